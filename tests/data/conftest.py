"""Shared fixtures of the data tests: Databento's test files and a small synthetic market."""

from pathlib import Path

import pytest

from numbarl.data import synth

DATA = Path(__file__).parent / "fixtures"  # real samples, copied with their sources (SOURCES.md)
FIXTURES = DATA / "dbn"
LOBSTER_MESSAGE = DATA / "lobster" / "AAPL_2012-06-21_34200000_57600000_message_10.csv"
LOBSTER_BOOK = DATA / "lobster" / "AAPL_2012-06-21_34200000_57600000_orderbook_10.csv"
BINANCE = DATA / "binance" / "btcusdt_20240808_head6k.gz"


@pytest.fixture(scope="session")
def dbn_fixtures() -> list[Path]:
    files = sorted(FIXTURES.glob("*.dbn*"))
    assert files, f"Databento test files missing from {FIXTURES}"
    return files


@pytest.fixture(scope="session")
def small_market():
    """Four sessions of the synthetic market (the first one calibrates target-mode bars)."""
    records, oracle = synth.generate(sessions=4, seed=11, events_per_session=6_000)
    return records, oracle


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    out = tmp_path_factory.mktemp("caches") / "tiny"
    synth.build_synthetic_cache(out, seed=5, **synth.TINY)
    return out
