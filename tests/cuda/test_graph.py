"""graph.capture / replay / fork / join on the simulator backend (eager re-call), plus the
capture-failure messages. The real capture path is covered by tests/cuda/test_gpu_runtime.py."""

import types

import numpy as np
import pytest

from numbarl.cuda import graph, rng
from numbarl.cuda.runtime import cuda, stream

_cuda = cuda()
BLOCK = 32


@_cuda.jit(cache=True)
def add_uniform_kernel(out, seed, counter):
    """out[i] += uniform(seed, i, counter[0], 0): state that changes every step."""
    i = _cuda.grid(1)
    if i >= out.shape[0]:
        return
    out[i] += rng.uniform(seed, i, counter[0], 0)


@_cuda.jit(cache=True)
def scale_kernel(x, factor, out):
    i = _cuda.grid(1)
    if i >= x.shape[0]:
        return
    out[i] = x[i] * factor


def _add_uniform_ref(n, seed, counters):
    out = np.zeros(n, np.float64)
    for c in counters:
        out += rng.uniform_ref(seed, c, 0, n)
    return out


def test_capture_warms_up_once_and_replays(rng):
    # the warm-up is a real step: after capture + 3 replays the step ran 4 times
    n, seed = 37, int(rng.integers(1 << 31))
    out = _cuda.to_device(np.zeros(n, np.float32))
    counter = _cuda.to_device(np.zeros(1, np.int64))
    calls = []

    def step(s):
        calls.append(s)
        add_uniform_kernel[(n + BLOCK - 1) // BLOCK, BLOCK, s](out, np.uint64(seed), counter)
        rng_advance(counter, s)

    g = graph.capture(step)
    assert len(calls) == 1 and not g.captured
    for _ in range(3):
        g.replay()
    assert len(calls) == 4 and g.replays == 3
    assert all(c is stream() for c in calls)
    assert counter.copy_to_host()[0] == 4
    np.testing.assert_allclose(out.copy_to_host(), _add_uniform_ref(n, seed, range(4)), rtol=1e-6, atol=1e-6)


def rng_advance(counter, s):
    rng.advance(counter, s)


def test_no_warmup_and_explicit_stream():
    s = _cuda.stream()
    calls = []
    g = graph.capture(lambda st: calls.append(st), stream=s, warmup=False)
    assert calls == []
    g.replay()
    g.replay(stream=stream())
    assert calls == [s, stream()]
    assert "eager" in repr(g)


def test_eager_switch():
    graph.set_eager(True)
    try:
        assert graph.eager_mode()
    finally:
        graph.set_eager(False)
    calls = []
    g = graph.capture(lambda st: calls.append(1), eager=True)
    g.replay()
    assert len(calls) == 2 and not g.captured


def test_fork_join_branches(rng):
    # two independent halves on branch streams, joined back: same numbers as one stream
    n = 45
    x = rng.standard_normal(n).astype(np.float32)
    dx = _cuda.to_device(x)
    a = _cuda.device_array(n, np.float32)
    b = _cuda.device_array(n, np.float32)
    s = stream()

    def step(st):
        left, right = graph.fork(st, 2)
        scale_kernel[(n + BLOCK - 1) // BLOCK, BLOCK, left](dx, np.float32(2.0), a)
        scale_kernel[(n + BLOCK - 1) // BLOCK, BLOCK, right](dx, np.float32(-0.5), b)
        graph.join(st, [left, right])

    g = graph.capture(step, stream=s)
    g.replay()
    np.testing.assert_array_equal(a.copy_to_host(), x * np.float32(2.0))
    np.testing.assert_array_equal(b.copy_to_host(), x * np.float32(-0.5))
    branches = graph.branch_streams(2)
    assert graph.fork(s, 2) == branches  # the pool is reused, not regrown
    with pytest.raises(ValueError, match="n >= 1"):
        graph.fork(s, 0)


def test_failure_message_names_cause_and_hints():
    # a driver error as numba raises it: .code is a CUresult whose .name says what happened
    exc = RuntimeError("Call to cuMemAlloc results in CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
    exc.code = types.SimpleNamespace(name="CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")

    def train_step(s):
        pass

    err = graph._fail(train_step, graph._cause_of(exc))
    text = str(err)
    assert isinstance(err, graph.GraphCaptureError)
    assert "train_step" in text and "allocation" in text and "cuMemAlloc" in text
    for hint in ("allocation inside capture", "host copy", "synchronize", "legacy default stream"):
        assert hint in text
    implicit = types.SimpleNamespace(code=types.SimpleNamespace(name="CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"))
    assert "legacy default stream was used" in graph._cause_of(implicit)
    plain = graph._cause_of(ValueError("bad shape"))
    assert plain == "ValueError: bad shape"


# ---------------------------------------------------------------------------------------------
# The GPU capture path driven by a fake driver: the control flow of capture() (sentinel capture,
# ending both captures on every failure, the cause in the message, one launch per replay).
# ---------------------------------------------------------------------------------------------
import enum  # noqa: E402


class FakeDriver:
    class CUresult(enum.Enum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900
        CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901
        CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903
        CUDA_ERROR_STREAM_CAPTURE_UNJOINED = 904

    class CUstreamCaptureStatus(enum.Enum):
        CU_STREAM_CAPTURE_STATUS_NONE = 0
        CU_STREAM_CAPTURE_STATUS_ACTIVE = 1

    class CUstreamCaptureMode(enum.Enum):
        CU_STREAM_CAPTURE_MODE_GLOBAL = 0

    CUstream = int

    def __init__(self):
        self.capturing, self.invalid, self.unjoined = set(), set(), set()
        self.launched, self.destroyed = [], []

    def cuStreamBeginCapture(self, h, mode):
        assert mode == self.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
        self.capturing.add(h)
        return (self.CUresult.CUDA_SUCCESS,)

    def cuStreamEndCapture(self, h):
        if h not in self.capturing:
            return self.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, None
        self.capturing.discard(h)
        if h in self.invalid:
            return self.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, None
        if h in self.unjoined:
            return self.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNJOINED, None
        return self.CUresult.CUDA_SUCCESS, f"graph{h}"

    def cuStreamIsCapturing(self, h):
        status = self.CUstreamCaptureStatus
        return self.CUresult.CUDA_SUCCESS, (status.CU_STREAM_CAPTURE_STATUS_ACTIVE if h in self.capturing
                                            else status.CU_STREAM_CAPTURE_STATUS_NONE)

    def cuGraphGetNodes(self, g, n):
        return self.CUresult.CUDA_SUCCESS, [], 3

    def cuGraphInstantiate(self, g, flags):
        return self.CUresult.CUDA_SUCCESS, f"exec-{g}"

    def cuGraphUpload(self, e, h):
        return (self.CUresult.CUDA_SUCCESS,)

    def cuGraphLaunch(self, e, h):
        self.launched.append((e, h))
        return (self.CUresult.CUDA_SUCCESS,)

    def cuGraphDestroy(self, g):
        self.destroyed.append(g)
        return (self.CUresult.CUDA_SUCCESS,)

    def cuGraphExecDestroy(self, e):
        self.destroyed.append(e)
        return (self.CUresult.CUDA_SUCCESS,)


class FakeStream:
    def __init__(self, h):
        self.h = h

    def synchronize(self):
        pass


@pytest.fixture
def fake_driver(monkeypatch):
    drv = FakeDriver()
    monkeypatch.setattr(graph, "_driver", lambda: drv)
    monkeypatch.setattr(graph, "simulator", lambda: False)
    monkeypatch.setattr(graph, "stream_handle", lambda s: s.h)
    monkeypatch.setattr(graph, "_sentinel_stream", lambda: FakeStream(99))
    monkeypatch.setattr(graph, "_BRANCHES", [FakeStream(7)])
    monkeypatch.setattr(graph, "_SIDE", [])
    return drv


def test_capture_flow_success(fake_driver):
    calls = []
    s = FakeStream(5)

    def step(st):
        calls.append(sorted(fake_driver.capturing))

    g = graph.capture(step, stream=s)
    assert calls == [[], [5, 99]]  # warm-up outside capture, then main + sentinel capturing
    assert g.captured and g.n_nodes == 3 and not fake_driver.capturing
    g.replay()
    g.replay(stream=FakeStream(6))
    assert fake_driver.launched == [("exec-graph5", 5), ("exec-graph5", 6)] and len(calls) == 2
    g.close()
    assert fake_driver.destroyed[-2:] == ["exec-graph5", "graph5"] and not g.captured


def test_capture_flow_step_raises(fake_driver):
    def allocating_step(st):
        fake_driver.invalid.add(5)
        exc = RuntimeError("Call to cuMemAlloc results in CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
        exc.code = FakeDriver.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        raise exc

    with pytest.raises(graph.GraphCaptureError, match="allocation.*cuMemAlloc") as err:
        graph.capture(allocating_step, stream=FakeStream(5), warmup=False)
    assert isinstance(err.value.__cause__, RuntimeError)
    assert not fake_driver.capturing  # main and sentinel both ended: the stream is usable


def test_capture_flow_legacy_stream_caught_by_sentinel(fake_driver):
    def legacy_step(st):
        fake_driver.invalid.add(99)  # a legacy-stream launch invalidates the blocking sentinel

    with pytest.raises(graph.GraphCaptureError, match="legacy default stream was used"):
        graph.capture(legacy_step, stream=FakeStream(5), warmup=False)
    assert not fake_driver.capturing and "graph5" in fake_driver.destroyed


def test_capture_flow_unjoined_branch(fake_driver):
    def unjoined_step(st):
        fake_driver.unjoined.add(5)
        fake_driver.capturing.add(7)  # the branch joined the capture and was never joined back

    with pytest.raises(graph.GraphCaptureError, match="not joined back"):
        graph.capture(unjoined_step, stream=FakeStream(5), warmup=False)
    assert not fake_driver.capturing  # the branch was taken out of capture mode too


def test_capture_refuses_legacy_stream(fake_driver):
    with pytest.raises(graph.GraphCaptureError, match="cannot capture the legacy default stream"):
        graph.capture(lambda st: None, stream=FakeStream(0), warmup=False)
