"""The PPO loss on branched categorical logits and a value output (Schulman et al. 2017, Eq. 7 and 9).

Inputs of a minibatch of B samples, n_b action branches of A_k actions each (the logits of branch k
are columns [o_k, o_k + A_k) of one [B, Σ A_k] matrix, o_k = Σ_{j<k} A_j)::

    logits [B, Σ A_k] f32   value [B, 1] f32   actions [B, n_b] i32   mask [B, n_b, max A] u8
    logp_old [B] f32 (log-prob of the joint action when collected)   adv [B] f32   ret [B] f32

Per sample (float64 inside the thread, one thread per sample)::

    log π_k(a) = l_a − LSE_{a' : mask} l_a'         masked softmax per branch (masked actions: p = 0)
    log π(a)   = Σ_k log π_k(a_k)                   the joint action of independent branches
    H          = Σ_k H_k,  H_k = −Σ_a p_a log p_a
    ρ          = exp(log π(a) − logp_old)
    L_clip     = −min(ρ A, clip(ρ, 1 − ε, 1 + ε) A)
    L_v        = ½ (V − R)²
    ℓ          = L_clip + c_v L_v − c_e H          (per_sample; the loss is its batch mean)
    kl         = (ρ − 1) − log ρ                    (the k3 estimator of KL(old ‖ new), >= 0)
    clipped    = [|ρ − 1| > ε]

Gradients (of the batch mean; g = ∂L_clip/∂log π = −ρA when ρA <= clip(ρ)A, else 0 — the min picks
the unclipped term, which matches autograd of torch.min, ties splitting one gradient in two halves
of the same value)::

    ∂ℓ/∂l_a = (g ([a = a_k] − p_a) + c_e p_a (log p_a + H_k)) / B      for allowed a, 0 for masked
    ∂ℓ/∂V   = c_v (V − R) / B

The batch mean of ℓ is a fixed-order flat reduction (numbarl.cuda.reduce); no atomics.
``ppo_loss_ref`` is the float64 reference; numbarl/rl/torch_peer.py ``ppo_loss_and_grads`` the
PyTorch peer.
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda.launch import blocks
from numbarl.cuda.reduce import Reducer
from numbarl.cuda.runtime import Arena, cuda
from numbarl.rl.losses.base import Loss

_cuda = cuda()

BLOCK = 128
MAX_BRANCHES = 4  # per-branch LSE / entropy kept in thread-local arrays


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def ppo_loss_ref(logits, value, actions, logp_old, adv, ret, mask, branch_sizes, clip_eps=0.2, vf_coef=0.5,
                 ent_coef=0.01):
    """float64: (loss, {per_sample, policy, value, entropy, kl, clipped, logp}, d_logits, d_value)."""
    logits = np.asarray(logits, np.float64)
    B = logits.shape[0]
    mask = np.asarray(mask) != 0
    actions = np.asarray(actions, np.int64)
    logp = np.zeros(B)
    H = np.zeros(B)
    parts = []
    o = 0
    for k, n in enumerate(branch_sizes):
        lk = logits[:, o:o + n]
        mk = mask[:, k, :n]
        masked = np.where(mk, lk, -np.inf)
        m = masked.max(axis=1, keepdims=True)
        lse = m + np.log(np.exp(masked - m).sum(axis=1, keepdims=True))
        lp = np.where(mk, lk - lse, 0.0)
        p = np.where(mk, np.exp(lp), 0.0)
        hk = -(p * lp).sum(axis=1)
        logp += lp[np.arange(B), actions[:, k]]
        H += hk
        parts.append((o, n, lp, p, hk))
        o += n
    ratio = np.exp(logp - np.asarray(logp_old, np.float64))
    a = np.asarray(adv, np.float64)
    s1 = ratio * a
    s2 = np.clip(ratio, 1 - clip_eps, 1 + clip_eps) * a
    pl = -np.minimum(s1, s2)
    g = np.where(s1 <= s2, -a * ratio, 0.0)
    dv = np.asarray(value, np.float64).reshape(B) - np.asarray(ret, np.float64)
    vl = 0.5 * dv * dv
    per = pl + vf_coef * vl - ent_coef * H
    d_logits = np.zeros_like(logits)
    for k, (o, n, lp, p, hk) in enumerate(parts):
        onehot = np.zeros((B, n))
        onehot[np.arange(B), actions[:, k]] = 1.0
        d = g[:, None] * (onehot - p) + ent_coef * p * (lp + hk[:, None])
        d_logits[:, o:o + n] = np.where(mask[:, k, :n], d, 0.0) / B
    d_value = (vf_coef * dv / B).reshape(B, 1)
    out = {"per_sample": per, "policy": pl, "value": vl, "entropy": H,
           "kl": (ratio - 1.0) - (logp - np.asarray(logp_old, np.float64)),
           "clipped": (np.abs(ratio - 1.0) > clip_eps).astype(np.float64), "logp": logp}
    return float(per.mean()), out, d_logits, d_value


# ---------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def ppo_loss_kernel(logits, value, actions, logp_old, adv, ret, mask, offsets, sizes, clip_eps, vf_coef, ent_coef,
                    inv_b, per_sample, pl_out, vl_out, ent_out, kl_out, clip_out, d_logits, d_value):
    """One thread per sample (module docstring)."""
    i = _cuda.grid(1)
    if i >= logits.shape[0]:
        return
    nb = offsets.shape[0]
    lse = _cuda.local.array(MAX_BRANCHES, np.float64)
    hks = _cuda.local.array(MAX_BRANCHES, np.float64)
    logp = np.float64(0.0)
    H = np.float64(0.0)
    for k in range(nb):
        o = offsets[k]
        n = sizes[k]
        m = -np.inf
        for a in range(n):
            if mask[i, k, a] != 0:
                m = max(m, np.float64(logits[i, o + a]))
        s = np.float64(0.0)
        for a in range(n):
            if mask[i, k, a] != 0:
                s += math.exp(np.float64(logits[i, o + a]) - m)
        z = m + math.log(s)
        hk = np.float64(0.0)
        for a in range(n):
            if mask[i, k, a] != 0:
                lp = np.float64(logits[i, o + a]) - z
                hk -= math.exp(lp) * lp
        lse[k] = z
        hks[k] = hk
        logp += np.float64(logits[i, o + actions[i, k]]) - z
        H += hk
    d_old = logp - np.float64(logp_old[i])
    ratio = math.exp(d_old)
    A = np.float64(adv[i])
    s1 = ratio * A
    rc = min(max(ratio, 1.0 - clip_eps), 1.0 + clip_eps)
    s2 = rc * A
    g = np.float64(0.0)
    if s1 <= s2:
        lpi = -s1
        g = -A * ratio
    else:
        lpi = -s2
    dv = np.float64(value[i, 0]) - np.float64(ret[i])
    lv = 0.5 * dv * dv
    per_sample[i] = np.float32(lpi + vf_coef * lv - ent_coef * H)
    pl_out[i] = np.float32(lpi)
    vl_out[i] = np.float32(lv)
    ent_out[i] = np.float32(H)
    kl_out[i] = np.float32((ratio - 1.0) - d_old)
    clip_out[i] = np.float32(1.0) if abs(ratio - 1.0) > clip_eps else np.float32(0.0)
    for k in range(nb):
        o = offsets[k]
        n = sizes[k]
        z = lse[k]
        hk = hks[k]
        taken = actions[i, k]
        for a in range(n):
            d = np.float64(0.0)
            if mask[i, k, a] != 0:
                lp = np.float64(logits[i, o + a]) - z
                p = math.exp(lp)
                onehot = np.float64(1.0) if a == taken else np.float64(0.0)
                d = g * (onehot - p) + ent_coef * p * (lp + hk)
            d_logits[i, o + a] = np.float32(d * inv_b)
    d_value[i, 0] = np.float32(vf_coef * dv * inv_b)


# ---------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------
class PpoLoss(Loss):
    """Clipped surrogate + value + entropy on branched logits (module docstring); B samples."""

    name = "ppo"
    inputs = ("logits", "value", "actions", "logp_old", "adv", "ret", "mask")
    grad_inputs = ("logits", "value")

    def __init__(self, batch: int, branch_sizes, clip_eps: float = 0.2, vf_coef: float = 0.5, ent_coef: float = 0.01):
        self.batch = int(batch)
        self.branch_sizes = tuple(int(n) for n in branch_sizes)
        if len(self.branch_sizes) > MAX_BRANCHES:
            raise ValueError(f"PpoLoss: at most {MAX_BRANCHES} branches, got {len(self.branch_sizes)}")
        self.clip_eps, self.vf_coef, self.ent_coef = float(clip_eps), float(vf_coef), float(ent_coef)
        B, width = self.batch, sum(self.branch_sizes)
        a = Arena("loss.ppo")
        a.add("loss", (1,), np.float32)
        for name in ("per_sample", "policy", "value", "entropy", "kl", "clipped"):
            a.add(name, (B,), np.float32)
        a.add("d_logits", (B, width), np.float32)
        a.add("d_value", (B, 1), np.float32)
        a.add("offsets", (len(self.branch_sizes),), np.int32)
        a.add("sizes", (len(self.branch_sizes),), np.int32)
        a.allocate()
        a.load({"offsets": np.concatenate([[0], np.cumsum(self.branch_sizes)[:-1]]).astype(np.int32),
                "sizes": np.asarray(self.branch_sizes, np.int32)})
        self.arena = a
        self.reducer = Reducer(B)

    def grad(self, name: str):
        return {"logits": self.arena["d_logits"], "value": self.arena["d_value"]}[name]

    def compute(self, x: dict, stream) -> None:
        a, B = self.arena, self.batch
        ppo_loss_kernel[blocks(B, min(BLOCK, B)), min(BLOCK, B), stream](
            x["logits"], x["value"], x["actions"], x["logp_old"], x["adv"], x["ret"], x["mask"], a["offsets"], a["sizes"],
            np.float64(self.clip_eps), np.float64(self.vf_coef), np.float64(self.ent_coef), np.float64(1.0 / B),
            a["per_sample"], a["policy"], a["value"], a["entropy"], a["kl"], a["clipped"], a["d_logits"], a["d_value"])
        self.reducer.mean(a["per_sample"], a["loss"], stream)

    def means(self, out, slots: dict, stream) -> None:
        """out[slots[name]] = batch mean of each per-sample term ("policy", "value", "entropy", "kl",
        "clipped"), fixed-order reductions (the stats of a minibatch)."""
        for name, slot in slots.items():
            self.reducer.mean(self.arena[name], out, stream, at=slot)
