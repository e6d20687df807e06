"""Sigmoid feature gate: y = x ⊙ σ(x·W + b), each feature scaled by a learned, input-dependent gate.

The gating unit of gated linear units (Dauphin et al. 2017, Eq. 1, with the gated input being x
itself) and of squeeze-and-excitation feature recalibration (Hu, Shen & Sun 2018, Eq. 3): the
network learns which observation features to pass, per sample. Placed on the observation it is
the "sigmoid-gated feature attention" of numbarl's roadmap; followed by LayerNorm
(``Sequential([FeatureGate, LayerNorm])``) it is the gated block with a normalized output.

Shapes: x [B, D], W [D, D], b [D], pre = x·W + b [B, D], g = σ(pre), y = x ⊙ g.

Backward from dy (product rule; σ' = σ(1 − σ)):
    dpre = dy ⊙ x ⊙ g ⊙ (1 − g)
    dW   = xᵀ·dpre,  db = colsum(dpre)                (linear_param_grads: the gradient rule)
    dx   = dy ⊙ g + dpre·Wᵀ                           (two paths: through the product and the gate)

Thread mapping: the forward is one GEMM with the bias fused plus one elementwise kernel (gate and
product); the backward is one elementwise kernel writing dpre and the product path of dx (into a
shared buffer: overwritten or added by the gradient rule), then the two parameter-gradient GEMMs
(or GEMM + column sum) and the dx GEMM accumulating onto the product path (beta = 1).

This module is the worked example of docs/ARCHITECTURE.md ("Adding a component").
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda import blas, reduce
from numbarl.cuda.kernels import elementwise
from numbarl.cuda.runtime import cuda
from numbarl.rl.nets.linear import linear_param_grads
from numbarl.rl.nets.module import Buf, Ctx, Module, Param

_cuda = cuda()  # the backend (GPU or simulator), selected once

_ONE = np.float32(1.0)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def feature_gate_forward_ref(x, w, b):
    """(y, (x, g)) in float64: y = x ⊙ σ(x·W + b)."""
    x = np.asarray(x, np.float64)
    g = elementwise.sigmoid_ref(x @ np.asarray(w, np.float64) + np.asarray(b, np.float64))
    return x * g, (x, g)


def feature_gate_backward_ref(dy, cache, w):
    """(dx, dW, db) in float64 (module docstring)."""
    x, g = cache
    dy = np.asarray(dy, np.float64)
    dpre = dy * x * g * (1.0 - g)
    dx = dy * g + dpre @ np.asarray(w, np.float64).T
    return dx, x.T @ dpre, dpre.sum(axis=0)


def identity_init(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    """W = 0 (up to a small U(±1/sqrt(D))/8 jitter) so that every gate starts near σ(b): the gate
    begins as a mild, input-independent scaling and learns its input dependence."""
    bound = 1.0 / (8.0 * math.sqrt(shape[0]))
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# device functions and kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(device=True, inline=True)
def _sigmoid(v):
    if v >= 0:
        return _ONE / (_ONE + math.exp(-v))
    e = math.exp(v)
    return e / (_ONE + e)


@_cuda.jit(cache=True)
def gate_forward_kernel(x, pre, g, y):
    """g = σ(pre), y = x ⊙ g; one element per thread (grid-stride), x/pre/g/y flat [B·D]."""
    for i in range(_cuda.grid(1), y.shape[0], _cuda.gridsize(1)):
        gi = _sigmoid(pre[i])
        g[i] = gi
        y[i] = x[i] * gi


DX_OVERWRITE, DX_ADD, DX_NONE = 0, 1, 2


@_cuda.jit(cache=True)
def gate_backward_kernel(x, g, dy, dpre, dx, dx_mode):
    """dpre = dy ⊙ x ⊙ g ⊙ (1 − g); the product path of dx, dy ⊙ g, written (DX_OVERWRITE), added
    (DX_ADD) or skipped (DX_NONE: no input gradient, dx unused)."""
    for i in range(_cuda.grid(1), dy.shape[0], _cuda.gridsize(1)):
        gi = g[i]
        d = dy[i]
        dpre[i] = d * x[i] * gi * (_ONE - gi)
        if dx_mode == DX_ADD:
            dx[i] += d * gi
        elif dx_mode == DX_OVERWRITE:
            dx[i] = d * gi


# ---------------------------------------------------------------------------------------------
# module
# ---------------------------------------------------------------------------------------------
class FeatureGate(Module):
    """y = x ⊙ σ(x·W + b) over D features (module contract of numbarl.rl.nets.module).

    Parameters ``{name}.w`` [D, D] (decayed when ``decay``), ``{name}.b`` [D] (init ``gate_bias``:
    σ(2) ≈ 0.88, so the gate starts mostly open). Buffers per tag: pre, g, y; with backward the
    dpre and dx buffers and the column-sum scratch.
    """

    native_dx_accumulate = True  # the product path takes the ledger's beta, the GEMM adds onto it

    def __init__(self, name: str, dim: int, group: str | None = None, decay: bool = True,
                 gate_bias: float = 2.0, input_grad: bool = True, compute: str = "fp32"):
        super().__init__(name, group)
        self.dim = int(dim)
        if self.dim < 1:
            raise ValueError(f"{name}: dim must be >= 1 (got {dim})")
        if compute not in blas.COMPUTES:
            raise ValueError(f"{name}: compute must be one of {blas.COMPUTES} (got {compute!r})")
        self.decay, self.gate_bias, self.compute = bool(decay), float(gate_bias), compute
        self.input_grad = bool(input_grad)  # False on the observation: no dx (saves the dx GEMM)

    @property
    def out_dim(self) -> int:
        return self.dim

    def params(self) -> list[Param]:
        bias = self.gate_bias
        return [Param("w", (self.dim, self.dim), identity_init, decay=self.decay),
                Param("b", (self.dim,), lambda rng, shape: np.full(shape, bias, np.float32))]

    def in_shape(self, batch: int) -> tuple:
        return (batch, self.dim)

    def buffers(self, batch: int, backward: bool, **opts) -> list[Buf]:
        d = self.dim
        bufs = [Buf("pre", (batch, d)), Buf("g", (batch, d)), Buf("y", (batch, d))]
        if backward:
            bufs += [Buf("dpre", (batch, d)), Buf("partials", reduce.col_partials_shape(batch, d))]
            if self.input_grad:
                bufs.append(Buf("dx", (batch, d)))
        return bufs

    def forward_impl(self, c: Ctx, x):
        pre, g, y = c.buf("pre"), c.buf("g"), c.buf("y")
        blas.gemm(x, c.p("w"), pre, bias=c.p("b"), compute=self.compute, stream=c.stream)
        n = y.size
        gate_forward_kernel[elementwise.grid_for(n), elementwise.BLOCK, c.stream](
            x.reshape(n), pre.reshape(n), g.reshape(n), y.reshape(n))
        return y

    def backward_impl(self, c: Ctx, dy, dx):
        if tuple(dy.shape) != (c.batch, self.dim):
            raise ValueError(f"{self.name}.backward: dy has shape {tuple(dy.shape)}, expected {(c.batch, self.dim)}")
        x, g, dpre = c.x(), c.buf("g"), c.buf("dpre")
        n = dy.size
        mode = DX_NONE if dx is None else (DX_ADD if c.dx_beta != 0.0 else DX_OVERWRITE)
        gate_backward_kernel[elementwise.grid_for(n), elementwise.BLOCK, c.stream](
            x.reshape(n), g.reshape(n), dy.reshape(n), dpre.reshape(n), (dpre if dx is None else dx).reshape(n),
            np.int32(mode))
        linear_param_grads(c, x, dpre, "w", "b", c.buf("partials"), self.compute)
        if dx is None:
            return None
        blas.gemm(dpre, c.p("w"), dx, trans_b=True, beta=1.0, compute=self.compute, stream=c.stream)
        return dx

    # -- float64 reference (host dict of params by name; composable) ----------------------------
    def forward_ref(self, x, params):
        n = self.param_names
        return feature_gate_forward_ref(x, params[n["w"]], params[n["b"]])

    def backward_ref(self, dy, cache, params):
        n = self.param_names
        dx, dw, db = feature_gate_backward_ref(dy, cache, params[n["w"]])
        return dx, {n["w"]: dw, n["b"]: db}
