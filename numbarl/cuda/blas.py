"""Row-major GEMM with fused epilogues: cuBLASLt on the GPU, a tiled numba kernel elsewhere.

    C = act(alpha * op(A) @ op(B) + beta * C + bias)          # [M, N]
    op(A): [M, K] (A is [M, K], or [K, M] with trans_a)       op(B): [K, N] (B is [K, N], or [N, K] with trans_b)

All matrices are row-major numba device arrays (or 2-D views whose inner stride is one element,
e.g. ``arena["x"][:, 0:5]``), float32. Epilogues (each implemented in BOTH backends and tested):

    epilogue      what it adds                                     cuBLASLt epilogue
    None          nothing (bias may still be given)                DEFAULT / BIAS
    "relu"        max(t, 0) after bias                             RELU / RELU_BIAS
    "gelu"        tanh-approximate GELU after bias                 GELU / GELU_BIAS
    "gelu_aux"    GELU, and aux[M, N] <- t (the pre-activation)    GELU_AUX / GELU_AUX_BIAS
    "bgrad_b"     bias_grad[N] <- sum_k op(B)[k, n]                BGRADA (operands swap, see below)
    "bgrad_a"     bias_grad[M] <- sum_k op(A)[m, k]                BGRADB
    "bgrad"       alias of "bgrad_b"

where t = alpha * op(A) @ op(B) + beta * C + bias. GELU is the tanh form used by cuBLASLt,
gelu(t) = 0.5 t (1 + tanh(sqrt(2/pi) (t + 0.044715 t^3))). "bgrad" is the linear layer's
backward: with weights stored [in, out] (y = x @ W + b), ``gemm(x, dy, dW, trans_a=True,
epilogue="bgrad", bias_grad=db)`` gives dW = xᵀ·dy and db = colsum(dy) in one call.

cuBLASLt is column-major. A row-major [R, S] array with row stride ld is the column-major
[S, R] matrix with the same ld, so the row-major product C = op(A)·op(B) is computed as the
column-major product Cᵀ = op(B)ᵀ·op(A)ᵀ: cuBLASLt's "A" is our B and its "B" is our A, with the
same transpose flags. cuBLASLt's BGRADA (sum over k of its op(A), i.e. our op(B)ᵀ) is therefore
our "bgrad_b", and BGRADB is our "bgrad_a".

Plans. The first call with a given (shapes, leading dimensions, transposes, epilogue, compute,
pointer mode, pointer alignments) creates the matmul descriptor, the layouts and the heuristic
algorithm, and pins them in a dict: later calls (and graph replays) use exactly that algorithm,
so results are bitwise reproducible. Buffer pointers are not part of the key (they are passed per
call). The heuristic must not run while a stream is being captured: run the step once eagerly
first (``numbarl.cuda.graph.capture`` does) or call :func:`plan` up front; a plan first needed
inside a capture raises :class:`GemmPlanError`. When cuBLASLt has no fused BGRADA/BGRADB algorithm
for a geometry, that plan runs a plain GEMM plus :func:`colsum_kernel` (same numbers, one more
launch). One cuBLASLt handle per process. Workspace: ``WORKSPACE_BYTES`` (change it with
:func:`set_workspace_bytes` before the first GEMM), allocated once *per stream* on that stream's
first eager GEMM, so its address is fixed under capture and GEMMs on forked branch streams never
share scratch. (Two graphs captured on one stream share its workspace: replay them on one stream,
one after the other.)

Tuned algorithms. The heuristic's first algorithm is not always the fastest for a geometry (an
autotuner times the candidates, as XLA does). ``numbarl-bench gemm`` times the heuristic's first
candidates for every GEMM of the train and collect steps and writes a tuning file: per plan key,
the index of the fastest candidate in the heuristic's list. With ``NUMBARL_GEMM_TUNING=FILE`` (or
:func:`load_tuning`) a new plan takes that candidate instead of the first. The choice is a file,
not a timing made by each run, so two runs with the same file use the same algorithms and give
the same bits; a file written on another GPU model or cuBLASLt version is refused with one error.
:func:`tuning_info` says which file and how many plans it changed (run summaries record it).

alpha / beta. Python floats use host pointer mode: the values are read when the call is
enqueued, i.e. frozen into a graph at capture. For a scale that changes between replays pass
``alpha`` as a device float32[1] array (device pointer mode; beta is then read from a small
device constant owned by this module, created on the first eager call).

Backends (:func:`set_backend`, or ``NUMBARL_GEMM``): "cublaslt" is the GPU default, "host" (numpy
in float64) the simulator default. "kernel" runs under the simulator or on a GPU (to cross-check
cuBLASLt): the same call runs
:func:`gemm_tiled_kernel`, a shared-memory tiled GEMM (one thread per output element, TILE x TILE
outputs per block, the k loop in a fixed order: deterministic), plus :func:`colsum_kernel` for
bgrad; compute="tf32" is computed in fp32 there. The simulator spends ~1 s on a 32x64x64 GEMM
(every simulated thread is a Python thread), so simulator runs that call many GEMMs (whole
networks, tiny training runs) should use "host": the float64 reference, rounded once to float32,
written straight into the simulated device arrays.
"""

from __future__ import annotations

import math
import os

import numpy as np
from numba import float32, njit

from numbarl.cuda import runtime
from numbarl.cuda.runtime import cuda, simulator
from numbarl.cuda.runtime import stream as default_stream

_cuda = cuda()  # the backend (GPU or simulator), selected once

TILE = 16  # output tile edge of the fallback kernel: TILE x TILE threads per block
TILE_K = 64  # k extent staged per step; the simulator pays ~40 ms per syncthreads per block
SUM_BLOCK = 64  # threads per block of the bgrad row/column-sum kernels
WORKSPACE_BYTES = 32 << 20  # fixed cuBLASLt workspace (allocated once; Hopper kernels like >= 32 MiB)

EPILOGUES = ("relu", "gelu", "gelu_aux", "bgrad_a", "bgrad_b")
_ALIASES = {"bgrad": "bgrad_b", "none": None}
COMPUTES = ("fp32", "tf32")

# activation codes shared by the kernel and the reference
ACT_NONE = 0
ACT_RELU = 1
ACT_GELU = 2

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_HALF = np.float32(0.5)
_GELU_C = np.float32(math.sqrt(2.0 / math.pi))  # sqrt(2/pi)
_GELU_K = np.float32(0.044715)


# ---------------------------------------------------------------------------------------------
# reference (numpy float64)
# ---------------------------------------------------------------------------------------------
def gelu_ref(t):
    """tanh-approximate GELU in float64 (the form cuBLASLt's GELU epilogue uses)."""
    t = np.asarray(t, np.float64)
    return 0.5 * t * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (t + 0.044715 * t**3)))


def gemm_ref(A, B, C=None, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, bias=None, epilogue=None):
    """Reference of :func:`gemm` in float64. Returns (out [M, N], aux [M, N] pre-activation,
    bgrad_a [M] = row sums of op(A), bgrad_b [N] = column sums of op(B))."""
    epilogue = _ALIASES.get(epilogue, epilogue)
    a = np.asarray(A, np.float64)
    b = np.asarray(B, np.float64)
    a = a.T if trans_a else a
    b = b.T if trans_b else b
    t = float(alpha) * (a @ b)
    if beta != 0.0:
        t = t + float(beta) * np.asarray(C, np.float64)
    if bias is not None:
        t = t + np.asarray(bias, np.float64)[None, :]
    if epilogue == "relu":
        out = np.maximum(t, 0.0)
    elif epilogue in ("gelu", "gelu_aux"):
        out = gelu_ref(t)
    else:
        out = t
    return out, t, a.sum(axis=1), b.sum(axis=0)


# ---------------------------------------------------------------------------------------------
# device functions (shared by the kernel and host code)
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def gelu_dev(t):
    """tanh-approximate GELU in float32 (cuBLASLt's form)."""
    u = _GELU_C * (t + _GELU_K * t * t * t)
    return _HALF * t * (_ONE + math.tanh(u))


@njit(cache=True)
def activate_dev(t, act):
    if act == ACT_RELU:
        return t if t > _ZERO else _ZERO
    if act == ACT_GELU:
        return gelu_dev(t)
    return t


# ---------------------------------------------------------------------------------------------
# kernels (simulator backend and NUMBARL_GEMM=kernel)
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def gemm_tiled_kernel(A, B, C, trans_a, trans_b, scal, alpha_dev, use_alpha_dev, bias, has_bias, act, aux, store_aux):
    """One thread per C[row, col]; a [TILE, TILE_K] panel of op(A) and a [TILE_K, TILE] panel of
    op(B) are staged in shared memory per step of the k loop (each thread loads TILE_K / TILE
    elements of each), so a block synchronizes only 2 * ceil(K / TILE_K) times.

    scal = (alpha, beta) float32[2]; alpha_dev[0] replaces alpha when use_alpha_dev.
    grid = (ceil(N / TILE), ceil(M / TILE)), block = (TILE, TILE).
    """
    a_panel = _cuda.shared.array((TILE, TILE_K), float32)  # op(A)[row0:row0+TILE, k0:k0+TILE_K]
    b_panel = _cuda.shared.array((TILE_K, TILE), float32)  # op(B)[k0:k0+TILE_K, col0:col0+TILE]
    tx = _cuda.threadIdx.x
    ty = _cuda.threadIdx.y
    row0 = _cuda.blockIdx.y * TILE
    col0 = _cuda.blockIdx.x * TILE
    row = row0 + ty
    col = col0 + tx
    M = C.shape[0]
    N = C.shape[1]
    K = A.shape[0] if trans_a else A.shape[1]

    acc = float32(0.0)
    for k0 in range(0, K, TILE_K):
        for r in range(TILE_K // TILE):
            kk = r * TILE + tx  # a_panel[ty, kk] <- op(A)[row, k0 + kk]
            k = k0 + kk
            va = float32(0.0)
            if row < M and k < K:
                va = A[k, row] if trans_a else A[row, k]
            a_panel[ty, kk] = va
            kk = r * TILE + ty  # b_panel[kk, tx] <- op(B)[k0 + kk, col]
            k = k0 + kk
            vb = float32(0.0)
            if k < K and col < N:
                vb = B[col, k] if trans_b else B[k, col]
            b_panel[kk, tx] = vb
        _cuda.syncthreads()
        for j in range(min(TILE_K, K - k0)):  # fixed order: deterministic
            acc += a_panel[ty, j] * b_panel[j, tx]
        _cuda.syncthreads()

    if row >= M or col >= N:
        return
    alpha = alpha_dev[0] if use_alpha_dev else scal[0]
    beta = scal[1]
    t = alpha * acc
    if beta != _ZERO:  # beta == 0: C is not read (it may hold NaN), as in cuBLASLt
        t += beta * C[row, col]
    if has_bias:
        t += bias[col]
    if store_aux:
        aux[row, col] = t
    C[row, col] = activate_dev(t, act)


@_cuda.jit(cache=True)
def colsum_kernel(X, trans, out):
    """out[n] = sum_k op(X)[k, n], op(X) = X or Xᵀ; one thread per n, k in order."""
    n = _cuda.grid(1)
    if n >= out.shape[0]:
        return
    K = X.shape[1] if trans else X.shape[0]
    s = float32(0.0)
    for k in range(K):
        s += X[n, k] if trans else X[k, n]
    out[n] = s


# ---------------------------------------------------------------------------------------------
# argument checks and plan keys (both backends)
# ---------------------------------------------------------------------------------------------
def _canon_epilogue(epilogue):
    epilogue = _ALIASES.get(epilogue, epilogue)
    if epilogue is not None and epilogue not in EPILOGUES:
        raise ValueError(f"gemm: unknown epilogue {epilogue!r}; choose None or one of {EPILOGUES + tuple(_ALIASES)}")
    return epilogue


def _matrix(name, x):
    """(rows, cols, ld in elements) of a row-major float32 matrix with unit inner stride."""
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 2:
        raise ValueError(f"gemm: {name} must be a 2-D device array, got shape {shape}")
    if np.dtype(x.dtype) != np.float32:
        raise TypeError(f"gemm: {name} must be float32, got {x.dtype}")
    rows, cols = int(shape[0]), int(shape[1])
    s0, s1 = (int(s) for s in x.strides)
    if cols > 1 and s1 != 4:
        raise ValueError(
            f"gemm: {name} must have unit inner stride (a row-major matrix or a column slice of one); "
            f"strides are {x.strides} bytes. Copy it to a contiguous buffer first."
        )
    ld = s0 // 4 if rows > 1 else max(cols, 1)
    if s0 % 4 or ld < cols:
        raise ValueError(f"gemm: {name} has row stride {s0} bytes, smaller than a row of {cols} float32")
    return rows, cols, max(ld, 1)


def _vector(name, x, n):
    shape = tuple(getattr(x, "shape", ()))
    if shape != (n,):
        raise ValueError(f"gemm: {name} must be a float32 device vector of shape ({n},), got {shape}")
    if np.dtype(x.dtype) != np.float32:
        raise TypeError(f"gemm: {name} must be float32, got {x.dtype}")
    if n > 1 and int(x.strides[0]) != 4:
        raise ValueError(f"gemm: {name} must be contiguous, strides {x.strides}")


def _is_device_scalar(x) -> bool:
    return hasattr(x, "shape") and not np.isscalar(x)


def _check(A, B, C, trans_a, trans_b, alpha, beta, bias, epilogue, aux, bias_grad, compute):
    """Validate a gemm call; returns the geometry (M, N, K, lda, ldb, ldc, ldaux)."""
    if compute not in COMPUTES:
        raise ValueError(f"gemm: compute must be one of {COMPUTES}, got {compute!r}")
    ra, ca, lda = _matrix("A", A)
    rb, cb, ldb = _matrix("B", B)
    M, N, ldc = _matrix("C", C)
    Ma, Ka = (ca, ra) if trans_a else (ra, ca)
    Kb, Nb = (cb, rb) if trans_b else (rb, cb)
    if Ma != M or Nb != N or Ka != Kb:
        raise ValueError(
            f"gemm: shapes do not chain: op(A) is [{Ma}, {Ka}] (A {tuple(A.shape)}, trans_a={trans_a}), "
            f"op(B) is [{Kb}, {Nb}] (B {tuple(B.shape)}, trans_b={trans_b}), C is [{M}, {N}]"
        )
    if min(M, N, Ka) < 1:
        raise ValueError(f"gemm: empty product M={M} N={N} K={Ka}")
    if bias is not None:
        if epilogue in ("bgrad_a", "bgrad_b"):
            raise ValueError("gemm: bias cannot be combined with a bgrad epilogue (cuBLASLt has no such epilogue)")
        _vector("bias", bias, N)
    ldaux = 0
    if epilogue == "gelu_aux":
        if aux is None:
            raise ValueError("gemm: epilogue 'gelu_aux' needs aux, a float32 [M, N] device array")
        ra_, ca_, ldaux = _matrix("aux", aux)
        if (ra_, ca_) != (M, N):
            raise ValueError(f"gemm: aux must be [{M}, {N}], got {tuple(aux.shape)}")
        if ldaux % 8:
            raise ValueError(
                f"gemm: aux row stride is {ldaux} floats; cuBLASLt's GELU_AUX needs a multiple of 8. "
                "Allocate aux with padded rows (e.g. [M, ceil(N/8)*8]) and pass the [:, :N] view."
            )
    elif aux is not None:
        raise ValueError(f"gemm: aux is only written by epilogue 'gelu_aux' (epilogue is {epilogue!r})")
    if epilogue in ("bgrad_a", "bgrad_b"):
        if bias_grad is None:
            raise ValueError(f"gemm: epilogue {epilogue!r} needs bias_grad, a float32 device vector")
        _vector("bias_grad", bias_grad, M if epilogue == "bgrad_a" else N)
    elif bias_grad is not None:
        raise ValueError(f"gemm: bias_grad is only written by a bgrad epilogue (epilogue is {epilogue!r})")
    if _is_device_scalar(alpha):
        if tuple(alpha.shape) != (1,) or np.dtype(alpha.dtype) != np.float32:
            raise ValueError(f"gemm: a device alpha must be a float32 array of shape (1,), got {alpha.dtype} {alpha.shape}")
    if _is_device_scalar(beta):
        raise TypeError("gemm: beta must be a Python float (device-pointer beta is not supported)")
    return M, N, Ka, lda, ldb, ldc, ldaux


# ---------------------------------------------------------------------------------------------
# kernel backend
# ---------------------------------------------------------------------------------------------
_DUMMY = {}


def _dummy(ndim):
    """Placeholder device arrays for unused kernel arguments (allocated on the first eager call)."""
    d = _DUMMY.get(ndim)
    if d is None:
        d = _cuda.device_array((1,) * ndim, dtype=np.float32)
        _DUMMY[ndim] = d
    return d


_SCAL = {}


def _scalars(alpha, beta):
    """(alpha, beta) as a float32[2] array for the kernel. Under the simulator a host array is
    passed directly; on a GPU the pair is cached per value so that no copy happens after the
    first (eager) call with those values."""
    key = (float(alpha), float(beta))
    host = np.array(key, dtype=np.float32)
    if simulator():
        return host
    d = _SCAL.get(key)
    if d is None:
        d = runtime.upload(host)
        _SCAL[key] = d
    return d


def _gemm_kernel_path(A, B, C, trans_a, trans_b, alpha, beta, bias, epilogue, aux, bias_grad, s, M, N):
    if epilogue in ("bgrad_a", "bgrad_b"):
        # bias-gradient first: B (or A) may alias nothing else, and C is written after
        if epilogue == "bgrad_b":
            colsum_kernel[(N + SUM_BLOCK - 1) // SUM_BLOCK, SUM_BLOCK, s](B, bool(trans_b), bias_grad)
        else:  # row sums of op(A) = column sums of op(A)ᵀ
            colsum_kernel[(M + SUM_BLOCK - 1) // SUM_BLOCK, SUM_BLOCK, s](A, not trans_a, bias_grad)
    act = {"relu": ACT_RELU, "gelu": ACT_GELU, "gelu_aux": ACT_GELU}.get(epilogue, ACT_NONE)
    device_alpha = _is_device_scalar(alpha)
    scal = _scalars(0.0 if device_alpha else alpha, beta)
    grid = ((N + TILE - 1) // TILE, (M + TILE - 1) // TILE)
    gemm_tiled_kernel[grid, (TILE, TILE), s](
        A, B, C, bool(trans_a), bool(trans_b), scal,
        alpha if device_alpha else _dummy(1), device_alpha,
        bias if bias is not None else _dummy(1), bias is not None, np.int32(act),
        aux if aux is not None else _dummy(2), aux is not None,
    )


def _host_view(x):
    """The numpy array behind a simulator device array (writes go straight to it)."""
    return x._ary if hasattr(x, "_ary") else np.asarray(x)


def _gemm_host_path(A, B, C, trans_a, trans_b, alpha, beta, bias, epilogue, aux, bias_grad):
    """Simulator-only fast path: the reference in float64, rounded once to float32 (deterministic)."""
    a, b, c = _host_view(A), _host_view(B), _host_view(C)
    alpha_v = float(_host_view(alpha)[0]) if _is_device_scalar(alpha) else float(alpha)
    out, pre, sum_a, sum_b = gemm_ref(
        a, b, c if beta != 0.0 else None, trans_a, trans_b, alpha_v, beta,
        None if bias is None else _host_view(bias), epilogue,
    )
    if epilogue == "bgrad_a":
        _host_view(bias_grad)[...] = sum_a
    elif epilogue == "bgrad_b":
        _host_view(bias_grad)[...] = sum_b
    if aux is not None:
        _host_view(aux)[...] = pre
    c[...] = out


# ---------------------------------------------------------------------------------------------
# cuBLASLt backend
# ---------------------------------------------------------------------------------------------
CUDA_R_32F = 0
CUBLAS_COMPUTE_32F = 68
CUBLAS_COMPUTE_32F_FAST_TF32 = 77
_COMPUTE_TYPES = {"fp32": CUBLAS_COMPUTE_32F, "tf32": CUBLAS_COMPUTE_32F_FAST_TF32}
_OP_N, _OP_T = 0, 1  # cublasOperation_t
_MAX_ALIGN = 256


class GemmPlanError(RuntimeError):
    """cuBLASLt could not plan or run a GEMM (no algorithm, bad layout, planning during capture)."""


class GemmTuningError(GemmPlanError):
    """A GEMM tuning file does not fit this machine or this plan (never answered by a fallback)."""


class _Lt:
    """Process-wide cuBLASLt state: the handle, per-stream workspaces, device constants."""

    handle = 0
    workspaces: dict = {}
    constants: dict = {}


def set_workspace_bytes(nbytes: int) -> None:
    """Size of the fixed cuBLASLt workspace (per stream). Only before the first cuBLASLt GEMM:
    plans chose their algorithm for the old size and captured graphs hold its address."""
    global WORKSPACE_BYTES
    if _Lt.workspaces:
        raise RuntimeError("set_workspace_bytes: workspaces already exist; call it before the first GEMM")
    if nbytes < 0:
        raise ValueError(f"workspace size must be >= 0, got {nbytes}")
    WORKSPACE_BYTES = int(nbytes)


class _Tuning:
    """The loaded tuning file (load_tuning / NUMBARL_GEMM_TUNING): {plan key: candidate index}."""

    path = None
    indices: dict = {}
    applied = 0  # plans created with a tuned (non-first) candidate
    checked = False  # NUMBARL_GEMM_TUNING looked at


def plan_key_text(key) -> str:
    """A plan key as the tuning file writes it."""
    return repr(tuple(key))


def tuning_identity() -> dict:
    """What a tuning file must have been written on: the GPU model, the cuBLASLt version and the
    workspace size (the heuristic's candidate list depends on all three)."""
    from numbarl.cuda.runtime import device_name

    lt = _lt()
    return {"device": device_name(), "cublaslt_version": int(lt.get_version()), "workspace_bytes": WORKSPACE_BYTES}


def algo_text(result) -> str:
    """The algorithm of one heuristic result (its `algo` bytes, hex): what a tuning file pins."""
    return bytes(np.asarray(result["algo"]).tobytes()).hex()


def load_tuning(path) -> int:
    """Use the tuned candidates of `path` (written by ``numbarl-bench gemm --write-tuning``) for
    the plans created from now on; returns how many keys it holds. One clear error (GemmPlanError)
    for a missing or malformed file or one written on another GPU model / cuBLASLt version."""
    import json

    if _PLANS:
        raise GemmTuningError(f"load_tuning({path}): {len(_PLANS)} cuBLASLt plans already exist; load the "
                              "tuning before the first GEMM")
    try:
        with open(path) as f:
            doc = json.load(f)
        identity, plans = doc["identity"], doc["plans"]
        indices = {str(k): (int(v["index"]), v.get("algo")) for k, v in plans.items()}
    except FileNotFoundError:
        raise GemmTuningError(f"GEMM tuning file {path}: not found") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise GemmTuningError(f"GEMM tuning file {path}: not a numbarl-bench gemm tuning file ({e})") from None
    here = tuning_identity()
    if identity != here:
        raise GemmTuningError(f"GEMM tuning file {path} was written for {identity}, this machine is {here}: "
                              "re-run numbarl-bench gemm --write-tuning here")
    if any(i < 0 for i, _ in indices.values()):
        raise GemmTuningError(f"GEMM tuning file {path}: negative candidate index")
    _Tuning.path, _Tuning.indices, _Tuning.applied, _Tuning.checked = str(path), indices, 0, True
    return len(indices)


def clear_tuning() -> None:
    """Back to the heuristic's first candidate for plans created from now on."""
    _Tuning.path, _Tuning.indices, _Tuning.applied, _Tuning.checked = None, {}, 0, True


def tuning_info() -> dict:
    """{"file": path or None, "keys": entries in it, "applied": plans that took a tuned candidate}."""
    return {"file": _Tuning.path, "keys": len(_Tuning.indices), "applied": _Tuning.applied}


def _tuned(key) -> tuple:
    """(candidate index, its pinned algo hex or None) of a plan key: (0, None) without a tuning."""
    if not _Tuning.checked:
        path = os.environ.get("NUMBARL_GEMM_TUNING")
        if path:
            load_tuning(path)  # an error here stays an error at every later plan, never a silent default
        _Tuning.checked = True
    return _Tuning.indices.get(plan_key_text(key), (0, None))


def _lt():
    import nvmath.bindings.cublasLt as lt

    if not _Lt.handle:
        _cuda.current_context()  # cuBLASLt binds to the current (primary) context
        _Lt.handle = lt.create()
    return lt


def _pointer(x) -> int:
    return int(x.__cuda_array_interface__["data"][0])


def _alignment(ptr: int) -> int:
    """Largest power of two (<= 256) dividing ptr: tells the heuristic which vector widths are legal."""
    return _MAX_ALIGN if ptr % _MAX_ALIGN == 0 else ptr & -ptr


def _capturing(stream_int: int) -> bool:
    from cuda.bindings import driver

    err, status = driver.cuStreamIsCapturing(driver.CUstream(stream_int))
    return err == driver.CUresult.CUDA_SUCCESS and status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


def _workspace(stream_int: int):
    """(pointer, bytes) of the fixed workspace of this stream. One per stream so that GEMMs on
    forked branch streams never share scratch memory; allocated on the first eager call."""
    ws = _Lt.workspaces.get(stream_int)
    if ws is None:
        if stream_int and _capturing(stream_int):
            raise GemmPlanError(
                "gemm: the first cuBLASLt GEMM on this stream happens inside a graph capture, which "
                "would allocate its workspace there; run the step eagerly once before capturing"
            )
        ws = _cuda.device_array(max(WORKSPACE_BYTES, 1), dtype=np.uint8)
        _Lt.workspaces[stream_int] = ws
    return (_pointer(ws) if WORKSPACE_BYTES else 0), WORKSPACE_BYTES


def _device_constant(value: float):
    """A device float32[1] holding `value` (beta in device pointer mode), made once per value."""
    d = _Lt.constants.get(float(value))
    if d is None:
        d = runtime.upload(np.array([value], np.float32))
        _Lt.constants[float(value)] = d
    return d


class Plan:
    """A pinned cuBLASLt matmul: descriptor, layouts and one heuristic algorithm for one geometry.

    Created once per key by :func:`plan` / the first :func:`gemm`; every later call with the same
    key (shapes, leading dimensions, transposes, epilogue, compute, pointer mode, alignments)
    reuses the same algorithm, so results are bitwise reproducible run to run.
    """

    def __init__(self, key, lt, handle, bias_ptr=0, aux_ptr=0, fuse_bgrad=True):
        (M, N, K, lda, ldb, ldc, ldaux, trans_a, trans_b, epilogue, has_bias, compute,
         device_alpha, beta_dev, *_alignments) = key  # the alignments: `candidates`
        tuned, pinned = _tuned(key)  # before any descriptor exists (a bad file raises here)
        self.key = key
        # bgrad epilogues: fused into the GEMM (BGRADA/BGRADB) when cuBLASLt has an algorithm
        # for this geometry, else a plain GEMM plus colsum_kernel (same result, one more launch)
        self.bgrad_separate = epilogue in ("bgrad_a", "bgrad_b") and not fuse_bgrad
        if self.bgrad_separate:
            epilogue = None
        self.M, self.N, self.K = M, N, K
        self._lt = lt
        self.desc = lt.matmul_desc_create(_COMPUTE_TYPES[compute], CUDA_R_32F)
        self.layouts = []
        self.beta_device = _device_constant(beta_dev) if device_alpha else None

        # Row-major C = op(A) op(B)  <=>  column-major Cᵀ = op(B)ᵀ op(A)ᵀ: cuBLASLt's "A" is our
        # B and its "B" is our A; a row-major [r, c] array with row stride ld is the col-major
        # [c, r] matrix with the same ld.
        lt_transa = _OP_T if trans_b else _OP_N
        lt_transb = _OP_T if trans_a else _OP_N
        # cuBLASLt A := our B, stored col-major as [N, K] (op N) or, with trans_b, [K, N] (op T)
        la = self._layout(K, N, ldb) if trans_b else self._layout(N, K, ldb)
        if epilogue == "bgrad_a" and not trans_a:
            # BGRADB wants op T on its B operand (nvmath-python transposes B for it too): our
            # row-major A [M, K] is a ROW-order [M, K] matrix X with Xᵀ = op(A)ᵀ.
            lb = self._layout(M, K, lda, order_row=True)
            lt_transb = _OP_T
        else:
            # cuBLASLt B := our A, stored col-major as [K, M] (op N) or, with trans_a, [M, K] (op T)
            lb = self._layout(M, K, lda) if trans_a else self._layout(K, M, lda)
        lc = self._layout(N, M, ldc)
        self.a_layout, self.b_layout, self.c_layout = la, lb, lc

        self._set(lt.MatmulDescAttribute.TRANSA, np.int32(lt_transa))
        self._set(lt.MatmulDescAttribute.TRANSB, np.int32(lt_transb))
        if device_alpha:
            self._set(lt.MatmulDescAttribute.POINTER_MODE, np.int32(int(lt.PointerMode.DEVICE)))
        self.epilogue_value = self._epilogue_enum(lt, epilogue, has_bias)
        self._set(lt.MatmulDescAttribute.EPILOGUE, np.uint32(self.epilogue_value))
        if epilogue == "gelu_aux":
            # aux is column-major like D (our row-major [M, ldaux]) in D's type, float32
            self._set(lt.MatmulDescAttribute.EPILOGUE_AUX_LD, np.int64(ldaux))
            # the heuristic rejects a null aux pointer; run() sets the real one per call
            self._set(lt.MatmulDescAttribute.EPILOGUE_AUX_POINTER, np.int64(aux_ptr or _MAX_ALIGN))
        if has_bias:
            self._set(lt.MatmulDescAttribute.BIAS_POINTER, np.int64(bias_ptr or _MAX_ALIGN))

        try:
            found = self.candidates(tuned + 1)
        except GemmPlanError:
            self.destroy()
            raise
        if len(found) < 1:
            self.destroy()
            raise GemmPlanError(f"cuBLASLt found no algorithm for {self.describe()}")
        if tuned >= len(found):
            self.destroy()
            raise GemmTuningError(f"GEMM tuning file {_Tuning.path}: candidate {tuned} of {self.describe()} does "
                                  f"not exist here (the heuristic offers {len(found)})")
        if pinned is not None and algo_text(found[tuned]) != pinned:
            self.destroy()
            raise GemmTuningError(f"GEMM tuning file {_Tuning.path}: candidate {tuned} of {self.describe()} is not "
                                  "the algorithm the file pinned (the heuristic's list changed): re-run "
                                  "numbarl-bench gemm --write-tuning here")
        self.use_candidate(found, tuned)
        _Tuning.applied += tuned > 0

    def candidates(self, n: int):
        """The heuristic's first n algorithms for this plan (fewer if it has fewer), best-ranked
        first: a numpy array of matmul_heuristic_result_dtype (workspace ≤ WORKSPACE_BYTES, the
        key's pointer alignments)."""
        lt = self._lt
        align_a, align_b, align_c = self.key[14:17]
        results = np.zeros(max(1, int(n)), dtype=lt.matmul_heuristic_result_dtype)
        count = np.zeros(1, dtype=np.int32)
        pref = lt.matmul_preference_create()
        try:
            self._pref_set(pref, lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, np.uint64(WORKSPACE_BYTES))
            # our B is cuBLASLt's A, our A its B; C and D are the same buffer
            self._pref_set(pref, lt.MatmulPreferenceAttribute.MIN_ALIGNMENT_A_BYTES, np.uint32(align_b))
            self._pref_set(pref, lt.MatmulPreferenceAttribute.MIN_ALIGNMENT_B_BYTES, np.uint32(align_a))
            self._pref_set(pref, lt.MatmulPreferenceAttribute.MIN_ALIGNMENT_C_BYTES, np.uint32(align_c))
            self._pref_set(pref, lt.MatmulPreferenceAttribute.MIN_ALIGNMENT_D_BYTES, np.uint32(align_c))
            lt.matmul_algo_get_heuristic(_Lt.handle, self.desc, self.a_layout, self.b_layout, self.c_layout,
                                         self.c_layout, pref, len(results), results.ctypes.data, count.ctypes.data)
        except lt.cuBLASLtError as e:
            raise GemmPlanError(f"cuBLASLt found no algorithm for {self.describe()}: {e}") from None
        finally:
            lt.matmul_preference_destroy(pref)
        return results[: int(count[0])].copy()

    def use_candidate(self, found, index: int) -> None:
        """Run with candidate `index` of `candidates(...)`'s result from now on (before any capture
        that holds this plan: a captured graph keeps the algorithm it was captured with)."""
        self.heuristic = found[index : index + 1].copy()
        self.algo_index = int(index)
        self.algo_ptr = self.heuristic.ctypes.data  # the algo is the struct's first field
        self.workspace_needed = int(self.heuristic["workspace_size"][0])

    def destroy(self):
        """Free the descriptor and layouts (plans normally live as long as the process)."""
        for layout in self.layouts:
            self._lt.matrix_layout_destroy(layout)
        self.layouts = []
        if self.desc:
            self._lt.matmul_desc_destroy(self.desc)
            self.desc = 0

    # -- helpers ----------------------------------------------------------------------------
    def _layout(self, rows, cols, ld, order_row=False):
        lt = self._lt
        layout = lt.matrix_layout_create(CUDA_R_32F, rows, cols, ld)
        self.layouts.append(layout)
        if order_row:
            order = np.array([int(lt.Order.ROW)], dtype=np.int32)
            lt.matrix_layout_set_attribute(layout, lt.MatrixLayoutAttribute.ORDER, order.ctypes.data, order.nbytes)
        return layout

    def _set(self, attr, value):
        value = np.asarray(value)
        self._lt.matmul_desc_set_attribute(self.desc, attr, value.ctypes.data, value.nbytes)

    def _pref_set(self, pref, attr, value):
        value = np.asarray(value)
        self._lt.matmul_preference_set_attribute(pref, attr, value.ctypes.data, value.nbytes)

    @staticmethod
    def _epilogue_enum(lt, epilogue, has_bias):
        E = lt.Epilogue
        if epilogue is None:
            return int(E.BIAS if has_bias else E.DEFAULT)
        if epilogue == "relu":
            return int(E.RELU_BIAS if has_bias else E.RELU)
        if epilogue == "gelu":
            return int(E.GELU_BIAS if has_bias else E.GELU)
        if epilogue == "gelu_aux":
            return int(E.GELU_AUX_BIAS if has_bias else E.GELU_AUX)
        if epilogue == "bgrad_b":  # column sums of our op(B) = cuBLASLt's op(A) summed over k
            return int(E.BGRADA)
        if epilogue == "bgrad_a":
            return int(E.BGRADB)
        raise ValueError(epilogue)

    def describe(self) -> str:
        (M, N, K, lda, ldb, ldc, ldaux, ta, tb, ep, bias, compute, dev_alpha, _, aa, ab, ac) = self.key
        return (f"C[{M}x{N}] = op(A)[{M}x{K}] op(B)[{K}x{N}] (trans_a={ta}, trans_b={tb}, lda={lda}, "
                f"ldb={ldb}, ldc={ldc}, epilogue={ep}, bias={bias}, compute={compute}, "
                f"device_alpha={dev_alpha}, alignments A/B/C={aa}/{ab}/{ac} bytes)")

    # -- run --------------------------------------------------------------------------------
    def run(self, A, B, C, alpha, beta, bias, aux, bias_grad, s, stream_int):
        lt = self._lt
        if self.bgrad_separate:
            epilogue = self.key[9]
            if epilogue == "bgrad_b":
                colsum_kernel[(self.N + SUM_BLOCK - 1) // SUM_BLOCK, SUM_BLOCK, s](B, bool(self.key[8]), bias_grad)
            else:
                colsum_kernel[(self.M + SUM_BLOCK - 1) // SUM_BLOCK, SUM_BLOCK, s](A, not self.key[7], bias_grad)
            bias_grad = None
        if bias is not None:
            self._set(lt.MatmulDescAttribute.BIAS_POINTER, np.int64(_pointer(bias)))
        elif bias_grad is not None:
            self._set(lt.MatmulDescAttribute.BIAS_POINTER, np.int64(_pointer(bias_grad)))
        if aux is not None:
            self._set(lt.MatmulDescAttribute.EPILOGUE_AUX_POINTER, np.int64(_pointer(aux)))
        if self.beta_device is not None:
            alpha_ptr, beta_ptr, keep = _pointer(alpha), _pointer(self.beta_device), None
        else:
            keep = np.array([alpha, beta], dtype=np.float32)  # host pointer mode: read at enqueue
            alpha_ptr, beta_ptr = keep.ctypes.data, keep.ctypes.data + 4
        ws_ptr, ws_bytes = _workspace(stream_int)
        c_ptr = _pointer(C)
        try:
            lt.matmul(_Lt.handle, self.desc, alpha_ptr, _pointer(B), self.a_layout, _pointer(A), self.b_layout,
                      beta_ptr, c_ptr, self.c_layout, c_ptr, self.c_layout, self.algo_ptr, ws_ptr, ws_bytes,
                      stream_int)
        except lt.cuBLASLtError as e:
            raise GemmPlanError(f"cublasLtMatmul failed for {self.describe()}: {e}") from None
        del keep


_PLANS: dict = {}


def _plan_key(A, B, C, trans_a, trans_b, alpha, beta, bias, epilogue, aux, bias_grad, compute, geometry):
    M, N, K, lda, ldb, ldc, ldaux = geometry
    align_c = _alignment(_pointer(C))
    if aux is not None:
        align_c = min(align_c, _alignment(_pointer(aux)))
    device_alpha = _is_device_scalar(alpha)
    return (M, N, K, lda, ldb, ldc, ldaux, bool(trans_a), bool(trans_b), epilogue, bias is not None, compute,
            device_alpha, float(beta) if device_alpha else None,
            _alignment(_pointer(A)), _alignment(_pointer(B)), align_c)


def _get_plan(key, stream_int, bias=None, aux=None):
    p = _PLANS.get(key)
    if p is None:
        lt = _lt()
        if stream_int and _capturing(stream_int):
            raise GemmPlanError(
                "gemm: a new cuBLASLt plan was needed inside a graph capture (its heuristic and "
                "workspace must exist before capture); run the step eagerly once first, or call "
                "blas.plan(...) with the same arguments. Call: "
                f"M,N,K={key[:3]} trans_a={key[7]} trans_b={key[8]} epilogue={key[9]} compute={key[11]}"
            )
        ptrs = {"bias_ptr": 0 if bias is None else _pointer(bias), "aux_ptr": 0 if aux is None else _pointer(aux)}
        try:
            p = Plan(key, lt, _Lt.handle, **ptrs)
        except GemmTuningError:
            raise
        except GemmPlanError:
            if key[9] not in ("bgrad_a", "bgrad_b"):
                raise
            p = Plan(key, lt, _Lt.handle, fuse_bgrad=False, **ptrs)
        _PLANS[key] = p
    return p


def _gemm_cublaslt(A, B, C, trans_a, trans_b, alpha, beta, bias, epilogue, aux, bias_grad, compute, s, geometry):
    from numbarl.cuda.runtime import stream_handle

    stream_int = stream_handle(s)
    key = _plan_key(A, B, C, trans_a, trans_b, alpha, beta, bias, epilogue, aux, bias_grad, compute, geometry)
    _get_plan(key, stream_int, bias, aux).run(A, B, C, alpha, beta, bias, aux, bias_grad, s, stream_int)


# ---------------------------------------------------------------------------------------------
# backend switch
# ---------------------------------------------------------------------------------------------
BACKENDS = ("cublaslt", "kernel", "host")
_BACKEND = None


def set_backend(name: str | None) -> None:
    """Choose the GEMM backend for this process (None: the default).

    "cublaslt": the GPU default. "host": the simulator default, numpy in float64 (simulator only;
    whole networks and tiny training runs call many GEMMs, and the simulated kernel costs ~1 s
    per call). "kernel": the tiled numba kernel, under the simulator (to debug it) or on a GPU
    (to cross-check cuBLASLt). Also settable with NUMBARL_GEMM=cublaslt|kernel|host.
    """
    global _BACKEND
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown GEMM backend {name!r}; choose one of {BACKENDS}")
    if name == "host" and not simulator():
        raise ValueError("the 'host' GEMM backend only exists under the simulator (it reads device memory directly)")
    if name == "cublaslt" and simulator():
        raise ValueError("cuBLASLt needs a GPU; under the simulator use 'kernel' or 'host'")
    _BACKEND = name


def backend() -> str:
    """The GEMM backend in use: set_backend(), else NUMBARL_GEMM, else cublaslt (GPU) / host (simulator).

    Under the simulator the default is "host" (numpy, float64 accumulate, rounded once): a
    simulated tiled-GEMM launch costs ~1 s even at 32x64x64, which would make a tiny training run
    take an hour. The tiled "kernel" backend stays available (NUMBARL_GEMM=kernel) and is tested
    against numpy in tests/cuda/test_blas.py.
    """
    if _BACKEND is not None:
        return _BACKEND
    env = os.environ.get("NUMBARL_GEMM", "").strip().lower()
    if env:
        usable = ("kernel", "host") if simulator() else ("cublaslt", "kernel")
        if env not in usable:
            raise ValueError(f"NUMBARL_GEMM={env!r} is not usable on this backend; choose one of {usable}")
        return env
    return "host" if simulator() else "cublaslt"


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------
def gemm(A, B, C, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, bias=None, epilogue=None,
         aux=None, bias_grad=None, compute="fp32", stream=None):
    """C = act(alpha * op(A) @ op(B) + beta * C + bias), row-major, enqueued on `stream`.

    A, B, C: float32 device arrays (unit inner stride). bias: float32 [N] or None.
    epilogue: None, "relu", "gelu", "gelu_aux" (needs aux [M, N], row stride a multiple of 8),
    "bgrad_b"/"bgrad" (bias_grad [N] = column sums of op(B)), "bgrad_a" (bias_grad [M] = row sums
    of op(A)). alpha: float (fixed at graph capture) or device float32[1] (read at run time).
    compute: "fp32" or "tf32". No allocation, copy or sync after the first call of a plan.
    """
    epilogue = _canon_epilogue(epilogue)
    M, N, K, lda, ldb, ldc, ldaux = _check(A, B, C, trans_a, trans_b, alpha, beta, bias, epilogue, aux, bias_grad, compute)
    s = default_stream() if stream is None else stream
    which = backend()
    if which == "kernel":
        _gemm_kernel_path(A, B, C, trans_a, trans_b, alpha, beta, bias, epilogue, aux, bias_grad, s, M, N)
        return
    if which == "host":
        _gemm_host_path(A, B, C, trans_a, trans_b, alpha, beta, bias, epilogue, aux, bias_grad)
        return
    _gemm_cublaslt(A, B, C, trans_a, trans_b, alpha, beta, bias, epilogue, aux, bias_grad, compute, s,
                   (M, N, K, lda, ldb, ldc, ldaux))


def plan(A, B, C, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, bias=None, epilogue=None,
         aux=None, bias_grad=None, compute="fp32", stream=None):
    """Validate a gemm call and create its cuBLASLt plan (and the stream's workspace) now,
    without running it. Same arguments as :func:`gemm`. Returns the :class:`Plan`, or None on
    the kernel / host backends (which need no plan)."""
    epilogue = _canon_epilogue(epilogue)
    geometry = _check(A, B, C, trans_a, trans_b, alpha, beta, bias, epilogue, aux, bias_grad, compute)
    if backend() != "cublaslt":
        return None
    from numbarl.cuda.runtime import stream_handle

    stream_int = stream_handle(default_stream() if stream is None else stream)
    key = _plan_key(A, B, C, trans_a, trans_b, alpha, beta, bias, epilogue, aux, bias_grad, compute, geometry)
    p = _get_plan(key, stream_int, bias, aux)
    _workspace(stream_int)
    return p


def plan_count() -> int:
    """Number of pinned cuBLASLt plans (tests check that replays create none)."""
    return len(_PLANS)
