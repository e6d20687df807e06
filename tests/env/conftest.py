"""Synthetic markets for the env tests (tiny, random, on a tick grid)."""

import numpy as np
import pytest

from numbarl.env.market import MarketData


def synthetic_market(rng, n_bars=120, n_features=5, tick=0.25, bars_per_session=40, start=100.0):
    """Random-walk mid on a half-tick grid, 1-2 tick spreads, high/low around the bar's path."""
    steps = rng.integers(-3, 4, n_bars) * (tick / 2)
    mid = start + np.cumsum(steps)
    spread = tick * rng.integers(1, 3, n_bars)
    bid = mid - spread / 2
    ask = mid + spread / 2
    prev = np.concatenate([[mid[0]], mid[:-1]])
    high = np.maximum(prev, mid) + tick * rng.integers(0, 4, n_bars)
    low = np.minimum(prev, mid) - tick * rng.integers(0, 4, n_bars)
    return MarketData(
        features=rng.standard_normal((n_bars, n_features)).astype(np.float32),
        mid=mid,
        bid=bid,
        ask=ask,
        high=high,
        low=low,
        session_id=(np.arange(n_bars) // bars_per_session).astype(np.int32),
        timestamps=(np.arange(n_bars, dtype=np.int64) * 1_000_000_000),
        tick_size=tick,
        bars_per_day=float(bars_per_session),
    )


@pytest.fixture
def market(rng):
    return synthetic_market(rng)


@pytest.fixture
def make_market():
    """The synthetic_market function (tests call it with their own sizes)."""
    return synthetic_market
