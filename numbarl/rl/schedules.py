"""Learning-rate schedules computed on the device inside the train step: per-group linear warm-up
and cosine annealing with warm restarts (SGDR), and the Adam first-moment scaling at a restart.

For optimizer group g with base learning rate lr_g, at the optimizer step t (0-based: the steps
taken before this one) the step uses

    warm_g(t) = min(1, (t − start_g + 1) / W)            linear warm-up over W steps from the step
                                                          the group started (start_g: 0, or the step
                                                          a group was added / restarted)
    cos(t)    = m + (1 − m) · ½ (1 + cos(π · (t mod C) / C))        SGDR, Loshchilov & Hutter 2017,
                                                          Eq. 5, with T_i = C for every cycle and
                                                          η_min = m · η_max
    lr_g(t)   = lr_g · warm_g(t) · cos(t)

W = 0 turns the warm-up off (warm = 1), C = 0 the cosine (cos = 1). At a warm restart (t > 0 and
t mod C = 0) Adam's first moments are multiplied by `restart_momentum_scale` (0.5: the momentum
is halved, so the first steps of the new cycle follow the fresh gradients sooner) before the
update of step t.

The schedule is a kernel of one thread that writes the optimizer's lr[G] (and the restart scale)
from the device step counter, so the captured train step follows it without re-capture; it is
launched only when a schedule is configured (the default constant learning rate leaves the
train step's launches, and its bits, exactly as they were).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from numbarl.cuda.runtime import cuda

_cuda = cuda()  # the backend (GPU or simulator), selected once

_ONE = np.float32(1.0)


@dataclass(frozen=True)
class ScheduleConfig:
    """Learning-rate schedule of an optimizer (every field 0 / default: constant learning rate)."""

    warmup_steps: int = 0
    """Linear warm-up length W in optimizer steps, per group from its start (0 = off)."""
    cycle_steps: int = 0
    """Cosine period C in optimizer steps, restarted every C steps (0 = off)."""
    min_lr_frac: float = 0.0
    """Lowest learning rate of a cosine cycle as a fraction m of the base rate."""
    restart_momentum_scale: float = 0.5
    """Factor on Adam's first moments at each warm restart (1 = leave them)."""

    def __post_init__(self):
        if int(self.warmup_steps) < 0 or int(self.cycle_steps) < 0:
            raise ValueError(f"ScheduleConfig: warmup_steps ({self.warmup_steps}) and cycle_steps "
                             f"({self.cycle_steps}) must be >= 0")
        if not 0.0 <= self.min_lr_frac <= 1.0:
            raise ValueError(f"ScheduleConfig.min_lr_frac must be in [0, 1], got {self.min_lr_frac}")
        if not 0.0 <= self.restart_momentum_scale <= 1.0:
            raise ValueError(f"ScheduleConfig.restart_momentum_scale must be in [0, 1], got "
                             f"{self.restart_momentum_scale}")

    @property
    def active(self) -> bool:
        return self.warmup_steps > 0 or self.cycle_steps > 0


# ---------------------------------------------------------------------------------------------
# reference (float64)
# ---------------------------------------------------------------------------------------------
def lr_multiplier_ref(t: int, start: int, cfg: ScheduleConfig) -> tuple[float, bool]:
    """(warm · cos multiplier of step t for a group started at `start`, is t a warm restart)."""
    warm = 1.0
    if cfg.warmup_steps > 0:
        warm = min(1.0, (t - start + 1) / cfg.warmup_steps)
    cos, restart = 1.0, False
    if cfg.cycle_steps > 0:
        pos = t % cfg.cycle_steps
        cos = cfg.min_lr_frac + (1.0 - cfg.min_lr_frac) * 0.5 * (1.0 + math.cos(math.pi * pos / cfg.cycle_steps))
        restart = t > 0 and pos == 0
    return warm * cos, restart


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def schedule_kernel(step, base_lr, start, warmup, cycle, min_frac, restart_scale, lr, momentum_scale, stats,
                    slot_scale, slot_warmup):
    """One thread: lr[g] = base_lr[g] · warm_g · cos for this step (module docstring, float64 math,
    rounded once); momentum_scale[0] = restart_scale at a warm restart, else 1; stats[slot_scale] =
    group 0's multiplier and stats[slot_warmup] its warm-up part. The optimizer applies the restart
    scale and counts the restart (numbarl.rl.optim.scale_restart_kernel: not on a skipped step)."""
    if _cuda.grid(1) != 0:
        return
    t = step[0]
    cos = 1.0
    restart = False
    if cycle > 0:
        pos = t % cycle
        cos = min_frac + (1.0 - min_frac) * 0.5 * (1.0 + math.cos(math.pi * np.float64(pos) / np.float64(cycle)))
        restart = t > 0 and pos == 0
    for g in range(lr.shape[0]):
        warm = 1.0
        if warmup > 0:
            warm = min(1.0, np.float64(t - start[g] + 1) / np.float64(warmup))
        mult = warm * cos
        lr[g] = np.float32(np.float64(base_lr[g]) * mult)
        if g == 0:
            stats[slot_scale] = np.float32(mult)
            stats[slot_warmup] = np.float32(warm)
    if restart:
        momentum_scale[0] = np.float32(restart_scale)
    else:
        momentum_scale[0] = _ONE


@_cuda.jit(cache=True)
def reset_group_moments_kernel(m, v, group_id, group):
    """m = v = 0 for every element of optimizer group `group` (targeted moment reset)."""
    for i in range(_cuda.grid(1), m.shape[0], _cuda.gridsize(1)):
        if group_id[i] == group:
            m[i] = np.float32(0.0)
            v[i] = np.float32(0.0)
