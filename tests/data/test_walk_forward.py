"""Walk-forward folds: whole sessions, chronological, embargo, clear errors."""

import numpy as np
import pytest

from numbarl.data.errors import DataError
from numbarl.data.splits import sessions_needed, walk_forward


def session_ids(rng, n_sessions):
    return np.repeat(np.arange(n_sessions), rng.integers(5, 40, size=n_sessions)).astype(np.int32)


def test_folds_are_chronological_whole_sessions(rng):
    sid = session_ids(rng, 27)
    folds = walk_forward(sid, n_folds=3, embargo_bars=2, train_sessions=8, val_sessions=3, test_sessions=4)
    assert len(folds) == 3
    starts = np.searchsorted(sid, np.arange(28))
    # anchored on the newest data: 23 of the 27 sessions are used, the 4 oldest are left out
    for k, fold in enumerate(folds):
        first = 4 + 4 * k
        assert fold.train_sessions == (first, first + 8)
        assert fold.train[0] == starts[first] and fold.train[1] == starts[first + 8] - 2
        assert fold.val == (starts[first + 8], starts[first + 11] - 2)
        assert fold.test == (starts[first + 11], starts[first + 15])
        assert fold.train[1] < fold.val[0] and fold.val[1] < fold.test[0]
        # whole sessions: ranges start at a session start; the test range ends at one
        for start in (fold.train[0], fold.val[0], fold.test[0]):
            assert start == 0 or sid[start] != sid[start - 1]
        assert fold.test[1] == len(sid) or sid[fold.test[1]] != sid[fold.test[1] - 1]
    tests = [f.test for f in folds]
    assert all(a[1] == b[0] for a, b in zip(tests, tests[1:]))  # adjacent, no overlap
    assert folds[-1].test[1] == len(sid) and folds[-1].test_sessions[1] == 27  # ends at the newest bar


def test_hand_computed_fold():
    sid = np.array([0, 0, 1, 1, 1, 2, 2, 3, 3, 3])  # sessions start at bars 0, 2, 5, 7
    (fold,) = walk_forward(sid, n_folds=1, embargo_bars=0, train_sessions=2, val_sessions=1, test_sessions=1)
    assert (fold.train, fold.val, fold.test) == ((0, 5), (5, 7), (7, 10))
    assert fold.to_dict()["test_sessions"] == [3, 4]
    sid = np.array([0, 0, 1, 1, 1, 2, 2, 2, 3, 3])  # sessions start at bars 0, 2, 5, 8
    (fold,) = walk_forward(sid, n_folds=1, embargo_bars=1, train_sessions=2, val_sessions=1, test_sessions=1)
    assert (fold.train, fold.val, fold.test) == ((0, 4), (5, 7), (8, 10))


def test_errors_name_what_is_needed():
    sid = np.repeat(np.arange(10), 3)
    with pytest.raises(DataError, match="needs 28 sessions; the data has 10"):
        walk_forward(sid, n_folds=3, train_sessions=12, val_sessions=4, test_sessions=4)
    assert sessions_needed(3, 12, 4, 4) == 28
    with pytest.raises(DataError, match="embargo of 5 bars leaves 0 validation bar"):
        walk_forward(sid, n_folds=1, embargo_bars=5, train_sessions=6, val_sessions=1, test_sessions=1)
    # one bar left is no step: refused here, not after the run folder is written
    with pytest.raises(DataError, match="embargo of 2 bars leaves 1 validation bar.*at least 2"):
        walk_forward(sid, n_folds=1, embargo_bars=2, train_sessions=6, val_sessions=1, test_sessions=1)
    hand = np.array([0, 0, 1, 1, 1, 2, 2, 3, 3, 3])
    with pytest.raises(DataError, match="at least 2"):
        walk_forward(hand, n_folds=1, embargo_bars=1, train_sessions=2, val_sessions=1, test_sessions=1)
    one_bar_test = np.array([0, 0, 0, 1, 1, 1, 2])
    with pytest.raises(DataError, match="test sessions hold 1 bar"):
        walk_forward(one_bar_test, n_folds=1, embargo_bars=0, train_sessions=1, val_sessions=1, test_sessions=1)
    with pytest.raises(DataError, match="n_folds must be an integer >= 1"):
        walk_forward(sid, n_folds=0)
    with pytest.raises(DataError, match="session_id must number sessions"):
        walk_forward(np.array([0, 2, 2]), n_folds=1, train_sessions=1, val_sessions=1, test_sessions=1)
