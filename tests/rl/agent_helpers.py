"""Shared pieces of the tests of the C51 agent's auxiliary components (IQN, IQL, spectral
normalization), on the simulator and the GPU: a replay filled with random transitions, the aux /
plain / aux train-step sequence, and the bitwise comparison of two snapshots."""

import numpy as np


def fill_replay(agent, rng, done_rate: float = 0.05, count: int | None = None):
    """Every slot of the agent's replay written with random transitions of its own shapes (rewards
    N(0, 0.5²), dones with probability done_rate); count: the replay's write count (None: its slots)."""
    n_slots, n_envs, sizes = agent.replay.n_slots, agent.n_envs, agent.branch_sizes
    actions = np.stack([rng.integers(0, n, (n_slots, n_envs)) for n in sizes], -1).astype(np.int32)
    mask = np.zeros((n_slots, n_envs, len(sizes), max(sizes)), np.uint8)
    for k, n in enumerate(sizes):
        mask[..., k, :n] = 1
    agent.replay.store.load({"obs": rng.normal(0, 1, (n_slots, n_envs, agent.state_dim)).astype(np.float32),
                             "action": actions, "reward": (rng.standard_normal((n_slots, n_envs)) * 0.5).astype(np.float32),
                             "done": (rng.random((n_slots, n_envs)) < done_rate).astype(np.uint8),
                             "weight": np.ones((n_slots, n_envs), np.float32), "mask": mask,
                             "count": np.array([n_slots if count is None else count], np.int64)})


def aux_steps(agent, s, fns=None):
    """aux step, plain step, aux step (eagerly, or by the given graphs {aux: graph})."""
    for aux in (True, False, True):
        if fns is None:
            agent.train_step(s, aux=aux)
        else:
            fns[aux].replay(s)
    s.synchronize()


def assert_bitwise(a, b):
    assert set(a) == set(b)
    for k in a:
        assert np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes(), f"{k} differs"
