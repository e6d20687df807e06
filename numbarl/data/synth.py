"""Synthetic MBP-10 market with a planted, configurable order-flow signal (SPEC §3.5).

The generator is an event-driven 10-level limit order book in integer ticks (numba ``@njit``):
each event is a limit order add, a cancel or a market order (trade) that consumes the best
queue; when a best queue empties the price moves one tick and a new level appears at the back;
when the spread is wider than one tick, orders improve it. Sessions follow the exchange calendar
(default CME Globex: 17:00-16:00 America/Chicago, Monday-Friday) with more activity during
regular trading hours. Output records are the MBP-10 record arrays the DBN reader returns
(records.py), so they go through the same bars, features and cache code: a trade is a ``T``
record (no F_LAST, levels unchanged) followed by the ``C`` book update with F_LAST.

The planted signal. A latent order-flow pressure x follows an AR(1) process in event time,
x <- φ·x + sqrt(1 - φ²)·ε with φ = exp(-1/τ) (τ = ``pressure_events``, many bars long), and sets

    δ = signal / 2 · tanh(x)
    P(trade is a buy) = 1/2 + δ
    P(add is on the bid) = P(cancel is on the ask) = 1/2 + κ·δ       (κ = ``passive_coupling``)

Buy pressure empties ask queues faster than bid queues, so the mid drifts up while the pressure
lasts; because x is persistent, the order-flow imbalance (OFI, trade imbalance) a bar shows
predicts the next bar's mid move: OFI leads the mid. ``null=True`` sets δ = 0: symmetric flow,
no exploitable signal.

Oracle. For every record the generator returns δ of that event, the planted drift known at that
moment (never later information): its sign is the sign of the expected mid move over the next
bar and its size the strength. Per bar the cache stores ``oracle = δ`` at the bar's closing
record, so ``position_t = sign(oracle_t)`` is a causal oracle policy whose Sharpe measures how
much a learner could get.

Memory mode (``mode="memory"``, ``data.synth_mode=memory``): an edge that only history reveals.
A hidden regime r ∈ {+1, -1} flips with probability 1/(``regime_bars`` · W) per event (a
two-state Markov chain in event time, mean duration ``regime_bars`` bars; W = events per session
/ bars per day, about one bar of events). Trades are fair coins: the visible order flow carries
no drift of its own. The market responds to it one bar later with the regime's sign:

    F  = EWMA of the signed trade volume (time constant W/8 events), z = F / its sd
    b(e) = signal / 2 · tanh(z)                                  (the flow before event e)
    P(add is on the bid) = P(cancel is on the ask) = 1/2 + κ_m · r · b(e - W)   (κ_m = 5)

so in regime +1 the mid continues the last bar's trade imbalance and in regime -1 it reverses
it. One bar shows the flow (``trade_imb``, ``trade_imb_4``...) but not r: averaged over regimes
the flow → next-move relation is zero, and since the flow is memoryless the drift is too (no
momentum for ``ret_k`` to pick up). An agent that remembers the last bars' flow and the moves
that followed can infer r. Why not a latent pressure x whose drift r·δ(x) moves prices while the
flow shows δ(x): a persistent drift makes returns autocorrelated whatever r is, an edge
``ret_k`` gives a memoryless agent; the drift must respond to the *previous* bar's flow.

Oracle (memory mode): r · mean(b(e - W + 1 .. e)) at each record, the drift expected over the
next W events (b from flow already seen, r the regime now): known at that moment. Per bar,
``oracle`` at the closing record as above; ``null=True`` sets signal 0 (no drift, oracle 0).

Memory-walk mode (``mode="memory_walk"``, ``data.synth_mode=memory_walk``): the memory mode's regime
and flow response on the walk mode's book (below). The book's sides are fair coins and its queues
do not move the price; the drift is in the walk's coin only, P(step up) = 1/2 + κ_w · r · b(e - W)
(κ_w = ``MEMORY_WALK_COUPLING``, a step with probability ``MEMORY_WALK_MOVE_P`` per event). Why: in the
memory mode the response goes through the passive side of the book, so queue imbalance shows the
drift's direction in the current bar, and the book's own queue mechanics lead the mid in its null
twin too (a memoryless learner earns 0.65 of that market's oracle). Here nothing in one bar's book
leads the mid; its null twin (``null=True``) is a walk market with fair steps. Same oracle formula.

Walk mode (``mode="walk"``, ``data.synth_mode=walk``): a null market in which nothing observable
leads the mid. The same book, flow and calendar, no drift (signal 0, oracle 0), but the price no
longer follows the queues: a best queue that trades or cancels away is refilled at its price, and
before each event, with probability ``WALK_MOVE_P``, the book steps one tick up or down on a fair
coin (the best ask goes and a bid level appears at its price, or the mirror). The mid is a random
walk of whole ticks (about 0.9 tick per bar at the default sizes, as the planted market's null);
the spread stays one tick. Why: in the event-driven book of ``null=True`` the mid moves when a
queue empties, so the queue imbalance leads the next move (correlation 0.29 with the next bar's
mid change) and a half-tick mid bounce makes bar returns mean-revert (variance ratio 0.7-0.8 for
8-128 bars): a book's own structure, not a planted edge, and a learner can trade it (PPO did,
docs/RESULTS.md). The walk mode is the null without it.

Measured (``python -m numbarl.data.synth_probe``: 10 sessions of 30,000 events, 200 bars/day,
seeds 1/2/3, fitted on the first half of the bars and scored on the second; synth_probe.py says
what each number is):

    market        best single-bar    single-bar products   memory predictor    oracle Sharpe
                  linear → oracle    → oracle              → oracle / → next   per bar, costs
    planted       0.92 0.80 0.82     0.85 0.79 0.77        0.67 0.65 0.57      0.47 0.48 0.45
    memory        0.03 -0.04 0.02    0.25 0.16 0.23        0.39 0.28 0.43      0.15 0.17 0.17
                                                           0.28 0.26 0.24 (→ next move)
    memory_walk   0.01 0.07 -0.00    0.19 0.19 0.12        0.36 0.46 0.35      0.45 0.43 0.42
                                                           0.24 0.25 0.20 (→ next move)

(``--modes memory_walk,memory_walk-null,walk``; the memory_walk null and the walk market score 0 on
the oracle columns and |0.09| or less against the next move.) At the training scale (20 sessions of
120,000 events, 1,000 bars per day, seed 7): products 0.28, memory predictor 0.34 (K = 8) and 0.39
(K = 16), oracle 0.39 per bar.

The best single-bar linear predictor of the next mid move scores 0.20/0.20/0.23 in memory mode
and 0.25/0.20/0.22 on the memory null: queue imbalance leads the mid by a fraction of a tick in
any book, so that number is the book's, not the planted edge (read on the oracle instead).
Products of one bar's windowed features (``ret_16`` × ``trade_imb_16``...) estimate r from the
few bars they span: a memoryless network can get a part of the edge, a memory agent more.

Regime-walk mode (``mode="regime_walk"``, ``data.synth_mode=regime_walk``; its regimes
last ``REGIME_WALK_REGIME_BARS`` = 200 bars on average unless ``data.synth_regime_bars`` sets it): a market where memory pays most of the oracle. The walk mode's book
(fair sides, fair-coin trades, queues that never move the price; a walk step with probability
``REGIME_WALK_MOVE_P`` = 0.1 per event, about 4.5 ticks of sd per bar) and the memory modes' hidden
regime r ∈ {+1, -1} (flip probability 1/(``regime_bars`` · W) per event). The market reacts to the
imbalance bars themselves: the signed trade volume θ since the last flow bar closes a flow bar once
|θ| >= H, H the threshold that cuts the previous session's signed volumes into ``bars_per_day`` bars
(``bars.calibrate_threshold``: the bar builder's ``target`` rule, so the flow bars *are* the cache's
bars), and until the next one closes

    s = the side of the last flow bar (±1; 0 before the session's first)
    P(step up) = 1/2 + κ_r · r · signal/2 · s                   (κ_r = ``REGIME_WALK_COUPLING`` = 1)

so in regime +1 the mid follows the last bar's trade imbalance by 0.2 tick per step (about 2.4
ticks over a bar) and in regime -1 it reverses it. Oracle: r · signal/2 · s at each record (the
walk's drift until the next bar closes, known at that record; it changes at the closing record of
a bar). ``null=True``: fair steps, oracle 0.

Why. In memory_walk the drift follows the flow W events back, which does not align with the
imbalance bars: with the regime known (frozen), the best single-bar linear predictor reaches only
0.70 of the oracle's Sharpe there (0.28 vs 0.40 per bar, training scale, seed 7) and the per-bar evidence
about r is weak, so a memory rule earns 0.3 of the oracle. Here the drift over bar t+1 is exactly
r · s_t with s_t the sign of bar t's ``trade_imb`` (frozen regime: 0.97 of the oracle for the linear
predictor, 0.425 vs 0.440), each bar's Δmid · s_{t-1} is a strong sample of r, and regimes long
next to the K = 16 bars a memory needs make the lag after a flip cheap. Nothing single-bar leads:
the sides of consecutive imbalance bars of a fair-coin flow are independent (P(same side) 0.501),
so the drift has no autocorrelation (lag-1 autocorrelation of bar returns 0.001: no momentum for
``ret_k``, whatever r) and one bar shows s_t but not r. Windowed features (``ret_16`` ×
``trade_imb_16``) span the 15 bar pairs that carry r, but mixed with the ~240 cross pairs that
carry noise: fitted single-bar products earn at most 0.3 of the memory rule.

Measured (``python -m numbarl.data.synth_probe --modes regime_walk,regime_walk-null,walk --sessions
20 --events 120000 --bars-per-day 1000 --seeds 7,8,9 --regime-bars 200``: the training scale;
after-cost Sharpe per bar of each predictor's sign on the second half of the bars, fits on the
first; the rule is synth_probe's ``regime_rule``, K = 16: sign(``trade_imb_t``) · sign(Σ_{j=1..15}
sign(``trade_imb_{t-j}``) · Δmid_{t-j+1}); the products are fitted to the oracle with the pairs
also times the bar's side, the strongest single-bar fit found):

    market             oracle   memory rule (/oracle)    linear   products   products·side
    regime_walk  s7    0.443    0.390 (0.88)             -0.073   0.017      0.111
                 s8    0.462    0.421 (0.91)             -0.098   0.032      0.086
                 s9    0.439    0.384 (0.87)             -0.078   0.025      0.110
    null         s7-9  0        -0.14 -0.15 -0.15        single-bar fits to the next move: -0.10 to -0.13

(the null's and the walk's numbers are the costs: the rule correlates 0.012 / 0.006 / 0.011 with the
next move in the null, 0.43-0.45 in the market.) The memory rule with K = 8: 0.364 (0.82); the
probe's ``memory_predictor`` (f = ``trade_imb_4``) only 0.05: the drift follows one bar's side, not
four. Shorter regimes cost the rule the lag after each flip (seed 7, K = 16): ``regime_bars`` 40
→ 0.64 of the oracle, 100 → 0.80, 200 → 0.88; hence the mode's 200 (the memory modes'
own is 40). At 10 sessions × 30,000 events, 200 bars per day,
seeds 1-3: oracle 0.51 / 0.54 / 0.47, rule 0.84 / 0.91 / 0.85 of it, products·side -0.01 / 0.07 / 0.05.
"""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path

import numpy as np
from numba import njit

from numbarl.data.calendar import SessionCalendar
from numbarl.data.errors import DataError
from numbarl.data.records import (
    ACTION_ADD,
    ACTION_CANCEL,
    ACTION_TRADE,
    F_LAST,
    MBP10_DTYPE,
    N_LEVELS,
    RECORD_BYTES,
    RTYPE_MBP10,
    SIDE_ASK,
    SIDE_BID,
)

SYMBOL = "SYNTH"
INSTRUMENT_ID = 1
PUBLISHER_ID = 1
TICK_SIZE = 0.25
TICK_FIXED = 250_000_000  # TICK_SIZE in 1e-9 fixed point
START_PRICE_TICKS = 16_000  # 4000.00
FIRST_TRADE_DATE = dt.date(2024, 1, 2)

DEFAULT_SIGNAL = 0.2
DEFAULT_SESSIONS = 20
DEFAULT_EVENTS = 120_000  # events per session: ~150k records, ~30k trades
DEFAULT_BARS_PER_DAY = 1000

# event mix and book shape (tuned so the best queues empty every few trades and the spread
# is one tick most of the time, like a liquid future)
P_TRADE = 0.25
P_ADD = 0.42
P_IMPROVE = 0.8  # chance an event improves a spread wider than one tick
ADD_LEVEL_WEIGHTS = np.array([0.26, 0.18, 0.13, 0.1, 0.08, 0.07, 0.06, 0.05, 0.04, 0.03])
ADD_SIZE_MAX = 4
TRADE_SIZE_P = 0.55  # trade size 1 + Geometric(p)
NEW_LEVEL_MIN = 4
NEW_LEVEL_MAX = 24
LATENCY_NS = 20_000  # ts_recv - ts_event
PRESSURE_EVENTS = 6000.0
PASSIVE_COUPLING = 0.5
MODES = ("planted", "memory", "walk", "memory_walk", "regime_walk")
WALK_MOVE_P = 0.008  # walk mode: chance per event that the book steps one tick (fair coin): ~0.9 tick per bar
DEFAULT_REGIME_BARS = 40.0  # memory mode: mean regime duration in bars
MEMORY_FLOW_FRACTION = 0.125  # memory mode: time constant of the flow EWMA / W (short: little momentum)
MEMORY_WALK_COUPLING = 5.0  # memory_walk: P(the walk steps up) = 1/2 + coupling · r · b (saturates above signal 0.2)
MEMORY_WALK_MOVE_P = 0.1  # memory_walk: chance per event of a walk step (sd ~4.6 ticks per bar at the default sizes)
REGIME_WALK_COUPLING = 1.0  # regime_walk: P(the walk steps up) = 1/2 + coupling · r · signal/2 · s (s = ±1: the last bar's side)
REGIME_WALK_MOVE_P = 0.1  # regime_walk: chance per event of a walk step
REGIME_WALK_REGIME_BARS = 200.0  # regime_walk: mean regime duration in bars (at 40 the rule reaches 0.64 of the oracle)
MEMORY_COUPLING = 5.0  # memory mode: P(add on bid) = P(cancel on ask) = 1/2 + coupling · r · b (saturates above signal 0.2)
WARMUP_SESSIONS = 1  # generated before the first cached session: the target bar mode calibrates on it

# tiny dataset for tests and the simulator preset: seconds to build
TINY = {"sessions": 4, "events_per_session": 12_000, "bars_per_day": 100}

# activity profile of a CME Globex session (hours after the 17:00 open, relative intensity)
PROFILE_HOURS = np.array([15.5, 6.75, 0.75])  # overnight, regular hours 08:30-15:15, close
PROFILE_RATE = np.array([1.0, 6.0, 2.0])


# ---------------------------------------------------------------------------------------------
# event generator
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def _write(out, k, ts, action, side, price, size, flags, depth, seq, bb, ba, bq, aq, bc, ac, tick):
    r = out[k]
    r.length = RECORD_BYTES // 4
    r.rtype = RTYPE_MBP10
    r.publisher_id = PUBLISHER_ID
    r.instrument_id = INSTRUMENT_ID
    r.ts_event = ts
    r.ts_recv = ts + LATENCY_NS
    r.ts_in_delta = 9_000
    r.sequence = seq
    r.price = price
    r.size = size
    r.action = action
    r.side = side
    r.flags = flags
    r.depth = depth
    for m in range(N_LEVELS):
        lv = r.levels[m]
        lv.bid_px = (bb - m) * tick
        lv.ask_px = (ba + m) * tick
        lv.bid_sz = bq[m]
        lv.ask_sz = aq[m]
        lv.bid_ct = bc[m]
        lv.ask_ct = ac[m]


@njit(cache=True)
def _orders(size):
    return max(1, (size + 2) // 3)


@njit(cache=True)
def _shift_out(q, c):
    """Best level emptied: levels move up one, a new level appears at the back."""
    for m in range(N_LEVELS - 1):
        q[m] = q[m + 1]
        c[m] = c[m + 1]
    q[N_LEVELS - 1] = np.random.randint(NEW_LEVEL_MIN, NEW_LEVEL_MAX + 1)
    c[N_LEVELS - 1] = _orders(q[N_LEVELS - 1])


@njit(cache=True)
def _shift_in(q, c, size):
    """An order improves the best price: levels move down one, the last falls out of the top 10."""
    for m in range(N_LEVELS - 1, 0, -1):
        q[m] = q[m - 1]
        c[m] = c[m - 1]
    q[0] = size
    c[0] = 1


@njit(cache=True)
def _simulate_session(seed, n_events, times, start_tick, x0, signal, coupling, tau, weights, out, oracle,
                      memory, switch_p, flow_tau, lagbuf, mstate, walk_p, bar_h=0.0):
    """One session of events. Returns (records written, best bid tick at the end, x at the end).

    times: int64 [n_events] event timestamps (ts_event); out: MBP10 records with room for
    2 * n_events; oracle: float64 [2 * n_events] (the oracle per record).

    ``memory`` (the memory mode, module docstring): trades are fair coins; ``lagbuf`` (float64
    [W]) holds the flow response b of the last W events and ``mstate`` (float64 [4]: regime ±1,
    ring position, flow EWMA F, the last event's signed trade volume) the state carried across
    sessions, both updated in place; the regime flips with probability ``switch_p`` per event.
    Off, no extra random numbers are drawn and x drives everything: the planted market.

    ``walk_p`` > 0 (the walk mode, module docstring): before each event, with probability walk_p,
    the book steps one tick up or down (a fair coin: the best ask queue goes and a new bid level
    appears at its price, or the mirror), and a best queue that trades or cancels away is refilled
    at its price instead of moving it; 0: no extra random numbers (the other markets unchanged).

    ``bar_h`` > 0 (the regime_walk mode, module docstring; with walk_p > 0 and memory off): the
    signed trade volume θ since the session's open or the last flow bar closes a flow bar once
    |θ| >= bar_h (the imbalance-bar rule of bars.py, reset at the session's open); the walk's coin
    is P(up) = 1/2 + coupling · r · signal/2 · s, s the side of the last flow bar (0 before the
    session's first), r the regime (``mstate[0]``, flipping with probability ``switch_p`` per event).
    0: none of this, no extra random numbers (the other markets unchanged).
    """
    np.random.seed(seed)
    phi = math.exp(-1.0 / tau)
    shock = math.sqrt(1.0 - phi * phi)
    lag = lagbuf.shape[0]
    lag_sum = 0.0
    for j in range(lag):
        lag_sum += lagbuf[j]
    r = mstate[0]
    pos = int(mstate[1])
    flow = mstate[2]
    last_v = mstate[3]
    flow_decay = math.exp(-1.0 / flow_tau)
    # sd of the flow EWMA under fair-coin trades: P(trade) · E[size²] / (1 - decay²)
    flow_sd = math.sqrt(P_TRADE * (2.0 - TRADE_SIZE_P) / (TRADE_SIZE_P * TRADE_SIZE_P) / (1.0 - flow_decay * flow_decay))
    bq = np.zeros(N_LEVELS, np.int64)
    aq = np.zeros(N_LEVELS, np.int64)
    bc = np.zeros(N_LEVELS, np.int64)
    ac = np.zeros(N_LEVELS, np.int64)
    for m in range(N_LEVELS):
        bq[m] = np.random.randint(NEW_LEVEL_MIN, NEW_LEVEL_MAX + 1)
        aq[m] = np.random.randint(NEW_LEVEL_MIN, NEW_LEVEL_MAX + 1)
        bc[m] = _orders(bq[m])
        ac[m] = _orders(aq[m])
    bb = start_tick
    ba = start_tick + 1
    tick = TICK_FIXED
    cum = np.cumsum(weights)
    x = x0
    k = 0
    seq = 1
    walk = walk_p > 0.0
    regime = bar_h > 0.0  # regime_walk
    theta = 0.0  # regime_walk: signed trade volume since the last flow bar (or the session's open)
    side_last = 0.0  # regime_walk: side (±1) of the last flow bar, 0 before the first
    step_up = 0.5  # the walk's coin; memory_walk: 1/2 + coupling · r · b(e - W)
    signal_now = 0.0
    old = 0.0
    for e in range(n_events):
        x = phi * x + shock * np.random.standard_normal()
        delta = 0.5 * signal * math.tanh(x)
        ts = times[e]
        if memory:
            # b(e): the response to the signed trade flow before this event; the drift follows
            # r·b(e - W) (W events ago): through the passive side of the book (memory) or the walk's
            # coin (memory_walk, whose book sides stay fair coins); the oracle is the drift expected
            # over the next W events, r·mean(b(e - W + 1 .. e)): all known now. Drawn before the
            # walk's step, so that every event (steps too) advances the regime and the lag ring.
            flow = flow_decay * flow + last_v
            last_v = 0.0
            if np.random.random() < switch_p:
                r = -r
            b_now = 0.5 * signal * math.tanh(flow / flow_sd)
            old = lagbuf[pos]
            lagbuf[pos] = b_now
            pos = (pos + 1) % lag
            lag_sum += b_now - old
            signal_now = r * lag_sum / lag
            if walk:
                step_up = 0.5 + coupling * r * old
        elif regime:
            # the drift until the next flow bar closes follows the last flow bar's side with the
            # regime's sign; the oracle is that tilt: known now. Drawn before the walk's step, so
            # that every event (steps too) advances the regime.
            if np.random.random() < switch_p:
                r = -r
            signal_now = r * 0.5 * signal * side_last
            step_up = 0.5 + coupling * signal_now
        if walk and np.random.random() < walk_p:
            # STEP: the mid moves by one tick, whatever the book shows (a fair coin but in memory_walk)
            size = np.random.randint(NEW_LEVEL_MIN, NEW_LEVEL_MAX + 1)
            if np.random.random() < step_up:
                ba += 1
                _shift_out(aq, ac)
                bb += 1
                _shift_in(bq, bc, size)
                side, price = SIDE_BID, bb * tick
            else:
                bb -= 1
                _shift_out(bq, bc)
                ba -= 1
                _shift_in(aq, ac, size)
                side, price = SIDE_ASK, ba * tick
            _write(out, k, ts, ACTION_ADD, side, price, size, F_LAST, 0, seq, bb, ba, bq, aq, bc, ac, tick)
            oracle[k] = signal_now if (memory or regime) else 0.0
            k += 1
            seq += 1
            continue
        if memory:
            passive_bid = 0.5 if walk else 0.5 + coupling * r * old
            buy_p = 0.5
        elif regime:  # the book's sides and the trades are fair coins
            passive_bid = 0.5
            buy_p = 0.5
        else:
            passive_bid = 0.5 + coupling * delta  # P(add on bid) = P(cancel on ask)
            buy_p = 0.5 + delta
            signal_now = delta
        u = np.random.random()
        if ba - bb > 1 and u < P_IMPROVE:
            # IMPROVE THE SPREAD
            size = np.random.randint(1, ADD_SIZE_MAX + 1)
            if np.random.random() < passive_bid:
                bb += 1
                _shift_in(bq, bc, size)
                side, price = SIDE_BID, bb * tick
            else:
                ba -= 1
                _shift_in(aq, ac, size)
                side, price = SIDE_ASK, ba * tick
            _write(out, k, ts, ACTION_ADD, side, price, size, F_LAST, 0, seq, bb, ba, bq, aq, bc, ac, tick)
            oracle[k] = signal_now
            k += 1
        elif u < P_TRADE:
            # TRADE: a market order takes (part of) the best opposite queue
            size = 1
            while np.random.random() > TRADE_SIZE_P:
                size += 1
            if np.random.random() < buy_p:
                size = min(size, aq[0])
                last_v = size
                price = ba * tick
                _write(out, k, ts, ACTION_TRADE, SIDE_BID, price, size, 0, 0, seq, bb, ba, bq, aq, bc, ac, tick)
                oracle[k] = signal_now
                k += 1
                aq[0] -= size
                if aq[0] == 0 and walk:  # walk mode: the price does not follow the queues
                    aq[0] = np.random.randint(NEW_LEVEL_MIN, NEW_LEVEL_MAX + 1)
                    ac[0] = _orders(aq[0])
                elif aq[0] == 0:
                    ba += 1
                    _shift_out(aq, ac)
                else:
                    ac[0] = min(ac[0], _orders(aq[0]))
                rest_side = SIDE_ASK
            else:
                size = min(size, bq[0])
                last_v = -size
                price = bb * tick
                _write(out, k, ts, ACTION_TRADE, SIDE_ASK, price, size, 0, 0, seq, bb, ba, bq, aq, bc, ac, tick)
                oracle[k] = signal_now
                k += 1
                bq[0] -= size
                if bq[0] == 0 and walk:
                    bq[0] = np.random.randint(NEW_LEVEL_MIN, NEW_LEVEL_MAX + 1)
                    bc[0] = _orders(bq[0])
                elif bq[0] == 0:
                    bb -= 1
                    _shift_out(bq, bc)
                else:
                    bc[0] = min(bc[0], _orders(bq[0]))
                rest_side = SIDE_BID
            if regime:
                theta += last_v
                if abs(theta) >= bar_h:  # a flow bar closes: the drift changes from the next event on
                    side_last = 1.0 if theta > 0.0 else -1.0
                    theta = 0.0
                    signal_now = r * 0.5 * signal * side_last  # at this closing record: the new drift
            _write(out, k, ts, ACTION_CANCEL, rest_side, price, size, F_LAST, 0, seq, bb, ba, bq, aq, bc, ac, tick)
            oracle[k] = signal_now
            k += 1
        elif u < P_TRADE + P_ADD:
            # ADD a limit order at one of the ten levels
            level = 0
            v = np.random.random() * cum[N_LEVELS - 1]
            while level < N_LEVELS - 1 and v > cum[level]:
                level += 1
            size = np.random.randint(1, ADD_SIZE_MAX + 1)
            if np.random.random() < passive_bid:
                bq[level] += size
                bc[level] += 1
                side, price = SIDE_BID, (bb - level) * tick
            else:
                aq[level] += size
                ac[level] += 1
                side, price = SIDE_ASK, (ba + level) * tick
            _write(out, k, ts, ACTION_ADD, side, price, size, F_LAST, level, seq, bb, ba, bq, aq, bc, ac, tick)
            oracle[k] = signal_now
            k += 1
        else:
            # CANCEL: a level chosen in proportion to its size loses part of its queue
            on_ask = np.random.random() < passive_bid
            q = aq if on_ask else bq
            c = ac if on_ask else bc
            total = 0
            for m in range(N_LEVELS):
                total += q[m]
            v = np.random.randint(0, total)
            level = 0
            while v >= q[level]:
                v -= q[level]
                level += 1
            size = np.random.randint(1, min(q[level], ADD_SIZE_MAX) + 1)
            if level > 0 and size >= q[level]:
                size = q[level] - 1
            if size == 0:
                continue
            price = (ba + level) * tick if on_ask else (bb - level) * tick
            q[level] -= size
            if c[level] > 1:
                c[level] -= 1
            if level == 0 and q[0] == 0 and walk:
                q[0] = np.random.randint(NEW_LEVEL_MIN, NEW_LEVEL_MAX + 1)
                c[0] = _orders(q[0])
            elif level == 0 and q[0] == 0:
                if on_ask:
                    ba += 1
                else:
                    bb -= 1
                _shift_out(q, c)
            side = SIDE_ASK if on_ask else SIDE_BID
            _write(out, k, ts, ACTION_CANCEL, side, price, size, F_LAST, level, seq, bb, ba, bq, aq, bc, ac, tick)
            oracle[k] = signal_now
            k += 1
        seq += 1
    mstate[0] = r
    mstate[1] = pos
    mstate[2] = flow
    mstate[3] = last_v
    return k, bb, x


def session_event_times(rng: np.random.Generator, n_events: int, open_ns: int) -> np.ndarray:
    """Sorted event timestamps over a 23-hour session with the CME activity profile."""
    busy = np.cumsum(rng.exponential(1.0, n_events))
    busy /= busy[-1] * (1.0 + 1.0 / n_events)  # in [0, 1)
    weights = PROFILE_HOURS * PROFILE_RATE
    edges_busy = np.concatenate([[0.0], np.cumsum(weights) / weights.sum()])
    edges_hours = np.concatenate([[0.0], np.cumsum(PROFILE_HOURS)])
    hours = np.interp(busy, edges_busy, edges_hours)
    offsets = np.round(hours * 3600e9).astype(np.int64)
    return open_ns + np.maximum.accumulate(offsets)


def trade_dates(sessions: int, first: dt.date = FIRST_TRADE_DATE) -> list[dt.date]:
    """The first ``sessions`` weekdays from ``first``."""
    out, day = [], first
    while len(out) < sessions:
        if day.weekday() < 5:
            out.append(day)
        day += dt.timedelta(days=1)
    return out


def iter_sessions(
    sessions: int,
    seed: int,
    signal: float = DEFAULT_SIGNAL,
    null: bool = False,
    events_per_session: int = DEFAULT_EVENTS,
    calendar: SessionCalendar = SessionCalendar(),
    pressure_events: float = PRESSURE_EVENTS,
    passive_coupling: float = PASSIVE_COUPLING,
    first_date: dt.date = FIRST_TRADE_DATE,
    mode: str = "planted",
    regime_events: float = DEFAULT_REGIME_BARS * DEFAULT_EVENTS / DEFAULT_BARS_PER_DAY,
    lag_events: int = DEFAULT_EVENTS // DEFAULT_BARS_PER_DAY,
    bars_per_day: int | None = None,
):
    """Yield (records, oracle) per session, carrying the price and the pressure across sessions.

    ``mode="memory"``: the regime market of the module docstring; ``regime_events`` is the mean
    regime duration and ``lag_events`` (W) the delay of the drift, both in events, and the
    pressure's time constant is ``MEMORY_FLOW_FRACTION`` · W (``pressure_events`` and
    ``passive_coupling`` are then ignored: ``MEMORY_COUPLING`` couples the passive side).

    ``mode="regime_walk"``: the regime flips with probability 1/``regime_events`` per event and the
    flow bars' threshold for a session is the one that cuts the previous session's signed trade
    volumes into ``bars_per_day`` bars (bars.calibrate_threshold, as the bar builder's ``target``
    mode does; None: events_per_session / lag_events); ``lag_events`` (W, one bar of events) only
    sizes the first session's threshold."""
    if sessions < 1:
        raise DataError(f"synthetic market: sessions must be >= 1, got {sessions}")
    if events_per_session < 100:
        raise DataError(f"synthetic market: events_per_session must be >= 100, got {events_per_session}")
    if not (0.0 <= signal <= 1.0):
        raise DataError(f"synthetic market: signal must be in [0, 1], got {signal}")
    if mode not in MODES:
        raise DataError(f"synthetic market: mode must be one of {list(MODES)}, got {mode!r}")
    memory = mode in ("memory", "memory_walk")
    regime = mode == "regime_walk"
    walk_p = {"walk": WALK_MOVE_P, "memory_walk": MEMORY_WALK_MOVE_P, "regime_walk": REGIME_WALK_MOVE_P}.get(mode, 0.0)
    if mode == "walk":  # no planted drift: the null of every mode
        null = True
    if memory or regime:
        if not (regime_events >= 1.0):
            raise DataError(f"synthetic market: regime_events must be >= 1, got {regime_events}")
        if isinstance(lag_events, bool) or int(lag_events) != lag_events or lag_events < 1:
            raise DataError(f"synthetic market: lag_events must be an integer >= 1, got {lag_events!r}")
        passive_coupling = MEMORY_WALK_COUPLING if mode == "memory_walk" else MEMORY_COUPLING
    if regime:
        if bars_per_day is None:
            bars_per_day = max(1, round(events_per_session / int(lag_events)))
        if isinstance(bars_per_day, bool) or int(bars_per_day) != bars_per_day or bars_per_day < 1:
            raise DataError(f"synthetic market: bars_per_day must be an integer >= 1, got {bars_per_day!r}")
        passive_coupling = REGIME_WALK_COUPLING
    strength = 0.0 if null else float(signal)
    coupling = 0.0 if null else float(passive_coupling)
    master = np.random.default_rng(seed)
    start_tick = START_PRICE_TICKS
    x = float(master.standard_normal())
    lagbuf = np.zeros(int(lag_events) if memory else 1, np.float64)
    mstate = np.zeros(4, np.float64)  # regime, ring position, flow EWMA, last signed trade
    mstate[0] = 1.0
    if memory or regime:  # drawn after everything the planted market draws first: that market is unchanged
        mstate[0] = 1.0 if master.random() < 0.5 else -1.0
    switch_p = 1.0 / float(regime_events) if (memory or regime) else 0.0
    # regime_walk: the first session's flow-bar threshold, sqrt(W · variance of the signed volume per
    # event) (a fair-coin walk reaches ±H in about H² / variance events); later sessions calibrate on
    # the previous one like the bar builder, so that their flow bars are its bars
    bar_h = 0.0
    if regime:
        bar_h = math.sqrt(int(lag_events) * (1.0 - walk_p) * P_TRADE * (2.0 - TRADE_SIZE_P) / TRADE_SIZE_P**2)
    flow_tau = max(MEMORY_FLOW_FRACTION * int(lag_events), 1.0)
    for n_session, day in enumerate(trade_dates(sessions, first_date)):
        open_ns, _ = calendar.open_close_ns(day)
        times = session_event_times(master, events_per_session, open_ns)
        out = np.zeros(2 * events_per_session, MBP10_DTYPE)
        oracle = np.zeros(2 * events_per_session, np.float64)
        sub_seed = int(master.integers(0, 2**31 - 1))
        k, start_tick, x = _simulate_session(
            sub_seed, events_per_session, times, start_tick, x, strength, coupling,
            float(pressure_events), ADD_LEVEL_WEIGHTS, out, oracle, memory, switch_p, flow_tau, lagbuf, mstate,
            walk_p, bar_h,
        )  # fmt: skip
        if regime:
            bar_h = _next_threshold(out[:k], int(bars_per_day), first=n_session == 0) or bar_h  # 0: no trades
        yield out[:k], oracle[:k]


def mode_regime_bars(mode: str) -> float:
    """The mean regime duration (bars) a mode uses when ``data.synth_regime_bars`` is 0, its default."""
    return REGIME_WALK_REGIME_BARS if mode == "regime_walk" else DEFAULT_REGIME_BARS


def _next_threshold(records: np.ndarray, bars_per_day: int, first: bool = False) -> float:
    """The imbalance-bar threshold that the bar builder's ``target`` mode calibrates on this session
    (its trades' signed volumes: + for a buy aggressor, side B) for the next one. ``first``: the
    stream's first session, whose trades before its first book state the builder cannot check
    against a book and leaves out."""
    from numbarl.data.bars import calibrate_threshold

    if first:
        books = np.flatnonzero(records["flags"] & F_LAST)
        records = records[books[0]:] if len(books) else records[:0]
    trades = records[records["action"] == ACTION_TRADE]
    vols = np.where(trades["side"] == SIDE_BID, 1.0, -1.0) * trades["size"].astype(np.float64)
    return float(calibrate_threshold(vols, len(vols), float(bars_per_day)))


def generate(
    sessions: int = DEFAULT_SESSIONS,
    seed: int = 0,
    signal: float = DEFAULT_SIGNAL,
    null: bool = False,
    events_per_session: int = DEFAULT_EVENTS,
    **kwargs,
) -> tuple[np.ndarray, np.ndarray]:
    """MBP-10 records (MBP10_DTYPE) of ``sessions`` sessions and the oracle δ per record."""
    parts = list(iter_sessions(sessions, seed, signal, null, events_per_session, **kwargs))
    records = np.concatenate([p[0] for p in parts])
    oracle = np.concatenate([p[1] for p in parts])
    return records, oracle


def build_synthetic_cache(
    out_dir,
    sessions: int = DEFAULT_SESSIONS,
    seed: int = 0,
    signal: float = DEFAULT_SIGNAL,
    null: bool = False,
    *,
    events_per_session: int = DEFAULT_EVENTS,
    bars_per_day: int = DEFAULT_BARS_PER_DAY,
    feature_names=None,
    feature_params=None,
    folds: dict | None = None,
    overwrite: bool = False,
    dbn_out=None,
    progress=None,
    mode: str = "planted",
    regime_bars: float | None = None,
) -> Path:
    """Generate a synthetic market and write its fxcache (same bars/features/cache code as real
    data), plus ``oracle.npy`` (δ at each bar's close, causal: ``sign(oracle)`` is a policy).
    ``regime_bars`` (memory modes): the mean regime duration in bars; None: the mode's own
    (:func:`mode_regime_bars`).

    One extra warm-up session is generated first (the ``target`` bar mode calibrates its
    threshold on it; its own bars, from the ewma rule, are dropped), so the cache holds exactly
    ``sessions`` sessions. ``dbn_out``: also write
    the records as a DBN file (``.dbn`` or ``.dbn.zst``) that ``numbarl-data build`` accepts.
    """
    from numbarl.data.bars import BarBuilder, BarParams
    from numbarl.data.features import FeatureParams, compute_features, resolve_features
    from numbarl.data.fxcache import check_destination, write_cache
    from numbarl.data.readers import write_dbn

    out_dir = check_destination(out_dir, overwrite)
    if regime_bars is None:
        regime_bars = mode_regime_bars(mode)
    if isinstance(sessions, bool) or not isinstance(sessions, (int, np.integer)) or sessions < 1:
        raise DataError(f"synthetic market: sessions must be an integer >= 1, got {sessions!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise DataError(f"seed must be a non-negative integer, got {seed!r}")
    if dbn_out is not None:
        dbn_out = Path(dbn_out)
        if dbn_out.is_dir():
            raise DataError(f"--dbn {dbn_out} is a folder; name the file to write")
        if dbn_out.exists() and not overwrite:
            raise DataError(f"--dbn {dbn_out} already exists; choose another name or pass --force to replace it")
    if mode not in MODES:
        raise DataError(f"synthetic market: mode must be one of {list(MODES)}, got {mode!r}")
    memory = mode in ("memory", "memory_walk", "regime_walk")
    if memory and not (isinstance(regime_bars, (int, float, np.integer, np.floating)) and regime_bars >= 1):
        raise DataError(f"synthetic market: regime_bars must be a number >= 1, got {regime_bars!r}")
    lag_events = max(1, round(events_per_session / max(int(bars_per_day), 1)))  # W: about one bar
    regime_events = float(regime_bars) * lag_events
    names = resolve_features(feature_names)
    feature_params = feature_params or FeatureParams()
    bar_params = BarParams(mode="target", bars_per_day=int(bars_per_day))
    calendar = SessionCalendar()
    builder = BarBuilder(bar_params, calendar)
    total = sessions + WARMUP_SESSIONS
    bar_parts, oracle_parts, record_parts = [], [], []
    offset = 0
    for k, (records, oracle) in enumerate(
        iter_sessions(total, seed, signal, null, events_per_session, calendar, mode=mode,
                      regime_events=regime_events, lag_events=lag_events, bars_per_day=int(bars_per_day))
    ):
        bars = builder.push(records)
        if k < WARMUP_SESSIONS:  # it only calibrates the first cached session's threshold
            bars = bars[:0]
        if len(bars):
            bar_parts.append(bars)
            oracle_parts.append(oracle[bars["close_index"] - offset].astype(np.float32))
        offset += len(records)
        if dbn_out is not None:
            record_parts.append(records)
        if progress is not None:
            progress("sessions", k + 1, total)
    if not bar_parts:
        raise DataError("synthetic market produced no bars; raise events_per_session or lower bars_per_day")
    bars = np.concatenate(bar_parts)
    oracle = np.concatenate(oracle_parts)
    features = compute_features(bars, names, TICK_SIZE, feature_params, calendar)
    config = {
        "sessions": sessions,
        "warmup_sessions": WARMUP_SESSIONS,
        "seed": seed,
        "signal": 0.0 if null else signal,
        "null": bool(null),
        "events_per_session": events_per_session,
        "bars_per_day_target": bars_per_day,
        "pressure_events": PRESSURE_EVENTS,
        "passive_coupling": 0.0 if null else PASSIVE_COUPLING,
    }
    if memory:  # only then: the planted market's meta stays as it was
        config.update({
            "mode": "memory", "regime_bars": float(regime_bars), "regime_events": regime_events,
            "lag_events": lag_events, "flow_events": max(MEMORY_FLOW_FRACTION * lag_events, 1.0),
            "pressure_events": None,  # no latent pressure drives this market
            "passive_coupling": 0.0 if null else MEMORY_COUPLING,
        })  # fmt: skip
    if mode == "memory_walk":  # the regime drift moves the walk's coin; the book's sides are fair
        config.update({"mode": "memory_walk", "walk_move_p": MEMORY_WALK_MOVE_P,
                       "passive_coupling": 0.0, "walk_coupling": 0.0 if null else MEMORY_WALK_COUPLING})
    if mode == "regime_walk":  # the regime drift follows the last bar's side; no flow EWMA, no lag
        config.update({"mode": "regime_walk", "walk_move_p": REGIME_WALK_MOVE_P, "passive_coupling": 0.0,
                       "walk_coupling": 0.0 if null else REGIME_WALK_COUPLING, "flow_events": None,
                       "lag_events": None})
    if mode == "walk":
        config.update({"mode": "walk", "signal": 0.0, "null": True, "passive_coupling": 0.0,
                       "pressure_events": None, "walk_move_p": WALK_MOVE_P})
    if dbn_out is not None:  # first: a failed DBN write leaves no cache behind, and the reverse below
        try:
            write_dbn(dbn_out, np.concatenate(record_parts), dataset="SYNTH", mappings={SYMBOL: INSTRUMENT_ID})
        except OSError as exc:
            raise DataError(f"cannot write --dbn {dbn_out}: {exc.strerror or exc}") from None
    try:
        return write_cache(
            out_dir, bars, features, names,
            tick_size=TICK_SIZE, bar_params=bar_params, feature_params=feature_params, calendar=calendar,
            source_files=[], symbol=SYMBOL, extra_arrays={"oracle": oracle},
            extra_meta={"synthetic": config}, folds=folds, overwrite=overwrite,
        )  # fmt: skip
    except BaseException:
        if dbn_out is not None:
            dbn_out.unlink(missing_ok=True)
        raise
