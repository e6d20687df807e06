"""The component registry: every entry is well formed, and a tiny simulator training run with its
switch on logs its liveness key finite and meeting its condition (metrics.jsonl train records)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from numbarl.cli import train_cmd
from numbarl.config import AGENT_KINDS
from numbarl.env.telemetry import KEY_PREFIXES
from numbarl.rl import components
from numbarl.rl.agents.base import known_kinds

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--preset", "tiny", "--quiet", "--epochs", "1", "--set", "data.synth_bars_per_day=30",
        "--set", "train.collect_steps_per_epoch=6", "--set", "train.log_interval=2", "--set", "train.learning_starts=3"]
# two runs cover every switch (the two target-network updates exclude each other; a third the CVaR gate); the clip threshold
# is tiny so that the tiny run's small gradients are clipped
RUNS = {
    "polyak": ["--set", "agent.target_update=polyak", "--set", "agent.n_step=3", "--set", "agent.max_grad_norm=1e-6",
               "--set", "agent.feature_gate=true", "--set", "agent.kan_gate=true",
               "--set", "agent.feature_attention=true", "--set", "agent.input_bottleneck=0:8:3",
               "--set", "agent.regime_gate=true",  # regime gate (its default columns: adx_14, rv_8 .. rv_ratio)
               "--set", "agent.isv=true",  # ISV signals
               "--set", "agent.lock_aware_target=true",
               "--set", "agent.lr_warmup_steps=1000", "--set", "agent.weight_decay=0.01",
               "--set", "agent.reward_centering=0.01",  # (E1, in the periodic run, excludes it)
               "--set", "agent.cql_alpha=0.5", "--set", "agent.atom_entropy_max=0.01",
               "--set", "agent.iqn=true", "--set", "agent.risk_budget=true", "--set", "agent.iqn_quantiles=4", "--set", "agent.iqn_embed=8",
               "--set", "agent.iql=true", "--set", "agent.iql_hidden=8",
               "--set", "agent.confidence_weight=0.5",  # recursive confidence
               "--set", "agent.risk_head_weight=0.5",  # risk-budget head (its labels need the trades this run makes)
               "--set", "agent.predictive_weight=0.1",  # predictive coding
               "--set", "agent.future_weight=0.1", "--set", "agent.future_targets=ret_1*ret_2,ret_1",  # future features
               "--set", "agent.regime_dropout=true", "--set", "agent.regime_dropout_col=0",  # regime dropout
               "--set", "agent.curiosity_weight=0.1", "--set", "agent.curiosity_hidden=8",
               "--set", "agent.curiosity_trunk_grad=true"],
    "periodic": ["--set", "agent.target_update=periodic", "--set", "agent.target_period=2",
                 "--set", "agent.lr_cycle_steps=2", "--set", "agent.n_step=1", "--set", "agent.weight_decay=0",
                 "--set", "agent.max_grad_norm=0",
                 # the validation feedback switches act from the second epoch on, the freeze detector (k = 1) from the third
                 "--epochs", "3", "--set", "train.e1_q_reality=0.5", "--set", "train.e2_adaptive_epsilon=true",
                 "--set", "train.e3_dynamic_gamma=true", "--set", "train.e9_tradability_gate=true",
                 "--set", "train.e3_refit_support=true",  # E3's gamma moves after epoch 1: the support refitted
                 "--set", "train.e4_trade_autopsy=true", "--set", "train.e6_winner_boost=1",
                 "--set", "train.e8_curriculum_kappa=1", "--set", "train.e7_margin_weight=0.1",
                 "--set", "agent.support=fit", "--set", "agent.freeze_reset=true", "--set", "agent.freeze_eps=1e6",
                 "--set", "agent.freeze_epochs=1", "--set", "agent.freeze_grad_min=0",
                 "--set", "train.e9_min_trades=1",
                 "--set", "agent.spectral_norm=trunk.fc0,head.value"],
    # the CVaR entry gate at a strict floor gates (nearly) every entry, which would starve the feedback
    # switches of the periodic run of trades: its own one-epoch run
    "cvar": ["--set", "agent.cvar_alpha=0.1", "--set", "agent.cvar_floor=0",
             # the ensemble and its epistemic gate (agent.ensemble_heads): +5 s here, +19 s in the polyak run
             "--set", "agent.ensemble_heads=2", "--set", "agent.epistemic_theta=0.01",
             # the temporal input (agent.temporal): a scan over the last 2 bars before the trunk
             "--set", "agent.temporal=mamba", "--set", "agent.temporal_steps=2", "--set", "agent.temporal_conv=2",
             "--set", "agent.isv_routing=true",  # ISV routing on the temporal input (implies agent.isv)
             "--set", "agent.obs_noise=0.1"],  # observation noise, on the batch and the temporal windows
    # multi-horizon C51 (agent.horizons): its own run, since the longest window delays the first train step
    # (adaptive atom positions, agent.adaptive_atoms, also bind the extra horizons' losses to their live support)
    "mh": ["--set", "agent.n_step=3", "--set", "agent.horizons=1,3,4", "--set", "env.kelly_lambda=0.5",
           "--set", "env.pnl_reward_scale=0.01",  # the mark-to-market reward term beside the trade and micro terms
           "--set", "env.dsr_reward_scale=0.1", "--set", "env.dsr_warmup_trades=0",  # DSR from an env's second trade
           "--set", "agent.adaptive_atoms=true", "--set", "agent.adaptive_atoms_warmup=0",
           "--set", "agent.aux_frequency=1"],  # the atoms step on aux steps; the run has few train steps
    # PPO (agent.kind = "ppo"): an update after every second collect step
    "ppo": ["--set", "agent.kind=ppo", "--set", "agent.ppo_rollout=2", "--set", "agent.ppo_epochs=2",
            "--set", "agent.ppo_minibatches=2"],
    # Decision Transformer (agent.kind = "dt"): a dataset of 2 steps, trained on after every second collect step
    "dt": ["--set", "agent.kind=dt", "--set", "agent.dt_rollout=2", "--set", "agent.dt_context=2",
           "--set", "agent.dt_updates=1", "--set", "agent.dt_batch=2", "--set", "agent.dt_embed=8"],
}


def test_entries_are_well_formed():
    names = [c.name for c in components.COMPONENTS]
    assert len(names) == len(set(names))
    for c in components.COMPONENTS:
        assert "=" in c.switch and c.reference and c.tests and c.liveness
        assert c.live_when.split()[0] in (">", "<", "!=")
        for t in c.tests:
            assert (ROOT / t).is_file(), f"{c.name}: test file {t} does not exist"
        assert set(c.agent_kinds) <= set(known_kinds())
    assert set(AGENT_KINDS) == set(known_kinds())  # the config's choices are the registry's kinds


def test_cli_lists_every_component_as_json():
    out = subprocess.run([sys.executable, "-m", "numbarl", "components", "--json"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    listed = json.loads(out)
    assert [c["name"] for c in listed] == [c.name for c in components.COMPONENTS]
    assert all(c["liveness"] for c in listed)
    r = subprocess.run([sys.executable, "-m", "numbarl", "components", "--nope"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.startswith("error:")


ON = ("periodic", "polyak")
# the run each component's switch is on in, the other run has it off (c51 and double DQN: always on)
ON_RUN = {"target_periodic": "periodic", "lr_cosine_restarts": "periodic", "e1_q_reality": "periodic",
          "e2_adaptive_epsilon": "periodic", "e3_dynamic_gamma": "periodic", "e3_refit_support": "periodic", "e9_tradability_gate": "periodic",
          "e4_trade_autopsy": "periodic", "e6_winner_distillation": "periodic", "e8_curriculum": "periodic",
          "e7_hindsight_labels": "periodic", "support_fit": "periodic", "freeze_reset": "periodic",
          "spectral_norm": "periodic", "cvar_gate": "cvar", "ensemble": "cvar", "temporal_mamba": "cvar", "isv_routing": "cvar", "obs_noise": "cvar",
          "multi_horizon_c51": "mh", "kelly_sizing": "mh", "pnl_reward": "mh", "dsr_reward": "mh",
          "adaptive_atoms": "mh"}
ON_RUN.update({c.name: c.agent_kinds[0] for c in components.COMPONENTS if "c51" not in c.agent_kinds})  # its kind's run
ON_RUN.update({c.name: "polyak" for c in components.COMPONENTS if c.name not in ON_RUN})
ALWAYS_ON = ("c51", "double_dqn")


@pytest.fixture(scope="module")
def live_runs(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    out = {}
    for name, sets in RUNS.items():
        folder = tmp_path_factory.mktemp(name) / "run"
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NUMBARL_CACHE", str(cache))
            r = CliRunner().invoke(train_cmd, [*FAST, *sets, "--out", str(folder)], catch_exceptions=True)
        assert r.exit_code == 0, r.output + repr(r.exception)
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        out[name] = [rec for rec in records if rec["kind"] == "train" and rec.get("train_step", 0) > 0]
        out[name + ":train_path"] = [rec for rec in records if rec["kind"] == "train_path"]  # the env's, per epoch
    return out


def _records(live_runs, run, key):
    """The run's records that carry `key`: the per-epoch "train_path" records for the env's
    telemetry keys (train_path.*, reward.<term>.*: numbarl/env/telemetry.py), the train records for the rest."""
    return live_runs[run + (":train_path" if key.startswith(KEY_PREFIXES) else "")]


@pytest.mark.parametrize("component", [c.name for c in components.COMPONENTS])
def test_component_is_live_in_a_training_run(component, live_runs):
    c = components.by_name()[component]
    run = ON_RUN[component]
    values = [rec.get(c.liveness) for rec in _records(live_runs, run, c.liveness)]
    assert values, f"the {run} run logged no train records after training started"
    assert all(v is not None for v in values), f"{c.liveness} is missing from metrics.jsonl"
    last = values[-1]
    assert c.is_live(last), f"{component}: {c.liveness} = {last} does not meet '{c.live_when}'"


@pytest.mark.parametrize("component", [c.name for c in components.COMPONENTS if c.name not in ALWAYS_ON])
def test_component_is_not_live_where_it_is_off(component, live_runs):
    """The liveness key tells off from on: in the run where the switch is off the key does not meet
    its condition (a key every configuration meets would prove nothing)."""
    c = components.by_name()[component]
    off = "polyak" if ON_RUN[component] == "periodic" else "periodic"
    last = _records(live_runs, off, c.liveness)[-1].get(c.liveness)
    assert not c.is_live(last), f"{component}: {c.liveness} = {last} meets '{c.live_when}' with the switch off"


def test_liveness_conditions_tell_off_from_on():
    n_step = components.by_name()["n_step"]
    assert not n_step.is_live(1.0) and n_step.is_live(2.5)  # n = 1: every window is one step
    assert not components.by_name()["grad_clip"].is_live(0) and not components.by_name()["c51"].is_live(float("nan"))


def test_risk_head_logs_its_keys_finite_and_live(live_runs):
    """The risk-budget head (polyak run): every train record carries its loss, mean ρ and labelled-row count
    finite, and the run's trades label rows the loss trains on (some record with a non-zero loss and count)."""
    records = live_runs["polyak"]
    keys = ("risk_head_loss", "risk_head_rho_mean", "risk_head_labeled")
    assert all(np.isfinite(rec[k]) for rec in records for k in keys)
    assert 0 < records[-1]["risk_head_rho_mean"] < 1
    assert any(rec["risk_head_loss"] > 0 and rec["risk_head_labeled"] > 0 for rec in records)


def test_log_records_carry_the_diagnostics(live_runs):
    """The diagnostics graph runs before every log read: atom utilization in (0, 1], the policy's
    normalized entropy per branch in [0, 1], a finite mean preference, a norm per optimizer group."""
    rec = live_runs["polyak"][-1]
    assert 0.0 < rec["atom_utilization"] <= 1.0
    for name in ("direction", "size", "target", "stop"):
        assert 0.0 <= rec[f"action_entropy.{name}"] <= 1.0
    assert np.isfinite(rec["q_gap_mean"])
    assert {"grad_norm.trunk", "grad_norm.trunk.gate", "grad_norm.head.value", "grad_norm.head.adv"} <= set(rec)
    # the Q statistics of the last train batch (C6): finite, a spread, one mean per branch
    assert rec["q_std"] > 0.0 and rec["q_divergence"] >= 0.0 and rec["q_gap_abs_mean"] >= 0.0
    assert all(np.isfinite(rec[f"q_mean.{name}"]) for name in ("direction", "size", "target", "stop"))
    assert rec["support_v_min"] == -10.0 and rec["support_v_max"] == 10.0 and rec["support_fits"] == 0
    # IQN (agent.iqn): its optimizer group's gradient norm and its readiness in [0, 1]
    assert "grad_norm.head.iqn" in rec and 0.0 <= rec["iqn_readiness"] <= 1.0 and rec["iqn_loss_ema"] > 0.0


# issue 14's components all on in one tiny run (the config refuses the ensemble with the adaptive atoms: those have
# the mh run). With IQN on, the CVaR gate's budget is the IQN readiness², which stays 0 until the quantile loss falls
# under its first value: in a run this short the gate runs open (its blocking is the cvar run's, without IQN), and the
# test checks that it runs on that budget. agent.risk_budget (the same ρ on the env's Kelly cap and DSR term) has its
# own check in the polyak run: here ρ = 0 would switch both off.
ALL_ON = ["--set", "agent.target_update=polyak", "--set", "agent.n_step=3",
          "--set", "agent.horizons=1,3,4", "--set", "agent.iqn=true", "--set", "agent.iqn_quantiles=4",
          "--set", "agent.iqn_embed=8", "--set", "agent.iql=true", "--set", "agent.iql_hidden=8",
          "--set", "agent.cql_alpha=0.5", "--set", "agent.confidence_weight=0.5",
          "--set", "agent.spectral_norm=trunk.fc0,head.value", "--set", "agent.ensemble_heads=2",
          "--set", "agent.epistemic_theta=0.01", "--set", "agent.cvar_alpha=0.1", "--set", "agent.cvar_floor=0",
          "--set", "env.kelly_lambda=0.5", "--set", "env.dsr_reward_scale=0.1", "--set", "env.dsr_warmup_trades=0",
          "--set", "agent.aux_frequency=1"]
ALL_ON_COMPONENTS = ("iqn", "iql", "cql", "multi_horizon_c51", "recursive_confidence", "spectral_norm",
                     "ensemble", "kelly_sizing", "dsr_reward")


def test_issue14_components_live_all_together(tmp_path):
    """Issue 14's protection stack and value heads switched on together in one tiny run: each component's key
    finite and meeting its condition in the last record that carries it (alone, each has its run above); the
    CVaR gate computes finite tails on the IQN readiness budget."""
    folder = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NUMBARL_CACHE", str(tmp_path / "cache"))
        r = CliRunner().invoke(train_cmd, [*FAST, *ALL_ON, "--out", str(folder)], catch_exceptions=True)
    assert r.exit_code == 0, r.output + repr(r.exception)
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    kinds = {"train": [rec for rec in records if rec["kind"] == "train" and rec.get("train_step", 0) > 0],
             "train_path": [rec for rec in records if rec["kind"] == "train_path"]}
    dead = {}
    for name in ALL_ON_COMPONENTS:
        c = components.by_name()[name]
        recs = kinds["train_path" if c.liveness.startswith(KEY_PREFIXES) else "train"]
        value = recs[-1].get(c.liveness) if recs else None
        if not c.is_live(value):
            dead[name] = (c.liveness, value)
    assert not dead, f"not live with everything on: {dead}"
    last = kinds["train"][-1]
    assert np.isfinite(last["cvar_mean"]) and last["cvar_mean"] < 0  # the gate ran on every collect step's tails
    assert last["cvar_budget"] == pytest.approx(last["iqn_readiness"] ** 2) and np.isfinite(last["cvar_blocked_frac"])
