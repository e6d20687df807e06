"""PyTorch peer of the numbarl learner: the same network, loss and AdamW in plain PyTorch.

What a researcher would write (CleanRL's c51.py style, extended to branches and double DQN):
nn.Linear layers, a dueling branched C51 head, the dense Eq. 7 projection (Bellemare et al.
2017; see `numbarl.rl.losses.c51`), cross-entropy averaged over branches, then the batch mean,
`clip_grad_norm_` and `torch.optim.AdamW`. It is used for two things (SPEC §7, issue 4):

1. **checking numbarl on the GPU**: load the same weights (numbarl's parameter dict, weights
   [in, out] — transposed into nn.Linear's [out, in]), run one batch, compare loss and
   gradients (`loss_and_grads`, gradients returned under numbarl's names and layout);
2. **timing**: `time_train_step(peer, batch, mode="eager" | "graphed", tf32=...)` runs the
   whole train step (online forward on next_obs for the argmax, target forward, online forward
   on obs, loss, backward, clipping, AdamW, optional Polyak target update) eagerly or as one
   CUDA graph captured with `torch.cuda.graph` (static inputs, warm-up on a side stream, grads
   set to None before capture, AdamW(capturable=True)), as the PyTorch CUDA-graphs docs
   describe for whole-network capture.

torch is an optional extra, never a runtime dependency: this module imports without it, and
every function imports torch when it is called.

Conventions shared with numbarl (so the comparison is exact up to float32 rounding):
  * loss = (1/B) Σ_b w_b · (1/n_branches) Σ_k CE[b, k]; per-sample loss unweighted;
  * double DQN: a* = first argmax over the valid actions of E[Z] under the online net;
  * γ_b = discounts[b] · (1 - dones[b]) (n-step discount γ^m from the replay);
  * padding of the [B, n_branches, max_actions, Z] layout: logits -inf, probs 0, Q -inf;
  * AdamW as torch arranges it; weight decay on the tensors numbarl marks `decay`;
    clip_grad_norm_ adds 1e-6 to the norm, like numbarl.rl.optim.

The trunk is described by a tuple of `TrunkOp`s (linear / relu / silu / gelu / tanh / layernorm,
with numbarl parameter names), so any trunk numbarl builds can be mirrored:
`trunk_ops_from_layers` derives it from numbarl layer objects.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np

ACTIVATIONS = ("relu", "silu", "gelu", "tanh")


@dataclass(frozen=True)
class TrunkOp:
    """One trunk operation, in order: a linear layer, an activation or a LayerNorm."""

    kind: str
    """"linear", "layernorm" or an activation in ACTIVATIONS"""
    weight: str | None = None
    """numbarl name of the weight ([in, out] for linear, [dim] gamma for layernorm)"""
    bias: str | None = None
    """numbarl name of the bias ([out] / beta [dim]); None: no bias"""
    eps: float = 1e-5
    """LayerNorm epsilon"""

    def __post_init__(self):
        if self.kind not in ("linear", "layernorm") + ACTIVATIONS:
            raise ValueError(f"TrunkOp.kind must be 'linear', 'layernorm' or one of {ACTIVATIONS}, got {self.kind!r}")
        if self.kind in ("linear", "layernorm") and self.weight is None:
            raise ValueError(f"TrunkOp({self.kind!r}) needs the numbarl weight name")


@dataclass(frozen=True)
class PeerSpec:
    """The network the peer builds: trunk ops + dueling branched C51 head."""

    trunk: tuple
    """TrunkOp sequence applied to obs (may be empty: the head reads obs directly)"""
    head: str
    """numbarl name prefix of the head: {head}.value.w/b, {head}.adv.w/b"""
    branch_sizes: tuple
    """actions per branch A_k"""
    n_atoms: int = 51
    """atoms of the C51 support"""
    v_min: float = -10.0
    """lowest atom"""
    v_max: float = 10.0
    """highest atom"""
    decay: frozenset = field(default_factory=frozenset)
    """numbarl names that get weight decay (numbarl's ParamSpec.decay)"""

    @classmethod
    def from_numbarl(cls, trunk_layers, head, store=None) -> "PeerSpec":
        """Spec mirroring numbarl objects: trunk layers (see `trunk_ops_from_layers`) and a
        `BranchedDuelingC51Head`; `store` (ParamStore) supplies the decay flags."""
        decay = frozenset(n for n, s in store.specs.items() if s.decay) if store is not None else frozenset()
        return cls(tuple(trunk_ops_from_layers(trunk_layers)), head.name, tuple(head.branch_sizes), head.n_atoms,
                   head.v_min, head.v_max, decay)


def trunk_ops_from_layers(layers) -> list:
    """TrunkOps from numbarl trunk layer objects, duck-typed on their attributes.

    Accepts an object with `.layers` (an Mlp) or a list of layers. A linear layer is recognised by
    `param_names` with a weight "w" and bias "b" (or attributes `w_name`/`b_name`) plus an optional
    `activation`; a LayerNorm by gamma/beta names and `eps`; a stand-alone activation layer by
    `activation` (or `kind`) alone. Raise with the layer's repr when a layer is not understood.
    """
    from numbarl.rl.nets.activations import Activation
    from numbarl.rl.nets.layernorm import LayerNorm
    from numbarl.rl.nets.linear import Linear
    from numbarl.rl.nets.module import Module

    if hasattr(layers, "layers"):
        layers = layers.layers
    ops = []
    for layer in layers:
        if isinstance(layer, Module) and not isinstance(layer, (Linear, LayerNorm, Activation)):
            # a gate, bottleneck, residual block or dropout also names a "w"/"b": mirroring it as a
            # Linear would give a peer that silently computes another network
            raise TypeError(f"torch peer: cannot mirror trunk layer {layer!r} ({type(layer).__name__}); describe "
                            "the trunk with TrunkOp(...) or use the component's own peer")
        names = dict(getattr(layer, "param_names", {}) or {})
        cls_name = type(layer).__name__.lower()
        activation = getattr(layer, "activation", None)
        if "layernorm" in cls_name or "gamma" in names:
            gamma = names.get("gamma", getattr(layer, "gamma_name", None))
            beta = names.get("beta", getattr(layer, "beta_name", None))
            ops.append(TrunkOp("layernorm", gamma, beta, float(getattr(layer, "eps", 1e-5))))
        elif names.get("w") or getattr(layer, "w_name", None):
            ops.append(TrunkOp("linear", names.get("w", getattr(layer, "w_name", None)),
                               names.get("b", getattr(layer, "b_name", None))))
            if activation not in (None, "none", "identity"):
                ops.append(TrunkOp(str(activation)))
        elif activation in ACTIVATIONS or getattr(layer, "kind", None) in ACTIVATIONS:
            ops.append(TrunkOp(str(activation if activation in ACTIVATIONS else layer.kind)))
        else:
            raise TypeError(f"torch peer: cannot mirror trunk layer {layer!r}; describe the trunk with TrunkOp(...)")
    return ops


# ---------------------------------------------------------------------------------------------
# the network and loss, written the way a PyTorch user would (torch imported lazily)
# ---------------------------------------------------------------------------------------------
_CLASSES = {}


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError("the PyTorch peer needs torch (pip install torch); numbarl itself does not") from e
    return torch


def _net_class():
    """nn.Module class of the peer network (defined on first use so that torch stays optional)."""
    if "net" in _CLASSES:
        return _CLASSES["net"]
    torch = _torch()
    from torch import nn

    class BranchedDuelingC51Net(nn.Module):
        """trunk -> V [B, Z] and A [B, ΣA·Z] -> per-branch dueling logits [B, A_k, Z]."""

        def __init__(self, spec: PeerSpec, shapes: dict):
            super().__init__()
            self.spec = spec
            layers = []
            for op in spec.trunk:
                if op.kind == "linear":
                    fan_in, fan_out = shapes[op.weight]
                    layers.append(nn.Linear(fan_in, fan_out, bias=op.bias is not None))
                elif op.kind == "layernorm":
                    layers.append(nn.LayerNorm(shapes[op.weight][0], eps=op.eps, elementwise_affine=True,
                                               bias=op.bias is not None))
                else:
                    layers.append({"relu": nn.ReLU, "silu": nn.SiLU, "gelu": lambda: nn.GELU(approximate="tanh"),
                                   "tanh": nn.Tanh}[op.kind]())
            self.trunk = nn.Sequential(*layers)
            hidden, n_atoms = shapes[f"{spec.head}.value.w"]
            self.value = nn.Linear(hidden, n_atoms)
            self.adv = nn.Linear(hidden, sum(spec.branch_sizes) * n_atoms)
            self.n_atoms = n_atoms
            self.offsets = [sum(spec.branch_sizes[:k]) for k in range(len(spec.branch_sizes))]

        def forward(self, obs):
            h = self.trunk(obs)
            return dueling_logits(self.value(h), self.adv(h), self.spec.branch_sizes)  # list over branches

        def numbarl_params(self):
            """(numbarl name, torch parameter, transpose?) for every parameter."""
            out = []
            modules = iter(m for m in self.trunk if isinstance(m, (nn.Linear, nn.LayerNorm)))
            for op in self.spec.trunk:
                if op.kind in ("linear", "layernorm"):
                    m = next(modules)
                    out.append((op.weight, m.weight, op.kind == "linear"))
                    if op.bias is not None:
                        out.append((op.bias, m.bias, False))
            h = self.spec.head
            out += [(f"{h}.value.w", self.value.weight, True), (f"{h}.value.b", self.value.bias, False),
                    (f"{h}.adv.w", self.adv.weight, True), (f"{h}.adv.b", self.adv.bias, False)]
            return out

    _CLASSES["net"] = BranchedDuelingC51Net
    return BranchedDuelingC51Net


def dueling_logits(v, a, branch_sizes) -> list:
    """Per-branch dueling logits from V [B, Z] and A [B, ΣA·Z]: V + A_k − mean over the branch's actions of A_k,
    a list over branches of [B, A_k, Z]."""
    n_atoms, off, out = v.shape[-1], 0, []
    for n in branch_sizes:
        a_k = a[:, off * n_atoms:(off + n) * n_atoms].view(-1, n, n_atoms)  # [B, A_k, Z]
        out.append(v.unsqueeze(1) + a_k - a_k.mean(dim=1, keepdim=True))
        off += n
    return out


def project_distribution(rewards, dones, discounts, next_probs, support):
    """Dense Eq. 7 in torch (CleanRL's projection without the scatter): [B, Z] -> [B, Z]."""
    torch = _torch()
    delta_z = support[1] - support[0]
    gamma = discounts * (1.0 - dones)  # [B]
    target_z = (rewards.unsqueeze(1) + gamma.unsqueeze(1) * support.unsqueeze(0)).clamp(support[0], support[-1])
    hat = (1.0 - (target_z.unsqueeze(1) - support.view(1, -1, 1)).abs() / delta_z).clamp(0.0, 1.0)  # [B, Zi, Zj]
    return torch.bmm(hat, next_probs.unsqueeze(2)).squeeze(2)


def c51_loss(online, target, batch, support, next_actions=None):
    """Distributional double-DQN loss of one batch (dict of tensors, see `batch_to_torch`).

    Returns (loss scalar, per_sample [B] unweighted). `next_actions` [B, n_branches] overrides
    the online argmax (used by the GPU test to remove near-tie flips between float32 paths).
    """
    torch = _torch()
    F = torch.nn.functional
    obs, actions = batch["obs"], batch["actions"]
    with torch.no_grad():
        next_online = online(batch["next_obs"])
        next_target = target(batch["next_obs"])
        targets = []
        for k, (lo, lt) in enumerate(zip(next_online, next_target)):
            if next_actions is None:
                q = (F.softmax(lo, dim=-1) * support).sum(-1)  # [B, A_k]
                a_star = q.argmax(dim=1)  # first maximum on ties
            else:
                a_star = next_actions[:, k]
            p = F.softmax(lt, dim=-1).gather(1, a_star.view(-1, 1, 1).expand(-1, 1, lt.shape[-1])).squeeze(1)
            targets.append(project_distribution(batch["rewards"], batch["dones"], batch["discounts"], p, support))
    ce = []
    for k, logits in enumerate(online(obs)):
        taken = logits.gather(1, actions[:, k].view(-1, 1, 1).expand(-1, 1, logits.shape[-1])).squeeze(1)  # [B, Z]
        ce.append(-(targets[k] * F.log_softmax(taken, dim=-1)).sum(-1))
    per_sample = torch.stack(ce, dim=1).mean(dim=1)  # mean over branches, [B]
    weights = batch.get("weights")
    loss = (per_sample * weights).mean() if weights is not None else per_sample.mean()
    return loss, per_sample.detach()


def batch_to_torch(batch: dict, device="cuda") -> dict:
    """numpy batch -> torch tensors: obs/next_obs [B, D], actions [B, n_branches] (int64),
    rewards/dones/discounts [B] and optional weights [B] (float32)."""
    torch = _torch()
    out = {}
    for k, v in batch.items():
        if v is None:
            continue
        v = np.asarray(v)
        dtype = torch.int64 if k == "actions" else torch.float32
        out[k] = torch.as_tensor(v.astype(np.int64 if k == "actions" else np.float32), device=device, dtype=dtype)
    missing = {"obs", "next_obs", "actions", "rewards", "dones", "discounts"} - set(out)
    if missing:
        raise KeyError(f"torch peer batch is missing {sorted(missing)}")
    return out


class TorchPeer:
    """Online + target networks, AdamW and the train step, loadable from numbarl's parameters.

        peer = TorchPeer(PeerSpec.from_numbarl(mlp, head, store), store.to_host("params"),
                         lr=1e-4, max_grad_norm=10.0, weight_decay=0.0)
        loss, per_sample, grads = peer.loss_and_grads(batch)     # grads: numbarl names, [in, out]
    """

    def __init__(self, spec: PeerSpec, values: dict, target_values: dict | None = None, device="cuda",
                 lr: float = 1e-4, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, target_tau: float | None = None, capturable: bool = False):
        torch = _torch()
        self.spec = spec
        self.device = torch.device(device)
        shapes = {k: tuple(np.shape(v)) for k, v in values.items()}
        net_cls = _net_class()
        self.online = net_cls(spec, shapes).to(self.device)
        self.target = net_cls(spec, shapes).to(self.device)
        for p in self.target.parameters():
            p.requires_grad_(False)
        self.load(values, self.online)
        self.load(values if target_values is None else target_values, self.target)
        # the same float32 atoms as numbarl.rl.losses.c51.make_support (float64 linspace, then cast)
        support = np.linspace(float(spec.v_min), float(spec.v_max), int(spec.n_atoms)).astype(np.float32)
        self.support = torch.as_tensor(support, device=self.device)
        self.max_grad_norm = float(max_grad_norm)
        self.target_tau = target_tau
        decay = [p for n, p, _ in self.online.numbarl_params() if n in spec.decay]
        no_decay = [p for n, p, _ in self.online.numbarl_params() if n not in spec.decay]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr, betas=tuple(betas), eps=eps, capturable=capturable)

    # -- weights ------------------------------------------------------------------------------
    def load(self, values: dict, net=None) -> None:
        """Copy numbarl arrays ([in, out] weights) into a net (default: online), in place."""
        torch = _torch()
        net = self.online if net is None else net
        with torch.no_grad():
            for name, param, transpose in net.numbarl_params():
                if name not in values:
                    raise KeyError(f"torch peer: numbarl parameter {name!r} is missing from the values")
                v = np.asarray(values[name], np.float32)
                v = v.T if transpose else v
                if tuple(v.shape) != tuple(param.shape):
                    raise ValueError(f"torch peer: {name!r} has shape {v.shape}, the peer expects {tuple(param.shape)}")
                param.copy_(torch.as_tensor(np.ascontiguousarray(v), device=self.device))

    def to_numbarl(self, net=None, grads: bool = False) -> dict:
        """Parameters (or their .grad) as numpy under numbarl's names and layout."""
        net = self.online if net is None else net
        out = {}
        for name, param, transpose in net.numbarl_params():
            t = param.grad if grads else param
            if t is None:
                continue
            a = t.detach().float().cpu().numpy()
            out[name] = np.ascontiguousarray(a.T if transpose else a)
        return out

    # -- one batch ----------------------------------------------------------------------------
    def outputs(self, obs, target: bool = False):
        """(logits, probs, q) of one pass in numbarl's padded layout, as numpy float32."""
        torch = _torch()
        F = torch.nn.functional
        spec = self.spec
        net = self.target if target else self.online
        with torch.no_grad():
            per_branch = net(obs)
            batch = per_branch[0].shape[0]
            shape = (batch, len(spec.branch_sizes), max(spec.branch_sizes), spec.n_atoms)
            logits = torch.full(shape, float("-inf"), device=self.device)
            probs = torch.zeros(shape, device=self.device)
            q = torch.full(shape[:3], float("-inf"), device=self.device)
            for k, (n, lk) in enumerate(zip(spec.branch_sizes, per_branch)):
                logits[:, k, :n] = lk
                probs[:, k, :n] = F.softmax(lk, dim=-1)
                q[:, k, :n] = (probs[:, k, :n] * self.support).sum(-1)
        return logits.cpu().numpy(), probs.cpu().numpy(), q.cpu().numpy()

    def loss_and_grads(self, batch: dict, next_actions=None):
        """Loss, per-sample loss and gradients (numbarl names, [in, out]) for one batch; no update."""
        self.online.zero_grad(set_to_none=True)
        loss, per_sample = c51_loss(self.online, self.target, batch, self.support, next_actions)
        loss.backward()
        return float(loss.detach().cpu()), per_sample.cpu().numpy(), self.to_numbarl(grads=True)

    def train_step(self, batch: dict):
        """The whole step: loss, backward, clip, AdamW, Polyak target update. Returns the loss tensor.

        Graph-safe: no host sync, no data-dependent Python control flow (grads are set to None by
        the caller before capture, as the torch docs ask)."""
        torch = _torch()
        loss, _ = c51_loss(self.online, self.target, batch, self.support)
        loss.backward()
        if self.max_grad_norm > 0.0:
            torch.nn.utils.clip_grad_norm_(self.online.parameters(), self.max_grad_norm)
        self.optimizer.step()
        if self.target_tau is not None:
            with torch.no_grad():
                for tp, p in zip(self.target.parameters(), self.online.parameters()):
                    tp.lerp_(p, self.target_tau)
        return loss.detach()


def time_train_step(peer: TorchPeer, batch: dict, mode: str = "eager", tf32: bool = False, iters: int = 100,
                    warmup: int = 10, repeats: int = 5) -> dict:
    """Median milliseconds per train step of the peer, eager or CUDA-graphed.

    mode "eager": `zero_grad(set_to_none=True)` + `train_step` per iteration.
    mode "graphed": static input tensors (copies of `batch`), 3 warm-up steps on a side stream,
    grads set to None, one `torch.cuda.graph` capture of `train_step`, then `graph.replay()`
    per iteration (the peer must be built with capturable=True so AdamW's step lives on the GPU).
    tf32: torch.backends.cuda.matmul.allow_tf32 for the duration (restored afterwards).
    Timed with CUDA events over `iters` steps, `repeats` times; returns ms_median, ms_min, all.
    """
    torch = _torch()
    if mode not in ("eager", "graphed"):
        raise ValueError(f"time_train_step: mode must be 'eager' or 'graphed', got {mode!r}")
    old_tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
    torch.backends.cudnn.allow_tf32 = bool(tf32)
    try:
        if mode == "eager":
            def run_once():
                peer.optimizer.zero_grad(set_to_none=True)
                peer.train_step(batch)
        else:
            if not any(g.get("capturable", False) for g in peer.optimizer.param_groups):
                raise ValueError("time_train_step(mode='graphed') needs TorchPeer(..., capturable=True)")
            static = {k: v.clone() for k, v in batch.items()}
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    peer.optimizer.zero_grad(set_to_none=True)
                    peer.train_step(static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            peer.optimizer.zero_grad(set_to_none=True)
            with torch.cuda.graph(graph):
                peer.train_step(static)
            run_once = graph.replay

        for _ in range(warmup):
            run_once()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                run_once()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / iters)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old_tf32
    return {"mode": mode, "tf32": bool(tf32), "ms_median": statistics.median(times), "ms_min": min(times),
            "ms_all": times, "iters": iters}


# ---------------------------------------------------------------------------------------------
# IQN head and quantile Huber loss (agent.iqn; numbarl/rl/nets/iqn_head.py, rl/losses/quantile_huber.py)
# ---------------------------------------------------------------------------------------------
def _iqn_class():
    """nn.Module of the IQN head (defined on first use so that torch stays optional)."""
    if "iqn" in _CLASSES:
        return _CLASSES["iqn"]
    torch = _torch()
    from torch import nn

    class IqnHeadNet(nn.Module):
        """φ = ReLU(Linear(cos(π j τ))), x = h ⊙ φ, Z = Linear(x): [B·N, ΣA] (Dabney et al. 2018, Eq. 4)."""

        def __init__(self, n_embed: int, hidden: int, total_actions: int):
            super().__init__()
            self.n_embed = n_embed
            self.phi = nn.Linear(n_embed, hidden)
            self.out = nn.Linear(hidden, total_actions)

        def forward(self, h, tau):
            j = torch.arange(self.n_embed, device=tau.device, dtype=tau.dtype)
            cos = torch.cos((torch.pi * j).unsqueeze(0) * tau.reshape(-1, 1))  # [B·N, n]
            phi = torch.relu(self.phi(cos))
            x = h.repeat_interleave(tau.shape[1], dim=0) * phi  # row b·N + i holds h[b]
            return self.out(x)

    _CLASSES["iqn"] = IqnHeadNet
    return IqnHeadNet


def iqn_quantile_huber_loss(z, tau, z_target, a_star, actions, rewards, dones, discounts, branch_sizes,
                            kappa: float = 1.0):
    """The quantile Huber loss in torch (numbarl/rl/losses/quantile_huber.py): z [B·N, ΣA], tau [B, N],
    z_target [B·N′, ΣA] (detached), a_star / actions [B, n_branches]. Returns (loss, per_sample [B])."""
    torch = _torch()
    B, N = tau.shape
    z = z.view(B, N, -1)
    z_target = z_target.view(B, -1, z.shape[-1])
    gamma = discounts * (1.0 - dones)
    rows = torch.arange(B, device=z.device)
    ell = []
    off = 0
    for k, n in enumerate(branch_sizes):
        q = z[rows, :, off + actions[:, k]]  # [B, N]
        theta = rewards.unsqueeze(1) + gamma.unsqueeze(1) * z_target[rows, :, off + a_star[:, k]]  # [B, N′]
        u = theta.unsqueeze(1) - q.unsqueeze(2)  # [B, N, N′]
        huber = torch.nn.functional.huber_loss(q.unsqueeze(2).expand_as(u), theta.unsqueeze(1).expand_as(u),
                                               reduction="none", delta=kappa)
        rho = (tau.unsqueeze(2) - (u.detach() < 0).float()).abs() * huber / kappa
        ell.append(rho.mean(dim=2).sum(dim=1))
        off += n
    per_sample = torch.stack(ell, dim=1).mean(dim=1)
    return per_sample.mean(), per_sample.detach()


def iqn_loss_and_grads(values: dict, target_values: dict, h, h_next, tau, tau_target, next_q, actions, rewards, dones,
                       discounts, branch_sizes, next_mask=None, head: str = "iqn", device="cpu", kappa: float = 1.0):
    """The IQN auxiliary loss on given trunk outputs, the PyTorch way: online head on h with τ, target head
    (target_values) on h_next with τ′, a* = first argmax of next_q over the allowed actions (the C51 double-DQN
    action), loss.backward(). Returns {"loss", "per_sample", "dh" [B, H], "grads" {numbarl name: [in, out]}}."""
    torch = _torch()
    dev = torch.device(device)
    f32 = lambda a: torch.as_tensor(np.ascontiguousarray(np.asarray(a, np.float32)), device=dev)  # noqa: E731
    n_embed, hidden = np.shape(values[f"{head}.phi.w"])
    total = np.shape(values[f"{head}.out.w"])[1]
    nets = []
    for vals in (values, target_values):
        net = _iqn_class()(int(n_embed), int(hidden), int(total)).to(dev)
        with torch.no_grad():
            for part in ("phi", "out"):
                lin = getattr(net, part)
                lin.weight.copy_(f32(np.asarray(vals[f"{head}.{part}.w"]).T))
                lin.bias.copy_(f32(vals[f"{head}.{part}.b"]))
        nets.append(net)
    online, target = nets
    q = np.asarray(next_q, np.float64).copy()
    a_star = np.zeros((q.shape[0], len(branch_sizes)), np.int64)
    for k, n in enumerate(branch_sizes):
        qk = q[:, k, :n]
        if next_mask is not None:
            qk[np.asarray(next_mask)[:, k, :n] == 0] = -np.inf
        a_star[:, k] = np.argmax(qk, axis=1)
    h_t = f32(h).requires_grad_(True)
    with torch.no_grad():
        z_target = target(f32(h_next), f32(tau_target))
    z = online(h_t, f32(tau))
    loss, per_sample = iqn_quantile_huber_loss(
        z, f32(tau), z_target, torch.as_tensor(a_star, device=dev),
        torch.as_tensor(np.asarray(actions, np.int64), device=dev), f32(rewards),
        f32(np.asarray(dones) != 0), f32(discounts), tuple(branch_sizes), kappa)
    loss.backward()
    grads = {}
    for part in ("phi", "out"):
        lin = getattr(online, part)
        grads[f"{head}.{part}.w"] = lin.weight.grad.detach().cpu().numpy().T.copy()
        grads[f"{head}.{part}.b"] = lin.bias.grad.detach().cpu().numpy().copy()
    return {"loss": float(loss.detach().cpu()), "per_sample": per_sample.cpu().numpy(),
            "dh": h_t.grad.detach().cpu().numpy(), "grads": grads}


# ---------------------------------------------------------------------------------------------
# reward centering (agent.reward_centering; numbarl/rl/reward_center.py)
# ---------------------------------------------------------------------------------------------
def reward_center_step(reward_store, index, rbar: float, beta: float, gamma: float, windows, device="cpu"):
    """One simple-reward-centering step the PyTorch way (Naik et al. 2024): the batch's first rewards gathered
    from the replay's flat rewards (0 for an empty row, index −1), r̄ += β (mean − r̄) in float64, and every
    window's returns lowered by r̄/(1 − γ)·(1 − γ^m) in float32. windows: a list of (R [B], discount [B]).
    Returns (r̄, the centered returns of each window)."""
    torch = _torch()
    dev = torch.device(device)
    flat = torch.as_tensor(np.asarray(reward_store, np.float32), device=dev).reshape(-1)
    idx = torch.as_tensor(np.asarray(index, np.int64), device=dev)
    first = torch.where(idx >= 0, flat[idx.clamp(min=0)], torch.zeros((), dtype=flat.dtype, device=dev))
    rbar = float(rbar) + float(beta) * (float(first.double().mean()) - float(rbar))
    offset = torch.tensor(rbar / (1.0 - float(gamma)), dtype=torch.float32, device=dev)
    out = []
    for r, d in windows:
        r_t = torch.as_tensor(np.asarray(r, np.float32), device=dev)
        d_t = torch.as_tensor(np.asarray(d, np.float32), device=dev)
        out.append((r_t - offset * (1.0 - d_t)).cpu().numpy())
    return rbar, out


# ---------------------------------------------------------------------------------------------
# the ensemble's extra C51 heads (agent.ensemble_heads; numbarl/rl/nets/ensemble.py)
# ---------------------------------------------------------------------------------------------
def ensemble_heads_loss_and_grads(h, h_next, h_target, params, target, names, masks, actions, rewards, dones,
                                  discounts, support, branch_sizes):
    """The extra heads the PyTorch way: V and A as x @ W + b with numbarl's weights, dueling logits per branch,
    the online argmax on the next trunk features, the target head's probabilities at it, the dense projection,
    the cross-entropy at the taken actions, each head's loss the mean over the batch of its bootstrap mask times the
    mean over branches, and Σ_m L_m.backward(). params/target: {name: array} (numbarl's parameter names);
    names: per extra head {"w_value", "b_value", "w_adv", "b_adv"} → its parameter names; masks [M, B].
    Returns (∂L/∂h [B, H], per head {"w_value", "b_value", "w_adv", "b_adv"} gradients), float32 on the CPU."""
    torch = _torch()
    t = lambda a: torch.as_tensor(np.ascontiguousarray(np.asarray(a, np.float32)))  # noqa: E731
    keys = ("w_value", "b_value", "w_adv", "b_adv")
    h_t = t(h).requires_grad_(True)

    def logits_of(x, wv, bv, wa, ba):
        return dueling_logits(x @ wv + bv, x @ wa + ba, branch_sizes)

    batch = {"obs": h_t, "next_obs": t(h_next), "actions": torch.as_tensor(np.asarray(actions, np.int64)),
             "rewards": t(rewards), "dones": t(dones), "discounts": t(discounts)}
    total, leaves = 0.0, []
    for m, n in enumerate(names):  # each extra head: c51_loss on the trunk features, its bootstrap mask as weights
        ws = [t(params[n[k]]).requires_grad_(True) for k in keys]
        leaves.append(ws)
        target_logits = logits_of(t(h_target), *[t(target[n[k]]) for k in keys])
        loss, _ = c51_loss(lambda x, ws=ws: logits_of(x, *ws), lambda _x, tl=target_logits: tl,
                           {**batch, "weights": t(masks[m])}, t(support))
        total = total + loss
    total.backward()
    grads = [{k: x.grad.numpy() for k, x in zip(keys, ws)} for ws in leaves]
    return h_t.grad.numpy(), grads


# ---------------------------------------------------------------------------------------------
# adaptive atom positions (agent.adaptive_atoms; numbarl/rl/losses/atoms.py)
# ---------------------------------------------------------------------------------------------
def atom_entropy_and_grad(spacing_raw, v_min: float, v_max: float, rewards, dones, discounts, probs,
                          m_floor: float = 1e-12, device="cpu"):
    """J(s) = H(m̄), the entropy of the batch-mean projected target on the support z(s), and ∂J/∂s by autograd
    (float64): z = v_min + (v_max − v_min)·c/c_{Z−1}, c = [0, cumsum(softplus(s))]; each row's target atoms
    x = clip(r + γ z, z_0, z_{Z−1}) split between the support atoms around them (Algorithm 1 on any spacing), the
    masses scattered with index_add; J = −Σ m̄ log max(m̄, m_floor) (an empty atom adds 0 to J and its floored
    log to the gradient, as numbarl's analytic gradient takes it). probs [B, n_branches, Z] (the target net's
    distribution at a*), rewards/dones/discounts [B]. Returns (J, ∂J/∂s [Z−1])."""
    torch = _torch()
    dev, f64 = torch.device(device), torch.float64
    s = torch.as_tensor(np.asarray(spacing_raw, np.float64), device=dev).requires_grad_(True)
    p = torch.as_tensor(np.asarray(probs, np.float64), device=dev)
    batch, n_branches, n_atoms = p.shape
    p = p.reshape(batch * n_branches, n_atoms)
    gamma = np.asarray(discounts, np.float64) * (1.0 - np.asarray(dones, np.float64))
    r = torch.as_tensor(np.repeat(np.asarray(rewards, np.float64), n_branches), device=dev)[:, None]
    g = torch.as_tensor(np.repeat(gamma, n_branches), device=dev)[:, None]
    c = torch.cat([torch.zeros(1, dtype=f64, device=dev), torch.cumsum(torch.nn.functional.softplus(s), 0)])
    z = v_min + (v_max - v_min) * c / c[-1]
    x = torch.minimum(torch.maximum(r + g * z[None, :], z[0]), z[-1])
    lower = torch.searchsorted(z.detach(), x.detach().contiguous(), right=True) - 1  # z_l <= x < z_u
    l = torch.clamp(lower, max=n_atoms - 2)
    w_u = (x - z[l]) / (z[l + 1] - z[l])
    m = torch.zeros(n_atoms, dtype=f64, device=dev)
    m = m.index_add(0, l.reshape(-1), (p * (1.0 - w_u)).reshape(-1)).index_add(0, (l + 1).reshape(-1),
                                                                                 (p * w_u).reshape(-1))
    m = m / p.shape[0]
    j = -(m * torch.log(torch.clamp(m, min=m_floor))).sum()
    j.backward()
    return float(j.detach().cpu()), s.grad.detach().cpu().numpy()


# ---------------------------------------------------------------------------------------------
# CQL(H) regularizer (agent.cql_alpha; numbarl/rl/losses/cql.py)
# ---------------------------------------------------------------------------------------------
def cql_loss_and_grads(logits, actions, support, branch_sizes, device="cpu"):
    """The CQL(H) term on given online logits, the PyTorch way (d3rlpy's DiscreteCQL formula per branch on
    the C51 head's expected values): Q = Σ_z softmax(logits)·z, R[b, k] = logsumexp_a Q[b, k, a] − Q[b, k, a_bk],
    loss = mean_b mean_k R, loss.backward(). logits [B, n_branches, max_actions, Z] (padding rows are
    never read), actions [B, n_branches]. Returns {"loss", "per_sample" [B], "d_logits" (same layout, 0 at
    padding)}."""
    torch = _torch()
    dev = torch.device(device)
    x = torch.as_tensor(np.ascontiguousarray(np.asarray(logits, np.float32)), device=dev).requires_grad_(True)
    z = torch.as_tensor(np.asarray(support, np.float32), device=dev)
    a = torch.as_tensor(np.asarray(actions, np.int64), device=dev)
    rows = torch.arange(x.shape[0], device=dev)
    reg = []
    for k, n in enumerate(branch_sizes):
        q = (torch.softmax(x[:, k, :n, :], dim=-1) * z).sum(-1)  # [B, A_k]
        reg.append(torch.logsumexp(q, dim=1) - q[rows, a[:, k]])
    per_sample = torch.stack(reg, dim=1).mean(dim=1)
    loss = per_sample.mean()
    loss.backward()
    return {"loss": float(loss.detach().cpu()), "per_sample": per_sample.detach().cpu().numpy(),
            "d_logits": x.grad.detach().cpu().numpy()}


def margin_loss_and_grads(logits, labels, support, branch: int, n_actions: int, margin: float, scale: float,
                          device="cpu"):
    """DQfD's large-margin loss (Hester et al. 2018, Eq. 2) on one branch of given online logits, the
    PyTorch way: Q = Σ_z softmax(logits)·z, J[b] = max_a (Q[b, a] + l·[a ≠ a_E]) − Q[b, a_E] for the
    labelled samples (label ≥ 0), loss = scale · Σ_b J[b], loss.backward() (E7, numbarl/rl/losses/margin.py).
    Returns {"loss", "per_sample" [B], "d_logits" (the logits' layout)}."""
    torch = _torch()
    dev = torch.device(device)
    x = torch.as_tensor(np.ascontiguousarray(np.asarray(logits, np.float32)), device=dev).requires_grad_(True)
    z = torch.as_tensor(np.asarray(support, np.float32), device=dev)
    lab = torch.as_tensor(np.asarray(labels, np.int64), device=dev)
    q = (torch.softmax(x[:, branch, :n_actions, :], dim=-1) * z).sum(-1)  # [B, A]
    keep = lab >= 0
    safe = torch.where(keep, lab, torch.zeros_like(lab))
    lifted = q + margin * (torch.arange(n_actions, device=dev)[None, :] != safe[:, None]).to(q.dtype)
    per_sample = torch.where(keep, lifted.max(dim=1).values - q.gather(1, safe[:, None])[:, 0], torch.zeros_like(q[:, 0]))
    loss = scale * per_sample.sum()
    loss.backward()
    return {"loss": float(loss.detach().cpu()), "per_sample": per_sample.detach().cpu().numpy(),
            "d_logits": x.grad.detach().cpu().numpy()}


# ---------------------------------------------------------------------------------------------
# IQL value head and expectile loss (agent.iql; numbarl/rl/nets/iql_value.py, rl/losses/expectile.py)
# ---------------------------------------------------------------------------------------------
def iql_loss_and_grads(values: dict, h, q_target, actions, branch_sizes, expectile: float = 0.7, head: str = "iql",
                       device="cpu"):
    """The IQL value loss on given trunk features, the PyTorch way: V = Linear(SiLU(Linear(h))) with numbarl's
    weights ([in, out], transposed into nn.Linear), Q̂ = mean over branches of q_target [B, n_branches, max_actions]
    at the taken actions (a constant), u = Q̂ − V, loss = mean |τ − 1{u<0}| u², loss.backward().
    Returns {"loss", "per_sample" [B], "v" [B], "dh" [B, H], "grads" {numbarl name: [in, out]}}."""
    torch = _torch()
    from torch import nn

    dev = torch.device(device)
    f32 = lambda a: torch.as_tensor(np.ascontiguousarray(np.asarray(a, np.float32)), device=dev)  # noqa: E731
    hidden_in, hidden = np.shape(values[f"{head}.fc0.w"])
    fc0, out = nn.Linear(int(hidden_in), int(hidden)).to(dev), nn.Linear(int(hidden), 1).to(dev)
    with torch.no_grad():
        for lin, part in ((fc0, "fc0"), (out, "out")):
            lin.weight.copy_(f32(np.asarray(values[f"{head}.{part}.w"]).T))
            lin.bias.copy_(f32(values[f"{head}.{part}.b"]))
    net = nn.Sequential(fc0, nn.SiLU(), out)
    h_t = f32(h).requires_grad_(True)
    v = net(h_t).squeeze(1)  # [B]
    q = f32(q_target)
    a = torch.as_tensor(np.asarray(actions, np.int64), device=dev)
    rows = torch.arange(q.shape[0], device=dev)
    q_hat = torch.stack([q[rows, k, a[:, k]] for k in range(len(branch_sizes))], dim=1).mean(dim=1)
    u = q_hat - v
    weight = torch.where(u.detach() < 0, 1.0 - expectile, expectile)
    per_sample = weight * u * u
    loss = per_sample.mean()
    loss.backward()
    grads = {}
    for lin, part in ((fc0, "fc0"), (out, "out")):
        grads[f"{head}.{part}.w"] = lin.weight.grad.detach().cpu().numpy().T.copy()
        grads[f"{head}.{part}.b"] = lin.bias.grad.detach().cpu().numpy().copy()
    return {"loss": float(loss.detach().cpu()), "per_sample": per_sample.detach().cpu().numpy(),
            "v": v.detach().cpu().numpy(), "dh": h_t.grad.detach().cpu().numpy(), "grads": grads}


# --- recursive confidence (agent.confidence_weight; numbarl/rl/nets/confidence.py, rl/losses/confidence.py) ---
def confidence_loss_and_grads(values: dict, h, target_values: dict, h_next, q, actions, rewards, dones,
                              epsilon: float = 1e-6, head: str = "conf", device="cpu"):
    """The confidence head's loss the PyTorch way: z = nn.Linear(H, 1)(h) with numbarl's weights ([in, out],
    transposed), the target z′ = the same layer with `target_values` on h_next (no grad), y built from the
    online q_gap of the direction branch, the taken side and R_n (numbarl/rl/losses/confidence.py),
    loss = F.binary_cross_entropy_with_logits(z, y), loss.backward().
    Returns {"loss", "per_sample" [B], "c" [B], "y" [B], "dz" [B, 1], "dh" [B, H], "grads" {numbarl name}}."""
    torch = _torch()
    from torch import nn
    from torch.nn import functional as F

    from numbarl.env.params import BR_DIRECTION, DIR_LONG, DIR_SHORT

    dev = torch.device(device)
    f32 = lambda a: torch.as_tensor(np.ascontiguousarray(np.asarray(a, np.float32)), device=dev)  # noqa: E731
    in_dim = int(np.shape(values[f"{head}.fc.w"])[0])
    lin, lin_t = nn.Linear(in_dim, 1).to(dev), nn.Linear(in_dim, 1).to(dev)
    with torch.no_grad():
        for layer, vals in ((lin, values), (lin_t, target_values)):
            layer.weight.copy_(f32(np.asarray(vals[f"{head}.fc.w"]).T))
            layer.bias.copy_(f32(vals[f"{head}.fc.b"]))
    h_t = f32(h).requires_grad_(True)
    z = lin(h_t).squeeze(1)
    z.retain_grad()
    with torch.no_grad():
        c_next = torch.sigmoid(lin_t(f32(h_next)).squeeze(1))
        qt = f32(q)
        gap = qt[:, BR_DIRECTION, DIR_LONG] - qt[:, BR_DIRECTION, DIR_SHORT]
        a = torch.as_tensor(np.asarray(actions, np.int64)[:, BR_DIRECTION], device=dev)
        side = (a == DIR_LONG).float() - (a == DIR_SHORT).float()
        r, done = f32(rewards), f32(dones) != 0
        informative = (side != 0) & (r.abs() >= epsilon)
        right = (r * side * gap > 0).float()
        y = torch.where(informative, right, torch.where(done, torch.full_like(r, 0.5), c_next))
    per_sample = F.binary_cross_entropy_with_logits(z, y, reduction="none")
    loss = per_sample.mean()
    loss.backward()
    grads = {f"{head}.fc.w": lin.weight.grad.detach().cpu().numpy().T.copy(),
             f"{head}.fc.b": lin.bias.grad.detach().cpu().numpy().copy()}
    return {"loss": float(loss.detach().cpu()), "per_sample": per_sample.detach().cpu().numpy(),
            "c": torch.sigmoid(z).detach().cpu().numpy(), "y": y.cpu().numpy(),
            "dz": z.grad.detach().cpu().numpy()[:, None], "dh": h_t.grad.detach().cpu().numpy(), "grads": grads}
# --- end recursive confidence ------------------------------------------------------------------------------


# --- spectral normalization (agent.spectral_norm; numbarl/rl/nets/spectral_norm.py) ----------------------
def spectral_linear_peer(x, w, b, u, v, dy, n_power_iterations: int = 1):
    """A dense layer under torch.nn.utils.parametrizations.spectral_norm, with numbarl's vectors.

    x [B, in], w [in, out] (numbarl's layout), b [out], u [out], v [in] (the parametrization's _u, _v:
    PyTorch's weight is wᵀ [out, in]), dy [B, out]. In training mode the forward runs
    n_power_iterations power iterations, then y = x·(W/σ)ᵀ + b; backward from dy.
    Returns float64 numpy {"y", "dw" ([in, out]), "db", "u", "v", "sigma"} (float32 computation, CPU).
    """
    torch = _torch()
    from torch.nn.utils.parametrizations import spectral_norm

    f32 = lambda a: torch.tensor(np.asarray(a, np.float32))  # noqa: E731
    lin = torch.nn.Linear(w.shape[0], w.shape[1])
    with torch.no_grad():
        lin.weight.copy_(f32(w).T)
        lin.bias.copy_(f32(b))
    lin = spectral_norm(lin, n_power_iterations=int(n_power_iterations))
    param = lin.parametrizations.weight
    with torch.no_grad():  # the registration ran its own 15 iterations from random vectors: ours instead
        param[0]._u.copy_(f32(u))
        param[0]._v.copy_(f32(v))
    lin.train()
    y = lin(f32(x))
    y.backward(f32(dy))
    sn = param[0]
    sigma = torch.vdot(sn._u, torch.mv(param.original.detach(), sn._v))
    as64 = lambda t: t.detach().double().numpy()  # noqa: E731
    return {"y": as64(y), "dw": as64(param.original.grad).T.copy(), "db": as64(lin.bias.grad),
            "u": as64(sn._u), "v": as64(sn._v), "sigma": float(sigma)}
# --- end spectral normalization ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# PPO loss (agent.kind = "ppo"; numbarl/rl/losses/ppo.py)
# ---------------------------------------------------------------------------------------------
def ppo_loss_and_grads(logits, value, actions, logp_old, adv, ret, mask, branch_sizes, clip_eps=0.2, vf_coef=0.5,
                       ent_coef=0.01, dtype="float64", device="cpu"):
    """The PPO loss the PyTorch way (CleanRL's ppo.py arrangement): per branch a masked log_softmax
    (masked logits filled with −inf), the joint log-prob the sum over branches, ratio = exp(logp − logp_old),
    pg = max(−A·ratio, −A·clamp(ratio, 1 − ε, 1 + ε)), v = ½(V − R)², entropy summed over branches,
    loss = mean(pg + c_v·v − c_e·H), loss.backward(). logits [B, Σ A_k], value [B, 1], mask
    [B, n_branches, max_actions]. Returns {"loss", "d_logits", "d_value", "per_sample"} (numpy)."""
    torch = _torch()
    dev = torch.device(device)
    dt = getattr(torch, dtype)
    x = torch.as_tensor(np.asarray(logits, np.float64), dtype=dt, device=dev).requires_grad_(True)
    v = torch.as_tensor(np.asarray(value, np.float64), dtype=dt, device=dev).requires_grad_(True)
    a = torch.as_tensor(np.asarray(actions, np.int64), device=dev)
    m = torch.as_tensor(np.asarray(mask) != 0, device=dev)
    rows = torch.arange(x.shape[0], device=dev)
    logp = torch.zeros(x.shape[0], dtype=dt, device=dev)
    ent = torch.zeros(x.shape[0], dtype=dt, device=dev)
    o = 0
    for k, n in enumerate(branch_sizes):
        mk = m[:, k, :n]
        lp = torch.log_softmax(x[:, o:o + n].masked_fill(~mk, float("-inf")), dim=1)
        lp_safe = torch.where(mk, lp, torch.zeros_like(lp))
        logp = logp + lp_safe[rows, a[:, k]]
        ent = ent - (lp_safe.exp() * lp_safe * mk).sum(dim=1)
        o += n
    ratio = torch.exp(logp - torch.as_tensor(np.asarray(logp_old, np.float64), dtype=dt, device=dev))
    A = torch.as_tensor(np.asarray(adv, np.float64), dtype=dt, device=dev)
    pg = torch.max(-A * ratio, -A * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps))
    vl = 0.5 * (v[:, 0] - torch.as_tensor(np.asarray(ret, np.float64), dtype=dt, device=dev)) ** 2
    per_sample = pg + vf_coef * vl - ent_coef * ent
    loss = per_sample.mean()
    loss.backward()
    return {"loss": float(loss.detach().cpu()), "per_sample": per_sample.detach().cpu().numpy(),
            "d_logits": x.grad.detach().cpu().numpy(), "d_value": v.grad.detach().cpu().numpy()}
