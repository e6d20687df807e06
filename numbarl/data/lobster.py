"""LOBSTER files (lobsterdata.com): a message file and its order-book file -> MBP-10 records.

The academic standard for NASDAQ limit-order-book data. One trading day of one ticker is a pair
of CSV files without header, named ``TICKER_DATE_START_END_message_L.csv`` and
``TICKER_DATE_START_END_orderbook_L.csv`` (START/END: ms after midnight; L: levels), row k of
the order-book file being the book *after* message k:

    message:   time (seconds after midnight, New York, up to 9 decimals), type, order id, size,
               price (dollars x 10^4, an integer), direction (1 buy order, -1 sell order)
    orderbook: per level 1..L: ask price, ask size, bid price, bid size (prices x 10^4; an empty
               level is 9999999999 on the ask side, -9999999999 on the bid side, size 0)

Message types: 1 new limit order, 2 partial cancel, 3 deletion, 4 execution of a visible order,
5 execution of a hidden order, 6 cross trade (auction), 7 trading halt (price -1 halt, 0 quoting
resumes, 1 trading resumes). One record per message:

* ts_recv = ts_event = the day's New-York midnight (UTC, from the file name's date) + time;
* types 1-3: action A / C / C, side of the order (B for direction 1, A for -1);
* types 4, 5: a trade (action T). The direction is that of the *resting* order that was
  executed, so the aggressor is the other side: direction 1 (a buy order was hit) is a sell
  aggressor (side A), -1 a buy aggressor (side B). Type 6 (an auction cross) has no aggressor:
  side N. Price and size of the execution;
* type 7: action N; from a halt (price -1) until trading resumes (price 1) every book state is
  flagged F_MAYBE_BAD_BOOK (a gap: no bar uses it);
* prices x 10^5 to 1e-9 fixed point, an empty level is UNDEF_PRICE, order counts are 0 (LOBSTER
  has none), levels beyond 10 are dropped, missing ones empty;
* F_LAST marks the last message of each run of messages with the same time (one event: a
  market order executing against several resting orders is several type-4 messages at one time,
  and only the book after the last is a consistent book). The end of the files ends the last run.

The pair is read in blocks (both files in step, whole rows). A row of either file that does not
parse, a type, direction or halt code that does not exist, a time outside the day, or files of
different row counts is a DataError naming the file and row (rows counted from 1).
"""

from __future__ import annotations

import datetime as dt
import io
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from zoneinfo import ZoneInfo

import numpy as np

try:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv
except ImportError:  # a dependency
    pa = pc = pacsv = None

from numbarl.data.calendar import NS_PER_SECOND
from numbarl.data.errors import DataError
from numbarl.data.records import (
    ACTION_ADD,
    ACTION_CANCEL,
    ACTION_NONE,
    ACTION_TRADE,
    F_LAST,
    F_MAYBE_BAD_BOOK,
    N_LEVELS,
    SIDE_ASK,
    SIDE_BID,
    SIDE_NONE,
    UNDEF_PRICE,
    empty_records,
)
from numbarl.data.sources import LineReader, SourceInfo, clip, short

BLOCK_BYTES = 4 << 20
EMPTY_ASK = 9_999_999_999
EMPTY_BID = -9_999_999_999
PRICE_FACTOR = 100_000  # 1e-4 dollars -> 1e-9
TIMEZONE = "America/New_York"
_NAME = re.compile(
    r"^(?P<ticker>[^_]+)_(?P<date>\d{4}-\d{2}-\d{2})_(?P<start>\d+)_(?P<end>\d+)_(?:message|orderbook)_(?P<levels>\d+)\.csv$",
    re.IGNORECASE,
)


def instrument_id_of(symbol: str) -> int:
    """A stable instrument_id for a venue symbol without one (LOBSTER ticker, Binance symbol)."""
    return zlib.crc32(symbol.encode()) & 0x7FFFFFFF


def _table(rows: list[bytes], ncols: int, path: Path, row0: int, what: str):
    """The rows as a table of text columns; a row with another column count is an error."""
    for k, row in enumerate(rows):
        if row.count(b",") + 1 != ncols:
            raise DataError(
                f"{path}: row {row0 + k + 1} has {row.count(b',') + 1} columns, a LOBSTER {what} row has {ncols} "
                f"({short(row.decode('utf-8', 'replace'))})"
            )
    block = b"\n".join(rows) + b"\n"
    try:
        return pacsv.read_csv(
            io.BytesIO(block),
            read_options=pacsv.ReadOptions(column_names=[f"c{i}" for i in range(ncols)], use_threads=False),
            parse_options=pacsv.ParseOptions(newlines_in_values=False, ignore_empty_lines=False),
            convert_options=pacsv.ConvertOptions(
                column_types={f"c{i}": pa.string() for i in range(ncols)}, strings_can_be_null=False,
            ),
        )
    except (pa.ArrowException, OSError) as exc:
        for k, row in enumerate(rows):
            try:
                row.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{path}: row {row0 + k + 1} is not text (invalid UTF-8)") from None
        raise DataError(f"{path}: malformed CSV after row {row0} ({clip(exc)})") from None


def _ints(col, path: Path, row0: int, name: str, lo: int, hi: int) -> np.ndarray:
    text = pc.utf8_trim_whitespace(col)
    ok = pc.match_substring_regex(text, r"^-?[0-9]{1,18}$").to_numpy(zero_copy_only=False)
    if ok.all():
        values = pc.cast(text, pa.int64()).to_numpy(zero_copy_only=False)
        ok = (values >= lo) & (values <= hi)
        if ok.all():
            return values
    i = int(np.flatnonzero(~ok)[0])
    raise DataError(
        f"{path}: row {row0 + i + 1}, column {name}: {short(text[i].as_py())} is not an integer in {lo}..{hi}"
    )


class LobsterReader:
    """Stream the MBP-10 records of a LOBSTER message file and its order-book file in blocks."""

    def __init__(self, message_path, orderbook_path, chunk_bytes: int | None = None):
        if pa is None:  # pragma: no cover - pyarrow is a dependency
            raise DataError(f"{message_path}: reading LOBSTER files needs pyarrow")
        self.path = Path(message_path)
        self.book_path = Path(orderbook_path)
        match = _NAME.match(self.path.name)
        if not match:
            raise DataError(
                f"{self.path}: a LOBSTER file name tells the ticker and date: TICKER_YYYY-MM-DD_START_END_message_L.csv "
                "(as LOBSTER names its files); rename the pair so"
            )
        self.ticker = match.group("ticker")
        try:
            self.date = dt.date.fromisoformat(match.group("date"))
        except ValueError:
            raise DataError(f"{self.path}: {match.group('date')!r} in the file name is not a date") from None
        if not 1971 <= self.date.year < 2200:
            raise DataError(f"{self.path}: the date {self.date} in the file name is not between 1971 and 2199")
        midnight = dt.datetime.combine(self.date, dt.time(0), tzinfo=ZoneInfo(TIMEZONE))
        self.midnight_ns = int(midnight.timestamp()) * NS_PER_SECOND
        self.instrument_id = instrument_id_of(self.ticker)
        self.info = SourceInfo(
            self.path, "lobster", False, dataset="LOBSTER", schema="lobster-10", symbols=[self.ticker],
            symbol_ids={self.ticker: {self.instrument_id}}, extra_paths=[self.book_path],
        )  # fmt: skip
        self.chunk_rows = max(256, int(chunk_bytes or BLOCK_BYTES) // 64)
        self._messages = LineReader(self.path)
        try:
            self._books = LineReader(self.book_path)
        except BaseException:
            self._messages.close()
            raise
        self.info.compressed = self._messages.compressed
        self._levels = None  # levels per order-book row, from its first row
        self._halted = False
        self._held = None  # the last record of a block: its F_LAST waits for the next time
        self.records_read = 0

    def close(self):
        self._messages.close()
        self._books.close()

    def __iter__(self) -> Iterator[np.ndarray]:
        try:
            while True:
                rows = self._messages.take(self.chunk_rows)
                books = self._books.take(len(rows)) if rows else self._books.take(1)
                if len(books) != len(rows):
                    longer = self.book_path if len(books) > len(rows) else self.path
                    raise DataError(
                        f"{longer}: has more rows than its partner ({self.path.name}: {self._messages.rows} rows, "
                        f"{self.book_path.name}: {self._books.rows}); row k of the order-book file is the book "
                        "after message k: the files must have the same number of rows"
                    )
                if not rows:
                    break
                recs = self._convert(rows, books)
                if self._held is not None:
                    recs = np.concatenate([self._held, recs])
                # F_LAST where the next record has another time; the block's last waits
                ts = recs["ts_recv"]
                last = np.r_[ts[1:] != ts[:-1], False]
                recs["flags"] |= np.where(last, F_LAST, 0).astype(np.uint8)
                self._held = recs[-1:].copy()
                if len(recs) > 1:
                    yield recs[:-1]
            if self._held is not None:
                self._held["flags"] |= F_LAST
                yield self._held
                self._held = None
        finally:
            self.close()

    def _convert(self, rows: list[bytes], books: list[bytes]) -> np.ndarray:
        row0 = self.records_read
        n = len(rows)
        msg = _table(rows, 6, self.path, row0, "message")
        time_text = pc.utf8_trim_whitespace(msg.column(0))
        ok = pc.match_substring_regex(time_text, r"^[0-9]{1,6}(\.[0-9]{1,9})?$").to_numpy(zero_copy_only=False)
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise DataError(
                f"{self.path}: row {row0 + i + 1}, column time: {short(time_text[i].as_py())} is not seconds after "
                "midnight (digits, at most 9 decimals)"
            )
        dec = pc.cast(time_text, pa.decimal128(38, 9)).combine_chunks()
        ns = np.frombuffer(dec.buffers()[1], np.int64)[2 * dec.offset : 2 * (dec.offset + n)].reshape(-1, 2)[:, 0].copy()
        late = ns >= 2 * 86_400 * NS_PER_SECOND
        if late.any():
            i = int(np.flatnonzero(late)[0])
            raise DataError(f"{self.path}: row {row0 + i + 1}: time {short(time_text[i].as_py())} s is after the day's end")
        kind = _ints(msg.column(1), self.path, row0, "type", 1, 7)
        size = _ints(msg.column(3), self.path, row0, "size", 0, 2**32 - 1)
        price = _ints(msg.column(4), self.path, row0, "price", -EMPTY_ASK, EMPTY_ASK)
        direction = _ints(msg.column(5), self.path, row0, "direction", -1, 1)
        _ints(msg.column(2), self.path, row0, "order id", 0, 2**63 - 1)
        zero = direction == 0
        if zero.any():
            i = int(np.flatnonzero(zero)[0])
            raise DataError(f"{self.path}: row {row0 + i + 1}, column direction: 0 is not a direction (1 buy, -1 sell)")
        halt = kind == 7
        if np.any(halt & ~np.isin(price, (-1, 0, 1))):
            i = int(np.flatnonzero(halt & ~np.isin(price, (-1, 0, 1)))[0])
            raise DataError(f"{self.path}: row {row0 + i + 1}: trading-halt message (type 7) with price {price[i]}; LOBSTER uses -1, 0, 1")
        if self._levels is None:
            first = books[0].count(b",") + 1
            if first % 4 or first == 0:
                raise DataError(f"{self.book_path}: row 1 has {first} columns; a LOBSTER order-book row has 4 per level")
            self._levels = first // 4
        book = _table(books, 4 * self._levels, self.book_path, row0, "order-book")
        recs = empty_records(n)
        recs["ts_recv"] = (self.midnight_ns + ns).astype(np.uint64)
        recs["ts_event"] = recs["ts_recv"]
        recs["instrument_id"] = self.instrument_id
        recs["sequence"] = (np.arange(row0 + 1, row0 + n + 1) & 0xFFFFFFFF).astype(np.uint32)
        trade = (kind == 4) | (kind == 5) | (kind == 6)
        recs["action"] = np.select([kind == 1, (kind == 2) | (kind == 3), trade], [ACTION_ADD, ACTION_CANCEL, ACTION_TRADE], ACTION_NONE)
        order_side = np.where(direction > 0, SIDE_BID, SIDE_ASK)
        aggressor = np.where(direction > 0, SIDE_ASK, SIDE_BID)
        recs["side"] = np.select([kind <= 3, (kind == 4) | (kind == 5)], [order_side, aggressor], SIDE_NONE)
        priced = ~halt
        recs["price"] = np.where(priced, price * PRICE_FACTOR, UNDEF_PRICE)
        recs["size"] = np.where(halt, 0, size).astype(np.uint32)
        levels = recs["levels"]
        for m in range(min(self._levels, N_LEVELS)):
            name = f"level {m + 1}"
            ask_px = _ints(book.column(4 * m), self.book_path, row0, f"ask price {name}", -EMPTY_ASK, EMPTY_ASK)
            ask_sz = _ints(book.column(4 * m + 1), self.book_path, row0, f"ask size {name}", 0, 2**32 - 1)
            bid_px = _ints(book.column(4 * m + 2), self.book_path, row0, f"bid price {name}", -EMPTY_ASK, EMPTY_ASK)
            bid_sz = _ints(book.column(4 * m + 3), self.book_path, row0, f"bid size {name}", 0, 2**32 - 1)
            levels["ask_px"][:, m] = np.where(ask_px == EMPTY_ASK, UNDEF_PRICE, ask_px * PRICE_FACTOR)
            levels["bid_px"][:, m] = np.where(bid_px == EMPTY_BID, UNDEF_PRICE, bid_px * PRICE_FACTOR)
            levels["ask_sz"][:, m] = np.where(ask_px == EMPTY_ASK, 0, ask_sz)
            levels["bid_sz"][:, m] = np.where(bid_px == EMPTY_BID, 0, bid_sz)
        # halts: every state from a halt message until the message that resumes trading
        flags = np.zeros(n, np.uint8)
        if halt.any() or self._halted:
            state = self._halted
            for i in range(n):
                if halt[i]:
                    state = price[i] != 1
                if state:
                    flags[i] = F_MAYBE_BAD_BOOK
            self._halted = state
        recs["flags"] = flags
        self.records_read += n
        return recs
