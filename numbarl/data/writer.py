"""Writing MBP-10 records as a Databento DBN file (metadata by databento_dbn), atomically."""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import databento_dbn as dbn
import numpy as np

try:
    import pyarrow as pa
except ImportError:  # only .zst output needs it
    pa = None


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
    path = Path(path)
    records = np.ascontiguousarray(records)
    ts = records["ts_recv"] if len(records) else np.zeros(1, np.uint64)
    # Python ints from uint64: a test file may hold sentinel times (2^64 - 1) the readers must refuse
    start, end = int(ts.min()), min(int(ts.max()) + 1, 2**64 - 1)
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
