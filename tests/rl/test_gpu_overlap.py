"""agent.overlap on the GPU, where the forked streams really run side by side: the train step with the passes and
the weight gradients on their own streams gives the one-stream step's bits, eagerly and as a CUDA graph, at the
benchmark's batch (16,384) in fp32 and TF32.

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_overlap.py -m gpu -q`.
"""

import numpy as np
import pytest

from agent_helpers import GPU_N_ENVS, GPU_STATE_DIM, agent_snapshot, assert_bitwise, capture_train_step, fill_replay
from agent_helpers import gpu_agent_config, train_steps

pytestmark = pytest.mark.gpu

SIZES = (3, 3, 4, 4)


def _agent(overlap: bool, compute: str):
    from dataclasses import replace

    from numbarl.rl.agents.dqn import DQNAgent

    cfg = replace(gpu_agent_config(overlap=overlap, compute=compute), batch_size=16384)
    return DQNAgent(cfg, GPU_STATE_DIM, SIZES, GPU_N_ENVS, seed=3)


@pytest.mark.parametrize("compute", ["fp32", "tf32"])
def test_overlapped_train_step_gives_the_one_stream_bits(compute):
    """Five train steps with agent.overlap off (eager), on (eager) and on (one captured graph, replayed): the
    parameters, targets, optimizer state, replay, stats and gradients bit for bit."""
    from numbarl.cuda.runtime import stream

    snaps = []
    for overlap, graphed in ((False, False), (True, False), (True, True)):
        agent = _agent(overlap, compute)
        assert agent.overlap == overlap
        fill_replay(agent, np.random.default_rng(11))
        s = stream()
        if graphed:
            agent.train_step(s)  # the capture's warm-up: plans and workspaces of every stream
            s.synchronize()
            graph = capture_train_step(agent, s)
            train_steps(agent, s, graph, n=4)
        else:
            train_steps(agent, s, n=5)
        snaps.append(agent_snapshot(agent, s))
    assert_bitwise(snaps[0], snaps[1])
    assert_bitwise(snaps[0], snaps[2])
