"""The C51 value support fitted to the rewards in the replay (`agent.support = "fit"`).

Why: the default support is ±10 with 51 atoms (Δz = 0.4), while a bar's micro-reward is about
0.006 and a closed trade about 0.01-0.1: the returns then fall between a few atoms and the
distribution has almost no resolution. The fit sets v_max = −v_min from the returns the learner
will actually bootstrap on, once, after the replay prefill and before the first train step.

Rule (float64, host, once):

    R_n      the n-step returns of every valid (time, env) window in the replay, computed exactly as
             the sampler forms them (numbarl/rl/replay.py: m = min(n, 1 + first done), R_n =
             Σ_{k<m} γ^k r_{τ+k}, the same n and the replay's current γ)
    A        = max(|quantile_0.001(R_n)|, |quantile_0.999(R_n)|)            (np.quantile, linear)
    v        = A · f                          agent.support_horizon_factor = f > 0
    v        = max(A / sqrt(1 − γ^{2n}), |mean R_n| / (1 − γ^n))             f = 0 (the default: auto)
    support  = linspace(−v, v, Z)

Reasoning for the auto factor: the value is a discounted sum over ~1/(1−γ) bars, i.e. over
successive n-step windows, G = Σ_j γ^{nj} R_n^{(j)}, not one window. If the windows are
independent with zero mean (a martingale-like P&L stream: the usual case for trading rewards), the
spread of G is the spread of one window times sqrt(Σ_j γ^{2nj}) = 1 / sqrt(1 − γ^{2n}) (γ = 0.99,
n = 3: ×4.1). A persistent mean (e.g. a holding cost paid every bar) instead accumulates linearly:
|mean R_n| · Σ_j γ^{nj} = |mean R_n| / (1 − γ^n) (×33.8 at the same γ, n). The support takes the
larger of the two, so that neither a fat-tailed zero-mean stream nor a constant drift piles the
value mass on the support's ends. Returns beyond ±v are clipped by the projection as before. A
v below MIN_HALF_WIDTH or non-finite (no non-zero reward in the prefill) keeps the configured support.

With adaptive atom positions (agent.adaptive_atoms, numbarl/rl/losses/atoms.py) the fit sets only the
ends: the support is v_min + (v_max − v_min)·c_i/c_{Z−1} of the learned spacings, which are still the
uniform ones at the fit (it runs before the first train step, the spacings move after their warm-up).
"""

from __future__ import annotations

import math

import numpy as np

QUANTILE = 0.001  # the tails that set the scale: quantiles 0.001 and 0.999 of R_n
MIN_HALF_WIDTH = 1e-6  # below this (float32 1/Δz would lose precision) the configured support is kept


def replay_nstep_returns(reward, done, count: int, n_step: int, gamma: float) -> np.ndarray:
    """R_n of every valid window of a replay store, float64 [V · N] (module docstring).

    reward float32 [n_slots, N], done [n_slots, N] (nonzero = done): the replay's store; count: writes
    so far. Times τ ∈ [max(0, count − n_slots), count − 1 − n]: the sampler's range without its extra
    horizons' and history's trims (numbarl/rl/replay.py; a few more complete windows, all valid returns);
    empty when there is none.
    """
    reward = np.asarray(reward, np.float64)
    done = np.asarray(done) != 0
    n_slots = reward.shape[0]
    valid = min(int(count), n_slots) - int(n_step)
    if valid <= 0:
        return np.zeros(0)
    lo = max(int(count) - n_slots, 0)
    taus = lo + np.arange(valid)
    ret = np.zeros((valid, reward.shape[1]))
    alive = np.ones_like(ret)  # 0 once the window met a done (the done step's reward is included)
    disc = 1.0
    for k in range(int(n_step)):
        rows = (taus + k) % n_slots
        ret += alive * disc * reward[rows]
        disc *= gamma
        alive = alive * (~done[rows])
    return ret.ravel()


def horizon_factor(gamma: float, n_step: int) -> float:
    """1 / sqrt(1 − γ^{2n}): the spread of a discounted sum of independent n-step windows over one."""
    g = float(gamma) ** (2 * int(n_step))
    return math.inf if g >= 1.0 else 1.0 / math.sqrt(1.0 - g)


def fit_support_range(returns, gamma: float, n_step: int, factor: float = 0.0) -> dict:
    """The fitted half-width v (module docstring) and what it came from.

    Returns {"v": v or None (keep the configured support), "abs_quantile": A, "mean": mean R_n,
    "factor": the spread factor used, "n": number of returns}.
    """
    r = np.asarray(returns, np.float64)
    out = {"v": None, "abs_quantile": 0.0, "mean": 0.0, "factor": float(factor), "n": int(r.size)}
    if r.size == 0 or not np.all(np.isfinite(r)):
        return out
    lo, hi = np.quantile(r, [QUANTILE, 1.0 - QUANTILE])
    a = max(abs(float(lo)), abs(float(hi)))
    mean = float(np.mean(r))
    out["abs_quantile"], out["mean"] = a, mean
    if factor > 0.0:
        v = a * float(factor)
    else:
        f = horizon_factor(gamma, n_step)
        g_n = float(gamma) ** int(n_step)
        drift = math.inf if g_n >= 1.0 else abs(mean) / (1.0 - g_n)
        if not (math.isfinite(f) and math.isfinite(drift)):
            raise ValueError(f"agent.support=fit with gamma = {gamma}: the auto horizon factor needs gamma < 1; "
                             "set agent.support_horizon_factor")
        out["factor"] = f
        v = max(a * f, drift)
    if math.isfinite(v) and v >= MIN_HALF_WIDTH:
        out["v"] = v
    return out
