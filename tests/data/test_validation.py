"""Input that a fuzzer found getting past the readers: each class is a clean DataError naming the
record, or counted and skipped (never into the cache). One test per class, each failing on the
readers/builder before validate.py."""

import io
import subprocess
import sys

import numpy as np
import pytest

from data_markets import csv_export
from numbarl.data import synth
from numbarl.data.bars import BarParams, bars_ref, build_bars
from numbarl.data.calendar import SessionCalendar
from numbarl.data.errors import DataError
from numbarl.data.features import compute_features
from numbarl.data.fxcache import build_cache, load_cache
from numbarl.data.readers import read_records, write_dbn
from numbarl.data.records import ACTION_TRADE, F_LAST, UNDEF_PRICE

INT64_MIN = np.iinfo(np.int64).min
EWMA = BarParams(mode="ewma", ewma_initial_trades=30, ewma_span_bars=10, ewma_span_trades=200)


@pytest.fixture(scope="module")
def market(small_market):
    records, _ = small_market
    return records[:6000].copy()


def dbn_bytes(records) -> bytes:
    buf = io.BytesIO()
    path = write_dbn(_tmp() / "m.dbn", records, mappings={"SYNTH": 1})
    buf.write(path.read_bytes())
    return buf.getvalue()


def _tmp():
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp(prefix="numbarl-validation-"))


@pytest.fixture(scope="module")
def csv_lines(market):
    text = csv_export(dbn_bytes(market)).decode()
    return text.splitlines()


def write_csv(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def set_cell(lines, row, column, value):
    header = lines[0].split(",")
    out = list(lines)
    cells = out[row].split(",")
    cells[header.index(column)] = value
    out[row] = ",".join(cells)
    return out


# -- timestamps ------------------------------------------------------------------------------
def test_calendar_refuses_times_it_cannot_represent():
    with pytest.raises(DataError, match="not between 1971 and 2200"):
        SessionCalendar().sessions_between(1_700_000_000_000_000_000, np.iinfo(np.int64).max - 5)


@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("value", [2**64 - 1, 2**63, 2**63 + 5, 0, 5])
def test_sentinel_ts_recv_is_an_error_naming_the_record(market, tmp_path, where, value):
    recs = market[:500].copy()
    k = 0 if where == "first" else len(recs) - 1
    recs["ts_recv"][k] = value
    path = write_dbn(tmp_path / "t.dbn", recs)
    with pytest.raises(DataError, match=rf"t\.dbn, record {k + 1}: ts_recv {value} is not a time between 1971-01-01 and 2200"):
        build_cache([path], tmp_path / "c", bar_params=EWMA)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("cell, message", [
    ("-1", "cannot parse"), ("18446744073709551616", "out of range for a uint64"), ("1.5", "cannot parse"),
])  # fmt: skip
def test_csv_timestamp_overflow_is_a_data_error(csv_lines, tmp_path, cell, message):
    lines = set_cell(csv_lines, 7, "ts_event", cell)
    with pytest.raises(DataError, match=rf"row 7, column ts_event: {message}"):
        read_records(write_csv(tmp_path / "t.csv", lines))


# -- CSV prices -----------------------------------------------------------------------------
@pytest.mark.parametrize("cell, message", [
    ("9223372036854775808", "out of range for int64"), ("-9223372036854775809", "out of range for int64"),
    ("99999999999999999999", "cannot parse"), ("4000.25", "cannot parse .*fixed-point"), ("nan", "cannot parse"),
])  # fmt: skip
def test_fixed_point_csv_prices(csv_lines, tmp_path, cell, message):
    lines = set_cell(csv_lines, 12, "bid_px_03", cell)
    with pytest.raises(DataError, match=rf"row 12, column bid_px_03: {message}"):
        read_records(write_csv(tmp_path / "p.csv", lines))


def test_one_decimal_cell_does_not_switch_the_parse_of_its_block(csv_lines, tmp_path):
    """A decimal in a fixed-point file was read as 'pretty' for the whole block (VWAP ~ -3e9)."""
    lines = set_cell(csv_lines, 3000, "price", "4000.250000000")
    for chunk in (None, 50_000):
        with pytest.raises(DataError, match="row 3000, column price: cannot parse .*fixed-point"):
            read_records(write_csv(tmp_path / "d.csv", lines), chunk_bytes=chunk)


@pytest.mark.parametrize("cell, message", [
    ("nan", "cannot parse"), ("inf", "cannot parse"), ("-inf", "cannot parse"), ("4000.1234567891", "cannot parse .*at most 9 decimal"),
    ("1e5", "cannot parse"), ("9223372037.000000000", "out of range for int64"), ("10000000000.5", "out of range for int64"),
    ("4000", "cannot parse"),
])  # fmt: skip
def test_pretty_csv_prices(market, tmp_path, cell, message):
    lines = csv_export(dbn_bytes(market), pretty=True).decode().splitlines()
    lines = set_cell(lines, 20, "ask_px_00", cell)
    with pytest.raises(DataError, match=rf"row 20, column ask_px_00: {message}"):
        read_records(write_csv(tmp_path / "p.csv", lines))


def test_pretty_prices_are_exact(market, tmp_path):
    lines = csv_export(dbn_bytes(market), pretty=True).decode().splitlines()
    got = read_records(write_csv(tmp_path / "p.csv", lines))
    np.testing.assert_array_equal(got["levels"], market["levels"])
    np.testing.assert_array_equal(got["price"], market["price"])


# -- CSV columns ----------------------------------------------------------------------------
def test_columns_are_found_by_name_in_any_order(csv_lines, market, tmp_path):
    header = csv_lines[0].split(",")
    order = list(reversed(range(len(header))))
    lines = [",".join(line.split(",")[i] for i in order) for line in csv_lines]
    assert not lines[0].startswith("ts_recv")
    got = read_records(write_csv(tmp_path / "r.csv", lines))
    assert got.tobytes() == read_records(write_csv(tmp_path / "o.csv", csv_lines)).tobytes()


@pytest.mark.parametrize("column", ["price", "size", "ask_ct_09", "ts_recv"])
def test_a_duplicated_column_name_is_an_error(csv_lines, tmp_path, column):
    header = csv_lines[0].split(",")
    victim = "bid_sz_05" if column != "bid_sz_05" else "bid_sz_06"
    header[header.index(victim)] = column
    with pytest.raises(DataError, match=f"column '{column}' appears more than once"):
        read_records(write_csv(tmp_path / "dup.csv", [",".join(header), *csv_lines[1:]]))


def test_error_lines_stay_short(csv_lines, tmp_path):
    lines = set_cell(csv_lines, 5, "size", "7" * 2_000_000)
    with pytest.raises(DataError) as err:
        read_records(write_csv(tmp_path / "long.csv", lines))
    text = str(err.value)
    assert "row 5, column size" in text and "2,000,000 characters" in text and len(text) < 400


def _big_bad_csv(path, csv_lines, kind):
    rows = csv_lines[1:]
    n = (18 << 20) // (sum(len(r) for r in rows[:50]) // 50) + 1
    body = [rows[k % len(rows)] for k in range(n)]
    if kind == "columns":
        body[10] = body[10] + ",1"
    data = ("\n".join([csv_lines[0], *body]) + "\n").encode()
    if kind == "utf8":
        cut = data.index(b"\n", 5000) + 3
        data = data[:cut] + b"\xff\xfe" + data[cut + 2 :]
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("kind", ["columns", "utf8"])
def test_a_bad_first_block_ends_with_the_error_not_a_signal(csv_lines, tmp_path, kind):
    """An invalid first 16 MB block once left a reader thread alive: SIGABRT after the error."""
    path = _big_bad_csv(tmp_path / f"{kind}.csv", csv_lines, kind)
    code = "from numbarl.cli import data_main; data_main()"
    for _ in range(3):  # the abort was intermittent
        proc = subprocess.run(
            [sys.executable, "-c", code, "build", str(path), "--out", str(tmp_path / "c")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, proc.stderr[-500:]
        assert len(lines) == 1 and lines[0].startswith("numbarl-data: error: ") and "row 11" in lines[0], lines
        assert not (tmp_path / "c").exists()


# -- what records say: counted and skipped --------------------------------------------------
def _book_state(recs, nth):
    return np.flatnonzero((recs["flags"] & F_LAST) != 0)[nth]


@pytest.mark.parametrize("field, value", [("bid_px", INT64_MIN), ("ask_px", 9 * 10**18), ("bid_px", 0), ("ask_sz", 2**32 - 1)])
def test_an_impossible_book_state_is_skipped_and_counted(market, field, value):
    recs = market.copy()
    k = _book_state(recs, 2000)
    recs["levels"][field][k, 0] = value
    counts = {}
    for bars in (build_bars(recs, EWMA), bars_ref(recs, EWMA, counts=counts)):
        assert np.all(bars["mid_low"] > 3000) and np.all(bars["mid_high"] < 5000)
        assert np.all(bars["bid_sz"] < 10**9) and np.all(bars["ask_sz"] < 10**9)
    assert counts["bad_book"] == 1
    clean = build_bars(market, EWMA)
    assert len(clean) > 50
    assert np.all(build_bars(recs, EWMA)["tick"][-10:] == 0.25)  # the tick estimate is not pulled off the grid


@pytest.mark.parametrize("price", [INT64_MIN, 0, UNDEF_PRICE, 4_000_000 * 10**9])
def test_an_impossible_trade_price_is_skipped_and_counted(market, price):
    recs = market.copy()
    trades = np.flatnonzero(recs["action"] == ACTION_TRADE)
    recs["price"][trades[300]] = price
    counts = {}
    got = build_bars(recs, EWMA)
    want = bars_ref(recs, EWMA, counts=counts)
    assert counts["bad_trade_price"] == 1 and len(got) == len(want)
    assert np.all(np.abs(got["vwap"] - got["mid_close"]) < 10)
    np.testing.assert_array_equal(got["close_index"], want["close_index"])


def test_an_off_grid_state_cannot_move_the_tick(market):
    recs = market.copy()
    k = _book_state(recs, 1500)
    recs["levels"]["bid_px"][k, 0] += 7  # 7e-9 off the 0.25 grid, still a book
    counts = {}
    bars = bars_ref(recs, EWMA, counts=counts)
    assert counts["off_grid"] == 1 and np.all(bars["tick"][5:] == 0.25)
    assert build_bars(recs, EWMA).tobytes() == build_bars(recs, EWMA).tobytes()
    np.testing.assert_array_equal(build_bars(recs, EWMA)["tick"], bars["tick"])
    # a known tick skips states off its grid too
    assert np.all(build_bars(market, EWMA, tick_size=0.5)["bid"] % 0.5 == 0)


def test_mid_of_zero_is_no_division_by_zero():
    bars = build_bars(synth.generate(sessions=2, seed=3, events_per_session=3000)[0], EWMA)
    bars["mid_close"][5] = 0.0
    bars["mid_close"][9] = -1.0
    features = compute_features(bars, tick_size=0.25)
    assert np.all(np.isfinite(features))


def test_prices_sit_exactly_on_the_tick_grid(market, tmp_path):
    """Prices were fixed point x 1e-9 (4000.25 -> 4000.2500000000005); now / 1e9: exact."""
    cache = load_cache(build_cache([write_dbn(tmp_path / "m.dbn", market)], tmp_path / "c", bar_params=EWMA))
    for name in ("bid", "ask", "mid", "high", "low"):
        values = np.asarray(getattr(cache, name))
        ticks = values / 0.125 if name in ("mid", "high", "low") else values / 0.25
        assert np.all(ticks == np.round(ticks)), name
    bars = np.asarray(cache.bars)
    assert np.all(cache.bid == bars["bid_px"] / 1e9)
    # the shortest decimal that reads back is the price itself: 4000.25, not 4000.2500000000005
    assert all(len(repr(float(x)).split(".")[1]) <= 2 for x in cache.bid)
    assert [float(x) for x in cache.ask[:50]] == [int(p) / 1e9 for p in bars["ask_px"][:50]]


def test_a_far_book_state_is_skipped_unless_the_next_ones_confirm_it(market):
    """A state far from the session's last good book (a whole book shifted by 500 points) is skipped;
    three such states in a row are a real move and the third is used."""
    states = np.flatnonzero((market["flags"] & F_LAST) != 0)
    shift = 500 * 10**9
    one = market.copy()
    lv = one["levels"][states[1000]]
    for name in ("bid_px", "ask_px"):
        lv[name] += shift
    counts = {}
    bars = bars_ref(one, EWMA, counts=counts)
    assert counts["off_book"] == 1 and np.all(bars["mid_high"] < 5000)
    np.testing.assert_array_equal(build_bars(one, EWMA)["close_index"], bars["close_index"])
    moved = market.copy()
    after = moved["ts_recv"] >= moved["ts_recv"][states[1000]]
    rows = np.flatnonzero(after)
    moved["levels"]["bid_px"][rows] += np.where(moved["levels"]["bid_px"][rows] != UNDEF_PRICE, shift, 0)
    moved["levels"]["ask_px"][rows] += np.where(moved["levels"]["ask_px"][rows] != UNDEF_PRICE, shift, 0)
    moved["price"][rows] += np.where(moved["price"][rows] != UNDEF_PRICE, shift, 0)
    counts = {}
    bars = bars_ref(moved, EWMA, counts=counts)
    assert counts["off_book"] == 2 and bars["mid_close"].max() > 4400
    assert build_bars(moved, EWMA).tobytes() == build_bars(moved, EWMA).tobytes()


def test_fixed_point_prices_stay_exact_beside_empty_cells(csv_lines, tmp_path):
    """An empty cell made the column's numbers float64 on their way to int64 (2^53 and up inexact)."""
    lines = set_cell(set_cell(csv_lines, 3, "bid_px_09", ""), 4, "bid_px_09", "9000000000000000001")
    got = read_records(write_csv(tmp_path / "e.csv", lines))
    assert got["levels"]["bid_px"][2, 9] == UNDEF_PRICE and got["levels"]["bid_px"][3, 9] == 9_000_000_000_000_000_001


@pytest.mark.parametrize("bad_price", [0.0, 1.0, -5000.0])
def test_an_absurd_opening_print_after_a_crossed_preopen_is_skipped(bad_price):
    """The session's first trade comes before its first good book (the pre-open books are crossed
    and skipped): it is checked against the latest book state, crossed ones included, and an
    absurd price is skipped and counted, never into a bar's VWAP (it used to pass: VWAP 1288)."""
    from data_markets import cme_like_records

    recs = cme_like_records(sessions=2, seed=7)
    trades = np.flatnonzero(recs["action"] == ACTION_TRADE)
    first = trades[0]
    good = bars_ref(recs, EWMA)
    recs = recs.copy()
    recs["price"][first] = int(round(bad_price * 1e9))
    for bars, counts in ((build_bars(recs, EWMA), None), (bars_ref(recs, EWMA, counts=(c := {})), c)):
        vwap = bars["vwap"][np.isfinite(bars["vwap"])]
        assert vwap.min() > 0.5 * np.median(vwap) and vwap.max() < 1.5 * np.median(vwap)
        if counts is not None:
            assert counts["bad_trade_price"] >= 1
    assert len(build_bars(recs, EWMA)) >= len(good) - 1


def test_a_trade_before_any_book_is_skipped_and_counted(market):
    recs = market.copy()
    first_book = np.flatnonzero(recs["flags"] & F_LAST)[0]
    trade = recs[np.flatnonzero(recs["action"] == ACTION_TRADE)[0]].copy()
    trade["ts_recv"] = recs["ts_recv"][first_book] - 1
    trade["price"] = 0  # nothing to check it against: skipped whatever its price
    recs = np.concatenate([recs[:first_book], [trade], recs[first_book:]])
    recs = recs[np.argsort(recs["ts_recv"], kind="stable")]
    counts = {}
    bars_ref(recs, EWMA, counts=counts)
    assert counts["trade_before_book"] == 1
    fast, ref = build_bars(recs, EWMA), bars_ref(recs, EWMA)
    assert len(fast) == len(ref) and np.array_equal(fast["close_ts"], ref["close_ts"])
    np.testing.assert_allclose(fast["vwap"], ref["vwap"], rtol=1e-12)
