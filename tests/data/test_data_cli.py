"""numbarl-data: every command, and one clear error with exit code 2 for each bad input."""

import json
import subprocess
import sys

import databento_dbn as dbn
import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from numbarl.data.commands import data_group
from numbarl.data.readers import write_dbn


def run(*args):
    return CliRunner().invoke(data_group, [str(a) for a in args])


@pytest.fixture(scope="module")
def market_file(tmp_path_factory):
    """Four synthetic sessions as a zstd DBN file, written by `numbarl-data synth --dbn`."""
    root = tmp_path_factory.mktemp("cli")
    result = run("synth", "--out", root / "synthcache", "--tiny", "--seed", 2, "--dbn", root / "market.dbn.zst")
    assert result.exit_code == 0, result.output
    return root / "market.dbn.zst"


def test_synth_inspect_export(tmp_path):
    out = tmp_path / "tiny"
    result = run("synth", "--out", out, "--tiny", "--seed", 3, "--signal", 0.1)
    assert result.exit_code == 0, result.output
    assert "4 sessions" in result.output
    info = json.loads(run("inspect", out, "--json").output)
    assert info["sessions"] == 4 and len(info["features"]) == 64
    assert info["bars"] == pytest.approx(info["bars_per_day"] * 4)
    assert all(row["nan"] == 0 for row in info["features"]) and info["synthetic"]["signal"] == 0.1
    table = run("inspect", out)
    assert table.exit_code == 0 and "ofi_total_16" in table.output and "bars/day" in table.output
    result = run("export", out, "--parquet", tmp_path / "bars.parquet")
    assert result.exit_code == 0, result.output
    frame = pq.read_table(tmp_path / "bars.parquet")
    assert frame.num_rows == info["bars"] and "f_ofi_1" in frame.column_names and "oracle" in frame.column_names
    assert run("synth", "--out", tmp_path / "x", "--null", "--signal", 0.2).exit_code == 2
    # bad output places and values: one error line, exit 2, nothing written
    (tmp_path / "folder").mkdir()
    for args, message in ((("export", out, "--parquet", tmp_path / "folder"), "is a folder"),
                          (("export", out, "--parquet", tmp_path / "bars.parquet"), "already exists"),
                          (("synth", "--out", tmp_path / "x", "--tiny", "--seed", -1), "seed must be a non-negative"),
                          (("synth", "--out", tmp_path / "x", "--tiny", "--sessions", 0), "sessions must be an integer >= 1, got 0"),
                          (("synth", "--out", tmp_path / "x", "--tiny", "--dbn", tmp_path / "folder"), "is a folder"),
                          (("synth", "--out", tmp_path / "x", "--tiny", "--dbn", tmp_path / "bars.parquet"), "already exists"),
                          (("synth", "--out", tmp_path / "bars.parquet" / "x", "--tiny"), "is a file, not a folder")):
        result = run(*args)
        assert result.exit_code == 2 and message in result.stderr, (args, result.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bars.parquet", "folder", "tiny"]
    assert run("export", out, "--parquet", tmp_path / "bars.parquet", "--force").exit_code == 0
    assert not any((tmp_path / "folder").iterdir())


def test_build_from_dbn(market_file, tmp_path):
    out = tmp_path / "built"
    result = run("build", market_file, "--out", out, "--bars-per-day", 100, "--features", "default,theta_norm")
    assert result.exit_code == 0, result.output
    info = json.loads(run("inspect", out, "--json").output)
    assert info["sessions"] == 5 and len(info["features"]) == 65 and info["tick_size"] == 0.25
    assert info["source_files"][0]["name"] == "market.dbn.zst"
    assert info["symbol"] == "SYNTH"  # the file's one raw symbol, without --symbol
    ewma = run("build", market_file, "--out", tmp_path / "ewma", "--mode", "ewma", "--symbol", "SYNTH")
    assert ewma.exit_code == 0, ewma.output
    both = run("build", market_file, "--out", tmp_path / "bad", "--mode", "ewma", "--bars-per-day", 10)
    assert both.exit_code == 2 and not (tmp_path / "bad").exists()
    zero = run("build", market_file, "--out", tmp_path / "bad", "--bars-per-day", 0)  # not "the default"
    assert zero.exit_code == 2 and "bars_per_day must be >= 1, got 0" in zero.stderr and not (tmp_path / "bad").exists()


def bad_inputs(market_file, root):
    """(name, extra CLI args, file) for every kind of bad input."""
    data = market_file.read_bytes()
    import pyarrow as pa

    raw = pa.input_stream(str(market_file), compression="zstd").read()
    header = 8 + int.from_bytes(raw[4:8], "little")
    records = np.frombuffer(raw[header:], dtype=np.uint8).reshape(-1, 368).copy()
    out = {}
    (root / "truncated.dbn").write_bytes(raw[: len(raw) - 1000])
    out["truncated"] = ("truncated DBN file", [], root / "truncated.dbn")
    corrupt = bytearray(data)
    corrupt[len(corrupt) // 2] ^= 0xFF
    (root / "corrupt.dbn.zst").write_bytes(bytes(corrupt))
    out["corrupt"] = ("corrupt", [], root / "corrupt.dbn.zst")
    (root / "empty.dbn").write_bytes(b"")
    out["empty"] = ("empty", [], root / "empty.dbn")
    meta = dbn.Metadata("GLBX.MDP3", 0, dbn.SType.RAW_SYMBOL, dbn.SType.INSTRUMENT_ID, dbn.Schema.MBP_1, symbols=["X"], end=1)
    (root / "mbp1.dbn").write_bytes(bytes(meta))
    out["schema"] = ("schema is 'mbp-1'", [], root / "mbp1.dbn")
    from numbarl.data.records import MBP10_DTYPE

    recs = records.view(MBP10_DTYPE).reshape(-1).copy()
    unsorted = recs.copy()
    unsorted["ts_recv"][5000] = unsorted["ts_recv"][4000]
    write_dbn(root / "unsorted.dbn", unsorted)
    out["unsorted"] = ("unsorted timestamps", [], root / "unsorted.dbn")
    crossed = recs.copy()
    crossed["levels"]["bid_px"][9000, 0] = crossed["levels"]["ask_px"][9000, 0] + 250_000_000
    write_dbn(root / "crossed.dbn", crossed)
    out["crossed"] = ("crossed book at .*crossed.dbn, selected record 9001", ["--bars-per-day", 100], root / "crossed.dbn")
    out["feature"] = ("unknown feature 'ofi_42'", ["--features", "ret_1,ofi_42"], market_file)
    out["folds"] = ("needs 20 sessions; the data has 5", ["--bars-per-day", 100, "--folds", 1], market_file)
    return out


@pytest.mark.parametrize("case", ["truncated", "corrupt", "empty", "schema", "unsorted", "crossed", "feature", "folds"])
def test_bad_inputs_fail_cleanly(market_file, tmp_path, case):
    message, extra, path = bad_inputs(market_file, tmp_path)[case]
    out = tmp_path / "cache"
    result = run("build", path, "--out", out, *extra)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("numbarl-data: error: ")
    import re

    assert re.search(message, lines[0]), lines[0]
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".cache")]


def test_console_entry_point_exit_code(tmp_path):
    code = "from numbarl.cli import data_main; data_main()"
    proc = subprocess.run(
        [sys.executable, "-c", code, "build", str(tmp_path / "missing.dbn"), "--out", str(tmp_path / "c")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"numbarl-data: error: {tmp_path / 'missing.dbn'}: no such file"]
