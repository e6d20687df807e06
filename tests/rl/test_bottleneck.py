"""Tanh input bottleneck (numbarl/rl/nets/bottleneck.py) on the simulator: a hand-computed case, the
observation-side layer (no input gradient) against the float64 reference, the PyTorch peer, the config
parse and the agent's wiring (the trunk's first Linear sees the compressed input; group trunk.bn). The
shared checks (finite differences, device vs reference on odd shapes, the gradient rule) run in
tests/rl/test_module_contract.py."""

import math

import numpy as np
import pytest
from agent_helpers import build_module

from numbarl.cuda.runtime import cuda, stream
from numbarl.cuda.testing import assert_close
from numbarl.rl.nets.bottleneck import (
    TanhBottleneck,
    bottleneck_backward_ref,
    bottleneck_forward_ref,
    parse_bottleneck,
)

_cuda = cuda()


def test_hand_computed():
    """x = [1, 2, 3, 4], block [1, 3) → one unit with W = [1, -1]ᵀ, b = 0: pre = 2 − 3 = −1,
    y = [1, 4, tanh(−1)]; dy = [1, 1, 1]: dpre = 1 − tanh²(−1), dx = [1, dpre, −dpre, 1]."""
    x = np.array([[1.0, 2.0, 3.0, 4.0]])
    w = np.array([[1.0], [-1.0]])
    y, cache = bottleneck_forward_ref(x, w, np.zeros(1), 1, 3)
    np.testing.assert_allclose(y, [[1.0, 4.0, math.tanh(-1.0)]])
    dx, dw, db = bottleneck_backward_ref(np.ones((1, 3)), cache, w, 1, 3)
    d = 1.0 - math.tanh(-1.0) ** 2
    np.testing.assert_allclose(dx, [[1.0, d, -d, 1.0]])
    np.testing.assert_allclose(dw, [[2.0 * d], [3.0 * d]])
    np.testing.assert_allclose(db, [d])


def test_parse():
    assert parse_bottleneck("") is None and parse_bottleneck("0:24:8") == (0, 24, 8)
    for bad in ("0:24", "a:b:c", "5:5:2", "0:4:0"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_bottleneck(bad)


def _build(rng, batch, in_dim, lo, hi, width, input_grad):
    layer, store, _, _ = build_module(TanhBottleneck("bn", in_dim, lo, hi, width, input_grad=input_grad), rng, batch)
    return layer, store


@pytest.mark.parametrize("input_grad", [True, False])
def test_device_against_reference_and_pytorch(rng, input_grad):
    B, D, lo, hi, k = 5, 8, 3, 7, 2
    layer, store = _build(rng, B, D, lo, hi, k, input_grad)
    params = {n: v.astype(np.float64) for n, v in store.to_host().items()}
    x = rng.standard_normal((B, D)).astype(np.float32)
    dy = rng.standard_normal((B, D - (hi - lo) + k)).astype(np.float32)
    s = stream()
    y = layer.forward(_cuda.to_device(x), s).copy_to_host()
    dx = layer.backward(_cuda.to_device(dy), s)
    ref_y, cache = layer.forward_ref(x, params)
    ref_dx, ref_grads = layer.backward_ref(dy, cache, params)
    assert_close(y, ref_y, 2e-6, 2e-5)
    grads = store.to_host("grads")
    for name, g in ref_grads.items():
        assert_close(grads[name], g, 2e-6, 2e-5)
    if input_grad:
        assert_close(dx.copy_to_host(), ref_dx, 2e-6, 2e-5)
    else:
        assert dx is None
    torch = pytest.importorskip("torch")
    xt = torch.tensor(x, requires_grad=True)
    w = torch.tensor(store.to_host()["bn.w"], requires_grad=True)
    b = torch.tensor(store.to_host()["bn.b"], requires_grad=True)
    yt = torch.cat([xt[:, :lo], xt[:, hi:], torch.tanh(xt[:, lo:hi] @ w + b)], dim=1)
    (yt * torch.tensor(dy)).sum().backward()
    assert_close(y, yt.detach().numpy(), 1e-5, 1e-5)
    assert_close(grads["bn.w"], w.grad.numpy(), 1e-5, 1e-5)
    assert_close(grads["bn.b"], b.grad.numpy(), 1e-5, 1e-5)
    if input_grad:
        assert_close(dx.copy_to_host(), xt.grad.numpy(), 1e-5, 1e-5)


def test_agent_trunk_reads_the_compressed_input(rng):
    from numbarl.config import AgentConfig, ConfigError
    from numbarl.rl.agents.dqn import DQNAgent

    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=40, n_step=2, input_bottleneck="1:4:2")
    agent = DQNAgent(cfg, 5, (3, 3, 4, 4), 4, seed=1)
    assert "trunk.bn" in agent.optim.groups and agent.trunk.layers[0].out_dim == 4
    assert agent.store.to_host()["trunk.fc0.w"].shape == (4, 8)
    with pytest.raises(ConfigError, match="columns 1..6 do not fit the observation's 5"):
        DQNAgent(AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=40, input_bottleneck="1:7:2"),
                 5, (3, 3, 4, 4), 4, seed=1)
