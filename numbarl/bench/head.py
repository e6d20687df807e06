"""C51 head forward benchmark: the one-launch dueling softmax (`dueling_forward`) per output set.

    python -m numbarl.bench.head [--batch 16384] [--atoms 51] [--json PATH]

Checks each output against the float64 reference first (a sample of rows), then times graphs of
20 calls (median of 5) for the passes a train step and a collect step make: ("q",), ("logits", "q"),
("probs",). Also prints the kernel's registers per thread and shared memory per block, which set
its occupancy. Launch-shape knobs for tuning: NUMBARL_HEAD_TY and
NUMBARL_HEAD_SAMPLES (environment, read at import).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from numbarl.cuda import backend


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
    # check (all outputs, first 256 rows) against the float64 reference
    c51_head.dueling_forward(value, adv, layout, s, **modes["logits+probs+q"])
    n = min(B, 256)
    ref_logits = c51_head.dueling_combine_ref(value_h[:n], adv_h[:n], sizes)
    ref_probs, ref_q = c51_head.distribution_ref(ref_logits, layout["support"].copy_to_host(), sizes)
    got = {"logits": logits.copy_to_host(stream=s)[:n], "probs": probs.copy_to_host(stream=s)[:n],
           "q": q.copy_to_host(stream=s)[:n]}
    s.synchronize()
    errs = {}
    for name, ref in (("logits", ref_logits), ("probs", ref_probs), ("q", ref_q)):
        fin = np.isfinite(ref)
        errs[name] = float(np.max(np.abs(got[name][fin] - ref[fin]))) if fin.any() else 0.0
    regs = c51_head.dueling_head_kernel.get_regs_per_thread()  # {signature: registers} (one signature here)
    out = {"device": device_name(), "batch": B, "atoms": Z, "tx": c51_head.HEAD_TX, "ty": c51_head.HEAD_TY,
           "samples": c51_head.HEAD_SAMPLES, "max_abs_err": errs,
           "regs_per_thread": sorted(set(regs.values())) if isinstance(regs, dict) else regs, "us": {}}
    mb = {"q": 0, "logits+q": 1, "probs": 1, "logits+probs+q": 2}
    for name, kw in modes.items():
        g = cuda_graph.capture(lambda st, kw=kw: c51_head.dueling_forward(value, adv, layout, st, **kw), s)
        us = _time_graph(g, s, iters=20) * 1e3
        gbytes = (B * (Z + width) + mb[name] * B * K * M * Z) * 4 / 1e9
        out["us"][name] = {"us": us, "GB/s": gbytes / (us * 1e-6)}
    return out


def main(argv=None) -> int:
    backend.select()
    p = argparse.ArgumentParser(prog="numbarl-bench head", description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16384)
    p.add_argument("--atoms", type=int, default=51)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if backend.simulator_active():
        print("numbarl-bench head needs a GPU (the simulator cannot time kernels)", file=sys.stderr)
        return 2
    r = run(args)
    print(f"head forward on {r['device']}: B={r['batch']} Z={r['atoms']} block ({r['tx']}, {r['ty']}) "
          f"samples {r['samples']} regs/thread {r['regs_per_thread']} "
          f"max abs err {', '.join(f'{k} {v:.1e}' for k, v in r['max_abs_err'].items())}")
    for name, v in r["us"].items():
        print(f"  {name:<16}{v['us']:>9.1f} us {v['GB/s']:>8.0f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
