"""Binary cross-entropy of the recursive-confidence head (issue 14 item 8; numbarl/rl/nets/confidence.py)
against a bootstrapped target: was the agent's directional conviction at s right?

The origin notes give only the name ("recursive_confidence_backward … deterministic reduce"); this is
numbarl's interpretation (../shared COMPONENTS A6), decided here and to be judged by an A/B.

For sample b of the train batch (shapes [B] unless noted):

    z[b]     the online confidence head's logit at s = obs          (the only input differentiated)
    z′[b]    the TARGET network's confidence logit at s′ = next_obs  (the n-step next state; a constant)
    g[b]     = Q(s, direction, long) − Q(s, direction, short)       the online conviction (q_gap; a constant)
    d[b]     = +1 if the taken direction is long, −1 if short, 0 if flat
    R[b]     the sampled n-step return R_n (discounted, the replay's), done[b] its window's episode end

    informative[b] = d ≠ 0 and |R| ≥ ε                               (ε = agent.confidence_epsilon)
    y[b] = 1{R·d·g > 0}           if informative       the market moved the way the conviction said
           σ(z′[b])               elif not done        the recursive part: the target net's confidence at s′
           1/2                    else                 an episode end with nothing learned: no information

R·d is the sign of the market move over the window as the taken side saw it (a long's profit is an up
move, a short's a down move), so "R_n has the sign of q_gap" is judged on the move, not on the side's
P&L: a profitable exploratory short against a long conviction is a wrong conviction. A flat direction
(hold / close) or a return below ε carries no verdict on the conviction (no position, or nothing
realized) and takes the bootstrap, as a TD target would. g = 0 exactly never counts as right.

The loss (the stable logit form of −y log σ(z) − (1−y) log(1−σ(z))) and its gradient:

    per_sample[b] = max(z, 0) − y·z + log1p(e^{−|z|}),     L = (1/B) Σ_b per_sample[b]
    ∂L/∂z[b]      = (σ(z[b]) − y[b]) / B                    (y is a constant: no gradient through z′ or g)

e.g. z = 0, informative and right (y = 1): per_sample = log 2, ∂L/∂z = −1/(2B); bootstrapped with
z′ = 0 (y = 1/2): per_sample = log 2, ∂L/∂z = 0.

The loss also leaves y [B], c = σ(z) [B] and boot [B] (1 where y = σ(z′)) in its arena: the agent's
stats read the batch means of c and boot (confidence_mean, confidence_boot_frac). The loss is
unweighted by the replay weights (an auxiliary loss, like IQL's); agent.confidence_weight scales its
gradient through Loss.apply.

Thread mapping: `confidence_kernel`, one thread per sample b (grid ceil(B / BLOCK)); then the C51 loss's
one-block fixed-order reduction (`c51_loss_reduce_kernel`) for per_sample and L. No atomics.
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda import launch
from numbarl.cuda.runtime import Arena, cuda
from numbarl.env.params import BR_DIRECTION, DIR_FLAT, DIR_LONG, DIR_SHORT
from numbarl.rl.losses import c51
from numbarl.rl.losses.base import Loss
from numbarl.rl.losses.c51 import c51_loss_reduce_kernel
from numbarl.rl.nets.confidence import sigmoid_ref

_cuda = cuda()  # the backend (GPU or simulator), selected once

BLOCK = launch.shape(gpu=256, sim=16)  # threads per block of the per-sample kernel
EPSILON = 1e-6  # |R_n| below this carries no verdict (a flat window's return is exactly 0)

_ZERO = np.float32(0.0)
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)
_NAN = np.float32(np.nan)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def confidence_target_ref(q, actions, rewards, dones, z_next, epsilon: float = EPSILON):
    """(y [B], boot [B]) in float64: the bootstrapped target of the module docstring. q [B, n_branches,
    max_actions] (online Q at obs), actions [B, n_branches], rewards [B] (R_n), dones [B], z_next [B, 1]
    or [B] (the target network's confidence logit at next_obs)."""
    q = np.asarray(q, np.float64)
    a = np.asarray(actions, np.int64)[:, BR_DIRECTION]
    r = np.asarray(rewards, np.float64).reshape(-1)
    done = np.asarray(dones).reshape(-1) != 0
    gap = q[:, BR_DIRECTION, DIR_LONG] - q[:, BR_DIRECTION, DIR_SHORT]
    side = np.where(a == DIR_LONG, 1.0, np.where(a == DIR_SHORT, -1.0, 0.0))
    informative = (side != 0) & (np.abs(r) >= epsilon)
    right = (r * side * gap > 0).astype(np.float64)
    c_next = sigmoid_ref(np.asarray(z_next, np.float64).reshape(-1))
    y = np.where(informative, right, np.where(done, 0.5, c_next))
    boot = (~informative & ~done).astype(np.float64)
    return y, boot


def confidence_ref(z, q, actions, rewards, dones, z_next, epsilon: float = EPSILON):
    """(loss, per_sample [B], dz [B, 1], y [B], boot [B], c [B]) in float64 (module docstring); z [B, 1]
    or [B] is the online head's logit at obs."""
    z = np.asarray(z, np.float64).reshape(-1)
    B = z.shape[0]
    y, boot = confidence_target_ref(q, actions, rewards, dones, z_next, epsilon)
    per_sample = np.maximum(z, 0.0) - y * z + np.log1p(np.exp(-np.abs(z)))
    c = sigmoid_ref(z)
    dz = ((c - y) / B).reshape(B, 1)
    return float(per_sample.mean()), per_sample, dz, y, boot, c


# ---------------------------------------------------------------------------------------------
# device functions and kernel
# ---------------------------------------------------------------------------------------------
@_cuda.jit(device=True, inline=True)
def sigmoid_dev(z):
    """σ(z) in float32 without overflow: e^{−|z|} only."""
    if z >= _ZERO:
        return _ONE / (_ONE + math.exp(-z))
    e = math.exp(z)
    return e / (_ONE + e)


@_cuda.jit(cache=True)
def confidence_kernel(z, z_next, q, actions, rewards, dones, n_directions, epsilon, grad_scale, reg, y_out, conf,
                      boot, dz):
    """One thread per sample b: the target y (module docstring), the cross-entropy into reg[b, 0],
    y, c = σ(z) and the bootstrap flag into y_out, conf, boot, ∂L/∂z = (c − y)·grad_scale into dz[b, 0]."""
    b = _cuda.grid(1)
    B = z.shape[0]
    if b >= B:
        return
    a = actions[b, BR_DIRECTION]
    zb = z[b, 0]
    c = sigmoid_dev(zb)
    conf[b] = c
    if a < 0 or a >= n_directions:  # an action outside its branch: a loud NaN, no out-of-bounds read
        reg[b, 0] = _NAN
        y_out[b] = _NAN
        boot[b] = _ZERO
        dz[b, 0] = _ZERO
        return
    side = _ZERO
    if a == DIR_LONG:
        side = _ONE
    elif a == DIR_SHORT:
        side = -_ONE
    r = rewards[b]
    flag = _ZERO
    if side != _ZERO and abs(r) >= epsilon:  # a verdict: did the market move the way the conviction said?
        gap = q[b, BR_DIRECTION, DIR_LONG] - q[b, BR_DIRECTION, DIR_SHORT]
        y = _ZERO
        if r * side * gap > _ZERO:
            y = _ONE
    elif dones[b] == 0:  # no verdict: the target network's confidence at the n-step next state
        y = sigmoid_dev(z_next[b, 0])
        flag = _ONE
    else:  # an episode end without a verdict: no information
        y = _HALF
    reg[b, 0] = max(zb, _ZERO) - y * zb + math.log1p(math.exp(-abs(zb)))
    y_out[b] = y
    boot[b] = flag
    dz[b, 0] = (c - y) * grad_scale


# ---------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------
class ConfidenceLoss(Loss):
    """The confidence head's cross-entropy (module docstring). Inputs: "logits" [B, 1] (the online head at
    obs), "target_logits" [B, 1] (the target network's head at next_obs), "q" [B, n_branches, max_actions]
    (the online Q at obs), "actions", "rewards" [B] (R_n), "dones" [B]."""

    name = "confidence"
    inputs = ("logits", "target_logits", "q", "actions", "rewards", "dones")
    grad_inputs = ("logits",)

    def __init__(self, batch: int, branch_sizes, epsilon: float = EPSILON):
        self.batch = int(batch)
        self.branch_sizes = tuple(int(a) for a in branch_sizes)
        self.n_branches, self.max_actions = len(self.branch_sizes), max(self.branch_sizes)
        if self.branch_sizes[BR_DIRECTION] <= max(DIR_SHORT, DIR_FLAT, DIR_LONG):
            raise ValueError(f"confidence loss: the direction branch needs the short/flat/long actions "
                             f"(got branch sizes {self.branch_sizes})")
        if not float(epsilon) >= 0.0:
            raise ValueError(f"confidence loss: epsilon must be >= 0 (got {epsilon})")
        self.epsilon = float(epsilon)
        arena = Arena("confidence_loss")
        arena.add("dz", (self.batch, 1), np.float32)
        arena.add("reg", (self.batch, 1), np.float32)
        arena.add("y", (self.batch,), np.float32)
        arena.add("conf", (self.batch,), np.float32)
        arena.add("boot", (self.batch,), np.float32)
        arena.add("per_sample", (self.batch,), np.float32)
        arena.add("loss", (1,), np.float32)
        arena.allocate()
        self.arena = arena

    def grad(self, name: str):
        return self.arena["dz"]

    @property
    def target(self):
        """Device float32 [B]: y of the last compute()."""
        return self.arena["y"]

    @property
    def confidence(self):
        """Device float32 [B]: c = σ(z) of the last compute()."""
        return self.arena["conf"]

    @property
    def bootstrapped(self):
        """Device float32 [B]: 1 where y = σ(z′) (no verdict, not an episode end), else 0."""
        return self.arena["boot"]

    def compute(self, x: dict, stream) -> None:
        z, z_next, q, actions = x["logits"], x["target_logits"], x["q"], x["actions"]
        rewards, dones = x["rewards"], x["dones"]
        B, nb = self.batch, self.n_branches
        shapes = {"logits": (B, 1), "target_logits": (B, 1), "q": (B, nb, self.max_actions), "actions": (B, nb),
                  "rewards": (B,), "dones": (B,)}
        bad = {k: tuple(x[k].shape) for k, s in shapes.items() if tuple(x[k].shape) != s}
        if bad:
            raise ValueError(f"confidence loss: {bad} (expected {shapes})")
        confidence_kernel[max(1, -(-B // BLOCK)), BLOCK, stream](
            z, z_next, q, actions, rewards, dones, np.int32(self.branch_sizes[BR_DIRECTION]),
            np.float32(self.epsilon), np.float32(1.0 / B), self.arena["reg"], self.arena["y"], self.arena["conf"],
            self.arena["boot"], self.arena["dz"])
        c51_loss_reduce_kernel[1, c51.REDUCE_BLOCK, stream](
            self.arena["reg"], self.per_sample, np.int32(0), np.float32(1.0), np.float32(1.0 / B),
            self.per_sample, self.loss)
