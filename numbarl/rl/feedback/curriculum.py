"""E8 curriculum weights: learn more from the market regimes where validation trades fail.

Buckets: the 9 regime buckets of numbarl/rl/feedback/regimes.py (tercile of a trend-strength
feature, ``adx_14``, x tercile of a volatility feature, ``rv_32`` by default; edges fixed once
from the fold's training window). After each epoch's validation (its *feedback* part, F0.4)::

    n_b  = validation trades whose entry bar lies in bucket b,  l_b = those with P&L ≤ 0
    f_b  = l_b / n_b                       (mode "rate": the failure rate of the bucket), or
           l_b / Σ l                       (mode "share": the bucket's share of all losing trades)
    f̄    = Σ l / Σ n                       ("rate": the overall failure rate), or 1/9 ("share")
    w_b  = clip(1 + κ (f_b − f̄), w_lo, w_hi)         (κ = kappa, clip (0.5, 2) by default)
    a bucket without validation trades gets f_b = f̄ (w_b = 1): no evidence, no change.

"rate" is the default: "share" ranks buckets by how often the agent trades there as much as by
how badly (the most visited regime collects the most losers at any failure rate); it is kept for
the literal "share of losing trades" reading. A trade's bucket is that of its entry bar's
features, the same values the env's obs carries in its first F columns.

How the weights act (choice (b) of the two the catalogue names): as importance weights in the
loss, not as a two-stage sampler. The replay's weighted batch multiplies each sampled row's
stored weight by w of the bucket of its obs and normalizes the batch to mean 1
(``Replay(normalize_weights=True).sample(counter, stream, factor=curriculum)``, numbarl/rl/replay.py),
and the C51 loss takes those per-sample weights. In expectation this is sampling ∝ w_b (the
gradient of Σ_b w_b L_b under uniform draws is that of Σ L_b under draws ∝ w_b), and:

- it composes with E6 by a product (a winning trade's row in a failure regime gets both factors)
  in the one normalization the replay already does;
- the uniform draw, and so every sampled index, stays exactly as without it;
- nothing has to be rebuilt: a two-stage sampler needs per-bucket index lists of a ring whose rows
  change every collect step (lists rebuilt between epochs go stale within n_slots steps, or need a
  device compaction per collect step), and a bucket that is rare in the replay would be drawn
  from a handful of rows over and over.
The cost is variance: the clip bounds the ratio of two weights by w_hi / w_lo = 4.

Before the first update every w_b = 1 and the weighted batch is all exactly 1.0 (the loss then
computes the bits it computes without weights).
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda.runtime import Arena
from numbarl.rl.feedback.regimes import N_BUCKETS, RegimeBuckets

MODES = ("rate", "share")


def curriculum_weights(buckets, losing, kappa: float = 1.0, clip=(0.5, 2.0), mode: str = "rate") -> np.ndarray:
    """The 9 weights w_b (float64, module docstring) from each validation trade's bucket (ints in
    [0, 9)) and whether it lost (bool)."""
    if mode not in MODES:
        raise ValueError(f"curriculum mode must be one of {MODES}, got {mode!r}")
    b = np.asarray(buckets, np.int64).ravel()
    lost = np.asarray(losing, bool).ravel()
    if b.shape != lost.shape:
        raise ValueError(f"curriculum_weights: {b.size} buckets for {lost.size} trades")
    if b.size and (b.min() < 0 or b.max() >= N_BUCKETS):
        raise ValueError(f"curriculum_weights: buckets must be in [0, {N_BUCKETS})")
    n = np.bincount(b, minlength=N_BUCKETS).astype(np.float64)
    lo = np.bincount(b[lost], minlength=N_BUCKETS).astype(np.float64)
    if n.sum() == 0:
        return np.ones(N_BUCKETS)
    if mode == "rate":
        f_bar = lo.sum() / n.sum()
        f = np.where(n > 0, lo / np.maximum(n, 1.0), f_bar)
    else:
        f_bar = 1.0 / N_BUCKETS
        f = lo / lo.sum() if lo.sum() > 0 else np.full(N_BUCKETS, f_bar)
        f = np.where(n > 0, f, f_bar)
    return np.clip(1.0 + float(kappa) * (f - f_bar), float(clip[0]), float(clip[1]))


class Curriculum:
    """E8 (module docstring). buckets: the fold's RegimeBuckets (columns + training-window edges);
    kappa: κ (0: every weight 1); clip: (w_lo, w_hi); mode: "rate" or "share".

    Device part (read by ``Replay.sample(..., factor=self)``): ``col_a``, ``col_b`` (obs columns),
    ``edges`` float32 [4] and ``table`` float32 [9] (w_b), fixed addresses, rewritten by update()."""

    def __init__(self, buckets: RegimeBuckets, kappa: float = 1.0, clip=(0.5, 2.0), mode: str = "rate"):
        if mode not in MODES:
            raise ValueError(f"curriculum mode must be one of {MODES}, got {mode!r}")
        if not 0.0 < float(clip[0]) <= 1.0 <= float(clip[1]):
            raise ValueError(f"curriculum clip must satisfy 0 < lo <= 1 <= hi, got {tuple(clip)}")
        if kappa < 0.0:
            raise ValueError(f"curriculum kappa must be >= 0, got {kappa}")
        self.buckets, self.kappa, self.clip, self.mode = buckets, float(kappa), tuple(map(float, clip)), mode
        self.col_a, self.col_b = int(buckets.col_a), int(buckets.col_b)
        self.weights = np.ones(N_BUCKETS)  # host copy of the table (float64)
        self.counts = np.zeros((2, N_BUCKETS), np.int64)  # last update: trades, losing trades per bucket
        self.arena = Arena("feedback.curriculum")
        self.arena.add("edges", (4,), np.float32)
        self.arena.add("table", (N_BUCKETS,), np.float32)

    def allocate(self) -> Curriculum:
        self.arena.allocate()
        self.arena.load({"edges": self.buckets.edges_array(), "table": np.ones(N_BUCKETS, np.float32)})
        return self

    @property
    def edges(self):
        return self.arena["edges"]

    @property
    def table(self):
        return self.arena["table"]

    def trade_buckets(self, val_trades, features) -> np.ndarray:
        """Bucket of each trade's entry bar: features [n_bars, F] (the market features, rows = bar
        indices as in the trades' entry_bar)."""
        entry = np.asarray(val_trades["entry_bar"], np.int64)
        features = np.asarray(features)
        if entry.size and (entry.min() < 0 or entry.max() >= features.shape[0]):
            raise ValueError(f"curriculum: entry bars in [{entry.min()}, {entry.max()}] outside the features' "
                             f"{features.shape[0]} rows")
        return self.buckets.of(features[entry]) if entry.size else np.zeros(0, np.int64)

    def update(self, val_trades, features) -> dict[str, float]:
        """Between epochs (host): w from the validation trades (DataFrame with entry_bar and pnl,
        e.g. BacktestResult.trades of the feedback part) and the market features; written to the
        device table (a host copy: outside capture). Returns {"curriculum_w<b>": w_b}."""
        b = self.trade_buckets(val_trades, features)
        lost = np.asarray(val_trades["pnl"], np.float64) <= 0.0
        self.weights = curriculum_weights(b, lost, self.kappa, self.clip, self.mode)
        self.counts = np.stack([np.bincount(b, minlength=N_BUCKETS), np.bincount(b[lost], minlength=N_BUCKETS)])
        self.arena.load({"table": self.weights.astype(np.float32)})
        return self.weights_dict()

    def weights_dict(self) -> dict[str, float]:
        return {f"curriculum_w{k}": float(np.float32(w)) for k, w in enumerate(self.weights)}

    def summary(self) -> dict[str, float]:
        """Liveness numbers for the metrics: the largest and smallest bucket weight."""
        w = self.weights.astype(np.float32)
        return {"curriculum_weight_max": float(w.max()), "curriculum_weight_min": float(w.min())}

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {"table": self.weights.astype(np.float32), "counts": self.counts.copy()}

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        if "table" in arrays:
            self.weights = np.asarray(arrays["table"], np.float64).copy()
            self.arena.load({"table": np.asarray(arrays["table"], np.float32)})
        if "counts" in arrays:
            self.counts = np.asarray(arrays["counts"], np.int64).copy()
