"""The recursive-confidence head (numbarl/rl/nets/confidence.py) and its cross-entropy against the
bootstrapped target (numbarl/rl/losses/confidence.py): hand-computed cases of the target rule, finite
differences of the float64 references, the kernel and the head against the references on odd shapes, the
trunk gradient as the sum of the C51 and confidence heads' parts (the gradient ledger), the agent's train
step with agent.confidence_weight on, and the PyTorch peer (skipped without torch)."""

from dataclasses import replace

import numpy as np
import pytest
from agent_helpers import (
    build_module,
    check_aux_step_trains_the_head,
    check_input_gradient_fd,
    check_param_gradients_fd,
    check_scalar_head_forward_backward,
    check_trunk_gradient_is_the_sum_of_both_heads,
    fill_replay,
    tiny_agent,
)

from numbarl.cuda.runtime import cuda, stream
from numbarl.cuda.testing import assert_close
from numbarl.env.params import DIR_FLAT, DIR_LONG, DIR_SHORT
from numbarl.rl.losses.confidence import (
    ConfidenceLoss,
    confidence_ref,
    confidence_target_ref,
)
from numbarl.rl.nets.confidence import ConfidenceHead, sigmoid_ref

_cuda = cuda()
SIZES = (3, 2)  # the direction branch (short, flat, long) and one more
NB, MAXA = len(SIZES), max(SIZES)


def _dev(x):
    return _cuda.to_device(np.ascontiguousarray(x))


def _loss_inputs(rng, B):
    q = rng.standard_normal((B, NB, MAXA)) * 2.0
    q[:, 1, 2:] = -np.inf  # padding, as the head writes it
    rewards = rng.standard_normal(B)
    rewards[rng.random(B) < 0.25] = 0.0  # windows without a verdict
    return {"z": rng.standard_normal((B, 1)) * 2.0, "z_next": rng.standard_normal((B, 1)) * 2.0, "q": q,
            "actions": np.stack([rng.integers(0, n, B) for n in SIZES], axis=1).astype(np.int32),
            "rewards": rewards, "dones": (rng.random(B) < 0.3).astype(np.float64)}


def _ref(x, z=None):
    return confidence_ref(x["z"] if z is None else z, x["q"], x["actions"], x["rewards"], x["dones"], x["z_next"])


# ---------------------------------------------------------------------------------------------
# references: hand-computed cases and finite differences
# ---------------------------------------------------------------------------------------------
def test_hand_computed_targets():
    """q_gap = Q(long) − Q(short) = +1 (a long conviction) in every row; the rows: long and up (right), short
    and profitable (the market fell: wrong), long and a loss (wrong), flat (no verdict: bootstrap), long with
    R = 0 (no verdict: bootstrap), short with R = 0 at an episode end (1/2)."""
    q = np.zeros((6, 1, 3))
    q[:, 0, DIR_LONG], q[:, 0, DIR_SHORT] = 1.0, 0.0
    a = np.array([[DIR_LONG], [DIR_SHORT], [DIR_LONG], [DIR_FLAT], [DIR_LONG], [DIR_SHORT]])
    r = np.array([0.5, 0.5, -0.2, 0.7, 0.0, 0.0])
    done = np.array([0, 0, 1, 0, 0, 1])
    z_next = np.array([9.0, 9.0, 9.0, 0.0, np.log(3.0), 9.0])  # σ(0) = 1/2, σ(log 3) = 3/4
    y, boot = confidence_target_ref(q, a, r, done, z_next)
    np.testing.assert_allclose(y, [1.0, 0.0, 0.0, 0.5, 0.75, 0.5])
    np.testing.assert_array_equal(boot, [0, 0, 0, 1, 1, 0])
    # the docstring's example: z = 0, y = 1 → log 2 and −1/(2B); y = 1/2 → log 2 and 0
    _, per, dz, _, _, c = confidence_ref(np.zeros(6), q, a, r, done, z_next)
    assert per[0] == pytest.approx(np.log(2)) and dz[0, 0] == pytest.approx(-1 / 12) and dz[3, 0] == 0.0
    assert per[3] == pytest.approx(np.log(2)) and np.all(c == 0.5)
    # a tie q_gap = 0 never counts as right
    q[0, 0, DIR_LONG] = 0.0
    assert confidence_target_ref(q, a, r, done, z_next)[0][0] == 0.0


def test_reference_loss_is_the_cross_entropy(rng):
    x = _loss_inputs(rng, 9)
    _, per, _, y, _, c = _ref(x)
    np.testing.assert_allclose(per, -(y * np.log(c) + (1 - y) * np.log(1 - c)), rtol=1e-12)
    assert np.allclose(sigmoid_ref([-800.0, 800.0]), [0.0, 1.0])  # no overflow


def test_reference_loss_gradient_matches_finite_differences(rng):
    B = 7
    x = _loss_inputs(rng, B)
    _, _, dz, _, _, _ = _ref(x)
    eps = 1e-6
    for b in range(B):
        up, down = x["z"].copy(), x["z"].copy()
        up[b, 0] += eps
        down[b, 0] -= eps
        numeric = (_ref(x, up)[0] - _ref(x, down)[0]) / (2 * eps)
        assert abs(dz[b, 0] - numeric) <= 1e-9 + 1e-6 * abs(numeric)


def _build_head(rng, B, H, tags=(("online", True),)):
    return build_module(ConfidenceHead("conf", H), rng, B, tags)


def test_reference_head_gradients_match_finite_differences(rng):
    """The chain h → head → cross-entropy: ∂L/∂h and ∂L/∂params of the composed references."""
    B, H = 5, 4
    head, _, values, _ = _build_head(rng, B, H)
    p = {k: np.asarray(v, np.float64) for k, v in values.items()}
    assert sorted(p) == ["conf.fc.b", "conf.fc.w"] and p["conf.fc.w"].shape == (H, 1)
    h = rng.standard_normal((B, H))
    x = _loss_inputs(rng, B)

    def loss_of(h_, p_):
        return _ref(x, head.forward_ref(h_, p_)[0])[0]

    z, cache = head.forward_ref(h, p)
    dz = _ref(x, z)[2]
    dh, grads = head.backward_ref(dz, cache, p)
    check_input_gradient_fd(rng, lambda h_: loss_of(h_, p), h, dh, 2 * B * H)
    check_param_gradients_fd(rng, lambda p_: loss_of(h, p_), p, grads, 2 * H)


# ---------------------------------------------------------------------------------------------
# kernels against the references
# ---------------------------------------------------------------------------------------------
def _f32(x):
    return {k: (v.astype(np.float32) if v.dtype == np.float64 else v) for k, v in x.items()}


def _run_loss(f, B, epsilon=1e-6):
    loss = ConfidenceLoss(B, SIZES, epsilon)
    s = stream()
    loss.apply({"logits": _dev(f["z"]), "target_logits": _dev(f["z_next"]), "q": _dev(f["q"]),
                "actions": _dev(f["actions"]), "rewards": _dev(f["rewards"]), "dones": _dev(f["dones"])},
               {"logits": loss.grad("logits")}, s)
    return loss


def test_loss_kernel_matches_reference(rng):
    B = 19  # not a multiple of the block
    x = _loss_inputs(rng, B)
    x["z"][0, 0] = 40.0  # saturated logits stay finite
    x["z"][1, 0] = -40.0
    f = _f32(x)
    loss_ref, per_ref, dz_ref, y_ref, boot_ref, c_ref = confidence_ref(f["z"], f["q"], f["actions"], f["rewards"],
                                                                       f["dones"], f["z_next"])
    assert 0 < boot_ref.sum() < B and np.any(y_ref == 1) and np.any(y_ref == 0)  # every kind of target is drawn
    loss = _run_loss(f, B)
    assert_close(loss.loss.copy_to_host()[0], loss_ref, 1e-6, 1e-5)
    assert_close(loss.per_sample.copy_to_host(), per_ref, 1e-6, 1e-5)
    assert_close(loss.grad("logits").copy_to_host(), dz_ref, 1e-7, 1e-5)
    assert_close(loss.target.copy_to_host(), y_ref, 1e-7, 1e-5)
    assert_close(loss.confidence.copy_to_host(), c_ref, 1e-7, 1e-5)
    np.testing.assert_array_equal(loss.bootstrapped.copy_to_host(), boot_ref)


def test_loss_kernel_action_outside_its_branch_is_nan():
    f = {"z": np.zeros((2, 1), np.float32), "z_next": np.zeros((2, 1), np.float32),
         "q": np.zeros((2, NB, MAXA), np.float32), "actions": np.array([[DIR_LONG, 0], [3, 0]], np.int32),
         "rewards": np.ones(2, np.float32), "dones": np.zeros(2, np.float32)}
    loss = _run_loss(f, 2)
    per = loss.per_sample.copy_to_host()
    assert np.isfinite(per[0]) and np.isnan(per[1]) and np.isnan(loss.loss.copy_to_host()[0])
    assert loss.grad("logits").copy_to_host()[1, 0] == 0
    with pytest.raises(ValueError):
        ConfidenceLoss(2, (2, 2))  # no long action in the direction branch
    with pytest.raises(ValueError):
        ConfidenceLoss(2, SIZES, epsilon=-1.0)


def test_head_forward_and_backward_match_reference(rng):
    B, H = 5, 7
    head, store, values, _ = _build_head(rng, B, H)
    check_scalar_head_forward_backward(rng, head, store, values, B, H)


def test_trunk_gradient_is_the_sum_of_both_heads(rng):
    """The confidence head adds its input gradient into the C51 head's dh; the trunk's backward runs
    once on the sum (agent_helpers.check_trunk_gradient_is_the_sum_of_both_heads)."""
    check_trunk_gradient_is_the_sum_of_both_heads(rng, lambda h: ConfidenceHead("conf", h), lambda b: (b, 1))


# ---------------------------------------------------------------------------------------------
# the agent (agent.confidence_weight > 0): an auxiliary loss on the aux train steps
# ---------------------------------------------------------------------------------------------
AGENT_SIZES = (3, 3, 4, 4)
STATE_DIM, N_ENVS = 5, 4


def _agent(**kw):
    return tiny_agent(STATE_DIM, AGENT_SIZES, N_ENVS, batch_size=4, confidence_weight=0.5, **kw)


def test_agent_train_step_with_confidence_trains_the_head_and_the_trunk(rng):
    agent = _agent(aux_frequency=2)
    assert agent.aux_every == 2 and {"train", "train_aux"} <= set(agent.step_functions(env=None))
    assert "head.conf" in agent.optim.groups and "grad_norm.head.conf" in agent.stats_layout
    fill_replay(agent, rng, done_rate=0.2, count=13)
    s = stream()
    names, before, target, _ = check_aux_step_trains_the_head(agent, s, "conf.")
    assert names == ["conf.fc.w", "conf.fc.b"]
    target = {k: np.asarray(v, np.float64) for k, v in target.items()}
    batch = agent.replay.batch
    actions, rewards, dones = batch.action.copy_to_host(), batch.reward.copy_to_host(), batch.done.copy_to_host()
    # z′: the head with TARGET parameters on the target network's trunk output at next_obs
    h_t, _ = agent.trunk.forward_ref(batch.next_obs.copy_to_host(), target)
    z_next_ref, _ = agent.conf_head.forward_ref(h_t, target)
    z_next = agent.conf_head.output("target").copy_to_host()
    assert_close(z_next, z_next_ref, 1e-5, 1e-4)
    # z: the head with the step's (pre-update) parameters on the online pass's trunk output
    z = agent.conf_head.output("online").copy_to_host()
    z_ref, _ = agent.conf_head.forward_ref(agent.trunk.output("online").copy_to_host(),
                                           {k: np.asarray(v, np.float64) for k, v in before.items()})
    assert_close(z, z_ref, 1e-5, 1e-4)
    q = agent.head.outputs("online").q.copy_to_host()
    loss_ref, _, dz_ref, _, boot_ref, c_ref = confidence_ref(z, q, actions, rewards, dones, z_next)
    # the gradient the head's backward read is weight · ∂L/∂z (Loss.apply)
    assert_close(agent.conf_loss.grad("logits").copy_to_host(), 0.5 * dz_ref, 1e-7, 1e-5)
    stats = agent.read_stats(s)
    assert stats["confidence_loss"] > 0 and stats["confidence_loss"] == pytest.approx(loss_ref, rel=1e-5)
    assert stats["confidence_mean"] == pytest.approx(float(c_ref.mean()), rel=1e-5)
    assert stats["confidence_boot_frac"] == pytest.approx(float(boot_ref.mean()), abs=1e-6)
    # a step without the auxiliary losses leaves the head's gradients at zero, the trunk's not
    agent.train_step(s, aux=False)
    s.synchronize()
    grads = agent.store.to_host("grads")
    assert all(np.all(grads[n] == 0) for n in names) and np.any(grads["trunk.fc0.w"] != 0)


def test_agent_confidence_adds_to_the_trunk_gradient(rng):
    """With the weight on, the trunk's gradient on an aux step differs from the same step without the head by
    exactly the head's part: the float64 reference of the trunk's backward fed dh_c51 + weight · dh_conf."""
    agent = _agent(aux_frequency=1)
    fill_replay(agent, rng, done_rate=0.2, count=13)
    s = stream()
    params = {k: np.asarray(v, np.float64) for k, v in agent.store.to_host("params").items()}
    agent.train_step(s, aux=True)
    s.synchronize()
    grads = agent.store.to_host("grads")
    obs = agent.replay.batch.obs.copy_to_host()
    h, trunk_cache = agent.trunk.forward_ref(obs, params)
    _, c51_cache = agent.head.forward_ref(h, params)
    dh_c51, _ = agent.head.backward_ref(agent.logits_grad_host(), c51_cache, params)
    _, conf_cache = agent.conf_head.forward_ref(h, params)
    dh_conf, _ = agent.conf_head.backward_ref(agent.conf_loss.grad("logits").copy_to_host(), conf_cache, params)
    _, g_sum = agent.trunk.backward_ref(dh_c51 + dh_conf, trunk_cache, params)
    _, g_c51 = agent.trunk.backward_ref(dh_c51, trunk_cache, params)
    assert_close(grads["trunk.fc0.w"], g_sum["trunk.fc0.w"], 1e-5, 1e-4)
    assert not np.allclose(g_sum["trunk.fc0.w"], g_c51["trunk.fc0.w"], rtol=1e-3, atol=1e-7)


def test_agent_confidence_with_iqn_and_iql_sums_four_heads(rng):
    """IQN, IQL and the confidence head together: one aux step trains all three and the trunk, finite (the dh
    the C51 head writes is IQN's; the others add)."""
    agent = _agent(aux_frequency=2, iqn=True, iqn_quantiles=2, iqn_embed=3, iql=True, iql_hidden=4)
    fill_replay(agent, rng, done_rate=0.2, count=13)
    s = stream()
    agent.train_step(s, aux=True)
    s.synchronize()
    grads = agent.store.to_host("grads")
    for prefix in ("iqn.", "iql.", "conf."):
        names = [n for n in grads if n.startswith(prefix)]
        assert names and all(np.any(grads[n] != 0) and np.all(np.isfinite(grads[n])) for n in names), prefix
    stats = agent.read_stats(s)
    assert stats["iqn_loss"] > 0 and stats["iql_loss"] > 0 and stats["confidence_loss"] > 0


def test_agent_confidence_off_declares_nothing():
    from numbarl.rl.agents.dqn import DQNAgent

    agent = _agent(aux_frequency=3)
    plain = DQNAgent(replace(agent.cfg, confidence_weight=0.0), STATE_DIM, AGENT_SIZES, N_ENVS, seed=1)
    assert plain.conf_head is None and not any(n.startswith("conf.") for n in plain.store.specs)
    assert "confidence_loss" not in plain.stats_layout and plain.aux_every == 1
    assert not any(n.startswith("conf.") for n in plain.acts.views)
    assert agent.aux_every == 3
    # the other parameters keep their init with the head on (it is declared last)
    on, off = agent.store.to_host("params"), plain.store.to_host("params")
    assert all(np.array_equal(on[k], off[k]) for k in off)


def test_config_checks_the_confidence_fields():
    from numbarl.config import AgentConfig, ConfigError

    AgentConfig(confidence_weight=0.5, weight_decay_groups="head.conf").validate()
    for bad in ({"confidence_weight": -0.1}, {"confidence_epsilon": -1.0}, {"confidence_weight": float("nan")}):
        with pytest.raises(ConfigError):
            AgentConfig(**bad).validate()
    with pytest.raises(ConfigError):
        AgentConfig(weight_decay_groups="head.conf").validate()  # no such group with the head off
    with pytest.raises(ConfigError):
        AgentConfig(kind="ppo", confidence_weight=0.5).validate()
    AgentConfig(confidence_weight=0.5, confidence_floor=0.6).validate()
    for bad in ({"confidence_floor": 0.5}, {"confidence_weight": 0.5, "confidence_floor": 1.0},
                {"confidence_weight": 0.5, "confidence_floor": -0.1}):  # the gate needs the trained head, floor < 1
        with pytest.raises(ConfigError):
            AgentConfig(**bad).validate()


# ---------------------------------------------------------------------------------------------
# the PyTorch peer: the same weights, h, h_next and Q → the same loss and gradients
# ---------------------------------------------------------------------------------------------
def test_torch_peer_matches_numbarl(rng):
    pytest.importorskip("torch")
    from numbarl.rl.torch_peer import confidence_loss_and_grads

    B, H = 13, 6
    head, store, values, _ = _build_head(rng, B, H, tags=(("online", True), ("target", False)))
    target_values = {k: v + np.float32(0.1) * rng.standard_normal(v.shape).astype(np.float32) for k, v in values.items()}
    store.load(target_values, role="target")
    h = rng.standard_normal((B, H)).astype(np.float32)
    h_next = rng.standard_normal((B, H)).astype(np.float32)
    f = _f32(_loss_inputs(rng, B))
    loss = ConfidenceLoss(B, SIZES)
    s = stream()
    z_next = head.forward(_dev(h_next), s, tag="target", role="target")
    z = head.forward(_dev(h), s, tag="online")
    loss.apply({"logits": z, "target_logits": z_next, "q": _dev(f["q"]), "actions": _dev(f["actions"]),
                "rewards": _dev(f["rewards"]), "dones": _dev(f["dones"])}, {"logits": loss.grad("logits")}, s)
    dh = head.backward(loss.grad("logits"), s, tag="online").copy_to_host()
    grads = store.to_host("grads")
    peer = confidence_loss_and_grads(values, h, target_values, h_next, f["q"], f["actions"], f["rewards"], f["dones"])

    def rel_close(a, b, what):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= 1e-5 * max(np.max(np.abs(b)), 1e-30), what

    assert float(loss.loss.copy_to_host()[0]) == pytest.approx(peer["loss"], rel=1e-5)
    rel_close(loss.per_sample.copy_to_host(), peer["per_sample"], "per_sample")
    rel_close(loss.target.copy_to_host(), peer["y"], "y")
    rel_close(loss.confidence.copy_to_host(), peer["c"], "c")
    rel_close(loss.grad("logits").copy_to_host(), peer["dz"], "dz")
    rel_close(dh, peer["dh"], "dh")
    for name in head.param_names:
        rel_close(grads[name], peer["grads"][name], name)


# ---------------------------------------------------------------------------------------------
# the use: the selectivity gate on new entries (agent.confidence_floor)
# ---------------------------------------------------------------------------------------------
def test_gate_by_hand_and_kernels_match_reference():
    """Five envs, position column 1: c = σ(z) = (0.12, 0.5, 0.88, 0.12, 0.5) against floor 0.5: env 0 (flat,
    c < floor) gated; env 1 (c = floor) not; env 2 confident; env 3 in a position (never gated: holding and
    exits stay); env 4 flat with c = 1/2 (not below the floor). Gated entries leave the mask, flat stays."""
    from numbarl.rl.nets.confidence import (
        ConfidenceGate,
        apply_mask_ref,
        apply_scores_ref,
        confidence_scores_kernel,
        gate_ref,
    )

    z = np.array([[-2.0], [0.0], [2.0], [-2.0], [0.0]], np.float32)
    obs = np.zeros((5, 3), np.float32)
    obs[3, 1] = -0.5  # env 3 holds a short
    gated = gate_ref(z, obs, 1, 0.5)
    np.testing.assert_array_equal(gated, [True, False, False, False, False])
    mask = np.ones((5, NB, MAXA), np.uint8)
    want = apply_mask_ref(mask, gated)
    assert want[0, 0].tolist() == [0, 1, 0] and want[1:].all() and want[0, 1].all()
    # the mask kernel through the gate (the head is the identity on a one-column h: w = 1, b = 0)
    head, store, _, _ = _build_head(np.random.default_rng(0), 5, 1, tags=(("act", False),))
    store.load({"conf.fc.w": np.ones((1, 1), np.float32), "conf.fc.b": np.zeros(1, np.float32)})
    gate = ConfidenceGate(head, 0.5, 5, position_col=1)
    s = stream()
    d_mask = _dev(mask)
    gate.on_mask(_dev(z), _dev(obs), d_mask, s, tag="act")
    np.testing.assert_array_equal(d_mask.copy_to_host(), want)
    np.testing.assert_array_equal(gate.gated.copy_to_host(), gated.astype(np.float32))
    q = np.random.default_rng(1).standard_normal((5, NB, MAXA)).astype(np.float32)
    d_q = _dev(q)
    confidence_scores_kernel[1, 5, s](_dev(z), _dev(obs), np.int64(1), np.float32(0.5), d_q)
    np.testing.assert_array_equal(d_q.copy_to_host(), apply_scores_ref(q, gated))
    with pytest.raises(ValueError):
        ConfidenceGate(head, 1.0, 5, 1)


def test_tiny_run_with_the_gate_on():
    """Agent + env (the learner-trace setup) with floor 0.99 on an untrained head (c near 1/2 everywhere):
    every flat env's entries are gated at collect (the replay keeps the gated mask), the diagnostics show it,
    and the greedy backtest never enters."""
    from numbarl.bench.train import _market
    from numbarl.config import AgentConfig
    from numbarl.env.backtest import backtest
    from numbarl.env.device import DeviceEnv
    from numbarl.env.params import EnvParams
    from numbarl.rl.agents.dqn import DQNAgent

    s = stream()
    params = EnvParams(sizes=(0.25, 0.5, 1.0), size_step=0.25)
    market = _market(200, 8, 1).to_device(params.vol_span, params.vol_horizon_bars)
    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=64, n_step=1, confidence_weight=0.5,
                      confidence_floor=0.99)
    env = DeviceEnv(market, params, 4, bar_range=(0, 150), seed=3)
    agent = DQNAgent(cfg, env.state_dim, params.branch_sizes, 4, 3, eval_batch=1, epsilon=(1.0, 0.05, 8))
    assert agent.conf_gate.position_col == env.position_column
    env.reset(3, s)
    for t in range(4):
        agent.collect_step(env, s)
        if t >= 2:
            agent.train_step(s)
    agent.diagnostics_step(env, s)
    stats = agent.read_stats(s)
    assert stats["confidence_gated_frac"] > 0 and stats["confidence_loss"] > 0
    mask = agent.replay.store["mask"].copy_to_host()
    count = int(agent.replay.count.copy_to_host()[0])
    assert (mask[:count, :, 0, DIR_LONG] == 0).any() and (mask[:count, :, 0, DIR_SHORT] == 0).any()
    result = backtest(market, (150, 200), params, q_fn=agent.scores, n_policies=1, stream=s)
    assert np.all(np.asarray(result.position) == 0)
