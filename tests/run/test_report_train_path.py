"""The report's "Training path vs validation" section from a fabricated metrics.jsonl: records of
kind "train_path" (numbarl.env.telemetry.epoch_record's keys) beside the "val" records."""

import html
import json
import re

import pytest

from numbarl.run import report
from numbarl.run.runio import RunDir

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TERMS = ("trade", "micro", "holding", "churn", "opportunity", "dsr")


def train_path_record(fold, epoch, sharpe, snr=None, **extra):
    record = {"kind": "train_path", "fold": fold, "epoch": epoch, "train_path.n_bars": 4096,
              "train_path.sharpe": sharpe, "train_path.n_trades": 37, "train_path.win_rate": 0.5,
              "train_path.avg_trade": 1.25, "train_path.trade_sharpe": 0.1}
    for j, term in enumerate(TERMS):
        value = None if snr is None else snr + j
        record |= {f"reward.{term}.mean": 0.01 * (j + 1), f"reward.{term}.std": 0.1, f"reward.{term}.snr": value}
    return record | extra


def append_raw(run, records):
    """metrics.jsonl lines written as the trainer's run.log writes them (json, null for undefined)."""
    with open(run.metrics_path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(record, allow_nan=False) + "\n" for record in records)


def section(text, title):
    start = text.index(f"<h2>{title}")
    end = text.find("<h2>", start + 4)
    return text[start : end if end >= 0 else len(text)]


def tables(text):
    """Each <table> in `text` as a list of rows of unescaped cell texts."""
    return [
        [[html.unescape(c) for c in re.findall(r"<t[dh][^>]*>([^<]*)</t[dh]>", row)] for row in re.findall(r"<tr>(.*?)</tr>", t)]
        for t in re.findall(r"<table>(.*?)</table>", text, flags=re.DOTALL)
    ]


def test_train_path_rows_join_validation_by_fold_and_epoch():
    records = [
        {"kind": "train", "fold": 0, "epoch": 1, "step": 4, "loss": 1.0},
        {"kind": "val", "fold": 0, "epoch": 1, "step": 8, "sharpe": 2.0},
        train_path_record(0, 1, 3.0),  # ratio 1.5: within 2x
        {"kind": "val", "fold": 0, "epoch": 2, "step": 16, "sharpe": 1.0},
        train_path_record(0, 2, 9.0),
        train_path_record(0, 2, 2.5),  # logged again (resume): the last one wins -> ratio 2.5, not within
        train_path_record(1, 1, None),  # undefined train Sharpe, no val record
        {"kind": "val", "fold": 1, "epoch": 2, "step": 40, "sharpe": -1.0},
        train_path_record(1, 2, -1.5),  # both negative: a ratio, but not the goal
        {"kind": "val", "fold": 1, "epoch": 3, "step": 48, "sharpe": 0.0},
        train_path_record(1, 3, 1.0),  # val Sharpe 0: no ratio, not within
    ]
    rows = report.train_path_rows(records)
    got = [(r["fold"], r["epoch"], r["train_path.sharpe"], r["val_sharpe"], r["train_over_val"], r["within_goal"]) for r in rows]
    assert got == [
        (0, 1, 3.0, 2.0, pytest.approx(1.5), True),
        (0, 2, 2.5, 1.0, pytest.approx(2.5), False),
        (1, 1, None, None, None, None),
        (1, 2, -1.5, -1.0, pytest.approx(1.5), False),
        (1, 3, 1.0, 0.0, None, False),
    ]
    assert report.reward_terms(rows) == list(TERMS)
    assert report.train_path_rows([r for r in records if r["kind"] != "train_path"]) == []


def test_report_shows_training_path_beside_validation(tmp_path):
    run = RunDir.create(tmp_path / "run", {"train": {"epochs": 2}})
    for fold in range(2):
        for epoch in (1, 2):
            step = 10 * (2 * fold + epoch)
            run.log({"kind": "train", "fold": fold, "epoch": epoch, "step": step - 5, "loss": 0.5, "q_mean": 0.1, "epsilon": 0.3})
            run.log({"kind": "val", "fold": fold, "epoch": epoch, "step": step, "sharpe": 1.0 + epoch})
            append_raw(run, [train_path_record(fold, epoch, 2.0 * (1.0 + epoch) + fold, snr=0.5 * epoch)])
    html_path, png_path = report.write_report(run.path)
    assert png_path.read_bytes().startswith(PNG_SIGNATURE)
    text = section(html_path.read_text(encoding="utf-8"), "Training path vs validation")
    assert "No training-path records" not in text
    sharpe, snr, last = tables(text)
    assert sharpe[0][:6] == ["fold", "epoch", "train-path Sharpe", "validation Sharpe", "train / val", "within 2×"]
    body = {(row[0], row[1]): row for row in sharpe[1:]}
    assert len(body) == 4
    # fold 0 epoch 1: train 4, val 2 -> ratio 2 (the edge of the goal: within); fold 1 epoch 1: 5 / 2
    assert body[("0", "1")][2:6] == [report.format_value(4.0), report.format_value(2.0), report.format_value(2.0), "yes"]
    assert body[("1", "1")][2:6] == [report.format_value(5.0), report.format_value(2.0), report.format_value(2.5), "no"]
    assert body[("0", "2")][6] == "37"  # trades
    assert snr[0] == ["fold", "epoch", *TERMS]
    snr_body = {(row[0], row[1]): row[2:] for row in snr[1:]}
    assert snr_body[("1", "2")] == [report.format_value(1.0 + j) for j in range(len(TERMS))]
    assert last[0] == ["fold", "epoch", "term", "mean", "std", "SNR"] and len(last) == 1 + 2 * len(TERMS)
    assert last[1][:3] == ["0", "2", "trade"] and last[-1][:3] == ["1", "2", "dsr"]


def test_report_without_train_path_records_says_so(tmp_path):
    run = RunDir.create(tmp_path / "run", {"a": 1})
    run.log({"kind": "val", "fold": 0, "epoch": 1, "step": 1, "sharpe": 0.3})
    html_path, png_path = report.write_report(run.path)
    assert png_path.read_bytes().startswith(PNG_SIGNATURE)
    text = section(html_path.read_text(encoding="utf-8"), "Training path vs validation")
    assert 'No training-path records (kind "train_path")' in text and "<table>" not in text


def test_report_shows_learning_diagnostics_and_the_feedback_records(tmp_path):
    """One row per epoch from its LAST train record (Q statistics, atom utilization, a norm per
    optimizer group), then the feedback switches' records."""
    run = RunDir.create(tmp_path / "run", {"train": {"epochs": 2}})
    for epoch in (1, 2):
        for k in range(2):  # two log reads per epoch: the second one is the epoch's
            run.log({"kind": "train", "fold": 0, "epoch": epoch, "step": 10 * epoch + k, "loss": 2.0 - 0.1 * k,
                     "q_mean": 0.1 * epoch + k, "q_std": 0.3, "atom_utilization": 0.5 + 0.1 * k,
                     "grad_norm.trunk": 1.5, "grad_norm.head.adv": 0.25})
        run.log({"kind": "val", "fold": 0, "epoch": epoch, "step": 10 * epoch + 5, "sharpe": 1.0})
        run.log({"kind": "feedback", "fold": 0, "epoch": epoch, "step": 10 * epoch + 5, "e2.epsilon": 0.3 * epoch,
                 "e3.gamma": 0.97, "e9.tau_0": -1.0})
    html_path, _ = report.write_report(run.path)
    text = section(html_path.read_text(encoding="utf-8"), "Learning diagnostics")
    diag, feedback = tables(text)
    header = diag[0]
    assert header[:3] == ["fold", "epoch", "loss"] and "atom util." in header and "‖g‖ trunk" in header
    row = dict(zip(header, diag[2]))  # epoch 2's last read
    assert row["epoch"] == "2" and row["Q mean"] == report.format_value(1.2) and row["atom util."] == report.format_value(0.6)
    assert row["‖g‖ head.adv"] == report.format_value(0.25) and "IQN loss" not in header  # never logged: no column
    assert feedback[0] == ["fold", "epoch", "e2.epsilon", "e3.gamma"] and feedback[2][2] == report.format_value(0.6)
