"""GEMM algorithm benchmark: every cuBLASLt GEMM of the C51 collect and train steps, each of the
heuristic's first candidates timed on the GPU, and an optional tuning file.

cuBLASLt's heuristic ranks algorithms by a model, not by timing, and numbarl's plans take its first
(numbarl/cuda/blas.py). This benchmark builds the C51 agent at the train bench's shapes, runs one
collect and one train step eagerly (which plans every GEMM and counts how often each plan runs per
step), then for each plan times the heuristic's first ``--candidates`` algorithms on buffers of the
plan's geometry (CUDA events, median of repeats). It prints, per plan, the first candidate's time,
the fastest candidate's and the predicted saving per step (calls per step × the difference), and
with ``--write-tuning FILE`` writes the fastest candidate of every plan whose gain clears
``--min-gain`` (noise), for ``NUMBARL_GEMM_TUNING=FILE`` (a later process's plans take them; the
same file gives the same algorithms, so the same bits, run after run).

``--split-tf32`` (issue 17: the fp32 train step is bound by the same SIMT sgemm JAX runs) also measures, for
every fp32 plan, a split ("3xTF32") product on its geometry: both operands split by
``numbarl.cuda.kernels.elementwise.split_tf32`` into hi (TF32) + lo, then three TF32 tensor-core GEMMs
accumulated into C, lo_a·hi_b + hi_a·lo_b first and hi_a·hi_b last (the dropped lo·lo term is ~2⁻²² of the
product). Per plan: the three GEMMs' time (one captured graph, CUDA events), each operand's split, and the
norm-relative error against a float64 product of the same operands (max |C − ref| / max |ref|) of the fp32 GEMM,
one TF32 GEMM and the split product. The totals say what the train step's GEMMs would cost with the split,
before an integration (weights split once per step, activations and gradients at their producers) decides it.

``--ld-pad 8`` times every plan's product twice more, without its epilogue: on buffers with the plan's own
leading dimensions and on buffers whose leading dimensions are rounded up to a multiple of 8 floats (32 bytes;
the logical shapes unchanged). The C51 head's advantage GEMMs are 714 = 14 actions × 51 atoms wide, so their
rows are 8-byte aligned only; the TF32 tensor-core kernels ran them at ~2.2× the time per FLOP of the 512-wide
trunk GEMMs (docs/bench/bench-gemm.json, fifth session), the fp32 SIMT kernels at ~1.08×. The difference per
plan says what padded head buffers would save before the layout is changed. (Measured in the nineteenth session:
next to nothing, 9 µs of the TF32 train step, fp32 −15 µs, noise; the rows' alignment is not the cause.)

``--pad-dims Q`` times every plan's product, without its epilogue, on its own M, N, K and on each rounded up to a
multiple of Q (the rows / columns a padded layout would add, zeros there: 714 → 720 at Q = 8, 768 at Q = 64;
51 → 56 or 64). A padded product that runs in less time than the plan's own is a saving outright. A padded width
is shared by the plans that use it (714 is the forward's N, the input gradient's K, the weight gradient's N), so
the totals are given both with every plan padded and with only the plans it speeds up (a lower and an upper
bound for a layout that pads some widths). It asks whether the 714-wide (and the 51-wide) GEMMs' TF32 cost comes
from their odd logical widths: the kernels the heuristic picks for them, not the memory layout.

    python -m numbarl.bench.gemm [--candidates 16] [--compute fp32,tf32] [--split-tf32] [--ld-pad 8]
                                 [--pad-dims 64] [--write-tuning F] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

from numbarl.cuda import backend


def _count_calls(blas, fn, s) -> dict:
    """{plan key: calls} while fn(s) runs (eagerly)."""
    counts: dict = {}
    original = blas.Plan.run

    def counting(self, *a, **kw):
        counts[self.key] = counts.get(self.key, 0) + 1
        return original(self, *a, **kw)

    blas.Plan.run = counting
    try:
        fn(s)
        s.synchronize()
    finally:
        blas.Plan.run = original
    return counts


def _buffers(plan, rng):
    """Device buffers of the plan's geometry: A, B, C, alpha, bias, aux, bias_grad (random data)."""
    from numbarl.cuda.runtime import cuda

    c = cuda()
    (M, N, K, lda, ldb, ldc, ldaux, trans_a, trans_b, epilogue, has_bias, _compute, device_alpha, *_rest) = plan.key

    def mat(rows, ld):
        return c.to_device((rng.standard_normal((rows, ld)) * 0.05).astype(np.float32))

    A = mat(K if trans_a else M, lda)
    B = mat(N if trans_b else K, ldb)
    C = mat(M, ldc)
    alpha = c.to_device(np.ones(1, np.float32)) if device_alpha else 1.0
    bias = c.to_device(np.zeros(N, np.float32)) if has_bias else None
    aux = mat(M, ldaux) if epilogue == "gelu_aux" else None
    bias_grad = c.to_device(np.zeros(max(M, N), np.float32)) if epilogue in ("bgrad_a", "bgrad_b") else None
    return A, B, C, alpha, bias, aux, bias_grad


def _time_plan(plan, bufs, s, iters: int, repeats: int) -> float:
    """Median µs per call of the plan's current algorithm."""
    from numbarl.cuda.runtime import cuda, stream_handle

    c = cuda()
    A, B, C, alpha, bias, aux, bias_grad = bufs
    beta = plan.key[13] if plan.key[12] else 0.0
    sh = stream_handle(s)
    for _ in range(3):
        plan.run(A, B, C, alpha, beta, bias, aux, bias_grad, s, sh)
    s.synchronize()
    times = []
    for _ in range(repeats):
        start, end = c.event(timing=True), c.event(timing=True)
        start.record(s)
        for _ in range(iters):
            plan.run(A, B, C, alpha, beta, bias, aux, bias_grad, s, sh)
        end.record(s)
        end.synchronize()
        times.append(c.event_elapsed_time(start, end) * 1e3 / iters)
    return statistics.median(times)


def _time_captured(fn, s, iters: int, repeats: int) -> float:
    """Median µs per replay of fn(s) captured as one CUDA graph (fn runs once eagerly first; the replays are
    timed as numbarl.bench.train times its steps)."""
    from numbarl.bench.train import _time_graph
    from numbarl.cuda.graph import capture

    graph = capture(fn, s)
    return 1e3 * _time_graph(graph, s, iters, repeats)


def split_tf32_gemm(A, B, C, trans_a, trans_b, parts, s) -> None:
    """C = op(A)·op(B) as three TF32 GEMMs of split operands (module docstring); parts = (hi_a, lo_a, hi_b, lo_b)
    views of A's and B's shapes already holding split_tf32 of them."""
    from numbarl.cuda import blas

    hi_a, lo_a, hi_b, lo_b = parts
    blas.gemm(lo_a, hi_b, C, trans_a, trans_b, beta=0.0, compute="tf32", stream=s)
    blas.gemm(hi_a, lo_b, C, trans_a, trans_b, beta=1.0, compute="tf32", stream=s)
    blas.gemm(hi_a, hi_b, C, trans_a, trans_b, beta=1.0, compute="tf32", stream=s)


def _split_row(plan, bufs, s, args) -> dict:
    """The split product on one fp32 plan's geometry: times (µs) and norm-relative errors (module docstring)."""
    from numbarl.cuda import blas
    from numbarl.cuda.kernels.elementwise import split_tf32
    from numbarl.cuda.runtime import cuda

    c = cuda()
    (M, N, K, *_ld, trans_a, trans_b) = plan.key[:9]
    A, B, C = bufs[:3]
    a = A[:, :(M if trans_a else K)]
    b = B[:, :(K if trans_b else N)]
    out = C[:, :N]
    halves = [c.device_array(A.shape, np.float32) for _ in range(2)] + [c.device_array(B.shape, np.float32)
                                                                        for _ in range(2)]
    parts = tuple(h[:, :v.shape[1]] for h, v in zip(halves, (a, a, b, b)))
    split_a = _time_captured(lambda st: split_tf32(A, halves[0], halves[1], st), s, args.iters, args.repeats)
    split_b = _time_captured(lambda st: split_tf32(B, halves[2], halves[3], st), s, args.iters, args.repeats)
    gemms = _time_captured(lambda st: split_tf32_gemm(a, b, out, trans_a, trans_b, parts, st), s, args.iters,
                        args.repeats)
    ha, hb = a.copy_to_host().astype(np.float64), b.copy_to_host().astype(np.float64)
    ref = (ha.T if trans_a else ha) @ (hb.T if trans_b else hb)
    scale = float(np.abs(ref).max()) or 1.0
    errors = {}
    for name, compute in (("fp32", "fp32"), ("tf32", "tf32"), ("split_tf32", None)):
        if compute is None:
            split_tf32_gemm(a, b, out, trans_a, trans_b, parts, s)
        else:
            blas.gemm(a, b, out, trans_a, trans_b, compute=compute, stream=s)
        s.synchronize()
        errors[name] = float(np.abs(out.copy_to_host() - ref).max()) / scale
    return {"gemms_us": gemms, "split_a_us": split_a, "split_b_us": split_b, "error": errors}


def _product_us(M, N, K, lds, trans_a, trans_b, compute, s, args, rng) -> float:
    """µs per call of C[M, N] = op(A)·op(B) without an epilogue, on random buffers with leading dimensions lds
    (lda, ldb, ldc), one captured graph."""
    from numbarl.cuda import blas
    from numbarl.cuda.runtime import cuda

    c = cuda()
    shapes = ((K if trans_a else M, M if trans_a else K), (N if trans_b else K, K if trans_b else N), (M, N))
    a, b, out_c = [c.to_device((rng.standard_normal((rows, ld)) * 0.05).astype(np.float32))[:, :cols]
                   for (rows, cols), ld in zip(shapes, lds)]
    return _time_captured(lambda st: blas.gemm(a, b, out_c, trans_a, trans_b, compute=compute, stream=st), s,
                          args.iters, args.repeats)


def _round_up(x, q: int) -> int:
    return -(-int(x) // q) * q


def _ld_row(plan, compute: str, s, args, rng) -> dict:
    """The plan's product without its epilogue on its own leading dimensions and on ones rounded up to a
    multiple of args.ld_pad floats (module docstring): µs of each, one captured graph each."""
    (M, N, K, lda, ldb, ldc, _ldaux, trans_a, trans_b) = plan.key[:9]
    out = {"ld": [int(lda), int(ldb), int(ldc)]}
    out["ld_padded"] = [_round_up(ld, args.ld_pad) for ld in out["ld"]]
    for key, lds in (("us_ld", out["ld"]), ("us_padded", out["ld_padded"])):
        out[key] = _product_us(M, N, K, lds, trans_a, trans_b, compute, s, args, rng)
    return out


def _dims_row(plan, compute: str, s, args, rng) -> dict:
    """The plan's product without its epilogue on its own shape and on M, N, K rounded up to a multiple of
    args.pad_dims (module docstring): the rows / columns a padded layout would add (random here: the timing does
    not depend on them). Leading dimensions are the (padded) row widths."""
    (M, N, K, *_lds, trans_a, trans_b) = plan.key[:9]
    dims = [int(M), int(N), int(K)]
    padded = [_round_up(d, args.pad_dims) for d in dims]
    out = {"dims": dims, "dims_padded": padded}
    for key, (m, n, k) in (("us_dims", dims), ("us_padded", padded)):
        lds = ((m if trans_a else k), (k if trans_b else n), n)
        out[key] = _product_us(m, n, k, lds, trans_a, trans_b, compute, s, args, rng)
    return out


def pad_dims_saving(rows, step: str, only_faster: bool = False) -> float:
    """µs per step saved by padding the plans' shapes: Σ calls · (own − padded) over every plan, or with
    only_faster over the plans whose padded product is faster (max(0, own − padded))."""
    def gain(x):
        d = x["us_dims"] - x["us_padded"]
        return max(0.0, d) if only_faster else d

    return sum(r["calls"][step] * gain(r["pad_dims"]) for r in rows)


def _agent_steps(compute: str, args):
    from numbarl.bench.train import _market
    from numbarl.config import AgentConfig
    from numbarl.env.device import DeviceEnv
    from numbarl.env.params import EnvParams
    from numbarl.rl.agents.base import make_agent

    params = EnvParams()
    market = _market(args.bars, args.features, args.seed).to_device(params.vol_span, params.vol_horizon_bars)
    trunk = tuple(int(w) for w in args.trunk.split(","))
    cfg = AgentConfig(trunk=trunk, batch_size=args.batch, replay_capacity=args.n_envs * 64, compute=compute)
    env = DeviceEnv(market, params, args.n_envs, seed=args.seed)
    agent = make_agent(cfg, env.state_dim, params.branch_sizes, args.n_envs, args.seed, epsilon=(1.0, 0.05, 100))
    return agent, env


def run(args) -> dict:
    from numbarl.cuda import blas
    from numbarl.cuda.runtime import device_name, stream

    s = stream()
    rng = np.random.default_rng(args.seed)
    results = {"device": device_name(), "identity": blas.tuning_identity(), "candidates": args.candidates,
               "tuning_loaded": blas.tuning_info(), "computes": {}}
    tuning = {}
    for compute in args.compute.split(","):
        agent, env = _agent_steps(compute, args)
        env.reset(args.seed, s)
        steps = agent.step_functions(env)
        for _ in range(8):  # fill the replay past its n-step window
            steps["collect"](s)
        per_step = {"collect": _count_calls(blas, steps["collect"], s), "train": _count_calls(blas, steps["train"], s)}
        rows = []
        for key in sorted(set(per_step["collect"]) | set(per_step["train"]), key=blas.plan_key_text):
            plan = blas._PLANS[key]
            kept, kept_index = plan.heuristic.copy(), plan.algo_index
            found = plan.candidates(args.candidates)
            bufs = _buffers(plan, rng)
            times = []
            for i in range(len(found)):
                plan.use_candidate(found, i)
                try:
                    times.append(_time_plan(plan, bufs, s, args.iters, args.repeats))
                except blas.GemmPlanError as e:  # a candidate that fails to run is skipped
                    times.append(float("inf"))
                    print(f"  candidate {i} of {plan.describe()}: {e}", file=sys.stderr)
            plan.use_candidate(kept, 0)
            plan.algo_index = kept_index
            best = int(np.argmin(times))
            gain = (times[0] - times[best]) / times[0] if np.isfinite(times[0]) else 0.0
            chosen = best if gain >= args.min_gain else 0
            calls = {k: per_step[k].get(key, 0) for k in per_step}
            rows.append({"plan": plan.describe(), "key": blas.plan_key_text(key), "calls": calls,
                         "candidates": len(found), "us": times, "first_us": times[0], "best_us": times[best],
                         "best_index": best, "chosen_index": chosen, "gain": gain,
                         "saving_us": {k: calls[k] * (times[0] - times[chosen]) for k in calls}})
            if args.split_tf32 and compute == "fp32":
                rows[-1]["split_tf32"] = _split_row(plan, bufs, s, args)
            if args.ld_pad:
                rows[-1]["ld_pad"] = _ld_row(plan, compute, s, args, rng)
            if args.pad_dims:
                rows[-1]["pad_dims"] = _dims_row(plan, compute, s, args, rng)
            if chosen:
                tuning[blas.plan_key_text(key)] = {"index": chosen, "algo": blas.algo_text(found[chosen]),
                                                   "first_us": times[0], "us": times[chosen], "plan": plan.describe()}
        results["computes"][compute] = {
            "plans": rows,
            "train_gemm_us": {"first": sum(r["calls"]["train"] * r["first_us"] for r in rows),
                              "tuned": sum(r["calls"]["train"] * r["us"][r["chosen_index"]] for r in rows)},
            "collect_gemm_us": {"first": sum(r["calls"]["collect"] * r["first_us"] for r in rows),
                                "tuned": sum(r["calls"]["collect"] * r["us"][r["chosen_index"]] for r in rows)}}
        if args.ld_pad:
            for step in ("train", "collect"):
                results["computes"][compute][f"{step}_ld_pad_saving_us"] = sum(
                    r["calls"][step] * (r["ld_pad"]["us_ld"] - r["ld_pad"]["us_padded"]) for r in rows)
        if args.pad_dims:
            for step in ("train", "collect"):
                results["computes"][compute][f"{step}_pad_dims_saving_us"] = pad_dims_saving(rows, step)
                results["computes"][compute][f"{step}_pad_dims_faster_saving_us"] = pad_dims_saving(rows, step, True)
        if args.split_tf32 and compute == "fp32":
            for step in ("train", "collect"):
                results["computes"][compute][f"{step}_split_tf32_us"] = {
                    "gemms": sum(r["calls"][step] * r["split_tf32"]["gemms_us"] for r in rows),
                    # an upper bound: both operands split at every call (an integration splits weights once per
                    # step and activations / gradients at their producers)
                    "splits": sum(r["calls"][step] * (r["split_tf32"]["split_a_us"] + r["split_tf32"]["split_b_us"])
                                  for r in rows)}
        del agent, env
    results["tuning"] = {"identity": results["identity"], "plans": tuning}
    return results


# the padded timings' table blocks: (row and totals key, heading, own µs key, label, own and padded keys, note)
_PADDINGS = (
    ("ld_pad", "leading dimensions padded (no epilogue): µs on the plan's lds -> on padded lds", "us_ld", "lds",
     "ld", "ld_padded", lambda r: ""),
    ("pad_dims", ("shapes padded (no epilogue, the rows / columns a padded layout adds): µs on the plan's M, N, K "
                  "-> on padded ones"), "us_dims", "M, N, K", "dims", "dims_padded",
     lambda r: (f" with every plan padded; {r['train_pad_dims_faster_saving_us']:.1f} / "
                f"{r['collect_pad_dims_faster_saving_us']:.1f} µs padding only the plans it speeds up")),
)


def table(results: dict) -> str:
    lines = [(f"GEMM candidates on {results['device']} (cuBLASLt {results['identity']['cublaslt_version']}), "
              f"up to {results['candidates']} per plan")]
    for compute, r in results["computes"].items():
        lines.append(f"\n{compute}: train step GEMMs {r['train_gemm_us']['first']:.1f} -> {r['train_gemm_us']['tuned']:.1f} µs, "
                     f"collect step GEMMs {r['collect_gemm_us']['first']:.1f} -> {r['collect_gemm_us']['tuned']:.1f} µs")
        lines.append(f"  {'calls t/c':>9}  {'n':>3}  {'first µs':>9}  {'best µs':>9}  {'idx':>3}  {'gain':>6}  plan")
        for row in r["plans"]:
            c = row["calls"]
            lines.append(f"  {c['train']:>4}/{c['collect']:<4}  {row['candidates']:>3}  {row['first_us']:9.1f}  "
                         f"{row['best_us']:9.1f}  {row['best_index']:>3}  {row['gain']:6.1%}  {row['plan']}")
        for key, heading, own_us, label, own, padded, note in _PADDINGS:
            if f"train_{key}_saving_us" not in r:
                continue
            lines.append(f"\n  {heading}")
            for row in r["plans"]:
                x = row[key]
                lines.append(f"  {x[own_us]:9.1f} -> {x['us_padded']:9.1f}  {label} {x[own]} -> {x[padded]}  "
                             f"{row['plan']}")
            lines.append(f"  saving per train step {r[f'train_{key}_saving_us']:.1f} µs, per collect step "
                         f"{r[f'collect_{key}_saving_us']:.1f} µs{note(r)}")
        if "train_split_tf32_us" in r:
            lines.append("\n  split TF32 (3 GEMMs) per fp32 plan: µs of the GEMMs, of each operand's split, and the "
                         "norm-relative error vs float64 of fp32 / one TF32 GEMM / the split product")
            for row in r["plans"]:
                x = row["split_tf32"]
                e = x["error"]
                lines.append(f"  {row['first_us']:9.1f} -> {x['gemms_us']:9.1f}  (+ {x['split_a_us']:.1f}, "
                             f"{x['split_b_us']:.1f})  err {e['fp32']:.1e} / {e['tf32']:.1e} / {e['split_tf32']:.1e}  "
                             f"{row['plan']}")
            for step in ("train", "collect"):
                t = r[f"{step}_split_tf32_us"]
                lines.append(f"  {step} step GEMMs: fp32 {r[f'{step}_gemm_us']['first']:.1f} µs, split TF32 "
                             f"{t['gemms']:.1f} µs + splits at most {t['splits']:.1f} µs")
    return "\n".join(lines)


def main(argv=None) -> int:
    backend.select()
    p = argparse.ArgumentParser(prog="numbarl-bench gemm", description=__doc__.split("\n")[0])
    p.add_argument("--candidates", type=int, default=16, help="heuristic candidates timed per plan (default: %(default)s)")
    p.add_argument("--compute", default="fp32,tf32", help="fp32 and/or tf32 (default: %(default)s)")
    p.add_argument("--iters", type=int, default=20, help="calls per timing (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timings per candidate, median (default: %(default)s)")
    p.add_argument("--min-gain", type=float, default=0.03,
                   help="a candidate replaces the first only when this much faster (default: %(default)s)")
    p.add_argument("--split-tf32", action="store_true",
                   help="also time and check a split (3xTF32) product on every fp32 plan (module docstring)")
    p.add_argument("--ld-pad", type=int, default=0, metavar="FLOATS",
                   help="also time every plan on leading dimensions rounded up to this multiple (0 = off; e.g. 8)")
    p.add_argument("--pad-dims", type=int, default=0, metavar="Q",
                   help="also time every plan with M, N, K rounded up to this multiple (0 = off; e.g. 8, 64)")
    p.add_argument("--write-tuning", default=None, metavar="PATH", help="write the tuning file (NUMBARL_GEMM_TUNING)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--batch", type=int, default=16384, help="transitions per train step (default: %(default)s)")
    p.add_argument("--n-envs", type=int, default=16384, help="parallel envs of the collect step (default: %(default)s)")
    p.add_argument("--trunk", default="512,512", help="hidden widths of the trunk MLP (default: %(default)s)")
    p.add_argument("--features", type=int, default=64, help="features per bar (default: %(default)s)")
    p.add_argument("--bars", type=int, default=200_000, help="bars of the synthetic market (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed (default: %(default)s)")
    args = p.parse_args(argv)
    if args.candidates < 1 or args.iters < 1 or args.repeats < 1:
        print("error: --candidates, --iters and --repeats must be >= 1. Nothing was written.", file=sys.stderr)
        return 2
    if args.ld_pad < 0 or args.ld_pad == 1:
        print(f"error: --ld-pad {args.ld_pad}: give a multiple in floats >= 2 (e.g. 8), or 0 for off. Nothing was "
              "written.", file=sys.stderr)
        return 2
    if args.pad_dims < 0 or args.pad_dims == 1:
        print(f"error: --pad-dims {args.pad_dims}: give a multiple >= 2 (e.g. 8 or 64), or 0 for off. Nothing was "
              "written.", file=sys.stderr)
        return 2
    if set(args.compute.split(",")) - {"fp32", "tf32"}:
        print(f"error: --compute {args.compute!r}: choose fp32 and/or tf32. Nothing was written.", file=sys.stderr)
        return 2
    if backend.simulator_active():
        print("error: numbarl-bench gemm needs a CUDA GPU with cuBLASLt: no GPU was found (or --simulate was "
              "given). Nothing was written.", file=sys.stderr)
        return 2
    results = run(args)
    print(table(results))
    if args.write_tuning:
        with open(args.write_tuning, "w") as f:
            json.dump(results["tuning"], f, indent=2)
        print(f"tuning: {len(results['tuning']['plans'])} plans -> {args.write_tuning}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
