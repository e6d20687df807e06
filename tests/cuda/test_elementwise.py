"""Elementwise kernels (numbarl.cuda.kernels.elementwise) against their float64 numpy references."""

import math

import numpy as np
import pytest

from numbarl.cuda.kernels import elementwise as ew
from numbarl.cuda.runtime import cuda, stream

_cuda = cuda()

ACTS = ["identity", "relu", "silu", "gelu", "gelu_tanh", "tanh", "sigmoid"]


from numbarl.cuda.testing import assert_close, to_device as dev, to_host as host  # noqa: E402


def odd_size(rng, lo=300, hi=700):
    n = int(rng.integers(lo, hi))
    return n + 1 if n % ew.BLOCK == 0 else n


# ---------------------------------------------------------------------------------------------
# fill / copy / zero
# ---------------------------------------------------------------------------------------------
def test_fill_copy_and_byte_zeroing(rng):
    s = stream()
    n = odd_size(rng)
    x = _cuda.device_array((n // 7, 7), np.float32)  # 2-D contiguous: treated as a flat vector
    ew.fill(x, 2.5, s)
    assert np.all(host(x, s) == 2.5)
    xi = _cuda.device_array(n, np.int32)
    ew.fill(xi, -3, s)
    assert np.all(host(xi, s) == -3)

    src = rng.standard_normal(n).astype(np.float32)
    dst = _cuda.device_array(n, np.float32)
    ew.copy(dev(src, s), dst, s)
    np.testing.assert_array_equal(host(dst, s), src)

    # bytes: an aligned buffer (4-byte path) and an odd, unaligned slice (byte path)
    raw = (rng.integers(1, 255, 4 * n + 3)).astype(np.uint8)
    draw = dev(raw, s)
    ew.fill_bytes_zero(draw[4 : 4 + 4 * (n // 2)], s)
    ew.fill_bytes_zero(draw[4 * n - 5 : 4 * n + 2], s)
    want = raw.copy()
    want[4 : 4 + 4 * (n // 2)] = 0
    want[4 * n - 5 : 4 * n + 2] = 0
    np.testing.assert_array_equal(host(draw, s), want)
    # a float32 array is zeroed through its bytes
    ew.fill_bytes_zero(dst, s)
    assert np.all(host(dst, s) == 0.0)

    with pytest.raises(TypeError, match="dtypes"):
        ew.copy(dst, xi, s)
    with pytest.raises(ValueError, match="size"):
        ew.copy(dst, _cuda.device_array(n + 1, np.float32), s)


# ---------------------------------------------------------------------------------------------
# scale / axpy / axpby / add / mul
# ---------------------------------------------------------------------------------------------
def test_blas1_ops_with_host_and_device_scalars(rng):
    s = stream()
    n = odd_size(rng)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    alpha = float(rng.uniform(-2, 2))
    scalars = dev(np.array([9.0, alpha, -1.0], np.float32), s)  # the scalar lives inside a buffer
    tol = dict(atol=1e-6, rtol=1e-6)

    d = dev(x, s)
    ew.scale(d, alpha, s)
    assert_close(host(d, s), np.float64(x) * np.float32(alpha), **tol)
    d = dev(x, s)
    ew.scale(d, scalars[1:2], s)
    assert_close(host(d, s), np.float64(x) * np.float32(alpha), **tol)

    dy = dev(y, s)
    ew.axpy(alpha, dev(x, s), dy, s)
    assert_close(host(dy, s), y + np.float32(alpha) * np.float64(x), **tol)
    dy = dev(y, s)
    ew.axpy(scalars[1:2], dev(x, s), dy, s)
    assert_close(host(dy, s), y + np.float32(alpha) * np.float64(x), **tol)

    tau = 0.005
    dy = dev(y, s)
    ew.axpby(tau, dev(x, s), 1.0 - tau, dy, s)
    assert_close(host(dy, s), tau * np.float64(x) + (1.0 - tau) * y, **tol)

    out = _cuda.device_array(n, np.float32)
    ew.add(dev(x, s), dev(y, s), out, s)
    assert_close(host(out, s), np.float64(x) + y, **tol)
    ew.mul(dev(x, s), dev(y, s), out, s)
    assert_close(host(out, s), np.float64(x) * y, **tol)

    # hand-computed, with the output aliasing an input
    a = dev(np.array([1.0, -2.0, 0.5], np.float32), s)
    ew.axpy(2.0, a, a, s)  # a += 2a
    assert host(a, s).tolist() == [3.0, -6.0, 1.5]

    with pytest.raises(ValueError, match="size"):
        ew.add(dev(x, s), dev(y[:-1], s), out, s)
    with pytest.raises(TypeError, match="float32"):
        ew.scale(d, _cuda.device_array(1, np.float64), s)


# ---------------------------------------------------------------------------------------------
# activations
# ---------------------------------------------------------------------------------------------
EDGE = np.array([0.0, -0.0, 1e-8, -1e-8, 0.5, -0.5, 3.0, -3.0, 9.5, -9.5, 10.5, -10.5, 30.0, -30.0,
                 88.0, -88.0, 100.0, -100.0, 1e20, -1e20, np.nan], np.float32)


def test_activations_forward_backward_against_reference(rng):
    s = stream()
    n = odd_size(rng, 200, 400)
    x = np.concatenate([rng.uniform(-6, 6, n).astype(np.float32), EDGE])
    dy = rng.standard_normal(x.size).astype(np.float32)
    dx_dev = dev(x, s)
    ddy = dev(dy, s)
    y_dev = _cuda.device_array(x.size, np.float32)
    g_dev = _cuda.device_array(x.size, np.float32)
    for act in ACTS:
        ew.activation(dx_dev, y_dev, act, s)
        ew.activation_backward(dx_dev, ddy, g_dev, act, s)
        assert_close(host(y_dev, s), ew.activation_ref(x, act), atol=2e-6, rtol=2e-6)
        assert_close(host(g_dev, s), dy * ew.activation_grad_ref(x, act), atol=2e-6, rtol=2e-5)


def test_activation_hand_values_and_named_wrappers():
    s = stream()
    x = dev(np.array([-1.0, 0.0, 2.0], np.float32), s)
    y = _cuda.device_array(3, np.float32)
    ones = dev(np.ones(3, np.float32), s)
    g = _cuda.device_array(3, np.float32)
    ew.relu(x, y, s)
    assert host(y, s).tolist() == [0.0, 0.0, 2.0]
    ew.relu_backward(x, ones, g, s)
    assert host(g, s).tolist() == [0.0, 0.0, 1.0]  # f'(0) = 0 (PyTorch convention)
    ew.sigmoid(x, y, s)
    np.testing.assert_allclose(host(y, s), [1 / (1 + math.e), 0.5, 1 / (1 + math.exp(-2))], rtol=1e-6)
    ew.tanh_backward(x, ones, g, s)
    np.testing.assert_allclose(host(g, s), [1 - math.tanh(1) ** 2, 1.0, 1 - math.tanh(2) ** 2], rtol=1e-6)
    ew.gelu(x, y, s)
    np.testing.assert_allclose(host(y, s), [-0.15865525393145707, 0.0, 1.9544997361036416], rtol=1e-6)
    ew.gelu_backward(x, ones, g, s)
    assert host(g, s)[1] == 0.5
    ew.gelu_tanh(x, y, s)
    np.testing.assert_allclose(host(y, s), [-0.15880800939172324, 0.0, 1.9545976940871754], rtol=1e-6)
    ew.silu(x, y, s)
    np.testing.assert_allclose(host(y, s), [-1 / (1 + math.e), 0.0, 2 / (1 + math.exp(-2))], rtol=1e-6)
    ew.silu_backward(x, ones, g, s)
    assert host(g, s)[1] == 0.5
    ew.sigmoid_backward(x, ones, g, s)
    assert host(g, s)[1] == 0.25
    ew.tanh(x, y, s)
    ew.gelu_tanh_backward(x, ones, g, s)
    assert host(g, s)[1] == 0.5
    with pytest.raises(ValueError, match="unknown activation"):
        ew.activation(x, y, "swish2", s)


@pytest.mark.parametrize("act", ACTS)
def test_activation_grad_reference_matches_finite_differences(act, rng):
    x = rng.uniform(-4, 4, 200)
    x = x[np.abs(x) > 1e-3]  # relu is not differentiable at 0
    h = 1e-6
    fd = (ew.activation_ref(x + h, act) - ew.activation_ref(x - h, act)) / (2 * h)
    np.testing.assert_allclose(ew.activation_grad_ref(x, act), fd, rtol=1e-6, atol=1e-8)


def test_device_functions_run_on_the_host_too():
    """The @njit scalar math is the same compiled code host references can call."""
    for act in ACTS:
        code = ew.activation_code(act)
        for v in (-2.0, 0.25, 3.0):
            got = ew.activation_dev(code, np.float32(v))
            assert abs(got - ew.activation_ref(np.array([v]), act)[0]) < 1e-6
            got = ew.activation_grad_dev(code, np.float32(v))
            assert abs(got - ew.activation_grad_ref(np.array([v]), act)[0]) < 1e-6


# ---------------------------------------------------------------------------------------------
# bias add / fused bias + activation
# ---------------------------------------------------------------------------------------------
def test_bias_add_and_bias_act(rng):
    s = stream()
    n_rows, n_cols = int(rng.integers(5, 12)), int(rng.integers(20, 45))
    big = rng.standard_normal((n_rows, n_cols + 5)).astype(np.float32)
    bias = rng.standard_normal(n_cols).astype(np.float32)
    dbig = dev(big, s)
    xv = dbig[:, 2 : 2 + n_cols]  # strided input view
    x = big[:, 2 : 2 + n_cols]
    dbias = dev(bias, s)
    y = _cuda.device_array((n_rows, n_cols), np.float32)
    ew.bias_add(xv, dbias, y, s)
    assert_close(host(y, s), ew.bias_add_ref(x, bias), atol=1e-6, rtol=1e-6)

    pre = _cuda.device_array((n_rows, n_cols), np.float32)
    ew.bias_act(xv, dbias, y, "silu", s, pre=pre)
    ref_pre = ew.bias_add_ref(x, bias)
    assert_close(host(pre, s), ref_pre, atol=1e-6, rtol=1e-6)
    assert_close(host(y, s), ew.activation_ref(ref_pre, "silu"), atol=2e-6, rtol=2e-6)

    # 3-D contiguous [B, H, C] viewed as rows, in place (y aliases x)
    x3 = rng.standard_normal((2, 3, n_cols)).astype(np.float32)
    d3 = dev(x3, s)
    ew.bias_act(d3, dbias, d3, "relu", s)
    assert_close(host(d3, s), np.maximum(x3 + np.float64(bias), 0.0), atol=1e-6, rtol=1e-6)

    with pytest.raises(ValueError, match="do not match"):
        ew.bias_add(y, dev(bias[:-1], s), y, s)
