"""numbarl-train end to end under the simulator: a tiny run leaves a complete run folder, a killed
and resumed run ends exactly like an uninterrupted one, a non-finite loss stops the run with a
message naming the step and tensor, and bad input gives one clear error and writes nothing."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from numbarl.cli import backtest_cmd, train_cmd
from numbarl.rl import trainer
from numbarl.rl.runio import RunDir

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


@pytest.fixture(scope="module")
def full_run(cache_dir, tmp_path_factory):
    """One uninterrupted tiny run, shared by the run-folder and the resume tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NUMBARL_CACHE", str(cache_dir))
        out = tmp_path_factory.mktemp("full") / "run"
        r = _invoke(*FAST, "--out", str(out))
    assert r.exit_code == 0, r.output + repr(r.exception)
    return out


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
    assert summary["numbarl_version"] and summary["device"]
    # the windows are chronological and disjoint: nothing of validation/test inside training
    w = fold["window"]
    assert w["train"][1] <= w["val"][0] and w["val"][1] <= w["test"][0]
    # the replay buffer is kept with the latest checkpoint only
    resume_files = sorted(p.name for p in (out / "checkpoints").glob("*.resume.npz"))
    assert len(resume_files) == 1 and resume_files[0].startswith("fold0-epoch0002.")


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
    assert r.exit_code != 0
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
    strip = lambda recs: [{k: v for k, v in rec.items() if k != "env_steps_per_s"} for rec in recs]  # noqa: E731
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


def _schema_file(tmp_path):
    import databento_dbn as dbn

    meta = dbn.Metadata("GLBX.MDP3", 0, dbn.SType.RAW_SYMBOL, dbn.SType.INSTRUMENT_ID, dbn.Schema.MBP_1,
                        symbols=["X"], end=1)
    path = tmp_path / "mbp1.dbn"
    path.write_bytes(bytes(meta))
    return path


@pytest.mark.parametrize("case", ["missing", "schema", "config", "sessions", "resume"])
def test_bad_input_one_clear_error_nothing_written(run_cli, tmp_path, case):
    out = tmp_path / "run"
    args = {
        "missing": (["--data", str(tmp_path / "nowhere.dbn")], "no such file or folder"),
        "schema": (["--data", str(_schema_file(tmp_path))], "mbp-1"),
        "config": (["--set", "agent.lr=-1"], "agent.lr = -1.0 is out of range"),
        "sessions": (["--set", "train.train_sessions=50"], "needs 52 sessions; the data has 6"),
        "resume": (None, "not a numbarl run"),
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
