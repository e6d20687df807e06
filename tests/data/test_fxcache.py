"""fxcache: round trip, validation on load, atomic writes, build from DBN files."""

import hashlib
import json
import os

import numpy as np
import pytest

from numbarl.data import fxcache
from numbarl.data.bars import BAR_DTYPE, BarParams, build_bars
from numbarl.data.errors import DataError
from numbarl.data.features import DEFAULT_FEATURES
from numbarl.data.fxcache import build_cache, load_cache
from numbarl.data.readers import write_dbn


def test_round_trip(tiny_cache):
    cache = load_cache(tiny_cache, expect_features=list(DEFAULT_FEATURES))
    n = cache.n_bars
    assert isinstance(cache.features, np.memmap)
    assert cache.features.dtype == np.float32 and cache.features.shape == (n, 64)
    assert cache.timestamps.dtype == np.int64 and np.all(np.diff(cache.timestamps) > 0)
    assert cache.session_id.dtype == np.int32 and cache.session_id[-1] == cache.n_sessions - 1 == 3
    assert cache.bars.dtype == BAR_DTYPE and cache.oracle.shape == (n,)
    assert np.all(cache.low <= cache.mid) and np.all(cache.mid <= cache.high)
    assert np.all(cache.bid < cache.mid) and np.all(cache.mid < cache.ask)
    meta = cache.meta
    for key in ("format_version", "feature_names", "n_bars", "n_sessions", "bars_per_day", "bar_params",
                "source_files", "created_by", "tick_size"):  # fmt: skip
        assert key in meta
    assert meta["bars_per_day"] == n / 4 and cache.tick_size == 0.25
    assert meta["created_by"].startswith("numbarl ")
    starts = cache.session_starts()
    assert starts[0] == 0 and starts[-1] == n and len(starts) == 5


def test_load_errors(tiny_cache, tmp_path):
    with pytest.raises(DataError, match="missing theta_norm; not asked for ret_2, .*rebuild"):
        load_cache(tiny_cache, expect_features=["ret_1", "theta_norm"])
    with pytest.raises(DataError, match="another order"):
        load_cache(tiny_cache, expect_features=list(reversed(DEFAULT_FEATURES)))
    with pytest.raises(DataError, match="not a numbarl feature cache"):
        load_cache(tmp_path)
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_cache, copy)
    meta = json.loads((copy / "meta.json").read_text())
    meta["format_version"] = 99
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="format_version 99"):
        load_cache(copy)
    meta["format_version"] = fxcache.FORMAT_VERSION
    (copy / "meta.json").write_text(json.dumps(meta))
    np.save(copy / "mid.npy", np.zeros(3))
    with pytest.raises(DataError, match=r"mid.npy: expected float64 \("):
        load_cache(copy)
    (copy / "mid.npy").unlink()
    with pytest.raises(DataError, match="missing mid.npy"):
        load_cache(copy)
    for bad, message in (([1, 2], "not a cache description"), (dict(meta, n_bars="abc"), "'n_bars' = 'abc' has the wrong type"),
                         ({k: v for k, v in meta.items() if k != "bar_params"}, "missing field 'bar_params'")):
        (copy / "meta.json").write_text(json.dumps(bad))
        with pytest.raises(DataError, match=message):
            load_cache(copy)


def test_interrupted_write_leaves_nothing(tiny_cache, tmp_path, monkeypatch):
    cache = load_cache(tiny_cache)
    bars = np.asarray(cache.bars)
    features = np.asarray(cache.features)
    saved = []
    real_save = np.save

    def failing_save(path, arr, **kw):
        if len(saved) == 3:
            raise OSError("disk full")
        saved.append(path)
        real_save(path, arr, **kw)

    monkeypatch.setattr(fxcache.np, "save", failing_save)
    out = tmp_path / "cache"
    kwargs = dict(
        tick_size=0.25, bar_params=BarParams(), feature_params=fxcache.FeatureParams(),
        calendar=fxcache.SessionCalendar(), source_files=[],
    )  # fmt: skip
    with pytest.raises(DataError, match="cannot write the cache to .*cache: disk full"):
        fxcache.write_cache(out, bars, features, list(DEFAULT_FEATURES), **kwargs)
    assert len(saved) == 3 and os.listdir(tmp_path) == []
    monkeypatch.setattr(fxcache.np, "save", real_save)
    fxcache.write_cache(out, bars, features, list(DEFAULT_FEATURES), **kwargs)
    with pytest.raises(DataError, match="already exists"):
        fxcache.write_cache(out, bars, features, list(DEFAULT_FEATURES), **kwargs)
    fxcache.write_cache(out, bars[:50], features[:50], list(DEFAULT_FEATURES), overwrite=True, **kwargs)
    assert load_cache(out).n_bars == 50 and sorted(os.listdir(tmp_path)) == ["cache"]
    nan_features = features.copy()
    nan_features[7, 3] = np.nan
    with pytest.raises(DataError, match="feature ret_8 is not finite at bar 7"):
        fxcache.write_cache(tmp_path / "nan", bars, nan_features, list(DEFAULT_FEATURES), **kwargs)
    assert not (tmp_path / "nan").exists()


def test_build_from_dbn_files(small_market, tmp_path):
    records, _ = small_market
    cut = len(records) // 2
    files = [write_dbn(tmp_path / "day1.dbn.zst", records[:cut]), write_dbn(tmp_path / "day2.dbn", records[cut:])]
    params = BarParams(mode="target", bars_per_day=40)
    out = build_cache(files, tmp_path / "cache", bar_params=params, feature_names="ret_1,ofi_1,qi_1", chunk_bytes=1 << 20)
    cache = load_cache(out, expect_features="ret_1,ofi_1,qi_1")
    want = build_bars(records, params)
    assert np.asarray(cache.bars).tobytes() == want.tobytes()
    assert cache.tick_size == pytest.approx(0.25)
    names = [f["name"] for f in cache.meta["source_files"]]
    assert names == ["day1.dbn.zst", "day2.dbn"]
    for info, path in zip(cache.meta["source_files"], files):
        assert info["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert info["size"] == path.stat().st_size
    assert cache.n_sessions == 4 and cache.bars_per_day == pytest.approx(len(want) / 4)


def test_build_errors_leave_no_cache(small_market, tmp_path):
    records, _ = small_market
    path = write_dbn(tmp_path / "d.dbn", records)
    with pytest.raises(DataError, match="unknown feature 'nope'"):
        build_cache([path], tmp_path / "c1", feature_names="ret_1,nope")
    with pytest.raises(DataError, match="needs 20 sessions; the data has 4"):
        build_cache([path], tmp_path / "c2", bar_params=BarParams(bars_per_day=40),
                    folds={"n_folds": 1, "train_sessions": 12, "val_sessions": 4, "test_sessions": 4})
    one_session = write_dbn(tmp_path / "one.dbn", records[: len(records) // 5])
    with pytest.raises(DataError, match="no bars .*1 with trades: no bar reached its threshold"):
        build_cache([one_session], tmp_path / "c3", bar_params=BarParams(ewma_initial_trades=1e6, ewma_min_trades=1e6,
                                                                          ewma_max_trades=1e6))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.dbn", "one.dbn"]
    # --out is checked before any input is read: --force replaces a cache or an empty folder only
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("x")
    with pytest.raises(DataError, match="is not a numbarl feature cache.*--force only replaces"):
        build_cache([path], precious, overwrite=True)
    assert (precious / "thesis.txt").read_text() == "x"
    with pytest.raises(DataError, match="d.dbn is a file, not a folder"):
        build_cache([path], tmp_path / "d.dbn" / "sub")
    (precious / "thesis.txt").unlink()
    assert build_cache([path], precious, overwrite=True) == precious  # an empty folder is fine
