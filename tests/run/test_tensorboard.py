"""TensorBoard event files written by hand: crc32c against the RFC 3720 test vectors, the Event
protobuf byte by byte, a run's metrics.jsonl written and read back (checksums, tags, steps,
values), regeneration after a resume's truncation, and TensorBoard's own reader when installed."""

import math
import struct

import numpy as np
import pytest

from numbarl.run import tensorboard as tb
from numbarl.run.runio import RunDir


@pytest.mark.parametrize(
    "data,crc",
    [
        (b"", 0x00000000),
        (b"123456789", 0xE3069283),  # the CRC catalogue's check value for CRC-32C
        (bytes(32), 0x8A9136AA),  # RFC 3720 B.4: 32 bytes of zeros
        (b"\xff" * 32, 0x62A8AB43),  # 32 bytes of ones
        (bytes(range(32)), 0x46DD794E),  # 32 incrementing bytes
        (bytes(range(31, -1, -1)), 0x113FDB5C),  # 32 decrementing bytes
    ],
)
def test_crc32c_known_vectors(data, crc):
    assert tb.crc32c_ref(data) == crc and tb.crc32c(data) == crc


def test_compiled_crc32c_equals_the_python_reference(rng):
    for n in (1, 7, 255, 4099):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert tb.crc32c(data) == tb.crc32c_ref(data)


def test_masked_crc_and_record_layout():
    c = 0xE3069283
    rotated = ((c >> 15) | (c << 17)) & 0xFFFFFFFF
    assert tb.masked_crc32c(b"123456789") == (rotated + 0xA282EAD8) % 2**32
    record = tb.tfrecord(b"abc")
    assert record[:8] == struct.pack("<Q", 3) and record[12:15] == b"abc" and len(record) == 19
    assert struct.unpack("<I", record[8:12])[0] == tb.masked_crc32c(struct.pack("<Q", 3))
    assert struct.unpack("<I", record[15:])[0] == tb.masked_crc32c(b"abc")
    assert tb.read_tfrecords(record + tb.tfrecord(b"")) == [b"abc", b""]
    for flipped in (3, 10, 13, 17):  # length, its crc, data, data crc
        bad = bytearray(record)
        bad[flipped] ^= 0x01
        with pytest.raises(ValueError, match="checksum|ends inside"):
            tb.read_tfrecords(bytes(bad))
    with pytest.raises(ValueError, match="ends inside"):
        tb.read_tfrecords(record[:-2])


def test_event_protobuf_bytes_by_hand():
    got = tb.encode_event(1.5, 300, {"a/b": 2.0})
    value = b"\x0a\x03a/b" + b"\x15" + struct.pack("<f", 2.0)  # tag (1, string), simple_value (2, float)
    summary = b"\x0a" + bytes([len(value)]) + value  # Summary.value (1)
    want = b"\x09" + struct.pack("<d", 1.5) + b"\x10\xac\x02" + b"\x2a" + bytes([len(summary)]) + summary
    assert got == want
    first = tb.encode_event(0.0, 0, file_version="brain.Event:2")
    assert first == b"\x09" + bytes(8) + b"\x10\x00" + b"\x1a\x0dbrain.Event:2"
    assert tb.encode_event(0.0, -1)[-10:] == b"\xff" * 9 + b"\x01"  # int64 -1: ten-byte varint
    assert tb.decode_event(tb.encode_event(0.0, -1))["step"] == -1


def make_run(tmp_path, folds=(0, 1)):
    run = RunDir.create(tmp_path / "run", {"a": 1}, {"seed": 1})
    for fold in folds:
        for step in (10, 20, 30):
            run.log({"kind": "train", "fold": fold, "epoch": 1 + step // 20, "step": step,
                     "loss": 1.0 / step + fold, "epsilon": 0.5, "q": {"mean": float(step)}})
        for epoch in (1, 2):
            run.log({"kind": "val", "fold": fold, "epoch": epoch, "step": 20 * epoch, "sharpe": 0.5 * epoch - fold,
                     "calmar": float("nan"), "nan_reasons": {"calmar": "window of 3 trading days is shorter than 20"}})
        run.log({"kind": "test", "fold": fold, "epoch": 2, "step": 40, "daily_sharpe": 1.25 + fold, "n_trades": 7})
    return run


def scalars_by_tag(events):
    out = {}
    for e in events:
        for tag, value in e["scalars"].items():
            out.setdefault(tag, []).append((e["step"], value))
    return out


def test_write_events_from_metrics_jsonl_reads_back(tmp_path):
    run = make_run(tmp_path)
    path = tb.write_events(run)
    assert path.parent == run.path and path.name.startswith("events.out.tfevents.")
    events = tb.read_events(path)
    assert events[0]["file_version"] == "brain.Event:2" and not events[0]["scalars"]
    assert all(e["wall_time"] == events[0]["wall_time"] > 1.6e9 for e in events)  # the run's creation time
    tags = scalars_by_tag(events[1:])
    assert set(tags) == {f"fold{k}/{t}" for k in (0, 1) for t in
                         ("train/loss", "train/epsilon", "train/q/mean", "val/sharpe", "test/daily_sharpe", "test/n_trades")}
    assert tags["fold1/train/loss"] == [(s, pytest.approx(np.float32(1.0 / s + 1))) for s in (10, 20, 30)]
    assert tags["fold0/val/sharpe"] == [(1, 0.5), (2, 1.0)]  # x = epoch for validation
    assert tags["fold1/test/daily_sharpe"] == [(2, 2.25)]
    # one event per record that has numbers: 2 folds x (3 train + 2 val + 1 test)
    assert len(events) == 1 + 12


def test_one_fold_has_no_prefix_and_write_csv_rewrites_after_truncation(tmp_path):
    run = make_run(tmp_path, folds=(0,))
    run.write_csv()  # the run folder's hook: metrics.csv and the event file together
    (first,) = tb.event_files(run.path)
    tags = scalars_by_tag(tb.read_events(first))
    assert tags["train/loss"][-1][0] == 30 and "val/sharpe" in tags
    run.truncate_log(after_step=20)  # a resume from the step-20 checkpoint rebuilds metrics.csv
    (second,) = tb.event_files(run.path)  # the older file is gone
    assert second.name > first.name
    tags = scalars_by_tag(tb.read_events(second))
    assert [s for s, _ in tags["train/loss"]] == [10, 20] and "test/daily_sharpe" not in tags
    assert tb.write_events(run.path).name > second.name  # a path works as well as a RunDir


def test_tensorboard_reads_the_file(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run = make_run(tmp_path)
    tb.write_events(run)
    acc = event_accumulator.EventAccumulator(str(run.path))
    acc.Reload()
    assert "fold0/train/loss" in acc.Tags()["scalars"]
    points = acc.Scalars("fold1/val/sharpe")
    assert [(p.step, p.value) for p in points] == [(1, -0.5), (2, 0.0)]
    assert math.isclose(acc.Scalars("fold0/test/daily_sharpe")[0].value, 1.25)
