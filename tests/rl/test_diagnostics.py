"""The c51 agent's log-interval diagnostics against numpy: atom utilization (perplexity of the
batch-mean projected target over the atoms), the behaviour policy's normalized entropy per branch,
the mean preference; and the diagnostics run in a training run's log records."""

import math

import numpy as np

from numbarl.cuda.runtime import cuda, stream
from numbarl.rl.agents.dqn import MAX_BRANCH_ACTIONS, action_entropy_kernel, atom_utilization_kernel

_cuda = cuda()


def test_atom_utilization_is_the_perplexity_over_the_atoms():
    # five of 51 atoms carry the mass evenly: exp(H) = 5
    sums = np.zeros(51, np.float32)
    sums[[3, 10, 20, 30, 40]] = 8.0
    stats = _cuda.to_device(np.zeros(4, np.float32))
    atom_utilization_kernel[1, 1, stream()](_cuda.to_device(sums), np.float64(40.0), stats, np.int64(2))
    assert math.isclose(stats.copy_to_host()[2], 5 / 51, rel_tol=1e-6)
    uniform = np.full(7, 3.0, np.float32)
    atom_utilization_kernel[1, 1, stream()](_cuda.to_device(uniform), np.float64(21.0), stats, np.int64(1))
    assert math.isclose(stats.copy_to_host()[1], 1.0, rel_tol=1e-6)


def test_action_entropy_per_branch(rng):
    n_slots, n_envs, sizes = 3, 40, (3, 2, 4, 4)
    actions = np.zeros((n_slots, n_envs, 4), np.int32)
    for b, n in enumerate(sizes):
        actions[:, :, b] = rng.integers(0, n, size=(n_slots, n_envs))
    actions[1, :, 1] = 1  # the latest slot's size branch: one action only
    count = np.array([5], np.int64)  # 5 writes: the latest is slot (5 - 1) % 3 = 1
    stats = _cuda.to_device(np.zeros(8, np.float32))
    action_entropy_kernel[4, MAX_BRANCH_ACTIONS, stream()](_cuda.to_device(actions), _cuda.to_device(count),
                                                           _cuda.to_device(np.asarray(sizes, np.int32)), stats, np.int64(3))
    got = stats.copy_to_host()
    for b, n in enumerate(sizes):
        p = np.bincount(actions[1, :, b], minlength=n) / n_envs
        p = p[p > 0]
        expected = float(-(p * np.log(p)).sum() / math.log(n))
        assert math.isclose(got[3 + b], expected, rel_tol=1e-5, abs_tol=1e-7), (b, got[3 + b], expected)
    assert got[4] == 0.0  # one action: no entropy
