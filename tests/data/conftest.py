"""Shared fixtures of the data tests: Databento's test files and a small synthetic market."""

from pathlib import Path

import pytest

from numbarl.data import synth

FIXTURES = Path(__file__).parents[2].parent / "shared" / "data" / "dbn"


@pytest.fixture(scope="session")
def dbn_fixtures() -> list[Path]:
    files = sorted(FIXTURES.glob("*.dbn*")) if FIXTURES.is_dir() else []
    if not files:
        pytest.skip(f"Databento test files not found in {FIXTURES} (shared/ must sit beside the clone)")
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
