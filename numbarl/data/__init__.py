"""Host-side market data: readers, bars, features, fxcache, synthetic market, splits (SPEC §3).

    readers.py   Databento MBP-10 DBN (v1-v3, zstd) and CSV, streamed in chunks -> MBP10_DTYPE
    records.py   the MBP-10 record layout and flags
    calendar.py  exchange sessions (default CME Globex 17:00 America/Chicago)
    bars.py      imbalance bars (target / ewma thresholds) with 10-level OFI; pure-Python reference
    features.py  named causal features, default 64, rolling normalization
    fxcache.py   build_cache / write_cache / load_cache: the on-disk dataset everything trains on
    synth.py     synthetic MBP-10 market with a planted order-flow signal and an oracle
    splits.py    walk-forward folds in whole sessions with an embargo
    commands.py  the numbarl-data command
    errors.py    DataError: every bad input
"""
