"""E7 hindsight labels: the entry state of a losing *training* trade is labelled with the action
that, in hindsight, was better there — and a large-margin loss (numbarl/rl/losses/margin.py, DQfD)
pulls the direction branch's Q towards it.

The label. Of the direction choices at the entry, the hindsight-best one among "enter" (what the
agent did, which lost) and "stay flat" (P&L 0) is flat, so a losing trade's entry row gets the
label DIR_FLAT. numbarl's reading of the origin notes ("correct actions for losers") is this
minimal one: the origin's search over {flat, opposite} x the target/stop grid on the realized path
needs each trade's plan and the path's fills, which the collect step does not keep; the opposite
side is left out on purpose (a losing long is not evidence for a short after costs), and only the
direction branch is labelled. Future prices decide the label only, never an observation.

Per collect step, after ``env.step`` and ``replay.write`` (tau_now = count - 1), one thread per env j:

    label[tau_now % n_slots, j] = -1                         the row just written carries no label
    if env j closed a trade this step with net P&L < 0:
        tau_in = entry_slot[j] (>= 0: open before this step) else tau_now
        if tau_in >= count - n_slots (the ring still holds it): label[tau_in % n_slots, j] = DIR_FLAT
    entry_slot[j] = tau_now - (bar[j] - entry_bar[j]) while env j holds a position, else -1

(the entry row from the env's own state, as E6: numbarl/rl/feedback/replay_weights.py). The
train step gathers the sampled rows' labels (`gather_labels_kernel`) for the margin loss, which
runs as an auxiliary loss (agent.aux_frequency) with weight lambda_E = e7_margin_weight x
0.5^(epochs trained), decaying as DQfD's demonstration term does once the agent's own data
dominates.
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda.runtime import Arena, cuda
from numbarl.env.params import DIR_FLAT, EXIT_NONE
from numbarl.rl.feedback.replay_weights import closed_trade_entry_dev, track_entry_dev

_cuda = cuda()

BLOCK = 128
NO_LABEL = -1


@_cuda.jit(cache=True)
def label_kernel(trade_pnl, exit_reason, bar, position, entry_bar, label, count, entry_slot, labelled, win_label,
                 even_label, loss_label):
    """One thread per env (module docstring): the row just written loses its label; a trade that closed this
    step labels its entry row (if the ring still holds it) by its net P&L p: win_label (p > 0), even_label
    (p = 0) or loss_label (p < 0), NO_LABEL meaning "leave it": E7 passes (NO_LABEL, NO_LABEL, DIR_FLAT), the
    risk-budget head's outcome labels (1, 0, 0) (numbarl/rl/losses/risk_head.py)."""
    j = _cuda.grid(1)
    if j >= entry_slot.shape[0]:
        return
    n_slots = label.shape[0]
    c = count[0]
    now = c - 1
    label[now % n_slots, j] = NO_LABEL
    if exit_reason[j] != EXIT_NONE:
        p = trade_pnl[j]
        value = win_label if p > 0 else (loss_label if p < 0 else even_label)
        if value != NO_LABEL:
            start = closed_trade_entry_dev(entry_slot, j, now)
            if start >= c - n_slots and start >= 0:  # the ring still holds the entry row
                label[start % n_slots, j] = value
                labelled[j] += 1
    track_entry_dev(entry_slot, j, now, position, bar, entry_bar)  # the entry tracking E6 and E7 share


@_cuda.jit(cache=True)
def gather_labels_kernel(label, index, out):
    """out[b] = label of the sampled row index[b] (= slot * n_envs + env; -1: no row)."""
    b = _cuda.grid(1)
    if b >= out.shape[0]:
        return
    i = index[b]
    if i < 0:
        out[b] = NO_LABEL
        return
    n_envs = label.shape[1]
    out[b] = label[i // n_envs, i % n_envs]


def label_ref(trade_pnl, exit_reason, bar, position, entry_bar, label, count: int, entry_slot, labelled) -> None:
    """numpy model of label_kernel (arrays modified in place)."""
    n_slots = label.shape[0]
    now = count - 1
    for j in range(len(entry_slot)):
        label[now % n_slots, j] = NO_LABEL
        if exit_reason[j] != EXIT_NONE and trade_pnl[j] < 0:
            start = entry_slot[j] if entry_slot[j] >= 0 else now
            if start >= count - n_slots and start >= 0:
                label[start % n_slots, j] = DIR_FLAT
                labelled[j] += 1
        entry_slot[j] = now - (int(bar[j]) - int(entry_bar[j])) if position[j] != 0 else -1


class HindsightLabels:
    """The label ring beside the replay (int8 [n_slots, N]) and the per-env entry rows."""

    def __init__(self, n_slots: int, n_envs: int, batch: int):
        self.n_slots, self.n_envs, self.batch = int(n_slots), int(n_envs), int(batch)
        a = Arena("feedback.hindsight")
        a.add("label", (self.n_slots, self.n_envs), np.int32)
        a.add("entry_slot", (self.n_envs,), np.int64)
        a.add("labelled", (self.n_envs,), np.int64)
        a.add("batch_label", (self.batch,), np.int32)
        self.arena = a

    def allocate(self) -> "HindsightLabels":
        self.arena.allocate()
        self.arena.load({"label": np.full((self.n_slots, self.n_envs), NO_LABEL, np.int32),
                         "entry_slot": np.full(self.n_envs, -1, np.int64),
                         "labelled": np.zeros(self.n_envs, np.int64),
                         "batch_label": np.full(self.batch, NO_LABEL, np.int32)})
        return self

    def mark(self, env_out, env_state, replay, stream) -> None:
        """Collect step, after replay.write (launch only)."""
        a = self.arena
        label_kernel[max(1, -(-self.n_envs // BLOCK)), BLOCK, stream](
            env_out.trade_pnl, env_out.exit_reason, env_out.bar, env_state.position, env_state.entry_bar,
            a["label"], replay.count, a["entry_slot"], a["labelled"], np.int32(NO_LABEL), np.int32(NO_LABEL),
            np.int32(DIR_FLAT))

    def gather(self, batch, stream):
        """Train step, after the sample: the batch's labels (int32 [B])."""
        out = self.arena["batch_label"]
        gather_labels_kernel[max(1, -(-self.batch // BLOCK)), BLOCK, stream](self.arena["label"], batch.index, out)
        return out

    def labelled(self) -> int:
        """Entry rows labelled so far (host read; syncs)."""
        return int(self.arena["labelled"].copy_to_host().sum())

    def state_arrays(self) -> dict:
        return {k: v for k, v in self.arena.to_host().items() if k != "batch_label"}

    def load_state(self, arrays: dict) -> None:
        self.arena.load({k: v for k, v in arrays.items() if k != "batch_label"})
