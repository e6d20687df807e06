"""The C51 loss's launches alone at the benchmark's size (B = 16,384, branches 3/3/4/4, 51 atoms; the target rows at
a*, the head's lse, the gradient's taken rows, as in the train step), timed with CUDA events for several
c51.TARGET_PARTS (threads per row's projection), with the outputs checked equal across them. Usage: python3 probe_loss.py OUT.json"""

import json
import sys

import numpy as np


def main(out):
    from numbarl.cuda.runtime import cuda, stream
    from numbarl.rl.losses import c51

    c = cuda()
    s = stream()
    rng = np.random.default_rng(0)
    B, sizes, Z = 16384, (3, 3, 4, 4), 51
    nb, na = len(sizes), max(sizes)
    logits = rng.standard_normal((B, nb, na, Z)).astype(np.float32) * 2
    x = logits.astype(np.float64)
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    rows = rng.random((B, nb, Z)).astype(np.float32)
    rows /= rows.sum(-1, keepdims=True)
    actions = np.stack([rng.integers(0, n, B) for n in sizes], 1).astype(np.int32)
    dev = dict(online_logits=c.to_device(logits), actions=c.to_device(actions),
               next_q=c.to_device(rng.standard_normal((B, nb, na)).astype(np.float32)), target_probs=c.to_device(rows),
               rewards=c.to_device(rng.uniform(-3, 3, B).astype(np.float32)),
               dones=c.to_device((rng.random(B) < 0.05).astype(np.float32)),
               discounts=c.to_device(np.full(B, 0.99 ** 3, np.float32)))
    head_lse = c.to_device(lse.astype(np.float32))
    res, ref = {}, None
    import os

    quick = os.environ.get("PROBE_QUICK") == "1"  # one shape, few calls (under ncu)
    for samples in (4,) if quick else (1, 2, 4, 8):
        c51.TARGET_PARTS = samples
        loss = c51.C51Loss(B, sizes, Z, -10.0, 10.0)
        call = lambda: loss(stream=s, taken_grad=True, head_lse=head_lse, **dev)  # noqa: E731
        for _ in range(5):
            call()
        s.synchronize()
        times = []
        for _ in range(1 if quick else 5):
            start, end = c.event(timing=True), c.event(timing=True)
            start.record(s)
            for _ in range(2 if quick else 100):
                call()
            end.record(s)
            end.synchronize()
            times.append(c.event_elapsed_time(start, end) * 1000 / (2 if quick else 100))
        outs = {k: loss.arena[k].copy_to_host() for k in ("target_dist", "lse", "ce", "d_taken", "per_sample", "loss")}
        same = ref is None or all(outs[k].tobytes() == ref[k].tobytes() for k in ref)
        ref = ref or outs
        res[samples] = {"us_per_call": float(np.median(times)), "same_bits": same}
        print(samples, res[samples], flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
