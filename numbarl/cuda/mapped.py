"""Pinned, device-mapped readback buffers: losses, stats and flags without a sync per step.

Kernels write straight into pinned host memory mapped into the device address space (zero-copy),
so a training step needs no device-to-host copy (SPEC §2.1: no host round trips on the hot
path). The host reads the values only at log intervals, after waiting on an event recorded
behind the writers::

    stats = MappedBuffer(8)                 # before capture: allocation
    graph = capture(step)                   # the step's kernels write into stats.device
    for i in range(n_steps):
        graph.replay()
        if i % log_every == 0:
            stats.record(stream)            # on the host, outside any capture
            loss = stats.read()[0]          # waits for that event only, then copies 8 floats

``record`` must not be called inside a captured step: an event recorded during capture becomes
a graph edge, not something the host can wait on. Reading without a recorded event is an error
rather than a silent race. Pass ``.device`` (the whole buffer, not a slice) to kernels.

Simulator: the same API over a simulated device array; the simulator runs kernels synchronously,
so the event is a formality there.
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda.runtime import cuda, simulator, stream_handle

_cuda = cuda()


class MappedBuffer:
    """n values of `dtype` in pinned host memory that kernels write directly."""

    def __init__(self, n: int, dtype=np.float32):
        n = int(n)
        if n < 1:
            raise ValueError(f"MappedBuffer needs n >= 1 elements, got {n}")
        self.dtype = np.dtype(dtype)
        self.n = n
        self._array = _cuda.mapped_array(n, dtype=self.dtype)
        if simulator():
            self._host = self._array._ary
        else:
            self._host = np.ndarray.view(self._array, np.ndarray)
        self._host[...] = 0
        self._event = _cuda.event() if simulator() else _cuda.event(timing=False)
        self._recorded = False

    @property
    def device(self):
        """The array kernels write (pass it whole, not a slice)."""
        return self._array

    @property
    def host(self):
        """numpy view of the same memory; its values are only meaningful after :meth:`read`'s wait."""
        return self._host

    def record(self, stream) -> None:
        """Record an event on `stream` behind everything enqueued so far (the writers)."""
        if not simulator():
            from cuda.bindings import driver

            err, status = driver.cuStreamIsCapturing(driver.CUstream(stream_handle(stream)))
            if err == driver.CUresult.CUDA_SUCCESS and status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
                raise RuntimeError(
                    "MappedBuffer.record() inside a graph capture: an event recorded while capturing "
                    "becomes a graph edge the host cannot wait on. Call record(stream) after replay()."
                )
        self._event.record(stream)
        self._recorded = True

    def read(self) -> np.ndarray:
        """Wait for the last recorded event, then return a copy of the values."""
        if not self._recorded:
            raise RuntimeError(
                "MappedBuffer.read() before record(stream): without an event the host would race "
                "the kernels writing the buffer"
            )
        self._event.synchronize()
        return self._host.copy()

    def reset(self, value=0) -> None:
        """Fill with `value` from the host (outside the hot path: waits for the last record first)."""
        if self._recorded:
            self._event.synchronize()
        self._host[...] = value

    def __len__(self):
        return self.n
