"""GPU checks of the bootstrapped ensemble of C51 heads and the epistemic gate (agent.ensemble_heads,
agent.epistemic_theta): the masks, the extra heads' masked C51 losses, their parameter gradients and the trunk's
dh against their float64 references at a real size, the gate on the acting pass against its reference, graph
replay == eager bitwise and two runs bitwise identical for the agent's train steps (an aux step, a step without
it, an aux step), alone and with IQN (two kinds of auxiliary heads adding into one dh, the IQN readiness as the
gate's budget).

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_ensemble.py -m gpu -q`
"""

from dataclasses import replace

import numpy as np
import pytest
from agent_helpers import GPU_N_ENVS, GPU_SIZES, GPU_STATE_DIM, agent_snapshot, check_graph_replay_equals_eager
from agent_helpers import check_two_runs_bitwise_identical, gpu_agent_config
from agent_helpers import fill_replay as _fill

from numbarl.cuda.runtime import cuda, stream
from numbarl.env.params import DIR_LONG, DIR_SHORT
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.losses.c51 import c51_loss_ref
from numbarl.rl.nets.c51_head import head_backward_ref, head_forward_ref
from numbarl.rl.nets.ensemble import (
    EpistemicGate,
    bootstrap_mask_ref,
    direction_q_ref,
    epistemic_score_ref,
    gate_ref,
)

pytestmark = pytest.mark.gpu

SIZES, STATE_DIM, N_ENVS = GPU_SIZES, GPU_STATE_DIM, GPU_N_ENVS
CFG = gpu_agent_config(ensemble_heads=5, epistemic_theta=0.05, aux_frequency=2)
WITH_IQN = replace(CFG, iqn=True, iqn_quantiles=8, iqn_embed=16)
KEYS = ("w_value", "b_value", "w_adv", "b_adv")


def _agent(seed=1, cfg=None):
    return DQNAgent(cfg or CFG, STATE_DIM, SIZES, N_ENVS, seed=seed)


def _snapshot(agent, s):
    arrays = {"ensemble_mask": agent.ens_state["mask"]}
    for m, loss in enumerate(agent.ens_losses):
        arrays[f"ensemble_loss.{m}"] = loss.loss
        arrays[f"ensemble_d_logits.{m}"] = loss.d_logits
    arrays["dh"] = agent.aux_state["dh"]
    return agent_snapshot(agent, s, arrays)


def _close(got, want, rel=1e-4):
    assert np.max(np.abs(np.asarray(got, np.float64) - want)) <= rel * max(np.max(np.abs(want)), 1e-12)


def test_losses_gradients_and_dh_match_reference_at_real_size(rng):
    agent = _agent()
    _fill(agent, rng, done_rate=0.05)
    s = stream()
    params = {k: np.asarray(v, np.float64) for k, v in agent.store.to_host("params").items()}
    agent.train_step(s, aux=True)
    s.synchronize()
    batch = agent.replay.batch
    h = agent.trunk.output("online").copy_to_host().astype(np.float64)
    actions, rewards = batch.action.copy_to_host(), batch.reward.copy_to_host()
    dones, discounts = batch.done.copy_to_host(), batch.discount.copy_to_host()
    masks = bootstrap_mask_ref(agent.seed, batch.index.copy_to_host(), len(agent.ens_heads))
    np.testing.assert_array_equal(agent.ens_state["mask"].copy_to_host(), masks)
    assert abs(masks.mean() - 0.5) < 5 * 0.5 / np.sqrt(masks.size)  # Bernoulli(1/2): within five standard errors
    grads = agent.store.to_host("grads")
    support = agent.head.support_host
    dh_extra = np.zeros_like(h)
    q_heads = []
    for m, (head, loss) in enumerate(zip(agent.ens_heads, agent.ens_losses)):
        w = [params[head.param_names[k]] for k in KEYS]
        logits_ref, _, q_ref = head_forward_ref(h, *w, SIZES, support)
        logits = head.outputs("online").logits.copy_to_host()
        np.testing.assert_allclose(logits, logits_ref, rtol=1e-3, atol=1e-3)  # fp32 GEMMs vs float64
        q_heads.append(q_ref)
        # the loss kernels on the device's own next-Q and target probabilities (no argmax near-tie flips)
        ref_loss, _, d_logits, _ = c51_loss_ref(logits, actions, head.outputs("next").q.copy_to_host(),
                                                head.outputs("target").probs.copy_to_host(), rewards, dones, discounts,
                                                support, SIZES, weights=masks[m])
        assert float(loss.loss.copy_to_host()[0]) == pytest.approx(ref_loss, rel=1e-5)
        _close(loss.d_logits.copy_to_host(), d_logits, 1e-5)
        g = head_backward_ref(h, w[0], w[2], loss.d_logits.copy_to_host(), SIZES)
        for key, gkey in zip(KEYS, ("dw_value", "db_value", "dw_adv", "db_adv")):
            _close(grads[head.param_names[key]], g[gkey])
        dh_extra += g["dh"]
    main = agent.head.param_names
    dh_main = head_backward_ref(h, params[main["w_value"]], params[main["w_adv"]], agent.logits_grad_host(),
                                SIZES)["dh"]
    _close(agent.aux_state["dh"].copy_to_host(), dh_main + dh_extra)
    q0 = head_forward_ref(h, *[params[main[k]] for k in KEYS], SIZES, support)[2]
    u = epistemic_score_ref(direction_q_ref([q0, *q_heads], actions))
    assert agent.read_stats(s)["ensemble_std"] == pytest.approx(float(u.mean()), rel=1e-3)


def test_gate_on_the_acting_pass_matches_reference(rng):
    agent = _agent()
    s = stream()
    obs = rng.normal(0, 1, (N_ENVS, STATE_DIM)).astype(np.float32)
    col = agent.ens_gate.position_col
    obs[: N_ENVS // 2, col] = 0.0  # half the envs flat
    obs[N_ENVS // 2:, col] = 1.0
    mask = np.ones((N_ENVS, len(SIZES), max(SIZES)), np.uint8)
    d_obs, d_mask = cuda().to_device(obs), cuda().to_device(mask)
    agent.forward(d_obs, s, tag="act")
    agent.ens_gate.on_mask(agent.trunk.output("act"), d_obs, d_mask, s, tag="act")
    s.synchronize()
    q = [x.outputs("act").q.copy_to_host() for x in (agent.head, *agent.ens_heads)]
    score = epistemic_score_ref(direction_q_ref(q))
    flat = obs[:, col] == 0
    # the agent's θ, and a θ at the median score of the flat envs (some entries gated, some not)
    for theta in (CFG.epistemic_theta, float(np.median(score[flat]))):
        gate = EpistemicGate([agent.head, *agent.ens_heads], theta, N_ENVS, 1, col)
        d_mask = cuda().to_device(mask)
        gate.on_mask(agent.trunk.output("act"), d_obs, d_mask, s, tag="act")
        got = d_mask.copy_to_host()[:, 0, [DIR_SHORT, DIR_LONG]] == 0
        want = gate_ref(score, flat, theta)
        near = np.abs(score - theta) <= 1e-5 * theta  # float32 vs float64 at the threshold
        np.testing.assert_array_equal(got[~near], want[~near])
        assert not got[~flat].any()  # never an env in a position
    assert want[flat].any() and not want[flat].all()


@pytest.mark.parametrize("cfg", [CFG, WITH_IQN], ids=["ensemble", "with_iqn"])
def test_graph_replay_equals_eager_bitwise(rng, cfg):
    eager, _, _ = check_graph_replay_equals_eager(_agent(cfg=cfg), rng, _snapshot)
    assert np.isfinite(eager["ensemble_loss.0"][0]) and eager["ensemble_loss.0"][0] > 0


@pytest.mark.parametrize("cfg", [CFG, WITH_IQN], ids=["ensemble", "with_iqn"])
def test_two_runs_bitwise_identical(rng, cfg):
    check_two_runs_bitwise_identical(rng, lambda: _agent(seed=3, cfg=cfg), _snapshot)
