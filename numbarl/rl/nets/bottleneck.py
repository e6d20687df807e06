"""Tanh input bottleneck: a block of observation features compressed through tanh, the rest passed on
(issue 15, spec D7; the origin's ``bn_tanh_concat``).

For x [B, D] and the block of columns [lo, hi) (G = hi − lo features, e.g. the order-flow levels and the
book-shape block, which carry much the same information), width k:

    pre = x[:, lo:hi] · W + b            W [G, k], b [k]
    y   = [x[:, :lo], x[:, hi:], tanh(pre)]          [B, D − G + k]   (the kept columns, then the bottleneck)

Backward from dy (tanh' = 1 − tanh²):
    dpre = dy[:, D − G:] ⊙ (1 − y[:, D − G:]²)
    dW = x[:, lo:hi]ᵀ · dpre,  db = colsum(dpre)        (linear_param_grads: the gradient rule)
    dx[:, :lo] = dy[:, :lo],  dx[:, hi:] = dy[:, lo:D − G],  dx[:, lo:hi] = dpre · Wᵀ

Thread mapping: the block is copied into a contiguous [B, G] buffer (one element per thread, grid-
stride), one GEMM with the bias fused, one elementwise kernel assembling y (copies and tanh); the
backward is one elementwise kernel for dpre, the two parameter-gradient GEMMs (or GEMM + column sum),
and, with the input gradient, one GEMM into a [B, G] buffer and one kernel assembling dx.
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda import blas, reduce
from numbarl.cuda.kernels import elementwise
from numbarl.cuda.runtime import cuda
from numbarl.rl.nets.base import bias_uniform_init, kaiming_uniform_init
from numbarl.rl.nets.linear import linear_param_grads
from numbarl.rl.nets.module import Buf, Ctx, Module, Param

_cuda = cuda()  # the backend (GPU or simulator), selected once

_ONE = np.float32(1.0)



def parse_bottleneck(text: str) -> tuple[int, int, int] | None:
    """'lo:hi:width' -> (lo, hi, width); '' -> None (off). Raises ValueError naming the text."""
    if not text:
        return None
    try:
        lo, hi, width = (int(p) for p in text.split(":"))
    except ValueError:
        raise ValueError(f"{text!r} is not lo:hi:width (e.g. '0:24:8': columns 0..23 through 8 tanh units)") from None
    if not 0 <= lo < hi or width < 1:
        raise ValueError(f"{text!r}: need 0 <= lo < hi and width >= 1")
    return lo, hi, width


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def bottleneck_forward_ref(x, w, b, lo: int, hi: int):
    """(y, (x, t)) in float64 (module docstring)."""
    x = np.asarray(x, np.float64)
    t = np.tanh(x[:, lo:hi] @ np.asarray(w, np.float64) + np.asarray(b, np.float64))
    return np.concatenate([x[:, :lo], x[:, hi:], t], axis=1), (x, t)


def bottleneck_backward_ref(dy, cache, w, lo: int, hi: int):
    """(dx, dW, db) in float64 (module docstring)."""
    x, t = cache
    dy = np.asarray(dy, np.float64)
    n_keep = x.shape[1] - (hi - lo)
    dpre = dy[:, n_keep:] * (1.0 - t * t)
    dx = np.empty_like(x)
    dx[:, :lo] = dy[:, :lo]
    dx[:, hi:] = dy[:, lo:n_keep]
    dx[:, lo:hi] = dpre @ np.asarray(w, np.float64).T
    return dx, x[:, lo:hi].T @ dpre, dpre.sum(axis=0)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def block_copy_kernel(x, lo, xg):
    """xg[b, j] = x[b, lo + j]."""
    width = xg.shape[1]
    for t in range(_cuda.grid(1), xg.shape[0] * width, _cuda.gridsize(1)):
        b = t // width
        j = t - b * width
        xg[b, j] = x[b, lo + j]


@_cuda.jit(cache=True)
def assemble_kernel(x, lo, hi, pre, y):
    """y = [x[:, :lo], x[:, hi:], tanh(pre)]."""
    width = y.shape[1]
    n_keep = width - pre.shape[1]
    for t in range(_cuda.grid(1), y.shape[0] * width, _cuda.gridsize(1)):
        b = t // width
        j = t - b * width
        if j < lo:
            y[b, j] = x[b, j]
        elif j < n_keep:
            y[b, j] = x[b, j + hi - lo]
        else:
            y[b, j] = math.tanh(pre[b, j - n_keep])


@_cuda.jit(cache=True)
def dpre_kernel(dy, y, dpre):
    """dpre = dy[:, keep:] ⊙ (1 − y[:, keep:]²)."""
    width = dpre.shape[1]
    n_keep = y.shape[1] - width
    for t in range(_cuda.grid(1), dpre.shape[0] * width, _cuda.gridsize(1)):
        b = t // width
        j = t - b * width
        v = y[b, n_keep + j]
        dpre[b, j] = dy[b, n_keep + j] * (_ONE - v * v)


@_cuda.jit(cache=True)
def dx_assemble_kernel(dy, dxg, lo, hi, dx):
    """dx[:, :lo] = dy[:, :lo], dx[:, hi:] = dy[:, lo:keep], dx[:, lo:hi] = dxg."""
    width = dx.shape[1]
    for t in range(_cuda.grid(1), dx.shape[0] * width, _cuda.gridsize(1)):
        b = t // width
        j = t - b * width
        if j < lo:
            dx[b, j] = dy[b, j]
        elif j < hi:
            dx[b, j] = dxg[b, j - lo]
        else:
            dx[b, j] = dy[b, j - (hi - lo)]


# ---------------------------------------------------------------------------------------------
# module
# ---------------------------------------------------------------------------------------------
class TanhBottleneck(Module):
    """y = [x_keep, tanh(x[:, lo:hi]·W + b)] (module contract of numbarl.rl.nets.module; module docstring).

    Parameters ``{name}.w`` [hi − lo, width] (nn.Linear's init, decayed when ``decay``), ``{name}.b`` [width].
    Buffers per tag: xg, pre, y; with backward dpre, the column-sum scratch and (with ``input_grad``) dxg, dx.
    """

    def __init__(self, name: str, in_dim: int, lo: int, hi: int, width: int, group: str | None = None,
                 decay: bool = True, input_grad: bool = True, compute: str = "fp32"):
        super().__init__(name, group)
        self.in_dim, self.lo, self.hi, self.width = int(in_dim), int(lo), int(hi), int(width)
        if not 0 <= self.lo < self.hi <= self.in_dim or self.width < 1:
            raise ValueError(f"{name}: the block [{lo}, {hi}) must lie inside the {in_dim} input columns and "
                             f"width ({width}) be >= 1")
        self.n_block = self.hi - self.lo
        self.decay, self.input_grad, self.compute = bool(decay), bool(input_grad), compute

    @property
    def out_dim(self) -> int:
        return self.in_dim - self.n_block + self.width

    def params(self) -> list[Param]:
        return [Param("w", (self.n_block, self.width), kaiming_uniform_init, decay=self.decay),
                Param("b", (self.width,), bias_uniform_init(self.n_block))]

    def in_shape(self, batch: int) -> tuple:
        return (batch, self.in_dim)

    def buffers(self, batch: int, backward: bool, **opts) -> list[Buf]:
        bufs = [Buf("xg", (batch, self.n_block)), Buf("pre", (batch, self.width)), Buf("y", (batch, self.out_dim))]
        if backward:
            bufs += [Buf("dpre", (batch, self.width)), Buf("partials", reduce.col_partials_shape(batch, self.width))]
            if self.input_grad:
                bufs += [Buf("dxg", (batch, self.n_block)), Buf("dx", (batch, self.in_dim))]
        return bufs

    def forward_impl(self, c: Ctx, x):
        xg, pre, y = c.buf("xg"), c.buf("pre"), c.buf("y")
        block_copy_kernel[elementwise.stride_launch(xg.size) + (c.stream,)](x, np.int64(self.lo), xg)
        blas.gemm(xg, c.p("w"), pre, bias=c.p("b"), compute=self.compute, stream=c.stream)
        assemble_kernel[elementwise.stride_launch(y.size) + (c.stream,)](x, np.int64(self.lo), np.int64(self.hi), pre, y)
        return y

    def backward_impl(self, c: Ctx, dy, dx):
        if tuple(dy.shape) != (c.batch, self.out_dim):
            raise ValueError(f"{self.name}.backward: dy has shape {tuple(dy.shape)}, expected {(c.batch, self.out_dim)}")
        dpre = c.buf("dpre")
        dpre_kernel[elementwise.stride_launch(dpre.size) + (c.stream,)](dy, c.buf("y"), dpre)
        linear_param_grads(c, c.buf("xg"), dpre, "w", "b", c.buf("partials"), self.compute)
        if dx is None:
            return None
        dxg = c.buf("dxg")
        blas.gemm(dpre, c.p("w"), dxg, trans_b=True, compute=self.compute, stream=c.stream)
        dx_assemble_kernel[elementwise.stride_launch(dx.size) + (c.stream,)](dy, dxg, np.int64(self.lo), np.int64(self.hi), dx)
        return dx

    # -- float64 reference (host dict of params by name; composable) ----------------------------
    def forward_ref(self, x, params):
        n = self.param_names
        return bottleneck_forward_ref(x, params[n["w"]], params[n["b"]], self.lo, self.hi)

    def backward_ref(self, dy, cache, params):
        n = self.param_names
        dx, dw, db = bottleneck_backward_ref(dy, cache, params[n["w"]], self.lo, self.hi)
        return dx, {n["w"]: dw, n["b"]: db}
