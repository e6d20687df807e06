"""C51 head forward benchmark: the one-launch dueling softmax (`dueling_forward`) per output set.

    python -m numbarl.bench.head [--batch 16384] [--atoms 51] [--shapes 64x2x8,64x1x8] [--json PATH]

For each launch shape (lanes x thread rows x samples per block; default the built-in one) it
checks every output against the float64 reference (the first 256 rows) and that the shape gives
the same bits as the first shape, then times graphs of 20 calls (median of 5) for the passes a
train step and a collect step make: ("q",), ("logits", "q"), ("probs",), and all three. Also
prints the kernel's registers per thread, which with the shared memory set its occupancy.
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
    modes = {"q": dict(lse=lse, q=q), "logits+q": dict(logits=logits, lse=lse, q=q), "probs": dict(probs=probs),
             "logits+probs+q": dict(logits=logits, lse=lse, q=q, probs=probs)}
    n = min(B, 256)
    ref_logits = c51_head.dueling_combine_ref(value_h[:n], adv_h[:n], sizes)
    ref_probs, ref_q = c51_head.distribution_ref(ref_logits, layout["support"].copy_to_host(), sizes)
    shapes = ([_shape(x) for x in args.shapes.split(",")] if args.shapes
              else [(c51_head.HEAD_TX, c51_head.HEAD_TY, c51_head.HEAD_SAMPLES)])
    out = {"device": device_name(), "batch": B, "atoms": Z, "shapes": []}
    first = None
    mb = {"q": 0, "logits+q": 1, "probs": 1, "logits+probs+q": 2}
    for tx, ty, samples in shapes:
        kw_shape = dict(block=(tx, ty), samples=samples)
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
            g = cuda_graph.capture(lambda st, kw=kw: c51_head.dueling_forward(value, adv, layout, st, **kw, **kw_shape), s)
            us = _time_graph(g, s, iters=20) * 1e3
            gbytes = (B * (Z + width) + mb[name] * B * K * M * Z) * 4 / 1e9
            row["us"][name] = {"us": us, "GB/s": gbytes / (us * 1e-6)}
        out["shapes"].append(row)
    regs = c51_head.dueling_head_kernel.get_regs_per_thread()  # {signature: registers}
    out["regs_per_thread"] = sorted(set(regs.values())) if isinstance(regs, dict) else regs
    return out


def main(argv=None) -> int:
    backend.select()
    p = argparse.ArgumentParser(prog="numbarl-bench head", description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16384)
    p.add_argument("--atoms", type=int, default=51)
    p.add_argument("--shapes", default="", help="comma-separated LANESxROWSxSAMPLES launch shapes, e.g. 64x2x8,64x1x8")
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
