"""Exploration policies: the learner's side of the env boundary (SPEC §2.0, numbarl/env/__init__.py).

The env publishes, per env i, the observation and the action mask ``mask[i, b, a]`` (uint8, 1 =
action a of branch b is available: the direction lock, the branch sizes) and takes back the
actions ``actions[i, b]`` and a ``preference[i]`` for its opportunity cost. A policy turns the
agent's action scores into those two; the env never sees the scores.

Epsilon-greedy per branch (``epsilon_greedy``), independently for each branch b of env i::

    greedy_b   = first argmax_a q[i, b, a] over {a : mask[i, b, a] = 1}   (NaN never wins;
                 numbarl.env.rows.greedy_action, which the backtest runs too)
    explore_b  = uniform(seed, lane=i, counter, SLOT_EXPLORE + b) < epsilon_i
    actions[i, b] = explore_b ? the r-th action allowed by explore[i, b, :], r = randint(seed, i,
                                counter, SLOT_RANDOM + b, #allowed) : greedy_b
    preference[i] = q[i, direction, long] - q[i, direction, short]       (C51: the gap of the
                                                                           expected returns)

so exploration respects a mask as the greedy choice does: ``explore`` is ``mask`` unless the
caller passes another (the DQN learner's entry gates narrow the greedy choice's mask only and let
exploration draw from the env's own: numbarl/rl/cvar_gate.py). Greedy is epsilon 0 (the coin is
drawn and never wins). RNG keys: the env's seed and step counter (numbarl/cuda/rng.py), lane =
env; the slots keep the numbers they had when this code lived in the env (0-3 and 4-7), so
recorded runs reproduce bit for bit.

Thread mapping: one thread per env (4 branches x max_actions Q reads and mask reads each).
The CPU reference (``epsilon_greedy_ref``) loops the same row function over envs.
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda import rng
from numbarl.cuda.launch import blocks, device_function
from numbarl.cuda.registry import RNG_STREAMS
from numbarl.cuda.runtime import cuda
from numbarl.env.params import BR_DIRECTION, DIR_LONG, DIR_SHORT
from numbarl.env.rows import greedy_action
from numbarl.env.state import row_jit
from numbarl.env.telemetry import telemetry_step_row
from numbarl.rl.replay import write_row

_cuda = cuda()

BLOCK = 128  # one env per thread

# RNG slots (registered by name; the numbers are fixed so recorded results reproduce)
SLOT_EXPLORE = RNG_STREAMS.claim("explore.coin", 0, width=4)  # + branch: exploration coin of branch b
SLOT_RANDOM = RNG_STREAMS.claim("explore.action", 4, width=4)  # + branch: random action of branch b


# ---------------------------------------------------------------------------------------------
# the row function (CPU reference loop and kernel)
# ---------------------------------------------------------------------------------------------
@row_jit
def epsilon_greedy_row(q, mask, explore, i, epsilon, seed, counter, actions, preference):
    """actions[i, :] and preference[i] of env i (see the module docstring): greedy over mask, the
    exploratory draw over explore (the same array for a plain ε-greedy)."""
    for b in range(actions.shape[1]):
        chosen = greedy_action(q, mask, i, b)
        if rng.uniform(seed, i, counter, SLOT_EXPLORE + b) < epsilon:
            n_valid = 0
            for a in range(explore.shape[2]):
                if explore[i, b, a] != 0:
                    n_valid += 1
            r = rng.randint(seed, i, counter, SLOT_RANDOM + b, n_valid)
            seen = 0
            for a in range(explore.shape[2]):
                if explore[i, b, a] == 0:
                    continue
                if seen == r:
                    chosen = a
                    break
                seen += 1
        actions[i, b] = chosen
    preference[i] = q[i, BR_DIRECTION, DIR_LONG] - q[i, BR_DIRECTION, DIR_SHORT]


@row_jit
def scheduled_epsilon(t, schedule, decay_steps):
    """The exploration rate at collect step t: max(end, start − (start − end)·t/decay), linear in
    float64, rounded once to float32. schedule = (start, end) float32 and decay_steps int64 [1] are
    device scalars (a feedback loop changes them between replays without re-capture); every
    thread of `scheduled_epsilon_greedy_kernel` and the learner's collect-tail kernel compute it
    with these same operations, so they agree to the bit."""
    frac = min(np.float64(t) / np.float64(decay_steps[0]), np.float64(1.0))
    return np.float32(schedule[0] + (schedule[1] - schedule[0]) * frac)


# ---------------------------------------------------------------------------------------------
# reference: the same row function in a CPU loop
# ---------------------------------------------------------------------------------------------
@row_jit
def _epsilon_greedy_loop(q, mask, explore, epsilon, seed, counter, actions, preference):
    n_eps = epsilon.shape[0]
    for i in range(q.shape[0]):
        eps = epsilon[i] if n_eps > 1 else epsilon[0]
        epsilon_greedy_row(q, mask, explore, i, eps, seed, counter, actions, preference)


def epsilon_greedy_ref(q, mask, epsilon, seed, counter, explore=None) -> tuple[np.ndarray, np.ndarray]:
    """(actions [N, n_branches] int32, preference [N] float32) on the CPU; epsilon: a scalar or [N];
    explore: the exploratory draw's mask (None: mask)."""
    q = np.ascontiguousarray(q, np.float32)
    mask = np.ascontiguousarray(mask, np.uint8)
    _check_shapes(q, mask)
    explore = mask if explore is None else np.ascontiguousarray(explore, np.uint8)
    _check_shapes(q, explore)
    eps = np.atleast_1d(np.asarray(epsilon, np.float32))
    actions = np.empty(q.shape[:2], np.int32)
    preference = np.empty(q.shape[0], np.float32)
    _epsilon_greedy_loop(q, mask, explore, eps, np.uint64(seed), np.int64(counter), actions, preference)
    return actions, preference


# ---------------------------------------------------------------------------------------------
# kernel and launcher
# ---------------------------------------------------------------------------------------------
_epsilon_greedy_row = device_function(epsilon_greedy_row)


@_cuda.jit(cache=True)
def epsilon_greedy_kernel(q, mask, epsilon, seed, counter, actions, preference):
    i = _cuda.grid(1)
    if i >= q.shape[0]:
        return
    eps = epsilon[i] if epsilon.shape[0] > 1 else epsilon[0]
    _epsilon_greedy_row(q, mask, mask, i, eps, seed[0], counter[0], actions, preference)


_scheduled_epsilon = device_function(scheduled_epsilon)


@_cuda.jit(cache=True)
def scheduled_epsilon_greedy_kernel(q, mask, explore, step, schedule, decay_steps, seed, counter, actions, preference):
    """epsilon_greedy_kernel with the rate of collect step step[0] computed in every thread (no
    one-thread schedule kernel before it; whoever advances step[0] does so after this launch)."""
    i = _cuda.grid(1)
    if i >= q.shape[0]:
        return
    eps = _scheduled_epsilon(step[0], schedule, decay_steps)
    _epsilon_greedy_row(q, mask, explore, i, eps, seed[0], counter[0], actions, preference)


_telemetry_step_row = device_function(telemetry_step_row)
_write_row = device_function(write_row)


@_cuda.jit(cache=True)
def scheduled_epsilon_greedy_step_kernel(q, mask, explore, step, schedule, decay_steps, actions, preference, st,
                                         grids, mk, risk_budget, k, lo, hi, seed, counter, out, acc, action_store,
                                         reward_store, done_store, weight_store, mask_store, count):
    """scheduled_epsilon_greedy_kernel, then in the same thread env i's step (the env's
    `telemetry_step_row` on the actions just chosen) and its replay row (`write_row`: actions,
    reward, done, weight 1, mask): the launches of ε-greedy, the env step and the replay's row write
    in one. Each thread reads and writes env i's entries only, in the order the three launches did."""
    i = _cuda.grid(1)
    if i >= q.shape[0]:
        return
    eps = _scheduled_epsilon(step[0], schedule, decay_steps)
    _epsilon_greedy_row(q, mask, explore, i, eps, seed[0], counter[0], actions, preference)
    _telemetry_step_row(st, i, actions, grids, mk, preference, risk_budget, k, lo, hi, seed[0], counter[0], out, acc)
    _write_row(action_store, reward_store, done_store, weight_store, mask_store, count[0] % action_store.shape[0], i,
               actions, out.reward, out.done, out.reward, False, mask, True)


def _check_shapes(q, mask) -> None:
    if q.ndim != 3 or tuple(mask.shape) != tuple(q.shape):
        raise ValueError(f"q [N, n_branches, max_actions] and the env's mask must have one shape, "
                         f"got q {list(q.shape)} and mask {list(mask.shape)}")


def _check_io(q, mask, actions, preference) -> int:
    """The launchers' checks of q, the mask and the outputs; returns N."""
    _check_shapes(q, mask)
    n = q.shape[0]
    if np.dtype(q.dtype) != np.float32 or np.dtype(mask.dtype) != np.uint8:
        raise ValueError(f"q must be float32 and mask uint8, got {q.dtype} and {mask.dtype}")
    if tuple(actions.shape) != tuple(q.shape[:2]) or np.dtype(actions.dtype) != np.int32:
        raise ValueError(f"actions must be int32 {list(q.shape[:2])}, got {actions.dtype} {list(actions.shape)}")
    if tuple(preference.shape) != (n,) or np.dtype(preference.dtype) != np.float32:
        raise ValueError(f"preference must be float32 [{n}], got {preference.dtype} {list(preference.shape)}")
    return n


def _explore_mask(q, mask, explore):
    """The exploratory draw's mask: mask itself, or a uint8 array of its shape."""
    if explore is None:
        return mask
    if tuple(explore.shape) != tuple(q.shape) or np.dtype(explore.dtype) != np.uint8:
        raise ValueError(f"explore (the exploratory draw's mask) must be uint8 {list(q.shape)} like the mask, "
                         f"got {explore.dtype} {list(explore.shape)}")
    return explore


def _check_schedule(schedule) -> None:
    if np.dtype(schedule.dtype) != np.float32 or tuple(schedule.shape) != (2,):
        raise ValueError(f"schedule must be float32 [2] (start, end), got {schedule.dtype} {list(schedule.shape)}")


def epsilon_greedy(q, mask, epsilon, seed, counter, actions, preference, stream) -> None:
    """Enqueue epsilon-greedy actions from q [N, n_branches, max_actions] float32 over the env's
    mask (uint8, same shape) into actions [N, n_branches] int32 and preference [N] float32.
    epsilon: device float32 [1] or [N]; seed: device uint64 [1]; counter: device int64 [1] (the
    env's `seed_dev` and `counter`). Only launches: capturable."""
    n = _check_io(q, mask, actions, preference)
    if np.dtype(epsilon.dtype) != np.float32 or epsilon.shape[0] not in (1, n):
        raise ValueError(f"epsilon must be float32 [1] or [{n}], got {epsilon.dtype} {list(epsilon.shape)}")
    epsilon_greedy_kernel[blocks(n, BLOCK), min(BLOCK, n), stream](q, mask, epsilon, seed, counter, actions, preference)


def scheduled_epsilon_greedy(q, mask, step, schedule, decay_steps, seed, counter, actions, preference, stream,
                             explore=None) -> None:
    """epsilon_greedy at the rate `scheduled_epsilon(step[0], schedule, decay_steps)` (device int64
    [1], float32 [2], int64 [1]), computed inside the launch; the same actions and preference as
    epsilon_greedy with epsilon = [that rate]. explore: the exploratory draw's mask (None: mask;
    the module docstring). Only launches: capturable."""
    n = _check_io(q, mask, actions, preference)
    explore = _explore_mask(q, mask, explore)
    _check_schedule(schedule)
    scheduled_epsilon_greedy_kernel[blocks(n, BLOCK), min(BLOCK, n), stream](
        q, mask, explore, step, schedule, decay_steps, seed, counter, actions, preference)


def scheduled_epsilon_greedy_step(q, mask, step, schedule, decay_steps, actions, preference, env, replay, stream,
                                  risk_budget=None, explore=None):
    """One launch for three: `scheduled_epsilon_greedy` into actions and preference, then
    `env.step(actions, preference, risk_budget=risk_budget)` (a DeviceEnv), then the replay's row of this
    step without the obs (`replay.write(obs, actions, reward, done, mask=mask, obs_written=True,
    advance=False)`): the same values in every array, for a collect step with nothing between the
    policy and the env step. seed and counter are the env's. explore: the exploratory draw's mask (None:
    mask; the replay stores mask, the one the greedy choice saw). Returns the env's outputs. Only
    launches: capturable."""
    n = _check_io(q, mask, actions, preference)
    explore = _explore_mask(q, mask, explore)
    _check_schedule(schedule)
    if n != env.n_envs or replay.n_envs != n:
        raise ValueError(f"q has {n} envs, the env {env.n_envs} and the replay {replay.n_envs}")
    (st, grids, mk), tail = env.step_operands(risk_budget)
    scheduled_epsilon_greedy_step_kernel[blocks(n, BLOCK), min(BLOCK, n), stream](
        q, mask, explore, step, schedule, decay_steps, actions, preference, st, grids, mk, *tail, *replay.row_stores())
    return env.outputs
