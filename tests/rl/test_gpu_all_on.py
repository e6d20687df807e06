"""GPU checks of issue 14's components switched on together at a real size, and of CQL alone: graph replay ==
eager bitwise and two same-seed runs bitwise identical for the train steps (an aux step, a step without the
auxiliary losses, an aux step), each with one graph per step kind; and the collect step with the CVaR gate, the
epistemic gate, the IQN risk budget, the Kelly cap and the DSR term on, graph == eager bitwise.

The two sets: every issue-14 component with the ensemble of heads and its gate, or with the adaptive atom
positions instead (the config refuses the two together). Reward centering (issue 13) rides along.

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_all_on.py -m gpu -q`
"""

from dataclasses import replace

import numpy as np
import pytest
from agent_helpers import GPU_N_ENVS, GPU_SIZES, GPU_STATE_DIM, agent_snapshot, assert_bitwise
from agent_helpers import check_graph_replay_equals_eager, check_two_runs_bitwise_identical
from agent_helpers import collect_graph_and_eager_runs, gpu_agent_config

from numbarl.env.params import EnvParams
from numbarl.rl.agents.dqn import DQNAgent

pytestmark = pytest.mark.gpu

CQL = gpu_agent_config(cql_alpha=0.1, aux_frequency=2)
# the regime column of the multi-horizon blend holds N(0, 1) values in these tests: lo/hi of ±1
_ALL = dict(iqn=True, iqn_quantiles=8, iqn_embed=16, risk_budget=True, iql=True, iql_hidden=64, cql_alpha=0.1,
            confidence_weight=0.5, spectral_norm="trunk.fc0,head.value", horizons="1,3,20", horizon_regime_col=53,
            horizon_trend_lo=-1.0, horizon_trend_hi=1.0, cvar_alpha=0.1, reward_centering=0.01, aux_frequency=2)
ALL_ENSEMBLE = gpu_agent_config(**_ALL, ensemble_heads=3, epistemic_theta=0.05)
ALL_ATOMS = gpu_agent_config(**_ALL, adaptive_atoms=True, adaptive_atoms_warmup=0)
CONFIGS = [CQL, ALL_ENSEMBLE, ALL_ATOMS]
IDS = ["cql", "all_on_ensemble", "all_on_atoms"]


def _agent(cfg, seed=1):
    return DQNAgent(cfg, GPU_STATE_DIM, GPU_SIZES, GPU_N_ENVS, seed=seed)


def _snapshot(agent, s):
    arrays = {"d_logits": agent.loss.d_logits}
    if agent.cfg.cql_alpha > 0:
        arrays["cql_loss"] = agent.cql.arena["loss"]
    return agent_snapshot(agent, s, arrays)


def test_configs_are_valid():
    for cfg in CONFIGS:
        cfg.validate()
    with pytest.raises(Exception, match="ensemble_heads and agent.adaptive_atoms"):
        replace(ALL_ENSEMBLE, adaptive_atoms=True).validate()


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_graph_replay_equals_eager_bitwise(rng, cfg):
    eager, _, _ = check_graph_replay_equals_eager(_agent(cfg), rng, _snapshot)
    assert all(np.isfinite(v).all() for k, v in eager.items() if np.issubdtype(np.asarray(v).dtype, np.floating))
    if cfg.cql_alpha > 0:
        assert eager["cql_loss"][0] > 0


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_two_runs_bitwise_identical(rng, cfg):
    check_two_runs_bitwise_identical(rng, lambda: _agent(cfg, seed=3), _snapshot)


@pytest.mark.parametrize("cfg", [ALL_ENSEMBLE, ALL_ATOMS], ids=IDS[1:])
def test_collect_with_every_gate_and_env_term_graph_equals_eager_bitwise(cfg):
    """The collect step of the all-on agent on an env with the Kelly cap and the DSR term (its start-up rule at
    2 trades): the replay, the env arena and the gates' device state bit for bit between eager and graph."""
    params = EnvParams(sizes=(0.25, 0.5, 1.0), size_step=0.25, kelly_lambda=0.5, dsr_reward_scale=0.1,
                       dsr_warmup_trades=2)
    runs = collect_graph_and_eager_runs(
        replace(cfg, horizon_regime_col=0), GPU_N_ENVS,
        lambda agent, env: {f"cvar/{k}": v for k, v in agent.cvar_gate.dev.to_host().items()}, steps=6, params=params)
    assert_bitwise(*runs)
    assert np.isfinite(runs[0]["cvar/cvar"]).all()
