"""GPU checks of future-feature regression (agent.future_weight): the loss against its float64 reference at a real
size, graph replay == eager bitwise and two runs bitwise identical for the agent's train steps with it on (an aux
step, a step without it, an aux step); with the temporal input too.

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_future.py -m gpu -q`
"""

import numpy as np
import pytest
from agent_helpers import (
    GPU_N_ENVS,
    GPU_SIZES,
    GPU_STATE_DIM,
    agent_snapshot,
    check_graph_replay_equals_eager,
    check_two_runs_bitwise_identical,
    gpu_agent_config,
)
from agent_helpers import fill_replay as _fill

from numbarl.cuda.runtime import stream
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.losses.future import future_ref
from numbarl.rl.obs_columns import NO_COLUMN

pytestmark = pytest.mark.gpu

TERMS = "1*3,0,5*5"  # two products (one a square) and one column of next_obs
FIRST, SECOND = [1, 0, 5], [3, NO_COLUMN, 5]
CFG = gpu_agent_config(future_weight=0.1, future_targets=TERMS, aux_frequency=2)


def _agent(seed=1, cfg=CFG):
    return DQNAgent(cfg, GPU_STATE_DIM, GPU_SIZES, GPU_N_ENVS, seed=seed)


def _snapshot(agent, s):
    return agent_snapshot(agent, s, {"ff_loss": agent.ff_loss.loss, "ff_pred": agent.ff_head.output("online")})


def test_loss_matches_reference_at_real_size(rng):
    agent = _agent()
    _fill(agent, rng)
    s = stream()
    agent.train_step(s, aux=True)
    s.synchronize()
    pred = agent.ff_head.output("online").copy_to_host()
    loss, per_sample, dpred = future_ref(pred, agent.replay.batch.next_obs.copy_to_host(), FIRST, SECOND,
                                         agent.replay.batch.done.copy_to_host())
    assert float(agent.ff_loss.loss.copy_to_host()[0]) == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(agent.ff_loss.per_sample.copy_to_host(), per_sample, rtol=1e-4, atol=1e-6)
    got = agent.ff_loss.grad("pred").copy_to_host()  # λ-scaled in place by Loss.apply
    want = CFG.future_weight * dpred
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    assert agent.read_stats(s)["future_loss"] == pytest.approx(loss, rel=1e-5)


def test_graph_replay_equals_eager_bitwise(rng):
    eager, _, _ = check_graph_replay_equals_eager(_agent(), rng, _snapshot)
    assert np.isfinite(eager["ff_loss"][0]) and eager["ff_loss"][0] > 0


def test_two_runs_bitwise_identical(rng):
    check_two_runs_bitwise_identical(rng, lambda: _agent(seed=3), _snapshot)


def test_with_the_temporal_input_graph_equals_eager(rng):
    cfg = gpu_agent_config(future_weight=0.1, future_targets=TERMS, aux_frequency=2, temporal="mamba")
    eager, _, _ = check_graph_replay_equals_eager(_agent(cfg=cfg), rng, _snapshot)
    assert np.isfinite(eager["ff_loss"][0]) and eager["ff_loss"][0] > 0
