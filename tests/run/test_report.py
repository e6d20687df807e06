"""Run report: hand-computed helpers, and report.png + report.html from synthetic run folders."""

import base64
import html
import re

import numpy as np
import pandas as pd
import pytest

from numbarl.run import report
from numbarl.run.runio import RunDir

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
METRIC_NAMES = ("total_return", "sharpe", "sortino", "max_drawdown", "win_rate", "profit_factor", "avg_hold")


# ----------------------------------------------------------------------------------------------
# helpers, hand-computed
# ----------------------------------------------------------------------------------------------


def test_stitch_equity_hand_computed():
    curve = report.stitch_equity({1: {"pnl": np.array([-1.0, 0.5])}, 0: {"pnl": np.array([1.0, -2.0, 3.0])}})
    np.testing.assert_allclose(curve["equity"], [1.0, -1.0, 2.0, 1.0, 1.5])
    # peak starts at the capital before the first bar (0): [1, 1, 2, 2, 2]
    np.testing.assert_allclose(curve["drawdown"], [0.0, -2.0, 0.0, -1.0, -0.5])
    assert curve["starts"].tolist() == [0, 3] and curve["labels"] == ["F0", "F1"]
    losing_start = report.stitch_equity({0: {"pnl": np.array([-1.0, np.nan, 2.0])}})
    np.testing.assert_allclose(losing_start["drawdown"], [-1.0, -1.0, 0.0])
    assert report.stitch_equity({}) is None


def test_stitch_equity_matches_a_loop_reference(rng):
    segments = {fold: {"pnl": rng.normal(size=int(rng.integers(1, 40)))} for fold in range(3)}
    curve = report.stitch_equity(segments)
    equity, peak, expected = 0.0, 0.0, []
    for fold in range(3):
        for value in segments[fold]["pnl"]:
            equity += value
            peak = max(peak, equity)
            expected.append(equity - peak)
    np.testing.assert_allclose(curve["drawdown"], expected, atol=1e-12, rtol=1e-12)


def test_trade_stats_hand_computed():
    trades = pd.DataFrame({"pnl": [2.0, -1.0, 3.0, -1.0, 0.0], "bars_held": [1, 2, 3, 4, 5]})
    stats = report.trade_stats(trades)
    assert stats == pytest.approx(
        {
            "trades": 5,
            "win_rate": 0.4,
            "avg_trade": 0.6,
            "avg_win": 2.5,
            "avg_loss": -1.0,
            "profit_factor": 2.5,
            "total_pnl": 3.0,
            "avg_hold": 3.0,
        }
    )
    assert report.trade_stats(pd.DataFrame({"pnl": [1.0, 2.0]}))["profit_factor"] is None  # no losses
    assert report.trade_stats(pd.DataFrame()) == {"trades": 0}
    assert report.trade_stats(pd.DataFrame({"entry": [1]})) is None
    assert report.trade_stats(None) is None


def test_format_value():
    assert report.format_value(None) == "—"
    assert report.format_value(float("nan")) == "—"
    assert report.format_value(np.float32(np.inf)) == "—"
    assert report.format_value(np.int64(12)) == "12"
    assert report.format_value(1.23456) == "1.235"
    assert report.format_value(-0.0431) == "-0.0431"
    assert report.format_value(123.456) == "123.5"
    assert report.format_value(123456.7) == "123,457"
    assert report.format_value(2.5e-5) == "2.50e-05"
    assert report.format_value(0.0) == "0"
    assert report.format_value("f0-e3") == "f0-e3"


def test_metric_rows_and_split_means():
    summary = {
        "seed": 1,
        "folds": {
            "1": {
                "val": {"sharpe": 2.0, "trades": 3},
                "test": {"sharpe": None, "trades": 4},
                "bars_per_day": 10.5,
            },
            "0": {
                "test": {"sharpe": 1.0, "trades": 6},
                "val": {"sharpe": float("nan"), "trades": 4},
                "note": "x",
            },
        },
    }
    rows, facts = report.metric_rows(summary)
    assert [(fold, split) for fold, split, _ in rows] == [(0, "val"), (0, "test"), (1, "val"), (1, "test")]
    assert facts == [(0, {"note": "x"}), (1, {"bars_per_day": 10.5})]
    means = report.split_means(rows)
    assert means["test"] == {"sharpe": 1.0, "trades": 5}
    assert isinstance(means["test"]["trades"], int)
    assert means["val"]["sharpe"] == 2.0 and means["val"]["trades"] == 3.5
    assert report.metric_rows(None) == ([], [])


# ----------------------------------------------------------------------------------------------
# whole reports
# ----------------------------------------------------------------------------------------------


def make_run(path, rng, n_folds=2, with_trades=True, finished=True):
    run = RunDir.create(
        path,
        {"train": {"epochs": 3, "lr": 0.000321}, "data": {"source": "synthetic"}},
        {"seed": 17, "device": "numba CUDA simulator (CPU)"},
    )
    step = 0
    folds = []
    for fold in range(n_folds):
        for epoch in range(3):
            for _ in range(25):
                step += 4
                run.log(
                    {
                        "kind": "train",
                        "fold": fold,
                        "epoch": epoch,
                        "step": step,
                        "loss": 1.0 / step + rng.random(),
                        "q_mean": rng.normal(),
                        "epsilon": max(0.05, 1.0 - step / 200),
                    }
                )
            run.log({"kind": "val", "fold": fold, "epoch": epoch, "step": step, "sharpe": rng.normal()})
        for split in ("val", "test"):
            bars = int(rng.integers(150, 400))
            run.write_equity(
                split,
                fold,
                {
                    "pnl": rng.normal(0.01, 1.0, bars),
                    "position": rng.choice([-1.0, 1.0], bars),
                    "timestamps": 1_700_000_000_000_000_000 + np.arange(bars) * 60 * 10**9,
                },
            )
            columns = {"entry_bar": [], "exit_bar": [], "pnl": [], "bars_held": []}
            if with_trades:
                n = int(rng.integers(20, 60))
                columns = {
                    "entry_bar": np.arange(n) * 3,
                    "exit_bar": np.arange(n) * 3 + 2,
                    "pnl": rng.normal(0.1, 2.0, n),
                    "bars_held": rng.integers(1, 9, n),
                }
            run.write_trades(split, pd.DataFrame(columns), fold=fold)
        folds.append(
            {
                "fold": fold,
                "bars_per_day": 411.25,
                "val": {name: float(rng.normal()) for name in METRIC_NAMES}
                | {"trades": int(rng.integers(1, 99))},
                "test": {name: float(rng.normal()) for name in METRIC_NAMES}
                | {"trades": int(rng.integers(1, 99))},
            }
        )
    run.write_csv()
    if finished:
        run.write_summary({"folds": folds, "seed": 17, "numbarl_version": "0.1.0"})
    return run, folds


def html_text(path):
    return path.read_text(encoding="utf-8")


def embedded_png(text):
    match = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert match, "report.html has no embedded PNG"
    return base64.b64decode(match.group(1))


def section(text, title):
    """The HTML between <h2>title...</h2> and the next <h2>."""
    start = text.index(f"<h2>{title}")
    end = text.find("<h2>", start + 4)
    return text[start : end if end >= 0 else len(text)]


def table_rows(text):
    """Each <tr> of the tables in `text` as a list of unescaped cell texts."""
    return [
        [html.unescape(c) for c in re.findall(r"<t[dh][^>]*>([^<]*)</t[dh]>", row)]
        for row in re.findall(r"<tr>(.*?)</tr>", text)
    ]


def test_report_with_trades(tmp_path, rng):
    run, folds = make_run(tmp_path / "run", rng, n_folds=2, with_trades=True)
    html_path, png_path = report.write_report(run.path)
    assert html_path == run.path / "report.html" and png_path == run.path / "report.png"
    png = png_path.read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 50_000
    text = html_text(html_path)
    assert embedded_png(text) == png  # self-contained: the very same image, no external file
    per_fold = table_rows(section(text, "Metrics per fold and split"))
    header = per_fold[0]
    assert header[:2] == ["fold", "split"] and set(header[2:]) == set(METRIC_NAMES) | {"trades"}
    assert len(per_fold) == 1 + 4 + 1 + 2  # header, fold x split rows, facts header, one facts row per fold
    for index, (fold, split) in enumerate([(0, "val"), (0, "test"), (1, "val"), (1, "test")]):
        row = dict(zip(header, per_fold[1 + index], strict=True))
        assert row["fold"] == str(fold) and row["split"] == report.SPLIT_LABELS[split]
        for name, value in folds[fold][split].items():
            assert row[name] == report.format_value(value), (fold, split, name)
    assert per_fold[-3:] == [["fold", "bars_per_day"], ["0", report.format_value(411.25)], ["1", "411.2"]]

    headline = {row[0]: row[1:] for row in table_rows(section(text, "Headline"))}
    mean_sharpe = np.mean([f["test"]["sharpe"] for f in folds])
    assert headline["Sharpe (ann.)"][1] == report.format_value(float(mean_sharpe))  # mean over folds

    trades = run.read_trades("test")
    trade_table = {row[0]: row[1:] for row in table_rows(section(text, "Trades"))}
    test_row = trade_table[report.SPLIT_LABELS["test"]]
    assert test_row[0] == str(len(trades)) and test_row[6] == report.format_value(float(trades["pnl"].sum()))
    assert "0.000321" in section(text, "Config")
    assert "numba CUDA simulator (CPU)" in section(text, "Run")
    assert "No trades" not in text


def test_report_without_trades_says_so(tmp_path, rng):
    run, folds = make_run(tmp_path / "run", rng, n_folds=1, with_trades=False)
    html_path, png_path = report.write_report(run)
    assert png_path.read_bytes().startswith(PNG_SIGNATURE)
    text = html_text(html_path)
    assert "No trades in the test (out-of-sample) window(s)." in text
    assert "No trades in the validation window(s)." in text
    per_fold = table_rows(section(text, "Metrics per fold and split"))
    test_row = dict(zip(per_fold[0], per_fold[2], strict=True))
    assert test_row["split"] == report.SPLIT_LABELS["test"]
    assert test_row["sharpe"] == report.format_value(folds[0]["test"]["sharpe"])


def test_report_of_a_run_in_progress(tmp_path, rng):
    run = RunDir.create(tmp_path / "run", {"a": 1})
    run.log({"kind": "train", "step": 1, "loss": float("nan")})  # a series with no finite value
    html_path, png_path = report.write_report(run.path)
    assert png_path.read_bytes().startswith(PNG_SIGNATURE)
    text = html_text(html_path)
    assert (
        "No summary yet" in text and "No trade lists saved yet." in text and "No checkpoints saved." in text
    )
    assert "in progress" in text
    assert [p.name for p in run.path.iterdir() if p.name.startswith(".")] == []  # no temp files
