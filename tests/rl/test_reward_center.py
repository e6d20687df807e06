"""Reward centering (agent.reward_centering, numbarl/rl/reward_center.py): the float64 reference by hand, the
device step against it and the PyTorch peer on a sampled replay batch (main window and an extra horizon), r̄ carried across steps and
through a checkpoint, and a constant reward centered to zero."""

import numpy as np
import pytest

from numbarl.cuda.registry import StatsLayout
from numbarl.cuda.runtime import cuda, stream
from numbarl.rl.replay import Replay
from numbarl.rl.reward_center import RewardCenter, center_ref

_cuda = cuda()


def test_reference_by_hand():
    """Rewards of the sampled rows 1, 3 and an empty row: m = (1 + 3 + 0)/3 = 4/3; β = 0.5 from r̄ = 0.2:
    r̄ = 0.2 + 0.5 (4/3 − 0.2) = 23/30; γ = 0.5: offset = 23/15; a window of discount γ² = 0.25 loses
    23/15 · 0.75 = 1.15, one of discount 1 (m = 0 steps) nothing."""
    store = np.array([[0.0, 1.0], [2.0, 3.0]], np.float32)  # [n_slots = 2, N = 2]: flat index slot·2 + env
    rbar, offset, (r1, r2) = center_ref(store, np.array([1, 3, -1]), 0.2, 0.5, 0.5,
                                        [(np.array([2.0, 0.0, 1.0]), np.array([0.25, 0.25, 0.25])),
                                         (np.array([2.0]), np.array([1.0]))])
    assert rbar == pytest.approx(23 / 30) and offset == pytest.approx(23 / 15)
    np.testing.assert_allclose(r1, [2.0 - 1.15, -1.15, 1.0 - 1.15])
    assert r2[0] == 2.0


def _replay(rng, horizons=()):
    rep = Replay(capacity=12 * 5, n_envs=5, state_dim=3, n_branches=2, batch_size=64, n_step=3, gamma=0.9, seed=4,
                 horizons=horizons).allocate()
    n_slots = rep.n_slots
    rep.store.load({"obs": rng.standard_normal((n_slots, 5, 3)).astype(np.float32),
                    "reward": (rng.standard_normal((n_slots, 5)) * 0.5 + 0.3).astype(np.float32),
                    "done": (rng.random((n_slots, 5)) < 0.1).astype(np.uint8),
                    "count": np.array([n_slots], np.int64)})
    return rep


def _center(rep, beta):
    layout = StatsLayout("test")
    slots = (layout.slot("reward_center"), layout.slot("reward_center_offset"))
    stats = _cuda.to_device(np.zeros(layout.size, np.float32))
    return RewardCenter(rep.batch_size, beta, *slots), stats, slots


@pytest.mark.parametrize("horizons", [(), (5,)])
def test_device_step_matches_the_reference_over_two_steps(rng, horizons):
    """Two train steps' samples: r̄ (float64 state) within float32 rounding of the reference's, every window's
    centered returns within 1e-6 of the float64 reference, the stats equal to r̄ and its offset."""
    rep = _replay(rng, horizons)
    center, stats, slots = _center(rep, 0.25)
    counter = _cuda.to_device(np.array([0], np.int64))
    s = stream()
    rbar = 0.0
    for step in range(2):
        counter.copy_to_device(np.array([step], np.int64))
        batch = rep.sample(counter, s)
        s.synchronize()
        windows = [(w.reward.copy_to_host(), w.discount.copy_to_host()) for w in [batch, *batch.horizons]]
        store, index = rep.store["reward"].copy_to_host(), batch.index.copy_to_host()
        try:  # the PyTorch peer (optional: torch is a test extra), from the same r̄ as the reference
            from numbarl.rl.torch_peer import reward_center_step

            peer = reward_center_step(store, index, rbar, 0.25, 0.9, windows)
        except ImportError:
            peer = None
        rbar, offset, want = center_ref(store, index, rbar, 0.25, 0.9, windows)
        center.apply(rep, stats, s)
        s.synchronize()
        state = center.arena["state"].copy_to_host()
        assert state[0] == pytest.approx(rbar, rel=1e-6) and state[1] == step + 1
        for i, (w, ref) in enumerate(zip([batch, *batch.horizons], want)):
            np.testing.assert_allclose(w.reward.copy_to_host(), ref, rtol=1e-6, atol=1e-6)
            if peer is not None:
                np.testing.assert_allclose(w.reward.copy_to_host(), peer[1][i], rtol=1e-6, atol=1e-6)
        if peer is not None:
            assert peer[0] == pytest.approx(rbar, rel=1e-12)
        host = stats.copy_to_host()
        assert host[slots[0]] == pytest.approx(rbar, rel=1e-6) and host[slots[1]] == pytest.approx(offset, rel=1e-6)
    assert abs(rbar) > 0.01  # the rewards' mean is 0.3: r̄ moved


def test_constant_reward_centers_to_zero_and_survives_a_checkpoint(rng):
    """Every reward 0.5: r̄ → 0.5 (β = 0.5: 1 − 2⁻³⁰ of the way after 30 steps) and every centered n-step return
    → 0, whatever its window length; a second RewardCenter loaded from the first's state continues from r̄."""
    rep = _replay(rng)
    rep.store.load({"reward": np.full((rep.n_slots, 5), 0.5, np.float32)})
    center, stats, _ = _center(rep, 0.5)
    counter = _cuda.to_device(np.array([0], np.int64))
    s = stream()
    for step in range(30):
        counter.copy_to_device(np.array([step], np.int64))
        rep.sample(counter, s)
        center.apply(rep, stats, s)
    s.synchronize()
    assert center.arena["state"].copy_to_host()[0] == pytest.approx(0.5, rel=1e-6)
    np.testing.assert_allclose(rep.batch.reward.copy_to_host(), 0.0, atol=1e-6)
    other, _, _ = _center(rep, 0.5)
    other.load_state(center.state_arrays())
    assert np.array_equal(other.arena["state"].copy_to_host(), center.arena["state"].copy_to_host())


def test_bad_rate_is_refused():
    from numbarl.config import AgentConfig, ConfigError

    with pytest.raises(ValueError, match="rate"):
        RewardCenter(8, 0.0, 0, 1)
    with pytest.raises(ConfigError, match="reward_centering"):
        AgentConfig(reward_centering=1.5).validate()
    with pytest.raises(ConfigError, match="agent.reward_centering"):
        AgentConfig(kind="ppo", reward_centering=0.01).validate()
    from numbarl.config import resolve

    with pytest.raises(ConfigError, match="undo the centering"):
        resolve(sets=["agent.reward_centering=0.01", "train.e1_q_reality=0.5"])
