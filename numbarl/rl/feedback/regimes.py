"""Regime buckets: tercile of a trend-strength feature x tercile of a volatility feature (9 buckets).

    bucket(x) = 3 * t(x[a]; lo_a, hi_a) + t(x[b]; lo_b, hi_b),   t(v; lo, hi) = [v > lo] + [v > hi]

The tercile edges (lo, hi) are the 1/3 and 2/3 quantiles of each feature over the fold's
*training* window (computed once, on the host); a NaN feature value falls in tercile 0. The same
rule runs on the host (numpy, for validation trades) and on the device (`bucket_of`, for the
env's observations), so a bar lands in the same bucket on both sides. The default features are
``adx_14`` (Wilder ADX, trend strength) and ``rv_32`` (realized volatility over 32 bars); both are
in numbarl's default feature list.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numbarl.cuda.runtime import cuda

_cuda = cuda()

N_BUCKETS = 9
DEFAULT_FEATURES = ("adx_14", "rv_32")


@dataclass(frozen=True)
class RegimeBuckets:
    """Columns (a, b) of the observation and their tercile edges (lo_a, hi_a, lo_b, hi_b)."""

    col_a: int
    col_b: int
    edges: tuple  # float32 (lo_a, hi_a, lo_b, hi_b)

    @classmethod
    def fit(cls, features: np.ndarray, train: tuple[int, int], names, wanted=DEFAULT_FEATURES) -> "RegimeBuckets":
        """Edges from the training window's rows of `features` [n_bars, F] (columns named `names`)."""
        names = list(names)
        missing = [w for w in wanted if w not in names]
        if missing:
            raise ValueError(f"the regime buckets need the features {', '.join(wanted)}; the data has no "
                             f"{', '.join(missing)} (add them to data.features)")
        lo, hi = train
        cols = [names.index(w) for w in wanted]
        edges = []
        for c in cols:
            v = np.asarray(features[lo:hi, c], np.float64)
            v = v[np.isfinite(v)]
            if v.size == 0:
                raise ValueError(f"feature {names[c]!r} has no finite value in the training window {train}")
            edges += [np.quantile(v, 1 / 3), np.quantile(v, 2 / 3)]
        return cls(cols[0], cols[1], tuple(float(np.float32(e)) for e in edges))

    def edges_array(self) -> np.ndarray:
        return np.asarray(self.edges, np.float32)

    def of(self, rows: np.ndarray) -> np.ndarray:
        """Bucket of each row of features/observations [n, >= F] (host; the device rule exactly)."""
        rows = np.asarray(rows, np.float32)
        e = self.edges_array()
        a, b = rows[:, self.col_a], rows[:, self.col_b]
        ta = (a > e[0]).astype(np.int64) + (a > e[1])
        tb = (b > e[2]).astype(np.int64) + (b > e[3])
        return 3 * ta + tb


@_cuda.jit(device=True)
def bucket_of(a, b, edges):
    """Device twin of RegimeBuckets.of for one row's two feature values (float32 compares)."""
    ta = 0
    if a > edges[0]:
        ta += 1
    if a > edges[1]:
        ta += 1
    tb = 0
    if b > edges[2]:
        tb += 1
    if b > edges[3]:
        tb += 1
    return 3 * ta + tb
