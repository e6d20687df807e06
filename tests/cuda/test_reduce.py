"""Deterministic reductions (numbarl.cuda.reduce) against their float64 numpy references.

Runs under the simulator on small shapes that are not multiples of the block sizes; the same
comparisons at real sizes, and bitwise repeatability on the GPU, are in test_gpu_kernels.py.
"""

import math

import numpy as np
import pytest

from numbarl.cuda import reduce as red
from numbarl.cuda.runtime import cuda, stream

_cuda = cuda()


from numbarl.cuda.testing import assert_close, to_device as dev, to_host as host  # noqa: E402


def sum_atol(x):
    """float32 accumulation error bound for sums: a few ulps of sum |x|."""
    return 1e-6 * float(np.sum(np.abs(np.asarray(x, np.float64)))) + 1e-7


# ---------------------------------------------------------------------------------------------
# flat reductions
# ---------------------------------------------------------------------------------------------
def test_flat_ops_against_reference(rng):
    s = stream()
    block_items = red.BLOCK * red.ITEMS
    n = int(rng.integers(block_items + 1, 2 * block_items - 1))  # two phase-1 blocks + phase 2
    if n % red.BLOCK == 0:
        n += 1
    x = rng.standard_normal(n).astype(np.float32) * np.float32(3.0)
    reducer = red.Reducer(n)
    assert red.flat_blocks(n) == 2
    d = dev(x, s)
    out = dev(np.full(len(red.FLAT_OPS) + 2, 7.0, np.float32), s)
    for k, op in enumerate(red.FLAT_OPS):
        getattr(reducer, op)(d, out, s, at=k + 1)
    got = host(out, s)
    assert got[0] == 7.0 and got[-1] == 7.0  # only out[at] is written
    for k, op in enumerate(red.FLAT_OPS):
        ref = red.FLAT_REFS[op](x)
        atol = sum_atol(x * x) if op in ("sumsq", "l2norm") else sum_atol(x)
        if op == "mean":
            atol /= n
        if op == "l2norm":
            atol = atol / max(ref, 1e-30)
        assert_close(got[k + 1], ref, atol=atol, rtol=1e-5)


def test_flat_grid_stride_with_capped_grid(rng):
    """More elements than threads: each thread folds an unrolled run, then a remainder."""
    s = stream()
    n = int(rng.integers(2500, 3000))
    x = rng.uniform(-1, 1, n).astype(np.float32)
    x[int(rng.integers(n))] = 5.5  # a unique maximum somewhere
    reducer = red.Reducer(n, max_blocks=2)
    assert red.flat_partials_size(n, max_blocks=2) == 2
    out = _cuda.device_array(2, np.float32)
    d = dev(x, s)
    reducer.sum(d, out, s, at=0)
    reducer.max(d, out, s, at=1)
    got = host(out, s)
    assert_close(got[0], red.sum_ref(x), atol=sum_atol(x), rtol=1e-5)
    assert got[1] == np.float32(5.5)


def test_flat_hand_computed_and_edges():
    s = stream()
    x = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    reducer = red.Reducer(4)
    out = _cuda.device_array(6, np.float32)
    d = dev(x, s)
    for k, op in enumerate(("sum", "mean", "max", "min", "sumsq", "l2norm")):
        getattr(reducer, op)(d, out, s, at=k)
    np.testing.assert_allclose(host(out, s), [10.0, 2.5, 4.0, 1.0, 30.0, math.sqrt(30.0)], rtol=1e-6)

    # a single element; then NaN propagates through sum, max and min
    one = red.Reducer(1)
    d1 = dev(np.array([-2.5], np.float32), s)
    one.l2norm(d1, out, s, at=0)
    one.max(d1, out, s, at=1)
    assert host(out, s)[:2].tolist() == [2.5, -2.5]
    xn = np.array([1.0, np.nan, -3.0, 2.0, 9.0], np.float32)
    rn = red.Reducer(5)
    dn = dev(xn, s)
    rn.sum(dn, out, s, at=0)
    rn.max(dn, out, s, at=1)
    rn.min(dn, out, s, at=2)
    assert np.isnan(host(out, s)[:3]).all()

    # empty input: the neutral elements
    empty = red.Reducer(0)
    d0 = _cuda.device_array(0, np.float32)
    empty.sum(d0, out, s, at=0)
    empty.max(d0, out, s, at=1)
    empty.l2norm(d0, out, s, at=2)
    assert host(out, s)[:3].tolist() == [0.0, -math.inf, 0.0]


def test_flat_multi_array_sumsq_for_global_norm(rng):
    """Global-norm clipping over several gradient tensors (2-D ones too) in one reduction."""
    s = stream()
    shapes = [(int(rng.integers(1, 9)),), (int(rng.integers(20, 27)), 37), (int(rng.integers(200, 400)),)]
    xs = [rng.standard_normal(sh).astype(np.float32) for sh in shapes]
    sizes = [int(np.prod(sh)) for sh in shapes]
    reducer = red.Reducer(sizes)
    # one partial per phase-1 block of each array, then one fold over them all
    assert reducer.partials.size == sum(red.flat_blocks(n) for n in sizes) == red.flat_partials_size(sizes)
    ds = [dev(x, s) for x in xs]
    out = _cuda.device_array(2, np.float32)
    reducer.l2norm(ds, out, s, at=0)
    reducer.max(ds, out, s, at=1)
    got = host(out, s)
    assert_close(got[0], red.l2norm_ref(xs), atol=0.0, rtol=1e-5)
    assert got[1] == max(float(x.max()) for x in xs)
    with pytest.raises(ValueError, match="sizes"):
        reducer.sumsq(ds[::-1], out, s)


def test_flat_scratch_garbage_and_repeatability(rng):
    """The result must not depend on what the scratch held before, and repeats bit for bit."""
    s = stream()
    n = int(rng.integers(red.BLOCK * red.ITEMS + 1, 2 * red.BLOCK * red.ITEMS))
    x = rng.standard_normal(n).astype(np.float32)
    partials = dev(np.full(red.flat_partials_size(n), np.nan, np.float32), s)
    out = _cuda.device_array(2, np.float32)
    d = dev(x, s)
    red.flat_reduce(d, out, partials, "sum", s, at=0)
    red.flat_reduce(d, out, partials, "sum", s, at=1)
    got = host(out, s)
    assert got[0].tobytes() == got[1].tobytes()
    assert_close(got[0], red.sum_ref(x), atol=sum_atol(x), rtol=1e-5)


def test_flat_argument_errors():
    s = stream()
    reducer = red.Reducer(10)
    out = _cuda.device_array(1, np.float32)
    with pytest.raises(ValueError, match="sizes"):
        reducer.sum(_cuda.device_array(11, np.float32), out, s)
    with pytest.raises(TypeError, match="float32"):
        reducer.sum(_cuda.device_array(10, np.float64), out, s)
    with pytest.raises(IndexError):
        reducer.sum(_cuda.device_array(10, np.float32), out, s, at=1)
    with pytest.raises(ValueError, match="unknown reduction"):
        red.flat_reduce(_cuda.device_array(10, np.float32), out, None, "median", s)
    with pytest.raises(ValueError, match="partials"):
        red.flat_reduce(_cuda.device_array(5000, np.float32), out, None, "sum", s)


# ---------------------------------------------------------------------------------------------
# row reductions
# ---------------------------------------------------------------------------------------------
def test_row_reductions_against_reference(rng):
    s = stream()
    n_rows = int(rng.integers(9, 16))  # two row blocks, the second partly empty
    n_cols = int(rng.integers(4 * red.LANES + 1, 5 * red.LANES + 2))  # unrolled loop + remainder
    big = rng.standard_normal((n_rows, n_cols + 7)).astype(np.float32)
    x = big[:, 3 : 3 + n_cols]  # a strided 2-D view on the device
    dbig = dev(big, s)
    dx = dbig[:, 3 : 3 + n_cols]
    outs = {name: _cuda.device_array(n_rows, np.float32) for name in ("sum", "mean", "max", "min", "sumsq")}
    red.row_sum(dx, outs["sum"], s)
    red.row_mean(dx, outs["mean"], s)
    red.row_max(dx, outs["max"], s)
    red.row_min(dx, outs["min"], s)
    red.row_sumsq(dx, outs["sumsq"], s)
    atol = 1e-6 * np.abs(x).sum(axis=1).max() + 1e-7
    assert_close(host(outs["sum"], s), red.row_sum_ref(x), atol=atol, rtol=1e-5)
    assert_close(host(outs["mean"], s), red.row_mean_ref(x), atol=atol / n_cols, rtol=1e-5)
    np.testing.assert_array_equal(host(outs["max"], s), x.max(axis=1))
    np.testing.assert_array_equal(host(outs["min"], s), x.min(axis=1))
    assert_close(host(outs["sumsq"], s), red.row_sumsq_ref(x), atol=1e-6 * (x * x).sum(axis=1).max(), rtol=1e-5)


def test_row_reductions_3d_small_rows_hand_case():
    s = stream()
    x = np.array([[[1.0, 2.0, 3.0], [-1.0, -5.0, 0.5]], [[np.nan, 1.0, 2.0], [-np.inf, -np.inf, -np.inf]]], np.float32)
    out = _cuda.device_array(4, np.float32)
    red.row_sum(dev(x, s), out, s)
    got = host(out, s)
    assert got[:2].tolist() == [6.0, -5.5] and np.isnan(got[2]) and got[3] == -math.inf
    red.row_max(dev(x, s), out, s)
    got = host(out, s)
    assert got[:2].tolist() == [3.0, 0.5] and np.isnan(got[2]) and got[3] == -math.inf
    with pytest.raises(ValueError, match="one per row"):
        red.row_sum(dev(x, s), _cuda.device_array(3, np.float32), s)


def test_row_argmax_ties_nan_and_random(rng):
    s = stream()
    n_cols = 70
    x = rng.standard_normal((11, n_cols)).astype(np.float32)
    x[0, :] = 1.0  # all tied: first index
    x[1, 40] = x[1, 7] = x[1].max() + 1.0  # tie across lanes (40 = lane 8, 7 = lane 7): 7 wins
    x[2, 33] = x[2, 65] = x[2].max() + 1.0  # tie within lane 1: 33 wins
    x[3, 50] = np.nan
    x[3, 20] = np.nan  # first NaN wins
    x[4, :] = -np.inf
    x[5, n_cols - 1] = 100.0  # last column
    for dtype in (np.int32, np.int64):
        out = _cuda.device_array(11, dtype)
        red.row_argmax(dev(x, s), out, s)
        got = host(out, s)
        np.testing.assert_array_equal(got, red.row_argmax_ref(x))
        assert got[:6].tolist() == [0, 7, 33, 20, 0, n_cols - 1]


# ---------------------------------------------------------------------------------------------
# column reductions
# ---------------------------------------------------------------------------------------------
def test_col_plan_depends_on_rows_only():
    assert red.col_plan(16384) == (64, 256)
    assert red.col_plan(1) == (1, 1)
    assert red.col_plan(257) == (2, 129)
    n_chunks, chunk_rows = red.col_plan(10_000_000)
    assert n_chunks == red.MAX_CHUNKS and n_chunks * chunk_rows >= 10_000_000
    assert red.col_partials_shape(16384, 512) == (64, 512)


def test_col_sum_against_reference_and_accumulate(rng):
    s = stream()
    n_rows = int(rng.integers(2 * red.CHUNK_ROWS + 1, 3 * red.CHUNK_ROWS))  # three chunks
    n_cols = int(rng.integers(red.LANES + 1, 2 * red.LANES + 2))  # two or more column tiles
    x = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    x[int(rng.integers(n_rows)), n_cols // 2] = np.nan  # NaN stays in its column
    plan = red.ColSum(n_rows, n_cols)
    assert plan.partials.shape == (3, n_cols)
    dxx = dev(x, s)
    out = _cuda.device_array(n_cols, np.float32)
    plan.run(dxx, out, s)
    ref = red.col_sum_ref(x)
    atol = 1e-6 * np.nanmax(np.abs(x).sum(axis=0)) + 1e-7
    got = host(out, s)
    assert_close(got, ref, atol=atol, rtol=1e-5)
    assert np.isnan(got).sum() == 1
    # accumulate: out += column sums (bias gradient of a parameter used twice)
    base = rng.standard_normal(n_cols).astype(np.float32)
    out2 = dev(base, s)
    plan.run(dxx, out2, s, accumulate=True)
    assert_close(host(out2, s), ref + base, atol=atol + 1e-6, rtol=1e-5)


def test_col_sum_single_chunk_strided_view_hand_case(rng):
    s = stream()
    big = np.arange(6 * 9, dtype=np.float32).reshape(6, 9)
    dbig = dev(big, s)
    view = dbig[1:, 2:7]  # rows 1..5, columns 2..6
    partials = _cuda.device_array(red.col_partials_shape(5, 5), np.float32)
    out = _cuda.device_array(5, np.float32)
    red.col_sum(view, out, partials, s)
    np.testing.assert_array_equal(host(out, s), big[1:, 2:7].sum(axis=0))  # small integers: exact
    out_acc = dev(np.ones(5, np.float32), s)
    red.col_sum(view, out_acc, partials, s, accumulate=True)
    np.testing.assert_array_equal(host(out_acc, s), big[1:, 2:7].sum(axis=0) + 1.0)
    with pytest.raises(ValueError, match="partials"):
        red.col_sum(view, out, _cuda.device_array((2, 5), np.float32), s)
