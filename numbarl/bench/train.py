"""Train-step benchmark (issue 4): numbarl's captured train step against the PyTorch peer.

Checks before it times: one batch's loss and gradients of numbarl and of the PyTorch peer
(same weights, same batch) are compared first. Then, in one run on one GPU:

* numbarl train step (graph replay), fp32 and TF32, with a per-phase breakdown (each phase captured
  as its own graph: sample, target passes, online pass, loss, backward, optimizer);
* PyTorch peer train step, eager and CUDA-graphed (torch.cuda.graphs), fp32 and TF32;
* JAX peer (numbarl.rl.jax_peer; optional, `pip install numbarl[jax]` or jax[cuda12/13]): checked
  against numbarl on loss and gradients like the PyTorch peer, then its jitted train step and
  acting step (forward + greedy, N = n_envs), fp32 and TF32; "jax: not installed" without it;
* collect step (state gather → online forward → action select → env step → replay write) at
  N = n_envs: env-steps/s including inference.

    python -m numbarl.bench.train [--json PATH] [--batch 16384] [--n-envs 16384] [--trunk 512,512]
                                  [--head-pad 0,1,0u,0s]   # the default, then other rows (u: value stream
                                                           # unfused, s: agent.overlap=false)

Default model: 64 features, trunk 2×512, 4 branches, 51 atoms, batch 16,384.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

import numpy as np

from numbarl.cuda import backend


def _market(n_bars: int, n_features: int, seed: int):
    from numbarl.env.market import MarketData

    rng = np.random.default_rng(seed)
    mid = 5000.0 + np.cumsum(rng.choice([-0.25, 0.0, 0.25], size=n_bars, p=[0.3, 0.4, 0.3]))
    spread = 0.25
    sessions = np.repeat(np.arange(max(1, n_bars // 5000)), 5000)[:n_bars]
    sessions = np.concatenate([sessions, np.full(n_bars - len(sessions), sessions[-1] if len(sessions) else 0)])
    return MarketData(
        features=rng.standard_normal((n_bars, n_features)).astype(np.float32),
        mid=mid, bid=mid - spread / 2, ask=mid + spread / 2, high=mid + 0.25, low=mid - 0.25,
        session_id=sessions.astype(np.int32), timestamps=np.arange(n_bars, dtype=np.int64) * 1_000_000_000,
        tick_size=0.25, bars_per_day=5000.0)


def _time_graph(graph, stream, iters: int, repeats: int = 5) -> float:
    """Median ms per replay, timed with CUDA events."""
    from numbarl.cuda.runtime import cuda

    c = cuda()
    for _ in range(3):
        graph.replay(stream)
    stream.synchronize()
    times = []
    for _ in range(repeats):
        start, end = c.event(timing=True), c.event(timing=True)
        start.record(stream)
        for _ in range(iters):
            graph.replay(stream)
        end.record(stream)
        end.synchronize()
        times.append(c.event_elapsed_time(start, end) / iters)
    return statistics.median(times)


def kernel_name(mangled: str) -> str:
    """Readable kernel name: the function of a numba kernel's Itanium-mangled name, others cut short."""
    if mangled.startswith("_ZN"):
        i, parts = 3, []
        while i < len(mangled) and mangled[i].isdigit():
            j = i
            while mangled[j].isdigit():
                j += 1
            n = int(mangled[i:j])
            parts.append(mangled[j:j + n])
            i = j + n
        if parts:
            return parts[-1]
    return mangled[:90]


def exit_after_cupti(code: int):
    """Leave the process with `code` once everything is written: after a CUPTI session (torch.profiler) the
    interpreter's teardown of the CUDA libraries can abort ("double free", seen on the H200)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def kernel_profile(step_fn, s, steps: int = 10) -> dict:
    """GPU time per kernel of one step (CUPTI through torch.profiler; the step runs eagerly, so each
    launch is timed alone): {kernel: {"calls": per step, "us": per step}}, empty without torch or a CUDA device
    (the simulator: CUPTI has nothing to trace)."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    step_fn(s)
    s.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step_fn(s)
        s.synchronize()
    out: dict = {}
    for evt in prof.events():
        dev = str(getattr(evt, "device_type", ""))
        if "CUDA" not in dev:
            continue
        us = getattr(evt, "device_time", None)
        if us is None:
            us = getattr(evt, "cuda_time", 0.0)
        name = kernel_name(evt.name)
        slot = out.setdefault(name, {"calls": 0.0, "us": 0.0})
        slot["calls"] += 1.0 / steps
        slot["us"] += float(us) / steps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us"]))


def _relerr(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run(args) -> dict:
    from numbarl.config import AgentConfig
    from numbarl.cuda import graph as cuda_graph
    from numbarl.cuda.runtime import device_name, stream
    from numbarl.env.device import DeviceEnv
    from numbarl.env.params import EnvParams
    from numbarl.rl.agents.base import make_agent

    s = stream()
    trunk = tuple(int(w) for w in args.trunk.split(","))
    params = EnvParams()
    market = _market(args.bars, args.features, args.seed).to_device(params.vol_span, params.vol_horizon_bars)
    results = {"device": device_name(), "batch": args.batch, "n_envs": args.n_envs, "trunk": trunk,
               "features": args.features, "branches": params.branch_sizes, "n_atoms": 51, "numbarl": {}, "torch": {}}
    pads = head_pads(getattr(args, "head_pad", "0"))
    results["head_pad"] = pads[0]
    for compute, pad in [(c, q) for c in ("fp32", "tf32") for q in pads]:
        key = compute if pad == pads[0] else f"{compute}.pad{pad}"  # the first padding is the table's row
        q, fuse, overlap = int(pad.rstrip("us")), "u" not in pad, "s" not in pad
        if not fuse and AgentConfig(compute=compute, head_pad=q).head_pad_multiple == 1:
            continue  # an unpadded head fuses nothing (e.g. head_pad=1): the row would repeat Q's
        cfg = AgentConfig(trunk=trunk, batch_size=args.batch, replay_capacity=args.n_envs * 64, compute=compute,
                          head_pad=q, head_fuse_value=fuse, overlap=overlap)
        env = DeviceEnv(market, params, args.n_envs, seed=args.seed)
        agent = make_agent(cfg, env.state_dim, params.branch_sizes, args.n_envs, args.seed, epsilon=(1.0, 0.05, 100))
        env.reset(args.seed, s)
        steps = agent.step_functions(env)  # the run's own step functions
        collect = cuda_graph.capture(steps["collect"], s)
        for _ in range(40):
            collect.replay(s)
        collect_ms = _time_graph(collect, s, iters=50)
        train = cuda_graph.capture(steps["train"], s)
        train_ms = _time_graph(train, s, iters=50)
        r = {"train_step_ms": train_ms, "collect_step_ms": collect_ms,
             "env_steps_per_s_with_inference": args.n_envs / (collect_ms * 1e-3)}
        # per-phase breakdown: the agent's own train phases, each captured alone (inputs are
        # whatever the last step left)
        r["phases_ms"] = {name: _time_graph(cuda_graph.capture(_own_step(agent, fn), s), s, iters=50)
                          for name, fn in agent.train_phases()}
        if getattr(args, "profile", False):
            r["kernels_train"] = kernel_profile(steps["train"], s)
            r["kernels_collect"] = kernel_profile(steps["collect"], s)
        results["numbarl"][key] = r
        if compute == "fp32" and pad == pads[0]:
            results["check"] = _check_against_peer(agent, s)
            if results["check"].get("available"):
                results["torch"] = _time_peer(agent, s)
            results["jax"] = jax_peer_results(agent, s, args.n_envs)  # checked, then timed
        elif compute == "fp32":  # another padding: the same peer check, not timed again
            results[f"check.pad{pad}"] = _check_against_peer(agent, s)
        del agent, env
    return results


# the train phases from the passes to the backward, in program order (agent.overlap runs TARGETS and ONLINE as one
# phase, "forward")
_TO_BACKWARD = ("targets", "online", "forward", "loss", "backward")


def _peer_batch(agent, s):
    b = agent.replay.batch
    host = {"obs": b.obs.copy_to_host(stream=s), "next_obs": b.next_obs.copy_to_host(stream=s),
            "actions": b.action.copy_to_host(stream=s), "rewards": b.reward.copy_to_host(stream=s),
            "dones": b.done.copy_to_host(stream=s), "discounts": b.discount.copy_to_host(stream=s)}
    s.synchronize()
    return host


def _own_step(agent, fn):
    """A phase run alone opens its own gradient-ledger step (as train_step does for the whole), so
    the capture's warm-up run and the captured run make the same overwrite/accumulate choice."""
    def step(stream):
        agent.store.begin_step()
        fn(stream)
        agent.store.end_step()
    step.__name__ = getattr(fn, "__name__", "phase")
    return step


def _check_against_peer(agent, s) -> dict:
    try:
        import torch  # noqa: F401
    except ImportError:
        return {"available": False, "why": "torch is not installed"}
    from numbarl.rl.torch_peer import PeerSpec, TorchPeer, batch_to_torch

    # one fresh sample, then the train step's phases up to the backward (no optimizer step)
    phases = dict(agent.train_phases())
    phases["sample"](s)
    batch = _peer_batch(agent, s)
    params = agent.store.to_host("params")
    target = agent.store.to_host("target")
    agent.store.begin_step()
    for name in _TO_BACKWARD:
        if name in phases:
            phases[name](s)
    agent.store.end_step()
    loss = float(agent.loss.loss.copy_to_host(stream=s)[0])
    grads = agent.store.to_host("grads")
    cfg = agent.cfg
    peer = TorchPeer(PeerSpec.from_numbarl(agent.trunk, agent.head, agent.store), params, target, lr=cfg.lr,
                     max_grad_norm=cfg.max_grad_norm)
    p_loss, _, p_grads = peer.loss_and_grads(batch_to_torch(batch))
    errs = {name: _relerr(grads[name], p_grads[name]) for name in p_grads}
    return {"available": True, "loss_numbarl": loss, "loss_torch": p_loss,
            "loss_relerr": abs(loss - p_loss) / max(abs(p_loss), 1e-30),
            "grad_relerr_max": max(errs.values()), "grad_relerr": errs}


def _time_peer(agent, s) -> dict:
    from numbarl.rl.torch_peer import PeerSpec, TorchPeer, batch_to_torch, time_train_step

    cfg = agent.cfg
    batch = batch_to_torch(_peer_batch(agent, s))
    params = agent.store.to_host("params")
    out = {}
    for mode in ("eager", "graphed"):
        for tf32 in (False, True):
            peer = TorchPeer(PeerSpec.from_numbarl(agent.trunk, agent.head, agent.store), params, lr=cfg.lr,
                             max_grad_norm=cfg.max_grad_norm, capturable=(mode == "graphed"))
            r = time_train_step(peer, batch, mode=mode, tf32=tf32, iters=50)
            out[f"{mode}_{'tf32' if tf32 else 'fp32'}"] = r["ms_median"]
    return out


# ---------------------------------------------------------------------------------------------
# the JAX peer (numbarl.rl.jax_peer): checked against numbarl, then its jitted steps timed
# ---------------------------------------------------------------------------------------------
JAX_LOSS_RTOL = 1e-5  # the GPU peer tests' bounds (tests/rl/test_gpu_c51.py): loss relative error,
JAX_GRAD_RTOL = 1e-4  # and norm-relative error of every gradient


def jax_peer_results(agent, s, n_envs: int) -> dict:
    """The JAX peer's row of the benchmark: `_check_against_jax`, then (only if it agrees, and
    only on a GPU backend) `_time_jax`. Without jax: {"available": False, "why": ...}."""
    try:
        from numbarl.rl.jax_peer import import_jax

        jax = import_jax()
    except ImportError:
        return {"available": False, "why": "jax: not installed (pip install numbarl[jax]; on a CUDA host "
                                           "pip install \"jax[cuda12]\" or \"jax[cuda13]\")"}
    out = {"available": True, "version": jax.__version__, "backend": jax.default_backend(),
           "jax_device": str(jax.devices()[0])}
    out["check"] = _check_against_jax(agent, s)
    if not out["check"]["agrees"]:
        out["why"] = (f"jax: disagrees with numbarl (loss rel {out['check']['loss_relerr']:.1e} > {JAX_LOSS_RTOL:g} "
                      f"or grad rel {out['check']['grad_relerr_max']:.1e} > {JAX_GRAD_RTOL:g}): not timed")
    elif out["backend"] not in ("gpu", "cuda"):
        out["why"] = (f"jax: backend {out['backend']!r}, not the GPU (jax installed without CUDA: pip install "
                      f"\"jax[cuda12]\" or \"jax[cuda13]\"): checked, not timed")
    else:
        out.update(_time_jax(agent, s, n_envs))
    return out


def _jax_peer(agent, params, target):
    from numbarl.rl.jax_peer import JaxPeer, PeerSpec

    cfg = agent.cfg
    periodic = getattr(cfg, "target_update", "periodic") == "periodic"
    return JaxPeer(PeerSpec.from_numbarl(agent.trunk, agent.head, agent.store), params, target, lr=cfg.lr,
                   betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                   max_grad_norm=cfg.max_grad_norm, target_tau=1.0 if periodic else cfg.tau,
                   target_period=cfg.target_period if periodic else 1)


def _check_against_jax(agent, s) -> dict:
    """Loss and gradients of one fresh batch, numbarl vs the JAX peer (fp32), as `_check_against_peer`.
    The double-DQN a* is numbarl's (first max of its next-obs Q over the available actions), so a
    float32 near-tie cannot pick a different target row; how often the peer's own argmax agrees is
    reported beside it."""
    from numbarl.rl.jax_peer import batch_to_jax

    phases = dict(agent.train_phases())
    phases["sample"](s)
    batch = _peer_batch(agent, s)
    lock_aware = bool(getattr(agent.cfg, "lock_aware_target", False))
    if lock_aware:  # the loss then maximises over the env's mask of next_obs
        batch["next_mask"] = agent.replay.batch.next_mask.copy_to_host(stream=s)
    params, target = agent.store.to_host("params"), agent.store.to_host("target")
    agent.store.begin_step()
    for name in _TO_BACKWARD:
        if name in phases:
            phases[name](s)
    agent.store.end_step()
    loss = float(agent.loss.loss.copy_to_host(stream=s)[0])
    next_q = agent.head.outputs("next").q.copy_to_host(stream=s)
    s.synchronize()
    grads = agent.store.to_host("grads")
    if lock_aware:
        next_q = np.where(batch["next_mask"] != 0, next_q, -np.inf)
    a_star = np.stack([np.argmax(next_q[:, k, :n], axis=1) for k, n in enumerate(agent.branch_sizes)], axis=1)

    peer = _jax_peer(agent, params, target)
    jb = batch_to_jax(batch)
    p_loss, _, p_grads = peer.loss_and_grads(jb, next_actions=a_star)
    own = np.asarray(peer.act(jb["next_obs"], jb.get("next_mask")))
    errs = {name: _relerr(p_grads[name], grads[name]) for name in p_grads}
    loss_relerr = abs(p_loss - loss) / max(abs(loss), 1e-30)
    return {"loss_numbarl": loss, "loss_jax": p_loss, "loss_relerr": loss_relerr,
            "grad_relerr_max": max(errs.values()), "grad_relerr": errs,
            "argmax_agreement": float(np.mean(own == a_star)),
            "agrees": bool(loss_relerr < JAX_LOSS_RTOL and max(errs.values()) < JAX_GRAD_RTOL)}


def _time_jax(agent, s, n_envs: int) -> dict:
    """ms per jitted train step (the last sampled batch, the agent's optimizer settings) and per
    acting step (forward + greedy per branch on n_envs observations), fp32 and TF32."""
    from numbarl.rl.jax_peer import batch_to_jax, import_jax, time_act, time_train_step

    jax = import_jax()
    batch = batch_to_jax(_peer_batch(agent, s))
    params, target = agent.store.to_host("params"), agent.store.to_host("target")
    obs = jax.device_put(np.random.default_rng(0).standard_normal((n_envs, agent.state_dim)).astype(np.float32))
    out = {}
    for tf32 in (False, True):
        prec = "tf32" if tf32 else "fp32"
        train = time_train_step(_jax_peer(agent, params, target), batch, tf32=tf32, iters=50)
        act = time_act(_jax_peer(agent, params, target), obs, tf32=tf32, iters=50)
        out[f"train_{prec}"], out[f"act_{prec}"] = train["ms_median"], act["ms_median"]
        out[f"compile_s_train_{prec}"], out[f"compile_s_act_{prec}"] = train["compile_s"], act["compile_s"]
    return out


def jax_table_lines(results: dict) -> list:
    """The JAX peer's lines of the table (or why it is absent)."""
    j = results.get("jax") or {}
    if not j.get("available") or "train_fp32" not in j:
        chk = j.get("check")
        lines = [f"JAX peer: {j.get('why', 'jax: not run')}"]
        if chk:
            lines.append(f"check vs JAX peer: loss {chk['loss_numbarl']:.6f} vs {chk['loss_jax']:.6f} "
                         f"(rel {chk['loss_relerr']:.1e}), max grad rel err {chk['grad_relerr_max']:.1e}")
        return lines
    chk, nb = j["check"], results["numbarl"]
    return [
        (f"check vs JAX peer (jax {j['version']}, {j['jax_device']}): loss {chk['loss_numbarl']:.6f} vs "
         f"{chk['loss_jax']:.6f} (rel {chk['loss_relerr']:.1e}), max grad rel err {chk['grad_relerr_max']:.1e}, "
         f"own double-DQN argmax agrees on {100 * chk['argmax_agreement']:.2f}%"),
        f"{'JAX peer, jit':<44}{j['train_fp32']:>10.3f}{j['train_tf32']:>10.3f}",
        *(f"speed-up {prec}: {j[f'train_{prec}'] / nb[prec]['train_step_ms']:.2f}x vs JAX jit" for prec in ("fp32", "tf32")),
        (f"{'JAX acting step (forward + greedy), N = ' + str(results['n_envs']):<44}{j['act_fp32']:>10.3f}"
         f"{j['act_tf32']:>10.3f}"),
    ]


def head_pads(text) -> list[str]:
    """--head-pad's rows: agent.head_pad per row, with a "u" for agent.head_fuse_value = false (the value stream
    unfused; a padded head fuses it by default) and an "s" for agent.overlap = false (the train step on one stream),
    the first the table's (e.g. "0,1,8,0u,0s": the default, which is automatic and fused under TF32, unpadded,
    padded to a multiple of 8 and fused, the default padding unfused, the default on one stream).
    Before the twenty-first session a plain padded row was unfused: its bench JSON's "tf32.pad8" is another layout."""
    pads = [x.strip() for x in str(text).split(",")]
    if not all(re.fullmatch(r"\d+u?s?", p) for p in pads) or len(set(pads)) != len(pads):
        raise SystemExit(f"error: --head-pad takes distinct integers >= 0, each optionally followed by u "
                         f"(the value stream unfused), then s (one stream), comma-separated (got {text!r})")
    if not pads[0].isdigit():
        raise SystemExit(f"error: --head-pad's first row is the table's, fp32 and TF32: not an unfused or one-stream "
                         f"one (got {text!r})")
    if any(re.fullmatch(r"0*1us?", p) for p in pads):
        raise SystemExit(f"error: --head-pad 1u: an unpadded head has no value stream to unfuse; 1 is the "
                         f"same row (got {text!r})")
    return pads


def pad_lines(results: dict) -> list[str]:
    """One line per extra --head-pad value: its train and collect steps against the first value's."""
    nb, lines = results["numbarl"], []
    for key in [k for k in nb if ".pad" in k]:
        prec, pad = key.split(".pad")
        base, r = nb[prec], nb[key]
        chk = results.get(f"check.pad{pad}", {}) if prec == "fp32" else {}  # the peer check runs in fp32 only
        peer = (f", vs PyTorch loss rel {chk['loss_relerr']:.1e} grad rel {chk['grad_relerr_max']:.1e}"
                if chk.get("available") else "")
        what = (f"agent.head_pad={pad.rstrip('us')}" + (" head_fuse_value=false" if "u" in pad else "")
                + (" overlap=false" if "s" in pad else ""))
        lines.append(f"{what} ({prec}): train {r['train_step_ms']:.3f} ms "
                     f"({r['train_step_ms'] - base['train_step_ms']:+.3f} vs head_pad={results['head_pad']}), collect "
                     f"{r['collect_step_ms']:.3f} ms ({r['collect_step_ms'] - base['collect_step_ms']:+.3f}){peer}")
    return lines


def table(results: dict) -> str:
    lines = [f"numbarl train-step benchmark on {results['device']}",
             f"model: {results['features']} features, trunk {results['trunk']}, branches {results['branches']}, "
             f"51 atoms, batch {results['batch']}, n_envs {results['n_envs']}"]
    chk = results.get("check", {})
    if chk.get("available"):
        lines.append(f"check vs PyTorch peer: loss {chk['loss_numbarl']:.6f} vs {chk['loss_torch']:.6f} "
                     f"(rel {chk['loss_relerr']:.1e}), max grad rel err {chk['grad_relerr_max']:.1e}")
    lines.append(f"{'':<44}{'fp32 ms':>10}{'tf32 ms':>10}")
    nb = results["numbarl"]
    lines.append(f"{'numbarl train step (graph)':<44}{nb['fp32']['train_step_ms']:>10.3f}{nb['tf32']['train_step_ms']:>10.3f}")
    t = results.get("torch") or {}
    if t:
        lines.append(f"{'PyTorch peer, eager':<44}{t['eager_fp32']:>10.3f}{t['eager_tf32']:>10.3f}")
        lines.append(f"{'PyTorch peer, CUDA-graphed':<44}{t['graphed_fp32']:>10.3f}{t['graphed_tf32']:>10.3f}")
        for prec in ("fp32", "tf32"):
            lines.append(f"speed-up {prec}: {t[f'eager_{prec}'] / nb[prec]['train_step_ms']:.2f}x vs eager, "
                         f"{t[f'graphed_{prec}'] / nb[prec]['train_step_ms']:.2f}x vs graphed")
    lines += jax_table_lines(results)
    for prec in ("fp32", "tf32"):
        lines.append(f"collect step ({prec}) {nb[prec]['collect_step_ms']:.3f} ms -> "
                     f"{nb[prec]['env_steps_per_s_with_inference']:.3e} env-steps/s incl. inference")
    lines += pad_lines(results)
    lines.append("phases (fp32 / tf32, ms, each captured alone):")
    for name in nb["fp32"]["phases_ms"]:
        lines.append(f"  {name:<44}{nb['fp32']['phases_ms'][name]:>8.3f}{nb['tf32']['phases_ms'][name]:>8.3f}")
    for prec in ("fp32", "tf32"):
        for what in ("train", "collect"):
            prof = nb[prec].get(f"kernels_{what}")
            if not prof:
                continue
            total = sum(v["us"] for v in prof.values())
            lines.append(f"kernels of one eager {what} step ({prec}): {total:.1f} us of GPU time")
            for name, v in prof.items():
                lines.append(f"  {name[:60]:<60}{v['calls']:>6.1f} x{v['us']:>10.1f} us{100 * v['us'] / max(total, 1e-9):>6.1f}%")
    return "\n".join(lines)


def main(argv=None) -> int:
    backend.select()
    p = argparse.ArgumentParser(prog="numbarl-bench train", description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--batch", type=int, default=16384, help="transitions per train step (default: %(default)s)")
    p.add_argument("--n-envs", type=int, default=16384, help="parallel envs of the collect step (default: %(default)s)")
    p.add_argument("--trunk", default="512,512", help="hidden widths of the trunk MLP (default: %(default)s)")
    p.add_argument("--features", type=int, default=64, help="features per bar (default: %(default)s)")
    p.add_argument("--bars", type=int, default=200_000, help="bars of the synthetic market the env steps over (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed (default: %(default)s)")
    p.add_argument("--profile", action="store_true", help="also list GPU time per kernel (needs torch)")
    p.add_argument("--head-pad", default="0", metavar="Q[,Q...]",
                   help="agent.head_pad per numbarl row (0: the automatic default; a trailing u: with "
                        "agent.head_fuse_value=false; then a trailing s: with agent.overlap=false, the train step on "
                        "one stream); the first is the table's, each other one a line of its train and collect steps "
                        "against it (default: %(default)s)")
    args = p.parse_args(argv)
    head_pads(args.head_pad)  # a bad value stops here, before the GPU work
    if backend.simulator_active():
        print("error: numbarl-bench train needs a CUDA GPU: no GPU was found (or --simulate was given), and "
              "the simulator cannot time kernels; run it on a GPU machine (docs/BENCHMARKS.md). Nothing was written.",
              file=sys.stderr)
        return 2
    results = run(args)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    if args.profile:
        exit_after_cupti(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
