"""Regime dropout (numbarl/rl/nets/regime_dropout.py) on the simulator: the kernel's masks and scales equal
the reference's bit for bit (the same counter RNG), the rate follows the regime column, E[s] = 1, a new
train step draws new masks and the same step the same; in the agent the heads read h ⊙ s and the trunk's
gradients are the reference's with dh ⊙ s."""

import numpy as np
import pytest

from numbarl.cuda.runtime import cuda, stream
from numbarl.cuda.testing import assert_close
from numbarl.rl.nets.regime_dropout import RegimeDropout, drop_rate_ref, scale_ref

_cuda = cuda()


def test_rate_and_scale_by_hand():
    np.testing.assert_allclose(drop_rate_ref([-1.0, 0.0, 0.5, 1.0, 3.0], 0.05, 0.3), [0.05, 0.05, 0.175, 0.3, 0.3],
                               rtol=1e-6)
    s = scale_ref(np.array([0.0, 1.0]), 4000, 0.05, 0.3, seed=7, counter=3)
    assert set(np.unique(s[0])) == {0.0, np.float32(1 / 0.95)} and set(np.unique(s[1])) == {0.0, np.float32(1 / 0.7)}
    for row, p in ((0, 0.05), (1, 0.3)):  # the dropped share and E[s] = 1, within 4 standard errors
        se = np.sqrt(p * (1 - p) / 4000)
        assert abs((s[row] == 0).mean() - p) < 4 * se
        assert abs(s[row].mean() - 1.0) < 4 * se / (1 - p)


def test_kernel_equals_reference_bitwise(rng):
    B, H, col = 5, 7, 2
    layer = RegimeDropout(B, H, col, 0.1, 0.6, seed=11)
    h = rng.standard_normal((B, H)).astype(np.float32)
    obs = rng.uniform(-0.5, 1.5, (B, 4)).astype(np.float32)
    s = stream()
    outs = []
    for step in (0, 0, 1):
        counter = _cuda.to_device(np.array([step], np.int64))
        out = layer.forward(_cuda.to_device(h), _cuda.to_device(obs), counter, s).copy_to_host()
        scale = layer.arena["scale"].copy_to_host()
        ref = scale_ref(obs[:, col], H, 0.1, 0.6, seed=11, counter=step)
        assert np.array_equal(scale, ref)
        assert np.array_equal(out, h * ref)
        assert np.array_equal(layer.dropped.copy_to_host(), (ref == 0).astype(np.float32))
        outs.append(scale)
    assert np.array_equal(outs[0], outs[1]) and not np.array_equal(outs[0], outs[2])  # keyed by the step
    dh = rng.standard_normal((B, H)).astype(np.float32)
    d = _cuda.to_device(dh)
    layer.backward(d, s)
    assert np.array_equal(d.copy_to_host(), dh * outs[2])


def test_bad_rates_are_refused():
    with pytest.raises(ValueError, match="p_lo <= p_hi"):
        RegimeDropout(2, 3, 0, 0.5, 0.2, seed=0)


def test_agent_heads_read_the_dropped_features_and_the_trunk_gradient_is_masked(rng):
    from agent_helpers import fill_replay

    from numbarl.config import AgentConfig
    from numbarl.rl.agents.dqn import DQNAgent

    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=40, n_step=2, gamma=0.9,
                      target_update="polyak", regime_dropout=True, regime_dropout_col=1, regime_dropout_lo=0.2,
                      regime_dropout_hi=0.6)
    agent = DQNAgent(cfg, 5, (3, 3, 4, 4), 4, seed=1)
    fill_replay(agent, rng, count=13)
    s = stream()
    before = {k: np.asarray(v, np.float64) for k, v in agent.store.to_host("params").items()}
    agent.train_step(s)
    s.synchronize()
    h = agent.trunk.output("online").copy_to_host()
    scale = agent.rdrop.arena["scale"].copy_to_host()
    assert np.array_equal(scale, scale_ref(agent.replay.batch.obs.copy_to_host()[:, 1], 8, 0.2, 0.6, seed=1,
                                           counter=0))
    h_drop = agent.rdrop.output.copy_to_host()
    assert np.array_equal(h_drop, h * scale) and (scale == 0).any()
    # the C51 head read h' (its online logits are the reference's on h'), the trunk's gradient is dh ⊙ s
    out, cache = agent.head.forward_ref(h_drop, before)
    assert_close(agent.head.outputs("online").logits.copy_to_host(), out.logits, 1e-5, 1e-4)
    dh, _ = agent.head.backward_ref(agent.logits_grad_host(), cache, before)
    _, trunk_cache = agent.trunk.forward_ref(agent.replay.batch.obs.copy_to_host(), before)
    _, g_ref = agent.trunk.backward_ref(dh * scale, trunk_cache, before)
    grads = agent.store.to_host("grads")
    for name, want in g_ref.items():
        assert_close(grads[name], want, 1e-5, 1e-4)
    assert agent.read_stats(s)["regime_dropout_frac"] == pytest.approx(float((scale == 0).mean()), rel=1e-6)
    # the next step draws the next step's masks (the device step counter)
    agent.train_step(s)
    s.synchronize()
    assert np.array_equal(agent.rdrop.arena["scale"].copy_to_host(),
                          scale_ref(agent.replay.batch.obs.copy_to_host()[:, 1], 8, 0.2, 0.6, seed=1, counter=1))


def test_auxiliary_heads_read_the_dropped_features(rng):
    """An auxiliary head on the online pass (the predictive-coding predictor) reads h ⊙ s, not h."""
    from agent_helpers import fill_replay

    from numbarl.config import AgentConfig
    from numbarl.rl.agents.dqn import DQNAgent

    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=40, n_step=2, gamma=0.9,
                      target_update="polyak", regime_dropout=True, regime_dropout_col=1, regime_dropout_lo=0.3,
                      regime_dropout_hi=0.6, predictive_weight=0.5, aux_frequency=1)
    agent = DQNAgent(cfg, 5, (3, 3, 4, 4), 4, seed=2)
    fill_replay(agent, rng, count=13)
    s = stream()
    before = {k: np.asarray(v, np.float64) for k, v in agent.store.to_host("params").items()}
    agent.train_step(s)
    s.synchronize()
    h_drop = agent.rdrop.output.copy_to_host()
    assert not np.array_equal(h_drop, agent.trunk.output("online").copy_to_host())
    pred, _ = agent.pc_head.forward_ref(h_drop, before)
    assert_close(agent.pc_head.output("online").copy_to_host(), pred, 1e-5, 1e-4)
