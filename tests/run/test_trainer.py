"""numbarl-train end to end under the simulator: a tiny run leaves a complete run folder, a killed
and resumed run ends exactly like an uninterrupted one, a non-finite loss stops the run with a
message naming the step and tensor, and bad input gives one clear error and writes nothing."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from numbarl import config
from numbarl.cli import backtest_cmd, train_cmd
from numbarl.run import trainer
from numbarl.run.runio import RunDir

# the tiny preset, made smaller still so three runs fit in the test budget
FAST = ["--preset", "tiny", "--quiet", "--set", "data.synth_bars_per_day=30", "--set", "train.collect_steps_per_epoch=4",
        "--set", "train.log_interval=2", "--set", "train.learning_starts=3"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("numbarl-cache")


def _invoke(*args):
    return CliRunner().invoke(train_cmd, list(args), catch_exceptions=True)


@pytest.fixture
def run_cli(cache_dir, monkeypatch):
    monkeypatch.setenv("NUMBARL_CACHE", str(cache_dir))
    return _invoke


def _uninterrupted(cache_dir, folder: Path, args) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NUMBARL_CACHE", str(cache_dir))
        r = _invoke(*args, "--out", str(folder / "run"))
    assert r.exit_code == 0, r.output + repr(r.exception)
    return folder / "run"


@pytest.fixture(scope="module")
def full_run(cache_dir, tmp_path_factory):
    """One uninterrupted tiny run, shared by the run-folder and the resume tests."""
    return _uninterrupted(cache_dir, tmp_path_factory.mktemp("full"), FAST)


TIMING = ("env_steps_per_s", "time", "elapsed_s")  # wall-clock columns: differ between any two runs


def _final_params(path):
    arrays, state = RunDir.open(path).load_checkpoint("latest")
    return {k: v for k, v in arrays.items() if k.startswith(("params/", "adam_m/", "target/", "env/", "replay/"))}, state


def _metrics(path):
    summary = json.loads((path / "summary.json").read_text())
    return [(f["fold"], f["val"], f["test"], f["val_sharpe_per_epoch"]) for f in summary["folds"]]


def test_tiny_run_leaves_complete_run_folder(full_run):
    out = full_run
    for name in ("config.json", "run.json", "metrics.jsonl", "metrics.csv", "summary.json", "report.html", "report.png",
                 "trades_val.csv", "trades_test.csv", "checkpoints/latest.json", "checkpoints/best.json"):
        assert (out / name).is_file(), name
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kinds = [rec["kind"] for rec in records]
    assert kinds.count("val") == 2 and kinds.count("test") == 1 and "train" in kinds
    train = [rec for rec in records if rec["kind"] == "train"]
    assert all(np.isfinite(rec["loss"]) for rec in train if rec["train_step"] > 0)
    summary = json.loads((out / "summary.json").read_text())
    fold = summary["folds"][0]
    assert fold["best_checkpoint"].startswith("fold0-epoch")
    assert "sharpe" in fold["test"] and "oracle_test" in fold
    if fold["val"]["sharpe"] is not None and fold["test"]["sharpe"] is not None:  # the per-fold val/test gap
        assert fold["val_test_gap"]["sharpe"] == pytest.approx(fold["val"]["sharpe"] - fold["test"]["sharpe"])
    # model selection (select_window 1): the epoch with the highest validation Sharpe
    val = [x if x is not None else -np.inf for x in fold["val_sharpe_per_epoch"]]
    assert fold["best_checkpoint"] == f"fold0-epoch{int(np.argmax(val)) + 1:04d}"
    assert fold["oracle_test"]["sharpe"] > 0  # the planted signal, traded at full size, makes money
    # the exploration schedule: epsilon = max(end, start - (start - end) t / decay) at collect step t
    cfg = json.loads((out / "config.json").read_text())["train"]
    for rec in train:
        t = rec["collect_step"] - 1
        want = cfg["epsilon_start"] + (cfg["epsilon_end"] - cfg["epsilon_start"]) * min(t / cfg["epsilon_decay_steps"], 1.0)
        assert rec["epsilon"] == pytest.approx(want, rel=1e-6), rec
    assert summary["numbarl_version"] and summary["device"]
    # the time budget: where the run's wall time went, measured, every entry accounted for
    budget = summary["time_budget_s"]
    parts = ("data", "compile", "steps", "validation", "test", "checkpoint", "report", "other")
    assert set(budget) == set(parts) | {"total"} and all(budget[k] >= 0 for k in budget)
    assert budget["compile"] > 0 and budget["validation"] > 0 and budget["test"] > 0 and budget["report"] > 0
    assert sum(budget[k] for k in parts) == pytest.approx(budget["total"], abs=0.01)
    assert "time: data" in (out / "train.log").read_text()
    # the execution assumption is stated with the results: summary, report, train log
    from numbarl.env.params import EnvParams

    fill = EnvParams(**{k: tuple(v) if isinstance(v, list) else v
                        for k, v in json.loads((out / "config.json").read_text())["env"].items()}).fill_assumption()
    assert summary["fill_assumption"] == fill and "zero latency" in fill
    import html

    assert f"Execution: {html.escape(fill)}" in (out / "report.html").read_text()
    assert f"execution: {fill}" in (out / "train.log").read_text()
    # the windows are chronological and disjoint: nothing of validation/test inside training
    w = fold["window"]
    assert w["train"][1] <= w["val"][0] and w["val"][1] <= w["test"][0]
    # the report shows the run's own numbers (a summary with undefined metrics included)
    page = (out / "report.html").read_text()
    assert "No summary yet" not in page and "Sharpe (ann.)" in page and "complete" in page
    assert "Trades" in page and "daily_sharpe n/a (fewer than 2 sessions)" in page
    # the replay buffer is kept with the latest checkpoint only
    resume_files = sorted(p.name for p in (out / "checkpoints").glob("*.resume.npz"))
    assert len(resume_files) == 1 and resume_files[0].startswith("fold0-epoch0002.")


def test_fold_benchmarks_write_what_the_fold_end_wrote(full_run, cache_dir, monkeypatch, tmp_path):
    """The oracle and buy-and-hold of a fold run beside its training (numbarl/run/fold_benchmarks.py;
    under the simulator: after the first validation, in the run's thread) and on the run's device
    market: the run's files are byte for byte those of the fold's-end backtests of the host
    MarketData (the path before), recomputed here and written by the same writer."""
    from numbarl import config as config_mod
    from numbarl.env.backtest import backtest
    from numbarl.env.market import MarketData
    from numbarl.run.fold_benchmarks import hold_actions, oracle_actions
    from numbarl.run.runio import to_jsonable

    monkeypatch.setenv("NUMBARL_CACHE", str(cache_dir))
    cfg = config_mod.from_dict(RunDir.open(full_run).config)
    cache = trainer.prepare_data(cfg.data, log=lambda m: None)
    fold = trainer.make_folds(cache, cfg.train)[0]
    host = MarketData.from_cache(cache)
    before = [(split, backtest(host, fold.test, cfg.env, actions=acts))
              for split, acts in (("oracle_test", oracle_actions(cache, fold.test, cfg.env)),
                                  ("hold_test", hold_actions(fold.test, cfg.env)))]
    fresh = RunDir.create(tmp_path / "before", {})
    trainer.write_fold_results(fresh, cache, fold.index, before, cfg.env.resolved_tick_size(cache.tick_size))
    for split, result in before:
        for name in (f"trades_{split}.csv", f"equity/{split}_fold0.csv", f"equity/{split}_fold0.npz"):
            assert (full_run / name).read_bytes() == (fresh.path / name).read_bytes(), name
        summary = json.loads((full_run / "summary.json").read_text())
        assert summary["folds"][0][split] == to_jsonable(trainer.metrics_dict(result.metrics()))
    # the time budget shows them: their own seconds, the run's wait, a part of `other`
    bench = summary["fold_benchmarks"]
    assert bench["folds"] == 1 and bench["overlapped"] == 0 and bench["job_s"] > 0  # simulator: not overlapped
    assert bench["waited_s"] >= bench["job_s"] - 0.05 and summary["time_other_s"]["benchmarks"] >= bench["waited_s"] - 0.05
    assert sum(summary["time_other_s"].values()) == pytest.approx(summary["time_budget_s"]["other"], abs=0.01)


def test_run_folder_a_user_can_read(full_run):
    """Issue 12's glitches: the run's log file with timestamped progress over every phase, a wall-clock
    column, checkpoints with their step, integer columns as integers, trade prices without float
    noise, equity curves as CSV, and the same average hold in every table."""
    import pandas as pd

    log = (full_run / "train.log").read_text().splitlines()
    assert log and all(line[:4].isdigit() and line[10] == "T" for line in log)
    text = "\n".join(log)
    for phase in ("collect+train step", "validation backtest", "checkpoint fold0-epoch0001",
                  "test (out-of-sample) backtest", "report:"):
        assert phase in text, phase
    assert "ETA" in text and "%" in text
    records = RunDir.open(full_run).read_metrics()
    elapsed = [rec["elapsed_s"] for rec in records]
    assert all(isinstance(rec["time"], str) for rec in records) and elapsed == sorted(elapsed) and elapsed[-1] > 0
    latest = json.loads((full_run / "checkpoints" / "latest.json").read_text())
    assert isinstance(latest["step"], int) and latest["step"] > 0
    assert all(isinstance(c["step"], int) for c in RunDir.open(full_run).list_checkpoints())
    # integer columns stay integers where some records lack them (were 3.0 in the CSV)
    csv_lines = (full_run / "metrics.csv").read_text().splitlines()
    header = csv_lines[0].split(",")
    val_row = next(line.split(",") for line in csv_lines[1:] if line.startswith("val,"))
    for column in ("step", "n_trades", "fold", "epoch"):
        assert "." not in val_row[header.index(column)], (column, val_row[header.index(column)])
    summary = json.loads((full_run / "summary.json").read_text())
    assert isinstance(summary["folds"][0]["test"]["n_trades"], int)
    for split in ("val", "test"):
        trades = pd.read_csv(full_run / f"trades_{split}.csv")
        raw = (full_run / f"trades_{split}.csv").read_text()
        assert "0000000" not in raw and "9999999" not in raw, raw  # no float noise in prices
        table = pd.read_csv(full_run / "equity" / f"{split}_fold0.csv")
        saved = RunDir.open(full_run).read_equity(split)[(split, 0)]
        assert np.allclose(table["equity"], saved["equity"]) and "time_utc" in table.columns
        if len(trades):  # avg hold: the metric and the report's trade table agree
            from numbarl.run.report import trade_stats

            assert trade_stats(trades)["avg_hold"] == pytest.approx(summary["folds"][0][split]["avg_hold"])


def test_backtest_rescores_the_saved_agent_like_the_run(full_run, cache_dir, monkeypatch):
    """numbarl-backtest on the best checkpoint reproduces the run's own out-of-sample metrics."""
    monkeypatch.setenv("NUMBARL_CACHE", str(cache_dir))
    r = CliRunner().invoke(backtest_cmd, [str(full_run), "--split", "all", "--json"], catch_exceptions=True)
    assert r.exit_code == 0, r.output + repr(r.exception)
    rows = json.loads(r.output[r.output.index("{"):])["results"]
    summary = json.loads((full_run / "summary.json").read_text())["folds"][0]
    got = {row["split"]: row for row in rows}
    for split in ("val", "test"):
        for metric, value in summary[split].items():
            assert got[split][metric] == value, (split, metric)
    r = CliRunner().invoke(backtest_cmd, [str(full_run), "--split", "test"], catch_exceptions=True)
    assert r.exit_code == 0 and "sharpe" in r.output and "None" not in r.output, r.output
    r = CliRunner().invoke(backtest_cmd, [str(full_run.parent)], catch_exceptions=True)
    assert r.exit_code == 2 and "not a numbarl run folder" in r.output


def test_backtest_every_checkpoint(full_run, cache_dir, monkeypatch):
    """--checkpoint all scores each saved epoch; the best one's validation row equals the run's."""
    monkeypatch.setenv("NUMBARL_CACHE", str(cache_dir))
    r = CliRunner().invoke(backtest_cmd, [str(full_run), "--checkpoint", "all", "--split", "all", "--json"],
                           catch_exceptions=True)
    assert r.exit_code == 0, r.output + repr(r.exception)
    rows = json.loads(r.output[r.output.index("{"):])["results"]
    summary = json.loads((full_run / "summary.json").read_text())["folds"][0]
    tags = sorted({row["checkpoint"] for row in rows})
    assert tags == ["fold0-epoch0001", "fold0-epoch0002"] and len(rows) == 4
    val = {row["epoch"]: row["sharpe"] for row in rows if row["split"] == "val"}
    assert [val[1], val[2]] == [x if x == x else None for x in summary["val_sharpe_per_epoch"]]
    best = [row for row in rows if row["checkpoint"] == summary["best_checkpoint"] and row["split"] == "test"]
    assert best[0]["sharpe"] == summary["test"]["sharpe"]
    r = CliRunner().invoke(backtest_cmd, [str(full_run), "--checkpoint", "all"], catch_exceptions=True)
    assert r.exit_code == 0 and "fold0-epoch0002" in r.output and "best by validation" in r.output, r.output


def test_resume_equals_uninterrupted(run_cli, full_run, tmp_path, monkeypatch):
    full, killed = full_run, tmp_path / "killed"
    original = trainer.FoldTrainer.collect_once

    def dying(self):  # the process dies in the middle of epoch 2, after the epoch-1 checkpoint
        if self.epoch == 1 and self.collect_steps == 6:
            raise KeyboardInterrupt("killed")
        original(self)

    monkeypatch.setattr(trainer.FoldTrainer, "collect_once", dying)
    r = run_cli(*FAST, "--out", str(killed))
    # Ctrl-C: exit 130 (not click's "Aborted!" and 1) and the command that continues the run
    assert r.exit_code == 130, r.output + repr(r.exception)
    assert f"continue with `numbarl-train --resume {killed}`" in r.output and "Aborted!" not in r.output
    assert "interrupted (Ctrl-C)" in (killed / "train.log").read_text()
    assert not (killed / "summary.json").exists()
    monkeypatch.setattr(trainer.FoldTrainer, "collect_once", original)
    r = run_cli("--resume", str(killed), "--quiet")
    assert r.exit_code == 0, r.output + repr(r.exception)

    a, state_a = _final_params(full)
    b, state_b = _final_params(killed)
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k], equal_nan=True), k
    assert state_a["collect_steps"] == state_b["collect_steps"]
    assert _metrics(full) == _metrics(killed)
    strip = lambda recs: [{k: v for k, v in rec.items() if k not in TIMING} for rec in recs]  # noqa: E731
    assert strip(RunDir.open(full).read_metrics()) == strip(RunDir.open(killed).read_metrics())


def test_resume_without_the_replay_buffer_is_one_clear_error(run_cli, full_run, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(full_run, copy)
    for p in (copy / "checkpoints").glob("*.resume.npz"):
        p.unlink()
    before = sorted(p.name for p in copy.rglob("*"))
    r = run_cli("--resume", str(copy), "--quiet")
    assert r.exit_code == 2 and "replay buffer" in r.output and "missing" in r.output, r.output
    assert sorted(p.name for p in copy.rglob("*")) == before


@pytest.mark.parametrize("role", ["params", "target"])
def test_nonfinite_loss_stops_run_and_keeps_last_good_checkpoint(run_cli, tmp_path, monkeypatch, role):
    """A NaN weight of the online or of the target network: the run stops at the next log
    interval naming the step and the tensor; the last good checkpoint is kept."""
    out = tmp_path / "nan"
    original = trainer.FoldTrainer.save

    def save_then_poison(self):  # after the epoch-1 checkpoint a weight turns NaN
        tag = original(self)
        name = "trunk.fc0.w"
        value = self.agent.store.to_host(role)[name]
        value[0, 0] = np.nan
        self.agent.store.load({name: value}, role=role)
        return tag

    monkeypatch.setattr(trainer.FoldTrainer, "save", save_then_poison)
    r = run_cli(*FAST, "--out", str(out))
    assert r.exit_code == 3, r.output + repr(r.exception)
    assert "non-finite loss at train step" in r.output and f"{role}:trunk.fc0.w" in r.output
    arrays, state = RunDir.open(out).load_checkpoint("latest")
    assert state["epoch"] == 1
    assert all(np.all(np.isfinite(v)) for k, v in arrays.items() if k.startswith("params/"))


def test_the_backtest_agent_holds_the_temporal_and_multi_horizon_windows():
    """numbarl-backtest scores with a one-env agent whose replay must pass the agent's own checks: the longest
    n-step window (agent.horizons) plus one slot, or plus the temporal input's K rows (it used to be n_step + 1,
    which refused every temporal or longer-horizon run)."""
    from dataclasses import replace

    from numbarl.config import AgentConfig, ConfigError
    from numbarl.rl.agents.dqn import DQNAgent
    from numbarl.run.trainer import backtest_replay_capacity

    mh = {"horizons": "1,3,5", "horizon_regime_col": "0"}  # a 6-column observation: the blend reads column 0
    for kw, want in (({}, 4), (mh, 6), ({"temporal": "mamba", "temporal_steps": 4}, 7),
                     ({**mh, "temporal": "mamba", "temporal_steps": 4, "temporal_heads": 2}, 9)):
        cfg = AgentConfig(trunk=(8,), n_atoms=5, n_step=3, batch_size=1, **kw)
        cap = backtest_replay_capacity(cfg)
        assert cap == want, (kw, cap)
        if kw:
            DQNAgent(replace(cfg, replay_capacity=cap), 6, (3, 3, 4, 4), 1, seed=0, eval_batch=1)
            with pytest.raises((ConfigError, ValueError), match="replay|window"):
                DQNAgent(replace(cfg, replay_capacity=cap - 1), 6, (3, 3, 4, 4), 1, seed=0, eval_batch=1)


def test_the_deployment_rule_holds_a_weak_fold_flat_and_keeps_the_policys_test(run_cli, full_run, tmp_path,
                                                                               monkeypatch):
    """train.deploy_min_trade_t above the validation window's trade t: the run trains as without the rule (the
    same validation), the fold's test is the window held flat (no trades, zero P&L, in the summary, the trade list
    and the pooled headline), the policy's own test is the uninterrupted run's, kept as test_policy, and the
    summary, the log and numbarl ab say why. A bar of 0 (the default) is off: no deployment keys at all."""
    from numbarl.run import ab
    from numbarl.run.compare import trade_t

    base = json.loads((full_run / "summary.json").read_text())["folds"][0]
    assert "deployed" not in base and "test_policy" not in base and base["test"]["n_trades"] > 0
    out = tmp_path / "deploy"
    r = run_cli(*FAST, "--set", "train.deploy_min_trade_t=1000", "--out", str(out))
    assert r.exit_code == 0, r.output + repr(r.exception)
    summary = json.loads((out / "summary.json").read_text())
    fold = summary["folds"][0]
    assert fold["deployed"] is False and fold["deploy_rule"] == "validation trade t >= 1000"
    assert fold["val"] == base["val"] and fold["val_trade_t"] == trade_t(base["val"])
    assert fold["test_policy"] == base["test"] and fold["val_test_gap"] == base["val_test_gap"]
    fold_policy = fold["test_policy"]
    assert fold["test"]["n_trades"] == 0 and fold["test"]["total_return"] == 0.0
    assert summary["headline"]["total_return"] == 0.0
    trades = out / "trades_test.csv"
    assert not trades.exists() or len(trades.read_text().strip().splitlines()) <= 1  # a header at most
    assert "not deployed: validation trade t" in (out / "train.log").read_text()
    kinds = [json.loads(line)["kind"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert kinds.count("test_policy") == 1 and kinds.count("test") == 1
    run = ab.run_numbers(out)
    assert run["t"] == 0.0 and run["trade_t"] == 0.0 and run["test_over_oracle"] == 0.0 and run["held_flat"] is True
    # numbarl-backtest re-scores the policy, and says that the run itself held that test window flat
    r = CliRunner().invoke(backtest_cmd, [str(out), "--split", "test"], catch_exceptions=True)
    assert r.exit_code == 0 and "the run held this test window flat" in r.output, r.output
    assert "the best checkpoint's are the summary's test_policy" in r.output, r.output
    r = CliRunner().invoke(backtest_cmd, [str(out), "--split", "test", "--checkpoint", "all"], catch_exceptions=True)
    assert r.exit_code == 0 and "the run held this test window flat" in r.output, r.output
    # the report's notes say the test window was held flat instead of listing its flat metrics as n/a
    from numbarl.run.report import nan_notes

    notes = nan_notes(summary)
    assert any("held flat, no trades (validation trade t >= 1000 not met" in n for n in notes), notes
    assert not any("test (out-of-sample): sharpe n/a" in n for n in notes), notes
    # a bar the validation trades clear deploys as usual: the test is the policy's, and the summary says so
    t = trade_t(base["val"])
    assert t is not None and t > 0, base["val"]  # the tiny run's validation trades earn: a bar below them
    low = tmp_path / "low"
    r = run_cli(*FAST, "--set", f"train.deploy_min_trade_t={t / 2}", "--out", str(low))
    assert r.exit_code == 0, r.output + repr(r.exception)
    fold = json.loads((low / "summary.json").read_text())["folds"][0]
    assert fold["deployed"] is True and fold["test"] == base["test"] and "test_policy" not in fold
    # killed after the fold logged its test_policy and test records, before its summary: the resume drops both
    # records and decides again, and ends as the uninterrupted run (log and summary)
    killed, fired, write = tmp_path / "killed", [], RunDir.write_summary

    def kill_once(run, summary):
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt("summary")
        return write(run, summary)

    monkeypatch.setattr(RunDir, "write_summary", kill_once)
    r = run_cli(*FAST, "--set", "train.deploy_min_trade_t=1000", "--out", str(killed))
    assert r.exit_code != 0 and fired, r.output
    assert "test_policy" in (killed / "metrics.jsonl").read_text()
    r = run_cli("--resume", str(killed), "--quiet")
    assert r.exit_code == 0, r.output + repr(r.exception)
    strip = lambda recs: [{k: v for k, v in rec.items() if k not in TIMING} for rec in recs]  # noqa: E731
    assert strip(RunDir.open(killed).read_metrics()) == strip(RunDir.open(out).read_metrics())
    assert _metrics(killed) == _metrics(out)
    assert json.loads((killed / "summary.json").read_text())["folds"][0]["test_policy"] == fold_policy


def _preset_sets(name: str, base: str = "default") -> list[str]:
    """--set arguments for every field where preset `name` differs from preset `base` (the preset's switches)."""
    from numbarl import config as config_mod

    sets, a, b = [], config_mod.preset(name).to_dict(), config_mod.preset(base).to_dict()
    for section, fields in a.items():
        if not isinstance(fields, dict):
            continue
        for key, value in fields.items():
            if value != b[section][key]:
                text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
                sets += ["--set", f"{section}.{key}={text}"]
    return sets


def test_the_temporal_preset_trains_end_to_end_on_the_simulator(run_cli, tmp_path):
    """The "temporal" preset's switches (every field where it differs from "default": the scan, the flow feature,
    the future-feature regression, early stopping) and the deployment rule it shares with "default" (since the
    twenty-fifth session) on the tiny preset's sizes, on the regime-walk market: the run finishes, its config holds
    every one of them, and the scan's and the regression's liveness keys are non-zero in training. (Two tiny epochs
    cannot reach early stopping's patience of 2; its stopping is tests/run/test_trainer.py's early-stop test.)"""
    sets = _preset_sets("temporal")
    assert {"agent.temporal=mamba", "agent.future_targets=trade_imb_prev*ret_1", "train.early_stop_patience=2"} <= set(
        sets[1::2]), sets
    assert config.preset("temporal").train.deploy_min_trade_t == config.preset("default").train.deploy_min_trade_t == 2
    sets += ["--set", "train.deploy_min_trade_t=2.0"]
    out = tmp_path / "temporal"
    r = run_cli(*FAST, *sets, "--set", "data.synth_mode=regime_walk", "--out", str(out))
    assert r.exit_code == 0, r.output + repr(r.exception)
    cfg = json.loads((out / "config.json").read_text())
    for kv in sets[1::2]:
        (section, field), value = kv.split("=", 1)[0].split("."), kv.split("=", 1)[1]
        assert str(cfg[section][field]) == value, (kv, cfg[section][field])
    assert "deployed" in json.loads((out / "summary.json").read_text())["folds"][0]  # the rule decided
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [rec for rec in records if rec.get("kind") == "train"]
    assert max(rec["future_loss"] for rec in train) > 0
    assert max(rec["grad_norm.temporal.mamba"] for rec in train) > 0
    assert any(rec.get("kind") == "test" for rec in records)


def _schema_file(tmp_path):
    import databento_dbn as dbn

    meta = dbn.Metadata("GLBX.MDP3", 0, dbn.SType.RAW_SYMBOL, dbn.SType.INSTRUMENT_ID, dbn.Schema.MBP_1,
                        symbols=["X"], end=1)
    path = tmp_path / "mbp1.dbn"
    path.write_bytes(bytes(meta))
    return path


@pytest.mark.parametrize("case", ["missing", "schema", "config", "sessions", "resume", "columns", "future"])
def test_bad_input_one_clear_error_nothing_written(run_cli, tmp_path, case):
    out = tmp_path / "run"
    args = {
        "missing": (["--data", str(tmp_path / "nowhere.dbn")], "no such file or folder"),
        "schema": (["--data", str(_schema_file(tmp_path))], "mbp-1"),
        "config": (["--set", "agent.lr=-1"], "agent.lr = -1.0 is out of range"),
        "sessions": (["--set", "train.train_sessions=50"], "needs 52 sessions; the data has 6"),
        "resume": (None, "not a numbarl run"),
        # the regime gate's default columns name rv_ratio, which this feature list lacks: refused before the
        # run folder is written (numbarl/rl/obs_columns.py check_agent_columns)
        "columns": (["--set", "data.features=rv_8,rv_32,adx_14,rv_128", "--set", "agent.regime_gate=true"],
                    "'rv_ratio' is not a column of the observation"),
        # a future-feature term naming a known feature this observation lacks: the same, before the folder
        "future": (["--set", "agent.future_weight=0.1", "--set", "agent.future_targets=trade_imb_prev*ret_1"],
                   "agent.future_targets = 'trade_imb_prev*ret_1': 'trade_imb_prev' is not a column"),
    }[case]
    if case == "resume":
        (tmp_path / "notarun").mkdir()
        (tmp_path / "notarun" / "x.txt").write_text("x")
        r = run_cli("--resume", str(tmp_path / "notarun"), "--quiet")
    else:
        r = run_cli(*FAST, *args[0], "--out", str(out))
    assert r.exit_code == 2, r.output + repr(r.exception)
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and args[1] in errors[0], r.output
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# two folds: per-fold best checkpoints, and resumes after kills at the awkward moments
# ---------------------------------------------------------------------------------------------
TWO_FOLDS = [*FAST, "--set", "data.synth_sessions=7", "--folds", "2"]


@pytest.fixture(scope="module")
def two_fold_run(cache_dir, tmp_path_factory):
    return _uninterrupted(cache_dir, tmp_path_factory.mktemp("two"), TWO_FOLDS)


def _backtest_json(*args):
    r = CliRunner().invoke(backtest_cmd, [str(a) for a in args] + ["--json"], catch_exceptions=True)
    assert r.exit_code == 0, r.output + repr(r.exception)
    return json.loads(r.output[r.output.index("{"):])["results"]


def test_backtest_scores_each_fold_with_its_own_best_checkpoint(two_fold_run, cache_dir, monkeypatch):
    """A later fold's agent trained on an earlier fold's validation/test bars: each fold is scored
    with its own checkpoint only, and the numbers are the run's own."""
    monkeypatch.setenv("NUMBARL_CACHE", str(cache_dir))
    summary = json.loads((two_fold_run / "summary.json").read_text())["folds"]
    rows = _backtest_json(two_fold_run, "--split", "all")
    assert len(rows) == 4
    for row in rows:
        fold = summary[row["fold"]]
        assert row["checkpoint"] == fold["best_checkpoint"] and row["checkpoint"].startswith(f"fold{row['fold']}-")
        for metric, value in fold[row["split"]].items():
            assert row[metric] == value, (row["fold"], row["split"], metric)
    latest = _backtest_json(two_fold_run, "--checkpoint", "latest", "--split", "all")
    assert {(r["fold"], r["checkpoint"]) for r in latest} == {(1, "fold1-epoch0002")}
    for args, message in (((two_fold_run, "--checkpoint", "fold0-epoch0001", "--fold", "1"), "belongs to fold 0"),
                          ((two_fold_run, "--checkpoint", "../x"), "is not valid"),
                          ((two_fold_run, "--checkpoint", "fold7-epoch0001"), "not found")):
        r = CliRunner().invoke(backtest_cmd, [str(a) for a in args], catch_exceptions=True)
        assert r.exit_code == 2 and message in r.output, r.output + repr(r.exception)


def test_backtest_refuses_a_cache_with_other_features(two_fold_run, cache_dir, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setenv("NUMBARL_CACHE", str(cache_dir))
    copy = tmp_path / "copy"
    shutil.copytree(two_fold_run, copy)
    meta = json.loads((copy / "run.json").read_text())
    names = meta["feature_names"]
    names[0], names[1] = names[1], names[0]  # same width, other order: scoring would be silently wrong
    (copy / "run.json").write_text(json.dumps(meta))
    r = CliRunner().invoke(backtest_cmd, [str(copy)], catch_exceptions=True)
    assert r.exit_code == 2 and "features differ" in r.output and "column 0" in r.output, r.output


def test_resume_after_kills_at_every_awkward_moment(run_cli, two_fold_run, tmp_path, monkeypatch):
    """Killed (1) after fold 0's test record, before its summary; (2) in fold 1 before its first
    checkpoint; (3) between fold 1's last checkpoint and its best pointer. Each resume picks up;
    the end is the uninterrupted run: summary, metrics log, best pointer, weights, trades."""
    out = tmp_path / "killed"
    fired = []

    def once(name, condition, original):
        def hook(*args, **kwargs):
            if name not in fired and condition(*args, **kwargs):
                fired.append(name)
                raise KeyboardInterrupt(name)
            return original(*args, **kwargs)
        return hook

    monkeypatch.setattr(RunDir, "write_summary", once("summary", lambda run, s: True, RunDir.write_summary))
    monkeypatch.setattr(trainer.FoldTrainer, "collect_once", once(
        "fold1", lambda ft: ft.fold.index == 1 and ft.collect_steps == 2, trainer.FoldTrainer.collect_once))
    monkeypatch.setattr(RunDir, "mark_best", once(
        "best", lambda run, tag, *a, **k: run.latest_checkpoint()["tag"] == "fold1-epoch0002", RunDir.mark_best))
    r = run_cli(*TWO_FOLDS, "--out", str(out))
    for expected in (["summary"], ["summary", "fold1"], ["summary", "fold1", "best"]):
        assert r.exit_code != 0 and fired == expected, r.output + repr(r.exception)
        r = run_cli("--resume", str(out), "--quiet")
    assert r.exit_code == 0, r.output + repr(r.exception)

    assert _metrics(two_fold_run) == _metrics(out)
    strip = lambda recs: [{k: v for k, v in rec.items() if k not in TIMING} for rec in recs]  # noqa: E731
    assert strip(RunDir.open(two_fold_run).read_metrics()) == strip(RunDir.open(out).read_metrics())
    assert RunDir.open(out).best_checkpoint()["tag"] == RunDir.open(two_fold_run).best_checkpoint()["tag"]
    a, _ = _final_params(two_fold_run)
    b, _ = _final_params(out)
    assert all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)
    for name in ("trades_val.csv", "trades_test.csv"):
        assert (out / name).read_text() == (two_fold_run / name).read_text(), name


def test_resume_refuses_other_settings(run_cli, full_run):
    before = (full_run / "metrics.jsonl").read_bytes()
    r = run_cli("--resume", str(full_run), "--epochs", "5", "--set", "agent.lr=0.5")
    assert r.exit_code == 2 and "--set, --epochs cannot be combined" in r.output, r.output
    assert (full_run / "metrics.jsonl").read_bytes() == before


def test_lock_aware_target_is_wired_into_training(run_cli, full_run, tmp_path):
    """agent.lock_aware_target: the double-DQN argmax reads the env's mask of each sampled
    next_obs (stored by the replay with the observation: the learner does not re-derive the lock)
    and it changes the learning (same seed, same data as the default run otherwise)."""
    from numbarl.rl.losses.c51 import C51Loss

    built, masks = [], []
    original = trainer.FoldTrainer.__init__
    original_loss = C51Loss.__call__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append((self.agent.replay.max_actions, self.cfg.env.max_actions))

    def loss_spy(self, *args, next_mask=None, **kwargs):
        masks.append(next_mask)
        return original_loss(self, *args, next_mask=next_mask, **kwargs)

    out = tmp_path / "lock"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer.FoldTrainer, "__init__", record)
        mp.setattr(C51Loss, "__call__", loss_spy)
        r = run_cli(*FAST, "--set", "agent.lock_aware_target=true", "--out", str(out))
    assert built and all(stored == width for stored, width in built)  # the replay keeps the env's masks
    assert masks and all(m is not None and m.shape[1:] == (4, built[0][1]) for m in masks)
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert json.loads((out / "config.json").read_text())["agent"]["lock_aware_target"] is True
    a, _ = _final_params(full_run)
    b, _ = _final_params(out)
    assert any(not np.array_equal(a[k], b[k]) for k in a if k.startswith("params/"))


def test_model_selection_keeps_the_best_validation_epoch(run_cli, tmp_path, monkeypatch):
    """Scripted validation scores 1, 3, 2 over three epochs: epoch 2 is the run's choice (summary,
    best.json), and its checkpoint is what the test window was scored with."""
    scores = iter([1.0, 3.0, 2.0])
    original = trainer.FoldTrainer.validate

    def scripted(self):
        result, m, _ = original(self)
        return result, m, next(scores)

    monkeypatch.setattr(trainer.FoldTrainer, "validate", scripted)
    out = tmp_path / "sel"
    r = run_cli(*FAST, "--epochs", "3", "--out", str(out))
    assert r.exit_code == 0, r.output + repr(r.exception)
    fold = json.loads((out / "summary.json").read_text())["folds"][0]
    assert fold["best_checkpoint"] == "fold0-epoch0002"
    assert RunDir.open(out).best_checkpoint()["tag"] == "fold0-epoch0002"


FEEDBACK = ["--set", "train.e1_q_reality=0.5", "--set", "train.e2_adaptive_epsilon=true", "--set", "train.e3_dynamic_gamma=true",
            "--set", "train.e4_trade_autopsy=true", "--set", "train.e6_winner_boost=1", "--set", "train.e7_margin_weight=0.1",
            "--set", "train.e8_curriculum_kappa=1", "--set", "train.e9_tradability_gate=true", "--set", "train.e9_min_trades=1",
            "--set", "agent.support=fit", "--set", "agent.freeze_reset=true", "--set", "agent.freeze_epochs=1",
            "--set", "agent.freeze_eps=1e6", "--set", "agent.freeze_grad_min=0", "--epochs", "3"]


def test_resume_with_the_feedback_loop_equals_uninterrupted(run_cli, cache_dir, tmp_path, monkeypatch):
    """Every feedback switch, the support fit and the freeze detector on: a run killed in epoch 3
    and resumed ends with the uninterrupted run's weights, replay, metrics log and summary (the
    loop's state, E6/E7/E8 device state, the gate and the detector are in the checkpoints)."""
    args = [*FAST, *FEEDBACK]
    full = _uninterrupted(cache_dir, tmp_path / "full", args)
    killed = tmp_path / "killed"
    original = trainer.FoldTrainer.collect_once

    def dying(self):
        if self.epoch == 2 and self.collect_steps == 10:
            raise KeyboardInterrupt("killed")
        original(self)

    monkeypatch.setattr(trainer.FoldTrainer, "collect_once", dying)
    r = run_cli(*args, "--out", str(killed))
    assert r.exit_code == 130, r.output + repr(r.exception)
    monkeypatch.setattr(trainer.FoldTrainer, "collect_once", original)
    r = run_cli("--resume", str(killed), "--quiet")
    assert r.exit_code == 0, r.output + repr(r.exception)
    a, state_a = _final_params(full)
    b, state_b = _final_params(killed)
    for k in a:
        assert np.array_equal(a[k], b[k], equal_nan=True), k
    assert state_a["feedback"] == state_b["feedback"] and state_a["freeze"] == state_b["freeze"]
    fa, _ = RunDir.open(full).load_checkpoint("latest", prefix="feedback/")
    fb, _ = RunDir.open(killed).load_checkpoint("latest", prefix="feedback/")
    assert fa.keys() == fb.keys() and any(k.startswith("feedback/hindsight/") for k in fa)
    for k in fa:
        assert np.array_equal(fa[k], fb[k]), k
    assert _metrics(full) == _metrics(killed)
    strip = lambda recs: [{k: v for k, v in rec.items() if k not in TIMING} for rec in recs]  # noqa: E731
    assert strip(RunDir.open(full).read_metrics()) == strip(RunDir.open(killed).read_metrics())
    assert any(rec["kind"] == "feedback" for rec in RunDir.open(full).read_metrics())


def test_early_stop_ends_the_fold_and_scores_the_best_epoch(run_cli, tmp_path, monkeypatch):
    """Scripted validation scores 1, 3, 2, 2.5, 9 over five epochs with train.early_stop_patience = 2: epochs 3
    and 4 do not beat epoch 2, so the fold stops after epoch 4 (epoch 5's 9 is never seen), the test window
    scores epoch 2's checkpoint, and the summary says where it stopped. Patience 0 (the default) runs all five."""
    original = trainer.FoldTrainer.validate

    def scripted(values):
        scores = iter(values)

        def validate(self):
            result, m, _ = original(self)
            return result, m, next(scores)
        return validate

    monkeypatch.setattr(trainer.FoldTrainer, "validate", scripted([1.0, 3.0, 2.0, 2.5, 9.0]))
    out = tmp_path / "stop"
    r = run_cli(*FAST, "--epochs", "5", "--set", "train.early_stop_patience=2", "--out", str(out))
    assert r.exit_code == 0, r.output + repr(r.exception)
    fold = json.loads((out / "summary.json").read_text())["folds"][0]
    assert fold["best_checkpoint"] == "fold0-epoch0002" and fold["early_stop_after_epoch"] == 4
    assert len(fold["val_sharpe_per_epoch"]) == 4
    assert "early stop after epoch 4 of 5" in (out / "train.log").read_text()
    monkeypatch.setattr(trainer.FoldTrainer, "validate", scripted([1.0, 3.0, 2.0, 2.5, 9.0]))
    full = tmp_path / "full"
    r = run_cli(*FAST, "--epochs", "5", "--out", str(full))
    assert r.exit_code == 0, r.output + repr(r.exception)
    fold = json.loads((full / "summary.json").read_text())["folds"][0]
    assert fold["best_checkpoint"] == "fold0-epoch0005" and "early_stop_after_epoch" not in fold
    # no defined score yet (select_window's first epochs, or no trades: -inf) counts as no best: patience 1
    # waits for epoch 3's 1.0, then stops after epoch 4's 0.5
    monkeypatch.setattr(trainer.FoldTrainer, "validate", scripted([-math.inf, -math.inf, 1.0, 0.5, 2.0]))
    late = tmp_path / "late"
    r = run_cli(*FAST, "--epochs", "5", "--set", "train.early_stop_patience=1", "--out", str(late))
    assert r.exit_code == 0, r.output + repr(r.exception)
    fold = json.loads((late / "summary.json").read_text())["folds"][0]
    assert fold["best_checkpoint"] == "fold0-epoch0003" and fold["early_stop_after_epoch"] == 4


def test_early_stop_after_a_resume_counts_from_the_restored_best(run_cli, tmp_path, monkeypatch):
    """Killed in epoch 4 and resumed from epoch 3's checkpoint, the run stops after epoch 4 as the uninterrupted
    one does: the best epoch (2) comes back with the checkpoint."""
    scores = iter([1.0, 3.0, 2.0, 2.5, 9.0])
    original_validate, original_collect = trainer.FoldTrainer.validate, trainer.FoldTrainer.collect_once

    def validate(self):
        result, m, _ = original_validate(self)
        return result, m, next(scores)

    def dying(self):
        if self.epoch == 3 and self.collect_steps == 14:
            raise KeyboardInterrupt("killed")
        original_collect(self)

    monkeypatch.setattr(trainer.FoldTrainer, "validate", validate)
    monkeypatch.setattr(trainer.FoldTrainer, "collect_once", dying)
    out = tmp_path / "killed"
    r = run_cli(*FAST, "--epochs", "5", "--set", "train.early_stop_patience=2", "--out", str(out))
    assert r.exit_code == 130, r.output + repr(r.exception)
    monkeypatch.setattr(trainer.FoldTrainer, "collect_once", original_collect)
    r = run_cli("--resume", str(out), "--quiet")
    assert r.exit_code == 0, r.output + repr(r.exception)
    fold = json.loads((out / "summary.json").read_text())["folds"][0]
    assert fold["best_checkpoint"] == "fold0-epoch0002" and fold["early_stop_after_epoch"] == 4
    assert next(scores) == 9.0  # epoch 5 was never validated
