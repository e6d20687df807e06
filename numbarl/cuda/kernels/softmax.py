"""Row-wise softmax, log-softmax and logsumexp over the last axis, and their backward passes.

API (launchers take the stream; no allocation, host copy or sync: safe inside a graph capture)::

    softmax(x, y, stream)                     # y = exp(x - lse(x))            x, y: [..., C]
    log_softmax(x, y, stream)                 # y = x - lse(x)
    logsumexp(x, out, stream)                 # out[r] = log sum_c exp(x[r, c])  out: [R] or [...]
    softmax_backward(y, dy, dx, stream)       # dx = y * (dy - sum_c dy*y)       (y = softmax output)
    log_softmax_backward(logp, dy, dx, stream)  # dx = dy - exp(logp) * sum_c dy  (logp = output)

x is float32 [R, C] (a 2-D view may be strided) or a contiguous [..., C] (e.g. C51 logits
[B, n_branches, n_atoms] are viewed as [B*n_branches, n_atoms]). Outputs may alias inputs
(y = x, dx = dy): every row's reductions finish before any element of it is written, and each
thread rewrites only elements it read itself.

Numerics (the usual max-shift): with m = max_c x[r, c] and shift = m when m is finite, else 0,
    lse = shift + log(sum_c exp(x[r, c] - shift)).
So a row of all -inf gives lse = -inf (softmax and log-softmax of it are NaN, as in PyTorch),
-inf entries get probability 0, a +inf entry gives lse = +inf, and a NaN anywhere in a row
makes the whole row NaN. Backward formulas: for y = softmax(x), dL/dx = y * (dL/dy - <dL/dy, y>);
for z = log_softmax(x), dL/dx = dL/dz - softmax(x) * sum(dL/dz).

Thread mapping: one row per group of LANES = 32 threads, ROWS = 8 rows per block (block
(LANES, ROWS)); lane l handles columns l, l+32, ...; row sums/maxima go through shared memory
and are folded in lane order (numbarl.cuda.reduce.row_fold), so results are deterministic.
Rows >= R skip loads and stores but still reach every barrier (no early return).
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, njit

from numbarl.cuda.reduce import LANES, OP_MAX, OP_SUM, ROWS, as_rows, combine, row_fold, row_grid
from numbarl.cuda.runtime import cuda  # the backend (GPU or simulator), selected once

_cuda = cuda()

# ---------------------------------------------------------------------------------------------
# constants
# ---------------------------------------------------------------------------------------------
MODE_SOFTMAX = 0
MODE_LOG_SOFTMAX = 1

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_NEG_INF = np.float32(-np.inf)
_POS_INF = np.float32(np.inf)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def _shift_ref(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        m = np.max(x, axis=-1, keepdims=True)
    return np.where(np.isfinite(m), m, 0.0)


def logsumexp_ref(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    shift = _shift_ref(x)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return (shift + np.log(np.sum(np.exp(x - shift), axis=-1, keepdims=True)))[..., 0]


def softmax_ref(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    shift = _shift_ref(x)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        e = np.exp(x - shift)
        return e / np.sum(e, axis=-1, keepdims=True)


def log_softmax_ref(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    with np.errstate(invalid="ignore"):
        return x - logsumexp_ref(x)[..., None]


def softmax_backward_ref(y, dy) -> np.ndarray:
    y = np.asarray(y, np.float64)
    dy = np.asarray(dy, np.float64)
    return y * (dy - np.sum(dy * y, axis=-1, keepdims=True))


def log_softmax_backward_ref(logp, dy) -> np.ndarray:
    logp = np.asarray(logp, np.float64)
    dy = np.asarray(dy, np.float64)
    return dy - np.exp(logp) * np.sum(dy, axis=-1, keepdims=True)


# ---------------------------------------------------------------------------------------------
# device functions
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def exp_dev(x):
    """math.exp as compiled code: overflows to inf on the host (simulator) as on the GPU."""
    return math.exp(x)


@njit(cache=True)
def log_dev(x):
    """math.log as compiled code: log(0) = -inf on the host (simulator) as on the GPU."""
    return math.log(x)


@_cuda.jit(device=True)
def row_shift_and_sumexp(x, r, n_rows, n_cols, lane, ty, sh_max, sh_sum):
    """(shift, sum_c exp(x[r, c] - shift)) for row r, identical in every lane of the row group.

    shift = row max when finite, else 0 (all -inf, +inf or NaN rows). Barriers inside: all
    threads of the block must call it.
    """
    m = _NEG_INF
    if r < n_rows:
        c = lane
        while c < n_cols:
            m = combine(OP_MAX, m, x[r, c])
            c += LANES
    m = row_fold(sh_max, ty, lane, m, OP_MAX)
    shift = m if (m > _NEG_INF and m < _POS_INF) else _ZERO
    s = _ZERO
    if r < n_rows:
        c = lane
        while c < n_cols:
            s += exp_dev(x[r, c] - shift)
            c += LANES
    s = row_fold(sh_sum, ty, lane, s, OP_SUM)
    return shift, s


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def softmax_kernel(x, y, mode):
    """mode 0: y = softmax(x) per row; mode 1: y = log_softmax(x)."""
    sh_max = _cuda.shared.array((ROWS, LANES), float32)
    sh_sum = _cuda.shared.array((ROWS, LANES), float32)
    lane = _cuda.threadIdx.x
    ty = _cuda.threadIdx.y
    r = _cuda.blockIdx.x * ROWS + ty
    n_rows, n_cols = x.shape
    shift, s = row_shift_and_sumexp(x, r, n_rows, n_cols, lane, ty, sh_max, sh_sum)
    if r < n_rows:
        if mode == MODE_SOFTMAX:
            inv = _ONE / s
            c = lane
            while c < n_cols:
                y[r, c] = exp_dev(x[r, c] - shift) * inv
                c += LANES
        else:
            log_s = log_dev(s)
            c = lane
            while c < n_cols:
                y[r, c] = (x[r, c] - shift) - log_s
                c += LANES


@_cuda.jit(cache=True)
def logsumexp_kernel(x, out):
    sh_max = _cuda.shared.array((ROWS, LANES), float32)
    sh_sum = _cuda.shared.array((ROWS, LANES), float32)
    lane = _cuda.threadIdx.x
    ty = _cuda.threadIdx.y
    r = _cuda.blockIdx.x * ROWS + ty
    n_rows, n_cols = x.shape
    shift, s = row_shift_and_sumexp(x, r, n_rows, n_cols, lane, ty, sh_max, sh_sum)
    if r < n_rows and lane == 0:
        out[r] = shift + log_dev(s)


@_cuda.jit(cache=True)
def softmax_backward_kernel(y, dy, dx, mode):
    """mode 0 (y = softmax): dx = y * (dy - sum dy*y); mode 1 (y = log_softmax): dx = dy - exp(y) * sum dy."""
    sh_sum = _cuda.shared.array((ROWS, LANES), float32)
    lane = _cuda.threadIdx.x
    ty = _cuda.threadIdx.y
    r = _cuda.blockIdx.x * ROWS + ty
    n_rows, n_cols = y.shape
    s = _ZERO
    if r < n_rows:
        c = lane
        while c < n_cols:
            if mode == MODE_SOFTMAX:
                s += dy[r, c] * y[r, c]
            else:
                s += dy[r, c]
            c += LANES
    s = row_fold(sh_sum, ty, lane, s, OP_SUM)
    if r < n_rows:
        c = lane
        while c < n_cols:
            if mode == MODE_SOFTMAX:
                dx[r, c] = y[r, c] * (dy[r, c] - s)
            else:
                dx[r, c] = dy[r, c] - exp_dev(y[r, c]) * s
            c += LANES


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------
def _rows(x, what: str):
    x2 = as_rows(x, what)
    if x2.dtype != np.float32:
        raise TypeError(f"{what}: expected float32, got {x2.dtype}")
    return x2


def _rows_like(y, x2, what: str, name: str):
    y2 = _rows(y, what)
    if tuple(y2.shape) != tuple(x2.shape):
        raise ValueError(f"{what}: {name} viewed as rows has shape {tuple(y2.shape)}, expected {tuple(x2.shape)}")
    return y2


def softmax(x, y, stream):
    """y = softmax(x) over the last axis (float32; y may be x)."""
    x2 = _rows(x, "softmax")
    y2 = _rows_like(y, x2, "softmax", "y")
    softmax_kernel[row_grid(x2.shape[0]), (LANES, ROWS), stream](x2, y2, MODE_SOFTMAX)


def log_softmax(x, y, stream):
    """y = log_softmax(x) over the last axis (float32; y may be x)."""
    x2 = _rows(x, "log_softmax")
    y2 = _rows_like(y, x2, "log_softmax", "y")
    softmax_kernel[row_grid(x2.shape[0]), (LANES, ROWS), stream](x2, y2, MODE_LOG_SOFTMAX)


def logsumexp(x, out, stream):
    """out[r] = logsumexp of row r of x[..., C]; out float32 with one element per row."""
    x2 = _rows(x, "logsumexp")
    out1 = out
    if out.ndim != 1:
        if not out.is_c_contiguous():
            raise ValueError("logsumexp: out must be 1-D or contiguous")
        out1 = out.reshape(out.size)
    if out1.dtype != np.float32 or out1.shape[0] != x2.shape[0]:
        raise ValueError(f"logsumexp: out must be float32 with {x2.shape[0]} elements, got {out.dtype} {tuple(out.shape)}")
    logsumexp_kernel[row_grid(x2.shape[0]), (LANES, ROWS), stream](x2, out1)


def softmax_backward(y, dy, dx, stream):
    """dx = y * (dy - sum_c dy*y) for y = softmax(x); dx may alias dy."""
    y2 = _rows(y, "softmax_backward")
    dy2 = _rows_like(dy, y2, "softmax_backward", "dy")
    dx2 = _rows_like(dx, y2, "softmax_backward", "dx")
    softmax_backward_kernel[row_grid(y2.shape[0]), (LANES, ROWS), stream](y2, dy2, dx2, MODE_SOFTMAX)


def log_softmax_backward(logp, dy, dx, stream):
    """dx = dy - exp(logp) * sum_c dy for logp = log_softmax(x); dx may alias dy."""
    y2 = _rows(logp, "log_softmax_backward")
    dy2 = _rows_like(dy, y2, "log_softmax_backward", "dy")
    dx2 = _rows_like(dx, y2, "log_softmax_backward", "dx")
    softmax_backward_kernel[row_grid(y2.shape[0]), (LANES, ROWS), stream](y2, dy2, dx2, MODE_LOG_SOFTMAX)
