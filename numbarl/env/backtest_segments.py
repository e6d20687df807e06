"""Segmented backtest of given actions: many threads per policy, results identical to the one-thread
path (`backtest.actions_kernel`) and so to the CPU reference.

Why: `actions_kernel` runs one thread per policy over a chunk of bars. 4,096 policies are 4,096
threads, about one warp per SM of an H200 (132 SMs), so every bar waits for its own memory and
float64 latency (~1 us per bar per policy). Here a chunk's decisions are cut into segments of
`seg_bars` bars and each (segment, policy) pair is a thread (4,096 policies x 64 segments of a
65,536-bar chunk: 262,144 threads), in three passes per chunk:

  A. SPECULATE (thread per segment x policy): run the segment with `step_core` from a flat book
     with nothing pending (what the policy is in whenever it is flat and idle). Record per step
     whether the speculative state is flat and idle (one bit per bar), the events that change the
     running accumulators in the order `step_core` applies them (closed trade: its net P&L and
     signed size; entry: its size), and the speculative state at the segment's end.
  B. CARRY (thread per policy, segments in order): from the policy's exact state at the segment
     start, step exactly (`step_core`) until the exact state is flat and idle at a bar where the
     speculative one was too. From there on both runs are the same run: what decides the path
     (position, entry price and bar, plan, levels, pending order) is identical when flat and idle
     (the backtest has no episodes and no hard cap, which the host checks), and every trade's
     prices and P&L depend only on that path. So the segment's end state is the speculative end
     state with the accumulators (realized P&L, trade count, Kelly counts and sums, DSR EMAs,
     last entry bar, episode length) folded from the exact ones over the speculative events after
     the join, with the same float operations in the same order as `step_core` (`core._book` for
     a closed trade, `realized -= fee x size` for an entry). A segment that never joins has been
     stepped exactly to its end; one whose events overflowed the slots is stepped exactly after
     the join. The exact state at every segment start is stored. (Pass A zeroes the accumulators
     before every step and stores only the path fields and the mark, so the compiler drops its
     accumulator arithmetic: `_path_only`, `store_path`.)
  C. REPLAY (thread per segment x policy): run the segment with the env's `_advance` from its
     exact start state, writing the per-bar P&L, position and trade rows exactly as the
     one-thread kernel does (a trade's column is the exact trade count). The Kelly and DSR
     accumulators feed no output, so pass C zeroes them before each step (`_no_kelly_dsr`: the
     compiler drops the DSR's division and square root); pass B carries them and stores the
     policy's state for the next chunk. Each thread checks that its end state equals the next
     segment's start from pass B in every other field (a flag the host reads; any difference is
     a bug, never a tolerance).

Every output is computed by the same float operations on the same values as the one-thread path:
no reassociation, no float atomics (tests/env/test_backtest_segments.py checks it bitwise on the
CPU and under the simulator; tests/env/test_gpu_backtest_segments.py on the GPU). Work: two full
passes (A without the row writes) plus pass B, which steps only until the join (a few bars per
segment while a position is open) and folds ~0.1-0.3 events per bar. Passes A and C have
n_segments x P threads, enough to fill the GPU; B has P threads but little dependent work.

Memory (per DeviceBacktest, S = ceil(chunk_bars / seg_bars) segments, E event slots): events
16 x E bytes per segment and policy (E = seg_bars by default, one event per bar: 16 bytes per
chunk bar and policy, 4.3 GB at 4,096 policies x 65,536-bar chunks), two states per segment and
policy (280 bytes), one bit per bar. A segment with more events than slots (a step has at most
three: a close, an entry, a stop/target exit) stays exact: pass B steps it after the join.

A policy that is never flat and idle (always in a position, no target or stop) never joins: pass
B then steps every bar exactly, at the one-thread path's speed; the results stay exact.

`segments_ref_loop` runs the three passes as @njit loops over the same row functions (the CPU
check of the algorithm, `backtest_segmented_reference`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from numbarl.cuda.launch import device_function
from numbarl.cuda.runtime import cuda
from numbarl.env import metrics as _metrics
from numbarl.env.backtest import (
    _MASK8,
    _S8,
    _S16,
    _S24,
    _ZERO32,
    TRADE_FIELDS,
    BacktestResult,
    TradeArrays,
    _advance,
    _check_trade_list,
    _window_actions,
    start_row,
    trades_frame,
)
from numbarl.env.core import _book, step_core
from numbarl.env.device import launch_dims
from numbarl.env.market import check_range
from numbarl.env.params import EXIT_CLOSE, EXIT_NONE
from numbarl.env.rows import load_bars, load_row, store_row
from numbarl.env.state import (
    STATE_FIELDS,
    Grids,
    MarketArrays,
    StateArrays,
    initial_portfolio,
    make_portfolio,
    make_trade,
    row_jit,
)

_cuda = cuda()

BLOCK = 128
_F0 = np.float64(0.0)
_ONE64 = np.int64(1)
_FULL_BUDGET = np.float64(1.0)  # the risk budget ρ of every backtest step (core.py; backtest.py's)
_WORD = np.int64(0xFFFFFFFF)


class SegmentArrays(NamedTuple):
    """Pass A's records and pass C's check flag; S = segments per chunk, E = event slots."""

    bits: object  # uint32 [S, ceil(seg_bars / 32), P]: bit i = speculative state flat and idle after step i
    # events [S, P, E]: a policy's events are contiguous, so pass B (one thread per policy, reading
    # them in order) hits L1 for 15 of every 16; pass A writes them sparsely (~0.15 per bar)
    code: object  # int32 [S, P, E]: 2 x step offset + 1 for an entry, + 0 for a closed trade
    a: object  # float64 [S, P, E]: closed trade's net P&L, or the entry's size
    b: object  # float32 [S, P, E]: closed trade's signed size (0 for an entry; sizes are float32 grid values)
    count: object  # int32 [S, P]: events of the segment (> E: overflowed, the slots hold the first E)
    bad: object  # int32 [1]: 1 when pass C found a segment's end different from the next start; 2 when
    # pass B found a policy whose cursor was not at the chunk's first decision bar
    exact: object  # int64 [P]: bars pass B stepped exactly in this window (a diagnostic: the serial work)


def segment_count(n_decisions: int, seg_bars: int) -> int:
    return (int(n_decisions) + int(seg_bars) - 1) // int(seg_bars)


# ---------------------------------------------------------------------------------------------
# row functions (kernels and the CPU loop)
# ---------------------------------------------------------------------------------------------
@row_jit
def idle(s):
    """Flat with no pending order: the state every speculative segment starts from."""
    return s.position == _F0 and s.pending_due < 0


@row_jit
def same_replayed(s, t):
    """Every field pass C computes (all but the Kelly and DSR accumulators) equal."""
    return (
        s.cursor == t.cursor and s.ep_len == t.ep_len and s.position == t.position and s.entry_price == t.entry_price
        and s.entry_bar == t.entry_bar and s.bars_in_trade == t.bars_in_trade and s.plan_target == t.plan_target
        and s.plan_stop == t.plan_stop and s.target_level == t.target_level and s.stop_level == t.stop_level
        and s.last_entry_bar == t.last_entry_bar and s.realized == t.realized and s.unrealized == t.unrealized
        and s.trade_count == t.trade_count and s.pending_due == t.pending_due and s.pending_dir == t.pending_dir
        and s.pending_size == t.pending_size and s.pending_target == t.pending_target and s.pending_stop == t.pending_stop
    )  # fmt: skip


@row_jit
def _no_kelly_dsr(s):
    """s with the Kelly and DSR accumulators zeroed: no output of pass C reads them (pass B
    carries them exactly), and zeroed before every step their arithmetic is dead code."""
    return make_portfolio(
        s.cursor, s.ep_len, s.position, s.entry_price, s.entry_bar, s.bars_in_trade, s.plan_target, s.plan_stop,
        s.target_level, s.stop_level, s.last_entry_bar, s.realized, s.unrealized, s.trade_count, 0, 0, _F0, _F0, _F0,
        _F0, s.pending_due, s.pending_dir, s.pending_size, s.pending_target, s.pending_stop,
    )  # fmt: skip


@row_jit
def _step(s, packed, col, origin, grids, mk, k, last_bar):
    """step_core from s.cursor with the packed decision of that bar (as `actions_row` decodes it)."""
    c = s.cursor
    a = packed[c + 1 - origin, col]
    return step_core(
        s, a & _MASK8, grids.sizes[(a >> _S8) & _MASK8], grids.targets[(a >> _S16) & _MASK8],
        grids.stops[(a >> _S24) & _MASK8], load_bars(mk, c), _ZERO32, _FULL_BUDGET, k, last_bar,
    )  # fmt: skip


@row_jit
def store_path(spec, i, s):
    """The speculative end state pass B takes over after a join: the fields that decide the path,
    and the mark (the accumulators are pass B's own)."""
    spec.position[i] = s.position
    spec.entry_price[i] = s.entry_price
    spec.entry_bar[i] = s.entry_bar
    spec.bars_in_trade[i] = s.bars_in_trade
    spec.plan_target[i] = s.plan_target
    spec.plan_stop[i] = s.plan_stop
    spec.target_level[i] = s.target_level
    spec.stop_level[i] = s.stop_level
    spec.unrealized[i] = s.unrealized
    spec.pending_due[i] = s.pending_due
    spec.pending_dir[i] = s.pending_dir
    spec.pending_size[i] = s.pending_size
    spec.pending_target[i] = s.pending_target
    spec.pending_stop[i] = s.pending_stop


@row_jit
def _path_only(s):
    """s with its accumulators zeroed: they never change the path (what `store_path` keeps), and
    without a value carried from step to step the compiler drops their arithmetic in pass A."""
    return make_portfolio(
        s.cursor, 0, s.position, s.entry_price, s.entry_bar, s.bars_in_trade, s.plan_target, s.plan_stop,
        s.target_level, s.stop_level, s.last_entry_bar, _F0, _F0, 0, 0, 0, _F0, _F0, _F0, _F0,
        s.pending_due, s.pending_dir, s.pending_size, s.pending_target, s.pending_stop,
    )  # fmt: skip


@row_jit
def _event(sg, j, p, m, code, a, b):
    if m < sg.a.shape[2]:
        sg.code[j, p, m] = code
        sg.a[j, p, m] = a
        sg.b[j, p, m] = b
    return m + 1


@row_jit
def speculate_row(e, packed, grids, mk, k, last_bar, origin, c0, n_dec, seg_bars, spec, sg):
    """Pass A for thread e = segment j x P + policy p."""
    P = sg.count.shape[1]
    j = e // P
    p = e - j * P
    col = p if packed.shape[1] > 1 else 0
    nb = min(seg_bars, n_dec - j * seg_bars)
    s = initial_portfolio(c0 + j * seg_bars)
    m = 0
    word = np.int64(0)
    for i in range(nb):
        c = s.cursor
        s, o, t1, t2 = _step(_path_only(s), packed, col, origin, grids, mk, k, last_bar)
        # the accumulators' events in step_core's order: closed trade t1, entry, closed trade t2
        if t1.reason != EXIT_NONE:
            m = _event(sg, j, p, m, 2 * i, t1.pnl, t1.size)
        if s.last_entry_bar == c:
            m = _event(sg, j, p, m, 2 * i + 1, abs(o.position_held), _F0)
        if t2.reason != EXIT_NONE:
            m = _event(sg, j, p, m, 2 * i, t2.pnl, t2.size)
        if idle(s):
            word |= _ONE64 << (i & 31)
        if (i & 31) == 31 or i == nb - 1:
            sg.bits[j, i >> 5, p] = np.uint32(word & _WORD)
            word = np.int64(0)
    sg.count[j, p] = m
    store_path(spec, j * P + p, s)


@row_jit
def carry_row(p, st, packed, grids, mk, k, last_bar, origin, c0, n_dec, seg_bars, spec, sg, starts):
    """Pass B for policy p: the exact state at every segment start of the chunk (and after the last)."""
    P = st.cursor.shape[0]
    col = p if packed.shape[1] > 1 else 0
    cap = sg.a.shape[2]
    n_seg = (n_dec + seg_bars - 1) // seg_bars
    x = load_row(st, p)
    if x.cursor != c0:  # not at the chunk's first decision (a chunk run twice?): refuse, loudly
        sg.bad[0] = 2
        return
    exact = sg.exact[p] if c0 != origin else 0  # (the window's first chunk starts the count)
    for j in range(n_seg):
        store_row(starts, j * P + p, x)
        nb = min(seg_bars, n_dec - j * seg_bars)
        i = 0
        joined = idle(x)
        while not joined and i < nb:
            x, _o, _t1, _t2 = _step(x, packed, col, origin, grids, mk, k, last_bar)
            joined = idle(x) and ((np.int64(sg.bits[j, i >> 5, p]) >> (i & 31)) & _ONE64) != 0
            i += 1
        if not joined:
            exact += i
            continue  # stepped exactly to the segment's end
        m = sg.count[j, p]
        if m > cap:  # the events overflowed their slots: step the rest exactly
            while i < nb:
                x, _o, _t1, _t2 = _step(x, packed, col, origin, grids, mk, k, last_bar)
                i += 1
            exact += i
            continue
        exact += i
        b0 = c0 + j * seg_bars
        realized = x.realized
        count = x.trade_count
        kw = x.kelly_wins
        kl = x.kelly_losses
        ksw = x.kelly_sum_win
        ksl = x.kelly_sum_loss
        da = x.dsr_a
        db = x.dsr_b
        last_entry = x.last_entry_bar
        for q in range(m):
            code = sg.code[j, p, q]
            off = code >> 1
            if off >= i:
                a = sg.a[j, p, q]
                if (code & 1) != 0:
                    realized -= k.fee * a  # step_core's entry fee, as it writes it
                    last_entry = b0 + off
                else:
                    t = make_trade(EXIT_CLOSE, 0, 0, sg.b[j, p, q], _F0, _F0, a)
                    realized, count, kw, kl, ksw, ksl, da, db, _d = _book(t, realized, count, kw, kl, ksw, ksl, da, db, k)
        e = load_row(spec, j * P + p)  # the fields store_path wrote (the other loads are dropped)
        x = make_portfolio(
            b0 + nb, x.ep_len + (nb - i), e.position, e.entry_price, e.entry_bar, e.bars_in_trade, e.plan_target,
            e.plan_stop, e.target_level, e.stop_level, last_entry, realized, e.unrealized, count, kw, kl, ksw, ksl,
            da, db, e.pending_due, e.pending_dir, e.pending_size, e.pending_target, e.pending_stop,
        )  # fmt: skip
    store_row(starts, n_seg * P + p, x)
    store_row(st, p, x)  # the policy's state for the next chunk
    sg.exact[p] = exact


@row_jit
def replay_row(e, st, packed, grids, mk, k, last_bar, origin, n_dec, seg_bars, starts, sg, pnl, position, tr):
    """Pass C for thread e = segment j x P + policy p: the segment's rows and trades, exactly."""
    P = st.cursor.shape[0]
    j = e // P
    p = e - j * P
    col = p if packed.shape[1] > 1 else 0
    nb = min(seg_bars, n_dec - j * seg_bars)
    s = load_row(starts, j * P + p)
    for _ in range(nb):
        a = packed[s.cursor + 1 - origin, col]
        s = _advance(
            _no_kelly_dsr(s), p, a & _MASK8, grids.sizes[(a >> _S8) & _MASK8], grids.targets[(a >> _S16) & _MASK8],
            grids.stops[(a >> _S24) & _MASK8], mk, k, last_bar, origin, pnl, position, tr,
        )  # fmt: skip
    if not same_replayed(s, load_row(starts, (j + 1) * P + p)):
        sg.bad[0] = 1


@row_jit
def segments_ref_loop(st, packed, grids, mk, k, last_bar, origin, c0, n_dec, seg_bars, spec, sg, starts, pnl, position, tr):
    """The three passes of one chunk as CPU loops (the kernels' order of work does not matter)."""
    P = st.cursor.shape[0]
    n = ((n_dec + seg_bars - 1) // seg_bars) * P
    for e in range(n):
        speculate_row(e, packed, grids, mk, k, last_bar, origin, c0, n_dec, seg_bars, spec, sg)
    for p in range(P):
        carry_row(p, st, packed, grids, mk, k, last_bar, origin, c0, n_dec, seg_bars, spec, sg, starts)
    for e in range(n):
        replay_row(e, st, packed, grids, mk, k, last_bar, origin, n_dec, seg_bars, starts, sg, pnl, position, tr)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
_speculate_row = device_function(speculate_row)
_carry_row = device_function(carry_row)
_replay_row = device_function(replay_row)


@_cuda.jit(cache=True)
def speculate_kernel(packed, grids, mk, k, last_bar, origin, c0, n_dec, seg_bars, spec, sg):
    e = _cuda.grid(1)
    if e >= ((n_dec + seg_bars - 1) // seg_bars) * sg.count.shape[1]:
        return
    _speculate_row(e, packed, grids, mk, k, last_bar, origin, c0, n_dec, seg_bars, spec, sg)


@_cuda.jit(cache=True)
def carry_kernel(st, packed, grids, mk, k, last_bar, origin, c0, n_dec, seg_bars, spec, sg, starts):
    p = _cuda.grid(1)
    if p >= st.cursor.shape[0]:
        return
    _carry_row(p, st, packed, grids, mk, k, last_bar, origin, c0, n_dec, seg_bars, spec, sg, starts)


@_cuda.jit(cache=True)
def replay_kernel(st, packed, grids, mk, k, last_bar, origin, n_dec, seg_bars, starts, sg, pnl, position, tr):
    e = _cuda.grid(1)
    if e >= ((n_dec + seg_bars - 1) // seg_bars) * st.cursor.shape[0]:
        return
    _replay_row(e, st, packed, grids, mk, k, last_bar, origin, n_dec, seg_bars, starts, sg, pnl, position, tr)


# ---------------------------------------------------------------------------------------------
# buffers and the launcher (DeviceBacktest.run_actions with segment_bars)
# ---------------------------------------------------------------------------------------------
def check_params(seg_bars, event_slots, k) -> tuple[int, int]:
    if not isinstance(seg_bars, (int, np.integer)) or seg_bars < 1:
        raise ValueError(f"segment_bars = {seg_bars!r} is invalid: allowed an integer >= 1 (None: one thread per policy)")
    slots = int(seg_bars) if event_slots is None else event_slots
    if not isinstance(slots, (int, np.integer)) or slots < 1:
        raise ValueError(f"event_slots = {event_slots!r} is invalid: allowed an integer >= 1 (None: segment_bars)")
    if k.episode_length != 0 or k.hard_cap != 0:  # the join needs a path decided by the trade state alone
        raise ValueError("segmented backtest needs the backtest step constants (no episodes, no hard cap)")
    if k.kelly_lambda > 0:  # the cap sizes entries from the Kelly sums: a flat book is no longer a join point
        raise ValueError("segmented backtest: env.kelly_lambda > 0 makes entry sizes depend on the Kelly accumulators, "
                         "which the speculative pass does not have; use segment_bars=None (one thread per policy)")
    return int(seg_bars), int(slots)


def add_buffers(arena, n_policies: int, chunk_bars: int, seg_bars: int, slots: int) -> None:
    S = segment_count(chunk_bars, seg_bars)
    P = n_policies
    for name, dtype in STATE_FIELDS:
        arena.add("seg_spec_" + name, (S * P,), dtype)
        arena.add("seg_start_" + name, ((S + 1) * P,), dtype)
    arena.add("seg_bits", (S, (seg_bars + 31) // 32, P), np.uint32)
    arena.add("seg_code", (S, P, slots), np.int32)
    arena.add("seg_a", (S, P, slots), np.float64)
    arena.add("seg_b", (S, P, slots), np.float32)
    arena.add("seg_count", (S, P), np.int32)
    arena.add("seg_bad", (1,), np.int32)
    arena.add("seg_exact", (P,), np.int64)


def views(arena):
    spec = StateArrays(*(arena["seg_spec_" + name] for name, _ in STATE_FIELDS))
    starts = StateArrays(*(arena["seg_start_" + name] for name, _ in STATE_FIELDS))
    sg = SegmentArrays(*(arena["seg_" + name] for name in SegmentArrays._fields))
    return spec, starts, sg


def chunk_decisions(start_bar: int, end_bar: int, origin: int, chunk_bars: int) -> tuple[int, int]:
    """(first decision bar, decisions) of the chunk at `origin`: the policies' cursor at the chunk's
    start (the window start, or origin - 1 after a whole earlier chunk) through its last decision."""
    c0 = start_bar if origin == start_bar else origin - 1
    c_end = min(origin + chunk_bars - 1, end_bar - 1)
    return c0, max(0, c_end - c0)


def launch(bt, packed_rows, stream, marks=None) -> None:
    """The three passes of bt's current chunk (every policy's cursor at the chunk's first decision).
    marks: a list to append the chunk's four CUDA events to (before A, after A, after B, after C),
    for a per-pass profile (the bench)."""
    c0, n_dec = chunk_decisions(bt.start_bar, bt.end_bar, bt.origin, bt.chunk_bars)
    if n_dec == 0:
        return
    L = np.int64(bt.segment_bars)
    P = bt.n_policies
    n = segment_count(n_dec, bt.segment_bars) * P
    origin, c0, n_dec = np.int64(bt.origin), np.int64(c0), np.int64(n_dec)
    spec, starts, sg = bt.segment_views
    grid = launch_dims(n, BLOCK) + (stream,)
    events = [_cuda.event() for _ in range(4)] if marks is not None else None
    if events:
        events[0].record(stream)
    speculate_kernel[grid](packed_rows, bt.grids, bt.mk, bt.k, bt.last_bar, origin, c0, n_dec, L, spec, sg)
    if events:
        events[1].record(stream)
    carry_kernel[launch_dims(P, 32) + (stream,)](
        bt.state, packed_rows, bt.grids, bt.mk, bt.k, bt.last_bar, origin, c0, n_dec, L, spec, sg, starts)
    if events:
        events[2].record(stream)
    replay_kernel[grid](
        bt.state, packed_rows, bt.grids, bt.mk, bt.k, bt.last_bar, origin, n_dec, L, starts, sg,
        bt.arena["pnl_rows"], bt.arena["position_rows"], bt.trades,
    )  # fmt: skip
    if events:
        events[3].record(stream)
        marks.append(tuple(events))


# ---------------------------------------------------------------------------------------------
# the algorithm on the CPU
# ---------------------------------------------------------------------------------------------
def backtest_segmented_reference(data, window, params, actions, segment_bars: int, chunk_bars: int | None = None,
                                 event_slots: int | None = None, max_trades: int | None = None,
                                 return_state: bool = False):
    """`backtest_reference` computed by the segmented algorithm (@njit loops of the row functions
    above, chunk by chunk as the device runs it): the CPU check that the three passes are the
    sequential computation. return_state: (result, the final StateArrays (numpy), the bars pass B
    stepped exactly)."""
    _check_trade_list(max_trades)
    start, end = check_range("window", window, data.n_bars)
    n_bars = end - start
    packed = _window_actions(actions, params, n_bars)
    n_pol = packed.shape[1]
    k = params.step_consts(data.tick_size, backtest=True)
    seg_bars, slots = check_params(segment_bars, event_slots, k)
    chunk = n_bars if chunk_bars is None else min(int(chunk_bars), n_bars)
    cap = n_bars if max_trades is None else int(max_trades)
    st = StateArrays(*(np.zeros(n_pol, dtype) for _, dtype in STATE_FIELDS))
    for p in range(n_pol):
        start_row(st, p, np.int64(start))
    tr = TradeArrays(*(np.zeros((n_pol, max(cap, 1)), dtype) for _, dtype in TRADE_FIELDS))
    mk = MarketArrays(data.features, data.mid, data.bid, data.ask, data.high, data.low, data.volatility(params.vol_span, params.vol_horizon_bars))
    grids = Grids(*params.grids())
    S = segment_count(chunk, seg_bars)
    spec = StateArrays(*(np.zeros(S * n_pol, dtype) for _, dtype in STATE_FIELDS))
    starts = StateArrays(*(np.zeros((S + 1) * n_pol, dtype) for _, dtype in STATE_FIELDS))
    sg = SegmentArrays(
        np.zeros((S, (seg_bars + 31) // 32, n_pol), np.uint32), np.zeros((S, n_pol, slots), np.int32),
        np.zeros((S, n_pol, slots), np.float64), np.zeros((S, n_pol, slots), np.float32),
        np.zeros((S, n_pol), np.int32), np.zeros(1, np.int32), np.zeros(n_pol, np.int64),
    )  # fmt: skip
    pnl = np.zeros((n_bars, n_pol), np.float64)
    pos = np.zeros((n_bars, n_pol), np.float32)
    origin = start
    while origin < end:
        rows = min(chunk, end - origin)
        c_pnl = np.zeros((chunk, n_pol), np.float64)
        c_pos = np.zeros((chunk, n_pol), np.float32)
        c_act = np.zeros((chunk, n_pol), np.int32)
        lo = origin - 1 - start
        src_lo, src_hi = max(lo, 0), min(lo + chunk, n_bars)
        c_act[src_lo - lo : src_hi - lo] = packed[src_lo:src_hi]
        c0, n_dec = chunk_decisions(start, end, origin, chunk)
        if n_dec:
            segments_ref_loop(st, c_act, grids, mk, k, np.int64(end - 1), np.int64(origin), np.int64(c0), np.int64(n_dec),
                              np.int64(seg_bars), spec, sg, starts, c_pnl, c_pos, tr)
        pnl[origin - start : origin - start + rows] = c_pnl[:rows]
        pos[origin - start : origin - start + rows] = c_pos[:rows]
        origin += chunk
    if sg.bad[0]:
        raise RuntimeError("segmented reference: a segment's replayed end differs from the carried start")
    acc = np.empty((_metrics.N_ACC, n_pol), np.float64)
    for p in range(n_pol):
        _metrics.init_row(acc, p, np.float64(params.initial_capital))
    _metrics.scan_ref(acc, pnl, pos, data.session_id, start, n_bars)
    arrays = {name: getattr(tr, name) for name, _ in TRADE_FIELDS}
    result = BacktestResult(
        window=(start, end),
        pnl=np.ascontiguousarray(pnl.T),
        position=np.ascontiguousarray(pos.T),
        trades=trades_frame(arrays, st.trade_count, cap),
        session_id=data.session_id[start:end].copy(),
        bars_per_day=data.bars_per_day,
        initial_capital=params.initial_capital,
        accumulators=acc,
    )
    return (result, st, int(sg.exact.sum())) if return_state else result
