"""The trading environment's math, written once (SPEC §4): fills, exits, reward terms, done, reset.

Every function here is numba ``@njit(cache=True)``. The CPU reference env (reference.py) calls
them from @njit loops; the numba.cuda kernels (device.py, backtest.py) call the same functions
(numba-cuda compiles @jit functions for the device, as numbarl/cuda/rng.py does). The *row*
functions (``*_row``: read/write the state of env ``i`` in structure-of-arrays buffers, compiled
with ``row_jit``) are used by kernels through ``device_function(row)``, which compiles the same Python source as a CUDA device
function (under the simulator it runs as Python on the simulated arrays). So the training env,
the backtest and the reference all execute ONE step function, ``step_core``.

Timing of one step (env at cursor c, the close of bar c; n = c + 1):

 1. ORDER      the decision made at c's close is queued unless an order is already pending
               (then it is ignored); a "hold" (same direction, or flat while flat) queues nothing.
 2. EXECUTION  an order due at c (c + latency_bars when it was queued) fills at c's close quote:
               with latency_bars = 0 the deciding bar's own close quote (zero latency);
               buys at ask + slippage, sells at bid - slippage, plus `fee` per contract per side.
               A new plan sets target/stop levels on the mid: mid_c +/- mult * vol_c.
               Direction lock: the opposite direction closes (no reversal); lock off: reverses.
 3. NEXT BAR   bar n's high/low trigger the stop or target (both in one bar: the stop is assumed
               first, conservatively); the exit fills at the level crossing half the spread of
               bar n's close quote, plus slippage.
 4. FORCED     at the last bar of the range (EXIT_END) or at the hard cap (EXIT_CAP) the position
               is closed at bar n's close quote and pending orders are dropped.
 5. MARK       unrealized = (mid_n - entry price) * position * multiplier; bar P&L = change in
               realized + unrealized (fees are realized when paid).
 6. REWARD     (trade P&L + micro - holding - churn - opportunity + DSR) * conviction, each term
               its own function below.
 7. DONE       position-gated: ep_len >= episode_length and flat with nothing pending; or forced.
               The env then soft-resets to a start drawn from the counter RNG (env_transition).

The env's rules that constrain the agent are published as data, not applied to its scores:
`mask_row` writes the action mask (branch sizes and the direction lock) beside the observation,
and `greedy_action` is the greedy choice over it (the backtest's policy; the learner's
epsilon-greedy in numbarl/rl/policies.py builds on it). There is no exploration here.

Money in rewards is measured in ticks x contracts (net P&L / (tick_size * multiplier)) so the
coefficients transfer across instruments.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from numbarl.cuda import rng
from numbarl.cuda.registry import RNG_STREAMS
from numbarl.cuda.runtime import cuda
from numbarl.env.params import (
    BR_DIRECTION,
    DIR_FLAT,
    DIR_LONG,
    DIR_SHORT,
    EXIT_CAP,
    EXIT_CLOSE,
    EXIT_END,
    EXIT_NONE,
    EXIT_STOP,
    EXIT_TARGET,
    NO_BAR,
)

cuda()  # the backend (GPU or simulator), selected once

# RNG slots (numbarl/cuda/rng.py convention: one draw per (lane, counter, slot)), registered by name;
# exploration's slots 0-7 are claimed by numbarl/rl/policies.py
SLOT_RESET = RNG_STREAMS.claim("env.reset", 16)  # soft-reset start after done
SLOT_INIT = RNG_STREAMS.claim("env.init", 17)  # start of the first episode (reset())

_F0 = np.float64(0.0)
_F1 = np.float64(1.0)
_HALF = np.float64(0.5)
_TWO = np.float64(2.0)
_DSR_MIN_VAR = np.float64(1e-12)
_I0 = np.int64(0)
_NEG_INF32 = np.float32(-np.inf)


# ---------------------------------------------------------------------------------------------
# state, bar and trade records (scalars; the device state is their structure-of-arrays form)
# ---------------------------------------------------------------------------------------------
class Portfolio(NamedTuple):
    """State of one env (scalars). Field order = STATE_FIELDS order."""

    cursor: np.int64  # bar index of the current close (the decision bar)
    ep_len: np.int64  # bars stepped in this episode
    position: np.float64  # signed contracts (+ long, - short, 0 flat)
    entry_price: np.float64  # fill price of the open position
    entry_bar: np.int64  # bar whose close filled the open position
    bars_in_trade: np.int64  # bars the open position has been held
    plan_target: np.float64  # target distance of the active plan in volatility units (0 = none)
    plan_stop: np.float64  # stop distance of the active plan in volatility units (0 = none)
    target_level: np.float64  # target level on the mid (valid when plan_target > 0)
    stop_level: np.float64  # stop level on the mid (valid when plan_stop > 0)
    last_entry_bar: np.int64  # bar of the last entry (NO_BAR: none this episode)
    realized: np.float64  # realized net P&L this episode (currency, fees included)
    unrealized: np.float64  # mark-to-market of the open position at the cursor's mid (currency)
    trade_count: np.int64  # trades closed this episode
    kelly_wins: np.int64  # closed trades with net P&L > 0 (persist across episodes)
    kelly_losses: np.int64  # closed trades with net P&L <= 0
    kelly_sum_win: np.float64  # sum of winning net P&L (currency)
    kelly_sum_loss: np.float64  # sum of |losing net P&L| (currency)
    dsr_a: np.float64  # differential Sharpe EMA of trade P&L in ticks (A)
    dsr_b: np.float64  # differential Sharpe EMA of squared trade P&L in ticks (B)
    pending_due: np.int64  # bar whose close fills the pending order (-1: none)
    pending_dir: np.int64  # pending order: direction code
    pending_size: np.float64  # pending order: size (contracts)
    pending_target: np.float64  # pending order: target distance (volatility units)
    pending_stop: np.float64  # pending order: stop distance (volatility units)


# storage dtype of each Portfolio field on the device and in the CPU reference (same order)
STATE_FIELDS = (
    ("cursor", np.int32),
    ("ep_len", np.int32),
    ("position", np.float32),
    ("entry_price", np.float64),
    ("entry_bar", np.int32),
    ("bars_in_trade", np.int32),
    ("plan_target", np.float32),
    ("plan_stop", np.float32),
    ("target_level", np.float64),
    ("stop_level", np.float64),
    ("last_entry_bar", np.int32),
    ("realized", np.float64),
    ("unrealized", np.float64),
    ("trade_count", np.int32),
    ("kelly_wins", np.int32),
    ("kelly_losses", np.int32),
    ("kelly_sum_win", np.float64),
    ("kelly_sum_loss", np.float64),
    ("dsr_a", np.float64),
    ("dsr_b", np.float64),
    ("pending_due", np.int32),
    ("pending_dir", np.int32),
    ("pending_size", np.float32),
    ("pending_target", np.float32),
    ("pending_stop", np.float32),
)
assert tuple(name for name, _ in STATE_FIELDS) == Portfolio._fields


class StateArrays(NamedTuple):
    """Structure-of-arrays env state: one [N] array per Portfolio field (device or numpy)."""

    cursor: object
    ep_len: object
    position: object
    entry_price: object
    entry_bar: object
    bars_in_trade: object
    plan_target: object
    plan_stop: object
    target_level: object
    stop_level: object
    last_entry_bar: object
    realized: object
    unrealized: object
    trade_count: object
    kelly_wins: object
    kelly_losses: object
    kelly_sum_win: object
    kelly_sum_loss: object
    dsr_a: object
    dsr_b: object
    pending_due: object
    pending_dir: object
    pending_size: object
    pending_target: object
    pending_stop: object


class MarketArrays(NamedTuple):
    """Bar arrays the kernels read (device or numpy): features [T, F], the rest [T]."""

    features: object
    mid: object
    bid: object
    ask: object
    high: object
    low: object
    vol: object


class Grids(NamedTuple):
    """Action grids (float32): sizes [n_size], targets [n_target], stops [n_stop]."""

    sizes: object
    targets: object
    stops: object


class StepArrays(NamedTuple):
    """Per-step outputs of the env step, [N] each (the replay hook reads these)."""

    reward: object  # float32
    done: object  # uint8
    bar_pnl: object  # float64: change of realized + unrealized over the step (currency)
    trade_pnl: object  # float64: net P&L of trades closed in the step
    exit_reason: object  # int32: reason of the last trade closed in the step (EXIT_NONE if none)
    bar: object  # int32: cursor at the decision (obs index)
    next_bar: object  # int32: cursor after the step and any reset (next obs index)


class Bars(NamedTuple):
    """The quotes one step needs: decision bar c and next bar n = c + 1 (float64)."""

    mid_c: np.float64
    bid_c: np.float64
    ask_c: np.float64
    vol_c: np.float64
    mid_n: np.float64
    bid_n: np.float64
    ask_n: np.float64
    high_n: np.float64
    low_n: np.float64


class Trade(NamedTuple):
    """A closed trade (reason EXIT_NONE: no trade)."""

    reason: np.int64
    entry_bar: np.int64
    exit_bar: np.int64
    size: np.float64  # signed: + long, - short
    entry_price: np.float64
    exit_price: np.float64
    pnl: np.float64  # net of fees on both sides (currency)


class StepOut(NamedTuple):
    reward: np.float64
    done: np.int64
    bar_pnl: np.float64
    trade_pnl: np.float64
    exit_reason: np.int64
    position_held: np.float64  # position held over bar c -> n (after the execution at c)


# Row functions and the CPU loops over them only index arrays they are given (they never
# allocate), so they are compiled without numba's reference counting: with it, every call
# increfs/decrefs each of the ~40 arrays in its namedtuple arguments, which made the CPU loops
# ~100x slower (measured: 0.42 s vs 0.002 s for a 4,096 x 72 gather). numba-cuda ignores the
# option when it compiles these functions for the device.
row_jit = njit(cache=True, _nrt=False)


# ---------------------------------------------------------------------------------------------
# constructors (fix the scalar types so every caller compiles one specialization)
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def make_trade(reason, entry_bar, exit_bar, size, entry_price, exit_price, pnl):
    return Trade(
        np.int64(reason),
        np.int64(entry_bar),
        np.int64(exit_bar),
        np.float64(size),
        np.float64(entry_price),
        np.float64(exit_price),
        np.float64(pnl),
    )


@njit(cache=True)
def no_trade():
    return make_trade(EXIT_NONE, 0, 0, 0.0, 0.0, 0.0, 0.0)


@njit(cache=True)
def make_bars(mid_c, bid_c, ask_c, vol_c, mid_n, bid_n, ask_n, high_n, low_n):
    return Bars(
        np.float64(mid_c),
        np.float64(bid_c),
        np.float64(ask_c),
        np.float64(vol_c),
        np.float64(mid_n),
        np.float64(bid_n),
        np.float64(ask_n),
        np.float64(high_n),
        np.float64(low_n),
    )


@njit(cache=True)
def make_portfolio(
    cursor,
    ep_len,
    position,
    entry_price,
    entry_bar,
    bars_in_trade,
    plan_target,
    plan_stop,
    target_level,
    stop_level,
    last_entry_bar,
    realized,
    unrealized,
    trade_count,
    kelly_wins,
    kelly_losses,
    kelly_sum_win,
    kelly_sum_loss,
    dsr_a,
    dsr_b,
    pending_due,
    pending_dir,
    pending_size,
    pending_target,
    pending_stop,
):
    return Portfolio(
        np.int64(cursor),
        np.int64(ep_len),
        np.float64(position),
        np.float64(entry_price),
        np.int64(entry_bar),
        np.int64(bars_in_trade),
        np.float64(plan_target),
        np.float64(plan_stop),
        np.float64(target_level),
        np.float64(stop_level),
        np.int64(last_entry_bar),
        np.float64(realized),
        np.float64(unrealized),
        np.int64(trade_count),
        np.int64(kelly_wins),
        np.int64(kelly_losses),
        np.float64(kelly_sum_win),
        np.float64(kelly_sum_loss),
        np.float64(dsr_a),
        np.float64(dsr_b),
        np.int64(pending_due),
        np.int64(pending_dir),
        np.float64(pending_size),
        np.float64(pending_target),
        np.float64(pending_stop),
    )


@njit(cache=True)
def initial_portfolio(cursor):
    """A fresh env at `cursor`: flat, no history (Kelly and DSR accumulators zero)."""
    return make_portfolio(cursor, 0, 0.0, 0.0, 0, 0, 0.0, 0.0, 0.0, 0.0, NO_BAR, 0.0, 0.0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, -1, DIR_FLAT, 0.0, 0.0, 0.0)


@njit(cache=True)
def soft_reset(s, cursor):
    """New episode at `cursor`: flat, episode counters cleared; the Kelly accumulators and DSR
    EMAs persist (they describe the agent's trading, not the episode)."""
    return make_portfolio(
        cursor, 0, 0.0, 0.0, 0, 0, 0.0, 0.0, 0.0, 0.0, NO_BAR, 0.0, 0.0, 0,
        s.kelly_wins, s.kelly_losses, s.kelly_sum_win, s.kelly_sum_loss, s.dsr_a, s.dsr_b,
        -1, DIR_FLAT, 0.0, 0.0, 0.0,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# execution
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def side_of(position):
    """+1 long, -1 short, 0 flat."""
    if position > _F0:
        return np.int64(1)
    if position < _F0:
        return np.int64(-1)
    return _I0


@njit(cache=True)
def fill_price(side, bid, ask, slippage):
    """Market order at a close quote: a buy (side > 0) pays ask + slippage, a sell gets bid - slippage."""
    if side > 0:
        return ask + slippage
    return bid - slippage


@njit(cache=True)
def level_fill_price(position, level, bid, ask, slippage):
    """Exit of a target/stop triggered at `level` (on the mid): crosses half the spread + slippage."""
    half = _HALF * (ask - bid)
    if position > _F0:
        return level - half - slippage
    return level + half + slippage


@njit(cache=True)
def trade_net_pnl(position, entry_price, exit_price, fee, multiplier):
    """Net P&L of a round trip: price change x signed contracts x multiplier - fee on both sides."""
    return (exit_price - entry_price) * position * multiplier - _TWO * fee * abs(position)


@njit(cache=True)
def changes_position(direction, position):
    """Would this direction change anything? (holding the current direction, or flat while flat, does not)."""
    s = side_of(position)
    if s == 0:
        return direction != DIR_FLAT
    if s > 0:
        return direction != DIR_LONG
    return direction != DIR_SHORT


@njit(cache=True)
def resolve_order(direction, position, direction_lock):
    """(close the open position?, side to open: -1/0/+1) for an order executed now.

    Flat: short/long open that side. In a position: flat closes; the opposite direction closes
    and, without the direction lock, opens the other side (reversal); the same direction holds.
    """
    want = np.int64(direction) - np.int64(1)  # DIR_SHORT -> -1, DIR_FLAT -> 0, DIR_LONG -> +1
    s = side_of(position)
    if s == 0:
        return False, want
    if want == s:
        return False, _I0
    if want == 0 or direction_lock != 0:
        return True, _I0
    return True, want


@njit(cache=True)
def plan_levels(side, mid, vol, target_mult, stop_mult):
    """(target level, stop level) on the mid for a plan opened at `mid` (distances in vol units)."""
    target = mid + side * target_mult * vol
    stop = mid - side * stop_mult * vol
    return target, stop


@njit(cache=True)
def bar_exit(position, plan_target, plan_stop, target_level, stop_level, high, low):
    """(exit reason, level) when bar (high, low) touches the stop or target of the open position.

    Long: stop when low <= stop, target when high >= target; short mirrored. Both touched in one
    bar: we cannot know the order inside the bar, so the stop is assumed first (conservative).
    A bar that opens beyond the stop (a gap between bars, every session open) never traded at the
    stop: a long stop fills no better than the bar's high, a short one no better than its low.
    A target fills at its level (a resting limit; a gap through it is not counted as improvement).
    """
    if position > _F0:
        stop_hit = plan_stop > _F0 and low <= stop_level
        target_hit = plan_target > _F0 and high >= target_level
    elif position < _F0:
        stop_hit = plan_stop > _F0 and high >= stop_level
        target_hit = plan_target > _F0 and low <= target_level
    else:
        return np.int64(EXIT_NONE), _F0
    if stop_hit:
        if position > _F0:
            return np.int64(EXIT_STOP), min(stop_level, high)
        return np.int64(EXIT_STOP), max(stop_level, low)
    if target_hit:
        return np.int64(EXIT_TARGET), target_level
    return np.int64(EXIT_NONE), _F0


# ---------------------------------------------------------------------------------------------
# reward terms (SPEC §4), each on its own
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def trade_reward(net_pnl, k):
    """Trade-level P&L attribution: net realized P&L of trades closed this step, in ticks x contracts."""
    return k.trade_scale * net_pnl / k.tick_value


@njit(cache=True)
def micro_reward(position_held, mid_c, mid_n, k):
    """position x next-bar simple return of the mid x scale (0 for a non-positive price)."""
    if mid_c <= _F0:
        return _F0
    return k.micro_scale * position_held * (mid_n / mid_c - _F1)


@njit(cache=True)
def holding_cost(position_held, k):
    """Inventory cost: rate x |position| for each bar a position is held."""
    return k.hold_rate * abs(position_held)


@njit(cache=True)
def churn_penalty(entered, bars_since_last_entry, k):
    """Graduated penalty for an entry soon after the previous one:
    scale x (1 - bars since last entry / threshold) when that is inside the threshold."""
    if entered == 0 or k.churn_bars <= _F0:
        return _F0
    gap = np.float64(bars_since_last_entry)
    if gap >= k.churn_bars:
        return _F0
    return k.churn_scale * (_F1 - gap / k.churn_bars)


@njit(cache=True)
def opportunity_cost(position_held, preference, k):
    """While flat: scale x |preference|, the agent's own predicted edge of one side over the other
    (the env's per-env `preference` input; for C51 Q(long) - Q(short))."""
    if position_held != _F0:
        return _F0
    return k.opp_scale * abs(np.float64(preference))


@njit(cache=True)
def conviction_factor(plan_size, k):
    """Plan-conviction scaling of the whole reward: 1 + w (size / max size - 1); 1 with no plan."""
    if plan_size <= _F0:
        return _F1
    return _F1 + k.conviction_weight * (plan_size / k.max_size - _F1)


@njit(cache=True)
def dsr_update(a, b, r, eta):
    """Differential Sharpe ratio of return r (Moody & Saffell 2001, eq. 15) and the updated EMAs.

    D = (B dA - A dB / 2) / (B - A^2)^(3/2) with dA = r - A, dB = r^2 - B; then A += eta dA,
    B += eta dB. D = 0 while the EMA variance B - A^2 is not yet positive.
    """
    da = r - a
    db = r * r - b
    var = b - a * a
    d = _F0
    if var > _DSR_MIN_VAR:
        d = (b * da - _HALF * a * db) / (var * math.sqrt(var))
    return d, a + eta * da, b + eta * db


@njit(cache=True)
def episode_done(ep_len, position, pending_due, k):
    """Position-gated end of episode: long enough, flat, nothing pending (no episodes if length 0)."""
    return k.episode_length > 0 and ep_len >= k.episode_length and position == _F0 and pending_due < 0


@njit(cache=True)
def reset_start(seed, lane, counter, slot, lo, hi, episode_length):
    """Episode start drawn uniformly from [lo, max(lo, min(hi - 2, hi - 1 - episode_length))]."""
    top = min(hi - 2, hi - 1 - episode_length)
    if top < lo:
        top = lo
    return np.int64(lo) + rng.randint(seed, lane, counter, slot, top - lo + 1)


# ---------------------------------------------------------------------------------------------
# the step (one execution path for training env, backtest and reference)
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def _book(trade, realized, count, kw, kl, ksw, ksl, da, db, k):
    """Account a closed trade: realized P&L (exit side fee), counts, Kelly sums, DSR EMAs."""
    realized = realized + trade.pnl + k.fee * abs(trade.size)  # the entry fee was realized at entry
    if trade.pnl > _F0:
        kw += 1
        ksw += trade.pnl
    else:
        kl += 1
        ksl -= trade.pnl
    d, da, db = dsr_update(da, db, trade.pnl / k.tick_value, k.dsr_eta)
    return realized, count + 1, kw, kl, ksw, ksl, da, db, d


@njit(cache=True)
def _no_order():
    """(pending_due, pending_dir, pending_size, pending_target, pending_stop) of no pending order."""
    return np.int64(-1), np.int64(DIR_FLAT), _F0, _F0, _F0


@njit(cache=True)
def step_core(s, direction, size, target_mult, stop_mult, bars, preference, k, last_bar):
    """One env step from the close of bar s.cursor to the close of the next bar.

    s: Portfolio; (direction, size, target_mult, stop_mult): the decoded decision; bars: Bars;
    preference: float (opportunity cost); k: StepConsts; last_bar: last bar of the range (forced exit).
    Returns (Portfolio, StepOut, first closed Trade, second closed Trade).
    """
    c = s.cursor
    n = c + 1
    pos = s.position
    equity_before = s.realized + s.unrealized
    realized = s.realized
    entry_price = s.entry_price
    entry_bar = s.entry_bar
    bars_in = s.bars_in_trade
    plan_t = s.plan_target
    plan_s = s.plan_stop
    t_level = s.target_level
    s_level = s.stop_level
    last_entry = s.last_entry_bar
    count = s.trade_count
    kw = s.kelly_wins
    kl = s.kelly_losses
    ksw = s.kelly_sum_win
    ksl = s.kelly_sum_loss
    da = s.dsr_a
    db = s.dsr_b
    p_due = s.pending_due
    p_dir = s.pending_dir
    p_size = s.pending_size
    p_tgt = s.pending_target
    p_stp = s.pending_stop

    # 1. ORDER -------------------------------------------------------------------------------
    if p_due < 0 and changes_position(direction, pos):
        p_due = c + k.latency_bars
        p_dir = np.int64(direction)
        if k.direction_lock != 0 and pos != _F0:
            # under the lock an order against the position only closes it: queued as a close, it
            # cannot open a side if a stop or target ends the position during the fill delay
            p_dir = np.int64(DIR_FLAT)
        p_size = np.float64(size)
        p_tgt = np.float64(target_mult)
        p_stp = np.float64(stop_mult)

    # 2. EXECUTION at bar c's close ----------------------------------------------------------
    t1 = no_trade()
    entered = 0
    since_entry = _I0
    d_sum = _F0
    if p_due >= 0 and p_due <= c:
        close_now, open_side = resolve_order(p_dir, pos, k.direction_lock)
        if close_now and pos != _F0:
            px = fill_price(-side_of(pos), bars.bid_c, bars.ask_c, k.slippage)
            pnl = trade_net_pnl(pos, entry_price, px, k.fee, k.multiplier)
            t1 = make_trade(EXIT_CLOSE, entry_bar, c, pos, entry_price, px, pnl)
            realized, count, kw, kl, ksw, ksl, da, db, d = _book(t1, realized, count, kw, kl, ksw, ksl, da, db, k)
            d_sum += d
            pos = _F0
        if open_side != 0 and pos == _F0:
            entry_price = fill_price(open_side, bars.bid_c, bars.ask_c, k.slippage)
            pos = open_side * p_size
            realized -= k.fee * p_size
            entry_bar = c
            bars_in = _I0
            plan_t = p_tgt
            plan_s = p_stp
            t_level, s_level = plan_levels(open_side, bars.mid_c, bars.vol_c, p_tgt, p_stp)
            since_entry = c - last_entry
            last_entry = c
            entered = 1
        p_due, p_dir, p_size, p_tgt, p_stp = _no_order()
    position_held = pos

    # 3. NEXT BAR: stop / target on bar n's high and low -------------------------------------
    t2 = no_trade()
    if pos != _F0:
        bars_in += 1
        reason, level = bar_exit(pos, plan_t, plan_s, t_level, s_level, bars.high_n, bars.low_n)
        if reason != EXIT_NONE:
            px = level_fill_price(pos, level, bars.bid_n, bars.ask_n, k.slippage)
            pnl = trade_net_pnl(pos, entry_price, px, k.fee, k.multiplier)
            t2 = make_trade(reason, entry_bar, n, pos, entry_price, px, pnl)
            realized, count, kw, kl, ksw, ksl, da, db, d = _book(t2, realized, count, kw, kl, ksw, ksl, da, db, k)
            d_sum += d
            pos = _F0
    ep_len = s.ep_len + 1

    # 4. FORCED EXIT: end of the bar range or episode hard cap -------------------------------
    forced = np.int64(EXIT_NONE)
    if n >= last_bar:
        forced = np.int64(EXIT_END)
    elif k.hard_cap > 0 and ep_len >= k.hard_cap:
        forced = np.int64(EXIT_CAP)
    if forced != EXIT_NONE:
        p_due, p_dir, p_size, p_tgt, p_stp = _no_order()
        if pos != _F0:
            px = fill_price(-side_of(pos), bars.bid_n, bars.ask_n, k.slippage)
            pnl = trade_net_pnl(pos, entry_price, px, k.fee, k.multiplier)
            t2 = make_trade(forced, entry_bar, n, pos, entry_price, px, pnl)
            realized, count, kw, kl, ksw, ksl, da, db, d = _book(t2, realized, count, kw, kl, ksw, ksl, da, db, k)
            d_sum += d
            pos = _F0

    # 5. MARK TO MARKET at bar n's mid -------------------------------------------------------
    unrealized = _F0
    if pos != _F0:
        unrealized = (bars.mid_n - entry_price) * pos * k.multiplier
    else:  # flat: no open trade, no plan
        entry_price = _F0
        entry_bar = _I0
        bars_in = _I0
        plan_t = _F0
        plan_s = _F0
        t_level = _F0
        s_level = _F0
    bar_pnl = realized + unrealized - equity_before

    # 6. REWARD ------------------------------------------------------------------------------
    plan_size = abs(position_held)
    if plan_size == _F0 and t1.reason != EXIT_NONE:
        plan_size = abs(t1.size)
    reward = (
        trade_reward(t1.pnl + t2.pnl, k)
        + micro_reward(position_held, bars.mid_c, bars.mid_n, k)
        - holding_cost(position_held, k)
        - churn_penalty(entered, since_entry, k)
        - opportunity_cost(position_held, preference, k)
        + k.dsr_scale * d_sum
    ) * conviction_factor(plan_size, k)

    # 7. DONE --------------------------------------------------------------------------------
    done = forced != EXIT_NONE or episode_done(ep_len, pos, p_due, k)
    exit_reason = t2.reason if t2.reason != EXIT_NONE else t1.reason

    s_new = make_portfolio(
        n, ep_len, pos, entry_price, entry_bar, bars_in, plan_t, plan_s, t_level, s_level, last_entry,
        realized, unrealized, count, kw, kl, ksw, ksl, da, db, p_due, p_dir, p_size, p_tgt, p_stp,
    )  # fmt: skip
    out = StepOut(
        np.float64(reward),
        np.int64(1 if done else 0),
        np.float64(bar_pnl),
        np.float64(t1.pnl + t2.pnl),
        np.int64(exit_reason),
        np.float64(position_held),
    )
    return s_new, out, t1, t2


@njit(cache=True)
def env_transition(s, direction, size, target_mult, stop_mult, bars, preference, k, lo, hi, seed, lane, counter):
    """Training step: step_core, then a soft reset to an RNG-drawn start when done."""
    s2, out, t1, t2 = step_core(s, direction, size, target_mult, stop_mult, bars, preference, k, hi - 1)
    if out.done != 0:
        start = reset_start(seed, lane, counter, SLOT_RESET, lo, hi, k.episode_length)
        s2 = soft_reset(s2, start)
    return s2, out, t1, t2


# ---------------------------------------------------------------------------------------------
# row functions: env i of structure-of-arrays buffers (CPU loops and kernels)
# ---------------------------------------------------------------------------------------------
@row_jit
def load_row(st, i):
    """Portfolio of env i from StateArrays."""
    return make_portfolio(
        st.cursor[i], st.ep_len[i], st.position[i], st.entry_price[i], st.entry_bar[i],
        st.bars_in_trade[i], st.plan_target[i], st.plan_stop[i], st.target_level[i],
        st.stop_level[i], st.last_entry_bar[i], st.realized[i], st.unrealized[i],
        st.trade_count[i], st.kelly_wins[i], st.kelly_losses[i], st.kelly_sum_win[i],
        st.kelly_sum_loss[i], st.dsr_a[i], st.dsr_b[i], st.pending_due[i], st.pending_dir[i],
        st.pending_size[i], st.pending_target[i], st.pending_stop[i],
    )  # fmt: skip


@row_jit
def store_row(st, i, s):
    st.cursor[i] = s.cursor
    st.ep_len[i] = s.ep_len
    st.position[i] = s.position
    st.entry_price[i] = s.entry_price
    st.entry_bar[i] = s.entry_bar
    st.bars_in_trade[i] = s.bars_in_trade
    st.plan_target[i] = s.plan_target
    st.plan_stop[i] = s.plan_stop
    st.target_level[i] = s.target_level
    st.stop_level[i] = s.stop_level
    st.last_entry_bar[i] = s.last_entry_bar
    st.realized[i] = s.realized
    st.unrealized[i] = s.unrealized
    st.trade_count[i] = s.trade_count
    st.kelly_wins[i] = s.kelly_wins
    st.kelly_losses[i] = s.kelly_losses
    st.kelly_sum_win[i] = s.kelly_sum_win
    st.kelly_sum_loss[i] = s.kelly_sum_loss
    st.dsr_a[i] = s.dsr_a
    st.dsr_b[i] = s.dsr_b
    st.pending_due[i] = s.pending_due
    st.pending_dir[i] = s.pending_dir
    st.pending_size[i] = s.pending_size
    st.pending_target[i] = s.pending_target
    st.pending_stop[i] = s.pending_stop


@row_jit
def load_bars(mk, c):
    """Bars for the step from bar c to c + 1."""
    return make_bars(mk.mid[c], mk.bid[c], mk.ask[c], mk.vol[c], mk.mid[c + 1], mk.bid[c + 1], mk.ask[c + 1], mk.high[c + 1], mk.low[c + 1])


@row_jit
def reset_row(st, i, lo, hi, k, seed, counter):
    """First episode of env i: fresh portfolio at an RNG-drawn start."""
    start = reset_start(seed, i, counter, SLOT_INIT, lo, hi, k.episode_length)
    store_row(st, i, initial_portfolio(start))


@row_jit
def env_step_row(st, i, actions, grids, mk, preference, k, lo, hi, seed, counter, out):
    """Training env step of env i: decode actions[i], step, soft reset on done, write outputs."""
    s = load_row(st, i)
    c = s.cursor
    direction = actions[i, 0]
    size = grids.sizes[actions[i, 1]]
    target_mult = grids.targets[actions[i, 2]]
    stop_mult = grids.stops[actions[i, 3]]
    bars = load_bars(mk, c)
    s2, o, t1, t2 = env_transition(s, direction, size, target_mult, stop_mult, bars, preference[i], k, lo, hi, seed, i, counter)
    store_row(st, i, s2)
    out.reward[i] = o.reward
    out.done[i] = o.done
    out.bar_pnl[i] = o.bar_pnl
    out.trade_pnl[i] = o.trade_pnl
    out.exit_reason[i] = o.exit_reason
    out.bar[i] = c
    out.next_bar[i] = s2.cursor


@njit(cache=True)
def kelly_fraction(wins, losses, sum_win, sum_loss):
    """Kelly fraction p - (1 - p) / b (p win rate, b average win / average loss), clipped to [-1, 1];
    0 until there is at least one win and one loss."""
    if wins <= 0 or losses <= 0 or sum_loss <= _F0:
        return _F0
    p = np.float64(wins) / np.float64(wins + losses)
    b = (sum_win / np.float64(wins)) / (sum_loss / np.float64(losses))
    if b <= _F0:
        return np.float64(-1.0)
    f = p - (_F1 - p) / b
    return max(np.float64(-1.0), min(_F1, f))


@row_jit
def portfolio_feature(st, i, which, mid, vol, k):
    """Portfolio observation `which` (params.PORTFOLIO_FEATURES order) of env i at its cursor."""
    pos = np.float64(st.position[i])
    side = np.float64(side_of(pos))
    if which == 0:
        return pos / k.max_size
    if which == 1:
        if pos == _F0:
            return _F0
        return (mid - st.entry_price[i]) * side / vol
    if which == 2:
        return np.float64(st.bars_in_trade[i]) / k.obs_hold_bars
    if which == 3:
        if pos == _F0 or st.plan_target[i] <= 0:
            return _F0
        return (st.target_level[i] - mid) * side / vol
    if which == 4:
        if pos == _F0 or st.plan_stop[i] <= 0:
            return _F0
        return (mid - st.stop_level[i]) * side / vol
    if which == 5:
        return _F1 if st.pending_due[i] >= 0 else _F0
    if which == 6:
        return kelly_fraction(st.kelly_wins[i], st.kelly_losses[i], st.kelly_sum_win[i], st.kelly_sum_loss[i])
    # which == 7: churn pressure
    if k.churn_bars <= _F0:
        return _F0
    gap = np.float64(np.int64(st.cursor[i]) - np.int64(st.last_entry_bar[i]))
    return max(_F0, _F1 - gap / k.churn_bars)


@row_jit
def gather_row(obs, mask, e, st, mk, k, branch_sizes):
    """obs element e of the flattened [N, state_dim] observation: features[cursor, j] for j < F,
    then the portfolio features; the same thread also writes env i's mask elements j, j +
    state_dim, ... (`mask_row`), so one launch publishes both."""
    state_dim = obs.shape[1]
    i = e // state_dim
    j = e - i * state_dim
    c = st.cursor[i]
    n_feat = mk.features.shape[1]
    if j < n_feat:
        obs[i, j] = mk.features[c, j]
    else:
        obs[i, j] = np.float32(portfolio_feature(st, i, j - n_feat, mk.mid[c], mk.vol[c], k))
    m = j
    while m < mask.shape[1] * mask.shape[2]:
        mask_row(mask, i, m, st.position[i], k.direction_lock, branch_sizes)
        m += state_dim


# ---------------------------------------------------------------------------------------------
# action masks: the env's rules, published as data (numbarl/env/__init__.py has the contract)
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def direction_allowed(direction, position, direction_lock):
    """Direction lock: mid-plan the opposite direction is not an action (hold or close only)."""
    if direction_lock == 0 or position == 0:
        return True
    if position > 0:
        return direction != DIR_SHORT
    return direction != DIR_LONG


@row_jit
def mask_row(mask, i, m, position, direction_lock, branch_sizes):
    """mask[i, b, a] (flattened m = b * max_actions + a) = 1 when action a of branch b is available
    to env i holding `position`: a inside the branch, and for the direction branch allowed by the
    lock. The one place the rule is applied: policies and learners read the mask."""
    n_act = mask.shape[2]
    b = m // n_act
    a = m - b * n_act
    ok = a < branch_sizes[b]
    if ok and b == BR_DIRECTION:
        ok = direction_allowed(a, position, direction_lock)
    mask[i, b, a] = np.uint8(1) if ok else np.uint8(0)


@row_jit
def greedy_action(q, mask, i, b):
    """The first maximum of q[i, b, :] over the actions mask[i, b, :] allows (NaN never wins; if
    every allowed Q is NaN, the first allowed action; -1 when none is allowed). The backtest's
    choice, and the greedy part of numbarl.rl.policies.epsilon_greedy: written once."""
    best = _NEG_INF32
    best_a = -1
    for a in range(mask.shape[2]):
        if mask[i, b, a] == 0:
            continue
        v = q[i, b, a]
        if best_a < 0:
            best_a = a
        if v > best:
            best = v
            best_a = a
    return best_a
