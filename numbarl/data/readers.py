"""The entry point of every market-data format: detection, one reader per input, one time-ordered stream.

Formats (each reader yields MBP10_DTYPE chunks, so bars, features and the cache are shared):

    dbn      Databento DBN v1-v3, plain or zstd            dbn.py
    csv      Databento CSV export, plain or zstd            databento_csv.py
    lobster  LOBSTER message + order-book CSV pairs         lobster.py
    binance  Binance raw websocket captures (plain or gz)   binance.py

The format is detected from a file's first decompressed bytes and, for LOBSTER, its name
(``sniff_kind``), or forced with ``fmt`` (``numbarl-data build --format``). Each format brings its
own default session calendar (``default_calendar``): CME Globex for Databento files, US equities
(09:30-16:00 New York) for LOBSTER, UTC days for Binance.

:class:`RecordStream` joins several inputs of one instrument in time order, selects the
instrument (``symbol`` = raw symbol from the DBN metadata, a CSV ``symbol`` value, a LOBSTER
ticker, a Binance symbol, or a numeric instrument_id), checks every ``ts_recv`` (validate.py:
within 1971..2200) and that timestamps never go backwards. Every problem is a :class:`DataError`
naming the file, record and value. Writing DBN files is in writer.py.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from numbarl.data.calendar import UTC_DAYS, US_EQUITIES, SessionCalendar
from numbarl.data.databento_csv import CSV_BLOCK_BYTES, CSV_REQUIRED, CsvReader, looks_like_databento_csv
from numbarl.data.dbn import CHUNK_BYTES, DbnReader
from numbarl.data.errors import DataError
from numbarl.data.sources import DBN_MAGIC, SourceInfo, check_file, file_sha256, head_bytes, short
from numbarl.data.validate import check_timestamps
from numbarl.data.writer import write_dbn

__all__ = [
    "CHUNK_BYTES", "CSV_BLOCK_BYTES", "CSV_REQUIRED", "FORMATS", "CsvReader", "DbnReader", "Input", "RecordStream",
    "SourceInfo", "default_calendar", "file_sha256", "first_timestamp", "open_reader", "read_records",
    "resolve_inputs", "sniff_kind", "write_dbn",
]  # fmt: skip

FORMATS = ("auto", "dbn", "csv", "lobster", "binance")
_LOBSTER_NAME = re.compile(r"^(?P<prefix>.+)_(?P<part>message|orderbook)_(?P<levels>\d+)\.csv$", re.IGNORECASE)
_BINANCE_LINE = re.compile(rb"^\d{1,20} \{")


def sniff_kind(path) -> str:
    """'dbn', 'csv', 'lobster-message', 'lobster-orderbook' or 'binance', from the file's first
    decompressed bytes (and a LOBSTER file's name)."""
    path = Path(path)
    head = head_bytes(path, 1 << 16)
    if head.startswith(DBN_MAGIC):
        return "dbn"
    if not head:
        raise DataError(f"{path}: the file is empty")
    if looks_like_databento_csv(head):
        return "csv"
    if _BINANCE_LINE.match(head):
        return "binance"
    lobster = _lobster_part(path, head)
    if lobster:
        return f"lobster-{lobster}"
    raise DataError(
        f"{path}: not a DBN file (first bytes {head[:8]!r}, expected b'DBN'), nor a Databento MBP-10 CSV "
        "export (a header naming ts_recv, ..., bid_px_00), a LOBSTER message/order-book file or a Binance "
        "capture ('<ns> {json}' lines)"
    )


def _lobster_part(path: Path, head: bytes) -> str | None:
    match = _LOBSTER_NAME.match(path.name)
    if match:
        return match.group("part").lower()
    line = head.split(b"\n", 1)[0].strip()
    cells = line.split(b",")
    if not line or not all(re.fullmatch(rb"-?[0-9]+(\.[0-9]+)?", c.strip()) for c in cells):
        return None
    if len(cells) == 6 and b"." in cells[0]:
        return "message"
    if len(cells) % 4 == 0 and b"." not in line:
        return "orderbook"
    return None


@dataclass
class Input:
    """One input of a stream: a file, or a LOBSTER message file with its order-book file."""

    kind: str  # "dbn", "csv", "lobster" or "binance"
    path: Path
    partner: Path | None = None  # the LOBSTER order-book file
    files: list[Path] = field(default_factory=list)

    def __post_init__(self):
        self.files = [self.path] + ([self.partner] if self.partner is not None else [])


def resolve_inputs(paths: Sequence, fmt: str | None = None) -> list[Input]:
    """Inputs of the given files: format of each (detected, or ``fmt``), LOBSTER files paired."""
    fmt = None if fmt in (None, "auto") else fmt
    if fmt is not None and fmt not in FORMATS:
        raise DataError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    kinds = []
    for p in paths:
        p = Path(p)
        check_file(p)
        kinds.append((p, sniff_kind(p) if fmt is None else _forced_kind(p, fmt)))
    out: list[Input] = []
    books = {}
    for p, kind in kinds:
        if kind == "lobster-orderbook":
            books[_lobster_key(p)] = p
    used = set()
    for p, kind in kinds:
        if kind == "lobster-message":
            key = _lobster_key(p)
            book = books.get(key) or _lobster_partner(p)
            if book is None:
                raise DataError(
                    f"{p}: LOBSTER message file without its order-book file (expected "
                    f"{p.name.replace('_message_', '_orderbook_')} beside it, or give both files)"
                )
            used.add(book)
            out.append(Input("lobster", p, book))
        elif kind == "lobster-orderbook":
            continue
        else:
            out.append(Input(kind, p))
    for p, kind in kinds:
        if kind == "lobster-orderbook" and p not in used:
            raise DataError(
                f"{p}: LOBSTER order-book file without its message file "
                f"({p.name.replace('_orderbook_', '_message_')}); give both files"
            )
    return out


def _forced_kind(path: Path, fmt: str) -> str:
    """The kind of a file whose format is given (--format): only LOBSTER's part is looked up."""
    if fmt != "lobster":
        return fmt
    part = _lobster_part(path, head_bytes(path, 1 << 16))
    if part is None:
        raise DataError(
            f"{path}: --format lobster, but the file is neither a LOBSTER message file (6 columns: time, "
            "type, order id, size, price, direction) nor an order-book file (4 columns per level)"
        )
    return f"lobster-{part}"


def _kind_name(kind: str) -> str:
    return {
        "dbn": "a DBN file", "csv": "a Databento CSV export", "binance": "a Binance capture",
        "lobster-message": "a LOBSTER message file", "lobster-orderbook": "a LOBSTER order-book file",
    }.get(kind, kind)  # fmt: skip


def _lobster_key(path: Path):
    match = _LOBSTER_NAME.match(path.name)
    if not match:
        return (path.parent, path.name)
    return (path.parent.resolve(), match.group("prefix"), match.group("levels"))


def _lobster_partner(message: Path) -> Path | None:
    match = _LOBSTER_NAME.match(message.name)
    if not match:
        return None
    start, end = match.span("part")
    candidate = message.with_name(message.name[:start] + "orderbook" + message.name[end:])
    return candidate if candidate.is_file() else None


def default_calendar(inputs: Sequence[Input]) -> SessionCalendar:
    """The session calendar of the inputs' format: US equities for LOBSTER, UTC days for Binance,
    CME Globex (SessionCalendar's default) for Databento files."""
    kinds = {i.kind for i in inputs}
    if kinds == {"lobster"}:
        return US_EQUITIES
    if kinds == {"binance"}:
        return UTC_DAYS
    if len(kinds & {"lobster", "binance"}) and len(kinds) > 1:
        raise DataError(
            f"inputs of several formats ({', '.join(sorted(kinds))}) cannot be one instrument's stream"
        )
    return SessionCalendar()


def open_reader(path, chunk_bytes: int | None = None, *, input: Input | None = None, fmt: str | None = None):
    """The reader of one input (a path is resolved to its input first)."""
    if input is None:
        found = resolve_inputs([path], fmt) if not isinstance(path, Input) else [path]
        input = found[0]
    if input.kind == "dbn":
        return DbnReader(input.path, chunk_bytes or CHUNK_BYTES)
    if input.kind == "csv":
        return CsvReader(input.path, chunk_bytes or CSV_BLOCK_BYTES)
    if input.kind == "lobster":
        from numbarl.data.lobster import LobsterReader

        return LobsterReader(input.path, input.partner, chunk_bytes)
    if input.kind == "binance":
        from numbarl.data.binance import BinanceReader

        return BinanceReader(input.path, chunk_bytes)
    raise DataError(f"{input.path}: unknown format {input.kind!r}")  # pragma: no cover


def _close(reader):
    close = getattr(reader, "close", None)
    if close is not None:
        close()


def first_timestamp(path, *, input: Input | None = None) -> int:
    """ts_recv of the first MBP-10 record (reads one small chunk); -1 when the file has none."""
    reader = open_reader(path, chunk_bytes=1 << 16, input=input)
    try:
        for chunk in reader:
            ts = chunk["ts_recv"][:1]
            check_timestamps(ts, lambda i: f"{reader.info.path}, record 1")
            return int(ts[0])
        return -1
    finally:
        _close(reader)


class RecordStream:
    """MBP-10 records of one instrument from several inputs, in time order, chunk by chunk.

    Inputs are ordered by their first ``ts_recv``; an input that starts before the previous one
    ended is an error (overlapping or unsorted input). ``symbol`` selects the instrument: a raw
    symbol from the DBN metadata, a CSV ``symbol`` column, a LOBSTER ticker or a Binance symbol,
    or a numeric instrument_id. Without it all the inputs together must hold one instrument (or
    one raw symbol whose instrument_id rolls over dates) of one dataset: files of two instruments
    are an error naming both files, never one merged stream. Files of different datasets are an
    error either way.

    Iterating yields ``(input_index, records)``; ``global_offset`` of each yielded chunk (its
    first record's index in the whole stream) is ``self.offset`` before the chunk. ``warnings``
    collects what the readers skipped (one line each, e.g. Binance book states before warm-up).
    """

    def __init__(self, paths: Sequence, symbol: str | None = None, chunk_bytes: int | None = None, fmt: str | None = None):
        if not paths:
            raise DataError("no input files given")
        self.inputs = resolve_inputs(paths, fmt)
        self.symbol = None if symbol in (None, "") else str(symbol)
        self.chunk_bytes = chunk_bytes
        starts = [first_timestamp(inp.path, input=inp) for inp in self.inputs]
        order = sorted(range(len(self.inputs)), key=lambda i: (starts[i], str(self.inputs[i].path)))
        self.inputs = [self.inputs[i] for i in order]
        self.paths = [p for inp in self.inputs for p in inp.files]  # every file (sha256 provenance)
        self.infos: list[SourceInfo] = []
        self.file_offsets: list[int] = []  # global index of each input's first selected record
        self.offset = 0
        self.selected_ids: set[int] | None = None
        self.warnings: list[str] = []
        # the first file read and what it holds, to name it when a later file does not match
        self._first: SourceInfo | None = None
        self._first_label = ""
        self._raw_symbol: str | None = None  # without --symbol: the one raw symbol of the inputs

    @property
    def calendar(self) -> SessionCalendar:
        """The inputs' format's session calendar (see default_calendar)."""
        return default_calendar(self.inputs)

    @property
    def symbol_name(self) -> str | None:
        """The instrument read: --symbol, or the one raw symbol the files name (None if none)."""
        return self.symbol if self.symbol is not None else self._raw_symbol

    def _label(self, info: SourceInfo, ids) -> str:
        """"symbol 'ESH1' (GLBX.MDP3, instrument_id 5482)": what one file holds, for messages."""
        parts = [p for p in (info.dataset, f"instrument_id {', '.join(str(i) for i in sorted(ids))}") if p]
        syms = [self.symbol] if self.symbol is not None else sorted(info.symbol_ids)
        head = f"symbol {short(syms[0])}" if len(syms) == 1 else f"symbols {[short(s) for s in syms[:5]]}" if syms else "no symbol"
        return f"{head} ({', '.join(parts)})"

    def _mixed(self, info: SourceInfo, ids, what: str):
        """Two files that cannot be one stream: name both, and what each holds."""
        todo = "give only files of one dataset" if self.symbol else "pass --symbol to choose one and give only its files"
        raise DataError(
            f"{what} across the inputs: {self._first.path} holds {self._first_label}, "
            f"{info.path} holds {self._label(info, ids)}; one stream is one instrument of one "
            f"dataset: {todo}"
        )

    def _resolve(self, reader, chunk) -> np.ndarray:
        info = reader.info
        ids_in_chunk = [int(i) for i in np.unique(chunk["instrument_id"])]
        if self.selected_ids is None:
            self.selected_ids = set()
        first_file = self._first is None or self._first is info
        if not first_file and info.dataset and self._first.dataset and info.dataset != self._first.dataset:
            # instrument ids are per dataset: the same number is another instrument elsewhere
            self._mixed(info, ids_in_chunk, "files of different datasets")
        if self.symbol is not None:
            ids = set(info.symbol_ids.get(self.symbol, set()))
            if not ids and self.symbol.isdigit():
                ids = {int(self.symbol)}
            if not ids and info.kind in ("dbn", "lobster"):  # a CSV or a capture names its symbols as they come
                known = ", ".join(short(s, 24) for s in sorted(info.symbol_ids)[:10]) or "none"
                raise DataError(f"{info.path}: symbol {short(self.symbol)} is not in the file (symbols: {known})")
            self.selected_ids |= ids
        else:
            if len(info.symbol_ids) > 1:
                listed = sorted(info.symbol_ids.items())
                known = ", ".join(f"{short(s, 24)} (instrument_id {sorted(i)[:3]})" for s, i in listed[:6])
                more = f" and {len(listed) - 6} more" if len(listed) > 6 else ""
                raise DataError(f"{info.path}: several instruments: {known}{more}; choose one with --symbol")
            if len(info.symbol_ids) == 1:
                # one raw symbol: all its instrument ids (a continuous symbol rolls between them,
                # also from one file to the next). Another raw symbol in a later file is another
                # instrument: never merged silently (an ES file and an NVDA file are not one book).
                raw, ids = next(iter(info.symbol_ids.items()))
                if self._raw_symbol is not None and raw != self._raw_symbol:
                    self._mixed(info, ids or ids_in_chunk, "several instruments")
                if self._raw_symbol is not None or not self.selected_ids or ids <= self.selected_ids:
                    self.selected_ids |= ids
                    self._raw_symbol = raw
                # else: earlier files had no symbol and other ids: the check below names both
            if not self.selected_ids:
                self.selected_ids = {ids_in_chunk[0]}
            foreign = [i for i in ids_in_chunk if i not in self.selected_ids]
            if foreign and not first_file:
                self._mixed(info, ids_in_chunk, "several instruments")
            if foreign:
                counts = {i: int(np.sum(chunk["instrument_id"] == i)) for i in ids_in_chunk[:6]}
                seen = ", ".join(f"{i} ({c} records)" for i, c in counts.items())
                raise DataError(
                    f"{info.path}: several instruments (instrument_id: {seen}); choose one with --symbol"
                )
        if self._first is None:
            self._first = info
            self._first_label = self._label(info, self.selected_ids)
        ids = np.fromiter(self.selected_ids, dtype=np.uint32, count=len(self.selected_ids))
        keep = np.isin(chunk["instrument_id"], ids)
        return chunk if keep.all() else chunk[keep]

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        last_ts = -1
        last_file = None
        for index, inp in enumerate(self.inputs):
            path = inp.path
            reader = open_reader(path, self.chunk_bytes, input=inp)
            try:
                self.infos.append(reader.info)
                self.file_offsets.append(self.offset)
                row = 0
                for chunk in reader:
                    row_start = row
                    row += len(chunk)
                    check_timestamps(chunk["ts_recv"], lambda i: f"{path}, record {row_start + i + 1}")
                    selected = self._resolve(reader, chunk)
                    if not len(selected):
                        continue
                    ts = selected["ts_recv"].astype(np.int64)
                    if ts[0] < last_ts:
                        where = (
                            f"{path.name} starts at ts_recv {ts[0]}, before the end of {last_file} ({last_ts})"
                            if row_start == 0 and last_file is not None
                            else f"{path}: ts_recv goes back from {last_ts} to {ts[0]}"
                        )
                        raise DataError(f"unsorted timestamps: {where}; inputs must be in time order and not overlap")
                    back = np.flatnonzero(np.diff(ts) < 0)
                    if len(back):
                        i = int(back[0])
                        raise DataError(
                            f"{path}: unsorted timestamps: record {row_start + i + 2} has ts_recv {ts[i + 1]} "
                            f"after {ts[i]}; the file should be sorted by ts_recv, this one is corrupt"
                        )
                    last_ts = int(ts[-1])
                    last_file = path.name
                    yield index, selected
                    self.offset += len(selected)
                self.warnings.extend(getattr(reader, "warnings", lambda: [])())
            finally:
                _close(reader)
        if self.offset == 0:
            which = f" for symbol {short(self.symbol)}" if self.symbol else ""
            raise DataError(f"no MBP-10 records{which} in {', '.join(p.name for p in self.paths)}")

    def source_files(self, digests: dict | None = None) -> list[dict]:
        """name, size, sha256 of every file; `digests` {path: sha256} when already computed."""
        out = []
        for info in self.infos:
            for p in [info.path, *info.extra_paths]:
                out.append({"name": p.name, "size": p.stat().st_size, "sha256": (digests or {}).get(p) or file_sha256(p)})
        return out

    def locate(self, global_index: int) -> str:
        """'file, record N' of a record by its index in the stream (for error messages)."""
        for i in range(len(self.file_offsets) - 1, -1, -1):
            if global_index >= self.file_offsets[i]:
                return f"{self.inputs[i].path}, selected record {global_index - self.file_offsets[i] + 1}"
        return f"record {global_index + 1}"


def read_records(path, symbol: str | None = None, chunk_bytes: int | None = None, fmt: str | None = None) -> np.ndarray:
    """All MBP-10 records of one instrument from one or more files, as one array (small inputs)."""
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    chunks = [chunk for _, chunk in RecordStream(paths, symbol, chunk_bytes, fmt)]
    return np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
