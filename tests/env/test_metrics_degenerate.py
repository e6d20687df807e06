"""Metrics on bad and degenerate input (issue 19): NaN/inf give NaN with the true reason, a variance
at rounding level is zero, Calmar needs 20 trading days, and the autocorrelation-adjusted Sharpe
(Lo 2002) against references written here with plain numpy; the device scan and the host path
give the same metrics, bad input included."""

import math

import numpy as np
import pandas as pd
import pytest

from numbarl.cuda.runtime import cuda
from numbarl.env import metrics as M

CAPITAL = 100_000.0


def trades_of(pnl, size=1.0):
    n = len(pnl)
    return pd.DataFrame({"policy": 0, "entry_bar": np.arange(n) * 2, "exit_bar": np.arange(n) * 2 + 1,
                         "size": size, "pnl": np.asarray(pnl, np.float64)})


def lo_reference(r, q):
    """Lo (2002) eq. for SR_q, q = bars per day, lags 1..ceil(q)-1 written out one by one; x sqrt(252)."""
    d = r - r.mean()
    total = 0.0
    for k in range(1, math.ceil(q)):
        total += (q - k) * np.dot(d[k:], d[:-k]) / np.dot(d, d)
    return r.mean() / r.std(ddof=1) * q / math.sqrt(q + 2 * total) * math.sqrt(252)


def returns_of(pnl, capital=CAPITAL):
    equity = capital + np.cumsum(pnl)
    return pnl / np.concatenate([[capital], equity[:-1]])


# --------------------------------------------------------------------------------------------
# NaN / inf input
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_bar_pnl_gives_nan_and_names_it_on_every_pnl_metric(rng, bad):
    pnl = rng.normal(5.0, 50.0, 300)
    pnl[17] = bad
    pnl[40] = bad
    session = np.repeat(np.arange(30), 10)
    position = np.ones(300, np.float32)
    m = M.compute_metrics(pnl, position, session, trades_of([3.0, -1.0]), 10.0, CAPITAL)
    values, reasons = m.policy(0)
    for name in M.PNL_METRICS:  # max_drawdown included (it stayed finite before)
        assert math.isnan(values[name]), name
        assert "bar P&L is NaN or inf in 2 of 300" in reasons[name] and "first at bar 17" in reasons[name], reasons[name]
        assert "equity fell" not in reasons[name]
    # what does not depend on the bar P&L is still computed
    assert values["exposure"] == 1.0 and values["n_trades"] == 2 and values["win_rate"] == 0.5


def test_ruin_keeps_its_own_reason():
    m = M.compute_metrics(np.array([10.0, -200.0, 5.0, 1.0]), np.zeros(4), np.array([0, 0, 1, 1]), None, 1.0, 100.0)
    assert "equity fell to zero" in m.policy(0)[1]["sharpe"]


def test_non_finite_trade_pnl_is_neither_win_nor_loss():
    m = M.compute_metrics(np.zeros(10), np.zeros(10), np.zeros(10), trades_of([4.0, np.nan, 2.0]), 10.0, CAPITAL)
    values, reasons = m.policy(0)
    for name in ("win_rate", "profit_factor", "avg_trade", "trade_sharpe"):
        assert math.isnan(values[name]) and "trade P&L is NaN or inf in 1 of 3 trades" in reasons[name], (name, reasons)
    assert "no losing trades" not in reasons["profit_factor"]
    assert values["n_trades"] == 3 and values["avg_hold"] == 1.0


def test_non_finite_position_and_trade_size():
    position = np.ones(10, np.float32)
    position[3] = np.nan
    m = M.compute_metrics(np.zeros(10), position, np.zeros(10), trades_of([1.0, -1.0], size=[1.0, np.inf]), 10.0, CAPITAL)
    values, reasons = m.policy(0)
    assert math.isnan(values["exposure"]) and "position is NaN or inf in 1 of 10" in reasons["exposure"]
    assert math.isnan(values["turnover"]) and "trade size is NaN or inf in 1 of 2" in reasons["turnover"]


def test_invalid_bars_per_day_is_a_clear_error():
    with pytest.raises(ValueError, match="bars_per_day"):
        M.compute_metrics(np.zeros(5), np.zeros(5), np.zeros(5), None, float("nan"), 1.0)


# --------------------------------------------------------------------------------------------
# variance at rounding level
# --------------------------------------------------------------------------------------------
def test_constant_return_series_has_undefined_sharpes():
    # equity grows 0.1 % a bar: every bar return is 0.001 up to float64 rounding
    n, bpd = 400, 10.0
    equity = CAPITAL * 1.001 ** np.arange(n + 1)
    pnl = np.diff(equity)
    session = np.repeat(np.arange(40), 10)
    r = returns_of(pnl)
    daily = pd.Series(1 + r).groupby(session).prod().to_numpy() - 1
    # independent check that this is the degenerate case: std is rounding noise, so the plain
    # formulas give absurd numbers (what numbarl reported before)
    assert 0 < r.std(ddof=1) < 1e-8 * np.sqrt(np.mean(r * r))
    assert r.mean() / r.std(ddof=1) * np.sqrt(bpd * 252) > 1e9
    assert daily.std(ddof=1) < 1e-8 * np.sqrt(np.mean(daily * daily))
    m = M.compute_metrics(pnl, np.ones(n), session, trades_of([2.0, 2.0 + 1e-13]), bpd, CAPITAL)
    values, reasons = m.policy(0)
    for name, why in (("sharpe", "zero variance of bar returns"), ("daily_sharpe", "zero variance of session returns"),
                      ("sharpe_adj", "zero variance of bar returns"), ("trade_sharpe", "zero variance of trade P&L")):
        assert math.isnan(values[name]) and why in reasons[name] and "rounding" in reasons[name], (name, values[name], reasons)
    assert values["total_return"] == pytest.approx(1.001**n - 1, rel=1e-12)
    assert "no negative bar returns" in reasons["sortino"]


def test_small_but_real_variance_is_kept(rng):
    # std / RMS = 1e-6: far above rounding, a real (if absurdly good) Sharpe
    n, bpd = 400, 10.0
    r = 0.001 * (1 + 1e-6 * rng.standard_normal(n))
    pnl = np.empty(n)
    equity = CAPITAL
    for t in range(n):
        pnl[t] = r[t] * equity
        equity += pnl[t]
    m = M.compute_metrics(pnl, np.ones(n), np.repeat(np.arange(40), 10), None, bpd, CAPITAL)
    got = returns_of(pnl)
    assert m.policy(0)[0]["sharpe"] == pytest.approx(got.mean() / got.std(ddof=1) * np.sqrt(bpd * 252), rel=1e-6)


# --------------------------------------------------------------------------------------------
# annualization needs 20 trading days
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_bars,defined", [(190, False), (200, True)])
def test_calmar_needs_twenty_trading_days(rng, n_bars, defined):
    bpd = 10.0
    pnl = rng.normal(20.0, 300.0, n_bars)
    m = M.compute_metrics(pnl, np.ones(n_bars), np.arange(n_bars) // 10, None, bpd, CAPITAL)
    values, reasons = m.policy(0)
    equity = np.concatenate([[CAPITAL], CAPITAL + np.cumsum(pnl)])
    mdd = np.min(equity / np.maximum.accumulate(equity) - 1)
    if defined:
        cagr = (equity[-1] / CAPITAL) ** (252 * bpd / n_bars) - 1
        assert values["calmar"] == pytest.approx(cagr / abs(mdd), rel=1e-9)
    else:
        assert math.isnan(values["calmar"]) and "19 trading days is shorter than 20" in reasons["calmar"]
    assert values["max_drawdown"] == pytest.approx(mdd, rel=1e-12)
    assert math.isfinite(values["sharpe"])  # sqrt-scaled ratios are units, defined on short windows


# --------------------------------------------------------------------------------------------
# the autocorrelation-adjusted Sharpe (Lo 2002)
# --------------------------------------------------------------------------------------------
def ar1_pnl(rng, n, phi, mean=3.0, sd=40.0):
    e = rng.standard_normal(n)
    x = np.empty(n)
    x[0] = e[0]
    for t in range(1, n):
        x[t] = phi * x[t - 1] + math.sqrt(1 - phi * phi) * e[t]
    return mean + sd * x


@pytest.mark.parametrize("bpd", [8.0, 12.5])
def test_sharpe_adj_matches_lo_formula_written_out(rng, bpd):
    n = 600
    pnl = ar1_pnl(rng, n, 0.4, mean=12.0)
    m = M.compute_metrics(pnl, np.ones(n), (np.arange(n) // bpd).astype(int), None, bpd, CAPITAL)
    got = m.policy(0)[0]
    assert got["sharpe_adj"] == pytest.approx(lo_reference(returns_of(pnl), bpd), rel=1e-9)
    # positive autocorrelation: the plain per-bar annualization overstates
    assert abs(got["sharpe_adj"]) < abs(got["sharpe"]) and got["sharpe_adj"] * got["sharpe"] > 0


def test_sharpe_adj_recovers_lo_population_value_for_ar1(rng):
    # AR(1) bar returns with autocorrelation phi: Lo's eq. 16 gives SR_q / (sqrt(q) SR) exactly
    q, phi, n = 20.0, 0.5, 200_000
    pnl = ar1_pnl(rng, n, phi, mean=2.0, sd=20.0)
    m = M.compute_metrics(pnl, np.ones(n), (np.arange(n) // q).astype(int), None, q, 1e9)  # huge capital: r ~ pnl
    got = m.policy(0)[0]
    eta = q / math.sqrt(q + 2 * phi / (1 - phi) ** 2 * ((q - 1) * (1 - phi) - phi * (1 - phi ** (q - 1))))
    assert got["sharpe_adj"] / got["sharpe"] == pytest.approx(eta / math.sqrt(q), rel=0.03)


def test_sharpe_adj_undefined_cases():
    flat = M.compute_metrics(np.zeros(40), np.zeros(40), np.arange(40) // 10, None, 10.0, CAPITAL)
    assert "zero variance" in flat.policy(0)[1]["sharpe_adj"]
    short = M.compute_metrics(np.arange(15.0), np.zeros(15), np.arange(15) // 10, None, 10.0, CAPITAL)
    assert "fewer than 2 sessions of bars" in short.policy(0)[1]["sharpe_adj"]


# --------------------------------------------------------------------------------------------
# the device scan and the host path give the same metrics
# --------------------------------------------------------------------------------------------
def test_device_scan_and_host_path_agree_on_every_metric_bad_input_included(rng):
    c = cuda()
    n_pol, n_bars, bpd = 3, 60, 3.0  # 20 trading days: Calmar defined
    pnl = rng.normal(4.0, 80.0, (n_pol, n_bars))
    pnl[1, 7] = np.nan  # policy 1: a NaN bar
    pos = rng.choice([-1.0, 0.0, 1.0], (n_pol, n_bars)).astype(np.float32)
    session = (np.arange(n_bars) // 3).astype(np.int32)
    trades = pd.concat([trades_of([5.0, -3.0, 1.0]).assign(policy=p) for p in range(n_pol)], ignore_index=True)
    host = M.compute_metrics(pnl, pos, session, trades, bpd, CAPITAL)
    stream = c.stream()
    acc = c.to_device(np.zeros((M.N_ACC, n_pol)))
    M.launch_init(acc, CAPITAL, stream)
    origin, n_rows = c.to_device(np.zeros(1, np.int64)), c.to_device(np.array([n_bars], np.int64))
    M.launch_scan(acc, c.to_device(np.ascontiguousarray(pnl.T)), c.to_device(np.ascontiguousarray(pos.T)),
                  c.to_device(session), origin, n_rows, stream)
    device = M.finalize(acc.copy_to_host(), trades, bpd, CAPITAL, pnl=pnl)
    for p in range(n_pol):
        hv, hr = host.policy(p)
        dv, dr = device.policy(p)
        assert hr == dr
        for name in M.METRIC_NAMES:
            assert (math.isnan(hv[name]) and math.isnan(dv[name])) or hv[name] == pytest.approx(dv[name], rel=1e-12, abs=1e-15), name
    assert math.isfinite(host.policy(0)[0]["sharpe_adj"]) and math.isfinite(host.policy(0)[0]["calmar"])
    assert "bar P&L is NaN" in host.policy(1)[1]["sharpe_adj"]
    # from the accumulators alone, sharpe_adj says what it needs
    assert "per-bar P&L" in M.finalize(acc.copy_to_host(), trades, bpd, CAPITAL).policy(0)[1]["sharpe_adj"]
