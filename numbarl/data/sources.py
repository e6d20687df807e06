"""What every reader shares: a file's decompressed bytes, its self-description, its sha256.

``open_bytes`` opens a file as a stream of decompressed bytes (zstd and gzip recognised by their
magic numbers, never by the file name); :class:`SourceInfo` is what a file says about itself
(format, dataset, symbols); ``short`` keeps echoed input short in error messages (a fuzzed cell
can be 20 M characters long: an error line stays one readable line).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

try:
    import pyarrow as pa
except ImportError:  # a dependency; only .zst and .gz inputs need it (offline GPU hosts may lack it)
    pa = None

from numbarl.data.errors import DataError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
GZIP_MAGIC = b"\x1f\x8b"
DBN_MAGIC = b"DBN"
HASH_BLOCK = 8 << 20
ECHO_CHARS = 40
LINE_BLOCK_BYTES = 4 << 20  # at most this many characters of an input value in an error message


def clip(text, limit: int = 200) -> str:
    """Plain text cut to ``limit`` characters (a library's error message can quote a whole block)."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def short(value, limit: int = ECHO_CHARS) -> str:
    """repr of an input value for a message, cut to ``limit`` characters (with the full length)."""
    text = str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text):,} characters)"


@dataclass
class SourceInfo:
    """What a file says about itself (DBN metadata, a CSV header, a file name)."""

    path: Path
    kind: str  # "dbn", "csv", "lobster" or "binance"
    compressed: bool
    version: int | None = None  # DBN version of the file (before upgrade)
    dataset: str | None = None
    schema: str | None = None
    symbols: list[str] = field(default_factory=list)
    symbol_ids: dict[str, set[int]] = field(default_factory=dict)  # raw symbol -> instrument ids
    extra_paths: list[Path] = field(default_factory=list)  # other files of the same input (LOBSTER book)
    size_unit: float | None = None  # sizes are integers of this many base units (Binance: 1e-5)

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


def check_file(path: Path, expected: str = "a .dbn, .dbn.zst or .csv file"):
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if path.is_dir():
        raise DataError(f"{path}: is a folder, expected {expected}")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty")


def compression_of(path: Path) -> str | None:
    """'zstd', 'gzip' or None, from the file's first bytes."""
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic == ZSTD_MAGIC:
        return "zstd"
    if magic[:2] == GZIP_MAGIC:
        return "gzip"
    return None


def open_bytes(path: Path):
    """A readable stream of the file's decompressed bytes, and whether it was compressed."""
    check_file(path)
    codec = compression_of(path)
    if codec is not None:
        if pa is None:  # pragma: no cover - pyarrow is a dependency
            raise DataError(f"{path}: reading {codec} files needs pyarrow (pip install pyarrow)")
        return pa.input_stream(str(path), compression=codec), True
    return open(path, "rb"), False


def _stream_errors():
    return (OSError, EOFError) if pa is None else (OSError, EOFError, pa.ArrowException)


def _corrupt(path: Path, exc) -> DataError:
    codec = compression_of(path) or "compressed"
    return DataError(f"{path}: corrupt or truncated {codec} data ({clip(exc)})")


def read_bytes(stream, n: int, path: Path) -> bytes:
    try:
        return stream.read(n)
    except _stream_errors() as exc:
        raise _corrupt(path, exc) from None


def readinto(stream, view, path: Path) -> int:
    """Fill `view` from the stream (fewer bytes only at end of file); the number of bytes read."""
    total = 0
    try:
        while total < len(view):
            n = stream.readinto(view[total:])
            if not n:
                break
            total += n
    except _stream_errors() as exc:
        raise _corrupt(path, exc) from None
    return total


def head_bytes(path: Path, n: int) -> bytes:
    """The first ``n`` decompressed bytes of a file."""
    stream, _ = open_bytes(path)
    try:
        return read_bytes(stream, n, path)
    finally:
        stream.close()


class LineReader:
    """Whole lines of a text file (plain or compressed), in blocks; a missing final newline is
    taken as the end of the last line (LOBSTER files may lack it)."""

    def __init__(self, path: Path, block_bytes: int = LINE_BLOCK_BYTES):
        self.path = path
        self.block_bytes = block_bytes
        self.stream, self.compressed = open_bytes(path)
        self.carry = b""
        self.eof = False
        self.rows = 0  # lines handed out so far

    def _more(self) -> bool:
        if self.eof:
            return False
        piece = read_bytes(self.stream, self.block_bytes, self.path)
        if not piece:
            self.eof = True
            self.close()
            if self.carry and not self.carry.endswith(b"\n"):
                self.carry += b"\n"  # LOBSTER files may end without a newline
            return False
        self.carry += piece
        return True

    def take(self, n: int | None = None) -> list[bytes]:
        """Up to ``n`` rows (None: about a block of rows); [] at the end."""
        while True:
            count = self.carry.count(b"\n")
            if (n is None and count > 0 and len(self.carry) >= self.block_bytes) or (n is not None and count >= n):
                break
            if not self._more():
                break
        lines = self.carry.split(b"\n")
        complete, partial = lines[:-1], lines[-1]
        if n is None:
            n = len(complete)
        rows = complete[:n]
        self.carry = b"\n".join([*complete[n:], partial])
        self.rows += len(rows)
        return [r.rstrip(b"\r") for r in rows]

    def close(self):
        if self.stream is not None:
            self.stream.close()
            self.stream = None
