"""numbarl-sweep under the simulator on a local Ray: a 2 × 2 grid × 2 seeds leaves 8 complete run
folders and the comparison table; a trial equals the plain numbarl-train run of its settings; a
sweep killed mid-way (SIGKILL of its whole process group) and re-run with --resume ends with the
same results as the uninterrupted one; without Ray, and with bad arguments, one `error:` line,
exit code 2, nothing written. The sweeps run as their own processes (`python -m numbarl sweep`),
so that Ray starts and stops with them and a kill is a real kill."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from numbarl.cli import sweep_cmd
from numbarl.run import sweep
from numbarl.run.runio import RunDir

ROOT = Path(__file__).resolve().parents[2]
# the trainer tests' tiny run (tests/run/test_trainer.py FAST): two epochs, so that a kill can
# land between a trial's first checkpoint and its end
SETS = ["--set", "data.synth_bars_per_day=30", "--set", "train.collect_steps_per_epoch=4", "--set",
        "train.log_interval=2", "--set", "train.learning_starts=3"]
# 2 x 2 grid points, one seed (the seeds axis multiplies the trials the same way: test_plan_grid_times_random_draws_times_seeds)
GRID = ["--grid", "agent.lr=0.001,0.003", "--grid", "train.epsilon_end=0.05,0.2", "--seeds", "1"]
SWEEP = ["--preset", "tiny", *SETS, *GRID, "--max-concurrent", "2"]
SWEEP_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("numbarl-cache")


def _env(cache_dir) -> dict:
    env = dict(os.environ, NUMBARL_CACHE=str(cache_dir), RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return env


def _start(cache_dir, *args, log: Path) -> subprocess.Popen:
    # a session of its own: the kill test stops the sweep, Ray and the trials as one process group
    return subprocess.Popen([sys.executable, "-m", "numbarl", "sweep", *args], cwd=ROOT, env=_env(cache_dir),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, log: Path):
    try:
        proc.wait(SWEEP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"numbarl-sweep did not finish in {SWEEP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
    assert proc.returncode == 0, log.read_text()[-3000:]


def _processes_of(folder: Path) -> list[int]:
    """Live processes whose command line names `folder` (trial processes of a sweep there)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(folder).encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _gone(proc: subprocess.Popen, folder: Path, timeout_s: float = 60):
    """Wait until the sweep's process group and every process working on `folder` have exited."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            if not _processes_of(folder):
                return
        time.sleep(0.2)
    pytest.fail(f"processes of the killed sweep still running after {timeout_s} s: {_processes_of(folder)}")


@pytest.fixture(scope="module")
def full_sweep(cache_dir, tmp_path_factory):
    """One uninterrupted 2 × 2 sweep, shared by the tests below."""
    out = tmp_path_factory.mktemp("full") / "sweep"
    pytest.importorskip("ray")
    log = out.parent / "sweep.log"
    _finish(_start(cache_dir, *SWEEP, "--out", str(out), log=log), log)
    return out


def _folds(run: Path) -> list[dict]:
    summary = json.loads((run / "summary.json").read_text())
    return [{k: f.get(k) for k in ("val", "test", "val_sharpe_per_epoch", "best_checkpoint", "oracle_test")}
            for f in summary["folds"]]


def _final_arrays(run: Path) -> dict:
    return RunDir.open(run).load_checkpoint("latest", require_resume=True)[0]  # with the replay buffer


def _same_run(a: Path, b: Path):
    assert _folds(a) == _folds(b), f"{a.name}: summary metrics differ"
    xa, xb = _final_arrays(a), _final_arrays(b)
    assert xa.keys() == xb.keys()
    differ = [n for n in xa if not np.array_equal(xa[n], xb[n], equal_nan=True)]
    assert not differ, f"{a.name}: final checkpoint arrays differ: {differ[:5]}"


# ---------------------------------------------------------------------------------------------
# a sweep
# ---------------------------------------------------------------------------------------------
def test_grid_sweep_leaves_4_run_folders_and_the_table(full_sweep):
    record = json.loads((full_sweep / "sweep.json").read_text())
    trials = record["trials"]
    assert len(trials) == 4 and all(t["status"] == "finished" and t["attempts"] == 1 for t in trials)
    combos = {(t["overrides"]["agent.lr"], t["overrides"]["train.epsilon_end"], t["seed"]) for t in trials}
    assert combos == {(lr, eps, s) for lr in ("0.001", "0.003") for eps in ("0.05", "0.2") for s in (1,)}
    assert record["args"]["grid"] == {"agent.lr": ["0.001", "0.003"], "train.epsilon_end": ["0.05", "0.2"]}
    for t in trials:
        run = full_sweep / "trials" / t["name"]
        for name in ("config.json", "run.json", "metrics.jsonl", "summary.json", "report.html", "checkpoints/latest.json"):
            assert (run / name).is_file(), f"{t['name']}/{name}"
        config = json.loads((run / "config.json").read_text())
        assert config["train"]["seed"] == t["seed"]
        assert str(config["agent"]["lr"]) == t["overrides"]["agent.lr"]
        assert str(config["train"]["epsilon_end"]) == t["overrides"]["train.epsilon_end"]
        assert config["data"]["synth_bars_per_day"] == 30  # the --set every trial shares
    table = (full_sweep / "compare.txt").read_text()
    assert all(t["name"] in table for t in trials) and "test_sharpe       n=4" in table
    assert "agent.lr = " in table and "train.epsilon_end = " in table  # the swept fields, named
    rows = json.loads((full_sweep / "compare.json").read_text())["rows"]
    assert sorted(r["run"] for r in rows) == sorted(t["name"] for t in trials)
    assert len({r["test_sharpe"] for r in rows}) > 1  # the grid points are different runs


def test_a_trial_equals_the_plain_numbarl_train_run(full_sweep, cache_dir, tmp_path):
    trial = next(t for t in json.loads((full_sweep / "sweep.json").read_text())["trials"]
                 if t["seed"] == 1 and t["overrides"] == {"agent.lr": "0.003", "train.epsilon_end": "0.2"})
    plain = tmp_path / "plain"
    r = subprocess.run([sys.executable, "-m", "numbarl", "train", "--preset", "tiny", "--quiet", *SETS,
                        "--set", "agent.lr=0.003", "--set", "train.epsilon_end=0.2", "--seed", "1", "--out", str(plain)],
                       cwd=ROOT, env=_env(cache_dir), capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-2000:]
    _same_run(full_sweep / "trials" / trial["name"], plain)


def test_killed_sweep_resumes_to_the_same_results(full_sweep, cache_dir, tmp_path):
    out = tmp_path / "sweep"
    log = tmp_path / "killed.log"
    proc = _start(cache_dir, *SWEEP, "--out", str(out), log=log)
    # KILL once two trials have finished and another is between its first checkpoint and its end
    deadline = time.time() + SWEEP_TIMEOUT_S
    while True:
        runs = list((out / "trials").iterdir()) if (out / "trials").is_dir() else []
        finished = [r for r in runs if sweep.run_finished(r)]
        midway = [r for r in runs if (r / "checkpoints" / "latest.json").is_file() and not (r / "summary.json").is_file()]
        if len(finished) >= 2 and midway:
            break
        assert proc.poll() is None, f"the sweep ended before it could be killed midway:\n{log.read_text()[-2000:]}"
        assert time.time() < deadline, log.read_text()[-2000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    _gone(proc, out)
    kept = {r.name: (r / "summary.json").stat().st_mtime_ns for r in finished}
    # RESUME
    log2 = tmp_path / "resumed.log"
    _finish(_start(cache_dir, "--out", str(out), "--resume", "--max-concurrent", "2", log=log2), log2)
    trials = json.loads((out / "sweep.json").read_text())["trials"]
    assert all(t["status"] == "finished" for t in trials), trials
    by_name = {t["name"]: t for t in trials}
    for name, mtime in kept.items():  # finished trials are kept as they were
        assert by_name[name]["attempts"] == 1 and (out / "trials" / name / "summary.json").stat().st_mtime_ns == mtime
    for r in midway:  # interrupted trials continued through numbarl-train --resume
        assert by_name[r.name]["resumed"] and by_name[r.name]["attempts"] == 2
        assert f"train --resume {r}" in (out / "logs" / f"{r.name}.log").read_text()
    for t in trials:
        _same_run(out / "trials" / t["name"], full_sweep / "trials" / t["name"])
    drop = ("path",)
    rows = [{k: v for k, v in row.items() if k not in drop}
            for row in json.loads((out / "compare.json").read_text())["rows"]]
    assert rows == [{k: v for k, v in row.items() if k not in drop}
                    for row in json.loads((full_sweep / "compare.json").read_text())["rows"]]


# ---------------------------------------------------------------------------------------------
# the trial list, and the validation records a trial reports
# ---------------------------------------------------------------------------------------------
def _args(**kw):
    args = {"preset": "tiny", "config": None, "sets": [], "grid": {}, "random": {}, "samples": 1,
            "sample_seed": 0, "seeds": [0], "asha": False, "asha_grace": 1}
    return {**args, **kw}


def test_plan_grid_times_random_draws_times_seeds():
    args = _args(grid={"agent.lr": ["0.001", "0.003"]}, random={"agent.gamma": [0.9, 0.999, True],
                                                                "agent.n_step": [1, 5, False]},
                 samples=3, seeds=[4, 7])
    trials, steps = sweep.plan_trials(args, None)
    assert len(trials) == 2 * 3 * 2 and steps == 2  # tiny: 1 fold × 2 epochs
    assert trials[0]["name"].startswith("t000-lr=0.001_gamma=") and trials[0]["name"].endswith("-s4")
    gammas = [float(t["overrides"]["agent.gamma"]) for t in trials]
    assert all(0.9 <= g <= 0.999 for g in gammas) and len(set(gammas)) == 3  # 3 draws, shared by the grid points
    assert all(t["overrides"]["agent.n_step"].isdigit() and 1 <= int(t["overrides"]["agent.n_step"]) <= 5 for t in trials)
    again, _ = sweep.plan_trials(args, None)
    assert again == trials  # the draws are seeded (--sample-seed)
    other, _ = sweep.plan_trials({**args, "sample_seed": 1}, None)
    assert [t["overrides"] for t in other] != [t["overrides"] for t in trials]


def test_val_tail_reports_each_epoch_once_across_a_resume_truncation(tmp_path):
    path = tmp_path / "metrics.jsonl"
    val = lambda e: json.dumps({"kind": "val", "fold": 0, "epoch": e, "sharpe": float(e)}) + "\n"  # noqa: E731
    tail = sweep._ValTail(path)
    assert tail.new() == []  # no file yet
    path.write_text(json.dumps({"kind": "train", "step": 2}) + "\n" + val(1) + val(2)[:10])  # a partial last line
    assert [r["epoch"] for r in tail.new()] == [1]
    path.write_text(val(1))  # --resume truncated the log back to its checkpoint
    assert tail.new() == []
    with open(path, "a") as f:
        f.write(val(2) + val(3))
    assert [r["epoch"] for r in tail.new()] == [2, 3]


# ---------------------------------------------------------------------------------------------
# errors: one line, exit code 2, nothing written
# ---------------------------------------------------------------------------------------------
def _invoke(*args):
    return CliRunner().invoke(sweep_cmd, list(args), catch_exceptions=True)


def _one_error(r, text):
    assert r.exit_code == 2, r.output + repr(r.exception)
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and text in errors[0], r.output
    assert "Traceback" not in r.output


def test_without_ray_says_how_to_install_it(monkeypatch, tmp_path):
    for name in [n for n in sys.modules if n == "ray" or n.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    out = tmp_path / "sweep"
    r = _invoke("--preset", "tiny", *GRID, "--out", str(out))
    _one_error(r, "pip install 'numbarl[sweep]'")
    assert not out.exists()


@pytest.mark.parametrize("case", ["grid_field", "set_field", "grid_value", "grid_empty", "grid_empty_item",
                                  "seeds_text", "seeds_negative", "seeds_empty", "random_range", "exists",
                                  "not_a_sweep", "resume_other_grid"])
def test_bad_arguments_one_error_nothing_written(tmp_path, case):
    out = tmp_path / "sweep"
    base = ["--preset", "tiny", "--seeds", "0"]
    args, text = {
        "grid_field": (["--grid", "agent.lrr=0.1,0.2"], "unknown config field agent.lrr"),
        "set_field": (["--set", "train.epochz=2", "--grid", "agent.lr=0.1,0.2"], "unknown config field train.epochz"),
        "grid_value": (["--grid", "agent.lr=0.001,-1"], "agent.lr = -1.0 is out of range"),
        "grid_empty": (["--grid", "agent.lr="], "--grid 'agent.lr=': empty value"),
        "grid_empty_item": (["--grid", "agent.lr=0.1,,0.2"], "empty value"),
        "seeds_text": (["--seeds", "0,x"], "'x' is not an integer"),
        "seeds_negative": (["--seeds", "0,-1"], "seeds must be >= 0"),
        "seeds_empty": (["--seeds", "0,"], "give non-negative integers"),
        "random_range": (["--random", "agent.lr=0.1:0.01:log", "--samples", "2"], "needs finite LO < HI"),
        "exists": ([], "already exists"),
        "not_a_sweep": (["--resume"], "not a numbarl sweep folder"),
        "resume_other_grid": (["--resume", "--grid", "agent.lr=0.5,0.6"], "--grid differs"),
    }[case]
    if case in ("not_a_sweep", "resume_other_grid"):  # --resume takes the saved settings
        base = []
    if case in ("exists", "not_a_sweep"):
        out.mkdir()
        (out / "x.txt").write_text("x")
    if case == "resume_other_grid":
        out.mkdir()
        saved = {"preset": "tiny", "config": None, "sets": [], "grid": {"agent.lr": ["0.1", "0.2"]}, "random": {},
                 "samples": 1, "sample_seed": 0, "seeds": [0], "asha": False, "asha_grace": 1}
        (out / "sweep.json").write_text(json.dumps({"format": "numbarl-sweep", "format_version": 1, "args": saved,
                                                    "trials": []}))
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    r = _invoke(*base, *args, "--out", str(out))
    _one_error(r, text)
    assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == before


# ---------------------------------------------------------------------------------------------
# ASHA
# ---------------------------------------------------------------------------------------------
def _first_val_sharpe(run: Path) -> float:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r["sharpe"] for r in records if r["kind"] == "val")


def test_asha_stops_the_trial_behind_at_its_first_rung_and_resume_keeps_it(cache_dir, tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "sweep"
    log = tmp_path / "asha.log"
    # one trial at a time: the second reaches rung 1 (epoch 1) with the first's value recorded there;
    # ASHA (reduction factor 3) stops it when its validation Sharpe is below the first's
    _finish(_start(cache_dir, "--preset", "tiny", *SETS, "--seeds", "0,1", "--asha",
                   "--max-concurrent", "1", "--out", str(out), log=log), log)
    assert not _processes_of(out)
    trials = json.loads((out / "sweep.json").read_text())["trials"]
    first, second = sorted(trials, key=lambda t: (out / "logs" / f"{t['name']}.log").read_text().splitlines()[0])
    assert first["status"] == "finished"
    behind = _first_val_sharpe(out / "trials" / second["name"]) < _first_val_sharpe(out / "trials" / first["name"])
    assert second["status"] == ("stopped_early" if behind else "finished"), (trials, log.read_text()[-2000:])
    if behind:  # stopped after its first epoch: one validation record, no test, listed under the table
        run = out / "trials" / second["name"]
        vals = [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "val"' in line]
        assert len(vals) == 1 and not (run / "summary.json").exists()
        assert f"not in the table: {second['name']} (stopped early)" in (out / "compare.txt").read_text()
    # --resume: the finished and the stopped trial only replay their epochs; nothing runs again
    log2 = tmp_path / "asha-resumed.log"
    _finish(_start(cache_dir, "--out", str(out), "--resume", log=log2), log2)
    again = json.loads((out / "sweep.json").read_text())["trials"]
    assert [(t["status"], t["attempts"]) for t in again] == [(t["status"], 1) for t in trials]


def test_a_failing_trial_is_reported_and_the_sweep_exits_1(cache_dir, tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "sweep"
    log = tmp_path / "failing.log"
    missing = tmp_path / "nowhere.dbn"  # a valid config whose data the trial cannot read
    proc = _start(cache_dir, "--preset", "tiny", "--set", f"data.source={missing}", "--seeds", "0", "--out", str(out),
                  log=log)
    proc.wait(SWEEP_TIMEOUT_S)
    assert proc.returncode == 1, log.read_text()[-2000:]
    (trial,) = json.loads((out / "sweep.json").read_text())["trials"]
    assert trial["status"] == "failed" and "exited with code 2" in trial["error"] and "no such file" in trial["error"]
    assert f"error: --data {missing}: no such file or folder" in (out / "logs" / f"{trial['name']}.log").read_text()
    assert f"not in the table: {trial['name']} (failed)" in (out / "compare.txt").read_text()
    assert "1 of 1 trials failed" in log.read_text() and "--resume` runs them again" in log.read_text()
