"""JAX peer of the numbarl learner: the same network, loss, AdamW and acting step, jitted by XLA.

What a JAX researcher would write (Dopamine's rainbow_agent / PureJaxRL style: pure functions,
one jitted update): a trunk of dense layers, the dueling branched C51 head, the dense Eq. 7
projection (Bellemare et al. 2017; see `numbarl.rl.losses.c51`), cross-entropy averaged over
branches then over the batch, global-norm clipping and AdamW, all in one `jax.jit` whose state
(online and target parameters, Adam moments, step counter) is donated so XLA updates it in place.
Beside the PyTorch peer (`numbarl.rl.torch_peer`, whose `PeerSpec` / `TrunkOp` it reuses) it
serves two things:

1. **checking numbarl**: load the same weights (numbarl's ParamStore host dict, weights
   [in, out] — JAX's x @ W reads them as they are), run one batch, compare loss and gradients
   (`JaxPeer.loss_and_grads`, gradients under numbarl's names and layout);
2. **timing**: `time_train_step(peer, batch, tf32=...)` runs the whole jitted train step
   (online forward on next_obs for the argmax, target forward, online forward on obs, loss,
   backward, clip, AdamW, target update) and `time_act(peer, obs, tf32=...)` the acting step
   (online forward + greedy argmax per branch over N observations), after warm-up (compile),
   timed on the host with `block_until_ready`.

The train step, phase by phase (B = batch, K = n_branches, A_k actions of branch k, Z atoms)::

    # TARGETS   a*_k = argmax_a Σ_z softmax(online(next_obs)[k, a])_z · z_z   (first max; over the
    #                  next_mask's available actions when the batch has one)      [B, K]
    #           p_k  = softmax(target(next_obs)[k, a*_k])                         [B, Z]
    #           m_k  = Σ_j clip(1 - |clip(r + γ z_j, v_min, v_max) - z_i| / Δz, 0, 1) · p_k,j   Eq. 7
    #                  γ = discount · (1 - done)                                  [B, Z]
    # LOSS      L = (1/B) Σ_b w_b · (1/K) Σ_k -Σ_i m_k,i · log softmax(online(obs)[k, a_k])_i
    # BACKWARD  jax.grad of L (targets are constants: computed outside the differentiated function)
    # UPDATE    norm = sqrt(Σ g²); s = min(1, max_norm / (norm + clip_eps))     (max_norm 0: s = 1)
    #           m = β1 m + (1-β1) s g;  v = β2 v + (1-β2) (s g)²;  t = t + 1
    #           p = p · (1 - lr · wd)            only for the tensors numbarl marks `decay` (numbarl folds
    #                                            lr·wd·p into the step below: the same value, other rounding)
    #           p = p - lr / (1-β1^t) · m / (sqrt(v) / sqrt(1-β2^t) + eps)     (torch.optim.AdamW)
    #           a non-finite norm skips the whole update (skip_nonfinite, as numbarl.rl.optim)
    #           target = tau · p + (1 - tau) · target when t % target_period == 0 (tau 1: copy)

Conventions shared with numbarl and the PyTorch peer (so the comparison is exact up to float32
rounding): the padded [B, K, max_actions, Z] layout of `outputs` (logits -inf, probs 0, Q -inf at
padding); the support is numbarl's `make_support` (float64 linspace cast to float32); the
projection and E[Z] are elementwise products and sums, never matmuls, so the precision switch
only touches the network's GEMMs, as numbarl's `compute="tf32"` does. The bias corrections
1 - β^t are evaluated as -expm1(t · log β) in float32: accurate to a few ulps at every t (the naive
float32 1 - 0.999^1 is off by ~6e-5 relative; numbarl evaluates them in float64 on one thread).

Precision: tf32=False runs under `jax.default_matmul_precision("float32")`, tf32=True under
`"tensorfloat32"`; each is a separate compilation (the precision is a static argument of the
module-level jitted functions and is entered inside them, so the caller's own setting does not
leak in; peers with the same spec, precision and hyper-parameters share one compilation).

jax is an optional extra, never a runtime dependency: this module imports without it and every
function imports jax when called (`pip install numbarl[jax]` installs the CPU build; on a CUDA host
install the wheel matching the driver yourself: `pip install "jax[cuda12]"` or `"jax[cuda13]"`).
On first use it sets XLA_PYTHON_CLIENT_PREALLOCATE=false unless the environment sets it: XLA would
otherwise reserve 75% of the GPU's memory up front, beside numbarl's own arenas.
"""

from __future__ import annotations

import math
import os
import statistics
import time

import numpy as np

from numbarl.rl.torch_peer import ACTIVATIONS, PeerSpec, TrunkOp, trunk_ops_from_layers

__all__ = ["JaxPeer", "PeerSpec", "TrunkOp", "adamw_update", "batch_to_jax", "c51_loss", "c51_targets",
           "greedy_actions", "import_jax", "net_apply", "project_distribution", "time_act", "time_train_step",
           "trunk_ops_from_layers"]

PRECISIONS = {False: "float32", True: "tensorfloat32"}  # tf32 flag -> jax.default_matmul_precision
BATCH_KEYS = ("obs", "next_obs", "actions", "rewards", "dones", "discounts")  # required; weights, next_mask optional


def import_jax():
    """The jax module, imported on first use (XLA's up-front GPU reservation off unless the
    environment says otherwise: module docstring), or an ImportError saying how to install it."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # see the module docstring
    try:
        import jax
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError(
            "the JAX peer needs jax, which numbarl itself does not: pip install numbarl[jax] (CPU build); "
            "on a CUDA host install the wheel for your driver instead, e.g. pip install \"jax[cuda12]\" "
            "or \"jax[cuda13]\"") from e
    return jax


# ---------------------------------------------------------------------------------------------
# the network (pure functions of a {numbarl name: array} dict; traced inside jit)
# ---------------------------------------------------------------------------------------------
def trunk_apply(ops, params: dict, x):
    """The trunk ops in order on x [B, D] -> h [B, H] (weights [in, out]: y = x @ W + b)."""
    jax = import_jax()
    jnp = jax.numpy
    for op in ops:
        if op.kind == "linear":
            x = x @ params[op.weight]
            if op.bias is not None:
                x = x + params[op.bias]
        elif op.kind == "layernorm":  # biased variance, eps inside the root (torch.nn.LayerNorm)
            mean = jnp.mean(x, axis=-1, keepdims=True)
            var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
            x = (x - mean) * jax.lax.rsqrt(var + op.eps) * params[op.weight]
            if op.bias is not None:
                x = x + params[op.bias]
        elif op.kind == "relu":
            x = jax.nn.relu(x)
        elif op.kind == "silu":
            x = jax.nn.silu(x)
        elif op.kind == "gelu":  # the tanh form, as the PyTorch peer's nn.GELU(approximate="tanh")
            x = jax.nn.gelu(x, approximate=True)
        elif op.kind == "tanh":
            x = jnp.tanh(x)
        else:  # TrunkOp validates its kind; a new kind must be taught here too
            raise ValueError(f"jax peer: trunk op {op.kind!r} is not implemented (known: linear, layernorm, "
                             f"{', '.join(ACTIVATIONS)})")
    return x


def net_apply(spec: PeerSpec, params: dict, obs) -> list:
    """trunk -> V [B, Z] and A [B, ΣA·Z] -> per-branch dueling logits, a list of [B, A_k, Z]
    (numbarl.rl.nets.c51_head: logits = V + A_k - mean_a A_k; branch k's columns of A are
    (offset_k + a)·Z + z)."""
    h = trunk_apply(spec.trunk, params, obs)
    value = h @ params[f"{spec.head}.value.w"] + params[f"{spec.head}.value.b"]  # [B, Z]
    adv = h @ params[f"{spec.head}.adv.w"] + params[f"{spec.head}.adv.b"]  # [B, ΣA·Z]
    n_atoms = value.shape[-1]
    logits, offset = [], 0
    for n in spec.branch_sizes:
        a_k = adv[:, offset * n_atoms:(offset + n) * n_atoms].reshape(-1, n, n_atoms)  # [B, A_k, Z]
        logits.append(value[:, None, :] + a_k - a_k.mean(axis=1, keepdims=True))
        offset += n
    return logits


def expected_q(logits_k, support):
    """E[Z] = Σ_z softmax(logits)_z · z_z over the last axis: [..., Z] -> [...] (a product and a
    sum, not a matmul: unaffected by the TF32 switch)."""
    jax = import_jax()
    return jax.numpy.sum(jax.nn.softmax(logits_k, axis=-1) * support, axis=-1)


def greedy_actions(logits: list, support, mask=None):
    """First argmax of E[Z] per branch: [B, K] int32. mask [B, K, max_actions] (0 = not available):
    the argmax runs over the available actions only (none available: action 0, as numbarl)."""
    jnp = import_jax().numpy
    out = []
    for k, logits_k in enumerate(logits):
        q = expected_q(logits_k, support)  # [B, A_k]
        if mask is not None:
            q = jnp.where(mask[:, k, :q.shape[1]] != 0, q, -jnp.inf)
        out.append(jnp.argmax(q, axis=1).astype(jnp.int32))
    return jnp.stack(out, axis=1)


# ---------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------
def project_distribution(rewards, dones, discounts, next_probs, support):
    """Dense Eq. 7 (numbarl.rl.losses.c51.project_distribution_ref): [B, Z] -> [B, Z].

    m_i = Σ_j clip(1 - |clip(r + γ z_j, v_min, v_max) - z_i| / Δz, 0, 1) · p_j, γ = discount·(1 - done).
    """
    jnp = import_jax().numpy
    delta_z = support[1] - support[0]
    gamma = discounts * (1.0 - dones)  # [B]
    target_z = jnp.clip(rewards[:, None] + gamma[:, None] * support[None, :], support[0], support[-1])  # [B, Zj]
    hat = jnp.clip(1.0 - jnp.abs(target_z[:, None, :] - support[None, :, None]) / delta_z, 0.0, 1.0)  # [B, Zi, Zj]
    return jnp.sum(hat * next_probs[:, None, :], axis=-1)  # [B, Zi]


def c51_targets(spec: PeerSpec, params: dict, target_params: dict, batch: dict, support, next_actions=None):
    """Double-DQN targets m_k [B, Z] per branch (a list): online argmax on next_obs (or
    `next_actions` [B, K]), target-network probabilities at a*, Eq. 7. Constants for the gradient."""
    jax = import_jax()
    jnp = jax.numpy
    next_online = net_apply(spec, params, batch["next_obs"])
    next_target = net_apply(spec, target_params, batch["next_obs"])
    if next_actions is None:
        next_actions = greedy_actions(next_online, support, batch.get("next_mask"))  # [B, K]
    targets = []
    for k, logits_k in enumerate(next_target):
        taken = jnp.take_along_axis(logits_k, next_actions[:, k, None, None], axis=1)[:, 0]  # [B, Z]
        p = jax.nn.softmax(taken, axis=-1)
        targets.append(project_distribution(batch["rewards"], batch["dones"], batch["discounts"], p, support))
    return [jax.lax.stop_gradient(m) for m in targets]


def c51_loss(spec: PeerSpec, params: dict, batch: dict, targets: list):
    """(loss, per_sample [B]): L = (1/B) Σ_b w_b · (1/K) Σ_k CE[b, k], per_sample unweighted."""
    jax = import_jax()
    jnp = jax.numpy
    ce = []
    for k, logits_k in enumerate(net_apply(spec, params, batch["obs"])):
        taken = jnp.take_along_axis(logits_k, batch["actions"][:, k, None, None], axis=1)[:, 0]  # [B, Z]
        ce.append(-jnp.sum(targets[k] * jax.nn.log_softmax(taken, axis=-1), axis=-1))
    per_sample = jnp.mean(jnp.stack(ce, axis=1), axis=1)  # mean over branches, [B]
    weights = batch.get("weights")
    loss = jnp.mean(per_sample * weights) if weights is not None else jnp.mean(per_sample)
    return loss, per_sample


# ---------------------------------------------------------------------------------------------
# the optimizer (numbarl.rl.optim's AdamW, clip and target update, written over a dict of arrays)
# ---------------------------------------------------------------------------------------------
def adamw_update(state: dict, grads: dict, hyper: dict, decay: frozenset) -> dict:
    """One optimizer step on state {"params", "target", "m", "v": {name: array}, "step": int32 []}.

    hyper: lr, beta1, beta2, eps, weight_decay, max_grad_norm, clip_eps, skip_nonfinite,
    target_tau (None: no target update), target_period (see the module docstring for the math).
    Returns the new state plus "grad_norm" and "clip_scale" (float32 scalars).
    """
    jnp = import_jax().numpy
    f32 = jnp.float32
    names = sorted(grads)  # a fixed order for the norm's sum
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(grads[n])) for n in names))
    if hyper["max_grad_norm"] > 0.0:
        scale = jnp.minimum(f32(1.0), f32(hyper["max_grad_norm"]) / (norm + f32(hyper["clip_eps"])))
    else:
        scale = f32(1.0)
    ok = jnp.isfinite(norm) if hyper["skip_nonfinite"] else jnp.bool_(True)
    t = state["step"] + 1
    tf = t.astype(f32)
    # 1 - β^t = -expm1(t · log β): no cancellation at small t (module docstring)
    bias1 = -jnp.expm1(tf * f32(math.log(hyper["beta1"])))
    bias2 = -jnp.expm1(tf * f32(math.log(hyper["beta2"])))
    step_size = f32(hyper["lr"]) / bias1
    inv_sqrt_bias2 = 1.0 / jnp.sqrt(bias2)
    b1, b2 = f32(hyper["beta1"]), f32(hyper["beta2"])
    one_minus_b1, one_minus_b2 = f32(1.0 - hyper["beta1"]), f32(1.0 - hyper["beta2"])  # rounded once
    shrink = f32(1.0 - hyper["lr"] * hyper["weight_decay"])
    new = {"params": {}, "m": {}, "v": {}, "target": {}}
    for n in names:
        p, g = state["params"][n], grads[n] * scale
        m = b1 * state["m"][n] + one_minus_b1 * g
        v = b2 * state["v"][n] + one_minus_b2 * g * g
        p_new = p * shrink if n in decay else p
        p_new = p_new - step_size * m / (jnp.sqrt(v) * inv_sqrt_bias2 + f32(hyper["eps"]))
        new["params"][n] = jnp.where(ok, p_new, p)
        new["m"][n] = jnp.where(ok, m, state["m"][n])
        new["v"][n] = jnp.where(ok, v, state["v"][n])
    step = jnp.where(ok, t, state["step"])
    tau = hyper["target_tau"]
    for n in names:
        old = state["target"][n]
        if tau is None:
            new["target"][n] = old
            continue
        update = ok & (t % int(hyper["target_period"]) == 0)
        blended = new["params"][n] if tau == 1.0 else f32(tau) * new["params"][n] + f32(1.0 - tau) * old
        new["target"][n] = jnp.where(update, blended, old)
    new["step"] = step
    new["grad_norm"] = norm
    new["clip_scale"] = jnp.where(ok, scale, f32(0.0))
    return new


# ---------------------------------------------------------------------------------------------
# the jitted steps (module level: peers with the same spec, precision and hyper-parameters share
# one compilation; spec, precision and hyper are static arguments, the arrays are traced)
# ---------------------------------------------------------------------------------------------
_JITTED = {}


def _loss_and_grads(params, target, batch, support, next_actions, *, spec, precision):
    jax = import_jax()
    with jax.default_matmul_precision(precision):
        targets = c51_targets(spec, params, target, batch, support, next_actions)
        (loss, per_sample), grads = jax.value_and_grad(lambda p: c51_loss(spec, p, batch, targets),
                                                       has_aux=True)(params)
    return loss, per_sample, grads


def _train_step(state, batch, support, *, spec, precision, hyper):
    jax = import_jax()
    with jax.default_matmul_precision(precision):
        # TARGETS (double DQN: online argmax on next_obs, target-network probabilities, Eq. 7)
        targets = c51_targets(spec, state["params"], state["target"], batch, support)
        # LOSS + BACKWARD
        (loss, _), grads = jax.value_and_grad(lambda p: c51_loss(spec, p, batch, targets),
                                              has_aux=True)(state["params"])
        # UPDATE (clip, AdamW, target)
        new = adamw_update(state, grads, dict(hyper), frozenset(spec.decay))
    stats = {"loss": loss, "grad_norm": new.pop("grad_norm"), "clip_scale": new.pop("clip_scale")}
    return new, stats


def _act(params, obs, support, mask, *, spec, precision):
    jax = import_jax()
    with jax.default_matmul_precision(precision):
        return greedy_actions(net_apply(spec, params, obs), support, mask)


def _outputs(params, obs, support, *, spec, precision):
    jax = import_jax()
    with jax.default_matmul_precision(precision):
        logits = net_apply(spec, params, obs)
        return logits, [jax.nn.softmax(lk, axis=-1) for lk in logits], [expected_q(lk, support) for lk in logits]


def _jitted(what: str):
    """The jitted function `what` (built on first use: jax is imported lazily). The train step
    donates its state: XLA writes the new parameters and moments over the old buffers."""
    if not _JITTED:
        jax = import_jax()
        _JITTED.update({
            "loss_and_grads": jax.jit(_loss_and_grads, static_argnames=("spec", "precision")),
            "train_step": jax.jit(_train_step, static_argnames=("spec", "precision", "hyper"), donate_argnums=0),
            "act": jax.jit(_act, static_argnames=("spec", "precision")),
            "outputs": jax.jit(_outputs, static_argnames=("spec", "precision")),
        })
    return _JITTED[what]


# ---------------------------------------------------------------------------------------------
# the peer
# ---------------------------------------------------------------------------------------------
def batch_to_jax(batch: dict, device=None) -> dict:
    """numpy batch -> jax arrays on `device` (None: jax's default): obs/next_obs [B, D] and
    rewards/dones/discounts [B] and optional weights [B] as float32, actions [B, K] and optional
    next_mask [B, K, max_actions] as int32."""
    jax = import_jax()
    missing = set(BATCH_KEYS) - {k for k, v in batch.items() if v is not None}
    if missing:
        raise KeyError(f"jax peer batch is missing {sorted(missing)} (needs {', '.join(BATCH_KEYS)})")
    out = {}
    for k, v in batch.items():
        if v is None:
            continue
        dtype = np.int32 if k in ("actions", "next_mask") else np.float32
        out[k] = jax.device_put(np.ascontiguousarray(np.asarray(v), dtype=dtype), device)
    return out


class JaxPeer:
    """Online + target parameters, Adam state and the jitted train and acting steps, loadable from
    numbarl's parameters.

        peer = JaxPeer(PeerSpec.from_numbarl(mlp, head, store), store.to_host("params"),
                       store.to_host("target"), lr=1e-4, max_grad_norm=10.0)
        loss, per_sample, grads = peer.loss_and_grads(batch_to_jax(batch))   # numbarl names, [in, out]
        peer.train_step(batch_to_jax(batch))                                 # one whole step, in place
        actions = peer.act(obs)                                              # [N, K] greedy

    Hyper-parameters as numbarl.rl.optim.AdamConfig / TargetConfig: target_tau None leaves the
    target network alone; otherwise every target_period-th step target ← tau·params + (1-tau)·target.
    """

    def __init__(self, spec: PeerSpec, values: dict, target_values: dict | None = None, device=None,
                 lr: float = 1e-4, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, clip_eps: float = 1e-6, skip_nonfinite: bool = True,
                 target_tau: float | None = None, target_period: int = 1):
        jax = import_jax()
        if target_tau is not None and not 0.0 < float(target_tau) <= 1.0:
            raise ValueError(f"JaxPeer: target_tau must be in (0, 1] or None, got {target_tau}")
        if int(target_period) < 1:
            raise ValueError(f"JaxPeer: target_period must be >= 1, got {target_period}")
        self.spec = spec
        self.device = device if device is not None else jax.devices()[0]
        self.names = self._param_names()
        self.hyper = {"lr": float(lr), "beta1": float(betas[0]), "beta2": float(betas[1]), "eps": float(eps),
                      "weight_decay": float(weight_decay), "max_grad_norm": float(max_grad_norm),
                      "clip_eps": float(clip_eps), "skip_nonfinite": bool(skip_nonfinite),
                      "target_tau": None if target_tau is None else float(target_tau),
                      "target_period": int(target_period)}
        # the same float32 atoms as numbarl.rl.nets.c51_head.make_support (float64 linspace, then cast)
        support = np.linspace(float(spec.v_min), float(spec.v_max), int(spec.n_atoms)).astype(np.float32)
        self.support = jax.device_put(support, self.device)
        params = self._put(values)
        zeros = lambda: {n: jax.numpy.zeros_like(p) for n, p in params.items()}  # m and v: own buffers (donated)
        self.state = {"params": params, "target": self._put(values if target_values is None else target_values),
                      "m": zeros(), "v": zeros(), "step": jax.device_put(np.int32(0), self.device)}
        self._static_hyper = tuple(sorted(self.hyper.items()))  # a static (hashable) jit argument

    # -- weights ------------------------------------------------------------------------------
    def _param_names(self) -> list:
        names = []
        for op in self.spec.trunk:
            if op.kind in ("linear", "layernorm"):
                names += [op.weight] + ([op.bias] if op.bias is not None else [])
        h = self.spec.head
        return names + [f"{h}.value.w", f"{h}.value.b", f"{h}.adv.w", f"{h}.adv.b"]

    def _put(self, values: dict) -> dict:
        jax = import_jax()
        out = {}
        for name in self.names:
            if name not in values:
                raise KeyError(f"jax peer: numbarl parameter {name!r} is missing from the values "
                               f"(have {sorted(values)})")
            out[name] = jax.device_put(np.ascontiguousarray(np.asarray(values[name], np.float32)), self.device)
        n_atoms = out[f"{self.spec.head}.value.w"].shape[-1]
        width = out[f"{self.spec.head}.adv.w"].shape[-1]
        if n_atoms != self.spec.n_atoms or width != sum(self.spec.branch_sizes) * n_atoms:
            raise ValueError(f"jax peer: head weights give {n_atoms} atoms and {width} advantage columns; the spec "
                             f"expects {self.spec.n_atoms} atoms and branches {self.spec.branch_sizes}")
        return out

    def load(self, values: dict, which: str = "params") -> None:
        """Replace the online ("params") or target ("target") weights with numbarl arrays."""
        if which not in ("params", "target"):
            raise ValueError(f"JaxPeer.load: which must be 'params' or 'target', got {which!r}")
        self.state = dict(self.state, **{which: self._put(values)})

    def to_numbarl(self, which: str = "params") -> dict:
        """Online ("params"), target ("target") or Adam ("m", "v") arrays as numpy, numbarl names."""
        return {n: np.asarray(a) for n, a in self.state[which].items()}

    # -- one batch ----------------------------------------------------------------------------
    def outputs(self, obs, target: bool = False, tf32: bool = False):
        """(logits, probs, q) of one pass in numbarl's padded layout, as numpy float32."""
        spec = self.spec
        logits, probs, q = _jitted("outputs")(self.state["target" if target else "params"], obs, self.support,
                                              spec=spec, precision=PRECISIONS[bool(tf32)])
        batch = int(np.shape(obs)[0])
        shape = (batch, len(spec.branch_sizes), max(spec.branch_sizes), spec.n_atoms)
        out_logits, out_probs = np.full(shape, -np.inf, np.float32), np.zeros(shape, np.float32)
        out_q = np.full(shape[:3], -np.inf, np.float32)
        for k, n in enumerate(spec.branch_sizes):
            out_logits[:, k, :n], out_probs[:, k, :n], out_q[:, k, :n] = logits[k], probs[k], q[k]
        return out_logits, out_probs, out_q

    def loss_and_grads(self, batch: dict, next_actions=None, tf32: bool = False):
        """Loss, per-sample loss and gradients (numbarl names, [in, out]) for one batch; no update.
        `next_actions` [B, K] overrides the online argmax (to remove near-tie flips between two
        float32 implementations when comparing them)."""
        if next_actions is not None:
            next_actions = import_jax().numpy.asarray(np.asarray(next_actions), dtype=np.int32)
        loss, per_sample, grads = _jitted("loss_and_grads")(
            self.state["params"], self.state["target"], batch, self.support, next_actions, spec=self.spec,
            precision=PRECISIONS[bool(tf32)])
        return float(loss), np.asarray(per_sample), {n: np.asarray(g) for n, g in grads.items()}

    def train_step(self, batch: dict, tf32: bool = False) -> dict:
        """The whole step (targets, loss, backward, clip, AdamW, target update), in place.
        Returns the step's stats as jax scalars (loss, grad_norm, clip_scale): no host sync."""
        self.state, stats = _jitted("train_step")(self.state, batch, self.support, spec=self.spec,
                                                  precision=PRECISIONS[bool(tf32)], hyper=self._static_hyper)
        return stats

    def act(self, obs, mask=None, tf32: bool = False):
        """Greedy actions [N, K] (int32 jax array) of the online network on obs [N, D]; mask
        [N, K, max_actions] (0 = not available) restricts each branch's argmax."""
        return _jitted("act")(self.state["params"], obs, self.support, mask, spec=self.spec,
                              precision=PRECISIONS[bool(tf32)])


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def _time_loop(run_once, finish, iters: int, warmup: int, repeats: int) -> list:
    """Milliseconds per call of `run_once` over `repeats` rounds of `iters` calls; `finish()` blocks
    until the device is done (jax dispatches asynchronously, so the host clock stops after it)."""
    for _ in range(warmup):
        run_once()
    finish()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            run_once()
        finish()
        times.append((time.perf_counter() - start) * 1e3 / iters)
    return times


def time_train_step(peer: JaxPeer, batch: dict, tf32: bool = False, iters: int = 100, warmup: int = 10,
                    repeats: int = 5) -> dict:
    """Median milliseconds per jitted train step of the peer (its state keeps training).

    The first call compiles (not timed); `warmup` more steps, then `repeats` rounds of `iters`
    back-to-back steps, each round ended by `block_until_ready` on the state. Returns ms_median,
    ms_min, ms_all, iters, tf32, compile_s (first call, compile included)."""
    jax = import_jax()
    start = time.perf_counter()
    jax.block_until_ready(peer.train_step(batch, tf32=tf32))
    compile_s = time.perf_counter() - start
    times = _time_loop(lambda: peer.train_step(batch, tf32=tf32), lambda: jax.block_until_ready(peer.state),
                       iters, warmup, repeats)
    return {"mode": "jit", "tf32": bool(tf32), "ms_median": statistics.median(times), "ms_min": min(times),
            "ms_all": times, "iters": iters, "compile_s": compile_s}


def time_act(peer: JaxPeer, obs, mask=None, tf32: bool = False, iters: int = 100, warmup: int = 10,
             repeats: int = 5) -> dict:
    """Median milliseconds per jitted acting step (forward + greedy argmax per branch) on obs
    [N, D]; timed like `time_train_step` (the last call's actions are blocked on)."""
    jax = import_jax()
    last = []
    start = time.perf_counter()
    jax.block_until_ready(peer.act(obs, mask, tf32=tf32))
    compile_s = time.perf_counter() - start

    def run_once():
        last[:] = [peer.act(obs, mask, tf32=tf32)]

    times = _time_loop(run_once, lambda: jax.block_until_ready(last), iters, warmup, repeats)
    return {"mode": "jit", "tf32": bool(tf32), "ms_median": statistics.median(times), "ms_min": min(times),
            "ms_all": times, "iters": iters, "n": int(np.shape(obs)[0]), "compile_s": compile_s}
