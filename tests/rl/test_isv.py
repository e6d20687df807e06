"""ISV signals and ISV temporal routing (agent.isv, agent.isv_routing; numbarl/rl/isv.py): the update kernel
against its float64 recursion over hand-made stats (non-finite inputs included), the routing kernels against
their float64 forward/backward and finite differences, the PyTorch peer, a tiny agent whose ISV is non-zero
after a few train steps (the origin's bug: its ISV stayed at zero because the update never ran), checkpoints,
the config's checks. GPU: tests/rl/test_gpu_isv.py; liveness: tests/rl/test_components.py (isv: polyak run,
isv_routing: cvar run)."""

from dataclasses import replace

import numpy as np
import pytest
from agent_helpers import build_module, fill_replay

from numbarl.config import AgentConfig, ConfigError
from numbarl.cuda.registry import StatsLayout
from numbarl.cuda.runtime import cuda, stream
from numbarl.cuda.testing import assert_close
from numbarl.rl import isv as isv_mod
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.isv import (
    ISV_NAMES,
    N_INPUTS,
    N_ISV,
    Isv,
    IsvRoute,
    isv_update_ref,
    route_backward_ref,
    route_forward_ref,
)

dev = cuda().to_device
SLOTS = (0, 1, 2, 3, 4)  # loss, grad norm, Q, Q next, clip scale in the hand-made stats


# ---------------------------------------------------------------------------------------------
# T5: the update
# ---------------------------------------------------------------------------------------------
def _hand_stats():
    """Thirteen steps of (loss, grad norm, Q, Q next, clip scale), with a NaN loss, an inf grad norm, a NaN
    Q next and a NaN clip scale on their own steps, the clip scaling on some steps, and a skipped step."""
    rows = [(3.9, 2.0, 0.10, 0.30, 1.0), (3.7, 1.5, 0.12, 0.35, 0.5), (np.nan, 1.2, 0.15, 0.33, 1.0),
            (3.5, np.inf, 0.11, 0.31, 1.0), (3.4, 1.1, 0.20, np.nan, 0.2), (3.3, 0.9, -0.05, 0.25, np.nan),
            (3.6, 1.4, 0.07, 0.22, 1.0), (3.2, 0.8, 0.30, 0.41, 0.9), (3.1, 5.0, 0.25, 0.44, 1.0),
            (3.0, 0.7, 0.28, 0.47, 1.0), (2.9, 0.6, 0.31, 0.49, 0.3), (2.8, 0.5, 0.33, 0.52, 1.0),
            (2.85, np.inf, 0.3, 0.5, 0.0)]  # a skipped step: the optimizer writes clip scale 0 (not a clip)
    return np.array(rows, np.float64)


def test_reference_hand_case():
    """Two finite steps by hand: the first sets every EMA to its input, the second moves it by 1 − β."""
    v, n = isv_update_ref(np.zeros(N_ISV), np.zeros(N_INPUTS, np.int64), 4.0, 2.0, 0.5, 0.7, 0.5)
    assert v[0] == v[1] == 4.0 and v[2] == v[3] == 2.0 and v[4] == v[5] == 0.5 and v[6] == 0.0
    assert v[7] == 1.0 and v[8] == pytest.approx(0.2) and v[9] == 1.0 and v[10] == 0.0 and v[11] == 1.0
    v, n = isv_update_ref(v, n, 2.0, 2.0, 1.5, 1.5, 1.0)
    assert v[0] == pytest.approx(0.9 * 4 + 0.1 * 2) and v[1] == pytest.approx(0.99 * 4 + 0.01 * 2)
    assert v[6] == pytest.approx((0.9 * 0.5 + 0.1 * 1.5) - (0.99 * 0.5 + 0.01 * 1.5))
    assert v[7] == pytest.approx(0.99) and v[8] == pytest.approx(0.9 * 0.2)
    assert v[11] == pytest.approx(1 - abs(3.8 - 3.98) / (3.98 + 1e-6))
    assert list(n) == [2, 2, 2, 2, 2, 2]


def test_kernel_matches_the_float64_recursion_over_steps():
    """Twelve steps of hand-made stats through the one-thread kernel vs isv_update_ref step by step; a
    non-finite input skips its EMAs (the state stays finite) and raises nonfinite_frac; the stats slots
    hold the vector."""
    layout = StatsLayout("isv test")
    for i, name in enumerate(("loss", "grad_norm", "q_mean", "q_next_max", "clip_scale")):
        layout.slot(name, i)
    isv = Isv(layout)
    assert layout["isv_loss_fast"].index == isv.first_slot
    stats = np.zeros(layout.size, np.float32)
    s = stream()
    v, n = np.zeros(N_ISV), np.zeros(N_INPUTS, np.int64)
    for row in _hand_stats():
        stats[:5] = row
        d_stats = dev(stats)
        isv.update(d_stats, SLOTS, s)
        s.synchronize()
        v, n = isv_update_ref(v, n, *row)
        got = isv.vector.copy_to_host()
        assert np.all(np.isfinite(got))
        assert_close(got, v, 1e-6, 1e-5)
        np.testing.assert_array_equal(isv.state["updates"].copy_to_host(), n)
        np.testing.assert_array_equal(d_stats.copy_to_host()[isv.first_slot:isv.first_slot + N_ISV], got)
    # one NaN loss, two inf grad norms (a clip is counted only with a finite G), one NaN clip, one NaN Qn
    assert list(n) == [12, 11, 13, 10, 12, 13]
    assert 0.0 < v[isv_mod.ISV_NONFINITE_FRAC] < 0.1 and 0.0 < v[isv_mod.ISV_CLIP_FRAC] < 1.0


# ---------------------------------------------------------------------------------------------
# T6: the routing
# ---------------------------------------------------------------------------------------------
B, F, K = 5, 7, 3  # odd shapes: rows, features, window length


def _route(rng, tags=(("online", True),)):
    route, store, _, _ = build_module(IsvRoute("temporal.route", F), rng, B, tags=tags)
    # non-zero routing parameters (the init is w = 0.5 everywhere)
    params = {"temporal.route.w_r": rng.normal(0, 0.3, (N_ISV, F)).astype(np.float32),
              "temporal.route.b_r": rng.normal(0, 0.5, F).astype(np.float32)}
    store.load(params)
    isv = rng.normal(0, 1, N_ISV).astype(np.float32)
    d_isv = dev(isv)
    route.bind_isv(d_isv)
    return route, store, {k: v.astype(np.float64) for k, v in params.items()}, isv


def test_route_init_is_one_half(rng):
    _, _, values, _ = build_module(IsvRoute("temporal.route", F), rng, B)
    assert not np.any(values["temporal.route.w_r"]) and not np.any(values["temporal.route.b_r"])
    _, w = route_forward_ref(np.ones((B, F)), np.zeros((B, F)), rng.normal(size=N_ISV), values["temporal.route.w_r"],
                             values["temporal.route.b_r"])
    np.testing.assert_array_equal(w, 0.5)


def test_route_forward_backward_match_the_reference(rng):
    """h̃, w, the scan's upstream gradient g = w ⊙ dh̃, dW_r and db_r against the float64 reference; a second
    backward in the same step adds its dW_r, db_r (the gradient rule)."""
    route, store, params, isv = _route(rng)
    u = rng.normal(0, 1, (B, F)).astype(np.float32)
    x = rng.normal(0, 1, (B * K, F)).astype(np.float32)
    dh = rng.normal(0, 1, (B, F)).astype(np.float32)
    s = stream()
    h = route.route(dev(u), dev(x), K, s)
    s.synchronize()
    h_ref, cache = route.forward_ref(u, x[K - 1::K], isv, params)
    assert_close(h.copy_to_host(), h_ref, 1e-6, 1e-5)
    assert_close(route._arena("online")["temporal.route.online.w"].copy_to_host(), cache[2], 1e-7, 1e-6)
    store.begin_step()
    g = route.backward(dev(dh), s)
    s.synchronize()
    g_ref, grads_ref = route.backward_ref(dh, cache, params)
    assert_close(g.copy_to_host(), g_ref, 1e-6, 1e-5)
    grads = store.to_host("grads")
    for name, want in grads_ref.items():
        assert_close(grads[name], want, 1e-6, 1e-5)
        assert np.any(want != 0)
    route.backward(dev(dh), s)  # second write of the step: adds
    s.synchronize()
    store.end_step()
    grads = store.to_host("grads")
    for name, want in grads_ref.items():
        assert_close(grads[name], 2 * want, 1e-6, 1e-5)


def test_route_reference_finite_differences(rng):
    """L = Σ c ⊙ h̃(u, W_r, b_r): the reference's g (∂L/∂u), dW_r, db_r against central differences."""
    u, x_last = rng.normal(size=(B, F)), rng.normal(size=(B, F))
    isv, w_r, b_r = rng.normal(size=N_ISV), rng.normal(0, 0.3, (N_ISV, F)), rng.normal(0, 0.5, F)
    c = rng.normal(size=(B, F))

    def loss(u_, w_r_, b_r_):
        return float(np.sum(c * route_forward_ref(u_, x_last, isv, w_r_, b_r_)[0]))

    _, w = route_forward_ref(u, x_last, isv, w_r, b_r)
    g, d_w_r, d_b_r = route_backward_ref(c, u, isv, w)
    eps = 1e-6
    for arr, grad, f in ((u, g, lambda a: loss(a, w_r, b_r)), (w_r, d_w_r, lambda a: loss(u, a, b_r)),
                         (b_r, d_b_r, lambda a: loss(u, w_r, a))):
        num = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            p, m = arr.copy(), arr.copy()
            p[idx] += eps
            m[idx] -= eps
            num[idx] = (f(p) - f(m)) / (2 * eps)
        assert_close(grad, num, 1e-7, 1e-6)


def test_route_matches_the_pytorch_peer(rng):
    """The kernels against autograd on the same weights (numbarl/rl/torch_peer_isv.py)."""
    pytest.importorskip("torch")
    from numbarl.rl.torch_peer_isv import route_forward_backward

    route, store, params, isv = _route(rng)
    u = rng.normal(0, 1, (B, F)).astype(np.float32)
    x = rng.normal(0, 1, (B * K, F)).astype(np.float32)
    dh = rng.normal(0, 1, (B, F)).astype(np.float32)
    s = stream()
    h = route.route(dev(u), dev(x), K, s)
    g = route.backward(dev(dh), s)
    s.synchronize()
    peer = route_forward_backward(params, u, x[K - 1::K], isv, dh)
    assert_close(h.copy_to_host(), peer["out"], 1e-6, 1e-5)
    assert_close(g.copy_to_host(), peer["du"], 1e-6, 1e-5)
    grads = store.to_host("grads")
    for name, want in peer["grads"].items():
        assert_close(grads[name], want, 1e-6, 1e-5)


# ---------------------------------------------------------------------------------------------
# the agent
# ---------------------------------------------------------------------------------------------
SIZES = (3, 3, 4, 4)
STATE_DIM, N_ENVS, KT, P = 6, 2, 2, 2
CFG = AgentConfig(trunk=(8,), n_atoms=5, batch_size=3, replay_capacity=10 * N_ENVS, n_step=2, gamma=0.9,
                  target_update="polyak", isv=True)


def _agent(seed=1, **kw):
    return DQNAgent(replace(CFG, **kw), STATE_DIM, SIZES, N_ENVS, seed=seed, eval_batch=P)


def test_isv_is_nonzero_after_train_steps_and_matches_the_stats(rng):
    """The origin's bug: its ISV stayed at zero because the update never ran. Three train steps: the vector
    is the recursion of the three steps' logged stats, non-zero, and logged as isv_<name>; the step's last
    phase is the update."""
    agent = _agent()
    assert agent.train_phases()[-1][0] == "isv"
    fill_replay(agent, rng)
    s = stream()
    v, n = np.zeros(N_ISV), np.zeros(N_INPUTS, np.int64)
    for _ in range(3):
        agent.train_step(s)
        st = agent.read_stats(s)
        v, n = isv_update_ref(v, n, st["loss"], st["grad_norm"], st["q_mean"], st["q_next_max"], st["clip_scale"])
    got = agent.isv.vector.copy_to_host()
    assert_close(got, v, 1e-6, 1e-5)
    assert got[isv_mod.ISV_LOSS_FAST] > 0 and got[isv_mod.ISV_GRAD_FAST] > 0 and np.count_nonzero(got) >= 6
    assert [st[f"isv_{name}"] for name in ISV_NAMES] == list(got)


def test_checkpoint_round_trip(rng):
    """state_arrays → load_state into a fresh agent: the same ISV; the policy arrays carry it (the routing
    of a backtest of a checkpoint reads it); the next train step continues the recursion identically."""
    agent = _agent()
    fill_replay(agent, rng)
    s = stream()
    for _ in range(2):
        agent.train_step(s)
    s.synchronize()
    arrays = agent.state_arrays()
    assert np.any(arrays["isv/vector"]) and arrays["isv/updates"][0] == 2
    other = _agent(seed=1)
    other.load_state(arrays)
    np.testing.assert_array_equal(other.isv.vector.copy_to_host(), arrays["isv/vector"])
    np.testing.assert_array_equal(other.isv.state["updates"].copy_to_host(), arrays["isv/updates"])
    assert "isv/" in DQNAgent.policy_prefixes
    policy = _agent(seed=2)
    policy.load_params({k: v for k, v in arrays.items() if k.startswith(DQNAgent.policy_prefixes)})
    np.testing.assert_array_equal(policy.isv.vector.copy_to_host(), arrays["isv/vector"])
    agent.train_step(s)
    other.train_step(s)
    s.synchronize()
    np.testing.assert_array_equal(other.isv.vector.copy_to_host(), agent.isv.vector.copy_to_host())


def test_routing_agent_matches_the_float64_reference(rng):
    """agent.isv_routing (temporal input, K = 2; ISV built without agent.isv): step 1 routes with isv = 0 (w = 0.5)
    and updates the ISV; on step 2 (non-zero isv) the trunk's input on the online pass is the reference
    x_t + w ⊙ u on the scan's reference, and given the trunk's input gradient dh̃ every gradient is the float64
    reference's: the scan's upstream g = w ⊙ dh̃, dW_r, db_r and the scan's own (BPTT on g)."""
    agent = _agent(isv=False, isv_routing=True, temporal="mamba", temporal_steps=KT, temporal_heads=2)
    assert agent.isv is not None and agent.temporal.route is not None and not agent.temporal.scan.residual
    assert agent.optim.group_values()["temporal.route"] == pytest.approx(CFG.temporal_lr)
    fill_replay(agent, rng, done_rate=0.25, count=13)
    F_obs = STATE_DIM  # routing parameters away from their init (w = 0.5), so that w depends on the isv
    agent.store.load({"temporal.route.w_r": rng.normal(0, 0.3, (N_ISV, F_obs)).astype(np.float32),
                      "temporal.route.b_r": rng.normal(0, 0.5, F_obs).astype(np.float32)})
    s = stream()
    agent.train_step(s)
    isv = agent.isv.vector.copy_to_host()
    assert np.any(isv)
    params = {k: v.astype(np.float64) for k, v in agent.store.to_host("params").items()}  # step 2's passes read these
    agent.train_step(s)
    s.synchronize()
    temporal, route = agent.temporal, agent.temporal.route
    window, mask = temporal.state["obs.x"].copy_to_host(), temporal.state["obs.mask"].copy_to_host()
    h_ref, (scan_cache, route_cache) = temporal.forward_ref(window, mask, params, isv=isv)
    assert_close(temporal.output("online").copy_to_host(), h_ref, 1e-6, 1e-5)
    assert np.all(np.abs(route_cache[2] - 0.5) > 1e-3)
    dh = agent.acts["trunk.fc0.online.dx"].copy_to_host()
    g_ref, want = route.backward_ref(dh, route_cache, params)
    assert_close(agent.acts["temporal.route.online.g"].copy_to_host(), g_ref, 1e-6, 1e-5)
    _, scan_grads = temporal.scan.backward_ref(g_ref, scan_cache, params)
    want.update(scan_grads)
    grads = agent.store.to_host("grads")
    assert set(want) == {n for n in grads if n.startswith("temporal.")}
    for name, ref in want.items():
        assert np.any(ref != 0), name
        assert_close(grads[name], ref, 1e-6, 1e-4)


def test_default_agent_builds_no_isv():
    agent = _agent(isv=False)
    assert agent.isv is None and "isv" not in [n for n, _ in agent.train_phases()]
    assert not any(k.startswith("isv") for k in agent.stats_layout.slots)


def test_config_checks():
    with pytest.raises(ConfigError, match="agent.isv_routing.*agent.temporal"):
        AgentConfig(isv_routing=True).validate()
    AgentConfig(isv_routing=True, temporal="mamba").validate()
    with pytest.raises(ConfigError, match="agent.isv"):
        AgentConfig(kind="ppo", isv=True).validate()
    with pytest.raises(ConfigError, match="agent.isv_routing_lr = -0.5 is out of range"):
        AgentConfig(isv_routing=True, temporal="mamba", isv_routing_lr=-0.5).validate()
    AgentConfig(isv_routing=True, temporal="mamba", isv_routing_lr=0.0).validate()


def test_fixed_mixing_baseline_and_routing_checkpoint(rng):
    """agent.isv_routing_lr = 0: W_r and b_r stay at zero through train steps (w = 0.5, the A/B's fixed
    mixing) while the scan learns. A routing agent's checkpoint restores the routed output bit for bit in
    a fresh agent (parameters, target copies, isv); a policy without isv/vector is refused."""
    kw = {"isv": False, "isv_routing": True, "temporal": "mamba", "temporal_steps": KT, "temporal_heads": 2}
    fixed = _agent(isv_routing_lr=0.0, **kw)
    assert fixed.optim.group_values()["temporal.route"] == 0.0
    fill_replay(fixed, rng, done_rate=0.25, count=13)
    s = stream()
    scan_before = fixed.store.to_host()["temporal.mamba.w_in"].copy()
    for _ in range(2):
        fixed.train_step(s)
    s.synchronize()
    params = fixed.store.to_host()
    assert not np.any(params["temporal.route.w_r"]) and not np.any(params["temporal.route.b_r"])
    assert np.any(fixed.store.to_host("grads")["temporal.route.b_r"])  # gradients flow, the step is 0
    assert not np.array_equal(params["temporal.mamba.w_in"], scan_before)

    agent = _agent(**kw)
    fill_replay(agent, rng, done_rate=0.25, count=13)
    for _ in range(2):
        agent.train_step(s)
    s.synchronize()
    arrays = agent.state_arrays()
    other = _agent(seed=3, **kw)
    other.load_state(arrays)
    policy = {k: v for k, v in arrays.items() if k.startswith(DQNAgent.policy_prefixes)}
    obs = rng.standard_normal((P, STATE_DIM)).astype(np.float32)
    scores = []
    for a in (agent, other):
        a.reset_eval(s)
        q = dev(np.zeros((P, len(SIZES), max(SIZES)), np.float32))
        a.scores(dev(obs), q, s)
        scores.append(q.copy_to_host())
    s.synchronize()
    np.testing.assert_array_equal(scores[0], scores[1])
    with pytest.raises(ValueError, match="no isv/vector"):
        _agent(seed=4, **kw).load_params({k: v for k, v in policy.items() if not k.startswith("isv/")})
