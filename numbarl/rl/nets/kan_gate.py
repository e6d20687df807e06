"""KAN spline gate: each feature scaled by a learned univariate spline of itself, y_j = x_j · σ(φ_j(x_j)).

The edge function of a Kolmogorov–Arnold network (Liu et al. 2024, Eq. 2.10; pykan's defaults
k = 3, grid = 5) used as a per-feature gate (issue 15, spec T8):

    φ_j(x) = w_b,j · silu(x) + w_s,j · Σ_m c_j,m B_m(x)          m = 0 .. G + 2 (G + 3 = 8 bases)
    g_j    = σ(φ_j(x_j)),   y_j = x_j · g_j

B_m are the cubic B-splines on the uniform grid of G = 5 intervals over [−5, 5] (knot spacing
h = 2, extended by three knots on each side; numbarl's features are clipped to ±5, so that is
their whole range). On cell i (s = (x + 5)/h, i = ⌊s⌋ clipped to 0..G−1, u = s − i ∈ [0, 1]) only
B_i .. B_{i+3} are non-zero, with the uniform cubic segment weights

    b0 = (1 − u)³/6,  b1 = (3u³ − 6u² + 4)/6,  b2 = (−3u³ + 3u² + 3u + 1)/6,  b3 = u³/6   (Σ = 1)

An x outside [−5, 5] (a portfolio feature, say) reads the spline at the nearest end (constant
extrapolation, no gradient through the spline there; at exactly ±5, where clipped features sit, the
one-sided derivative of the end cell, as autograd through a clamp gives); the silu path is unbounded.

Parameters: one tensor θ [F, G + 5] per gate, row j = (w_b, w_s, c_0 .. c_{G+2}) of feature j,
initialised to (0, 1, 2, …, 2): φ = 2 everywhere (the partition of unity), so every gate starts at
σ(2) ≈ 0.88 like :class:`numbarl.rl.nets.feature_gate.FeatureGate`, with no input dependence
until it learns one. Not weight-decayed (decay would pull the spline towards a half-closed gate).

Backward from dy (σ' = σ(1 − σ), silu' = σ(x)(1 + x(1 − σ(x))), B'_m from the segment weights · 1/h):
    dφ = dy · x · g · (1 − g)
    dx = dy · g + dφ · (w_b · silu'(x) + w_s · Σ_m c_m B'_m(x))
    ∂θ_j = Σ_b dφ_bj · (silu(x_bj), S(x_bj), w_s,j · B_0(x_bj), …, w_s,j · B_{G+2}(x_bj)),  S = Σ_m c_m B_m

Thread mapping (the origin notes' "kan_gate_backward writes per-element basis contributions, then
kan_grad_reduce deterministically accumulates them"): the forward is one elementwise kernel, one
thread per (b, j); the backward is one elementwise kernel over (j, b), b fastest, that writes dx and
the per-element contributions P [F·(G+5), B] (every row written, zeros off the cell; coalesced along
b), then the fixed-order row sums of numbarl.cuda.reduce (``row_sum``: lanes along b, no atomics),
whose [F·(G+5)] result is ∂θ itself (θ is row-major [F, G+5]), written, or added through a scratch
vector when the gradient rule says an earlier backward of the step wrote it.
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda import reduce
from numbarl.cuda.kernels import elementwise
from numbarl.cuda.runtime import cuda
from numbarl.rl.nets.module import Buf, Ctx, Module, Param

_cuda = cuda()  # the backend (GPU or simulator), selected once


GRID = 5  # intervals of the spline grid (pykan's grid = 5)
X_LO, X_HI = -5.0, 5.0  # the grid's range (the features' clip range)
H_KNOT = (X_HI - X_LO) / GRID  # knot spacing
N_BASIS = GRID + 3  # cubic B-splines on the grid (k = 3)
N_COEF = N_BASIS + 2  # θ row: w_b, w_s, c_0 .. c_{N_BASIS-1}

_ZERO, _ONE, _TWO, _THREE, _FOUR, _SIX = (np.float32(v) for v in (0.0, 1.0, 2.0, 3.0, 4.0, 6.0))
_LO, _HI, _INV_H = np.float32(X_LO), np.float32(X_HI), np.float32(1.0 / H_KNOT)
_LAST_CELL = GRID - 1


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def _sigmoid64(v):
    return 1.0 / (1.0 + np.exp(-v))


def cell_ref(x) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cell i, local u, inside) of x (module docstring): i ∈ 0..G−1, u ∈ [0, 1]; inside: the
    spline's derivative is live (X_LO ≤ x ≤ X_HI: at the ends the one-sided one, as autograd's clamp)."""
    x = np.asarray(x, np.float64)
    s = (np.clip(x, X_LO, X_HI) - X_LO) / H_KNOT
    i = np.minimum(np.floor(s), _LAST_CELL).astype(np.int64)
    return i, s - i, (x >= X_LO) & (x <= X_HI)


def basis_ref(x) -> np.ndarray:
    """B [..., N_BASIS] float64: the cubic B-spline bases at x (each row sums to 1)."""
    i, u, _ = cell_ref(x)
    w = np.stack([(1 - u) ** 3 / 6, (3 * u ** 3 - 6 * u ** 2 + 4) / 6, (-3 * u ** 3 + 3 * u ** 2 + 3 * u + 1) / 6,
                  u ** 3 / 6], axis=-1)
    out = np.zeros(np.shape(x) + (N_BASIS,))
    for k in range(4):
        np.put_along_axis(out, (i + k)[..., None], w[..., k:k + 1], axis=-1)
    return out


def basis_deriv_ref(x) -> np.ndarray:
    """dB/dx [..., N_BASIS] float64 (zero outside the grid; one-sided at its ends)."""
    i, u, inside = cell_ref(x)
    w = np.stack([-(1 - u) ** 2 / 2, (3 * u ** 2 - 4 * u) / 2, (-3 * u ** 2 + 2 * u + 1) / 2, u ** 2 / 2],
                 axis=-1) / H_KNOT * inside[..., None]
    out = np.zeros(np.shape(x) + (N_BASIS,))
    for k in range(4):
        np.put_along_axis(out, (i + k)[..., None], w[..., k:k + 1], axis=-1)
    return out


def kan_gate_forward_ref(x, theta):
    """(y, cache) in float64: y = x ⊙ σ(φ(x)) (module docstring); theta [F, N_COEF]."""
    x = np.asarray(x, np.float64)
    theta = np.asarray(theta, np.float64)
    basis = basis_ref(x)  # [B, F, nb]
    spline = np.einsum("bfm,fm->bf", basis, theta[:, 2:])
    silu = x * _sigmoid64(x)
    g = _sigmoid64(theta[:, 0] * silu + theta[:, 1] * spline)
    return x * g, (x, g, basis, spline, silu)


def kan_gate_backward_ref(dy, cache, theta):
    """(dx, dθ) in float64 (module docstring)."""
    x, g, basis, spline, silu = cache
    theta = np.asarray(theta, np.float64)
    dy = np.asarray(dy, np.float64)
    dphi = dy * x * g * (1.0 - g)
    sig = _sigmoid64(x)
    d_silu = sig * (1.0 + x * (1.0 - sig))
    d_spline = np.einsum("bfm,fm->bf", basis_deriv_ref(x), theta[:, 2:])
    dx = dy * g + dphi * (theta[:, 0] * d_silu + theta[:, 1] * d_spline)
    dtheta = np.concatenate([(dphi * silu).sum(0)[:, None], (dphi * spline).sum(0)[:, None],
                             np.einsum("bf,bfm->fm", dphi, basis) * theta[:, 1:2]], axis=1)
    return dx, dtheta


def kan_gate_init(gate_bias: float):
    """θ rows (w_b, w_s, c…) = (0, 1, gate_bias, …): every gate starts at σ(gate_bias), input-independent."""
    def init(rng: np.random.Generator, shape: tuple) -> np.ndarray:
        theta = np.full(shape, gate_bias, np.float32)
        theta[:, 0], theta[:, 1] = 0.0, 1.0
        return theta
    return init


# ---------------------------------------------------------------------------------------------
# device functions and kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(device=True, inline=True)
def _cell(x):
    """(cell, u, inside) of x (cell_ref)."""
    xc = min(max(x, _LO), _HI)
    s = (xc - _LO) * _INV_H
    i = min(int(s), _LAST_CELL)  # s >= 0: truncation is the floor
    return i, s - np.float32(i), x >= _LO and x <= _HI


@_cuda.jit(device=True, inline=True)
def _segment(u):
    """The four non-zero bases b0..b3 on a cell at local u."""
    v = _ONE - u
    u2 = u * u
    u3 = u2 * u
    return (v * v * v / _SIX, (_THREE * u3 - _SIX * u2 + _FOUR) / _SIX,
            (-_THREE * u3 + _THREE * u2 + _THREE * u + _ONE) / _SIX, u3 / _SIX)


@_cuda.jit(device=True, inline=True)
def _spline(theta, j, i, b0, b1, b2, b3):
    """S = Σ_k c_{i+k} b_k of feature j on cell i."""
    return (theta[j, 2 + i] * b0 + theta[j, 3 + i] * b1) + (theta[j, 4 + i] * b2 + theta[j, 5 + i] * b3)


@_cuda.jit(cache=True)
def kan_forward_kernel(x, theta, g, y):
    """g = σ(φ(x)), y = x ⊙ g; one element (b, j) per thread (grid-stride); x, g, y [B, F]."""
    n_feat = x.shape[1]
    for t in range(_cuda.grid(1), x.shape[0] * n_feat, _cuda.gridsize(1)):
        b = t // n_feat
        j = t - b * n_feat
        xv = x[b, j]
        i, u, _ = _cell(xv)
        b0, b1, b2, b3 = _segment(u)
        phi = theta[j, 0] * (xv * elementwise.sigmoid_dev(xv)) + theta[j, 1] * _spline(theta, j, i, b0, b1, b2, b3)
        gv = elementwise.sigmoid_dev(phi)
        g[b, j] = gv
        y[b, j] = xv * gv


DX_OVERWRITE, DX_ADD, DX_NONE = 0, 1, 2


@_cuda.jit(cache=True)
def kan_backward_kernel(x, theta, g, dy, contrib, dx, dx_mode):
    """The per-element parameter contributions contrib [F·N_COEF, B] (every row written) and the
    input gradient dx, written (DX_OVERWRITE), added (DX_ADD) or skipped (DX_NONE); one element
    (j, b) per thread, b fastest (grid-stride)."""
    n_rows = x.shape[0]
    for t in range(_cuda.grid(1), n_rows * x.shape[1], _cuda.gridsize(1)):
        j = t // n_rows
        b = t - j * n_rows
        xv = x[b, j]
        gv = g[b, j]
        d = dy[b, j]
        i, u, inside = _cell(xv)
        b0, b1, b2, b3 = _segment(u)
        sig = elementwise.sigmoid_dev(xv)
        silu = xv * sig
        spline = _spline(theta, j, i, b0, b1, b2, b3)
        dphi = d * xv * gv * (_ONE - gv)
        ws = theta[j, 1]
        base = j * N_COEF
        contrib[base, b] = dphi * silu
        contrib[base + 1, b] = dphi * spline
        for m in range(N_BASIS):
            contrib[base + 2 + m, b] = _ZERO
        wd = dphi * ws
        contrib[base + 2 + i, b] = wd * b0
        contrib[base + 3 + i, b] = wd * b1
        contrib[base + 4 + i, b] = wd * b2
        contrib[base + 5 + i, b] = wd * b3
        if dx_mode == DX_NONE:
            continue
        d_spline = _ZERO
        if inside:
            v = _ONE - u
            d_spline = ((theta[j, 2 + i] * (-v * v) + theta[j, 3 + i] * (_THREE * u * u - _FOUR * u))
                        + (theta[j, 4 + i] * (-_THREE * u * u + _TWO * u + _ONE) + theta[j, 5 + i] * (u * u))) \
                / _TWO * _INV_H
        d_silu = sig * (_ONE + xv * (_ONE - sig))
        dxv = d * gv + dphi * (theta[j, 0] * d_silu + ws * d_spline)
        if dx_mode == DX_ADD:
            dx[b, j] += dxv
        else:
            dx[b, j] = dxv


# ---------------------------------------------------------------------------------------------
# module
# ---------------------------------------------------------------------------------------------
class KanGate(Module):
    """y = x ⊙ σ(φ(x)) over F features, φ a KAN spline per feature (module contract of
    numbarl.rl.nets.module; module docstring for the math).

    Parameter ``{name}.theta`` [F, N_COEF]. Buffers per tag: g, y; with backward the contributions
    [F·N_COEF, B], a [F·N_COEF] scratch for an accumulating write and (with ``input_grad``) dx.
    """

    native_dx_accumulate = True  # the kernel adds into a shared dx with the ledger's beta

    def __init__(self, name: str, dim: int, group: str | None = None, gate_bias: float = 2.0,
                 input_grad: bool = True):
        super().__init__(name, group)
        self.dim = int(dim)
        if self.dim < 1:
            raise ValueError(f"{name}: dim must be >= 1 (got {dim})")
        self.gate_bias, self.input_grad = float(gate_bias), bool(input_grad)

    @property
    def out_dim(self) -> int:
        return self.dim

    def params(self) -> list[Param]:
        return [Param("theta", (self.dim, N_COEF), kan_gate_init(self.gate_bias))]

    def in_shape(self, batch: int) -> tuple:
        return (batch, self.dim)

    def buffers(self, batch: int, backward: bool, **opts) -> list[Buf]:
        d = self.dim
        bufs = [Buf("g", (batch, d)), Buf("y", (batch, d))]
        if backward:
            bufs += [Buf("contrib", (d * N_COEF, batch)), Buf("sums", (d * N_COEF,))]
            if self.input_grad:
                bufs.append(Buf("dx", (batch, d)))
        return bufs

    def forward_impl(self, c: Ctx, x):
        g, y = c.buf("g"), c.buf("y")
        kan_forward_kernel[elementwise.stride_launch(y.size) + (c.stream,)](x, c.p("theta"), g, y)
        return y

    def backward_impl(self, c: Ctx, dy, dx):
        if tuple(dy.shape) != (c.batch, self.dim):
            raise ValueError(f"{self.name}.backward: dy has shape {tuple(dy.shape)}, expected {(c.batch, self.dim)}")
        contrib = c.buf("contrib")
        mode = DX_NONE if dx is None else (DX_ADD if c.dx_beta != 0.0 else DX_OVERWRITE)
        kan_backward_kernel[elementwise.stride_launch(dy.size) + (c.stream,)](
            c.x(), c.p("theta"), c.buf("g"), dy, contrib, dy if dx is None else dx, np.int32(mode))
        grad = c.g("theta")
        grad = grad.reshape(grad.size)
        if c.beta("theta") == 0.0:
            reduce.row_sum(contrib, grad, c.stream)
        else:  # a second backward of the step (the gradient rule): sum aside, then add
            reduce.row_sum(contrib, c.buf("sums"), c.stream)
            elementwise.axpy(1.0, c.buf("sums"), grad, c.stream)
        return dx

    # -- float64 reference (host dict of params by name; composable) ----------------------------
    def forward_ref(self, x, params):
        return kan_gate_forward_ref(x, params[self.param_names["theta"]])

    def backward_ref(self, dy, cache, params):
        name = self.param_names["theta"]
        dx, dtheta = kan_gate_backward_ref(dy, cache, params[name])
        return dx, {name: dtheta}
