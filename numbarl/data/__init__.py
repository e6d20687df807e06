"""Host-side market data: readers, bars, features, fxcache, synthetic market, splits (SPEC §3).

    readers.py   the entry point: format detection, RecordStream (inputs in time order, one instrument)
    dbn.py       Databento MBP-10 DBN (v1-v3, zstd), streamed in chunks -> MBP10_DTYPE
    databento_csv.py  Databento's CSV export (any column order, one parse rule per file)
    lobster.py   LOBSTER message + order-book CSV pairs
    binance.py   Binance websocket captures (depth diffs, book ticker, trades) -> a 10-level book
    writer.py    write_dbn: records -> DBN file (synthetic market, tests)
    sources.py   decompressed bytes and lines of a file, SourceInfo, sha256, short error echoes
    validate.py  what a record may say: sentinel/out-of-range values, book structure, causal tick
    records.py   the MBP-10 record layout and flags
    calendar.py  exchange sessions (default CME Globex 17:00 America/Chicago)
    bars.py      imbalance bars (target / ewma thresholds) with 10-level OFI; pure-Python reference
                 (crossed books outside the session, invalid states and trades: skipped, counted)
    features.py  named causal features, default 64, rolling normalization
    fxcache.py   build_cache / write_cache / load_cache: the on-disk dataset everything trains on
    synth.py     synthetic MBP-10 market with a planted order-flow signal and an oracle
    splits.py    walk-forward folds in whole sessions with an embargo
    commands.py  the numbarl-data command
    errors.py    DataError: every bad input
"""
