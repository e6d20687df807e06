"""CUDA graphs for training steps: capture a step function once, replay it with one launch.

A *step* is a Python function ``step_fn(stream)`` that only enqueues work on `stream` (numba
kernels, :func:`numbarl.cuda.blas.gemm`, event waits) on buffers allocated before capture, and
reads every per-step scalar from device memory (SPEC §2.1)::

    graph = capture(step_fn)      # runs step_fn once eagerly, then captures and instantiates it
    for _ in range(n):
        graph.replay()            # one cuGraphLaunch: same kernels, same arguments, same buffers

Capture (GPU): ``cuStreamBeginCapture`` in GLOBAL mode (cuBLASLt needs it) on the step's stream,
inside ``cuda.defer_cleanup()`` so numba frees nothing mid-capture, ``cuStreamEndCapture``,
``cuGraphInstantiate`` once, ``cuGraphUpload``. The warm-up run before capture compiles and
loads every kernel and creates every GEMM plan and workspace, and it is a real step: it changes
device state exactly like a replay does (pass ``warmup=False`` only when everything is already
warm). The number of executed steps is the same in graph, eager and simulator mode.

What breaks a capture fails loudly with :class:`GraphCaptureError` (never a hang or a silently
wrong graph), naming the cause, and the stream is out of capture mode afterwards:
allocation (``device_array``, ``to_device``, ``mapped_array``), host copies (``copy_to_host``,
``copy_to_device`` from host memory), synchronization (``cuda.synchronize``,
``stream.synchronize``, ``event.synchronize``), use of the legacy default stream (a launch or
copy without ``stream=``), branches forked and not joined, a GEMM plan first needed inside
capture. The legacy-stream case is caught with a *sentinel*: an empty capture on a private
blocking stream runs alongside the real one, and CUDA forbids any use of the legacy stream while a
blocking stream is capturing; without it, a launch on the legacy stream would run once at
capture time and be missing from the graph.

Fork/join: independent work (aux heads) can run on branch streams inside a step::

    branches = fork(stream, 2)    # both branches wait for everything enqueued on stream so far
    head_a(branches[0]); head_b(branches[1])
    join(stream, branches)        # stream waits for both branches

Inside a capture the event record/wait pairs become graph edges.

Backends: under the simulator (or with :func:`set_eager` / ``eager=True``, the CLI's
``--no-graph``) the same API runs eagerly: ``capture`` runs the warm-up step and ``replay``
re-calls ``step_fn(stream)``.
"""

from __future__ import annotations

from numbarl.cuda.runtime import cuda, new_stream, simulator, stream_handle
from numbarl.cuda.runtime import stream as default_stream

_cuda = cuda()
_EAGER = False
# callables capture() runs before it begins a GLOBAL-mode capture: device work of another thread
# (allocations, host copies) must not run during one; such a thread registers the wait for it here
# (numbarl/run/fold_benchmarks.py)
BEFORE_CAPTURE: list = []

HINTS = (
    "allocation inside capture (device_array/to_device/mapped_array, or a buffer created on first use)",
    "host copy (copy_to_host, copy_to_device from host memory, implicit copies of numpy arguments to a kernel)",
    "synchronize (cuda.synchronize, stream.synchronize, event.synchronize/query)",
    "launch or copy on the legacy default stream (kernel[grid, block] without a stream, a copy without stream=)",
    "a branch stream forked and not joined back (graph.join)",
    "a GEMM plan or workspace first needed inside capture (run the step eagerly once first)",
)

# what each capture error code means, in terms of step code
_CAUSES = {
    "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED": "an operation not permitted while capturing: an allocation, a synchronous host copy or a synchronize",
    "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED": "the capture was invalidated by an earlier illegal operation (allocation, host copy, synchronize or legacy-stream use)",
    "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT": "the legacy default stream was used while capturing (a kernel launch or copy without stream=)",
    "CUDA_ERROR_STREAM_CAPTURE_UNJOINED": "work forked onto a branch stream was not joined back into the capture stream (call join)",
    "CUDA_ERROR_STREAM_CAPTURE_ISOLATION": "a captured stream waited on an event recorded outside the capture",
    "CUDA_ERROR_STREAM_CAPTURE_MERGE": "two separate captures were merged through an event",
    "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED": "capture was ended on a stream that did not begin it",
    "CUDA_ERROR_CAPTURED_EVENT": "an event recorded inside the capture was queried or synchronized",
    "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD": "capture was ended from another thread",
}


class GraphCaptureError(RuntimeError):
    """A step could not be captured into a CUDA graph; the message names the cause."""


def set_eager(flag: bool) -> None:
    """Process-wide switch (the CLI's ``--no-graph``): replay re-calls the step instead of launching a graph."""
    global _EAGER
    _EAGER = bool(flag)


def eager_mode() -> bool:
    return _EAGER or simulator()


# ---------------------------------------------------------------------------------------------
# driver helpers
# ---------------------------------------------------------------------------------------------
def _driver():
    from cuda.bindings import driver

    return driver


def _ok(result, what):
    driver = _driver()
    err = result[0] if isinstance(result, tuple) else result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise GraphCaptureError(f"{what} failed: {_err_name(err)}: {_CAUSES.get(_err_name(err), '')}".rstrip(": "))
    return result[1] if isinstance(result, tuple) and len(result) == 2 else result


def _err_name(err) -> str:
    return getattr(err, "name", str(err))


def _cause_of(exc: BaseException) -> str:
    """A person-readable cause for an exception raised inside a capture."""
    code = getattr(exc, "code", None)
    name = _err_name(code) if code is not None else ""
    cause = _CAUSES.get(name)
    text = f"{type(exc).__name__}: {exc}"
    return f"{cause} ({text})" if cause else text


def _end_capture(handle):
    """End a capture whatever its state; returns (error name or None, CUgraph or None)."""
    driver = _driver()
    err, graph = driver.cuStreamEndCapture(handle)
    if err != driver.CUresult.CUDA_SUCCESS:
        return _err_name(err), None
    return None, graph


def _is_capturing(handle) -> bool:
    driver = _driver()
    err, status = driver.cuStreamIsCapturing(handle)
    return err == driver.CUresult.CUDA_SUCCESS and status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


def _fail(step_fn, cause: str) -> GraphCaptureError:
    name = getattr(step_fn, "__qualname__", repr(step_fn))
    hints = "\n".join(f"  - {h}" for h in HINTS)
    return GraphCaptureError(
        f"capturing step {name!r} into a CUDA graph failed: {cause}.\n"
        f"Things that break a capture:\n{hints}\n"
        "Run the step with graph.set_eager(True) (--no-graph) to check it works outside a graph."
    )


_SENTINEL = None


def _sentinel_stream():
    """A private *blocking* stream; capturing it makes any legacy-stream use an error."""
    global _SENTINEL
    if _SENTINEL is None:
        _SENTINEL = _cuda.stream()  # numba streams are created blocking (flags 0)
    return _SENTINEL


# ---------------------------------------------------------------------------------------------
# Graph
# ---------------------------------------------------------------------------------------------
class Graph:
    """A captured step. ``replay()`` launches it (or re-calls the step in eager mode)."""

    def __init__(self, step_fn, stream, graph=None, graph_exec=None, n_nodes=0):
        self.step_fn = step_fn
        self.stream = stream
        self._graph = graph
        self._exec = graph_exec
        self.n_nodes = n_nodes
        self.replays = 0

    @property
    def captured(self) -> bool:
        """True when replay launches a CUDA graph, False when it re-calls the step."""
        return self._exec is not None

    def replay(self, stream=None):
        """Run the step once more: one cuGraphLaunch on `stream` (default: the capture stream).
        Asynchronous: returns as soon as the work is enqueued."""
        s = self.stream if stream is None else stream
        if self._exec is None:
            self.step_fn(s)
        else:
            driver = _driver()
            err = driver.cuGraphLaunch(self._exec, driver.CUstream(stream_handle(s)))
            err = err[0] if isinstance(err, tuple) else err
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuGraphLaunch failed: {_err_name(err)}")
        self.replays += 1

    def close(self):
        """Destroy the executable graph (also done at interpreter exit by the driver)."""
        if self._exec is None and self._graph is None:
            return
        driver = _driver()
        if self._exec is not None:
            driver.cuGraphExecDestroy(self._exec)
            self._exec = None
        if self._graph is not None:
            driver.cuGraphDestroy(self._graph)
            self._graph = None

    def __repr__(self):
        mode = f"graph of {self.n_nodes} nodes" if self.captured else "eager"
        return f"Graph({getattr(self.step_fn, '__qualname__', self.step_fn)!r}, {mode}, replays={self.replays})"


def capture(step_fn, stream=None, warmup=True, eager=None) -> Graph:
    """Capture ``step_fn(stream)`` into a CUDA graph and instantiate it once.

    warmup: run the step eagerly first (compiles kernels, creates GEMM plans and workspaces). It
    is a real step: state advances once. eager: True to skip the graph (replay re-calls the step);
    None follows :func:`set_eager` and the simulator. Raises :class:`GraphCaptureError` with the
    cause when the step cannot be captured; the stream is usable afterwards.
    """
    s = default_stream() if stream is None else stream
    if eager is None:
        eager = eager_mode()
    if simulator():
        eager = True
    if warmup:
        step_fn(s)
    if eager:
        return Graph(step_fn, s)

    driver = _driver()
    handle = stream_handle(s)
    if handle == 0:
        raise GraphCaptureError(
            "cannot capture the legacy default stream; use numbarl.cuda.runtime.stream() or new_stream()"
        )
    s.synchronize()  # warm-up errors surface here, outside the capture
    for wait in tuple(BEFORE_CAPTURE):
        wait()
    sentinel = _sentinel_stream()
    h_main = driver.CUstream(handle)
    h_sentinel = driver.CUstream(stream_handle(sentinel))
    mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL

    graph = None
    with _cuda.defer_cleanup():
        _ok(driver.cuStreamBeginCapture(h_sentinel, mode), "cuStreamBeginCapture (sentinel)")
        try:
            _ok(driver.cuStreamBeginCapture(h_main, mode), "cuStreamBeginCapture")
        except GraphCaptureError:
            _end_capture(h_sentinel)
            raise
        failure = None
        try:
            step_fn(s)
        except Exception as exc:  # noqa: BLE001 - re-raised below with the cause
            failure = exc
        main_err, graph = _end_capture(h_main)
        sentinel_err, sentinel_graph = _end_capture(h_sentinel)
        for b in _BRANCHES + _SIDE:  # a failed capture must not leave a branch stream capturing
            hb = driver.CUstream(stream_handle(b))
            if _is_capturing(hb):
                _end_capture(hb)
        if sentinel_graph is not None:
            driver.cuGraphDestroy(sentinel_graph)
        if failure is not None or main_err is not None or sentinel_err is not None:
            if graph is not None:
                driver.cuGraphDestroy(graph)
            if failure is not None:
                cause = _cause_of(failure)
            elif sentinel_err is not None:
                cause = _CAUSES["CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"] + f" (sentinel capture ended with {sentinel_err})"
            else:
                cause = _CAUSES.get(main_err, main_err) + f" ({main_err})"
            err = _fail(step_fn, cause)
            if failure is not None:
                raise err from failure
            raise err

    if _is_capturing(h_main):  # never expected: EndCapture succeeded
        raise _fail(step_fn, "the stream is still capturing after cuStreamEndCapture")
    n_nodes = _node_count(graph)
    try:
        graph_exec = _ok(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    except GraphCaptureError:
        driver.cuGraphDestroy(graph)
        raise
    _ok(driver.cuGraphUpload(graph_exec, h_main), "cuGraphUpload")
    return Graph(step_fn, s, graph, graph_exec, n_nodes)


def _node_count(graph) -> int:
    """Number of nodes in a captured graph (-1 when the driver will not say)."""
    driver = _driver()
    result = driver.cuGraphGetNodes(graph, 0)
    if result[0] != driver.CUresult.CUDA_SUCCESS:
        return -1
    return int(result[-1])


# ---------------------------------------------------------------------------------------------
# fork / join
# ---------------------------------------------------------------------------------------------
_BRANCHES: list = []
_EVENT = None


def _event():
    # One event serves every fork and join: each record is followed at once by its waits, and a
    # wait uses the event's most recent record at the time it is enqueued, so reuse is safe.
    global _EVENT
    if _EVENT is None:
        _EVENT = _cuda.event(timing=False)
    return _EVENT


def branch_streams(n: int) -> list:
    """The first n branch streams of the process pool (created on first use, then reused)."""
    while len(_BRANCHES) < n:
        _BRANCHES.append(new_stream())
    return _BRANCHES[:n]


def fork(stream, n: int) -> list:
    """n branch streams that wait for everything enqueued on `stream` so far."""
    if n < 1:
        raise ValueError(f"fork needs n >= 1 branches, got {n}")
    branches = branch_streams(n)
    if simulator():
        return branches
    ev = _event()
    ev.record(stream)
    for b in branches:
        ev.wait(b)
    return branches


def join(stream, branches) -> None:
    """`stream` waits for everything enqueued on each branch so far."""
    if simulator():
        return
    ev = _event()
    for b in branches:
        ev.record(b)
        ev.wait(stream)


# ---------------------------------------------------------------------------------------------
# work beside a stream: what nothing later on it reads (weight gradients, statistics)
# ---------------------------------------------------------------------------------------------
_BESIDE: list = []  # stack of (main stream, side stream) of the open `beside` blocks (the step's thread only)
_SIDE: list = []  # the side stream (created on first use)


class beside:
    """Inside ``with beside(stream):`` each :func:`side_stream` call on `stream` returns a side stream that has
    waited for everything enqueued on `stream` so far, for work that nothing later on `stream` inside the block
    reads: a layer's weight gradient while `stream` goes on with the input gradient, a loss's scalar reduction,
    the step's statistics. The block's exit joins the side stream back. All such work of the block goes to the one
    side stream, so it stays in program order among itself (a later accumulating write of a gradient comes after
    the first). Each kernel computes what it computed on one stream: the bits are the same. `on=False` makes the
    block a no-op. Work on `stream` inside the block must not read what a side-stream launch writes, nor overwrite
    what it reads (its inputs live until the join)."""

    def __init__(self, stream, on: bool = True):
        self.stream, self.on, self._pushed = stream, bool(on), False

    def __enter__(self):
        if self.on:
            if not _SIDE:  # its own stream, apart from fork's pool: a fork inside the block gets other streams
                _SIDE.append(new_stream())
            _BESIDE.append((self.stream, _SIDE[0]))
            self._pushed = True
        return self

    def __exit__(self, *exc):
        if self._pushed:
            _, side = _BESIDE.pop()
            join(self.stream, [side])
        return False


def side_stream(stream):
    """Where work beside `stream` goes: inside ``beside(stream)`` the side stream, after it waits for everything
    enqueued on `stream` so far; otherwise `stream` itself."""
    if not _BESIDE or _BESIDE[-1][0] is not stream:
        return stream
    side = _BESIDE[-1][1]
    if not simulator():
        ev = _event()
        ev.record(stream)
        ev.wait(side)
    return side
