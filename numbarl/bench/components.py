"""Cost of each learning component (issue 14): ms each adds to the c51 agent's train step.

The configurations: the base (the preset alone); for every c51 component of the registry
(numbarl/rl/components.py) whose `--set` switch is not already on in the preset, the preset with
that switch on; last, every measured switch on together. Each configuration is built the
way numbarl-train builds a fold (numbarl.run.trainer.FoldTrainer: env, agent, validation feedback
loop, step functions), its replay prefilled by replaying the collect graph, the value support fitted
when the config asks for it, and then the trainer's own graphs are captured with the trainer's own
capture and replayed:

* `collect`    the acting step (gather, forward, gates, epsilon-greedy, env step, replay write);
* `train`      the train step (without the auxiliary losses when the agent has them);
* `train_aux`  the train step with the auxiliary losses (IQN, IQL, CQL, confidence, E7), which the
               trainer replays every agent.aux_frequency-th train step (agent.aux_every).

Timing follows numbarl.bench.train: warm-up replays, then `repeats` x `reps` replays between two
CUDA events, the median of the repeats per replay (under the simulator: synchronized wall time,
which says nothing about a GPU; it only proves the bench runs). Amortized train step =
((aux_every - 1) x train + train_aux) / aux_every, the cost per train step of a run.

Liveness (the honest part): a component's registry entry names the metrics key that proves it ran.
Before the timed replays the key's slot in the agent's mapped stats is set to NaN (a counter's
value is remembered instead); after them the trainer's diagnostics graph runs (as before every log
read) and the key is read: `live` means the key meets its condition and was written (a counter
advanced) by the replays since (the warm-up and timed replays of the same captured graphs, and the
diagnostics on what they left). Env telemetry keys (train_path.*) are zeroed before those replays.
Validation feedback keys (feedback.*) move at epoch ends from validation backtests, which this
bench does not run, and they are not reset: their value is reported, `live` is None ("unproven
here"; some keys, e.g. E3's discount, meet their condition from the start). The base row reads every
measured key too: none may be live with its switch off, or that key proves nothing.

    python -m numbarl.bench.components [--preset default] [--components iqn,cql] [--reps 50]
                                       [--tf32] [--json OUT] [--markdown OUT] [--profile]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import statistics
import sys
import tempfile
import time

from numbarl.cuda import backend

AGENT_KIND = "c51"
TRAIN_GRAPHS = ("train", "train_aux")  # the agent's step-function names (DqnAgent.step_functions)
ACT_GRAPH = "collect"
BASE = "base"
ALL_ON = "all"
# `section.field=` starts a new --set inside a switch; anything else after a comma belongs to the
# value before it (agent.horizons=1,3,4 and agent.spectral_norm=trunk.fc0,head.value are one --set)
_SET_START = re.compile(r"^\s*[a-z_]+\.[a-z_0-9]+\s*=")


# ---------------------------------------------------------------------------------------------
# the configurations: switches from the registry
# ---------------------------------------------------------------------------------------------
def parse_switch(switch: str) -> dict[str, str]:
    """A registry switch as {"section.field": "value"}: one `--set` (`agent.iqn=true`), several
    separated by commas, semicolons or whitespace (`agent.iqn=true,agent.iqn_quantiles=8`), with
    commas inside a value kept (`agent.horizons=1,3,4`)."""
    pieces = [p for p in re.split(r"[;\s]+|,", switch.strip()) if p != ""]
    pairs: list[list[str]] = []
    for piece in pieces:
        if _SET_START.match(piece):
            key, _, value = piece.partition("=")
            pairs.append([key.strip(), value.strip()])
        elif pairs:
            pairs[-1][1] += "," + piece.strip()
        else:
            raise ValueError(f"component switch {switch!r}: {piece!r} is not section.field=value")
    return {k: v for k, v in pairs}


def base_config(preset: str, sets=(), batch: int | None = None, n_envs: int | None = None, tf32: bool = False):
    """The preset with the bench's own overrides (the `--set`s first, then --batch, --n-envs, --tf32)."""
    from numbarl import config as config_mod

    direct = {"agent.batch_size": batch, "train.n_envs": n_envs, "agent.compute": "tf32" if tf32 else None}
    return config_mod.resolve(preset, None, list(sets), **{k: v for k, v in direct.items() if v is not None})


def plan(base, only=None) -> tuple[list[dict], list[dict]]:
    """([variant], [skipped]) for the c51 components of the registry, in registry order.

    variant: {"component", "switch", "sets", "config"}; skipped: {"component", "switch", "why"}
    (another agent kind, already on in the preset, or invalid on top of it). `only`: the names to
    keep (an unknown name is a ConfigError that lists the known ones)."""
    from numbarl import config as config_mod
    from numbarl.rl.components import COMPONENTS

    names = [c.name for c in COMPONENTS]
    if only:
        unknown = [n for n in only if n not in names]
        if unknown:
            raise config_mod.ConfigError(f"--components: no component {', '.join(unknown)}; the registry has "
                                         f"{', '.join(names)}")
    variants, skipped = [], []
    for c in COMPONENTS:
        if only and c.name not in only:
            continue
        if base.agent.kind not in c.agent_kinds:
            skipped.append({"component": c.name, "switch": c.switch,
                            "why": f"a component of agent.kind {'/'.join(c.agent_kinds)}"})
            continue
        sets = parse_switch(c.switch)
        try:
            cfg = config_mod.apply(base, sets).validate()
        except config_mod.ConfigError as e:
            skipped.append({"component": c.name, "switch": c.switch, "why": f"invalid on preset {base.preset}: {e}"})
            continue
        if cfg == base:
            skipped.append({"component": c.name, "switch": c.switch, "why": f"already on in preset {base.preset}"})
            continue
        variants.append({"component": c.name, "switch": c.switch, "sets": sets, "config": cfg})
    return variants, skipped


def combine(base, variants) -> tuple[dict, list[str], list[dict]]:
    """Every variant's switch on at once, in registry order: (sets, the components in it, the
    ones left out {"component", "why"}). A component is left out when it sets a field an earlier
    one set to another value, or when config validation rejects it beside those already in (the
    pairs that fail alone are named)."""
    from numbarl import config as config_mod

    sets: dict[str, str] = {}
    included, left_out = [], []
    for v in variants:
        clash = [(k, sets[k]) for k, val in v["sets"].items() if k in sets and sets[k] != val]
        if clash:
            k, val = clash[0]
            owner = next(u["component"] for u in variants if u["component"] in included and u["sets"].get(k) == val)
            left_out.append({"component": v["component"], "why": f"mutually exclusive with {owner} ({k})"})
            continue
        try:
            config_mod.apply(base, {**sets, **v["sets"]}).validate()
        except config_mod.ConfigError as e:
            pairs = []
            for u in variants:
                if u["component"] not in included:
                    continue
                try:
                    config_mod.apply(base, {**u["sets"], **v["sets"]}).validate()
                except config_mod.ConfigError:
                    pairs.append(u["component"])
            with_ = f"with {', '.join(pairs)}" if pairs else "with the components before it together"
            left_out.append({"component": v["component"], "why": f"invalid {with_}: {e}"})
            continue
        sets.update(v["sets"])
        included.append(v["component"])
    return sets, included, left_out


# ---------------------------------------------------------------------------------------------
# one configuration: built, warmed and captured as numbarl-train does, then timed
# ---------------------------------------------------------------------------------------------
class Markets:
    """The data each configuration trains on, prepared once per data config (the trainer's
    prepare_data, its first walk-forward fold, the market on the device)."""

    def __init__(self):
        self._by_data = {}

    def get(self, cfg):
        key = (cfg.data, cfg.train.folds, cfg.train.embargo_bars, cfg.train.train_sessions, cfg.train.val_sessions,
               cfg.train.test_sessions, cfg.env.vol_span, cfg.env.vol_horizon_bars)
        if key not in self._by_data:
            from numbarl.env.market import MarketData
            from numbarl.run.trainer import make_folds, prepare_data

            cache = prepare_data(cfg.data, log=lambda msg: print(msg, flush=True))
            market = MarketData.from_cache(cache).to_device(cfg.env.vol_span, cfg.env.vol_horizon_bars)
            self._by_data[key] = (cache, market, make_folds(cache, cfg.train)[0])
        return self._by_data[key]


def build(cfg, markets: Markets, folder: str):
    """A FoldTrainer of fold 0 (the trainer's env, agent, feedback loop and step functions); its
    run folder lives in memory (nothing is logged or saved)."""
    from numbarl.run.progress import Progress
    from numbarl.run.runio import RunDir
    from numbarl.run.trainer import FoldTrainer

    cache, market, fold = markets.get(cfg)
    run = RunDir(folder, cfg.to_dict(), {"graph": True, "feature_names": list(cache.feature_names)})
    ft = FoldTrainer(cfg, market, fold, run, graph=True, progress=Progress(quiet=True))
    if cache.oracle is not None and hasattr(ft.agent, "set_behavior_signal"):
        ft.agent.set_behavior_signal(cache.oracle)  # as run_training does
    return ft


def warm(ft) -> list[str]:
    """Prefill the replay by replaying the collect graph (captured on its first use, as in
    run_epoch), fit the support if the config asks, capture the train graphs; returns their names.
    Each capture's warm-up run is a real step, as in training."""
    t = ft.cfg.train
    ready = max(int(t.learning_starts), int(ft.agent.prefill_steps), 1)
    while ft.collect_steps < ready:
        ft.collect_once()
    if not ft.support_fitted:
        ft.fit_support()
    names = [name for name in TRAIN_GRAPHS if name in ft.steps]
    for name in names:
        ft.replay_graph(name)
    ft.stream.synchronize()
    return names


def time_graph(graph, stream, reps: int, repeats: int, warmup: int) -> float:
    """Median over `repeats` of the ms per replay of `reps` back-to-back replays, after `warmup`
    replays: CUDA events on a GPU (numbarl.bench.train's method), synchronized wall time on the
    simulator (whose events measure nothing)."""
    from numbarl.cuda.runtime import cuda, simulator

    for _ in range(warmup):
        graph.replay(stream)
    stream.synchronize()
    c = cuda()
    times = []
    for _ in range(repeats):
        if simulator():
            t0 = time.perf_counter()
            for _ in range(reps):
                graph.replay(stream)
            stream.synchronize()
            times.append((time.perf_counter() - t0) * 1e3 / reps)
            continue
        start, end = c.event(timing=True), c.event(timing=True)
        start.record(stream)
        for _ in range(reps):
            graph.replay(stream)
        end.record(stream)
        end.synchronize()
        times.append(c.event_elapsed_time(start, end) / reps)
    return statistics.median(times)


class Liveness:
    """The liveness keys of the components on in a configuration, armed before the timed replays
    and read after them (see the module docstring)."""

    def __init__(self, ft, components):
        self.ft, self.components = ft, components
        self.layout = ft.agent.stats_layout
        self.before = {}

    def arm(self):
        from numbarl.env.telemetry import KEY_PREFIXES, epoch_record

        ft = self.ft
        ft.stream.synchronize()
        host = ft.agent.stats.host
        for c in self.components:
            if c.liveness in self.layout:
                slot = self.layout[c.liveness]
                if slot.kind == "int":  # a counter: it must advance during the timed replays
                    self.before[c.liveness] = float(host[slot.index])
                else:  # a value: it must be written by them
                    host[slot.index] = math.nan
        if any(c.liveness.startswith(KEY_PREFIXES) for c in self.components):
            epoch_record(ft.telemetry, ft.stream, ft.market.bars_per_day)  # zeroes the env's accumulators

    def read(self) -> list[dict]:
        from numbarl.env.telemetry import KEY_PREFIXES, epoch_record

        ft = self.ft
        if "diagnostics" in ft.steps:  # what the trainer runs before every log read
            ft.replay_graph("diagnostics")
        stats = ft.agent.read_stats(ft.stream)
        if ft.loop is not None:
            stats.update(ft.loop.train_stats())
        if any(c.liveness.startswith(KEY_PREFIXES) for c in self.components):
            stats.update(epoch_record(ft.telemetry, ft.stream, ft.market.bars_per_day))  # NaN: None
        out = []
        for c in self.components:
            value = stats.get(c.liveness)
            value = None if value is None else float(value)
            if c.liveness not in stats:
                live, how = False, "not in this configuration's stats"
            elif c.liveness in self.before:
                live = value is not None and value > self.before[c.liveness] and c.is_live(value)
                how = f"counter {self.before[c.liveness]:g} -> {value:g}" if value is not None else "undefined"
            elif c.liveness in self.layout:
                live = value is not None and c.is_live(value)
                how = "set to NaN before the timed replays"
            elif c.liveness.startswith(KEY_PREFIXES):
                live = value is not None and c.is_live(value)
                how = "env telemetry zeroed before the timed replays"
                if value is None:  # no env wrote the term in ~60 collect steps
                    how += ("; undefined after them: a start-up rule can hold a term at 0 for longer "
                            "(env.dsr_warmup_trades: each env's first trades)")
            else:  # not reset, and moved by validation (at epoch ends) only: neither proof nor disproof
                live, how = None, "feedback state, moves only at epoch ends: unproven here"
            out.append({"component": c.name, "key": c.liveness, "live_when": c.live_when, "value": value,
                        "live": live if live is None else bool(live), "how": how})
        return out


def close_graphs(ft) -> None:
    """Destroy the configuration's executable graphs (they hold its buffers' addresses)."""
    for g in ft.graphs.values():
        close = getattr(g, "close", None)
        if close is not None:
            close()
    ft.graphs.clear()


def free_device_memory() -> None:
    """Give the last configuration's device memory back before the next one is built."""
    gc.collect()
    try:
        from numbarl.cuda.runtime import cuda

        cuda().current_context().deallocations.clear()  # numba defers frees: flush them now
    except AttributeError:  # the simulator has no deferred frees
        pass


def measure(cfg, components, markets: Markets, reps: int, repeats: int, warmup: int) -> dict:
    """Build, warm, capture and time one configuration; its row (without the deltas)."""
    free_device_memory()  # also what a configuration that failed left behind
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="numbarl-bench-components-") as folder:
        ft = build(cfg, markets, folder)
        try:
            names = warm(ft)
            live = Liveness(ft, components)
            live.arm()
            s = ft.stream
            ms = {name: time_graph(ft.graphs[name], s, reps, repeats, warmup) for name in (ACT_GRAPH, *names)}
            aux_every = int(ft.agent.aux_every)
            liveness = live.read()
        finally:
            close_graphs(ft)
        del ft, live
    free_device_memory()
    train_aux = ms.get("train_aux")
    return {"collect_ms": ms[ACT_GRAPH], "train_ms": ms["train"], "train_aux_ms": train_aux, "aux_every": aux_every,
            "amortized_ms": amortized_ms(ms["train"], train_aux, aux_every), "liveness": liveness,
            "build_s": time.perf_counter() - t0}


def profile_kernels(cfg, markets: Markets) -> dict:
    """GPU time per kernel of one configuration's eager train (and train_aux) and collect steps
    (numbarl.bench.train.kernel_profile: empty without torch or a CUDA device), from a fresh build: the
    profiling pass runs after every row is timed, so no timing runs with a CUPTI session attached."""
    from numbarl.bench.train import kernel_profile

    free_device_memory()
    with tempfile.TemporaryDirectory(prefix="numbarl-bench-components-") as folder:
        ft = build(cfg, markets, folder)
        try:
            names = warm(ft)
            out = {f"kernels_{name}": kernel_profile(ft.steps[name], ft.stream) for name in (*names, ACT_GRAPH)}
        finally:
            close_graphs(ft)
        del ft
    free_device_memory()
    return out


def amortized_ms(train_ms: float, train_aux_ms: float | None, aux_every: int) -> float:
    """ms per train step of a run: aux_every - 1 plain train steps and one with the auxiliary
    losses (DqnAgent.after_collect's rhythm); the plain step when the agent has no aux step."""
    if train_aux_ms is None:
        return train_ms
    return ((aux_every - 1) * train_ms + train_aux_ms) / aux_every


# ---------------------------------------------------------------------------------------------
# the run and its report
# ---------------------------------------------------------------------------------------------
def run(args) -> dict:
    from numbarl import config as config_mod
    from numbarl.cuda.runtime import device_name, simulator
    from numbarl.rl.components import by_name

    only = [n.strip() for n in args.components.split(",") if n.strip()] if args.components else None
    base = base_config(args.preset, args.set or (), args.batch, args.n_envs, args.tf32)
    if base.agent.kind != AGENT_KIND:
        raise config_mod.ConfigError(f"agent.kind = {base.agent.kind!r}: this bench measures the {AGENT_KIND} "
                                     f"agent's train step; leave agent.kind at {AGENT_KIND!r}")
    variants, skipped = plan(base, only)
    all_sets, all_members, left_out = combine(base, variants)
    registry = by_name()
    results = {
        "device": device_name(), "timing": "synchronized wall time (simulator)" if simulator() else "CUDA events",
        "preset": base.preset, "sets": list(args.set or ()), "compute": base.agent.compute,
        "batch": base.agent.batch_size, "n_envs": base.train.n_envs, "trunk": list(base.agent.trunk),
        "n_atoms": base.agent.n_atoms, "aux_frequency": base.agent.aux_frequency,
        "reps": args.reps, "repeats": args.repeats, "warmup": args.warmup,
        "rows": [], "skipped": skipped, "all_on": {"components": all_members, "left_out": left_out},
    }
    # the base reads every measured component's key too: with the switches off none may be live,
    # or that key proves nothing
    configs = [(BASE, "", base, [registry[v["component"]] for v in variants])]
    configs += [(v["component"], v["switch"], v["config"], [registry[v["component"]]]) for v in variants]
    if len(all_members) > 1:
        configs.append((ALL_ON, " ".join(f"{k}={v}" for k, v in all_sets.items()),
                        config_mod.apply(base, all_sets).validate(), [registry[n] for n in all_members]))
    markets = Markets()
    for name, switch, cfg, comps in configs:
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {switch or 'preset ' + base.preset}", flush=True)
        row = {"component": name, "switch": switch}
        try:
            row.update(measure(cfg, comps, markets, args.reps, args.repeats, args.warmup))
        except Exception as e:  # one configuration that cannot run is a row of the table, not the end of it
            if name == BASE:
                raise
            row["error"] = f"{type(e).__name__}: {e}"
            print(f"  error: {row['error']}", file=sys.stderr, flush=True)
        results["rows"].append(row)
    add_deltas(results["rows"])
    if getattr(args, "profile", False):  # a second pass: every timing above ran without a profiler attached
        for (name, _, cfg, _), row in zip(configs, results["rows"]):
            if "error" in row:
                continue
            try:
                row.update(profile_kernels(cfg, markets))
            except Exception as e:  # noqa: BLE001  (any failure: the timed row stays, the profile says why it is missing)
                row["kernels_error"] = f"{type(e).__name__}: {e}"
                print(f"  {name}: profile failed: {row['kernels_error']}", file=sys.stderr, flush=True)
    return results


def add_deltas(rows: list[dict]) -> None:
    """Δ of every row's amortized train step and collect step against the base row (ms and %)."""
    base = rows[0]
    for r in rows:
        if "amortized_ms" not in r:
            continue
        r["delta_ms"] = r["amortized_ms"] - base["amortized_ms"]
        r["delta_pct"] = 100.0 * r["delta_ms"] / base["amortized_ms"] if base["amortized_ms"] > 0 else math.nan
        r["collect_delta_ms"] = r["collect_ms"] - base["collect_ms"]


def kernel_deltas(base: dict, row: dict, key: str = "kernels_train", top: int = 8) -> list[tuple[str, float, float]]:
    """The kernels whose GPU time per step differs most between a row and the base row: (kernel, Δ µs, calls per
    step in the row), largest |Δ| first; empty without profiles."""
    a, b = base.get(key) or {}, row.get(key) or {}
    out = []
    for name in set(a) | set(b):
        d = b.get(name, {}).get("us", 0.0) - a.get(name, {}).get("us", 0.0)
        out.append((name, d, b.get(name, {}).get("calls", 0.0)))
    return sorted(out, key=lambda x: -abs(x[1]))[:top]


def short_kernel_name(name: str, width: int = 64) -> str:
    """A profiler's kernel name, readable: numba's mangled ``numbarl::a::b::kernel[abi:...]...`` as ``b.kernel``,
    any other name (cuBLAS, CUTLASS templates) cut to `width` characters."""
    if name.startswith("numbarl::"):
        path = name.split("[", 1)[0].split("::")
        return ".".join(path[-2:])
    return name if len(name) <= width else name[: width - 1] + "…"


# the steps --profile times per kernel: (the row's key, the step's name)
PROFILED_STEPS = (("kernels_train", "train"), ("kernels_train_aux", "train_aux"), (f"kernels_{ACT_GRAPH}", ACT_GRAPH))


def base_kernels_text(base: dict, top: int = 10) -> list[str]:
    """The base row's own GPU time per step by kernel (its largest `top`), one line per profiled step."""
    lines = []
    for key, what in PROFILED_STEPS:
        kernels = base.get(key) or {}
        if not kernels:
            continue
        total = sum(k.get("us", 0.0) for k in kernels.values())
        ranked = sorted(kernels.items(), key=lambda kv: -kv[1].get("us", 0.0))[:top]
        lines.append(f"{BASE} ({what} step), GPU µs per step {total:.1f} in {len(kernels)} kernels, largest: "
                     + "; ".join(f"{short_kernel_name(n)} {k.get('us', 0.0):.1f} ({k.get('calls', 0.0):g}/step)"
                                 for n, k in ranked))
    return lines


def profile_text(results: dict) -> str:
    """The base row's kernels, then per component the kernels that account for its Δ (train and collect steps),
    from --profile."""
    rows = results["rows"]
    lines = base_kernels_text(rows[0])
    for r in rows[1:]:
        if "error" in r or "kernels_error" in r:
            lines.append(f"{r['component']}: no profile ({r.get('error') or r.get('kernels_error')})")
            continue
        for key, what in PROFILED_STEPS:
            if key not in r or key not in rows[0]:
                continue
            deltas = kernel_deltas(rows[0], r, key)
            if deltas:
                lines.append(f"{r['component']} ({what} step), Δ µs per step against {BASE}: "
                             + "; ".join(f"{short_kernel_name(n)} {d:+.1f} ({c:g}/step)" for n, d, c in deltas))
    if not lines and any(k.startswith("kernels_") and k != "kernels_error" for r in rows for k in r):
        lines.append("--profile: no kernel times (needs torch with CUDA and a GPU; the simulator has no CUPTI)")
    return "\n".join(lines)


def _live_text(row) -> str:
    if not row.get("liveness"):
        return ""
    provable = [x for x in row["liveness"] if x["live"] is not None]
    if row["component"] == BASE:
        on = [x["component"] for x in provable if x["live"]]
        return (f"LIVE with its switch off: {', '.join(on)}" if on
                else f"0/{len(provable)} keys live (every switch off)")
    if row["component"] == ALL_ON:
        dead = [x["component"] for x in provable if not x["live"]]
        unproven = [x["component"] for x in row["liveness"] if x["live"] is None]
        return (f"{len(provable) - len(dead)}/{len(provable)} live" + (f"; NOT live: {', '.join(dead)}" if dead else "")
                + (f"; unproven here: {', '.join(unproven)}" if unproven else ""))
    x = row["liveness"][0]
    value = "undefined" if x["value"] is None else f"{x['value']:.4g}"
    verdict = "live" if x["live"] else x["how"] if x["live"] is None else "NOT live: " + x["how"]
    return f"{x['key']} = {value} ({verdict})"


COLUMNS = ("component", "train ms", "train_aux ms", "aux every", "amortized ms", "Δ ms", "Δ %", "collect ms",
           "Δ collect ms", "liveness after the timed replays")


def _cells(r) -> list[str]:
    if "error" in r:
        return [r["component"], "error: " + r["error"]] + [""] * (len(COLUMNS) - 2)

    def f(x, spec=".3f"):
        return "" if x is None else format(x, spec)

    return [r["component"], f(r["train_ms"]), f(r["train_aux_ms"]), str(r["aux_every"]), f(r["amortized_ms"]),
            f(r["delta_ms"], "+.3f"), f(r["delta_pct"], "+.1f"), f(r["collect_ms"]), f(r["collect_delta_ms"], "+.3f"),
            _live_text(r)]


def _notes(results) -> list[str]:
    lines = []
    a = results["all_on"]
    if a["left_out"]:
        lines.append(f"'{ALL_ON}' leaves out: " + "; ".join(f"{x['component']} ({x['why']})" for x in a["left_out"]))
    for s in results["skipped"]:
        lines.append(f"not measured: {s['component']} ({s['switch']}): {s['why']}")
    return lines


def table(results: dict) -> str:
    rows = [list(COLUMNS)] + [_cells(r) for r in results["rows"]]
    widths = [max(len(r[i]) for r in rows if not r[1].startswith("error:")) for i in range(len(COLUMNS) - 1)]
    title = (f"numbarl component cost on {results['device']} ({results['timing']}), preset {results['preset']} "
             f"{results['compute']}: batch {results['batch']}, n_envs {results['n_envs']}, trunk {results['trunk']}, "
             f"{results['n_atoms']} atoms; median of {results['repeats']} x {results['reps']} replays")
    lines = [title]
    for r in rows:
        if r[1].startswith("error:"):
            lines.append(f"{r[0]:<{widths[0]}}  {r[1]}")
            continue
        lines.append("  ".join(c.rjust(w) if 0 < i < len(widths) else c.ljust(w) if i == 0 else c
                               for i, (c, w) in enumerate(zip(r, widths + [0]))))
    lines.append("switches: " + "; ".join(f"{r['component']}: {r['switch']}" for r in results["rows"][1:]
                                         if r["component"] != ALL_ON))
    return "\n".join(lines + _notes(results))


def markdown(results: dict) -> str:
    """The table for docs/BENCHMARKS.md."""
    head = list(COLUMNS)
    head.insert(1, "switch")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " if i in (0, 1, len(head) - 1) else " ---: "
                                                            for i in range(len(head))) + "|"]
    left_out = [x["component"] for x in results["all_on"]["left_out"]]
    every = "every switch above" + (f" but {', '.join(left_out)}" if left_out else "")
    for r in results["rows"]:
        cells = _cells(r)
        cells.insert(1, every if r["component"] == ALL_ON else f"`{r['switch']}`" if r["switch"] else "")
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines + [""] + [f"- {n}" for n in _notes(results)]) + "\n"


def main(argv=None, exit_after_profile: bool = False) -> int:
    """exit_after_profile (the command line's entry points): after a --profile run on a GPU, leave with os._exit
    once everything is written (the interpreter's teardown of the CUDA libraries after a CUPTI session can
    abort); a caller in the same process (a test) gets the code back instead."""
    backend.select()
    p = argparse.ArgumentParser(prog="numbarl-bench components", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="default", help="preset whose shapes and switches are the base (default: %(default)s)")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                   help="override of the base config, as numbarl-train's --set (repeatable)")
    p.add_argument("--batch", type=int, default=None, help="agent.batch_size of the base (default: the preset's)")
    p.add_argument("--n-envs", type=int, default=None, help="train.n_envs of the base (default: the preset's)")
    p.add_argument("--tf32", action="store_true", help="TF32 GEMMs (agent.compute=tf32; the default preset is fp32)")
    p.add_argument("--components", default=None, metavar="A,B", help="only these registry components (default: every c51 one)")
    p.add_argument("--reps", type=int, default=50, help="replays per timed repeat (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats, the median reported (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed replays before timing each graph (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the results as JSON to OUT")
    p.add_argument("--markdown", default=None, metavar="OUT", help="also write the table as markdown to OUT")
    p.add_argument("--profile", action="store_true",
                   help="also the GPU time per kernel of each configuration's train and collect steps (needs torch), "
                        "and per component the kernels that make its Δ")
    args = p.parse_args(argv)
    if args.reps < 1 or args.repeats < 1 or args.warmup < 0:
        p.error("--reps and --repeats must be >= 1, --warmup >= 0")
    from numbarl.config import ConfigError
    from numbarl.run.trainer import GPU_PRESETS

    if backend.simulator_active() and args.preset in GPU_PRESETS:
        print(f"error: numbarl-bench components --preset {args.preset} needs a CUDA GPU: no GPU was found (or "
              "--simulate was given), and the simulator neither times kernels nor gets through that preset's shapes "
              "in hours; run it on a GPU machine (docs/BENCHMARKS.md), or --preset tiny to check the bench. Nothing "
              "was written.", file=sys.stderr)
        return 2
    try:
        results = run(args)
    except ConfigError as e:  # a bad --preset, --set, --components or switch: nothing was measured
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(results))
    if args.profile:
        print(profile_text(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"wrote {args.json}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results) + ("\n\n" + profile_text(results) + "\n" if args.profile else ""))
        print(f"wrote {args.markdown}")
    code = 1 if any("error" in r for r in results["rows"]) else 0
    if exit_after_profile and args.profile and not backend.simulator_active():
        from numbarl.bench.train import exit_after_cupti

        exit_after_cupti(code)
    return code


if __name__ == "__main__":
    sys.exit(main(exit_after_profile=True))
