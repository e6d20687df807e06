"""Layers (Linear, Activation, LayerNorm, Mlp): finite-difference checks of the float64 references,
then the device layers (simulator) against those references on odd shapes (batch 7, in 5, out 13).
"""

import numpy as np
import pytest

from numbarl.cuda import blas
from numbarl.cuda.runtime import Arena, cuda, stream
from numbarl.cuda.testing import assert_fd_gradient
from numbarl.rl.nets.activations import Activation, activation_backward_ref, activation_ref
from numbarl.rl.nets.base import ParamStore
from numbarl.rl.nets.layernorm import LayerNorm, layernorm_backward_ref, layernorm_forward_ref
from numbarl.rl.nets.linear import Linear, linear_backward_ref, linear_forward_ref
from numbarl.rl.nets.mlp import Mlp

_cuda = cuda()
RTOL, ATOL = 2e-5, 2e-6


def _close(got, ref, rtol=RTOL, atol=ATOL, what=""):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    err = np.abs(got - ref) - (atol + rtol * np.abs(ref))
    assert (err <= 0).all(), f"{what}: {(err > 0).sum()} of {err.size} off, max abs err {np.abs(got - ref).max():.3e}"


@pytest.fixture
def host_gemm():
    """Networks call many GEMMs: the simulator's numpy GEMM keeps these tests fast (blas's own
    tests cover the tiled kernel; test_linear_kernel_backend runs the layer on it once)."""
    blas.set_backend("host")
    yield
    blas.set_backend(None)


# ---------------------------------------------------------------------------------------------
# finite differences of the float64 references
# ---------------------------------------------------------------------------------------------
def _fd_check(forward, backward, inputs: dict, rng, out_shape, rtol=1e-6, atol=1e-8):
    """L = Σ forward(**inputs) · R for a fixed random R; backward(R) must give dL/d(each input)."""
    R = rng.standard_normal(out_shape)
    analytic = backward(R)
    for name, x in inputs.items():
        assert_fd_gradient(lambda: float(np.sum(forward() * R)), x, analytic[name], range(x.size), atol, rtol,
                           label=f"d{name}")


@pytest.mark.parametrize("act", [None, "relu", "silu"])
def test_linear_ref_finite_differences(rng, act):
    x, w, b = rng.standard_normal((4, 3)), rng.standard_normal((3, 5)), rng.standard_normal(5)

    def backward(R):
        dx, dw, db = linear_backward_ref(x, w, linear_forward_ref(x, w, b, act)[1], R, act)
        return {"x": dx, "w": dw, "b": db}

    _fd_check(lambda: linear_forward_ref(x, w, b, act)[0], backward, {"x": x, "w": w, "b": b}, rng, (4, 5))


@pytest.mark.parametrize("act", ["relu", "silu", "tanh"])
def test_activation_ref_finite_differences(rng, act):
    x = rng.standard_normal((3, 6)) * 3
    _fd_check(lambda: activation_ref(x, act), lambda R: {"x": activation_backward_ref(R, x, act)},
              {"x": x}, rng, (3, 6))


def test_layernorm_ref_finite_differences(rng):
    x, gamma, beta = rng.standard_normal((4, 6)) * 2 + 1, rng.standard_normal(6), rng.standard_normal(6)

    def backward(R):
        _, cache = layernorm_forward_ref(x, gamma, beta, 1e-5)
        dx, dg, db = layernorm_backward_ref(R, cache, gamma)
        return {"x": dx, "gamma": dg, "beta": db}

    _fd_check(lambda: layernorm_forward_ref(x, gamma, beta, 1e-5)[0], backward,
              {"x": x, "gamma": gamma, "beta": beta}, rng, (4, 6), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("layernorm,act", [(False, "silu"), (True, "relu")])
def test_mlp_ref_finite_differences(rng, layernorm, act):
    net = Mlp("trunk", 3, (5, 4), activation=act, layernorm=layernorm, input_grad=True)
    store = ParamStore()
    net.declare_params(store)
    params = {name: rng.standard_normal(spec.shape) for name, spec in store.specs.items()}
    x = rng.standard_normal((3, 3))

    def backward(R):
        out, caches = net.forward_ref(x, params)
        dx, grads = net.backward_ref(R, caches, params)
        return {"x": dx, **grads}

    _fd_check(lambda: net.forward_ref(x, params)[0], backward, {"x": x, **params}, rng, (3, 4), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# device layers vs references
# ---------------------------------------------------------------------------------------------
def _build(layer, batch, rng, tags=(("online", True),)):
    store = ParamStore()
    layer.declare_params(store)
    store.allocate()
    store.init(rng)
    acts = Arena("acts")
    for tag, backward in tags:
        layer.declare_acts(acts, batch, tag, backward=backward)
    acts.allocate()
    return store, acts


def _host(x):
    s = stream()
    out = x.copy_to_host(stream=s)
    s.synchronize()
    return out


def _randomize(store, rng, role="params"):
    """Random values in a role (beyond the init range: exercises ReLU on both sides)."""
    values = {n: rng.standard_normal(s.shape).astype(np.float32) for n, s in store.specs.items()}
    store.load(values, role=role)
    return {n: v.astype(np.float64) for n, v in values.items()}


def _check_layer(layer, batch, in_dim, out_dim, rng, input_grad=True):
    store, _ = _build(layer, batch, rng)
    params = _randomize(store, rng)
    x = rng.standard_normal((batch, in_dim)).astype(np.float32)
    dy = rng.standard_normal((batch, out_dim)).astype(np.float32)
    # grads hold garbage first: backward must overwrite, not accumulate
    store.load({n: np.full(s.shape, 7.0, np.float32) for n, s in store.specs.items()}, role="grads")
    y = layer.forward(_cuda.to_device(x), stream())
    dx = layer.backward(_cuda.to_device(dy), stream())
    ref_y, cache = layer.forward_ref(x, params)
    ref_dx, ref_grads = layer.backward_ref(dy, cache, params)
    _close(_host(y), ref_y, what="y")
    if input_grad:
        _close(_host(dx), ref_dx, what="dx")
    else:
        assert dx is None
    grads = store.to_host("grads")
    assert set(ref_grads) == set(grads)
    for name, g in ref_grads.items():
        _close(grads[name], g, what=name)


@pytest.mark.parametrize("act", [None, "silu"])
def test_linear_matches_reference(rng, host_gemm, act):
    _check_layer(Linear("fc", 5, 13, act), 7, 5, 13, rng)


def test_linear_kernel_backend(rng):
    """The same check through the simulated tiled GEMM kernel (ReLU epilogue, bgrad, no dx)."""
    blas.set_backend("kernel")
    try:
        _check_layer(Linear("fc", 5, 13, "relu", input_grad=False), 7, 5, 13, rng, input_grad=False)
    finally:
        blas.set_backend(None)


def test_linear_hand_computed(host_gemm):
    """W = [[1, -1], [2, 0]], b = [0.5, -3], x = [1, 2]: pre = [5.5, -4], relu → [5.5, 0];
    dy = [1, 1] → dpre = [1, 0], dW = xᵀ·dpre = [[1, 0], [2, 0]], db = [1, 0], dx = dpre·Wᵀ = [1, 2]."""
    layer = Linear("fc", 2, 2, "relu")
    store, _ = _build(layer, 1, np.random.default_rng(0))
    store.load({"fc.w": np.array([[1, -1], [2, 0]], np.float32), "fc.b": np.array([0.5, -3], np.float32)})
    y = layer.forward(_cuda.to_device(np.array([[1, 2]], np.float32)), stream())
    dx = layer.backward(_cuda.to_device(np.array([[1, 1]], np.float32)), stream())
    np.testing.assert_array_equal(_host(y), [[5.5, 0]])
    np.testing.assert_array_equal(_host(dx), [[1, 2]])
    grads = store.to_host("grads")
    np.testing.assert_array_equal(grads["fc.w"], [[1, 0], [2, 0]])
    np.testing.assert_array_equal(grads["fc.b"], [1, 0])


def test_activation_layer(rng):
    layer = Activation("act", 13, "silu")
    _, acts = _build(layer, 7, rng)
    x = (rng.standard_normal((7, 13)) * 4).astype(np.float32)
    dy = rng.standard_normal((7, 13)).astype(np.float32)
    _close(_host(layer.forward(_cuda.to_device(x), stream())), activation_ref(x, "silu"), what="y")
    _close(_host(layer.backward(_cuda.to_device(dy), stream())), activation_backward_ref(dy, x, "silu"), what="dx")


def test_layernorm_layer(rng):
    layer = LayerNorm("ln", 13)
    _check_layer(layer, 7, 13, 13, rng)


def test_layernorm_hand_computed():
    """x = [1, 2, 3, 6]: mean 3, var 3.5, x̂ = (x − 3)/sqrt(3.5 + eps); γ = 2, β = 1 → y = 2x̂ + 1."""
    layer = LayerNorm("ln", 4, eps=1e-5)
    store, _ = _build(layer, 1, np.random.default_rng(0))
    store.load({"ln.gamma": np.full(4, 2, np.float32), "ln.beta": np.ones(4, np.float32)})
    y = _host(layer.forward(_cuda.to_device(np.array([[1, 2, 3, 6]], np.float32)), stream()))
    _close(y, 2 * (np.array([[1, 2, 3, 6]]) - 3) / np.sqrt(3.5 + 1e-5) + 1, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layernorm,act", [(False, "relu"), (True, "silu")])
def test_mlp_matches_reference(rng, host_gemm, layernorm, act):
    net = Mlp("trunk", 5, (13, 6), activation=act, layernorm=layernorm, input_grad=True)
    _check_layer(net, 7, 5, 6, rng)


def test_mlp_tags_roles_and_names(rng, host_gemm):
    """A no-backward tag reads the target role; names follow the documented scheme; init bounds."""
    net = Mlp("trunk", 5, (13, 6), activation="relu")
    store, acts = _build(net, 7, rng, tags=(("online", True), ("target", False)))
    assert net.param_names == ["trunk.fc0.w", "trunk.fc0.b", "trunk.fc1.w", "trunk.fc1.b"]
    assert store.specs["trunk.fc0.w"].decay and not store.specs["trunk.fc0.b"].decay
    assert store.groups() == ["trunk"]
    init = store.to_host()
    for name, fan_in in (("trunk.fc0.w", 5), ("trunk.fc0.b", 5), ("trunk.fc1.w", 13)):
        assert np.abs(init[name]).max() <= 1 / np.sqrt(fan_in) and init[name].std() > 0
    assert "trunk.fc0.target.dpre" not in acts and "trunk.fc0.online.dx" not in acts
    online, target = _randomize(store, rng), _randomize(store, rng, role="target")
    x = rng.standard_normal((7, 5)).astype(np.float32)
    dx = _cuda.to_device(x)
    h_online = _host(net.forward(dx, stream(), tag="online"))
    h_target = _host(net.forward(dx, stream(), tag="target", role="target"))
    _close(h_online, net.forward_ref(x, online)[0], what="online")
    _close(h_target, net.forward_ref(x, target)[0], what="target")
    assert net.backward(_cuda.to_device(np.ones((7, 6), np.float32)), stream(), tag="online") is None
    with pytest.raises(RuntimeError, match="backward=False"):
        net.backward(_cuda.to_device(np.ones((7, 6), np.float32)), stream(), tag="target")
    with pytest.raises(ValueError, match="expected"):
        net.forward(_cuda.to_device(np.zeros((7, 4), np.float32)), stream())
    with pytest.raises(ValueError, match="activation"):
        Linear("bad", 2, 2, "swish")
