"""The value support fitted to the replay's n-step returns (agent.support = "fit", numbarl/rl/support.py):
the returns and the rule against numpy, the agent's fit on a scripted replay, and a train step after a
refit equal to one of an agent built with that support."""

import math
from dataclasses import replace

import numpy as np
import pytest

from numbarl.config import AgentConfig
from numbarl.cuda import graph as cuda_graph
from numbarl.cuda.runtime import stream
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.losses.c51 import make_support, support_scalars
from numbarl.rl.replay import nstep_ref
from numbarl.rl.support import QUANTILE, fit_support_range, horizon_factor, replay_nstep_returns

SIZES = (3, 3, 4, 4)
STATE_DIM, N_ENVS = 5, 4
CFG = AgentConfig(trunk=(8,), n_atoms=11, batch_size=8, replay_capacity=10 * N_ENVS, n_step=3, gamma=0.9,
                  support="fit", target_period=2)


def _loop_returns(reward, done, count, n, gamma):
    """Every valid window by the replay's own host model (nstep_ref), time-major like the fit."""
    n_slots, n_envs = reward.shape
    lo, valid = max(count - n_slots, 0), min(count, n_slots) - n
    out = []
    for tau in range(lo, lo + max(valid, 0)):
        for e in range(n_envs):
            rows = [(tau + k) % n_slots for k in range(n)]
            out.append(nstep_ref(reward[rows, e], done[rows, e], gamma, n)[0])
    return np.asarray(out)


@pytest.mark.parametrize("count", [2, 4, 7, 10, 23])  # empty, few, not full, exactly full, wrapped
def test_nstep_returns_match_the_replays_definition(rng, count):
    reward = rng.normal(0, 1, (10, 3)).astype(np.float32)
    done = (rng.random((10, 3)) < 0.25).astype(np.uint8)
    got = replay_nstep_returns(reward, done, count, 3, 0.9)
    np.testing.assert_allclose(got, _loop_returns(reward, done, count, 3, 0.9), rtol=1e-12, atol=1e-12)


def test_fit_rule_matches_numpy(rng):
    r = np.concatenate([rng.normal(0.0, 0.01, 5000), [0.4, -0.7]])
    a = max(abs(np.quantile(r, QUANTILE)), abs(np.quantile(r, 1 - QUANTILE)))
    fit = fit_support_range(r, 0.99, 3)
    assert fit["v"] == pytest.approx(a / math.sqrt(1 - 0.99 ** 6), rel=1e-12)  # the spread term wins
    assert horizon_factor(0.99, 3) == pytest.approx(4.13, abs=0.01)
    assert fit_support_range(r, 0.99, 3, factor=2.5)["v"] == pytest.approx(2.5 * a, rel=1e-12)
    drift = np.full(100, 0.02)  # a constant reward accumulates: |mean| / (1 - γ^n)
    assert fit_support_range(drift, 0.99, 3)["v"] == pytest.approx(0.02 / (1 - 0.99 ** 3), rel=1e-12)
    assert fit_support_range(np.zeros(50), 0.99, 3)["v"] is None  # nothing to fit: keep the support
    assert fit_support_range(np.zeros(0), 0.99, 3)["v"] is None
    with pytest.raises(ValueError, match="gamma < 1"):
        fit_support_range(r, 1.0, 3)


def _fill(agent, rng, count):
    """A scripted replay: random obs, valid actions, heavy-tailed rewards, some dones, every action allowed."""
    n_slots = agent.replay.n_slots
    actions = np.stack([rng.integers(0, n, (n_slots, N_ENVS)) for n in SIZES], -1).astype(np.int32)
    mask = np.zeros((n_slots, N_ENVS, len(SIZES), max(SIZES)), np.uint8)
    for k, n in enumerate(SIZES):
        mask[..., k, :n] = 1
    reward = (rng.standard_t(3, (n_slots, N_ENVS)) * 0.05).astype(np.float32)
    done = (rng.random((n_slots, N_ENVS)) < 0.2).astype(np.uint8)
    agent.replay.store.load({"obs": rng.normal(0, 1, (n_slots, N_ENVS, STATE_DIM)).astype(np.float32),
                             "action": actions, "reward": reward, "done": done,
                             "weight": np.ones((n_slots, N_ENVS), np.float32), "mask": mask,
                             "count": np.array([count], np.int64)})
    return reward, done


def test_agent_fit_support_on_a_scripted_replay(rng):
    agent = DQNAgent(CFG, STATE_DIM, SIZES, N_ENVS, seed=1)
    reward, done = _fill(agent, rng, count=13)
    s = stream()
    fit = agent.fit_support(s)
    r = _loop_returns(reward, done, 13, CFG.n_step, float(np.float32(CFG.gamma)))
    a = max(abs(np.quantile(r, QUANTILE)), abs(np.quantile(r, 1 - QUANTILE)))
    v = max(a * horizon_factor(np.float32(CFG.gamma), CFG.n_step),
            abs(r.mean()) / (1 - float(np.float32(CFG.gamma)) ** CFG.n_step))
    assert fit["v_max"] == pytest.approx(v, rel=1e-9) and fit["v_min"] == -fit["v_max"] and fit["n"] == r.size
    assert agent.support_range == (fit["v_min"], fit["v_max"])
    support = make_support(CFG.n_atoms, -fit["v_max"], fit["v_max"])
    assert np.array_equal(agent.head.support.copy_to_host(), support)
    assert np.array_equal(agent.loss.support.copy_to_host(), support)
    assert np.array_equal(agent.loss.arena["support_scalars"].copy_to_host(),
                          np.array(support_scalars(CFG.n_atoms, -fit["v_max"], fit["v_max"]), np.float32))
    agent.stats.record(s)
    stats = agent.stats_layout.read(agent.stats.read())
    assert stats["support_fits"] == 1 and stats["support_v_max"] == np.float32(fit["v_max"])
    # the checkpoint carries the fitted support; a fresh agent loading it uses it
    other = DQNAgent(CFG, STATE_DIM, SIZES, N_ENVS, seed=1)
    other.load_state(agent.state_arrays())
    assert other.support_range == agent.support_range
    assert np.array_equal(other.head.support.copy_to_host(), support)
    fixed = DQNAgent(replace(CFG, support="fixed"), STATE_DIM, SIZES, N_ENVS, seed=1)
    assert fixed.fit_support(s) is None and fixed.support_range == (CFG.v_min, CFG.v_max)


def test_a_captured_step_after_a_refit_equals_an_agent_built_with_that_support(rng):
    """The train step captured on the configured support, then refit between replays: its next replay
    computes the bits of an agent built with the fitted support from the same state (under the
    simulator a replay re-runs the step; on the GPU it relaunches the graph, which reads the support
    from device memory: test_c51_loss.py::test_the_loss_reads_its_support_from_device_memory_only)."""
    s = stream()
    a = DQNAgent(CFG, STATE_DIM, SIZES, N_ENVS, seed=1)
    _fill(a, rng, count=13)
    graph = cuda_graph.capture(a.train_step, s)  # its warm-up is train step 1, on ±10
    fit = a.fit_support(s)
    assert fit is not None and fit["v_max"] < 10.0
    state = {k: v for k, v in a.state_arrays().items() if k != "support/range"}
    graph.replay(s)  # train step 2 on the fitted support
    b = DQNAgent(replace(CFG, support="fixed", v_min=fit["v_min"], v_max=fit["v_max"]), STATE_DIM, SIZES, N_ENVS,
                 seed=1)
    b.load_state(state)
    assert b.support_range == (fit["v_min"], fit["v_max"])
    b.train_step(s)
    s.synchronize()
    got, want = a.state_arrays(), b.state_arrays()
    for role in ("params", "target", "adam_m", "adam_v"):
        names = [k for k in want if k.startswith(role + "/")]
        assert names
        for k in names:
            assert np.array_equal(got[k], want[k]), k
    assert np.array_equal(a.head.outputs("online").q.copy_to_host(), b.head.outputs("online").q.copy_to_host())
