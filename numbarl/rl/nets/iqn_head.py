"""Implicit quantile head (IQN, Dabney, Ostrovski, Silver & Munos 2018) on the shared trunk, per action branch.

Math (paper Eq. 4 and §3.1, the cosine embedding with n features and the Hadamard product with the
trunk's state embedding). For the trunk output h [B, H] and N quantile fractions τ[b, i] ~ U(0, 1)
per sample (one row r = b·N + i per (sample, fraction)):

    cos[r, j]  = cos(π · j · τ[b, i])                      j = 0 .. n−1       [B·N, n]
    φ[r, :]    = ReLU(cos[r, :]·W_φ + b_φ)                  Linear "phi"       [B·N, H]
    x[r, :]    = h[b, :] ⊙ φ[r, :]                                            [B·N, H]
    Z[r, :]    = x[r, :]·W_o + b_o                          Linear "out"       [B·N, Σ_k A_k]

φ uses ReLU, as the paper (the origin notes' `hadamard_sigmoid` used a sigmoid; the spec leaves it
open). Column c = off_k + a of Z is the quantile Z_τ(s, a) of action a of branch k
(off_k = Σ_{k'<k} A_{k'}: the C51 head's branch order, without atoms).

Backward from dZ [B·N, ΣA] (the quantile Huber loss writes it; numbarl/rl/losses/quantile_huber.py):

    dx     = dZ·W_oᵀ,  dW_o = xᵀ·dZ,  db_o = colsum(dZ)        Linear "out"
    dφ[r]  = dx[r] ⊙ h[b]
    dh[b]  = Σ_{i<N} dx[b·N+i] ⊙ φ[b·N+i]                      i in increasing order, one thread per (b, c)
    dpre   = dφ ⊙ [φ > 0],  dW_φ = cosᵀ·dpre,  db_φ = colsum   Linear "phi" (no input gradient: τ is data)

dh is the head's input gradient: with ``backward(dZ, s, tag, dx_out=dh_shared)`` it is written or
ADDED into a buffer the C51 head wrote first (the gradient ledger of numbarl/rl/nets/module.py), so
the trunk's backward runs once on the sum of both heads' contributions.

τ is drawn on the device with numbarl's counter RNG (numbarl/cuda/rng.py): τ[b, i] =
uniform(seed, lane = b·N + i, counter[0], slot), the slot per pass from :data:`IQN_TAU_SLOT`
(online fractions: slot + 0, target fractions: slot + 1); ``counter`` is a device int64 [1] (the
agent passes the optimizer's step counter, so every train step draws fresh fractions and two runs
draw the same ones). Tests write τ into the pass's "tau" buffer directly.

Parameters (optimizer group ``head.iqn`` unless given): ``{name}.phi.w`` [n, H], ``{name}.phi.b`` [H],
``{name}.out.w`` [H, ΣA], ``{name}.out.b`` [ΣA] (numbarl's Linear: kaiming-uniform weights, weight decay
on the weights). Buffers per tag (N = the tag's ``n_quantiles``): ``tau`` [B, N], ``cos`` [B·N, n],
``x`` [B·N, H]; with backward ``dx`` [B, H] (dh) and ``dphi`` [B·N, H]; the two Linears hold φ, Z and
their own scratch (batch B·N).

Thread mapping: `tau_kernel` and `cos_kernel` / `hadamard_kernel` are elementwise grid-stride loops
over B·N and B·N·n / B·N·H; `hadamard_backward_kernel` one thread per (b, c) of dh (adjacent threads
adjacent columns: coalesced), looping over the N fractions in order: no atomics, same bits every run.
The two GEMMs per pass (and three per backward) are cuBLASLt through numbarl's Linear.
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda import launch, rng
from numbarl.cuda.registry import RNG_STREAMS
from numbarl.cuda.runtime import cuda
from numbarl.rl.nets.linear import Linear, linear_forward_ref
from numbarl.rl.nets.module import Buf, Ctx, Module

_cuda = cuda()  # the backend (GPU or simulator), selected once

IQN_TAU_SLOT = RNG_STREAMS.claim("iqn.tau", 210, width=2)  # + 0: online fractions τ, + 1: target fractions τ'

BLOCK = launch.shape(gpu=256, sim=32)  # threads per block of the elementwise kernels
MAX_GRID = 1 << 16

_PI = np.float32(math.pi)
_ZERO = np.float32(0.0)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def cos_embedding_ref(tau, n_embed: int) -> np.ndarray:
    """cos(π j τ) for j = 0..n−1: [B·N, n] from τ [B, N] (float64)."""
    t = np.asarray(tau, np.float64).reshape(-1, 1)
    return np.cos(np.pi * np.arange(n_embed, dtype=np.float64)[None, :] * t)


def iqn_forward_ref(h, tau, w_phi, b_phi, w_out, b_out):
    """(Z [B·N, ΣA], cache) in float64 (module docstring)."""
    h = np.asarray(h, np.float64)
    tau = np.asarray(tau, np.float64)
    N = tau.shape[1]
    cos = cos_embedding_ref(tau, np.shape(w_phi)[0])
    phi, _ = linear_forward_ref(cos, w_phi, b_phi, "relu")
    hr = np.repeat(h, N, axis=0)  # row b·N + i holds h[b]
    x = hr * phi
    z, _ = linear_forward_ref(x, w_out, b_out)
    return z, (h, cos, phi, x, N)


def iqn_backward_ref(dz, cache, w_phi, w_out):
    """(dh [B, H], {"phi.w", "phi.b", "out.w", "out.b": grads}) in float64."""
    h, cos, phi, x, N = cache
    dz = np.asarray(dz, np.float64)
    dx, dw_out, db_out = dz @ np.asarray(w_out, np.float64).T, x.T @ dz, dz.sum(axis=0)
    hr = np.repeat(h, N, axis=0)
    dphi = dx * hr
    dh = (dx * phi).reshape(h.shape[0], N, -1).sum(axis=1)
    dpre = dphi * (phi > 0)
    return dh, {"phi.w": cos.T @ dpre, "phi.b": dpre.sum(axis=0), "out.w": dw_out, "out.b": db_out}


def tau_ref(seed: int, counter: int, slot: int, batch: int, n: int) -> np.ndarray:
    """The fractions tau_kernel draws: uniform(seed, lane = b·N + i, counter, slot), float32 [B, N]."""
    return rng.uniform_ref(np.uint64(seed), np.uint64(counter), np.uint64(slot), batch * n).reshape(batch, n)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def tau_kernel(seed, counter, slot, flat):
    """flat[r] = uniform(seed, r, counter[0], slot) (τ [B, N] flattened; grid-stride over r)."""
    c = counter[0]
    r = _cuda.grid(1)
    stride = _cuda.gridsize(1)
    while r < flat.size:
        flat[r] = rng.uniform(seed, r, c, slot)
        r += stride


@_cuda.jit(cache=True)
def cos_kernel(flat, cos):
    """cos[r, j] = cos(π·j·flat[r]) in float32 (τ [B, N] flattened; grid-stride over the B·N·n elements)."""
    n = cos.shape[1]
    total = cos.shape[0] * n
    e = _cuda.grid(1)
    stride = _cuda.gridsize(1)
    while e < total:
        r = e // n
        j = e - r * n
        cos[r, j] = math.cos(_PI * np.float32(j) * flat[r])
        e += stride


@_cuda.jit(cache=True)
def hadamard_kernel(h, phi, n_quantiles, x):
    """x[r, c] = h[r // N, c] · φ[r, c] (grid-stride over the B·N·H elements)."""
    H = x.shape[1]
    total = x.shape[0] * H
    e = _cuda.grid(1)
    stride = _cuda.gridsize(1)
    while e < total:
        r = e // H
        c = e - r * H
        x[r, c] = h[r // n_quantiles, c] * phi[r, c]
        e += stride


@_cuda.jit(cache=True)
def hadamard_backward_kernel(h, phi, dx, n_quantiles, accumulate, dphi, dh):
    """One thread per (b, c): dφ[b·N+i, c] = dx[b·N+i, c]·h[b, c] for every i, and
    dh[b, c] (+)= Σ_i dx[b·N+i, c]·φ[b·N+i, c] in increasing i (accumulate: add into dh)."""
    B = dh.shape[0]
    H = dh.shape[1]
    e = _cuda.grid(1)
    stride = _cuda.gridsize(1)
    while e < B * H:
        b = e // H
        c = e - b * H
        hv = h[b, c]
        acc = _ZERO
        r = b * n_quantiles
        for i in range(n_quantiles):
            g = dx[r + i, c]
            dphi[r + i, c] = g * hv
            acc += g * phi[r + i, c]
        if accumulate != 0:
            dh[b, c] = dh[b, c] + acc
        else:
            dh[b, c] = acc
        e += stride


def _grid(n: int) -> int:
    return max(1, min(MAX_GRID, -(-int(n) // BLOCK)))


# ---------------------------------------------------------------------------------------------
# the module
# ---------------------------------------------------------------------------------------------
class IqnHead(Module):
    """Implicit quantile head on h [B, H] (module docstring): quantiles [B·N, Σ_k A_k] per pass.

    declare_acts(acts, batch, tag, backward, n_quantiles=N); before forward, the pass's fractions
    are drawn with :meth:`sample_tau` (or written into ``tau_buffer(tag)``)."""

    native_dx_accumulate = True  # dh is written by our own kernel, which can add into a shared buffer

    def __init__(self, name: str, hidden: int, branch_sizes, n_embed: int = 64, group: str | None = "head.iqn",
                 compute: str = "fp32"):
        super().__init__(name, group)
        self.hidden, self.n_embed = int(hidden), int(n_embed)
        self.branch_sizes = tuple(int(a) for a in branch_sizes)
        if self.hidden < 1 or self.n_embed < 1 or not self.branch_sizes or min(self.branch_sizes) < 1:
            raise ValueError(f"{name}: hidden, n_embed and every branch size must be >= 1")
        self.total_actions = sum(self.branch_sizes)
        self.phi = Linear(f"{name}.phi", self.n_embed, self.hidden, activation="relu", group=self.group,
                          input_grad=False, compute=compute)
        self.out = Linear(f"{name}.out", self.hidden, self.total_actions, group=self.group, compute=compute)

    # -- declarations (the two Linears own the parameters) -------------------------------------
    @property
    def param_names(self) -> dict[str, str]:
        return {"phi.w": self.phi.param_names["w"], "phi.b": self.phi.param_names["b"],
                "out.w": self.out.param_names["w"], "out.b": self.out.param_names["b"]}

    def declare_params(self, store) -> None:
        self.phi.declare_params(store)
        self.out.declare_params(store)
        self.store = store

    def in_shape(self, batch: int) -> tuple:
        return (batch, self.hidden)

    def buffers(self, batch: int, backward: bool, n_quantiles: int = 32, **opts) -> list[Buf]:
        rows = batch * int(n_quantiles)
        bufs = [Buf("tau", (batch, int(n_quantiles))), Buf("cos", (rows, self.n_embed)), Buf("x", (rows, self.hidden))]
        if backward:
            bufs += [Buf("dx", (batch, self.hidden)), Buf("dphi", (rows, self.hidden))]
        return bufs

    def declare_acts(self, acts, batch: int, tag: str, backward: bool = True, n_quantiles: int = 32, **opts) -> None:
        if int(n_quantiles) < 1:
            raise ValueError(f"{self.name}: n_quantiles must be >= 1 (got {n_quantiles})")
        super().declare_acts(acts, batch, tag, backward=backward, n_quantiles=int(n_quantiles))
        rows = int(batch) * int(n_quantiles)
        self.phi.declare_acts(acts, rows, tag, backward=backward)
        self.out.declare_acts(acts, rows, tag, backward=backward)

    def n_quantiles(self, tag: str) -> int:
        return self._opts[tag]["n_quantiles"]

    def tau_buffer(self, tag: str = "online"):
        """The pass's fractions τ [B, N] (device)."""
        return self._arena(tag)[self._buf_name(tag, "tau")]

    def output(self, tag: str = "online"):
        """The pass's quantiles Z [B·N, ΣA] (device), valid after forward."""
        return self.out.output(tag)

    # -- the fractions -----------------------------------------------------------------------------
    def sample_tau(self, stream, tag: str, seed: int, counter, slot: int) -> None:
        """τ[b, i] = uniform(seed, b·N + i, counter[0], slot) into the pass's tau buffer (capturable)."""
        tau = self.tau_buffer(tag)
        tau_kernel[_grid(tau.size), BLOCK, stream](np.uint64(seed), counter, np.uint64(slot), tau.reshape(tau.size))

    # -- kernels ----------------------------------------------------------------------------------
    def forward_impl(self, c: Ctx, h):
        n_q = self.n_quantiles(c.tag)
        cos, x = c.buf("cos"), c.buf("x")
        tau = c.buf("tau")
        cos_kernel[_grid(cos.size), BLOCK, c.stream](tau.reshape(tau.size), cos)
        phi = self.phi.forward(cos, c.stream, tag=c.tag, role=c.role)
        hadamard_kernel[_grid(x.size), BLOCK, c.stream](h, phi, np.int64(n_q), x)
        return self.out.forward(x, c.stream, tag=c.tag, role=c.role)

    def backward_impl(self, c: Ctx, dz, dh):
        n_q = self.n_quantiles(c.tag)
        rows = c.batch * n_q
        if tuple(dz.shape) != (rows, self.total_actions):
            raise ValueError(f"{self.name}.backward: dZ has shape {tuple(dz.shape)}, expected {(rows, self.total_actions)}")
        dx = self.out.backward(dz, c.stream, tag=c.tag)  # out's own dx [B·N, H]; dW_o, db_o by the rule
        hadamard_backward_kernel[_grid(dh.size), BLOCK, c.stream](
            c.x(), self.phi.output(c.tag), dx, np.int64(n_q), np.int32(1 if c.dx_beta == 1.0 else 0),
            c.buf("dphi"), dh)
        self.phi.backward(c.buf("dphi"), c.stream, tag=c.tag)  # dW_φ, db_φ; no input gradient
        return dh

    # -- float64 reference (host dict of params by store name) ------------------------------------
    def forward_ref(self, h, params, tau=None):
        if tau is None:
            raise ValueError(f"{self.name}.forward_ref needs the fractions tau [B, N]")
        n = self.param_names
        return iqn_forward_ref(h, tau, params[n["phi.w"]], params[n["phi.b"]], params[n["out.w"]], params[n["out.b"]])

    def backward_ref(self, dz, cache, params):
        n = self.param_names
        dh, g = iqn_backward_ref(dz, cache, params[n["phi.w"]], params[n["out.w"]])
        return dh, {n[k]: v for k, v in g.items()}
