"""Sequence replay (numbarl/rl/sequence.py): the K rows up to a sampled transition, from the ring,
masked at episode starts and at rows the ring no longer (or not yet) holds; hand-computed cases and
the numpy model on a wrapped ring with dones."""

import numpy as np
import pytest

from numbarl.cuda.runtime import cuda, stream
from numbarl.rl.replay import Replay
from numbarl.rl.sequence import gather_sequences, sequence_gather_ref

_cuda = cuda()


def _fill(buf, obs, done, s):
    """Write T steps: obs [T, N, D], done [T, N]."""
    N = obs.shape[1]
    for t in range(obs.shape[0]):
        buf.write(_cuda.to_device(obs[t]), _cuda.to_device(np.zeros((N, 1), np.int32)),
                  _cuda.to_device(np.zeros(N, np.float32)), _cuda.to_device(done[t]), s)


def _gather(buf, index, K, s):
    B = len(index)
    out = _cuda.to_device(np.full((B, K, buf.state_dim), np.nan, np.float32))
    valid = _cuda.to_device(np.full((B, K), 7, np.uint8))
    gather_sequences(buf, _cuda.to_device(np.asarray(index, np.int64)), out, valid, s)
    return out.copy_to_host(), valid.copy_to_host()


def test_hand_computed_episode_start_ring_start_and_empty_rows():
    """One env, 6 slots, 4 writes (times 0..3), done at time 1; K = 3.
    τ = 3: rows 1, 2, 3 → time 1 ended an episode, so only 2, 3 are valid.
    τ = 1: rows −1, 0, 1 → −1 was never written: 0, 1 valid. Empty row (−1): nothing valid."""
    s = stream()
    buf = Replay(capacity=6, n_envs=1, state_dim=2, n_branches=1, batch_size=4, n_step=1, seed=0).allocate()
    obs = np.array([[[t, 10 + t]] for t in range(4)], np.float32)
    done = np.array([[0], [1], [0], [0]], np.uint8)
    _fill(buf, obs, done, s)
    out, valid = _gather(buf, [3, 1, -1], 3, s)
    np.testing.assert_array_equal(valid, [[0, 1, 1], [0, 1, 1], [0, 0, 0]])
    np.testing.assert_array_equal(out[0], [[0, 0], [2, 12], [3, 13]])
    np.testing.assert_array_equal(out[1], [[0, 0], [0, 10], [1, 11]])
    assert (out[2] == 0).all()


def test_overwritten_rows_are_invalid_and_the_model_matches_on_a_wrapped_ring(rng):
    """3 envs, 5 slots, 13 writes (the ring holds times 8..12), random dones; every slot × env
    as a batch row, K = 4 (reaches past the oldest stored time) against the numpy model."""
    s = stream()
    N, D, T, K = 3, 2, 13, 4
    buf = Replay(capacity=15, n_envs=N, state_dim=D, n_branches=1, batch_size=4, n_step=1, seed=0).allocate()
    obs = rng.standard_normal((T, N, D)).astype(np.float32)
    done = (rng.uniform(size=(T, N)) < 0.25).astype(np.uint8)
    _fill(buf, obs, done, s)
    index = np.arange(5 * N)
    out, valid = _gather(buf, index, K, s)
    ring_obs, ring_done = buf.store["obs"].copy_to_host(), buf.store["done"].copy_to_host()
    want, want_valid = sequence_gather_ref(ring_obs, ring_done, T, index, K)
    np.testing.assert_array_equal(valid, want_valid)
    np.testing.assert_array_equal(out, want)
    # the oldest stored time (8) has only itself: slot 8 % 5 = 3
    assert (valid[3 * N:4 * N, :K - 1] == 0).all() and (valid[:, K - 1] == 1).all()
    # a row the model calls valid is the obs written at that time
    tau = {t % 5: t for t in range(8, 13)}
    for b, k0 in enumerate(index):
        slot, e = divmod(int(k0), N)
        for j in np.flatnonzero(valid[b]):
            np.testing.assert_array_equal(out[b, j], obs[tau[slot] - (K - 1 - j), e])


def test_bad_shapes_name_the_argument():
    s = stream()
    buf = Replay(capacity=6, n_envs=1, state_dim=2, n_branches=1, batch_size=4, n_step=1, seed=0).allocate()
    index = _cuda.to_device(np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="out must be float32"):
        gather_sequences(buf, index, _cuda.device_array((2, 3, 5), np.float32), _cuda.device_array((2, 3), np.uint8), s)
    with pytest.raises(ValueError, match="K = 7 must be in"):
        gather_sequences(buf, index, _cuda.device_array((2, 7, 2), np.float32), _cuda.device_array((2, 7), np.uint8), s)
