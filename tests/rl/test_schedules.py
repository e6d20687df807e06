"""Learning-rate schedules (numbarl/rl/schedules.py) in the optimizer: hand-computed multipliers, the
device step against the float64 AdamW reference with the scheduled per-group rates and the halved
momentum at a warm restart, a group's warm-up restarted, and the targeted moment reset."""

import math

import numpy as np
import pytest

from numbarl.cuda.runtime import stream
from test_optim import _flat, _store  # three tensors of odd shapes in two groups, trunk and head
from numbarl.rl.optim import STAT_LR, STAT_LR_RESTARTS, STAT_LR_SCALE, Adam, AdamConfig, adam_ref
from numbarl.rl.schedules import ScheduleConfig, lr_multiplier_ref


def test_multipliers_hand_computed():
    warm = ScheduleConfig(warmup_steps=4)
    assert [lr_multiplier_ref(t, 0, warm)[0] for t in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_multiplier_ref(6, 5, warm)[0] == 0.5  # a group started at step 5: its second step
    cos = ScheduleConfig(cycle_steps=4, min_lr_frac=0.2)
    # 0.2 + 0.8 * (1 + cos(pi * pos / 4)) / 2 at pos = 0, 2, 4 (a restart)
    assert lr_multiplier_ref(0, 0, cos) == (1.0, False)
    assert lr_multiplier_ref(2, 0, cos)[0] == pytest.approx(0.6)
    assert lr_multiplier_ref(4, 0, cos) == (1.0, True)
    assert not ScheduleConfig().active
    with pytest.raises(ValueError, match="min_lr_frac"):
        ScheduleConfig(cycle_steps=4, min_lr_frac=1.5)


def test_scheduled_steps_match_the_reference(rng):
    store = _store(rng)
    cfg = AdamConfig(lr=1e-2, weight_decay=0.1)
    sched = ScheduleConfig(warmup_steps=3, cycle_steps=4, min_lr_frac=0.1, restart_momentum_scale=0.5)
    opt = Adam(store, cfg, schedule=sched).allocate()
    opt.set_lr(3e-2, group="head")
    base = {"trunk": 1e-2, "head": 3e-2}
    ids = np.pad(store.group_ids(opt.groups), (0, opt._n - store.flat_size))
    mask = np.pad(store.decay_mask(), (0, opt._n - store.flat_size))
    p, m, v = _flat(store, "params").astype(np.float64), np.zeros(opt._n), np.zeros(opt._n)
    step, restarts = 0, 0
    for t in range(9):
        grads = {n: rng.standard_normal(sp.shape).astype(np.float32) for n, sp in store.specs.items()}
        store.load(grads, role="grads")
        g = _flat(store, "grads")
        opt.step(stream())
        mult, restart = lr_multiplier_ref(t, 0, sched)
        if restart:
            m = m * 0.5
            restarts += 1
        lr_el = np.where(ids == 1, base["head"], base["trunk"]) * mult
        p, m, v, step, _ = adam_ref(p, g, m, v, mask, step, lr_el, cfg)
        np.testing.assert_allclose(_flat(store, "params"), p, rtol=2e-5, atol=1e-6, err_msg=f"params step {t}")
        np.testing.assert_allclose(_flat(store, "adam_m"), m, rtol=2e-5, atol=1e-7, err_msg=f"m step {t}")
        stats = opt.stats.copy_to_host()
        assert stats[STAT_LR_SCALE] == pytest.approx(mult, rel=1e-6)
        assert stats[STAT_LR] == pytest.approx(base["trunk"] * mult, rel=1e-6)
        assert stats[STAT_LR_RESTARTS] == restarts
    assert restarts == 2  # steps 4 and 8
    assert opt.group_values("lr")["head"] == pytest.approx(3e-2 * lr_multiplier_ref(8, 0, sched)[0], rel=1e-6)


def test_a_restarted_group_warms_up_again_and_moments_reset(rng):
    store = _store(rng)
    opt = Adam(store, AdamConfig(lr=1e-2), schedule=ScheduleConfig(warmup_steps=4)).allocate()
    for _ in range(5):
        store.load({n: np.ones(sp.shape, np.float32) for n, sp in store.specs.items()}, role="grads")
        opt.step(stream())
    assert opt.group_values("lr") == pytest.approx({"trunk": 1e-2, "head": 1e-2})
    opt.restart_warmup("head")  # e.g. a component switched on: its group is new at step 5
    opt.step(stream())
    assert opt.group_values("lr") == pytest.approx({"trunk": 1e-2, "head": 1e-2 * lr_multiplier_ref(5, 5, opt.schedule)[0]})
    ids = np.pad(store.group_ids(opt.groups), (0, opt._n - store.flat_size))
    used = np.pad(store.mask(lambda s: True), (0, opt._n - store.flat_size)) == 1
    m_before = _flat(store, "adam_m")
    opt.reset_moments("head", stream())
    m_after, v_after = _flat(store, "adam_m"), _flat(store, "adam_v")
    assert np.all(m_after[ids == 1] == 0) and np.all(v_after[ids == 1] == 0)
    trunk = used & (ids == 0)
    assert np.array_equal(m_after[trunk], m_before[trunk]) and np.all(m_before[trunk] != 0)
    with pytest.raises(KeyError, match="groups: trunk, head"):
        opt.reset_moments("value", stream())


def test_no_schedule_launches_nothing_extra(rng):
    """Without a schedule the step is the constant-rate step: an inactive ScheduleConfig is dropped."""
    opt = Adam(_store(rng), AdamConfig(lr=1e-3), schedule=ScheduleConfig()).allocate()
    assert opt.schedule is None
    assert math.isclose(float(opt.lr.copy_to_host()[0]), 1e-3, rel_tol=1e-6)


def test_agent_wires_the_schedule_and_the_weight_decay_groups():
    from numbarl.config import AgentConfig
    from numbarl.rl.agents.dqn import DQNAgent

    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=64, n_step=1, weight_decay=0.1,
                      weight_decay_groups="trunk, head.value", lr_warmup_steps=10, lr_cycle_steps=50)
    agent = DQNAgent(cfg, 6, (3, 2, 2, 2), 2, seed=1)
    assert agent.optim.schedule is not None and agent.optim.schedule.cycle_steps == 50
    assert agent.optim.group_values("weight_decay") == pytest.approx({"trunk": 0.1, "head.value": 0.1, "head.adv": 0.0})
    with pytest.raises(ValueError, match="no optimizer group head.bogus; this network's groups: trunk, head.value, head.adv"):
        DQNAgent(AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=64, n_step=1,
                             weight_decay_groups="head.bogus"), 6, (3, 2, 2, 2), 2, seed=1)


def test_a_checkpoint_from_before_groups_and_new_stats_still_loads():
    """Resume across this version's changes: a single lr, a shorter optimizer stats vector and a
    shorter agent stats vector load into the current agent (what they have, then defaults)."""
    from numbarl.config import AgentConfig
    from numbarl.rl.agents.dqn import DQNAgent

    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=64, n_step=1, lr=3e-3)
    agent = DQNAgent(cfg, 6, (3, 2, 2, 2), 2, seed=1)
    arrays = agent.state_arrays()
    old = {k: v for k, v in arrays.items() if k not in ("optim/base_lr", "optim/group_start", "optim/momentum_scale")}
    old["optim/lr"] = np.array([2e-3], np.float32)
    old["optim/stats"] = np.arange(5, dtype=np.float32)
    old["agent/stats"] = np.arange(16, dtype=np.float32)
    fresh = DQNAgent(cfg, 6, (3, 2, 2, 2), 2, seed=2)
    fresh.load_state(old)
    assert fresh.optim.group_values("lr") == pytest.approx({"trunk": 2e-3, "head.value": 2e-3, "head.adv": 2e-3})
    assert np.array_equal(fresh.optim.state["stats"].copy_to_host()[:5], np.arange(5))
    assert np.array_equal(fresh.stats.host[:16], np.arange(16))
