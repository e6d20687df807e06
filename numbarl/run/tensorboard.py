"""TensorBoard scalars for a run folder, written without tensorflow or torch.

`write_events(run)` (re)writes the run's event file from metrics.jsonl, so `tensorboard --logdir
runs/` shows every logged number: one scalar per numeric metric of each record, tagged
`<kind>/<metric>` (`train/loss`, `val/sharpe`, `test/daily_sharpe`; nested dicts add levels,
`val/oracle/sharpe`), prefixed `fold<k>/` when the run has several folds. The x axis is the
record's `step` for training records and its `epoch` for validation and test records (one point
per epoch). Null values (non-finite numbers in metrics.jsonl), strings (the NaN reasons) and
booleans are skipped.

The event file is derived data: it is rebuilt from metrics.jsonl whenever metrics.csv is
(`RunDir.write_csv`), so it is as crash-safe and resume-safe as the log itself (after a resume
the truncated log gives a truncated event file). Each rewrite goes to a temporary name, is
renamed to `events.out.tfevents.<ns>.numbarl` with a name later than any existing one, and then
the older event files are removed: a TensorBoard that is watching the folder moves to the newest
file (it reads files in name order), and a reader never sees a torn file.

Format (TensorFlow's TFRecord container, tensorflow/core/lib/io/record_writer.cc; the Event and
Summary protobufs, tensorflow/core/util/event.proto and framework/summary.proto):

    record  = uint64 length (little endian) | uint32 masked_crc32c(length bytes)
            | data[length] | uint32 masked_crc32c(data)
    masked_crc32c(x) = ((c >> 15) | (c << 17)) + 0xa282ead8  (mod 2^32),  c = crc32c(x)
    Event   = wall_time (field 1, double) | step (field 2, int64 varint)
            | file_version (field 3, string "brain.Event:2", first event only)
            | summary (field 5, message Summary)
    Summary = repeated value (field 1, message Value)
    Value   = tag (field 1, string) | simple_value (field 2, float)

crc32c is CRC-32 with the Castagnoli polynomial (reflected 0x82F63B78, RFC 3720 §B.4), computed
with a 256-entry table, one byte per step: `crc32c_ref` in plain Python (the reference, 6 MiB/s
here), `crc32c` the same loop under numba @njit (480 MiB/s). The event file of 5,000 records x 20
metrics (1.8 MiB) is written in 0.3 s (2 CPU cores shared), most of it in the protobuf encoding.
wall_time is a record's own numeric `wall_time` when it has one, else the run's creation time
(run.json): the file is then a pure function of metrics.jsonl and run.json.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import re
import struct
import time
from pathlib import Path

import numpy as np
from numba import njit

from numbarl.run import runio

FILE_VERSION = "brain.Event:2"
EVENT_PREFIX = "events.out.tfevents."
EVENT_SUFFIX = ".numbarl"
EVENT_NAME = re.compile(r"^events\.out\.tfevents\.(\d+)\.numbarl$")
INDEX_KEYS = ("kind", "fold", "epoch", "step", "wall_time")  # record keys that place a point, not plotted
EPOCH_KINDS = ("val", "test", "test_policy")  # records whose x axis is the epoch

_CRC_POLY = 0x82F63B78  # Castagnoli, reflected
_MASK_DELTA = 0xA282EAD8


# ---------------------------------------------------------------------------------------------
# crc32c and the TFRecord container
# ---------------------------------------------------------------------------------------------
def _crc_table() -> tuple:
    table = []
    for byte in range(256):
        c = byte
        for _ in range(8):
            c = (c >> 1) ^ _CRC_POLY if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


_CRC_TABLE = _crc_table()
_CRC_TABLE_ARRAY = np.array(_CRC_TABLE, np.int64)


def crc32c_ref(data: bytes) -> int:
    """CRC-32C of `data` in plain Python (crc32c_ref(b"123456789") == 0xE3069283)."""
    c = 0xFFFFFFFF
    table = _CRC_TABLE
    for byte in data:
        c = table[(c ^ byte) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


@njit(cache=True)
def _crc32c_loop(table, data):
    c = np.int64(0xFFFFFFFF)  # int64 holds every uint32 value; no sign games
    for i in range(data.shape[0]):
        c = table[(c ^ np.int64(data[i])) & 0xFF] ^ (c >> 8)
    return c ^ np.int64(0xFFFFFFFF)


def crc32c(data: bytes) -> int:
    """CRC-32C of `data`: crc32c_ref's loop compiled."""
    return int(_crc32c_loop(_CRC_TABLE_ARRAY, np.frombuffer(data, np.uint8)))


def masked_crc32c(data: bytes) -> int:
    """The TFRecord checksum: crc32c rotated right by 15 bits plus a constant (mod 2^32)."""
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def read_tfrecords(blob: bytes) -> list[bytes]:
    """The records of a TFRecord byte string; a checksum mismatch or a torn record is an error."""
    out, offset = [], 0
    while offset < len(blob):
        if offset + 12 > len(blob):
            raise ValueError(f"event file ends inside a record header at byte {offset}")
        header = blob[offset : offset + 8]
        (length,) = struct.unpack("<Q", header)
        (crc,) = struct.unpack("<I", blob[offset + 8 : offset + 12])
        if crc != masked_crc32c(header):
            raise ValueError(f"record length checksum mismatch at byte {offset}")
        end = offset + 12 + length
        if end + 4 > len(blob):
            raise ValueError(f"event file ends inside a record of {length} bytes at byte {offset}")
        data = blob[offset + 12 : end]
        (crc,) = struct.unpack("<I", blob[end : end + 4])
        if crc != masked_crc32c(data):
            raise ValueError(f"record data checksum mismatch at byte {offset}")
        out.append(data)
        offset = end + 4
    return out


# ---------------------------------------------------------------------------------------------
# the Event protobuf, by hand (wire types: 0 varint, 1 64-bit, 2 length-delimited, 5 32-bit)
# ---------------------------------------------------------------------------------------------
def _varint(value: int) -> bytes:
    value &= 0xFFFFFFFFFFFFFFFF  # int64: negatives as their two's complement (10 bytes)
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def encode_event(wall_time: float, step: int, scalars: dict | None = None, file_version: str | None = None) -> bytes:
    """One serialized Event: wall_time, step, and either file_version or a Summary of scalars
    {tag: value} (values stored as float32, TensorBoard's simple_value)."""
    out = _key(1, 1) + struct.pack("<d", float(wall_time)) + _key(2, 0) + _varint(int(step))
    if file_version is not None:
        out += _length_delimited(3, file_version.encode("utf-8"))
    if scalars:
        values = []
        with np.errstate(over="ignore"):  # beyond float32's range: inf, as TensorBoard would store it
            for tag, value in scalars.items():
                value_msg = _length_delimited(1, tag.encode("utf-8")) + _key(2, 5) + np.float32(value).tobytes()
                values.append(_length_delimited(1, value_msg))
        out += _length_delimited(5, b"".join(values))
    return out


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes):
    """(field number, wire type, value) of a protobuf message: int, bytes or raw 8/4 bytes."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(data, pos)
        elif wire_type == 1:
            value, pos = data[pos : pos + 8], pos + 8
        elif wire_type == 2:
            length, pos = _read_varint(data, pos)
            value, pos = data[pos : pos + length], pos + length
        elif wire_type == 5:
            value, pos = data[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"protobuf wire type {wire_type} (field {field}) is not used by Event")
        yield field, wire_type, value


def decode_event(data: bytes) -> dict:
    """{"wall_time", "step", "file_version" (or None), "scalars": {tag: float}} of one Event."""
    event = {"wall_time": math.nan, "step": 0, "file_version": None, "scalars": {}}
    for field, _, value in _fields(data):
        if field == 1:
            event["wall_time"] = struct.unpack("<d", value)[0]
        elif field == 2:
            event["step"] = value - (1 << 64) if value >= 1 << 63 else value
        elif field == 3:
            event["file_version"] = value.decode("utf-8")
        elif field == 5:
            for f_value, _, value_msg in _fields(value):
                if f_value != 1:
                    continue
                tag, number = None, math.nan
                for f, _, v in _fields(value_msg):
                    if f == 1:
                        tag = v.decode("utf-8")
                    elif f == 2:
                        number = float(np.frombuffer(v, np.float32)[0])
                event["scalars"][tag] = number
    return event


def read_events(path) -> list[dict]:
    """Every Event of an event file, decoded (checksums verified)."""
    return [decode_event(record) for record in read_tfrecords(Path(path).read_bytes())]


# ---------------------------------------------------------------------------------------------
# metrics.jsonl -> events
# ---------------------------------------------------------------------------------------------
def _scalars(record: dict, prefix: str) -> dict:
    out = {}
    for key, value in record.items():
        if key in INDEX_KEYS:
            continue
        tag = f"{prefix}/{key}"
        if isinstance(value, dict):
            out.update(_scalars({k: v for k, v in value.items() if k not in INDEX_KEYS}, tag))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[tag] = float(value)
    return out


def _creation_time(run) -> float:
    created = run.meta.get("created") if isinstance(run.meta, dict) else None
    try:
        stamp = _dt.datetime.fromisoformat(str(created))  # Python >= 3.11 reads a trailing "Z" too
    except ValueError:
        return 0.0
    if stamp.tzinfo is None:  # run.json stores UTC
        stamp = stamp.replace(tzinfo=_dt.UTC)
    return stamp.timestamp()


def events_from_records(records: list[dict], wall_time: float = 0.0) -> bytes:
    """The event-file bytes of metrics records (see the module docstring for tags and steps)."""
    folds = {r.get("fold") for r in records if r.get("fold") is not None}
    records_out = [tfrecord(encode_event(wall_time, 0, file_version=FILE_VERSION))]
    for record in records:
        kind = str(record.get("kind", "log"))
        prefix = kind if len(folds) < 2 or record.get("fold") is None else f"fold{int(record['fold'])}/{kind}"
        x = record.get("epoch") if kind in EPOCH_KINDS and record.get("epoch") is not None else record.get("step")
        scalars = _scalars(record, prefix)
        if not scalars or x is None:
            continue
        when = record.get("wall_time")
        when = float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) else wall_time
        records_out.append(tfrecord(encode_event(when, int(x), scalars=scalars)))
    return b"".join(records_out)


def event_files(folder) -> list[Path]:
    """numbarl's event files in `folder`, oldest (smallest number) first."""
    found = [(int(m.group(1)), p) for p in Path(folder).glob(f"{EVENT_PREFIX}*") if (m := EVENT_NAME.match(p.name)) and p.is_file()]
    return [p for _, p in sorted(found)]


def write_events(run) -> Path:
    """Rewrite the TensorBoard event file of `run` (a RunDir or a run folder's path) from its
    metrics.jsonl; returns the new file. Older numbarl event files in the folder are removed."""
    run = run if isinstance(run, runio.RunDir) else runio.RunDir.open(run)
    blob = events_from_records(run.read_metrics(), _creation_time(run))
    older = event_files(run.path)
    stamp = time.time_ns()
    if older:  # a later name than any existing one (names sort as their numbers until the year 2286)
        stamp = max(stamp, int(EVENT_NAME.match(older[-1].name).group(1)) + 1)
    path = run.path / f"{EVENT_PREFIX}{stamp}{EVENT_SUFFIX}"
    runio.atomic_write_bytes(path, blob)
    for stale in older:
        try:
            os.remove(stale)
        except FileNotFoundError:
            pass
    return path
