"""GPU checks of multi-horizon C51 (agent.horizons = "1,5,20", n_step = 5) at a real size: the blended
loss and d_logits of a train step against the float64 reference and the PyTorch peer on the step's own
buffers, graph replay == eager bitwise, and two same-seed runs bitwise identical.

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_mh.py -m gpu -q`
"""

import numpy as np
import pytest
from agent_helpers import agent_snapshot, capture_train_step, check_graph_replay_equals_eager
from agent_helpers import check_two_runs_bitwise_identical, train_steps
from agent_helpers import fill_replay as _fill

from numbarl.config import AgentConfig
from numbarl.cuda.runtime import stream
from numbarl.rl.agents.dqn import DQNAgent
from numbarl.rl.losses.multi_horizon import multi_horizon_loss_ref

pytestmark = pytest.mark.gpu

SIZES = (3, 3, 4, 4)
STATE_DIM, N_ENVS = 64, 64
# the regime column holds N(0, 1) values here: lo/hi of ±1 put the trend strengths all over [0, 1]
CFG = AgentConfig(trunk=(512, 512), n_atoms=51, batch_size=4096, replay_capacity=64 * N_ENVS, n_step=5, gamma=0.99,
                  horizons="1,5,20", horizon_regime_col=53, horizon_trend_lo=-1.0, horizon_trend_hi=1.0,
                  lock_aware_target=True, target_update="polyak", weight_decay=0.01)


def _agent(seed=1):
    return DQNAgent(CFG, STATE_DIM, SIZES, N_ENVS, seed=seed)


def _snapshot(agent, s):
    return agent_snapshot(agent, s, {"mh_loss": agent.mh.loss, "mh_weights": agent.mh.weights,
                                     "d_logits": agent.loss.d_logits})


def _step_inputs(agent):
    """The train step's own loss inputs, on the host: logits, actions, obs and the per-horizon dicts."""
    b, host = agent.replay.batch, (lambda x: x.copy_to_host())
    extra = {hb.horizon: hb for hb in b.horizons}
    hs = []
    for h in agent.horizons:
        src = b if h == CFG.n_step else extra[h]
        tag_next, tag_target = ("next", "target") if h == CFG.n_step else (f"next_h{h}", f"target_h{h}")
        hs.append({"next_q": host(agent.head.outputs(tag_next).q), "target_probs": host(agent.head.outputs(tag_target).probs),
                   "rewards": host(src.reward), "dones": host(src.done), "discounts": host(src.discount),
                   "next_mask": host(src.next_mask)})
    return host(agent.head.outputs("online").logits), host(b.action), host(b.obs), hs


def test_loss_matches_reference_and_peer_at_real_size(rng):
    pytest.importorskip("torch")
    from numbarl.rl.torch_peer_mh import multi_horizon_loss_and_grads

    agent = _agent()
    _fill(agent, rng, done_rate=0.02)
    s = stream()
    agent.train_step(s)
    s.synchronize()
    logits, actions, obs, hs = _step_inputs(agent)
    support = agent.head.support_host
    got_loss = float(agent.mh.loss.copy_to_host()[0])
    got = agent.loss.d_logits.copy_to_host()
    args = (CFG.horizon_regime_col, CFG.horizon_trend_lo, CFG.horizon_trend_hi, CFG.horizon_mix)
    loss, _, d_logits, _, trend, _ = multi_horizon_loss_ref(logits, actions, obs, hs, support, SIZES, *args)
    assert got_loss == pytest.approx(loss, rel=1e-5)
    assert np.max(np.abs(got - d_logits)) <= 1e-5 * np.max(np.abs(d_logits))
    assert 0.05 < trend.mean() < 0.95  # the blend's interior is exercised
    peer = multi_horizon_loss_and_grads(logits, actions, obs, hs, support, SIZES, *args, device="cuda")
    assert got_loss == pytest.approx(peer["loss"], rel=1e-5)
    np.testing.assert_allclose([lo.loss.copy_to_host()[0] for lo in agent.mh.losses], peer["parts"], rtol=1e-5)
    assert np.max(np.abs(got - peer["d_logits"])) <= 1e-5 * np.max(np.abs(peer["d_logits"]))
    stats = agent.read_stats(s)
    assert stats["loss"] == np.float32(got_loss) and stats["mh_ce_longest"] > 0


def test_graph_replay_equals_eager_bitwise(rng):
    eager, _, _ = check_graph_replay_equals_eager(_agent(), rng, _snapshot, train_steps, capture_train_step)
    assert np.isfinite(eager["mh_loss"][0]) and eager["mh_loss"][0] > 0


def test_two_runs_bitwise_identical(rng):
    check_two_runs_bitwise_identical(rng, lambda: _agent(seed=3), _snapshot, train_steps)
