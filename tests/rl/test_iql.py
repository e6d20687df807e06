"""The IQL value head (numbarl/rl/nets/iql_value.py) and its expectile loss (numbarl/rl/losses/expectile.py):
hand-computed cases (τ = 0.5 is mean regression), finite differences of the float64 references, the kernel
and the head against the references on odd shapes, the trunk gradient as the sum of the C51 and IQL heads'
contributions (the gradient ledger), the agent's train step with agent.iql on, and the PyTorch peer
(skipped without torch)."""

from dataclasses import replace

import numpy as np
import pytest
from agent_helpers import check_input_gradient_fd, check_param_gradients_fd, check_scalar_head_forward_backward
from agent_helpers import build_module, check_aux_step_trains_the_head, check_trunk_gradient_is_the_sum_of_both_heads
from agent_helpers import fill_replay

from numbarl.cuda.runtime import cuda, stream
from numbarl.cuda.testing import assert_close
from numbarl.rl.losses.expectile import ExpectileLoss, expectile_ref, taken_q_mean_ref
from numbarl.rl.nets.iql_value import IqlValueHead

_cuda = cuda()
SIZES = (3, 2)
NB, MAXA = len(SIZES), max(SIZES)


def _dev(x):
    return _cuda.to_device(np.ascontiguousarray(x))


def _loss_inputs(rng, B):
    q = rng.standard_normal((B, NB, MAXA)) * 2.0
    q[:, 1, 2:] = -np.inf  # padding, as the head writes it (never read: no action points there)
    return dict(v=rng.standard_normal((B, 1)), q=q,
                actions=np.stack([rng.integers(0, n, B) for n in SIZES], axis=1).astype(np.int32))


# ---------------------------------------------------------------------------------------------
# references: hand-computed cases and finite differences
# ---------------------------------------------------------------------------------------------
def test_hand_computed_expectile():
    """One sample, two branches: Q̂ = (Q[0, a0] + Q[1, a1]) / 2; u = Q̂ − V; w = τ or 1 − τ."""
    q = np.array([[[1.0, 3.0, 0.0], [2.0, -1.0, -np.inf]]])
    a = np.array([[1, 0]])
    assert taken_q_mean_ref(q, a)[0] == pytest.approx(2.5)
    loss, per, dv, adv = expectile_ref(np.array([[2.0]]), q, a, expectile=0.7)  # u = 0.5 ≥ 0: w = 0.7
    assert loss == pytest.approx(0.7 * 0.25) and per[0] == pytest.approx(loss) and adv[0] == pytest.approx(0.5)
    assert dv[0, 0] == pytest.approx(-2 * 0.7 * 0.5)
    loss, _, dv, adv = expectile_ref(np.array([[3.5]]), q, a, expectile=0.7)  # u = −1 < 0: w = 0.3
    assert loss == pytest.approx(0.3) and dv[0, 0] == pytest.approx(0.6) and adv[0] == -1.0


def test_half_expectile_is_mean_regression(rng):
    """τ = 0.5: L = mean u² / 2, and a constant V has zero gradient exactly at the batch mean of Q̂; τ = 0.7 puts
    the minimizer above the mean (the upper expectile)."""
    B = 7
    x = _loss_inputs(rng, B)
    q_hat = taken_q_mean_ref(x["q"], x["actions"])
    loss, _, dv, _ = expectile_ref(np.full((B, 1), q_hat.mean()), x["q"], x["actions"], expectile=0.5)
    assert abs(dv.sum()) < 1e-12 and loss == pytest.approx(0.5 * np.mean((q_hat - q_hat.mean()) ** 2))
    _, _, dv7, _ = expectile_ref(np.full((B, 1), q_hat.mean()), x["q"], x["actions"], expectile=0.7)
    assert dv7.sum() < 0  # gradient descent raises V above the mean


def test_reference_loss_gradient_matches_finite_differences(rng):
    B = 6
    x = _loss_inputs(rng, B)
    _, _, dv, _ = expectile_ref(x["v"], x["q"], x["actions"])
    eps = 1e-6
    for b in range(B):
        up, down = x["v"].copy(), x["v"].copy()
        up[b, 0] += eps
        down[b, 0] -= eps
        numeric = (expectile_ref(up, x["q"], x["actions"])[0] - expectile_ref(down, x["q"], x["actions"])[0]) / (2 * eps)
        assert abs(dv[b, 0] - numeric) <= 1e-8 + 1e-6 * abs(numeric)


def _build_head(rng, B, H, n, tags=(("online", True),)):
    return build_module(IqlValueHead("iql", H, n), rng, B, tags)


def test_reference_head_gradients_match_finite_differences(rng):
    """The chain h → value head → expectile loss: ∂L/∂h and ∂L/∂params of the composed references."""
    B, H, n = 4, 5, 6
    head, _, values, _ = _build_head(rng, B, H, n)
    p = {k: np.asarray(v, np.float64) for k, v in values.items()}
    assert sorted(p) == ["iql.fc0.b", "iql.fc0.w", "iql.out.b", "iql.out.w"]
    h = rng.standard_normal((B, H))
    x = _loss_inputs(rng, B)

    def loss_of(h_, p_):
        v, _ = head.forward_ref(h_, p_)
        return expectile_ref(v, x["q"], x["actions"])[0]

    v, cache = head.forward_ref(h, p)
    _, _, dv, _ = expectile_ref(v, x["q"], x["actions"])
    dh, grads = head.backward_ref(dv, cache, p)
    check_input_gradient_fd(rng, lambda h_: loss_of(h_, p), h, dh, 12)
    check_param_gradients_fd(rng, lambda p_: loss_of(h, p_), p, grads, 5)


# ---------------------------------------------------------------------------------------------
# kernels against the references
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("expectile", [0.7, 0.5])
def test_loss_kernel_matches_reference(rng, expectile):
    B = 19  # not a multiple of the block
    x = _loss_inputs(rng, B)
    x["v"][0, 0] = taken_q_mean_ref(x["q"], x["actions"])[0]  # an exact u = 0 is harmless
    f = {k: (v.astype(np.float32) if v.dtype == np.float64 else v) for k, v in x.items()}
    loss_ref, per_ref, dv_ref, adv_ref = expectile_ref(f["v"], f["q"], f["actions"], expectile=expectile)
    loss = ExpectileLoss(B, SIZES, expectile)
    s = stream()
    loss.apply({k: _dev(v) for k, v in f.items()}, {"v": loss.grad("v")}, s)
    assert_close(loss.loss.copy_to_host()[0], loss_ref, 1e-6, 1e-5)
    assert_close(loss.per_sample.copy_to_host(), per_ref, 1e-6, 1e-5)
    assert_close(loss.grad("v").copy_to_host(), dv_ref, 1e-7, 1e-5)
    assert_close(loss.adv.copy_to_host(), adv_ref, 1e-6, 1e-5)


def test_loss_kernel_action_outside_its_branch_is_nan():
    q = np.zeros((2, NB, MAXA), np.float32)
    loss = ExpectileLoss(2, SIZES)
    s = stream()
    loss.compute({"v": _dev(np.zeros((2, 1), np.float32)), "q": _dev(q),
                  "actions": _dev(np.array([[0, 0], [0, 2]], np.int32))}, s)
    per = loss.per_sample.copy_to_host()
    assert per[0] == 0.0 and np.isnan(per[1]) and np.isnan(loss.loss.copy_to_host()[0])
    assert np.all(loss.grad("v").copy_to_host() == 0)
    with pytest.raises(ValueError):
        ExpectileLoss(2, SIZES, expectile=1.0)


def test_head_forward_and_backward_match_reference(rng):
    B, H, n = 5, 7, 6
    head, store, values, _ = _build_head(rng, B, H, n)
    check_scalar_head_forward_backward(rng, head, store, values, B, H)


def test_trunk_gradient_is_the_sum_of_both_heads(rng):
    """The value head adds its input gradient into the C51 head's dh; the trunk's backward runs once
    on the sum (agent_helpers.check_trunk_gradient_is_the_sum_of_both_heads)."""
    check_trunk_gradient_is_the_sum_of_both_heads(rng, lambda h: IqlValueHead("iql", h, 4), lambda b: (b, 1))


# ---------------------------------------------------------------------------------------------
# the agent (agent.iql = true): an auxiliary loss on the aux train steps
# ---------------------------------------------------------------------------------------------
AGENT_SIZES = (3, 3, 4, 4)
STATE_DIM, N_ENVS = 5, 4


def _agent(**kw):
    from numbarl.config import AgentConfig
    from numbarl.rl.agents.dqn import DQNAgent

    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=10 * N_ENVS, n_step=2, gamma=0.9,
                      target_update="polyak", iql=True, iql_hidden=6, **kw)
    return DQNAgent(cfg, STATE_DIM, AGENT_SIZES, N_ENVS, seed=1)


def _fill(agent, rng, count=13):
    fill_replay(agent, rng, done_rate=0.2, count=count)


def test_agent_train_step_with_iql_trains_the_head_and_the_trunk(rng):
    agent = _agent(aux_frequency=2)
    assert agent.aux_every == 2 and {"train", "train_aux"} <= set(agent.step_functions(env=None))
    assert "head.iql" in agent.optim.groups and "grad_norm.head.iql" in agent.stats_layout
    _fill(agent, rng)
    s = stream()
    iql_names, before, target, after = check_aux_step_trains_the_head(agent, s, "iql.")
    assert len(iql_names) == 4
    assert not np.array_equal(before["trunk.fc0.w"], after["trunk.fc0.w"])
    stats = agent.read_stats(s)
    batch = agent.replay.batch
    obs, actions = batch.obs.copy_to_host(), batch.action.copy_to_host()
    # Q̂'s source is the TARGET network on obs (the step's own parameters: the update ran after the loss)
    q_t = agent.head.outputs("iql_target").q.copy_to_host()
    target64 = {k: np.asarray(v, np.float64) for k, v in target.items()}
    h_t, _ = agent.trunk.forward_ref(obs, target64)
    q_ref = agent.head.forward_ref(h_t, target64)[0].q
    rows = np.arange(obs.shape[0])[:, None]
    taken = (rows, np.arange(len(AGENT_SIZES))[None, :], actions)
    assert_close(q_t[taken], q_ref[taken], 1e-5, 1e-4)
    v_dev = agent.iql_head.output("online").copy_to_host()
    loss_ref, _, _, _ = expectile_ref(v_dev, q_t, actions, expectile=0.7)
    assert stats["iql_loss"] > 0 and stats["iql_loss"] == pytest.approx(loss_ref, rel=1e-5)
    assert stats["iql_v_mean"] == pytest.approx(float(v_dev.mean()), rel=1e-5, abs=1e-7)
    # V is the value head on the online pass's trunk output with the step's (pre-update) parameters
    h_on = agent.trunk.output("online").copy_to_host()
    v_ref, _ = agent.iql_head.forward_ref(h_on, {k: np.asarray(v, np.float64) for k, v in before.items()})
    assert_close(v_dev, v_ref, 1e-5, 1e-4)
    # the diagnostic advantage A = Q̂ − V on the same batch (target network on obs, the diag pass)
    q_diag = agent.forward(batch.obs, s, tag="diag", role="target").q
    agent._iql_diagnostics(q_diag, s)
    s.synchronize()
    v_diag = agent.iql_head.output("diag").copy_to_host()
    _, _, _, adv_ref = expectile_ref(v_diag, q_diag.copy_to_host(), actions)
    adv_mean = agent.read_stats(s)["iql_adv_mean"]
    assert adv_mean == pytest.approx(float(adv_ref.mean()), rel=1e-5, abs=1e-6) and adv_mean != 0
    # a step without the auxiliary losses leaves the value head's gradients at zero
    agent.train_step(s, aux=False)
    s.synchronize()
    grads = agent.store.to_host("grads")
    assert all(np.all(grads[n] == 0) for n in iql_names)
    assert np.any(grads["trunk.fc0.w"] != 0)


def test_agent_iql_with_iqn_sums_three_heads(rng):
    """IQN and IQL together: one aux step trains both heads and the trunk, finite."""
    agent = _agent(aux_frequency=2, iqn=True, iqn_quantiles=2, iqn_embed=3)
    assert agent.aux_every == 2
    _fill(agent, rng)
    s = stream()
    agent.train_step(s, aux=True)
    s.synchronize()
    grads = agent.store.to_host("grads")
    for prefix in ("iql.", "iqn."):
        names = [n for n in grads if n.startswith(prefix)]
        assert names and all(np.any(grads[n] != 0) and np.all(np.isfinite(grads[n])) for n in names), prefix
    stats = agent.read_stats(s)
    assert stats["iql_loss"] > 0 and stats["iqn_loss"] > 0


def test_agent_iql_off_declares_nothing():
    from numbarl.rl.agents.dqn import DQNAgent

    agent = _agent(aux_frequency=3)
    plain = DQNAgent(replace(agent.cfg, iql=False), STATE_DIM, AGENT_SIZES, N_ENVS, seed=1)
    assert plain.iql_head is None and not any(n.startswith("iql.") for n in plain.store.specs)
    assert "iql_loss" not in plain.stats_layout and "iql_adv_mean" not in plain.stats_layout and plain.aux_every == 1
    assert not any(".iql_target." in n for n in plain.acts.views)
    assert agent.aux_every == 3


def test_config_checks_the_expectile():
    from numbarl.config import AgentConfig, ConfigError

    AgentConfig(iql=True, iql_expectile=0.9).validate()
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ConfigError):
            AgentConfig(iql=True, iql_expectile=bad).validate()
    AgentConfig(iql=True, weight_decay_groups="head.iql").validate()


# ---------------------------------------------------------------------------------------------
# the PyTorch peer: the same weights, h and Q → the same loss and gradients
# ---------------------------------------------------------------------------------------------
def test_torch_peer_matches_numbarl(rng):
    pytest.importorskip("torch")
    from numbarl.rl.torch_peer import iql_loss_and_grads

    B, H, n = 6, 5, 7
    head, store, values, _ = _build_head(rng, B, H, n)
    h = rng.standard_normal((B, H)).astype(np.float32)
    x = _loss_inputs(rng, B)
    q = x["q"].astype(np.float32)
    loss = ExpectileLoss(B, SIZES, 0.7)
    s = stream()
    v = head.forward(_dev(h), s, tag="online")
    loss.apply({"v": v, "q": _dev(q), "actions": _dev(x["actions"])}, {"v": loss.grad("v")}, s)
    dh = head.backward(loss.grad("v"), s, tag="online").copy_to_host()
    grads = store.to_host("grads")
    peer = iql_loss_and_grads(values, h, q, x["actions"], SIZES, expectile=0.7, head="iql", device="cpu")

    def rel_close(a, b, what):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= 1e-5 * max(np.max(np.abs(b)), 1e-30), what

    assert float(loss.loss.copy_to_host()[0]) == pytest.approx(peer["loss"], rel=1e-5)
    rel_close(loss.per_sample.copy_to_host(), peer["per_sample"], "per_sample")
    rel_close(v.copy_to_host()[:, 0], peer["v"], "v")
    rel_close(dh, peer["dh"], "dh")
    for name in head.param_names:
        rel_close(grads[name], peer["grads"][name], name)
