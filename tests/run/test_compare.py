"""numbarl-compare: rows per (run, fold) from summary.json, the spread, config differences, errors."""

import json
import statistics

import pytest
from click.testing import CliRunner

from numbarl.cli import compare_cmd
from numbarl.run import compare
from numbarl.run.runio import RunDir, RunError


def _run(tmp_path, name, seed, tests, lr=1e-3, oracle=200.0):
    """A finished run folder whose folds have the given test Sharpe ratios."""
    run = RunDir.create(tmp_path / name, {"preset": "default", "agent": {"lr": lr}, "train": {"seed": seed}})
    folds = []
    for i, t in enumerate(tests):
        folds.append({"fold": i, "seed": seed + 1000 * i, "best_checkpoint": f"fold{i}-epoch{i + 3:04d}",
                      "val": {"sharpe": t + 10.0}, "test": {"sharpe": t, "total_return": t / 1000,
                                                             "n_trades": 100.0, "max_drawdown": -0.01},
                      "oracle_test": {"sharpe": oracle}})
    run.write_summary({"folds": folds, "seed": seed})
    return run


def test_rows_spread_and_identical_configs(tmp_path):
    runs = [_run(tmp_path, "s0", 0, [64.4]), _run(tmp_path, "s1", 1, [-18.1]), _run(tmp_path, "s2", 2, [102.2, 114.2])]
    rows = compare.compare_rows(runs)
    assert [(r["run"], r["fold"]) for r in rows] == [("s0", 0), ("s1", 0), ("s2", 0), ("s2", 1)]
    assert rows[3]["seed"] == 1002 and rows[3]["best_epoch"] == 4
    assert rows[1]["test_over_oracle"] == pytest.approx(-18.1 / 200.0)
    spread = compare.summarize(rows)
    values = [64.4, -18.1, 102.2, 114.2]
    assert spread["test_sharpe"]["mean"] == pytest.approx(statistics.fmean(values))
    assert spread["test_sharpe"]["std"] == pytest.approx(statistics.stdev(values))
    assert spread["test_sharpe"]["median"] == pytest.approx(83.3)
    assert spread["test_sharpe"]["min"] == -18.1 and spread["test_sharpe"]["max"] == 114.2
    assert spread["positive_test_sharpe"] == {"count": 3, "of": 4}
    assert compare.config_differences(runs) == {}
    text = compare.main([str(r.path) for r in runs])
    assert "configs identical apart from the seed" in text and "positive test Sharpe: 3 of 4" in text
    assert "-18.10" in text and "n=4" in text and "sample std" in text


def test_config_differences_and_missing_oracle(tmp_path):
    a = _run(tmp_path, "a", 0, [1.0])
    b = _run(tmp_path, "b", 0, [2.0], lr=3e-4)
    summary = b.read_summary()
    del summary["folds"][0]["oracle_test"]
    b.write_summary(summary)
    assert compare.config_differences([a, b]) == {"agent.lr": [1e-3, 3e-4]}
    rows = compare.compare_rows([a, b])
    assert rows[1]["oracle_sharpe"] is None and rows[1]["test_over_oracle"] is None
    out = json.loads(compare.main([str(a.path), str(b.path)], as_json=True))
    assert out["config_differences"] == {"agent.lr": [1e-3, 3e-4]}
    assert out["spread"]["test_over_oracle"]["n"] == 1


def test_fields_saved_in_two_spellings_compare_by_meaning(tmp_path):
    """A run saved before feature names (regime columns as indices, synth_regime_bars 40) and one after (names,
    0 = the mode's own) of the same market and options do not differ; another regime length does."""
    old = RunDir.create(tmp_path / "old", {"agent": {"regime_gate_cols": "53,9,10,11,12", "regime_dropout_col": 53},
                                           "data": {"synth_mode": "memory", "synth_regime_bars": 40.0}})
    new = RunDir.create(tmp_path / "new", {"agent": {"regime_gate_cols": "adx_14,rv_8,rv_32,rv_128,rv_ratio",
                                                     "regime_dropout_col": "adx_14"},
                                           "data": {"synth_mode": "memory", "synth_regime_bars": 0.0}})
    assert compare.config_differences([old, new]) == {}
    walk = RunDir.create(tmp_path / "walk", {"agent": {"regime_gate_cols": "adx_14,rv_8,rv_32,rv_128,rv_ratio",
                                                       "regime_dropout_col": "adx_14"},
                                             "data": {"synth_mode": "regime_walk", "synth_regime_bars": 0.0}})
    assert compare.config_differences([new, walk]) == {"data.synth_mode": ["memory", "regime_walk"],
                                                       "data.synth_regime_bars": [40.0, 200.0]}


def test_head_pad_compares_by_what_the_run_ran(tmp_path):
    """agent.head_pad: a TF32 run saved before the field (unpadded, config.LEGACY) equals one saved with 1, and
    differs from today's automatic 0 (64 under TF32); in fp32 the automatic 0 equals 1."""
    old = RunDir.create(tmp_path / "old", {"agent": {"compute": "tf32"}})
    one = RunDir.create(tmp_path / "one", {"agent": {"compute": "tf32", "head_pad": 1}})
    auto = RunDir.create(tmp_path / "auto", {"agent": {"compute": "tf32", "head_pad": 0}})
    fp32 = [RunDir.create(tmp_path / f"f{p}", {"agent": {"compute": "fp32", "head_pad": p}}) for p in (0, 1)]
    assert compare.config_differences([old, one]) == {}
    assert compare.config_differences([one, auto]) == {"agent.head_pad": [1, 64]}
    assert compare.config_differences(fp32) == {}


def test_unfinished_run_and_non_run_are_clear_errors(tmp_path):
    unfinished = RunDir.create(tmp_path / "u", {"train": {"seed": 0}})
    with pytest.raises(RunError, match="has no summary.json"):
        compare.compare_rows([unfinished])
    (tmp_path / "plain").mkdir()
    result = CliRunner().invoke(compare_cmd, [str(tmp_path / "plain")])
    assert result.exit_code == 2
    assert "not a numbarl run folder" in result.output
    result = CliRunner().invoke(compare_cmd, [str(unfinished.path)])
    assert result.exit_code == 2 and "has no summary.json" in result.output
    odd = _run(tmp_path, "odd", 0, [1.0])
    odd.summary_path.write_text('{"folds": {"0": 1}}')
    with pytest.raises(RunError, match="not a numbarl summary"):
        compare.compare_rows([odd])
    done = _run(tmp_path, "d", 0, [1.0])
    result = CliRunner().invoke(compare_cmd, [str(done.path), str(tmp_path / "." / "d")])
    assert result.exit_code == 2 and "is listed twice" in result.output, result.output


def test_a_multi_fold_run_gets_a_pooled_row_outside_the_spread(tmp_path):
    run = _run(tmp_path, "three", 0, [10.0, 20.0, 30.0])
    summary = run.read_summary()
    summary["pooled"] = {"test": {"sharpe": 18.5, "daily_sharpe": 1.2, "total_return": 0.05, "n_trades": 300},
                         "val": {"sharpe": 25.0}, "oracle_test": {"sharpe": 150.0}}
    run.write_summary(summary)
    rows = compare.compare_rows([run])
    assert [r["fold"] for r in rows] == [0, 1, 2, "pooled"]
    pooled = rows[-1]
    assert pooled["test_sharpe"] == 18.5 and pooled["test_daily_sharpe"] == 1.2 and pooled["test_trades"] == 300
    assert pooled["test_over_oracle"] == pytest.approx(18.5 / 150.0) and pooled["val_sharpe"] == 25.0
    spread = compare.summarize(rows)
    assert spread["test_sharpe"]["n"] == 3 and spread["test_sharpe"]["mean"] == pytest.approx(20.0)
    assert "pooled" in compare.main([str(run.path)])


def test_a_fold_held_flat_by_the_deployment_rule_counts_as_zero(tmp_path):
    """train.deploy_min_trade_t held fold 1's test window flat: its own Sharpe is undefined (zero variance), but it
    earned exactly 0, so the table counts it as 0 in the means and the positive count instead of leaving it out."""
    run = _run(tmp_path, "r", 0, [50.0, 30.0])
    summary = run.read_summary()
    summary["folds"][1].update({"deployed": False, "val_trade_t": 0.4, "deploy_rule": "validation trade t >= 2",
                                "test": {"sharpe": None, "daily_sharpe": None, "total_return": 0.0, "n_trades": 0},
                                "test_policy": {"sharpe": -12.0}})
    summary["pooled"] = {"test": {"sharpe": 20.0, "total_return": 0.05}}  # the folds' windows, the flat one's zeros in
    run.write_summary(summary)
    rows = compare.compare_rows([run])
    assert rows[1]["test_sharpe"] == 0.0 and rows[1]["test_daily_sharpe"] == 0.0 and rows[1]["test_over_oracle"] == 0.0
    assert rows[2]["pooled"] and rows[2]["test_sharpe"] == 20.0  # the pooled row keeps its own (it has no decision)
    spread = compare.summarize(rows)
    assert spread["test_sharpe"]["mean"] == pytest.approx(25.0) and spread["positive_test_sharpe"] == {"count": 1, "of": 2}
    assert compare.deployment({"trade_sharpe": 0.5, "n_trades": 9}, 2.0) == {
        "deployed": False, "val_trade_t": 1.5, "deploy_rule": "validation trade t >= 2"}
    assert compare.deployment({"trade_sharpe": 0.5, "n_trades": 16}, 2.0)["deployed"] is True  # t = 2: the bar itself
    assert compare.deployment({"trade_sharpe": None, "n_trades": 1}, 2.0)["deployed"] is False  # no trade t
    assert compare.deployment({"trade_sharpe": 0.5, "n_trades": 9}, 0.0) is None  # off
