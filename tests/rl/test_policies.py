"""Exploration policies (numbarl/rl/policies.py) on the env's published masks: greedy against an
independent numpy argmax (lock, ties, padding, NaN), every exploratory draw reproduced from the
counter RNG, the device kernel against the CPU reference, and the draws' distribution."""

import numpy as np
import pytest

from numbarl.bench.env import synthetic_market
from numbarl.cuda import rng as crng
from numbarl.cuda.runtime import cuda, stream
from numbarl.env.device import DeviceEnv
from numbarl.env.params import DIR_FLAT, DIR_LONG, DIR_SHORT, EnvParams
from numbarl.env.reference import CpuEnv
from numbarl.rl import policies
from numbarl.rl.policies import (
    SLOT_EXPLORE,
    SLOT_RANDOM,
    epsilon_greedy,
    epsilon_greedy_ref,
    scheduled_epsilon,
    scheduled_epsilon_greedy,
    scheduled_epsilon_greedy_step,
)
from numbarl.rl.replay import Replay

_cuda = cuda()


def _greedy_numpy(q, position, branch_sizes, lock):
    """Greedy reference: first maximum over the allowed actions, NaN never wins."""
    n = q.shape[0]
    out = np.zeros((n, 4), np.int32)
    for i in range(n):
        for b, size in enumerate(branch_sizes):
            allowed = np.ones(size, bool)
            if b == 0 and lock and position[i] != 0:
                allowed[DIR_SHORT if position[i] > 0 else DIR_LONG] = False
            vals = np.where(allowed & ~np.isnan(q[i, b, :size]), q[i, b, :size], -np.inf)
            out[i, b] = int(np.argmax(vals)) if np.isfinite(vals).any() else int(np.flatnonzero(allowed)[0])
    return out


def _env_with_positions(data, params, position, seed=0):
    """A device env whose published mask is that of the given positions (and its seed/counter)."""
    env = DeviceEnv(data, params, len(position), seed=seed)
    env.reset()
    env.arena.load({"position": np.asarray(position, np.float32)})
    env.gather()
    return env


def _run(env, q, epsilon):
    """The policy on the device, on the env's mask; returns (actions, preference) on the host."""
    eps = _cuda.to_device(np.atleast_1d(np.asarray(epsilon, np.float32)))
    actions, preference = env.arena["actions"], env.arena["preference"]
    epsilon_greedy(_cuda.to_device(q), env.arena["mask"], eps, env.seed_dev, env.counter, actions, preference, stream())
    return actions.copy_to_host(), preference.copy_to_host()


def test_greedy_matches_numpy_with_lock_ties_nan_and_padding(rng):
    data = synthetic_market(30, 5, seed=int(rng.integers(1000)))
    params = EnvParams(sizes=(1, 2), targets=(0.0, 1.0, 2.0, 3.0, 4.0), stops=(0.0, 2.0, 4.0))
    position = np.array([0, 1, -1, 2, -2, 0, 1, -1, 0], np.float32)
    env = _env_with_positions(data, params, position)
    q = rng.standard_normal((len(position), 4, params.max_actions)).astype(np.float32)
    q[:, 1, 2:] = 1e9  # padding beyond the size branch must be ignored
    q[:, 3, 3:] = 1e9
    q[0, 2, :] = 0.25  # ties: first maximum
    q[1, 0, DIR_SHORT] = 100.0  # locked out for a long position
    q[2, 0, :] = np.nan  # no valid maximum: first allowed action
    q[3, 1, :2] = np.nan
    got, preference = _run(env, q, 0.0)
    np.testing.assert_array_equal(got, _greedy_numpy(q, position, params.branch_sizes, True))
    assert got[0, 2] == 0 and got[1, 0] != DIR_SHORT and got[2, 0] == DIR_SHORT
    np.testing.assert_array_equal(preference[3:], (q[3:, 0, DIR_LONG] - q[3:, 0, DIR_SHORT]).astype(np.float32))
    want, want_pref = epsilon_greedy_ref(q, env.arena["mask"].copy_to_host(), 0.0, 0, 0)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(preference[3:], want_pref[3:])


def test_exploration_draws_reproduce_from_the_counter_rng_and_respect_the_mask(rng):
    data = synthetic_market(30, 5, seed=int(rng.integers(1000)))
    params = EnvParams()
    n, seed, counter = 6, int(rng.integers(1 << 31)), 7
    position = np.array([1, -1, 0, 1, -1, 2], np.float32)
    env = _env_with_positions(data, params, position, seed)
    env.arena.load({"counter": np.array([counter], np.int64)})
    got, _ = _run(env, np.zeros((n, 4, params.max_actions), np.float32), 1.0)
    for i in range(n):
        for b, size in enumerate(params.branch_sizes):
            allowed = list(range(size))
            if b == 0 and position[i] != 0:
                allowed.remove(DIR_SHORT if position[i] > 0 else DIR_LONG)
            assert crng.uniform(np.uint64(seed), i, counter, SLOT_EXPLORE + b) < 1.0
            r = crng.randint(np.uint64(seed), i, counter, SLOT_RANDOM + b, len(allowed))
            assert got[i, b] == allowed[r]
    # the slot numbers recorded runs depend on (they were the env's before the policy moved here)
    assert (SLOT_EXPLORE, SLOT_RANDOM) == (0, 4)


def test_device_matches_reference_with_per_env_epsilon_past_one_block(rng):
    data = synthetic_market(30, 5, seed=int(rng.integers(1000)))
    params = EnvParams()
    m = policies.BLOCK + 3  # the guard of a partial last block
    position = rng.choice(np.array([-1.0, 0.0, 2.0], np.float32), m)
    env = _env_with_positions(data, params, position, seed=5)
    eps = rng.uniform(0, 1, m).astype(np.float32)
    q = rng.standard_normal((m, 4, params.max_actions)).astype(np.float32)
    got, preference = _run(env, q, eps)
    want, want_pref = epsilon_greedy_ref(q, env.arena["mask"].copy_to_host(), eps, 5, 0)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(preference, want_pref)
    assert (got != _greedy_numpy(q, position, params.branch_sizes, True)).any()  # some envs explored


@pytest.mark.parametrize("step", [0, 7, 40])
def test_scheduled_rate_in_every_thread_equals_the_explicit_rate(rng, step):
    """The collect step's ε-greedy computes its rate from the schedule inside the launch: the same
    actions and preference as epsilon_greedy at that rate (linear from 0.9 to 0.2 over 20 steps,
    then flat)."""
    data = synthetic_market(30, 5, seed=int(rng.integers(1000)))
    params = EnvParams()
    m = 37
    position = rng.choice(np.array([-1.0, 0.0, 2.0], np.float32), m)
    env = _env_with_positions(data, params, position, seed=9)
    q = rng.standard_normal((m, 4, params.max_actions)).astype(np.float32)
    schedule, decay = np.array([0.9, 0.2], np.float32), np.array([20], np.int64)
    eps = scheduled_epsilon(np.int64(step), schedule, decay)
    assert eps == np.float32(np.float64(schedule[0]) + (schedule[1] - schedule[0]) * min(step / 20, 1.0))
    want, want_pref = _run(env, q, eps)
    actions, preference = env.arena["actions"], env.arena["preference"]
    scheduled_epsilon_greedy(_cuda.to_device(q), env.arena["mask"], _cuda.to_device(np.array([step], np.int64)),
                             _cuda.to_device(schedule), _cuda.to_device(decay), env.seed_dev, env.counter,
                             actions, preference, stream())
    np.testing.assert_array_equal(actions.copy_to_host(), want)
    np.testing.assert_array_equal(preference.copy_to_host(), want_pref)


def _collect_setup(seed):
    """A device env mid-run (positions, cursors moved by two random steps) and an empty replay with
    its obs row written by the gather, as the learner's collect step has them before choosing."""
    m = 21
    data = synthetic_market(40, 5, seed=seed)
    params = EnvParams()
    env = DeviceEnv(data, params, m, seed=seed)
    env.reset()
    r = np.random.default_rng(seed)
    for _ in range(2):
        env.gather()
        env.arena.load({"actions": np.stack([r.integers(0, s, m) for s in params.branch_sizes], 1).astype(np.int32),
                        "preference": r.standard_normal(m).astype(np.float32)})
        env.step()
        env.advance()
    replay = Replay(capacity=4 * m, n_envs=m, state_dim=env.state_dim, n_branches=params.n_branches, batch_size=8,
                    n_step=1, seed=1, max_actions=params.max_actions).allocate()
    replay.store.load({"count": np.array([5], np.int64)})
    obs, mask = env.gather(ring=replay.obs_ring())
    return env, replay, obs, mask


def _collect_host(env, replay):
    out = {f"env.{k}": v for k, v in env.arena.to_host().items()}
    out["env.telemetry"] = env.telemetry_acc.copy_to_host()
    out.update({f"replay.{k}": v for k, v in replay.store.to_host().items()})
    return out


@pytest.mark.parametrize("step", [3, 40])
def test_fused_collect_launch_equals_the_three_launches(step):
    """scheduled_epsilon_greedy_step (ε-greedy, the env step and the replay row in one launch, the
    learner's collect step without a risk head) against scheduled_epsilon_greedy, env.step and
    replay.write(obs_written=True, advance=False) from the same state: every array of the env, its
    telemetry and the replay bit for bit (ε 0.9 → 0.2 over 20 steps: exploratory and greedy draws)."""
    got = []
    for fused in (False, True):
        env, replay, obs, mask = _collect_setup(seed=4)
        q = np.random.default_rng(8).standard_normal((env.n_envs, 4, env.params.max_actions)).astype(np.float32)
        q_dev, args = _cuda.to_device(q), (_cuda.to_device(np.array([step], np.int64)),
                                           _cuda.to_device(np.array([0.9, 0.2], np.float32)),
                                           _cuda.to_device(np.array([20], np.int64)))
        actions, preference = env.arena["actions"], env.arena["preference"]
        if fused:
            scheduled_epsilon_greedy_step(q_dev, mask, *args, actions, preference, env, replay, stream())
        else:
            scheduled_epsilon_greedy(q_dev, mask, *args, env.seed_dev, env.counter, actions, preference, stream())
            out = env.step(actions, preference, stream=stream())
            replay.write(obs, actions, out.reward, out.done, stream(), mask=mask, obs_written=True, advance=False)
        stream().synchronize()
        got.append(_collect_host(env, replay))
    want, have = got
    assert want.keys() == have.keys()
    for k in want:
        np.testing.assert_array_equal(have[k], want[k], err_msg=k)
    row = int(want["replay.count"][0]) % replay.store["action"].shape[0]
    assert (want["replay.action"][row] == want["env.actions"]).all() and want["replay.mask"][row].any()
    assert np.isfinite(want["replay.reward"][row]).all() and (want["replay.weight"][row] == 1).all()


def test_a_narrower_greedy_mask_leaves_exploration_on_the_env_mask():
    """The entry gates' split (numbarl/rl/cvar_gate.py): greedy over a mask whose direction entries are off,
    exploration over the env's own. With ε 1 every branch draws over `explore` (the same draws as a plain
    ε-greedy on it: the same RNG slots and counts), with ε 0 nothing enters; the fused collect launch equals
    the unfused one with the split, and its replay row stores the greedy choice's mask."""
    env, replay, obs, mask = _collect_setup(seed=6)
    n, q_host = env.n_envs, np.random.default_rng(3).standard_normal((env.n_envs, 4, env.params.max_actions))
    q_host[:, 0, [DIR_SHORT, DIR_LONG]] += 5.0  # the greedy choice would enter wherever it may
    q_host = q_host.astype(np.float32)
    env_mask = mask.copy_to_host()
    greedy_mask = env_mask.copy()
    greedy_mask[:, 0, [DIR_SHORT, DIR_LONG]] = 0  # every entry gated for the greedy choice
    seed, counter = int(env.seed_dev.copy_to_host()[0]), int(env.counter.copy_to_host()[0])
    explored, _ = epsilon_greedy_ref(q_host, greedy_mask, 1.0, seed, counter, explore=env_mask)
    plain, _ = epsilon_greedy_ref(q_host, env_mask, 1.0, seed, counter)
    np.testing.assert_array_equal(explored, plain)
    assert np.isin(explored[:, 0], [DIR_SHORT, DIR_LONG]).any()
    greedy, _ = epsilon_greedy_ref(q_host, greedy_mask, 0.0, seed, counter, explore=env_mask)
    assert not np.isin(greedy[:, 0], [DIR_SHORT, DIR_LONG]).any()
    got = []
    for fused in (False, True):
        env, replay, obs, mask = _collect_setup(seed=6)
        gm = _cuda.to_device(greedy_mask)
        q_dev, args = _cuda.to_device(q_host), (_cuda.to_device(np.array([5], np.int64)),
                                                _cuda.to_device(np.array([0.9, 0.2], np.float32)),
                                                _cuda.to_device(np.array([20], np.int64)))
        actions, preference = env.arena["actions"], env.arena["preference"]
        if fused:
            scheduled_epsilon_greedy_step(q_dev, gm, *args, actions, preference, env, replay, stream(), explore=mask)
        else:
            scheduled_epsilon_greedy(q_dev, gm, *args, env.seed_dev, env.counter, actions, preference, stream(),
                                     explore=mask)
            want_actions, _ = epsilon_greedy_ref(q_host, greedy_mask, scheduled_epsilon(np.int64(5), np.array(
                [0.9, 0.2], np.float32), np.array([20], np.int64)), seed, counter, explore=env_mask)
            np.testing.assert_array_equal(actions.copy_to_host(), want_actions)
            out = env.step(actions, preference, stream=stream())
            replay.write(obs, actions, out.reward, out.done, stream(), mask=gm, obs_written=True, advance=False)
        stream().synchronize()
        got.append(_collect_host(env, replay))
    for k in got[0]:
        np.testing.assert_array_equal(got[1][k], got[0][k], err_msg=k)
    row = int(got[0]["replay.count"][0]) % replay.store["action"].shape[0]
    np.testing.assert_array_equal(got[0]["replay.mask"][row], greedy_mask)
    with pytest.raises(ValueError, match="explore"):
        scheduled_epsilon_greedy(q_dev, gm, *args, env.seed_dev, env.counter, actions, preference, stream(),
                                 explore=env.arena["obs"])
    assert n == got[0]["env.actions"].shape[0]


def test_fused_collect_launch_names_mismatched_sizes():
    env, _, _, mask = _collect_setup(seed=2)
    other = Replay(capacity=4 * 3, n_envs=3, state_dim=env.state_dim, n_branches=4, batch_size=2, n_step=1,
                   max_actions=env.params.max_actions).allocate()
    q = _cuda.to_device(np.zeros((env.n_envs, 4, env.params.max_actions), np.float32))
    args = (_cuda.to_device(np.array([0], np.int64)), _cuda.to_device(np.array([0.9, 0.2], np.float32)),
            _cuda.to_device(np.array([20], np.int64)))
    with pytest.raises(ValueError, match="the replay 3"):
        scheduled_epsilon_greedy_step(q, mask, *args, env.arena["actions"], env.arena["preference"], env, other,
                                      stream())
    no_mask = Replay(capacity=4 * env.n_envs, n_envs=env.n_envs, state_dim=env.state_dim, n_branches=4, batch_size=2,
                     n_step=1).allocate()
    with pytest.raises(ValueError, match="max_actions"):
        scheduled_epsilon_greedy_step(q, mask, *args, env.arena["actions"], env.arena["preference"], env, no_mask,
                                      stream())


def test_exploration_is_uniform_over_the_allowed_actions():
    """CPU reference at scale: with epsilon 1 a long never explores short and the draws are uniform;
    with epsilon 0.3 about 30% of the decisions are exploratory."""
    data = synthetic_market(30, 4)
    params = EnvParams()
    m = 6000
    env = CpuEnv(data, params, m, seed=9)
    env.reset()
    env.state.position[:] = np.where(np.arange(m) % 2 == 0, 1.0, -1.0)
    env.gather()
    q = np.zeros((m, 4, params.max_actions), np.float32)
    acts, _ = epsilon_greedy_ref(q, env.mask, 1.0, 9, 0)
    longs, shorts = acts[0::2, 0], acts[1::2, 0]
    assert not (longs == DIR_SHORT).any() and not (shorts == DIR_LONG).any()
    assert abs(np.mean(longs == DIR_FLAT) - 0.5) < 0.05
    np.testing.assert_allclose(np.bincount(acts[:, 2], minlength=4) / m, 0.25, atol=0.03)
    q[:, :, 0] = 1.0  # greedy is action 0 everywhere
    acts, _ = epsilon_greedy_ref(q, env.mask, 0.3, 9, 0)
    explored = np.mean(acts[:, 3] != 0)  # a random draw that differs from greedy: 0.3 * 3/4
    assert abs(explored - 0.3 * 0.75) < 0.03


def test_launcher_errors_name_the_input():
    env = _env_with_positions(synthetic_market(20, 3), EnvParams(), [0.0, 1.0])
    q = _cuda.to_device(np.zeros((2, 4, EnvParams().max_actions), np.float32))
    eps = _cuda.to_device(np.zeros(1, np.float32))
    a, p = env.arena["actions"], env.arena["preference"]
    with pytest.raises(ValueError, match="mask must have one shape"):
        epsilon_greedy(q, env.arena["obs"], eps, env.seed_dev, env.counter, a, p, stream())
    with pytest.raises(ValueError, match="preference must be float32"):
        epsilon_greedy(q, env.arena["mask"], eps, env.seed_dev, env.counter, a, env.arena["bar"], stream())
    with pytest.raises(ValueError, match="epsilon must be float32"):
        epsilon_greedy(q, env.arena["mask"], _cuda.to_device(np.zeros(1, np.float64)), env.seed_dev, env.counter, a, p, stream())
