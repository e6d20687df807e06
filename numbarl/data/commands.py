"""``numbarl-data``: build, generate, inspect and export feature caches.

    numbarl-data build INPUT... --out DIR [--format F] [--symbol S] [--bars-per-day N | --mode ewma] [--features LIST]
    numbarl-data synth --out DIR --sessions N --seed S [--signal X | --null]
    numbarl-data inspect DIR [--json]
    numbarl-data export DIR --parquet FILE

Inputs: Databento MBP-10 DBN/CSV files, LOBSTER message + order-book file pairs, Binance websocket
captures (detected, or --format). Bad input (unreadable, truncated or corrupt files, wrong schema,
unsorted or impossible timestamps, crossed books inside the session, unknown features, too few
sessions for the requested folds) ends with one line on stderr and exit code 2, and no cache
folder is left behind. What a build skips (crossed books outside the session, invalid book
states or trades) is one warning line per kind on stderr.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import uuid
from pathlib import Path

import click
import numpy as np

from numbarl.data.errors import DataError
from numbarl.data.splits import DEFAULT_SPLIT



class DataCommandError(click.ClickException):
    """A DataError as a one-line CLI error with exit code 2."""

    exit_code = 2

    def show(self, file=None):
        click.echo(f"numbarl-data: error: {self.message}", err=True)


class DataGroup(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DataError as exc:
            raise DataCommandError(str(exc)) from None


def _progress():
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    return Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True, disable=not console.is_terminal,
    )  # fmt: skip


def _fold_spec(options: dict) -> dict | None:
    if options.get("folds") is None:
        return None
    return {"n_folds": options["folds"], **{name: options[name] for name in DEFAULT_SPLIT}}


def fold_options(fn):
    """--folds and friends: check that the cache can be split before writing it, with the split
    numbarl-train uses (numbarl/data/splits.py: the same defaults, the same walk_forward)."""
    options = [
        click.option("--folds", type=int, default=None, help="Require this many walk-forward folds, split as numbarl-train splits them (checked before writing)."),
        *(click.option(f"--{name.replace('_', '-')}", type=int, default=DEFAULT_SPLIT[name], show_default=True,
                       help=f"As numbarl-train's train.{name}.") for name in DEFAULT_SPLIT),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@click.group(cls=DataGroup, name="numbarl-data", help=__doc__.split("\n\n")[0],
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="numbarl", prog_name="numbarl-data", message="%(prog)s %(version)s")
def data_group():
    pass


@data_group.command()
@click.version_option(package_name="numbarl", prog_name="numbarl-data", message="%(prog)s %(version)s")
@click.argument("inputs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Cache folder to create.")
@click.option("--format", "fmt", type=click.Choice(["auto", "dbn", "csv", "lobster", "binance"]), default="auto",
              show_default=True, help="Input format (auto: detected from each file).")
@click.option("--symbol", default=None, help="Raw symbol (DBN metadata, CSV, LOBSTER ticker, Binance symbol) or instrument_id.")
@click.option("--bars-per-day", type=int, default=None, help="Target bars per session (target mode, default 7500).")
@click.option("--mode", type=click.Choice(["target", "ewma"]), default=None, help="Bar threshold mode.")
@click.option("--ewma-initial-trades", type=float, default=None, help="ewma mode: expected trades per bar at the start (default 100).")
@click.option("--ewma-min-trades", type=float, default=None, help="ewma mode: lower clamp of the expected trades per bar (default 10).")
@click.option("--ewma-max-trades", type=float, default=None, help="ewma mode: upper clamp of the expected trades per bar (default 1000).")
@click.option("--features", "features", default=None, help="Comma list of feature names ('default' = the default set).")
@click.option("--tick-size", type=float, default=None, help="The contract's tick; default: estimated causally from the book.")
@click.option("--tz", default=None, help="Exchange timezone (IANA); default: the format's (CME America/Chicago, LOBSTER America/New_York, Binance UTC).")
@click.option("--session-open", default=None, help="Local session open (HH:MM); default: the format's (CME 17:00).")
@click.option("--session-close", default=None, help="Local session close (HH:MM, 24:00 = midnight); default: the format's (CME 16:00).")
@click.option("--allow-crossed", is_flag=True, help="Skip crossed book states inside the session too (outside it they are always skipped).")
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
@fold_options
def build(inputs, out, fmt, symbol, bars_per_day, mode, ewma_initial_trades, ewma_min_trades, ewma_max_trades,
          features, tick_size, tz, session_open, session_close, allow_crossed, force, **folds):
    """Market data (Databento .dbn/.dbn.zst/.csv, LOBSTER, Binance) -> imbalance bars -> features -> cache."""
    from numbarl.data.bars import BarParams
    from numbarl.data.calendar import SessionCalendar
    from numbarl.data.fxcache import build_cache

    if mode == "ewma" and bars_per_day is not None:
        raise click.UsageError("--bars-per-day sets the target mode; it cannot be combined with --mode ewma")
    ewma = {k: v for k, v in (("ewma_initial_trades", ewma_initial_trades), ("ewma_min_trades", ewma_min_trades),
                              ("ewma_max_trades", ewma_max_trades)) if v is not None}
    if ewma and mode != "ewma":
        raise click.UsageError("--ewma-* options set the ewma mode's clamps; pass --mode ewma")
    if "ewma_initial_trades" not in ewma and ewma:
        # keep the start inside the clamps that were given
        lo, hi = ewma.get("ewma_min_trades", BarParams.ewma_min_trades), ewma.get("ewma_max_trades", BarParams.ewma_max_trades)
        ewma["ewma_initial_trades"] = min(max(BarParams.ewma_initial_trades, lo), hi)
    params = BarParams(
        mode=mode or "target",
        bars_per_day=BarParams.bars_per_day if bars_per_day is None else bars_per_day,
        allow_crossed=allow_crossed,
        **ewma,
    )
    calendar = None
    if tz is not None or session_open is not None or session_close is not None:
        from numbarl.data.readers import default_calendar, resolve_inputs

        base = default_calendar(resolve_inputs(inputs, fmt))  # what is not given stays the format's
        calendar = SessionCalendar(tz or base.tz, session_open or base.open_time, session_close or base.close_time,
                                   weekends=base.weekends)
    with _progress() as progress:
        task = progress.add_task("reading records", total=None)

        def report(stage, done, total):
            if stage == "records":
                progress.update(task, completed=done, description="records -> bars")
            else:
                progress.update(task, description="features", completed=done, total=total)

        def warn(message):
            progress.console.print(f"numbarl-data: warning: {message}", markup=False, highlight=False, soft_wrap=True) \
                if progress.console.is_terminal else click.echo(f"numbarl-data: warning: {message}", err=True)

        path = build_cache(
            inputs, out, symbol=symbol, bar_params=params, feature_names=features, calendar=calendar,
            tick_size=tick_size, folds=_fold_spec(folds), overwrite=force, progress=report, fmt=fmt, warn=warn,
        )  # fmt: skip
    _summary(path)


@data_group.command()
@click.version_option(package_name="numbarl", prog_name="numbarl-data", message="%(prog)s %(version)s")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Cache folder to create.")
@click.option("--sessions", type=int, default=None, help="Sessions in the cache (default 20; 4 with --tiny).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--signal", type=float, default=None, help="Planted signal strength in [0, 1] (default 0.2).")
@click.option("--null", "null", is_flag=True, help="No planted signal (control dataset).")
@click.option("--events-per-session", type=int, default=None, help="Order-book events per session.")
@click.option("--bars-per-day", type=int, default=None, help="Target bars per session.")
@click.option("--tiny", is_flag=True, help="Tiny dataset for tests (4 sessions, seconds).")
@click.option("--features", "features", default=None, help="Comma list of feature names.")
@click.option("--dbn", "dbn_out", type=click.Path(path_type=Path), default=None, help="Also write the records as DBN.")
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
@fold_options
def synth(out, sessions, seed, signal, null, events_per_session, bars_per_day, tiny, features, dbn_out, force, **folds):
    """Synthetic MBP-10 market with a planted order-flow signal -> cache (with oracle.npy)."""
    from numbarl.data import synth as synth_mod

    if null and signal is not None:
        raise click.UsageError("--signal and --null exclude each other")
    base = dict(synth_mod.TINY) if tiny else {
        "sessions": synth_mod.DEFAULT_SESSIONS, "events_per_session": synth_mod.DEFAULT_EVENTS,
        "bars_per_day": synth_mod.DEFAULT_BARS_PER_DAY,
    }  # fmt: skip
    if sessions is not None:
        base["sessions"] = sessions
    if events_per_session is not None:
        base["events_per_session"] = events_per_session
    if bars_per_day is not None:
        base["bars_per_day"] = bars_per_day
    with _progress() as progress:
        task = progress.add_task("generating sessions", total=base["sessions"] + synth_mod.WARMUP_SESSIONS)
        path = synth_mod.build_synthetic_cache(
            out, base["sessions"], seed,
            synth_mod.DEFAULT_SIGNAL if signal is None else signal, null,
            events_per_session=base["events_per_session"], bars_per_day=base["bars_per_day"],
            feature_names=features, folds=_fold_spec(folds), overwrite=force, dbn_out=dbn_out,
            progress=lambda stage, done, total: progress.update(task, completed=done),
        )  # fmt: skip
    _summary(path)


def _summary(path: Path):
    from numbarl.data.fxcache import load_cache

    cache = load_cache(path)
    click.echo(
        f"wrote {path}: {cache.n_bars} bars, {cache.n_sessions} sessions, "
        f"{cache.bars_per_day:.1f} bars/day, {len(cache.feature_names)} features"
    )


def describe(cache) -> dict:
    """Summary of a cache: sizes, span, per-feature mean/std/NaN count (as ``inspect`` prints)."""
    from numbarl.data.features import REGISTRY

    feats = cache.features
    n = cache.n_bars
    stats = []
    step = 65536
    total = np.zeros(feats.shape[1])
    total_sq = np.zeros(feats.shape[1])
    nan = np.zeros(feats.shape[1], np.int64)
    finite_count = np.zeros(feats.shape[1], np.int64)
    for start in range(0, n, step):
        block = np.asarray(feats[start : start + step], np.float64)
        ok = np.isfinite(block)
        nan += np.isnan(block).sum(axis=0)
        finite_count += ok.sum(axis=0)
        block = np.where(ok, block, 0.0)
        total += block.sum(axis=0)
        total_sq += (block * block).sum(axis=0)
    count = np.maximum(finite_count, 1)
    mean = total / count
    std = np.sqrt(np.maximum(total_sq / count - mean * mean, 0.0))
    for j, name in enumerate(cache.feature_names):
        spec = REGISTRY.get(name)
        stats.append(
            {"name": name, "mean": float(mean[j]), "std": float(std[j]), "nan": int(nan[j]),
             "description": spec.doc if spec else ""}
        )  # fmt: skip
    ts = cache.timestamps
    span = [
        dt.datetime.fromtimestamp(int(ts[0]) / 1e9, dt.timezone.utc).isoformat(),
        dt.datetime.fromtimestamp(int(ts[-1]) / 1e9, dt.timezone.utc).isoformat(),
    ]
    meta = cache.meta
    return {
        "path": str(cache.path),
        "bars": n,
        "sessions": cache.n_sessions,
        "bars_per_day": cache.bars_per_day,
        "first_session": meta.get("session_dates", [None])[0],
        "last_session": meta.get("session_dates", [None])[-1],
        "time_span_utc": span,
        "tick_size": cache.tick_size,
        "symbol": meta.get("symbol"),
        "bar_params": meta.get("bar_params"),
        "source_files": meta.get("source_files"),
        "synthetic": meta.get("synthetic"),
        "created_by": meta.get("created_by"),
        "features": stats,
    }


@data_group.command()
@click.version_option(package_name="numbarl", prog_name="numbarl-data", message="%(prog)s %(version)s")
@click.argument("cache_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def inspect(cache_dir, as_json):
    """Bars, sessions, bars/day, time span and per-feature mean/std/NaN count of a cache."""
    from numbarl.data.fxcache import load_cache

    if not Path(cache_dir).exists():
        raise DataError(f"{cache_dir}: no such folder")
    info = describe(load_cache(cache_dir))
    if as_json:
        click.echo(json.dumps(info, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]{info['path']}[/bold]  symbol {info['symbol']}  tick {info['tick_size']:g}\n"
        f"{info['bars']} bars, {info['sessions']} sessions ({info['first_session']} .. {info['last_session']}), "
        f"{info['bars_per_day']:.1f} bars/day, mode {info['bar_params'].get('mode')}\n"
        f"span {info['time_span_utc'][0]} .. {info['time_span_utc'][1]}  ({info['created_by']})"
    )
    table = Table("feature", "mean", "std", "NaN", "description")
    for row in info["features"]:
        table.add_row(row["name"], f"{row['mean']:+.3f}", f"{row['std']:.3f}", str(row["nan"]), row["description"])
    console.print(table)


@data_group.command()
@click.version_option(package_name="numbarl", prog_name="numbarl-data", message="%(prog)s %(version)s")
@click.argument("cache_dir", type=click.Path(path_type=Path))
@click.option("--parquet", "parquet", required=True, type=click.Path(path_type=Path), help="Parquet file to write.")
@click.option("--force", is_flag=True, help="Replace --parquet if it exists.")
def export(cache_dir, parquet, force):
    """Write a cache's bars, prices and features as one Parquet table."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from numbarl.data.fxcache import load_cache

    if Path(parquet).is_file() and not force:
        raise DataError(f"--parquet {parquet} already exists; choose another name or pass --force to replace it")
    blocking = next((p for p in Path(parquet).parents if p.is_file()), None)
    if blocking is not None:  # checked before the cache is read
        raise DataError(f"--parquet {parquet}: {blocking} is a file, not a folder")
    cache = load_cache(cache_dir)
    columns = {
        "timestamp": pa.array(np.asarray(cache.timestamps), pa.timestamp("ns", tz="UTC")),
        "session_id": np.asarray(cache.session_id),
    }
    for name in ("mid", "bid", "ask", "high", "low"):
        columns[name] = np.asarray(getattr(cache, name))
    if cache.bars is not None:
        bars = cache.bars
        for name in bars.dtype.names:
            if bars.dtype[name].shape == ():
                columns[f"bar_{name}"] = np.asarray(bars[name])
            else:
                for m in range(bars.dtype[name].shape[0]):
                    columns[f"bar_{name}_{m + 1}"] = np.asarray(bars[name][:, m])
    if cache.oracle is not None:
        columns["oracle"] = np.asarray(cache.oracle)
    for j, name in enumerate(cache.feature_names):
        columns[f"f_{name}"] = np.asarray(cache.features[:, j])
    table = pa.table(columns)
    parquet = Path(parquet)
    if parquet.is_dir():
        raise DataError(f"--parquet {parquet} is a folder; name the file to write")
    tmp = parquet.with_name(f".{parquet.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        parquet.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, tmp)
        os.replace(tmp, parquet)
    except BaseException as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # a file where a folder should be: there is no temporary file to remove
            pass
        if isinstance(exc, OSError):  # full disk, read-only mount, a file where a folder should be
            raise DataError(f"cannot write {parquet}: {exc.strerror or exc}") from None
        raise
    click.echo(f"wrote {parquet}: {table.num_rows} rows, {table.num_columns} columns")


def data_main(argv=None):
    """Console entry point of ``numbarl-data``."""
    try:
        data_group.main(args=argv, prog_name="numbarl-data", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort as exc:
        if isinstance(exc.__context__, KeyboardInterrupt):  # click turns Ctrl-C into Abort
            click.echo("numbarl-data: interrupted (no cache written)", err=True)
            sys.exit(130)
        click.echo("numbarl-data: aborted", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("numbarl-data: interrupted (no cache written)", err=True)
        sys.exit(130)
    sys.exit(0)
