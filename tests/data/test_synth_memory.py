"""Memory mode of the synthetic market: the planted edge shows only through history, its oracle is
causal, its null has no edge, and the planted market is unchanged."""

import numpy as np
import pytest

from numbarl.config import ConfigError, DataConfig
from numbarl.data import synth
from numbarl.data.errors import DataError
from numbarl.data.fxcache import load_cache
from numbarl.data.records import MBP10_DTYPE
from numbarl.data.synth_probe import after_cost_sharpe, edge_report, memory_predictor

SMALL = {"sessions": 10, "events_per_session": 30_000, "bars_per_day": 200}


@pytest.fixture(scope="module")
def memory_markets(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth_memory")
    out = {}
    for null in (False, True):
        path = synth.build_synthetic_cache(root / f"null_{null}", seed=1, null=null, mode="memory", **SMALL)
        out[null] = load_cache(path)
    return out


def test_edge_is_invisible_in_one_bar_and_visible_through_history(memory_markets):
    rep, null = edge_report(memory_markets[False]), edge_report(memory_markets[True])
    # the best single-bar linear predictor of the planted drift (the oracle) has nothing
    assert abs(rep["linear_oracle"]) < 0.1  # measured 0.03
    # against the next mid move it gets what it gets in the null market (the book's mechanics)
    assert abs(rep["linear_next"] - null["linear_next"]) < 0.1  # measured 0.20 vs 0.25
    # the memory predictor (the last 16 bars' flow-vs-move products) finds the regime
    assert rep["memory_oracle"] > 0.25  # measured 0.39
    assert rep["memory_next"] > 0.15  # measured 0.28
    assert rep["memory_oracle"] > rep["products_oracle"]  # one bar's window products: 0.25
    assert rep["oracle_next"] > 0.3 and rep["oracle_sharpe"] > 0.1  # measured 0.50 and 0.15 after costs


def test_within_a_regime_the_flow_predicts_with_the_regime_sign(tmp_path):
    """With the regime frozen (regime_bars huge) one bar's flow predicts the next move, with the
    regime's sign (seed 1 starts in regime -1, seed 2 in +1): the sign only history can tell."""
    regimes = []
    for seed in (1, 2):
        path = synth.build_synthetic_cache(tmp_path / f"frozen{seed}", seed=seed, mode="memory", regime_bars=1e12,
                                           sessions=4, events_per_session=30_000, bars_per_day=200)
        cache = load_cache(path)
        flow = np.asarray(cache.features[:, cache.feature_names.index("trade_imb_4")], np.float64)
        oracle, mid, sid = np.asarray(cache.oracle), np.asarray(cache.mid), np.asarray(cache.session_id)
        same = sid[1:] == sid[:-1]
        with_oracle = np.corrcoef(flow, oracle)[0, 1]  # its sign is the regime's
        with_next = np.corrcoef(flow[:-1][same], np.diff(mid)[same])[0, 1]
        assert abs(with_oracle) > 0.5 and np.sign(with_oracle) * with_next > 0.25, (seed, with_oracle, with_next)
        regimes.append(np.sign(with_oracle))
    assert regimes == [-1, 1]


def test_null_memory_market_has_no_edge(memory_markets):
    cache = memory_markets[True]
    assert np.all(cache.oracle == 0.0) and cache.meta["synthetic"]["null"]
    assert cache.meta["synthetic"]["mode"] == "memory" and cache.meta["synthetic"]["passive_coupling"] == 0.0
    mid, sid = np.asarray(cache.mid), np.asarray(cache.session_id)
    args = (mid, np.asarray(cache.bid), np.asarray(cache.ask), sid)
    flow = np.asarray(cache.features[:, cache.feature_names.index("trade_imb_4")], np.float64)
    assert after_cost_sharpe(np.sign(memory_predictor(flow, mid, sid)), *args) < 0.0
    assert after_cost_sharpe(np.sign(flow), *args) < 0.0 and after_cost_sharpe(-np.sign(flow), *args) < 0.0


def _session(mode, n_events, seed=3):
    """One session straight from the event generator (the memory state as iter_sessions starts it)."""
    rng = np.random.default_rng(0)
    times = synth.session_event_times(rng, 4_000, 0)[:n_events]
    memory = mode == "memory"
    out = np.zeros(2 * n_events, MBP10_DTYPE)
    oracle = np.zeros(2 * n_events, np.float64)
    lagbuf = np.zeros(40 if memory else 1)
    mstate = np.array([1.0, 0.0, 0.0, 0.0])
    coupling = synth.MEMORY_COUPLING if memory else synth.PASSIVE_COUPLING
    k, _, _ = synth._simulate_session(seed, n_events, times, synth.START_PRICE_TICKS, 0.3, 0.2, coupling,
                                      300.0, synth.ADD_LEVEL_WEIGHTS, out, oracle, memory, 1 / 400, 5.0, lagbuf, mstate,
                                      0.0)
    return out[:k], oracle[:k]


@pytest.mark.parametrize("mode", ["planted", "memory"])
def test_oracle_uses_nothing_after_its_record(mode):
    """Stopping the generator after any event leaves every earlier record and oracle value as it
    was: the oracle at a record depends on nothing generated after it."""
    full, full_oracle = _session(mode, 4_000)
    assert np.any(full_oracle != 0.0)
    for n in (500, 1_777, 3_001):
        part, part_oracle = _session(mode, n)
        assert part.tobytes() == full[: len(part)].tobytes()
        assert part_oracle.tobytes() == full_oracle[: len(part)].tobytes()


def test_appending_a_session_changes_no_earlier_bar(tmp_path):
    """Cache level: the bars, features and oracle of the first sessions do not change when the
    market runs one session longer (bars, the target threshold, features, oracle: all causal)."""
    kw = {"seed": 2, "mode": "memory", "events_per_session": 8_000, "bars_per_day": 80}
    short = load_cache(synth.build_synthetic_cache(tmp_path / "short", sessions=3, **kw))
    long = load_cache(synth.build_synthetic_cache(tmp_path / "long", sessions=4, **kw))
    n = short.n_bars
    assert long.n_bars > n and np.any(np.asarray(short.oracle) != 0)
    assert np.asarray(long.features[:n]).tobytes() == np.asarray(short.features).tobytes()
    assert np.asarray(long.oracle[:n]).tobytes() == np.asarray(short.oracle).tobytes()
    assert np.asarray(long.mid[:n]).tobytes() == np.asarray(short.mid).tobytes()


def test_memory_market_is_deterministic_and_differs_from_planted():
    a, oa = synth.generate(sessions=2, seed=4, events_per_session=2_000, mode="memory", lag_events=30, regime_events=900)
    b, ob = synth.generate(sessions=2, seed=4, events_per_session=2_000, mode="memory", lag_events=30, regime_events=900)
    p, _ = synth.generate(sessions=2, seed=4, events_per_session=2_000)
    assert a.tobytes() == b.tobytes() and oa.tobytes() == ob.tobytes()
    assert a.tobytes() != p.tobytes() and np.any(oa > 0) and np.any(oa < 0)
    assert np.all(np.abs(oa) <= 0.5 * synth.DEFAULT_SIGNAL)


def test_bad_memory_arguments():
    with pytest.raises(DataError, match="mode must be one of"):
        synth.generate(sessions=1, events_per_session=1_000, mode="regime")
    with pytest.raises(DataError, match="lag_events must be an integer"):
        synth.generate(sessions=1, events_per_session=1_000, mode="memory", lag_events=0)
    with pytest.raises(DataError, match="regime_events must be"):
        synth.generate(sessions=1, events_per_session=1_000, mode="memory", regime_events=0.5)
    with pytest.raises(DataError, match="regime_bars must be"):
        synth.build_synthetic_cache("/nonexistent/never", sessions=1, mode="memory", regime_bars=0)


def test_config_fields_and_cache_keys():
    from numbarl.run.trainer import _synth_spec

    with pytest.raises(ConfigError, match="data.synth_mode = 'regime' is not allowed"):
        DataConfig(synth_mode="regime").validate()
    with pytest.raises(ConfigError, match="data.synth_regime_bars = 0.5 is out of range"):
        DataConfig(synth_mode="memory", synth_regime_bars=0.5).validate()
    DataConfig(synth_mode="memory", synth_regime_bars=12.0).validate()
    planted = _synth_spec(DataConfig())
    assert "mode" not in planted and "regime_bars" not in planted  # today's caches keep their keys
    memory = _synth_spec(DataConfig(synth_mode="memory", synth_regime_bars=12.0))
    assert memory == {**planted, "mode": "memory", "regime_bars": 12.0}
    # 0 (the default): each mode's own duration, so the memory modes' caches keep their keys (40)
    for mode, bars in (("memory", 40.0), ("memory_walk", 40.0), ("regime_walk", 200.0)):
        DataConfig(synth_mode=mode).validate()
        assert _synth_spec(DataConfig(synth_mode=mode))["regime_bars"] == bars


@pytest.fixture(scope="module")
def memory_walk_markets(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth_memory_walk")
    return {null: load_cache(synth.build_synthetic_cache(root / f"null_{null}", seed=1, null=null, mode="memory_walk",
                                                         **SMALL))
            for null in (False, True)}


def test_memory_walk_edge_only_through_history(memory_walk_markets):
    """memory_walk: the regime drift moves the walk's coin, the book's sides are fair coins, so no
    single-bar feature leads the mid (the memory market's queue imbalance did: its linear_next 0.20)."""
    rep = edge_report(memory_walk_markets[False])
    assert abs(rep["linear_oracle"]) < 0.1 and abs(rep["linear_next"]) < 0.1  # measured 0.007, -0.011
    assert rep["memory_oracle"] > 0.25 and rep["memory_next"] > 0.15  # measured 0.36, 0.24
    assert rep["memory_oracle"] > rep["products_oracle"] + 0.1  # one bar's window products: 0.19
    assert rep["oracle_next"] > 0.45 and rep["oracle_sharpe"] > 0.3  # measured 0.57 and 0.45 after costs
    meta = memory_walk_markets[False].meta["synthetic"]
    assert meta["mode"] == "memory_walk" and meta["passive_coupling"] == 0.0
    assert meta["walk_coupling"] == synth.MEMORY_WALK_COUPLING and meta["walk_move_p"] == synth.MEMORY_WALK_MOVE_P


def test_memory_walk_null_has_no_edge(memory_walk_markets):
    cache = memory_walk_markets[True]
    assert np.all(cache.oracle == 0.0) and cache.meta["synthetic"]["walk_coupling"] == 0.0
    rep = edge_report(cache)
    assert abs(rep["linear_next"]) < 0.1 and abs(rep["memory_next"]) < 0.1  # measured -0.09, 0.05
    mid, sid = np.asarray(cache.mid), np.asarray(cache.session_id)
    args = (mid, np.asarray(cache.bid), np.asarray(cache.ask), sid)
    flow = np.asarray(cache.features[:, cache.feature_names.index("trade_imb_4")], np.float64)
    assert after_cost_sharpe(np.sign(memory_predictor(flow, mid, sid)), *args) < 0.0
    assert after_cost_sharpe(np.sign(flow), *args) < 0.0 and after_cost_sharpe(-np.sign(flow), *args) < 0.0


def test_memory_walk_oracle_uses_nothing_after_its_record():
    """The generator's memory_walk path (memory on, walk steps on): records and oracle values of a
    shortened run equal the full run's prefix, so the oracle at a record uses nothing later."""
    def session(n):
        times = synth.session_event_times(np.random.default_rng(0), 4_000, 0)[:n]
        out, oracle = np.zeros(2 * n, MBP10_DTYPE), np.zeros(2 * n, np.float64)
        k, _, _ = synth._simulate_session(3, n, times, synth.START_PRICE_TICKS, 0.3, 0.2, synth.MEMORY_WALK_COUPLING,
                                          300.0, synth.ADD_LEVEL_WEIGHTS, out, oracle, True, 1 / 400, 5.0,
                                          np.zeros(40), np.array([1.0, 0.0, 0.0, 0.0]), synth.MEMORY_WALK_MOVE_P)
        return out[:k], oracle[:k]

    full, full_oracle = session(4_000)
    steps = np.diff(full["levels"]["bid_px"][:, 0].astype(np.int64))
    assert np.any(full_oracle > 0) and np.any(full_oracle < 0) and np.any(steps != 0)
    for n in (500, 1_777, 3_001):
        part, part_oracle = session(n)
        assert part.tobytes() == full[: len(part)].tobytes()
        assert part_oracle.tobytes() == full_oracle[: len(part)].tobytes()


def test_memory_walk_config_and_cache_key():
    from numbarl.run.trainer import _synth_spec

    DataConfig(synth_mode="memory_walk").validate()
    spec = _synth_spec(DataConfig(synth_mode="memory_walk"))
    assert spec["mode"] == "memory_walk" and spec["regime_bars"] == 40.0
    with pytest.raises(DataError, match="mode must be one of"):
        synth.generate(sessions=1, events_per_session=1_000, mode="memory-walk")


# regime_walk: the walk's coin follows the last imbalance bar's side with the regime's sign
REGIME_SMALL = {**SMALL, "regime_bars": 200.0}


@pytest.fixture(scope="module")
def regime_walk_markets(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth_regime_walk")
    return {null: edge_report(load_cache(synth.build_synthetic_cache(root / f"null_{null}", seed=1, null=null,
                                                                     mode="regime_walk", **REGIME_SMALL)))
            for null in (False, True)}


def test_regime_walk_memory_rule_earns_most_of_the_oracle(regime_walk_markets):
    """The memory rule (the last 16 bars) earns most of the oracle after costs; single-bar fits,
    windowed features and their products included, earn little of it."""
    rep = regime_walk_markets[False]
    assert rep["oracle_test_sharpe"] > 0.4  # measured 0.51
    assert rep["rule_sharpe"] > 0.7 * rep["oracle_test_sharpe"]  # measured 0.43: 0.84
    assert abs(rep["linear_oracle"]) < 0.1 and rep["linear_sharpe"] < 0.05  # measured 0.05, -0.01
    for key in ("products_sharpe", "products_side_sharpe", "linear_next_sharpe", "products_next_sharpe"):
        assert rep[key] < 0.3 * rep["rule_sharpe"], key  # measured -0.02, -0.01, 0.05, -0.04


def test_regime_walk_null_has_no_edge(regime_walk_markets):
    rep = regime_walk_markets[True]
    assert rep["oracle_sharpe"] == 0.0 and rep["oracle_test_sharpe"] == 0.0
    assert abs(rep["rule_next"]) < 0.05 and abs(rep["linear_next"]) < 0.15  # measured 0.01, -0.09
    for key in ("rule_sharpe", "memory_sharpe", "linear_next_sharpe", "products_next_sharpe"):
        assert rep[key] < 0.0, key  # measured -0.14, -0.01, -0.13, -0.12: the costs


@pytest.mark.parametrize("seed, regime", [(1, -1.0), (2, 1.0)])
def test_regime_walk_flow_bars_are_the_cache_bars(tmp_path, seed, regime):
    """The generator's flow bars are the bar builder's bars: with the regime frozen, every bar's
    oracle (the drift over the next bar) has the sign of r times the bar's trade imbalance, and
    within a bar the oracle is constant (the drift changes only at a bar's closing record)."""
    path = synth.build_synthetic_cache(tmp_path / "frozen", seed=seed, mode="regime_walk", regime_bars=1e12,
                                       sessions=4, events_per_session=12_000, bars_per_day=100)
    cache = load_cache(path)
    side = np.sign(np.asarray(cache.features[:, cache.feature_names.index("trade_imb")], np.float64))
    oracle = np.asarray(cache.oracle, np.float64)
    assert np.all(np.sign(oracle) == regime * side)
    assert np.allclose(np.abs(oracle), 0.5 * synth.DEFAULT_SIGNAL)  # float32 in the cache
    for records, per_record in synth.iter_sessions(2, seed, events_per_session=12_000, mode="regime_walk",
                                                   bars_per_day=100, lag_events=120, regime_events=1e15):
        changes = np.flatnonzero(np.diff(per_record) != 0) + 1  # records where the oracle changes in a session
        assert len(changes) > 20 and per_record[0] == 0.0  # no drift before the session's first bar
        assert np.all(records["action"][changes] == synth.ACTION_CANCEL)  # the record closing a trade's packet
        assert np.all(records["action"][changes - 1] == synth.ACTION_TRADE)


def test_regime_walk_oracle_uses_nothing_after_its_record():
    def session(n):
        times = synth.session_event_times(np.random.default_rng(0), 4_000, 0)[:n]
        out, oracle = np.zeros(2 * n, MBP10_DTYPE), np.zeros(2 * n, np.float64)
        k, _, _ = synth._simulate_session(3, n, times, synth.START_PRICE_TICKS, 0.3, 0.2, synth.REGIME_WALK_COUPLING,
                                          300.0, synth.ADD_LEVEL_WEIGHTS, out, oracle, False, 1 / 400, 5.0,
                                          np.zeros(1), np.array([1.0, 0.0, 0.0, 0.0]), synth.REGIME_WALK_MOVE_P, 12.0)
        return out[:k], oracle[:k]

    full, full_oracle = session(4_000)
    assert np.any(full_oracle > 0) and np.any(full_oracle < 0)
    for n in (500, 1_777, 3_001):
        part, part_oracle = session(n)
        assert part.tobytes() == full[: len(part)].tobytes()
        assert part_oracle.tobytes() == full_oracle[: len(part)].tobytes()


def test_regime_walk_config_cache_key_and_arguments():
    from numbarl.run.trainer import _synth_spec

    DataConfig(synth_mode="regime_walk", synth_regime_bars=200.0).validate()
    spec = _synth_spec(DataConfig(synth_mode="regime_walk", synth_regime_bars=200.0))
    assert spec["mode"] == "regime_walk" and spec["regime_bars"] == 200.0
    kw = {"sessions": 2, "seed": 4, "events_per_session": 3_000, "bars_per_day": 30, "lag_events": 100}
    a, oa = synth.generate(mode="regime_walk", **kw)
    b, ob = synth.generate(mode="regime_walk", **kw)
    w, _ = synth.generate(mode="memory_walk", **kw)
    assert a.tobytes() == b.tobytes() and oa.tobytes() == ob.tobytes() and a.tobytes() != w.tobytes()
    null, null_oracle = synth.generate(mode="regime_walk", null=True, **kw)
    assert np.all(null_oracle == 0.0) and null.tobytes() != a.tobytes()
    with pytest.raises(DataError, match="bars_per_day must be an integer"):
        synth.generate(sessions=1, events_per_session=1_000, mode="regime_walk", bars_per_day=0)
