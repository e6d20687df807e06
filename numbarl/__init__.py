"""numbarl: deep RL trading agents on limit-order-book data, the whole loop on one GPU.

Importing numbarl does not import numba.cuda: call `numbarl.cuda.backend.select()` (the CLI and
tests/conftest.py do) before the first kernel so that the CUDA simulator can be switched on when
no GPU is present.
"""

__version__ = "0.1.0"
