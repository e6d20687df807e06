"""agent.overlap and the target pass at a* (dqn.TARGET_AT) timed in their four combinations on the benchmark's model
(numbarl.bench.train's agent, batch 16,384, fp32 and TF32). Each variant's train graph is timed like the bench
(_time_graph) and its state after the same steps compared bit for bit with the first variant's (one stream, the
full target pass). Usage: python3 probe_overlap.py OUT.json"""

import json
import sys

import numpy as np

from numbarl.bench.train import _market, _time_graph
from numbarl.config import AgentConfig
from numbarl.cuda import graph as cuda_graph
from numbarl.cuda.runtime import stream
from numbarl.env.device import DeviceEnv
from numbarl.env.params import EnvParams
from numbarl.rl.agents import dqn
from numbarl.rl.agents.base import make_agent


def run(compute, overlap, target_at, s):
    dqn.TARGET_AT = target_at
    params = EnvParams()
    market = _market(200_000, 64, 0).to_device(params.vol_span, params.vol_horizon_bars)
    cfg = AgentConfig(trunk=(512, 512), batch_size=16384, replay_capacity=16384 * 64, compute=compute, overlap=overlap)
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
    return ms, state


def main(out):
    s = stream()
    res = {}
    for compute in ("fp32", "tf32"):
        base_ms, base = run(compute, False, False, s)
        res[f"{compute}.one_stream.full_target"] = {"ms": base_ms}
        for overlap, target_at in ((True, False), (False, True), (True, True)):
            ms, state = run(compute, overlap, target_at, s)
            same = set(state) == set(base) and all(np.asarray(state[k]).tobytes() == np.asarray(base[k]).tobytes()
                                                   for k in base)
            key = f"{compute}.{'overlap' if overlap else 'one_stream'}.{'target_at' if target_at else 'full_target'}"
            res[key] = {"ms": ms, "bitwise_equal": same}
        print(compute, json.dumps({k: v for k, v in res.items() if k.startswith(compute)}), flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1])
