"""Device env (simulator here, GPU in test_gpu_env.py) vs the CPU reference env, and the gather
kernel (obs and the published action mask) vs independent numpy implementations. The policies
that turn the mask into actions are the learner's: tests/rl/test_policies.py."""

import numpy as np
import pytest

from numbarl.cuda.runtime import cuda, stream
from numbarl.env.state import STATE_FIELDS
from numbarl.env.device import DeviceEnv, launch_gather
from numbarl.env.params import DIR_LONG, DIR_SHORT, PORTFOLIO_DIM, EnvParams
from numbarl.env.reference import CpuEnv
from numbarl.rl.policies import epsilon_greedy, epsilon_greedy_ref

_cuda = cuda()

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
        dsr_warmup_trades=2,  # both sides of the DSR's start-up rule
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
    q_dev, eps_dev = _cuda.device_array(shape, np.float32), _cuda.device_array(1, np.float32)
    for t in range(n_steps):
        obs_d, mask_d = dev.gather()
        assert_close(f"obs step {t}", obs_d.copy_to_host(), cpu.gather())
        assert_close(f"mask step {t}", mask_d.copy_to_host(), cpu.mask)
        q = rng.standard_normal(shape).astype(np.float32)
        eps = np.float32(rng.choice([0.0, 0.3, 1.0]))
        q_dev.copy_to_device(q)
        eps_dev.copy_to_device(np.array([eps], np.float32))
        epsilon_greedy(q_dev, mask_d, eps_dev, dev.seed_dev, dev.counter, dev.arena["actions"], dev.arena["preference"], stream())
        actions_c, pref_c = epsilon_greedy_ref(q, cpu.mask, eps, seed, cpu.counter[0])
        assert_close(f"actions step {t}", dev.arena["actions"].copy_to_host(), actions_c)
        assert_close(f"preference step {t}", dev.arena["preference"].copy_to_host(), pref_c)
        dev.step()
        reward_c, done_c = cpu.step(actions_c, pref_c)
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
    obs = dev.gather()[0].copy_to_host()
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
    # the env's two-launch gather and the backtest's one-launch gather write the same bits
    one_obs = _cuda.to_device(np.full(obs.shape, np.nan, np.float32))
    one_mask = _cuda.to_device(np.full((7, params.n_branches, params.max_actions), 7, np.uint8))
    launch_gather(one_obs, one_mask, dev.state, dev.mk, dev.k, dev.branch_sizes, stream())
    np.testing.assert_array_equal(one_obs.copy_to_host(), obs)
    np.testing.assert_array_equal(one_mask.copy_to_host(), dev.gather()[1].copy_to_host())
    # the learner's collect step gathers into the replay's row of the step as well (count % n_slots)
    ring = _cuda.to_device(np.full((3,) + obs.shape, np.nan, np.float32))
    count = _cuda.to_device(np.array([4], np.int64))
    ring_obs, ring_mask = dev.gather(_cuda.to_device(np.zeros_like(obs)), None, ring=(ring, count))
    got = ring.copy_to_host()
    np.testing.assert_array_equal(ring_obs.copy_to_host(), obs)
    np.testing.assert_array_equal(got[1], obs)  # 4 % 3
    assert np.isnan(got[[0, 2]]).all()
    np.testing.assert_array_equal(ring_mask.copy_to_host(), one_mask.copy_to_host())
    with pytest.raises(ValueError, match="ring store must be float32"):
        dev.gather(ring=(_cuda.to_device(np.zeros((3, 7, 2), np.float32)), count))


def _mask_numpy(position, branch_sizes, max_actions, lock):
    """The direction-lock rule and the branch sizes, as a mask [N, 4, max_actions] (1 = allowed)."""
    mask = np.zeros((len(position), len(branch_sizes), max_actions), np.uint8)
    for b, size in enumerate(branch_sizes):
        mask[:, b, :size] = 1
    if lock:
        mask[position > 0, 0, DIR_SHORT] = 0
        mask[position < 0, 0, DIR_LONG] = 0
    return mask


@pytest.mark.parametrize("lock", [True, False])
def test_gather_publishes_the_direction_lock_and_branch_sizes_as_a_mask(rng, make_market, lock):
    # odd branch sizes (padding in three branches) and an obs narrower than the mask (3 + 8 obs
    # columns < 4 x 5 mask entries: each gather thread writes two mask entries)
    data = make_market(rng, n_bars=30, n_features=3)
    params = EnvParams(sizes=(1, 2), targets=(0.0, 1.0, 2.0, 3.0, 4.0), stops=(0.0, 2.0, 4.0), direction_lock=lock)
    position = np.array([0, 1, -1, 2, -2, 0, 1], np.float32)
    dev = DeviceEnv(data, params, len(position))
    dev.reset()
    dev.arena.load({"position": position})
    want = _mask_numpy(position, params.branch_sizes, params.max_actions, lock)
    _, mask = dev.gather()
    np.testing.assert_array_equal(mask.copy_to_host(), want)
    assert want.shape[1] * want.shape[2] > dev.state_dim
    cpu = CpuEnv(data, params, len(position))
    cpu.state.position[:] = position
    cpu.gather()
    np.testing.assert_array_equal(cpu.mask, want)
    if lock:  # hold and close stay allowed mid-plan; only the opposite side is barred
        assert want[1, 0].tolist()[:3] == [0, 1, 1] and want[2, 0].tolist()[:3] == [1, 1, 0]


def test_collect_hook_fixed_views_and_indices(rng, make_market):
    data = make_market(rng, n_bars=60, n_features=3)
    params = small_params(rng, episode_length=3, fill_delay=0)
    env = DeviceEnv(data, params, 4, seed=2)
    env.reset()
    views = tuple(id(v) for v in env.transition)

    q_dev, greedy = _cuda.device_array((4, params.n_branches, params.max_actions), np.float32), _cuda.to_device(np.zeros(1, np.float32))

    def policy(obs, mask, actions, preference, stream):
        """A fixed "network" (prefer long when the first feature is positive), acted on greedily."""
        o = obs.copy_to_host(stream=stream)
        stream.synchronize()
        q_dev.copy_to_device(q_of(o), stream=stream)
        epsilon_greedy(q_dev, mask, greedy, env.seed_dev, env.counter, actions, preference, stream)

    def q_of(o):
        qh = np.zeros((o.shape[0], params.n_branches, params.max_actions), np.float32)
        qh[:, 0, DIR_LONG] = o[:, 0]
        qh[:, 0, DIR_SHORT] = -o[:, 0]
        return qh

    saw_done = False
    for t in range(12):
        before = env.state_to_host()
        tr = env.collect(policy)
        assert tuple(id(v) for v in tr) == views
        obs, nobs = tr.obs.copy_to_host(), tr.next_obs.copy_to_host()
        bar, nbar, done = tr.bar.copy_to_host(), tr.next_bar.copy_to_host(), tr.done.copy_to_host()
        np.testing.assert_array_equal(bar, before["cursor"])
        np.testing.assert_array_equal(obs[:, :3], data.features[bar])
        np.testing.assert_array_equal(nbar, env.state_to_host()["cursor"])
        np.testing.assert_array_equal(nobs[:, :3], data.features[nbar])
        np.testing.assert_array_equal(nbar[done == 0], bar[done == 0] + 1)
        lock = params.direction_lock
        np.testing.assert_array_equal(tr.mask.copy_to_host(), _mask_numpy(before["position"], params.branch_sizes, params.max_actions, lock))
        after = env.state_to_host()["position"]
        np.testing.assert_array_equal(tr.next_mask.copy_to_host(), _mask_numpy(after, params.branch_sizes, params.max_actions, lock))
        expected, _ = epsilon_greedy_ref(q_of(obs), tr.mask.copy_to_host(), 0.0, 0, 0)
        np.testing.assert_array_equal(tr.actions.copy_to_host(), expected)
        if lock:
            barred = np.where(before["position"] > 0, DIR_SHORT, np.where(before["position"] < 0, DIR_LONG, -1))
            assert not (tr.actions.copy_to_host()[:, 0] == barred).any()
        saw_done |= bool(done.any())
    assert env.counter.copy_to_host()[0] == 12 and saw_done


def test_launcher_shape_errors(rng, make_market):
    env = DeviceEnv(make_market(rng, n_bars=20), EnvParams(), 3)
    with pytest.raises(ValueError, match="mask must be uint8"):
        env.gather(mask=env.arena["actions"])
    with pytest.raises(ValueError, match="preference must be float32"):
        env.step(preference=env.arena["bar"])
    with pytest.raises(ValueError, match="bar_range"):
        DeviceEnv(make_market(rng, n_bars=20), EnvParams(), 3, bar_range=(5, 6))
    with pytest.raises(ValueError, match="n_envs"):
        DeviceEnv(make_market(rng, n_bars=20), EnvParams(), 0)
