"""PPO throughput benchmark (issue 16): numbarl's PPO iteration against a PyTorch PPO on the same shapes.

    python -m numbarl.bench.ppo [--json PATH] [--preset default] [--n-envs N] [--rollout T]
                                [--epochs K] [--minibatches M] [--trunk 512,512] [--compute fp32,tf32]

Shapes: the preset's (default: ``default`` with ``agent.kind=ppo``): N = train.n_envs envs, T =
agent.ppo_rollout collect steps per rollout, K = agent.ppo_epochs epochs of M =
agent.ppo_minibatches minibatches of B = T·N // M rows, the agent.trunk MLP, agent.lr, AdamW and
agent.max_grad_norm; an env on a synthetic market of --features features (state_dim = features +
the portfolio features), the env's 4 action branches.

Check before it times (fp32): after one real rollout + update, one more minibatch step on the last
minibatch (numbarl's own train_minibatch, eager) against the PyTorch side on the same weights and
the same rows: (a) the loss and ∂L/∂logits, ∂L/∂V of numbarl's loss kernel against the PyTorch peer
(numbarl.rl.torch_peer.ppo_loss_and_grads, float64) on numbarl's logits and values; (b) the loss
and every parameter gradient against the PyTorch network of this file in float64 (the same trunk /
pi / v built from numbarl's layers, its ReLUs on the device's activation pattern: on the H200 a
few of the 524,288 × 512 pre-activations sit within rounding of 0 and flipped in float64, which put
the trunk gradients 2e-4 off): the gradients are the peer's ∂L/∂logits, ∂L/∂V back through
that network (free of the clip kink: a row whose ratio sits within rounding of 1 ± ε can take the
other surrogate branch in float64), and, reported beside them, the same end to end through
``torch_ppo_loss`` (the loss the PyTorch timing runs, itself checked against the peer on the same
logits) with the count of such clip-branch flips. "agrees": both losses rel ≤ 1e-5, ∂L/∂logits,
∂L/∂V and every parameter gradient norm-relative ≤ 1e-4 (fp32 GEMMs over B rows against float64).

What each number includes:

* numbarl iteration (graphs, exactly as the trainer replays them: T replays of the "collect" graph,
  each followed by the graphs ``agent.after_collect`` names — "update" after the T-th): T env steps
  of all N envs (gather → trunk/pi/v forward → masked categorical sample → rollout write → env
  step → reward/done write → counters) + the update (bootstrap forward, GAE, advantage
  normalization, K·M minibatch steps: permutation, row gather, forward, loss, backward, AdamW).
  env-steps/s including the update = T·N / iteration time. Apart: the collect graph alone, the
  update graph alone, one minibatch step graph alone, the env step alone (gather + step + RNG
  advance; no network) — the last only to build the PyTorch row's fair equivalent.
* PyTorch PPO (no device env: the env step is NOT in its numbers): the act step = forward of N
  observations + a masked categorical sample per branch (Gumbel-max on log_softmax) + log-prob +
  value + the rollout writes; the update = GAE (CleanRL's reverse loop over T, vectorized over N),
  advantage normalization over the rollout (as numbarl), K epochs of torch.randperm and M
  minibatch steps (index gather, forward, the loss, backward, clip_grad_norm_, AdamW), eager and
  with the minibatch step CUDA-graphed (static index buffer; AdamW(capturable=True)). PyTorch
  iteration = T·act + update. Two env-steps/s figures: without any env step, and with numbarl's
  measured env step time added T times (what PyTorch would get driving numbarl's device env
  through the same buffers; an estimate, not a run).

Timing: CUDA events (numbarl through numba, PyTorch through torch.cuda), warm-up first, median of
--reps repetitions of --iters iterations. Under the numba simulator (no GPU) everything runs with
host wall-clock timing at whatever tiny shapes are given: a smoke test, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from numbarl.cuda import backend

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def _time_numba(fn, s, iters: int, reps: int, warmup: int = 1) -> float:
    """Median ms per call of fn() (which enqueues on stream s): CUDA events; the simulator: wall clock."""
    from numbarl.cuda.runtime import cuda, simulator

    for _ in range(warmup):
        fn()
    s.synchronize()
    times = []
    for _ in range(reps):
        if simulator():
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            s.synchronize()
            times.append((time.perf_counter() - t0) * 1e3 / iters)
            continue
        c = cuda()
        start, end = c.event(timing=True), c.event(timing=True)
        start.record(s)
        for _ in range(iters):
            fn()
        end.record(s)
        end.synchronize()
        times.append(c.event_elapsed_time(start, end) / iters)
    return statistics.median(times)


def _time_torch(fn, iters: int, reps: int, warmup: int = 1) -> float:
    """Median ms per call of fn() on torch's current stream: CUDA events; on the CPU: wall clock."""
    import torch

    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if not cuda:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / iters)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def row_writer(lines: list, computes: list, width: int, default_fmt: str):
    """row(label, get, fmt): append to `lines` one table line, the label padded to `width` and
    get(c) for each compute precision c ('n/a' where it raises KeyError or returns None)."""

    def row(label, get, fmt=default_fmt):
        vals = []
        for c in computes:
            try:
                v = get(c)
            except KeyError:
                v = None
            vals.append(fmt.format(v) if v is not None else f"{'n/a':>12}")
        lines.append(f"{label:<{width}}" + "".join(vals))

    return row


def _relerr(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---------------------------------------------------------------------------------------------
# the PyTorch PPO (what a PyTorch user writes; CleanRL's ppo.py arrangement, branched + masked)
# ---------------------------------------------------------------------------------------------
def torch_ppo_net(trunk_ops, shapes: dict, width: int, device, dtype, relu_masks=None):
    """nn.Module: trunk (numbarl's TrunkOps) → pi Linear(h, Σ A_k) and v Linear(h, 1).

    relu_masks: optional [one bool array per ReLU of the trunk, rows × units]: that ReLU then
    passes exactly the units its mask marks (the device's own activation pattern, so that a float64
    network differentiates the same branch of the function as numbarl's float32 pass: a
    pre-activation within rounding of 0 can fall on the other side of the kink in float64)."""
    import torch
    from torch import nn

    class _MaskedReLU(nn.Module):
        def __init__(self, mask):
            super().__init__()
            self.register_buffer("mask", torch.as_tensor(np.asarray(mask)).to(torch.bool))

        def forward(self, x):
            return torch.where(self.mask, x, torch.zeros_like(x))

    masks = list(relu_masks) if relu_masks is not None else None

    class PPONet(nn.Module):
        def __init__(self):
            super().__init__()
            layers, self.names = [], []
            for op in trunk_ops:
                if op.kind == "linear":
                    fan_in, fan_out = shapes[op.weight]
                    layers.append(nn.Linear(fan_in, fan_out, bias=op.bias is not None))
                    self.names.append((op.weight, op.bias, len(layers) - 1))
                elif op.kind == "relu" and masks is not None:
                    layers.append(_MaskedReLU(masks.pop(0)))
                elif op.kind in ("relu", "silu", "tanh"):
                    layers.append({"relu": nn.ReLU, "silu": nn.SiLU, "tanh": nn.Tanh}[op.kind]())
                else:
                    raise TypeError(f"bench ppo: trunk op {op.kind!r} is not mirrored here")
            self.trunk = nn.Sequential(*layers)
            hidden = shapes["pi.w"][0]
            self.pi = nn.Linear(hidden, width)
            self.v = nn.Linear(hidden, 1)

        def forward(self, obs):
            h = self.trunk(obs)
            return self.pi(h), self.v(h)

        def numbarl_params(self):
            """(numbarl name, parameter, transpose?) of every parameter."""
            out = []
            for w, b, i in self.names:
                out.append((w, self.trunk[i].weight, True))
                if b is not None:
                    out.append((b, self.trunk[i].bias, False))
            return out + [("pi.w", self.pi.weight, True), ("pi.b", self.pi.bias, False),
                          ("v.w", self.v.weight, True), ("v.b", self.v.bias, False)]

        def load_numbarl(self, values: dict):
            with torch.no_grad():
                for name, p, transpose in self.numbarl_params():
                    v = np.asarray(values[name], np.float64)
                    p.copy_(torch.as_tensor(np.ascontiguousarray(v.T if transpose else v), dtype=p.dtype))

        def grads_numbarl(self) -> dict:
            return {name: (p.grad.detach().double().cpu().numpy().T if t else p.grad.detach().double().cpu().numpy())
                    for name, p, t in self.numbarl_params()}

    return PPONet().to(device=device, dtype=dtype)


def torch_ppo_loss(logits, value, actions, logp_old, adv, ret, mask, branch_sizes, clip_eps, vf_coef, ent_coef):
    """The PPO loss on tensors (the peer's math, numbarl.rl.torch_peer.ppo_loss_and_grads): per branch a
    masked log_softmax, the joint log-prob, the clipped surrogate, ½(V − R)², the summed entropy.
    Returns (loss, approx_kl k3, clip_frac) tensors; no host sync."""
    import torch

    logp = torch.zeros_like(logp_old)
    ent = torch.zeros_like(logp_old)
    o = 0
    for k, n in enumerate(branch_sizes):
        mk = mask[:, k, :n]
        lp = torch.log_softmax(logits[:, o:o + n].masked_fill(~mk, float("-inf")), dim=1)
        lp = torch.where(mk, lp, torch.zeros_like(lp))
        logp = logp + lp.gather(1, actions[:, k:k + 1]).squeeze(1)
        ent = ent - (lp.exp() * lp * mk).sum(dim=1)
        o += n
    log_ratio = logp - logp_old
    ratio = log_ratio.exp()
    pg = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps))
    vl = 0.5 * (value[:, 0] - ret) ** 2
    loss = (pg + vf_coef * vl - ent_coef * ent).mean()
    with torch.no_grad():
        kl = ((ratio - 1) - log_ratio).mean()
        clip_frac = ((ratio - 1.0).abs() > clip_eps).float().mean()
    return loss, kl, clip_frac


def torch_act(net, obs, mask, branch_sizes, out: dict, t: int):
    """One collect step's inference for N envs: forward, a masked categorical sample per branch
    (Gumbel-max), the joint log-prob and the value, written into the rollout buffers at step t."""
    import torch

    with torch.no_grad():
        logits, value = net(obs)
        logp = torch.zeros(obs.shape[0], device=obs.device, dtype=logits.dtype)
        o = 0
        for k, n in enumerate(branch_sizes):
            mk = mask[:, k, :n]
            lp = torch.log_softmax(logits[:, o:o + n].masked_fill(~mk, float("-inf")), dim=1)
            g = -torch.log(-torch.log(torch.rand_like(lp).clamp_(1e-20, 1.0)))
            a = torch.argmax(lp + g, dim=1, keepdim=True)
            logp += lp.gather(1, a).squeeze(1)
            out["actions"][t, :, k] = a.squeeze(1)
            o += n
        out["obs"][t].copy_(obs)
        out["mask"][t].copy_(mask)
        out["logp"][t] = logp
        out["value"][t] = value[:, 0]


class TorchPPO:
    """Network, AdamW (decoupled decay on the tensors numbarl decays), the update and the act step."""

    def __init__(self, agent, params: dict, rollout: dict, device, capturable: bool = False):
        import torch

        from numbarl.rl.torch_peer import trunk_ops_from_layers

        cfg = agent.cfg
        self.agent, self.device = agent, device
        self.sizes = agent.branch_sizes
        self.T, self.N, self.K, self.M, self.B = agent.T, agent.n_envs, agent.K, agent.M, agent.B
        shapes = {k: tuple(np.shape(v)) for k, v in params.items()}
        self.net = torch_ppo_net(trunk_ops_from_layers(agent.trunk), shapes, agent.width, device, torch.float32)
        self.net.load_numbarl(params)
        decay = {n for n, s in agent.store.specs.items() if s.decay}
        named = self.net.numbarl_params()
        self.opt = torch.optim.AdamW(
            [{"params": [p for n, p, _ in named if n in decay], "weight_decay": cfg.weight_decay},
             {"params": [p for n, p, _ in named if n not in decay], "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, capturable=capturable)
        self.coef = (cfg.ppo_clip, cfg.ppo_value_coef, cfg.ppo_entropy_coef)
        self.gamma, self.lam, self.max_grad_norm = cfg.gamma, cfg.gae_lambda, cfg.max_grad_norm
        T, N = self.T, self.N
        dev = lambda a, dt: torch.as_tensor(np.asarray(a), dtype=dt, device=device)
        self.data = {"obs": dev(rollout["obs"], torch.float32), "actions": dev(rollout["actions"], torch.int64),
                     "logp": dev(rollout["logp"], torch.float32), "value": dev(rollout["value"], torch.float32),
                     "reward": dev(rollout["reward"], torch.float32), "done": dev(rollout["done"], torch.float32),
                     "mask": dev(rollout["mask"] != 0, torch.bool)}
        self.boot_v = dev(rollout["value"][-1], torch.float32)  # a stand-in bootstrap value [N]
        # advantages and returns in fixed buffers (the captured minibatch step reads these addresses)
        self.adv = torch.zeros((T, N), dtype=torch.float32, device=device)
        self.ret = torch.zeros((T, N), dtype=torch.float32, device=device)
        d, n = self.data, T * N
        self.flat = {"obs": d["obs"].reshape(n, -1), "actions": d["actions"].reshape(n, -1),
                     "logp": d["logp"].reshape(n), "adv": self.adv.reshape(n), "ret": self.ret.reshape(n),
                     "mask": d["mask"].reshape(n, *d["mask"].shape[2:])}
        self.idx = torch.zeros(self.B, dtype=torch.int64, device=device)  # the graphed step's static rows
        self.graph = None
        # the act step's inputs (no env: fixed observations and masks of the rollout's first step)
        self.act_obs = self.data["obs"][0].clone()
        self.act_mask = self.data["mask"][0].clone()
        self.act_out = {k: self.data[k] for k in ("obs", "actions", "logp", "value", "mask")}
        assert T == self.data["obs"].shape[0] and N == self.data["obs"].shape[1]

    # -- update ------------------------------------------------------------------------------------
    def gae(self):
        """CleanRL's reverse loop over T (vectorized over N), then advantage normalization over the
        whole rollout (as numbarl: population std + 1e-8), into the fixed adv / ret buffers."""
        import torch

        d = self.data
        with torch.no_grad():
            last = torch.zeros_like(self.boot_v)
            for t in reversed(range(self.T)):
                next_v = self.boot_v if t == self.T - 1 else d["value"][t + 1]
                nonterminal = 1.0 - d["done"][t]
                delta = d["reward"][t] + self.gamma * next_v * nonterminal - d["value"][t]
                last = delta + self.gamma * self.lam * nonterminal * last
                self.adv[t] = last
            torch.add(self.adv, d["value"], out=self.ret)
            self.adv.sub_(self.adv.mean()).div_(self.adv.std(unbiased=False) + 1e-8)

    def minibatch_step(self, idx):
        import torch

        f = self.flat
        logits, value = self.net(f["obs"][idx])
        loss, _, _ = torch_ppo_loss(logits, value, f["actions"][idx], f["logp"][idx], f["adv"][idx], f["ret"][idx],
                                    f["mask"][idx], self.sizes, *self.coef)
        loss.backward()
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.max_grad_norm)
        self.opt.step()
        return loss.detach()

    def update_eager(self):
        import torch

        self.gae()
        for _ in range(self.K):
            perm = torch.randperm(self.T * self.N, device=self.device)
            for m in range(self.M):
                self.opt.zero_grad(set_to_none=True)
                self.minibatch_step(perm[m * self.B:(m + 1) * self.B])

    def capture_minibatch(self):
        """torch.cuda.graph of one minibatch step on the static index buffer (the PyTorch docs'
        whole-network capture: warm-up on a side stream, grads None before capture)."""
        import torch

        self.gae()
        self.idx.copy_(torch.randperm(self.T * self.N, device=self.device)[:self.B])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.opt.zero_grad(set_to_none=True)
                self.minibatch_step(self.idx)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        self.opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(self.graph):
            self.minibatch_step(self.idx)

    def update_graphed(self):
        import torch

        self.gae()
        for _ in range(self.K):
            perm = torch.randperm(self.T * self.N, device=self.device)
            for m in range(self.M):
                self.idx.copy_(perm[m * self.B:(m + 1) * self.B])
                self.graph.replay()

    # -- act -----------------------------------------------------------------------------------------
    def act(self, t: int = 0):
        torch_act(self.net, self.act_obs, self.act_mask, self.sizes, self.act_out, t)


# ---------------------------------------------------------------------------------------------
# numbarl
# ---------------------------------------------------------------------------------------------
def _market(n_bars: int, n_features: int, seed: int):
    from numbarl.bench.train import _market as market

    return market(n_bars, n_features, seed)


class NumbarlPPO:
    """The agent, its env and its graphs, replayed exactly as the trainer replays them."""

    def __init__(self, cfg, params, market, n_envs: int, seed: int, s):
        from numbarl.env.device import DeviceEnv
        from numbarl.rl.agents.base import make_agent

        self.s = s
        self.env = DeviceEnv(market, params, n_envs, seed=seed)
        self.agent = make_agent(cfg, self.env.state_dim, params.branch_sizes, n_envs, seed, eval_batch=1)
        self.env.reset(seed, s)
        self.steps = self.agent.step_functions(self.env)
        self.graphs = {}
        self.collect_steps = 0

    def replay(self, name: str):
        from numbarl.cuda import graph as cuda_graph

        if name not in self.graphs:  # the trainer's rule: the capture's warm-up run is this step
            self.graphs[name] = cuda_graph.capture(self.steps[name], self.s)
        else:
            self.graphs[name].replay(self.s)

    def iteration(self):
        """T collect steps, each followed by what after_collect names (the update after the T-th)."""
        for _ in range(self.agent.T):
            self.replay("collect")
            self.collect_steps += 1
            for name in self.agent.after_collect(self.collect_steps, 0, 1):
                self.replay(name)


def _numbarl_rows(nb: NumbarlPPO, iters: int, reps: int) -> dict:
    """Timings of one agent (its first iteration already ran: every graph is captured)."""
    from numbarl.cuda import graph as cuda_graph

    a, s, T, N = nb.agent, nb.s, nb.agent.T, nb.agent.n_envs
    it_ms = _time_numba(nb.iteration, s, iters, reps)
    collect = nb.graphs["collect"]
    update = nb.graphs["update"]
    collect_ms = _time_numba(lambda: collect.replay(s), s, max(1, iters * T), reps)
    update_ms = _time_numba(lambda: update.replay(s), s, iters, reps)
    mb = cuda_graph.capture(lambda st: a.train_minibatch(st, last=False), s)
    mb_ms = _time_numba(lambda: mb.replay(s), s, max(1, iters * a.K * a.M), reps)
    env, t = nb.env, nb.env.transition

    def env_only(st):
        env.gather(t.obs, t.mask, st)
        env.step(t.actions, env.arena["preference"], stream=st)
        env.advance(st)

    env_graph = cuda_graph.capture(env_only, s)
    env_ms = _time_numba(lambda: env_graph.replay(s), s, max(1, iters * T), reps)
    return {"iteration_ms": it_ms, "env_steps_per_s_incl_update": T * N / (it_ms * 1e-3),
            "collect_step_ms": collect_ms, "env_steps_per_s_collect_only": N / (collect_ms * 1e-3),
            "update_ms": update_ms, "minibatch_step_ms": mb_ms,
            "update_rest_ms": update_ms - a.K * a.M * mb_ms, "env_step_ms": env_ms,
            "update_share": update_ms / it_ms}


# ---------------------------------------------------------------------------------------------
# the check: numbarl vs the PyTorch peer on one minibatch, same weights
# ---------------------------------------------------------------------------------------------
def check_against_peer(agent, s) -> dict:
    """One eager train_minibatch on the minibatch buffers the last update left, against (a) the
    PyTorch peer's loss on numbarl's logits/values and (b) the PyTorch network (float64) end to end."""
    try:
        import torch
    except ImportError:
        return {"available": False, "why": "torch is not installed"}
    from numbarl.rl.torch_peer import ppo_loss_and_grads, trunk_ops_from_layers

    cfg = agent.cfg
    params = agent.store.to_host("params")
    mb = agent.work.to_host()
    agent.train_minibatch(s)  # forward, loss, backward, AdamW (the gradients stay in the store)
    s.synchronize()
    loss = float(agent.loss.loss.copy_to_host(stream=s)[0])
    logits = agent.pi.output("train").copy_to_host(stream=s)
    value = agent.v.output("train").copy_to_host(stream=s)
    d_logits = agent.loss.grad("logits").copy_to_host(stream=s)
    d_value = agent.loss.grad("value").copy_to_host(stream=s)
    s.synchronize()
    grads = agent.store.to_host("grads")
    x = {"actions": mb["mb_actions"], "logp_old": mb["mb_logp"], "adv": mb["mb_adv"], "ret": mb["mb_ret"],
         "mask": mb["mb_mask"]}
    coef = {"clip_eps": cfg.ppo_clip, "vf_coef": cfg.ppo_value_coef, "ent_coef": cfg.ppo_entropy_coef}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # (a) the loss kernel against the peer on numbarl's own network outputs
    peer = ppo_loss_and_grads(logits, value, **x, branch_sizes=agent.branch_sizes, **coef, device=device)
    out = {"available": True, "rows": int(agent.B),
           "loss_numbarl": loss, "loss_peer": peer["loss"],
           "loss_kernel_relerr": abs(loss - peer["loss"]) / max(abs(peer["loss"]), 1e-30),
           "d_logits_relerr": _relerr(d_logits, peer["d_logits"]), "d_value_relerr": _relerr(d_value, peer["d_value"])}
    # (b) the PyTorch network (float64, same weights, same rows). Gated: the peer's ∂L/∂logits, ∂L/∂V
    # (on numbarl's outputs) back through the network: every parameter gradient then compares the whole
    # backward chain (heads, the gradient ledger's sum into the trunk, trunk) free of the clip kink,
    # where a row whose ratio sits within rounding of 1 ± ε may take the other branch in float64.
    # Reported beside it: the same end to end through torch_ppo_loss on the network's own logits.
    shapes = {k: tuple(np.shape(v)) for k, v in params.items()}
    # the device's ReLU pattern of this pass (a ReLU layer's output > 0; torch_ppo_net's docstring)
    relu_masks = [layer.output("train").copy_to_host(stream=s) > 0 for layer in agent.trunk.layers
                  if getattr(layer, "activation", None) == "relu"]
    s.synchronize()
    net = torch_ppo_net(trunk_ops_from_layers(agent.trunk), shapes, agent.width, device, torch.float64,
                        relu_masks=relu_masks)
    net.load_numbarl(params)
    t = lambda a, dt: torch.as_tensor(np.asarray(a), dtype=dt, device=device)
    lg, v = net(t(mb["mb_obs"], torch.float64))
    torch.autograd.backward([lg, v], [t(peer["d_logits"], torch.float64), t(peer["d_value"], torch.float64)],
                            retain_graph=True)
    chained = net.grads_numbarl()
    net.zero_grad(set_to_none=True)
    tl, _, _ = torch_ppo_loss(lg, v, t(x["actions"], torch.int64), t(x["logp_old"], torch.float64),
                              t(x["adv"], torch.float64), t(x["ret"], torch.float64), t(x["mask"] != 0, torch.bool),
                              agent.branch_sizes, cfg.ppo_clip, cfg.ppo_value_coef, cfg.ppo_entropy_coef)
    tl.backward()
    end_to_end = net.grads_numbarl()
    lg_np, v_np = lg.detach().cpu().numpy(), v.detach().cpu().numpy()
    # the timed torch loss is the peer's math: the same loss on the same (torch) logits
    peer_t = ppo_loss_and_grads(lg_np, v_np, **x, branch_sizes=agent.branch_sizes, **coef, device=device)
    # rows whose surrogate branch (unclipped vs clipped) differs between numbarl's and the float64 logits
    from numbarl.rl.losses.ppo import ppo_loss_ref

    branch = []
    for logits_ in (logits, lg_np):
        _, o, _, _ = ppo_loss_ref(logits_, value, **x, branch_sizes=agent.branch_sizes, **coef)
        ratio = np.exp(o["logp"] - np.asarray(x["logp_old"], np.float64))
        a_ = np.asarray(x["adv"], np.float64)
        branch.append(ratio * a_ <= np.clip(ratio, 1 - cfg.ppo_clip, 1 + cfg.ppo_clip) * a_)
    errs = {name: _relerr(grads[name], chained[name]) for name in chained}
    errs_e2e = {name: _relerr(grads[name], end_to_end[name]) for name in end_to_end}
    loss_t = float(tl.detach().cpu())
    out.update({"loss_torch": loss_t, "loss_relerr": abs(loss - loss_t) / max(abs(loss_t), 1e-30),
                "torch_loss_vs_peer_relerr": abs(loss_t - peer_t["loss"]) / max(abs(peer_t["loss"]), 1e-30),
                "grad_relerr_max": max(errs.values()), "grad_relerr": errs,
                "grad_relerr_end_to_end_max": max(errs_e2e.values()), "grad_relerr_end_to_end": errs_e2e,
                "clip_branch_flips": int(np.sum(branch[0] != branch[1]))})
    out["agrees"] = bool(out["loss_kernel_relerr"] <= LOSS_RTOL and out["loss_relerr"] <= LOSS_RTOL
                         and out["d_logits_relerr"] <= GRAD_RTOL and out["d_value_relerr"] <= GRAD_RTOL
                         and out["grad_relerr_max"] <= GRAD_RTOL and out["torch_loss_vs_peer_relerr"] <= 1e-9)
    return out


# ---------------------------------------------------------------------------------------------
# the PyTorch rows
# ---------------------------------------------------------------------------------------------
def torch_rows(agent, tf32: bool, iters: int, reps: int) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(tf32)
    try:
        params = agent.store.to_host("params")
        rollout = agent.rollout.to_host()
        out = {"device": str(torch.cuda.get_device_name() if device == "cuda" else "cpu"), "version": torch.__version__}
        tp = TorchPPO(agent, params, rollout, device, capturable=False)
        out["act_eager_ms"] = _time_torch(tp.act, max(1, iters * agent.T), reps)
        out["update_eager_ms"] = _time_torch(tp.update_eager, iters, reps)
        del tp
        if device == "cuda":
            try:
                tg = TorchPPO(agent, params, rollout, device, capturable=True)
                tg.capture_minibatch()
                out["update_graphed_ms"] = _time_torch(tg.update_graphed, iters, reps)
                act_graph = torch.cuda.CUDAGraph()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        tg.act()
                torch.cuda.current_stream().wait_stream(side)
                with torch.cuda.graph(act_graph):
                    tg.act()
                out["act_graphed_ms"] = _time_torch(act_graph.replay, max(1, iters * agent.T), reps)
                del tg, act_graph
            except Exception as exc:  # noqa: BLE001 - report and keep the eager numbers
                out["graphed_error"] = f"{type(exc).__name__}: {exc}"
        else:
            out["graphed_error"] = "no CUDA device: PyTorch ran on the CPU, eager only"
        torch.cuda.empty_cache() if device == "cuda" else None
        return out
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _torch_summary(t: dict, T: int, N: int, env_ms: float) -> dict:
    """Iteration figures of the PyTorch rows: T·act + update, without and with numbarl's env step."""
    out = {}
    for mode in ("eager", "graphed"):
        if f"update_{mode}_ms" not in t or f"act_{mode}_ms" not in t:
            continue
        it = T * t[f"act_{mode}_ms"] + t[f"update_{mode}_ms"]
        it_env = it + T * env_ms
        out[mode] = {"iteration_ms_no_env": it, "env_steps_per_s_no_env": T * N / (it * 1e-3),
                     "iteration_ms_with_numbarl_env": it_env,
                     "env_steps_per_s_with_numbarl_env": T * N / (it_env * 1e-3)}
    return out


# ---------------------------------------------------------------------------------------------
# run, table, main
# ---------------------------------------------------------------------------------------------
def resolve_config(args):
    from dataclasses import replace

    from numbarl import config as config_mod

    sets = ["agent.kind=ppo"] + list(args.set or [])
    cfg = config_mod.resolve(args.preset, None, sets)
    a = cfg.agent
    over = {}
    if args.rollout:
        over["ppo_rollout"] = args.rollout
    if args.epochs:
        over["ppo_epochs"] = args.epochs
    if args.minibatches:
        over["ppo_minibatches"] = args.minibatches
    if args.trunk:
        over["trunk"] = tuple(int(w) for w in args.trunk.split(","))
    a = replace(a, **over)
    n_envs = args.n_envs or cfg.train.n_envs
    return cfg, a, n_envs


def run(args) -> dict:
    from dataclasses import replace

    from numbarl.cuda.runtime import device_name, simulator, stream

    cfg, acfg, n_envs = resolve_config(args)
    params = cfg.env
    s = stream()
    market = _market(args.bars, args.features, args.seed).to_device(params.vol_span, params.vol_horizon_bars)
    computes = [c.strip() for c in args.compute.split(",") if c.strip()]
    results = {"device": device_name(), "simulator": simulator(), "preset": args.preset,
               "n_envs": n_envs, "rollout": acfg.ppo_rollout, "epochs": acfg.ppo_epochs,
               "minibatches": acfg.ppo_minibatches, "trunk": list(acfg.trunk), "features": args.features,
               "branches": list(params.branch_sizes),
               "hyper": {"lr": acfg.lr, "clip": acfg.ppo_clip, "value_coef": acfg.ppo_value_coef,
                         "entropy_coef": acfg.ppo_entropy_coef, "gamma": acfg.gamma, "gae_lambda": acfg.gae_lambda,
                         "max_grad_norm": acfg.max_grad_norm, "weight_decay": acfg.weight_decay},
               "iters": args.iters, "reps": args.reps, "numbarl": {}, "torch": {},
               "notes": {
                   "numbarl.iteration_ms": "T collect-graph replays (device env step + inference + rollout write) "
                                           "+ the update graph (bootstrap, GAE, normalization, K x M minibatch "
                                           "steps), replayed as the trainer does",
                   "numbarl.env_step_ms": "gather + env step + RNG advance alone (no network), one graph",
                   "torch.act_*_ms": "forward of N obs + masked categorical sample + log-prob + value + rollout "
                                     "writes; NO env step (PyTorch has no device env)",
                   "torch.update_*_ms": "GAE loop + normalization + K x (randperm + M minibatch steps: gather, "
                                        "forward, loss, backward, clip_grad_norm_, AdamW); graphed = the "
                                        "minibatch step as one torch.cuda graph",
                   "torch.*.env_steps_per_s_with_numbarl_env": "T·N / (T·(act + numbarl env_step) + update): an "
                                                               "estimate, not a run"}}
    for compute in computes:
        nb = NumbarlPPO(replace(acfg, compute=compute), params, market, n_envs, args.seed, s)
        a = nb.agent
        results.update({"state_dim": a.state_dim, "minibatch": a.B, "minibatches_used": a.M,
                        "rows_per_rollout": a.T * a.n_envs})
        nb.iteration()  # the first rollout and update: captures every graph (each capture's warm-up is its step)
        s.synchronize()
        if compute == "fp32" and not args.no_check:
            results["check"] = check_against_peer(a, s)
        results["numbarl"][compute] = _numbarl_rows(nb, args.iters, args.reps)
        stats = a.read_stats(s)
        results["numbarl"][compute]["stats_after"] = {k: stats[k] for k in ("loss", "approx_kl", "clip_frac", "entropy",
                                                                           "ppo_updates", "train_step", "nonfinite_step")}
        if not args.no_torch:
            try:
                import torch
            except ImportError:
                results["torch"] = {"available": False, "why": "torch is not installed"}
            else:
                if not simulator() and not torch.cuda.is_available():  # a CPU build of torch on the GPU host
                    results["torch"] = {"available": False, "why": "torch has no CUDA device (a CPU build?): the "
                                                                   "PyTorch rows were not timed"}
                    del nb, a
                    continue
                t = torch_rows(a, compute == "tf32", args.iters, args.reps)
                t.update(_torch_summary(t, a.T, a.n_envs, results["numbarl"][compute]["env_step_ms"]))
                results["torch"][compute] = t
        del nb, a
    return results


def _fmt_rate(x) -> str:
    return f"{x:.3e}" if x is not None else "n/a"


def table(r: dict) -> str:
    sim = "  [SIMULATOR: host wall clock, not a measurement]" if r.get("simulator") else ""
    shapes = (f"shapes ({r['preset']} preset, agent.kind=ppo): N = {r['n_envs']} envs, T = {r['rollout']}, "
              f"K = {r['epochs']} epochs x M = {r.get('minibatches_used', r['minibatches'])} minibatches of "
              f"B = {r.get('minibatch')} rows, trunk {r['trunk']}, state_dim {r.get('state_dim')}, "
              f"branches {r['branches']}")
    lines = [f"numbarl PPO benchmark on {r['device']}{sim}", shapes]
    chk = r.get("check")
    if chk and chk.get("available"):
        lines.append(f"check (fp32, one minibatch of {chk['rows']} rows, same weights): loss {chk['loss_numbarl']:.7g} vs "
                     f"PyTorch float64 {chk['loss_torch']:.7g} (rel {chk['loss_relerr']:.1e}); loss kernel vs peer rel "
                     f"{chk['loss_kernel_relerr']:.1e}, dlogits {chk['d_logits_relerr']:.1e}, dV {chk['d_value_relerr']:.1e}; "
                     f"max param grad rel err {chk['grad_relerr_max']:.1e} (end to end through the torch loss "
                     f"{chk['grad_relerr_end_to_end_max']:.1e}, {chk['clip_branch_flips']} clip-branch flips) -> "
                     + ("AGREES" if chk["agrees"] else "DISAGREES (the timings below compare different computations)"))
    elif chk:
        lines.append(f"check: {chk.get('why')}")
    computes = list(r["numbarl"])
    lines.append(f"{'':<58}" + "".join(f"{c + ' ms':>12}" for c in computes))

    row = row_writer(lines, computes, 58, "{:>12.3f}")

    nb = r["numbarl"]
    T = r["rollout"]
    row(f"numbarl PPO iteration ({T} collect + update, graphs)", lambda c: nb[c]["iteration_ms"])
    row("  collect step (env + inference + rollout write)", lambda c: nb[c]["collect_step_ms"])
    row("  update (GAE, norm, K x M minibatch steps)", lambda c: nb[c]["update_ms"])
    row("    one minibatch step (fwd, loss, bwd, AdamW)", lambda c: nb[c]["minibatch_step_ms"])
    row("    rest of the update (GAE, norm, perm, gathers)", lambda c: nb[c]["update_rest_ms"])
    row("  env step alone (gather + step + RNG)", lambda c: nb[c]["env_step_ms"])
    t = r.get("torch") or {}
    if t and t.get("available", True):
        row("PyTorch act step, eager (fwd + sample, NO env)", lambda c: t[c]["act_eager_ms"])
        row("PyTorch act step, CUDA-graphed (NO env)", lambda c: t[c]["act_graphed_ms"])
        row("PyTorch update, eager", lambda c: t[c]["update_eager_ms"])
        row("PyTorch update, minibatch step CUDA-graphed", lambda c: t[c]["update_graphed_ms"])
        for c in computes:
            if "graphed_error" in t.get(c, {}):
                lines.append(f"  PyTorch graphed ({c}): {t[c]['graphed_error']}")
    lines.append("env-steps/s (T·N per iteration):")
    for c in computes:
        lines.append(f"  {c}: numbarl incl. env + update {_fmt_rate(nb[c]['env_steps_per_s_incl_update'])}"
                     f" (collect only {_fmt_rate(nb[c]['env_steps_per_s_collect_only'])}, update "
                     f"{100 * nb[c]['update_share']:.0f}% of the iteration)")
        tc = t.get(c, {}) if t else {}
        for mode in ("eager", "graphed"):
            if mode in tc:
                m = tc[mode]
                lines.append(f"      PyTorch {mode:<8} no env {_fmt_rate(m['env_steps_per_s_no_env'])}, with numbarl's env "
                             f"step added {_fmt_rate(m['env_steps_per_s_with_numbarl_env'])} -> numbarl "
                             f"{nb[c]['env_steps_per_s_incl_update'] / m['env_steps_per_s_with_numbarl_env']:.2f}x")
    if t.get("available") is False:
        lines.append(f"PyTorch: {t.get('why')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    backend.select()
    p = argparse.ArgumentParser(prog="numbarl-bench ppo", description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--preset", default="default", help="config preset the shapes come from (default: %(default)s)")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help="config override (repeatable)")
    p.add_argument("--n-envs", type=int, default=0, help="parallel envs N (default: the preset's train.n_envs)")
    p.add_argument("--rollout", type=int, default=0, help="rollout length T (default: the preset's agent.ppo_rollout)")
    p.add_argument("--epochs", type=int, default=0, help="epochs K per update (default: the preset's agent.ppo_epochs)")
    p.add_argument("--minibatches", type=int, default=0, help="minibatches M per epoch (default: the preset's)")
    p.add_argument("--trunk", default="", help="hidden widths, e.g. 512,512 (default: the preset's agent.trunk)")
    p.add_argument("--features", type=int, default=64, help="features per bar of the synthetic market (default: %(default)s)")
    p.add_argument("--bars", type=int, default=200_000, help="bars of the synthetic market (default: %(default)s)")
    p.add_argument("--compute", default="fp32,tf32", help="GEMM precisions to run (default: %(default)s)")
    p.add_argument("--iters", type=int, default=3, help="iterations per timed repetition (default: %(default)s)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions, median reported (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed (default: %(default)s)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch rows")
    p.add_argument("--no-check", action="store_true", help="skip the check against the PyTorch peer")
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
    return 0 if (chk is None or not chk.get("available") or chk["agrees"]) else 1


if __name__ == "__main__":
    sys.exit(main())
