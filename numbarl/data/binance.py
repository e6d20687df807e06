"""Binance raw websocket captures -> MBP-10 records (spot, combined streams).

A capture is a text file (plain or gzip) of lines ``<local receive time, ns> <JSON message>``, as
recorded by hftbacktest's collector and similar tools. Messages read (per symbol ``s``):

* ``<symbol>@depth`` / ``@depth@100ms`` diffs (``depthUpdate``: first and last update id ``U``,
  ``u``; price levels ``b``/``a`` with the *new* quantity, 0 = level gone);
* ``<symbol>@bookTicker`` (best bid/ask price and quantity, update id ``u``);
* ``<symbol>@trade`` (price ``p``, quantity ``q``, trade time ``T`` ms, ``m`` = the buyer is the
  maker: then the seller is the aggressor);
* a REST depth snapshot line (``lastUpdateId``, ``bids``, ``asks``) when the capture has one.

The book. Without a snapshot a price level is known only once a diff or a ticker has named it: the
book starts empty, and deeper levels that never change stay unknown. The rule numbarl uses:

1. diffs are applied in update-id order; a diff whose ``u`` is not above the last applied one is
   a duplicate and ignored; a diff whose ``U`` skips ids (a gap in the feed) is applied and its
   state flagged F_MAYBE_BAD_BOOK (a gap: no bar uses it, the OFI reference is reset);
2. a snapshot replaces the book; the diffs already received whose ``u`` is above its
   ``lastUpdateId`` are applied again on top of it (the capture may receive the snapshot after
   diffs it does not contain);
3. a book ticker is newer than the diff book when its ``u`` is above the last applied diff's
   ``u``: then it *clamps* the book (bid levels above its bid and ask levels below its ask are
   gone, its best levels get its quantities), and it clamps again after every older diff applied
   later. A ticker not newer than the diff book is ignored (the book already knows more);
4. warm-up: a symbol's records are emitted only once both sides of its book are known and either
   a snapshot was applied or ``WARMUP_DIFFS`` depth diffs (one second of ``@100ms``) have been;
   messages before that are counted and left out (a warning says how many);
5. a state whose best bid is not below its best ask (a reconstruction that went wrong: a level
   that vanished between two messages) is flagged F_MAYBE_BAD_BOOK and counted, never used.

Records: one per message after the warm-up, with the symbol's top 10 levels after it; book
messages (diff, ticker, snapshot) have F_LAST (a snapshot also F_SNAPSHOT), trades do not (a bar
closes at the next book message, whose quote shows the trade). ts_recv = the capture's local
time; ts_event = the exchange's event (``E``) or trade (``T``) time. Trades: action T, side A
when ``m`` is true (the seller took liquidity), B when false.

Units. Prices are exact decimals -> 1e-9 fixed point. Quantities are in units of ``SIZE_UNIT``
(1e-5 of the base asset, BTCUSDT's lot step; recorded as ``size_unit`` in the cache's meta): a
quantity is rounded up to whole units (a non-zero level never reads as empty) and capped at
``validate.MAX_SIZE`` units (counted). Sessions: crypto trades every day, the calendar is UTC days
(calendar.UTC_DAYS). Order counts are 0 (Binance sends none).

A line that is not ``<ns> <JSON>``, a message of another stream, or a value that is not a decimal
is a DataError naming the file and line (counted from 1).
"""

from __future__ import annotations

import bisect
import json
import re
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from numbarl.data.errors import DataError
from numbarl.data.lobster import instrument_id_of
from numbarl.data.records import (
    ACTION_MODIFY,
    ACTION_TRADE,
    F_LAST,
    F_MAYBE_BAD_BOOK,
    F_SNAPSHOT,
    N_LEVELS,
    SIDE_ASK,
    SIDE_BID,
    SIDE_NONE,
    UNDEF_PRICE,
    empty_records,
)
from numbarl.data.sources import LineReader, SourceInfo, short
from numbarl.data.validate import MAX_SIZE

SIZE_UNIT = 1e-5
QTY_PER_UNIT = 1000  # quantities are parsed in 1e-8 (Binance prints 8 decimals); 1000 of them per unit
WARMUP_DIFFS = 10
REPLAY_DIFFS = 256  # diffs kept to replay on top of a late snapshot
_PRICE = re.compile(r"^([0-9]{1,9})(?:\.([0-9]{1,9}))?$")  # below 1e9: int64 in 1e-9 fixed point
_QTY = re.compile(r"^([0-9]{1,12})(?:\.([0-9]{1,8}))?$")
_LINE = re.compile(rb"^([0-9]{1,20}) (.*)$", re.DOTALL)


class _Book:
    """One symbol's book: price (1e-9) -> quantity (1e-8), both sides, with sorted prices."""

    def __init__(self):
        self.bids: dict[int, int] = {}
        self.asks: dict[int, int] = {}
        self.bid_keys: list[int] = []  # ascending
        self.ask_keys: list[int] = []
        self.diff_u = -1  # last applied diff's final update id
        self.ticker = None  # (u, bid_px, bid_qty, ask_px, ask_qty) newer than the diff book
        self.snapshot = False
        self.diffs = 0
        self.recent: deque = deque(maxlen=REPLAY_DIFFS)
        self.warm = False

    def _set(self, side: str, px: int, qty: int):
        levels, keys = (self.bids, self.bid_keys) if side == "b" else (self.asks, self.ask_keys)
        if qty == 0:
            if px in levels:
                del levels[px]
                keys.pop(bisect.bisect_left(keys, px))
            return
        if px not in levels:
            bisect.insort(keys, px)
        levels[px] = qty

    def apply(self, bids, asks):
        for px, qty in bids:
            self._set("b", px, qty)
        for px, qty in asks:
            self._set("a", px, qty)

    def clamp(self):
        """Apply the newest ticker on top of the diff book (rule 3)."""
        if self.ticker is None:
            return
        _, bpx, bq, apx, aq = self.ticker
        while self.bid_keys and self.bid_keys[-1] > bpx:
            self._set("b", self.bid_keys[-1], 0)
        while self.ask_keys and self.ask_keys[0] < apx:
            self._set("a", self.ask_keys[0], 0)
        self._set("b", bpx, bq)
        self._set("a", apx, aq)

    def reset(self, bids, asks):
        self.bids, self.asks, self.bid_keys, self.ask_keys = {}, {}, [], []
        self.apply(bids, asks)

    def top(self):
        bids = self.bid_keys[-N_LEVELS:][::-1]
        asks = self.ask_keys[:N_LEVELS]
        return bids, [self.bids[p] for p in bids], asks, [self.asks[p] for p in asks]


class BinanceReader:
    """Stream the MBP-10 records of a Binance websocket capture in chunks."""

    def __init__(self, path, chunk_bytes: int | None = None):
        self.path = Path(path)
        self._lines = LineReader(self.path)
        self.info = SourceInfo(self.path, "binance", self._lines.compressed, dataset="BINANCE.SPOT", schema="binance-ws")
        self.info.size_unit = SIZE_UNIT
        self.chunk_lines = max(64, int(chunk_bytes or (8 << 20)) // 256)
        self.books: dict[str, _Book] = {}
        self._pending_snapshot = None  # a snapshot seen before any symbol
        self.line_no = 0
        self.records_read = 0
        self.skipped_warmup: dict[str, int] = {}
        self.crossed = 0
        self.gaps = 0
        self.capped = 0
        self.stale_tickers = 0

    def close(self):
        self._lines.close()

    def warnings(self) -> list[str]:
        out = []
        for sym, n in self.skipped_warmup.items():
            if n:
                out.append(
                    f"{self.path.name}: {n} messages of {sym} before its book was warm (both sides known and a "
                    f"snapshot or {WARMUP_DIFFS} depth diffs) were left out"
                )
        if self.gaps:
            out.append(f"{self.path.name}: {self.gaps} depth diffs skipped update ids (gaps in the feed; flagged)")
        if self.crossed:
            out.append(f"{self.path.name}: {self.crossed} reconstructed book states were crossed or locked (flagged, not used)")
        if self.capped:
            out.append(f"{self.path.name}: {self.capped} quantities above {MAX_SIZE} units of {SIZE_UNIT} were capped")
        return out

    # -- parsing -----------------------------------------------------------------------------
    def _fail(self, problem: str):
        raise DataError(f"{self.path}: line {self.line_no}: {problem}")

    def _price(self, text) -> int:
        m = _PRICE.match(text) if isinstance(text, str) else None
        if m is None:
            self._fail(f"price {short(text)} is not a decimal number below 1e9")
        return int(m.group(1)) * 1_000_000_000 + int((m.group(2) or "").ljust(9, "0"))

    def _qty(self, text) -> int:
        m = _QTY.match(text) if isinstance(text, str) else None
        if m is None:
            self._fail(f"quantity {short(text)} is not a decimal number")
        return int(m.group(1)) * 100_000_000 + int((m.group(2) or "").ljust(8, "0"))

    def _units(self, qty: int) -> int:
        units = -(-qty // QTY_PER_UNIT)
        if units > MAX_SIZE:
            self.capped += 1
            return MAX_SIZE
        return units

    def _levels(self, rows, name: str):
        if not isinstance(rows, list):
            self._fail(f"{name} is not a list of [price, quantity] pairs")
        out = []
        for row in rows:
            if not isinstance(row, list) or len(row) < 2:
                self._fail(f"{name} has an entry {short(row)} that is not [price, quantity]")
            out.append((self._price(row[0]), self._qty(row[1])))
        return out

    def _field(self, data: dict, key: str, kind=int):
        value = data.get(key)
        if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            self._fail(f"field {key!r} is {short(value)}, expected a non-negative integer")
        if kind is bool and not isinstance(value, bool):
            self._fail(f"field {key!r} is {short(value)}, expected true or false")
        if kind is str and not isinstance(value, str):
            self._fail(f"field {key!r} is {short(value)}, expected text")
        return value

    def _book(self, data: dict) -> tuple[str, _Book]:
        sym = self._field(data, "s", str)
        if len(sym) > 40:
            self._fail(f"symbol {short(sym)} is not a symbol")
        book = self.books.get(sym)
        if book is None:
            book = self.books[sym] = _Book()
            self.info.symbol_ids[sym] = {instrument_id_of(sym)}
            self.info.symbols.append(sym)
            self.skipped_warmup[sym] = 0
            if self._pending_snapshot is not None:
                self._snapshot(book, *self._pending_snapshot)
                self._pending_snapshot = None
        return sym, book

    def _snapshot(self, book: _Book, last_id: int, bids, asks):
        book.reset(bids, asks)
        book.snapshot = True
        replay = [d for d in book.recent if d[1] > last_id]
        for _, u, b, a in replay:
            book.apply(b, a)
        book.diff_u = max(last_id, book.diff_u)
        if book.ticker is not None and book.ticker[0] <= book.diff_u:
            book.ticker = None
        book.clamp()

    # -- records -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[np.ndarray]:
        try:
            while True:
                lines = self._lines.take(self.chunk_lines)
                if not lines:
                    break
                rows = []
                for line in lines:
                    self.line_no += 1
                    row = self._message(line)
                    if row is not None:
                        rows.append(row)
                if rows:
                    self.records_read += len(rows)
                    yield self._records(rows)
        finally:
            self.close()

    def _message(self, line: bytes):
        if not line.strip():
            self._fail("empty line")
        m = _LINE.match(line)
        if m is None:
            self._fail(f"not '<receive time ns> <JSON>': {short(line.decode('utf-8', 'replace'))}")
        ts = int(m.group(1))
        if ts >= 1 << 63:
            self._fail(f"receive time {ts} is beyond int64 nanoseconds (year 2262)")
        try:
            msg = json.loads(m.group(2))
        except (ValueError, RecursionError):
            self._fail(f"not JSON: {short(m.group(2).decode('utf-8', 'replace'))}")
        if not isinstance(msg, dict):
            self._fail("the message is not a JSON object")
        if "stream" in msg:
            stream = msg["stream"]
            data = msg.get("data")
            if not isinstance(stream, str) or not isinstance(data, dict):
                self._fail("a combined-stream message needs 'stream' (text) and 'data' (an object)")
        elif "lastUpdateId" in msg:
            return self._snapshot_line(ts, msg)
        else:
            stream, data = "", msg
        event = data.get("e")
        if event == "depthUpdate":
            return self._diff(ts, data)
        if event == "trade":
            return self._trade(ts, data)
        if stream.endswith("@bookTicker") or (event is None and {"u", "b", "B", "a", "A"} <= data.keys()):
            return self._ticker(ts, data)
        self._fail(
            f"stream {short(stream or event)} is not read: numbarl reads depth diffs (@depth), @bookTicker "
            "and @trade, and REST depth snapshots"
        )

    def _snapshot_line(self, ts, msg):
        last_id = self._field(msg, "lastUpdateId")
        bids, asks = self._levels(msg.get("bids"), "bids"), self._levels(msg.get("asks"), "asks")
        if not self.books:
            self._pending_snapshot = (last_id, bids, asks)
            return None
        if len(self.books) > 1:
            self._fail("a depth snapshot in a capture of several symbols: it does not say which symbol it is")
        sym, book = next(iter(self.books.items()))
        self._snapshot(book, last_id, bids, asks)
        return self._state(ts, ts, sym, book, F_SNAPSHOT)

    def _diff(self, ts, data):
        sym, book = self._book(data)
        first, last = self._field(data, "U"), self._field(data, "u")
        bids, asks = self._levels(data.get("b"), "b"), self._levels(data.get("a"), "a")
        if last <= book.diff_u:
            return None  # already applied (a duplicate, or contained in a snapshot)
        gap = book.diff_u >= 0 and first > book.diff_u + 1
        book.apply(bids, asks)
        book.recent.append((first, last, bids, asks))
        book.diff_u = last
        book.diffs += 1
        if book.ticker is not None:
            if book.ticker[0] <= last:
                book.ticker = None  # the diff book is as new as the ticker
            else:
                book.clamp()
        flags = 0
        if gap:
            self.gaps += 1
            flags = F_MAYBE_BAD_BOOK
        return self._state(ts, min(self._field(data, "E"), 2**44) * 1_000_000, sym, book, flags)

    def _ticker(self, ts, data):
        sym, book = self._book(data)
        u = self._field(data, "u")
        bpx, bq = self._price(data.get("b")), self._qty(data.get("B"))
        apx, aq = self._price(data.get("a")), self._qty(data.get("A"))
        if u <= book.diff_u or (book.ticker is not None and u <= book.ticker[0]):
            self.stale_tickers += 1
            return None
        book.ticker = (u, bpx, bq, apx, aq)
        book.clamp()
        return self._state(ts, ts, sym, book, 0)

    def _trade(self, ts, data):
        sym, book = self._book(data)
        px, qty = self._price(data.get("p")), self._qty(data.get("q"))
        maker = self._field(data, "m", bool)
        event_ts = min(self._field(data, "T"), 2**44) * 1_000_000
        if not self._ready(sym, book):
            return None
        side = SIDE_ASK if maker else SIDE_BID
        bids, bq, asks, aq = book.top()
        return (ts, event_ts, instrument_id_of(sym), ACTION_TRADE, side, px, self._units(qty), 0, bids, bq, asks, aq)

    def _ready(self, sym: str, book: _Book) -> bool:
        if not book.warm:
            book.warm = bool(book.bid_keys and book.ask_keys and (book.snapshot or book.diffs >= WARMUP_DIFFS))
        if not book.warm:
            self.skipped_warmup[sym] += 1
        return book.warm

    def _state(self, ts, event_ts, sym, book, flags):
        if not self._ready(sym, book):
            return None
        bids, bq, asks, aq = book.top()
        flags |= F_LAST
        if bids and asks and bids[0] >= asks[0] and not flags & F_MAYBE_BAD_BOOK:
            self.crossed += 1
            flags |= F_MAYBE_BAD_BOOK
        return (ts, event_ts, instrument_id_of(sym), ACTION_MODIFY, SIDE_NONE, UNDEF_PRICE, 0, flags, bids, bq, asks, aq)

    def _records(self, rows) -> np.ndarray:
        n = len(rows)
        recs = empty_records(n)
        recs["ts_recv"] = np.array([r[0] for r in rows], np.uint64)
        recs["ts_event"] = np.array([r[1] for r in rows], np.uint64)
        recs["instrument_id"] = np.array([r[2] for r in rows], np.uint32)
        recs["action"] = np.array([r[3] for r in rows], np.uint8)
        recs["side"] = np.array([r[4] for r in rows], np.uint8)
        recs["price"] = np.array([r[5] for r in rows], np.int64)
        recs["size"] = np.array([r[6] for r in rows], np.uint32)
        recs["flags"] = np.array([r[7] for r in rows], np.uint8)
        recs["sequence"] = (np.arange(self.records_read - n + 1, self.records_read + 1) & 0xFFFFFFFF).astype(np.uint32)
        bid_px = np.full((n, N_LEVELS), UNDEF_PRICE, np.int64)
        ask_px = np.full((n, N_LEVELS), UNDEF_PRICE, np.int64)
        bid_sz = np.zeros((n, N_LEVELS), np.int64)
        ask_sz = np.zeros((n, N_LEVELS), np.int64)
        for i, r in enumerate(rows):
            k = len(r[8])
            bid_px[i, :k] = r[8]
            bid_sz[i, :k] = [self._units(q) for q in r[9]]
            k = len(r[10])
            ask_px[i, :k] = r[10]
            ask_sz[i, :k] = [self._units(q) for q in r[11]]
        lv = recs["levels"]
        lv["bid_px"] = bid_px
        lv["ask_px"] = ask_px
        lv["bid_sz"] = bid_sz.astype(np.uint32)
        lv["ask_sz"] = ask_sz.astype(np.uint32)
        return recs
