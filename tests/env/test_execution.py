"""Execution settings (issue 19): whole contracts by default with a per-instrument size step,
`latency_bars` with its exact timing (decided at bar t's close, filled at bar t+L's close quote),
the former name `fill_delay` still accepted, and the one-line fill assumption for reports."""

import numpy as np
import pytest

from numbarl import config as nconfig
from numbarl.env.market import MarketData
from numbarl.env.params import DIR_FLAT, DIR_LONG, DIR_SHORT, EnvParams
from numbarl.env.reference import CpuEnv


def test_default_sizes_are_whole_contracts():
    p = EnvParams()
    assert p.size_step == 1.0 and p.sizes == (1.0, 2.0, 4.0)
    assert all(float(s).is_integer() for s in p.sizes)
    # the fractions of the largest size are those of the old grid (0.25, 0.5, 1.0)
    assert tuple(s / p.max_size for s in p.sizes) == (0.25, 0.5, 1.0)


@pytest.mark.parametrize("sizes,bad", [((0.25, 0.5, 1.0), "0.25"), ((1.0, 1.5), "1.5"), ((2.0, 3.0000001),  "3.0000001")])
def test_fractional_sizes_are_a_config_error_naming_field_and_value(sizes, bad):
    with pytest.raises(ValueError, match=rf"EnvParams\.sizes = .* is invalid: {bad} is not a whole multiple of size_step = 1\.0"):
        EnvParams(sizes=sizes)


def test_an_instrument_with_fractional_lots_declares_its_step():
    assert EnvParams(sizes=(0.25, 0.5, 1.0), size_step=0.25).sizes == (0.25, 0.5, 1.0)
    assert EnvParams(sizes=(0.001, 0.003, 0.007), size_step=0.001).size_step == 0.001  # 0.003 / 0.001 = 2.9999999999999996
    with pytest.raises(ValueError, match=r"0\.3 is not a whole multiple of size_step = 0\.25"):
        EnvParams(sizes=(0.25, 0.3), size_step=0.25)
    for step in (0.0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match=r"EnvParams\.size_step = .* is invalid"):
            EnvParams(size_step=step)


def test_config_sets_latency_and_refuses_fractional_sizes():
    cfg = nconfig.apply(nconfig.preset("tiny"), {"env.latency_bars": 2})
    assert cfg.env.latency_bars == 2 and cfg.env.step_consts(0.25).latency_bars == 2
    with pytest.raises(nconfig.ConfigError, match=r"env: EnvParams\.sizes = .*0\.5 is not a whole multiple"):
        nconfig.apply(nconfig.preset("tiny"), {"env.sizes": [0.5, 1.0]})


def test_fill_delay_is_the_former_name_of_latency_bars():
    assert EnvParams(fill_delay=2).latency_bars == 2 and EnvParams(latency_bars=2).fill_delay == 2
    assert EnvParams().replace(fill_delay=3).latency_bars == 3
    assert EnvParams(fill_delay=1, latency_bars=1).latency_bars == 1
    with pytest.raises(ValueError, match="fill_delay = 1 and latency_bars = 2 disagree"):
        EnvParams(fill_delay=1, latency_bars=2)


def test_fill_assumption_states_the_rule():
    assert EnvParams().fill_assumption().startswith("fills at the deciding bar's own close quote (zero latency)")
    line = EnvParams(latency_bars=2, slippage_ticks=0.5, fee_per_contract=2.25).fill_assumption()
    assert "fills 2 bars after the decision" in line and "bar t+2" in line and "0.5 tick slippage" in line
    assert "fee 2.25 per contract per side" in line and "whole contracts" in line and "\n" not in line
    assert "size step 0.001" in EnvParams(sizes=(0.001,), size_step=0.001).fill_assumption()


def _market(n=20):
    # bid/ask different at every bar, so the fill bar is visible in the entry price
    mid = 100.0 + 0.25 * np.arange(n) + 0.25 * (np.arange(n) % 3)
    return MarketData(
        features=np.zeros((n, 1), np.float32),
        mid=mid,
        bid=mid - 0.125,
        ask=mid + 0.125,
        high=mid + 1.0,
        low=mid - 1.0,
        session_id=np.zeros(n, np.int32),
        timestamps=np.arange(n, dtype=np.int64),
        tick_size=0.25,
        bars_per_day=100.0,
    )


@pytest.mark.parametrize("latency", [0, 1, 3])
def test_decision_at_bar_t_fills_at_bar_t_plus_latency_close_quote(latency):
    data = _market()
    params = EnvParams(latency_bars=latency, sizes=(1.0, 2.0), fee_per_contract=0.0, contract_multiplier=1.0,
                       episode_length=100, max_episode_bars=100, opportunity_cost_scale=0.0)
    env = CpuEnv(data, params, 1, (0, 20))
    env.reset(seed=1)
    t = int(env.state.cursor[0])
    env.step(np.array([[DIR_LONG, 1, 0, 0]], np.int32))  # decided at bar t's close
    for _ in range(latency):
        assert env.state.position[0] == 0.0
        env.step(np.array([[DIR_FLAT, 0, 0, 0]], np.int32))  # ignored while the order waits
    assert env.state.position[0] == 2.0
    assert env.state.entry_bar[0] == t + latency and env.state.entry_price[0] == data.ask[t + latency]
    env.step(np.array([[DIR_SHORT, 0, 0, 0]], np.int32))  # close (direction lock) decided at bar t+L+1
    for _ in range(latency):
        env.step(np.array([[DIR_LONG, 0, 0, 0]], np.int32))
    assert env.state.position[0] == 0.0
    assert env.out.trade_pnl[0] == pytest.approx((data.bid[t + 2 * latency + 1] - data.ask[t + latency]) * 2.0)
