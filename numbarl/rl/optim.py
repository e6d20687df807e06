"""Flat AdamW with deterministic global-norm clipping and target-network updates, all on device.

Everything runs over the ParamStore's flat float32 buffers (params, grads, adam_m, adam_v, target:
same views, same offsets), one launch per phase, no host round trip, so one captured train graph
replays it forever:

1. **grad norm** (fixed order, no atomics): ``numbarl.cuda.reduce.Reducer.sumsq`` over the flat
   grads buffer — per-block partials, then one fixed tree — into a device scalar. Its grid
   depends only on the buffer size, so the same gradients give the same bits on every run.
2. **clip + step bookkeeping** (``finalize_kernel``, one thread): ``norm = sqrt(Σ g²)``,
   ``scale = min(1, max_norm / (norm + clip_eps))`` (PyTorch ``clip_grad_norm_``; max_norm 0
   disables clipping), ``t = step[0] + 1`` written back, bias corrections ``1 − β1^t``,
   ``1 − β2^t`` computed in float64 (one thread, once per step: exactness costs nothing here), and
   the stats row. A non-finite norm skips the whole update when ``skip_nonfinite``: step, moments,
   params and target stay as they were and ``stats[STAT_SKIPPED]`` counts it.
3. **AdamW** (``adam_kernel``, one thread per element; Loshchilov & Hutter 2019, Algorithm 2, in
   PyTorch's ``torch.optim.AdamW`` arrangement so the PyTorch peer matches)::

       g  = scale · grad
       m  = β1 m + (1 − β1) g
       v  = β2 v + (1 − β2) g²
       p  = p − (c · p + (lr_g / (1 − β1^t)) · m / (sqrt(v) / sqrt(1 − β2^t) + eps))
            c = lr_g · wd_g · decay_mask                      decoupled weight decay, masked per tensor

   The decay is folded into the step rather than applied as a factor ``p · (1 − c)`` first (PyTorch's
   arrangement): in float32, ``1 − c`` rounds to exactly 1 for every c < 2^-25 ≈ 3e-8, and the default
   lr (2.5e-4) times a usual decay (1e-4) is 2.5e-8. A grid of five runs with ``agent.weight_decay=1e-4``
   came back bit for bit equal to the runs without decay (docs/RESULTS.md, fourteenth session). Added
   to the Adam step first, ``c · p`` survives the rounding whenever the step moves the weight; the
   exact value is the same (the float64 reference keeps the factor form), and c = 0 gives the
   previous bits.

   Parameter groups: every element belongs to the optimizer group of its tensor (``group_id``,
   int32 over the flat buffer; a group per ParamSpec.group: "trunk", "head.value", "head.adv",
   ...), and each group g has its own device learning rate ``lr[g]`` and weight decay ``wd[g]``
   (float32 [G]), initialised from the config and changed between replays by schedules, a
   feedback loop or :meth:`Adam.set_lr` / :meth:`Adam.set_weight_decay` (one group or all).
   With one value for every group the step is bit for bit the single-rate step.

   The clip scale is applied inside the update (the grads buffer itself is left unscaled: the
   backward pass overwrites it every step, nothing else reads it after the optimizer).
   ``lr`` and ``wd`` are read from device memory (float32[G]): schedules change them between replays without
   recapture.
4. **target update** (``target_update_kernel``): after the optimizer step t, when
   ``t % period == 0``: ``target = tau · params + (1 − tau) · target`` (Polyak; Lillicrap et al.
   2016) or an exact copy when tau = 1 (periodic hard update; Mnih et al. 2015). The condition is
   evaluated on the device from the step counter, so the same graph does it every k-th replay.

Stats (float32 device vector, slots ``STAT_*``): grad norm before clipping, clip scale, lr of group 0,
optimizer step, skipped non-finite steps, clipped steps and target updates (both cumulative). Pass ``stats=`` a view of mapped memory to have the
kernels write straight into it, or copy ``Adam.stats`` there.

Padding between parameter views is zero in every role and stays zero (zero grad, zero moments).

Measured on an H200, 609,892 parameters: the whole step (5 launches) replays in 16 µs inside a
graph (norm 5.7 µs, AdamW 6.4 µs, target 4.4 µs); run eagerly it costs ~600 µs of numba launch
overhead, which is why it belongs in the captured train step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import float32, float64

from numbarl.cuda.reduce import Reducer
from numbarl.cuda.runtime import Arena, cuda, stride_grid
from numbarl.rl.nets.base import ParamStore
from numbarl.rl.schedules import ScheduleConfig, reset_group_moments_kernel, schedule_kernel

BLOCK = 256           # threads per block of the elementwise Adam / target kernels

STAT_GRAD_NORM = 0    # global L2 norm of the gradients before clipping
STAT_CLIP_SCALE = 1   # factor the gradients were scaled by (1 when not clipped)
STAT_LR = 2           # learning rate used by this step
STAT_STEP = 3         # optimizer steps taken (float32: exact up to 2**24)
STAT_SKIPPED = 4      # steps skipped because the gradient norm was not finite (cumulative)
STAT_CLIPPED = 5      # steps whose gradients were scaled down by the clip (cumulative)
STAT_TARGET_UPDATES = 6  # exact target copies done (tau = 1: the periodic update; cumulative)
STAT_LR_SCALE = 7     # the schedule's multiplier of group 0 this step (1 without a schedule)
STAT_LR_RESTARTS = 8  # warm restarts of the cosine schedule so far (cumulative)
STAT_TARGET_SOFT = 9  # Polyak (tau < 1) target updates done (cumulative)
STAT_DECAY_RATE = 10  # the largest lr_g * wd_g of this step: the decoupled weight decay in force
STAT_WARMUP_SCALE = 11  # the warm-up part of group 0's schedule multiplier this step (1: none)

# the names an agent's stats layout gives the optimizer's slots (agents whose stats buffer the
# optimizer writes directly, at these numbers: PPO, the Decision Transformer)
OPTIMIZER_SLOTS = (("grad_norm", STAT_GRAD_NORM, "float"), ("clip_scale", STAT_CLIP_SCALE, "float"),
                   ("lr", STAT_LR, "float"), ("optim_step", STAT_STEP, "int"), ("skipped_steps", STAT_SKIPPED, "int"),
                   ("clipped_steps", STAT_CLIPPED, "int"), ("target_copies", STAT_TARGET_UPDATES, "int"),
                   ("lr_scale", STAT_LR_SCALE, "float"), ("lr_restarts", STAT_LR_RESTARTS, "int"),
                   ("target_soft_updates", STAT_TARGET_SOFT, "int"), ("decay_rate", STAT_DECAY_RATE, "float"),
                   ("lr_warmup_scale", STAT_WARMUP_SCALE, "float"))


def claim_optimizer_slots(layout) -> None:
    """Name the optimizer's slots 0..11 in `layout` (a numbarl.cuda.registry.StatsLayout); without
    a target network, target_copies and target_soft_updates stay 0."""
    for name, slot, kind in OPTIMIZER_SLOTS:
        layout.slot(name, slot, kind=kind)
N_STATS = 12

# scalars the finalize kernel hands to the update kernels (float32 [N_SCAL])
_SCAL_SCALE = 0       # clip scale
_SCAL_STEP_SIZE = 1   # lr / (1 - beta1^t)
_SCAL_INV_SQRT_BC2 = 2  # 1 / sqrt(1 - beta2^t)
_SCAL_SKIP = 3        # 1.0 when this step is skipped
_SCAL_LR = 4          # lr of this step
_SCAL_SUMSQ = 5       # Σ grad², written by the reducer
N_SCAL = 6

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


@dataclass(frozen=True)
class AdamConfig:
    """AdamW hyper-parameters (the lr here is only the initial value of the device lr scalar)."""

    lr: float = 1e-4
    """initial learning rate, written to the device lr scalar at allocate()"""
    beta1: float = 0.9
    """first-moment decay"""
    beta2: float = 0.999
    """second-moment decay"""
    eps: float = 1e-8
    """added to sqrt(v_hat) (PyTorch's placement)"""
    weight_decay: float = 0.0
    """decoupled weight decay coefficient, applied only where the store's decay mask is 1"""
    max_grad_norm: float = 0.0
    """global-norm clipping threshold; 0 disables clipping (the norm is still reported)"""
    clip_eps: float = 1e-6
    """added to the norm in the clip factor, as in torch.nn.utils.clip_grad_norm_"""
    skip_nonfinite: bool = True
    """skip the whole step (moments, params, step counter, target) when the grad norm is inf/NaN"""

    def __post_init__(self):
        if not self.lr >= 0.0:
            raise ValueError(f"AdamConfig.lr must be >= 0, got {self.lr}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"AdamConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0.0:
            raise ValueError(f"AdamConfig.eps must be > 0, got {self.eps}")
        if not self.weight_decay >= 0.0 or not self.max_grad_norm >= 0.0:
            raise ValueError(f"AdamConfig: weight_decay ({self.weight_decay}) and max_grad_norm "
                             f"({self.max_grad_norm}) must be >= 0")


@dataclass(frozen=True)
class TargetConfig:
    """Target-network update: every `period` optimizer steps, target ← tau·params + (1 − tau)·target."""

    period: int = 1
    """optimizer steps between updates (periodic hard copy: e.g. 2000 with tau=1)"""
    tau: float = 1.0
    """1.0 = exact copy (periodic); < 1 = Polyak averaging (e.g. period 1, tau 0.005)"""

    def __post_init__(self):
        if self.period < 1:
            raise ValueError(f"TargetConfig.period must be >= 1, got {self.period}")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"TargetConfig.tau must be in (0, 1], got {self.tau}")

    @classmethod
    def periodic(cls, period: int) -> "TargetConfig":
        return cls(period=period, tau=1.0)

    @classmethod
    def polyak(cls, tau: float, period: int = 1) -> "TargetConfig":
        return cls(period=period, tau=tau)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def clip_scale_ref(grads, max_norm: float, clip_eps: float = 1e-6):
    """(norm, scale) of global-norm clipping: scale = min(1, max_norm / (norm + clip_eps))."""
    norm = float(np.sqrt(np.sum(np.asarray(grads, np.float64) ** 2)))
    if max_norm <= 0.0:
        return norm, 1.0
    return norm, min(1.0, max_norm / (norm + clip_eps))


def adam_ref(params, grads, m, v, decay_mask, step: int, lr, cfg: AdamConfig, weight_decay=None):
    """One AdamW step (module docstring, phase 2-3) in float64 on flat vectors.

    lr and weight_decay: scalars, or per-element vectors (the element's group value); weight_decay
    None: cfg.weight_decay. The stats' lr is the first element's.

    step: optimizer steps taken before this one. Returns (params, m, v, step, stats) with stats
    laid out like the device stats vector; a skipped (non-finite) step returns the inputs unchanged.
    """
    p, g = np.asarray(params, np.float64), np.asarray(grads, np.float64)
    m, v = np.asarray(m, np.float64), np.asarray(v, np.float64)
    norm, scale = clip_scale_ref(g, cfg.max_grad_norm, cfg.clip_eps)
    stats = np.zeros(N_STATS)
    lr = np.asarray(lr, np.float64)
    wd = np.asarray(cfg.weight_decay if weight_decay is None else weight_decay, np.float64)
    stats[STAT_GRAD_NORM], stats[STAT_CLIP_SCALE], stats[STAT_LR] = norm, scale, float(lr.flat[0])
    stats[STAT_LR_SCALE] = stats[STAT_WARMUP_SCALE] = 1.0  # no schedule in the reference
    stats[STAT_DECAY_RATE] = float(np.max(lr * wd))
    if cfg.skip_nonfinite and not np.isfinite(norm):
        stats[STAT_CLIP_SCALE], stats[STAT_STEP], stats[STAT_SKIPPED] = 0.0, step, 1
        return p, m, v, step, stats
    t = step + 1
    g = g * scale
    m = cfg.beta1 * m + (1.0 - cfg.beta1) * g
    v = cfg.beta2 * v + (1.0 - cfg.beta2) * g * g
    p = p * (1.0 - lr * wd * np.asarray(decay_mask, np.float64))
    p = p - (lr / (1.0 - cfg.beta1**t)) * m / (np.sqrt(v) / math.sqrt(1.0 - cfg.beta2**t) + cfg.eps)
    stats[STAT_STEP] = t
    stats[STAT_CLIPPED] = float(scale < 1.0)  # this step's share of the device's cumulative count
    return p, m, v, t, stats


def target_update_ref(target, params, step: int, cfg: TargetConfig):
    """Target after optimizer step `step` (float64)."""
    target = np.asarray(target, np.float64)
    if step % cfg.period != 0:
        return target
    if cfg.tau == 1.0:
        return np.asarray(params, np.float64).copy()
    return cfg.tau * np.asarray(params, np.float64) + (1.0 - cfg.tau) * target


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
_cuda = cuda()


@_cuda.jit(device=True)
def nonfinite_flag_dev(stats, t, loss, grad_norm, slot_step, slot_what):
    """The sticky non-finite flag of a train step's bookkeeping: stats[slot_step] < 0 until the first
    step t whose loss (what 1) or gradient norm (what 2) is not finite, then t and what, kept."""
    if stats[slot_step] < np.float32(0.0):
        if not math.isfinite(loss):
            stats[slot_step] = np.float32(t)
            stats[slot_what] = np.float32(1.0)
        elif not math.isfinite(grad_norm):
            stats[slot_step] = np.float32(t)
            stats[slot_what] = np.float32(2.0)


@_cuda.jit(cache=True)
def after_train_step_kernel(loss, train_step, stats, slot_step, slot_loss, slot_nonfinite_step, slot_nonfinite_what):
    """One thread, after an optimizer step of an agent whose stats layout puts these slots where it
    says (PPO's minibatch step, the Decision Transformer's step): train_step += 1, stats[slot_step]
    and stats[slot_loss] written, and the sticky non-finite flag: the first step whose loss (what 1)
    or gradient norm (stats[STAT_GRAD_NORM], what 2) was not finite; stats[slot_nonfinite_step] < 0
    until then."""
    if _cuda.grid(1) == 0:
        t = train_step[0] + 1
        train_step[0] = t
        stats[slot_step] = np.float32(t)
        stats[slot_loss] = loss[0]
        nonfinite_flag_dev(stats, t, loss[0], stats[STAT_GRAD_NORM], slot_nonfinite_step, slot_nonfinite_what)


@_cuda.jit(cache=True)
def finalize_kernel(step, lr, weight_decay, scal, group_scal, stats, max_norm, clip_eps, beta1, beta2, skip_nonfinite):
    """One thread: clip scale from scal[_SCAL_SUMSQ], step counter, bias corrections and stats
    (module docstring, phase 2). group_scal[g] = (lr_g / (1 − β1^t), lr_g) for every group g."""
    if _cuda.grid(1) != 0:
        return
    norm = math.sqrt(scal[_SCAL_SUMSQ])
    rate = lr[0]
    stats[STAT_GRAD_NORM] = norm
    stats[STAT_LR] = rate
    if skip_nonfinite and not math.isfinite(norm):
        scal[_SCAL_SKIP] = _ONE
        scal[_SCAL_SCALE] = _ZERO
        stats[STAT_CLIP_SCALE] = _ZERO
        stats[STAT_STEP] = float32(step[0])
        stats[STAT_SKIPPED] += _ONE
        return
    scale = _ONE
    if max_norm > _ZERO:
        scale = min(_ONE, max_norm / (norm + clip_eps))
        if scale < _ONE:
            stats[STAT_CLIPPED] += _ONE
    t = step[0] + 1
    step[0] = t
    bc1 = float64(1.0) - math.pow(beta1, float64(t))  # float64 on one thread: exact bias correction
    bc2 = float64(1.0) - math.pow(beta2, float64(t))
    scal[_SCAL_SCALE] = scale
    scal[_SCAL_STEP_SIZE] = float32(float64(rate) / bc1)
    scal[_SCAL_INV_SQRT_BC2] = float32(float64(1.0) / math.sqrt(bc2))
    scal[_SCAL_SKIP] = _ZERO
    scal[_SCAL_LR] = rate
    decay = _ZERO
    for g in range(lr.shape[0]):  # a handful of groups, one thread: per-group step sizes
        group_scal[g, 0] = float32(float64(lr[g]) / bc1)
        group_scal[g, 1] = lr[g]
        decay = max(decay, lr[g] * weight_decay[g])
    stats[STAT_DECAY_RATE] = decay
    stats[STAT_CLIP_SCALE] = scale
    stats[STAT_STEP] = float32(t)


@_cuda.jit(cache=True)
def adam_kernel(params, grads, m, v, decay_mask, group_id, group_scal, weight_decay, scal, beta1, one_minus_beta1,
                beta2, one_minus_beta2, eps):
    """AdamW on one element per thread (module docstring, phase 3), with its group's lr and weight
    decay. 1 − β arrive precomputed in float64 and rounded once: float32(1) − float32(0.999) is
    off by 1.3e-5 relative."""
    if scal[_SCAL_SKIP] != _ZERO:
        return
    for i in range(_cuda.grid(1), params.shape[0], _cuda.gridsize(1)):  # grid-stride
        gid = group_id[i]
        g = grads[i] * scal[_SCAL_SCALE]
        mi = beta1 * m[i] + one_minus_beta1 * g
        vi = beta2 * v[i] + one_minus_beta2 * g * g
        m[i] = mi
        v[i] = vi
        p = params[i]
        c = group_scal[gid, 1] * weight_decay[gid] * decay_mask[i]  # folded into the step (module docstring)
        denom = math.sqrt(vi) * scal[_SCAL_INV_SQRT_BC2] + eps
        params[i] = p - (c * p + group_scal[gid, 0] * mi / denom)


@_cuda.jit(cache=True)
def target_update_kernel(target, params, step, scal, period, tau, one_minus_tau, stats):
    """target ← tau·params + (1 − tau)·target after optimizer steps that are multiples of period."""
    if scal[_SCAL_SKIP] != _ZERO or step[0] % period != 0:
        return
    if _cuda.grid(1) == 0:
        if tau == _ONE:
            stats[STAT_TARGET_UPDATES] += _ONE
        else:
            stats[STAT_TARGET_SOFT] += _ONE
    for i in range(_cuda.grid(1), target.shape[0], _cuda.gridsize(1)):  # grid-stride
        if tau == _ONE:
            target[i] = params[i]
        else:
            target[i] = tau * params[i] + one_minus_tau * target[i]


@_cuda.jit(cache=True)
def scale_restart_kernel(m, momentum_scale, scal, stats):
    """At a warm restart (momentum_scale[0] != 1) and unless the step is skipped: m *= the scale,
    and stats[STAT_LR_RESTARTS] += 1 (thread 0). Nothing otherwise."""
    s = momentum_scale[0]
    if s == _ONE or scal[_SCAL_SKIP] != _ZERO:
        return
    if _cuda.grid(1) == 0:
        stats[STAT_LR_RESTARTS] += _ONE
    for i in range(_cuda.grid(1), m.shape[0], _cuda.gridsize(1)):
        m[i] = m[i] * s


# ---------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------
class Adam:
    """AdamW over a ParamStore's flat buffers, with clipping, target update and device stats.

    Usage (before capture)::

        opt = Adam(store, AdamConfig(lr=1e-4, max_grad_norm=10.0), TargetConfig.periodic(2000))
        opt.allocate()                # store must be allocated; uploads decay mask and lr
        ...
        opt.step(stream)              # inside the train step: norm → clip → Adam → target update
    """

    def __init__(self, store: ParamStore, config: AdamConfig = AdamConfig(),
                 target: TargetConfig | None = None, stats=None, schedule: ScheduleConfig | None = None):
        self.store, self.config, self.target = store, config, target
        # learning-rate schedule (numbarl/rl/schedules.py): None or inactive = constant base lr
        self.schedule = schedule if schedule is not None and schedule.active else None
        self._stats_out = stats
        self.state = Arena("optim")
        self._n = 0
        self._reducer = None
        self._splits = {}  # group -> ({tensor name: element labels}, sub-group names): split_group
        self.parents = {}  # optimizer group -> the tensor group it came from (itself unless split)

    def split_group(self, group: str, labels: dict, names) -> "Adam":
        """Before allocate(): the elements of tensor group `group` become the optimizer groups
        `names`, element e of tensor t going to names[labels[t].flat[e]] (every tensor of the group
        labelled, row-major). Each sub-group gets its own lr and weight decay (e.g. one per branch
        of the head's advantage GEMM, whose columns are the branches one after the other)."""
        if self.state.allocated:
            raise RuntimeError("Adam.split_group must run before allocate()")
        tensors = [n for n, spec in self.store.specs.items() if spec.group == group]
        if not tensors or set(labels) != set(tensors):
            raise ValueError(f"Adam.split_group({group!r}): label every tensor of the group ({tensors}), got {sorted(labels)}")
        for t in tensors:
            lab = np.asarray(labels[t])
            if lab.size != int(np.prod(self.store.specs[t].shape)) or lab.min() < 0 or lab.max() >= len(names):
                raise ValueError(f"Adam.split_group({group!r}): labels of {t} must be {self.store.specs[t].shape} "
                                 f"values in [0, {len(names)})")
        self._splits[group] = ({t: np.asarray(labels[t]).reshape(-1).astype(np.int32) for t in tensors}, list(names))
        return self

    def _expanded_groups(self, tensor_groups: list) -> list:
        out = []
        for g in tensor_groups:
            subs = self._splits[g][1] if g in self._splits else [g]
            out += subs
            self.parents.update({sub: g for sub in subs})
        return out

    def allocate(self) -> "Adam":
        """Plan and allocate the optimizer's device state; one host upload each for the decay mask
        and the initial lr (must run before capture)."""
        if self.state.allocated:
            return self
        if not self.store.arenas["params"].allocated:
            raise RuntimeError("Adam.allocate: allocate the ParamStore first (store.allocate())")
        flat = self.store.flat("params")
        n = int(flat.shape[0])
        for role in ("grads", "adam_m", "adam_v", "target"):
            if int(self.store.flat(role).shape[0]) != n:
                raise RuntimeError(f"ParamStore role {role!r} does not mirror params ({n} floats)")
        self._n = n
        self._reducer = Reducer(n)  # owns the fixed partials scratch of the grad-norm reduction
        tensor_groups = self.store.optimizer_groups()
        self.groups = self._expanded_groups(tensor_groups)
        G = len(self.groups)
        st = self.state
        st.add("step", (1,), np.int64)
        st.add("lr", (G,), np.float32)
        st.add("base_lr", (G,), np.float32)  # what set_lr writes; the schedule scales it into lr
        st.add("group_start", (G,), np.int64)  # optimizer step each group's warm-up counts from
        st.add("momentum_scale", (1,), np.float32)  # < 1 at a warm restart (the schedule writes it)
        st.add("weight_decay", (G,), np.float32)
        st.add("scal", (N_SCAL,), np.float32)
        st.add("group_scal", (G, 2), np.float32)
        st.add("group_id", (n,), np.int32)
        st.add("decay_mask", (n,), np.float32)
        st.add("stats", (N_STATS,), np.float32)
        st.allocate()
        if self._stats_out is not None:
            if np.dtype(self._stats_out.dtype) != np.float32 or self._stats_out.shape[0] < N_STATS:
                raise ValueError(f"Adam: stats must be a float32 device vector of at least {N_STATS} entries")
        mask = np.zeros(n, np.float32)
        host_mask = self.store.decay_mask()
        mask[: host_mask.shape[0]] = host_mask
        gid = np.zeros(n, np.int32)
        host_gid = self.store.group_ids(tensor_groups)
        first = np.array([self.groups.index(self._splits[g][1][0] if g in self._splits else g) for g in tensor_groups],
                         np.int32)
        gid[: host_gid.shape[0]] = first[host_gid]  # the tensor group's (first) optimizer group
        arena = self.store.arenas["params"]
        for labels, _ in self._splits.values():  # split groups: each element to its sub-group
            for t, lab in labels.items():
                v = arena.views[t]
                gid[v.offset // 4 : v.offset // 4 + v.size] += lab
        stats0 = np.zeros(N_STATS, np.float32)
        stats0[STAT_LR_SCALE] = 1.0  # the schedule's multipliers: 1 until a schedule writes them
        stats0[STAT_WARMUP_SCALE] = 1.0
        st.load({"stats": stats0})
        st.load({"decay_mask": mask, "group_id": gid, "lr": np.full(G, self.config.lr, np.float32),
                 "base_lr": np.full(G, self.config.lr, np.float32), "momentum_scale": np.ones(1, np.float32),
                 "weight_decay": np.full(G, self.config.weight_decay, np.float32)})
        return self

    # -- device views ---------------------------------------------------------------------------
    @property
    def step_counter(self):
        """Device int64 [1]: optimizer steps taken (drives bias correction and target updates)."""
        return self.state["step"]

    @property
    def lr(self):
        """Device float32 [G]: each group's learning rate, read by every step (written by a schedule
        kernel or set_lr). Group order: ``self.groups``."""
        return self.state["lr"]

    @property
    def weight_decay(self):
        """Device float32 [G]: each group's decoupled weight decay (where the decay mask is 1)."""
        return self.state["weight_decay"]

    def group_index(self, group: str) -> int:
        if group not in self.groups:
            raise KeyError(f"optimizer group {group!r} does not exist; groups: {', '.join(self.groups)}")
        return self.groups.index(group)

    @property
    def stats(self):
        """Device float32 [N_STATS] (or the caller's stats vector when one was given)."""
        return self._stats_out if self._stats_out is not None else self.state["stats"]

    # -- capturable launchers -------------------------------------------------------------------
    def grad_norm(self, stream) -> None:
        """Phases 1-2: deterministic grad norm, clip scale, step counter, bias corrections, stats."""
        cfg, st = self.config, self.state
        self._reducer.sumsq(self.store.flat("grads"), st["scal"], stream, at=_SCAL_SUMSQ)
        finalize_kernel[1, 1, stream](
            st["step"], st["lr"], st["weight_decay"], st["scal"], st["group_scal"], self.stats,
            np.float32(cfg.max_grad_norm), np.float32(cfg.clip_eps), np.float64(cfg.beta1),
            np.float64(cfg.beta2), bool(cfg.skip_nonfinite))

    def apply(self, stream) -> None:
        """Phase 3: the AdamW update with the scalars grad_norm() left on the device."""
        cfg, st, s = self.config, self.state, self.store
        adam_kernel[stride_grid(self._n, BLOCK, 1 << 16)[0], stride_grid(self._n, BLOCK)[1], stream](
            s.flat("params"), s.flat("grads"), s.flat("adam_m"), s.flat("adam_v"), st["decay_mask"], st["group_id"],
            st["group_scal"], st["weight_decay"], st["scal"],
            np.float32(cfg.beta1), np.float32(1.0 - cfg.beta1), np.float32(cfg.beta2), np.float32(1.0 - cfg.beta2),
            np.float32(cfg.eps))

    def update_target(self, stream) -> None:
        """Phase 4 (no-op without a TargetConfig): decided on the device from the step counter."""
        if self.target is None:
            return
        st, s = self.state, self.store
        target_update_kernel[stride_grid(self._n, BLOCK, 1 << 16)[0], stride_grid(self._n, BLOCK)[1], stream](
            s.flat("target"), s.flat("params"), st["step"], st["scal"], np.int64(self.target.period),
            np.float32(self.target.tau), np.float32(1.0 - self.target.tau), self.stats)

    def step(self, stream) -> None:
        """One optimizer step: [schedule →] grad norm + clip → [restart momentum scale →] AdamW →
        target update (4 launches without a schedule, no host sync). Closes the store's train step
        (the gradient ledger: the next backward overwrites again)."""
        if self.schedule is not None:
            self.run_schedule(stream)
        self.grad_norm(stream)
        if self.schedule is not None:
            st = self.state
            scale_restart_kernel[stride_grid(self._n, BLOCK, 1 << 16)[0], stride_grid(self._n, BLOCK)[1], stream](
                self.store.flat("adam_m"), st["momentum_scale"], st["scal"], self.stats)
        self.apply(stream)
        self.update_target(stream)
        self.store.end_step()

    def run_schedule(self, stream) -> None:
        """The schedule's lr[G] and restart scale for this step (module numbarl.rl.schedules)."""
        sc, st = self.schedule, self.state
        schedule_kernel[1, 1, stream](
            st["step"], st["base_lr"], st["group_start"], np.int64(sc.warmup_steps), np.int64(sc.cycle_steps),
            np.float64(sc.min_lr_frac), np.float64(sc.restart_momentum_scale), st["lr"], st["momentum_scale"],
            self.stats, np.int64(STAT_LR_SCALE), np.int64(STAT_WARMUP_SCALE))

    def restart_warmup(self, group: str) -> None:
        """Start group's warm-up again from the current optimizer step (a group that is new to the
        training, e.g. a component switched on at a resume). Host copy: between replays."""
        starts = self.state["group_start"].copy_to_host()
        starts[self.group_index(group)] = int(self.state["step"].copy_to_host()[0])
        self.state.load({"group_start": starts})

    def reset_moments(self, group: str, stream) -> None:
        """Zero Adam's m and v of one group (the targeted moment reset of a frozen group; eager,
        between replays)."""
        s = self.store
        reset_group_moments_kernel[stride_grid(self._n, BLOCK, 1 << 16)[0], stride_grid(self._n, BLOCK)[1], stream](
            s.flat("adam_m"), s.flat("adam_v"), self.state["group_id"], np.int32(self.group_index(group)))

    # -- host helpers (between replays; not capturable) -----------------------------------------
    def set_lr(self, value: float, group: str | None = None) -> None:
        """Write the device lr of one group (None: every group) from the host (outside capture);
        with a schedule it is the base rate the schedule scales."""
        self._set_group_value("lr", value, group)
        self._set_group_value("base_lr", value, group)

    def set_weight_decay(self, value: float, group: str | None = None) -> None:
        """Write the device weight decay of one group (None: every group) from the host."""
        self._set_group_value("weight_decay", value, group)

    def _set_group_value(self, what: str, value: float, group: str | None) -> None:
        if not value >= 0.0:
            raise ValueError(f"Adam.set_{what}: {what} must be >= 0, got {value}")
        values = self.state[what].copy_to_host()
        if group is None:
            values[:] = value
        else:
            values[self.group_index(group)] = value
        self.state.load({what: values})

    def group_values(self, what: str = "lr") -> dict[str, float]:
        """{group: value} of the device lr or weight_decay (host copy; syncs)."""
        values = self.state[what].copy_to_host()
        return {g: float(values[i]) for i, g in enumerate(self.groups)}

    def read_stats(self) -> dict[str, float]:
        """Host copy of the stats (syncs; for tests and logs, not the hot path)."""
        from numbarl.cuda.runtime import stream

        s = stream()
        host = self.stats.copy_to_host(stream=s)
        s.synchronize()
        names = ("grad_norm", "clip_scale", "lr", "step", "skipped", "clipped", "target_copies", "lr_scale",
                 "lr_restarts", "target_soft_updates", "decay_rate", "lr_warmup_scale")
        return {name: float(host[i]) for i, name in enumerate(names)}
