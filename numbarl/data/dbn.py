"""Databento DBN files (``.dbn``, ``.dbn.zst``, DBN v1-v3): MBP-10 records streamed in chunks.

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

The reader checks the file's structure only; what the records say (prices, sizes, timestamps)
is checked by validate.py for every format alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import databento_dbn
import numpy as np
from numba import njit

from numbarl.data.errors import DataError
from numbarl.data.records import (
    MBP10_DTYPE,
    RECORD_BYTES,
    RTYPE_ERROR,
    RTYPE_MBP10,
    RTYPE_SYMBOL_MAPPING,
    RTYPE_SYSTEM,
    schema_name,
)
from numbarl.data.sources import DBN_MAGIC, SourceInfo, clip, open_bytes, read_bytes, readinto

CHUNK_BYTES = 64 << 20  # decompressed bytes per step: ~180k records, ~64 MB of records in flight
_ERR_NONE = 0
_ERR_RTYPE = 1
_ERR_LENGTH = 2


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
        self._stream, compressed = open_bytes(self.path)
        self._pending = b""  # decompressed bytes not yet returned as records (zstd)
        self._eof = False
        self.records_read = 0
        self._consumed = 0  # record bytes (after the metadata) already turned into records
        self.info = SourceInfo(self.path, "dbn", compressed)
        try:
            self._read_header()
        except BaseException:
            self._stream.close()
            raise

    def _feed(self) -> bool:
        """Read one chunk of file bytes behind the pending ones; False at end of file."""
        if self._eof:
            return False
        carry = len(self._pending)
        buf = bytearray(carry + self.chunk_bytes)  # writable: record arrays are views of it
        buf[:carry] = self._pending
        got = readinto(self._stream, memoryview(buf)[carry:], self.path)
        if got == 0:
            self._eof = True
            self._stream.close()
            return False
        if got < self.chunk_bytes:
            del buf[carry + got:]
        self._pending = buf
        return True

    def _read_header(self):
        first = read_bytes(self._stream, 8, self.path)
        if len(first) < 8 or not first.startswith(DBN_MAGIC):
            if not first:
                raise DataError(f"{self.path}: the file is empty")
            raise DataError(f"{self.path}: not a DBN file (first bytes {first[:8]!r}, expected b'DBN')")
        self.info.version = first[3]
        if not 1 <= first[3] <= 3:
            raise DataError(f"{self.path}: DBN version {first[3]} is not supported (numbarl reads DBN v1-v3)")
        body_len = int.from_bytes(first[4:8], "little")
        parts, have = [], 0
        while have < body_len:  # in pieces: a corrupt length must not allocate gigabytes up front
            piece = read_bytes(self._stream, min(body_len - have, 1 << 20), self.path)
            if not piece:
                break
            parts.append(piece)
            have += len(piece)
        body = b"".join(parts)
        if len(body) < body_len:
            raise DataError(f"{self.path}: truncated DBN file (the metadata header is incomplete)")
        self._records_offset = 8 + body_len
        try:
            meta = databento_dbn.Metadata.decode(first + body)
        except Exception as exc:  # databento_dbn raises its own error types here
            raise DataError(f"{self.path}: corrupt DBN metadata ({clip(exc)})") from None
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
