"""A fixed-seed mutation fuzzer of the cache build: ``python fuzz_inputs.py WORKDIR [--cases N] [--seed S]``.

Base inputs: a synthetic DBN market (plain and zstd), a CME-like day with a pre-open of crossed
books, their Databento CSV exports (fixed-point and pretty), Databento's own tiny DBN test files,
a LOBSTER pair and a Binance capture (real samples, cut). Each case mutates one base (bytes
flipped, a record field set to a sentinel or extreme value, a CSV/LOBSTER cell replaced, a
header changed, lines cut, dropped, doubled or swapped, a JSON value replaced) and builds a
cache from it in this process. A case passes when the build either raises DataError with one
short line, or writes a cache in which every price lies in the base market's range (halved /
doubled), bid < ask, every size is at most validate.MAX_SIZE, timestamps are valid and sorted,
features are finite and the tick is the base's. Anything else (another exception) fails the run;
a signal or a hang kills the process, which the test running this script sees.

Prints one line per failing case and a last line ``fuzz: N cases, E errors, C caches, F failures``.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from data_markets import cme_like_records, csv_export  # noqa: E402

from numbarl.data import synth  # noqa: E402
from numbarl.data.bars import BarParams  # noqa: E402
from numbarl.data.errors import DataError  # noqa: E402
from numbarl.data.fxcache import build_cache, load_cache  # noqa: E402
from numbarl.data.readers import write_dbn  # noqa: E402
from numbarl.data.records import F_LAST, MBP10_DTYPE, RECORD_BYTES, UNDEF_PRICE  # noqa: E402
from numbarl.data.validate import MAX_SIZE, TS_MAX, TS_MIN  # noqa: E402

FIXTURES = HERE / "fixtures"
EWMA = BarParams(mode="ewma", ewma_initial_trades=20, ewma_min_trades=5, ewma_max_trades=200)
TARGET = BarParams(mode="target", bars_per_day=60)
INT_VALUES = [0, 1, -1, 2**31, 2**32 - 1, 2**63 - 1, -(2**63), 2**63, 2**64 - 1, 9 * 10**18, 10**17, 10**12]
CELLS = [
    "", "-1", "0", "nan", "inf", "-inf", "1e400", "1e5", "18446744073709551616", "9223372036854775808",
    "-9223372036854775809", "9223372036854775807", "4000.250000000", "4000.1234567891", "99999999999.5",
    "9999999999", "-9999999999", "x", "\u00e9", "7" * 50_000, "2.5", " 3", "0x10",
]  # fmt: skip


@dataclass
class Base:
    name: str
    kind: str  # dbn, csv, lobster, binance
    files: list[Path]
    params: BarParams
    price: tuple[float, float] = (np.inf, -np.inf)
    tick: float | None = None
    extra: dict = field(default_factory=dict)


def price_range(records) -> tuple[float, float]:
    states = records[(records["flags"] & F_LAST) != 0]["levels"][:, 0]
    ok = (states["bid_px"] != UNDEF_PRICE) & (states["ask_px"] != UNDEF_PRICE) & (states["bid_px"] < states["ask_px"])
    return float(states["bid_px"][ok].min()) / 1e9, float(states["ask_px"][ok].max()) / 1e9


def make_corpus(work: Path) -> list[Base]:
    work.mkdir(parents=True, exist_ok=True)
    bases = []
    market, _ = synth.generate(sessions=2, seed=21, events_per_session=1500)
    dbn_path = write_dbn(work / "synth.dbn", market, mappings={"SYNTH": 1})
    rng_ = price_range(market)
    bases.append(Base("synth.dbn", "dbn", [dbn_path], EWMA, rng_, 0.25))
    bases.append(Base("synth.dbn.zst", "dbn", [write_dbn(work / "synth.dbn.zst", market, mappings={"SYNTH": 1})], EWMA, rng_, 0.25))
    for pretty in (False, True):
        path = work / f"synth.{'pretty' if pretty else 'fixed'}.csv"
        path.write_bytes(csv_export(dbn_path.read_bytes(), pretty=pretty))
        bases.append(Base(path.name, "csv", [path], EWMA, rng_, 0.25))
    cme = cme_like_records(sessions=2, seed=5, events_per_session=1500)
    cme_path = write_dbn(work / "cme.dbn", cme, mappings={"ESH4": 1})
    bases.append(Base("cme.dbn", "dbn", [cme_path], TARGET, price_range(cme), 0.25))
    cme_csv = work / "cme.csv"
    cme_csv.write_bytes(csv_export(cme_path.read_bytes()))
    bases.append(Base("cme.csv", "csv", [cme_csv], EWMA, price_range(cme), 0.25))
    for path in sorted((FIXTURES / "dbn").glob("*.dbn*")):
        bases.append(Base(path.name, "dbn", [path], EWMA, (1e-9, 1e9), None))
    msg = FIXTURES / "lobster" / "AAPL_2012-06-21_34200000_57600000_message_10.csv"
    book = FIXTURES / "lobster" / "AAPL_2012-06-21_34200000_57600000_orderbook_10.csv"
    lob = work / "lobster"
    lob.mkdir(exist_ok=True)
    for src in (msg, book):
        (lob / src.name).write_text("\n".join(src.read_text().splitlines()[:500]) + "\n")
    lobster_params = BarParams(mode="ewma", ewma_initial_trades=10, ewma_min_trades=5, ewma_max_trades=50)
    bases.append(Base("lobster", "lobster", [lob / msg.name, lob / book.name], lobster_params, (580.0, 590.0), 0.01))
    lines = gzip.decompress((FIXTURES / "binance" / "btcusdt_20240808_head6k.gz").read_bytes()).splitlines()[:2500]
    cap = work / "binance.gz"
    cap.write_bytes(gzip.compress(b"\n".join(lines) + b"\n"))
    binance_params = BarParams(mode="ewma", ewma_initial_trades=20, ewma_min_trades=5, ewma_max_trades=200)
    bases.append(Base("binance", "binance", [cap], binance_params, (61_000.0, 62_500.0), 0.01))
    return bases


# ---------------------------------------------------------------------------------------------
# mutators: (rng, base, out folder) -> (description, files)
# ---------------------------------------------------------------------------------------------
def _raw(path: Path) -> tuple[bytes, str | None]:
    data = path.read_bytes()
    if data[:4] == b"\x28\xb5\x2f\xfd":
        import pyarrow as pa

        return pa.input_stream(str(path), compression="zstd").read(), "zstd"
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data), "gzip"
    return data, None


def _write(path: Path, data: bytes, codec: str | None) -> Path:
    if codec == "zstd":
        import pyarrow as pa

        with pa.CompressedOutputStream(str(path), "zstd") as out:
            out.write(data)
    elif codec == "gzip":
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def flip_bytes(rng, base, out):
    src = base.files[0]
    data, codec = _raw(src)
    if codec and rng.random() < 0.3:  # the compressed bytes themselves
        data, codec = bytearray(src.read_bytes()), None
    data = bytearray(data)
    k = int(rng.integers(1, 5))
    at = rng.integers(0, len(data), size=k)
    for i in at:
        data[i] = int(rng.integers(0, 256))
    return f"flip {k} bytes at {at.tolist()}", [_write(out / src.name, bytes(data), codec), *base.files[1:]]


def cut_or_grow(rng, base, out):
    src = base.files[0]
    data, codec = _raw(src)
    choice = rng.integers(0, 3)
    if choice == 0:
        at = int(rng.integers(1, len(data)))
        data, what = data[:at], f"cut at byte {at}"
    elif choice == 1:
        a = int(rng.integers(0, len(data) - 1))
        b = min(len(data), a + int(rng.integers(1, 2000)))
        at = int(rng.integers(0, len(data)))
        data, what = data[:at] + data[a:b] + data[at:], f"copy bytes {a}:{b} to {at}"
    else:
        junk = bytes(rng.integers(0, 256, size=int(rng.integers(1, 400)), dtype=np.uint8))
        data, what = data + junk, f"append {len(junk)} random bytes"
    return what, [_write(out / src.name, data, codec), *base.files[1:]]


def dbn_field(rng, base, out):
    src = base.files[0]
    data, codec = _raw(src)
    header = 8 + int.from_bytes(data[4:8], "little")
    n = (len(data) - header) // RECORD_BYTES
    recs = np.frombuffer(bytearray(data[header : header + n * RECORD_BYTES]), MBP10_DTYPE).copy()
    k = int(rng.integers(0, n))
    m = int(rng.integers(0, 10))
    name = str(rng.choice(["ts_recv", "price", "size", "action", "side", "flags", "instrument_id", "length", "rtype",
                           "bid_px", "ask_px", "bid_sz", "ask_sz", "bid_ct", "ask_ct", "swap", "ts_event"]))
    if name == "swap":
        j = int(rng.integers(0, n))
        recs[[k, j]] = recs[[j, k]]
        what = f"swap records {k} and {j}"
    else:
        value = int(rng.choice(INT_VALUES)) if rng.random() < 0.7 else None
        target = recs["levels"][name][k:k + 1, m] if name in ("bid_px", "ask_px", "bid_sz", "ask_sz", "bid_ct", "ask_ct") else recs[name][k:k + 1]
        if value is None:  # near the old value: off by a few units or ticks
            value = int(target[0]) + int(rng.choice([1, -1, 7, 250_000_000, -250_000_000, 2**32]))
        bits = target.dtype.itemsize * 8
        target[...] = np.array([value % (1 << bits)], np.uint64).astype(target.dtype.str.replace("i", "u"), casting="unsafe").view(target.dtype)
        what = f"record {k + 1} {name}{f'[{m}]' if name.endswith(('_px', '_sz', '_ct')) else ''} = {value}"
    payload = data[:header] + recs.tobytes() + data[header + n * RECORD_BYTES:]
    return what, [_write(out / src.name, payload, codec), *base.files[1:]]


def _lines_of(path):
    data, codec = _raw(path)
    return data.split(b"\n"), codec


def text_cell(rng, base, out):
    which = int(rng.integers(0, len(base.files)))
    src = base.files[which]
    lines, codec = _lines_of(src)
    body = [i for i, line in enumerate(lines) if line][1 if base.kind == "csv" else 0:]
    k = int(rng.choice(body))
    cells = lines[k].split(b",")
    c = int(rng.integers(0, len(cells)))
    cell = str(rng.choice(CELLS))
    cells[c] = cell.encode()
    lines[k] = b",".join(cells)
    files = list(base.files)
    files[which] = _write(out / src.name, b"\n".join(lines), codec)
    for i, f in enumerate(files):
        if i != which:
            files[i] = Path(shutil.copy(f, out / f.name))
    return f"{src.name} line {k + 1} cell {c + 1} = {cell[:20]!r}", files


def text_lines(rng, base, out):
    which = int(rng.integers(0, len(base.files)))
    src = base.files[which]
    lines, codec = _lines_of(src)
    first = 1 if base.kind == "csv" else 0
    k = int(rng.integers(first, max(first + 1, len(lines) - 1)))
    j = int(rng.integers(first, max(first + 1, len(lines) - 1)))
    op = int(rng.integers(0, 6))
    if op == 0:
        del lines[k]
        what = f"drop line {k + 1}"
    elif op == 1:
        lines.insert(k, lines[j])
        what = f"copy line {j + 1} to {k + 1}"
    elif op == 2:
        lines[k], lines[j] = lines[j], lines[k]
        what = f"swap lines {k + 1} and {j + 1}"
    elif op == 3:
        lines[k] = lines[k][: int(rng.integers(0, max(1, len(lines[k]))))]
        what = f"cut line {k + 1}"
    elif op == 4:
        lines.insert(k, b"")
        what = f"blank line at {k + 1}"
    else:
        lines[k] = lines[k][:5] + b"\xff\xfe" + lines[k][5:]
        what = f"invalid UTF-8 in line {k + 1}"
    files = list(base.files)
    files[which] = _write(out / src.name, b"\n".join(lines), codec)
    for i, f in enumerate(files):
        if i != which:
            files[i] = Path(shutil.copy(f, out / f.name))
    return what, files


def csv_header(rng, base, out):
    src = base.files[0]
    lines, codec = _lines_of(src)
    names = lines[0].split(b",")
    op = int(rng.integers(0, 3))
    if op == 0:
        a, b = rng.choice(len(names), size=2, replace=False)
        names[a] = names[b]
        what = f"column {int(a) + 1} renamed {names[b].decode()!r} (a duplicate)"
        lines[0] = b",".join(names)
    elif op == 1:
        order = rng.permutation(len(names))
        lines = [b",".join(line.split(b",")[i] for i in order) if line else line for line in lines]
        what = "columns reordered"
    else:
        c = int(rng.integers(0, len(names)))
        lines = [b",".join(x for i, x in enumerate(line.split(b",")) if i != c) if line else line for line in lines]
        what = f"column {names[c].decode()!r} dropped"
    return what, [_write(out / src.name, b"\n".join(lines), codec)]


def json_value(rng, base, out):
    src = base.files[0]
    lines, codec = _lines_of(src)
    k = int(rng.integers(0, len(lines) - 1))
    parts = lines[k].split(b'"')
    spots = [i for i in range(1, len(parts), 2)]
    if spots:
        i = int(rng.choice(spots))
        parts[i] = str(rng.choice(CELLS + ["99999999.00000000", "0.00000001", "1000000000.0", "1e3"])).encode()
        lines[k] = b'"'.join(parts)
    elif lines[k]:
        lines[k] = lines[k][::-1]
    return f"line {k + 1} value {i if spots else 'reversed'}", [_write(out / src.name, b"\n".join(lines), codec)]


MUTATORS = {
    "dbn": [flip_bytes, cut_or_grow, dbn_field, dbn_field, dbn_field],
    "csv": [flip_bytes, cut_or_grow, text_cell, text_cell, text_lines, csv_header],
    "lobster": [text_cell, text_cell, text_lines, flip_bytes],
    "binance": [json_value, json_value, text_lines, flip_bytes, cut_or_grow],
}


# ---------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------
def check_cache(path: Path, base: Base) -> list[str]:
    cache = load_cache(path)
    problems = []
    lo, hi = base.price
    for name in ("mid", "bid", "ask", "high", "low"):
        values = np.asarray(getattr(cache, name))
        if not np.all(np.isfinite(values)) or values.min() < lo / 2 or values.max() > hi * 2:
            problems.append(f"{name} outside [{lo / 2}, {hi * 2}]: {values.min()}..{values.max()}")
    bars = np.asarray(cache.bars)
    for name in ("vwap", "micro_close", "mid_open"):
        if not np.all(np.isfinite(bars[name])) or bars[name].min() < lo / 2 or bars[name].max() > hi * 2:
            problems.append(f"bars {name} outside the market: {bars[name].min()}..{bars[name].max()}")
    if not np.all(cache.bid < cache.ask):
        problems.append("a bar closes on a crossed or locked book")
    for name in ("bid_sz", "ask_sz", "bid_ct", "ask_ct"):
        if bars[name].max() > MAX_SIZE or bars[name].min() < 0:
            problems.append(f"bars {name} out of range: {bars[name].max()}")
    if np.any(bars["volume"] > bars["n_trades"] * float(MAX_SIZE)) or np.any(bars["volume"] < 0):
        problems.append("a bar's volume is beyond its trades' sizes")
    ts = np.asarray(cache.timestamps)
    if ts.min() < TS_MIN or ts.max() >= TS_MAX or np.any(np.diff(ts) < 0):
        problems.append(f"timestamps out of range or unsorted: {ts.min()}..{ts.max()}")
    if not np.all(np.isfinite(np.asarray(cache.features))):
        problems.append("features not finite")
    if base.tick is not None and cache.tick_size != base.tick:
        problems.append(f"tick size {cache.tick_size}, the market's is {base.tick}")
    return problems


def run(work: Path, cases: int, seed: int, budget_s: float) -> int:
    bases = make_corpus(work / "corpus")
    for base in bases:  # the unmutated inputs: what a case is compared with
        try:
            base.extra["clean"] = check_cache(build_cache(base.files, work / "clean" / base.name, bar_params=base.params,
                                                          warn=lambda m: None), base)
        except DataError as exc:
            base.extra["clean"] = str(exc)
        if isinstance(base.extra["clean"], list) and base.extra["clean"]:
            print(f"FAIL base {base.name}: {base.extra['clean']}")
            return 1
    rng = np.random.default_rng(seed)
    counts = {"error": 0, "cache": 0, "fail": 0}
    log = open(work / "cases.log", "w", buffering=1)
    started = time.monotonic()
    done = 0
    for case in range(cases):
        if time.monotonic() - started > budget_s:
            break
        base = bases[int(rng.integers(0, len(bases)))]
        mutate = MUTATORS[base.kind][int(rng.integers(0, len(MUTATORS[base.kind])))]
        folder = work / "cases" / f"{case:04d}"
        folder.mkdir(parents=True)
        try:
            what, files = mutate(rng, base, folder)
        except (IndexError, ValueError) as exc:  # a mutation that does not apply to this base
            shutil.rmtree(folder)
            log.write(f"{case} {base.name} skipped ({exc})\n")
            continue
        log.write(f"{case} {base.name} {mutate.__name__}: {what}\n")
        out = folder / "cache"
        try:
            build_cache(files, out, bar_params=base.params, warn=lambda m: None)
        except DataError as exc:
            text = str(exc)
            if "\n" in text or len(text) > 800:
                counts["fail"] += 1
                print(f"FAIL case {case} ({base.name}, {what}): error message of {len(text)} characters / several lines")
            else:
                counts["error"] += 1
        except Exception:  # noqa: BLE001 - any other exception is what the fuzzer looks for
            counts["fail"] += 1
            print(f"FAIL case {case} ({base.name}, {mutate.__name__}: {what}):\n{traceback.format_exc()}")
        else:
            problems = check_cache(out, base)
            counts["cache"] += 1
            if problems:
                counts["fail"] += 1
                print(f"FAIL case {case} ({base.name}, {mutate.__name__}: {what}): {'; '.join(problems)}")
        done += 1
        shutil.rmtree(folder, ignore_errors=True)
    print(f"fuzz: {done} cases, {counts['error']} errors, {counts['cache']} caches, {counts['fail']} failures "
          f"in {time.monotonic() - started:.1f} s")
    return 1 if counts["fail"] else 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--cases", type=int, default=400)
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--budget", type=float, default=45.0, help="stop starting cases after this many seconds")
    args = parser.parse_args(argv)
    sys.exit(run(args.work, args.cases, args.seed, args.budget))


if __name__ == "__main__":
    main()
