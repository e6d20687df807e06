"""Backtest: the env's step function run greedily and continuously over a bar window (SPEC §4).

One execution path: every bar of every policy goes through `core.step_core`, the function the
training env steps with, with the backtest's StepConsts (no episodes and no hard cap, no
opportunity cost, `params.step_consts(..., backtest=True)`) and the risk budget ρ = 1 (core.py:
the full Kelly cap, whatever an agent's IQN readiness; the DSR term is no backtest output). The window [start, end) runs without
resets from a flat book at `start`; the position is force-closed at the close of `end - 1`.

Output layout, P policies, W = end - start bars (column j = bar start + j):

    pnl[p, j]       P&L over (close of bar start+j-1, close of bar start+j] (currency); pnl[:, 0] = 0
    position[p, j]  position held over that interval (after the decision at bar start+j-1); 0 at j = 0
    trades          DataFrame: policy, entry_bar, exit_bar, side (+1/-1), size, entry_price,
                    exit_price, pnl (net of fees), exit_reason

Two ways to choose actions:
  actions  int [P, W, 4] (or [W, 4] for every policy): branch indices decided at each bar
           (the last bar's are unused). The kernel `actions_kernel` loops over a chunk of bars
           inside one thread per policy, reading packed int32 actions (time-major [rows, P]).
           With segment_bars, the chunk runs as segments x policies threads instead (speculate,
           carry, replay: numbarl/env/backtest_segments.py), with identical results.
  q_fn     q_fn(obs [P, state_dim], q_out [P, 4, max_actions], stream) fills greedy Q for a batch
           of observations; each bar runs q_fn -> `policy_bar_kernel` (greedy action over the env's
           mask, the step `bar_row`, the next bar's obs and mask), the first ones gathered by `start`.

Bars of a learned policy as CUDA graphs (graph=True, the default): eager, every bar costs several
launches whose host-side argument preparation (~37 us each, numbarl/cuda/graph.py) dominated the
validation of a training run. `PolicyBars` captures `bars_per_graph` (default GRAPH_BARS) bar
steps into one graph and replays it ceil(steps / bars_per_graph) times per chunk. Nothing in a
bar step needs a per-bar launch argument: each policy's bar is its state's `cursor` and the chunk
origin is read from device memory, and `bar_row` advances the cursor inside the graph. The last
replay of a chunk is masked by the same rule: `bar_row` leaves a policy whose cursor reached the
chunk's (or window's) last decision bar untouched, so surplus steps only recompute the scratch
obs/q/actions. The graph holds the eager loop's kernels, in its order, on its inputs, so the
results are bitwise identical (tests/env/test_backtest.py, and on the GPU tests/env/test_gpu_env.py).
A graph is captured once per (device market, params, window, policy callback) and reused by later
calls, e.g. every epoch's validation (see `policy_bars`).

Device buffers are time-major [rows, P] (coalesced: a warp's policies write adjacent addresses)
and hold `chunk_bars` rows; long windows run chunk by chunk. Row r of a chunk with origin o holds
bar o + r, and row r of the packed actions is the decision taken at bar o + r - 1. The metric
scan (numbarl/env/metrics.py) folds each chunk on the device, so metrics of any window length
are computed without copying P x W arrays back.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from numbarl.cuda import graph as cuda_graph
from numbarl.cuda.launch import device_function, shape
from numbarl.cuda.runtime import Arena, cuda
from numbarl.cuda.runtime import stream as default_stream
from numbarl.env import metrics as _metrics
from numbarl.env.core import step_core
from numbarl.env.device import launch_dims, launch_gather
from numbarl.env.market import DeviceMarket, MarketData, check_range
from numbarl.env.params import EXIT_NONE, EXIT_REASONS, N_BRANCHES, EnvParams, pack_actions, validate_actions
from numbarl.env.rows import gather_row, greedy_action, load_bars, load_row, store_row
from numbarl.env.state import STATE_FIELDS, Grids, MarketArrays, StateArrays, initial_portfolio, row_jit

_cuda = cuda()

BLOCK = 32  # one warp per block: P sequential chains spread over as many SMs as possible
# policy bars: one block per policy, one thread steps it and the block gathers its next obs row
# (a simulated thread costs ~0.1 ms, so the simulator runs one thread looping over the row)
POLICY_BLOCK = shape(gpu=128, sim=1)
DEFAULT_CHUNK = 1 << 16
# bar steps per captured graph: a 3,063-bar validation window is 12 replays (3,072 steps, the 9
# surplus ones masked); longer graphs only lengthen the one-off capture
GRAPH_BARS = 256
GRAPH_CACHE_SIZE = 4  # captured policy backtests kept for reuse (validation and test windows of a fold)
_MASK8 = np.int32(0xFF)
_S8 = np.int32(8)
_S16 = np.int32(16)
_S24 = np.int32(24)
_ZERO64 = np.float64(0.0)
_ZERO32 = np.float32(0.0)
_ONE64 = np.float64(1.0)  # the backtests' risk budget ρ (core.py): full protection, the step without R18


class TradeArrays(NamedTuple):
    """Closed trades per policy, [P, capacity] each; policy p's k-th trade in column k."""

    entry_bar: object  # int32
    exit_bar: object  # int32
    size: object  # float32, signed
    entry_price: object  # float64
    exit_price: object  # float64
    pnl: object  # float64
    reason: object  # int32


TRADE_FIELDS = (
    ("entry_bar", np.int32),
    ("exit_bar", np.int32),
    ("size", np.float32),
    ("entry_price", np.float64),
    ("exit_price", np.float64),
    ("pnl", np.float64),
    ("reason", np.int32),
)


# ---------------------------------------------------------------------------------------------
# row functions (kernels and the CPU reference loop)
# ---------------------------------------------------------------------------------------------
@row_jit
def start_row(st, p, start):
    store_row(st, p, initial_portfolio(start))


@row_jit
def record_trade(tr, p, index, t):
    """Write trade t (if any) at column `index` of policy p (dropped beyond capacity: the trade
    count still counts it, so overflow is detected on the host). Returns the next index."""
    if t.reason == EXIT_NONE:
        return index
    if index < tr.reason.shape[1]:
        tr.entry_bar[p, index] = t.entry_bar
        tr.exit_bar[p, index] = t.exit_bar
        tr.size[p, index] = t.size
        tr.entry_price[p, index] = t.entry_price
        tr.exit_price[p, index] = t.exit_price
        tr.pnl[p, index] = t.pnl
        tr.reason[p, index] = t.reason
    return index + 1


@row_jit
def _advance(s, p, direction, size, target_mult, stop_mult, mk, k, last_bar, origin, pnl, position, tr):
    """One backtest bar of policy p (state s in registers); writes row c + 1 - origin."""
    c = s.cursor
    index = s.trade_count
    s2, o, t1, t2 = step_core(s, direction, size, target_mult, stop_mult, load_bars(mk, c), _ZERO32, _ONE64, k, last_bar)
    row = c + 1 - origin
    pnl[row, p] = o.bar_pnl
    position[row, p] = o.position_held
    index = record_trade(tr, p, index, t1)
    record_trade(tr, p, index, t2)
    return s2


@row_jit
def actions_row(p, st, packed, grids, mk, k, last_bar, origin, pnl, position, tr):
    """Policy p from its cursor through the chunk: decisions c < min(origin + rows - 1, last_bar)."""
    s = load_row(st, p)
    end = min(origin + pnl.shape[0] - 1, last_bar)
    col = p if packed.shape[1] > 1 else 0
    last_row = packed.shape[0] - 1
    row = s.cursor + 1 - origin
    a = packed[min(row, last_row), col]
    while s.cursor < end:
        # prefetch the next bar's action: with one warp per SM nothing else hides the memory
        # latency of this load, so it is issued before the current bar's step, not after it
        row = s.cursor + 1 - origin
        a_next = packed[min(row + 1, last_row), col]
        s = _advance(
            s, p, a & _MASK8, grids.sizes[(a >> _S8) & _MASK8], grids.targets[(a >> _S16) & _MASK8],
            grids.stops[(a >> _S24) & _MASK8], mk, k, last_bar, origin, pnl, position, tr,
        )  # fmt: skip
        a = a_next
    store_row(st, p, s)


@row_jit
def bar_row(p, st, actions, grids, mk, k, last_bar, origin, pnl, position, tr):
    """One bar of policy p with actions[p] (from the greedy select); no-op past the chunk/window."""
    s = load_row(st, p)
    end = min(origin + pnl.shape[0] - 1, last_bar)
    if s.cursor < end:
        s = _advance(
            s, p, actions[p, 0], grids.sizes[actions[p, 1]], grids.targets[actions[p, 2]], grids.stops[actions[p, 3]],
            mk, k, last_bar, origin, pnl, position, tr,
        )  # fmt: skip
        store_row(st, p, s)


# ---------------------------------------------------------------------------------------------
# reference: the CPU backtest (same rows, @njit loops)
# ---------------------------------------------------------------------------------------------
@row_jit
def backtest_ref_loop(st, packed, grids, mk, k, start, last_bar, origin, pnl, position, tr):
    for p in range(st.cursor.shape[0]):
        if origin == start:
            start_row(st, p, start)
        actions_row(p, st, packed, grids, mk, k, last_bar, origin, pnl, position, tr)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
_start_row = device_function(start_row)
_actions_row = device_function(actions_row)
_bar_row = device_function(bar_row)
_greedy_action = device_function(greedy_action)
_gather_row = device_function(gather_row)


@_cuda.jit(cache=True)
def start_kernel(st, start):
    p = _cuda.grid(1)
    if p >= st.cursor.shape[0]:
        return
    _start_row(st, p, start)


@_cuda.jit(cache=True)
def actions_kernel(st, packed, grids, mk, k, last_bar, origin, pnl, position, tr):
    p = _cuda.grid(1)
    if p >= st.cursor.shape[0]:
        return
    _actions_row(p, st, packed, grids, mk, k, last_bar, origin[0], pnl, position, tr)


@_cuda.jit(cache=True)
def policy_bar_kernel(q, mask, branch_sizes, actions, st, grids, mk, k, last_bar, origin, pnl, position, tr, obs):
    """One bar of policy p = blockIdx.x after its Q: greedy action over the env's mask -> `bar_row`
    -> obs and mask of the next bar.

    Fused (one launch per bar instead of select, step and gather): at one policy a bar is a chain
    of dependent launches, so each launch removed is latency removed (H200, default network, 3,063
    bars: 9 -> 7 graph nodes per bar, 100.2 -> 88.2 ms per validation). Thread 0 picks each
    branch's `greedy_action` (the greedy part of the training policy, numbarl.rl.policies: epsilon 0
    gives the same actions) and steps; after the barrier the block gathers obs row p (and its mask)
    at the new cursor, one element per thread, as gather_kernel.
    """
    p = _cuda.blockIdx.x
    if p >= st.cursor.shape[0]:
        return  # the whole block: the barrier below is reached by all threads of a live block or none
    if _cuda.threadIdx.x == 0:
        for b in range(actions.shape[1]):
            actions[p, b] = _greedy_action(q, mask, p, b)
        _bar_row(p, st, actions, grids, mk, k, last_bar, origin[0], pnl, position, tr)
    _cuda.syncthreads()  # the new state (global memory) is visible to the whole block
    dim = obs.shape[1]
    j = _cuda.threadIdx.x
    while j < dim:
        _gather_row(obs, mask, p * dim + j, st, mk, k, branch_sizes)
        j += _cuda.blockDim.x


@_cuda.jit(cache=True)
def record_q_kernel(q, cursor, start_bar, q_rec):
    """q_rec[c - start, p, :] = policy p's direction-branch Q at its decision bar c (the bar its
    obs was gathered at; a surplus step at a chunk's end rewrites the same row with the same Q)."""
    p = _cuda.grid(1)
    if p >= cursor.shape[0]:
        return
    r = cursor[p] - start_bar
    if 0 <= r < q_rec.shape[0]:
        for a in range(q_rec.shape[2]):
            q_rec[r, p, a] = q[p, 0, a]


@_cuda.jit(cache=True)
def zero_rows_kernel(pnl, position):
    e = _cuda.grid(1)
    if e >= pnl.shape[0] * pnl.shape[1]:
        return
    r = e // pnl.shape[1]
    p = e - r * pnl.shape[1]
    pnl[r, p] = _ZERO64
    position[r, p] = _ZERO32


# ---------------------------------------------------------------------------------------------
# launcher: a device backtest of P policies over one window
# ---------------------------------------------------------------------------------------------
class DeviceBacktest:
    """Backtest state and buffers in one Arena("backtest"); every method only launches kernels
    (plus `set_origin`/`start`, which write two scalars from the host, and `to_host` readers).

        bt = DeviceBacktest(market, params, n_policies, window, chunk_bars, max_trades)
        bt.start(stream)                            # flat at window start, chunk origin = start
        bt.run_actions(packed_rows, stream)         # whole chunk, actions given   (or, per bar:)
        bt.bar_step(q_fn, stream)                   # q_fn -> greedy select -> step -> gather
        bt.scan(stream)                             # fold the chunk into the metric accumulators
        bt.set_origin(origin + chunk_bars)          # next chunk
    """

    def __init__(self, data, params: EnvParams, n_policies: int, window, chunk_bars: int | None = None,
                 max_trades: int | None = None, record_q: bool = False, segment_bars: int | None = None,
                 event_slots: int | None = None):
        market = data if isinstance(data, DeviceMarket) else data.to_device(params.vol_span, params.vol_horizon_bars)
        market.check(params)
        if not isinstance(n_policies, (int, np.integer)) or not 1 <= n_policies <= 1 << 20:
            raise ValueError(f"n_policies = {n_policies!r} is invalid: allowed an integer in [1, 1048576]")
        self.market = market
        self.params = params
        self.n_policies = P = int(n_policies)
        self.start_bar, self.end_bar = check_range("window", window, market.n_bars)
        self.n_bars = self.end_bar - self.start_bar
        chunk = self.n_bars if chunk_bars is None else int(chunk_bars)
        if chunk < 2:
            raise ValueError(f"chunk_bars = {chunk_bars!r} is invalid: allowed an integer >= 2")
        self.chunk_bars = min(chunk, self.n_bars)
        cap = self.n_bars if max_trades is None else int(max_trades)
        if cap < 0:
            raise ValueError(f"max_trades = {max_trades!r} is invalid: allowed an integer >= 0 (0: count only)")
        self.k = params.step_consts(market.tick_size, backtest=True)
        self.last_bar = np.int64(self.end_bar - 1)
        self.state_dim = params.state_dim(market.n_features)
        self.branch_sizes = tuple(np.int64(b) for b in params.branch_sizes)

        arena = Arena("backtest")
        for name, dtype in STATE_FIELDS:
            arena.add(name, (P,), dtype)
        arena.add("pnl_rows", (self.chunk_bars, P), np.float64)
        arena.add("position_rows", (self.chunk_bars, P), np.float32)
        for name, dtype in TRADE_FIELDS:
            arena.add("trade_" + name, (P, max(cap, 1)), dtype)
        arena.add("acc", (_metrics.N_ACC, P), np.float64)
        arena.add("origin", (1,), np.int64)
        arena.add("n_rows", (1,), np.int64)
        arena.add("obs", (P, self.state_dim), np.float32)
        arena.add("mask", (P, params.n_branches, params.max_actions), np.uint8)
        arena.add("q", (P, params.n_branches, params.max_actions), np.float32)
        arena.add("actions", (P, params.n_branches), np.int32)
        sizes, targets, stops = params.grids()
        arena.add("sizes", sizes.shape, np.float32)
        arena.add("targets", targets.shape, np.float32)
        arena.add("stops", stops.shape, np.float32)
        if record_q:  # the direction branch's Q at every decision bar of the window (q_fn bar steps)
            arena.add("q_record", (self.n_bars, P, params.branch_sizes[0]), np.float32)
        self.segment_bars = self.event_slots = None
        if segment_bars is not None:  # run_actions in segments (numbarl/env/backtest_segments.py)
            from numbarl.env import backtest_segments as _seg

            self.segment_bars, self.event_slots = _seg.check_params(segment_bars, event_slots, self.k)
            _seg.add_buffers(arena, P, self.chunk_bars, self.segment_bars, self.event_slots)
        arena.allocate()
        arena.load({"sizes": sizes, "targets": targets, "stops": stops})
        self.arena = arena
        self.capacity = cap
        self.state = StateArrays(*(arena[name] for name, _ in STATE_FIELDS))
        self.grids = Grids(arena["sizes"], arena["targets"], arena["stops"])
        self.mk = MarketArrays(*(market[name] for name in ("features", "mid", "bid", "ask", "high", "low", "vol")))
        self.trades = TradeArrays(*(arena["trade_" + name] for name, _ in TRADE_FIELDS))
        self.origin = self.start_bar
        self.record_q = bool(record_q)
        self.segment_views = None
        if self.segment_bars is not None:
            from numbarl.env import backtest_segments as _seg

            self.segment_views = _seg.views(arena)

    # -- host-side control (between chunks; not inside a capture) --------------------------------
    def set_origin(self, origin: int, stream=None) -> None:
        """Chunk origin (bar of row 0) and the rows the scan folds, written to device memory."""
        self.origin = int(origin)
        rows = min(self.chunk_bars, self.end_bar - self.origin)
        self.arena["origin"].copy_to_device(np.array([self.origin], np.int64), stream=_s(stream))
        self.arena["n_rows"].copy_to_device(np.array([rows], np.int64), stream=_s(stream))

    def start(self, stream=None) -> None:
        """Every policy flat at the window start (and its obs gathered there); metric accumulators
        reset; origin = start."""
        s = _s(stream)
        self.set_origin(self.start_bar, s)
        start_kernel[launch_dims(self.n_policies, BLOCK) + (s,)](self.state, np.int64(self.start_bar))
        launch_gather(self.arena["obs"], self.arena["mask"], self.state, self.mk, self.k, self.branch_sizes, s)
        _metrics.launch_init(self.arena["acc"], self.params.initial_capital, s)
        self.zero_rows(s)

    # -- launches ---------------------------------------------------------------------------------
    def zero_rows(self, stream=None) -> None:
        pnl, pos = self.arena["pnl_rows"], self.arena["position_rows"]
        zero_rows_kernel[launch_dims(pnl.shape[0] * pnl.shape[1], 256) + (_s(stream),)](pnl, pos)

    def run_actions(self, packed_rows, stream=None, marks=None) -> None:
        """All bars of the current chunk. packed_rows: device int32 [chunk_bars, P or 1], row r =
        packed decision at bar origin + r - 1 (numbarl.env.params.pack_actions). marks (segmented
        only): a list that gets the chunk's per-pass CUDA events (backtest_segments.launch)."""
        if packed_rows.shape[0] != self.chunk_bars or packed_rows.shape[1] not in (1, self.n_policies):
            raise ValueError(
                f"packed actions must be int32 [{self.chunk_bars}, {self.n_policies} or 1], got {list(packed_rows.shape)}"
            )
        if self.segment_bars is not None:
            # segments x policies threads, the same results (numbarl/env/backtest_segments.py); the
            # chunk's decisions come from the host's origin: every policy's cursor must be at the
            # chunk's first decision (start(), then whole chunks of run_actions)
            from numbarl.env import backtest_segments as _seg

            _seg.launch(self, packed_rows, _s(stream), marks)
            return
        actions_kernel[launch_dims(self.n_policies, BLOCK) + (_s(stream),)](
            self.state, packed_rows, self.grids, self.mk, self.k, self.last_bar, self.arena["origin"],
            self.arena["pnl_rows"], self.arena["position_rows"], self.trades,
        )  # fmt: skip

    def segment_check(self, stream=None) -> None:
        """Raise if a segmented run_actions found a segment whose replayed end state differs from
        the next segment's carried start (an internal error; never expected), or was called on a
        chunk whose policies were not at its first decision bar (synchronizes)."""
        if self.segment_bars is None:
            return
        s = _s(stream)
        bad = self.arena["seg_bad"].copy_to_host(stream=s)
        s.synchronize()
        if bad[0] == 2:
            raise RuntimeError("segmented backtest: a policy's cursor was not at the chunk's first decision bar; "
                               "run_actions runs each chunk once, after start() or set_origin()")
        if bad[0]:
            raise RuntimeError("segmented backtest: a segment's replayed end state differs from the carried start of "
                               "the next one (internal error; segment_bars=None runs one thread per policy)")

    def segment_exact_bars(self, stream=None) -> int:
        """Bars the carry pass stepped exactly (serially) over the window so far, all policies
        (segmented run_actions; the rest ran in parallel passes). Synchronizes."""
        if self.segment_bars is None:
            return 0
        s = _s(stream)
        exact = self.arena["seg_exact"].copy_to_host(stream=s)
        s.synchronize()
        return int(exact.sum())

    def bar_step(self, q_fn, stream=None) -> None:
        """One bar for every policy: q_fn(obs) -> greedy actions over the mask -> step -> next obs
        and mask (capturable; `start` gathered the first ones)."""
        s = _s(stream)
        obs, q = self.arena["obs"], self.arena["q"]
        q_fn(obs, q, s)
        if self.record_q:
            record_q_kernel[launch_dims(self.n_policies, BLOCK) + (s,)](
                q, self.state.cursor, np.int64(self.start_bar), self.arena["q_record"])
        policy_bar_kernel[self.n_policies, POLICY_BLOCK, s](
            q, self.arena["mask"], self.branch_sizes, self.arena["actions"],
            self.state, self.grids, self.mk, self.k, self.last_bar, self.arena["origin"],
            self.arena["pnl_rows"], self.arena["position_rows"], self.trades, obs,
        )  # fmt: skip

    def scan(self, stream=None) -> None:
        """Fold the chunk's rows into the per-policy metric accumulators (deterministic)."""
        _metrics.launch_scan(
            self.arena["acc"], self.arena["pnl_rows"], self.arena["position_rows"], self.market["session_id"],
            self.arena["origin"], self.arena["n_rows"], _s(stream),
        )  # fmt: skip

    # -- readers (synchronize) ---------------------------------------------------------------------
    def chunk_to_host(self, stream=None) -> tuple[np.ndarray, np.ndarray, int]:
        """(pnl [rows, P], position [rows, P], rows) of the current chunk."""
        s = _s(stream)
        rows = min(self.chunk_bars, self.end_bar - self.origin)
        pnl = self.arena["pnl_rows"].copy_to_host(stream=s)
        pos = self.arena["position_rows"].copy_to_host(stream=s)
        s.synchronize()
        return pnl[:rows], pos[:rows], rows

    def trades_to_host(self, stream=None):
        s = _s(stream)
        counts = self.arena["trade_count"].copy_to_host(stream=s)
        arrays = {name: self.arena["trade_" + name].copy_to_host(stream=s) for name, _ in TRADE_FIELDS}
        s.synchronize()
        return trades_frame(arrays, counts, self.capacity)

    def q_record_to_host(self, stream=None) -> np.ndarray | None:
        """float32 [P, W, n_directions]: the direction branch's greedy-pass Q at each decision bar
        (NaN where no decision was taken: the window's last bar), or None without record_q."""
        if not self.record_q:
            return None
        s = _s(stream)
        rec = self.arena["q_record"].copy_to_host(stream=s)
        s.synchronize()
        out = np.ascontiguousarray(np.transpose(rec, (1, 0, 2)))
        out[:, -1, :] = np.nan
        return out

    def accumulators_to_host(self, stream=None) -> np.ndarray:
        s = _s(stream)
        acc = self.arena["acc"].copy_to_host(stream=s)
        s.synchronize()
        return acc


def _s(stream):
    return default_stream() if stream is None else stream


# ---------------------------------------------------------------------------------------------
# bars of a learned policy: captured graphs of bar steps
# ---------------------------------------------------------------------------------------------
class PolicyBars:
    """Runs the bar steps of a policy callback on one DeviceBacktest, as graph replays or eagerly.

        runner = PolicyBars(bt, q_fn, graph=True)
        runner.run(n_steps, stream)     # n_steps bar steps of the current chunk (surplus: no-ops)

    graph=True: the first `run` captures `bars_per_graph` calls of `bt.bar_step` into one CUDA
    graph; the capture's warm-up (numbarl/cuda/graph.py) executes those bar steps for real, so it
    counts as the first replay. Later runs, on later chunks and later windows started with
    `bt.start`, only replay it: every buffer keeps its address and every per-bar value is device
    state. graph=False: `n_steps` eager `bt.bar_step` calls (the reference path). Under the
    simulator (or `graph.set_eager`) a replay re-calls the captured function: the same masked steps.
    """

    def __init__(self, bt: "DeviceBacktest", q_fn, graph: bool = True, bars_per_graph: int | None = None):
        bars_per_graph = GRAPH_BARS if bars_per_graph is None else bars_per_graph
        if not isinstance(bars_per_graph, (int, np.integer)) or bars_per_graph < 1:
            raise ValueError(f"bars_per_graph = {bars_per_graph!r} is invalid: allowed an integer >= 1")
        self.bt = bt
        self.q_fn = q_fn
        self.graph_mode = bool(graph)
        # a graph longer than a chunk's steps would only add masked steps
        self.bars_per_graph = int(min(bars_per_graph, bt.chunk_bars))
        self.graph = None
        self.replays = 0  # graph replays (the capture's warm-up counted), for tests and benchmarks

    def _bars(self, stream) -> None:
        q_fn = self.q_fn
        for _ in range(self.bars_per_graph):
            self.bt.bar_step(q_fn, stream)

    def run(self, n_steps: int, stream=None) -> None:
        """At least n_steps bar steps of every policy (the chunk's decisions; extra steps no-ops)."""
        s = _s(stream)
        if not self.graph_mode:
            for _ in range(int(n_steps)):
                self.bt.bar_step(self.q_fn, s)
            return
        done = 0
        if self.graph is None and n_steps > 0:
            try:
                self.graph = cuda_graph.capture(self._bars, s)  # the warm-up runs bars_per_graph real steps
            except cuda_graph.GraphCaptureError as exc:
                raise cuda_graph.GraphCaptureError(
                    f"{exc}\nThe backtest's q_fn runs inside the graph of bar steps: it must only enqueue work "
                    "(no allocation, host copy or synchronize); backtest(..., graph=False) runs it eagerly."
                ) from exc
            done = self.bars_per_graph
            self.replays += 1
        while done < n_steps:
            self.graph.replay(s)
            done += self.bars_per_graph
            self.replays += 1

    def close(self) -> None:
        if self.graph is not None:
            self.graph.close()
            self.graph = None


class _WeakCallback:
    """Calls a bound method through a weak reference, so a cached graph does not keep the agent
    (its replay buffer, its parameters) alive; the cache entry is dropped when the agent dies."""

    def __init__(self, method, on_death):
        self._ref = weakref.WeakMethod(method, on_death)

    def __call__(self, *args):
        method = self._ref()
        if method is None:
            raise ReferenceError("the backtest's q_fn belongs to an object that no longer exists")
        return method(*args)


_POLICY_CACHE: "OrderedDict[tuple, PolicyBars]" = OrderedDict()


def _drop(key) -> None:
    runner = _POLICY_CACHE.pop(key, None)
    if runner is not None:
        runner.close()


def policy_bars(market, params: EnvParams, n_policies: int, window, chunk_bars, max_trades, q_fn, graph: bool = True,
                record_q: bool = False) -> PolicyBars:
    """A PolicyBars (with its DeviceBacktest) for this backtest; reused across calls when possible.

    With a DeviceMarket and graph=True, the runner is cached per (market, params, n_policies,
    window, chunk_bars, max_trades, q_fn), so the validation window of every epoch replays the
    graph captured at the first epoch (the agent's weights change in place, at fixed addresses).
    An entry holds its market (so `id(market)` stays its own) but only a weak reference to the
    object whose bound method q_fn is, and dies with it; beyond GRAPH_CACHE_SIZE entries the oldest
    is closed. Host MarketData (uploaded per call) and graph=False get a fresh DeviceBacktest each
    call, as before.
    """
    if not graph or not isinstance(market, DeviceMarket):
        return PolicyBars(DeviceBacktest(market, params, n_policies, window, chunk_bars, max_trades, record_q), q_fn,
                          graph)
    owner = getattr(q_fn, "__self__", None)
    func = getattr(q_fn, "__func__", q_fn) if owner is not None else q_fn
    key = (id(market), id(owner), func, params, int(n_policies), tuple(window), chunk_bars, max_trades, bool(record_q))
    runner = _POLICY_CACHE.get(key)
    if runner is not None:
        _POLICY_CACHE.move_to_end(key)
        return runner
    on_death = lambda _ref, key=key: _drop(key)  # noqa: E731 - a weakref callback
    bt = DeviceBacktest(market, params, n_policies, window, chunk_bars, max_trades, record_q)
    callback = _WeakCallback(q_fn, on_death) if owner is not None else q_fn
    runner = PolicyBars(bt, callback, graph=True)
    _POLICY_CACHE[key] = runner
    while len(_POLICY_CACHE) > GRAPH_CACHE_SIZE:
        _drop(next(iter(_POLICY_CACHE)))
    return runner


def _check_trade_list(max_trades) -> None:
    """backtest()/backtest_reference() compute the trade metrics from the trade list: count-only
    mode (max_trades=0) is DeviceBacktest's, for a caller that reads only the device scan."""
    if max_trades is not None and int(max_trades) < 1:
        raise ValueError(f"max_trades = {max_trades!r} is invalid here: the trade metrics need the trade list "
                         "(an integer >= 1, or None = one slot per bar); count-only (0) is for DeviceBacktest")


def trades_frame(arrays: dict, counts: np.ndarray, capacity: int):
    """Trade list DataFrame from [P, capacity] trade arrays and per-policy trade counts."""
    import pandas as pd

    counts = np.asarray(counts, np.int64)
    over = np.flatnonzero(counts > capacity)
    if over.size:
        p = int(over[0])
        raise RuntimeError(
            f"backtest trade buffer overflowed: policy {p} closed {int(counts[p])} trades but max_trades = {capacity}; "
            "raise max_trades (None = one slot per bar)"
        )
    cols = {name: [] for name, _ in TRADE_FIELDS}
    policy = []
    for p, n in enumerate(counts):
        policy.append(np.full(n, p, np.int64))
        for name, _ in TRADE_FIELDS:
            cols[name].append(arrays[name][p, :n])
    cat = {name: (np.concatenate(v) if v else np.zeros(0, dtype)) for (name, dtype), v in zip(TRADE_FIELDS, cols.values())}
    size = cat["size"].astype(np.float64)
    return pd.DataFrame(
        {
            "policy": np.concatenate(policy) if policy else np.zeros(0, np.int64),
            "entry_bar": cat["entry_bar"].astype(np.int64),
            "exit_bar": cat["exit_bar"].astype(np.int64),
            "side": np.sign(size).astype(np.int8),
            "size": np.abs(size),
            "entry_price": cat["entry_price"],
            "exit_price": cat["exit_price"],
            "pnl": cat["pnl"],
            "exit_reason": pd.Categorical([EXIT_REASONS[r] for r in cat["reason"]], categories=list(EXIT_REASONS)),
        }
    )


# ---------------------------------------------------------------------------------------------
# the host API
# ---------------------------------------------------------------------------------------------
@dataclass
class BacktestResult:
    """Per-bar P&L and positions [P, W], trades, and metrics of one backtest window."""

    window: tuple[int, int]
    pnl: np.ndarray  # float64 [P, W]
    position: np.ndarray  # float32 [P, W]
    trades: object  # pandas DataFrame
    session_id: np.ndarray  # int32 [W]
    bars_per_day: float
    initial_capital: float
    accumulators: np.ndarray  # float64 [N_ACC, P]: the device metric scan
    q_record: np.ndarray | None = None  # float32 [P, W, n_directions] with record_q (q_fn backtests)

    @property
    def n_policies(self) -> int:
        return int(self.pnl.shape[0])

    def equity(self) -> np.ndarray:
        return self.initial_capital + np.cumsum(self.pnl, axis=1)

    def metrics(self) -> "_metrics.Metrics":
        return _metrics.finalize(self.accumulators, self.trades, self.bars_per_day, self.initial_capital, pnl=self.pnl)


def _window_actions(actions, params: EnvParams, n_bars: int) -> np.ndarray:
    """[P, W, 4] / [W, 4] branch indices -> packed int32 [W, P or 1] (time-major)."""
    a = validate_actions(actions, params)
    if a.ndim == 2:
        a = a[None]
    if a.ndim != 3 or a.shape[1] != n_bars:
        raise ValueError(f"actions must be [P, {n_bars}, {N_BRANCHES}] or [{n_bars}, {N_BRANCHES}] (one row per window bar), got {a.shape}")
    return np.ascontiguousarray(pack_actions(a).T)


def backtest(
    data,
    window,
    params: EnvParams | None = None,
    actions=None,
    q_fn=None,
    n_policies: int | None = None,
    chunk_bars: int | None = None,
    max_trades: int | None = None,
    stream=None,
    graph: bool = True,
    record_q: bool = False,
    segment_bars: int | None = None,
    event_slots: int | None = None,
) -> BacktestResult:
    """Backtest P policies over window=(start, end) on the device.

    actions: int [P, W, 4] or [W, 4] branch indices per bar, or
    q_fn(obs_dev [P, state_dim], q_out_dev [P, 4, max_actions], stream): greedy Q per bar
    (n_policies required). Opportunity cost is off; the step function is the env's.
    graph: run the q_fn bar steps as replays of a captured CUDA graph (`PolicyBars`; q_fn must then
    be capturable: no allocation, host copy or synchronize), or False: one eager launch sequence
    per bar. Both give bitwise identical results.
    record_q (q_fn only): also return the direction branch's Q at every decision bar
    (BacktestResult.q_record [P, W, n_directions]; the validation feedback loop reads it).
    segment_bars (actions only): run each chunk as segments of this many bars, segments x policies
    threads (numbarl/env/backtest_segments.py; event_slots: events recorded per segment, default
    segment_bars); the results are identical to segment_bars=None (one thread per policy).
    Returns host arrays [P, W]; for windows too large for host memory (e.g. 4,096 x 10^6 bars)
    drive DeviceBacktest chunk by chunk and take the metrics from its device scan instead.
    """
    params = EnvParams() if params is None else params
    if (actions is None) == (q_fn is None):
        raise ValueError("backtest needs exactly one of actions= (branch indices) or q_fn= (greedy Q callback)")
    _check_trade_list(max_trades)
    host = data.data if isinstance(data, DeviceMarket) else data
    if not isinstance(host, MarketData):
        raise TypeError(f"data must be MarketData or DeviceMarket, got {type(data).__name__}")
    start, end = check_range("window", window, host.n_bars)
    n_bars = end - start
    packed = None
    if actions is not None:
        packed = _window_actions(actions, params, n_bars)
        n_pol = packed.shape[1] if n_policies is None else int(n_policies)
        if packed.shape[1] not in (1, n_pol):
            raise ValueError(f"actions are for {packed.shape[1]} policies but n_policies = {n_pol}")
    else:
        if n_policies is None:
            raise ValueError("backtest with q_fn needs n_policies")
        if segment_bars is not None:
            raise ValueError("segment_bars is for backtests of given actions (a q_fn policy decides bar by bar)")
        n_pol = int(n_policies)
    if packed is None:
        runner = policy_bars(data, params, n_pol, (start, end), chunk_bars, max_trades, q_fn, graph, record_q)
        bt = runner.bt
    else:
        bt = DeviceBacktest(data, params, n_pol, (start, end), chunk_bars, max_trades,
                            segment_bars=segment_bars, event_slots=event_slots)
    s = _s(stream)
    pnl = np.zeros((n_pol, n_bars), np.float64)
    pos = np.zeros((n_pol, n_bars), np.float32)
    bt.start(s)
    rows_dev = _cuda.device_array((bt.chunk_bars, packed.shape[1]), np.int32) if packed is not None else None
    origin = start
    while origin < end:
        if origin != start:
            bt.set_origin(origin, s)
            bt.zero_rows(s)
        rows = min(bt.chunk_bars, end - origin)
        if packed is not None:
            chunk = np.zeros((bt.chunk_bars, packed.shape[1]), np.int32)
            lo = origin - 1 - start  # window row of the decision driving chunk row 0
            src_lo = max(lo, 0)
            src_hi = min(lo + bt.chunk_bars, n_bars)
            chunk[src_lo - lo : src_hi - lo] = packed[src_lo:src_hi]
            rows_dev.copy_to_device(chunk, stream=s)
            bt.run_actions(rows_dev, s)
        else:
            runner.run(rows - 1 if origin == start else rows, s)
        bt.scan(s)
        c_pnl, c_pos, _ = bt.chunk_to_host(s)
        pnl[:, origin - start : origin - start + rows] = c_pnl.T
        pos[:, origin - start : origin - start + rows] = c_pos.T
        origin += bt.chunk_bars
    bt.segment_check(s)
    trades = bt.trades_to_host(s)
    return BacktestResult(
        window=(start, end),
        pnl=pnl,
        position=pos,
        trades=trades,
        session_id=host.session_id[start:end].copy(),
        bars_per_day=host.bars_per_day,
        initial_capital=params.initial_capital,
        accumulators=bt.accumulators_to_host(s),
        q_record=bt.q_record_to_host(s),
    )


def backtest_reference(data: MarketData, window, params: EnvParams, actions, max_trades: int | None = None,
                       return_state: bool = False):
    """The same backtest on the CPU (@njit loops of the same row functions); actions only.
    return_state: (result, the final StateArrays) instead of the result."""
    _check_trade_list(max_trades)
    start, end = check_range("window", window, data.n_bars)
    n_bars = end - start
    packed = _window_actions(actions, params, n_bars)
    n_pol = packed.shape[1]
    cap = n_bars if max_trades is None else int(max_trades)
    k = params.step_consts(data.tick_size, backtest=True)
    st = StateArrays(*(np.zeros(n_pol, dtype) for _, dtype in STATE_FIELDS))
    tr = TradeArrays(*(np.zeros((n_pol, max(cap, 1)), dtype) for _, dtype in TRADE_FIELDS))
    mk = MarketArrays(data.features, data.mid, data.bid, data.ask, data.high, data.low, data.volatility(params.vol_span, params.vol_horizon_bars))
    grids = Grids(*params.grids())
    # one chunk = the whole window: row r = bar start + r, action row r = decision at bar start + r - 1
    rows = np.zeros((n_bars, n_pol), np.int32)
    rows[1:] = packed[:-1]
    pnl_tp = np.zeros((n_bars, n_pol), np.float64)
    pos_tp = np.zeros((n_bars, n_pol), np.float32)
    backtest_ref_loop(st, rows, grids, mk, k, np.int64(start), np.int64(end - 1), np.int64(start), pnl_tp, pos_tp, tr)
    acc = np.empty((_metrics.N_ACC, n_pol), np.float64)
    for p in range(n_pol):
        _metrics.init_row(acc, p, np.float64(params.initial_capital))
    _metrics.scan_ref(acc, pnl_tp, pos_tp, data.session_id, start, n_bars)
    arrays = {name: getattr(tr, name) for name, _ in TRADE_FIELDS}
    result = BacktestResult(
        window=(start, end),
        pnl=np.ascontiguousarray(pnl_tp.T),
        position=np.ascontiguousarray(pos_tp.T),
        trades=trades_frame(arrays, st.trade_count, cap),
        session_id=data.session_id[start:end].copy(),
        bars_per_day=data.bars_per_day,
        initial_capital=params.initial_capital,
        accumulators=acc,
    )
    return (result, st) if return_state else result
