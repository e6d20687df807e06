"""GPU checks of the IQN head (agent.iqn): the quantile Huber loss and the head against their float64
references at a real size, graph replay == eager bitwise and two runs bitwise identical for the agent's
train steps with IQN on (an aux step, a step without it, an aux step).

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_iqn.py -m gpu -q`
"""

import numpy as np
import pytest
from agent_helpers import GPU_N_ENVS, GPU_SIZES, GPU_STATE_DIM, agent_snapshot, check_graph_replay_equals_eager
from agent_helpers import check_two_runs_bitwise_identical, gpu_agent_config
from agent_helpers import fill_replay as _fill

from numbarl.cuda.runtime import stream
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.losses.quantile_huber import quantile_huber_ref

pytestmark = pytest.mark.gpu

SIZES, STATE_DIM, N_ENVS = GPU_SIZES, GPU_STATE_DIM, GPU_N_ENVS
CFG = gpu_agent_config(iqn=True, iqn_quantiles=32, iqn_embed=64, aux_frequency=2)


def _agent(seed=1):
    return DQNAgent(CFG, STATE_DIM, SIZES, N_ENVS, seed=seed)


def _snapshot(agent, s):
    return agent_snapshot(agent, s, {"iqn_loss": agent.iqn_loss.loss})


def test_loss_matches_reference_at_real_size(rng):
    agent = _agent()
    _fill(agent, rng)
    s = stream()
    agent.train_step(s, aux=True)
    s.synchronize()
    head, batch = agent.iqn_head, agent.replay.batch
    x = dict(quantiles=head.output("online").copy_to_host(), tau=head.tau_buffer("online").copy_to_host(),
             target_quantiles=head.output("target").copy_to_host(), next_q=agent.head.outputs("next").q.copy_to_host(),
             actions=batch.action.copy_to_host(), rewards=batch.reward.copy_to_host(), dones=batch.done.copy_to_host(),
             discounts=batch.discount.copy_to_host())
    loss, per_sample, dz = quantile_huber_ref(**x, branch_sizes=SIZES)
    assert float(agent.iqn_loss.loss.copy_to_host()[0]) == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(agent.iqn_loss.per_sample.copy_to_host(), per_sample, rtol=1e-4, atol=1e-6)
    got = agent.iqn_loss.grad("quantiles").copy_to_host()
    assert np.max(np.abs(got - dz)) <= 1e-5 * np.max(np.abs(dz))
    stats = agent.read_stats(s)
    assert stats["iqn_loss"] == np.float32(agent.iqn_loss.loss.copy_to_host()[0]) and stats["iqn_loss"] > 0


def test_graph_replay_equals_eager_bitwise(rng):
    eager, _, _ = check_graph_replay_equals_eager(_agent(), rng, _snapshot)
    assert np.isfinite(eager["iqn_loss"][0]) and eager["iqn/readiness_state"][0] > 0


def test_two_runs_bitwise_identical(rng):
    check_two_runs_bitwise_identical(rng, lambda: _agent(seed=3), _snapshot)
