"""On-policy rollout math on the device: GAE(λ), advantage normalization, the minibatch permutation.

GAE (Schulman, Moritz, Levine, Jordan & Abbeel 2016, Eq. 16) over a rollout of T steps of N envs,
stored [T, N] (step t of env i at [t, i]), with V_T the value of the state after the rollout::

    δ_t = r_t + γ (1 − done_t) V_{t+1} − V_t
    A_t = δ_t + γ λ (1 − done_t) A_{t+1}          A_T = 0, V_T = bootstrap value
    R_t = A_t + V_t                                the value target

``gae_kernel``: one thread per env, a reverse scan over t in float64 (fixed order: the same bits
every run); stores float32.

Advantage normalization over the whole rollout (``AdvantageNormalizer``): mean and the population
variance by two fixed-order flat reductions (numbarl.cuda.reduce.Reducer: mean, then the mean of
the squared deviations), then A ← (A − mean) / (sqrt(var) + 1e-8). Four launches, no atomics.

The minibatch permutation (``permutation_kernel``): a keyed bijection of [0, n) computed per index,
no sort. A balanced 4-round Feistel network on 2h bits (2^(2h) >= n, h >= 1; round function
F(R, k_r) = mix64(R ^ k_r) mod 2^h, numbarl.cuda.rng's SplitMix64 finalizer) is a bijection of
[0, 2^(2h)); cycle walking (apply it again while the result is >= n; Black & Rogaway 2002) restricts
it to a bijection of [0, n) (the walk from an index < n stays on its cycle, which returns below n;
2^(2h) < 4n, so at most a few steps on average). Round key r = draw_u64(seed, lane r, counter,
SLOT_PERMUTATION) with counter = update · K + epoch: one fresh permutation per epoch, the same in
every run. ``permutation_ref`` is the same function on the host.

``gather_minibatch_kernel`` copies rows perm[m·B : (m+1)·B] of the flattened [T·N] rollout into the
minibatch buffers (one thread per row).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from numbarl.cuda import rng
from numbarl.cuda.launch import blocks
from numbarl.cuda.reduce import Reducer
from numbarl.cuda.registry import RNG_STREAMS
from numbarl.cuda.runtime import cuda

_cuda = cuda()

BLOCK = 128
SLOT_PERMUTATION = RNG_STREAMS.claim("ppo.permutation", 224)  # lane r: Feistel round key r
FEISTEL_ROUNDS = 4
NORM_EPS = 1e-8


def grid(n: int) -> tuple[int, int]:
    """(blocks, threads) of a one-thread-per-item launch (small blocks for small n: the simulator)."""
    threads = max(1, min(BLOCK, int(n)))
    return blocks(n, threads), threads


# ---------------------------------------------------------------------------------------------
# references (numpy, float64)
# ---------------------------------------------------------------------------------------------
def gae_ref(reward, done, value, boot_value, gamma: float, lam: float):
    """(advantages, returns) [T, N] in float64 (module docstring)."""
    r = np.asarray(reward, np.float64)
    d = np.asarray(done, np.float64)
    v = np.asarray(value, np.float64)
    T = r.shape[0]
    adv = np.zeros_like(r)
    next_v = np.asarray(boot_value, np.float64).reshape(-1)
    last = np.zeros(r.shape[1])
    for t in range(T - 1, -1, -1):
        nonterminal = 1.0 - d[t]
        delta = r[t] + gamma * nonterminal * next_v - v[t]
        last = delta + gamma * lam * nonterminal * last
        adv[t] = last
        next_v = v[t]
    return adv, adv + v


def normalize_ref(adv):
    a = np.asarray(adv, np.float64)
    return (a - a.mean()) / (a.std() + NORM_EPS)


def half_bits(n: int) -> int:
    """h of the Feistel network on 2h bits for [0, n): the least h >= 1 with 4^h >= n."""
    h = 1
    while (1 << (2 * h)) < n:
        h += 1
    return h


def permutation_ref(n: int, seed: int, counter: int) -> np.ndarray:
    """The permutation of [0, n) that permutation_kernel writes (host, same integer math)."""
    return _permutation_loop(np.int64(n), np.uint64(seed), np.int64(counter), np.int64(half_bits(n)))


# ---------------------------------------------------------------------------------------------
# device functions
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def feistel_index(i, n, seed, counter, h):
    """The image of i (< n) under the cycle-walked keyed Feistel bijection of [0, n)."""
    mask = (np.uint64(1) << np.uint64(h)) - np.uint64(1)
    x = np.uint64(i)
    while True:
        left = x >> np.uint64(h)
        right = x & mask
        for r in range(FEISTEL_ROUNDS):
            k = rng.draw_u64(seed, r, counter, SLOT_PERMUTATION)
            f = rng.mix64(right ^ k) & mask
            left, right = right, left ^ f
        x = (left << np.uint64(h)) | right
        if x < np.uint64(n):
            return np.int64(x)


@njit(cache=True)
def _permutation_loop(n, seed, counter, h):
    out = np.empty(n, np.int64)
    for i in range(n):
        out[i] = feistel_index(i, n, seed, counter, h)
    return out


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def gae_kernel(reward, done, value, boot_value, gamma, lam, adv, ret):
    """One thread per env i: the reverse scan of the module docstring (float64, fixed order).
    reward, value, adv, ret float32 [T, N]; done uint8 [T, N]; boot_value float32 [N, 1]."""
    i = _cuda.grid(1)
    if i >= reward.shape[1]:
        return
    T = reward.shape[0]
    next_v = np.float64(boot_value[i, 0])
    last = np.float64(0.0)
    for s in range(T):
        t = T - 1 - s
        nonterminal = np.float64(1.0) - np.float64(done[t, i])
        v = np.float64(value[t, i])
        delta = np.float64(reward[t, i]) + gamma * nonterminal * next_v - v
        last = delta + gamma * lam * nonterminal * last
        adv[t, i] = np.float32(last)
        ret[t, i] = np.float32(last + v)
        next_v = v


@_cuda.jit(cache=True)
def _centered_square_kernel(x, scal, out):
    i = _cuda.grid(1)
    if i < x.size:
        d = x[i] - scal[0]
        out[i] = d * d


@_cuda.jit(cache=True)
def _normalize_kernel(x, scal, eps):
    """x ← (x − mean) / (sqrt(var) + eps); scal = (mean, var, std)."""
    i = _cuda.grid(1)
    if i < x.size:
        std = math.sqrt(scal[1])
        if i == 0:
            scal[2] = np.float32(std)
        x[i] = np.float32((x[i] - scal[0]) / (std + eps))


class AdvantageNormalizer:
    """A ← (A − mean) / (std + 1e-8) over a flat float32 vector of n values (module docstring);
    scal float32 [3] keeps (mean, var, std) of the last call. Owns its scratch: allocate before capture."""

    def __init__(self, n: int):
        self.n = int(n)
        self.reducer = Reducer(self.n)
        self.tmp = _cuda.device_array(self.n, np.float32)
        self.scal = _cuda.device_array(3, np.float32)

    def run(self, x, stream) -> None:
        flat = x.reshape(self.n)
        g, b = grid(self.n)
        self.reducer.mean(flat, self.scal, stream, at=0)
        _centered_square_kernel[g, b, stream](flat, self.scal, self.tmp)
        self.reducer.mean(self.tmp, self.scal, stream, at=1)
        _normalize_kernel[g, b, stream](flat, self.scal, np.float32(NORM_EPS))


@_cuda.jit(cache=True)
def permutation_kernel(seed, updates, n_epochs, epoch, h, perm):
    """perm[i] = feistel_index(i) keyed by counter = updates[0] · n_epochs + epoch."""
    i = _cuda.grid(1)
    n = perm.shape[0]
    if i >= n:
        return
    counter = updates[0] * n_epochs + epoch
    perm[i] = feistel_index(i, n, seed, counter, h)


def permutation(perm, seed: int, updates, n_epochs: int, epoch: int, stream) -> None:
    """Enqueue the epoch's permutation of [0, perm.size) into perm (int64, device; capturable)."""
    n = int(perm.shape[0])
    permutation_kernel[grid(n) + (stream,)](np.uint64(seed), updates, np.int64(n_epochs),
                                                        np.int64(epoch), np.int64(half_bits(n)), perm)


@_cuda.jit(cache=True)
def gather_minibatch_kernel(perm, start, obs, actions, logp, adv, ret, mask,
                            mb_obs, mb_actions, mb_logp, mb_adv, mb_ret, mb_mask):
    """Row j of the minibatch = row perm[start + j] of the flattened rollout ([T·N, ...] views)."""
    j = _cuda.grid(1)
    if j >= mb_obs.shape[0]:
        return
    r = perm[start + j]
    for c in range(obs.shape[1]):
        mb_obs[j, c] = obs[r, c]
    for k in range(actions.shape[1]):
        mb_actions[j, k] = actions[r, k]
        for a in range(mask.shape[2]):
            mb_mask[j, k, a] = mask[r, k, a]
    mb_logp[j] = logp[r]
    mb_adv[j] = adv[r]
    mb_ret[j] = ret[r]
