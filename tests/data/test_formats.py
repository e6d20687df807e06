"""LOBSTER and Binance captures: real samples build caches through the shared bars/features path,
bars are causal under truncation, and bad files are one error line, exit 2, nothing written."""

import gzip
import json

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import BINANCE, LOBSTER_BOOK, LOBSTER_MESSAGE
from numbarl.data.bars import BarParams, bars_ref, build_bars
from numbarl.data.binance import BinanceReader
from numbarl.data.calendar import UTC_DAYS, US_EQUITIES
from numbarl.data.commands import data_group
from numbarl.data.errors import DataError
from numbarl.data.features import compute_features
from numbarl.data.fxcache import build_cache, load_cache
from numbarl.data.lobster import LobsterReader
from numbarl.data.readers import read_records, resolve_inputs, sniff_kind
from numbarl.data.records import ACTION_TRADE, F_LAST, F_MAYBE_BAD_BOOK, F_SNAPSHOT, SIDE_ASK, SIDE_BID, SIDE_NONE

LOBSTER_BARS = BarParams(mode="ewma", ewma_initial_trades=10, ewma_min_trades=5, ewma_max_trades=50)
BINANCE_BARS = BarParams(mode="ewma", ewma_initial_trades=20, ewma_min_trades=5, ewma_max_trades=200)


def run(*args):
    return CliRunner().invoke(data_group, [str(a) for a in args])


def assert_one_error(result, out, pattern):
    import re

    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if not line.startswith("numbarl-data: warning:")]
    assert len(errors) == 1 and errors[0].startswith("numbarl-data: error: "), lines
    assert re.search(pattern, errors[0]), errors[0]
    assert len(errors[0]) < 600
    assert not out.exists()


# -- LOBSTER ---------------------------------------------------------------------------------
def test_lobster_records_follow_the_message_file():
    recs = read_records([LOBSTER_MESSAGE, LOBSTER_BOOK])
    rows = [line.split(",") for line in LOBSTER_MESSAGE.read_text().splitlines()]
    assert len(recs) == len(rows) == 999
    kinds = np.array([int(r[1]) for r in rows])
    direction = np.array([int(r[5]) for r in rows])
    trades = recs["action"] == ACTION_TRADE
    np.testing.assert_array_equal(trades, np.isin(kinds, (4, 5, 6)))
    # an execution hits a resting order: the aggressor is the other side
    np.testing.assert_array_equal(recs["side"][trades & (direction == 1)], SIDE_ASK)
    np.testing.assert_array_equal(recs["side"][trades & (direction == -1)], SIDE_BID)
    np.testing.assert_array_equal(recs["price"], [int(r[4]) * 100_000 for r in rows])
    # 34200.004241176 s after New York midnight of 2012-06-21 (EDT): 13:30:00.004241176 UTC
    assert int(recs["ts_recv"][0]) == 1_340_285_400_004_241_176
    # the book after each message, ask/bid per level, and F_LAST only at the last message of a time
    book = [line.split(",") for line in LOBSTER_BOOK.read_text().splitlines()]
    assert recs["levels"]["ask_px"][5, 2] == int(book[5][8]) * 100_000
    assert recs["levels"]["bid_sz"][5, 2] == int(book[5][11])
    same_time_next = np.r_[recs["ts_recv"][1:] == recs["ts_recv"][:-1], False]
    np.testing.assert_array_equal((recs["flags"] & F_LAST) != 0, ~same_time_next)
    assert same_time_next.sum() > 10


def test_lobster_chunking_and_halts(tmp_path):
    whole = read_records([LOBSTER_MESSAGE, LOBSTER_BOOK])
    chunks = list(LobsterReader(LOBSTER_MESSAGE, LOBSTER_BOOK, chunk_bytes=64 * 300))
    assert len(chunks) > 2 and np.concatenate(chunks).tobytes() == whole.tobytes()
    rows = LOBSTER_MESSAGE.read_text().splitlines()
    book = LOBSTER_BOOK.read_text().splitlines()
    t100, t199 = rows[100].split(",")[0], rows[199].split(",")[0]
    # a halt (price -1), quoting resumes (0), ... trading resumes (1): LOBSTER's type-7 messages
    msg = rows[:101] + [f"{t100},7,0,0,-1,-1", f"{t100},7,0,0,0,-1"] + rows[101:200] + [f"{t199},7,0,0,1,-1"] + rows[200:]
    books = book[:101] + [book[100], book[100]] + book[101:200] + [book[199]] + book[200:]
    path = tmp_path / LOBSTER_MESSAGE.name
    path.write_text("\n".join(msg) + "\n")
    (tmp_path / LOBSTER_BOOK.name).write_text("\n".join(books) + "\n")
    recs = read_records([path])  # the order-book file is found beside its message file
    bad = (recs["flags"] & F_MAYBE_BAD_BOOK) != 0
    assert bad[101] and bad[102] and bad[150] and bad[201]
    assert not bad[100] and not bad[202] and not bad[300]


def test_lobster_cache_builds_and_is_causal_under_truncation(tmp_path):
    out = build_cache([LOBSTER_MESSAGE, LOBSTER_BOOK], tmp_path / "c", bar_params=LOBSTER_BARS, warn=lambda m: None)
    cache = load_cache(out)
    assert cache.n_bars > 20 and cache.meta["calendar"]["tz"] == "America/New_York"
    assert cache.meta["formats"] == ["lobster"] and cache.tick_size == 0.01 and cache.meta["symbol"] == "AAPL"
    assert [f["name"] for f in cache.meta["source_files"]] == [LOBSTER_MESSAGE.name, LOBSTER_BOOK.name]
    assert np.all((cache.bid > 580) & (cache.ask < 590) & (cache.bid < cache.ask))
    assert all(float(f"{x:.2f}") == x for x in cache.bid)  # cents, exactly: the double nearest the decimal
    records = read_records([LOBSTER_MESSAGE])
    _assert_causal(records, LOBSTER_BARS, US_EQUITIES, tmp_path, "lobster")
    # truncated files (both cut at the same row): the bars closing before the cut are the same
    msg, book = LOBSTER_MESSAGE.read_text().splitlines(), LOBSTER_BOOK.read_text().splitlines()
    cut = 600
    short_msg = tmp_path / "cut" / LOBSTER_MESSAGE.name
    short_msg.parent.mkdir()
    short_msg.write_text("\n".join(msg[:cut]) + "\n")
    (short_msg.parent / LOBSTER_BOOK.name).write_text("\n".join(book[:cut]) + "\n")
    part = load_cache(build_cache([short_msg], tmp_path / "cc", bar_params=LOBSTER_BARS, warn=lambda m: None))
    n = int(np.sum(np.asarray(cache.bars["close_index"]) < cut - 1))
    assert n > 5 and np.asarray(part.bars[:n]).tobytes() == np.asarray(cache.bars[:n]).tobytes()
    assert np.asarray(part.features[:n]).tobytes() == np.asarray(cache.features[:n]).tobytes()


def _assert_causal(records, params, calendar, tmp_path, name):
    full = build_bars(records, params, calendar)
    features = compute_features(full, tick_size=None, calendar=calendar)
    assert len(full) > 20
    reference = bars_ref(records, params, calendar)
    np.testing.assert_array_equal(full["close_index"], reference["close_index"])
    rng = np.random.default_rng(len(records))
    first = int(full["close_index"][0]) + 1
    for cut in rng.integers(first, len(records), size=4):
        bars = build_bars(records[:cut], params, calendar)
        assert 0 < len(bars) <= len(full) and np.all(full["close_index"][len(bars):] >= cut)
        assert bars.tobytes() == full[: len(bars)].tobytes(), (name, cut)
        assert compute_features(bars, tick_size=None, calendar=calendar).tobytes() == features[: len(bars)].tobytes()


def test_lobster_cli(tmp_path):
    out = tmp_path / "c"
    result = run("build", LOBSTER_MESSAGE, LOBSTER_BOOK, "--out", out, "--mode", "ewma", "--ewma-initial-trades", 10,
                 "--ewma-min-trades", 5, "--ewma-max-trades", 50)
    assert result.exit_code == 0, result.output
    assert "bars, 1 sessions" in result.output
    forced = run("build", LOBSTER_MESSAGE, "--out", tmp_path / "f", "--format", "lobster", "--mode", "ewma",
                 "--ewma-min-trades", 5, "--ewma-max-trades", 50)
    assert forced.exit_code == 0, forced.output
    assert_one_error(run("build", LOBSTER_MESSAGE, "--out", tmp_path / "x", "--format", "binance"), tmp_path / "x",
                     "not '<receive time ns> <JSON>'")
    # default flags: target mode has no earlier session to calibrate on, so the day's bars follow
    # the ewma rule (the sample's 999 records give a handful of bars)
    default = run("build", LOBSTER_MESSAGE, LOBSTER_BOOK, "--out", tmp_path / "d")
    assert default.exit_code == 0 and "1 sessions" in default.output, default.output


def _lobster_pair(tmp_path, msg_edit=None, book_edit=None, name="AAPL_2012-06-21_34200000_57600000"):
    msg = LOBSTER_MESSAGE.read_text().splitlines()
    book = LOBSTER_BOOK.read_text().splitlines()
    msg, book = (msg_edit or (lambda x: x))(msg), (book_edit or (lambda x: x))(book)
    folder = tmp_path / "in"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}_message_10.csv").write_text("\n".join(msg) + "\n")
    (folder / f"{name}_orderbook_10.csv").write_text("\n".join(book) + "\n")
    return folder / f"{name}_message_10.csv"


def _replace(rows, k, column, value):
    cells = rows[k].split(",")
    cells[column] = value
    return rows[:k] + [",".join(cells)] + rows[k + 1 :]


LOBSTER_BAD = {
    "rows": (lambda m: m[:-5], None, "the files must have the same number of rows"),
    "type": (lambda m: _replace(m, 40, 1, "8"), None, r"row 41, column type: '8' is not an integer in 1\.\.7"),
    "direction": (lambda m: _replace(m, 40, 5, "0"), None, "row 41, column direction: 0 is not a direction"),
    "time": (lambda m: _replace(m, 40, 0, "34200.1234567890"), None, "row 41, column time: .* is not seconds"),
    "unsorted": (lambda m: _replace(m, 40, 0, "34100.0"), None, "unsorted timestamps: record 41"),
    "columns": (None, lambda b: _replace(b, 7, 3, "5,5"), "row 8 has 41 columns"),
    "size": (None, lambda b: _replace(b, 7, 1, "99999999999"), r"row 8, column ask size level 1: .* not an integer"),
    "crossed": (None, lambda b: _replace(b, 300, 2, "5999000"), r"crossed book at .*selected record 301 .*inside the trading session"),
}


@pytest.mark.parametrize("case", sorted(LOBSTER_BAD))
def test_lobster_bad_files(tmp_path, case):
    msg_edit, book_edit, pattern = LOBSTER_BAD[case]
    msg = _lobster_pair(tmp_path, msg_edit, book_edit)
    out = tmp_path / "c"
    assert_one_error(run("build", msg, "--out", out, "--mode", "ewma", "--ewma-min-trades", 5, "--ewma-max-trades", 50),
                     out, pattern)


def test_lobster_names_and_partners(tmp_path):
    msg = _lobster_pair(tmp_path)
    (tmp_path / "in" / msg.name.replace("_message_", "_orderbook_")).unlink()
    with pytest.raises(DataError, match="message file without its order-book file"):
        resolve_inputs([msg])
    other = _lobster_pair(tmp_path, name="AAPL_2012-13-45_1_2")
    with pytest.raises(DataError, match="'2012-13-45' in the file name is not a date"):
        read_records([other])
    assert sniff_kind(LOBSTER_BOOK) == "lobster-orderbook"
    with pytest.raises(DataError, match="order-book file without its message file"):
        resolve_inputs([LOBSTER_BOOK])


# -- Binance ---------------------------------------------------------------------------------
def _lines():
    return gzip.decompress(BINANCE.read_bytes()).decode().splitlines()


def test_binance_records_and_book_rule():
    reader = BinanceReader(BINANCE)
    recs = np.concatenate(list(reader))
    lines = _lines()
    messages = [json.loads(line.split(" ", 1)[1]) for line in lines]
    trades = [m["data"] for m in messages if m.get("stream", "").endswith("@trade")]
    got = recs[recs["action"] == ACTION_TRADE]
    skipped = sum(reader.skipped_warmup.values())
    assert skipped > 0 and len(trades) - skipped <= len(got) < len(trades)
    tail = trades[len(trades) - len(got):]  # the trades after the warm-up
    np.testing.assert_array_equal(got["side"], [SIDE_ASK if t["m"] else SIDE_BID for t in tail])
    np.testing.assert_array_equal(got["size"], [round(float(t["q"]) * 1e5) for t in tail])
    np.testing.assert_array_equal(got["price"], [round(float(t["p"]) * 100) * 10_000_000 for t in tail])
    assert np.all((got["flags"] & F_LAST) == 0)  # a bar closes at the next book message
    books = recs[(recs["flags"] & F_LAST) != 0]
    assert np.sum((books["flags"] & F_SNAPSHOT) != 0) == 1
    lv = books["levels"][:, 0]
    assert np.all(lv["bid_px"] < lv["ask_px"]) and reader.crossed == 0
    # the newest book ticker is the top of the book (it is newer than the diffs it clamps)
    last_ticker = next(m["data"] for m in reversed(messages) if m.get("stream", "").endswith("@bookTicker"))
    assert books[-1]["levels"][0]["bid_px"] == round(float(last_ticker["b"]) * 100) * 10_000_000
    assert np.all(np.diff(books["levels"]["bid_px"][:, :5], axis=1) < 0)


def test_binance_cache_builds_and_is_causal(tmp_path):
    warnings = []
    cache = load_cache(build_cache([BINANCE], tmp_path / "c", bar_params=BINANCE_BARS, warn=warnings.append))
    assert cache.n_bars > 20 and cache.meta["calendar"]["tz"] == "UTC" and cache.meta["calendar"]["weekends"]
    assert cache.meta["symbol"] == "BTCUSDT" and cache.meta["size_unit"] == 1e-5 and cache.tick_size == 0.01
    assert any("before its book was warm" in w for w in warnings)
    assert np.all((cache.bid > 60_000) & (cache.bid < cache.ask))
    records = read_records([BINANCE])
    _assert_causal(records, BINANCE_BARS, UTC_DAYS, tmp_path, "binance")


def _capture(tmp_path, edit):
    lines = edit(_lines())
    path = tmp_path / "capture.gz"
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    return path


def _swap_json(lines, k, old, new):
    assert old in lines[k], lines[k][:120]
    return lines[:k] + [lines[k].replace(old, new, 1)] + lines[k + 1 :]


BINANCE_BAD = {
    "json": (lambda x: x[:50] + [x[50][:-3]] + x[51:], "line 51: not JSON"),
    "line": (lambda x: x[:50] + ["garbage"] + x[51:], "line 51: not '<receive time ns> <JSON>'"),
    "price": (lambda x: _swap_json(x, 3, '"p":"61837.63000000"', '"p":"-1"'), "line 4: price '-1' is not a decimal"),
    "stream": (lambda x: _swap_json(_swap_json(x, 3, '"e":"trade"', '"e":"kline"'), 3, "@trade", "@kline_1m"),
               "line 4: stream .* is not read"),
    "unsorted": (lambda x: x[:100] + [x[300]] + x[101:], "unsorted timestamps"),
    "time": (lambda x: ["99999999999999999999" + x[60][19:]] + x[1:], "beyond int64 nanoseconds"),
}


@pytest.mark.parametrize("case", sorted(BINANCE_BAD))
def test_binance_bad_files(tmp_path, case):
    edit, pattern = BINANCE_BAD[case]
    path = _capture(tmp_path, edit)
    out = tmp_path / "c"
    assert_one_error(run("build", path, "--out", out, "--mode", "ewma"), out, pattern)


def test_binance_cli_and_trainer_path(tmp_path):
    result = run("build", BINANCE, "--out", tmp_path / "c", "--mode", "ewma")
    assert result.exit_code == 0, result.output
    assert "1 sessions" in result.output
    # numbarl-train --data FILES calls build_cache with the default bar parameters: a one-day
    # capture has one session, whose bars follow the ewma rule in target mode (nothing to calibrate on)
    assert load_cache(build_cache([BINANCE], tmp_path / "t", warn=lambda m: None)).n_sessions == 1
    assert SIDE_NONE not in read_records([BINANCE])["side"][read_records([BINANCE])["action"] == ACTION_TRADE]


def test_binance_capture_of_two_symbols(tmp_path):
    """Each symbol has its own book; without --symbol two symbols are an error, with it one is read."""
    lines = [line for line in _lines()[:3000] if "lastUpdateId" not in line]
    twin = []
    for line in lines:
        ts, rest = line.split(" ", 1)
        twin.append(f"{int(ts) + 1} " + rest.replace("BTCUSDT", "ETHUSDT").replace("btcusdt@", "ethusdt@"))
    both = [x for pair in zip(lines, twin) for x in pair]
    path = tmp_path / "two.gz"
    path.write_bytes(gzip.compress(("\n".join(both) + "\n").encode()))
    with pytest.raises(DataError, match="several instruments: 'BTCUSDT' .*'ETHUSDT' .*--symbol"):
        read_records([path])
    eth = read_records([path], symbol="ETHUSDT")
    btc = read_records([path], symbol="BTCUSDT")
    assert len(eth) == len(btc) > 1000
    np.testing.assert_array_equal(eth["levels"], btc["levels"])
    np.testing.assert_array_equal(eth["ts_recv"], btc["ts_recv"] + 1)
