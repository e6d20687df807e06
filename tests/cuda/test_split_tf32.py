"""split_tf32 (numbarl/cuda/kernels/elementwise.py), the operand split of a 3xTF32 GEMM: the kernel against
its numpy reference bit for bit, hi on the TF32 grid (low 13 mantissa bits zero, the nearest such value, ties
to even), hi + lo == x exactly, and |lo| within half a TF32 ulp of x."""

import numpy as np
import pytest

from numbarl.cuda.kernels.elementwise import split_tf32, split_tf32_ref
from numbarl.cuda.runtime import cuda, stream

_cuda = cuda()


def _inputs():
    r = np.random.default_rng(5)
    x = np.concatenate([r.standard_normal(40) * 10.0 ** r.integers(-30, 30, 40), [0.0, -0.0, 1.0, -1.5],
                        # ties: exactly half a TF32 ulp above 1 + k·2⁻¹⁰ (k even: down, k odd: up), and just above
                        [1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1.0 + 2.0 ** -11 + 2.0 ** -23, 3.4e38, 1e-40]])
    return x.astype(np.float32)


def test_reference_is_the_nearest_tf32_value_and_splits_exactly():
    x = _inputs()
    hi, lo = split_tf32_ref(x)
    assert ((hi.view(np.uint32) & np.uint32(0x1FFF)) == 0).all()
    np.testing.assert_array_equal((hi.astype(np.float64) + lo.astype(np.float64)), x.astype(np.float64))
    # the TF32 ulp of x's binade (subnormals: the fixed spacing 2⁻¹³⁶ of 10 bits below the smallest exponent)
    ulp = np.maximum(np.ldexp(1.0, np.frexp(x.astype(np.float64))[1] - 11), 2.0 ** -136)
    assert (np.abs(lo.astype(np.float64)) <= ulp / 2 + 1e-300).all()
    np.testing.assert_array_equal(hi[-5:-2], np.float32([1.0, 1.0 + 4 * 2.0 ** -11, 1.0 + 2 * 2.0 ** -11]))


@pytest.mark.parametrize("shape", [(7,), (3, 17)])
def test_kernel_equals_the_reference_bit_for_bit(shape):
    x = np.resize(_inputs(), shape).astype(np.float32)
    s = stream()
    xd = _cuda.to_device(x)
    hi, lo = _cuda.device_array(shape, np.float32), _cuda.device_array(shape, np.float32)
    split_tf32(xd, hi, lo, s)
    s.synchronize()
    want_hi, want_lo = split_tf32_ref(x.ravel())
    np.testing.assert_array_equal(hi.copy_to_host().ravel().view(np.uint32), want_hi.view(np.uint32))
    np.testing.assert_array_equal(lo.copy_to_host().ravel().view(np.uint32), want_lo.view(np.uint32))


def test_errors_name_the_input():
    s = stream()
    x = _cuda.to_device(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="split_tf32: arrays differ in size"):
        split_tf32(x, _cuda.device_array(3, np.float32), _cuda.device_array(4, np.float32), s)
    with pytest.raises(TypeError, match="split_tf32: arrays must be float32"):
        split_tf32(x, _cuda.device_array(4, np.float64), _cuda.device_array(4, np.float32), s)


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True)])
def test_split_product_of_column_slices_matches_float64(trans_a, trans_b):
    """numbarl.bench.gemm.split_tf32_gemm on views into wider buffers (the plans' leading dimensions): the three
    GEMMs accumulate to op(A)·op(B) (here the simulator's TF32 is float32; tests/cuda/test_gpu_split_tf32.py
    checks the accuracy on tensor cores)."""
    from numbarl.bench.gemm import split_tf32_gemm

    r = np.random.default_rng(2)
    M, N, K, pad = 5, 6, 7, 3
    a_rows, a_cols = (K, M) if trans_a else (M, K)
    b_rows, b_cols = (N, K) if trans_b else (K, N)
    A = r.standard_normal((a_rows, a_cols + pad)).astype(np.float32)
    B = r.standard_normal((b_rows, b_cols + pad)).astype(np.float32)
    s = stream()
    Ad, Bd = _cuda.to_device(A), _cuda.to_device(B)
    halves = [_cuda.device_array(A.shape, np.float32) for _ in range(2)] + [_cuda.device_array(B.shape, np.float32)
                                                                          for _ in range(2)]
    split_tf32(Ad, halves[0], halves[1], s)
    split_tf32(Bd, halves[2], halves[3], s)
    C = _cuda.to_device(np.full((M, N + pad), 7.0, np.float32))
    parts = (halves[0][:, :a_cols], halves[1][:, :a_cols], halves[2][:, :b_cols], halves[3][:, :b_cols])
    split_tf32_gemm(Ad[:, :a_cols], Bd[:, :b_cols], C[:, :N], trans_a, trans_b, parts, s)
    s.synchronize()
    a, b = A[:, :a_cols].astype(np.float64), B[:, :b_cols].astype(np.float64)
    ref = (a.T if trans_a else a) @ (b.T if trans_b else b)
    got = C.copy_to_host()
    np.testing.assert_allclose(got[:, :N], ref, rtol=1e-5, atol=1e-5)
    assert (got[:, N:] == 7.0).all()  # the padding columns are not written


def test_bench_row_and_table_of_the_split_product(monkeypatch):
    """numbarl.bench.gemm's per-plan measurement (_split_row) on a plan's key geometry, and its table lines
    (the bench itself needs cuBLASLt and timing events; here the simulator's GEMMs, each timed call run once)."""
    from types import SimpleNamespace

    from numbarl.bench import gemm as bench

    monkeypatch.setattr(bench, "_time_captured", lambda fn, s, iters, repeats: (fn(s), 1.0)[1])

    M, N, K, lda, ldb, ldc = 6, 5, 4, 7, 5, 8
    plan = SimpleNamespace(key=(M, N, K, lda, ldb, ldc, 0, True, False, None, False, "fp32", False, 0.0))
    r = np.random.default_rng(1)
    bufs = (_cuda.to_device(r.standard_normal((K, lda)).astype(np.float32)),
            _cuda.to_device(r.standard_normal((K, ldb)).astype(np.float32)),
            _cuda.to_device(np.zeros((M, ldc), np.float32)))
    row = bench._split_row(plan, bufs, stream(), SimpleNamespace(iters=1, repeats=1))
    assert set(row) == {"gemms_us", "split_a_us", "split_b_us", "error"}
    assert row["error"]["split_tf32"] < 1e-6 and row["error"]["fp32"] < 1e-6
    plans = [{"calls": {"train": 2, "collect": 1}, "candidates": 1, "first_us": 10.0, "best_us": 10.0,
              "best_index": 0, "gain": 0.0, "plan": "M=6", "split_tf32": row}]
    results = {"device": "sim", "identity": {"cublaslt_version": "-"}, "candidates": 1, "computes": {"fp32": {
        "plans": plans, "train_gemm_us": {"first": 20.0, "tuned": 20.0},
        "collect_gemm_us": {"first": 10.0, "tuned": 10.0},
        "train_split_tf32_us": {"gemms": 2 * row["gemms_us"], "splits": 0.0},
        "collect_split_tf32_us": {"gemms": row["gemms_us"], "splits": 0.0}}}}
    text = bench.table(results)
    assert "split TF32 (3 GEMMs)" in text and "train step GEMMs: fp32 20.0 µs" in text


def test_bench_row_of_padded_leading_dimensions(monkeypatch, capsys):
    """numbarl.bench.gemm --ld-pad: the plan's product on its own leading dimensions and on padded ones (each
    timed call run once here), the padded lds the next multiple."""
    from types import SimpleNamespace

    from numbarl.bench import gemm as bench

    calls = []
    monkeypatch.setattr(bench, "_time_captured", lambda fn, s, iters, repeats: (fn(s), calls.append(1), 1.0)[2])
    plan = SimpleNamespace(key=(6, 5, 4, 6, 5, 5, 0, True, False, None, False, "fp32", False, 0.0))
    row = bench._ld_row(plan, "fp32", stream(), SimpleNamespace(iters=1, repeats=1, ld_pad=8),
                        np.random.default_rng(0))
    assert row == {"ld": [6, 5, 5], "ld_padded": [8, 8, 8], "us_ld": 1.0, "us_padded": 1.0} and len(calls) == 2
    capsys.readouterr()
    assert bench.main(["--ld-pad", "1"]) == 2
    assert "--ld-pad 1: give a multiple" in capsys.readouterr().err


@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_bench_row_of_padded_shapes(monkeypatch, capsys, trans_a, trans_b):
    """numbarl.bench.gemm --pad-dims: the plan's product on its own M, N, K and on each rounded up to the next
    multiple (each timed call run once here, its output checked against numpy, its operands' shapes and leading
    dimensions the stored layout of op(A)[M, K], op(B)[K, N], C[M, N]), and the table's totals with every plan
    padded and with only the plans that padding speeds up."""
    from types import SimpleNamespace

    from numbarl.bench import gemm as bench
    from numbarl.cuda import blas

    seen = []
    real_gemm = blas.gemm

    def gemm(a, b, c, ta, tb, **kw):
        real_gemm(a, b, c, ta, tb, **kw)
        ha, hb = a.copy_to_host(), b.copy_to_host()
        ref = (ha.T if ta else ha) @ (hb.T if tb else hb)
        np.testing.assert_allclose(c.copy_to_host(), ref, rtol=1e-5, atol=1e-6)
        seen.append(tuple((x.shape, x.strides[0] // 4) for x in (a, b, c)))

    monkeypatch.setattr(blas, "gemm", gemm)
    times = iter([3.0, 2.0])
    monkeypatch.setattr(bench, "_time_captured", lambda fn, s, iters, repeats: (fn(s), next(times))[1])
    M, N, K = 6, 5, 3
    plan = SimpleNamespace(key=(M, N, K, 0, 0, N, 0, trans_a, trans_b, None, False, "fp32", False, 0.0))
    row = bench._dims_row(plan, "fp32", stream(), SimpleNamespace(iters=1, repeats=1, pad_dims=4),
                          np.random.default_rng(0))
    assert row == {"dims": [6, 5, 3], "dims_padded": [8, 8, 4], "us_dims": 3.0, "us_padded": 2.0}

    def stored(m, n, k):  # (shape, leading dimension) of A, B, C, each tightly packed
        a = (k, m) if trans_a else (m, k)
        b = (n, k) if trans_b else (k, n)
        return tuple((x, x[1]) for x in (a, b, (m, n)))

    assert seen == [stored(6, 5, 3), stored(8, 8, 4)]
    slower = {"dims": [6, 5, 3], "dims_padded": [8, 8, 4], "us_dims": 1.0, "us_padded": 4.0}
    ld = {"ld": [6, 5, 5], "ld_padded": [8, 8, 8], "us_ld": 5.0, "us_padded": 4.5}
    plans = [{"calls": {"train": 2, "collect": 1}, "candidates": 1, "first_us": 10.0, "best_us": 10.0,
              "best_index": 0, "gain": 0.0, "plan": f"p{i}", "pad_dims": x, "ld_pad": ld}
             for i, x in enumerate((row, slower))]
    saving = {f"{k}_pad_dims_saving_us": bench.pad_dims_saving(plans, k) for k in ("train", "collect")}
    saving |= {f"{k}_pad_dims_faster_saving_us": bench.pad_dims_saving(plans, k, True) for k in ("train", "collect")}
    assert saving == {"train_pad_dims_saving_us": -4.0, "collect_pad_dims_saving_us": -2.0,
                      "train_pad_dims_faster_saving_us": 2.0, "collect_pad_dims_faster_saving_us": 1.0}
    results = {"device": "sim", "identity": {"cublaslt_version": "-"}, "candidates": 1, "computes": {"fp32": {
        "plans": plans, "train_gemm_us": {"first": 40.0, "tuned": 40.0},
        "collect_gemm_us": {"first": 20.0, "tuned": 20.0}, **saving,
        "train_ld_pad_saving_us": 2.0, "collect_ld_pad_saving_us": 1.0}}}
    text = bench.table(results)
    assert "shapes padded" in text and "M, N, K [6, 5, 3] -> [8, 8, 4]  p0" in text
    assert ("saving per train step -4.0 µs, per collect step -2.0 µs with every plan padded; 2.0 / 1.0 µs padding "
            "only the plans it speeds up") in text
    assert "leading dimensions padded" in text and "lds [6, 5, 5] -> [8, 8, 8]  p1" in text
    capsys.readouterr()
    assert bench.main(["--pad-dims", "1"]) == 2
    assert "--pad-dims 1: give a multiple" in capsys.readouterr().err
