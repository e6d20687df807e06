"""GPU checks of regime dropout (agent.regime_dropout) at a real size: the kernel's scales against the
reference (a float32 rate computed with the same operations; an element whose draw sits within an ulp
of its rate may differ under fused multiply-add, so a handful of mismatches out of two million are
allowed), graph replay == eager bitwise and two runs bitwise identical for the agent's train steps, alone
and with the trunk's tanh input bottleneck, KAN gate and gated feature-attention block.

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_regime_dropout.py -m gpu -q`
"""

import numpy as np
import pytest
from agent_helpers import (
    GPU_N_ENVS,
    GPU_SIZES,
    GPU_STATE_DIM,
    agent_snapshot,
    capture_train_step,
    check_graph_replay_equals_eager,
    check_two_runs_bitwise_identical,
    fill_replay,
    gpu_agent_config,
    train_steps,
)

from numbarl.cuda.runtime import stream
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.nets.regime_dropout import scale_ref

pytestmark = pytest.mark.gpu

CFG = gpu_agent_config(regime_dropout=True, regime_dropout_col=3)


def _agent(seed=1):
    return DQNAgent(CFG, GPU_STATE_DIM, GPU_SIZES, GPU_N_ENVS, seed=seed)


def _snapshot(agent, s):
    return agent_snapshot(agent, s, {"h_drop": agent.rdrop.output, "scale": agent.rdrop.arena["scale"]})


def test_scales_match_reference_at_real_size(rng):
    agent = _agent()
    fill_replay(agent, rng)
    s = stream()
    agent.train_step(s)
    s.synchronize()
    scale = agent.rdrop.arena["scale"].copy_to_host()
    regime = agent.replay.batch.obs.copy_to_host()[:, 3]
    ref = scale_ref(regime, scale.shape[1], CFG.regime_dropout_lo, CFG.regime_dropout_hi, seed=1, counter=0)
    assert np.count_nonzero((scale == 0) != (ref == 0)) <= 8
    same = (scale == 0) == (ref == 0)
    np.testing.assert_allclose(scale[same], ref[same], rtol=1e-6)
    frac = float((scale == 0).mean())
    p = np.clip(regime, 0, 1) * (CFG.regime_dropout_hi - CFG.regime_dropout_lo) + CFG.regime_dropout_lo
    assert abs(frac - float(p.mean())) < 0.01


def test_graph_replay_equals_eager_bitwise(rng):
    check_graph_replay_equals_eager(_agent(), rng, _snapshot, steps=train_steps, capture=capture_train_step)


def test_two_runs_bitwise_identical(rng):
    check_two_runs_bitwise_identical(rng, lambda: _agent(seed=3), _snapshot, steps=train_steps)


def test_with_the_kan_gate_feature_attention_and_the_input_bottleneck(rng):
    """Regime dropout with the trunk's tanh input bottleneck, KAN gate and gated feature-attention block on:
    graph replay == eager and two runs, bitwise."""
    cfg = gpu_agent_config(regime_dropout=True, regime_dropout_col=3, kan_gate=True, feature_attention=True,
                           input_bottleneck="0:24:8")

    def make(seed=1):
        return DQNAgent(cfg, GPU_STATE_DIM, GPU_SIZES, GPU_N_ENVS, seed=seed)

    check_graph_replay_equals_eager(make(), rng, _snapshot, steps=train_steps, capture=capture_train_step)
    check_two_runs_bitwise_identical(rng, lambda: make(seed=3), _snapshot, steps=train_steps)
