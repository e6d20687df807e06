"""bin/ab-arms.sh: the option sets docs/RESULTS.md's A/B commands name still resolve, and the archived base runs
the GPU grids are seeded with still match their arms under today's defaults. A default changed since they ran
would stop a seeded grid on the GPU host (numbarl ab compares each finished run's config.json with what its arm
resolves to now); this test says so on the CPU first."""

import dataclasses
import shlex
import subprocess
import tarfile
from pathlib import Path

from numbarl import config
from numbarl.run import ab

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("T", "RW", "RWK", "TEMP16", "LAG10", "FF", "MEM", "NM", "LAG", "ALL", "RW32", "PT", "OLD32", "BASE_RUNS")


def arm_sets() -> dict:
    """The variables of bin/ab-arms.sh, as bash sources it."""
    script = ". bin/ab-arms.sh && printf '%s\\0' " + " ".join(f'"${n}"' for n in NAMES)
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    values = out.split("\0")[:len(NAMES)]
    assert all(values), dict(zip(NAMES, values))
    return dict(zip(NAMES, values))


def test_every_option_set_resolves():
    v = arm_sets()
    # the sets as the commands combine them (the convolution and the flow feature ride on the scan)
    for combo in ("T", "RW", "RWK", "TEMP16", "RW TEMP16 LAG10", "RWK TEMP16 LAG", "ALL", "RW TEMP16 LAG10 FF"):
        opts = shlex.split(" ".join(v[n] for n in combo.split()) + (" --set agent.future_weight=0.1" * ("FF" in combo)))
        config.resolve(sets=ab.train_arg_sets(opts))  # raises on an unknown field or a bad value
    nm = ab.seed_options(shlex.split(f"{v['RW']} {v['MEM']} {v['NM']}"), 3)
    assert config.resolve(sets=ab.train_arg_sets(nm)).data.synth_seed == 103
    assert "--epochs 5" in v["LAG"] and v["LAG"].startswith(v["LAG10"])
    # the "temporal" preset is the default preset with $MEM (what the twenty-second session trained as rws12ffes)
    # and the deployment rule (which changes no training bit: it decides whether the test window is traded)
    mem = config.resolve("default", sets=ab.train_arg_sets(shlex.split(v["MEM"])) + ["train.deploy_min_trade_t=2"])
    assert mem == dataclasses.replace(config.preset("temporal"), preset="default")
    assert config.preset("temporal").agent.temporal_conv == 0 and config.preset("temporal").agent.temporal_steps == 12
    assert set(v["RW"].split()) >= set(v["T"].split()) and "agent.iqn=true" in v["ALL"]
    # "--preset temporal" in an arm replaces numbarl ab's --preset default: the preset as users run it, in fp32
    pt = ab.resolved_config("default", shlex.split(f"{v['PT']} {v['RW32']}"), 0, [])
    assert pt["preset"] == "temporal" and pt["train"]["deploy_min_trade_t"] == 2.0 and pt["agent"]["compute"] == "fp32"
    assert pt["data"]["synth_mode"] == "regime_walk" and v["RW"] == f"{v['RW32']} {v['T']}"


def test_the_archived_bases_match_their_arms(tmp_path):
    """Seed 0 of each base the docs seed into grids (e10, t32b, rw, rwl10, all14x, rwlp, rwlff, rws12ffes, t32f; pt32, the `temporal` preset as
    numbarl ab runs it with --preset temporal in the arm; f32f, fp32 padded and fused; d25nm, today's default on a
    null market per seed, and e10nm, the old default there; d25 and pt25, today's default and `temporal` as users run
    them): finished, with config.json,
    equal to what numbarl train resolves for its arm today."""
    v = arm_sets()
    archives = [ROOT / p for p in v["BASE_RUNS"].split()]
    for archive in archives:
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if "-s0/" in m.name]
            tar.extractall(tmp_path, members=members, filter="data")
    arms = [("e10", shlex.split(v["OLD32"])), ("t32b", shlex.split(v["T"])), ("rw", shlex.split(v["RW"])),
            ("rwl10", shlex.split(f"{v['RW']} {v['TEMP16']} {v['LAG10']}")), ("all14x", shlex.split(v["ALL"])),
            ("rwlp", shlex.split(f"{v['RW']} {v['TEMP16']} {v['LAG10']} --set agent.predictive_weight=0.1")),
            ("rwlff", shlex.split(f"{v['RW']} {v['TEMP16']} {v['LAG10']} {v['FF']} --set agent.future_weight=0.1")),
            ("rws12ffes", shlex.split(f"{v['RW']} {v['MEM']}")),
            ("t32f", shlex.split("--set agent.compute=tf32 --set train.deploy_min_trade_t=0")),
            ("pt32", shlex.split(f"{v['PT']} {v['RW32']} --set agent.head_pad=1")),
            ("rw32", shlex.split(f"{v['RW32']} {v['OLD32']}")), ("f32f", shlex.split("--set train.deploy_min_trade_t=0")),
            ("d25nm", shlex.split(v["NM"])), ("e10nm", shlex.split(f"{v['OLD32']} {v['NM']}")),
            ("d25", []), ("pt25", shlex.split(f"{v['PT']} {v['RW32']}"))]
    for arm, _ in arms:
        assert ab._finished(tmp_path / f"{arm}-s0"), f"{arm}-s0 is not a finished run in {v['BASE_RUNS']}"
    errors, unchecked = ab.check_finished_runs(tmp_path, "default", [(a, o, [0]) for a, o in arms], [], parallel=2)
    assert errors == [] and unchecked == []
    # the check is not vacuous: the regime-walk base under the planted market's options differs
    errors, _ = ab.check_finished_runs(tmp_path, "default", [("rw", shlex.split(v["T"]), [0])], [], parallel=1)
    assert len(errors) == 1 and "data.synth_mode" in errors[0]
    # a TF32 base saved before agent.head_pad (unpadded) is not today's padded TF32 default (config.LEGACY)
    errors, _ = ab.check_finished_runs(tmp_path, "default", [("t32b", ["--set", "agent.compute=tf32"], [0])], [],
                                       parallel=1)
    assert len(errors) == 1 and "agent.head_pad: 1 -> 64" in errors[0]
    # since the twenty-fifth session the default preset pads fp32's head and holds unsupported folds flat: the fp32
    # bases saved before it (e10 without either field, rw32 with head_pad = 0 meaning 1 then, and the rule off) are
    # not today's default, and f32f (padded by hand) differs from it only by the rule
    for arm, what in (("e10", ("agent.head_pad: 1 -> 64", "train.deploy_min_trade_t: 0.0 -> 2.0")),
                      ("rw32", ("agent.head_pad: 1 -> 64",)), ("f32f", ("train.deploy_min_trade_t: 0.0 -> 2.0",))):
        opts = shlex.split(v["RW32"]) if arm == "rw32" else []
        errors, _ = ab.check_finished_runs(tmp_path, "default", [(arm, opts, [0])], [], parallel=1)
        assert len(errors) == 1 and all(w in errors[0] for w in what), (arm, errors)
