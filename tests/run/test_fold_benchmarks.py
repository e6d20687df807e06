"""The oracle and buy-and-hold backtests of a fold's test window (numbarl/run/fold_benchmarks.py):
computed in a background thread they give exactly what the fold's end computed before (a backtest
of the host MarketData, uploaded again), a failure in the thread surfaces once, in the run's
thread, naming the fold, and the time budget counts the wait for them as one part of `other`."""

import sys
from types import SimpleNamespace

import numpy as np
import pytest

from numbarl.cuda import graph as cuda_graph
from numbarl.env.backtest import backtest
from numbarl.env.market import MarketData
from numbarl.env.params import EnvParams
from numbarl.run import fold_benchmarks as fb
from numbarl.run.progress import Progress
from numbarl.run.trainer import metrics_dict


def _fold_setup(rng, n_bars=90, tick=0.25):
    """A random-walk market on a tick grid (3 sessions), an oracle signal and a fold's test window."""
    mid = 5000.0 + np.cumsum(rng.integers(-3, 4, n_bars) * (tick / 2))
    spread = tick * rng.integers(1, 3, n_bars)
    prev = np.concatenate([[mid[0]], mid[:-1]])
    data = MarketData(features=rng.standard_normal((n_bars, 3)).astype(np.float32), mid=mid, bid=mid - spread / 2,
                      ask=mid + spread / 2, high=np.maximum(prev, mid) + tick * rng.integers(0, 4, n_bars),
                      low=np.minimum(prev, mid) - tick * rng.integers(0, 4, n_bars),
                      session_id=(np.arange(n_bars) // 30).astype(np.int32),
                      timestamps=np.arange(n_bars, dtype=np.int64) * 1_000_000_000, tick_size=tick, bars_per_day=30.0)
    oracle = rng.standard_normal(data.n_bars)
    oracle[::7] = 0.0  # flat bars too
    cache = SimpleNamespace(oracle=oracle)
    fold = SimpleNamespace(index=2, test=(41, 83))
    return data, cache, fold, EnvParams()


def _same(a, b):
    np.testing.assert_array_equal(a.pnl, b.pnl)
    np.testing.assert_array_equal(a.position, b.position)
    np.testing.assert_array_equal(a.accumulators, b.accumulators)
    np.testing.assert_array_equal(a.session_id, b.session_id)
    assert a.trades.equals(b.trades) and a.window == b.window


def test_background_job_equals_the_fold_end_computation(rng):
    data, cache, fold, params = _fold_setup(rng)
    market = data.to_device(params.vol_span, params.vol_horizon_bars)
    # before: at the fold's end, on the host MarketData (uploaded by the backtest)
    before = [("oracle_test", backtest(data, fold.test, params, actions=fb.oracle_actions(cache, fold.test, params))),
              ("hold_test", backtest(data, fold.test, params, actions=fb.hold_actions(fold.test, params)))]
    switch = sys.getswitchinterval()
    job = fb.FoldBenchmarks(cache, market, fold, params, background=True)
    job.start()
    assert job.running and job.join in cuda_graph.BEFORE_CAPTURE  # a capture would wait for it
    assert sys.getswitchinterval() <= fb.JOB_SWITCH_INTERVAL_S
    after = job.results()
    assert not job.running and job.join not in cuda_graph.BEFORE_CAPTURE and sys.getswitchinterval() == switch
    assert job.overlapped and job.job_s > 0 and 0 <= job.waited_s
    assert [s for s, _, _ in after] == [s for s, _ in before]
    for (_, old), (_, new, metrics) in zip(before, after):
        _same(old, new)
        assert metrics == metrics_dict(old.metrics())
    # the simulator's path (computed in the caller's thread at start()) gives the same
    inline = fb.FoldBenchmarks(cache, market, fold, params, background=False)
    inline.start()
    assert not inline.overlapped and not inline.running
    for (_, a, ma), (_, b, mb) in zip(after, inline.results()):
        _same(a, b)
        assert ma == mb
    # no oracle (real data): buy and hold only; results() without start() computes at once
    plain = fb.FoldBenchmarks(SimpleNamespace(oracle=None), market, fold, params, background=True)
    (split, result, _), = plain.results()
    assert split == "hold_test" and not plain.overlapped and plain.waited_s == pytest.approx(plain.job_s, abs=0.05)
    _same(result, before[1][1])


def test_a_failing_job_raises_once_in_the_run_thread(rng, monkeypatch):
    data, cache, fold, params = _fold_setup(rng)
    market = data.to_device(params.vol_span, params.vol_horizon_bars)

    def lost(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr("numbarl.env.backtest.backtest", lost)
    switch = sys.getswitchinterval()
    job = fb.FoldBenchmarks(cache, market, fold, params, background=True)
    job.start()
    job._thread.join()  # finished, not yet joined by the run
    with pytest.raises(fb.FoldBenchmarkError):  # the trainer's check after each epoch raises at once
        job.check()
    job = fb.FoldBenchmarks(cache, market, fold, params, background=True)
    job.start()
    job.join()  # a capture's wait keeps the error for results()
    job.check()  # joined: results() raises it
    with pytest.raises(fb.FoldBenchmarkError, match=r"fold 2: the oracle / buy-and-hold backtest of the test "
                                                    r"window \(41, 83\) failed: RuntimeError: device lost") as err:
        job.results()
    assert isinstance(err.value.__cause__, RuntimeError) and "--resume" in str(err.value)
    assert sys.getswitchinterval() == switch and job.join not in cuda_graph.BEFORE_CAPTURE


def test_a_part_inside_a_part_of_other_counts_once():
    now = [0.0]
    p = Progress(quiet=True, clock=lambda: now[0])
    outer = p.part_begin()
    now[0] += 1.0
    inner = p.part_begin()
    now[0] += 2.0  # the wait for the benchmarks, inside the fold's results
    p.part_end("benchmarks", inner)
    p.charge("test", 0.5)
    now[0] += 0.5
    now[0] += 0.25
    p.part_end("fold_results", outer)
    assert p.other == {"benchmarks": 2.0, "fold_results": 1.25}
    assert sum(p.time_other().values()) == pytest.approx(p.time_budget()["other"])


def test_the_mode_variable_takes_background_or_sync_and_names_a_bad_value(monkeypatch):
    from numbarl.run import fold_benchmarks as fb

    monkeypatch.setenv("NUMBARL_FOLD_BENCHMARKS", "sync")
    assert fb.background_ok() is False
    monkeypatch.setenv("NUMBARL_FOLD_BENCHMARKS", "Sync")
    with pytest.raises(fb.FoldBenchmarkError, match="NUMBARL_FOLD_BENCHMARKS='Sync'"):
        fb.background_ok()
