"""numbarl-compare: out-of-sample results of several runs side by side, with their spread.

One learning run is one draw: the same config with another seed can land far from it (see
docs/RESULTS.md). `numbarl-compare runs/s0 runs/s1 runs/s2` reads each run's summary.json (no GPU,
nothing re-scored) and prints one row per (run, fold) — seed, best epoch, validation and test
Sharpe, the oracle's test Sharpe and the ratio on synthetic data, return, trades, drawdown — then
the spread of the test numbers over all fold rows (mean, sample std, min, median, max) and which
config fields differ between the runs, so that a seed sweep is not mistaken for a config change.
A run with several folds also gets a "pooled" row: its folds' windows concatenated into one
track record (summary.json's "pooled", numbarl/run/pooled.py), shown but not counted in the
spread (its folds already are).

    rows = compare_rows([RunDir.open(p) for p in paths])
    print(format_table(rows, summarize(rows), config_differences(runs)))
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from numbarl.run.runio import RunDir, RunError, flatten_record

COLUMNS = (  # (key, header, format)
    ("run", "run", "{}"),
    ("seed", "seed", "{}"),
    ("fold", "fold", "{}"),
    ("best_epoch", "best ep", "{}"),
    ("val_sharpe", "val Sharpe", "{:.2f}"),
    ("test_sharpe", "test Sharpe", "{:.2f}"),
    ("test_daily_sharpe", "test daily", "{:.2f}"),
    ("oracle_sharpe", "oracle", "{:.2f}"),
    ("test_over_oracle", "test/oracle", "{:.2f}"),
    ("test_return", "test return", "{:.3%}"),
    ("test_trades", "trades", "{:.0f}"),
    ("test_max_drawdown", "max DD", "{:.2%}"),
)
SPREAD = ("test_sharpe", "test_over_oracle", "test_return")


def _num(x):
    return float(x) if isinstance(x, (int, float)) and math.isfinite(float(x)) else None


def checkpoint_epoch(tag) -> int | None:
    """The epoch a checkpoint tag names (``fold0-epoch0002`` -> 2; the trainer's FoldTrainer.tag), None otherwise."""
    if isinstance(tag, str) and "epoch" in tag:
        try:
            return int(tag.rsplit("epoch", 1)[1])
        except ValueError:
            return None
    return None


def compare_rows(runs: list[RunDir]) -> list[dict]:
    """One row per (run, fold) from the runs' summary.json files; RunError for an unfinished run."""
    if not runs:
        raise RunError("numbarl-compare needs at least one run folder")
    rows = []
    for run in runs:
        if not run.summary_path.is_file():
            raise RunError(f"{run.path} has no summary.json: its training has not finished a fold yet")
        summary = run.read_summary()
        folds = summary.get("folds") if isinstance(summary, dict) else None
        if not isinstance(folds, list) or not all(isinstance(f, dict) for f in folds):
            raise RunError(f"{run.summary_path} is not a numbarl summary (no list of fold records)")
        if not folds:
            raise RunError(f"{run.summary_path} lists no finished fold")
        records = [(f, f.get("fold"), f.get("seed", summary.get("seed"))) for f in folds]
        pooled = summary.get("pooled")
        if len(folds) > 1 and isinstance(pooled, dict) and isinstance(pooled.get("test"), dict):
            records.append((pooled, "pooled", summary.get("seed")))
        for f, fold, seed in records:
            val, test, oracle_test = (f.get(k) if isinstance(f.get(k), dict) else {} for k in ("val", "test", "oracle_test"))
            oracle = _num(oracle_test.get("sharpe"))
            flat = held_flat(f)  # earned exactly 0: counted as 0, not left out of the means
            t_sharpe = 0.0 if flat else _num(test.get("sharpe"))
            rows.append({
                "run": run.path.name or str(run.path), "path": str(run.path), "seed": seed,
                "fold": fold, "best_epoch": checkpoint_epoch(f.get("best_checkpoint")), "pooled": fold == "pooled",
                "val_sharpe": _num(val.get("sharpe")), "test_sharpe": t_sharpe,
                "test_daily_sharpe": 0.0 if flat else _num(test.get("daily_sharpe")), "oracle_sharpe": oracle,
                "test_over_oracle": t_sharpe / oracle if t_sharpe is not None and oracle else None,
                "test_return": _num(test.get("total_return")), "test_trades": _num(test.get("n_trades")),
                "test_max_drawdown": _num(test.get("max_drawdown")),
            })
    return rows


def deployment(val: dict, min_trade_t: float) -> dict | None:
    """train.deploy_min_trade_t's decision for one fold from its selected checkpoint's validation metrics:
    {"deployed", "val_trade_t", "deploy_rule"}, or None when the rule is off (0). A window without a trade t
    (fewer than 2 trades, or trades whose P&L has no variance) is not deployed."""
    if not min_trade_t or min_trade_t <= 0:
        return None
    t = trade_t(val)
    return {"deployed": t is not None and t >= min_trade_t, "val_trade_t": t,
            "deploy_rule": f"validation trade t >= {min_trade_t:g}"}


def held_flat(fold: dict) -> bool:
    """Whether the deployment rule held this fold's test window flat: its test earned exactly 0 (Sharpe 0 where
    a flat window's own Sharpe is undefined, zero variance)."""
    return fold.get("deployed") is False


def trade_t(m: dict) -> float | None:
    """t of a window's trades: per-trade Sharpe × √trades from a metrics dict (None when either is undefined).
    With a few test days the daily t has few degrees of freedom; ~100 trades give this one far more power."""
    ts, n = m.get("trade_sharpe"), m.get("n_trades")
    if ts is None or not n or not math.isfinite(ts):
        return None
    return float(ts) * math.sqrt(n)


def spread(values) -> dict | None:
    """n, mean, std (sample; None for one value), min, median, max of the values that are not None
    (None when there is none)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"n": len(values), "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(rows: list[dict]) -> dict:
    """Spread of each SPREAD column over the fold rows that have it (pooled rows are shown, not
    counted: their folds already are): n, mean, std (sample), min, median, max."""
    rows = [r for r in rows if not r.get("pooled")]
    out = {}
    for key in SPREAD:
        s = spread(r.get(key) for r in rows)
        if s is not None:
            out[key] = s
    positives = [r["test_sharpe"] for r in rows if r.get("test_sharpe") is not None]
    out["positive_test_sharpe"] = {"count": sum(v > 0 for v in positives), "of": len(positives)}
    return out


# fields whose saved spelling changed while their meaning did not: compared by what they resolve to
COLUMN_FIELDS = (("agent.regime_gate_cols", True), ("agent.regime_dropout_col", False),
                 ("agent.horizon_regime_col", False))


def effective_config(run: RunDir) -> dict:
    """The run's flat config with the fields saved in two spellings resolved: agent.head_pad as the multiple the run
    used (absent: 1, config.LEGACY; 0: the automatic one), agent.head_fuse_value as what ran (absent: false; false on
    an unpadded head), data.synth_regime_bars 0 (the
    mode's own) as that mode's duration, and the options naming obs columns (feature names, or the indices
    runs saved before names were accepted) as the columns of the run's observation."""
    from numbarl.config import ConfigError, saved_as_ran
    from numbarl.data.synth import mode_regime_bars
    from numbarl.rl.obs_columns import resolve_obs_columns

    flat = flatten_record(saved_as_ran(run.config))  # agent.head_pad as the run ran it
    if flat.get("data.synth_regime_bars") == 0:
        flat["data.synth_regime_bars"] = mode_regime_bars(flat.get("data.synth_mode", "planted"))
    names = (getattr(run, "meta", None) or {}).get("feature_names")
    for key, many in COLUMN_FIELDS:
        if key in flat:
            try:
                cols = resolve_obs_columns(flat[key], names, key.split(".", 1)[1], many=many)
            except ConfigError:
                continue  # shown as saved
            flat[key] = ",".join(map(str, cols))
    return flat


def config_differences(runs: list[RunDir], ignore=("train.seed",)) -> dict:
    """{field: [value per run]} for the config fields that differ between the runs (seed excluded), each
    run's fields as :func:`effective_config` resolves them."""
    flats = [effective_config(run) for run in runs]
    keys = sorted(set().union(*flats)) if flats else []
    diff = {}
    for k in keys:
        if k in ignore:
            continue
        values = [f.get(k) for f in flats]
        if any(v != values[0] for v in values[1:]):
            diff[k] = values
    return diff


def _cell(value, fmt) -> str:
    if value is None:
        return "n/a"
    try:
        return fmt.format(value)
    except (TypeError, ValueError):
        return str(value)


def format_table(rows: list[dict], spread: dict, differences: dict) -> str:
    """The human-readable comparison: rows, spread, differing config fields."""
    cells = [[h for _, h, _ in COLUMNS]] + [[_cell(r.get(k), f) for k, _, f in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    fmt = dict((k, f) for k, _, f in COLUMNS)
    for key, s in spread.items():
        if key == "positive_test_sharpe":
            continue
        std = _cell(s["std"], fmt[key])
        lines.append(f"{key:<17} n={s['n']}  mean {_cell(s['mean'], fmt[key])}  sample std {std}  min {_cell(s['min'], fmt[key])}"
                     f"  median {_cell(s['median'], fmt[key])}  max {_cell(s['max'], fmt[key])}")
    pos = spread.get("positive_test_sharpe")
    if pos:
        lines.append(f"positive test Sharpe: {pos['count']} of {pos['of']}")
    if differences:
        lines.append("config fields that differ (besides the seed): "
                     + "; ".join(f"{k} = {', '.join(map(str, v))}" for k, v in differences.items()))
    else:
        lines.append("configs identical apart from the seed")
    return "\n".join(lines)


def main(run_dirs, as_json: bool = False) -> str:
    """numbarl-compare: the text (or JSON) comparison of the given run folders."""
    import json

    seen = {}
    for p in run_dirs:  # one run listed twice would count as two draws in the spread
        key = str(Path(p).resolve())
        if key in seen:
            raise RunError(f"{p} is listed twice (as {seen[key]} too); each run counts once")
        seen[key] = p
    runs = [RunDir.open(p) for p in run_dirs]
    rows = compare_rows(runs)
    spread = summarize(rows)
    diff = config_differences(runs)
    if as_json:
        return json.dumps({"rows": rows, "spread": spread, "config_differences": diff}, indent=2, default=str)
    return format_table(rows, spread, diff)
