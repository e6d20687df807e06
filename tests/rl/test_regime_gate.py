"""Regime gate (numbarl/rl/nets/regime_gate.py) on the simulator: a hand-computed case, finite differences of
the float64 reference, the kernels against it (output, input gradient, every parameter gradient) with and
without an input gradient, the PyTorch peer (autograd through the same network), the init (the gated trunk
starts as the ungated one, bit for bit, and still has non-zero gate gradients), the column parse and the
agent's wiring (group trunk.rgate, columns checked against the observation). The shared checks (finite
differences, device vs reference on odd shapes, the gradient rule) run in tests/rl/test_module_contract.py
("regime-gate", "mlp-regime-gate")."""

import math

import numpy as np
import pytest
from agent_helpers import build_module

from numbarl.cuda.runtime import cuda, stream
from numbarl.cuda.testing import assert_close, assert_fd_gradient
from numbarl.rl.nets.linear import Linear
from numbarl.rl.nets.mlp import Mlp
from numbarl.rl.nets.regime_gate import (
    RegimeGate,
    regime_gate_backward_ref,
    regime_gate_forward_ref,
)

_cuda = cuda()
RTOL, ATOL = 1e-5, 1e-6


def test_hand_computed():
    """h = [1, −2], r = [2], W = [0, 0.5], b = [0, ln 3 − 1]: z = [0, ln 3], s = [1/2, 3/4], g = [1, 3/2],
    y = [1, −3]; dy = [1, 1]: dh = g = [1, 3/2], dz = dy·h·2s(1 − s) = [1/2, −3/4], dW = r·dz = [1, −3/2],
    db = dz, dr = dz·Wᵀ = −3/8."""
    w = np.array([[0.0, 0.5]])
    y, cache = regime_gate_forward_ref(np.array([[1.0, -2.0]]), np.array([[2.0]]), w, np.array([0.0, math.log(3) - 1]))
    np.testing.assert_allclose(y, [[1.0, -3.0]])
    dh, dr, dw, db = regime_gate_backward_ref(np.ones((1, 2)), cache, w)
    np.testing.assert_allclose(dh, [[1.0, 1.5]])
    np.testing.assert_allclose(dw, [[1.0, -1.5]])
    np.testing.assert_allclose(db, [0.5, -0.75])
    np.testing.assert_allclose(dr, [[-0.375]])


def test_reference_matches_finite_differences(rng):
    """Every gradient of L = Σ R ⊙ y(h, r, W, b) against central differences, every entry."""
    B, R, H = 4, 3, 5
    arrays = {"h": rng.standard_normal((B, H)), "r": rng.standard_normal((B, R)),
              "w": rng.standard_normal((R, H)), "b": rng.standard_normal(H)}
    weights = rng.standard_normal((B, H))

    def loss():
        return float(np.sum(weights * regime_gate_forward_ref(arrays["h"], arrays["r"], arrays["w"], arrays["b"])[0]))

    _, cache = regime_gate_forward_ref(arrays["h"], arrays["r"], arrays["w"], arrays["b"])
    dh, dr, dw, db = regime_gate_backward_ref(weights, cache, arrays["w"])
    for name, grad in (("h", dh), ("r", dr), ("w", dw), ("b", db)):
        assert_fd_gradient(loss, arrays[name], grad, range(arrays[name].size), 1e-8, 1e-6, label=f"d{name}")


def _gate(input_grad: bool, cols=(5, 0, 3)):
    """The gate around a Linear + SiLU body on 7 inputs, 6 features."""
    return RegimeGate("rg", Linear("rg.fc", 7, 6, "silu", input_grad=input_grad), 7, 6, cols)


@pytest.mark.parametrize("input_grad", [True, False])
def test_device_against_reference_and_pytorch(rng, input_grad):
    B, D, H, cols = 5, 7, 6, (5, 0, 3)
    gate, store, _, _ = build_module(_gate(input_grad, cols), rng, B)
    values = {n: (0.5 * rng.standard_normal(s.shape)).astype(np.float32) for n, s in store.specs.items()}
    store.load(values)  # the gate away from its zero init
    params = {n: v.astype(np.float64) for n, v in values.items()}
    x = rng.standard_normal((B, D)).astype(np.float32)
    dy = rng.standard_normal((B, H)).astype(np.float32)
    s = stream()
    y = gate.forward(_cuda.to_device(x), s).copy_to_host()
    dx = gate.backward(_cuda.to_device(dy), s)
    ref_y, cache = gate.forward_ref(x, params)
    ref_dx, ref_grads = gate.backward_ref(dy, cache, params)
    assert_close(y, ref_y, ATOL, RTOL)
    grads = store.to_host("grads")
    assert set(grads) == set(ref_grads) == {"rg.w", "rg.b", "rg.fc.w", "rg.fc.b"}
    for name, g in ref_grads.items():
        assert_close(grads[name], g, ATOL, RTOL)
    if input_grad:
        assert_close(dx.copy_to_host(), ref_dx, ATOL, RTOL)
    else:
        assert dx is None
    # the PyTorch peer: the same network by autograd (the input gradient includes the path through r)
    torch = pytest.importorskip("torch")
    t = {n: torch.tensor(v, requires_grad=True) for n, v in values.items()}
    xt = torch.tensor(x, requires_grad=True)
    h = torch.nn.functional.silu(xt @ t["rg.fc.w"] + t["rg.fc.b"])
    yt = h * 2.0 * torch.sigmoid(xt[:, list(cols)] @ t["rg.w"] + t["rg.b"])
    (yt * torch.tensor(dy)).sum().backward()
    assert_close(y, yt.detach().numpy(), 1e-5, 1e-5)
    for name in values:
        assert_close(grads[name], t[name].grad.numpy(), 1e-5, 1e-5)
    if input_grad:
        assert_close(dx.copy_to_host(), xt.grad.numpy(), 1e-5, 1e-5)


def test_starts_as_the_ungated_trunk_and_learns(rng):
    """Same seed: the gated trunk's other parameters get the ungated trunk's init (the gate's zero init draws
    nothing) and its output is the ungated output bit for bit (g = 2σ(0) = 1); the gate's gradients at init are
    non-zero (σ at its steepest) and the bias's is Σ_b dy ⊙ h / 2. The bottleneck is on: r is the raw input's
    columns, not the bottleneck's output."""
    B, D = 6, 9
    x = rng.standard_normal((B, D)).astype(np.float32)
    dy = rng.standard_normal((B, 8)).astype(np.float32)
    kw = {"activation": "silu", "bottleneck": (2, 6, 2)}  # SiLU: no feature is zero on every row
    plain, _, plain_init, _ = build_module(Mlp("trunk", D, (8,), **kw), np.random.default_rng(5), B)
    gated, store, init, _ = build_module(Mlp("trunk", D, (8,), regime_gate=(7, 3), **kw), np.random.default_rng(5), B)
    assert set(init) == set(plain_init) | {"trunk.rgate.w", "trunk.rgate.b"}
    assert all(np.array_equal(init[n], v) for n, v in plain_init.items())
    assert not init["trunk.rgate.w"].any() and not init["trunk.rgate.b"].any()
    assert store.specs["trunk.rgate.w"].group == "trunk.rgate" and store.specs["trunk.rgate.w"].shape == (2, 8)
    s = stream()
    h = plain.forward(_cuda.to_device(x), s).copy_to_host()
    y = gated.forward(_cuda.to_device(x), s).copy_to_host()
    assert np.array_equal(y, h)
    assert gated.backward(_cuda.to_device(dy), s) is None  # on the observation: no input gradient
    grads = store.to_host("grads")
    assert np.all(grads["trunk.rgate.w"] != 0) and np.all(grads["trunk.rgate.b"] != 0)
    assert_close(grads["trunk.rgate.b"], (dy.astype(np.float64) * h).sum(0) / 2, ATOL, RTOL)
    assert_close(grads["trunk.rgate.w"], x[:, [7, 3]].T.astype(np.float64) @ (dy * h / 2), ATOL, RTOL)


def test_module_checks():  # the option's syntax: tests/rl/test_obs_columns.py
    with pytest.raises(ValueError, match="distinct columns of the 7 inputs"):
        _gate(True, cols=(2, 7))


def test_config_and_agent_wiring():
    from numbarl.config import AgentConfig, ConfigError
    from numbarl.rl.agents.dqn import DQNAgent

    with pytest.raises(ConfigError, match=r"agent.regime_gate_cols = '53,x'"):
        AgentConfig(regime_gate=True, regime_gate_cols="53,x").validate()
    with pytest.raises(ConfigError, match=r"agent.regime_gate_cols = '1,1'.*twice"):
        AgentConfig(regime_gate_cols="1,1").validate()
    with pytest.raises(ConfigError, match="does not have agent.regime_gate"):
        AgentConfig(kind="ppo", regime_gate=True).validate()
    AgentConfig(regime_gate=True, weight_decay_groups="trunk.rgate").validate()
    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=40, n_step=2, regime_gate=True,
                      regime_gate_cols="4,0")
    agent = DQNAgent(cfg, 5, (3, 3, 4, 4), 4, seed=1)
    assert "trunk.rgate" in agent.optim.groups and agent.trunk.layers[0].cols == (4, 0)
    assert agent.store.to_host()["trunk.rgate.w"].shape == (2, 8)
    with pytest.raises(ConfigError, match=r"agent.regime_gate_cols = 'adx_14,rv_8,rv_32,rv_128,rv_ratio': column 53 "
                                          r"\('adx_14' in the default feature list .*\) is not an obs column "
                                          r"\(the observation has 5\)"):
        DQNAgent(AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=40, regime_gate=True),
                 5, (3, 3, 4, 4), 4, seed=1)


def test_default_columns_name_the_regime_features():
    """The default columns (regime gate, regime dropout's and multi-horizon's ADX column) are feature names;
    on the default feature list they resolve to the indices they were before names were accepted (53, 9, 10,
    11, 12 and 53: the default learner's bits do not move), and name the features they are meant to read."""
    from numbarl.config import AgentConfig
    from numbarl.data.features import resolve_features
    from numbarl.rl.obs_columns import resolve_obs_columns

    names = resolve_features(None)
    cfg = AgentConfig()
    gate = resolve_obs_columns(cfg.regime_gate_cols, None, "regime_gate_cols", 72)
    assert gate == (53, 9, 10, 11, 12) == resolve_obs_columns(cfg.regime_gate_cols, names, "regime_gate_cols", 72)
    assert [names[c] for c in gate] == ["adx_14", "rv_8", "rv_32", "rv_128", "rv_ratio"]
    for field in ("regime_dropout_col", "horizon_regime_col"):
        assert resolve_obs_columns(getattr(cfg, field), None, field, 72, many=False) == (53,)
        assert names[53] == "adx_14"
