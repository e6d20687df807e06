"""Test setup: the simulator switches itself on when there is no GPU (no env variable needed)."""

import os

import numpy as np
import pytest

from numbarl.cuda import backend

SIMULATOR = backend.select()

if not SIMULATOR:
    # Kernels run on numbarl's compute stream, which is non-blocking (numbarl.cuda.runtime.stream:
    # it must be, to be captured), so a plain `copy_to_host()` / `copy_to_device()` on the legacy
    # default stream does not wait for them: on a busy GPU a test would read a result before the
    # kernel wrote it, or overwrite an input a queued kernel has not read yet (both seen on the
    # H200 with training runs sharing the GPU). Tests copy without a stream, so here such a copy
    # first waits for the compute stream.
    from numba.cuda.cudadrv.devicearray import DeviceNDArrayBase

    from numba import cuda

    from numbarl.cuda.runtime import stream as _compute_stream

    _copy_to_host = DeviceNDArrayBase.copy_to_host

    def _copy_to_host_after_compute(self, ary=None, stream=0):
        if not stream:
            _compute_stream().synchronize()
        return _copy_to_host(self, ary, stream)

    DeviceNDArrayBase.copy_to_host = _copy_to_host_after_compute

    _copy_to_device = DeviceNDArrayBase.copy_to_device

    def _copy_to_device_after_compute(self, ary, stream=0):
        if not stream:
            _compute_stream().synchronize()
        out = _copy_to_device(self, ary, stream)
        if not stream:
            # a copy from pageable host memory may return before its DMA has landed (numbarl.cuda.runtime.upload),
            # and the next kernel on the compute stream does not wait for the legacy stream: it read the previous
            # step's Q in tests/env/test_gpu_env.py once (fourteenth session, six test workers on one H200)
            cuda.synchronize()
        return out

    DeviceNDArrayBase.copy_to_device = _copy_to_device_after_compute


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts, pytest-xdist, files kept whole per worker): two worker
    processes for the simulator suite (~0.6x its serial wall time on 2 cores; most tests hold one
    core), none for a GPU run (`-m gpu`: one GPU, and its speed tests time kernels alone)."""
    marks = config.getoption("markexpr") or ""
    if "gpu" in marks and "not gpu" not in marks:
        return 0
    return max(1, min(2, os.cpu_count() or 1))


# The longest files of the simulator suite (minutes each on 2 cores), scheduled first and in this
# order: with pyproject's `--dist loadfile --no-loadscope-reorder` the two xdist workers start on
# the first two, so they never queue behind each other at the end of a run (the suite's wall time
# was 11-14 minutes depending on which worker drew both).
HEAVY_FILES = ("tests/run/test_sweep.py", "tests/rl/test_components.py")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a real CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and SIMULATOR:
            item.add_marker(skip_gpu)
    rank = {name: i for i, name in enumerate(HEAVY_FILES)}
    # a stable sort: the heavy files first (in HEAVY_FILES order), every other file as collected;
    # every xdist worker collects and sorts alike, so the collections still agree
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture
def rng(request):
    """Random inputs, reproducible. By default the seed comes from the test's id: the same inputs
    on every run, so a CI run cannot fail by the luck of a draw. NUMBARL_TEST_SEED=random draws
    fresh seeds (a sweep for rare cases: run it after changing a test or the code under it), and
    NUMBARL_TEST_SEED=<n> replays the seed a failure printed."""
    import os
    import zlib

    choice = os.environ.get("NUMBARL_TEST_SEED", "")
    if choice == "random":
        seed = int(np.random.SeedSequence().entropy % (2**32))
    elif choice:
        seed = int(choice)
    else:
        seed = zlib.crc32(request.node.nodeid.encode("utf-8"))
    print(f"numpy seed {seed}")
    return np.random.default_rng(seed)
