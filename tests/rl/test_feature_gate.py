"""FeatureGate: a hand-computed case, and the observation-side gate (no input gradient) against the
float64 reference. The shared checks (FD, device vs reference, the gradient rule) run for it in
tests/rl/test_module_contract.py."""

import math

import numpy as np
import pytest

from numbarl.cuda import blas
from numbarl.cuda.runtime import Arena, cuda, stream
from numbarl.cuda.testing import assert_close
from numbarl.rl.nets.base import ParamStore
from numbarl.rl.nets.feature_gate import FeatureGate, feature_gate_backward_ref, feature_gate_forward_ref

_cuda = cuda()


def test_hand_computed():
    """x = [1, -2], W = 0, b = [0, ln 3]: g = [1/2, 3/4], y = [0.5, -1.5]; dy = [1, 1]:
    dpre = dy·x·g(1-g) = [0.25, -0.375], dx = dy·g + dpre·Wᵀ = [0.5, 0.75], db = dpre."""
    x = np.array([[1.0, -2.0]])
    w = np.zeros((2, 2))
    b = np.array([0.0, math.log(3.0)])
    y, cache = feature_gate_forward_ref(x, w, b)
    np.testing.assert_allclose(y, [[0.5, -1.5]])
    dx, dw, db = feature_gate_backward_ref(np.ones((1, 2)), cache, w)
    np.testing.assert_allclose(db, [0.25, -0.375])
    np.testing.assert_allclose(dx, [[0.5, 0.75]])
    np.testing.assert_allclose(dw, [[0.25, -0.375], [-0.5, 0.75]])


@pytest.mark.parametrize("backend", ["host", "kernel"])
def test_gate_without_input_gradient(rng, backend):
    blas.set_backend(backend)
    try:
        gate = FeatureGate("gate", 5, input_grad=False)
        store = ParamStore()
        gate.declare_params(store)
        store.allocate()
        store.init(rng)
        acts = Arena("acts")
        gate.declare_acts(acts, 6, "online")
        acts.allocate()
        params = {n: v.astype(np.float64) for n, v in store.to_host().items()}
        x = rng.standard_normal((6, 5)).astype(np.float32)
        dy = rng.standard_normal((6, 5)).astype(np.float32)
        s = stream()
        y = gate.forward(_cuda.to_device(x), s)
        assert gate.backward(_cuda.to_device(dy), s) is None
        ref_y, cache = gate.forward_ref(x, params)
        _, ref_grads = gate.backward_ref(dy, cache, params)
        assert_close(y.copy_to_host(), ref_y, 2e-6, 2e-5)
        grads = store.to_host("grads")
        for name, g in ref_grads.items():
            assert_close(grads[name], g, 2e-6, 2e-5)
        # the gate starts mostly open: sigma(2) for every feature when W is ~0
        assert np.all(store.to_host()["gate.b"] == 2.0)
    finally:
        blas.set_backend(None)


def test_attention_block_matches_pytorch(rng):
    """The trunk's gated feature-attention block y = LN(h + h ⊙ σ(h·W + b)) (Mlp(attention=True)) against
    torch autograd on the same parameters: output, input gradient and every parameter gradient."""
    torch = pytest.importorskip("torch")
    from numbarl.rl.nets.mlp import Mlp

    B, D, H = 6, 5, 7
    trunk = Mlp("trunk", D, (H,), attention=True, input_grad=True)
    store = ParamStore()
    trunk.declare_params(store)
    store.allocate()
    store.init(rng)
    values = {n: (0.5 * rng.standard_normal(v.shape)).astype(np.float32) for n, v in store.to_host().items()}
    store.load(values)
    acts = Arena("acts")
    trunk.declare_acts(acts, B, "online")
    acts.allocate()
    x = rng.standard_normal((B, D)).astype(np.float32)
    dy = rng.standard_normal((B, H)).astype(np.float32)
    s = stream()
    y = trunk.forward(_cuda.to_device(x), s).copy_to_host()
    dx = trunk.backward(_cuda.to_device(dy), s).copy_to_host()
    t = {n: torch.tensor(v, requires_grad=True) for n, v in values.items()}
    xt = torch.tensor(x, requires_grad=True)
    h = torch.relu(xt @ t["trunk.fc0.w"] + t["trunk.fc0.b"])
    g = torch.sigmoid(h @ t["trunk.attn.gate.w"] + t["trunk.attn.gate.b"])
    yt = torch.nn.functional.layer_norm(h + h * g, (H,), t["trunk.attn.ln.gamma"], t["trunk.attn.ln.beta"], eps=1e-5)
    (yt * torch.tensor(dy)).sum().backward()
    assert_close(y, yt.detach().numpy(), 1e-5, 1e-5)
    assert_close(dx, xt.grad.numpy(), 1e-5, 1e-5)
    grads = store.to_host("grads")
    for n, v in t.items():
        assert_close(grads[n], v.grad.numpy(), 1e-5, 1e-5)
