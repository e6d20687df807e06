"""Databento MBP-10 CSV exports (``Transcoder(..., Encoding.CSV)`` / ``to_csv``), plain or zstd.

With or without ``pretty_px`` / ``pretty_ts`` and the optional ``symbol`` column. Columns are
found by their names in the header (any order; a name given twice is an error, never "the other
one"). The file is read in blocks of whole lines by this module and each block parsed by pyarrow
with every column as text (no background reader thread: an error in the first block once left a
pyarrow read-ahead thread that aborted the interpreter at exit). Every cell is then parsed with
one rule for the whole file:

* prices: fixed-point integers (the default export) or decimals (``pretty_px``), decided by the
  first price cell of the file; a cell of the other kind anywhere is an error (a single decimal
  cell once switched the parse of its whole 16 MB block). Decimals are exact (no float), at most 9
  decimal places, and must fit int64 fixed point; an empty cell is an empty level;
* timestamps: integer nanoseconds or ISO 8601 (``pretty_ts``), decided by the first cell;
* integers: decimal digits within the field's type (size u32, flags u8, ...).

A bad cell is a DataError naming the file, the data row (counted from 1, the header not counted),
the column and the cell (cut to a few dozen characters). What the values mean (sentinel prices,
out-of-range timestamps) is checked by validate.py, as for every format.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

try:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv
except ImportError:  # a dependency; only CSV input needs it
    pa = pc = pacsv = None

from numbarl.data.errors import DataError
from numbarl.data.records import N_LEVELS, RTYPE_MBP10, UNDEF_PRICE, empty_records, schema_name
from numbarl.data.sources import SourceInfo, clip, open_bytes, read_bytes, short

CSV_BLOCK_BYTES = 16 << 20
HEADER_LIMIT = 1 << 16  # a header line longer than this is not a Databento header
LEVEL_FIELDS = ("bid_px", "ask_px", "bid_sz", "ask_sz", "bid_ct", "ask_ct")
CSV_REQUIRED = (
    "ts_recv", "ts_event", "instrument_id", "action", "side", "price", "size", "flags",
    *(f"{f}_{m:02d}" for m in range(N_LEVELS) for f in LEVEL_FIELDS),
)  # fmt: skip
CSV_OPTIONAL_INTS = ("rtype", "publisher_id", "depth", "ts_in_delta", "sequence")
PRICE_COLUMNS = ("price", *(f"{s}_px_{m:02d}" for m in range(N_LEVELS) for s in ("bid", "ask")))
_FIXED_RE = r"^-?[0-9]{1,19}$"
_PRETTY_RE = r"^-?[0-9]{1,19}\.[0-9]{1,9}$"
_INT_RE = r"^-?[0-9]{1,20}$"


def header_names(first_line: bytes) -> list[str]:
    return [name.strip() for name in first_line.decode("utf-8", errors="replace").rstrip("\r\n").split(",")]


def looks_like_databento_csv(head: bytes) -> bool:
    """True when the first line of ``head`` names the columns of an MBP-10 export (any order)."""
    line = head.split(b"\n", 1)[0]
    names = set(header_names(line))
    return "ts_recv" in names and ("bid_px_00" in names or "rtype" in names or "price" in names)


class CsvReader:
    """Stream the MBP-10 records of a Databento CSV export in blocks.

    Rows in messages are data rows counted from 1 (the header line is not counted).
    """

    def __init__(self, path, chunk_bytes: int = CSV_BLOCK_BYTES):
        if pa is None:  # pragma: no cover - pyarrow is a dependency
            raise DataError(f"{path}: reading CSV needs pyarrow (pip install pyarrow)")
        self.path = Path(path)
        self.block_bytes = max(int(chunk_bytes), 1 << 12)
        self._stream, compressed = open_bytes(self.path)
        self.info = SourceInfo(self.path, "csv", compressed, schema="mbp-10")
        self.records_read = 0
        self._carry = b""
        self._eof = False
        self._price_mode: str | None = None  # "fixed" or "pretty", fixed by the first price cell
        self._ts_mode: str | None = None  # "int" or "iso"
        try:
            if not compressed:
                # A CSV cut inside its last field (an interrupted download) still parses: "...,3,10"
                # cut to "...,3,1" is a valid row with a wrong value. Databento ends every row with
                # a newline, so a missing final newline is the sign. A plain file is checked here;
                # a zstd one once decompressed to its end (see _next_block).
                self._stream.seek(-1, os.SEEK_END)
                last = self._stream.read(1)
                self._stream.seek(0)
                if last != b"\n":
                    self._no_newline()
            self._read_header()
        except BaseException:
            self.close()
            raise

    # -- bytes -------------------------------------------------------------------------------
    def _fill(self, minimum: int) -> None:
        while not self._eof and len(self._carry) < minimum:
            piece = read_bytes(self._stream, self.block_bytes, self.path)
            if not piece:
                self._eof = True
                self.close()
                break
            self._carry += piece

    def _read_header(self):
        self._fill(HEADER_LIMIT)
        end = self._carry.find(b"\n")
        if end < 0:
            if self._eof and self._carry:
                self._no_newline()
            raise DataError(f"{self.path}: not a Databento MBP-10 CSV export (no header line)")
        line = self._carry[:end]
        self._carry = self._carry[end + 1 :]
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{self.path}: the CSV header is not text (invalid UTF-8)") from None
        names = header_names(text.encode())
        seen, dupes = set(), []
        for name in names:
            if name in seen and name not in dupes:
                dupes.append(name)
            seen.add(name)
        if dupes:
            raise DataError(
                f"{self.path}: column {short(dupes[0])} appears more than once in the header; each column "
                "must be named once (which one would hold the data?)"
            )
        if "bid_px_00" not in seen and "rtype" not in seen:
            listed = ", ".join(short(n, 24) for n in names[:8])
            raise DataError(f"{self.path}: not a Databento MBP-10 CSV export (columns: {listed}, ...)")
        self.names = names
        self.has_symbol = "symbol" in seen
        self._missing = [c for c in CSV_REQUIRED if c not in seen]
        if self._missing and "rtype" not in seen:
            raise DataError(f"{self.path}: not a Databento MBP-10 CSV: missing columns {', '.join(self._missing[:6])}")

    def _next_block(self) -> bytes | None:
        """The next run of whole lines (about a block), None at the end of the file."""
        self._fill(self.block_bytes + 1)  # more than a block, or the whole rest of the file
        if not self._carry:
            return None
        if self._eof:
            # the end of the file is known: rows after its last newline mean the file was cut
            # inside its last row; say so before any of this block is converted (a cut "ESH1" ->
            # "ESH" would read as a second instrument)
            if not self._carry.endswith(b"\n"):
                self._no_newline()
            block, self._carry = self._carry, b""
            return block
        cut = self._carry.rfind(b"\n", 0, self.block_bytes)
        while cut < 0:  # one line longer than a block: read on to its end
            found = self._carry.find(b"\n")
            if found >= 0:
                cut = found
            elif self._eof:
                self._no_newline()
            else:
                self._fill(len(self._carry) + self.block_bytes)
        block, self._carry = self._carry[: cut + 1], self._carry[cut + 1 :]
        return block

    def close(self):
        stream, self._stream = getattr(self, "_stream", None), None
        if stream is not None:
            stream.close()

    def _no_newline(self):
        raise DataError(
            f"{self.path}: the CSV{' (decompressed)' if self.info.compressed else ''} ends without "
            "a newline: the file looks truncated (its last row may be cut inside a field); "
            "download it again"
        )

    # -- rows --------------------------------------------------------------------------------
    def _parse_block(self, block: bytes):
        try:
            return pacsv.read_csv(
                io.BytesIO(block),
                read_options=pacsv.ReadOptions(column_names=[f"c{i}" for i in range(len(self.names))], use_threads=False),
                parse_options=pacsv.ParseOptions(newlines_in_values=False, ignore_empty_lines=False),
                convert_options=pacsv.ConvertOptions(
                    column_types={f"c{i}": pa.string() for i in range(len(self.names))},
                    strings_can_be_null=False,
                    quoted_strings_can_be_null=False,
                ),
            )
        except (pa.ArrowException, OSError) as exc:
            self._locate_bad_line(block, exc)

    def _locate_bad_line(self, block: bytes, exc):
        """The first row of the block that is not a row of this file, as one short message."""
        for k, line in enumerate(block.split(b"\n")[:-1]):
            row = self.records_read + k + 1
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{self.path}: row {row} is not text (invalid UTF-8)") from None
            count = text.count(",") + 1
            if count != len(self.names):
                raise DataError(
                    f"{self.path}: row {row} has {count} columns, the header {len(self.names)} "
                    f"(rows are data rows counted from 1, the header line not counted)"
                ) from None
            if '"' in text:
                raise DataError(f"{self.path}: row {row} has a quote character; Databento CSV has none") from None
        raise DataError(f"{self.path}: malformed CSV after row {self.records_read} ({clip(exc)})") from None

    def __iter__(self) -> Iterator[np.ndarray]:
        try:
            while (block := self._next_block()) is not None:
                table = self._parse_block(block)
                if table.num_rows == 0:
                    continue
                recs, symbols = self._convert(table)
                self.records_read += len(recs)
                if symbols is not None:
                    for sym, ids in symbols.items():
                        self.info.symbol_ids.setdefault(sym, set()).update(ids)
                yield recs
        finally:
            self.close()

    def _column(self, table, name):
        return table.column(self.names.index(name)).combine_chunks()

    def _convert(self, table):
        row0 = self.records_read
        names = set(self.names)
        if "rtype" in names:
            rtypes = self._integers(self._column(table, "rtype"), "rtype", row0, np.uint8)
            bad = np.flatnonzero(rtypes != RTYPE_MBP10)
            if len(bad):
                rt = int(rtypes[bad[0]])
                raise DataError(
                    f"{self.path}: row {row0 + bad[0] + 1} has rtype {rt} ({schema_name(rt)}); "
                    "numbarl needs mbp-10 records (rtype 10) only"
                )
        if self._missing:
            raise DataError(f"{self.path}: not a Databento MBP-10 CSV: missing columns {', '.join(self._missing[:6])}")
        recs = empty_records(table.num_rows)
        for name in ("ts_recv", "ts_event"):
            recs[name] = self._timestamps(self._column(table, name), name, row0)
        recs["price"] = self._prices(self._column(table, "price"), "price", row0)
        for name in ("size", "flags", "instrument_id", *CSV_OPTIONAL_INTS):
            if name in names and name != "rtype":
                recs[name] = self._integers(self._column(table, name), name, row0, recs.dtype[name])
        for name in ("action", "side"):
            recs[name] = self._chars(self._column(table, name), name, row0)
        levels = recs["levels"]
        for m in range(N_LEVELS):
            for f in LEVEL_FIELDS:
                name = f"{f}_{m:02d}"
                col = self._column(table, name)
                if f.endswith("_px"):
                    levels[f][:, m] = self._prices(col, name, row0)
                else:
                    levels[f][:, m] = self._integers(col, name, row0, np.uint32)
        symbols = None
        if self.has_symbol:
            sym = pc.utf8_trim_whitespace(self._column(table, "symbol")).to_numpy(zero_copy_only=False)
            symbols = {}
            for s in np.unique(sym):
                symbols[str(s)] = set(np.unique(recs["instrument_id"][sym == s]).tolist())
        return recs, symbols

    # -- cells -------------------------------------------------------------------------------
    def _bad_at(self, name, row, raw, problem="cannot parse"):
        raise DataError(
            f"{self.path}: row {row + 1}, column {name}: {problem} {short(raw)} "
            "(rows are data rows counted from 1, the header line not counted)"
        )

    def _first_bad(self, col, name, row0, mask, problem="cannot parse"):
        i = int(np.flatnonzero(mask)[0])
        self._bad_at(name, row0 + i, col[i].as_py(), problem)

    def _matches(self, col, pattern) -> np.ndarray:
        return pc.match_substring_regex(col, pattern).to_numpy(zero_copy_only=False)

    def _timestamps(self, col, name, row0):
        if self._ts_mode is None:
            first = col[0].as_py().strip()
            self._ts_mode = "int" if first.isdigit() else "iso"
        if self._ts_mode == "int":
            ok = self._matches(col, r"^[0-9]{1,20}$")
            if not ok.all():
                self._first_bad(col, name, row0, ~ok, "cannot parse (the file's timestamps are integer nanoseconds)")
            try:
                return pc.cast(col, pa.uint64()).to_numpy(zero_copy_only=False)
            except pa.ArrowException:
                big = np.array([int(v) >= 1 << 64 for v in col.to_pylist()])
                self._first_bad(col, name, row0, big, "out of range for a uint64 timestamp:")
        try:
            stamps = pc.cast(col, pa.timestamp("ns", tz="UTC"))
        except pa.ArrowException:
            bad = []
            for value in col.to_pylist():
                try:
                    pc.cast(pa.array([value]), pa.timestamp("ns", tz="UTC"))
                    bad.append(False)
                except pa.ArrowException:
                    bad.append(True)
            if not any(bad):  # pragma: no cover - arrow failed on the block but on no cell
                raise DataError(f"{self.path}: rows {row0 + 1}.., column {name}: cannot parse the timestamps") from None
            self._first_bad(col, name, row0, np.asarray(bad), "cannot parse (not an ISO 8601 UTC time between 1677 and 2262):")
        return stamps.cast(pa.int64()).to_numpy(zero_copy_only=False).view(np.uint64)

    def _prices(self, col, name, row0):
        text = pc.utf8_trim_whitespace(col)
        empty = pc.equal(text, "").to_numpy(zero_copy_only=False)
        if self._price_mode is None and not empty.all():
            first = text[int(np.flatnonzero(~empty)[0])].as_py()
            self._price_mode = "pretty" if "." in first else "fixed"
        values = np.full(len(text), UNDEF_PRICE, np.int64)
        if empty.all():
            return values
        if self._price_mode == "fixed":
            ok = self._matches(text, _FIXED_RE) | empty
            if not ok.all():
                self._first_bad(text, name, row0, ~ok, "cannot parse (the file's prices are fixed-point integers, 1e-9 units):")
            nulled = pc.if_else(pc.equal(text, ""), pa.scalar(None, pa.string()), text)
            try:
                # nulls filled before numpy: an int64 column with nulls would become float64 (inexact)
                parsed = pc.fill_null(pc.cast(nulled, pa.int64()), 0).to_numpy(zero_copy_only=False)
            except pa.ArrowException:
                over = np.array([v is not None and v != "" and not -(1 << 63) <= int(v) < (1 << 63) for v in text.to_pylist()])
                self._first_bad(text, name, row0, over, "out of range for int64 fixed point:")
            values[~empty] = parsed[~empty].astype(np.int64)
            return values
        ok = self._matches(text, _PRETTY_RE) | empty
        if not ok.all():
            self._first_bad(
                text, name, row0, ~ok,
                "cannot parse (the file's prices are decimals with at most 9 decimal places):",
            )  # fmt: skip
        nulled = pc.if_else(pc.equal(text, ""), pa.scalar(None, pa.string()), text)
        try:
            dec = pc.cast(nulled, pa.decimal128(38, 9))
        except pa.ArrowException:  # pragma: no cover - the pattern admits only what arrow parses
            self._first_bad(text, name, row0, ~empty, "cannot parse")
        if isinstance(dec, pa.ChunkedArray):
            dec = dec.combine_chunks()
        # decimal128 stores the unscaled integer (value * 1e9) in 16 little-endian bytes: a price
        # that fits int64 fixed point has a high limb that is the sign extension of the low one
        limbs = np.frombuffer(dec.buffers()[1], dtype=np.int64)[2 * dec.offset : 2 * (dec.offset + len(dec))]
        limbs = limbs.reshape(-1, 2)
        fits = limbs[:, 1] == (limbs[:, 0] >> 63)
        if not (fits | empty).all():
            self._first_bad(text, name, row0, ~fits & ~empty, "out of range for int64 fixed point (|price| < 9.2e9):")
        values[~empty] = limbs[~empty, 0]
        return values

    def _integers(self, col, name, row0, dtype):
        """An integer column as `dtype`; the first empty, non-integer or out-of-range cell is an error."""
        limits = np.iinfo(dtype)
        span = f"out of range for {np.dtype(dtype).name} ({limits.min}..{limits.max}):"
        text = pc.utf8_trim_whitespace(col)
        ok = self._matches(text, _INT_RE)
        if not ok.all():
            self._first_bad(text, name, row0, ~ok)
        try:
            values = pc.cast(text, pa.int64()).to_numpy(zero_copy_only=False)
        except pa.ArrowException:
            self._first_bad(text, name, row0, np.array([not -(1 << 63) <= int(v) < (1 << 63) for v in text.to_pylist()]), span)
        out = (values < limits.min) | (values > limits.max)
        if out.any():
            self._first_bad(text, name, row0, out, span)
        return values.astype(dtype)

    def _chars(self, col, name, row0):
        lengths = pc.binary_length(pc.cast(col, pa.binary())).to_numpy(zero_copy_only=False)
        if np.any(lengths != 1):
            self._first_bad(col, name, row0, lengths != 1, "must be one ASCII character, got")
        return np.frombuffer(col.to_numpy(zero_copy_only=False).astype("S1").tobytes(), np.uint8)
