"""Synthetic market: valid MBP-10 books, a learnable planted signal, a null without one."""

import time

import numpy as np
import pytest

from numbarl.data import synth
from numbarl.data.bars import bars_ref, BarParams, build_bars
from numbarl.data.errors import DataError
from numbarl.data.fxcache import load_cache
from numbarl.data.records import ACTION_TRADE, F_LAST, UNDEF_PRICE


def test_records_are_valid_books(small_market):
    records, oracle = small_market
    assert len(oracle) == len(records)
    ts = records["ts_recv"].astype(np.int64)
    assert np.all(np.diff(ts) >= 0)
    lv = records["levels"]
    tick = synth.TICK_FIXED
    assert np.all(lv["bid_px"][:, 0] < lv["ask_px"][:, 0])
    assert np.all(np.diff(lv["bid_px"], axis=1) == -tick) and np.all(np.diff(lv["ask_px"], axis=1) == tick)
    assert np.all(lv["bid_sz"] > 0) and np.all(lv["ask_sz"] > 0) and np.all(lv["bid_ct"] > 0)
    assert not np.any(lv["bid_px"] == UNDEF_PRICE)
    trades = records["action"] == ACTION_TRADE
    assert 0.15 < trades.mean() < 0.35
    assert np.all(records["flags"][trades] & F_LAST == 0)  # the book update after a trade closes the packet
    np.testing.assert_array_equal(np.flatnonzero(trades) + 1, np.flatnonzero(np.r_[False, trades[:-1]]))
    buys = trades & (records["side"] == ord("B"))
    np.testing.assert_array_equal(records["price"][buys], lv["ask_px"][buys, 0])
    assert np.all(np.abs(oracle) <= 0.5 * synth.DEFAULT_SIGNAL)


def test_deterministic_per_seed():
    a, oa = synth.generate(sessions=1, seed=4, events_per_session=2_000)
    b, ob = synth.generate(sessions=1, seed=4, events_per_session=2_000)
    c, _ = synth.generate(sessions=1, seed=5, events_per_session=2_000)
    assert a.tobytes() == b.tobytes() and np.array_equal(oa, ob)
    assert a.tobytes() != c.tobytes()
    null, oracle = synth.generate(sessions=1, seed=4, events_per_session=2_000, null=True)
    assert np.all(oracle == 0.0)
    with pytest.raises(DataError, match="signal must be in"):
        synth.generate(sessions=1, signal=1.5)


def after_cost_sharpe(position, mid, bid, ask, session_id):
    """Per-bar Sharpe of holding `position` from each close to the next, paying half the spread
    per unit of position change (entering at the ask / bid, i.e. crossing the spread)."""
    position = np.asarray(position, np.float64)
    pnl = position[:-1] * np.diff(mid) - np.abs(np.diff(np.r_[0.0, position]))[:-1] * (ask - bid)[:-1] / 2
    pnl = pnl[session_id[1:] == session_id[:-1]]
    return pnl.mean() / pnl.std()


@pytest.fixture(scope="module")
def markets(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    out = {}
    for null in (False, True):
        path = synth.build_synthetic_cache(
            root / f"null_{null}", sessions=6, seed=1, null=null, events_per_session=30_000, bars_per_day=200
        )
        out[null] = load_cache(path)
    return out


def test_oracle_policy_is_clearly_profitable_after_costs(markets):
    cache = markets[False]
    args = (np.asarray(cache.mid), np.asarray(cache.bid), np.asarray(cache.ask), np.asarray(cache.session_id))
    assert np.all(cache.ask - cache.bid >= 0.25)
    assert after_cost_sharpe(np.sign(cache.oracle), *args) > 0.25  # measured 0.44 per bar
    assert after_cost_sharpe(-np.sign(cache.oracle), *args) < -0.25
    bars = np.asarray(cache.bars)
    assert np.median(bars["n_trades"]) >= 10  # bars last long enough for moves to beat the spread


def fitted_oracle_and_policy(cache):
    """Least squares of the oracle (and of the next return) on the features, fitted on the first
    half of the bars and applied to the second half."""
    x = np.c_[np.asarray(cache.features, np.float64), np.ones(cache.n_bars)]
    half = cache.n_bars // 2
    mid = np.asarray(cache.mid)
    same = cache.session_id[1:] == cache.session_id[:-1]
    train = np.flatnonzero(same[: half - 1])
    w_ret = np.linalg.lstsq(x[train], np.diff(mid)[train], rcond=None)[0]
    position = np.sign(x @ w_ret)
    position[:half] = 0.0
    return x, half, position


def test_signal_is_learnable_from_features(markets):
    cache = markets[False]
    x, half, position = fitted_oracle_and_policy(cache)
    oracle = np.asarray(cache.oracle, np.float64)
    w = np.linalg.lstsq(x[:half], oracle[:half], rcond=None)[0]
    assert np.corrcoef(x[half:] @ w, oracle[half:])[0, 1] > 0.6  # measured 0.87
    names = cache.feature_names
    ofi16 = np.asarray(cache.features[:, names.index("ofi_total_16")], np.float64)
    next_ret = np.diff(np.asarray(cache.mid))
    same = cache.session_id[1:] == cache.session_id[:-1]
    assert np.corrcoef(ofi16[:-1][same], next_ret[same])[0, 1] > 0.2  # OFI leads the mid


def test_null_market_has_no_exploitable_signal(markets):
    cache = markets[True]
    assert np.all(cache.oracle == 0.0) and cache.meta["synthetic"]["null"]
    _, _, position = fitted_oracle_and_policy(cache)
    args = (np.asarray(cache.mid), np.asarray(cache.bid), np.asarray(cache.ask), np.asarray(cache.session_id))
    assert after_cost_sharpe(position, *args) < 0.0  # measured -0.14: sub-spread effects only
    names = cache.feature_names
    for name in ("ofi_total_16", "trade_imb_16"):
        signal = np.sign(np.asarray(cache.features[:, names.index(name)]))
        assert after_cost_sharpe(signal, *args) < 0.0


def test_default_dataset_builds_fast_with_enough_sessions(tmp_path):
    start = time.perf_counter()
    path = synth.build_synthetic_cache(tmp_path / "default")
    elapsed = time.perf_counter() - start
    cache = load_cache(path)
    assert elapsed < 30.0
    assert cache.n_sessions == 20 and 800 < cache.bars_per_day < 1300
    from numbarl.data.splits import walk_forward

    (fold,) = walk_forward(cache.session_id, 1, 10, 12, 4, 4)
    assert fold.train[1] - fold.train[0] > 5000  # longer than a default 5,000-bar episode


def test_synthetic_bars_match_reference_on_one_session():
    (records, _), = synth.iter_sessions(1, seed=9, events_per_session=3_000)
    params = BarParams(mode="ewma", ewma_initial_trades=20, ewma_span_trades=100)
    got, want = build_bars(records, params), bars_ref(records, params)
    assert len(got) == len(want) > 10
    np.testing.assert_array_equal(got["close_index"], want["close_index"])


def _next_move_stats(cache):
    """(lag-1 autocorrelation of bar mid changes, corr(qi_1, next bar's mid change), the largest
    |corr| of any feature with the next bar's mid change), within sessions."""
    mid, sid = np.asarray(cache.mid, np.float64), np.asarray(cache.session_id)
    feats, names = np.asarray(cache.features), list(cache.feature_names)
    nxt = np.r_[np.diff(mid), 0.0]
    same = np.r_[sid[1:] == sid[:-1], False]
    r = np.concatenate([np.diff(mid[sid == s]) for s in np.unique(sid)])
    ac1 = np.corrcoef(r[:-1], r[1:])[0, 1]
    corr = [np.corrcoef(feats[same, j], nxt[same])[0, 1] for j in range(feats.shape[1]) if np.std(feats[same, j]) > 0]
    return ac1, corr[names.index("qi_1")], max(abs(c) for c in corr)


def test_walk_market_is_a_null_that_nothing_observable_leads(tmp_path):
    """The book's own structure makes the null=True market predictable (queue imbalance leads the next
    move, the mid's half-tick bounce reverts); the walk mode's mid is a random walk the features do
    not lead. Same sizes, same seed: ~1,300 bars each (noise of a correlation ~0.03)."""
    size = {"sessions": 6, "seed": 3, "null": True, "events_per_session": 30_000, "bars_per_day": 200}
    walk = load_cache(synth.build_synthetic_cache(tmp_path / "walk", mode="walk", **size))
    book = load_cache(synth.build_synthetic_cache(tmp_path / "null", **size))
    assert np.all(walk.oracle == 0.0) and walk.meta["synthetic"]["mode"] == "walk" and walk.meta["synthetic"]["null"]
    spread = np.asarray(walk.ask) - np.asarray(walk.bid)
    np.testing.assert_allclose(spread, synth.TICK_SIZE)  # queues refill: the spread stays one tick
    ac1, qi, most = _next_move_stats(walk)
    assert abs(ac1) < 0.08 and abs(qi) < 0.1 and most < 0.12, (ac1, qi, most)
    ac1, qi, most = _next_move_stats(book)  # measured -0.125, 0.226: what the walk mode removes
    assert ac1 < -0.08 and qi > 0.15, (ac1, qi)
    r = np.diff(np.asarray(walk.mid))
    assert 0.5 < r.std() / synth.TICK_SIZE < 1.6  # about the null market's 0.9-1.1 tick per bar
