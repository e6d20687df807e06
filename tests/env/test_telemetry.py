"""Training-path telemetry (numbarl/env/telemetry.py): the device accumulators against a float64
numpy fold of the per-step records, the statistics against numpy and metrics.py, the reset, and
that the step's outputs are the ones the plain reference step gives (nothing changed but the sums)."""

import math

import numpy as np
import pandas as pd
import pytest

from numbarl.cuda.runtime import simulator
from numbarl.env import telemetry as tel
from numbarl.env.device import DeviceEnv
from numbarl.env.metrics import TRADING_DAYS, compute_metrics
from numbarl.env.params import EnvParams
from numbarl.env.reference import CpuEnv
from numbarl.env.state import STATE_FIELDS

BARS_PER_DAY = 40.0
SIMULATOR = simulator()


def assert_same(got, want, err_msg=""):
    """Device vs CPU reference: bit for bit under the simulator (both run the same compiled CPU
    code); on a GPU, FMA contraction may change the last bits of floats (as test_device_env)."""
    got, want = np.asarray(got), np.asarray(want)
    if SIMULATOR or np.issubdtype(want.dtype, np.integer):
        np.testing.assert_array_equal(got, want, err_msg=err_msg)
    elif want.dtype == np.float64:
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-8, err_msg=err_msg)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=err_msg)


def _params(**kw):
    base = {
        "episode_length": 6,
        "max_episode_bars": 15,
        "vol_span": 10,
        "vol_horizon_bars": 3,
        "latency_bars": 0,
        "direction_lock": False,
        "churn_penalty_scale": 0.05,
        "conviction_weight": 0.3,
        "dsr_reward_scale": 0.1,
        "dsr_warmup_trades": 2,
        "pnl_reward_scale": 0.01,  # every reward term on: the sum of the contributions is the reward
        "slippage_ticks": 0.5,
        "holding_cost_rate": 1e-3,
        "opportunity_cost_scale": 0.01,
    }
    base.update(kw)
    return EnvParams(**base)


def _script(rng, params, n_envs, n_steps):
    """Scripted actions [T, N, 4] and preferences [T, N]: every branch drawn uniformly (without
    the direction lock every action is allowed), so trades open and close often."""
    sizes = params.branch_sizes
    actions = np.stack([rng.integers(0, b, (n_steps, n_envs)) for b in sizes], axis=-1).astype(np.int32)
    preference = rng.normal(0.0, 1.0, (n_steps, n_envs)).astype(np.float32)
    return actions, preference


def run_both(rng, make_market, n_envs=3, n_steps=36, **kw):
    """Step a DeviceEnv (simulator), a CpuEnv through the telemetry's reference step (records) and
    a CpuEnv through the plain reference step with the same script; returns what each produced."""
    data = make_market(rng, n_bars=70, bars_per_session=int(BARS_PER_DAY))
    params = _params(**kw)
    seed = int(rng.integers(1 << 31))
    dev = DeviceEnv(data, params, n_envs, bar_range=(2, 68), seed=seed)
    rec_env = CpuEnv(data, params, n_envs, bar_range=(2, 68), seed=seed)
    plain = CpuEnv(data, params, n_envs, bar_range=(2, 68), seed=seed)
    dev.reset()
    rec_env.reset()
    plain.reset()
    actions, preference = _script(rng, params, n_envs, n_steps)
    records, outputs = [], []
    for t in range(n_steps):
        dev.arena["actions"].copy_to_device(actions[t])
        dev.arena["preference"].copy_to_device(preference[t])
        dev.step()
        dev.advance()
        rec = np.zeros((tel.N_REC, n_envs), np.float64)
        tel.step_record_ref(rec_env.state, actions[t], rec_env.grids, rec_env.market, preference[t], rec_env.risk_budget,
                            rec_env.k, rec_env.lo, rec_env.hi, rec_env.seed, rec_env.counter[0], rec_env.out, rec)
        rec_env.advance()
        plain.step(actions[t], preference[t])
        plain.advance()
        out = {name: getattr(dev.outputs, name).copy_to_host() for name in dev.outputs._fields}
        # nothing but the sums changed: the device step (with its accumulation) and the telemetry's
        # reference step give the plain reference step's outputs and state, bit for bit
        for name, value in out.items():
            assert_same(value, getattr(plain.out, name), err_msg=f"{name} step {t}")
            np.testing.assert_array_equal(getattr(rec_env.out, name), getattr(plain.out, name), err_msg=f"{name} step {t}")
        state = dev.state_to_host()
        for name, _ in STATE_FIELDS:
            assert_same(state[name], getattr(plain.state, name), err_msg=f"state {name} step {t}")
            np.testing.assert_array_equal(getattr(rec_env.state, name), getattr(plain.state, name), err_msg=f"state {name} step {t}")
        records.append(rec)
        outputs.append(out)
    return dev, records, outputs


def test_accumulators_equal_the_numpy_fold_of_the_step_records(rng, make_market):
    dev, records, outputs = run_both(rng, make_market)
    # the records are the step's own outputs: bar P&L, trade P&L (two trades may close in a step)
    # and the reward terms, which sum to the reward
    for t, (rec, out) in enumerate(zip(records, outputs, strict=True)):
        assert_same(rec[tel.R_BAR_PNL], out["bar_pnl"], err_msg=f"step {t}")
        assert_same(rec[tel.R_T1_PNL] + rec[tel.R_T2_PNL], out["trade_pnl"], err_msg=f"step {t}")
        closed = (rec[tel.R_T1_CLOSED] + rec[tel.R_T2_CLOSED]) > 0
        np.testing.assert_array_equal(closed, out["exit_reason"] != 0, err_msg=f"step {t}")
        terms = rec[tel.R_TERM0 : tel.R_TERM0 + len(tel.TERMS)]
        np.testing.assert_allclose(terms.sum(axis=0), out["reward"], rtol=1e-6, atol=1e-7, err_msg=f"step {t}")
    acc = tel.TrainPathTelemetry(dev).read()
    want = tel.accumulate_reference(records)
    assert_same(acc, want)  # same values added in the same order: bit for bit (simulator)
    # the script exercised every accumulator (so this test can fail on each of them)
    assert want[tel.T_BAR_N].sum() == len(records) * dev.n_envs
    assert want[tel.T_TRADE_N].sum() >= 6 and 0 < want[tel.T_TRADE_WINS].sum() < want[tel.T_TRADE_N].sum()
    assert (want[tel.T_TRADE_N] > 0).all()
    for j, term in enumerate(tel.TERMS):
        assert want[tel.term_sumsq(j)].sum() > 0, f"reward term {term} never non-zero"
    assert (want[tel.term_sum(tel.TERMS.index("holding"))] < 0).all()  # a cost: negative contribution


def test_statistics_match_numpy_and_metrics(rng, make_market):
    dev, records, _ = run_both(rng, make_market, n_envs=2, n_steps=30)
    reader = tel.TrainPathTelemetry(dev, BARS_PER_DAY)
    stats = reader.read_and_reset()
    assert set(stats) == set(tel.summary_keys())
    # read_and_reset zeroes the accumulators; another read says "nothing since"
    np.testing.assert_array_equal(reader.read(), np.zeros((tel.N_TEL, dev.n_envs)))
    empty = reader.read_and_reset()
    assert empty["train_path.n_bars"] == 0 and empty["train_path.n_trades"] == 0
    assert all(math.isnan(v) for k, v in empty.items() if not k.endswith(("n_bars", "n_trades")))

    pnl = np.stack([r[tel.R_BAR_PNL] for r in records])  # [T, N]
    ann = math.sqrt(BARS_PER_DAY * TRADING_DAYS)
    assert stats["train_path.n_bars"] == pnl.size
    # (tolerances: float64 rounding of the sums, and on a GPU the last bits of the device's P&L)
    np.testing.assert_allclose(stats["train_path.pnl_mean"], pnl.mean(), rtol=1e-9, atol=1e-12 * np.abs(pnl).max())
    np.testing.assert_allclose(stats["train_path.pnl_std"], pnl.std(ddof=1), rtol=1e-9)
    np.testing.assert_allclose(stats["train_path.sharpe"], pnl.mean() / pnl.std(ddof=1) * ann, rtol=1e-9)
    # metrics.py's per-bar Sharpe of the same P&L series: returns pnl / equity with an equity that
    # hardly moves against a huge capital are the P&L scaled by a constant
    series = pnl.T.reshape(-1)  # env by env
    capital = 1e12
    trades = []
    for r in records:
        for closed, col in ((tel.R_T1_CLOSED, tel.R_T1_PNL), (tel.R_T2_CLOSED, tel.R_T2_PNL)):
            trades += list(r[col][r[closed] != 0])
    trades = np.asarray(trades)
    frame = pd.DataFrame({"policy": 0, "entry_bar": 0, "exit_bar": 1, "size": 1.0, "pnl": trades})
    m, _ = compute_metrics(series, np.ones_like(series), np.zeros(len(series), np.int32), frame, BARS_PER_DAY, capital).policy(0)
    np.testing.assert_allclose(stats["train_path.sharpe"], m["sharpe"], rtol=1e-6)
    assert stats["train_path.n_trades"] == len(trades) == m["n_trades"] and len(trades) >= 4
    np.testing.assert_allclose(stats["train_path.win_rate"], m["win_rate"], rtol=1e-15)
    np.testing.assert_allclose(stats["train_path.avg_trade"], m["avg_trade"], rtol=1e-9, atol=1e-12 * np.abs(trades).max())
    np.testing.assert_allclose(stats["train_path.trade_sharpe"], m["trade_sharpe"], rtol=1e-9)
    for j, term in enumerate(tel.TERMS):
        x = np.stack([r[tel.R_TERM0 + j] for r in records])
        np.testing.assert_allclose(stats[f"reward.{term}.mean"], x.mean(), rtol=1e-9, atol=1e-12 * np.abs(x).max(), err_msg=term)
        np.testing.assert_allclose(stats[f"reward.{term}.std"], x.std(ddof=1), rtol=1e-8, err_msg=term)
        np.testing.assert_allclose(stats[f"reward.{term}.snr"], x.mean() / x.std(ddof=1), rtol=1e-8, err_msg=term)


def test_summarize_hand_computed_and_degenerate():
    n = 2
    acc = np.zeros((tel.N_TEL, n))
    # bar P&L: env 0 saw [1, 3], env 1 saw [-1, 5]  -> mean 2, std(ddof=1) sqrt(20 / 3)
    acc[tel.T_BAR_N] = [2, 2]
    acc[tel.T_BAR_SUM] = [4, 4]
    acc[tel.T_BAR_SUMSQ] = [10, 26]
    # trades: env 0 [2, -1], env 1 [4]  -> 3 trades, 2 wins, mean 5/3
    acc[tel.T_TRADE_N] = [2, 1]
    acc[tel.T_TRADE_WINS] = [1, 1]
    acc[tel.T_TRADE_SUM] = [1, 4]
    acc[tel.T_TRADE_SUMSQ] = [5, 16]
    # holding: a constant cost -0.25 every step (zero variance: no SNR); micro [1, -1, 1, 3]
    j_hold, j_micro = tel.TERMS.index("holding"), tel.TERMS.index("micro")
    acc[tel.term_sum(j_hold)] = [-0.5, -0.5]
    acc[tel.term_sumsq(j_hold)] = [0.125, 0.125]
    acc[tel.term_sum(j_micro)] = [0, 4]
    acc[tel.term_sumsq(j_micro)] = [2, 10]
    s = tel.summarize(acc, 10.0)
    assert s["train_path.n_bars"] == 4 and s["train_path.n_trades"] == 3
    assert s["train_path.pnl_mean"] == 2.0
    assert s["train_path.pnl_std"] == pytest.approx(math.sqrt(20 / 3), rel=1e-14)
    assert s["train_path.sharpe"] == pytest.approx(2 / math.sqrt(20 / 3) * math.sqrt(2520), rel=1e-14)
    assert s["train_path.win_rate"] == pytest.approx(2 / 3) and s["train_path.avg_trade"] == pytest.approx(5 / 3)
    assert s["train_path.trade_sharpe"] == pytest.approx((5 / 3) / np.std([2, -1, 4], ddof=1), rel=1e-14)
    assert s["reward.holding.mean"] == -0.25 and math.isnan(s["reward.holding.std"]) and math.isnan(s["reward.holding.snr"])
    assert s["reward.micro.mean"] == 1.0 and s["reward.micro.std"] == pytest.approx(np.std([1, -1, 1, 3], ddof=1))
    assert s["reward.dsr.mean"] == 0.0 and math.isnan(s["reward.dsr.snr"])  # never non-zero: mean 0, no SNR
    # one trade: a win rate, no trade Sharpe; bad bars_per_day is an error
    one = acc.copy()
    one[tel.T_TRADE_N], one[tel.T_TRADE_WINS], one[tel.T_TRADE_SUM], one[tel.T_TRADE_SUMSQ] = [1, 0], [0, 0], [-2, 0], [4, 0]
    s1 = tel.summarize(one, 10.0)
    assert s1["train_path.win_rate"] == 0.0 and s1["train_path.avg_trade"] == -2.0 and math.isnan(s1["train_path.trade_sharpe"])
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="bars_per_day"):
            tel.summarize(acc, bad)
    with pytest.raises(ValueError, match="accumulators"):
        tel.summarize(acc[:-1], 10.0)


def test_epoch_record_is_flat_and_json_ready(rng, make_market):
    import json

    data = make_market(rng, n_bars=40)
    dev = DeviceEnv(data, _params(), 2, bar_range=(2, 38), seed=3)
    dev.reset()
    reader = tel.TrainPathTelemetry(dev)
    with pytest.raises(ValueError, match="bars_per_day"):
        reader.read_and_reset()
    dev.step()  # all-zero actions: short, size 1, no target/stop
    dev.advance()
    record = tel.epoch_record(reader, bars_per_day=BARS_PER_DAY)
    assert tuple(record) == tel.summary_keys()
    assert record["train_path.n_bars"] == 2 and isinstance(record["train_path.n_trades"], int)
    json.dumps(record, allow_nan=False)  # undefined figures are None, not NaN
    assert record["train_path.trade_sharpe"] is None
    # env.reset zeroes the accumulators too
    dev.step()
    dev.reset()
    np.testing.assert_array_equal(reader.read(), 0.0)

