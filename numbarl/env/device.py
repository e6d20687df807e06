"""Device trading environment: N envs in structure-of-arrays buffers, one thread per env (SPEC §4).

Kernels (each runs the row function of numbarl/env/core.py that the CPU reference loops over):

    reset_kernel    env i -> fresh portfolio at an RNG-drawn start        grid over N
    gather_kernel   obs[i, j] = features[cursor_i, j] | portfolio feature  grid over N * state_dim
    select_kernel   epsilon-greedy per branch, direction lock, q_gap      grid over N
    step_kernel     fills, exits, P&L, reward, done, soft reset            grid over N

Every launcher only launches: no allocation, host copy or synchronization, and per-step scalars
(epsilon, RNG counter, seed) are read from device memory, so a collect step can be captured into
a CUDA graph and replayed (the RNG counter is advanced by a kernel, numbarl/cuda/rng.advance).

Memory per env step: ~130 B of state read and written (float64 only where P&L precision needs it,
see numbarl/env/market.py), 16 B of actions, ~30 B of outputs, ~70 B of bar quotes.

Replay hook: after `step`, `env.transition` holds device views with fixed addresses:
obs (before the step) [N, state_dim], actions [N, 4], reward [N] f32, done [N] u8, next_obs [N,
state_dim] (gathered after the step; after a done it is the first obs of the next episode, which
a learner masks with done), bar / next_bar [N] i32 (the obs indices: cursor before / after).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from numbarl.cuda import rng
from numbarl.cuda.launch import device_function
from numbarl.cuda.runtime import Arena, cuda
from numbarl.cuda.runtime import stream as default_stream
from numbarl.env.core import (
    STATE_FIELDS,
    Grids,
    MarketArrays,
    StateArrays,
    StepArrays,
    env_step_row,
    gather_row,
    reset_row,
    select_row,
)
from numbarl.env.market import DeviceMarket, MarketData, check_range
from numbarl.env.params import PORTFOLIO_FEATURES, EnvParams

_cuda = cuda()

BLOCK = 128  # threads per block (one env per thread; the gather maps one obs element per thread)

# ---------------------------------------------------------------------------------------------
# device functions (the shared row functions, compiled for the device)
# ---------------------------------------------------------------------------------------------
_reset_row = device_function(reset_row)
_gather_row = device_function(gather_row)
_select_row = device_function(select_row)
_env_step_row = device_function(env_step_row)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def reset_kernel(st, lo, hi, k, seed, counter):
    i = _cuda.grid(1)
    if i >= st.cursor.shape[0]:
        return
    _reset_row(st, i, lo, hi, k, seed[0], counter[0])


@_cuda.jit(cache=True)
def gather_kernel(obs, st, mk, k):
    e = _cuda.grid(1)
    if e >= obs.shape[0] * obs.shape[1]:
        return
    _gather_row(obs, e, st, mk, k)


@_cuda.jit(cache=True)
def select_kernel(q, epsilon, seed, counter, position, direction_lock, branch_sizes, actions, q_gap):
    i = _cuda.grid(1)
    if i >= q.shape[0]:
        return
    eps = epsilon[i] if epsilon.shape[0] > 1 else epsilon[0]
    _select_row(q, i, eps, seed[0], counter[0], position, direction_lock, branch_sizes, actions, q_gap)


@_cuda.jit(cache=True)
def step_kernel(st, actions, grids, mk, q_gap, k, lo, hi, seed, counter, out):
    i = _cuda.grid(1)
    if i >= st.cursor.shape[0]:
        return
    _env_step_row(st, i, actions, grids, mk, q_gap, k, lo, hi, seed[0], counter[0], out)


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------
def _s(stream):
    return default_stream() if stream is None else stream


def launch_dims(n: int, block: int = BLOCK) -> tuple[int, int]:
    """(blocks, threads per block) covering n threads; tiny launches use one block of n threads."""
    n = max(1, int(n))
    threads = min(block, n)
    return (n + threads - 1) // threads, threads


def _check(name, arr, shape, dtype):
    if tuple(arr.shape) != tuple(shape) or np.dtype(arr.dtype) != np.dtype(dtype):
        raise ValueError(f"{name} must be {np.dtype(dtype)} {list(shape)}, got {np.dtype(arr.dtype)} {list(arr.shape)}")


def launch_reset(st, lo, hi, k, seed, counter, stream):
    reset_kernel[launch_dims(st.cursor.shape[0]) + (stream,)](st, np.int64(lo), np.int64(hi), k, seed, counter)


def launch_gather(obs, st, mk, k, stream):
    gather_kernel[launch_dims(obs.shape[0] * obs.shape[1]) + (stream,)](obs, st, mk, k)


def launch_select(q, epsilon, seed, counter, position, direction_lock, branch_sizes, actions, q_gap, stream):
    select_kernel[launch_dims(q.shape[0]) + (stream,)](q, epsilon, seed, counter, position, direction_lock, branch_sizes, actions, q_gap)


def launch_step(st, actions, grids, mk, q_gap, k, lo, hi, seed, counter, out, stream):
    step_kernel[launch_dims(st.cursor.shape[0]) + (stream,)](st, actions, grids, mk, q_gap, k, np.int64(lo), np.int64(hi), seed, counter, out)


class Transition(NamedTuple):
    """Device views the learner's replay-write kernel reads after `DeviceEnv.step` (fixed addresses)."""

    obs: object  # float32 [N, state_dim], gathered before the step
    actions: object  # int32 [N, 4]
    reward: object  # float32 [N]
    done: object  # uint8 [N]
    next_obs: object  # float32 [N, state_dim], gathered after the step (and reset)
    bar: object  # int32 [N]: cursor of obs
    next_bar: object  # int32 [N]: cursor of next_obs
    bar_pnl: object  # float64 [N]: P&L of the step (currency)


class DeviceEnv:
    """N parallel trading envs on the device; every buffer lives in one Arena("env").

    Methods launch kernels on `stream` (default: the process compute stream) and nothing else:
      reset(seed)                 first episodes (host writes seed/counter; call before capture)
      gather(obs=None)            obs [N, state_dim] at the current cursors (default: view "obs")
      select(q=None, epsilon=None, actions=None, q_gap=None)
                                  epsilon-greedy actions from Q [N, 4, max_actions]
      step(actions=None)          one env step; outputs in the views of `transition`/`outputs`
      advance()                   RNG counter += 1 (device)
      collect(q_fn)               gather -> q_fn(obs, q, stream) -> select -> step -> gather(next_obs) -> advance
    Defaults are the arena's own views ("obs", "q", "actions", "q_gap", "epsilon"), so the
    simplest graph body is `env.collect(q_fn, stream)`.
    """

    def __init__(self, data, params: EnvParams, n_envs: int, bar_range=None, seed: int = 0):
        if not isinstance(n_envs, (int, np.integer)) or not 1 <= n_envs <= 1 << 24:
            raise ValueError(f"n_envs = {n_envs!r} is invalid: allowed an integer in [1, 16777216]")
        market = data if isinstance(data, DeviceMarket) else data.to_device(params.vol_span, params.vol_horizon_bars)
        if not isinstance(market, DeviceMarket):
            raise TypeError(f"data must be MarketData or DeviceMarket, got {type(data).__name__}")
        market.check(params)
        self.market = market
        self.params = params
        self.n_envs = n = int(n_envs)
        self.lo, self.hi = check_range("bar_range", bar_range if bar_range is not None else (0, market.n_bars), market.n_bars)
        self.k = params.step_consts(market.tick_size)
        self.branch_sizes = tuple(np.int64(b) for b in params.branch_sizes)
        self.state_dim = params.state_dim(market.n_features)
        # obs column of the signed position (features first, then the portfolio features)
        self.position_column = int(market.n_features) + PORTFOLIO_FEATURES.index("position")
        self._seed = int(seed)

        arena = Arena("env")
        for name, dtype in STATE_FIELDS:
            arena.add(name, (n,), dtype)
        arena.add("obs", (n, self.state_dim), np.float32)
        arena.add("next_obs", (n, self.state_dim), np.float32)
        arena.add("q", (n, params.n_branches, params.max_actions), np.float32)
        arena.add("actions", (n, params.n_branches), np.int32)
        arena.add("q_gap", (n,), np.float32)
        arena.add("reward", (n,), np.float32)
        arena.add("done", (n,), np.uint8)
        arena.add("bar_pnl", (n,), np.float64)
        arena.add("trade_pnl", (n,), np.float64)
        arena.add("exit_reason", (n,), np.int32)
        arena.add("bar", (n,), np.int32)
        arena.add("next_bar", (n,), np.int32)
        arena.add("epsilon", (1,), np.float32)
        arena.add("counter", (1,), np.int64)
        arena.add("seed", (1,), np.uint64)
        sizes, targets, stops = params.grids()
        arena.add("sizes", sizes.shape, np.float32)
        arena.add("targets", targets.shape, np.float32)
        arena.add("stops", stops.shape, np.float32)
        arena.allocate()
        arena.load({"sizes": sizes, "targets": targets, "stops": stops})
        self.arena = arena

        self.state = StateArrays(*(arena[name] for name, _ in STATE_FIELDS))
        self.grids = Grids(arena["sizes"], arena["targets"], arena["stops"])
        self.mk = MarketArrays(*(market[name] for name in ("features", "mid", "bid", "ask", "high", "low", "vol")))
        self.outputs = StepArrays(*(arena[name] for name in StepArrays._fields))
        self.transition = Transition(
            arena["obs"], arena["actions"], arena["reward"], arena["done"], arena["next_obs"], arena["bar"], arena["next_bar"], arena["bar_pnl"]
        )
        self.counter = arena["counter"]
        self.epsilon = arena["epsilon"]
        self.seed_dev = arena["seed"]

    # -- host-side setup (not for capture) ------------------------------------------------------
    def reset(self, seed: int | None = None, stream=None) -> None:
        """Start every env at an RNG-drawn bar (Kelly/DSR cleared) and set the RNG counter to 0."""
        if seed is not None:
            self._seed = int(seed)
        self.arena.load({"seed": np.array([self._seed], np.uint64), "counter": np.zeros(1, np.int64)})
        launch_reset(self.state, self.lo, self.hi, self.k, self.seed_dev, self.counter, _s(stream))

    def set_epsilon(self, value: float) -> None:
        """Host write of the exploration rate (between replays; a learner may write the view itself)."""
        self.arena.load({"epsilon": np.array([value], np.float32)})

    def state_to_host(self) -> dict[str, np.ndarray]:
        """Every state field as numpy (synchronizes; tests and checkpoints)."""
        s = default_stream()
        out = {name: self.arena[name].copy_to_host(stream=s) for name, _ in STATE_FIELDS}
        s.synchronize()
        return out

    # -- launches (capturable) ------------------------------------------------------------------
    def gather(self, obs=None, stream=None):
        obs = self.arena["obs"] if obs is None else obs
        _check("obs", obs, (self.n_envs, self.state_dim), np.float32)
        launch_gather(obs, self.state, self.mk, self.k, _s(stream))
        return obs

    def select(self, q=None, epsilon=None, actions=None, q_gap=None, counter=None, stream=None):
        q = self.arena["q"] if q is None else q
        epsilon = self.epsilon if epsilon is None else epsilon
        actions = self.arena["actions"] if actions is None else actions
        q_gap = self.arena["q_gap"] if q_gap is None else q_gap
        counter = self.counter if counter is None else counter
        _check("q", q, (self.n_envs, self.params.n_branches, self.params.max_actions), np.float32)
        _check("actions", actions, (self.n_envs, self.params.n_branches), np.int32)
        _check("q_gap", q_gap, (self.n_envs,), np.float32)
        if np.dtype(epsilon.dtype) != np.float32 or epsilon.shape[0] not in (1, self.n_envs):
            raise ValueError(f"epsilon must be float32 [1] or [{self.n_envs}], got {epsilon.dtype} {list(epsilon.shape)}")
        launch_select(
            q, epsilon, self.seed_dev, counter, self.state.position, self.k.direction_lock, self.branch_sizes, actions, q_gap, _s(stream)
        )
        return actions, q_gap

    def step(self, actions=None, q_gap=None, counter=None, stream=None):
        actions = self.arena["actions"] if actions is None else actions
        q_gap = self.arena["q_gap"] if q_gap is None else q_gap
        counter = self.counter if counter is None else counter
        _check("actions", actions, (self.n_envs, self.params.n_branches), np.int32)
        _check("q_gap", q_gap, (self.n_envs,), np.float32)
        launch_step(
            self.state, actions, self.grids, self.mk, q_gap, self.k, self.lo, self.hi, self.seed_dev, counter, self.outputs, _s(stream)
        )
        return self.outputs

    def advance(self, stream=None) -> None:
        rng.advance(self.counter, _s(stream))

    def collect(self, q_fn, stream=None) -> Transition:
        """One collect step: obs -> Q (q_fn(obs, q, stream) writes the arena's "q") -> actions -> step."""
        stream = _s(stream)
        # COLLECT
        self.gather(self.transition.obs, stream)
        q_fn(self.transition.obs, self.arena["q"], stream)
        self.select(stream=stream)
        self.step(stream=stream)
        self.gather(self.transition.next_obs, stream)
        self.advance(stream)
        return self.transition


def upload(data: MarketData, params: EnvParams) -> DeviceMarket:
    """Upload market data once for any number of envs/backtests with these params."""
    return data.to_device(params.vol_span, params.vol_horizon_bars)
