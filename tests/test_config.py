"""Config: presets validate, overrides are typed and checked, files and saved configs round-trip,
and every bad value is one ConfigError naming the field and the value."""

import json

import pytest

from numbarl import config as config_mod
from numbarl.config import ConfigError


@pytest.mark.parametrize("name", sorted(config_mod.PRESETS))
def test_presets_validate_and_round_trip(name):
    cfg = config_mod.preset(name).validate()
    assert config_mod.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_set_overrides_are_typed():
    cfg = config_mod.resolve("tiny", sets=["train.n_envs=1e1", "agent.lr=3e-4", "train.graph=off",
                                           "agent.trunk=32,16"])
    assert cfg.train.n_envs == 10 and cfg.agent.lr == pytest.approx(3e-4)
    assert cfg.train.graph is False and cfg.agent.trunk == (32, 16)
    assert config_mod.resolve("tiny", **{"train.seed": 7}).train.seed == 7


@pytest.mark.parametrize("sets, message", [
    (["train.n_envs=2.5e0"], "train.n_envs = '2.5e0' is not a valid int"),
    (["train.n_envs=2.5"], "train.n_envs = '2.5' is not a valid int"),
    (["train.graph=maybe"], "train.graph = 'maybe' is not a boolean"),
    (["agent.lr=-1"], "agent.lr = -1.0 is out of range"),
    (["agent.nope=1"], "unknown config field agent.nope"),
    (["nope.x=1"], "unknown config section 'nope'"),
    (["lr=1"], "must look like section.field"),
    (["agent.lr"], "must look like section.field=value"),
])
def test_bad_overrides_name_the_field_and_value(sets, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        config_mod.resolve("tiny", sets=sets)


def test_config_files(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[agent]\nlr = 1e-4\n[train]\nepochs = 3\n")
    cfg = config_mod.resolve("tiny", toml, sets=["train.epochs=4"])
    assert cfg.agent.lr == pytest.approx(1e-4) and cfg.train.epochs == 4  # --set wins over the file
    for text, message in (("[1, 2]", "must hold a table of sections"),
                          ('{"train": 5}', "section 'train' must be a table of fields"),
                          ("{not json", "could not be parsed")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=message):
            config_mod.resolve("tiny", bad)
    with pytest.raises(ConfigError, match="does not exist"):
        config_mod.resolve("tiny", tmp_path / "missing.toml")


# ---------------------------------------------------------------------------------------------
# issue 12: configs a user can reuse
# ---------------------------------------------------------------------------------------------
REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_a_config_file_sets_the_preset_and_a_runs_config_json_is_reusable(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('preset = "tiny"\n[agent]\nlr = 1e-4\n')
    cfg = config_mod.resolve(None, toml, default_preset="default")
    assert cfg.preset == "tiny" and cfg.train.n_envs == config_mod.preset("tiny").train.n_envs
    assert cfg.agent.lr == pytest.approx(1e-4)
    assert config_mod.resolve("small", toml).preset == "small"  # --preset wins over the file
    assert config_mod.resolve(None, None, default_preset="tiny").preset == "tiny"
    # a run's config.json (every field, the preset, env.tick_size null) with --config: the same config
    saved = config_mod.resolve("tiny", sets=["agent.lr=3e-4", "train.seed=5"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(saved.to_dict()))
    assert config_mod.resolve(None, path) == saved
    path.write_text(json.dumps({**saved.to_dict(), "preset": 3}))
    with pytest.raises(ConfigError, match="preset = 3 must be a preset name"):
        config_mod.resolve(None, path)


def test_set_reaches_fields_whose_default_is_none():
    cfg = config_mod.resolve("tiny", sets=["env.tick_size=0.25"])
    assert cfg.env.tick_size == 0.25
    assert config_mod.resolve("tiny", sets=["env.tick_size=0.25", "env.tick_size=none"]).env.tick_size is None
    with pytest.raises(ConfigError, match="env.tick_size = 'abc' is not a valid float"):
        config_mod.resolve("tiny", sets=["env.tick_size=abc"])


@pytest.mark.parametrize("name, message", [("c.yaml", "YAML is not supported; write the config as TOML"),
                                           ("c.yml", "YAML is not supported"),
                                           ("c.ini", "unknown format '.ini'")])
def test_other_config_formats_are_a_clear_error(tmp_path, name, message):
    path = tmp_path / name
    path.write_text("agent:\n  lr: 1e-4\n")
    with pytest.raises(ConfigError, match=message):
        config_mod.resolve("tiny", path)


@pytest.mark.parametrize("name", sorted(config_mod.PRESETS))
def test_toml_of_a_config_loads_back_to_it(tmp_path, name):
    cfg = config_mod.resolve(name, sets=["env.tick_size=0.25", "data.source=a b\"c"] if name == "tiny" else ())
    path = tmp_path / "printed.toml"
    path.write_text(config_mod.to_toml(cfg))
    assert config_mod.resolve(None, path) == cfg
    assert "# Adam learning rate." in path.read_text()  # each field with its docstring


def test_the_sample_config_in_the_repository_loads_and_runs_on_a_cpu():
    sample = REPO / "examples" / "config.toml"
    cfg = config_mod.resolve(None, sample, sets=["agent.lr=1e-4"])
    assert cfg.preset == "tiny" and cfg.agent.lr == pytest.approx(1e-4)  # the simulator-sized preset
    from numbarl.data.splits import sessions_needed

    t = cfg.train
    assert sessions_needed(t.folds, t.train_sessions, t.val_sessions, t.test_sessions) <= cfg.data.synth_sessions


def test_print_config_prints_the_resolved_config_and_trains_nothing(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from numbarl.cli import train_cmd

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NUMBARL_CACHE", str(tmp_path / "cache"))
    r = CliRunner().invoke(train_cmd, ["--config", str(REPO / "examples" / "config.toml"), "--set", "agent.lr=1e-4",
                                       "--epochs", "3", "--print-config"])
    assert r.exit_code == 0, r.output + repr(r.exception)
    import tomllib

    printed = tomllib.loads(r.output[r.output.index("# numbarl config"):])
    assert printed["preset"] == "tiny" and printed["agent"]["lr"] == 1e-4 and printed["train"]["epochs"] == 3
    assert list(tmp_path.iterdir()) == []  # no runs/, no cache


def test_readme_config_examples_resolve():
    """Every `numbarl-train ... --config FILE` line of the README resolves (a sample file in the
    repository, and settings a CPU can run)."""
    import re
    import shlex

    lines = [line.split("#")[0] for line in (REPO / "README.md").read_text().splitlines()
             if line.startswith("numbarl-train") and "--config" in line]
    assert lines
    for line in lines:
        args = shlex.split(line)[1:]
        if args[args.index("--config") + 1].startswith("runs/"):  # a run's config.json: tested above
            continue
        config_file = REPO / args[args.index("--config") + 1]
        sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
        cfg = config_mod.resolve(None, config_file, sets=sets, default_preset="tiny")
        assert cfg.preset == "tiny" or not re.search(r"n_envs=\d{4,}", line), line


def test_a_run_saved_before_a_field_existed_reloads_with_that_fields_default_not_the_presets():
    """The default preset turns env.pnl_reward_scale on (and the trade and micro terms off); a default-preset run
    saved before that field existed reloads (resume, evaluate) with its own reward, the new field off."""
    from numbarl import config

    old = config.preset("default").to_dict()
    old["env"].update(trade_reward_scale=0.01, micro_reward_scale=100.0)
    old["env"].pop("pnl_reward_scale")
    cfg = config.from_dict(json.loads(json.dumps(old)))
    assert (cfg.env.trade_reward_scale, cfg.env.micro_reward_scale, cfg.env.pnl_reward_scale) == (0.01, 100.0, 0.0)
    assert cfg.preset == "default" and cfg.agent.batch_size == config.preset("default").agent.batch_size
    now = config.preset("default")
    assert config.from_dict(json.loads(json.dumps(now.to_dict()))) == now  # a full dump round-trips


def test_a_tf32_run_saved_before_head_pad_resumes_unpadded():
    """agent.head_pad's default (0: 64 under TF32) is not what the code before it did: a run saved without the
    field reloads with head_pad = 1 (config.LEGACY), and numbarl ab compares the automatic 0 by what it means."""
    from numbarl import config

    old = config.apply(config.preset("default"), {"agent.compute": "tf32"}).to_dict()
    old["agent"].pop("head_pad")
    cfg = config.from_dict(json.loads(json.dumps(old)))
    assert cfg.agent.head_pad == 1 and cfg.agent.head_pad_multiple == 1
    now = config.apply(config.preset("default"), {"agent.compute": "tf32"})
    assert now.agent.head_pad_multiple == 64 and config.from_dict(now.to_dict()) == now
    fp32 = config.preset("default").to_dict()
    assert config.behaviour_fields(fp32)["agent"]["head_pad"] == 64  # fp32's automatic 0: agent.head_pad_fp32
    assert "head_pad_fp32" not in config.behaviour_fields(fp32)["agent"]  # it acts through head_pad alone
    assert config.behaviour_fields(now.to_dict())["agent"]["head_pad"] == 64


def test_an_fp32_run_saved_before_head_pad_fp32_resumes_unpadded():
    """agent.head_pad_fp32 (64: what fp32's automatic head_pad means since the twenty-fifth session) is not what the
    code before it did: an fp32 run saved without the field, head_pad = 0, reloads unpadded (config.LEGACY), and
    numbarl ab compares it by what ran (1) against today's default (64)."""
    from numbarl import config

    now = config.preset("default")
    assert now.agent.compute == "fp32" and now.agent.head_pad == 0 and now.agent.head_pad_multiple == 64
    assert now.agent.fuse_value
    old = now.to_dict()
    old["agent"].pop("head_pad_fp32")
    cfg = config.from_dict(json.loads(json.dumps(old)))
    assert cfg.agent.head_pad_fp32 == 1 and cfg.agent.head_pad_multiple == 1 and not cfg.agent.fuse_value
    assert config.saved_as_ran(old)["agent"]["head_pad"] == 1
    assert config.saved_as_ran(now.to_dict())["agent"]["head_pad"] == 64
    assert config.from_dict(json.loads(json.dumps(now.to_dict()))) == now


def test_the_default_preset_deploys_only_what_validation_supports():
    """train.deploy_min_trade_t: 2 in the default preset (and the presets built on it) since the twenty-fifth
    session, 0 (off) as the field's default and in the smoke presets; a run saved without the field reloads with
    the rule off (config.LEGACY), and numbarl ab compares it so."""
    from numbarl import config

    assert config.preset("default").train.deploy_min_trade_t == 2.0
    assert config.preset("temporal").train.deploy_min_trade_t == 2.0 and config.preset("large").train.deploy_min_trade_t == 2.0
    assert config.preset("tiny").train.deploy_min_trade_t == 0.0 and config.preset("small").train.deploy_min_trade_t == 0.0
    assert config.TrainConfig().deploy_min_trade_t == 0.0
    old = config.preset("default").to_dict()
    old["train"].pop("deploy_min_trade_t")
    assert config.from_dict(json.loads(json.dumps(old))).train.deploy_min_trade_t == 0.0
    assert config.saved_as_ran(old)["train"]["deploy_min_trade_t"] == 0.0
    # the rule is not a C51 switch: PPO on the default preset keeps it (it decides deployment, not training)
    assert config.resolve(sets=["agent.kind=ppo"]).train.deploy_min_trade_t == 2.0


def test_a_padded_run_saved_before_head_fuse_value_resumes_unfused():
    """agent.head_fuse_value's default (true: the value stream in a padded head's GEMM) is not what the code before
    it did: a TF32 run saved without the field (padded by the automatic head_pad, twentieth session) reloads unfused
    (config.LEGACY), and numbarl ab compares the switch by what runs (false on an unpadded head)."""
    from numbarl import config

    now = config.apply(config.preset("default"), {"agent.compute": "tf32"})
    assert now.agent.fuse_value and now.agent.head_pad_multiple == 64
    old = now.to_dict()
    old["agent"].pop("head_fuse_value")
    cfg = config.from_dict(json.loads(json.dumps(old)))
    assert cfg.agent.head_pad_multiple == 64 and not cfg.agent.fuse_value
    assert config.saved_as_ran(old)["agent"]["head_fuse_value"] is False
    assert config.saved_as_ran(now.to_dict())["agent"]["head_fuse_value"] is True
    fp32 = config.apply(config.preset("default"), {"agent.head_pad": 1}).to_dict()  # unpadded: nothing to fuse
    assert fp32["agent"]["head_fuse_value"] is True and config.behaviour_fields(fp32)["agent"]["head_fuse_value"] is False
    # a --set that turns it on where it does nothing is an error; the default, a full dump and false are not
    with pytest.raises(config.ConfigError, match="head_fuse_value=true: the value stream fuses into a padded head"):
        config.resolve(sets=["agent.head_fuse_value=true", "agent.head_pad=1"])
    assert config.resolve(sets=["agent.head_fuse_value=true", "agent.compute=tf32"]).agent.fuse_value
    assert config.resolve(sets=["agent.head_fuse_value=true"]).agent.fuse_value  # fp32's automatic 64 since session 25
    assert not config.resolve(sets=["agent.head_fuse_value=false"]).agent.fuse_value
    assert config.resolve().agent.fuse_value and not config.resolve(sets=["agent.head_pad=1"]).agent.fuse_value
    with pytest.raises(config.ConfigError, match="is unpadded; set agent.head_pad above 1$"):  # TF32 already: no tf32 hint
        config.resolve(sets=["agent.head_fuse_value=true", "agent.compute=tf32", "agent.head_pad=1"])
    with pytest.raises(config.ConfigError, match="'ppo' has no C51 head"):
        config.resolve(sets=["agent.head_fuse_value=true", "agent.kind=ppo"])


def test_renamed_env_fill_delay_still_loads():
    """env.fill_delay (renamed env.latency_bars) in an earlier run's config.json or a --set still
    loads; both names with different values is one clear error."""
    from numbarl import config

    old = config.preset("tiny").to_dict()
    old["env"].pop("latency_bars", None)
    old["env"]["fill_delay"] = 2
    assert config.from_dict(old).env.latency_bars == 2
    assert config.apply(config.preset("tiny"), {"env.fill_delay": 1}).env.latency_bars == 1
    with pytest.raises(config.ConfigError, match="old name of env.latency_bars"):
        config.apply(config.preset("tiny"), {"env.fill_delay": 2, "env.latency_bars": 1})


def test_weight_decay_groups_are_checked_before_anything_runs():
    from numbarl import config

    cfg = config.apply(config.preset("tiny"), {"agent.weight_decay_groups": "trunk,head.value"}).validate()
    assert cfg.agent.weight_decay_groups == "trunk,head.value"
    with pytest.raises(config.ConfigError, match="no optimizer group trunk.gate; the groups are trunk, head.value"):
        config.apply(config.preset("tiny"), {"agent.weight_decay_groups": "trunk.gate"}).validate()
    gated = config.apply(config.preset("tiny"), {"agent.feature_gate": "true",
                                                 "agent.weight_decay_groups": "trunk.gate"}).validate()
    assert gated.agent.weight_decay_groups == "trunk.gate"


def test_a_bad_value_in_a_config_file_names_the_file(tmp_path):
    from numbarl import config

    bad = tmp_path / "mine.json"
    bad.write_text('{"agent": {"lr": "x"}}')
    with pytest.raises(config.ConfigError, match=r"config file .*mine\.json: agent\.lr = 'x' is not a valid float"):
        config.resolve(config_file=str(bad))
