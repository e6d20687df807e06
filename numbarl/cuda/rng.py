"""Counter-based random numbers keyed by (seed, lane, counter).

Every draw is a pure function of its key: ``x = mix(seed, lane, counter)`` with the SplitMix64
finalizer (Steele, Lea & Flood 2014, "Fast splittable pseudorandom number generators") applied to
a Weyl-sequence combination of the key. There is no state to carry between threads, so a kernel
thread draws with ``(seed, its lane, step counter)``, and the step counter lives in device memory
(``counter[0]``) and is advanced by :func:`advance` inside the captured graph: each replay draws
fresh numbers and two runs with the same seed draw the same numbers.

The scalar functions are numba ``@njit`` functions: the same compiled math runs in host
references (CPU env, tests) and inside CUDA kernels (numba-cuda compiles ``@jit`` functions for
the device when a kernel calls them), so host and device draw bit-identical integers.

Convention for callers: one logical draw per (lane, counter, slot); slots separate independent
draws of the same step (``slot`` 0..255), e.g. exploration coin = slot 0, random action = slot 1.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from numbarl.cuda.runtime import cuda

# SplitMix64 / Weyl constants
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_LANE = np.uint64(0xD1B54A32D192ED03)
_SLOT = np.uint64(0xAEF17502108EF2D9)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S40 = np.uint64(40)
_S32 = np.uint64(32)
_INV24 = np.float32(1.0 / 16777216.0)
_TWO_PI = np.float32(2.0 * math.pi)
_MINUS_TWO = np.float32(-2.0)
_HALF = np.float32(0.5)


# ---------------------------------------------------------------------------------------------
# scalar math (host and device)
# ---------------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def mix64(z):
    """SplitMix64 finalizer (bijective avalanche on uint64)."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(cache=True)
def draw_u64(seed, lane, counter, slot):
    """64 random bits for key (seed, lane, counter, slot); all arguments are integers >= 0."""
    k = mix64(np.uint64(seed) * _GOLDEN + np.uint64(lane) * _LANE)
    k = mix64(k ^ (np.uint64(counter) * _GOLDEN + np.uint64(slot) * _SLOT))
    return mix64(k + _GOLDEN)


@njit(cache=True)
def uniform(seed, lane, counter, slot):
    """float32 uniform in [0, 1) with 24 random bits (exactly representable)."""
    return np.float32(draw_u64(seed, lane, counter, slot) >> _S40) * _INV24


@njit(cache=True)
def randint(seed, lane, counter, slot, n):
    """Integer in [0, n) (n >= 1) by multiply-shift (Lemire 2019); bias < n / 2**32."""
    hi = draw_u64(seed, lane, counter, slot) >> _S32
    return np.int64((hi * np.uint64(n)) >> _S32)


@njit(cache=True)
def normal(seed, lane, counter, slot):
    """Standard normal float32 by Box-Muller from slots (2*slot, 2*slot+1)."""
    u1 = uniform(seed, lane, counter, np.uint64(2) * np.uint64(slot))
    u2 = uniform(seed, lane, counter, np.uint64(2) * np.uint64(slot) + np.uint64(1))
    u1 = np.float32(1.0) - u1  # (0, 1]: log is finite
    r = math.sqrt(_MINUS_TWO * math.log(u1))
    return np.float32(r * math.cos(_TWO_PI * u2))


# ---------------------------------------------------------------------------------------------
# reference (numpy, vectorised over lanes; used by tests)
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def uniform_ref(seed, counter, slot, n):
    out = np.empty(n, np.float32)
    for i in range(n):
        out[i] = uniform(seed, i, counter, slot)
    return out


@njit(cache=True)
def normal_ref(seed, counter, slot, n):
    out = np.empty(n, np.float32)
    for i in range(n):
        out[i] = normal(seed, i, counter, slot)
    return out


@njit(cache=True)
def randint_ref(seed, counter, slot, n, high):
    out = np.empty(n, np.int64)
    for i in range(n):
        out[i] = randint(seed, i, counter, slot, high)
    return out


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
_cuda = cuda()


@_cuda.jit(cache=True)
def advance_kernel(counter, k):
    if _cuda.grid(1) == 0:
        counter[0] += k


def advance(counter, stream, k=1):
    """counter[0] += k on the device (int64 counter array of length >= 1)."""
    advance_kernel[1, 1, stream](counter, np.int64(k))
