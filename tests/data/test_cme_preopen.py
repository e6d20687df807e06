"""A CME day as real files have it: a pre-open of crossed and locked books, a side-N opening
print, then the session. Default flags build it in both bar modes, and a build of any prefix of
the file gives bit for bit the bars (and features) of the full build before the cut."""

import numpy as np
import pytest

from data_markets import cme_like_records
from numbarl.data.bars import BarParams, bars_ref, build_bars
from numbarl.data.calendar import SessionCalendar
from numbarl.data.errors import DataError
from numbarl.data.fxcache import build_cache, load_cache
from numbarl.data.readers import write_dbn
from numbarl.data.records import ACTION_TRADE, F_LAST, SIDE_NONE

MODES = {"target": BarParams(), "ewma": BarParams(mode="ewma")}


@pytest.fixture(scope="module")
def cme_day(tmp_path_factory):
    records = cme_like_records(sessions=3, seed=7, events_per_session=6000)
    path = write_dbn(tmp_path_factory.mktemp("cme") / "glbx-es.mbp-10.dbn.zst", records, mappings={"ESH4": 1})
    return path, records


def test_the_market_has_what_real_files_have(cme_day):
    _, records = cme_day
    states = records[(records["flags"] & F_LAST) != 0]
    lv = states["levels"][:, 0]
    crossed = lv["bid_px"] > lv["ask_px"]
    locked = lv["bid_px"] == lv["ask_px"]
    assert crossed.sum() > 100 and locked.sum() > 20
    table = SessionCalendar().sessions_between(int(records["ts_recv"][0]), int(records["ts_recv"][-1]))
    ts = states["ts_recv"].astype(np.int64)
    sess = table.index_of(ts)
    outside = ts >= table.close_ns[sess]
    assert np.all(outside[crossed | locked])  # every crossed state is in a pre-open
    trades = records[records["action"] == ACTION_TRADE]
    opening = trades[trades["side"] == SIDE_NONE]
    assert len(opening) == 3 and np.all(opening["size"] == 2500)
    # the first trade of the file is an opening print: no aggressor side and no earlier price
    assert trades[0]["side"] == SIDE_NONE


@pytest.mark.parametrize("mode", ["target", "ewma"])
def test_builds_with_default_flags(cme_day, tmp_path, mode):
    path, records = cme_day
    warnings = []
    out = build_cache([path], tmp_path / "c", bar_params=MODES[mode], warn=warnings.append)
    cache = load_cache(out)
    assert cache.n_bars > 10
    assert cache.n_sessions == 3  # target: the first session's bars follow the ewma rule, it calibrates the next
    assert np.all(np.unique(cache.session_id, return_counts=True)[1] >= 3)  # every session has bars
    assert cache.meta["skipped"]["crossed_outside_session"] > 100
    assert any("crossed or locked book states outside the trading session" in w for w in warnings)
    assert cache.tick_size == 0.25 and cache.meta["tick_size_source"].startswith("estimated")
    assert np.all(cache.bid < cache.ask)
    # inside a session a crossed book is still an error
    bad = records.copy()
    k = np.flatnonzero((bad["flags"] & F_LAST) != 0)[-50]
    bad["levels"]["bid_px"][k, 0] = bad["levels"]["ask_px"][k, 0] + 250_000_000
    bad_path = write_dbn(tmp_path / "bad.dbn", bad)
    with pytest.raises(DataError, match=r"crossed book at .*bad\.dbn, selected record .*inside the trading session"):
        build_cache([bad_path], tmp_path / "c2", bar_params=MODES[mode])
    assert not (tmp_path / "c2").exists()


@pytest.mark.parametrize("mode", ["target", "ewma"])
def test_prefix_builds_are_bit_identical(cme_day, tmp_path, mode, rng):
    path, records = cme_day
    full = load_cache(build_cache([path], tmp_path / "full", bar_params=MODES[mode], warn=lambda m: None))
    first_close = int(full.bars["close_index"][0]) + 1
    cuts = sorted(set(rng.integers(first_close, len(records), size=3).tolist()) | {first_close})
    for cut in cuts:
        part = write_dbn(tmp_path / f"cut{cut}.dbn", records[:cut], mappings={"ESH4": 1})
        cache = load_cache(build_cache([part], tmp_path / f"c{cut}", bar_params=MODES[mode], warn=lambda m: None))
        n = cache.n_bars
        assert 0 < n <= full.n_bars
        assert np.all(full.bars["close_index"][n:] >= cut)
        assert np.asarray(cache.bars).tobytes() == np.asarray(full.bars[:n]).tobytes()
        assert np.asarray(cache.features).tobytes() == np.asarray(full.features[:n]).tobytes()
        for name in ("mid", "bid", "ask", "high", "low", "timestamps"):
            assert np.asarray(getattr(cache, name)).tobytes() == np.asarray(getattr(full, name)[:n]).tobytes()
        assert cache.tick_size == full.tick_size


@pytest.mark.parametrize("mode", ["target", "ewma"])
def test_reference_agrees_on_the_preopen_day(cme_day, mode):
    _, records = cme_day
    part = records[: len(records) * 2 // 3]
    counts = {}
    want = bars_ref(part, MODES[mode], counts=counts)
    got = build_bars(part, MODES[mode])
    assert len(got) == len(want) > 0
    for name in got.dtype.names:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-9, err_msg=name)
    assert counts["crossed_outside_session"] > 0


def test_cli_default_flags_warn_once(cme_day, tmp_path):
    from click.testing import CliRunner

    from numbarl.data.commands import data_group

    path, _ = cme_day
    result = CliRunner().invoke(data_group, ["build", str(path), "--out", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    warnings = result.stderr.strip().splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("numbarl-data: warning: skipped ")
    assert "crossed or locked book states outside the trading session" in warnings[0]
    assert "wrote " in result.stdout and "3 sessions" in result.stdout
    known = CliRunner().invoke(data_group, ["build", str(path), "--out", str(tmp_path / "k"), "--tick-size", "0.25"])
    assert known.exit_code == 0 and load_cache(tmp_path / "k").meta["tick_size_source"] == "given"


def test_no_bars_says_how_many_sessions_had_trades(tmp_path):
    """Two sessions of which the first has no trade: it was reported as 'needs at least two
    sessions' although the file has two; now the message counts sessions with trades."""
    from numbarl.data import synth

    records, _ = synth.generate(sessions=2, seed=4, events_per_session=1500)
    records = records.copy()
    second_open, _ = SessionCalendar().open_close_ns(synth.trade_dates(2)[1])
    quiet = (records["ts_recv"] < second_open) & (records["action"] == ACTION_TRADE)
    assert quiet.any() and (records["action"][records["ts_recv"] >= second_open] == ACTION_TRADE).any()
    records["action"][quiet] = ord("C")
    path = write_dbn(tmp_path / "two.dbn", records)
    # the second session is the first with trades: it builds (ewma rule, nothing to calibrate on);
    # with thresholds no imbalance reaches, the message counts the sessions with trades
    assert load_cache(build_cache([path], tmp_path / "c", warn=lambda m: None)).n_sessions == 1
    never = BarParams(ewma_initial_trades=1e6, ewma_min_trades=1e6, ewma_max_trades=1e6)
    with pytest.raises(DataError, match=r"no bars from \d+ records in 2 sessions, 1 with trades: no bar reached"):
        build_cache([path], tmp_path / "c2", bar_params=never, warn=lambda m: None)


def _grid_market(n_states: int, spacings, t0: int) -> np.ndarray:
    """Book states (levels ``spacing`` apart, the best bid walking) each followed by a buy trade."""
    from numbarl.data.records import ACTION_ADD, SIDE_BID, empty_records

    recs = empty_records(2 * n_states * len(spacings))
    recs["instrument_id"] = 1
    recs["ts_recv"] = t0 + np.arange(len(recs)) * 1_000_000
    k = 0
    for spacing in spacings:
        for i in range(n_states):
            bid = 4000 * 10**9 + (i % 7) * spacing
            trade, state = recs[k], recs[k + 1]
            trade["action"], trade["side"], trade["size"], trade["price"] = ACTION_TRADE, SIDE_BID, 1, bid + spacing
            state["action"], state["side"], state["flags"] = ACTION_ADD, SIDE_BID, F_LAST
            for m in range(10):
                state["levels"][m]["bid_px"] = bid - m * spacing
                state["levels"][m]["ask_px"] = bid + (m + 1) * spacing
                state["levels"][m]["bid_sz"] = state["levels"][m]["ask_sz"] = 10
            k += 2
    return recs


def test_a_finer_tick_later_in_the_data_is_a_warning(tmp_path):
    """The tick is what the records up to each bar show: 0.5 while every book is on a 0.5 grid,
    0.25 once three states show the finer one; the cache's tick_size is the first bar's."""
    t0 = 1_704_322_800_000_000_000  # Wednesday 2024-01-03 17:00 Chicago: a session open
    recs = _grid_market(150, [500_000_000, 250_000_000], t0)
    params = BarParams(mode="ewma", ewma_initial_trades=5, ewma_min_trades=2, ewma_max_trades=20)
    warnings = []
    cache = load_cache(build_cache([write_dbn(tmp_path / "g.dbn", recs)], tmp_path / "c", bar_params=params,
                                   warn=warnings.append))
    ticks = np.asarray(cache.bars["tick"])
    assert cache.tick_size == 0.5 and ticks[0] == 0.5 and ticks[-1] == 0.25
    assert [t for _, t in cache.meta["tick_size_changes"]] == [0.5, 0.25]
    assert any("tick size estimate changed" in w for w in warnings)
    np.testing.assert_array_equal(build_bars(recs, params)["tick"], bars_ref(recs, params)["tick"])


def test_ewma_no_bars_names_the_cli_options(tmp_path):
    """ewma mode with a threshold no imbalance reaches: the message names the options the CLI has
    (it used to say 'lower the ewma clamps', a setting numbarl-data build did not offer)."""
    from click.testing import CliRunner

    from numbarl.data import synth
    from numbarl.data.commands import data_group

    records, _ = synth.generate(sessions=2, seed=4, events_per_session=1500)
    path = write_dbn(tmp_path / "two.dbn", records)
    r = CliRunner().invoke(data_group, ["build", str(path), "--out", str(tmp_path / "c"), "--mode", "ewma",
                                        "--ewma-initial-trades", "1e6", "--ewma-min-trades", "1e6",
                                        "--ewma-max-trades", "1e6"])
    assert r.exit_code == 2, r.output
    assert "--ewma-initial-trades" in r.output and "--ewma-max-trades" in r.output
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("mode", ["target", "ewma"])
def test_one_session_with_its_preopen_builds_with_default_flags(tmp_path, mode):
    """An hour-long file (one session with trades, behind its crossed pre-open and opening print)
    builds in both modes with default flags: target mode has no previous session to calibrate on,
    so its first session follows the ewma rule (it used to stop: 'at least two sessions')."""
    records = cme_like_records(sessions=1, seed=11, events_per_session=6000)
    path = write_dbn(tmp_path / "hour.mbp-10.dbn", records, mappings={"ESH4": 1})
    cache = load_cache(build_cache([path], tmp_path / "c", bar_params=MODES[mode], warn=lambda m: None))
    assert cache.n_sessions == 1 and cache.n_bars >= 5
    assert cache.meta["skipped"]["crossed_outside_session"] > 10
    fast = build_bars(records, MODES[mode])
    ref = bars_ref(records, MODES[mode])
    assert len(fast) == len(ref) == cache.n_bars and np.array_equal(fast["close_index"], ref["close_index"])
