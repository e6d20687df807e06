#!/usr/bin/env python
"""Benchmark of the market-data pipeline on one CPU core (checks before it times).

Measures, on a synthetic multi-million-record MBP-10 stream (numbarl.data.synth):
  1. bars + features: BarBuilder over record chunks (as when streaming a file) followed by the
     default 64 features, excluding decode -- records per second;
  2. decode: numbarl.data.readers.DbnReader over the same records written as .dbn and .dbn.zst
     (zstd stream, metadata by databento_dbn, records as numpy views) -- records per second.
Before timing it checks that the streamed bars equal one-shot bars and that decoding returns the
written records byte for byte.

    python bin/bench_data.py                     # ~6.2M records (about 2.3 GB of memory)
    python bin/bench_data.py --events 200000     # smaller

Rates are given against wall time and against the process's CPU time (the same on an idle
machine; on a shared machine the CPU-time rate is what one core does). The synthetic stream has
~165 records per bar at 7,500 bars/day; real ES MBP-10 days have several times more records per
bar, so per-bar feature work weighs less there than here.
    python bin/bench_data.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from numbarl.data import synth
from numbarl.data.bars import BarBuilder, BarParams, build_bars
from numbarl.data.features import compute_features
from numbarl.data.readers import DbnReader, write_dbn

CHUNK_RECORDS = 180_000  # what a 64 MiB decode chunk holds


def bars_and_features(records, params):
    builder = BarBuilder(params)
    parts = [builder.push(records[i : i + CHUNK_RECORDS]) for i in range(0, len(records), CHUNK_RECORDS)]
    bars = np.concatenate([p for p in parts if len(p)])
    features = compute_features(bars, tick_size=synth.TICK_SIZE)
    return bars, features


def best_of(fn, repeats):
    """(best wall seconds, best CPU seconds, result) over ``repeats`` runs."""
    walls, cpus = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - start_cpu)
    return min(walls), min(cpus), result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=5)
    parser.add_argument("--events", type=int, default=1_000_000, help="events per session")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    # one core: numba loops are single-threaded; keep BLAS/numpy helpers from spreading out
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    warm, _ = synth.generate(sessions=3, seed=1, events_per_session=60_000)
    records, _ = synth.generate(sessions=args.sessions, seed=0, events_per_session=args.events)
    n = len(records)
    results = {"records": n, "record_bytes": int(records.nbytes), "sessions": args.sessions}

    # CHECK, then TIME: bars + features (excluding decode)
    ewma = BarParams(mode="ewma", ewma_initial_trades=100, ewma_min_trades=50, ewma_max_trades=200)  # ~7,400 bars/day
    for mode, params in (("target", BarParams(mode="target", bars_per_day=7500)), ("ewma", ewma)):
        bars, features = bars_and_features(warm, params)  # warm-up (compile/load), then check
        assert len(bars) and bars.tobytes() == build_bars(warm, params).tobytes()
        seconds, cpu, (bars, features) = best_of(lambda: bars_and_features(records, params), args.repeats)
        assert np.isfinite(features).all()
        results[f"bars_features_{mode}"] = {
            "seconds": seconds, "records_per_s": n / seconds, "cpu_seconds": cpu, "records_per_cpu_s": n / cpu,
            "bars": len(bars),
            "bars_per_day": len(bars) / max(len(np.unique(bars["trade_date"])), 1),
        }  # fmt: skip

    # CHECK, then TIME: decode
    with tempfile.TemporaryDirectory() as tmp:
        for suffix in (".dbn", ".dbn.zst"):
            path = write_dbn(Path(tmp) / f"bench{suffix}", records)

            def decode():
                return sum(len(chunk) for chunk in DbnReader(path))

            first = np.concatenate(list(DbnReader(path)))
            assert first.tobytes() == records.tobytes()
            del first
            seconds, cpu, count = best_of(decode, args.repeats)
            assert count == n
            results[f"decode{suffix.replace('.', '_')}"] = {
                "seconds": seconds, "records_per_s": n / seconds, "cpu_seconds": cpu, "records_per_cpu_s": n / cpu,
                "file_bytes": path.stat().st_size,
            }  # fmt: skip

    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"{n:,} MBP-10 records ({records.nbytes / 2**30:.2f} GiB), {args.sessions} sessions, best of {args.repeats}")
    for key, row in results.items():
        if isinstance(row, dict):
            extra = f"  {row['bars']:,} bars" if "bars" in row else f"  file {row['file_bytes'] / 2**20:.0f} MiB"
            print(
                f"  {key:24s} {row['records_per_s'] / 1e6:6.2f} M records/s wall ({row['seconds']:.3f} s), "
                f"{row['records_per_cpu_s'] / 1e6:6.2f} M records/s CPU{extra}"
            )


if __name__ == "__main__":
    main()
