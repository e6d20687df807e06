"""The env's state, bar and trade records and their constructors (scalars; the device state is
their structure-of-arrays form), shared by the step math (core.py), the row functions (rows.py),
the CPU reference env and the kernels.

``row_jit`` compiles the row functions: they only index arrays they are given (they never
allocate), so they are compiled without numba's reference counting (see below).
"""


from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from numbarl.cuda.runtime import cuda
from numbarl.env.params import (
    DIR_FLAT,
    EXIT_NONE,
    NO_BAR,
)

cuda()  # the backend (GPU or simulator), selected once

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
    # the reward's terms exactly as step_core adds them (reward = (r_trade + r_micro [+ r_pnl] - r_holding
    # - r_churn - r_opportunity + r_dsr) * conviction): exposed for the training-path telemetry
    # (numbarl/env/telemetry.py); costs are positive here and subtracted by the reward
    r_trade: np.float64  # trade-level P&L attribution of the trades closed in the step
    r_micro: np.float64  # position x next-bar return x scale
    r_holding: np.float64  # holding cost (subtracted)
    r_churn: np.float64  # churn penalty (subtracted)
    r_opportunity: np.float64  # opportunity cost while flat (subtracted)
    r_dsr: np.float64  # dsr_scale x differential Sharpe of the trades closed in the step x risk budget ρ
    conviction: np.float64  # plan-conviction factor multiplying the whole reward
    # Kelly size cap (EnvParams.kelly_lambda > 0): capped / asked size of the opening order queued
    # this step (1: the cap did not bind); 0 when no such order was queued or the cap is off
    kelly_ratio: np.float64
    r_pnl: np.float64  # pnl_scale x the step's net P&L per tick-contract (added to the reward only when pnl_scale != 0)


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


