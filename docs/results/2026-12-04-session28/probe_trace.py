"""The benchmark's model (numbarl.bench.train's agent: batch 16,384, trunk 512x512, default overlap) trained for the
same steps in fp32 and TF32, and every array it ends with hashed: parameters, target, Adam moments, replay, counters,
statistics, gradients and the C51 loss's outputs (target_dist, lse, ce, per_sample, loss, d_logits / d_taken). Run it
in two trees and compare the two JSON files: the same hashes mean the same bits.
Usage: python3 probe_trace.py OUT.json [--compare A.json B.json]"""

import hashlib
import json
import sys

import numpy as np


def run(compute, s):
    from numbarl.bench.train import _market, _time_graph
    from numbarl.config import AgentConfig
    from numbarl.cuda import graph as cuda_graph
    from numbarl.env.device import DeviceEnv
    from numbarl.env.params import EnvParams
    from numbarl.rl.agents.base import make_agent

    params = EnvParams()
    market = _market(200_000, 64, 0).to_device(params.vol_span, params.vol_horizon_bars)
    cfg = AgentConfig(trunk=(512, 512), batch_size=16384, replay_capacity=16384 * 64, compute=compute)
    env = DeviceEnv(market, params, 16384, seed=0)
    agent = make_agent(cfg, env.state_dim, params.branch_sizes, 16384, 0, epsilon=(1.0, 0.05, 100))
    env.reset(0, s)
    steps = agent.step_functions(env)
    collect = cuda_graph.capture(steps["collect"], s)
    for _ in range(40):
        collect.replay(s)
    train = cuda_graph.capture(steps["train"], s)
    ms = _time_graph(train, s, iters=50)
    s.synchronize()
    state = {**agent.state_arrays(), **{f"grads/{k}": v for k, v in agent.store.to_host("grads").items()}}
    for k, v in agent.loss.arena.to_host().items():
        state[f"loss/{k}"] = v
    return ms, {k: hashlib.sha256(np.ascontiguousarray(np.asarray(v)).tobytes()).hexdigest() for k, v in state.items()}


def main(argv):
    if argv[0] == "--compare":
        a, b = ({}, {})
        for d, path in zip((a, b), argv[1:3]):
            with open(path) as f:
                d.update(json.load(f))
        bad = 0
        for compute in a:
            ha, hb = a[compute]["hashes"], b[compute]["hashes"]
            diff = sorted(k for k in set(ha) | set(hb) if ha.get(k) != hb.get(k))
            bad += len(diff)
            print(f"{compute}: {len(ha)} vs {len(hb)} arrays, {len(diff)} differ {diff[:20]} "
                  f"(ms {a[compute]['ms']:.3f} vs {b[compute]['ms']:.3f})")
        return 1 if bad else 0
    from numbarl.cuda.runtime import stream

    s = stream()
    res = {}
    for compute in ("fp32", "tf32"):
        ms, hashes = run(compute, s)
        res[compute] = {"ms": ms, "hashes": hashes}
        print(compute, f"{ms:.3f} ms", len(hashes), "arrays", flush=True)
    with open(argv[0], "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
