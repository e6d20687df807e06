"""Pooled out-of-sample metrics (issue 12): the headline of a multi-fold run is the metrics of the
folds' windows concatenated (bar level and trade level), checked against a computation written
here from the definitions (numpy, no numbarl metric code), on hand-made windows and on a real
3-fold run, whose folds must use the newest sessions."""

import json
import math

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from numbarl.run.pooled import pooled_metrics
from numbarl.run.runio import RunDir

CAPITAL = 100_000.0
BARS_PER_DAY = 40.0


def independent(windows, trades: pd.DataFrame, bars_per_day: float, capital: float) -> dict:
    """The metrics of windows [(pnl, position, session_id)] traded one after another, from the
    definitions: equity_t = capital + Σ pnl, r_t = pnl_t / equity_{t-1}, sessions of different
    windows never merged, trades pooled."""
    pnl = np.concatenate([w[0] for w in windows]).astype(np.float64)
    position = np.concatenate([w[1] for w in windows])
    equity = capital + np.cumsum(pnl)
    before = np.concatenate([[capital], equity[:-1]])
    r = pnl / before
    out = {"total_return": equity[-1] / capital - 1.0,
           "sharpe": r.mean() / r.std(ddof=1) * math.sqrt(bars_per_day * 252),
           "max_drawdown": float(np.min(equity / np.maximum.accumulate(np.maximum(equity, capital)) - 1.0)),
           "exposure": float(np.mean(position != 0))}
    session_returns, offset = [], 0
    for window_pnl, _, sid in windows:  # each window's sessions on their own
        for s in np.unique(sid):
            rows = np.flatnonzero(sid == s) + offset
            start = capital + (pnl[: rows[0]].sum() if rows[0] else 0.0)
            session_returns.append((start + pnl[rows].sum()) / start - 1.0)
        offset += len(window_pnl)
    session_returns = np.asarray(session_returns)
    out["daily_sharpe"] = session_returns.mean() / session_returns.std(ddof=1) * math.sqrt(252)
    t = trades["pnl"].to_numpy(np.float64)
    out.update({"n_trades": len(t), "win_rate": float(np.mean(t > 0)), "avg_trade": float(t.mean()),
                "profit_factor": t[t > 0].sum() / -t[t < 0].sum(),
                "avg_hold": float(np.mean(trades["exit_bar"] - trades["entry_bar"]))})
    return out


def _check(got: dict, want: dict):
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_pooled_metrics_are_those_of_the_concatenated_windows(tmp_path, rng):
    run = RunDir.create(tmp_path / "run", {"x": 1})
    windows, trade_frames = [], []
    # fold 1's window starts in the session fold 0's ends in (validation windows overlap when
    # val_sessions > test_sessions): pooled, they stay two sessions
    sessions = {0: [5, 5, 6, 6], 1: [6, 7, 7, 7], 2: [8, 8, 9, 9]}
    n_trades = {0: 1, 1: 9, 2: 4}
    bar = 0
    for fold, per_session in sessions.items():
        sid = np.repeat(per_session, 12)
        pnl = rng.normal(3.0, 40.0, len(sid))
        pnl[0] = 0.0
        position = rng.choice([-1.0, 0.0, 0.5, 1.0], len(sid))
        run.write_equity("test", fold, {"pnl": pnl, "position": position, "session_id": sid})
        windows.append((pnl, position, sid))
        entry = np.sort(rng.choice(len(sid) - 5, n_trades[fold], replace=False)) + bar
        frame = pd.DataFrame({"policy": 0, "entry_bar": entry, "exit_bar": entry + rng.integers(1, 5, len(entry)),
                              "side": 1, "size": 1.0, "entry_price": 100.0, "exit_price": 101.0,
                              "pnl": rng.normal(5.0, 30.0, len(entry)) if fold else [25.0],
                              "exit_reason": "close"})
        if fold == 1:
            frame.loc[1:, "pnl"] = -np.abs(frame.loc[1:, "pnl"])  # 1 winner of 9
        run.write_trades("test", frame.assign(fold=fold), fold=fold)
        trade_frames.append(frame)
        bar += len(sid)
    metrics = pooled_metrics(run, "test", BARS_PER_DAY, CAPITAL)
    got, _ = metrics.policy(0)
    want = independent(windows, pd.concat(trade_frames), BARS_PER_DAY, CAPITAL)
    _check(got, want)
    # the old headline, the mean of per-fold win rates, is not the track record's
    per_fold = [float(np.mean(f["pnl"] > 0)) for f in trade_frames]
    assert abs(np.mean(per_fold) - got["win_rate"]) > 0.2
    assert pooled_metrics(run, "val", BARS_PER_DAY, CAPITAL) is None  # no window of that split saved


# ---------------------------------------------------------------------------------------------
# a real 3-fold run
# ---------------------------------------------------------------------------------------------
THREE_FOLDS = ["--preset", "tiny", "--quiet", "--set", "data.synth_bars_per_day=30",
               "--set", "train.collect_steps_per_epoch=4", "--set", "train.log_interval=2",
               "--set", "train.learning_starts=3", "--set", "data.synth_sessions=9", "--folds", "3", "--epochs", "1"]


@pytest.fixture(scope="module")
def three_fold_run(tmp_path_factory):
    from numbarl.cli import train_cmd

    out = tmp_path_factory.mktemp("three") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NUMBARL_CACHE", str(tmp_path_factory.mktemp("cache")))
        r = CliRunner().invoke(train_cmd, [*THREE_FOLDS, "--out", str(out)], catch_exceptions=True)
    assert r.exit_code == 0, r.output + repr(r.exception)
    return out


def test_three_fold_headline_is_the_pooled_test_windows_of_the_newest_sessions(three_fold_run):
    summary = json.loads((three_fold_run / "summary.json").read_text())
    folds = summary["folds"]
    # tiny preset: 4 train + 1 validation + 1 test sessions, folds 1 test session apart: 8 of the 9
    # sessions, anchored on the newest (the oldest, session 0, is the one left out)
    assert [f["window"]["test_sessions"] for f in folds] == [[6, 7], [7, 8], [8, 9]]
    assert folds[0]["window"]["train_sessions"] == [1, 5]
    # the headline: the pooled test windows, recomputed here from the run's own per-bar and trade files
    run = RunDir.open(three_fold_run)
    equity = run.read_equity("test")
    windows = [(a["pnl"], a["position"], a["session_id"]) for _, a in sorted(equity.items())]
    assert [len(w[0]) for w in windows] == [f["window"]["test"][1] - f["window"]["test"][0] for f in folds]
    trades = run.read_trades("test")
    want = independent(windows, trades, summary["bars_per_day"], CAPITAL)
    headline = summary["headline"]
    assert headline["folds"] == 3 and headline["split"] == "test"
    _check({k: v for k, v in headline.items() if k in want}, {k: want[k] for k in headline if k in want})
    _check(summary["pooled"]["test"], want)
    assert "sharpe_adj" in headline  # beside the daily Sharpe (None only where undefined)
    assert summary["pooled"]["test"]["n_trades"] == sum(f["test"]["n_trades"] for f in folds)
    # the report leads with the pooled numbers, per-fold rows beside them
    page = (three_fold_run / "report.html").read_text()
    assert "Headline (3 folds&#x27; windows pooled)" in page and "Metrics per fold and split" in page
    assert page.index("Daily Sharpe (ann.)") < page.index("Sharpe adj. (Lo 2002)") < page.index(">Sharpe (ann.)<")
