"""Runtime self-check and benchmark: graphs, cuBLASLt GEMMs, reductions (issue 6, item 8).

    python -m numbarl.bench.runtime            # checks, then timings (GPU), one table
    python -m numbarl.bench.runtime --check    # checks only: pass/fail in seconds (CPU simulator or GPU)
    python -m numbarl.bench.runtime --json out.json

Checks before it times (llm.c style): GEMM vs a float64 numpy reference for the four transpose
combinations and every epilogue, graph replay == eager, mapped readback, and a reduction when
``numbarl.cuda.reduce`` is present. Then, on a GPU only:

* launch overhead: host time of one eager numba launch vs GPU time per node of a graph of
  ``--nodes`` tiny kernels (both checked: the counter must equal the number of launches);
* GEMM TFLOP/s through ``blas.gemm`` vs ``torch.matmul`` (same GPU, same run, fp32 and TF32) on
  the trunk shapes X[M, K]·W[K, N] and their backward products dX = dY·Wᵀ and dW = Xᵀ·dY. Both
  sides are timed as CUDA graphs of ``--gemm-iters`` calls (the way training runs them: no
  Python overhead in the numbers) over rotating buffer sets larger than L2;
* reduction bandwidth (``Reducer.sum``) vs a device-to-device copy of the same bytes.

Timing: CUDA events around each replay, warm-up replays first, median over ``--reps``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time

import numpy as np

from numbarl.cuda import backend, blas, graph, rng
from numbarl.cuda.mapped import MappedBuffer
from numbarl.cuda.runtime import cuda, device_name, simulator, stream

backend.select()  # before anything imports numba: the simulator when there is no GPU

_cuda = cuda()

BLOCK = 32
_ONE = np.float32(1.0)
_DECAY = np.float32(0.5)
GEMM_SHAPES = ((16384, 64, 512), (16384, 512, 512), (16384, 512, 768))  # (M, K, N) of X[M,K]·W[K,N]
ROTATE_BYTES = 256 << 20  # rotate GEMM inputs over at least this many bytes (H200 L2 is 50 MB)
REDUCE_FLOATS = 64 << 20  # 256 MB reduced / copied


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def tick_kernel(x):
    """x[i] += 1: the smallest kernel worth launching (launch-overhead probe)."""
    i = _cuda.grid(1)
    if i >= x.shape[0]:
        return
    x[i] += _ONE


@_cuda.jit(cache=True)
def mix_kernel(h, seed, counter, out):
    """out[r, c] = 0.5 * h[r, c] + uniform(seed, r * C + c, counter[0]): kernel + RNG in one step."""
    i = _cuda.grid(1)
    n_cols = h.shape[1]
    if i >= h.shape[0] * n_cols:
        return
    r = i // n_cols
    c = i - r * n_cols
    out[r, c] = _DECAY * h[r, c] + rng.uniform(seed, i, counter[0], 0)


# ---------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------
class Checks:
    def __init__(self):
        self.results = []

    def record(self, name, ok, detail=""):
        self.results.append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}" + (f"  ({detail})" if detail else ""), flush=True)
        return ok

    def run(self, name, fn):
        try:
            ok, detail = fn()
        except Exception as exc:  # noqa: BLE001 - a failing check reports and the run goes on
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        return self.record(name, ok, detail)

    @property
    def passed(self):
        return all(r["ok"] for r in self.results)


def _rel_err(got, ref):
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / max(1e-30, np.max(np.abs(ref))))


def _check_gemm(gen, trans_a, trans_b, epilogue, M, K, N, compute="fp32"):
    A = gen.standard_normal((K, M) if trans_a else (M, K)).astype(np.float32)
    B = gen.standard_normal((N, K) if trans_b else (K, N)).astype(np.float32)
    C = gen.standard_normal((M, N)).astype(np.float32)
    bias = gen.standard_normal(N).astype(np.float32) if epilogue in (None, "relu", "gelu", "gelu_aux") else None
    dC = _cuda.to_device(C)
    kw = {}
    if epilogue == "gelu_aux":
        ld = -(-N // 8) * 8
        kw["aux"] = _cuda.device_array((M, ld), np.float32)[:, :N]
    if epilogue in ("bgrad_a", "bgrad_b"):
        kw["bias_grad"] = _cuda.device_array(M if epilogue == "bgrad_a" else N, np.float32)
    beta = 0.0 if epilogue in ("bgrad_a", "bgrad_b") else 0.5
    blas.gemm(_cuda.to_device(A), _cuda.to_device(B), dC, trans_a, trans_b, alpha=1.5, beta=beta,
              bias=None if bias is None else _cuda.to_device(bias), epilogue=epilogue, compute=compute,
              stream=stream(), **kw)
    stream().synchronize()
    out, pre, sum_a, sum_b = blas.gemm_ref(A, B, C, trans_a, trans_b, 1.5, beta, bias, epilogue)
    errs = [_rel_err(dC.copy_to_host(), out)]
    if epilogue == "gelu_aux":
        errs.append(_rel_err(kw["aux"].copy_to_host(), pre))
    if epilogue == "bgrad_a":
        errs.append(_rel_err(kw["bias_grad"].copy_to_host(), sum_a))
    if epilogue == "bgrad_b":
        errs.append(_rel_err(kw["bias_grad"].copy_to_host(), sum_b))
    tol = 1e-5 if compute == "fp32" else 5e-3
    return max(errs) < tol, f"max rel err {max(errs):.1e}"


def _make_step(x, w, b, h, counter, seed):
    n, k = x.shape

    def step(s):
        # h = relu(x W + b); x = 0.5 h + u(seed, i, step); step += 1
        blas.gemm(x, w, h, bias=b, epilogue="relu", stream=s)
        mix_kernel[(n * k + BLOCK - 1) // BLOCK, BLOCK, s](h, np.uint64(seed), counter, x)
        rng.advance(counter, s)

    return step


def _check_graph_vs_eager(gen, n, k, steps):
    """Same initial state: `steps` eager steps vs warm-up + (steps - 1) replays, bitwise."""
    init = [gen.standard_normal((n, k)).astype(np.float32), (gen.standard_normal((k, k)) / math.sqrt(k)).astype(np.float32),
            gen.standard_normal(k).astype(np.float32)]
    outs = []
    for use_graph in (False, True):
        x, w, b = (_cuda.to_device(a) for a in init)
        h = _cuda.device_array((n, k), np.float32)
        counter = _cuda.to_device(np.zeros(1, np.int64))
        step = _make_step(x, w, b, h, counter, seed=7)
        s = stream()
        if use_graph:
            g = graph.capture(step, stream=s)
            for _ in range(steps - 1):
                g.replay()
        else:
            for _ in range(steps):
                step(s)
        s.synchronize()
        outs.append((x.copy_to_host(), counter.copy_to_host()))
    same = outs[0][0].tobytes() == outs[1][0].tobytes() and outs[0][1][0] == outs[1][1][0] == steps
    return same, f"{steps} steps of GEMM+relu, RNG kernel, counter advance; bitwise equal: {same}"


def _check_mapped():
    buf = MappedBuffer(4)
    x = _cuda.to_device(np.zeros(4, np.float32))
    s = stream()
    for _ in range(3):
        tick_kernel[1, BLOCK, s](x)
    tick_kernel[1, BLOCK, s](buf.device)
    buf.record(s)
    got = buf.read()
    return bool((got == 1.0).all()), f"read {got.tolist()}"


def _check_reduce(gen, n):
    try:
        from numbarl.cuda import reduce as red
    except ImportError:
        return True, "numbarl.cuda.reduce not present: skipped"
    x = gen.standard_normal(n).astype(np.float32)
    out = _cuda.device_array(1, np.float32)
    red.Reducer(n).sum(_cuda.to_device(x), out, stream())
    stream().synchronize()
    got = float(out.copy_to_host()[0])
    ref = float(x.astype(np.float64).sum())
    err = abs(got - ref) / max(1.0, float(np.abs(x).sum()))
    return err < 1e-6, f"sum of {n}: {got:.6g} vs {ref:.6g}"


def run_checks(seed=None) -> Checks:
    gen = np.random.default_rng(seed)
    checks = Checks()
    sim = simulator()
    M, K, N = (5, 23, 7) if sim else (1000, 259, 131)
    print(f"checks on {device_name()} (GEMM backend: {blas.backend()})", flush=True)
    for ta in (False, True):
        for tb in (False, True):
            checks.run(f"gemm {M}x{K}x{N} trans_a={ta} trans_b={tb}", lambda: _check_gemm(gen, ta, tb, None, M, K, N))
    for ep, ta, tb in (("relu", False, True), ("gelu", True, False), ("gelu_aux", False, False),
                       ("bgrad_b", True, False), ("bgrad_a", False, True)):
        checks.run(f"gemm epilogue {ep} (trans_a={ta}, trans_b={tb})", lambda: _check_gemm(gen, ta, tb, ep, M, K, N))
    if not sim:
        checks.run("gemm tf32", lambda: _check_gemm(gen, False, False, None, M, K, N, compute="tf32"))
    n, k = (6, 9) if sim else (4096, 256)
    checks.run("graph replay == eager", lambda: _check_graph_vs_eager(gen, n, k, steps=3))
    checks.run("mapped readback", _check_mapped)
    checks.run("reduction vs numpy", lambda: _check_reduce(gen, 1000 if sim else 10_000_019))
    return checks


# ---------------------------------------------------------------------------------------------
# timing (GPU)
# ---------------------------------------------------------------------------------------------
def _events_ms(fn, s, reps, warmup=3):
    """Median milliseconds of fn() between two events on stream s."""
    for _ in range(warmup):
        fn()
    start, end = _cuda.event(), _cuda.event()
    times = []
    for _ in range(reps):
        start.record(s)
        fn()
        end.record(s)
        end.synchronize()
        times.append(_cuda.event_elapsed_time(start, end))
    return float(np.median(times))


def bench_launch(n_nodes, reps):
    s = stream()
    x = _cuda.to_device(np.zeros(BLOCK, np.float32))
    tick_kernel[1, BLOCK, s](x)
    s.synchronize()
    eager_us = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n_nodes):
            tick_kernel[1, BLOCK, s](x)
        eager_us.append((time.perf_counter() - t0) * 1e6 / n_nodes)  # host time per launch
        s.synchronize()

    def step(st):
        for _ in range(n_nodes):
            tick_kernel[1, BLOCK, st](x)

    g = graph.capture(step, stream=s, warmup=False)
    ms = _events_ms(g.replay, s, reps)  # 3 warm-up replays + reps timed ones
    s.synchronize()
    expected = 1 + reps * n_nodes + (3 + reps) * n_nodes
    got = float(x.copy_to_host()[0])
    return {
        "nodes": n_nodes,
        "graph_nodes_captured": g.n_nodes,
        "eager_launch_us": float(np.median(eager_us)),
        "graph_node_us": ms * 1e3 / n_nodes,
        "ok": got == expected,
    }


def _rotations(nbytes_per_set):
    return int(min(8, max(2, math.ceil(ROTATE_BYTES / max(1, nbytes_per_set)))))


def _products(M, K, N):
    """(name, trans_a, trans_b, A shape, B shape, C shape) for forward, dX and dW."""
    return (
        ("Y=X·W", False, False, (M, K), (K, N), (M, N)),
        ("dX=dY·Wᵀ", False, True, (M, N), (K, N), (M, K)),
        ("dW=Xᵀ·dY", True, False, (M, K), (M, N), (K, N)),
    )


def bench_gemm_blas(ta, tb, a_shape, b_shape, c_shape, compute, iters, reps):
    s = stream()
    per_set = 4 * (np.prod(a_shape) + np.prod(b_shape) + np.prod(c_shape))
    n_rot = _rotations(per_set)
    gen = np.random.default_rng(0)
    sets = [(_cuda.to_device(gen.standard_normal(a_shape, dtype=np.float32)),
             _cuda.to_device(gen.standard_normal(b_shape, dtype=np.float32)),
             _cuda.device_array(c_shape, np.float32)) for _ in range(n_rot)]

    def step(st):
        for i in range(iters):
            A, B, C = sets[i % n_rot]
            blas.gemm(A, B, C, ta, tb, compute=compute, stream=st)

    g = graph.capture(step, stream=s)
    return _events_ms(g.replay, s, reps) / iters


def bench_gemm_torch(torch, ta, tb, a_shape, b_shape, c_shape, compute, iters, reps):
    torch.backends.cuda.matmul.allow_tf32 = compute == "tf32"
    dev = torch.device("cuda")
    per_set = 4 * (np.prod(a_shape) + np.prod(b_shape) + np.prod(c_shape))
    n_rot = _rotations(per_set)
    sets = [(torch.randn(*a_shape, device=dev), torch.randn(*b_shape, device=dev), torch.empty(*c_shape, device=dev))
            for _ in range(n_rot)]

    def body():
        for i in range(iters):
            A, B, C = sets[i % n_rot]
            torch.matmul(A.t() if ta else A, B.t() if tb else B, out=C)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # warm-up (cuBLAS handles and workspaces) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    torch.backends.cuda.matmul.allow_tf32 = False
    return float(np.median(times)) / iters


def bench_gemms(iters, reps, with_torch=True):
    torch = None
    note = ""
    if with_torch:
        try:
            import torch as _torch

            if _torch.cuda.is_available():
                torch = _torch
            else:
                note = "torch has no CUDA device: torch columns skipped"
        except ImportError:
            note = "torch is not installed: torch columns skipped"
    rows = []
    for M, K, N in GEMM_SHAPES:
        for name, ta, tb, a_shape, b_shape, c_shape in _products(M, K, N):
            m, n = c_shape
            k = a_shape[0] if ta else a_shape[1]
            flops = 2.0 * m * n * k
            for compute in ("fp32", "tf32"):
                ms = bench_gemm_blas(ta, tb, a_shape, b_shape, c_shape, compute, iters, reps)
                row = {"shape": f"{M}x{K}x{N}", "product": name, "m": m, "n": n, "k": k, "compute": compute,
                       "blas_ms": ms, "blas_tflops": flops / ms / 1e9}
                if torch is not None:
                    tms = bench_gemm_torch(torch, ta, tb, a_shape, b_shape, c_shape, compute, iters, reps)
                    row.update(torch_ms=tms, torch_tflops=flops / tms / 1e9, blas_vs_torch=tms / ms)
                rows.append(row)
                print(f"  gemm {row['shape']:<15} {name:<10} {compute}: blas {row['blas_tflops']:6.1f} TFLOP/s"
                      + (f", torch {row['torch_tflops']:6.1f} TFLOP/s" if "torch_tflops" in row else ""), flush=True)
    return rows, note


def bench_reduce(n, reps):
    s = stream()
    gen = np.random.default_rng(1)
    x = _cuda.to_device(gen.standard_normal(n, dtype=np.float32))
    dst = _cuda.device_array(n, np.float32)
    out = _cuda.device_array(1, np.float32)
    nbytes = 4 * n
    copy_ms = _events_ms(lambda: dst.copy_to_device(x, stream=s), s, reps)
    result = {"floats": n, "copy_ms": copy_ms, "copy_GBps": 2 * nbytes / copy_ms / 1e6}  # read + write
    try:
        from numbarl.cuda import reduce as red
    except ImportError:
        result["note"] = "numbarl.cuda.reduce not present: reduction row skipped"
        return result
    reducer = red.Reducer(n)
    g = graph.capture(lambda st: reducer.sum(x, out, st), stream=s)
    ms = _events_ms(g.replay, s, reps)
    result.update(reduce_ms=ms, reduce_GBps=nbytes / ms / 1e6)  # read only
    return result


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def _table(report) -> str:
    lines = [f"numbarl runtime benchmark on {report['device']}", ""]
    la = report.get("launch")
    if la:
        lines.append(f"launch overhead: eager {la['eager_launch_us']:.2f} us/launch (host), "
                     f"graph {la['graph_node_us']:.3f} us/node (GPU, {la['nodes']} nodes)"
                     + ("" if la["ok"] else "  ** counter mismatch **"))
        lines.append("")
    rows = report.get("gemm") or []
    if rows:
        has_torch = any("torch_tflops" in r for r in rows)
        head = f"{'shape MxKxN':<16}{'product':<11}{'m x n x k':<20}{'prec':<6}{'blas TFLOP/s':>13}"
        if has_torch:
            head += f"{'torch TFLOP/s':>15}{'blas/torch':>12}"
        lines += [head, "-" * len(head)]
        for r in rows:
            line = (f"{r['shape']:<16}{r['product']:<11}{str(r['m']) + 'x' + str(r['n']) + 'x' + str(r['k']):<20}"
                    f"{r['compute']:<6}{r['blas_tflops']:>13.1f}")
            if has_torch and "torch_tflops" in r:
                line += f"{r['torch_tflops']:>15.1f}{r['blas_vs_torch']:>12.2f}"
            lines.append(line)
        if report.get("gemm_note"):
            lines.append(report["gemm_note"])
        lines.append("")
    red = report.get("reduce")
    if red:
        line = f"device copy {red['copy_GBps']:.0f} GB/s (read+write, {red['floats'] * 4 >> 20} MiB)"
        if "reduce_GBps" in red:
            line += f"; Reducer.sum {red['reduce_GBps']:.0f} GB/s (read) = {red['reduce_GBps'] / red['copy_GBps']:.0%} of copy"
        else:
            line += f"; {red.get('note', '')}"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="numbarl-bench runtime", description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="run the self-checks only (fast; CPU simulator or GPU)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per measurement (median)")
    p.add_argument("--nodes", type=int, default=1000, help="kernel nodes in the launch-overhead graph")
    p.add_argument("--gemm-iters", type=int, default=20, help="GEMM calls per timed graph")
    p.add_argument("--no-torch", action="store_true", help="skip the torch.matmul columns")
    p.add_argument("--seed", type=int, default=None, help="seed of the check inputs (default: fresh)")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    checks = run_checks(args.seed)
    report = {
        "device": device_name(),
        "python": platform.python_version(),
        "command": "python -m numbarl.bench.runtime " + " ".join(sys.argv[1:] if argv is None else argv),
        "checks": checks.results,
        "checks_passed": checks.passed,
    }
    print(f"checks: {'PASS' if checks.passed else 'FAIL'} in {time.perf_counter() - t0:.1f} s", flush=True)
    if not args.check:
        if simulator():
            print("timings need a GPU (running on the simulator): only the checks ran")
            report["note"] = "simulator: no timings"
        elif not checks.passed:
            print("checks failed: not timing")
        else:
            report["launch"] = bench_launch(args.nodes, args.reps)
            report["gemm"], report["gemm_note"] = bench_gemms(args.gemm_iters, args.reps, not args.no_torch)
            report["reduce"] = bench_reduce(REDUCE_FLOATS, args.reps)
            print()
            print(_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if checks.passed else 1


if __name__ == "__main__":
    sys.exit(main())
