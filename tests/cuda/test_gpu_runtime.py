"""GPU-only checks of the device runtime (run with ``pytest -m gpu tests/cuda/test_gpu_runtime.py``).

cuBLASLt GEMM vs float64 numpy (all transposes, odd shapes, every epilogue, strided views,
device alpha), graph replay == eager bitwise for a step mixing GEMMs, numba kernels, RNG, a
reduction and a fork/join, bitwise determinism across two processes, and captures that break
(allocation, host copy, sync, legacy stream, unjoined fork, GEMM planned inside capture) failing
with a clear GraphCaptureError while the stream stays usable.
"""

import hashlib
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from numbarl.cuda.runtime import cuda, stream  # selects the backend before numba is imported

from numbarl.cuda import blas, graph, rng  # noqa: E402
from numbarl.cuda.mapped import MappedBuffer  # noqa: E402

pytestmark = pytest.mark.gpu
_cuda = cuda()
BLOCK = 128
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)
SHAPES = ((1, 1, 1), (5, 23, 7), (37, 129, 65), (1000, 77, 513), (4097, 300, 129))


# ---------------------------------------------------------------------------------------------
# helper kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def mix_kernel(y, seed, counter, x):
    """x[r, c] = 0.5 * y[r, c] + uniform(seed, lane=r*C+c, counter[0]) - 0.5."""
    i = _cuda.grid(1)
    n_cols = y.shape[1]
    if i >= y.shape[0] * n_cols:
        return
    r = i // n_cols
    c = i - r * n_cols
    x[r, c] = _HALF * y[r, c] + rng.uniform(seed, i, counter[0], 0) - _HALF


@_cuda.jit(cache=True)
def axpy2d_kernel(w, a, g):
    """w += a * g over a 2-D array (a is a float32 scalar)."""
    i = _cuda.grid(1)
    n_cols = w.shape[1]
    if i >= w.shape[0] * n_cols:
        return
    r = i // n_cols
    c = i - r * n_cols
    w[r, c] += a * g[r, c]


@_cuda.jit(cache=True)
def axpy1d_kernel(w, a, g):
    i = _cuda.grid(1)
    if i >= w.shape[0]:
        return
    w[i] += a * g[i]


@_cuda.jit(cache=True)
def sum_rows_kernel(x, out, at):
    """out[at] = sum of x in row-major order, one thread (fallback when numbarl.cuda.reduce is absent)."""
    if _cuda.grid(1) != 0:
        return
    s = np.float32(0.0)
    for r in range(x.shape[0]):
        for c in range(x.shape[1]):
            s += x[r, c]
    out[at] = s


@_cuda.jit(cache=True)
def tick_kernel(x):
    i = _cuda.grid(1)
    if i >= x.shape[0]:
        return
    x[i] += _ONE


def _grid(n):
    return (n + BLOCK - 1) // BLOCK


def _close(got, ref, atol, rtol):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    err = np.abs(got - ref)
    bad = err > atol + rtol * np.abs(ref)
    assert not bad.any(), f"{bad.sum()} of {bad.size} mismatch, max err {err.max():.3e}"


def _tol(compute, K):
    # fp32: rounding of K products of N(0,1) numbers grows like sqrt(K); TF32 keeps 10 mantissa bits
    return (1e-5 * math.sqrt(K), 1e-5) if compute == "fp32" else (4e-3 * math.sqrt(K), 4e-3)


# ---------------------------------------------------------------------------------------------
# cuBLASLt GEMM vs numpy
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compute", ["fp32", "tf32"])
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_cublaslt_transposes_odd_shapes(rng, compute, M, K, N):
    assert blas.backend() == "cublaslt"
    s = stream()
    for ta in (False, True):
        for tb in (False, True):
            A = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
            B = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
            C = rng.standard_normal((M, N)).astype(np.float32)
            alpha, beta = float(rng.uniform(-2, 2)), float(rng.uniform(-1, 1))
            dC = _cuda.to_device(C, stream=s)
            blas.gemm(_cuda.to_device(A, stream=s), _cuda.to_device(B, stream=s), dC, ta, tb, alpha, beta,
                      compute=compute, stream=s)
            got = dC.copy_to_host(stream=s)
            s.synchronize()
            atol, rtol = _tol(compute, K)
            _close(got, blas.gemm_ref(A, B, C, ta, tb, alpha, beta)[0], atol * 2, rtol)


@pytest.mark.parametrize("epilogue", [None, "relu", "gelu", "gelu_aux", "bgrad_a", "bgrad_b"])
@pytest.mark.parametrize("M,K,N", [(37, 129, 65), (300, 64, 512), (1031, 255, 17)])
def test_cublaslt_epilogues(rng, epilogue, M, K, N):
    s = stream()
    for ta in (False, True):
        for tb in (False, True):
            A = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
            B = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
            C = rng.standard_normal((M, N)).astype(np.float32)
            bgrad = epilogue in ("bgrad_a", "bgrad_b")
            bias = None if bgrad else rng.standard_normal(N).astype(np.float32)
            beta = 0.0 if bgrad else 0.75
            kw = {}
            if epilogue == "gelu_aux":
                aux_full = _cuda.to_device(np.full((M, -(-N // 8) * 8 + 8), 9.0, np.float32), stream=s)
                kw["aux"] = aux_full[:, :N]
            if bgrad:
                kw["bias_grad"] = _cuda.to_device(np.full(M if epilogue == "bgrad_a" else N, np.nan, np.float32), stream=s)
            dC = _cuda.to_device(C, stream=s)
            blas.gemm(_cuda.to_device(A, stream=s), _cuda.to_device(B, stream=s), dC, ta, tb, 1.25, beta,
                      bias=None if bias is None else _cuda.to_device(bias, stream=s), epilogue=epilogue,
                      stream=s, **kw)
            s.synchronize()
            out, pre, sum_a, sum_b = blas.gemm_ref(A, B, C, ta, tb, 1.25, beta, bias, epilogue)
            atol, rtol = _tol("fp32", K)
            _close(dC.copy_to_host(), out, 2 * atol, rtol)
            if epilogue == "gelu_aux":
                host = aux_full.copy_to_host()
                _close(host[:, :N], pre, 2 * atol, rtol)
                assert (host[:, N:] == 9.0).all(), "aux padding was overwritten"
            if bgrad:
                ref = sum_a if epilogue == "bgrad_a" else sum_b
                _close(kw["bias_grad"].copy_to_host(), ref, 1e-5 * math.sqrt(K), 1e-5)


def test_kernel_backend_agrees_with_cublaslt(rng):
    M, K, N = 77, 130, 45
    A = _cuda.to_device(rng.standard_normal((M, K)).astype(np.float32))
    B = _cuda.to_device(rng.standard_normal((N, K)).astype(np.float32))
    bias = _cuda.to_device(rng.standard_normal(N).astype(np.float32))
    outs = []
    try:
        for which in ("cublaslt", "kernel"):
            blas.set_backend(which)
            C = _cuda.device_array((M, N), np.float32)
            blas.gemm(A, B, C, trans_b=True, bias=bias, epilogue="gelu")
            outs.append(C.copy_to_host(stream=stream()))
            stream().synchronize()
    finally:
        blas.set_backend(None)
    _close(outs[1], outs[0], 1e-4, 1e-5)


def test_strided_views_and_unaligned_pointers(rng):
    big_a = rng.standard_normal((300, 141)).astype(np.float32)
    big_b = rng.standard_normal((133, 70)).astype(np.float32)
    dA, dB = _cuda.to_device(big_a), _cuda.to_device(big_b)
    out = _cuda.to_device(np.zeros((300, 90), np.float32))
    A, B, C = dA[:, 3:136], dB[:, 1:66], out[:, 5:70]  # [300, 133] @ [133, 65]; 4-byte aligned pointers
    blas.gemm(A, B, C, stream=stream())
    host = out.copy_to_host(stream=stream())
    stream().synchronize()
    _close(host[:, 5:70], big_a[:, 3:136].astype(np.float64) @ big_b[:, 1:66], 2e-5 * math.sqrt(133), 1e-5)
    assert (host[:, :5] == 0).all() and (host[:, 70:] == 0).all()


def test_device_alpha_is_read_at_replay(rng):
    s = stream()
    A = rng.standard_normal((64, 32)).astype(np.float32)
    B = rng.standard_normal((32, 48)).astype(np.float32)
    dA, dB = _cuda.to_device(A), _cuda.to_device(B)
    C = _cuda.device_array((64, 48), np.float32)
    alpha = _cuda.to_device(np.array([2.0], np.float32))
    g = graph.capture(lambda st: blas.gemm(dA, dB, C, alpha=alpha, stream=st), stream=s)
    for value in (2.0, -0.5, 3.0):
        alpha.copy_to_device(np.array([value], np.float32), stream=s)  # outside the graph
        g.replay()
        got = C.copy_to_host(stream=s)
        s.synchronize()
        _close(got, value * (A.astype(np.float64) @ B), 1e-4, 1e-5)


def test_plans_are_pinned(rng):
    s = stream()
    A = _cuda.to_device(rng.standard_normal((33, 17)).astype(np.float32))
    B = _cuda.to_device(rng.standard_normal((17, 9)).astype(np.float32))
    C = _cuda.device_array((33, 9), np.float32)
    p = blas.plan(A, B, C, stream=s)
    assert isinstance(p, blas.Plan)
    before = blas.plan_count()
    g = graph.capture(lambda st: blas.gemm(A, B, C, stream=st), stream=s)
    for _ in range(5):
        g.replay()
    s.synchronize()
    assert blas.plan_count() == before


# ---------------------------------------------------------------------------------------------
# graph replay == eager, determinism
# ---------------------------------------------------------------------------------------------
def build_reference_step(seed, n=4096, k=256):
    """A step mixing GEMMs (bias+relu, transposed, bgrad), an RNG kernel, parameter updates, a
    reduction and a fork/join; returns (step, buffers). State feeds back, so drift shows."""
    gen = np.random.default_rng(seed)
    d = {
        "x": gen.standard_normal((n, k)).astype(np.float32),
        "w1": (gen.standard_normal((k, k)) / math.sqrt(k)).astype(np.float32),
        "b1": (0.1 * gen.standard_normal(k)).astype(np.float32),
        "w2": (gen.standard_normal((k, k)) / math.sqrt(k)).astype(np.float32),
        "counter": np.zeros(1, np.int64),
        "stats": np.zeros(2, np.float32),
    }
    bufs = {name: _cuda.to_device(v) for name, v in d.items()}
    for name, shape in (("h", (n, k)), ("y", (n, k)), ("z", (n, k)), ("dw", (k, k))):
        bufs[name] = _cuda.device_array(shape, np.float32)
    bufs["db"] = _cuda.device_array(k, np.float32)
    try:
        from numbarl.cuda import reduce as red

        reducer = red.Reducer(n * k)

        def reduce_sum(x, out, at, st):
            reducer.sum(x, out, st, at=at)
    except ImportError:

        def reduce_sum(x, out, at, st):
            sum_rows_kernel[1, 1, st](x, out, at)

    lr = np.float32(-1e-5)
    b = bufs

    def step(s):
        # FORWARD: h = relu(x W1 + b1); y = h W2ᵀ
        blas.gemm(b["x"], b["w1"], b["h"], bias=b["b1"], epilogue="relu", stream=s)
        blas.gemm(b["h"], b["w2"], b["y"], trans_b=True, stream=s)
        # BRANCHES: the gradient GEMM and a second product run on forked streams
        left, right = graph.fork(s, 2)
        blas.gemm(b["h"], b["y"], b["dw"], trans_a=True, epilogue="bgrad", bias_grad=b["db"], stream=left)
        blas.gemm(b["y"], b["w2"], b["z"], stream=right)
        graph.join(s, [left, right])
        # UPDATE: parameters move, x gets fresh noise from the step counter
        axpy2d_kernel[_grid(k * k), BLOCK, s](b["w1"], lr, b["dw"])
        axpy1d_kernel[_grid(k), BLOCK, s](b["b1"], lr, b["db"])
        mix_kernel[_grid(n * k), BLOCK, s](b["z"], np.uint64(seed), b["counter"], b["x"])
        # STATS
        reduce_sum(b["x"], b["stats"], 0, s)
        reduce_sum(b["h"], b["stats"], 1, s)
        rng.advance(b["counter"], s)

    return step, bufs


def run_reference(seed, steps, use_graph):
    """sha256 of the state after `steps` steps (eager, or warm-up + replays)."""
    step, bufs = build_reference_step(seed)
    s = stream()
    if use_graph:
        g = graph.capture(step, stream=s)
        assert g.captured and g.n_nodes > 10
        for _ in range(steps - 1):
            g.replay()
    else:
        for _ in range(steps):
            step(s)
    s.synchronize()
    host = {name: bufs[name].copy_to_host() for name in ("x", "w1", "b1", "stats", "counter")}
    assert host["counter"][0] == steps
    assert all(np.isfinite(v).all() for v in host.values())
    digest = hashlib.sha256()
    for name in sorted(host):
        digest.update(host[name].tobytes())
    return digest.hexdigest()


def test_graph_replay_equals_eager_bitwise():
    assert run_reference(11, 5, use_graph=True) == run_reference(11, 5, use_graph=False)


def test_different_seeds_differ():
    # the comparison above could not pass by accident: another seed gives other bits
    assert run_reference(11, 2, use_graph=True) != run_reference(12, 2, use_graph=True)


def test_bitwise_determinism_across_processes():
    here = os.path.dirname(os.path.abspath(__file__))
    script = (
        "import sys; sys.path.insert(0, %r)\n"
        "import test_gpu_runtime as t\n"
        "print('DIGEST', t.run_reference(5, 4, use_graph=True))\n"
    ) % here
    digests = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        digests += [line.split()[1] for line in out.stdout.splitlines() if line.startswith("DIGEST")]
    assert len(digests) == 2 and digests[0] == digests[1]
    assert digests[0] == run_reference(5, 4, use_graph=True)


# ---------------------------------------------------------------------------------------------
# captures that break fail loudly; the stream stays usable
# ---------------------------------------------------------------------------------------------
def _stream_still_works(s):
    x = _cuda.to_device(np.zeros(7, np.float32), stream=s)
    tick_kernel[1, 32, s](x)
    tick_kernel[1, 32, s](x)
    got = x.copy_to_host(stream=s)
    s.synchronize()
    assert (got == 2.0).all()
    ok = graph.capture(lambda st: tick_kernel[1, 32, st](x), stream=s)
    ok.replay()
    s.synchronize()
    assert (x.copy_to_host() == 4.0).all()


def _cause(err):
    return str(err.value).split("Things that break")[0]


def test_capture_that_allocates_fails_clearly():
    s = stream()

    def allocating_step(st):
        scratch = _cuda.device_array(1024, np.float32)
        tick_kernel[_grid(1024), BLOCK, st](scratch)

    with pytest.raises(graph.GraphCaptureError) as err:
        graph.capture(allocating_step, stream=s, warmup=False)
    assert "allocating_step" in str(err.value)
    assert "cuMemAlloc" in _cause(err) or "allocation" in _cause(err)
    _stream_still_works(s)


def test_capture_with_host_copy_or_sync_fails_clearly():
    s = stream()
    x = _cuda.to_device(np.zeros(8, np.float32))
    tick_kernel[1, 32, s](x)

    def copying_step(st):
        tick_kernel[1, 32, st](x)
        x.copy_to_host()

    def syncing_step(st):
        tick_kernel[1, 32, st](x)
        st.synchronize()

    for step, what in ((copying_step, "cuMemcpy"), (syncing_step, "Synchronize")):
        with pytest.raises(graph.GraphCaptureError) as err:
            graph.capture(step, stream=s, warmup=False)
        assert what in _cause(err) or "not permitted" in _cause(err) or "legacy" in _cause(err), _cause(err)
        _stream_still_works(s)


def test_capture_with_legacy_stream_launch_fails_clearly():
    s = stream()
    x = _cuda.to_device(np.zeros(8, np.float32))
    tick_kernel[1, 32](x)  # compile; legacy stream outside capture is fine
    _cuda.synchronize()

    def legacy_step(st):
        tick_kernel[1, 32, st](x)
        tick_kernel[1, 32](x)  # forgot the stream

    with pytest.raises(graph.GraphCaptureError) as err:
        graph.capture(legacy_step, stream=s, warmup=False)
    assert "legacy" in _cause(err) or "IMPLICIT" in _cause(err), _cause(err)
    _stream_still_works(s)


def test_unjoined_fork_fails_clearly():
    s = stream()
    x = _cuda.to_device(np.zeros(8, np.float32))
    tick_kernel[1, 32, s](x)

    def unjoined_step(st):
        (branch,) = graph.fork(st, 1)
        tick_kernel[1, 32, branch](x)

    with pytest.raises(graph.GraphCaptureError) as err:
        graph.capture(unjoined_step, stream=s, warmup=False)
    assert "join" in _cause(err) or "UNJOINED" in _cause(err), _cause(err)
    _stream_still_works(s)


def test_gemm_planned_inside_capture_fails_clearly(rng):
    s = stream()
    A = _cuda.to_device(rng.standard_normal((19, 23)).astype(np.float32))
    B = _cuda.to_device(rng.standard_normal((23, 29)).astype(np.float32))
    C = _cuda.device_array((19, 29), np.float32)
    with pytest.raises(graph.GraphCaptureError) as err:
        graph.capture(lambda st: blas.gemm(A, B, C, compute="tf32", stream=st), stream=s, warmup=False)
    assert "plan" in _cause(err)
    _stream_still_works(s)


def test_mapped_buffer_in_graph():
    s = stream()
    buf = MappedBuffer(5)
    g = graph.capture(lambda st: tick_kernel[1, 32, st](buf.device), stream=s)  # warm-up writes 1
    for _ in range(3):
        g.replay()
    buf.record(s)
    assert buf.read().tolist() == [4.0] * 5
    with pytest.raises(graph.GraphCaptureError, match="record"):
        graph.capture(lambda st: buf.record(st), stream=s, warmup=False)
    _stream_still_works(s)


def test_bench_self_check_passes_on_gpu():
    from numbarl.bench import runtime as bench

    assert bench.main(["--check"]) == 0
