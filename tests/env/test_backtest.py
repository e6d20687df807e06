"""Backtest: device vs CPU reference, one execution path with the env, q_fn mode, trade list."""

import numpy as np
import pytest

from numbarl.cuda.runtime import cuda
from numbarl.env import backtest as backtest_module
from numbarl.env.backtest import backtest, backtest_reference
from numbarl.env.device import DeviceEnv
from numbarl.env.metrics import METRIC_NAMES, compute_metrics
from numbarl.env.params import DIR_FLAT, EXIT_REASONS, EnvParams


def plan_actions(rng, params, n_policies, n_bars, hold=6):
    """Random plans that persist for a few bars (so trades last and targets/stops get hit)."""
    segments = -(-n_bars // hold) + 1
    a = np.stack([rng.integers(0, n, (n_policies, segments)) for n in params.branch_sizes], -1)
    return np.repeat(a, hold, axis=1)[:, :n_bars].astype(np.int32)


def params_for(rng, **kw):
    base = dict(
        vol_span=8,
        vol_horizon_bars=2,
        targets=(0.0, 0.5, 1.0),
        stops=(0.0, 0.5, 1.0),
        fill_delay=int(rng.integers(0, 3)),
        direction_lock=bool(rng.integers(0, 2)),
        slippage_ticks=0.5,
    )
    base.update(kw)
    return EnvParams(**base)


def test_device_backtest_matches_reference_chunked(rng, make_market):
    data = make_market(rng, n_bars=130)
    params = params_for(rng)
    window = (7, 121)
    actions = plan_actions(rng, params, 3, window[1] - window[0])
    ref = backtest_reference(data, window, params, actions)
    dev = backtest(data, window, params, actions=actions, chunk_bars=23)  # 114 bars: 5 chunks, last partial
    np.testing.assert_allclose(dev.pnl, ref.pnl, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(dev.position, ref.position)
    assert len(dev.trades) == len(ref.trades) > 10
    for col in ("policy", "entry_bar", "exit_bar", "side", "size", "exit_reason"):
        assert (dev.trades[col].to_numpy() == ref.trades[col].to_numpy()).all(), col
    for col in ("entry_price", "exit_price", "pnl"):
        np.testing.assert_allclose(dev.trades[col].to_numpy(), ref.trades[col].to_numpy(), rtol=1e-12)
    np.testing.assert_allclose(dev.accumulators, ref.accumulators, rtol=1e-12, atol=1e-12)
    # the trade list is the P&L: everything is closed at the end of the window
    np.testing.assert_allclose(dev.trades.groupby("policy")["pnl"].sum().to_numpy(), dev.pnl.sum(axis=1), rtol=1e-9)
    assert (dev.pnl[:, 0] == 0).all() and (dev.position[:, 0] == 0).all()
    assert set(dev.trades["exit_reason"].astype(str)) <= set(EXIT_REASONS[1:])
    assert (dev.trades["exit_bar"] > dev.trades["entry_bar"]).all()
    assert (dev.trades["exit_bar"] <= window[1] - 1).all() and (dev.trades["entry_bar"] >= window[0]).all()
    # every trade by hand: crossed the quote plus slippage at its entry bar's close, P&L from its
    # prices, fee per contract per side (the two paths above share the trade recording)
    t = dev.trades
    side, size, entry = t["side"].to_numpy(), t["size"].to_numpy(), t["entry_bar"].to_numpy()
    slip = params.slippage_ticks * data.tick_size
    np.testing.assert_allclose(t["entry_price"], np.where(side > 0, data.ask[entry] + slip, data.bid[entry] - slip), rtol=1e-12)
    pnl = (t["exit_price"] - t["entry_price"]) * side * size * params.contract_multiplier - 2 * params.fee_per_contract * size
    np.testing.assert_allclose(t["pnl"], pnl, rtol=1e-9, atol=1e-9)
    closed = t["exit_reason"].astype(str) == "close"
    ex = t["exit_bar"].to_numpy()[closed]
    np.testing.assert_allclose(t["exit_price"][closed], np.where(side[closed] > 0, data.bid[ex] - slip, data.ask[ex] + slip), rtol=1e-12)
    assert set(np.unique(side)) <= {-1, 1} and closed.any()
    # metrics from the device scan == metrics of the returned arrays
    m_dev, m_host = dev.metrics(), compute_metrics(dev.pnl, dev.position, dev.session_id, dev.trades, data.bars_per_day, params.initial_capital)
    for name in METRIC_NAMES:
        np.testing.assert_allclose(m_dev.values[name], m_host.values[name], rtol=1e-9, equal_nan=True, err_msg=name)


def test_broadcast_actions_equal_per_policy_actions(rng, make_market):
    data = make_market(rng, n_bars=60)
    params = params_for(rng)
    one = plan_actions(rng, params, 1, 50)[0]
    a = backtest(data, (5, 55), params, actions=one, n_policies=2)
    b = backtest(data, (5, 55), params, actions=np.stack([one, one]))
    np.testing.assert_array_equal(a.pnl, b.pnl)
    np.testing.assert_array_equal(a.pnl[0], a.pnl[1])


def test_backtest_pnl_equals_env_pnl_for_the_same_actions(rng, make_market):
    """One execution path: the training env stepped with the backtest's actions gives the same
    per-bar P&L and equity (episode longer than the window: the env starts at its start)."""
    data = make_market(rng, n_bars=80)
    params = params_for(rng, episode_length=200, max_episode_bars=400, opportunity_cost_scale=0.5)
    start, end = 4, 70
    n_pol, n_bars = 3, end - start
    actions = plan_actions(rng, params, n_pol, n_bars)
    bt = backtest(data, (start, end), params, actions=actions)
    env = DeviceEnv(data, params, n_pol, bar_range=(start, end))
    env.reset()
    assert (env.state_to_host()["cursor"] == start).all()
    env.arena.load({"preference": rng.standard_normal(n_pol).astype(np.float32)})  # must not move P&L
    equity = np.zeros(n_pol)
    for j in range(n_bars - 1):
        env.arena.load({"actions": np.ascontiguousarray(actions[:, j])})
        out = env.step()
        step_pnl = out.bar_pnl.copy_to_host()
        np.testing.assert_allclose(step_pnl, bt.pnl[:, j + 1], rtol=1e-12, atol=1e-12, err_msg=f"bar {start + j + 1}")
        equity += step_pnl
        state = env.state_to_host()
        if j < n_bars - 2:
            np.testing.assert_allclose(state["realized"] + state["unrealized"], bt.pnl[:, : j + 2].sum(1), rtol=1e-9, atol=1e-9)
    assert (out.done.copy_to_host() == 1).all()  # the window end is the episode end
    np.testing.assert_allclose(equity, bt.pnl.sum(1), rtol=1e-9, atol=1e-9)


def test_q_fn_backtest_equals_actions_backtest(rng, make_market):
    data = make_market(rng, n_bars=50, n_features=2)
    features = data.features.copy()
    features[:, 0] = np.arange(data.n_bars)  # the q_fn reads the bar index from the obs
    data = type(data)(
        features=features, mid=data.mid, bid=data.bid, ask=data.ask, high=data.high, low=data.low,
        session_id=data.session_id, timestamps=data.timestamps, tick_size=data.tick_size, bars_per_day=data.bars_per_day,
    )  # fmt: skip
    # fill delay 0: with a delay, a queued locked-out "short" (actions mode) and the greedy "flat"
    # differ when a stop empties the position before the fill bar (the short then opens)
    params = params_for(rng, fill_delay=0)
    start, end, n_pol = 3, 47, 2
    actions = plan_actions(rng, params, n_pol, end - start)
    calls = []

    def q_fn(obs, q_out, stream):
        o = obs.copy_to_host(stream=stream)
        stream.synchronize()
        q = np.zeros(q_out.shape, np.float32)
        for p in range(n_pol):
            j = int(o[p, 0]) - start
            for b in range(4):
                q[p, b, actions[p, j, b]] = 1.0  # one-hot greedy = the given action
            # under the direction lock the opposite direction is masked; flat second-best makes
            # the greedy choice "close", which is what the env does with a locked-out direction
            q[p, 0, DIR_FLAT] = max(q[p, 0, DIR_FLAT], 0.5)
        q_out.copy_to_device(q, stream=stream)
        calls.append(j)

    via_q = backtest(data, (start, end), params, q_fn=q_fn, n_policies=n_pol, chunk_bars=13, graph=False)
    via_a = backtest(data, (start, end), params, actions=actions)
    assert len(calls) == end - start - 1
    np.testing.assert_array_equal(via_q.pnl, via_a.pnl)
    np.testing.assert_array_equal(via_q.position, via_a.position)
    assert via_q.trades.equals(via_a.trades)
    # the graphed path's chunking (13-bar graphs, the surplus steps of the last replay masked) is
    # the same backtest; this q_fn copies to the host, so its "graph" re-calls the bars (as the
    # simulator always does, and --no-graph on a GPU)
    from numbarl.cuda import graph as cuda_graph

    cuda_graph.set_eager(True)
    try:
        via_g = backtest(data, (start, end), params, q_fn=q_fn, n_policies=n_pol, chunk_bars=13, graph=True)
    finally:
        cuda_graph.set_eager(False)
    np.testing.assert_array_equal(via_g.pnl, via_a.pnl)
    np.testing.assert_array_equal(via_g.position, via_a.position)
    assert via_g.trades.equals(via_a.trades)


_cuda = cuda()


@_cuda.jit
def _linear_q_kernel(obs, w, q):
    """q[p, b, a] = sum_j obs[p, j] W[p, j, b * A + a]: a capturable per-policy 'network'."""
    e = _cuda.grid(1)
    n, nb, na = q.shape
    if e >= n * nb * na:
        return
    p = e // (nb * na)
    o = e - p * nb * na
    acc = np.float32(0.0)
    for j in range(obs.shape[1]):
        acc += obs[p, j] * w[p, j, o]
    q[p, o // na, o - (o // na) * na] = acc


class _LinearPolicies:
    """P linear greedy policies on the device (q_fn is a bound method, like an agent's)."""

    def __init__(self, weights):
        self.w = _cuda.to_device(weights)

    def q_fn(self, obs, q, stream):
        _linear_q_kernel[1, q.size, stream](obs, self.w, q)


def test_graphed_policy_backtest_equals_eager_bitwise(rng, make_market, monkeypatch):
    data = make_market(rng, n_bars=50, n_features=2)
    params = params_for(rng, fill_delay=int(rng.integers(0, 2)))
    market = data.to_device(params.vol_span, params.vol_horizon_bars)
    n_pol, window = 2, (4, 45)  # 41 bars in 12-bar chunks: 11 + 12 + 12 + 5 steps
    dim = params.state_dim(data.n_features)
    policies = _LinearPolicies(rng.standard_normal((n_pol, dim, params.n_branches * params.max_actions)).astype(np.float32))
    monkeypatch.setattr(backtest_module, "GRAPH_BARS", 5)  # 3 + 3 + 3 + 1 replays, masked tails
    kw = dict(q_fn=policies.q_fn, n_policies=n_pol, chunk_bars=12)
    eager = backtest(data, window, params, graph=False, **kw)
    graphed = backtest(market, window, params, graph=True, **kw)
    runner = backtest_module.policy_bars(market, params, n_pol, window, 12, None, policies.q_fn)
    assert runner.bars_per_graph == 5 and runner.replays == 10
    again = backtest(market, window, params, graph=True, **kw)  # the cached graph, replayed
    assert runner.replays == 20 and backtest_module.policy_bars(market, params, n_pol, window, 12, None, policies.q_fn) is runner
    assert len(eager.trades) > 0
    for other in (graphed, again):
        np.testing.assert_array_equal(other.pnl, eager.pnl)
        np.testing.assert_array_equal(other.position, eager.position)
        assert other.trades.equals(eager.trades)
        np.testing.assert_array_equal(other.accumulators, eager.accumulators)
        got, want = other.metrics().values, eager.metrics().values
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # the actions the greedy policies took, replayed: the actions-driven reference agrees
    ref = backtest_reference(data, window, params, _greedy_actions(eager, data, params, policies, window))
    np.testing.assert_allclose(eager.pnl, ref.pnl, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(eager.position, ref.position)
    # the cache holds the policies weakly: their entry goes with them
    key_count = len(backtest_module._POLICY_CACHE)
    del policies, kw
    assert len(backtest_module._POLICY_CACHE) == key_count - 1


def _greedy_actions(result, data, params, policies, window):
    """The greedy actions of `policies` at each window bar, recomputed on the host (obs = features
    | portfolio features and the mask, by the CPU env's gather; greedy = the learner's policy at
    epsilon 0)."""
    from numbarl.env.rows import store_row
    from numbarl.env.state import initial_portfolio
    from numbarl.env.reference import CpuEnv
    from numbarl.rl.policies import epsilon_greedy_ref

    start, end = window
    w = policies.w.copy_to_host()
    n_pol = w.shape[0]
    env = CpuEnv(data, params, n_pol)

    for p in range(n_pol):
        store_row(env.state, p, initial_portfolio(start))
    out = np.zeros((n_pol, end - start, params.n_branches), np.int32)
    for j in range(end - start - 1):
        obs = env.gather()
        q = np.einsum("pj,pjo->po", obs, w, dtype=np.float32).reshape(n_pol, params.n_branches, params.max_actions)
        actions, _ = epsilon_greedy_ref(q.astype(np.float32), env.mask, 0.0, 0, 0)
        out[:, j] = actions
        env.step(actions)
    return out


def test_flat_policy_has_no_pnl_and_degenerate_metrics(rng, make_market):
    data = make_market(rng, n_bars=40)
    params = EnvParams()
    actions = np.zeros((30, 4), np.int32)
    actions[:, 0] = DIR_FLAT
    r = backtest(data, (0, 30), params, actions=actions)
    assert (r.pnl == 0).all() and len(r.trades) == 0
    values, reasons = r.metrics().policy(0)
    assert values["total_return"] == 0 and values["n_trades"] == 0 and values["exposure"] == 0
    assert np.isnan(values["sharpe"]) and "zero variance" in reasons["sharpe"]
    assert np.isnan(values["win_rate"]) and reasons["win_rate"] == "no trades"


def test_trade_buffer_overflow_and_bad_actions(rng, make_market):
    data = make_market(rng, n_bars=40)
    params = EnvParams(fill_delay=0)
    alternating = np.zeros((30, 4), np.int32)
    alternating[::2, 0] = 2  # long, flat, long, ...: a trade every two bars
    alternating[1::2, 0] = DIR_FLAT
    with pytest.raises(RuntimeError, match="max_trades"):
        backtest(data, (0, 30), params, actions=alternating, max_trades=3)
    for run in (backtest, backtest_reference):  # trade metrics need the list: count-only is refused up front
        with pytest.raises(ValueError, match="max_trades = 0 is invalid here"):
            run(data, (0, 30), params, actions=alternating, max_trades=0)
    bad = alternating.copy()
    bad[4, 1] = 7
    with pytest.raises(ValueError, match=r"actions\[..., 1\] \(size\) has index 7"):
        backtest(data, (0, 30), params, actions=bad)
    with pytest.raises(ValueError, match="one row per window bar"):
        backtest(data, (0, 30), params, actions=alternating[:20])
    with pytest.raises(ValueError, match="exactly one of"):
        backtest(data, (0, 30), params)
    with pytest.raises(ValueError, match="window"):
        backtest(data, (0, 400), params, actions=alternating)
