"""The Decision Transformer's loss: cross-entropy of each action branch at the state tokens (Chen et al. 2021, §3).

Inputs of B windows of L steps, n_b branches of A_k actions (branch k's logits are columns
[o_k, o_k + A_k) of the network's logits, one row per token, rows b·3L + 3t + kind;
numbarl/rl/nets/dt.py)::

    logits [B·3L, Σ A_k] f32      actions [B, L, n_b] i32 (the action taken at step t of window b)

Per sample (b, t), read at the state-token row r = b·3L + 3t + 1 (one thread, float64 inside)::

    ℓ_bt = Σ_k CE_k,   CE_k = LSE_a l_r,o_k+a − l_r,o_k+a_k       (the sum over the branches)
    L    = (1 / (B·L)) Σ_bt ℓ_bt                                   (per_sample [B·L], a fixed-order mean)
    ∂L/∂l_r,o_k+a = (softmax_a − [a = a_k]) / (B·L)                at state-token rows; 0 at the others
    correct_bt = (1/n_b) Σ_k [first argmax_a l_r,o_k+a = a_k]       (the share of branches predicted)

The paper's discrete-action loss is this cross-entropy; the actions are the behavior's own (always
allowed by the env's mask when taken), so no mask enters the loss. The mean is
numbarl.cuda.reduce.Reducer's fixed-order flat reduction: no atomics.
``dt_loss_ref`` is the float64 reference; numbarl/rl/torch_peer_dt.py the PyTorch peer.
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda.launch import blocks
from numbarl.cuda.reduce import Reducer
from numbarl.cuda.runtime import Arena, cuda
from numbarl.rl.losses.base import Loss
from numbarl.rl.nets.dt import KIND_STATE, TOKENS_PER_STEP, branch_offsets

_cuda = cuda()

BLOCK = 128


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def dt_loss_ref(logits, actions, branch_sizes):
    """float64: (loss, per_sample [B·L], correct [B·L], d_logits [B·3L, W])."""
    actions = np.asarray(actions, np.int64)
    B, L, nb = actions.shape
    logits = np.asarray(logits, np.float64).reshape(B, L, TOKENS_PER_STEP, -1)
    state = logits[:, :, KIND_STATE, :]  # [B, L, W]
    per = np.zeros((B, L))
    correct = np.zeros((B, L))
    d_state = np.zeros_like(state)
    for k, (o, n) in enumerate(zip(branch_offsets(branch_sizes), branch_sizes)):
        lk = state[:, :, o:o + n]
        m = lk.max(axis=-1, keepdims=True)
        lse = m[..., 0] + np.log(np.exp(lk - m).sum(axis=-1))
        a = actions[:, :, k]
        taken = np.take_along_axis(lk, a[..., None], axis=-1)[..., 0]
        per += lse - taken
        correct += (lk.argmax(axis=-1) == a) / nb
        p = np.exp(lk - lse[..., None])
        d_state[:, :, o:o + n] = p - (np.arange(n) == a[..., None])
    d_logits = np.zeros_like(logits)
    d_logits[:, :, KIND_STATE, :] = d_state / (B * L)
    return float(per.mean()), per.reshape(-1), correct.reshape(-1), d_logits.reshape(B * L * TOKENS_PER_STEP, -1)


# ---------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def dt_loss_kernel(logits, actions, offsets, sizes, inv_n, per_sample, correct, d_logits):
    """One thread per sample (b, t): its three token rows of d_logits (module docstring)."""
    i = _cuda.grid(1)
    L = actions.shape[1]
    if i >= actions.shape[0] * L:
        return
    b = i // L
    t = i - b * L
    base = b * TOKENS_PER_STEP * L + TOKENS_PER_STEP * t
    r = base + KIND_STATE
    for kind in range(TOKENS_PER_STEP):
        if kind != KIND_STATE:
            for c in range(d_logits.shape[1]):
                d_logits[base + kind, c] = np.float32(0.0)
    nb = offsets.shape[0]
    loss = np.float64(0.0)
    hits = np.float64(0.0)
    for k in range(nb):
        o = offsets[k]
        n = sizes[k]
        m = np.float64(logits[r, o])
        best = 0
        for a in range(1, n):
            v = np.float64(logits[r, o + a])
            if v > m:
                m = v
                best = a
        s = np.float64(0.0)
        for a in range(n):
            s += math.exp(np.float64(logits[r, o + a]) - m)
        z = m + math.log(s)
        taken = actions[b, t, k]
        loss += z - np.float64(logits[r, o + taken])
        if best == taken:
            hits += np.float64(1.0)
        for a in range(n):
            p = math.exp(np.float64(logits[r, o + a]) - z)
            onehot = np.float64(1.0) if a == taken else np.float64(0.0)
            d_logits[r, o + a] = np.float32((p - onehot) * inv_n)
    per_sample[i] = np.float32(loss)
    correct[i] = np.float32(hits / nb)


# ---------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------
class DtLoss(Loss):
    """Branch cross-entropy at the state tokens of B windows of L steps (module docstring)."""

    name = "dt"
    inputs = ("logits", "actions")
    grad_inputs = ("logits",)

    def __init__(self, windows: int, context: int, branch_sizes):
        self.windows, self.context = int(windows), int(context)
        self.branch_sizes = tuple(int(n) for n in branch_sizes)
        n, width = self.windows * self.context, sum(self.branch_sizes)
        a = Arena("loss.dt")
        a.add("loss", (1,), np.float32)
        a.add("per_sample", (n,), np.float32)
        a.add("correct", (n,), np.float32)
        a.add("d_logits", (n * TOKENS_PER_STEP, width), np.float32)
        a.add("offsets", (len(self.branch_sizes),), np.int32)
        a.add("sizes", (len(self.branch_sizes),), np.int32)
        a.allocate()
        a.load({"offsets": branch_offsets(self.branch_sizes), "sizes": np.asarray(self.branch_sizes, np.int32)})
        self.arena = a
        self.reducer = Reducer(n)

    def grad(self, name: str):
        return {"logits": self.arena["d_logits"]}[name]

    def compute(self, x: dict, stream) -> None:
        a, n = self.arena, self.windows * self.context
        threads = min(BLOCK, n)
        dt_loss_kernel[blocks(n, threads), threads, stream](x["logits"], x["actions"], a["offsets"], a["sizes"],
                                                            np.float64(1.0 / n), a["per_sample"], a["correct"],
                                                            a["d_logits"])
        self.reducer.mean(a["per_sample"], a["loss"], stream)

    def accuracy(self, out, at: int, stream) -> None:
        """out[at] = the batch mean of `correct` (fixed order)."""
        self.reducer.mean(self.arena["correct"], out, stream, at=at)
