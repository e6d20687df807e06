"""GPU checks of spectral normalization (agent.spectral_norm) and the CVaR entry gate (agent.cvar_alpha):
the power iteration and the gradient transform against their float64 references at a real width,
graph replay == eager bitwise and two runs bitwise identical for the agent's train steps (every layer
normalized), and the collect step with the gate on, graph == eager bitwise.

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_spectral.py -m gpu -q`
"""

import numpy as np
import pytest
from agent_helpers import assert_bitwise as _assert_bitwise
from agent_helpers import (
    capture_train_step,
    check_graph_replay_equals_eager,
    check_two_runs_bitwise_identical,
    collect_graph_and_eager_runs,
    train_steps,
)

from numbarl.config import AgentConfig
from numbarl.cuda.runtime import Arena, stream
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.nets.spectral_norm import (
    SN_BLOCK,
    power_iteration_kernel,
    power_iteration_ref,
    spectral_backward_ref,
)

pytestmark = pytest.mark.gpu

SIZES = (3, 3, 4, 4)
STATE_DIM, N_ENVS, WIDTH = 64, 64, 512
CFG = AgentConfig(trunk=(WIDTH, WIDTH), n_atoms=51, batch_size=4096, replay_capacity=64 * N_ENVS, n_step=3,
                  gamma=0.99, target_update="periodic", target_period=2, weight_decay=0.01,
                  spectral_norm="trunk.fc0,trunk.fc1,head.value,head.adv")


def _unit(rng, n):
    x = rng.standard_normal(n)
    return (x / np.linalg.norm(x)).astype(np.float32)


def test_power_iteration_and_gradient_transform_at_real_size(rng):
    from numbarl.rl.nets.base import ParamStore
    from numbarl.rl.nets.spectral_norm import SpectralNorm

    store = ParamStore()
    store.add("fc.w", (WIDTH, WIDTH + 3), "fc", decay=True)
    store.allocate()
    w = (rng.standard_normal((WIDTH, WIDTH + 3)) / np.sqrt(WIDTH)).astype(np.float32)
    store.load({"fc.w": w})
    store.load({"fc.w": w}, role="target")
    sn = SpectralNorm(store, "fc", seed=1)
    u0, v0 = _unit(rng, WIDTH + 3), _unit(rng, WIDTH)
    sn.arena.load({"fc.u": u0, "fc.v": v0})
    s = stream()
    sn.refresh(s, n_iter=1)
    g = rng.standard_normal((WIDTH, WIDTH + 3)).astype(np.float32)
    store.arenas["grads"].load({"fc.w": g})
    sn.transform_grads(s)
    s.synchronize()
    out = sn.arena.to_host()
    ru, rv, rs = power_iteration_ref(w, u0, v0, 1)
    np.testing.assert_allclose(out["fc.u"], ru, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out["fc.v"], rv, rtol=1e-4, atol=1e-6)
    assert out["fc.sigma"][0] == pytest.approx(rs, rel=1e-5)
    np.testing.assert_allclose(out["fc.w_sn"], w / rs, rtol=1e-5, atol=1e-7)
    dw = store.to_host("grads")["fc.w"]
    ref = spectral_backward_ref(g, w, out["fc.u"], out["fc.v"])
    assert np.max(np.abs(dw - ref)) <= 1e-4 * np.max(np.abs(ref))
    # the σ-only refresh gives back the σ of the iteration bit for bit (what a checkpoint load relies on)
    arena = Arena("sigma-only")
    arena.add("t", (WIDTH + 3,))
    arena.add("sigma", (1,))
    arena.allocate()
    power_iteration_kernel[1, SN_BLOCK, s](store.arenas["params"]["fc.w"], sn.view("fc", "u"), sn.view("fc", "v"),
                                           arena["t"], arena["sigma"], np.int64(0), arena["sigma"], np.int64(-1))
    s.synchronize()
    assert arena.to_host()["sigma"].tobytes() == out["fc.sigma"].tobytes()


def _agent(seed=1, cfg=CFG):
    return DQNAgent(cfg, STATE_DIM, SIZES, N_ENVS, seed=seed)


def _snapshot(agent, s):
    out = dict(agent.state_arrays())
    out.update({f"sn/{k}": v for k, v in agent.spectral.arena.to_host().items()})
    out.update({f"grads/{k}": v for k, v in agent.store.to_host("grads").items()})
    s.synchronize()
    return out


def test_train_graph_replay_equals_eager_bitwise(rng):
    agent = _agent()
    eager, _, _ = check_graph_replay_equals_eager(agent, rng, _snapshot, train_steps, capture_train_step)
    assert all(eager[f"spectral/{layer}.sigma"][0] > 0 for layer in agent.spectral.names)


def test_two_runs_bitwise_identical(rng):
    check_two_runs_bitwise_identical(rng, lambda: _agent(seed=3), _snapshot, train_steps)


def test_collect_with_the_cvar_gate_graph_equals_eager_bitwise():
    from dataclasses import replace

    runs = collect_graph_and_eager_runs(replace(CFG, cvar_alpha=0.1, cvar_floor=1.0), N_ENVS,
                                        lambda agent, env: {f"cvar/{k}": v for k, v in agent.cvar_gate.dev.to_host().items()})
    _assert_bitwise(*runs)
    assert np.isfinite(runs[0]["cvar/cvar"]).all()
