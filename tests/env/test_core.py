"""Hand-computed cases for the env's step function and each reward term (numbarl/env/core.py)."""

import math

import numpy as np
import pytest

from numbarl.cuda import rng as crng
from numbarl.env import core
from numbarl.env.market import MarketData, causal_volatility
from numbarl.env.params import (
    DIR_FLAT,
    DIR_LONG,
    DIR_SHORT,
    EXIT_CAP,
    EXIT_CLOSE,
    EXIT_END,
    EXIT_NONE,
    EXIT_STOP,
    EXIT_TARGET,
    NO_BAR,
    PORTFOLIO_DIM,
    EnvParams,
)
from numbarl.env.reference import CpuEnv

# tick 0.25, multiplier 2 -> one tick on one contract = 0.5 currency
QUIET = dict(
    sizes=(1.0, 2.0),
    fee_per_contract=0.5,
    contract_multiplier=2.0,
    tick_size=0.25,
    trade_reward_scale=0.0,
    micro_reward_scale=0.0,
    holding_cost_rate=0.0,
    churn_penalty_scale=0.0,
    opportunity_cost_scale=0.0,
    conviction_weight=0.0,
)


def consts(**kw):
    return EnvParams(**{**QUIET, **kw}).step_consts(0.25)


def bars(mid_c=100.0, spread_c=0.25, vol_c=0.5, mid_n=100.5, spread_n=0.25, high_n=100.75, low_n=100.0):
    return core.make_bars(mid_c, mid_c - spread_c / 2, mid_c + spread_c / 2, vol_c, mid_n, mid_n - spread_n / 2, mid_n + spread_n / 2, high_n, low_n)


def step(s, direction, size=1.0, target=0.0, stop=0.0, b=None, preference=0.0, k=None, last_bar=1000, risk_budget=1.0):
    return core.step_core(s, direction, size, target, stop, bars() if b is None else b, np.float32(preference),
                          np.float64(risk_budget), k or consts(), last_bar)


def long_position(cursor=10, size=2.0, entry=100.125, plan_target=0.0, plan_stop=0.0, target_level=0.0, stop_level=0.0, last_entry=10):
    s = core.initial_portfolio(cursor)
    return s._replace(
        position=size, entry_price=entry, entry_bar=cursor - 1, bars_in_trade=1, plan_target=plan_target, plan_stop=plan_stop,
        target_level=target_level, stop_level=stop_level, last_entry_bar=last_entry,
    )  # fmt: skip


def test_execution_prices_and_trade_pnl():
    assert core.fill_price(1, 99.875, 100.125, 0.0) == 100.125
    assert core.fill_price(-1, 99.875, 100.125, 0.25) == 99.625
    # target on a long at 101: sells at level - half spread (0.125) - slippage (0.25)
    assert core.level_fill_price(2.0, 101.0, 100.875, 101.125, 0.25) == pytest.approx(100.625)
    assert core.level_fill_price(-1.0, 99.0, 98.875, 99.125, 0.0) == pytest.approx(99.125)
    # long 2 from 100.125 to 100.375, multiplier 2, fee 0.5/contract/side: 1.0 - 2.0
    assert core.trade_net_pnl(2.0, 100.125, 100.375, 0.5, 2.0) == pytest.approx(-1.0)
    assert core.trade_net_pnl(-1.0, 100.0, 99.0, 0.5, 2.0) == pytest.approx(1.0)


def test_resolve_order_table():
    r = core.resolve_order
    assert r(DIR_LONG, 0.0, 1) == (False, 1)
    assert r(DIR_SHORT, 0.0, 1) == (False, -1)
    assert r(DIR_FLAT, 0.0, 1) == (False, 0)
    assert r(DIR_LONG, 1.0, 1) == (False, 0)  # hold
    assert r(DIR_FLAT, 1.0, 1) == (True, 0)  # close
    assert r(DIR_SHORT, 1.0, 1) == (True, 0)  # locked: the opposite direction only closes
    assert r(DIR_SHORT, 1.0, 0) == (True, -1)  # unlocked: reversal
    assert r(DIR_LONG, -0.5, 0) == (True, 1)


def test_bar_exit_target_stop_and_both():
    # long, target 101, stop 99
    assert core.bar_exit(1.0, 2.0, 2.0, 101.0, 99.0, 101.0, 99.5) == (EXIT_TARGET, 101.0)
    assert core.bar_exit(1.0, 2.0, 2.0, 101.0, 99.0, 100.5, 99.0) == (EXIT_STOP, 99.0)
    assert core.bar_exit(1.0, 2.0, 2.0, 101.0, 99.0, 101.5, 98.5) == (EXIT_STOP, 99.0)  # both: stop first
    assert core.bar_exit(1.0, 2.0, 2.0, 101.0, 99.0, 100.9, 99.1)[0] == EXIT_NONE
    assert core.bar_exit(1.0, 0.0, 0.0, 101.0, 99.0, 200.0, 1.0)[0] == EXIT_NONE  # no plan levels
    # short, target 99, stop 101
    assert core.bar_exit(-1.0, 2.0, 2.0, 99.0, 101.0, 100.0, 99.0) == (EXIT_TARGET, 99.0)
    assert core.bar_exit(-1.0, 2.0, 2.0, 99.0, 101.0, 101.0, 100.0) == (EXIT_STOP, 101.0)
    # a bar that gapped through the stop never traded at it: the fill is the bar's best price
    assert core.bar_exit(1.0, 2.0, 2.0, 101.0, 99.0, 98.5, 98.0) == (EXIT_STOP, 98.5)
    assert core.bar_exit(-1.0, 2.0, 2.0, 99.0, 101.0, 102.0, 101.5) == (EXIT_STOP, 101.5)
    # a gap through the target fills at the target (a resting limit: no price improvement counted)
    assert core.bar_exit(1.0, 2.0, 0.0, 101.0, 99.0, 102.0, 101.5) == (EXIT_TARGET, 101.0)


def test_locked_close_order_cannot_open_a_side_after_a_stop():
    """Fill delay + direction lock: an order against a long only closes it. When the stop ends the
    position before the order's fill bar, the order does nothing (it used to open a short)."""
    k = consts(fill_delay=1, direction_lock=True)
    s = long_position(stop_level=99.5, plan_stop=1.0)
    gap = bars(mid_n=99.0, high_n=99.6, low_n=99.0)
    s, _, _, t2 = step(s, DIR_SHORT, b=gap, k=k)  # queued (due next bar); the stop fires in bar n
    assert t2.reason == EXIT_STOP and s.position == 0.0 and s.pending_dir == DIR_FLAT
    s, out, t1, _ = step(s, DIR_FLAT, k=k)
    assert s.position == 0.0 and t1.reason == EXIT_NONE


def test_trade_reward_attribution_paid_at_close():
    k = consts(trade_reward_scale=0.01)
    assert core.trade_reward(-1.0, k) == pytest.approx(0.01 * -1.0 / 0.5)
    s = long_position()  # long 2 from 100.125
    # hold: no trade reward
    s1, out, t1, t2 = step(s, DIR_LONG, k=k)
    assert out.reward == 0.0 and t1.reason == EXIT_NONE and t2.reason == EXIT_NONE
    # close at bar c's bid 99.875: (99.875 - 100.125) * 2 * 2 - 2 * 0.5 * 2 = -3.0 -> -0.06
    s2, out, t1, t2 = step(s, DIR_FLAT, k=k)
    assert t1.reason == EXIT_CLOSE and t1.exit_price == 99.875 and t1.pnl == pytest.approx(-3.0)
    assert out.reward == pytest.approx(0.01 * -3.0 / 0.5)
    assert out.trade_pnl == pytest.approx(-3.0) and s2.position == 0.0 and s2.trade_count == 1


def test_entry_accounting_and_micro_reward():
    k = consts(micro_reward_scale=100.0)
    s = core.initial_portfolio(10)
    s1, out, t1, t2 = step(s, DIR_LONG, size=2.0, k=k)
    assert s1.position == 2.0 and s1.entry_price == 100.125 and s1.entry_bar == 10 and s1.cursor == 11
    assert s1.realized == pytest.approx(-1.0)  # entry fee 0.5 * 2
    assert s1.unrealized == pytest.approx((100.5 - 100.125) * 2 * 2)
    assert out.bar_pnl == pytest.approx(1.5 - 1.0)
    # micro: 100 * 2 * (100.5 / 100 - 1) = 1.0
    assert out.reward == pytest.approx(1.0)
    assert core.micro_reward(-1.0, 200.0, 199.0, k) == pytest.approx(100.0 * -1.0 * (199.0 / 200.0 - 1.0))
    assert core.micro_reward(1.0, 0.0, 1.0, k) == 0.0


def test_pnl_reward_is_the_step_net_pnl_and_sums_to_the_trade_pnl():
    """env.pnl_reward_scale: the step's net P&L (realized + unrealized change) per tick-contract x scale; over
    a trade opened, held and closed it sums to the trade's net P&L x scale / tick value (fees and spread
    included). Off (0): the reward is bit for bit the reward without the term."""
    k = consts(pnl_reward_scale=0.01)
    tv = 0.25 * 2.0  # tick 0.25, multiplier 2
    s = core.initial_portfolio(10)
    s1, o1, _, _ = step(s, DIR_LONG, size=2.0, k=k)  # buy 2 at 100.125 (fee 1.0), marked at 100.5
    assert o1.bar_pnl == pytest.approx(0.5) and o1.reward == pytest.approx(0.01 * 0.5 / tv)
    assert o1.r_pnl == o1.reward
    b2 = bars(mid_c=100.5, mid_n=101.0, high_n=101.25, low_n=100.5)
    s2, o2, _, _ = step(s1, DIR_LONG, k=k, b=b2)  # held: marked at 101.0
    b3 = bars(mid_c=101.0, mid_n=100.75, high_n=101.0, low_n=100.5)
    s3, o3, t1, _ = step(s2, DIR_FLAT, k=k, b=b3)  # sold at bid 100.875 (fee 1.0)
    assert t1.reason == EXIT_CLOSE and s3.position == 0.0
    total = float(o1.reward) + float(o2.reward) + float(o3.reward)
    assert total == pytest.approx(0.01 * t1.pnl / tv, rel=1e-12)
    assert t1.pnl == pytest.approx((100.875 - 100.125) * 2 * 2 - 2 * 1.0)
    # off (0): with every other term on, the reward is bit for bit the sum without the term, in its order
    k0 = consts(trade_reward_scale=0.01, micro_reward_scale=100.0, holding_cost_rate=1e-4, churn_penalty_scale=0.01)
    for state, d, b in ((s, DIR_LONG, None), (s1, DIR_LONG, b2), (s2, DIR_FLAT, b3)):
        _, c, _, _ = step(state, d, size=2.0, k=k0, b=b)
        want = (c.r_trade + c.r_micro - c.r_holding - c.r_churn - c.r_opportunity + c.r_dsr) * c.conviction
        assert np.float64(c.reward).tobytes() == np.float64(want).tobytes() and c.r_pnl == 0.0 and c.reward != 0.0


def test_holding_cost():
    k = consts(holding_cost_rate=0.01)
    assert core.holding_cost(-2.0, k) == pytest.approx(0.02)
    _, out, _, _ = step(long_position(), DIR_LONG, k=k)
    assert out.reward == pytest.approx(-0.02)
    _, out, _, _ = step(core.initial_portfolio(10), DIR_FLAT, k=k)
    assert out.reward == 0.0


def test_churn_penalty_is_graduated():
    k = consts(churn_threshold_bars=20, churn_penalty_scale=0.1)
    assert core.churn_penalty(1, 5, k) == pytest.approx(0.1 * (1 - 5 / 20))
    assert core.churn_penalty(1, 0, k) == pytest.approx(0.1)
    assert core.churn_penalty(1, 20, k) == 0.0
    assert core.churn_penalty(0, 5, k) == 0.0
    assert core.churn_penalty(1, 5, consts(churn_threshold_bars=0, churn_penalty_scale=0.1)) == 0.0
    # re-entry 4 bars after the previous entry (at bar 6), decision at bar 10
    s = core.initial_portfolio(10)._replace(last_entry_bar=6)
    s1, out, _, _ = step(s, DIR_SHORT, k=k)
    assert s1.last_entry_bar == 10
    assert out.reward == pytest.approx(-0.1 * (1 - 4 / 20))
    # the first entry of an episode pays nothing
    _, out, _, _ = step(core.initial_portfolio(10), DIR_SHORT, k=k)
    assert core.initial_portfolio(10).last_entry_bar == NO_BAR and out.reward == 0.0


def test_opportunity_cost_when_flat_and_not_in_backtest():
    params = EnvParams(**{**QUIET, "opportunity_cost_scale": 0.5})
    k = params.step_consts(0.25)
    assert core.opportunity_cost(0.0, -3.0, k) == pytest.approx(1.5)
    assert core.opportunity_cost(1.0, -3.0, k) == 0.0
    _, out, _, _ = step(core.initial_portfolio(10), DIR_FLAT, preference=2.0, k=k)
    assert out.reward == pytest.approx(-1.0)
    _, out, _, _ = step(core.initial_portfolio(10), DIR_LONG, preference=2.0, k=k)
    assert out.reward == 0.0  # in a position: no opportunity cost
    kb = params.step_consts(0.25, backtest=True)
    assert kb.opp_scale == 0.0 and kb.episode_length == 0 and kb.hard_cap == 0
    _, out, _, _ = step(core.initial_portfolio(10), DIR_FLAT, preference=2.0, k=kb)
    assert out.reward == 0.0


def test_conviction_scaling():
    k = consts(conviction_weight=0.5, holding_cost_rate=0.01)
    assert core.conviction_factor(1.0, k) == pytest.approx(0.75)  # 1 + 0.5 * (1/2 - 1)
    assert core.conviction_factor(2.0, k) == pytest.approx(1.0)
    assert core.conviction_factor(0.0, k) == 1.0
    s = long_position(size=1.0)
    _, out, _, _ = step(s, DIR_LONG, k=k)
    assert out.reward == pytest.approx(-0.01 * 1.0 * 0.75)
    # closing step scales with the closed plan's size
    k2 = consts(conviction_weight=0.5, trade_reward_scale=0.01)
    _, out, t1, _ = step(s, DIR_FLAT, k=k2)
    assert out.reward == pytest.approx(0.01 * t1.pnl / 0.5 * 0.75)


def test_dsr_update_hand_computed():
    a, b, r, eta = 0.5, 1.25, 2.0, 0.1
    d, a2, b2 = core.dsr_update(a, b, r, eta)
    # dA = 1.5, dB = 2.75, var = 1.0: D = (1.25*1.5 - 0.5*0.5*2.75) / 1 = 1.1875
    assert d == pytest.approx(1.1875)
    assert a2 == pytest.approx(0.65) and b2 == pytest.approx(1.525)
    assert core.dsr_update(0.0, 0.0, 1.0, 0.1)[0] == 0.0  # no variance yet
    # as a reward term: weight on the closed trade's DSR
    k = consts(dsr_reward_scale=2.0, dsr_eta=0.1, dsr_warmup_trades=0)
    s = long_position()._replace(dsr_a=0.5, dsr_b=1.25)
    s2, out, t1, _ = step(s, DIR_FLAT, k=k)
    d, a2, b2 = core.dsr_update(0.5, 1.25, t1.pnl / 0.5, 0.1)
    assert out.reward == pytest.approx(2.0 * d) and s2.dsr_a == pytest.approx(a2) and s2.dsr_b == pytest.approx(b2)


def test_dsr_term_waits_for_the_warmup_trades():
    """EnvParams.dsr_warmup_trades = 3: a closed trade's D is 0 while the env's EMAs hold fewer than 3
    earlier trades (Kelly wins + losses: 0, 1, 2), the plain D from the third on; the EMAs move every time.
    Hand case of the start-up it guards against: after one 0.1-tick trade (η = 0.01) a 5-tick trade has
    D ≈ −12,183, with no warm-up the reward term of a 0.01 weight is ≈ −122."""
    d_plain = core.dsr_update(0.001, 0.0001, 5.0, 0.01)[0]
    assert d_plain == pytest.approx(-12183.0, rel=1e-3)
    k = consts(dsr_reward_scale=2.0, dsr_eta=0.1, dsr_warmup_trades=3)
    for wins, losses, gated in ((0, 0, True), (1, 1, True), (2, 0, True), (2, 1, False), (7, 5, False)):
        s = long_position()._replace(dsr_a=0.5, dsr_b=1.25, kelly_wins=wins, kelly_losses=losses)
        s2, out, t1, _ = step(s, DIR_FLAT, k=k)
        d, a2, b2 = core.dsr_update(0.5, 1.25, t1.pnl / 0.5, 0.1)
        assert d != 0.0 and s2.dsr_a == a2 and s2.dsr_b == b2
        assert out.r_dsr == (0.0 if gated else 2.0 * d), (wins, losses)
        assert s2.kelly_wins + s2.kelly_losses == wins + losses + 1
    with pytest.raises(ValueError, match="dsr_warmup_trades"):
        EnvParams(dsr_warmup_trades=-1)


def test_target_and_stop_exits_in_step():
    k = consts()
    # long 1 at 100.125 (bar 9), target 101 stop 99.5; next bar's high 101.25 touches the target
    s = long_position(size=1.0, plan_target=2.0, plan_stop=1.0, target_level=101.0, stop_level=99.5)
    s2, out, t1, t2 = step(s, DIR_LONG, b=bars(mid_n=101.0, high_n=101.25, low_n=100.0), k=k)
    assert t1.reason == EXIT_NONE and t2.reason == EXIT_TARGET and out.exit_reason == EXIT_TARGET
    assert t2.exit_price == pytest.approx(101.0 - 0.125) and t2.exit_bar == 11 and t2.entry_bar == 9
    assert t2.pnl == pytest.approx((100.875 - 100.125) * 2 - 1.0)
    assert s2.position == 0.0 and s2.plan_target == 0.0 and s2.kelly_wins == 1
    # stop: low 99.25 <= 99.5
    s2, out, _, t2 = step(s, DIR_LONG, b=bars(mid_n=99.75, high_n=100.0, low_n=99.25), k=k)
    assert t2.reason == EXIT_STOP and t2.exit_price == pytest.approx(99.5 - 0.125)
    assert s2.kelly_losses == 1 and s2.kelly_sum_loss == pytest.approx(-t2.pnl)
    # a new plan gets levels from mid_c +/- mult * vol_c and can exit on the very next bar
    s2, out, _, t2 = step(core.initial_portfolio(10), DIR_SHORT, 1.0, 1.0, 2.0, b=bars(vol_c=0.5, high_n=100.25, low_n=99.5), k=k)
    assert t2.reason == EXIT_TARGET and t2.entry_price == 99.875 and t2.exit_price == pytest.approx(99.5 + 0.125)


def test_unlocked_reversal_closes_then_opens():
    k = consts(direction_lock=False)
    s2, out, t1, t2 = step(long_position(), DIR_SHORT, size=1.0, k=k)
    assert t1.reason == EXIT_CLOSE and s2.position == -1.0 and s2.entry_price == 99.875 and s2.trade_count == 1
    s2, out, t1, t2 = step(long_position(), DIR_SHORT, size=1.0, k=consts())
    assert t1.reason == EXIT_CLOSE and s2.position == 0.0  # locked: closes only


def _hand_market(n=40, tick=0.25):
    mid = 100.0 + 0.25 * np.arange(n)
    prev = np.concatenate([[mid[0]], mid[:-1]])
    return MarketData(
        features=np.arange(n * 2, dtype=np.float32).reshape(n, 2),
        mid=mid,
        bid=mid - 0.125,
        ask=mid + 0.125,
        high=np.maximum(prev, mid) + 0.25,
        low=np.minimum(prev, mid) - 0.25,
        session_id=np.zeros(n, np.int32),
        timestamps=np.arange(n, dtype=np.int64),
        tick_size=tick,
        bars_per_day=100.0,
    )


def _act(direction, size=0, target=0, stop=0):
    return np.array([[direction, size, target, stop]], np.int32)


def test_fill_delay():
    data = _hand_market()
    env = CpuEnv(data, EnvParams(**{**QUIET, "fill_delay": 2, "episode_length": 100, "max_episode_bars": 100}), 1, (0, 30))
    env.reset(seed=3)
    assert env.state.cursor[0] == 0  # episode longer than the range: start = range start
    env.step(_act(DIR_LONG, 1))  # decided at bar 0, fills at bar 2's close
    assert env.state.position[0] == 0 and env.state.pending_due[0] == 2
    env.step(_act(DIR_SHORT))  # ignored while an order is pending
    assert env.state.position[0] == 0 and env.state.pending_dir[0] == DIR_LONG
    env.step(_act(DIR_FLAT))
    assert env.state.position[0] == 2.0 and env.state.entry_price[0] == data.ask[2] and env.state.entry_bar[0] == 2
    assert env.state.pending_due[0] == -1
    env.step(_act(DIR_FLAT))  # close decided at bar 3 fills at bar 5
    env.step(_act(DIR_LONG))
    assert env.state.position[0] == 2.0
    env.step(_act(DIR_LONG))
    assert env.state.position[0] == 0.0 and env.out.exit_reason[0] == EXIT_CLOSE
    assert env.out.trade_pnl[0] == pytest.approx((data.bid[5] - data.ask[2]) * 2 * 2 - 2 * 0.5 * 2)


def test_position_gated_done_hard_cap_and_soft_reset():
    data = _hand_market()
    params = EnvParams(**{**QUIET, "episode_length": 3, "max_episode_bars": 6})
    env = CpuEnv(data, params, 1, (0, 40), seed=11)
    env.reset()
    lo, hi = 0, 40
    top = min(hi - 2, hi - 1 - 3)
    assert env.state.cursor[0] == lo + crng.randint(np.uint64(11), 0, 0, core.SLOT_INIT, top - lo + 1)
    start = int(env.state.cursor[0])
    dones = []
    for t in range(3):
        _, d = env.step(_act(DIR_LONG))
        dones.append(int(d[0]))
    assert dones == [0, 0, 0] and env.state.ep_len[0] == 3  # long at the episode length: not done
    _, d = env.step(_act(DIR_FLAT))  # flat now -> done, then the soft reset
    assert d[0] == 1 and env.out.exit_reason[0] == EXIT_CLOSE
    counter = env.counter[0]
    expected = lo + crng.randint(np.uint64(11), 0, counter, core.SLOT_RESET, top - lo + 1)
    assert env.state.cursor[0] == expected and env.out.next_bar[0] == expected and env.out.bar[0] == start + 3
    assert env.state.ep_len[0] == 0 and env.state.realized[0] == 0 and env.state.trade_count[0] == 0
    assert env.state.kelly_wins[0] + env.state.kelly_losses[0] == 1  # Kelly persists over the soft reset
    assert env.state.last_entry_bar[0] == NO_BAR
    # hard cap: holding forever is force-closed at max_episode_bars
    env.advance()
    env.state.cursor[0] = 0  # room for the cap before the end of the range
    for t in range(6):
        _, d = env.step(_act(DIR_LONG))
        if t < 5:
            assert d[0] == 0
    assert d[0] == 1 and env.out.exit_reason[0] == EXIT_CAP and env.state.position[0] == 0


def test_end_of_range_forces_exit():
    data = _hand_market()
    env = CpuEnv(data, EnvParams(**{**QUIET, "episode_length": 100, "max_episode_bars": 200}), 1, (5, 9))
    env.reset()
    assert env.state.cursor[0] == 5
    env.step(_act(DIR_SHORT))
    env.step(_act(DIR_SHORT))
    _, d = env.step(_act(DIR_SHORT))  # 7 -> 8 = last bar of the range
    assert d[0] == 1 and env.out.exit_reason[0] == EXIT_END
    assert env.out.trade_pnl[0] == pytest.approx((data.bid[5] - data.ask[8]) * 2 - 2 * 0.5)
    assert env.state.cursor[0] == 5


def test_causal_volatility_matches_pandas_ewm_and_is_causal(rng):
    import pandas as pd

    mid = 100 + np.cumsum(rng.standard_normal(300))
    vol = causal_volatility(mid, 20.0, 4.0, 0.01)
    d2 = pd.Series(np.diff(mid) ** 2)
    expected = np.sqrt(d2.ewm(span=20, adjust=True).mean().to_numpy() * 4.0)
    np.testing.assert_allclose(vol[1:], np.maximum(expected, 0.01), rtol=1e-10)
    assert vol[0] == 0.01
    changed = mid.copy()
    changed[200:] += 50.0  # the future does not move the past
    np.testing.assert_array_equal(causal_volatility(changed, 20.0, 4.0, 0.01)[:200], vol[:200])


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("sizes", (), "sizes"),
        ("sizes", (1.0, -1.0), "sizes"),
        ("targets", (0.0, math.inf), "targets"),
        ("latency_bars", -1, "latency_bars"),
        ("size_step", 0.0, "size_step"),
        ("episode_length", 0, "episode_length"),
        ("max_episode_bars", 10, "max_episode_bars"),
        ("fee_per_contract", -0.1, "fee_per_contract"),
        ("conviction_weight", 2.0, "conviction_weight"),
        ("dsr_eta", 0.0, "dsr_eta"),
        ("tick_size", 0.0, "tick_size"),
        ("kelly_lambda", -0.5, "kelly_lambda"),
        ("kelly_lambda", math.nan, "kelly_lambda"),
        ("kelly_floor", 1.5, "kelly_floor"),
    ],
)
def test_params_validation_names_field_and_value(field, value, match):
    kw = {field: value}
    if field == "max_episode_bars":
        kw["episode_length"] = 100
    with pytest.raises(ValueError, match=rf"EnvParams\.{match} = .*allowed"):
        EnvParams(**kw)


def test_params_derived_sizes():
    p = EnvParams(sizes=(1.0, 2.0), targets=(0.0, 1.0, 2.0, 3.0, 5.0), stops=(0.0, 1.0))
    assert p.branch_sizes == (3, 2, 5, 2) and p.max_actions == 5 and p.n_branches == 4
    assert p.state_dim(10) == 10 + PORTFOLIO_DIM == 18
    k = p.step_consts(0.5)
    assert k.max_size == 2.0 and k.tick_value == 0.5 * p.contract_multiplier and k.direction_lock == 1 and k.episode_length == 5000
    assert EnvParams(slippage_ticks=1.5).step_consts(0.25).slippage == 0.375  # ticks -> price units


# ---------------------------------------------------------------------------------------------
# the fractional-Kelly size cap (EnvParams.kelly_lambda; core.kelly_size)
# ---------------------------------------------------------------------------------------------
KELLY = {"sizes": (1.0, 2.0, 4.0), "kelly_lambda": 0.5, "kelly_floor": 0.25}


def test_kelly_size_hand_computed():
    k = consts(**KELLY)
    # 3 wins summing 6, 1 loss of 1: p = 3/4, b = (6/3) / (1/1) = 2, f* = 0.75 - 0.25 / 2 = 0.625
    assert core.kelly_fraction(3, 1, 6.0, 1.0) == 0.625
    # half Kelly: cap = 4 x 0.3125 = 1.25 contracts -> 1 lot; an order below the cap keeps its size
    assert core.kelly_size(4.0, 3, 1, 6.0, 1.0, k, 1.0) == 1.0 and core.kelly_size(1.0, 3, 1, 6.0, 1.0, k, 1.0) == 1.0
    # full Kelly: cap 2.5 -> 2 lots; twice Kelly: 1.25 clipped to 1 -> the whole size
    assert core.kelly_size(4.0, 3, 1, 6.0, 1.0, consts(**{**KELLY, "kelly_lambda": 1.0}), 1.0) == 2.0
    assert core.kelly_size(4.0, 3, 1, 6.0, 1.0, consts(**{**KELLY, "kelly_lambda": 2.0}), 1.0) == 4.0
    # no history (f* = 0), wins only, or no edge (1 win of 1, 3 losses of 1: f* = 0.25 - 0.75 = -0.5): the floor, 4 x 0.25 = 1
    assert core.kelly_size(4.0, 0, 0, 0.0, 0.0, k, 1.0) == 1.0 and core.kelly_size(4.0, 2, 0, 5.0, 0.0, k, 1.0) == 1.0
    assert core.kelly_fraction(1, 3, 1.0, 3.0) == -0.5 and core.kelly_size(4.0, 1, 3, 1.0, 3.0, k, 1.0) == 1.0
    # floor 0: the cap never goes below the smallest size (an entry stays an entry)
    assert core.kelly_size(4.0, 1, 3, 1.0, 3.0, consts(**{**KELLY, "kelly_floor": 0.0}), 1.0) == 1.0
    # fractional lots: sizes (0.5, 1, 2) in lots of 0.5, full Kelly 0.625: cap 1.25 -> 2 lots = 1.0
    kf = consts(sizes=(0.5, 1.0, 2.0), size_step=0.5, kelly_lambda=1.0)
    assert core.kelly_size(2.0, 3, 1, 6.0, 1.0, kf, 1.0) == 1.0
    # a cap that is a whole number of lots only up to rounding keeps the lot: 0.004 x 0.5 / 0.001 = 2 lots
    km = consts(sizes=(0.001, 0.002, 0.004), size_step=0.001, kelly_lambda=1.0, kelly_floor=0.5)
    assert core.kelly_size(np.float64(np.float32(0.004)), 0, 0, 0.0, 0.0, km, 1.0) == np.float64(np.float32(0.002))


def test_kelly_cap_in_the_step():
    """The cap acts at order time on orders that may open a side, from the accumulators before the
    step; a close is not sized; with latency the queued order carries the capped size."""
    k = consts(**KELLY)
    s = core.initial_portfolio(10)._replace(kelly_wins=3, kelly_losses=1, kelly_sum_win=6.0, kelly_sum_loss=1.0)
    s1, out, _, _ = step(s, DIR_LONG, size=4.0, k=k)
    assert s1.position == 1.0 and s1.realized == pytest.approx(-0.5) and out.kelly_ratio == 0.25  # fee on 1 contract
    s1, out, _, _ = step(s, DIR_SHORT, size=1.0, k=k)
    assert s1.position == -1.0 and out.kelly_ratio == 1.0  # sized, not shrunk
    _, out, t1, _ = step(long_position()._replace(kelly_wins=3, kelly_losses=1), DIR_FLAT, k=k)
    assert t1.reason == EXIT_CLOSE and out.kelly_ratio == 0.0  # a close: no order to size
    s1, out, _, _ = step(s, DIR_LONG, size=4.0, k=consts(**{**KELLY, "fill_delay": 1}))
    assert s1.position == 0.0 and s1.pending_size == 1.0 and out.kelly_ratio == 0.25
    _, out, _, _ = step(s, DIR_LONG, size=4.0, k=consts(sizes=(1.0, 2.0, 4.0)))
    assert out.kelly_ratio == 0.0  # off


def _random_run(rng, make_market, params, n_envs=4, n_steps=120):
    """Every output and the state after every step of a CpuEnv run with random actions."""
    data = make_market(np.random.default_rng(5), n_bars=160)
    env = CpuEnv(data, params, n_envs, bar_range=(3, 155), seed=21)
    env.reset()
    rows = []
    for _ in range(n_steps):
        actions = np.stack([rng.integers(0, n, n_envs) for n in params.branch_sizes], 1)
        env.step(actions, rng.standard_normal(n_envs).astype(np.float32))
        env.advance()
        rows.append({name: getattr(env.out, name).copy() for name in env.out._fields} | env.state_dict())
    return rows


@pytest.mark.parametrize("lock,latency", [(True, 0), (False, 2)])
def test_kelly_off_is_bitwise_the_step_without_it(make_market, lock, latency):
    """kelly_lambda = 0 (the default) gives the same bits as a run without the field set, whatever
    kelly_floor is; with the cap on, the same script trades differently (the run can tell)."""
    base = {"sizes": (1.0, 2.0, 4.0), "episode_length": 8, "max_episode_bars": 30, "vol_span": 10, "vol_horizon_bars": 3,
            "latency_bars": latency, "direction_lock": lock, "dsr_reward_scale": 0.1, "conviction_weight": 0.3,
            "slippage_ticks": 0.5}
    default = _random_run(np.random.default_rng(3), make_market, EnvParams(**base))
    off = _random_run(np.random.default_rng(3), make_market, EnvParams(**base, kelly_lambda=0.0, kelly_floor=0.9))
    for t, (a, b) in enumerate(zip(default, off, strict=True)):
        for name in a:
            assert a[name].tobytes() == b[name].tobytes(), f"{name} step {t}"
    on = _random_run(np.random.default_rng(3), make_market, EnvParams(**base, kelly_lambda=0.5))
    assert max(np.abs(r["position"]).max() for r in default) == 4.0
    assert any(not np.array_equal(a["position"], b["position"]) for a, b in zip(default, on, strict=True))


def test_kelly_parity_device_vs_reference(rng, make_market):
    """The device env (simulator) and the CPU reference with the cap on: every field, every step;
    the device's training-path telemetry counts the orders the cap shrank, as the numpy fold of
    the reference's step records does (the CpuEnv steps through telemetry.step_record_ref: the
    same row function as CpuEnv.step, plus the record)."""
    from numbarl.env import telemetry as tel
    from numbarl.env.device import DeviceEnv
    from numbarl.env.state import STATE_FIELDS

    data = make_market(rng, n_bars=70)
    params = EnvParams(sizes=(1.0, 2.0, 4.0), episode_length=6, max_episode_bars=20, vol_span=10, vol_horizon_bars=3,
                       latency_bars=int(rng.integers(0, 2)), targets=(0.0, 0.5, 1.0), stops=(0.0, 0.5, 1.0),
                       kelly_lambda=0.5, kelly_floor=0.25, dsr_reward_scale=0.1)
    n_envs, n_steps, seed = 5, 30, int(rng.integers(1 << 31))
    cpu = CpuEnv(data, params, n_envs, bar_range=(3, 66), seed=seed)
    dev = DeviceEnv(data, params, n_envs, bar_range=(3, 66), seed=seed)
    cpu.reset()
    dev.reset()
    records = []
    for t in range(n_steps):
        actions = np.stack([rng.integers(0, n, n_envs) for n in params.branch_sizes], 1).astype(np.int32)
        pref = rng.standard_normal(n_envs).astype(np.float32)
        dev.arena["actions"].copy_to_device(actions)
        dev.arena["preference"].copy_to_device(pref)
        dev.step()
        rec = np.zeros((tel.N_REC, n_envs), np.float64)
        tel.step_record_ref(cpu.state, actions, cpu.grids, cpu.market, pref, cpu.risk_budget, cpu.k, cpu.lo, cpu.hi, cpu.seed,
                            cpu.counter[0], cpu.out, rec)
        records.append(rec)
        # on a GPU the float64 state can differ from the host reference in the last bit: the device
        # compiler contracts e.g. dsr_update's a + eta·(r - a) into one FMA (seen on the H200:
        # dsr_a 1 ulp apart); under the simulator the two are the same arithmetic and equal
        for name in dev.outputs._fields:
            np.testing.assert_allclose(getattr(dev.outputs, name).copy_to_host(), getattr(cpu.out, name), rtol=1e-9,
                                       atol=1e-12, err_msg=f"{name} step {t}")
        state = dev.state_to_host()
        for name, _ in STATE_FIELDS:
            np.testing.assert_allclose(state[name], getattr(cpu.state, name), rtol=1e-9, atol=1e-12,
                                       err_msg=f"state {name} step {t}")
        dev.advance()
        cpu.advance()
    acc = tel.TrainPathTelemetry(dev).read()
    np.testing.assert_allclose(acc, tel.accumulate_reference(records), rtol=1e-9, atol=1e-12)
    sized, capped = acc[tel.T_KELLY_ORDERS].sum(), acc[tel.T_KELLY_CAPPED].sum()
    assert sized > 0 and 0 < capped <= sized  # the run exercised the cap
    stats = tel.summarize(acc, 40.0)
    assert stats["train_path.kelly_capped_frac"] == capped / sized
    assert 0 < stats["train_path.kelly_size_ratio"] < 1


def test_kelly_cap_in_the_backtest(make_market):
    """The backtest steps the same function: always-long size-4 decisions enter with the floor's
    1 contract while the backtest's own history has no win and loss; the segmented backtest,
    whose join assumes entries do not depend on the Kelly sums, refuses the cap."""
    from numbarl.env.backtest import backtest_reference
    from numbarl.env.backtest_segments import backtest_segmented_reference

    data = make_market(np.random.default_rng(8), n_bars=80)
    params = EnvParams(sizes=(1.0, 2.0, 4.0), targets=(0.0, 1.0), stops=(0.0, 1.0), vol_span=10, vol_horizon_bars=3,
                       kelly_lambda=0.5)
    actions = np.tile(np.array([DIR_LONG, 2, 1, 1], np.int32), (70, 1))
    result = backtest_reference(data, (5, 75), params, actions)
    held = np.abs(result.position[0])
    assert held[held > 0][0] == 1.0 and held.max() <= 4.0
    off = backtest_reference(data, (5, 75), params.replace(kelly_lambda=0.0), actions)
    assert np.abs(off.position[0]).max() == 4.0
    with pytest.raises(ValueError, match="kelly_lambda"):
        backtest_segmented_reference(data, (5, 75), params, actions, segment_bars=8)


def test_kelly_config_switch_and_errors():
    from numbarl.config import ConfigError, apply, parse_sets, preset

    cfg = apply(preset("tiny"), parse_sets(["env.kelly_lambda=0.5", "env.kelly_floor=0.1"]))
    assert cfg.env.kelly_lambda == 0.5 and cfg.env.kelly_floor == 0.1
    assert cfg.env.step_consts(0.25).kelly_lambda == 0.5 and preset("tiny").env.kelly_lambda == 0.0
    with pytest.raises(ConfigError, match=r"kelly_lambda = -1\.0 is invalid"):
        apply(preset("tiny"), parse_sets(["env.kelly_lambda=-1"]))
    with pytest.raises(ConfigError, match=r"kelly_floor = 2\.0 is invalid"):
        apply(preset("tiny"), parse_sets(["env.kelly_floor=2"]))
