"""Readers for Databento MBP-10 files: DBN (``.dbn``, ``.dbn.zst``, DBN v1-v3) and CSV exports.

Everything is streamed in chunks (``chunk_bytes`` of decompressed input at a time), so a
multi-GB day never has to fit in memory twice:

    file --zstd stream (pyarrow)--> DBN bytes --metadata: databento_dbn.Metadata.decode
                                              --records: numpy view (only MBP-10 records back to
                                                back) or a numba walk over record headers
                                                (control records skipped)--> MBP10_DTYPE chunk

The MBP-10 record is the same 368 bytes in DBN v1, v2 and v3 (the versions differ in the
metadata and in other record types), and its encoding is exactly ``MBP10_DTYPE`` (records.py),
so records become numpy arrays without per-record Python and without re-encoding; the walk
checks every record's length and rtype. ``databento_dbn.Metadata.decode`` reads the v1-v3
metadata (upgraded to v3). The test suite compares these arrays field by field with
``databento_dbn.DBNDecoder``'s Python objects for v1, v2 and v3 files, plain and zstd.
(An earlier version passed the bytes through ``databento_dbn.Transcoder`` to upgrade them:
1.2 M records/s; see docs/BENCHMARKS.md for this path's rate.)

CSV: Databento's CSV export (``Transcoder(..., Encoding.CSV)`` / ``to_csv``), with or without
``pretty_px`` / ``pretty_ts`` and the optional ``symbol`` column, optionally zstd-compressed;
read in blocks with pyarrow. Prices are parsed exactly (decimal -> int64 fixed point).

:class:`RecordStream` joins several files of one instrument in time order, selects the
instrument (``symbol`` = raw symbol from the DBN metadata, a CSV ``symbol`` value, or a numeric
instrument_id) and checks that timestamps (``ts_recv``, the DBN index time of MBP-10) never go
backwards. Every problem is a :class:`DataError` naming the file, record and value.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import databento_dbn as dbn
import numpy as np
try:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv
except ImportError:  # a dependency; only .dbn.zst and CSV need it (offline GPU hosts may lack it)
    pa = pc = pacsv = None
from numba import njit

from numbarl.data.errors import DataError
from numbarl.data.records import (
    MBP10_DTYPE,
    N_LEVELS,
    RECORD_BYTES,
    RTYPE_ERROR,
    RTYPE_MBP10,
    RTYPE_SYMBOL_MAPPING,
    RTYPE_SYSTEM,
    UNDEF_PRICE,
    empty_records,
    schema_name,
)

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
DBN_MAGIC = b"DBN"
CHUNK_BYTES = 64 << 20  # decompressed bytes per step: ~180k records, ~64 MB of records in flight
CSV_BLOCK_BYTES = 16 << 20
HASH_BLOCK = 8 << 20
_ERR_NONE = 0
_ERR_RTYPE = 1
_ERR_LENGTH = 2


# ---------------------------------------------------------------------------------------------
# metadata of one source file
# ---------------------------------------------------------------------------------------------
@dataclass
class SourceInfo:
    """What a file says about itself (DBN metadata, or the CSV header)."""

    path: Path
    kind: str  # "dbn" or "csv"
    compressed: bool
    version: int | None = None  # DBN version of the file (before upgrade)
    dataset: str | None = None
    schema: str | None = None
    symbols: list[str] = field(default_factory=list)
    symbol_ids: dict[str, set[int]] = field(default_factory=dict)  # raw symbol -> instrument ids

    @property
    def name(self) -> str:
        return self.path.name

    def describe(self, sha256: str | None = None) -> dict:
        """name, size and sha256 (computed here unless given), as stored in the cache's ``source_files``."""
        return {"name": self.name, "size": self.path.stat().st_size, "sha256": sha256 or file_sha256(self.path)}


def file_sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# byte sources
# ---------------------------------------------------------------------------------------------
def _open_bytes(path: Path):
    """A readable stream of the file's decompressed bytes, and whether it was zstd."""
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if path.is_dir():
        raise DataError(f"{path}: is a folder, expected a .dbn, .dbn.zst or .csv file")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic == ZSTD_MAGIC:
        return pa.input_stream(str(path), compression="zstd"), True
    return open(path, "rb"), False


def _read(stream, n: int, path: Path) -> bytes:
    try:
        return stream.read(n)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path}: corrupt or truncated zstd data ({exc})") from None


def _readinto(stream, view, path: Path) -> int:
    """Fill `view` from the stream (fewer bytes only at end of file); the number of bytes read."""
    total = 0
    try:
        while total < len(view):
            n = stream.readinto(view[total:])
            if not n:
                break
            total += n
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path}: corrupt or truncated zstd data ({exc})") from None
    return total


def sniff_kind(path) -> str:
    """'dbn' or 'csv' from the first decompressed bytes (not the file name)."""
    path = Path(path)
    stream, _ = _open_bytes(path)
    try:
        head = _read(stream, 64, path)
    finally:
        stream.close()
    if head.startswith(DBN_MAGIC):
        return "dbn"
    text = head.decode("ascii", errors="replace")
    if "," in text and ("ts_recv" in text or "ts_event" in text):
        return "csv"
    if not head:
        raise DataError(f"{path}: the file is empty")
    raise DataError(
        f"{path}: not a DBN file (first bytes {head[:8]!r}, expected b'DBN') and not a Databento CSV export"
    )


# ---------------------------------------------------------------------------------------------
# DBN
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def _walk_records(buf, out):
    """Copy the MBP-10 records of ``buf`` (DBN record bytes) into ``out`` (uint8 [cap, 368]).

    Each DBN record starts with its length in 4-byte words and its rtype. Control records
    (error, symbol mapping, system) are skipped. Returns (bytes consumed (whole records only),
    records written, error code, offending rtype or length, byte offset of the error).
    """
    n = buf.shape[0]
    pos = 0
    count = 0
    while pos + 2 <= n:
        length = np.int64(buf[pos]) * 4
        rtype = np.int64(buf[pos + 1])
        if length < 16:
            return pos, count, _ERR_LENGTH, length, pos
        if pos + length > n:
            break
        if rtype == RTYPE_MBP10:
            if length < RECORD_BYTES:
                return pos, count, _ERR_LENGTH, length, pos
            for b in range(RECORD_BYTES):
                out[count, b] = buf[pos + b]
            count += 1
        elif rtype != RTYPE_ERROR and rtype != RTYPE_SYMBOL_MAPPING and rtype != RTYPE_SYSTEM:
            return pos, count, _ERR_RTYPE, rtype, pos
        pos += length
    return pos, count, _ERR_NONE, 0, 0


@njit(cache=True)
def _plain_mbp10_count(buf):
    """Number of whole records when buf is only 368-byte MBP-10 records back to back, else 0."""
    count = buf.shape[0] // RECORD_BYTES
    for k in range(count):
        if buf[k * RECORD_BYTES] != RECORD_BYTES // 4 or buf[k * RECORD_BYTES + 1] != RTYPE_MBP10:
            return 0
    return count


class DbnReader:
    """Stream the MBP-10 records of one DBN file (any of v1-v3, plain or zstd) in chunks.

    A plain ``.dbn`` file is memory-mapped (copy-on-write): its MBP-10 records are views of the
    mapping, no copy. A ``.dbn.zst`` file is decompressed chunk by chunk into fresh buffers.
    """

    def __init__(self, path, chunk_bytes: int = CHUNK_BYTES):
        self.path = Path(path)
        self.chunk_bytes = int(chunk_bytes)
        self._stream, compressed = _open_bytes(self.path)
        self._pending = b""  # decompressed bytes not yet returned as records (zstd)
        self._eof = False
        self.records_read = 0
        self._consumed = 0  # record bytes (after the metadata) already turned into records
        self.info = SourceInfo(self.path, "dbn", compressed)
        self._read_header()

    def _feed(self) -> bool:
        """Read one chunk of file bytes behind the pending ones; False at end of file."""
        if self._eof:
            return False
        carry = len(self._pending)
        buf = bytearray(carry + self.chunk_bytes)  # writable: record arrays are views of it
        buf[:carry] = self._pending
        got = _readinto(self._stream, memoryview(buf)[carry:], self.path)
        if got == 0:
            self._eof = True
            self._stream.close()
            return False
        if got < self.chunk_bytes:
            del buf[carry + got:]
        self._pending = buf
        return True

    def _read_header(self):
        first = _read(self._stream, 8, self.path)
        if len(first) < 8 or not first.startswith(DBN_MAGIC):
            if not first:
                raise DataError(f"{self.path}: the file is empty")
            raise DataError(f"{self.path}: not a DBN file (first bytes {first[:8]!r}, expected b'DBN')")
        self.info.version = first[3]
        if not 1 <= first[3] <= 3:
            raise DataError(f"{self.path}: DBN version {first[3]} is not supported (numbarl reads DBN v1-v3)")
        body_len = int.from_bytes(first[4:8], "little")
        body = _read(self._stream, body_len, self.path)
        if len(body) < body_len:
            raise DataError(f"{self.path}: truncated DBN file (the metadata header is incomplete)")
        self._records_offset = 8 + body_len
        try:
            meta = dbn.Metadata.decode(first + body)
        except Exception as exc:  # databento_dbn raises its own error types here
            raise DataError(f"{self.path}: corrupt DBN metadata ({exc})") from None
        self.metadata = meta
        self.info.dataset = meta.dataset
        self.info.schema = None if meta.schema is None else str(meta.schema)
        self.info.symbols = list(meta.symbols or [])
        self.info.symbol_ids = _mapping_ids(meta.mappings)
        if self.info.schema is not None and self.info.schema != "mbp-10":
            raise DataError(
                f"{self.path}: schema is {self.info.schema!r}; numbarl needs Databento 'mbp-10' "
                "(market by price, 10 levels) — request schema='mbp-10'"
            )

    def __iter__(self) -> Iterator[np.ndarray]:
        if not self.info.compressed:
            yield from self._iter_mapped()
            return
        while True:
            more = self._feed()
            if self._pending:
                records, used = self._records_of(np.frombuffer(self._pending, dtype=np.uint8))
                self._pending = bytes(self._pending[used:])
                if len(records):
                    yield records
            if not more:
                break
        if self._pending:
            self._truncated(len(self._pending))

    def _iter_mapped(self) -> Iterator[np.ndarray]:
        self._stream.close()
        self._eof = True
        size = self.path.stat().st_size - self._records_offset
        if size <= 0:
            return
        mapped = np.memmap(self.path, dtype=np.uint8, mode="c", offset=self._records_offset, shape=(size,))
        pos = 0
        while pos < size:
            records, used = self._records_of(mapped[pos : pos + self.chunk_bytes])
            if used == 0:  # not one whole record left
                self._truncated(size - pos)
            pos += used
            if len(records):
                yield records

    def _truncated(self, n_bytes: int):
        raise DataError(
            f"{self.path}: truncated DBN file: {n_bytes} trailing bytes after record "
            f"{self.records_read} do not form a whole record"
        )

    def _records_of(self, buf: np.ndarray) -> tuple[np.ndarray, int]:
        """(MBP-10 records of the whole records at the start of buf, bytes they take)."""
        count = _plain_mbp10_count(buf)
        if count > 0:
            # the usual case, only MBP-10 records: a view of the bytes, no copy
            self.records_read += count
            self._consumed += count * RECORD_BYTES
            return np.asarray(buf[: count * RECORD_BYTES]).view(MBP10_DTYPE), count * RECORD_BYTES
        out = np.empty((len(buf) // RECORD_BYTES + 1, RECORD_BYTES), np.uint8)
        used, count, err, value, offset = _walk_records(buf, out)
        if err != _ERR_NONE:
            # records are numbered from 1, like CSV rows and the timestamp checks; the number
            # counts MBP-10 records only (skipped control records are not counted), so the byte
            # offset in the decompressed file pins the record down exactly
            where = (
                f"record {self.records_read + count + 1} (after {self.records_read + count} MBP-10 "
                f"records, byte {self._records_offset + self._consumed + int(offset)} of the "
                f"{'decompressed ' if self.info.compressed else ''}file)"
            )
            if err == _ERR_RTYPE:
                raise DataError(
                    f"{self.path}: {where} has rtype {value} ({schema_name(value)}); numbarl needs "
                    "mbp-10 records (rtype 10) only"
                )
            raise DataError(f"{self.path}: corrupt DBN data: {where} claims a length of {value} bytes")
        self.records_read += count
        self._consumed += int(used)
        return out[:count].view(MBP10_DTYPE).reshape(count), int(used)

    def close(self):
        if not self._eof:
            self._stream.close()
            self._eof = True


def _mapping_ids(mappings) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for raw_symbol, intervals in (mappings or {}).items():
        ids = out.setdefault(str(raw_symbol), set())
        for interval in intervals:
            text = interval["symbol"] if isinstance(interval, dict) else interval.symbol
            if str(text).isdigit():
                ids.add(int(text))
    return out


def write_dbn(
    path,
    records: np.ndarray,
    *,
    dataset: str = "GLBX.MDP3",
    symbols: Sequence[str] = (),
    mappings: dict[str, int] | None = None,
    version: int = 3,
    schema: str = "mbp-10",
) -> Path:
    """Write records as a DBN file (``.zst`` suffix: zstd-compressed), metadata by databento_dbn.

    ``mappings`` maps a raw symbol to its instrument_id (one interval covering the data).
    Used by the synthetic market (``numbarl-data synth --dbn``) and by the tests.
    """
    import datetime as dt

    path = Path(path)
    records = np.ascontiguousarray(records)
    ts = records["ts_recv"].astype(np.int64) if len(records) else np.zeros(1, np.int64)
    start, end = int(ts.min()), int(ts.max()) + 1
    day0 = dt.date(1970, 1, 1) + dt.timedelta(days=start // 86_400_000_000_000)
    day1 = dt.date(1970, 1, 1) + dt.timedelta(days=end // 86_400_000_000_000 + 1)

    @dataclass
    class _Interval:
        start_date: dt.date
        end_date: dt.date
        symbol: str

    @dataclass
    class _Mapping:
        raw_symbol: str
        intervals: list

    maps = [_Mapping(s, [_Interval(day0, day1, str(i))]) for s, i in (mappings or {}).items()]
    meta = dbn.Metadata(
        dataset,
        start,
        dbn.SType.RAW_SYMBOL,
        dbn.SType.INSTRUMENT_ID,
        dbn.Schema.from_str(schema),
        symbols=list(symbols or (mappings or {}).keys()),
        mappings=maps,
        end=end,
        version=version,
    )
    payload = bytes(meta) + records.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    # temp file + rename: a full disk or a kill leaves no partial DBN under the final name
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if path.name.endswith(".zst"):
            with pa.CompressedOutputStream(str(tmp), "zstd") as out:
                out.write(payload)
        else:
            tmp.write_bytes(payload)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


# ---------------------------------------------------------------------------------------------
# CSV (Databento's CSV export)
# ---------------------------------------------------------------------------------------------
_LEVEL_FIELDS = ("bid_px", "ask_px", "bid_sz", "ask_sz", "bid_ct", "ask_ct")
CSV_REQUIRED = (
    "ts_recv", "ts_event", "instrument_id", "action", "side", "price", "size", "flags",
    *(f"{f}_{m:02d}" for m in range(N_LEVELS) for f in _LEVEL_FIELDS),
)  # fmt: skip
_CSV_PRICE_COLUMNS = ("price", *(f"{s}_px_{m:02d}" for m in range(N_LEVELS) for s in ("bid", "ask")))
_CSV_TEXT_COLUMNS = ("ts_recv", "ts_event", "action", "side", "symbol", *_CSV_PRICE_COLUMNS)


class _TailStream:
    """A byte stream that remembers its last byte (the end of a zstd CSV, seen only once read)."""

    def __init__(self, stream):
        self._stream = stream
        self.last = b""
        self.closed = False

    def read(self, n=-1):
        data = self._stream.read(n)
        if data:
            self.last = data[-1:]
        return data

    def readable(self):
        return True

    def seekable(self):
        return False

    def close(self):
        self._stream.close()
        self.closed = True


class CsvReader:
    """Stream the MBP-10 records of a Databento CSV export in blocks.

    Rows in messages are data rows counted from 1 (the header line is not counted).
    """

    def __init__(self, path, chunk_bytes: int = CSV_BLOCK_BYTES):
        self.path = Path(path)
        stream, compressed = _open_bytes(self.path)
        self.info = SourceInfo(self.path, "csv", compressed, schema="mbp-10")
        self.records_read = 0
        # A CSV cut inside its last field (an interrupted download) still parses: "...,3,10"
        # cut to "...,3,1" is a valid row with a wrong value. Databento ends every row with a
        # newline, so a missing final newline is the sign. A plain file is checked here, before
        # anything is read; a zstd one only once decompressed to its end (see __iter__).
        self._tail = None
        if compressed:
            stream = self._tail = _TailStream(stream)
        else:
            stream.seek(-1, os.SEEK_END)
            last = stream.read(1)
            stream.seek(0)
            if last != b"\n":
                stream.close()
                self._no_newline()
        try:
            self._reader = pacsv.open_csv(
                stream,
                read_options=pacsv.ReadOptions(block_size=int(chunk_bytes)),
                convert_options=pacsv.ConvertOptions(
                    column_types={c: pa.string() for c in _CSV_TEXT_COLUMNS},
                    strings_can_be_null=False,
                    # only an empty cell is null (not "NA", "nan", ...): a null is then always
                    # the raw value '' in messages, and any other text stays visible as text
                    null_values=[""],
                ),
            )
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{self.path}: cannot read as CSV ({exc})") from None
        names = self._reader.schema.names
        if "rtype" not in names and "bid_px_00" not in names:
            raise DataError(f"{self.path}: not a Databento MBP-10 CSV export (columns: {', '.join(names[:8])}, ...)")
        missing = [c for c in CSV_REQUIRED if c not in names]
        if missing and "rtype" not in names:
            raise DataError(f"{self.path}: not a Databento MBP-10 CSV: missing columns {', '.join(missing[:6])}")
        self._missing = missing
        self.has_symbol = "symbol" in names

    def _next_batch(self, rows_before: int):
        """The next block of rows, None at the end of the file."""
        try:
            return self._reader.read_next_batch()
        except StopIteration:
            return None
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{self.path}: malformed CSV after row {rows_before} ({exc})") from None

    def __iter__(self) -> Iterator[np.ndarray]:
        # one block ahead: a zstd file's end (and so its final newline) is only known once the
        # next block is asked for, and a cut last row must be reported as a truncated file
        # before that row is converted (a cut symbol "ESH1" -> "ESH" would otherwise read as a
        # second instrument)
        batch = self._next_batch(0)
        while batch is not None:
            following = self._next_batch(self.records_read + batch.num_rows)
            if following is None and self._tail is not None and self._tail.last != b"\n":
                self._no_newline()
            if batch.num_rows == 0:
                batch = following
                continue
            recs, symbols = self._convert(batch)
            self.records_read += len(recs)
            if symbols is not None:
                for sym, ids in symbols.items():
                    self.info.symbol_ids.setdefault(sym, set()).update(ids)
            batch = following
            yield recs

    def _no_newline(self):
        raise DataError(
            f"{self.path}: the CSV{' (decompressed)' if self.info.compressed else ''} ends without "
            "a newline: the file looks truncated (its last row may be cut inside a field); "
            "download it again"
        )

    def _column(self, batch, name):
        return batch.column(batch.schema.get_field_index(name))

    def _convert(self, batch):
        row0 = self.records_read
        if "rtype" in batch.schema.names:
            rtypes = self._integers(self._column(batch, "rtype"), "rtype", row0, np.uint8)
            bad = np.flatnonzero(rtypes != RTYPE_MBP10)
            if len(bad):
                rt = int(rtypes[bad[0]])
                raise DataError(
                    f"{self.path}: row {row0 + bad[0] + 1} has rtype {rt} ({schema_name(rt)}); "
                    "numbarl needs mbp-10 records (rtype 10) only"
                )
        if self._missing:
            raise DataError(f"{self.path}: not a Databento MBP-10 CSV: missing columns {', '.join(self._missing[:6])}")
        n = batch.num_rows
        recs = empty_records(n)
        for name in ("ts_recv", "ts_event"):
            recs[name] = self._timestamps(self._column(batch, name), name, row0)
        recs["price"] = self._prices(self._column(batch, "price"), "price", row0)
        for name in ("size", "flags", "instrument_id", "publisher_id", "depth", "ts_in_delta", "sequence"):
            if name in batch.schema.names:
                recs[name] = self._integers(self._column(batch, name), name, row0, recs.dtype[name])
        for name in ("action", "side"):
            recs[name] = self._chars(self._column(batch, name), name, row0)
        levels = recs["levels"]
        for m in range(N_LEVELS):
            for f in _LEVEL_FIELDS:
                col = self._column(batch, f"{f}_{m:02d}")
                if f.endswith("_px"):
                    levels[f][:, m] = self._prices(col, f"{f}_{m:02d}", row0)
                else:
                    levels[f][:, m] = self._integers(col, f"{f}_{m:02d}", row0, np.uint32)
        symbols = None
        if self.has_symbol:
            sym = self._column(batch, "symbol").to_numpy(zero_copy_only=False)
            symbols = {}
            for s in np.unique(sym):
                symbols[str(s)] = set(np.unique(recs["instrument_id"][sym == s]).tolist())
        return recs, symbols

    def _bad(self, name, row0, values, mask, problem="cannot parse"):
        """Raise for the first row of `mask`; `values` holds the raw cells (indexed by row)."""
        i = int(np.flatnonzero(mask)[0])
        self._bad_at(name, row0 + i, str(values[i]), problem)

    def _bad_at(self, name, row, raw: str, problem="cannot parse"):
        # str(): a numpy string would print as np.str_('...')
        raise DataError(
            f"{self.path}: row {row + 1}, column {name}: {problem} {str(raw)!r} "
            "(rows are data rows counted from 1, the header line not counted)"
        )

    def _timestamps(self, col, name, row0):
        text = col.to_numpy(zero_copy_only=False).astype(str)
        if len(text) and all(t.isdigit() for t in text[:4]):
            try:
                return text.astype(np.uint64)
            except ValueError:
                self._bad(name, row0, text, ~np.char.isdigit(text))
        try:
            stamps = pc.cast(col, pa.timestamp("ns", tz="UTC"))
        except pa.ArrowException:
            ok = []
            for t in text:
                try:
                    pc.cast(pa.array([t]), pa.timestamp("ns", tz="UTC"))
                    ok.append(True)
                except pa.ArrowException:
                    ok.append(False)
            self._bad(name, row0, text, ~np.asarray(ok))
        return stamps.cast(pa.int64()).to_numpy(zero_copy_only=False).astype(np.uint64)

    def _prices(self, col, name, row0):
        text = pc.utf8_trim_whitespace(col)
        empty = pc.equal(text, "").to_numpy(zero_copy_only=False)
        pretty = pc.any(pc.match_substring(text, ".")).as_py()
        if not pretty:
            values = np.full(len(text), UNDEF_PRICE, np.int64)
            raw = text.to_numpy(zero_copy_only=False).astype(str)
            try:
                values[~empty] = raw[~empty].astype(np.int64)
            except ValueError:
                self._bad(name, row0, raw, ~empty & ~np.char.isdigit(np.char.lstrip(raw, "-")))
            return values
        nulled = pc.if_else(pc.equal(text, ""), pa.scalar(None, pa.string()), text)
        try:
            dec = pc.cast(nulled, pa.decimal128(38, 9))
        except pa.ArrowException:
            raw = text.to_numpy(zero_copy_only=False).astype(str)
            ok = np.array([_is_decimal(t) for t in raw])
            self._bad(name, row0, raw, ~ok)
        if isinstance(dec, pa.ChunkedArray):
            dec = dec.combine_chunks()
        # decimal128 stores the unscaled integer (value * 1e9) in 16 little-endian bytes; prices fit
        # in the low 8 bytes (int64 two's complement)
        limbs = np.frombuffer(dec.buffers()[1], dtype=np.int64)[2 * dec.offset : 2 * (dec.offset + len(dec))]
        values = limbs.reshape(-1, 2)[:, 0].copy()
        values[empty] = UNDEF_PRICE
        return values

    def _integers(self, col, name, row0, dtype):
        """An integer column as `dtype`; the first empty, non-integer or out-of-range cell is an error.

        pyarrow infers each column's type per block: int64 normally, but double when a cell is
        empty (null) or like "2.5", and string when a cell is not a number. So the bad cell is
        looked for by what it is, not by the column type (in a double column every row is a
        float, and only the null or fractional ones are wrong).
        """
        limits = np.iinfo(dtype)
        span = f"out of range for {np.dtype(dtype).name} ({limits.min}..{limits.max}):"
        nulls = col.is_null().to_numpy(zero_copy_only=False)
        if pa.types.is_integer(col.type):
            values = pc.fill_null(col, 0).to_numpy(zero_copy_only=False)
            ok = ~nulls & (values >= limits.min) & (values <= limits.max)
            if ok.all():
                return values.astype(dtype)
            i = int(np.flatnonzero(~ok)[0])
            if nulls[i]:
                self._bad_at(name, row0 + i, "")
            self._bad_at(name, row0 + i, str(int(values[i])), span)
        if pa.types.is_floating(col.type):
            values = pc.fill_null(col, 0.0).to_numpy(zero_copy_only=False)
            whole = np.isfinite(values) & (values == np.round(values))
            ok = ~nulls & whole & (values >= limits.min) & (values <= limits.max)
            if ok.all():  # e.g. "3.0": an exact integer written as a float
                return values.astype(dtype)
            i = int(np.flatnonzero(~ok)[0])
            raw = "" if nulls[i] else str(float(values[i]))  # the cell as pyarrow parsed it
            self._bad_at(name, row0 + i, raw, "cannot parse" if nulls[i] or not whole[i] else span)
        # anything else (text, timestamps, an all-empty block): look at the cells as text
        text = pc.fill_null(pc.cast(col, pa.string()), "")
        ok = pc.match_substring_regex(text, r"^-?[0-9]{1,18}$").to_numpy(zero_copy_only=False)
        raw = text.to_numpy(zero_copy_only=False).astype(str)
        if not ok.all():
            self._bad(name, row0, raw, ~ok)
        values = raw.astype(np.int64)
        out = (values < limits.min) | (values > limits.max)
        if out.any():
            self._bad(name, row0, raw, out, span)
        return values.astype(dtype)

    def _chars(self, col, name, row0):
        text = col.to_numpy(zero_copy_only=False).astype(str)
        lengths = np.char.str_len(text)
        if np.any(lengths != 1):
            self._bad(name, row0, text, lengths != 1)
        return np.frombuffer(text.astype("S1").tobytes(), np.uint8)


def _is_decimal(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return text == ""


# ---------------------------------------------------------------------------------------------
# several files of one instrument
# ---------------------------------------------------------------------------------------------
def open_reader(path, chunk_bytes: int | None = None):
    kind = sniff_kind(path)
    if kind == "dbn":
        return DbnReader(path, chunk_bytes or CHUNK_BYTES)
    return CsvReader(path, chunk_bytes or CSV_BLOCK_BYTES)


def first_timestamp(path) -> int:
    """ts_recv of the first MBP-10 record (reads one small chunk); -1 when the file has none."""
    reader = open_reader(path, chunk_bytes=1 << 16)
    try:
        for chunk in reader:
            return int(chunk["ts_recv"][0])
        return -1
    finally:
        if isinstance(reader, DbnReader):
            reader.close()


class RecordStream:
    """MBP-10 records of one instrument from several files, in time order, chunk by chunk.

    Files are ordered by their first ``ts_recv``; a file that starts before the previous one
    ended is an error (overlapping or unsorted input). ``symbol`` selects the instrument: a raw
    symbol from the DBN metadata or a CSV ``symbol`` column, or a numeric instrument_id. Without
    it all the files together must hold one instrument (or one raw symbol whose instrument_id
    rolls over dates) of one dataset: files of two instruments are an error naming both files,
    never one merged stream. Files of different datasets are an error either way.

    Iterating yields ``(file_index, records)``; ``global_offset`` of each yielded chunk (its
    first record's index in the whole stream) is ``self.offset`` before the chunk.
    """

    def __init__(self, paths: Sequence, symbol: str | None = None, chunk_bytes: int | None = None):
        if not paths:
            raise DataError("no input files given")
        self.paths = [Path(p) for p in paths]
        self.symbol = None if symbol in (None, "") else str(symbol)
        self.chunk_bytes = chunk_bytes
        starts = []
        for p in self.paths:
            sniff_kind(p)
            starts.append(first_timestamp(p))
        order = sorted(range(len(self.paths)), key=lambda i: (starts[i], str(self.paths[i])))
        self.paths = [self.paths[i] for i in order]
        self.infos: list[SourceInfo] = []
        self.file_offsets: list[int] = []  # global index of each file's first selected record
        self.offset = 0
        self.selected_ids: set[int] | None = None
        # the first file read and what it holds, to name it when a later file does not match
        self._first: SourceInfo | None = None
        self._first_label = ""
        self._raw_symbol: str | None = None  # without --symbol: the one raw symbol of the inputs

    @property
    def symbol_name(self) -> str | None:
        """The instrument read: --symbol, or the one raw symbol the files name (None if none)."""
        return self.symbol if self.symbol is not None else self._raw_symbol

    def _label(self, info: SourceInfo, ids) -> str:
        """"symbol 'ESH1' (GLBX.MDP3, instrument_id 5482)": what one file holds, for messages."""
        parts = [p for p in (info.dataset, f"instrument_id {', '.join(str(i) for i in sorted(ids))}") if p]
        syms = [self.symbol] if self.symbol is not None else sorted(info.symbol_ids)
        head = f"symbol {syms[0]!r}" if len(syms) == 1 else f"symbols {syms}" if syms else "no symbol"
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
            if not ids and info.kind == "dbn":
                known = ", ".join(sorted(info.symbol_ids)) or "none"
                raise DataError(f"{info.path}: symbol {self.symbol!r} is not in the file (symbols: {known})")
            self.selected_ids |= ids
        else:
            if len(info.symbol_ids) > 1:
                known = ", ".join(f"{s} (instrument_id {sorted(i)})" for s, i in sorted(info.symbol_ids.items()))
                raise DataError(f"{info.path}: several instruments: {known}; choose one with --symbol")
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
                counts = {i: int(np.sum(chunk["instrument_id"] == i)) for i in ids_in_chunk}
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
        for index, path in enumerate(self.paths):
            reader = open_reader(path, self.chunk_bytes)
            self.infos.append(reader.info)
            self.file_offsets.append(self.offset)
            row = 0
            for chunk in reader:
                selected = self._resolve(reader, chunk)
                row_start = row
                row += len(chunk)
                if not len(selected):
                    continue
                ts = selected["ts_recv"].astype(np.int64)
                if ts[0] < last_ts:
                    where = f"{path.name} starts at ts_recv {ts[0]}, before the end of {last_file} ({last_ts})" if row_start == 0 else f"{path}: ts_recv goes back from {last_ts} to {ts[0]}"
                    raise DataError(f"unsorted timestamps: {where}; inputs must be in time order and not overlap")
                back = np.flatnonzero(np.diff(ts) < 0)
                if len(back):
                    i = int(back[0])
                    raise DataError(
                        f"{path}: unsorted timestamps: record {row_start + i + 1} has ts_recv {ts[i + 1]} "
                        f"after {ts[i]}; Databento files are sorted by ts_recv, this one is corrupt"
                    )
                last_ts = int(ts[-1])
                last_file = path.name
                yield index, selected
                self.offset += len(selected)
        if self.offset == 0:
            which = f" for symbol {self.symbol!r}" if self.symbol else ""
            raise DataError(f"no MBP-10 records{which} in {', '.join(p.name for p in self.paths)}")

    def source_files(self, digests: dict | None = None) -> list[dict]:
        """name, size, sha256 of every file; `digests` {path: sha256} when already computed."""
        return [info.describe((digests or {}).get(info.path)) for info in self.infos]

    def locate(self, global_index: int) -> str:
        """'file, record N' of a record by its index in the stream (for error messages)."""
        for i in range(len(self.file_offsets) - 1, -1, -1):
            if global_index >= self.file_offsets[i]:
                return f"{self.paths[i]}, selected record {global_index - self.file_offsets[i] + 1}"
        return f"record {global_index + 1}"


def read_records(path, symbol: str | None = None, chunk_bytes: int | None = None) -> np.ndarray:
    """All MBP-10 records of one instrument from one or more files, as one array (small inputs)."""
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    chunks = [chunk for _, chunk in RecordStream(paths, symbol, chunk_bytes)]
    return np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
