"""What an MBP-10 record may say: the checks every format's records pass before they become bars.

Readers check a file's structure (DBN framing, CSV cells, LOBSTER and Binance lines); this module
checks what the records say, the same way for every format. Two kinds of answer:

* **an error** (:class:`DataError`, naming the file and record) for what makes the whole stream
  meaningless: a ``ts_recv`` outside [1971-01-01, 2200-01-01) (sentinels such as 2^64 - 1, a
  negative time read as unsigned, a value that overflows the session calendar), or timestamps
  going backwards (readers.py);
* **counted and skipped** (``BarBuilder.counts``: one warning line per kind at the end of a
  build, and ``meta.json["skipped"]`` in the cache) for one bad record among good ones. The bar
  builder (bars.py) applies these checks; its reference applies the same ones:

  - a book state (a record with F_LAST) whose levels are not a book: a price beyond
    ±``MAX_ABS_PRICE`` (1e8 price units: INT64_MIN, 9e18, ...), a size or order count above
    ``MAX_SIZE`` (1e9: u32 sentinels), a defined level behind an empty one, bids not strictly
    decreasing or asks not strictly increasing from level 1 to 10 -> ``bad_book`` (a gap);
  - a book state whose best bid or best ask is far from the session's last good book (outside
    the band trades are held to, below) -> ``off_book`` (a gap), unless ``JUMP_CONFIRM``
    consecutive states are: then the market has moved (a gap, a halt) and the third is used;
  - a book state whose prices are off the tick grid -> ``off_grid`` (a gap): with a known tick
    (``--tick-size``) any price not a whole number of ticks from the best bid; without one the
    grid is estimated causally (below) and a state that disagrees with it is skipped until
    ``TICK_CONFIRM`` states have shown the finer grid;
  - a trade (action T) whose price is undefined, beyond ±``MAX_ABS_PRICE``, or far from the last
    good book of the session (more than max(2 × the book's 10-level width, 10 % of its mid) from
    its mid: a price of 0 or INT64_MIN among prices near 4000) -> ``bad_trade_price``; a trade
    size above ``MAX_SIZE`` -> ``bad_trade_size``. A skipped trade adds no volume, no imbalance
    and nothing to the thresholds' averages.

Tick size, estimated causally. Each good book state has a grid: the gcd of the differences of its
level prices (both sides) to its best bid. A grid value seen in ``TICK_CONFIRM`` states becomes the
tick when no tick is known yet, or replaces a coarser tick it divides. One corrupt state cannot set
or refine the tick (its grid is seen once), and the tick in force at a bar's close (the ``tick``
field of the bar) uses only records up to that close. Features that count in ticks use it.
"""

from __future__ import annotations

import datetime as dt

import numpy as np
from numba import njit

from numbarl.data.errors import DataError
from numbarl.data.records import N_LEVELS, UNDEF_PRICE

MAX_ABS_PRICE_UNITS = 1e8
MAX_ABS_PRICE = 100_000_000 * 1_000_000_000  # fixed point (1e-9): 1e17
MAX_SIZE = 1_000_000_000
TS_MIN = int((dt.datetime(1971, 1, 1, tzinfo=dt.timezone.utc).timestamp())) * 1_000_000_000
TS_MAX = int((dt.datetime(2200, 1, 1, tzinfo=dt.timezone.utc).timestamp())) * 1_000_000_000
TICK_CONFIRM = 3
JUMP_CONFIRM = 3
TICK_SLOTS = 8  # grid values remembered while waiting for confirmation

# book checks
BOOK_OK = 0
BOOK_ONE_SIDED = 1  # best bid or best ask missing: not a usable state, not an error
BOOK_BAD = 2

SKIP_NAMES = {
    "crossed_outside_session": "crossed or locked book states outside the trading session (pre-open, halts)",
    "crossed_in_session": "crossed or locked book states inside the trading session (--allow-crossed)",
    "bad_book": "book states whose levels are not a book (sentinel or out-of-range price or size, unordered levels)",
    "off_book": "book states far from the last good book (a jump no later state confirmed)",
    "off_grid": "book states off the tick grid",
    "bad_trade_price": "trades with an undefined, out-of-range or impossible price",
    "bad_trade_size": "trades with an out-of-range size",
    "trade_before_book": "trades before any book state (no price to check them against)",
}


def check_timestamps(ts: np.ndarray, where) -> None:
    """DataError for the first ts_recv outside [TS_MIN, TS_MAX); ``where(i)`` names record i."""
    ts = np.asarray(ts)
    bad = (ts < np.uint64(TS_MIN)) | (ts >= np.uint64(TS_MAX)) if ts.dtype == np.uint64 else (ts < TS_MIN) | (ts >= TS_MAX)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DataError(
            f"{where(i)}: ts_recv {int(ts[i])} is not a time between 1971-01-01 and 2200-01-01 "
            "(a sentinel or corrupt timestamp)"
        )


@njit(cache=True)
def check_levels(lv):
    """BOOK_OK, BOOK_ONE_SIDED or BOOK_BAD for the 10 levels of one record (see the module doc)."""
    for side in range(2):
        empty = False
        prev = np.int64(0)
        for m in range(N_LEVELS):
            if side == 0:
                px = lv[m].bid_px
                sz = lv[m].bid_sz
                ct = lv[m].bid_ct
            else:
                px = lv[m].ask_px
                sz = lv[m].ask_sz
                ct = lv[m].ask_ct
            if px == UNDEF_PRICE:
                empty = True
                continue
            if empty or px > MAX_ABS_PRICE or px < -MAX_ABS_PRICE or sz > MAX_SIZE or ct > MAX_SIZE:
                return BOOK_BAD
            if m > 0:
                if side == 0 and px >= prev:
                    return BOOK_BAD
                if side == 1 and px <= prev:
                    return BOOK_BAD
            prev = px
    if lv[0].bid_px == UNDEF_PRICE or lv[0].ask_px == UNDEF_PRICE:
        return BOOK_ONE_SIDED
    return BOOK_OK


@njit(cache=True)
def _gcd(a, b):
    a = abs(a)
    b = abs(b)
    while b != 0:
        a, b = b, a % b
    return a


@njit(cache=True)
def level_grid(lv):
    """gcd of the differences of the defined level prices to the best bid (0 if all equal)."""
    ref = lv[0].bid_px
    g = np.int64(0)
    for m in range(N_LEVELS):
        px = lv[m].bid_px
        if px != UNDEF_PRICE:
            g = _gcd(g, px - ref)
        px = lv[m].ask_px
        if px != UNDEF_PRICE:
            g = _gcd(g, px - ref)
    return g


@njit(cache=True)
def on_grid(lv, tick):
    """Every defined level price a whole number of ticks from the best bid (``tick`` > 0): the
    usual case, 20 remainders instead of 20 gcds (the gcd path cost half the builder's speed)."""
    ref = lv[0].bid_px
    for m in range(N_LEVELS):
        px = lv[m].bid_px
        if px != UNDEF_PRICE and (px - ref) % tick != 0:
            return False
        px = lv[m].ask_px
        if px != UNDEF_PRICE and (px - ref) % tick != 0:
            return False
    return True


@njit(cache=True)
def tick_update(g, tick, fixed, slots, counts):
    """Causal tick estimate after a good state with grid ``g``: (accepted, new tick).

    ``slots``/``counts`` (int64 [TICK_SLOTS]) remember grid values not yet confirmed. With a
    ``fixed`` (known) tick a state is accepted when ``g`` is a multiple of it.
    """
    if fixed:
        return (tick == 0 or g % tick == 0), tick
    if tick != 0 and g % tick == 0:
        return True, tick
    # a new grid (no tick yet) or a finer one: count it
    k = -1
    for j in range(slots.shape[0]):
        if slots[j] == g:
            k = j
            break
    if k < 0:
        k = 0
        for j in range(slots.shape[0]):  # an empty slot, else the least seen
            if counts[j] < counts[k]:
                k = j
        slots[k] = g
        counts[k] = 0
    counts[k] += 1
    if counts[k] >= TICK_CONFIRM and g > 0 and (tick == 0 or tick % g == 0):
        for j in range(slots.shape[0]):
            slots[j] = 0
            counts[j] = 0
        return True, g
    return tick == 0, tick


@njit(cache=True)
def trade_price_ok(price, ref_valid, ref_lo, ref_hi):
    """A trade price is defined, within ±MAX_ABS_PRICE, and near the session's last good book."""
    if price == UNDEF_PRICE or price > MAX_ABS_PRICE or price < -MAX_ABS_PRICE:
        return False
    if ref_valid == 0:
        return True
    width = ref_hi - ref_lo
    mid = ref_lo + width // 2
    band = max(2 * width, abs(mid) // 10)
    return abs(price - mid) <= band


# ---------------------------------------------------------------------------------------------
# the same checks in plain Python, for the reference bar builder
# ---------------------------------------------------------------------------------------------
def check_levels_ref(bpx, apx, bsz, asz, bct, act) -> int:
    for px, sz, ct, sign in ((bpx, bsz, bct, -1), (apx, asz, act, 1)):
        empty, prev = False, None
        for m in range(N_LEVELS):
            if px[m] == UNDEF_PRICE:
                empty = True
                continue
            if empty or abs(px[m]) > MAX_ABS_PRICE or sz[m] > MAX_SIZE or ct[m] > MAX_SIZE:
                return BOOK_BAD
            if prev is not None and (px[m] - prev) * sign <= 0:
                return BOOK_BAD
            prev = px[m]
    if bpx[0] == UNDEF_PRICE or apx[0] == UNDEF_PRICE:
        return BOOK_ONE_SIDED
    return BOOK_OK


def level_grid_ref(bpx, apx) -> int:
    import math

    g = 0
    for px in list(bpx) + list(apx):
        if px != UNDEF_PRICE:
            g = math.gcd(g, px - bpx[0])
    return g


class TickRef:
    """The causal tick estimate of :func:`tick_update`, in plain Python (same slots, same order)."""

    def __init__(self, fixed_tick: int = 0):
        self.tick = int(fixed_tick)
        self.fixed = fixed_tick > 0
        self.slots = [0] * TICK_SLOTS
        self.counts = [0] * TICK_SLOTS

    def update(self, g: int) -> bool:
        if self.fixed:
            return self.tick == 0 or g % self.tick == 0
        if self.tick and g % self.tick == 0:
            return True
        if g in self.slots:
            k = self.slots.index(g)
        else:
            k = self.counts.index(min(self.counts))
            self.slots[k], self.counts[k] = g, 0
        self.counts[k] += 1
        if self.counts[k] >= TICK_CONFIRM and g > 0 and (self.tick == 0 or self.tick % g == 0):
            self.tick = g
            self.slots = [0] * TICK_SLOTS
            self.counts = [0] * TICK_SLOTS
            return True
        return self.tick == 0


def trade_price_ok_ref(price: int, ref) -> bool:
    if price == UNDEF_PRICE or abs(price) > MAX_ABS_PRICE:
        return False
    if ref is None:
        return True
    lo, hi = ref
    width = hi - lo
    mid = lo + width // 2
    return abs(price - mid) <= max(2 * width, abs(mid) // 10)
