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
def rng(request):
    """Random inputs, reproducible. By default the seed comes from the test's id: the same inputs
    on every run, so a CI run cannot fail by the luck of a draw. NUMBARL_TEST_SEED=random draws
    fresh seeds (a sweep for rare cases: run it after changing a test or the code under it), and
    NUMBARL_TEST_SEED=<n> replays the seed a failure printed."""
    import os
    import zlib

    choice = os.environ.get("NUMBARL_TEST_SEED", "")
    if choice == "random":
        seed = int(np.random.SeedSequence().entropy % (2**32))
    elif choice:
        seed = int(choice)
    else:
        seed = zlib.crc32(request.node.nodeid.encode("utf-8"))
    print(f"numpy seed {seed}")
    return np.random.default_rng(seed)
