"""GPU checks of observation noise (agent.obs_noise) at a real size: the batch's noise against the reference
(the Box-Muller draws use the device's log and cos, which may differ from the host's in the last ulp, so the
comparison allows 1e-5), the replay left clean, graph replay == eager bitwise and two runs bitwise identical,
alone and with the temporal input.

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_obs_noise.py -m gpu -q`
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
from numbarl.env.params import PORTFOLIO_FEATURES
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.obs_noise import apply_ref

pytestmark = pytest.mark.gpu

CFG = gpu_agent_config(obs_noise=0.1)
N_MARKET = GPU_STATE_DIM - len(PORTFOLIO_FEATURES)


def _agent(seed=1, cfg=CFG):
    return DQNAgent(cfg, GPU_STATE_DIM, GPU_SIZES, GPU_N_ENVS, seed=seed)


def _snapshot(agent, s):
    return agent_snapshot(agent, s, {"obs": agent.replay.batch.obs, "next_obs": agent.replay.batch.next_obs})


def test_noise_matches_reference_at_real_size(rng):
    agent = _agent()
    fill_replay(agent, rng)
    ring = agent.replay.store["obs"].copy_to_host().reshape(-1, GPU_STATE_DIM)
    s = stream()
    agent.train_step(s)
    s.synchronize()
    index = agent.replay.batch.index.copy_to_host()
    obs = agent.replay.batch.obs.copy_to_host()
    want, e = apply_ref(ring[index], N_MARKET, 0.1, seed=1, lane0=0, counter=0)
    np.testing.assert_allclose(obs, want, rtol=0, atol=1e-5)
    assert np.array_equal(obs[:, N_MARKET:], ring[index][:, N_MARKET:])
    assert np.array_equal(agent.replay.store["obs"].copy_to_host().reshape(-1, GPU_STATE_DIM), ring)
    assert abs(float(np.std(obs[:, :N_MARKET] - ring[index][:, :N_MARKET])) - 0.1) < 0.002
    assert agent.read_stats(s)["obs_noise_var"] == pytest.approx(float(np.mean(e.astype(np.float64) ** 2)), rel=1e-4)


def test_graph_replay_equals_eager_bitwise(rng):
    check_graph_replay_equals_eager(_agent(), rng, _snapshot, steps=train_steps, capture=capture_train_step)


def test_two_runs_bitwise_identical(rng):
    check_two_runs_bitwise_identical(rng, lambda: _agent(seed=3), _snapshot, steps=train_steps)


def test_with_the_temporal_input(rng):
    cfg = gpu_agent_config(obs_noise=0.1, temporal="mamba", temporal_steps=8, temporal_conv=4)
    check_graph_replay_equals_eager(_agent(cfg=cfg), rng, _snapshot, steps=train_steps, capture=capture_train_step)
    check_two_runs_bitwise_identical(rng, lambda: _agent(seed=3, cfg=cfg), _snapshot, steps=train_steps)
