"""GPU checks of the C51 agent's temporal input (agent.temporal = "mamba", numbarl/rl/temporal.py) at a real
size: graph replay == eager bitwise and two same-seed runs bitwise identical for the train step (windows
gathered from the replay, the scan on every pass, BPTT into the scan's gradients; also with Mamba2's causal
convolution, agent.temporal_conv = 4), and the backtest's scores (the per-policy window ring) replayed from a
graph bitwise as run eagerly.

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_temporal.py -m gpu -q`
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
    gpu_agent_config,
    train_steps,
)

from numbarl.cuda import graph as cuda_graph
from numbarl.cuda.runtime import cuda, stream
from numbarl.rl.agents.dqn import DQNAgent

pytestmark = pytest.mark.gpu

SIZES, STATE_DIM, N_ENVS, P = GPU_SIZES, GPU_STATE_DIM, GPU_N_ENVS, 4
CFG = gpu_agent_config(temporal="mamba", temporal_steps=8, temporal_heads=8)
CFG_CONV = gpu_agent_config(temporal="mamba", temporal_steps=8, temporal_heads=8, temporal_conv=4)


def _agent(seed=1, conv=False):
    return DQNAgent(CFG_CONV if conv else CFG, STATE_DIM, SIZES, N_ENVS, seed=seed, eval_batch=P)


def _snapshot(agent, s):
    st = agent.temporal.state
    return agent_snapshot(agent, s, {"obs.x": st["obs.x"], "next.mask": st["next.mask"],
                                     "h_online": agent.temporal.scan.output("online")})


@pytest.mark.parametrize("conv", [False, True])
def test_graph_replay_equals_eager_bitwise(rng, conv):
    eager, _, _ = check_graph_replay_equals_eager(_agent(conv=conv), rng, _snapshot, steps=train_steps,
                                                  capture=capture_train_step)
    for name in ("w_in",) + (("conv",) if conv else ()):
        g = eager[f"grads/temporal.mamba.{name}"]
        assert np.all(np.isfinite(g)) and np.any(g != 0), name


@pytest.mark.parametrize("conv", [False, True])
def test_two_runs_bitwise_identical(rng, conv):
    check_two_runs_bitwise_identical(rng, lambda: _agent(seed=3, conv=conv), _snapshot, steps=train_steps)


def test_backtest_scores_graph_equals_eager(rng):
    """A bar sequence scored eagerly, then (after reset_eval) by replays of a captured scores graph fed the
    same bars through one fixed obs buffer: the same scores, bitwise."""
    agent = _agent()
    s = stream()
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
    assert eager.tobytes() == replayed.tobytes()
    assert not np.array_equal(eager[0], eager[-1])
