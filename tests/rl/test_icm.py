"""ICM curiosity (agent.curiosity_weight; numbarl/rl/nets/icm.py, numbarl/rl/losses/icm.py): a
hand-computed case, finite differences of the float64 references, the kernels and the models against
the references on odd shapes (episode ends, the running scale over two steps, an action outside its
branch), the PyTorch peer on the same weights and batch, the agent's train step with it on, off being
bitwise the plain agent, and a tiny training run that logs it live in metrics.jsonl."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from agent_helpers import build_module, check_param_gradients_fd, fill_replay

from numbarl.cuda.runtime import cuda, stream
from numbarl.cuda.testing import assert_close
from numbarl.rl.losses.icm import IcmLoss, icm_loss_ref, intrinsic_reward_ref
from numbarl.rl.nets.icm import Icm, icm_inputs_ref

_cuda = cuda()
SIZES = (3, 2, 4)
A = sum(SIZES)


def _dev(x):
    return _cuda.to_device(np.ascontiguousarray(x))


def _batch(rng, B, H, done_rate=0.3):
    return {"phi": rng.standard_normal((B, H)).astype(np.float32),
            "phi_next": rng.standard_normal((B, H)).astype(np.float32),
            "actions": np.stack([rng.integers(0, n, B) for n in SIZES], axis=1).astype(np.int32),
            "dones": (rng.random(B) < done_rate).astype(np.float32)}


def _build(rng, B, H, n):
    icm, store, values, _ = build_module(Icm("icm", H, SIZES, n), rng, B)
    return icm, store, values


# ---------------------------------------------------------------------------------------------
# references: a hand-computed case and finite differences
# ---------------------------------------------------------------------------------------------
def test_hand_computed_case():
    """One sample, H = 2, branches (2, 3), all logits 0: e = ½(1² + 2²)/2 = 1.25 (the mean over the
    features), CE = (log 2 + log 3)/2; with β = 0.2, L = 0.2·1.25 + 0.8·log(6)/2. A done sample counts
    for nothing."""
    phi_hat, phi_next = np.array([[1.0, 2.0]]), np.zeros((1, 2))
    logits, a = np.zeros((1, 5)), np.array([[1, 2]])
    r = icm_loss_ref(phi_hat, phi_next, logits, a, [0.0], (2, 3), beta=0.2)
    assert r["forward_loss"] == pytest.approx(1.25) and r["inverse_loss"] == pytest.approx(math.log(6) / 2)
    assert r["loss"] == pytest.approx(0.25 + 0.4 * math.log(6)) and r["mean_error"] == pytest.approx(1.25)
    np.testing.assert_allclose(r["d_phi_hat"], [[0.1, 0.2]])  # β (φ̂′ − φ′) / (B H)
    np.testing.assert_allclose(r["d_logits"], [[0.2, -0.2, 0.4 / 3, 0.4 / 3, -0.8 / 3]])
    # first step: the scale is this batch's mean error, so r_i = w exactly; unnormalized r_i = w · e
    r_i, reward, scale = intrinsic_reward_ref(r["error"], [1.0], 0.1, -1.0, r["mean_error"])
    assert r_i[0] == pytest.approx(0.1) and reward[0] == pytest.approx(1.1) and scale == 1.25
    assert intrinsic_reward_ref(r["error"], [1.0], 0.1, -1.0, 1.25, normalize=False)[0][0] == pytest.approx(0.125)
    assert intrinsic_reward_ref(r["error"], [1.0], 0.1, 5.0, 1.25)[2] == pytest.approx(0.99 * 5 + 0.01 * 1.25)
    done = icm_loss_ref(phi_hat, phi_next, logits, a, [1.0], (2, 3))
    assert done["loss"] == 0 and done["mean_error"] is None and not done["d_phi_hat"].any()
    assert intrinsic_reward_ref(done["error"], [1.0], 0.1, 4.0, None)[1:] == (1.0, 4.0)  # scale unchanged


def test_reference_gradients_match_finite_differences(rng):
    """The chain (φ, φ′, a) → models → loss: ∂L/∂params of the composed references, central differences."""
    B, H, n = 4, 3, 5
    icm, _, values = _build(rng, B, H, n)
    p = {k: np.asarray(v, np.float64) for k, v in values.items()}
    x = _batch(rng, B, H)
    x["dones"][:2] = [0.0, 1.0]

    def loss_of(p_):
        phi_hat, logits, _ = icm.forward_ref(x["phi"], x["phi_next"], x["actions"], p_)
        return icm_loss_ref(phi_hat, x["phi_next"], logits, x["actions"], x["dones"], SIZES)["loss"]

    phi_hat, logits, cache = icm.forward_ref(x["phi"], x["phi_next"], x["actions"], p)
    r = icm_loss_ref(phi_hat, x["phi_next"], logits, x["actions"], x["dones"], SIZES)
    grads = icm.backward_ref(r["d_phi_hat"], r["d_logits"], cache, p)
    assert sorted(grads) == sorted(icm.param_names) and len(grads) == 8
    check_param_gradients_fd(rng, loss_of, p, grads, 4)


# ---------------------------------------------------------------------------------------------
# kernels and models against the references
# ---------------------------------------------------------------------------------------------
def test_device_matches_reference_over_two_steps(rng):
    """Odd shapes (B = 19, H = 7): the inputs, both models, the loss, its gradients, the parameter
    gradients, then the intrinsic reward and the running scale on two consecutive batches."""
    B, H, n = 19, 7, 6
    icm, store, values = _build(rng, B, H, n)
    p = {k: np.asarray(v, np.float64) for k, v in values.items()}
    loss = IcmLoss(B, H, SIZES, beta=0.3)
    stats = _dev(np.zeros(7, np.float32))
    s = stream()
    scale = -1.0
    for step in range(2):
        x = _batch(rng, B, H)
        rewards = rng.standard_normal(B).astype(np.float32)
        phi_hat, logits = icm.forward(_dev(x["phi"]), _dev(x["phi_next"]), _dev(x["actions"]), s)
        x_fwd, x_inv = icm.inputs()
        f_ref, i_ref = icm_inputs_ref(x["phi"], x["phi_next"], x["actions"], SIZES)
        np.testing.assert_array_equal(x_fwd.copy_to_host(), f_ref)
        np.testing.assert_array_equal(x_inv.copy_to_host(), i_ref)
        ph_ref, lg_ref, cache = icm.forward_ref(x["phi"], x["phi_next"], x["actions"], p)
        assert_close(phi_hat.copy_to_host(), ph_ref, 1e-5, 1e-4)
        assert_close(logits.copy_to_host(), lg_ref, 1e-5, 1e-4)
        loss.apply({"phi_hat": phi_hat, "phi_next": _dev(x["phi_next"]), "logits": logits, "actions": _dev(x["actions"]),
                    "dones": _dev(x["dones"])}, {"phi_hat": loss.grad("phi_hat"), "logits": loss.grad("logits")}, s)
        r = icm_loss_ref(phi_hat.copy_to_host(), x["phi_next"], logits.copy_to_host(), x["actions"], x["dones"], SIZES,
                         beta=0.3)
        assert_close(loss.loss.copy_to_host()[0], r["loss"], 1e-6, 1e-5)
        assert_close(loss.terms.copy_to_host()[:3], [r["loss"], r["forward_loss"], r["inverse_loss"]], 1e-6, 1e-5)
        assert_close(loss.per_sample.copy_to_host(), r["per_sample"], 1e-6, 1e-5)
        assert_close(loss.grad("phi_hat").copy_to_host(), r["d_phi_hat"], 1e-7, 1e-5)
        assert_close(loss.grad("logits").copy_to_host(), r["d_logits"], 1e-7, 1e-5)
        icm.backward(loss.grad("phi_hat"), loss.grad("logits"), s)
        g_ref = icm.backward_ref(r["d_phi_hat"], r["d_logits"], cache, p)
        grads = store.to_host("grads")
        for name, ref in g_ref.items():
            assert_close(grads[name], ref, 1e-5, 1e-4)
        loss.intrinsic_reward(_dev(rewards), 0.25, True, stats, 2, s)
        r_i, reward_ref, scale = intrinsic_reward_ref(r["error"], rewards, 0.25, scale, r["mean_error"])
        assert_close(loss.rewards.copy_to_host(), reward_ref, 1e-6, 1e-5)
        assert_close(loss.scale.copy_to_host()[0], scale, 0, 1e-5)
        got = stats.copy_to_host()
        assert_close(got[2:7], [r["loss"], r["forward_loss"], r["inverse_loss"], r_i.mean(), scale], 1e-6, 1e-5)
        assert got[5] > 0
    loss.intrinsic_reward(_dev(rewards), 0.25, False, stats, 2, s)  # unnormalized: w · v e, scale moves on
    assert_close(loss.rewards.copy_to_host(), rewards + 0.25 * r["error"], 1e-6, 1e-5)


def test_all_done_batch_and_bad_action():
    """Every window ended the episode: no loss, no reward, the scale stays; an action outside its branch
    makes that sample (and the loss) NaN with a zero gradient."""
    B, H = 3, 2
    loss = IcmLoss(B, H, SIZES)
    loss.arena.load({"scale": np.array([2.0], np.float32)})
    a = np.zeros((B, 3), np.int32)
    x = {"phi_hat": _dev(np.ones((B, H), np.float32)), "phi_next": _dev(np.zeros((B, H), np.float32)),
         "logits": _dev(np.zeros((B, A), np.float32)), "actions": _dev(a), "dones": _dev(np.ones(B, np.float32))}
    s = stream()
    loss.compute(x, s)
    loss.intrinsic_reward(_dev(np.full(B, 0.5, np.float32)), 1.0, True, _dev(np.zeros(5, np.float32)), 0, s)
    assert loss.loss.copy_to_host()[0] == 0 and np.all(loss.rewards.copy_to_host() == 0.5)
    assert loss.scale.copy_to_host()[0] == 2.0 and not loss.grad("phi_hat").copy_to_host().any()
    a[1, 2] = 4  # branch 2 has 4 actions: index 4 is outside
    x.update(actions=_dev(a), dones=_dev(np.zeros(B, np.float32)))
    loss.compute(x, s)
    per = loss.per_sample.copy_to_host()
    assert np.isfinite(per[0]) and np.isnan(per[1]) and np.isnan(loss.loss.copy_to_host()[0])
    assert not loss.grad("logits").copy_to_host()[1, 5:].any()


def test_torch_peer_matches_numbarl(rng):
    """Losses, per-sample terms, every parameter gradient and the intrinsic reward against autograd on
    the same weights and batch: relative error ≤ 1e-5 (fp32)."""
    pytest.importorskip("torch")
    from numbarl.rl.torch_peer_icm import icm_loss_and_grads

    B, H, n = 9, 6, 5
    icm, store, values = _build(rng, B, H, n)
    x = _batch(rng, B, H)
    loss = IcmLoss(B, H, SIZES, beta=0.2)
    s = stream()
    phi_hat, logits = icm.forward(_dev(x["phi"]), _dev(x["phi_next"]), _dev(x["actions"]), s)
    loss.apply({"phi_hat": phi_hat, "phi_next": _dev(x["phi_next"]), "logits": logits, "actions": _dev(x["actions"]),
                "dones": _dev(x["dones"])}, {"phi_hat": loss.grad("phi_hat"), "logits": loss.grad("logits")}, s)
    icm.backward(loss.grad("phi_hat"), loss.grad("logits"), s)
    loss.intrinsic_reward(_dev(np.zeros(B, np.float32)), 0.1, True, _dev(np.zeros(5, np.float32)), 0, s)
    peer = icm_loss_and_grads(values, x["phi"], x["phi_next"], x["actions"], x["dones"], SIZES, beta=0.2, weight=0.1)

    def rel_close(a, b, what):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= 1e-5 * max(np.max(np.abs(b)), 1e-30), what

    assert float(loss.loss.copy_to_host()[0]) == pytest.approx(peer["loss"], rel=1e-5)
    rel_close(loss.terms.copy_to_host()[1:3], [peer["forward_loss"], peer["inverse_loss"]], "terms")
    rel_close(loss.per_sample.copy_to_host(), peer["per_sample"], "per_sample")
    rel_close(phi_hat.copy_to_host(), peer["phi_hat"], "phi_hat")
    rel_close(logits.copy_to_host(), peer["logits"], "logits")
    grads = store.to_host("grads")
    assert set(peer["grads"]) == set(icm.param_names)
    for name, g in peer["grads"].items():
        rel_close(grads[name], g, name)
    rel_close(loss.rewards.copy_to_host(), peer["r_i"], "r_i")
    assert float(loss.scale.copy_to_host()[0]) == pytest.approx(peer["scale"], rel=1e-5)


# ---------------------------------------------------------------------------------------------
# the agent (agent.curiosity_weight >= 0.001): every train step
# ---------------------------------------------------------------------------------------------
AGENT_SIZES = (3, 3, 4, 4)
STATE_DIM, N_ENVS = 5, 4


def _agent(**kw):
    from numbarl.config import AgentConfig
    from numbarl.rl.agents.dqn import DQNAgent

    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=10 * N_ENVS, n_step=2, gamma=0.9,
                      target_update="polyak", curiosity_hidden=6, **kw)
    return DQNAgent(cfg, STATE_DIM, AGENT_SIZES, N_ENVS, seed=1)


def test_agent_train_step_with_curiosity(rng):
    """The curiosity phase runs before LOSS on φ(obs), φ(next_obs) of the online and next passes; the C51
    loss reads reward′ = R_n + r_i; the models (not the trunk: detached) train; the scale is checkpointed."""
    from numbarl.rl.losses.c51 import c51_loss_ref

    agent = _agent(curiosity_weight=0.5)
    phases = [name for name, _ in agent.train_phases()]
    assert phases.index("curiosity") == phases.index("loss") - 1 and agent.aux_every == 1
    assert {"icm.forward", "icm.inverse"} <= set(agent.optim.groups) and "intrinsic_reward_mean" in agent.stats_layout
    assert not {"icm.fwd.fc0.online.dx", "icm.inv.fc0.online.dx"} & set(agent.acts.views)  # no gradient into the trunk
    fill_replay(agent, rng, done_rate=0.2, count=13)
    s = stream()
    before = agent.store.to_host("params")
    agent.train_step(s)
    s.synchronize()
    after = agent.store.to_host("params")
    for name in agent.icm.param_names:
        assert not np.array_equal(before[name], after[name]), name
    batch = agent.replay.batch
    h = {k: v.copy_to_host() for k, v in (("phi", agent.trunk.output("online")), ("phi_next", agent.trunk.output("next")),
                                          ("actions", batch.action), ("dones", batch.done), ("reward", batch.reward))}
    p = {k: np.asarray(v, np.float64) for k, v in before.items()}
    phi_hat, logits, _ = agent.icm.forward_ref(h["phi"], h["phi_next"], h["actions"], p)
    r = icm_loss_ref(phi_hat, h["phi_next"], logits, h["actions"], h["dones"], AGENT_SIZES)
    r_i, reward_ref, scale = intrinsic_reward_ref(r["error"], h["reward"], 0.5, -1.0, r["mean_error"])
    assert_close(agent.icm_loss.rewards.copy_to_host(), reward_ref, 1e-6, 1e-4)
    stats = agent.read_stats(s)
    assert stats["icm_loss"] == pytest.approx(r["loss"], rel=1e-4) and stats["intrinsic_reward_mean"] > 0
    assert stats["intrinsic_reward_mean"] == pytest.approx(r_i.mean(), rel=1e-4, abs=1e-7)
    c51 = c51_loss_ref(agent.head.outputs("online").logits.copy_to_host(), h["actions"],
                       agent.head.outputs("next").q.copy_to_host(), agent.target_probs_host(),
                       agent.icm_loss.rewards.copy_to_host(), h["dones"], batch.discount.copy_to_host(),
                       agent.head.support_host, AGENT_SIZES)
    assert stats["loss"] == pytest.approx(c51[0], rel=1e-4)  # the projection read reward′
    saved = agent.state_arrays()
    assert saved["icm/scale"][0] == pytest.approx(scale, rel=1e-5)
    agent.icm_loss.arena.load({"scale": np.array([-1.0], np.float32)})
    agent.load_state(saved)
    assert agent.icm_loss.scale.copy_to_host()[0] == saved["icm/scale"][0]


def test_trunk_grad_adds_the_inverse_loss_gradient(rng):
    """agent.curiosity_trunk_grad: the trunk's gradient is the detached agent's plus the float64 reference
    of ∂L_I/∂φ through the online pass and ∂L_I/∂φ′ through the next pass (same seed, batch and weights:
    everything else is the same)."""
    seed = int(rng.integers(2**31))
    grads, agents = [], []
    for trunk_grad in (False, True):
        agent = _agent(curiosity_weight=0.5, curiosity_trunk_grad=trunk_grad)
        fill_replay(agent, np.random.default_rng(seed), done_rate=0.2, count=13)
        before = agent.store.to_host("params")
        s = stream()
        agent.train_step(s)
        s.synchronize()
        grads.append(agent.store.to_host("grads"))
        agents.append(agent)
    agent, batch = agents[1], agents[1].replay.batch
    assert "icm.inv.fc0.online.dx" in agent.acts.views and "icm.inv.fc0.online.dx" not in agents[0].acts.views
    p = {k: np.asarray(v, np.float64) for k, v in before.items()}
    _, cache_online = agent.trunk.forward_ref(batch.obs.copy_to_host(), p)
    _, cache_next = agent.trunk.forward_ref(batch.next_obs.copy_to_host(), p)
    phi, phi_next = agent.trunk.output("online").copy_to_host(), agent.trunk.output("next").copy_to_host()
    actions, dones = batch.action.copy_to_host(), batch.done.copy_to_host()
    phi_hat, logits, cache = agent.icm.forward_ref(phi, phi_next, actions, p)
    r = icm_loss_ref(phi_hat, phi_next, logits, actions, dones, AGENT_SIZES)
    g_icm, (d_phi, d_phi_next) = agent.icm.backward_ref(r["d_phi_hat"], r["d_logits"], cache, p, trunk_grads=True)
    _, g_online = agent.trunk.backward_ref(d_phi, cache_online, p)
    _, g_next = agent.trunk.backward_ref(d_phi_next, cache_next, p)
    for name in g_online:
        want = g_online[name] + g_next[name]
        got = grads[1][name].astype(np.float64) - grads[0][name]
        assert np.abs(want).max() > 0, name
        assert_close(got, want, 1e-6 * max(1.0, np.abs(grads[0][name]).max()), 1e-4)
    for name in g_icm:  # the models' own gradients do not depend on the switch
        np.testing.assert_array_equal(grads[0][name], grads[1][name])


def test_curiosity_off_is_bitwise_the_plain_agent(rng):
    """Below 0.001 nothing of ICM is built: the same parameters, stats layout and train-step bits."""
    plain, low = _agent(), _agent(curiosity_weight=0.0009)
    assert low.icm is None and not any(n.startswith("icm.") for n in low.store.specs)
    assert plain.stats_layout.table() == low.stats_layout.table()
    init = plain.store.to_host("params")
    seed = int(rng.integers(2**31))
    snaps = []
    for agent in (plain, low):
        fill_replay(agent, np.random.default_rng(seed), done_rate=0.2, count=13)
        s = stream()
        agent.train_step(s)
        s.synchronize()
        snaps.append(agent.state_arrays())
    assert set(snaps[0]) == set(snaps[1])
    for k in snaps[0]:
        assert np.asarray(snaps[0][k]).tobytes() == np.asarray(snaps[1][k]).tobytes(), k
    on = _agent(curiosity_weight=0.1)  # declared last: the network's own parameters start the same
    on_init = on.store.to_host("params")
    for name in plain.store.specs:
        assert np.array_equal(on_init[name], init[name]), name


def test_config():
    from numbarl.config import AgentConfig, ConfigError

    assert not AgentConfig().curiosity and not AgentConfig(curiosity_weight=0.0009).curiosity
    AgentConfig(curiosity_weight=0.1, weight_decay_groups="icm.forward").validate()
    for bad in ({"curiosity_weight": -0.1}, {"curiosity_beta": 1.5}, {"curiosity_hidden": 0},
                {"kind": "ppo", "curiosity_weight": 0.1}):
        with pytest.raises(ConfigError):
            replace(AgentConfig(), **bad).validate()


def test_live_in_a_tiny_training_run(tmp_path, monkeypatch):
    """`--set agent.curiosity_weight=0.1`: metrics.jsonl's train records after the first train step
    carry a positive ICM loss and mean intrinsic reward (the component registry's liveness key)."""
    from click.testing import CliRunner

    from numbarl.cli import train_cmd
    from numbarl.rl import components

    monkeypatch.setenv("NUMBARL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    r = CliRunner().invoke(train_cmd, ["--preset", "tiny", "--quiet", "--epochs", "1", "--set", "data.synth_bars_per_day=12",
                                       "--set", "train.collect_steps_per_epoch=3", "--set", "train.log_interval=3",
                                       "--set", "train.learning_starts=2", "--set", "agent.curiosity_weight=0.1",
                                       "--out", str(out)], catch_exceptions=True)
    assert r.exit_code == 0, r.output + repr(r.exception)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [rec for rec in records if rec["kind"] == "train" and rec.get("train_step", 0) > 0]
    assert trained
    c = components.by_name()["icm_curiosity"]
    assert all(c.is_live(rec[c.liveness]) for rec in trained) and trained[-1]["icm_loss"] > 0
    assert trained[-1]["grad_norm.icm.forward"] > 0 and trained[-1]["grad_norm.icm.inverse"] > 0
