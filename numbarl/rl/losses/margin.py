"""Large-margin expert loss on one branch of the C51 head (DQfD, Hester et al. 2018, Eq. 2), for the
samples that carry a label (E7 hindsight labels: numbarl/rl/feedback/hindsight.py).

For sample b with label a_E = label[b] >= 0 on branch k (the direction branch), from the ONLINE
pass's logits and lse: p[a, z] = softmax_z(logits[b,k,a,:]), Q[a] = Σ_z p[a,z] z_z and

    J[b] = max_a (Q[a] + l [a != a_E]) − Q[a_E]        (>= 0; 0 once a_E leads by the margin l)
    L    = scale · Σ_b [label[b] >= 0] J[b]              scale = lambda_E / B (a device scalar)

Gradient (a* = the argmax above, ties to the lowest index; ∂Q_a/∂logits_{a,z} = p_z (z_z − Q_a)):

    ∂L/∂logits[b,k,a,z] = scale · ([a = a*] − [a = a_E]) · p[a,z] (z_z − Q[a])

zero for unlabelled samples, other branches and padding actions. The weight is read from device
memory so it can decay from epoch to epoch without re-capturing the train step (the loss is
applied with weight 1 through the loss contract, numbarl/rl/losses/base.py).

Thread mapping: `margin_kernel`, one thread per sample, writes its whole gradient row block (zeros
outside branch k); the C51 loss's fixed-order single-block reduction gives per_sample and the loss.
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda import launch
from numbarl.cuda.runtime import Arena, cuda
from numbarl.rl.losses import c51
from numbarl.rl.losses.base import Loss
from numbarl.rl.losses.c51 import c51_loss_reduce_kernel

_cuda = cuda()

BLOCK = launch.shape(gpu=128, sim=16)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


def margin_ref(logits, labels, support, branch: int, n_actions: int, margin: float, scale: float):
    """(loss, per_sample [B], d_logits) in float64 (module docstring); labels < 0: no term."""
    logits = np.asarray(logits, np.float64)
    B = logits.shape[0]
    z = np.asarray(support, np.float64)
    d = np.zeros_like(logits)
    per = np.zeros(B)
    for b in range(B):
        aE = int(labels[b])
        if aE < 0:
            continue
        x = logits[b, branch, :n_actions]
        x = x - x.max(axis=-1, keepdims=True)
        p = np.exp(x)
        p /= p.sum(axis=-1, keepdims=True)
        q = p @ z
        lifted = q + margin * (np.arange(n_actions) != aE)
        star = int(np.argmax(lifted))
        per[b] = lifted[star] - q[aE]
        g = np.zeros(n_actions)
        g[star] += 1.0
        g[aE] -= 1.0
        d[b, branch, :n_actions] = scale * g[:, None] * p * (z[None, :] - q[:, None])
    return float(scale * per.sum()), per, d


@_cuda.jit(cache=True)
def margin_kernel(logits, lse, labels, support, branch, n_actions, margin, scale, per, d_logits):
    """One thread per sample (module docstring)."""
    b = _cuda.grid(1)
    B, nb, A, Z = logits.shape[0], logits.shape[1], logits.shape[2], logits.shape[3]
    if b >= B:
        return
    for k in range(nb):
        for a in range(A):
            for j in range(Z):
                d_logits[b, k, a, j] = _ZERO
    aE = np.int64(labels[b])
    per[b, 0] = _ZERO
    if aE < 0:
        return
    best = np.float32(-3.4e38)
    star = 0
    q_e = _ZERO
    for a in range(n_actions):
        q = _ZERO
        for j in range(Z):
            q += math.exp(logits[b, branch, a, j] - lse[b, branch, a]) * support[j]
        if a == aE:
            q_e = q
        lifted = q if a == aE else q + margin
        if lifted > best:
            best = lifted
            star = a
    per[b, 0] = best - q_e
    if star == aE:
        return
    s = scale[0]
    for t in range(2):  # a* (+), then the label (-)
        a = star if t == 0 else aE
        q = _ZERO
        for j in range(Z):
            q += math.exp(logits[b, branch, a, j] - lse[b, branch, a]) * support[j]
        g = s if t == 0 else -s
        for j in range(Z):
            p = math.exp(logits[b, branch, a, j] - lse[b, branch, a])
            d_logits[b, branch, a, j] = g * p * (support[j] - q)


class MarginLoss(Loss):
    """DQfD's large-margin loss on one branch of a branched C51 head (module docstring). Inputs:
    the online pass's "logits" and "lse", the per-sample "labels" (int32 [B], -1 = none) and the
    head's device "support"."""

    name = "margin"
    inputs = ("logits", "lse", "labels", "support")
    grad_inputs = ("logits",)

    def __init__(self, batch: int, branch_sizes, n_atoms: int, branch: int = 0, margin: float = 0.8):
        self.batch = int(batch)
        self.branch_sizes = tuple(int(a) for a in branch_sizes)
        self.branch, self.margin = int(branch), float(margin)
        self.n_atoms = int(n_atoms)
        nb, A = len(self.branch_sizes), max(self.branch_sizes)
        arena = Arena("margin_loss")
        arena.add("d_logits", (self.batch, nb, A, self.n_atoms), np.float32)
        arena.add("per", (self.batch, 1), np.float32)
        arena.add("per_sample", (self.batch,), np.float32)
        arena.add("loss", (1,), np.float32)
        arena.add("scale", (1,), np.float32)
        arena.allocate()
        arena.load({"scale": np.zeros(1, np.float32)})
        self.arena = arena

    def set_weight(self, lam: float) -> None:
        """lambda_E (the device scale is lambda_E / B); host copy, between replays."""
        self.arena.load({"scale": np.array([lam / self.batch], np.float32)})

    def grad(self, name: str):
        return self.arena["d_logits"]

    def compute(self, x: dict, stream) -> None:
        logits = x["logits"]
        if tuple(logits.shape) != tuple(self.arena["d_logits"].shape):
            raise ValueError(f"margin: logits {tuple(logits.shape)} do not match {tuple(self.arena['d_logits'].shape)}")
        margin_kernel[max(1, -(-self.batch // BLOCK)), BLOCK, stream](
            logits, x["lse"], x["labels"], x["support"], np.int64(self.branch),
            np.int64(self.branch_sizes[self.branch]), np.float32(self.margin), self.arena["scale"],
            self.arena["per"], self.arena["d_logits"])
        # per_sample = J[b]; loss = Σ_b J[b] / B (its weight lambda_E is in the gradient's scale)
        c51_loss_reduce_kernel[1, c51.REDUCE_BLOCK, stream](
            self.arena["per"], self.per_sample, np.int32(0), np.float32(1.0), np.float32(1.0 / self.batch),
            self.per_sample, self.loss)
