"""The risk-budget head (numbarl/rl/nets/risk_head.py) and its cross-entropy on trade outcomes
(numbarl/rl/losses/risk_head.py): the size rewrite and the outcome labels by hand and against their references,
the loss reference by hand and by finite differences, the kernels against the references on odd shapes, the
PyTorch peer, the agent's train step with agent.risk_head_weight on, and a tiny env run with the sizing on."""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from agent_helpers import (
    build_module,
    check_aux_step_trains_the_head,
    check_input_gradient_fd,
    check_param_gradients_fd,
    check_scalar_head_forward_backward,
    fill_replay,
    tiny_agent,
)

from numbarl.cuda.runtime import cuda, stream
from numbarl.cuda.testing import assert_close
from numbarl.env.params import (
    BR_DIRECTION,
    BR_SIZE,
    DIR_FLAT,
    DIR_LONG,
    DIR_SHORT,
    EXIT_CLOSE,
    EXIT_NONE,
    EXIT_STOP,
)
from numbarl.rl.feedback.hindsight import NO_LABEL
from numbarl.rl.losses.risk_head import (
    RiskHeadLoss,
    TradeOutcomeLabels,
    base_rate_ref,
    outcome_label_ref,
    risk_bce_ref,
)
from numbarl.rl.nets.risk_head import (
    RiskHead,
    flat_mask,
    size_actions_kernel,
    size_actions_ref,
    size_factor_ref,
    size_scores_kernel,
    size_scores_ref,
    snap_size_ref,
)

_cuda = cuda()
SIZES = (3, 3, 4, 4)  # direction, size, target, stop
NB, MAXA = len(SIZES), max(SIZES)


def _dev(x):
    return _cuda.to_device(np.ascontiguousarray(x))


def _greedy(q, mask):
    """numbarl/env/rows.py greedy_action per (row, branch) in numpy: the first maximum over the mask."""
    out = np.zeros(q.shape[:2], np.int64)
    for i in range(q.shape[0]):
        for b in range(q.shape[1]):
            best, best_a = -np.inf, -1
            for a in range(q.shape[2]):
                if not mask[i, b, a]:
                    continue
                if best_a < 0:
                    best_a = a
                if q[i, b, a] > best:
                    best, best_a = q[i, b, a], a
            out[i, b] = best_a
    return out


# ---------------------------------------------------------------------------------------------
# the size rewrite: by hand, kernels against the references, collect == backtest
# ---------------------------------------------------------------------------------------------
def test_snap_by_hand():
    """sizes (1, 2, 4), chosen 4: ρ = 0.9 → 3.6 → 2; 0.5 → 2 exactly → 2; 0.3 → 1.2 → 1; 0.1 → 0.4 → 1 (never
    below the smallest); NaN → the smallest; an unsorted grid snaps by value, not by index."""
    sizes = (1.0, 2.0, 4.0)
    assert [snap_size_ref(2, r, sizes) for r in (0.9, 0.5, 0.3, 0.1, 1.0)] == [1, 1, 0, 0, 2]
    assert snap_size_ref(2, np.nan, sizes) == 0 and snap_size_ref(0, 0.99, sizes) == 0
    assert snap_size_ref(1, 0.6, (4.0, 2.0, 1.0)) == 2  # 2 × 0.6 = 1.2 → size 1 at index 2
    assert snap_size_ref(0, 0.6, (4.0, 1.0, 2.0)) == 2  # 4 × 0.6 = 2.4 → size 2 at index 2


BASE_ONE = np.array([1.0, 1.0], np.float32)  # a base win rate of 1: the factor f = min(1, ρ / 1) is ρ itself


def test_size_factor_relative_to_the_base_rate():
    """f = min(1, ρ / ρ̄): at or above the base rate the chosen size is kept (the largest size stays reachable
    from flat); below it the size shrinks; no base rate yet (or ρ̄ ≤ 0): 1; a NaN ρ: the smallest size; the
    kernels read the same factor."""
    sizes = (1.0, 2.0, 4.0)
    base = (0.5, 1.0)
    assert [snap_size_ref(2, size_factor_ref(r, base), sizes) for r in (0.5, 0.9, 0.45, 0.25, 0.15)] == [2, 2, 1, 1, 0]
    assert size_factor_ref(0.2, (0.0, 0.0)) == 1.0 and size_factor_ref(0.2, (0.0, 1.0)) == 1.0
    assert size_factor_ref(0.2, (0.4, 0.0)) == 1.0 and size_factor_ref(0.2, (0.4, 1.0)) == np.float32(0.2) / np.float32(0.4)
    assert snap_size_ref(2, size_factor_ref(np.nan, (0.0, 0.0)), sizes) == 0
    z = np.log(np.array([[0.5 / 0.5], [0.45 / 0.55], [0.15 / 0.85], [np.nan]], np.float32))  # ρ = 0.5, 0.45, 0.15, NaN
    obs = np.zeros((4, 2), np.float32)
    actions = np.zeros((4, NB), np.int32)
    actions[:, BR_DIRECTION] = DIR_LONG
    actions[:, BR_SIZE] = 2
    for b, want in ((base, [2, 1, 0, 0]), ((0.0, 0.0), [2, 2, 2, 0])):
        d_actions = _dev(actions)
        size_actions_kernel[1, 4, 0](_dev(z), _dev(obs), np.int64(0), _dev(np.float32(sizes)), d_actions,
                                     _dev(np.zeros(3, np.float32)), _dev(np.zeros(4, np.float32)),
                                     _dev(np.zeros(4, np.float32)), _dev(np.asarray(b, np.float32)))
        assert d_actions.copy_to_host()[:, BR_SIZE].tolist() == want, b


def test_size_actions_by_hand_and_kernel_matches_reference():
    """Seven envs, position column 0, sizes (1, 2, 4), ρ = σ(z) (base win rate 1: f = ρ): env 0 flat long at 4 with ρ = 0.5 → 2; env 1
    flat short at 4 with ρ ≈ 0.27 → 1; env 2 flat at direction flat (no entry: unchanged); env 3 in a position
    (a reversal or a hold: unchanged); env 4 flat long at 1 (already the smallest); env 5 a NaN logit → the
    smallest; env 6 ρ ≈ 1 keeps 4. The kernel also copies the env's grid into the sizer's."""
    z = np.array([[0.0], [-1.0], [-3.0], [-3.0], [0.0], [np.nan], [30.0]], np.float32)
    obs = np.zeros((7, 2), np.float32)
    obs[3, 0] = 0.5
    actions = np.zeros((7, NB), np.int32)
    actions[:, BR_DIRECTION] = [DIR_LONG, DIR_SHORT, DIR_FLAT, DIR_SHORT, DIR_LONG, DIR_LONG, DIR_SHORT]
    actions[:, BR_SIZE] = [2, 2, 2, 2, 0, 2, 2]
    actions[:, 2] = 3
    sizes = np.array([1.0, 2.0, 4.0], np.float32)
    d_actions, d_sizes, rho, resized = _dev(actions), _dev(np.zeros(3, np.float32)), _dev(np.zeros(7, np.float32)), \
        _dev(np.zeros(7, np.float32))
    size_actions_kernel[1, 8, 0](_dev(z), _dev(obs), np.int64(0), _dev(sizes), d_actions, d_sizes, rho, resized,
                                 _dev(BASE_ONE))
    got_rho = rho.copy_to_host()
    assert_close(got_rho[[0, 1, 6]], [0.5, 1 / (1 + np.e), 1.0], 1e-7, 1e-6)
    want, want_resized = size_actions_ref(actions, obs, got_rho, sizes, 0)
    assert want[:, BR_SIZE].tolist() == [1, 0, 2, 2, 0, 0, 2]
    assert want_resized.tolist() == [True, True, False, False, False, True, False]
    np.testing.assert_array_equal(d_actions.copy_to_host(), want)
    np.testing.assert_array_equal(resized.copy_to_host(), want_resized.astype(np.float32))
    np.testing.assert_array_equal(d_sizes.copy_to_host(), sizes)


def test_size_kernels_match_references_and_the_backtest_acts_as_the_collect_step(rng):
    """Random logits, positions, actions and Q on 13 envs / policies (not a multiple of anything), a 5-size grid
    in no order: the collect kernel and the scores kernel equal their references, and greedy_action on the
    rewritten scores picks exactly the collect step's executed action on the greedy actions."""
    n, sizes = 13, np.array([2.0, 0.5, 3.0, 1.0, 4.0], np.float32)
    branch_sizes = (3, 5, 4, 2)
    nb, maxa = len(branch_sizes), max(branch_sizes)
    z = (rng.standard_normal((n, 1)) * 2).astype(np.float32)
    obs = rng.standard_normal((n, 3)).astype(np.float32)
    obs[rng.random(n) < 0.7, 1] = 0.0  # mostly flat
    q = rng.standard_normal((n, nb, maxa)).astype(np.float32)
    q[0, BR_SIZE, :] = -np.inf  # a size branch without a number: its first size, rewritten to the lowest float32
    mask = flat_mask(n, branch_sizes)
    q[mask == 0] = -np.inf
    d_q = _dev(q)
    size_scores_kernel[1, 16, 0](_dev(z), _dev(obs), np.int64(1), _dev(sizes), _dev(mask), d_q, _dev(BASE_ONE))
    rho = 1.0 / (1.0 + np.exp(-z[:, 0].astype(np.float64)))
    got = d_q.copy_to_host()
    want = size_scores_ref(q, obs, rho.astype(np.float32), sizes, 1, branch_sizes)
    np.testing.assert_array_equal(got, want)
    greedy = _greedy(q, mask).astype(np.int32)
    executed, _ = size_actions_ref(greedy, obs, rho.astype(np.float32), sizes, 1)
    np.testing.assert_array_equal(_greedy(got, mask), executed)
    assert (executed != greedy).any()  # the draw resized some greedy entries
    # the collect kernel on random (exploratory) actions
    actions = np.stack([rng.integers(0, b, n) for b in branch_sizes], 1).astype(np.int32)
    d_actions, rho_out, resized = _dev(actions), _dev(np.zeros(n, np.float32)), _dev(np.zeros(n, np.float32))
    size_actions_kernel[2, 8, 0](_dev(z), _dev(obs), np.int64(1), _dev(sizes), d_actions, _dev(np.zeros(5, np.float32)),
                                 rho_out, resized, _dev(BASE_ONE))
    assert_close(rho_out.copy_to_host(), rho, 1e-7, 1e-6)
    want_actions, want_resized = size_actions_ref(actions, obs, rho_out.copy_to_host(), sizes, 1)
    np.testing.assert_array_equal(d_actions.copy_to_host(), want_actions)
    np.testing.assert_array_equal(resized.copy_to_host(), want_resized.astype(np.float32))


# ---------------------------------------------------------------------------------------------
# the outcome labels: a hand-made sequence (a reversal, a break-even trade, an overwritten entry, a trade
# opened and closed in one step), the kernel against the reference
# ---------------------------------------------------------------------------------------------
def _script():
    """Two envs, 13 collect steps (τ = t, bar = t), the state AFTER each step. Env 0: long at 1, reversed to
    short at 3 closing the long at +5; the short closed at 5 for −2; long at 6, closed at 11 for +1 after
    the ring (4 slots) overwrote row 6; at 12 a trade opened and stopped out in the same step for −1.
    Env 1: long at 2 closed at 4 at break-even (0: not a win)."""
    steps = 13
    pos = np.zeros((steps, 2))
    entry = np.zeros((steps, 2), np.int64)
    pnl = np.zeros((steps, 2))
    reason = np.full((steps, 2), EXIT_NONE, np.int32)
    pos[1:3, 0], entry[1:3, 0] = 1, 1
    pos[3:5, 0], entry[3:5, 0] = -1, 3
    reason[3, 0], pnl[3, 0] = EXIT_CLOSE, 5.0
    reason[5, 0], pnl[5, 0] = EXIT_CLOSE, -2.0
    pos[6:11, 0], entry[6:11, 0] = 1, 6
    reason[11, 0], pnl[11, 0] = EXIT_CLOSE, 1.0
    reason[12, 0], pnl[12, 0] = EXIT_STOP, -1.0
    pos[2:4, 1], entry[2:4, 1] = 1, 2
    reason[4, 1] = EXIT_CLOSE
    return [SimpleNamespace(trade_pnl=pnl[t], exit_reason=reason[t], bar=np.full(2, t, np.int32), position=pos[t],
                            entry_bar=entry[t].astype(np.int32)) for t in range(steps)]


def test_outcome_labels_by_hand_and_kernel_matches_reference():
    n_slots, n_envs = 4, 2
    labels = TradeOutcomeLabels(n_slots, n_envs, batch=5)
    count = _dev(np.zeros(1, np.int64))
    label = np.full((n_slots, n_envs), NO_LABEL, np.int32)
    entry_slot = np.full(n_envs, -1, np.int64)
    labeled = np.zeros(n_envs, np.int64)
    # (after step t: {(slot, env): label}) by hand; slot = τ % 4, so row τ5 replaces τ1's label
    want = {3: {(1, 0): 1}, 4: {(1, 0): 1, (2, 1): 0}, 5: {(3, 0): 0, (2, 1): 0}, 11: {}, 12: {(0, 0): 0}}
    for t, step in enumerate(_script()):
        count.copy_to_device(np.array([t + 1], np.int64))
        out = SimpleNamespace(trade_pnl=_dev(step.trade_pnl), exit_reason=_dev(step.exit_reason), bar=_dev(step.bar))
        state = SimpleNamespace(position=_dev(step.position), entry_bar=_dev(step.entry_bar))
        labels.mark(out, state, SimpleNamespace(count=count, n_envs=n_envs, n_slots=n_slots), 0)
        outcome_label_ref(step.trade_pnl, step.exit_reason, step.bar, step.position, step.entry_bar, label, t + 1,
                          entry_slot, labeled)
        np.testing.assert_array_equal(labels.arena["label"].copy_to_host(), label)
        np.testing.assert_array_equal(labels.arena["entry_slot"].copy_to_host(), entry_slot)
        if t in want:
            hand = np.full((n_slots, n_envs), NO_LABEL, np.int32)
            for (s, j), v in want[t].items():
                hand[s, j] = v
            np.testing.assert_array_equal(label, hand, err_msg=f"after step {t}")
    assert labeled.tolist() == [3, 1]  # the +1 trade's entry row was gone: not labelled
    np.testing.assert_array_equal(labels.arena["labeled"].copy_to_host(), labeled)
    index = np.array([0, 1, 5, -1, 7], np.int64)  # slot * n_envs + env
    got = labels.gather(_dev(index), 0).copy_to_host()
    flat = label.reshape(-1)
    np.testing.assert_array_equal(got, np.where(index >= 0, flat[np.maximum(index, 0)], NO_LABEL))


# ---------------------------------------------------------------------------------------------
# the loss: by hand, finite differences, the kernel against the reference, the head
# ---------------------------------------------------------------------------------------------
def test_loss_by_hand():
    """The docstring's example: z = 0, labels (1, −1): L = log 2, ∂L/∂z = (−1/2, 0); no labelled row: 0, 0."""
    loss, per, dz, rho, n = risk_bce_ref(np.zeros(2), np.array([1, -1]))
    assert loss == pytest.approx(np.log(2)) and n == 1 and per[1] == 0.0
    np.testing.assert_allclose(dz[:, 0], [-0.5, 0.0])
    np.testing.assert_allclose(rho, [0.5, 0.5])
    loss, per, dz, _, n = risk_bce_ref(np.array([3.0, -2.0]), np.array([-1, -1]))
    assert loss == 0.0 and n == 0 and not dz.any()
    # the stable form is the cross-entropy, also at saturated logits
    z, y = np.array([-3.0, 0.5, 2.0, 40.0]), np.array([1, 0, 1, 0])
    _, per, _, rho, _ = risk_bce_ref(z, y)
    y3, rho3 = y[:3], rho[:3]
    np.testing.assert_allclose(per[:3], -(y3 * np.log(rho3) + (1 - y3) * np.log(1 - rho3)), rtol=1e-12)
    assert per[3] == pytest.approx(40.0)


def _labels(rng, B):
    y = rng.integers(-1, 2, B).astype(np.int32)
    y[:3] = (-1, 0, 1)  # every kind
    return y


def test_loss_reference_gradient_matches_finite_differences(rng):
    B = 9
    z, y = rng.standard_normal(B) * 2, _labels(rng, B)
    dz = risk_bce_ref(z, y)[2]
    eps = 1e-6
    for b in range(B):
        up, down = z.copy(), z.copy()
        up[b] += eps
        down[b] -= eps
        numeric = (risk_bce_ref(up, y)[0] - risk_bce_ref(down, y)[0]) / (2 * eps)
        assert abs(dz[b, 0] - numeric) <= 1e-9 + 1e-6 * abs(numeric)


@pytest.mark.parametrize("B", [1, 19, 40])  # one row, and not multiples of the block (16 on the simulator)
def test_loss_kernel_matches_reference(rng, B):
    z = (rng.standard_normal((B, 1)) * 2).astype(np.float32)
    y = _labels(rng, B) if B >= 3 else np.array([1], np.int32)
    if B > 3:
        z[3, 0], z[4, 0] = 40.0, -40.0  # saturated logits stay finite
    loss = RiskHeadLoss(B)
    loss.apply({"logits": _dev(z), "labels": _dev(y)}, {"logits": loss.grad("logits")}, 0, weight=0.5)
    ref_loss, per, dz, rho, n = risk_bce_ref(z, y)
    assert float(loss.count.copy_to_host()[0]) == n
    assert_close(loss.loss.copy_to_host()[0], ref_loss, 0.0, 1e-5)
    assert_close(loss.per_sample.copy_to_host(), per, 0.0, 1e-5)
    assert_close(loss.rho.copy_to_host(), rho, 0.0, 1e-5)
    got = loss.grad("logits").copy_to_host()  # weight · ∂L/∂z
    assert np.max(np.abs(got - 0.5 * dz)) <= 1e-5 * np.max(np.abs(0.5 * dz))
    assert np.all(got[y < 0] == 0)
    # the base win rate: the first labelled batch sets it, the next moves it by 1 %
    base = base_rate_ref((0.0, 0.0), y)
    assert_close(loss.base_rate.copy_to_host(), np.array(base, np.float64), 1e-7, 1e-6)
    y2 = np.where(y >= 0, 1 - y, y).astype(np.int32)  # the labelled rows' outcomes flipped
    loss.apply({"logits": _dev(z), "labels": _dev(y2)}, {"logits": loss.grad("logits")}, 0)
    base2 = base_rate_ref(base, y2)
    assert_close(loss.base_rate.copy_to_host(), np.array(base2, np.float64), 1e-7, 1e-6)
    if 0 < base[0] < 1:
        assert base2[0] != base[0] and base2[1] == 1.0


def test_loss_kernel_without_labels_is_zero():
    loss = RiskHeadLoss(5)
    loss.apply({"logits": _dev(np.ones((5, 1), np.float32)), "labels": _dev(np.full(5, -1, np.int32))},
               {"logits": loss.grad("logits")}, 0)
    assert loss.loss.copy_to_host()[0] == 0 and loss.count.copy_to_host()[0] == 0
    assert not loss.grad("logits").copy_to_host().any()
    assert not loss.base_rate.copy_to_host().any()  # no labels: no base rate (the sizing's factor stays 1)
    with pytest.raises(ValueError):
        loss.compute({"logits": _dev(np.ones((4, 1), np.float32)), "labels": _dev(np.ones(5, np.int32))}, 0)


def _build_head(rng, B, H, tags=(("online", True),)):
    return build_module(RiskHead("risk", H), rng, B, tags)


def test_head_forward_and_backward_match_reference(rng):
    B, H = 5, 7
    head, store, values, _ = _build_head(rng, B, H)
    assert sorted(values) == ["risk.fc.b", "risk.fc.w"] and head.group == "head.risk"
    check_scalar_head_forward_backward(rng, head, store, values, B, H)


def test_reference_head_gradients_match_finite_differences(rng):
    """The chain h → head → cross-entropy on the labelled rows: ∂L/∂h and ∂L/∂params of the references."""
    B, H = 6, 3
    head, _, values, _ = _build_head(rng, B, H)
    p = {k: np.asarray(v, np.float64) for k, v in values.items()}
    h = rng.standard_normal((B, H))
    y = _labels(rng, B)

    def loss_of(h_, p_):
        return risk_bce_ref(head.forward_ref(h_, p_)[0], y)[0]

    z, cache = head.forward_ref(h, p)
    dh, grads = head.backward_ref(risk_bce_ref(z, y)[2], cache, p)
    check_input_gradient_fd(rng, lambda h_: loss_of(h_, p), h, dh, 2 * B * H)
    check_param_gradients_fd(rng, lambda p_: loss_of(h, p_), p, grads, 2 * H)


# ---------------------------------------------------------------------------------------------
# the PyTorch peer: the same weights, h and labels → the same loss and gradients
# ---------------------------------------------------------------------------------------------
def _torch_peer(values, h, labels):
    """z = nn.Linear(H, 1)(h) with numbarl's weights, BCE-with-logits on the rows with a label (mean over them)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    lin = nn.Linear(h.shape[1], 1).double()
    with torch.no_grad():
        lin.weight.copy_(torch.as_tensor(np.asarray(values["risk.fc.w"], np.float64).T))
        lin.bias.copy_(torch.as_tensor(np.asarray(values["risk.fc.b"], np.float64)))
    h_t = torch.as_tensor(np.asarray(h, np.float64)).requires_grad_(True)
    z = lin(h_t).squeeze(1)
    z.retain_grad()
    y = torch.as_tensor(np.asarray(labels, np.float64))
    keep = y >= 0
    loss = F.binary_cross_entropy_with_logits(z[keep], y[keep], reduction="mean")
    loss.backward()
    return {"loss": float(loss.detach()), "dz": z.grad.numpy().reshape(-1, 1), "dh": h_t.grad.numpy(),
            "grads": {"risk.fc.w": lin.weight.grad.numpy().T, "risk.fc.b": lin.bias.grad.numpy()}}


def test_torch_peer_matches_numbarl(rng):
    pytest.importorskip("torch")
    B, H = 13, 6
    head, store, values, _ = _build_head(rng, B, H)
    h = rng.standard_normal((B, H)).astype(np.float32)
    y = _labels(rng, B)
    loss = RiskHeadLoss(B)
    s = stream()
    z = head.forward(_dev(h), s, tag="online")
    loss.apply({"logits": z, "labels": _dev(y)}, {"logits": loss.grad("logits")}, s)
    dh = head.backward(loss.grad("logits"), s, tag="online").copy_to_host()
    grads = store.to_host("grads")
    peer = _torch_peer(values, h, y)

    def rel_close(a, b, what):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= 1e-5 * max(np.max(np.abs(b)), 1e-30), what

    assert float(loss.loss.copy_to_host()[0]) == pytest.approx(peer["loss"], rel=1e-5)
    rel_close(loss.grad("logits").copy_to_host(), peer["dz"], "dz")
    rel_close(dh, peer["dh"], "dh")
    for name in head.param_names:
        rel_close(grads[name], peer["grads"][name], name)


# ---------------------------------------------------------------------------------------------
# the agent (agent.risk_head_weight > 0)
# ---------------------------------------------------------------------------------------------
STATE_DIM, N_ENVS = 5, 4


def _agent(**kw):
    return tiny_agent(STATE_DIM, SIZES, N_ENVS, batch_size=6, risk_head_weight=0.5, **kw)


def test_agent_train_step_with_the_risk_head_trains_the_head_and_the_trunk(rng):
    agent = _agent(aux_frequency=2, risk_head_sizing=False)
    assert agent.aux_every == 2 and agent.risk_sizer is None
    assert "head.risk" in agent.optim.groups and "grad_norm.head.risk" in agent.stats_layout
    fill_replay(agent, rng, done_rate=0.2, count=13)
    n_slots = agent.replay.n_slots
    label = rng.integers(-1, 2, (n_slots, N_ENVS)).astype(np.int32)
    agent.risk_labels.arena.load({"label": label})
    s = stream()
    names, before, _, _ = check_aux_step_trains_the_head(agent, s, "risk.")
    assert names == ["risk.fc.w", "risk.fc.b"]
    index = agent.replay.batch.index.copy_to_host()
    y = np.where(index >= 0, label.reshape(-1)[np.maximum(index, 0)], NO_LABEL)
    np.testing.assert_array_equal(agent.risk_labels.arena["batch_label"].copy_to_host(), y)
    z = agent.risk_head.output("online").copy_to_host()
    z_ref, _ = agent.risk_head.forward_ref(agent.trunk.output("online").copy_to_host(),
                                           {k: np.asarray(v, np.float64) for k, v in before.items()})
    assert_close(z, z_ref, 1e-5, 1e-4)
    loss_ref, _, dz_ref, rho_ref, n = risk_bce_ref(z, y)
    assert n > 0
    assert_close(agent.risk_loss.grad("logits").copy_to_host(), 0.5 * dz_ref, 1e-7, 1e-5)
    stats = agent.read_stats(s)
    assert stats["risk_head_loss"] > 0 and stats["risk_head_loss"] == pytest.approx(loss_ref, rel=1e-5)
    assert stats["risk_head_rho_mean"] == pytest.approx(float(rho_ref.mean()), rel=1e-5)
    assert stats["risk_head_labeled"] == n
    # a step without the auxiliary losses leaves the head's gradients at zero, the trunk's not
    agent.train_step(s, aux=False)
    s.synchronize()
    grads = agent.store.to_host("grads")
    assert all(np.all(grads[n] == 0) for n in names) and np.any(grads["trunk.fc0.w"] != 0)
    # the labels travel with the replay in the checkpoint
    arrays = agent.state_arrays()
    np.testing.assert_array_equal(arrays["risk/label"], label)
    assert "risk_grid/sizes" not in arrays  # no sizing


def test_agent_risk_head_off_declares_nothing():
    from numbarl.rl.agents.dqn import DQNAgent

    agent = _agent(aux_frequency=3)
    plain = DQNAgent(replace(agent.cfg, risk_head_weight=0.0), STATE_DIM, SIZES, N_ENVS, seed=1)
    assert plain.risk_head is None and plain.risk_labels is None and plain.risk_sizer is None
    assert not any(n.startswith("risk.") for n in plain.store.specs) and plain.aux_every == 1
    assert "risk_head_loss" not in plain.stats_layout and not any(k.startswith("risk") for k in plain.state_arrays())
    on, off = agent.store.to_host("params"), plain.store.to_host("params")
    assert all(np.array_equal(on[k], off[k]) for k in off)  # declared last: the others keep their init
    assert agent.risk_sizer is not None and "risk_head_resized_frac" in agent.stats_layout


def test_config_checks_the_risk_head_fields():
    from numbarl.config import AgentConfig, ConfigError

    AgentConfig(risk_head_weight=0.5, risk_head_sizing=False, weight_decay_groups="head.risk").validate()
    for bad in ({"risk_head_weight": -0.1}, {"risk_head_weight": float("nan")}, {"risk_head_sizing": "no"},
                {"weight_decay_groups": "head.risk"}, {"kind": "ppo", "risk_head_weight": 0.5}):
        with pytest.raises(ConfigError, match="risk_head|head.risk"):
            AgentConfig(**bad).validate()
    import dataclasses

    from numbarl.config import Config

    cfg = Config()
    cfg = dataclasses.replace(cfg, agent=dataclasses.replace(cfg.agent, risk_head_weight=0.1))
    cfg.validate()
    with pytest.raises(ConfigError, match="needs env.latency_bars = 0 \\(got 2\\)"):
        dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, latency_bars=2)).validate()


def test_tiny_run_with_the_sizing_on():
    """Agent + env with the head's bias at −30 (ρ ≈ 0): every flat env's entry executes at the smallest size
    (the replay stores it), trades close and label their entry rows, the aux train step's loss sees them, and
    the greedy backtest never holds more than the smallest size."""
    from numbarl.bench.train import _market
    from numbarl.config import AgentConfig
    from numbarl.env.backtest import backtest
    from numbarl.env.device import DeviceEnv
    from numbarl.env.params import EnvParams
    from numbarl.rl.agents.dqn import DQNAgent

    s = stream()
    params = EnvParams(sizes=(0.25, 0.5, 1.0), size_step=0.25)
    market = _market(200, 8, 1).to_device(params.vol_span, params.vol_horizon_bars)
    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=8, replay_capacity=64, n_step=1, risk_head_weight=0.5)
    env = DeviceEnv(market, params, 4, bar_range=(0, 150), seed=3)
    agent = DQNAgent(cfg, env.state_dim, params.branch_sizes, 4, 3, eval_batch=1, epsilon=(1.0, 0.05, 8))
    assert agent.risk_sizer.position_col == env.position_column
    agent.store.load({"risk.fc.w": np.zeros((8, 1), np.float32), "risk.fc.b": np.array([-30.0], np.float32)})
    agent.risk_loss.arena.load({"base_rate": np.array([0.5, 1.0], np.float32)})  # ρ ≈ 0 against a base rate of 1/2
    with pytest.raises(RuntimeError, match="size grid"):  # no collect step yet: the backtest has no grid
        agent.scores(_dev(np.zeros((1, env.state_dim), np.float32)),
                     _dev(np.zeros((1, agent.n_branches, agent.max_actions), np.float32)), s)
    env.reset(3, s)
    for t in range(8):
        agent.collect_step(env, s)
        if t >= 5:
            agent.train_step(s)
    agent.diagnostics_step(env, s)
    stats = agent.read_stats(s)
    count = int(agent.replay.count.copy_to_host()[0])
    obs = agent.replay.store["obs"].copy_to_host()[:count]
    actions = agent.replay.store["action"].copy_to_host()[:count]
    flat_entry = (obs[..., env.position_column] == 0) & np.isin(actions[..., BR_DIRECTION], (DIR_SHORT, DIR_LONG))
    assert flat_entry.sum() > 3 and np.all(actions[..., BR_SIZE][flat_entry] == 0)
    assert (actions[..., BR_SIZE][~flat_entry] > 0).any()  # the rest keep their (random) sizes
    label = agent.risk_labels.arena["label"].copy_to_host()
    assert (label >= 0).any() and set(np.unique(label)) <= {NO_LABEL, 0, 1}
    assert np.all(flat_entry[label[:count] >= 0] | (obs[..., env.position_column][label[:count] >= 0] != 0))
    assert np.isfinite(stats["risk_head_resized_frac"]) and np.isfinite(stats["risk_head_loss"])
    assert stats["risk_head_rho_mean"] < 1e-6 and np.isfinite(stats["risk_head_labeled"])
    arrays = agent.state_arrays()
    np.testing.assert_array_equal(arrays["risk_grid/sizes"], np.float32(params.sizes))
    assert 0.0 < arrays["risk_grid/base_rate"][0] < 1.0 and arrays["risk_grid/base_rate"][1] == 1.0
    result = backtest(market, (150, 185), params, q_fn=agent.scores, n_policies=1, stream=s)
    position = np.abs(np.asarray(result.position))
    assert 0 < position.max() <= 0.25 + 1e-12  # it trades, at the smallest size only
