"""Device replay buffer: a ring over time with one column per env, n-step returns at sample time.

Layout
------
N parallel envs each append one transition per collect step, so storage is a ring over time
slots with env e's history in column e (``[n_slots, N, ...]``)::

    obs     float32 [n_slots, N, state_dim]    obs_t, the observation the action was chosen on
    action  int32   [n_slots, N, n_branches]   a_t, one action index per branch
    reward  float32 [n_slots, N]               r_t, the reward of the step taken from obs_t
    done    uint8   [n_slots, N]               1 when the episode ended with this step
    weight  float32 [n_slots, N]               per-transition weight: 1.0, or given at write time when
                                               built with weights=True (prioritization, boosts)
    mask    uint8   [n_slots, N, n_branches, max_actions]
                                               the env's action mask of obs_t (built with max_actions;
                                               numbarl/env/__init__.py): the sampled batch carries the
                                               mask of next_obs, so a target over the actions available
                                               there reads the env's rule instead of re-deriving it
    count   int64   [1]                        steps written so far (device); head slot = count % n_slots

**Only obs_t is stored, not next_obs.** The next observation of a non-terminal step is obs_{t+1} of
the same env: the next row of its column. That halves the buffer's memory and write traffic
(obs is the only wide field) and makes the n-step window a walk down one column. It costs two
things, both handled here:

- after a done the env soft-resets, so the row after a done step holds the first obs of the
  env's next episode, never a bootstrap state. Done is treated as terminal (bootstrap discount 0),
  so that row is never used as a target state. An episode cut by the env's hard cap is treated as
  terminal as well (the env raises done only while flat, SPEC §4).
- the newest ``n_step`` rows are not sampled yet: their windows are incomplete until n later rows
  exist (the window of an episode that ended early is complete sooner, but the few such
  transitions among the newest n rows simply wait for n more writes, which keeps the valid range
  a single interval and the sampler uniform over it).

n-step transition (Sutton & Barto 2018, §7.1, Eq. 7.1) for time τ of env e, window n, discount γ::

    m        = min(n, 1 + first k in [0, n) with done[τ+k])     number of rewards summed
    R_n      = Σ_{k<m} γ^k r_{τ+k}
    done_n   = 1 if the episode ended inside the window, else 0
    discount = γ^m                                                bootstrap discount
    next_obs = obs[τ+m]                                           (unused by the target when done_n)
    next_mask = mask[τ+m]                                         (the actions available at next_obs)

and the learner's target is ``R_n + (1 − done_n) · discount · Z(next_obs)``. Hand-computed example
(also a test): γ = 0.5, n = 3, env rewards 1, 2, 4 with done on the second step →
m = 2, R_n = 1 + 0.5·2 = 2, done_n = 1, discount = 0.25.

Valid sample times: with c = count, the oldest stored time is τ_lo = max(0, c − n_slots) and a
window needs rows τ..τ+n, so τ ∈ [τ_lo, c − 1 − n]: V = min(c, n_slots) − n times × N envs.
Uniform sampling draws ``u = randint(seed, lane=b, counter[0], slot, V·N)`` per batch row b with
the counter RNG (numbarl.cuda.rng; the step counter is read from device memory), then
τ = τ_lo + u // N, e = u % N. Before n + 1 writes (V ≤ 0) a sample is empty: weight 0, done 1,
discount 0, zero obs, index −1; the learner starts after ``min_writes`` writes.

History (``set_history(h)``, h = K − 1 of a temporal input that reads the K rows up to τ; 0 by default,
and then nothing changes): once the ring has wrapped (c > n_slots) the h oldest times are not drawn,
τ ∈ [τ_lo + h, c − 1 − n] (V = n_slots − n − h), so every row of a drawn window that existed when τ was
acted on is still in the ring: a window is the one the policy acted on, never a truncated one.

Weighted batches (``normalize_weights=True``; off by default, and then nothing below runs): the
stored weight column is 1.0 for every written row unless something marks rows afterwards (the
winner distillation of numbarl/rl/feedback/replay_weights.py sets the rows of winning training
trades to 1 + κ) or write() is given weights (``weights=True``). After the gather, ONE block
turns the sampled weights into importance weights for the loss (``C51Loss(..., weights=)``)::

    w_b   = weight[τ_b, e_b] · f(obs_b)           f: an optional factor table over the 9 regime
                                                  buckets of obs (terciles of two obs columns,
                                                  numbarl/rl/feedback/regimes.py): the E8
                                                  curriculum (numbarl/rl/feedback/curriculum.py);
                                                  1 without one
    batch.weight[b] = w_b · (B / Σ_b' w_b')       mean 1 over the batch (unless Σ = 0: an empty
                                                  buffer's all-zero weights stay 0)

The sum is fixed-order (thread t of the block folds rows t, t + NORM_BLOCK, ... in order, then a
fixed shared-memory tree: :func:`normalize_weights_ref` repeats that order in numpy, bit for bit).
A batch whose weights are all 1 comes out all exactly 1.0 (Σ = B is exact in float32 below 2**24
rows and B / B = 1), so a loss given these weights computes the same bits as one given none until
a row is actually boosted. ``Replay.weight_stats`` (device float32 [2]) then holds the batch's
mean of w_b before the normalization (> 1 once boosted rows are sampled: the liveness of the
marking) and the largest normalized weight (> 1 once the loss sees unequal weights). The numpy
model matches bit for bit under the simulator; on a GPU the compiler may fuse w·f into the sum
(FMA), an ulp away from the model but still the same bits on every run.

Extra horizons (``horizons=(1, 20)``; empty by default, and then nothing below runs): the same
draw (τ, e) also gets the window of every extra horizon h — R_h, done_h, γ^{m_h}, next_obs_h and
next_mask_h by the same scan with n = h — in ``ReplayBatch.horizons[i]`` (the multi-horizon C51
loss, numbarl/rl/losses/multi_horizon.py). The valid range then uses the longest window,
w = max(n_step, horizons): τ ∈ [τ_lo, c − 1 − w] and min_writes = w + 1, so every horizon's
window is complete; with no extra horizon w = n_step and the draw is the one without them.

Kernels and thread mapping: write (obs: one thread per (env, feature); then one thread per env for
the action, reward, done, weight and mask), advance
(one thread: count += 1), sample index (one thread per batch row: RNG, n-step scan), gather (one
thread per (row, feature): obs and next_obs), weight normalization (one block, only when
normalize_weights). Launchers only launch (no allocation, copy or sync)
and read count and the RNG counter from device memory, so write and sample can be captured into
the collect and train graphs. Measured on an H200 (graph replay): write of 16,384 envs × 64
features 15.7 µs, sample of 16,384 rows with n = 3 18.4 µs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numbarl.cuda import launch, rng
from numbarl.cuda.registry import RNG_STREAMS
from numbarl.cuda.runtime import Arena, cuda, stream
from numbarl.rl.feedback.regimes import N_BUCKETS, RegimeBuckets, bucket_of
from numbarl.env.state import row_jit

BLOCK = 128
SAMPLE_RNG_SLOT = RNG_STREAMS.claim("replay.sample", 200)  # the sampler's draw (numbarl.cuda.registry)
# threads of the one-block weight normalization (power of two; few simulated threads under the simulator)
NORM_BLOCK = launch.shape(gpu=256, sim=8)
ROW_THREADS = launch.shape(gpu=256, sim=32)  # threads per block of the batch gather (a thread row per sample)

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64 returns): the whole buffer, same write order, same RNG keys
# ---------------------------------------------------------------------------------------------
def nstep_ref(rewards, dones, gamma: float, n: int):
    """n-step return of the window starting at rewards[0]: (R_n, done_n, m, γ^m).

    rewards/dones: 1-D sequences of at least n entries (the env's steps τ, τ+1, ...).
    """
    ret, done_n, m = 0.0, 0, n
    for k in range(n):
        ret += gamma**k * float(rewards[k])
        if dones[k]:
            done_n, m = 1, k + 1
            break
    return ret, done_n, m, gamma**m


def obs_bucket_ref(a, b, edges) -> np.ndarray:
    """Regime bucket 3·i + j of values a, b (arrays) with tercile edges (lo_a, hi_a, lo_b, hi_b):
    the rule of numbarl/rl/feedback/regimes.py (float32 compares, NaN in tercile 0)."""
    rows = np.stack([np.asarray(a, np.float32), np.asarray(b, np.float32)], axis=1)
    return RegimeBuckets(0, 1, tuple(float(e) for e in np.asarray(edges, np.float32))).of(rows)


def normalize_weights_ref(weight, block: int | None = None, factor: np.ndarray | None = None):
    """Host model of the weight normalization, in the kernel's order (same float32 bits).

    weight: float32 [B] sampled weights; factor: float32 [B] per-row factors or None; block: the
    kernel's NORM_BLOCK. Returns (normalized weights float32 [B], (raw mean, max normalized)).
    """
    block = NORM_BLOCK if block is None else int(block)
    w = np.asarray(weight, np.float32).copy()
    if factor is not None:
        w = (w * np.asarray(factor, np.float32)).astype(np.float32)
    n = w.shape[0]
    partial = np.zeros(block, np.float32)
    for t in range(block):
        acc = np.float32(0.0)
        for b in range(t, n, block):
            acc = np.float32(acc + w[b])
        partial[t] = acc
    stride = block // 2
    while stride > 0:
        partial[:stride] = partial[:stride] + partial[stride:2 * stride]
        stride //= 2
    total = partial[0]
    scale = np.float32(np.float32(n) / total) if total > 0 else np.float32(1.0)
    out = (w * scale).astype(np.float32)
    return out, (np.float32(total / np.float32(n)), np.float32(out.max()) if n else np.float32(0.0))


class ReplayRef:
    """Host model of :class:`Replay` (float64 n-step returns; same layout, same sampling keys)."""

    def __init__(self, n_slots, n_envs, state_dim, n_branches, n_step, gamma, seed, rng_slot=SAMPLE_RNG_SLOT,
                 horizons=(), history: int = 0):
        self.n_slots, self.n_envs, self.n_step, self.gamma = n_slots, n_envs, n_step, gamma
        self.history = int(history)  # oldest times skipped once the ring wrapped (module docstring)
        self.horizons = tuple(int(h) for h in horizons)  # extra windows (module docstring)
        self.window = max((int(n_step),) + self.horizons)
        self.seed, self.rng_slot = seed, rng_slot
        self.obs = np.zeros((n_slots, n_envs, state_dim), np.float32)
        self.action = np.zeros((n_slots, n_envs, n_branches), np.int32)
        self.reward = np.zeros((n_slots, n_envs), np.float32)
        self.done = np.zeros((n_slots, n_envs), np.uint8)
        self.weight = np.ones((n_slots, n_envs), np.float32)
        self.mask = None  # [n_slots, N, n_branches, max_actions] uint8 once written with masks
        self.count = 0

    def write(self, obs, action, reward, done, weight=None, mask=None):
        s = self.count % self.n_slots
        self.obs[s], self.action[s], self.reward[s], self.done[s] = obs, action, reward, done
        self.weight[s] = 1.0 if weight is None else weight
        if mask is not None:
            if self.mask is None:
                self.mask = np.zeros((self.n_slots,) + np.shape(mask), np.uint8)
            self.mask[s] = mask
        self.count += 1

    def sample(self, batch_size: int, counter: int, normalize: bool = False, factor=None) -> dict:
        """The batch Replay.sample draws. normalize: the weighted batch (Replay(normalize_weights=True));
        factor: (col_a, col_b, edges [4], table [9]) of Replay.sample(factor=) or None. With
        normalize, out["weight_stats"] = (raw mean, max normalized weight)."""
        out = self._sample(batch_size, counter)
        if factor is not None and not normalize:
            raise ValueError("ReplayRef.sample: a factor needs normalize=True")
        if normalize:
            f = None
            if factor is not None:
                col_a, col_b, edges, table = factor
                f = np.asarray(table, np.float32)[obs_bucket_ref(out["obs"][:, col_a], out["obs"][:, col_b], edges)]
            w, stats = normalize_weights_ref(out["weight"].astype(np.float32), NORM_BLOCK, f)
            out["weight"], out["weight_stats"] = w, np.array(stats, np.float32)
        return out

    def _sample(self, batch_size: int, counter: int) -> dict:
        T, N, n = self.n_slots, self.n_envs, self.n_step
        skip = self.history if self.count > T else 0
        valid = min(self.count, T) - self.window - skip
        lo = max(0, self.count - T) + skip
        out = {
            "obs": np.zeros((batch_size, self.obs.shape[2])), "next_obs": np.zeros((batch_size, self.obs.shape[2])),
            "action": np.zeros((batch_size, self.action.shape[2]), np.int32), "reward": np.zeros(batch_size),
            "done": np.ones(batch_size), "discount": np.zeros(batch_size), "weight": np.zeros(batch_size),
            "index": np.full(batch_size, -1, np.int64), "next_index": np.full(batch_size, -1, np.int64),
        }
        if self.mask is not None:
            out["next_mask"] = np.zeros((batch_size,) + self.mask.shape[2:], np.uint8)
        out["horizons"] = [{"reward": np.zeros(batch_size), "done": np.ones(batch_size), "discount": np.zeros(batch_size),
                            "next_obs": np.zeros_like(out["next_obs"]), "next_index": np.full(batch_size, -1, np.int64),
                            **({"next_mask": np.zeros_like(out["next_mask"])} if self.mask is not None else {})}
                           for _ in self.horizons]
        if valid <= 0:
            return out
        for b in range(batch_size):
            u = int(rng.randint(np.uint64(self.seed), b, counter, np.uint64(self.rng_slot), valid * N))
            tau, e = lo + u // N, u % N
            rows = [(tau + k) % T for k in range(n)]
            ret, done_n, m, disc = nstep_ref(self.reward[rows, e], self.done[rows, e], self.gamma, n)
            s, s_next = tau % T, (tau + m) % T
            out["obs"][b], out["next_obs"][b] = self.obs[s, e], self.obs[s_next, e]
            out["action"][b] = self.action[s, e]
            out["reward"][b], out["done"][b], out["discount"][b] = ret, done_n, disc
            out["weight"][b] = self.weight[s, e]
            out["index"][b], out["next_index"][b] = s * N + e, s_next * N + e
            if self.mask is not None:
                out["next_mask"][b] = self.mask[s_next, e]
            for h, hb in zip(self.horizons, out["horizons"]):  # the extra windows of the same draw
                rows = [(tau + k) % T for k in range(h)]
                ret, done_n, m, disc = nstep_ref(self.reward[rows, e], self.done[rows, e], self.gamma, h)
                s_next = (tau + m) % T
                hb["reward"][b], hb["done"][b], hb["discount"][b] = ret, done_n, disc
                hb["next_obs"][b], hb["next_index"][b] = self.obs[s_next, e], s_next * N + e
                if self.mask is not None:
                    hb["next_mask"][b] = self.mask[s_next, e]
        return out


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
_cuda = cuda()


@_cuda.jit(cache=True)
def write_obs_kernel(obs_store, count, obs):
    """obs_store[count % n_slots] ← obs: one thread per (env, feature) and nothing else (a light
    copy at full occupancy; the env's small per-row fields are `write_row_kernel`'s)."""
    i = _cuda.grid(1)
    dim = obs.shape[1]
    if i >= obs.shape[0] * dim:
        return
    e = i // dim
    d = i - e * dim
    obs_store[count[0] % obs_store.shape[0], e, d] = obs[e, d]


@row_jit
def write_row(action_store, reward_store, done_store, weight_store, mask_store, s, e, action, reward, done, weight,
              use_weight, mask, use_mask):
    """Env e's fields of row s: its actions, reward, done, weight (1 without use_weight) and mask
    (with use_mask). `write_row_kernel` runs it per env; the learner's fused collect launch
    (numbarl.rl.policies.scheduled_epsilon_greedy_step) runs it after the env step of its thread."""
    for j in range(action.shape[1]):
        action_store[s, e, j] = action[e, j]
    reward_store[s, e] = reward[e]
    done_store[s, e] = 1 if done[e] != 0 else 0
    if use_weight:
        weight_store[s, e] = weight[e]
    else:
        weight_store[s, e] = _ONE
    if use_mask:
        for b in range(mask.shape[1]):
            for a in range(mask.shape[2]):
                mask_store[s, e, b, a] = mask[e, b, a]


_write_row = launch.device_function(write_row)


@_cuda.jit(cache=True)
def write_row_kernel(action_store, reward_store, done_store, weight_store, mask_store, count,
                     action, reward, done, weight, use_weight, mask, use_mask):
    """Row count % n_slots ← this step's actions, reward, done, weight and mask: one thread per env."""
    e = _cuda.grid(1)
    if e >= action.shape[0]:
        return
    _write_row(action_store, reward_store, done_store, weight_store, mask_store, count[0] % action_store.shape[0], e,
               action, reward, done, weight, use_weight, mask, use_mask)


@_cuda.jit(cache=True)
def advance_kernel(count):
    if _cuda.grid(1) == 0:
        count[0] += 1


@_cuda.jit(cache=True)
def reset_count_kernel(count):
    if _cuda.grid(1) == 0:
        count[0] = 0


@_cuda.jit(cache=True)
def sample_index_kernel(reward_store, done_store, action_store, weight_store, count, counter,
                        seed, rng_slot, n_step, window, history, gamma_dev,
                        out_action, out_reward, out_done, out_discount, out_weight, out_index, out_next_index):
    """Per batch row: uniform draw over the valid (time, env) pairs, then the n-step scan.
    window: the longest lookahead (n_step, or the longest extra horizon): the valid range's end;
    history: the oldest times skipped once the ring wrapped (module docstring; 0: none)."""
    b = _cuda.grid(1)
    if b >= out_reward.shape[0]:
        return
    n_slots = reward_store.shape[0]
    n_envs = reward_store.shape[1]
    c = count[0]
    skip = history if c > n_slots else 0
    valid = min(c, n_slots) - window - skip
    if valid <= 0:
        for j in range(out_action.shape[1]):
            out_action[b, j] = 0
        out_reward[b] = _ZERO
        out_done[b] = _ONE
        out_discount[b] = _ZERO
        out_weight[b] = _ZERO
        out_index[b] = -1
        out_next_index[b] = -1
        return
    lo = max(c - n_slots, 0) + skip
    gamma = gamma_dev[0]
    u = rng.randint(seed, b, counter[0], rng_slot, valid * n_envs)
    tau = lo + u // n_envs
    e = u % n_envs
    ret = _ZERO
    disc = _ONE
    done_n = _ZERO
    m = n_step
    for k in range(n_step):
        s_k = (tau + k) % n_slots
        ret += disc * reward_store[s_k, e]
        disc *= gamma
        if done_store[s_k, e] != 0:
            done_n = _ONE
            m = k + 1
            break
    s = tau % n_slots
    for j in range(out_action.shape[1]):
        out_action[b, j] = action_store[s, e, j]
    out_reward[b] = ret
    out_done[b] = done_n
    out_discount[b] = disc
    out_weight[b] = weight_store[s, e]
    out_index[b] = s * n_envs + e
    out_next_index[b] = ((tau + m) % n_slots) * n_envs + e


@_cuda.jit(cache=True)
def sample_horizons_kernel(reward_store, done_store, index, horizons, gamma_dev, out_reward, out_done, out_discount,
                           out_next_index):
    """Per batch row b (one thread): for each extra horizon i (window h = horizons[i]) the n-step scan of
    sample_index_kernel from the row's drawn slot (index[b] = slot · n_envs + env) into out_*[i, b]. An
    empty row (index −1) gets the empty sample (reward 0, done 1, discount 0, next index −1)."""
    b = _cuda.grid(1)
    if b >= index.shape[0]:
        return
    n_slots = reward_store.shape[0]
    n_envs = reward_store.shape[1]
    k0 = index[b]
    for i in range(horizons.shape[0]):
        if k0 < 0:
            out_reward[i, b] = _ZERO
            out_done[i, b] = _ONE
            out_discount[i, b] = _ZERO
            out_next_index[i, b] = -1
            continue
        s = k0 // n_envs
        e = k0 - s * n_envs
        gamma = gamma_dev[0]
        n = horizons[i]
        ret = _ZERO
        disc = _ONE
        done_n = _ZERO
        m = n
        for k in range(n):
            s_k = (s + k) % n_slots
            ret += disc * reward_store[s_k, e]
            disc *= gamma
            if done_store[s_k, e] != 0:
                done_n = _ONE
                m = k + 1
                break
        out_reward[i, b] = ret
        out_done[i, b] = done_n
        out_discount[i, b] = disc
        out_next_index[i, b] = ((s + m) % n_slots) * n_envs + e


@_cuda.jit(cache=True)
def gather_rows_kernel(obs_rows, mask_rows, rows, out_obs, out_mask, use_mask):
    """out_obs[r] = obs_rows[rows[r]] and its mask row (zeros where rows[r] < 0): the next observations
    of the extra horizons, all horizons in one launch (rows = their next indices flattened [H·B]).
    Thread row ty is row r, its lanes walk the features d (launch.row_block)."""
    r = _cuda.blockIdx.x * _cuda.blockDim.y + _cuda.threadIdx.y
    if r >= out_obs.shape[0]:
        return
    dim = out_obs.shape[1]
    n_mask = out_mask.shape[1] if use_mask else 0
    k = rows[r]
    d = _cuda.threadIdx.x
    while d < dim:
        out_obs[r, d] = _ZERO if k < 0 else obs_rows[k, d]
        m = d
        while m < n_mask:
            out_mask[r, m] = 0 if k < 0 else mask_rows[k, m]
            m += dim
        d += _cuda.blockDim.x


@_cuda.jit(cache=True)
def gather_obs_kernel(obs_rows, mask_rows, index, next_index, out_obs, out_next_obs, out_next_mask, use_mask):
    """out_obs[b] = obs_rows[index[b]], out_next_obs[b] = obs_rows[next_index[b]] and next_index's
    mask (obs_rows [n_slots · n_envs, dim] and mask_rows [n_slots · n_envs, n_branches · max_actions]
    are flat-row views of the store; out_next_mask [B, n_branches · max_actions]). Block (lanes,
    rows) of launch.row_block: thread row ty is sample b, its lanes walk the features d; feature d
    also copies mask elements d, d + dim, ... An empty sample (index −1) gets zeros."""
    b = _cuda.blockIdx.x * _cuda.blockDim.y + _cuda.threadIdx.y
    if b >= out_obs.shape[0]:
        return
    dim = out_obs.shape[1]
    n_mask = out_next_mask.shape[1] if use_mask else 0
    k = index[b]
    k_next = next_index[b]
    d = _cuda.threadIdx.x
    while d < dim:
        if k < 0:
            out_obs[b, d] = _ZERO
            out_next_obs[b, d] = _ZERO
        else:
            out_obs[b, d] = obs_rows[k, d]
            out_next_obs[b, d] = obs_rows[k_next, d]
        m = d
        while m < n_mask:
            out_next_mask[b, m] = 0 if k < 0 else mask_rows[k_next, m]  # an empty sample has no available action
            m += dim
        d += _cuda.blockDim.x


@_cuda.jit(cache=True)
def weight_norm_kernel(weight, obs, col_a, col_b, edges, table, use_factor, stats):
    """ONE block of NORM_BLOCK threads: weight[b] ← weight[b]·f_b · B / Σ weight·f (fixed order:
    thread t folds rows t, t + NORM_BLOCK, ... in order, then a fixed shared-memory tree), with
    f_b = table[bucket_of(obs[b, col_a], obs[b, col_b], edges)] when use_factor, else 1. stats[0] = the
    raw mean Σ / B, stats[1] = the largest normalized weight. Σ = 0 (an empty buffer): unchanged."""
    partial = _cuda.shared.array(NORM_BLOCK, np.float32)
    t = _cuda.threadIdx.x
    batch = weight.shape[0]
    acc = _ZERO
    for b in range(t, batch, NORM_BLOCK):
        w = weight[b]
        if use_factor:
            w = w * table[bucket_of(obs[b, col_a], obs[b, col_b], edges)]
            weight[b] = w
        acc += w
    partial[t] = acc
    _cuda.syncthreads()
    stride = NORM_BLOCK // 2
    while stride > 0:
        if t < stride:
            partial[t] += partial[t + stride]
        _cuda.syncthreads()
        stride //= 2
    total = partial[0]
    _cuda.syncthreads()  # every thread has read the sum before the max reuses the array
    scale = _ONE
    if total > _ZERO:
        scale = np.float32(batch) / total
    mx = _ZERO
    for b in range(t, batch, NORM_BLOCK):
        w = weight[b] * scale
        weight[b] = w
        mx = max(mx, w)
    partial[t] = mx
    _cuda.syncthreads()
    stride = NORM_BLOCK // 2
    while stride > 0:
        if t < stride:
            partial[t] = max(partial[t], partial[t + stride])
        _cuda.syncthreads()
        stride //= 2
    if t == 0:
        stats[0] = total / np.float32(batch)
        stats[1] = partial[0]


@_cuda.jit(cache=True)
def weight_stats_copy_kernel(src, stats, slot_mean, slot_max):
    """stats[slot_mean] = src[0], stats[slot_max] = src[1] (a slot < 0 is skipped)."""
    if _cuda.grid(1) == 0:
        if slot_mean >= 0:
            stats[slot_mean] = src[0]
        if slot_max >= 0:
            stats[slot_max] = src[1]


# ---------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------
def _grid(n: int) -> int:
    return max(1, (n + BLOCK - 1) // BLOCK)


@dataclass(frozen=True)
class ReplayBatch:
    """Fixed-address device views of one sampled batch (rewritten in place by every sample())."""

    obs: object         # float32 [B, state_dim]
    action: object      # int32   [B, n_branches]
    reward: object      # float32 [B]   R_n
    done: object        # float32 [B]   1.0 when the episode ended inside the n-step window
    discount: object    # float32 [B]   γ^m, the bootstrap discount (apply (1 − done) on top)
    next_obs: object    # float32 [B, state_dim]
    weight: object      # float32 [B]   stored per-transition weight (1.0 unless written or marked); 0 when
                        #               empty; with normalize_weights: × the factor, normalized to mean 1
    index: object       # int64   [B]   slot * n_envs + env of the sampled transition (−1 when empty)
    next_index: object  # int64   [B]   slot * n_envs + env of next_obs
    next_mask: object = None  # uint8 [B, n_branches, max_actions]: the env's mask of next_obs
                              # (None unless built with max_actions; all 0 when empty)
    horizons: tuple = ()      # one HorizonBatch per extra horizon (Replay(horizons=)); () without


@dataclass(frozen=True)
class HorizonBatch:
    """The window of one extra horizon h for the same sampled rows (fixed-address views)."""

    horizon: int        # h, the window length
    reward: object      # float32 [B]   R_h
    done: object        # float32 [B]   1.0 when the episode ended inside the h-step window
    discount: object    # float32 [B]   γ^{m_h}
    next_obs: object    # float32 [B, state_dim]
    next_index: object  # int64   [B]
    next_mask: object = None  # uint8 [B, n_branches, max_actions] (None unless built with max_actions)


class Replay:
    """Circular device replay buffer for N parallel envs with n-step returns (see module docstring).

    capacity: transitions kept (rounded down to a multiple of n_envs: n_slots = capacity // n_envs
    time slots). n_step is fixed at construction; gamma is a device scalar (``Replay.gamma_device``,
    initial value ``gamma``) read by every sample, so a schedule or the feedback loop changes it
    between graph replays without re-capture (``set_gamma``); seed and rng_slot key the sampler.
    weights=True lets write() take a per-transition float32 weight (stored; 1.0 otherwise); the
    sampled weight comes back in ReplayBatch.weight either way. max_actions: store the env's action
    mask [N, n_branches, max_actions] with every write (write(..., mask=)); each sample then
    carries next_obs's mask in ReplayBatch.next_mask. normalize_weights=True: every sample ends
    with the weight normalization of the module docstring (ReplayBatch.weight has mean 1: pass it
    to the loss as its per-sample weights; sample(factor=) multiplies in a bucket table first).
    It is a plain attribute read by sample() (its buffers are always allocated), so a component
    attached after construction may switch it on, before the train graph is captured.
    """

    def __init__(self, capacity: int, n_envs: int, state_dim: int, n_branches: int, batch_size: int,
                 n_step: int = 1, gamma: float = 0.99, seed: int = 0, weights: bool = False,
                 rng_slot: int = SAMPLE_RNG_SLOT, max_actions: int | None = None,
                 normalize_weights: bool = False, horizons=()):
        n_slots = int(capacity) // int(n_envs) if n_envs > 0 else 0
        self.horizons = tuple(int(h) for h in horizons)  # extra windows (module docstring)
        if any(h < 1 for h in self.horizons):
            raise ValueError(f"Replay: every extra horizon must be >= 1, got {self.horizons}")
        self.window = max((int(n_step),) + self.horizons)  # the longest lookahead a sample needs
        if n_envs < 1 or state_dim < 1 or n_branches < 1 or batch_size < 1:
            raise ValueError(
                f"Replay: n_envs ({n_envs}), state_dim ({state_dim}), n_branches ({n_branches}) and "
                f"batch_size ({batch_size}) must all be >= 1")
        if n_step < 1:
            raise ValueError(f"Replay: n_step must be >= 1, got {n_step}")
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"Replay: gamma must be in [0, 1], got {gamma}")
        if n_slots <= self.window:
            raise ValueError(
                f"Replay: capacity {capacity} gives {n_slots} time slots for {n_envs} envs, but an "
                f"{self.window}-step window needs at least {self.window + 1}; raise the capacity to at least "
                f"{(self.window + 1) * n_envs} transitions")
        self.n_slots, self.n_envs, self.state_dim, self.n_branches = n_slots, int(n_envs), int(state_dim), int(n_branches)
        self.batch_size, self.n_step, self.gamma = int(batch_size), int(n_step), float(gamma)
        self.seed, self.rng_slot, self.weights = int(seed), int(rng_slot), bool(weights)
        self.normalize_weights = bool(normalize_weights)
        self.history = 0  # set_history: the oldest times not drawn once the ring wrapped (module docstring)
        if max_actions is not None and int(max_actions) < 1:
            raise ValueError(f"Replay: max_actions must be >= 1 (or None: no masks), got {max_actions}")
        self.max_actions = None if max_actions is None else int(max_actions)
        # without masks the kernels still take (never read) uint8 arrays of the right rank
        mask_row = (n_branches, self.max_actions) if self.max_actions else (1, 1)

        self.store = Arena("replay")
        self.store.add("obs", (n_slots, n_envs, state_dim), np.float32)
        self.store.add("action", (n_slots, n_envs, n_branches), np.int32)
        self.store.add("reward", (n_slots, n_envs), np.float32)
        self.store.add("done", (n_slots, n_envs), np.uint8)
        self.store.add("weight", (n_slots, n_envs), np.float32)
        self.store.add("mask", ((n_slots, n_envs) if self.max_actions else (1, 1)) + mask_row, np.uint8)
        self.store.add("count", (1,), np.int64)
        self.store.add("gamma", (1,), np.float32)
        self.batch_arena = Arena("replay.batch")
        B = self.batch_size
        self.batch_arena.add("obs", (B, state_dim), np.float32)
        self.batch_arena.add("action", (B, n_branches), np.int32)
        self.batch_arena.add("reward", (B,), np.float32)
        self.batch_arena.add("done", (B,), np.float32)
        self.batch_arena.add("discount", (B,), np.float32)
        self.batch_arena.add("next_obs", (B, state_dim), np.float32)
        self.batch_arena.add("weight", (B,), np.float32)
        self.batch_arena.add("index", (B,), np.int64)
        self.batch_arena.add("next_index", (B,), np.int64)
        self.batch_arena.add("next_mask", ((B,) if self.max_actions else (1,)) + mask_row, np.uint8)
        self.batch_arena.add("weight_stats", (2,), np.float32)  # (raw mean, max normalized) of the last batch
        self.batch_arena.add("no_factor", (N_BUCKETS + 4,), np.float32)  # placeholder edges/table (unread)
        if self.horizons:  # the extra horizons' windows, horizon-major [H, B, ...]
            H = len(self.horizons)
            self.batch_arena.add("h_reward", (H, B), np.float32)
            self.batch_arena.add("h_done", (H, B), np.float32)
            self.batch_arena.add("h_discount", (H, B), np.float32)
            self.batch_arena.add("h_next_index", (H, B), np.int64)
            self.batch_arena.add("h_next_obs", (H, B, state_dim), np.float32)
            self.batch_arena.add("h_next_mask", ((H, B) if self.max_actions else (1, 1)) + mask_row, np.uint8)
            self.batch_arena.add("h_windows", (H,), np.int64)
        self.batch: ReplayBatch | None = None

    @property
    def capacity(self) -> int:
        return self.n_slots * self.n_envs

    def set_history(self, history: int) -> None:
        """Draw only times whose `history` preceding rows are still in the ring once it has wrapped (module
        docstring: a temporal input's K − 1); 0 (the default) draws every valid time."""
        history = int(history)
        if history < 0 or self.n_slots <= self.window + history:
            raise ValueError(f"Replay: {self.n_slots} time slots cannot hold a {self.window}-step window after "
                             f"{history} rows of history; raise the capacity to at least "
                             f"{(self.window + history + 1) * self.n_envs} transitions")
        self.history = history

    @property
    def min_writes(self) -> int:
        """Writes (collect steps) needed before sample() returns real transitions."""
        return self.window + 1

    @property
    def count(self):
        """Device int64 [1]: collect steps written so far."""
        return self.store["count"]

    @property
    def weight_store(self):
        """Device float32 [n_slots, N]: the stored per-transition weights (time-major ring, column =
        env); a marking kernel may set rows between writes (numbarl.rl.feedback.replay_weights)."""
        return self.store["weight"]

    @property
    def weight_stats(self):
        """Device float32 [2]: (mean weight before the normalization, largest normalized weight) of
        the last sampled batch; written only with normalize_weights."""
        return self.batch_arena["weight_stats"]

    @property
    def gamma_device(self):
        """Device float32 [1]: the discount every sample reads."""
        return self.store["gamma"]

    def set_gamma(self, value: float) -> None:
        """Write the device gamma from the host (a copy: outside capture only)."""
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"Replay: gamma must be in [0, 1], got {value}")
        self.gamma = float(value)
        self.store.load({"gamma": np.array([value], np.float32)})

    def allocate(self) -> "Replay":
        self.store.allocate()
        self.store.load({"gamma": np.array([self.gamma], np.float32)})
        self.batch_arena.allocate()
        a = self.batch_arena
        horizons = ()
        if self.horizons:
            a.load({"h_windows": np.asarray(self.horizons, np.int64)})
            horizons = tuple(HorizonBatch(h, a["h_reward"][i], a["h_done"][i], a["h_discount"][i], a["h_next_obs"][i],
                                          a["h_next_index"][i], a["h_next_mask"][i] if self.max_actions else None)
                             for i, h in enumerate(self.horizons))
        self.batch = ReplayBatch(a["obs"], a["action"], a["reward"], a["done"], a["discount"],
                                 a["next_obs"], a["weight"], a["index"], a["next_index"],
                                 a["next_mask"] if self.max_actions else None, horizons)
        return self

    # -- capturable launchers ---------------------------------------------------------------------
    def write(self, obs, action, reward, done, stream, weight=None, mask=None, obs_written=False,
              advance=True) -> None:
        """Append one transition per env: obs [N, state_dim] f32 (obs_t), action [N, n_branches] i32,
        reward [N] f32, done [N] (any integer/bool/float dtype, nonzero = done), weight [N] f32 or None,
        mask [N, n_branches, max_actions] u8 (the env's mask of obs_t; required iff built with max_actions).

        obs_written: obs is already in the ring's slot (the env's gather wrote it there too, through
        `obs_ring`), so only the per-env fields are copied. advance=False leaves count[0] += 1 to
        the caller (one launch of its own that also advances its other counters, after this write
        and before the next write or sample)."""
        N, D = self.n_envs, self.state_dim
        if obs.shape != (N, D) or action.shape != (N, self.n_branches) or reward.shape != (N,) or done.shape != (N,):
            raise ValueError(
                f"Replay.write expects obs {(N, D)}, action {(N, self.n_branches)}, reward ({N},), "
                f"done ({N},); got {obs.shape}, {action.shape}, {reward.shape}, {done.shape}")
        if obs.dtype != np.float32 or reward.dtype != np.float32 or action.dtype != np.int32:
            raise TypeError(f"Replay.write expects float32 obs/reward and int32 action; got "
                            f"{obs.dtype}, {reward.dtype}, {action.dtype}")
        if weight is not None and not self.weights:
            raise ValueError("Replay.write got a weight but the buffer was built with weights=False")
        use_weight = weight is not None
        w = weight if use_weight else reward  # any float32 [N] placeholder; unread when use_weight is False
        s = self.store
        if (mask is not None) != bool(self.max_actions):
            raise ValueError("Replay.write: pass the env's mask exactly when the buffer was built with max_actions "
                             f"(max_actions = {self.max_actions}, mask {'given' if mask is not None else 'missing'})")
        if mask is not None and (tuple(mask.shape) != (N, self.n_branches, self.max_actions) or mask.dtype != np.uint8):
            raise ValueError(f"Replay.write expects mask uint8 {(N, self.n_branches, self.max_actions)}, got "
                             f"{mask.dtype} {tuple(mask.shape)}")
        m = mask if mask is not None else self.batch_arena["next_mask"]  # placeholder, unread
        # two launches: the obs copy alone (one thread per element), then one thread per env for
        # the small fields (one launch whose obs threads also carried the per-env fields took
        # 21.6 µs at N = 16,384 on the H200)
        if not obs_written:
            write_obs_kernel[_grid(N * D), BLOCK, stream](s["obs"], s["count"], obs)
        write_row_kernel[_grid(N), BLOCK, stream](
            s["action"], s["reward"], s["done"], s["weight"], s["mask"], s["count"],
            action, reward, done, w, use_weight, m, mask is not None)
        if advance:
            advance_kernel[1, 1, stream](s["count"])

    def row_stores(self):
        """(action, reward, done, weight, mask, count) stores of the per-env fields, for a launch
        that writes a step's row itself through `write_row` (the fused collect launch); count[0] % n_slots
        is the row, and the obs are already there (`obs_ring`). Needs a buffer built with max_actions."""
        if not self.max_actions:
            raise ValueError("Replay.row_stores needs a buffer built with max_actions (the mask is part of the row)")
        s = self.store
        return s["action"], s["reward"], s["done"], s["weight"], s["mask"], s["count"]

    def obs_ring(self):
        """(obs store [n_slots, N, state_dim], count [1]): where a gather writes obs_t straight into
        row count % n_slots (before `write(..., obs_written=True)` of the same step)."""
        return self.store["obs"], self.store["count"]

    def sample(self, counter, stream, factor=None) -> ReplayBatch:
        """Draw batch_size transitions uniformly (key: seed, lane = batch row, counter[0], rng_slot)
        into the fixed batch views and return them. counter: device int64 [1] (the step counter).

        With normalize_weights, the batch's weights are then normalized to mean 1 (module
        docstring). factor (only with normalize_weights): an object with int attributes col_a, col_b
        (obs columns) and device float32 arrays edges [4] (lo_a, hi_a, lo_b, hi_b) and table [9]
        (the factor of each regime bucket, numbarl/rl/feedback/regimes.py), e.g.
        numbarl.rl.feedback.curriculum.Curriculum; the sampled indices never depend on it."""
        s, out = self.store, self.batch
        if out is None:
            raise RuntimeError("Replay.sample before Replay.allocate()")
        if factor is not None and not self.normalize_weights:
            raise ValueError("Replay.sample: a weight factor needs a buffer built with normalize_weights=True")
        sample_index_kernel[_grid(self.batch_size), BLOCK, stream](
            s["reward"], s["done"], s["action"], s["weight"], s["count"], counter,
            np.uint64(self.seed), np.uint64(self.rng_slot), np.int64(self.n_step), np.int64(self.window),
            np.int64(self.history), s["gamma"],
            out.action, out.reward, out.done, out.discount, out.weight, out.index, out.next_index)
        n_rows = s["obs"].shape[0] * s["obs"].shape[1]  # flat-row views: no index division in the kernel
        mask_rows, next_mask = s["mask"], self.batch_arena["next_mask"]
        mask_rows = mask_rows.reshape(mask_rows.shape[0] * mask_rows.shape[1], mask_rows.shape[2] * mask_rows.shape[3])
        grid, block = launch.row_block(self.batch_size, self.state_dim, ROW_THREADS)
        gather_obs_kernel[grid, block, stream](
            s["obs"].reshape(n_rows, self.state_dim), mask_rows, out.index, out.next_index, out.obs, out.next_obs,
            next_mask.reshape(next_mask.shape[0], next_mask.shape[1] * next_mask.shape[2]), bool(self.max_actions))
        if self.horizons:  # the extra horizons' windows of the same draw, then their next observations
            a, H = self.batch_arena, len(self.horizons)
            sample_horizons_kernel[_grid(self.batch_size), BLOCK, stream](
                s["reward"], s["done"], out.index, a["h_windows"], s["gamma"], a["h_reward"], a["h_done"],
                a["h_discount"], a["h_next_index"])
            h_mask = a["h_next_mask"]
            h_mask = h_mask.reshape(h_mask.shape[0] * h_mask.shape[1], h_mask.shape[2] * h_mask.shape[3])
            grid, block = launch.row_block(H * self.batch_size, self.state_dim, ROW_THREADS)
            gather_rows_kernel[grid, block, stream](
                s["obs"].reshape(n_rows, self.state_dim), mask_rows, a["h_next_index"].reshape(H * self.batch_size),
                a["h_next_obs"].reshape(H * self.batch_size, self.state_dim), h_mask, bool(self.max_actions))
        if self.normalize_weights:
            if factor is not None:
                col_a, col_b, edges, table = int(factor.col_a), int(factor.col_b), factor.edges, factor.table
                if not (0 <= col_a < self.state_dim and 0 <= col_b < self.state_dim):
                    raise ValueError(f"Replay.sample: factor columns ({col_a}, {col_b}) outside obs [0, {self.state_dim})")
                if tuple(edges.shape) != (4,) or tuple(table.shape) != (N_BUCKETS,):
                    raise ValueError(f"Replay.sample: factor edges must be [4] and table [{N_BUCKETS}], got "
                                     f"{tuple(edges.shape)} and {tuple(table.shape)}")
            else:
                col_a, col_b = 0, 0
                edges = table = self.batch_arena["no_factor"]
            weight_norm_kernel[1, NORM_BLOCK, stream](out.weight, out.obs, np.int64(col_a), np.int64(col_b), edges,
                                                      table, factor is not None, self.batch_arena["weight_stats"])
        return out

    def copy_weight_stats(self, stats, stream, slot_mean: int = -1, slot_max: int = -1) -> None:
        """stats[slot_mean], stats[slot_max] (device float32, e.g. the agent's mapped stats) ← the last
        batch's raw mean weight and largest normalized weight (capturable; normalize_weights only)."""
        if not self.normalize_weights:
            raise ValueError("Replay.copy_weight_stats: the buffer was built with normalize_weights=False")
        weight_stats_copy_kernel[1, 1, stream](self.batch_arena["weight_stats"], stats, np.int64(slot_mean),
                                               np.int64(slot_max))

    def reset(self, stream) -> None:
        """Forget everything written (count = 0); the rows are overwritten by later writes."""
        reset_count_kernel[1, 1, stream](self.store["count"])

    # -- host helpers (checkpoints, tests; not for the hot path) ---------------------------------
    def written(self) -> int:
        """Host copy of count (syncs the stream)."""
        s = stream()
        host = self.store["count"].copy_to_host(stream=s)
        s.synchronize()
        return int(host[0])
