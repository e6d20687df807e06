"""Multi-horizon C51: one distributional double-DQN loss per n-step horizon, blended per sample by a
trend-strength regime weight (agent.horizons, e.g. "1,5,20"; off by default).

Math. For horizons h_0 < h_1 < ... < h_{H-1} (bars) the replay draws one transition (τ, e) and
returns every horizon's window of it (numbarl/rl/replay.py, `Replay(horizons=)`): R_h, done_h,
γ^{m_h} and next_obs_h = obs[τ + m_h]. Horizon i has its own C51 target (numbarl/rl/losses/c51.py):

    a*_i = argmax_a E[Z_online(next_obs_i, a)]           double DQN, online net at that horizon's state
    m_i  = Φ(R_{h_i} + (1 − done_i) γ^{m_i} z, p_target(next_obs_i, a*_i))     Eq. 7 projection
    CE_i[b] = (1/n_branches) Σ_k −Σ_z m_i log softmax(logits_online(obs)[a_taken])

and the loss is their per-sample blend

    L = (1/B) Σ_b Σ_i w_i[b] · CE_i[b],      w_i[b] = β_i(s_b) · ι_b

with ι_b the replay's importance weight (1 without one) and β_i the regime blend of the sample's
trend strength s_b ∈ [0, 1]:

    s_b  = clip((obs[b, regime_col] − lo) / (hi − lo), 0, 1)      ADX(14)/100 by default: lo = 0.20,
                                                                   hi = 0.40 (Wilder's "no trend" and
                                                                   "strong trend" levels)
    x_b  = s_b · (H − 1)                                           position along the horizons
    β_i  = (1 − mix) / H + mix · max(0, 1 − |x_b − i|)              Σ_i β_i = 1

A ranging bar (s = 0) puts the regime part of the weight on the shortest horizon, a strongly
trending one (s = 1) on the longest, and bars in between on the two neighbouring horizons (a hat
over the horizon index); `mix` ∈ [0, 1] keeps (1 − mix) spread evenly so every horizon always
learns (mix = 0: a plain average of the H losses, mix = 1: only the regime's horizons).

Gradient: ∂L/∂logits[b, k, a_taken, :] = Σ_i w_i[b] / (B · n_branches) · (softmax − m_i), i.e. the
C51 gradient of each horizon with per-sample weights w_i. Each horizon runs the unchanged C51 kernels
(`C51Loss`, per-sample weights = w_i) and the gradients accumulate into ONE d_logits buffer by the
loss contract (numbarl/rl/losses/base.py): the first horizon applied writes, the others add (an axpy
each), in a fixed program order — deterministic, no atomics. The horizon equal to agent.n_step is the
agent's own C51 loss (its buffer is the destination; it goes first), so everything else that reads the
n-step batch (IQN, ICM, the stats, the diagnostics' atom utilisation) is unchanged.

Cost (why it is off by default): horizon i ≠ n_step needs the online net (double-DQN argmax) and the
target net on next_obs_i — two extra forward passes per extra horizon, plus one C51 target/grad/reduce
triple and a d_logits axpy (B · n_branches · max_actions · Z floats). With "1,5,20" and n_step = 5:
four extra forwards next to the step's online forward + backward and two "next"/"target" forwards.

The regime column. agent.horizon_regime_col names the trend-strength feature, default `adx_14`
(ADX(14)/100, bounded, not z-scored; another feature needs lo/hi in its units), or gives an obs column
index; the agent resolves a name to its column in the run's feature list (numbarl/rl/obs_columns.py;
obs column 53 in the default 64-feature set, DEFAULT_FEATURES). This loss takes the column index.

Kernels (thread mapping): `horizon_blend_kernel`, one thread per sample (s_b, the H weights);
`add_scalar_kernel`, one thread (the total loss, horizons summed in ascending order). Everything
else is the C51 loss's three kernels per horizon.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from numbarl.config import parse_horizons  # re-exported: agent.horizons' parser
from numbarl.cuda.runtime import Arena, cuda
from numbarl.rl.losses.base import Loss
from numbarl.rl.losses.c51 import C51Loss, c51_loss_ref
from numbarl.rl.nets.base import _address

_cuda = cuda()

BLOCK = 128  # threads per block of the per-sample blend kernel

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)

# Wilder's ADX levels (ADX / 100): below 0.20 no trend, above 0.40 a strong one
DEFAULT_TREND_LO = 0.20
DEFAULT_TREND_HI = 0.40
DEFAULT_REGIME_COL = 53  # adx_14 in numbarl.data.features.DEFAULT_FEATURES


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def trend_strength_ref(feature, lo: float, hi: float):
    """s = clip((feature − lo) / (hi − lo), 0, 1) (NaN -> 0), float64 [B]."""
    f = np.asarray(feature, np.float64)
    s = np.clip((f - lo) / (hi - lo), 0.0, 1.0)
    return np.where(np.isfinite(s), s, 0.0)


def blend_weights_ref(trend, n_horizons: int, mix: float):
    """β [H, B] of the module docstring from trend strengths s [B]."""
    s = np.asarray(trend, np.float64)
    x = s * (n_horizons - 1)
    idx = np.arange(n_horizons, dtype=np.float64)[:, None]
    hat = np.maximum(0.0, 1.0 - np.abs(x[None, :] - idx))
    return (1.0 - mix) / n_horizons + mix * hat


def multi_horizon_loss_ref(online_logits, actions, obs, horizon_inputs, support, branch_sizes, regime_col: int,
                           lo: float, hi: float, mix: float, weights=None):
    """The blended loss of the module docstring, from the C51 reference per horizon.

    horizon_inputs: one dict per horizon (ascending) with next_q, target_probs, rewards, dones,
    discounts and optionally next_mask (`c51_loss_ref`'s arguments). weights: importance weights [B]
    or None. Returns (loss, per-horizon weighted losses [H], d_logits, blend β [H, B], trend s [B],
    per-horizon unweighted per-sample CE [H, B]).
    """
    obs = np.asarray(obs, np.float64)
    trend = trend_strength_ref(obs[:, regime_col], lo, hi)
    beta = blend_weights_ref(trend, len(horizon_inputs), mix)
    imp = np.ones(obs.shape[0]) if weights is None else np.asarray(weights, np.float64)
    total, parts, ces, d_total = 0.0, [], [], None
    for i, h in enumerate(horizon_inputs):
        loss, per_sample, d_logits, _ = c51_loss_ref(online_logits, actions, h["next_q"], h["target_probs"],
                                                     h["rewards"], h["dones"], h["discounts"], support, branch_sizes,
                                                     weights=beta[i] * imp, next_mask=h.get("next_mask"))
        total += loss
        parts.append(loss)
        ces.append(per_sample)
        d_total = d_logits if d_total is None else d_total + d_logits
    return total, np.array(parts), d_total, beta, trend, np.array(ces)


# ---------------------------------------------------------------------------------------------
# device functions
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def blend_weight(s, i, n_horizons, mix, base):
    """β_i(s) = base + mix · max(0, 1 − |s (H − 1) − i|), base = (1 − mix) / H (float32)."""
    x = s * np.float32(n_horizons - 1)
    hat = _ONE - abs(x - np.float32(i))
    hat = max(hat, _ZERO)
    return base + mix * hat


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def horizon_blend_kernel(obs, col, lo, inv_width, mix, base, importance, use_importance, weights, trend):
    """One thread per sample b: trend[b] = s_b, weights[i, b] = β_i(s_b) · ι_b for every horizon i."""
    b = _cuda.grid(1)
    if b >= obs.shape[0]:
        return
    s = (obs[b, col] - lo) * inv_width
    if not s > _ZERO:  # also NaN
        s = _ZERO
    s = min(s, _ONE)
    trend[b] = s
    n_h = weights.shape[0]
    for i in range(n_h):
        w = blend_weight(s, i, n_h, mix, base)
        if use_importance != 0:
            w = w * importance[b]
        weights[i, b] = w


@_cuda.jit(cache=True)
def add_scalar_kernel(src, dst, first):
    """dst[0] = src[0] (first) or dst[0] + src[0]: the total loss, horizons in a fixed order."""
    if _cuda.grid(1) == 0:
        if first != 0:
            dst[0] = src[0]
        else:
            dst[0] = dst[0] + src[0]


# ---------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------
class _CallLedger:
    """The gradient rule for one apply() called without a ParamStore: the first write of a buffer
    overwrites, later writes add."""

    def __init__(self):
        self._written = set()

    def act_beta(self, buffer) -> float:
        key = _address(buffer)
        if key in self._written:
            return 1.0
        self._written.add(key)
        return 0.0


class MultiHorizonC51Loss(Loss):
    """H C51 losses on the same online logits, blended per sample (module docstring).

    losses: one `C51Loss` per horizon (ascending horizons), built for the same head and batch; the
    one at index `primary` (the agent's own C51 loss, horizon = agent.n_step) is applied first, so its
    own d_logits may be the destination. Contract (numbarl/rl/losses/base.py):

        mh.apply({"logits", "actions", "obs", "horizons": [per-horizon dicts of C51Loss inputs:
                  next_q, target_probs, rewards, dones, discounts[, next_mask]][, "weights"]},
                 {"logits": d_logits}, stream, weight, ledger=store)

    adds weight · ∂L/∂logits into d_logits by the gradient rule (one apply per horizon: the first
    writer overwrites, the rest add). After it: `loss` [1] the blended L, `weights` [H, B] the w_i,
    `trend` [B] the s_b, `losses[i].loss` horizon i's weighted part, `losses[i].per_sample` its
    unweighted CE.
    """

    name = "multi_horizon_c51"
    inputs = ("logits", "actions", "obs", "horizons")
    grad_inputs = ("logits",)

    def __init__(self, losses, horizons, primary: int = 0, regime_col: int = DEFAULT_REGIME_COL,
                 trend_lo: float = DEFAULT_TREND_LO, trend_hi: float = DEFAULT_TREND_HI, mix: float = 0.5):
        self.losses = list(losses)
        self.horizons = tuple(int(h) for h in horizons)
        if len(self.losses) != len(self.horizons) or len(self.horizons) < 2:
            raise ValueError(f"MultiHorizonC51Loss: one C51Loss per horizon and at least two horizons "
                             f"(got {len(self.losses)} losses for horizons {self.horizons})")
        if list(self.horizons) != sorted(set(self.horizons)):
            raise ValueError(f"MultiHorizonC51Loss: horizons must be ascending and distinct, got {self.horizons}")
        if not 0 <= primary < len(self.losses):
            raise ValueError(f"MultiHorizonC51Loss: primary = {primary} is not a horizon index")
        if not trend_hi > trend_lo:
            raise ValueError(f"MultiHorizonC51Loss: trend_hi ({trend_hi}) must be > trend_lo ({trend_lo})")
        if not 0.0 <= mix <= 1.0:
            raise ValueError(f"MultiHorizonC51Loss: mix must be in [0, 1], got {mix}")
        batches = {loss.batch for loss in self.losses}
        if len(batches) != 1:
            raise ValueError(f"MultiHorizonC51Loss: the horizons' losses have different batches {sorted(batches)}")
        self.batch = batches.pop()
        self.primary, self.regime_col = int(primary), int(regime_col)
        self.trend_lo, self.trend_hi, self.mix = float(trend_lo), float(trend_hi), float(mix)
        self.order = [self.primary] + [i for i in range(len(self.losses)) if i != self.primary]
        H = len(self.horizons)
        arena = Arena("multi_horizon_loss")
        arena.add("weights", (H, self.batch), np.float32)
        arena.add("trend", (self.batch,), np.float32)
        arena.add("loss", (1,), np.float32)
        arena.allocate()
        self.arena = arena

    @property
    def weights(self):
        """Device float32 [H, B]: w_i[b] = β_i(s_b) · ι_b of the last call."""
        return self.arena["weights"]

    @property
    def trend(self):
        """Device float32 [B]: the trend strength s_b of the last call."""
        return self.arena["trend"]

    @property
    def per_sample(self):
        raise TypeError("MultiHorizonC51Loss has no single per-sample loss; horizon i's unweighted CE is "
                        "losses[i].per_sample")

    def grad(self, name: str):
        raise TypeError("MultiHorizonC51Loss accumulates its horizons' gradients into the buffer given to apply(); "
                        "it has no gradient buffer of its own")

    def blend(self, obs, importance, stream) -> None:
        """weights [H, B] and trend [B] from obs [B, state_dim] (and importance [B] or None)."""
        if obs.shape[0] != self.batch or not 0 <= self.regime_col < obs.shape[1]:
            raise ValueError(f"multi-horizon C51: obs {tuple(obs.shape)} has no regime column {self.regime_col} "
                             f"for batch {self.batch} (agent.horizon_regime_col)")
        H = len(self.horizons)
        use = importance is not None
        horizon_blend_kernel[max(1, -(-self.batch // BLOCK)), BLOCK, stream](
            obs, np.int64(self.regime_col), np.float32(self.trend_lo),
            np.float32(1.0 / (self.trend_hi - self.trend_lo)), np.float32(self.mix), np.float32((1.0 - self.mix) / H),
            importance if use else self.trend, np.int32(use), self.weights, self.trend)

    def compute(self, x: dict, stream) -> None:
        raise TypeError("MultiHorizonC51Loss: use apply() (its horizons accumulate into the caller's buffer)")

    def apply(self, x: dict, grads: dict, stream, weight: float = 1.0, ledger=None) -> None:
        missing = [n for n in self.inputs if n not in x]
        if missing:
            raise KeyError(f"{self.name}: missing inputs {missing}; it reads {list(self.inputs)}")
        if len(x["horizons"]) != len(self.horizons):
            raise ValueError(f"{self.name}: {len(x['horizons'])} horizon inputs for horizons {self.horizons}")
        self.blend(x["obs"], x.get("weights"), stream)
        ledger = ledger if ledger is not None else _CallLedger()  # without one: this call's first write overwrites
        for i in self.order:  # the primary first (it may own the destination), then ascending
            h = x["horizons"][i]
            inputs = {"logits": x["logits"], "actions": x["actions"], "next_q": h["next_q"],
                      "target_probs": h["target_probs"], "rewards": h["rewards"], "dones": h["dones"],
                      "discounts": h["discounts"], "next_mask": h.get("next_mask"), "weights": self.weights[i]}
            self.losses[i].apply(inputs, grads, stream, weight=weight, ledger=ledger)
        for i, loss in enumerate(self.losses):  # L = Σ_i L_i in ascending horizon order
            add_scalar_kernel[1, 1, stream](loss.loss, self.loss, np.int32(i == 0))


__all__ = ["C51Loss", "MultiHorizonC51Loss", "blend_weights_ref", "multi_horizon_loss_ref", "parse_horizons",
           "trend_strength_ref"]
