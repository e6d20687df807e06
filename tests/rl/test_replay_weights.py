"""Weighted replay batches (normalization to mean 1) and E6 winner distillation, device vs numpy."""

import numpy as np
import pytest

from numbarl.cuda.runtime import cuda, stream
from numbarl.env.params import EXIT_CLOSE, EXIT_NONE, EXIT_STOP
from numbarl.rl.feedback.replay_weights import (
    WinnerDistillation,
    WinnerDistillationRef,
    winner_threshold,
)
from numbarl.rl.replay import NORM_BLOCK, Replay, ReplayRef, normalize_weights_ref

_cuda = cuda()


def _dev(x):
    return _cuda.to_device(np.ascontiguousarray(x), stream=stream())


def _host(x):
    s = stream()
    out = x.copy_to_host(stream=s)
    s.synchronize()
    return out


def _write(buf, ref, rng, weights):
    N, D = buf.n_envs, buf.state_dim
    obs = rng.standard_normal((N, D)).astype(np.float32)
    action = rng.integers(0, 3, size=(N, buf.n_branches)).astype(np.int32)
    reward = rng.standard_normal(N).astype(np.float32)
    done = (rng.random(N) < 0.2).astype(np.uint8)
    w = (rng.random(N) * 3).astype(np.float32) if weights else None
    buf.write(_dev(obs), _dev(action), _dev(reward), _dev(done), stream(), weight=None if w is None else _dev(w))
    if ref is not None:
        ref.write(obs, action, reward, done, w)


# ---------------------------------------------------------------------------------------------
# the weighted batch
# ---------------------------------------------------------------------------------------------
def test_normalize_reference_hand_computed():
    w, (mean, mx) = normalize_weights_ref(np.array([1.0, 3.0, 0.0, 4.0], np.float32), block=2)
    np.testing.assert_array_equal(w, np.array([0.5, 1.5, 0.0, 2.0], np.float32))  # Σ = 8, B = 4
    assert mean == 2.0 and mx == 2.0
    w, (mean, mx) = normalize_weights_ref(np.zeros(3, np.float32), block=4)  # an empty batch stays 0
    assert (w == 0).all() and mean == 0.0
    w, _ = normalize_weights_ref(np.ones(5, np.float32), block=4, factor=np.array([2, 2, 1, 1, 4], np.float32))
    np.testing.assert_array_equal(w, np.array([2, 2, 1, 1, 4], np.float32) * np.float32(5 / 10))


def test_weighted_batch_matches_reference_and_keeps_indices(rng):
    """normalize_weights: same indices as the plain buffer, weights = the numpy model's bits."""
    N, D, B = 3, 2, 2 * NORM_BLOCK + 3  # rows per thread differ: the fixed order matters
    kw = {"capacity": 15, "n_envs": N, "state_dim": D, "n_branches": 1, "batch_size": B, "n_step": 2, "gamma": 0.9, "seed": 7, "weights": True}
    buf = Replay(normalize_weights=True, **kw).allocate()
    plain = Replay(**kw).allocate()
    ref = ReplayRef(buf.n_slots, N, D, 1, 2, 0.9, 7)
    for t in range(8):
        state = rng.bit_generator.state
        _write(buf, ref, rng, weights=True)
        rng.bit_generator.state = state
        _write(plain, None, rng, weights=True)
    ctr = _dev(np.array([5], np.int64))
    got = buf.sample(ctr, stream())
    w, idx, stats = _host(got.weight), _host(got.index), _host(buf.weight_stats)
    base = plain.sample(ctr, stream())
    np.testing.assert_array_equal(idx, _host(base.index))
    expect = ref.sample(B, 5, normalize=True)
    np.testing.assert_array_equal(idx, expect["index"])
    np.testing.assert_array_equal(w, expect["weight"])
    np.testing.assert_array_equal(stats, expect["weight_stats"])
    assert abs(float(w.astype(np.float64).mean()) - 1.0) < 1e-5
    raw = _host(base.weight)
    np.testing.assert_allclose(w, raw * B / raw.astype(np.float64).sum(), rtol=1e-5)
    assert stats[1] == w.max() and abs(stats[0] - raw.astype(np.float64).mean()) < 1e-5
    mapped = _dev(np.zeros(3, np.float32))
    buf.copy_weight_stats(mapped, stream(), slot_mean=2, slot_max=0)
    np.testing.assert_array_equal(_host(mapped), np.array([stats[1], 0.0, stats[0]], np.float32))


def test_unmarked_batch_is_exactly_one_and_empty_stays_zero(rng):
    buf = Replay(capacity=8, n_envs=2, state_dim=1, n_branches=1, batch_size=5, n_step=1, gamma=0.9,
                 normalize_weights=True).allocate()
    ctr = _dev(np.array([0], np.int64))
    _write(buf, None, rng, weights=False)
    assert (_host(buf.sample(ctr, stream()).weight) == 0).all()  # empty: no division by zero
    _write(buf, None, rng, weights=False)
    w = _host(buf.sample(ctr, stream()).weight)
    assert w.dtype == np.float32 and (w == np.float32(1.0)).all()  # bitwise 1.0: the loss sees unit weights
    with pytest.raises(ValueError, match="normalize_weights"):
        Replay(capacity=8, n_envs=2, state_dim=1, n_branches=1, batch_size=5).allocate().sample(ctr, stream(), factor=object())


# ---------------------------------------------------------------------------------------------
# E6: the threshold
# ---------------------------------------------------------------------------------------------
def test_winner_threshold_hand_computed():
    assert winner_threshold(np.arange(1.0, 11.0), 0.1) == 10.0  # top 10% of 10 trades: the best one
    assert winner_threshold(np.arange(1.0, 21.0)[::-1], 0.1) == 19.0  # order does not matter: the top 2
    assert winner_threshold(-np.arange(1.0, 21.0), 0.1) == np.nextafter(0.0, 1.0)  # no loser is a winner
    assert winner_threshold(np.arange(5.0), 0.1, min_trades=10) == float("inf")
    with pytest.raises(ValueError):
        winner_threshold(np.arange(20.0), 0.0)


# ---------------------------------------------------------------------------------------------
# E6: the marking kernel on a scripted env
# ---------------------------------------------------------------------------------------------
def _script(rng, n_envs, steps):
    """Per step: the env outputs/state the mark kernel reads, and the ground-truth trades
    (env, entry step, exit step, P&L summed per exit step as the env reports it)."""
    cursor = rng.integers(100, 200, n_envs)
    pos = np.zeros(n_envs, np.float32)
    entry_bar = np.zeros(n_envs, np.int32)
    entry_step = np.full(n_envs, -1)
    trades, frames = [], []
    for t in range(steps):
        bar = cursor.copy()
        exit_reason = np.zeros(n_envs, np.int32)
        pnl = np.zeros(n_envs)
        for j in range(n_envs):
            u = rng.random()
            if pos[j] == 0:
                if u < 0.35:  # entry filled at this step's close
                    entry_step[j], entry_bar[j], pos[j] = t, bar[j], rng.choice([-1.0, 1.0])
                    if rng.random() < 0.25:  # stopped out on the next bar: opened and closed in one step
                        exit_reason[j], pnl[j] = EXIT_STOP, rng.normal()
                        trades.append((j, t, t, pnl[j]))
                        pos[j], entry_bar[j], entry_step[j] = 0, 0, -1
            elif u < 0.15:  # close by the agent, sometimes a reversal into a new trade
                exit_reason[j], pnl[j] = EXIT_CLOSE, rng.normal()
                trades.append((j, entry_step[j], t, pnl[j]))
                pos[j], entry_bar[j], entry_step[j] = 0, 0, -1
                if rng.random() < 0.3:
                    entry_step[j], entry_bar[j], pos[j] = t, bar[j], rng.choice([-1.0, 1.0])
        cursor = cursor + 1
        reset = (pos == 0) & (rng.random(n_envs) < 0.2)  # done while flat: soft reset elsewhere
        cursor[reset] = rng.integers(100, 200, int(reset.sum()))
        frames.append({"trade_pnl": pnl, "exit_reason": exit_reason, "bar": bar.astype(np.int32),
                           "position": pos.copy(), "entry_bar": entry_bar.copy()})
    return frames, trades


class _Arrays:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _truth(trades, count, n_slots, n_envs, theta, theta_step, weight):
    """The weight store after `count` steps from the script alone: rows of the winning trades
    closed once θ was set, as far as they are still in the ring; other written rows 1, unwritten 0."""
    truth = np.zeros((n_slots, n_envs), np.float32)
    truth[[tau % n_slots for tau in range(max(0, count - n_slots), count)]] = 1.0
    for j, a, b, p in trades:
        if theta_step <= b < count and p >= theta:
            for tau in range(max(a, count - n_slots), b + 1):
                truth[tau % n_slots, j] = weight
    return truth


@pytest.mark.parametrize("n_slots", [5, 40])  # a ring shorter than the trades, and one that holds them all
def test_mark_matches_reference_and_ground_truth(rng, n_slots):
    N, steps, kappa = 3, 36, 1.5
    frames, trades = _script(rng, N, steps)
    buf = Replay(capacity=n_slots * N, n_envs=N, state_dim=1, n_branches=1, batch_size=4, n_step=1).allocate()
    wd = WinnerDistillation(N, boost=kappa, log_capacity=4, min_trades=1).allocate()
    ref = WinnerDistillationRef(N, boost=kappa, log_capacity=4)
    ref_w = np.zeros((n_slots, N), np.float32)  # rows never written hold 0
    theta_step = 12  # θ = +inf before (nothing marked), then the top half of the trades so far
    theta = float("inf")
    boosted_steps = clipped = 0
    for t, f in enumerate(frames):
        if t == theta_step:
            logged = wd.trade_pnls()
            np.testing.assert_array_equal(logged, ref.trade_pnls())
            theta = wd.epoch_threshold(top_frac=0.5)
            assert theta == winner_threshold(logged, 0.5, 1) and np.isfinite(theta)
            ref.threshold = theta
            ref.log_count[:] = 0
        _write(buf, None, rng, weights=False)  # the step's row (weight 1.0), then the mark
        ref_w[t % n_slots] = 1.0
        out = _Arrays(trade_pnl=_dev(f["trade_pnl"]), exit_reason=_dev(f["exit_reason"]), bar=_dev(f["bar"]))
        st = _Arrays(position=_dev(f["position"]), entry_bar=_dev(f["entry_bar"]))
        wd.mark(out, st, buf, stream())
        ref.mark(f["trade_pnl"], f["exit_reason"], f["bar"], f["position"], f["entry_bar"], ref_w, t + 1)
        got = _host(buf.weight_store)
        np.testing.assert_array_equal(got, ref_w, err_msg=f"step {t}")
        truth = _truth(trades, t + 1, n_slots, N, theta, theta_step, np.float32(1.0 + kappa))
        np.testing.assert_array_equal(got, truth, err_msg=f"step {t}")
        boosted_steps += bool((truth > 1.0).any())
        clipped += sum(1 for j, a, b, p in trades if b == t and b >= theta_step and p >= theta and b - a + 1 > n_slots)
    assert boosted_steps > 3  # the case is not trivial
    if n_slots == 5:  # a winner longer than the ring: its overwritten rows were left alone
        assert clipped > 0
    c = wd.counters()
    assert c["winner_rows_marked"] == int(ref.marked_rows.sum()) > 0
    assert c["winner_trades_marked"] == int(ref.marked_trades.sum()) == sum(
        1 for _, _, b, p in trades if b >= theta_step and p >= theta)
    stats = _dev(np.zeros(4, np.float32))
    wd.write_stats(stats, stream(), slot_rows=0, slot_trades=2, slot_threshold=3)
    np.testing.assert_array_equal(_host(stats), np.array([c["winner_rows_marked"], 0, c["winner_trades_marked"],
                                                          theta], np.float32))


def test_marked_rows_raise_the_sampled_weight(rng):
    """End to end: a winner's rows come back from the weighted sampler with weight (1 + κ) / mean."""
    N, T = 2, 6
    buf = Replay(capacity=T * N, n_envs=N, state_dim=1, n_branches=1, batch_size=16, n_step=1, seed=3,
                 normalize_weights=True).allocate()
    wd = WinnerDistillation(N, boost=1.0).allocate()
    wd.set_threshold(1.0)
    script = [  # env 0 enters at step 1 (bar 11), exits at step 3 with P&L 2 ≥ θ; env 1 loses
        {"trade_pnl": [0, 0], "exit_reason": [EXIT_NONE, EXIT_NONE], "bar": [10, 50], "position": [0, 1], "entry_bar": [0, 50]},
        {"trade_pnl": [0, 0], "exit_reason": [EXIT_NONE, EXIT_NONE], "bar": [11, 51], "position": [1, 1], "entry_bar": [11, 50]},
        {"trade_pnl": [0, 0], "exit_reason": [EXIT_NONE, EXIT_NONE], "bar": [12, 52], "position": [1, 1], "entry_bar": [11, 50]},
        {"trade_pnl": [2, -1], "exit_reason": [EXIT_STOP, EXIT_CLOSE], "bar": [13, 53], "position": [0, 0], "entry_bar": [0, 0]},
        {"trade_pnl": [0, 0], "exit_reason": [EXIT_NONE, EXIT_NONE], "bar": [14, 54], "position": [0, 0], "entry_bar": [0, 0]},
    ]
    for f in script:
        _write(buf, None, rng, weights=False)
        out = _Arrays(trade_pnl=_dev(np.array(f["trade_pnl"], np.float64)),
                      exit_reason=_dev(np.array(f["exit_reason"], np.int32)), bar=_dev(np.array(f["bar"], np.int32)))
        st = _Arrays(position=_dev(np.array(f["position"], np.float32)),
                     entry_bar=_dev(np.array(f["entry_bar"], np.int32)))
        wd.mark(out, st, buf, stream())
    expect = np.ones((T, N), np.float32)
    expect[1:4, 0] = 2.0  # steps 1..3 of env 0
    expect[5] = 0.0  # not written yet
    np.testing.assert_array_equal(_host(buf.weight_store), expect)
    batch = buf.sample(_dev(np.array([1], np.int64)), stream())
    idx, w = _host(batch.index), _host(batch.weight)
    boosted = np.isin(idx, [1 * N + 0, 2 * N + 0, 3 * N + 0])
    assert boosted.any() and (~boosted).any()
    raw = np.where(boosted, 2.0, 1.0)
    np.testing.assert_allclose(w, raw * 16 / raw.sum(), rtol=1e-6)
    assert w[boosted].min() == pytest.approx(2 * w[~boosted].max())
