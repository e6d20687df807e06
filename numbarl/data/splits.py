"""Walk-forward splits in whole exchange sessions (SPEC §3.6).

The folds are anchored on the NEWEST data: the last fold's test window ends at the last
session, and fold k (k = 0..n_folds-1, oldest first) takes consecutive sessions starting at
session ``first + k·test_sessions``, ``first = n_sessions - sessions_needed(...)``::

    | (older sessions, unused) | train_sessions | val_sessions | test_sessions |
                                               ^ embargo        ^ embargo

so successive test windows are adjacent and never overlap, the out-of-sample test covers the
most recent ``n_folds·test_sessions`` sessions (the data a researcher cares most about; anchoring
on the oldest data silently left the newest sessions out), every fold is strictly chronological
(train < validation < test, nothing after the fold's test window is used) and sessions are never
split. The embargo removes the last ``embargo_bars`` bars of the training range before the
validation range and the last ``embargo_bars`` bars of the validation range before the test range,
so features and labels that look a few bars back or ahead cannot straddle two ranges
(López de Prado, AFML §7.4.2). Ranges are half-open bar index pairs ``(start, end)``.

Sessions needed: train + val + test + (n_folds - 1)·test.

One split definition: :data:`DEFAULT_SPLIT` holds the window sizes that ``numbarl-train``'s
config (``train.*_sessions``, ``train.embargo_bars``) and ``numbarl-data --folds`` both default
to, and both call :func:`walk_forward`, so a cache checked with ``numbarl-data --folds 3`` is
split exactly as ``numbarl-train --folds 3`` splits it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numbarl.data.errors import DataError

# the default window sizes (sessions) and embargo (bars) of every walk-forward split
DEFAULT_SPLIT = {"train_sessions": 14, "val_sessions": 3, "test_sessions": 3, "embargo_bars": 50}
MIN_WINDOW_BARS = 2  # a window must hold one step (bar t -> t + 1); the env's check_range agrees


@dataclass(frozen=True)
class Fold:
    """One walk-forward fold: half-open bar ranges and the sessions they cover."""

    index: int
    train: tuple[int, int]
    val: tuple[int, int]
    test: tuple[int, int]
    train_sessions: tuple[int, int]  # half-open session-id ranges
    val_sessions: tuple[int, int]
    test_sessions: tuple[int, int]

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "train": list(self.train),
            "val": list(self.val),
            "test": list(self.test),
            "train_sessions": list(self.train_sessions),
            "val_sessions": list(self.val_sessions),
            "test_sessions": list(self.test_sessions),
        }


def sessions_needed(n_folds: int, train_sessions: int, val_sessions: int, test_sessions: int) -> int:
    return train_sessions + val_sessions + test_sessions + (n_folds - 1) * test_sessions


def walk_forward(
    session_id,
    n_folds: int = 1,
    embargo_bars: int = DEFAULT_SPLIT["embargo_bars"],
    train_sessions: int = DEFAULT_SPLIT["train_sessions"],
    val_sessions: int = DEFAULT_SPLIT["val_sessions"],
    test_sessions: int = DEFAULT_SPLIT["test_sessions"],
) -> list[Fold]:
    """Chronological (train, validation, test) folds over bars numbered by ``session_id``, the
    last test window ending at the newest session.

    ``session_id``: int [T], 0..S-1 non-decreasing (the cache's session_id).
    """
    sid = np.asarray(session_id)
    for name, value, low in (
        ("n_folds", n_folds, 1),
        ("train_sessions", train_sessions, 1),
        ("val_sessions", val_sessions, 1),
        ("test_sessions", test_sessions, 1),
        ("embargo_bars", embargo_bars, 0),
    ):
        if int(value) != value or value < low:
            raise DataError(f"walk-forward: {name} must be an integer >= {low}, got {value}")
    if sid.ndim != 1 or len(sid) == 0:
        raise DataError("walk-forward: no bars")
    if np.any(np.diff(sid) < 0) or sid[0] != 0 or np.any(np.diff(sid) > 1):
        raise DataError("walk-forward: session_id must number sessions 0, 1, 2, ... in time order")
    n_sessions = int(sid[-1]) + 1
    need = sessions_needed(n_folds, train_sessions, val_sessions, test_sessions)
    if need > n_sessions:
        raise DataError(
            f"walk-forward with {n_folds} fold(s) of {train_sessions} train + {val_sessions} validation + "
            f"{test_sessions} test sessions needs {need} sessions; the data has {n_sessions}. "
            "Use fewer or shorter folds, or more data"
        )
    starts = np.searchsorted(sid, np.arange(n_sessions + 1), side="left")
    folds = []
    first = n_sessions - need  # sessions older than the first fold's training window are unused
    for k in range(n_folds):
        s0 = first + k * test_sessions
        s_val = s0 + train_sessions
        s_test = s_val + val_sessions
        s_end = s_test + test_sessions
        train = (int(starts[s0]), int(starts[s_val]) - embargo_bars)
        val = (int(starts[s_val]), int(starts[s_test]) - embargo_bars)
        test = (int(starts[s_test]), int(starts[s_end]))
        for name, (a, b) in (("training", train), ("validation", val)):
            if b - a < MIN_WINDOW_BARS:
                raise DataError(
                    f"walk-forward fold {k}: the embargo of {embargo_bars} bars leaves {max(b - a, 0)} {name} "
                    f"bar(s) of {b - a + embargo_bars}; a window needs at least {MIN_WINDOW_BARS} (one step); "
                    "lower embargo_bars"
                )
        if test[1] - test[0] < MIN_WINDOW_BARS:
            raise DataError(f"walk-forward fold {k}: the test sessions hold {test[1] - test[0]} bar(s); a window "
                            f"needs at least {MIN_WINDOW_BARS} (one step)")
        folds.append(Fold(k, train, val, test, (s0, s_val), (s_val, s_test), (s_test, s_end)))
    return folds
