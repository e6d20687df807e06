"""E7: the large-margin loss against its float64 reference and finite differences, the hindsight
label kernel against its numpy model on a scripted sequence, and the label gather."""

from types import SimpleNamespace

import numpy as np
import pytest

from numbarl.cuda.runtime import cuda
from numbarl.env.params import DIR_FLAT, EXIT_NONE
from numbarl.rl.feedback.hindsight import NO_LABEL, HindsightLabels, gather_labels_kernel, label_ref
from numbarl.rl.losses.margin import MarginLoss, margin_ref

_cuda = cuda()


def _lse(logits):
    m = logits.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)))[..., 0]


def test_margin_hand_computed_two_atoms():
    # one sample, support (0, 1), three actions with Q = 0.5, 0.2, 0.7 (p_1 = Q): label 1, margin 0.8
    q = np.array([0.5, 0.2, 0.7])
    logits = np.zeros((1, 1, 3, 2))
    logits[0, 0, :, 1] = np.log(q / (1 - q))
    loss, per, d = margin_ref(logits, np.array([1]), np.array([0.0, 1.0]), 0, 3, 0.8, 1.0)
    assert per[0] == pytest.approx(0.7 + 0.8 - 0.2)  # max(0.5+0.8, 0.2, 0.7+0.8) - Q(label)
    assert loss == pytest.approx(per[0])
    # d logits of atom 1 at a: ± p1 (1 - Q) = ± q(1 - q) (p_z (z - Q) at z = 1); a* = 2 gets +, the label -
    assert d[0, 0, 2, 1] == pytest.approx(0.7 * 0.3) and d[0, 0, 1, 1] == pytest.approx(-0.2 * 0.8)
    assert d[0, 0, 0].sum() == 0.0
    # already separated by the margin: no loss, no gradient
    loss, per, d = margin_ref(logits, np.array([2]), np.array([0.0, 5.0]), 0, 3, 0.1, 1.0)
    assert per[0] == 0.0 and not d.any()


def test_margin_reference_gradient_finite_differences(rng):
    B, nb, A, Z = 5, 2, 3, 4
    logits = rng.normal(size=(B, nb, A, Z))
    labels = np.array([0, -1, 2, 1, 0])
    z = np.linspace(-1.0, 1.0, Z)
    _, _, d = margin_ref(logits, labels, z, 0, 3, 0.3, 0.2)
    eps = 1e-6
    for idx in [(0, 0, 0, 1), (2, 0, 2, 3), (3, 0, 1, 0), (1, 0, 1, 2), (4, 1, 2, 2), (0, 0, 1, 0)]:
        up, dn = logits.copy(), logits.copy()
        up[idx] += eps
        dn[idx] -= eps
        num = (margin_ref(up, labels, z, 0, 3, 0.3, 0.2)[0] - margin_ref(dn, labels, z, 0, 3, 0.3, 0.2)[0]) / (2 * eps)
        assert d[idx] == pytest.approx(num, abs=1e-7)


def test_margin_kernel_matches_reference(rng):
    B, branch_sizes, Z = 9, (3, 3, 4, 4), 5
    A = max(branch_sizes)
    logits = rng.normal(size=(B, 4, A, Z)).astype(np.float32)
    lse = _lse(logits.astype(np.float64)).astype(np.float32)
    labels = np.array([0, 1, 2, -1, 1, 0, -1, 2, 2], np.int32)
    z = np.linspace(-2.0, 2.0, Z).astype(np.float32)
    loss = MarginLoss(B, branch_sizes, Z, branch=0, margin=0.8)
    loss.set_weight(0.1)
    dev = {"logits": _cuda.to_device(logits), "lse": _cuda.to_device(lse), "labels": _cuda.to_device(labels),
           "support": _cuda.to_device(z)}
    loss.compute(dev, 0)
    want_loss, want_per, want_d = margin_ref(logits, labels, z, 0, 3, 0.8, np.float32(0.1 / B))
    np.testing.assert_allclose(loss.arena["d_logits"].copy_to_host(), want_d, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(loss.per_sample.copy_to_host(), want_per, rtol=1e-5, atol=1e-6)
    assert loss.loss.copy_to_host()[0] == pytest.approx(want_per.sum() / B, rel=1e-5)
    assert want_per[labels >= 0].max() > 0 and np.all(want_per[labels < 0] == 0)


def _scripted(n_envs, steps, seed):
    """A scripted env: per step each env may close a trade (P&L +/-) and may hold a position."""
    rng = np.random.default_rng(seed)
    out = []
    entry = np.zeros(n_envs, np.int64)
    pos = np.zeros(n_envs, np.float32)
    for t in range(steps):
        close = rng.random(n_envs) < 0.3
        reason = np.where(close & (pos != 0), 1, EXIT_NONE).astype(np.int32)
        pnl = np.where(reason != EXIT_NONE, rng.normal(size=n_envs), 0.0)
        pos = np.where(reason != EXIT_NONE, 0.0, pos).astype(np.float32)
        opening = (pos == 0) & (rng.random(n_envs) < 0.4)
        pos = np.where(opening, 1.0, pos).astype(np.float32)
        entry = np.where(opening, t, entry)
        out.append(SimpleNamespace(trade_pnl=pnl, exit_reason=reason, bar=np.full(n_envs, t, np.int64),
                                   position=pos.copy(), entry_bar=entry.copy()))
    return out


def test_label_kernel_matches_numpy_model_through_the_ring():
    n_envs, n_slots, steps = 6, 5, 23
    script = _scripted(n_envs, steps, 4)
    h = HindsightLabels(n_slots, n_envs, batch=8).allocate()
    count = _cuda.to_device(np.zeros(1, np.int64))
    model_label = np.full((n_slots, n_envs), NO_LABEL, np.int32)
    model_entry = np.full(n_envs, -1, np.int64)
    model_n = np.zeros(n_envs, np.int64)
    for t, step in enumerate(script):
        count.copy_to_device(np.array([t + 1], np.int64))  # the replay wrote this step's row
        env_out = SimpleNamespace(**{k: _cuda.to_device(getattr(step, k)) for k in ("trade_pnl", "exit_reason", "bar")})
        state = SimpleNamespace(position=_cuda.to_device(step.position), entry_bar=_cuda.to_device(step.entry_bar))
        h.mark(env_out, state, SimpleNamespace(count=count), 0)
        label_ref(step.trade_pnl, step.exit_reason, step.bar, step.position, step.entry_bar, model_label, t + 1,
                  model_entry, model_n)
        np.testing.assert_array_equal(h.arena["label"].copy_to_host(), model_label)
    assert h.labelled() == model_n.sum() > 0
    assert set(np.unique(model_label)) <= {NO_LABEL, DIR_FLAT}
    # the gather: sampled rows slot * n_envs + env (and -1 for an empty draw)
    index = np.array([0, 7, 13, 29, -1, 4, 11, 24], np.int64)
    out = _cuda.to_device(np.zeros(8, np.int32))
    gather_labels_kernel[1, 32](h.arena["label"], _cuda.to_device(index), out)
    flat = model_label.reshape(-1)
    want = np.where(index >= 0, flat[np.maximum(index, 0)], NO_LABEL)
    np.testing.assert_array_equal(out.copy_to_host(), want)


def test_margin_kernel_matches_the_pytorch_peer(rng):
    """The device loss and d_logits against torch autograd of the same DQfD margin (fp32, 1e-5
    relative to the largest gradient)."""
    pytest.importorskip("torch")
    from numbarl.rl.torch_peer import margin_loss_and_grads

    B, branch_sizes, Z = 11, (3, 3, 4, 4), 7
    logits = (rng.normal(size=(B, 4, max(branch_sizes), Z)) * 2.0).astype(np.float32)
    lse = _lse(logits.astype(np.float64)).astype(np.float32)
    labels = rng.integers(-1, 3, size=B).astype(np.int32)
    z = np.linspace(-1.5, 1.5, Z).astype(np.float32)
    loss = MarginLoss(B, branch_sizes, Z, branch=0, margin=0.8)
    loss.set_weight(0.1)
    loss.compute({"logits": _cuda.to_device(logits), "lse": _cuda.to_device(lse), "labels": _cuda.to_device(labels),
                  "support": _cuda.to_device(z)}, 0)
    peer = margin_loss_and_grads(logits, labels, z, 0, 3, 0.8, np.float32(0.1 / B))
    d = loss.arena["d_logits"].copy_to_host()
    assert np.abs(peer["d_logits"]).max() > 0
    np.testing.assert_allclose(d, peer["d_logits"], rtol=0, atol=1e-5 * np.abs(peer["d_logits"]).max())
    np.testing.assert_allclose(loss.per_sample.copy_to_host(), peer["per_sample"], rtol=1e-5, atol=1e-6)
    assert loss.loss.copy_to_host()[0] * 0.1 == pytest.approx(peer["loss"], rel=1e-5)
