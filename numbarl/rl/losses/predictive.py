"""Predictive coding: the online trunk's features of s_t, through a linear predictor, predict the target
network's trunk features of the n-step next state (issue 15, spec T3): the normalized-L2 objective of
self-predictive representations (Schwarzer et al. 2021, "Data-Efficient Reinforcement Learning with
Self-Predictive Representations", Eq. 4) WITHOUT its action-conditioned transition model: the predictor
sees h(s_t) only, so the part of the next state the actions decide (the portfolio features) is predicted
on average over the behaviour policy's actions; the market part does not depend on them. The trunk
learns features that carry what comes next; the target network (Polyak-averaged) and the predictor
keep it from collapsing to a constant, as in SPR and BYOL (Grill et al. 2020).

For sample b with prediction p_b = P(h(s_t)) [H] (the agent's ``head.pc`` Linear on the online pass's
trunk output) and target t_b = h_target(s_{t+n}) [H] (the target pass's trunk output on next_obs, a
constant), SPR's normalized L2 (2 − 2 cos):

    p̂ = p / ‖p‖,  t̂ = t / ‖t‖            (a zero vector, ‖·‖ < 1e-12, normalizes to 0: no gradient)
    per_sample[b] = m_b · ‖p̂_b − t̂_b‖² = m_b · (2 − 2 p̂_b·t̂_b)   (with t̂ = 0: m_b · 1 (p̂ alone))
    L = (1/B) Σ_b per_sample[b],    m_b = 1 − done_b (no next state to predict past an episode's end)

computed as ‖p̂‖² + ‖t̂‖² − 2 p̂·t̂ so a zero vector is handled by the same formula. Gradient
(t̂ constant; ∂p̂/∂p = (I − p̂p̂ᵀ)/‖p‖):

    ∂L/∂p_b = −(2 m_b / B) · (t̂_b − (p̂_b·t̂_b) p̂_b) / ‖p_b‖

Thread mapping: ``predictive_kernel``, one thread per sample b: three dot products over H in order
(‖p‖², ‖t‖², p·t), then a second pass writing ∂L/∂p; per_sample[b]; then the C51 loss's one-block
fixed-order reduction for L. No atomics.
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda import launch
from numbarl.cuda.runtime import Arena, cuda
from numbarl.rl.losses import c51
from numbarl.rl.losses.base import Loss
from numbarl.rl.losses.c51 import c51_loss_reduce_kernel

_cuda = cuda()  # the backend (GPU or simulator), selected once

BLOCK = launch.shape(gpu=128, sim=16)  # threads per block of the per-sample kernel
NORM_EPS = 1e-12  # a norm below this normalizes to the zero vector

_ZERO, _ONE, _TWO = np.float32(0.0), np.float32(1.0), np.float32(2.0)
_EPS = np.float32(NORM_EPS)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def _unit(v):
    n = np.linalg.norm(v, axis=1, keepdims=True)
    safe = np.where(n < NORM_EPS, 1.0, n)
    return np.where(n < NORM_EPS, 0.0, v / safe), n


def predictive_ref(pred, target, dones):
    """(loss, per_sample [B], dpred [B, H]) in float64 (module docstring)."""
    p = np.asarray(pred, np.float64)
    t = np.asarray(target, np.float64)
    m = 1.0 - np.asarray(dones, np.float64).reshape(-1)
    B = p.shape[0]
    ph, pn = _unit(p)
    th, _ = _unit(t)
    cos = (ph * th).sum(1)
    per_sample = m * ((ph * ph).sum(1) + (th * th).sum(1) - 2.0 * cos)
    live = (pn[:, 0] >= NORM_EPS)
    scale = np.where(live, -2.0 * m / B / np.where(live, pn[:, 0], 1.0), 0.0)
    dpred = scale[:, None] * (th - cos[:, None] * ph)
    return float(per_sample.mean()), per_sample, dpred


# ---------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def predictive_kernel(pred, target, dones, grad_scale, reg, dpred):
    """One thread per sample b: the normalized-L2 term into reg[b, 0] and ∂L/∂p into dpred[b]."""
    b = _cuda.grid(1)
    B = pred.shape[0]
    if b >= B:
        return
    H = pred.shape[1]
    pp = _ZERO
    tt = _ZERO
    pt = _ZERO
    for j in range(H):
        p = pred[b, j]
        t = target[b, j]
        pp += p * p
        tt += t * t
        pt += p * t
    pn = math.sqrt(pp)
    tn = math.sqrt(tt)
    ip = _ZERO
    it = _ZERO
    if pn >= _EPS:
        ip = _ONE / pn
    if tn >= _EPS:
        it = _ONE / tn
    cos = pt * ip * it
    m = _ONE - np.float32(dones[b])
    reg[b, 0] = m * (pp * ip * ip + tt * it * it - _TWO * cos)
    s = -(_TWO * m * grad_scale) * ip
    for j in range(H):
        dpred[b, j] = s * (target[b, j] * it - cos * (pred[b, j] * ip))


# ---------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------
class PredictiveLoss(Loss):
    """Predictive coding (module docstring). Inputs: "pred" [B, H] (the predictor's output), "target"
    [B, H] (the target network's trunk features of next_obs) and "dones" [B]."""

    name = "predictive"
    inputs = ("pred", "target", "dones")
    grad_inputs = ("pred",)

    def __init__(self, batch: int, width: int):
        self.batch, self.width = int(batch), int(width)
        arena = Arena("predictive_loss")
        arena.add("dpred", (self.batch, self.width), np.float32)
        arena.add("reg", (self.batch, 1), np.float32)
        arena.add("per_sample", (self.batch,), np.float32)
        arena.add("loss", (1,), np.float32)
        arena.allocate()
        self.arena = arena

    def grad(self, name: str):
        return self.arena["dpred"]

    def compute(self, x: dict, stream) -> None:
        pred, target, dones = x["pred"], x["target"], x["dones"]
        B, H = self.batch, self.width
        if tuple(pred.shape) != (B, H) or tuple(target.shape) != (B, H) or tuple(dones.shape) != (B,):
            raise ValueError(f"predictive loss: pred {tuple(pred.shape)} / target {tuple(target.shape)} / dones "
                             f"{tuple(dones.shape)}, expected {(B, H)} / {(B, H)} / {(B,)}")
        predictive_kernel[max(1, -(-B // BLOCK)), BLOCK, stream](
            pred, target, dones, np.float32(1.0 / B), self.arena["reg"], self.arena["dpred"])
        c51_loss_reduce_kernel[1, c51.REDUCE_BLOCK, stream](
            self.arena["reg"], self.per_sample, np.int32(0), np.float32(1.0), np.float32(1.0 / B),
            self.per_sample, self.loss)
