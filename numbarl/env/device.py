"""Device trading environment: N envs in structure-of-arrays buffers, one thread per env (SPEC §4).

Kernels (each runs the row function of numbarl/env/core.py that the CPU reference loops over):

    reset_kernel    env i -> fresh portfolio at an RNG-drawn start        grid over N
    gather          two launches: features_kernel  obs[i, j < F] = features[cursor_i, j]
                    (grid over N * F, a plain copy), then portfolio_kernel: the
                    portfolio features and the action mask [N, n_branches, max_actions]
                    (grid over N * PORTFOLIO_DIM). gather_kernel (grid over N * state_dim,
                    both in one) is the backtest's, over its policies' rows
    step_kernel     fills, exits, P&L, reward, done, soft reset            grid over N
                    (the risk budget ρ, float32 [1], read from device memory: core.py)
                    + the training-path telemetry: env i adds its step to its own column of
                    telemetry_acc [N_TEL, N] float64 (numbarl/env/telemetry.py)

Actions are chosen outside the env (numbarl/rl/policies.py) from the published mask; the step
reads the actions and the per-env `preference` (the contract: numbarl/env/__init__.py).
Every launcher only launches: no allocation, host copy or synchronization, and per-step scalars
(RNG counter, seed) are read from device memory, so a collect step can be captured into a CUDA
graph and replayed (the RNG counter is advanced by a kernel, numbarl/cuda/rng.advance).

Memory per env step: ~130 B of state read and written (float64 only where P&L precision needs it,
see numbarl/env/market.py), 16 B of actions, ~30 B of outputs, ~70 B of bar quotes, and ~240 B of
training-path telemetry sums read and written (17 float64 every step, 4 more per closed trade).

Replay hook: after `step`, `env.transition` holds device views with fixed addresses:
obs (before the step) [N, state_dim], mask (of obs) [N, 4, max_actions] u8, actions [N, 4],
reward [N] f32, done [N] u8, next_obs [N, state_dim] and next_mask (gathered after the step;
after a done they are the first of the next episode, which a learner masks with done), bar /
next_bar [N] i32 (the obs indices: cursor before / after).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from numbarl.cuda import rng
from numbarl.cuda.launch import device_function
from numbarl.cuda.runtime import Arena, cuda
from numbarl.cuda.runtime import stream as default_stream
from numbarl.env.market import DeviceMarket, MarketData, check_range
from numbarl.env.params import PORTFOLIO_FEATURES, EnvParams
from numbarl.env.rows import gather_portfolio_row, gather_row, reset_row
from numbarl.env.state import STATE_FIELDS, Grids, MarketArrays, StateArrays, StepArrays
from numbarl.env.telemetry import N_TEL, launch_zero, telemetry_step_row

_cuda = cuda()

BLOCK = 128  # threads per block (one env per thread; the gather maps one obs element per thread)

# ---------------------------------------------------------------------------------------------
# device functions (the shared row functions, compiled for the device)
# ---------------------------------------------------------------------------------------------
_reset_row = device_function(reset_row)
_gather_row = device_function(gather_row)
_gather_portfolio_row = device_function(gather_portfolio_row)
_telemetry_step_row = device_function(telemetry_step_row)  # rows.env_step_row + accumulation


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
def gather_kernel(obs, mask, st, mk, k, branch_sizes):
    e = _cuda.grid(1)
    if e >= obs.shape[0] * obs.shape[1]:
        return
    _gather_row(obs, mask, e, st, mk, k, branch_sizes)


@_cuda.jit(cache=True)
def features_kernel(obs, cursor, features, ring, count, to_ring):
    """obs[i, j] = features[cursor[i], j] for the market features j < F: one element per thread,
    nothing else in the kernel (a light copy at full occupancy; the portfolio features' float64
    arithmetic and the mask are `portfolio_kernel`'s). to_ring: also into ring[count % n_slots]
    (the replay's obs row of this step, so the learner's collect step skips its own obs copy)."""
    e = _cuda.grid(1)
    n_feat = features.shape[1]
    if e >= obs.shape[0] * n_feat:
        return
    i = e // n_feat
    j = e - i * n_feat
    v = features[cursor[i], j]
    obs[i, j] = v
    if to_ring:
        ring[count[0] % ring.shape[0], i, j] = v


@_cuda.jit(cache=True)
def portfolio_kernel(obs, mask, st, mk, k, branch_sizes, ring, count, to_ring):
    e = _cuda.grid(1)
    n_feat = mk.features.shape[1]
    n_port = obs.shape[1] - n_feat
    if e >= obs.shape[0] * n_port:
        return
    _gather_portfolio_row(obs, mask, e, st, mk, k, branch_sizes)
    if to_ring:
        i = e // n_port
        j = n_feat + (e - i * n_port)
        ring[count[0] % ring.shape[0], i, j] = obs[i, j]


@_cuda.jit(cache=True)
def step_kernel(st, actions, grids, mk, preference, risk_budget, k, lo, hi, seed, counter, out, acc):
    i = _cuda.grid(1)
    if i >= st.cursor.shape[0]:
        return
    _telemetry_step_row(st, i, actions, grids, mk, preference, risk_budget, k, lo, hi, seed[0], counter[0], out, acc)


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


def launch_gather(obs, mask, st, mk, k, branch_sizes, stream):
    """One launch, one thread per obs element (the backtest's gather over its policies)."""
    gather_kernel[launch_dims(obs.shape[0] * obs.shape[1]) + (stream,)](obs, mask, st, mk, k, branch_sizes)


def launch_gather_split(obs, mask, st, mk, k, branch_sizes, stream, ring=None, counter=None):
    """The env's gather in two launches: the market features' copy, then the portfolio features
    and the mask; the same values as `launch_gather`. ring: None, or (store [n_slots, N,
    state_dim] float32, count int64 [1]) into whose row count % n_slots obs is written as well;
    counter: any int64 [1] device array, the kernels' unread count argument when ring is None."""
    n, n_feat = obs.shape[0], mk.features.shape[1]
    if obs.shape[1] - n_feat < 1:
        raise ValueError(f"obs has {obs.shape[1]} columns for {n_feat} market features: no portfolio block")
    if ring is None:
        if counter is None:
            raise ValueError("launch_gather_split: pass ring=(store, count) or the env's counter")
        store, count, to_ring = obs.reshape(1, obs.shape[0], obs.shape[1]), counter, False
    else:
        (store, count), to_ring = ring, True
        if tuple(store.shape[1:]) != tuple(obs.shape) or np.dtype(store.dtype) != np.float32:
            raise ValueError(f"ring store must be float32 [n_slots, {obs.shape[0]}, {obs.shape[1]}], got "
                             f"{np.dtype(store.dtype)} {list(store.shape)}")
    features_kernel[launch_dims(n * n_feat) + (stream,)](obs, st.cursor, mk.features, store, count, to_ring)
    portfolio_kernel[launch_dims(n * (obs.shape[1] - n_feat)) + (stream,)](
        obs, mask, st, mk, k, branch_sizes, store, count, to_ring)


def launch_step(st, actions, grids, mk, preference, risk_budget, k, lo, hi, seed, counter, out, acc, stream):
    step_kernel[launch_dims(st.cursor.shape[0]) + (stream,)](st, actions, grids, mk, preference, risk_budget, k, np.int64(lo),
                                                             np.int64(hi), seed, counter, out, acc)


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
    mask: object  # uint8 [N, 4, max_actions]: actions available at obs
    next_mask: object  # uint8 [N, 4, max_actions]: actions available at next_obs


class DeviceEnv:
    """N parallel trading envs on the device; every buffer lives in one Arena("env").

    Methods launch kernels on `stream` (default: the process compute stream) and nothing else:
      reset(seed)                 first episodes (host writes seed/counter; call before capture)
      gather(obs=None, mask=None) obs [N, state_dim] and mask [N, 4, max_actions] at the cursors
      step(actions=None, preference=None, risk_budget=None)
                                  one env step; outputs in the views of `transition`/`outputs`;
                                  risk_budget: float32 [1] device ρ (core.py), default the
                                  env's own ones (ρ = 1: the step without R18)
      advance()                   RNG counter += 1 (device)
      collect(policy)             gather -> policy(obs, mask, actions, preference, stream) -> step
                                  -> gather(next_obs, next_mask) -> advance
    Defaults are the arena's own views ("obs", "mask", "actions", "preference"), so the simplest
    graph body is `env.collect(policy, stream)`. The policy (learner side) may key its own random
    draws with the env's `seed_dev` and `counter` (one counter per env step).

    Training-path telemetry: every step also adds each env's bar P&L, closed trades and reward
    terms to `telemetry_acc` (float64 [N_TEL, N], its own Arena("env.telemetry"), so checkpoints
    of the env arena are unchanged); numbarl.env.telemetry.TrainPathTelemetry reads and zeroes it
    once per epoch, reset() zeroes it.
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
        arena.add("mask", (n, params.n_branches, params.max_actions), np.uint8)
        arena.add("next_mask", (n, params.n_branches, params.max_actions), np.uint8)
        arena.add("actions", (n, params.n_branches), np.int32)
        arena.add("preference", (n,), np.float32)
        arena.add("reward", (n,), np.float32)
        arena.add("done", (n,), np.uint8)
        arena.add("bar_pnl", (n,), np.float64)
        arena.add("trade_pnl", (n,), np.float64)
        arena.add("exit_reason", (n,), np.int32)
        arena.add("bar", (n,), np.int32)
        arena.add("next_bar", (n,), np.int32)
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
            arena["obs"], arena["actions"], arena["reward"], arena["done"], arena["next_obs"], arena["bar"], arena["next_bar"],
            arena["bar_pnl"], arena["mask"], arena["next_mask"],
        )
        self.counter = arena["counter"]
        self.seed_dev = arena["seed"]
        # training-path telemetry (numbarl/env/telemetry.py): running sums, env i in column i
        telemetry = Arena("env.telemetry")
        telemetry.add("acc", (N_TEL, n), np.float64)
        telemetry.allocate()  # zeroed
        self.telemetry_arena = telemetry
        self.telemetry_acc = telemetry["acc"]
        # ρ = 1, the default risk budget of `step` (its own arena: checkpoints of the env arena are unchanged)
        ones = Arena("env.risk_budget")
        ones.add("ones", (1,), np.float32)
        ones.allocate()
        ones.load({"ones": np.ones(1, np.float32)})
        self.risk_budget_arena = ones
        self.risk_budget_ones = ones["ones"]

    # -- host-side setup (not for capture) ------------------------------------------------------
    def reset(self, seed: int | None = None, stream=None) -> None:
        """Start every env at an RNG-drawn bar (Kelly/DSR cleared), set the RNG counter to 0 and
        zero the training-path telemetry."""
        if seed is not None:
            self._seed = int(seed)
        self.arena.load({"seed": np.array([self._seed], np.uint64), "counter": np.zeros(1, np.int64)})
        launch_reset(self.state, self.lo, self.hi, self.k, self.seed_dev, self.counter, _s(stream))
        launch_zero(self.telemetry_acc, _s(stream))

    def state_to_host(self) -> dict[str, np.ndarray]:
        """Every state field as numpy (synchronizes; tests and checkpoints)."""
        s = default_stream()
        out = {name: self.arena[name].copy_to_host(stream=s) for name, _ in STATE_FIELDS}
        s.synchronize()
        return out

    # -- launches (capturable) ------------------------------------------------------------------
    def gather(self, obs=None, mask=None, stream=None, ring=None):
        """obs [N, state_dim] and the action mask [N, n_branches, max_actions] (uint8, 1 = allowed)
        at the current cursors; returns (obs, mask). ring: (store, count) of a replay's `obs_ring`,
        whose row count % n_slots gets obs as well."""
        obs = self.arena["obs"] if obs is None else obs
        mask = self.arena["mask"] if mask is None else mask
        _check("obs", obs, (self.n_envs, self.state_dim), np.float32)
        _check("mask", mask, (self.n_envs, self.params.n_branches, self.params.max_actions), np.uint8)
        launch_gather_split(obs, mask, self.state, self.mk, self.k, self.branch_sizes, _s(stream), ring=ring,
                            counter=self.counter)
        return obs, mask

    def step(self, actions=None, preference=None, counter=None, stream=None, risk_budget=None):
        """One step of every env with actions [N, n_branches] int32, preference [N] float32 and the
        risk budget ρ float32 [1] on the device (None: the env's ones, ρ = 1)."""
        actions = self.arena["actions"] if actions is None else actions
        preference = self.arena["preference"] if preference is None else preference
        counter = self.counter if counter is None else counter
        risk_budget = self.risk_budget_ones if risk_budget is None else risk_budget
        _check("actions", actions, (self.n_envs, self.params.n_branches), np.int32)
        _check("preference", preference, (self.n_envs,), np.float32)
        _check("risk_budget", risk_budget, (1,), np.float32)
        launch_step(
            self.state, actions, self.grids, self.mk, preference, risk_budget, self.k, self.lo, self.hi, self.seed_dev, counter,
            self.outputs, self.telemetry_acc, _s(stream),
        )  # fmt: skip
        return self.outputs

    def step_operands(self, risk_budget=None) -> tuple:
        """The arguments of `telemetry_step_row` after (i, actions) and between preference and
        (seed, counter), in its order: (st, grids, mk) and (risk_budget, k, lo, hi, seed, counter, out,
        acc), for a learner's launch that runs the env step of env i in its own thread after choosing
        its actions (numbarl.rl.policies.scheduled_epsilon_greedy_step); the same step as `step`."""
        risk_budget = self.risk_budget_ones if risk_budget is None else risk_budget
        _check("risk_budget", risk_budget, (1,), np.float32)
        return ((self.state, self.grids, self.mk),
                (risk_budget, self.k, np.int64(self.lo), np.int64(self.hi), self.seed_dev, self.counter, self.outputs,
                 self.telemetry_acc))

    def advance(self, stream=None) -> None:
        rng.advance(self.counter, _s(stream))

    def collect(self, policy, stream=None) -> Transition:
        """One collect step: obs, mask -> policy(obs, mask, actions, preference, stream) writes the
        arena's "actions" and "preference" -> step -> next obs and mask -> RNG counter += 1."""
        stream = _s(stream)
        t = self.transition
        # COLLECT
        self.gather(t.obs, t.mask, stream)
        policy(t.obs, t.mask, t.actions, self.arena["preference"], stream)
        self.step(stream=stream)
        self.gather(t.next_obs, t.next_mask, stream)
        self.advance(stream)
        return t


def upload(data: MarketData, params: EnvParams) -> DeviceMarket:
    """Upload market data once for any number of envs/backtests with these params."""
    return data.to_device(params.vol_span, params.vol_horizon_bars)
