"""numbarl-ab: an A/B grid of training runs (arms x seeds) and one comparison table.

    python -m numbarl ab --out ab/ --preset default --seeds 0,1,2,3,4 --parallel 8 \\
        --arm "base" --arm "e2: --set train.e2_adaptive_epsilon=true" --arm "null: --set data.synth_null=true"

Each arm is a name and the numbarl-train options it adds (``NAME@2,3,4: ...`` runs that arm on its own seeds
instead of ``--seeds``, e.g. to add seeds to an arm measured before); every (arm, seed) is a normal run folder
``OUT/<arm>-s<seed>`` trained by ``python -m numbarl train`` in its own process, ``--parallel`` of
them at once (side by side on one GPU). ``{seed}`` in an arm's options is replaced by the run's seed,
so each seed can also get its own market: ``--arm "null: --set data.synth_null=true --set
data.synth_seed=10{seed}"`` trains seed 3 on null market 103. A finished run (its summary.json lists every fold) is not run again, so
an interrupted grid is continued by the same command. Then ``OUT/ab.md`` (and ``ab.json``) holds one
row per arm with, over its seeds:

* test/oracle: the per-bar test Sharpe over the oracle's on the same window (synthetic markets):
  mean, sample std, min;
* val - test: the selected checkpoint's validation Sharpe minus its test Sharpe (how much of the
  selection score survives out of sample): mean, sample std;
* last/best val: the last epoch's validation Sharpe over the best epoch's (1 = no late decay; n/a when the
  last epoch made no trades): mean, min;
* best epochs: the epoch each seed's selected checkpoint comes from (the test window scored it); under the table,
  each arm's validation Sharpe per epoch, the mean over its finished seeds (``val_curve_mean`` in ``ab.json``, with
  ``val_curve_n``, the seeds behind each epoch's mean);
* test t per seed: t = daily Sharpe x sqrt(test days / 252) of the test window (the null market's check: no
  seed above 2; a negative one is a losing seed, not a false edge); ``ab.json`` also has the largest |t| with
  its sign (``t_at_abs_max``);
* hold t: the t of buying and holding over the same window, what a long-biased policy earns from the window's
  drift (one number when every seed has the same window, else per seed). Where an arm's seeds share one window
  path (the built-in market's seed is the data's, not the training's, unless an arm sets
  ``data.synth_seed=...{seed}``), a line under the table says so: their test t are several policies on one
  path, not independent draws of the null;
* trade t per seed: per-trade Sharpe x sqrt(trades) of the test window (its trades as the sample:
  three test days give the daily t two degrees of freedom, ~100 trades give this one power);
* atoms: the atom utilization of the last train record (share of atoms the projected targets use);
* train-path last/best: the training envs' per-bar Sharpe at the last epoch over its best epoch's (mean):
  beside last/best val it tells overfitting (the training path holds while validation falls) from a
  policy that gets worse on its own training data too (both fall);
* val trades last/best: the last epoch's validation trade count over the best validation epoch's (mean):
  above 1 the policy churns more as it decays.

``ab.json`` also lists per run (``run_all`` order) the selected epoch (``best_epoch_all``: how early the runs peak,
what ``train.early_stop_patience`` saves) and a fingerprint of its learning curve (``fingerprint_all``: a hash of every
logged train loss and validation Sharpe of fold 0). Two arms whose runs have the same fingerprints on every seed they
share are named under the table as bit for bit the same: the options that separate them did nothing (a switch that
never fires, or one whose effect rounds away: a weight decay of 1e-4 at lr 2.5e-4 did, before the optimizer folded
the decay into its step). Arms with the same train losses alone are named too: their training was the same, only
validation differed (E9's gate, which never closed on the planted market, beside the base). Put the base arm in the
grid (``SEED_RUNS`` archives cost no device time) to see it.

With ``--train-arg=--set=train.early_stop_patience=P`` every run stops P epochs after its best one: the
test/oracle columns are those of the full schedule's runs wherever no later epoch would have beaten the best
(deterministic runs: a stopped run is the full run's first epochs), at about half the device time on the
planted market (best epoch 1–3); the decay columns then end at the stopped epoch and say little.
A run whose summary.json does not list every fold (killed before its end) that logged a validation epoch
is counted as unfinished: it has no test numbers, and its decay columns run to its last logged epoch (the runs column
then reads ``3 (+2 unfinished)``). ``--table-only`` rebuilds the table from the run folders without training.
``--deploy-min-trade-t BAR`` scores the runs as if ``train.deploy_min_trade_t`` had been BAR: a seed whose
validation trade t is below it scores 0, and the line under the table names it with its policy's test t. The rule
changes no training bit, so this is exact for runs trained without it (those trained with it keep their own decision).
``--component NAME`` adds an arm named NAME with that registry component's switch (numbarl/rl/components.py),
e.g. ``--arm base --component iqn --component cql``.

A finished run is skipped by its folder name and a started one resumed with its saved config, so before training
the grid checks each such folder's config.json against the config the arm's options resolve to now (``numbarl train --print-config``, the seed
aside): a folder run with other options, or under a preset that has changed since (e.g. the `default` preset's
precision), stops the grid with an error naming the folder and the fields that differ. Fields the saved config
does not have (added to numbarl after the run) are not compared, except those whose default is not the old
behaviour (``config.LEGACY``: agent.head_pad, 1 for a run saved before it; agent.head_fuse_value, false), which
compare as that value, and the automatic ones compare as what they resolve to (``config.behaviour_fields``). A finished folder without config.json (a light
copy, e.g. ``bin/gpu-ab``'s archives before the twelfth session) cannot be checked, so it stops the grid too, naming
the folders, unless ``--accept-unchecked`` takes such folders as they are: a preset default changed since they ran
(the `default` preset's epsilon_end in the fifteenth session) would otherwise pass unseen.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from numbarl import config
from numbarl.run.compare import checkpoint_epoch, deployment, held_flat, spread, trade_t


def parse_arm_spec(text: str) -> tuple[str, list[str], list[int] | None]:
    """'name@2,3: --set a=b' -> ('name', ['--set', 'a=b'], [2, 3]); without '@': seeds None (the grid's)."""
    head, _, rest = text.partition(":")
    name, at, seeds_text = head.strip().partition("@")
    name = name.strip()
    if not name or any(c in name for c in "/ \\") or name.endswith(tuple(f"-s{i}" for i in range(10))):
        raise ValueError(f"arm {text!r}: a name is a plain word (no '/', spaces, or a '-s<digit>' ending)")
    seeds = None
    if at:
        try:
            seeds = [int(x) for x in seeds_text.split(",") if x.strip()]
        except ValueError:
            seeds = []
        if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
            raise ValueError(f"arm {text!r}: '@' takes distinct seeds >= 0, e.g. 'name@2,3,4: ...'")
    return name, rest.split(), seeds


def train_arg_sets(train_args: list[str]) -> list[str]:
    """The ``section.field=value`` overrides among the options every run gets (``--set=X`` or ``--set X``)."""
    out = []
    for i, arg in enumerate(train_args):
        if arg.startswith("--set="):
            out.append(arg[len("--set="):])
        elif arg == "--set" and i + 1 < len(train_args):
            out.append(train_args[i + 1])
    return out


def component_arm(name: str, preset: str | None = None, train_args: list[str] = ()) -> tuple[str, list[str], None]:
    """The arm of a registry component (numbarl/rl/components.py): its name and its switch as --set options, so a
    grid of single-switch A/Bs is written as component names (``--component iqn --component cql``). With `preset`,
    a switch that is already on in the grid's base (the preset with the `--set`s of `train_args`, which every run
    gets) is refused: the arm would be the base again."""
    from numbarl import config as config_mod
    from numbarl.bench.components import parse_switch
    from numbarl.rl.components import by_name

    registry = by_name()
    if name not in registry:
        raise ValueError(f"--component {name!r}: no such registry component (numbarl components lists them)")
    sets = parse_switch(registry[name].switch)
    if preset is not None:
        base = config_mod.resolve(preset, None, train_arg_sets(list(train_args)))
        try:
            same = config_mod.apply(base, sets) == base
        except config_mod.ConfigError:  # invalid on this base alone: the run says why
            same = False
        if same:
            raise ValueError(f"--component {name!r}: its switch ({registry[name].switch}) is already on in the grid's "
                             f"base (preset {preset!r} with the --train-arg settings); the arm would be the base")
    opts = []
    for key, value in sets.items():
        opts += ["--set", f"{key}={value}"]
    return name, opts, None


def parse_arm(text: str) -> tuple[str, list[str]]:
    """'name: --set a=b --set c=d' -> ('name', ['--set', 'a=b', '--set', 'c=d']); 'name' alone: no options."""
    name, opts, _ = parse_arm_spec(text)
    return name, opts


def seed_options(opts: list[str], seed: int) -> list[str]:
    """An arm's options for one seed: every ``{seed}`` replaced by the seed."""
    return [o.replace("{seed}", str(seed)) for o in opts]


def run_folder(out: Path, arm: str, seed: int) -> Path:
    return out / f"{arm}-s{seed}"


def train_command(folder: Path, preset: str, opts: list[str], seed: int, extra: list[str], resume: bool) -> list[str]:
    """The numbarl-train command of one (arm, seed) run: a new run in `folder`, or (resume) the
    interrupted one continued with the config it saved (numbarl-train refuses settings beside
    --resume)."""
    if resume:
        return [sys.executable, "-m", "numbarl", "train", "--quiet", "--resume", str(folder)]
    return [sys.executable, "-m", "numbarl", "train", "--preset", preset, "--seed", str(seed), "--quiet", *extra,
            *seed_options(opts, seed), "--out", str(folder)]


def _train(out: Path, preset: str, arm: str, opts: list[str], seed: int, extra: list[str]) -> tuple[str, int, float]:
    folder = run_folder(out, arm, seed)
    if _finished(folder):
        return str(folder), 0, 0.0
    if folder.exists() and not (folder / "checkpoints").exists():
        import shutil

        shutil.rmtree(folder)  # started but nothing to resume: start over
    cmd = train_command(folder, preset, opts, seed, extra, resume=folder.exists())
    t0 = time.time()
    with open(out / f"{arm}-s{seed}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    return str(folder), rc, time.time() - t0


def resolved_config(preset: str, opts: list[str], seed: int, extra: list[str]) -> dict:
    """The config numbarl-train resolves for one (arm, seed) run: its ``--print-config`` TOML, parsed (a
    subprocess, as the run itself: the CLI's layering and device choice stay in one place)."""
    import tomllib

    cmd = train_command(Path("unused"), preset, opts, seed, extra, resume=False)
    cmd = cmd[:cmd.index("--out")] + ["--print-config"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise ValueError(f"numbarl train {' '.join(cmd[3:])} failed: {(r.stderr or r.stdout).strip()}")
    return tomllib.loads(r.stdout)


def config_differences(saved: dict, now: dict, prefix: str = "") -> list[str]:
    """``section.field: saved -> now`` for every field of `saved` whose value `now` does not share (lists and
    tuples alike); fields `saved` lacks are not compared, nor the training seed (the folder name holds it), nor a
    field `now` lacks (--print-config leaves a None field out). A non-finite float is saved as null (config.json
    is JSON), so a saved None matches a non-finite value now."""
    out = []
    for key, old in saved.items():
        name = prefix + key
        if name == "train.seed" or key not in now:
            continue
        new = now[key]
        if isinstance(old, dict) and isinstance(new, dict):
            out += config_differences(old, new, name + ".")
        elif _plain(old) != _plain(new) and not (old is None and isinstance(new, float) and not math.isfinite(new)):
            out.append(f"{name}: {old!r} -> {new!r}")
    return out


def _plain(x):
    return [_plain(v) for v in x] if isinstance(x, (list, tuple)) else x


def check_finished_runs(out: Path, preset: str, arms, extra: list[str],
                        parallel: int = 4) -> tuple[list[str], list[Path]]:
    """(errors, unchecked): an error per finished run folder, or started one that the grid would resume (it has
    checkpoints/), whose config.json differs from what its arm resolves to now; unchecked lists the finished
    folders without config.json."""
    todo, unchecked = [], []
    for arm, opts, arm_seeds in arms:
        for seed in arm_seeds:
            folder = run_folder(out, arm, seed)
            finished = _finished(folder)
            if not (finished or (folder / "checkpoints").is_dir()):
                continue
            try:
                saved = config.saved_as_ran(json.loads((folder / "config.json").read_text()))
            except (OSError, ValueError):
                if finished:  # a folder to resume without its config.json fails in numbarl train itself
                    unchecked.append(folder)
                continue
            todo.append((folder, opts, seed, saved, finished))

    def one(job):
        folder, opts, seed, saved, finished = job
        diff = config_differences(saved, config.behaviour_fields(resolved_config(preset, opts, seed, extra)))
        what = "finished" if finished else "started (the grid would resume it)"
        return f"{folder}: {what} with other settings than its arm gives now ({'; '.join(diff)})" if diff else None

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        errors = [e for e in pool.map(one, todo) if e]
    return errors, unchecked


def _f(x):
    return float(x) if isinstance(x, (int, float)) and math.isfinite(float(x)) else None


def _ratio_to_best(xs):
    """The last value over the largest (None when the last is undefined, e.g. an epoch without trades, or
    the best is not > 0)."""
    xs = [_f(v) for v in xs]
    defined = [x for x in xs if x is not None]
    return xs[-1] / max(defined) if defined and xs[-1] is not None and max(defined) > 0 else None


def metrics_trajectory(folder: Path) -> dict:
    """Per-epoch numbers of fold 0 from metrics.jsonl: validation Sharpe and trade count, the training
    path's Sharpe, the last atom utilization, the last epoch logged (absent file: empty lists) and the learning
    curve's fingerprint (every train loss and validation Sharpe, hashed; None without a train loss)."""
    val_sharpe, val_trades, train_path, atoms, epoch, losses = [], [], [], None, 0, []
    path = folder / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a run killed while writing its last line
                continue
            if rec.get("fold", 0) != 0:
                continue
            kind = rec.get("kind")
            if kind == "val":
                val_sharpe.append(rec.get("sharpe"))
                val_trades.append(rec.get("n_trades"))
                epoch = max(epoch, int(rec.get("epoch") or 0))
            elif kind == "train_path":
                train_path.append(rec.get("train_path.sharpe"))
            elif kind == "train":
                if rec.get("atom_utilization") is not None:
                    atoms = rec["atom_utilization"]
                if rec.get("loss") is not None:
                    losses.append(rec["loss"])
    def digest(x):  # repr of the floats as logged: equal curves give equal text, any differing bit another hash
        return hashlib.sha256(json.dumps(x).encode()).hexdigest()[:16] if losses else None

    return {"val_sharpe": val_sharpe, "val_trades": val_trades, "train_path_sharpe": train_path,
            "atom_utilization": _f(atoms), "epochs": epoch, "fingerprint": digest([losses, val_sharpe]),
            "train_fingerprint": digest(losses)}


def _trades_drift(sharpe, trades):
    """The last validation epoch's trade count over the best validation epoch's (None without both)."""
    pairs = [(_f(s), _f(n)) for s, n in zip(sharpe, trades)]
    scored = [(s, i) for i, (s, _) in enumerate(pairs) if s is not None]
    if not scored or not pairs or pairs[-1][1] is None:
        return None
    best = pairs[max(scored, key=lambda p: (p[0], -p[1]))[1]][1]  # the first best epoch, as the selection
    return pairs[-1][1] / best if best else None


def _finished(folder: Path) -> bool:
    """summary.json lists every fold the run's config asks for (summary.json is rewritten after each fold);
    without a readable config.json (a folder copied without it), summary.json alone."""
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    try:
        folds = int(json.loads((folder / "config.json").read_text())["train"]["folds"])
    except (OSError, ValueError, KeyError, TypeError):
        folds = 1
    return len(summary.get("folds") or []) >= folds


def run_numbers(folder: Path, deploy_min_trade_t: float | None = None) -> dict | None:
    """The A/B numbers of one run: a finished one (fold 0 of its summary.json), or an unfinished one with at least one
    validation epoch logged (decay columns only, ``finished`` False); None otherwise. `deploy_min_trade_t`: score a
    finished run trained without train.deploy_min_trade_t as if it had been on at that bar (the rule changes no
    training bit, so this is exact); a run that recorded its own decision keeps it."""
    traj = metrics_trajectory(folder)
    common = {"run": folder.name, "atom_utilization": traj["atom_utilization"], "epochs": traj["epochs"],
              "val_curve": traj["val_sharpe"],  # the validation Sharpe per epoch, as logged
              "fingerprint": traj["fingerprint"], "train_fingerprint": traj["train_fingerprint"],
              "train_path_last_over_best": _ratio_to_best(traj["train_path_sharpe"]),
              "val_trades_last_over_best": _trades_drift(traj["val_sharpe"], traj["val_trades"])}
    path = folder / "summary.json"
    if not _finished(folder):
        if not traj["val_sharpe"]:
            return None
        return {**common, "finished": False, "test_over_oracle": None, "test_sharpe": None, "val_test_gap": None,
                "last_over_best_val": _ratio_to_best(traj["val_sharpe"]), "t": None, "hold_t": None,
                "trade_t": None}
    s = json.loads(path.read_text())
    f = s["folds"][0]
    decision = deployment(f.get("val") or {}, deploy_min_trade_t) if "deployed" not in f else None
    if decision and not decision["deployed"]:  # the rule applied afterwards, as the trainer applies it
        f = {**f, **decision, "test_policy": f.get("test")}
    test, oracle = f.get("test") or {}, f.get("oracle_test") or {}
    ratio = None
    if _f(test.get("sharpe")) is not None and _f(oracle.get("sharpe")):
        ratio = test["sharpe"] / oracle["sharpe"]
    decay = _ratio_to_best(f.get("val_sharpe_per_epoch") or [])
    days = (f["window"]["test"][1] - f["window"]["test"][0]) / float(s.get("bars_per_day") or 1.0)

    def t_of(metrics):
        x = _f((metrics or {}).get("daily_sharpe"))
        return x * math.sqrt(days / 252.0) if x is not None else None

    t, hold_t = t_of(test), t_of(f.get("hold_test"))
    # the same question asked of the trades: with three test days the daily t has two degrees of
    # freedom; a window of ~100 trades gives t = per-trade Sharpe x sqrt(trades) far more power
    test_trade_t = trade_t(test)
    flat = held_flat(f)  # train.deploy_min_trade_t held the test window flat: it earned exactly 0
    policy_t = t_of(f.get("test_policy")) if flat else None  # what the policy itself would have scored
    test_sharpe = 0.0 if flat else _f(test.get("sharpe"))
    if flat:  # a ratio only where there is an oracle (synthetic markets)
        ratio, t, test_trade_t = (0.0 if _f(oracle.get("sharpe")) else None), 0.0, 0.0
    common["best_epoch"] = checkpoint_epoch(f.get("best_checkpoint"))  # the selected checkpoint's
    return {**common, "finished": True, "test_over_oracle": ratio, "test_sharpe": test_sharpe,
            "val_test_gap": _f((f.get("val_test_gap") or {}).get("sharpe")), "last_over_best_val": decay,
            "t": t, "hold_t": hold_t, "trade_t": test_trade_t, "held_flat": flat, "policy_t": policy_t}


def arm_row(name: str, runs: list[dict]) -> dict:
    done = [x for x in runs if x.get("finished", True)]
    r = {"arm": name, "runs": len(done), "unfinished": len(runs) - len(done),
         "unfinished_epochs": [x.get("epochs") for x in runs if not x.get("finished", True)]}
    for key in ("test_over_oracle", "val_test_gap", "last_over_best_val", "atom_utilization",
                "train_path_last_over_best", "val_trades_last_over_best"):
        xs = [x[key] for x in runs]
        s = spread(xs) or {}
        r[f"{key}_mean"], r[f"{key}_std"], r[f"{key}_min"] = s.get("mean"), s.get("std"), s.get("min")
        r[f"{key}_all"] = xs
    ts = [x["t"] for x in runs if x["t"] is not None]
    r["abs_t_max"] = max(abs(v) for v in ts) if ts else None
    r["t_at_abs_max"] = max(ts, key=abs) if ts else None  # with its sign: a losing seed is not a false edge
    r["t_all"], r["hold_t_all"] = [x["t"] for x in runs], [x.get("hold_t") for x in runs]
    r["trade_t_all"] = [x.get("trade_t") for x in runs]
    r["held_flat_all"], r["policy_t_all"] = [x.get("held_flat", False) for x in runs], [x.get("policy_t") for x in runs]
    # every *_all list is over the same runs, in this order (an unfinished run: None where it has no number)
    r["run_all"], r["finished_all"] = [x["run"] for x in runs], [x.get("finished", True) for x in runs]
    r["best_epoch_all"] = [x.get("best_epoch") for x in runs]  # the epoch the test window scored (finished runs)
    r["val_curve_all"] = [x.get("val_curve") for x in runs]
    r["val_curve_mean"] = curve_mean(_done_values(r, "val_curve"))
    r["val_curve_n"] = [len(xs) for xs in curve_points(_done_values(r, "val_curve"))]  # seeds behind each mean
    r["fingerprint_all"] = [x.get("fingerprint") for x in runs]
    r["train_fingerprint_all"] = [x.get("train_fingerprint") for x in runs]
    return r


def curve_points(curves: list) -> list[list[float]]:
    """Per epoch, the numbers the curves (lists of floats, None where an epoch had no number) have there: the
    curves that reach that epoch and scored it."""
    curves = [c or [] for c in curves]
    return [[_f(c[e]) for c in curves if e < len(c) and _f(c[e]) is not None]
            for e in range(max((len(c) for c in curves), default=0))]


def curve_mean(curves: list) -> list:
    """The per-epoch mean of the curves over :func:`curve_points`; None for an epoch without any number."""
    return [sum(xs) / len(xs) if xs else None for xs in curve_points(curves)]


def curve_note(rows: list[dict]) -> str:
    """The lines under the table with each arm's mean validation Sharpe per epoch over its finished seeds: where the
    arm peaks and how it decays, which last/best val sums up in one number (empty without curves). An epoch that
    fewer seeds reached (early stopping) or scored names its count, e.g. "35.7 (n=3)"."""
    def epochs(r):
        full = max(r["val_curve_n"], default=0)
        return ", ".join(_c(x, ".1f") + (f" (n={n})" if n != full else "")
                         for x, n in zip(r["val_curve_mean"], r["val_curve_n"]))

    lines = [f"{r['arm']}: {epochs(r)}" for r in rows if r.get("val_curve_mean")]
    if not lines:
        return ""
    return "\nValidation Sharpe per epoch, mean over the finished seeds:\n" + "".join(f"- {x}\n" for x in lines)


def _seed_of(run: str) -> str:
    return run.rsplit("-s", 1)[-1]


def identical_arms(rows: list[dict], key: str = "fingerprint") -> list[tuple[str, str, list[str]]]:
    """Pairs of arms whose finished runs have the same learning-curve fingerprint on every seed both have (at least
    one): (arm, arm, the seeds), in table order. Such arms trained the same bits: what separates them did nothing.
    key "train_fingerprint": the train losses alone (the same training, validation perhaps scored otherwise)."""
    prints = []
    for r in rows:
        fp = {_seed_of(run): f for run, f in zip(_done_values(r, "run"), _done_values(r, key)) if f is not None}
        prints.append((r["arm"], fp))
    pairs = []
    for i, (a, fa) in enumerate(prints):
        for b, fb in prints[i + 1:]:
            seeds = sorted(set(fa) & set(fb), key=lambda x: (len(x), x))
            if seeds and all(fa[k] == fb[k] for k in seeds):
                pairs.append((a, b, seeds))
    return pairs


def identical_note(rows: list[dict]) -> str:
    """The lines under the table that name arms which trained the same bits (empty when there are none)."""
    same = identical_arms(rows)
    text = "".join(f"\nArms {a} and {b} are bit for bit the same on seed(s) {', '.join(seeds)} (every train loss and "
                   f"validation Sharpe): the options that separate them did nothing in these runs.\n"
                   for a, b, seeds in same)
    pairs = {(a, b) for a, b, _ in same}
    return text + "".join(f"\nArms {a} and {b} trained the same bits on seed(s) {', '.join(seeds)} (every train loss): "
                          f"the options that separate them changed only how validation was scored.\n"
                          for a, b, seeds in identical_arms(rows, "train_fingerprint") if (a, b) not in pairs)


def _done_values(r: dict, key: str) -> list:
    """The row's `key`_all values of its finished runs, in run order."""
    return [x for x, done in zip(r.get(f"{key}_all", []), r.get("finished_all", [])) if done]


def _shared_hold_t(r: dict):
    """The buy-and-hold t that every finished run of the row scored (two or more runs), else None."""
    holds = _done_values(r, "hold_t")
    return holds[0] if len(holds) >= 2 and holds[0] is not None and all(h == holds[0] for h in holds) else None


def shared_window_note(rows: list[dict]) -> str:
    """One line under the table naming the arms whose finished seeds (two or more) all scored a test window with
    the same buy-and-hold t: one market path each, so their seeds' test t are not independent draws (empty when
    there are none)."""
    shared = [f"{r['arm']} (hold t {_shared_hold_t(r):+.2f})" for r in rows if _shared_hold_t(r) is not None]
    if not shared:
        return ""
    return (f"\nOne test window path per arm, the same for each of its seeds: {', '.join(shared)}. Their test t are "
            "several policies on one path, not independent draws of the market; a seed-dependent market "
            "(--set data.synth_seed=...{seed}) gives independent ones.\n")


def held_flat_note(rows: list[dict]) -> str:
    """One line under the table naming the seeds whose test window train.deploy_min_trade_t held flat (their test
    t and test/oracle are 0 in the table), each with the test t its policy would have scored (empty when none)."""
    held = []
    for r in rows:
        seeds = [f"{run.rsplit('-s', 1)[-1]} ({_c(pt, '+.2f')})" for run, flat, pt, done in
                 zip(r.get("run_all", []), r.get("held_flat_all", []), r.get("policy_t_all", []), r.get("finished_all", []))
                 if flat and done]
        if seeds:
            held.append(f"{r['arm']} seed(s) {', '.join(seeds)}")
    if not held:
        return ""
    return (f"\nHeld flat by train.deploy_min_trade_t or --deploy-min-trade-t (validation trade t below the bar; test t and test/oracle 0 in "
            f"the table), with the test t each policy would have scored: {'; '.join(held)}.\n")


def _c(x, spec=".2f"):
    return "n/a" if x is None else format(x, spec)


def format_table(rows: list[dict]) -> str:
    head = ("| arm | runs | test/oracle per seed | mean | std | min | val-test mean | val-test std "
            "| last/best val mean | min | best epochs | test t per seed | hold t | trade t per seed | atoms | train-path last/best "
            "| val trades last/best |")
    lines = [head, "|" + "|".join(["---"] * 17) + "|"]
    for r in rows:
        per = ", ".join(_c(x) for x in _done_values(r, "test_over_oracle"))
        trade_t = ", ".join(_c(x, ".1f") for x in _done_values(r, "trade_t"))
        test_t = ", ".join(_c(x) for x in _done_values(r, "t"))
        best = ", ".join(_c(x, "d") for x in _done_values(r, "best_epoch"))
        shared = _shared_hold_t(r)  # one number for one market path, else each run's
        hold = _c(shared, "+.2f") if shared is not None else ", ".join(_c(h, "+.2f") for h in _done_values(r, "hold_t"))
        runs = str(r["runs"]) + (f" (+{r['unfinished']} unfinished)" if r.get("unfinished") else "")
        lines.append(f"| {r['arm']} | {runs} | {per} | {_c(r['test_over_oracle_mean'])} | "
                     f"{_c(r['test_over_oracle_std'])} | {_c(r['test_over_oracle_min'])} | {_c(r['val_test_gap_mean'], '.1f')} | "
                     f"{_c(r['val_test_gap_std'], '.1f')} | {_c(r['last_over_best_val_mean'])} | "
                     f"{_c(r['last_over_best_val_min'])} | {best} | {test_t} | {hold} | "
                     f"{trade_t} | {_c(r['atom_utilization_mean'])} | "
                     f"{_c(r['train_path_last_over_best_mean'])} | {_c(r['val_trades_last_over_best_mean'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="numbarl ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder of the grid's run folders and its table")
    ap.add_argument("--preset", default="default")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated training seeds")
    ap.add_argument("--arm", action="append", default=[], help="'NAME' or 'NAME: numbarl-train options' (repeat)")
    ap.add_argument("--component", action="append", default=[], metavar="NAME",
                    help="an arm named after a registry component with its switch on (repeat; numbarl components)")
    ap.add_argument("--parallel", type=int, default=4, help="runs at once")
    ap.add_argument("--table-only", action="store_true", help="only rebuild the table from the run folders")
    ap.add_argument("--train-arg", action="append", default=[], help="an option added to every run (repeat)")
    ap.add_argument("--deploy-min-trade-t", type=float, default=None, metavar="BAR",
                    help="score runs trained without train.deploy_min_trade_t as if it had been BAR (exact: the rule "
                         "changes no training bit); runs that recorded their own decision keep it")
    ap.add_argument("--accept-unchecked", action="store_true",
                    help="take finished run folders without config.json as they are (their settings cannot be "
                         "checked; without this option they stop the grid)")
    a = ap.parse_args(argv)
    try:
        seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
        specs = [*map(parse_arm_spec, a.arm),  # a finished grid's table is rebuilt without the check
                 *(component_arm(c, None if a.table_only else a.preset, a.train_arg) for c in a.component)]
        arms = [(n, o, s if s is not None else seeds) for n, o, s in specs]
    except ValueError as e:  # a ConfigError (an unknown preset) too
        print(f"error: {e}", file=sys.stderr)
        return 2
    bar = a.deploy_min_trade_t
    if bar is not None and not (math.isfinite(bar) and bar >= 0):
        print(f"error: --deploy-min-trade-t {bar} must be a number >= 0 (0: off)", file=sys.stderr)
        return 2
    if not arms or not seeds or len({n for n, _, _ in arms}) != len(arms):
        print("error: give at least one --arm (distinct names) and one seed", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab-config.json").write_text(json.dumps({"preset": a.preset, "seeds": seeds, "arms": a.arm,
                                                    "components": a.component,
                                                    "train_args": a.train_arg}, indent=2))
    if not a.table_only:
        try:
            errors, unchecked = check_finished_runs(out, a.preset, arms, a.train_arg, a.parallel)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if errors:
            print("error: " + "\n       ".join(errors) + "\n       remove those folders or give the arm another "
                  "name", file=sys.stderr)
            return 2
        if unchecked and not a.accept_unchecked:
            print(f"error: {len(unchecked)} finished run folder(s) have no config.json, so their settings cannot be "
                  f"checked against what their arm gives now: {', '.join(str(f) for f in unchecked)}\n"
                  "       pass --accept-unchecked to take them as they are (they may have run under an older "
                  "preset), or remove them", file=sys.stderr)
            return 2
        if unchecked:
            print(f"ab: {len(unchecked)} finished run folder(s) without config.json are taken as they are "
                  "(--accept-unchecked: their settings cannot be checked)", file=sys.stderr)
        jobs = [(arm, opts, seed) for arm, opts, arm_seeds in arms for seed in arm_seeds]
        with ThreadPoolExecutor(max_workers=max(1, a.parallel)) as pool:
            for folder, rc, secs in pool.map(lambda j: _train(out, a.preset, j[0], j[1], j[2], a.train_arg), jobs):
                print(f"{folder}: rc {rc}, {secs:.0f} s", flush=True)
    rows = []
    for arm, _, arm_seeds in arms:
        runs = [n for n in (run_numbers(run_folder(out, arm, s), a.deploy_min_trade_t) for s in arm_seeds)
                if n is not None]
        rows.append(arm_row(arm, runs))
    notes = identical_note(rows) + shared_window_note(rows) + held_flat_note(rows) + curve_note(rows)  # each starts with a line break
    table = format_table(rows) + ("\n" + notes.rstrip("\n") if notes else "")  # a blank line ends the table
    (out / "ab.md").write_text(table + "\n")
    (out / "ab.json").write_text(json.dumps(rows, indent=2))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
