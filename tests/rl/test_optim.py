"""Flat AdamW, global-norm clipping and target updates: device (simulator) vs float64 references."""

import math

import numpy as np
import pytest

from numbarl.cuda.runtime import stream
from numbarl.rl.nets.base import ParamStore, kaiming_uniform_init
from numbarl.rl.optim import (
    N_STATS, STAT_CLIP_SCALE, STAT_CLIPPED, STAT_GRAD_NORM, STAT_LR, STAT_SKIPPED, STAT_STEP, STAT_TARGET_UPDATES,
    Adam, AdamConfig, TargetConfig, adam_ref, clip_scale_ref, target_update_ref,
)


def _store(rng) -> ParamStore:
    """Three tensors of odd shapes (views padded to 256-byte offsets); the bias is not decayed."""
    store = ParamStore()
    store.add("fc.w", (5, 13), group="trunk", decay=True, init=kaiming_uniform_init)
    store.add("fc.b", (13,), group="trunk", decay=False, init=kaiming_uniform_init)
    store.add("head.w", (7, 3), group="head", decay=True, init=kaiming_uniform_init)
    store.allocate()
    store.init(rng)
    return store


def _flat(store, role):
    s = stream()
    host = store.flat(role).copy_to_host(stream=s)
    s.synchronize()
    return host


def _set_grads(store, rng, scale=1.0):
    grads = {name: (scale * rng.standard_normal(spec.shape)).astype(np.float32) for name, spec in store.specs.items()}
    store.load(grads, role="grads")
    return _flat(store, "grads")


def _stats(opt):
    s = stream()
    host = opt.stats.copy_to_host(stream=s)
    s.synchronize()
    return host


def _close(actual, expected, rtol=2e-5, atol=1e-6, what=""):
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


# ---------------------------------------------------------------------------------------------
# references by hand
# ---------------------------------------------------------------------------------------------
def test_clip_scale_ref_hand_computed():
    assert clip_scale_ref([3.0, 4.0], 1.0, 0.0) == (5.0, 0.2)
    assert clip_scale_ref([3.0, 4.0], 10.0) == (5.0, 1.0)
    assert clip_scale_ref([3.0, 4.0], 0.0) == (5.0, 1.0)  # 0 disables clipping


def test_adam_ref_first_step_hand_computed():
    """t=1: m = 0.1 g, v = 0.001 g², m̂ = g, v̂ = g² → p −= lr · g / (|g| + eps); decay on p first."""
    cfg = AdamConfig(lr=0.1, eps=1e-8, weight_decay=0.5)
    p, m, v, t, _ = adam_ref([1.0, 2.0], [2.0, -0.5], [0, 0], [0, 0], [1.0, 0.0], 0, 0.1, cfg)
    assert t == 1
    _close(m, [0.2, -0.05]), _close(v, [0.004, 0.00025])
    _close(p, [1.0 * (1 - 0.1 * 0.5) - 0.1, 2.0 + 0.1], rtol=1e-7)


# ---------------------------------------------------------------------------------------------
# device vs reference
# ---------------------------------------------------------------------------------------------
def test_adam_several_steps_match_reference(rng):
    store = _store(rng)
    # beta2 = 0.999: float32(1) − float32(0.999) is 1.3e-5 off, so 1 − β must be rounded from float64
    cfg = AdamConfig(lr=3e-3, beta1=0.8, beta2=0.999, eps=1e-6, weight_decay=0.1, max_grad_norm=4.0)
    opt = Adam(store, cfg).allocate()
    p, m, v = _flat(store, "params").astype(np.float64), np.zeros(opt._n), np.zeros(opt._n)
    mask = store.decay_mask()
    mask = np.pad(mask, (0, opt._n - mask.size))
    step, clipped = 0, 0
    for k, scale in enumerate((0.1, 3.0, 0.5, 2.0, 0.05)):  # some steps clip (norm > 4), some don't
        g = _set_grads(store, rng, scale)
        lr = cfg.lr if k < 3 else 1e-3
        if k == 3:
            opt.set_lr(lr)  # a schedule writes the device scalar: the same launches pick it up
        opt.step(stream())
        p, m, v, step, ref_stats = adam_ref(p, g, m, v, mask, step, lr, cfg)
        _close(_flat(store, "params"), p, what=f"params step {k}")
        _close(_flat(store, "adam_m"), m, what=f"m step {k}")
        _close(_flat(store, "adam_v"), v, rtol=3e-6, atol=1e-12, what=f"v step {k}")
        _close(_stats(opt)[:STAT_CLIPPED], ref_stats[:STAT_CLIPPED], rtol=1e-5, what=f"stats step {k}")
        clipped += ref_stats[STAT_CLIPPED]
        assert _stats(opt)[STAT_CLIPPED] == clipped  # cumulative count of clipped steps
    assert 0 < clipped < 5
    assert opt.read_stats()["step"] == 5.0
    # padding between views stayed zero in every role
    used = store.mask(lambda s: True)
    used = np.pad(used, (0, opt._n - used.size))
    for role in ("params", "adam_m", "adam_v"):
        assert (_flat(store, role)[used == 0] == 0).all()


def test_weight_decay_below_float32_resolution_of_one_still_decays():
    """lr · wd = 2.5e-8 (the default lr with wd 1e-4) is below half an ulp of 1.0 in float32: the factor form
    p · (1 − c) rounds to p and the decay vanishes (a grid of runs came back bitwise equal to the undecayed
    ones). Folded into the step it survives: after 200 steps the decayed and undecayed twins differ by what the
    float64 reference says, and the undecayed tensor (the bias) not at all."""
    cfg_wd, cfg_0 = AdamConfig(lr=2.5e-4, weight_decay=1e-4), AdamConfig(lr=2.5e-4, weight_decay=0.0)
    stores = [_store(np.random.default_rng(7)) for _ in range(2)]
    opts = [Adam(stores[0], cfg_wd).allocate(), Adam(stores[1], cfg_0).allocate()]
    n = opts[0]._n
    mask = np.pad(stores[0].decay_mask(), (0, n - stores[0].decay_mask().size))
    p0 = _flat(stores[0], "params").astype(np.float64)
    ref = [(p0, np.zeros(n), np.zeros(n), 0), (p0, np.zeros(n), np.zeros(n), 0)]
    grng = np.random.default_rng(8)
    for _ in range(200):
        grads = {name: (0.1 * grng.standard_normal(spec.shape)).astype(np.float32)
                 for name, spec in stores[0].specs.items()}
        for store, opt in zip(stores, opts):
            store.load(grads, role="grads")
            opt.step(stream())
        g = _flat(stores[0], "grads")
        ref = [adam_ref(p, g, m, v, mask, t, 2.5e-4, cfg)[:4] for (p, m, v, t), cfg in zip(ref, (cfg_wd, cfg_0))]
    dev = _flat(stores[0], "params").astype(np.float64) - _flat(stores[1], "params").astype(np.float64)
    want = ref[0][0] - ref[1][0]
    decayed = (mask == 1) & (np.abs(want) > 0)
    assert decayed.sum() > 50 and (dev[mask == 0] == 0).all()
    # ~40 ulps of shift per weight, dithered by the rounding: the projection of the device's shift on the reference's
    ratio = np.dot(dev[decayed], want[decayed]) / np.dot(want[decayed], want[decayed])
    assert 0.9 < ratio < 1.1, ratio


def test_clip_hand_computed_and_deterministic_norm(rng):
    store = _store(rng)
    opt = Adam(store, AdamConfig(lr=1e-3, max_grad_norm=1.0, clip_eps=0.0)).allocate()
    grads = {name: np.zeros(spec.shape, np.float32) for name, spec in store.specs.items()}
    grads["fc.w"][0, 0], grads["head.w"][6, 2] = 3.0, -4.0  # norm 5
    store.load(grads, role="grads")
    opt.step(stream())
    st = _stats(opt)
    assert st[STAT_GRAD_NORM] == 5.0 and abs(st[STAT_CLIP_SCALE] - 0.2) < 1e-7
    m = store.to_host("adam_m")  # m = (1 − β1) · scale · g
    _close(m["fc.w"][0, 0], 0.1 * 0.2 * 3.0), _close(m["head.w"][6, 2], 0.1 * 0.2 * -4.0)
    assert np.count_nonzero(m["fc.w"]) == 1 and np.count_nonzero(m["fc.b"]) == 0

    g = _set_grads(store, rng, 7.0)  # random grads: norm vs float64, bitwise equal on a rerun
    opt.grad_norm(stream())
    first = _stats(opt)[STAT_GRAD_NORM]
    _close(first, np.sqrt(np.sum(g.astype(np.float64) ** 2)), rtol=1e-6)
    opt.grad_norm(stream())
    assert _stats(opt)[STAT_GRAD_NORM] == first


def test_zero_lr_moves_only_moments(rng):
    store = _store(rng)
    opt = Adam(store, AdamConfig(lr=0.0, weight_decay=0.3)).allocate()
    before = _flat(store, "params")
    g = _set_grads(store, rng)
    opt.step(stream())
    np.testing.assert_array_equal(_flat(store, "params"), before)
    _close(_flat(store, "adam_m"), 0.1 * g)
    assert opt.read_stats()["step"] == 1.0 and opt.read_stats()["lr"] == 0.0


def test_nonfinite_gradient_skips_the_step(rng):
    store = _store(rng)
    opt = Adam(store, AdamConfig(lr=1e-2), TargetConfig.periodic(1)).allocate()
    _set_grads(store, rng)
    opt.step(stream())
    snapshot = {role: _flat(store, role) for role in ("params", "adam_m", "adam_v", "target")}
    grads = store.to_host("grads")
    grads["fc.b"][4] = np.nan
    store.load(grads, role="grads")
    opt.step(stream())
    for role, before in snapshot.items():
        np.testing.assert_array_equal(_flat(store, role), before, err_msg=role)
    st = _stats(opt)
    assert math.isnan(st[STAT_GRAD_NORM]) and st[STAT_SKIPPED] == 1 and st[STAT_STEP] == 1
    _set_grads(store, rng)
    opt.step(stream())
    assert opt.read_stats()["step"] == 2.0 and opt.read_stats()["skipped"] == 1.0
    np.testing.assert_array_equal(_flat(store, "target"), _flat(store, "params"))


def test_periodic_target_copy(rng):
    store = _store(rng)
    opt = Adam(store, AdamConfig(lr=1e-2), TargetConfig.periodic(3)).allocate()
    initial = _flat(store, "target")
    for step in range(1, 5):
        _set_grads(store, rng)
        opt.step(stream())
        target, params = _flat(store, "target"), _flat(store, "params")
        if step % 3 == 0:
            np.testing.assert_array_equal(target, params)
            initial = target
        else:
            np.testing.assert_array_equal(target, initial)
            assert not np.array_equal(target, params)
        assert _stats(opt)[STAT_TARGET_UPDATES] == step // 3  # the liveness counter of the target update


def test_polyak_target_matches_reference(rng):
    store = _store(rng)
    tcfg = TargetConfig.polyak(0.25, period=2)
    opt = Adam(store, AdamConfig(lr=5e-2), tcfg).allocate()
    target = _flat(store, "target").astype(np.float64)
    for step in range(1, 4):
        _set_grads(store, rng)
        opt.step(stream())
        target = target_update_ref(target, _flat(store, "params"), step, tcfg)
        _close(_flat(store, "target"), target, rtol=1e-6, atol=1e-7, what=f"step {step}")


def test_stats_into_caller_vector_and_config_errors(rng):
    from numbarl.cuda.runtime import cuda

    store = _store(rng)
    out = cuda().to_device(np.zeros(N_STATS + 2, np.float32))
    opt = Adam(store, AdamConfig(lr=2e-3), stats=out).allocate()
    _set_grads(store, rng)
    opt.step(stream())
    host = out.copy_to_host()
    assert host[STAT_STEP] == 1 and abs(host[STAT_LR] - 2e-3) < 1e-9 and host[STAT_GRAD_NORM] > 0
    with pytest.raises(ValueError, match="beta2"):
        AdamConfig(beta2=1.0)
    with pytest.raises(ValueError, match="tau"):
        TargetConfig(period=1, tau=0.0)
    with pytest.raises(RuntimeError, match="allocate the ParamStore"):
        fresh = ParamStore()
        fresh.add("w", (2, 2), group="g", decay=True)
        Adam(fresh).allocate()


# ---------------------------------------------------------------------------------------------
# parameter groups
# ---------------------------------------------------------------------------------------------
def test_groups_have_their_own_learning_rate_and_weight_decay(rng):
    """Two groups ("trunk", "head"): a per-group lr and weight decay set between steps reach exactly
    the elements of that group (per-element reference), without re-allocating anything."""
    store = _store(rng)
    cfg = AdamConfig(lr=2e-3, weight_decay=0.05)
    opt = Adam(store, cfg).allocate()
    assert opt.groups == ["trunk", "head"]
    ids = np.pad(store.group_ids(opt.groups), (0, opt._n - store.flat_size))
    p, m, v = _flat(store, "params").astype(np.float64), np.zeros(opt._n), np.zeros(opt._n)
    mask = np.pad(store.decay_mask(), (0, opt._n - store.flat_size))
    lr, wd = {"trunk": 2e-3, "head": 2e-3}, {"trunk": 0.05, "head": 0.05}
    step = 0
    for k in range(3):
        if k == 1:
            lr["head"], wd["trunk"] = 5e-2, 0.5
            opt.set_lr(lr["head"], group="head")
            opt.set_weight_decay(wd["trunk"], group="trunk")
        g = _set_grads(store, rng)
        opt.step(stream())
        lr_el = np.where(ids == 1, lr["head"], lr["trunk"])
        wd_el = np.where(ids == 1, wd["head"], wd["trunk"])
        p, m, v, step, _ = adam_ref(p, g, m, v, mask, step, lr_el, cfg, weight_decay=wd_el)
        _close(_flat(store, "params"), p, what=f"params step {k}")
    assert opt.group_values("lr") == pytest.approx({"trunk": 2e-3, "head": 5e-2})
    assert opt.group_values("weight_decay") == pytest.approx({"trunk": 0.5, "head": 0.05})
    with pytest.raises(KeyError, match="groups: trunk, head"):
        opt.set_lr(1e-3, group="value")


def test_one_value_for_every_group_is_the_single_rate_step(rng):
    """Groups with equal values give the bits of one shared lr (the recorded runs reproduce)."""
    a, b = _store(np.random.default_rng(5)), _store(np.random.default_rng(5))
    for store in (a, b):
        opt = Adam(store, AdamConfig(lr=1e-3, weight_decay=0.1)).allocate()
        if store is b:
            opt.set_lr(1e-3, group="head")  # the same value, written per group
        _set_grads(store, np.random.default_rng(9))
        opt.step(stream())
    assert (_flat(a, "params") == _flat(b, "params")).all()
