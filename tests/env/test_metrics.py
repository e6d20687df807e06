"""Metrics vs an independent pandas implementation of the empyrical formulas, degenerate cases,
and the device scan (simulator here) vs the CPU scan."""

import math

import numpy as np
import pandas as pd
import pytest

from numbarl.cuda.runtime import cuda
from numbarl.env import metrics as M

RTOL = 1e-9


def empyrical_reference(pnl, pos, session, trades, bars_per_day, capital):
    """Written from the empyrical formulas (sharpe_ratio, sortino_ratio, max_drawdown,
    calmar_ratio, cum_returns_final) over simple returns r_t = pnl_t / equity_{t-1}."""
    equity = capital + np.cumsum(pnl)
    prev = np.concatenate([[capital], equity[:-1]])
    r = pd.Series(pnl / prev)
    ann = bars_per_day * 252
    out = {}
    out["total_return"] = float((1 + r).prod() - 1)
    out["sharpe"] = float(r.mean() / r.std(ddof=1) * np.sqrt(ann))
    daily = (1 + r).groupby(np.asarray(session)).prod() - 1
    out["daily_sharpe"] = float(daily.mean() / daily.std(ddof=1) * np.sqrt(252))
    downside = np.sqrt(np.mean(np.square(np.clip(r.to_numpy(), -np.inf, 0))) * ann)
    out["sortino"] = float(r.mean() * ann / downside)
    cum = np.concatenate([[100.0], 100.0 * np.cumprod(1 + r.to_numpy())])
    peak = np.fmax.accumulate(cum)
    out["max_drawdown"] = float(np.min((cum - peak) / peak))
    years = len(r) / ann
    cagr = (1 + out["total_return"]) ** (1 / years) - 1
    out["calmar"] = cagr / abs(out["max_drawdown"]) if len(r) / bars_per_day >= 20 else np.nan
    out["sharpe_adj"] = lo_reference(r.to_numpy(), bars_per_day)
    t = trades["pnl"].to_numpy()
    out["n_trades"] = len(t)
    out["win_rate"] = float((t > 0).mean())
    with np.errstate(divide="ignore", invalid="ignore"):  # no losing trade: inf / nan, as numbarl's reason says
        out["profit_factor"] = float(t[t > 0].sum() / -t[t < 0].sum())
    out["avg_trade"] = float(t.mean())
    out["trade_sharpe"] = float(t.mean() / t.std(ddof=1))
    out["avg_hold"] = float((trades["exit_bar"] - trades["entry_bar"]).mean())
    out["trades_per_day"] = len(t) / (len(r) / bars_per_day)
    out["exposure"] = float(np.mean(np.asarray(pos) != 0))
    out["turnover"] = float(2 * trades["size"].abs().sum() / len(r))
    return out


def lo_reference(r, q):
    """Lo (2002) q-period Sharpe, q = bars_per_day, times sqrt(252), with the sample
    autocorrelations written out lag by lag (the code under test uses an FFT)."""
    d = r - r.mean()
    lags = range(1, math.ceil(q))
    rho = [np.sum(d[k:] * d[:-k]) / np.sum(d * d) for k in lags]
    sr = r.mean() / r.std(ddof=1)
    return float(sr * q / np.sqrt(q + 2 * sum((q - k) * rho_k for k, rho_k in zip(lags, rho))) * np.sqrt(252))


def random_case(rng, n_pol=3, n_bars=200, per_session=40):
    pnl = rng.normal(2.0, 60.0, (n_pol, n_bars))
    pos = rng.choice([-1.0, 0.0, 0.0, 0.5], (n_pol, n_bars)).astype(np.float32)
    session = (np.arange(n_bars) // per_session + 5).astype(np.int32)
    rows = []
    for p in range(n_pol):
        n_tr = int(rng.integers(3, 15))
        entry = np.sort(rng.integers(0, n_bars - 10, n_tr))
        rows.append(
            pd.DataFrame(
                {
                    "policy": p,
                    "entry_bar": entry,
                    "exit_bar": entry + rng.integers(1, 10, n_tr),
                    "side": rng.choice([-1, 1], n_tr),
                    "size": rng.choice([0.25, 0.5, 1.0], n_tr),
                    "pnl": rng.normal(0, 20, n_tr),
                }
            )
        )
    return pnl, pos, session, pd.concat(rows, ignore_index=True)


def test_metrics_match_independent_empyrical_implementation(rng):
    pnl, pos, session, trades = random_case(rng)
    capital, bpd = 100_000.0, 8.0  # 25 trading days: Calmar is defined
    m = M.compute_metrics(pnl, pos, session, trades, bpd, capital)
    assert set(m.values) == set(M.METRIC_NAMES)
    for p in range(pnl.shape[0]):
        want = empyrical_reference(pnl[p], pos[p], session, trades[trades.policy == p], bpd, capital)
        got, reasons = m.policy(p)
        # a random policy can end with no losing trades: then (and only then) a ratio is NaN with a
        # reason, and the independent reference must be degenerate (NaN or inf) there too
        for name in reasons:
            assert math.isnan(got[name]) and not math.isfinite(want[name]), (name, reasons[name], want[name])
        for name in M.METRIC_NAMES:
            if name not in reasons:
                assert got[name] == pytest.approx(want[name], rel=RTOL, abs=1e-12), name


def test_hand_computed_small_case():
    # capital 100, pnl +10, -22, +11: equity 110, 88, 99; returns 0.1, -0.2, 0.125
    r = np.array([0.1, -0.2, 0.125])
    m = M.compute_metrics(np.array([10.0, -22.0, 11.0]), np.array([1, 1, 0], np.float32), np.array([0, 0, 1]), None, 1.0, 100.0)
    v, why = m.policy(0)
    assert v["total_return"] == pytest.approx(-0.01)
    assert v["max_drawdown"] == pytest.approx(88 / 110 - 1)
    assert v["sharpe"] == pytest.approx(r.mean() / r.std(ddof=1) * math.sqrt(252))
    assert v["sortino"] == pytest.approx(r.mean() / math.sqrt(0.04 / 3) * math.sqrt(252))
    daily = np.array([88 / 100 - 1, 99 / 88 - 1])
    assert v["daily_sharpe"] == pytest.approx(daily.mean() / daily.std(ddof=1) * math.sqrt(252))
    assert v["exposure"] == pytest.approx(2 / 3)
    assert v["n_trades"] == 0 and why["win_rate"] == "no trades" and why["profit_factor"] == "no trades"


@pytest.mark.parametrize(
    "case,metric,reason",
    [
        ("flat", "sharpe", "zero variance of bar returns"),
        ("flat", "sortino", "no negative bar returns"),
        ("flat", "calmar", "no drawdown"),
        ("one_bar", "sharpe", "fewer than 2 bars"),
        ("one_session", "daily_sharpe", "fewer than 2 sessions"),
        ("winners", "profit_factor", "no losing trades"),
        ("one_trade", "trade_sharpe", "fewer than 2 trades"),
        ("equal_trades", "trade_sharpe", "zero variance of trade P&L"),
        ("no_trades", "avg_hold", "no trades"),
        ("ruin", "sharpe", "equity fell to zero"),
        ("short_boom", "calmar", "overflows"),
        ("short_boom", "sharpe", "overflow"),  # not "zero variance": the squares overflow
        ("short_boom", "sharpe_adj", "overflow"),
        ("short_window", "calmar", "shorter than 20"),
    ],
)
def test_degenerate_cases_give_nan_and_a_reason(case, metric, reason):
    n = 50
    pnl = np.zeros(n)
    session = np.repeat(np.arange(5), 10)
    trades = pd.DataFrame({"policy": [0, 0], "entry_bar": [1, 5], "exit_bar": [3, 9], "size": [1.0, 1.0], "pnl": [1.0, -2.0]})
    bpd = 10.0
    if case == "flat":
        bpd = 2.0  # 25 trading days: long enough to annualize
    elif case == "one_bar":
        pnl, session = np.array([5.0]), np.array([0])
    elif case == "one_session":
        pnl = np.linspace(-1, 1, n)
        session = np.zeros(n)
    elif case == "winners":
        trades["pnl"] = [1.0, 2.0]
    elif case == "one_trade":
        trades = trades.iloc[:1]
    elif case == "equal_trades":
        trades["pnl"] = [3.0, 3.0]
    elif case == "no_trades":
        trades = trades.iloc[:0]
    elif case == "ruin":
        pnl = np.array([10.0, -200.0, 5.0, 1.0])
        session = np.array([0, 0, 1, 1])
    elif case == "short_boom":
        pnl, session, bpd = np.array([0.0, -10.0, 1e300]), np.array([0, 0, 0]), 0.1  # 30 days in 3 bars
    elif case == "short_window":
        pnl = np.linspace(-1, 1, n)  # 5 trading days of 10 bars
    m = M.compute_metrics(pnl, np.zeros(len(pnl), np.float32), session, trades, bpd, 100.0)
    values, reasons = m.policy(0)
    assert math.isnan(values[metric])
    assert reason in reasons[metric]
    assert all(math.isnan(values[k]) for k in reasons)  # a reason only where the value is NaN


def test_device_scan_chunked_equals_cpu_scan(rng):
    c = cuda()
    pnl, pos, session, _ = random_case(rng, n_pol=3, n_bars=150, per_session=23)
    capital = 50_000.0
    acc_ref = np.empty((M.N_ACC, 3))
    for p in range(3):
        M.init_row(acc_ref, p, capital)
    M.scan_ref(acc_ref, np.ascontiguousarray(pnl.T), np.ascontiguousarray(pos.T), session, 0, 150)
    stream = c.stream()
    acc = c.to_device(np.zeros((M.N_ACC, 3)))
    M.launch_init(acc, capital, stream)
    chunk = 37
    pnl_rows = c.device_array((chunk, 3), np.float64)
    pos_rows = c.device_array((chunk, 3), np.float32)
    sess = c.to_device(session)
    origin, n_rows = c.to_device(np.zeros(1, np.int64)), c.to_device(np.zeros(1, np.int64))
    for o in range(0, 150, chunk):
        rows = min(chunk, 150 - o)
        buf_p = np.zeros((chunk, 3))
        buf_q = np.zeros((chunk, 3), np.float32)
        buf_p[:rows], buf_q[:rows] = pnl.T[o : o + rows], pos.T[o : o + rows]
        pnl_rows.copy_to_device(buf_p)
        pos_rows.copy_to_device(buf_q)
        origin.copy_to_device(np.array([o], np.int64))
        n_rows.copy_to_device(np.array([rows], np.int64))
        M.launch_scan(acc, pnl_rows, pos_rows, sess, origin, n_rows, stream)
    np.testing.assert_allclose(acc.copy_to_host(), acc_ref, rtol=1e-12, atol=1e-12)


def test_input_validation():
    with pytest.raises(ValueError, match="same shape"):
        M.compute_metrics(np.zeros((2, 5)), np.zeros((2, 4)), np.zeros(5), None, 10.0, 1.0)
    with pytest.raises(ValueError, match="session_id"):
        M.compute_metrics(np.zeros(5), np.zeros(5), np.zeros(4), None, 10.0, 1.0)
    with pytest.raises(ValueError, match="initial_capital"):
        M.compute_metrics(np.zeros(5), np.zeros(5), np.zeros(5), None, 10.0, 0.0)
