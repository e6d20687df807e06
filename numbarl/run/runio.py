"""The run folder: resolved config, metrics log, atomic checkpoints, trades, equity, summary.

One `numbarl-train` run owns one folder (SPEC §6)::

    RUN_DIR/
      run.json                  run marker: format version, numbarl version, creation time, meta
      config.json               the resolved config (every value the run used)
      train.log                 the run's progress lines, timestamped (written by the trainer)
      metrics.jsonl             one JSON record per log step ("train"), validation ("val"), test ("test"; and
                                "test_policy", the policy's own, where train.deploy_min_trade_t held the test window
                                flat), each with its wall clock (time, elapsed_s)
      metrics.csv               the same records as a table (union of columns), rebuilt by write_csv()
      checkpoints/
        <tag>.npz               arrays (flat params, Adam moments, RNG counters, env cursors, ...)
                                plus the state dict embedded as JSON: the .npz alone is the checkpoint
        <tag>.<id>.resume.npz   the replay buffer: only an exact --resume needs it, so only the
                                latest checkpoint keeps it (older epochs stay a few MB)
        <tag>.json              human-readable copy of the state and a manifest of the arrays
        latest.json             {"tag": ...}: the checkpoint `--resume` continues from
        best.json               {"tag": ..., "score": ...}: best by validation score
      trades_<split>.csv        trade list per split ("val", "test", ...), a `fold` column per row
      equity/<split>_fold<k>.npz  per-bar pnl, equity, position, session id (drawdown is derived) for
                                the report and the pooled metrics; <split>_fold<k>.csv the same as a table
      summary.json              per fold: val and test metrics, bars_per_day, seed, version, device;
                                "pooled" and "headline": the folds' windows concatenated (run/pooled.py)
      report.html, report.png   written by numbarl.run.report.write_report

Crash safety. Every file except metrics.jsonl is written to a temporary name in its own folder,
flushed, fsync'ed, then moved over the final name with `os.replace` (atomic on POSIX and Windows
within one file system), and the folder is fsync'ed. A reader therefore sees either the old or
the new file, never a torn one. A checkpoint is committed in three atomic steps: `<tag>.npz`
(arrays and state together, so that it is self-consistent on its own), then `<tag>.json`, then
`latest.json`. A crash before the last step leaves `latest.json` pointing at the previous
checkpoint, which is untouched. Temporary files left by a killed process are removed by
`RunDir.open`.

Background checkpoints. `save_checkpoint_async` (what the trainer uses) checks the arrays and
serializes the state in the caller's thread, then runs the same commit steps on a writer thread,
so that serialization, fsync and renames overlap with training; the best pointer, when asked for,
moves only after the commit. One write is in flight at a time, and every RunDir method that
reads or changes checkpoints, pointers or the summary first waits for the write it depends on
(`wait_checkpoint`), so a reader in the writing process never sees a checkpoint older than the
one it saved. Other processes see the files only as they are committed, as above.

metrics.jsonl is append-only (one `write` + flush per record). A process killed mid-write can
leave a partial last line; readers skip it and `truncate_log` removes it. On `--resume`, the
trainer calls `truncate_log(after_step=<checkpoint step>)` so that the log of a killed-and-resumed
run ends identical to the log of an uninterrupted run: records are chronological, so the cut is
at the first record logged after the checkpoint. For that to hold, the trainer logs an epoch's
validation record *before* saving the epoch's checkpoint.

JSON: numpy scalars and arrays become numbers and lists; non-finite floats (NaN, ±inf) become
`null`, so every file is strict JSON that any tool can read.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import shutil
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pandas as pd

import numbarl
from numbarl.run import tensorboard

RUN_FORMAT = "numbarl-run"
RUN_FORMAT_VERSION = 1
RUN_MARKER = "run.json"
CONFIG_FILE = "config.json"
METRICS_JSONL = "metrics.jsonl"
METRICS_CSV = "metrics.csv"
SUMMARY_FILE = "summary.json"
CHECKPOINT_DIR = "checkpoints"
EQUITY_DIR = "equity"
LATEST_FILE = "latest.json"
BEST_FILE = "best.json"
TEMP_MARKER = ".tmp-"  # temporary files are ".<final name>.tmp-<pid>-<random>"

LOG_KINDS = ("train", "val", "test", "test_policy", "val_feedback", "feedback", "train_path")
CSV_LEADING_COLUMNS = ("kind", "fold", "epoch", "step")  # first columns of metrics.csv, when present
STATE_KEY = "__state__"  # reserved array name: the checkpoint's state dict as UTF-8 JSON bytes
RESUME_SUFFIX = ".resume.npz"  # a checkpoint's resume-only arrays (replay buffer), latest checkpoint only
RESERVED_TAGS = ("latest", "best")
TAG_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
SPLIT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,63}$")
EQUITY_SERIES = ("pnl", "equity", "position")  # per-bar float series; at least pnl or equity


def _checkpoint_array(name, value) -> np.ndarray:
    if not isinstance(name, str) or not name or name.startswith("__"):
        raise ValueError(f"checkpoint array name {name!r} is not valid (non-empty, no leading '__')")
    array = np.asarray(value)
    if array.dtype == object:
        raise TypeError(f"checkpoint array {name!r} has dtype object; save numeric arrays only")
    return array


class RunError(Exception):
    """A run folder is missing, is not a numbarl run, or holds something unreadable."""


# ----------------------------------------------------------------------------------------------
# JSON and atomic files
# ----------------------------------------------------------------------------------------------


def to_jsonable(value):
    """`value` with numpy scalars/arrays turned into Python numbers/lists, tuples into lists,
    paths into strings and non-finite floats into None (JSON `null`)."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                if isinstance(key, (int, np.integer)):
                    key = str(int(key))
                else:
                    raise TypeError(f"JSON object keys must be strings, got {key!r}")
            out[key] = to_jsonable(item)
        return out
    if isinstance(value, (list, tuple)):
        return [to_jsonable(item) for item in value]
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist())
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"cannot write a {type(value).__name__} to JSON: {value!r}")


def dumps(value, indent: int | None = None) -> str:
    """Strict JSON text of `value` (see :func:`to_jsonable`)."""
    return json.dumps(to_jsonable(value), indent=indent, allow_nan=False)


def _fsync_dir(folder: Path) -> None:
    """Make a rename inside `folder` durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write) -> Path:
    """Write a file so that readers see the old content or the new content, never a mix.

    `write(f)` fills a binary file object opened on a temporary name in the same folder; the
    file is flushed and fsync'ed, then moved over `path` with os.replace and the folder is
    fsync'ed. On any exception (including a failing os.replace) the temporary file is removed and
    `path` is left as it was.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}{TEMP_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_json(path: str | os.PathLike, value) -> Path:
    return atomic_write_bytes(path, (dumps(value, indent=2) + "\n").encode("utf-8"))


def _read_json(path: Path, what: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as err:
        raise RunError(f"{what} {path} cannot be read: {err}") from err


def _pid_alive(pid: int) -> bool:
    """Is process `pid` running (on this machine)? A temp folder of a live process is its own."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not TAG_PATTERN.match(tag) or TEMP_MARKER in tag:
        raise ValueError(
            f"checkpoint tag {tag!r} is not valid: use 1-128 letters, digits, '_', '-', '.', "
            "starting with a letter or digit (e.g. 'f0-e003')"
        )
    if tag in RESERVED_TAGS:
        raise ValueError(f"checkpoint tag {tag!r} is reserved (it names a pointer file); pick another")
    if tag.endswith(".resume"):
        raise ValueError(f"checkpoint tag {tag!r} is not valid: '.resume' ends the names of resume files")
    return tag


def _check_split(split: str) -> str:
    if not isinstance(split, str) or not SPLIT_PATTERN.match(split):
        raise ValueError(f"split name {split!r} is not valid: use letters, digits, '_', '-' (e.g. 'test')")
    return split


def flatten_record(record: dict, prefix: str = "") -> dict:
    """Nested dicts flattened to dotted keys ({"val": {"sharpe": 1}} -> {"val.sharpe": 1}); lists
    become JSON text so that every value fits one CSV cell."""
    flat = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_record(value, prefix=f"{name}."))
        elif isinstance(value, list):
            flat[name] = json.dumps(value)
        else:
            flat[name] = value
    return flat


# ----------------------------------------------------------------------------------------------
# the run folder
# ----------------------------------------------------------------------------------------------


class _BackgroundWrite:
    """One checkpoint being committed on its own (non-daemon) thread: RunDir.save_checkpoint_async."""

    def __init__(self, run: RunDir, job: dict, mark_best: tuple | None):
        self.tag = job["tag"]
        self.bytes = sum(a.nbytes for part in ("arrays", "resume_arrays") for a in job[part].values())
        self.error = None
        self.committed = False  # the checkpoint is on disk (an error after it: the best pointer's)
        self.seconds = 0.0
        self._run, self._job, self._mark_best = run, job, mark_best
        self.thread = threading.Thread(target=self._write, name=f"numbarl-checkpoint-{self.tag}", daemon=False)

    def _write(self):
        t0 = time.perf_counter()
        try:
            self._run._commit_checkpoint(self._job)
            self.committed = True
            if self._mark_best is not None:
                self._run.mark_best(*self._mark_best)
        except BaseException as err:  # noqa: BLE001 - raised again in the thread that waits for the write
            self.error = err
        finally:
            self._job = None  # the host snapshot is not kept once it is on disk
            self.seconds = time.perf_counter() - t0


class RunDir:
    """One run folder. Create with :meth:`create`, reopen with :meth:`open`.

    Attributes: `path` (Path), `config` (dict, the resolved config), `meta` (dict, the run
    marker's content: format version, numbarl version, creation time and the caller's meta).
    """

    def __init__(self, path: Path, config: dict, meta: dict):
        self.path = Path(path)
        self.config = config
        self.meta = meta
        self._pending = None  # the checkpoint being written in the background (save_checkpoint_async)
        # the background writes committed so far: how many, their array bytes, the writer thread's
        # seconds, and the seconds callers waited for them (the only part on their critical path)
        self.checkpoint_writes = {"count": 0, "bytes": 0, "write_s": 0.0, "waited_s": 0.0}
        # called (in the waiting thread) when a background write has been waited for: a dict with
        # tag, waited_s, write_s, bytes, committed (the checkpoint is on disk) and error (None, or
        # the exception raised next: with committed, the best pointer's update failed)
        self.on_checkpoint_written = None

    # -- paths ---------------------------------------------------------------------------------

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / CHECKPOINT_DIR

    @property
    def equity_dir(self) -> Path:
        return self.path / EQUITY_DIR

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS_JSONL

    @property
    def csv_path(self) -> Path:
        return self.path / METRICS_CSV

    @property
    def summary_path(self) -> Path:
        return self.path / SUMMARY_FILE

    def trades_path(self, split: str) -> Path:
        return self.path / f"trades_{_check_split(split)}.csv"

    def equity_path(self, split: str, fold: int) -> Path:
        return self.equity_dir / f"{_check_split(split)}_fold{int(fold)}.npz"

    def equity_csv_path(self, split: str, fold: int) -> Path:
        return self.equity_dir / f"{_check_split(split)}_fold{int(fold)}.csv"

    # -- create / open -------------------------------------------------------------------------

    @staticmethod
    def check_destination(path, exist_ok: bool = False) -> Path:
        """Refuse, before anything is computed, a run folder that cannot be made at `path`: a file
        there or above it, a non-empty folder (without `exist_ok`), or a place not writable."""
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise RunError(f"cannot create run folder {path}: a file with that name exists")
        if path.is_dir() and any(path.iterdir()) and not exist_ok:
            raise RunError(
                f"run folder {path} already exists and is not empty; pick a new --out folder, "
                "or continue that run with --resume"
            )
        if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
            raise RunError(f"cannot create run folder {path}: the folder is not writable")
        # the folder is made as a temporary sibling and renamed into place: the nearest existing
        # folder above it must be writable
        ancestor = path.parent
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise RunError(f"cannot create run folder {path}: {ancestor} is a file, not a folder")
        if not os.access(ancestor, os.W_OK | os.X_OK):
            raise RunError(f"cannot create run folder {path}: {ancestor} is not writable")
        return path

    @classmethod
    def create(cls, path, config: dict, meta: dict | None = None, exist_ok: bool = False) -> "RunDir":
        """Make a new run folder and write config.json, then the run marker run.json (last, so
        that a folder with a marker always has its config).

        A folder that exists and is not empty is an error unless `exist_ok` (then config and
        marker are rewritten; other files stay). `meta` is free-form run information (seed,
        device, data source, command line) stored in run.json.
        """
        path = cls.check_destination(path, exist_ok)
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict (the resolved config), got {type(config).__name__}")
        config = to_jsonable(config)
        marker = {
            "format": RUN_FORMAT,
            "format_version": RUN_FORMAT_VERSION,
            "numbarl_version": numbarl.__version__,
            "created": _utc_now(),
        }
        if meta:
            marker.update(to_jsonable(dict(meta)))
        try:
            return cls._create(path, config, marker, exist_ok)
        except OSError as err:  # a race with the checks above, a full disk, a read-only mount
            raise RunError(f"cannot create run folder {path}: {err.strerror or err}") from None

    @classmethod
    def _create(cls, path: Path, config: dict, marker: dict, exist_ok: bool) -> "RunDir":
        if path.is_dir() and exist_ok:
            (path / CHECKPOINT_DIR).mkdir(exist_ok=True)
            atomic_write_json(path / CONFIG_FILE, config)
            atomic_write_json(path / RUN_MARKER, marker)
            return cls(path, config, marker)
        # a new folder appears whole (temp folder + rename): a kill while it is made leaves no
        # half-made run folder under the --out name
        made = []  # parent folders this call creates: removed again if the run folder is not made
        for folder in reversed(path.parents):
            if not folder.exists():
                made.append(folder)
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}{TEMP_MARKER}*"):  # a creation killed before
            pid = stale.name[len(f".{path.name}{TEMP_MARKER}"):].split("-", 1)[0]
            if stale.is_dir() and pid.isdigit() and not _pid_alive(int(pid)):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = path.parent / f".{path.name}{TEMP_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            (tmp / CHECKPOINT_DIR).mkdir(parents=True)
            atomic_write_json(tmp / CONFIG_FILE, config)
            atomic_write_json(tmp / RUN_MARKER, marker)
            os.rename(tmp, path)  # onto an empty folder too (POSIX)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            for folder in reversed(made):
                try:
                    folder.rmdir()
                except OSError:
                    break
            raise
        _fsync_dir(path.parent)
        return cls(path, config, marker)

    @classmethod
    def open(cls, path, clean: bool = False) -> "RunDir":
        """Open an existing run folder (for `numbarl-train --resume`, `numbarl-backtest`, ...).

        Raises RunError naming the folder and what is missing when `path` is not a run folder.
        `clean=True` (the resuming writer only) removes temporary files left behind by a process
        that was killed while writing; readers leave them alone, since a live writer may own them.
        """
        path = Path(path)
        if not path.exists():
            raise RunError(f"run folder {path} does not exist")
        if not path.is_dir():
            raise RunError(f"{path} is a file, not a run folder")
        missing = [name for name in (RUN_MARKER, CONFIG_FILE) if not (path / name).is_file()]
        if missing:
            raise RunError(
                f"{path} is not a numbarl run folder: {' and '.join(missing)} missing "
                "(run folders are made by numbarl-train --out)"
            )
        marker = _read_json(path / RUN_MARKER, "run marker")
        if not isinstance(marker, dict) or marker.get("format") != RUN_FORMAT:
            raise RunError(f"{path} is not a numbarl run folder: {RUN_MARKER} has no format '{RUN_FORMAT}'")
        version = marker.get("format_version")
        if not isinstance(version, int) or version > RUN_FORMAT_VERSION:
            raise RunError(
                f"run folder {path} has format version {version!r}; this numbarl "
                f"({numbarl.__version__}) reads versions up to {RUN_FORMAT_VERSION}: upgrade numbarl"
            )
        config = _read_json(path / CONFIG_FILE, "config")
        if not isinstance(config, dict):
            raise RunError(f"config {path / CONFIG_FILE} is not a JSON object")
        run = cls(path, config, marker)
        if clean:
            run.remove_temp_files()
        return run

    def remove_temp_files(self) -> list[Path]:
        """Delete temporary files left by a killed writer; returns what was removed."""
        removed = []
        for folder in (self.path, self.checkpoints_dir, self.equity_dir):
            if not folder.is_dir():
                continue
            for entry in folder.iterdir():
                if entry.name.startswith(".") and TEMP_MARKER in entry.name and entry.is_file():
                    entry.unlink()
                    removed.append(entry)
        return removed

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # -- metrics log ---------------------------------------------------------------------------

    def log(self, record: dict) -> dict:
        """Append one record to metrics.jsonl and flush; returns the record as written.

        `record["kind"]` is one of LOG_KINDS: "train" (a log step), "val" (a validation backtest), "test",
        "test_policy" (the policy's own test where the deployment rule held the window flat), ...; it
        should carry `step` (the trainer's global step counter; `truncate_log` cuts on it), and
        usually `fold` and `epoch`. Non-finite floats are written as null.
        """
        if not isinstance(record, dict):
            raise TypeError(f"a metrics record is a dict, got {type(record).__name__}")
        kind = record.get("kind")
        if kind not in LOG_KINDS:
            raise ValueError(f"metrics record kind must be one of {LOG_KINDS}, got {kind!r}")
        clean = to_jsonable(record)
        line = json.dumps(clean, allow_nan=False) + "\n"
        self._repair_log_tail()
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
        return clean

    def _repair_log_tail(self) -> None:
        """A process killed mid-write leaves a last line without its newline: cut it off, so
        that the next record does not get glued to it."""
        path = self.metrics_path
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return
        if size == 0:
            return
        with open(path, "rb") as f:
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            f.seek(0)
            data = f.read()
        keep = data[: data.rfind(b"\n") + 1]
        atomic_write_bytes(path, keep)

    def read_metrics(self, kind: str | None = None) -> list[dict]:
        """All complete records of metrics.jsonl (optionally of one kind), in logged order. A
        partial last line (killed writer) is skipped; a corrupt line elsewhere is an error."""
        if not self.metrics_path.is_file():
            return []
        with open(self.metrics_path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        records = []
        last = len(lines) - 1
        for number, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                if number == last:  # no trailing newline: the write was cut short
                    break
                raise RunError(f"{self.metrics_path} line {number + 1} is not JSON: {err}") from err
            if kind is None or record.get("kind") == kind:
                records.append(record)
        return records

    def metrics_frame(self, kind: str | None = None) -> pd.DataFrame:
        """The records as a DataFrame (nested dicts flattened to dotted columns, union of
        columns, leading columns kind/fold/epoch/step)."""
        rows = [flatten_record(r) for r in self.read_metrics(kind)]
        columns: dict[str, None] = {}
        for name in CSV_LEADING_COLUMNS:
            if any(name in row for row in rows):
                columns[name] = None
        for row in rows:
            for name in row:
                columns.setdefault(name, None)
        frame = pd.DataFrame.from_records(rows, columns=list(columns))
        # a column whose values are all integers (steps, counts) stays integer where some records
        # lack it (pandas would make it float: 3.0), as a nullable integer column
        for name in frame.columns:
            values = [row[name] for row in rows if row.get(name) is not None]
            if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                frame[name] = frame[name].astype("Int64")
        return frame

    def write_csv(self) -> Path:
        """Rebuild metrics.csv from metrics.jsonl (atomically). Columns are the union over all
        records; a record without a column leaves the cell empty; null is written empty."""
        frame = self.metrics_frame()
        text = frame.to_csv(index=False, lineterminator="\n")
        tensorboard.write_events(self)  # the same records as TensorBoard scalars (numbarl/run/tensorboard.py)
        return atomic_write_bytes(self.csv_path, text.encode("utf-8"))

    def truncate_log(self, after_step: int, fold: int | None = None, closing_kinds: tuple = ()) -> int:
        """Drop every record logged after the checkpoint at `after_step`; returns how many.

        The log is chronological, so the cut is at the first record with `step > after_step`
        (when `fold` is given and records carry folds: the first record of a later fold, or of
        the same fold with `step > after_step`, for trainers whose step counter restarts per
        fold; `after_step=-1` drops the whole fold). `closing_kinds`: kinds of record a fold logs
        once it ends, at its last checkpoint's step (the test result): they are after that
        checkpoint too. Everything from the cut on is dropped, including a partial last line. The
        file is rewritten atomically, and metrics.csv is rebuilt if it exists.
        """
        after_step = int(after_step)
        records = self.read_metrics()
        cut = len(records)
        for index, record in enumerate(records):
            step = record.get("step")
            record_fold = record.get("fold")
            if fold is not None and record_fold is not None and int(record_fold) != int(fold):
                later = int(record_fold) > int(fold)
            else:
                later = (step is not None and int(step) > after_step) or record.get("kind") in closing_kinds
            if later:
                cut = index
                break
        dropped = len(records) - cut
        if self.metrics_path.is_file():
            text = "".join(json.dumps(r, allow_nan=False) + "\n" for r in records[:cut])
            atomic_write_bytes(self.metrics_path, text.encode("utf-8"))
            if self.csv_path.is_file():
                self.write_csv()
        return dropped

    # -- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, tag: str, arrays: dict, state: dict, latest: bool = True,
                        resume_arrays: dict | None = None) -> Path:
        """Save arrays + state as checkpoint `tag`, atomically; returns the .npz path.

        `arrays`: name -> numpy array (host copies of the flat parameter buffer, Adam moments,
        RNG counters, env cursors, ...). `state`: JSON-able dict (step, fold, epoch, epsilon, best
        score, ...). `resume_arrays`: bulky arrays only an exact resume needs (the replay buffer),
        written to `<tag>.<id>.resume.npz` and kept for the latest checkpoint only: older epochs
        stay small. Steps: the resume file (a new name each save), `<tag>.npz` (arrays, the state
        and the resume file's name and id embedded), `<tag>.json` (readable copy + manifest), then `latest.json` (unless
        `latest=False`), then the other checkpoints' resume files are removed. A crash at any
        point leaves the previous checkpoint loadable and resumable.

        A checkpoint still being written in the background (:meth:`save_checkpoint_async`) is
        finished first: saves are committed in the order they were made.
        """
        self.wait_checkpoint()
        return self._commit_checkpoint(self._prepare_checkpoint(tag, arrays, state, latest, resume_arrays))

    def save_checkpoint_async(self, tag: str, arrays: dict, state: dict, latest: bool = True,
                              resume_arrays: dict | None = None, mark_best: tuple | None = None,
                              handed_over: bool = False) -> None:
        """:meth:`save_checkpoint` with the writing (serialization, fsync, atomic renames) on a
        background thread, off the caller's critical path; then, when `mark_best` is given
        (`(tag, score)` or `(tag, score, higher_is_better)`), :meth:`mark_best` after the commit, so
        that best.json never names a checkpoint that is not on disk yet.

        The caller hands `arrays` and `resume_arrays` over: they must be host snapshots it does
        not modify afterwards (device copies, as the trainer makes); views of other memory are
        copied here, unless `handed_over`: the caller's promise that it leaves every array as it is
        until this write is waited for (the trainer's reused page-locked snapshot buffers, which
        it refills only after :meth:`wait_checkpoint`). `state` is serialized here, so later
        changes to it do not reach the file.
        Names, dtypes and the state are checked here too (errors raise at once).

        At most one write is in flight: a second save first waits for the first. Every method
        of this RunDir that reads or changes checkpoints or pointers waits for the write it
        depends on (:meth:`wait_checkpoint`), and so does :meth:`write_summary`; an error of the
        background write is raised by the next wait. A RunDir is driven from one thread (the
        writer thread is its own). The thread is not a daemon: an exiting
        Python process finishes the write; a killed one leaves the previous checkpoint (the
        commit steps are those of :meth:`save_checkpoint`).
        """
        self.wait_checkpoint()
        job = self._prepare_checkpoint(tag, arrays, state, latest, resume_arrays, own=not handed_over)
        write = _BackgroundWrite(self, job, mark_best)
        self._pending = write
        try:
            write.thread.start()
        except BaseException:  # no thread (a resource limit): nothing is in flight
            self._pending = None
            raise

    def pending_checkpoint(self) -> str | None:
        """The tag of the checkpoint being written in the background (None: every save is on disk)."""
        pending = self._pending
        return pending.tag if pending is not None else None

    def wait_checkpoint(self, tag: str | None = None) -> float:
        """Wait until the background checkpoint write is on disk (only when it is checkpoint `tag`,
        if given); returns the seconds waited. Raises the write's error, if it failed (once).
        Called from the writer thread itself, it returns at once."""
        pending = self._pending
        if pending is None or threading.current_thread() is pending.thread:
            return 0.0
        if tag is not None and tag != pending.tag:
            return 0.0
        t0 = time.perf_counter()
        pending.thread.join()
        waited = time.perf_counter() - t0
        self._pending = None
        stats = self.checkpoint_writes
        stats["waited_s"] += waited
        if pending.committed:
            stats["count"] += 1
            stats["bytes"] += pending.bytes
            stats["write_s"] += pending.seconds
        if self.on_checkpoint_written is not None:
            self.on_checkpoint_written({"tag": pending.tag, "waited_s": waited, "write_s": pending.seconds,
                                        "bytes": pending.bytes, "error": pending.error,
                                        "committed": pending.committed})
        if pending.error is not None:
            raise pending.error
        return waited

    def _prepare_checkpoint(self, tag, arrays, state, latest, resume_arrays, own: bool = False) -> dict:
        """Everything of a save that must happen before the caller goes on: checks, the state as
        JSON, the arrays as numpy arrays (with `own`, copies of any array that is a view of other
        memory)."""
        _check_tag(tag)
        if not isinstance(state, dict):
            raise TypeError(f"checkpoint state must be a dict, got {type(state).__name__}")

        def take(name, value):
            array = _checkpoint_array(name, value)
            if own and (not array.flags.owndata or array.base is not None):
                array = array.copy()
            return array

        payload = {name: take(name, value) for name, value in arrays.items()}
        bulk = {name: take(name, value) for name, value in (resume_arrays or {}).items()}
        if set(bulk) & set(payload):
            raise ValueError(f"checkpoint arrays and resume_arrays share names: {sorted(set(bulk) & set(payload))}")
        return {"tag": tag, "arrays": payload, "resume_arrays": bulk, "state_json": dumps(state),
                "saved": _utc_now(), "latest": bool(latest)}

    def _commit_checkpoint(self, job: dict) -> Path:
        """The file writes of a prepared save, in their crash-safe order (see save_checkpoint)."""
        tag, payload, bulk = job["tag"], dict(job["arrays"]), dict(job["resume_arrays"])
        self.checkpoints_dir.mkdir(exist_ok=True)
        resume_id = resume_name = None
        if bulk:
            resume_id = uuid.uuid4().hex
            resume_name = f"{tag}.{resume_id[:12]}{RESUME_SUFFIX}"  # never overwrites another save's file
            bulk[STATE_KEY] = np.frombuffer(json.dumps({"resume_id": resume_id}).encode("utf-8"), dtype=np.uint8)
            atomic_write(self.checkpoints_dir / resume_name, lambda f: np.savez(f, **bulk))
        save_id = uuid.uuid4().hex
        saved = job["saved"]
        header = {"tag": tag, "save_id": save_id, "saved": saved, "state": json.loads(job["state_json"])}
        if resume_id is not None:
            header["resume_id"], header["resume_file"] = resume_id, resume_name
            # a reader with a prefix that none of these match does not open the resume file
            header["resume_arrays"] = sorted(name for name in bulk if name != STATE_KEY)
        payload[STATE_KEY] = np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8)

        npz_path = self.checkpoints_dir / f"{tag}.npz"
        atomic_write(npz_path, lambda f: np.savez(f, **payload))
        manifest = {
            "tag": tag,
            "save_id": save_id,
            "saved": saved,
            "state": header["state"],
            "arrays": {
                name: {"shape": list(a.shape), "dtype": a.dtype.str}
                for name, a in payload.items()
                if name != STATE_KEY
            },
            "bytes": npz_path.stat().st_size,
        }
        if resume_id is not None:
            manifest["resume_file"] = resume_name
            manifest["resume_bytes"] = (self.checkpoints_dir / resume_name).stat().st_size
        atomic_write_json(self.checkpoints_dir / f"{tag}.json", manifest)
        if job["latest"]:
            atomic_write_json(
                self.checkpoints_dir / LATEST_FILE,
                {"tag": tag, "save_id": save_id, "saved": saved, "step": header["state"].get("step")},
            )
            self._drop_resume_files(keep=resume_name)
        return npz_path

    def _drop_resume_files(self, keep: str | None) -> None:
        """Remove every resume file but `keep` (the latest checkpoint's)."""
        dropped = False
        for path in self.checkpoints_dir.glob(f"*{RESUME_SUFFIX}"):
            if path.name != keep and not path.name.startswith("."):
                path.unlink(missing_ok=True)
                dropped = True
        if dropped:
            _fsync_dir(self.checkpoints_dir)

    def resolve_tag(self, tag: str = "latest") -> str:
        """'latest' and 'best' resolved to the checkpoint they point to; other tags checked."""
        if tag in RESERVED_TAGS:
            self.wait_checkpoint()  # the pointer a background write is about to move
            pointer = self.checkpoints_dir / (LATEST_FILE if tag == "latest" else BEST_FILE)
            try:
                data = _read_json(pointer, f"{tag} checkpoint pointer")
            except FileNotFoundError:
                raise RunError(f"run {self.path} has no {tag} checkpoint ({pointer} missing)") from None
            if not isinstance(data, dict) or not isinstance(data.get("tag"), str):
                raise RunError(f"{pointer} does not name a checkpoint")
            return data["tag"]
        try:
            return _check_tag(tag)
        except ValueError as err:  # a user's --checkpoint value: an input error, not a bug
            raise RunError(str(err)) from None

    def load_checkpoint(self, tag: str = "latest", prefix: str | tuple = "",
                        require_resume: bool = False) -> tuple[dict, dict]:
        """(arrays, state) of checkpoint `tag` ("latest", "best" or a saved tag); with `prefix`,
        only the arrays whose names start with it are read (e.g. "params/": no replay buffer).

        The checkpoint's resume arrays (`<tag>.<id>.resume.npz`, kept for the latest checkpoint
        only) are merged in when present; `require_resume=True` (an exact --resume) makes their absence
        an error instead.
        """
        real_tag = self.resolve_tag(tag)
        self.wait_checkpoint(real_tag)  # that checkpoint being written in the background
        npz_path = self.checkpoints_dir / f"{real_tag}.npz"
        if not npz_path.is_file():
            known = ", ".join(c["tag"] for c in self.list_checkpoints()) or "none"
            raise RunError(f"checkpoint {real_tag!r} not found in {self.checkpoints_dir} (saved: {known})")
        arrays = self._read_npz(npz_path, prefix)
        header_bytes = arrays.pop(STATE_KEY, None)
        if header_bytes is None:
            raise RunError(f"checkpoint {npz_path} has no embedded state; it was not written by numbarl")
        header = json.loads(header_bytes.tobytes().decode("utf-8"))
        resume_file = header.get("resume_file")
        names = header.get("resume_arrays")
        if resume_file and names is not None and not any(name.startswith(prefix) for name in names):
            resume_file = None  # none of the resume arrays is asked for: the file is not opened
        if resume_file:
            resume_path = self.checkpoints_dir / resume_file
            try:  # a later save of the run may remove it at any moment (only the latest keeps one)
                bulk = self._read_npz(resume_path, prefix, missing_ok=True)
            except FileNotFoundError:
                bulk = None
            bulk_header = json.loads(bulk.pop(STATE_KEY).tobytes().decode("utf-8")) if bulk is not None else {}
            if bulk_header.get("resume_id") == header.get("resume_id") and bulk is not None:
                arrays.update(bulk)
            elif require_resume:
                raise RunError(
                    f"checkpoint {real_tag!r}: its resume arrays (replay buffer) {resume_path.name} are "
                    f"{'from another save' if bulk is not None else 'missing'}; only the latest checkpoint "
                    "keeps them, and an exact resume needs them")
        return arrays, header["state"]

    @staticmethod
    def _read_npz(path: Path, prefix, missing_ok: bool = False) -> dict:
        try:
            with np.load(path, allow_pickle=False) as data:
                return {name: data[name] for name in data.files if name == STATE_KEY or name.startswith(prefix)}
        except FileNotFoundError:
            if missing_ok:
                raise
            raise RunError(f"checkpoint {path} cannot be read: it does not exist") from None
        except (OSError, ValueError) as err:
            raise RunError(f"checkpoint {path} cannot be read: {err}") from err

    def _checkpoint_header(self, npz_path: Path) -> dict:
        with np.load(npz_path, allow_pickle=False) as data:
            return json.loads(data[STATE_KEY].tobytes().decode("utf-8"))

    def list_checkpoints(self) -> list[dict]:
        """Saved checkpoints, oldest first: dicts with tag, saved (UTC time), step and state.
        Reads the .json sidecar; falls back to the .npz when the sidecar is missing or belongs
        to an older save of the same tag (a crash between the two writes)."""
        self.wait_checkpoint()
        if not self.checkpoints_dir.is_dir():
            return []
        out = []
        for npz_path in self.checkpoints_dir.glob("*.npz"):
            if npz_path.name.startswith(".") or npz_path.name.endswith(RESUME_SUFFIX):
                continue
            tag = npz_path.stem
            info = None
            sidecar = npz_path.with_suffix(".json")
            if sidecar.is_file():
                try:
                    info = _read_json(sidecar, "checkpoint manifest")
                except RunError:
                    info = None
            try:
                header = self._checkpoint_header(npz_path)
            except (OSError, ValueError, KeyError):
                continue  # not a numbarl checkpoint
            if info is None or info.get("save_id") != header.get("save_id"):
                info = header
            state = info.get("state") or {}
            out.append({"tag": tag, "saved": info.get("saved"), "step": state.get("step"), "state": state,
                        "resume_file": info.get("resume_file")})
        out.sort(key=lambda c: (c["saved"] or "", c["step"] if isinstance(c["step"], int) else -1, c["tag"]))
        return out

    def mark_best(self, tag: str, score: float, higher_is_better: bool = True) -> bool:
        """Record `tag` as the best checkpoint if `score` beats the current best (strictly);
        returns True when it became best. NaN/inf scores never become best. best.json is
        written atomically."""
        real_tag = self.resolve_tag(tag)
        self.wait_checkpoint()  # best.json moves after the checkpoint it names is on disk
        if not (self.checkpoints_dir / f"{real_tag}.npz").is_file():
            raise RunError(
                f"cannot mark checkpoint {real_tag!r} as best: it was not saved in {self.checkpoints_dir}"
            )
        score = float(score)
        if not math.isfinite(score):
            return False
        current = self.best_checkpoint()
        if current is not None and current.get("score") is not None:
            best = float(current["score"])
            if (score <= best) if higher_is_better else (score >= best):
                return False
        atomic_write_json(
            self.checkpoints_dir / BEST_FILE,
            {
                "tag": real_tag,
                "score": score,
                "higher_is_better": bool(higher_is_better),
                "marked": _utc_now(),
            },
        )
        return True

    def reset_best(self) -> None:
        """Forget the best checkpoint (e.g. at the start of a new fold)."""
        self.wait_checkpoint()
        try:
            (self.checkpoints_dir / BEST_FILE).unlink()
        except FileNotFoundError:
            pass
        _fsync_dir(self.checkpoints_dir)

    def best_checkpoint(self) -> dict | None:
        """{"tag", "score", ...} of the best checkpoint, or None when none was marked."""
        self.wait_checkpoint()
        path = self.checkpoints_dir / BEST_FILE
        if not path.is_file():
            return None
        return _read_json(path, "best checkpoint pointer")

    def latest_checkpoint(self) -> dict | None:
        """{"tag", "step", ...} of the latest checkpoint, or None when none was saved."""
        self.wait_checkpoint()
        path = self.checkpoints_dir / LATEST_FILE
        if not path.is_file():
            return None
        return _read_json(path, "latest checkpoint pointer")

    def prune_checkpoints(self, keep_last: int) -> list[str]:
        """Delete all but the `keep_last` newest checkpoints, never the latest or best one;
        returns the deleted tags."""
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        self.wait_checkpoint()
        protected = {p["tag"] for p in (self.latest_checkpoint(), self.best_checkpoint()) if p}
        checkpoints = self.list_checkpoints()
        keep = {c["tag"] for c in checkpoints[len(checkpoints) - keep_last :]} if keep_last else set()
        deleted = []
        for c in checkpoints:
            if c["tag"] in keep or c["tag"] in protected:
                continue
            if c.get("resume_file"):
                (self.checkpoints_dir / c["resume_file"]).unlink(missing_ok=True)
            for suffix in (".json", ".npz"):  # sidecar first: a lone .npz is still listed
                try:
                    (self.checkpoints_dir / f"{c['tag']}{suffix}").unlink()
                except FileNotFoundError:
                    pass
            deleted.append(c["tag"])
        if deleted:
            _fsync_dir(self.checkpoints_dir)
        return deleted

    # -- trades, equity, summary ---------------------------------------------------------------

    def write_trades(self, split: str, df: pd.DataFrame, fold: int | None = None) -> Path:
        """Write the trade list of `split` to trades_<split>.csv (atomically).

        With `fold`, the rows get a `fold` column and replace that fold's rows in the existing
        file (other folds are kept, rows sorted by fold): a fold re-run after --resume does not
        duplicate trades. Without `fold`, the file is replaced by `df`.
        """
        path = self.trades_path(split)
        if not isinstance(df, pd.DataFrame):
            raise TypeError(f"trades must be a pandas DataFrame, got {type(df).__name__}")
        frame = df.copy()
        if fold is not None:
            if "fold" in frame.columns:
                frame["fold"] = int(fold)
            else:
                frame.insert(0, "fold", int(fold))
            if path.is_file():
                existing = self.read_trades(split)
                if "fold" in existing.columns:
                    existing = existing[existing["fold"] != int(fold)]
                if len(existing):
                    frame = pd.concat([existing, frame], ignore_index=True)
                frame = frame.sort_values("fold", kind="stable").reset_index(drop=True)
        text = frame.to_csv(index=False, lineterminator="\n")
        return atomic_write_bytes(path, text.encode("utf-8"))

    def read_trades(self, split: str) -> pd.DataFrame | None:
        """The trade list of `split`, or None when none was written. An empty list (a window
        with no trades) is an empty DataFrame."""
        path = self.trades_path(split)
        if not path.is_file():
            return None
        try:
            return pd.read_csv(path)
        except pd.errors.EmptyDataError:
            return pd.DataFrame()

    def trade_splits(self) -> list[str]:
        return sorted(p.stem[len("trades_") :] for p in self.path.glob("trades_*.csv"))

    def write_equity(self, split: str, fold: int, arrays: dict) -> Path:
        """Save the per-bar series of one backtest window for the report:
        equity/<split>_fold<k>.npz.

        `arrays`: "pnl" (net P&L per bar) and/or "equity" (cumulative P&L; computed from pnl
        when missing), optional "position" (per bar), "timestamps" (int64 ns, bar close) and
        any other 1-D series of the same length. All are stored as given (float64 for
        pnl/equity/position).
        """
        if "pnl" not in arrays and "equity" not in arrays:
            raise ValueError(f"write_equity({split!r}, {fold}) needs 'pnl' or 'equity', got {sorted(arrays)}")
        series = {}
        for name, value in arrays.items():
            array = np.asarray(value)
            if array.ndim != 1:
                raise ValueError(f"equity series {name!r} must be 1-D (per bar), got shape {array.shape}")
            series[name] = array.astype(np.float64) if name in EQUITY_SERIES else array
        lengths = {name: len(a) for name, a in series.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"equity series of {split!r} fold {fold} differ in length: {lengths}")
        if "equity" not in series:
            series["equity"] = np.cumsum(series["pnl"])
        if "pnl" not in series:
            series["pnl"] = np.diff(series["equity"], prepend=0.0)
        self.equity_dir.mkdir(exist_ok=True)
        # the same series as a table for any tool (spreadsheet, pandas): one row per bar
        table = pd.DataFrame({"bar": np.arange(len(series["pnl"]))})
        if "timestamps" in series:
            table["time_utc"] = pd.to_datetime(np.asarray(series["timestamps"], np.int64), utc=True)
        for name, value in series.items():
            if name != "timestamps":
                table[name] = value
        atomic_write_bytes(self.equity_csv_path(split, fold),
                           table.to_csv(index=False, lineterminator="\n").encode("utf-8"))
        return atomic_write(self.equity_path(split, fold), lambda f: np.savez(f, **series))

    def read_equity(self, split: str | None = None) -> dict[tuple[str, int], dict[str, np.ndarray]]:
        """{(split, fold): {"pnl", "equity", ...}} of the saved series, sorted by split and fold."""
        if not self.equity_dir.is_dir():
            return {}
        found = {}
        for path in self.equity_dir.glob("*_fold*.npz"):
            if path.name.startswith("."):
                continue
            name, _, fold_text = path.stem.rpartition("_fold")
            if not fold_text.isdigit() or (split is not None and name != split):
                continue
            with np.load(path, allow_pickle=False) as data:
                found[(name, int(fold_text))] = {key: data[key] for key in data.files}
        return dict(sorted(found.items()))

    def write_summary(self, summary: dict) -> Path:
        """Write summary.json atomically.

        Shape the report reads: {"folds": [{"fold": 0, "val": {metric: value}, "test": {...},
        "bars_per_day": ..., "best_checkpoint": ...}, ...], "seed": ..., "numbarl_version": ...,
        "device": ..., ...}: every dict of scalars inside a fold is a split's metric row.
        """
        if not isinstance(summary, dict):
            raise TypeError(f"summary must be a dict, got {type(summary).__name__}")
        self.wait_checkpoint()  # a summary never gets ahead of the checkpoints (a resume trusts it)
        return atomic_write_json(self.summary_path, summary)

    def read_summary(self) -> dict | None:
        if not self.summary_path.is_file():
            return None
        return _read_json(self.summary_path, "summary")
