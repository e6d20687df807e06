"""Compile, for a real GPU's architecture and without a GPU, every kernel the simulator launched.

The simulator runs a kernel as Python, so a kernel numba-cuda cannot type (a local array sized by
an expression instead of a constant, a numpy call the CUDA target lacks, an argument type that
never occurs on the simulator) passes every simulator test and fails at its first launch on the
GPU, where device time is scarce. This module closes that gap on a CPU machine: NVVM compiles to
PTX without a driver.

Record (any command that runs kernels on the simulator: pytest, numbarl-train)::

    NUMBARL_RECORD_LAUNCHES=/tmp/launches python -m pytest tests/rl/test_mamba.py

appends one line per distinct (kernel, argument types) to ``/tmp/launches/launches-<pid>.jsonl``.
Check::

    python -m numbarl.cuda.ptxcheck /tmp/launches [--cc 9.0] [--jobs 2]

compiles each recorded kernel with those argument types for ``sm_<cc>`` and exits 1 naming every
kernel that does not compile (module, kernel, signature, numba's first error lines). Kernels
defined inside a function (``<locals>`` in their name) cannot be re-imported and are counted as
skipped, and so are test kernels that call Python on purpose (their function carries the attribute
``__numbarl_simulator_only__ = True``). ``bin/ptx-check`` runs both steps.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import threading
from pathlib import Path

ENV = "NUMBARL_RECORD_LAUNCHES"
# a test kernel that only the simulator can run (it calls Python) sets this attribute on its function
SIMULATOR_ONLY = "__numbarl_simulator_only__"
SKIPPED = "skipped"

_recorders: dict = {}  # folder -> its file; every installed recorder sees every launch
_original_call = None
_lock = threading.Lock()


def _host_view(arg):
    """The launch argument with each simulator device array replaced by its host numpy array (tuples and
    named tuples of arrays kept as such), so numba's typeof gives the type a GPU launch would see."""
    ary = getattr(arg, "_ary", None)  # the simulator's FakeCUDAArray wraps a numpy array
    if ary is not None:
        return ary
    if isinstance(arg, tuple):
        vals = [_host_view(a) for a in arg]
        return type(arg)(*vals) if hasattr(arg, "_fields") else tuple(vals)
    return arg


def _cheap_key(arg):
    """What decides an argument's numba type, without numba: dtype, rank, layout and writability of arrays
    (recursively in tuples), the Python type of scalars. typeof runs only for launches with a new key."""
    ary = getattr(arg, "_ary", arg)
    if hasattr(ary, "dtype") and hasattr(ary, "flags"):
        f = ary.flags
        return (ary.dtype, ary.ndim, f.c_contiguous, f.f_contiguous, f.writeable, f.aligned)
    if isinstance(arg, tuple):
        return (type(arg), *(_cheap_key(a) for a in arg))
    if isinstance(arg, int) and not isinstance(arg, bool):  # typeof: int64, or uint64 from 2**63 on
        return (int, arg >= 2**63, arg < -(2**63))
    return (type(arg), getattr(arg, "dtype", None))


def _signature(args):
    """(pickled numba argument types as base64, their text)."""
    import base64
    import pickle

    from numba import typeof

    sig = tuple(typeof(_host_view(a)) for a in args)
    return base64.b64encode(pickle.dumps(sig)).decode(), ", ".join(str(t) for t in sig)


def install_recorder(folder: str | os.PathLike):
    """Record every simulated kernel launch of this process into folder (see the module docstring); returns a
    function that removes this recorder (several may be installed; each gets every launch)."""
    global _original_call
    from numba.cuda.simulator import kernel as sim_kernel

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"launches-{os.getpid()}.jsonl"
    with _lock:
        if str(out) in _recorders:
            raise RuntimeError(f"a launch recorder into {out} is already installed")
        _recorders[str(out)] = {"path": path, "seen": set()}
        if _original_call is None:
            original = _original_call = sim_kernel.FakeCUDAKernel.__call__

            def recording_call(self, *args):
                if not self._device and not sim_kernel._kernel_context and _recorders:
                    fn = self.fn
                    key = (fn.__module__, fn.__qualname__, tuple(_cheap_key(a) for a in args))
                    with _lock:
                        new = [r for r in _recorders.values() if key not in r["seen"]]
                    if new:
                        sig, text = _signature(args)
                        rec = {"module": fn.__module__, "kernel": fn.__qualname__, "file": fn.__code__.co_filename,
                               "sig": sig, "text": text}
                        with _lock:
                            for r in new:
                                r["seen"].add(key)
                                with open(r["path"], "a") as fh:
                                    fh.write(json.dumps(rec, sort_keys=True) + "\n")
                return original(self, *args)

            sim_kernel.FakeCUDAKernel.__call__ = recording_call

    def uninstall():
        global _original_call
        with _lock:
            _recorders.pop(str(out), None)
            if not _recorders and _original_call is not None:
                sim_kernel.FakeCUDAKernel.__call__ = _original_call
                _original_call = None

    return uninstall


def load_records(folder: str | os.PathLike) -> list[dict]:
    """The distinct recorded launches under folder, sorted by module, kernel and signature."""
    recs = {}
    for f in sorted(Path(folder).glob("launches-*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                recs[(r["module"], r["kernel"], r["text"])] = r
    return [recs[k] for k in sorted(recs)]


def _numba_signature(rec):
    import base64
    import pickle

    return pickle.loads(base64.b64decode(rec["sig"]))


def _prepare_compiler(cc):
    """Import numba.cuda for the real target (not the simulator) and let device functions compile
    for ``cc`` without asking a driver which device is current."""
    if "numba.cuda" in sys.modules and os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        raise RuntimeError("ptxcheck must run in a process where numba.cuda is not the simulator")
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
    import types as pytypes

    from numba.cuda import dispatcher

    dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=cc)


def _import(rec):
    """The kernel's module: by name, else from its file (test modules that pytest imported by file)."""
    try:
        return importlib.import_module(rec["module"])
    except ModuleNotFoundError as exc:
        path = Path(rec.get("file", ""))
        if exc.name != rec["module"] or not path.is_file():  # a dependency is missing: that is the finding
            raise
        sys.path.insert(0, str(path.parent))  # the test module's own imports (its helpers beside it)
        spec = importlib.util.spec_from_file_location(rec["module"], path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[rec["module"]] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(rec["module"], None)  # no half-executed module for the next record
            raise
        return module


def compile_record(rec: dict, cc=(9, 0)) -> str | None:
    """None when the recorded kernel compiles to PTX for cc with the recorded argument types, else
    the error (its first lines)."""
    from numba import cuda

    obj = _import(rec)
    for part in rec["kernel"].split("."):
        obj = getattr(obj, part)
    fn = getattr(obj, "py_func", obj)
    if getattr(fn, SIMULATOR_ONLY, False):
        return SKIPPED
    sig = _numba_signature(rec)
    try:
        cuda.compile_ptx(fn, sig, cc=cc)
    except Exception as exc:  # noqa: BLE001 - every compile error is the finding
        lines = [ln for ln in str(exc).replace("\x1b[1m", "").replace("\x1b[0m", "").splitlines() if ln.strip()]
        return f"{type(exc).__name__}: " + "\n    ".join(lines[:8])
    return None


def _worker(args):
    rec, cc = args
    _prepare_compiler(cc)
    try:
        return rec, compile_record(rec, cc)
    except Exception as exc:  # noqa: BLE001 - an import failure is a finding too
        return rec, f"{type(exc).__name__}: {exc}"


def check(folder, cc=(9, 0), jobs: int = 1, out=sys.stdout) -> int:
    """Compile every recorded launch; returns the number of kernels that failed."""
    records = load_records(folder)
    todo = [r for r in records if "<locals>" not in r["kernel"]]
    skipped = len(records) - len(todo)
    if not records:
        print(f"ptxcheck: no launches recorded under {folder} (was {ENV} set before the run?)", file=out)
        return 1
    if jobs > 1:  # a worker that dies (NVVM crashing) raises BrokenProcessPool instead of hanging
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
            results = list(pool.map(_worker, [(r, cc) for r in todo], chunksize=4))
    else:
        results = [_worker((r, cc)) for r in todo]
    sim_only = sum(1 for _, err in results if err == SKIPPED)
    failed = [(r, err) for r, err in results if err and err != SKIPPED]
    for r, err in failed:
        print(f"FAIL {r['module']}.{r['kernel']}({r['text']})\n    {err}", file=out)
    kernels = {(r["module"], r["kernel"]) for r in todo}
    print(f"ptxcheck: {len(todo)} launch signatures of {len(kernels)} kernels compiled for sm_{cc[0]}{cc[1]}: "
          f"{len(failed)} failed; {skipped} skipped (kernels defined inside a function), {sim_only} simulator-only "
          f"test kernels not compiled", file=out)
    return len(failed)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m numbarl.cuda.ptxcheck", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help=f"the folder {ENV} pointed at")
    p.add_argument("--cc", default="9.0", help="compute capability to compile for (default 9.0, H100/H200)")
    p.add_argument("--jobs", type=int, default=1, help="compiling processes")
    a = p.parse_args(argv)
    try:
        cc = tuple(int(x) for x in a.cc.split("."))
        if len(cc) != 2:
            raise ValueError
    except ValueError:
        p.error(f"--cc must look like 9.0, got {a.cc!r}")
    if not Path(a.folder).is_dir():
        p.error(f"no such folder: {a.folder}")
    missing = compiler_missing(cc)
    if missing:
        print(f"ptxcheck: numba-cuda cannot compile PTX on this machine ({missing}); it needs a CUDA toolkit's "
              "NVVM, libdevice and NVRTC (a /usr/local/cuda install, or NVIDIA's pip wheels: "
              "nvidia-cuda-nvcc, nvidia-cuda-nvrtc)", file=sys.stderr)
        return 2
    return 1 if check(a.folder, cc, a.jobs) else 0


def compiler_missing(cc=(9, 0)) -> str:
    """'' when a one-line kernel compiles to PTX for cc in this process, else numba's last error line."""
    _prepare_compiler(cc)
    from numba import cuda, types

    def probe(x):
        x[0] = 1.0

    try:
        cuda.compile_ptx(probe, (types.float32[::1],), cc=cc)
    except Exception as exc:  # noqa: BLE001 - a missing library shows up as any of several errors
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
    return ""


if __name__ == "__main__":
    sys.exit(main())
