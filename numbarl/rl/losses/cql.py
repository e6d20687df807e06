"""Conservative Q-learning regularizer on the branched C51 head's Q-values (Kumar et al. 2020, Eq. 4,
the CQL(H) term: logsumexp over the actions minus the data action's Q), per action branch.

For sample b and branch k with A_k actions, on the ONLINE pass's logits (the head's "logits" and
"lse" outputs on obs), p[b,k,a,z] = softmax_z(logits[b,k,a,:]) and the expected values
Q[b,k,a] = Σ_z p[b,k,a,z] · z_z:

    R[b, k]  = logsumexp_{a < A_k} Q[b,k,a] − Q[b,k,a_taken]              (>= 0)
    L        = (1/B) Σ_b (1/n_branches) Σ_k R[b, k]                        (the C51 loss's averaging)

pushes down the Q of actions the data does not take (a softened max) and up the taken one's.
Gradient with respect to the online logits (chain rule through E[Z]; ∂Q_a/∂logits_{a,z} =
p_z (z_z − Q_a)):

    g[b,k,a]            = (1/(B·n_branches)) · (softmax_{a' < A_k}(Q[b,k,:])_a − [a = a_taken])
    ∂L/∂logits[b,k,a,z] = g[b,k,a] · p[b,k,a,z] · (z_z − Q[b,k,a])         (0 at padding a >= A_k)

Through the loss contract (numbarl/rl/losses/base.py) the train step adds α · ∂L/∂logits into the
same buffer the C51 loss wrote (the gradient rule: the C51 loss writes first, CQL adds), so the
head's backward sees the sum; no atomics, fixed order.

Thread mapping: `cql_kernel`, one thread per (b, k): the branch's Q from its logits and lse, the
softmax over its actions, R[b,k] and the gradient row of every action (a loop over the atoms);
the C51 loss's `c51_loss_reduce_kernel` (ONE block): per-sample means and the scalar loss in a
fixed order.
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

BLOCK = launch.shape(gpu=128, sim=16)  # threads per block of the (sample, branch) kernel

_ZERO = np.float32(0.0)
_NEG_INF = np.float32(-np.inf)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def cql_ref(logits, actions, support, branch_sizes):
    """(loss, per_sample [B], d_logits [B, nb, A, Z]) in float64 (module docstring)."""
    logits = np.asarray(logits, np.float64)
    B, nb, A, Z = logits.shape
    z = np.asarray(support, np.float64)
    d = np.zeros_like(logits)
    per = np.zeros((B, nb))
    for k, n in enumerate(branch_sizes):
        x = logits[:, k, :n, :]
        x = x - x.max(axis=-1, keepdims=True)
        p = np.exp(x)
        p /= p.sum(axis=-1, keepdims=True)  # [B, n, Z]
        q = (p * z).sum(axis=-1)  # [B, n]
        m = q.max(axis=-1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(q - m).sum(axis=-1))
        taken = np.asarray(actions)[:, k]
        per[:, k] = lse - q[np.arange(B), taken]
        sm = np.exp(q - lse[:, None])
        onehot = np.zeros_like(sm)
        onehot[np.arange(B), taken] = 1.0
        g = (sm - onehot) / (B * nb)  # [B, n]
        d[:, k, :n, :] = g[:, :, None] * p * (z[None, None, :] - q[:, :, None])
    per_sample = per.mean(axis=1)
    return float(per_sample.mean()), per_sample, d


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def cql_kernel(logits, lse, actions, support, branch_sizes, grad_scale, reg, d_logits):
    """One thread per (sample b, branch k): R[b,k] into reg and the branch's gradient rows."""
    b = _cuda.blockIdx.x * _cuda.blockDim.x + _cuda.threadIdx.x
    k = _cuda.blockIdx.y
    B = logits.shape[0]
    A = logits.shape[2]
    Z = logits.shape[3]
    if b >= B:
        return
    n = branch_sizes[k]
    # Q of each action from its logits and log-sum-exp (the head's outputs): p = exp(logit - lse)
    qmax = _NEG_INF
    for a in range(n):
        q = _ZERO
        for j in range(Z):
            q += math.exp(logits[b, k, a, j] - lse[b, k, a]) * support[j]
        if q > qmax:
            qmax = q
    s = _ZERO
    for a in range(n):
        q = _ZERO
        for j in range(Z):
            q += math.exp(logits[b, k, a, j] - lse[b, k, a]) * support[j]
        s += math.exp(q - qmax)
    q_lse = qmax + math.log(s)
    taken = actions[b, k]
    for a in range(A):
        if a >= n:
            for j in range(Z):
                d_logits[b, k, a, j] = _ZERO
            continue
        q = _ZERO
        for j in range(Z):
            q += math.exp(logits[b, k, a, j] - lse[b, k, a]) * support[j]
        g = math.exp(q - q_lse)
        if a == taken:
            g -= np.float32(1.0)
            reg[b, k] = q_lse - q
        g *= grad_scale
        for j in range(Z):
            p = math.exp(logits[b, k, a, j] - lse[b, k, a])
            d_logits[b, k, a, j] = g * p * (support[j] - q)


# ---------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------
class CqlLoss(Loss):
    """The CQL(H) regularizer of a branched C51 head (module docstring). Inputs: the online pass's
    "logits" and "lse" (the head's outputs with "q" declared) and the taken "actions"."""

    name = "cql"
    inputs = ("logits", "lse", "actions")
    grad_inputs = ("logits",)

    def __init__(self, batch: int, branch_sizes, support: np.ndarray):
        self.batch = int(batch)
        self.branch_sizes = tuple(int(a) for a in branch_sizes)
        self.n_branches, self.max_actions = len(self.branch_sizes), max(self.branch_sizes)
        self.n_atoms = int(len(support))
        arena = Arena("cql_loss")
        arena.add("d_logits", (self.batch, self.n_branches, self.max_actions, self.n_atoms), np.float32)
        arena.add("reg", (self.batch, self.n_branches), np.float32)
        arena.add("per_sample", (self.batch,), np.float32)
        arena.add("loss", (1,), np.float32)
        arena.add("support", (self.n_atoms,), np.float32)
        arena.add("branch_sizes", (self.n_branches,), np.int32)
        arena.allocate()
        arena.load({"support": np.asarray(support, np.float32),
                    "branch_sizes": np.asarray(self.branch_sizes, np.int32)})
        self.arena = arena

    @classmethod
    def for_head(cls, head, batch: int) -> "CqlLoss":
        return cls(batch, head.branch_sizes, head.support_host)

    def grad(self, name: str):
        return self.arena["d_logits"]

    def compute(self, x: dict, stream) -> None:
        logits, lse, actions = x["logits"], x["lse"], x["actions"]
        shape = (self.batch, self.n_branches, self.max_actions, self.n_atoms)
        if tuple(logits.shape) != shape or tuple(lse.shape) != shape[:3]:
            raise ValueError(f"cql: logits {tuple(logits.shape)} / lse {tuple(lse.shape)} do not match the "
                             f"head's {shape}")
        grid = (max(1, -(-self.batch // BLOCK)), self.n_branches)
        cql_kernel[grid, BLOCK, stream](logits, lse, actions, self.arena["support"], self.arena["branch_sizes"],
                                        np.float32(1.0 / (self.batch * self.n_branches)), self.arena["reg"],
                                        self.arena["d_logits"])
        # per-sample means over the branches and the batch mean: the C51 loss's fixed-order reduction
        c51_loss_reduce_kernel[1, c51.REDUCE_BLOCK, stream](
            self.arena["reg"], self.per_sample, np.int32(0), np.float32(1.0 / self.n_branches),
            np.float32(1.0 / self.batch), self.per_sample, self.loss)
