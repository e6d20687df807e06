"""Device, stream and Arena: the fixed-address memory contract of SPEC §2.1.

Everything a captured graph touches is allocated before capture and never reallocated. An
:class:`Arena` is one device allocation per role (params, grads, optimizer state, activations,
env, replay, ...) carved into named, typed, shaped views. Views keep their addresses for the
life of the arena, so kernel launches and GEMM calls frozen into a graph stay valid.

Usage::

    params = Arena("params")
    params.add("trunk.w1", (64, 512), np.float32)
    params.add("trunk.b1", (512,), np.float32)
    params.allocate()            # one allocation; clear error when it does not fit
    w1 = params["trunk.w1"]      # device view [64, 512]
    flat = params.flat(np.float32)   # the whole buffer as one float32 vector (single-dtype arenas)
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import numpy as np

from numbarl.cuda import backend

ALIGN_BYTES = 256  # cuBLASLt and vector loads like 16-byte alignment; 256 keeps views cache-line aligned


class DeviceMemoryError(MemoryError):
    """A configuration does not fit in device memory."""


def cuda():
    """numba.cuda, imported after the backend was selected."""
    backend.select()
    from numba import cuda as _cuda

    return _cuda


def simulator() -> bool:
    """True when kernels run on the numba simulator (selects the backend first if nobody has)."""
    backend.select()
    return backend.simulator_active()


def device_name() -> str:
    if simulator():
        return "numba CUDA simulator (CPU)"
    dev = cuda().get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    return f"{name} (sm_{dev.compute_capability[0]}{dev.compute_capability[1]})"


_STREAM = None


def stream():
    """The process's compute stream: non-blocking (does not serialize with the legacy default
    stream) so that it can be captured. Under the simulator, a plain numba stream."""
    global _STREAM
    if _STREAM is None:
        _STREAM = new_stream()
    return _STREAM


def new_stream():
    """A new non-blocking stream (branch streams for fork/join inside a capture)."""
    c = cuda()
    if simulator():
        return c.stream()
    from cuda.bindings import driver

    c.current_context()  # make sure the primary context exists and is current
    err, handle = driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
    _check(err, "cuStreamCreate")
    s = c.external_stream(int(handle))
    s._numbarl_handle = handle  # keep the CUstream object alive with the wrapper
    return s


def upload(host) -> object:
    """A new device copy of a host array, complete on return.

    The copy runs on the compute stream and is synchronized: a plain ``cuda.to_device`` goes
    through the legacy default stream, which the non-blocking compute stream does not wait for,
    and a pageable host-to-device copy may return before its DMA has landed, so a kernel on the
    compute stream could read the buffer before it holds the value.
    """
    s = stream()
    d = cuda().to_device(np.ascontiguousarray(host), stream=s)
    s.synchronize()
    return d


def stream_handle(s) -> int:
    """Raw CUstream pointer of a numba stream (0 under the simulator)."""
    if simulator():
        return 0
    return int(s.handle) if not hasattr(s.handle, "value") else int(s.handle.value)


SIM_THREADS = 32  # threads of a grid-stride launch under the simulator (each is a Python thread)


def stride_grid(n: int, block: int, max_blocks: int = 4096) -> tuple[int, int]:
    """(blocks, threads) for a grid-stride kernel over n elements.

    On the GPU: enough blocks of `block` threads to cover n (capped at max_blocks; the kernel's
    stride loop covers the rest). Under the simulator: one block of SIM_THREADS threads, since a
    simulated thread costs ~0.1 ms to start and the loop does the rest. Only for kernels whose
    result does not depend on the launch shape (elementwise grid-stride loops).
    """
    if simulator():
        return 1, min(int(block), SIM_THREADS)
    return max(1, min(-(-int(n) // int(block)), int(max_blocks))), int(block)


def _check(result, what: str):
    from cuda.bindings import driver

    err = result[0] if isinstance(result, tuple) else result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, msg = driver.cuGetErrorString(err)
        raise RuntimeError(f"{what} failed: {err.name}: {msg.decode() if msg else ''}")
    return result


def memory_info() -> tuple[int, int]:
    """(free, total) bytes on the device; the simulator reports the host's RAM budget."""
    if simulator():
        return (8 << 30, 8 << 30)
    free, total = cuda().current_context().get_memory_info()
    return int(free), int(total)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass(frozen=True)
class View:
    name: str
    offset: int  # bytes from the start of the arena
    shape: tuple
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


_SNAPSHOT = threading.local()  # .pool: the pinned buffers of the pinned_snapshots block this thread is in


@contextlib.contextmanager
def pinned_snapshots(pool: dict):
    """Inside the block, Arena.to_host copies into page-locked host buffers kept in `pool` (made at
    the first use, reused by every later block with the same pool): one asynchronous copy per view
    and no fresh pageable memory. The arrays returned stay valid (and unchanged) until the next
    block with this pool; a caller that hands them to another thread (a background checkpoint
    write) waits for it before that block. Checkpoint snapshots: numbarl/run/trainer.py."""
    previous = getattr(_SNAPSHOT, "pool", None)
    _SNAPSHOT.pool = pool
    try:
        yield pool
    finally:
        _SNAPSHOT.pool = previous


def _pinned(pool: dict, key, view: View) -> np.ndarray:
    buf = pool.get(key)
    if buf is None or buf.shape != view.shape or buf.dtype != view.dtype:
        buf = pool[key] = cuda().pinned_array(view.shape, dtype=view.dtype)
    return buf


class Arena:
    """One device allocation per role, carved into named views with fixed addresses."""

    def __init__(self, role: str):
        self.role = role
        self.views: dict[str, View] = {}
        self.nbytes = 0
        self._buffer = None
        self._cache: dict[str, object] = {}

    # -- planning -----------------------------------------------------------------------------
    def add(self, name: str, shape, dtype=np.float32) -> View:
        if self._buffer is not None:
            raise RuntimeError(f"Arena {self.role!r} is already allocated; cannot add {name!r}")
        if name in self.views:
            raise ValueError(f"Arena {self.role!r} already has a view named {name!r}")
        shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"Arena {self.role!r}: view {name!r} has a negative dimension {shape}")
        dtype = np.dtype(dtype)
        offset = -(-self.nbytes // ALIGN_BYTES) * ALIGN_BYTES
        view = View(name, offset, shape, dtype)
        self.views[name] = view
        self.nbytes = offset + view.nbytes
        return view

    def plan(self) -> str:
        """Human-readable memory plan of this arena."""
        lines = [f"arena {self.role}: {_fmt_bytes(self.nbytes)} in {len(self.views)} views"]
        for v in self.views.values():
            lines.append(f"  {v.name:<32} {str(v.dtype):<8} {str(list(v.shape)):<20} {_fmt_bytes(v.nbytes):>10} @ {v.offset}")
        return "\n".join(lines)

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, zero: bool = True) -> "Arena":
        if self._buffer is not None:
            return self
        need = max(self.nbytes, ALIGN_BYTES)
        free, total = memory_info()
        if need > free:
            raise DeviceMemoryError(
                f"Arena {self.role!r} needs {need:,} bytes ({_fmt_bytes(need)}) but the device has "
                f"{free:,} bytes ({_fmt_bytes(free)}) free of {_fmt_bytes(total)}; reduce the "
                "configuration (n_envs, batch size, replay capacity or layer widths)."
            )
        c = cuda()
        self._buffer = c.device_array(need, dtype=np.uint8)
        if zero:  # once, before any capture, on the compute stream (ordered before every later use)
            s = stream()
            self._buffer.copy_to_device(np.zeros(need, dtype=np.uint8), stream=s)
            s.synchronize()
        return self

    @property
    def allocated(self) -> bool:
        return self._buffer is not None

    def __getitem__(self, name: str):
        if self._buffer is None:
            raise RuntimeError(f"Arena {self.role!r} is not allocated yet (call allocate())")
        arr = self._cache.get(name)
        if arr is None:
            try:
                v = self.views[name]
            except KeyError:
                raise KeyError(f"Arena {self.role!r} has no view {name!r}; views: {list(self.views)}") from None
            arr = self._buffer[v.offset : v.offset + v.nbytes].view(v.dtype)
            if len(v.shape) != 1:
                arr = arr.reshape(v.shape)
            self._cache[name] = arr
        return arr

    def __contains__(self, name: str) -> bool:
        return name in self.views

    def flat(self, dtype=np.float32):
        """The whole arena as one vector of `dtype` (for flat optimizers over a params arena).

        Padding between views is included and stays zero, so it never changes a norm or an update.
        """
        dtype = np.dtype(dtype)
        n = self._buffer.size // dtype.itemsize
        return self._buffer[: n * dtype.itemsize].view(dtype)

    def buffer(self):
        return self._buffer

    def to_host(self) -> dict[str, np.ndarray]:
        """Copy every view to host numpy arrays (checkpoints, tests). Syncs the stream. Inside a
        `pinned_snapshots(pool)` block the arrays are the pool's page-locked buffers (see there)."""
        s = stream()
        pool = getattr(_SNAPSHOT, "pool", None)
        if pool is None:
            out = {name: self[name].copy_to_host(stream=s) for name in self.views}
        else:
            out = {name: self[name].copy_to_host(_pinned(pool, (id(self), name), self.views[name]), stream=s)
                   for name in self.views}
        s.synchronize()
        return out

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Copy host arrays into the named views (shapes and dtypes must match)."""
        c = cuda()
        for name, value in arrays.items():
            v = self.views.get(name)
            if v is None:
                raise KeyError(f"Arena {self.role!r} has no view {name!r}")
            value = np.ascontiguousarray(value, dtype=v.dtype)
            if value.shape != v.shape:
                raise ValueError(f"Arena {self.role!r}: {name!r} expects shape {v.shape}, got {value.shape}")
            self[name].copy_to_device(value, stream=stream())
        stream().synchronize()
