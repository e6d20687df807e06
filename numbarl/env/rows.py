"""Row functions: env i of structure-of-arrays buffers, for the CPU loops and the kernels.

Each ``*_row`` function reads or writes the state of one env (or one observation element) in the
structure-of-arrays buffers; the CPU reference env calls them from @njit loops and the numba.cuda
kernels through ``numbarl.cuda.launch.device_function`` (the same Python source compiled as a CUDA
device function). They wrap the step math of core.py, which is written once.

The env's rules that constrain the agent are published as data here: ``mask_row`` writes the
action mask (branch sizes and the direction lock) beside the observation, and ``greedy_action`` is
the greedy choice over it (the backtest's policy; numbarl/rl/policies.py's epsilon-greedy builds on
it). numbarl/env/__init__.py documents the observation / action / mask / preference contract.
"""


from __future__ import annotations

import numpy as np
from numba import njit

from numbarl.cuda.runtime import cuda
from numbarl.env.core import SLOT_INIT, SLOT_RESET, env_transition, kelly_fraction, reset_start, side_of  # noqa: F401
from numbarl.env.params import (
    BR_DIRECTION,
    DIR_LONG,
    DIR_SHORT,
)
from numbarl.env.state import (  # noqa: F401
    STATE_FIELDS,
    Grids,
    MarketArrays,
    StateArrays,
    StepArrays,
    initial_portfolio,
    make_bars,
    make_portfolio,
    row_jit,
)

cuda()  # the backend (GPU or simulator), selected once

_F0 = np.float64(0.0)
_F1 = np.float64(1.0)
_NEG_INF32 = np.float32(-np.inf)


# ---------------------------------------------------------------------------------------------
# row functions: env i of structure-of-arrays buffers (CPU loops and kernels)
# ---------------------------------------------------------------------------------------------
@row_jit
def load_row(st, i):
    """Portfolio of env i from StateArrays."""
    return make_portfolio(
        st.cursor[i], st.ep_len[i], st.position[i], st.entry_price[i], st.entry_bar[i],
        st.bars_in_trade[i], st.plan_target[i], st.plan_stop[i], st.target_level[i],
        st.stop_level[i], st.last_entry_bar[i], st.realized[i], st.unrealized[i],
        st.trade_count[i], st.kelly_wins[i], st.kelly_losses[i], st.kelly_sum_win[i],
        st.kelly_sum_loss[i], st.dsr_a[i], st.dsr_b[i], st.pending_due[i], st.pending_dir[i],
        st.pending_size[i], st.pending_target[i], st.pending_stop[i],
    )  # fmt: skip


@row_jit
def store_row(st, i, s):
    st.cursor[i] = s.cursor
    st.ep_len[i] = s.ep_len
    st.position[i] = s.position
    st.entry_price[i] = s.entry_price
    st.entry_bar[i] = s.entry_bar
    st.bars_in_trade[i] = s.bars_in_trade
    st.plan_target[i] = s.plan_target
    st.plan_stop[i] = s.plan_stop
    st.target_level[i] = s.target_level
    st.stop_level[i] = s.stop_level
    st.last_entry_bar[i] = s.last_entry_bar
    st.realized[i] = s.realized
    st.unrealized[i] = s.unrealized
    st.trade_count[i] = s.trade_count
    st.kelly_wins[i] = s.kelly_wins
    st.kelly_losses[i] = s.kelly_losses
    st.kelly_sum_win[i] = s.kelly_sum_win
    st.kelly_sum_loss[i] = s.kelly_sum_loss
    st.dsr_a[i] = s.dsr_a
    st.dsr_b[i] = s.dsr_b
    st.pending_due[i] = s.pending_due
    st.pending_dir[i] = s.pending_dir
    st.pending_size[i] = s.pending_size
    st.pending_target[i] = s.pending_target
    st.pending_stop[i] = s.pending_stop


@row_jit
def load_bars(mk, c):
    """Bars for the step from bar c to c + 1."""
    return make_bars(mk.mid[c], mk.bid[c], mk.ask[c], mk.vol[c], mk.mid[c + 1], mk.bid[c + 1], mk.ask[c + 1], mk.high[c + 1], mk.low[c + 1])


@row_jit
def reset_row(st, i, lo, hi, k, seed, counter):
    """First episode of env i: fresh portfolio at an RNG-drawn start."""
    start = reset_start(seed, i, counter, SLOT_INIT, lo, hi, k.episode_length)
    store_row(st, i, initial_portfolio(start))


@row_jit
def store_out(out, i, o, bar, next_bar):
    """Env i's step outputs (a StepOut) into the StepArrays `out`, with the bar it stepped from and
    the cursor it ended on."""
    out.reward[i] = o.reward
    out.done[i] = o.done
    out.bar_pnl[i] = o.bar_pnl
    out.trade_pnl[i] = o.trade_pnl
    out.exit_reason[i] = o.exit_reason
    out.bar[i] = bar
    out.next_bar[i] = next_bar


@row_jit
def env_step_row(st, i, actions, grids, mk, preference, risk_budget, k, lo, hi, seed, counter, out):
    """Training env step of env i: decode actions[i], step, soft reset on done, write outputs.
    risk_budget: float32 [1], ρ of every env (core.py's module docstring; ones: unchanged).
    Returns (StepOut, first closed Trade, second closed Trade) for the training-path telemetry
    (numbarl/env/telemetry.py); callers that only step ignore it."""
    s = load_row(st, i)
    c = s.cursor
    direction = actions[i, 0]
    size = grids.sizes[actions[i, 1]]
    target_mult = grids.targets[actions[i, 2]]
    stop_mult = grids.stops[actions[i, 3]]
    bars = load_bars(mk, c)
    s2, o, t1, t2 = env_transition(s, direction, size, target_mult, stop_mult, bars, preference[i], risk_budget[0], k, lo, hi,
                                    seed, i, counter)
    store_row(st, i, s2)
    store_out(out, i, o, c, s2.cursor)
    return o, t1, t2


@row_jit
def portfolio_feature(st, i, which, mid, vol, k):
    """Portfolio observation `which` (params.PORTFOLIO_FEATURES order) of env i at its cursor."""
    pos = np.float64(st.position[i])
    side = np.float64(side_of(pos))
    if which == 0:
        return pos / k.max_size
    if which == 1:
        if pos == _F0:
            return _F0
        return (mid - st.entry_price[i]) * side / vol
    if which == 2:
        return np.float64(st.bars_in_trade[i]) / k.obs_hold_bars
    if which == 3:
        if pos == _F0 or st.plan_target[i] <= 0:
            return _F0
        return (st.target_level[i] - mid) * side / vol
    if which == 4:
        if pos == _F0 or st.plan_stop[i] <= 0:
            return _F0
        return (mid - st.stop_level[i]) * side / vol
    if which == 5:
        return _F1 if st.pending_due[i] >= 0 else _F0
    if which == 6:
        return kelly_fraction(st.kelly_wins[i], st.kelly_losses[i], st.kelly_sum_win[i], st.kelly_sum_loss[i])
    # which == 7: churn pressure
    if k.churn_bars <= _F0:
        return _F0
    gap = np.float64(np.int64(st.cursor[i]) - np.int64(st.last_entry_bar[i]))
    return max(_F0, _F1 - gap / k.churn_bars)


@row_jit
def gather_row(obs, mask, e, st, mk, k, branch_sizes):
    """obs element e of the flattened [N, state_dim] observation: features[cursor, j] for j < F,
    then the portfolio features; the same thread also writes env i's mask elements j, j +
    state_dim, ... (`mask_row`), so one launch publishes both."""
    state_dim = obs.shape[1]
    i = e // state_dim
    j = e - i * state_dim
    c = st.cursor[i]
    n_feat = mk.features.shape[1]
    if j < n_feat:
        obs[i, j] = mk.features[c, j]
    else:
        obs[i, j] = np.float32(portfolio_feature(st, i, j - n_feat, mk.mid[c], mk.vol[c], k))
    m = j
    while m < mask.shape[1] * mask.shape[2]:
        mask_row(mask, i, m, st.position[i], k.direction_lock, branch_sizes)
        m += state_dim


@row_jit
def gather_portfolio_row(obs, mask, e, st, mk, k, branch_sizes):
    """The part of `gather_row` after the market features, for element e of the flattened
    [N, PORTFOLIO_DIM] portfolio block: env i's portfolio feature p, and its mask elements p,
    p + PORTFOLIO_DIM, ... The device gather splits in two launches (the market features are a
    plain copy, `numbarl/env/device.py`); the values are the ones `gather_row` writes."""
    n_feat = mk.features.shape[1]
    n_port = obs.shape[1] - n_feat
    i = e // n_port
    p = e - i * n_port
    c = st.cursor[i]
    obs[i, n_feat + p] = np.float32(portfolio_feature(st, i, p, mk.mid[c], mk.vol[c], k))
    m = p
    while m < mask.shape[1] * mask.shape[2]:
        mask_row(mask, i, m, st.position[i], k.direction_lock, branch_sizes)
        m += n_port


# ---------------------------------------------------------------------------------------------
# action masks: the env's rules, published as data (numbarl/env/__init__.py has the contract)
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def direction_allowed(direction, position, direction_lock):
    """Direction lock: mid-plan the opposite direction is not an action (hold or close only)."""
    if direction_lock == 0 or position == 0:
        return True
    if position > 0:
        return direction != DIR_SHORT
    return direction != DIR_LONG


@row_jit
def mask_row(mask, i, m, position, direction_lock, branch_sizes):
    """mask[i, b, a] (flattened m = b * max_actions + a) = 1 when action a of branch b is available
    to env i holding `position`: a inside the branch, and for the direction branch allowed by the
    lock. The one place the rule is applied: policies and learners read the mask."""
    n_act = mask.shape[2]
    b = m // n_act
    a = m - b * n_act
    ok = a < branch_sizes[b]
    if ok and b == BR_DIRECTION:
        ok = direction_allowed(a, position, direction_lock)
    mask[i, b, a] = np.uint8(1) if ok else np.uint8(0)


@row_jit
def greedy_action(q, mask, i, b):
    """The first maximum of q[i, b, :] over the actions mask[i, b, :] allows (NaN never wins; if
    every allowed Q is NaN, the first allowed action; -1 when none is allowed). The backtest's
    choice, and the greedy part of numbarl.rl.policies.epsilon_greedy: written once."""
    best = _NEG_INF32
    best_a = -1
    for a in range(mask.shape[2]):
        if mask[i, b, a] == 0:
            continue
        v = q[i, b, a]
        if best_a < 0:
            best_a = a
        if v > best:
            best = v
            best_a = a
    return best_a
