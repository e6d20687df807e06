"""Env and backtest benchmark: checks, then times (issue 3; results go to docs/BENCHMARKS.md).

    python -m numbarl.bench.env                  # checks, then timings at the issue's sizes (GPU)
    python -m numbarl.bench.env --check          # checks only (CPU simulator or GPU), seconds
    python -m numbarl.bench.env --json out.json

Checks before it times: the device env against the CPU reference env (every state field, reward,
done, actions, obs for a few steps) and the device backtest against the CPU reference backtest.
Then, on a GPU:

* env-steps/s without inference at N = --n-envs (default 65,536): CUDA graphs of --graph-steps
  steps, (a) the env step alone and (b) the whole collect step minus the network: gather obs and
  mask -> epsilon-greedy (numbarl.rl.policies) from a fixed Q buffer -> step -> gather next obs
  and mask -> RNG advance;
* backtest bar-steps/s for --bt-policies x --bt-bars (default 4,096 x 1,000,000): one thread per
  policy loops over a chunk of bars inside the kernel (--bt-chunk rows, per-bar P&L and position
  written time-major), plus the device metric scan of each chunk; actions are random plans held
  for 5-36 bars (different per policy), generated on the device, so the env does real work
  (entries, target/stop exits, trade accounting);
  the CPU column's backtest also runs the metric scan (backtest_reference computes both);
  then the same with --bt-segment-bars (default 1,024; 0 skips it): the segmented kernels
  (numbarl/env/backtest_segments.py: speculate, carry, replay; segments x policies threads),
  with one more run timed pass by pass, and a check that its final state and metric
  accumulators equal the one-thread run's bitwise at the full size (the checks above also
  compare it with the CPU reference and, bitwise, with the one-thread path on a smaller case);
* the CPU reference env and backtest on this host (@njit, one core) at smaller sizes, scaled per
  step, and the device/CPU ratios;
* backtest with a learned policy, bars/s: the default preset's validation window (--val-bars,
  default 3,063 bars, 1 policy, the default agent network 64 features -> 512 -> 512, C51 head
  4 branches x 51 atoms): every bar gather -> network -> greedy select -> step, as replays of
  captured graphs of bar steps (numbarl.env.backtest.PolicyBars) and as the eager loop; checked
  bitwise equal before it is timed. The first graphed call captures (timed apart), later calls
  replay (the trainer's validation from the second epoch on).

Timing: CUDA events, warm-up first, median of --reps repetitions.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np

from numbarl.cuda import backend, graph, rng
from numbarl.cuda.runtime import cuda, device_name, simulator
from numbarl.cuda.runtime import stream as default_stream
from numbarl.env.backtest import DeviceBacktest, backtest, backtest_reference
from numbarl.env.device import DeviceEnv
from numbarl.env.market import MarketData
from numbarl.env.params import EnvParams
from numbarl.env.reference import CpuEnv
from numbarl.env.state import STATE_FIELDS
from numbarl.rl.policies import epsilon_greedy, epsilon_greedy_ref

backend.select()

_cuda = cuda()
BLOCK = 256
_MASK8 = np.int64(0xFF)


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------
def synthetic_market(n_bars: int, n_features: int, seed: int = 0, tick: float = 0.25, bars_per_day: int = 7500) -> MarketData:
    """Random-walk mid on a half-tick grid around 5,000, 1-2 tick spreads (bench data only)."""
    r = np.random.default_rng(seed)
    mid = 5000.0 + np.cumsum(r.integers(-3, 4, n_bars) * (tick / 2))
    spread = tick * r.integers(1, 3, n_bars)
    prev = np.concatenate([[mid[0]], mid[:-1]])
    return MarketData(
        features=r.standard_normal((n_bars, n_features), dtype=np.float32),
        mid=mid,
        bid=mid - spread / 2,
        ask=mid + spread / 2,
        high=np.maximum(prev, mid) + tick * r.integers(0, 4, n_bars),
        low=np.minimum(prev, mid) - tick * r.integers(0, 4, n_bars),
        session_id=(np.arange(n_bars) // bars_per_day).astype(np.int32),
        timestamps=np.arange(n_bars, dtype=np.int64) * 1_000_000_000,
        tick_size=tick,
        bars_per_day=float(bars_per_day),
    )


def bench_params() -> EnvParams:
    return EnvParams(episode_length=5000, max_episode_bars=10000, fill_delay=0, churn_penalty_scale=0.01, conviction_weight=0.2)


@_cuda.jit(cache=True)
def plan_rows_kernel(rows, seed, salt, n_size, n_target, n_stop):
    """rows[r, p] = packed plan of policy p at row r: random plans held for 5 + p % 32 bars."""
    e = _cuda.grid(1)
    if e >= rows.shape[0] * rows.shape[1]:
        return
    r = e // rows.shape[1]
    p = e - r * rows.shape[1]
    segment = (r + salt) // (5 + p % 32)
    d = rng.randint(seed, p, segment, 0, 3)
    s = rng.randint(seed, p, segment, 1, n_size)
    t = rng.randint(seed, p, segment, 2, n_target)
    x = rng.randint(seed, p, segment, 3, n_stop)
    rows[r, p] = np.int32(d | (s << 8) | (t << 16) | (x << 24))


def plan_actions_host(params: EnvParams, n_policies: int, n_bars: int, seed: int) -> np.ndarray:
    r = np.random.default_rng(seed)
    out = np.empty((n_policies, n_bars, 4), np.int32)
    for p in range(n_policies):
        hold = 5 + p % 32
        seg = np.stack([r.integers(0, s, n_bars // hold + 1) for s in params.branch_sizes], -1)
        out[p] = np.repeat(seg, hold, axis=0)[:n_bars]
    return out


# ---------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------
def check_env(n_envs: int, steps: int, seed: int = 1) -> tuple[bool, str]:
    data = synthetic_market(3000, 16, seed)
    params = bench_params().replace(episode_length=50, max_episode_bars=120, fill_delay=1)
    cpu = CpuEnv(data, params, n_envs, seed=seed)
    dev = DeviceEnv(data, params, n_envs, seed=seed)
    cpu.reset()
    dev.reset()
    r = np.random.default_rng(seed)
    worst = 0.0
    s = default_stream()
    q_dev = _cuda.device_array((n_envs, params.n_branches, params.max_actions), np.float32)
    eps = _cuda.to_device(np.array([0.2], np.float32))
    for t in range(steps):
        obs, mask = dev.gather(stream=s)
        obs_ok = np.allclose(obs.copy_to_host(), cpu.gather(), rtol=1e-5, atol=1e-5)
        mask_ok = np.array_equal(mask.copy_to_host(), cpu.mask)
        q = r.standard_normal((n_envs, params.n_branches, params.max_actions)).astype(np.float32)
        q_dev.copy_to_device(q, stream=s)
        epsilon_greedy(q_dev, mask, eps, dev.seed_dev, dev.counter, dev.arena["actions"], dev.arena["preference"], s)
        actions, preference = epsilon_greedy_ref(q, cpu.mask, 0.2, seed, cpu.counter[0])
        if not obs_ok or not mask_ok or not np.array_equal(dev.arena["actions"].copy_to_host(), actions):
            return False, f"obs/mask/actions differ at step {t}"
        dev.step(stream=s)
        cpu.step(actions, preference)
        state = dev.state_to_host()
        for name, _ in STATE_FIELDS:
            got, want = state[name], getattr(cpu.state, name)
            if np.issubdtype(want.dtype, np.integer):
                if not np.array_equal(got, want):
                    return False, f"{name} differs at step {t}"
            else:
                err = float(np.max(np.abs(got - want) / (1e-8 + np.abs(want)))) if want.size else 0.0
                worst = max(worst, err)
                if not np.allclose(got, want, rtol=1e-9, atol=1e-8):
                    return False, f"{name} differs at step {t} (max rel {err:.2e})"
        if not np.allclose(dev.outputs.reward.copy_to_host(), cpu.out.reward, rtol=1e-5, atol=1e-6):
            return False, f"reward differs at step {t}"
        dev.advance()
        cpu.advance()
    return True, f"{n_envs} envs x {steps} steps, max rel err {worst:.1e}"


def check_backtest(n_policies: int, n_bars: int, seed: int = 2, segment_bars: int | None = None) -> tuple[bool, str]:
    """Device backtest == CPU reference; with segment_bars the segmented kernels, also checked
    bitwise against the one-thread device path."""
    data = synthetic_market(n_bars + 10, 4, seed)
    params = bench_params()
    actions = plan_actions_host(params, n_policies, n_bars, seed)
    ref = backtest_reference(data, (5, 5 + n_bars), params, actions)
    chunk = max(2, n_bars // 3)
    dev = backtest(data, (5, 5 + n_bars), params, actions=actions, chunk_bars=chunk, segment_bars=segment_bars)
    if not np.allclose(dev.pnl, ref.pnl, rtol=1e-9, atol=1e-8) or not np.array_equal(dev.position, ref.position):
        return False, "per-bar P&L or positions differ"
    if len(dev.trades) != len(ref.trades) or not np.allclose(dev.trades["pnl"], ref.trades["pnl"], rtol=1e-9, atol=1e-8):
        return False, "trade lists differ"
    for col in ("policy", "entry_bar", "exit_bar", "side", "size", "exit_reason"):
        if not (dev.trades[col].to_numpy() == ref.trades[col].to_numpy()).all():
            return False, f"trade {col} differs"
    detail = f"{n_policies} policies x {n_bars} bars, {len(ref.trades)} trades"
    if segment_bars is not None:
        one = backtest(data, (5, 5 + n_bars), params, actions=actions, chunk_bars=chunk)
        same = (np.array_equal(dev.pnl, one.pnl) and np.array_equal(dev.position, one.position) and dev.trades.equals(one.trades)
                and np.array_equal(dev.accumulators, one.accumulators, equal_nan=True))
        if not same:
            return False, "segmented device backtest differs from the one-thread device backtest (bitwise)"
        detail += f", segments of {segment_bars} bars, bitwise equal to the one-thread device path"
    return True, detail


# ---------------------------------------------------------------------------------------------
# timings
# ---------------------------------------------------------------------------------------------
def _median_ms(fn, reps: int, warmup: int = 2) -> float:
    s = default_stream()
    for _ in range(warmup):
        fn(s)
    times = []
    for _ in range(reps):
        e0, e1 = _cuda.event(), _cuda.event()
        e0.record(s)
        fn(s)
        e1.record(s)
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return max(statistics.median(times), 1e-6)  # (the simulator's events report 0)


def time_env(n_envs: int, graph_steps: int, n_features: int, n_bars: int, reps: int) -> dict:
    data = synthetic_market(n_bars, n_features, seed=3)
    params = bench_params()
    env = DeviceEnv(data, params, n_envs, seed=3)
    env.reset()
    q = _cuda.to_device(np.random.default_rng(4).standard_normal((n_envs, params.n_branches, params.max_actions)).astype(np.float32))
    eps = _cuda.to_device(np.array([0.05], np.float32))

    def select(s):  # the learner's epsilon-greedy on the env's mask, from a fixed Q buffer
        epsilon_greedy(q, env.arena["mask"], eps, env.seed_dev, env.counter, env.arena["actions"], env.arena["preference"], s)

    env.gather()
    select(default_stream())

    def step_only(s):
        for _ in range(graph_steps):
            env.step(stream=s)
            env.advance(s)

    def collect_no_inference(s):
        for _ in range(graph_steps):
            env.gather(env.transition.obs, env.transition.mask, s)
            select(s)
            env.step(stream=s)
            env.gather(env.transition.next_obs, env.transition.next_mask, s)
            env.advance(s)

    out = {}
    for name, body in (("step", step_only), ("collect", collect_no_inference)):
        g = graph.capture(body)
        ms = _median_ms(lambda s: g.replay(s), reps)
        out[name] = n_envs * graph_steps / (ms * 1e-3)
        out[name + "_us_per_step"] = ms * 1e3 / graph_steps
    out["eager_step"] = n_envs / (_median_ms(lambda s: env.step(stream=s), reps) * 1e-3)
    state = env.state_to_host()
    out["trades_closed"] = int(state["kelly_wins"].sum() + state["kelly_losses"].sum())
    return out


def time_backtest(n_policies: int, n_bars: int, chunk: int, reps: int, segment_bars: int | None = None,
                  event_slots: int | None = None) -> dict:
    """segment_bars=None: one thread per policy (`actions_kernel`); else the segmented kernels."""
    data = synthetic_market(n_bars, 4, seed=5)
    params = bench_params()
    bt = DeviceBacktest(data, params, n_policies, (0, n_bars), chunk_bars=chunk, max_trades=0, segment_bars=segment_bars,
                        event_slots=event_slots)
    rows = _cuda.device_array((bt.chunk_bars, n_policies), np.int32)
    sizes = params.branch_sizes

    def run(s, scan=True, marks=None):
        bt.start(s)
        origin = 0
        while origin < n_bars:
            if origin:
                bt.set_origin(origin, s)
            total = rows.shape[0] * rows.shape[1]
            plan_rows_kernel[(total + BLOCK - 1) // BLOCK, BLOCK, s](rows, np.uint64(7), np.int64(origin), sizes[1], sizes[2], sizes[3])
            bt.run_actions(rows, s, marks)
            if scan:
                bt.scan(s)
            origin += bt.chunk_bars

    # the plan generator alone, to subtract (it is not env work)
    def gen_only(s):
        for origin in range(0, n_bars, bt.chunk_bars):
            total = rows.shape[0] * rows.shape[1]
            plan_rows_kernel[(total + BLOCK - 1) // BLOCK, BLOCK, s](rows, np.uint64(7), np.int64(origin), sizes[1], sizes[2], sizes[3])

    ms_gen = _median_ms(gen_only, reps, warmup=1)
    ms_env = _median_ms(lambda s: run(s, scan=False), reps, warmup=1)
    ms = _median_ms(run, reps, warmup=1)
    steps = n_policies * (n_bars - 1)
    passes = {}
    if segment_bars is not None:  # one more run, profiled pass by pass (events between the kernels;
        marks = []  # with the scan, so that the accumulators read below are a full run's)
        run(default_stream(), scan=True, marks=marks)
        default_stream().synchronize()
        for i, name in enumerate(("ms_speculate", "ms_carry", "ms_replay")):
            passes[name] = sum(m[i].elapsed_time(m[i + 1]) for m in marks)
    bt.segment_check()
    if segment_bars is not None:
        passes["carry_exact_fraction"] = bt.segment_exact_bars() / steps
    counts = bt.arena["trade_count"].copy_to_host()
    state = {name: bt.arena[name].copy_to_host() for name, _ in STATE_FIELDS}
    state["metric_accumulators"] = bt.accumulators_to_host()
    return {
        **passes,
        "segment_bars": segment_bars,
        "event_slots": bt.event_slots,
        "state": state,
        "bar_steps_per_s": steps / (max(ms_env - ms_gen, 1e-6) * 1e-3),
        "bar_steps_per_s_with_metrics": steps / (max(ms - ms_gen, 1e-6) * 1e-3),
        "ms_env": ms_env,
        "ms_with_metrics": ms,
        "ms_action_gen": ms_gen,
        "trades": int(counts.sum()),
    }


def policy_backtest(n_bars: int = 3063, n_features: int = 64, reps: int = 5, trunk=None, seed: int = 8) -> dict:
    """A greedy learned policy over an n_bars window: graph == eager (bitwise), then timings.

    The network is the default preset's shape in fp32 (AgentConfig(); trunk= overrides it, e.g. for a quick
    run under the simulator) with its initial weights; the env is EnvParams(). Returns seconds
    per call: eager, first graphed call (capture included), median of `reps` later graphed calls;
    bars/s of the latter; and `identical`, the name of the first output that differs (or None).
    """
    from dataclasses import replace

    from numbarl.config import AgentConfig
    from numbarl.rl.agents.dqn import DQNAgent

    params = EnvParams()
    data = synthetic_market(n_bars + 1, n_features, seed=seed)
    market = data.to_device(params.vol_span, params.vol_horizon_bars)
    cfg = replace(AgentConfig(), batch_size=256, replay_capacity=1024)  # the network is what a backtest runs
    if trunk is not None:
        cfg = replace(cfg, trunk=tuple(trunk))
    agent = DQNAgent(cfg, params.state_dim(n_features), params.branch_sizes, 1, seed, eval_batch=1)
    window = (0, n_bars)
    s = default_stream()

    def call(graph_mode):
        t0 = time.perf_counter()
        agent.reset_eval(s)
        result = backtest(market, window, params, q_fn=agent.scores, n_policies=1, stream=s, graph=graph_mode)
        return result, time.perf_counter() - t0  # backtest() returns host arrays: it has synchronized

    eager, t_eager = call(False)
    first, t_first = call(True)
    times = []
    for _ in range(max(1, reps)):
        again, t = call(True)
        times.append(t)
    differs = None
    for name, a, b in (("pnl", first.pnl, eager.pnl), ("position", first.position, eager.position),
                       ("accumulators", first.accumulators, eager.accumulators),
                       ("pnl (cached graph)", again.pnl, eager.pnl), ("accumulators (cached graph)", again.accumulators, eager.accumulators)):
        if not np.array_equal(a, b, equal_nan=True):
            differs = differs or name
    if not (first.trades.equals(eager.trades) and again.trades.equals(eager.trades)):
        differs = differs or "trades"
    m_eager, m_graph = eager.metrics().values, again.metrics().values
    for name in m_eager:
        if not np.array_equal(np.asarray(m_graph[name]), np.asarray(m_eager[name]), equal_nan=True):
            differs = differs or f"metric {name}"
    t_graph = statistics.median(times)
    return {
        "bars": n_bars, "trunk": list(cfg.trunk), "n_atoms": cfg.n_atoms, "identical": differs is None, "differs": differs,
        "trades": len(eager.trades), "s_eager": t_eager, "s_graph_first": t_first, "s_graph": t_graph,
        "s_graph_all": times, "bars_per_s_graph": (n_bars - 1) / t_graph, "bars_per_s_eager": (n_bars - 1) / t_eager,
    }


def time_cpu(n_envs: int, steps: int, bt_policies: int, bt_bars: int) -> dict:
    params = bench_params()
    data = synthetic_market(max(bt_bars + 10, 20_000), 64, seed=6)
    env = CpuEnv(data, params, n_envs, seed=6)
    env.reset()
    q = np.random.default_rng(6).standard_normal((n_envs, params.n_branches, params.max_actions)).astype(np.float32)
    obs = env.gather()
    acts, pref = epsilon_greedy_ref(q, env.mask, 0.05, 6, env.counter[0])
    env.step(acts, pref)  # compile
    t0 = time.perf_counter()
    for _ in range(steps):
        acts, pref = epsilon_greedy_ref(q, env.mask, 0.05, 6, env.counter[0])
        env.step(acts, pref)
        env.gather(obs)
        env.advance()
    collect = n_envs * steps / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(steps):
        env.step(acts)
    step_only = n_envs * steps / (time.perf_counter() - t0)
    actions = plan_actions_host(params, bt_policies, bt_bars, 6)
    backtest_reference(data, (0, 1000), params, actions[:, :1000])  # compile
    t0 = time.perf_counter()
    backtest_reference(data, (0, bt_bars), params, actions)
    bt = bt_policies * (bt_bars - 1) / (time.perf_counter() - t0)
    return {"step": step_only, "collect": collect, "backtest": bt}


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def _fmt(x: float) -> str:
    return f"{x:.3g}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="numbarl-bench env", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="checks only (works on the CPU simulator)")
    ap.add_argument("--n-envs", type=int, default=65_536)
    ap.add_argument("--graph-steps", type=int, default=20, help="env steps captured per graph")
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--env-bars", type=int, default=200_000)
    ap.add_argument("--bt-policies", type=int, default=4096)
    ap.add_argument("--bt-bars", type=int, default=1_000_000)
    ap.add_argument("--bt-chunk", type=int, default=65_536)
    ap.add_argument("--bt-segment-bars", type=str, default="1024",
                    help="segment bars of the segmented backtest (numbarl/env/backtest_segments.py), or a comma list to "
                         "time several (the first is the headline); 0: time only the one-thread path")
    ap.add_argument("--bt-event-slots", type=int, default=None, help="events recorded per segment (default: segment bars)")
    ap.add_argument("--cpu-envs", type=int, default=4096)
    ap.add_argument("--cpu-steps", type=int, default=50)
    ap.add_argument("--cpu-bt-policies", type=int, default=16)
    ap.add_argument("--cpu-bt-bars", type=int, default=200_000)
    ap.add_argument("--val-bars", type=int, default=3063, help="bars of the learned-policy backtest (default preset validation)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=str, default=None, help="write results to this path")
    args = ap.parse_args(argv)

    sim = simulator()
    results = {"device": device_name(), "host": platform.processor() or platform.machine(), "command": " ".join(["python -m numbarl.bench.env"] + list(argv if argv is not None else sys.argv[1:]))}
    print(f"numbarl env benchmark on {results['device']}")
    checks = [
        ("device env == CPU reference env", check_env(6 if sim else 512, 12 if sim else 40)),
        ("device backtest == CPU reference backtest", check_backtest(3 if sim else 64, 60 if sim else 5000)),
        ("segmented device backtest == CPU reference backtest",
         check_backtest(3 if sim else 64, 60 if sim else 5000, segment_bars=8 if sim else 256)),
    ]
    ok = True
    for name, (passed, detail) in checks:
        ok &= passed
        print(f"  [{'pass' if passed else 'FAIL'}] {name}: {detail}")
    results["checks"] = {name: {"pass": passed, "detail": detail} for name, (passed, detail) in checks}
    if not ok:
        print("checks failed: no timings")
        _write(args.json, results)
        return 1
    if args.check:
        _write(args.json, results)
        return 0
    if sim:
        print("timings need a CUDA GPU (the simulator runs ~10^4 times slower); ran the checks only")
        _write(args.json, results)
        return 0

    pol = policy_backtest(args.val_bars, args.features, args.reps)
    print(
        f"  [{'pass' if pol['identical'] else 'FAIL'}] learned-policy backtest, graph == eager bitwise: "
        f"{pol['bars']} bars, {pol['trades']} trades" + ("" if pol["identical"] else f" ({pol['differs']} differs)")
    )
    results["checks"]["learned-policy backtest graph == eager"] = {"pass": pol["identical"], "detail": pol["differs"]}
    env = time_env(args.n_envs, args.graph_steps, args.features, args.env_bars, args.reps)
    bt = time_backtest(args.bt_policies, args.bt_bars, args.bt_chunk, max(1, args.reps // 2))
    seg_list = [int(x) for x in args.bt_segment_bars.split(",") if int(x) > 0]
    seg_runs = {}
    for seg_bars in seg_list:
        r = time_backtest(args.bt_policies, args.bt_bars, args.bt_chunk, max(1, args.reps // 2), seg_bars, args.bt_event_slots)
        differs = [name for name, want in bt["state"].items() if not np.array_equal(r["state"][name], want, equal_nan=True)]
        print(
            f"  [{'pass' if not differs else 'FAIL'}] segmented backtest ({seg_bars} bars) == one-thread backtest at full size, "
            f"bitwise: final state and metric accumulators of {args.bt_policies} policies x {args.bt_bars:,} bars"
            + (f" ({', '.join(differs)} differ)" if differs else "")
        )
        results["checks"][f"segmented backtest ({seg_bars} bars) == one-thread backtest (full size)"] = {"pass": not differs, "detail": differs}
        ok &= not differs
        r.pop("state")
        seg_runs[seg_bars] = r
    bts = seg_runs[seg_list[0]] if seg_list else None
    bt.pop("state")
    cpu = time_cpu(args.cpu_envs, args.cpu_steps, args.cpu_bt_policies, args.cpu_bt_bars)
    rows = [
        (f"env step, N={args.n_envs} (graph of {args.graph_steps})", "env-steps/s", env["step"], cpu["step"], 1e9),
        ("env collect w/o inference (gather+select+step+gather)", "env-steps/s", env["collect"], cpu["collect"], None),
        ("env step, eager launch", "env-steps/s", env["eager_step"], cpu["step"], None),
        (f"backtest {args.bt_policies} x {args.bt_bars:,} bars, one thread per policy", "bar-steps/s", bt["bar_steps_per_s"], cpu["backtest"], 1e10),
        ("backtest + device metric scan per chunk", "bar-steps/s", bt["bar_steps_per_s_with_metrics"], cpu["backtest"], None),
    ]
    for seg_bars, r in seg_runs.items():
        rows += [
            (f"backtest {args.bt_policies} x {args.bt_bars:,} bars, segments of {seg_bars}", "bar-steps/s",
             r["bar_steps_per_s"], cpu["backtest"], 1e10),
            (f"segmented ({seg_bars}) backtest + device metric scan per chunk", "bar-steps/s", r["bar_steps_per_s_with_metrics"],
             cpu["backtest"], None),
        ]
    rows += [
        (f"backtest with a learned policy, {pol['bars']:,} bars (graphs)", "bars/s", pol["bars_per_s_graph"], pol["bars_per_s_eager"], (pol["bars"] - 1) / 0.1),
    ]
    print(f"\n{'what':<62} {'unit':<12} {'device':>10} {'CPU ref':>10} {'ratio':>8} {'goal':>8}")
    for what, unit, dev, ref, goal in rows:
        print(f"{what:<62} {unit:<12} {_fmt(dev):>10} {_fmt(ref):>10} {_fmt(dev / ref):>8} {(_fmt(goal) if goal else '-'):>8}")
    print(
        f"\nenv: {env['step_us_per_step']:.1f} us per step, {env['collect_us_per_step']:.1f} us per collect step; "
        f"backtest: {bt['ms_env']:.0f} ms ({bt['ms_with_metrics']:.0f} ms with metrics) incl. {bt['ms_action_gen']:.0f} ms of action "
        f"generation (subtracted), {bt['trades']:,} trades; "
        + "".join(f"segmented backtest ({b} bars): {r['ms_env']:.0f} ms ({r['ms_with_metrics']:.0f} ms with metrics; passes: "
                  f"speculate {r['ms_speculate']:.0f} ms, carry {r['ms_carry']:.0f} ms stepping {r['carry_exact_fraction']:.2%} of the bars "
                  f"serially, replay {r['ms_replay']:.0f} ms), "
                  f"{r['trades']:,} trades, {r['event_slots']} event slots per segment; " for b, r in seg_runs.items())
        + f"CPU reference: one core, {args.cpu_envs} envs x {args.cpu_steps} steps, backtest {args.cpu_bt_policies} x {args.cpu_bt_bars:,} bars"
    )
    print(
        f"learned-policy backtest ({pol['bars']:,} bars, 1 policy, trunk {pol['trunk']}, {pol['n_atoms']} atoms; its 'CPU ref' "
        f"column is the eager device loop): {pol['s_graph'] * 1e3:.1f} ms per call with graphs (goal 100 ms), "
        f"{pol['s_graph_first'] * 1e3:.0f} ms for the first call (capture), {pol['s_eager'] * 1e3:.0f} ms eager"
    )
    results.update({"env": env, "backtest": bt, "backtest_segmented": bts, "backtest_segmented_all": {str(b): r for b, r in seg_runs.items()},
                    "cpu": cpu, "policy_backtest": pol, "args": vars(args)})
    results["ratios"] = {"env_step": env["step"] / cpu["step"], "env_collect": env["collect"] / cpu["collect"], "backtest": bt["bar_steps_per_s"] / cpu["backtest"]}
    if bts is not None:
        results["ratios"]["backtest_segmented"] = bts["bar_steps_per_s"] / cpu["backtest"]
    _write(args.json, results)
    return 0 if pol["identical"] and ok else 1


def _write(path, results):
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2, default=float)


if __name__ == "__main__":
    sys.exit(main())
