"""Sequence replay on the GPU at the default preset's shapes: the gather against the numpy model
on a wrapped ring with dones (B = 16,384 rows, K = 8, 72 features), graph replay == eager."""

import numpy as np
import pytest

from numbarl.cuda import graph as cuda_graph
from numbarl.cuda.runtime import cuda, stream
from numbarl.rl.replay import Replay
from numbarl.rl.sequence import gather_sequences, sequence_gather_ref

pytestmark = pytest.mark.gpu
_cuda = cuda()


def test_real_size_matches_the_model_and_graph_equals_eager(rng):
    s = stream()
    N, D, T, K, B = 256, 72, 150, 8, 16384
    buf = Replay(capacity=N * 128, n_envs=N, state_dim=D, n_branches=1, batch_size=B, n_step=3, seed=2).allocate()
    obs = rng.standard_normal((T, N, D)).astype(np.float32)
    done = (rng.uniform(size=(T, N)) < 0.05).astype(np.uint8)
    for t in range(T):
        buf.write(_cuda.to_device(obs[t]), _cuda.to_device(np.zeros((N, 1), np.int32)),
                  _cuda.to_device(np.zeros(N, np.float32)), _cuda.to_device(done[t]), s)
    batch = buf.sample(_cuda.to_device(np.array([5], np.int64)), s)
    out = _cuda.device_array((B, K, D), np.float32)
    valid = _cuda.device_array((B, K), np.uint8)
    gather_sequences(buf, batch.index, out, valid, s)
    s.synchronize()
    eager, eager_valid = out.copy_to_host(), valid.copy_to_host()
    want, want_valid = sequence_gather_ref(buf.store["obs"].copy_to_host(), buf.store["done"].copy_to_host(), T,
                                           batch.index.copy_to_host(), K)
    np.testing.assert_array_equal(eager_valid, want_valid)
    np.testing.assert_array_equal(eager, want)
    assert 0 < want_valid.mean() < 1  # episode starts and the ring's start both cut sequences
    g = cuda_graph.capture(lambda st: gather_sequences(buf, batch.index, out, valid, st), s)
    out.copy_to_device(np.zeros((B, K, D), np.float32))
    g.replay(s)
    s.synchronize()
    np.testing.assert_array_equal(out.copy_to_host(), eager)
