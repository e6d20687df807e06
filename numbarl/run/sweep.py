"""numbarl-sweep: a grid (and random) search over config fields × seeds on Ray Tune, each trial a
normal numbarl run folder (docs/SWEEPS.md).

    trials = plan_trials(preset, config, sets, grid, random, samples, seeds)   every config validated
    for trial in trials (Ray Tune schedules them, fractional GPUs, --max-concurrent):
        python -m numbarl train <the trial's options> --out DIR/trials/<name>   its own process
            (or `train --resume DIR/trials/<name>` for a trial a killed sweep left half done)
        tail its metrics.jsonl: every "val" record -> tune.report(val_sharpe)   ASHA reads these
    numbarl-compare over the finished trials -> DIR/compare.txt, DIR/compare.json

A trial runs as `python -m numbarl train` with exactly the options a person would type for that
run (preset, config, --set, --seed), so its result is the plain run's: numbarl's own process
isolation, cache lock and `--resume` are reused, nothing of the trainer runs inside Ray. The
sweep folder::

    DIR/
      sweep.json         the sweep's arguments, the resolved trial list (each trial's --set
                         overrides and seed) and each trial's status
      base-config.toml   copy of --config (when given): every trial, also a resumed one, reads it
      trials/<name>/     one numbarl run folder per trial (config.json, metrics, checkpoints, summary)
      logs/<name>.log    the trial process's output, one section per attempt
      compare.txt, compare.json   numbarl-compare over the finished trials
      ray/               Ray Tune's own experiment files (not needed by --resume)

Resume (`--resume`): the trial list comes from sweep.json; a finished trial (summary.json with
every fold, report written) is kept as it is; a trial with a run folder continues through
`numbarl-train --resume` from its last checkpoint; a trial not started starts. A trial that ASHA
stopped stays stopped.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

SWEEP_FORMAT = "numbarl-sweep"
SWEEP_FORMAT_VERSION = 1
SWEEP_FILE = "sweep.json"
TRIALS_DIR = "trials"
LOGS_DIR = "logs"
BASE_CONFIG = "base-config"  # + the --config file's suffix
INSTALL_HINT = "pip install 'numbarl[sweep]' (or pip install 'ray[tune]')"
METRIC = "val_sharpe"  # what ASHA compares: the per-bar validation Sharpe of each epoch
ASHA_REDUCTION = 3  # keep the best third at each rung (the Hyperband paper's eta = 3)
POLL_S = 0.5  # how often a trial's metrics.jsonl is read for new validation records
STOP_GRACE_S = 30  # SIGTERM, then this long for the trial process to exit, then SIGKILL
# the options that define the trials: on --resume they come from sweep.json and may only be repeated
TRIAL_ARGS = ("preset", "config", "sets", "grid", "random", "samples", "sample_seed", "seeds", "asha", "asha_grace")
# the driver's values of these reach each trial process (Ray sets its own thread counts in its
# workers; a trial must run with the environment its plain numbarl-train run would have)
PASSED_ENV_PREFIXES = ("NUMBARL_", "NUMBA_")
PASSED_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONHASHSEED")
TRIAL_STATES = ("pending", "running", "finished", "stopped_early", "failed")


class SweepError(ValueError):
    """Bad numbarl-sweep arguments, a folder that is not a sweep, or Ray missing: one line for a person."""


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------
def _key(text: str, option: str) -> str:
    key = text.strip()
    if not re.fullmatch(r"[a-z_]+\.[a-z0-9_]+", key):
        raise SweepError(f"{option} {text!r}: the field must look like section.field (e.g. agent.lr)")
    if key == "train.seed":
        raise SweepError(f"{option} {text!r}: seeds are given with --seeds (e.g. --seeds 0,1,2)")
    return key


def parse_grid(specs) -> dict[str, list[str]]:
    """--grid agent.lr=1e-3,3e-4 (repeatable) -> {"agent.lr": ["1e-3", "3e-4"]}."""
    grid = {}
    for spec in specs or ():
        key, sep, values = spec.partition("=")
        if not sep:
            raise SweepError(f"--grid {spec!r} must look like section.field=V1,V2 (e.g. agent.lr=1e-3,3e-4)")
        key = _key(key, "--grid")
        items = [v.strip() for v in values.split(",")]
        if not values.strip() or any(not v for v in items):
            raise SweepError(f"--grid {spec!r}: empty value in the list; give values separated by commas")
        if len(set(items)) != len(items):
            raise SweepError(f"--grid {spec!r}: a value is listed twice")
        if key in grid:
            raise SweepError(f"--grid {key} is given twice; list all its values in one --grid")
        grid[key] = items
    return grid


def parse_random(specs) -> dict[str, list]:
    """--random agent.lr=1e-4:1e-2:log -> {"agent.lr": [1e-4, 1e-2, True]} (lo, hi, log scale)."""
    out = {}
    for spec in specs or ():
        key, sep, rng = spec.partition("=")
        parts = rng.split(":")
        if not sep or len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "log"):
            raise SweepError(f"--random {spec!r} must look like section.field=LO:HI or section.field=LO:HI:log")
        key = _key(key, "--random")
        try:
            lo, hi = float(parts[0]), float(parts[1])
        except ValueError:
            raise SweepError(f"--random {spec!r}: LO and HI must be numbers") from None
        log = len(parts) == 3
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi) or (log and lo <= 0):
            raise SweepError(f"--random {spec!r}: needs finite LO < HI" + (" and LO > 0 on a log scale" if log else ""))
        if key in out:
            raise SweepError(f"--random {key} is given twice")
        out[key] = [lo, hi, log]
    return out


def parse_seeds(text: str) -> list[int]:
    """--seeds 0,1,2 -> [0, 1, 2] (non-negative integers, each once)."""
    items = [s.strip() for s in (text or "").split(",")]
    if not text or any(not s for s in items):
        raise SweepError(f"--seeds {text!r}: give non-negative integers separated by commas (e.g. --seeds 0,1,2)")
    try:
        seeds = [int(s) for s in items]
    except ValueError:
        raise SweepError(f"--seeds {text!r}: {next(s for s in items if not s.lstrip('-').isdigit())!r} "
                         "is not an integer") from None
    if any(s < 0 for s in seeds):
        raise SweepError(f"--seeds {text!r}: seeds must be >= 0")
    if len(set(seeds)) != len(seeds):
        raise SweepError(f"--seeds {text!r}: a seed is listed twice")
    return seeds


# ---------------------------------------------------------------------------------------------
# the trial list
# ---------------------------------------------------------------------------------------------
def _slug(overrides: dict) -> str:
    """A trial name's part from its overrides: the field names (the section only where two
    fields share a name), e.g. lr=0.001_n_step=3."""
    names = [k.split(".", 1)[1] for k in overrides]
    parts = []
    for key, value in overrides.items():
        name = key.split(".", 1)[1]
        parts.append(f"{key if names.count(name) > 1 else name}={value}")
    return re.sub(r"[^A-Za-z0-9_.=+-]", "-", "_".join(parts))[:96]


def _sample(cfg, key: str, lo: float, hi: float, log: bool, rng) -> str:
    """One draw of --random `key` as a --set value: an integer for an integer field, else a float
    rounded to 6 significant digits (the value the trial gets is exactly the one written down)."""
    section, name = key.split(".", 1)
    current = getattr(getattr(cfg, section, None), name, None)
    if isinstance(current, bool) or not isinstance(current, (int, float)):
        raise SweepError(f"--random {key}: the field is not a number (it is {current!r}); use --grid for it")
    x = math.exp(rng.uniform(math.log(lo), math.log(hi))) if log else rng.uniform(lo, hi)
    if isinstance(current, int):
        return str(min(max(int(round(x)), math.ceil(lo)), math.floor(hi)))
    return repr(float(f"{x:.6g}"))


def plan_trials(args: dict, config_path: str | None) -> tuple[list[dict], int]:
    """The sweep's trials (grid points × random samples × seeds), each config resolved and
    validated exactly as numbarl-train will (ConfigError names the bad field), and the number of
    validation records per trial (folds × epochs: ASHA's time axis)."""
    import numpy as np

    from numbarl import config as config_mod

    base = config_mod.resolve(args["preset"], config_path, args["sets"], default_preset=args["preset"] or "default")
    given = config_mod.parse_sets(args["sets"])
    for key in list(args["grid"]) + list(args["random"]):
        if key in given:
            raise SweepError(f"{key} is given with --set and swept with --grid/--random; drop one")
    both = set(args["grid"]) & set(args["random"])
    if both:
        raise SweepError(f"{sorted(both)[0]} is swept with both --grid and --random; use one")
    if args["samples"] != 1 and not args["random"]:
        raise SweepError("--samples needs at least one --random field to draw")
    rng = np.random.default_rng(args["sample_seed"])
    draws = [{key: _sample(base, key, *spec, rng) for key, spec in args["random"].items()} for _ in range(args["samples"])]
    points = [dict(zip(args["grid"], values)) for values in itertools.product(*args["grid"].values())]
    trials, steps = [], None
    for point, draw, seed in itertools.product(points, draws, args["seeds"]):
        overrides = {**point, **draw}
        index = len(trials)
        name = f"t{index:03d}" + (f"-{_slug(overrides)}" if overrides else "") + f"-s{seed}"
        sets = [*args["sets"], *(f"{k}={v}" for k, v in overrides.items())]
        cfg = config_mod.resolve(args["preset"], config_path, sets, default_preset=args["preset"] or "default",
                                 **{"train.seed": seed})
        steps = cfg.train.folds * cfg.train.epochs if steps is None else max(steps, cfg.train.folds * cfg.train.epochs)
        trials.append({"name": name, "overrides": overrides, "seed": seed, "status": "pending", "attempts": 0,
                       "resumed": False, "error": None})
    return trials, steps


def train_argv(args: dict, trial: dict, config_path: str | None, run_dir: Path) -> list[str]:
    """`python -m numbarl` options of a trial's new run: what a person types for that plain run."""
    argv = ["train", "--preset", args["preset"]] if args["preset"] else ["train"]
    if config_path:
        argv += ["--config", config_path]
    for s in [*args["sets"], *(f"{k}={v}" for k, v in trial["overrides"].items())]:
        argv += ["--set", s]
    return argv + ["--seed", str(trial["seed"]), "--out", str(run_dir), "--quiet"]


# ---------------------------------------------------------------------------------------------
# the sweep folder
# ---------------------------------------------------------------------------------------------
def run_finished(run_dir: Path) -> bool:
    """A trial's numbarl-train finished: summary.json lists every fold and the report (written
    last) exists."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        folds = json.loads((run_dir / "config.json").read_text())["train"]["folds"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return len(summary.get("folds") or []) >= folds and (run_dir / "report.html").is_file()


class Sweep:
    """A sweep folder: sweep.json (written atomically) plus the trials' run folders and logs."""

    def __init__(self, path: Path, record: dict):
        self.path, self.record = Path(path), record

    @property
    def trials(self) -> list[dict]:
        return self.record["trials"]

    def run_dir(self, trial: dict) -> Path:
        return self.path / TRIALS_DIR / trial["name"]

    def log_path(self, trial: dict) -> Path:
        return self.path / LOGS_DIR / f"{trial['name']}.log"

    @property
    def config_path(self) -> str | None:
        name = self.record.get("base_config")
        return str(self.path / name) if name else None

    def save(self):
        from numbarl.run.runio import atomic_write_json

        self.record["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        atomic_write_json(self.path / SWEEP_FILE, self.record)

    @classmethod
    def open(cls, path) -> "Sweep":
        path = Path(path)
        try:
            record = json.loads((path / SWEEP_FILE).read_text())
        except FileNotFoundError:
            raise SweepError(f"--resume {path}: not a numbarl sweep folder (no {SWEEP_FILE})") from None
        except (OSError, ValueError) as e:
            raise SweepError(f"--resume {path}: {SWEEP_FILE} cannot be read: {e}") from None
        if not isinstance(record, dict) or record.get("format") != SWEEP_FORMAT:
            raise SweepError(f"--resume {path}: {SWEEP_FILE} is not a numbarl sweep record")
        if record.get("format_version") != SWEEP_FORMAT_VERSION:
            raise SweepError(f"--resume {path}: sweep format {record.get('format_version')} is not the "
                             f"{SWEEP_FORMAT_VERSION} this numbarl reads")
        return cls(path, record)


# ---------------------------------------------------------------------------------------------
# one trial (runs inside a Ray worker)
# ---------------------------------------------------------------------------------------------
# the trial process asks the kernel for SIGTERM when the Ray worker that started it dies (ASHA
# stopping the trial, the sweep killed), then becomes `python -m numbarl ...` (PR_SET_PDEATHSIG
# = 1 survives exec; Linux only, elsewhere a trial outlives a killed worker)
_CHILD = ("import ctypes, os, signal, sys\n"
          "if sys.platform.startswith('linux'):\n"
          "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
          "    if os.getppid() != int(sys.argv[1]): sys.exit(143)\n"
          "os.execv(sys.executable, [sys.executable, '-m', 'numbarl', *sys.argv[2:]])\n")


def _trial_env(passed: dict) -> dict:
    """The Ray worker's environment (its CUDA_VISIBLE_DEVICES: the GPU Ray gave the trial) with the
    driver's numbarl/numba/thread-count variables, and the numbarl this worker imported first on
    the path."""
    import numbarl

    env = dict(os.environ)
    for name in [n for n in env if n.startswith(PASSED_ENV_PREFIXES) or n in PASSED_ENV]:
        del env[name]
    env.update(passed)
    root = str(Path(numbarl.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


class _ValTail:
    """New "val" records of a run's metrics.jsonl, each (fold, epoch) once: a resumed run
    truncates its log to its checkpoint and logs the same records again."""

    def __init__(self, path: Path):
        self.path, self.offset, self.seen = path, 0, set()

    def new(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:  # truncated by --resume
                    self.offset = 0
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[:data.rfind(b"\n") + 1]  # a partial last line waits for its newline
        self.offset += len(complete)
        out = []
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            key = (record.get("fold"), record.get("epoch"))
            if record.get("kind") == "val" and key not in self.seen:
                self.seen.add(key)
                out.append(record)
        return out


def _report(record: dict):
    from ray import tune

    sharpe = record.get("sharpe")  # null when undefined (no trades): ASHA does not stop on a NaN
    tune.report({METRIC: float(sharpe) if sharpe is not None else float("nan"),
                 "fold": record.get("fold"), "epoch": record.get("epoch")})


def _stop(proc: subprocess.Popen):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # numbarl-train leaves a resumable run folder
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def trial_main(config: dict):
    """The Ray Tune trainable: run (or resume) one trial's numbarl-train as its own process and
    report each validation epoch; a finished trial only reports its saved records (ASHA's rungs)."""
    spec, trial = config["sweep"], config["trial"]
    run_dir = Path(spec["dir"]) / TRIALS_DIR / trial["name"]
    tail = _ValTail(run_dir / "metrics.jsonl")
    if trial["status"] in ("finished", "stopped_early"):
        for record in tail.new():
            _report(record)
        return
    if (run_dir / "run.json").is_file():
        argv = ["train", "--resume", str(run_dir), "--quiet"]
    else:
        argv = train_argv(spec["args"], trial, spec["config_path"], run_dir)
    log_path = Path(spec["dir"]) / LOGS_DIR / f"{trial['name']}.log"
    with open(log_path, "a") as log:
        log.write(f"== {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} python -m numbarl "
                  f"{shlex.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(os.getpid()), *argv], cwd=spec["cwd"],
                                env=_trial_env(spec["env"]), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        while proc.poll() is None:
            for record in tail.new():
                _report(record)
            time.sleep(POLL_S)
        for record in tail.new():
            _report(record)
    finally:
        _stop(proc)
    if proc.returncode != 0:
        last = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-1:]
        raise RuntimeError(f"numbarl-train exited with code {proc.returncode}"
                           + (f": {last[0].strip()}" if last else "") + f" (log: {log_path})")
    if not run_finished(run_dir):
        raise RuntimeError(f"numbarl-train exited without finishing {run_dir} (log: {log_path})")


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------
def _import_ray():
    try:
        import ray
        from ray import tune
    except ImportError:
        raise SweepError(f"numbarl-sweep needs Ray Tune, which is not installed: {INSTALL_HINT}") from None
    return ray, tune


def _status_callback(tune, sweep: Sweep, log):
    """Tune callback: each trial's status into sweep.json as it changes, one line per ended trial."""
    by_name = {t["name"]: t for t in sweep.trials}

    class Status(tune.Callback):
        def _set(self, trial, status, error=None):
            entry = by_name[trial.config["trial"]["name"]]
            if status != "running" and run_finished(sweep.run_dir(entry)):
                status = "finished"  # also when ASHA's stop came after the run's last epoch
            entry["status"], entry["error"] = status, error
            sweep.save()
            return entry

        def on_trial_start(self, iteration, trials, trial, **info):
            entry = by_name[trial.config["trial"]["name"]]
            if entry["status"] in ("finished", "stopped_early") or entry["name"] in self.launched:
                return  # a finished or stopped trial only replays its saved validation epochs (ASHA)
            self.launched.add(entry["name"])
            if (sweep.run_dir(entry) / "run.json").is_file():
                entry["resumed"] = True  # numbarl-train --resume continues it
            entry["attempts"] += 1
            self._set(trial, "running")

        def on_trial_complete(self, iteration, trials, trial, **info):
            entry = self._set(trial, "stopped_early")
            log(f"trial {entry['name']}: {entry['status'].replace('_', ' ')} "
                f"({sum(t['status'] in ('finished', 'stopped_early', 'failed') for t in sweep.trials)}"
                f"/{len(sweep.trials)} done)")

        def on_trial_error(self, iteration, trials, trial, **info):
            entry = self._set(trial, "failed", "see " + str(sweep.log_path(by_name[trial.config["trial"]["name"]])))
            log(f"trial {entry['name']}: failed (log: {sweep.log_path(entry)})")

    callback = Status()
    callback.launched = set()
    return callback


def _write_compare(sweep: Sweep) -> str:
    """numbarl-compare over the finished trials -> compare.txt and compare.json; the text."""
    from numbarl.run import compare
    from numbarl.run.runio import RunDir, atomic_write_bytes, atomic_write_json

    done = [t for t in sweep.trials if t["status"] == "finished"]
    missing = [f"{t['name']} ({t['status'].replace('_', ' ')})" for t in sweep.trials if t["status"] != "finished"]
    if done:
        runs = [RunDir.open(sweep.run_dir(t)) for t in done]
        rows = compare.compare_rows(runs)
        spread, diff = compare.summarize(rows), compare.config_differences(runs)
        text = compare.format_table(rows, spread, diff)
    else:
        rows, spread, diff, text = [], {}, {}, "no trial finished"
    if missing:
        text += "\nnot in the table: " + ", ".join(missing)
    atomic_write_bytes(sweep.path / "compare.txt", (text + "\n").encode())
    atomic_write_json(sweep.path / "compare.json", {"rows": rows, "spread": spread, "config_differences": diff,
                                                    "not_finished": missing})
    return text


def _given(args: dict, saved: dict) -> list[str]:
    """Trial-defining options given with --resume that differ from the saved sweep's."""
    defaults = {"preset": None, "config": None, "sets": [], "grid": {}, "random": {}, "samples": 1,
                "sample_seed": 0, "seeds": None, "asha": False, "asha_grace": 1}
    return [k for k in TRIAL_ARGS if args[k] != defaults[k] and args[k] != saved.get(k)]


def main(preset=None, config_file=None, sets=(), grid=(), random=(), samples=1, sample_seed=0, seeds=None,
         out_dir=None, gpus_per_trial=None, cpus_per_trial=1.0, address=None, resume=False, asha=False,
         asha_grace=1, max_concurrent=None, log=None) -> int:
    """numbarl-sweep (see the module docstring). Every argument and every trial's config is
    checked before Ray starts or anything is written; SweepError/ConfigError for a bad one.
    Returns the exit code: 0 when no trial failed, 1 otherwise."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    if not out_dir:
        raise SweepError("--out DIR is required: the sweep folder (with --resume: the sweep to continue)")
    out = Path(out_dir).resolve()
    args = {"preset": preset, "config": str(Path(config_file).resolve()) if config_file else None,
            "sets": list(sets), "grid": parse_grid(grid), "random": parse_random(random), "samples": samples,
            "sample_seed": sample_seed, "seeds": parse_seeds(seeds) if seeds is not None else None,
            "asha": asha, "asha_grace": asha_grace}
    if samples < 1:
        raise SweepError(f"--samples {samples}: must be >= 1")
    if asha_grace < 1:
        raise SweepError(f"--asha-grace {asha_grace}: must be >= 1 (epochs before ASHA may stop a trial)")
    if gpus_per_trial is not None and not (0 <= gpus_per_trial <= 8):
        raise SweepError(f"--gpus-per-trial {gpus_per_trial}: must be between 0 and 8 (0.25 packs four trials on a GPU)")
    if not cpus_per_trial > 0:
        raise SweepError(f"--cpus-per-trial {cpus_per_trial}: must be > 0")
    if max_concurrent is not None and max_concurrent < 1:
        raise SweepError(f"--max-concurrent {max_concurrent}: must be >= 1")
    sweep = None
    if resume:
        sweep = Sweep.open(out)
        changed = _given(args, sweep.record["args"])
        if changed:
            raise SweepError(f"--resume continues the sweep in {out} with its saved settings (sweep.json); "
                             f"--{changed[0].replace('_', '-')} differs from them. Start a new sweep with another --out.")
        args = sweep.record["args"]
        plan_trials(args, sweep.config_path)  # the saved trials still resolve with this numbarl
        config_path = sweep.config_path
    else:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise SweepError(f"--out {out} already exists; pick a new folder, or continue that sweep with --resume")
        if args["seeds"] is None:
            raise SweepError("--seeds is required (e.g. --seeds 0,1,2)")
        if not args["preset"] and not (args["config"] and _config_names_preset(args["config"])):
            raise SweepError("numbarl-sweep needs --preset (or a --config that names its preset): every trial "
                             "must resolve to the same config on any machine, GPU or not")
        trials, _ = plan_trials(args, args["config"])
        config_path = None
    ray, tune = _import_ray()
    os.environ.setdefault("TUNE_DISABLE_SIGINT_HANDLER", "1")  # Ctrl-C reaches numbarl-sweep itself
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # with verbose=0: no Tune tables, numbarl's own lines

    # RAY: a local instance, or the cluster at --address
    init = {"address": address} if address else {"include_dashboard": False}
    stopped = []  # the exception a SIGTERM raised (Ray Tune re-raises a plain KeyboardInterrupt)
    on_sigterm = signal.getsignal(signal.SIGTERM)  # the CLI's (stop like Ctrl-C): Ray's start replaces it
    try:
        ray.init(log_to_driver=False, configure_logging=True, logging_level="WARNING", **init)
        if callable(on_sigterm):
            signal.signal(signal.SIGTERM, functools.partial(_sigterm, on_sigterm, stopped))
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise SweepError(f"--address {address}: cannot join that Ray cluster ({str(e).splitlines()[0]}); "
                         "start one with `ray start --head`" if address else f"cannot start a local Ray: {e}") from None
    try:
        gpus = ray.cluster_resources().get("GPU", 0)
        if gpus_per_trial is None:
            gpus_per_trial = 1.0 if gpus else 0.0
        if gpus_per_trial > gpus:
            raise SweepError(f"--gpus-per-trial {gpus_per_trial}: the Ray cluster has {gpus:g} GPUs")
        # THE SWEEP FOLDER (created only now: every check above passed)
        if not resume:
            out.mkdir(parents=True, exist_ok=True)
            if args["config"]:
                config_path = str(out / (BASE_CONFIG + Path(args["config"]).suffix))
                Path(config_path).write_bytes(Path(args["config"]).read_bytes())
            from numbarl import __version__

            sweep = Sweep(out, {"format": SWEEP_FORMAT, "format_version": SWEEP_FORMAT_VERSION,
                                "numbarl_version": __version__,
                                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                "args": args, "base_config": Path(config_path).name if config_path else None,
                                "cwd": os.getcwd(), "trials": trials})
        (out / TRIALS_DIR).mkdir(exist_ok=True)
        (out / LOGS_DIR).mkdir(exist_ok=True)
        for t in sweep.trials:  # from the folders: a killed sweep's statuses are stale
            if t["status"] != "stopped_early":
                t["status"] = "finished" if run_finished(sweep.run_dir(t)) else "pending"
        sweep.record["resources"] = {"gpus_per_trial": gpus_per_trial, "cpus_per_trial": cpus_per_trial,
                                     "address": address, "max_concurrent": max_concurrent,
                                     "cluster_gpus": gpus, "cluster_cpus": ray.cluster_resources().get("CPU", 0)}
        sweep.save()
        _, steps = plan_trials(args, config_path)
        # with ASHA every trial reports (a finished one its saved epochs) so the rungs hold them all
        todo = [t for t in sweep.trials if args["asha"] or t["status"] not in ("finished", "stopped_early")]
        log(f"numbarl-sweep: {len(sweep.trials)} trials in {out} ({len(todo)} to run"
            f"{', ASHA on validation Sharpe' if args['asha'] else ''}); "
            f"{gpus_per_trial:g} GPU and {cpus_per_trial:g} CPU per trial")
        if todo:
            _fit(tune, sweep, args, config_path, todo, steps, gpus_per_trial, cpus_per_trial, max_concurrent, log)
    except KeyboardInterrupt as e:
        raise (stopped[0] if stopped else e) from None
    finally:  # Ctrl-C too: the workers end, their trial processes get SIGTERM (resumable run folders)
        ray.shutdown()
    text = _write_compare(sweep)
    log(text)
    failed = [t["name"] for t in sweep.trials if t["status"] == "failed"]
    if failed:
        log(f"numbarl-sweep: {len(failed)} of {len(sweep.trials)} trials failed ({', '.join(failed)}); logs in "
            f"{out / LOGS_DIR}; `numbarl-sweep --out {out} --resume` runs them again")
        return 1
    log(f"numbarl-sweep: results in {out / 'compare.txt'} and {out / 'compare.json'}")
    return 0


def _sigterm(handler, stopped: list, signum, frame):
    try:
        handler(signum, frame)
    except BaseException as e:
        stopped.append(e)
        raise


def _config_names_preset(path: str) -> bool:
    from numbarl import config as config_mod

    return bool(config_mod.load_file(path).get("preset"))


def _fit(tune, sweep, args, config_path, todo, steps, gpus_per_trial, cpus_per_trial, max_concurrent, log):
    env = {n: v for n, v in os.environ.items() if n.startswith(PASSED_ENV_PREFIXES) or n in PASSED_ENV}
    spec = {"dir": str(sweep.path), "cwd": sweep.record["cwd"], "args": args, "config_path": config_path, "env": env}
    scheduler = None
    if args["asha"]:
        from ray.tune.schedulers import ASHAScheduler

        # stop_last_trials=False: ASHA never stops a trial at its last epoch (its test still runs)
        scheduler = ASHAScheduler(metric=METRIC, mode="max", max_t=steps, grace_period=args["asha_grace"],
                                  reduction_factor=ASHA_REDUCTION, stop_last_trials=False)
    attempt = len(list((sweep.path / "ray").glob("tune-*"))) if (sweep.path / "ray").is_dir() else 0
    tuner = tune.Tuner(
        tune.with_resources(trial_main, {"cpu": cpus_per_trial, "gpu": gpus_per_trial}),
        param_space={"sweep": spec, "trial": tune.grid_search(todo)},
        tune_config=tune.TuneConfig(scheduler=scheduler, max_concurrent_trials=max_concurrent,
                                    trial_name_creator=lambda t: t.config["trial"]["name"],
                                    trial_dirname_creator=lambda t: t.config["trial"]["name"]),
        run_config=tune.RunConfig(name=f"tune-{attempt}", storage_path=str(sweep.path / "ray"), verbose=0,
                                  callbacks=[_status_callback(tune, sweep, log)]))
    results = tuner.fit()
    by_name = {t["name"]: t for t in sweep.trials}
    for result in results:
        entry = by_name[result.config["trial"]["name"]]
        if result.error is not None:
            entry["status"] = "failed"
            entry["error"] = str(result.error).strip().splitlines()[-1][:500]
    sweep.save()
