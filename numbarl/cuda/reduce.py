"""Deterministic, fixed-order reductions (SPEC §2.1: no float atomics, same input -> same bits).

Every reduction here combines values in an order that depends only on the input *shape*, never
on timing, the number of SMs or a previous run, so repeated runs (eager or graph replay) give
bitwise identical results on the same GPU. Nothing uses atomics.

API (launchers never allocate, copy to/from the host or synchronize: safe inside a graph
capture; plan objects allocate their scratch once, when they are built)::

    # flat reductions over one float32 vector or the concatenation of several
    red = Reducer(n)                          # or Reducer([n1, n2, ...]); allocates scratch once
    red.sum(x, out, stream, at=0)             # out[at] = sum(x)           (out: float32 device, 1-D)
    red.mean(x, out, stream, at=0)            # out[at] = sum(x) / n
    red.max(x, out, stream, at=0)             # out[at] = max(x)   (NaN propagates, like np.max)
    red.min(x, out, stream, at=0)
    red.sumsq(x, out, stream, at=0)           # out[at] = sum(x**2)
    red.l2norm(x, out, stream, at=0)          # out[at] = sqrt(sum(x**2))
    # x: a float32 device array (any contiguous shape) or, for Reducer([n1, n2, ...]), a list of
    # arrays with those sizes (global-norm clipping over several gradient tensors).
    flat_partials_size(sizes) -> int          # scratch floats, for callers who place it themselves
    flat_reduce(xs, out, partials, op, stream, at=0)   # the same with caller-owned scratch

    # row reductions over the last axis of x[R, C] (no scratch)
    row_sum(x, out, stream) / row_mean / row_max / row_min / row_sumsq     # out[R] float32
    row_argmax(x, out, stream)                # out[R] integer: first index of the max (np.argmax)

    # column reductions over the rows of x[R, C] (bias gradient of a linear layer)
    col_partials_shape(R, C) -> (n_chunks, C)
    col_sum(x, out, partials, stream, accumulate=False)   # out[C] (+)= sum over rows
    ColSum(R, C).run(x, out, stream, accumulate=False)    # plan owning `partials`

Flat reductions (two phases):
  1. ``G = flat_blocks(n)`` blocks of ``BLOCK`` threads. Thread t of block b folds the elements
     ``i = b*BLOCK + t + k*G*BLOCK`` (k = 0, 1, ...) in increasing k (four loads in flight per
     step, combined as ``acc (+) ((a0 (+) a1) (+) (a2 (+) a3))``), then the block folds its
     ``BLOCK`` values with the fixed radix-16 tree of :func:`block_reduce` into ``partials[b]``.
  2. One block folds the ``G`` partials the same way and applies the final map (/n, sqrt).
  G depends only on n (``max_blocks`` caps it; the default suits an H200 and any other GPU),
  and when G == 1 phase 1 writes the result directly (one launch).

Row reductions: one row per group of ``LANES`` = 32 threads, ``ROWS`` = 8 rows per block
(block shape (LANES, ROWS)). Lane l folds columns l, l+32, ... in order; the 32 lane values
go through shared memory and every lane folds them in lane order 0..31 (one barrier).

Column reductions (two phases): rows are split into ``n_chunks`` chunks of ``chunk_rows``
rows (both functions of R only, see :func:`col_plan`). Block (column tile of 32, chunk) has
threads (lane -> column, ty -> rows ty, ty+8, ... of the chunk); the 8 per-ty values are
folded in ty order into ``partials[chunk, c]``; a second launch of the same kernel folds the
partials over chunks. R = 16384, C = 512: 64 chunks x 16 tiles = 1024 blocks, then 16 blocks.

Accumulation is float32 (the tree keeps the error at O(log n) ulps for the sizes used here).
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, int32

from numbarl.cuda.runtime import cuda, simulator  # the backend (GPU or simulator), selected once

_cuda = cuda()

# ---------------------------------------------------------------------------------------------
# constants
# ---------------------------------------------------------------------------------------------
# block tree: 256 values -> 16 (each of 16 threads folds 16) -> 1. Under the simulator, where every
# simulated thread is a Python thread, the same tree runs on 16 threads (radix 4): results there are
# compared with tolerances, never bitwise against the GPU.
RADIX = 4 if simulator() else 16
BLOCK = RADIX * RADIX  # threads per block for flat reductions
MAX_BLOCKS = 2 if simulator() else 1024  # phase-1 blocks cap: 262,144 threads keep an H200's 132 SMs full
ITEMS = 4  # loads in flight per thread per step (unrolled)
# Row groups of 32 lanes (one warp) on the GPU. Under the simulator one lane per row and 4 rows per
# block: the same kernels with 32x fewer simulated (Python) threads and no barrier in row_fold (a
# simulated barrier costs ~30 ms per block), so a C51 head pass over 16 samples takes milliseconds
# instead of seconds. Simulator results are compared with tolerances, never bitwise with the GPU.
LANES = 1 if simulator() else 32  # threads per row (row reductions) / columns per tile (column reductions)
ROWS = 4 if simulator() else 8  # rows per block (row reductions) / row lanes per block (column reductions)
CHUNK_ROWS = 256  # rows per chunk for column reductions (before the MAX_CHUNKS cap)
MAX_CHUNKS = 1024

# op codes (combine)
OP_SUM = 0
OP_MAX = 1
OP_MIN = 2
# element maps applied before combining
MAP_ID = 0
MAP_SQUARE = 1
# final maps applied to the result
FINAL_NONE = 0
FINAL_DIV = 1  # divide by a count (mean)
FINAL_SQRT = 2  # l2 norm

_ZERO = np.float32(0.0)
_NEG_INF = np.float32(-np.inf)
_POS_INF = np.float32(np.inf)

assert BLOCK == RADIX * RADIX

# public op name -> (combine op, element map, final map)
FLAT_OPS = {
    "sum": (OP_SUM, MAP_ID, FINAL_NONE),
    "mean": (OP_SUM, MAP_ID, FINAL_DIV),
    "max": (OP_MAX, MAP_ID, FINAL_NONE),
    "min": (OP_MIN, MAP_ID, FINAL_NONE),
    "sumsq": (OP_SUM, MAP_SQUARE, FINAL_NONE),
    "l2norm": (OP_SUM, MAP_SQUARE, FINAL_SQRT),
}


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def _concat64(xs) -> np.ndarray:
    if isinstance(xs, (list, tuple)):
        return np.concatenate([np.asarray(x, np.float64).ravel() for x in xs]) if xs else np.zeros(0)
    return np.asarray(xs, np.float64).ravel()


def sum_ref(x) -> float:
    return float(np.sum(_concat64(x)))


def mean_ref(x) -> float:
    v = _concat64(x)
    return float(np.sum(v) / v.size) if v.size else float("nan")


def max_ref(x) -> float:
    v = _concat64(x)
    return float(np.max(v)) if v.size else float("-inf")


def min_ref(x) -> float:
    v = _concat64(x)
    return float(np.min(v)) if v.size else float("inf")


def sumsq_ref(x) -> float:
    v = _concat64(x)
    return float(np.sum(v * v))


def l2norm_ref(x) -> float:
    return math.sqrt(sumsq_ref(x))


FLAT_REFS = {"sum": sum_ref, "mean": mean_ref, "max": max_ref, "min": min_ref,
             "sumsq": sumsq_ref, "l2norm": l2norm_ref}


def row_sum_ref(x) -> np.ndarray:
    return np.sum(np.asarray(x, np.float64), axis=-1)


def row_mean_ref(x) -> np.ndarray:
    return np.mean(np.asarray(x, np.float64), axis=-1)


def row_max_ref(x) -> np.ndarray:
    return np.max(np.asarray(x, np.float64), axis=-1)


def row_min_ref(x) -> np.ndarray:
    return np.min(np.asarray(x, np.float64), axis=-1)


def row_sumsq_ref(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return np.sum(x * x, axis=-1)


def row_argmax_ref(x) -> np.ndarray:
    """First index of the row maximum; a NaN counts as the maximum (np.argmax semantics)."""
    return np.argmax(np.asarray(x), axis=-1)


def col_sum_ref(x) -> np.ndarray:
    return np.sum(np.asarray(x, np.float64), axis=0)


# ---------------------------------------------------------------------------------------------
# device functions
# ---------------------------------------------------------------------------------------------
@_cuda.jit(device=True)
def combine(op, a, b):
    """a (+) b for op in {sum, max, min}; max/min propagate NaN (either operand NaN -> NaN)."""
    if op == OP_SUM:
        return a + b
    if op == OP_MAX:
        return a if (a > b or a != a) else b
    return a if (a < b or a != a) else b


@_cuda.jit(device=True)
def identity(op):
    """Neutral element of op."""
    if op == OP_SUM:
        return _ZERO
    if op == OP_MAX:
        return _NEG_INF
    return _POS_INF


@_cuda.jit(device=True)
def apply_map(mapping, v):
    if mapping == MAP_SQUARE:
        return v * v
    return v


@_cuda.jit(device=True)
def apply_final(final, v, divisor):
    if final == FINAL_DIV:
        return v / divisor
    if final == FINAL_SQRT:
        return math.sqrt(v)
    return v


@_cuda.jit(device=True)
def block_reduce(values, tree, t, op):
    """Fold values[0:BLOCK] (shared, already written by every thread) in a fixed order.

    Thread j < RADIX folds values[j], values[j+16], ..., values[j+240] (conflict-free shared
    reads) into tree[j]; thread 0 then folds tree[0..15]. The result is valid in thread 0 only.
    All threads of the block must call it (it contains barriers).
    """
    _cuda.syncthreads()
    if t < RADIX:
        v = values[t]
        for k in range(1, RADIX):
            v = combine(op, v, values[k * RADIX + t])
        tree[t] = v
    _cuda.syncthreads()
    v = tree[0]
    if t == 0:
        for k in range(1, RADIX):
            v = combine(op, v, tree[k])
    return v


@_cuda.jit(device=True)
def row_fold(shared, ty, lane, v, op):
    """Fold one value per lane across the LANES lanes of row group ty, in lane order.

    Every lane gets the result. shared is a (ROWS, LANES) float32 shared array used only by this
    call (use a distinct array per call in one kernel, so no second barrier is needed).
    """
    if LANES == 1:  # (simulator) the lane holds the whole row: nothing to fold, no barrier
        return v
    shared[ty, lane] = v
    _cuda.syncthreads()
    acc = shared[ty, 0]
    for k in range(1, LANES):
        acc = combine(op, acc, shared[ty, k])
    return acc


@_cuda.jit(device=True)
def store_col(partials, out, chunk, c, total, final, accumulate):
    """Write a column total: to partials[chunk, c], or (final) to out[c] (+= when accumulate)."""
    if final:
        if accumulate:
            out[c] = out[c] + total
        else:
            out[c] = total
    else:
        partials[chunk, c] = total


@_cuda.jit(device=True)
def argmax_better(a, j, v, idx):
    """True when candidate (value a, index j) beats (v, idx) in np.argmax order.

    NaN beats every number; among NaNs, and among equal numbers, the smaller index wins. This
    is a total order on (value, index) pairs, so any fold order gives the same winner.
    """
    if v != v:
        return a != a and j < idx
    if a != a:
        return True
    return a > v or (a == v and j < idx)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def flat_reduce_kernel(x, op, mapping, final, divisor, out, at):
    """out[at + blockIdx.x] = final(fold over this block's grid-stride slice of map(x))."""
    values = _cuda.shared.array(BLOCK, float32)
    tree = _cuda.shared.array(RADIX, float32)
    t = _cuda.threadIdx.x
    n = x.size
    stride = _cuda.gridDim.x * BLOCK
    i = _cuda.blockIdx.x * BLOCK + t
    acc = identity(op)
    while i + 3 * stride < n:  # four independent loads in flight
        a0 = apply_map(mapping, x[i])
        a1 = apply_map(mapping, x[i + stride])
        a2 = apply_map(mapping, x[i + 2 * stride])
        a3 = apply_map(mapping, x[i + 3 * stride])
        acc = combine(op, acc, combine(op, combine(op, a0, a1), combine(op, a2, a3)))
        i += 4 * stride
    while i < n:
        acc = combine(op, acc, apply_map(mapping, x[i]))
        i += stride
    values[t] = acc
    total = block_reduce(values, tree, t, op)
    if t == 0:
        out[at + _cuda.blockIdx.x] = apply_final(final, total, divisor)


@_cuda.jit(cache=True)
def row_reduce_kernel(x, op, mapping, final, divisor, out):
    """out[r] = final(fold_c map(x[r, c])); block (LANES, ROWS), one row per lane group.

    No early return: every thread reaches the barrier in row_fold; rows >= R only skip loads/stores.
    """
    shared = _cuda.shared.array((ROWS, LANES), float32)
    lane = _cuda.threadIdx.x
    ty = _cuda.threadIdx.y
    r = _cuda.blockIdx.x * ROWS + ty
    n_rows, n_cols = x.shape
    acc = identity(op)
    if r < n_rows:
        c = lane
        while c + 3 * LANES < n_cols:
            a0 = apply_map(mapping, x[r, c])
            a1 = apply_map(mapping, x[r, c + LANES])
            a2 = apply_map(mapping, x[r, c + 2 * LANES])
            a3 = apply_map(mapping, x[r, c + 3 * LANES])
            acc = combine(op, acc, combine(op, combine(op, a0, a1), combine(op, a2, a3)))
            c += 4 * LANES
        while c < n_cols:
            acc = combine(op, acc, apply_map(mapping, x[r, c]))
            c += LANES
    total = row_fold(shared, ty, lane, acc, op)
    if r < n_rows and lane == 0:
        out[r] = apply_final(final, total, divisor)


@_cuda.jit(cache=True)
def row_argmax_kernel(x, out):
    """out[r] = first index of max_c x[r, c]; a NaN counts as the maximum (np.argmax)."""
    best_val = _cuda.shared.array((ROWS, LANES), float32)
    best_idx = _cuda.shared.array((ROWS, LANES), int32)
    lane = _cuda.threadIdx.x
    ty = _cuda.threadIdx.y
    r = _cuda.blockIdx.x * ROWS + ty
    n_rows, n_cols = x.shape
    v = _NEG_INF
    idx = n_cols  # sentinel "no candidate yet": larger than any index
    if r < n_rows:
        c = lane
        while c < n_cols:
            a = x[r, c]
            if argmax_better(a, c, v, idx):
                v = a
                idx = c
            c += LANES
    best_val[ty, lane] = v
    best_idx[ty, lane] = idx
    _cuda.syncthreads()
    if r < n_rows and lane == 0:
        v = best_val[ty, 0]
        idx = best_idx[ty, 0]
        for k in range(1, LANES):
            a = best_val[ty, k]
            j = best_idx[ty, k]
            if argmax_better(a, j, v, idx):
                v = a
                idx = j
        out[r] = idx


@_cuda.jit(cache=True)
def col_reduce_kernel(x, chunk_rows, partials, out, final, accumulate):
    """Column sums of x[R, C] per chunk of rows.

    Block (lane, ty) of grid (column tiles, chunks): column c = tile*LANES + lane, rows
    chunk*chunk_rows + ty + k*ROWS (increasing k). final=False: partials[chunk, c] = chunk sum.
    final=True (one chunk): out[c] = sum (+ out[c] when accumulate).
    """
    shared = _cuda.shared.array((ROWS, LANES), float32)
    lane = _cuda.threadIdx.x
    ty = _cuda.threadIdx.y
    c = _cuda.blockIdx.x * LANES + lane
    chunk = _cuda.blockIdx.y
    n_rows, n_cols = x.shape
    r = chunk * chunk_rows + ty
    r_end = min(chunk * chunk_rows + chunk_rows, n_rows)
    acc = _ZERO
    if c < n_cols:
        while r + 3 * ROWS < r_end:
            a0 = x[r, c]
            a1 = x[r + ROWS, c]
            a2 = x[r + 2 * ROWS, c]
            a3 = x[r + 3 * ROWS, c]
            acc += (a0 + a1) + (a2 + a3)
            r += 4 * ROWS
        while r < r_end:
            acc += x[r, c]
            r += ROWS
    shared[ty, lane] = acc
    _cuda.syncthreads()
    if ty == 0 and c < n_cols:
        total = shared[0, lane]
        for k in range(1, ROWS):
            total += shared[k, lane]
        store_col(partials, out, chunk, c, total, final, accumulate)


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------
def flat_blocks(n: int, max_blocks: int = MAX_BLOCKS) -> int:
    """Phase-1 blocks for n elements: a function of n (and the cap) only."""
    return max(1, min(-(-int(n) // (BLOCK * ITEMS)), int(max_blocks)))


def _sizes(sizes) -> tuple:
    if np.isscalar(sizes):
        return (int(sizes),)
    out = tuple(int(s) for s in sizes)
    if not out:
        raise ValueError("a reduction needs at least one input array")
    return out


def flat_partials_size(sizes, max_blocks: int = MAX_BLOCKS) -> int:
    """Scratch float32 elements needed by flat_reduce for inputs of these sizes."""
    return sum(flat_blocks(n, max_blocks) for n in _sizes(sizes))


def _as_flat(x, what: str):
    if x.dtype != np.float32:
        raise TypeError(f"{what}: expected a float32 device array, got dtype {x.dtype}")
    if x.ndim == 1:
        return x
    if not x.is_c_contiguous():
        raise ValueError(f"{what}: a {x.ndim}-D input must be C-contiguous to be reduced as one vector")
    return x.reshape(x.size)


def _check_out(out, at: int, what: str):
    if out.dtype != np.float32 or out.ndim != 1:
        raise TypeError(f"{what}: out must be a 1-D float32 device array, got {out.dtype} {out.shape}")
    if not 0 <= at < out.shape[0]:
        raise IndexError(f"{what}: at={at} is outside out (length {out.shape[0]})")


def flat_reduce(xs, out, partials, op: str, stream, at: int = 0, max_blocks: int = MAX_BLOCKS):
    """out[at] = op over the concatenation of xs (one array or a list), with caller-owned scratch.

    partials: float32 device vector of at least flat_partials_size(sizes, max_blocks) elements
    (unused when that size is 1). op: one of FLAT_OPS.
    """
    try:
        op_code, mapping, final = FLAT_OPS[op]
    except KeyError:
        raise ValueError(f"unknown reduction {op!r}; choose one of {sorted(FLAT_OPS)}") from None
    arrays = list(xs) if isinstance(xs, (list, tuple)) else [xs]
    if not arrays:
        raise ValueError("flat_reduce: no input arrays")
    arrays = [_as_flat(x, f"flat_reduce({op})") for x in arrays]
    _check_out(out, at, f"flat_reduce({op})")
    total_n = sum(x.size for x in arrays)
    divisor = np.float32(total_n)
    grids = [flat_blocks(x.size, max_blocks) for x in arrays]
    n_partials = sum(grids)
    if n_partials == 1:  # one block covers everything: write the final value directly
        flat_reduce_kernel[1, BLOCK, stream](arrays[0], op_code, mapping, final, divisor, out, at)
        return
    if partials is None or partials.dtype != np.float32 or partials.ndim != 1 or partials.size < n_partials:
        raise ValueError(
            f"flat_reduce({op}): partials must be a float32 device vector of >= {n_partials} elements "
            "(see flat_partials_size); got "
            + ("None" if partials is None else f"{partials.dtype} {partials.shape}")
        )
    offset = 0
    for x, g in zip(arrays, grids):
        flat_reduce_kernel[g, BLOCK, stream](x, op_code, mapping, FINAL_NONE, divisor, partials, offset)
        offset += g
    scratch = partials if partials.size == n_partials else partials[:n_partials]
    flat_reduce_kernel[1, BLOCK, stream](scratch, op_code, MAP_ID, final, divisor, out, at)


class Reducer:
    """Plan for flat reductions over inputs of fixed sizes; owns its scratch (allocate before capture).

    ``Reducer(n)`` reduces one vector of n elements; ``Reducer([n1, n2])`` reduces the
    concatenation of several arrays (pass them as a list in the same order). One Reducer's
    launches must stay on one stream at a time (they share the scratch).
    """

    def __init__(self, sizes, max_blocks: int = MAX_BLOCKS):
        self.sizes = _sizes(sizes)
        if any(n < 0 for n in self.sizes):
            raise ValueError(f"Reducer: negative size in {self.sizes}")
        self.max_blocks = int(max_blocks)
        self.n = sum(self.sizes)
        size = flat_partials_size(self.sizes, self.max_blocks)
        self.partials = _cuda.device_array(max(size, 1), dtype=np.float32)

    def _run(self, op, x, out, stream, at):
        arrays = list(x) if isinstance(x, (list, tuple)) else [x]
        got = tuple(int(a.size) for a in arrays)
        if got != self.sizes:
            raise ValueError(f"Reducer planned for sizes {self.sizes} was given arrays of sizes {got}")
        flat_reduce(arrays, out, self.partials, op, stream, at, self.max_blocks)

    def sum(self, x, out, stream, at: int = 0):
        self._run("sum", x, out, stream, at)

    def mean(self, x, out, stream, at: int = 0):
        self._run("mean", x, out, stream, at)

    def max(self, x, out, stream, at: int = 0):
        self._run("max", x, out, stream, at)

    def min(self, x, out, stream, at: int = 0):
        self._run("min", x, out, stream, at)

    def sumsq(self, x, out, stream, at: int = 0):
        self._run("sumsq", x, out, stream, at)

    def l2norm(self, x, out, stream, at: int = 0):
        self._run("l2norm", x, out, stream, at)


def as_rows(x, what: str):
    """View x[..., C] as a 2-D [R, C] array (2-D views may be strided; higher ranks must be contiguous)."""
    if x.ndim == 2:
        return x
    if x.ndim < 2:
        raise ValueError(f"{what}: expected an array of rank >= 2 ([..., C]), got shape {x.shape}")
    if not x.is_c_contiguous():
        raise ValueError(f"{what}: a rank-{x.ndim} input must be C-contiguous to be viewed as rows")
    n_cols = x.shape[x.ndim - 1]  # (the simulator's shape tuple has no negative indexing)
    return x.reshape(x.size // max(n_cols, 1), n_cols)


def row_grid(n_rows: int) -> int:
    return max(1, -(-int(n_rows) // ROWS))


def _row_out(out, n_rows: int, what: str):
    if out.ndim != 1:
        if not out.is_c_contiguous():
            raise ValueError(f"{what}: out must be 1-D or contiguous")
        out = out.reshape(out.size)
    if out.shape[0] != n_rows:
        raise ValueError(f"{what}: out has {out.shape[0]} elements, expected one per row ({n_rows})")
    return out


def _row_reduce(x, out, stream, op_code, mapping, final, what):
    x2 = as_rows(x, what)
    if x2.dtype != np.float32:
        raise TypeError(f"{what}: expected float32 input, got {x2.dtype}")
    out1 = _row_out(out, x2.shape[0], what)
    if out1.dtype != np.float32:
        raise TypeError(f"{what}: out must be float32, got {out1.dtype}")
    divisor = np.float32(x2.shape[1])
    row_reduce_kernel[row_grid(x2.shape[0]), (LANES, ROWS), stream](x2, op_code, mapping, final, divisor, out1)


def row_sum(x, out, stream):
    """out[r] = sum_c x[r, c] for x[..., C] float32 (out has one element per row)."""
    _row_reduce(x, out, stream, OP_SUM, MAP_ID, FINAL_NONE, "row_sum")


def row_mean(x, out, stream):
    _row_reduce(x, out, stream, OP_SUM, MAP_ID, FINAL_DIV, "row_mean")


def row_max(x, out, stream):
    """Row maximum; NaN propagates; an empty row (C == 0) gives -inf."""
    _row_reduce(x, out, stream, OP_MAX, MAP_ID, FINAL_NONE, "row_max")


def row_min(x, out, stream):
    _row_reduce(x, out, stream, OP_MIN, MAP_ID, FINAL_NONE, "row_min")


def row_sumsq(x, out, stream):
    _row_reduce(x, out, stream, OP_SUM, MAP_SQUARE, FINAL_NONE, "row_sumsq")


def row_argmax(x, out, stream):
    """out[r] = first index of the maximum of row r (np.argmax semantics, NaN counts as max).

    out: int32 or int64 device array with one element per row. Rows must be non-empty.
    """
    x2 = as_rows(x, "row_argmax")
    if x2.dtype != np.float32:
        raise TypeError(f"row_argmax: expected float32 input, got {x2.dtype}")
    if x2.shape[1] == 0:
        raise ValueError("row_argmax: rows are empty (C == 0)")
    out1 = _row_out(out, x2.shape[0], "row_argmax")
    if out1.dtype not in (np.int32, np.int64):
        raise TypeError(f"row_argmax: out must be int32 or int64, got {out1.dtype}")
    row_argmax_kernel[row_grid(x2.shape[0]), (LANES, ROWS), stream](x2, out1)


def col_plan(n_rows: int) -> tuple[int, int]:
    """(n_chunks, chunk_rows) for column reductions over n_rows rows (a function of n_rows only)."""
    n_rows = int(n_rows)
    n_chunks = max(1, min(-(-n_rows // CHUNK_ROWS), MAX_CHUNKS))
    chunk_rows = max(1, -(-n_rows // n_chunks))
    return n_chunks, chunk_rows


def col_partials_shape(n_rows: int, n_cols: int) -> tuple[int, int]:
    """Shape of the float32 scratch col_sum needs for x[n_rows, n_cols]."""
    return (col_plan(n_rows)[0], int(n_cols))


def col_tiles(n_cols: int) -> int:
    return max(1, -(-int(n_cols) // LANES))


def col_finish(partials, out, stream, accumulate: bool = False):
    """Phase 2 of a column reduction: out[c] (+)= sum_k partials[k, c], folded in fixed order."""
    n_chunks, n_cols = partials.shape
    col_reduce_kernel[(col_tiles(n_cols), 1), (LANES, ROWS), stream](
        partials, np.int64(n_chunks), partials, out, True, bool(accumulate)
    )


def col_sum(x, out, partials, stream, accumulate: bool = False):
    """out[c] = sum_r x[r, c] (or out[c] += ... with accumulate) for x[R, C] float32, deterministic.

    partials: float32 device scratch of shape col_partials_shape(R, C) (any values; overwritten).
    x may be a strided 2-D view. Bias gradient of a linear layer: col_sum(dy, db, ...).
    """
    if x.ndim != 2:
        x = as_rows(x, "col_sum")
    if x.dtype != np.float32 or out.dtype != np.float32:
        raise TypeError(f"col_sum: x and out must be float32, got {x.dtype} and {out.dtype}")
    n_rows, n_cols = x.shape
    if out.ndim != 1 or out.shape[0] != n_cols:
        raise ValueError(f"col_sum: out must be 1-D with {n_cols} elements, got shape {out.shape}")
    n_chunks, chunk_rows = col_plan(n_rows)
    if partials is None or tuple(partials.shape) != (n_chunks, n_cols) or partials.dtype != np.float32:
        raise ValueError(
            f"col_sum: partials must be float32 of shape {(n_chunks, n_cols)} (col_partials_shape), got "
            + ("None" if partials is None else f"{partials.dtype} {tuple(partials.shape)}")
        )
    one_pass = n_chunks == 1
    col_reduce_kernel[(col_tiles(n_cols), n_chunks), (LANES, ROWS), stream](
        x, np.int64(chunk_rows), partials, out, one_pass, bool(accumulate)
    )
    if not one_pass:
        col_finish(partials, out, stream, accumulate)


class ColSum:
    """Plan for column sums of [n_rows, n_cols] float32 inputs; owns the scratch."""

    def __init__(self, n_rows: int, n_cols: int):
        self.n_rows, self.n_cols = int(n_rows), int(n_cols)
        self.partials = _cuda.device_array(col_partials_shape(self.n_rows, self.n_cols), dtype=np.float32)

    def run(self, x, out, stream, accumulate: bool = False):
        x = as_rows(x, "ColSum.run")
        if tuple(x.shape) != (self.n_rows, self.n_cols):
            raise ValueError(f"ColSum planned for {(self.n_rows, self.n_cols)} was given {tuple(x.shape)}")
        col_sum(x, out, self.partials, stream, accumulate)
