"""ICM losses and the intrinsic reward (Pathak, Agrawal, Efros & Darrell 2017, Eq. 2-7), on a branched
action space, with the models of numbarl/rl/nets/icm.py.

For sample b of a batch of B with trunk features φ′ = φ(s′) [B, H], the forward model's prediction
φ̂′ [B, H], the inverse model's logits [B, A] (branch k's A_k logits at [o_k, o_k + A_k)), the taken
actions a_bk and the episode-end flag done_b of the replay's n-step window:

    v_b     = 1 − done_b                                  1: s′ continues the episode s is in
    e_b     = ½ ‖φ̂′_b − φ′_b‖² / H                        forward error (Eq. 5; the mean over the H features),
                                                          the curiosity signal
    CE_bk   = logsumexp(logits_b[o_k : o_k + A_k]) − logits_b[o_k + a_bk]        inverse loss (Eq. 3)
    CE_b    = (1/K) Σ_k CE_bk                             mean over the K branches
    L_F     = (1/B) Σ_b v_b e_b,     L_I = (1/B) Σ_b v_b CE_b
    L       = β L_F + (1 − β) L_I                         Eq. 7's weighting (β = agent.curiosity_beta,
                                                          0.2 in the paper); per_sample[b] = v_b (β e_b + (1 − β) CE_b)

A sample whose window ended the episode (done_b = 1) has a reset state or an empty draw as s′: no
transition to model, so it neither trains ICM nor earns curiosity. Gradients (φ′ is a constant):

    ∂L/∂φ̂′_b         = β v_b (φ̂′_b − φ′_b) / (B H)
    ∂L/∂logits_b[o_k + j] = (1 − β) v_b (softmax_k(logits_b)_j − [j = a_bk]) / (B K)

Why the mean over the features (as the ICM of Burda et al.'s large-scale study computes its loss and
reward, ``reduce_mean(…, -1)``) rather than Pathak et al.'s sum: Adam does not care about a constant
factor, but the optimizer's global-norm clip does. The models' gradients join the one gradient norm
the C51 network is clipped by (numbarl/rl/optim.py). Measured with the float64 references at init
(trunk 64 → 512 → 512 ReLU, hidden 256, B = 1024, N(0, 1) observations, |φ| ≈ 0.09): the forward
model's gradient norm is 1.03 with the sum and 0.002 with the mean, and it grows about quadratically
with the feature scale (the error times the hidden activations), so with the sum features a few
times larger than at init would make ICM alone reach agent.max_grad_norm = 10 and clip the C51 update.

**The intrinsic reward** (Eq. 6, r_i = η/2 ‖φ̂′ − φ′‖², here η e_b with η = agent.curiosity_weight w;
the 1/H is absorbed by the running scale below, and without it η is per feature). The raw
error's scale is the trunk features' (their width, activation and growth during training), not a
reward unit, so by default it is divided by a running scale, the EMA of the batch mean error over the
continuing samples (as Burda et al. 2019, "Large-Scale Study of Curiosity-Driven Learning", §2.2,
normalize the intrinsic reward by a running estimate of its scale):

    ē        = Σ_b v_b e_b / Σ_b v_b                       this batch's mean error (skipped when Σ v = 0)
    scale    ← ē on the first step, then 0.99 scale + 0.01 ē   (device state, checkpointed; < 0: none yet)
    r_i[b]   = w · v_b · e_b / scale      (normalize; scale ≤ 1e-30 gives r_i = 0)
    r_i[b]   = w · v_b · e_b              (agent.curiosity_normalize = false)
    reward′[b] = reward[b] + r_i[b]       the batch reward the C51 target projection reads

So with normalization the mean intrinsic reward is about w reward units whatever the features are,
and a transition earns more than the mean exactly when the forward model predicts it worse than
usual. The error is the one of this step's forward pass (before the update), so the reward and the
model's training use the same numbers.

n-step windows: the replay's next_obs is s_{τ+m} (m ≤ agent.n_step steps after s_τ), so the
forward model predicts the features m steps ahead from the first action and the intrinsic reward is
added once per window (to R_n, undiscounted). With agent.n_step = 1 this is the paper's one-step
ICM; with n > 1 the transition modelled is the window's macro step. That reuses the double-DQN pass's
φ(next_obs) (no extra trunk pass) and matches what the C51 target bootstraps from.

Thread mapping (no atomics, fixed order):
  ``icm_diff_kernel``       one thread per (b, j) of [B, H]: diff = φ̂′ − φ′, ∂L/∂φ̂′ = β v_b diff / (B H)
  ``reduce.row_sumsq``      ‖diff_b‖² per row (numbarl/cuda/reduce.py: fixed lane order)
  ``icm_inverse_kernel``    one thread per sample: the branches in order (max, Σexp, CE, ∂L/∂logits),
                            e_b, CE_b, per_sample[b]
  ``icm_loss_reduce_kernel`` ONE block: Σ v e, Σ v CE, Σ v in a fixed tree → L, L_F, L_I, ē
  ``icm_reward_kernel``     ONE block: every thread derives the same scale, r_i and reward′ per row,
                            Σ r_i in a fixed tree; thread 0 writes the scale state and the stats
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda import launch, reduce
from numbarl.cuda.runtime import Arena, cuda
from numbarl.rl.losses.base import Loss
from numbarl.rl.nets.icm import branch_offsets

_cuda = cuda()  # the backend (GPU or simulator), selected once

BLOCK = launch.shape(gpu=256, sim=16)  # threads per block of the per-element and per-sample kernels
REDUCE_BLOCK = launch.shape(gpu=256, sim=16)  # threads of the one-block reductions (power of two)
SCALE_EMA = 0.99  # the running scale: scale ← 0.99 scale + 0.01 ē
SCALE_FLOOR = 1e-30  # below it the scale counts as zero: no intrinsic reward
BETA = 0.2  # β of L = β L_F + (1 − β) L_I (Pathak et al. 2017, §3: "β = 0.2")

# offsets of the stats slots the reward kernel writes (consecutive, registered by the agent)
ST_LOSS, ST_FORWARD, ST_INVERSE, ST_REWARD_MEAN, ST_SCALE = 0, 1, 2, 3, 4
STAT_NAMES = ("icm_loss", "icm_forward_loss", "icm_inverse_loss", "intrinsic_reward_mean", "icm_error_scale")

# terms [5] the reduction leaves: L, L_F, L_I, ē (mean error over the continuing samples), Σ v
T_LOSS, T_FORWARD, T_INVERSE, T_MEAN_ERROR, T_VALID = 0, 1, 2, 3, 4

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_NAN = np.float32(np.nan)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def icm_loss_ref(phi_hat, phi_next, logits, actions, dones, branch_sizes, beta: float = BETA) -> dict:
    """The losses and gradients of the module docstring in float64: {"loss", "forward_loss",
    "inverse_loss", "per_sample" [B], "error" [B] (v_b e_b), "ce" [B] (v_b CE_b), "mean_error" (ē, or
    None when no sample continues), "d_phi_hat" [B, H], "d_logits" [B, A]}."""
    phi_hat, phi_next = np.asarray(phi_hat, np.float64), np.asarray(phi_next, np.float64)
    logits, a = np.asarray(logits, np.float64), np.asarray(actions, np.int64)
    B, K = phi_hat.shape[0], len(branch_sizes)
    v = 1.0 - np.asarray(dones, np.float64)
    diff = phi_hat - phi_next
    e = 0.5 * np.sum(diff * diff, axis=1) / phi_hat.shape[1]
    ce = np.zeros(B)
    d_logits = np.zeros_like(logits)
    for k, (o, n) in enumerate(zip(branch_offsets(branch_sizes), branch_sizes)):
        seg = logits[:, o:o + n]
        m = seg.max(axis=1, keepdims=True)
        p = np.exp(seg - m)
        lse = m[:, 0] + np.log(p.sum(axis=1))
        p /= p.sum(axis=1, keepdims=True)
        ce += lse - seg[np.arange(B), a[:, k]]
        p[np.arange(B), a[:, k]] -= 1.0
        d_logits[:, o:o + n] = (1.0 - beta) * v[:, None] * p / (B * K)
    ce /= K
    forward_loss, inverse_loss = float(np.mean(v * e)), float(np.mean(v * ce))
    n_valid = float(v.sum())
    return {"loss": beta * forward_loss + (1.0 - beta) * inverse_loss, "forward_loss": forward_loss,
            "inverse_loss": inverse_loss, "per_sample": v * (beta * e + (1.0 - beta) * ce), "error": v * e,
            "ce": v * ce, "mean_error": float(np.sum(v * e) / n_valid) if n_valid > 0 else None,
            "d_phi_hat": beta * v[:, None] * diff / (B * phi_hat.shape[1]), "d_logits": d_logits}


def intrinsic_reward_ref(error, rewards, weight: float, scale: float, mean_error, normalize: bool = True):
    """(r_i [B], reward′ [B], the new scale) in float64 from the masked errors v_b e_b, the running
    scale before this step (< 0: none yet) and this batch's ē (None: no continuing sample)."""
    error = np.asarray(error, np.float64)
    if mean_error is not None:
        scale = mean_error if scale < 0 else SCALE_EMA * scale + (1.0 - SCALE_EMA) * mean_error
    if normalize:
        r_i = weight * error / scale if scale > SCALE_FLOOR else np.zeros_like(error)
    else:
        r_i = weight * error
    return r_i, np.asarray(rewards, np.float64) + r_i, scale


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def icm_diff_kernel(phi_hat, phi_next, dones, coef, diff, d_phi_hat):
    """One thread per (b, j): diff = φ̂′ − φ′; ∂L/∂φ̂′ = coef · v_b · diff (coef = β / (B H))."""
    i = _cuda.grid(1)
    B = phi_hat.shape[0]
    H = phi_hat.shape[1]
    if i >= B * H:
        return
    b = i // H
    j = i - b * H
    d = phi_hat[b, j] - phi_next[b, j]
    diff[b, j] = d
    d_phi_hat[b, j] = coef * (_ONE - dones[b]) * d


@_cuda.jit(cache=True)
def icm_inverse_kernel(logits, actions, dones, sumsq, branch_sizes, offsets, beta, grad_scale, inv_branches,
                       half_inv_dim, error, ce, per_sample, d_logits):
    """One thread per sample b: per branch (in order) the max, Σ exp, CE and ∂L/∂logits (times
    (1 − β) v_b grad_scale, grad_scale = 1 / (B K)); then e_b = sumsq[b] · half_inv_dim (½ / H), the
    masked error and CE
    and per_sample[b]. An action outside its branch makes the sample's terms NaN (a loud failure) and
    its gradient 0."""
    b = _cuda.grid(1)
    B = logits.shape[0]
    if b >= B:
        return
    nb = actions.shape[1]
    v = _ONE - dones[b]
    g = (_ONE - beta) * v * grad_scale
    total = _ZERO
    bad = False
    for k in range(nb):
        o = offsets[k]
        n = branch_sizes[k]
        a = actions[b, k]
        if a < 0 or a >= n:
            bad = True
            for j in range(n):
                d_logits[b, o + j] = _ZERO
            continue
        m = logits[b, o]
        for j in range(1, n):
            m = max(m, logits[b, o + j])
        s = _ZERO
        for j in range(n):
            s += math.exp(logits[b, o + j] - m)
        total += m + math.log(s) - logits[b, o + a]
        inv_s = _ONE / s
        for j in range(n):
            p = math.exp(logits[b, o + j] - m) * inv_s
            if j == a:
                p -= _ONE
            d_logits[b, o + j] = g * p
    e = sumsq[b] * half_inv_dim
    c = total * inv_branches
    if bad:
        c = _NAN
    error[b] = v * e
    ce[b] = v * c
    per_sample[b] = v * (beta * e + (_ONE - beta) * c)


@_cuda.jit(cache=True)
def icm_loss_reduce_kernel(error, ce, dones, beta, inv_batch, loss, terms):
    """ONE block: Σ_b v e, Σ_b v CE, Σ_b v (thread t folds b = t, t + REDUCE_BLOCK, … in order, then
    a fixed shared-memory tree); terms = (L, L_F, L_I, ē, Σ v), loss[0] = L. No atomics."""
    se = _cuda.shared.array(REDUCE_BLOCK, np.float32)
    sc = _cuda.shared.array(REDUCE_BLOCK, np.float32)
    sv = _cuda.shared.array(REDUCE_BLOCK, np.float32)
    t = _cuda.threadIdx.x
    B = error.shape[0]
    acc_e = _ZERO
    acc_c = _ZERO
    acc_v = _ZERO
    for b in range(t, B, REDUCE_BLOCK):
        acc_e += error[b]
        acc_c += ce[b]
        acc_v += _ONE - dones[b]
    se[t] = acc_e
    sc[t] = acc_c
    sv[t] = acc_v
    _cuda.syncthreads()
    stride = REDUCE_BLOCK // 2
    while stride > 0:
        if t < stride:
            se[t] += se[t + stride]
            sc[t] += sc[t + stride]
            sv[t] += sv[t + stride]
        _cuda.syncthreads()
        stride //= 2
    if t == 0:
        forward_loss = se[0] * inv_batch
        inverse_loss = sc[0] * inv_batch
        total = beta * forward_loss + (_ONE - beta) * inverse_loss
        loss[0] = total
        terms[T_LOSS] = total
        terms[T_FORWARD] = forward_loss
        terms[T_INVERSE] = inverse_loss
        terms[T_MEAN_ERROR] = se[0] / sv[0] if sv[0] > _ZERO else _ZERO
        terms[T_VALID] = sv[0]


@_cuda.jit(cache=True)
def icm_reward_kernel(error, rewards, terms, scale_state, weight, normalize, rewards_out, stats, first_slot):
    """ONE block: the running scale (every thread computes the same float64 update from the same
    inputs; thread 0 stores it after the barrier), r_i = w · error / scale (or w · error), reward′ =
    reward + r_i per row, Σ r_i in a fixed tree, then the stats slots first_slot + ST_*."""
    sr = _cuda.shared.array(REDUCE_BLOCK, np.float32)
    t = _cuda.threadIdx.x
    B = error.shape[0]
    scale = np.float64(scale_state[0])
    if terms[T_VALID] > _ZERO:
        mean_error = np.float64(terms[T_MEAN_ERROR])
        if scale < 0.0:
            scale = mean_error
        else:
            scale = SCALE_EMA * scale + (1.0 - SCALE_EMA) * mean_error
    scale32 = np.float32(scale)
    factor = np.float32(weight)
    if normalize != 0:
        factor = np.float32(weight / np.float64(scale32)) if np.float64(scale32) > SCALE_FLOOR else _ZERO
    acc = _ZERO
    for b in range(t, B, REDUCE_BLOCK):
        r = factor * error[b]
        rewards_out[b] = rewards[b] + r
        acc += r
    sr[t] = acc
    _cuda.syncthreads()  # every thread has read scale_state before thread 0 writes it
    stride = REDUCE_BLOCK // 2
    while stride > 0:
        if t < stride:
            sr[t] += sr[t + stride]
        _cuda.syncthreads()
        stride //= 2
    if t == 0:
        scale_state[0] = scale32
        stats[first_slot + ST_LOSS] = terms[T_LOSS]
        stats[first_slot + ST_FORWARD] = terms[T_FORWARD]
        stats[first_slot + ST_INVERSE] = terms[T_INVERSE]
        stats[first_slot + ST_REWARD_MEAN] = sr[0] / np.float32(B)
        stats[first_slot + ST_SCALE] = scale32


# ---------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------
class IcmLoss(Loss):
    """L = β L_F + (1 − β) L_I of the ICM models (module docstring). Inputs: "phi_hat" [B, H] (the
    forward model's output), "phi_next" [B, H] (the trunk features of s′, a constant), "logits" [B, A]
    (the inverse model's output), "actions" [B, K] and "dones" [B] (float32, the replay batch's).
    :meth:`intrinsic_reward` then turns this step's errors into reward′."""

    name = "icm"
    inputs = ("phi_hat", "phi_next", "logits", "actions", "dones")
    grad_inputs = ("phi_hat", "logits")

    def __init__(self, batch: int, feature_dim: int, branch_sizes, beta: float = BETA):
        self.batch, self.feature_dim = int(batch), int(feature_dim)
        self.branch_sizes = tuple(int(a) for a in branch_sizes)
        self.n_branches, self.n_actions = len(self.branch_sizes), int(sum(self.branch_sizes))
        if not 0.0 <= float(beta) <= 1.0:
            raise ValueError(f"icm loss: beta must be in [0, 1] (got {beta})")
        self.beta = float(beta)
        B, H, A = self.batch, self.feature_dim, self.n_actions
        arena = Arena("icm_loss")
        arena.add("diff", (B, H), np.float32)
        arena.add("sumsq", (B,), np.float32)
        arena.add("d_phi_hat", (B, H), np.float32)
        arena.add("d_logits", (B, A), np.float32)
        arena.add("error", (B,), np.float32)
        arena.add("ce", (B,), np.float32)
        arena.add("per_sample", (B,), np.float32)
        arena.add("loss", (1,), np.float32)
        arena.add("terms", (5,), np.float32)
        arena.add("rewards", (B,), np.float32)  # reward′ = reward + r_i
        arena.add("scale", (1,), np.float32)  # the running scale (< 0: none yet); checkpointed
        arena.add("branch_sizes", (self.n_branches,), np.int32)
        arena.add("offsets", (self.n_branches,), np.int32)
        arena.allocate()
        arena.load({"branch_sizes": np.asarray(self.branch_sizes, np.int32), "offsets": branch_offsets(self.branch_sizes),
                    "scale": np.array([-1.0], np.float32)})
        self.arena = arena

    def grad(self, name: str):
        return self.arena["d_phi_hat"] if name == "phi_hat" else self.arena["d_logits"]

    @property
    def error(self):
        """Device float32 [B]: v_b e_b of the last compute() (the forward error, 0 at episode ends)."""
        return self.arena["error"]

    @property
    def terms(self):
        """Device float32 [5]: (L, L_F, L_I, ē, Σ v) of the last compute()."""
        return self.arena["terms"]

    @property
    def rewards(self):
        """Device float32 [B]: reward′ = reward + r_i of the last intrinsic_reward()."""
        return self.arena["rewards"]

    @property
    def scale(self):
        """Device float32 [1]: the running scale of the forward error (< 0 before the first step)."""
        return self.arena["scale"]

    def compute(self, x: dict, stream) -> None:
        phi_hat, phi_next, logits, actions, dones = (x[n] for n in self.inputs)
        B, H, A, K = self.batch, self.feature_dim, self.n_actions, self.n_branches
        shapes = {"phi_hat": (B, H), "phi_next": (B, H), "logits": (B, A), "actions": (B, K), "dones": (B,)}
        for name, want in shapes.items():
            if tuple(x[name].shape) != want:
                raise ValueError(f"icm loss: {name} has shape {tuple(x[name].shape)}, expected {want}")
        a = self.arena
        icm_diff_kernel[launch.blocks(B * H, BLOCK), BLOCK, stream](phi_hat, phi_next, dones, np.float32(self.beta / (B * H)),
                                                                     a["diff"], a["d_phi_hat"])
        reduce.row_sumsq(a["diff"], a["sumsq"], stream)
        icm_inverse_kernel[launch.blocks(B, BLOCK), BLOCK, stream](
            logits, actions, dones, a["sumsq"], a["branch_sizes"], a["offsets"], np.float32(self.beta),
            np.float32(1.0 / (B * K)), np.float32(1.0 / K), np.float32(0.5 / H), a["error"], a["ce"], a["per_sample"], a["d_logits"])
        icm_loss_reduce_kernel[1, REDUCE_BLOCK, stream](a["error"], a["ce"], dones, np.float32(self.beta),
                                                        np.float32(1.0 / B), a["loss"], a["terms"])

    def intrinsic_reward(self, rewards, weight: float, normalize: bool, stats, first_slot: int, stream) -> None:
        """reward′ = rewards + r_i into self.rewards from the last compute()'s errors; the running
        scale advances; the stats slots first_slot + ST_* (STAT_NAMES) are written. Capturable."""
        if tuple(rewards.shape) != (self.batch,):
            raise ValueError(f"icm loss: rewards has shape {tuple(rewards.shape)}, expected {(self.batch,)}")
        icm_reward_kernel[1, REDUCE_BLOCK, stream](self.error, rewards, self.terms, self.scale, np.float64(weight),
                                                   np.int32(1 if normalize else 0), self.rewards, stats,
                                                   np.int64(first_slot))
