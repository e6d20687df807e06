"""Dueling branched C51 head: references (hand case, finite differences through head + loss) and
kernels / the whole layer under the simulator on odd shapes (B=5, H=7, branches (3, 2, 4), 11 atoms)."""

import numpy as np
import pytest

from numbarl.cuda.runtime import Arena, cuda, stream
from numbarl.cuda.testing import to_device, to_host
from numbarl.rl.losses import c51
from numbarl.rl.nets import c51_head
from numbarl.rl.nets.base import ParamStore
from numbarl.rl.nets.c51_head import BranchedDuelingC51Head

_cuda = cuda()

BATCH, HIDDEN = 5, 7
SIZES = (3, 2, 4)
N_ATOMS = 11
V_MIN, V_MAX = -2.0, 3.0


def _dev(x):
    return to_device(x, stream())


def _host(x):
    return to_host(x, stream())


def _close(actual, expected, atol=2e-5, rtol=2e-4, what=""):
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    same_inf = np.isinf(expected) & (actual == expected)
    with np.errstate(invalid="ignore"):  # inf - inf where both are the same infinity
        err = np.where(same_inf, 0.0, np.abs(actual - expected))
    bound = atol + rtol * np.where(np.isinf(expected), 0.0, np.abs(expected))
    assert np.all(err <= bound), f"{what}: max excess {np.nanmax(err - bound):.3g}"


def _params(rng, hidden=HIDDEN, sizes=SIZES, n_atoms=N_ATOMS):
    total = sum(sizes) * n_atoms
    return {
        "w_value": rng.standard_normal((hidden, n_atoms)) * 0.5,
        "b_value": rng.standard_normal(n_atoms) * 0.3,
        "w_adv": rng.standard_normal((hidden, total)) * 0.5,
        "b_adv": rng.standard_normal(total) * 0.3,
    }


def _layout(sizes, n_atoms, v_min=V_MIN, v_max=V_MAX):
    return BranchedDuelingC51Head("layout_only", 4, sizes, n_atoms, v_min, v_max).layout


# ---------------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------------
def test_dueling_combine_hand_computed():
    """V = [1, 2]; branch 0 (2 actions) A = [[1, 3], [3, 5]] (mean [2, 4]); branch 1 (1 action)."""
    value = np.array([[1.0, 2.0]])
    adv = np.array([[1.0, 3.0, 3.0, 5.0, 7.0, -7.0]])  # [branch 0 a0 z0..z1, a1, branch 1 a0]
    logits = c51_head.dueling_combine_ref(value, adv, (2, 1))
    np.testing.assert_allclose(logits[0, 0], [[0.0, 1.0], [2.0, 3.0]])  # V + A - mean_a A
    np.testing.assert_allclose(logits[0, 1, 0], [1.0, 2.0])  # one action: the advantage cancels
    assert np.all(logits[0, 1, 1] == -np.inf)  # padding
    probs, q = c51_head.distribution_ref(logits, np.array([-1.0, 1.0]), (2, 1))
    e = np.exp(1.0)
    np.testing.assert_allclose(probs[0, 0, 0], [1 / (1 + e), e / (1 + e)])
    np.testing.assert_allclose(q[0, 0, 0], (e - 1) / (e + 1))
    assert np.all(probs[0, 1, 1] == 0.0) and q[0, 1, 1] == -np.inf


def test_head_and_loss_reference_backward_finite_differences(rng):
    """The hand-written head backward (from the loss's d_logits) against central differences of
    loss(head(h, params)) in float64, for every parameter and for h."""
    params = _params(rng)
    h = rng.standard_normal((BATCH, HIDDEN))
    support = c51.make_support(N_ATOMS, V_MIN, V_MAX)
    actions = np.stack([rng.integers(0, n, BATCH) for n in SIZES], axis=1)
    target = rng.random((BATCH, len(SIZES), N_ATOMS))
    target /= target.sum(-1, keepdims=True)  # fixed projected targets (no gradient into them)
    weights = rng.uniform(0.5, 1.5, BATCH)

    def loss_of(h_, p):
        logits, _, _ = c51_head.head_forward_ref(h_, p["w_value"], p["b_value"], p["w_adv"], p["b_adv"], SIZES, support)
        return c51.cross_entropy_loss_ref(logits, actions, target, weights)

    _, _, d_logits = loss_of(h, params)
    grads = c51_head.head_backward_ref(h, params["w_value"], params["w_adv"], d_logits, SIZES)
    eps = 1e-6
    wrt = {"dh": ("h", h)} | {"d" + k: (k, v) for k, v in params.items()}  # "dw_value": ("w_value", ...)
    for grad_name, (key, value) in wrt.items():
        fd = np.zeros(value.shape)
        for idx in np.ndindex(value.shape):
            for sign in (1.0, -1.0):
                x = value.copy()
                x[idx] += sign * eps
                if key == "h":
                    loss = loss_of(x, params)[0]
                else:
                    loss = loss_of(h, params | {key: x})[0]
                fd[idx] += sign * loss / (2 * eps)
        np.testing.assert_allclose(grads[grad_name], fd, atol=1e-8, rtol=1e-5, err_msg=grad_name)
        assert np.any(grads[grad_name] != 0.0), grad_name


# ---------------------------------------------------------------------------------------------
# kernels vs references
# ---------------------------------------------------------------------------------------------
def test_dueling_forward_kernel_matches_reference(rng):
    layout = _layout(SIZES, N_ATOMS)
    support = c51.make_support(N_ATOMS, V_MIN, V_MAX)
    value = (rng.standard_normal((BATCH, N_ATOMS)) * 2).astype(np.float32)
    adv = (rng.standard_normal((BATCH, sum(SIZES) * N_ATOMS)) * 2).astype(np.float32)
    adv[0, :N_ATOMS] = 40.0  # a large shared advantage: the dueling mean removes it, no overflow
    shape = (BATCH, len(SIZES), max(SIZES), N_ATOMS)
    logits, probs = _cuda.device_array(shape, np.float32), _cuda.device_array(shape, np.float32)
    q, lse = _cuda.device_array(shape[:3], np.float32), _cuda.device_array(shape[:3], np.float32)
    c51_head.dueling_forward(_dev(value), _dev(adv), layout, stream(), logits=logits, lse=lse, q=q, probs=probs)
    ref_logits = c51_head.dueling_combine_ref(value, adv, SIZES)
    ref_probs, ref_q = c51_head.distribution_ref(ref_logits, support, SIZES)
    got_logits, got_probs, got_q = _host(logits), _host(probs), _host(q)
    _close(got_logits, ref_logits, what="logits")
    _close(got_probs, ref_probs, atol=1e-6, what="probs")
    _close(got_q, ref_q, what="q")
    assert not np.any(np.isnan(got_logits)) and not np.any(np.isnan(got_probs)) and not np.any(np.isnan(got_q))
    for k, n in enumerate(SIZES):
        np.testing.assert_allclose(got_probs[:, k, :n].sum(-1), 1.0, atol=1e-5)
        assert np.all(got_q[:, k, n:] == -np.inf) and np.all(got_probs[:, k, n:] == 0.0)


def test_dueling_backward_kernel_matches_reference(rng):
    layout = _layout(SIZES, N_ATOMS)
    d_logits = rng.standard_normal((BATCH, len(SIZES), max(SIZES), N_ATOMS)).astype(np.float32)
    for k, n in enumerate(SIZES):
        d_logits[:, k, n:] = 1e30  # padding must be ignored, whatever it holds
    d_value = _cuda.device_array((BATCH, N_ATOMS), np.float32)
    d_adv = _cuda.device_array((BATCH, sum(SIZES) * N_ATOMS), np.float32)
    c51_head.dueling_backward(_dev(d_logits), layout, d_value, d_adv, stream())
    ref_dv, ref_da = c51_head.dueling_backward_ref(d_logits, SIZES)
    _close(_host(d_value), ref_dv, what="d_value")
    _close(_host(d_adv), ref_da, what="d_adv")


def _build(rng, batch=BATCH, tags=("online",)):
    head = BranchedDuelingC51Head("head", HIDDEN, SIZES, N_ATOMS, V_MIN, V_MAX)
    store = ParamStore()
    head.declare_params(store)
    store.allocate()
    values = store.init(rng)
    acts = Arena("acts")
    for tag in tags:
        head.declare_acts(acts, batch, tag, backward=(tag == "online"))
    acts.allocate()
    return head, store, values


def _named(values, head):
    return {k: values[v].astype(np.float64) for k, v in head.param_names.items()}


def test_layer_forward_backward_matches_reference(rng):
    head, store, values = _build(rng)
    p = _named(values, head)
    h = rng.standard_normal((BATCH, HIDDEN)).astype(np.float32)
    out = head.forward(_dev(h), stream(), tag="online")
    ref_logits, ref_probs, ref_q = c51_head.head_forward_ref(h, p["w_value"], p["b_value"], p["w_adv"], p["b_adv"],
                                                            SIZES, head.support_host)
    _close(_host(out.logits), ref_logits, what="logits")
    _close(_host(out.probs), ref_probs, atol=1e-6, what="probs")
    _close(_host(out.q), ref_q, what="q")

    d_logits = rng.standard_normal(ref_logits.shape).astype(np.float32)
    for k, n in enumerate(SIZES):
        d_logits[:, k, n:] = 0.0
    store.arenas["grads"].load({name: np.full(s.shape, 7.0, np.float32) for name, s in store.specs.items()})
    dh = head.backward(_dev(d_logits), stream(), tag="online")
    ref = c51_head.head_backward_ref(h, p["w_value"], p["w_adv"], d_logits, SIZES)
    grads = store.to_host("grads")  # the stale 7.0s must be overwritten
    n = head.param_names
    _close(_host(dh), ref["dh"], atol=1e-4, what="dh")
    _close(grads[n["w_value"]], ref["dw_value"], atol=1e-4, what="dw_value")
    _close(grads[n["b_value"]], ref["db_value"], atol=1e-4, what="db_value")
    _close(grads[n["w_adv"]], ref["dw_adv"], atol=1e-4, what="dw_adv")
    _close(grads[n["b_adv"]], ref["db_adv"], atol=1e-4, what="db_adv")


def test_layer_outputs_per_pass(rng):
    """Each pass computes exactly the outputs it declared (one launch), each equal to the reference;
    B = 9 leaves a partial block."""
    head = BranchedDuelingC51Head("head", HIDDEN, SIZES, N_ATOMS, V_MIN, V_MAX)
    store = ParamStore()
    head.declare_params(store)
    store.allocate()
    p = _named(store.init(rng), head)
    acts = Arena("acts")
    batch = 9
    declared = {"next": ("q",), "online": ("logits",), "target": ("probs",), "both": ("logits", "q")}
    for tag, outputs in declared.items():
        head.declare_acts(acts, batch, tag, backward=(tag == "online"), outputs=outputs)
    acts.allocate()
    h = rng.standard_normal((batch, HIDDEN)).astype(np.float32)
    ref_logits, ref_probs, ref_q = c51_head.head_forward_ref(h, p["w_value"], p["b_value"], p["w_adv"], p["b_adv"],
                                                            SIZES, head.support_host)
    refs = {"logits": ref_logits, "probs": ref_probs, "q": ref_q}
    for tag, outputs in declared.items():
        out = head.forward(_dev(h), stream(), tag=tag)
        for what in ("logits", "probs", "q"):
            got = getattr(out, what)
            if what not in outputs:
                assert got is None, (tag, what)
            else:
                _close(_host(got), refs[what], atol=1e-6 if what == "probs" else 2e-5, what=f"{tag} {what}")
    with pytest.raises(ValueError, match="non-empty subset"):
        head.declare_acts(Arena("more"), BATCH, "bad", outputs=("value",))
    with pytest.raises(ValueError, match="non-empty subset"):
        head.declare_acts(Arena("more"), BATCH, "bad", outputs=())


def test_layer_tags_and_roles_are_independent(rng):
    """The target pass reads the target arena and its own buffers; the online outputs stay put."""
    head, store, values = _build(rng, tags=("online", "target"))
    target_values = {k: (v + rng.standard_normal(v.shape).astype(np.float32)) for k, v in values.items()}
    store.load(target_values, role="target")
    h = rng.standard_normal((BATCH, HIDDEN)).astype(np.float32)
    h_next = rng.standard_normal((BATCH, HIDDEN)).astype(np.float32)
    online = head.forward(_dev(h), stream(), tag="online")
    target = head.forward(_dev(h_next), stream(), tag="target", role="target")
    p_online, p_target = _named(values, head), _named(target_values, head)
    _, _, q_online = c51_head.head_forward_ref(h, *(p_online[k] for k in ("w_value", "b_value", "w_adv", "b_adv")),
                                               SIZES, head.support_host)
    _, probs_target, _ = c51_head.head_forward_ref(h_next, *(p_target[k] for k in ("w_value", "b_value", "w_adv",
                                                                                   "b_adv")), SIZES, head.support_host)
    _close(_host(online.q), q_online, what="online q")
    _close(_host(target.probs), probs_target, atol=1e-6, what="target probs")
    with pytest.raises(RuntimeError, match="backward=False"):
        head.backward(_dev(np.zeros(online.logits.shape, np.float32)), stream(), tag="target")


def test_head_rejects_bad_configuration():
    with pytest.raises(ValueError, match="branch_sizes"):
        BranchedDuelingC51Head("head", HIDDEN, (3, 0), N_ATOMS, V_MIN, V_MAX)
    with pytest.raises(ValueError, match="v_min"):
        BranchedDuelingC51Head("head", HIDDEN, SIZES, N_ATOMS, 1.0, -1.0)
    head = BranchedDuelingC51Head("head", HIDDEN, SIZES, N_ATOMS, V_MIN, V_MAX)
    with pytest.raises(KeyError, match="declare_acts"):
        head.forward(_dev(np.zeros((BATCH, HIDDEN), np.float32)), stream(), tag="next")


def test_forward_launch_shape_gives_the_same_bits(rng):
    """The kernel reads its shape from blockDim and `samples`: any block / samples per block (here
    lanes 1-2, thread rows 1-3, 1-4 samples, partial last blocks) gives bit-identical outputs."""
    layout = _layout(SIZES, N_ATOMS)
    batch = 7
    value = _dev((rng.standard_normal((batch, N_ATOMS)) * 2).astype(np.float32))
    adv = _dev((rng.standard_normal((batch, sum(SIZES) * N_ATOMS)) * 2).astype(np.float32))
    shape = (batch, len(SIZES), max(SIZES), N_ATOMS)
    results = []
    for block, samples in (((1, 4), 4), ((1, 1), 1), ((2, 3), 3), ((1, 2), 2)):
        logits, probs = _cuda.device_array(shape, np.float32), _cuda.device_array(shape, np.float32)
        q, lse = _cuda.device_array(shape[:3], np.float32), _cuda.device_array(shape[:3], np.float32)
        c51_head.dueling_forward(value, adv, layout, stream(), logits=logits, lse=lse, q=q, probs=probs,
                                 block=block, samples=samples)
        results.append([_host(x) for x in (logits, probs, q, lse)])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def test_q_kernel_matches_head_kernel_bitwise(rng):
    """The Q-only pass: `dueling_q_kernel` writes the same lse and q bits as `dueling_head_kernel`
    (q_kernel="head") for any launch shape, and both match the float64 reference. Odd shapes: a
    5-action branch, a 1-action branch, 7 atoms (the four-atom unroll has a remainder), B = 5 (a
    partial last block; the guarded end of the eight-load span crosses from A into V), large
    magnitudes (a shared advantage of 1e3, logits spread over ±300) next to small ones (where every
    atom's term changes the sums' rounding, so an order change shows)."""
    sizes, n_atoms, batch = (3, 5, 1), 7, 5
    layout = _layout(sizes, n_atoms)
    support = c51.make_support(n_atoms, V_MIN, V_MAX)
    scale = np.array([[0.3], [30.0], [1.0], [120.0], [3.0]])  # per sample: every atom counts ... one dominates
    value = (rng.standard_normal((batch, n_atoms)) * scale).astype(np.float32)
    adv = (rng.standard_normal((batch, sum(sizes) * n_atoms)) * scale).astype(np.float32)
    adv[1, :3 * n_atoms] += np.float32(1e3)  # removed by the dueling mean (in float32, not exactly)
    value_d, adv_d = _dev(value), _dev(adv)
    shape = (batch, len(sizes), max(sizes))
    runs = {}
    for name, kw in (("head", {"q_kernel": "head"}), ("q", {}), ("q 2x3x3", {"block": (2, 3), "samples": 3}),
                     ("q 3x1x1", {"block": (3, 1), "samples": 1})):
        lse, q = _cuda.device_array(shape, np.float32), _cuda.device_array(shape, np.float32)
        c51_head.dueling_forward(value_d, adv_d, layout, stream(), lse=lse, q=q, **kw)
        runs[name] = (_host(lse), _host(q))
    for name, (lse, q) in runs.items():
        assert np.array_equal(lse, runs["head"][0]), name
        assert np.array_equal(q, runs["head"][1]), name
    ref_logits = c51_head.dueling_combine_ref(value, adv, sizes)
    _, ref_q = c51_head.distribution_ref(ref_logits, support, sizes)
    with np.errstate(invalid="ignore"):
        ref_lse = ref_logits.max(-1) + np.log(np.exp(ref_logits - ref_logits.max(-1, keepdims=True)).sum(-1))
    lse, q = runs["q"]
    _close(q, ref_q, what="q")
    _close(lse, np.where(np.isfinite(ref_lse), ref_lse, -np.inf), atol=1e-4, what="lse")
    for k, n in enumerate(sizes):
        assert np.all(q[:, k, n:] == -np.inf) and np.all(lse[:, k, n:] == -np.inf)
    assert np.all(np.isfinite(q[:, 0, :3])) and not np.any(np.isnan(lse))
    with pytest.raises(ValueError, match="q_kernel"):
        c51_head.dueling_forward(value_d, adv_d, layout, stream(), lse=lse, q=q, q_kernel="staged")


def test_forward_and_backward_with_long_branches_and_atom_tails(rng):
    """Branches longer than the four-action chunks (6 and 9 actions: the Σ_a loops take two and
    three chunks) and atom counts with and without a remainder of the four-atom unroll (8, 9):
    every output against the float64 reference, and each single-output pass bit-identical to the
    all-outputs pass."""
    batch = 3
    for sizes, n_atoms in (((6, 1, 9), 8), ((2, 6), 9)):
        layout = _layout(sizes, n_atoms)
        support = c51.make_support(n_atoms, V_MIN, V_MAX)
        value = (rng.standard_normal((batch, n_atoms)) * 2).astype(np.float32)
        adv = (rng.standard_normal((batch, sum(sizes) * n_atoms)) * 2).astype(np.float32)
        value_d, adv_d = _dev(value), _dev(adv)
        shape = (batch, len(sizes), max(sizes), n_atoms)
        runs = {}
        for outs in (("logits", "lse", "q", "probs"), ("logits",), ("probs",), ("lse", "q")):
            arrs = {k: _cuda.device_array(shape if k in ("logits", "probs") else shape[:3], np.float32) for k in outs}
            c51_head.dueling_forward(value_d, adv_d, layout, stream(), q_kernel="head", **arrs)
            runs[outs] = {k: _host(v) for k, v in arrs.items()}
        full = runs[("logits", "lse", "q", "probs")]
        for outs, got in runs.items():
            for k, v in got.items():
                assert np.array_equal(v, full[k]), (sizes, outs, k)
        ref_logits = c51_head.dueling_combine_ref(value, adv, sizes)
        ref_probs, ref_q = c51_head.distribution_ref(ref_logits, support, sizes)
        _close(full["logits"], ref_logits, what=f"logits {sizes}")
        _close(full["probs"], ref_probs, atol=1e-6, what=f"probs {sizes}")
        _close(full["q"], ref_q, what=f"q {sizes}")
        d_logits = rng.standard_normal(shape).astype(np.float32)
        d_value = _cuda.device_array((batch, n_atoms), np.float32)
        d_adv = _cuda.device_array((batch, sum(sizes) * n_atoms), np.float32)
        c51_head.dueling_backward(_dev(d_logits), layout, d_value, d_adv, stream())
        ref_dv, ref_da = c51_head.dueling_backward_ref(d_logits, sizes)
        _close(_host(d_value), ref_dv, what=f"d_value {sizes}")
        _close(_host(d_adv), ref_da, what=f"d_adv {sizes}")


def _head_run(rng_seed, pad_to, fuse_value=False):
    """One padded or unpadded head: the three passes of a train step, then two backwards in one ledger step
    (the second accumulates: its bias gradient is the column sum of a strided view of the padded d_adv)."""
    rng = np.random.default_rng(rng_seed)
    head = BranchedDuelingC51Head("head", HIDDEN, SIZES, N_ATOMS, V_MIN, V_MAX, pad_to=pad_to, fuse_value=fuse_value)
    store = ParamStore()
    head.declare_params(store)
    store.allocate()
    store.init(rng)
    store.load({k: v + np.float32(0.1) for k, v in store.to_host("params").items()}, role="target")
    acts = Arena("acts")
    for tag, outputs in (("online", ("logits", "q")), ("next", ("q",)), ("target", ("probs",))):
        head.declare_acts(acts, BATCH, tag, backward=(tag == "online"), outputs=outputs)
    acts.allocate()
    h = _dev(rng.standard_normal((BATCH, HIDDEN)).astype(np.float32))
    d_logits = rng.standard_normal((BATCH, len(SIZES), max(SIZES), N_ATOMS)).astype(np.float32)
    for k, n in enumerate(SIZES):
        d_logits[:, k, n:] = 0.0
    online = head.forward(h, stream(), tag="online")
    nxt = head.forward(h, stream(), tag="next")
    target = head.forward(h, stream(), tag="target", role="target")
    store.begin_step()
    dh1 = _host(head.backward(_dev(d_logits), stream(), tag="online"))
    dh2 = _host(head.backward(_dev(2.0 * d_logits), stream(), tag="online"))
    store.end_step()
    out = {"logits": _host(online.logits), "q": _host(online.q), "next_q": _host(nxt.q),
           "target_probs": _host(target.probs), "dh1": dh1, "dh2": dh2}
    out.update({f"grad:{k}": v for k, v in store.to_host("grads").items()})
    bufs = dict(zip(("value", "adv"), map(_host, head.pass_views("online"))))
    bufs.update(zip(("d_value", "d_adv"), map(_host, head.pass_views("online", grads=True))))
    for tag in ("online", "target"):
        for what in ("w_adv_pad", "b_adv_pad"):
            name = head._buf_name(tag, what)
            if name in acts:
                bufs[f"{tag}.{what}"] = _host(acts[name])
    return head, out, bufs


def test_padded_head_gives_the_unpadded_bits(rng):
    """agent.head_pad: the advantage GEMMs at ΣA·Z = 99 columns rounded up to 104 give the same logits, Q,
    probabilities, input gradients and parameter gradients bit for bit (the pad columns of the weight copy and
    of d_adv are zeros: exact zero terms), the parameters keep their shape, and the pad columns stay zero. The
    same with the value stream fused into the advantage's GEMM (agent.head_fuse_value: 99 + 11 -> 112), whose V
    and dV are views of the fused buffers, except dh (one input-gradient GEMM instead of two: one rounding)."""
    seed = int(rng.integers(2**31))
    plain, ref, _ = _head_run(seed, 1)
    head, got, bufs = _head_run(seed, 8)
    assert (plain.padded_width, head.width, head.padded_width) == (99, 99, 104)
    assert [s.shape for s in head.params()] == [s.shape for s in plain.params()]
    assert set(got) == set(ref)
    for k in ref:
        assert np.array_equal(got[k], ref[k], equal_nan=True), k
    for name, arr in bufs.items():
        if name not in ("value", "d_value"):
            pad = arr[..., 99:]
            assert pad.shape[-1] == 5 and np.all(pad == 0.0), name
    assert np.any(bufs["online.w_adv_pad"][:, :99] != bufs["target.w_adv_pad"][:, :99])  # each pass its role's
    # the value stream in the advantage's GEMM (agent.head_fuse_value): 99 + 11 -> 112 columns, the same bits
    plain_bufs = _head_run(seed, 1)[2]
    fused, got, bufs = _head_run(seed, 8, fuse_value=True)
    assert (fused.value_col, fused.padded_width) == (99, 112) and not fused.plain
    for k in ref:  # dh: one GEMM of [dA | dV] rounds once where the unfused head's two GEMMs round twice
        if k.startswith("dh"):
            _close(got[k], ref[k], atol=1e-6, rtol=1e-6, what=f"fused {k}")
        else:
            assert np.array_equal(got[k], ref[k], equal_nan=True), f"fused {k}"
    for what in ("value", "d_value", "adv", "d_adv"):
        assert np.array_equal(bufs[what][:, :plain_bufs[what].shape[1]], plain_bufs[what]), what
    assert np.all(bufs["adv"][:, 110:] == 0) and np.all(bufs["d_adv"][:, 110:] == 0)
    assert np.array_equal(bufs["online.w_adv_pad"][:, 99:110], _host(fused.store.arenas["params"]["head.value.w"]))
    with pytest.raises(ValueError, match="pad_to"):
        BranchedDuelingC51Head("head", HIDDEN, SIZES, N_ATOMS, V_MIN, V_MAX, pad_to=0)
    adv = _dev(np.zeros((BATCH, 104), np.float32))
    value = _dev(np.zeros((BATCH, N_ATOMS), np.float32))
    q = _cuda.device_array((BATCH, len(SIZES), max(SIZES)), np.float32)
    lse = _cuda.device_array((BATCH, len(SIZES), max(SIZES)), np.float32)
    with pytest.raises(ValueError, match="not a multiple of 11 atoms"):  # 104 columns without the logical width
        c51_head.dueling_forward(value, adv, head.layout, stream(), lse=lse, q=q)
    with pytest.raises(ValueError, match="exceeds adv's 104 columns"):
        c51_head.dueling_forward(value, adv, head.layout, stream(), lse=lse, q=q, width=110)


def test_agent_with_a_padded_head_trains_to_the_same_bits():
    """agent.head_pad through the agent (online, next-obs and target passes, the loss, the backward, AdamW): three
    train steps from the same replay give the same parameters, targets and gradients bit for bit as unpadded."""
    from agent_helpers import aux_steps, fill_replay, tiny_agent

    snaps = []
    for pad in (1, 4):
        agent = tiny_agent(6, (3, 2), 4, batch_size=6, head_pad=pad, head_fuse_value=False)
        assert agent.head.padded_width == (25 if pad == 1 else 28)
        fill_replay(agent, np.random.default_rng(3))
        aux_steps(agent, stream())
        snaps.append({f"{role}:{k}": v for role in ("params", "target", "grads")
                      for k, v in agent.store.to_host(role).items()})
    assert set(snaps[0]) == set(snaps[1])
    for k, v in snaps[0].items():
        assert v.tobytes() == snaps[1][k].tobytes(), k
    assert any(np.any(v != 0) for k, v in snaps[0].items() if k.startswith("grads:head.adv"))


def test_head_pad_default_pads_a_c51_head_in_both_precisions():
    """agent.head_pad=0 (the default) resolves to config.HEAD_PAD_TF32 under TF32 and to agent.head_pad_fp32 (64
    since the twenty-fifth session) in fp32, and to 1 for the agents without a C51 head; an explicit value is kept;
    a bad one is refused naming the field."""
    from numbarl.config import HEAD_PAD_TF32, AgentConfig

    assert AgentConfig().head_pad == 0 and AgentConfig().head_pad_multiple == AgentConfig().head_pad_fp32 == 64
    assert AgentConfig(head_pad_fp32=1).head_pad_multiple == 1 and not AgentConfig(head_pad_fp32=1).fuse_value
    assert AgentConfig(compute="tf32", head_pad_fp32=1).head_pad_multiple == HEAD_PAD_TF32 == 64
    assert AgentConfig(compute="tf32", head_pad=1).head_pad_multiple == 1
    assert AgentConfig(head_pad=8).head_pad_multiple == 8
    assert AgentConfig(kind="ppo").head_pad_multiple == 1 and AgentConfig(kind="dt", compute="tf32").head_pad_multiple == 1
    with pytest.raises(ValueError, match="head_pad"):
        AgentConfig(head_pad=-1).validate()
    with pytest.raises(ValueError, match="head_pad_fp32"):
        AgentConfig(head_pad_fp32=0).validate()


def test_agent_with_the_value_stream_fused_trains_as_unfused():
    """agent.head_fuse_value through the agent: three train steps give the unpadded agent's parameters and
    gradients to rounding (dh is one GEMM instead of two), the value head's gradients included; the config fuses
    a padded head only."""
    from agent_helpers import aux_steps, fill_replay, tiny_agent

    from numbarl.config import AgentConfig, ConfigError

    snaps = []
    for pad, fuse in ((1, False), (8, True)):
        agent = tiny_agent(6, (3, 2), 4, batch_size=6, head_pad=pad, head_fuse_value=fuse)
        assert agent.head.fused == fuse and agent.head.padded_width == (25 if pad == 1 else 32)
        fill_replay(agent, np.random.default_rng(3))
        aux_steps(agent, stream())
        snaps.append({f"{role}:{k}": v for role in ("params", "grads") for k, v in agent.store.to_host(role).items()})
    for k, v in snaps[0].items():
        _close(snaps[1][k], v, atol=1e-5, rtol=1e-4, what=k)
    assert np.any(snaps[1]["grads:head.value.w"] != 0) and np.any(snaps[1]["grads:head.adv.w"] != 0)
    # the default fuses where the head is padded (TF32's automatic 64), and an unpadded head keeps its value GEMM
    assert AgentConfig(compute="tf32").fuse_value and not AgentConfig(compute="tf32", head_fuse_value=False).fuse_value
    assert AgentConfig().fuse_value and not AgentConfig(head_pad=1).fuse_value
    assert not AgentConfig(compute="tf32", head_pad=1).fuse_value
    with pytest.raises(ConfigError, match="head_fuse_value = 'yes' must be true or false"):
        AgentConfig(head_fuse_value="yes").validate()
    # the agent passes what runs: the default (true) leaves an unpadded fp32 head and its extra heads unfused
    agent = tiny_agent(6, (3, 2), 4, batch_size=6, ensemble_heads=2, head_pad=1)
    assert [(h.padded_width, h.fused) for h in (agent.head, *agent.ens_heads)] == [(25, False), (25, False)]
    # the ensemble's extra heads are laid out as the agent's head
    agent = tiny_agent(6, (3, 2), 4, batch_size=6, head_pad=8, head_fuse_value=True, ensemble_heads=2)
    assert [(h.padded_width, h.fused) for h in (agent.head, *agent.ens_heads)] == [(32, True), (32, True)]


@pytest.mark.parametrize("pad_to, fuse_value", [(1, False), (8, False), (8, True)])
def test_taken_rows_backward_gives_the_dense_bits(rng, pad_to, fuse_value):
    """A TakenGrad (the gradient's rows at the taken actions, zero elsewhere) gives the dense d_logits' dV, dA, dh and
    parameter gradients bit for bit, plain, padded and fused, on the first write of a step and on an accumulating
    one; an action outside its branch is a zero row; bad shapes are refused naming the rows."""
    seed = int(rng.integers(2**31))
    actions = np.stack([rng.integers(0, n, BATCH) for n in SIZES], 1).astype(np.int32)
    actions[1, 1] = SIZES[1]  # outside branch 1: a zero row
    rows = rng.standard_normal((BATCH, len(SIZES), N_ATOMS)).astype(np.float32)
    rows[2, 0] = -0.0  # a signed zero as the whole taken row
    rows[1, 1] = 0.0
    dense = np.zeros((BATCH, len(SIZES), max(SIZES), N_ATOMS), np.float32)
    for k, n in enumerate(SIZES):
        ok = actions[:, k] < n
        dense[np.arange(BATCH)[ok], k, actions[ok, k]] = rows[ok, k]
    assert c51_head.taken_rows_dense_ref(rows, actions, SIZES).tobytes() == dense.tobytes()  # the agent's host view
    out = []
    for grad in (lambda: _dev(dense), lambda: c51_head.TakenGrad(_dev(rows), _dev(actions))):
        r = np.random.default_rng(seed)
        head = BranchedDuelingC51Head("head", HIDDEN, SIZES, N_ATOMS, V_MIN, V_MAX, pad_to=pad_to,
                                      fuse_value=fuse_value)
        store = ParamStore()
        head.declare_params(store)
        store.allocate()
        store.init(r)
        acts = Arena("acts")
        head.declare_acts(acts, BATCH, "online", backward=True, outputs=("logits",))
        acts.allocate()
        head.forward(_dev(r.standard_normal((BATCH, HIDDEN)).astype(np.float32)), stream(), tag="online")
        store.begin_step()
        dh1 = _host(head.backward(grad(), stream(), tag="online"))
        dh2 = _host(head.backward(grad(), stream(), tag="online"))  # the second write adds
        d_value, d_adv = head.pass_views("online", grads=True)
        out.append({"dh1": dh1, "dh2": dh2, "d_value": _host(d_value), "d_adv": _host(d_adv),
                    **store.to_host("grads")})
    for k in out[0]:
        assert out[0][k].tobytes() == out[1][k].tobytes(), k
    with pytest.raises(ValueError, match="taken rows have shape"):
        head.backward(c51_head.TakenGrad(_dev(rows[:, :2]), _dev(actions)), stream(), tag="online")
    with pytest.raises(ValueError, match="taken actions"):
        head.backward(c51_head.TakenGrad(_dev(rows), _dev(actions[:, :2])), stream(), tag="online")


def test_agent_writes_the_taken_rows_when_the_c51_loss_is_alone():
    """Through the agent: with the C51 loss alone at the logits the step runs the taken rows (TakenGrad), and three
    train steps give the dense path's parameters, targets and gradients bit for bit; a CQL term (which adds at
    every action) keeps the dense gradient."""
    from agent_helpers import aux_steps, fill_replay, tiny_agent

    snaps = []
    for taken in (True, False):
        agent = tiny_agent(6, (3, 2), 4, batch_size=6)
        assert agent._taken_grad()
        if not taken:
            agent._taken_grad = lambda: False
        fill_replay(agent, np.random.default_rng(3))
        aux_steps(agent, stream())
        snaps.append({f"{role}:{k}": v for role in ("params", "target", "grads")
                      for k, v in agent.store.to_host(role).items()})
    for k, v in snaps[0].items():
        assert v.tobytes() == snaps[1][k].tobytes(), k
    assert any(np.any(v != 0) for k, v in snaps[0].items() if k.startswith("grads:head.adv"))
    assert not tiny_agent(6, (3, 2), 4, batch_size=6, cql_alpha=0.1)._taken_grad()


@pytest.mark.parametrize("entropy", [False, True])
def test_loss_reading_the_heads_lse_gives_its_own_bits(rng, entropy):
    """The C51 loss given the head's row log-sum-exp ("lse", what the agent passes) instead of computing it again:
    loss, per-sample values, CE, lse, the taken rows (and the entropy terms) bit for bit, with an action outside
    its branch; the same input is refused at the wrong shape."""
    layout = _layout(SIZES, N_ATOMS)
    value = (rng.standard_normal((BATCH, N_ATOMS)) * 2).astype(np.float32)
    adv = (rng.standard_normal((BATCH, sum(SIZES) * N_ATOMS)) * 2).astype(np.float32)
    shape = (BATCH, len(SIZES), max(SIZES), N_ATOMS)
    logits, lse, q = (_cuda.device_array(shape, np.float32), _cuda.device_array(shape[:3], np.float32),
                      _cuda.device_array(shape[:3], np.float32))
    c51_head.dueling_forward(_dev(value), _dev(adv), layout, stream(), logits=logits, lse=lse, q=q)
    target_probs = rng.random(shape).astype(np.float32)
    target_probs /= target_probs.sum(axis=-1, keepdims=True)
    actions = np.stack([rng.integers(0, n, BATCH) for n in SIZES], 1).astype(np.int32)
    actions[2, 1] = SIZES[1]  # outside branch 1
    x = {"logits": logits, "actions": _dev(actions), "next_q": q, "target_probs": _dev(target_probs),
         "rewards": _dev(rng.uniform(-3, 3, BATCH).astype(np.float32)), "dones": _dev(np.zeros(BATCH, np.float32)),
         "discounts": _dev(np.full(BATCH, 0.9, np.float32))}
    losses = [c51.C51Loss(BATCH, SIZES, N_ATOMS, V_MIN, V_MAX, entropy_reg=entropy) for _ in range(2)]
    for loss, given in zip(losses, (None, lse)):
        if entropy:
            loss.set_entropy_beta(0.3)
        loss.apply({**x, "lse": given}, {"logits_taken": loss.d_taken}, stream())
    for name in ("loss", "per_sample", "ce", "lse", "d_taken", "target_dist") + (("entropy", "taken_probs")
                                                                                 if entropy else ()):
        assert _host(losses[0].arena[name]).tobytes() == _host(losses[1].arena[name]).tobytes(), name
    assert np.isnan(_host(losses[1].ce)[2, 1]) and not np.isfinite(_host(losses[1].loss)[0])
    with pytest.raises(ValueError, match="lse has shape"):
        losses[1].apply({**x, "lse": q[:, :2]}, {"logits_taken": losses[1].d_taken}, stream())


@pytest.mark.parametrize("fused", [False, True])
def test_select_writes_the_full_probs_rows_at_the_chosen_actions(rng, fused):
    """dueling_forward(select=...) writes probs [B, n_branches, Z] = the full pass's probs[b, k, select[b, k]] bit
    for bit (a zero row for an action outside its branch), separate V or V inside adv's rows; bad calls refused."""
    layout = _layout(SIZES, N_ATOMS)
    width = sum(SIZES) * N_ATOMS
    value = (rng.standard_normal((BATCH, N_ATOMS)) * 2).astype(np.float32)
    adv = (rng.standard_normal((BATCH, width + (N_ATOMS + 3 if fused else 0))) * 2).astype(np.float32)
    if fused:
        adv[:, width:width + N_ATOMS] = value
    kw = {"width": width, "value_col": width} if fused else {}
    v = None if fused else _dev(value)
    shape = (BATCH, len(SIZES), max(SIZES), N_ATOMS)
    full = _cuda.device_array(shape, np.float32)
    c51_head.dueling_forward(v, _dev(adv), layout, stream(), probs=full, **kw)
    select = np.stack([rng.integers(0, n, BATCH) for n in SIZES], 1).astype(np.int32)
    select[1, 2], select[3, 0] = SIZES[2], -1  # outside their branches
    rows = _cuda.device_array((BATCH, len(SIZES), N_ATOMS), np.float32)
    c51_head.dueling_forward(v, _dev(adv), layout, stream(), probs=rows, select=_dev(select), max_actions=max(SIZES),
                             **kw)
    got, want = _host(rows), _host(full)
    for b in range(BATCH):
        for k, n in enumerate(SIZES):
            expected = want[b, k, select[b, k]] if 0 <= select[b, k] < n else np.zeros(N_ATOMS, np.float32)
            assert got[b, k].tobytes() == expected.tobytes(), (b, k)
    with pytest.raises(ValueError, match="select writes probs alone"):
        c51_head.dueling_forward(v, _dev(adv), layout, stream(), probs=rows, select=_dev(select), **kw)
    with pytest.raises(ValueError, match="probs has shape"):
        c51_head.dueling_forward(v, _dev(adv), layout, stream(), probs=full, select=_dev(select), max_actions=4,
                                 **kw)


def test_copy_cols_does_two_copies_in_one_launch(rng):
    """copy_cols with then=: both copies land (weights and biases), every other column keeps its value; a copy that
    does not fit is refused naming the columns."""
    w1, b1 = rng.standard_normal((3, 5)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    w2, b2 = rng.standard_normal((3, 2)).astype(np.float32), rng.standard_normal(2).astype(np.float32)
    wd, bd = np.full((3, 9), 7.0, np.float32), np.full(9, 7.0, np.float32)
    wd_d, bd_d = _dev(wd), _dev(bd)
    c51_head.copy_cols(_dev(w1), _dev(b1), wd_d, bd_d, stream(), cols=4, src_col=1,
                       then=c51_head.ColCopy(_dev(w2), _dev(b2), wd_d, bd_d, dst_col=6))
    want_w, want_b = wd.copy(), bd.copy()
    want_w[:, :4], want_b[:4] = w1[:, 1:], b1[1:]
    want_w[:, 6:8], want_b[6:8] = w2, b2
    assert np.array_equal(_host(wd_d), want_w) and np.array_equal(_host(bd_d), want_b)
    with pytest.raises(ValueError, match="2 columns from 0 of 2 into 8 of 9 do not fit"):
        c51_head.copy_cols(_dev(w1), _dev(b1), wd_d, bd_d, stream(),
                           then=c51_head.ColCopy(_dev(w2), _dev(b2), wd_d, bd_d, dst_col=8, cols=2))
