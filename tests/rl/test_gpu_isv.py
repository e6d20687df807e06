"""GPU checks of the ISV signals and the ISV temporal routing (agent.isv, agent.isv_routing; numbarl/rl/isv.py) at
a real size: the ISV after real train steps is the float64 recursion of their logged stats; with the routing on
(temporal input, K = 8) graph replay == eager bitwise and two same-seed runs bitwise identical for the train step
(the ISV update inside the graph, the routing on every pass and in the backward), and the backtest's scores with
the routing replayed from a graph bitwise as run eagerly, with the ISV frozen between train steps.

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_isv.py -m gpu -q`
"""

import numpy as np
import pytest
from agent_helpers import (
    GPU_N_ENVS,
    GPU_SIZES,
    GPU_STATE_DIM,
    agent_snapshot,
    capture_train_step,
    check_graph_replay_equals_eager,
    check_two_runs_bitwise_identical,
    fill_replay,
    gpu_agent_config,
    train_steps,
)

from numbarl.cuda import graph as cuda_graph
from numbarl.cuda.runtime import cuda, stream
from numbarl.cuda.testing import assert_close
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.isv import N_INPUTS, N_ISV, isv_update_ref

pytestmark = pytest.mark.gpu

SIZES, STATE_DIM, N_ENVS, P = GPU_SIZES, GPU_STATE_DIM, GPU_N_ENVS, 4
CFG = gpu_agent_config(temporal="mamba", temporal_steps=8, temporal_heads=8, isv_routing=True)


def _agent(seed=1, cfg=CFG):
    return DQNAgent(cfg, STATE_DIM, SIZES, N_ENVS, seed=seed, eval_batch=P)


def _snapshot(agent, s):
    route = agent.temporal.route
    return agent_snapshot(agent, s, {"h_online": route.output("online"),
                                     "w_online": route._arena("online")["temporal.route.online.w"],
                                     "g_online": route._arena("online")["temporal.route.online.g"],
                                     "isv": agent.isv.vector})


def test_isv_is_the_recursion_of_the_logged_stats():
    """agent.isv alone (no temporal input): five train steps, each step's stats read back; the device ISV is
    the float64 recursion of them (float32 state: 1e-5 relative), non-zero."""
    agent = _agent(cfg=gpu_agent_config(isv=True))
    fill_replay(agent, np.random.default_rng(0))
    s = stream()
    v, n = np.zeros(N_ISV), np.zeros(N_INPUTS, np.int64)
    for _ in range(5):
        agent.train_step(s)
        st = agent.read_stats(s)
        v, n = isv_update_ref(v, n, st["loss"], st["grad_norm"], st["q_mean"], st["q_next_max"], st["clip_scale"])
    got = agent.isv.vector.copy_to_host(stream=s)
    s.synchronize()
    assert_close(got, v, 1e-6, 1e-5)
    assert np.count_nonzero(got) >= 6


def test_graph_replay_equals_eager_bitwise(rng):
    eager, _, _ = check_graph_replay_equals_eager(_agent(), rng, _snapshot, steps=train_steps,
                                                  capture=capture_train_step)
    for name in ("grads/temporal.route.w_r", "grads/temporal.route.b_r", "grads/temporal.mamba.w_in"):
        assert np.all(np.isfinite(eager[name])) and np.any(eager[name] != 0), name
    assert np.any(eager["isv"] != 0)


def test_two_runs_bitwise_identical(rng):
    check_two_runs_bitwise_identical(rng, lambda: _agent(seed=3), _snapshot, steps=train_steps)


def test_backtest_scores_graph_equals_eager_with_frozen_isv(rng):
    """After two train steps (a non-zero ISV), a bar sequence scored eagerly, then (after reset_eval) by
    replays of a captured scores graph fed the same bars: the same scores bitwise, and the ISV unchanged by
    the backtest (frozen: only train steps write it)."""
    agent = _agent()
    fill_replay(agent, rng)
    s = stream()
    train_steps(agent, s, n=2)
    isv = agent.isv.vector.copy_to_host(stream=s)
    s.synchronize()
    assert np.any(isv != 0)
    bars = rng.standard_normal((10, P, STATE_DIM)).astype(np.float32)
    obs = cuda().device_array((P, STATE_DIM), np.float32)
    q = cuda().device_array((P, len(SIZES), max(SIZES)), np.float32)

    def run(step):
        agent.reset_eval(s)
        out = []
        for bar in bars:
            obs.copy_to_device(bar, stream=s)
            step(s)
            out.append(q.copy_to_host(stream=s))
        s.synchronize()
        return np.stack(out)

    eager = run(lambda st: agent.scores(obs, q, st))
    graph = cuda_graph.capture(lambda st: agent.scores(obs, q, st), stream=s, warmup=False)
    replayed = run(graph.replay)
    after = agent.isv.vector.copy_to_host(stream=s)
    s.synchronize()
    assert eager.tobytes() == replayed.tobytes()
    assert after.tobytes() == isv.tobytes()
