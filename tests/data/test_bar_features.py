"""Feature registry and the causal building blocks against pandas / plain-Python references."""

import numpy as np
import pandas as pd
import pytest

from numbarl.data import synth
from numbarl.data.bars import BarParams, build_bars
from numbarl.data.errors import DataError
from numbarl.data.features import (
    DEFAULT_FEATURES, REGISTRY, FeatureInputs, FeatureParams, bars_in_window, compute_features, ema,
    lag_log_return, resolve_features, rolling_max, rolling_min, rolling_sum, rolling_zscore, wilder_adx,
)  # fmt: skip


@pytest.fixture(scope="module")
def bars(small_market):
    return build_bars(small_market[0], BarParams(mode="ewma", ewma_initial_trades=30, ewma_span_trades=200))


def test_registry_and_resolution():
    assert len(DEFAULT_FEATURES) == 64 and len(set(DEFAULT_FEATURES)) == 64
    assert all(name in REGISTRY for name in DEFAULT_FEATURES)
    assert resolve_features(None) == list(DEFAULT_FEATURES)
    assert resolve_features(" ret_1, ofi_3 ,qi_1") == ["ret_1", "ofi_3", "qi_1"]
    assert resolve_features("default,theta_norm")[-1] == "theta_norm"
    with pytest.raises(DataError, match="unknown feature 'ofi_11'; known features: ret_1, ret_2"):
        resolve_features("ret_1,ofi_11")
    with pytest.raises(DataError, match="listed twice"):
        resolve_features(["ret_1", "ret_1"])
    with pytest.raises(DataError, match="empty"):
        resolve_features(" , ")


def test_rolling_zscore_matches_pandas(rng):
    x = rng.normal(3.0, 2.0, size=517)
    x[rng.choice(517, 40, replace=False)] = np.nan
    w, min_periods, clip = 37, 5, 2.5
    got = rolling_zscore(x, w, min_periods, clip)
    s = pd.Series(x)
    roll = s.rolling(w, min_periods=min_periods)
    want = ((s - roll.mean()) / roll.std(ddof=0)).clip(-clip, clip).fillna(0.0).to_numpy()
    np.testing.assert_allclose(got, want, atol=1e-9, rtol=1e-9)
    assert np.all(rolling_zscore(np.full(50, 4.0), 10, 2, 5.0) == 0.0)  # no spread: 0


def test_window_helpers_match_pandas(rng):
    x = rng.lognormal(0.0, 0.1, size=301)
    s = pd.Series(x)
    np.testing.assert_allclose(lag_log_return(x, 7), np.log(s / s.shift(7)).to_numpy(), rtol=1e-12)
    np.testing.assert_allclose(rolling_sum(x, 13), s.rolling(13).sum().to_numpy(), rtol=1e-12)
    np.testing.assert_allclose(rolling_max(x, 9), s.rolling(9, min_periods=1).max().to_numpy())
    np.testing.assert_allclose(rolling_min(x, 9), s.rolling(9, min_periods=1).min().to_numpy())
    np.testing.assert_allclose(ema(x, 8.0), s.ewm(span=8, adjust=False).mean().to_numpy(), rtol=1e-12)
    ts = np.cumsum(rng.integers(1, 100, size=301)).astype(np.int64)
    want = [np.sum((ts > t - 250) & (ts <= t)) for t in ts]
    np.testing.assert_array_equal(bars_in_window(ts, 250), want)


def adx_ref(high, low, close, period=14):
    """Wilder's ADX written out (Wilder 1978, New Concepts in Technical Trading Systems)."""
    a = 1.0 / period
    adx, di = [np.nan], [np.nan]
    tr_s = pdm_s = mdm_s = adx_s = None
    for t in range(1, len(high)):
        up, down = high[t] - high[t - 1], low[t - 1] - low[t]
        pdm = up if up > down and up > 0 else 0.0
        mdm = down if down > up and down > 0 else 0.0
        tr = max(high[t] - low[t], abs(high[t] - close[t - 1]), abs(low[t] - close[t - 1]))
        if tr_s is None:
            tr_s, pdm_s, mdm_s = tr, pdm, mdm
        else:
            tr_s, pdm_s, mdm_s = a * tr + (1 - a) * tr_s, a * pdm + (1 - a) * pdm_s, a * mdm + (1 - a) * mdm_s
        dip, dim = (pdm_s / tr_s, mdm_s / tr_s) if tr_s > 0 else (0.0, 0.0)
        dx = abs(dip - dim) / (dip + dim) if dip + dim > 0 else 0.0
        adx_s = dx if adx_s is None else a * dx + (1 - a) * adx_s
        adx.append(adx_s)
        di.append(dip - dim)
    return np.array(adx), np.array(di)


def test_adx_matches_reference(rng):
    close = 100 + np.cumsum(rng.normal(0, 1, 203))
    high = close + rng.uniform(0, 1, 203)
    low = close - rng.uniform(0, 1, 203)
    got_adx, got_di = wilder_adx(high, low, close, 14.0)
    want_adx, want_di = adx_ref(high, low, close)
    np.testing.assert_allclose(got_adx, want_adx, rtol=1e-12)
    np.testing.assert_allclose(got_di, want_di, rtol=1e-12)


def test_features_shape_bounds_and_hand_values(bars):
    features = compute_features(bars, tick_size=synth.TICK_SIZE)
    assert features.dtype == np.float32 and features.shape == (len(bars), 64)
    assert np.isfinite(features).all()
    names = list(DEFAULT_FEATURES)
    params = FeatureParams()
    for j, name in enumerate(names):
        if REGISTRY[name].normalize:
            assert np.abs(features[:, j]).max() <= params.clip
        else:
            assert np.abs(features[:, j]).max() <= 1.0 + 1e-6, name
    col = names.index("qi_1")
    b, a = bars["bid_sz"][:, 0].astype(float), bars["ask_sz"][:, 0].astype(float)
    np.testing.assert_allclose(features[:, col], (b - a) / (b + a), rtol=1e-6)
    inputs = FeatureInputs(bars, synth.TICK_SIZE)
    np.testing.assert_allclose(REGISTRY["spread_ticks"].compute(inputs), bars["spread"] / 0.25)
    tos = REGISTRY["tos_frac"].compute(inputs)
    assert np.all((tos >= 0) & (tos <= 1)) and np.all(np.diff(tos)[np.diff(bars["trade_date"]) == 0] >= 0)
    ofi1 = REGISTRY["ofi_1"].compute(inputs)
    depth = pd.Series(bars["depth_mean"][:, 0]).rolling(64, min_periods=1).mean().to_numpy()
    np.testing.assert_allclose(ofi1, bars["ofi"][:, 0] / depth, rtol=1e-12)


def test_changing_the_last_bar_changes_no_earlier_feature(bars):
    names = resolve_features("default,theta_norm,gaps,log_events,ret_128,flow_move_8,flow_move_sig_16,"
                             "trade_imb_prev,side_move_16,side_move_sig_16")
    before = compute_features(bars, names, synth.TICK_SIZE)
    changed = bars.copy()
    for field in ("mid_close", "mid_high", "mid_low", "micro_close", "volume", "spread"):
        changed[field][-1] *= 1.5
    changed["ofi"][-1] += 100.0
    after = compute_features(changed, names, synth.TICK_SIZE)
    assert after[:-1].tobytes() == before[:-1].tobytes()
    assert not np.array_equal(after[-1], before[-1])


def test_flow_move_features_by_formula(bars):
    """flow_move_k = Σ_{j<k} trade_imb_4(t-j-1) · ret_1(t-j) (the memory rule's regime estimate, synth_probe's
    memory_predictor on log returns) and flow_move_sig_k = trade_imb_4 · flow_move_k, before normalization."""
    inputs = FeatureInputs(bars, synth.TICK_SIZE)
    flow = REGISTRY["trade_imb_4"].compute(inputs)
    ret = np.r_[np.nan, np.diff(np.log(bars["mid_close"].astype(np.float64)))]
    pair = np.r_[np.nan, flow[:-1] * ret[1:]]
    want = pd.Series(pair).rolling(16, min_periods=1).sum().to_numpy().copy()
    want[:15] = np.nan
    got = REGISTRY["flow_move_16"].compute(inputs)
    np.testing.assert_allclose(got[15:], want[15:], rtol=1e-10, atol=1e-15)
    assert np.isnan(got[:15]).all()
    np.testing.assert_allclose(REGISTRY["flow_move_sig_16"].compute(FeatureInputs(bars, synth.TICK_SIZE))[15:],
                               flow[15:] * want[15:], rtol=1e-10, atol=1e-15)


def test_regime_features_by_formula(bars):
    """trade_imb_prev = trade_imb(t-1); side_move_16 = Σ_{j=1..15} sign(trade_imb(t-j)) · ret_1(t-j+1)
    (synth_probe.regime_rule's regime estimate on log returns) and side_move_sig_16 = sign(trade_imb) ·
    side_move_16, before normalization."""
    inputs = FeatureInputs(bars, synth.TICK_SIZE)
    imb = REGISTRY["trade_imb"].compute(inputs)
    prev = REGISTRY["trade_imb_prev"].compute(inputs)
    assert np.isnan(prev[0]) and np.array_equal(prev[1:], imb[:-1])
    ret = np.r_[np.nan, np.diff(np.log(bars["mid_close"].astype(np.float64)))]
    pair = np.r_[np.nan, np.sign(imb[:-1]) * ret[1:]]
    want = pd.Series(pair).rolling(15, min_periods=1).sum().to_numpy()  # bar 14: the 14 products there are
    got = REGISTRY["side_move_16"].compute(inputs)
    assert np.isnan(got[:14]).all()
    np.testing.assert_allclose(got[14:], want[14:], rtol=1e-10, atol=1e-12)  # pandas sums online: cancellation
    np.testing.assert_allclose(REGISTRY["side_move_sig_16"].compute(FeatureInputs(bars, synth.TICK_SIZE))[14:],
                               np.sign(imb[14:]) * want[14:], rtol=1e-10, atol=1e-12)


def test_bad_tick_size(bars):
    with pytest.raises(DataError, match="tick_size"):
        compute_features(bars, tick_size=0.0)
