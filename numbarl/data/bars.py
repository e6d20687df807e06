"""Imbalance bars from MBP-10 records, with per-level order-flow imbalance (SPEC §3.2).

Signed volume. Each trade record (action ``T``) contributes b·v: v its size, b = +1 for a buy
aggressor (side ``B``), -1 for a sell aggressor (side ``A``), and for side ``N`` the tick rule
(López de Prado, AFML §2.3.2.1): b = sign(p - p_prev) if the price changed, else the previous b
(0 before any trade of the session: the rule does not reach across a session boundary, so an
opening-auction print is unsigned). A bar accumulates θ = Σ b·v and closes once |θ| >= threshold.

Thresholds, two modes:

* ``target``: one threshold per exchange session (calendar.py), chosen so that the *previous*
  session would have produced ``bars_per_day`` bars: bisection on H over the previous session's
  signed volumes with the same θ rule. Strictly causal. The first session with trades has no
  previous session to calibrate on: its bars follow the ``ewma`` rule below (so a one-session
  file, e.g. an hour of CME with its pre-open, builds in the default mode), and its signed
  volumes calibrate the next session's threshold.
* ``ewma``: AFML expected imbalance, E0[θ_T] = E0[T] · |E0[b·v]|: E0[T] is an EWMA of past bar
  lengths in trades, clamped to [min_trades, max_trades]; E0[b·v] an EWMA over trades, floored at
  ``imbalance_floor · E0[|v|]`` so a balanced market cannot drive the threshold to zero. E0[|v|]
  averages trade *sizes*: a trade without an aggressor side (side ``N`` with no earlier price to
  sign it, like CME's opening-auction print) adds 0 to E0[b·v] but its size to E0[|v|]. Both trade
  EWMAs are bias-corrected (Σ w·x / Σ w over the trades so far, w = (1-α)^age): the first trade
  does not stand for the whole past, so one large auction print weighs 1/k of the estimate after k
  trades, not (1-α)^k. The threshold is fixed at the start of each bar, except that it follows the
  EWMAs at every trade until the first bar of the stream has closed, and in a bar that has already
  run ``ewma_max_trades`` trades: a threshold set by one outsized print cannot stay above every
  later imbalance, and a session with trades always produces bars. The first bar's length (its
  threshold was still warming up) does not enter E0[T].

Where a bar closes. The trade that makes |θ| reach the threshold sets the bar *pending*; the bar
closes at the next consistent book state — the next record with F_LAST (the end of the trade's
event packet) whose book is usable — so its close quote already shows the trade's effect. Bars
never span sessions: a bar still open when its session ends is dropped, and the book reference
is reset.

Book states. Only records with F_LAST carry a consistent book. A state is *usable* when best
bid and ask exist, it is not flagged F_MAYBE_BAD_BOOK (a gap: counted in ``gaps``, the OFI
reference is reset), its levels pass the checks of validate.py (else it is skipped like a gap and
counted), and it is neither crossed nor locked (bid >= ask). A crossed or locked state outside
the trading session (after the calendar's close and before the next open: CME's pre-open, a
halt) is skipped like a gap and counted (``crossed_outside_session``); inside the session it is a
DataError unless ``allow_crossed`` (then skipped and counted as ``crossed_in_session``). ``R``
(clear) resets the book reference; F_SNAPSHOT records are book replays, not activity: they set the
reference but add no OFI, events or trades. Trades with an impossible price or size are skipped
and counted (validate.py): a trade's price is checked against the session's last good book, or,
before the session has one (an opening print after a crossed pre-open), against the latest book
state of the stream, crossed or locked ones included; a trade before any book state of the stream
has nothing to be checked against and is skipped (``trade_before_book``). ``BarBuilder.counts``
has every count.

Order-flow imbalance per level m (Cont, Kukanov & Stoikov 2014, eq. 2; levels 1..10 as in
Xu, Gould & Howison 2019, "Multi-level order-flow imbalance"), between consecutive usable
states n-1 -> n within a bar:

    e_m = 1{Pb_n >= Pb_n-1}·qb_n - 1{Pb_n <= Pb_n-1}·qb_n-1
        - 1{Pa_n <= Pa_n-1}·qa_n + 1{Pa_n >= Pa_n-1}·qa_n-1

with P, q the level-m price and size; an empty bid level has price -inf, an empty ask level +inf
(a level appearing adds its size, disappearing removes it). ``ofi[m]`` sums e_m over the bar.

Per bar (BAR_DTYPE): trade date and session open, first/close timestamps, duration, OHLC of mid
and microprice (Stoikov's size-weighted mid, (bid·qa + ask·qb)/(qb + qa)), best bid/ask/spread at
close, volume, buy/sell volume, VWAP, trade count, book events, records, θ and the threshold in
force, gap count, level sizes and order counts at close, OFI per level and mean depth per level
((qb_m + qa_m)/2 averaged over the bar's usable states), and the tick size in force at the close
(validate.py: the known tick, or the causal estimate from the records so far). Prices are float64
price units: fixed-point int64 / 1e9, correctly rounded, so a price on the tick grid is the
nearest double to its decimal value (4000.25 exactly, not 4000.2500000000005).

The builder is a numba ``@njit`` loop over record chunks with its state in a one-row structured
array, so bars can be built from a stream of chunks (a multi-GB day) and are identical however the
stream is cut into chunks. :func:`bars_ref` is the slow pure-Python reference of the same rules.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from numba import njit

from numbarl.data.calendar import SessionCalendar, SessionTable
from numbarl.data.errors import DataError
from numbarl.data.records import (
    ACTION_CLEAR,
    ACTION_TRADE,
    F_LAST,
    F_MAYBE_BAD_BOOK,
    F_SNAPSHOT,
    N_LEVELS,
    PRICE_DIVISOR,
    SIDE_ASK,
    SIDE_BID,
    UNDEF_PRICE,
)
from numbarl.data.validate import (
    BOOK_BAD,
    BOOK_OK,
    JUMP_CONFIRM,
    MAX_SIZE,
    SKIP_NAMES,
    TICK_SLOTS,
    TickRef,
    check_levels,
    check_levels_ref,
    level_grid,
    level_grid_ref,
    on_grid,
    tick_update,
    trade_price_ok,
    trade_price_ok_ref,
)

MODE_TARGET = 0
MODE_EWMA = 1
MODES = {"target": MODE_TARGET, "ewma": MODE_EWMA}
INT64_MIN = np.iinfo(np.int64).min
OUT_CAPACITY = 1 << 15  # bars written per call of the njit loop before returning to Python
CALIBRATION_STEPS = 60  # bisection steps on log(threshold)
TABLE_LEAP_NS = 40 * 86_400 * 1_000_000_000  # extend the session table 40 days at a time

# error codes of the njit loop
ERR_NONE = 0
ERR_CROSSED = 1

# indices into the float64 parameter vector of the njit loop
P_MODE = 0
P_TARGET_BARS = 1
P_ALPHA_BAR = 2
P_ALPHA_TRADE = 3
P_INITIAL_TRADES = 4
P_MIN_TRADES = 5
P_MAX_TRADES = 6
P_FLOOR = 7
P_ALLOW_CROSSED = 8
P_TICK_FIXED = 9  # known tick in fixed point (0: estimate it causally)
N_PARAMS = 10

BAR_DTYPE = np.dtype(
    [
        ("trade_date", "<i8"),  # exchange trade date, days since 1970-01-01 (8 bytes: no padding)
        ("session_open_ns", "<i8"),  # UTC ns of the session's open
        ("open_ts", "<i8"),  # ts_recv of the bar's first record
        ("close_ts", "<i8"),  # ts_recv of the record that closed the bar
        ("duration_ns", "<i8"),  # close_ts - open_ts
        ("close_index", "<i8"),  # index of the closing record in the input stream
        ("mid_open", "<f8"),
        ("mid_high", "<f8"),
        ("mid_low", "<f8"),
        ("mid_close", "<f8"),
        ("micro_open", "<f8"),
        ("micro_high", "<f8"),
        ("micro_low", "<f8"),
        ("micro_close", "<f8"),
        ("bid", "<f8"),  # best bid at close
        ("ask", "<f8"),  # best ask at close
        ("bid_px", "<i8"),  # best bid at close, fixed point 1e-9
        ("ask_px", "<i8"),
        ("spread", "<f8"),
        ("volume", "<f8"),
        ("buy_volume", "<f8"),
        ("sell_volume", "<f8"),
        ("vwap", "<f8"),
        ("n_trades", "<i8"),
        ("n_events", "<i8"),  # usable non-snapshot book states
        ("n_records", "<i8"),
        ("imbalance", "<f8"),  # θ at close
        ("threshold", "<f8"),
        ("gaps", "<i8"),  # F_MAYBE_BAD_BOOK states and skipped (crossed, invalid, off-grid) states
        ("tick", "<f8"),  # tick size in force at the close (known or causal estimate; 0 = not yet known)
        ("bid_sz", "<i8", (N_LEVELS,)),  # level sizes at close
        ("ask_sz", "<i8", (N_LEVELS,)),
        ("bid_ct", "<i8", (N_LEVELS,)),  # level order counts at close
        ("ask_ct", "<i8", (N_LEVELS,)),
        ("ofi", "<f8", (N_LEVELS,)),  # Σ e_m over the bar
        ("depth_mean", "<f8", (N_LEVELS,)),  # mean (qb_m + qa_m)/2 over the bar's usable states
    ],
    align=True,
)

STATE_DTYPE = np.dtype(
    [
        ("record_index", "<i8"),  # global index of the next record
        ("session", "<i8"),  # index into the session table, -1 before the first record
        ("instrument", "<i8"),
        ("prev_valid", "<i8"),
        ("prev_bid_px", "<i8", (N_LEVELS,)),
        ("prev_ask_px", "<i8", (N_LEVELS,)),
        ("prev_bid_sz", "<i8", (N_LEVELS,)),
        ("prev_ask_sz", "<i8", (N_LEVELS,)),
        ("last_trade_px", "<i8"),
        ("last_sign", "<i8"),
        ("threshold", "<f8"),
        ("ewma_trades", "<f8"),
        ("ewma_bv", "<f8"),  # Σ w·b·v (bias-corrected EWMA: divided by ewma_w)
        ("ewma_absv", "<f8"),  # Σ w·|v|
        ("ewma_w", "<f8"),  # Σ w
        ("bars_closed", "<i8"),
        ("session_trades", "<i8"),  # signed volumes of this session stored (target mode)
        ("sessions_seen", "<i8"),
        ("trade_sessions", "<i8"),  # sessions with at least one (valid) trade
        ("session_traded", "<i8"),
        ("tick_px", "<i8"),
        ("tick_slots", "<i8", (TICK_SLOTS,)),
        ("tick_counts", "<i8", (TICK_SLOTS,)),
        ("calibrated", "<i8"),  # target mode: a session's threshold has been calibrated (else the ewma rule)
        ("ref_valid", "<i8"),  # the session's last good book: trade prices are checked against it
        ("loose_valid", "<i8"),  # the latest book state of any session, crossed or locked ones included:
        ("loose_lo", "<i8"),  # the reference of a trade before the session's first good book (an
        ("loose_hi", "<i8"),  # opening print after a crossed pre-open)
        ("n_trade_no_book", "<i8"),
        ("ref_lo", "<i8"),
        ("ref_hi", "<i8"),
        ("n_crossed_out", "<i8"),
        ("n_crossed_in", "<i8"),
        ("n_bad_book", "<i8"),
        ("n_off_grid", "<i8"),
        ("n_off_book", "<i8"),
        ("jump_count", "<i8"),  # consecutive states far from the last good book
        ("n_bad_trade_px", "<i8"),
        ("n_bad_trade_sz", "<i8"),
        ("in_bar", "<i8"),  # records in the current bar
        ("has_book", "<i8"),
        ("pending", "<i8"),
        ("notional", "<f8"),
        ("n_depth", "<i8"),
        ("depth_sum", "<f8", (N_LEVELS,)),
        ("cur", BAR_DTYPE),
    ],
    align=True,
)


@dataclass(frozen=True)
class BarParams:
    """How imbalance bars are cut (stored in the cache's meta as ``bar_params``)."""

    mode: str = "target"
    """``target`` (per-session threshold aiming at ``bars_per_day``) or ``ewma`` (AFML)."""
    bars_per_day: int = 7500
    """target mode: bars per exchange session to aim for (~7,500 suits a liquid future)."""
    ewma_span_bars: float = 20.0
    """ewma mode: span (bars) of the EWMA of bar length in trades; alpha = 2 / (span + 1)."""
    ewma_span_trades: float = 1000.0
    """ewma mode: span (trades) of the EWMAs of b·v and |v|."""
    ewma_initial_trades: float = 100.0
    """ewma mode: expected trades per bar before the first bar closes."""
    ewma_min_trades: float = 10.0
    """ewma mode: lower clamp of the expected trades per bar."""
    ewma_max_trades: float = 1000.0
    """ewma mode: upper clamp of the expected trades per bar. AFML's expected-imbalance rule has
    no stable bar length (a longer bar raises E0[T] and so the next threshold): in practice E0[T]
    drifts to one of the clamps, so set them around the bar length you want."""
    imbalance_floor: float = 0.1
    """ewma mode: |E[b·v]| is floored at this fraction of E[|v|]."""
    allow_crossed: bool = False
    """Skip crossed or locked book states inside the trading session too, instead of stopping with
    an error (outside the session, e.g. CME's pre-open, they are always skipped and counted)."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise DataError(f"bar mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "target" and int(self.bars_per_day) < 1:
            raise DataError(f"bars_per_day must be >= 1, got {self.bars_per_day}")
        if not (0 < self.ewma_min_trades <= self.ewma_initial_trades <= self.ewma_max_trades):
            raise DataError(
                "ewma bar clamps need 0 < ewma_min_trades <= ewma_initial_trades <= ewma_max_trades, got "
                f"{self.ewma_min_trades}, {self.ewma_initial_trades}, {self.ewma_max_trades}"
            )
        if self.ewma_span_bars < 1 or self.ewma_span_trades < 1:
            raise DataError("ewma spans must be >= 1")
        if not (0 < self.imbalance_floor <= 1):
            raise DataError(f"imbalance_floor must be in (0, 1], got {self.imbalance_floor}")

    def vector(self) -> np.ndarray:
        p = np.zeros(N_PARAMS, np.float64)
        p[P_MODE] = MODES[self.mode]
        p[P_TARGET_BARS] = self.bars_per_day
        p[P_ALPHA_BAR] = 2.0 / (self.ewma_span_bars + 1.0)
        p[P_ALPHA_TRADE] = 2.0 / (self.ewma_span_trades + 1.0)
        p[P_INITIAL_TRADES] = self.ewma_initial_trades
        p[P_MIN_TRADES] = self.ewma_min_trades
        p[P_MAX_TRADES] = self.ewma_max_trades
        p[P_FLOOR] = self.imbalance_floor
        p[P_ALLOW_CROSSED] = 1.0 if self.allow_crossed else 0.0
        return p

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# reference (slow, pure Python: one record at a time, Python ints and floats)
# ---------------------------------------------------------------------------------------------
def ofi_level_ref(pb0, qb0, pa0, qa0, pb1, qb1, pa1, qa1) -> float:
    """e_m of CKS eq. 2 for one level; prices None = empty level (bid -inf, ask +inf)."""
    pb0 = -np.inf if pb0 is None else pb0
    pb1 = -np.inf if pb1 is None else pb1
    pa0 = np.inf if pa0 is None else pa0
    pa1 = np.inf if pa1 is None else pa1
    e = 0.0
    if pb1 >= pb0:
        e += qb1
    if pb1 <= pb0:
        e -= qb0
    if pa1 <= pa0:
        e -= qa1
    if pa1 >= pa0:
        e += qa0
    return float(e)


def calibrate_threshold_ref(signed_volumes, target_bars) -> float:
    """Threshold H that makes the θ rule cut ``signed_volumes`` into ~``target_bars`` bars."""
    vols = [float(v) for v in signed_volumes]

    def count(h):
        theta, bars = 0.0, 0
        for v in vols:
            theta += v
            if abs(theta) >= h:
                bars += 1
                theta = 0.0
        return bars

    sizes = [abs(v) for v in vols if v != 0.0]
    if not sizes:
        return 0.0
    lo, hi = np.log(min(sizes)), np.log(sum(sizes))
    if count(np.exp(lo)) <= target_bars:
        return float(np.exp(lo))
    for _ in range(CALIBRATION_STEPS):
        mid = 0.5 * (lo + hi)
        if count(np.exp(mid)) >= target_bars:
            lo = mid
        else:
            hi = mid
    return float(np.exp(lo))


def bars_ref(
    records, params: BarParams, calendar: SessionCalendar = SessionCalendar(), tick_size: float | None = None,
    counts: dict | None = None,
) -> np.ndarray:
    """Pure-Python imbalance bars: the specification that :func:`build_bars` is tested against.
    ``counts``: a dict that receives the skip counts (as ``BarBuilder.counts``)."""
    out = []
    if len(records) == 0:
        return np.zeros(0, BAR_DTYPE)
    ts_all = records["ts_recv"].astype(np.int64)
    table = calendar.sessions_between(int(ts_all[0]), int(ts_all[-1]))
    opens = [int(x) for x in table.open_ns]
    closes = [int(x) for x in table.close_ns]
    div = PRICE_DIVISOR
    st = {
        "session": -1, "instrument": -1, "prev": None, "last_px": None, "last_sign": 0,
        "threshold": 0.0, "ew_t": params.ewma_initial_trades, "ew_bv": 0.0, "ew_absv": 0.0, "ew_w": 0.0,
        "bars_closed": 0, "session_vols": [], "ref": None, "loose": None, "jumps": 0, "calibrated": False,
    }  # fmt: skip
    skipped = dict.fromkeys(SKIP_NAMES, 0)
    ticks = TickRef(tick_fixed(tick_size))
    a_bar = 2.0 / (params.ewma_span_bars + 1.0)
    a_trade = 2.0 / (params.ewma_span_trades + 1.0)

    def new_bar():
        return {"records": 0, "has_book": False, "pending": False, "open_ts": 0, "volume": 0.0,
                "buy": 0.0, "sell": 0.0, "notional": 0.0, "n_trades": 0, "n_events": 0,
                "theta": 0.0, "gaps": 0, "ofi": [0.0] * N_LEVELS, "depth": [0.0] * N_LEVELS,
                "n_depth": 0, "mid": None, "micro": None}  # fmt: skip

    def ewma_threshold():
        if st["ew_w"] <= 0.0:
            return 0.0
        expected = min(max(st["ew_t"], params.ewma_min_trades), params.ewma_max_trades)
        return expected * max(abs(st["ew_bv"] / st["ew_w"]), params.imbalance_floor * (st["ew_absv"] / st["ew_w"]))

    def skip_state(kind):
        skipped[kind] += 1
        bar["gaps"] += 1
        st["prev"] = None

    bar = new_bar()
    for i in range(len(records)):
        r = records[i]
        ts = int(r["ts_recv"])
        sess = st["session"]
        while sess + 1 < len(opens) and ts >= opens[sess + 1]:
            sess += 1
        if sess != st["session"]:
            if st["session"] >= 0 and params.mode == "target" and st["session_vols"]:
                st["threshold"] = calibrate_threshold_ref(st["session_vols"], params.bars_per_day)
                st["calibrated"] = True
            st["session_vols"] = []
            st["session"] = sess
            st["prev"] = None
            st["ref"] = None
            st["last_px"], st["last_sign"] = None, 0
            bar = new_bar()
        inst = int(r["instrument_id"])
        if inst != st["instrument"]:
            st["instrument"] = inst
            st["prev"] = None
        if bar["records"] == 0:
            bar["open_ts"] = ts
        bar["records"] += 1
        action, flags = int(r["action"]), int(r["flags"])
        snapshot = bool(flags & F_SNAPSHOT)
        if action == ACTION_CLEAR:
            st["prev"] = None
            st["ref"] = None
            continue
        if action == ACTION_TRADE and not snapshot:
            size, price = int(r["size"]), int(r["price"])
            if size > MAX_SIZE:
                skipped["bad_trade_size"] += 1
            elif st["ref"] is None and st["loose"] is None:
                skipped["trade_before_book"] += 1
            elif not trade_price_ok_ref(price, st["ref"] if st["ref"] is not None else st["loose"]):
                skipped["bad_trade_price"] += 1
            else:
                size = float(size)
                side = int(r["side"])
                if side == SIDE_BID:
                    sign = 1
                elif side == SIDE_ASK:
                    sign = -1
                elif st["last_px"] is not None and price != st["last_px"]:
                    sign = 1 if price > st["last_px"] else -1
                else:
                    sign = st["last_sign"]
                st["last_px"] = price
                bar["notional"] += price / div * size
                st["last_sign"] = sign
                signed = sign * size
                bar["volume"] += size
                if sign > 0:
                    bar["buy"] += size
                elif sign < 0:
                    bar["sell"] += size
                bar["n_trades"] += 1
                bar["theta"] += signed
                if params.mode == "target":
                    st["session_vols"].append(signed)
                if params.mode == "ewma" or not st["calibrated"]:  # ewma, or target before its first calibration
                    st["ew_bv"] = a_trade * signed + (1.0 - a_trade) * st["ew_bv"]
                    st["ew_absv"] = a_trade * size + (1.0 - a_trade) * st["ew_absv"]
                    st["ew_w"] = a_trade + (1.0 - a_trade) * st["ew_w"]
                    if st["bars_closed"] == 0 or bar["n_trades"] >= params.ewma_max_trades:
                        st["threshold"] = ewma_threshold()
                if st["threshold"] > 0.0 and abs(bar["theta"]) >= st["threshold"]:
                    bar["pending"] = True
        if not flags & F_LAST:
            continue
        lv = r["levels"]
        bpx = [int(x) for x in lv["bid_px"]]
        apx = [int(x) for x in lv["ask_px"]]
        bsz = [int(x) for x in lv["bid_sz"]]
        asz = [int(x) for x in lv["ask_sz"]]
        if flags & F_MAYBE_BAD_BOOK:
            bar["gaps"] += 1
            st["prev"] = None
            continue
        check = check_levels_ref(bpx, apx, bsz, asz, [int(x) for x in lv["bid_ct"]], [int(x) for x in lv["ask_ct"]])
        if check == BOOK_BAD:
            skip_state("bad_book")
            continue
        if check != BOOK_OK:
            st["prev"] = None
            continue
        if bpx[0] >= apx[0]:
            st["loose"] = (apx[0], bpx[0])  # a crossed or locked book still says where prices are
            if ts >= closes[sess]:
                skip_state("crossed_outside_session")
                continue
            if not params.allow_crossed:
                raise DataError(f"crossed book at record {i + 1}: bid {bpx[0] / div} >= ask {apx[0] / div}")
            skip_state("crossed_in_session")
            continue
        if not (trade_price_ok_ref(bpx[0], st["ref"]) and trade_price_ok_ref(apx[0], st["ref"])):
            st["jumps"] += 1
            if st["jumps"] < JUMP_CONFIRM:
                skip_state("off_book")
                continue
        st["jumps"] = 0
        if not ticks.update(level_grid_ref(bpx, apx)):
            skip_state("off_grid")
            continue
        st["ref"] = (min(p for p in bpx if p != UNDEF_PRICE), max(p for p in apx if p != UNDEF_PRICE))
        st["loose"] = st["ref"]
        bid, ask = bpx[0] / div, apx[0] / div
        mid = (bid + ask) * 0.5
        qsum = bsz[0] + asz[0]
        micro = (bid * asz[0] + ask * bsz[0]) / qsum if qsum > 0 else mid
        if not snapshot:
            if st["prev"] is not None:
                pb, pa, qb, qa = st["prev"]
                for m in range(N_LEVELS):
                    bar["ofi"][m] += ofi_level_ref(
                        None if pb[m] == UNDEF_PRICE else pb[m], qb[m],
                        None if pa[m] == UNDEF_PRICE else pa[m], qa[m],
                        None if bpx[m] == UNDEF_PRICE else bpx[m], bsz[m],
                        None if apx[m] == UNDEF_PRICE else apx[m], asz[m],
                    )  # fmt: skip
            bar["n_events"] += 1
        st["prev"] = (bpx, apx, bsz, asz)
        for m in range(N_LEVELS):
            bar["depth"][m] += 0.5 * (bsz[m] + asz[m])
        bar["n_depth"] += 1
        if bar["mid"] is None:
            bar["mid"] = [mid, mid, mid, mid]
            bar["micro"] = [micro, micro, micro, micro]
        for key, value in (("mid", mid), ("micro", micro)):
            o = bar[key]
            o[1] = max(o[1], value)
            o[2] = min(o[2], value)
            o[3] = value
        if not bar["pending"]:
            continue
        row = np.zeros(1, BAR_DTYPE)[0]
        row["trade_date"] = table.trade_date[sess]
        row["session_open_ns"] = opens[sess]
        row["open_ts"], row["close_ts"] = bar["open_ts"], ts
        row["duration_ns"] = ts - bar["open_ts"]
        row["close_index"] = i
        row["mid_open"], row["mid_high"], row["mid_low"], row["mid_close"] = bar["mid"]
        row["micro_open"], row["micro_high"], row["micro_low"], row["micro_close"] = bar["micro"]
        row["bid"], row["ask"], row["bid_px"], row["ask_px"] = bid, ask, bpx[0], apx[0]
        row["spread"] = ask - bid
        row["volume"], row["buy_volume"], row["sell_volume"] = bar["volume"], bar["buy"], bar["sell"]
        row["vwap"] = bar["notional"] / bar["volume"] if bar["volume"] > 0 else mid
        row["n_trades"], row["n_events"], row["n_records"] = bar["n_trades"], bar["n_events"], bar["records"]
        row["imbalance"], row["threshold"], row["gaps"] = bar["theta"], st["threshold"], bar["gaps"]
        row["tick"] = ticks.tick / div
        row["bid_sz"], row["ask_sz"] = bsz, asz
        row["bid_ct"], row["ask_ct"] = [int(x) for x in lv["bid_ct"]], [int(x) for x in lv["ask_ct"]]
        row["ofi"] = bar["ofi"]
        row["depth_mean"] = [d / bar["n_depth"] for d in bar["depth"]]
        out.append(row)
        st["bars_closed"] += 1
        if params.mode == "ewma" or not st["calibrated"]:
            if st["bars_closed"] > 1:
                st["ew_t"] = a_bar * bar["n_trades"] + (1.0 - a_bar) * st["ew_t"]
            st["threshold"] = ewma_threshold()
        bar = new_bar()
    if counts is not None:
        counts.update(skipped)
    return np.array(out, dtype=BAR_DTYPE) if out else np.zeros(0, BAR_DTYPE)


def tick_fixed(tick_size: float | None) -> int:
    """A tick size in price units as fixed point (0 for None: estimate it)."""
    if tick_size is None:
        return 0
    fixed = int(round(float(tick_size) * PRICE_DIVISOR))
    if not tick_size > 0 or fixed < 1:
        raise DataError(f"tick_size must be a price step of at least 1e-9, got {tick_size}")
    return fixed


# ---------------------------------------------------------------------------------------------
# shared njit functions
# ---------------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def ofi_level(pb0, qb0, pa0, qa0, pb1, qb1, pa1, qa1):
    """e_m of CKS eq. 2 for one level: int64 fixed-point prices, empty bid = INT64_MIN, empty ask
    = INT64_MAX (so -inf / +inf), sizes as float64."""
    e = 0.0
    if pb1 >= pb0:
        e += qb1
    if pb1 <= pb0:
        e -= qb0
    if pa1 <= pa0:
        e -= qa1
    if pa1 >= pa0:
        e += qa0
    return e


@njit(cache=True)
def _count_bars(vols, n, h):
    theta = 0.0
    bars = 0
    for i in range(n):
        theta += vols[i]
        if abs(theta) >= h:
            bars += 1
            theta = 0.0
    return bars


@njit(cache=True)
def calibrate_threshold(vols, n, target_bars):
    """Bisection on log(H) so that the θ rule cuts vols[:n] into ~target_bars bars (see ref)."""
    lo_size = np.inf
    total = 0.0
    for i in range(n):
        a = abs(vols[i])
        if a != 0.0:
            total += a
            if a < lo_size:
                lo_size = a
    if total == 0.0:
        return 0.0
    lo = np.log(lo_size)
    hi = np.log(total)
    if _count_bars(vols, n, np.exp(lo)) <= target_bars:
        return np.exp(lo)
    for _ in range(CALIBRATION_STEPS):
        mid = 0.5 * (lo + hi)
        if _count_bars(vols, n, np.exp(mid)) >= target_bars:
            lo = mid
        else:
            hi = mid
    return np.exp(lo)


@njit(cache=True)
def _reset_bar(st):
    st.in_bar = 0
    st.has_book = 0
    st.pending = 0
    st.notional = 0.0
    st.n_depth = 0
    for m in range(N_LEVELS):
        st.depth_sum[m] = 0.0
        st.cur.ofi[m] = 0.0
    c = st.cur
    c.volume = 0.0
    c.buy_volume = 0.0
    c.sell_volume = 0.0
    c.n_trades = 0
    c.n_events = 0
    c.n_records = 0
    c.imbalance = 0.0
    c.gaps = 0


@njit(cache=True)
def _ewma_threshold(st, p):
    if st.ewma_w <= 0.0:
        return 0.0
    expected = min(max(st.ewma_trades, p[P_MIN_TRADES]), p[P_MAX_TRADES])
    return expected * max(abs(st.ewma_bv / st.ewma_w), p[P_FLOOR] * (st.ewma_absv / st.ewma_w))


@njit(cache=True)
def _skip_state(st, c):
    c.gaps += 1
    st.prev_valid = 0


@njit(cache=True)
def _build_bars_chunk(recs, start, state, p, opens, closes, dates, vols, out):
    """Advance the bar builder over recs[start:] writing completed bars to ``out``.

    Returns (next record to process, bars written, error code, error record index). It stops
    early when ``out`` is full; the caller drains ``out`` and calls again from the returned index.
    ``vols`` must have room for the session's signed volumes (target mode).
    """
    st = state[0]
    c = st.cur
    n_out = 0
    target = p[P_MODE] == MODE_TARGET
    fixed_tick = p[P_TICK_FIXED] > 0.0
    n_open = opens.shape[0]
    for i in range(start, recs.shape[0]):
        if n_out == out.shape[0]:
            return i, n_out, ERR_NONE, 0
        r = recs[i]
        gi = st.record_index
        st.record_index += 1
        ts = np.int64(r.ts_recv)
        # SESSION
        sess = st.session
        while sess + 1 < n_open and ts >= opens[sess + 1]:
            sess += 1
        if sess != st.session:
            if st.session >= 0 and target and st.session_trades > 0:
                st.threshold = calibrate_threshold(vols, st.session_trades, p[P_TARGET_BARS])
                st.calibrated = 1
            st.session_trades = 0
            st.session = sess
            st.sessions_seen += 1
            st.session_traded = 0
            st.prev_valid = 0
            st.ref_valid = 0
            st.last_trade_px = UNDEF_PRICE  # the tick rule does not reach across sessions
            st.last_sign = 0
            _reset_bar(st)
        inst = np.int64(r.instrument_id)
        if inst != st.instrument:
            st.instrument = inst
            st.prev_valid = 0
        if st.in_bar == 0:
            c.open_ts = ts
        st.in_bar += 1
        c.n_records += 1
        action = r.action
        flags = r.flags
        snapshot = (flags & F_SNAPSHOT) != 0
        if action == ACTION_CLEAR:
            st.prev_valid = 0
            st.ref_valid = 0
            continue
        # TRADES
        if action == ACTION_TRADE and not snapshot:
            price = r.price
            if r.size > MAX_SIZE:
                st.n_bad_trade_sz += 1
            elif st.ref_valid == 0 and st.loose_valid == 0:
                st.n_trade_no_book += 1
            elif not (trade_price_ok(price, st.ref_valid, st.ref_lo, st.ref_hi) if st.ref_valid != 0
                      else trade_price_ok(price, st.loose_valid, st.loose_lo, st.loose_hi)):
                st.n_bad_trade_px += 1
            else:
                size = np.float64(r.size)
                side = r.side
                if side == SIDE_BID:
                    sign = 1
                elif side == SIDE_ASK:
                    sign = -1
                elif st.last_trade_px != UNDEF_PRICE and price != st.last_trade_px:
                    sign = 1 if price > st.last_trade_px else -1
                else:
                    sign = st.last_sign
                st.last_trade_px = price
                st.notional += price / PRICE_DIVISOR * size
                st.last_sign = sign
                signed = sign * size
                c.volume += size
                if sign > 0:
                    c.buy_volume += size
                elif sign < 0:
                    c.sell_volume += size
                c.n_trades += 1
                c.imbalance += signed
                if st.session_traded == 0:
                    st.session_traded = 1
                    st.trade_sessions += 1
                if target:
                    vols[st.session_trades] = signed
                    st.session_trades += 1
                if not target or st.calibrated == 0:  # ewma, or target before its first calibration
                    a = p[P_ALPHA_TRADE]
                    st.ewma_bv = a * signed + (1.0 - a) * st.ewma_bv
                    st.ewma_absv = a * size + (1.0 - a) * st.ewma_absv
                    st.ewma_w = a + (1.0 - a) * st.ewma_w
                    if st.bars_closed == 0 or c.n_trades >= p[P_MAX_TRADES]:
                        st.threshold = _ewma_threshold(st, p)
                if st.threshold > 0.0 and abs(c.imbalance) >= st.threshold:
                    st.pending = 1
        # BOOK STATE
        if (flags & F_LAST) == 0:
            continue
        lv = r.levels
        if (flags & F_MAYBE_BAD_BOOK) != 0:
            _skip_state(st, c)
            continue
        check = check_levels(lv)
        if check == BOOK_BAD:
            st.n_bad_book += 1
            _skip_state(st, c)
            continue
        if check != BOOK_OK:
            st.prev_valid = 0
            continue
        bpx0 = lv[0].bid_px
        apx0 = lv[0].ask_px
        if bpx0 >= apx0:
            st.loose_valid = 1  # a crossed or locked book still says where prices are
            st.loose_lo = apx0
            st.loose_hi = bpx0
            if ts >= closes[sess]:
                st.n_crossed_out += 1
                _skip_state(st, c)
                continue
            if p[P_ALLOW_CROSSED] == 0.0:
                return i, n_out, ERR_CROSSED, gi
            st.n_crossed_in += 1
            _skip_state(st, c)
            continue
        if not (trade_price_ok(bpx0, st.ref_valid, st.ref_lo, st.ref_hi)
                and trade_price_ok(apx0, st.ref_valid, st.ref_lo, st.ref_hi)):
            st.jump_count += 1
            if st.jump_count < JUMP_CONFIRM:
                st.n_off_book += 1
                _skip_state(st, c)
                continue
        st.jump_count = 0
        if st.tick_px != 0 and on_grid(lv, st.tick_px):
            ok = True  # what tick_update answers for a grid that the tick divides, without the gcds
        else:
            ok, tick = tick_update(level_grid(lv), st.tick_px, fixed_tick, st.tick_slots, st.tick_counts)
            st.tick_px = tick
        if not ok:
            st.n_off_grid += 1
            _skip_state(st, c)
            continue
        lo = bpx0
        hi = apx0
        for m in range(N_LEVELS):
            if lv[m].bid_px != UNDEF_PRICE:
                lo = lv[m].bid_px
            if lv[m].ask_px != UNDEF_PRICE:
                hi = lv[m].ask_px
        st.ref_valid = 1
        st.ref_lo = lo
        st.ref_hi = hi
        st.loose_valid = 1
        st.loose_lo = lo
        st.loose_hi = hi
        bid = bpx0 / PRICE_DIVISOR
        ask = apx0 / PRICE_DIVISOR
        mid = (bid + ask) * 0.5
        qb = np.float64(lv[0].bid_sz)
        qa = np.float64(lv[0].ask_sz)
        micro = (bid * qa + ask * qb) / (qb + qa) if qb + qa > 0.0 else mid
        if not snapshot:
            if st.prev_valid != 0:
                for m in range(N_LEVELS):
                    pb1 = lv[m].bid_px
                    if pb1 == UNDEF_PRICE:
                        pb1 = INT64_MIN
                    pb0 = st.prev_bid_px[m]
                    if pb0 == UNDEF_PRICE:
                        pb0 = INT64_MIN
                    c.ofi[m] += ofi_level(
                        pb0, np.float64(st.prev_bid_sz[m]), st.prev_ask_px[m], np.float64(st.prev_ask_sz[m]),
                        pb1, np.float64(lv[m].bid_sz), lv[m].ask_px, np.float64(lv[m].ask_sz),
                    )  # fmt: skip
            c.n_events += 1
        st.prev_valid = 1
        for m in range(N_LEVELS):
            st.prev_bid_px[m] = lv[m].bid_px
            st.prev_ask_px[m] = lv[m].ask_px
            st.prev_bid_sz[m] = lv[m].bid_sz
            st.prev_ask_sz[m] = lv[m].ask_sz
            st.depth_sum[m] += 0.5 * (np.float64(lv[m].bid_sz) + np.float64(lv[m].ask_sz))
        st.n_depth += 1
        if st.has_book == 0:
            st.has_book = 1
            c.mid_open = mid
            c.mid_high = mid
            c.mid_low = mid
            c.micro_open = micro
            c.micro_high = micro
            c.micro_low = micro
        c.mid_high = max(c.mid_high, mid)
        c.mid_low = min(c.mid_low, mid)
        c.mid_close = mid
        c.micro_high = max(c.micro_high, micro)
        c.micro_low = min(c.micro_low, micro)
        c.micro_close = micro
        if st.pending == 0:
            continue
        # CLOSE THE BAR
        o = out[n_out]
        o.trade_date = dates[sess]
        o.session_open_ns = opens[sess]
        o.open_ts = c.open_ts
        o.close_ts = ts
        o.duration_ns = ts - c.open_ts
        o.close_index = gi
        o.mid_open = c.mid_open
        o.mid_high = c.mid_high
        o.mid_low = c.mid_low
        o.mid_close = c.mid_close
        o.micro_open = c.micro_open
        o.micro_high = c.micro_high
        o.micro_low = c.micro_low
        o.micro_close = c.micro_close
        o.bid = bid
        o.ask = ask
        o.bid_px = bpx0
        o.ask_px = apx0
        o.spread = ask - bid
        o.volume = c.volume
        o.buy_volume = c.buy_volume
        o.sell_volume = c.sell_volume
        o.vwap = st.notional / c.volume if c.volume > 0.0 else mid
        o.n_trades = c.n_trades
        o.n_events = c.n_events
        o.n_records = c.n_records
        o.imbalance = c.imbalance
        o.threshold = st.threshold
        o.gaps = c.gaps
        o.tick = st.tick_px / PRICE_DIVISOR
        for m in range(N_LEVELS):
            o.bid_sz[m] = lv[m].bid_sz
            o.ask_sz[m] = lv[m].ask_sz
            o.bid_ct[m] = lv[m].bid_ct
            o.ask_ct[m] = lv[m].ask_ct
            o.ofi[m] = c.ofi[m]
            o.depth_mean[m] = st.depth_sum[m] / st.n_depth
        n_out += 1
        st.bars_closed += 1
        if not target or st.calibrated == 0:
            if st.bars_closed > 1:  # the first bar's threshold was warming up: its length is no E[T] sample
                a = p[P_ALPHA_BAR]
                st.ewma_trades = a * c.n_trades + (1.0 - a) * st.ewma_trades
            st.threshold = _ewma_threshold(st, p)
        _reset_bar(st)
    return recs.shape[0], n_out, ERR_NONE, 0


# ---------------------------------------------------------------------------------------------
# streaming builder
# ---------------------------------------------------------------------------------------------
class BarBuilder:
    """Imbalance bars from a stream of MBP-10 record chunks (any chunking gives the same bars).

    ``push(chunk)`` returns the bars completed inside the chunk; a bar still open at the end of
    the stream is not returned (it never closed). ``tick_size``: the instrument's known tick
    (book states off its grid are skipped); None estimates it causally (validate.py).
    """

    def __init__(
        self, params: BarParams = BarParams(), calendar: SessionCalendar = SessionCalendar(),
        tick_size: float | None = None,
    ):  # fmt: skip
        self.params = params
        self.calendar = calendar
        self._p = params.vector()
        self._p[P_TICK_FIXED] = tick_fixed(tick_size)
        self._state = np.zeros(1, STATE_DTYPE)
        st = self._state[0]
        st["session"] = -1
        st["instrument"] = -1
        st["last_trade_px"] = UNDEF_PRICE
        st["ewma_trades"] = params.ewma_initial_trades
        st["tick_px"] = tick_fixed(tick_size)
        self._vols = np.zeros(1 << 16, np.float64)
        self._out = np.zeros(OUT_CAPACITY, BAR_DTYPE)
        self._table: SessionTable | None = None
        self._table_start = 0
        self._table_end = 0
        self.records_seen = 0

    def _ensure_table(self, first_ts: int, last_ts: int):
        if self._table is None:
            self._table_start = first_ts
        if self._table is None or last_ts >= self._table_end:
            self._table_end = max(last_ts, self._table_end) + TABLE_LEAP_NS
            self._table = self.calendar.sessions_between(self._table_start, self._table_end)
            if self._table.open_ns[0] > first_ts:
                raise DataError("session table does not cover the first record")

    @property
    def counts(self) -> dict[str, int]:
        """Book states and trades skipped so far, by kind (validate.SKIP_NAMES)."""
        st = self._state[0]
        return {
            "crossed_outside_session": int(st["n_crossed_out"]),
            "crossed_in_session": int(st["n_crossed_in"]),
            "bad_book": int(st["n_bad_book"]),
            "off_book": int(st["n_off_book"]),
            "off_grid": int(st["n_off_grid"]),
            "bad_trade_price": int(st["n_bad_trade_px"]),
            "bad_trade_size": int(st["n_bad_trade_sz"]),
            "trade_before_book": int(st["n_trade_no_book"]),
        }

    @property
    def sessions_seen(self) -> int:
        return int(self._state[0]["sessions_seen"])

    @property
    def trade_sessions(self) -> int:
        """Sessions with at least one (valid) trade so far."""
        return int(self._state[0]["trade_sessions"])

    @property
    def tick_size(self) -> float:
        """The tick in force now (known, or the causal estimate; 0.0 while unknown)."""
        return int(self._state[0]["tick_px"]) / PRICE_DIVISOR

    def no_bars_reason(self) -> str:
        """Why a stream gave no bars, in the terms of the data (for the 'no bars' error)."""
        seen, traded = self.sessions_seen, self.trade_sessions
        where = f"{self.records_seen} records in {seen} session{'s' if seen != 1 else ''}"
        if traded == 0:
            return f"{where}, none with a valid trade: imbalance bars need trades"
        return (f"{where}, {traded} with trades: no bar reached its threshold (the first session's bars follow "
                "the ewma rule); with numbarl-data build, lower --ewma-initial-trades / --ewma-max-trades "
                "(BarParams.ewma_initial_trades, ewma_max_trades), or use more data")

    def push(self, records: np.ndarray, locate=None) -> np.ndarray:
        """Feed the next chunk; returns the bars that closed in it (BAR_DTYPE)."""
        n = len(records)
        if n == 0:
            return np.zeros(0, BAR_DTYPE)
        ts = records["ts_recv"]
        self._ensure_table(int(ts[0]), int(ts[-1]))
        need = int(self._state[0]["session_trades"]) + n
        if self.params.mode == "target" and need > len(self._vols):
            grown = np.zeros(max(need, 2 * len(self._vols)), np.float64)
            grown[: len(self._vols)] = self._vols
            self._vols = grown
        pieces = []
        start = 0
        table = self._table
        while start < n:
            start, n_out, err, where = _build_bars_chunk(
                records, start, self._state, self._p, table.open_ns, table.close_ns, table.trade_date, self._vols,
                self._out,
            )  # fmt: skip
            if err == ERR_CROSSED:
                local = start
                lv = records[local]["levels"][0]
                place = locate(int(where)) if locate is not None else f"record {int(where) + 1}"
                bid, ask = int(lv["bid_px"]), int(lv["ask_px"])
                what = "crossed book" if bid > ask else "locked book"
                raise DataError(
                    f"{what} at {place} (ts_recv {int(records[local]['ts_recv'])}) inside the trading "
                    f"session: best bid {bid / PRICE_DIVISOR:.9g} {'>' if bid > ask else '='} best ask "
                    f"{ask / PRICE_DIVISOR:.9g}; pass allow_crossed (--allow-crossed) to skip crossed "
                    "states inside sessions too (outside them they are always skipped)"
                )
            if n_out:
                pieces.append(self._out[:n_out].copy())
        self.records_seen += n
        if not pieces:
            return np.zeros(0, BAR_DTYPE)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def build_bars(
    chunks, params: BarParams = BarParams(), calendar: SessionCalendar = SessionCalendar(),
    tick_size: float | None = None,
) -> np.ndarray:  # fmt: skip
    """Bars from one record array or an iterable of record chunks."""
    if isinstance(chunks, np.ndarray):
        chunks = [chunks]
    builder = BarBuilder(params, calendar, tick_size)
    parts = [builder.push(chunk) for chunk in chunks]
    parts = [p for p in parts if len(p)]
    if not parts:
        return np.zeros(0, BAR_DTYPE)
    return np.concatenate(parts)


def estimate_tick_size(bars: np.ndarray) -> float:
    """The tick of a finished build: the causal estimate in force at the first bar's close (the
    ``tick`` field; validate.py), so no later record decides it. Bars of an older build without
    a usable ``tick`` fall back to the gcd of their best bid/ask differences."""
    if len(bars) == 0:
        raise DataError("cannot estimate the tick size: no bars")
    known = bars["tick"][bars["tick"] > 0] if "tick" in bars.dtype.names else np.zeros(0)
    if len(known):
        return float(known[0])
    px = np.concatenate([bars["bid_px"], bars["ask_px"]]).astype(np.int64)
    diffs = np.abs(px - px[0])
    diffs = diffs[diffs > 0]
    if len(diffs) == 0:
        raise DataError("cannot estimate the tick size: the price never changes; pass tick_size (--tick-size)")
    return float(np.gcd.reduce(diffs)) / PRICE_DIVISOR
