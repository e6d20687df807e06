"""C51 projection (Eq. 7), double-DQN target and cross-entropy: references, hand cases, kernels."""

import numpy as np

from numbarl.cuda.testing import to_device, to_host
import pytest

from numbarl.cuda.runtime import cuda, stream
from numbarl.rl.losses import c51

_cuda = cuda()

SIZES = (3, 2, 4)  # odd branch sizes: padding in branches 0 and 1
N_ATOMS = 11
V_MIN, V_MAX = -2.0, 3.0


def _dev(x):
    return to_device(x, stream())


def _host(x):
    return to_host(x, stream())


def _close(actual, expected, atol=2e-5, rtol=2e-4, what=""):
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    err = np.abs(actual - expected)
    bound = atol + rtol * np.abs(expected)
    assert np.all(err <= bound), f"{what}: max excess {np.max(err - bound):.3g}, max err {np.max(err):.3g}"


def scatter_projection(rewards, dones, discounts, next_probs, support):
    """Algorithm 1 of Bellemare et al. 2017 as CleanRL writes it (floor/ceil + scatter), float64:
    an independent check of the dense form."""
    z = np.asarray(support, np.float64)
    v_min, v_max, dz = z[0], z[-1], z[1] - z[0]
    out = np.zeros(next_probs.shape)
    for b in range(len(rewards)):
        gamma = discounts[b] * (1.0 - dones[b])
        for j, zj in enumerate(z):
            tz = min(max(rewards[b] + gamma * zj, v_min), v_max)
            pos = (tz - v_min) / dz
            lo, hi = int(np.floor(pos)), int(np.ceil(pos))
            if lo == hi:  # lands exactly on an atom
                out[b, lo] += next_probs[b, j]
            else:
                out[b, lo] += next_probs[b, j] * (hi - pos)
                out[b, hi] += next_probs[b, j] * (pos - lo)
    return out


def _random_probs(rng, shape):
    x = rng.standard_normal(shape) * 1.5
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _loss_inputs(rng, batch, sizes=SIZES, n_atoms=N_ATOMS):
    nb, na = len(sizes), max(sizes)
    logits = rng.standard_normal((batch, nb, na, n_atoms)) * 2.0
    next_q = rng.standard_normal((batch, nb, na))
    target_probs = _random_probs(rng, (batch, nb, na, n_atoms))
    actions = np.zeros((batch, nb), np.int32)
    for k, n in enumerate(sizes):
        logits[:, k, n:] = -np.inf
        next_q[:, k, n:] = -np.inf
        target_probs[:, k, n:] = 0.0
        actions[:, k] = rng.integers(0, n, batch)
    rewards = rng.uniform(1.5 * V_MIN, 1.5 * V_MAX, batch)  # some beyond the support
    dones = (rng.random(batch) < 0.3).astype(np.float32)
    dones[0], dones[-1] = 1.0, 0.0  # at least one of each
    discounts = rng.uniform(0.5, 1.0, batch)
    weights = rng.uniform(0.2, 2.0, batch)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    return dict(online_logits=f32(logits), actions=actions, next_q=f32(next_q), target_probs=f32(target_probs),
                rewards=f32(rewards), dones=dones, discounts=f32(discounts)), f32(weights)


# ---------------------------------------------------------------------------------------------
# reference: hand-computed cases and edge cases
# ---------------------------------------------------------------------------------------------
def test_project_hand_computed():
    """The docstring example: z = [-1, 0, 1], p = [0.2, 0.5, 0.3]."""
    support = np.array([-1.0, 0.0, 1.0])
    p = np.array([[0.2, 0.5, 0.3]] * 3)
    m = c51.project_distribution_ref([0.5, 2.5, -0.25], [0, 1, 1], [0.5, 0.5, 0.5], p, support)
    np.testing.assert_allclose(m[0], [0.0, 0.45, 0.55], atol=1e-12)  # T z = [0, 0.5, 1]
    np.testing.assert_allclose(m[1], [0.0, 0.0, 1.0], atol=1e-12)  # done, reward above v_max
    np.testing.assert_allclose(m[2], [0.25, 0.75, 0.0], atol=1e-12)  # done, -0.25 splits 1/4 : 3/4


def test_project_edge_cases():
    support = c51.make_support(5, -2.0, 2.0).astype(np.float64)  # [-2, -1, 0, 1, 2], Δz = 1
    p = np.array([[0.1, 0.2, 0.3, 0.25, 0.15]] * 4)
    # 0: reward far beyond the support, not done -> every atom clipped to v_max
    # 1: reward far below, not done -> v_min
    # 2: γ = 1, r = Δz: every atom lands exactly one support point up; the top one piles at v_max
    # 3: done with r = 0.4 -> 0.6 at z = 0, 0.4 at z = 1 whatever p is
    m = c51.project_distribution_ref([50.0, -50.0, 1.0, 0.4], [0, 0, 0, 1], [0.99, 0.99, 1.0, 0.9], p, support)
    np.testing.assert_allclose(m[0], [0, 0, 0, 0, 1], atol=1e-12)
    np.testing.assert_allclose(m[1], [1, 0, 0, 0, 0], atol=1e-12)
    np.testing.assert_allclose(m[2], [0.0, 0.1, 0.2, 0.3, 0.4], atol=1e-12)
    np.testing.assert_allclose(m[3], [0, 0, 0.6, 0.4, 0], atol=1e-12)


def test_project_matches_scatter_algorithm(rng):
    batch, n_atoms = 40, 21
    support = c51.make_support(n_atoms, -5.0, 5.0).astype(np.float64)
    p = _random_probs(rng, (batch, n_atoms))
    rewards = rng.uniform(-8.0, 8.0, batch)
    rewards[:5] = rng.integers(-6, 7, 5) * 0.5  # on-grid rewards: exact landings with γ = 1
    dones = (rng.random(batch) < 0.3).astype(np.float64)
    discounts = rng.uniform(0.0, 1.0, batch)
    discounts[:5] = 1.0
    dones[:5] = 0.0
    m = c51.project_distribution_ref(rewards, dones, discounts, p, support)
    np.testing.assert_allclose(m, scatter_projection(rewards, dones, discounts, p, support), atol=1e-12)
    np.testing.assert_allclose(m.sum(1), 1.0, atol=1e-12)  # mass is preserved


def test_double_dqn_argmax_ignores_padding_and_breaks_ties_first():
    q = np.array([[[1.0, 3.0, 3.0, 9.0], [2.0, 2.0, 5.0, 5.0]]])  # [1, 2 branches, 4]
    # branch 0 has 3 actions (the 9 is padding), branch 1 has 2 (ties -> first)
    np.testing.assert_array_equal(c51.double_dqn_actions_ref(q, (3, 2)), [[1, 0]])


def test_cross_entropy_hand_computed():
    """Uniform online logits over z = [-1, 0, 1], target m = [0, 0.45, 0.55]: CE = log 3."""
    logits = np.zeros((1, 1, 2, 3))
    logits[0, 0, 1] = [5.0, -1.0, 2.0]  # the action not taken: no effect, zero gradient
    target = np.array([[[0.0, 0.45, 0.55]]])
    loss, per_sample, d = c51.cross_entropy_loss_ref(logits, np.array([[0]]), target)
    assert loss == pytest.approx(np.log(3.0), abs=1e-12)
    np.testing.assert_allclose(per_sample, [np.log(3.0)], atol=1e-12)
    np.testing.assert_allclose(d[0, 0, 0], [1 / 3, 1 / 3 - 0.45, 1 / 3 - 0.55], atol=1e-12)
    np.testing.assert_array_equal(d[0, 0, 1], 0.0)


@pytest.mark.parametrize("beta", [0.0, 0.7])
def test_loss_reference_gradient_finite_differences(rng, beta):
    """∂loss/∂online_logits of the reference against central differences (float64); with beta > 0
    the loss carries the atom-entropy term −β · mean_{b,k} H(p_bk) of the taken actions (C5)."""
    inputs, weights = _loss_inputs(rng, 4)
    support = c51.make_support(N_ATOMS, V_MIN, V_MAX)
    args = {k: np.asarray(v, np.float64) if v.dtype != np.int32 else v for k, v in inputs.items()}
    logits = args.pop("online_logits")
    w = weights.astype(np.float64)

    def loss_of(x):
        return c51.c51_loss_ref(x, support=support, branch_sizes=SIZES, weights=w, entropy_beta=beta, **args)[0]

    if beta:  # the objective is the β = 0 loss minus β times the mean entropy
        ce = c51.c51_loss_ref(logits, support=support, branch_sizes=SIZES, weights=w, **args)[0]
        h = c51.atom_entropy_ref(logits, inputs["actions"])
        assert np.isclose(loss_of(logits), ce - beta * h.mean(), rtol=1e-12)
    _, _, d_logits, _ = c51.c51_loss_ref(logits, support=support, branch_sizes=SIZES, weights=w, entropy_beta=beta,
                                         **args)
    eps = 1e-6
    fd = np.zeros_like(logits)
    for idx in zip(*np.nonzero(np.isfinite(logits))):
        x = logits.copy()
        x[idx] += eps
        up = loss_of(x)
        x[idx] -= 2 * eps
        fd[idx] = (up - loss_of(x)) / (2 * eps)
    np.testing.assert_allclose(np.where(np.isfinite(logits), d_logits, 0.0), fd, atol=1e-8, rtol=1e-6)
    assert np.count_nonzero(d_logits) > 0


# ---------------------------------------------------------------------------------------------
# kernels vs references (simulator: tiny odd shapes)
# ---------------------------------------------------------------------------------------------
def test_project_kernel_hand_computed():
    support = c51.make_support(3, -1.0, 1.0)
    p = np.array([[0.2, 0.5, 0.3]] * 3, np.float32)
    out = _cuda.device_array((3, 3), np.float32)
    c51.project_distribution(_dev(np.float32([0.5, 2.5, -0.25])), _dev(np.uint8([0, 1, 1])),
                             _dev(np.float32([0.5, 0.5, 0.5])), _dev(p), _dev(support), -1.0, 1.0, out, stream())
    _close(_host(out), [[0.0, 0.45, 0.55], [0.0, 0.0, 1.0], [0.25, 0.75, 0.0]], atol=1e-6, what="projection")


@pytest.mark.parametrize("done_dtype", [np.float32, np.uint8])
def test_project_kernel_matches_reference(rng, done_dtype):
    batch, n_atoms = 7, N_ATOMS
    support = c51.make_support(n_atoms, V_MIN, V_MAX)
    p = _random_probs(rng, (batch, n_atoms)).astype(np.float32)
    rewards = rng.uniform(-4.0, 5.0, batch).astype(np.float32)
    rewards[0] = 0.5  # Δz = 0.5: lands on the grid
    dones = (rng.random(batch) < 0.4).astype(done_dtype)
    dones[1] = 1
    discounts = rng.uniform(0.3, 1.0, batch).astype(np.float32)
    discounts[0], dones[0] = 1.0, 0
    # edges: γ = 0 (one target point), rewards exactly at v_min / v_max, a reward far above the
    # support (every atom piles on v_max)
    rewards[2], discounts[2], dones[2] = 0.5, 0.0, 0
    rewards[3], dones[3] = V_MIN, 1
    rewards[4], discounts[4], dones[4] = V_MAX, 1.0, 0
    rewards[5], dones[5] = 40.0, 0
    out = _cuda.device_array((batch, n_atoms), np.float32)
    c51.project_distribution(_dev(rewards), _dev(dones), _dev(discounts), _dev(p), _dev(support), V_MIN, V_MAX,
                             out, stream())
    ref = c51.project_distribution_ref(rewards, dones, discounts, p, support)
    _close(_host(out), ref, atol=2e-6, rtol=1e-5, what="projection")


@pytest.mark.parametrize("use_weights", [False, True])
def test_loss_kernel_matches_reference(rng, use_weights):
    batch = 5
    inputs, weights = _loss_inputs(rng, batch)
    loss_fn = c51.C51Loss(batch, SIZES, N_ATOMS, V_MIN, V_MAX)
    dev = {k: _dev(v) for k, v in inputs.items()}
    loss_fn(stream=stream(), weights=_dev(weights) if use_weights else None, **dev)
    w = weights if use_weights else None
    loss, per_sample, d_logits, _ = c51.c51_loss_ref(support=loss_fn.support_host, branch_sizes=SIZES, weights=w,
                                                     **inputs)
    _close(_host(loss_fn.loss)[0], loss, what="loss")
    _close(_host(loss_fn.per_sample), per_sample, what="per_sample")
    got = _host(loss_fn.d_logits)
    _close(got, d_logits, atol=1e-6, rtol=1e-4, what="d_logits")
    assert np.all(np.isfinite(got))
    taken = np.zeros(got.shape, bool)
    for k in range(len(SIZES)):
        taken[np.arange(batch), k, inputs["actions"][:, k]] = True
    assert np.all(got[~taken] == 0.0)  # other actions and padding: exactly zero


def _full_mask(batch):
    """The env's mask when nothing is locked: 1 inside each branch, 0 in the padding."""
    mask = np.zeros((batch, len(SIZES), max(SIZES)), np.uint8)
    for k, n in enumerate(SIZES):
        mask[:, k, :n] = 1
    return mask


def test_next_state_mask_restricts_the_double_dqn_argmax(rng):
    """With next_mask (the env's mask of next_obs, e.g. the direction a lock forbids), a* is the
    argmax over the actions available there; rows and branches the mask leaves whole are unchanged."""
    q = np.array([[[3.0, 1.0, 2.0]], [[3.0, 1.0, 2.0]], [[1.0, 1.0, 5.0]]])
    barred = np.ones((3, 1, 3), np.uint8)
    barred[0, 0, 0] = barred[2, 0, 2] = 0
    np.testing.assert_array_equal(c51.double_dqn_actions_ref(q, (3,), next_mask=barred), [[2], [0], [0]])
    batch = 6
    inputs, _ = _loss_inputs(rng, batch)
    next_mask = _full_mask(batch)
    for row, short_or_long in enumerate([0, 2, -1, 0, 2, -1]):  # the direction the lock bars (-1: none)
        if short_or_long >= 0:
            next_mask[row, 0, short_or_long] = 0
    inputs["next_q"][:, 0, 0] = 50.0  # the barred short would win every row it is not barred in
    inputs["dones"][:] = 0.0  # (a done row's target is the reward alone, whatever a* is)
    loss_fn = c51.C51Loss(batch, SIZES, N_ATOMS, V_MIN, V_MAX)
    loss_fn(stream=stream(), next_mask=_dev(next_mask), **{k: _dev(v) for k, v in inputs.items()})
    loss, _, d_logits, target = c51.c51_loss_ref(support=loss_fn.support_host, branch_sizes=SIZES,
                                                 next_mask=next_mask, **inputs)
    _close(_host(loss_fn.target_dist), target, atol=2e-6, rtol=1e-5, what="target_dist")
    _close(_host(loss_fn.loss)[0], loss, what="loss")
    _close(_host(loss_fn.d_logits), d_logits, atol=1e-6, rtol=1e-4, what="d_logits")
    _, _, _, plain = c51.c51_loss_ref(support=loss_fn.support_host, branch_sizes=SIZES, **inputs)
    differs = np.any(np.abs(plain[:, 0] - target[:, 0]) > 1e-9, axis=1)
    assert list(differs) == [True, False, False, True, False, False]  # only where short was barred
    np.testing.assert_array_equal(plain[:, 1:], target[:, 1:])  # other branches: untouched
    # a whole mask is no restriction: the device gives the unmasked target exactly
    loss_fn(stream=stream(), next_mask=_dev(_full_mask(batch)), **{k: _dev(v) for k, v in inputs.items()})
    whole = _host(loss_fn.target_dist)
    loss_fn(stream=stream(), **{k: _dev(v) for k, v in inputs.items()})
    np.testing.assert_array_equal(whole, _host(loss_fn.target_dist))
    with pytest.raises(TypeError, match="next_mask"):
        loss_fn(stream=stream(), next_mask=_dev(_full_mask(batch).astype(np.int32)), **{k: _dev(v) for k, v in inputs.items()})


def test_loss_kernel_hand_computed():
    """One sample, one branch: uniform logits, target m = [0, 0.45, 0.55] -> CE = log 3."""
    loss_fn = c51.C51Loss(1, (2,), 3, -1.0, 1.0)
    logits = np.zeros((1, 1, 2, 3), np.float32)
    logits[0, 0, 1] = [4.0, 0.0, -4.0]
    next_q = np.array([[[0.1, 0.7]]], np.float32)  # a* = 1 picks the second target row
    target_probs = np.array([[[[1.0, 0.0, 0.0], [0.2, 0.5, 0.3]]]], np.float32)
    loss_fn(_dev(logits), _dev(np.int32([[0]])), _dev(next_q), _dev(target_probs), _dev(np.float32([0.5])),
            _dev(np.float32([0.0])), _dev(np.float32([0.5])), stream())
    _close(_host(loss_fn.loss)[0], np.log(3.0), atol=1e-6, what="loss")
    d = _host(loss_fn.d_logits)
    _close(d[0, 0, 0], [1 / 3, 1 / 3 - 0.45, 1 / 3 - 0.55], atol=1e-6, what="d_logits")
    assert np.all(d[0, 0, 1] == 0.0)


def test_loss_kernel_invalid_action_is_nan():
    inputs, _ = _loss_inputs(np.random.default_rng(0), 3)
    inputs["actions"][1, 1] = SIZES[1]  # one past the branch: padding
    loss_fn = c51.C51Loss(3, SIZES, N_ATOMS, V_MIN, V_MAX)
    loss_fn(stream=stream(), **{k: _dev(v) for k, v in inputs.items()})
    per_sample = _host(loss_fn.per_sample)
    assert np.isnan(per_sample[1]) and np.all(np.isfinite(per_sample[[0, 2]]))
    assert np.isnan(_host(loss_fn.loss)[0])


def test_loss_launcher_rejects_bad_shapes():
    loss_fn = c51.C51Loss(3, SIZES, N_ATOMS, V_MIN, V_MAX)
    inputs, _ = _loss_inputs(np.random.default_rng(1), 3)
    inputs["next_q"] = inputs["next_q"][:, :2]
    with pytest.raises(ValueError, match="next_q"):
        loss_fn(stream=stream(), **{k: _dev(v) for k, v in inputs.items()})
    with pytest.raises(ValueError, match="n_atoms"):
        c51.C51Loss(3, SIZES, 1, V_MIN, V_MAX)
    with pytest.raises(ValueError, match="v_min"):
        c51.make_support(11, 1.0, 1.0)


# ---------------------------------------------------------------------------------------------
# atom-entropy regulariser (C5) and the device support (set_support)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_weights", [False, True])
def test_entropy_regularised_kernel_matches_reference(rng, use_weights):
    batch, beta = 5, 0.37
    inputs, weights = _loss_inputs(rng, batch)
    loss_fn = c51.C51Loss(batch, SIZES, N_ATOMS, V_MIN, V_MAX, entropy_reg=True)
    loss_fn.set_entropy_beta(beta)
    dev = {k: _dev(v) for k, v in inputs.items()}
    loss_fn(stream=stream(), weights=_dev(weights) if use_weights else None, **dev)
    w = weights if use_weights else None
    ce_loss, per_sample, d_logits, _ = c51.c51_loss_ref(support=loss_fn.support_host, branch_sizes=SIZES, weights=w,
                                                        **inputs)
    _, _, d_logits_reg, _ = c51.c51_loss_ref(support=loss_fn.support_host, branch_sizes=SIZES, weights=w,
                                             entropy_beta=beta, **inputs)
    assert np.abs(d_logits_reg - d_logits).max() > 1e-4  # the term is not negligible here
    _close(_host(loss_fn.loss)[0], ce_loss, what="loss (the cross-entropy alone)")
    _close(_host(loss_fn.per_sample), per_sample, what="per_sample")
    _close(_host(loss_fn.d_logits), d_logits_reg, atol=1e-6, rtol=1e-4, what="d_logits")
    _close(_host(loss_fn.entropy), c51.atom_entropy_ref(inputs["online_logits"], inputs["actions"]), atol=1e-5,
           what="entropy")
    rows = np.arange(batch)
    for k in range(len(SIZES)):
        p = np.exp(c51.log_softmax_ref(inputs["online_logits"][rows, k, inputs["actions"][:, k]]))
        _close(_host(loss_fn.taken_probs)[:, k], p, atol=1e-6, what=f"taken_probs branch {k}")


def test_entropy_regulariser_with_beta_zero_is_bitwise_the_plain_loss(rng):
    batch = 6
    inputs, _ = _loss_inputs(rng, batch)
    dev = {k: _dev(v) for k, v in inputs.items()}
    plain = c51.C51Loss(batch, SIZES, N_ATOMS, V_MIN, V_MAX)
    reg = c51.C51Loss(batch, SIZES, N_ATOMS, V_MIN, V_MAX, entropy_reg=True)  # β = 0 until written
    plain(stream=stream(), **dev)
    reg(stream=stream(), **dev)
    for what in ("d_logits", "per_sample", "loss", "target_dist"):
        assert np.array_equal(_host(getattr(plain, what)), _host(getattr(reg, what))), what


def test_set_support_equals_a_loss_built_with_that_support(rng):
    """A loss built on ±10 and moved to [V_MIN, V_MAX] by set_support computes the bits of one built on
    [V_MIN, V_MAX]."""
    batch = 6
    inputs, weights = _loss_inputs(rng, batch)
    dev = {k: _dev(v) for k, v in inputs.items()}
    built = c51.C51Loss(batch, SIZES, N_ATOMS, V_MIN, V_MAX)
    moved = c51.C51Loss(batch, SIZES, N_ATOMS, -10.0, 10.0)
    moved.set_support(V_MIN, V_MAX)
    for fn in (built, moved):
        fn(stream=stream(), weights=_dev(weights), **dev)
    for what in ("d_logits", "per_sample", "loss", "target_dist"):
        assert np.array_equal(_host(getattr(built, what)), _host(getattr(moved, what))), what


def test_the_loss_reads_its_support_from_device_memory_only(rng):
    """What a captured graph would replay: the launch reads the support and the projection's
    (v_min, v_max, 1/Δz) from device arrays, not from Python attributes frozen at capture. Writing
    only the device arrays (the host attributes keep ±10) gives the reference on the new support."""
    batch = 5
    inputs, _ = _loss_inputs(rng, batch)
    loss_fn = c51.C51Loss(batch, SIZES, N_ATOMS, -10.0, 10.0)
    support = c51.make_support(N_ATOMS, V_MIN, V_MAX)
    loss_fn.arena.load({"support": support, "support_scalars": np.array(c51.support_scalars(N_ATOMS, V_MIN, V_MAX),
                                                                        np.float32)})
    assert loss_fn.v_min == np.float32(-10.0)  # the host attribute did not move
    loss_fn(stream=stream(), **{k: _dev(v) for k, v in inputs.items()})
    _, _, d_logits, target = c51.c51_loss_ref(support=support, branch_sizes=SIZES, **inputs)
    _close(_host(loss_fn.target_dist), target, atol=2e-6, rtol=1e-5, what="target_dist")
    _close(_host(loss_fn.d_logits), d_logits, atol=1e-6, rtol=1e-4, what="d_logits")


@pytest.mark.parametrize("n_branches", [1, 3, 6])
def test_loss_reduce_kernel_order_and_tails(rng, n_branches):
    """`c51_loss_reduce_kernel` (shared with the other losses) takes four samples per step and four
    branches per load round: a batch that is not a multiple of 4·REDUCE_BLOCK and branch counts
    below, at and above four. per_sample bitwise equals the float32 sum in branch order times
    1/n_branches; the loss matches the float64 mean, with and without weights."""
    batch = 4 * c51.REDUCE_BLOCK + 7
    ce = (rng.standard_normal((batch, n_branches)) * 3).astype(np.float32)
    weights = rng.uniform(0.2, 2.0, batch).astype(np.float32)
    inv_branches, inv_batch = np.float32(1.0 / n_branches), np.float32(1.0 / batch)
    expected = np.zeros(batch, np.float32)
    for k in range(n_branches):  # float32 adds in branch order
        expected = (expected + ce[:, k]).astype(np.float32)
    expected = (expected * inv_branches).astype(np.float32)
    for use_weights in (0, 1):
        per_sample, loss = _cuda.device_array(batch, np.float32), _cuda.device_array(1, np.float32)
        c51.c51_loss_reduce_kernel[1, c51.REDUCE_BLOCK, stream()](
            _dev(ce), _dev(weights), np.int32(use_weights), inv_branches, inv_batch, per_sample, loss)
        assert np.array_equal(_host(per_sample), expected), use_weights
        w = weights.astype(np.float64) if use_weights else 1.0
        _close(_host(loss)[0], np.mean(w * ce.astype(np.float64).mean(axis=1)), what=f"loss (weights {use_weights})")


@pytest.mark.parametrize("entropy", [False, True])
def test_taken_rows_are_the_dense_gradient_rows(rng, entropy):
    """taken_grad=True writes d_taken = d_logits at the taken actions bit for bit (zeros for an action outside its
    branch) and the same loss, per-sample values and taken probabilities, without touching d_logits; the loss
    contract's "logits_taken" asks for it, and asking for both forms is refused."""
    batch = 6
    inputs, weights = _loss_inputs(rng, batch)
    inputs["actions"][3, 2] = SIZES[2]  # outside branch 2
    dev = {k: _dev(v) for k, v in inputs.items()}
    losses = [c51.C51Loss(batch, SIZES, N_ATOMS, V_MIN, V_MAX, entropy_reg=entropy) for _ in range(2)]
    for loss, taken in zip(losses, (False, True)):
        if entropy:
            loss.set_entropy_beta(0.4)
        loss(stream=stream(), weights=_dev(weights), taken_grad=taken, **dev)
    dense, rows = _host(losses[0].d_logits), _host(losses[1].d_taken)
    a = inputs["actions"]
    for k, n in enumerate(SIZES):
        for b in range(batch):
            want = dense[b, k, a[b, k]] if a[b, k] < n else np.zeros(N_ATOMS, np.float32)
            assert rows[b, k].tobytes() == want.tobytes(), (b, k)
    assert np.all(_host(losses[1].d_logits) == 0.0)  # the dense buffer: untouched (the arena's zeros)
    for name in ("loss", "per_sample", "ce", "lse", "target_dist") + (("taken_probs", "entropy") if entropy else ()):
        assert _host(losses[0].arena[name]).tobytes() == _host(losses[1].arena[name]).tobytes(), name
    d = _cuda.device_array((batch, len(SIZES), N_ATOMS), np.float32)
    x = {"logits" if k == "online_logits" else k: v for k, v in dev.items()}
    losses[0].apply({**x, "weights": _dev(weights)}, {"logits_taken": d}, stream())
    assert _host(d).tobytes() == rows.tobytes()
    with pytest.raises(KeyError, match="not both"):
        losses[0].apply(x, {"logits_taken": d, "logits": losses[0].d_logits}, stream())



@pytest.mark.parametrize("case", ["plain", "entropy+own_lse", "rows+head_lse", "adaptive_nonuniform+mask"])
def test_target_kernel_split_rows_keep_the_bits(rng, monkeypatch, case):
    """`c51_target_kernel` with each row's atoms split over 4 threads (each sweeping its share from the pointer the
    full sweep has there, then a barrier before the first part's log-sum-exp and CE) writes the bits of one thread
    per row: every output, both gradient forms, with an action outside its branch, rewards far outside the support
    (targets piling on an end atom), done rows (γ = 0: every target on one point), targets exactly on atoms, γ = 1,
    and a NaN reward (NaN everywhere, as the dense sum gives)."""
    batch = 7
    inputs, weights = _loss_inputs(rng, batch)
    inputs["actions"][2, 1] = -1  # outside branch 1
    dz = (V_MAX - V_MIN) / (N_ATOMS - 1)
    inputs["rewards"][:4] = (3 * V_MAX, 3 * V_MIN, V_MIN + 3 * dz, np.nan)
    inputs["dones"][:4] = (0.0, 0.0, 1.0, 0.0)
    inputs["discounts"][4] = 1.0
    entropy, adaptive = case.startswith("entropy"), case.startswith("adaptive")
    extra = {}
    if case.startswith("rows"):  # the target probabilities at a* ([B, n_branches, Z]) and the head's lse
        a_star = inputs["next_q"].argmax(axis=2)
        inputs["target_probs"] = np.ascontiguousarray(np.take_along_axis(
            inputs["target_probs"], a_star[:, :, None, None], axis=2)[:, :, 0])
        x = np.where(np.isfinite(inputs["online_logits"]), inputs["online_logits"], -30.0).astype(np.float64)
        extra["head_lse"] = _dev(np.log(np.exp(x).sum(-1)).astype(np.float32))
    support = None
    if adaptive:  # a moved, non-uniform support: lane 0's scatter
        extra["next_mask"] = _dev(_full_mask(batch))
        support = np.sort(rng.uniform(V_MIN, V_MAX, N_ATOMS)).astype(np.float32)
        support[0], support[-1] = V_MIN, V_MAX
    dev = {k: _dev(v) for k, v in inputs.items()}
    one, many = 1, 4
    outputs = {}
    for shape in (one, many):
        with monkeypatch.context() as m:
            m.setattr(c51, "TARGET_PARTS", shape)
            for taken in (False, True):
                loss = c51.C51Loss(batch, SIZES, N_ATOMS, V_MIN, V_MAX, entropy_reg=entropy, adaptive_support=adaptive)
                if entropy:
                    loss.set_entropy_beta(0.3)
                if adaptive:
                    loss.bind_support(_dev(support), _dev(np.ones(1, np.int32)))
                loss(stream=stream(), weights=_dev(weights), taken_grad=taken, **dev, **extra)
                outputs[shape, taken] = loss.arena.to_host()
    for taken in (False, True):
        a, b = outputs[one, taken], outputs[many, taken]
        assert set(a) == set(b)
        for name in a:
            assert a[name].tobytes() == b[name].tobytes(), (case, taken, name)
        assert np.isnan(b["ce"][2, 1]) and np.isnan(b["ce"][3]).all()  # the invalid action; the NaN reward
        assert np.isfinite(b["ce"][4:]).all() and np.isfinite(b["ce"][:2]).all()
        assert np.any(b["d_taken"] != 0.0) if taken else np.any(b["d_logits"] != 0.0)

