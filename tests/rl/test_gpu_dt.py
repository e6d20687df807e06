"""GPU checks of the Decision Transformer (agent.kind = "dt"): the network + loss against the PyTorch peer
at a real size (cuBLASLt GEMMs), the update (returns, K gradient steps) captured as a graph == eager
bitwise, the acting path (scores over a few bars) graph == eager bitwise, two runs bitwise identical,
and two same-seed tiny training runs (collect, update and backtest graphs) with identical metrics.

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_dt.py -m gpu -q`
"""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from numbarl.config import AgentConfig
from numbarl.cuda import graph as cuda_graph
from numbarl.cuda.runtime import cuda, stream
from numbarl.rl.agents.dt import DTAgent

pytestmark = pytest.mark.gpu

SIZES = (3, 3, 4, 4)
STATE_DIM, N_ENVS, T = 64, 256, 48
CFG = AgentConfig(kind="dt", dt_rollout=T, dt_context=8, dt_batch=64, dt_updates=4, dt_embed=64, dt_heads=2,
                  dt_layers=2, weight_decay=0.01, max_grad_norm=0.5)


def _agent(seed=1, eval_batch=1):
    return DTAgent(CFG, STATE_DIM, SIZES, N_ENVS, seed=seed, eval_batch=eval_batch)


def _fill(agent, rng):
    actions = np.stack([rng.integers(0, n, (T, N_ENVS)) for n in SIZES], -1).astype(np.int32)
    agent.data.load({"obs": rng.normal(0, 1, (T, N_ENVS, agent.token_dim)).astype(np.float32), "actions": actions,
                     "reward": (rng.standard_normal((T, N_ENVS)) * 0.5).astype(np.float32),
                     "done": (rng.random((T, N_ENVS)) < 0.02).astype(np.uint8)})


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


def test_attention_core_matches_reference_at_real_size(rng):
    """The causal attention kernels at the DT's default shape (64 windows of 3 x 8 tokens, 2 heads of 32)
    against the float64 reference, forward and backward."""
    from numbarl.cuda.runtime import Arena
    from numbarl.cuda.testing import assert_close
    from numbarl.rl.nets.attention import CausalAttentionCore, attention_backward_ref, attention_forward_ref

    E, H, T, n_seq = 64, 2, 24, 64
    core = CausalAttentionCore("core", E, H, T)
    acts = Arena("acts")
    core.declare_acts(acts, n_seq * T, "online")
    acts.allocate()
    qkv = rng.normal(0, 1, (n_seq * T, 3 * E)).astype(np.float32)
    dy = rng.normal(0, 1, (n_seq * T, E)).astype(np.float32)
    s = stream()
    y = core.forward(cuda().to_device(qkv), s)
    dx = core.backward(cuda().to_device(dy), s)
    y_ref, probs = attention_forward_ref(qkv, T, H)
    assert_close(y.copy_to_host(stream=s), y_ref, 1e-5, 1e-4)
    assert_close(dx.copy_to_host(stream=s), attention_backward_ref(dy, qkv, probs, T, H), 1e-5, 1e-4)


def test_step_matches_pytorch_peer_at_real_size(rng):
    """One gradient step (update with K = 1): the loss and every gradient against the PyTorch peer on the
    same weights and the batch the step drew, relative error <= 1e-5 (fp32)."""
    pytest.importorskip("torch")
    from numbarl.rl.torch_peer_dt import dt_loss_and_grads

    agent = _agent()
    _fill(agent, rng)
    agent.K = 1
    params = {k: v.astype(np.float64) for k, v in agent.store.to_host("params").items()}
    s = stream()
    agent.update_step(s)
    s.synchronize()
    w = agent.work.to_host()
    device = "cuda" if __import__("torch").cuda.is_available() else "cpu"
    peer = dt_loss_and_grads(agent.net, params, w["tokens"], w["mb_actions"], device=device)
    assert float(agent.loss.loss.copy_to_host()[0]) == pytest.approx(peer["loss"], rel=1e-5)
    grads = agent.store.to_host("grads")
    for name, want in peer["grads"].items():
        assert np.max(np.abs(grads[name] - want)) <= 1e-5 * np.max(np.abs(want)), name
    stats = agent.read_stats(s)
    assert stats["train_step"] == 1 and stats["dt_action_acc"] > 0 and stats["nonfinite_step"] == -1


def test_update_graph_replay_equals_eager_bitwise(rng):
    agent = _agent()
    _fill(agent, rng)
    s = stream()
    start = agent.state_arrays()
    for _ in range(2):
        agent.update_step(s)
    s.synchronize()
    eager = _snapshot(agent, s)
    graph = cuda_graph.capture(agent.update_step, stream=s, warmup=False)
    agent.load_state(start)
    for _ in range(2):
        graph.replay(s)
    s.synchronize()
    _assert_bitwise(eager, _snapshot(agent, s))


def test_scores_graph_replay_equals_eager_bitwise(rng):
    """Ten bars of acting (the history fills and then shifts): one captured scores() replayed per bar ==
    eager calls, bitwise, for the scores and the carried state."""
    P = 3
    agent = _agent(eval_batch=P)
    _fill(agent, rng)
    agent.update_step(stream())
    obs_bars = rng.normal(0, 1, (10, P, STATE_DIM)).astype(np.float32)
    obs = cuda().device_array((P, STATE_DIM), np.float32)
    out = cuda().device_array((P, len(SIZES), max(SIZES)), np.float32)
    s = stream()

    def run(step):
        agent.reset_eval(s)
        got = []
        for x in obs_bars:
            obs.copy_to_device(x, stream=s)
            step(s)
            got.append(out.copy_to_host(stream=s))
        s.synchronize()
        return np.stack(got), agent.eval_state.to_host()

    eager_scores, eager_state = run(lambda st: agent.scores(obs, out, st))
    graph = cuda_graph.capture(lambda st: agent.scores(obs, out, st), stream=s)
    graph_scores, graph_state = run(graph.replay)
    assert eager_scores.tobytes() == graph_scores.tobytes()
    _assert_bitwise(eager_state, graph_state)


def test_collect_and_update_graphs_equal_eager_bitwise(rng):
    """Two datasets on a real device env (the behavior with noise, the env step, the update after every
    T-th collect step): captured collect and update graphs == the eager steps, bitwise, for the
    dataset, the parameters, the optimizer state and the env."""
    from test_dt import market_data

    from numbarl.env.device import DeviceEnv
    from numbarl.env.params import EnvParams

    params = EnvParams()
    env = DeviceEnv(market_data(rng, n_bars=400, n_features=16), params, N_ENVS, bar_range=(0, 350), seed=9)
    s = stream()
    env.reset(9, s)
    cfg = AgentConfig(kind="dt", dt_rollout=16, dt_context=8, dt_batch=32, dt_updates=2, dt_embed=32, dt_heads=2)
    agent = DTAgent(cfg, env.state_dim, params.branch_sizes, N_ENVS, seed=2)
    steps = agent.step_functions(env)
    start_agent, start_env = agent.state_arrays(), env.arena.to_host()

    def run(collect, update):
        for t in range(1, 2 * cfg.dt_rollout + 1):
            collect(s)
            if agent.after_collect(t, 0, 1):
                update(s)
        s.synchronize()
        return {**_snapshot(agent, s), **{f"env/{k}": v for k, v in env.arena.to_host().items()}}

    eager = run(steps["collect"], steps["update"])
    graphs = {name: cuda_graph.capture(fn, stream=s, warmup=False) for name, fn in steps.items()}
    agent.load_state(start_agent)
    env.arena.load(start_env)
    _assert_bitwise(eager, run(graphs["collect"].replay, graphs["update"].replay))
    assert eager["agent/updates"][0] == 2


def test_two_runs_bitwise_identical(rng):
    seed = int(rng.integers(2**31))
    snaps = []
    for _ in range(2):
        agent = _agent(seed=3)
        _fill(agent, np.random.default_rng(seed))
        s = stream()
        agent.update_step(s)
        agent.update_step(s)
        s.synchronize()
        snaps.append(_snapshot(agent, s))
    _assert_bitwise(*snaps)


def test_same_seed_training_runs_are_identical(tmp_path, monkeypatch):
    """Two tiny training runs with the same seed (collect with the behavior policy, the update graph, the
    validation and test backtests as graphs): every train record's statistics and the test metrics equal."""
    from numbarl.cli import train_cmd

    monkeypatch.setenv("NUMBARL_CACHE", str(tmp_path / "cache"))
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        r = CliRunner().invoke(train_cmd, ["--preset", "tiny", "--quiet", "--epochs", "2", "--set", "agent.kind=dt",
                                           "--set", "agent.dt_rollout=3", "--set", "agent.dt_context=2",
                                           "--set", "agent.dt_updates=2", "--set", "agent.dt_batch=8",
                                           "--seed", "7", "--out", str(out)], catch_exceptions=True)
        assert r.exit_code == 0, r.output + repr(r.exception)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        drop = ("time", "elapsed_s", "env_steps_per_s")
        runs.append([{k: v for k, v in rec.items() if k not in drop and not k.endswith("_s")}
                     for rec in records if rec["kind"] in ("train", "val")])
    assert runs[0] == runs[1]
    assert any(rec.get("dt_updates", 0) >= 1 for rec in runs[0])
