"""Kernel benchmark: reductions and kernel families against a device-to-device copy.

    python -m numbarl.bench.kernels                # checks, then timings (GPU), one table
    python -m numbarl.bench.kernels --check        # checks only (CPU simulator or GPU)
    python -m numbarl.bench.kernels --json out.json

Checks before it times (llm.c style): every benchmarked op is first compared with its float64
numpy reference on the benchmark's own inputs (the simulator uses tiny shapes). Then, on a GPU,
each op is timed as a CUDA graph of ``--iters`` back-to-back calls (no Python launch overhead in
the numbers: that is how training runs them), with CUDA events around each replay, a warm-up
replay first and the median over ``--reps``. The copy baseline is ``copy_to_device`` between two
device buffers of the same bytes, timed the same way.

Columns: microseconds per call; GB/s = bytes the op must move (reads + writes, each element
once) / time; "of copy" = that bandwidth over the copy's (read + write) bandwidth. Rows whose
data fits in the 50 MB L2 of an H200 can beat the copy of a larger buffer: the table keeps the
sizes training uses (batch 16,384 x 512) next to 256 MB streams that must come from HBM.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np

from numbarl.cuda import backend, graph
from numbarl.cuda import reduce as red
from numbarl.cuda.kernels import elementwise as ew
from numbarl.cuda.kernels import layernorm as ln
from numbarl.cuda.kernels import softmax as sm
from numbarl.cuda.runtime import cuda, device_name, simulator, stream

backend.select()  # before anything imports numba: the simulator when there is no GPU

_cuda = cuda()

STREAM_FLOATS = 64 << 20  # 256 MB: far beyond L2, measures HBM bandwidth
FLAT_GRAD_FLOATS = 1_000_003  # ~ the optimizer's flat gradient buffer
BATCH, WIDTH = 16384, 512
C51_ROWS, ATOMS = 16384 * 4, 51


def _sizes(sim: bool) -> dict:
    if sim:  # simulator: tiny shapes, checks only
        return dict(stream=3001, flat=1500, batch=37, width=45, c51_rows=19, atoms=51)
    return dict(stream=STREAM_FLOATS, flat=FLAT_GRAD_FLOATS, batch=BATCH, width=WIDTH, c51_rows=C51_ROWS, atoms=ATOMS)


class Case:
    """One benchmarked op: run(stream) enqueues one call; check() -> (ok, detail); bytes moved."""

    def __init__(self, name, shape, nbytes, run, check):
        self.name, self.shape, self.nbytes, self.run, self.check = name, shape, nbytes, run, check


def _host(d, s):
    out = d.copy_to_host(stream=s)
    s.synchronize()
    return out


def _rel_err(got, ref) -> float:
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / max(1e-30, float(np.max(np.abs(ref)))))


def build_cases(gen, sizes) -> list:
    s = stream()
    cases = []
    n_stream, n_flat = sizes["stream"], sizes["flat"]
    R, C = sizes["batch"], sizes["width"]

    # copy baseline and flat reductions over a large stream
    x = gen.standard_normal(n_stream, dtype=np.float32)
    d = _cuda.to_device(x, stream=s)
    dst = _cuda.device_array(n_stream, np.float32)
    out = _cuda.device_array(8, np.float32)
    big = red.Reducer(n_stream)
    cases.append(Case("copy (device to device)", f"[{n_stream}]", 8 * n_stream,
                      lambda st: dst.copy_to_device(d, stream=st),
                      lambda: (bool(np.array_equal(_host(dst, s), x)), "bitwise")))
    for at, op in enumerate(("sum", "l2norm", "max")):
        def check(op=op, at=at):
            got = float(_host(out, s)[at])
            ref = red.FLAT_REFS[op](x)
            scale = abs(ref) if op == "max" else max(1.0, float(np.abs(x).sum()))
            return abs(got - ref) <= 1e-6 * scale, f"{got:.7g} vs {ref:.7g}"
        cases.append(Case(f"Reducer.{op}", f"[{n_stream}]", 4 * n_stream,
                          lambda st, op=op, at=at: getattr(big, op)(d, out, st, at=at), check))

    # the optimizer's global norm: one ~1M-float vector (latency, not bandwidth)
    g = gen.standard_normal(n_flat, dtype=np.float32)
    dg = _cuda.to_device(g, stream=s)
    small = red.Reducer(n_flat)
    norm_out = _cuda.device_array(1, np.float32)
    cases.append(Case("Reducer.l2norm (flat grads)", f"[{n_flat}]", 4 * n_flat,
                      lambda st: small.l2norm(dg, norm_out, st),
                      lambda: (abs(float(_host(norm_out, s)[0]) - red.l2norm_ref(g)) <= 1e-6 * red.l2norm_ref(g),
                               f"{float(_host(norm_out, s)[0]):.7g} vs {red.l2norm_ref(g):.7g}")))

    # batch x width: bias gradient, row sums, activations, LayerNorm
    xb = gen.standard_normal((R, C), dtype=np.float32)
    dxb = _cuda.to_device(xb, stream=s)
    col_out = _cuda.device_array(C, np.float32)
    cols = red.ColSum(R, C)
    cases.append(Case("col_sum (bias grad)", f"[{R}, {C}]", 4 * R * C,
                      lambda st: cols.run(dxb, col_out, st),
                      lambda: (_rel_err(_host(col_out, s), red.col_sum_ref(xb)) < 1e-5, "rel err vs numpy")))
    row_out = _cuda.device_array(R, np.float32)
    cases.append(Case("row_sum", f"[{R}, {C}]", 4 * R * C,
                      lambda st: red.row_sum(dxb, row_out, st),
                      lambda: (_rel_err(_host(row_out, s), red.row_sum_ref(xb)) < 1e-5, "rel err vs numpy")))
    yb = _cuda.device_array((R, C), np.float32)
    cases.append(Case("silu forward", f"[{R}, {C}]", 8 * R * C,
                      lambda st: ew.silu(dxb, yb, st),
                      lambda: (_rel_err(_host(yb, s), ew.activation_ref(xb, "silu")) < 1e-5, "rel err vs numpy")))
    bias = gen.standard_normal(C, dtype=np.float32)
    dbias = _cuda.to_device(bias, stream=s)
    pre = _cuda.device_array((R, C), np.float32)
    cases.append(Case("bias + relu (saves pre)", f"[{R}, {C}]", 12 * R * C,
                      lambda st: ew.bias_act(dxb, dbias, yb, "relu", st, pre=pre),
                      lambda: (_rel_err(_host(yb, s), np.maximum(xb + np.float64(bias), 0)) < 1e-6, "rel err vs numpy")))
    gamma = gen.uniform(0.5, 1.5, C).astype(np.float32)
    beta = gen.standard_normal(C, dtype=np.float32)
    dgam, dbet = _cuda.to_device(gamma, stream=s), _cuda.to_device(beta, stream=s)
    mean = _cuda.device_array(R, np.float32)
    rstd = _cuda.device_array(R, np.float32)
    plan = ln.LayerNormPlan(R, C)
    y_ref, mean_ref, rstd_ref = ln.layernorm_forward_ref(xb, gamma, beta, plan.eps)
    cases.append(Case("layernorm forward", f"[{R}, {C}]", 8 * R * C,
                      lambda st: plan.forward(dxb, dgam, dbet, yb, mean, rstd, st),
                      lambda: (_rel_err(_host(yb, s), y_ref) < 1e-5, "rel err vs numpy")))
    dy = gen.standard_normal((R, C), dtype=np.float32)
    ddy = _cuda.to_device(dy, stream=s)
    dx = _cuda.device_array((R, C), np.float32)
    dgamma = _cuda.device_array(C, np.float32)
    dbeta = _cuda.device_array(C, np.float32)
    dx_ref, dgamma_ref, _ = ln.layernorm_backward_ref(dy, xb, gamma, mean_ref, rstd_ref)
    cases.append(Case("layernorm backward", f"[{R}, {C}]", 12 * R * C,
                      lambda st: plan.backward(ddy, dxb, dgam, mean, rstd, dx, dgamma, dbeta, st),
                      lambda: (max(_rel_err(_host(dx, s), dx_ref), _rel_err(_host(dgamma, s), dgamma_ref)) < 1e-4,
                               "rel err vs numpy")))

    # C51 rows: softmax over 51 atoms
    rows, atoms = sizes["c51_rows"], sizes["atoms"]
    q = (gen.standard_normal((rows, atoms), dtype=np.float32) * 3).astype(np.float32)
    dq = _cuda.to_device(q, stream=s)
    probs = _cuda.device_array((rows, atoms), np.float32)
    cases.append(Case("softmax (C51 atoms)", f"[{rows}, {atoms}]", 8 * rows * atoms,
                      lambda st: sm.softmax(dq, probs, st),
                      lambda: (_rel_err(_host(probs, s), sm.softmax_ref(q)) < 1e-5, "rel err vs numpy")))
    s.synchronize()
    return cases


def run_checks(cases) -> tuple[bool, list]:
    s = stream()
    results = []
    ok_all = True
    for case in cases:
        case.run(s)
        s.synchronize()
        ok, detail = case.check()
        ok_all &= bool(ok)
        results.append({"op": case.name, "ok": bool(ok), "detail": detail})
        print(f"  {'ok  ' if ok else 'FAIL'} {case.name:<30} {detail}", flush=True)
    return ok_all, results


def time_case(case, iters: int, reps: int) -> float:
    """Median microseconds per call of case.run, from graph replays of `iters` calls."""
    s = stream()
    g = graph.capture(lambda st: [case.run(st) for _ in range(iters)], stream=s)
    start, end = _cuda.event(), _cuda.event()
    g.replay()  # warm-up replay
    times = []
    for _ in range(reps):
        start.record(s)
        g.replay()
        end.record(s)
        end.synchronize()
        times.append(_cuda.event_elapsed_time(start, end) * 1e3 / iters)
    g.close()
    return float(np.median(times))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="numbarl-bench kernels", description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="run the checks only")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--reps", type=int, default=20, help="timed graph replays per op (median)")
    p.add_argument("--iters", type=int, default=20, help="calls per captured graph")
    p.add_argument("--seed", type=int, default=None, help="seed of the inputs (default: fresh)")
    args = p.parse_args(argv)

    sim = simulator()
    gen = np.random.default_rng(args.seed)
    print(f"kernel checks on {device_name()}", flush=True)
    t0 = time.perf_counter()
    cases = build_cases(gen, _sizes(sim))
    ok, checks = run_checks(cases)
    report = {
        "device": device_name(),
        "python": platform.python_version(),
        "command": "python -m numbarl.bench.kernels " + " ".join(sys.argv[1:] if argv is None else argv),
        "checks": checks,
        "checks_passed": ok,
    }
    print(f"checks: {'PASS' if ok else 'FAIL'} in {time.perf_counter() - t0:.1f} s", flush=True)
    if not args.check:
        if sim:
            print("timings need a GPU (running on the simulator): only the checks ran")
            report["note"] = "simulator: no timings"
        elif not ok:
            print("checks failed: not timing")
        else:
            rows = []
            for case in cases:
                us = time_case(case, args.iters, args.reps)
                rows.append({"op": case.name, "shape": case.shape, "us": us, "GBps": case.nbytes / us / 1e3})
            copy_gbps = rows[0]["GBps"]
            print(f"\nnumbarl kernel benchmark on {report['device']} (graphs of {args.iters} calls, "
                  f"median of {args.reps})\n")
            print(f"{'op':<30} {'shape':<16} {'us/call':>10} {'GB/s':>8} {'of copy':>8}")
            for row in rows:
                row["of_copy"] = row["GBps"] / copy_gbps
                print(f"{row['op']:<30} {row['shape']:<16} {row['us']:>10.2f} {row['GBps']:>8.0f} {row['of_copy']:>8.0%}")
            report["timings"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
