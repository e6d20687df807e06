"""The validation feedback loop (numbarl/rl/feedback): each rule against a hand-computed case, the
device kernels against numpy, the backtest's per-bar Q record, and a tiny run end to end."""

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from numbarl.cli import train_cmd
from numbarl.cuda.runtime import cuda, stream
from numbarl.env.params import DIR_FLAT, DIR_LONG, DIR_SHORT, EnvParams
from numbarl.rl.feedback import kernels, loop
from numbarl.rl.feedback.regimes import RegimeBuckets, N_BUCKETS
from numbarl.rl.feedback.split import split_validation

_cuda = cuda()


def test_validation_split_is_chronological_with_an_embargo():
    assert split_validation((100, 200), 0.5, 10) == ((100, 150), (160, 200))
    assert split_validation((0, 30), 1 / 3, 2) == ((0, 10), (12, 30))
    with pytest.raises(ValueError, match="too short to split"):
        split_validation((0, 10), 0.5, 8)


def test_e2_epsilon_follows_a_scripted_series():
    # hand-computed: 0.3 (capped) -> x0.8 = 0.24 -> Sharpe falls 20% below best: x1.25 = 0.3 -> x0.8
    eps = loop.next_epsilon(0.5, 1.0, 1.0, 50, 10)
    assert eps == pytest.approx(0.3)  # 0.5 * 0.8 = 0.4, capped at 0.3
    eps = loop.next_epsilon(eps, 2.0, 2.0, 50, 10)
    assert eps == pytest.approx(0.24)
    eps = loop.next_epsilon(eps, 1.6, 2.0, 50, 10)  # 1.6 < 2.0 - 0.1 * 2.0 = 1.8: worse
    assert eps == pytest.approx(0.3)
    eps = loop.next_epsilon(eps, 1.85, 2.0, 50, 10)  # within 10% of the best: better
    assert eps == pytest.approx(0.24)
    assert loop.next_epsilon(0.02, 5.0, 5.0, 50, 10) == pytest.approx(0.016)
    assert loop.next_epsilon(0.011, 5.0, 5.0, 50, 10) == pytest.approx(0.01)  # the floor
    assert loop.next_epsilon(0.02, 5.0, 5.0, 3, 10) == pytest.approx(0.1)  # too few trades: floor raised
    assert loop.next_epsilon(0.2, None, None, 50, 10) == pytest.approx(0.25)  # undefined Sharpe: not improving
    # a negative best: "within 10%" is best - 0.1 |best|
    assert loop.next_epsilon(0.2, -1.05, -1.0, 50, 10) == pytest.approx(0.16)
    assert loop.next_epsilon(0.2, -1.2, -1.0, 50, 10) == pytest.approx(0.25)


def test_e3_gamma_from_holding_time():
    assert loop.gamma_from_hold(50.0) == pytest.approx(0.99)  # 1 - 1 / 100
    assert loop.gamma_from_hold(4.0) == pytest.approx(0.95)  # 1 - 1/8 = 0.875 -> clipped up
    assert loop.gamma_from_hold(10_000.0) == pytest.approx(0.999)
    assert loop.gamma_from_hold(None) is None and loop.gamma_from_hold(float("nan")) is None


def test_e9_tradability_shrinks_and_gates():
    counts = np.array([0, 10, 30, 5, 0, 0, 0, 0, 0], np.float64)
    sums = np.array([0, -100, 60, -50, 0, 0, 0, 0, 0], np.float64)
    tau, gate = loop.tradability(counts, sums, min_trades=10)
    assert tau[1] == pytest.approx(-100 / 30) and tau[2] == pytest.approx(60 / 50) and tau[3] == pytest.approx(-50 / 25)
    assert gate.tolist() == [0, 1, 0, 0, 0, 0, 0, 0, 0]  # bucket 3 is negative but has 5 < 10 trades


def _trades(rows):
    return pd.DataFrame(rows, columns=["policy", "entry_bar", "exit_bar", "side", "size", "pnl"])


def test_e1_trade_return_and_bias_hand_computed():
    k = EnvParams().step_consts(0.25)
    mid = np.array([100.0, 101.0, 99.0, 99.0])
    g = 0.9
    t = _trades([(0, 0, 2, 1, float(k.max_size), 50.0)])  # long max size from bar 0 to bar 2
    conv = 1.0  # full size: conviction factor 1
    p = float(k.max_size)
    r0 = k.micro_scale * p * (101 / 100 - 1) - k.hold_rate * p
    r1 = k.micro_scale * p * (99 / 101 - 1) - k.hold_rate * p + k.trade_scale * 50.0 / k.tick_value
    want = conv * (r0 + g * r1)
    got = loop.trade_returns(t, mid, k, g)
    assert got[0] == pytest.approx(want, rel=1e-12)
    # the mark-to-market term (env.pnl_reward_scale): each bar's mid-to-mid P&L, the costs at the last bar
    kp = EnvParams(pnl_reward_scale=0.01).step_consts(0.25)
    m1, m2 = p * 1.0 * kp.multiplier, p * -2.0 * kp.multiplier  # $ of the two bars' moves
    s_tv = kp.pnl_scale / kp.tick_value
    want_p = conv * ((r0 + s_tv * m1) + g * (r1 + s_tv * m2 + s_tv * (50.0 - m1 - m2)))
    assert loop.trade_returns(t, mid, kp, g)[0] == pytest.approx(want_p, rel=1e-12)
    q_record = np.full((1, 4, 3), np.nan, np.float32)
    q_record[0, 0, DIR_LONG] = 2.5
    q_hat = loop.entry_q(t, q_record, start=0)
    assert q_hat[0] == pytest.approx(2.5)
    assert loop.q_bias(np.array([1.0, 2.0, np.nan, 10.0]), np.array([0.0, 0.0, 0.0, 1.0])) == pytest.approx(2.0)
    assert loop.q_bias(np.array([np.nan]), np.array([0.0])) is None


def test_reward_offset_kernel_matches_reference(rng):
    n = 37
    reward = rng.normal(size=n).astype(np.float32)
    discount = (0.99 ** rng.integers(1, 4, size=n)).astype(np.float32)
    offset = np.array([0.7], np.float32)
    r_dev = _cuda.to_device(reward)
    kernels.reward_offset_kernel[1, 64](r_dev, _cuda.to_device(discount), _cuda.to_device(offset))
    got = r_dev.copy_to_host()
    want = kernels.reward_offset_ref(reward, discount, 0.7)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert not np.array_equal(got, reward)


def test_e1_offsets_every_window_of_the_batch(rng):
    """E1 on a batch with an extra horizon: the main window and the horizon's returns each lowered by the offset
    times (1 − their own discount), as the replay's n-step scan with every reward lowered would give."""
    from types import SimpleNamespace

    from numbarl.rl.feedback.loop import FeedbackLoop

    n = 9
    windows = [SimpleNamespace(reward=rng.normal(size=n).astype(np.float32),
                               discount=(0.9 ** rng.integers(1, 6, size=n)).astype(np.float32)) for _ in range(2)]
    dev = [SimpleNamespace(reward=_cuda.to_device(w.reward), discount=_cuda.to_device(w.discount)) for w in windows]
    batch = SimpleNamespace(reward=dev[0].reward, discount=dev[0].discount, horizons=[dev[1]])
    loop = SimpleNamespace(hindsight=None, e1=0.5, dev={"offset": _cuda.to_device(np.array([0.7], np.float32))})
    s = stream()
    FeedbackLoop.on_sample(loop, batch, s)
    s.synchronize()
    for w, d in zip(windows, dev):
        np.testing.assert_allclose(d.reward.copy_to_host(), kernels.reward_offset_ref(w.reward, w.discount, 0.7),
                                   rtol=0, atol=1e-6)


def test_regime_buckets_and_gate_kernels_match_numpy(rng):
    n, n_feat = 24, 5
    feats = rng.normal(size=(200, n_feat)).astype(np.float32)
    names = ["a", "adx_14", "b", "rv_32", "c"]
    reg = RegimeBuckets.fit(feats, (0, 150), names)
    assert (reg.col_a, reg.col_b) == (1, 3)
    assert np.isclose(reg.edges[0], np.quantile(feats[:150, 1].astype(np.float64), 1 / 3), atol=1e-6)
    b = reg.of(feats)
    assert set(np.unique(b)) <= set(range(N_BUCKETS)) and len(np.unique(b)) > 3
    obs = np.zeros((n, n_feat + 8), np.float32)
    obs[:, :n_feat] = feats[:n]
    obs[::3, n_feat] = 0.5  # every third env holds a position: never gated
    gate = np.zeros(N_BUCKETS, np.uint8)
    gate[np.unique(reg.of(obs))[:2]] = 1
    mask = np.ones((n, 4, 4), np.uint8)
    blocked = np.zeros(n, np.uint8)
    d_mask = _cuda.to_device(mask)
    d_blocked = _cuda.to_device(blocked)
    args = (n_feat, _cuda.to_device(reg.edges_array()), _cuda.to_device(gate), reg.col_a, reg.col_b)
    kernels.gate_mask_kernel[1, 32](_cuda.to_device(obs), d_mask, *args, d_blocked)
    got_mask, got_blocked = d_mask.copy_to_host(), d_blocked.copy_to_host()
    want_blocked = (gate[reg.of(obs)] == 1) & (obs[:, n_feat] == 0)
    assert want_blocked.any() and not want_blocked.all()
    np.testing.assert_array_equal(got_blocked, want_blocked.astype(np.uint8))
    want_mask = mask.copy()
    want_mask[want_blocked, 0, DIR_SHORT] = 0
    want_mask[want_blocked, 0, DIR_LONG] = 0
    np.testing.assert_array_equal(got_mask, want_mask)
    assert got_mask[:, 0, DIR_FLAT].all()  # flat stays available
    q = rng.normal(size=(n, 4, 4)).astype(np.float32)
    d_q = _cuda.to_device(q)
    kernels.gate_scores_kernel[1, 32](_cuda.to_device(obs), d_q, *args)
    got_q = d_q.copy_to_host()
    want_q = q.copy()
    want_q[want_blocked, 0, DIR_SHORT] = np.float32(-3.4028235e38)
    want_q[want_blocked, 0, DIR_LONG] = np.float32(-3.4028235e38)
    np.testing.assert_array_equal(got_q, want_q)
    assert np.all(np.argmax(got_q[want_blocked, 0, :3], axis=1) == DIR_FLAT)


def test_backtest_records_the_direction_q_of_each_decision_bar(rng):
    """q_record[0, j] is what q_fn returned at bar start + j (graph and eager paths alike)."""
    from numbarl.env.backtest import backtest
    from numbarl.env.market import MarketData

    n = 40
    mid = 100.0 + np.cumsum(rng.integers(-3, 4, n) * 0.125)
    market = MarketData(features=rng.standard_normal((n, 3)).astype(np.float32), mid=mid, bid=mid - 0.125,
                        ask=mid + 0.125, high=mid + 0.25, low=mid - 0.25, session_id=np.zeros(n, np.int32),
                        timestamps=np.arange(n, dtype=np.int64) * 10**9, tick_size=0.25, bars_per_day=40.0)
    params = EnvParams()
    window = (2, 20)

    def q_fn(obs, q_out, stream):  # the first feature as every action's Q: a per-bar value
        _fill_q[1, 32, stream](obs, q_out)

    results = [backtest(market, window, params, q_fn=q_fn, n_policies=1, record_q=True, graph=g) for g in (True, False)]
    feats = np.asarray(market.features[window[0]:window[1], 0], np.float32)
    for r in results:
        assert r.q_record.shape == (1, 18, 3)
        np.testing.assert_array_equal(r.q_record[0, :-1, DIR_LONG], feats[:-1])
        assert np.isnan(r.q_record[0, -1]).all()
    np.testing.assert_array_equal(results[0].q_record, results[1].q_record)


@_cuda.jit
def _fill_q(obs, q):
    i = _cuda.grid(1)
    if i < q.shape[0] * q.shape[1] * q.shape[2]:
        p = i // (q.shape[1] * q.shape[2])
        rest = i % (q.shape[1] * q.shape[2])
        q[p, rest // q.shape[2], rest % q.shape[2]] = obs[p, 0]


FAST = ["--preset", "tiny", "--quiet", "--epochs", "2", "--set", "data.synth_bars_per_day=30",
        "--set", "train.collect_steps_per_epoch=6", "--set", "train.log_interval=2", "--set", "train.learning_starts=3"]


def test_tiny_run_feeds_back_and_selects_on_the_other_part(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBARL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    r = CliRunner().invoke(train_cmd, [*FAST, "--set", "train.e1_q_reality=0.5", "--set", "train.e2_adaptive_epsilon=true",
                                       "--set", "train.e3_dynamic_gamma=true", "--set", "train.e9_tradability_gate=true",
                                       "--set", "train.e9_min_trades=1", "--out", str(out)], catch_exceptions=True)
    assert r.exit_code == 0, r.output + repr(r.exception)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kinds = [rec["kind"] for rec in records]
    assert kinds.count("val_feedback") == 2 and kinds.count("feedback") == 2 and kinds.count("val") == 2
    # the training path's realized results each epoch, matched to the validation record's epoch
    paths = [rec for rec in records if rec["kind"] == "train_path"]
    assert [p["epoch"] for p in paths] == [1, 2] and all(p["train_path.n_bars"] > 0 for p in paths)
    fb = [rec for rec in records if rec["kind"] == "feedback"]
    assert all(rec["e3.gamma"] is not None and 0.95 <= rec["e3.gamma"] <= 0.999 for rec in fb)
    assert all(0.01 <= rec["e2.epsilon"] <= 0.3 for rec in fb)
    summary = json.loads((out / "summary.json").read_text())
    split = summary["folds"][0]["validation_split"]
    val = summary["folds"][0]["window"]["val"]
    assert split["feedback"][0] == val[0] and split["selection"][1] == val[1]
    assert split["selection"][0] - split["feedback"][1] == 2  # the tiny preset's embargo
    # every checkpoint keeps the loop's state (resume) and the gate its epoch was validated with
    from numbarl.run.runio import RunDir

    run = RunDir.open(out)
    _, state = run.load_checkpoint("latest", prefix="params/")
    assert state["feedback"]["e2_updates"] == 2 and len(state["feedback_gate"]) == N_BUCKETS


def test_e3_refits_the_support_at_the_gamma_it_sets(tmp_path, monkeypatch):
    """train.e3_refit_support: each time E3 moves gamma the fitted support is refitted from the replay's returns at
    the new gamma (numbarl/rl/support.py's rule: v = |R_n| quantile x a factor at least the spread factor
    1/sqrt(1 - gamma^(2n)) of that gamma), and the train records after it carry that support; without E3 or without
    a fitted support the switch is a config error."""
    from numbarl import config as config_mod
    from numbarl.rl.support import horizon_factor

    monkeypatch.setenv("NUMBARL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    r = CliRunner().invoke(train_cmd, [*FAST, "--set", "agent.support=fit", "--set", "train.e3_dynamic_gamma=true",
                                       "--set", "train.e3_refit_support=true", "--out", str(out)], catch_exceptions=True)
    assert r.exit_code == 0, r.output + repr(r.exception)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    fb = [rec for rec in records if rec["kind"] == "feedback"]
    assert fb[0]["e3.gamma"] != 0.99 and fb[0]["e3.support_v"] > 0  # the tiny preset starts at gamma 0.99
    later = [rec for rec in records if rec["kind"] == "train" and rec["epoch"] == 2]
    assert later and all(rec["support_fits"] == 2 for rec in later)
    assert later[-1]["support_v_max"] == pytest.approx(fb[0]["e3.support_v"], rel=1e-6)
    log = (out / "train.log").read_text()
    line = next(x for x in log.splitlines() if "at E3's gamma" in x)
    factor = float(line.rsplit("horizon factor", 1)[1].strip(" )"))
    assert factor >= horizon_factor(fb[0]["e3.gamma"], 2) * (1 - 1e-3)  # the tiny preset's n_step = 2
    with pytest.raises(config_mod.ConfigError, match="e3_refit_support"):
        config_mod.resolve("tiny", sets=["train.e3_refit_support=true", "agent.support=fit"])
    with pytest.raises(config_mod.ConfigError, match="agent.support = 'fit'"):
        config_mod.resolve("tiny", sets=["train.e3_refit_support=true", "train.e3_dynamic_gamma=true",
                                         "agent.support=fixed"])


def test_a_validation_window_too_short_to_split_fails_before_any_output(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBARL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    r = CliRunner().invoke(train_cmd, [*FAST, "--set", "train.e2_adaptive_epsilon=true", "--set", "train.feedback_split=0.03",
                                       "--out", str(out)], catch_exceptions=True)
    assert r.exit_code != 0
    assert "feedback_split" in r.output and not out.exists()


def test_e4_autopsy_blames_each_rule_hand_computed():
    from numbarl.env.params import BR_DIRECTION, BR_SIZE, BR_STOP, BR_TARGET

    mid = np.full(30, 100.0)
    high = mid + 0.1
    low = mid - 0.1
    vol = np.full(30, 1.0)
    high[13] = 101.5  # after trade 0's stop exit (bar 12, held 2 bars): price 1.5 vol its way -> stop
    high[21] = 101.2  # inside trade 1 (bars 20..23): MFE 1.2 vol, closed at a loss -> target
    cols = ["policy", "entry_bar", "exit_bar", "side", "size", "pnl", "exit_reason"]
    t = pd.DataFrame([(0, 10, 12, 1, 1.0, -5.0, "stop"),
                      (0, 20, 23, 1, 1.0, -5.0, "close"),
                      (0, 2, 4, -1, 4.0, -50.0, "close"),   # largest size, loss beyond the median -> size
                      (0, 5, 7, -1, 1.0, -1.0, "close"),    # never 1 vol its way -> direction
                      (0, 25, 27, 1, 1.0, 8.0, "close")],   # a winner: not blamed
                     columns=cols)
    blame = loop.autopsy(t, mid, high, low, vol, max_size=4.0)
    want = np.zeros(4)
    want[[BR_STOP, BR_TARGET, BR_SIZE, BR_DIRECTION]] = 1
    np.testing.assert_array_equal(blame, want)
    # shares 0.5, 0.25, 0.25, 0 (mean 0.25) -> scales 2, 1, 1, 0.5 (clipped)
    np.testing.assert_allclose(loop.branch_lr_scales(np.array([2.0, 1.0, 1.0, 0.0])), [2.0, 1.0, 1.0, 0.5])
    np.testing.assert_allclose(loop.branch_lr_scales(np.zeros(4)), np.ones(4))


def test_split_advantage_groups_keep_the_step_bitwise_and_scale_each_branch():
    """With the advantage GEMM split into one optimizer group per branch and every rate equal, the
    Adam step is bit for bit the unsplit one; a branch's own rate moves only its columns."""
    from numbarl.config import PRESETS
    from numbarl.rl.agents.dqn import DQNAgent

    cfg = PRESETS["tiny"].agent
    agents = [DQNAgent(cfg, 12, (3, 3, 4, 4), 4, seed=3, branch_lr=b) for b in (False, True)]
    split = agents[1]
    assert [g for g in split.optim.groups if g.startswith("head.adv")] == [
        "head.adv.direction", "head.adv.size", "head.adv.target", "head.adv.stop"]
    rng = np.random.default_rng(0)
    g = rng.normal(size=agents[0].store.flat("grads").shape[0]).astype(np.float32)
    s = stream()
    for a in agents:
        a.store.begin_step()
        a.store.flat("grads").copy_to_device(g)
        a.optim.step(s)
    s.synchronize()
    p0, p1 = (a.store.flat("params").copy_to_host() for a in agents)
    np.testing.assert_array_equal(p0, p1)
    # only the size branch's rate set to 0: its columns stop moving, the others still move
    before = split.store.flat("params").copy_to_host()
    split.optim.set_lr(0.0, group="head.adv.size")
    split.store.begin_step()
    split.store.flat("grads").copy_to_device(g)
    split.optim.step(s)
    s.synchronize()
    after = split.store.flat("params").copy_to_host()
    gid = split.optim.state["group_id"].copy_to_host()
    size_group = split.optim.group_index("head.adv.size")
    assert np.array_equal(after[gid == size_group], before[gid == size_group])
    assert not np.array_equal(after[gid == split.optim.group_index("head.adv.stop")],
                              before[gid == split.optim.group_index("head.adv.stop")])
    labels = split._branch_labels("head.adv")
    w = [n for n in labels if split.store.specs[n].shape[-1] == labels[n].shape[-1]]
    assert labels[w[0]].shape[-1] == (3 + 3 + 4 + 4) * cfg.n_atoms
