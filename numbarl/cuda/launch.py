"""Launch shapes and the simulator shim: every place where the GPU and the simulator differ in how
kernels are launched lives here, so trading and learning code has no simulator branches
(SPEC §2.1).

Under the numba CUDA simulator every GPU thread is a Python thread (about 0.1 ms each, plus
~30 ms per ``syncthreads`` per block), so kernels that walk their rows in a loop run with small
blocks there and the GPU shape on a device: :func:`shape` picks one of the two. Kernels read their
shape from ``blockDim`` (never a compiled-in constant that numba's on-disk cache could serve stale
across backends), so both shapes compute the same sums in the same order.

:func:`device_function` lets a kernel call an ``@njit`` function: numba-cuda compiles ``@jit``
functions for the device when a kernel calls them; under the simulator the kernel is Python and
its arrays are simulator wrappers that ``@njit`` code cannot take, so the call unwraps them to the
numpy arrays they hold (writes go straight to simulated device memory) and runs the same compiled
function. The env step (numbarl/env/core.py) is written once this way for the CPU reference, the
training env and the backtest.
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda.runtime import simulator

SIMULATOR = simulator()


def shape(gpu: int, sim: int) -> int:
    """A launch dimension: ``gpu`` on a device, ``sim`` under the simulator."""
    return int(sim) if SIMULATOR else int(gpu)


def blocks(n: int, block: int) -> int:
    """Blocks of ``block`` threads covering ``n`` items (at least one)."""
    return max(1, (int(n) + int(block) - 1) // int(block))


def row_block(n_rows: int, width: int, threads: int) -> tuple[int, tuple[int, int]]:
    """(blocks, (lanes, rows)) for a kernel with a thread row per item (blockIdx.x · rows +
    threadIdx.y) and lanes along its ``width`` elements: lanes = min(width, threads), rows =
    threads // lanes. A block then covers whole consecutive rows of a row-major [n, width] array
    (coalesced), with no division of a flat index."""
    lanes = max(1, min(int(width), int(threads)))
    rows = max(1, int(threads) // lanes)
    return blocks(n_rows, rows), (lanes, rows)


def device_function(fn):
    """The @njit function ``fn`` as a function kernels call (see the module docstring)."""
    if not SIMULATOR:
        return fn

    def call_on_simulator(*args):
        return fn(*(_simulated_array_to_numpy(a) for a in args))

    call_on_simulator.__name__ = getattr(fn, "__name__", "device_function")
    return call_on_simulator


def _simulated_array_to_numpy(x):
    if isinstance(x, tuple):
        values = tuple(_simulated_array_to_numpy(v) for v in x)
        return type(x)(*values) if hasattr(x, "_fields") else values
    item = x.__dict__.get("_item") if hasattr(x, "__dict__") else None  # in-kernel wrapper
    if item is not None:
        x = item
    ary = x.__dict__.get("_ary") if hasattr(x, "__dict__") else None  # simulated device array
    return ary if isinstance(ary, np.ndarray) else x
