"""numbarl's adjustments to the numba CUDA simulator (numbarl.cuda.backend): a short GIL switch
interval (speed), an atomic static shared-array allocation (correctness under that speed), and
barrier-free blocks run in the launching thread (speed; kernels with a barrier keep their threads)."""

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


# ---------------------------------------------------------------------------------------------
# barrier-free blocks run in the launching thread
# ---------------------------------------------------------------------------------------------
_RAN_IN = []


def _note_thread():
    import threading

    _RAN_IN.append(threading.get_ident())


@_cuda.jit(device=True)
def _sync_in_a_device_function():
    _cuda.syncthreads()


@_cuda.jit
def _stride_kernel(x, out):
    _note_thread()
    for i in range(_cuda.grid(1), x.shape[0], _cuda.gridsize(1)):
        out[i] = x[i] * np.float32(2) + _cuda.threadIdx.x * np.float32(0) + np.float32(_cuda.laneid * 0)


@_cuda.jit
def _neighbour_kernel(out):
    """Each thread reads its right neighbour's shared value after a barrier reached through a device function."""
    _note_thread()
    sh = _cuda.shared.array(8, np.float32)
    t = _cuda.threadIdx.x
    sh[t] = t + 10 * _cuda.blockIdx.x
    _sync_in_a_device_function()
    out[_cuda.blockIdx.x, t] = sh[(t + 1) % 8]


# they call Python (_note_thread): the simulator runs them, a GPU cannot (numbarl.cuda.ptxcheck skips them)
_stride_kernel.py_func.__numbarl_simulator_only__ = True
_neighbour_kernel.py_func.__numbarl_simulator_only__ = True


@_cuda.jit
def _index_error_kernel(out):
    out[_cuda.threadIdx.x + 5] = 1.0


def test_barrier_free_kernels_run_in_the_launching_thread_with_each_threads_indices():
    import threading

    _RAN_IN.clear()
    x = np.arange(100, dtype=np.float32)
    out = np.zeros(100, np.float32)
    _stride_kernel[3, 8](x, out)
    np.testing.assert_array_equal(out, 2 * x)  # every element by the (block, thread) that owns it
    assert set(_RAN_IN) == {threading.get_ident()} and len(_RAN_IN) == 24


def test_a_barrier_behind_a_device_function_keeps_the_threads():
    import threading

    _RAN_IN.clear()
    out = np.zeros((2, 8), np.float32)
    _neighbour_kernel[2, 8](out)
    want = np.array([[(t + 1) % 8 + 10 * b for t in range(8)] for b in range(2)], np.float32)
    np.testing.assert_array_equal(out, want)  # one after another, threads 0..6 would read unwritten neighbours
    assert len(_RAN_IN) == 16 and threading.get_ident() not in _RAN_IN  # simulator threads (idents are reused)


def test_an_error_names_the_thread_and_the_block():
    with pytest.raises(IndexError, match=r"tid=\[3, 0, 0\] ctaid=\[0, 0, 0\]"):
        _index_error_kernel[1, 4](np.zeros(8, np.float32))


def test_the_detector_sees_barriers_in_called_functions_and_closures():
    assert backend._may_wait_for_other_threads(_neighbour_kernel.py_func)
    assert not backend._may_wait_for_other_threads(_stride_kernel.py_func)

    def make():
        inner = _sync_in_a_device_function

        def k():
            inner()
        return k

    assert backend._may_wait_for_other_threads(make())

    from numbarl.cuda import reduce as red

    # red.block_reduce reaches syncthreads
    def through_a_module():  # module.device_function(...), the name only an attribute of a module global
        red.block_reduce(None, None, 0, 0)

    assert backend._may_wait_for_other_threads(through_a_module)


def _kernel_calling(op):
    @_cuda.jit
    def k(out):
        op(out)
    return k


@_cuda.jit(device=True)
def _plain_op(out):
    out[_cuda.threadIdx.x] = _cuda.threadIdx.x


@_cuda.jit(device=True)
def _neighbour_op(out):
    sh = _cuda.shared.array(4, np.float32)
    t = _cuda.threadIdx.x
    sh[t] = t
    _cuda.syncthreads()
    out[t] = sh[(t + 1) % 4]


_OPS = (_neighbour_op,)


@_cuda.jit
def _tuple_kernel(out):
    _OPS[0](out)


def test_factory_kernels_sharing_code_and_device_functions_in_a_tuple_get_their_own_verdict():
    """A factory's kernels share one code object: the one whose op has a barrier keeps its threads even when
    the barrier-free one ran first; so does a kernel that calls a device function held in a tuple."""
    out = np.zeros(4, np.float32)
    _kernel_calling(_plain_op)[1, 4](out)
    np.testing.assert_array_equal(out, [0, 1, 2, 3])
    _kernel_calling(_neighbour_op)[1, 4](out)
    np.testing.assert_array_equal(out, [1, 2, 3, 0])
    out[:] = 0
    _tuple_kernel[1, 4](out)
    np.testing.assert_array_equal(out, [1, 2, 3, 0])
