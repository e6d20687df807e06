"""Observation noise on the training batch (agent.obs_noise): Gaussian noise on the market features of every
observation the learner reads in a train step, a regularizer against memorizing the training sessions.

Why: on the regime-walk market (94 training sessions, ninth session) the memoryless agent reached a Sharpe of
68 on its own training path (ε = 0.05) while its validation Sharpe was −9 and its test Sharpe 0: 16,384 envs
replay the same ~100,000 bars about 1,700 times in a run, and a 2 × 512 network fits each bar's outcome from
its exact feature values. Its Q-mean climbed with the training-path earnings, as it did in every run whose
validation Sharpe peaked early and decayed (docs/RESULTS.md). Perturbing the features of each sampled
transition (the replay keeps the clean values) makes a single bar's exact values useless and leaves what
holds across nearby values (input-noise training ≈ Tikhonov regularization, Bishop 1995; the same
augmentation as DrQ / RAD for pixels, Kostrikov et al. 2021, Laskin et al. 2020).

For the sampled batch in the SAMPLE phase of every train step (counter = the train step, on the device):

    x[r, c] += σ · ε(lane0 + r · n_cols + c, step),  ε ~ N(0, 1) by the counter RNG (numbarl/cuda/rng.py)

for the market columns c < n_cols (the features come first in an observation, then the portfolio features,
which stay exact: they are the agent's own position and P&L), on obs, next_obs, each extra horizon's next_obs
and, with the temporal input, each row of the windows whose mask is set (masked rows stay zero). Each tensor
has its own lane range (lane0), so obs and next_obs of one transition get independent noise. Most features
are z-scored (numbarl/data/features.py), so σ is in units of their standard deviation; the few registered
without normalization (the time-of-session sine and cosine, on [−1, 1]) get the same absolute σ. Acting, the
backtests and the replay see the clean observations.

Every consumer in the train step reads the perturbed rows, the controls included: regime dropout's rate
column and the multi-horizon blend's regime column come from the noised obs (with the temporal input, the
trunk reads the windows, whose rows draw their own noise, while those columns come from obs: the same bar
then carries two independent draws). The learner never sees a clean training observation.

Stat (liveness key): ``obs_noise_var`` = the mean of the squared noise added to obs this step (≈ σ²).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from numbarl.cuda.kernels import elementwise
from numbarl.cuda.registry import RNG_STREAMS
from numbarl.cuda.rng import normal
from numbarl.cuda.runtime import Arena, cuda

_cuda = cuda()  # the backend (GPU or simulator), selected once

# normal(slot s) draws the uniform slots 2s and 2s + 1: claim both
_FIRST = RNG_STREAMS.claim("augment.obs_noise", 270, width=2)
NOISE_SLOT = _FIRST // 2
SIGMA_MAX = 10.0

_ZERO = np.float32(0.0)


# ---------------------------------------------------------------------------------------------
# reference (numpy; the draws are the kernel's bit for bit: the same njit normal)
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def _noise(n_rows, n_cols, sigma, seed, lane0, counter):
    e = np.empty((n_rows, n_cols), np.float32)
    for r in range(n_rows):
        for c in range(n_cols):
            e[r, c] = sigma * normal(np.uint64(seed), lane0 + r * n_cols + c, counter, NOISE_SLOT)
    return e


def apply_ref(x, n_cols: int, sigma: float, seed: int, lane0: int, counter: int, row_mask=None):
    """(x + noise on the first n_cols columns of the unmasked rows, the noise added) as float32 arrays.
    row_mask: None or [B, K] with x's rows r = b·K + k."""
    x = np.array(x, np.float32)
    e = _noise(x.shape[0], int(n_cols), np.float32(sigma), int(seed), int(lane0), int(counter))
    if row_mask is not None:
        keep = np.asarray(row_mask).reshape(-1) != 0
        e[~keep] = _ZERO
    x[:, :n_cols] += e
    return x, e


# ---------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def obs_noise_kernel(x, n_cols, row_mask, use_mask, sigma, seed, lane0, counter, sq, write_sq):
    """x[r, c] += σ·ε for c < n_cols (rows with row_mask 0 untouched); sq[r·n_cols + c] = the noise² when
    write_sq. One element per thread (grid-stride)."""
    step = counter[0]
    n_steps = row_mask.shape[1]
    for t in range(_cuda.grid(1), x.shape[0] * n_cols, _cuda.gridsize(1)):
        r = t // n_cols
        c = t - r * n_cols
        e = _ZERO
        keep = True
        if use_mask:
            b = r // n_steps
            keep = row_mask[b, r - b * n_steps] != _ZERO
        if keep:
            e = sigma * normal(seed, lane0 + t, step, NOISE_SLOT)
            x[r, c] = x[r, c] + e
        if write_sq:
            sq[t] = e * e


# ---------------------------------------------------------------------------------------------
# the augmentation
# ---------------------------------------------------------------------------------------------
class ObsNoise:
    """``apply(x, which, counter, stream, row_mask=None)`` perturbs x in place (module docstring); ``which``
    (0, 1, ...) picks the tensor's lane range. ``sq`` [batch·n_cols] holds the last obs noise² (which = 0)."""

    def __init__(self, batch: int, n_cols: int, sigma: float, seed: int, max_rows: int):
        if not 0.0 < sigma <= SIGMA_MAX:
            raise ValueError(f"obs noise: sigma must be in (0, {SIGMA_MAX}], got {sigma}")
        if n_cols < 1:
            raise ValueError(f"obs noise: no market feature columns to perturb (n_cols = {n_cols})")
        self.batch, self.n_cols, self.sigma, self.seed = int(batch), int(n_cols), float(sigma), int(seed)
        self.lanes = int(max_rows) * self.n_cols  # one tensor's lane range
        self.arena = Arena("obs_noise")
        self.arena.add("sq", (self.batch * self.n_cols,), np.float32)
        self.arena.add("no_mask", (1, 1), np.float32)
        self.arena.allocate()

    @property
    def sq(self):
        return self.arena["sq"]

    def apply(self, x, which: int, counter, stream, row_mask=None):
        if x.ndim != 2 or x.shape[1] < self.n_cols or x.shape[0] * self.n_cols > self.lanes:
            raise ValueError(f"obs noise: x of shape {tuple(x.shape)}; expected [rows <= {self.lanes // self.n_cols}, "
                             f">= {self.n_cols}]")
        if row_mask is not None and row_mask.size != x.shape[0]:
            raise ValueError(f"obs noise: row mask of {row_mask.size} entries for {x.shape[0]} rows")
        write_sq = which == 0
        if write_sq and x.shape[0] != self.batch:
            raise ValueError(f"obs noise: the stat tensor (which = 0) must have {self.batch} rows, got {x.shape[0]}")
        mask = self.arena["no_mask"] if row_mask is None else row_mask
        obs_noise_kernel[elementwise.stride_launch(x.shape[0] * self.n_cols) + (stream,)](
            x, np.int64(self.n_cols), mask, row_mask is not None, np.float32(self.sigma), np.uint64(self.seed),
            np.int64(int(which) * self.lanes), counter, self.sq, write_sq)
        return x
