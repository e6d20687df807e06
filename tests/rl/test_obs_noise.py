"""Observation noise (agent.obs_noise, numbarl/rl/obs_noise.py): the kernel equals its reference bit for bit,
only the market columns of unmasked rows move, and in a train step the learner reads the perturbed batch while
the replay keeps the clean rows."""

import numpy as np
import pytest

from numbarl.cuda.runtime import cuda, stream
from numbarl.cuda.testing import assert_close
from numbarl.env.params import PORTFOLIO_FEATURES
from numbarl.rl.obs_noise import ObsNoise, apply_ref

N_PORT = len(PORTFOLIO_FEATURES)


def test_reference_by_hand():
    """σ·ε on the market columns of the kept rows only; the draws are N(0, 1) (mean ≈ 0, var ≈ 1 over 20,000
    fixed draws) and independent across lane ranges and steps."""
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    y, e = apply_ref(x, 2, 0.5, seed=3, lane0=0, counter=7, row_mask=np.array([[1, 0], [1, 1]]))
    assert np.array_equal(y[:, 2], x[:, 2])  # column 2 is not a market column
    assert np.array_equal(y[1], x[1]) and (e[1] == 0).all()  # row 1 = window 0, step 1: masked
    assert np.array_equal(y[[0, 2, 3], :2], (x[[0, 2, 3], :2] + e[[0, 2, 3]]).astype(np.float32))
    assert (e[[0, 2, 3]] != 0).all()
    _, big = apply_ref(np.zeros((10_000, 2), np.float32), 2, 1.0, seed=1, lane0=0, counter=0)
    assert abs(big.mean()) < 0.03 and abs(big.var() - 1.0) < 0.05
    _, other = apply_ref(np.zeros((10_000, 2), np.float32), 2, 1.0, seed=1, lane0=20_000, counter=0)
    _, later = apply_ref(np.zeros((10_000, 2), np.float32), 2, 1.0, seed=1, lane0=0, counter=1)
    assert abs(np.corrcoef(big.ravel(), other.ravel())[0, 1]) < 0.03
    assert abs(np.corrcoef(big.ravel(), later.ravel())[0, 1]) < 0.03


@pytest.mark.parametrize("masked", [False, True])
def test_kernel_equals_reference_bitwise(rng, masked):
    cu = cuda()
    rows, d, n_cols = 6, 5, 3  # 2 windows of 3 rows when masked
    x0 = rng.standard_normal((rows, d)).astype(np.float32)
    mask = np.array([[0, 1, 1], [1, 1, 1]], np.float32) if masked else None
    noise = ObsNoise(rows, n_cols, 0.3, seed=11, max_rows=rows)
    x = cu.to_device(x0)
    counter = cu.to_device(np.array([5], np.int64))
    s = stream()
    noise.apply(x, 0 if not masked else 2, counter, s, row_mask=None if mask is None else cu.to_device(mask))
    s.synchronize()
    want, e = apply_ref(x0, n_cols, 0.3, seed=11, lane0=(0 if not masked else 2) * rows * n_cols, counter=5,
                        row_mask=mask)
    assert np.array_equal(x.copy_to_host(), want)
    if not masked:
        assert np.array_equal(noise.sq.copy_to_host(), (e * e).ravel())


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="sigma"):
        ObsNoise(4, 3, 0.0, seed=0, max_rows=4)
    with pytest.raises(ValueError, match="market feature"):
        ObsNoise(4, 0, 0.1, seed=0, max_rows=4)
    from numbarl.config import AgentConfig, ConfigError

    with pytest.raises(ConfigError, match="obs_noise"):
        AgentConfig(obs_noise=-0.1).validate()


def test_agent_learns_from_the_perturbed_batch_and_the_replay_stays_clean(rng):
    from agent_helpers import fill_replay

    from numbarl.config import AgentConfig
    from numbarl.rl.agents.dqn import DQNAgent

    dim = N_PORT + 3  # 3 market features, then the portfolio's
    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=40, n_step=2, gamma=0.9,
                      target_update="polyak", obs_noise=0.2)
    agent = DQNAgent(cfg, dim, (3, 3, 4, 4), 4, seed=5)
    fill_replay(agent, rng, count=13)
    ring = agent.replay.store["obs"].copy_to_host().reshape(-1, dim)
    s = stream()
    params = {k: np.asarray(v, np.float64) for k, v in agent.store.to_host("params").items()}
    agent.train_step(s)
    s.synchronize()
    batch = agent.replay.batch
    index, next_index = batch.index.copy_to_host(), batch.next_index.copy_to_host()
    obs, next_obs = batch.obs.copy_to_host(), batch.next_obs.copy_to_host()
    want, e = apply_ref(ring[index], 3, 0.2, seed=5, lane0=0, counter=0)
    assert np.array_equal(obs, want)
    assert np.array_equal(obs[:, 3:], ring[index][:, 3:])  # the portfolio features are exact
    lanes = 4 * 3  # one tensor's lane range: batch x market columns
    assert np.array_equal(next_obs, apply_ref(ring[next_index], 3, 0.2, seed=5, lane0=lanes, counter=0)[0])
    assert np.array_equal(agent.replay.store["obs"].copy_to_host().reshape(-1, dim), ring)  # the replay is clean
    # the online pass read the perturbed obs
    h_ref, _ = agent.trunk.forward_ref(obs, params)
    assert_close(agent.trunk.output("online").copy_to_host(), h_ref, 1e-5, 1e-5)
    assert agent.read_stats(s)["obs_noise_var"] == pytest.approx(float(np.mean(e.astype(np.float64) ** 2)), rel=1e-5)
    agent.train_step(s)  # the next step draws new noise (the device step counter)
    s.synchronize()
    index = agent.replay.batch.index.copy_to_host()
    assert np.array_equal(agent.replay.batch.obs.copy_to_host(),
                          apply_ref(ring[index], 3, 0.2, seed=5, lane0=0, counter=1)[0])


def test_temporal_windows_are_perturbed_where_their_mask_is_set(rng):
    from agent_helpers import fill_replay

    from numbarl.config import AgentConfig
    from numbarl.rl.agents.dqn import DQNAgent

    dim, k = N_PORT + 2, 2
    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=40, n_step=2, gamma=0.9,
                      target_update="polyak", obs_noise=0.5, temporal="mamba", temporal_steps=k, temporal_heads=1)
    agent = DQNAgent(cfg, dim, (3, 3, 4, 4), 4, seed=6)
    fill_replay(agent, rng, done_rate=0.3, count=13)
    s = stream()
    agent.replay.sample(agent.optim.step_counter, s)
    agent.temporal.gather_batch(agent.replay, s)
    clean = {n: [a.copy_to_host() for a in agent.temporal.window_rows(n)] for n in ("obs", "next")}
    agent._perturb_batch(s)
    s.synchronize()
    lanes = 4 * k * 2  # batch x K rows x market columns
    n_masked = 0
    for i, name in enumerate(("obs", "next")):
        x0, mask = clean[name]
        want, _ = apply_ref(x0, 2, 0.5, seed=6, lane0=(100 + i) * lanes, counter=0, row_mask=mask)
        got = agent.temporal.window_rows(name)[0].copy_to_host()
        assert np.array_equal(got, want)
        assert np.array_equal(got[mask.reshape(-1) == 0], x0[mask.reshape(-1) == 0])
        n_masked += int((mask == 0).sum())
    assert n_masked > 0  # the windows crossed an episode start (done rate 0.3): masked rows were seen
