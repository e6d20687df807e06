"""Expectile loss of the IQL value head (Kostrikov, Nair & Levine 2021, "Offline RL with Implicit
Q-Learning", Eq. 5 and the asymmetric L₂ loss L₂^τ(u) = |τ − 1{u < 0}| · u²), on a branched action space.

For sample b with value V[b] (the value head's output on the online pass's trunk features, [B, 1]),
the taken action a_bk of each branch k and the TARGET network's expected Q on obs, Q′[b, k, a]
(E[Z] of the C51 head with target parameters; numbarl/rl/agents/dqn.py runs that pass), V is one
scalar per state and the action value it regresses to is the mean over branches of each branch's
Q at its taken action:

    Q̂[b]          = (1/n_branches) Σ_k Q′[b, k, a_bk]                   a constant (target network)
    u[b]          = Q̂[b] − V[b]                                          the taken plan's advantage
    w[b]          = τ if u[b] ≥ 0 else 1 − τ                             |τ − 1{u < 0}|
    per_sample[b] = w[b] · u[b]²,     L = (1/B) Σ_b per_sample[b]

τ = 0.5 is mean regression (w = 1/2: L = mean u² / 2, V → the batch mean of Q̂); τ → 1 approaches
the maximum of Q̂ over the behaviour data's actions (the in-sample max IQL is built on).
Gradient with respect to V (Q̂ is a constant; at u = 0 both sides give 0):

    ∂L/∂V[b] = −2 · w[b] · u[b] / B

The loss also leaves u [B] in its arena ("adv"): A(s, a_taken) = Q̂ − V, the advantage the agent
reports as a diagnostic (`iql_adv_mean`). The loss is unweighted (replay weights are not applied to
this auxiliary loss, like the IQN head's).

Thread mapping: `expectile_kernel`, one thread per sample b (grid ceil(B / BLOCK)): the branch
loop in order, per_sample's term into reg [B, 1], u and ∂L/∂V; then the C51 loss's one-block
fixed-order reduction (`c51_loss_reduce_kernel`) for per_sample and L. No atomics.
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda import launch
from numbarl.cuda.runtime import Arena, cuda
from numbarl.rl.losses import c51
from numbarl.rl.losses.base import Loss
from numbarl.rl.losses.c51 import c51_loss_reduce_kernel

_cuda = cuda()  # the backend (GPU or simulator), selected once

BLOCK = launch.shape(gpu=256, sim=16)  # threads per block of the per-sample kernel
EXPECTILE = 0.7  # τ of the IQL paper's locomotion runs (Kostrikov et al. 2021, Appendix B)

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_TWO = np.float32(2.0)
_NAN = np.float32(np.nan)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def taken_q_mean_ref(q, actions, branch_sizes=None):
    """Q̂[b] = mean over branches of q[b, k, a_bk] (float64 [B])."""
    q = np.asarray(q, np.float64)
    a = np.asarray(actions, np.int64)
    rows = np.arange(q.shape[0])[:, None]
    return q[rows, np.arange(q.shape[1])[None, :], a].mean(axis=1)


def expectile_ref(v, q, actions, branch_sizes=None, expectile: float = EXPECTILE):
    """(loss, per_sample [B], dV [B, 1], adv [B]) in float64 (module docstring).

    v [B, 1] (or [B]), q [B, n_branches, max_actions] (the target network's Q on obs), actions
    [B, n_branches]."""
    v = np.asarray(v, np.float64).reshape(-1)
    B = v.shape[0]
    u = taken_q_mean_ref(q, actions) - v
    w = np.where(u < 0, 1.0 - expectile, expectile)
    per_sample = w * u * u
    dv = (-2.0 * w * u / B).reshape(B, 1)
    return float(per_sample.mean()), per_sample, dv, u


# ---------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def expectile_kernel(v, q, actions, branch_sizes, inv_branches, expectile, grad_scale, reg, adv, dv):
    """One thread per sample b: Q̂ (branches in order), u = Q̂ − V, w·u² into reg[b, 0], u into
    adv[b], ∂L/∂V = −2·w·u·grad_scale into dv[b, 0]."""
    b = _cuda.grid(1)
    B = v.shape[0]
    if b >= B:
        return
    nb = actions.shape[1]
    s = _ZERO
    bad = False
    for k in range(nb):
        a = actions[b, k]
        if a < 0 or a >= branch_sizes[k]:  # an action outside its branch: a loud NaN, no out-of-bounds read
            bad = True
        else:
            s += q[b, k, a]
    if bad:
        reg[b, 0] = _NAN
        adv[b] = _NAN
        dv[b, 0] = _ZERO
        return
    u = s * inv_branches - v[b, 0]
    w = expectile
    if u < _ZERO:
        w = _ONE - expectile
    reg[b, 0] = w * u * u
    adv[b] = u
    dv[b, 0] = -(_TWO * w * u) * grad_scale


# ---------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------
class ExpectileLoss(Loss):
    """The IQL value head's expectile loss (module docstring). Inputs: "v" [B, 1] (the value head's
    output), "q" [B, n_branches, max_actions] (the target network's Q on obs) and "actions"."""

    name = "iql"
    inputs = ("v", "q", "actions")
    grad_inputs = ("v",)

    def __init__(self, batch: int, branch_sizes, expectile: float = EXPECTILE):
        self.batch = int(batch)
        self.branch_sizes = tuple(int(a) for a in branch_sizes)
        self.n_branches, self.max_actions = len(self.branch_sizes), max(self.branch_sizes)
        if not 0.0 < float(expectile) < 1.0:
            raise ValueError(f"expectile loss: the expectile must be in (0, 1) (got {expectile})")
        self.expectile = float(expectile)
        arena = Arena("iql_loss")
        arena.add("dv", (self.batch, 1), np.float32)
        arena.add("reg", (self.batch, 1), np.float32)
        arena.add("adv", (self.batch,), np.float32)
        arena.add("per_sample", (self.batch,), np.float32)
        arena.add("loss", (1,), np.float32)
        arena.add("branch_sizes", (self.n_branches,), np.int32)
        arena.allocate()
        arena.load({"branch_sizes": np.asarray(self.branch_sizes, np.int32)})
        self.arena = arena

    def grad(self, name: str):
        return self.arena["dv"]

    @property
    def adv(self):
        """Device float32 [B]: u = Q̂ − V of the last compute() (the taken plan's advantage)."""
        return self.arena["adv"]

    def compute(self, x: dict, stream) -> None:
        v, q, actions = x["v"], x["q"], x["actions"]
        B, nb = self.batch, self.n_branches
        if tuple(v.shape) != (B, 1) or tuple(q.shape) != (B, nb, self.max_actions) or tuple(actions.shape) != (B, nb):
            raise ValueError(f"iql loss: v {tuple(v.shape)} / q {tuple(q.shape)} / actions {tuple(actions.shape)}, "
                             f"expected {(B, 1)} / {(B, nb, self.max_actions)} / {(B, nb)}")
        expectile_kernel[max(1, -(-B // BLOCK)), BLOCK, stream](
            v, q, actions, self.arena["branch_sizes"], np.float32(1.0 / nb), np.float32(self.expectile),
            np.float32(1.0 / B), self.arena["reg"], self.arena["adv"], self.arena["dv"])
        c51_loss_reduce_kernel[1, c51.REDUCE_BLOCK, stream](
            self.arena["reg"], self.per_sample, np.int32(0), np.float32(1.0), np.float32(1.0 / B),
            self.per_sample, self.loss)
