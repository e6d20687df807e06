"""Predictive coding loss (numbarl/rl/losses/predictive.py) on the simulator: a hand-computed case,
the float64 reference against finite differences, the kernel against the reference (zero vectors,
done rows), the gradient rule through Loss.apply, and the PyTorch peer (F.normalize, autograd)."""

import numpy as np
import pytest

from numbarl.cuda.runtime import cuda, stream
from numbarl.cuda.testing import assert_close, assert_fd_gradient
from numbarl.rl.losses.predictive import PredictiveLoss, predictive_ref

_cuda = cuda()


def test_hand_computed():
    """p = (3, 4) → p̂ = (0.6, 0.8); t = (0, 2) → t̂ = (0, 1): cos = 0.8, ℓ = 2 − 1.6 = 0.4; with B = 1:
    ∂ℓ/∂p = −2 (t̂ − 0.8 p̂) / 5 = −0.4 (−0.48, 0.36) = (0.192, −0.144). A done row: 0, no gradient."""
    loss, _, d = predictive_ref([[3.0, 4.0]], [[0.0, 2.0]], [0.0])
    assert loss == pytest.approx(0.4)
    np.testing.assert_allclose(d, [[0.192, -0.144]])
    loss, _, d = predictive_ref([[3.0, 4.0]], [[0.0, 2.0]], [1.0])
    assert loss == 0.0 and not d.any()


def test_reference_matches_finite_differences(rng):
    p, t = rng.standard_normal((4, 6)), rng.standard_normal((4, 6))
    dones = np.array([0.0, 1.0, 0.0, 0.0])
    _, _, d = predictive_ref(p, t, dones)
    assert_fd_gradient(lambda: predictive_ref(p, t, dones)[0], p, d, range(p.size), 1e-8, 1e-7, label="dpred")


def _run(p, t, dones):
    B, H = p.shape
    loss = PredictiveLoss(B, H)
    s = stream()
    dst = _cuda.to_device(np.full((B, H), np.nan, np.float32))
    loss.apply({"pred": _cuda.to_device(p), "target": _cuda.to_device(t), "dones": _cuda.to_device(dones)},
               {"pred": dst}, s, weight=0.5)
    return loss.loss.copy_to_host()[0], loss.per_sample.copy_to_host(), dst.copy_to_host()


def test_kernel_against_reference(rng):
    B, H = 9, 7
    p = rng.standard_normal((B, H)).astype(np.float32)
    t = np.maximum(rng.standard_normal((B, H)), 0).astype(np.float32)  # ReLU features
    p[2] = 0.0  # a zero prediction: per-sample 1 (t̂ alone), no gradient
    t[4] = 0.0  # a dead target row
    dones = (rng.random(B) < 0.3).astype(np.float32)
    dones[2] = dones[4] = 0.0
    got_loss, got_per, got_d = _run(p, t, dones)
    ref_loss, ref_per, ref_d = predictive_ref(p, t, dones)
    assert_close(got_per, ref_per, 1e-6, 1e-5)
    assert got_loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert_close(got_d, 0.5 * ref_d, 1e-7, 1e-5)  # weight 0.5 into a NaN-filled buffer: overwritten
    assert got_per[2] == pytest.approx(1.0) and not got_d[2].any()


def test_pytorch_peer(rng):
    torch = pytest.importorskip("torch")
    B, H = 6, 5
    p = rng.standard_normal((B, H)).astype(np.float32)
    t = rng.standard_normal((B, H)).astype(np.float32)
    dones = np.array([0, 0, 1, 0, 0, 0], np.float32)
    pt = torch.tensor(p, requires_grad=True)
    diff = torch.nn.functional.normalize(pt, dim=1) - torch.nn.functional.normalize(torch.tensor(t), dim=1)
    peer = ((1 - torch.tensor(dones)) * (diff * diff).sum(1)).mean()
    peer.backward()
    got_loss, _, got_d = _run(p, t, dones)
    assert got_loss == pytest.approx(peer.item(), rel=1e-5)
    assert_close(got_d, 0.5 * pt.grad.numpy(), 1e-7, 1e-5)


# ---------------------------------------------------------------------------------------------
# the agent (agent.predictive_weight > 0): an auxiliary loss on the aux train steps
# ---------------------------------------------------------------------------------------------
def test_trunk_gradient_is_the_sum_of_both_heads(rng):
    """The predictor's input gradient adds into the C51 head's dh; the trunk's backward runs on the sum."""
    from agent_helpers import check_trunk_gradient_is_the_sum_of_both_heads

    from numbarl.rl.nets.linear import Linear

    check_trunk_gradient_is_the_sum_of_both_heads(rng, lambda h: Linear("head.pc", h, h, None, group="head.pc"),
                                                  lambda b: (b, 6))


def test_agent_aux_step_trains_the_predictor_and_the_trunk(rng):
    """One aux step: head.pc and the trunk get gradients; predictive_loss is the reference loss of the
    predictor's output (pre-update parameters) against the target pass's trunk output on next_obs,
    masked by the batch's dones; a plain step zeroes the predictor's gradients."""
    from agent_helpers import aux_head_agent_after_one_step, check_trunk_gradient_adds_the_aux_head_then_plain_step_zeroes_it

    agent, s, before = aux_head_agent_after_one_step(rng, "head.pc.", predictive_weight=0.25)
    h_on = agent.trunk.output("online").copy_to_host()
    pred, _ = agent.pc_head.forward_ref(h_on, {k: np.asarray(v, np.float64) for k, v in before.items()})
    loss_ref, _, _ = predictive_ref(pred, agent.trunk.output("target").copy_to_host(),
                                    agent.replay.batch.done.copy_to_host())
    stats = agent.read_stats(s)
    assert stats["predictive_loss"] > 0 and stats["predictive_loss"] == pytest.approx(loss_ref, rel=1e-5)
    # inside the agent the predictor's input gradient (λ · ∂L/∂pred through W_pc) adds to the C51 head's dh
    check_trunk_gradient_adds_the_aux_head_then_plain_step_zeroes_it(  # λ-scaled in place by Loss.apply
        agent, s, before, agent.pc_loss.grad("pred").copy_to_host(), "head.pc.")
