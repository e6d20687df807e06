"""C51 head forward benchmark: the one-launch dueling softmax (`dueling_forward`) per output set.

    python -m numbarl.bench.head [--batch 16384] [--atoms 51] [--shapes 64x2x8,64x1x8]
                                 [--q-shapes 32x4x8,32x8x16] [--json PATH]

For each launch shape of the general kernel `dueling_head_kernel` (lanes x thread rows x samples
per block; default the built-in one) it checks every output against the float64 reference (the
first 256 rows) and that the shape gives the same bits as the first shape, then times graphs of 20
calls (median of 5) for the passes a train step and a collect step make: ("q",), ("logits", "q"),
("probs",), and all three. Then the Q-only pass (acting, the next-obs pass) side by side: the
general kernel (q_kernel="head", first shape) against the dedicated `dueling_q_kernel` at each
--q-shapes shape (q_kernel="q"), each checked for the same lse and q bits as the general kernel
over the whole batch. Also prints both kernels' registers per thread, which with the shared memory
set their occupancy.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from numbarl.cuda import backend


def _shape(text: str):
    try:
        tx, ty, samples = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"numbarl-bench head: --shapes wants LANESxROWSxSAMPLES items, got {text!r}")
    return tx, ty, samples


def run(args) -> dict:
    from numbarl.bench.train import _time_graph
    from numbarl.cuda import graph as cuda_graph
    from numbarl.cuda.runtime import cuda, device_name, stream
    from numbarl.env.params import EnvParams
    from numbarl.rl.nets import c51_head

    c = cuda()
    s = stream()
    sizes = EnvParams().branch_sizes
    B, Z = args.batch, args.atoms
    K, M, width = len(sizes), max(sizes), sum(sizes) * Z
    layout = c51_head.BranchedDuelingC51Head("bench", 8, sizes, Z).layout
    rng = np.random.default_rng(0)
    value_h = rng.standard_normal((B, Z)).astype(np.float32)
    adv_h = rng.standard_normal((B, width)).astype(np.float32)
    value, adv = c.to_device(value_h, stream=s), c.to_device(adv_h, stream=s)
    logits = c.device_array((B, K, M, Z), np.float32, stream=s)
    probs = c.device_array((B, K, M, Z), np.float32, stream=s)
    lse = c.device_array((B, K, M), np.float32, stream=s)
    q = c.device_array((B, K, M), np.float32, stream=s)
    modes = {"q": {"lse": lse, "q": q}, "logits+q": {"logits": logits, "lse": lse, "q": q}, "probs": {"probs": probs},
             "logits+probs+q": {"logits": logits, "lse": lse, "q": q, "probs": probs}}
    n = min(B, 256)
    ref_logits = c51_head.dueling_combine_ref(value_h[:n], adv_h[:n], sizes)
    ref_probs, ref_q = c51_head.distribution_ref(ref_logits, layout["support"].copy_to_host(), sizes)
    shapes = ([_shape(x) for x in args.shapes.split(",")] if args.shapes
              else [(c51_head.HEAD_TX, c51_head.HEAD_TY, c51_head.HEAD_SAMPLES)])
    out = {"device": device_name(), "batch": B, "atoms": Z, "shapes": []}
    first = None
    mb = {"q": 0, "logits+q": 1, "probs": 1, "logits+probs+q": 2}
    for tx, ty, samples in shapes:
        # this table is the general kernel's, its Q-only pass included (see _q_only for the dedicated one)
        kw_shape = {"block": (tx, ty), "samples": samples, "q_kernel": "head"}
        c51_head.dueling_forward(value, adv, layout, s, **modes["logits+probs+q"], **kw_shape)
        got = {"logits": logits.copy_to_host(stream=s), "probs": probs.copy_to_host(stream=s),
               "q": q.copy_to_host(stream=s)}
        s.synchronize()
        errs = {}
        for name, ref in (("logits", ref_logits), ("probs", ref_probs), ("q", ref_q)):
            fin = np.isfinite(ref)
            errs[name] = float(np.max(np.abs(got[name][:n][fin] - ref[fin]))) if fin.any() else 0.0
        same = None if first is None else all(np.array_equal(got[k], first[k]) for k in got)
        first = first or got
        row = {"block": [tx, ty], "samples": samples, "max_abs_err": errs, "bitwise_equal_to_first": same, "us": {}}
        for name, kw in modes.items():
            def call(st, kw=kw, kw_shape=kw_shape):
                c51_head.dueling_forward(value, adv, layout, st, **kw, **kw_shape)

            g = cuda_graph.capture(call, s)
            us = _time_graph(g, s, iters=20) * 1e3
            gbytes = (B * (Z + width) + mb[name] * B * K * M * Z) * 4 / 1e9
            row["us"][name] = {"us": us, "GB/s": gbytes / (us * 1e-6)}
        out["shapes"].append(row)
    gbytes = B * (Z + width + 2 * K * M) * 4 / 1e9  # the Q-only pass reads V, A and writes lse, q
    out["q_only"] = _q_only(args, c51_head, cuda_graph, _time_graph, s, value, adv, layout, lse, q, ref_q, n,
                            shapes[0], gbytes)
    out["regs_per_thread"] = _regs(c51_head.dueling_head_kernel)
    out["q_regs_per_thread"] = _regs(c51_head.dueling_q_kernel)
    return out


def _regs(kernel):
    regs = kernel.get_regs_per_thread()  # {signature: registers}
    return sorted(set(regs.values())) if isinstance(regs, dict) else regs


def _q_only(args, c51_head, cuda_graph, time_graph, s, value, adv, layout, lse, q, ref_q, n, head_shape, gbytes):
    """The Q-only pass: general kernel (first --shapes shape) vs `dueling_q_kernel` per --q-shapes
    shape, same bits over the whole batch checked before timing."""
    tx, ty, samples = head_shape
    runs = [("head", {"block": (tx, ty), "samples": samples, "q_kernel": "head"})]
    q_shapes = ([_shape(x) for x in args.q_shapes.split(",")] if args.q_shapes
                else [(c51_head.Q_TX, c51_head.Q_TY, c51_head.Q_SAMPLES)])
    runs += [("q", {"block": (qx, qy), "samples": qs, "q_kernel": "q"}) for qx, qy, qs in q_shapes]
    rows, first = [], None
    nan = np.full(q.shape, np.nan, np.float32)
    for kernel, kw in runs:
        lse.copy_to_device(nan, stream=s)  # a kernel that skips an entry cannot inherit the previous run's bits
        q.copy_to_device(nan, stream=s)
        c51_head.dueling_forward(value, adv, layout, s, lse=lse, q=q, **kw)
        got = (lse.copy_to_host(stream=s), q.copy_to_host(stream=s))
        s.synchronize()
        fin = np.isfinite(ref_q)
        err = float(np.max(np.abs(got[1][:n][fin] - ref_q[fin]))) if fin.any() else 0.0
        same = None if first is None else bool(np.array_equal(got[0], first[0]) and np.array_equal(got[1], first[1]))
        first = first or got
        def call(st, kw=kw):
            c51_head.dueling_forward(value, adv, layout, st, lse=lse, q=q, **kw)

        us = time_graph(cuda_graph.capture(call, s), s, iters=20) * 1e3
        rows.append({"kernel": kernel, "block": list(kw["block"]), "samples": kw["samples"], "q_max_abs_err": err,
                     "bitwise_equal_to_head": same, "us": us, "GB/s": gbytes / (us * 1e-6)})
    return rows


def main(argv=None) -> int:
    backend.select()
    p = argparse.ArgumentParser(prog="numbarl-bench head", description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16384)
    p.add_argument("--atoms", type=int, default=51)
    p.add_argument("--shapes", default="", help="comma-separated LANESxROWSxSAMPLES launch shapes, e.g. 64x2x8,64x1x8")
    p.add_argument("--q-shapes", default="",
                   help="comma-separated LANESxROWSxSAMPLES shapes for dueling_q_kernel, e.g. 32x4x8,32x8x16")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if backend.simulator_active():
        print("numbarl-bench head needs a GPU (the simulator cannot time kernels)", file=sys.stderr)
        return 2
    r = run(args)
    print(f"head forward on {r['device']}: B={r['batch']} Z={r['atoms']} regs/thread {r['regs_per_thread']}")
    for row in r["shapes"]:
        same = {None: "", True: " | bitwise = first shape", False: " | DIFFERS from the first shape"}[row["bitwise_equal_to_first"]]
        print(f"block {tuple(row['block'])} samples {row['samples']}: max abs err "
              f"{', '.join(f'{k} {v:.1e}' for k, v in row['max_abs_err'].items())}{same}")
        for name, v in row["us"].items():
            print(f"  {name:<16}{v['us']:>9.1f} us {v['GB/s']:>8.0f} GB/s")
    print(f"Q-only pass (lse, q): dueling_head_kernel regs/thread {r['regs_per_thread']}, "
          f"dueling_q_kernel regs/thread {r['q_regs_per_thread']}")
    base_us = r["q_only"][0]["us"]
    for row in r["q_only"]:
        same = {None: "the bits compared", True: "bitwise = head", False: "BITS DIFFER from head"}[
            row["bitwise_equal_to_head"]]
        print(f"  {row['kernel']:<5} block {tuple(row['block'])} samples {row['samples']:<3}{row['us']:>8.1f} us "
              f"{row['GB/s']:>6.0f} GB/s ({base_us / row['us']:.2f}x)  q max abs err {row['q_max_abs_err']:.1e}  "
              f"{same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    if any(row["bitwise_equal_to_head"] is False for row in r["q_only"]):
        print("dueling_q_kernel's lse / q bits differ from dueling_head_kernel's: see the rows above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
