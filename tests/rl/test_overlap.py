"""agent.overlap: the train step's independent work on forked streams (numbarl/cuda/graph.py's beside and
fork, DQNAgent._forward / _backward), under the simulator: which networks take it, the phases it gives, and the
same bits as the one-stream step. tests/rl/test_gpu_overlap.py checks the bits where the streams really overlap."""

import numpy as np
import pytest

from numbarl import config
from numbarl.config import AgentConfig, ConfigError
from numbarl.cuda import graph
from numbarl.cuda.runtime import new_stream, stream


def test_side_stream_is_the_side_stream_inside_beside_only():
    s, other = stream(), new_stream()
    assert graph.side_stream(s) is s
    with graph.beside(s) as block:
        side = graph.side_stream(s)
        assert side is not s and side is graph._SIDE[0] and side not in graph.branch_streams(2)  # its own stream
        assert graph.side_stream(other) is other  # another pass's stream keeps its own
        assert block.on
    assert graph.side_stream(s) is s  # the exit joined and closed the block
    with graph.beside(s, on=False):
        assert graph.side_stream(s) is s
    with pytest.raises(RuntimeError, match="inside"), graph.beside(s):
        raise RuntimeError("inside")
    assert graph.side_stream(s) is s  # closed on an exception too


def test_overlap_runs_on_the_plain_network_only():
    from agent_helpers import tiny_agent

    agent = tiny_agent(6, (3, 2), 4, batch_size=6)
    assert agent.overlap and [n for n, _ in agent.train_phases()][:3] == ["sample", "forward", "loss"]
    off = tiny_agent(6, (3, 2), 4, batch_size=6, overlap=False)
    assert not off.overlap and [n for n, _ in off.train_phases()][:4] == ["sample", "targets", "online", "loss"]
    for fields in ({"iqn": True}, {"feature_gate": True}, {"kan_gate": True}, {"horizons": "2,4", "horizon_regime_col": "1"}):
        assert not tiny_agent(6, (3, 2), 4, batch_size=6, **fields).overlap, fields
    assert tiny_agent(6, (3, 2), 4, batch_size=6, cql_alpha=0.1).overlap  # a loss-side term runs after the join


def test_overlap_gives_the_one_stream_bits():
    """Three train steps (aux, plain, aux) with agent.overlap on and off: parameters, targets, gradients and the
    device stats bit for bit."""
    from agent_helpers import aux_steps, fill_replay, tiny_agent

    snaps = []
    for overlap in (True, False):
        agent = tiny_agent(6, (3, 2), 4, batch_size=6, overlap=overlap)
        assert agent.overlap == overlap
        fill_replay(agent, np.random.default_rng(5))
        aux_steps(agent, stream())
        snap = {f"{role}:{k}": v for role in ("params", "target", "grads") for k, v in agent.store.to_host(role).items()}
        snap["stats"] = agent.read_stats(stream())
        snaps.append(snap)
    assert snaps[0]["stats"] == snaps[1]["stats"]
    for k, v in snaps[0].items():
        if k != "stats":
            assert v.tobytes() == snaps[1][k].tobytes(), k
    assert any(np.any(v != 0) for k, v in snaps[0].items() if k.startswith("grads:trunk.fc0"))


def test_overlap_is_checked_and_is_not_a_behaviour_field():
    with pytest.raises(ConfigError, match="agent.overlap = 'yes' must be true or false"):
        AgentConfig(overlap="yes").validate()
    d = config.resolve(sets=["agent.overlap=false"]).to_dict()
    assert d["agent"]["overlap"] is False
    assert "overlap" not in config.behaviour_fields(d)["agent"]
    assert config.behaviour_fields(d) == config.behaviour_fields(config.resolve().to_dict())


@pytest.mark.parametrize("fields", [{}, {"overlap": False}, {"lock_aware_target": True}])
def test_target_probs_at_a_star_give_the_full_target_bits(monkeypatch, fields):
    """The target pass's probabilities at a* alone (DQNAgent.target_at: a* from the next-obs Q, the head's
    select_probs, the loss reading those rows) against the full pass (dqn.TARGET_AT off): three train steps give
    the same parameters, targets, gradients and stats, bit for bit, with and without the overlap and with the
    lock-aware (masked) argmax; target_probs_host expands the rows at a*. Adaptive atoms and the multi-horizon loss,
    which read every action's probabilities, keep the full pass."""
    from agent_helpers import aux_steps, fill_replay, tiny_agent

    from numbarl.rl.agents import dqn

    snaps = []
    for at in (True, False):
        monkeypatch.setattr(dqn, "TARGET_AT", at)
        agent = tiny_agent(6, (3, 2), 4, batch_size=6, **fields)
        assert agent.target_at == at
        fill_replay(agent, np.random.default_rng(9))
        aux_steps(agent, stream())
        snap = {f"{role}:{k}": v for role in ("params", "target", "grads") for k, v in agent.store.to_host(role).items()}
        snap["stats"] = agent.read_stats(stream())
        probs = agent.target_probs_host()
        snaps.append(snap)
        if at:
            a_star = agent.loss.arena["a_star"].copy_to_host()
            rows = agent.head.outputs("target").probs_at.copy_to_host()
        else:
            full = probs
    assert snaps[0]["stats"] == snaps[1]["stats"]
    for k, v in snaps[0].items():
        if k != "stats":
            assert v.tobytes() == snaps[1][k].tobytes(), k
    for k, n in enumerate((3, 2)):  # the rows at a* are the full pass's rows (the last step's)
        assert np.all((a_star[:, k] >= 0) & (a_star[:, k] < n))
        assert rows[:, k].tobytes() == full[np.arange(6), k, a_star[:, k]].tobytes()
    monkeypatch.setattr(dqn, "TARGET_AT", True)
    assert not tiny_agent(6, (3, 2), 4, batch_size=6, adaptive_atoms=True).target_at
    assert not tiny_agent(6, (3, 2), 4, batch_size=6, horizons="2,4", horizon_regime_col="1").target_at
