"""The one backend switch: real GPU or the numba CUDA simulator (SPEC §2.1).

numba reads ``NUMBA_ENABLE_CUDASIM`` once, when ``numba.cuda`` is first imported, so
:func:`select` must run before anything imports ``numba.cuda``. It probes the CUDA driver with
ctypes (no numba import) and switches the simulator on when there is no usable GPU, or when
asked to (``--simulate``).
"""

from __future__ import annotations

import ctypes
import os
import sys

_ENV = "NUMBA_ENABLE_CUDASIM"

# The simulator runs every thread of a block as a Python thread while the launching thread polls
# them in a busy loop; with Python's default 5 ms GIL switch interval most of a block's time is
# that poll holding the GIL. 0.1 ms makes simulated kernels 4-8x faster (measured on the C51 head
# kernel: 1.9 s -> 0.25 s per launch). Applied once, only when the simulator is selected.
SIM_SWITCH_INTERVAL_S = 1e-4
_tuned = False


def gpu_present() -> bool:
    """True when the CUDA driver loads and reports at least one device."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    try:
        if lib.cuInit(0) != 0:
            return False
        count = ctypes.c_int(0)
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return False
        return count.value > 0
    except AttributeError:
        return False


def select(simulate: bool | None = None) -> bool:
    """Choose the backend; returns True when the simulator is in use.

    simulate=None: use the GPU when one is present, else the simulator.
    simulate=True: force the simulator even on a GPU machine (kernel debugging with print/pdb).
    simulate=False: require a GPU (error when there is none).
    """
    if "numba.cuda" in sys.modules:
        active = simulator_active()
        if simulate is not None and simulate != active:
            raise RuntimeError(
                "numba.cuda was imported before numbarl.cuda.backend.select(); the backend can no "
                f"longer switch to {'the simulator' if simulate else 'the GPU'}. Call select() first."
            )
        if active:
            _tune_simulator()
        return active
    if simulate is None:
        simulate = os.environ.get(_ENV, "") == "1" or not gpu_present()
    elif simulate is False and not gpu_present():
        raise RuntimeError("no CUDA GPU found (libcuda.so.1 missing or no device); use --simulate")
    os.environ[_ENV] = "1" if simulate else "0"
    os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")
    if "numba" in sys.modules:  # plain numba read its config already: make it read ours
        from numba.core import config

        config.reload_config()
    if simulate:
        _tune_simulator()
    return simulate


def _tune_simulator() -> None:
    global _tuned
    if not _tuned:
        _lock_simulator_shared_arrays()
        if os.environ.get("NUMBARL_SIM_THREADS", "") != "1":
            _run_barrier_free_blocks_in_one_thread()
        if os.environ.get("NUMBARL_RECORD_LAUNCHES"):  # numbarl.cuda.ptxcheck: kernels the GPU must compile
            from numbarl.cuda.ptxcheck import install_recorder

            install_recorder(os.environ["NUMBARL_RECORD_LAUNCHES"])
        sys.setswitchinterval(SIM_SWITCH_INTERVAL_S)
        _tuned = True


def _lock_simulator_shared_arrays() -> None:
    """Make the simulator's static shared-array allocation atomic.

    numba's simulator gives the threads of a block one array per `cuda.shared.array` call site by
    a check-then-create on a dict (`FakeCUDAShared.array`). Two threads that both find the site
    missing each create an array, and the first keeps a private copy its block never sees: seen
    as a wrong column of a simulated tiled GEMM once the short switch interval above made thread
    switches frequent. This replacement does the same lookup under a lock (and finds the call
    site from the caller's frame, as the original does from the stack); dynamic shared memory
    (shape 0) is unchanged.
    """
    import threading

    from numba.cuda.simulator import kernelapi

    cls = kernelapi.FakeCUDAShared
    if getattr(cls.array, "_numbarl_locked", False):
        return
    original = cls.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None or not hasattr(self, "_allocations"):
            # (older simulators take no alignment argument)
            return original(self, shape, dtype) if alignment is None else original(self, shape, dtype, alignment)
        if isinstance(dtype, kernelapi.types.Type):
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        site = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            res = self._allocations.get(site)
            if res is None:
                res = kernelapi.np.empty(shape, dtype)
                self._allocations[site] = res
        return res

    array._numbarl_locked = True
    cls.array = array


# what makes a simulated thread wait for the others of its block: with none of these reachable from a
# kernel, its threads can run one after another (each sees the earlier ones' writes, as some
# interleaving of real threads would)
_BARRIER_NAMES = frozenset({
    "syncthreads", "syncthreads_count", "syncthreads_and", "syncthreads_or", "syncwarp", "sync",
    "shfl_sync", "shfl_up_sync", "shfl_down_sync", "shfl_xor_sync", "all_sync", "any_sync", "eq_sync",
    "ballot_sync", "match_any_sync", "match_all_sync", "activemask", "this_grid", "cg",
})


def _may_wait_for_other_threads(fn, seen=None) -> bool:
    """True when a barrier or warp operation may be reached from fn: its code's names, then every
    function it can reach through its globals and closure (simulator device functions included)."""
    import types

    seen = set() if seen is None else seen
    fn = getattr(fn, "fn", fn)  # a simulator device function (FakeCUDAKernel) wraps its Python function
    if not isinstance(fn, types.FunctionType):  # njit functions run compiled for the CPU: no barrier there
        return False
    if id(fn) in seen:  # by function, not code: factory-made kernels share code and differ in their closure
        return False
    seen.add(id(fn))
    codes, names = [fn.__code__], set()
    while codes:  # nested functions and comprehensions
        c = codes.pop()
        names.update(c.co_names)
        names.update(c.co_freevars)
        codes.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    if names & _BARRIER_NAMES:
        return True
    reachable = [fn.__globals__.get(n) for n in names]
    reachable += [cell.cell_contents for cell in (fn.__closure__ or ()) if _cell_filled(cell)]
    # module.function(...) inside the kernel: the module is a global (or a closure cell), the function one of
    # the code's attribute names
    modules = [g for g in reachable if isinstance(g, types.ModuleType)
               and g.__name__.split(".")[0] not in ("numpy", "numba", "math", "cmath")]  # no device functions there
    reachable += [getattr(m, n, None) for m in modules for n in names]
    # device functions held in a tuple, list or dict (OPS[i](...))
    reachable += [v for g in reachable if isinstance(g, (tuple, list, dict))
                  for v in (g.values() if isinstance(g, dict) else g)]
    return any(_may_wait_for_other_threads(g, seen) for g in reachable if callable(g))


def _missed_barrier(*_):
    raise RuntimeError("a kernel reached syncthreads while numbarl ran its block in one thread (the barrier scan "
                       "in numbarl/cuda/backend.py missed it): run with NUMBARL_SIM_THREADS=1 and report the kernel")


def _cell_filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _run_barrier_free_blocks_in_one_thread() -> None:
    """Run a simulated block's threads one after another in the launching thread when the kernel reaches
    no barrier or warp operation (most of numbarl's kernels: grid-stride loops), instead of one Python
    thread each. The simulator's own BlockManager starts a thread per CUDA thread, and starting them
    was ~60% of a tiny training run's time (168,135 threads for 1,583 launches, measured with cProfile).
    Kernels that can reach a barrier keep the threads; an error names the thread and block as before.
    NUMBARL_SIM_THREADS=1 restores the simulator's threads for every kernel."""
    import threading

    import numpy as np
    from numba.cuda.simulator import kernel as sim_kernel

    cls = sim_kernel.BlockManager
    if getattr(cls.run, "_numbarl_sequential", False):
        return
    original = cls.run
    verdicts: dict = {}

    def run(self, grid_point, *args):
        f = self._f
        waits = verdicts.get(f)  # keyed by the function object (a factory's kernels share their code)
        if waits is None:
            waits = verdicts[f] = _may_wait_for_other_threads(f)
        if waits or self._debug:
            return original(self, grid_point, *args)
        cur = threading.current_thread()
        attrs = ("threadIdx", "blockIdx", "thread_id", "syncthreads")  # what kernelapi reads from the thread
        saved = {k: cur.__dict__[k] for k in attrs if k in cur.__dict__}
        bx, by, _ = self._block_dim  # normalized to three dimensions by the launch
        cur.blockIdx = sim_kernel.Dim3(*grid_point)
        cur.syncthreads = _missed_barrier  # the scan missed a barrier: say so rather than run it wrongly
        try:
            for tx, ty, tz in np.ndindex(*self._block_dim):
                cur.threadIdx = sim_kernel.Dim3(tx, ty, tz)
                cur.thread_id = tx + bx * (ty + by * tz)
                try:
                    f(*args)
                except Exception as e:  # noqa: BLE001 - re-raised naming the thread and block, as the simulator's threads do
                    msg = f"tid={list(cur.threadIdx)} ctaid={list(cur.blockIdx)}"
                    msg = f"{msg}: {e}" if str(e) else msg
                    try:
                        wrapped = type(e)(msg)
                    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
                        raise RuntimeError(msg) from e
                    raise wrapped.with_traceback(e.__traceback__) from None
        finally:
            for k in attrs:
                cur.__dict__.pop(k, None)
            cur.__dict__.update(saved)

    run._numbarl_sequential = True
    cls.run = run


def simulator_active() -> bool:
    """True when numba.cuda runs on the simulator (valid after select() or any numba.cuda import)."""
    from numba import config

    return bool(config.ENABLE_CUDASIM)
