"""The per-component cost benchmark (numbarl/bench/components.py): which configurations it builds from
the registry's switches (skips, conflicts, the all-on row), and one real run at the tiny preset under the
simulator (its numbers are not timings there): the trainer's graphs built, replayed and timed, the
deltas against the base and the liveness keys read after the timed replays."""

import json

import pytest

from numbarl import config as config_mod
from numbarl.bench import components as bench
from numbarl.cuda import backend

SIMULATOR = backend.simulator_active()


def test_parse_switch_keeps_commas_inside_a_value():
    assert bench.parse_switch("agent.iqn=true") == {"agent.iqn": "true"}
    assert bench.parse_switch("agent.horizons=1,3,4") == {"agent.horizons": "1,3,4"}
    assert bench.parse_switch("agent.spectral_norm=trunk.fc0,head.value") == {"agent.spectral_norm": "trunk.fc0,head.value"}
    assert bench.parse_switch("agent.iqn=true,agent.iqn_quantiles=8; train.e6_winner_boost=1") == {
        "agent.iqn": "true", "agent.iqn_quantiles": "8", "train.e6_winner_boost": "1"}
    with pytest.raises(ValueError, match="not section.field=value"):
        bench.parse_switch("true,agent.iqn=true")


def test_plan_skips_other_kinds_defaults_and_invalid_switches():
    base = bench.base_config("tiny")
    variants, skipped = bench.plan(base)
    why = {s["component"]: s["why"] for s in skipped}
    measured = [v["component"] for v in variants]
    assert why["ppo"].startswith("a component of agent.kind ppo") and "decision_transformer" in why
    # the tiny preset already copies its target periodically; c51 and double DQN are the agent itself
    assert all(why[n] == "already on in preset tiny" for n in ("c51", "double_dqn", "target_periodic"))
    assert "agent.n_step = 2" in why["multi_horizon_c51"]  # horizons 1,3,4 need n_step among them
    assert {"target_polyak", "iqn", "cql", "kelly_sizing"} <= set(measured) and not set(measured) & set(why)
    for v in variants:  # each configuration is the base with exactly its switch applied
        assert v["config"] == config_mod.apply(base, v["sets"]).validate() != base
    assert [v["component"] for v in bench.plan(base, ["cql", "iqn"])[0]] == ["cql", "iqn"]  # registry order
    with pytest.raises(ValueError, match="no component nope"):
        bench.plan(base, ["nope"])


def test_all_on_leaves_out_what_conflicts_and_names_the_pair():
    base = bench.base_config("tiny")  # n_step = 2
    variants = [{"component": "polyak", "sets": {"agent.target_update": "polyak"}},
                {"component": "n3", "sets": {"agent.n_step": "3"}},
                {"component": "periodic", "sets": {"agent.target_update": "periodic", "agent.tau": "0.5"}},
                {"component": "h12", "sets": {"agent.horizons": "1,2"}},  # valid with n_step 2, not with 3
                {"component": "cql", "sets": {"agent.cql_alpha": "0.5"}}]
    sets, included, left_out = bench.combine(base, variants)
    assert included == ["polyak", "n3", "cql"]
    assert sets == {"agent.target_update": "polyak", "agent.n_step": "3", "agent.cql_alpha": "0.5"}
    why = {x["component"]: x["why"] for x in left_out}
    assert why["periodic"] == "mutually exclusive with polyak (agent.target_update)"
    assert why["h12"].startswith("invalid with n3:") and "agent.horizons" in why["h12"]


def test_liveness_text_tells_live_dead_and_unproven_apart():
    keys = [{"component": "iqn", "key": "iqn_loss", "value": 0.3, "live": True, "how": "set to NaN before the timed replays"},
            {"component": "support_fit", "key": "support_fits", "value": 1.0, "live": False, "how": "counter 1 -> 1"},
            {"component": "e3_dynamic_gamma", "key": "feedback.e3_gamma", "value": 0.99, "live": None,
             "how": "feedback state, moves only at epoch ends: unproven here"}]
    assert bench._live_text({"component": "all", "liveness": keys}) == (
        "1/2 live; NOT live: support_fit; unproven here: e3_dynamic_gamma")
    assert bench._live_text({"component": "base", "liveness": keys}) == "LIVE with its switch off: iqn"
    assert bench._live_text({"component": "support_fit", "liveness": keys[1:2]}) == (
        "support_fits = 1 (NOT live: counter 1 -> 1)")
    e3 = bench._live_text({"component": "e3_dynamic_gamma", "liveness": keys[2:]})
    assert e3 == "feedback.e3_gamma = 0.99 (feedback state, moves only at epoch ends: unproven here)"


def test_amortized_train_step_weights_the_aux_step():
    assert bench.amortized_ms(2.0, None, 1) == 2.0
    assert bench.amortized_ms(2.0, 6.0, 4) == 3.0  # (3 x 2 + 6) / 4


def test_bench_runs_the_trainer_graphs_and_reads_liveness(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NUMBARL_CACHE", str(tmp_path / "cache"))
    out, md = tmp_path / "components.json", tmp_path / "components.md"
    code = bench.main(["--preset", "tiny", "--batch", "4", "--n-envs", "2", "--components", "weight_decay",
                       "--reps", "1", "--repeats", "1", "--warmup", "0", "--json", str(out), "--markdown", str(md)])
    assert code == 0
    r = json.loads(out.read_text())
    assert (r["preset"], r["batch"], r["n_envs"], r["timing"].startswith("CUDA events") != SIMULATOR) == ("tiny", 4, 2, True)
    assert [row["component"] for row in r["rows"]] == ["base", "weight_decay"]  # no all-on row for one switch
    base, wd = r["rows"]
    for row in (base, wd):
        assert row["train_ms"] > 0 and row["collect_ms"] > 0
        assert row["train_aux_ms"] is None and row["aux_every"] == 1 and row["amortized_ms"] == row["train_ms"]
    assert wd["delta_ms"] == pytest.approx(wd["amortized_ms"] - base["amortized_ms"])
    assert wd["collect_delta_ms"] == pytest.approx(wd["collect_ms"] - base["collect_ms"])
    # decay_rate: NaN before the timed replays, written by them; the base (no weight decay) leaves it 0
    (on,), (off,) = wd["liveness"], base["liveness"]
    assert on["key"] == off["key"] == "decay_rate" and on["how"].startswith("set to NaN")
    assert on["live"] and on["value"] > 0 and not off["live"] and off["value"] == 0.0
    text = capsys.readouterr().out
    assert "decay_rate = " in text and "(live)" in text and "0/1 keys live" in text
    table = md.read_text().splitlines()
    assert table[0].startswith("| component | switch | train ms") and "`agent.weight_decay=1e-4`" in table[3]


def test_bench_reads_an_env_reward_terms_liveness(tmp_path, monkeypatch):
    """pnl_reward's key (reward.pnl.std) comes from the env's training-path telemetry, zeroed before the timed
    replays: live with the switch on, not with it off."""
    monkeypatch.setenv("NUMBARL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "components.json"
    assert bench.main(["--preset", "tiny", "--batch", "4", "--n-envs", "2", "--components", "pnl_reward", "--reps", "2",
                       "--repeats", "1", "--warmup", "0", "--json", str(out), "--profile"]) == 0
    base, on = json.loads(out.read_text())["rows"]
    assert "kernels_train" in on and "kernels_collect" in on  # --profile: empty on the simulator (no CUPTI)
    (b,), (o,) = base["liveness"], on["liveness"]
    assert b["key"] == o["key"] == "reward.pnl.std" and o["how"].startswith("env telemetry zeroed")
    assert o["live"] and o["value"] > 0 and not b["live"]


def test_kernel_deltas_name_the_kernels_that_make_a_components_cost():
    base = {"kernels_train": {"gemm": {"calls": 6.0, "us": 100.0}, "conv_fwd": {"calls": 0.0, "us": 0.0}}}
    row = {"component": "x", "kernels_train": {"gemm": {"calls": 6.0, "us": 101.0}, "conv_fwd": {"calls": 3.0, "us": 40.0},
                                               "silu": {"calls": 3.0, "us": 2.5}}}
    assert bench.kernel_deltas(base, row) == [("conv_fwd", 40.0, 3.0), ("silu", 2.5, 3.0), ("gemm", 1.0, 6.0)]
    assert bench.kernel_deltas(base, row, top=1) == [("conv_fwd", 40.0, 3.0)]
    text = bench.profile_text({"rows": [{"component": "base", **base}, row]}).splitlines()
    assert text[0] == "base (train step), GPU µs per step 100.0 in 2 kernels, largest: gemm 100.0 (6/step); conv_fwd 0.0 (0/step)"
    assert text[1].startswith("x (train step), Δ µs per step against base: conv_fwd +40.0 (3/step)")
    empty = bench.profile_text({"rows": [{"component": "base", "kernels_train": {}}, {"component": "x", "kernels_train": {}}]})
    assert "no kernel times" in empty
    failed = bench.profile_text({"rows": [{"component": "base", **base}, {"component": "iqn", "error": "boom"}]})
    assert failed.splitlines()[1:] == ["iqn: no profile (boom)"]  # not every base kernel at a negative delta


def test_kernel_names_are_shortened_for_the_profile_text():
    mangled = "numbarl::cuda::kernels::conv1d::conv_forward_kernel[abi:v69][abi:cw51cXTLSUwv1sDUaKthqaNgo"
    assert bench.short_kernel_name(mangled) == "conv1d.conv_forward_kernel"
    cutlass = "void cutlass::Kernel2<cutlass_80_simt_sgemm_256x128_8x4_nn_align1>(cutlass_80_simt_sgemm_256x128_8x4)"
    assert bench.short_kernel_name(cutlass, width=20) == cutlass[:19] + "…"
    assert bench.short_kernel_name("step_kernel") == "step_kernel"


def test_gpu_presets_are_refused_on_the_simulator(capsys):
    if not SIMULATOR:
        pytest.skip("a GPU is present: the default preset runs")
    assert bench.main(["--preset", "default"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
