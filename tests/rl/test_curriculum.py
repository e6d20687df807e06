"""E8 curriculum weights: the host rule by hand, the update from validation trades, and the device
weights of sampled batches against the numpy model."""

import numpy as np
import pandas as pd
import pytest

from numbarl.cuda.runtime import cuda, stream
from numbarl.rl.feedback.curriculum import Curriculum, curriculum_weights
from numbarl.rl.feedback.regimes import N_BUCKETS, RegimeBuckets
from numbarl.rl.replay import Replay, ReplayRef

_cuda = cuda()


def _dev(x):
    return _cuda.to_device(np.ascontiguousarray(x), stream=stream())


def _host(x):
    s = stream()
    out = x.copy_to_host(stream=s)
    s.synchronize()
    return out


def test_weights_hand_computed():
    # bucket 4: 10 trades, all lost; bucket 0: 10 trades, all won; the rest: no trades
    b = np.r_[np.full(10, 4), np.zeros(10, int)]
    lost = np.r_[np.ones(10, bool), np.zeros(10, bool)]
    w = curriculum_weights(b, lost, kappa=1.0)  # rate: f_4 = 1, f_0 = 0, f̄ = 0.5
    expect = np.ones(N_BUCKETS)
    expect[4], expect[0] = 1.5, 0.5
    np.testing.assert_allclose(w, expect)
    w = curriculum_weights(b, lost, kappa=1.0, mode="share")  # f_4 = 1, f_0 = 0, f̄ = 1/9
    expect[4], expect[0] = 1 + 8 / 9, 1 - 1 / 9
    np.testing.assert_allclose(w, expect)
    w = curriculum_weights(b, lost, kappa=10.0)  # clipped to [0.5, 2]
    assert w[4] == 2.0 and w[0] == 0.5
    np.testing.assert_array_equal(curriculum_weights(b, lost, kappa=0.0), np.ones(N_BUCKETS))  # κ = 0: off
    np.testing.assert_array_equal(curriculum_weights([], [], kappa=1.0), np.ones(N_BUCKETS))  # no trades


def _features(rng, n_bars=300, n_features=4):
    f = rng.standard_normal((n_bars, n_features)).astype(np.float32)
    return f


def test_update_raises_the_failing_bucket(rng):
    feats = _features(rng)
    buckets = RegimeBuckets.fit(feats, (0, 200), ["x", "adx_14", "y", "rv_32"])
    assert (buckets.col_a, buckets.col_b) == (1, 3)
    cur = Curriculum(buckets, kappa=1.0).allocate()
    np.testing.assert_array_equal(_host(cur.table), np.ones(N_BUCKETS, np.float32))
    of = buckets.of(feats)
    # validation bars 200..299: every losing trade enters in the bucket of the first of them, winners elsewhere
    val = np.arange(200, 300)
    target = of[val[0]]
    losers = val[of[val] == target][:6]
    winners = val[of[val] != target][:20]
    trades = pd.DataFrame({"entry_bar": np.r_[losers, winners], "exit_bar": np.r_[losers, winners] + 1,
                           "pnl": np.r_[-np.ones(losers.size), np.ones(winners.size)]})
    w = cur.update(trades, feats)
    assert set(w) == {f"curriculum_w{k}" for k in range(N_BUCKETS)}
    assert w[f"curriculum_w{target}"] == max(w.values()) > 1.0
    assert all(v <= 1.0 for k, v in w.items() if k != f"curriculum_w{target}")
    np.testing.assert_array_equal(_host(cur.table), np.array([w[f"curriculum_w{k}"] for k in range(N_BUCKETS)], np.float32))
    np.testing.assert_array_equal(cur.counts[0], np.bincount(of[trades["entry_bar"]], minlength=N_BUCKETS))
    assert cur.summary()["curriculum_weight_max"] == w[f"curriculum_w{target}"]
    with pytest.raises(ValueError, match="entry bars"):
        cur.update(pd.DataFrame({"entry_bar": [300], "pnl": [1.0]}), feats)


def test_sampled_weights_match_the_numpy_model(rng):
    """Device batch weights with the bucket factor == ReplayRef's bits; indices unchanged; the
    effective sampling frequency of each bucket (its share of the batch's weight) == the model's."""
    N, D, B = 3, 4, 37
    feats = _features(rng, 400, D)
    buckets = RegimeBuckets(1, 3, tuple(float(np.float32(e)) for e in (-0.4, 0.4, -0.5, 0.3)))
    cur = Curriculum(buckets, kappa=1.0).allocate()
    table = np.linspace(0.5, 2.0, N_BUCKETS).astype(np.float32)
    cur.arena.load({"table": table})
    kw = {"capacity": 12 * N, "n_envs": N, "state_dim": D, "n_branches": 1, "batch_size": B, "n_step": 2, "gamma": 0.9, "seed": 4,
              "weights": True}
    buf = Replay(normalize_weights=True, **kw).allocate()
    plain = Replay(**kw).allocate()
    ref = ReplayRef(buf.n_slots, N, D, 1, 2, 0.9, 4)
    for t in range(15):
        obs = feats[rng.integers(0, 400, N)]
        action = rng.integers(0, 3, (N, 1)).astype(np.int32)
        reward = rng.standard_normal(N).astype(np.float32)
        done = np.zeros(N, np.uint8)
        w = (1.0 + (rng.random(N) < 0.3)).astype(np.float32)  # some rows marked (E6 composes)
        for r in (buf, plain):
            r.write(_dev(obs), _dev(action), _dev(reward), _dev(done), stream(), weight=_dev(w))
        ref.write(obs, action, reward, done, w)
    ctr = _dev(np.array([9], np.int64))
    batch = buf.sample(ctr, stream(), factor=cur)
    got_w, got_idx, got_obs = _host(batch.weight), _host(batch.index), _host(batch.obs)
    np.testing.assert_array_equal(got_idx, _host(plain.sample(ctr, stream()).index))
    expect = ref.sample(B, 9, normalize=True, factor=(1, 3, buckets.edges_array(), table))
    np.testing.assert_array_equal(got_idx, expect["index"])
    np.testing.assert_array_equal(got_w, expect["weight"])
    np.testing.assert_array_equal(_host(buf.weight_stats), expect["weight_stats"])
    # effective frequency per bucket: the share of the loss weight each bucket gets
    bk = buckets.of(got_obs)
    assert len(set(bk.tolist())) >= 4  # several buckets are drawn
    stored = ref.weight[got_idx // N, got_idx % N].astype(np.float64)
    model = stored * table[bk]
    freq = np.bincount(bk, weights=got_w, minlength=N_BUCKETS) / B
    np.testing.assert_allclose(freq, np.bincount(bk, weights=model, minlength=N_BUCKETS) / model.sum(), rtol=1e-5)
    assert abs(got_w.astype(np.float64).mean() - 1.0) < 1e-5
