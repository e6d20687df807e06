"""gymnasium.Env around the CPU reference env, so other RL libraries can use numbarl's env.

One env, the same step function as the device env and the backtest (numbarl/env/core.py).

    env = TradingEnv(data, EnvParams(), bar_range=(0, 50_000))
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(env.action_space.sample())

Spaces: observation Box(float32, [F + PORTFOLIO_DIM]); action MultiDiscrete(params.branch_sizes)
= (direction 3 {short, flat, long}, size, target, stop). `terminated` is the position-gated end of
an episode; `truncated` is a forced end (last bar of the range, or the max_episode_bars hard cap;
the position is closed first). After either, call reset(): it draws a new start uniformly from the
range (gymnasium's np_random) with a fresh portfolio. The opportunity-cost term reads the agent's
preference (e.g. Q(long) - Q(short)); set it with `set_preference` before `step` (default 0: no
cost). `info["mask"]` is the action mask of the returned observation ([4, max_actions] uint8, 1 =
allowed: the direction lock as data; numbarl/env/__init__.py has the contract).
"""

from __future__ import annotations

import gymnasium
import numpy as np
from gymnasium import spaces

from numbarl.env.market import MarketData, check_range
from numbarl.env.params import EXIT_REASONS, EnvParams, validate_actions
from numbarl.env.reference import CpuEnv, step_no_reset_ref
from numbarl.env.rows import store_row
from numbarl.env.state import initial_portfolio


class TradingEnv(gymnasium.Env):
    """numbarl's trading env as a gymnasium.Env (CPU)."""

    metadata = {"render_modes": []}

    def __init__(self, data: MarketData, params: EnvParams | None = None, bar_range=None):
        super().__init__()
        self.params = EnvParams() if params is None else params
        self._env = CpuEnv(data, self.params, 1, bar_range)
        self.lo, self.hi = check_range("bar_range", bar_range if bar_range is not None else (0, data.n_bars), data.n_bars)
        dim = self._env.state_dim
        self.observation_space = spaces.Box(low=-np.inf, high=np.inf, shape=(dim,), dtype=np.float32)
        self.action_space = spaces.MultiDiscrete(np.array(self.params.branch_sizes, dtype=np.int64))
        self._preference = np.zeros(1, np.float32)
        self._started = False

    def set_preference(self, preference: float) -> None:
        """The agent's preference of long over short (e.g. Q(long) - Q(short)) for the opportunity
        cost of the next step."""
        self._preference[0] = np.float32(preference)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        top = max(self.lo, min(self.hi - 2, self.hi - 1 - self.params.episode_length))
        start = int(self.np_random.integers(self.lo, top + 1))
        if options and "start" in options:
            start = int(options["start"])
            if not self.lo <= start <= self.hi - 2:
                raise ValueError(f"options['start'] = {start} is outside [{self.lo}, {self.hi - 2}]")
        store_row(self._env.state, 0, initial_portfolio(start))
        self._started = True
        obs = self._env.gather()[0].copy()
        return obs, {"bar": start, "mask": self._env.mask[0].copy()}

    def step(self, action):
        if not self._started:
            raise RuntimeError("call reset() before step()")
        a = validate_actions(np.asarray(action).reshape(1, -1), self.params)
        e = self._env
        step_no_reset_ref(e.state, a, e.grids, e.market, self._preference, e.k, self.hi, e.out)
        obs = e.gather()[0].copy()
        done = bool(e.out.done[0])
        cursor = int(e.state.cursor[0])
        forced = cursor >= self.hi - 1 or int(e.state.ep_len[0]) >= self.params.max_episode_bars
        if done:
            self._started = False
        info = {
            "bar": cursor,
            "bar_pnl": float(e.out.bar_pnl[0]),
            "trade_pnl": float(e.out.trade_pnl[0]),
            "exit_reason": EXIT_REASONS[int(e.out.exit_reason[0])],
            "position": float(e.state.position[0]),
            "mask": e.mask[0].copy(),
        }
        return obs, float(e.out.reward[0]), done and not forced, done and forced, info
