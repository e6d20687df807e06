"""The training loop behind ``numbarl-train`` (SPEC §6): data → walk-forward folds → per fold:
epochs of collect/train graph replays, a validation backtest and a checkpoint each epoch → the
best-by-validation checkpoint scored once on the fold's out-of-sample test window → report.

Read top to bottom it is the algorithm::

    cache  = prepare_data(cfg.data)                         fxcache (built once, then reused)
    folds  = walk_forward(cache.session_id, ...)            whole sessions, embargo between windows
    for fold in folds:
        env    = DeviceEnv(market, cfg.env, n_envs, bar_range=fold.train)   training bars only
        agent  = make_agent(cfg.agent, ...)                 fresh weights per fold (agent.kind registry)
        for epoch:                                          until train.early_stop_patience epochs pass the best
            for step:   collect.replay(); train.replay()    captured CUDA graphs
                        every log_interval: read mapped stats (the only host syncs)
            val    = backtest(fold.val, greedy agent)       full metrics, logged
                     after the first: the oracle and buy-and-hold backtests of fold.test start,
                     in a thread beside the training (run/fold_benchmarks.py)
            checkpoint(epoch); best ← val Sharpe (mean of the last select_window epochs)
        test   = backtest(fold.test, best checkpoint)       scored once (then the benchmarks joined)
                 held flat instead when the best epoch's validation trade t < train.deploy_min_trade_t
                 (the policy's own test kept beside it as test_policy)
    pooled = metrics(concatenated test windows of the folds) the headline (run/pooled.py)
    summary.json, trades_<split>.csv, equity/, train.log, report.html/png

Nothing from a fold's validation or test window reaches its training: the env draws episode
starts and steps only inside ``fold.train`` (its cursor stops at the range's end), features are
causal, and validation/test only read the agent's weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import numpy as np

from numbarl import __version__
from numbarl import config as config_mod
from numbarl.config import Config, ConfigError, parse_horizons
from numbarl.data.errors import DataError
from numbarl.rl.feedback.split import feedback_on, split_validation
from numbarl.rl.obs_columns import check_agent_columns
from numbarl.run.compare import checkpoint_epoch, deployment, held_flat
from numbarl.run.fold_benchmarks import FoldBenchmarkError, FoldBenchmarks, background_ok
from numbarl.run.progress import LOG_FILE, Progress
from numbarl.run.runio import RunDir, RunError

# summary.json's headline: the daily Sharpe first (per-bar Sharpe of a strategy whose bar returns
# are autocorrelated overstates; sharpe_adj is the per-bar Sharpe with Lo's (2002) correction)
HEADLINE_KEYS = ("daily_sharpe", "sharpe_adj", "sharpe", "total_return", "max_drawdown", "n_trades", "win_rate",
                 "avg_trade", "profit_factor")
INT_METRICS = ("n_trades",)  # counts: ints in summary.json, metrics.jsonl and the tables
SUMMARY_METRICS = ("sharpe", "daily_sharpe", "trade_sharpe", "sortino", "total_return", "max_drawdown", "calmar",
                   "win_rate", "profit_factor", "n_trades", "trades_per_day", "avg_hold", "exposure", "turnover")


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
def default_cache_dir(dcfg) -> Path:
    if dcfg.cache_dir:
        return Path(dcfg.cache_dir).expanduser()
    return Path(os.environ.get("NUMBARL_CACHE", Path.home() / ".cache" / "numbarl")).expanduser()


def _synth_spec(dcfg) -> dict:
    from numbarl.data import synth

    if dcfg.synth_scale == "tiny":
        spec = dict(synth.TINY)
    else:
        spec = {"events_per_session": synth.DEFAULT_EVENTS, "bars_per_day": synth.DEFAULT_BARS_PER_DAY}
    spec["sessions"] = dcfg.synth_sessions
    if dcfg.synth_bars_per_day:
        spec["bars_per_day"] = dcfg.synth_bars_per_day
    spec["signal"] = 0.0 if dcfg.synth_null else dcfg.synth_signal
    spec["null"] = dcfg.synth_null
    spec["seed"] = dcfg.synth_seed
    spec["features"] = dcfg.features
    if dcfg.synth_mode != "planted":  # only then: the planted market's caches keep their keys
        spec["mode"] = dcfg.synth_mode
        spec["regime_bars"] = dcfg.synth_regime_bars or synth.mode_regime_bars(dcfg.synth_mode)
    return spec


@contextlib.contextmanager
def _build_once(path: Path):
    """fxcache.build_lock around a cache build (runs started together build it once), and no empty
    `.<name>.lock` file left in the cache folder when the build fails (bad input, Ctrl-C): users
    found them piling up. A run waiting on the lock at that moment still holds the file open and
    builds the cache itself."""
    from numbarl.data.fxcache import META_FILE, build_lock

    try:
        with build_lock(path):
            yield
    except BaseException:
        if not (path / META_FILE).is_file():
            (path.parent / f".{path.name}.lock").unlink(missing_ok=True)
        raise


def prepare_data(dcfg, log=print):
    """Load or build the feature cache the config names. Errors are DataError (one clear line)."""
    from numbarl.data.fxcache import FORMAT_VERSION, META_FILE, build_cache, load_cache

    features = dcfg.features or None
    source = dcfg.source
    if source == "synthetic":
        from numbarl.data import synth

        spec = _synth_spec(dcfg)
        # the cache format is part of the key: a numbarl that writes another format builds a new
        # cache beside the old one instead of failing on it
        key = hashlib.sha256(json.dumps({**spec, "format": FORMAT_VERSION}, sort_keys=True).encode()).hexdigest()[:12]
        path = default_cache_dir(dcfg) / f"synthetic-{key}"
        if not (path / META_FILE).is_file():
            with _build_once(path):  # runs started together build it once
                if not (path / META_FILE).is_file():
                    log(f"building the synthetic market ({spec['sessions']} sessions, signal {spec['signal']}) -> {path}")
                    t0 = time.time()
                    synth.build_synthetic_cache(path, spec["sessions"], spec["seed"], spec["signal"], spec["null"],
                                                events_per_session=spec["events_per_session"],
                                                bars_per_day=spec["bars_per_day"], feature_names=features,
                                                overwrite=True, mode=spec.get("mode", "planted"),
                                                regime_bars=spec.get("regime_bars", synth.DEFAULT_REGIME_BARS))
                    log(f"synthetic market built in {time.time() - t0:.1f} s")
        return load_cache(path, expect_features=features)
    p = Path(source)
    if p.is_dir():
        if not (p / META_FILE).is_file():
            raise DataError(f"--data {p}: folder is not a numbarl feature cache (no {META_FILE}); "
                            "build one with `numbarl-data build` or pass DBN files")
        return load_cache(p, expect_features=features)
    files = [Path(x) for x in source.split(",") if x]
    for f in files:
        if not f.is_file():
            raise DataError(f"--data {f}: no such file or folder")
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.resolve()).encode())
        h.update(str(f.stat().st_size).encode())
        h.update(str(f.stat().st_mtime_ns).encode())
    h.update((dcfg.symbol + "|" + (dcfg.features or "") + f"|format{FORMAT_VERSION}").encode())
    path = default_cache_dir(dcfg) / f"cache-{h.hexdigest()[:12]}"
    if not (path / META_FILE).is_file():
        with _build_once(path):
            if not (path / META_FILE).is_file():
                log(f"building the feature cache from {len(files)} file(s) -> {path}")
                build_cache(files, path, symbol=dcfg.symbol or None, feature_names=features, overwrite=True)
    return load_cache(path, expect_features=features)


def make_folds(cache, tcfg):
    from numbarl.data.splits import walk_forward

    return walk_forward(cache.session_id, tcfg.folds, tcfg.embargo_bars, tcfg.train_sessions,
                        tcfg.val_sessions, tcfg.test_sessions)


def _finite(x):
    return float(x) if x is not None and math.isfinite(float(x)) else None


def _num(x, spec: str = ".3g") -> str:
    """A metric for a log line: compact, and 'n/a' for a missing (degenerate) value."""
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def metric_cell(name: str, value) -> str:
    """A metric in a printed table: counts as integers (3, not 3.0000), 'n/a' where undefined."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if name in INT_METRICS:
        return f"{int(value):,d}"
    return f"{float(value):,.4f}"


GAP_METRICS = ("sharpe", "daily_sharpe", "sharpe_adj", "total_return", "win_rate")


def val_test_gap(val: dict, test: dict) -> dict:
    """Validation minus out-of-sample test for the headline metrics of one fold (None where either
    is undefined): how much of the selected checkpoint's validation score survives out of sample."""
    gap = {}
    for k in GAP_METRICS:
        v, t = val.get(k), test.get(k)
        gap[k] = None if v is None or t is None else float(v) - float(t)
    return gap


def metrics_dict(metrics, p: int = 0) -> dict:
    values, reasons = metrics.policy(p)
    out = {k: _finite(v) for k, v in values.items()}
    for k in INT_METRICS:
        if out.get(k) is not None:
            out[k] = int(out[k])
    if reasons:
        out["nan_reasons"] = reasons
    return out


class NonFiniteError(RuntimeError):
    """The loss or a gradient became NaN/inf; the run stopped (its last good checkpoint, if one was
    saved, is kept)."""


# ---------------------------------------------------------------------------------------------
# one fold
# ---------------------------------------------------------------------------------------------
class FoldTrainer:
    """Trains one walk-forward fold: env on the training window, fresh agent, epochs, validation."""

    def __init__(self, cfg: Config, market, fold, run: RunDir, graph: bool, progress: Progress):
        from numbarl.cuda.runtime import stream
        from numbarl.env.device import DeviceEnv
        from numbarl.rl.agents.base import make_agent

        self.cfg, self.market, self.fold, self.run, self.graph = cfg, market, fold, run, graph
        self.progress = progress
        t = cfg.train
        self.seed = fold_seed(t.seed, fold.index)
        self.stream = stream()
        self.env = DeviceEnv(market, cfg.env, t.n_envs, bar_range=fold.train, seed=self.seed)
        self.agent = make_agent(cfg.agent, self.env.state_dim, cfg.env.branch_sizes, t.n_envs, self.seed,
                              eval_batch=1, epsilon=(t.epsilon_start, t.epsilon_end, t.epsilon_decay_steps),
                              feature_names=run.meta.get("feature_names"),  # the options naming obs columns
                              **({"branch_lr": True} if t.e4_trade_autopsy else {}))
        self.env.reset(self.seed, self.stream)
        # VALIDATION FEEDBACK (numbarl/rl/feedback): with a switch on, the validation window splits
        # into the part the loop reads and the part the model is selected on
        self.loop, self.feedback_window, self.val_window = None, None, fold.val
        self.gate_in_force = None
        self.last_stats = {}
        if feedback_on(t):
            from numbarl.rl.feedback.loop import FeedbackLoop

            self.feedback_window, self.val_window = split_validation(fold.val, t.feedback_split, t.embargo_bars)
            self.loop = FeedbackLoop(t, self.agent, cfg.env, market.data, fold.train, run.meta["feature_names"],
                                     market.tick_size)
            self.agent.attach_feedback(self.loop)  # before the step functions are captured
        self.steps = self.agent.step_functions(self.env)
        # the value support fitted to the prefill's returns, once, before the first train step
        # (agent.support = "fit"; a resumed fold has it in its checkpoint), and the freeze detector
        self.support_fitted = cfg.agent.support != "fit" or not hasattr(self.agent, "fit_support")
        self.freeze = None
        if cfg.agent.freeze_reset and hasattr(self.agent, "on_freeze"):
            from numbarl.rl.freeze import FreezeDetector

            self.freeze = FreezeDetector.from_config(cfg.agent)
        # the training envs' own realized results and reward terms, read once per epoch
        from numbarl.env.telemetry import TrainPathTelemetry

        self.telemetry = TrainPathTelemetry(self.env, market.bars_per_day)  # the agent's step functions, by graph name
        self.graphs = {}  # each captured on its first use (the capture's warm-up run is that step)
        self.collect_steps = 0  # host mirror of the device collect counter (for scheduling only)
        self.gates_on = True  # the agent's entry gates (a new agent's are on: arm_entry_gates)
        self.epoch = 0
        self.best_sharpe = -math.inf
        self.best_tag = None
        self.best_val = None  # the best epoch's validation BacktestResult (not kept across a resume)
        self.val_history = []
        self.snapshot_buffers = {}  # the checkpoints' page-locked host buffers (save)

    # -- checkpoints ----------------------------------------------------------------------------
    def tag(self, epoch: int) -> str:
        return f"fold{self.fold.index}-epoch{epoch:04d}"

    def epochs_since_best(self) -> int:
        """Epochs run after the best one so far (its tag names it, so this survives a resume); 0 before any."""
        return 0 if self.best_tag is None else self.epoch - checkpoint_epoch(self.best_tag)

    def save(self):
        from numbarl.cuda.runtime import pinned_snapshots

        # the device state's host snapshot (the critical path) goes into page-locked buffers made at
        # the first checkpoint and refilled by each later one, once the write of the one before has
        # finished (the writer thread reads them): no fresh pageable memory per checkpoint (the
        # replay alone is ~0.4 GB at the default preset), one asynchronous copy per view
        self.run.wait_checkpoint()
        with pinned_snapshots(self.snapshot_buffers):
            arrays = self.agent.state_arrays()
            for name, value in self.env.arena.to_host().items():
                arrays[f"env/{name}"] = value
            if self.loop is not None:  # E6/E8 device state
                arrays.update({f"feedback/{k}": v for k, v in self.loop.state_arrays().items()})
        # handed to the writer thread as they are: the buffers above, and copies of anything else
        # that is a view of memory its owner may change meanwhile
        buffers = {id(buf) for buf in self.snapshot_buffers.values()}
        arrays = {name: _owned(value, buffers) for name, value in arrays.items()}
        # the replay buffer (most of the bytes) only matters to an exact resume: latest checkpoint only
        replay = {name: arrays.pop(name) for name in [n for n in arrays if n.startswith("replay/")]}
        state = {"fold": self.fold.index, "epoch": self.epoch, "step": self.collect_steps,
                 "collect_steps": self.collect_steps,
                 "best_sharpe": _finite(self.best_sharpe), "best_tag": self.best_tag,
                 "val_history": self.val_history, "seed": self.seed, "support_fitted": self.support_fitted}
        if self.freeze is not None:
            state["freeze"] = self.freeze.state_dict()
        if self.loop is not None:  # the loop's state (resume) and the gate this epoch was validated with
            state["feedback"] = self.loop.state_dict()
            state["feedback_gate"] = self.gate_in_force
        tag = self.tag(self.epoch)
        # the arrays above are the device state's host snapshot (the critical path); serialization,
        # fsync and renames run on the run folder's writer thread while the next epoch trains, and
        # best.json moves once the checkpoint it names is on disk (runio.RunDir.save_checkpoint_async)
        best = None
        if self.best_tag is not None:
            best = (self.best_tag, self.best_sharpe if math.isfinite(self.best_sharpe) else -1e300)
        self.run.save_checkpoint_async(tag, arrays, state, resume_arrays=replay, mark_best=best, handed_over=True)
        return tag

    def restore(self, arrays: dict, state: dict):
        self.agent.load_state(arrays)
        self.env.arena.load({k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("env/")})
        self.epoch = int(state["epoch"])
        self.collect_steps = int(state["collect_steps"])
        self.best_sharpe = state["best_sharpe"] if state["best_sharpe"] is not None else -math.inf
        self.best_tag = state["best_tag"]
        # an undefined validation Sharpe is saved as JSON null
        self.val_history = [float("nan") if x is None else float(x) for x in state.get("val_history", [])]
        self.support_fitted = bool(state.get("support_fitted", True))  # the checkpoint holds the support
        if getattr(self, "freeze", None) is not None:
            self.freeze.load_state_dict(state.get("freeze"))
        if getattr(self, "loop", None) is not None:
            self.loop.load_state_dict(state.get("feedback"))
            self.loop.load_arrays({k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("feedback/")})

    # -- the loop --------------------------------------------------------------------------------
    def replay_graph(self, name: str):
        if name not in self.graphs:  # capture runs the step once (warm-up): that is this step
            t0 = time.perf_counter()
            self.graphs[name] = _capture(self.steps[name], self.stream, self.graph)
            self.stream.synchronize()  # the first run compiles its kernels: its time is the compile entry
            self.progress.charge("compile", time.perf_counter() - t0)
        else:
            self.graphs[name].replay(self.stream)

    def collect_once(self):
        self.replay_graph("collect")
        self.collect_steps += 1

    def run_epoch(self):
        t = self.cfg.train
        t0 = time.perf_counter()
        steps0 = self.collect_steps
        timed_at, timed_steps = t0, self.collect_steps  # the ETA's step timing, at each log sync
        for _ in range(t.collect_steps_per_epoch):
            # COLLECT (the entry gates off over the replay's prefill)
            self.arm_entry_gates(self.collect_steps >= self.agent.train_starts_after(t.learning_starts))
            self.collect_once()
            # TRAIN (what the agent runs after this collect step: a train step, or nothing yet)
            for name in self.agent.after_collect(self.collect_steps, t.learning_starts, t.train_every):
                if not self.support_fitted:  # before the train step's first replay (and its capture)
                    self.fit_support()
                self.replay_graph(name)
            # LOG (the only host reads inside an epoch)
            if self.collect_steps % t.log_interval == 0:
                if "diagnostics" in self.steps:  # what only the log reads, computed only here
                    self.replay_graph("diagnostics")
                stats = self.agent.read_stats(self.stream)
                self.last_stats = stats
                if self.loop is not None:
                    stats = {**stats, **self.loop.train_stats()}
                now = time.perf_counter()
                self.progress.done("step", self.collect_steps - timed_steps, now - timed_at)
                timed_at, timed_steps = now, self.collect_steps
                env_steps_per_s = (self.collect_steps - steps0) * t.n_envs / max(now - t0, 1e-9)
                record = {"kind": "train", "fold": self.fold.index, "epoch": self.epoch + 1,
                          "step": self.collect_steps, "env_steps_per_s": env_steps_per_s, **stats}
                self.run.log(self.progress.stamp(record))
                self.progress.status(
                    f"fold {self.fold.index} epoch {self.epoch + 1}/{t.epochs} collect+train step {self.collect_steps} "
                    f"{self.progress.bar()} ETA {self.progress.eta()} "
                    f"| {_num(env_steps_per_s)} env-steps/s | loss {stats['loss']:.4f} | eps {stats['epsilon']:.3f} "
                    f"| last val Sharpe {_num(self.val_history[-1] if self.val_history else None, '.2f')}")
                if stats["nonfinite_step"] >= 0:
                    self.stop_nonfinite(stats)
        # the agent leaves every epoch with its gates on, whoever steps it next (an epoch can end inside the prefill);
        # backtests (validation, test) are gated either way: their score kernels do not read the switch
        self.arm_entry_gates(True)
        self.stream.synchronize()  # once per epoch: the steps since the last log interval are done (ETA)
        self.progress.done("step", self.collect_steps - timed_steps, time.perf_counter() - timed_at)
        self.epoch += 1

    def arm_entry_gates(self, armed: bool) -> None:
        """The agent's entry gates on or off (DQNAgent.arm_entry_gates), written only when it changes."""
        if armed != self.gates_on:
            self.agent.arm_entry_gates(armed, self.stream)
            self.gates_on = armed

    def fit_support(self, when: str = "") -> dict | None:
        """The value support fitted to the replay's n-step returns (agent.support = 'fit'; the agent's
        fit_support): after the prefill, and with train.e3_refit_support each time E3 moves gamma (`when`)."""
        info = self.agent.fit_support(self.stream)
        self.support_fitted = True
        what = f"the replay's {self.agent.cfg.n_step}-step returns {when}" if when else \
            f"the prefill's {self.agent.cfg.n_step}-step returns"
        if info is None:
            kept = "" if when else f" at [{self.cfg.agent.v_min:g}, {self.cfg.agent.v_max:g}]"
            self.progress.log(f"fold {self.fold.index}: value support kept{kept} (no non-zero return in {what})")
        else:
            self.progress.log(f"fold {self.fold.index}: value support fitted to {what}: [{info['v_min']:.4g}, "
                              f"{info['v_max']:.4g}] (|R_n| quantile {info['abs_quantile']:.4g} x horizon factor "
                              f"{info['factor']:.3g})")
        return info

    def after_epoch(self):
        """The epoch's training-path record (numbarl/env/telemetry.py: the training envs' realized
        trades and reward terms since the last epoch), then the freeze detector on the epoch's
        last train record (agent.freeze_reset)."""
        from numbarl.env.telemetry import epoch_record

        self.run.log(self.progress.stamp({"kind": "train_path", "fold": self.fold.index, "epoch": self.epoch,
                                          "step": self.collect_steps,
                                          **epoch_record(self.telemetry, self.stream, self.market.bars_per_day)}))
        if self.freeze is not None and self.last_stats and self.freeze.update(self.last_stats):
            if self.agent.on_freeze(self.stream):
                self.progress.log(f"fold {self.fold.index} epoch {self.epoch}: Q statistics frozen for "
                                  f"{self.freeze.epochs} epochs with gradients flowing: Adam moments of the "
                                  "branch advantages reset")

    def stop_nonfinite(self, stats):
        what = {1: "loss", 2: "gradient norm"}.get(stats["nonfinite_what"], "value")
        tensors = self.agent.nonfinite_tensors()
        where = ", ".join(tensors) if tensors else "no parameter/gradient tensor (the loss inputs)"
        last = self.run.latest_checkpoint()
        if last is not None and last.get("tag"):
            kept = (f"the last good checkpoint {last['tag']} is kept (inspect it with "
                    f"`numbarl-backtest {self.run.path} --checkpoint {last['tag']}`)")
        else:
            kept = ("no checkpoint had been saved yet (it stopped in its first epoch), so none is kept; "
                    "`--resume` would start the fold over")
        raise NonFiniteError(
            f"non-finite {what} at train step {stats['nonfinite_step']} (fold {self.fold.index}, epoch "
            f"{self.epoch + 1}); non-finite tensors: {where}. The run stopped; {kept}.")

    # -- evaluation --------------------------------------------------------------------------------
    def evaluate(self, window, record_q: bool = False):
        from numbarl.env.backtest import backtest

        params = self.cfg.env
        self.agent.reset_eval(self.stream)  # a window starts with no state carried from the last one
        return backtest(self.market, window, params, q_fn=self.agent.scores, n_policies=1, stream=self.stream,
                        record_q=record_q)

    def flat_backtest(self, window):
        """The window held flat (direction flat at every bar): what a fold deploys when train.deploy_min_trade_t
        keeps its policy out of the test window. The env's own backtest, so its metrics, trade list and
        equity are those of any other window."""
        from numbarl.env.backtest import backtest
        from numbarl.env.params import DIR_FLAT, N_BRANCHES

        actions = np.zeros((window[1] - window[0], N_BRANCHES), np.int32)
        actions[:, 0] = DIR_FLAT
        t0 = time.perf_counter()
        result = backtest(self.market, window, self.cfg.env, actions=actions, stream=self.stream)
        self.progress.charge("test", time.perf_counter() - t0)
        return result

    def backtest_timed(self, window, what: str, record_q: bool = False):
        """A backtest of `window` with a status line before it and its time counted for the ETA."""
        bars = window[1] - window[0]
        self.progress.status(f"fold {self.fold.index} epoch {self.epoch}/{self.cfg.train.epochs} {what} backtest "
                             f"({bars} bars) {self.progress.bar()} ETA {self.progress.eta()}")
        t0 = time.perf_counter()
        result = self.evaluate(window, record_q)
        seconds = time.perf_counter() - t0
        self.progress.done("backtest", bars, seconds)
        self.progress.charge("test" if what.startswith("test") else "validation", seconds)
        return result

    def validate(self):
        if self.loop is not None:  # the feedback part first: what the loop reads
            self.gate_in_force = self.loop.gate_in_force()
            fb = self.backtest_timed(self.feedback_window, "validation (feedback part)", record_q=self.loop.record_q)
            fb_m = metrics_dict(fb.metrics())
            self.run.log(self.progress.stamp({"kind": "val_feedback", "fold": self.fold.index, "epoch": self.epoch,
                                              "step": self.collect_steps, **fb_m}))
        result = self.backtest_timed(self.val_window, "validation")
        m = metrics_dict(result.metrics())
        sharpe = m.get("sharpe")
        self.val_history.append(sharpe if sharpe is not None else float("nan"))
        self.run.log(self.progress.stamp(
            {"kind": "val", "fold": self.fold.index, "epoch": self.epoch, "step": self.collect_steps, **m}))
        if self.loop is not None:  # the knobs of the next epoch, from the feedback part only
            gamma_before = self.loop.state.gamma
            record = self.loop.on_epoch(fb, fb_m, self.last_stats.get("epsilon", self.agent.eps_end))
            if self.cfg.train.e3_refit_support and self.loop.state.gamma != gamma_before and self.support_fitted:
                # E3 moved gamma (already on the device): the support from the replay's returns at the new gamma
                info = self.fit_support(f"at E3's gamma {self.loop.state.gamma:.4g}")
                record["e3.support_v"] = None if info is None else info["v_max"]
            self.run.log(self.progress.stamp({"kind": "feedback", "fold": self.fold.index, "epoch": self.epoch,
                                              "step": self.collect_steps, **record}))
        return result, m, selection_score(self.val_history, self.cfg.train.select_window)


def _owned(value, buffers: set) -> np.ndarray:
    """`value` as an array nobody else changes: itself when it is one of the snapshot `buffers`
    (ids) or owns its memory, else a copy."""
    array = np.asarray(value)
    if id(array) in buffers or (array.flags.owndata and array.base is None):
        return array
    return array.copy()


def fold_seed(seed: int, fold: int) -> int:
    """The seed of walk-forward fold `fold`: the run's seed for fold 0, a splitmix64 mix of (seed, fold)
    otherwise, so that no two (seed, fold) pairs of a seed sweep share a stream (seed + 1000·fold did:
    seed 1000 fold 0 = seed 0 fold 1)."""
    if fold == 0:
        return int(seed)
    mask = (1 << 64) - 1
    z = (int(seed) + (int(fold) * 0x9E3779B97F4A7C15)) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 2  # 62 bits: a non-negative int64 wherever a seed goes


def selection_score(history, window: int) -> float:
    """Model-selection score of the latest epoch: the mean validation Sharpe of the last `window`
    epochs; -inf before `window` epochs exist or when one of them is undefined (NaN)."""
    recent = history[-window:]
    if len(recent) < window or any(not math.isfinite(x) for x in recent):
        return -math.inf
    return math.fsum(recent) / window


def _capture(step_fn, stream, graph: bool):
    from numbarl.cuda import graph as cuda_graph

    return cuda_graph.capture(step_fn, stream, eager=not graph)


# ---------------------------------------------------------------------------------------------
# the whole run
# ---------------------------------------------------------------------------------------------
def _plan(progress: Progress, tcfg, folds_left, resume):
    """The work left for the ETA: collect steps, backtest bars (each epoch's validation, each fold's
    test and oracle) and checkpoints of the folds not finished yet."""
    steps = bars = checkpoints = 0
    for fold in folds_left:
        epochs = tcfg.epochs
        if resume is not None and resume[1]["fold"] == fold.index:
            epochs -= int(resume[1]["epoch"])
        steps += epochs * tcfg.collect_steps_per_epoch
        bars += epochs * (fold.val[1] - fold.val[0]) + (fold.test[1] - fold.test[0])
        checkpoints += epochs
    progress.plan(steps, bars, checkpoints)


def _tidy_prices(trades, tick: float):
    """Trade prices as a person writes them: a price within 1e-6 tick of the tick grid snapped onto it
    and printed with the tick's decimals (3937.0, not 3937.0000000000005); others (a target or stop
    between ticks) rounded to 1e-9 to drop float noise."""
    if trades is None or not len(trades) or not tick > 0:
        return trades
    decimals = max(0, -Decimal(repr(float(tick))).normalize().as_tuple().exponent)
    out = trades.copy()
    for column in ("entry_price", "exit_price"):
        if column in out.columns:
            price = out[column].to_numpy(np.float64)
            ticks = np.round(price / tick)
            on_grid = np.abs(price / tick - ticks) < 1e-6
            out[column] = np.where(on_grid, np.round(ticks * tick, decimals), np.round(price, 9))
    return out


def write_fold_results(run: RunDir, cache, fold: int, results, tick: float) -> None:
    """The trade list (trades_<split>.csv) and per-bar series (equity/<split>_fold<k>) of each
    (split, BacktestResult) of fold `fold`, in order."""
    for split, result in results:
        trades = _tidy_prices(result.trades, tick)
        if trades is not None and len(trades):
            trades = trades.assign(fold=fold)
        run.write_trades(split, trades, fold=fold)
        lo = result.window[0]
        run.write_equity(split, fold, {"pnl": result.pnl[0], "position": result.position[0],
                                       "session_id": np.asarray(result.session_id),
                                       "timestamps": np.asarray(cache.timestamps[lo:lo + result.pnl.shape[1]])})


def pooled_summary(run: RunDir, bars_per_day: float, initial_capital: float) -> dict:
    """summary.json's "pooled" (the metrics of each split's fold windows concatenated: the
    out-of-sample track record, numbarl/run/pooled.py) and "headline" (the pooled test window's
    daily Sharpe, with the autocorrelation-adjusted per-bar Sharpe beside it, and the numbers a
    reader checks next)."""
    from numbarl.run.pooled import pooled_metrics

    pooled = {}
    for split in ("val", "test", "oracle_test", "hold_test"):
        m = pooled_metrics(run, split, bars_per_day, initial_capital)
        if m is not None:
            pooled[split] = metrics_dict(m)
    test = pooled.get("test") or {}
    headline = {"split": "test", "folds": len(run.read_equity("test"))}
    headline.update({k: test.get(k) for k in HEADLINE_KEYS})
    return {"pooled": pooled, "headline": headline}


def _benchmark_times(previous: dict | None, bench: FoldBenchmarks) -> dict:
    """summary.json's "fold_benchmarks": the oracle and buy-and-hold backtests of the folds so far
    (a resumed run adds to the killed one's): `job_s` their own seconds (beside the training when
    `overlapped` folds > 0), `waited_s` what the run waited for them at the folds' ends (inside
    time_other_s's `benchmarks`; the rest of job_s was hidden behind the training)."""
    out = {"folds": 0, "overlapped": 0, "job_s": 0.0, "waited_s": 0.0, **(previous or {})}
    out["folds"] += 1
    out["overlapped"] += int(bench.overlapped)
    out["job_s"] = round(out["job_s"] + bench.job_s, 3)
    out["waited_s"] = round(out["waited_s"] + bench.waited_s, 3)
    return out


def _checkpoint_written(progress: Progress, info: dict) -> None:
    """A background checkpoint write the run waited for: the wait counts to the time budget's
    checkpoint entry, and train.log says that it is on disk (or that it failed)."""
    progress.charge("checkpoint", info["waited_s"])
    if info["committed"]:
        progress.note(f"checkpoint {info['tag']} on disk ({info['bytes'] / 2**20:.1f} MiB written in the "
                      f"background in {info['write_s']:.2f} s; {info['waited_s']:.2f} s waited for)")
    if info["error"] is not None:
        progress.note(f"checkpoint {info['tag']}: {'best pointer not updated' if info['committed'] else 'not saved'}: "
                      f"{info['error']!r}")


def _headline_text(m: dict) -> str:
    return (f"daily Sharpe {_num(m.get('daily_sharpe'), '.2f')} (sharpe_adj {_num(m.get('sharpe_adj'), '.2f')}) "
            f"| return {_num(m.get('total_return'), '.3%')} | max DD {_num(m.get('max_drawdown'), '.2%')} "
            f"| trades {_num(m.get('n_trades'), 'd')} | win rate {_num(m.get('win_rate'), '.1%')}")


def run_training(cfg: Config, cache, run: RunDir, graph: bool, progress: Progress,
                 resume: tuple | None = None, resuming: bool = False) -> dict:
    """Train every fold not yet finished. `resume`: (arrays, state) of the latest checkpoint;
    `resuming`: the run folder already holds a (killed) run, whose records after its last
    checkpoint are dropped so the resumed log reads like an uninterrupted one."""
    from numbarl.cuda.runtime import device_name
    from numbarl.env.market import MarketData

    folds = make_folds(cache, cfg.train)
    begun = progress.part_begin()  # the parts of the time budget's `other` (summary.json's time_other_s)
    host_market = MarketData.from_cache(cache)
    market = host_market.to_device(cfg.env.vol_span, cfg.env.vol_horizon_bars)
    progress.part_end("setup", begun)
    summary = run.read_summary() if resume and (run.path / "summary.json").exists() else None
    summary = summary or {"folds": [], "seed": cfg.train.seed, "numbarl_version": __version__,
                          "device": device_name(), "preset": cfg.preset, "bars_per_day": cache.bars_per_day,
                          "data": str(cache.path)}
    # the execution assumption every result of the run rests on, stated where results are shown
    summary.setdefault("fill_assumption", cfg.env.fill_assumption())
    previous_budget = summary.get("time_budget_s")  # a resumed run adds its time to the killed one's
    run.on_checkpoint_written = lambda info: _checkpoint_written(progress, info)
    progress.log(f"execution: {summary['fill_assumption']}")
    done_folds = {f["fold"] for f in summary["folds"]}
    if resume is not None and all(f.index in done_folds for f in folds):
        progress.log(f"{run.path}: every fold ({len(folds)}) has finished; nothing to resume (report rewritten)")
    _plan(progress, cfg.train, [f for f in folds if f.index not in done_folds], resume)
    if resuming:  # the elapsed-time column goes on from where the killed run's log stopped
        progress.elapsed_offset = max([float(r.get("elapsed_s") or 0.0) for r in run.read_metrics()] or [0.0])
    t_start = time.time()
    for fold in folds:
        if fold.index in done_folds:
            continue
        progress.log(f"fold {fold.index}: train bars {fold.train}, validation {fold.val}, test {fold.test}")
        begun = progress.part_begin()
        ft = FoldTrainer(cfg, market, fold, run, graph, progress)
        progress.part_end("setup", begun)
        if cache.oracle is not None and hasattr(ft.agent, "set_behavior_signal"):
            ft.agent.set_behavior_signal(cache.oracle)  # dt: on synthetic data the planted oracle is the behavior policy
        run.reset_best()  # best.json: the best checkpoint of the fold in training
        # the oracle and buy-and-hold backtests of the test window read only the market: they run
        # beside epochs 2.. of the fold (numbarl/run/fold_benchmarks.py), started after the fold's
        # first validation (its graphs are captured by then)
        bench = FoldBenchmarks(cache, market, fold, cfg.env, background=background_ok())
        try:
            if resume is not None and resume[1]["fold"] == fold.index:
                ft.restore(*resume)
                # records after the checkpoint, and a test record of this fold (logged at its step), go
                run.truncate_log(ft.collect_steps, fold=fold.index, closing_kinds=("test", "test_policy"))
                if ft.best_tag is not None:  # a kill between save and mark_best left best.json behind
                    run.mark_best(ft.best_tag, ft.best_sharpe if math.isfinite(ft.best_sharpe) else -1e300)
                progress.log(f"resumed fold {fold.index} after epoch {ft.epoch} (step {ft.collect_steps})")
            elif resuming:  # the fold starts over: whatever it logged before the kill goes
                run.truncate_log(-1, fold=fold.index)
            stopped_after, patience = None, cfg.train.early_stop_patience
            while ft.epoch < cfg.train.epochs:
                # EARLY STOP (checked before each epoch, so a resumed run stops where the full one did), counted
                # from a defined best: not while every score is -inf (select_window's first epochs, no trades)
                if patience and math.isfinite(ft.best_sharpe) and ft.epochs_since_best() >= patience:
                    stopped_after, skipped = ft.epoch, cfg.train.epochs - ft.epoch
                    progress.skip("step", skipped * cfg.train.collect_steps_per_epoch)
                    progress.skip("backtest", skipped * (fold.val[1] - fold.val[0]))
                    progress.skip("checkpoint", skipped)
                    progress.log(f"fold {fold.index}: early stop after epoch {ft.epoch} of {cfg.train.epochs}: {patience} "
                                 f"epochs without a better validation score than {ft.best_tag} (train.early_stop_patience)")
                    break
                ft.run_epoch()
                begun = progress.part_begin()
                ft.after_epoch()
                progress.part_end("epoch_records", begun)
                # VALIDATE (logged before the checkpoint so a resume keeps it)
                begun = progress.part_begin()
                val_result, m, score = ft.validate()  # the backtest's seconds are the budget's validation
                progress.part_end("validation_metrics", begun)
                if ft.epoch < cfg.train.epochs and not bench.started:  # epochs follow to run them beside
                    begun = progress.part_begin()
                    bench.start()  # a thread on a GPU (at once); computed here under the simulator
                    progress.part_end("benchmarks", begun)
                if score > ft.best_sharpe or ft.best_tag is None:
                    ft.best_sharpe, ft.best_tag, ft.best_val = score, ft.tag(ft.epoch), val_result
                run.wait_checkpoint()  # the last epoch's background write (done by now, unless the disk is slow)
                t0 = time.perf_counter()
                progress.status(f"fold {fold.index} epoch {ft.epoch}/{cfg.train.epochs} checkpoint {ft.tag(ft.epoch)} "
                                f"{progress.bar()} ETA {progress.eta()}")
                tag = ft.save()  # the snapshot; the write (and the best pointer) in the background
                progress.done("checkpoint", 1, time.perf_counter() - t0)
                bench.check()  # a failed benchmark job stops the run now (after this epoch's checkpoint)
                writing = " (writing)" if run.pending_checkpoint() == tag else ""
                progress.log(f"fold {fold.index} epoch {ft.epoch}/{cfg.train.epochs}: val Sharpe "
                             f"{_num(m.get('sharpe'), '.2f')} | trades {_num(m.get('n_trades'), 'd')} | return "
                             f"{_num(m.get('total_return'), '.3%')} | checkpoint {tag}{writing} | ETA {progress.eta()}")
            # the benchmarks' job ends before the test backtest captures its graph (a capture would
            # wait for it too, but then the wait would count as test time)
            waited = progress.part_begin()
            bench.join()
            progress.part_end("benchmarks", waited)
            # TEST: the best-by-validation checkpoint, scored once on the out-of-sample window
            begun = progress.part_begin()  # the test's backtest and any checkpoint wait are budget entries
            best_arrays, best_state = run.load_checkpoint(ft.best_tag, prefix=ft.agent.policy_prefixes)
            ft.agent.load_params(best_arrays)
            if ft.loop is not None:  # the policy includes the E9 gate it was validated with
                ft.loop.set_gate(best_state.get("feedback_gate"))
            val_result = (ft.best_val if ft.best_val is not None
                          else ft.backtest_timed(ft.val_window, "validation (best epoch)"))
            test_result = ft.backtest_timed(fold.test, "test (out-of-sample)")
            val_m, test_m = metrics_dict(val_result.metrics()), metrics_dict(test_result.metrics())
            # DEPLOY (train.deploy_min_trade_t): a fold whose validation trades fall short holds its test window flat
            deploy, policy_m = deployment(val_m, cfg.train.deploy_min_trade_t), test_m
            flat = held_flat(deploy or {})
            if flat:
                run.log(progress.stamp({"kind": "test_policy", "fold": fold.index, "epoch": ft.epoch,
                                        "step": ft.collect_steps, **policy_m}))
                test_result = ft.flat_backtest(fold.test)
                test_m = metrics_dict(test_result.metrics())
                bar, vt = cfg.train.deploy_min_trade_t, deploy["val_trade_t"]
                no_t = (val_m.get("nan_reasons") or {}).get("trade_sharpe", "undefined")
                why = (f"validation trade t {vt:.2f} < {bar:g}" if vt is not None
                       else f"no validation trade t ({no_t}), bar {bar:g}")
                progress.log(f"fold {fold.index}: not deployed: {why} (train.deploy_min_trade_t); the test window is "
                             f"held flat. The policy's own test (test_policy, a diagnostic): {_headline_text(policy_m)}")
            run.log(progress.stamp({"kind": "test", "fold": fold.index, "epoch": ft.epoch, "step": ft.collect_steps,
                                    **test_m, **({"deployed": deploy["deployed"]} if deploy else {})}))
            results = [("val", val_result), ("test", test_result)]
            entry = {"fold": fold.index, "window": fold.to_dict(), "best_checkpoint": ft.best_tag,
                     **({"validation_split": {"feedback": list(ft.feedback_window), "selection": list(ft.val_window)}}
                        if ft.loop is not None else {}),
                     **(deploy or {}), **({"test_policy": policy_m} if flat else {}),
                     # the gap is the policy's (how its validation score carried out of sample), deployed or not
                     "val": val_m, "test": test_m, "val_test_gap": val_test_gap(val_m, policy_m),
                     "bars_per_day": cache.bars_per_day, "seed": ft.seed, "val_sharpe_per_epoch": ft.val_history,
                     **({"early_stop_after_epoch": stopped_after} if stopped_after is not None else {})}
            # the oracle and buy-and-hold results (computed beside the training, or now): the wait
            # for them is a part of `other` of its own
            waited = progress.part_begin()
            for split, result, metrics in bench.results():
                entry[split] = metrics
                results.append((split, result))
            progress.part_end("benchmarks", waited)
            summary["fold_benchmarks"] = _benchmark_times(summary.get("fold_benchmarks"), bench)
            from numbarl.cuda import blas

            gemm_tuning = blas.tuning_info()  # NUMBARL_GEMM_TUNING: which algorithms the GEMMs ran
            if gemm_tuning["file"]:
                summary["gemm_tuning"] = gemm_tuning
            oracle = "oracle_test" in entry
            write_fold_results(run, cache, fold.index, results, cfg.env.resolved_tick_size(cache.tick_size))
            summary["folds"].append(entry)
            summary.update(pooled_summary(run, cache.bars_per_day, cfg.env.initial_capital))
            summary["wall_time_s"] = summary.get("wall_time_s", 0.0) + (time.time() - t_start)
            t_start = time.time()
            run.write_summary(summary)
            progress.part_end("fold_results", begun)
            progress.log(f"fold {fold.index} test: {_headline_text(test_m)}"
                         + (f" | oracle daily Sharpe {_num(entry['oracle_test'].get('daily_sharpe'), '.2f')}"
                            if oracle else ""))
        except BaseException:
            bench.join()  # a stopping run leaves no job on the device (the job's own error, if any, is dropped)
            raise
    if len(summary["folds"]) > 1:
        headline = summary.get("headline") or {}
        progress.log(f"out-of-sample, the {len(summary['folds'])} folds' test windows pooled: "
                     f"{_headline_text(headline)}")
    begun = progress.part_begin()
    run.write_csv()
    progress.part_end("fold_results", begun)
    from numbarl.run.report import write_report

    t_report = time.perf_counter()
    html, png = write_report(run)
    progress.charge("report", time.perf_counter() - t_report)
    # the time budget (measured: issue 17's "where a run's wall time goes"), then the report again
    # would be circular: summary.json gets it, the log prints it
    summary["time_budget_s"] = progress.time_budget(previous_budget)
    summary["time_other_s"] = progress.time_other(summary.get("time_other_s"))  # what `other` is made of
    # the background checkpoint writes: their thread's seconds (hidden behind training) and the
    # seconds the run waited for them (inside time_budget_s's checkpoint entry)
    writes = summary.get("checkpoint_writes") or {}
    summary["checkpoint_writes"] = {k: round(v + (writes.get(k) or 0), 3) for k, v in run.checkpoint_writes.items()}
    run.write_summary(summary)
    progress.log("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in summary["time_budget_s"].items()))
    cw = summary["checkpoint_writes"]
    progress.note("time other: " + ", ".join(f"{k} {v:.2f} s" for k, v in summary["time_other_s"].items())
                  + f" | checkpoints written in the background: {cw['count']}, {cw['bytes'] / 2**20:.0f} MiB in "
                  f"{cw['write_s']:.2f} s, of which the run waited {cw['waited_s']:.2f} s"
                  + (f" | oracle and buy-and-hold backtests: {fb['job_s']:.2f} s ({fb['overlapped']} of {fb['folds']} "
                     f"fold(s) beside the training), of which the run waited {fb['waited_s']:.2f} s"
                     if (fb := summary.get("fold_benchmarks")) else ""))
    if len(summary["folds"]) > 1:  # the out-of-sample spread over the folds (numbarl-compare's table)
        from numbarl.run import compare

        rows = compare.compare_rows([run])
        progress.log(compare.format_table(rows, compare.summarize(rows), {}).rsplit("\n", 1)[0])
    progress.log(f"report: {html}")
    return summary


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM) stopped a run; `run_path` is the folder `--resume` continues (None when
    it was not made yet), `cause` the KeyboardInterrupt (or the CLI's SIGTERM subclass of it)."""

    def __init__(self, run_path, cause: BaseException):
        super().__init__(f"interrupted ({type(cause).__name__})")
        self.run_path, self.cause = run_path, cause


# presets sized for a GPU: under the simulator (each GPU thread a Python thread) one of their epochs
# takes hours on a CPU (measured: --preset default printed nothing for 10 minutes on 2 cores)
GPU_PRESETS = tuple(name for name in config_mod.PRESETS if name != "tiny")


def main(data=None, preset=None, config_file=None, sets=(), seed=None, folds=None, epochs=None,
         out_dir=None, resume_dir=None, graph=True, simulator=False, quiet=False, default_preset="default",
         print_config=False):
    """numbarl-train: validate everything, then train (see module docstring). `preset` None: the
    config file's preset, else `default_preset`. `print_config`: return the resolved config as TOML
    without training (nothing is read or written)."""
    progress = Progress(quiet)
    resume = None
    run = None
    if resume_dir:
        run = RunDir.open(resume_dir, clean=True)
        cfg = config_mod.from_dict(run.config)
        if run.latest_checkpoint() is not None:  # none yet: the run starts over in its folder
            resume = run.load_checkpoint("latest", require_resume=True)
        graph = graph and bool(run.meta.get("graph", True))  # --no-graph may switch a resumed run to eager
    else:
        direct = {"train.seed": seed, "train.folds": folds, "train.epochs": epochs,
                  "data.source": data}
        cfg = config_mod.resolve(preset, config_file, sets, default_preset=default_preset,
                                 **{k: v for k, v in direct.items() if v is not None})
        if not graph:
            cfg = replace(cfg, train=replace(cfg.train, graph=False))
    if print_config:
        return config_mod.to_toml(cfg)
    graph = graph and cfg.train.graph
    if simulator and cfg.preset in GPU_PRESETS:
        progress.warn(f"preset {cfg.preset!r} ({cfg.train.n_envs} envs, batch {cfg.agent.batch_size}) is sized "
                      "for a GPU; under the CUDA simulator it cannot realistically finish on a CPU (hours per "
                      "epoch). Use --preset tiny (the default without a GPU) to try numbarl here.")
    if not resume_dir:
        if out_dir is None:
            out_dir = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        RunDir.check_destination(out_dir)  # before the data is read or built: a bad --out fails at once
    try:
        # DATA (validated before anything is written)
        t_data = time.perf_counter()
        cache = prepare_data(cfg.data, log=progress.log)
        progress.charge("data", time.perf_counter() - t_data)
        folds = make_folds(cache, cfg.train)  # too few sessions → DataError before any output
        if feedback_on(cfg.train):  # a validation window too short to split: before any output too
            for f in folds:
                try:
                    split_validation(f.val, cfg.train.feedback_split, cfg.train.embargo_bars)
                except ValueError as e:
                    raise ConfigError(f"train.feedback_split = {cfg.train.feedback_split}: fold {f.index}: {e}") from None
        if cache.features.shape[1] < 1:
            raise DataError(f"{cache.path}: the cache has no features")
        # the options naming obs columns by feature: this cache's names, before anything is written
        check_agent_columns(cfg.agent, cache.feature_names, cfg.env.state_dim(cache.features.shape[1]))
        if not resume_dir:
            run = RunDir.create(out_dir, cfg.to_dict(), {"graph": graph, "simulator": simulator,
                                                        "numbarl_version": __version__,
                                                        "feature_names": list(cache.feature_names)})
        progress.attach(run.path / LOG_FILE)
        if resume_dir:
            progress.log(f"resuming run {run.path}")
        else:
            progress.log(f"run folder: {run.path} (log: {run.path / LOG_FILE})")
        progress.log(f"preset {cfg.preset} | {cache.n_bars} bars, {cache.n_sessions} sessions, "
                     f"{cache.bars_per_day:.0f} bars/day, {cache.features.shape[1]} features | "
                     f"{cfg.train.n_envs} envs | {'graphs' if graph else 'eager'}"
                     f"{' | simulator' if simulator else ''}")
        try:
            return run_training(cfg, cache, run, graph, progress, resume, resuming=bool(resume_dir))
        except BaseException:
            _finish_checkpoint_write(run, progress)  # a checkpoint the log named is on disk before we stop
            raise
    except KeyboardInterrupt as e:
        if run is not None:
            # train.log keeps the news; the console gets the CLI's one line (not the same hint twice)
            progress.note(f"interrupted ({'SIGTERM' if type(e) is not KeyboardInterrupt else 'Ctrl-C'}); "
                          f"continue with: numbarl-train --resume {run.path}")
        raise Interrupted(run.path if run is not None else None, e) from None
    except (NonFiniteError, FoldBenchmarkError) as e:
        progress.log(f"error: {e}")
        raise
    finally:
        progress.close()


def _finish_checkpoint_write(run: RunDir, progress: Progress) -> None:
    """A run that stops (Ctrl-C, an error) first finishes the checkpoint being written in the
    background; that write's own error, if any, is only reported (the stop's cause goes on)."""
    try:
        run.wait_checkpoint()
    except BaseException as err:  # noqa: BLE001 - the run is stopping for another reason
        progress.warn(f"the checkpoint write in flight when the run stopped failed ({err!r}); "
                      "the last checkpoint on disk is kept")


def _check_same_features(run: RunDir, cache) -> None:
    """The agent reads features by position: scoring it on a cache with other features (or the
    same ones in another order) would be silently wrong."""
    trained = run.meta.get("feature_names")
    if trained is None:  # a run folder from before the names were recorded: the width at least
        return
    have = list(cache.feature_names)
    if have != list(trained):
        diff = next((i for i, (a, b) in enumerate(zip(have, trained)) if a != b), min(len(have), len(trained)))
        raise DataError(
            f"{cache.path}: its features differ from the ones run {run.path} trained on ({len(have)} vs "
            f"{len(trained)} features; first difference at column {diff}: "
            f"{have[diff] if diff < len(have) else '(none)'!r} vs {trained[diff] if diff < len(trained) else '(none)'!r}); "
            "rebuild the cache with the run's data.features")


def _checkpoints_to_score(run: RunDir, checkpoint: str, folds) -> list[tuple[str, object]]:
    """(tag, fold) pairs for numbarl-backtest: a checkpoint is only ever scored on its own fold
    (a later fold's agent has trained on an earlier fold's validation and test windows).

    "best": each fold's best-by-validation checkpoint (summary.json for a finished fold, best.json
    for the fold in training); "all": every saved checkpoint; "latest" or a tag: that checkpoint.
    """
    by_index = {f.index: f for f in folds}
    saved = {c["tag"]: c["state"].get("fold") for c in run.list_checkpoints()}
    wanted = f"fold(s) {sorted(by_index)}"
    if checkpoint == "all":
        out = [(tag, by_index[k]) for tag, k in saved.items() if k in by_index]
        if not out:
            raise RunError(f"{run.path}: no saved checkpoint for {wanted}")
        return out
    if checkpoint == "best":
        summary = run.read_summary() if run.summary_path.exists() else None
        finished = {f["fold"]: f["best_checkpoint"] for f in (summary or {}).get("folds", [])}
        pointer = run.best_checkpoint()
        if pointer is not None and saved.get(pointer.get("tag")) is not None:
            finished.setdefault(saved[pointer["tag"]], pointer["tag"])  # the fold in training
        out = [(finished[k], f) for k, f in by_index.items() if finished.get(k)]
        if not out:
            raise RunError(f"{run.path}: no best checkpoint for {wanted} (no epoch has been validated yet)")
        return out
    tag = run.resolve_tag(checkpoint)
    if tag not in saved:
        known = ", ".join(saved) or "none"
        raise RunError(f"checkpoint {tag!r} not found in {run.checkpoints_dir} (saved: {known})")
    k = saved[tag]
    if k not in by_index:
        raise RunError(f"checkpoint {tag!r} belongs to fold {k}; it is scored on its own fold only (asked: {wanted})")
    return [(tag, by_index[k])]


def backtest_replay_capacity(agent_cfg) -> int:
    """Replay slots of the one-env agent that scores a saved policy (it never trains): the smallest replay its
    checks accept, the longest n-step window (agent.horizons too) plus one slot, or plus the temporal input's K
    rows of history (numbarl/rl/temporal.py check_replay)."""
    window = max((int(agent_cfg.n_step), *parse_horizons(agent_cfg.horizons)))
    return window + (int(agent_cfg.temporal_steps) if agent_cfg.temporal else 1)


def backtest_main(run_dir, checkpoint="best", data=None, split="test", fold=None, as_json=False):
    """numbarl-backtest: re-score a saved agent on a split of its folds.

    ``checkpoint="all"`` scores every saved checkpoint on its own fold (one row per checkpoint and
    split): a diagnostic of how each epoch generalizes. Choosing a checkpoint by its test score
    would be selection on the test window; the run's own choice is the best-by-validation one.
    """
    import pandas as pd

    from numbarl.env.backtest import backtest
    from numbarl.env.device import DeviceEnv  # noqa: F401 - compiles kernels the agent needs
    from numbarl.env.market import MarketData
    from numbarl.cuda.runtime import stream
    from numbarl.rl.agents.base import make_agent

    run = RunDir.open(run_dir)
    cfg = config_mod.from_dict(run.config)
    if data:
        cfg = replace(cfg, data=replace(cfg.data, source=data))
    cache = prepare_data(cfg.data, log=lambda m: print(m, file=sys.stderr))
    _check_same_features(run, cache)
    folds = make_folds(cache, cfg.train)
    chosen = [f for f in folds if fold is None or f.index == fold]
    if not chosen:
        raise RunError(f"{run_dir}: no fold {fold}; the run has folds 0..{len(folds) - 1}")
    every = checkpoint == "all"
    tags = _checkpoints_to_score(run, checkpoint, chosen)
    host_market = MarketData.from_cache(cache)
    market = host_market.to_device(cfg.env.vol_span, cfg.env.vol_horizon_bars)
    state_dim = cfg.env.state_dim(cache.features.shape[1])
    small = replace(cfg.agent, batch_size=1, replay_capacity=backtest_replay_capacity(cfg.agent))
    agent = make_agent(small, state_dim, cfg.env.branch_sizes, 1, cfg.train.seed, eval_batch=1,
                       feature_names=cache.feature_names)
    rows = []
    loops = {}
    for tag, f in tags:
        arrays, state = run.load_checkpoint(tag, prefix=agent.policy_prefixes)
        agent.load_params(arrays)
        if cfg.train.e9_tradability_gate:  # the policy includes the E9 gate it was validated with
            from numbarl.rl.feedback.loop import FeedbackLoop

            if f.index not in loops:  # one per fold: a captured backtest graph keeps its loop's tables
                loops[f.index] = FeedbackLoop(cfg.train, agent, cfg.env, host_market, f.train, cache.feature_names,
                                              cache.tick_size)
            loops[f.index].set_gate(state.get("feedback_gate"))
            agent.attach_feedback(loops[f.index])
        for name in (("val", "test") if split == "all" else (split,)):
            window = getattr(f, name)
            if name == "val" and feedback_on(cfg.train):  # the run's validation is the selection part
                window = split_validation(f.val, cfg.train.feedback_split, cfg.train.embargo_bars)[1]
            agent.reset_eval(stream())
            result = backtest(market, window, cfg.env, q_fn=agent.scores, n_policies=1, stream=stream())
            rows.append({"checkpoint": tag, "epoch": state.get("epoch"), "fold": f.index, "split": name,
                         **metrics_dict(result.metrics())})
    if as_json:
        print(json.dumps({"run": str(run.path), "checkpoint": checkpoint, "results": rows}, indent=2, default=str))
        return
    used = ", ".join(f"fold {f.index}: {tag}" for tag, f in tags)
    print(f"run {run.path} | checkpoint {checkpoint}" + ("" if every else f" ({used})"))
    print(f"execution: {cfg.env.fill_assumption()}")
    if every:  # one line per checkpoint and split, the headline metrics
        cols = ["daily_sharpe", "sharpe_adj", "sharpe", "total_return", "max_drawdown", "n_trades", "win_rate",
                "profit_factor", "avg_hold", "exposure"]
        frame = pd.DataFrame(rows).set_index(["checkpoint", "split"]).reindex(columns=cols)
        print(frame.apply(lambda col: col.map(lambda v: metric_cell(col.name, v))).to_string())
        summary = run.read_summary() if (run.path / "summary.json").exists() else {"folds": []}
        for f in summary["folds"]:
            print(f"fold {f['fold']}: best by validation {f['best_checkpoint']} (the run's choice; picking by "
                  "the test rows above would be selection on the test window)")
        for line in held_flat_lines(summary, rows):
            print(line)
        return
    frame = pd.DataFrame(rows).drop(columns=["nan_reasons", "checkpoint", "epoch"], errors="ignore")
    frame = frame.set_index(["fold", "split"]).T
    print(frame.apply(lambda row: row.map(lambda v: metric_cell(row.name, v)), axis=1).to_string())
    reasons = [f"  {metric} (fold {r['fold']} {r['split']}): {why}"
               for r in rows for metric, why in (r.get("nan_reasons") or {}).items()]
    if reasons:
        print("n/a:\n" + "\n".join(reasons))
    for line in held_flat_lines(run.read_summary() if (run.path / "summary.json").exists() else {}, rows):
        print(line)


def held_flat_lines(summary: dict, rows: list[dict]) -> list[str]:
    """numbarl-backtest's rows score the policy; where the run (its summary) held a fold's test window flat (the
    deployment rule) one line says so for each such fold it scored on its test window."""
    lines = []
    for f in (summary.get("folds") if isinstance(summary, dict) else None) or []:
        if not isinstance(f, dict) or not held_flat(f):
            continue
        scored = [r for r in rows if r["fold"] == f.get("fold") and r["split"] == "test"]
        if scored:
            same = any(r["checkpoint"] == f.get("best_checkpoint") for r in scored)
            lines.append(f"fold {f['fold']}: the run held this test window flat ({f.get('deploy_rule')} not met: "
                         "train.deploy_min_trade_t); the test rows above score its policy"
                         + (" (the best checkpoint's are the summary's test_policy)" if same else ""))
    return lines
