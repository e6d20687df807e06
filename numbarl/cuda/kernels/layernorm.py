"""LayerNorm over the last axis: forward (saving mean and rstd) and backward (dx, dgamma, dbeta).

API (launchers take the stream; no allocation, host copy or sync: safe inside a graph capture)::

    layernorm_forward(x, gamma, beta, y, mean, rstd, eps, stream)
        # x, y: [R, C] float32 (2-D views may be strided; contiguous [..., C] is viewed as rows)
        # gamma, beta: [C]; mean, rstd: [R] (saved for the backward pass)
    layernorm_partials_shape(R, C) -> (2, n_chunks, C)      # float32 scratch for the backward
    layernorm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta, partials, stream, accumulate=False)
        # dx: [R, C]; dgamma, dbeta: [C], overwritten (or += with accumulate=True)
    layernorm_param_grads(dy, x, mean, rstd, dgamma, dbeta, partials, stream, accumulate=False)
        # only dgamma, dbeta (the first half of layernorm_backward)
    plan = LayerNormPlan(R, C, eps=1e-5)       # owns the scratch
    plan.forward(x, gamma, beta, y, mean, rstd, stream)
    plan.backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta, stream, accumulate=False)

Math (Ba, Kiros & Hinton 2016; biased variance and eps inside the sqrt, as torch.nn.LayerNorm):
    mean_r = (1/C) sum_c x[r, c]
    var_r  = (1/C) sum_c (x[r, c] - mean_r)^2          (two passes: no cancellation)
    rstd_r = 1 / sqrt(var_r + eps)
    xhat   = (x - mean_r) * rstd_r,      y = xhat * gamma + beta
Backward with g = dy * gamma:
    dx[r, c] = rstd_r * (g[r, c] - mean_c(g[r, :]) - xhat[r, c] * mean_c(g[r, :] * xhat[r, :]))
    dgamma[c] = sum_r dy[r, c] * xhat[r, c],     dbeta[c] = sum_r dy[r, c]

Thread mapping: forward and dx use the row-group layout of numbarl.cuda.reduce (32 lanes per
row, 8 rows per block, lane-ordered folds). dgamma/dbeta are column reductions over the batch,
deterministic in two phases exactly like reduce.col_sum: per (column tile, row chunk) partials
folded in a fixed order into ``partials[0 | 1, chunk, c]``, then reduce.col_finish folds the
chunks. No atomics. The parameter-gradient kernel runs before the dx kernel, so dx may alias
dy or x; y may alias x.
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32

from numbarl.cuda.reduce import (
    LANES,
    OP_SUM,
    ROWS,
    as_rows,
    col_finish,
    col_plan,
    col_tiles,
    row_fold,
    row_grid,
)
from numbarl.cuda.runtime import cuda  # the backend (GPU or simulator), selected once

_cuda = cuda()

# ---------------------------------------------------------------------------------------------
# constants
# ---------------------------------------------------------------------------------------------
DEFAULT_EPS = 1e-5  # torch.nn.LayerNorm default

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def layernorm_forward_ref(x, gamma, beta, eps=DEFAULT_EPS):
    """(y, mean, rstd) in float64 for x [..., C]."""
    x = np.asarray(x, np.float64)
    mean = x.mean(axis=-1)
    var = ((x - mean[..., None]) ** 2).mean(axis=-1)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = (x - mean[..., None]) * rstd[..., None]
    y = xhat * np.asarray(gamma, np.float64) + np.asarray(beta, np.float64)
    return y, mean, rstd


def layernorm_backward_ref(dy, x, gamma, mean, rstd):
    """(dx, dgamma, dbeta) in float64 for x, dy [R, C] (or [..., C]; parameter grads sum over all rows)."""
    dy = np.asarray(dy, np.float64)
    x = np.asarray(x, np.float64)
    gamma = np.asarray(gamma, np.float64)
    mean = np.asarray(mean, np.float64)[..., None]
    rstd = np.asarray(rstd, np.float64)[..., None]
    xhat = (x - mean) * rstd
    g = dy * gamma
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    dgamma = (dy * xhat).reshape(-1, x.shape[-1]).sum(axis=0)
    dbeta = dy.reshape(-1, x.shape[-1]).sum(axis=0)
    return dx, dgamma, dbeta


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def layernorm_forward_kernel(x, gamma, beta, y, mean, rstd, eps):
    sh_mean = _cuda.shared.array((ROWS, LANES), float32)
    sh_var = _cuda.shared.array((ROWS, LANES), float32)
    lane = _cuda.threadIdx.x
    ty = _cuda.threadIdx.y
    r = _cuda.blockIdx.x * ROWS + ty
    n_rows, n_cols = x.shape
    inv_n = _ONE / float32(n_cols)
    # mean
    s = _ZERO
    if r < n_rows:
        c = lane
        while c + 3 * LANES < n_cols:
            s += (x[r, c] + x[r, c + LANES]) + (x[r, c + 2 * LANES] + x[r, c + 3 * LANES])
            c += 4 * LANES
        while c < n_cols:
            s += x[r, c]
            c += LANES
    mu = row_fold(sh_mean, ty, lane, s, OP_SUM) * inv_n
    # variance about the mean (second pass)
    q = _ZERO
    if r < n_rows:
        c = lane
        while c < n_cols:
            d = x[r, c] - mu
            q += d * d
            c += LANES
    var = row_fold(sh_var, ty, lane, q, OP_SUM) * inv_n
    rs = _ONE / math.sqrt(var + eps)
    if r < n_rows:
        c = lane
        while c < n_cols:
            y[r, c] = (x[r, c] - mu) * rs * gamma[c] + beta[c]
            c += LANES
        if lane == 0:
            mean[r] = mu
            rstd[r] = rs


@_cuda.jit(cache=True)
def layernorm_dx_kernel(dy, x, gamma, mean, rstd, dx):
    sh_g = _cuda.shared.array((ROWS, LANES), float32)
    sh_gx = _cuda.shared.array((ROWS, LANES), float32)
    lane = _cuda.threadIdx.x
    ty = _cuda.threadIdx.y
    r = _cuda.blockIdx.x * ROWS + ty
    n_rows, n_cols = x.shape
    inv_n = _ONE / float32(n_cols)
    mu = _ZERO
    rs = _ZERO
    sg = _ZERO
    sgx = _ZERO
    if r < n_rows:
        mu = mean[r]
        rs = rstd[r]
        c = lane
        while c < n_cols:
            g = dy[r, c] * gamma[c]
            sg += g
            sgx += g * ((x[r, c] - mu) * rs)
            c += LANES
    mean_g = row_fold(sh_g, ty, lane, sg, OP_SUM) * inv_n
    mean_gx = row_fold(sh_gx, ty, lane, sgx, OP_SUM) * inv_n
    if r < n_rows:
        c = lane
        while c < n_cols:
            xhat = (x[r, c] - mu) * rs
            dx[r, c] = rs * (dy[r, c] * gamma[c] - mean_g - xhat * mean_gx)
            c += LANES


@_cuda.jit(cache=True)
def layernorm_param_grad_kernel(dy, x, mean, rstd, chunk_rows, partials, dgamma, dbeta, final, accumulate):
    """Per (column tile, row chunk): sums of dy*xhat and dy over the chunk's rows (fixed order).

    final=False: partials[0, chunk, c], partials[1, chunk, c]; final=True (one chunk): straight
    into dgamma[c], dbeta[c] (+= with accumulate). Same thread mapping as reduce.col_reduce_kernel.
    """
    sh_g = _cuda.shared.array((ROWS, LANES), float32)
    sh_b = _cuda.shared.array((ROWS, LANES), float32)
    lane = _cuda.threadIdx.x
    ty = _cuda.threadIdx.y
    c = _cuda.blockIdx.x * LANES + lane
    chunk = _cuda.blockIdx.y
    n_rows, n_cols = x.shape
    r = chunk * chunk_rows + ty
    r_end = min(chunk * chunk_rows + chunk_rows, n_rows)
    acc_g = _ZERO
    acc_b = _ZERO
    if c < n_cols:
        while r < r_end:
            d = dy[r, c]
            acc_g += d * ((x[r, c] - mean[r]) * rstd[r])
            acc_b += d
            r += ROWS
    sh_g[ty, lane] = acc_g
    sh_b[ty, lane] = acc_b
    _cuda.syncthreads()
    if ty == 0 and c < n_cols:
        tg = sh_g[0, lane]
        tb = sh_b[0, lane]
        for k in range(1, ROWS):
            tg += sh_g[k, lane]
            tb += sh_b[k, lane]
        if final:
            if accumulate:
                dgamma[c] = dgamma[c] + tg
                dbeta[c] = dbeta[c] + tb
            else:
                dgamma[c] = tg
                dbeta[c] = tb
        else:
            partials[0, chunk, c] = tg
            partials[1, chunk, c] = tb


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------
def _rows(x, what: str, name: str):
    x2 = as_rows(x, what)
    if x2.dtype != np.float32:
        raise TypeError(f"{what}: {name} must be float32, got {x2.dtype}")
    return x2


def _vec(v, n: int, what: str, name: str):
    if v.dtype != np.float32:
        raise TypeError(f"{what}: {name} must be float32, got {v.dtype}")
    if v.ndim != 1:
        if not v.is_c_contiguous():
            raise ValueError(f"{what}: {name} must be 1-D or contiguous")
        v = v.reshape(v.size)
    if v.shape[0] != n:
        raise ValueError(f"{what}: {name} has {v.shape[0]} elements, expected {n}")
    return v


def layernorm_partials_shape(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """Shape of the float32 scratch layernorm_backward needs for [n_rows, n_cols] inputs."""
    return (2, col_plan(n_rows)[0], int(n_cols))


def layernorm_forward(x, gamma, beta, y, mean, rstd, eps, stream):
    """y = LayerNorm(x) * gamma + beta over the last axis; saves mean[R] and rstd[R]."""
    what = "layernorm_forward"
    x2 = _rows(x, what, "x")
    y2 = _rows(y, what, "y")
    n_rows, n_cols = x2.shape
    if tuple(y2.shape) != (n_rows, n_cols):
        raise ValueError(f"{what}: y has shape {tuple(y2.shape)}, expected {(n_rows, n_cols)}")
    gamma = _vec(gamma, n_cols, what, "gamma")
    beta = _vec(beta, n_cols, what, "beta")
    mean = _vec(mean, n_rows, what, "mean")
    rstd = _vec(rstd, n_rows, what, "rstd")
    if n_cols == 0:
        raise ValueError(f"{what}: rows are empty (C == 0)")
    layernorm_forward_kernel[row_grid(n_rows), (LANES, ROWS), stream](x2, gamma, beta, y2, mean, rstd, np.float32(eps))


def layernorm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta, partials, stream, accumulate: bool = False):
    """dx, dgamma, dbeta of LayerNorm (deterministic; see the module docstring for the math).

    partials: float32 device scratch of shape layernorm_partials_shape(R, C). dgamma and dbeta
    are overwritten, or accumulated into with accumulate=True. dx may alias dy or x.
    """
    what = "layernorm_backward"
    x2 = _rows(x, what, "x")
    n_rows, n_cols = x2.shape
    dy2 = _rows(dy, what, "dy")
    dx2 = _rows(dx, what, "dx")
    for name, a in (("dy", dy2), ("dx", dx2)):
        if tuple(a.shape) != (n_rows, n_cols):
            raise ValueError(f"{what}: {name} has shape {tuple(a.shape)}, expected {(n_rows, n_cols)}")
    gamma = _vec(gamma, n_cols, what, "gamma")
    mean = _vec(mean, n_rows, what, "mean")
    rstd = _vec(rstd, n_rows, what, "rstd")
    # parameter gradients first: they read dy and x, which dx may overwrite
    layernorm_param_grads(dy2, x2, mean, rstd, dgamma, dbeta, partials, stream, accumulate)
    layernorm_dx_kernel[row_grid(n_rows), (LANES, ROWS), stream](dy2, x2, gamma, mean, rstd, dx2)


def layernorm_param_grads(dy, x, mean, rstd, dgamma, dbeta, partials, stream, accumulate: bool = False):
    """dgamma[c] = sum_r dy*xhat, dbeta[c] = sum_r dy (the parameter half of layernorm_backward).

    Deterministic two-phase column reduction; partials: float32 [2, n_chunks, C] scratch
    (layernorm_partials_shape). Overwrites dgamma/dbeta, or adds to them with accumulate=True.
    """
    what = "layernorm_param_grads"
    x2 = _rows(x, what, "x")
    n_rows, n_cols = x2.shape
    dy2 = _rows(dy, what, "dy")
    if tuple(dy2.shape) != (n_rows, n_cols):
        raise ValueError(f"{what}: dy has shape {tuple(dy2.shape)}, expected {(n_rows, n_cols)}")
    mean = _vec(mean, n_rows, what, "mean")
    rstd = _vec(rstd, n_rows, what, "rstd")
    if dgamma.ndim != 1 or dbeta.ndim != 1:
        raise ValueError(f"{what}: dgamma and dbeta must be 1-D")
    dgamma = _vec(dgamma, n_cols, what, "dgamma")
    dbeta = _vec(dbeta, n_cols, what, "dbeta")
    n_chunks, chunk_rows = col_plan(n_rows)
    want = (2, n_chunks, n_cols)
    if partials is None or tuple(partials.shape) != want or partials.dtype != np.float32:
        raise ValueError(
            f"{what}: partials must be float32 of shape {want} (layernorm_partials_shape), got "
            + ("None" if partials is None else f"{partials.dtype} {tuple(partials.shape)}")
        )
    one_pass = n_chunks == 1
    layernorm_param_grad_kernel[(col_tiles(n_cols), n_chunks), (LANES, ROWS), stream](
        dy2, x2, mean, rstd, np.int64(chunk_rows), partials, dgamma, dbeta, one_pass, bool(accumulate)
    )
    if not one_pass:
        col_finish(partials[0], dgamma, stream, accumulate)
        col_finish(partials[1], dbeta, stream, accumulate)


class LayerNormPlan:
    """LayerNorm over [n_rows, n_cols] with a fixed eps; owns the backward scratch (allocate before capture)."""

    def __init__(self, n_rows: int, n_cols: int, eps: float = DEFAULT_EPS):
        self.n_rows, self.n_cols, self.eps = int(n_rows), int(n_cols), float(eps)
        if self.eps <= 0:
            raise ValueError(f"LayerNormPlan: eps must be > 0, got {eps}")
        self.partials = _cuda.device_array(layernorm_partials_shape(self.n_rows, self.n_cols), dtype=np.float32)
        self._check_shape = (self.n_rows, self.n_cols)

    def _check(self, x, what):
        x2 = as_rows(x, what)
        if tuple(x2.shape) != self._check_shape:
            raise ValueError(f"{what}: plan is for {self._check_shape}, got {tuple(x2.shape)}")

    def forward(self, x, gamma, beta, y, mean, rstd, stream):
        self._check(x, "LayerNormPlan.forward")
        layernorm_forward(x, gamma, beta, y, mean, rstd, self.eps, stream)

    def backward(self, dy, x, gamma, mean, rstd, dx, dgamma, dbeta, stream, accumulate: bool = False):
        self._check(x, "LayerNormPlan.backward")
        layernorm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta, self.partials, stream, accumulate)
