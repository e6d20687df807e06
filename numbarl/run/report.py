"""Run report: `report.png` (one figure) and `report.html` (self-contained) from a run folder.

    html_path, png_path = write_report(run_dir)

What it reads (all written through :class:`numbarl.run.runio.RunDir`) and what it draws:

- `equity/<split>_fold<k>.npz` → equity curves of the validation and test windows, folds
  stitched in order (cumulative sum of per-bar net P&L across folds, fold starts marked), with the
  drawdown (equity − running peak) shaded in a strip underneath.
- `metrics.jsonl` → training curves per fold: loss, Q mean, epsilon against the step (records of
  kind "train" with keys `loss`, `q_mean`, `epsilon`, `step`, `fold`), and the validation Sharpe
  per epoch (records of kind "val" with `sharpe` and `epoch`; the best epoch is starred).
- `metrics.jsonl` → training path vs validation (records of kind "train_path", one per fold and
  epoch, keys of numbarl.env.telemetry.epoch_record: `train_path.sharpe`, `train_path.n_trades`,
  ..., `reward.<term>.mean/.std/.snr`): the training envs' own per-bar Sharpe beside the
  validation Sharpe of the same fold and epoch (dashed in the validation Sharpe panel, a table in
  the HTML with the train / val ratio against the 2x goal), and each reward term's
  signal-to-noise ratio per epoch. Runs without such records (older numbarl) say so.
- `trades_<split>.csv` → histogram of net trade P&L (column `pnl`) of the test trades (validation
  trades when no test was run), wins and losses coloured, with count, win rate, payoff and
  profit factor.
- `summary.json` → headline metrics: the folds' windows of each split POOLED (concatenated into
  one track record, numbarl/run/pooled.py; the daily Sharpe first, the autocorrelation-adjusted
  per-bar Sharpe `sharpe_adj` beside it) and, in the HTML, one metrics row per fold and split
  beside them, plus per-fold facts (bars_per_day, best checkpoint, ...). A summary without pooled
  metrics (written by an older numbarl) falls back to the mean over folds, labelled so.

Every panel degrades to a short note when its input is missing (run still in progress, no trades
in a window, a series not logged), so the report can be rendered at any point of a run. Plots use
matplotlib's Agg canvas directly (no pyplot state, no display needed).
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from numbarl.run.compare import held_flat
from numbarl.run.runio import RunDir, atomic_write_bytes, flatten_record

REPORT_HTML = "report.html"
REPORT_PNG = "report.png"
FIGURE_SIZE = (16.0, 13.5)  # inches
FIGURE_DPI = 110

# metrics.jsonl keys drawn as training curves: (key, panel title, log-scale allowed)
TRAIN_SERIES = (
    ("loss", "Training loss", True),
    ("q_mean", "Q mean", False),
    ("epsilon", "Exploration ε", False),
)
VAL_SCORE_KEYS = ("sharpe", "metrics.sharpe", "val.sharpe")  # first present is the val Sharpe
TRADE_PNL_KEYS = ("pnl", "net_pnl", "trade_pnl")  # first present column is a trade's net P&L
TRADE_HOLD_KEYS = ("bars_held", "hold_bars", "duration_bars")  # optional holding time in bars
TRAIN_PATH_KIND = "train_path"  # metrics.jsonl records of the training envs' own results
TRAIN_PATH_SHARPE = "train_path.sharpe"
TRAIN_VAL_GOAL = 2.0  # the training-path Sharpe should be within this factor of the validation one
TRAIN_PATH_COLUMNS = (  # (record key, table header) beside the two Sharpes
    ("train_path.n_trades", "trades"),
    ("train_path.win_rate", "win rate"),
    ("train_path.avg_trade", "avg trade"),
    ("train_path.trade_sharpe", "trade Sharpe"),
)
SPLIT_ORDER = ("train", "val", "test", "test_policy", "oracle_test", "hold_test")
SPLIT_LABELS = {"train": "train", "val": "validation", "test": "test (out-of-sample)",
                "test_policy": "policy's own test (not deployed: train.deploy_min_trade_t)",
                "oracle_test": "oracle (test windows)", "hold_test": "buy and hold (test windows)"}
# headline metrics, in order, when the summary has them: (key, label)
HEADLINE_METRICS = (
    ("daily_sharpe", "Daily Sharpe (ann.)"),
    ("sharpe_adj", "Sharpe adj. (Lo 2002)"),
    ("sharpe", "Sharpe (ann.)"),
    ("total_return", "Total return"),
    ("trade_sharpe", "Per-trade Sharpe"),
    ("sortino", "Sortino"),
    ("max_drawdown", "Max drawdown"),
    ("calmar", "Calmar"),
    ("win_rate", "Win rate"),
    ("profit_factor", "Profit factor"),
    ("avg_trade", "Avg trade"),
    ("n_trades", "Trades"),
    ("trades", "Trades"),
    ("trades_per_day", "Trades / day"),
    ("avg_hold", "Avg hold (bars)"),
    ("exposure", "Exposure"),
    ("turnover", "Turnover"),
)
MAX_HEADLINE_ROWS = 13
NAN_REASONS = "nan_reasons"  # a split's {metric: why it is undefined} in summary.json

COLOR_SPLIT = {"val": "#1f5f99", "test": "#b8322a", "train": "#4d4d4d"}
COLOR_DRAWDOWN = "#c0392b"
COLOR_WIN = "#2e8b57"
COLOR_LOSS = "#c0392b"
COLOR_NOTE = "#7f7f7f"
FOLD_COLORS = ("#1f5f99", "#e07b00", "#2e8b57", "#8e44ad", "#b8322a", "#17a2b8", "#7f6000", "#d63384")
GRID_STYLE = {"color": "#dddddd", "linewidth": 0.6}


# ----------------------------------------------------------------------------------------------
# formatting and data extraction
# ----------------------------------------------------------------------------------------------


def format_value(value) -> str:
    """A metric value as a short string: '—' for missing/non-finite, ints as ints, floats with
    3-4 significant decimals depending on magnitude."""
    if value is None:
        return "—"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if not math.isfinite(value):
            return "—"
        magnitude = abs(value)
        if magnitude == 0.0:
            return "0"
        if magnitude >= 1e4:
            return f"{value:,.0f}"
        if magnitude >= 100:
            return f"{value:.1f}"
        if magnitude >= 1:
            return f"{value:.3f}"
        if magnitude >= 1e-3:
            return f"{value:.4f}"
        return f"{value:.2e}"
    return str(value)


def _is_scalar(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, np.generic))


def metric_rows(summary: dict | None) -> tuple[list[tuple[int, str, dict]], list[tuple[int, dict]]]:
    """([(fold, split, metrics)], [(fold, fold_facts)]) from summary.json.

    `summary["folds"]` is a list of fold dicts (or a dict keyed by fold id). Inside a fold, each
    dict whose values are all scalars is one split's metrics (key = split name); other scalar
    entries (bars_per_day, best_checkpoint, seed, windows) are the fold's facts.
    """
    if not summary:
        return [], []
    folds = summary.get("folds") or []
    if isinstance(folds, dict):
        folds = [dict(value, fold=value.get("fold", key)) for key, value in folds.items()]
    rows, facts = [], []
    for index, fold_record in enumerate(folds):
        if not isinstance(fold_record, dict):
            continue
        fold = fold_record.get("fold", index)
        fold = int(fold) if isinstance(fold, (int, np.integer)) or str(fold).isdigit() else fold
        fold_facts = {}
        for key, value in fold_record.items():
            if key == "fold":
                continue
            if isinstance(value, dict):  # a split's metrics; why a metric is n/a is a note, not a metric
                value = {k: v for k, v in value.items() if k != NAN_REASONS}
            if isinstance(value, dict) and value and all(_is_scalar(v) for v in value.values()):
                rows.append((fold, key, value))
            elif _is_scalar(value):
                fold_facts[key] = value
        facts.append((fold, fold_facts))
    order = {split: i for i, split in enumerate(SPLIT_ORDER)}
    rows.sort(key=lambda r: (_fold_key(r[0]), order.get(r[1], len(order)), r[1]))
    facts.sort(key=lambda f: _fold_key(f[0]))
    return rows, facts


def nan_notes(summary: dict | None) -> list[str]:
    """"fold 0 validation: daily_sharpe n/a (fewer than 2 sessions)" for every undefined metric
    whose reason the summary records; for a test window the deployment rule held flat, one line saying so instead
    of its metrics' (a flat window's Sharpe is undefined: zero variance)."""
    notes = []
    folds = (summary or {}).get("folds") or []
    for index, fold_record in enumerate(folds if isinstance(folds, list) else []):
        if not isinstance(fold_record, dict):
            continue
        fold, flat = fold_record.get("fold", index), held_flat(fold_record)
        if flat:  # the deployment rule held the test window flat: say that instead
            notes.append(f"fold {fold} {SPLIT_LABELS['test']}: held flat, no trades ({fold_record.get('deploy_rule')} "
                         f"not met: train.deploy_min_trade_t); the policy's own test is the "
                         f"'{SPLIT_LABELS['test_policy'].split(' (')[0]}' row")
        for split, value in fold_record.items():
            reasons = value.get(NAN_REASONS) if isinstance(value, dict) else None
            if split == "test" and flat:
                continue
            if isinstance(reasons, dict):
                notes += [f"fold {fold} {SPLIT_LABELS.get(split, split)}: {metric} n/a ({why})"
                          for metric, why in reasons.items()]
    return notes


def _fold_key(fold) -> tuple:
    """Folds sort numerically when they are numbers, after them by name."""
    return (0, int(fold), "") if isinstance(fold, (int, np.integer)) else (1, 0, str(fold))


def split_means(rows: list[tuple[int, str, dict]]) -> dict[str, dict]:
    """{split: {metric: mean over folds}} of the numeric metrics; missing and non-finite values
    are ignored (None when a metric has no value in any fold). Counts (ints in every fold) with
    an integral mean stay ints."""
    collected: dict[str, dict[str, list]] = {}
    for _, split, metrics in rows:
        per_split = collected.setdefault(split, {})
        for key, value in metrics.items():
            values = per_split.setdefault(key, [])
            numeric = isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.bool_))
            if numeric and math.isfinite(float(value)):
                values.append(value)
    means = {}
    for split, metrics in collected.items():
        means[split] = {}
        for key, values in metrics.items():
            if not values:
                means[split][key] = None
                continue
            mean = float(np.mean(np.asarray(values, dtype=np.float64)))
            counts = all(isinstance(v, (int, np.integer)) for v in values)
            means[split][key] = int(mean) if counts and mean.is_integer() else mean
    return means


def _first_column(frame: pd.DataFrame, candidates) -> str | None:
    for name in candidates:
        if name in frame.columns:
            return name
    return None


def _numeric(frame: pd.DataFrame, column: str) -> np.ndarray:
    return pd.to_numeric(frame[column], errors="coerce").to_numpy(dtype=np.float64)


def _finite_or_none(value):
    numeric = isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.bool_))
    return float(value) if numeric and math.isfinite(float(value)) else None


def train_path_rows(records: list[dict]) -> list[dict]:
    """The "train_path" records of metrics.jsonl (flattened to dotted keys), one per (fold, epoch)
    (the last one logged wins, as after a resume), sorted by fold then epoch, each with
    `val_sharpe` (the "val" record of the same fold and epoch; None if none or undefined),
    `train_over_val` (train-path Sharpe / validation Sharpe, None where either is undefined or
    the validation Sharpe is 0) and `within_goal` (True when both are positive and the ratio is
    within [1 / TRAIN_VAL_GOAL, TRAIN_VAL_GOAL]; False when both are defined otherwise; None)."""
    val, train = {}, {}
    for record in records:
        kind = record.get("kind")
        if kind not in ("val", TRAIN_PATH_KIND):
            continue
        flat = flatten_record(record)
        key = (flat.get("fold"), flat.get("epoch"))
        if kind == "val":
            score = next((flat[k] for k in VAL_SCORE_KEYS if k in flat), None)
            val[key] = _finite_or_none(score)
        else:
            train[key] = flat
    rows = []
    for key, flat in train.items():
        row = dict(flat)
        t, v = _finite_or_none(flat.get(TRAIN_PATH_SHARPE)), val.get(key)
        row["val_sharpe"] = v
        row["train_over_val"] = t / v if t is not None and v is not None and v != 0.0 else None
        if t is None or v is None:
            row["within_goal"] = None
        else:
            ratio = row["train_over_val"]
            row["within_goal"] = t > 0 and v > 0 and 1.0 / TRAIN_VAL_GOAL <= ratio <= TRAIN_VAL_GOAL
        rows.append(row)

    def order(row):
        epoch = row.get("epoch")
        return _fold_key(row.get("fold")), epoch if isinstance(epoch, (int, float)) else -1

    return sorted(rows, key=order)


def reward_terms(rows: list[dict]) -> list[str]:
    """Reward term names of `reward.<term>.snr` keys, in first-logged order."""
    terms: list[str] = []
    for row in rows:
        for key in row:
            parts = key.split(".")
            if len(parts) == 3 and parts[0] == "reward" and parts[2] == "snr" and parts[1] not in terms:
                terms.append(parts[1])
    return terms


def stitch_equity(segments: dict[int, dict[str, np.ndarray]]) -> dict[str, np.ndarray] | None:
    """Folds of one split joined in fold order into one curve: equity is the cumulative sum of
    the concatenated per-bar net P&L; drawdown = equity − running peak (peak starts at 0, the
    capital before the first bar). Returns equity, drawdown, fold start indices and labels."""
    if not segments:
        return None
    pnl_parts, starts, labels = [], [], []
    offset = 0
    for fold in sorted(segments):
        pnl = np.nan_to_num(np.asarray(segments[fold]["pnl"], dtype=np.float64))
        starts.append(offset)
        label = f"F{fold}"
        stamps = segments[fold].get("timestamps")
        if stamps is not None and len(stamps):
            day = _dt.datetime.fromtimestamp(int(stamps[0]) / 1e9, tz=_dt.timezone.utc)
            label += f" {day:%Y-%m-%d}"
        labels.append(label)
        pnl_parts.append(pnl)
        offset += len(pnl)
    pnl = np.concatenate(pnl_parts) if pnl_parts else np.zeros(0)
    equity = np.cumsum(pnl)
    peak = np.maximum.accumulate(np.maximum(equity, 0.0)) if len(equity) else equity
    return {"equity": equity, "drawdown": equity - peak, "starts": np.asarray(starts), "labels": labels}


def _ema(values: np.ndarray, span: int) -> np.ndarray:
    """Exponential moving average that ignores NaNs (pandas ewm, adjust=True)."""
    return pd.Series(values).ewm(span=span, ignore_na=True).mean().to_numpy()


def trade_stats(trades: pd.DataFrame | None) -> dict | None:
    """Count, win rate, average win/loss, profit factor, total, average hold of a trade list;
    None when there is no list or it has no P&L column."""
    if trades is None:
        return None
    if len(trades) == 0:
        return {"trades": 0}
    column = _first_column(trades, TRADE_PNL_KEYS)
    if column is None:
        return None
    pnl = _numeric(trades, column)
    pnl = pnl[np.isfinite(pnl)]
    wins, losses = pnl[pnl > 0], pnl[pnl < 0]
    gross_loss = -losses.sum()
    stats = {
        "trades": int(len(pnl)),
        "win_rate": float(len(wins) / len(pnl)) if len(pnl) else None,
        "avg_trade": float(pnl.mean()) if len(pnl) else None,
        "avg_win": float(wins.mean()) if len(wins) else None,
        "avg_loss": float(losses.mean()) if len(losses) else None,
        "profit_factor": float(wins.sum() / gross_loss) if gross_loss > 0 else None,
        "total_pnl": float(pnl.sum()),
    }
    hold = _first_column(trades, TRADE_HOLD_KEYS)
    if hold is not None:
        values = _numeric(trades, hold)
    elif "entry_bar" in trades.columns and "exit_bar" in trades.columns:  # the backtest's trade list
        values = _numeric(trades, "exit_bar") - _numeric(trades, "entry_bar")  # as the avg_hold metric
    else:
        values = None
    if values is not None:
        values = values[np.isfinite(values)]
        stats["avg_hold"] = float(values.mean()) if len(values) else None
    return stats


def headline_metrics(summary: dict | None, rows) -> tuple[dict[str, dict], str]:
    """({split: metrics}, what they are) for the headline: the pooled metrics of the folds' windows
    when the summary has them (one track record), else the mean over folds (older summaries)."""
    pooled = (summary or {}).get("pooled")
    n_folds = len({fold for fold, _, _ in rows})
    if isinstance(pooled, dict) and pooled:
        means = {split: {k: v for k, v in m.items() if k != NAN_REASONS}
                 for split, m in pooled.items() if isinstance(m, dict)}
        return means, (f"{n_folds} folds' windows pooled" if n_folds > 1 else "")
    return split_means(rows), (f"mean of {n_folds} folds" if n_folds > 1 else "")


# ----------------------------------------------------------------------------------------------
# figure panels
# ----------------------------------------------------------------------------------------------


def _note(ax, text: str) -> None:
    ax.text(
        0.5,
        0.5,
        text,
        transform=ax.transAxes,
        ha="center",
        va="center",
        color=COLOR_NOTE,
        fontsize=10,
        wrap=True,
    )
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_color("#e5e5e5")


def _style(ax) -> None:
    ax.grid(True, **GRID_STYLE)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.tick_params(labelsize=8)


def _equity_panel(ax_equity, ax_drawdown, split: str, curve: dict | None, headline: dict | None,
                  what: str = "") -> None:
    title = f"Equity — {SPLIT_LABELS.get(split, split)}"
    ax_equity.set_title(title, loc="left", fontsize=11, fontweight="bold")
    if curve is None or len(curve["equity"]) == 0:
        _note(ax_equity, f"no {SPLIT_LABELS.get(split, split)} equity saved yet")
        _note(ax_drawdown, "")
        return
    equity, drawdown = curve["equity"], curve["drawdown"]
    bars = np.arange(1, len(equity) + 1)
    color = COLOR_SPLIT.get(split, "#333333")
    ax_equity.plot(bars, equity, color=color, linewidth=1.2)
    ax_equity.axhline(0.0, color="#999999", linewidth=0.7)
    ax_equity.fill_between(bars, 0.0, equity, where=equity >= 0, color=color, alpha=0.06, linewidth=0)
    ax_drawdown.fill_between(bars, drawdown, 0.0, color=COLOR_DRAWDOWN, alpha=0.35, linewidth=0)
    ax_drawdown.plot(bars, drawdown, color=COLOR_DRAWDOWN, linewidth=0.6)
    worst = int(np.argmin(drawdown))
    if drawdown[worst] < 0:
        right = worst > 0.75 * len(drawdown)  # keep the label inside the axes
        ax_drawdown.annotate(
            f"max DD {format_value(float(drawdown[worst]))}",
            xy=(bars[worst], drawdown[worst]),
            xytext=(-4 if right else 4, 2),
            textcoords="offset points",
            fontsize=7,
            color=COLOR_DRAWDOWN,
            ha="right" if right else "left",
        )
    if len(curve["starts"]) > 1:
        for start, label in zip(curve["starts"], curve["labels"], strict=True):
            for ax in (ax_equity, ax_drawdown):
                ax.axvline(start + 0.5, color="#888888", linewidth=0.7, linestyle=":")
            ax_equity.annotate(
                label,
                xy=(start + 1, 1.0),
                xycoords=ax_equity.get_xaxis_transform(),
                xytext=(3, -3),
                textcoords="offset points",
                fontsize=7,
                color="#555555",
                va="top",
                ha="left",
            )
    elif curve["labels"] and " " in curve["labels"][0]:
        ax_equity.annotate(
            f"from {curve['labels'][0].split(' ', 1)[1]}",
            xy=(0.0, 1.0),
            xycoords="axes fraction",
            xytext=(3, -3),
            textcoords="offset points",
            fontsize=7,
            color="#555555",
            va="top",
            ha="left",
        )
    info = [f"final {format_value(float(equity[-1]))}", f"bars {len(equity):,}"]
    if headline and headline.get("daily_sharpe") is not None:
        info.append(f"daily Sharpe {format_value(headline['daily_sharpe'])}"
                    + (f" ({what})" if what else ""))
    ax_equity.text(
        0.99,
        0.03,
        "   ".join(info),
        transform=ax_equity.transAxes,
        ha="right",
        va="bottom",
        fontsize=8,
        color="#333333",
        bbox={"boxstyle": "round,pad=0.3", "facecolor": "white", "edgecolor": "#cccccc", "alpha": 0.9},
    )
    ax_equity.set_ylabel("cumulative net P&L", fontsize=8)
    ax_drawdown.set_ylabel("drawdown", fontsize=8)
    ax_drawdown.set_xlabel("bar (folds stitched in order)" if len(curve["starts"]) > 1 else "bar", fontsize=8)
    ax_equity.set_xlim(1, len(equity))
    ax_drawdown.set_xlim(1, len(equity))
    _style(ax_equity)
    _style(ax_drawdown)
    ax_equity.tick_params(labelbottom=False)


def _fold_groups(frame: pd.DataFrame):
    if "fold" in frame.columns:
        for fold, group in frame.groupby("fold", sort=True, dropna=False):
            yield fold, group
    else:
        yield None, frame


def _train_panel(ax, train: pd.DataFrame, key: str, title: str, log_allowed: bool) -> None:
    ax.set_title(title, loc="left", fontsize=10, fontweight="bold")
    if train.empty or key not in train.columns or not np.isfinite(_numeric(train, key)).any():
        _note(ax, f"'{key}' not logged")
        return
    x_key = "step" if "step" in train.columns else None
    positive = True
    n_folds = train["fold"].nunique() if "fold" in train.columns else 1
    for index, (fold, group) in enumerate(_fold_groups(train)):
        values = _numeric(group, key)
        x = _numeric(group, x_key) if x_key else np.arange(len(values), dtype=np.float64)
        color = FOLD_COLORS[index % len(FOLD_COLORS)]
        label = f"fold {fold}" if n_folds > 1 else None
        finite = values[np.isfinite(values)]
        positive &= bool(len(finite)) and bool((finite > 0).all())
        if len(values) >= 20 and key != "epsilon":
            ax.plot(x, values, color=color, linewidth=0.6, alpha=0.3)
            ax.plot(x, _ema(values, max(5, len(values) // 25)), color=color, linewidth=1.3, label=label)
        else:
            ax.plot(
                x, values, color=color, linewidth=1.3, marker="." if len(values) < 20 else None, label=label
            )
    if log_allowed and positive:
        finite = _numeric(train, key)
        finite = finite[np.isfinite(finite)]
        if finite.max() > 20 * finite.min():
            ax.set_yscale("log")
    ax.set_xlabel("step" if x_key else "log record", fontsize=8)
    if n_folds > 1:
        ax.legend(fontsize=7, frameon=False)
    _style(ax)


def _val_sharpe_panel(ax, val: pd.DataFrame, train_path: pd.DataFrame | None = None) -> None:
    """Validation Sharpe per epoch and fold (best starred); the training-path Sharpe of the same
    epochs dashed in the fold's colour when "train_path" records exist."""
    has_train = (
        train_path is not None
        and not train_path.empty
        and TRAIN_PATH_SHARPE in train_path.columns
        and np.isfinite(_numeric(train_path, TRAIN_PATH_SHARPE)).any()
    )
    title = "Sharpe: val —, train path - -" if has_train else "Validation Sharpe per epoch"
    ax.set_title(title, loc="left", fontsize=10, fontweight="bold")
    key = _first_column(val, VAL_SCORE_KEYS) if not val.empty else None
    if key is None or not np.isfinite(_numeric(val, key)).any():
        _note(ax, "no validation Sharpe logged")
        return
    n_folds = val["fold"].nunique() if "fold" in val.columns else 1
    for index, (fold, group) in enumerate(_fold_groups(val)):
        values = _numeric(group, key)
        epochs = (
            _numeric(group, "epoch") if "epoch" in group.columns else np.arange(len(values), dtype=np.float64)
        )
        color = FOLD_COLORS[index % len(FOLD_COLORS)]
        ax.plot(
            epochs,
            values,
            color=color,
            linewidth=1.3,
            marker="o",
            markersize=3.5,
            label=f"fold {fold}" if n_folds > 1 else None,
        )
        if np.isfinite(values).any():
            best = int(np.nanargmax(values))
            ax.plot(
                epochs[best],
                values[best],
                marker="*",
                markersize=12,
                color=color,
                markeredgecolor="black",
                markeredgewidth=0.5,
                linestyle="none",
            )
    if has_train:
        folds = [fold for fold, _ in _fold_groups(val)]
        for fold, group in _fold_groups(train_path):
            index = folds.index(fold) if fold in folds else len(folds)
            values = _numeric(group, TRAIN_PATH_SHARPE)
            epochs = (
                _numeric(group, "epoch") if "epoch" in group.columns else np.arange(len(values), dtype=np.float64)
            )
            ax.plot(epochs, values, color=FOLD_COLORS[index % len(FOLD_COLORS)], linewidth=1.1, linestyle="--",
                    marker=".", markersize=3)
    ax.axhline(0.0, color="#999999", linewidth=0.7)
    ax.set_xlabel("epoch (★ best)", fontsize=8)
    if n_folds > 1:
        ax.legend(fontsize=7, frameon=False)
    _style(ax)


def _trades_panel(ax, trades_by_split: dict[str, pd.DataFrame | None]) -> None:
    split = (
        "test"
        if trades_by_split.get("test") is not None
        else ("val" if trades_by_split.get("val") is not None else None)
    )
    label = SPLIT_LABELS.get(split, split) if split else ""
    ax.set_title(f"Trade P&L — {label}" if split else "Trade P&L", loc="left", fontsize=11, fontweight="bold")
    if split is None:
        _note(ax, "no trade list saved yet")
        return
    trades = trades_by_split[split]
    column = _first_column(trades, TRADE_PNL_KEYS) if len(trades) else None
    if len(trades) == 0:
        _note(ax, f"no trades in the {label} window(s): the agent stayed flat")
        return
    if column is None:
        _note(ax, f"trade list has no P&L column (expected one of {', '.join(TRADE_PNL_KEYS)})")
        return
    pnl = _numeric(trades, column)
    pnl = pnl[np.isfinite(pnl)]
    edges = _pnl_bins(pnl)
    ax.hist(pnl[pnl > 0], bins=edges, color=COLOR_WIN, alpha=0.8, label="wins")
    ax.hist(pnl[pnl <= 0], bins=edges, color=COLOR_LOSS, alpha=0.8, label="losses / flat")
    ax.axvline(0.0, color="#555555", linewidth=0.8)
    mean = float(pnl.mean())
    ax.axvline(mean, color="black", linewidth=1.0, linestyle="--", label=f"mean {format_value(mean)}")
    stats = trade_stats(trades)
    lines = [
        f"trades        {stats['trades']:,}",
        f"win rate      {format_value(stats['win_rate'])}",
        f"avg win       {format_value(stats['avg_win'])}",
        f"avg loss      {format_value(stats['avg_loss'])}",
        f"profit factor {format_value(stats['profit_factor'])}",
        f"total P&L     {format_value(stats['total_pnl'])}",
    ]
    if "avg_hold" in stats:
        lines.append(f"avg hold      {format_value(stats['avg_hold'])} bars")
    ax.text(
        0.99,
        0.97,
        "\n".join(lines),
        transform=ax.transAxes,
        ha="right",
        va="top",
        family="monospace",
        multialignment="left",
        fontsize=8,
        bbox={"boxstyle": "round,pad=0.4", "facecolor": "white", "edgecolor": "#cccccc"},
    )
    ax.set_xlabel("net trade P&L", fontsize=8)
    ax.set_ylabel("trades", fontsize=8)
    ax.legend(fontsize=7, frameon=False, loc="upper left")
    _style(ax)


def _pnl_bins(pnl: np.ndarray, max_bins: int = 60) -> np.ndarray:
    """Histogram edges of equal width with 0 on an edge, so that no bin mixes wins and losses."""
    low, high = float(min(pnl.min(), 0.0)), float(max(pnl.max(), 0.0))
    if high == low:
        return np.array([low - 0.5, low + 0.5])
    auto = np.histogram_bin_edges(pnl, bins="auto")
    width = max(float(auto[1] - auto[0]) if len(auto) > 1 else 0.0, (high - low) / max_bins)
    first, last = math.floor(low / width), math.ceil(high / width)
    return np.arange(first, last + 1, dtype=np.float64) * width


def _headline_rows(means: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    """(column splits, rows [label, value per split]) for the headline table."""
    splits = [s for s in SPLIT_ORDER if s in means] + [s for s in means if s not in SPLIT_ORDER]
    known = {key for metrics in means.values() for key in metrics}
    keys = [(key, label) for key, label in HEADLINE_METRICS if key in known]
    if not keys:  # metrics named differently: show what there is
        seen = []
        for metrics in means.values():
            seen += [k for k in metrics if k not in seen]
        keys = [(key, key.replace("_", " ")) for key in seen]
    rows = [
        [label] + [format_value(means[s].get(key)) for s in splits] for key, label in keys[:MAX_HEADLINE_ROWS]
    ]
    return splits, rows


def _headline_panel(ax, means: dict[str, dict], what: str) -> None:
    title = "Headline" + (f" ({what})" if what else "")
    ax.set_title(title, loc="left", fontsize=11, fontweight="bold")
    if not means:
        _note(ax, "summary.json not written yet\n(run still in progress)")
        return
    splits, rows = _headline_rows(means)
    ax.axis("off")
    table = ax.table(
        cellText=rows,
        colLabels=["metric"] + [SPLIT_LABELS.get(s, s).split(" ")[0] for s in splits],
        loc="upper center",
        cellLoc="right",
        colLoc="right",
        bbox=[0.0, 0.0, 1.0, 1.0],
    )
    table.auto_set_font_size(False)
    table.set_fontsize(8.5)
    for (row, col), cell in table.get_celld().items():
        cell.set_edgecolor("#e0e0e0")
        cell.set_linewidth(0.5)
        if row == 0:
            cell.set_facecolor("#f0f0f0")
            cell.set_text_props(fontweight="bold")
        elif row % 2 == 0:
            cell.set_facecolor("#fafafa")
        if col == 0:
            cell.set_text_props(ha="left")
            cell._loc = "left"


def render_figure(run: RunDir) -> bytes:
    """report.png as PNG bytes."""
    metrics = run.metrics_frame()
    train = metrics[metrics["kind"] == "train"] if "kind" in metrics.columns else metrics.iloc[0:0]
    val = metrics[metrics["kind"] == "val"] if "kind" in metrics.columns else metrics.iloc[0:0]
    train_path = metrics[metrics["kind"] == TRAIN_PATH_KIND] if "kind" in metrics.columns else metrics.iloc[0:0]
    summary = run.read_summary()
    rows, _ = metric_rows(summary)
    means, what = headline_metrics(summary, rows)
    equity = run.read_equity()
    trades = {split: run.read_trades(split) for split in ("val", "test")}

    figure = Figure(figsize=FIGURE_SIZE, dpi=FIGURE_DPI, facecolor="white")
    FigureCanvasAgg(figure)
    outer = figure.add_gridspec(
        3, 1, height_ratios=[1.35, 0.8, 0.95], hspace=0.38, left=0.05, right=0.985, top=0.915, bottom=0.05
    )
    top = outer[0].subgridspec(2, 2, height_ratios=[3, 1], hspace=0.06, wspace=0.16)
    for column, split in enumerate(("val", "test")):
        segments = {fold: arrays for (s, fold), arrays in equity.items() if s == split}
        _equity_panel(
            figure.add_subplot(top[0, column]),
            figure.add_subplot(top[1, column]),
            split,
            stitch_equity(segments),
            means.get(split),
            what,
        )
    middle = outer[1].subgridspec(1, 4, wspace=0.28)
    for column, (key, title, log_allowed) in enumerate(TRAIN_SERIES):
        _train_panel(figure.add_subplot(middle[0, column]), train, key, title, log_allowed)
    _val_sharpe_panel(figure.add_subplot(middle[0, 3]), val, train_path)
    bottom = outer[2].subgridspec(1, 2, width_ratios=[1.6, 1.0], wspace=0.12)
    _trades_panel(figure.add_subplot(bottom[0, 0]), trades)
    _headline_panel(figure.add_subplot(bottom[0, 1]), means, what)

    figure.suptitle(_title(run), x=0.05, ha="left", fontsize=14, fontweight="bold")
    figure.text(0.05, 0.948, _subtitle(run, summary), ha="left", va="bottom", fontsize=9, color="#555555")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=FIGURE_DPI, facecolor="white")
    return buffer.getvalue()


# ----------------------------------------------------------------------------------------------
# HTML
# ----------------------------------------------------------------------------------------------


def _title(run: RunDir) -> str:
    return f"numbarl run · {run.path.resolve().name}"


def _fill_note(summary: dict | None) -> str:
    """The execution assumption the results rest on (summary.json's fill_assumption), one line."""
    text = (summary or {}).get("fill_assumption")
    return f'<p class="note">Execution: {html.escape(str(text))}</p>' if text else ""


def _run_facts(run: RunDir, summary: dict | None) -> dict:
    """Run information: run.json's entries, then summary.json's top-level scalars."""
    facts = {key: value for key, value in run.meta.items() if _is_scalar(value) and key != "format"}
    if summary:
        facts.update({key: value for key, value in summary.items() if _is_scalar(value)})
    planned = (run.config.get("train") or {}).get("folds")
    done = len((summary or {}).get("folds") or [])
    if not summary:
        facts["status"] = "in progress (no summary.json yet)"
    elif isinstance(planned, int) and done < planned:
        facts["status"] = f"in progress ({done} of {planned} folds finished)"
    else:
        facts["status"] = "complete"
    return facts


def _subtitle(run: RunDir, summary: dict | None) -> str:
    facts = _run_facts(run, summary)
    parts = [
        f"{key} {facts[key]}"
        for key in ("created", "seed", "device", "numbarl_version", "preset", "data")
        if facts.get(key) is not None
    ]
    parts.append(facts["status"])
    return "   ·   ".join(str(p) for p in parts)


def _html_table(header: list[str], rows: list[list[str]], numeric_from: int = 1) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = "".join(
            f'<td class="{"num" if i >= numeric_from else "key"}">{html.escape(str(c))}</td>'
            for i, c in enumerate(row)
        )
        body.append(f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _metrics_table_html(rows: list[tuple[int, str, dict]]) -> str:
    if not rows:
        return '<p class="note">No fold metrics yet: summary.json is written when the run finishes.</p>'
    columns: list[str] = []
    for _, _, metrics in rows:
        columns += [key for key in metrics if key not in columns]
    known = [key for key, _ in HEADLINE_METRICS if key in columns]
    columns = known + [key for key in columns if key not in known]
    body = [
        [str(fold), SPLIT_LABELS.get(split, split)] + [format_value(metrics.get(key)) for key in columns]
        for fold, split, metrics in rows
    ]
    return _html_table(["fold", "split"] + columns, body, numeric_from=2)


def _nan_notes_html(notes: list[str]) -> str:
    if not notes:
        return ""
    items = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    return f'<p class="note">n/a: a metric undefined on its window, never a made-up number:</p><ul class="note">{items}</ul>'


def _facts_table_html(facts: list[tuple[int, dict]]) -> str:
    facts = [(fold, f) for fold, f in facts if f]
    if not facts:
        return ""
    columns: list[str] = []
    for _, fold_facts in facts:
        columns += [key for key in fold_facts if key not in columns]
    body = [[str(fold)] + [format_value(f.get(key)) for key in columns] for fold, f in facts]
    return "<h3>Per fold</h3>" + _html_table(["fold"] + columns, body)


def _trades_html(run: RunDir) -> str:
    order = {split: i for i, split in enumerate(SPLIT_ORDER)}
    splits = sorted(run.trade_splits(), key=lambda s: (order.get(s, len(order)), s))
    if not splits:
        return '<p class="note">No trade lists saved yet.</p>'
    parts, rows = [], []
    for split in splits:
        stats = trade_stats(run.read_trades(split))
        if stats is None:
            parts.append(f'<p class="note">trades_{html.escape(split)}.csv has no P&amp;L column.</p>')
        elif stats["trades"] == 0:
            window = html.escape(SPLIT_LABELS.get(split, split))
            parts.append(f'<p class="note">No trades in the {window} window(s).</p>')
        else:
            rows.append(
                [SPLIT_LABELS.get(split, split)]
                + [
                    format_value(stats.get(key))
                    for key in (
                        "trades",
                        "win_rate",
                        "avg_trade",
                        "avg_win",
                        "avg_loss",
                        "profit_factor",
                        "total_pnl",
                        "avg_hold",
                    )
                ]
            )
    table = ""
    if rows:
        table = _html_table(
            [
                "split",
                "trades",
                "win rate",
                "avg trade",
                "avg win",
                "avg loss",
                "profit factor",
                "total P&L",
                "avg hold (bars)",
            ],
            rows,
        )
    return table + "".join(parts)


def _train_path_html(run: RunDir) -> str:
    """The "Training path vs validation" section: per fold and epoch the training envs' own
    Sharpe beside the validation Sharpe, then the reward terms' signal-to-noise ratios."""
    rows = train_path_rows(run.read_metrics())
    if not rows:
        return ('<p class="note">No training-path records (kind "train_path") in metrics.jsonl: '
                "this run was made before numbarl logged them, or no epoch has finished.</p>")
    intro = (
        '<p class="note">Training path: the training envs\' own bar P&amp;L and closed trades during the '
        "epoch (exploration included, pooled over envs; per-bar Sharpe of the bar P&amp;L annualized with "
        "sqrt(bars_per_day × 252), per-trade Sharpe not annualized). Validation: the greedy backtest of the "
        f"validation window after that epoch. Goal: training-path Sharpe within {TRAIN_VAL_GOAL:g}× of the "
        "validation Sharpe.</p>"
    )
    verdict = {True: "yes", False: "no", None: "—"}
    body = [
        [format_value(row.get("fold")), format_value(row.get("epoch")), format_value(row.get(TRAIN_PATH_SHARPE)),
         format_value(row["val_sharpe"]), format_value(row["train_over_val"]), verdict[row["within_goal"]]]
        + [format_value(row.get(key)) for key, _ in TRAIN_PATH_COLUMNS]
        for row in rows
    ]
    header = ["fold", "epoch", "train-path Sharpe", "validation Sharpe", "train / val",
              f"within {TRAIN_VAL_GOAL:g}×"] + [label for _, label in TRAIN_PATH_COLUMNS]
    parts = [intro, _html_table(header, body, numeric_from=2)]
    terms = reward_terms(rows)
    if not terms:
        parts.append('<p class="note">No reward-term statistics in the training-path records.</p>')
        return "".join(parts)
    parts.append("<h3>Reward terms: signal-to-noise ratio (mean / std of the term's contribution per env-step)</h3>")
    snr = [[format_value(row.get("fold")), format_value(row.get("epoch"))]
           + [format_value(row.get(f"reward.{term}.snr")) for term in terms] for row in rows]
    parts.append(_html_table(["fold", "epoch"] + terms, snr, numeric_from=2))
    last = {}
    for row in rows:  # sorted by fold then epoch: the last one of each fold stays
        last[row.get("fold")] = row
    detail = [
        [format_value(fold), format_value(row.get("epoch")), term]
        + [format_value(row.get(f"reward.{term}.{stat}")) for stat in ("mean", "std", "snr")]
        for fold, row in last.items()
        for term in terms
    ]
    parts.append("<h3>Reward terms in the last epoch of each fold</h3>")
    parts.append(_html_table(["fold", "epoch", "term", "mean", "std", "SNR"], detail, numeric_from=3))
    return "".join(parts)


DIAGNOSTIC_KEYS = (  # (key of the train record, column label): the learner's health per epoch
    ("loss", "loss"), ("q_mean", "Q mean"), ("q_std", "Q std"), ("q_divergence", "|Q − Q target|"),
    ("q_gap_abs_mean", "|Q gap|"), ("atom_utilization", "atom util."), ("atom_entropy_beta", "entropy β"),
    ("support_v_max", "support ±"), ("grad_norm", "grad norm"), ("clip_scale", "clip scale"), ("lr", "lr"),
    ("epsilon", "epsilon"), ("action_entropy.direction", "H(direction)"), ("action_entropy.size", "H(size)"),
    ("freeze_resets", "freeze resets"), ("iqn_loss", "IQN loss"), ("cql_loss", "CQL"),
)


def diagnostic_rows(records: list[dict]) -> list[dict]:
    """The last train record of each (fold, epoch): the learner's statistics at the epoch's end."""
    last = {}
    for rec in records:
        if rec.get("kind") == "train":
            last[(rec.get("fold"), rec.get("epoch"))] = rec
    return [last[k] for k in sorted(last, key=lambda k: (_fold_key(k[0]), k[1] if k[1] is not None else -1))]


def _diagnostics_html(run: RunDir) -> str:
    """The "Learning diagnostics" section: per epoch the Q statistics, atom utilization, policy
    entropy, gradient norms (per optimizer group) of the epoch's last log read; then what the
    validation feedback switches measured and set (records of kind "feedback")."""
    records = run.read_metrics()
    rows = diagnostic_rows(records)
    if not rows:
        return '<p class="note">No train records yet.</p>'
    keys = [(k, label) for k, label in DIAGNOSTIC_KEYS if any(r.get(k) is not None for r in rows)]
    groups = sorted({k for r in rows for k in r if k.startswith("grad_norm.")})
    keys += [(g, g.replace("grad_norm.", "‖g‖ ")) for g in groups]
    body = [[format_value(r.get("fold")), format_value(r.get("epoch"))] + [format_value(r.get(k)) for k, _ in keys]
            for r in rows]
    parts = ['<p class="note">The last log read of each epoch (numbarl/rl/agents/dqn.py: train and diagnostics '
             "statistics). Late decay, atom collapse, Q drift and a frozen learner show here first.</p>",
             _html_table(["fold", "epoch"] + [label for _, label in keys], body, numeric_from=2)]
    feedback = [r for r in records if r.get("kind") == "feedback"]
    if feedback:
        skip = {"kind", "fold", "epoch", "step", "time", "elapsed_s"}
        cols = [k for k in dict.fromkeys(k for r in feedback for k in r) if k not in skip and not k.startswith("e9.tau_")
                and not k.startswith("e8.curriculum_w")]
        parts.append("<h3>Validation feedback (what each switch measured on the feedback part and set for the "
                     "next epoch; docs/FEEDBACK.md)</h3>")
        parts.append(_html_table(["fold", "epoch"] + cols,
                                 [[format_value(r.get("fold")), format_value(r.get("epoch"))]
                                  + [format_value(r.get(k)) for k in cols] for r in feedback], numeric_from=2))
    return "".join(parts)


def _checkpoints_html(run: RunDir) -> str:
    latest, best = run.latest_checkpoint(), run.best_checkpoint()
    checkpoints = run.list_checkpoints()
    if not checkpoints:
        return '<p class="note">No checkpoints saved.</p>'
    rows = [["saved", str(len(checkpoints))]]
    if latest:
        rows.append(["latest", f"{latest.get('tag')} (step {format_value(latest.get('step'))})"])
    if best:
        rows.append(["best by validation", f"{best.get('tag')} (score {format_value(best.get('score'))})"])
    return _html_table(["checkpoint", ""], rows, numeric_from=99)


CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px auto;
       max-width: 1500px; color: #222; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 2px; }
h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
h3 { font-size: 14px; } .sub { color: #666; font-size: 13px; }
table { border-collapse: collapse; font-size: 12.5px; margin: 8px 0; }
th, td { border: 1px solid #e2e2e2; padding: 3px 8px; } th { background: #f3f3f3; text-align: right; }
td.num { text-align: right; font-variant-numeric: tabular-nums; } td.key { text-align: left; }
tbody tr:nth-child(even) { background: #fafafa; } .note { color: #777; font-style: italic; }
img { max-width: 100%; border: 1px solid #eee; } pre { background: #f7f7f7; padding: 10px; font-size: 12px;
overflow-x: auto; } .wide { overflow-x: auto; }
"""


def render_html(run: RunDir, png: bytes) -> str:
    """report.html text with `png` embedded (base64)."""
    summary = run.read_summary()
    rows, facts = metric_rows(summary)
    means, what = headline_metrics(summary, rows)
    splits, headline = _headline_rows(means)
    headline_html = (
        _html_table(["metric"] + [SPLIT_LABELS.get(s, s) for s in splits], headline)
        if headline
        else '<p class="note">No summary yet: the run is in progress or was stopped before its test.</p>'
    )
    run_facts = _run_facts(run, summary)
    facts_rows = [[key, str(value)] for key, value in run_facts.items()] + [
        ["folder", str(run.path.resolve())]
    ]
    encoded = base64.b64encode(png).decode("ascii")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(_title(run))}</title>
<style>{CSS}</style></head><body>
<h1>{html.escape(_title(run))}</h1>
<div class="sub">{html.escape(_subtitle(run, summary))}</div>
<h2>Headline{html.escape(f" ({what})" if what else "")}</h2>
{headline_html}
{_fill_note(summary)}
<h2>Charts</h2>
<img alt="equity, drawdown, training curves and trade P&amp;L" src="data:image/png;base64,{encoded}">
<h2>Metrics per fold and split</h2>
<div class="wide">{_metrics_table_html(rows)}{_nan_notes_html(nan_notes(summary))}{_facts_table_html(facts)}</div>
<h2>Training path vs validation</h2>
<div class="wide">{_train_path_html(run)}</div>
<h2>Learning diagnostics</h2>
<div class="wide">{_diagnostics_html(run)}</div>
<h2>Trades</h2>
{_trades_html(run)}
<h2>Checkpoints</h2>
{_checkpoints_html(run)}
<h2>Run</h2>
{_html_table(["", ""], facts_rows, numeric_from=99)}
<h2>Config</h2>
<pre>{html.escape(json.dumps(run.config, indent=2))}</pre>
</body></html>
"""


def write_report(run_dir) -> tuple[Path, Path]:
    """Render report.png and report.html into the run folder (both atomically); returns
    (html_path, png_path). `run_dir` is a RunDir or the path of a run folder."""
    run = run_dir if isinstance(run_dir, RunDir) else RunDir.open(run_dir)
    png = render_figure(run)
    png_path = atomic_write_bytes(run.path / REPORT_PNG, png)
    html_path = atomic_write_bytes(run.path / REPORT_HTML, render_html(run, png).encode("utf-8"))
    return html_path, png_path
