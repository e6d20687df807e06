"""The trading environment's math, written once (SPEC §4): fills, exits, reward terms, done, reset.

Every function here is numba ``@njit(cache=True)``. The CPU reference env (reference.py) calls
them from @njit loops; the numba.cuda kernels (device.py, backtest.py) call the same functions
(numba-cuda compiles @jit functions for the device, as numbarl/cuda/rng.py does) through the row
functions of rows.py. So the training env, the backtest and the reference all execute ONE step
function, ``step_core``. The records it works on (Portfolio, Bars, Trade, ...) are in state.py.

Timing of one step (env at cursor c, the close of bar c; n = c + 1):

 1. ORDER      the decision made at c's close is queued unless an order is already pending
               (then it is ignored); a "hold" (same direction, or flat while flat) queues nothing.
               With the Kelly size cap on (kelly_lambda > 0) an order that may open a side is
               queued at min(size, the env's Kelly cap) (`kelly_size`), loosened by the risk budget ρ.
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
 6. REWARD     (trade P&L + micro [+ net P&L] - holding - churn - opportunity + DSR) * conviction, each term
               its own function below; the terms are also returned in StepOut (r_*, conviction)
               for the training-path telemetry (numbarl/env/telemetry.py).
 7. DONE       position-gated: ep_len >= episode_length and flat with nothing pending; or forced.
               The env then soft-resets to a start drawn from the counter RNG (env_transition).

The env's rules that constrain the agent are published as data (rows.py: `mask_row`,
`greedy_action`), not applied to the agent's scores; there is no exploration here.

The exploration risk budget ρ ∈ [0, 1] (R18; `risk_budget`, an input of every step like the
preference, read from a device array because StepConsts is frozen into the captured graph) scales
the env's protection: ρ = 1 is today's step exactly (bit for bit), ρ = 0 no protection.

    Kelly cap fraction   frac_ρ = 1 − ρ (1 − frac), frac = clip(kelly_lambda f*, kelly_floor, 1)
                         (ρ = 0: max size, no cap; ρ = 1: frac), `kelly_size`
    DSR reward term      r_dsr = ρ · (dsr_scale · D)  (ρ = 0: no DSR term); the EMAs A, B are
                         updated from every closed trade whatever ρ is; D = 0 until they hold
                         dsr_warmup earlier trades (EnvParams.dsr_warmup_trades)

Evaluated as frac + (1 − ρ)(1 − frac) and (dsr_scale · D) · ρ, so ρ = 1 adds an exact 0 and
multiplies by an exact 1: the old arithmetic, also with FMA contraction on the GPU. ρ outside
[0, 1] is clipped. The DQN agent with agent.iqn writes ρ = readiness² (numbarl/rl/cvar_gate.py,
`risk_budget_kernel`); every other caller passes 1 (DeviceEnv's own ones array, CpuEnv's default,
the backtests' constant).

Money in rewards is measured in ticks x contracts (net P&L / (tick_size * multiplier)) so the
coefficients transfer across instruments.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from numbarl.cuda import rng
from numbarl.cuda.registry import RNG_STREAMS
from numbarl.cuda.runtime import cuda
from numbarl.env.params import (
    DIR_FLAT,
    DIR_LONG,
    DIR_SHORT,
    EXIT_CAP,
    EXIT_CLOSE,
    EXIT_END,
    EXIT_NONE,
    EXIT_STOP,
    EXIT_TARGET,
    SIZE_STEP_RTOL,
)
from numbarl.env.state import (  # noqa: F401  (the records the step math works on)
    STATE_FIELDS,
    Bars,
    Grids,
    MarketArrays,
    Portfolio,
    StateArrays,
    StepArrays,
    StepOut,
    Trade,
    initial_portfolio,
    make_bars,
    make_portfolio,
    make_trade,
    no_trade,
    row_jit,
    soft_reset,
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
# the Kelly cap in lots is rounded down after this relative nudge up, so that a cap that is a whole
# number of lots up to rounding (e.g. 4 x 0.5 / 0.001) keeps that lot (params.SIZE_STEP_RTOL);
# a product, not a sum, so no FMA can contract it on the GPU
_LOTS_NUDGE = np.float64(1.0 + SIZE_STEP_RTOL)
_I0 = np.int64(0)
_NEG_INF32 = np.float32(-np.inf)


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
def pnl_reward(bar_pnl, k):
    """Mark-to-market net P&L of the step (realized + unrealized change: fees and the spread paid at fills
    included) in ticks x contracts x scale: over a trade it sums to the trade's net P&L x scale / tick value."""
    if k.pnl_scale == _F0:  # off: 0, also for a non-finite bar P&L (the telemetry's term stays finite)
        return _F0
    return k.pnl_scale * bar_pnl / k.tick_value


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
def kelly_fraction(wins, losses, sum_win, sum_loss):
    """Kelly fraction f* = p - (1 - p) / b (Kelly 1956; Thorp 2006: p win rate, b average
    win / average loss), clipped to [-1, 1]; 0 until there is at least one win and one loss.
    The observation's `kelly_fraction` feature and the size cap read it."""
    if wins <= 0 or losses <= 0 or sum_loss <= _F0:
        return _F0
    p = np.float64(wins) / np.float64(wins + losses)
    b = (sum_win / np.float64(wins)) / (sum_loss / np.float64(losses))
    if b <= _F0:
        return np.float64(-1.0)
    f = p - (_F1 - p) / b
    return max(np.float64(-1.0), min(_F1, f))


@njit(cache=True)
def risk_budget_fraction(frac, risk_budget):
    """The Kelly cap fraction under the exploration risk budget ρ (R18): 1 − ρ (1 − frac), written
    frac + (1 − ρ)(1 − frac) so that ρ = 1 returns frac bit for bit (1 − ρ is an exact 0).
    Hand cases (frac 0.25): ρ = 1 -> 0.25, ρ = 0.25 -> 0.8125, ρ = 0 -> 1 (no cap)."""
    return min(_F1, frac + (_F1 - risk_budget) * (_F1 - frac))


@njit(cache=True)
def dsr_term(d_sum, risk_budget, k):
    """The reward's DSR term: dsr_scale x (D x ρ) (R16 under R18's budget). At ρ = 1 the inner product is D
    exactly and the outer one feeds the reward's sum as the old dsr_scale x D did, so a fused multiply-add on
    the GPU contracts it the same way: the old term bit for bit."""
    return k.dsr_scale * (d_sum * risk_budget)


@njit(cache=True)
def kelly_size(size, wins, losses, sum_win, sum_loss, k, risk_budget):
    """Fractional-Kelly size cap at order time: min(size, cap), cap = max_size x clip(lambda f*,
    floor, 1) rounded DOWN to whole lots (k.size_step) and never below the smallest grid size;
    the fraction loosened by the risk budget ρ to 1 − ρ (1 − clip(...)) (`risk_budget_fraction`).

    f* = kelly_fraction of the env's closed trades (f* <= 0 or no history: the floor). Rounding down
    keeps the cap a cap (the position never exceeds lambda f* x max size by a fraction of a lot);
    the smallest-size bound keeps every entry an entry (a cap can shrink an order, never cancel it).
    The cap goes through float32 like the grid's sizes, so an uncapped grid size compares equal.
    Hand case (sizes (1, 2, 4), step 1, lambda 0.5, floor 0.25): 3 wins of 2, 1 loss of 1 ->
    p = 0.75, b = 2, f* = 0.625, cap = 4 x 0.3125 = 1.25 -> 1 lot: a size-4 order opens 1 contract;
    at ρ = 0.25 the fraction is 1 − 0.25 x 0.6875 = 0.828125, cap 3.3125 -> 3 lots; at ρ = 0: 4.
    """
    f = k.kelly_lambda * kelly_fraction(wins, losses, sum_win, sum_loss)
    frac = risk_budget_fraction(min(_F1, max(k.kelly_floor, f)), risk_budget)
    lots = math.floor(k.max_size * frac / k.size_step * _LOTS_NUDGE)
    cap = max(np.float64(np.float32(np.float64(lots) * k.size_step)), k.min_size)
    return min(np.float64(size), cap)


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
    """Account a closed trade: realized P&L (exit side fee), counts, Kelly sums, DSR EMAs. The trade's
    D is 0 while the EMAs hold fewer than k.dsr_warmup earlier trades (kw + kl: every booked trade is a
    win or a loss, and both persist across episodes as the EMAs do); the EMAs learn from it either way."""
    held = kw + kl
    realized = realized + trade.pnl + k.fee * abs(trade.size)  # the entry fee was realized at entry
    if trade.pnl > _F0:
        kw += 1
        ksw += trade.pnl
    else:
        kl += 1
        ksl -= trade.pnl
    d, da, db = dsr_update(da, db, trade.pnl / k.tick_value, k.dsr_eta)
    if held < k.dsr_warmup:
        d = _F0
    return realized, count + 1, kw, kl, ksw, ksl, da, db, d


@njit(cache=True)
def _no_order():
    """(pending_due, pending_dir, pending_size, pending_target, pending_stop) of no pending order."""
    return np.int64(-1), np.int64(DIR_FLAT), _F0, _F0, _F0


@njit(cache=True)
def step_core(s, direction, size, target_mult, stop_mult, bars, preference, risk_budget, k, last_bar):
    """One env step from the close of bar s.cursor to the close of the next bar.

    s: Portfolio; (direction, size, target_mult, stop_mult): the decoded decision; bars: Bars;
    preference: float (opportunity cost); risk_budget: ρ (the Kelly cap and the DSR term, module
    docstring; 1: unchanged); k: StepConsts; last_bar: last bar of the range (forced exit).
    Returns (Portfolio, StepOut, first closed Trade, second closed Trade).
    """
    c = s.cursor
    n = c + 1
    rho = np.float64(risk_budget)  # R18's ρ, clipped to [0, 1]; NaN (a broken readiness) is full protection, 1
    rho = _F1 if np.isnan(rho) else min(_F1, max(_F0, rho))
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
    kelly_ratio = _F0  # capped / asked size of an opening order queued with the Kelly cap on (telemetry)
    if p_due < 0 and changes_position(direction, pos):
        p_due = c + k.latency_bars
        p_dir = np.int64(direction)
        if k.direction_lock != 0 and pos != _F0:
            # under the lock an order against the position only closes it: queued as a close, it
            # cannot open a side if a stop or target ends the position during the fill delay
            p_dir = np.int64(DIR_FLAT)
        p_size = np.float64(size)
        if k.kelly_lambda > _F0 and p_dir != DIR_FLAT:  # an order that may open a side: Kelly cap
            p_size = kelly_size(p_size, kw, kl, ksw, ksl, k, rho)
            kelly_ratio = p_size / np.float64(size)
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
    # each term once, then the sum in the same order as always (the telemetry reads the terms)
    r_trade = trade_reward(t1.pnl + t2.pnl, k)
    r_micro = micro_reward(position_held, bars.mid_c, bars.mid_n, k)
    r_holding = holding_cost(position_held, k)
    r_churn = churn_penalty(entered, since_entry, k)
    r_opportunity = opportunity_cost(position_held, preference, k)
    r_dsr = dsr_term(d_sum, rho, k)
    r_pnl = pnl_reward(bar_pnl, k)
    conviction = conviction_factor(plan_size, k)
    gross = r_trade + r_micro
    if k.pnl_scale != _F0:  # off: the sum, and its bits, as without the term
        gross = gross + r_pnl
    reward = (gross - r_holding - r_churn - r_opportunity + r_dsr) * conviction

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
        np.float64(r_trade),
        np.float64(r_micro),
        np.float64(r_holding),
        np.float64(r_churn),
        np.float64(r_opportunity),
        np.float64(r_dsr),
        np.float64(conviction),
        np.float64(kelly_ratio),
        np.float64(r_pnl),
    )
    return s_new, out, t1, t2


@njit(cache=True)
def env_transition(s, direction, size, target_mult, stop_mult, bars, preference, risk_budget, k, lo, hi, seed, lane,
                   counter):
    """Training step: step_core, then a soft reset to an RNG-drawn start when done."""
    s2, out, t1, t2 = step_core(s, direction, size, target_mult, stop_mult, bars, preference, risk_budget, k, hi - 1)
    if out.done != 0:
        start = reset_start(seed, lane, counter, SLOT_RESET, lo, hi, k.episode_length)
        s2 = soft_reset(s2, start)
    return s2, out, t1, t2


