"""GPU checks of the recursive-confidence head (agent.confidence_weight): the cross-entropy and the head against
their float64 references at a real size, graph replay == eager bitwise and two runs bitwise identical for the
agent's train steps with the head on (an aux step, a step without it, an aux step), alone and with IQN + IQL
(three auxiliary heads adding into one dh).

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_confidence.py -m gpu -q`
"""

from dataclasses import replace

import numpy as np
import pytest
from agent_helpers import assert_bitwise as _assert_bitwise
from agent_helpers import aux_steps as _steps
from agent_helpers import fill_replay as _fill

from numbarl.config import AgentConfig
from numbarl.cuda import graph as cuda_graph
from numbarl.cuda.runtime import stream
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.losses.confidence import confidence_ref

pytestmark = pytest.mark.gpu

SIZES = (3, 3, 4, 4)
STATE_DIM, N_ENVS = 64, 64
CFG = AgentConfig(trunk=(512, 512), n_atoms=51, batch_size=4096, replay_capacity=64 * N_ENVS, n_step=3, gamma=0.99,
                  target_update="polyak", confidence_weight=0.5, aux_frequency=2, weight_decay=0.01)
ALL_HEADS = replace(CFG, iqn=True, iqn_quantiles=8, iqn_embed=16, iql=True, iql_hidden=64)


def _agent(seed=1, cfg=CFG):
    return DQNAgent(cfg, STATE_DIM, SIZES, N_ENVS, seed=seed)


def _snapshot(agent, s):
    out = dict(agent.state_arrays())
    out["confidence_loss"] = agent.conf_loss.loss.copy_to_host(stream=s)
    out["confidence_z"] = agent.conf_head.output("online").copy_to_host(stream=s)
    out["confidence_y"] = agent.conf_loss.target.copy_to_host(stream=s)
    out.update({f"grads/{k}": v for k, v in agent.store.to_host("grads").items()})
    s.synchronize()
    return out


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
    agent = _agent(cfg=cfg)
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
    assert np.isfinite(eager["confidence_loss"][0]) and eager["confidence_loss"][0] > 0


@pytest.mark.parametrize("cfg", [CFG, ALL_HEADS], ids=["confidence", "with_iqn_iql"])
def test_two_runs_bitwise_identical(rng, cfg):
    seed = int(rng.integers(2**31))
    snaps = []
    for _ in range(2):
        agent = _agent(seed=3, cfg=cfg)
        _fill(agent, np.random.default_rng(seed))
        s = stream()
        _steps(agent, s)
        snaps.append(_snapshot(agent, s))
    _assert_bitwise(*snaps)
