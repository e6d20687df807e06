"""Multi-horizon C51 (agent.horizons): the regime blend by hand, the loss kernels vs the float64
reference, finite differences of the reference, the PyTorch peer, the replay's extra horizons vs its
host model, and the agent with the switch on (simulator, tiny shapes)."""

import numpy as np
import pytest

from numbarl.cuda.runtime import cuda, stream
from numbarl.rl.losses.c51 import C51Loss
from numbarl.rl.losses.multi_horizon import (
    MultiHorizonC51Loss,
    blend_weights_ref,
    multi_horizon_loss_ref,
    parse_horizons,
    trend_strength_ref,
)
from numbarl.rl.nets.c51_head import make_support
from numbarl.rl.replay import Replay, ReplayRef

_cuda = cuda()
SIZES = (2, 3)
Z = 7
V = 2.0


def _dev(x):
    return _cuda.to_device(np.ascontiguousarray(x), stream=stream())


# ---------------------------------------------------------------------------------------------
# the regime blend, by hand
# ---------------------------------------------------------------------------------------------
def test_blend_hand_computed():
    s = np.array([0.0, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(blend_weights_ref(s, 3, 1.0), [[1, 0, 0, 0], [0, 1, 0.5, 0], [0, 0, 0.5, 1]])
    # mix = 0.5: one half spread evenly (1/6 each), one half on the regime's horizon
    np.testing.assert_allclose(blend_weights_ref([0.0], 3, 0.5)[:, 0], [2 / 3, 1 / 6, 1 / 6])
    np.testing.assert_allclose(blend_weights_ref(s, 3, 0.0), np.full((3, 4), 1 / 3))
    np.testing.assert_allclose(blend_weights_ref(np.linspace(0, 1, 9), 3, 0.7).sum(axis=0), 1.0)
    # ADX 0.1 (no trend) -> 0, 0.3 -> 0.5, 0.5 -> 1, NaN -> 0
    np.testing.assert_allclose(trend_strength_ref([0.1, 0.3, 0.5, np.nan], 0.2, 0.4), [0, 0.5, 1, 0])
    assert parse_horizons("20, 1,5,5") == (1, 5, 20) and parse_horizons("") == ()
    with pytest.raises(ValueError, match="comma list"):
        parse_horizons("1,x")


# ---------------------------------------------------------------------------------------------
# the loss: kernels vs the float64 reference, FD of the reference
# ---------------------------------------------------------------------------------------------
def _problem(rng, batch, horizons, state_dim=4, masks=True):
    na = max(SIZES)
    logits = rng.normal(0, 1, (batch, len(SIZES), na, Z)).astype(np.float32)
    actions = np.stack([rng.integers(0, n, batch) for n in SIZES], 1).astype(np.int32)
    obs = rng.normal(0.3, 0.15, (batch, state_dim)).astype(np.float32)  # column 1: an ADX-like level
    hs = []
    for h in horizons:
        tp = rng.random((batch, len(SIZES), na, Z)).astype(np.float32) + 0.01
        tp /= tp.sum(-1, keepdims=True)
        item = {"next_q": rng.normal(0, 1, (batch, len(SIZES), na)).astype(np.float32),
                "target_probs": tp.astype(np.float32),
                "rewards": rng.normal(0, 0.5 * h, batch).astype(np.float32),
                "dones": (rng.random(batch) < 0.2).astype(np.float32),
                "discounts": np.full(batch, 0.9**h, np.float32)}
        if masks:
            item["next_mask"] = (rng.random((batch, len(SIZES), na)) < 0.7).astype(np.uint8)
        hs.append(item)
    return logits, actions, obs, hs


def _run_device(logits, actions, obs, hs, horizons, primary, weights=None, mix=0.5):
    batch = logits.shape[0]
    losses = [C51Loss(batch, SIZES, Z, -V, V) for _ in horizons]
    mh = MultiHorizonC51Loss(losses, horizons, primary=primary, regime_col=1, trend_lo=0.2, trend_hi=0.4, mix=mix)
    x = {"logits": _dev(logits), "actions": _dev(actions), "obs": _dev(obs),
         "horizons": [{k: _dev(v) for k, v in h.items()} for h in hs]}
    if weights is not None:
        x["weights"] = _dev(weights)
    d_logits = losses[primary].d_logits
    s = stream()
    mh.apply(x, {"logits": d_logits}, s)
    out = {"loss": mh.loss.copy_to_host(stream=s)[0], "d_logits": d_logits.copy_to_host(stream=s),
           "weights": mh.weights.copy_to_host(stream=s), "trend": mh.trend.copy_to_host(stream=s),
           "parts": np.array([lo.loss.copy_to_host(stream=s)[0] for lo in losses]),
           "ce": np.array([lo.per_sample.copy_to_host(stream=s) for lo in losses])}
    s.synchronize()
    return out


@pytest.mark.parametrize("weighted", [False, True])
def test_loss_matches_reference(rng, weighted):
    horizons, batch = (1, 3, 6), 9
    logits, actions, obs, hs = _problem(rng, batch, horizons)
    w = rng.uniform(0.5, 1.5, batch).astype(np.float32) if weighted else None
    got = _run_device(logits, actions, obs, hs, horizons, primary=1, weights=w)
    loss, parts, d_logits, beta, trend, ce = multi_horizon_loss_ref(
        logits, actions, obs, hs, make_support(Z, -V, V), SIZES, 1, 0.2, 0.4, 0.5, weights=w)
    np.testing.assert_allclose(got["trend"], trend, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["weights"], beta * (1 if w is None else w), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got["parts"], parts, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got["ce"], ce, rtol=1e-5, atol=1e-6)
    assert got["loss"] == pytest.approx(loss, rel=1e-5)
    assert np.max(np.abs(got["d_logits"] - d_logits)) <= 1e-5 * np.max(np.abs(d_logits))
    assert 0.0 < trend.mean() < 1.0  # the problem exercises the blend's interior


def test_destination_rule_and_order(rng):
    """Whichever horizon owns the destination goes first, the result is the same blend (up to the
    float32 order of the adds); two calls give the same bits (overwrite, not accumulate across calls)."""
    horizons, batch = (1, 4), 6
    logits, actions, obs, hs = _problem(rng, batch, horizons, masks=False)
    a = _run_device(logits, actions, obs, hs, horizons, primary=0)
    b = _run_device(logits, actions, obs, hs, horizons, primary=1)
    np.testing.assert_allclose(a["d_logits"], b["d_logits"], rtol=1e-6, atol=1e-9)
    assert a["loss"] == b["loss"]  # the total sums the parts in ascending order either way
    c = _run_device(logits, actions, obs, hs, horizons, primary=0)
    assert a["d_logits"].tobytes() == c["d_logits"].tobytes()


def test_reference_gradient_by_finite_differences(rng):
    horizons, batch = (1, 2, 5), 4
    logits, actions, obs, hs = _problem(rng, batch, horizons)
    w = rng.uniform(0.5, 1.5, batch)
    support = make_support(Z, -V, V)
    args = (actions, obs, hs, support, SIZES, 1, 0.2, 0.4, 0.6)
    x = logits.astype(np.float64)
    _, _, grad, *_ = multi_horizon_loss_ref(x, *args, weights=w)
    eps = 1e-6
    rows = np.arange(batch)
    for k in range(len(SIZES)):
        for z in (0, 3, Z - 1):
            idx = (rows, k, actions[:, k], z)
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            num = (multi_horizon_loss_ref(xp, *args, weights=w)[0] - multi_horizon_loss_ref(xm, *args, weights=w)[0])
            # perturbing all B rows at once: the sum of their partials (rows are independent)
            assert num / (2 * eps) == pytest.approx(grad[idx].sum(), rel=1e-6, abs=1e-9)
    # off the taken actions the gradient is zero
    taken = np.zeros(x.shape, bool)
    for k in range(len(SIZES)):
        taken[rows, k, actions[:, k]] = True
    assert np.all(grad[~taken] == 0.0)


def test_torch_peer_matches_reference(rng):
    torch = pytest.importorskip("torch")
    from numbarl.rl.torch_peer_mh import multi_horizon_loss_and_grads

    horizons, batch = (1, 3, 7), 8
    logits, actions, obs, hs = _problem(rng, batch, horizons)
    w = rng.uniform(0.5, 1.5, batch).astype(np.float32)
    support = make_support(Z, -V, V)
    peer = multi_horizon_loss_and_grads(logits, actions, obs, hs, support, SIZES, regime_col=1, trend_lo=0.2,
                                        trend_hi=0.4, mix=0.5, weights=w, device="cpu")
    loss, parts, d_logits, *_ = multi_horizon_loss_ref(logits, actions, obs, hs, support, SIZES, 1, 0.2, 0.4,
                                                              0.5, weights=w)
    assert peer["loss"] == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(peer["parts"], parts, rtol=1e-5)
    assert np.max(np.abs(peer["d_logits"] - d_logits)) <= 1e-5 * np.max(np.abs(d_logits))
    del torch


# ---------------------------------------------------------------------------------------------
# the replay's extra horizons vs its host model
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("history", [0, 2])
def test_replay_horizons_match_host_model(rng, history):
    """The extra horizons' windows against the host model, also with a temporal input's history (the
    oldest `history` times skipped once the ring wrapped, the longest horizon's window kept whole)."""
    N, D, nb, na, B = 3, 2, 2, 3, 24
    n_step, extra = 2, (1, 5)
    buf = Replay(capacity=9 * N, n_envs=N, state_dim=D, n_branches=nb, batch_size=B, n_step=n_step, gamma=0.8,
                 seed=5, max_actions=na, horizons=extra).allocate()
    buf.set_history(history)
    ref = ReplayRef(9, N, D, nb, n_step, 0.8, 5, horizons=extra, history=history)
    assert buf.min_writes == 6 and buf.window == 5
    s = stream()
    counter = _dev(np.zeros(1, np.int64))
    for t in range(13):  # wraps the 9-slot ring
        obs = rng.standard_normal((N, D)).astype(np.float32)
        action = rng.integers(0, na, (N, nb)).astype(np.int32)
        reward = rng.standard_normal(N).astype(np.float32)
        done = (rng.random(N) < 0.25).astype(np.uint8)
        mask = (rng.random((N, nb, na)) < 0.7).astype(np.uint8)
        buf.write(_dev(obs), _dev(action), _dev(reward), _dev(done), s, mask=_dev(mask))
        ref.write(obs, action, reward, done, None, mask)
        if t in (4, 5, 12):  # before min_writes (empty), the first valid draw, after the wrap
            counter.copy_to_device(np.array([t], np.int64), stream=s)
            batch = buf.sample(counter, s)
            want = ref.sample(B, t)
            np.testing.assert_array_equal(batch.index.copy_to_host(stream=s), want["index"])
            np.testing.assert_allclose(batch.reward.copy_to_host(stream=s), want["reward"], rtol=1e-6, atol=1e-6)
            assert [hb.horizon for hb in batch.horizons] == list(extra)
            for hb, hw in zip(batch.horizons, want["horizons"]):
                np.testing.assert_allclose(hb.reward.copy_to_host(stream=s), hw["reward"], rtol=1e-6, atol=1e-6)
                np.testing.assert_allclose(hb.discount.copy_to_host(stream=s), hw["discount"], rtol=1e-6)
                np.testing.assert_array_equal(hb.done.copy_to_host(stream=s), hw["done"])
                np.testing.assert_array_equal(hb.next_index.copy_to_host(stream=s), hw["next_index"])
                np.testing.assert_array_equal(hb.next_obs.copy_to_host(stream=s), hw["next_obs"].astype(np.float32))
                np.testing.assert_array_equal(hb.next_mask.copy_to_host(stream=s), hw["next_mask"])
            if t == 4:
                assert np.all(want["index"] == -1)
            if t == 12:  # slots hold times 4..12; the longest window (5) and the history bound τ
                slots = want["index"] // N
                times = np.where(slots >= 4, slots, slots + 9)
                assert set(times.tolist()) == set(range(4 + history, 12 - 5 + 1))
    s.synchronize()


# ---------------------------------------------------------------------------------------------
# the agent with agent.horizons on
# ---------------------------------------------------------------------------------------------
def test_agent_train_step_matches_reference(rng):
    """One train step of a tiny agent with horizons (1, 2, 4), n_step = 2, the lock-aware target and
    the regime column 1: the logged loss and the d_logits the backward read are the blended reference
    on the step's own buffers; the stats are written."""
    from agent_helpers import fill_replay

    from numbarl.config import AgentConfig
    from numbarl.rl.agents.dqn import DQNAgent

    cfg = AgentConfig(trunk=(8,), n_atoms=Z, v_min=-V, v_max=V, batch_size=6, replay_capacity=12 * 2, n_step=2,
                      gamma=0.9, horizons="4,1,2", horizon_regime_col=1, horizon_trend_lo=-0.5, horizon_trend_hi=0.5,
                      lock_aware_target=True, target_update="polyak")
    agent = DQNAgent(cfg, 5, SIZES, 2, seed=4)
    assert agent.horizons == (1, 2, 4) and agent.extra_horizons == (1, 4) and agent.replay.min_writes == 5
    fill_replay(agent, rng, done_rate=0.15)
    s = stream()
    agent.train_step(s)
    s.synchronize()
    b = agent.replay.batch
    def host(x):
        return x.copy_to_host()

    hs = []
    for h in agent.horizons:
        if h == cfg.n_step:
            src, nq, tp = b, agent.head.outputs("next").q, agent.head.outputs("target").probs
        else:
            src = {hb.horizon: hb for hb in b.horizons}[h]
            nq, tp = agent.head.outputs(f"next_h{h}").q, agent.head.outputs(f"target_h{h}").probs
        hs.append({"next_q": host(nq), "target_probs": host(tp), "rewards": host(src.reward), "dones": host(src.done),
                   "discounts": host(src.discount), "next_mask": host(src.next_mask)})
    assert not np.array_equal(hs[0]["rewards"], hs[2]["rewards"])  # the horizons' windows differ
    loss, _, d_logits, beta, trend, ce = multi_horizon_loss_ref(
        host(agent.head.outputs("online").logits), host(b.action), host(b.obs), hs, make_support(Z, -V, V), SIZES,
        1, -0.5, 0.5, cfg.horizon_mix)
    got = host(agent.loss.d_logits)
    assert np.max(np.abs(got - d_logits)) <= 1e-5 * np.max(np.abs(d_logits))
    stats = agent.read_stats(s)
    assert stats["loss"] == pytest.approx(loss, rel=1e-5)
    assert stats["mh_trend_mean"] == pytest.approx(trend.mean(), rel=1e-5, abs=1e-7)
    assert stats["mh_weight_longest"] == pytest.approx(beta[-1].mean(), rel=1e-5)
    for h, c in zip(agent.horizons, ce):
        assert stats[f"mh_ce.h{h}"] == pytest.approx(c.mean(), rel=1e-5)
    assert stats["mh_ce_longest"] == stats["mh_ce.h4"] > 0


def test_config_checks():
    from numbarl.config import AgentConfig, ConfigError

    AgentConfig(n_step=5, horizons="1,5,20").validate()
    for bad in ("5", "1,20", "1,x,5", "0,5"):
        with pytest.raises(ConfigError, match="agent.horizons"):
            AgentConfig(n_step=5, horizons=bad).validate()
    with pytest.raises(ConfigError, match="horizon_trend_hi"):
        AgentConfig(n_step=5, horizons="1,5", horizon_trend_lo=0.5, horizon_trend_hi=0.5).validate()
