"""fxcache: the feature cache everything downstream trains on (SPEC §3.4).

One folder per dataset::

    meta.json        format_version, feature_names, n_bars, n_sessions, bars_per_day, bar_params,
                     feature_params, calendar, tick_size, symbol, session_dates, source_files
                     (name, size, sha256), created_by (numbarl version), created_at, price_fields;
                     built from market data also tick_size_source, tick_size_changes, skipped
                     (book states and trades left out, by kind: validate.py), formats
    features.npy     float32 [T, F]   causal, normalized (features.py), no NaN
    timestamps.npy   int64 [T]        bar close time, ts_recv in UTC nanoseconds
    session_id.npy   int32 [T]        0..n_sessions-1, chronological exchange sessions
    mid.npy          float64 [T]      mid price at the bar's close
    bid.npy, ask.npy float64 [T]      best bid / best ask at the bar's close (execution prices)
    high.npy, low.npy float64 [T]     highest / lowest *mid* during the bar (stops and targets
                                      are checked against these; positions are marked at mid)
    bars.npy         BAR_DTYPE [T]    every bar field (bars.py), for analysis and export
    oracle.npy       float32 [T]      synthetic market only: planted signal at bar close

All arrays are ``.npy`` files opened memory-mapped. Prices are in price units (not fixed point):
the fixed-point int64 divided by 1e9, so a price on the tick grid is exactly the double nearest
its decimal value (bid / tick is a whole number for binary ticks such as 0.25).
``bars_per_day`` = bars / exchange sessions with bars (calendar.py), never UTC dates.

A cache is written to a temporary folder beside its destination and renamed into place at the
end (os.rename is atomic on one filesystem): an interrupted or failed build leaves no cache
folder. Loading checks the format version, every array's shape and dtype, and (when asked) the
feature list.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from numbarl import __version__
from numbarl.data.bars import BAR_DTYPE, BarBuilder, BarParams, estimate_tick_size
from numbarl.data.calendar import SessionCalendar, date_from_ordinal
from numbarl.data.errors import DataError
from numbarl.data.features import FeatureParams, compute_features, resolve_features
from numbarl.data.readers import RecordStream, file_sha256
from numbarl.data.validate import SKIP_NAMES

FORMAT_VERSION = 2  # 2: bars carry the tick in force at their close; prices divided by 1e9
META_FILE = "meta.json"
PRICE_ARRAYS = ("mid", "bid", "ask", "high", "low")
PRICE_FIELDS = {
    "mid": "mid price at the bar's close",
    "bid": "best bid at the bar's close",
    "ask": "best ask at the bar's close",
    "high": "highest mid price during the bar",
    "low": "lowest mid price during the bar",
}
ProgressFn = Callable[[str, int, "int | None"], None]


@dataclass
class Cache:
    """A loaded fxcache: memory-mapped arrays plus ``meta``."""

    path: Path
    meta: dict
    features: np.ndarray  # float32 [T, F]
    timestamps: np.ndarray  # int64 [T]
    session_id: np.ndarray  # int32 [T]
    mid: np.ndarray  # float64 [T]
    bid: np.ndarray
    ask: np.ndarray
    high: np.ndarray
    low: np.ndarray
    bars: np.ndarray | None = None  # BAR_DTYPE [T]
    oracle: np.ndarray | None = None  # float32 [T], synthetic caches only

    @property
    def feature_names(self) -> list[str]:
        return list(self.meta["feature_names"])

    @property
    def n_bars(self) -> int:
        return int(self.meta["n_bars"])

    @property
    def n_sessions(self) -> int:
        return int(self.meta["n_sessions"])

    @property
    def bars_per_day(self) -> float:
        return float(self.meta["bars_per_day"])

    @property
    def tick_size(self) -> float:
        return float(self.meta["tick_size"])

    def session_starts(self) -> np.ndarray:
        """int64 [n_sessions + 1]: bar index where each session starts, then n_bars."""
        return np.searchsorted(self.session_id, np.arange(self.n_sessions + 1), side="left").astype(np.int64)


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
def session_ids(trade_date: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(session_id int32 [T] numbered 0.. in time order, unique trade dates int32 [S])."""
    dates = np.asarray(trade_date, np.int64)
    if len(dates) and np.any(np.diff(dates) < 0):
        raise DataError("bars are not in session order")
    unique, ids = np.unique(dates, return_inverse=True)
    return ids.astype(np.int32), unique.astype(np.int32)


@contextlib.contextmanager
def build_lock(out_dir):
    """Hold an exclusive lock for building the cache at ``out_dir`` (a ``.<name>.lock`` file beside
    it): runs started together on one fresh cache build it once; the others wait, then load it.
    A no-op where ``fcntl`` does not exist (Windows)."""
    out_dir = Path(out_dir)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def check_destination(out_dir, overwrite: bool) -> Path:
    """Refuse, before any input is read, an --out the cache cannot go to: one that exists (without
    --force), a folder --force would wipe that is not a numbarl cache, or a place not writable."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise DataError(f"{out_dir} already exists; choose another --out or pass --force to replace it")
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"{out_dir} exists and is not a folder")
    if out_dir.exists() and not (out_dir / META_FILE).is_file() and any(out_dir.iterdir()):
        raise DataError(f"{out_dir} is not a numbarl feature cache (no {META_FILE}); --force only replaces a "
                        "cache or an empty folder: choose another --out")
    ancestor = out_dir.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise DataError(f"cannot write a cache to {out_dir}: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise DataError(f"cannot write a cache to {out_dir}: {ancestor} is not writable")
    return out_dir


def write_cache(
    out_dir,
    bars: np.ndarray,
    features: np.ndarray,
    feature_names: Sequence[str],
    *,
    tick_size: float,
    bar_params: BarParams,
    feature_params: FeatureParams,
    calendar: SessionCalendar,
    source_files: list[dict],
    symbol: str | None = None,
    extra_arrays: dict[str, np.ndarray] | None = None,
    extra_meta: dict | None = None,
    folds: dict | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a cache atomically (temporary folder + rename). ``folds``: walk_forward kwargs that
    the data must satisfy (checked before anything is written)."""
    out_dir = check_destination(out_dir, overwrite)
    n_bars = len(bars)
    if n_bars == 0:
        raise DataError("no bars to write")
    if features.shape != (n_bars, len(feature_names)) or features.dtype != np.float32:
        raise DataError(f"features must be float32 [{n_bars}, {len(feature_names)}], got {features.dtype} {features.shape}")
    if not np.all(np.isfinite(features)):
        bad = np.argwhere(~np.isfinite(features))[0]
        raise DataError(f"feature {feature_names[bad[1]]} is not finite at bar {bad[0]}")
    sid, dates = session_ids(bars["trade_date"])
    if folds:
        from numbarl.data.splits import walk_forward

        walk_forward(sid, **folds)
    n_sessions = int(len(dates))
    arrays = {
        "features": np.ascontiguousarray(features, np.float32),
        "timestamps": bars["close_ts"].astype(np.int64),
        "session_id": sid,
        "mid": bars["mid_close"].astype(np.float64),
        "bid": bars["bid"].astype(np.float64),
        "ask": bars["ask"].astype(np.float64),
        "high": bars["mid_high"].astype(np.float64),
        "low": bars["mid_low"].astype(np.float64),
        "bars": np.ascontiguousarray(bars),
    }
    for name, arr in (extra_arrays or {}).items():
        if len(arr) != n_bars:
            raise DataError(f"extra array {name} has {len(arr)} rows, expected {n_bars}")
        arrays[name] = np.ascontiguousarray(arr)
    meta = {
        "format_version": FORMAT_VERSION,
        "feature_names": list(feature_names),
        "n_bars": n_bars,
        "n_features": len(feature_names),
        "n_sessions": n_sessions,
        "bars_per_day": n_bars / n_sessions,
        "bar_params": bar_params.to_dict(),
        "feature_params": feature_params.to_dict(),
        "calendar": calendar.to_dict(),
        "tick_size": float(tick_size),
        "symbol": symbol,
        "session_dates": [date_from_ordinal(d).isoformat() for d in dates],
        "time_span": [int(arrays["timestamps"][0]), int(arrays["timestamps"][-1])],
        "source_files": list(source_files),
        "created_by": f"numbarl {__version__}",
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "price_fields": PRICE_FIELDS,
        "arrays": {k: {"dtype": str(v.dtype) if k != "bars" else "BAR_DTYPE", "shape": list(v.shape)} for k, v in arrays.items()},
    }
    meta.update(extra_meta or {})
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        for name, arr in arrays.items():
            np.save(tmp / f"{name}.npy", arr, allow_pickle=False)
        with open(tmp / META_FILE, "w") as fh:
            json.dump(meta, fh, indent=1)
        if out_dir.exists():
            trash = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out_dir, trash)
            os.rename(tmp, out_dir)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):  # a full disk, a read-only mount, permissions: the user's to fix
            raise DataError(f"cannot write the cache to {out_dir}: {exc.strerror or exc}") from None
        raise
    return out_dir


def _warn_stderr(message: str) -> None:
    print(f"numbarl-data: warning: {message}", file=sys.stderr, flush=True)


def build_cache(
    inputs: Sequence,
    out_dir,
    *,
    symbol: str | None = None,
    bar_params: BarParams = BarParams(),
    feature_names: str | Sequence[str] | None = None,
    feature_params: FeatureParams = FeatureParams(),
    calendar: SessionCalendar | None = None,
    tick_size: float | None = None,
    folds: dict | None = None,
    overwrite: bool = False,
    chunk_bytes: int | None = None,
    progress: ProgressFn | None = None,
    fmt: str | None = None,
    warn: Callable[[str], None] | None = None,
) -> Path:
    """Market-data files -> imbalance bars -> features -> fxcache folder ``out_dir``.

    ``inputs``: Databento DBN/CSV, LOBSTER message + order-book files, or Binance captures; the
    format is detected (``fmt`` forces one: readers.FORMATS). ``calendar``: None takes the
    format's (CME Globex for Databento, US equities for LOBSTER, UTC days for Binance).
    ``tick_size``: the instrument's known tick; None estimates it causally (validate.py): features
    at each bar use the estimate in force at its close, and ``meta.tick_size`` is the one in force
    at the first bar (no later record decides it). ``warn``: where one-line warnings go (skipped
    book states and trades, a tick estimate that changed); default stderr.
    """
    warn = warn or _warn_stderr
    out_dir = check_destination(out_dir, overwrite)
    names = resolve_features(feature_names)
    if tick_size is not None and not (np.isfinite(tick_size) and tick_size > 0):
        raise DataError(f"tick_size must be > 0, got {tick_size}")
    stream = RecordStream(list(inputs), symbol, chunk_bytes, fmt)
    calendar = calendar if calendar is not None else stream.calendar
    builder = BarBuilder(bar_params, calendar, tick_size)
    parts = []
    # the sha256 of the source files (cache provenance) on a second thread: hashlib releases the
    # GIL, so hashing overlaps decoding and bar building instead of following them
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="numbarl-sha256")
    digests = pool.submit(lambda: {p: file_sha256(p) for p in stream.paths})
    try:
        for _, chunk in stream:
            bars = builder.push(chunk, locate=stream.locate)
            if len(bars):
                parts.append(bars)
            if progress is not None:
                progress("records", builder.records_seen, None)
        sources = stream.source_files(digests.result()) if parts else []
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    skipped = builder.counts
    for line in stream.warnings:
        warn(line)
    for kind, count in skipped.items():
        if count:
            warn(f"skipped {count} {SKIP_NAMES[kind]}")
    if not parts:
        bad = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in skipped.items() if n)
        raise DataError(f"no bars from {builder.no_bars_reason()}" + (f" (skipped: {bad})" if bad else ""))
    bars = np.concatenate(parts)
    if tick_size is not None:
        tick, source = float(tick_size), "given"
    else:
        tick, source = estimate_tick_size(bars), "estimated causally: the tick in force at the first bar's close"
    changes = _tick_changes(bars)
    if tick_size is None and len(changes) > 1:
        listed = ", ".join(f"{t:g} from bar {i}" for i, t in changes[:4])
        warn(f"the tick size estimate changed during the data ({listed}); features use the estimate in force at "
             f"each bar, the cache's tick_size is {tick:g}; pass --tick-size with the contract's tick")
    if progress is not None:
        progress("features", 0, len(names))
    features = compute_features(bars, names, None, feature_params, calendar)
    extra = {
        "tick_size_source": source,
        "tick_size_changes": [[int(i), float(t)] for i, t in changes],
        "skipped": skipped,
        "formats": sorted({inp.kind for inp in stream.inputs}),
    }
    units = {info.size_unit for info in stream.infos if getattr(info, "size_unit", None)}
    if units:
        extra["size_unit"] = float(min(units))
    return write_cache(
        out_dir, bars, features, names,
        tick_size=tick, bar_params=bar_params, feature_params=feature_params, calendar=calendar,
        source_files=sources, symbol=stream.symbol_name, folds=folds, overwrite=overwrite, extra_meta=extra,
    )  # fmt: skip


def _tick_changes(bars: np.ndarray) -> list[tuple[int, float]]:
    """(bar index, tick) wherever the per-bar tick (known or estimated) takes a new value."""
    ticks = np.asarray(bars["tick"], np.float64)
    if len(ticks) == 0:
        return []
    at = np.flatnonzero(np.r_[True, ticks[1:] != ticks[:-1]])
    return [(int(i), float(ticks[i])) for i in at if ticks[i] > 0]


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
def load_cache(path, expect_features: str | Sequence[str] | None = None, mmap: bool = True) -> Cache:
    """Open a cache (memory-mapped). ``expect_features``: the feature list the caller was
    configured with; any difference (missing, extra, order) is a DataError."""
    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.exists():
        raise DataError(f"{path}: not a numbarl feature cache (no {META_FILE}); build one with numbarl-data build or synth")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{meta_path}: unreadable ({exc})") from None
    if not isinstance(meta, dict):
        raise DataError(f"{meta_path}: not a cache description (a JSON object), got a {type(meta).__name__}")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise DataError(
            f"{path}: cache format_version {version!r}, this numbarl reads version {FORMAT_VERSION}; rebuild the cache"
        )
    kinds = {"feature_names": list, "n_bars": int, "n_sessions": int, "bars_per_day": (int, float),
             "tick_size": (int, float), "bar_params": dict}
    for key, kind in kinds.items():
        if key not in meta:
            raise DataError(f"{meta_path}: missing field {key!r}")
        if not isinstance(meta[key], kind) or isinstance(meta[key], bool):
            raise DataError(f"{meta_path}: field {key!r} = {meta[key]!r} has the wrong type; rebuild the cache")
    if not all(isinstance(name, str) for name in meta["feature_names"]):
        raise DataError(f"{meta_path}: field 'feature_names' must list names (strings)")
    n_bars, n_feat = int(meta["n_bars"]), len(meta["feature_names"])
    expected = {
        "features": (np.float32, (n_bars, n_feat)),
        "timestamps": (np.int64, (n_bars,)),
        "session_id": (np.int32, (n_bars,)),
        **{name: (np.float64, (n_bars,)) for name in PRICE_ARRAYS},
    }
    arrays = {}
    mode = "r" if mmap else None
    for name, (dtype, shape) in expected.items():
        arrays[name] = _load_array(path, name, dtype, shape, mode)
    bars = _load_array(path, "bars", BAR_DTYPE, (n_bars,), mode, required=False)
    oracle = _load_array(path, "oracle", np.float32, (n_bars,), mode, required=False)
    sid = arrays["session_id"]
    if n_bars and (sid[0] != 0 or sid[-1] != int(meta["n_sessions"]) - 1 or np.any(np.diff(sid) < 0)):
        raise DataError(f"{path}: session_id is not 0..n_sessions-1 in order")
    if expect_features is not None:
        wanted = resolve_features(expect_features)
        have = list(meta["feature_names"])
        if wanted != have:
            missing = [f for f in wanted if f not in have]
            extra = [f for f in have if f not in wanted]
            detail = []
            if missing:
                detail.append(f"missing {', '.join(missing)}")
            if extra:
                detail.append(f"not asked for {', '.join(extra)}")
            if not detail:
                detail.append("same features in another order")
            raise DataError(
                f"{path}: the cache's feature list does not match the configuration ({'; '.join(detail)}); "
                "rebuild the cache with the configured --features"
            )
    return Cache(path=path, meta=meta, bars=bars, oracle=oracle, **arrays)


def _load_array(path: Path, name: str, dtype, shape, mode, required: bool = True):
    file = path / f"{name}.npy"
    if not file.exists():
        if required:
            raise DataError(f"{path}: missing {file.name}; the cache is incomplete, rebuild it")
        return None
    try:
        arr = np.load(file, mmap_mode=mode, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"{file}: unreadable ({exc})") from None
    if arr.dtype != np.dtype(dtype) or tuple(arr.shape) != tuple(shape):
        raise DataError(f"{file}: expected {np.dtype(dtype) if name != 'bars' else 'BAR_DTYPE'} {tuple(shape)}, found {arr.dtype if name != 'bars' else 'other'} {tuple(arr.shape)}")
    return arr
