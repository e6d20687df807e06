"""GPU tests of the C51 head and loss at real sizes, and the comparison with the PyTorch peer.

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_c51.py -m gpu -q`
(the peer tests need torch; they are skipped without it).

Default model of issue 4: 64 features, trunk 2×512 ReLU, 4 branches (3, 3, 4, 4), 51 atoms,
batch 16,384, fp32.
"""

import numpy as np
import pytest

from numbarl.cuda.runtime import Arena, cuda, stream
from numbarl.rl.losses import c51
from numbarl.rl.nets import c51_head
from numbarl.rl.nets.base import ParamStore
from numbarl.rl.nets.c51_head import BranchedDuelingC51Head
from numbarl.rl.nets.mlp import Mlp

pytestmark = pytest.mark.gpu

_cuda = cuda()

BATCH = 16384
STATE_DIM = 64
WIDTHS = (512, 512)
SIZES = (3, 3, 4, 4)
N_ATOMS = 51
V_MIN, V_MAX = -10.0, 10.0
GAMMA = 0.99


def _dev(x):
    return _cuda.to_device(np.ascontiguousarray(x), stream=stream())


def _host(x):
    out = x.copy_to_host(stream=stream())
    stream().synchronize()
    return out


def _rel_close(actual, expected, rel=1e-4, what=""):
    """Float32-vs-reference check: norm-relative error and a per-element bound scaled by the
    largest magnitude (sums over 16,384 samples in a different order differ at ~1e-6)."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} vs {e.shape}"
    fin = np.isfinite(e)
    same_nonfinite = np.array_equal(fin, np.isfinite(a)) and np.array_equal(a[~fin], e[~fin])
    assert same_nonfinite, f"{what}: non-finite entries differ"
    a, e = a[fin], e[fin]
    scale = max(np.max(np.abs(e)), 1e-30)
    norm_err = np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30)
    max_err = np.max(np.abs(a - e)) / scale
    assert norm_err < rel and max_err < 10 * rel, f"{what}: norm-relative error {norm_err:.3g}, max/scale {max_err:.3g}"


def _batch(rng, batch=BATCH):
    n_steps = rng.integers(1, 4, batch)  # n-step windows cut short by episode ends
    actions = np.stack([rng.integers(0, n, batch) for n in SIZES], axis=1).astype(np.int32)
    return {
        "obs": rng.standard_normal((batch, STATE_DIM)).astype(np.float32),
        "next_obs": rng.standard_normal((batch, STATE_DIM)).astype(np.float32),
        "actions": actions,
        "rewards": (rng.standard_normal(batch) * 3.0).astype(np.float32),  # some beyond the support
        "dones": (rng.random(batch) < 0.1).astype(np.float32),
        "discounts": (GAMMA ** n_steps).astype(np.float32),
        "weights": rng.uniform(0.5, 1.5, batch).astype(np.float32),
    }


def _layout(pad):
    """The learner's arguments of a parametrized pad: Q, "Qf" for Q with the value stream fused, "Qt" for Q in
    TF32 (the shipped TF32 default is "64ft", fused since the twenty-first session; "64t" unfused)."""
    return {"pad_to": int(str(pad).rstrip("ft")), "fuse_value": "f" in str(pad),
            "compute": "tf32" if str(pad).endswith("t") else "fp32"}


class Learner:
    """numbarl trunk + head + loss wired the way the agent does it (online / next / target tags)."""

    # what each pass needs in a train step (all outputs everywhere when full_outputs)
    OUTPUTS = {"online": ("logits",), "next": ("q",), "target": ("probs",)}

    def __init__(self, rng, batch=BATCH, trunk=True, full_outputs=False, pad_to=1, fuse_value=False, compute="fp32",
                 taken=False):
        self.taken = taken  # the loss's gradient as its taken rows (TakenGrad), as the agent runs it alone
        self.store = ParamStore()
        self.trunk = Mlp("trunk", STATE_DIM, WIDTHS, "relu", compute=compute) if trunk else None
        hidden = WIDTHS[-1] if trunk else STATE_DIM
        self.head = BranchedDuelingC51Head("head", hidden, SIZES, N_ATOMS, V_MIN, V_MAX, compute=compute,
                                           pad_to=pad_to, fuse_value=fuse_value)
        for layer in ([self.trunk] if trunk else []) + [self.head]:
            layer.declare_params(self.store)
        self.store.allocate()
        self.values = self.store.init(rng)
        target = {k: v + (0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in self.values.items()}
        self.store.load(target, role="target")
        self.target_values = target
        self.acts = Arena("acts")
        for tag in ("online", "next", "target"):
            if trunk:
                self.trunk.declare_acts(self.acts, batch, tag, backward=(tag == "online"))
            self.head.declare_acts(self.acts, batch, tag, backward=(tag == "online"),
                                   outputs=c51_head.OUTPUTS if full_outputs else self.OUTPUTS[tag])
        self.acts.allocate()
        self.loss = c51.C51Loss.for_head(self.head, batch)

    def upload(self, batch):
        self.batch = {k: _dev(v) for k, v in batch.items()}

    def step(self, s):
        """Forward x3, loss, backward: no allocation, copy or sync (capturable)."""
        b = self.batch

        def net(x, tag, role="params"):
            h = self.trunk.forward(x, s, tag=tag, role=role) if self.trunk is not None else x
            return self.head.forward(h, s, tag=tag, role=role)

        online = net(b["obs"], "online")
        nxt = net(b["next_obs"], "next")
        target = net(b["next_obs"], "target", role="target")
        self.loss(online.logits, b["actions"], nxt.q, target.probs, b["rewards"], b["dones"], b["discounts"], s,
                  weights=b["weights"], taken_grad=self.taken)
        grad = c51_head.TakenGrad(self.loss.d_taken, b["actions"]) if self.taken else self.loss.d_logits
        dh = self.head.backward(grad, s, tag="online")
        if self.trunk is not None:
            self.trunk.backward(dh, s, tag="online")


# ---------------------------------------------------------------------------------------------
# numbarl vs float64 references at the real size (each stage fed the same float32 inputs)
# ---------------------------------------------------------------------------------------------
def test_head_and_loss_match_reference_at_real_size(rng):
    learner = Learner(rng, trunk=False, full_outputs=True)  # the head reads obs directly: h = obs [B, 64]
    batch = _batch(rng)
    learner.upload(batch)
    learner.step(stream())
    head, n = learner.head, learner.head.param_names
    p = {k: learner.values[v].astype(np.float64) for k, v in n.items()}
    pt = {k: learner.target_values[v].astype(np.float64) for k, v in n.items()}
    online, nxt, target = head.outputs("online"), head.outputs("next"), head.outputs("target")

    ref = c51_head.head_forward_ref(batch["obs"], p["w_value"], p["b_value"], p["w_adv"], p["b_adv"], SIZES,
                                    head.support_host)
    for got, exp, what in zip(online, ref, ("logits", "probs", "q")):
        _rel_close(_host(got), exp, rel=2e-5, what=f"online {what}")
    ref_t = c51_head.head_forward_ref(batch["next_obs"], pt["w_value"], pt["b_value"], pt["w_adv"], pt["b_adv"],
                                      SIZES, head.support_host)
    _rel_close(_host(target.probs), ref_t[1], rel=2e-5, what="target probs")

    # the loss from numbarl's own float32 head outputs (same a* on both sides)
    logits_h, next_q_h, target_probs_h = _host(online.logits), _host(nxt.q), _host(target.probs)
    loss, per_sample, d_logits, _ = c51.c51_loss_ref(logits_h, batch["actions"], next_q_h, target_probs_h,
                                                     batch["rewards"], batch["dones"], batch["discounts"],
                                                     head.support_host, SIZES, batch["weights"])
    assert _host(learner.loss.loss)[0] == pytest.approx(loss, rel=1e-5)
    _rel_close(_host(learner.loss.per_sample), per_sample, rel=1e-5, what="per_sample")
    got_d = _host(learner.loss.d_logits)
    _rel_close(got_d, d_logits, rel=1e-5, what="d_logits")

    g = c51_head.head_backward_ref(batch["obs"], p["w_value"], p["w_adv"], got_d, SIZES)
    grads = learner.store.to_host("grads")
    _rel_close(grads[n["w_value"]], g["dw_value"], what="dw_value")
    _rel_close(grads[n["b_value"]], g["db_value"], what="db_value")
    _rel_close(grads[n["w_adv"]], g["dw_adv"], what="dw_adv")
    _rel_close(grads[n["b_adv"]], g["db_adv"], what="db_adv")
    _rel_close(_host(learner.acts[f"{head.name}.online.dh"]), g["dh"], what="dh")


def test_projection_kernel_at_real_size(rng):
    support = c51.make_support(N_ATOMS, V_MIN, V_MAX)
    batch = 4099
    x = rng.standard_normal((batch, N_ATOMS))
    p = (np.exp(x) / np.exp(x).sum(1, keepdims=True)).astype(np.float32)
    rewards = (rng.standard_normal(batch) * 6).astype(np.float32)
    dones = (rng.random(batch) < 0.2).astype(np.uint8)
    discounts = (GAMMA ** rng.integers(1, 6, batch)).astype(np.float32)
    out = _cuda.device_array((batch, N_ATOMS), np.float32)
    c51.project_distribution(_dev(rewards), _dev(dones), _dev(discounts), _dev(p), _dev(support), V_MIN, V_MAX,
                             out, stream())
    ref = c51.project_distribution_ref(rewards, dones, discounts, p, support)
    got = _host(out)
    assert np.max(np.abs(got - ref)) < 1e-5
    np.testing.assert_allclose(got.sum(1), 1.0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# graph == eager, determinism
# ---------------------------------------------------------------------------------------------
def _snapshot(learner):
    s = stream()
    s.synchronize()
    out = {"loss": _host(learner.loss.loss), "per_sample": _host(learner.loss.per_sample),
           "d_logits": _host(learner.loss.d_logits)}
    out.update({f"grad:{k}": v for k, v in learner.store.to_host("grads").items()})
    return out


def _assert_bitwise(a, b):
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), f"{k} differs"


# 4: the advantage GEMMs at 716 columns (agent.head_pad); "64f": the value stream in them, 768 (agent.head_fuse_value);
# "64t": padded, unfused, in TF32 (the twentieth session's TF32 default); "64ft": the TF32 default since the twenty-first
@pytest.mark.parametrize("pad", [1, 4, "64f", "64t", "64ft"])
def test_graph_replay_equals_eager_bitwise(rng, pad):
    from numbarl.cuda import graph as graphs

    learner = Learner(rng, **_layout(pad))
    learner.upload(_batch(rng))
    learner.step(stream())
    eager = _snapshot(learner)
    learner.store.arenas["grads"].load({k: np.zeros(s.shape, np.float32) for k, s in learner.store.specs.items()})
    g = graphs.capture(learner.step, stream=stream())
    g.replay(stream())
    _assert_bitwise(eager, _snapshot(learner))
    g.replay(stream())
    g.replay(stream())
    _assert_bitwise(eager, _snapshot(learner))
    assert np.isfinite(eager["loss"][0]) and all(np.all(np.isfinite(v)) for v in eager.values())


@pytest.mark.parametrize("pad", [1, 4, "64f", "64t", "64ft"])  # as test_graph_replay_equals_eager_bitwise
def test_two_runs_bitwise_identical(rng, pad):
    seed = int(rng.integers(2**31))
    snaps = []
    for _ in range(2):
        r = np.random.default_rng(seed)
        learner = Learner(r, **_layout(pad))
        learner.upload(_batch(r))
        learner.step(stream())
        snaps.append(_snapshot(learner))
    _assert_bitwise(*snaps)


@pytest.mark.parametrize("pad", [1, "64f", "64ft"])
def test_taken_rows_give_the_dense_gradient_bits(rng, pad):
    """The loss's taken rows and the head's TakenGrad backward (the agent's path when the C51 loss is alone at the
    logits) against the dense d_logits: every parameter gradient and the loss bit for bit at the real size."""
    seed = int(rng.integers(2**31))
    snaps = []
    for taken in (False, True):
        r = np.random.default_rng(seed)
        learner = Learner(r, taken=taken, **_layout(pad))
        learner.upload(_batch(r))
        learner.step(stream())
        snap = _snapshot(learner)
        snap.pop("d_logits")
        snaps.append(snap)
    _assert_bitwise(*snaps)


# ---------------------------------------------------------------------------------------------
# the PyTorch peer: same weights, same batch -> same loss and gradients
# ---------------------------------------------------------------------------------------------
def _peer(learner, **kw):
    from numbarl.rl.torch_peer import PeerSpec, TorchPeer

    spec = PeerSpec.from_numbarl(learner.trunk, learner.head, learner.store)
    return TorchPeer(spec, learner.values, learner.target_values, **kw)


@pytest.mark.parametrize("pad", [1, 4, "64f"])  # fp32 (the peer's tolerance), as above
def test_peer_loss_and_gradients_match_numbarl(rng, pad):
    torch = pytest.importorskip("torch")
    from numbarl.rl.torch_peer import batch_to_torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    learner = Learner(rng, **_layout(pad))
    batch = _batch(rng)
    learner.upload(batch)
    learner.step(stream())
    nb = _snapshot(learner)
    peer = _peer(learner)
    tb = batch_to_torch(batch)

    # forward outputs of the online net agree
    logits, probs, q = peer.outputs(tb["next_obs"])
    next_q = _host(learner.head.outputs("next").q)
    _rel_close(next_q, q, rel=1e-5, what="online q on next_obs")
    _rel_close(_host(learner.head.outputs("target").probs), peer.outputs(tb["next_obs"], target=True)[1], rel=1e-5,
               what="target probs")

    # a* from numbarl's Q (first maximum over the valid actions, as the kernel does): float32 near-ties
    # between the two implementations must not pick different target rows
    a_star = c51.double_dqn_actions_ref(next_q, SIZES)
    peer_a_star = np.stack([q[:, k, :n].argmax(1) for k, n in enumerate(SIZES)], axis=1)
    assert np.mean(a_star == peer_a_star) > 0.999
    loss, per_sample, grads = peer.loss_and_grads(tb, next_actions=torch.as_tensor(a_star, device="cuda"))

    assert nb["loss"][0] == pytest.approx(loss, rel=1e-5)
    _rel_close(nb["per_sample"], per_sample, rel=1e-5, what="per_sample")
    assert set(grads) == set(learner.store.specs)
    for name in learner.store.specs:
        _rel_close(nb[f"grad:{name}"], grads[name], rel=1e-4, what=f"grad {name}")


def test_peer_graphed_step_matches_eager_step(rng):
    """The peer's CUDA-graphed train step (the benchmark's baseline) updates like its eager step."""
    pytest.importorskip("torch")
    from numbarl.rl.torch_peer import batch_to_torch, time_train_step

    learner = Learner(rng, batch=1024)
    tb = batch_to_torch(_batch(rng, 1024))
    kw = dict(lr=1e-3, max_grad_norm=1.0, target_tau=0.01)
    # both capturable: the same AdamW arithmetic (the step count on the GPU), so the only difference
    # is eager launches vs one graph; Adam's m/sqrt(v) amplifies rounding where grads are ~0, so
    # two optimizer variants would not agree to a useful tolerance
    eager, graphed = _peer(learner, capturable=True, **kw), _peer(learner, capturable=True, **kw)
    for _ in range(6):
        eager.optimizer.zero_grad(set_to_none=True)
        eager.train_step(tb)
    # graphed: 3 warm-up steps on the side stream, a capture (runs nothing), then 3 replays = 6 steps
    timing = time_train_step(graphed, tb, mode="graphed", iters=3, warmup=0, repeats=1)
    assert timing["ms_median"] > 0
    for which in ("online", "target"):
        a = eager.to_numbarl(getattr(eager, which))
        b = graphed.to_numbarl(getattr(graphed, which))
        start = learner.values if which == "online" else learner.target_values
        assert set(a) == set(b) == set(start)
        for k in a:
            assert np.all(np.isfinite(b[k])), k
            assert np.any(a[k] != start[k]), f"{which} {k} did not move"
            # capturable AdamW differs from the default (foreach) one in rounding, and Adam's
            # normalised step turns a 1e-7 gradient difference on a near-zero moment into a
            # visible one: 1e-2 of the update still catches a wrong or missing step
            _rel_close(b[k] - start[k], a[k] - start[k], rel=1e-3, what=f"{which} update of {k}")


def test_head_lse_and_rows_at_a_star_give_the_full_bits_at_batch_size():
    """On the GPU at B = 16,384: the loss reading the head's row log-sum-exp ("lse") and the target probabilities at
    a* alone (C51Loss.double_dqn_actions, then dueling_forward(select=)) writes what the loss computing its own lse
    from the full target probabilities writes, bit for bit (loss, per-sample values, CE, lse, taken rows, target)."""
    rng = np.random.default_rng(27)
    head = BranchedDuelingC51Head("probe", 4, SIZES, N_ATOMS, V_MIN, V_MAX)
    layout, nb, na, width = head.layout, len(SIZES), max(SIZES), sum(SIZES) * N_ATOMS
    shape = (BATCH, nb, na, N_ATOMS)
    dev = {}
    for tag in ("online", "next", "target"):
        value = _dev((rng.standard_normal((BATCH, N_ATOMS)) * 2).astype(np.float32))
        adv = _dev((rng.standard_normal((BATCH, width)) * 2).astype(np.float32))
        out = {"logits": _cuda.device_array(shape, np.float32), "probs": _cuda.device_array(shape, np.float32),
               "lse": _cuda.device_array(shape[:3], np.float32), "q": _cuda.device_array(shape[:3], np.float32)}
        c51_head.dueling_forward(value, adv, layout, stream(), **out)
        dev[tag] = (value, adv, out)
    b = _batch(rng, BATCH)
    x = {"logits": dev["online"][2]["logits"], "actions": _dev(b["actions"]), "next_q": dev["next"][2]["q"],
         "target_probs": dev["target"][2]["probs"], "rewards": _dev(b["rewards"]), "dones": _dev(b["dones"]),
         "discounts": _dev(b["discounts"]), "weights": _dev(b["weights"])}
    full, at = (c51.C51Loss(BATCH, SIZES, N_ATOMS, V_MIN, V_MAX) for _ in range(2))
    full.apply(x, {"logits_taken": full.d_taken}, stream())
    a_star = at.double_dqn_actions(x["next_q"], stream())
    rows = _cuda.device_array((BATCH, nb, N_ATOMS), np.float32)
    value, adv, _ = dev["target"]
    c51_head.dueling_forward(value, adv, layout, stream(), probs=rows, select=a_star, max_actions=na)
    at.apply({**x, "target_probs": rows, "lse": dev["online"][2]["lse"]}, {"logits_taken": at.d_taken}, stream())
    for name in ("loss", "per_sample", "ce", "lse", "d_taken", "target_dist"):
        assert _host(full.arena[name]).tobytes() == _host(at.arena[name]).tobytes(), name
    want = c51.double_dqn_actions_ref(_host(x["next_q"]), SIZES)
    assert np.array_equal(_host(a_star), want)
