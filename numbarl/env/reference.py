"""CPU reference env: the device env's semantics in @njit loops over envs (SPEC §4).

Each function loops the same row functions the kernels run (numbarl/env/rows.py), over numpy
structure-of-arrays state, so the device env can be checked step by step against it, and so the
env can be used without a GPU (numbarl/env/gym.py wraps one env of it as a gymnasium.Env).

    env = CpuEnv(data, params, n_envs=8, bar_range=(0, 5000), seed=1)
    obs = env.reset()                           # [N, state_dim] float32; env.mask [N, 4, max_actions]
    actions = ...                               # [N, 4] int32, e.g. numbarl.rl.policies.epsilon_greedy_ref
    reward, done = env.step(actions, preference)  # then obs = env.gather()
    env.step(actions, preference, risk_budget=0.3)  # R18's ρ (core.py); None: the last one, initially 1
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda.runtime import cuda
from numbarl.env.core import step_core
from numbarl.env.market import MarketData, check_range
from numbarl.env.params import EnvParams, validate_actions
from numbarl.env.rows import env_step_row, gather_row, load_bars, load_row, reset_row, store_out, store_row
from numbarl.env.state import STATE_FIELDS, Grids, MarketArrays, StateArrays, StepArrays, row_jit

cuda()  # the backend (GPU or simulator), selected once

_ONE = np.float64(1.0)


def new_state(n: int) -> StateArrays:
    """Zeroed numpy state for n envs (dtypes of STATE_FIELDS)."""
    return StateArrays(*(np.zeros(n, dtype) for _, dtype in STATE_FIELDS))


def new_step_arrays(n: int) -> StepArrays:
    return StepArrays(
        reward=np.zeros(n, np.float32),
        done=np.zeros(n, np.uint8),
        bar_pnl=np.zeros(n, np.float64),
        trade_pnl=np.zeros(n, np.float64),
        exit_reason=np.zeros(n, np.int32),
        bar=np.zeros(n, np.int32),
        next_bar=np.zeros(n, np.int32),
    )


def market_arrays(data: MarketData, params: EnvParams) -> MarketArrays:
    return MarketArrays(
        data.features, data.mid, data.bid, data.ask, data.high, data.low, data.volatility(params.vol_span, params.vol_horizon_bars)
    )


# ---------------------------------------------------------------------------------------------
# reference loops (one per kernel)
# ---------------------------------------------------------------------------------------------
@row_jit
def reset_ref(st, lo, hi, k, seed, counter):
    for i in range(st.cursor.shape[0]):
        reset_row(st, i, lo, hi, k, seed, counter)


@row_jit
def gather_ref(obs, mask, st, mk, k, branch_sizes):
    for e in range(obs.size):
        gather_row(obs, mask, e, st, mk, k, branch_sizes)


@row_jit
def step_ref(st, actions, grids, mk, preference, risk_budget, k, lo, hi, seed, counter, out):
    for i in range(st.cursor.shape[0]):
        env_step_row(st, i, actions, grids, mk, preference, risk_budget, k, lo, hi, seed, counter, out)


# ---------------------------------------------------------------------------------------------
# the CPU env
# ---------------------------------------------------------------------------------------------
class CpuEnv:
    """N envs on the CPU with the device env's exact semantics (numpy state, @njit steps)."""

    def __init__(self, data: MarketData, params: EnvParams, n_envs: int, bar_range=None, seed: int = 0):
        if not isinstance(n_envs, (int, np.integer)) or n_envs < 1:
            raise ValueError(f"n_envs = {n_envs!r} is invalid: allowed an integer >= 1")
        self.data = data
        self.params = params
        self.n_envs = int(n_envs)
        self.lo, self.hi = check_range("bar_range", bar_range if bar_range is not None else (0, data.n_bars), data.n_bars)
        self.k = params.step_consts(data.tick_size)
        self.grids = Grids(*params.grids())
        self.market = market_arrays(data, params)
        self.branch_sizes = tuple(np.int64(b) for b in params.branch_sizes)
        self.state_dim = params.state_dim(data.n_features)
        self.seed = np.uint64(seed)
        self.counter = np.zeros(1, np.int64)
        self.state = new_state(self.n_envs)
        self.out = new_step_arrays(self.n_envs)
        self.mask = np.zeros((self.n_envs, params.n_branches, params.max_actions), np.uint8)  # of the last gather
        self.preference = np.zeros(self.n_envs, np.float32)
        self.risk_budget = np.ones(1, np.float32)  # ρ of the Kelly cap and the DSR term (core.py), as the device's

    def reset(self, seed: int | None = None) -> np.ndarray:
        """New episodes at RNG-drawn starts (Kelly/DSR cleared, counter set to 0); returns obs."""
        if seed is not None:
            self.seed = np.uint64(seed)
        self.counter[0] = 0
        reset_ref(self.state, self.lo, self.hi, self.k, self.seed, self.counter[0])
        return self.gather()

    def gather(self, obs: np.ndarray | None = None) -> np.ndarray:
        """obs [N, state_dim] at the cursors; the action mask goes to self.mask (1 = allowed)."""
        if obs is None:
            obs = np.empty((self.n_envs, self.state_dim), np.float32)
        gather_ref(obs, self.mask, self.state, self.market, self.k, self.branch_sizes)
        return obs

    def step(self, actions: np.ndarray, preference: np.ndarray | None = None,
             risk_budget: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Apply actions [N, 4] with preference [N] (None: the last one given, initially 0) and the
        risk budget ρ (stored as float32 like the device's; None: the last one given, initially 1);
        returns (reward float32 [N], done uint8 [N]) (copies). The other outputs (bar_pnl,
        trade_pnl, exit_reason, bar, next_bar) are in self.out."""
        actions = validate_actions(actions, self.params).reshape(self.n_envs, self.params.n_branches)
        if preference is not None:
            self.preference[:] = preference
        if risk_budget is not None:
            self.risk_budget[0] = risk_budget
        step_ref(self.state, actions, self.grids, self.market, self.preference, self.risk_budget, self.k, self.lo, self.hi,
                 self.seed, self.counter[0], self.out)
        return self.out.reward.copy(), self.out.done.copy()

    def advance(self, k: int = 1) -> None:
        """Next RNG counter (the device env advances it inside the graph)."""
        self.counter[0] += k

    def state_dict(self) -> dict[str, np.ndarray]:
        return {name: getattr(self.state, name).copy() for name, _ in STATE_FIELDS}


@row_jit
def step_no_reset_ref(st, actions, grids, mk, preference, k, hi, out):
    """Like step_ref but without the soft reset: for callers that reset episodes themselves
    (the gymnasium wrapper). Same step function (core.step_core), risk budget ρ = 1."""
    for i in range(st.cursor.shape[0]):
        s = load_row(st, i)
        c = s.cursor
        bars = load_bars(mk, c)
        s2, o, t1, t2 = step_core(
            s, actions[i, 0], grids.sizes[actions[i, 1]], grids.targets[actions[i, 2]], grids.stops[actions[i, 3]], bars, preference[i], _ONE, k, hi - 1
        )
        store_row(st, i, s2)
        store_out(out, i, o, c, s2.cursor)
