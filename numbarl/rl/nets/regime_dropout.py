"""Regime dropout: inverted dropout on the trunk's output of the online training pass, at a rate set by
each sample's market regime (issue 15, spec T4; the origin's ``apply_regime_dropout``).

For sample b with regime signal r_b = clip(obs[b, col], 0, 1) (agent.regime_dropout_col, default adx_14 =
ADX(14)/100, resolved to its obs column by the agent, 53 in the default feature set: a trending market drops
more) and trunk output h [B, H]:

    p_b     = p_lo + (p_hi − p_lo) · r_b
    keep_bj = u_bj ≥ p_b,   u_bj = uniform(seed, lane b·H + j, train step, DROPOUT_SLOT)   (numbarl/cuda/rng.py)
    s_bj    = keep_bj / (1 − p_b)          (inverted dropout: E[s] = 1; Srivastava et al. 2014)
    h'_bj   = h_bj · s_bj                  every consumer of the online pass (the C51 head, the auxiliary
                                           heads, ICM) reads h'
    ∂L/∂h   = ∂L/∂h' ⊙ s                    applied to dh in place before the trunk's backward

Only the online training pass drops: the next / target passes, acting and the backtests see h (so the
logged q_divergence, online Q on dropped features against target Q on undropped ones, includes the
dropout's noise). The
draw is a pure function of (seed, lane, train step), so graph replays and a second run draw the same
masks and the eager warm-up and the graph agree (the step counter lives on the device).

Thread mapping: one element (b, j) per thread (grid-stride) for both kernels; the scale s is kept
([B, H]) for the backward, plus a 0/1 "dropped" array whose mean is the ``regime_dropout_frac`` stat.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from numbarl.cuda.kernels import elementwise
from numbarl.cuda.registry import RNG_STREAMS
from numbarl.cuda.rng import uniform
from numbarl.cuda.runtime import Arena, cuda

_cuda = cuda()  # the backend (GPU or simulator), selected once


DROPOUT_SLOT = RNG_STREAMS.claim("regime.dropout", 205)  # lane b·H + j, counter = the train step
P_MAX = 0.95  # largest drop rate accepted (a rate of 1 has no inverse scale)

_ZERO, _ONE = np.float32(0.0), np.float32(1.0)


# ---------------------------------------------------------------------------------------------
# reference (numpy; the draws are the kernels' bit for bit: the same njit function)
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def _draws(n_rows, width, seed, counter):
    u = np.empty((n_rows, width), np.float32)
    for b in range(n_rows):
        for j in range(width):
            u[b, j] = uniform(np.uint64(seed), b * width + j, counter, DROPOUT_SLOT)
    return u


def drop_rate_ref(regime, p_lo: float, p_hi: float) -> np.ndarray:
    """p [B] float32 as the kernel computes it."""
    r = np.clip(np.asarray(regime, np.float32), np.float32(0), np.float32(1))
    return np.float32(p_lo) + (np.float32(p_hi) - np.float32(p_lo)) * r


def scale_ref(regime, width: int, p_lo: float, p_hi: float, seed: int, counter: int) -> np.ndarray:
    """s [B, H] float32 (module docstring)."""
    p = drop_rate_ref(regime, p_lo, p_hi)
    u = _draws(p.shape[0], int(width), int(seed), int(counter))
    inv = (np.float32(1) / (np.float32(1) - p))[:, None]
    return np.where(u >= p[:, None], inv, np.float32(0)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def dropout_forward_kernel(h, obs, col, p_lo, p_span, seed, counter, out, scale, dropped):
    """out = h ⊙ s, s and the 0/1 dropped indicator written; one element per thread (grid-stride)."""
    width = h.shape[1]
    step = counter[0]
    for t in range(_cuda.grid(1), h.shape[0] * width, _cuda.gridsize(1)):
        b = t // width
        j = t - b * width
        r = min(max(obs[b, col], _ZERO), _ONE)
        p = p_lo + p_span * r
        s = _ZERO
        d = _ONE
        if uniform(seed, t, step, DROPOUT_SLOT) >= p:
            s = _ONE / (_ONE - p)
            d = _ZERO
        scale[b, j] = s
        dropped[b, j] = d
        out[b, j] = h[b, j] * s


@_cuda.jit(cache=True)
def dropout_backward_kernel(dh, scale):
    """dh ⊙= s in place."""
    width = dh.shape[1]
    for t in range(_cuda.grid(1), dh.shape[0] * width, _cuda.gridsize(1)):
        b = t // width
        j = t - b * width
        dh[b, j] = dh[b, j] * scale[b, j]


# ---------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------
class RegimeDropout:
    """The online pass's dropout (module docstring): ``forward(h, obs, counter, stream)`` -> h' (its own
    buffer), ``backward(dh, stream)`` scales dh in place; ``dropped`` [B, H] for the stat."""

    def __init__(self, batch: int, width: int, col: int, p_lo: float, p_hi: float, seed: int):
        if not 0.0 <= p_lo <= p_hi <= P_MAX:
            raise ValueError(f"regime dropout: need 0 <= p_lo <= p_hi <= {P_MAX} (got {p_lo}, {p_hi})")
        self.batch, self.width, self.col = int(batch), int(width), int(col)
        self.p_lo, self.p_hi, self.seed = float(p_lo), float(p_hi), int(seed)
        self.arena = Arena("regime_dropout")
        for name in ("h", "scale", "dropped"):
            self.arena.add(name, (self.batch, self.width), np.float32)
        self.arena.allocate()

    @property
    def output(self):
        return self.arena["h"]

    @property
    def dropped(self):
        return self.arena["dropped"]

    def forward(self, h, obs, counter, stream):
        if tuple(h.shape) != (self.batch, self.width) or obs.shape[0] != self.batch or self.col >= obs.shape[1]:
            raise ValueError(f"regime dropout: h {tuple(h.shape)}, obs {tuple(obs.shape)}, column {self.col}; "
                             f"expected h {(self.batch, self.width)} and obs of {self.batch} rows with that column")
        out = self.arena["h"]
        dropout_forward_kernel[elementwise.stride_launch(out.size) + (stream,)](
            h, obs, np.int64(self.col), np.float32(self.p_lo), np.float32(self.p_hi) - np.float32(self.p_lo),
            np.uint64(self.seed), counter, out, self.arena["scale"], self.arena["dropped"])
        return out

    def backward(self, dh, stream):
        dropout_backward_kernel[elementwise.stride_launch(dh.size) + (stream,)](dh, self.arena["scale"])
        return dh
