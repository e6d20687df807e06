"""Device env (simulator here, GPU in test_gpu_env.py) vs the CPU reference env, and the gather
and select kernels vs independent numpy implementations."""

import numpy as np
import pytest

from numbarl.cuda import rng as crng
from numbarl.env import core
from numbarl.env.core import STATE_FIELDS
from numbarl.env.device import DeviceEnv
from numbarl.env.params import DIR_FLAT, DIR_LONG, DIR_SHORT, PORTFOLIO_DIM, EnvParams
from numbarl.env.reference import CpuEnv

# Tolerances of the device/reference comparison. Under the simulator both sides run the same
# compiled CPU code, so they agree bit for bit; on a GPU, FMA contraction may change the last
# bits of float64 P&L (rtol 1e-9) and of float32 rewards/obs (rtol 1e-5); integers must match.
F64_RTOL, F64_ATOL = 1e-9, 1e-9
F32_RTOL, F32_ATOL = 1e-5, 1e-6


def assert_close(name, got, want):
    got, want = np.asarray(got), np.asarray(want)
    if np.issubdtype(want.dtype, np.integer):
        np.testing.assert_array_equal(got, want, err_msg=name)
    elif want.dtype == np.float64:
        np.testing.assert_allclose(got, want, rtol=F64_RTOL, atol=F64_ATOL, err_msg=name)
    else:
        np.testing.assert_allclose(got, want, rtol=F32_RTOL, atol=F32_ATOL, err_msg=name)


def small_params(rng, **kw):
    base = dict(
        episode_length=int(rng.integers(4, 12)),
        max_episode_bars=30,
        vol_span=10,
        vol_horizon_bars=3,
        fill_delay=int(rng.integers(0, 3)),
        direction_lock=bool(rng.integers(0, 2)),
        churn_penalty_scale=0.05,
        conviction_weight=0.3,
        dsr_reward_scale=0.1,
        slippage_ticks=0.5,
    )
    base.update(kw)
    return EnvParams(**base)


def test_parity_device_vs_reference_every_field_every_step(rng, make_market):
    data = make_market(rng, n_bars=90)
    params = small_params(rng)
    n_envs, n_steps, seed = 5, 45, int(rng.integers(1 << 31))
    cpu = CpuEnv(data, params, n_envs, bar_range=(3, 85), seed=seed)
    dev = DeviceEnv(data, params, n_envs, bar_range=(3, 85), seed=seed)
    cpu.reset()
    dev.reset()
    shape = (n_envs, params.n_branches, params.max_actions)
    n_done = n_trades = 0
    for t in range(n_steps):
        obs_d = dev.gather().copy_to_host()
        assert_close(f"obs step {t}", obs_d, cpu.gather())
        q = rng.standard_normal(shape).astype(np.float32)
        eps = np.float32(rng.choice([0.0, 0.3, 1.0]))
        dev.arena.load({"q": q, "epsilon": np.array([eps], np.float32)})
        dev.select()
        actions_c, gap_c = cpu.select(q, eps)
        assert_close(f"actions step {t}", dev.arena["actions"].copy_to_host(), actions_c)
        assert_close(f"q_gap step {t}", dev.arena["q_gap"].copy_to_host(), gap_c)
        dev.step()
        reward_c, done_c = cpu.step(actions_c)
        out = {name: dev.outputs._asdict()[name].copy_to_host() for name in dev.outputs._fields}
        for name in ("reward", "done", "bar_pnl", "trade_pnl", "exit_reason", "bar", "next_bar"):
            assert_close(f"{name} step {t}", out[name], getattr(cpu.out, name))
        state = dev.state_to_host()
        for name, _ in STATE_FIELDS:
            assert_close(f"{name} step {t}", state[name], getattr(cpu.state, name))
        dev.advance()
        cpu.advance()
        n_done += int(done_c.sum())
        n_trades += int((cpu.out.exit_reason != 0).sum())
    assert dev.counter.copy_to_host()[0] == n_steps
    assert n_done > 0 and n_trades > 0  # the run exercised resets and closed trades


def test_gather_matches_numpy(rng, make_market):
    data = make_market(rng, n_bars=60, n_features=13)  # 7 x 21 obs elements: two blocks, the second partial
    params = small_params(rng, fill_delay=1)
    env = CpuEnv(data, params, 7, seed=5)
    env.reset()
    for _ in range(6):  # get some positions, plans and pending orders
        acts = np.stack([rng.integers(0, n, 7) for n in params.branch_sizes], 1)
        env.step(acts)
        env.advance()
    dev = DeviceEnv(data, params, 7)
    dev.arena.load(env.state_dict())
    obs = dev.gather().copy_to_host()
    s = env.state_dict()
    vol = data.volatility(params.vol_span, params.vol_horizon_bars)
    c = s["cursor"]
    mid, v = data.mid[c], vol[c]
    side = np.sign(s["position"].astype(np.float64))
    flat = s["position"] == 0
    expected = np.zeros((7, PORTFOLIO_DIM))
    expected[:, 0] = s["position"] / max(params.sizes)
    # the column the learner reads the lock from (agent.lock_aware_target) is this one
    np.testing.assert_allclose(obs[:, dev.position_column], s["position"] / max(params.sizes), rtol=1e-6)
    assert dev.position_column == data.n_features
    expected[:, 1] = np.where(flat, 0.0, (mid - s["entry_price"]) * side / v)
    expected[:, 2] = s["bars_in_trade"] / params.obs_hold_bars
    expected[:, 3] = np.where(flat | (s["plan_target"] <= 0), 0.0, (s["target_level"] - mid) * side / v)
    expected[:, 4] = np.where(flat | (s["plan_stop"] <= 0), 0.0, (mid - s["stop_level"]) * side / v)
    expected[:, 5] = s["pending_due"] >= 0
    w, lo, sw, sl = s["kelly_wins"], s["kelly_losses"], s["kelly_sum_win"], s["kelly_sum_loss"]
    with np.errstate(divide="ignore", invalid="ignore"):
        p = w / (w + lo)
        b = (sw / w) / (sl / lo)
        kelly = np.clip(p - (1 - p) / b, -1, 1)
    expected[:, 6] = np.where((w > 0) & (lo > 0) & (sl > 0), kelly, 0.0)
    expected[:, 7] = np.clip(1 - (c - s["last_entry_bar"].astype(np.int64)) / params.churn_threshold_bars, 0, 1)
    np.testing.assert_allclose(obs[:, : data.n_features], data.features[c], rtol=0, atol=0)
    np.testing.assert_allclose(obs[:, data.n_features :], expected.astype(np.float32), rtol=1e-6, atol=1e-6)
    assert (s["position"] != 0).any() and obs.shape == (7, data.n_features + PORTFOLIO_DIM)


def _select_numpy(q, position, branch_sizes, lock):
    """Greedy reference: first maximum over allowed actions, NaN never wins."""
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


def test_select_greedy_matches_numpy_with_lock_ties_and_padding(rng, make_market):
    data = make_market(rng, n_bars=30)
    params = EnvParams(sizes=(1.0, 2.0), targets=(0.0, 1.0, 2.0, 3.0, 4.0), stops=(0.0, 2.0, 4.0))
    n = 9
    dev = DeviceEnv(data, params, n)
    position = np.array([0, 1, -1, 0.5, -0.5, 0, 1, -1, 0], np.float32)
    dev.arena.load({"position": position})
    q = rng.standard_normal((n, 4, params.max_actions)).astype(np.float32)
    q[:, 1, 2:] = 1e9  # padding beyond the size branch must be ignored
    q[:, 3, 3:] = 1e9
    q[0, 2, :] = 0.25  # ties: first maximum
    q[1, 0, DIR_SHORT] = 100.0  # locked out for a long position
    q[2, 0, :] = np.nan  # no valid maximum: first allowed action
    q[3, 1, :2] = np.nan
    dev.arena.load({"q": q})
    dev.select()
    got = dev.arena["actions"].copy_to_host()
    np.testing.assert_array_equal(got, _select_numpy(q, position, params.branch_sizes, True))
    assert got[0, 2] == 0 and got[1, 0] != DIR_SHORT and got[2, 0] == DIR_SHORT
    gap = dev.arena["q_gap"].copy_to_host()
    np.testing.assert_array_equal(gap[3:], (q[3:, 0, DIR_LONG] - q[3:, 0, DIR_SHORT]).astype(np.float32))


def test_exploration_respects_direction_lock_and_is_uniform(rng, make_market):
    data = make_market(rng, n_bars=30)
    params = EnvParams()
    # device: every exploratory draw reproduced from the counter RNG
    n, seed, counter = 6, int(rng.integers(1 << 31)), 7
    dev = DeviceEnv(data, params, n, seed=seed)
    dev.reset()
    position = np.array([1, -1, 0, 0.25, -1, 1], np.float32)
    dev.arena.load({"position": position, "counter": np.array([counter], np.int64), "epsilon": np.ones(1, np.float32)})
    dev.select()
    got = dev.arena["actions"].copy_to_host()
    for i in range(n):
        for b, size in enumerate(params.branch_sizes):
            allowed = list(range(size))
            if b == 0 and position[i] != 0:
                allowed.remove(DIR_SHORT if position[i] > 0 else DIR_LONG)
            r = crng.randint(np.uint64(seed), i, counter, core.SLOT_RANDOM + b, len(allowed))
            assert got[i, b] == allowed[r]
    # more envs than one block (guard of the partial last block), mixed epsilon per env
    m = 131
    dev = DeviceEnv(data, params, m, seed=seed)
    cpu = CpuEnv(data, params, m, seed=seed)
    dev.reset()
    cpu.reset()
    pos = rng.choice(np.array([-1.0, 0.0, 0.5], np.float32), m)
    cpu.state.position[:] = pos
    eps = rng.uniform(0, 1, m).astype(np.float32)
    q = rng.standard_normal((m, 4, params.max_actions)).astype(np.float32)
    dev.arena.load({"position": pos, "q": q})
    eps_dev = dev.arena["q_gap"]  # any float32 [N] device array works as per-env epsilon
    eps_dev.copy_to_device(eps)
    dev.select(epsilon=eps_dev, q_gap=dev.arena["reward"])
    want, _ = cpu.select(q, eps)
    np.testing.assert_array_equal(dev.arena["actions"].copy_to_host(), want)
    # CPU reference at scale: with epsilon 1 a long never explores short and draws are uniform
    m = 6000
    env = CpuEnv(data, params, m, seed=seed)
    env.reset()
    env.state.position[:] = np.where(np.arange(m) % 2 == 0, 1.0, -1.0)
    q = np.zeros((m, 4, params.max_actions), np.float32)
    acts, _ = env.select(q, 1.0)
    longs, shorts = acts[0::2, 0], acts[1::2, 0]
    assert not (longs == DIR_SHORT).any() and not (shorts == DIR_LONG).any()
    frac = np.mean(longs == DIR_FLAT)
    assert abs(frac - 0.5) < 0.05
    counts = np.bincount(acts[:, 2], minlength=4) / m
    np.testing.assert_allclose(counts, 0.25, atol=0.03)
    # epsilon 0.3: about 30% of branch decisions are coins that came up (greedy is action 0 here)
    q[:, :, 0] = 1.0
    acts, _ = env.select(q, 0.3)
    explored = np.mean(acts[:, 3] != 0)  # a random draw that differs from greedy: 0.3 * 3/4
    assert abs(explored - 0.3 * 0.75) < 0.03


def test_collect_hook_fixed_views_and_indices(rng, make_market):
    data = make_market(rng, n_bars=60, n_features=3)
    params = small_params(rng, episode_length=3, fill_delay=0)
    env = DeviceEnv(data, params, 4, seed=2)
    env.reset()
    views = tuple(id(v) for v in env.transition)

    def q_fn(obs, q, stream):  # a fixed "network": prefer long when the first feature is positive
        o = obs.copy_to_host(stream=stream)
        stream.synchronize()
        q.copy_to_device(q_of(o), stream=stream)

    def q_of(o):
        qh = np.zeros((o.shape[0], params.n_branches, params.max_actions), np.float32)
        qh[:, 0, DIR_LONG] = o[:, 0]
        qh[:, 0, DIR_SHORT] = -o[:, 0]
        return qh

    env.set_epsilon(0.0)
    saw_done = False
    for t in range(12):
        before = env.state_to_host()
        tr = env.collect(q_fn)
        assert tuple(id(v) for v in tr) == views
        obs, nobs = tr.obs.copy_to_host(), tr.next_obs.copy_to_host()
        bar, nbar, done = tr.bar.copy_to_host(), tr.next_bar.copy_to_host(), tr.done.copy_to_host()
        np.testing.assert_array_equal(bar, before["cursor"])
        np.testing.assert_array_equal(obs[:, :3], data.features[bar])
        np.testing.assert_array_equal(nbar, env.state_to_host()["cursor"])
        np.testing.assert_array_equal(nobs[:, :3], data.features[nbar])
        np.testing.assert_array_equal(nbar[done == 0], bar[done == 0] + 1)
        expected = _select_numpy(q_of(obs), before["position"], params.branch_sizes, params.direction_lock)
        np.testing.assert_array_equal(tr.actions.copy_to_host(), expected)
        saw_done |= bool(done.any())
    assert env.counter.copy_to_host()[0] == 12 and saw_done


def test_launcher_shape_errors(rng, make_market):
    env = DeviceEnv(make_market(rng, n_bars=20), EnvParams(), 3)
    with pytest.raises(ValueError, match="q must be float32"):
        env.select(q=env.arena["obs"])
    with pytest.raises(ValueError, match="bar_range"):
        DeviceEnv(make_market(rng, n_bars=20), EnvParams(), 3, bar_range=(5, 6))
    with pytest.raises(ValueError, match="n_envs"):
        DeviceEnv(make_market(rng, n_bars=20), EnvParams(), 0)
