"""The benchmarks a fold's test result is read against: the oracle (synthetic data: the planted
signal's direction) and buy-and-hold, backtested on the fold's test window.

They read the market and the window only, never the agent, so they need not wait for the fold's
training: the trainer starts them after the fold's first validation (every graph of the fold's
epochs is captured by then) and takes their results at the fold's end::

    bench = FoldBenchmarks(cache, market, fold, params, background=True)
    ... epoch 1, its validation ...
    bench.start()                  # a thread: compile, upload, backtests, metrics
    ... epochs 2..E ...
    results = bench.results()      # [(split, BacktestResult, metrics)]: joined, errors raised here

Measured: a default run alone on the H200 (a fresh machine) spent 4.6 s on its fold's results;
the tiny preset under the simulator with cold numba caches 4.51 s, of which this job is 4.34 s
(the first calls compile the given-actions backtest's row functions and the host metric scan;
0.11 s once compiled) and the rest 0.18 s. In the background the job overlaps epochs 2..E;
`waited_s` is what the run still waited for.

Same results as computing them at the fold's end: the same device backtest (`backtest` with the
actions given) on the same market arrays (the run's DeviceMarket instead of a second upload of
the same MarketData; both are `to_device(env.vol_span, env.vol_horizon_bars)`), with the run
folder's files written by the trainer at the fold's end in the same order as before.

Threads and the device: the job uses its own non-blocking stream; its allocations and host copies
are not allowed while a CUDA graph is being captured in GLOBAL mode (numbarl/cuda/graph.py), so
the trainer starts it only after the fold's first captures, and any later capture (a graph first
used later, the test backtest's) joins it first (`graph.BEFORE_CAPTURE`; the trainer joins it
before the test backtest itself, so that the wait counts as the job's). Under the CUDA simulator
a kernel launch swaps the kernel module's `cuda` global for the launch's fake module, which is not
safe from two threads at once: there `background=False` and `start()` computes in the caller's
thread.

While the job holds the GIL (numba's typing and lowering are Python), the training thread waits
for it at every graph launch: up to the interpreter's switch interval (5 ms) per launch against a
collect + train step of ~3.8 ms of GPU time, so the GPU would starve. The job shortens the switch
interval while it runs (JOB_SWITCH_INTERVAL_S) and restores it when joined.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np

# while the job runs: the longest a graph launch of the training thread waits for the GIL
JOB_SWITCH_INTERVAL_S = 0.0005


def oracle_actions(cache, window, params):
    """Oracle policy: long when the planted signal says up, short when down (synthetic data)."""
    if cache.oracle is None:
        return None
    lo, hi = window
    sig = np.asarray(cache.oracle[lo:hi], np.float64)
    direction = np.where(sig > 0, 2, np.where(sig < 0, 0, 1)).astype(np.int32)
    acts = np.zeros((hi - lo, 4), np.int32)
    acts[:, 0] = direction
    acts[:, 1] = len(params.sizes) - 1
    return acts


def hold_actions(window, params):
    """Buy and hold: long the largest size on every bar of the window (no target, no stop), the
    benchmark a test result is read against (on a market without an edge, its t is the window's
    drift: a long-biased policy earns it too)."""
    lo, hi = window
    acts = np.zeros((hi - lo, 4), np.int32)
    acts[:, 0] = 2
    acts[:, 1] = len(params.sizes) - 1
    return acts


def background_ok() -> bool:
    """Whether the job may run in a thread beside the training: on a GPU, not under the CUDA
    simulator (see the module docstring), and not with NUMBARL_FOLD_BENCHMARKS=sync (the job at the
    fold's end in the training thread, as before: same results, for debugging)."""
    import os

    from numbarl.cuda.runtime import simulator

    mode = os.environ.get("NUMBARL_FOLD_BENCHMARKS", "background")
    if mode not in ("background", "sync"):
        raise FoldBenchmarkError(f"NUMBARL_FOLD_BENCHMARKS={mode!r}: use 'background' (the default) or 'sync'")
    return not simulator() and mode == "background"


class FoldBenchmarkError(RuntimeError):
    """The oracle or buy-and-hold backtest of a fold failed (in the background); nothing of them
    was written."""


class FoldBenchmarks:
    """The oracle (when the data has one) and buy-and-hold backtests of `fold.test`, computed once.

    `start()` begins the work (a thread with `background`, else at once in the caller's thread);
    `results()` returns `[(split, BacktestResult, metrics dict)]` for "oracle_test" then
    "hold_test", starting the work first if nobody did. Timing: `job_s` (the work's own seconds),
    `waited_s` (what `results()` waited: the part on the run's critical path), `overlapped`
    (whether it ran beside the training).
    """

    def __init__(self, cache, market, fold, params, background: bool):
        self.cache, self.market, self.fold, self.params = cache, market, fold, params
        self.background = bool(background)
        self._thread = None
        self._result = None
        self._error = None
        self._switch = None  # the interpreter's switch interval before the job shortened it
        self.started = False
        self.job_s = 0.0
        self.waited_s = 0.0
        self.overlapped = False

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Begin the work once (a thread with `background`, else now)."""
        if self.started:
            return
        self.started = True
        if not self.background:  # on the critical path: all of it is waited for
            t0 = time.perf_counter()
            self._work()
            self.waited_s += time.perf_counter() - t0
            return
        from numbarl.cuda import graph as cuda_graph

        if sys.getswitchinterval() > JOB_SWITCH_INTERVAL_S:
            self._switch = sys.getswitchinterval()
            sys.setswitchinterval(JOB_SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._work, name=f"numbarl-benchmarks-fold{self.fold.index}",
                                        daemon=True)
        self.overlapped = True
        cuda_graph.BEFORE_CAPTURE.append(self.join)  # no capture while the job uses the device
        try:
            self._thread.start()
        except BaseException:  # no thread (a resource limit): the work is done at results()
            self._thread, self.started, self.overlapped = None, False, False
            self._release()
            raise

    def _release(self) -> None:
        from numbarl.cuda import graph as cuda_graph

        if self.join in cuda_graph.BEFORE_CAPTURE:
            cuda_graph.BEFORE_CAPTURE.remove(self.join)
        if self._switch is not None:
            sys.setswitchinterval(self._switch)
            self._switch = None

    def join(self) -> None:
        """Wait for a background job (before a graph capture, or for the results); its error, if
        any, is kept for results()."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        t0 = time.perf_counter()
        thread.join()
        self.waited_s += time.perf_counter() - t0
        self._thread = None
        self._release()

    def check(self) -> None:
        """Raise FoldBenchmarkError now if the job has already failed (the run stops at the epoch
        it learns of it, not at the fold's end)."""
        thread = self._thread
        if thread is not None and not thread.is_alive() and self._error is not None:
            self.results()

    def results(self) -> list:
        """[(split, BacktestResult, metrics)] of the window; raises FoldBenchmarkError if the work
        failed."""
        if not self.started:  # nothing ran beside the training (e.g. a resume after the last epoch)
            self.started = True
            t0 = time.perf_counter()
            self._work()
            self.waited_s += time.perf_counter() - t0
        self.join()
        if self._error is not None:
            err = self._error
            raise FoldBenchmarkError(
                f"fold {self.fold.index}: the oracle / buy-and-hold backtest of the test window "
                f"{tuple(self.fold.test)} failed: {type(err).__name__}: {err}. Nothing of the fold's results was "
                "written; its checkpoints are kept (`numbarl-train --resume RUN_DIR` recomputes them)") from err
        return self._result

    def _work(self) -> None:
        t0 = time.perf_counter()
        try:
            self._result = self._compute()
        except BaseException as err:  # noqa: BLE001 - raised again by results(), in the run's thread
            self._error = err
        finally:
            self.job_s = time.perf_counter() - t0

    def _compute(self) -> list:
        from numbarl.cuda.runtime import new_stream
        from numbarl.env.backtest import backtest
        from numbarl.env.metrics import compute_metrics
        from numbarl.run.trainer import metrics_dict

        window, params = self.fold.test, self.params
        stream = new_stream()  # not the compute stream the training replays its graphs on
        out = []
        for split, actions in (("oracle_test", oracle_actions(self.cache, window, params)),
                               ("hold_test", hold_actions(window, params))):
            if actions is None:
                continue
            result = backtest(self.market, window, params, actions=actions, stream=stream)
            out.append((split, result, metrics_dict(result.metrics())))
        # the pooled metrics of the fold's end (numbarl/run/pooled.py) run the host metric scan, an
        # @njit loop compiled at its first call: compiled here (same argument types), off the
        # critical path; its result is not used
        result = out[-1][1]
        compute_metrics(result.pnl[0], result.position[0].astype(np.float64), result.session_id, None,
                        result.bars_per_day, result.initial_capital)
        return out
