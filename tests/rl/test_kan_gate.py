"""KAN spline gate (numbarl/rl/nets/kan_gate.py) on the simulator: the B-spline bases by hand (knots,
partition of unity, derivatives), a hand-computed gate, the kernels against the float64 reference with
inputs on every cell, at the grid's ends and outside it, the observation-side gate (no input gradient),
and the PyTorch peer (Cox–de Boor bases and autograd). The shared checks (finite differences, device
vs reference on odd shapes, the gradient rule) run in tests/rl/test_module_contract.py."""

import math

import numpy as np
import pytest
from agent_helpers import build_module

from numbarl.cuda.runtime import cuda, stream
from numbarl.cuda.testing import assert_close
from numbarl.rl.nets.kan_gate import (
    N_BASIS,
    N_COEF,
    KanGate,
    basis_deriv_ref,
    basis_ref,
    kan_gate_backward_ref,
    kan_gate_forward_ref,
)

_cuda = cuda()


def test_bases_by_hand():
    """At a knot (u = 0) the cubic B-splines are (1/6, 4/6, 1/6) on three bases; at a cell's middle
    (1/48, 23/48, 23/48, 1/48); the bases sum to 1 and their derivatives to 0 everywhere."""
    np.testing.assert_allclose(basis_ref(np.array([-5.0]))[0], [1 / 6, 4 / 6, 1 / 6, 0, 0, 0, 0, 0], atol=1e-15)
    np.testing.assert_allclose(basis_ref(np.array([5.0]))[0], [0, 0, 0, 0, 0, 1 / 6, 4 / 6, 1 / 6], atol=1e-15)
    np.testing.assert_allclose(basis_ref(np.array([0.0]))[0], [0, 0, 1 / 48, 23 / 48, 23 / 48, 1 / 48, 0, 0],
                               atol=1e-15)  # x = 0 is the middle of cell 2 ([-1, 1]): bases 2..5
    x = np.linspace(-6.0, 6.0, 241)
    np.testing.assert_allclose(basis_ref(x).sum(-1), 1.0, atol=1e-14)
    inside = (x >= -5) & (x <= 5)
    np.testing.assert_allclose(basis_deriv_ref(x).sum(-1), 0.0, atol=1e-14)
    # derivatives against central differences away from the grid's ends
    e = 1e-6
    fd = (basis_ref(x + e) - basis_ref(x - e)) / (2 * e)
    np.testing.assert_allclose(basis_deriv_ref(x)[inside & (np.abs(np.abs(x) - 5) > 1e-3)],
                               fd[inside & (np.abs(np.abs(x) - 5) > 1e-3)], atol=1e-7)
    assert not basis_deriv_ref(np.array([-7.0, 5.5, 6.0])).any()  # constant outside the grid
    np.testing.assert_allclose(basis_deriv_ref(np.array([5.0]))[0], [0, 0, 0, 0, 0, -0.25, 0, 0.25], atol=1e-15)


def test_hand_computed_gate():
    """θ = (w_b, w_s, c) = (0, 1, ln 3, ...): φ = ln 3 everywhere, g = 3/4; x = 2: y = 1.5, dy = 1:
    dφ = x g (1 − g) = 0.375; dx = g = 0.75 (the spline is flat: no path through φ); ∂w_b = dφ·silu(2),
    ∂w_s = dφ·ln 3, ∂c_m = dφ·B_m(2) (x = 2: the middle of cell 3, [1, 3]: bases 3..6)."""
    theta = np.full((1, N_COEF), math.log(3.0))
    theta[0, 0], theta[0, 1] = 0.0, 1.0
    x = np.array([[2.0]])
    y, cache = kan_gate_forward_ref(x, theta)
    np.testing.assert_allclose(y, [[1.5]])
    dx, dtheta = kan_gate_backward_ref(np.ones((1, 1)), cache, theta)
    np.testing.assert_allclose(dx, [[0.75]])
    silu2 = 2.0 / (1.0 + math.exp(-2.0))
    np.testing.assert_allclose(dtheta[0, :2], [0.375 * silu2, 0.375 * math.log(3.0)])
    np.testing.assert_allclose(dtheta[0, 2:], 0.375 * np.array([0, 0, 0, 1 / 48, 23 / 48, 23 / 48, 1 / 48, 0]),
                               atol=1e-15)


def _build(rng, batch, dim, input_grad=True):
    gate, store, _, _ = build_module(KanGate("kan", dim, input_grad=input_grad), rng, batch)
    return gate, store


@pytest.mark.parametrize("input_grad", [True, False])
def test_kernels_against_reference(rng, input_grad):
    """Inputs on every cell, on knots, at ±5 and outside the grid; random θ."""
    batch, dim = 6, 5
    gate, store = _build(rng, batch, dim, input_grad)
    assert np.array_equal(store.to_host()["kan.theta"][:, 2:], np.full((dim, N_BASIS), 2.0, np.float32))
    theta = (0.7 * rng.standard_normal((dim, N_COEF))).astype(np.float32)
    store.load({"kan.theta": theta})
    x = rng.uniform(-5.5, 5.5, (batch, dim)).astype(np.float32)
    x[0] = [-5.0, 5.0, -3.0, 1.0, 7.0]  # the ends, two knots, outside
    dy = rng.standard_normal((batch, dim)).astype(np.float32)
    s = stream()
    y = gate.forward(_cuda.to_device(x), s)
    dx = gate.backward(_cuda.to_device(dy), s)
    ref_y, cache = gate.forward_ref(x, {"kan.theta": theta.astype(np.float64)})
    ref_dx, ref_grads = gate.backward_ref(dy, cache, {"kan.theta": theta.astype(np.float64)})
    assert_close(y.copy_to_host(), ref_y, 2e-6, 2e-5)
    assert_close(store.to_host("grads")["kan.theta"], ref_grads["kan.theta"], 2e-6, 2e-5)
    if input_grad:
        assert_close(dx.copy_to_host(), ref_dx, 2e-6, 2e-5)
    else:
        assert dx is None


def test_pytorch_peer(rng):
    """Cox–de Boor bases and autograd in float32 (numbarl/rl/torch_peer_kan.py) on the same θ and x:
    output, input gradient and ∂θ within 1e-5 of the kernels."""
    pytest.importorskip("torch")
    from numbarl.rl.torch_peer_kan import kan_gate_forward_backward

    batch, dim = 8, 4
    gate, store = _build(rng, batch, dim)
    theta = (0.7 * rng.standard_normal((dim, N_COEF))).astype(np.float32)
    store.load({"kan.theta": theta})
    x = rng.uniform(-6.0, 6.0, (batch, dim)).astype(np.float32)
    x[0] = [-5.0, 5.0, -6.0, 0.0]  # the clip values, where autograd's clamp passes a one-sided derivative
    dy = rng.standard_normal((batch, dim)).astype(np.float32)
    s = stream()
    y = gate.forward(_cuda.to_device(x), s).copy_to_host()
    dx = gate.backward(_cuda.to_device(dy), s).copy_to_host()
    peer = kan_gate_forward_backward(theta, x, dy)
    assert_close(y, peer["y"], 1e-5, 1e-5)
    assert_close(dx, peer["dx"], 1e-5, 1e-5)
    assert_close(store.to_host("grads")["kan.theta"], peer["dtheta"], 1e-5, 1e-5)
