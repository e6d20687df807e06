"""Options that pick observation columns (agent.regime_gate_cols, agent.regime_dropout_col,
agent.horizon_regime_col; numbarl/rl/obs_columns.py): feature names resolve against the run's feature list
(the default list without one, to the indices the options had before names), legacy integer indices still
work and still load from a config file / a run's config.json, and a bad value is one ConfigError naming
the field and the value."""

import json

import pytest

from numbarl import config as config_mod
from numbarl.config import AgentConfig, ConfigError
from numbarl.data.features import DEFAULT_FEATURES, resolve_features
from numbarl.env.params import PORTFOLIO_DIM, PORTFOLIO_FEATURES
from numbarl.rl.obs_columns import (
    check_known_names,
    parse_obs_columns,
    resolve_obs_columns,
)

DEFAULT_DIM = len(DEFAULT_FEATURES) + PORTFOLIO_DIM


def test_default_names_resolve_to_the_former_indices():
    cfg = AgentConfig()
    assert cfg.regime_gate_cols == "adx_14,rv_8,rv_32,rv_128,rv_ratio"
    assert cfg.regime_dropout_col == cfg.horizon_regime_col == "adx_14"
    for names in (None, resolve_features(None), resolve_features("default")):
        assert resolve_obs_columns(cfg.regime_gate_cols, names, "regime_gate_cols", DEFAULT_DIM) == (53, 9, 10, 11, 12)
        assert resolve_obs_columns(cfg.regime_dropout_col, names, "regime_dropout_col", DEFAULT_DIM, many=False) == (53,)
        assert resolve_obs_columns(cfg.horizon_regime_col, names, "horizon_regime_col", DEFAULT_DIM, many=False) == (53,)
    # appending a feature moves nothing; the portfolio features are named too (after the market's)
    longer = resolve_features("default,flow_move_sig_8")
    assert resolve_obs_columns(cfg.regime_gate_cols, longer, "regime_gate_cols") == (53, 9, 10, 11, 12)
    assert resolve_obs_columns("position,churn_pressure", longer, "regime_gate_cols") == (65, 65 + PORTFOLIO_DIM - 1)


def test_a_custom_feature_list_resolves_to_its_own_positions():
    dropped = [n for n in DEFAULT_FEATURES if n not in ("rv_8", "rv_32")]  # "default" minus two: adx_14 shifts
    assert resolve_obs_columns("adx_14", dropped, "regime_dropout_col", len(dropped) + PORTFOLIO_DIM,
                               many=False) == (51,)
    assert resolve_obs_columns("adx_14,rv_128", dropped, "regime_gate_cols") == (51, dropped.index("rv_128"))
    small = ["rv_32", "adx_14", "rv_8"]  # a reordered small list
    assert resolve_obs_columns("adx_14,rv_8,rv_32", small, "regime_gate_cols", 3 + PORTFOLIO_DIM) == (1, 2, 0)
    assert resolve_obs_columns("adx_14", small, "horizon_regime_col", many=False) == (1,)
    assert resolve_obs_columns(PORTFOLIO_FEATURES[0], small, "regime_dropout_col", many=False) == (3,)
    # names and legacy indices mixed; indices are taken as they are
    assert resolve_obs_columns("adx_14, 0", small, "regime_gate_cols", 11) == (1, 0)


def test_integer_indices_still_work():
    assert resolve_obs_columns(53, None, "regime_dropout_col", DEFAULT_DIM, many=False) == (53,)
    assert resolve_obs_columns("53", ["adx_14"], "regime_dropout_col", many=False) == (53,)
    assert resolve_obs_columns("53,9,10,11,12", None, "regime_gate_cols", DEFAULT_DIM) == (53, 9, 10, 11, 12)
    assert resolve_obs_columns(" 4 ", ["a"], "regime_gate_cols", 5) == (4,)
    assert parse_obs_columns("adx_14,3", "regime_gate_cols") == ("adx_14", 3)


@pytest.mark.parametrize("value, names, dim, message", [
    ("adx_41", None, None, (r"agent.regime_gate_cols = 'adx_41': 'adx_41' is not a column of the default feature "
                            r"list .*e.g. adx_14")),
    ("rv_8,nope", ["rv_8", "adx_14"], None, (r"agent.regime_gate_cols = 'rv_8,nope': 'nope' is not a column of the "
                                             r"observation \(10 columns")),
    ("rv_32", ["rv_8", "adx_14"], None, r"'rv_32' is not a column of the observation .*e.g. rv_8"),
    ("9,72", None, 72, r"agent.regime_gate_cols = '9,72': column 72 is not an obs column \(the observation has 72\)"),
    ("adx_14", list(DEFAULT_FEATURES), 40,
     r"column 53 \('adx_14' in the observation\) is not an obs column \(the observation has 40\)"),
    ("adx_14,53", None, None, r"agent.regime_gate_cols = 'adx_14,53': a column is named twice"),
])
def test_bad_columns_name_the_field_and_the_value(value, names, dim, message):
    with pytest.raises(ConfigError, match=message):
        resolve_obs_columns(value, names, "regime_gate_cols", dim)


@pytest.mark.parametrize("value, many, message", [
    ("", True, r"agent.regime_gate_cols = '': '' is neither a feature name"),
    ("53,", True, r"'53,': '' is neither"),
    ("-1", True, r"'-1' is neither a feature name .* nor an obs column index >= 0"),
    ("1.5", True, r"'1.5' is neither"),
    ("1;2", True, r"'1;2' is neither .*separate columns with commas"),
    ("adx 14", True, r"'adx 14' is neither"),
    ("rv_8,rv_8", True, r"'rv_8,rv_8': a column is listed twice"),
    ("adx_14,rv_8", False, r"agent.regime_gate_cols = 'adx_14,rv_8' must name one obs column"),
    (-3, False, r"= -3: '-3' is neither"),
    (True, False, r"= True must name one obs column"),
    (1.0, False, r"= 1.0 must name one obs column"),
])
def test_syntax(value, many, message):
    with pytest.raises(ConfigError, match=message):
        parse_obs_columns(value, "regime_gate_cols", many)


def test_config_validation_checks_syntax_and_known_names():
    AgentConfig(regime_gate_cols="adx_14,position,3", regime_dropout_col=53, horizon_regime_col="rv_ratio").validate()
    AgentConfig(horizons="1,3", n_step=3, horizon_regime_col="7").validate()
    with pytest.raises(ConfigError, match=r"agent.regime_dropout_col = 'adx_41': 'adx_41' is not a feature "
                                          r"\(did you mean 'adx_14'"):
        AgentConfig(regime_dropout_col="adx_41").validate()
    with pytest.raises(ConfigError, match=r"agent.regime_dropout_col = 'adx_14,rv_8' must name one obs column"):
        AgentConfig(regime_dropout_col="adx_14,rv_8").validate()
    with pytest.raises(ConfigError, match=r"agent.horizon_regime_col = 'trend': 'trend' is not a feature"):
        AgentConfig(horizons="1,3", n_step=3, horizon_regime_col="trend").validate()
    with pytest.raises(ConfigError, match=r"agent.regime_gate_cols = '53,x': 'x' is not a feature"):
        AgentConfig(regime_gate_cols="53,x").validate()
    check_known_names("flow_move_sig_8", "regime_dropout_col", many=False)  # any registered feature


def test_config_round_trip_with_names_and_legacy_ints(tmp_path):
    cfg = config_mod.resolve("tiny", sets=["agent.regime_gate_cols=rv_8,adx_14", "agent.regime_dropout_col=rv_32",
                                           "agent.horizon_regime_col=53"])
    assert (cfg.agent.regime_gate_cols, cfg.agent.regime_dropout_col, cfg.agent.horizon_regime_col) == (
        "rv_8,adx_14", "rv_32", "53")
    assert config_mod.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # a run's config.json
    toml = tmp_path / "c.toml"
    toml.write_text(config_mod.to_toml(cfg))
    assert config_mod.resolve(None, toml) == cfg  # --print-config loads back
    # a config from before names: ints (TOML and a run's config.json) load as those indices
    toml.write_text('[agent]\nregime_dropout_col = 53\nhorizon_regime_col = 7\nregime_gate_cols = "53,9,10,11,12"\n')
    legacy = config_mod.resolve("tiny", toml)
    assert (legacy.agent.regime_dropout_col, legacy.agent.horizon_regime_col, legacy.agent.regime_gate_cols) == (
        "53", "7", "53,9,10,11,12")
    saved = config_mod.preset("tiny").to_dict()
    saved["agent"].update(regime_dropout_col=53, horizon_regime_col=53, regime_gate_cols="53,9,10,11,12")
    old = config_mod.from_dict(json.loads(json.dumps(saved)))
    assert old.agent.regime_dropout_col == old.agent.horizon_regime_col == "53"
    for field, many in (("regime_gate_cols", True), ("regime_dropout_col", False), ("horizon_regime_col", False)):
        assert (resolve_obs_columns(getattr(old.agent, field), DEFAULT_FEATURES, field, DEFAULT_DIM, many)
                == resolve_obs_columns(getattr(AgentConfig(), field), DEFAULT_FEATURES, field, DEFAULT_DIM, many))
    with pytest.raises(ConfigError, match=r"agent.regime_dropout_col = 'adx_41'"):
        config_mod.resolve("tiny", sets=["agent.regime_dropout_col=adx_41"])
    toml.write_text("[agent]\nregime_dropout_col = -1\n")
    with pytest.raises(ConfigError, match=r"agent.regime_dropout_col = '-1': '-1' is neither"):
        config_mod.resolve("tiny", toml)


def test_the_agent_resolves_names_against_its_feature_names():
    """DQNAgent(feature_names=...) (make_agent passes them through): a reordered small list puts the gate,
    the dropout and the horizon blend on that list's columns; without names the default list's (53)."""
    from numbarl.rl.agents.base import make_agent
    from numbarl.rl.agents.dqn import DQNAgent

    names = ("rv_32", "adx_14", "rv_8")
    dim = len(names) + PORTFOLIO_DIM
    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=40, n_step=2, regime_gate=True,
                      regime_gate_cols="adx_14,rv_8,rv_32", regime_dropout=True, horizons="1,2")
    agent = make_agent(cfg, dim, (3, 3, 4, 4), 4, 1, feature_names=names)
    assert agent.trunk.layers[0].cols == (1, 2, 0)
    assert agent.rdrop.col == 1 and agent.mh.regime_col == 1
    with pytest.raises(ConfigError, match=r"agent.regime_gate_cols = 'adx_14,rv_8,rv_32': column 53 \('adx_14' in the "
                                          r"default feature list"):
        DQNAgent(cfg, dim, (3, 3, 4, 4), 4, seed=1)  # no names: the default list, whose adx_14 is column 53
    with pytest.raises(ConfigError, match=r"agent.horizon_regime_col = 'rv_128': 'rv_128' is not a column of the "
                                          r"observation"):
        DQNAgent(AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=40, n_step=2, horizons="1,2",
                             horizon_regime_col="rv_128"), dim, (3, 3, 4, 4), 4, seed=1, feature_names=names)
    legacy = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=40, n_step=2, regime_dropout=True,
                         regime_dropout_col=3)
    assert DQNAgent(legacy, dim, (3, 3, 4, 4), 4, seed=1, feature_names=names).rdrop.col == 3
