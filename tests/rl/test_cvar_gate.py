"""The CVaR entry gate (agent.cvar_alpha, numbarl/rl/cvar_gate.py): CVaR_α by hand (two atoms, a
fractional tail), the kernels against the float64 reference on the mask and on greedy scores (the
head's distribution recomputed from the pass's value / advantage / lse buffers), the readiness budget,
the statistics, and a tiny agent + env run with the gate on (collect mask, replay, backtest)."""

import numpy as np
import pytest

from numbarl.config import AgentConfig
from numbarl.cuda.runtime import Arena, cuda, stream
from numbarl.env.params import DIR_FLAT, DIR_LONG, DIR_SHORT
from numbarl.rl.cvar_gate import (
    CvarGate,
    apply_mask_ref,
    apply_scores_ref,
    budget_ref,
    cvar_ref,
    gate_ref,
)
from numbarl.rl.nets.base import ParamStore
from numbarl.rl.nets.c51_head import BranchedDuelingC51Head

_cuda = cuda()
_LOWEST = np.float32(-3.4028235e38)


def test_cvar_by_hand():
    z = np.array([-1.0, 1.0])
    p = np.array([0.3, 0.7])
    assert cvar_ref(p, z, 0.1) == pytest.approx(-1.0)
    assert cvar_ref(p, z, 0.3) == pytest.approx(-1.0)
    assert cvar_ref(p, z, 0.5) == pytest.approx((0.3 * -1 + 0.2 * 1) / 0.5)  # the boundary atom fractionally
    assert cvar_ref(p, z, 1.0) == pytest.approx(0.4)  # the whole distribution: its mean
    z3, p3 = np.array([-2.0, 0.0, 2.0]), np.array([0.05, 0.15, 0.8])
    assert cvar_ref(p3, z3, 0.1) == pytest.approx((0.05 * -2 + 0.05 * 0) / 0.1)  # = -1
    assert cvar_ref(np.array([0.0, 1.0]), z, 0.1) == pytest.approx(1.0)  # no mass on the lower atom


def test_budget_and_gate_reference():
    assert budget_ref(None) == 1.0
    assert budget_ref(np.array([-1.0, -1.0])) == 0.0  # no IQN step yet: loose
    assert budget_ref(np.array([2.0, 1.0])) == pytest.approx(0.25)  # readiness 1/2
    cvar = np.array([[-3.0, 0.5], [-0.5, -4.5], [-9.0, -9.0]])
    flat = np.array([True, True, False])
    np.testing.assert_array_equal(gate_ref(cvar, flat, 1.0), [[True, False], [False, True], [False, False]])
    np.testing.assert_array_equal(gate_ref(cvar, flat, 1.0, budget=0.25), [[False, False], [False, True],
                                                                           [False, False]])
    np.testing.assert_array_equal(gate_ref(cvar, flat, 1.0, budget=0.0), np.zeros((3, 2), bool))


SIZES = (3, 2, 3)
Z, H, N = 7, 5, 9
POS = 3  # position column of the test observations


# the head's layouts: as it is; padded with the value stream fused into the advantage's GEMM (V then a strided view)
LAYOUTS = [{}, {"pad_to": 8, "fuse_value": True}]


def _head_pass(rng, tag, **layout):
    head = BranchedDuelingC51Head("head", H, SIZES, n_atoms=Z, v_min=-2.0, v_max=2.0, **layout)
    store = ParamStore()
    head.declare_params(store)
    store.allocate()
    store.init(rng)
    acts = Arena("acts")
    head.declare_acts(acts, N, tag, backward=False, outputs=("q",))
    acts.allocate()
    h = rng.standard_normal((N, H)).astype(np.float32) * 2
    s = stream()
    head.forward(_cuda.to_device(h), s, tag=tag)
    params = {k: v.astype(np.float64) for k, v in store.to_host().items()}
    ref, _ = head.forward_ref(h, params)
    return head, ref.probs, s


def _obs(rng):
    obs = rng.standard_normal((N, 5)).astype(np.float32)
    obs[:, POS] = np.where(rng.random(N) < 0.7, 0.0, 0.5).astype(np.float32)
    obs[0, POS] = 0.0
    obs[1, POS] = -0.5
    return obs


def _floor_between(cvar, budget=1.0):
    """A floor that gates some rows and keeps every row away from the threshold (no float32 ties)."""
    vals = np.sort(-budget * cvar.ravel())
    gaps = np.diff(vals)
    k = int(np.argmax(gaps[len(gaps) // 4:])) + len(gaps) // 4
    return float(0.5 * (vals[k] + vals[k + 1]))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("alpha", [0.1, 0.35, 1.0])
def test_mask_kernel_matches_reference(rng, alpha, layout):
    for _ in range(8):  # a draw whose gate blocks some flat entries and not all (the seed is the test id's)
        head, probs, s = _head_pass(rng, "act", **layout)
        support = head.support_host.astype(np.float64)
        cvar = cvar_ref(probs[:, 0, [DIR_SHORT, DIR_LONG]], support, alpha)
        floor = max(_floor_between(cvar), 0.0)
        obs = _obs(rng)
        drawn = gate_ref(cvar, obs[:, POS] == 0, floor)
        if drawn.any() and not drawn.all():
            break
    mask = np.ones((N, len(SIZES), max(SIZES)), np.uint8)
    mask[1, 0, DIR_SHORT] = 0  # an env in a position: the lock (the gate leaves it as it is)
    gate = CvarGate(head, alpha, floor, N, POS)
    d_mask = _cuda.to_device(mask)
    gate.on_mask(_cuda.to_device(obs), d_mask, s, tag="act")
    s.synchronize()
    flat = obs[:, POS] == 0
    gated = gate_ref(cvar, flat, floor)
    assert gated.any() and not gated.all()
    np.testing.assert_allclose(gate.dev["cvar"].copy_to_host(), cvar, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(d_mask.copy_to_host(), apply_mask_ref(mask, gated))
    np.testing.assert_array_equal(gate.dev["blocked"].copy_to_host(), gated.any(axis=1).astype(np.uint8))
    np.testing.assert_array_equal(gate.dev["flat"].copy_to_host(), flat.astype(np.uint8))
    assert d_mask.copy_to_host()[:, 0, DIR_FLAT].all()  # flat is never gated
    # the statistics (one block, fixed order)
    stats = _cuda.to_device(np.zeros(4, np.float32))
    gate.write_stats(stats, (0, 1, 3), s)
    out = stats.copy_to_host()
    assert out[0] == pytest.approx(gated.any(axis=1).sum() / flat.sum())
    assert out[1] == pytest.approx(cvar.mean(), rel=1e-5, abs=1e-6)
    assert out[3] == 1.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scores_kernel_matches_reference(rng, layout):
    head, probs, s = _head_pass(rng, "eval", **layout)
    cvar = cvar_ref(probs[:, 0, [DIR_SHORT, DIR_LONG]], head.support_host, 0.2)
    floor = max(_floor_between(cvar), 0.0)
    obs = _obs(rng)
    q = rng.standard_normal((N, len(SIZES), max(SIZES))).astype(np.float32)
    gate = CvarGate(head, 0.2, floor, N, POS)
    d_q = _cuda.to_device(q)
    gate.on_scores(_cuda.to_device(obs), d_q, s, tag="eval")
    expected = apply_scores_ref(q, gate_ref(cvar, obs[:, POS] == 0, floor))
    np.testing.assert_array_equal(d_q.copy_to_host(), expected)
    assert (expected == _LOWEST).any() and (expected[:, 0, [DIR_SHORT, DIR_LONG]] != _LOWEST).any()


def test_readiness_budget_read_on_the_device(rng):
    head, probs, s = _head_pass(rng, "act")
    cvar = cvar_ref(probs[:, 0, [DIR_SHORT, DIR_LONG]], head.support_host, 0.5)
    state = _cuda.to_device(np.array([2.0, 1.0], np.float64))  # (L_first, L_ema): readiness 1/2, budget 1/4
    floor = max(_floor_between(cvar, 0.25), 0.0)
    gate = CvarGate(head, 0.5, floor, N, POS, readiness_state=state)
    obs = np.zeros((N, 5), np.float32)
    d_mask = _cuda.to_device(np.ones((N, len(SIZES), max(SIZES)), np.uint8))
    gate.on_mask(_cuda.to_device(obs), d_mask, s, tag="act")
    gated = gate_ref(cvar, np.ones(N, bool), floor, budget=0.25)
    np.testing.assert_array_equal(d_mask.copy_to_host()[:, 0, [DIR_SHORT, DIR_LONG]] == 0, gated)
    assert gate.dev["budget"].copy_to_host()[0] == np.float32(0.25)
    # before the first IQN step the budget is 0: nothing is gated, whatever the floor
    state.copy_to_device(np.array([-1.0, -1.0]))
    gate = CvarGate(head, 0.5, 0.0, N, POS, readiness_state=state)
    d_mask = _cuda.to_device(np.ones((N, len(SIZES), max(SIZES)), np.uint8))
    gate.on_mask(_cuda.to_device(obs), d_mask, s, tag="act")
    assert d_mask.copy_to_host().all()


def test_tiny_run_with_the_gate_on():
    """Agent + env (the learner-trace setup) with a strict gate (α = 0.1, floor 0: every entry whose
    lower tail is negative): entries are gated at collect (the replay keeps the gated mask), the stats
    show it, and the greedy backtest never enters."""
    from numbarl.bench.train import _market
    from numbarl.env.backtest import backtest
    from numbarl.env.device import DeviceEnv
    from numbarl.env.params import EnvParams
    from numbarl.rl.agents.dqn import DQNAgent

    s = stream()
    params = EnvParams(sizes=(0.25, 0.5, 1.0), size_step=0.25)
    market = _market(200, 8, 1).to_device(params.vol_span, params.vol_horizon_bars)
    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=64, n_step=1, cvar_alpha=0.1,
                      cvar_floor=0.0)
    env = DeviceEnv(market, params, 4, bar_range=(0, 150), seed=3)
    agent = DQNAgent(cfg, env.state_dim, params.branch_sizes, 4, 3, eval_batch=1, epsilon=(1.0, 0.05, 8))
    assert agent.cvar_gate.position_col == env.position_column
    env.reset(3, s)
    for t in range(4):
        agent.collect_step(env, s)
        if t >= 2:
            agent.train_step(s)
    agent.cvar_gate.write_stats(agent.stats.device, agent._slots_cvar, s)
    stats = agent.read_stats(s)
    assert stats["cvar_blocked_frac"] > 0 and stats["cvar_mean"] < 0 and stats["cvar_budget"] == 1.0
    mask = agent.replay.store["mask"].copy_to_host()
    count = int(agent.replay.count.copy_to_host()[0])
    assert (mask[:count, :, 0, DIR_LONG] == 0).any() or (mask[:count, :, 0, DIR_SHORT] == 0).any()
    result = backtest(market, (150, 200), params, q_fn=agent.scores, n_policies=1, stream=s)
    assert np.all(np.asarray(result.position) == 0)  # every entry's tail is below 0 on an untrained net
