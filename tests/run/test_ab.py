"""numbarl ab: a grid of tiny runs (arms x seeds) and its one table; a finished grid is not re-run."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from numbarl.run import ab

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--train-arg=--epochs=2", "--train-arg=--set=data.synth_bars_per_day=30",
        "--train-arg=--set=train.collect_steps_per_epoch=4", "--train-arg=--set=train.learning_starts=3",
        "--train-arg=--set=train.log_interval=2"]


def test_arm_parsing():
    assert ab.parse_arm("base") == ("base", [])
    assert ab.parse_arm("e2: --set train.e2_adaptive_epsilon=true") == ("e2", ["--set", "train.e2_adaptive_epsilon=true"])
    for bad in ("a/b", "x-s3", ": --set a=b"):
        try:
            ab.parse_arm(bad)
        except ValueError:
            continue
        raise AssertionError(bad)


def test_an_arm_with_its_own_seeds(tmp_path):
    """'name@2,3: options' runs (and tables) that arm on seeds 2 and 3, the others on --seeds."""
    assert ab.parse_arm_spec("ptemp@2,3,4: --set a=b") == ("ptemp", ["--set", "a=b"], [2, 3, 4])
    assert ab.parse_arm_spec("base") == ("base", [], None) and ab.parse_arm("x@1: --set a=b") == ("x", ["--set", "a=b"])
    for bad in ("x@: --set a=b", "x@a", "x@1,1", "x@-1"):
        try:
            ab.parse_arm_spec(bad)
        except ValueError:
            continue
        raise AssertionError(bad)
    out = tmp_path / "grid"
    for name, sharpe in (("a-s0", 1.0), ("a-s2", 9.0), ("b-s2", 0.5), ("b-s3", 1.5), ("b-s0", 9.0)):
        (out / name).mkdir(parents=True)
        summary = {"bars_per_day": 10, "folds": [{"test": {"sharpe": sharpe}, "oracle_test": {"sharpe": 2.0},
                                                   "window": {"test": [0, 30]}}]}
        (out / name / "summary.json").write_text(json.dumps(summary))
    assert ab.main(["--out", str(out), "--table-only", "--seeds", "0", "--arm", "a", "--arm", "b@2,3: --set x=1"]) == 0
    rows = {r["arm"]: r for r in json.loads((out / "ab.json").read_text())}
    assert rows["a"]["test_over_oracle_all"] == [0.5]  # seed 0 only: a-s2 is not in this grid
    assert rows["b"]["test_over_oracle_all"] == [0.25, 0.75]  # seeds 2, 3: b-s0 is not


def test_an_interrupted_run_resumes_with_its_saved_config(tmp_path):
    """numbarl-train refuses --set/--seed/--preset beside --resume (the run's config.json rules): the
    grid's continuation of an interrupted run passes --resume alone (it used to pass both: rc 2)."""
    folder = tmp_path / "mh-s0"
    new = ab.train_command(folder, "default", ["--set", "agent.horizons=1,3,20"], 0, ["--epochs=2"], resume=False)
    assert new[-2:] == ["--out", str(folder)] and "agent.horizons=1,3,20" in new and "--epochs=2" in new
    again = ab.train_command(folder, "default", ["--set", "agent.horizons=1,3,20"], 0, ["--epochs=2"], resume=True)
    assert again[3:] == ["train", "--quiet", "--resume", str(folder)]


def test_best_epochs_and_the_mean_validation_curve():
    """The table names each finished seed's selected epoch, and the note under it the arm's mean validation Sharpe
    per epoch over its finished seeds (a shorter curve counts where it reaches, a None epoch not at all)."""
    def run(seed, best, curve, done=True):
        return {"run": f"a-s{seed}", "finished": done, "t": None, "hold_t": None, "trade_t": None, "best_epoch": best,
                "val_curve": curve, **{k: None for k in ("test_over_oracle", "val_test_gap", "last_over_best_val",
                                                         "atom_utilization", "train_path_last_over_best",
                                                         "val_trades_last_over_best")}}

    row = ab.arm_row("a", [run(0, 2, [1.0, 9.0, 3.0]), run(1, 3, [3.0, 5.0, None]), run(2, 1, [2.0], done=False)])
    assert row["val_curve_mean"] == [2.0, 7.0, 3.0] and row["best_epoch_all"] == [2, 3, 1]
    assert "| 2, 3 | n/a |" not in ab.format_table([row]) and " | 2, 3 | " in ab.format_table([row])
    note = "\nValidation Sharpe per epoch, mean over the finished seeds:\n- a: 2.0, 7.0, 3.0 (n=1)\n"
    assert ab.curve_note([row]) == note  # epoch 3: one seed has a number
    assert ab.curve_note([ab.arm_row("b", [run(0, None, [], done=False)])]) == ""
    assert ab.curve_mean([[None, 1.0], [2.0]]) == [2.0, 1.0] and ab.curve_mean([]) == []


def test_seed_placeholder_gives_each_seed_its_options():
    opts = ["--set", "data.synth_null=true", "--set", "data.synth_seed=10{seed}"]
    assert ab.seed_options(opts, 3) == ["--set", "data.synth_null=true", "--set", "data.synth_seed=103"]
    assert ab.seed_options(["--set", "a=1"], 0) == ["--set", "a=1"]


def test_grid_writes_one_table_and_continues(tmp_path):
    # two arms x one seed, two runs side by side (the seeds' own markets: test_seed_options above)
    out = tmp_path / "grid"
    env = {"NUMBARL_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "numbarl", "ab", "--out", str(out), "--preset", "tiny", "--seeds", "0",
           "--parallel", "2", "--arm", "base", "--arm", "eps: --set train.epsilon_end=0.2", *FAST]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**__import__("os").environ, **env})
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads((out / "ab.json").read_text())
    assert [row["arm"] for row in rows] == ["base", "eps"] and all(row["runs"] == 1 for row in rows)
    assert all(1 <= row["best_epoch_all"][0] <= 2 for row in rows)  # the selected checkpoint of a 2-epoch run
    for row in rows:  # the tiny market has an oracle: every run has a test/oracle and a decay ratio
        assert len(row["test_over_oracle_all"]) == 1
        assert row["last_over_best_val_mean"] is None or row["last_over_best_val_mean"] <= 1.0
        assert len(row["hold_t_all"]) == len(row["t_all"]) == 1  # None where the window is under two days
    hold = json.loads((out / "base-s0" / "summary.json").read_text())["folds"][0]["hold_test"]
    assert hold["n_trades"] >= 1 and hold["exposure"] > 0.5  # buy and hold: long over the test window
    table = (out / "ab.md").read_text()
    assert table.split("\n\n")[0].count("\n") == 3 and "| base | 1 |" in table  # the header, its rule, two rows
    assert "\nValidation Sharpe per epoch, mean over the finished seeds:\n- base: " in table  # two epochs each
    assert all(len(row["val_curve_mean"]) == 2 for row in rows)
    for name in ("base-s0", "eps-s0"):
        assert (out / name / "summary.json").is_file()
    cfg = json.loads((out / "eps-s0" / "config.json").read_text()) if (out / "eps-s0" / "config.json").exists() else None
    if cfg is not None:
        assert cfg["train"]["epsilon_end"] == 0.2
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**__import__("os").environ, **env})
    assert again.returncode == 0 and again.stdout.count("rc 0, 0 s") == 2  # finished runs are not run again
    # a finished folder whose config.json differs from what its arm gives now stops the grid, naming the field
    cfg_path = out / "eps-s0" / "config.json"
    saved = json.loads(cfg_path.read_text())
    saved["train"]["epsilon_end"] = 0.3
    cfg_path.write_text(json.dumps(saved))
    changed = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT, env={**__import__("os").environ, **env})
    assert changed.returncode == 2 and "eps-s0" in changed.stderr, changed.stdout + changed.stderr
    assert "train.epsilon_end: 0.3 -> 0.2" in changed.stderr and "base-s0" not in changed.stderr
    cfg_path.unlink()  # a light copy (no config.json) stops the grid, naming it, unless --accept-unchecked
    light = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT, env={**__import__("os").environ, **env})
    assert light.returncode == 2 and "1 finished run folder(s) have no config.json" in light.stderr
    assert "eps-s0" in light.stderr and "base-s0" not in light.stderr and "--accept-unchecked" in light.stderr
    light = subprocess.run([*cmd, "--accept-unchecked"], capture_output=True, text=True, check=False, cwd=ROOT,
                           env={**__import__("os").environ, **env})
    assert light.returncode == 0 and "1 finished run folder(s) without config.json are taken" in light.stderr
    bad = subprocess.run([sys.executable, "-m", "numbarl", "ab", "--out", str(out), "--arm", "a/b"],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.startswith("error:")


def _write_metrics(folder, records):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "va')


def test_decay_columns_and_an_unfinished_run(tmp_path):
    # hand-computed: val Sharpe 10, 20, 15 (best epoch 2 with 40 trades, last 60 trades: 1.5; last/best 0.75),
    # training path 5, 8, 6 (0.75), a killed run's torn last line skipped, fold 1's records ignored
    recs = []
    for e, (v, n, tp) in enumerate([(10.0, 30, 5.0), (20.0, 40, 8.0), (15.0, 60, 6.0)], start=1):
        recs += [{"kind": "train", "fold": 0, "epoch": e, "atom_utilization": 0.9 - 0.1 * e},
                 {"kind": "train_path", "fold": 0, "epoch": e, "train_path.sharpe": tp},
                 {"kind": "val", "fold": 0, "epoch": e, "sharpe": v, "n_trades": n}]
    recs.append({"kind": "val", "fold": 1, "epoch": 4, "sharpe": 99.0, "n_trades": 1})
    _write_metrics(tmp_path / "a-s0", recs)
    n = ab.run_numbers(tmp_path / "a-s0")
    assert n["finished"] is False and n["epochs"] == 3 and n["test_over_oracle"] is None
    assert n["last_over_best_val"] == 0.75 and n["train_path_last_over_best"] == 0.75
    assert n["val_trades_last_over_best"] == 1.5 and abs(n["atom_utilization"] - 0.6) < 1e-12
    _write_metrics(tmp_path / "a-s1", [{"kind": "train", "fold": 0, "epoch": 1, "atom_utilization": 0.5}])
    assert ab.run_numbers(tmp_path / "a-s1") is None  # no validation epoch yet: nothing to count
    row = ab.arm_row("a", [n])
    assert row["runs"] == 0 and row["unfinished"] == 1 and row["unfinished_epochs"] == [3]
    assert row["test_over_oracle_all"] == [None] and row["t_all"] == [None] and row["last_over_best_val_mean"] == 0.75
    assert row["run_all"] == ["a-s0"] and row["finished_all"] == [False]
    assert "| a | 0 (+1 unfinished) |" in ab.format_table([row])
    # a validation epoch without trades (Sharpe undefined) is skipped for the best epoch, not for the last
    assert ab._trades_drift([None, 5.0, None], [0, 10, 20]) == 2.0
    assert ab._trades_drift([5.0, None], [10, None]) is None
    assert ab._trades_drift([5.0, 7.0, 7.0], [10, 20, 40]) == 2.0  # a tie: the first best epoch, as the selection
    assert ab._ratio_to_best([5.0, 10.0, None]) is None  # a last epoch without trades has no ratio
    # a summary that lists fewer folds than the config asks for (a multi-fold run killed in fold 1) is unfinished
    (tmp_path / "a-s0" / "config.json").write_text(json.dumps({"train": {"folds": 2}}))
    (tmp_path / "a-s0" / "summary.json").write_text(json.dumps({"folds": [{}]}))
    assert ab.run_numbers(tmp_path / "a-s0")["finished"] is False


def test_component_arms_take_the_registry_switch(tmp_path):
    """--component NAME: an arm named after a registry component with its switch as --set options (several
    settings, and commas inside a value, kept); an unknown name is one clear error, exit 2."""
    from numbarl.rl.components import by_name

    assert ab.component_arm("kelly_sizing") == ("kelly_sizing", ["--set", "env.kelly_lambda=0.5"], None)
    assert by_name()["multi_horizon_c51"].switch.count("=") == 1
    name, opts, _ = ab.component_arm("multi_horizon_c51")
    assert name == "multi_horizon_c51" and opts == ["--set", by_name()["multi_horizon_c51"].switch]
    name, opts, _ = ab.component_arm("risk_budget")  # two settings in one switch
    assert opts == ["--set", "agent.iqn=true", "--set", "agent.risk_budget=true"]
    bad = subprocess.run([sys.executable, "-m", "numbarl", "ab", "--out", str(tmp_path / "g"), "--component", "nope"],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --component 'nope'")
    # a switch the preset already has on would be a second base arm: refused before anything runs
    with pytest.raises(ValueError, match=r"already on in the grid's base \(preset 'default'"):
        ab.component_arm("pnl_reward", "default")
    assert ab.component_arm("pnl_reward", "tiny")[1] == ["--set", "env.pnl_reward_scale=0.01"]
    assert ab.main(["--out", str(tmp_path / "g3"), "--arm", "base", "--component", "pnl_reward"]) == 2
    assert not (tmp_path / "g3").exists()
    # the base is the preset with the settings every run gets: off there, the switch is an arm again
    assert ab.train_arg_sets(["--set=env.pnl_reward_scale=0", "--quiet", "--set", "agent.gamma=0.9"]) == [
        "env.pnl_reward_scale=0", "agent.gamma=0.9"]
    assert ab.component_arm("pnl_reward", "default", ["--set=env.pnl_reward_scale=0"])[0] == "pnl_reward"
    with pytest.raises(ValueError, match="already on"):  # and a switch the settings turn on is refused
        ab.component_arm("kelly_sizing", "tiny", ["--set=env.kelly_lambda=0.5"])
    assert ab.main(["--out", str(tmp_path / "g2"), "--table-only", "--component", "pnl_reward"]) == 0
    # a grid's table names the component arm; nothing to train (--table-only)
    assert ab.main(["--out", str(tmp_path / "g2"), "--table-only", "--arm", "base", "--component", "kelly_sizing"]) == 0
    rows = json.loads((tmp_path / "g2" / "ab.json").read_text())
    assert [r["arm"] for r in rows] == ["base", "kelly_sizing"]


def test_config_differences_names_each_changed_field():
    saved = {"preset": "default", "agent": {"compute": "fp32", "trunk": [512, 512], "gone": 1},
             "train": {"seed": 3, "epochs": 10}}
    now = {"preset": "default", "agent": {"compute": "tf32", "trunk": (512, 512), "new_field": 2},
           "train": {"seed": 4, "epochs": 10}}
    # the seed is the folder's, fields the saved run lacks or the code no longer has are not compared
    assert ab.config_differences(saved, now) == ["agent.compute: 'fp32' -> 'tf32'"]
    assert ab.config_differences(now, now) == []


def test_a_resumable_folder_with_other_settings_stops_the_grid(tmp_path):
    # a started run (checkpoints/, no summary) is resumed with its saved config: checked like a finished one
    out = tmp_path / "g"
    folder = out / "eps-s0"
    (folder / "checkpoints").mkdir(parents=True)
    saved = ab.resolved_config("tiny", ["--set", "train.epsilon_end=0.3"], 0, [])
    (folder / "config.json").write_text(json.dumps(saved))
    errors, unchecked = ab.check_finished_runs(out, "tiny", [("eps", ["--set", "train.epsilon_end=0.2"], [0])], [])
    assert unchecked == [] and len(errors) == 1
    assert "started (the grid would resume it)" in errors[0] and "train.epsilon_end: 0.3 -> 0.2" in errors[0]
    assert ab.check_finished_runs(out, "tiny", [("eps", ["--set", "train.epsilon_end=0.3"], [0])], []) == ([], [])
    # a non-finite value is saved as null (JSON) and printed as inf: the same setting
    assert ab.config_differences({"agent": {"v_max": None}}, {"agent": {"v_max": float("inf")}}) == []


def test_arms_that_trained_the_same_bits_are_named(tmp_path):
    # the learning curve's fingerprint: equal records give equal hashes, one loss one float32 ulp apart another
    recs = [{"kind": "train", "fold": 0, "epoch": 1, "loss": 2.303375720977783},
            {"kind": "val", "fold": 0, "epoch": 1, "sharpe": 186.7, "n_trades": 40}]
    _write_metrics(tmp_path / "x-s0", recs)
    _write_metrics(tmp_path / "y-s0", recs)
    _write_metrics(tmp_path / "z-s0", [{**recs[0], "loss": float(np.nextafter(np.float32(recs[0]["loss"]),
                                                                             np.float32(3)))}, recs[1]])
    fp = [ab.metrics_trajectory(tmp_path / n)["fingerprint"] for n in ("x-s0", "y-s0", "z-s0")]
    assert fp[0] == fp[1] != fp[2] and fp[0] is not None
    assert ab.metrics_trajectory(tmp_path / "none")["fingerprint"] is None  # no metrics.jsonl: nothing to compare

    def run(arm, seed, f, done=True, train=None):
        return {"run": f"{arm}-s{seed}", "fingerprint": f, "train_fingerprint": train or f + "-train", "finished": done,
                "t": None,
                **{k: None for k in ("test_over_oracle", "val_test_gap", "last_over_best_val", "atom_utilization",
                                     "train_path_last_over_best", "val_trades_last_over_best")}}

    rows = [ab.arm_row("base", [run("base", 0, "a"), run("base", 1, "b"), run("base", 10, "c")]),
            ab.arm_row("wd", [run("wd", 0, "a"), run("wd", 1, "b")]),  # seeds 0 and 1 the same as base's
            ab.arm_row("warm", [run("warm", 0, "a"), run("warm", 1, "B")]),  # seed 1 differs: not the same
            ab.arm_row("cos", [run("cos", 10, "c"), run("cos", 1, "b", done=False)]),  # the unfinished seed 1 left out
            ab.arm_row("new", [run("new", 2, "a")])]  # no seed in common with any arm
    assert ab.identical_arms(rows) == [("base", "wd", ["0", "1"]), ("base", "cos", ["10"])]
    note = ab.identical_note(rows)
    assert "Arms base and wd are bit for bit the same on seed(s) 0, 1" in note and "warm" not in note
    assert ab.identical_note(rows[2:3]) == ""
    # the same train losses, another validation (E9's gate that never closed, beside the base): named apart
    rows.append(ab.arm_row("e9", [run("e9", 0, "v0", train="a-train"), run("e9", 1, "v1", train="b-train")]))
    assert ("base", "e9", ["0", "1"]) in ab.identical_arms(rows, "train_fingerprint")
    assert ("base", "e9", ["0", "1"]) not in ab.identical_arms(rows)
    note = ab.identical_note(rows)
    assert "Arms base and e9 trained the same bits on seed(s) 0, 1 (every train loss)" in note
    assert "Arms base and wd trained the same" not in note  # already named as the same in every way
    assert ab.metrics_trajectory(tmp_path / "x-s0")["train_fingerprint"] == ab.metrics_trajectory(
        tmp_path / "y-s0")["train_fingerprint"] != ab.metrics_trajectory(tmp_path / "z-s0")["train_fingerprint"]


def test_arms_whose_seeds_share_one_test_path_are_named():
    # the null market's check: five seeds on one market path (the same buy-and-hold t) are five policies on one
    # path; the table lists each seed's test t and the window's buy-and-hold t, and a line under it says so
    def run(arm, seed, t, hold, done=True):
        return {"run": f"{arm}-s{seed}", "finished": done, "t": t, "hold_t": hold, "trade_t": None,
                **{k: None for k in ("test_over_oracle", "val_test_gap", "last_over_best_val", "atom_utilization",
                                     "train_path_last_over_best", "val_trades_last_over_best")}}

    rows = [ab.arm_row("null", [run("null", 0, 0.5, 1.454), run("null", 1, -1.65, 1.454),
                                run("null", 2, 2.2, 0.3, done=False)]),  # the unfinished seed is left out
            ab.arm_row("own", [run("own", 0, 0.1, 0.2), run("own", 1, -0.4, -1.1)]),  # a market per seed
            ab.arm_row("one", [run("one", 0, 1.0, 0.7)])]  # one seed: nothing to share
    note = ab.shared_window_note(rows)
    assert note.count("\n") == 2 and "null (hold t +1.45)" in note and "own" not in note and "one (" not in note
    assert ab.shared_window_note(rows[1:]) == ""
    table = ab.format_table(rows).splitlines()
    assert "| best epochs | test t per seed | hold t |" in table[0] and table[1].count("---") == 17
    assert all(line.count(" | ") == 16 for line in table[2:])  # 17 columns in every row
    assert "| 0.50, -1.65 | +1.45 |" in table[2] and "| 0.10, -0.40 | +0.20, -1.10 |" in table[3]
    assert rows[1]["t_at_abs_max"] == -0.4  # ab.json keeps the largest |t| with its sign


def test_seeds_held_flat_by_the_deployment_rule_are_named_with_their_policys_test_t(tmp_path):
    """A finished run whose fold the deployment rule held flat (summary: deployed false, test_policy beside the flat
    test) scores 0 in the table (it earned nothing) and a line under it names the seed with the test t its policy
    would have scored (daily Sharpe x sqrt(days / 252): 2 test days of 100 bars, daily Sharpe -31.5 -> t -2.81)."""
    def finished(name, fold):
        folder = tmp_path / name
        _write_metrics(folder, [{"kind": "val", "fold": 0, "epoch": 1, "sharpe": 1.0, "n_trades": 3}])
        (folder / "summary.json").write_text(json.dumps({"bars_per_day": 100.0, "folds": [
            {"window": {"test": [0, 200]}, "best_checkpoint": "fold0-epoch0001", **fold}]}))
        return ab.run_numbers(folder)

    flat = {"sharpe": None, "daily_sharpe": None, "n_trades": 0, "trade_sharpe": None}
    held = finished("n-s3", {"deployed": False, "val_trade_t": 0.4, "test": flat, "oracle_test": {"sharpe": 50.0},
                             "test_policy": {"sharpe": -9.0, "daily_sharpe": -31.5, "n_trades": 5, "trade_sharpe": -1.6}})
    assert held["held_flat"] is True and held["t"] == 0.0 and held["trade_t"] == 0.0 and held["test_over_oracle"] == 0.0
    assert abs(held["policy_t"] - (-31.5 * (2 / 252) ** 0.5)) < 1e-12
    kept = finished("n-s1", {"deployed": True, "val_trade_t": 3.0, "oracle_test": {"sharpe": 50.0},
                             "test": {"sharpe": 10.0, "daily_sharpe": 20.0, "n_trades": 9, "trade_sharpe": 1.0}})
    assert kept["held_flat"] is False and kept["policy_t"] is None and kept["test_over_oracle"] == 0.2
    row = ab.arm_row("n", [kept, held])
    note = ab.held_flat_note([row])
    assert "n seed(s) 3 (-2.81)" in note and "1 (" not in note
    assert ab.held_flat_note([ab.arm_row("n", [kept])]) == ""  # nothing held flat: no line
    assert "| 0.20, 0.00 |" in ab.format_table([row])
    # --deploy-min-trade-t scores a run trained without the rule as if it had been on: validation trade t 1 x sqrt(4)
    # = 2 is held flat below a bar of 2.5 and deploys at 2; a run with its own decision keeps it
    before = finished("m-s0", {"val": {"trade_sharpe": 1.0, "n_trades": 4}, "oracle_test": {"sharpe": 50.0},
                               "test": {"sharpe": 10.0, "daily_sharpe": 20.0, "n_trades": 9, "trade_sharpe": 1.0}})
    rescored = ab.run_numbers(tmp_path / "m-s0", deploy_min_trade_t=2.5)
    assert before["held_flat"] is False and rescored["held_flat"] is True and rescored["t"] == 0.0
    assert rescored["policy_t"] == before["t"] and rescored["test_over_oracle"] == 0.0
    assert ab.run_numbers(tmp_path / "m-s0", deploy_min_trade_t=2.0) == before
    assert ab.run_numbers(tmp_path / "n-s1", deploy_min_trade_t=100.0) == kept  # its own decision: deployed
    assert held["test_sharpe"] == 0.0 and rescored["test_sharpe"] == 0.0  # both kinds of held-flat run alike
    # real data has no oracle: a held-flat seed has no test/oracle either (not 0 beside the deployed seeds' n/a)
    no_oracle = finished("r-s0", {"deployed": False, "val_trade_t": 0.4, "test": flat, "test_policy": flat})
    assert no_oracle["test_over_oracle"] is None and no_oracle["t"] == 0.0
    # a bar that is not a number >= 0 is refused (a NaN bar would hold every run flat)
    for bar in ("nan", "-1"):
        assert ab.main(["--out", str(tmp_path), "--table-only", "--arm", "n", f"--deploy-min-trade-t={bar}"]) == 2
