"""The split ("3xTF32") product on tensor cores (numbarl.bench.gemm --split-tf32, issue 17): at the train step's
largest shape, 16,384 × 512 × 512 with inputs of the trunk's scale, one TF32 GEMM misses float64 by ~1e-4 of the
largest element and the split product of three comes within fp32's own error (×4)."""

import numpy as np
import pytest

from numbarl.cuda.runtime import cuda, stream

pytestmark = pytest.mark.gpu
_cuda = cuda()


def test_split_tf32_product_is_as_accurate_as_fp32():
    from numbarl.bench.gemm import split_tf32_gemm
    from numbarl.cuda import blas
    from numbarl.cuda.kernels.elementwise import split_tf32

    r = np.random.default_rng(0)
    M, N, K = 16384, 512, 512
    A = (r.standard_normal((M, K)) * 0.5).astype(np.float32)
    B = (r.standard_normal((K, N)) * 0.05).astype(np.float32)
    s = stream()
    Ad, Bd = _cuda.to_device(A), _cuda.to_device(B)
    parts = tuple(_cuda.device_array(x.shape, np.float32) for x in (A, A, B, B))
    split_tf32(Ad, parts[0], parts[1], s)
    split_tf32(Bd, parts[2], parts[3], s)
    C = _cuda.device_array((M, N), np.float32)
    ref = A[:2048].astype(np.float64) @ B.astype(np.float64)
    scale = np.abs(ref).max()
    err = {}
    for name in ("fp32", "tf32", "split"):
        if name == "split":
            split_tf32_gemm(Ad, Bd, C, False, False, parts, s)
        else:
            blas.gemm(Ad, Bd, C, compute=name, stream=s)
        s.synchronize()
        err[name] = np.abs(C.copy_to_host()[:2048] - ref).max() / scale
    assert err["tf32"] > 2e-5, err  # TF32 rounds the inputs to 10 mantissa bits
    assert err["split"] <= 4 * max(err["fp32"], 1e-7), err
