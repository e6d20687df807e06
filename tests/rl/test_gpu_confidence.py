"""GPU checks of the recursive-confidence head (agent.confidence_weight): the cross-entropy and the head against
their float64 references at a real size, graph replay == eager bitwise and two runs bitwise identical for the
agent's train steps with the head on (an aux step, a step without it, an aux step), alone and with IQN + IQL
(three auxiliary heads adding into one dh).

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_confidence.py -m gpu -q`
"""

from dataclasses import replace

import numpy as np
import pytest
from agent_helpers import GPU_N_ENVS, GPU_SIZES, GPU_STATE_DIM, agent_snapshot, check_graph_replay_equals_eager
from agent_helpers import check_two_runs_bitwise_identical, gpu_agent_config
from agent_helpers import fill_replay as _fill

from numbarl.cuda.runtime import stream
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.losses.confidence import confidence_ref

pytestmark = pytest.mark.gpu

SIZES, STATE_DIM, N_ENVS = GPU_SIZES, GPU_STATE_DIM, GPU_N_ENVS
CFG = gpu_agent_config(confidence_weight=0.5, aux_frequency=2)
ALL_HEADS = replace(CFG, iqn=True, iqn_quantiles=8, iqn_embed=16, iql=True, iql_hidden=64)


def _agent(seed=1, cfg=CFG):
    return DQNAgent(cfg, STATE_DIM, SIZES, N_ENVS, seed=seed)


def _snapshot(agent, s):
    return agent_snapshot(agent, s, {"confidence_loss": agent.conf_loss.loss,
                                     "confidence_z": agent.conf_head.output("online"),
                                     "confidence_y": agent.conf_loss.target})


def test_loss_and_head_match_reference_at_real_size(rng):
    agent = _agent()
    _fill(agent, rng, done_rate=0.05)
    s = stream()
    params = {k: np.asarray(v, np.float64) for k, v in agent.store.to_host("params").items()}
    target = {k: np.asarray(v, np.float64) for k, v in agent.store.to_host("target").items()}
    agent.train_step(s, aux=True)
    s.synchronize()
    batch = agent.replay.batch
    z = agent.conf_head.output("online").copy_to_host()
    z_next = agent.conf_head.output("target").copy_to_host()
    q = agent.head.outputs("online").q.copy_to_host()
    actions, rewards, dones = batch.action.copy_to_host(), batch.reward.copy_to_host(), batch.done.copy_to_host()
    loss, per_sample, dz, y, boot, c = confidence_ref(z, q, actions, rewards, dones, z_next, CFG.confidence_epsilon)
    assert float(agent.conf_loss.loss.copy_to_host()[0]) == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(agent.conf_loss.per_sample.copy_to_host(), per_sample, rtol=1e-4, atol=1e-6)
    got = agent.conf_loss.grad("logits").copy_to_host()  # weight · ∂L/∂z
    assert np.max(np.abs(got - CFG.confidence_weight * dz)) <= 1e-5 * np.max(np.abs(CFG.confidence_weight * dz))
    np.testing.assert_allclose(agent.conf_loss.target.copy_to_host(), y, rtol=1e-5, atol=1e-6)
    # the head's forward on the online trunk output (pre-update parameters), on the target trunk output with
    # target parameters: fp32 GEMMs vs float64
    z_ref, _ = agent.conf_head.forward_ref(agent.trunk.output("online").copy_to_host(), params)
    np.testing.assert_allclose(z, z_ref, rtol=1e-4, atol=1e-4)
    z_next_ref, _ = agent.conf_head.forward_ref(agent.trunk.output("target").copy_to_host(), target)
    np.testing.assert_allclose(z_next, z_next_ref, rtol=1e-4, atol=1e-4)
    stats = agent.read_stats(s)
    assert stats["confidence_loss"] == np.float32(agent.conf_loss.loss.copy_to_host()[0]) and stats["confidence_loss"] > 0
    assert stats["confidence_mean"] == pytest.approx(float(c.mean()), rel=1e-4)
    assert stats["confidence_boot_frac"] == pytest.approx(float(boot.mean()), abs=1e-6)
    assert 0 < boot.mean() < 1  # random returns and directions: both kinds of target at this size


@pytest.mark.parametrize("cfg", [CFG, ALL_HEADS], ids=["confidence", "with_iqn_iql"])
def test_graph_replay_equals_eager_bitwise(rng, cfg):
    eager, _, _ = check_graph_replay_equals_eager(_agent(cfg=cfg), rng, _snapshot)
    assert np.isfinite(eager["confidence_loss"][0]) and eager["confidence_loss"][0] > 0


@pytest.mark.parametrize("cfg", [CFG, ALL_HEADS], ids=["confidence", "with_iqn_iql"])
def test_two_runs_bitwise_identical(rng, cfg):
    check_two_runs_bitwise_identical(rng, lambda: _agent(seed=3, cfg=cfg), _snapshot)
