"""Dueling branched C51 head: one value stream, one advantage GEMM for all branches, softmax over atoms.

Math (Wang et al. 2016 dueling networks, Eq. 9, applied per atom as in Rainbow, Hessel et al.
2018, Eq. 2; action branching: Tavakoli, Pardo & Kormushev 2018, Eq. 1). For the trunk output
h [B, H], branch k with A_k actions and atoms z_0..z_{Z-1}:

    V      = h·W_v + b_v                                   [B, Z]           (one GEMM)
    A      = h·W_a + b_a                                   [B, Σ_k A_k·Z]   (ONE GEMM for all branches)
    logits[b, k, a, z] = V[b, z] + A[b, k, a, z] - (1/A_k) Σ_a' A[b, k, a', z]
    probs  = softmax over z of logits                      [B, n_branches, max_actions, Z]
    q[b, k, a] = Σ_z probs[b, k, a, z] · z_z               [B, n_branches, max_actions]

The advantage GEMM's columns are the branches one after the other: branch k, action a, atom z
is column (offset_k + a)·Z + z with offset_k = Σ_{k' < k} A_{k'}. Outputs are padded to
max_actions = max_k A_k; padding entries (a >= A_k) are defined: logits = -inf, probs = 0,
q = -inf (never NaN), so an argmax over the padded Q never picks them and the env's
action_select (q [N, n_branches, max_actions]) reads this layout directly.

Backward from d_logits (the loss writes zeros at padding and at actions not taken):

    dV[b, z]          = Σ_k Σ_{a < A_k} d_logits[b, k, a, z]
    dA[b, k, a, z]    = d_logits[b, k, a, z] - (1/A_k) Σ_a' d_logits[b, k, a', z]
    dW_v = hᵀ·dV, db_v = colsum(dV)         dW_a = hᵀ·dA, db_a = colsum(dA)   (bgrad epilogue;
                                            accumulating GEMM + column sum for a later consumer)
    dh   = dV·W_vᵀ + dA·W_aᵀ                 (second GEMM accumulates with beta = 1)

Thread mapping (forward: one launch after the two GEMMs). `dueling_head_kernel` gives a block
HEAD_SAMPLES samples (block (64, 2) on the GPU): their V and A rows are one contiguous span of
each GEMM output, loaded once into shared memory; x = A + (V - mean_a A) is written over A in
place, and the row statistics (one thread per (b, k, a) row: max, log Σ exp, Q) and the coalesced
logits / probs stores all read x from shared memory. Each pass declares the outputs it needs
(`declare_acts(..., outputs=...)`) and computes nothing else: the train step's online pass
("logits", "q"), the next-obs pass ("q",), the target pass ("probs",), acting ("q",).
Measured on the H200 (B = 16,384, branches (3, 3, 4, 4), 51 atoms, `python -m numbarl.bench.head`
and `bench.train --profile`): 156 µs per train-step pass on average, against 169 + 75 + 114 µs for
the earlier three-kernel split (elementwise logits, row stats, elementwise probs, every pass all
outputs) and 0.59 ms for the first one-thread-per-row kernel. Nsight Compute (on a variant with
the same loops) found it compute-bound with register-limited occupancy, not memory-bound: 94
registers per thread allow 5 blocks of 128 threads per SM. Issue 17 rewrote it the way of
`dueling_q_kernel` below (uint64 indices, eight loads in flight, x in place of A and no base rows,
the atom loops unrolled by four): 1,671 -> 1,024 PTX instructions and 60 -> 48 registers (ptxas
13.0, sm_90), the same float32 operations in the same order, so the same bits.
Q-only passes (lse and q: acting with N = 16,384 envs, the train step's next-obs pass) take the
dedicated `dueling_q_kernel` (`dueling_head_kernel` took 92 µs there on the H200, the collect step's
largest kernel): uint64 indices (no negative-index wraparound code, which was a third to a half of
the PTX of its loops), eight loads in flight per thread, x = A + base written over A in place (one
shared float per atom in the row statistics, no base rows), no logits / probs branches; 40
registers (ptxas 13.0 on its PTX for sm_90, against 60 for `dueling_head_kernel` then; the bench
prints the counts the driver gives) and 24.5 KB of shared memory per block of 128 threads. The
same float32 operations in the same order per row: the same lse and q bits as
`dueling_head_kernel` (`q_kernel="head"`), checked by the tests and over the whole batch by
`python -m numbarl.bench.head`.
Padded width (`pad_to`, agent.head_pad; issue 17): cuBLASLt's heuristic goes by the logical width, and at
ΣA·Z = 714 it picks one-float-aligned TF32 kernels (117-120 µs per advantage GEMM on the H200, against 43-78 µs
at 768). With pad_to = Q the advantage GEMMs run at Wp = ΣA·Z rounded up to a multiple of Q: each forward copies
its role's adv.w / adv.b into a per-pass zero-padded scratch (`copy_cols_kernel`), `adv` and `d_adv` are Wp wide
(the kernels take Wp as the row stride and never read the pad columns; the backward never writes them, so they
keep the arena's zeros), the input gradient runs at K = Wp, and the weight gradient's first write of the step at
N = Wp into a scratch copied back into the gradient. The parameters keep their shape [H, ΣA·Z]. The pad columns add
exact zeros: the same values, rounded by other kernels (bit for bit the same under the simulator's GEMM).
TF32 train step 1.63 -> 1.34 ms at Q = 64 (docs/BENCHMARKS.md, twentieth session).
Fused value stream (`fuse_value`, agent.head_fuse_value; padded heads only): the value weights and bias are copied
into the same scratch at columns ΣA·Z .. ΣA·Z + Z, so one GEMM per pass writes [A | V | 0] (714 + 51 -> 768);
the head kernels read V from the loaded A rows (`fused`, `value_col`), the backward writes dV into those columns
of d_adv (a strided view), one weight-gradient GEMM at the padded width serves both streams (copied back into
both gradients) and one input-gradient GEMM gives dh = [dA | dV | 0]·[W_a | W_v | 0]ᵀ (one rounding where the
unfused head has two). The TF32 default since the twenty-first session: train step 1.34 -> 1.22 ms, collect
0.232 -> 0.212 ms on the H200 (docs/BENCHMARKS.md); fp32's since the twenty-fifth (agent.head_pad_fp32 = 64): 3.20 -> 3.03 ms,
collect 0.619 -> 0.596 ms. (The PTX instruction and register counts above were taken before
the kernels gained the fused layout's `v_base` / `v_stride` select: recount with `numbarl.bench.head`.)
Backward: `dueling_backward_kernel`, one thread per (b, z) (block (EW_ATOMS, EW_ROWS)): adjacent
threads touch adjacent atoms (coalesced), each loops over the branches and their actions (uint64
indices: 504 -> 239 PTX instructions).
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import numpy as np
from numba import float32

from numbarl.cuda import blas, graph, launch, reduce
from numbarl.cuda.kernels import elementwise
from numbarl.cuda.runtime import Arena, cuda
from numbarl.rl.nets.base import bias_uniform_init, kaiming_uniform_init
from numbarl.rl.nets.linear import linear_param_grads
from numbarl.rl.nets.module import Buf, Ctx, Module, Param

_cuda = cuda()  # the backend (GPU or simulator), selected once

# Forward launch shape: HEAD_SAMPLES samples per block, HEAD_TX lanes along the atoms, HEAD_TY
# thread rows. Under the simulator (every thread a Python thread): 4 threads, lanes walk whole rows.
# The kernel reads its shape from blockDim and a `samples` argument (never compiled-in constants,
# which numba's on-disk cache would serve stale), so `dueling_forward(..., block=, samples=)` can
# try other shapes: `python -m numbarl.bench.head --shapes 64x2x8,64x1x8`.
HEAD_TX = launch.shape(gpu=64, sim=1)
HEAD_TY = launch.shape(gpu=2, sim=4)
HEAD_SAMPLES = launch.shape(gpu=8, sim=4)  # at most (fewer when a sample's rows need more shared memory)
# Q-only pass (`dueling_q_kernel`): Q_SAMPLES samples per block of Q_TX x Q_TY threads (used as one
# flat range: only the product matters); the same blockDim / `samples` rule as above. One thread
# per padded output row: Q_TX·Q_TY = Q_SAMPLES·n_branches·max_actions (128 for branches
# (3, 3, 4, 4)) leaves none idle in the statistics phase.
Q_TX = launch.shape(gpu=64, sim=1)
Q_TY = launch.shape(gpu=2, sim=4)
Q_SAMPLES = launch.shape(gpu=8, sim=4)
Q_KERNELS = ("q", "head")  # dueling_forward(q_kernel=...): the dedicated kernel, or the general one
# Elementwise kernels over [B, Z] rows (the head's backward and the C51 loss's): EW_ATOMS threads
# along the atoms (loop beyond), EW_ROWS samples per block.
EW_ATOMS = launch.shape(gpu=64, sim=1)
EW_ROWS = launch.shape(gpu=4, sim=8)
SHARED_BYTES_MAX = 48 * 1024  # dynamic shared memory a block may use without an opt-in

_ZERO = np.float32(0.0)
_NEG_INF = np.float32(-np.inf)
_MINUS_ONE = np.float32(-1.0)
# uint64 index constants for `dueling_q_kernel` (an int literal would make uint64 arithmetic float64)
_U0, _U1, _U2, _U3, _U4, _U5, _U6, _U7, _U8 = (np.uint64(n) for n in range(9))
_EW_ATOMS, _EW_ROWS = np.uint64(EW_ATOMS), np.uint64(EW_ROWS)  # the elementwise shapes as uint64 (the same rule)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def make_support(n_atoms: int, v_min: float, v_max: float) -> np.ndarray:
    """The C51 support z_i = v_min + i·Δz as float32 [n_atoms] (both ends exact)."""
    if int(n_atoms) < 2:
        raise ValueError(f"n_atoms must be >= 2 (got {n_atoms}): C51 needs at least two atoms")
    if not (np.isfinite(v_min) and np.isfinite(v_max) and v_max > v_min):
        raise ValueError(f"C51 support needs finite v_min < v_max (got v_min={v_min}, v_max={v_max})")
    return np.linspace(float(v_min), float(v_max), int(n_atoms)).astype(np.float32)


def branch_offsets(branch_sizes) -> np.ndarray:
    """offset_k = Σ_{k' < k} A_{k'} (in actions) as int64 [n_branches]."""
    sizes = np.asarray(branch_sizes, np.int64)
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def dueling_combine_ref(value, adv, branch_sizes):
    """logits[b, k, a, z] = V[b, z] + A[b, k, a, z] - mean_a A[b, k, a, z], padding = -inf.

    Args:
      value: [B, Z] value stream V.
      adv: [B, Σ_k A_k·Z] advantage GEMM output (branches concatenated).
      branch_sizes: [n_branches] actions per branch A_k.

    Returns:
      [B, n_branches, max_actions, Z] logits (float64).
    """
    value = np.asarray(value, np.float64)
    adv = np.asarray(adv, np.float64)
    batch, n_atoms = value.shape
    sizes = list(branch_sizes)
    offsets = branch_offsets(sizes)
    logits = np.full((batch, len(sizes), max(sizes), n_atoms), -np.inf)
    for k, (n, off) in enumerate(zip(sizes, offsets)):
        a = adv[:, off * n_atoms:(off + n) * n_atoms].reshape(batch, n, n_atoms)  # [B, A_k, Z]
        logits[:, k, :n] = value[:, None, :] + a - a.mean(axis=1, keepdims=True)
    return logits


def distribution_ref(logits, support, branch_sizes):
    """probs = softmax over atoms (0 at padding), q = Σ_z p·z (-inf at padding).

    Args:
      logits: [B, n_branches, max_actions, Z].
      support: [Z].
      branch_sizes: [n_branches].

    Returns:
      probs [B, n_branches, max_actions, Z], q [B, n_branches, max_actions] (float64).
    """
    logits = np.asarray(logits, np.float64)
    probs = np.zeros(logits.shape)
    q = np.full(logits.shape[:3], -np.inf)
    for k, n in enumerate(branch_sizes):
        x = logits[:, k, :n]
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)
        probs[:, k, :n] = p
        q[:, k, :n] = p @ np.asarray(support, np.float64)
    return probs, q


def head_forward_ref(h, w_value, b_value, w_adv, b_adv, branch_sizes, support):
    """Whole head forward in float64. Returns (logits, probs, q) with the padded layouts above."""
    h = np.asarray(h, np.float64)
    value = h @ np.asarray(w_value, np.float64) + np.asarray(b_value, np.float64)
    adv = h @ np.asarray(w_adv, np.float64) + np.asarray(b_adv, np.float64)
    logits = dueling_combine_ref(value, adv, branch_sizes)
    probs, q = distribution_ref(logits, support, branch_sizes)
    return logits, probs, q


def dueling_backward_ref(d_logits, branch_sizes):
    """(dV [B, Z], dA [B, Σ_k A_k·Z]) from d_logits [B, n_branches, max_actions, Z] (padding ignored)."""
    d_logits = np.asarray(d_logits, np.float64)
    batch, _, _, n_atoms = d_logits.shape
    sizes = list(branch_sizes)
    offsets = branch_offsets(sizes)
    d_value = np.zeros((batch, n_atoms))
    d_adv = np.zeros((batch, int(sum(sizes)) * n_atoms))
    for k, (n, off) in enumerate(zip(sizes, offsets)):
        g = d_logits[:, k, :n]  # [B, A_k, Z]
        d_value += g.sum(axis=1)
        d_adv[:, off * n_atoms:(off + n) * n_atoms] = (g - g.mean(axis=1, keepdims=True)).reshape(batch, -1)
    return d_value, d_adv


def head_backward_ref(h, w_value, w_adv, d_logits, branch_sizes):
    """Gradients of the head from d_logits, float64: dict with dh, dw_value, db_value, dw_adv, db_adv."""
    h = np.asarray(h, np.float64)
    d_value, d_adv = dueling_backward_ref(d_logits, branch_sizes)
    return {
        "dh": d_value @ np.asarray(w_value, np.float64).T + d_adv @ np.asarray(w_adv, np.float64).T,
        "dw_value": h.T @ d_value,
        "db_value": d_value.sum(axis=0),
        "dw_adv": h.T @ d_adv,
        "db_adv": d_adv.sum(axis=0),
    }


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(device=True)
def _span_load_dev(adv, value, adv_start, value_start, n_adv, i):
    """Element i of a block's span A rows | V rows: adv[adv_start + i] for i < n_adv, else
    value[value_start + i - n_adv] (uint64 indices)."""
    if i < n_adv:
        return adv[adv_start + i]
    return value[value_start + (i - n_adv)]


@_cuda.jit(device=True)
def _sum_four_dev(sh, at, n_atoms, n_left, acc):
    """acc + sh[at] + sh[at + Z] + ... over the first min(n_left, 4) of four slots, in that order
    (`dueling_head_kernel`'s `for a: acc += A[a, z]`); the loads come before the adds."""
    x0 = sh[at]
    x1 = sh[at + n_atoms] if n_left > _U1 else _ZERO
    x2 = sh[at + _U2 * n_atoms] if n_left > _U2 else _ZERO
    x3 = sh[at + _U3 * n_atoms] if n_left > _U3 else _ZERO
    acc += x0
    if n_left > _U1:
        acc += x1
    if n_left > _U2:
        acc += x2
    if n_left > _U3:
        acc += x3
    return acc


@_cuda.jit(device=True)
def _add_four_dev(sh, at, n_atoms, n_left, base):
    """sh[at + j·Z] = sh[at + j·Z] + base for the first min(n_left, 4) of j = 0..3."""
    sh[at] = sh[at] + base
    if n_left > _U1:
        sh[at + n_atoms] = sh[at + n_atoms] + base
    if n_left > _U2:
        sh[at + _U2 * n_atoms] = sh[at + _U2 * n_atoms] + base
    if n_left > _U3:
        sh[at + _U3 * n_atoms] = sh[at + _U3 * n_atoms] + base


@_cuda.jit(device=True)
def _row_stats_dev(sh, row, n_atoms, sup, sup_at):
    """(lse, q) of the logits row sh[row .. row + Z): the row max, then Σ e and Σ e·z with
    e = exp(x_z - max), each in atom order z = 0..Z-1, unrolled by four so the shared loads and exps
    of four atoms issue before the running sums take them; lse = max + log Σ e, q = Σ e·z / Σ e.
    The support z is sup[sup_at + z] (shared memory in the general head kernel, the global support
    in the Q-only kernel): one arithmetic for both, so both give the same bits."""
    mx = _NEG_INF
    z = _U0
    while z + _U3 < n_atoms:
        at = row + z
        x0 = sh[at]
        x1 = sh[at + _U1]
        x2 = sh[at + _U2]
        x3 = sh[at + _U3]
        mx = max(mx, x0)
        mx = max(mx, x1)
        mx = max(mx, x2)
        mx = max(mx, x3)
        z += _U4
    while z < n_atoms:
        mx = max(mx, sh[row + z])
        z += _U1
    total = _ZERO
    expected = _ZERO
    z = _U0
    while z + _U3 < n_atoms:
        at = row + z
        zs = sup_at + z
        e0 = math.exp(sh[at] - mx)
        e1 = math.exp(sh[at + _U1] - mx)
        e2 = math.exp(sh[at + _U2] - mx)
        e3 = math.exp(sh[at + _U3] - mx)
        total += e0
        expected += e0 * sup[zs]
        total += e1
        expected += e1 * sup[zs + _U1]
        total += e2
        expected += e2 * sup[zs + _U2]
        total += e3
        expected += e3 * sup[zs + _U3]
        z += _U4
    while z < n_atoms:
        e = math.exp(sh[row + z] - mx)
        total += e
        expected += e * sup[sup_at + z]
        z += _U1
    return mx + math.log(total), expected / total


@_cuda.jit(device=True)
def _load_span_dev(sh, adv, value, adv_start, value_start, n_adv, n_load, t, threads):
    """sh[i] = element i of a block's span A rows | V rows for i < n_load, thread t of `threads`:
    unguarded rounds of eight loads in flight over A, then guarded rounds of eight over the rest of
    A and V (uint64 indices; step 1 of both head kernels)."""
    i = t
    while i + _U7 * threads < n_adv:  # eight independent loads before the stores
        x0 = adv[adv_start + i]
        x1 = adv[adv_start + i + threads]
        x2 = adv[adv_start + i + _U2 * threads]
        x3 = adv[adv_start + i + _U3 * threads]
        x4 = adv[adv_start + i + _U4 * threads]
        x5 = adv[adv_start + i + _U5 * threads]
        x6 = adv[adv_start + i + _U6 * threads]
        x7 = adv[adv_start + i + _U7 * threads]
        sh[i] = x0
        sh[i + threads] = x1
        sh[i + _U2 * threads] = x2
        sh[i + _U3 * threads] = x3
        sh[i + _U4 * threads] = x4
        sh[i + _U5 * threads] = x5
        sh[i + _U6 * threads] = x6
        sh[i + _U7 * threads] = x7
        i += _U8 * threads
    while i < n_load:  # the rest of A, then V: eight loads in flight, each guarded (one round at the defaults)
        x0 = _span_load_dev(adv, value, adv_start, value_start, n_adv, i)
        i1 = i + threads
        i2 = i + _U2 * threads
        i3 = i + _U3 * threads
        i4 = i + _U4 * threads
        i5 = i + _U5 * threads
        i6 = i + _U6 * threads
        i7 = i + _U7 * threads
        x1 = _span_load_dev(adv, value, adv_start, value_start, n_adv, i1) if i1 < n_load else _ZERO
        x2 = _span_load_dev(adv, value, adv_start, value_start, n_adv, i2) if i2 < n_load else _ZERO
        x3 = _span_load_dev(adv, value, adv_start, value_start, n_adv, i3) if i3 < n_load else _ZERO
        x4 = _span_load_dev(adv, value, adv_start, value_start, n_adv, i4) if i4 < n_load else _ZERO
        x5 = _span_load_dev(adv, value, adv_start, value_start, n_adv, i5) if i5 < n_load else _ZERO
        x6 = _span_load_dev(adv, value, adv_start, value_start, n_adv, i6) if i6 < n_load else _ZERO
        x7 = _span_load_dev(adv, value, adv_start, value_start, n_adv, i7) if i7 < n_load else _ZERO
        sh[i] = x0
        if i1 < n_load:
            sh[i1] = x1
        if i2 < n_load:
            sh[i2] = x2
        if i3 < n_load:
            sh[i3] = x3
        if i4 < n_load:
            sh[i4] = x4
        if i5 < n_load:
            sh[i5] = x5
        if i6 < n_load:
            sh[i6] = x6
        if i7 < n_load:
            sh[i7] = x7
        i += _U8 * threads


@_cuda.jit(cache=True)
def dueling_head_kernel(value, adv, n_atoms, width, fused, value_col, branch_sizes, branch_offsets, branch_inv_sizes,
                        support, max_actions, samples, want_logits, want_stats, want_probs, logits, lse, q, probs,
                        select, use_select):
    """One block per `samples` samples, block (HEAD_TX, HEAD_TY), dynamic shared memory
    (`head_shared_floats`): the block's value and advantage rows are loaded once, coalesced, and
    every output is computed from shared memory. value [B·Z], adv [B·ΣA·Z] and the outputs (logits,
    probs [B·nb·max_a·Z], lse, q [B·nb·max_a]) are flat views; n_atoms, width, max_actions, samples
    are uint64. fused: V is not a separate array but columns value_col .. value_col + Z of each adv row
    (the padded head's one GEMM for both streams, `BranchedDuelingC51Head(fuse_value=True)`); the span
    loaded is then the adv rows alone, V read from them in shared memory (`value` is not read).

    1. load  A [S, ΣA·Z] and V [S, Z] as one span (`_load_span_dev`: eight loads in flight);
    2. x     thread row per sample, lane per atom: base = V - (Σ_a A[a, z] in order a = 0..A_k-1)
             · (1/A_k) in a register, then A overwritten in place by x = A + base (the thread
             that read those slots writes them: no barrier between); the support, once per block;
    3. stats one thread per (s, k, a) row: its start in x (-1 for padding), and unless the pass
             wants logits only, the row max, then lse = max + log Σ e and Q = Σ e·z / Σ e with
             e = exp(x_z - max), each sum in atom order, unrolled by four; padding rows
             lse = q = -inf;
    4. rows  the block's outputs are one contiguous span of each: thread t writes elements t,
             t + threads, ... (all lanes busy, coalesced): logits x_z and/or probs exp(x_z - lse);
             padding logits -inf, probs 0.
    use_select (`BranchedDuelingC51Head.select_probs`): probs only, at one action per branch, select[b·nb + k]
    (int32 [B·nb]; one outside its branch gives a zero row): steps 3 and 4 run over the rows [n_s, nb] and write
    probs [B·nb·Z], each row the bits of the full pass's probs[b, k, select[b, k]] (the same operations).
    Fixed summation orders, no atomics: the same inputs give the same bits on every run. Every index
    is uint64 (constants _U0.._U8 included): a signed index costs Python's negative-index
    wraparound code at every array access (see `dueling_q_kernel`). The float32 operations per
    output are those of the earlier signed-index kernel that kept a separate base row (x = A + base
    rounded once, then max / exp(x - max) / exp(x - lse)), so the same bits.
    """
    # shared: A, then x [n_s, ΣA·Z] | V [n_s, Z] | lse [S·nb·max_a] | support [Z] | row starts [S·nb·max_a]
    sh = _cuda.shared.array(0, float32)
    batch = np.uint64(adv.shape[0]) // width
    n_branches = np.uint64(branch_sizes.shape[0])
    tx = np.uint64(_cuda.threadIdx.x)
    ty = np.uint64(_cuda.threadIdx.y)
    lanes = np.uint64(_cuda.blockDim.x)  # the launch shape is read, not compiled in: a cached kernel serves any shape
    rows_y = np.uint64(_cuda.blockDim.y)
    threads = lanes * rows_y
    t = ty * lanes + tx
    b0 = np.uint64(_cuda.blockIdx.x) * samples  # 64-bit: flat indices reach B·ΣA·Z
    n_s = min(samples, batch - b0)
    rows_per_sample = n_branches * max_actions
    n_adv = n_s * width  # V follows the block's A rows (fused: V is inside them)
    v_base, v_stride, n_load = n_adv, n_atoms, n_adv + n_s * n_atoms
    if fused:
        v_base, v_stride, n_load = value_col, width, n_adv
    off_lse = samples * (width + n_atoms)
    off_support = off_lse + samples * rows_per_sample
    off_rows = off_support + n_atoms

    # 1. load (the block's rows are contiguous in both GEMM outputs)
    _load_span_dev(sh, adv, value, b0 * width, b0 * n_atoms, n_adv, n_load, t, threads)
    _cuda.syncthreads()

    # 2. x = A + base in place, base[s, k, z] = V[s, z] - (Σ_a A[s, k, a, z]) · (1/A_k)
    s = ty
    while s < n_s:
        z = tx
        while z < n_atoms:
            first = s * width + z  # A[s, 0, 0, z]
            v = sh[v_base + s * v_stride + z]  # V[s, z]
            k = _U0
            while k < n_branches:
                n_actions = np.uint64(branch_sizes[k])
                start = first + np.uint64(branch_offsets[k]) * n_atoms
                acc = _ZERO
                a = _U0
                while a < n_actions:
                    acc = _sum_four_dev(sh, start + a * n_atoms, n_atoms, n_actions - a, acc)
                    a += _U4
                base = v - acc * branch_inv_sizes[k]
                a = _U0
                while a < n_actions:
                    _add_four_dev(sh, start + a * n_atoms, n_atoms, n_actions - a, base)
                    a += _U4
                k += _U1
            z += lanes
        s += rows_y
    i = t
    while i < n_atoms:
        sh[off_support + i] = support[i]
        i += threads
    _cuda.syncthreads()

    # 3. row statistics: log-sum-exp and Q, one thread per row (and each row's start in x, or -1 for
    # padding, for step 4)
    rows_out = n_branches if use_select else rows_per_sample  # the outputs' rows per sample
    if want_logits or want_probs or want_stats:
        r = t
        while r < n_s * rows_out:
            s = r // rows_out
            rem = r - s * rows_out
            if use_select:
                k = rem
                chosen = select[(b0 + s) * n_branches + k]
                a = max_actions if chosen < 0 else np.uint64(chosen)  # outside the branch: a zero row
            else:
                k = rem // max_actions
                a = rem - k * max_actions
            log_norm = _NEG_INF
            q_val = _NEG_INF
            x_start = _MINUS_ONE
            if a < np.uint64(branch_sizes[k]):
                row = s * width + (np.uint64(branch_offsets[k]) + a) * n_atoms
                x_start = float32(row)  # exact: shared offsets stay far below 2^24
                if want_stats or want_probs:
                    log_norm, q_val = _row_stats_dev(sh, row, n_atoms, sh, off_support)
            sh[off_lse + r] = log_norm
            sh[off_rows + r] = x_start
            if want_stats:
                lse[b0 * rows_per_sample + r] = log_norm
                q[b0 * rows_per_sample + r] = q_val
            r += threads
        _cuda.syncthreads()

    # 4. logits and / or probabilities: the block's outputs are one contiguous span [n_s, nb, max_a, Z]
    # of each; thread t writes its elements t, t + threads, ... (every lane busy, coalesced), the
    # element's (row, atom) stepped without a division
    if want_logits or want_probs:
        n_out = n_s * rows_out * n_atoms
        out_start = b0 * rows_out * n_atoms
        r = t // n_atoms
        z = t - r * n_atoms
        step_r = threads // n_atoms
        step_z = threads - step_r * n_atoms
        i = t
        while i < n_out:
            x_start = sh[off_rows + r]
            if x_start >= _ZERO:
                x = sh[np.uint64(x_start) + z]
                if want_logits:
                    logits[out_start + i] = x
                if want_probs:
                    probs[out_start + i] = math.exp(x - sh[off_lse + r])
            else:  # padding: defined, never NaN
                if want_logits:
                    logits[out_start + i] = _NEG_INF
                if want_probs:
                    probs[out_start + i] = _ZERO
            i += threads
            r += step_r
            z += step_z
            if z >= n_atoms:
                z -= n_atoms
                r += _U1


@_cuda.jit(cache=True)
def dueling_q_kernel(value, adv, n_atoms, width, fused, value_col, branch_sizes, branch_offsets, branch_inv_sizes,
                     support, max_actions, samples, lse, q):
    """The Q-only pass (lse and q, no logits, no probs): bit-identical to `dueling_head_kernel`'s
    statistics in fewer instructions, with a smaller footprint. One block per `samples`
    samples, block (Q_TX, Q_TY), dynamic shared memory A | V (`q_shared_floats`); value [B·Z] and
    adv [B·ΣA·Z] are flat views; n_atoms, width, max_actions, samples are uint64; fused, value_col: V in
    adv's rows, as in `dueling_head_kernel`.

    1. load   the block's A [S, ΣA·Z] and V [S, Z] rows as one span, coalesced, eight loads in flight
              per thread: five unguarded rounds over A and one guarded round over the rest of A and
              V at the defaults (guarding every load costs five times the instructions);
    2. logits thread per (s, z) column, for each branch: base = V - (Σ_a A[a, z] in order
              a = 0..A_k-1) · (1/A_k) in a register, then A overwritten in place by x = A + base
              (the thread that read those slots writes them: no barrier between);
    3. stats  one thread per (s, k, a) row of the padded output: row max, then Σ e and Σ e·z with
              e = exp(x_z - max), each in atom order z = 0..Z-1, unrolled by four so the shared
              loads and exps of four atoms issue before the running sums take them; lse = max +
              log Σ e, q = Σ e·z / Σ e; padding rows lse = q = -inf.
    Every index is uint64 (constants _U0.._U8 included: uint64 + int64 is float64 in numba): a
    signed index costs three to five more instructions per array access for Python's negative-index
    wraparound (counted in the PTX for sm_90: the eight-load copy step 116 -> 43 instructions, the
    atom-max loop 39 -> 24 per four atoms).
    Against `dueling_head_kernel` (signed indices, four loads in flight, a separate base row, two
    shared loads and an add per atom in the statistics): the same float32 operations in the same
    order per row, so the same bits.
    """
    sh = _cuda.shared.array(0, float32)  # A, then x [n_s, ΣA·Z] (rows as in adv) | V [n_s, Z]
    batch = np.uint64(adv.shape[0]) // width
    n_branches = np.uint64(branch_sizes.shape[0])
    tx = np.uint64(_cuda.threadIdx.x)
    ty = np.uint64(_cuda.threadIdx.y)
    lanes = np.uint64(_cuda.blockDim.x)  # the launch shape is read, not compiled in (numba's on-disk cache)
    rows_y = np.uint64(_cuda.blockDim.y)
    threads = lanes * rows_y
    t = ty * lanes + tx
    b0 = np.uint64(_cuda.blockIdx.x) * samples  # 64-bit: flat indices reach B·ΣA·Z
    n_s = min(samples, batch - b0)

    # 1. load: the block's A rows then its V rows (each contiguous in its GEMM output) as one span
    n_adv = n_s * width
    v_base, v_stride, n_load = n_adv, n_atoms, n_adv + n_s * n_atoms
    if fused:  # V inside the A rows
        v_base, v_stride, n_load = value_col, width, n_adv
    _load_span_dev(sh, adv, value, b0 * width, b0 * n_atoms, n_adv, n_load, t, threads)
    _cuda.syncthreads()

    # 2. x = A + base in place, base[s, k, z] = V[s, z] - (Σ_a A[s, k, a, z]) · (1/A_k): a thread
    # per (s, z) column walks the branches (the branch tables are read once per column, not per
    # (s, k) pair and atom step: a quarter of the instructions of a thread row per (s, k))
    col = t
    while col < n_s * n_atoms:
        s = col // n_atoms
        z = col - s * n_atoms
        first = s * width + z  # A[s, 0, 0, z]
        v = sh[v_base + s * v_stride + z]  # V[s, z]
        k = _U0
        while k < n_branches:
            n_actions = np.uint64(branch_sizes[k])
            start = first + np.uint64(branch_offsets[k]) * n_atoms
            acc = _ZERO
            at = start
            a = _U0
            while a < n_actions:
                acc += sh[at]
                at += n_atoms
                a += _U1
            base = v - acc * branch_inv_sizes[k]
            at = start
            a = _U0
            while a < n_actions:
                sh[at] = sh[at] + base
                at += n_atoms
                a += _U1
            k += _U1
        col += threads
    _cuda.syncthreads()

    # 3. row statistics, one thread per padded output row (s, k, a)
    rows_per_sample = n_branches * max_actions
    r = t
    while r < n_s * rows_per_sample:
        s = r // rows_per_sample
        rem = r - s * rows_per_sample
        k = rem // max_actions
        a = rem - k * max_actions
        log_norm = _NEG_INF
        q_val = _NEG_INF
        if a < np.uint64(branch_sizes[k]):
            row = s * width + (np.uint64(branch_offsets[k]) + a) * n_atoms
            log_norm, q_val = _row_stats_dev(sh, row, n_atoms, support, _U0)
        lse[b0 + s, k, a] = log_norm
        q[b0 + s, k, a] = q_val
        r += threads


@_cuda.jit(cache=True)
def dueling_backward_kernel(d_logits, branch_sizes, branch_offsets, branch_inv_sizes, d_value, d_adv):
    """Thread (z, b): dV[b, z] and dA[b, :, z] from d_logits (padding entries ignored); grid
    ceil(B / EW_ROWS), block (EW_ATOMS, EW_ROWS). uint64 indices (no negative-index wraparound
    code); the sums Σ_a in action order a = 0..A_k-1, four loads before their adds."""
    b = np.uint64(_cuda.blockIdx.x) * _EW_ROWS + np.uint64(_cuda.threadIdx.y)
    if b >= np.uint64(d_logits.shape[0]):
        return
    n_branches = np.uint64(d_logits.shape[1])
    n_atoms = np.uint64(d_logits.shape[3])
    z = np.uint64(_cuda.threadIdx.x)
    while z < n_atoms:
        dv = _ZERO
        k = _U0
        while k < n_branches:
            n_actions = np.uint64(branch_sizes[k])
            s = _ZERO
            a = _U0
            while a < n_actions:
                x0 = d_logits[b, k, a, z]
                x1 = d_logits[b, k, a + _U1, z] if a + _U1 < n_actions else _ZERO
                x2 = d_logits[b, k, a + _U2, z] if a + _U2 < n_actions else _ZERO
                x3 = d_logits[b, k, a + _U3, z] if a + _U3 < n_actions else _ZERO
                s += x0
                if a + _U1 < n_actions:
                    s += x1
                if a + _U2 < n_actions:
                    s += x2
                if a + _U3 < n_actions:
                    s += x3
                a += _U4
            dv += s
            mean = s * branch_inv_sizes[k]
            col = np.uint64(branch_offsets[k]) * n_atoms + z
            a = _U0
            while a < n_actions:
                d_adv[b, col] = d_logits[b, k, a, z] - mean
                col += n_atoms
                a += _U1
            k += _U1
        d_value[b, z] = dv
        z += _EW_ATOMS


@_cuda.jit(cache=True)
def dueling_backward_taken_kernel(rows, actions, branch_sizes, branch_offsets, branch_inv_sizes, d_value, d_adv):
    """`dueling_backward_kernel`'s dV and dA, bit for bit, from the taken rows alone (`TakenGrad`: d_logits zero at
    every other action): per branch, Σ_a d_logits[b, k, a, z] is 0 + g (the zeros add exactly), every action's dA
    is its entry less that sum's mean, and the taken action's entry is g. Reads [B, n_branches, Z] instead of
    [B, n_branches, max_actions, Z]. An action outside its branch (a zero row) matches no column. Thread (z, b),
    grid ceil(B / EW_ROWS), block (EW_ATOMS, EW_ROWS); uint64 indices."""
    b = np.uint64(_cuda.blockIdx.x) * _EW_ROWS + np.uint64(_cuda.threadIdx.y)
    if b >= np.uint64(rows.shape[0]):
        return
    n_branches = np.uint64(rows.shape[1])
    n_atoms = np.uint64(rows.shape[2])
    z = np.uint64(_cuda.threadIdx.x)
    while z < n_atoms:
        dv = _ZERO
        k = _U0
        while k < n_branches:
            n_actions = np.uint64(branch_sizes[k])
            taken_signed = actions[b, k]
            taken = n_actions  # matches no action
            if taken_signed >= 0 and taken_signed < branch_sizes[k]:
                taken = np.uint64(taken_signed)
            g = rows[b, k, z]
            s = _ZERO + g  # the dense sum: 0, then the zeros and g in action order
            dv += s
            mean = s * branch_inv_sizes[k]
            col = np.uint64(branch_offsets[k]) * n_atoms + z
            a = _U0
            while a < n_actions:
                d_adv[b, col] = (g if a == taken else _ZERO) - mean
                col += n_atoms
                a += _U1
            k += _U1
        d_value[b, z] = dv
        z += _EW_ATOMS


@_cuda.jit(cache=True)
def copy_cols_kernel(w_src, b_src, w_dst, b_dst, cols, src_col, dst_col, w_src2, b_src2, w_dst2, b_dst2, cols2,
                     src_col2, dst_col2):
    """w_dst[r, dst_col + j] = w_src[r, src_col + j] and b_dst[dst_col + j] = b_src[src_col + j] for j < cols
    (uint64): a padded layer's weight and bias into its zero-padded copy, or a padded gradient back; the other
    columns are not written. A second copy of the same rows (w_src2 ... dst_col2, cols2 columns; cols2 = 0: none)
    goes in the same launch. A grid-stride loop over the (rows + 1) x (cols + cols2) entries (the last row is the
    bias), uint64 indices."""
    rows = np.uint64(w_dst.shape[0])
    total = cols + cols2
    n = (rows + _U1) * total
    i = np.uint64(_cuda.grid(1))
    stride = np.uint64(_cuda.gridsize(1))
    while i < n:
        r = i // total
        j = i - r * total
        if j < cols:
            if r < rows:
                w_dst[r, dst_col + j] = w_src[r, src_col + j]
            else:
                b_dst[dst_col + j] = b_src[src_col + j]
        else:
            j -= cols
            if r < rows:
                w_dst2[r, dst_col2 + j] = w_src2[r, src_col2 + j]
            else:
                b_dst2[dst_col2 + j] = b_src2[src_col2 + j]
        i += stride


# ---------------------------------------------------------------------------------------------
# launchers and the layer
# ---------------------------------------------------------------------------------------------
OUTPUTS = ("logits", "probs", "q", "probs_at")  # probs_at: filled by select_probs, not by forward
FULL_OUTPUTS = ("logits", "probs", "q")  # a pass's outputs when it names none


class TakenGrad(NamedTuple):
    """The head's logits gradient when it is zero at every action but the taken one (the C51 loss alone, without
    a loss that adds at other actions): rows [B, n_branches, Z] = ∂L/∂logits[b, k, actions[b, k], :], actions
    [B, n_branches] int32/int64 (one outside its branch: a zero row, the dense gradient's all-zero block).
    `BranchedDuelingC51Head.backward` takes it in place of d_logits and gives the same bits without the dense
    [B, n_branches, max_actions, Z] array (`C51Loss`'s "logits_taken" gradient)."""
    rows: object
    actions: object


class C51Outputs(NamedTuple):
    """Fixed-address device views written by `BranchedDuelingC51Head.forward` for one tag
    (None for an output the tag was declared without)."""

    logits: object  # float32 [B, n_branches, max_actions, Z]
    probs: object  # float32 [B, n_branches, max_actions, Z] or None
    q: object  # float32 [B, n_branches, max_actions] or None
    probs_at: object = None  # float32 [B, n_branches, Z] (select_probs) or None


class BranchedDuelingC51Head(Module):
    """Dueling branched C51 head (module contract of numbarl.rl.nets.module).

    Parameters (weights [in, out], y = h @ W + b):
        {name}.value.w [H, Z]   {name}.value.b [Z]            group "{name}.value"
        {name}.adv.w [H, ΣA·Z]  {name}.adv.b [ΣA·Z]           group "{name}.adv"
    Buffers per tag (declare_acts): value, adv, logits, lse, q, and probs if requested by
    `outputs`; with backward=True the backward scratch d_value, d_adv, dh and the column-sum
    scratch of the accumulating bias gradients.

    forward(h, stream, tag, role) -> C51Outputs(logits, probs, q); backward(d_logits, stream, tag)
    -> dh, the four gradients by the gradient rule. compute="tf32" switches the GEMMs to TF32. pad_to: the
    advantage GEMMs' width rounded up to a multiple of it (module docstring, "Padded width"); the padded pass
    declares w_adv_pad / b_adv_pad and, with backward, dw_adv_pad / db_adv_pad. fuse_value: the value stream
    joins the advantage's GEMM as its columns ΣA·Z .. ΣA·Z + Z (one GEMM per pass for both, at
    round_up(ΣA·Z + Z, pad_to) columns; no value / d_value buffers: `pass_views` gives V as a view).
    """

    native_dx_accumulate = True  # dh ends in GEMMs: the first takes the ledger's beta

    def __init__(self, name: str, hidden: int, branch_sizes, n_atoms: int = 51, v_min: float = -10.0,
                 v_max: float = 10.0, compute: str = "fp32", pad_to: int = 1, fuse_value: bool = False):
        super().__init__(name)
        self.hidden = int(hidden)
        self.branch_sizes = tuple(int(a) for a in branch_sizes)
        if self.hidden < 1:
            raise ValueError(f"{name}: hidden must be >= 1 (got {hidden})")
        if not self.branch_sizes or min(self.branch_sizes) < 1:
            raise ValueError(f"{name}: branch_sizes must be a non-empty tuple of sizes >= 1 (got {branch_sizes})")
        if compute not in blas.COMPUTES:
            raise ValueError(f"{name}: compute must be one of {blas.COMPUTES} (got {compute!r})")
        self.n_branches = len(self.branch_sizes)
        self.max_actions = max(self.branch_sizes)
        self.total_actions = sum(self.branch_sizes)
        self.n_atoms = int(n_atoms)
        self.v_min = float(v_min)
        self.v_max = float(v_max)
        self.compute = compute
        self.support_host = make_support(self.n_atoms, v_min, v_max)  # validates n_atoms, v_min, v_max
        if int(pad_to) < 1:
            raise ValueError(f"{name}: pad_to must be >= 1 (got {pad_to})")
        self.width = self.total_actions * self.n_atoms  # the advantage GEMM's logical width ΣA·Z
        self.fused = bool(fuse_value)  # V in the advantage GEMM's columns width .. width + Z
        self.value_col = self.width
        cols = self.width + (self.n_atoms if self.fused else 0)
        self.padded_width = -(-cols // int(pad_to)) * int(pad_to)  # the GEMM's width in the passes
        self.plain = self.padded_width == self.width  # unpadded and unfused: the parameters used as they are

        # constant per-branch tables, uploaded once (before any capture)
        layout = Arena(f"{name}.layout")
        layout.add("branch_sizes", (self.n_branches,), np.int32)
        layout.add("branch_offsets", (self.n_branches,), np.int32)
        layout.add("branch_inv_sizes", (self.n_branches,), np.float32)
        layout.add("support", (self.n_atoms,), np.float32)
        layout.add("unused4", (1, 1, 1, 1), np.float32)  # stands in for an output a pass does not want
        layout.add("unused3", (1, 1, 1), np.float32)
        layout.add("no_select", (1, 1), np.int32)  # dueling_head_kernel's select when a pass selects nothing
        layout.allocate()
        layout.load({
            "branch_sizes": np.asarray(self.branch_sizes, np.int32),
            "branch_offsets": branch_offsets(self.branch_sizes).astype(np.int32),
            "branch_inv_sizes": (1.0 / np.asarray(self.branch_sizes, np.float64)).astype(np.float32),
            "support": self.support_host,
        })
        self.layout = layout

    @property
    def support(self):
        """float32 device [Z] support of the head."""
        return self.layout["support"]

    def set_support(self, v_min: float, v_max: float) -> None:
        """Write a new support linspace(v_min, v_max, Z) into the device array every pass reads
        (`dueling_head_kernel` and `dueling_q_kernel` take it from device memory, so a captured graph
        follows). A host copy: between graph replays, never inside a capture."""
        support = make_support(self.n_atoms, v_min, v_max)
        self.v_min, self.v_max, self.support_host = float(v_min), float(v_max), support
        self.layout.load({"support": support})

    # -- declarations -------------------------------------------------------------------------
    def params(self) -> list[Param]:
        h, z, width = self.hidden, self.n_atoms, self.total_actions * self.n_atoms
        value, adv = f"{self.name}.value", f"{self.name}.adv"
        return [Param("value.w", (h, z), kaiming_uniform_init, decay=True, group=value, key="w_value"),
                Param("value.b", (z,), bias_uniform_init(h), group=value, key="b_value"),
                Param("adv.w", (h, width), kaiming_uniform_init, decay=True, group=adv, key="w_adv"),
                Param("adv.b", (width,), bias_uniform_init(h), group=adv, key="b_adv")]

    def in_shape(self, batch: int) -> tuple:
        return (batch, self.hidden)

    def buffers(self, batch: int, backward: bool, outputs=FULL_OUTPUTS, **opts) -> list[Buf]:
        """Buffers of one pass. backward=False skips the backward scratch (target / next passes).

        outputs: which of "logits", "probs", "q" the pass computes (one kernel launch either way;
        each output left out is a [B, n_branches, max_actions, Z] store saved). "q" also writes the
        row log-sum-exp (lse). "probs_at" declares [B, n_branches, Z] for `select_probs` (the forward then
        runs the GEMM alone when it is the only output). The train step declares ("logits", "q") for the
        online pass (logits for the loss, Q for the logged Q-mean), ("q",) for the next-obs pass and
        ("probs_at",) for the target pass (("probs",) where a reader wants every action's); acting and
        evaluation declare ("q",).
        """
        unknown = set(outputs) - set(OUTPUTS)
        if unknown or not outputs:
            raise ValueError(f"{self.name}: outputs must be a non-empty subset of {OUTPUTS} (got {tuple(outputs)})")
        b, z, wp = int(batch), self.n_atoms, self.padded_width
        shape4 = (b, self.n_branches, self.max_actions, z)
        bufs = ([] if self.fused else [Buf("value", (b, z))]) + [Buf("adv", (b, wp))]
        if not self.plain:  # the pass's zero-padded copy of adv.w / adv.b (and value's, fused; pads stay zero)
            bufs += [Buf("w_adv_pad", (self.hidden, wp)), Buf("b_adv_pad", (wp,))]
        if "logits" in outputs:
            bufs.append(Buf("logits", shape4))
        if "q" in outputs:
            bufs += [Buf("lse", shape4[:3]), Buf("q", shape4[:3])]
        if "probs" in outputs:
            bufs.append(Buf("probs", shape4))
        if "probs_at" in outputs:
            bufs.append(Buf("probs_at", (b, self.n_branches, z)))
        if backward:
            if not self.plain:  # the padded weight gradient's GEMM output, copied back into the gradients
                bufs += [Buf("dw_adv_pad", (self.hidden, wp)), Buf("db_adv_pad", (wp,))]
            bufs += [] if self.fused else [Buf("d_value", (b, z))]
            bufs += [Buf("d_adv", (b, wp)), Buf("dh", (b, self.hidden)),
                     Buf("partials_value", reduce.col_partials_shape(b, z)),
                     Buf("partials_adv", reduce.col_partials_shape(b, self.width))]
        return bufs

    def pass_views(self, tag: str, grads: bool = False):
        """(V [B, Z], A [B, ≥ ΣA·Z]) of a pass: its value and advantage buffers, or with grads=True d_value and
        d_adv. Fused, V is a strided view of the advantage buffer's columns ΣA·Z .. ΣA·Z + Z. A's rows may be
        wider than ΣA·Z (padded): index them as A[b, (offset_k + a)·Z + z]."""
        acts = self._arena(tag)
        adv = acts[self._buf_name(tag, "d_adv" if grads else "adv")]
        if self.fused:
            return adv[:, self.value_col:self.value_col + self.n_atoms], adv
        return acts[self._buf_name(tag, "d_value" if grads else "value")], adv

    def outputs(self, tag: str = "online") -> C51Outputs:
        acts = self._arena(tag)

        def view(what):
            name = self._buf_name(tag, what)
            return acts[name] if name in acts else None  # noqa: SIM401 (an Arena has no .get)

        return C51Outputs(view("logits"), view("probs"), view("q"), view("probs_at"))

    def dx_buffer(self, c: Ctx):
        return c.buf("dh")

    # -- kernels ------------------------------------------------------------------------------
    def forward_impl(self, c: Ctx, h) -> C51Outputs:
        """The two GEMMs, then the dueling combination + softmax in one launch."""
        adv = c.buf("adv")
        if not self.fused:
            blas.gemm(h, c.p("w_value"), c.buf("value"), bias=c.p("b_value"), compute=self.compute, stream=c.stream)
        w_adv, b_adv = self._adv_weights(c, refresh=True)
        blas.gemm(h, w_adv, adv, bias=b_adv, compute=self.compute, stream=c.stream)  # fused: V's columns too
        out = self.outputs(c.tag)
        if out.logits is None and out.q is None and out.probs is None:  # probs_at alone: select_probs computes it
            return out
        lse = c.buf("lse") if out.q is not None else None
        dueling_forward(None if self.fused else c.buf("value"), adv, self.layout, c.stream, logits=out.logits,
                        lse=lse, q=out.q, probs=out.probs, width=self.width,
                        value_col=self.value_col if self.fused else None)
        return out

    def select_probs(self, tag: str, actions, stream):
        """The probabilities of pass `tag` at one action per branch, actions [B, n_branches] int32 (e.g. the
        double-DQN a*), into its "probs_at" output [B, n_branches, Z]: the rows of the full "probs" output at those
        actions, bit for bit, without the other actions' exps and stores (the train step's target pass: the
        projection reads a*'s row only). After forward(tag), on the same GEMM output; returns the view."""
        out = self.outputs(tag)
        if out.probs_at is None:
            raise ValueError(f"{self.name}.select_probs({tag!r}): the pass was declared without 'probs_at'")
        if tag not in self._inputs:
            raise RuntimeError(f"{self.name}.select_probs({tag!r}) before forward({tag!r})")
        value, adv = self.pass_views(tag)
        dueling_forward(None if self.fused else value, adv, self.layout, stream, probs=out.probs_at, width=self.width,
                        value_col=self.value_col if self.fused else None, select=actions,
                        max_actions=self.max_actions)
        return out.probs_at

    def _adv_weights(self, c: Ctx, refresh: bool):
        """The advantage GEMM's weight and bias in this pass: the parameters themselves, or (padded) the pass's
        zero-padded copy of them, refreshed by the forward (`copy_cols_kernel`) and read again by the backward."""
        if self.plain:
            return c.p("w_adv"), c.p("b_adv")
        w_pad, b_pad = c.buf("w_adv_pad"), c.buf("b_adv_pad")
        if refresh:
            # fused: the value stream's weight and bias into the columns after the advantage's, in the same launch
            value = ColCopy(c.p("w_value"), c.p("b_value"), w_pad, b_pad, dst_col=self.value_col) if self.fused else None
            copy_cols(c.p("w_adv"), c.p("b_adv"), w_pad, b_pad, c.stream, then=value)
        return w_pad, b_pad

    def backward_impl(self, c: Ctx, d_logits, dh):
        """dV, dA from d_logits [B, n_branches, max_actions, Z] or a `TakenGrad` (its taken rows, the same bits);
        the four gradients by the gradient rule; dh = dV·W_vᵀ + dA·W_aᵀ into `dh` (the second GEMM
        accumulates; fused, one GEMM)."""
        taken = isinstance(d_logits, TakenGrad)
        expected = (c.batch, self.n_branches) + ((self.n_atoms,) if taken else (self.max_actions, self.n_atoms))
        got = tuple((d_logits.rows if taken else d_logits).shape)
        if got != expected:
            what = "the taken rows" if taken else "d_logits"
            raise ValueError(f"{self.name}.backward: {what} have shape {got}, expected {expected}")
        h = c.x()
        d_value, d_adv = self.pass_views(c.tag, grads=True)
        if taken:  # d_adv's pad columns stay zero
            dueling_backward_taken(d_logits, self.layout, d_value, d_adv, c.stream)
        else:
            dueling_backward(d_logits, self.layout, d_value, d_adv, c.stream)
        gs = graph.side_stream(c.stream)  # the weight gradients: beside dh's GEMM inside the agent's beside
        if not self.fused:
            linear_param_grads(c, h, d_value, "w_value", "b_value", c.buf("partials_value"), self.compute, stream=gs)
        betas = {key: c.beta(key) for key in ("w_adv", "b_adv") + (("w_value", "b_value") if self.fused else ())}
        if not self.plain and not any(betas.values()):  # padded, the step's first write: one GEMM at Wp, copied back
            dw_pad, db_pad = c.buf("dw_adv_pad"), c.buf("db_adv_pad")
            blas.gemm(h, d_adv, dw_pad, trans_a=True, epilogue="bgrad", bias_grad=db_pad, compute=self.compute,
                      stream=gs)
            value = (ColCopy(dw_pad, db_pad, c.g("w_value"), c.g("b_value"), src_col=self.value_col) if self.fused
                     else None)
            copy_cols(dw_pad, db_pad, c.g("w_adv"), c.g("b_adv"), gs, cols=self.width, then=value)
        else:  # unpadded, or a later write that adds: at the logical widths (a strided view of a padded d_adv)
            d_adv_cols = d_adv if self.plain else d_adv[:, :self.width]
            linear_param_grads(c, h, d_adv_cols, "w_adv", "b_adv", c.buf("partials_adv"), self.compute,
                               betas=(betas["w_adv"], betas["b_adv"]), stream=gs)
            if self.fused:
                linear_param_grads(c, h, d_value, "w_value", "b_value", c.buf("partials_value"), self.compute,
                                   betas=(betas["w_value"], betas["b_value"]), stream=gs)
        w_adv, _ = self._adv_weights(c, refresh=False)  # K = the padded width: zero columns add exact zeros
        if self.fused:  # dh = [dA | dV | 0]·[W_a | W_v | 0]ᵀ: one GEMM
            blas.gemm(d_adv, w_adv, dh, trans_b=True, beta=c.dx_beta, compute=self.compute, stream=c.stream)
        else:
            blas.gemm(d_value, c.p("w_value"), dh, trans_b=True, beta=c.dx_beta, compute=self.compute,
                      stream=c.stream)
            blas.gemm(d_adv, w_adv, dh, trans_b=True, beta=1.0, compute=self.compute, stream=c.stream)
        return dh

    # -- float64 reference of the layer (host dict of params by name; composable with Linear's) --
    def forward_ref(self, h, params):
        """(C51Outputs of float64 arrays, cache) for h [B, hidden]; params: host dict by name."""
        n = self.param_names
        logits, probs, q = head_forward_ref(h, params[n["w_value"]], params[n["b_value"]], params[n["w_adv"]],
                                            params[n["b_adv"]], self.branch_sizes, self.support_host)
        return C51Outputs(logits, probs, q), np.asarray(h, np.float64)

    def backward_ref(self, d_logits, cache, params):
        """(dh, {param name: grad}) from d_logits, float64."""
        n = self.param_names
        g = head_backward_ref(cache, params[n["w_value"]], params[n["w_adv"]], d_logits, self.branch_sizes)
        return g["dh"], {n["w_value"]: g["dw_value"], n["b_value"]: g["db_value"], n["w_adv"]: g["dw_adv"],
                         n["b_adv"]: g["db_adv"]}


def _check(name, arr, shape, dtype=np.float32):
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"c51 head: {name} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
    if np.dtype(arr.dtype) != np.dtype(dtype):
        raise TypeError(f"c51 head: {name} has dtype {arr.dtype}, expected {np.dtype(dtype)}")


def head_shared_floats(samples: int, n_atoms: int, width: int, n_branches: int, max_actions: int) -> int:
    """float32 slots of dynamic shared memory one forward block uses (A, then x | V | lse | support | row starts)."""
    return samples * (width + n_atoms + 2 * n_branches * max_actions) + n_atoms


def q_shared_floats(samples: int, width: int, n_atoms: int) -> int:
    """float32 slots of dynamic shared memory one `dueling_q_kernel` block uses (A | V)."""
    return samples * (width + n_atoms)


def dueling_forward(value, adv, layout: Arena, stream, logits=None, lse=None, q=None, probs=None,
                    block=None, samples=None, q_kernel: str = "q", width=None, value_col=None, select=None,
                    max_actions=None) -> None:
    """The dueling combination and its softmax in one launch; writes only the outputs given.

    value [B, Z], adv [B, ΣA·Z]; logits, probs [B, n_branches, max_actions, Z]; lse, q
    [B, n_branches, max_actions] (both or neither). layout: Arena with int32 branch_sizes /
    branch_offsets, float32 branch_inv_sizes, support and the unused4 / unused3 stand-ins
    (`BranchedDuelingC51Head.layout`). block (lanes, thread rows) and samples (per block, at most)
    default to HEAD_TX/HEAD_TY and HEAD_SAMPLES (Q_TX/Q_TY and Q_SAMPLES for the Q-only kernel);
    every shape gives the same bits.

    width: the advantage's logical width ΣA·Z when adv's rows are wider (a padded GEMM output whose
    columns past ΣA·Z the kernels never read: they take adv.shape[1] as the row stride); None: all of
    adv's columns (a multiple of the atoms).

    value_col: V is not a separate array (value None) but adv's columns value_col .. value_col + Z, at or
    after the advantage's width (the fused padded layout: one GEMM for both streams).

    q_kernel: for a Q-only pass (lse and q, no logits, no probs: acting, the next-obs pass), "q"
    launches `dueling_q_kernel` and "head" the general `dueling_head_kernel` (kept for
    `python -m numbarl.bench.head`, which times both); the two write the same bits. Passes with
    logits or probs always use `dueling_head_kernel`.

    select: int32 [B, n_branches], one action per branch: probs (alone, no logits / lse / q) is then
    [B, n_branches, Z], each row the full pass's probs[b, k, select[b, k]] bit for bit (a zero row for an action
    outside its branch); max_actions (the padded layout's, max_k A_k) must be given with it.
    """
    if select is not None:
        if probs is None or logits is not None or q is not None or lse is not None or max_actions is None:
            raise ValueError("c51 head: select writes probs alone ([B, n_branches, Z]) and needs max_actions")
        _check("select", select, (adv.shape[0], layout["branch_sizes"].shape[0]), np.int32)
        _check("probs", probs, (adv.shape[0], layout["branch_sizes"].shape[0], layout["support"].shape[0]))
    if q_kernel not in Q_KERNELS:
        raise ValueError(f"c51 head: q_kernel must be one of {Q_KERNELS} (got {q_kernel!r})")
    given = [x for x in (logits, probs) if x is not None]
    if (lse is None) != (q is None):
        raise ValueError("c51 head: lse and q are written together: give both or neither")
    if not given and q is None:
        raise ValueError("c51 head: dueling_forward needs at least one output (logits, probs or q)")
    n_atoms = layout["support"].shape[0]
    batch = adv.shape[0]
    sizes = layout["branch_sizes"]
    n_branches = sizes.shape[0]
    max_actions = int(max_actions) if select is not None else (given[0].shape[2] if given else q.shape[2])
    shape4 = (batch, n_branches, max_actions, n_atoms)
    _check("adv", adv, (batch, adv.shape[1]))
    _check("support", layout["support"], (n_atoms,))
    for name, arr in (("logits", logits), ("probs", None if select is not None else probs)):
        if arr is not None:
            _check(name, arr, shape4)
    for name, arr in (("lse", lse), ("q", q)):
        if arr is not None:
            _check(name, arr, shape4[:3])
    width = adv.shape[1] if width is None else int(width)
    if width % n_atoms or width > adv.shape[1]:
        raise ValueError(f"c51 head: the advantage's width {width} is not a multiple of {n_atoms} atoms "
                         f"or exceeds adv's {adv.shape[1]} columns")
    if (value is None) == (value_col is None):
        raise ValueError("c51 head: give value, or value_col (V inside adv's rows), not both or neither")
    if value is None:
        value_col = int(value_col)
        if value_col < width or value_col + n_atoms > adv.shape[1]:
            raise ValueError(f"c51 head: value_col {value_col} puts V's {n_atoms} columns outside adv's columns "
                             f"{width} .. {adv.shape[1]}")
        value, fused = adv, True  # a stand-in the kernels never read
    else:
        _check("value", value, (batch, n_atoms))
        value_col, fused = 0, False
    if q_kernel == "q" and not given:
        _dueling_q(value, adv, layout, stream, lse, q, max_actions, block, samples, fused, value_col)
        return
    per_sample = (head_shared_floats(1, n_atoms, adv.shape[1], n_branches, max_actions) - n_atoms) * 4
    samples = min(HEAD_SAMPLES if samples is None else int(samples), (SHARED_BYTES_MAX - n_atoms * 4) // per_sample)
    if samples < 1:
        raise ValueError(f"c51 head: {n_atoms} atoms x {adv.shape[1] // n_atoms} actions need {per_sample} bytes of "
                         f"shared memory per sample, more than a block's {SHARED_BYTES_MAX}")
    shared_bytes = head_shared_floats(samples, n_atoms, adv.shape[1], n_branches, max_actions) * 4
    u4, u3 = layout["unused4"], layout["unused3"]
    grid = max(1, -(-batch // samples))
    block = (HEAD_TX, HEAD_TY) if block is None else tuple(int(x) for x in block)
    # A non-finite input (a diverged trunk) makes this launch compute inf - inf = NaN, as the GPU
    # does silently; under the CUDA simulator each thread's float32 arithmetic is numpy scalar
    # arithmetic, which also printed "RuntimeWarning: invalid value encountered in scalar add" on
    # the user's terminal. The NaN is the signal: the trainer's non-finite guard stops the run and
    # names the tensor. (numpy.errstate is per thread: it does not reach the simulated threads.)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dueling_head_kernel[grid, block, stream, shared_bytes](
            value.reshape(value.size), adv.reshape(adv.size), np.uint64(n_atoms), np.uint64(adv.shape[1]), fused,
            np.uint64(value_col), sizes, layout["branch_offsets"], layout["branch_inv_sizes"], layout["support"],
            np.uint64(max_actions), np.uint64(samples), logits is not None, q is not None, probs is not None,
            _flat(u4 if logits is None else logits), _flat(u3 if lse is None else lse), _flat(u3 if q is None else q),
            _flat(u4 if probs is None else probs), _flat(layout["no_select"] if select is None else select),
            select is not None)


def _flat(array):
    """A C-contiguous device array as a flat view (`dueling_head_kernel` writes its outputs by flat index)."""
    return array.reshape(array.size)


def _dueling_q(value, adv, layout: Arena, stream, lse, q, max_actions, block, samples, fused, value_col) -> None:
    """Launch `dueling_q_kernel` (shapes already checked by `dueling_forward`)."""
    batch, width = adv.shape
    n_atoms = layout["support"].shape[0]
    per_sample = q_shared_floats(1, width, n_atoms) * 4
    samples = min(Q_SAMPLES if samples is None else int(samples), SHARED_BYTES_MAX // per_sample)
    if samples < 1:
        raise ValueError(f"c51 head: {n_atoms} atoms x {width // n_atoms} actions need {per_sample} bytes of "
                         f"shared memory per sample, more than a block's {SHARED_BYTES_MAX}")
    block = (Q_TX, Q_TY) if block is None else tuple(int(x) for x in block)
    grid = max(1, -(-batch // samples))
    with warnings.catch_warnings():  # non-finite inputs: see dueling_forward
        warnings.simplefilter("ignore", RuntimeWarning)
        dueling_q_kernel[grid, block, stream, q_shared_floats(samples, width, n_atoms) * 4](
            value.reshape(value.size), adv.reshape(adv.size), np.uint64(n_atoms), np.uint64(width), fused,
            np.uint64(value_col), layout["branch_sizes"], layout["branch_offsets"], layout["branch_inv_sizes"],
            layout["support"],
            np.uint64(max_actions), np.uint64(samples), lse, q)


class ColCopy(NamedTuple):
    """One copy of `copy_cols`: cols (None: as many as both have) columns of w_src [H, ·] / b_src from src_col into
    w_dst [H, ·] / b_dst at dst_col."""
    w_src: object
    b_src: object
    w_dst: object
    b_dst: object
    src_col: int = 0
    dst_col: int = 0
    cols: object = None


def _col_copy(c: ColCopy, rows: int) -> tuple:
    """(w_src, b_src, w_dst, b_dst, cols, src_col, dst_col) of a checked ColCopy into rows-row weights."""
    w_src, b_src, w_dst, b_dst, src_col, dst_col, cols = c
    cols = min(w_src.shape[1] - src_col, w_dst.shape[1] - dst_col) if cols is None else int(cols)
    _check("w_src", w_src, (rows, w_src.shape[1]))
    _check("w_dst", w_dst, (rows, w_dst.shape[1]))
    _check("b_src", b_src, (w_src.shape[1],))
    _check("b_dst", b_dst, (w_dst.shape[1],))
    if cols < 1 or src_col < 0 or dst_col < 0 or src_col + cols > w_src.shape[1] or dst_col + cols > w_dst.shape[1]:
        raise ValueError(f"c51 head: {cols} columns from {src_col} of {w_src.shape[1]} into {dst_col} of "
                         f"{w_dst.shape[1]} do not fit")
    return w_src, b_src, w_dst, b_dst, cols, src_col, dst_col


def copy_cols(w_src, b_src, w_dst, b_dst, stream, src_col: int = 0, dst_col: int = 0, cols=None,
              then: ColCopy | None = None) -> None:
    """`cols` columns of a weight [H, ·] and entries of its bias [·] from (w_src, b_src) at src_col into (w_dst,
    b_dst) at dst_col (default: as many as both have): a padded layer's per-pass copy of its parameters (the pad
    columns keep their zeros), or its padded weight gradient back into the parameters' gradients. then: a second
    copy of the same rows done by the same launch (the value stream's columns beside the advantage's)."""
    rows = w_dst.shape[0]
    first = _col_copy(ColCopy(w_src, b_src, w_dst, b_dst, src_col, dst_col, cols), rows)
    second = _col_copy(then, rows) if then is not None else first[:4] + (0,) + first[5:]
    blocks, threads = elementwise.stride_launch((rows + 1) * (first[4] + second[4]))
    ws, bs, wd, bd, c1, s1, d1 = first
    ws2, bs2, wd2, bd2, c2, s2, d2 = second
    copy_cols_kernel[blocks, threads, stream](ws, bs, wd, bd, np.uint64(c1), np.uint64(s1), np.uint64(d1),
                                              ws2, bs2, wd2, bd2, np.uint64(c2), np.uint64(s2), np.uint64(d2))


def taken_rows_dense_ref(rows, actions, branch_sizes) -> np.ndarray:
    """The dense d_logits [B, n_branches, max_actions, Z] a TakenGrad stands for (host arrays): its rows at the taken
    actions, zeros elsewhere (an action outside its branch: none)."""
    rows, actions = np.asarray(rows), np.asarray(actions)
    dense = np.zeros(rows.shape[:2] + (max(branch_sizes),) + rows.shape[2:], rows.dtype)
    for k, n in enumerate(branch_sizes):
        ok = (actions[:, k] >= 0) & (actions[:, k] < n)
        dense[np.flatnonzero(ok), k, actions[ok, k]] = rows[ok, k]
    return dense


def dueling_backward_taken(grad: TakenGrad, layout: Arena, d_value, d_adv, stream) -> None:
    """dV [B, Z] and dA [B, ΣA·Z] from the taken rows (`TakenGrad`): `dueling_backward`'s bits."""
    rows, actions = grad
    batch, n_branches, n_atoms = rows.shape
    _check("taken rows", rows, rows.shape)
    _check("d_value", d_value, (batch, n_atoms))
    _check("d_adv", d_adv, (batch, d_adv.shape[1]))
    if tuple(actions.shape) != (batch, n_branches) or np.dtype(actions.dtype) not in (np.int32, np.int64):
        raise ValueError(f"c51 head: taken actions {tuple(actions.shape)} {actions.dtype}, expected "
                         f"({batch}, {n_branches}) int32/int64")
    if layout["branch_sizes"].shape[0] != n_branches:
        raise ValueError(f"c51 head: layout has {layout['branch_sizes'].shape[0]} branches, the rows have {n_branches}")
    dueling_backward_taken_kernel[max(1, -(-batch // EW_ROWS)), (EW_ATOMS, EW_ROWS), stream](
        rows, actions, layout["branch_sizes"], layout["branch_offsets"], layout["branch_inv_sizes"], d_value, d_adv)


def dueling_backward(d_logits, layout: Arena, d_value, d_adv, stream) -> None:
    """dV [B, Z] and dA [B, ΣA·Z] from d_logits [B, n_branches, max_actions, Z]."""
    batch, n_branches, _, n_atoms = d_logits.shape
    _check("d_logits", d_logits, d_logits.shape)
    _check("d_value", d_value, (batch, n_atoms))
    _check("d_adv", d_adv, (batch, d_adv.shape[1]))
    if layout["branch_sizes"].shape[0] != n_branches:
        raise ValueError(f"c51 head: layout has {layout['branch_sizes'].shape[0]} branches, d_logits have {n_branches}")
    dueling_backward_kernel[max(1, -(-batch // EW_ROWS)), (EW_ATOMS, EW_ROWS), stream](
        d_logits, layout["branch_sizes"], layout["branch_offsets"], layout["branch_inv_sizes"], d_value, d_adv)
