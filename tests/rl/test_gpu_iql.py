"""GPU checks of the IQL value head (agent.iql): the expectile loss and the head against their float64
references at a real size, graph replay == eager bitwise and two runs bitwise identical for the agent's
train steps with IQL on (an aux step, a step without it, an aux step).

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_iql.py -m gpu -q`
"""

import numpy as np
import pytest
from agent_helpers import GPU_N_ENVS, GPU_SIZES, GPU_STATE_DIM, agent_snapshot, check_graph_replay_equals_eager
from agent_helpers import check_two_runs_bitwise_identical, gpu_agent_config
from agent_helpers import fill_replay as _fill

from numbarl.cuda.runtime import stream
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.losses.expectile import expectile_ref

pytestmark = pytest.mark.gpu

SIZES, STATE_DIM, N_ENVS = GPU_SIZES, GPU_STATE_DIM, GPU_N_ENVS
CFG = gpu_agent_config(iql=True, iql_hidden=256, iql_expectile=0.7, aux_frequency=2)


def _agent(seed=1):
    return DQNAgent(CFG, STATE_DIM, SIZES, N_ENVS, seed=seed)


def _snapshot(agent, s):
    return agent_snapshot(agent, s, {"iql_loss": agent.iql_loss.loss, "iql_v": agent.iql_head.output("online")})


def test_loss_and_head_match_reference_at_real_size(rng):
    agent = _agent()
    _fill(agent, rng)
    s = stream()
    params = {k: np.asarray(v, np.float64) for k, v in agent.store.to_host("params").items()}
    agent.train_step(s, aux=True)
    s.synchronize()
    batch = agent.replay.batch
    v = agent.iql_head.output("online").copy_to_host()
    q = agent.head.outputs("iql_target").q.copy_to_host()
    actions = batch.action.copy_to_host()
    loss, per_sample, dv, _ = expectile_ref(v, q, actions, expectile=CFG.iql_expectile)
    assert float(agent.iql_loss.loss.copy_to_host()[0]) == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(agent.iql_loss.per_sample.copy_to_host(), per_sample, rtol=1e-4, atol=1e-6)
    got = agent.iql_loss.grad("v").copy_to_host()
    assert np.max(np.abs(got - dv)) <= 1e-5 * np.max(np.abs(dv))
    # the head's forward on the online trunk output (pre-update parameters), fp32 GEMMs vs float64
    v_ref, _ = agent.iql_head.forward_ref(agent.trunk.output("online").copy_to_host(), params)
    np.testing.assert_allclose(v, v_ref, rtol=1e-4, atol=1e-4)
    stats = agent.read_stats(s)
    assert stats["iql_loss"] == np.float32(agent.iql_loss.loss.copy_to_host()[0]) and stats["iql_loss"] > 0
    assert stats["iql_v_mean"] == pytest.approx(float(v.astype(np.float64).mean()), rel=1e-4, abs=1e-6)


def test_graph_replay_equals_eager_bitwise(rng):
    eager, _, _ = check_graph_replay_equals_eager(_agent(), rng, _snapshot)
    assert np.isfinite(eager["iql_loss"][0]) and eager["iql_loss"][0] > 0


def test_two_runs_bitwise_identical(rng):
    check_two_runs_bitwise_identical(rng, lambda: _agent(seed=3), _snapshot)
