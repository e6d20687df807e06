"""Pooled out-of-sample metrics: the folds' windows of one split concatenated into one track record.

A walk-forward run's out-of-sample result is ONE track record: the test windows of its folds,
traded one after another. Averaging per-fold ratios does not give that record's numbers (a mean
of win rates weighs a 3-trade fold like a 300-trade one; a mean of Calmar ratios of short windows
is dominated by the one whose annualized return explodes). So the headline is computed on the
concatenation, with the same metric code as every single window (numbarl/env/metrics.py):

    pnl, position   fold 0's window bars, then fold 1's, ...          (bar level)
    trades          every fold's trades, one list                      (trade level)
    sessions        each window's sessions numbered on from the previous window's, so that a
                    session never merges with one of another fold (validation windows of
                    neighbouring folds may share a session when val_sessions > test_sessions)

The inputs are what the run folder keeps per fold (equity/<split>_fold<k>.npz, trades_<split>.csv),
so the pooled numbers of a resumed run are those of an uninterrupted one.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from numbarl.run.runio import RunDir


def concatenate_windows(segments: dict[int, dict], trades: pd.DataFrame | None):
    """(pnl [T], position [T], session_id [T], trades) of the windows `segments` ({fold: arrays with
    "pnl", "position", "session_id"}) joined in fold order; the trades of those folds as policy 0."""
    pnl, position, sessions = [], [], []
    offset = 0
    for fold in sorted(segments):
        arrays = segments[fold]
        n = len(arrays["pnl"])
        pnl.append(np.asarray(arrays["pnl"], np.float64))
        position.append(np.asarray(arrays.get("position", np.zeros(n)), np.float64))
        sid = np.asarray(arrays["session_id"], np.int64) if "session_id" in arrays else np.zeros(n, np.int64)
        local = sid - sid[0] if n else sid  # sessions of this window: 0, 1, ...
        sessions.append(local + offset)
        offset += int(local[-1]) + 1 if n else 0
    if trades is not None and len(trades):
        if "fold" in trades.columns:
            trades = trades[trades["fold"].isin(list(segments))]
        trades = trades.assign(policy=0)
    cat = (lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype))  # noqa: E731
    return cat(pnl, np.float64), cat(position, np.float64), cat(sessions, np.int64), trades


def pooled_metrics(run: RunDir, split: str, bars_per_day: float, initial_capital: float):
    """The metrics (numbarl.env.metrics.Metrics, one policy) of every saved fold window of `split`
    concatenated, or None when no window of that split was saved."""
    from numbarl.env.metrics import compute_metrics

    segments = {fold: arrays for (name, fold), arrays in run.read_equity(split).items() if name == split}
    if not segments:
        return None
    pnl, position, session_id, trades = concatenate_windows(segments, run.read_trades(split))
    if trades is not None and not len(trades):
        trades = None
    return compute_metrics(pnl, position, session_id, trades, bars_per_day, initial_capital)
