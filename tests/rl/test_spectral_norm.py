"""Spectral normalization (agent.spectral_norm, numbarl/rl/nets/spectral_norm.py): the float64 reference
against finite differences, the kernels against the reference, the power iteration against numpy's SVD,
a Linear layer reading W_sn through the store's substitutes (device vs reference, and against PyTorch's
spectral_norm with the same vectors), the checkpoint round trip of u and v, and an agent's train step."""

import numpy as np
import pytest

from numbarl.config import AgentConfig
from numbarl.cuda.runtime import Arena, cuda, stream
from numbarl.rl.nets.base import ParamStore
from numbarl.rl.nets.linear import Linear
from numbarl.rl.nets.spectral_norm import (
    SN_BLOCK,
    SpectralNorm,
    power_iteration_kernel,
    power_iteration_ref,
    resolve_layers,
    spectral_backward_ref,
    spectral_forward_ref,
)

_cuda = cuda()


def _unit(rng, n):
    x = rng.standard_normal(n)
    return x / np.linalg.norm(x)


def test_reference_backward_matches_finite_differences(rng):
    """L = Σ dy ⊙ (x·W_sn(W) + b) with σ = uᵀ Wᵀ v (u, v constants): ∂L/∂W by central differences."""
    x, w, dy = rng.standard_normal((6, 5)), rng.standard_normal((5, 4)), rng.standard_normal((6, 4))
    u, v, _ = power_iteration_ref(w, _unit(rng, 4), _unit(rng, 5), 3)

    def loss(w_):
        return float(np.sum(dy * (x @ spectral_forward_ref(w_, u, v)[0])))

    g_sn = x.T @ dy
    got = spectral_backward_ref(g_sn, w, u, v)
    fd = np.zeros_like(w)
    h = 1e-6
    for idx in np.ndindex(w.shape):
        wp, wm = w.copy(), w.copy()
        wp[idx] += h
        wm[idx] -= h
        fd[idx] = (loss(wp) - loss(wm)) / (2 * h)
    np.testing.assert_allclose(got, fd, rtol=1e-6, atol=1e-8)
    # Eq. 12's λ is ⟨G, W_sn⟩: the uᵀGv form is a different (wrong) gradient for a full-rank W
    _, sigma = spectral_forward_ref(w, u, v)
    wrong = (g_sn - float(u @ g_sn.T @ v) * np.outer(v, u)) / sigma
    assert np.max(np.abs(wrong - fd)) > 1e-3


def test_hand_computed_rank_one():
    """W = 3·a bᵀ (a, b unit): σ = 3 for u = b, v = a; W_sn = a bᵀ."""
    a, b = np.array([0.6, 0.8]), np.array([0.0, 1.0, 0.0])
    w = 3.0 * np.outer(a, b)
    u, v, sigma = power_iteration_ref(w, np.array([0.5, 0.5, 0.5]) / np.sqrt(0.75), np.array([1.0, 0.0]), 1)
    np.testing.assert_allclose(u, b, atol=1e-12)
    np.testing.assert_allclose(v, a, atol=1e-12)
    assert sigma == pytest.approx(3.0)
    np.testing.assert_allclose(spectral_forward_ref(w, u, v)[0], np.outer(a, b), atol=1e-12)


def _run_power(w, u, v, n_iter):
    arena = Arena("sn-test")
    arena.add("w", w.shape)
    arena.add("u", u.shape)
    arena.add("v", v.shape)
    arena.add("t", u.shape)
    arena.add("sigma", (1,))
    arena.add("stats", (4,))
    arena.allocate()
    arena.load({"w": w.astype(np.float32), "u": u.astype(np.float32), "v": v.astype(np.float32)})
    s = stream()
    power_iteration_kernel[1, SN_BLOCK, s](arena["w"], arena["u"], arena["v"], arena["t"], arena["sigma"],
                                           np.int64(n_iter), arena["stats"], np.int64(2))
    s.synchronize()
    out = arena.to_host()
    assert out["stats"][2] == out["sigma"][0]
    return out["u"], out["v"], float(out["sigma"][0])


@pytest.mark.parametrize("n_iter", [0, 1, 2])
def test_power_iteration_kernel_matches_reference(rng, n_iter):
    """Shapes not multiples of the block (11 × 3 under an 8-thread simulated block)."""
    w = rng.standard_normal((11, 3)).astype(np.float32)
    u0, v0 = _unit(rng, 3).astype(np.float32), _unit(rng, 11).astype(np.float32)
    u, v, sigma = _run_power(w, u0, v0, n_iter)
    ru, rv, rs = power_iteration_ref(w, u0, v0, n_iter)
    np.testing.assert_allclose(u, ru, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(v, rv, rtol=1e-5, atol=1e-6)
    assert sigma == pytest.approx(rs, rel=1e-5)


def test_power_iteration_converges_to_the_largest_singular_value(rng):
    q1, _ = np.linalg.qr(rng.standard_normal((7, 7)))
    q2, _ = np.linalg.qr(rng.standard_normal((5, 5)))
    w = (q1[:, :5] * np.array([3.0, 1.5, 1.0, 0.5, 0.2])) @ q2.T
    _, v, sigma = _run_power(w, _unit(rng, 5), _unit(rng, 7), 50)
    top = np.linalg.svd(w, compute_uv=False)[0]
    assert sigma == pytest.approx(top, rel=1e-5)
    assert abs(float(v @ np.linalg.svd(w)[0][:, 0])) == pytest.approx(1.0, abs=1e-5)


def _linear_sn(rng, activation=None, seed=5):
    fc = Linear("fc", 5, 4, activation, input_grad=True)
    store = ParamStore()
    fc.declare_params(store)
    store.allocate()
    store.init(rng)
    sn = SpectralNorm(store, "fc", seed)
    acts = Arena("acts")
    fc.declare_acts(acts, 7, "online")
    acts.allocate()
    return fc, store, sn


def test_linear_reads_w_sn_device_vs_reference(rng):
    fc, store, sn = _linear_sn(rng, "relu")
    params = {n: v.astype(np.float64) for n, v in store.to_host().items()}
    state = sn.arena.to_host()
    u, v = state["fc.u"].astype(np.float64), state["fc.v"].astype(np.float64)
    w_sn, sigma = spectral_forward_ref(params["fc.w"], u, v)
    assert state["fc.sigma"][0] == pytest.approx(sigma, rel=1e-5)
    np.testing.assert_allclose(state["fc.w_sn"], w_sn, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(state["fc.w_sn_target"], state["fc.w_sn"])  # target = online at the start
    x = rng.standard_normal((7, 5)).astype(np.float32)
    dy = rng.standard_normal((7, 4)).astype(np.float32)
    s = stream()
    y = fc.forward(_cuda.to_device(x), s)
    dx = fc.backward(_cuda.to_device(dy), s)
    sn.transform_grads(s)
    ref_y, cache = fc.forward_ref(x, {**params, "fc.w": w_sn})
    ref_dx, ref_g = fc.backward_ref(dy, cache, {**params, "fc.w": w_sn})
    np.testing.assert_allclose(y.copy_to_host(), ref_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx.copy_to_host(), ref_dx, rtol=1e-5, atol=1e-6)
    grads = store.to_host("grads")
    np.testing.assert_allclose(grads["fc.b"], ref_g["fc.b"], rtol=1e-5, atol=1e-6)
    ref_dw = spectral_backward_ref(ref_g["fc.w"], params["fc.w"], u, v)
    np.testing.assert_allclose(grads["fc.w"], ref_dw, rtol=1e-4, atol=1e-5)


def test_matches_pytorch_spectral_norm(rng):
    """One power iteration, the forward and the weight gradient against torch's parametrization with
    the same u, v (relative 1e-5)."""
    pytest.importorskip("torch")
    from numbarl.rl.torch_peer import spectral_linear_peer

    fc, store, sn = _linear_sn(rng)
    params = store.to_host()
    u0, v0 = _unit(rng, 4).astype(np.float32), _unit(rng, 5).astype(np.float32)
    sn.arena.load({"fc.u": u0, "fc.v": v0})
    x = rng.standard_normal((7, 5)).astype(np.float32)
    dy = rng.standard_normal((7, 4)).astype(np.float32)
    s = stream()
    sn.refresh(s, n_iter=1)  # the iteration PyTorch's training-mode forward runs first
    y = fc.forward(_cuda.to_device(x), s)
    fc.backward(_cuda.to_device(dy), s)
    sn.transform_grads(s)
    s.synchronize()
    peer = spectral_linear_peer(x, params["fc.w"], params["fc.b"], u0, v0, dy)
    state, grads = sn.arena.to_host(), store.to_host("grads")

    def rel(a, b):
        return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))

    assert rel(state["fc.u"], peer["u"]) < 1e-5 and rel(state["fc.v"], peer["v"]) < 1e-5
    assert state["fc.sigma"][0] == pytest.approx(peer["sigma"], rel=1e-5)
    assert rel(y.copy_to_host(), peer["y"]) < 1e-5
    assert rel(grads["fc.w"], peer["dw"]) < 1e-5
    assert rel(grads["fc.b"], peer["db"]) < 1e-5


def test_layer_names_resolve_and_unknown_ones_are_errors(rng):
    store = ParamStore()
    for lin in (Linear("trunk.fc0", 3, 4), Linear("trunk.fc1", 4, 4), Linear("head.value", 4, 2)):
        lin.declare_params(store)
    assert resolve_layers(store, "trunk.1, head.value") == [("trunk.fc1", "trunk.fc1.w"),
                                                            ("head.value", "head.value.w")]
    with pytest.raises(ValueError, match="no layer 'trunk.7'.*trunk.fc0"):
        resolve_layers(store, "trunk.7")
    with pytest.raises(ValueError, match="named twice"):
        resolve_layers(store, "trunk.fc1,trunk.1")


# -- the agent ----------------------------------------------------------------------------------------
SIZES = (3, 2, 2, 2)
STATE_DIM, N_ENVS = 6, 2
CFG = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=8 * N_ENVS, n_step=1,
                  target_update="periodic", target_period=1, spectral_norm="trunk.0,head.value")


def _agent(seed=1):
    from numbarl.rl.agents.dqn import DQNAgent

    return DQNAgent(CFG, STATE_DIM, SIZES, N_ENVS, seed=seed)


def _fill(agent, rng):
    n_slots = agent.replay.n_slots
    actions = np.stack([rng.integers(0, n, (n_slots, N_ENVS)) for n in SIZES], -1).astype(np.int32)
    mask = np.zeros((n_slots, N_ENVS, len(SIZES), max(SIZES)), np.uint8)
    for k, n in enumerate(SIZES):
        mask[..., k, :n] = 1
    agent.replay.store.load({"obs": rng.normal(0, 1, (n_slots, N_ENVS, STATE_DIM)).astype(np.float32),
                             "action": actions, "reward": rng.standard_normal((n_slots, N_ENVS)).astype(np.float32),
                             "done": np.zeros((n_slots, N_ENVS), np.uint8),
                             "weight": np.ones((n_slots, N_ENVS), np.float32), "mask": mask,
                             "count": np.array([n_slots], np.int64)})


def test_agent_step_iterates_and_checkpoints_round_trip(rng):
    agent = _agent()
    _fill(agent, rng)
    sn = agent.spectral
    assert sn.names == ["trunk.fc0", "head.value"]
    before = sn.arena.to_host()
    names = [n for n, _ in agent.train_phases()]
    assert names.index("spectral_grad") == names.index("update") - 1 and names[-1] == "spectral"
    s = stream()
    agent.train_step(s)
    s.synchronize()
    after = sn.arena.to_host()
    params, target = agent.store.to_host("params"), agent.store.to_host("target")
    stats = agent.read_stats(s)
    for layer in sn.names:
        w = params[f"{layer}.w"]
        # the end-of-step phase: one iteration on the updated W from the previous vectors, W_sn = W / σ
        ru, rv, rs = power_iteration_ref(w, before[f"{layer}.u"], before[f"{layer}.v"], 1)
        np.testing.assert_allclose(after[f"{layer}.u"], ru, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(after[f"{layer}.v"], rv, rtol=1e-4, atol=1e-5)
        assert after[f"{layer}.sigma"][0] == pytest.approx(rs, rel=1e-5)
        assert stats[f"spectral_sigma.{layer}"] == after[f"{layer}.sigma"][0] > 0
        np.testing.assert_array_equal(after[f"{layer}.w_sn"], w / after[f"{layer}.sigma"][0])
        # the target (copied this step) has its own σ from the online vectors
        _, st = spectral_forward_ref(target[f"{layer}.w"], after[f"{layer}.u"], after[f"{layer}.v"])
        assert after[f"{layer}.sigma_target"][0] == pytest.approx(st, rel=1e-5)
    # checkpoint: the vectors travel; a fresh agent (another seed) gets back u, v, σ and W_sn bitwise
    arrays = agent.state_arrays()
    assert {f"spectral/{layer}.{w}" for layer in sn.names for w in ("u", "v", "sigma")} <= set(arrays)
    other = _agent(seed=7)
    assert not np.array_equal(other.spectral.arena.to_host()["trunk.fc0.u"], after["trunk.fc0.u"])
    other.load_state(arrays)
    loaded = other.spectral.arena.to_host()
    for key in ("u", "v", "sigma", "w_sn", "sigma_target", "w_sn_target"):
        for layer in sn.names:
            np.testing.assert_array_equal(loaded[f"{layer}.{key}"], after[f"{layer}.{key}"], err_msg=f"{layer}.{key}")
