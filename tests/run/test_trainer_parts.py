"""Trainer parts: the progress line (ETA, compact metric cells) and the model-selection score."""

import math

from numbarl.run import trainer


def test_eta_covers_every_phase():
    """The ETA counts the work left in every phase at its own measured cost: collect/train steps,
    backtest bars (validation and test) and checkpoints; a phase with work left but not timed yet
    makes it a lower bound (">"). The old ETA counted collect steps only ("ETA 0m15s" for a
    14-minute run whose time went into validation)."""
    now = [100.0]
    p = trainer.Progress(quiet=True, clock=lambda: now[0])
    p.plan(steps=10, backtest_bars=200, checkpoints=2)
    assert p.eta() == "--"  # nothing done yet
    p.done("step", 4, 8.0)  # 2 s per step, 6 left: 12 s, but backtests and checkpoints are untimed
    assert p.eta() == ">0m12s"
    p.done("backtest", 50, 25.0)  # 0.5 s per bar, 150 left: 75 s
    p.done("checkpoint", 1, 3.0)  # 3 s each, 1 left
    assert p.remaining() == (12.0 + 75.0 + 3.0, True)
    assert p.eta() == "1m30s"
    p.skip("step", 2)  # an early stop: work the run will not do leaves the estimate (2 steps of 2 s)
    assert p.remaining() == (8.0 + 75.0 + 3.0, True)
    p.left["step"] += 2
    now[0] += 30.0  # 30 s spent, 90 s left: a quarter of the way
    assert p.bar(width=8) == "[##------]  25%"
    p.plan(steps=4000)
    p.done("step", 2, 4.0)  # 2 s per step, 3998 left: 2 h 13 min
    assert p.eta() == "2h13m"


def test_progress_lines_are_timestamped_and_kept_in_the_run_log(tmp_path, capsys):
    import re

    p = trainer.Progress(quiet=True)
    p.log("building the market")  # before the run folder exists: kept, written on attach
    p.attach(tmp_path / "train.log")
    p.status("fold 0 epoch 1/2 validation backtest (22 bars)")
    p.warn("preset 'default' is sized for a GPU")
    p.close()
    err = capsys.readouterr().err.splitlines()
    assert all(re.match(r"^\[\d\d:\d\d:\d\d\] ", line) for line in err), err
    logged = (tmp_path / "train.log").read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in logged] == [
        "building the market", "fold 0 epoch 1/2 validation backtest (22 bars)",
        "warning: preset 'default' is sized for a GPU"]
    assert all(re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", line) for line in logged)
    record = p.stamp({"kind": "val"})
    assert record["elapsed_s"] >= 0 and record["time"].endswith("+00:00")


def test_metric_cells():
    assert trainer._num(None) == "n/a"
    assert trainer._num(float("nan"), ".2f") == "n/a"
    assert trainer._num(math.inf) == "n/a"
    assert trainer._num(37.274646557517116, ".2f") == "37.27"
    assert trainer._num(0.001609713497292109, ".3%") == "0.161%"
    assert trainer._num(3862144.0) == "3.86e+06"


def test_selection_score_is_the_mean_of_the_last_window_epochs():
    # the best single epoch (window 1), NaN -> never selected
    assert trainer.selection_score([1.0, 5.0], 1) == 5.0
    assert trainer.selection_score([1.0, math.nan], 1) == -math.inf
    # window 3: nothing before 3 epochs, then the mean of the last 3 (the seed-2 curve of RESULTS.md)
    history = [122.6, 8.0, 32.7, 23.0, 129.4, 66.9, 113.3, 116.6, 103.2, 88.1]
    scores = [trainer.selection_score(history[:e], 3) for e in range(1, len(history) + 1)]
    assert scores[:2] == [-math.inf, -math.inf]
    assert scores[2] == (122.6 + 8.0 + 32.7) / 3
    assert max(range(len(scores)), key=scores.__getitem__) + 1 == 9  # epochs 7-9: 111.0 (single best: epoch 5)
    assert trainer.selection_score([1.0, math.nan, 2.0, 3.0], 3) == -math.inf


def test_select_window_is_validated_against_the_epochs():
    import pytest

    from numbarl import config

    with pytest.raises(config.ConfigError, match="train.select_window = 11 is out of range"):
        config.resolve("default", None, ["train.select_window=11"])
    assert config.resolve("default", None, ["train.select_window=3"]).train.select_window == 3


def test_runs_started_together_build_the_synthetic_market_once(tmp_path, monkeypatch):
    """Two runs (two processes, as in real use) on one fresh cache folder: the second waits for
    the first's build and loads it. Processes, not threads: CPython 3.11's ast.literal_eval (used
    by np.load for .npy headers) is not thread-safe, and runs never share a process anyway."""
    import multiprocessing
    import os
    import time

    from numbarl import config as config_mod
    from numbarl.data import synth
    from numbarl.run import trainer

    original = synth.build_synthetic_cache
    marks = tmp_path / "builds"
    marks.mkdir()

    def slow_build(*args, **kwargs):
        (marks / str(os.getpid())).touch()
        time.sleep(0.5)  # long enough for the other run to find no cache yet
        return original(*args, **kwargs)

    monkeypatch.setattr(synth, "build_synthetic_cache", slow_build)
    cache = tmp_path / "cache"
    monkeypatch.setenv("NUMBARL_CACHE", str(cache))
    dcfg = config_mod.preset("tiny").data

    def one(i):
        path = trainer.prepare_data(dcfg, log=lambda m: None).path
        (tmp_path / f"path-{i}").write_text(str(path))

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=one, args=(i,)) for i in range(2)]
    procs[0].start()
    time.sleep(0.1)
    procs[1].start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    paths = [(tmp_path / f"path-{i}").read_text() for i in range(2)]
    assert len(list(marks.iterdir())) == 1 and paths[0] == paths[1]


def test_fold_seeds_do_not_collide_across_a_seed_sweep():
    from numbarl.run.trainer import fold_seed

    assert fold_seed(5, 0) == 5  # fold 0 keeps the run's seed (recorded single-fold results stand)
    seeds = {fold_seed(s, k) for s in range(2000) for k in range(4)}
    assert len(seeds) == 8000 and all(0 <= x < 2**63 for x in seeds)


def test_restore_reads_an_undefined_validation_sharpe_back_as_nan():
    """A NaN validation Sharpe is saved as JSON null; restored it must be NaN again, or the
    selection score of a select_window > 1 run fails on None after a resume."""
    import math
    import types

    from numbarl.run.trainer import FoldTrainer, selection_score

    ft = types.SimpleNamespace(agent=types.SimpleNamespace(load_state=lambda a: None),
                               env=types.SimpleNamespace(arena=types.SimpleNamespace(load=lambda a: None)))
    FoldTrainer.restore(ft, {}, {"epoch": 2, "collect_steps": 8, "best_sharpe": None, "best_tag": None,
                                 "val_history": [None, 1.5]})
    assert math.isnan(ft.val_history[0]) and ft.val_history[1] == 1.5 and ft.best_sharpe == -math.inf
    assert selection_score(ft.val_history, 2) == -math.inf


def test_numbarl_data_folds_check_the_split_numbarl_train_uses():
    """One split definition: numbarl-data --folds defaulted to 12/4/4 sessions and embargo 0 while
    numbarl-train used 14/3/3 and 50; both now take numbarl/data/splits.py's DEFAULT_SPLIT."""
    import click

    from numbarl.config import TrainConfig
    from numbarl.data import commands
    from numbarl.data.splits import DEFAULT_SPLIT

    seen = {}

    @click.command()
    @commands.fold_options
    def probe(**options):
        seen.update(commands._fold_spec(options))

    probe.main(["--folds", "3"], standalone_mode=False)
    t = TrainConfig()
    assert seen == {"n_folds": 3, "train_sessions": t.train_sessions, "val_sessions": t.val_sessions,
                    "test_sessions": t.test_sessions, "embargo_bars": t.embargo_bars}
    assert {k: v for k, v in seen.items() if k != "n_folds"} == DEFAULT_SPLIT


def test_nonfinite_stop_does_not_claim_a_checkpoint_that_does_not_exist():
    from types import SimpleNamespace

    import pytest

    def stopped(latest):
        ft = SimpleNamespace(agent=SimpleNamespace(nonfinite_tensors=lambda: ["params:trunk.fc0.w"]),
                             run=SimpleNamespace(latest_checkpoint=lambda: latest, path="runs/x"),
                             fold=SimpleNamespace(index=0), epoch=0)
        with pytest.raises(trainer.NonFiniteError) as info:
            trainer.FoldTrainer.stop_nonfinite(ft, {"nonfinite_what": 1, "nonfinite_step": 2})
        return str(info.value)

    message = stopped(None)
    assert "no checkpoint had been saved yet" in message and "last good checkpoint" not in message
    message = stopped({"tag": "fold0-epoch0001", "step": 4})
    assert "the last good checkpoint fold0-epoch0001 is kept" in message


def test_trade_prices_without_float_noise():
    import pandas as pd

    trades = pd.DataFrame({"entry_price": [3937.0000000000005, 3933.7499999999995, 3937.32551627000001],
                           "exit_price": [3940.25, 0.1 + 0.2, 3937.0]})
    tidy = trainer._tidy_prices(trades, 0.25)
    assert tidy["entry_price"].tolist() == [3937.0, 3933.75, 3937.32551627]
    assert tidy["exit_price"].tolist()[0] == 3940.25 and tidy["exit_price"].tolist()[2] == 3937.0
    assert tidy.to_csv(index=False).splitlines()[1].startswith("3937.0,3940.25")
    assert trainer._tidy_prices(pd.DataFrame({"entry_price": [1.1 + 2.2]}), 0.1)["entry_price"][0] == 3.3


def test_c51_head_on_a_non_finite_input_gives_nan_without_a_warning_on_stderr():
    """A diverged trunk (inf) makes the head compute NaN; under the simulator that used to print
    numpy's "RuntimeWarning: invalid value encountered in scalar add" to the user's terminal."""
    import warnings

    import numpy as np

    from numbarl.cuda.runtime import cuda, stream
    from numbarl.rl.nets.c51_head import BranchedDuelingC51Head, dueling_forward

    _cuda = cuda()
    sizes, n_atoms, batch = (3, 2), 5, 2
    layout = BranchedDuelingC51Head("layout_only", 4, sizes, n_atoms, -1.0, 1.0).layout
    value = np.zeros((batch, n_atoms), np.float32)
    adv = np.zeros((batch, sum(sizes) * n_atoms), np.float32)
    adv[0, 1] = np.inf
    q = _cuda.device_array((batch, len(sizes), max(sizes)), np.float32)
    lse = _cuda.device_array((batch, len(sizes), max(sizes)), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dueling_forward(_cuda.to_device(value), _cuda.to_device(adv), layout, stream(), lse=lse, q=q)
    got = q.copy_to_host()
    assert np.isnan(got[0, 0, :3]).any() and np.all(np.isfinite(got[1, :, :2]))


def test_metric_cells_of_printed_tables():
    assert trainer.metric_cell("n_trades", 3) == "3" and trainer.metric_cell("n_trades", 1234.0) == "1,234"
    assert trainer.metric_cell("sharpe", 1.23456) == "1.2346"
    assert trainer.metric_cell("sharpe", None) == "n/a" and trainer.metric_cell("calmar", float("nan")) == "n/a"
    assert trainer.metrics_dict(type("M", (), {"policy": lambda self, p: ({"n_trades": 3.0}, {})})())["n_trades"] == 3


def test_val_test_gap_per_fold():
    from numbarl.run.trainer import val_test_gap

    gap = val_test_gap({"sharpe": 3.0, "daily_sharpe": 2.0, "win_rate": 0.6, "total_return": None},
                       {"sharpe": 1.0, "daily_sharpe": 2.5, "win_rate": 0.5, "total_return": 0.1})
    assert gap["sharpe"] == 2.0 and gap["daily_sharpe"] == -0.5 and abs(gap["win_rate"] - 0.1) < 1e-12
    assert gap["total_return"] is None and gap["sharpe_adj"] is None  # undefined on either side: no gap


def test_every_evaluation_window_resets_the_agents_carried_state(monkeypatch):
    """The agent contract's reset_eval runs before each backtest window (a recurrent agent must not
    carry state from validation into test); the backtest gets the agent's scores."""
    import types

    from numbarl.env import backtest as backtest_module
    from numbarl.run.trainer import FoldTrainer

    calls = []
    agent = types.SimpleNamespace(reset_eval=lambda s: calls.append("reset"), scores=object())
    monkeypatch.setattr(backtest_module, "backtest", lambda *a, **k: calls.append(("backtest", k["q_fn"])) or "r")
    ft = types.SimpleNamespace(agent=agent, cfg=types.SimpleNamespace(env=None), market=None, stream=None)
    assert FoldTrainer.evaluate(ft, (0, 10)) == "r"
    assert FoldTrainer.evaluate(ft, (10, 20)) == "r"
    assert calls == ["reset", ("backtest", agent.scores), "reset", ("backtest", agent.scores)]


def test_the_progress_bar_never_moves_back():
    """A phase timed for the first time (here the first checkpoint, slower than the steps) raises
    the estimate of the time left: the ETA shows it, the bar waits instead of jumping back (it went
    50% -> 43% in a review run)."""
    now = [0.0]
    p = trainer.Progress(quiet=True, clock=lambda: now[0])
    p.plan(steps=10, checkpoints=2)
    p.done("step", 5, 5.0)
    now[0] = 5.0
    assert p.bar(width=10) == "[#####-----]  50%"  # 5 s spent, 5 steps left at 1 s: half way
    p.done("checkpoint", 1, 20.0)  # a checkpoint costs 20 s: 5 s of steps + 20 s of checkpoint left
    assert p.eta() == "0m25s"
    assert p.bar(width=10) == "[#####-----]  50%"  # the estimate says 5 / 30 = 17%: the bar does not go back
    now[0] = 40.0
    assert p.bar(width=10) == "[######----]  62%"  # 40 / 65: moving on again
