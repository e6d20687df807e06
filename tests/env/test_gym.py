"""The gymnasium wrapper: API conformance and the same step function as the backtest."""

import warnings

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from numbarl.env.backtest import backtest_reference
from numbarl.env.gym import TradingEnv
from numbarl.env.params import DIR_FLAT, DIR_LONG, PORTFOLIO_DIM, EnvParams


def test_gymnasium_api(rng, make_market):
    data = make_market(rng, n_bars=80, n_features=3)
    env = TradingEnv(data, EnvParams(episode_length=10, max_episode_bars=20))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unbounded Box observations are intended (normalized features)
        check_env(env, skip_render_check=True)
    assert env.observation_space.shape == (3 + PORTFOLIO_DIM,)
    assert tuple(env.action_space.nvec) == EnvParams().branch_sizes
    o1, i1 = env.reset(seed=123)
    o2, i2 = env.reset(seed=123)
    np.testing.assert_array_equal(o1, o2)
    assert i1["bar"] == i2["bar"] and env.observation_space.contains(o1)
    # the action mask of the observation: flat at a reset, so every action inside its branch
    want = np.zeros((4, EnvParams().max_actions), np.uint8)
    for branch, size in enumerate(EnvParams().branch_sizes):
        want[branch, :size] = 1
    np.testing.assert_array_equal(i1["mask"], want)
    with pytest.raises(ValueError, match="index"):
        env.step(np.array([3, 0, 0, 0]))


def test_gym_steps_equal_the_backtest(rng, make_market):
    data = make_market(rng, n_bars=70)
    params = EnvParams(episode_length=500, max_episode_bars=1000, vol_span=8, fill_delay=1)
    start, end = 6, 60
    env = TradingEnv(data, params, bar_range=(start, end))
    actions = np.stack([rng.integers(0, n, end - start) for n in params.branch_sizes], -1)
    actions[::5, 0] = DIR_LONG
    ref = backtest_reference(data, (start, end), params, actions)
    env.reset(seed=0, options={"start": start})
    pnl = []
    for j in range(end - start - 1):
        obs, reward, terminated, truncated, info = env.step(actions[j])
        pnl.append(info["bar_pnl"])
        assert not terminated and truncated == (j == end - start - 2)
    np.testing.assert_allclose(pnl, ref.pnl[0, 1:], rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(actions[0])


def test_position_gated_termination(rng, make_market):
    env = TradingEnv(make_market(rng, n_bars=80), EnvParams(episode_length=3, max_episode_bars=50), bar_range=(0, 80))
    env.reset(seed=1, options={"start": 0})
    flags = [env.step(np.array([DIR_LONG, 0, 0, 0]))[2] for _ in range(5)]
    assert flags == [False] * 5  # in a position: no episode end
    _, _, terminated, truncated, info = env.step(np.array([DIR_FLAT, 0, 0, 0]))
    assert terminated and not truncated and info["exit_reason"] == "close"
