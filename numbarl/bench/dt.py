"""Decision Transformer throughput benchmark (issue 16): numbarl's DT train step and acting step against PyTorch.

    python -m numbarl.bench.dt [--json PATH] [--preset default] [--compute fp32,tf32] [--n-envs N]
                               [--context L] [--embed E] [--heads H] [--layers n] [--batch B]
                               [--rollout T] [--updates K] [--val-bars W] [--profile]

Shapes: the preset's (default: ``default`` with ``agent.kind=dt``), the agent built as the trainer
builds it (make_agent with eval_batch = 1, the env's state_dim and branches): B = agent.dt_batch
windows of L = agent.dt_context steps (3L tokens each: B·3L token rows, B·L predicted actions),
agent.dt_embed / dt_heads / dt_layers, agent.lr, AdamW and agent.max_grad_norm; T = agent.dt_rollout
collect steps of N = train.n_envs envs per dataset, K = agent.dt_updates steps per dataset; a
synthetic market of --features features (the state token holds those, agent.dt_portfolio off).

Check before it times (fp32): on the token batch the first update left, numbarl's forward, loss
and backward (eager, no optimizer step) against the PyTorch peer (numbarl.rl.torch_peer_dt,
float64, same weights, same tokens and actions): "agrees" = loss rel ≤ 1e-5 and every parameter
gradient norm-relative ≤ 1e-4. The PyTorch DT timed below (this file's ``TorchDT``: SDPA attention,
F.cross_entropy, AdamW) is checked against the same peer in float64 (loss and gradients ≤ 1e-9), so
the timings compare one computation. A disagreement is printed and the exit status is 1.

What each number includes:

* numbarl train step (one graph): forward of B·3L token rows, the branch cross-entropy, backward,
  AdamW with the global-norm clip, the step's stats (``DTAgent.train_window_batch``, tokens already
  built). samples/s = B·L / step; tokens/s = B·3L / step.
* numbarl update (one graph, as the trainer replays it): the return-to-go scan and normalization,
  then K × (window sampling, token building, the train step).
* numbarl collect step (one graph): gather, the behavior policy, env step, dataset write (no network).
  iteration = T collect + the update: env-steps/s incl. training = T·N / iteration.
* numbarl acting (``DTAgent.scores``, one graph): each policy's history pushed one bar, its 3L
  tokens built, the forward of P·3L rows, the newest state token's scores. P = 1 (the trainer's
  validation backtest: its per-bar cost) and P = N (env-steps/s of acting N envs).
* numbarl validation backtest (P = 1, --val-bars bars, exactly the trainer's ``evaluate``:
  reset_eval, then ``backtest(q_fn=agent.scores)`` as captured bar-step graphs): seconds of the
  first call (capture included) and of a later call (cached graph), host wall clock.
* --profile (GPU only, needs torch): GPU time per kernel of one P = 1 acting call and of one train
  step, each launched eagerly (numbarl/bench/train.py's ``kernel_profile``): which kernels make up
  the validation's per-bar time.
* PyTorch DT: the same train step (forward, loss, backward, clip_grad_norm_, AdamW) eager and as
  one torch.cuda graph (AdamW(capturable=True)); its acting step = forward of P·3L rows (no_grad)
  + the newest state token's logits, P = N (no history push, no token build: those are numbarl's).

Timing: CUDA events (numbarl through numba, PyTorch through torch.cuda), warm-up first, median of
--reps repetitions of --iters calls. Under the numba simulator (no GPU) everything runs with host
wall-clock timing at whatever tiny shapes are given: a smoke test, not a measurement.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import numpy as np

from numbarl.bench.ppo import NumbarlPPO, _market, _relerr, _time_numba, _time_torch, row_writer
from numbarl.cuda import backend

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
TORCH_VS_PEER_RTOL = 1e-9  # the timed PyTorch DT against the peer, both float64


# ---------------------------------------------------------------------------------------------
# the PyTorch DT (what a PyTorch user writes: nanoGPT's blocks, SDPA, F.cross_entropy, AdamW)
# ---------------------------------------------------------------------------------------------
def torch_dt_logits(P: dict, tokens, net):
    """logits [B·3L, W] of numbarl's DT network `net` (shapes, names) with parameters P {numbarl name:
    tensor, weights [in, out]} on tokens [B·3L, F]: embed → pre-LN causal blocks → ln_f → head."""
    import torch.nn.functional as F

    T, E, H = net.n_tokens, net.dim, net.n_heads
    d = E // H
    B = tokens.shape[0] // T
    name = net.name
    act = {"relu": F.relu, "silu": F.silu}[net.activation]

    def linear(h, prefix):
        return h @ P[f"{prefix}.w"] + P[f"{prefix}.b"]

    def layernorm(h, prefix):
        return F.layer_norm(h, (E,), P[f"{prefix}.gamma"], P[f"{prefix}.beta"], eps=1e-5)

    h = linear(tokens, f"{name}.embed")
    for i in range(net.n_layers):
        blk = f"{name}.block{i}"
        qkv = linear(layernorm(h, f"{blk}.ln1"), f"{blk}.attn.qkv").view(B, T, 3, H, d)
        q, k, v = (qkv[:, :, j].transpose(1, 2) for j in range(3))  # [B, H, T, d]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale 1/sqrt(d), as numbarl's
        h = h + linear(o.transpose(1, 2).reshape(B * T, E), f"{blk}.attn.out")
        h = h + linear(act(linear(layernorm(h, f"{blk}.ln2"), f"{blk}.fc1")), f"{blk}.fc2")
    return linear(layernorm(h, f"{name}.ln_f"), f"{name}.head")


def torch_dt_loss(logits, actions, branch_sizes):
    """Σ_k mean cross-entropy of branch k at the state tokens (numbarl/rl/losses/dt.py): logits
    [B·3L, W], actions [B, L, n_b] int64."""
    import torch.nn.functional as F

    B, L, _ = actions.shape
    state = logits.view(B, L, 3, -1)[:, :, 1, :]  # [B, L, W]: the state tokens
    loss, o = 0.0, 0
    for k, n in enumerate(branch_sizes):
        loss = loss + F.cross_entropy(state[:, :, o:o + n].reshape(B * L, n), actions[:, :, k].reshape(-1))
        o += n
    return loss


class TorchDT:
    """Parameters (numbarl's values), AdamW (decay on the tensors numbarl decays), the train step on a
    fixed token batch and the acting forward."""

    def __init__(self, agent, params: dict, tokens, actions, device, dtype=None, capturable: bool = False):
        import torch

        cfg = agent.cfg
        dtype = dtype or torch.float32
        self.agent, self.net, self.sizes = agent, agent.net, agent.branch_sizes
        self.P = {k: torch.nn.Parameter(torch.as_tensor(np.asarray(v, np.float64), dtype=dtype, device=device))
                  for k, v in params.items()}
        decay = {n for n, s in agent.store.specs.items() if s.decay}
        groups = [{"params": [p for n, p in self.P.items() if n in decay], "weight_decay": cfg.weight_decay},
                  {"params": [p for n, p in self.P.items() if n not in decay], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr,
                                     betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, capturable=capturable)
        self.max_grad_norm = cfg.max_grad_norm
        self.tokens = torch.as_tensor(np.asarray(tokens), dtype=dtype, device=device)  # [B·3L, F]
        self.actions = torch.as_tensor(np.asarray(actions, np.int64), device=device)  # [B, L, n_b]
        self.graph = None

    def loss(self):
        return torch_dt_loss(torch_dt_logits(self.P, self.tokens, self.net), self.actions, self.sizes)

    def train_step(self):
        import torch

        self.opt.zero_grad(set_to_none=True)
        loss = self.loss()
        loss.backward()
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(list(self.P.values()), self.max_grad_norm)
        self.opt.step()
        return loss.detach()

    def capture(self):
        """torch.cuda.graph of one train step (the PyTorch docs' whole-network capture: warm-up on a
        side stream, grads None before capture)."""
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.train_step()
        torch.cuda.current_stream().wait_stream(side)
        self.opt.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.train_step()

    def act(self, tokens):
        """The newest state token's logits of each of P windows [P, W] (tokens [P·3L, F], no_grad)."""
        import torch

        with torch.no_grad():
            logits = torch_dt_logits(self.P, tokens, self.net)
            return logits.view(-1, self.net.n_tokens, logits.shape[1])[:, -2, :]


# ---------------------------------------------------------------------------------------------
# numbarl
# ---------------------------------------------------------------------------------------------
class NumbarlDT(NumbarlPPO):
    """The env, the agent (built as the trainer builds it) and its graphs, replayed as the trainer
    does (the PPO bench's rig: `make_agent` builds whichever agent.kind the config names), and an
    acting twin of the same weights with eval_batch = N (the trainer's agent acts for P = 1)."""

    def __init__(self, cfg, params, market, n_envs: int, seed: int, s):
        super().__init__(cfg, params, market, n_envs, seed, s)
        from numbarl.cuda.runtime import cuda
        from numbarl.rl.agents.base import make_agent

        c = cuda()
        self.params, self.market, self.n_envs = params, market, int(n_envs)
        self.actor = make_agent(cfg, self.env.state_dim, params.branch_sizes, n_envs, seed, eval_batch=n_envs)
        shape = (len(params.branch_sizes), max(params.branch_sizes))
        self.act_out = c.device_array((n_envs,) + shape, np.float32)
        self.obs1 = c.device_array((1, self.env.state_dim), np.float32)
        self.act1_out = c.device_array((1,) + shape, np.float32)

    def sync_actor(self):
        """The acting twin gets the trained agent's weights; obs1 the first env's observation."""
        self.actor.store.load(self.agent.store.to_host("params"))
        self.obs1.copy_to_device(self.env.arena["obs"][:1], stream=self.s)
        self.s.synchronize()

    def act_n(self, stream):
        self.actor.scores(self.env.arena["obs"], self.act_out, stream)

    def act_1(self, stream):
        self.agent.scores(self.obs1, self.act1_out, stream)

    @property
    def actor_tokens(self) -> np.ndarray:
        """The N policies' token rows of the last acting call [N·3L, F] (the PyTorch act's input)."""
        out = self.actor.eval_state["tokens"].copy_to_host(stream=self.s)
        self.s.synchronize()
        return out


def _numbarl_rows(nb: NumbarlDT, cfg, n_envs: int, args, s) -> dict:
    """Timings of one agent whose first iteration already ran (every trainer graph is captured)."""
    from numbarl.bench.train import kernel_profile
    from numbarl.cuda import graph as cuda_graph
    from numbarl.cuda.runtime import simulator

    a, T = nb.agent, nb.agent.T
    it_ms = _time_numba(nb.iteration, s, max(1, args.iters // 4), args.reps)
    collect, update = nb.graphs["collect"], nb.graphs["update"]
    collect_ms = _time_numba(lambda: collect.replay(s), s, max(1, args.iters * T), args.reps)
    update_ms = _time_numba(lambda: update.replay(s), s, args.iters, args.reps)
    step = cuda_graph.capture(lambda st: a.train_window_batch(st, last=False), s)
    train_ms = _time_numba(lambda: step.replay(s), s, max(1, args.iters * a.K), args.reps)
    nb.sync_actor()
    act = cuda_graph.capture(nb.act_n, s)
    act_ms = _time_numba(lambda: act.replay(s), s, args.iters, args.reps)
    act1 = cuda_graph.capture(nb.act_1, s)
    act1_ms = _time_numba(lambda: act1.replay(s), s, args.iters, args.reps)
    a.reset_eval(s)
    samples, tokens = a.B * a.L, a.B * 3 * a.L
    out = {"train_step_ms": train_ms, "update_ms": update_ms, "collect_step_ms": collect_ms, "iteration_ms": it_ms,
           "act_ms": act_ms, "act_p1_ms": act1_ms,
           "train_samples_per_s": samples / (train_ms / 1e3), "train_tokens_per_s": tokens / (train_ms / 1e3),
           "act_env_steps_per_s": n_envs / (act_ms / 1e3),
           "env_steps_per_s_incl_update": T * n_envs / (it_ms / 1e3), "update_share": update_ms / it_ms}
    if args.profile and not simulator():
        out["kernels_act_p1"] = kernel_profile(nb.act_1, s)
        out["kernels_train_step"] = kernel_profile(lambda st: a.train_window_batch(st, last=False), s)
        a.reset_eval(s)
    return out


def validation_rows(nb: NumbarlDT, val_bars: int, s) -> dict:
    """The trainer's validation backtest (P = 1, bar-step graphs) over val_bars bars: first call
    (graph capture included) and a later call, host wall clock."""
    from numbarl.env.backtest import GRAPH_BARS, backtest

    a, market = nb.agent, nb.market
    window = (0, int(val_bars))

    def call():
        t0 = time.perf_counter()
        a.reset_eval(s)
        r = backtest(market, window, nb.params, q_fn=a.scores, n_policies=1, stream=s)
        return r, time.perf_counter() - t0  # backtest() returns host arrays: it has synchronized

    _, first = call()
    r, later = call()
    bars = window[1] - window[0]
    return {"bars": bars, "graph_bars": GRAPH_BARS, "s_first": first, "s_cached": later,
            "ms_per_bar_cached": later * 1e3 / max(bars, 1), "trades": len(r.trades)}


# ---------------------------------------------------------------------------------------------
# the check: numbarl vs the PyTorch peer on one batch, same weights
# ---------------------------------------------------------------------------------------------
def check_against_peer(agent, s) -> dict:
    """numbarl's forward + loss + backward (eager, no optimizer step) on the token batch in the work
    buffers, against the PyTorch peer in float64; then the timed PyTorch DT against the same peer."""
    try:
        import torch
    except ImportError:
        return {"available": False, "why": "torch is not installed"}
    from numbarl.rl.torch_peer_dt import dt_loss_and_grads

    w = agent.work
    params = agent.store.to_host("params")
    tokens = w["tokens"].copy_to_host(stream=s)
    actions = w["mb_actions"].copy_to_host(stream=s)
    agent.store.begin_step()
    logits = agent.net.forward(w["tokens"], s, tag="train")
    agent.loss.apply({"logits": logits, "actions": w["mb_actions"]}, {"logits": agent.loss.grad("logits")}, s,
                     ledger=agent.store)
    agent.net.backward(agent.loss.grad("logits"), s, tag="train")
    agent.store.end_step()
    s.synchronize()
    loss = float(agent.loss.loss.copy_to_host(stream=s)[0])
    grads = agent.store.to_host("grads")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    peer = dt_loss_and_grads(agent.net, params, tokens, actions, dtype="float64", device=device)
    errs = {name: _relerr(grads[name], peer["grads"][name]) for name in peer["grads"]}
    # the PyTorch DT this file times, in float64, against the same peer
    tdt = TorchDT(agent, params, tokens, actions, device, dtype=torch.float64)
    t_loss = tdt.loss()
    t_loss.backward()
    t_errs = {name: _relerr(p.grad.detach().cpu().numpy(), peer["grads"][name]) for name, p in tdt.P.items()}
    t_loss = float(t_loss.detach().cpu())
    out = {"available": True, "rows": int(tokens.shape[0]), "samples": int(actions.shape[0] * actions.shape[1]),
           "loss_numbarl": loss, "loss_peer": peer["loss"],
           "loss_relerr": abs(loss - peer["loss"]) / max(abs(peer["loss"]), 1e-30),
           "grad_relerr_max": max(errs.values()), "grad_relerr": errs,
           "torch_dt_loss_relerr": abs(t_loss - peer["loss"]) / max(abs(peer["loss"]), 1e-30),
           "torch_dt_grad_relerr_max": max(t_errs.values())}
    out["agrees"] = bool(out["loss_relerr"] <= LOSS_RTOL and out["grad_relerr_max"] <= GRAD_RTOL
                         and out["torch_dt_loss_relerr"] <= TORCH_VS_PEER_RTOL
                         and out["torch_dt_grad_relerr_max"] <= TORCH_VS_PEER_RTOL)
    return out


# ---------------------------------------------------------------------------------------------
# the PyTorch rows
# ---------------------------------------------------------------------------------------------
def torch_rows(agent, act_tokens, tf32: bool, iters: int, reps: int, s) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(tf32)
    try:
        params = agent.store.to_host("params")
        tokens = agent.work["tokens"].copy_to_host(stream=s)
        actions = agent.work["mb_actions"].copy_to_host(stream=s)
        s.synchronize()
        out = {"device": str(torch.cuda.get_device_name() if device == "cuda" else "cpu"), "version": torch.__version__}
        t = TorchDT(agent, params, tokens, actions, device)
        out["train_step_eager_ms"] = _time_torch(t.train_step, max(1, iters * agent.K), reps)
        obs_tokens = torch.as_tensor(act_tokens, device=device)
        out["act_eager_ms"] = _time_torch(functools.partial(t.act, obs_tokens), iters, reps)
        del t
        if device == "cuda":
            try:
                g = TorchDT(agent, params, tokens, actions, device, capturable=True)
                g.capture()
                out["train_step_graphed_ms"] = _time_torch(g.graph.replay, max(1, iters * agent.K), reps)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        g.act(obs_tokens)
                torch.cuda.current_stream().wait_stream(side)
                act_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(act_graph):
                    g.act(obs_tokens)
                out["act_graphed_ms"] = _time_torch(act_graph.replay, iters, reps)
                del g, act_graph
            except Exception as exc:  # noqa: BLE001 - report and keep the eager numbers
                out["graphed_error"] = f"{type(exc).__name__}: {exc}"
            torch.cuda.empty_cache()
        else:
            out["graphed_error"] = "no CUDA device: PyTorch ran on the CPU, eager only"
        return out
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


# ---------------------------------------------------------------------------------------------
# run, table, main
# ---------------------------------------------------------------------------------------------
def resolve_config(args):
    from dataclasses import replace

    from numbarl import config as config_mod

    cfg = config_mod.resolve(args.preset, None, ["agent.kind=dt"] + list(args.set or []))
    over = {f"dt_{k}": getattr(args, k) for k in ("context", "embed", "heads", "layers", "batch", "rollout", "updates")
            if getattr(args, k)}
    acfg = replace(cfg.agent, **over)
    acfg.validate()
    return cfg, acfg, args.n_envs or cfg.train.n_envs


def run(args) -> dict:
    from dataclasses import replace

    from numbarl.cuda.runtime import device_name, simulator, stream

    cfg, acfg, n_envs = resolve_config(args)
    params = cfg.env
    s = stream()
    market = _market(args.bars, args.features, args.seed).to_device(params.vol_span, params.vol_horizon_bars)
    computes = [c.strip() for c in args.compute.split(",") if c.strip()]
    results = {"device": device_name(), "simulator": simulator(), "preset": args.preset, "n_envs": n_envs,
               "context": acfg.dt_context, "embed": acfg.dt_embed, "heads": acfg.dt_heads, "layers": acfg.dt_layers,
               "batch": acfg.dt_batch, "rollout": acfg.dt_rollout, "updates": acfg.dt_updates,
               "activation": acfg.activation, "features": args.features, "branches": list(params.branch_sizes),
               "hyper": {"lr": acfg.lr, "max_grad_norm": acfg.max_grad_norm, "weight_decay": acfg.weight_decay},
               "iters": args.iters, "reps": args.reps, "numbarl": {}, "torch": {},
               "notes": {
                   "numbarl.train_step_ms": "one graph: forward of B·3L tokens, branch cross-entropy, backward, "
                                            "AdamW + global-norm clip, stats (tokens already built)",
                   "numbarl.update_ms": "return scan + normalization + K x (sample windows, tokens, train step)",
                   "numbarl.collect_step_ms": "gather + behavior policy + env step + dataset write (no network)",
                   "numbarl.act_ms": "DTAgent.scores for N policies: history push, tokens, forward, scores",
                   "numbarl.act_p1_ms": "the same for P = 1: the validation backtest's per-bar policy call",
                   "validation": "the trainer's evaluate (P = 1, graphed bar steps), host wall clock",
                   "torch.train_step_*_ms": "forward, F.cross_entropy, backward, clip_grad_norm_, AdamW on the "
                                            "same tokens; graphed = one torch.cuda graph",
                   "torch.act_*_ms": "forward of the same N·3L token rows + the newest state token's logits "
                                     "(no history push, no token build)"}}
    for compute in computes:
        ccfg = replace(acfg, compute=compute)
        nb = NumbarlDT(ccfg, params, market, n_envs, args.seed, s)
        a = nb.agent
        results.update({"state_dim": a.state_dim, "token_dim": a.token_dim, "token_features": a.net.in_dim,
                        "tokens_per_step": a.B * 3 * a.L, "samples_per_step": a.B * a.L,
                        "params": int(sum(np.prod(sp.shape) for sp in a.store.specs.values()))})
        nb.iteration()  # the first dataset and update: captures every graph (each capture's warm-up is its step)
        s.synchronize()
        if compute == "fp32" and not args.no_check:
            results["check"] = check_against_peer(a, s)
        results["numbarl"][compute] = _numbarl_rows(nb, ccfg, n_envs, args, s)
        if args.val_bars > 0:
            results["numbarl"][compute]["validation"] = validation_rows(nb, args.val_bars, s)
        stats = a.read_stats(s)
        results["numbarl"][compute]["stats_after"] = {k: stats[k] for k in ("loss", "dt_action_acc", "train_step",
                                                                           "dt_updates", "nonfinite_step")}
        if not args.no_torch:
            try:
                import torch
            except ImportError:
                results["torch"] = {"available": False, "why": "torch is not installed"}
            else:
                if not simulator() and not torch.cuda.is_available():  # a CPU build of torch on the GPU host
                    results["torch"] = {"available": False, "why": "torch has no CUDA device (a CPU build?): the "
                                                                   "PyTorch rows were not timed"}
                else:
                    results["torch"][compute] = torch_rows(a, nb.actor_tokens, compute == "tf32", args.iters,
                                                           args.reps, s)
        del nb, a
    return results


def _fmt_rate(x) -> str:
    return f"{x:.3e}" if x is not None else "n/a"


def table(r: dict) -> str:
    sim = "  [SIMULATOR: host wall clock, not a measurement]" if r.get("simulator") else ""
    lines = [f"numbarl Decision Transformer benchmark on {r['device']}{sim}",
             (f"shapes ({r['preset']} preset, agent.kind=dt): B = {r['batch']} windows x L = {r['context']} steps "
              f"({r.get('tokens_per_step')} token rows of {r.get('token_features')} features, {r.get('samples_per_step')} "
              f"actions predicted), E = {r['embed']}, {r['heads']} heads, {r['layers']} layers, {r['activation']}, "
              f"{r.get('params')} parameters; dataset T = {r['rollout']} x N = {r['n_envs']} envs, K = {r['updates']} "
              f"steps per dataset; branches {r['branches']}")]
    chk = r.get("check")
    if chk and chk.get("available"):
        lines.append(f"check (fp32, {chk['samples']} samples, same weights): loss {chk['loss_numbarl']:.7g} vs PyTorch "
                     f"peer float64 {chk['loss_peer']:.7g} (rel {chk['loss_relerr']:.1e}), max param grad rel err "
                     f"{chk['grad_relerr_max']:.1e}; timed PyTorch DT vs peer (float64) loss "
                     f"{chk['torch_dt_loss_relerr']:.1e}, grads {chk['torch_dt_grad_relerr_max']:.1e} -> "
                     + ("AGREES" if chk["agrees"] else "DISAGREES (the timings below compare different computations)"))
    elif chk:
        lines.append(f"check: {chk.get('why')}")
    computes = list(r["numbarl"])
    lines.append(f"{'':<60}" + "".join(f"{c + ' ms':>12}" for c in computes))

    row = row_writer(lines, computes, 60, "{:>12.4f}")

    nb, t = r["numbarl"], r.get("torch") or {}
    row("numbarl train step (fwd, loss, bwd, AdamW; one graph)", lambda c: nb[c]["train_step_ms"])
    row(f"numbarl update (returns + {r['updates']} x sample/tokens/step)", lambda c: nb[c]["update_ms"])
    row("numbarl collect step (behavior + env step, no network)", lambda c: nb[c]["collect_step_ms"])
    row(f"numbarl iteration ({r['rollout']} collect + update)", lambda c: nb[c]["iteration_ms"])
    row(f"numbarl act, N = {r['n_envs']} (push, tokens, fwd, scores)", lambda c: nb[c]["act_ms"])
    row("numbarl act, P = 1 (the validation's per-bar call)", lambda c: nb[c]["act_p1_ms"])
    if t and t.get("available", True):
        row("PyTorch train step, eager", lambda c: t[c]["train_step_eager_ms"])
        row("PyTorch train step, CUDA-graphed", lambda c: t[c]["train_step_graphed_ms"])
        row(f"PyTorch act, N = {r['n_envs']} (fwd only), eager", lambda c: t[c]["act_eager_ms"])
        row(f"PyTorch act, N = {r['n_envs']} (fwd only), CUDA-graphed", lambda c: t[c]["act_graphed_ms"])
        for c in computes:
            if "graphed_error" in t.get(c, {}):
                lines.append(f"  PyTorch graphed ({c}): {t[c]['graphed_error']}")
    elif t.get("available") is False:
        lines.append(f"PyTorch: {t.get('why')}")
    for c in computes:
        n = nb[c]
        lines.append(f"{c}: train {_fmt_rate(n['train_samples_per_s'])} samples/s ({_fmt_rate(n['train_tokens_per_s'])} "
                     f"tokens/s); acting {_fmt_rate(n['act_env_steps_per_s'])} env-steps/s; env-steps/s incl. "
                     f"training {_fmt_rate(n['env_steps_per_s_incl_update'])} (update {100 * n['update_share']:.0f}%)")
        tc = t.get(c, {}) if t else {}
        for mode in ("eager", "graphed"):
            if f"train_step_{mode}_ms" in tc:
                lines.append(f"      vs PyTorch {mode:<8} train step: numbarl "
                             f"{tc[f'train_step_{mode}_ms'] / n['train_step_ms']:.2f}x"
                             + (f", act: numbarl {tc[f'act_{mode}_ms'] / n['act_ms']:.2f}x" if f"act_{mode}_ms" in tc
                                else ""))
        for what in ("act_p1", "train_step"):
            prof = n.get(f"kernels_{what}") or {}
            if prof:
                top = ", ".join(f"{k} {x['us']:.1f} us ({x['calls']:.0f}x)" for k, x in list(prof.items())[:8])
                lines.append(f"      GPU time per kernel, one {what} call (eager): {top}")
        v = n.get("validation")
        if v:
            lines.append(f"      validation backtest (P = 1, {v['bars']} bars, bar-step graphs of <= {v['graph_bars']} bars): first "
                         f"call {v['s_first']:.2f} s (capture), cached {v['s_cached']:.2f} s = "
                         f"{v['ms_per_bar_cached']:.3f} ms/bar (act P = 1 alone {n['act_p1_ms']:.3f} ms)")
    return "\n".join(lines)


def main(argv=None) -> int:
    backend.select()
    p = argparse.ArgumentParser(prog="numbarl-bench dt", description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--preset", default="default", help="config preset the shapes come from (default: %(default)s)")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help="config override (repeatable)")
    p.add_argument("--n-envs", type=int, default=0, help="envs N, also the acting batch (default: the preset's train.n_envs)")
    for name, what in (("context", "window steps L"), ("embed", "token width E"), ("heads", "attention heads"),
                       ("layers", "transformer blocks"), ("batch", "windows B per train step"),
                       ("rollout", "collect steps T per dataset"), ("updates", "train steps K per dataset")):
        p.add_argument(f"--{name}", type=int, default=0, help=f"{what} (default: the preset's agent.dt_{name})")
    p.add_argument("--features", type=int, default=64, help="features per bar of the synthetic market (default: %(default)s)")
    p.add_argument("--bars", type=int, default=200_000, help="bars of the synthetic market (default: %(default)s)")
    p.add_argument("--val-bars", type=int, default=3063,
                   help="bars of the timed validation backtest, 0 = skip (default: %(default)s, the default run's)")
    p.add_argument("--compute", default="fp32,tf32", help="GEMM precisions to run (default: %(default)s)")
    p.add_argument("--iters", type=int, default=20, help="calls per timed repetition (train steps: x K, collect "
                                                         "steps: x T; default: %(default)s)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions, median reported (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed (default: %(default)s)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch rows")
    p.add_argument("--no-check", action="store_true", help="skip the check against the PyTorch peer")
    p.add_argument("--profile", action="store_true", help="also list GPU time per kernel of the P = 1 acting call "
                                                          "and of the train step (needs torch)")
    args = p.parse_args(argv)
    if backend.simulator_active():
        print("note: no GPU (numba simulator): the numbers below are host wall-clock times of a smoke run, not a "
              "benchmark; run it on a GPU machine for docs/BENCHMARKS.md.", file=sys.stderr)
    results = run(args)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    chk = results.get("check")
    if args.profile:
        # as numbarl/bench/train.py: after a CUPTI session the interpreter's teardown of the CUDA
        # libraries can abort (seen on the H200): everything is written, so leave directly
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if (chk is None or not chk.get("available") or chk["agrees"]) else 1)
    return 0 if (chk is None or not chk.get("available") or chk["agrees"]) else 1


if __name__ == "__main__":
    sys.exit(main())
