"""The training progress line: ETA from the mean time per collect step, compact metric cells."""

import math

from numbarl.rl import trainer


def test_eta_from_mean_step_time(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(trainer.time, "perf_counter", lambda: now[0])
    p = trainer.Progress(quiet=True)
    p.plan(10)
    assert p.eta() == "--"  # nothing done yet
    for _ in range(4):
        p.step_done()
    now[0] += 8.0  # 2 s per step, 6 steps left
    assert p.eta() == "0m12s"
    p.plan(4000)
    for _ in range(2):
        p.step_done()
    now[0] += 4.0  # 2 s per step, 3998 left: 2 h 13 min
    assert p.eta() == "2h13m"


def test_metric_cells():
    assert trainer._num(None) == "n/a"
    assert trainer._num(float("nan"), ".2f") == "n/a"
    assert trainer._num(math.inf) == "n/a"
    assert trainer._num(37.274646557517116, ".2f") == "37.27"
    assert trainer._num(0.001609713497292109, ".3%") == "0.161%"
    assert trainer._num(3862144.0) == "3.86e+06"
