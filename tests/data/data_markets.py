"""Test markets shared by the data tests: CME-like days with a pre-open, and CSV exports.

A real CME Globex MBP-10 day (rebuilt from order-by-order data) holds, before each session's
17:00 America/Chicago open, a pre-open: a book clear, then indicative books that are crossed or
locked (orders accepted, none matched), no trades; at the open the opening auction prints one
large trade without an aggressor side (side N), then continuous trading. ``cme_like_records``
puts such a pre-open and opening print in front of each session of the synthetic market.
"""

from __future__ import annotations

import io

import databento_dbn as dbn
import numpy as np

from numbarl.data import synth
from numbarl.data.calendar import SessionCalendar
from numbarl.data.records import (
    ACTION_ADD, ACTION_CLEAR, ACTION_TRADE, F_LAST, N_LEVELS, SIDE_BID, SIDE_NONE, empty_records,
)  # fmt: skip

TICK = synth.TICK_FIXED
MINUTE = 60 * 1_000_000_000


def preopen(first: np.ndarray, open_ns: int, rng: np.random.Generator, n_states: int = 150, minutes: int = 15):
    """Pre-open records before ``open_ns`` (a clear, then crossed/locked indicative books) and the
    opening print at the open, around the first book of the session ``first``."""
    lv0 = first["levels"][0]
    bid0, ask0 = int(lv0["bid_px"]), int(lv0["ask_px"])
    recs = empty_records(n_states + 2)
    recs["instrument_id"] = first["instrument_id"]
    recs["publisher_id"] = first["publisher_id"]
    times = open_ns - minutes * MINUTE + np.sort(rng.integers(0, minutes * MINUTE - 1_000_000, n_states + 1))
    recs["ts_recv"][:-1] = times
    recs["ts_recv"][-1] = open_ns
    recs["ts_event"] = recs["ts_recv"] - 20_000
    recs["action"][0] = ACTION_CLEAR
    recs["flags"][0] = F_LAST
    for k in range(1, n_states + 1):
        overlap = int(rng.integers(0, 4))  # 0: locked, 1..3 ticks crossed
        bid = ask0 + overlap * TICK - int(rng.integers(0, 2)) * TICK
        ask = bid - overlap * TICK
        r = recs[k]
        r["action"], r["side"], r["flags"] = ACTION_ADD, SIDE_BID, F_LAST
        lv = r["levels"]
        for m in range(N_LEVELS):
            lv[m]["bid_px"], lv[m]["ask_px"] = bid - m * TICK, ask + m * TICK
            lv[m]["bid_sz"], lv[m]["ask_sz"] = int(rng.integers(5, 80)), int(rng.integers(5, 80))
            lv[m]["bid_ct"], lv[m]["ask_ct"] = 1, 1
    # the opening print: the auction's uncrossing trade, one large size, no aggressor side
    r = recs[-1]
    r["action"], r["side"], r["flags"] = ACTION_TRADE, SIDE_NONE, 0
    r["price"] = bid0 + TICK * int((ask0 - bid0) // (2 * TICK))
    r["size"] = 2500
    r["levels"] = first["levels"]
    return recs


def cme_like_records(sessions: int = 3, seed: int = 7, events_per_session: int = 6000) -> np.ndarray:
    """Synthetic sessions, each behind a CME-style pre-open and opening auction print."""
    rng = np.random.default_rng(seed)
    calendar = SessionCalendar()
    parts = []
    for day, (records, _) in zip(
        synth.trade_dates(sessions), synth.iter_sessions(sessions, seed, events_per_session=events_per_session)
    ):
        open_ns, _ = calendar.open_close_ns(day)
        first_book = records[np.flatnonzero(records["flags"] & F_LAST)[0]]
        assert int(records["ts_recv"][0]) >= open_ns
        parts += [preopen(first_book, open_ns, rng), records]
    out = np.concatenate(parts)
    assert np.all(np.diff(out["ts_recv"].astype(np.int64)) >= 0)
    return out


def csv_export(dbn_bytes: bytes, pretty: bool = False) -> bytes:
    """Databento's own CSV export of DBN bytes (plain)."""
    out = io.BytesIO()
    transcoder = dbn.Transcoder(out, dbn.Encoding.CSV, dbn.Compression.NONE, pretty_px=pretty, pretty_ts=pretty)
    transcoder.write(dbn_bytes)
    transcoder.flush()
    return out.getvalue()
