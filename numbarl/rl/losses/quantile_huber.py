"""Quantile Huber loss of the implicit quantile head (Dabney et al. 2018, Eq. 3 and §3.2), per action
branch, with the double-DQN action of the C51 head and the target network's quantiles ("dual":
online and target quantile sets).

For sample b, branch k (A_k actions, columns off_k + a of the IQN head's output), the taken action
a_bk, the double-DQN action a*_bk = first argmax of the online C51 head's E[Z](next_obs) over the
branch (over the actions next_mask allows, when given: the C51 loss's rule), N online fractions
τ_i with quantiles Z[b, i, a] = quantiles[b·N + i, off_k + a] (online head on obs) and N′ target
quantiles Z′[b, j, a] (the TARGET network's head on next_obs, its own fractions τ′_j):

    γ_b       = discounts[b] · (1 − dones[b])                         (γ^m of the n-step window)
    θ_bkj     = rewards[b] + γ_b · Z′[b, j, a*_bk]                     target samples, constants
    u_bkij    = θ_bkj − Z[b, i, a_bk]
    L_κ(u)    = u²/2 if |u| ≤ κ else κ(|u| − κ/2)                      Huber, κ = 1
    ρ_τ(u)    = |τ − 1{u < 0}| · L_κ(u) / κ
    ℓ[b, k]   = Σ_{i<N} (1/N′) Σ_{j<N′} ρ_{τ_i}(u_bkij)                 averaged over N′, summed over N
    per_sample[b] = (1/n_branches) Σ_k ℓ[b, k],   L = (1/B) Σ_b per_sample[b]

Gradient with respect to the online quantiles (θ is a constant; L_κ′(u) = clip(u, −κ, κ)):

    ∂L/∂Z[b, i, a_bk] = −1/(B·n_branches·N′) Σ_j |τ_i − 1{u_bkij < 0}| · clip(u_bkij, −κ, κ) / κ

and 0 in every other column (other actions of the branch). The loss is unweighted (replay weights
are not applied to this auxiliary loss).

Thread mapping: `quantile_huber_kernel`, one thread per (b, k), grid (ceil(B / BLOCK), n_branches):
a*, the N × N′ double loop (j innermost, in order), ℓ[b, k] into reg and the branch's gradient
columns of its N rows (zeros for the untaken actions); then the C51 loss's one-block fixed-order
reduction (`c51_loss_reduce_kernel`) for per_sample and L. No atomics.

`iqn_readiness_kernel` (one thread, float64 state): L_first (the first step's loss), the EMA
L_ema ← 0.99 L_ema + 0.01 L (the first step sets L_ema = L) and readiness = clip(1 − L_ema / L_first,
0, 1), all on the device, into the agent's mapped stats.
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda import launch
from numbarl.cuda.runtime import Arena, cuda
from numbarl.rl.losses import c51
from numbarl.rl.losses.base import Loss
from numbarl.rl.losses.c51 import c51_loss_reduce_kernel, double_dqn_actions_ref

_cuda = cuda()  # the backend (GPU or simulator), selected once

BLOCK = launch.shape(gpu=128, sim=16)  # threads per block of the (sample, branch) kernel
KAPPA = 1.0  # the Huber threshold κ (the paper's and Dopamine's)
READINESS_EMA = 0.99  # L_ema ← 0.99 L_ema + 0.01 L

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_HALF = np.float32(0.5)
_NAN = np.float32(np.nan)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def branch_offsets(branch_sizes) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(branch_sizes)[:-1]]).astype(np.int64)


def quantile_huber_ref(quantiles, tau, target_quantiles, next_q, actions, rewards, dones, discounts, branch_sizes,
                       next_mask=None, kappa: float = KAPPA):
    """(loss, per_sample [B], dZ [B·N, ΣA]) in float64 (module docstring).

    quantiles [B·N, ΣA] (online), tau [B, N], target_quantiles [B·N′, ΣA] (target net, next_obs),
    next_q [B, n_branches, max_actions] (online C51 Q on next_obs: a*), actions [B, n_branches]."""
    tau = np.asarray(tau, np.float64)
    B, N = tau.shape
    z = np.asarray(quantiles, np.float64).reshape(B, N, -1)
    zt = np.asarray(target_quantiles, np.float64)
    Np = zt.shape[0] // B
    zt = zt.reshape(B, Np, -1)
    a_star = double_dqn_actions_ref(next_q, branch_sizes, next_mask)
    actions = np.asarray(actions, np.int64)
    gamma = np.asarray(discounts, np.float64) * (1.0 - (np.asarray(dones) != 0))
    rewards = np.asarray(rewards, np.float64)
    nb = len(branch_sizes)
    off = branch_offsets(branch_sizes)
    rows = np.arange(B)
    ell = np.zeros((B, nb))
    dz = np.zeros_like(z)
    for k in range(nb):
        col, tcol = off[k] + actions[:, k], off[k] + a_star[:, k]
        theta = rewards[:, None] + gamma[:, None] * zt[rows, :, tcol]  # [B, N′]
        q = z[rows, :, col]  # [B, N]
        u = theta[:, None, :] - q[:, :, None]  # [B, N, N′]
        w = np.abs(tau[:, :, None] - (u < 0))
        au = np.abs(u)
        huber = np.where(au <= kappa, 0.5 * u * u, kappa * (au - 0.5 * kappa))
        ell[:, k] = (w * huber / kappa).mean(axis=2).sum(axis=1)
        g = -(w * np.clip(u, -kappa, kappa) / kappa).mean(axis=2) / (B * nb)  # [B, N]
        dz[rows, :, col] = g
    per_sample = ell.mean(axis=1)
    return float(per_sample.mean()), per_sample, dz.reshape(B * N, -1)


def iqn_readiness_ref(losses, ema: float = READINESS_EMA):
    """(L_first, L_ema, readiness) after the given sequence of losses (float64)."""
    first = e = None
    for x in losses:
        x = float(x)
        if first is None:
            first = e = x
        else:
            e = ema * e + (1.0 - ema) * x
    ready = min(max(1.0 - e / first, 0.0), 1.0) if first and first > 0 else 0.0
    return first, e, ready


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def quantile_huber_kernel(quantiles, tau, target_quantiles, next_q, actions, rewards, dones, discounts,
                          branch_sizes, branch_offsets, next_mask, use_mask, n_quantiles, n_target, kappa,
                          inv_kappa, inv_target, grad_scale, reg, d_quantiles):
    """One thread per (sample b, branch k): ℓ[b, k] into reg and the branch's gradient columns."""
    b = _cuda.blockIdx.x * _cuda.blockDim.x + _cuda.threadIdx.x
    k = _cuda.blockIdx.y
    B = actions.shape[0]
    if b >= B:
        return
    n = branch_sizes[k]
    off = branch_offsets[k]
    taken = actions[b, k]
    r0 = b * n_quantiles
    if taken < 0 or taken >= n:  # an action outside its branch: a loud NaN, no out-of-bounds read
        reg[b, k] = _NAN
        for i in range(n_quantiles):
            for a in range(n):
                d_quantiles[r0 + i, off + a] = _ZERO
        return
    # double DQN: a* = first argmax of the online C51 Q on next_obs over the allowed actions
    best = -1
    best_q = next_q[b, k, 0]
    for a in range(n):
        if use_mask != 0 and next_mask[b, k, a] == 0:
            continue
        q = next_q[b, k, a]
        if best < 0 or q > best_q:
            best_q = q
            best = a
    if best < 0:
        best = 0
    gamma = _ZERO if dones[b] != 0 else discounts[b]
    reward = rewards[b]
    col = off + taken
    tcol = off + best
    t0 = b * n_target
    acc = _ZERO
    for i in range(n_quantiles):
        zq = quantiles[r0 + i, col]
        t = tau[b, i]
        s = _ZERO
        g = _ZERO
        for j in range(n_target):
            u = (reward + gamma * target_quantiles[t0 + j, tcol]) - zq
            w = t
            if u < _ZERO:
                w = _ONE - t
            au = abs(u)
            if au <= kappa:
                s += w * (_HALF * u * u) * inv_kappa
                g += w * u * inv_kappa
            else:
                s += w * (kappa * (au - _HALF * kappa)) * inv_kappa
                g += w * math.copysign(kappa, u) * inv_kappa
        acc += s * inv_target
        for a in range(n):
            d_quantiles[r0 + i, off + a] = _ZERO
        d_quantiles[r0 + i, col] = -(g * inv_target) * grad_scale
    reg[b, k] = acc


@_cuda.jit(cache=True)
def iqn_readiness_kernel(loss, state, stats, slot_loss, slot_ready, slot_ema):
    """One thread: state = (L_first, L_ema) float64 (L_first < 0: no step yet); the loss, its EMA and
    readiness = clip(1 − L_ema / L_first, 0, 1) into the stats slots."""
    if _cuda.grid(1) != 0:
        return
    x = np.float64(loss[0])
    if state[0] < 0.0:
        state[0] = x
        state[1] = x
    else:
        state[1] = READINESS_EMA * state[1] + (1.0 - READINESS_EMA) * x
    ready = 0.0
    if state[0] > 0.0:
        ready = min(max(1.0 - state[1] / state[0], 0.0), 1.0)
    stats[slot_loss] = loss[0]
    stats[slot_ready] = np.float32(ready)
    stats[slot_ema] = np.float32(state[1])


# ---------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------
class QuantileHuberLoss(Loss):
    """The IQN head's quantile Huber loss (module docstring)."""

    name = "iqn"
    inputs = ("quantiles", "tau", "target_quantiles", "next_q", "actions", "rewards", "dones", "discounts")
    grad_inputs = ("quantiles",)

    def __init__(self, batch: int, branch_sizes, n_quantiles: int, n_target: int, kappa: float = KAPPA):
        self.batch, self.n_quantiles, self.n_target = int(batch), int(n_quantiles), int(n_target)
        self.branch_sizes = tuple(int(a) for a in branch_sizes)
        self.n_branches, self.max_actions = len(self.branch_sizes), max(self.branch_sizes)
        self.total_actions = sum(self.branch_sizes)
        if not kappa > 0:
            raise ValueError(f"quantile Huber loss: kappa must be > 0 (got {kappa})")
        self.kappa = float(kappa)
        arena = Arena("iqn_loss")
        arena.add("d_quantiles", (self.batch * self.n_quantiles, self.total_actions), np.float32)
        arena.add("reg", (self.batch, self.n_branches), np.float32)
        arena.add("per_sample", (self.batch,), np.float32)
        arena.add("loss", (1,), np.float32)
        arena.add("branch_sizes", (self.n_branches,), np.int32)
        arena.add("branch_offsets", (self.n_branches,), np.int32)
        arena.add("no_mask", (1, 1, 1), np.uint8)
        arena.allocate()
        arena.load({"branch_sizes": np.asarray(self.branch_sizes, np.int32),
                    "branch_offsets": branch_offsets(self.branch_sizes).astype(np.int32)})
        self.arena = arena

    def grad(self, name: str):
        return self.arena["d_quantiles"]

    def compute(self, x: dict, stream) -> None:
        B, N, Np, S = self.batch, self.n_quantiles, self.n_target, self.total_actions
        if tuple(x["quantiles"].shape) != (B * N, S) or tuple(x["target_quantiles"].shape) != (B * Np, S):
            raise ValueError(f"iqn loss: quantiles {tuple(x['quantiles'].shape)} / target "
                             f"{tuple(x['target_quantiles'].shape)}, expected {(B * N, S)} / {(B * Np, S)}")
        if tuple(x["tau"].shape) != (B, N):
            raise ValueError(f"iqn loss: tau has shape {tuple(x['tau'].shape)}, expected {(B, N)}")
        mask = x.get("next_mask")
        use_mask = mask is not None
        grid = (max(1, -(-B // BLOCK)), self.n_branches)
        quantile_huber_kernel[grid, BLOCK, stream](
            x["quantiles"], x["tau"], x["target_quantiles"], x["next_q"], x["actions"], x["rewards"], x["dones"],
            x["discounts"], self.arena["branch_sizes"], self.arena["branch_offsets"],
            mask if use_mask else self.arena["no_mask"], np.int32(1 if use_mask else 0), np.int64(N), np.int64(Np),
            np.float32(self.kappa), np.float32(1.0 / self.kappa), np.float32(1.0 / Np),
            np.float32(1.0 / (B * self.n_branches)), self.arena["reg"], self.arena["d_quantiles"])
        c51_loss_reduce_kernel[1, c51.REDUCE_BLOCK, stream](
            self.arena["reg"], self.per_sample, np.int32(0), np.float32(1.0 / self.n_branches),
            np.float32(1.0 / B), self.per_sample, self.loss)
