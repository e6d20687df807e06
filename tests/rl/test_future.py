"""Future-feature regression (numbarl/rl/losses/future.py, agent.future_weight) on the simulator: a hand-computed
case, the float64 reference against finite differences, the kernel against the reference (one-column and product
terms, done rows), the PyTorch peer (autograd), the terms' parsing and resolution, and the agent's aux step."""

import numpy as np
import pytest

from numbarl.config import AgentConfig, ConfigError
from numbarl.cuda.runtime import cuda, stream
from numbarl.cuda.testing import assert_close, assert_fd_gradient
from numbarl.rl.losses.future import FutureFeatureLoss, future_ref, future_terms_ref
from numbarl.rl.obs_columns import NO_COLUMN, parse_obs_terms, resolve_obs_terms

_cuda = cuda()


def test_hand_computed():
    """next_obs = (2, 3, -1); terms x0·x1 = 6 and x2 = -1; p = (5, 1): errors (-1, 2), ℓ = (1 + 4) / 2 = 2.5;
    with B = 1: ∂ℓ/∂p = 2 (-1, 2) / 2 = (-1, 2). A done row: 0, no gradient."""
    first, second = [0, 2], [1, NO_COLUMN]
    np.testing.assert_array_equal(future_terms_ref([[2.0, 3.0, -1.0]], first, second), [[6.0, -1.0]])
    loss, per, d = future_ref([[5.0, 1.0]], [[2.0, 3.0, -1.0]], first, second, [0.0])
    assert loss == pytest.approx(2.5) and per[0] == pytest.approx(2.5)
    np.testing.assert_allclose(d, [[-1.0, 2.0]])
    loss, _, d = future_ref([[5.0, 1.0]], [[2.0, 3.0, -1.0]], first, second, [1.0])
    assert loss == 0.0 and not d.any()


def test_reference_matches_finite_differences(rng):
    p, x = rng.standard_normal((4, 3)), rng.standard_normal((4, 6))
    first, second, dones = [1, 4, 0], [5, NO_COLUMN, 0], np.array([0.0, 1.0, 0.0, 0.0])
    _, _, d = future_ref(p, x, first, second, dones)
    assert_fd_gradient(lambda: future_ref(p, x, first, second, dones)[0], p, d, range(p.size), 1e-8, 1e-7,
                       label="dpred")


def _run(p, x, first, second, dones, weight=0.5):
    B, T = p.shape
    loss = FutureFeatureLoss(B, first, second, x.shape[1])
    s = stream()
    dst = _cuda.to_device(np.full((B, T), np.nan, np.float32))
    loss.apply({"pred": _cuda.to_device(p), "next_obs": _cuda.to_device(x), "dones": _cuda.to_device(dones)},
               {"pred": dst}, s, weight=weight)
    return loss.loss.copy_to_host()[0], loss.per_sample.copy_to_host(), dst.copy_to_host()


def test_kernel_against_reference(rng):
    B, F = 9, 7
    first, second = [3, 0, 6, 2], [1, NO_COLUMN, 6, NO_COLUMN]  # products, one-column terms, a square
    p = rng.standard_normal((B, 4)).astype(np.float32)
    x = rng.standard_normal((B, F)).astype(np.float32)
    dones = (rng.random(B) < 0.3).astype(np.float32)
    dones[0] = 1.0
    got_loss, got_per, got_d = _run(p, x, first, second, dones)
    ref_loss, ref_per, ref_d = future_ref(p, x, first, second, dones)
    assert_close(got_per, ref_per, 1e-6, 1e-5)
    assert got_loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert_close(got_d, 0.5 * ref_d, 1e-7, 1e-5)  # weight 0.5 into a NaN-filled buffer: overwritten
    assert got_per[0] == 0.0 and not got_d[0].any()
    with pytest.raises(ValueError, match="outside an observation of 7 columns"):
        FutureFeatureLoss(B, [7], [NO_COLUMN], F)
    loss = FutureFeatureLoss(B, first, second, F)
    with pytest.raises(ValueError, match=r"next_obs \(9, 5\)"):
        loss.compute({"pred": _cuda.to_device(p), "next_obs": _cuda.to_device(x[:, :5].copy()),
                      "dones": _cuda.to_device(dones)}, stream())


def test_pytorch_peer(rng):
    torch = pytest.importorskip("torch")
    B, F = 6, 5
    first, second = [0, 2, 4], [1, NO_COLUMN, 4]
    p = rng.standard_normal((B, 3)).astype(np.float32)
    x = rng.standard_normal((B, F)).astype(np.float32)
    dones = np.array([0, 0, 1, 0, 0, 0], np.float32)
    pt, xt = torch.tensor(p, requires_grad=True), torch.tensor(x)
    y = torch.stack([xt[:, 0] * xt[:, 1], xt[:, 2], xt[:, 4] * xt[:, 4]], dim=1)
    peer = ((1 - torch.tensor(dones)) * ((pt - y) ** 2).mean(1)).mean()
    peer.backward()
    got_loss, _, got_d = _run(p, x, first, second, dones)
    assert got_loss == pytest.approx(peer.item(), rel=1e-5)
    assert_close(got_d, 0.5 * pt.grad.numpy(), 1e-7, 1e-5)


def test_terms_parse_resolve_and_fail_naming_the_field():
    assert parse_obs_terms("trade_imb_prev*ret_1, ret_1", "future_targets") == (("trade_imb_prev", "ret_1"),
                                                                                ("ret_1",))
    names = ["ret_1", "trade_imb", "trade_imb_prev"]
    assert resolve_obs_terms("trade_imb_prev*ret_1,1,position", names, "future_targets") == ([2, 1, 3],
                                                                                           [0, NO_COLUMN, NO_COLUMN])
    for bad, msg in (("", "at least one term"), ("a*b*c", "product of two"), ("ret_1,ret_1", "listed twice"),
                     ("ret_1*", "product of two"), ("ret-1", "neither a feature name")):
        with pytest.raises(ConfigError, match=msg):
            parse_obs_terms(bad, "future_targets")
    for same in ("ret_1*trade_imb,trade_imb*ret_1", "ret_1,0"):  # the same columns by order or by index
        with pytest.raises(ConfigError, match="names the same columns as an earlier one"):
            resolve_obs_terms(same, names, "future_targets")
    with pytest.raises(ConfigError, match="agent.future_targets.*'rv_99' is not a column"):
        resolve_obs_terms("ret_1*rv_99", names, "future_targets")
    with pytest.raises(ConfigError, match="agent.future_targets.*'ret_11' is not a feature"):
        AgentConfig(future_weight=0.1, future_targets="ret_11").validate()
    with pytest.raises(ConfigError, match="agent.future_targets.*at least one term"):
        AgentConfig(future_weight=0.1).validate()
    with pytest.raises(ConfigError, match="only with agent.future_weight > 0"):
        AgentConfig(future_targets="ret_1").validate()
    AgentConfig(future_weight=0.1, future_targets="trade_imb_prev*ret_1").validate()


# ---------------------------------------------------------------------------------------------
# the agent (agent.future_weight > 0): an auxiliary loss on the aux train steps
# ---------------------------------------------------------------------------------------------
def test_agent_aux_step_trains_the_head_and_the_trunk(rng):
    """One aux step: head.ff and the trunk get gradients; future_loss is the reference loss of the head's output
    (pre-update parameters) against the terms of the batch's next_obs, masked by its dones; the trunk's gradient is
    the sum of the C51 head's and the future head's input gradients; a plain step zeroes the head's gradients."""
    from agent_helpers import aux_head_agent_after_one_step, check_trunk_gradient_adds_the_aux_head_then_plain_step_zeroes_it

    agent, s, before = aux_head_agent_after_one_step(rng, "head.ff.", future_weight=0.25, future_targets="1*3,0")
    p64 = {k: np.asarray(v, np.float64) for k, v in before.items()}
    h_on = agent.trunk.output("online").copy_to_host()
    pred, _ = agent.ff_head.forward_ref(h_on, p64)
    loss_ref, _, _ = future_ref(pred, agent.replay.batch.next_obs.copy_to_host(), [1, 0], [3, NO_COLUMN],
                                agent.replay.batch.done.copy_to_host())
    stats = agent.read_stats(s)
    assert stats["future_loss"] > 0 and stats["future_loss"] == pytest.approx(loss_ref, rel=1e-5)
    check_trunk_gradient_adds_the_aux_head_then_plain_step_zeroes_it(  # λ-scaled in place by Loss.apply
        agent, s, before, agent.ff_loss.grad("pred").copy_to_host(), "head.ff.")


def test_the_regime_walks_flow_move_term_carries_the_regime():
    """bin/regime-term-probe on a small regime-walk cache: the term trade_imb_prev*ret_1 three bars ahead
    correlates with the hidden regime now (what makes it a target for agent.future_weight), ret_1 alone does not."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    import os

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}  # the tree under test
    out = subprocess.run([sys.executable, str(root / "bin" / "regime-term-probe")], capture_output=True, text=True,
                         check=True, timeout=300, env=env).stdout
    corr = {(m[1], int(m[2])): float(m[3]) for m in re.finditer(r"(\S+)\s+n=(\d): corr with the regime ([+-][\d.]+)",
                                                                 out)}
    assert corr[("trade_imb_prev*ret_1", 3)] > 0.3 and corr[("trade_imb_prev*ret_1", 1)] > 0.3, out
    assert abs(corr[("ret_1", 3)]) < 0.1 and abs(corr[("ret_1", 1)]) < 0.1, out
    for terms, msg in (("ret_1*nope", "'nope' is not a column"),
                       ("ret_1*position", "('position' in the observation) is not an obs column")):
        bad = subprocess.run([sys.executable, str(root / "bin" / "regime-term-probe"), "--terms", terms],
                             capture_output=True, text=True, timeout=300, env=env, check=False)
        assert bad.returncode == 2 and msg in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
