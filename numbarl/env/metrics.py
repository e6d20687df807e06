"""Performance metrics: one implementation for training episodes, validation and test (SPEC §4).

Inputs: per-bar P&L (currency) and positions for P policies, the bars' session ids, the trade
list, bars_per_day and the initial capital. Conventions follow empyrical:

    equity_t = capital + sum_{s<=t} pnl_s,     r_t = pnl_t / equity_{t-1}    (so equity_t / capital
                                                                            = prod (1 + r_s))
    total_return   equity_T / capital - 1                                   (cum_returns_final)
    sharpe         mean(r) / std(r, ddof=1) * sqrt(bars_per_day * 252)     (sharpe_ratio)
    daily_sharpe   same over per-session returns, * sqrt(252)
    sharpe_adj     autocorrelation-adjusted per-bar Sharpe (Lo 2002, below)
    trade_sharpe   mean / std(ddof=1) of trade P&L, not annualized
    sortino        mean(r) / sqrt(mean(min(r, 0)^2)) * sqrt(ann)            (downside over ALL bars)
    max_drawdown   min_t (equity_t / max(capital, equity_<=t) - 1)  <= 0    (max_drawdown)
    calmar         cagr / |max_drawdown|, cagr = (equity_T / capital)^(1 / years) - 1,
                   years = bars / (bars_per_day * 252)                      (calmar_ratio)
    win_rate, profit_factor (gross win / gross loss), avg_trade, n_trades, trades_per_day
    (trades per bars_per_day bars), avg_hold (bars), exposure (fraction of bars with a
    position), turnover (contracts traded per bar, entries + exits).

sharpe_adj. The per-bar Sharpe annualized by sqrt(bars_per_day * 252) assumes uncorrelated bar
returns; bar P&L of a held position is autocorrelated and the figure then overstates (Lo 2002,
"The Statistics of Sharpe Ratios", Financial Analysts Journal 58(4), eq. 13-14). Lo's q-period
Sharpe from the per-period SR and the sample autocorrelations rho_k is

    SR_q = SR * q / sqrt(q + 2 * sum_{k=1}^{q-1} (q - k) * rho_k).

numbarl takes q = bars_per_day (one session: every lag inside a trading day, as Lo's formula
prescribes, lags k = 1 .. ceil(q) - 1) and annualizes the session figure with sqrt(252), the
daily Sharpe's own assumption of uncorrelated days:

    sharpe_adj = SR * q / sqrt(q + 2 sum_k (q - k) rho_k) * sqrt(252),   SR = mean(r) / std(r, ddof=1)

With rho = 0 it equals `sharpe`; it estimates from bars what `daily_sharpe` measures from
sessions. rho_k is the standard (biased, divided by n) sample autocorrelation
sum_{t>=k} (r_t - mean)(r_{t-k} - mean) / sum_t (r_t - mean)^2; the weights (q - k) are Bartlett's,
so the denominator is never negative. It needs at least 2 sessions' worth of bars (2 q). Its
sampling error is of the daily Sharpe's order, not the per-bar one's: the variance estimate sums
a session of lags (Bartlett kernel: relative sd about sqrt(4 q / (3 T)) = sqrt(4 / (3 sessions)),
half that on the ratio). Measured on iid bar P&L with q = 7,500: 30.3 against a per-bar 26.4 over
13 sessions, 25.0 against 28.1 over 133; on the synthetic oracle (30 sessions, 537 bars/day,
default EnvParams) 29.6 where the per-bar Sharpe says 134.1 and the daily Sharpe 27.6.
The lags need the whole per-bar series, which the device scan does not keep: `sharpe_adj` is
computed on the host from the per-bar P&L (`finalize(..., pnl=)`; `compute_metrics` and
`BacktestResult.metrics()` pass it); from the accumulators alone it is NaN with a reason.

Degenerate and bad input gives NaN plus a reason string that names the true cause (never a
crash, never a fake number):
  - NaN or inf bar P&L (counted by the scan; such a bar folds as 0 so that the other
    accumulators stay finite): every P&L-derived metric is NaN, "bar P&L is NaN or inf in k of
    n bars (first at bar i)" (i indexes session_id: the market's bar for a backtest);
    a non-finite position: exposure; a non-finite trade P&L: the trade statistics (it is
    neither a win nor a loss); a non-finite trade size or bar index: turnover / avg_hold.
  - A variance at rounding level is zero: std <= ROUNDING_REL_STD * RMS (the root mean square of
    the same series). A constant-return series computed in float64 (r_t = pnl_t / equity_{t-1}
    with equity accumulated bar by bar) has std / RMS of order n * 2.2e-16 at most (about 2e-9 for
    10^7 bars), while no market series has a per-bar mean / std anywhere near 1e8; the threshold
    1e-8 separates the two. It applies to every std a ratio divides by (bar, session and trade
    returns, the downside deviation).
  - Figures that annualize by compounding (calmar's CAGR) are NaN when the window is shorter
    than MIN_ANNUALIZE_DAYS = 20 trading days (bars / bars_per_day): raising a 3-day return to
    the power 84 is not a measurement. Sharpe-type ratios scale by sqrt(periods), a change of
    units that is defined for any window with enough observations; they stay.

The heavy part, a pass over P x T bars, is `scan_row`: one sequential, fixed-order pass per
policy (Welford for the variances) updating float64 accumulators, so it is deterministic and
streams over chunks of bars. The kernel runs one thread per policy on time-major [T, P] arrays
(coalesced); the CPU path loops the same row function, so both paths give the same accumulators
and `finalize` turns either into the same metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from numbarl.cuda.launch import device_function
from numbarl.cuda.runtime import cuda
from numbarl.env.state import row_jit

_cuda = cuda()

TRADING_DAYS = 252
MIN_ANNUALIZE_DAYS = 20  # shortest window (trading days) whose return is compounded to a year
ROUNDING_REL_STD = 1e-8  # std <= this x RMS of the same series is rounding: zero variance
BLOCK = 32  # one warp per block: the per-policy scans spread over as many SMs as possible

METRIC_NAMES = (
    "total_return",
    "sharpe",
    "daily_sharpe",
    "sharpe_adj",
    "trade_sharpe",
    "sortino",
    "max_drawdown",
    "calmar",
    "win_rate",
    "profit_factor",
    "avg_trade",
    "n_trades",
    "trades_per_day",
    "avg_hold",
    "exposure",
    "turnover",
)
# metrics computed from the bar P&L: NaN (with the count) when any bar P&L is NaN or inf
PNL_METRICS = ("total_return", "sharpe", "daily_sharpe", "sharpe_adj", "sortino", "max_drawdown", "calmar")
TRADE_PNL_METRICS = ("win_rate", "profit_factor", "avg_trade", "trade_sharpe")

# accumulator rows ([N_ACC, P] float64)
A_EQUITY, A_PEAK, A_MAX_DD, A_N, A_MEAN, A_M2, A_DOWN, A_EXPOSED = 0, 1, 2, 3, 4, 5, 6, 7
A_SESSION, A_SESSION_START, A_N_SESSIONS, A_SESSION_MEAN, A_SESSION_M2, A_RUIN = 8, 9, 10, 11, 12, 13
A_BAD_PNL, A_FIRST_BAD_PNL, A_BAD_POSITION = 14, 15, 16  # non-finite inputs: counts, first bar (-1: none)
N_ACC = 17
_ZERO = np.float64(0.0)  # the scan accumulates in float64 on purpose (P x T sums)
_ONE = np.float64(1.0)
_MINUS_ONE = np.float64(-1.0)


# ---------------------------------------------------------------------------------------------
# the scan (host loops and kernel share it)
# ---------------------------------------------------------------------------------------------
@row_jit
def init_row(acc, p, capital):
    for a in range(N_ACC):
        acc[a, p] = _ZERO
    acc[A_EQUITY, p] = capital
    acc[A_PEAK, p] = capital
    acc[A_SESSION, p] = _MINUS_ONE
    acc[A_FIRST_BAD_PNL, p] = _MINUS_ONE


@njit(cache=True)
def _welford(n, mean, m2, x):
    n = n + _ONE
    d = x - mean
    mean = mean + d / n
    m2 = m2 + d * (x - mean)
    return n, mean, m2


@row_jit
def scan_row(acc, p, pnl, position, session_id, origin, n_rows):
    """Fold bars origin + t (t < n_rows) of policy p: pnl[t, p], position[t, p] (time-major).

    A NaN/inf P&L or position is counted (A_BAD_PNL with the first bar index origin + t,
    A_BAD_POSITION) and folds as 0: finalize reports the count instead of a number."""
    equity = acc[A_EQUITY, p]
    peak = acc[A_PEAK, p]
    mdd = acc[A_MAX_DD, p]
    n = acc[A_N, p]
    mean = acc[A_MEAN, p]
    m2 = acc[A_M2, p]
    down = acc[A_DOWN, p]
    exposed = acc[A_EXPOSED, p]
    sess = acc[A_SESSION, p]
    sess_start = acc[A_SESSION_START, p]
    ns = acc[A_N_SESSIONS, p]
    s_mean = acc[A_SESSION_MEAN, p]
    s_m2 = acc[A_SESSION_M2, p]
    ruin = acc[A_RUIN, p]
    bad = acc[A_BAD_PNL, p]
    first_bad = acc[A_FIRST_BAD_PNL, p]
    bad_pos = acc[A_BAD_POSITION, p]
    for t in range(n_rows):
        sid = np.float64(session_id[origin + t])
        if sid != sess:
            if sess >= _ZERO and sess_start > _ZERO:
                ns, s_mean, s_m2 = _welford(ns, s_mean, s_m2, equity / sess_start - _ONE)
            sess = sid
            sess_start = equity
        x = np.float64(pnl[t, p])
        if not math.isfinite(x):
            bad += _ONE
            if first_bad < _ZERO:
                first_bad = np.float64(origin + t)
            x = _ZERO
        r = _ZERO
        if equity > _ZERO:
            r = x / equity
        else:
            ruin = _ONE
        equity += x
        if equity > peak:
            peak = equity
        if peak > _ZERO:
            dd = equity / peak - _ONE
            if dd < mdd:
                mdd = dd
        n, mean, m2 = _welford(n, mean, m2, r)
        if r < _ZERO:
            down += r * r
        held = np.float64(position[t, p])
        if not math.isfinite(held):
            bad_pos += _ONE
        elif held != _ZERO:
            exposed += _ONE
    acc[A_EQUITY, p] = equity
    acc[A_PEAK, p] = peak
    acc[A_MAX_DD, p] = mdd
    acc[A_N, p] = n
    acc[A_MEAN, p] = mean
    acc[A_M2, p] = m2
    acc[A_DOWN, p] = down
    acc[A_EXPOSED, p] = exposed
    acc[A_SESSION, p] = sess
    acc[A_SESSION_START, p] = sess_start
    acc[A_N_SESSIONS, p] = ns
    acc[A_SESSION_MEAN, p] = s_mean
    acc[A_SESSION_M2, p] = s_m2
    acc[A_RUIN, p] = ruin
    acc[A_BAD_PNL, p] = bad
    acc[A_FIRST_BAD_PNL, p] = first_bad
    acc[A_BAD_POSITION, p] = bad_pos


@row_jit
def scan_ref(acc, pnl, position, session_id, origin, n_rows):
    for p in range(acc.shape[1]):
        scan_row(acc, p, pnl, position, session_id, origin, n_rows)


_init_row = device_function(init_row)
_scan_row = device_function(scan_row)


@_cuda.jit(cache=True)
def init_kernel(acc, capital):
    p = _cuda.grid(1)
    if p >= acc.shape[1]:
        return
    _init_row(acc, p, capital)


@_cuda.jit(cache=True)
def scan_kernel(acc, pnl, position, session_id, origin, n_rows):
    p = _cuda.grid(1)
    if p >= acc.shape[1]:
        return
    _scan_row(acc, p, pnl, position, session_id, origin[0], n_rows[0])


def _dims(n):
    threads = max(1, min(BLOCK, int(n)))
    return (max(1, int(n)) + threads - 1) // threads, threads


def launch_init(acc, capital, stream):
    init_kernel[_dims(acc.shape[1]) + (stream,)](acc, np.float64(capital))


def launch_scan(acc, pnl, position, session_id, origin, n_rows, stream):
    """origin, n_rows: device int64 [1] (first bar of row 0, rows to fold): capturable."""
    scan_kernel[_dims(acc.shape[1]) + (stream,)](acc, pnl, position, session_id, origin, n_rows)


# ---------------------------------------------------------------------------------------------
# host-only: metrics that need the whole per-bar series (the scan keeps O(1) state per policy)
# ---------------------------------------------------------------------------------------------
def bar_returns(pnl_row: np.ndarray, initial_capital: float) -> np.ndarray:
    """r_t = pnl_t / equity_{t-1}, with equity accumulated in the scan's order (capital first)."""
    equity = np.cumsum(np.concatenate([[np.float64(initial_capital)], np.asarray(pnl_row, np.float64)]))
    return np.asarray(pnl_row, np.float64) / equity[:-1]


def autocovariance(x: np.ndarray, max_lag: int) -> np.ndarray:
    """gamma_k = sum_{t>=k} (x_t - mean)(x_{t-k} - mean) / n for k = 0 .. max_lag (biased, as
    statsmodels' acf): by FFT, O(n log n), so a lag window of a whole session stays cheap."""
    d = np.asarray(x, np.float64) - np.mean(x)
    n = len(d)
    size = 1 << int(n + max_lag).bit_length()  # zero padding >= n + max_lag: no circular wrap
    spectrum = np.fft.rfft(d, size)
    return np.fft.irfft(spectrum * np.conj(spectrum), size)[: max_lag + 1] / n


def _rounding_level(std: float, rms: float) -> bool:
    return std <= ROUNDING_REL_STD * rms


def _rms(x: np.ndarray) -> float:
    """Root mean square, scaled by max |x| first so that squares of huge values do not overflow."""
    scale = float(np.max(np.abs(x))) if len(x) else 0.0
    if scale == 0.0 or not math.isfinite(scale):
        return scale
    return scale * math.sqrt(float(np.mean(np.square(x / scale))))


def lo_adjusted_sharpe(returns: np.ndarray, bars_per_day: float) -> tuple[float, str]:
    """(sharpe_adj, reason): Lo (2002) q-period Sharpe with q = bars_per_day, times sqrt(252)
    (module docstring). returns: float64 [T] finite bar returns of one policy."""
    r = np.asarray(returns, np.float64)
    n = len(r)
    q = float(bars_per_day)
    if n < 2.0 * q or n < 2:
        return math.nan, f"fewer than 2 sessions of bars ({n} < 2 x bars_per_day = {2.0 * q:g}) for lags up to one session"
    with np.errstate(over="ignore", invalid="ignore"):
        std = float(np.std(r, ddof=1))
    if not math.isfinite(std):
        return math.nan, "not finite (overflow)"
    if _rounding_level(std, _rms(r)):
        return math.nan, "zero variance of bar returns (std at rounding level)"
    max_lag = max(math.ceil(q) - 1, 0)
    gamma = autocovariance(r, max_lag)
    lags = np.arange(1, max_lag + 1, dtype=np.float64)
    denominator = q + 2.0 * float(np.sum((q - lags) * gamma[1:] / gamma[0]))
    if not denominator > 0.0:
        return math.nan, "autocorrelation-adjusted variance is zero (bar returns cancel within a session)"
    return float(np.mean(r)) / std * q / math.sqrt(denominator) * math.sqrt(TRADING_DAYS), ""


# ---------------------------------------------------------------------------------------------
# finalization (host, O(P) + the trade list)
# ---------------------------------------------------------------------------------------------
@dataclass
class Metrics:
    """values[name]: float64 [P]; reasons[name]: list of P strings ('' where the value is a number)."""

    values: dict
    reasons: dict

    @property
    def n_policies(self) -> int:
        return len(next(iter(self.values.values())))

    def policy(self, p: int = 0) -> tuple[dict, dict]:
        """(name -> float, name -> reason) of one policy; reasons only for NaN values."""
        vals = {k: float(v[p]) for k, v in self.values.items()}
        why = {k: r[p] for k, r in self.reasons.items() if r[p]}
        return vals, why

    def to_frame(self):
        import pandas as pd

        frame = pd.DataFrame({k: v for k, v in self.values.items()})
        frame.index.name = "policy"
        return frame


def _ratio(num, den, reason_if_zero, rms=None):
    """num / den, NaN with a reason when den is 0 (or at rounding level of `rms`)."""
    if not math.isfinite(num) or not math.isfinite(den):
        return math.nan, "not finite (overflow)"
    if den == 0.0 or (rms is not None and _rounding_level(den, rms)):
        return math.nan, reason_if_zero
    return num / den, ""


def _bad_count(what: str, count: float, of: int, first: float | None = None) -> str:
    where = f" (first at bar {int(first)})" if first is not None and first >= 0 else ""
    return f"{what} is NaN or inf in {int(count)} of {of}{where}"


def finalize(acc: np.ndarray, trades, bars_per_day: float, initial_capital: float, pnl=None) -> Metrics:
    """Metrics from scan accumulators [N_ACC, P] and the trade list (DataFrame with columns
    policy, entry_bar, exit_bar, size, pnl; None = no trades).

    pnl: the per-bar P&L [P, T] (or [T]) the accumulators were folded from, for `sharpe_adj`
    (it needs autocorrelations, which the scan does not keep); None leaves it NaN with a reason.
    """
    acc = np.asarray(acc, np.float64)
    n_pol = acc.shape[1]
    if not math.isfinite(float(bars_per_day)) or float(bars_per_day) <= 0:
        raise ValueError(f"bars_per_day = {bars_per_day!r} is invalid: allowed a finite number > 0 (the cache's meta.json value)")
    if pnl is not None:
        pnl = np.asarray(pnl, np.float64)
        pnl = pnl[None, :] if pnl.ndim == 1 else pnl
        if pnl.shape[0] != n_pol:
            raise ValueError(f"pnl has {pnl.shape[0]} policies, the accumulators {n_pol}")
    ann = float(bars_per_day) * TRADING_DAYS
    values = {name: np.full(n_pol, np.nan) for name in METRIC_NAMES}
    reasons = {name: [""] * n_pol for name in METRIC_NAMES}

    def put(name, p, value, reason=""):
        values[name][p] = value
        if not math.isfinite(value):
            reasons[name][p] = reason or "not finite (overflow)"

    by_policy = {}
    if trades is not None and len(trades):
        for p, group in trades.groupby("policy", sort=True):
            by_policy[int(p)] = group

    for p in range(n_pol):
        n = acc[A_N, p]
        equity = acc[A_EQUITY, p]
        ruined = acc[A_RUIN, p] > 0 or equity <= 0
        why_ruin = "equity fell to zero or below (returns undefined)"
        days = n / float(bars_per_day)
        if n < 1:
            for name in PNL_METRICS + ("exposure", "turnover", "trades_per_day"):
                put(name, p, math.nan, "no bars")
        elif acc[A_BAD_PNL, p] > 0:
            why = _bad_count("bar P&L", acc[A_BAD_PNL, p], int(n), acc[A_FIRST_BAD_PNL, p]) + " bars"
            for name in PNL_METRICS:
                put(name, p, math.nan, why)
        else:
            put("total_return", p, equity / initial_capital - 1.0)
            put("max_drawdown", p, acc[A_MAX_DD, p])
            if ruined:
                for name in ("sharpe", "sortino", "daily_sharpe", "sharpe_adj", "calmar"):
                    put(name, p, math.nan, why_ruin)
            else:
                # per-bar Sharpe and Sortino
                mean = acc[A_MEAN, p]
                rms = math.hypot(mean, math.sqrt(acc[A_M2, p] / n))
                if n < 2:
                    put("sharpe", p, math.nan, "fewer than 2 bars")
                else:
                    std = math.sqrt(acc[A_M2, p] / (n - 1.0))
                    v, why = _ratio(mean, std, "zero variance of bar returns (std at rounding level)", rms)
                    put("sharpe", p, v * math.sqrt(ann) if why == "" else math.nan, why)
                downside = math.sqrt(acc[A_DOWN, p] / n)
                v, why = _ratio(mean, downside, "no negative bar returns (zero downside deviation)", rms)
                put("sortino", p, v * math.sqrt(ann) if why == "" else math.nan, why)
                # per-session returns: the open session closes at the end of the data
                ns, s_mean, s_m2 = acc[A_N_SESSIONS, p], acc[A_SESSION_MEAN, p], acc[A_SESSION_M2, p]
                if acc[A_SESSION, p] >= 0 and acc[A_SESSION_START, p] > 0:
                    ns, s_mean, s_m2 = _welford(ns, s_mean, s_m2, equity / acc[A_SESSION_START, p] - 1.0)
                if ns < 2:
                    put("daily_sharpe", p, math.nan, "fewer than 2 sessions")
                else:
                    s_rms = math.hypot(s_mean, math.sqrt(s_m2 / ns))
                    v, why = _ratio(s_mean, math.sqrt(s_m2 / (ns - 1.0)), "zero variance of session returns (std at rounding level)", s_rms)
                    put("daily_sharpe", p, v * math.sqrt(TRADING_DAYS) if why == "" else math.nan, why)
                # autocorrelation-adjusted Sharpe: host only, from the per-bar P&L
                if pnl is None:
                    put("sharpe_adj", p, math.nan, "needs the per-bar P&L (autocorrelations): finalize(..., pnl=)")
                else:
                    v, why = lo_adjusted_sharpe(bar_returns(pnl[p], initial_capital), bars_per_day)
                    put("sharpe_adj", p, v, why)
                # Calmar: compounds the window's return to a year
                mdd = acc[A_MAX_DD, p]
                if days < MIN_ANNUALIZE_DAYS:
                    put("calmar", p, math.nan, f"window of {days:.3g} trading days is shorter than {MIN_ANNUALIZE_DAYS} (too short to annualize)")
                elif mdd >= 0.0:
                    put("calmar", p, math.nan, "no drawdown")
                else:
                    years = n / ann
                    with np.errstate(over="ignore", invalid="ignore"):
                        cagr = float(np.power(equity / initial_capital, 1.0 / years) - 1.0)
                    if not math.isfinite(cagr):
                        put("calmar", p, math.nan, "annualized return overflows")
                    else:
                        put("calmar", p, cagr / abs(mdd))
        if n >= 1:
            if acc[A_BAD_POSITION, p] > 0:
                put("exposure", p, math.nan, _bad_count("position", acc[A_BAD_POSITION, p], int(n)) + " bars")
            else:
                put("exposure", p, acc[A_EXPOSED, p] / n)
        # trade statistics
        group = by_policy.get(p)
        n_tr = 0 if group is None else len(group)
        values["n_trades"][p] = n_tr
        if n > 0:
            put("trades_per_day", p, n_tr / days)
            sizes = np.zeros(0) if group is None else np.abs(group["size"].to_numpy(np.float64))
            if not np.all(np.isfinite(sizes)):
                put("turnover", p, math.nan, _bad_count("trade size", np.sum(~np.isfinite(sizes)), n_tr) + " trades")
            else:
                put("turnover", p, 2.0 * float(sizes.sum()) / n)
        if n_tr == 0:
            for name in TRADE_PNL_METRICS + ("avg_hold",):
                put(name, p, math.nan, "no trades")
            continue
        hold = group["exit_bar"].to_numpy(np.float64) - group["entry_bar"].to_numpy(np.float64)
        if np.all(np.isfinite(hold)):
            put("avg_hold", p, float(np.mean(hold)))
        else:
            put("avg_hold", p, math.nan, _bad_count("trade entry/exit bar", np.sum(~np.isfinite(hold)), n_tr) + " trades")
        trade_pnl = group["pnl"].to_numpy(np.float64)
        n_bad = int(np.sum(~np.isfinite(trade_pnl)))
        if n_bad:  # neither a win nor a loss: every trade statistic is unknown
            for name in TRADE_PNL_METRICS:
                put(name, p, math.nan, _bad_count("trade P&L", n_bad, n_tr) + " trades")
            continue
        put("win_rate", p, float(np.mean(trade_pnl > 0)))
        put("avg_trade", p, float(np.mean(trade_pnl)))
        gross_win = float(trade_pnl[trade_pnl > 0].sum())
        gross_loss = float(-trade_pnl[trade_pnl < 0].sum())
        v, why = _ratio(gross_win, gross_loss, "no losing trades")
        put("profit_factor", p, v, why)
        if n_tr < 2:
            put("trade_sharpe", p, math.nan, "fewer than 2 trades")
        else:
            with np.errstate(over="ignore", invalid="ignore"):
                std = float(np.std(trade_pnl, ddof=1))
            v, why = _ratio(float(np.mean(trade_pnl)), std, "zero variance of trade P&L (std at rounding level)", _rms(trade_pnl))
            put("trade_sharpe", p, v, why)
    return Metrics(values, reasons)


def compute_metrics(pnl, position, session_id, trades, bars_per_day: float, initial_capital: float) -> Metrics:
    """Metrics of host arrays pnl [P, T] (or [T]) float64 currency, position [P, T], session_id [T].

    The pass over bars runs the same scan as the device (CPU @njit loop, one policy at a time);
    a device backtest calls launch_scan on its own device buffers instead. `sharpe_adj` comes
    from `pnl` on the host (see finalize).
    """
    pnl = np.asarray(pnl, np.float64)
    position = np.asarray(position)
    if pnl.ndim == 1:
        pnl, position = pnl[None, :], position[None, :]
    if pnl.shape != position.shape:
        raise ValueError(f"pnl {pnl.shape} and position {position.shape} must have the same shape [P, T]")
    session_id = np.ascontiguousarray(session_id, np.int32)
    if session_id.shape != (pnl.shape[1],):
        raise ValueError(f"session_id must have {pnl.shape[1]} entries (one per bar), got {session_id.shape}")
    if not math.isfinite(initial_capital) or initial_capital <= 0:
        raise ValueError(f"initial_capital = {initial_capital!r} is invalid: allowed a finite number > 0")
    acc = np.empty((N_ACC, pnl.shape[0]), np.float64)
    for p in range(pnl.shape[0]):
        init_row(acc, p, np.float64(initial_capital))
    scan_ref(acc, np.ascontiguousarray(pnl.T), np.ascontiguousarray(position.T), session_id, 0, pnl.shape[1])
    return finalize(acc, trades, bars_per_day, initial_capital, pnl=pnl)
