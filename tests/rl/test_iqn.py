"""The IQN head (numbarl/rl/nets/iqn_head.py) and its quantile Huber loss (numbarl/rl/losses/quantile_huber.py):
finite differences of the float64 references, a hand-computed case, the kernels against the references on
odd shapes, the trunk gradient as the sum of the C51 and IQN heads' contributions (the gradient ledger),
the agent's train step with agent.iqn on, and the PyTorch peer (skipped without torch)."""

from dataclasses import replace

import numpy as np
import pytest
from agent_helpers import check_input_gradient_fd, check_param_gradients_fd
from agent_helpers import build_module, check_aux_step_trains_the_head, check_trunk_gradient_is_the_sum_of_both_heads
from agent_helpers import fill_replay

from numbarl.cuda.runtime import Arena, cuda, stream
from numbarl.cuda.testing import assert_close
from numbarl.rl.losses.quantile_huber import (
    QuantileHuberLoss,
    iqn_readiness_kernel,
    iqn_readiness_ref,
    quantile_huber_ref,
)
from numbarl.rl.nets.base import ParamStore
from numbarl.rl.nets.iqn_head import IQN_TAU_SLOT, IqnHead, cos_embedding_ref, tau_ref

_cuda = cuda()
SIZES = (3, 2)
S = sum(SIZES)


def _dev(x):
    return _cuda.to_device(np.ascontiguousarray(x))


def _loss_inputs(rng, B, N, Np, mask=False):
    x = dict(
        quantiles=rng.standard_normal((B * N, S)) * 1.5,
        tau=rng.random((B, N)),
        target_quantiles=rng.standard_normal((B * Np, S)) * 1.5,
        next_q=rng.standard_normal((B, len(SIZES), max(SIZES))),
        actions=np.stack([rng.integers(0, n, B) for n in SIZES], axis=1).astype(np.int32),
        rewards=rng.standard_normal(B),
        dones=(rng.random(B) < 0.3).astype(np.float32),
        discounts=np.full(B, 0.81),
    )
    if mask:
        m = (rng.random((B, len(SIZES), max(SIZES))) < 0.7).astype(np.uint8)
        x["next_mask"] = m
    return x


def _f32(x):
    return {k: (v.astype(np.float32) if v.dtype == np.float64 else v) for k, v in x.items()}


def _ref(x, **kw):
    return quantile_huber_ref(x["quantiles"], x["tau"], x["target_quantiles"], x["next_q"], x["actions"], x["rewards"],
                              x["dones"], x["discounts"], SIZES, next_mask=x.get("next_mask"), **kw)


# ---------------------------------------------------------------------------------------------
# references: hand-computed case and finite differences
# ---------------------------------------------------------------------------------------------
def test_hand_computed_quantile_huber():
    """One sample, one branch of 2 actions, N = N′ = 1, not done: θ = r + γ Z′(a*), u = θ − Z(a)."""
    base = dict(tau=np.array([[0.25]]), next_q=np.array([[[0.0, 1.0]]]), actions=np.array([[0]]),
                rewards=np.array([0.5]), dones=np.array([0.0]), discounts=np.array([0.5]))
    # a* = 1 (higher Q); θ = 0.5 + 0.5·2 = 1.5; Z = 1.2 → u = 0.3 ≥ 0: ρ = τ·u²/2 = 0.25·0.045
    q, tq = np.array([[1.2, 9.0]]), np.array([[7.0, 2.0]])
    loss, per, dz = quantile_huber_ref(q, base["tau"], tq, base["next_q"], base["actions"], base["rewards"],
                                       base["dones"], base["discounts"], (2,))
    assert loss == pytest.approx(0.25 * 0.045) and per[0] == pytest.approx(loss)
    assert dz[0, 0] == pytest.approx(-0.25 * 0.3) and dz[0, 1] == 0.0
    # u = 1.5 − 4 = −2.5 < −κ: ρ = (1 − τ)·(|u| − 1/2) = 0.75·2, ∂/∂Z = (1 − τ)·κ
    q2 = np.array([[4.0, 0.0]])
    loss2, _, dz2 = quantile_huber_ref(q2, base["tau"], tq, base["next_q"], base["actions"], base["rewards"],
                                       base["dones"], base["discounts"], (2,))
    assert loss2 == pytest.approx(0.75 * 2.0) and dz2[0, 0] == pytest.approx(0.75)
    # done: θ = r alone
    loss3, _, _ = quantile_huber_ref(np.array([[0.5, 0.0]]), base["tau"], tq, base["next_q"], base["actions"],
                                     base["rewards"], np.array([1.0]), base["discounts"], (2,))
    assert loss3 == 0.0


def test_reference_loss_gradient_matches_finite_differences(rng):
    B, N, Np = 3, 4, 5
    x = _loss_inputs(rng, B, N, Np, mask=True)
    _, _, dz = _ref(x)
    eps = 1e-6
    nonzero = 0
    for _ in range(40):
        r, c = rng.integers(B * N), rng.integers(S)
        up, down = dict(x), dict(x)
        up["quantiles"], down["quantiles"] = x["quantiles"].copy(), x["quantiles"].copy()
        up["quantiles"][r, c] += eps
        down["quantiles"][r, c] -= eps
        numeric = (_ref(up)[0] - _ref(down)[0]) / (2 * eps)
        assert abs(dz[r, c] - numeric) <= 1e-8 + 1e-5 * abs(numeric)
        nonzero += numeric != 0
    assert nonzero > 0


def _head_params(rng, H, n, scale=0.5):
    return {"iqn.phi.w": rng.standard_normal((n, H)) * scale, "iqn.phi.b": rng.standard_normal(H) * 0.3,
            "iqn.out.w": rng.standard_normal((H, S)) * scale, "iqn.out.b": rng.standard_normal(S) * 0.3}


def test_reference_head_gradients_match_finite_differences(rng):
    """The chain h → IQN head → quantile Huber loss: ∂L/∂h and ∂L/∂params of the references."""
    B, N, Np, H, n = 2, 3, 4, 5, 6
    head = IqnHead("iqn", H, SIZES, n_embed=n)
    p = _head_params(rng, H, n)
    h = rng.standard_normal((B, H))
    x = _loss_inputs(rng, B, N, Np)

    def loss_of(h_, p_):
        z, _ = head.forward_ref(h_, p_, tau=x["tau"])
        return _ref({**x, "quantiles": z})[0]

    z, cache = head.forward_ref(h, p, tau=x["tau"])
    _, _, dz = _ref({**x, "quantiles": z})
    dh, grads = head.backward_ref(dz, cache, p)
    check_input_gradient_fd(rng, lambda h_: loss_of(h_, p), h, dh, 15)
    check_param_gradients_fd(rng, lambda p_: loss_of(h, p_), p, grads, 6)


def test_cos_embedding_and_readiness_reference():
    cos = cos_embedding_ref(np.array([[0.0, 0.5]]), 3)
    assert np.allclose(cos, [[1, 1, 1], [1, 0, -1]])
    first, ema, ready = iqn_readiness_ref([2.0, 1.0])
    assert first == 2.0 and ema == pytest.approx(1.99) and ready == pytest.approx(0.005)
    assert iqn_readiness_ref([1.0, 5.0])[2] == 0.0  # clipped at 0


# ---------------------------------------------------------------------------------------------
# kernels against the references
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", [False, True])
def test_loss_kernel_matches_reference(rng, mask):
    B, N, Np = 5, 3, 4
    x = _f32(_loss_inputs(rng, B, N, Np, mask=mask))
    x["quantiles"][0, 0] = x["rewards"][0]  # an exact tie u = 0 somewhere is harmless
    loss_ref, per_ref, dz_ref = _ref(x)
    loss = QuantileHuberLoss(B, SIZES, N, Np)
    s = stream()
    loss.compute({k: _dev(v) for k, v in x.items()}, s)
    assert_close(loss.loss.copy_to_host()[0], loss_ref, 1e-6, 1e-5)
    assert_close(loss.per_sample.copy_to_host(), per_ref, 1e-6, 1e-5)
    assert_close(loss.grad("quantiles").copy_to_host(), dz_ref, 1e-7, 1e-5)


def test_tau_kernel_draws_the_counter_rng(rng):
    B, N = 3, 5
    head = IqnHead("iqn", 4, SIZES, n_embed=3)
    store = ParamStore()
    head.declare_params(store)
    store.allocate()
    acts = Arena("acts")
    head.declare_acts(acts, B, "online", backward=False, n_quantiles=N)
    acts.allocate()
    counter = _dev(np.array([7], np.int64))
    s = stream()
    head.sample_tau(s, "online", 11, counter, IQN_TAU_SLOT)
    got = head.tau_buffer("online").copy_to_host()
    assert np.array_equal(got, tau_ref(11, 7, IQN_TAU_SLOT, B, N))
    assert np.all((got >= 0) & (got < 1)) and len(np.unique(got)) == B * N


def _build_head(rng, B, N, H, n, backward=True):
    head, store, values, acts = build_module(IqnHead("iqn", H, SIZES, n_embed=n), rng, B, (("online", backward),),
                                             n_quantiles=N)
    return head, store, {k: np.asarray(v, np.float64) for k, v in values.items()}, acts


def test_head_forward_and_backward_match_reference(rng):
    B, N, H, n = 3, 5, 7, 6
    head, store, params, _ = _build_head(rng, B, N, H, n)
    tau = rng.random((B, N)).astype(np.float32)
    h = rng.standard_normal((B, H)).astype(np.float32)
    dz = rng.standard_normal((B * N, S)).astype(np.float32)
    s = stream()
    head.tau_buffer("online").copy_to_device(tau)
    z = head.forward(_dev(h), s, tag="online")
    z_ref, cache = head.forward_ref(h, params, tau=tau)
    assert_close(z.copy_to_host(), z_ref, 1e-5, 1e-4)
    dh = head.backward(_dev(dz), s, tag="online")
    dh_ref, g_ref = head.backward_ref(dz, cache, params)
    assert_close(dh.copy_to_host(), dh_ref, 1e-5, 1e-4)
    grads = store.to_host("grads")
    for name, ref in g_ref.items():
        assert_close(grads[name], ref, 1e-5, 1e-4)


def test_trunk_gradient_is_the_sum_of_both_heads(rng):
    """The IQN head adds its input gradient into the C51 head's dh; the trunk's backward runs once on
    the sum (agent_helpers.check_trunk_gradient_is_the_sum_of_both_heads). N = 4 quantiles, τ given."""
    n_quantiles = 4
    tau = rng.random((3, n_quantiles)).astype(np.float32)
    check_trunk_gradient_is_the_sum_of_both_heads(
        rng, lambda h: IqnHead("iqn", h, SIZES, n_embed=4), lambda b: (b * n_quantiles, S),
        declare={"n_quantiles": n_quantiles}, ref={"tau": tau},
        setup=lambda head, b: head.tau_buffer("online").copy_to_device(tau))


def test_readiness_kernel_matches_reference():
    s = stream()
    state = _dev(np.array([-1.0, -1.0]))
    stats = _dev(np.zeros(4, np.float32))
    losses = [2.0, 1.5, 0.5, 0.25]
    for x in losses:
        iqn_readiness_kernel[1, 1, s](_dev(np.array([x], np.float32)), state, stats, np.int64(0), np.int64(1),
                                      np.int64(2))
    first, ema, ready = iqn_readiness_ref(losses)
    got = stats.copy_to_host()
    assert got[0] == np.float32(0.25) and got[1] == pytest.approx(ready, rel=1e-6)
    assert got[2] == pytest.approx(ema, rel=1e-6) and 0.0 < got[1] < 1.0
    assert state.copy_to_host()[0] == first


# ---------------------------------------------------------------------------------------------
# the agent (agent.iqn = true): an auxiliary loss on the aux train steps
# ---------------------------------------------------------------------------------------------
AGENT_SIZES = (3, 3, 4, 4)
STATE_DIM, N_ENVS = 5, 4


def _agent(**kw):
    from numbarl.config import AgentConfig
    from numbarl.rl.agents.dqn import DQNAgent

    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=10 * N_ENVS, n_step=2, gamma=0.9,
                      target_update="polyak", iqn=True, iqn_quantiles=3, iqn_embed=4, **kw)
    return DQNAgent(cfg, STATE_DIM, AGENT_SIZES, N_ENVS, seed=1)


def _fill(agent, rng, count=13):
    fill_replay(agent, rng, done_rate=0.2, count=count)


def test_agent_train_step_with_iqn_trains_the_head_and_the_trunk(rng):
    agent = _agent(aux_frequency=2)
    assert agent.aux_every == 2 and {"train", "train_aux"} <= set(agent.step_functions(env=None))
    assert "head.iqn" in agent.optim.groups
    _fill(agent, rng)
    s = stream()
    iqn_names, before, _, after = check_aux_step_trains_the_head(agent, s, "iqn.")
    assert len(iqn_names) == 4
    assert not np.array_equal(before["trunk.fc0.w"], after["trunk.fc0.w"])
    stats = agent.read_stats(s)
    assert stats["iqn_loss"] > 0 and np.isfinite(stats["iqn_loss"])
    assert stats["iqn_readiness"] == 0.0 and stats["iqn_loss_ema"] == pytest.approx(stats["iqn_loss"])
    # the loss's reference on the step's own device inputs
    x = dict(quantiles=agent.iqn_head.output("online").copy_to_host(),
             tau=agent.iqn_head.tau_buffer("online").copy_to_host(),
             target_quantiles=agent.iqn_head.output("target").copy_to_host(),
             next_q=agent.head.outputs("next").q.copy_to_host(),
             actions=agent.replay.batch.action.copy_to_host(), rewards=agent.replay.batch.reward.copy_to_host(),
             dones=agent.replay.batch.done.copy_to_host(), discounts=agent.replay.batch.discount.copy_to_host())
    loss_ref, _, _ = quantile_huber_ref(**x, branch_sizes=AGENT_SIZES)
    assert stats["iqn_loss"] == pytest.approx(loss_ref, rel=1e-5)
    # a step without the auxiliary losses leaves the IQN gradients at zero (no stale gradient is applied)
    agent.train_step(s, aux=False)
    s.synchronize()
    grads = agent.store.to_host("grads")
    assert all(np.all(grads[n] == 0) for n in iqn_names)
    # the state round-trips through a checkpoint (readiness state included)
    arrays = agent.state_arrays()
    assert "iqn/readiness_state" in arrays and arrays["iqn/readiness_state"][0] > 0


def test_agent_iqn_off_declares_nothing():
    agent = _agent(aux_frequency=3)
    from numbarl.rl.agents.dqn import DQNAgent

    plain = DQNAgent(replace(agent.cfg, iqn=False), STATE_DIM, AGENT_SIZES, N_ENVS, seed=1)
    assert plain.iqn_head is None and not any(n.startswith("iqn.") for n in plain.store.specs)
    assert "iqn_loss" not in plain.stats_layout and plain.aux_every == 1
    assert agent.aux_every == 3


# ---------------------------------------------------------------------------------------------
# the PyTorch peer: the same weights, h and τ → the same loss and gradients
# ---------------------------------------------------------------------------------------------
def test_torch_peer_matches_numbarl(rng):
    pytest.importorskip("torch")
    from numbarl.rl.torch_peer import iqn_loss_and_grads

    B, N, Np, H, n = 4, 5, 3, 6, 8
    store = ParamStore()
    iqn = IqnHead("iqn", H, SIZES, n_embed=n)
    iqn.declare_params(store)
    store.allocate()
    values = store.init(rng)
    target_values = {k: v + (0.05 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in values.items()}
    store.load(target_values, role="target")
    acts = Arena("acts")
    iqn.declare_acts(acts, B, "online", n_quantiles=N)
    iqn.declare_acts(acts, B, "target", backward=False, n_quantiles=Np)
    acts.allocate()
    h = rng.standard_normal((B, H)).astype(np.float32)
    h_next = rng.standard_normal((B, H)).astype(np.float32)
    x = _f32(_loss_inputs(rng, B, N, Np, mask=True))
    loss = QuantileHuberLoss(B, SIZES, N, Np)
    s = stream()
    tau_t = rng.random((B, Np)).astype(np.float32)
    iqn.tau_buffer("online").copy_to_device(x["tau"])
    iqn.tau_buffer("target").copy_to_device(tau_t)
    iqn.forward(_dev(h_next), s, tag="target", role="target")
    z = iqn.forward(_dev(h), s, tag="online")
    dev = {k: _dev(v) for k, v in x.items() if k not in ("quantiles", "target_quantiles")}
    dev.update(quantiles=z, target_quantiles=iqn.output("target"), tau=iqn.tau_buffer("online"))
    loss.apply(dev, {"quantiles": loss.grad("quantiles")}, s)
    dh = iqn.backward(loss.grad("quantiles"), s, tag="online").copy_to_host()
    grads = store.to_host("grads")
    got_loss = float(loss.loss.copy_to_host()[0])

    peer = iqn_loss_and_grads(values, target_values, h, h_next, x["tau"], tau_t, x["next_q"], x["actions"],
                              x["rewards"], x["dones"], x["discounts"], SIZES, next_mask=x["next_mask"], head="iqn",
                              device="cpu")
    assert got_loss == pytest.approx(peer["loss"], rel=1e-5)

    def rel_close(a, b, what):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= 1e-5 * max(np.max(np.abs(b)), 1e-30), what

    rel_close(dh, peer["dh"], "dh")
    for name in iqn.param_names.values():
        rel_close(grads[name], peer["grads"][name], name)
