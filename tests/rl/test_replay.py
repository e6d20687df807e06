"""Replay buffer: device (simulator) vs the host model, hand-computed n-step cases, edge cases."""

import numpy as np
import pytest

from numbarl.cuda.runtime import cuda, stream
from numbarl.rl.replay import Replay, ReplayRef, nstep_ref

_cuda = cuda()


def _to_dev(x):
    return _cuda.to_device(np.ascontiguousarray(x), stream=stream())


def _batch_host(batch) -> dict:
    s = stream()
    out = {k: getattr(batch, k).copy_to_host(stream=s) for k in
           ("obs", "action", "reward", "done", "discount", "next_obs", "weight", "index", "next_index")}
    if batch.next_mask is not None:
        out["next_mask"] = batch.next_mask.copy_to_host(stream=s)
    s.synchronize()
    return out


def _compare(dev: dict, ref: dict):
    for k in ("action", "index", "next_index"):
        np.testing.assert_array_equal(dev[k], ref[k], err_msg=k)
    for k in ("obs", "next_obs", "done", "weight"):
        np.testing.assert_array_equal(dev[k], ref[k].astype(np.float32), err_msg=k)
    for k in ("reward", "discount"):
        np.testing.assert_allclose(dev[k], ref[k], rtol=1e-6, atol=1e-6, err_msg=k)
    assert ("next_mask" in dev) == ("next_mask" in ref)
    if "next_mask" in ref:
        np.testing.assert_array_equal(dev["next_mask"], ref["next_mask"], err_msg="next_mask")


def _write_both(buf, ref, rng, weights):
    N, D, nb = buf.n_envs, buf.state_dim, buf.n_branches
    obs = rng.standard_normal((N, D)).astype(np.float32)
    action = rng.integers(0, 5, size=(N, nb)).astype(np.int32)
    reward = rng.standard_normal(N).astype(np.float32)
    done = (rng.random(N) < 0.25).astype(np.uint8)
    w = rng.random(N).astype(np.float32) if weights else None
    # a random env mask (the replay stores whatever the env published)
    mask = (rng.random((N, nb, buf.max_actions)) < 0.7).astype(np.uint8) if buf.max_actions else None
    buf.write(_to_dev(obs), _to_dev(action), _to_dev(reward), _to_dev(done), stream(),
              weight=None if w is None else _to_dev(w), mask=None if mask is None else _to_dev(mask))
    ref.write(obs, action, reward, done, w, mask)


# ---------------------------------------------------------------------------------------------
# reference n-step math, by hand
# ---------------------------------------------------------------------------------------------
def test_nstep_ref_hand_computed():
    # docstring example: γ = 0.5, n = 3, rewards 1, 2, 4, done on the second step
    assert nstep_ref([1, 2, 4], [0, 1, 0], 0.5, 3) == (2.0, 1, 2, 0.25)
    # no done: 1 + 0.5*2 + 0.25*4 = 3, discount γ^3
    assert nstep_ref([1, 2, 4], [0, 0, 0], 0.5, 3) == (3.0, 0, 3, 0.125)
    # done on the first step: only r_τ
    assert nstep_ref([1, 2, 4], [1, 0, 1], 0.5, 3) == (1.0, 1, 1, 0.5)
    # done on the last step of the window
    assert nstep_ref([1, 2, 4], [0, 0, 1], 0.5, 3) == (3.0, 1, 3, 0.125)


# ---------------------------------------------------------------------------------------------
# device vs hand-computed values
# ---------------------------------------------------------------------------------------------
def test_device_nstep_hand_computed_done_in_window():
    """One env, γ = 0.5, n = 3; rewards 1, 2, 4, 8, 16 with done on step 1 (0-based).

    Valid times after 5 writes: τ ∈ [0, 1]. τ=0: m=2, R=1+0.5·2=2, done. τ=1: m=1, R=2, done.
    """
    buf = Replay(capacity=8, n_envs=1, state_dim=2, n_branches=1, batch_size=64, n_step=3, gamma=0.5, seed=11).allocate()
    s = stream()
    rewards = [1.0, 2.0, 4.0, 8.0, 16.0]
    dones = [0, 1, 0, 0, 0]
    for t in range(5):
        buf.write(_to_dev(np.array([[t, 10 + t]], np.float32)), _to_dev(np.array([[t]], np.int32)),
                  _to_dev(np.array([rewards[t]], np.float32)), _to_dev(np.array([dones[t]], np.uint8)), s)
    batch = _batch_host(buf.sample(_to_dev(np.array([3], np.int64)), s))
    expected = {0: (2.0, 1.0, 0.25, 2), 1: (2.0, 1.0, 0.5, 2)}  # τ: (R, done, discount, next row)
    assert set(batch["index"].tolist()) == {0, 1}  # 64 draws over 2 valid times: both appear
    for b in range(64):
        tau = int(batch["index"][b])
        R, d, disc, nxt = expected[tau]
        assert batch["reward"][b] == R and batch["done"][b] == d and batch["discount"][b] == disc
        assert batch["next_index"][b] == nxt
        np.testing.assert_array_equal(batch["obs"][b], [tau, 10 + tau])
        np.testing.assert_array_equal(batch["next_obs"][b], [nxt, 10 + nxt])
        assert batch["action"][b, 0] == tau and batch["weight"][b] == 1.0


def test_device_nstep_no_done_full_window():
    """One env, γ = 0.9, n = 2, no done: R = r_τ + 0.9 r_{τ+1}, discount 0.81, next = τ+2."""
    buf = Replay(capacity=4, n_envs=1, state_dim=1, n_branches=2, batch_size=16, n_step=2, gamma=0.9, seed=5).allocate()
    s = stream()
    for t in range(6):  # wraps: slots hold times 2..5, valid τ ∈ {2, 3}
        buf.write(_to_dev(np.array([[t]], np.float32)), _to_dev(np.array([[t, -t]], np.int32)),
                  _to_dev(np.array([float(t)], np.float32)), _to_dev(np.array([0], np.uint8)), s)
    assert buf.written() == 6
    batch = _batch_host(buf.sample(_to_dev(np.array([0], np.int64)), s))
    for b in range(16):
        tau = int(batch["obs"][b, 0])
        assert tau in (2, 3)
        assert batch["index"][b] == tau % 4 and batch["next_index"][b] == (tau + 2) % 4
        np.testing.assert_allclose(batch["reward"][b], tau + 0.9 * (tau + 1), rtol=1e-6)
        np.testing.assert_allclose(batch["discount"][b], 0.81, rtol=1e-6)
        assert batch["done"][b] == 0.0 and batch["next_obs"][b, 0] == tau + 2
        np.testing.assert_array_equal(batch["action"][b], [tau, -tau])


def test_empty_until_min_writes(rng):
    buf = Replay(capacity=12, n_envs=3, state_dim=2, n_branches=1, batch_size=5, n_step=2, gamma=0.9, seed=1).allocate()
    ref = ReplayRef(buf.n_slots, 3, 2, 1, 2, 0.9, 1)
    ctr = _to_dev(np.array([0], np.int64))
    for _ in range(buf.min_writes - 1):
        _write_both(buf, ref, rng, weights=False)
        dev = _batch_host(buf.sample(ctr, stream()))
        assert (dev["index"] == -1).all() and (dev["weight"] == 0).all() and (dev["discount"] == 0).all()
        assert (dev["obs"] == 0).all() and (dev["done"] == 1).all()
        _compare(dev, ref.sample(5, 0))
    _write_both(buf, ref, rng, weights=False)
    dev = _batch_host(buf.sample(ctr, stream()))
    assert (dev["index"] >= 0).all() and (dev["index"] < 3).all()  # only time 0 is complete
    _compare(dev, ref.sample(5, 0))


# ---------------------------------------------------------------------------------------------
# device == host model over many wraps
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_step,weights,max_actions", [(3, True, 3), (1, False, None)])
def test_device_matches_reference_over_wraps(rng, n_step, weights, max_actions):
    N, D, nb, B = 3, 5, 2, 7  # with masks: 2 x 3 mask entries per row > D, the kernels loop
    buf = Replay(capacity=17, n_envs=N, state_dim=D, n_branches=nb, batch_size=B, n_step=n_step,
                 gamma=0.93, seed=int(rng.integers(1 << 31)), weights=weights, max_actions=max_actions).allocate()
    assert buf.n_slots == 5 and buf.capacity == 15
    ref = ReplayRef(buf.n_slots, N, D, nb, n_step, 0.93, buf.seed)
    ctr_host = int(rng.integers(0, 1000))
    ctr = _to_dev(np.array([ctr_host], np.int64))
    for t in range(23):  # 23 writes into 5 slots: more than four wraps
        _write_both(buf, ref, rng, weights)
        if t % 4 == 3 or t == 22:
            ctr_host += 1
            ctr.copy_to_device(np.array([ctr_host], np.int64), stream=stream())
            _compare(_batch_host(buf.sample(ctr, stream())), ref.sample(B, ctr_host))
    assert buf.written() == 23
    host = buf.store.to_host()
    np.testing.assert_array_equal(host["obs"], ref.obs)
    np.testing.assert_array_equal(host["action"], ref.action)
    np.testing.assert_array_equal(host["reward"], ref.reward)
    np.testing.assert_array_equal(host["done"], ref.done)
    np.testing.assert_array_equal(host["weight"], ref.weight)
    if max_actions:
        np.testing.assert_array_equal(host["mask"], ref.mask)
        assert (ref.mask == 0).any() and (ref.mask == 1).any()


def test_sampling_is_uniform_over_valid_range_and_counter_keyed():
    """Draws cover exactly the valid (time, env) pairs; a new counter gives new draws."""
    N = 2
    buf = Replay(capacity=10, n_envs=N, state_dim=1, n_branches=1, batch_size=96, n_step=2, gamma=0.9, seed=3).allocate()
    s = stream()
    for t in range(8):  # slots hold times 3..7; valid τ ∈ [3, 5] → 6 (time, env) pairs
        buf.write(_to_dev(np.full((N, 1), t, np.float32)), _to_dev(np.zeros((N, 1), np.int32)),
                  _to_dev(np.zeros(N, np.float32)), _to_dev(np.zeros(N, np.uint8)), s)
    first = _batch_host(buf.sample(_to_dev(np.array([1], np.int64)), s))
    times = first["obs"][:, 0].astype(int)
    assert set(times.tolist()) == {3, 4, 5}
    assert set(first["index"].tolist()) == {(t % 5) * N + e for t in (3, 4, 5) for e in range(N)}
    second = _batch_host(buf.sample(_to_dev(np.array([2], np.int64)), s))
    assert not np.array_equal(first["index"], second["index"])
    again = _batch_host(buf.sample(_to_dev(np.array([1], np.int64)), s))
    np.testing.assert_array_equal(first["index"], again["index"])


def test_history_skips_the_oldest_times_once_the_ring_wrapped(rng):
    """set_history(2): before the ring wraps every valid time is drawn; after it the two oldest are not
    (slots hold times 4..8 of 9 writes into 5 slots, n = 1: τ ∈ [4 + 2, 7]); the host model agrees."""
    N = 2
    buf = Replay(capacity=10, n_envs=N, state_dim=1, n_branches=1, batch_size=96, n_step=1, gamma=0.9, seed=5).allocate()
    buf.set_history(2)
    ref = ReplayRef(buf.n_slots, N, 1, 1, 1, 0.9, buf.seed, history=2)
    s = stream()
    for t in range(9):
        obs, act = np.full((N, 1), t, np.float32), np.zeros((N, 1), np.int32)
        rew, done = np.zeros(N, np.float32), np.zeros(N, np.uint8)
        buf.write(_to_dev(obs), _to_dev(act), _to_dev(rew), _to_dev(done), s)
        ref.write(obs, act, rew, done)
        if t == 4:  # 5 writes, not wrapped: τ ∈ [0, 3]
            early = _batch_host(buf.sample(_to_dev(np.array([1], np.int64)), s))
            assert set(early["obs"][:, 0].astype(int).tolist()) == {0, 1, 2, 3}
    late = _batch_host(buf.sample(_to_dev(np.array([2], np.int64)), s))
    assert set(late["obs"][:, 0].astype(int).tolist()) == {6, 7}
    _compare(late, ref.sample(96, 2))
    with pytest.raises(ValueError, match="cannot hold a 1-step window after 4 rows of history"):
        buf.set_history(4)


def test_reset_and_bad_arguments(rng):
    buf = Replay(capacity=9, n_envs=3, state_dim=2, n_branches=1, batch_size=4, n_step=1, gamma=0.5).allocate()
    ref = ReplayRef(buf.n_slots, 3, 2, 1, 1, 0.5, 0)
    for _ in range(3):
        _write_both(buf, ref, rng, weights=False)
    buf.reset(stream())
    assert buf.written() == 0
    assert (_batch_host(buf.sample(_to_dev(np.array([0], np.int64)), stream()))["index"] == -1).all()
    with pytest.raises(ValueError, match="time slots"):
        Replay(capacity=6, n_envs=3, state_dim=2, n_branches=1, batch_size=4, n_step=2)
    with pytest.raises(ValueError, match="expects obs"):
        buf.write(_to_dev(np.zeros((2, 2), np.float32)), _to_dev(np.zeros((3, 1), np.int32)),
                  _to_dev(np.zeros(3, np.float32)), _to_dev(np.zeros(3, np.uint8)), stream())
    with pytest.raises(ValueError, match="mask exactly when"):
        buf.write(_to_dev(np.zeros((3, 2), np.float32)), _to_dev(np.zeros((3, 1), np.int32)),
                  _to_dev(np.zeros(3, np.float32)), _to_dev(np.zeros(3, np.uint8)), stream(),
                  mask=_to_dev(np.ones((3, 1, 2), np.uint8)))
    with pytest.raises(ValueError, match="weights=False"):
        buf.write(_to_dev(np.zeros((3, 2), np.float32)), _to_dev(np.zeros((3, 1), np.int32)),
                  _to_dev(np.zeros(3, np.float32)), _to_dev(np.zeros(3, np.uint8)), stream(),
                  weight=_to_dev(np.ones(3, np.float32)))
