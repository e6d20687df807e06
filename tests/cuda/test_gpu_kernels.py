"""GPU-only checks of the reductions and kernel families at real sizes.

    pytest -m gpu tests/cuda/test_gpu_kernels.py -q

The same comparisons as the simulator tests (float64 numpy references, odd shapes) at the sizes
training uses (batch 16,384 x width 512, the optimizer's ~1M-element flat gradient vector, C51
rows of 51 atoms), plus what only a GPU can show: reductions repeat bit for bit (also with
another scratch buffer at another address), and a step mixing every family captured as a CUDA
graph replays to the same bits as the eager run (the launchers neither allocate nor sync).
"""

import math

import numpy as np
import pytest

from numbarl.cuda import graph
from numbarl.cuda import reduce as red
from numbarl.cuda.kernels import elementwise as ew
from numbarl.cuda.kernels import layernorm as ln
from numbarl.cuda.kernels import softmax as sm
from numbarl.cuda.runtime import cuda, stream

pytestmark = pytest.mark.gpu

_cuda = cuda()

BATCH, WIDTH = 16384, 512
FLAT = 1_000_003  # ~ the optimizer's flat gradient buffer, odd on purpose


from numbarl.cuda.testing import assert_close, to_device as dev, to_host as host  # noqa: E402


# ---------------------------------------------------------------------------------------------
# reductions
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [FLAT, BATCH * WIDTH + 5])
def test_flat_reductions_real_sizes(rng, n):
    s = stream()
    x = rng.standard_normal(n).astype(np.float32)
    d = dev(x, s)
    reducer = red.Reducer(n)
    out = _cuda.device_array(len(red.FLAT_OPS), np.float32)
    for k, op in enumerate(red.FLAT_OPS):
        getattr(reducer, op)(d, out, s, at=k)
    got = host(out, s)
    abs_sum = float(np.abs(x.astype(np.float64)).sum())
    sq_sum = float((x.astype(np.float64) ** 2).sum())
    for k, op in enumerate(red.FLAT_OPS):
        ref = red.FLAT_REFS[op](x)
        atol = {"sum": 1e-6 * abs_sum, "mean": 1e-6 * abs_sum / n, "sumsq": 1e-6 * sq_sum,
                "l2norm": 1e-6 * math.sqrt(sq_sum)}.get(op, 0.0)
        assert_close(got[k], ref, atol=atol, rtol=1e-6)


def test_flat_reductions_repeat_bitwise_with_other_scratch(rng):
    s = stream()
    n = FLAT
    x = (rng.standard_normal(n) * 10).astype(np.float32)
    d = dev(x, s)
    first, second = red.Reducer(n), red.Reducer(n)  # scratch at two different addresses
    out = _cuda.device_array(1, np.float32)
    bits = {op: set() for op in ("sum", "l2norm", "max", "sumsq")}
    for reducer in (first, second, first, second):
        for op in bits:
            getattr(reducer, op)(d, out, s)
            bits[op].add(host(out, s).tobytes())
    assert all(len(v) == 1 for v in bits.values()), bits


def test_global_norm_over_parameter_tensors(rng):
    """sumsq over several gradient tensors in one reduction == over the flat concatenation."""
    s = stream()
    shapes = [(64, 512), (512,), (512, 512), (512,), (512, 4 * 3 * 51), (4 * 3 * 51,)]
    xs = [rng.standard_normal(sh).astype(np.float32) for sh in shapes]
    reducer = red.Reducer([x.size for x in xs])
    out = _cuda.device_array(2, np.float32)
    ds = [dev(x, s) for x in xs]
    reducer.l2norm(ds, out, s, at=0)
    reducer.l2norm(ds, out, s, at=1)
    got = host(out, s)
    assert got[0].tobytes() == got[1].tobytes()
    assert_close(got[0], red.l2norm_ref(xs), atol=0.0, rtol=2e-6)


def test_row_reductions_real_sizes(rng):
    s = stream()
    x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    d = dev(x, s)
    out = _cuda.device_array(BATCH, np.float32)
    red.row_sum(d, out, s)
    assert_close(host(out, s), red.row_sum_ref(x), atol=1e-6 * np.abs(x).sum(axis=1).max(), rtol=1e-6)
    red.row_max(d, out, s)
    np.testing.assert_array_equal(host(out, s), x.max(axis=1))
    q = rng.standard_normal((BATCH * 4, 51)).astype(np.float32)
    q[:, 7] = q[:, 30] = q.max(axis=1) + 1.0  # ties across lanes: the first index wins
    idx = _cuda.device_array(BATCH * 4, np.int32)
    red.row_argmax(dev(q, s), idx, s)
    got = host(idx, s)
    np.testing.assert_array_equal(got, red.row_argmax_ref(q))
    assert np.all(got == 7)


def test_col_sum_bias_gradient_size_bitwise_repeat(rng):
    s = stream()
    x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    d = dev(x, s)
    plan = red.ColSum(BATCH, WIDTH)
    a = _cuda.device_array(WIDTH, np.float32)
    b = _cuda.device_array(WIDTH, np.float32)
    plan.run(d, a, s)
    plan.run(d, b, s)
    got_a, got_b = host(a, s), host(b, s)
    assert got_a.tobytes() == got_b.tobytes()
    assert_close(got_a, red.col_sum_ref(x), atol=1e-6 * np.abs(x).sum(axis=0).max(), rtol=1e-6)
    # a strided view (columns 3..3+500 of a wider batch) and accumulate
    wide = rng.standard_normal((BATCH, WIDTH + 16)).astype(np.float32)
    dw = dev(wide, s)
    view = dw[:, 3 : 3 + 500]
    base = rng.standard_normal(500).astype(np.float32)
    c = dev(base, s)
    red.col_sum(view, c, _cuda.device_array(red.col_partials_shape(BATCH, 500), np.float32), s, accumulate=True)
    ref = red.col_sum_ref(wide[:, 3:503]) + base
    assert_close(host(c, s), ref, atol=1e-6 * np.abs(wide).sum(axis=0).max() + 1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# elementwise
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("act", sorted(ew.ACTIVATIONS))
def test_activations_real_size(rng, act):
    s = stream()
    n = (1 << 20) + 3
    x = rng.uniform(-8, 8, n).astype(np.float32)
    x[:4] = [0.0, 1e20, -1e20, np.nan]
    dy = rng.standard_normal(n).astype(np.float32)
    dx_, ddy = dev(x, s), dev(dy, s)
    y = _cuda.device_array(n, np.float32)
    g = _cuda.device_array(n, np.float32)
    ew.activation(dx_, y, act, s)
    ew.activation_backward(dx_, ddy, g, act, s)
    assert_close(host(y, s), ew.activation_ref(x, act), atol=2e-6, rtol=2e-6)
    assert_close(host(g, s), dy * ew.activation_grad_ref(x, act), atol=2e-6, rtol=2e-5)


def test_blas1_and_bias_act_real_size(rng):
    s = stream()
    x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    bias = rng.standard_normal(WIDTH).astype(np.float32)
    d, db = dev(x, s), dev(bias, s)
    pre = _cuda.device_array((BATCH, WIDTH), np.float32)
    y = _cuda.device_array((BATCH, WIDTH), np.float32)
    ew.bias_act(d, db, y, "relu", s, pre=pre)
    ref_pre = x + bias.astype(np.float64)
    assert_close(host(pre, s), ref_pre, atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(host(y, s), np.maximum(host(pre, s), 0))
    alpha = dev(np.array([0.37], np.float32), s)
    ew.axpy(alpha, d, y, s)
    assert_close(host(y, s), np.maximum(host(pre, s), 0) + np.float32(0.37) * np.float64(x), atol=1e-6, rtol=1e-6)
    buf = dev(rng.integers(0, 255, 4 * 1000 + 3).astype(np.uint8), s)
    ew.fill_bytes_zero(buf, s)
    assert not host(buf, s).any()


# ---------------------------------------------------------------------------------------------
# softmax family and LayerNorm
# ---------------------------------------------------------------------------------------------
def test_softmax_family_c51_rows(rng):
    s = stream()
    x = (rng.standard_normal((BATCH, 4, 51)) * 5).astype(np.float32)
    x[0, 0, :] = -np.inf
    d = dev(x, s)
    y = _cuda.device_array(x.shape, np.float32)
    lse = _cuda.device_array((BATCH, 4), np.float32)
    sm.softmax(d, y, s)
    p = host(y, s)
    assert_close(p, sm.softmax_ref(x), atol=1e-6, rtol=1e-5)
    sm.log_softmax(d, y, s)
    logp = host(y, s)
    assert_close(logp, sm.log_softmax_ref(x), atol=1e-5, rtol=1e-5)
    sm.logsumexp(d, lse, s)
    assert_close(host(lse, s), sm.logsumexp_ref(x), atol=1e-5, rtol=1e-6)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    dx = _cuda.device_array(x.shape, np.float32)
    good = np.isfinite(p).all(axis=-1)
    sm.softmax_backward(dev(p, s), dev(dy, s), dx, s)
    assert_close(host(dx, s)[good], sm.softmax_backward_ref(p, dy)[good], atol=1e-6, rtol=1e-5)
    sm.log_softmax_backward(dev(logp, s), dev(dy, s), dx, s)
    assert_close(host(dx, s)[good], sm.log_softmax_backward_ref(logp, dy)[good], atol=2e-6, rtol=1e-5)


def test_layernorm_real_size_and_bitwise_repeat(rng):
    s = stream()
    x = (rng.standard_normal((BATCH, WIDTH)) * 3 + 1).astype(np.float32)
    dy = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, WIDTH).astype(np.float32)
    beta = rng.standard_normal(WIDTH).astype(np.float32)
    plan = ln.LayerNormPlan(BATCH, WIDTH)
    d, dg, db, ddy = dev(x, s), dev(gamma, s), dev(beta, s), dev(dy, s)
    y = _cuda.device_array((BATCH, WIDTH), np.float32)
    mean = _cuda.device_array(BATCH, np.float32)
    rstd = _cuda.device_array(BATCH, np.float32)
    plan.forward(d, dg, db, y, mean, rstd, s)
    y_ref, mean_ref, rstd_ref = ln.layernorm_forward_ref(x, gamma, beta, plan.eps)
    assert_close(host(y, s), y_ref, atol=5e-5, rtol=1e-5)
    assert_close(host(rstd, s), rstd_ref, atol=0.0, rtol=1e-5)
    outs = []
    for _ in range(2):
        dx = _cuda.device_array((BATCH, WIDTH), np.float32)
        dgamma = _cuda.device_array(WIDTH, np.float32)
        dbeta = _cuda.device_array(WIDTH, np.float32)
        plan.backward(ddy, d, dg, mean, rstd, dx, dgamma, dbeta, s)
        outs.append([host(a, s) for a in (dx, dgamma, dbeta)])
    for a, b in zip(*outs):
        assert a.tobytes() == b.tobytes()
    dx_ref, dgamma_ref, dbeta_ref = ln.layernorm_backward_ref(dy, x, gamma, mean_ref, rstd_ref)
    assert_close(outs[0][0], dx_ref, atol=5e-5, rtol=1e-4)
    assert_close(outs[0][1], dgamma_ref, atol=1e-6 * np.abs(dy).sum(axis=0).max() * 4, rtol=1e-5)
    assert_close(outs[0][2], dbeta_ref, atol=1e-6 * np.abs(dy).sum(axis=0).max(), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# capture: graph replay == eager, bit for bit
# ---------------------------------------------------------------------------------------------
def test_graph_replay_equals_eager_bitwise(rng):
    s = stream()
    n_rows, n_cols = 4096, 512
    x = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    bias = rng.standard_normal(n_cols).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, n_cols).astype(np.float32)
    beta = rng.standard_normal(n_cols).astype(np.float32)
    d, db, dg, dbt = dev(x, s), dev(bias, s), dev(gamma, s), dev(beta, s)
    pre = _cuda.device_array((n_rows, n_cols), np.float32)
    h = _cuda.device_array((n_rows, n_cols), np.float32)
    y = _cuda.device_array((n_rows, n_cols), np.float32)
    mean = _cuda.device_array(n_rows, np.float32)
    rstd = _cuda.device_array(n_rows, np.float32)
    dx = _cuda.device_array((n_rows, n_cols), np.float32)
    dgamma = _cuda.device_array(n_cols, np.float32)
    dbeta = _cuda.device_array(n_cols, np.float32)
    dbias = _cuda.device_array(n_cols, np.float32)
    probs = _cuda.device_array((n_rows, n_cols), np.float32)
    stats = _cuda.device_array(2, np.float32)
    norm = red.Reducer(n_rows * n_cols)
    cols = red.ColSum(n_rows, n_cols)
    lnp = ln.LayerNormPlan(n_rows, n_cols)

    def step(st):
        ew.bias_act(d, db, h, "silu", st, pre=pre)
        lnp.forward(h, dg, dbt, y, mean, rstd, st)
        sm.softmax(y, probs, st)
        lnp.backward(probs, h, dg, mean, rstd, dx, dgamma, dbeta, st)
        ew.activation_backward(pre, dx, dx, "silu", st)
        cols.run(dx, dbias, st)
        norm.l2norm(dx, stats, st, at=0)
        norm.max(probs, stats, st, at=1)
        ew.scale(dx, stats[0:1], st)

    step(s)  # eager
    eager = [host(a, s) for a in (dx, dgamma, dbeta, dbias, stats, probs)]
    for a in (dx, dgamma, dbeta, dbias, stats, probs):
        ew.fill(a, np.nan, s)
    g = graph.capture(step, stream=s, warmup=False)
    assert g.captured
    g.replay()
    g.replay()  # the step is a pure function of its inputs: every replay gives the same bits
    replayed = [host(a, s) for a in (dx, dgamma, dbeta, dbias, stats, probs)]
    g.close()
    for e, r in zip(eager, replayed):
        assert e.tobytes() == r.tobytes()
    assert np.isfinite(eager[4]).all()
