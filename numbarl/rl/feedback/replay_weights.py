"""E6 winner distillation: the replay rows of winning *training* trades get weight 1 + κ.

Self-imitation (Oh et al. 2018, "Self-Imitation Learning"): transitions that led to the agent's
best outcomes are replayed with more weight. Here "best" is a closed training trade whose net
P&L reaches a threshold θ; its rows (the env's entry step to its exit step, in that env's column
of the replay's time-major ring) get the stored weight 1 + κ, and the weighted batch of
``Replay(normalize_weights=True)`` turns the stored weights into per-sample loss weights with mean
1 (numbarl/rl/replay.py). Leakage-safe: only trades of the training envs are marked and logged;
validation never touches the replay (it may set nothing here but, if the caller wishes, θ).

Per collect step, after ``env.step`` AND ``replay.write`` of the same step (the row of this step
must already be in the ring: its time is τ_now = count − 1), one thread per env j::

    if env j closed a trade in the step (exit_reason ≠ none), with P&L p = trade_pnl[j]:
        log p in env j's ring of the last K closed-trade P&Ls (the numbers θ is computed from)
        τ_in = entry_slot[j]  (≥ 0: the trade was open before the step) else τ_now (opened and
                              closed within the step)
        if p ≥ θ: weight[τ % n_slots, j] = 1 + κ  for τ in [max(τ_in, count − n_slots, 0), τ_now]
                  (rows the ring has already overwritten, τ < count − n_slots, are left alone)
    entry_slot[j] = τ_now − (bar[j] − entry_bar[j])  if env j holds a position after the step
                    −1                                otherwise

The entry's replay time comes from the env's own state: within an episode the cursor advances
one bar per collect step and the replay writes one row per collect step, and a position never
survives an episode's end (done is position-gated; forced exits close), so the fill bar
``entry_bar`` lies ``bar − entry_bar`` rows before the current one. The entry row is the step
whose execution filled the entry (with ``latency_bars = 0``: the row whose action opened it; with
latency the decision rows before the fill are not marked). Rows are set, not multiplied: a row
shared by two winning trades (a reversal's step) gets 1 + κ once. Newly written rows are 1.0
(the write kernel), so a mark is forgotten when the ring overwrites its row.

Known approximation: the env reports the P&L SUM of the trades closed in one step. Two trades
close in one step only when a reversal (direction lock off) opens a trade that a stop, target or
forced exit closes on the very next bar; the sum is then tested against θ and the rows of both
(the old trade's entry to this step) are marked together.

The threshold: :meth:`WinnerDistillation.epoch_threshold` (host, between epochs) reads the closed-
trade log of the epoch just trained, sets θ = the top-``top_frac`` quantile of those P&Ls
(:func:`winner_threshold`, deterministic: numpy's "higher" quantile, an actual trade's P&L, and
never below the smallest positive P&L: a losing trade is never a winner) and clears the log.
Before the first call θ = +inf (nothing is marked). An env that closes more than K trades between
reads keeps its last K (the log is a per-env ring, written by one thread: no atomics).

Device memory: entry_slot int64 [N], the log float64 [K, N] + counts int64 [N], marked rows and
trades int64 [N] each (summed in a fixed order only when the stats are read), θ float64 [1] and
1 + κ float32 [1] (device scalars: set_threshold / set_boost between replays, no re-capture).
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda.runtime import Arena, cuda
from numbarl.cuda.runtime import stream as default_stream
from numbarl.env.params import EXIT_NONE

_cuda = cuda()

BLOCK = 128
DEFAULT_LOG = 32  # closed-trade P&Ls kept per env between two threshold reads


# ---------------------------------------------------------------------------------------------
# host reference
# ---------------------------------------------------------------------------------------------
def winner_threshold(pnls, top_frac: float = 0.1, min_trades: int = 10) -> float:
    """θ: the (1 − top_frac) quantile of the closed trades' P&Ls (numpy "higher": the P&L of an
    actual trade, the same number for the same trades in any order), raised to the smallest
    positive float64 when it is ≤ 0 (only trades that made money are winners); +inf with fewer
    than min_trades trades (nothing is marked)."""
    p = np.asarray(pnls, np.float64).ravel()
    p = p[np.isfinite(p)]
    if not 0.0 < top_frac <= 1.0:
        raise ValueError(f"winner_threshold: top_frac must be in (0, 1], got {top_frac}")
    if p.size < max(1, int(min_trades)):
        return float("inf")
    q = float(np.quantile(p, 1.0 - top_frac, method="higher"))
    return max(q, float(np.nextafter(0.0, 1.0)))


class WinnerDistillationRef:
    """Host model of one :meth:`WinnerDistillation.mark` per step (same state, same rules)."""

    def __init__(self, n_envs: int, boost: float = 1.0, log_capacity: int = DEFAULT_LOG):
        self.n_envs, self.K = int(n_envs), int(log_capacity)
        self.entry_slot = np.full(self.n_envs, -1, np.int64)
        self.threshold = float("inf")
        self.weight_value = np.float32(1.0 + boost)
        self.log = np.zeros((self.K, self.n_envs), np.float64)
        self.log_count = np.zeros(self.n_envs, np.int64)
        self.marked_rows = np.zeros(self.n_envs, np.int64)
        self.marked_trades = np.zeros(self.n_envs, np.int64)

    def mark(self, trade_pnl, exit_reason, bar, position, entry_bar, weight, count: int) -> None:
        """weight: the replay's [n_slots, N] weight store (numpy, modified in place); count: the
        replay's write count after this step's write."""
        n_slots = weight.shape[0]
        now = count - 1
        for j in range(self.n_envs):
            if exit_reason[j] != EXIT_NONE:
                pnl = float(trade_pnl[j])
                self.log[self.log_count[j] % self.K, j] = pnl
                self.log_count[j] += 1
                start = self.entry_slot[j] if self.entry_slot[j] >= 0 else now
                if pnl >= self.threshold:
                    lo = max(start, count - n_slots, 0)
                    for tau in range(lo, count):
                        weight[tau % n_slots, j] = self.weight_value
                    self.marked_rows[j] += max(0, count - lo)
                    self.marked_trades[j] += 1
            self.entry_slot[j] = now - (int(bar[j]) - int(entry_bar[j])) if position[j] != 0 else -1

    def trade_pnls(self) -> np.ndarray:
        return _logged(self.log, self.log_count)


def _logged(log, count) -> np.ndarray:
    """The logged P&Ls, env by env, each env's oldest kept first (its last min(count, K))."""
    K = log.shape[0]
    out = []
    for j in range(log.shape[1]):
        c = int(count[j])
        out.extend(log[k % K, j] for k in range(max(0, c - K), c))
    return np.asarray(out, np.float64)


# ---------------------------------------------------------------------------------------------
# device functions: the entry tracking every trade-outcome component shares (E6 here, E7's hindsight
# labels, the risk head's outcome labels: numbarl/rl/losses/risk_head.py)
# ---------------------------------------------------------------------------------------------
@_cuda.jit(device=True, inline=True)
def closed_trade_entry_dev(entry_slot, j, now):
    """τ_in: the replay time of the entry row of the trade env j closed in this step, entry_slot[j] when the
    trade was open before the step, else now (opened and closed within it). Call before track_entry_dev."""
    start = entry_slot[j]
    if start < 0:
        start = now
    return start


@_cuda.jit(device=True, inline=True)
def track_entry_dev(entry_slot, j, now, position, bar, entry_bar):
    """entry_slot[j] after the step: now − (bar − entry_bar) (the fill bar's row) while env j holds a
    position, else −1 (module docstring)."""
    if position[j] != 0:
        entry_slot[j] = now - (np.int64(bar[j]) - np.int64(entry_bar[j]))
    else:
        entry_slot[j] = -1


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def winner_mark_kernel(trade_pnl, exit_reason, bar, position, entry_bar, weight_store, count,
                       entry_slot, threshold, weight_value, log, log_count, marked_rows, marked_trades):
    """One thread per env (module docstring)."""
    j = _cuda.grid(1)
    if j >= entry_slot.shape[0]:
        return
    n_slots = weight_store.shape[0]
    c = count[0]
    now = c - 1
    if exit_reason[j] != EXIT_NONE:
        pnl = trade_pnl[j]
        k = log_count[j]
        log[k % log.shape[0], j] = pnl
        log_count[j] = k + 1
        start = closed_trade_entry_dev(entry_slot, j, now)
        if pnl >= threshold[0]:
            lo = max(start, max(c - n_slots, 0))
            w = weight_value[0]
            for tau in range(lo, c):
                weight_store[tau % n_slots, j] = w
            if c > lo:
                marked_rows[j] += c - lo
            marked_trades[j] += 1
    track_entry_dev(entry_slot, j, now, position, bar, entry_bar)


@_cuda.jit(cache=True)
def winner_stats_kernel(marked_rows, marked_trades, threshold, stats, slot_rows, slot_trades, slot_threshold):
    """One thread: the per-env counters summed in env order (int64, exact) into the mapped stats
    (float32; a slot < 0 is skipped)."""
    if _cuda.grid(1) != 0:
        return
    rows = 0
    trades = 0
    for j in range(marked_rows.shape[0]):
        rows += marked_rows[j]
        trades += marked_trades[j]
    if slot_rows >= 0:
        stats[slot_rows] = np.float32(rows)
    if slot_trades >= 0:
        stats[slot_trades] = np.float32(trades)
    if slot_threshold >= 0:
        stats[slot_threshold] = np.float32(threshold[0])


# ---------------------------------------------------------------------------------------------
# the component
# ---------------------------------------------------------------------------------------------
class WinnerDistillation:
    """E6 (module docstring). boost: κ (the rows of a winning trade get weight 1 + κ); top_frac:
    the share of training trades that count as winners; log_capacity: K closed-trade P&Ls kept per
    env between threshold reads; min_trades: fewer logged trades leave θ = +inf."""

    def __init__(self, n_envs: int, boost: float = 1.0, top_frac: float = 0.1,
                 log_capacity: int = DEFAULT_LOG, min_trades: int = 10):
        if n_envs < 1 or log_capacity < 1:
            raise ValueError(f"WinnerDistillation: n_envs ({n_envs}) and log_capacity ({log_capacity}) must be >= 1")
        if boost < 0.0:
            raise ValueError(f"WinnerDistillation: boost (κ) must be >= 0, got {boost}")
        if not 0.0 < top_frac <= 1.0:
            raise ValueError(f"WinnerDistillation: top_frac must be in (0, 1], got {top_frac}")
        self.n_envs, self.boost, self.top_frac = int(n_envs), float(boost), float(top_frac)
        self.log_capacity, self.min_trades = int(log_capacity), int(min_trades)
        self.threshold = float("inf")
        a = Arena("feedback.winners")
        a.add("entry_slot", (self.n_envs,), np.int64)
        a.add("threshold", (1,), np.float64)
        a.add("weight_value", (1,), np.float32)
        a.add("log", (self.log_capacity, self.n_envs), np.float64)
        a.add("log_count", (self.n_envs,), np.int64)
        a.add("marked_rows", (self.n_envs,), np.int64)
        a.add("marked_trades", (self.n_envs,), np.int64)
        self.arena = a

    def allocate(self) -> WinnerDistillation:
        self.arena.allocate()
        self.arena.load({"entry_slot": np.full(self.n_envs, -1, np.int64),
                         "threshold": np.array([self.threshold], np.float64),
                         "weight_value": np.array([1.0 + self.boost], np.float32)})
        return self

    # -- capturable -------------------------------------------------------------------------------
    def mark(self, env_out, env_state, replay, stream) -> None:
        """Collect step, after env.step and replay.write of the same step: log closed trades, mark
        winners' rows in replay.weight_store. env_out: the env's StepArrays (DeviceEnv.outputs:
        trade_pnl, exit_reason, bar); env_state: its StateArrays (DeviceEnv.state: position,
        entry_bar). Launch only (no allocation, copy or sync)."""
        if replay.n_envs != self.n_envs:
            raise ValueError(f"WinnerDistillation for {self.n_envs} envs, replay has {replay.n_envs}")
        a = self.arena
        winner_mark_kernel[max(1, -(-self.n_envs // BLOCK)), BLOCK, stream](
            env_out.trade_pnl, env_out.exit_reason, env_out.bar, env_state.position, env_state.entry_bar,
            replay.weight_store, replay.count, a["entry_slot"], a["threshold"], a["weight_value"],
            a["log"], a["log_count"], a["marked_rows"], a["marked_trades"])

    def write_stats(self, stats, stream, slot_rows: int = -1, slot_trades: int = -1, slot_threshold: int = -1) -> None:
        """stats[slot_*] (device float32, e.g. the agent's mapped stats) ← rows marked so far, winning
        trades so far, θ (float32; +inf before the first threshold). One thread over N envs: for the
        log-interval diagnostics step, not every collect step."""
        a = self.arena
        winner_stats_kernel[1, 1, stream](a["marked_rows"], a["marked_trades"], a["threshold"], stats,
                                          np.int64(slot_rows), np.int64(slot_trades), np.int64(slot_threshold))

    # -- host, between epochs -------------------------------------------------------------------
    def set_threshold(self, value: float) -> None:
        """θ (device float64; a trade with P&L ≥ θ is a winner; +inf: none). Host copy: outside capture."""
        self.threshold = float(value)
        self.arena.load({"threshold": np.array([self.threshold], np.float64)})

    def set_boost(self, kappa: float) -> None:
        """κ: marked rows get weight 1 + κ from now on (rows already marked keep theirs)."""
        if kappa < 0.0:
            raise ValueError(f"WinnerDistillation: boost (κ) must be >= 0, got {kappa}")
        self.boost = float(kappa)
        self.arena.load({"weight_value": np.array([1.0 + self.boost], np.float32)})

    def trade_pnls(self) -> np.ndarray:
        """Host copy of the closed-trade P&Ls logged since the last clear (env by env; syncs)."""
        log, count = self._read("log"), self._read("log_count")
        return _logged(log, count)

    def clear_log(self) -> None:
        self.arena.load({"log_count": np.zeros(self.n_envs, np.int64)})

    def epoch_threshold(self, top_frac: float | None = None, clear: bool = True) -> float:
        """Between epochs: θ ← winner_threshold(P&Ls of the training trades logged since the last
        call, top_frac), written to the device; the log is cleared (clear=True). Returns θ."""
        value = winner_threshold(self.trade_pnls(), self.top_frac if top_frac is None else top_frac, self.min_trades)
        self.set_threshold(value)
        if clear:
            self.clear_log()
        return value

    def counters(self) -> dict[str, float]:
        """Host read: rows and trades marked so far, θ, trades logged since the last clear."""
        return {"winner_rows_marked": int(self._read("marked_rows").sum()),
                "winner_trades_marked": int(self._read("marked_trades").sum()),
                "winner_threshold": float(self._read("threshold")[0]),
                "winner_trades_logged": int(np.minimum(self._read("log_count"), self.log_capacity).sum())}

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Checkpoint arrays (prefix them, e.g. "winners/<name>")."""
        return self.arena.to_host()

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        self.arena.load(arrays)
        if "threshold" in arrays:
            self.threshold = float(np.asarray(arrays["threshold"]).ravel()[0])

    def _read(self, name):
        s = default_stream()
        host = self.arena[name].copy_to_host(stream=s)
        s.synchronize()
        return host
