"""The JAX peer (numbarl.rl.jax_peer) against numbarl's float64 references.

(a) loss, per-sample loss and every gradient against the reference pipeline (Mlp / head
    forward_ref, c51_loss_ref, head / trunk backward_ref), for a ReLU trunk and a
    Linear-LayerNorm-SiLU trunk; (b) whole train steps (clip, AdamW with masked weight decay, Polyak
    or periodic target update, a non-finite step skipped) against `adam_ref` / `target_update_ref`;
    (c) the acting step's greedy actions (with and without a mask) and the padded outputs against a
    numpy forward. Small odd shapes (branches 3/2/4: padding in two branches), float32 on jax's CPU
    backend. Skipped without jax (`pip install numbarl[jax]`); the test of the message that says so
    runs everywhere.
"""

import subprocess
import sys

import numpy as np
import pytest

from numbarl.rl.losses import c51
from numbarl.rl.nets.base import ParamStore
from numbarl.rl.nets.c51_head import BranchedDuelingC51Head, make_support
from numbarl.rl.nets.mlp import Mlp
from numbarl.rl.optim import (
    STAT_CLIP_SCALE,
    STAT_GRAD_NORM,
    AdamConfig,
    TargetConfig,
    adam_ref,
    target_update_ref,
)

SIZES = (3, 2, 4)  # odd branch sizes: padding in branches 0 and 1
STATE_DIM = 7
WIDTHS = (16, 12)
N_ATOMS = 11
V_MIN, V_MAX = -2.0, 3.0
BATCH = 37


def _jax_peer():
    pytest.importorskip("jax")
    from numbarl.rl import jax_peer

    return jax_peer


def _rel_close(actual, expected, rel, what=""):
    """Norm-relative error < rel and every element within 10·rel of the largest magnitude (the
    bound of the GPU peer tests, tests/rl/test_gpu_c51.py); non-finite entries must match exactly."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} vs {e.shape}"
    fin = np.isfinite(e)
    assert np.array_equal(fin, np.isfinite(a)) and np.array_equal(a[~fin], e[~fin]), f"{what}: non-finite entries differ"
    a, e = a[fin], e[fin]
    norm_err = np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30)
    max_err = np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30)
    assert norm_err < rel and max_err < 10 * rel, f"{what}: norm-relative error {norm_err:.3g}, max/scale {max_err:.3g}"


class Net:
    """numbarl's trunk + head declared in a ParamStore (host values only: nothing runs on a device),
    with float64 reference passes."""

    def __init__(self, rng, layernorm=False, activation="relu"):
        self.store = ParamStore()
        self.trunk = Mlp("trunk", STATE_DIM, WIDTHS, activation, layernorm=layernorm)
        self.head = BranchedDuelingC51Head("head", WIDTHS[-1], SIZES, N_ATOMS, V_MIN, V_MAX)
        self.trunk.declare_params(self.store)
        self.head.declare_params(self.store)
        # LayerNorm starts at gamma 1, beta 0: perturbed so that their gradients are not special
        self.values = {n: (np.asarray(s.init(rng, s.shape)) + 0.1 * rng.standard_normal(s.shape)).astype(np.float32)
                       for n, s in self.store.specs.items()}
        self.target = {n: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32) for n, v in self.values.items()}
        self.support = make_support(N_ATOMS, V_MIN, V_MAX)

    def forward_ref(self, obs, values):
        h, trunk_cache = self.trunk.forward_ref(obs, values)
        out, head_cache = self.head.forward_ref(h, values)
        return out, (trunk_cache, head_cache)

    def loss_ref(self, batch, values=None, target=None):
        """(loss, per_sample, grads {name: float64}, a* [B, K]) of the whole pipeline in float64."""
        values = self.values if values is None else values
        target = self.target if target is None else target
        online, (trunk_cache, head_cache) = self.forward_ref(batch["obs"], values)
        nxt, _ = self.forward_ref(batch["next_obs"], values)
        tgt, _ = self.forward_ref(batch["next_obs"], target)
        loss, per_sample, d_logits, _ = c51.c51_loss_ref(online.logits, batch["actions"], nxt.q, tgt.probs,
                                                         batch["rewards"], batch["dones"], batch["discounts"],
                                                         self.support, SIZES, weights=batch.get("weights"))
        dh, grads = self.head.backward_ref(d_logits, head_cache, values)
        _, trunk_grads = self.trunk.backward_ref(dh, trunk_cache, values)
        grads.update(trunk_grads)
        return loss, per_sample, grads, c51.double_dqn_actions_ref(nxt.q, SIZES)

    def peer(self, jax_peer, **kw):
        spec = jax_peer.PeerSpec.from_numbarl(self.trunk, self.head, self.store)
        return jax_peer.JaxPeer(spec, self.values, self.target, **kw)


def _batch(rng, batch=BATCH, weights=True):
    out = {
        "obs": rng.standard_normal((batch, STATE_DIM)).astype(np.float32),
        "next_obs": rng.standard_normal((batch, STATE_DIM)).astype(np.float32),
        "actions": np.stack([rng.integers(0, n, batch) for n in SIZES], axis=1).astype(np.int32),
        "rewards": rng.uniform(1.5 * V_MIN, 1.5 * V_MAX, batch).astype(np.float32),  # some beyond the support
        "dones": (rng.random(batch) < 0.3).astype(np.float32),
        "discounts": (0.99 ** rng.integers(1, 4, batch)).astype(np.float32),
    }
    out["dones"][0], out["dones"][-1] = 1.0, 0.0  # at least one of each
    if weights:
        out["weights"] = rng.uniform(0.5, 1.5, batch).astype(np.float32)
    return out


def _separated(q, gap=1e-4):
    """[N, K] bool: the best valid action of the branch beats the second by more than `gap`, so a
    float32 argmax must agree with the float64 one."""
    out = np.ones(q.shape[:2], bool)
    for k, n in enumerate(SIZES):
        top = np.sort(q[:, k, :n], axis=1)
        with np.errstate(invalid="ignore"):  # -inf - -inf: no action available, nothing to decide
            out[:, k] = (n == 1) | (top[:, -1] - top[:, -2] > gap)
    return out


# ---------------------------------------------------------------------------------------------
# without jax
# ---------------------------------------------------------------------------------------------
def test_import_needs_no_jax_and_the_error_says_what_to_install(monkeypatch):
    code = "import sys, numbarl.rl.jax_peer, numbarl.bench.train; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    from numbarl.rl import jax_peer

    monkeypatch.setitem(sys.modules, "jax", None)  # `import jax` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install numbarl\[jax\]"):
        jax_peer.import_jax()


# ---------------------------------------------------------------------------------------------
# (a) loss and gradients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layernorm, activation", [(False, "relu"), (True, "silu")])
def test_loss_and_gradients_match_float64_reference(rng, layernorm, activation):
    jax_peer = _jax_peer()
    net = Net(rng, layernorm, activation)
    batch = _batch(rng)
    loss_ref, per_sample_ref, grads_ref, a_star = net.loss_ref(batch)
    peer = net.peer(jax_peer)
    jb = jax_peer.batch_to_jax(batch)

    # the peer's own double-DQN argmax agrees wherever float32 can decide it
    _, _, q = peer.outputs(jb["next_obs"])
    ref_next, _ = net.forward_ref(batch["next_obs"], net.values)
    sep = _separated(ref_next.q)
    assert sep.mean() > 0.9
    peer_a_star = np.stack([q[:, k, :n].argmax(1) for k, n in enumerate(SIZES)], axis=1)
    np.testing.assert_array_equal(peer_a_star[sep], a_star[sep])

    # with the reference's a* (no near-tie flips): loss, per-sample loss and every gradient
    loss, per_sample, grads = peer.loss_and_grads(jb, next_actions=a_star)
    assert loss == pytest.approx(loss_ref, rel=1e-5)
    _rel_close(per_sample, per_sample_ref, rel=1e-5, what="per_sample")
    assert set(grads) == set(net.store.specs) == set(grads_ref)
    for name in grads:
        _rel_close(grads[name], grads_ref[name], rel=1e-5, what=f"grad {name}")

    # the peer's own argmax gives the same loss when it agrees everywhere
    if np.array_equal(peer_a_star, a_star):
        assert peer.loss_and_grads(jb)[0] == pytest.approx(loss_ref, rel=1e-5)


# ---------------------------------------------------------------------------------------------
# (b) whole train steps: clip, AdamW, target update
# ---------------------------------------------------------------------------------------------
def _flat(d, names):
    return np.concatenate([np.ravel(np.asarray(d[n], np.float64)) for n in names])


@pytest.mark.parametrize("target_cfg", [TargetConfig.polyak(0.1), TargetConfig.periodic(2)], ids=["polyak", "periodic"])
def test_train_steps_match_adam_and_target_references(rng, target_cfg):
    jax_peer = _jax_peer()
    net = Net(rng)
    batch = jax_peer.batch_to_jax(_batch(rng))
    names = list(net.store.specs)
    decay_mask = np.concatenate([np.full(int(np.prod(s.shape)), float(s.decay)) for s in net.store.specs.values()])
    assert 0 < decay_mask.mean() < 1  # weights decayed, biases not
    # clipping active: max_grad_norm below the first step's norm (checked below)
    cfg = AdamConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=0.05)
    peer = net.peer(jax_peer, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
                    max_grad_norm=cfg.max_grad_norm, clip_eps=cfg.clip_eps, target_tau=target_cfg.tau,
                    target_period=target_cfg.period)
    p, tgt = _flat(net.values, names), _flat(net.target, names)
    m, v, step = np.zeros_like(p), np.zeros_like(p), 0
    last_copy = _flat(net.target, names)
    for _ in range(3):
        # the optimizer's input: the peer's gradients at its current parameters (checked against
        # float64 above); Adam's m/sqrt(v) would magnify a float32-vs-float64 difference on a
        # near-zero gradient, so both sides start from the same gradients
        _, _, grads = peer.loss_and_grads(batch)
        p, m, v, step, stats = adam_ref(p, _flat(grads, names), m, v, decay_mask, step, cfg.lr, cfg)
        tgt = target_update_ref(tgt, p, step, target_cfg)
        out = peer.train_step(batch)
        assert stats[STAT_CLIP_SCALE] < 1.0  # the clip is exercised
        assert float(out["grad_norm"]) == pytest.approx(stats[STAT_GRAD_NORM], rel=1e-5)
        assert float(out["clip_scale"]) == pytest.approx(stats[STAT_CLIP_SCALE], rel=1e-5)
        assert int(peer.state["step"]) == step
        got_p, got_t = _flat(peer.to_numbarl("params"), names), _flat(peer.to_numbarl("target"), names)
        # an Adam step moves each parameter by ≈ lr: compare to 1e-4 of that
        np.testing.assert_allclose(got_p, p, rtol=1e-6, atol=1e-4 * cfg.lr, err_msg=f"params after step {step}")
        np.testing.assert_allclose(got_t, tgt, rtol=1e-6, atol=1e-4 * cfg.lr, err_msg=f"target after step {step}")
        np.testing.assert_allclose(_flat(peer.to_numbarl("m"), names), m, rtol=1e-5, atol=1e-9)
        np.testing.assert_allclose(_flat(peer.to_numbarl("v"), names), v, rtol=1e-5, atol=1e-12)
        if target_cfg.tau == 1.0:  # periodic, every 2nd step: an exact copy, untouched in between
            copied = step % target_cfg.period == 0
            np.testing.assert_array_equal(got_t, got_p if copied else last_copy)
            last_copy = got_p if copied else last_copy

    # a non-finite loss skips the whole update (numbarl.rl.optim, skip_nonfinite)
    before = {w: peer.to_numbarl(w) for w in ("params", "target", "m", "v")}
    bad = dict(batch, rewards=batch["rewards"].at[0].set(np.nan))
    out = peer.train_step(bad)
    assert not np.isfinite(float(out["grad_norm"])) and float(out["clip_scale"]) == 0.0
    assert int(peer.state["step"]) == step
    for w, values in before.items():
        for n in names:
            np.testing.assert_array_equal(peer.to_numbarl(w)[n], values[n], err_msg=f"{w} {n} changed")


# ---------------------------------------------------------------------------------------------
# (c) the acting step
# ---------------------------------------------------------------------------------------------
def test_act_and_outputs_match_numpy_forward(rng):
    jax_peer = _jax_peer()
    net = Net(rng)
    peer = net.peer(jax_peer)
    n_obs = 203
    obs = rng.standard_normal((n_obs, STATE_DIM)).astype(np.float32)
    ref, _ = net.forward_ref(obs, net.values)
    logits, probs, q = peer.outputs(obs)
    _rel_close(logits, ref.logits, rel=1e-5, what="logits")  # -inf padding included
    _rel_close(probs, ref.probs, rel=1e-5, what="probs")
    _rel_close(q, ref.q, rel=1e-5, what="q")
    sep = _separated(ref.q)
    assert sep.mean() > 0.9

    greedy = np.asarray(peer.act(obs))
    assert greedy.shape == (n_obs, len(SIZES)) and greedy.dtype == np.int32
    expected = np.stack([np.argmax(ref.q[:, k, :n], axis=1) for k, n in enumerate(SIZES)], axis=1)
    np.testing.assert_array_equal(greedy[sep], expected[sep])

    # with the env's mask: only available actions; a branch with none available gives action 0
    mask = (rng.random((n_obs, len(SIZES), max(SIZES))) < 0.6).astype(np.int32)
    mask[:5, 1] = 0
    for k, n in enumerate(SIZES):
        mask[:, k, n:] = 0  # padding: never available
    masked = np.asarray(peer.act(obs, mask))
    q_masked = np.where(mask != 0, ref.q, -np.inf)
    expected = np.stack([np.argmax(q_masked[:, k, :n], axis=1) for k, n in enumerate(SIZES)], axis=1)
    sep = _separated(q_masked)  # rows with no or one available action count as decided
    assert sep.mean() > 0.8
    np.testing.assert_array_equal(masked[sep], expected[sep])
    assert np.all(masked[:5, 1] == 0)
    available = mask[np.arange(n_obs)[:, None], np.arange(len(SIZES))[None, :], masked]
    assert np.all(available | (mask.sum(axis=2) == 0))
