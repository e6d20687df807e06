"""GPU checks of ICM curiosity (agent.curiosity_weight): the loss, the intrinsic reward and the models'
gradients against the float64 reference and the PyTorch peer at a real size (cuBLASLt GEMMs), graph
replay == eager bitwise and two same-seed runs bitwise identical for the agent's train steps with it on.

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_icm.py -m gpu -q`
"""

import numpy as np
import pytest
from agent_helpers import GPU_N_ENVS, GPU_SIZES, GPU_STATE_DIM, agent_snapshot, capture_train_step
from agent_helpers import check_graph_replay_equals_eager, check_two_runs_bitwise_identical, gpu_agent_config
from agent_helpers import train_steps
from agent_helpers import assert_bitwise as _assert_bitwise
from agent_helpers import fill_replay as _fill

from numbarl.cuda.runtime import stream
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.losses.icm import icm_loss_ref, intrinsic_reward_ref

pytestmark = pytest.mark.gpu

SIZES, STATE_DIM, N_ENVS = GPU_SIZES, GPU_STATE_DIM, GPU_N_ENVS
CFG = gpu_agent_config(curiosity_weight=0.1, curiosity_hidden=256)
N_STEPS = 3


def _agent(seed=1, **kw):
    from dataclasses import replace

    return DQNAgent(replace(CFG, **kw), STATE_DIM, SIZES, N_ENVS, seed=seed)


def _steps(agent, s, graph=None):
    train_steps(agent, s, graph, N_STEPS)


def _snapshot(agent, s):
    return agent_snapshot(agent, s, {"icm_loss": agent.icm_loss.loss, "rewards": agent.icm_loss.rewards})


def _inputs(agent):
    batch = agent.replay.batch
    return {"phi": agent.trunk.output("online").copy_to_host(), "phi_next": agent.trunk.output("next").copy_to_host(),
            "actions": batch.action.copy_to_host(), "dones": batch.done.copy_to_host(),
            "reward": batch.reward.copy_to_host()}


def _on_device_branch(agent, cache):
    """The float64 cache with each hidden ReLU on the device's side of 0. A pre-activation within
    float32 rounding of 0 can switch the ReLU the other way in float64 than on the device (seen on
    the H200: one flip among the B·hidden units gave a gradient element 1.8e-3 of the largest off);
    the reference then differentiates another branch of the function, so the comparison is made on
    the device's branch and what is left is rounding."""
    (c_f, c_i), out = cache, []
    for model, caches in ((agent.icm.forward_model, c_f), (agent.icm.inverse_model, c_i)):
        x, pre = caches[0]
        on = model.layers[0].output("online").copy_to_host() > 0  # the device's ReLU output
        pre = np.where(on == (pre > 0), pre, np.where(on, np.finfo(np.float64).tiny, 0.0))
        out.append([(x, pre)] + list(caches[1:]))
    return tuple(out)


def test_loss_and_reward_match_reference_at_real_size(rng):
    agent = _agent()
    _fill(agent, rng)
    s = stream()
    before = agent.store.to_host("params")
    agent.train_step(s)
    s.synchronize()
    x = _inputs(agent)
    p = {k: np.asarray(v, np.float64) for k, v in before.items()}
    phi_hat, logits, cache = agent.icm.forward_ref(x["phi"], x["phi_next"], x["actions"], p)
    r = icm_loss_ref(phi_hat, x["phi_next"], logits, x["actions"], x["dones"], SIZES, beta=CFG.curiosity_beta)
    assert float(agent.icm_loss.loss.copy_to_host()[0]) == pytest.approx(r["loss"], rel=1e-4)
    _, reward_ref, scale = intrinsic_reward_ref(r["error"], x["reward"], CFG.curiosity_weight, -1.0, r["mean_error"])
    got = agent.icm_loss.rewards.copy_to_host()
    assert np.max(np.abs(got - reward_ref)) <= 1e-4 * max(np.max(np.abs(reward_ref)), 1.0)
    grads = agent.store.to_host("grads")
    g_ref = agent.icm.backward_ref(r["d_phi_hat"], r["d_logits"], _on_device_branch(agent, cache), p)
    for name, ref in g_ref.items():
        assert np.max(np.abs(grads[name] - ref)) <= 1e-4 * np.max(np.abs(ref)), name
    stats = agent.read_stats(s)
    assert stats["intrinsic_reward_mean"] > 0 and stats["icm_error_scale"] == pytest.approx(scale, rel=1e-4)


def test_kernels_match_the_pytorch_peer(rng):
    """The agent's ICM pass at a real size against autograd on the same weights and batch (fp32, torch
    on the GPU when it has CUDA): losses and gradients within 1e-5 relative."""
    torch = pytest.importorskip("torch")
    from numbarl.rl.torch_peer_icm import icm_loss_and_grads

    agent = _agent()
    _fill(agent, rng)
    s = stream()
    before = agent.store.to_host("params")
    agent.train_step(s)
    s.synchronize()
    x = _inputs(agent)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    peer = icm_loss_and_grads(before, x["phi"], x["phi_next"], x["actions"], x["dones"], SIZES,
                              beta=CFG.curiosity_beta, weight=CFG.curiosity_weight, device=device)
    assert float(agent.icm_loss.loss.copy_to_host()[0]) == pytest.approx(peer["loss"], rel=1e-5)
    grads = agent.store.to_host("grads")
    for name, g in peer["grads"].items():
        assert np.max(np.abs(grads[name] - g)) <= 1e-5 * np.max(np.abs(g)), name
    r_i = agent.icm_loss.rewards.copy_to_host() - x["reward"]
    assert np.max(np.abs(r_i - peer["r_i"])) <= 1e-5 * max(np.max(np.abs(peer["r_i"])), 1.0)


@pytest.mark.parametrize("trunk_grad", [False, True])
def test_graph_replay_equals_eager_bitwise(rng, trunk_grad):
    agent = _agent(curiosity_trunk_grad=trunk_grad)
    eager, _, _ = check_graph_replay_equals_eager(agent, rng, _snapshot, _steps, capture_train_step)
    assert np.isfinite(eager["icm_loss"][0]) and eager["icm/scale"][0] > 0


@pytest.mark.parametrize("trunk_grad", [False, True])
def test_two_runs_bitwise_identical(rng, trunk_grad):
    check_two_runs_bitwise_identical(rng, lambda: _agent(seed=3, curiosity_trunk_grad=trunk_grad), _snapshot, _steps)


def test_off_is_bitwise_the_plain_agent(rng):
    """curiosity_weight below 0.001: the train step's bits are those of an agent without the field set."""
    seed = int(rng.integers(2**31))
    snaps = []
    for weight in (0.0, 0.0005):
        agent = _agent(seed=3, curiosity_weight=weight)
        assert agent.icm is None
        _fill(agent, np.random.default_rng(seed))
        s = stream()
        _steps(agent, s)
        out = dict(agent.state_arrays())
        out.update({f"grads/{k}": v for k, v in agent.store.to_host("grads").items()})
        snaps.append(out)
    _assert_bitwise(*snaps)
