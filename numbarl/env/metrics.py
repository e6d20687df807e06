"""Performance metrics: one implementation for training episodes, validation and test (SPEC §4).

Inputs: per-bar P&L (currency) and positions for P policies, the bars' session ids, the trade
list, bars_per_day and the initial capital. Conventions follow empyrical:

    equity_t = capital + sum_{s<=t} pnl_s,     r_t = pnl_t / equity_{t-1}    (so equity_t / capital
                                                                            = prod (1 + r_s))
    total_return   equity_T / capital - 1                                   (cum_returns_final)
    sharpe         mean(r) / std(r, ddof=1) * sqrt(bars_per_day * 252)     (sharpe_ratio)
    daily_sharpe   same over per-session returns, * sqrt(252)
    trade_sharpe   mean / std(ddof=1) of trade P&L, not annualized
    sortino        mean(r) / sqrt(mean(min(r, 0)^2)) * sqrt(ann)            (downside over ALL bars)
    max_drawdown   min_t (equity_t / max(capital, equity_<=t) - 1)  <= 0    (max_drawdown)
    calmar         cagr / |max_drawdown|, cagr = (equity_T / capital)^(1 / years) - 1,
                   years = bars / (bars_per_day * 252)                      (calmar_ratio)
    win_rate, profit_factor (gross win / gross loss), avg_trade, n_trades, trades_per_day
    (trades per bars_per_day bars), avg_hold (bars), exposure (fraction of bars with a
    position), turnover (contracts traded per bar, entries + exits).

Degenerate cases give NaN plus a reason string (never a crash, never a fake number).

The heavy part, a pass over P x T bars, is `scan_row`: one sequential, fixed-order pass per
policy (Welford for the variances) updating float64 accumulators, so it is deterministic and
streams over chunks of bars. The kernel runs one thread per policy on time-major [T, P] arrays
(coalesced); the CPU path loops the same row function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from numbarl.cuda.launch import device_function
from numbarl.cuda.runtime import cuda
from numbarl.env.core import row_jit

_cuda = cuda()

TRADING_DAYS = 252
BLOCK = 32  # one warp per block: the per-policy scans spread over as many SMs as possible

METRIC_NAMES = (
    "total_return",
    "sharpe",
    "daily_sharpe",
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

# accumulator rows ([N_ACC, P] float64)
A_EQUITY, A_PEAK, A_MAX_DD, A_N, A_MEAN, A_M2, A_DOWN, A_EXPOSED = 0, 1, 2, 3, 4, 5, 6, 7
A_SESSION, A_SESSION_START, A_N_SESSIONS, A_SESSION_MEAN, A_SESSION_M2, A_RUIN = 8, 9, 10, 11, 12, 13
N_ACC = 14
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


@njit(cache=True)
def _welford(n, mean, m2, x):
    n = n + _ONE
    d = x - mean
    mean = mean + d / n
    m2 = m2 + d * (x - mean)
    return n, mean, m2


@row_jit
def scan_row(acc, p, pnl, position, session_id, origin, n_rows):
    """Fold bars origin + t (t < n_rows) of policy p: pnl[t, p], position[t, p] (time-major)."""
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
    for t in range(n_rows):
        sid = np.float64(session_id[origin + t])
        if sid != sess:
            if sess >= _ZERO and sess_start > _ZERO:
                ns, s_mean, s_m2 = _welford(ns, s_mean, s_m2, equity / sess_start - _ONE)
            sess = sid
            sess_start = equity
        x = np.float64(pnl[t, p])
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
        if position[t, p] != 0:
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


def _ratio(num, den, reason_if_zero):
    if not math.isfinite(num) or not math.isfinite(den):
        return math.nan, "not finite"
    if den == 0.0:
        return math.nan, reason_if_zero
    return num / den, ""


def finalize(acc: np.ndarray, trades, bars_per_day: float, initial_capital: float) -> Metrics:
    """Metrics from scan accumulators [N_ACC, P] and the trade list (DataFrame with columns
    policy, entry_bar, exit_bar, size, pnl; None = no trades)."""
    acc = np.asarray(acc, np.float64)
    n_pol = acc.shape[1]
    ann = float(bars_per_day) * TRADING_DAYS
    values = {name: np.full(n_pol, np.nan) for name in METRIC_NAMES}
    reasons = {name: [""] * n_pol for name in METRIC_NAMES}

    def put(name, p, value, reason=""):
        values[name][p] = value
        if not math.isfinite(value):
            reasons[name][p] = reason or "not finite"

    by_policy = {}
    if trades is not None and len(trades):
        for p, group in trades.groupby("policy", sort=True):
            by_policy[int(p)] = group

    for p in range(n_pol):
        n = acc[A_N, p]
        equity = acc[A_EQUITY, p]
        ruined = acc[A_RUIN, p] > 0 or equity <= 0
        why_ruin = "equity fell to zero or below (returns undefined)"
        if n < 1:
            for name in ("total_return", "sharpe", "daily_sharpe", "sortino", "max_drawdown", "calmar", "exposure", "turnover", "trades_per_day"):
                put(name, p, math.nan, "no bars")
        else:
            put("total_return", p, equity / initial_capital - 1.0)
            put("max_drawdown", p, acc[A_MAX_DD, p])
            put("exposure", p, acc[A_EXPOSED, p] / n)
            # per-bar Sharpe and Sortino
            if ruined:
                for name in ("sharpe", "sortino", "daily_sharpe", "calmar"):
                    put(name, p, math.nan, why_ruin)
            else:
                if n < 2:
                    put("sharpe", p, math.nan, "fewer than 2 bars")
                else:
                    std = math.sqrt(acc[A_M2, p] / (n - 1.0))
                    v, why = _ratio(acc[A_MEAN, p], std, "zero variance of bar returns")
                    put("sharpe", p, v * math.sqrt(ann) if why == "" else math.nan, why)
                downside = math.sqrt(acc[A_DOWN, p] / n)
                v, why = _ratio(acc[A_MEAN, p], downside, "no negative bar returns (zero downside deviation)")
                put("sortino", p, v * math.sqrt(ann) if why == "" else math.nan, why)
                # per-session returns: the open session closes at the end of the data
                ns, s_mean, s_m2 = acc[A_N_SESSIONS, p], acc[A_SESSION_MEAN, p], acc[A_SESSION_M2, p]
                if acc[A_SESSION, p] >= 0 and acc[A_SESSION_START, p] > 0:
                    x = equity / acc[A_SESSION_START, p] - 1.0
                    ns += 1.0
                    d = x - s_mean
                    s_mean += d / ns
                    s_m2 += d * (x - s_mean)
                if ns < 2:
                    put("daily_sharpe", p, math.nan, "fewer than 2 sessions")
                else:
                    v, why = _ratio(s_mean, math.sqrt(s_m2 / (ns - 1.0)), "zero variance of session returns")
                    put("daily_sharpe", p, v * math.sqrt(TRADING_DAYS) if why == "" else math.nan, why)
                # Calmar
                mdd = acc[A_MAX_DD, p]
                if mdd >= 0.0:
                    put("calmar", p, math.nan, "no drawdown")
                else:
                    years = n / ann
                    with np.errstate(over="ignore", invalid="ignore"):
                        cagr = float(np.power(equity / initial_capital, 1.0 / years) - 1.0)
                    if not math.isfinite(cagr):
                        put("calmar", p, math.nan, "annualized return overflows (window too short)")
                    else:
                        put("calmar", p, cagr / abs(mdd))
        # trade statistics
        group = by_policy.get(p)
        n_tr = 0 if group is None else len(group)
        values["n_trades"][p] = n_tr
        days = n / float(bars_per_day) if n > 0 else 0.0
        if n > 0:
            put("trades_per_day", p, n_tr / days)
            size_col = 0.0 if group is None else float(np.abs(group["size"].to_numpy(np.float64)).sum())
            put("turnover", p, 2.0 * size_col / n)
        if n_tr == 0:
            for name in ("win_rate", "profit_factor", "avg_trade", "trade_sharpe", "avg_hold"):
                put(name, p, math.nan, "no trades")
            continue
        pnl = group["pnl"].to_numpy(np.float64)
        hold = (group["exit_bar"].to_numpy(np.int64) - group["entry_bar"].to_numpy(np.int64)).astype(np.float64)
        put("win_rate", p, float(np.mean(pnl > 0)))
        put("avg_trade", p, float(np.mean(pnl)))
        put("avg_hold", p, float(np.mean(hold)))
        gross_win = float(pnl[pnl > 0].sum())
        gross_loss = float(-pnl[pnl < 0].sum())
        v, why = _ratio(gross_win, gross_loss, "no losing trades")
        put("profit_factor", p, v, why)
        if n_tr < 2:
            put("trade_sharpe", p, math.nan, "fewer than 2 trades")
        else:
            v, why = _ratio(float(np.mean(pnl)), float(np.std(pnl, ddof=1)), "zero variance of trade P&L")
            put("trade_sharpe", p, v, why)
    return Metrics(values, reasons)


def compute_metrics(pnl, position, session_id, trades, bars_per_day: float, initial_capital: float) -> Metrics:
    """Metrics of host arrays pnl [P, T] (or [T]) float64 currency, position [P, T], session_id [T].

    The pass over bars runs the same scan as the device (CPU @njit loop, one policy at a time);
    a device backtest calls launch_scan on its own device buffers instead.
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
    return finalize(acc, trades, bars_per_day, initial_capital)
