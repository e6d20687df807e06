"""Adaptive atom positions (agent.adaptive_atoms, numbarl/rl/losses/atoms.py): the non-uniform
projection against Algorithm 1 with np.searchsorted, mass conservation, the uniform mode equal to
today's projection bit for bit, J and its analytic gradient against float64 references and central
differences, a hand-computed ascent step, the device step against the reference, and the agent:
warm-up steps identical to the agent without the switch, the liveness stats moving after it, and the
checkpoint round trip of spacing_raw and the live support. Tiny shapes (simulator)."""

import math
from dataclasses import replace

import numpy as np
import pytest
from agent_helpers import assert_bitwise, fill_replay

from numbarl.config import AgentConfig, ConfigError
from numbarl.cuda.runtime import cuda, stream
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.losses import atoms
from numbarl.rl.losses.c51 import (
    C51Loss,
    double_dqn_actions_ref,
    project_distribution_nonuniform_ref,
    project_distribution_ref,
)

_cuda = cuda()
SIZES = (3, 4)
N_ATOMS = 7
V_MIN, V_MAX = -2.0, 2.0


def _dev(x):
    return _cuda.to_device(np.ascontiguousarray(x))


def _inputs(rng, batch, n_atoms=N_ATOMS, sizes=SIZES):
    """Loss inputs with rewards inside and beyond the support and some episode ends."""
    nb, na = len(sizes), max(sizes)
    return {"logits": rng.standard_normal((batch, nb, na, n_atoms)).astype(np.float32),
            "actions": np.stack([rng.integers(0, n, batch) for n in sizes], 1).astype(np.int32),
            "next_q": rng.standard_normal((batch, nb, na)).astype(np.float32),
            "target_probs": rng.dirichlet(np.ones(n_atoms), (batch, nb, na)).astype(np.float32),
            "rewards": rng.uniform(-2.5, 2.5, batch).astype(np.float32),
            "dones": (rng.random(batch) < 0.3).astype(np.float32),
            "discounts": rng.uniform(0.5, 0.99, batch).astype(np.float32)}


def _call(loss, x, s):
    d = {k: _dev(v) for k, v in x.items()}
    loss(d["logits"], d["actions"], d["next_q"], d["target_probs"], d["rewards"], d["dones"], d["discounts"], s)
    s.synchronize()


def _at_best(x, sizes=SIZES):
    """The target-net rows at the double-DQN action, float64 [B, n_branches, Z], and a*."""
    a_star = double_dqn_actions_ref(x["next_q"], sizes)
    rows = np.arange(len(a_star))
    return np.stack([x["target_probs"][rows, k, a_star[:, k]] for k in range(len(sizes))], 1).astype(np.float64), a_star


def _close(got, want, atol, rtol, what=""):
    """|got - want| <= atol + rtol · |want| elementwise (float64)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got - want) - (atol + rtol * np.abs(want))
    assert got.shape == want.shape and np.all(err <= 0), f"{what}: worst excess {np.max(err):.3g}"


def _moved_spacing(rng, n_atoms=N_ATOMS):
    return atoms.SPACING_INIT + 0.4 * rng.standard_normal(n_atoms - 1)


# ---------------------------------------------------------------------------------------------
# the projection
# ---------------------------------------------------------------------------------------------
def test_nonuniform_reference_hand_computed_and_uniform_equivalence(rng):
    m = project_distribution_nonuniform_ref([0.5], [0], [0.5], [[0.2, 0.5, 0.3]], [-1.0, 0.0, 2.0])
    np.testing.assert_allclose(m, [[0.0, 0.65, 0.35]], atol=1e-15)
    z = np.linspace(-1, 1, 5)  # evenly spaced: Algorithm 1 is Eq. 7
    r, d, g = rng.uniform(-1.5, 1.5, 6), (rng.random(6) < 0.3), rng.uniform(0, 1, 6)
    p = rng.dirichlet(np.ones(5), 6)
    np.testing.assert_allclose(project_distribution_nonuniform_ref(r, d, g, p, z),
                               project_distribution_ref(r, d, g, p, z), atol=1e-12)


def test_device_nonuniform_projection_matches_algorithm_1_and_conserves_mass(rng):
    batch = 5  # not a multiple of the simulator's block
    x = _inputs(rng, batch)
    z = atoms.support_from_spacing_ref(_moved_spacing(rng), V_MIN, V_MAX).astype(np.float32)
    x["rewards"][0], x["dones"][0] = np.float32(z[3]), 1.0  # a target atom exactly on an atom (l = that atom)
    loss = C51Loss(batch, SIZES, N_ATOMS, V_MIN, V_MAX, adaptive_support=True)
    support, mode = _dev(z), _dev(np.ones(1, np.int32))
    loss.bind_support(support, mode)
    s = stream()
    _call(loss, x, s)
    probs, a_star = _at_best(x)
    want = np.stack([project_distribution_nonuniform_ref(x["rewards"], x["dones"], x["discounts"], probs[:, k], z)
                     for k in range(len(SIZES))], 1)
    got = loss.target_dist.copy_to_host()
    _close(got, want, 1e-6, 1e-5, "target_dist")
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-6)  # mass conservation
    assert np.array_equal(loss.best_action.copy_to_host(), a_star)
    assert got[0, 0, 3] == pytest.approx(1.0, abs=1e-6)


def test_uniform_mode_is_todays_projection_bitwise(rng):
    """A loss built for adaptive atoms, with the flag at 0 (the support still the linspace), gives the
    bits of the loss without the switch: target, cross-entropy, gradient, loss."""
    batch = 5
    x = _inputs(rng, batch)
    plain = C51Loss(batch, SIZES, N_ATOMS, V_MIN, V_MAX)
    adaptive = C51Loss(batch, SIZES, N_ATOMS, V_MIN, V_MAX, adaptive_support=True)
    adaptive.bind_support(_dev(plain.support_host), _dev(np.zeros(1, np.int32)))
    s = stream()
    _call(plain, x, s)
    _call(adaptive, x, s)
    for name in ("target_dist", "ce", "d_logits", "loss", "per_sample"):
        assert plain.arena[name].copy_to_host().tobytes() == adaptive.arena[name].copy_to_host().tobytes(), name


# ---------------------------------------------------------------------------------------------
# the objective, its gradient and the step
# ---------------------------------------------------------------------------------------------
def test_support_parameterisation_starts_uniform_and_keeps_its_ends(rng):
    z0 = atoms.support_from_spacing_ref(np.full(N_ATOMS - 1, atoms.SPACING_INIT), V_MIN, V_MAX)
    np.testing.assert_allclose(z0, np.linspace(V_MIN, V_MAX, N_ATOMS), atol=1e-14)
    z = atoms.support_from_spacing_ref(_moved_spacing(rng), V_MIN, V_MAX)
    assert z[0] == V_MIN and z[-1] == pytest.approx(V_MAX, abs=1e-14) and np.all(np.diff(z) > 0)


def test_entropy_hand_computed():
    """Z = 3 on [-1, 1] (z = [-1, 0, 1]), one row, done (γ = 0), r = 0.5: all mass splits half/half
    between z_1 and z_2, m̄ = [0, 0.5, 0.5], J = log 2."""
    j = atoms.support_entropy_ref(np.full(2, atoms.SPACING_INIT), -1.0, 1.0, [0.5], [1.0], [0.9], [[[0.1, 0.6, 0.3]]])
    assert j == pytest.approx(math.log(2.0), abs=1e-14)


def test_analytic_gradient_matches_central_differences(rng):
    batch = 4
    x = _inputs(rng, batch)
    probs, _ = _at_best(x)
    s = _moved_spacing(rng)
    args = (V_MIN, V_MAX, x["rewards"], x["dones"], x["discounts"], probs)
    j, _, grad = atoms.support_entropy_grad_ref(s, *args)
    assert j == pytest.approx(atoms.support_entropy_ref(s, *args), abs=1e-14)
    eps = 1e-6
    fd = np.array([(atoms.support_entropy_ref(s + eps * e, *args) - atoms.support_entropy_ref(s - eps * e, *args))
                   / (2 * eps) for e in np.eye(N_ATOMS - 1)])
    _close(grad, fd, 1e-7, 1e-5, "dJ/ds")
    assert np.max(np.abs(grad)) > 1e-3  # not a vacuous zero


def test_torch_peer_matches_the_analytic_gradient(rng):
    """The PyTorch peer (autograd through softplus, the cumulative support, the clip and the scattered
    projection) against the float64 analytic J and ∂J/∂s, on a moved and on the uniform support, with done rows."""
    pytest.importorskip("torch")
    from numbarl.rl.torch_peer import atom_entropy_and_grad

    x = _inputs(rng, 6)
    probs, _ = _at_best(x)
    for s in (_moved_spacing(rng), np.full(N_ATOMS - 1, atoms.SPACING_INIT)):
        args = (V_MIN, V_MAX, x["rewards"], x["dones"], x["discounts"], probs)
        j, _, grad = atoms.support_entropy_grad_ref(s, *args)
        j_peer, grad_peer = atom_entropy_and_grad(s, *args)
        assert j_peer == pytest.approx(j, rel=1e-12)
        _close(grad_peer, grad, 1e-12, 1e-9, "peer dJ/ds")
        assert np.max(np.abs(grad)) > 1e-3


def test_ascent_step_hand_computed():
    s = np.array([0.1, -0.2, 0.3])
    g = np.array([0.5, -1.0, 2.0])
    np.testing.assert_allclose(atoms.spacing_step_ref(s, g, 1e-3), [0.1005, -0.201, 0.302], atol=1e-15)


@pytest.mark.parametrize("moved", [False, True])
def test_device_step_matches_reference(rng, moved):
    """The loss on a (moved or uniform) support, then AdaptiveAtoms.step past its warm-up: J, ∂J/∂z,
    the new spacings and the new support against the float64 reference; before the warm-up ends
    nothing moves."""
    batch = 5
    x = _inputs(rng, batch)
    s0 = _moved_spacing(rng) if moved else np.full(N_ATOMS - 1, atoms.SPACING_INIT)
    z = atoms.support_from_spacing_ref(s0, V_MIN, V_MAX).astype(np.float32)
    lr = 0.1
    state = atoms.AdaptiveAtoms(batch, len(SIZES), N_ATOMS, lr=lr, warmup=2)
    state.arena.load({"spacing_raw": s0, "support_mode": np.array([int(moved)], np.int32)})
    loss = C51Loss(batch, SIZES, N_ATOMS, V_MIN, V_MAX, adaptive_support=True)
    support = _dev(z)
    loss.bind_support(support, state.support_mode)
    st = stream()
    _call(loss, x, st)
    d = {k: _dev(v) for k, v in x.items()}
    stats = _dev(np.zeros(2, np.float32))
    train_step = _dev(np.array([2], np.int64))
    rng_range = _dev(np.array([V_MIN, V_MAX]))

    def step():
        state.step(loss, d["rewards"], d["dones"], d["discounts"], d["actions"], d["target_probs"], support, rng_range,
                   train_step, stats, 0, 1, st)
        st.synchronize()

    step()  # train step 2 = warm-up: J only
    assert np.array_equal(state.spacing_raw.copy_to_host(), s0) and np.array_equal(support.copy_to_host(), z)
    sp0 = atoms.softplus_ref(s0)
    assert stats.copy_to_host()[1] == pytest.approx(sp0.max() / sp0.min(), rel=1e-6)  # 1 exactly when uniform
    train_step.copy_to_device(np.array([3], np.int64))
    step()
    probs, _ = _at_best(x)
    j, dz, ds = atoms.support_entropy_grad_ref(s0, V_MIN, V_MAX, x["rewards"], x["dones"], x["discounts"], probs)
    try:  # the PyTorch peer (optional: torch is a test extra) gives the same J and step, autograd's
        from numbarl.rl.torch_peer import atom_entropy_and_grad

        j_peer, ds_peer = atom_entropy_and_grad(s0, V_MIN, V_MAX, x["rewards"], x["dones"], x["discounts"], probs)
    except ImportError:
        j_peer, ds_peer = j, ds
    got_stats = stats.copy_to_host()
    assert got_stats[0] == pytest.approx(j_peer, rel=1e-5)
    got_ds = (state.spacing_raw.copy_to_host() - s0) / lr  # the device's ∂J/∂s, from its step
    np.testing.assert_allclose(got_ds, ds_peer, atol=1e-6 + 1e-4 * np.max(np.abs(ds_peer)))
    assert got_stats[0] == pytest.approx(j, rel=1e-5)
    np.testing.assert_allclose(state.arena["dj_dz"].copy_to_host(), dz, atol=1e-6 + 1e-4 * np.max(np.abs(dz)))
    s1 = atoms.spacing_step_ref(s0, ds, lr)
    np.testing.assert_allclose(state.spacing_raw.copy_to_host(), s1, atol=1e-7 + 1e-4 * np.max(np.abs(s1 - s0)))
    np.testing.assert_allclose(support.copy_to_host(), atoms.support_from_spacing_ref(s1, V_MIN, V_MAX), atol=2e-6)
    assert state.support_mode.copy_to_host()[0] == 1
    sp = atoms.softplus_ref(state.spacing_raw.copy_to_host())
    assert got_stats[1] == pytest.approx(sp.max() / sp.min(), rel=1e-6) and got_stats[1] > 1.0


# ---------------------------------------------------------------------------------------------
# the agent
# ---------------------------------------------------------------------------------------------
CFG = AgentConfig(trunk=(8,), n_atoms=N_ATOMS, batch_size=4, replay_capacity=40, n_step=2, gamma=0.9,
                  v_min=V_MIN, v_max=V_MAX, target_period=2)


def test_config_rejects_bad_values():
    with pytest.raises(ConfigError, match="adaptive_atoms needs agent.n_atoms >= 3"):
        replace(CFG, adaptive_atoms=True, n_atoms=2).validate()
    with pytest.raises(ConfigError, match="adaptive_atoms_lr"):
        replace(CFG, adaptive_atoms=True, adaptive_atoms_lr=0.0).validate()


def test_agent_warmup_is_bitwise_the_plain_agent_then_the_atoms_move_and_round_trip(rng):
    """Warm-up: the adaptive agent's steps give the plain agent's bits. After it: support_entropy_J
    finite, atom_spacing_ratio above 1, the head's support moved (ends fixed); a checkpoint carries
    spacing_raw, the flag and the live support, and the agent loading it takes the same next step."""
    on = replace(CFG, adaptive_atoms=True, adaptive_atoms_warmup=2, adaptive_atoms_lr=0.5)
    plain, adaptive = DQNAgent(CFG, 5, SIZES, 4, seed=1), DQNAgent(on, 5, SIZES, 4, seed=1)
    fill_replay(plain, np.random.default_rng(7))
    fill_replay(adaptive, np.random.default_rng(7))
    s = stream()
    for _ in range(2):
        plain.train_step(s)
        adaptive.train_step(s)
    s.synchronize()
    mine = {k: v for k, v in adaptive.state_arrays().items() if not k.startswith("atoms/") and k != "agent/stats"}
    assert_bitwise({k: v for k, v in plain.state_arrays().items() if k != "agent/stats"}, mine)
    stats = adaptive.read_stats(s)
    assert stats["atom_spacing_ratio"] == 1.0 and np.isfinite(stats["support_entropy_J"])
    adaptive.train_step(s)  # train step 3: the first spacing step
    stats = adaptive.read_stats(s)
    z = adaptive.head.support.copy_to_host()
    assert np.isfinite(stats["support_entropy_J"]) and stats["support_entropy_J"] > 0
    assert stats["atom_spacing_ratio"] > 1.0
    assert z[0] == V_MIN and z[-1] == V_MAX and not np.array_equal(z, plain.head.support.copy_to_host())
    assert adaptive.loss.support is adaptive.head.support  # one live support: the projection reads the head's
    saved = adaptive.state_arrays()
    assert {"atoms/spacing_raw", "atoms/support_mode", "atoms/support"} <= set(saved)
    other = DQNAgent(on, 5, SIZES, 4, seed=1)
    other.load_state(saved)
    assert np.array_equal(other.atoms.spacing_raw.copy_to_host(), saved["atoms/spacing_raw"])
    assert np.array_equal(other.head.support.copy_to_host(), z)
    # the policy alone (what the test backtest and numbarl-backtest load from a checkpoint) carries
    # the moved support too: Q of a scoring pass is the trained agent's
    policy = DQNAgent(on, 5, SIZES, 4, seed=1)
    policy.load_params({k: v for k, v in saved.items() if k.startswith(adaptive.policy_prefixes)})
    assert np.array_equal(policy.head.support.copy_to_host(), z)
    adaptive.train_step(s)
    other.train_step(s)
    s.synchronize()
    assert_bitwise({k: v for k, v in adaptive.state_arrays().items() if k != "agent/stats"},
                   {k: v for k, v in other.state_arrays().items() if k != "agent/stats"})


def test_every_consumer_reads_the_live_support(rng):
    """With multi-horizon C51 and CQL on: after the atoms moved, every horizon's loss projects onto
    the head's support, the CQL term's copy equals it, and Q = Σ_i softmax(logits)_i z_i of a pass
    run now uses the moved z."""
    on = replace(CFG, adaptive_atoms=True, adaptive_atoms_warmup=0, adaptive_atoms_lr=0.5, horizons="1,2",
                 horizon_regime_col=0, cql_alpha=0.5, aux_frequency=1)
    agent = DQNAgent(on, 5, SIZES, 4, seed=1)
    fill_replay(agent, rng)
    s = stream()
    agent.train_step(s)
    s.synchronize()
    z = agent.head.support.copy_to_host()
    assert not np.allclose(np.diff(z), np.diff(z)[0], rtol=1e-4)  # moved
    assert all(loss.support is agent.head.support for loss in agent.mh.losses)
    assert np.array_equal(agent.cql.arena["support"].copy_to_host(), z)
    out = agent.forward(agent.replay.batch.obs, s, tag="online")
    s.synchronize()
    logits, q = out.logits.copy_to_host(), out.q.copy_to_host()
    for k, n in enumerate(SIZES):  # the padding actions of the shorter branch hold no distribution
        x = logits[:, k, :n].astype(np.float64)
        p = np.exp(x - x.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        _close(q[:, k, :n], p @ z.astype(np.float64), 1e-5, 1e-4, f"Q of branch {k}")
