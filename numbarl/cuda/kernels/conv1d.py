"""Causal depthwise convolution over the K rows of each window, then SiLU: Mamba2's short convolution
before the scan (Dao & Gu 2024, ``d_conv`` = 4 in mamba_ssm; numbarl/rl/nets/mamba.py's ``conv``).

Why the scan needs it. The scan's state accumulates Δ_t u_t ⊗ B_t, products of two projections of the
*same* row, and its decay a_t is positive, so without mixing rows first it cannot form a product of
two different bars' features (e.g. the previous bar's flow times this bar's move, the evidence of a
regime that flips the sign of the flow → move relation). The convolution mixes each column with its
d − 1 predecessors in the window, so u_t ⊗ B_t then holds such cross-bar products.

Layout: z [B·K, P] as in numbarl/cuda/kernels/ssm.py (window b at rows b·K .. b·K + K − 1, oldest
first); the first ``n_cols`` columns (u | B | C: H + 2N) are convolved, the rest (Δ̃) are copied. The
weights w [d + 1, n_cols]: rows 0..d − 1 the taps (tap k reads the row k steps back), row d the bias::

    v_t[j]   = w[d, j] + Σ_{k < min(d, ℓ_t)} w[k, j] · z_{t−k}[j]
    out_t[j] = silu(v_t[j]) = v_t[j] · σ(v_t[j])                          j < n_cols
    out_t[j] = z_t[j]                                                     j ≥ n_cols

ℓ_t the number of consecutive valid rows ending at row t (0 when row t is masked; the row mask: 1
valid, 0 masked, e.g. before the episode start), so a tap never reads across a masked row, as the
scan's state restarts after one. Backward from dout (e_t = dout_t · silu'(v_t)):

    ∂L/∂z_s[j]  = Σ_{k < d, k < ℓ_{s+k}} w[k, j] · e_{s+k}[j]   (s + k ≤ K − 1; j ≥ n_cols: dout_s[j])
    ∂L/∂w[k, j] = Σ_{b, t: k < ℓ_t} e_t[j] · z_{t−k}[j],     ∂L/∂w[d, j] = Σ_{b, t} e_t[j]

Thread mapping (one writer per element, sums in a fixed order, no atomics): every kernel one thread per
(window, column) walking the window's K rows (the forward and the weight gradient down, bounding the taps by
the run of valid rows ending at the row; the input gradient up, by the first masked row at or after it)
instead of a mask load per tap; consecutive threads
are consecutive columns of one row, so each row's loads and stores are coalesced. (The earlier mapping of
the forward and the input gradient, one thread per (row, column), ran K× the threads, each with d dependent
mask loads; the sums and their order are unchanged, so the results are bit for bit the same.) For d ≤ REG_TAPS
(4, mamba_ssm's width) the forward and the weight parts keep the taps' weights (the parts) and the last d − 1
rows in registers and read every row once, before that row's mask decides which taps apply (the generic loop
waits for the mask before it reads the taps' rows and re-reads them). They read their rows in chunks of
CHUNK = 4: a chunk's rows and masks (the weight parts: z, dout and v) are loaded before the chunk's first store,
then the rows are taken in order, and the last K mod 4 rows one by one (row by row, a row's load came after the
previous row's stores, which may alias it as far as the compiler knows: one load in flight per thread). Same
products, same order: bit for bit the generic loop's results (tests/rl/test_mamba.py pins the chunks and the
tail to the generic loop). Measured on one H200 at K = 16, d = 4 (docs/BENCHMARKS.md, thirteenth session),
per call: the forward 211 µs (generic loop) → 183, the weight parts 176 → 132. The input gradient keeps the
generic loop: its register path measured 156 → 222 µs (row by row) and 204 µs (in chunks). The weight
gradient sums
its K rows into part [B, (d + 1)·n_cols] (tap k at columns k·n_cols + j, the bias at d·n_cols + j),
which the caller sums over windows with numbarl.cuda.reduce.col_sum (fixed order). The forward keeps
v in ``pre`` [B·K, n_cols] for the backward.
"""

from __future__ import annotations

import numpy as np
from numba import float32

from numbarl.cuda import launch
from numbarl.cuda.kernels.elementwise import silu_dev, silu_grad_dev
from numbarl.cuda.kernels.ssm import cell_dev, row_masked_dev
from numbarl.cuda.runtime import cuda

_cuda = cuda()

BLOCK = launch.shape(gpu=128, sim=32)
MAX_WIDTH = 8  # d: taps per column
CHUNK = 4  # rows a register-path thread reads before the first of them is used (loads in flight together)
REG_TAPS = 4  # d up to this (mamba_ssm's d_conv = 4) runs the kernels' register path; wider, the generic loops
_PARTS = MAX_WIDTH + 1  # a weight-gradient part per tap, then the bias (a module constant: numba sizes local arrays only from those)

_ZERO = np.float32(0.0)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def _silu_ref(v):
    return v / (1.0 + np.exp(-v))


def _rows(z, mask, n_steps):
    """(z as [B, K, P] float64, mask [B, K] float64)."""
    z = np.asarray(z, np.float64)
    zk = z.reshape(-1, int(n_steps), z.shape[1])
    m = np.ones(zk.shape[:2]) if mask is None else np.asarray(mask, np.float64)
    return zk, m


def valid_run_ref(mask, n_windows: int, n_steps: int) -> np.ndarray:
    """ℓ [B, K]: consecutive valid rows ending at each row (0 at a masked row)."""
    m = np.ones((n_windows, n_steps)) if mask is None else np.asarray(mask, np.float64)
    run = np.zeros(m.shape, np.int64)
    for t in range(n_steps):
        run[:, t] = np.where(m[:, t] != 0, (run[:, t - 1] if t else 0) + 1, 0)
    return run


def causal_conv_ref(z, w, mask, n_steps: int, n_cols: int):
    """(out [B·K, P], v [B·K, n_cols]) in float64 (module docstring)."""
    zk, _ = _rows(z, mask, n_steps)
    w = np.asarray(w, np.float64)
    d = w.shape[0] - 1
    Bn, K, _ = zk.shape
    run = valid_run_ref(mask, Bn, K)
    v = np.broadcast_to(w[d], (Bn, K, n_cols)).copy()
    for t in range(K):
        for k in range(min(d, t + 1)):
            v[:, t] += (run[:, t, None] > k) * w[k] * zk[:, t - k, :n_cols]
    out = zk.copy()
    out[..., :n_cols] = _silu_ref(v)
    return out.reshape(-1, zk.shape[2]), v.reshape(-1, n_cols)


def causal_conv_backward_ref(dout, z, w, mask, n_steps: int, n_cols: int):
    """(dz [B·K, P], dw [d + 1, n_cols]) in float64 from dout [B·K, P]."""
    zk, _ = _rows(z, mask, n_steps)
    w = np.asarray(w, np.float64)
    d = w.shape[0] - 1
    Bn, K, P = zk.shape
    run = valid_run_ref(mask, Bn, K)
    _, v = causal_conv_ref(z, w, mask, n_steps, n_cols)
    v = v.reshape(Bn, K, n_cols)
    s = 1.0 / (1.0 + np.exp(-v))
    e = np.asarray(dout, np.float64).reshape(Bn, K, P)[..., :n_cols] * s * (1.0 + v * (1.0 - s))
    dz = np.asarray(dout, np.float64).reshape(Bn, K, P).copy()
    dz[..., :n_cols] = 0.0
    dw = np.zeros_like(w)
    for t in range(K):  # v_t's taps, as in the forward
        for k in range(min(d, t + 1)):
            live = (run[:, t, None] > k) * e[:, t]
            dz[:, t - k, :n_cols] += w[k] * live
            dw[k] += np.sum(live * zk[:, t - k, :n_cols], axis=0)
    dw[d] = e.sum(axis=(0, 1))
    return dz.reshape(Bn * K, P), dw


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(device=True, inline=True)
def _taps_dev(w, j, d):
    """Column j's first REG_TAPS tap weights (0 past the d taps: never applied, the callers test d)."""
    w0 = w[0, j]
    w1 = w[1, j] if d > 1 else _ZERO
    w2 = w[2, j] if d > 2 else _ZERO
    w3 = w[3, j] if d > 3 else _ZERO
    return w0, w1, w2, w3


@_cuda.jit(device=True, inline=True)
def _rows4_dev(x, row, j, step):
    """x[row, j], x[row + step, j], x[row + 2·step, j], x[row + 3·step, j]: a chunk's four loads issued together."""
    return x[row, j], x[row + step, j], x[row + 2 * step, j], x[row + 3 * step, j]


@_cuda.jit(device=True, inline=True)
def _masks4_dev(mask, has_mask, b, t, step):
    """Whether rows t, t + step, t + 2·step, t + 3·step of window b are masked (:func:`row_masked_dev`)."""
    return (row_masked_dev(mask, has_mask, b, t), row_masked_dev(mask, has_mask, b, t + step),
            row_masked_dev(mask, has_mask, b, t + 2 * step), row_masked_dev(mask, has_mask, b, t + 3 * step))


@_cuda.jit(device=True, inline=True)
def _tap_sum_dev(acc, reach, d, w0, w1, w2, w3, x0, x1, x2, x3):
    """acc + Σ_{k < min(d, reach)} w_k · x_k, the taps added in the generic loop's order k = 0, 1, ..."""
    if reach > 0:
        acc += w0 * x0
    if d > 1 and reach > 1:
        acc += w1 * x1
    if d > 2 and reach > 2:
        acc += w2 * x2
    if d > 3 and reach > 3:
        acc += w3 * x3
    return acc


@_cuda.jit(device=True, inline=True)
def _fwd_row_dev(pre, out, row, j, zt, masked, run, z1, z2, z3, d, w0, w1, w2, w3, bias):
    """The forward's register path at one row: v from the row and the three before it (the taps in the generic
    loop's order, k = 0, 1, ...), v to pre and silu(v) to out; returns (run, z1, z2, z3) for the next row."""
    run = 0 if masked else run + 1
    v = _tap_sum_dev(bias, run, d, w0, w1, w2, w3, zt, z1, z2, z3)
    pre[row, j] = v
    out[row, j] = silu_dev(v)
    return run, zt, z1, z2


@_cuda.jit(device=True, inline=True)
def _wpart_row_dev(zt, e, masked, run, z1, z2, z3, n_taps, a0, a1, a2, a3, ab):
    """The weight parts' register path at one row (e its e): the bias part and each reached tap's part, in the
    generic loop's order; returns (run, z1, z2, z3, a0, a1, a2, a3, ab) for the next row."""
    run = 0 if masked else run + 1
    ab += e
    if run > 0:
        a0 += e * zt
    if n_taps > 1 and run > 1:
        a1 += e * z1
    if n_taps > 2 and run > 2:
        a2 += e * z2
    if n_taps > 3 and run > 3:
        a3 += e * z3
    return run, zt, z1, z2, a0, a1, a2, a3, ab


@_cuda.jit(cache=True)
def conv_forward_kernel(z, w, mask, has_mask, n_steps, out, pre):
    """One thread per (window b, column j of z), down the window's K rows: out = silu(v) for j < n_cols
    (v saved in pre), else z. The taps of row t reach back over the run of valid rows ending at t."""
    i = _cuda.grid(1)
    n_cols = out.shape[1]
    if i >= (out.shape[0] // n_steps) * n_cols:
        return
    b, j = cell_dev(i, n_cols)
    first = b * n_steps
    if j >= pre.shape[1]:
        for t in range(n_steps):
            out[first + t, j] = z[first + t, j]
        return
    d = w.shape[0] - 1
    run = 0  # consecutive valid rows ending at row t (0 at a masked row)
    if d <= REG_TAPS:  # the taps' weights and the last rows in registers; each row read once, before its mask decides
        w0, w1, w2, w3 = _taps_dev(w, j, d)
        bias = w[d, j]
        z1 = z2 = z3 = _ZERO  # rows t − 1, t − 2, t − 3 (read only where the run reaches them)
        t = 0
        while t + CHUNK <= n_steps:  # a chunk's four rows and masks read before its first store
            row = first + t
            za, zb, zc, zd = _rows4_dev(z, row, j, 1)
            ma, mb, mc, md = _masks4_dev(mask, has_mask, b, t, 1)
            run, z1, z2, z3 = _fwd_row_dev(pre, out, row, j, za, ma, run, z1, z2, z3, d, w0, w1, w2, w3, bias)
            run, z1, z2, z3 = _fwd_row_dev(pre, out, row + 1, j, zb, mb, run, z1, z2, z3, d, w0, w1, w2, w3, bias)
            run, z1, z2, z3 = _fwd_row_dev(pre, out, row + 2, j, zc, mc, run, z1, z2, z3, d, w0, w1, w2, w3, bias)
            run, z1, z2, z3 = _fwd_row_dev(pre, out, row + 3, j, zd, md, run, z1, z2, z3, d, w0, w1, w2, w3, bias)
            t += CHUNK
        while t < n_steps:  # the last K mod 4 rows
            run, z1, z2, z3 = _fwd_row_dev(pre, out, first + t, j, z[first + t, j], row_masked_dev(mask, has_mask, b, t),
                                           run, z1, z2, z3, d, w0, w1, w2, w3, bias)
            t += 1
        return
    for t in range(n_steps):
        run = 0 if row_masked_dev(mask, has_mask, b, t) else run + 1
        v = w[d, j]
        for k in range(d):  # taps back to the first masked row (or the window's start)
            if k >= run:
                break
            v += w[k, j] * z[first + t - k, j]
        pre[first + t, j] = v
        out[first + t, j] = silu_dev(v)


@_cuda.jit(cache=True)
def conv_input_grad_kernel(dout, w, pre, mask, has_mask, n_steps, dz):
    """One thread per (window b, column j), up the window's rows: dz_s = Σ_k w[k, j] · e_{s+k}[j] over the taps
    of rows s + k that reach row s (no masked row in s..s + k) for j < n_cols, else dout."""
    i = _cuda.grid(1)
    n_cols = dz.shape[1]
    if i >= (dz.shape[0] // n_steps) * n_cols:
        return
    b, j = cell_dev(i, n_cols)
    first = b * n_steps
    if j >= pre.shape[1]:
        for t in range(n_steps):
            dz[first + t, j] = dout[first + t, j]
        return
    d = w.shape[0] - 1
    stop = n_steps  # the first masked row at or after row s (n_steps: none)
    for back in range(n_steps):
        s = n_steps - 1 - back
        if row_masked_dev(mask, has_mask, b, s):
            stop = s
        acc = _ZERO
        for k in range(d):
            if s + k >= stop:
                break
            acc += w[k, j] * (dout[first + s + k, j] * silu_grad_dev(pre[first + s + k, j]))
        dz[first + s, j] = acc


@_cuda.jit(cache=True)
def conv_weight_part_kernel(dout, z, pre, mask, has_mask, n_steps, n_taps, part):
    """One thread per (window b, column j): its K rows' parts of ∂L/∂w[k, j] (k < d) and of the bias."""
    i = _cuda.grid(1)
    n_cols = pre.shape[1]
    if i >= part.shape[0] * n_cols:
        return
    b, j = cell_dev(i, n_cols)
    first = b * n_steps
    if n_taps <= REG_TAPS:  # the parts and the last rows in registers
        a0 = a1 = a2 = a3 = ab = _ZERO
        z1 = z2 = z3 = _ZERO
        run = 0
        t = 0
        while t + CHUNK <= n_steps:  # a chunk's four rows read together
            row = first + t
            za, zb, zc, zd = _rows4_dev(z, row, j, 1)
            da, db, dc, dd = _rows4_dev(dout, row, j, 1)
            pa, pb, pc, pd = _rows4_dev(pre, row, j, 1)
            ma, mb, mc, md = _masks4_dev(mask, has_mask, b, t, 1)
            run, z1, z2, z3, a0, a1, a2, a3, ab = _wpart_row_dev(za, da * silu_grad_dev(pa), ma, run, z1, z2, z3,
                                                                 n_taps, a0, a1, a2, a3, ab)
            run, z1, z2, z3, a0, a1, a2, a3, ab = _wpart_row_dev(zb, db * silu_grad_dev(pb), mb, run, z1, z2, z3,
                                                                 n_taps, a0, a1, a2, a3, ab)
            run, z1, z2, z3, a0, a1, a2, a3, ab = _wpart_row_dev(zc, dc * silu_grad_dev(pc), mc, run, z1, z2, z3,
                                                                 n_taps, a0, a1, a2, a3, ab)
            run, z1, z2, z3, a0, a1, a2, a3, ab = _wpart_row_dev(zd, dd * silu_grad_dev(pd), md, run, z1, z2, z3,
                                                                 n_taps, a0, a1, a2, a3, ab)
            t += CHUNK
        while t < n_steps:  # the last K mod 4 rows
            row = first + t
            run, z1, z2, z3, a0, a1, a2, a3, ab = _wpart_row_dev(
                z[row, j], dout[row, j] * silu_grad_dev(pre[row, j]), row_masked_dev(mask, has_mask, b, t), run,
                z1, z2, z3, n_taps, a0, a1, a2, a3, ab)
            t += 1
        part[b, j] = a0
        if n_taps > 1:
            part[b, n_cols + j] = a1
        if n_taps > 2:
            part[b, 2 * n_cols + j] = a2
        if n_taps > 3:
            part[b, 3 * n_cols + j] = a3
        part[b, n_taps * n_cols + j] = ab
        return
    acc = _cuda.local.array(_PARTS, float32)  # taps 0..d − 1, then the bias
    for k in range(n_taps + 1):
        acc[k] = _ZERO
    run = 0  # consecutive valid rows ending at row t, as in the forward
    for t in range(n_steps):  # rows in order; each row's taps as in the forward
        run = 0 if row_masked_dev(mask, has_mask, b, t) else run + 1
        e = dout[first + t, j] * silu_grad_dev(pre[first + t, j])
        acc[n_taps] += e
        for k in range(n_taps):
            if k >= run:
                break
            acc[k] += e * z[first + t - k, j]
    for k in range(n_taps + 1):
        part[b, k * n_cols + j] = acc[k]


# ---------------------------------------------------------------------------------------------
# launchers (no allocation, host copy or sync: capturable)
# ---------------------------------------------------------------------------------------------
def _check(z, w, mask, n_steps, pre):
    rows, n_cols = pre.shape
    if tuple(w.shape) != (w.shape[0], n_cols) or not 2 <= w.shape[0] <= MAX_WIDTH + 1:
        raise ValueError(f"causal conv: w must be [d + 1, {n_cols}] with 1 <= d <= {MAX_WIDTH}, got {tuple(w.shape)}")
    if z.shape[0] != rows or z.shape[1] < n_cols or rows % n_steps:
        raise ValueError(f"causal conv: z {tuple(z.shape)} does not hold {rows} rows (windows of {n_steps}) "
                         f"of at least {n_cols} columns")
    if mask is not None and tuple(mask.shape) != (rows // n_steps, n_steps):
        raise ValueError(f"causal conv: mask must be [{rows // n_steps}, {n_steps}], got {tuple(mask.shape)}")


def conv_forward(z, w, mask, n_steps: int, out, pre, stream):
    """out [B·K, P] = the module docstring's out for z [B·K, P]; pre [B·K, n_cols] = v (kept for the
    backward); mask float32 [B, K] or None (every row valid)."""
    _check(z, w, mask, n_steps, pre)
    conv_forward_kernel[launch.blocks((out.shape[0] // n_steps) * out.shape[1], BLOCK), BLOCK, stream](
        z, w, pre if mask is None else mask, mask is not None, np.int32(n_steps), out, pre)


def conv_backward(dout, z, w, pre, mask, n_steps: int, dz, part, stream):
    """dz [B·K, P] from dout; part [B, (d + 1)·n_cols] = each window's weight-gradient parts (sum
    them over windows with reduce.col_sum into the gradient of w, flattened)."""
    _check(z, w, mask, n_steps, pre)
    n_taps = w.shape[0] - 1
    if tuple(part.shape) != (z.shape[0] // n_steps, (n_taps + 1) * pre.shape[1]):
        raise ValueError(f"causal conv: part must be [{z.shape[0] // n_steps}, {(n_taps + 1) * pre.shape[1]}], "
                         f"got {tuple(part.shape)}")
    m = pre if mask is None else mask
    conv_input_grad_kernel[launch.blocks((dz.shape[0] // n_steps) * dz.shape[1], BLOCK), BLOCK, stream](
        dout, w, pre, m, mask is not None, np.int32(n_steps), dz)
    conv_weight_part_kernel[launch.blocks(part.shape[0] * pre.shape[1], BLOCK), BLOCK, stream](
        dout, z, pre, m, mask is not None, np.int32(n_steps), np.int32(n_taps), part)
