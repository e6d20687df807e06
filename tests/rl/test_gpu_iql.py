"""GPU checks of the IQL value head (agent.iql): the expectile loss and the head against their float64
references at a real size, graph replay == eager bitwise and two runs bitwise identical for the agent's
train steps with IQL on (an aux step, a step without it, an aux step).

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_iql.py -m gpu -q`
"""

import numpy as np
import pytest
from agent_helpers import assert_bitwise as _assert_bitwise
from agent_helpers import aux_steps as _steps
from agent_helpers import fill_replay as _fill

from numbarl.config import AgentConfig
from numbarl.cuda import graph as cuda_graph
from numbarl.cuda.runtime import stream
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.losses.expectile import expectile_ref

pytestmark = pytest.mark.gpu

SIZES = (3, 3, 4, 4)
STATE_DIM, N_ENVS = 64, 64
CFG = AgentConfig(trunk=(512, 512), n_atoms=51, batch_size=4096, replay_capacity=64 * N_ENVS, n_step=3, gamma=0.99,
                  target_update="polyak", iql=True, iql_hidden=256, iql_expectile=0.7, aux_frequency=2,
                  weight_decay=0.01)


def _agent(seed=1):
    return DQNAgent(CFG, STATE_DIM, SIZES, N_ENVS, seed=seed)


def _snapshot(agent, s):
    out = dict(agent.state_arrays())
    out["iql_loss"] = agent.iql_loss.loss.copy_to_host(stream=s)
    out["iql_v"] = agent.iql_head.output("online").copy_to_host(stream=s)
    out.update({f"grads/{k}": v for k, v in agent.store.to_host("grads").items()})
    s.synchronize()
    return out


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
    agent = _agent()
    _fill(agent, rng)
    s = stream()
    start = agent.state_arrays()
    _steps(agent, s)
    eager = _snapshot(agent, s)
    graphs = {aux: cuda_graph.capture(lambda st, a=aux: agent.train_step(st, aux=a), stream=s, warmup=False)
              for aux in (True, False)}
    agent.load_state(start)
    _steps(agent, s, graphs)
    _assert_bitwise(eager, _snapshot(agent, s))
    assert np.isfinite(eager["iql_loss"][0]) and eager["iql_loss"][0] > 0


def test_two_runs_bitwise_identical(rng):
    seed = int(rng.integers(2**31))
    snaps = []
    for _ in range(2):
        agent = _agent(seed=3)
        _fill(agent, np.random.default_rng(seed))
        s = stream()
        _steps(agent, s)
        snaps.append(_snapshot(agent, s))
    _assert_bitwise(*snaps)
