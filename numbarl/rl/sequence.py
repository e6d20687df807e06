"""Sequence replay: the K observations up to a sampled transition, read from the replay's ring.

A temporal module (a scan over the last K bars, numbarl/rl/nets/mamba.py) needs, for every batch row
b drawn by ``Replay.sample`` (slot τ, env e: ``index[b] = τ mod n_slots · N + e``), the
observations of rows τ−K+1 .. τ of env e's column, oldest first. The ring already stores every env's
history as one column (numbarl/rl/replay.py), so a sequence is K rows of that column: nothing is
copied K times at write time, the gather reads them per batch.

Validity (``valid[b, j]``, j = 0..K−1, j = K−1 is τ itself), with c = count and the oldest stored
time τ_lo = max(0, c − n_slots)::

    row j (time t = τ − (K − 1 − j)) is valid  iff  t ≥ τ_lo  and  done[t'] = 0 for t ≤ t' < τ

i.e. it is still in the ring (not overwritten by a newer write, not before the first write) and
belongs to τ's episode (a done at t' ends the episode, the env's row t' + 1 is a new episode's
first observation). The invalid rows are therefore always a prefix; they get zeros, and the scan
restarts its state after them. An empty batch row (index −1) is all invalid. The absolute time of
slot s is the unique t ≡ s (mod n_slots) in [τ_lo, c).

The same gather serves the target side with ``next_index`` (the sequence ending at the n-step
window's next observation).

Two launches: one thread per (b, j) computes valid (a walk of at most K−1 done flags), then one
thread row per (b, j) with lanes over the features copies the row (coalesced) or writes zeros.
``sequence_gather_ref`` is the numpy model; the kernels compute the same values exactly (copies).
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda import launch
from numbarl.cuda.runtime import cuda

_cuda = cuda()

BLOCK = 128
ROW_THREADS = launch.shape(gpu=256, sim=16)  # threads per block of the row copy (a thread row per (b, j))

_ZERO = np.float32(0.0)


@_cuda.jit(cache=True)
def sequence_valid_kernel(done_store, count, count_offset, index, valid):
    """valid [B, K] uint8 or float32 (module docstring); one thread per (b, j). count_offset: added to the
    device count (1: the row the current step's gather has written, before the count advances)."""
    i = _cuda.grid(1)
    n_seq = valid.shape[1]
    if i >= valid.shape[0] * n_seq:
        return
    b = i // n_seq
    j = i - b * n_seq
    k0 = index[b]
    if k0 < 0:
        valid[b, j] = 0
        return
    n_slots = done_store.shape[0]
    n_envs = done_store.shape[1]
    c = count[0] + count_offset
    lo = max(c - n_slots, 0)
    s = k0 // n_envs
    e = k0 - s * n_envs
    tau = lo + (s - lo % n_slots + n_slots) % n_slots
    back = n_seq - 1 - j  # rows before τ
    ok = tau - back >= lo
    t = tau - 1
    while ok and t >= tau - back:
        if done_store[t % n_slots, e] != 0:
            ok = False
        t -= 1
    valid[b, j] = 1 if ok else 0


@_cuda.jit(cache=True)
def sequence_rows_kernel(obs_rows, n_envs, n_slots, index, valid, out):
    """out [B·K, dim] (a flat view of [B, K, dim]): row (b, j) ← obs of slot τ − (K − 1 − j), env e,
    or zeros when invalid. Block (lanes, rows) of launch.row_block: thread row = (b, j)."""
    r = _cuda.blockIdx.x * _cuda.blockDim.y + _cuda.threadIdx.y
    n_seq = valid.shape[1]
    if r >= out.shape[0]:
        return
    b = r // n_seq
    j = r - b * n_seq
    dim = out.shape[1]
    src = -1
    if valid[b, j] != 0:
        k0 = index[b]
        s = k0 // n_envs
        e = k0 - s * n_envs
        src = ((s - (n_seq - 1 - j)) % n_slots + n_slots) % n_slots * n_envs + e
    d = _cuda.threadIdx.x
    while d < dim:
        out[r, d] = _ZERO if src < 0 else obs_rows[src, d]
        d += _cuda.blockDim.x


def gather_sequences(replay, index, out, valid, stream, count_offset: int = 0) -> None:
    """The sequences ending at the batch rows `index` (device int64 [B], e.g. ``replay.batch.index``
    or ``.next_index``) into out float32 [B, K, state_dim] and valid [B, K] (K = out.shape[1]), uint8,
    or float32 (1.0 / 0.0: the scan's mask, numbarl/cuda/kernels/ssm.py). Only launches: capturable
    (reads the replay's device count).

    count_offset=1 (acting): the replay's row count % n_slots already holds this step's observation
    (the env's gather wrote it through ``Replay.obs_ring``) but the count advances only after the
    step's write; the window ending at that row then reads the ring as if the count were one more
    (its done flag, not yet written, is never read: only rows before τ are checked)."""
    s = replay.store
    obs, done = s["obs"], s["done"]
    n_slots, n_envs, dim = obs.shape
    B, K = valid.shape
    if tuple(out.shape) != (B, K, dim) or np.dtype(out.dtype) != np.float32:
        raise ValueError(f"gather_sequences: out must be float32 [{B}, {K}, {dim}], got {np.dtype(out.dtype)} "
                         f"{list(out.shape)}")
    if (np.dtype(valid.dtype) not in (np.uint8, np.float32) or tuple(index.shape) != (B,)
            or np.dtype(index.dtype) != np.int64):
        raise ValueError(f"gather_sequences: valid must be uint8 or float32 [B, K] and index int64 [B]; got valid "
                         f"{np.dtype(valid.dtype)} {list(valid.shape)}, index {np.dtype(index.dtype)} {list(index.shape)}")
    if not 1 <= K <= n_slots:
        raise ValueError(f"gather_sequences: sequence length K = {K} must be in [1, n_slots = {n_slots}]")
    if count_offset not in (0, 1):
        raise ValueError(f"gather_sequences: count_offset must be 0 or 1 (got {count_offset})")
    sequence_valid_kernel[launch.blocks(B * K, BLOCK), BLOCK, stream](done, s["count"], np.int64(count_offset),
                                                                      index, valid)
    grid, block = launch.row_block(B * K, dim, ROW_THREADS)
    sequence_rows_kernel[grid, block, stream](obs.reshape(n_slots * n_envs, dim), np.int64(n_envs),
                                              np.int64(n_slots), index, valid, out.reshape(B * K, dim))


def sequence_gather_ref(obs_store, done_store, count: int, index, K: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy model of `gather_sequences`: (out [B, K, dim] float32, valid [B, K] uint8)."""
    obs_store, done_store = np.asarray(obs_store), np.asarray(done_store)
    n_slots, n_envs, dim = obs_store.shape
    index = np.asarray(index, np.int64)
    out = np.zeros((len(index), K, dim), np.float32)
    valid = np.zeros((len(index), K), np.uint8)
    lo = max(int(count) - n_slots, 0)
    for b, k0 in enumerate(index):
        if k0 < 0:
            continue
        s, e = divmod(int(k0), n_envs)
        tau = next(t for t in range(lo, int(count)) if t % n_slots == s)
        for j in range(K - 1, -1, -1):
            t = tau - (K - 1 - j)
            if t < lo or (t < tau and done_store[t % n_slots, e]):
                break
            valid[b, j] = 1
            out[b, j] = obs_store[t % n_slots, e]
    return out, valid
