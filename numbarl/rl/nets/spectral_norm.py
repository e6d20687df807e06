"""Spectral normalization of chosen layers' weights: W_sn = W / σ(W), σ by power iteration.

Miyato, Kataoka, Koyama & Yoshida 2018 ("Spectral normalization for GANs"), Algorithm 1 and
Eq. 12, in the arrangement of PyTorch's ``torch.nn.utils.parametrizations.spectral_norm``
(the peer of the tests). numbarl stores a dense weight as W [in, out] (y = x·W + b), the
transpose of the [out, in] matrix the paper and PyTorch write; with u [out] and v [in]:

    one power iteration       u ← normalize(Wᵀ·v)        (PyTorch: normalize(W_pt·v))
                              v ← normalize(W·u)         (PyTorch: normalize(W_ptᵀ·u))
    the estimate              σ = uᵀ·(Wᵀ·v)              (PyTorch: vdot(u, mv(W_pt, v)))
    the forward's weight      W_sn = W / σ
    normalize(t) = t / max(‖t‖₂, ε), ε = 1e-12 (F.normalize).

Backward (u, v constants, as in Eq. 12 and PyTorch's autograd through σ = uᵀ W v): from
G = ∂L/∂W_sn (what the layer's own backward writes),

    ∂L/∂W = (G − λ·v uᵀ) / σ,     λ = ⟨G, W_sn⟩ = Σ_ij G_ij · W_sn_ij

(Eq. 12's λ = E[δᵀ W_sn h] is exactly ⟨G, W_sn⟩ for G = E[δ hᵀ]; it is NOT uᵀ G v unless W_sn is
rank one). The transform is linear in G, so it runs once per train step on the accumulated
gradient, after every consumer of the layer wrote it (the gradient rule of
numbarl/rl/nets/module.py) and before the optimizer reads it.

How a layer reads W_sn: :class:`SpectralNorm` registers, in the parameter store's
``substitutes``, a view W_sn for the weight's "params" role and one for its "target" role; a
module's ``c.p("w")`` (numbarl.rl.nets.module.Ctx.p) returns that view, so the layer's forward
GEMM and its dx GEMM use W_sn, its dW GEMM writes G into the weight's gradient slot, and the layer
code is unchanged. Every address is fixed (one Arena, allocated once): the refresh and the
gradient transform are ordinary kernels inside the captured train step.

When σ is estimated (agent.spectral_norm, numbarl/rl/agents/dqn.py): one power iteration at the
END of every train step, after the optimizer's update, so u, v, σ and W_sn describe the weights
the next collect steps act with and the next train step starts from (the same as iterating at the
start of the next train step: nothing writes W in between). The construction and every checkpoint
load run the σ-only refresh (no iteration) on the device, so a resumed run continues bit for bit.

The target network: its own W_sn_target = W_target / σ_target with σ_target = uᵀ·(W_targetᵀ·v)
from the ONLINE vectors (no iteration of its own: a target copy of W is an earlier W, whose
leading singular pair the online vectors approximate), recomputed in the same end-of-step phase
(after a periodic copy or a Polyak average). No extra persistent state.

Thread mapping: `power_iteration_kernel`, ONE block of SN_BLOCK threads (thread i owns rows
i, i + SN_BLOCK, ... of each matrix-vector product, summed in index order; the norms and σ are
fixed shared-memory trees): deterministic, no atomics. `scale_kernel` (W_sn = W / σ) and
`grad_transform_kernel` are grid-stride elementwise; `grad_lambda_kernel` is one block (λ, a
fixed-order full reduction). The matrix-vector products read W row by row per thread (not
coalesced across threads): cheap at numbarl's widths (512 × 512: two passes over 1 MB), not
measured on a GPU.
"""

from __future__ import annotations

import math
import re

import numpy as np

from numbarl.cuda import launch
from numbarl.cuda.kernels import elementwise
from numbarl.cuda.runtime import Arena, cuda
from numbarl.cuda.runtime import stream as compute_stream

_cuda = cuda()  # the backend (GPU or simulator), selected once

SN_BLOCK = launch.shape(gpu=256, sim=8)  # threads of the one-block kernels (a power of two)
SN_EPS = 1e-12  # F.normalize's ε
N_INIT_ITERATIONS = 15  # power iterations at construction (PyTorch's spectral_norm does 15 on registration)
SEED_SALT = 0x5E5E  # u, v initial draws: np.random.default_rng([seed, SEED_SALT, layer index])

_ZERO = np.float32(0.0)
_EPS32 = np.float32(SN_EPS)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def _normalize(t, eps=SN_EPS):
    return t / max(float(np.linalg.norm(t)), eps)


def power_iteration_ref(w, u, v, n_iter: int = 1, eps: float = SN_EPS):
    """(u, v, σ) in float64 after n_iter power iterations from (u, v); n_iter = 0: σ of the given
    vectors. w [in, out] (numbarl's layout), u [out], v [in]."""
    w = np.asarray(w, np.float64)
    u, v = np.asarray(u, np.float64).copy(), np.asarray(v, np.float64).copy()
    for _ in range(int(n_iter)):
        u = _normalize(w.T @ v, eps)
        v = _normalize(w @ u, eps)
    return u, v, float(u @ (w.T @ v))


def spectral_forward_ref(w, u, v):
    """(W_sn, σ) in float64 with σ = uᵀ·(Wᵀ·v) for the given (post-iteration) vectors."""
    w = np.asarray(w, np.float64)
    sigma = float(np.asarray(u, np.float64) @ (w.T @ np.asarray(v, np.float64)))
    return w / sigma, sigma


def spectral_backward_ref(g_sn, w, u, v):
    """∂L/∂W in float64 from G = ∂L/∂W_sn (u, v constants): (G − ⟨G, W_sn⟩·v uᵀ) / σ."""
    g_sn = np.asarray(g_sn, np.float64)
    w_sn, sigma = spectral_forward_ref(w, u, v)
    lam = float(np.sum(g_sn * w_sn))
    return (g_sn - lam * np.outer(np.asarray(v, np.float64), np.asarray(u, np.float64))) / sigma


def init_vectors(w, seed: int, index: int, n_iter: int = N_INIT_ITERATIONS):
    """Initial (u [out], v [in]) float32 of layer `index`: standard normal draws from
    default_rng([seed, SEED_SALT, index]), normalized, then n_iter float64 power iterations on w."""
    w = np.asarray(w, np.float64)
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, SEED_SALT, int(index)])
    u = _normalize(rng.standard_normal(w.shape[1]))
    v = _normalize(rng.standard_normal(w.shape[0]))
    u, v, _ = power_iteration_ref(w, u, v, n_iter)
    return u.astype(np.float32), v.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# device functions and kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(device=True)
def _block_sum(sh, tid, value):
    """Fixed-order tree sum over the block's SN_BLOCK threads; every thread gets the total."""
    sh[tid] = value
    _cuda.syncthreads()
    width = SN_BLOCK // 2
    while width > 0:
        if tid < width:
            sh[tid] += sh[tid + width]
        _cuda.syncthreads()
        width //= 2
    total = sh[0]
    _cuda.syncthreads()  # every thread has read the total before the next use of sh
    return total


@_cuda.jit(cache=True)
def power_iteration_kernel(w, u, v, t, sigma, n_iter, stats, slot):
    """ONE block of SN_BLOCK threads. n_iter power iterations on w [in, out] from u [out], v [in]
    (in place), then t = Wᵀ·v and sigma[0] = Σ_j u_j t_j (module docstring); stats[slot] = σ when
    slot >= 0. n_iter = 0 is the σ-only refresh: the same arithmetic as the last step of an
    iteration, so a checkpoint's vectors give back the σ they were saved with, bit for bit."""
    sh = _cuda.shared.array(SN_BLOCK, np.float32)
    tid = _cuda.threadIdx.x
    n_in = w.shape[0]
    n_out = w.shape[1]
    for _ in range(n_iter):
        # u ← normalize(Wᵀ v): thread owns columns j
        part = _ZERO
        for j in range(tid, n_out, SN_BLOCK):
            acc = _ZERO
            for i in range(n_in):
                acc += w[i, j] * v[i]
            t[j] = acc
            part += acc * acc
        denom = max(math.sqrt(_block_sum(sh, tid, part)), _EPS32)
        for j in range(tid, n_out, SN_BLOCK):
            u[j] = t[j] / denom
        _cuda.syncthreads()
        # v ← normalize(W u): thread owns rows i (v[i] holds W u until normalized)
        part = _ZERO
        for i in range(tid, n_in, SN_BLOCK):
            acc = _ZERO
            for j in range(n_out):
                acc += w[i, j] * u[j]
            v[i] = acc
            part += acc * acc
        denom = max(math.sqrt(_block_sum(sh, tid, part)), _EPS32)
        for i in range(tid, n_in, SN_BLOCK):
            v[i] = v[i] / denom
        _cuda.syncthreads()
    # σ = uᵀ (Wᵀ v)
    part = _ZERO
    for j in range(tid, n_out, SN_BLOCK):
        acc = _ZERO
        for i in range(n_in):
            acc += w[i, j] * v[i]
        t[j] = acc
        part += u[j] * acc
    s = _block_sum(sh, tid, part)
    if tid == 0:
        sigma[0] = s
        if slot >= 0:
            stats[slot] = s


@_cuda.jit(cache=True)
def scale_kernel(w, sigma, w_sn):
    """w_sn = w / sigma[0], flat, grid-stride."""
    s = sigma[0]
    for i in range(_cuda.grid(1), w.shape[0], _cuda.gridsize(1)):
        w_sn[i] = w[i] / s


@_cuda.jit(cache=True)
def grad_lambda_kernel(g, w_sn, lam):
    """ONE block: lam[0] = Σ_i g[i] · w_sn[i] over the flat gradient, fixed order."""
    sh = _cuda.shared.array(SN_BLOCK, np.float32)
    tid = _cuda.threadIdx.x
    part = _ZERO
    for i in range(tid, g.shape[0], SN_BLOCK):
        part += g[i] * w_sn[i]
    total = _block_sum(sh, tid, part)
    if tid == 0:
        lam[0] = total


@_cuda.jit(cache=True)
def grad_transform_kernel(g, u, v, lam, sigma):
    """g[i, j] ← (g[i, j] − λ·v[i]·u[j]) / σ over the flat [in·out] gradient, grid-stride."""
    n_out = u.shape[0]
    l = lam[0]
    s = sigma[0]
    for k in range(_cuda.grid(1), g.shape[0], _cuda.gridsize(1)):
        i = k // n_out
        j = k - i * n_out
        g[k] = (g[k] - l * v[i] * u[j]) / s


# ---------------------------------------------------------------------------------------------
# the layer option
# ---------------------------------------------------------------------------------------------
def resolve_layers(store, spec: str) -> list[tuple[str, str]]:
    """[(layer, weight name)] for a comma list of layers: a layer is the prefix of a 2-D weight
    "<layer>.w" of the store ("trunk.fc1", "head.value", "head.adv"); "trunk.1" is short for
    "trunk.fc1". Unknown names are an error listing the layers that exist."""
    out = []
    weights = [n for n, s in store.specs.items() if n.endswith(".w") and len(s.shape) == 2]
    for token in (t.strip() for t in str(spec).split(",")):
        if not token:
            continue
        candidates = [token]
        m = re.fullmatch(r"(.+)\.(\d+)", token)
        if m:
            candidates.append(f"{m.group(1)}.fc{m.group(2)}")
        found = next((c for c in candidates if f"{c}.w" in weights), None)
        if found is None:
            layers = ", ".join(n[:-2] for n in weights)
            raise ValueError(f"agent.spectral_norm: no layer {token!r}; the layers with a weight are {layers}")
        if any(found == layer for layer, _ in out):
            raise ValueError(f"agent.spectral_norm: layer {found!r} named twice")
        out.append((found, f"{found}.w"))
    return out


class SpectralNorm:
    """Spectral normalization of the named weights of one ParamStore (module docstring).

    Device state per layer L (Arena "spectral_norm"): ``L.u`` [out], ``L.v`` [in] (persistent:
    checkpointed), ``L.sigma``, ``L.sigma_target`` [1], ``L.w_sn``, ``L.w_sn_target`` [in, out]
    (the views the layers read), scratch ``L.t`` [out] and ``L.lam`` [1].
    """

    def __init__(self, store, spec: str, seed: int, n_init: int = N_INIT_ITERATIONS):
        self.store = store
        self.layers = resolve_layers(store, spec)
        if not self.layers:
            raise ValueError("agent.spectral_norm names no layer")
        self.arena = Arena("spectral_norm")
        for layer, name in self.layers:
            n_in, n_out = store.specs[name].shape
            self.arena.add(f"{layer}.u", (n_out,), np.float32)
            self.arena.add(f"{layer}.v", (n_in,), np.float32)
            self.arena.add(f"{layer}.t", (n_out,), np.float32)
            self.arena.add(f"{layer}.sigma", (1,), np.float32)
            self.arena.add(f"{layer}.sigma_target", (1,), np.float32)
            self.arena.add(f"{layer}.lam", (1,), np.float32)
            self.arena.add(f"{layer}.w_sn", (n_in, n_out), np.float32)
            self.arena.add(f"{layer}.w_sn_target", (n_in, n_out), np.float32)
        self.arena.allocate()
        params = store.to_host("params")
        init = {}
        for k, (layer, name) in enumerate(self.layers):
            init[f"{layer}.u"], init[f"{layer}.v"] = init_vectors(params[name], seed, k, n_init)
        self.arena.load(init)
        for layer, name in self.layers:  # the layers read W_sn from now on (numbarl.rl.nets.module.Ctx.p)
            store.substitutes[("params", name)] = self.arena[f"{layer}.w_sn"]
            store.substitutes[("target", name)] = self.arena[f"{layer}.w_sn_target"]
        self.refresh_now()

    @property
    def names(self) -> list[str]:
        return [layer for layer, _ in self.layers]

    def view(self, layer: str, what: str):
        return self.arena[f"{layer}.{what}"]

    def refresh(self, stream, n_iter: int = 1, stats=None, slots=None) -> None:
        """n_iter power iterations per layer on the online W (0: σ only), σ into stats[slots[k]]
        when given, W_sn = W / σ; then σ_target from the online vectors and W_sn_target. Capturable."""
        p, tg = self.store.arenas["params"], self.store.arenas["target"]
        dummy = self.arena[f"{self.layers[0][0]}.lam"]
        for k, (layer, name) in enumerate(self.layers):
            a = self.arena
            slot = -1 if slots is None else int(slots[k])
            st = dummy if stats is None else stats
            power_iteration_kernel[1, SN_BLOCK, stream](p[name], a[f"{layer}.u"], a[f"{layer}.v"], a[f"{layer}.t"],
                                                        a[f"{layer}.sigma"], np.int64(n_iter), st, np.int64(slot))
            power_iteration_kernel[1, SN_BLOCK, stream](tg[name], a[f"{layer}.u"], a[f"{layer}.v"], a[f"{layer}.t"],
                                                        a[f"{layer}.sigma_target"], np.int64(0), dummy, np.int64(-1))
            n = p[name].size
            for w, sigma, out in ((p[name], "sigma", "w_sn"), (tg[name], "sigma_target", "w_sn_target")):
                scale_kernel[elementwise.grid_for(n), elementwise.BLOCK, stream](
                    w.reshape(n), a[f"{layer}.{sigma}"], a[f"{layer}.{out}"].reshape(n))

    def refresh_now(self) -> None:
        """The σ-only refresh, eagerly on the compute stream, synchronized (construction and
        checkpoint loads; between graph replays, never inside a capture)."""
        s = compute_stream()
        self.refresh(s, n_iter=0)
        s.synchronize()

    def transform_grads(self, stream) -> None:
        """∂L/∂W from the accumulated ∂L/∂W_sn in the weights' gradient slots (module docstring).
        Once per train step, after the backward, before the optimizer. Capturable."""
        g_all = self.store.arenas["grads"]
        for layer, name in self.layers:
            a = self.arena
            n = g_all[name].size
            g = g_all[name].reshape(n)
            grad_lambda_kernel[1, SN_BLOCK, stream](g, a[f"{layer}.w_sn"].reshape(n), a[f"{layer}.lam"])
            grad_transform_kernel[elementwise.grid_for(n), elementwise.BLOCK, stream](
                g, a[f"{layer}.u"], a[f"{layer}.v"], a[f"{layer}.lam"], a[f"{layer}.sigma"])

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_arrays(self) -> dict[str, np.ndarray]:
        """{"spectral/<layer>.u" | ".v" | ".sigma": ...}: the persistent vectors (and σ, for reading)."""
        host = self.arena.to_host()
        out = {}
        for layer, _ in self.layers:
            for what in ("u", "v", "sigma"):
                out[f"spectral/{layer}.{what}"] = host[f"{layer}.{what}"]
        return out

    def load_arrays(self, arrays: dict) -> None:
        """The vectors a checkpoint saved (those it has), then the σ-only refresh for the weights now
        in the store (call after the parameters were loaded)."""
        vectors = {}
        for layer, _ in self.layers:
            for what in ("u", "v"):
                key = f"spectral/{layer}.{what}"
                if key in arrays:
                    vectors[f"{layer}.{what}"] = np.asarray(arrays[key], np.float32)
        if vectors:
            self.arena.load(vectors)
        self.refresh_now()
