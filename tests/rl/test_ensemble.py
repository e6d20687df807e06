"""The bootstrapped ensemble of C51 heads and the epistemic entry gate (agent.ensemble_heads,
agent.epistemic_theta; numbarl/rl/nets/ensemble.py): the score by hand and its kernel, the Bernoulli
masks (deterministic, replayable, the reference's draws), the gate on a hand-built case (exactly the
entries with budget · u > θ, never hold or close, never a non-flat env), the extra heads' masked C51
losses and the trunk gradient in the agent's train step against the float64 reference (finite
differences) and a PyTorch peer, and a tiny agent + env run with the gate on."""

import numpy as np
import pytest
from agent_helpers import fill_replay

from numbarl.config import AgentConfig, ConfigError
from numbarl.cuda.runtime import cuda, stream
from numbarl.env.params import DIR_FLAT, DIR_LONG, DIR_SHORT
from numbarl.rl.nets.c51_head import head_backward_ref, head_forward_ref
from numbarl.rl.nets.ensemble import (
    MASK_SLOT,
    bootstrap_mask_ref,
    bootstrap_masks,
    direction_q,
    direction_q_ref,
    ensemble_c51_loss_ref,
    epistemic_mask_kernel,
    epistemic_score,
    epistemic_score_ref,
    epistemic_scores_kernel,
    gate_ref,
)

_cuda = cuda()
_LOWEST = np.float32(-3.4028235e38)
SIZES = (3, 2, 3)  # direction (short, flat, long), two more branches


def test_score_by_hand_and_kernel(rng):
    assert epistemic_score_ref(np.array([1.0, 2.0, 3.0])[:, None, None])[0, 0] == pytest.approx(np.sqrt(2 / 3))
    assert epistemic_score_ref(np.full((4, 1, 1), 0.7))[0, 0] == 0.0  # agreeing heads: no epistemic spread
    s = stream()
    dir_q = rng.normal(0, 1, (3, 5, 2)).astype(np.float32)  # M = 3 heads, 5 rows (not a block multiple), 2 sides
    score = _cuda.to_device(np.zeros((5, 2), np.float32))
    epistemic_score(_cuda.to_device(dir_q), score, s)
    np.testing.assert_allclose(score.copy_to_host(), epistemic_score_ref(dir_q), rtol=1e-6, atol=1e-7)


def test_direction_q_gathers_sides_and_taken(rng):
    s = stream()
    q = rng.normal(0, 1, (3, 5, len(SIZES), 3)).astype(np.float32)  # 3 heads' Q [N, n_branches, max_actions]
    actions = np.stack([rng.integers(0, n, 5) for n in SIZES], -1).astype(np.int32)
    sides = _cuda.to_device(np.zeros((3, 5, 2), np.float32))
    direction_q([_cuda.to_device(x) for x in q], sides, s)
    np.testing.assert_array_equal(sides.copy_to_host(), direction_q_ref(q))
    taken = _cuda.to_device(np.zeros((3, 5, 1), np.float32))
    direction_q([_cuda.to_device(x) for x in q], taken, s, actions=_cuda.to_device(actions))
    np.testing.assert_array_equal(taken.copy_to_host(), direction_q_ref(q, actions))


def test_bootstrap_masks_are_deterministic_and_replayable():
    s = stream()
    rows = np.array([0, 7, 123456, -1, 40, 41, 9], np.int64)  # -1: an unfilled sample (row 0's mask)
    out = _cuda.to_device(np.full((3, rows.size), -5.0, np.float32))
    bootstrap_masks(11, _cuda.to_device(rows), out, s)
    first = out.copy_to_host()
    np.testing.assert_array_equal(first, bootstrap_mask_ref(11, rows, 3))
    assert set(np.unique(first)) <= {0.0, 1.0}
    np.testing.assert_array_equal(first[:, 3], first[:, 0])
    bootstrap_masks(11, _cuda.to_device(rows), out, s)  # the same (seed, row, head): the same mask, any step
    np.testing.assert_array_equal(out.copy_to_host(), first)
    w = np.linspace(0.5, 2.0, rows.size).astype(np.float32)  # E6/E8 batch weights multiply in
    bootstrap_masks(11, _cuda.to_device(rows), out, s, weights=_cuda.to_device(w))
    np.testing.assert_allclose(out.copy_to_host(), first * w[None, :], rtol=0, atol=0)
    other = bootstrap_mask_ref(12, rows, 3)
    many = bootstrap_mask_ref(5, np.arange(800), 2)  # Bernoulli(1/2), independent heads
    assert abs(many.mean() - 0.5) < 0.05 and abs((many[0] == many[1]).mean() - 0.5) < 0.07
    assert not np.array_equal(bootstrap_mask_ref(5, np.arange(64), 1), other[:1, :1].repeat(64, 1))
    assert MASK_SLOT == 250


def test_gate_blocks_exactly_the_entries_above_theta():
    """Hand-built scores: env 0 flat, short above θ; env 1 flat, both above; env 2 flat, both below; env 3 in a
    position (never gated); env 4 flat, exactly θ (not above: allowed)."""
    s = stream()
    theta = np.float32(0.5)
    score = np.array([[0.9, 0.1], [0.6, 0.7], [0.2, 0.3], [5.0, 5.0], [0.5, 0.5]], np.float32)
    n, pos = score.shape[0], 2
    obs = np.zeros((n, 4), np.float32)
    obs[3, pos] = 1.0
    mask = np.ones((n, len(SIZES), 3), np.uint8)
    mask[:, 1, 2] = 0  # padding of the two-action branch stays as it was
    dev = {k: _cuda.to_device(v) for k, v in (("score", score), ("obs", obs), ("mask", mask))}
    blocked, flat = _cuda.to_device(np.zeros(n, np.uint8)), _cuda.to_device(np.zeros(n, np.uint8))
    budget = _cuda.to_device(np.zeros(1, np.float32))
    no_ready = _cuda.to_device(np.zeros(2))
    on = _cuda.to_device(np.ones(1, np.uint8))
    epistemic_mask_kernel[1, n, s](dev["score"], theta, no_ready, False, on, dev["obs"], np.int64(pos), dev["mask"],
                                   blocked, flat, budget)
    got = dev["mask"].copy_to_host()
    gated = gate_ref(score, obs[:, pos] == 0, theta)
    np.testing.assert_array_equal(gated, [[1, 0], [1, 1], [0, 0], [0, 0], [0, 0]])
    expected = mask.copy()
    expected[:, 0, DIR_SHORT] = np.where(gated[:, 0], 0, 1)
    expected[:, 0, DIR_LONG] = np.where(gated[:, 1], 0, 1)
    np.testing.assert_array_equal(got, expected)
    assert got[:, 0, DIR_FLAT].all() and (got[:, 1:] == mask[:, 1:]).all()  # hold / close and other branches untouched
    np.testing.assert_array_equal(blocked.copy_to_host(), [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(flat.copy_to_host(), [1, 1, 1, 0, 1])
    # greedy scores: the same entries at the lowest float32, nothing else
    q = np.arange(n * len(SIZES) * 3, dtype=np.float32).reshape(n, len(SIZES), 3)
    d_q = _cuda.to_device(q)
    epistemic_scores_kernel[1, n, s](dev["score"], theta, no_ready, False, dev["obs"], np.int64(pos), d_q)
    want = q.copy()
    want[:, 0, DIR_SHORT] = np.where(gated[:, 0], _LOWEST, q[:, 0, DIR_SHORT])
    want[:, 0, DIR_LONG] = np.where(gated[:, 1], _LOWEST, q[:, 0, DIR_LONG])
    np.testing.assert_array_equal(d_q.copy_to_host(), want)
    # the risk budget (IQN readiness²): 0 before the first IQN step gates nothing; readiness 1/2 halves u
    for state, want_gated in ((np.array([-1.0, -1.0]), np.zeros((n, 2), bool)),
                              (np.array([2.0, 1.0]), gate_ref(score, obs[:, pos] == 0, theta, budget=0.25))):
        d_mask = _cuda.to_device(mask)
        epistemic_mask_kernel[1, n, s](dev["score"], theta, _cuda.to_device(state), True, on, dev["obs"],
                                       np.int64(pos), d_mask, blocked, flat, budget)
        m = d_mask.copy_to_host()
        np.testing.assert_array_equal(m[:, 0, [DIR_SHORT, DIR_LONG]] == 0, want_gated)
    assert budget.copy_to_host()[0] == np.float32(0.25)
    # the agent's switch off (the trainer's prefill): nothing gated, the flat envs still recorded
    d_mask, off = _cuda.to_device(mask), _cuda.to_device(np.zeros(1, np.uint8))
    epistemic_mask_kernel[1, n, s](dev["score"], theta, no_ready, False, off, dev["obs"], np.int64(pos), d_mask,
                                   blocked, flat, budget)
    np.testing.assert_array_equal(d_mask.copy_to_host(), mask)
    np.testing.assert_array_equal(blocked.copy_to_host(), [0, 0, 0, 0, 0])
    np.testing.assert_array_equal(flat.copy_to_host(), [1, 1, 1, 0, 1])


def test_config_switches_and_errors():
    AgentConfig(ensemble_heads=5, epistemic_theta=0.1).validate()
    AgentConfig(ensemble_heads=1).validate()  # 0 / 1: off
    with pytest.raises(ConfigError, match="agent.ensemble_heads >= 2"):
        AgentConfig(ensemble_heads=1, epistemic_theta=0.1).validate()
    with pytest.raises(ConfigError, match="agent.ensemble_heads"):
        AgentConfig(ensemble_heads=17).validate()
    with pytest.raises(ConfigError, match="agent.epistemic_theta"):
        AgentConfig(ensemble_heads=3, epistemic_theta=-1.0).validate()
    with pytest.raises(ConfigError, match="agent.ensemble_heads"):
        AgentConfig(kind="ppo", ensemble_heads=3).validate()
    if "adaptive_atoms" in AgentConfig.__dataclass_fields__:
        with pytest.raises(ConfigError, match="not combined yet"):
            AgentConfig(ensemble_heads=3, adaptive_atoms=True).validate()


# --- the agent's train step: the extra heads' losses, their gradients and the trunk's dh ----------------------
CFG = AgentConfig(trunk=(6,), n_atoms=5, batch_size=5, replay_capacity=12, n_step=1, ensemble_heads=3,
                  aux_frequency=1, v_min=-2.0, v_max=2.0)


def _reference_step(agent, params, target):
    """float64: per extra head m its double-DQN target from its own next / target passes, the masked C51 loss,
    d_logits, its parameter gradients and its dh; plus the loss of the online h alone (for finite differences)."""
    batch = agent.replay.batch
    h = agent.trunk.output("online").copy_to_host().astype(np.float64)
    h_next = agent.trunk.output("next").copy_to_host()
    h_target = agent.trunk.output("target").copy_to_host()
    actions, rewards = batch.action.copy_to_host(), batch.reward.copy_to_host()
    dones, discounts = batch.done.copy_to_host(), batch.discount.copy_to_host()
    masks = bootstrap_mask_ref(agent.seed, batch.index.copy_to_host(), len(agent.ens_heads))
    support = agent.head.support_host
    out = []
    for m, head in enumerate(agent.ens_heads):
        n = head.param_names
        w = [params[n[k]] for k in ("w_value", "b_value", "w_adv", "b_adv")]
        wt = [target[n[k]] for k in ("w_value", "b_value", "w_adv", "b_adv")]
        _, _, next_q = head_forward_ref(h_next, *w, SIZES, support)
        _, target_probs, _ = head_forward_ref(h_target, *wt, SIZES, support)

        def loss_of(hh, w=w, next_q=next_q, target_probs=target_probs, m=m):
            logits, _, _ = head_forward_ref(hh, *w, SIZES, support)
            return ensemble_c51_loss_ref(logits, actions, next_q, target_probs, rewards, dones, discounts, support,
                                         SIZES, masks[m])

        loss, d_logits = loss_of(h)
        g = head_backward_ref(h, w[0], w[2], d_logits, SIZES)
        out.append({"loss": loss, "d_logits": d_logits, "g": g, "loss_of": loss_of, "names": n})
    return h, masks, out, (actions, rewards, dones, discounts)


def test_train_step_matches_reference_finite_differences_and_torch(rng):
    from numbarl.rl.agents.dqn import DQNAgent

    agent = DQNAgent(CFG, 7, SIZES, 2, seed=4)
    assert len(agent.ens_heads) == 2 and agent.aux_every == 1
    fill_replay(agent, rng, done_rate=0.2)
    s = stream()
    params = {k: np.asarray(v, np.float64) for k, v in agent.store.to_host("params").items()}
    target = {k: np.asarray(v, np.float64) for k, v in agent.store.to_host("target").items()}
    agent.train_step(s)
    s.synchronize()
    h, masks, ref, batch_arrays = _reference_step(agent, params, target)
    np.testing.assert_array_equal(agent.ens_state["mask"].copy_to_host(), masks)
    grads = agent.store.to_host("grads")
    dh_extra = np.zeros_like(h)
    for m, r in enumerate(ref):
        loss = agent.ens_losses[m]
        assert float(loss.loss.copy_to_host()[0]) == pytest.approx(r["loss"], rel=1e-5)
        np.testing.assert_allclose(loss.d_logits.copy_to_host(), r["d_logits"], rtol=1e-4, atol=1e-6)
        n = r["names"]
        for key, gkey in (("w_value", "dw_value"), ("b_value", "db_value"), ("w_adv", "dw_adv"), ("b_adv", "db_adv")):
            np.testing.assert_allclose(grads[n[key]], r["g"][gkey], rtol=1e-4, atol=1e-6)
        dh_extra += r["g"]["dh"]
        # the reference gradient against central finite differences of the reference loss
        eps, i, j = 1e-6, 1, 2
        hp, hm = h.copy(), h.copy()
        hp[i, j] += eps
        hm[i, j] -= eps
        fd = (r["loss_of"](hp)[0] - r["loss_of"](hm)[0]) / (2 * eps)
        assert r["g"]["dh"][i, j] == pytest.approx(fd, rel=1e-5, abs=1e-9)
    # the trunk's dh = the C51 head's (its own d_logits) + the extra heads', in that order (the gradient ledger)
    main = agent.head.param_names
    dh_main = head_backward_ref(h, params[main["w_value"]], params[main["w_adv"]],
                                agent.logits_grad_host(), SIZES)["dh"]
    dh = agent.aux_state["dh"].copy_to_host()
    np.testing.assert_allclose(dh, dh_main + dh_extra, rtol=1e-4, atol=1e-6)
    # ensemble_std: the batch mean of the heads' std of Q at the taken direction
    q_heads = [head_forward_ref(h, *[params[x.param_names[k]] for k in ("w_value", "b_value", "w_adv", "b_adv")],
                                SIZES, agent.head.support_host)[2] for x in (agent.head, *agent.ens_heads)]
    u = epistemic_score_ref(direction_q_ref(q_heads, batch_arrays[0]))
    stats = agent.read_stats(s)
    assert stats["ensemble_std"] == pytest.approx(float(u.mean()), rel=1e-4) and stats["ensemble_std"] > 0
    # the PyTorch peer (autograd through the same heads and losses)
    pytest.importorskip("torch")
    from numbarl.rl.torch_peer import ensemble_heads_loss_and_grads

    dh_torch, g_torch = ensemble_heads_loss_and_grads(h, agent.trunk.output("next").copy_to_host(),
                                                      agent.trunk.output("target").copy_to_host(), params, target,
                                                      [r["names"] for r in ref], masks, *batch_arrays,
                                                      agent.head.support_host, SIZES)
    assert np.max(np.abs(dh_extra - dh_torch)) <= 1e-5 * np.max(np.abs(dh_torch))
    for m, r in enumerate(ref):
        for key in ("w_value", "b_value", "w_adv", "b_adv"):
            got, want = grads[r["names"][key]], g_torch[m][key]
            assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want)), key


def test_tiny_run_with_the_gate_on():
    """Agent + env (the learner-trace setup) with a tiny θ (every flat env's entries gated on an untrained
    ensemble): entries gated at collect (the replay keeps the gated mask), the stats show it, the extra heads
    train (their group's gradient norm), the checkpoint holds them, and the greedy backtest never enters.
    With the switch off nothing of it is built."""
    from numbarl.bench.train import _market
    from numbarl.env.backtest import backtest
    from numbarl.env.device import DeviceEnv
    from numbarl.env.params import EnvParams
    from numbarl.rl.agents.dqn import DQNAgent

    s = stream()
    params = EnvParams(sizes=(0.25, 0.5, 1.0), size_step=0.25)
    market = _market(200, 8, 1).to_device(params.vol_span, params.vol_horizon_bars)
    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=64, n_step=1, ensemble_heads=3,
                      epistemic_theta=1e-6, aux_frequency=1)
    env = DeviceEnv(market, params, 4, bar_range=(0, 150), seed=3)
    off = DQNAgent(AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=64), env.state_dim,
                   params.branch_sizes, 4, 3)
    assert off.ens_heads == () and off.ens_gate is None and not any("ens" in k for k in off.store.specs)
    agent = DQNAgent(cfg, env.state_dim, params.branch_sizes, 4, 3, eval_batch=1, epsilon=(1.0, 0.05, 8))
    assert agent.ens_gate.position_col == env.position_column
    env.reset(3, s)
    for _ in range(3):
        agent.collect_step(env, s)
    agent.train_step(s)
    agent.diagnostics_step(env, s)
    stats = agent.read_stats(s)
    assert np.isfinite(stats["ensemble_std"]) and stats["ensemble_std"] > 0
    assert stats["epistemic_blocked_frac"] > 0 and stats["epistemic_score_mean"] > 0 and stats["epistemic_budget"] == 1
    assert stats["grad_norm.head.ens"] > 0
    mask = agent.replay.store["mask"].copy_to_host()
    count = int(agent.replay.count.copy_to_host()[0])
    assert (mask[:count, :, 0, DIR_LONG] == 0).any() or (mask[:count, :, 0, DIR_SHORT] == 0).any()
    assert {"params/head.ens1.adv.w", "target/head.ens2.value.b"} <= set(agent.state_arrays())
    result = backtest(market, (150, 162), params, q_fn=agent.scores, n_policies=1, stream=s)
    assert np.all(np.asarray(result.position) == 0)  # every entry's u is above 1e-6 on an untrained ensemble
    agent.set_support(-3.0, 3.0)  # a fitted support (agent.support = "fit") reaches the extra heads and their losses
    want = agent.head.support.copy_to_host()
    for head, loss in zip(agent.ens_heads, agent.ens_losses):
        np.testing.assert_array_equal(head.support.copy_to_host(), want)
        np.testing.assert_array_equal(loss.support.copy_to_host(), want)
