"""The C51 agent's temporal input (agent.temporal = "mamba", numbarl/rl/temporal.py): the train step
against a float64 reference of the whole step (windows → scan → trunk → head → C51 loss → the scan's
gradients through all K steps), the acting window read from the replay's ring, the backtest's window
ring, checkpoints, the config's checks, and the default path without it. The liveness in a tiny
training run: tests/rl/test_components.py ("temporal_mamba", the cvar run)."""

from dataclasses import replace

import numpy as np
import pytest
from agent_helpers import fill_replay

from numbarl.config import AgentConfig, ConfigError
from numbarl.cuda.runtime import cuda, stream
from numbarl.cuda.testing import assert_close
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.losses.c51 import c51_loss_ref
from numbarl.rl.sequence import sequence_gather_ref
from numbarl.rl.temporal import eval_push_ref

SIZES = (3, 3, 4, 4)
STATE_DIM, N_ENVS, K, P = 6, 2, 4, 2  # obs width 6 in 2 heads of 3; 2 backtest policies
CFG = AgentConfig(trunk=(8,), n_atoms=5, batch_size=3, replay_capacity=10 * N_ENVS, n_step=2, gamma=0.9,
                  target_update="polyak", temporal="mamba", temporal_steps=K, temporal_heads=2)


def _agent(seed=1, **kw):
    return DQNAgent(replace(CFG, **kw), STATE_DIM, SIZES, N_ENVS, seed=seed, eval_batch=P)


def _rel(got, ref):
    return float(np.linalg.norm(np.asarray(got, np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


def _host(x):
    return x.copy_to_host()


@pytest.mark.parametrize("conv, heads", [(0, 2), (2, 2), (0, 4)])
def test_train_step_matches_the_float64_reference(rng, conv, heads):
    """One train step: the obs / next windows equal the gather's model; the trunk's input on every pass is
    the scan's reference on its window (target parameters on the target pass); the loss is the C51
    reference on those passes; the scan's gradients are its BPTT reference fed the trunk's input gradient
    of the reference backward (C51 loss → head → trunk): relative error <= 1e-5. conv: with Mamba2's
    causal convolution before the scan (agent.temporal_conv), its weights among the scan's gradients; heads 4:
    a width of 6 features the heads do not divide (the scan's inner width 8)."""
    agent = _agent(temporal_conv=conv, temporal_heads=heads)
    fill_replay(agent, rng, done_rate=0.25, count=13)  # the ring has wrapped: windows cut by age and by dones
    params, target = agent.store.to_host("params"), agent.store.to_host("target")
    params = {k: v.astype(np.float64) for k, v in params.items()}
    target = {k: v.astype(np.float64) for k, v in target.items()}
    s = stream()
    agent.train_step(s)
    s.synchronize()
    store, batch, temporal = agent.replay.store, agent.replay.batch, agent.temporal
    obs_ring, done_ring, count = _host(store["obs"]), _host(store["done"]), int(_host(store["count"])[0])
    windows = {}
    for name, index in (("obs", batch.index), ("next", batch.next_index)):
        want, valid = sequence_gather_ref(obs_ring, done_ring, count, _host(index), K)
        np.testing.assert_array_equal(_host(temporal.state[f"{name}.x"]), want)
        np.testing.assert_array_equal(_host(temporal.state[f"{name}.mask"]), valid.astype(np.float32))
        windows[name] = (want, valid)
    assert 0 < windows["obs"][1].sum() < windows["obs"][1].size  # some windows are cut short
    # forward: scan → trunk → head on each pass
    scan, trunk, head = temporal.scan, agent.trunk, agent.head
    passes = {}
    for tag, name, p in (("online", "obs", params), ("next", "next", params), ("target", "next", target)):
        x, mask = windows[name]
        h_in, scan_cache = temporal.forward_ref(x, mask, p)
        assert_close(_host(scan.output(tag)), h_in, 1e-6, 1e-5)
        h, trunk_cache = trunk.forward_ref(h_in, p)
        out, head_cache = head.forward_ref(h, p)
        passes[tag] = (out, scan_cache, trunk_cache, head_cache)
    assert_close(_host(agent.head.outputs("next").q), passes["next"][0].q, 1e-6, 1e-5)
    # the C51 loss (the device's next_q for the double-DQN argmax: a float32 near-tie must not flip it)
    next_q = _host(agent.head.outputs("next").q)
    loss, _, d_logits, _ = c51_loss_ref(passes["online"][0].logits, _host(batch.action), next_q,
                                        passes["target"][0].probs, _host(batch.reward), _host(batch.done),
                                        _host(batch.discount), head.support_host, SIZES)
    assert float(agent.read_stats(s)["loss"]) == pytest.approx(loss, rel=1e-5)
    # backward: head → trunk (its input gradient now computed) → the scan through all K steps
    _, scan_cache, trunk_cache, head_cache = passes["online"]
    dh, _ = head.backward_ref(d_logits, head_cache, params)
    dx, _ = trunk.backward_ref(dh, trunk_cache, params)
    assert _rel(_host(agent.acts["trunk.fc0.online.dx"]), dx) <= 1e-5
    _, scan_grads = scan.backward_ref(dx, scan_cache, params)
    grads = agent.store.to_host("grads")
    assert set(scan_grads) == {n for n in grads if n.startswith("temporal.mamba.")}
    assert ("temporal.mamba.conv" in scan_grads) == bool(conv)
    for name, want in scan_grads.items():
        assert np.any(want != 0), name
        assert _rel(grads[name], want) <= 1e-5, (name, _rel(grads[name], want))
    # the optimizer moved the scan at its own rate; the target scan follows by Polyak like every tensor
    assert agent.optim.group_values()["temporal.mamba"] == pytest.approx(CFG.temporal_lr)
    after = agent.store.to_host("params")
    assert all(not np.array_equal(after[n], params[n].astype(np.float32)) for n in scan_grads)
    assert not np.array_equal(agent.store.to_host("target")["temporal.mamba.w_in"], target["temporal.mamba.w_in"])


def test_curiosity_trunk_gradient_reaches_the_scan_on_both_passes(rng):
    """ICM with agent.curiosity_trunk_grad runs a second trunk backward on the next pass: its input gradient
    runs the scan's backward too, and the scan's gradients are the sum of both passes' references (the
    online pass first, the next pass adding)."""
    agent = _agent(curiosity_weight=0.1, curiosity_hidden=4, curiosity_trunk_grad=True)
    fill_replay(agent, rng, done_rate=0.25, count=13)
    params = {k: v.astype(np.float64) for k, v in agent.store.to_host("params").items()}
    s = stream()
    agent.train_step(s)
    s.synchronize()
    temporal, grads = agent.temporal, agent.store.to_host("grads")
    want = {}
    for tag, name in (("online", "obs"), ("next", "next")):
        window, mask = _host(temporal.state[f"{name}.x"]), _host(temporal.state[f"{name}.mask"])
        _, cache = temporal.forward_ref(window, mask, params)
        _, g = temporal.scan.backward_ref(_host(agent.acts[f"trunk.fc0.{tag}.dx"]), cache, params)
        want = {k: want.get(k, 0.0) + v for k, v in g.items()}
        assert np.any(g["temporal.mamba.w_in"] != 0), tag  # both passes contribute
    for name, w in want.items():
        assert _rel(grads[name], w) <= 1e-5, name


def test_acting_window_ends_at_the_row_the_gather_just_wrote(rng):
    """The collect step's window: the env's column of the ring ending at row count % n_slots, which the
    env's gather has written before the count advances (count_offset=1), i.e. the gather's model at count + 1."""
    agent = _agent()
    fill_replay(agent, rng, done_rate=0.3, count=17)
    s = stream()
    agent.temporal.gather_act(agent.replay, s)
    s.synchronize()
    n_slots = agent.replay.n_slots
    index = (17 % n_slots) * N_ENVS + np.arange(N_ENVS)
    want, valid = sequence_gather_ref(_host(agent.replay.store["obs"]), _host(agent.replay.store["done"]), 18, index, K)
    np.testing.assert_array_equal(_host(agent.temporal.state["act.x"]), want)
    np.testing.assert_array_equal(_host(agent.temporal.state["act.mask"]), valid.astype(np.float32))
    assert np.array_equal(want[:, -1], _host(agent.replay.store["obs"])[17 % n_slots])  # the newest row: obs_t


def test_backtest_scores_read_the_last_k_observations(rng):
    """scores(obs) of bar t = the network on the scan of that policy's bars t − K + 1 .. t (fewer after a
    reset_eval, a zero prefix masked), per policy; the ring is the model's (eval_push_ref)."""
    agent = _agent()
    params = {k: v.astype(np.float64) for k, v in agent.store.to_host("params").items()}
    s = stream()
    q_out = cuda().device_array((P, len(SIZES), max(SIZES)), np.float32)
    agent.reset_eval(s)
    window, mask, count = np.zeros((P, K, STATE_DIM), np.float32), np.zeros((P, K), np.float32), np.zeros(P, np.int64)
    for t in range(K + 2):
        obs = rng.standard_normal((P, STATE_DIM)).astype(np.float32)
        agent.scores(cuda().to_device(obs), q_out, s)
        s.synchronize()
        window, mask, count = eval_push_ref(window, mask, count, obs)
        np.testing.assert_array_equal(_host(agent.temporal.state["eval.x"]), window)
        np.testing.assert_array_equal(_host(agent.temporal.state["eval.mask"]), mask)
        h_in, _ = agent.temporal.forward_ref(window, mask, params)
        out, _ = agent.head.forward_ref(agent.trunk.forward_ref(h_in, params)[0], params)
        assert_close(_host(q_out), out.q, 1e-6, 1e-5)
    assert mask.all() and count[0] == K + 2
    agent.reset_eval(s)  # a new backtest starts with an empty window
    s.synchronize()
    assert not _host(agent.temporal.state["eval.mask"]).any() and not _host(agent.temporal.state["eval.x"]).any()


def _scores(agent, obs_seq, s):
    q_out = cuda().device_array((P, len(SIZES), max(SIZES)), np.float32)
    agent.reset_eval(s)
    out = []
    for obs in obs_seq:
        agent.scores(cuda().to_device(obs), q_out, s)
        out.append(q_out.copy_to_host(stream=s))
    s.synchronize()
    return np.stack(out)


@pytest.mark.parametrize("conv", [0, 2])
def test_checkpoint_round_trip_gives_the_same_scores(rng, conv):
    """After a train step: the online and target scan parameters are in the checkpoint arrays; a fresh
    agent of another seed loaded with the policy arrays (policy_prefixes) scores a bar sequence bitwise
    as the trained one, and load_state restores the target scan too (with the convolution's weights)."""
    agent = _agent(temporal_conv=conv)
    fill_replay(agent, rng, done_rate=0.2, count=13)
    s = stream()
    agent.train_step(s)
    s.synchronize()
    arrays = agent.state_arrays()
    for role in ("params", "target"):
        names = ("w_in", "dt_bias", "a_log", "w_out") + (("conv",) if conv else ())
        assert {f"{role}/temporal.mamba.{p}" for p in names} <= set(arrays)
    obs_seq = rng.standard_normal((K + 1, P, STATE_DIM)).astype(np.float32)
    want = _scores(agent, obs_seq, s)
    other = _agent(seed=7, temporal_conv=conv)
    assert not np.array_equal(_scores(other, obs_seq, s), want)
    other.load_params({k: v for k, v in arrays.items() if k.startswith(agent.policy_prefixes)})
    np.testing.assert_array_equal(_scores(other, obs_seq, s), want)
    third = _agent(seed=9, temporal_conv=conv)
    third.load_state(arrays)
    assert np.array_equal(third.store.to_host("target")["temporal.mamba.w_out"], arrays["target/temporal.mamba.w_out"])


def test_off_builds_nothing():
    """agent.temporal off (the default): no scan parameters, group, buffers, and the trunk's first layer
    computes no input gradient (the launches of the default train step are those without the switch)."""
    plain = DQNAgent(replace(CFG, temporal=""), STATE_DIM, SIZES, N_ENVS, seed=1, eval_batch=P)
    assert plain.temporal is None and not any(n.startswith("temporal") for n in plain.store.specs)
    assert "temporal.mamba" not in plain.optim.groups and "trunk.fc0.online.dx" not in plain.acts
    assert "grad_norm.temporal.mamba" not in plain.stats_layout
    on = _agent()
    assert on.optim.groups[0] == "trunk" and on.optim.groups[-1] == "temporal.mamba"
    # declared last: every other parameter has the init it has without the switch
    before = plain.store.to_host("params")
    after = on.store.to_host("params")
    assert all(np.array_equal(v, after[k]) for k, v in before.items())


def test_config_checks():
    with pytest.raises(ConfigError, match="agent.temporal = 'lstm'"):
        replace(CFG, temporal="lstm").validate()
    with pytest.raises(ConfigError, match="agent.temporal_steps"):
        replace(CFG, temporal_steps=33).validate()
    with pytest.raises(ConfigError, match="agent.temporal_lr"):
        replace(CFG, temporal_lr=0.0).validate()
    with pytest.raises(ConfigError, match="agent.temporal_conv"):
        replace(CFG, temporal_conv=9).validate()
    with pytest.raises(ConfigError, match="agent.temporal_conv = 5 taps exceed the window of agent.temporal_steps = 4"):
        replace(CFG, temporal_conv=5).validate()
    with pytest.raises(ConfigError, match="agent.temporal_conv = 4 convolves the temporal input"):
        replace(CFG, temporal="", temporal_conv=4).validate()
    with pytest.raises(ConfigError, match="agent.temporal"):
        replace(CFG, kind="ppo").validate()
    with pytest.raises(ConfigError, match="agent.temporal_steps = 4 needs the replay"):
        _agent(replay_capacity=3 * N_ENVS, n_step=1)
