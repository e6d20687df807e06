"""What `numbarl-train` prints while it runs: timestamped lines, a progress bar and an ETA over every
phase of the run (collect/train steps, validation and test backtests, checkpoints), and the same
lines in the run folder's train.log.

    progress = Progress(quiet)
    progress.plan(steps=..., backtest_bars=..., checkpoints=...)   the work left
    progress.done("backtest", bars, seconds)                      measured after a host sync
    progress.status(f"... {progress.bar()} ETA {progress.eta()}")
"""

from __future__ import annotations

import datetime as _dt
import sys
import time
from pathlib import Path

PHASES = ("step", "backtest", "checkpoint")
# the time budget of a run: data (load or build the cache), compile (the first run of each step,
# which compiles its kernels and captures its graph), steps (collect + train replays), validation
# and test backtests, checkpoints (the critical path only: the device-to-host snapshot, and the waits
# for a background write that had not finished when the run needed it), report; `other` is the rest
# of the wall time (start-up imports, the wait for the oracle and buy-and-hold backtests that run
# beside the training, writing summaries and trade lists: summary.json's time_other_s)
BUDGET = ("data", "compile", "steps", "validation", "test", "checkpoint", "report")  # a collect step (+ its train step), a backtest bar, a checkpoint
LOG_FILE = "train.log"


def _duration(seconds: float) -> str:
    m, sec = divmod(int(round(max(seconds, 0.0))), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


class Progress:
    """What a run prints: timestamped log lines, and status lines with a bar and an ETA over the
    whole run (every phase: collect/train steps, validation and test backtests, checkpoints).

    The ETA is the work left per phase times that phase's measured mean cost: steps in seconds per
    collect step, backtests in seconds per bar (validation and test windows differ in length),
    checkpoints in seconds each. While a phase with work left has not been timed yet, the ETA is a
    lower bound and shows as ">2m10s". Every line also goes to the run folder's train.log (with
    the date) once the folder exists; lines from before are kept and written then.
    """

    def __init__(self, quiet: bool, clock=time.perf_counter):
        self.live = sys.stderr.isatty() and not quiet
        self._console = None
        if self.live:
            from rich.console import Console

            self._console = Console(stderr=True)
        self._clock = clock
        self._started = clock()
        # where this process's wall time went, measured (seconds): summary.json's time_budget_s
        self.budget = {name: 0.0 for name in BUDGET}
        self._charged = 0.0  # every second charged so far (a part of `other` does not count them twice)
        self._parted = 0.0  # every second of a part of `other` so far (a part inside another counts once)
        self.other = {}  # measured parts of the budget's `other` entry (summary.json's time_other_s)
        self._last_width = 0
        self._file = None
        self._pending: list[str] = []  # lines logged before the run folder (and its log) existed
        self.elapsed_offset = 0.0  # wall time of the run before this process (a resume)
        self.plan()

    # -- the ETA ----------------------------------------------------------------------------------
    def plan(self, steps: int = 0, backtest_bars: int = 0, checkpoints: int = 0):
        """The work this run still has to do."""
        self.left = {"step": int(steps), "backtest": int(backtest_bars), "checkpoint": int(checkpoints)}
        self.spent = {phase: [0, 0.0] for phase in PHASES}  # phase -> [units done, seconds]
        self._t0 = self._clock()
        self._shown = 0.0  # the bar's fraction never moves back (the estimate does, the bar does not)

    def done(self, phase: str, units: int, seconds: float):
        """`units` of `phase` finished in `seconds` (measured after a host sync)."""
        self.left[phase] = max(self.left[phase] - int(units), 0)
        self.spent[phase][0] += int(units)
        self.spent[phase][1] += float(seconds)

    def skip(self, phase: str, units: int):
        """`units` of `phase` the run will not do after all (an early-stopped fold's epochs)."""
        self.left[phase] = max(self.left[phase] - int(units), 0)

    def remaining(self) -> tuple[float, bool]:
        """(seconds left, exact): exact is False while a phase with work left is still untimed."""
        total, exact = 0.0, True
        for phase in PHASES:
            units, seconds = self.spent[phase]
            if self.left[phase] and not units:
                exact = False
            elif units:
                total += self.left[phase] * seconds / units
        return total, exact

    def eta(self) -> str:
        if not any(units for units, _ in self.spent.values()):
            return "--"
        left, exact = self.remaining()
        return ("" if exact else ">") + _duration(left)

    def bar(self, width: int = 20) -> str:
        """[#####---------------] 25%: the fraction of the estimated wall time already spent, never
        lower than the last one shown."""
        elapsed = self._clock() - self._t0
        left, _ = self.remaining()
        if not any(units for units, _ in self.spent.values()):
            fraction = 0.0
        else:
            fraction = elapsed / (elapsed + left) if elapsed + left > 0 else 1.0
        # a phase timed for the first time can raise the estimate of what is left; the bar then
        # waits at what it showed instead of jumping back (the ETA shows the new estimate)
        fraction = max(fraction, self._shown)
        self._shown = fraction
        fill = int(round(fraction * width))
        return f"[{'#' * fill}{'-' * (width - fill)}] {fraction:4.0%}"

    def elapsed(self) -> float:
        return self._clock() - self._t0

    def stamp(self, record: dict) -> dict:
        """`record` with the wall clock: `time` (UTC, ISO 8601) and `elapsed_s` (seconds since the run
        started; a resumed run goes on from the elapsed time its log had reached)."""
        return {**record, "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "elapsed_s": round(self.elapsed_offset + self.elapsed(), 3)}

    # -- output -------------------------------------------------------------------------------------
    def attach(self, path: Path):
        """Write every line from now on (and the ones logged so far) to `path` (appending: a resumed
        run continues its log)."""
        self._file = open(path, "a", encoding="utf-8", buffering=1)
        for line in self._pending:
            self._file.write(line + "\n")
        self._pending = []

    def _record(self, msg: str):
        line = f"{_dt.datetime.now().astimezone().isoformat(timespec='seconds')} {msg}"
        if self._file is not None:
            self._file.write(line + "\n")
        else:
            self._pending.append(line)

    def charge(self, name: str, seconds: float) -> None:
        """Count `seconds` of wall time to the budget entry `name` (one of BUDGET)."""
        self.budget[name] += float(seconds)
        self._charged += float(seconds)

    def part_begin(self) -> tuple[float, float, float]:
        """Start timing a part of the budget's `other` entry; end it with :meth:`part_end`."""
        return self._clock(), self._charged, self._parted

    def part_end(self, name: str, begun: tuple[float, float, float]) -> None:
        """The part `name` of `other` took the time since `begun`, less what was charged to a budget
        entry meanwhile (e.g. a wait for a checkpoint write: counted under checkpoint) and less the
        parts timed inside it (e.g. the wait for the fold's benchmarks inside its results)."""
        t0, charged, parted = begun
        seconds = max(self._clock() - t0 - (self._charged - charged) - (self._parted - parted), 0.0)
        self.other[name] = self.other.get(name, 0.0) + seconds
        self._parted += seconds

    def time_other(self, previous: dict | None = None) -> dict:
        """{part: seconds} of the budget's `other` entry: the parts measured with part_begin/part_end
        and `rest` (what no part covers: imports, config, log lines, ...), added to a `previous` one."""
        parts = dict(self.other)
        parts["rest"] = max(self._spent()["other"] - sum(parts.values()), 0.0)
        previous = previous or {}
        return {k: round(v + float(previous.get(k) or 0.0), 3) for k, v in parts.items()}

    def time_budget(self, previous: dict | None = None) -> dict:
        """{entry: seconds} of this process's run so far, with `other` and `total`, added to a
        `previous` budget (a resumed run's summary). The steps' entry is the step time measured for
        the ETA less the compile time inside it."""
        spent = self._spent()
        previous = previous or {}
        return {k: round(v + float(previous.get(k) or 0.0), 3) for k, v in spent.items()}

    def _spent(self) -> dict:
        spent = dict(self.budget)
        spent["steps"] = max(self.spent["step"][1] - spent["compile"], 0.0)
        # the checkpoints' critical path: the snapshots (timed for the ETA) and, charged where the
        # run waited for it, the part of a background write that was not hidden behind other work
        spent["checkpoint"] = self.spent["checkpoint"][1] + spent["checkpoint"]
        total = self._clock() - self._started
        spent["other"] = max(total - sum(spent.values()), 0.0)
        spent["total"] = total
        return spent

    def note(self, msg: str):
        """A line for the run's train.log only (the console already gets the same news elsewhere)."""
        self._record(msg)

    def log(self, msg: str):
        self._record(msg)
        msg = f"[{time.strftime('%H:%M:%S')}] {msg}"
        if self.live:
            self._clear()
            self._console.print(msg, highlight=False)
        else:
            print(msg, file=sys.stderr, flush=True)

    def status(self, msg: str):
        """A progress line: redrawn in place on a terminal, a plain line otherwise."""
        self._record(msg)
        msg = f"[{time.strftime('%H:%M:%S')}] {msg}"
        if self.live:
            self._clear()
            sys.stderr.write(msg[: 200])
            sys.stderr.flush()
            self._last_width = len(msg[:200])
        else:
            print(msg, file=sys.stderr, flush=True)

    def warn(self, msg: str):
        self.log(f"warning: {msg}")

    def _clear(self):
        if self._last_width:
            sys.stderr.write("\r" + " " * self._last_width + "\r")
            self._last_width = 0

    def close(self):
        if self.live:
            self._clear()
        if self._file is not None:
            self._file.close()
            self._file = None
