"""MBP-10 records as numpy structured arrays: the layout of a Databento DBN v3 ``Mbp10Msg``.

One record is 368 bytes, byte for byte the DBN encoding (little-endian, no padding)::

    header   length u1 (record size / 4), rtype u1 (10 for MBP-10), publisher_id u2,
             instrument_id u4, ts_event u8
    body     price i8, size u4, action u1, side u1, flags u1, depth u1, ts_recv u8,
             ts_in_delta i4, sequence u4
    levels   10 x (bid_px i8, ask_px i8, bid_sz u4, ask_sz u4, bid_ct u4, ask_ct u4)

so ``np.frombuffer(dbn_bytes, MBP10_DTYPE)`` is a zero-copy view of decoded records, and
``records.tobytes()`` is valid DBN record data. Prices are int64 fixed point with scale 1e-9
(``PRICE_SCALE``); an empty price is ``UNDEF_PRICE`` (INT64_MAX). To price units they are divided
by ``PRICE_DIVISOR`` (1e9), never multiplied by 1e-9: 1e-9 is not a double, and the product lands
up to an ulp off (4000.25 became 4000.2500000000005); the quotient is correctly rounded, so a
price on a decimal tick grid is the double nearest to its decimal value. ``action`` and ``side`` hold
ASCII codes (``ACTION_TRADE == ord("T")``) so numba code compares integers.

Flags (Databento): F_LAST (128) marks the last record of an event packet, the only records whose
levels are a consistent book; F_SNAPSHOT (32) marks book-replay records, not market activity;
F_MAYBE_BAD_BOOK (4) marks a possible gap (the book may be wrong until the next clear).
Source: databento-dbn ``dbn/src/record.rs`` (``Mbp10Msg``, ``BidAskPair``) and ``flags.rs``.
"""

from __future__ import annotations

import numpy as np

N_LEVELS = 10
RECORD_BYTES = 368
RTYPE_MBP10 = 10
PRICE_SCALE = 1e-9  # the fixed-point scale, as a number (divide by PRICE_DIVISOR to convert)
PRICE_DIVISOR = 1e9
UNDEF_PRICE = np.iinfo(np.int64).max

F_LAST = 128
F_TOB = 64
F_SNAPSHOT = 32
F_MBP = 16
F_BAD_TS_RECV = 8
F_MAYBE_BAD_BOOK = 4

ACTION_ADD = ord("A")
ACTION_CANCEL = ord("C")
ACTION_MODIFY = ord("M")
ACTION_TRADE = ord("T")
ACTION_FILL = ord("F")
ACTION_CLEAR = ord("R")
ACTION_NONE = ord("N")

SIDE_BID = ord("B")  # buy order; in a trade: buy aggressor (signed volume +1)
SIDE_ASK = ord("A")  # sell order; in a trade: sell aggressor (signed volume -1)
SIDE_NONE = ord("N")  # no side given: the tick rule signs the trade

LEVEL_DTYPE = np.dtype(
    [
        ("bid_px", "<i8"),
        ("ask_px", "<i8"),
        ("bid_sz", "<u4"),
        ("ask_sz", "<u4"),
        ("bid_ct", "<u4"),
        ("ask_ct", "<u4"),
    ]
)

MBP10_DTYPE = np.dtype(
    [
        ("length", "u1"),
        ("rtype", "u1"),
        ("publisher_id", "<u2"),
        ("instrument_id", "<u4"),
        ("ts_event", "<u8"),
        ("price", "<i8"),
        ("size", "<u4"),
        ("action", "u1"),
        ("side", "u1"),
        ("flags", "u1"),
        ("depth", "u1"),
        ("ts_recv", "<u8"),
        ("ts_in_delta", "<i4"),
        ("sequence", "<u4"),
        ("levels", LEVEL_DTYPE, (N_LEVELS,)),
    ]
)
assert MBP10_DTYPE.itemsize == RECORD_BYTES

# record types of other schemas, to name the schema in errors (databento-dbn ``RType``)
RTYPE_NAMES = {
    0x00: "trades (mbp-0)",
    0x01: "mbp-1",
    0x0A: "mbp-10",
    0x11: "ohlcv (deprecated)",
    0x12: "status",
    0x13: "definition",
    0x14: "imbalance",
    0x18: "statistics",
    0x20: "ohlcv-1s",
    0x21: "ohlcv-1m",
    0x22: "ohlcv-1h",
    0x23: "ohlcv-1d",
    0x24: "ohlcv-eod",
    0xA0: "mbo",
    0xB1: "cmbp-1",
    0xC0: "cbbo-1s",
    0xC1: "cbbo-1m",
    0xC2: "tcbbo",
    0xC3: "bbo-1s",
    0xC4: "bbo-1m",
}
# control records that may appear in any stream and carry no market data: skipped by the reader
RTYPE_ERROR = 0x15
RTYPE_SYMBOL_MAPPING = 0x16
RTYPE_SYSTEM = 0x17


def empty_records(n: int) -> np.ndarray:
    """``n`` zeroed MBP-10 records with the header filled in and all levels empty."""
    recs = np.zeros(n, MBP10_DTYPE)
    recs["length"] = RECORD_BYTES // 4
    recs["rtype"] = RTYPE_MBP10
    recs["levels"]["bid_px"] = UNDEF_PRICE
    recs["levels"]["ask_px"] = UNDEF_PRICE
    recs["price"] = UNDEF_PRICE
    return recs


def to_price(fixed) -> np.ndarray:
    """Fixed-point int64 prices to float64 price units; ``UNDEF_PRICE`` becomes NaN."""
    fixed = np.asarray(fixed, dtype=np.int64)
    out = fixed.astype(np.float64) / PRICE_DIVISOR
    return np.where(fixed == UNDEF_PRICE, np.nan, out)


def schema_name(rtype: int) -> str:
    return RTYPE_NAMES.get(int(rtype), f"unknown record type {int(rtype)}")
