"""Market data the environment trades on, and its one-time upload to the device.

The env does not import the data package: it takes the arrays of a feature cache (or of a test's
synthetic market) directly.

    features    float32 [T, F]  causal, normalized state features of bar t (known at t's close)
    mid         float64 [T]     close mid of bar t (price units)
    bid, ask    float64 [T]     best bid / ask at t's close (fills cross the spread)
    high, low   float64 [T]     high / low of bar t (target and stop triggers)
    session_id  int32   [T]     trading session of bar t (0.., chronological)
    timestamps  int64   [T]     bar close time (ns)
    tick_size, bars_per_day     scalars from the cache meta

Volatility unit (target/stop distances, observation scaling) -- causal, per bar:

    d_t = mid_t - mid_{t-1},  v_t = (1 - a) v_{t-1} + a d_t^2,  w_t = (1 - a) w_{t-1} + a,  a = 2 / (span + 1)
    vol_t = max(sqrt(v_t / w_t) * sqrt(horizon), tick_size)      (vol_0 = tick_size)

(EWMA variance with the bias correction 1 / w_t, as pandas' ewm(adjust=True) of d^2 without a
prior; vol_t uses mid up to bar t only).

Precision: prices, volatility and all P&L are float64 on the device. The H200 runs fp64 at the
fp32 non-tensor rate, an env step is a few hundred flops, and float32 (24-bit mantissa) cannot
hold a 5,000.25 price plus sub-tick P&L increments accumulated over 10^6 bars; float64 also
keeps the device env within rounding of the CPU reference, so parity tests can use tight
tolerances. Observations and rewards are float32 (network inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numba import njit

from numbarl.cuda import backend

backend.select()  # the backend (GPU or simulator), selected once


# ---------------------------------------------------------------------------------------------
# reference / host computation
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def causal_volatility(mid, span, horizon, floor):
    """Causal EWMA volatility unit per bar (see module docstring); float64 [T]."""
    n = mid.shape[0]
    out = np.empty(n, np.float64)
    if n == 0:
        return out
    a = 2.0 / (span + 1.0)
    v = 0.0
    w = 0.0
    scale = math.sqrt(horizon)
    out[0] = floor
    for t in range(1, n):
        d = mid[t] - mid[t - 1]
        v = (1.0 - a) * v + a * d * d
        w = (1.0 - a) * w + a
        out[t] = max(math.sqrt(v / w) * scale, floor)
    return out


def _array(name, value, dtype, ndim, n=None):
    if value is None:
        raise ValueError(f"MarketData.{name} is missing")
    arr = np.ascontiguousarray(np.asarray(value), dtype=dtype)
    if arr.ndim != ndim:
        raise ValueError(f"MarketData.{name} must be {ndim}-D, got shape {arr.shape}")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"MarketData.{name} has {arr.shape[0]} bars, features have {n}")
    return arr


@dataclass(frozen=True, eq=False)
class MarketData:
    """Bar arrays of one dataset (host numpy). Validated and converted on construction."""

    features: np.ndarray
    mid: np.ndarray
    bid: np.ndarray
    ask: np.ndarray
    high: np.ndarray
    low: np.ndarray
    session_id: np.ndarray
    timestamps: np.ndarray
    tick_size: float
    bars_per_day: float
    _vol_cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        feats = _array("features", self.features, np.float32, 2)
        n = feats.shape[0]
        if n < 2:
            raise ValueError(f"MarketData needs at least 2 bars, got {n}")
        object.__setattr__(self, "features", feats)
        for name in ("mid", "bid", "ask", "high", "low"):
            arr = _array(name, getattr(self, name), np.float64, 1, n)
            if not np.all(np.isfinite(arr)):
                bad = int(np.flatnonzero(~np.isfinite(arr))[0])
                raise ValueError(f"MarketData.{name}[{bad}] = {arr[bad]!r} is not finite")
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "session_id", _array("session_id", self.session_id, np.int32, 1, n))
        object.__setattr__(self, "timestamps", _array("timestamps", self.timestamps, np.int64, 1, n))
        if np.any(self.ask < self.bid):
            bad = int(np.flatnonzero(self.ask < self.bid)[0])
            raise ValueError(f"MarketData: ask < bid at bar {bad} ({self.ask[bad]} < {self.bid[bad]})")
        if np.any(self.high < self.low):
            bad = int(np.flatnonzero(self.high < self.low)[0])
            raise ValueError(f"MarketData: high < low at bar {bad} ({self.high[bad]} < {self.low[bad]})")
        if not np.all(np.isfinite(feats)):
            bad = np.argwhere(~np.isfinite(feats))[0]
            raise ValueError(f"MarketData.features[{bad[0]}, {bad[1]}] is not finite")
        for name in ("tick_size", "bars_per_day"):
            v = getattr(self, name)
            if not isinstance(v, (int, float, np.floating, np.integer)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"MarketData.{name} = {v!r} is invalid: allowed a finite number > 0")
            object.__setattr__(self, name, float(v))

    @classmethod
    def from_cache(cls, cache) -> "MarketData":
        """From a numbarl feature cache object (attributes features, mid, ..., meta)."""
        meta = cache.meta
        return cls(
            features=cache.features,
            mid=cache.mid,
            bid=cache.bid,
            ask=cache.ask,
            high=cache.high,
            low=cache.low,
            session_id=cache.session_id,
            timestamps=cache.timestamps,
            tick_size=meta["tick_size"],
            bars_per_day=meta["bars_per_day"],
        )

    @property
    def n_bars(self) -> int:
        return int(self.features.shape[0])

    @property
    def n_features(self) -> int:
        return int(self.features.shape[1])

    def volatility(self, span: int, horizon: int) -> np.ndarray:
        """Causal volatility unit per bar (float64 [T]); cached per (span, horizon)."""
        key = (int(span), int(horizon))
        vol = self._vol_cache.get(key)
        if vol is None:
            vol = causal_volatility(self.mid, float(span), float(horizon), float(self.tick_size))
            self._vol_cache[key] = vol
        return vol

    def to_device(self, vol_span: int, vol_horizon_bars: int) -> "DeviceMarket":
        """Upload every array once (one Arena, fixed addresses)."""
        return DeviceMarket(self, vol_span, vol_horizon_bars)


class DeviceMarket:
    """MarketData on the device: views of one Arena("market"), uploaded once."""

    def __init__(self, data: MarketData, vol_span: int, vol_horizon_bars: int):
        from numbarl.cuda.runtime import Arena

        self.data = data
        self.vol_span = int(vol_span)
        self.vol_horizon_bars = int(vol_horizon_bars)
        n, f = data.features.shape
        arena = Arena("market")
        arena.add("features", (n, f), np.float32)
        for name in ("mid", "bid", "ask", "high", "low", "vol"):
            arena.add(name, (n,), np.float64)
        arena.add("session_id", (n,), np.int32)
        arena.allocate(zero=False)
        arena.load(
            {
                "features": data.features,
                "mid": data.mid,
                "bid": data.bid,
                "ask": data.ask,
                "high": data.high,
                "low": data.low,
                "vol": data.volatility(vol_span, vol_horizon_bars),
                "session_id": data.session_id,
            }
        )
        self.arena = arena
        self.n_bars = n
        self.n_features = f
        self.tick_size = data.tick_size
        self.bars_per_day = data.bars_per_day

    def __getitem__(self, name):
        return self.arena[name]

    def check(self, params) -> None:
        if (params.vol_span, params.vol_horizon_bars) != (self.vol_span, self.vol_horizon_bars):
            raise ValueError(
                f"DeviceMarket was uploaded with vol_span={self.vol_span}, vol_horizon_bars="
                f"{self.vol_horizon_bars} but EnvParams has vol_span={params.vol_span}, vol_horizon_bars="
                f"{params.vol_horizon_bars}; upload with data.to_device(params.vol_span, params.vol_horizon_bars)"
            )


def check_range(name: str, bar_range, n_bars: int, min_len: int = 2) -> tuple[int, int]:
    """Validate a [start, end) bar range against the data."""
    try:
        lo, hi = (int(bar_range[0]), int(bar_range[1]))
    except (TypeError, ValueError, IndexError):
        raise ValueError(f"{name} must be a (start, end) pair of bar indices, got {bar_range!r}") from None
    if not (0 <= lo and hi <= n_bars and hi - lo >= min_len):
        raise ValueError(
            f"{name} = ({lo}, {hi}) is invalid: need 0 <= start, end <= {n_bars} (bars in the data) "
            f"and at least {min_len} bars"
        )
    return lo, hi
