"""Binary cross-entropy of the risk-budget head (issue 15, T7; numbarl/rl/nets/risk_head.py) on the replay's
trade outcomes: did the trade opened at s close with a net profit?

The labels (E7's `label_kernel` with outcome labels (1, 0, 0), per collect step, after ``env.step``, ``replay.write`` and the count's
advance, so τ_now = count − 1 is the row just written; one thread per env j)::

    label[τ_now % n_slots, j] = −1                             the row just written: no (or not yet) label
    if env j closed a trade this step, net P&L p = trade_pnl[j]:
        τ_in = entry_slot[j] (≥ 0: the trade was open before this step) else τ_now
        if τ_in ≥ count − n_slots (the ring still holds the row):  label[τ_in % n_slots, j] = 1{p > 0}
    entry_slot[j] = τ_now − (bar[j] − entry_bar[j]) while env j holds a position, else −1

The entry tracking is E6's (numbarl/rl/feedback/replay_weights.py: `closed_trade_entry_dev`,
`track_entry_dev`, shared with E7's hindsight labels), so is its meaning: the labelled row is the step whose
execution filled the entry (latency_bars = 0: the row whose action opened the trade). A reversal closes the
old trade (labelled at its own entry row) and opens the next one at the reversal's row (labelled when that
one closes). Rows of a trade still open, of no trade, and entries the ring overwrote before the close carry
−1: they do not enter the loss. Known approximation (E6's): the env reports the P&L SUM of the trades closed
in one step (a reversal whose new trade a stop, target or forced exit closes on the next bar); the sum
labels the older entry. The labels live beside the replay in an int32 [n_slots, N] ring of their own (the
replay's layout; checkpointed with it) and the train step gathers the sampled rows' labels by the batch's
index (E7's `gather_labels_kernel`).

The loss, for the online head's logits z [B] at the batch's obs and the gathered labels y ∈ {−1, 0, 1}:

    m[b]          = 1{y[b] ≥ 0}                                  the labelled rows; n = Σ_b m[b]
    per_sample[b] = m[b]·(max(z, 0) − y·z + log1p(e^{−|z|}))     the stable −y log σ(z) − (1−y) log(1−σ(z))
    L             = Σ_b per_sample[b] / max(n, 1)                 the mean over the labelled rows (0 if none)
    ∂L/∂z[b]      = m[b]·(σ(z[b]) − y[b]) / max(n, 1)

e.g. z = 0, one labelled row of two (y = 1): L = log 2, ∂L/∂z = (−1/2, 0). The loss also leaves ρ = σ(z) [B],
m [B] and n [1] in its arena: the agent's stats risk_head_rho_mean (the batch mean of ρ over EVERY sampled
row, labelled or not: what the head says on the replay's states) and risk_head_labeled (n). Unweighted by
the replay weights; agent.risk_head_weight scales its gradient through Loss.apply.

The base win rate ρ̄ (the sizing's reference, numbarl/rl/nets/risk_head.py): the same kernel moves an EMA
of the labelled rows' share of wins, ρ̄ ← 0.99 ρ̄ + 0.01 · (wins / n) per aux step with labels (the first
such batch sets it; `base_rate` [2] = (ρ̄, 1 once set)); checkpointed, and a policy array (risk_grid/).

Thread mapping: `risk_bce_kernel` is ONE block; thread t takes samples t, t + T, ... (T = blockDim), its
partial sums of the loss and of m go through a fixed shared-memory tree, then every thread writes its
samples' gradient with the common 1 / max(n, 1). Fixed order, no atomics.
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda import launch
from numbarl.cuda.runtime import Arena, cuda
from numbarl.env.params import EXIT_NONE
from numbarl.rl.feedback.hindsight import NO_LABEL, gather_labels_kernel, label_kernel
from numbarl.rl.losses.base import Loss
from numbarl.rl.losses.confidence import sigmoid_dev
from numbarl.rl.nets.confidence import sigmoid_ref

_cuda = cuda()  # the backend (GPU or simulator), selected once

LABEL_BLOCK = 128  # one env per thread
BLOCK = launch.shape(gpu=256, sim=16)  # threads of the one-block loss kernel (a power of two)
MAX_BLOCK = 256  # its shared arrays' length (compile-time)

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_DECAY = np.float32(0.99)  # BASE_RATE_DECAY in float32
_ONE_MINUS_DECAY = np.float32(1.0 - 0.99)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def outcome_label_ref(trade_pnl, exit_reason, bar, position, entry_bar, label, count: int, entry_slot,
                      labeled) -> None:
    """numpy model of the outcome labelling (E7's label_kernel with (1, 0, 0)) for one collect step (label [n_slots, N], entry_slot [N] and
    labeled [N] modified in place; count: the replay's write count after this step's write)."""
    n_slots = label.shape[0]
    now = count - 1
    for j in range(len(entry_slot)):
        label[now % n_slots, j] = NO_LABEL
        if exit_reason[j] != EXIT_NONE:
            start = entry_slot[j] if entry_slot[j] >= 0 else now
            if start >= max(count - n_slots, 0):
                label[start % n_slots, j] = 1 if trade_pnl[j] > 0 else 0
                labeled[j] += 1
        entry_slot[j] = now - (int(bar[j]) - int(entry_bar[j])) if position[j] != 0 else -1


BASE_RATE_DECAY = 0.99  # the base win rate's EMA per aux step (the sizing's reference ρ̄)


def base_rate_ref(base, labels):
    """(rate, seen) after one batch's labels (module docstring): the first batch with labels sets the rate to
    its share of wins, later ones move it by 1 − BASE_RATE_DECAY; a batch without labels changes nothing."""
    y = np.asarray(labels).reshape(-1)
    n = int((y >= 0).sum())
    rate, seen = float(base[0]), float(base[1])
    if n == 0:
        return np.float32(rate), np.float32(seen)
    batch = np.float32(np.float32((y == 1).sum()) / np.float32(n))
    if seen == 0.0:
        return batch, np.float32(1.0)
    return np.float32(np.float32(BASE_RATE_DECAY) * np.float32(rate) + np.float32(1.0 - BASE_RATE_DECAY) * batch), \
        np.float32(1.0)


def risk_bce_ref(z, labels):
    """(loss, per_sample [B], dz [B, 1], rho [B], n) in float64 (module docstring); z [B, 1] or [B], labels
    [B] in {−1, 0, 1}."""
    z = np.asarray(z, np.float64).reshape(-1)
    y = np.asarray(labels, np.float64).reshape(-1)
    m = (y >= 0).astype(np.float64)
    yy = np.where(m > 0, y, 0.0)
    n = float(m.sum())
    scale = 1.0 / max(n, 1.0)
    per_sample = m * (np.maximum(z, 0.0) - yy * z + np.log1p(np.exp(-np.abs(z))))
    rho = sigmoid_ref(z)
    dz = (m * (rho - yy) * scale).reshape(-1, 1)
    return float(per_sample.sum() * scale), per_sample, dz, rho, n


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def risk_bce_kernel(z, labels, grad_scale, per_sample, rho, labeled, loss, count, dz, base):
    """One block (module docstring): per_sample, ρ = σ(z), m into per_sample / rho / labeled; the mean over
    labelled rows into loss[0], n into count[0]; dz[b, 0] = m (ρ − y) · grad_scale / max(n, 1); the base win
    rate base[0] (base[1] = 1 once set) moved by the batch's share of wins (base_rate_ref)."""
    t = _cuda.threadIdx.x
    T = _cuda.blockDim.x
    B = z.shape[0]
    s_loss = _cuda.shared.array(MAX_BLOCK, np.float32)
    s_count = _cuda.shared.array(MAX_BLOCK, np.float32)
    s_wins = _cuda.shared.array(MAX_BLOCK, np.float32)
    acc = _ZERO
    n = _ZERO
    wins = _ZERO
    for b in range(t, B, T):
        zb = z[b, 0]
        rho[b] = sigmoid_dev(zb)
        y = labels[b]
        if y >= 0:
            yf = np.float32(y)
            ell = max(zb, _ZERO) - yf * zb + math.log1p(math.exp(-abs(zb)))
            per_sample[b] = ell
            labeled[b] = _ONE
            acc += ell
            n += _ONE
            wins += yf
        else:
            per_sample[b] = _ZERO
            labeled[b] = _ZERO
    s_loss[t] = acc
    s_count[t] = n
    s_wins[t] = wins
    _cuda.syncthreads()
    stride = T // 2
    while stride > 0:
        if t < stride:
            s_loss[t] += s_loss[t + stride]
            s_count[t] += s_count[t + stride]
            s_wins[t] += s_wins[t + stride]
        _cuda.syncthreads()
        stride //= 2
    total = s_count[0]
    inv = _ONE / max(total, _ONE)
    if t == 0:
        loss[0] = s_loss[0] * inv
        count[0] = total
        if total > _ZERO:
            rate = s_wins[0] / total
            if base[1] == _ZERO:
                base[0] = rate
                base[1] = _ONE
            else:
                base[0] = _DECAY * base[0] + _ONE_MINUS_DECAY * rate
    scale = grad_scale * inv
    for b in range(t, B, T):
        y = labels[b]
        if y >= 0:
            dz[b, 0] = (rho[b] - np.float32(y)) * scale
        else:
            dz[b, 0] = _ZERO


# ---------------------------------------------------------------------------------------------
# the labels and the loss
# ---------------------------------------------------------------------------------------------
class TradeOutcomeLabels:
    """The outcome labels beside the replay (int32 [n_slots, N], −1 = none) and the per-env entry rows."""

    def __init__(self, n_slots: int, n_envs: int, batch: int):
        self.n_slots, self.n_envs, self.batch = int(n_slots), int(n_envs), int(batch)
        a = Arena("agent.risk_labels")
        a.add("label", (self.n_slots, self.n_envs), np.int32)
        a.add("entry_slot", (self.n_envs,), np.int64)
        a.add("labeled", (self.n_envs,), np.int64)  # entry rows labelled so far, per env
        a.add("batch_label", (self.batch,), np.int32)
        a.allocate()
        a.load({"label": np.full((self.n_slots, self.n_envs), NO_LABEL, np.int32),
                "entry_slot": np.full(self.n_envs, -1, np.int64), "labeled": np.zeros(self.n_envs, np.int64),
                "batch_label": np.full(self.batch, NO_LABEL, np.int32)})
        self.arena = a

    def mark(self, env_out, env_state, replay, stream) -> None:
        """Collect step, after env.step, replay.write and the count's advance (launch only). env_out: the env's
        StepArrays (trade_pnl, exit_reason, bar); env_state: its StateArrays (position, entry_bar)."""
        if replay.n_envs != self.n_envs or replay.n_slots != self.n_slots:
            raise ValueError(f"risk head labels for [{self.n_slots}, {self.n_envs}], replay has "
                             f"[{replay.n_slots}, {replay.n_envs}]")
        a = self.arena
        label_kernel[launch.blocks(self.n_envs, LABEL_BLOCK), min(LABEL_BLOCK, self.n_envs), stream](
            env_out.trade_pnl, env_out.exit_reason, env_out.bar, env_state.position, env_state.entry_bar,
            a["label"], replay.count, a["entry_slot"], a["labeled"], np.int32(1), np.int32(0), np.int32(0))

    def gather(self, index, stream):
        """Train step, after the sample: the labels of the sampled rows index [B] (int32 [B], −1 = none)."""
        out = self.arena["batch_label"]
        gather_labels_kernel[launch.blocks(self.batch, LABEL_BLOCK), min(LABEL_BLOCK, self.batch), stream](
            self.arena["label"], index, out)
        return out

    def state_arrays(self) -> dict:
        return {k: v for k, v in self.arena.to_host().items() if k != "batch_label"}

    def load_state(self, arrays: dict) -> None:
        self.arena.load({k: v for k, v in arrays.items() if k != "batch_label"})


class RiskHeadLoss(Loss):
    """The risk head's cross-entropy on the labelled rows (module docstring). Inputs: "logits" [B, 1] (the
    online head at obs), "labels" int32 [B] (−1: no label)."""

    name = "risk_head"
    inputs = ("logits", "labels")
    grad_inputs = ("logits",)

    def __init__(self, batch: int):
        self.batch = int(batch)
        arena = Arena("risk_head_loss")
        arena.add("dz", (self.batch, 1), np.float32)
        arena.add("per_sample", (self.batch,), np.float32)
        arena.add("rho", (self.batch,), np.float32)
        arena.add("labeled", (self.batch,), np.float32)
        arena.add("count", (1,), np.float32)
        arena.add("loss", (1,), np.float32)
        arena.add("base_rate", (2,), np.float32)  # the base win rate ρ̄ and whether it is set (sizing's reference)
        arena.allocate()
        arena.load({"base_rate": np.zeros(2, np.float32)})
        self.arena = arena

    def grad(self, name: str):
        return self.arena["dz"]

    @property
    def rho(self):
        """Device float32 [B]: ρ = σ(z) of the last compute() (every row)."""
        return self.arena["rho"]

    @property
    def base_rate(self):
        """Device float32 [2]: the base win rate ρ̄ of the labelled rows (an EMA over aux steps) and 1 once set."""
        return self.arena["base_rate"]

    @property
    def count(self):
        """Device float32 [1]: the labelled rows n of the last compute()."""
        return self.arena["count"]

    def compute(self, x: dict, stream) -> None:
        z, labels = x["logits"], x["labels"]
        B = self.batch
        if tuple(z.shape) != (B, 1) or tuple(labels.shape) != (B,):
            raise ValueError(f"risk head loss: logits {tuple(z.shape)} and labels {tuple(labels.shape)} "
                             f"(expected ({B}, 1) and ({B},))")
        a = self.arena
        risk_bce_kernel[1, BLOCK, stream](z, labels, np.float32(1.0), a["per_sample"], a["rho"], a["labeled"],
                                          a["loss"], a["count"], a["dz"], a["base_rate"])
