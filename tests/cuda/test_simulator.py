"""numbarl's adjustments to the numba CUDA simulator (numbarl.cuda.backend): a short GIL switch
interval (speed) and an atomic static shared-array allocation (correctness under that speed)."""

import sys
import time
import types

import numpy as np
import pytest

from numbarl.cuda import backend
from numbarl.cuda.runtime import cuda

pytestmark = pytest.mark.skipif(not backend.simulator_active(), reason="simulator only")

_cuda = cuda()


@_cuda.jit
def _block_sum_kernel(out):
    sh = _cuda.shared.array(16, np.float32)
    t = _cuda.threadIdx.x
    sh[t] = t
    _cuda.syncthreads()
    s = np.float32(0)
    for j in range(16):
        s += sh[j]
    out[_cuda.blockIdx.x, t] = s


def test_switch_interval_is_short():
    assert sys.getswitchinterval() == pytest.approx(backend.SIM_SWITCH_INTERVAL_S)


def test_every_thread_of_a_block_gets_the_same_shared_array(monkeypatch):
    """With the allocation made slow, the simulator's own check-then-create hands some threads
    a private array (16 of 64 sums wrong when measured); numbarl's locked allocation does not."""
    from numba.cuda.simulator import kernelapi

    slow = types.SimpleNamespace(**{n: getattr(np, n) for n in dir(np) if not n.startswith("__")})

    def slow_empty(*args, **kwargs):
        time.sleep(0.002)  # widens the window between "no array for this call site" and creating it
        return np.empty(*args, **kwargs)

    slow.empty = slow_empty
    monkeypatch.setattr(kernelapi, "np", slow)
    out = np.zeros((4, 16), np.float32)
    _block_sum_kernel[4, 16](out)
    np.testing.assert_array_equal(out, np.full((4, 16), 120.0, np.float32))
