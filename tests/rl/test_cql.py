"""The CQL regularizer (numbarl/rl/losses/cql.py): finite differences of the float64 reference, a
hand-computed case, the kernel against the reference on odd shapes, and its gradient added into the
C51 loss's buffer by the loss contract (two losses, one head, one step), and the PyTorch peer (autograd of
the same term; skipped without torch)."""

import math

import numpy as np
import pytest

from numbarl.cuda.runtime import cuda, stream
from numbarl.cuda.testing import assert_close
from numbarl.rl.losses.c51 import C51Loss
from numbarl.rl.losses.cql import CqlLoss, cql_ref
from numbarl.rl.nets.base import ParamStore

_cuda = cuda()
SIZES = (3, 2)
Z = 5
SUPPORT = np.linspace(-2.0, 2.0, Z)


def _logits(rng, B):
    x = rng.standard_normal((B, len(SIZES), max(SIZES), Z))
    for k, n in enumerate(SIZES):
        x[:, k, n:, :] = -np.inf  # padding, as the head writes it
    return x


def test_reference_gradient_matches_finite_differences(rng):
    B = 4
    x = _logits(rng, B)
    actions = np.stack([rng.integers(0, n, B) for n in SIZES], axis=1)
    _, _, d = cql_ref(x, actions, SUPPORT, SIZES)
    eps = 1e-6
    for _ in range(25):
        b, k = rng.integers(B), rng.integers(len(SIZES))
        a, j = rng.integers(SIZES[k]), rng.integers(Z)
        up, down = x.copy(), x.copy()
        up[b, k, a, j] += eps
        down[b, k, a, j] -= eps
        numeric = (cql_ref(up, actions, SUPPORT, SIZES)[0] - cql_ref(down, actions, SUPPORT, SIZES)[0]) / (2 * eps)
        assert abs(d[b, k, a, j] - numeric) <= 1e-7 + 1e-5 * abs(numeric)
    assert np.all(d[:, 1, 2:, :] == 0)  # padding


def test_hand_computed():
    """Two actions with equal Q: logsumexp = Q + ln 2, so the regularizer is ln 2 per branch."""
    x = np.zeros((1, 1, 2, Z))
    loss, per, d = cql_ref(x, np.array([[1]]), SUPPORT, (2,))
    assert math.isclose(loss, math.log(2.0)) and math.isclose(per[0], math.log(2.0))
    # uniform atoms: Q = 0, g = 1/2 - [a = taken], d = g * p * (z - Q) = g z / 5: zero sum over the atoms
    assert np.allclose(d[0, 0, 0], 0.5 * SUPPORT / Z) and np.allclose(d[0, 0, 1], -0.5 * SUPPORT / Z)
    x[0, 0, 0, 4] = 1.0  # action 0 now has the higher Q
    loss2, _, d2 = cql_ref(x, np.array([[1]]), SUPPORT, (2,))
    assert loss2 > math.log(2.0)  # the untaken action's Q rose: the penalty grows
    assert d2[0, 0, 0, 4] > 0  # and its gradient lowers that atom's logit (gradient descent)


def _head_outputs(x):
    """(logits, lse) as the head writes them: lse of every real action row, -inf at padding."""
    lse = np.full(x.shape[:3], -np.inf)
    for idx in np.ndindex(*x.shape[:3]):
        row = x[idx]
        if np.all(np.isfinite(row)):
            m = row.max()
            lse[idx] = m + np.log(np.exp(row - m).sum())
    return x.astype(np.float32), lse.astype(np.float32)


def test_kernel_matches_reference(rng):
    B = 9
    x = _logits(rng, B)
    actions = np.stack([rng.integers(0, n, B) for n in SIZES], axis=1).astype(np.int32)
    loss_ref, per_ref, d_ref = cql_ref(x, actions, SUPPORT, SIZES)
    logits, lse = _head_outputs(x)
    cql = CqlLoss(B, SIZES, SUPPORT.astype(np.float32))
    s = stream()
    cql.compute({"logits": _cuda.to_device(logits), "lse": _cuda.to_device(lse), "actions": _cuda.to_device(actions)}, s)
    assert_close(cql.loss.copy_to_host()[0], loss_ref, 1e-6, 1e-5)
    assert_close(cql.per_sample.copy_to_host(), per_ref, 1e-6, 1e-5)
    assert_close(cql.grad("logits").copy_to_host(), d_ref, 1e-7, 1e-4)


def test_two_losses_one_head_one_step(rng):
    """C51 writes d_logits first, CQL adds α times its gradient into the same buffer."""
    B, alpha = 6, 0.7
    x = _logits(rng, B)
    logits, lse = _head_outputs(x)
    actions = np.stack([rng.integers(0, n, B) for n in SIZES], axis=1).astype(np.int32)
    c51 = C51Loss(B, SIZES, Z, -2.0, 2.0)
    cql = CqlLoss(B, SIZES, SUPPORT.astype(np.float32))
    probs = np.full(x.shape, 1.0 / Z, np.float32)
    next_q = rng.standard_normal(x.shape[:3]).astype(np.float32)
    dev = {k: _cuda.to_device(v) for k, v in dict(
        logits=logits, lse=lse, actions=actions, next_q=next_q, target_probs=probs,
        rewards=rng.standard_normal(B).astype(np.float32), dones=np.zeros(B, np.float32),
        discounts=np.full(B, 0.9, np.float32)).items()}
    store = ParamStore()  # the ledger only
    s = stream()
    c51.compute(dev, s)
    alone = c51.d_logits.copy_to_host()
    store.begin_step()
    c51.apply(dev, {"logits": c51.d_logits}, s, ledger=store)
    cql.apply(dev, {"logits": c51.d_logits}, s, weight=alpha, ledger=store)
    store.end_step()
    _, _, d_cql = cql_ref(x, actions, SUPPORT, SIZES)
    assert_close(c51.d_logits.copy_to_host(), alone + alpha * d_cql, 1e-6, 1e-4)


def test_aux_frequency_runs_the_regularizer_every_kth_train_step():
    """agent.aux_frequency = 3: train steps k = collect_steps / train_every with k % 3 == 0 run the
    graph with CQL ("train_aux"), the others the C51 loss alone; without CQL there is one graph."""
    from dataclasses import replace

    from numbarl.config import PRESETS
    from numbarl.rl.agents.dqn import DQNAgent

    cfg = replace(PRESETS["tiny"].agent, cql_alpha=0.5, aux_frequency=3)
    agent = DQNAgent(cfg, 12, (3, 3, 4, 4), 4, seed=1)
    start = agent.prefill_steps
    got = [agent.after_collect(t, 0, 2) for t in range(start, start + 12)]
    want = [() if t % 2 else (("train_aux",) if (t // 2) % 3 == 0 else ("train",)) for t in range(start, start + 12)]
    assert got == want and ("train_aux",) in got and ("train",) in got
    assert {"train", "train_aux"} <= set(agent.step_functions(env=None))
    plain = DQNAgent(replace(cfg, cql_alpha=0.0), 12, (3, 3, 4, 4), 4, seed=1)
    assert "train_aux" not in plain.step_functions(env=None)
    assert all(a in ((), ("train",)) for a in (plain.after_collect(t, 0, 1) for t in range(start, start + 6)))


def test_torch_peer_matches_numbarl(rng):
    """The kernel's loss, per-sample losses and d_logits against torch autograd of the CQL(H) term on the same
    float32 logits (numbarl/rl/torch_peer.py:cql_loss_and_grads), within 1e-5 relative."""
    pytest.importorskip("torch")
    from numbarl.rl.torch_peer import cql_loss_and_grads

    B = 11
    x = _logits(rng, B) * 1.5
    actions = np.stack([rng.integers(0, n, B) for n in SIZES], axis=1).astype(np.int32)
    logits, lse = _head_outputs(x)
    cql = CqlLoss(B, SIZES, SUPPORT.astype(np.float32))
    s = stream()
    cql.compute({"logits": _cuda.to_device(logits), "lse": _cuda.to_device(lse), "actions": _cuda.to_device(actions)}, s)
    peer = cql_loss_and_grads(logits, actions, SUPPORT.astype(np.float32), SIZES, device="cpu")

    def rel_close(a, b, what):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= 1e-5 * max(np.max(np.abs(b)), 1e-30), what

    assert float(cql.loss.copy_to_host()[0]) == pytest.approx(peer["loss"], rel=1e-5)
    rel_close(cql.per_sample.copy_to_host(), peer["per_sample"], "per_sample")
    got = cql.grad("logits").copy_to_host()
    assert np.all(peer["d_logits"][:, 1, 2:, :] == 0) and np.all(got[:, 1, 2:, :] == 0)  # padding
    rel_close(got, peer["d_logits"], "d_logits")
