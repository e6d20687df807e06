"""GPU checks of adaptive atom positions (agent.adaptive_atoms, numbarl/rl/losses/atoms.py): the
non-uniform projection and the spacing step against their float64 references at the real size
(B = 16,384, 4 branches, 51 atoms), graph replay == eager bitwise and two runs bitwise identical for
the agent's train steps with the atoms moving (an aux step, a step without it, an aux step).

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_adaptive_atoms.py -m gpu -q`
"""

import numpy as np
import pytest
from agent_helpers import agent_snapshot, check_graph_replay_equals_eager, check_two_runs_bitwise_identical

from numbarl.config import AgentConfig
from numbarl.cuda.runtime import cuda, stream
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.losses import atoms
from numbarl.rl.losses.c51 import (
    C51Loss,
    double_dqn_actions_ref,
    project_distribution_nonuniform_ref,
)

pytestmark = pytest.mark.gpu

_cuda = cuda()
BATCH = 16384
SIZES = (3, 3, 4, 4)
N_ATOMS = 51
V_MIN, V_MAX = -10.0, 10.0
STATE_DIM, N_ENVS = 64, 64
CFG = AgentConfig(trunk=(512, 512), n_atoms=N_ATOMS, batch_size=4096, replay_capacity=64 * N_ENVS, n_step=3,
                  gamma=0.99, target_update="polyak", adaptive_atoms=True, adaptive_atoms_warmup=0,
                  adaptive_atoms_lr=0.05, aux_frequency=2, weight_decay=0.01)


def _dev(x):
    out = _cuda.to_device(np.ascontiguousarray(x), stream=stream())
    stream().synchronize()
    return out


def _host(x):
    out = x.copy_to_host(stream=stream())
    stream().synchronize()
    return out


def _inputs(rng):
    nb, na = len(SIZES), max(SIZES)
    return {"logits": rng.standard_normal((BATCH, nb, na, N_ATOMS)).astype(np.float32),
            "actions": np.stack([rng.integers(0, n, BATCH) for n in SIZES], 1).astype(np.int32),
            "next_q": rng.standard_normal((BATCH, nb, na)).astype(np.float32),
            "target_probs": rng.dirichlet(np.ones(N_ATOMS), (BATCH, nb, na)).astype(np.float32),
            "rewards": (rng.standard_normal(BATCH) * 3.0).astype(np.float32),  # some beyond the support
            "dones": (rng.random(BATCH) < 0.1).astype(np.float32),
            "discounts": (0.99 ** rng.integers(1, 4, BATCH)).astype(np.float32)}


def test_projection_and_spacing_step_match_reference_at_real_size(rng):
    x = _inputs(rng)
    s0 = atoms.SPACING_INIT + 0.3 * rng.standard_normal(N_ATOMS - 1)
    z = atoms.support_from_spacing_ref(s0, V_MIN, V_MAX).astype(np.float32)
    lr = 0.05
    state = atoms.AdaptiveAtoms(BATCH, len(SIZES), N_ATOMS, lr=lr, warmup=0)
    state.arena.load({"spacing_raw": s0, "support_mode": np.ones(1, np.int32)})
    loss = C51Loss(BATCH, SIZES, N_ATOMS, V_MIN, V_MAX, adaptive_support=True)
    support = _dev(z)
    loss.bind_support(support, state.support_mode)
    d = {k: _dev(v) for k, v in x.items()}
    s = stream()
    loss(d["logits"], d["actions"], d["next_q"], d["target_probs"], d["rewards"], d["dones"], d["discounts"], s)
    stats = _dev(np.zeros(2, np.float32))
    state.step(loss, d["rewards"], d["dones"], d["discounts"], d["actions"], d["target_probs"], support,
               _dev(np.array([V_MIN, V_MAX])), _dev(np.array([1], np.int64)), stats, 0, 1, s)
    s.synchronize()
    a_star = double_dqn_actions_ref(x["next_q"], SIZES)
    rows = np.arange(BATCH)
    probs = np.stack([x["target_probs"][rows, k, a_star[:, k]] for k in range(len(SIZES))], 1).astype(np.float64)
    want = np.stack([project_distribution_nonuniform_ref(x["rewards"], x["dones"], x["discounts"], probs[:, k], z)
                     for k in range(len(SIZES))], 1)
    got = _host(loss.target_dist)
    assert np.max(np.abs(got - want)) <= 1e-5
    assert np.max(np.abs(got.sum(-1) - 1.0)) <= 1e-5
    j, dz, ds = atoms.support_entropy_grad_ref(s0, V_MIN, V_MAX, x["rewards"], x["dones"], x["discounts"], probs)
    assert _host(stats)[0] == pytest.approx(j, rel=1e-5)
    assert np.max(np.abs(_host(state.arena["dj_dz"]) - dz)) <= 1e-3 * np.max(np.abs(dz))
    s1 = atoms.spacing_step_ref(s0, ds, lr)
    assert np.max(np.abs(_host(state.spacing_raw) - s1)) <= 1e-3 * np.max(np.abs(s1 - s0))
    assert np.max(np.abs(_host(support) - atoms.support_from_spacing_ref(s1, V_MIN, V_MAX))) <= 1e-5


def _agent(seed=1):
    return DQNAgent(CFG, STATE_DIM, SIZES, N_ENVS, seed=seed)


def _snapshot(agent, s):
    return agent_snapshot(agent, s, {"loss": agent.loss.loss, "target_dist": agent.loss.target_dist})


def test_graph_replay_equals_eager_bitwise(rng):
    agent = _agent()
    eager, start, s = check_graph_replay_equals_eager(agent, rng, _snapshot)
    assert eager["atoms/support_mode"][0] == 1 and not np.array_equal(eager["atoms/support"], start["atoms/support"])
    ratio = agent.read_stats(s)["atom_spacing_ratio"]
    assert np.isfinite(ratio) and ratio > 1.0


def test_two_runs_bitwise_identical(rng):
    check_two_runs_bitwise_identical(rng, lambda: _agent(seed=3), _snapshot)
