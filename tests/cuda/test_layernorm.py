"""LayerNorm kernels (numbarl.cuda.kernels.layernorm) against float64 numpy references."""

import math

import numpy as np
import pytest

from numbarl.cuda import reduce as red
from numbarl.cuda.kernels import layernorm as ln
from numbarl.cuda.runtime import cuda, stream

_cuda = cuda()


from numbarl.cuda.testing import assert_close, to_device as dev, to_host as host  # noqa: E402


def params(rng, n_cols):
    gamma = rng.uniform(0.5, 1.5, n_cols).astype(np.float32)
    beta = rng.standard_normal(n_cols).astype(np.float32)
    return gamma, beta


def test_forward_backward_against_reference(rng):
    s = stream()
    n_rows = int(rng.integers(9, 16))  # two row blocks
    n_cols = int(rng.integers(4 * red.LANES + 1, 5 * red.LANES + 2))  # unrolled mean loop + remainder
    x = (rng.standard_normal((n_rows, n_cols)) * 2 + 3).astype(np.float32)
    dy = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    gamma, beta = params(rng, n_cols)
    eps = 1e-5
    plan = ln.LayerNormPlan(n_rows, n_cols, eps)
    dxx, dg, db = dev(x, s), dev(gamma, s), dev(beta, s)
    y = _cuda.device_array((n_rows, n_cols), np.float32)
    mean = _cuda.device_array(n_rows, np.float32)
    rstd = _cuda.device_array(n_rows, np.float32)
    plan.forward(dxx, dg, db, y, mean, rstd, s)
    y_ref, mean_ref, rstd_ref = ln.layernorm_forward_ref(x, gamma, beta, eps)
    assert_close(host(mean, s), mean_ref, atol=1e-5, rtol=1e-5)
    assert_close(host(rstd, s), rstd_ref, atol=1e-6, rtol=1e-5)
    assert_close(host(y, s), y_ref, atol=2e-5, rtol=1e-5)

    dx = _cuda.device_array((n_rows, n_cols), np.float32)
    dgamma = _cuda.device_array(n_cols, np.float32)
    dbeta = _cuda.device_array(n_cols, np.float32)
    plan.backward(dev(dy, s), dxx, dg, mean, rstd, dx, dgamma, dbeta, s)
    dx_ref, dgamma_ref, dbeta_ref = ln.layernorm_backward_ref(dy, x, gamma, mean_ref, rstd_ref)
    assert_close(host(dx, s), dx_ref, atol=2e-5, rtol=1e-4)
    assert_close(host(dgamma, s), dgamma_ref, atol=1e-5 * n_rows, rtol=1e-4)
    assert_close(host(dbeta, s), dbeta_ref, atol=1e-6 * n_rows, rtol=1e-5)


def test_param_grads_over_several_chunks_and_accumulate(rng):
    """More rows than one chunk: partials per (tile, chunk), then the fixed fold over chunks."""
    s = stream()
    n_rows = int(rng.integers(red.CHUNK_ROWS + 1, red.CHUNK_ROWS + 60))
    n_cols = int(rng.integers(3, 9))
    x = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    dy = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    _, mean_ref, rstd_ref = ln.layernorm_forward_ref(x, np.ones(n_cols), np.zeros(n_cols))
    shape = ln.layernorm_partials_shape(n_rows, n_cols)
    assert shape == (2, 2, n_cols)
    partials = dev(np.full(shape, np.nan, np.float32), s)  # garbage must not leak through
    mean = dev(mean_ref.astype(np.float32), s)
    rstd = dev(rstd_ref.astype(np.float32), s)
    dgamma = _cuda.device_array(n_cols, np.float32)
    dbeta = _cuda.device_array(n_cols, np.float32)
    ddy, dxx = dev(dy, s), dev(x, s)
    ln.layernorm_param_grads(ddy, dxx, mean, rstd, dgamma, dbeta, partials, s)
    _, dgamma_ref, dbeta_ref = ln.layernorm_backward_ref(dy, x, np.ones(n_cols), mean_ref, rstd_ref)
    tol = dict(atol=2e-6 * n_rows, rtol=1e-4)
    assert_close(host(dgamma, s), dgamma_ref, **tol)
    assert_close(host(dbeta, s), dbeta_ref, **tol)
    ln.layernorm_param_grads(ddy, dxx, mean, rstd, dgamma, dbeta, partials, s, accumulate=True)
    assert_close(host(dgamma, s), 2 * dgamma_ref, **tol)
    assert_close(host(dbeta, s), 2 * dbeta_ref, **tol)
    with pytest.raises(ValueError, match="partials"):
        ln.layernorm_param_grads(ddy, dxx, mean, rstd, dgamma, dbeta, _cuda.device_array((2, 1, n_cols), np.float32), s)


def test_hand_computed_constant_row_and_in_place():
    s = stream()
    eps = 1e-5
    x = np.array([[1.0, 2.0, 3.0, 4.0], [7.0, 7.0, 7.0, 7.0]], np.float32)  # the second row is constant
    gamma = np.array([1.0, 2.0, 1.0, 0.5], np.float32)
    beta = np.array([0.0, 0.0, 1.0, -1.0], np.float32)
    d = dev(x, s)
    mean = _cuda.device_array(2, np.float32)
    rstd = _cuda.device_array(2, np.float32)
    ln.layernorm_forward(d, dev(gamma, s), dev(beta, s), d, mean, rstd, eps, s)  # y aliases x
    rs = 1.0 / math.sqrt(1.25 + eps)  # var of 1..4 is 1.25
    xhat = (np.array([1.0, 2.0, 3.0, 4.0]) - 2.5) * rs
    np.testing.assert_allclose(host(mean, s), [2.5, 7.0], rtol=1e-7)
    np.testing.assert_allclose(host(rstd, s), [rs, 1.0 / math.sqrt(eps)], rtol=1e-6)
    got = host(d, s)
    np.testing.assert_allclose(got[0], xhat * gamma + beta, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[1], beta)  # constant row: xhat = 0, y = beta

    # backward of the constant row with dy = 1: g - mean(g) only; dx aliases dy
    dy = dev(np.ones((2, 4), np.float32), s)
    partials = _cuda.device_array(ln.layernorm_partials_shape(2, 4), np.float32)
    dgamma = _cuda.device_array(4, np.float32)
    dbeta = _cuda.device_array(4, np.float32)
    ln.layernorm_backward(dy, dev(x, s), dev(gamma, s), mean, rstd, dy, dgamma, dbeta, partials, s)
    dx_got = host(dy, s)
    np.testing.assert_allclose(dx_got[1], (gamma - gamma.mean()) / math.sqrt(eps), rtol=1e-5)
    np.testing.assert_array_equal(host(dbeta, s), [2.0, 2.0, 2.0, 2.0])
    np.testing.assert_allclose(host(dgamma, s), xhat, rtol=1e-6, atol=1e-6)


def test_3d_input_and_shape_errors(rng):
    s = stream()
    x = rng.standard_normal((2, 3, 10)).astype(np.float32)
    gamma, beta = params(rng, 10)
    y = _cuda.device_array((2, 3, 10), np.float32)
    mean = _cuda.device_array((2, 3), np.float32)
    rstd = _cuda.device_array((2, 3), np.float32)
    ln.layernorm_forward(dev(x, s), dev(gamma, s), dev(beta, s), y, mean, rstd, 1e-3, s)
    y_ref, mean_ref, rstd_ref = ln.layernorm_forward_ref(x, gamma, beta, 1e-3)
    assert_close(host(y, s), y_ref, atol=2e-5, rtol=1e-5)
    assert_close(host(rstd, s), rstd_ref, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="gamma"):
        ln.layernorm_forward(dev(x, s), dev(gamma[:-1], s), dev(beta, s), y, mean, rstd, 1e-3, s)
    with pytest.raises(ValueError, match="eps"):
        ln.LayerNormPlan(4, 4, eps=0.0)


def test_reference_backward_matches_finite_differences(rng):
    n_rows, n_cols, eps = 3, 6, 1e-3
    x = rng.standard_normal((n_rows, n_cols))
    gamma = rng.uniform(0.5, 1.5, n_cols)
    beta = rng.standard_normal(n_cols)
    w = rng.standard_normal((n_rows, n_cols))  # loss = sum(w * y)

    def loss(x_, g_, b_):
        return float(np.sum(w * ln.layernorm_forward_ref(x_, g_, b_, eps)[0]))

    _, mean, rstd = ln.layernorm_forward_ref(x, gamma, beta, eps)
    dx, dgamma, dbeta = ln.layernorm_backward_ref(w, x, gamma, mean, rstd)
    h = 1e-6

    def fd(f, a):
        out = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            ap, am = a.copy(), a.copy()
            ap[idx] += h
            am[idx] -= h
            out[idx] = (f(ap) - f(am)) / (2 * h)
        return out

    np.testing.assert_allclose(dx, fd(lambda a: loss(a, gamma, beta), x), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dgamma, fd(lambda a: loss(x, a, beta), gamma), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dbeta, fd(lambda a: loss(x, gamma, a), beta), rtol=1e-5, atol=1e-7)
