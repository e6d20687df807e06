"""GPU checks of the risk-budget head (agent.risk_head_weight): the cross-entropy and the head against their
float64 references at a real size, graph replay == eager bitwise and two runs bitwise identical for the agent's
train steps with the head on (an aux step, a step without it, an aux step), alone and with the confidence head
(two auxiliary heads adding into one dh), and the collect step's size rewrite against its reference.

The replay's outcome labels are drawn at random (a third each of no label, loss and win) after the replay is
filled, so the loss has labelled rows of both kinds.

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_risk_head.py -m gpu -q`
"""

from dataclasses import replace

import numpy as np
import pytest
from agent_helpers import (
    GPU_N_ENVS,
    GPU_SIZES,
    GPU_STATE_DIM,
    agent_snapshot,
    assert_bitwise,
    check_graph_replay_equals_eager,
    check_two_runs_bitwise_identical,
    collect_graph_and_eager_runs,
    gpu_agent_config,
)
from agent_helpers import fill_replay as _fill

from numbarl.cuda.runtime import cuda, stream
from numbarl.env.params import BR_DIRECTION, BR_SIZE, DIR_LONG
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.feedback.hindsight import NO_LABEL
from numbarl.rl.losses.risk_head import risk_bce_ref
from numbarl.rl.nets.risk_head import size_actions_kernel, size_actions_ref

pytestmark = pytest.mark.gpu

SIZES, STATE_DIM, N_ENVS = GPU_SIZES, GPU_STATE_DIM, GPU_N_ENVS
CFG = gpu_agent_config(risk_head_weight=0.5, aux_frequency=2)
WITH_CONF = replace(CFG, confidence_weight=0.5)


def _agent(seed=1, cfg=CFG):
    return DQNAgent(cfg, STATE_DIM, SIZES, N_ENVS, seed=seed)


def _fill_with_labels(agent, rng, **kw):
    """The replay (agent_helpers.fill_replay), then random outcome labels beside it (from the same rng)."""
    _fill(agent, rng, **kw)
    label = rng.integers(-1, 2, (agent.replay.n_slots, agent.n_envs)).astype(np.int32)
    agent.risk_labels.arena.load({"label": label})
    return label


def _snapshot(agent, s):
    return agent_snapshot(agent, s, {"risk_loss": agent.risk_loss.loss, "risk_z": agent.risk_head.output("online"),
                                     "risk_labels": agent.risk_labels.arena["batch_label"],
                                     "risk_count": agent.risk_loss.count})


def test_loss_and_head_match_reference_at_real_size(rng):
    agent = _agent()
    label = _fill_with_labels(agent, rng, done_rate=0.05)
    s = stream()
    params = {k: np.asarray(v, np.float64) for k, v in agent.store.to_host("params").items()}
    agent.train_step(s, aux=True)
    s.synchronize()
    index = agent.replay.batch.index.copy_to_host()
    y = np.where(index >= 0, label.reshape(-1)[np.maximum(index, 0)], NO_LABEL)
    np.testing.assert_array_equal(agent.risk_labels.arena["batch_label"].copy_to_host(), y)
    z = agent.risk_head.output("online").copy_to_host()
    loss, per_sample, dz, rho, n = risk_bce_ref(z, y)
    assert 0 < n < CFG.batch_size
    assert float(agent.risk_loss.loss.copy_to_host()[0]) == pytest.approx(loss, rel=1e-5)
    assert float(agent.risk_loss.count.copy_to_host()[0]) == n
    np.testing.assert_allclose(agent.risk_loss.per_sample.copy_to_host(), per_sample, rtol=1e-4, atol=1e-6)
    got = agent.risk_loss.grad("logits").copy_to_host()  # weight · ∂L/∂z
    assert np.max(np.abs(got - CFG.risk_head_weight * dz)) <= 1e-5 * np.max(np.abs(CFG.risk_head_weight * dz))
    z_ref, _ = agent.risk_head.forward_ref(agent.trunk.output("online").copy_to_host(), params)
    np.testing.assert_allclose(z, z_ref, rtol=1e-4, atol=1e-4)
    stats = agent.read_stats(s)
    assert stats["risk_head_loss"] == np.float32(agent.risk_loss.loss.copy_to_host()[0]) and stats["risk_head_loss"] > 0
    assert stats["risk_head_rho_mean"] == pytest.approx(float(rho.mean()), rel=1e-4)
    assert stats["risk_head_labeled"] == n


@pytest.mark.parametrize("cfg", [CFG, WITH_CONF], ids=["risk_head", "with_confidence"])
def test_graph_replay_equals_eager_bitwise(rng, cfg):
    agent = _agent(cfg=cfg)
    label = rng.integers(-1, 2, (agent.replay.n_slots, agent.n_envs)).astype(np.int32)
    agent.risk_labels.arena.load({"label": label})  # fill_replay inside the check leaves the labels alone
    eager, _, _ = check_graph_replay_equals_eager(agent, rng, _snapshot)
    assert np.isfinite(eager["risk_loss"][0]) and eager["risk_loss"][0] > 0 and eager["risk_count"][0] > 0


@pytest.mark.parametrize("cfg", [CFG, WITH_CONF], ids=["risk_head", "with_confidence"])
def test_two_runs_bitwise_identical(rng, cfg):
    seed = int(rng.integers(2**31))

    def make():
        agent = _agent(seed=3, cfg=cfg)
        label = np.random.default_rng(seed).integers(-1, 2, (agent.replay.n_slots, agent.n_envs)).astype(np.int32)
        agent.risk_labels.arena.load({"label": label})
        return agent

    check_two_runs_bitwise_identical(rng, make, _snapshot)


def test_size_actions_kernel_matches_reference_at_real_size(rng):
    """The collect kernel on 300 envs (three blocks of 128, the last partial), half flat, against its reference
    (ρ from the kernel itself: the snap is compared exactly), with a base win rate of 0.4."""
    n = 300
    sizes = np.array([1.0, 2.0, 4.0], np.float32)
    z = (rng.standard_normal((n, 1)) * 2).astype(np.float32)
    obs = rng.standard_normal((n, 4)).astype(np.float32)
    obs[rng.random(n) < 0.5, 2] = 0.0
    actions = np.stack([rng.integers(0, b, n) for b in (3, 3, 4, 4)], 1).astype(np.int32)
    actions[::7, BR_DIRECTION] = DIR_LONG
    actions[::5, BR_SIZE] = 2
    dev = cuda().to_device
    d_actions, rho, resized = dev(actions), dev(np.zeros(n, np.float32)), dev(np.zeros(n, np.float32))
    s = stream()
    base = np.array([0.4, 1.0], np.float32)
    size_actions_kernel[3, 128, s](dev(z), dev(obs), np.int64(2), dev(sizes), d_actions, dev(np.zeros(3, np.float32)),
                                   rho, resized, dev(base))
    s.synchronize()
    rho_h = rho.copy_to_host()
    np.testing.assert_allclose(rho_h, 1.0 / (1.0 + np.exp(-z[:, 0].astype(np.float64))), rtol=1e-6, atol=1e-7)
    want, want_resized = size_actions_ref(actions, obs, rho_h, sizes, 2, base=base)
    np.testing.assert_array_equal(d_actions.copy_to_host(), want)
    np.testing.assert_array_equal(resized.copy_to_host(), want_resized.astype(np.float32))
    assert want_resized.any()


def test_collect_step_with_the_sizing_graph_equals_eager_bitwise():
    """The collect step with the head on (acting pass, the head, the size rewrite, the outcome labels) as a
    captured graph against eager steps: replay store, labels and env state bit for bit; a base win rate of
    0.5 so that entries the head rates low are resized."""
    def outputs(agent, env):
        out = {f"risk/{k}": v for k, v in agent.risk_labels.arena.to_host().items()}
        out.update({f"sizer/{k}": v for k, v in agent.risk_sizer.dev.to_host().items()})
        return out

    def base_rate(agent):
        agent.risk_loss.arena.load({"base_rate": np.array([0.5, 1.0], np.float32)})

    runs = collect_graph_and_eager_runs(CFG, N_ENVS, outputs, steps=12, setup=base_rate, epsilon=(1.0, 1.0, 10))
    assert_bitwise(*runs)
    assert (runs[0]["risk/label"] >= 0).any()  # trades closed and labelled their entry rows
