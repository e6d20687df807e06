"""DBN and CSV readers against Databento's own decoder, and every kind of bad input."""

import io

import databento_dbn as dbn
import numpy as np
import pyarrow as pa
import pytest

from numbarl.data.errors import DataError
from numbarl.data.readers import DbnReader, RecordStream, read_records, write_dbn
from numbarl.data.records import MBP10_DTYPE, N_LEVELS, RECORD_BYTES, UNDEF_PRICE

HEADER_FIELDS = ("rtype", "publisher_id", "instrument_id", "ts_event")
BODY_FIELDS = ("price", "size", "flags", "depth", "ts_recv", "ts_in_delta", "sequence")
LEVEL_FIELDS = ("bid_px", "ask_px", "bid_sz", "ask_sz", "bid_ct", "ask_ct")


def decode_with_databento(path):
    """(metadata, [MBP10Msg]) from databento_dbn.DBNDecoder, the reference decoder."""
    data = path.read_bytes()
    compression = dbn.Compression.ZSTD if data[:4] == b"\x28\xb5\x2f\xfd" else dbn.Compression.NONE
    decoder = dbn.DBNDecoder(compression=compression)
    decoder.write(data)
    items = decoder.decode()
    return items[0], items[1:]


def assert_same_as_decoder(records, msgs):
    assert len(records) == len(msgs) > 0
    for rec, msg in zip(records, msgs):
        assert int(rec["length"]) * 4 == msg.record_size() == RECORD_BYTES
        for name in HEADER_FIELDS + BODY_FIELDS:
            assert int(rec[name]) == int(getattr(msg, name)), name
        assert chr(rec["action"]) == str(msg.action.value)
        assert chr(rec["side"]) == str(msg.side.value)
        for m in range(N_LEVELS):
            for name in LEVEL_FIELDS:
                assert int(rec["levels"][m][name]) == int(getattr(msg.levels[m], name)), (m, name)


def test_fixtures_decode_exactly_like_databento(dbn_fixtures):
    versions = set()
    for path in dbn_fixtures:
        reader = DbnReader(path)
        records = np.concatenate(list(reader))
        meta, msgs = decode_with_databento(path)
        assert records.dtype == MBP10_DTYPE
        assert_same_as_decoder(records, msgs)
        assert reader.info.schema == "mbp-10" and reader.info.dataset == meta.dataset
        assert reader.info.symbols == list(meta.symbols)
        versions.add((reader.info.version, reader.info.compressed))
    assert (2, False) in versions, "the uncompressed DBN v2 file must be among the fixtures"
    assert (3, True) in versions


def test_csv_export_reads_like_dbn(dbn_fixtures, tmp_path):
    for path in dbn_fixtures:
        expected = read_records(path)
        raw = pa.input_stream(str(path), compression="zstd").read() if path.suffix == ".zst" else path.read_bytes()
        for pretty in (True, False):
            out = io.BytesIO()
            transcoder = dbn.Transcoder(out, dbn.Encoding.CSV, dbn.Compression.NONE, pretty_px=pretty, pretty_ts=pretty)
            transcoder.write(raw)
            transcoder.flush()
            csv_path = tmp_path / f"{path.name}.{pretty}.csv"
            csv_path.write_bytes(out.getvalue())
            zst_path = tmp_path / f"{path.name}.{pretty}.csv.zst"
            with pa.CompressedOutputStream(str(zst_path), "zstd") as sink:
                sink.write(out.getvalue())
            for source in (csv_path, zst_path):
                got = read_records(source)
                for name in HEADER_FIELDS + BODY_FIELDS + ("action", "side"):
                    np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{source.name} {name}")
                np.testing.assert_array_equal(got["levels"], expected["levels"])


def test_written_dbn_all_versions_and_chunkings(small_market, tmp_path):
    records, _ = small_market
    part = records[:3000]
    for version in (1, 2, 3):
        for suffix in (".dbn", ".dbn.zst"):
            path = write_dbn(tmp_path / f"v{version}{suffix}", part, version=version, mappings={"SYNTH": 1})
            for chunk_bytes in (1 << 12, 5000, 1 << 24):
                chunks = list(DbnReader(path, chunk_bytes=chunk_bytes))
                got = np.concatenate(chunks)
                assert got.tobytes() == part.tobytes(), (version, suffix, chunk_bytes)
            meta, msgs = decode_with_databento(path)
            assert meta.version == 3
            assert_same_as_decoder(got[:50], msgs[:50])


def test_instrument_selection(small_market, tmp_path):
    records, _ = small_market
    a = records[:400].copy()
    b = records[:400].copy()
    b["instrument_id"] = 7
    both = np.sort(np.concatenate([a, b]), order="ts_recv", kind="stable")
    path = write_dbn(tmp_path / "two.dbn", both, mappings={"AAA": 1, "BBB": 7})
    with pytest.raises(DataError, match="several instruments.*--symbol"):
        read_records(path)
    got = read_records(path, symbol="BBB")
    assert len(got) == 400 and np.all(got["instrument_id"] == 7)
    assert len(read_records(path, symbol="1")) == 400
    with pytest.raises(DataError, match="symbol 'CCC' is not in the file"):
        read_records(path, symbol="CCC")


def test_files_are_joined_in_time_order(small_market, tmp_path):
    records, _ = small_market
    first = write_dbn(tmp_path / "b_first.dbn", records[:1000])
    second = write_dbn(tmp_path / "a_second.dbn.zst", records[1000:2500])
    stream = RecordStream([second, first])
    got = np.concatenate([chunk for _, chunk in stream])
    assert got.tobytes() == records[:2500].tobytes()
    overlap = write_dbn(tmp_path / "overlap.dbn", records[500:1500])
    with pytest.raises(DataError, match="unsorted timestamps"):
        list(RecordStream([first, overlap]))


@pytest.fixture
def good_file(small_market, tmp_path):
    records, _ = small_market
    return write_dbn(tmp_path / "good.dbn", records[:2000]), records[:2000]


def test_truncated_file(good_file, tmp_path):
    path, _ = good_file
    data = path.read_bytes()
    cut = tmp_path / "cut.dbn"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(DataError, match="truncated DBN file"):
        read_records(cut)
    import pyarrow as pa  # the same cut inside a valid zstd stream (the streamed, not mapped, reader)

    with pa.CompressedOutputStream(str(tmp_path / "cut.dbn.zst"), "zstd") as out:
        out.write(data[: len(data) - 100])
    with pytest.raises(DataError, match="truncated DBN file: 268 trailing bytes"):
        read_records(tmp_path / "cut.dbn.zst")
    cut.write_bytes(data[:30])
    with pytest.raises(DataError, match="truncated|metadata"):
        read_records(cut)


def test_corrupt_zstd(good_file, tmp_path):
    path, records = good_file
    z = write_dbn(tmp_path / "good.dbn.zst", records)
    data = bytearray(z.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad = tmp_path / "bad.dbn.zst"
    bad.write_bytes(bytes(data))
    with pytest.raises(DataError, match="corrupt|truncated"):
        read_records(bad)
    half = tmp_path / "half.dbn.zst"
    half.write_bytes(z.read_bytes()[: len(data) // 2])
    with pytest.raises(DataError, match="corrupt or truncated zstd"):
        read_records(half)


def test_corrupt_record_length(good_file, tmp_path):
    path, _ = good_file
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[4:8], "little")
    data[header + 5 * RECORD_BYTES] = 1  # a record claiming 4 bytes
    bad = tmp_path / "badlen.dbn"
    bad.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"corrupt DBN data: record 6 \(after 5 MBP-10 records, byte "):
        read_records(bad)


def test_empty_and_garbage_files(tmp_path):
    empty = tmp_path / "empty.dbn"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        read_records(empty)
    garbage = tmp_path / "garbage.dbn"
    garbage.write_bytes(b"\x00\x01 this is not market data" * 20)
    with pytest.raises(DataError, match="not a DBN file"):
        read_records(garbage)
    with pytest.raises(DataError, match="no such file"):
        read_records(tmp_path / "missing.dbn")


def test_header_only_file_has_no_records(small_market, tmp_path):
    path = write_dbn(tmp_path / "header_only.dbn", small_market[0][:0])
    with pytest.raises(DataError, match="no MBP-10 records"):
        read_records(path)


def test_wrong_schema(tmp_path):
    meta = dbn.Metadata("GLBX.MDP3", 0, dbn.SType.RAW_SYMBOL, dbn.SType.INSTRUMENT_ID, dbn.Schema.TRADES, symbols=["ESH1"], end=10)
    trade = dbn.TradeMsg(1, 5482, 100, 3720250000000, 1, dbn.Action.TRADE, dbn.Side.BID, 0, 101, flags=128)
    path = tmp_path / "trades.dbn"
    path.write_bytes(bytes(meta) + bytes(trade))
    with pytest.raises(DataError, match="schema is 'trades'.*mbp-10"):
        read_records(path)
    # a stream without a schema in its metadata that carries trade records
    mixed = dbn.Metadata("GLBX.MDP3", 0, dbn.SType.RAW_SYMBOL, dbn.SType.INSTRUMENT_ID, None, symbols=["ESH1"], end=10)
    path.write_bytes(bytes(mixed) + bytes(trade))
    with pytest.raises(DataError, match=r"record 1 \(after 0 MBP-10 records.*\) has rtype 0 \(trades"):
        read_records(path)
    csv = tmp_path / "trades.csv"
    out = io.BytesIO()
    transcoder = dbn.Transcoder(out, dbn.Encoding.CSV, dbn.Compression.NONE)
    transcoder.write(bytes(meta) + bytes(trade))
    transcoder.flush()
    csv.write_bytes(out.getvalue())
    with pytest.raises(DataError, match="mbp-10|MBP-10"):
        read_records(csv)


def test_unsorted_timestamps(good_file, tmp_path):
    _, records = good_file
    shuffled = records.copy()
    shuffled[[700, 701]] = shuffled[[701, 700]]
    if shuffled["ts_recv"][700] == shuffled["ts_recv"][701]:
        shuffled["ts_recv"][701] -= 1_000
    path = write_dbn(tmp_path / "unsorted.dbn", shuffled)
    with pytest.raises(DataError, match="unsorted timestamps: record 70[12]"):
        read_records(path)


def test_csv_bad_values(dbn_fixtures, tmp_path):
    path = next(p for p in dbn_fixtures if p.suffix == ".dbn")
    out = io.BytesIO()
    transcoder = dbn.Transcoder(out, dbn.Encoding.CSV, dbn.Compression.NONE)
    transcoder.write(path.read_bytes())
    transcoder.flush()
    lines = out.getvalue().decode().splitlines()
    row = lines[1].split(",")
    row[8] = "12x.5"
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join([lines[0], ",".join(row), *lines[2:]]) + "\n")
    with pytest.raises(DataError, match="row 1, column price"):
        read_records(bad)
    assert UNDEF_PRICE == np.iinfo(np.int64).max


def test_files_of_different_instruments_are_not_merged(dbn_fixtures, small_market, tmp_path):
    """Without --symbol, two files of two instruments are one error naming both, never one stream."""
    by_name = {p.name.split("__")[1]: p for p in dbn_fixtures}
    es, nvda = by_name["GLBX.MDP3"], by_name["XNAS.ITCH"]
    with pytest.raises(DataError, match=r"(?s)different datasets.*ESH1.*GLBX.*NVDA.*XNAS.*--symbol") as err:
        read_records([es, nvda])
    assert str(es) in str(err.value) and str(nvda) in str(err.value)
    # the same raw symbol in several files (v2 plain, v3 zstd) still joins
    same = [es, by_name["test_data.mbp-10.dbn"]]
    assert len(read_records(same)) == len(read_records(same[0])) + len(read_records(same[1]))
    # one dataset, two raw symbols; and two files without symbols of two instrument_ids
    records, _ = small_market
    a = write_dbn(tmp_path / "a.dbn", records[:500], mappings={"AAA": 1})
    b = write_dbn(tmp_path / "b.dbn", records[500:1000], mappings={"BBB": 1})
    with pytest.raises(DataError, match=r"several instruments across the inputs:.*a\.dbn holds symbol 'AAA'.*b\.dbn holds symbol 'BBB'.*--symbol"):
        read_records([a, b])
    assert len(read_records([a, b], symbol="1")) == 1000  # --symbol picks the instrument
    other = records[500:1000].copy()
    other["instrument_id"] = 7
    c = write_dbn(tmp_path / "c.dbn", other)
    d = write_dbn(tmp_path / "d.dbn", records[:500])
    with pytest.raises(DataError, match=r"several instruments across the inputs:.*d\.dbn holds no symbol .*instrument_id 1\).*c\.dbn.*instrument_id 7"):
        read_records([c, d])


def _csv_lines(dbn_fixtures):
    path = next(p for p in dbn_fixtures if p.suffix == ".dbn")
    out = io.BytesIO()
    transcoder = dbn.Transcoder(out, dbn.Encoding.CSV, dbn.Compression.NONE)
    transcoder.write(path.read_bytes())
    transcoder.flush()
    assert out.getvalue().endswith(b"\n")
    return out.getvalue().decode().splitlines()


@pytest.mark.parametrize(
    "cell, shown",
    [("", "cannot parse ''"), ("2.5", "cannot parse '2.5'"), ("2x", "cannot parse '2x'"), ("-1", "out of range for uint32.*'-1'")],
)
def test_csv_error_names_the_real_row_and_raw_value(dbn_fixtures, tmp_path, cell, shown):
    lines = _csv_lines(dbn_fixtures)
    header = lines[0].split(",")
    rows = [lines[1 + k % (len(lines) - 1)].split(",") for k in range(300)]
    rows[49][header.index("size")] = cell  # data row 50
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join([lines[0], *(",".join(r) for r in rows)]) + "\n")
    for chunk_bytes in (None, 20_000):  # one block, and row 50 inside a later block
        with pytest.raises(DataError, match=rf"bad\.csv: row 50, column size: {shown}.*counted from 1") as err:
            read_records(bad, chunk_bytes=chunk_bytes)
        assert "np.str_" not in str(err.value)


def test_csv_without_final_newline_is_truncated(dbn_fixtures, tmp_path):
    lines = _csv_lines(dbn_fixtures)
    header = lines[0].split(",")
    rows = [r.split(",")[: header.index("ask_ct_09") + 1] for r in lines]  # no symbol column: ends in a count
    rows[-1][-1] = "10"
    text = "\n".join(",".join(r) for r in rows) + "\n"
    good = tmp_path / "good.csv"
    good.write_text(text)
    assert read_records(good)["levels"]["ask_ct"][-1, -1] == 10
    cut = tmp_path / "cut.csv"
    cut.write_text(text[:-2])  # "...,10\n" cut to "...,1": still parses, with a wrong count
    with pytest.raises(DataError, match=r"cut\.csv: the CSV ends without a newline: the file looks truncated"):
        read_records(cut)
    with pa.CompressedOutputStream(str(tmp_path / "cut.csv.zst"), "zstd") as sink:
        sink.write(text[:-2].encode())
    with pytest.raises(DataError, match=r"cut\.csv\.zst: the CSV \(decompressed\) ends without a newline"):
        read_records(tmp_path / "cut.csv.zst")
    # cut inside the symbol column ("ESH1" -> "ESH"), in a later block of a zstd file: reported
    # as the truncation it is, not as a second instrument
    full = "\n".join(lines) + "\n"
    rows = "\n".join([lines[0], *([lines[-1]] * 400)]) + "\n"  # equal ts_recv: still in order
    with pa.CompressedOutputStream(str(tmp_path / "cut_symbol.csv.zst"), "zstd") as sink:
        sink.write(rows[:-2].encode())
    assert full.endswith(",ESH1\n")
    for chunk_bytes in (None, 20_000):
        with pytest.raises(DataError, match=r"cut_symbol\.csv\.zst: the CSV \(decompressed\) ends without a newline"):
            read_records(tmp_path / "cut_symbol.csv.zst", chunk_bytes=chunk_bytes)


@pytest.mark.parametrize("name", ["d.dbn", "d.dbn.zst"])
def test_write_dbn_is_atomic(small_market, tmp_path, monkeypatch, name):
    """A write that fails (a full disk) leaves neither a partial file nor its temp file."""
    import os

    records, _ = small_market

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_dbn(tmp_path / name, records[:100])
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert len(read_records([write_dbn(tmp_path / name, records[:100])])) == 100
    assert [p.name for p in tmp_path.iterdir()] == [name]
