"""The freeze detector (numbarl/rl/freeze.py) on scripted epoch series, and the agent's reset of the
branch-advantage group's Adam moments (agent.freeze_reset)."""

from dataclasses import replace

import numpy as np
import pytest

from numbarl.config import AgentConfig
from numbarl.cuda.runtime import stream
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.freeze import FreezeDetector


def _rec(q, std, u, g):
    return {"q_mean": q, "q_std": std, "atom_utilization": u, "grad_norm": g}


def _run(det, records):
    return [det.update(r) for r in records]


def test_fires_after_k_still_epochs_with_a_large_gradient():
    det = FreezeDetector(eps=1e-3, epochs=4, grad_min=5.0)
    still = [_rec(0.47, 0.1, 0.2, 10.0)] * 10
    # the first record has no Δ; epochs 2..5 are four still epochs: fires at index 4, then counts again
    assert _run(det, still) == [False, False, False, False, True, False, False, False, True, False]
    assert det.fired == 2


def test_moving_statistics_or_small_gradients_do_not_fire():
    det = FreezeDetector(eps=1e-3, epochs=4, grad_min=5.0)
    moving = [_rec(0.1 * i, 0.1, 0.2, 10.0) for i in range(8)]  # Q-mean moves
    assert not any(_run(det, moving))
    det = FreezeDetector(eps=1e-3, epochs=4, grad_min=5.0)
    converged = [_rec(0.47, 0.1, 0.2, 0.5)] * 8  # still, but the gradient is small: converged, not frozen
    assert not any(_run(det, converged))
    for key in ("q_std", "atom_utilization"):  # any one watched statistic moving breaks it
        det = FreezeDetector(eps=1e-3, epochs=4, grad_min=5.0)
        recs = [_rec(0.47, 0.1, 0.2, 10.0) for _ in range(8)]
        for i, r in enumerate(recs):
            r[key] += 0.002 * i  # |Δ| = 0.002 > ε every epoch
        assert not any(_run(det, recs)), key


def test_a_break_restarts_the_count():
    det = FreezeDetector(eps=1e-3, epochs=4, grad_min=5.0)
    recs = [_rec(0.47, 0.1, 0.2, 10.0)] * 4 + [_rec(0.6, 0.1, 0.2, 10.0)] + [_rec(0.6, 0.1, 0.2, 10.0)] * 4
    # 3 still epochs, a jump (streak 0), then 4 still epochs: fires on the last record only
    assert _run(det, recs) == [False] * 8 + [True]
    det = FreezeDetector(eps=1e-3, epochs=2, grad_min=0.0)
    recs = [_rec(1.0, 0.1, 0.2, 1.0), _rec(1.0, 0.1, 0.2, 1.0), {"q_mean": 1.0}, _rec(1.0, 0.1, 0.2, 1.0),
            _rec(1.0, 0.1, 0.2, float("nan")), _rec(1.0, 0.1, 0.2, 1.0), _rec(1.0, 0.1, 0.2, 1.0),
            _rec(1.0, 0.1, 0.2, 1.0)]
    # a record missing a key or holding NaN breaks the streak and is no reference for the next one
    assert _run(det, recs) == [False, False, False, False, False, False, False, True]


def test_from_config_and_validation():
    cfg = AgentConfig(freeze_eps=0.01, freeze_epochs=3, freeze_grad_min=2.0)
    det = FreezeDetector.from_config(cfg)
    assert (det.eps, det.epochs, det.grad_min, det.keys[-1]) == (0.01, 3, 2.0, "atom_utilization")
    assert FreezeDetector.from_config(replace(cfg, atom_entropy_max=0.01)).keys[-1] == "atom_utilization_ema"
    with pytest.raises(ValueError):
        FreezeDetector(eps=0.0)


CFG = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=40, n_step=1)


@pytest.mark.parametrize("on", [True, False])
def test_on_freeze_zeroes_exactly_the_advantage_groups_moments(rng, on):
    agent = DQNAgent(replace(CFG, freeze_reset=on), 5, (3, 3, 4, 4), 4, seed=2)
    store = agent.store
    m0 = {n: rng.normal(0, 1, v.shape).astype(np.float32) for n, v in store.arenas["adam_m"].to_host().items()}
    v0 = {n: rng.random(v.shape).astype(np.float32) for n, v in store.arenas["adam_v"].to_host().items()}
    store.arenas["adam_m"].load(m0)
    store.arenas["adam_v"].load(v0)
    s = stream()
    assert agent.on_freeze(s) is on
    s.synchronize()
    m1, v1 = store.arenas["adam_m"].to_host(), store.arenas["adam_v"].to_host()
    adv = [n for n, spec in store.specs.items() if spec.group == "head.adv"]
    assert adv
    for name in m0:
        reset = on and name in adv
        assert np.array_equal(m1[name], np.zeros_like(m0[name]) if reset else m0[name]), name
        assert np.array_equal(v1[name], np.zeros_like(v0[name]) if reset else v0[name]), name
    agent.stats.record(s)
    assert agent.stats_layout.read(agent.stats.read())["freeze_resets"] == int(on)
