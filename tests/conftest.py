"""Test setup: the simulator switches itself on when there is no GPU (no env variable needed)."""

import numpy as np
import pytest

from numbarl.cuda import backend

SIMULATOR = backend.select()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a real CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and SIMULATOR:
            item.add_marker(skip_gpu)


@pytest.fixture
def rng():
    """Fresh random inputs every run; the seed is printed on failure, and NUMBARL_TEST_SEED=<seed>
    replays it."""
    import os

    seed = int(os.environ.get("NUMBARL_TEST_SEED") or np.random.SeedSequence().entropy % (2**32))
    print(f"numpy seed {seed}")
    return np.random.default_rng(seed)
