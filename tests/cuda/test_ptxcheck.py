"""numbarl.cuda.ptxcheck: kernels recorded on the simulator compile for sm_90 on a CPU machine, and
a kernel the GPU cannot type (it passes the simulator) is named."""

import base64
import json
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from numbarl.cuda import ptxcheck
from numbarl.cuda.runtime import simulator


def _compiler_missing() -> str:
    """'' when numba-cuda can compile PTX here (NVVM, libdevice and NVRTC found), else the reason."""
    code = "from numbarl.cuda import ptxcheck; print(ptxcheck.compiler_missing((9, 0)))"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    return r.stdout.strip() if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1][:300]


_MISSING = _compiler_missing()
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"no CUDA compiler libraries to compile PTX with: {_MISSING}")


def _check(folder, extra_path=None):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    env.pop("NUMBARL_RECORD_LAUNCHES", None)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "numbarl.cuda.ptxcheck", str(folder)], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(not simulator(), reason="records simulator launches")
def test_recorded_conv_launches_compile_for_sm90(tmp_path):
    from numbarl.cuda.kernels import conv1d
    from numbarl.cuda.runtime import cuda, stream

    cu = cuda()
    rng = np.random.default_rng(0)
    n_steps, cols, width = 3, 2, 3  # one window of 3 rows; 2 convolved columns of 3; 1 tap + bias
    z = cu.to_device(rng.standard_normal((n_steps, width)).astype(np.float32))
    w = cu.to_device(rng.standard_normal((2, cols)).astype(np.float32))
    out = cu.device_array((n_steps, width), np.float32)
    pre = cu.device_array((n_steps, cols), np.float32)
    dz = cu.device_array((n_steps, width), np.float32)
    part = cu.device_array((1, 2 * cols), np.float32)
    uninstall = ptxcheck.install_recorder(tmp_path)
    try:
        conv1d.conv_forward(z, w, None, n_steps, out, pre, stream())
        conv1d.conv_backward(out, z, w, pre, None, n_steps, dz, part, stream())
    finally:
        uninstall()
    names = sorted(r["kernel"] for r in ptxcheck.load_records(tmp_path))
    assert names == ["conv_forward_kernel", "conv_input_grad_kernel", "conv_weight_part_kernel"]
    res = _check(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "3 launch signatures of 3 kernels compiled for sm_90: 0 failed" in res.stdout


def test_a_kernel_the_simulator_runs_but_the_gpu_cannot_type_is_named(tmp_path):
    """A local array sized by an expression of a module constant: the simulator allocates it, numba-cuda
    refuses it (the bug the convolution's weight kernel had until its first GPU run)."""
    (tmp_path / "badkern.py").write_text(textwrap.dedent("""
        from numba import cuda, float32
        N = 4

        @cuda.jit
        def bad_kernel(x):
            acc = cuda.local.array(N + 1, float32)
            acc[0] = x[0]
            x[0] = acc[0]

        @cuda.jit
        def good_kernel(x):
            acc = cuda.local.array(N, float32)
            acc[0] = x[0]
            x[0] = acc[0]
    """))
    rec = tmp_path / "rec"
    rec.mkdir()
    from numba import types

    sig = base64.b64encode(pickle.dumps((types.float32[::1],))).decode()
    lines = [json.dumps({"module": "badkern", "kernel": k, "file": str(tmp_path / "badkern.py"), "sig": sig,
                         "text": "array(float32, 1d, C)"}) for k in ("bad_kernel", "good_kernel")]
    (rec / "launches-1.jsonl").write_text("\n".join(lines) + "\n")
    res = _check(rec, extra_path=tmp_path)
    assert res.returncode == 1
    assert "FAIL badkern.bad_kernel(array(float32, 1d, C))" in res.stdout
    assert "good_kernel" not in res.stdout.split("ptxcheck:")[0]
    assert "2 launch signatures of 2 kernels compiled for sm_90: 1 failed" in res.stdout
