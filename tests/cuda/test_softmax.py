"""Row-wise softmax family (numbarl.cuda.kernels.softmax) against float64 numpy references."""

import math

import numpy as np
import pytest

from numbarl.cuda.kernels import softmax as sm
from numbarl.cuda.runtime import cuda, stream

_cuda = cuda()


from numbarl.cuda.testing import assert_close, to_device as dev, to_host as host  # noqa: E402


def test_forward_against_reference_with_large_offsets(rng):
    """C51-like rows (51 atoms) and rows wider than one pass of 32 lanes; offsets of +-1000
    would overflow exp without the max shift."""
    s = stream()
    n_rows = int(rng.integers(9, 16))
    n_cols = int(rng.choice([51, 70]))
    x = (rng.standard_normal((n_rows, n_cols)) * 4).astype(np.float32)
    x[0] += 1000.0
    x[1] -= 1000.0
    dx = dev(x, s)
    y = _cuda.device_array((n_rows, n_cols), np.float32)
    lse = _cuda.device_array(n_rows, np.float32)
    sm.softmax(dx, y, s)
    assert_close(host(y, s), sm.softmax_ref(x), atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(host(y, s).sum(axis=1), 1.0, rtol=1e-5)
    sm.log_softmax(dx, y, s)
    assert_close(host(y, s), sm.log_softmax_ref(x), atol=2e-5, rtol=1e-5)
    sm.logsumexp(dx, lse, s)
    assert_close(host(lse, s), sm.logsumexp_ref(x), atol=1e-5, rtol=1e-6)


def test_3d_strided_and_in_place(rng):
    s = stream()
    batch, heads, atoms = 3, 4, 5
    x3 = rng.standard_normal((batch, heads, atoms)).astype(np.float32)
    d3 = dev(x3, s)
    sm.softmax(d3, d3, s)  # in place, [B, H, C] viewed as [B*H, C]
    assert_close(host(d3, s), sm.softmax_ref(x3), atol=1e-6, rtol=1e-5)
    lse = _cuda.device_array((batch, heads), np.float32)
    sm.logsumexp(dev(x3, s), lse, s)
    assert_close(host(lse, s), sm.logsumexp_ref(x3), atol=1e-5, rtol=1e-6)

    big = rng.standard_normal((7, 40)).astype(np.float32)
    dbig = dev(big, s)
    view = dbig[:, 3:36]  # strided rows of 33
    out = _cuda.device_array((7, 33), np.float32)
    sm.log_softmax(view, out, s)
    assert_close(host(out, s), sm.log_softmax_ref(big[:, 3:36]), atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="shape"):
        sm.softmax(view, _cuda.device_array((7, 34), np.float32), s)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator computes 0/0 with numpy
def test_hand_computed_and_edge_rows():
    s = stream()
    inf, nan = np.inf, np.nan
    x = np.array(
        [
            [0.0, math.log(3.0), -inf, -inf],  # hand case: [1/4, 3/4, 0, 0], lse = log 4
            [-inf, -inf, -inf, -inf],  # all -inf: lse -inf, softmax NaN
            [1.0, inf, 2.0, 0.0],  # +inf: lse +inf
            [1.0, nan, 2.0, 0.0],  # NaN: whole row NaN
            [5.0, 5.0, 5.0, 5.0],  # ties: uniform
        ],
        np.float32,
    )
    dx = dev(x, s)
    y = _cuda.device_array(x.shape, np.float32)
    lse = _cuda.device_array(x.shape[0], np.float32)
    sm.softmax(dx, y, s)
    got = host(y, s)
    np.testing.assert_allclose(got[0], [0.25, 0.75, 0.0, 0.0], rtol=1e-6)
    assert np.isnan(got[1]).all() and np.isnan(got[3]).all()
    np.testing.assert_array_equal(got[4], 0.25)
    assert_close(got, sm.softmax_ref(x), atol=1e-6, rtol=1e-5)
    sm.logsumexp(dx, lse, s)
    got = host(lse, s)
    assert got[1] == -inf and got[2] == inf and np.isnan(got[3])
    np.testing.assert_allclose(got[[0, 4]], [math.log(4.0), 5.0 + math.log(4.0)], rtol=1e-6)
    assert_close(got, sm.logsumexp_ref(x), atol=1e-6, rtol=1e-6)
    sm.log_softmax(dx, y, s)
    got = host(y, s)
    assert got[0, 2] == -inf
    assert_close(got, sm.log_softmax_ref(x), atol=1e-6, rtol=1e-6)

    # one column: softmax is 1, logsumexp is the value
    one = dev(np.array([[3.5], [-2.0]], np.float32), s)
    y1 = _cuda.device_array((2, 1), np.float32)
    sm.softmax(one, y1, s)
    assert host(y1, s).ravel().tolist() == [1.0, 1.0]
    l1 = _cuda.device_array(2, np.float32)
    sm.logsumexp(one, l1, s)
    assert host(l1, s).tolist() == [3.5, -2.0]


def test_backward_against_reference(rng):
    s = stream()
    n_rows, n_cols = int(rng.integers(9, 14)), int(rng.integers(33, 60))
    x = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    dy = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    p = sm.softmax_ref(x).astype(np.float32)
    logp = sm.log_softmax_ref(x).astype(np.float32)
    dx = _cuda.device_array((n_rows, n_cols), np.float32)
    sm.softmax_backward(dev(p, s), dev(dy, s), dx, s)
    assert_close(host(dx, s), sm.softmax_backward_ref(p, dy), atol=1e-6, rtol=1e-5)
    ddy = dev(dy, s)
    sm.log_softmax_backward(dev(logp, s), ddy, ddy, s)  # dx aliases dy
    assert_close(host(ddy, s), sm.log_softmax_backward_ref(logp, dy), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("log", [False, True])
def test_reference_backward_matches_finite_differences(log, rng):
    x = rng.standard_normal((3, 7))
    w = rng.standard_normal((3, 7))  # loss = sum(w * f(x))
    f = sm.log_softmax_ref if log else sm.softmax_ref
    h = 1e-6
    fd = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += h
        xm[idx] -= h
        fd[idx] = (np.sum(w * f(xp)) - np.sum(w * f(xm))) / (2 * h)
    analytic = sm.log_softmax_backward_ref(f(x), w) if log else sm.softmax_backward_ref(f(x), w)
    np.testing.assert_allclose(analytic, fd, rtol=1e-6, atol=1e-8)
