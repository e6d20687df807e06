"""GPU checks of the regime gate (agent.regime_gate, numbarl/rl/nets/regime_gate.py) at a real size: the module
(cuBLASLt GEMMs, the kernels) against its float64 reference, graph replay == eager bitwise and two same-seed runs
bitwise identical for the agent's train steps, alone and with the temporal input (the trunk then computes its
input gradient: the gate's path through r, the scatter-add kernel) and the other trunk pieces on.

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_regime_gate.py -m gpu -q`
"""

import numpy as np
import pytest
from agent_helpers import (
    GPU_N_ENVS,
    GPU_SIZES,
    GPU_STATE_DIM,
    agent_snapshot,
    build_module,
    capture_train_step,
    check_graph_replay_equals_eager,
    check_two_runs_bitwise_identical,
    gpu_agent_config,
    train_steps,
)

from numbarl.cuda.runtime import cuda, stream
from numbarl.cuda.testing import assert_close
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.nets.linear import Linear
from numbarl.rl.nets.regime_gate import RegimeGate

pytestmark = pytest.mark.gpu

CFG = gpu_agent_config(regime_gate=True)  # the default columns 53, 9, 10, 11, 12 of the 64


def _agent(cfg=CFG, seed=1):
    return DQNAgent(cfg, GPU_STATE_DIM, GPU_SIZES, GPU_N_ENVS, seed=seed)


def _snapshot(agent, s):
    return agent_snapshot(agent, s, {"h_gated": agent.trunk.output("online"),
                                     "gate": agent.acts["trunk.rgate.online.s"]})


@pytest.mark.parametrize("input_grad", [True, False])
def test_module_matches_reference_at_real_size(rng, input_grad):
    B, D, H, cols = 4096, GPU_STATE_DIM, 512, (53, 9, 10, 11, 12)
    gate, store, _, _ = build_module(RegimeGate("rg", Linear("rg.fc", D, H, "relu", input_grad=input_grad), D, H, cols),
                                     rng, B)
    values = {n: (0.1 * rng.standard_normal(s.shape)).astype(np.float32) for n, s in store.specs.items()}
    store.load(values)
    params = {n: v.astype(np.float64) for n, v in values.items()}
    x = rng.standard_normal((B, D)).astype(np.float32)
    dy = rng.standard_normal((B, H)).astype(np.float32)
    s = stream()
    y = gate.forward(cuda().to_device(x), s)
    dx = gate.backward(cuda().to_device(dy), s)
    s.synchronize()
    ref_y, cache = gate.forward_ref(x, params)
    ref_dx, ref_grads = gate.backward_ref(dy, cache, params)
    assert_close(y.copy_to_host(), ref_y, 1e-5, 1e-4)
    grads = store.to_host("grads")
    for name, g in ref_grads.items():
        assert_close(grads[name], g, 1e-3, 1e-4)  # sums over 4096 rows
    if input_grad:
        assert_close(dx.copy_to_host(), ref_dx, 1e-5, 1e-4)
    else:
        assert dx is None


def test_graph_replay_equals_eager_bitwise(rng):
    eager, _, _ = check_graph_replay_equals_eager(_agent(), rng, _snapshot, steps=train_steps,
                                                  capture=capture_train_step)
    for name in ("grads/trunk.rgate.w", "grads/trunk.rgate.b"):
        g = eager[name]
        assert np.all(np.isfinite(g)) and np.any(g != 0), name


def test_two_runs_bitwise_identical(rng):
    check_two_runs_bitwise_identical(rng, lambda: _agent(seed=3), _snapshot, steps=train_steps)


def test_with_the_temporal_input_and_the_other_trunk_pieces(rng):
    """The gate with the temporal input (its input gradient, through r too), the tanh input bottleneck, the KAN
    gate, the gated feature-attention block and regime dropout on: graph replay == eager and two runs, bitwise."""
    cfg = gpu_agent_config(regime_gate=True, temporal="mamba", temporal_steps=8, temporal_heads=8, kan_gate=True,
                           feature_attention=True, input_bottleneck="0:8:4", regime_dropout=True, regime_dropout_col=3)
    check_graph_replay_equals_eager(_agent(cfg), rng, _snapshot, steps=train_steps, capture=capture_train_step)
    check_two_runs_bitwise_identical(rng, lambda: _agent(cfg, seed=3), _snapshot, steps=train_steps)
