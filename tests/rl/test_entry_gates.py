"""The entry gates' switch (DQNAgent.arm_entry_gates, numbarl/rl/cvar_gate.py: gate_switch): with the CVaR,
epistemic and confidence gates all on and strict enough to gate every flat env's entries on an untrained net,
a collect step with the switch off gates nothing (the replay keeps the full mask, the stats say 0), the same
step with it on gates the greedy choice's mask and leaves exploration the env's (the captured graph reads the
switch, so one capture serves both), and the backtest's
greedy scores stay gated either way. The trainer turns the switch off over the replay's prefill: a tiny run
with a gate fits the value support to the same prefill returns as the same run without it, and gates from the
first train step on."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from numbarl.cli import train_cmd
from numbarl.config import AgentConfig
from numbarl.cuda.graph import capture
from numbarl.cuda.runtime import stream
from numbarl.env.params import DIR_LONG, DIR_SHORT


def _gated(agent) -> tuple[int, int, int]:
    """How many envs each gate (CVaR, epistemic, confidence) took an entry from in the last collect step."""
    return (int(agent.cvar_gate.dev["blocked"].copy_to_host().sum()),
            int(agent.ens_gate.dev["blocked"].copy_to_host().sum()),
            int(agent.conf_gate.gated.copy_to_host().sum()))


def _flat_mask_rows(agent, row: int) -> np.ndarray:
    """The replay's mask row `row` at the entry sides: [N, 2] (short, long)."""
    return agent.replay.store["mask"].copy_to_host()[row][:, 0, [DIR_SHORT, DIR_LONG]]


def test_the_switch_turns_every_entry_gate_off_and_on_in_one_captured_graph():
    from numbarl.bench.train import _market
    from numbarl.env.backtest import backtest
    from numbarl.env.device import DeviceEnv
    from numbarl.env.params import EnvParams
    from numbarl.rl.agents.dqn import DQNAgent

    s = stream()
    params = EnvParams(sizes=(0.25, 0.5, 1.0), size_step=0.25)
    market = _market(200, 8, 1).to_device(params.vol_span, params.vol_horizon_bars)
    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=64, n_step=1, cvar_alpha=0.1,
                      cvar_floor=0.0, ensemble_heads=2, epistemic_theta=1e-9, confidence_weight=0.5,
                      confidence_floor=0.99, aux_frequency=1)
    env = DeviceEnv(market, params, 4, bar_range=(0, 150), seed=3)
    agent = DQNAgent(cfg, env.state_dim, params.branch_sizes, 4, 3, eval_batch=1, epsilon=(1.0, 0.05, 8))
    switch = agent.entry_gates_armed
    assert switch is not None and switch.copy_to_host()[0] == 1  # a new agent's gates are on
    assert agent.cvar_gate.armed is switch and agent.ens_gate.armed is switch and agent.conf_gate.armed is switch
    env.reset(3, s)
    graph = capture(lambda st: agent.collect_step(env, st), s)  # the capture runs the step once: gates on
    s.synchronize()
    assert all(n > 0 for n in _gated(agent))  # every gate takes the flat envs' entries (step 0: all flat)
    assert (_flat_mask_rows(agent, 0) == 0).all()  # the replay keeps the greedy choice's (gated) mask
    # ε is 1 at step 0 (schedule 1.0 -> 0.05 over 8 steps): every draw explores, over the env's own mask, so
    # the gated envs still enter (direction short / long) although no greedy choice may
    directions = env.transition.actions.copy_to_host()[:, 0]
    assert np.isin(directions, [DIR_SHORT, DIR_LONG]).any(), directions
    assert env.transition.mask.copy_to_host()[:, 0, [DIR_SHORT, DIR_LONG]].all()  # the env's mask: untouched
    agent.arm_entry_gates(False, s)
    graph.replay(s)
    s.synchronize()
    assert _gated(agent) == (0, 0, 0)
    assert (_flat_mask_rows(agent, 1) != 0).any()  # some entry open again (the env's own mask allows it)
    agent.diagnostics_step(env, s)
    agent.cvar_gate.write_stats(agent.stats.device, agent._slots_cvar, s)
    stats = agent.read_stats(s)
    assert stats["cvar_blocked_frac"] == 0 and stats["epistemic_blocked_frac"] == 0
    assert stats["confidence_gated_frac"] == 0
    agent.arm_entry_gates(True, s)
    for _ in range(30):  # on again: the first step with a flat env gates it in every gate
        graph.replay(s)
        s.synchronize()
        if _any_flat(agent):
            break
    assert _any_flat(agent) and all(n > 0 for n in _gated(agent))
    agent.arm_entry_gates(False, s)  # the backtest's scores do not read the switch
    result = backtest(market, (150, 200), params, q_fn=agent.scores, n_policies=1, stream=s)
    assert np.all(np.asarray(result.position) == 0)


def _any_flat(agent) -> bool:
    return bool(agent.cvar_gate.dev["flat"].copy_to_host().any())


def test_an_agent_without_a_gate_has_no_switch():
    from numbarl.bench.train import _market
    from numbarl.env.device import DeviceEnv
    from numbarl.env.params import EnvParams
    from numbarl.rl.agents.dqn import DQNAgent

    params = EnvParams(sizes=(0.25, 0.5, 1.0), size_step=0.25)
    market = _market(200, 8, 1).to_device(params.vol_span, params.vol_horizon_bars)
    env = DeviceEnv(market, params, 4, bar_range=(0, 150), seed=3)
    agent = DQNAgent(AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=64), env.state_dim,
                     params.branch_sizes, 4, 3)
    assert agent.entry_gates_armed is None
    agent.arm_entry_gates(False, stream())  # nothing to switch: no error


TINY = ["--preset", "tiny", "--quiet", "--set", "data.synth_bars_per_day=30", "--set", "train.collect_steps_per_epoch=4",
        "--set", "train.log_interval=1", "--set", "train.learning_starts=3", "--set", "train.epochs=1",
        "--set", "agent.support=fit", "--set", "agent.ensemble_heads=2"]


@pytest.fixture
def tiny_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBARL_CACHE", str(tmp_path / "cache"))

    def run(name, *sets):
        out = tmp_path / name
        r = CliRunner().invoke(train_cmd, [*TINY, *sets, "--out", str(out)], catch_exceptions=True)
        assert r.exit_code == 0, r.output + repr(r.exception)
        support = [line.split("fold 0: ", 1)[1] for line in (out / "train.log").read_text().splitlines()
                   if "value support" in line]
        train = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return support, [r for r in train if r["kind"] == "train"]

    return run


def test_the_trainer_turns_the_gates_off_over_the_prefill(tiny_runs):
    plain_support, _ = tiny_runs("plain")
    gated_support, gated = tiny_runs("gated", "--set", "agent.epistemic_theta=1e-9")
    assert len(plain_support) == 1 and gated_support == plain_support  # the same prefill, the same fit
    by_step = {r["step"]: r for r in gated}
    prefill = max(3, min(by_step) + 1)  # learning_starts; the replay's own minimum is below it here
    assert by_step[1]["epistemic_blocked_frac"] == 0  # a prefill collect step: off
    after = [r["epistemic_blocked_frac"] for r in gated if r["step"] > prefill]
    assert after and all(x > 0 for x in after)  # from the first train step on: every entry gated (θ ≈ 0)
