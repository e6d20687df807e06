"""GPU checks of PPO (agent.kind = "ppo"): the loss against its float64 reference at a real size, the
update (GAE, normalization, K x M minibatch steps) captured as a graph == eager bitwise, two runs bitwise,
and the agent's own step functions on a device env (collect graph + update graph, replayed as the trainer
does) == the same steps run eagerly, bitwise.

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_ppo.py -m gpu -q`
"""

import numpy as np
import pytest

from numbarl.config import AgentConfig
from numbarl.cuda import graph as cuda_graph
from numbarl.cuda.runtime import stream, upload
from numbarl.rl.agents.ppo import PPOAgent
from numbarl.rl.losses.ppo import ppo_loss_ref

pytestmark = pytest.mark.gpu

SIZES = (3, 3, 4, 4)
STATE_DIM, N_ENVS, T = 64, 256, 32
CFG = AgentConfig(kind="ppo", trunk=(512, 512), ppo_rollout=T, ppo_epochs=4, ppo_minibatches=4, weight_decay=0.01,
                  max_grad_norm=0.5)


def _agent(seed=1):
    return PPOAgent(CFG, STATE_DIM, SIZES, N_ENVS, seed=seed)


def _fill(agent, rng):
    nb, A = len(SIZES), max(SIZES)
    mask = np.zeros((T, N_ENVS, nb, A), np.uint8)
    actions = np.zeros((T, N_ENVS, nb), np.int32)
    for k, n in enumerate(SIZES):
        mask[..., k, :n] = 1
        actions[..., k] = rng.integers(0, n, (T, N_ENVS))
    mask[..., 0, 0] = rng.random((T, N_ENVS)) < 0.8  # a direction lock on some rows
    actions[..., 0] = np.where(mask[..., 0, 0] == 0, 1 + rng.integers(0, 2, (T, N_ENVS)), actions[..., 0])
    agent.rollout.load({"obs": rng.normal(0, 1, (T, N_ENVS, STATE_DIM)).astype(np.float32), "actions": actions,
                        "logp": (-np.log(np.prod(SIZES)) + rng.normal(0, 0.3, (T, N_ENVS))).astype(np.float32),
                        "value": rng.normal(0, 1, (T, N_ENVS)).astype(np.float32),
                        "reward": (rng.standard_normal((T, N_ENVS)) * 0.5).astype(np.float32),
                        "done": (rng.random((T, N_ENVS)) < 0.05).astype(np.uint8), "mask": mask})
    # upload: complete on return (a plain to_device goes through the legacy stream, which the
    # non-blocking compute stream does not wait for)
    return upload(rng.normal(0, 1, (N_ENVS, 1)).astype(np.float32))


def _snapshot(agent, s):
    out = dict(agent.state_arrays())
    out.pop("agent/stats")
    out["loss"] = agent.loss.loss.copy_to_host(stream=s)
    out.update({f"grads/{k}": v for k, v in agent.store.to_host("grads").items()})
    s.synchronize()
    return out


def _assert_bitwise(a, b):
    assert set(a) == set(b)
    for k in a:
        assert np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes(), f"{k} differs"


def test_loss_matches_reference_at_real_size(rng):
    agent = _agent()
    boot = _fill(agent, rng)
    s = stream()
    agent.train_on_rollout(boot, s)
    s.synchronize()
    w = agent.work.to_host()
    x = {"logits": agent.pi.output("train").copy_to_host(), "value": agent.v.output("train").copy_to_host(),
             "actions": w["mb_actions"], "logp_old": w["mb_logp"], "adv": w["mb_adv"], "ret": w["mb_ret"], "mask": w["mb_mask"]}
    loss, _, d_logits, _ = ppo_loss_ref(**x, branch_sizes=SIZES)
    assert float(agent.loss.loss.copy_to_host()[0]) == pytest.approx(loss, rel=1e-5, abs=1e-6)
    got = agent.loss.grad("logits").copy_to_host()
    assert np.max(np.abs(got - d_logits)) <= 1e-5 * np.max(np.abs(d_logits))
    stats = agent.read_stats(s)
    assert stats["approx_kl"] > 0 and stats["train_step"] == 16 and stats["nonfinite_step"] == -1


def test_graph_replay_equals_eager_bitwise(rng):
    agent = _agent()
    boot = _fill(agent, rng)
    s = stream()
    start = agent.state_arrays()
    for _ in range(2):
        agent.train_on_rollout(boot, s)
    s.synchronize()
    eager = _snapshot(agent, s)
    graph = cuda_graph.capture(lambda st: agent.train_on_rollout(boot, st), stream=s, warmup=False)
    agent.load_state(start)
    for _ in range(2):
        graph.replay(s)
    s.synchronize()
    _assert_bitwise(eager, _snapshot(agent, s))


def test_two_runs_bitwise_identical(rng):
    seed = int(rng.integers(2**31))
    snaps = []
    for _ in range(2):
        agent = _agent(seed=3)
        boot = _fill(agent, np.random.default_rng(seed))
        s = stream()
        agent.train_on_rollout(boot, s)
        agent.train_on_rollout(boot, s)
        s.synchronize()
        snaps.append(_snapshot(agent, s))
    _assert_bitwise(*snaps)


def _env_run(use_graph: bool, iterations: int = 2):
    """T collect steps + the update, `iterations` times, on a device env over a synthetic market: the
    trainer's schedule (each graph captured on first use, the capture's warm-up run being that step)."""
    from numbarl.bench.train import _market
    from numbarl.env.device import DeviceEnv
    from numbarl.env.params import EnvParams

    params = EnvParams()
    market = _market(20_000, 16, 0).to_device(params.vol_span, params.vol_horizon_bars)
    cfg = AgentConfig(kind="ppo", trunk=(64, 64), ppo_rollout=16, ppo_epochs=2, ppo_minibatches=4, max_grad_norm=0.5)
    s = stream()
    env = DeviceEnv(market, params, 256, seed=4)
    agent = PPOAgent(cfg, env.state_dim, params.branch_sizes, 256, seed=4)
    env.reset(4, s)
    steps, graphs = agent.step_functions(env), {}
    for n in range(1, iterations * agent.T + 1):
        for name in ["collect", *agent.after_collect(n, 0, 1)]:
            if name not in graphs:
                graphs[name] = cuda_graph.capture(steps[name], s, eager=not use_graph)
            else:
                graphs[name].replay(s)
    s.synchronize()
    out = _snapshot(agent, s)
    out.update({f"env/{k}": v for k, v in env.arena.to_host().items()})
    return agent, out


def test_collect_and_update_graphs_equal_eager_bitwise():
    agent, graphed = _env_run(True)
    _, eager = _env_run(False)
    _assert_bitwise(eager, graphed)
    stats = agent.read_stats(stream())
    assert stats["ppo_updates"] == 2 and stats["train_step"] == 2 * 2 * 4 and stats["nonfinite_step"] == -1
    assert stats["collect_step"] == 32 and np.isfinite(stats["loss"]) and stats["entropy"] > 0
    # every sampled action was allowed by the mask stored beside it
    a, m = graphed["replay/actions"], graphed["replay/mask"]
    taken = np.take_along_axis(m, a[..., None].astype(np.int64), axis=3)[..., 0]
    assert np.all(taken == 1)
