"""The exploration risk budget ρ (R18) in the env step (numbarl/env/core.py): the Kelly cap fraction
1 − ρ (1 − frac) and the DSR term ρ · term by hand at ρ = 0, 0.25, 1 (core functions and the CPU
reference env), ρ = 1 bit for bit the arithmetic without ρ, the device step against the CPU reference
at ρ = 0.3, and the DQN agent with agent.iqn handing the env ρ = readiness²."""

import math

import numpy as np
import pytest

from numbarl.env import core
from numbarl.env.params import DIR_FLAT, DIR_LONG, EXIT_CLOSE, EnvParams
from numbarl.env.reference import CpuEnv

# tick 0.25, multiplier 2 -> one tick on one contract = 0.5 currency; every reward term off but DSR
QUIET = dict(sizes=(1.0, 2.0, 4.0), fee_per_contract=0.5, contract_multiplier=2.0, tick_size=0.25,
             trade_reward_scale=0.0, micro_reward_scale=0.0, holding_cost_rate=0.0, churn_penalty_scale=0.0,
             opportunity_cost_scale=0.0, conviction_weight=0.0, kelly_lambda=0.5, kelly_floor=0.25,
             dsr_reward_scale=0.1, dsr_warmup_trades=0, latency_bars=0, slippage_ticks=0.0)
TICK_VALUE = 0.5


def consts(**kw):
    return EnvParams(**{**QUIET, **kw}).step_consts(0.25)


# Kelly accumulators of the hand case: 3 wins of 2, 1 loss of 1 -> p = 0.75, b = 2, f* = 0.625,
# frac = clip(0.5 x 0.625, 0.25, 1) = 0.3125
WINS, LOSSES, SUM_WIN, SUM_LOSS = 3, 1, 6.0, 1.0
# ρ -> the size a size-4 order opens: 4 x (1 − ρ (1 − 0.3125)) rounded down to whole contracts
#   ρ = 1: 4 x 0.3125 = 1.25 -> 1;  ρ = 0.25: 4 x 0.828125 = 3.3125 -> 3;  ρ = 0: 4 (no cap)
KELLY_HAND = {1.0: 1.0, 0.25: 3.0, 0.0: 4.0}
# with no history the fraction is the floor 0.25: ρ = 0.25 -> 0.25 + 0.75 x 0.75 = 0.8125 -> 3.25 -> 3
FLOOR_HAND = {1.0: 1.0, 0.25: 3.0, 0.0: 4.0}


# ---------------------------------------------------------------------------------------------
# the core functions by hand
# ---------------------------------------------------------------------------------------------
def test_fraction_and_dsr_term_by_hand():
    assert core.risk_budget_fraction(0.25, 1.0) == 0.25
    assert core.risk_budget_fraction(0.25, 0.25) == 0.8125
    assert core.risk_budget_fraction(0.25, 0.0) == 1.0
    assert core.risk_budget_fraction(0.3125, 0.25) == 0.828125
    k = consts()
    assert core.dsr_term(2.0, 1.0, k) == 0.1 * 2.0
    assert core.dsr_term(2.0, 0.25, k) == pytest.approx(0.05, abs=1e-17)
    assert core.dsr_term(2.0, 0.0, k) == 0.0


@pytest.mark.parametrize("rho", [1.0, 0.25, 0.0])
def test_kelly_size_by_hand(rho):
    k = consts()
    assert core.kelly_size(4.0, WINS, LOSSES, SUM_WIN, SUM_LOSS, k, rho) == KELLY_HAND[rho]
    assert core.kelly_size(4.0, 0, 0, 0.0, 0.0, k, rho) == FLOOR_HAND[rho]
    assert core.kelly_size(2.0, WINS, LOSSES, SUM_WIN, SUM_LOSS, k, rho) == min(2.0, KELLY_HAND[rho])  # min(size, cap)


def _old_kelly_size(size, wins, losses, sum_win, sum_loss, k):
    """core.kelly_size before the risk budget, line for line (float64 Python arithmetic = @njit's)."""
    f = k.kelly_lambda * core.kelly_fraction(wins, losses, sum_win, sum_loss)
    frac = min(1.0, max(k.kelly_floor, f))
    lots = math.floor(k.max_size * frac / k.size_step * core._LOTS_NUDGE)
    cap = max(float(np.float32(float(lots) * k.size_step)), k.min_size)
    return min(float(size), cap)


def test_full_budget_is_the_old_arithmetic_bit_for_bit(rng):
    """ρ = 1 adds an exact 0 to the fraction and multiplies the DSR term by an exact 1: a few hundred
    random accumulators, coefficients and fractions (small ones too, where 1 − (1 − frac) would round)."""
    fracs = np.concatenate([rng.random(200), 10.0 ** rng.uniform(-12, 0, 100)])
    for frac in fracs:
        assert core.risk_budget_fraction(frac, 1.0) == frac
    for _ in range(300):
        k = consts(kelly_lambda=float(rng.uniform(0.01, 2.0)), kelly_floor=float(rng.uniform(0.0, 1.0)),
                   sizes=(0.001, 0.003, 0.01), size_step=0.001, dsr_reward_scale=float(rng.uniform(0, 1)))
        wins, losses = (int(x) for x in rng.integers(0, 20, 2))
        sum_win, sum_loss = float(rng.uniform(0, 50) * (wins > 0)), float(rng.uniform(0, 50) * (losses > 0))
        size = float(np.float32(rng.choice([0.001, 0.003, 0.01])))
        new = core.kelly_size(size, wins, losses, sum_win, sum_loss, k, 1.0)
        assert np.float64(new).tobytes() == np.float64(_old_kelly_size(size, wins, losses, sum_win, sum_loss, k)).tobytes()
        d = float(rng.standard_normal() * 10.0 ** rng.uniform(-5, 5))
        assert np.float64(core.dsr_term(d, 1.0, k)).tobytes() == np.float64(k.dsr_scale * d).tobytes()


# ---------------------------------------------------------------------------------------------
# the step (core.step_core) and the CPU reference env
# ---------------------------------------------------------------------------------------------
def _portfolio(position=0.0, entry_price=0.0, kelly=(0, 0, 0.0, 0.0), dsr=(0.0, 0.0)):
    s = core.initial_portfolio(10)
    kw, kl, ksw, ksl = kelly
    return core.make_portfolio(
        s.cursor, 1, position, entry_price, 9 if position else s.entry_bar, 1 if position else 0, 0.0, 0.0, 0.0, 0.0,
        s.last_entry_bar, s.realized, s.unrealized, s.trade_count, kw, kl, ksw, ksl, dsr[0], dsr[1], s.pending_due,
        s.pending_dir, s.pending_size, s.pending_target, s.pending_stop,
    )  # fmt: skip


def _bars():
    return core.make_bars(100.0, 99.875, 100.125, 0.5, 100.5, 100.375, 100.625, 100.75, 100.0)


@pytest.mark.parametrize("rho", [1.0, 0.25, 0.0])
def test_step_core_scales_the_kelly_cap_and_the_dsr_term(rho):
    k = consts()
    # an opening order (latency 0: filled at this bar's ask) at the loosened cap
    s = _portfolio(kelly=(WINS, LOSSES, SUM_WIN, SUM_LOSS))
    s2, out, _, _ = core.step_core(s, DIR_LONG, 4.0, 0.0, 0.0, _bars(), np.float32(0), np.float64(rho), k, 1000)
    assert s2.position == KELLY_HAND[rho] and out.kelly_ratio == KELLY_HAND[rho] / 4.0
    # a close with the DSR EMAs at A = 0, B = 1: D = r (the trade's return in ticks), the term ρ · 0.1 r
    s = _portfolio(position=1.0, entry_price=99.0, dsr=(0.0, 1.0))
    s2, out, t1, _ = core.step_core(s, DIR_FLAT, 1.0, 0.0, 0.0, _bars(), np.float32(0), np.float64(rho), k, 1000)
    r = t1.pnl / TICK_VALUE  # sold at the bid 99.875: (0.875 x 2 - 2 x 0.5) / 0.5 = 1.5 ticks
    assert t1.reason == EXIT_CLOSE and r == 1.5
    assert out.r_dsr == 0.1 * r * rho and out.reward == out.r_dsr  # every other term is off
    assert (s2.dsr_a, s2.dsr_b) == (0.01 * r, 1.0 + 0.01 * (r * r - 1.0))  # the EMAs move whatever ρ is


def test_nan_budget_is_full_protection():
    """A NaN ρ (a broken readiness) counts as ρ = 1: today's Kelly cap and DSR term, not none."""
    k = consts()
    s = _portfolio(kelly=(WINS, LOSSES, SUM_WIN, SUM_LOSS))
    s2, out, _, _ = core.step_core(s, DIR_LONG, 4.0, 0.0, 0.0, _bars(), np.float32(0), np.float64(np.nan), k, 1000)
    assert s2.position == KELLY_HAND[1.0]
    s = _portfolio(position=1.0, entry_price=99.0, dsr=(0.0, 1.0))
    _, out, _, _ = core.step_core(s, DIR_FLAT, 1.0, 0.0, 0.0, _bars(), np.float32(0), np.float64(np.nan), k, 1000)
    assert out.r_dsr == 0.1 * 1.5


def test_zero_budget_no_dsr_term_and_no_cap():
    """ρ = 0: the DSR term is 0 whatever D is, and every order opens its full size (the cap is max size)."""
    k = consts(kelly_lambda=2.0, kelly_floor=0.0)
    for kelly in ((0, 0, 0.0, 0.0), (WINS, LOSSES, SUM_WIN, SUM_LOSS), (1, 9, 1.0, 30.0)):
        for size in (1.0, 2.0, 4.0):
            s2, out, _, _ = core.step_core(_portfolio(kelly=kelly), DIR_LONG, size, 0.0, 0.0, _bars(), np.float32(0),
                                           np.float64(0.0), k, 1000)
            assert s2.position == size and out.kelly_ratio == 1.0
    for entry in (95.0, 99.0, 104.0):
        s = _portfolio(position=1.0, entry_price=entry, dsr=(0.3, 1.5))
        _, out, t1, _ = core.step_core(s, DIR_FLAT, 1.0, 0.0, 0.0, _bars(), np.float32(0), np.float64(0.0), k, 1000)
        assert t1.reason == EXIT_CLOSE and core.dsr_update(0.3, 1.5, t1.pnl / TICK_VALUE, 0.01)[0] != 0.0
        assert out.r_dsr == 0.0 and out.reward == 0.0


@pytest.mark.parametrize("rho", [1.0, 0.25, 0.0])
def test_cpu_reference_env_by_hand(rho, make_market, rng):
    """The CPU env at ρ: a flat env with the hand case's Kelly history opens KELLY_HAND[ρ] of a
    size-4 order; an env long one contract with DSR EMAs (0, 1) closes and is rewarded ρ · 0.1 r."""
    data = make_market(rng, n_bars=40)
    params = EnvParams(**QUIET, vol_span=10, vol_horizon_bars=3)
    env = CpuEnv(data, params, 2, bar_range=(0, 40), seed=1)
    env.reset()
    st = env.state
    st.kelly_wins[0], st.kelly_losses[0], st.kelly_sum_win[0], st.kelly_sum_loss[0] = WINS, LOSSES, SUM_WIN, SUM_LOSS
    c = int(st.cursor[1])
    st.position[1], st.entry_price[1], st.entry_bar[1], st.bars_in_trade[1] = 1.0, data.mid[c] - 1.0, c - 1, 1
    st.dsr_a[1], st.dsr_b[1] = 0.0, 1.0
    actions = np.array([[DIR_LONG, 2, 0, 0], [DIR_FLAT, 0, 0, 0]], np.int32)  # size index 2: 4 contracts
    reward, _ = env.step(actions, np.zeros(2, np.float32), risk_budget=rho)
    assert env.risk_budget[0] == np.float32(rho)
    assert st.position[0] == KELLY_HAND[rho]
    r = env.out.trade_pnl[1] / TICK_VALUE
    assert env.out.exit_reason[1] == EXIT_CLOSE and reward[1] == np.float32(0.1 * r * rho)
    assert reward[0] == 0.0  # no trade closed: no DSR term, every other term off


# ---------------------------------------------------------------------------------------------
# the device step against the CPU reference
# ---------------------------------------------------------------------------------------------
def test_device_step_matches_reference_at_rho_0_3(rng, make_market):
    """Simulator: a handful of envs, a few steps with the Kelly cap and the DSR term on and ρ = 0.3
    in a device float32 [1]: every output and state field equals the CPU env's stepped at ρ = 0.3."""
    from numbarl.cuda.runtime import cuda
    from numbarl.env.device import DeviceEnv
    from numbarl.env.state import STATE_FIELDS

    data = make_market(rng, n_bars=50)
    params = EnvParams(sizes=(1.0, 2.0, 4.0), episode_length=5, max_episode_bars=15, vol_span=10, vol_horizon_bars=3,
                       targets=(0.0, 0.5, 1.0), stops=(0.0, 0.5, 1.0), kelly_lambda=0.5, kelly_floor=0.25,
                       dsr_reward_scale=0.1, latency_bars=0)
    n_envs, n_steps, seed = 4, 12, int(rng.integers(1 << 31))
    cpu = CpuEnv(data, params, n_envs, bar_range=(3, 46), seed=seed)
    dev = DeviceEnv(data, params, n_envs, bar_range=(3, 46), seed=seed)
    rho_dev = cuda().to_device(np.array([0.3], np.float32))
    cpu.reset()
    dev.reset()
    n_closed = 0
    for t in range(n_steps):
        actions = np.stack([rng.integers(0, n, n_envs) for n in params.branch_sizes], 1).astype(np.int32)
        pref = rng.standard_normal(n_envs).astype(np.float32)
        dev.arena["actions"].copy_to_device(actions)
        dev.arena["preference"].copy_to_device(pref)
        dev.step(risk_budget=rho_dev)
        cpu.step(actions, pref, risk_budget=0.3)
        for name in dev.outputs._fields:  # the same arithmetic under the simulator
            np.testing.assert_array_equal(getattr(dev.outputs, name).copy_to_host(), getattr(cpu.out, name),
                                          err_msg=f"{name} step {t}")
        state = dev.state_to_host()
        for name, _ in STATE_FIELDS:
            np.testing.assert_array_equal(state[name], getattr(cpu.state, name), err_msg=f"state {name} step {t}")
        dev.advance()
        cpu.advance()
        n_closed += int((cpu.out.exit_reason != 0).sum())
    assert n_closed > 0  # the run closed trades (the Kelly and DSR accumulators moved)


# ---------------------------------------------------------------------------------------------
# the agent path: agent.iqn hands the env ρ = readiness²
# ---------------------------------------------------------------------------------------------
def test_dqn_agent_with_iqn_passes_readiness_squared(make_market, rng):
    from numbarl.config import AgentConfig
    from numbarl.cuda.runtime import stream
    from numbarl.env.device import DeviceEnv
    from numbarl.rl.agents.dqn import DQNAgent
    from numbarl.rl.cvar_gate import budget_ref

    s = stream()
    params = EnvParams(sizes=(1.0, 2.0), vol_span=10, vol_horizon_bars=3, kelly_lambda=0.5, dsr_reward_scale=0.1)
    env = DeviceEnv(make_market(rng, n_bars=60), params, 2, bar_range=(0, 50), seed=2)
    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=16, n_step=1, iqn=True, risk_budget=True,
                      iqn_quantiles=3, iqn_embed=4)
    agent = DQNAgent(cfg, env.state_dim, params.branch_sizes, 2, 3, eval_batch=1)
    seen = []
    operands = env.step_operands  # the collect step's one launch takes the env step's operands from here

    def spy(risk_budget=None):  # the array the env step reads, at the time its launch is queued
        seen.append(None if risk_budget is None else risk_budget.copy_to_host()[0])
        return operands(risk_budget)

    env.step_operands = spy
    env.reset(2, s)
    for state in ((-1.0, -1.0), (2.0, 1.0), (3.0, 2.0), (1.0, 4.0)):  # no IQN step yet, readiness 1/2, 1/3, 0
        agent.iqn_state.load({"readiness_state": np.array(state, np.float64)})
        agent.collect_step(env, s)
        s.synchronize()
        want = np.float32(budget_ref(np.array(state)))
        assert seen[-1] == want and agent.read_stats(s)["risk_budget"] == want
    assert seen[1] == np.float32(0.25)
    for state in ((np.nan, -1.0), (2.0, np.nan), (np.inf, 1.0)):  # a NaN IQN loss, first or later: ρ = 1
        agent.iqn_state.load({"readiness_state": np.array(state, np.float64)})
        agent.collect_step(env, s)
        s.synchronize()
        assert seen[-1] == 1.0 and agent.read_stats(s)["risk_budget"] == 1.0
