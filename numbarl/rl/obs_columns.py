"""Observation columns named by feature: agent.regime_gate_cols, agent.regime_dropout_col, agent.horizon_regime_col,
and the terms of agent.future_targets (a column or the product of two).

The observation is the cache's market features in the order of its ``feature_names`` (data.features), then
the portfolio features (numbarl.env.params.PORTFOLIO_FEATURES). An option that picks columns takes feature
names ("adx_14,rv_8"; the defaults) or, as configs saved before names were accepted do, obs column indices
("53,9", or a bare int); the two may be mixed. :func:`parse_obs_columns` checks the syntax (the config's
validate); :func:`resolve_obs_columns` turns it into indices for the feature list the agent is built for
(the trainer and numbarl-backtest pass the cache's names). Without names (a benchmark's anonymous synthetic
features, a unit test's agent) names resolve against the default list, DEFAULT_FEATURES, where the default
names are the columns they always were: adx_14 = 53, rv_8 = 9, rv_32 = 10, rv_128 = 11, rv_ratio = 12.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence

from numbarl.config import ConfigError

_INDEX = re.compile(r"\d+")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_obs_columns(value, field: str, many: bool = True, where: str | None = None) -> tuple[int | str, ...]:
    """The items of agent.<field>: ints (obs column indices) and strs (feature names), in order.

    ``value``: a comma list (str) or an int (a legacy index). ``many=False``: exactly one column.
    Raises ConfigError naming the field and the value: not a name or an index >= 0, empty, or repeated.
    ``where``: how the message names the option (default "agent.<field> = <value>"; a term's factor names the
    whole option)."""
    where = where or f"agent.{field} = {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{where} must name {'obs columns' if many else 'one obs column'}: feature names "
                          "(e.g. 'adx_14') or column indices >= 0")
    if isinstance(value, int):
        parts = [str(value)]
    else:
        parts = [p.strip() for p in value.split(",")]
    items: list[int | str] = []
    for p in parts:
        if _INDEX.fullmatch(p):
            items.append(int(p))
        elif _NAME.fullmatch(p):
            items.append(p)
        else:
            raise ConfigError(f"{where}: {p!r} is neither a feature name (e.g. 'adx_14') nor an obs column "
                              f"index >= 0" + ("; separate columns with commas" if many else ""))
    if not many and len(items) != 1:
        raise ConfigError(f"{where} must name one obs column (a feature name such as 'adx_14', or an index)")
    if len(set(items)) != len(items):
        raise ConfigError(f"{where}: a column is listed twice")
    return tuple(items)


def obs_names(feature_names: Sequence[str] | None) -> list[str]:
    """The observation's column names: the market features (the default list when None), then the portfolio's."""
    from numbarl.data.features import resolve_features
    from numbarl.env.params import PORTFOLIO_FEATURES

    market = resolve_features(None) if feature_names is None else [str(n) for n in feature_names]
    return market + list(PORTFOLIO_FEATURES)


def check_known_names(value, field: str, many: bool = True, where: str | None = None) -> None:
    """Config-time check: every name in agent.<field> is a feature numbarl knows (data.features's registry)
    or a portfolio feature, so a typo fails before the data is prepared; whether the run's observation
    has it is checked when the agent is built (:func:`resolve_obs_columns`)."""
    from numbarl.data.features import REGISTRY
    from numbarl.env.params import PORTFOLIO_FEATURES

    known = list(REGISTRY) + list(PORTFOLIO_FEATURES)
    where = where or f"agent.{field} = {value!r}"
    for item in parse_obs_columns(value, field, many, where):
        if isinstance(item, str) and item not in known:
            close = difflib.get_close_matches(item, known, n=3)
            hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            raise ConfigError(f"{where}: {item!r} is not a feature{hint}; name a feature of "
                              "data.features (e.g. 'adx_14', 'rv_32'), a portfolio feature (e.g. 'position') "
                              "or give an obs column index")


def resolve_obs_columns(value, feature_names: Sequence[str] | None, field: str, state_dim: int | None = None,
                        many: bool = True, where: str | None = None) -> tuple[int, ...]:
    """The obs column indices agent.<field> names, for an observation of ``feature_names`` (the cache's
    market features; None: the default list) then the portfolio features, ``state_dim`` columns wide
    (None: unchecked). Raises ConfigError naming the field and the value (an unknown name, with a few
    of the observation's names; an index outside the observation; a column named twice); ``where`` as in
    :func:`parse_obs_columns`."""
    where = where or f"agent.{field} = {value!r}"
    names = obs_names(feature_names)
    index: dict[str, int] = {}
    for i, n in enumerate(names):
        index.setdefault(n, i)
    source = ("the default feature list (the agent was given no feature names)" if feature_names is None
              else "the observation")
    out = []
    for item in parse_obs_columns(value, field, many, where):
        if isinstance(item, str):
            if item not in index:
                close = difflib.get_close_matches(item, names, n=3) or names[:5]
                raise ConfigError(f"{where}: {item!r} is not a column of {source} ({len(names)} columns: its "
                                  f"features then the portfolio's); e.g. {', '.join(close)}")
            col = index[item]
        else:
            col = item
        if state_dim is not None and col >= state_dim:
            named = f" ({item!r} in {source})" if isinstance(item, str) else ""
            raise ConfigError(f"{where}: column {col}{named} is not an obs column (the observation has {state_dim})")
        out.append(col)
    if len(set(out)) != len(out):
        raise ConfigError(f"{where}: a column is named twice (columns {out})")
    return tuple(out)


def check_agent_columns(agent_cfg, feature_names: Sequence[str] | None, state_dim: int) -> None:
    """Every enabled option of ``agent_cfg`` that names obs columns resolves for this observation (the
    trainer calls it before a run folder is written; the agent resolves them again when it is built)."""
    if agent_cfg.regime_gate:
        resolve_obs_columns(agent_cfg.regime_gate_cols, feature_names, "regime_gate_cols", state_dim)
    if agent_cfg.regime_dropout:
        resolve_obs_columns(agent_cfg.regime_dropout_col, feature_names, "regime_dropout_col", state_dim, many=False)
    if agent_cfg.horizons:
        resolve_obs_columns(agent_cfg.horizon_regime_col, feature_names, "horizon_regime_col", state_dim, many=False)
    if agent_cfg.future_weight > 0:
        resolve_obs_terms(agent_cfg.future_targets, feature_names, "future_targets", state_dim)


# ---------------------------------------------------------------------------------------------
# terms: a column or the product of two (agent.future_targets)
# ---------------------------------------------------------------------------------------------
NO_COLUMN = -1  # the second factor of a one-column term


def parse_obs_terms(value, field: str) -> tuple[tuple[str, ...], ...]:
    """The terms of agent.<field>: a comma list of terms, each an obs column (a feature name or an index) or the
    product of two ("trade_imb_prev*ret_1"). Returns each term's factors as strings; raises ConfigError naming the
    field and the value (empty, a term of more than two factors, a term listed twice)."""
    where = f"agent.{field} = {value!r}"
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where} must name at least one term: an obs column (e.g. 'ret_1') or the product of "
                          "two ('trade_imb_prev*ret_1'), comma-separated")
    terms = []
    for part in value.split(","):
        factors = tuple(f.strip() for f in part.split("*"))
        if not 1 <= len(factors) <= 2 or not all(factors):
            raise ConfigError(f"{where}: {part.strip()!r} is not a column or the product of two columns ('a*b')")
        for f in factors:
            parse_obs_columns(f, field, many=False, where=where)
        terms.append(factors)
    if len(set(terms)) != len(terms):
        raise ConfigError(f"{where}: a term is listed twice")
    return tuple(terms)


def check_known_terms(value, field: str) -> None:
    """Config-time check of agent.<field>'s terms: the syntax, and every named factor a known feature."""
    for factors in parse_obs_terms(value, field):
        for f in factors:
            check_known_names(f, field, many=False, where=f"agent.{field} = {value!r}")


def resolve_obs_terms(value, feature_names: Sequence[str] | None, field: str, state_dim: int | None = None):
    """(first, second): the obs column indices of agent.<field>'s terms (lists of ints, second NO_COLUMN for a
    one-column term) for an observation of ``feature_names`` then the portfolio features; errors as
    :func:`resolve_obs_columns`."""
    where = f"agent.{field} = {value!r}"
    first, second, seen = [], [], set()
    for factors in parse_obs_terms(value, field):
        cols = [resolve_obs_columns(f, feature_names, field, state_dim, many=False, where=where)[0] for f in factors]
        pair = tuple(sorted(cols))
        if pair in seen:
            raise ConfigError(f"{where}: the term {'*'.join(factors)!r} names the same columns as "
                              "an earlier one")
        seen.add(pair)
        first.append(cols[0])
        second.append(cols[1] if len(cols) == 2 else NO_COLUMN)
    return first, second
