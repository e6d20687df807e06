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
