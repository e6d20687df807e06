"""Future-feature regression: the online trunk's features of s_t, through a linear head, regress chosen terms of
the n-step next observation (issue 15): an auxiliary task in the way of UNREAL's reward prediction (Jaderberg et
al. 2017, "Reinforcement Learning with Unsupervised Auxiliary Tasks", §3.2), with the terms named by the user.

Why beside predictive coding (numbarl/rl/losses/predictive.py). Predictive coding predicts the whole next trunk
output, and most of it is what the current bar already shows. A term such as ``trade_imb_prev*ret_1`` (how the
next bar's move followed its previous bar's flow) has, on the regime-walk market, the expectation r · c: the
hidden regime's sign. A trunk that regresses it well must carry the regime, which is what the temporal scan is
for. Each term is one obs column of next_obs or the product of two.

For sample b with prediction p_b = P(h(s_t)) [T] (the agent's ``head.ff`` Linear on the online pass's trunk
output), terms y_bj = next_obs[b, a_j] · next_obs[b, c_j] (or next_obs[b, a_j] for a one-column term), and
m_b = 1 − done_b (no next state past an episode's end):

    per_sample[b] = m_b · (1/T) Σ_j (p_bj − y_bj)²
    L = (1/B) Σ_b per_sample[b]
    ∂L/∂p_bj = 2 m_b (p_bj − y_bj) / (B · T)

Thread mapping: ``future_kernel``, one thread per sample b: the T terms in order (the squared errors summed in
j order, then the gradient row); per_sample[b]; then the C51 loss's one-block fixed-order reduction for L. No
atomics.
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda import launch
from numbarl.cuda.runtime import Arena, cuda
from numbarl.rl.losses import c51
from numbarl.rl.losses.base import Loss
from numbarl.rl.losses.c51 import c51_loss_reduce_kernel
from numbarl.rl.obs_columns import NO_COLUMN

_cuda = cuda()  # the backend (GPU or simulator), selected once

BLOCK = launch.shape(gpu=128, sim=16)  # threads per block of the per-sample kernel

_ZERO, _ONE, _TWO = np.float32(0.0), np.float32(1.0), np.float32(2.0)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def future_terms_ref(next_obs, first, second) -> np.ndarray:
    """y [B, T] in float64: next_obs[:, first_j] · next_obs[:, second_j] (one column where second_j < 0)."""
    x = np.asarray(next_obs, np.float64)
    first, second = np.asarray(first), np.asarray(second)
    y = x[:, first]
    two = second >= 0
    y[:, two] = y[:, two] * x[:, second[two]]
    return y


def future_ref(pred, next_obs, first, second, dones):
    """(loss, per_sample [B], dpred [B, T]) in float64 (module docstring)."""
    p = np.asarray(pred, np.float64)
    y = future_terms_ref(next_obs, first, second)
    m = 1.0 - np.asarray(dones, np.float64).reshape(-1)
    B, T = p.shape
    err = p - y
    per_sample = m * (err * err).sum(1) / T
    dpred = (2.0 * m / (B * T))[:, None] * err
    return float(per_sample.mean()), per_sample, dpred


# ---------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def future_kernel(pred, next_obs, first, second, dones, inv_t, grad_scale, reg, dpred):
    """One thread per sample b: the mean squared error of the T terms into reg[b, 0] and ∂L/∂p into dpred[b]
    (grad_scale = 2 / (B · T), inv_t = 1 / T)."""
    b = _cuda.grid(1)
    B = pred.shape[0]
    if b >= B:
        return
    T = pred.shape[1]
    m = _ONE - np.float32(dones[b])
    s = _ZERO
    for j in range(T):
        y = next_obs[b, first[j]]
        if second[j] >= 0:
            y = y * next_obs[b, second[j]]
        e = pred[b, j] - y
        s += e * e
        dpred[b, j] = (m * grad_scale) * e
    reg[b, 0] = m * (s * inv_t)


# ---------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------
class FutureFeatureLoss(Loss):
    """Future-feature regression (module docstring). Inputs: "pred" [B, T] (the head's output), "next_obs"
    [B, F] (the batch's n-step next observation) and "dones" [B]; the terms' columns are fixed at construction
    (first, second: int64 [T], second NO_COLUMN for a one-column term)."""

    name = "future_features"
    inputs = ("pred", "next_obs", "dones")
    grad_inputs = ("pred",)

    def __init__(self, batch: int, first, second, state_dim: int):
        first, second = np.asarray(first, np.int64), np.asarray(second, np.int64)
        if first.ndim != 1 or first.shape != second.shape or first.size < 1:
            raise ValueError(f"future-feature loss: first {first.shape} and second {second.shape} must be equal "
                             "non-empty 1-D column lists")
        if first.min() < 0 or max(first.max(), second.max()) >= state_dim or second.min() < NO_COLUMN:
            raise ValueError(f"future-feature loss: columns {first.tolist()} x {second.tolist()} outside an "
                             f"observation of {state_dim} columns")
        self.batch, self.n_terms, self.state_dim = int(batch), int(first.size), int(state_dim)
        arena = Arena("future_loss")
        arena.add("first", (self.n_terms,), np.int64)
        arena.add("second", (self.n_terms,), np.int64)
        arena.add("dpred", (self.batch, self.n_terms), np.float32)
        arena.add("reg", (self.batch, 1), np.float32)
        arena.add("per_sample", (self.batch,), np.float32)
        arena.add("loss", (1,), np.float32)
        arena.allocate()
        arena.load({"first": first, "second": second})
        self.arena = arena
        self.first, self.second = first, second

    def grad(self, name: str):
        return self.arena["dpred"]

    def compute(self, x: dict, stream) -> None:
        pred, next_obs, dones = x["pred"], x["next_obs"], x["dones"]
        B, T, F = self.batch, self.n_terms, self.state_dim
        if tuple(pred.shape) != (B, T) or tuple(next_obs.shape) != (B, F) or tuple(dones.shape) != (B,):
            raise ValueError(f"future-feature loss: pred {tuple(pred.shape)} / next_obs {tuple(next_obs.shape)} / "
                             f"dones {tuple(dones.shape)}, expected {(B, T)} / {(B, F)} / {(B,)}")
        future_kernel[max(1, -(-B // BLOCK)), BLOCK, stream](
            pred, next_obs, self.arena["first"], self.arena["second"], dones, np.float32(1.0 / T),
            np.float32(2.0 / (B * T)), self.arena["reg"], self.arena["dpred"])
        c51_loss_reduce_kernel[1, c51.REDUCE_BLOCK, stream](
            self.arena["reg"], self.per_sample, np.int32(0), np.float32(1.0), np.float32(1.0 / B),
            self.per_sample, self.loss)
