"""Regime gate: the trunk's features scaled by a learned gate of the market regime (issue 15, spec T9).

For the trunk's input x [B, D], its regime columns c_1 .. c_R (default ``agent.regime_gate_cols`` =
adx_14, rv_8, rv_32, rv_128, rv_ratio, feature names the agent resolves to obs columns for the run's
feature list: 53, 9, 10, 11, 12 in the default 64-feature set; numbarl/rl/obs_columns.py) and the trunk
body's output h = body(x) [B, H] (the features every head reads):

    r = x[:, c]                        [B, R]       the regime signal, data (not trained)
    z = r · W_g + b_g                  [B, H]       W_g [R, H], b_g [H]
    s = σ(z),  g = 2s                  gate in (0, 2)
    y = h ⊙ g

Initialisation W_g = 0, b_g = 0: g = 2σ(0) = 1 exactly, so the gated trunk starts as the ungated one (its
outputs bit for bit: y = h · 1), and the zero init draws nothing from the parameter RNG, so every other
parameter keeps the init it has with the gate off: the A/B starts from the same network. It still learns
from the first step: σ is at its steepest there (∂g/∂z = 2σ(1 − σ) = 1/2, where a plain σ opened to
σ(b) ≈ 1 by a large bias b would pass (1 − σ) ≈ 0 of the gradient), so ∂L/∂b_g = Σ_b dy ⊙ h / 2 ≠ 0 and
∂L/∂W_g = rᵀ(dy ⊙ h / 2) ≠ 0. The factor 2 lets the gate amplify a feature (up to 2x) as well as damp it;
weight decay on W_g pulls the gate towards regime-independence.

Backward from dy (σ' = σ(1 − σ)):
    dh   = dy ⊙ g                                  the body's backward runs on dh
    dz   = dy ⊙ h ⊙ 2s(1 − s)                      (= dg ⊙ g(1 − g/2) with dg = dy ⊙ h)
    dW_g = rᵀ · dz,   db_g = 1ᵀ · dz               two GEMMs (the bias sum as a GEMM with a ones column:
                                                   fixed order, no atomics; the gradient rule by beta)
    dx   = body's dx,  dx[:, c] += dz · W_gᵀ       only where the trunk computes an input gradient

What r is: the columns of the trunk's input as the agent hands it. That is the observation, so r is the
raw regime features also with the tanh input bottleneck or the gates on (they are layers of the body,
after the gate has read x). With the temporal input (agent.temporal) the trunk reads h̃ = x + y·W_out
(numbarl/rl/temporal.py, a residual), so r = h̃[:, c], the regime features plus the scan's correction;
that is the one case in which the trunk computes an input gradient, and the gate then passes the exact
one, including the path through r (the last line above), so the module contract's exact gradients hold
(tests/rl/test_module_contract.py). On the observation (no input gradient) r has no gradient at all.

A wrapper like numbarl.rl.nets.attention.Residual: it reads its input twice, through the body and as r,
which is how a piece at the trunk's end sees the trunk's input without a side channel. numbarl.rl.nets.mlp
wraps its layers in it (``Mlp(..., regime_gate=cols)``; parameter group ``{group}.rgate``).

Thread mapping: forward: one grid-stride kernel gathering r (and writing the ones column), the body, one
GEMM with the bias fused (z into the s buffer), one elementwise kernel (s = σ(z) in place, y); backward:
one elementwise kernel (dh, dz), the two parameter GEMMs, the body's backward, and with an input gradient
one GEMM (dz · W_gᵀ) plus a kernel adding it into dx's regime columns, one thread per row (columns in
order).
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda import blas
from numbarl.cuda.kernels import elementwise
from numbarl.cuda.runtime import cuda
from numbarl.rl.nets.base import zeros_init
from numbarl.rl.nets.module import Buf, Ctx, Module, Param

_cuda = cuda()  # the backend (GPU or simulator), selected once

_ONE, _TWO = np.float32(1.0), np.float32(2.0)



# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def regime_gate_forward_ref(h, r, w, b):
    """(y, (h, r, s)) in float64: y = h ⊙ 2σ(r·W + b) (module docstring)."""
    h, r = np.asarray(h, np.float64), np.asarray(r, np.float64)
    s = elementwise.sigmoid_ref(r @ np.asarray(w, np.float64) + np.asarray(b, np.float64))
    return h * 2.0 * s, (h, r, s)


def regime_gate_backward_ref(dy, cache, w):
    """(dh, dr, dW, db) in float64 (module docstring; dr = dz·Wᵀ, the path through r)."""
    h, r, s = cache
    dy = np.asarray(dy, np.float64)
    dz = dy * h * 2.0 * s * (1.0 - s)
    return dy * 2.0 * s, dz @ np.asarray(w, np.float64).T, r.T @ dz, dz.sum(axis=0)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def regime_gather_kernel(x, cols, r, ones):
    """r[b, j] = x[b, cols[j]], ones[b, 0] = 1; one element of r per thread (grid-stride)."""
    n_cols = r.shape[1]
    for t in range(_cuda.grid(1), r.shape[0] * n_cols, _cuda.gridsize(1)):
        b = t // n_cols
        j = t - b * n_cols
        r[b, j] = x[b, cols[j]]
        if j == 0:
            ones[b, 0] = _ONE


@_cuda.jit(cache=True)
def gate_forward_kernel(h, s, y):
    """s = σ(z) in place (s holds z on entry), y = h ⊙ 2s; one element per thread (grid-stride)."""
    width = h.shape[1]
    for t in range(_cuda.grid(1), h.shape[0] * width, _cuda.gridsize(1)):
        b = t // width
        j = t - b * width
        sv = elementwise.sigmoid_dev(s[b, j])
        s[b, j] = sv
        y[b, j] = h[b, j] * (_TWO * sv)


@_cuda.jit(cache=True)
def gate_backward_kernel(dy, h, s, dh, dz):
    """dh = dy ⊙ 2s, dz = dy ⊙ h ⊙ 2s(1 − s); one element per thread (grid-stride)."""
    width = dy.shape[1]
    for t in range(_cuda.grid(1), dy.shape[0] * width, _cuda.gridsize(1)):
        b = t // width
        j = t - b * width
        sv = s[b, j]
        d = dy[b, j]
        g = _TWO * sv
        dh[b, j] = d * g
        dz[b, j] = d * h[b, j] * g * (_ONE - sv)


@_cuda.jit(cache=True)
def scatter_add_kernel(dr, cols, dx):
    """dx[b, cols[j]] += dr[b, j]; one row per thread, its columns in order (grid-stride over rows)."""
    for b in range(_cuda.grid(1), dx.shape[0], _cuda.gridsize(1)):
        for j in range(dr.shape[1]):
            dx[b, cols[j]] += dr[b, j]


# ---------------------------------------------------------------------------------------------
# module
# ---------------------------------------------------------------------------------------------
class RegimeGate(Module):
    """y = body(x) ⊙ 2σ(x[:, cols]·W_g + b_g) (module contract of numbarl.rl.nets.module; module docstring).

    Parameters ``{name}.w`` [R, H] (zero init, decayed when ``decay``), ``{name}.b`` [H] (zero init), then the
    body's. Own buffers per tag: r, ones, s, y; with backward dh, dz and dr; the body's buffers are its own.
    """

    def __init__(self, name: str, body: Module, in_dim: int, width: int, cols, group: str | None = None,
                 decay: bool = True, compute: str = "fp32"):
        super().__init__(name, group)
        self.body, self.in_dim, self.width = body, int(in_dim), int(width)
        self.cols = tuple(int(c) for c in cols)
        if not self.cols or min(self.cols) < 0 or max(self.cols) >= self.in_dim or len(set(self.cols)) != len(self.cols):
            raise ValueError(f"{name}: regime columns {self.cols} must be distinct columns of the {in_dim} inputs")
        if compute not in blas.COMPUTES:
            raise ValueError(f"{name}: compute must be one of {blas.COMPUTES} (got {compute!r})")
        self.decay, self.compute = bool(decay), compute
        self._cols_arg = tuple(np.int64(c) for c in self.cols)  # a kernel argument (a tuple: passed by value)

    @property
    def out_dim(self) -> int:
        return self.width

    def params(self) -> list[Param]:
        return [Param("w", (len(self.cols), self.width), zeros_init, decay=self.decay),
                Param("b", (self.width,), zeros_init)]

    @property
    def param_names(self) -> dict[str, str]:
        body = self.body.param_names
        names = {n: n for n in (body.values() if isinstance(body, dict) else body)}
        names.update({p.k: f"{self.name}.{p.name}" for p in self.params()})
        return names

    def declare_params(self, store) -> None:
        self.body.declare_params(store)  # the body first: its parameters keep their declaration order
        super().declare_params(store)

    def declare_acts(self, acts, batch: int, tag: str, backward: bool = True, **opts) -> None:
        self.body.declare_acts(acts, batch, tag, backward=backward, **opts)
        super().declare_acts(acts, batch, tag, backward=backward, **opts)

    def in_shape(self, batch: int) -> tuple:
        return (batch, self.in_dim)

    def buffers(self, batch: int, backward: bool, **opts) -> list[Buf]:
        n_cols, width = len(self.cols), self.width
        bufs = [Buf("r", (batch, n_cols)), Buf("ones", (batch, 1)), Buf("s", (batch, width)), Buf("y", (batch, width))]
        if backward:
            bufs += [Buf("dh", (batch, width)), Buf("dz", (batch, width)), Buf("dr", (batch, n_cols))]
        return bufs

    def dx_buffer(self, c: Ctx):
        return c.buf("dh")  # what backward_impl returns: the body's upstream gradient

    def forward_impl(self, c: Ctx, x):
        r, s, y = c.buf("r"), c.buf("s"), c.buf("y")
        regime_gather_kernel[elementwise.stride_launch(r.size) + (c.stream,)](x, self._cols_arg, r, c.buf("ones"))
        h = self.body.forward(x, c.stream, tag=c.tag, role=c.role)
        blas.gemm(r, c.p("w"), s, bias=c.p("b"), compute=self.compute, stream=c.stream)  # z
        gate_forward_kernel[elementwise.stride_launch(y.size) + (c.stream,)](h, s, y)
        return y

    def backward_impl(self, c: Ctx, dy, dh):
        """The gate's part: dh and dz, the parameter gradients (GEMMs with the ledger's beta); returns dh."""
        if tuple(dy.shape) != (c.batch, self.width):
            raise ValueError(f"{self.name}.backward: dy has shape {tuple(dy.shape)}, expected {(c.batch, self.width)}")
        dz = c.buf("dz")
        gate_backward_kernel[elementwise.stride_launch(dz.size) + (c.stream,)](
            dy, self.body.output(c.tag), c.buf("s"), dh, dz)
        blas.gemm(c.buf("r"), dz, c.g("w"), trans_a=True, beta=c.beta("w"), compute=self.compute, stream=c.stream)
        db = c.g("b")
        # a bias sum: fp32 whatever the trunk's compute (TF32 would round dz before the B-row sum)
        blas.gemm(c.buf("ones"), dz, db.reshape(1, db.size), trans_a=True, beta=c.beta("b"), compute="fp32",
                  stream=c.stream)
        return dh

    def backward(self, dy, stream, tag: str = "online", dx_out=None):
        """The gate's part (the base's checks and backward_impl), then the body's backward on dh, its input
        gradient into dx_out by the body's own contract, then the path through r added into it."""
        dh = super().backward(dy, stream, tag=tag)
        dx = self.body.backward(dh, stream, tag=tag, dx_out=dx_out)
        if dx is None:  # no input gradient (the trunk on the observation): r is data
            return None
        c = Ctx(self, tag, "params", stream)
        dr = c.buf("dr")
        blas.gemm(c.buf("dz"), c.p("w"), dr, trans_b=True, compute=self.compute, stream=stream)
        scatter_add_kernel[elementwise.stride_launch(dx.shape[0]) + (stream,)](dr, self._cols_arg, dx)
        return dx

    # -- float64 reference (host dict of params by name; composable) ----------------------------
    def forward_ref(self, x, params):
        n = self.param_names
        h, body_cache = self.body.forward_ref(x, params)
        r = np.asarray(x, np.float64)[:, list(self.cols)]
        y, cache = regime_gate_forward_ref(h, r, params[n["w"]], params[n["b"]])
        return y, (body_cache, cache)

    def backward_ref(self, dy, cache, params):
        n = self.param_names
        body_cache, gate_cache = cache
        dh, dr, dw, db = regime_gate_backward_ref(dy, gate_cache, params[n["w"]])
        dx, grads = self.body.backward_ref(dh, body_cache, params)
        grads = dict(grads)
        grads[n["w"]], grads[n["b"]] = dw, db
        if dx is not None:
            dx = np.array(dx, np.float64)
            dx[:, list(self.cols)] += dr
        return dx, grads
