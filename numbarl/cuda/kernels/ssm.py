"""Selective state-space scan with scalar decay per head (Mamba2's SSD, Dao & Gu 2024): the K-step
scan, its exact backward through all K steps (BPTT), and the one-step recurrent update for acting.

Layout. A batch of B windows of K consecutive rows (oldest first, row b·K + K − 1 the newest) is
stored flat, one row per step: z [B·K, P], the input projection x·W_in of numbarl/rl/nets/mamba.py,
with P = H + 2N + n_heads columns (N = d_state = :data:`D_STATE`, H = n_heads · head_dim)::

    z[:, 0:H]              u_t   (value channel c belongs to head c // head_dim)
    z[:, H:H+N]            B_t   (input map, shared by every head: Mamba2's single B/C group)
    z[:, H+N:H+2N]         C_t   (output map, shared by every head)
    z[:, H+2N:H+2N+n_h]    Δ̃_t   (decay pre-activation, one per head)

Scan (Dao & Gu 2024, §3 "SSD" with the scalar-times-identity A of Mamba2; per window b, head h,
channel c of h, state index n; m_t ∈ {0, 1} the row mask, 1 = valid)::

    Δ_t   = softplus(Δ̃_t + b_Δ[h])                       step size
    a_t   = exp(−Δ_t · exp(A_log[h]))                   decay in (0, 1)
    S_t   = m_t · (a_t S_{t−1} + Δ_t u_t[c] B_t)         S [H, N] (per head [head_dim, N]), S_{−1} = 0
    y     = S_{K−1} C_{K−1}                             y[c] = Σ_n S_{K−1}[c, n] C_{K−1}[n]   [B, H]

A masked row (m_t = 0: before the episode start or not yet written) contributes nothing and the
state restarts from zero after it. Only the newest row's y is an output (the module adds it to the
newest row's features), so the gradient g = ∂L/∂y enters at the last step only.

Backward. Because A is a scalar per head and only y_{K−1} is read, the adjoint of the state is rank
one per head: G_t = ∂L/∂S_t = γ_t · g ⊗ C_{K−1} with γ_{K−1} = 1 and γ_{t−1} = m_t a_t γ_t (a
reverse scan). With ĝ_t = m_t γ_t, the per-head sums r_t = Σ_{c∈h} g[c] u_t[c] and
q_t = Σ_{c∈h} g[c] (S_{t−1}[c, :] · C_{K−1}), and β_t = B_t · C_{K−1}::

    ∂L/∂u_t[c]    = ĝ_t Δ_t β_t g[c]                          (coef_t · g[c])
    ∂L/∂B_t[n]    = C_{K−1}[n] Σ_h ĝ_t Δ_t r_t                 (dbw_t[h] summed over heads)
    ∂L/∂C_{K−1}[n] = Σ_c g[c] S_{K−1}[c, n]
    ∂L/∂a_t       = ĝ_t q_t
    ∂L/∂Δ_t       = ĝ_t r_t β_t + ∂L/∂a_t · (−e^{A_log} a_t)
    ∂L/∂Δ̃_t       = ∂L/∂Δ_t · σ(Δ̃_t + b_Δ)                    (softplus' = sigmoid)
    ∂L/∂b_Δ[h]    = Σ_{b,t} ∂L/∂Δ̃_t,   ∂L/∂A_log[h] = Σ_{b,t} ∂L/∂a_t · (−Δ_t e^{A_log} a_t)

The float64 reference (:func:`ssd_scan_backward_ref`) does not use this structure: it carries the
full adjoint G_t [H, N] back through every step (textbook BPTT), so the two derivations check each
other; both are checked by finite differences in tests/rl/test_mamba.py.

Thread mapping (one writer per output element, every sum a loop in a fixed order: no atomics)::

    ssd_scan_forward_kernel    one thread per (b, c): its state row S[c, :] in registers, t = 0..K−1;
                               writes y[b, c] and (the head's first channel) Δ_t, a_t for the backward
    ssd_scan_backward_kernel   one thread per (b, h): recomputes the head's state rows channel by
                               channel from the saved Δ, a (p outer, t inner) to form r_t, q_t and
                               the head's part of ∂L/∂C, then the reverse scan over γ; writes
                               ∂L/∂Δ̃, coef, dbw per (row, h), ∂L/∂A_log per (b, h) and ∂L/∂C per
                               (b, h, n); ∂b_Δ and ∂A_log are then summed over rows / windows by the
                               caller's fixed-order column sums (numbarl.cuda.reduce.col_sum)
    ssd_input_grad_kernel      a thread row per row of z, lanes along its columns: dz, the head sums in order 0..n_h−1
    ssd_step_kernel            acting: one thread per (env, c), S[env, c, :] read, updated, written back
    last_row_kernel            out[b, :] (+)= x[b·K + K − 1, :] (the residual of the forward)
    add_to_last_row_kernel     dx[b·K + K − 1, :] += dh̃[b, :] (the residual of the backward)

The forward saves Δ_t and a_t [B·K, n_h], not the states: those are B·K·H·N floats (1 GiB at
B = 4096, K = 8, H = 512), and the backward recomputes them in registers from the saved Δ, a with
the same device function and order, so they are the forward's bit for bit.

The scan and the acting step call the same device functions (:func:`decay_dev`,
:func:`state_update_dev`, :func:`state_read_dev`), so stepping a window row by row from a zero
state gives the scan's y.
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32

from numbarl.cuda import launch
from numbarl.cuda.kernels.elementwise import sigmoid_dev
from numbarl.cuda.runtime import cuda

_cuda = cuda()  # the backend (GPU or simulator), selected once

# ---------------------------------------------------------------------------------------------
# constants
# ---------------------------------------------------------------------------------------------
D_STATE = 16  # N: state size per channel (the d_state of the origin system's temporal scan)
MAX_STEPS = 32  # K: window length a backward thread's local r_t, q_t arrays hold
BLOCK = launch.shape(gpu=128, sim=32)  # threads per block of every kernel here but the input gradient's
ROW_THREADS = launch.shape(gpu=256, sim=32)  # threads per block of the input gradient (thread rows of z's columns)

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


def z_width(width: int, n_heads: int) -> int:
    """P = H + 2N + n_heads: columns of the input projection z."""
    return int(width) + 2 * D_STATE + int(n_heads)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def softplus_ref(v):
    return np.logaddexp(0.0, np.asarray(v, np.float64))


def _split(z, width: int, n_heads: int):
    """(u [.., H], B [.., N], C [.., N], Δ̃ [.., n_h]) column blocks of z (float64)."""
    z = np.asarray(z, np.float64)
    H, N = int(width), D_STATE
    return z[..., :H], z[..., H:H + N], z[..., H + N:H + 2 * N], z[..., H + 2 * N:H + 2 * N + n_heads]


def ssd_scan_ref(z, dt_bias, a_log, mask, n_steps: int, n_heads: int):
    """(y [B, H], cache) in float64 for z [B·K, P] (module docstring); mask [B, K] or None (all valid)."""
    K = int(n_steps)
    n_h = int(n_heads)
    P = np.asarray(z).shape[1]
    H = P - 2 * D_STATE - n_h
    z = np.asarray(z, np.float64).reshape(-1, K, P)
    Bn = z.shape[0]
    m = np.ones((Bn, K)) if mask is None else np.asarray(mask, np.float64)
    u, Bt, Ct, dt_pre = _split(z, H, n_h)  # [B, K, ..]
    dt = softplus_ref(dt_pre + np.asarray(dt_bias, np.float64))  # [B, K, n_h]
    ea = np.exp(np.asarray(a_log, np.float64))
    a = np.exp(-dt * ea)
    hd = H // n_h
    a_c, dt_c = np.repeat(a, hd, axis=2), np.repeat(dt, hd, axis=2)  # per channel [B, K, H]
    S = np.zeros((Bn, K + 1, H, D_STATE))  # S[:, t + 1] = S_t, S[:, 0] = S_{-1} = 0
    for t in range(K):
        S[:, t + 1] = m[:, t, None, None] * (a_c[:, t, :, None] * S[:, t]
                                              + (dt_c[:, t] * u[:, t])[:, :, None] * Bt[:, t, None, :])
    y = np.einsum("bcn,bn->bc", S[:, K], Ct[:, K - 1])
    return y, {"z": z, "m": m, "u": u, "Bt": Bt, "Ct": Ct, "dt_pre": dt_pre, "dt": dt, "a": a, "ea": ea, "S": S,
               "n_heads": n_h, "dt_bias": np.asarray(dt_bias, np.float64)}


def ssd_scan_backward_ref(g, cache):
    """(dz [B·K, P], ∂L/∂b_Δ [n_h], ∂L/∂A_log [n_h]) in float64 from g = ∂L/∂y [B, H]: the full adjoint
    G_t = ∂L/∂S_t [B, H, N] carried back through every step (plain BPTT of the recurrence)."""
    g = np.asarray(g, np.float64)
    z, m, u, Bt, Ct, S = cache["z"], cache["m"], cache["u"], cache["Bt"], cache["Ct"], cache["S"]
    dt, a, ea, n_h = cache["dt"], cache["a"], cache["ea"], cache["n_heads"]
    Bn, K, P = z.shape
    H = u.shape[2]
    hd = H // n_h
    du, dB, dC = np.zeros_like(u), np.zeros_like(Bt), np.zeros_like(Ct)
    d_dt, d_a = np.zeros_like(dt), np.zeros_like(a)
    dC[:, K - 1] = np.einsum("bc,bcn->bn", g, S[:, K])
    G = g[:, :, None] * Ct[:, K - 1, None, :]  # ∂L/∂S_{K−1}

    def heads(v):  # [B, H, N] -> [B, n_h]: the sum over each head's channels and the state index
        return v.reshape(Bn, n_h, hd, D_STATE).sum(axis=(2, 3))

    for t in range(K - 1, -1, -1):
        Gh = m[:, t, None, None] * G  # gradient of the pre-mask value a_t S_{t−1} + Δ_t u_t B_t
        a_c = np.repeat(a[:, t], hd, axis=1)
        dt_c = np.repeat(dt[:, t], hd, axis=1)
        d_a[:, t] = heads(Gh * S[:, t])
        d_dt[:, t] = heads(Gh * u[:, t, :, None] * Bt[:, t, None, :])
        du[:, t] = dt_c * np.einsum("bcn,bn->bc", Gh, Bt[:, t])
        dB[:, t] = np.einsum("bcn,bc->bn", Gh, dt_c * u[:, t])
        G = Gh * a_c[:, :, None]  # ∂L/∂S_{t−1}
    d_dt_total = d_dt + d_a * (-ea * a)
    d_dt_pre = d_dt_total * (1.0 / (1.0 + np.exp(-(cache["dt_pre"] + cache["dt_bias"]))))
    d_a_log = (d_a * (-dt * ea * a)).sum(axis=(0, 1))
    dz = np.concatenate([du, dB, dC, d_dt_pre], axis=2).reshape(Bn * K, P)
    return dz, d_dt_pre.sum(axis=(0, 1)), d_a_log


def ssd_step_ref(z, state, reset, dt_bias, a_log, n_heads: int):
    """(y [N_env, H], new state [N_env, H, N]) in float64: one acting step from z [N_env, P]; reset
    [N_env] (nonzero: the env's episode starts at this row, its state is cleared before the update)."""
    n_h = int(n_heads)
    P = np.asarray(z).shape[1]
    H = P - 2 * D_STATE - n_h
    u, Bt, Ct, dt_pre = _split(z, H, n_h)
    dt = softplus_ref(dt_pre + np.asarray(dt_bias, np.float64))
    a = np.exp(-dt * np.exp(np.asarray(a_log, np.float64)))
    hd = H // n_h
    keep = (np.asarray(reset) == 0).astype(np.float64)[:, None, None]
    S = np.repeat(a, hd, axis=1)[:, :, None] * keep * np.asarray(state, np.float64) \
        + (np.repeat(dt, hd, axis=1) * u)[:, :, None] * Bt[:, None, :]
    return np.einsum("ecn,en->ec", S, Ct), S


# ---------------------------------------------------------------------------------------------
# device functions
# ---------------------------------------------------------------------------------------------
@_cuda.jit(device=True, inline=True)
def softplus_dev(v):
    """log(1 + e^v) without overflow."""
    if v > _ZERO:
        return v + math.log1p(math.exp(-v))
    return math.log1p(math.exp(v))


@_cuda.jit(device=True, inline=True)
def decay_dev(dt_pre, dt_bias, exp_a_log):
    """(Δ, a) = (softplus(Δ̃ + b_Δ), exp(−Δ·e^{A_log}))."""
    dt = softplus_dev(dt_pre + dt_bias)
    return dt, math.exp(-dt * exp_a_log)


@_cuda.jit(device=True, inline=True)
def state_update_dev(S, a, dt_u, z, row, b_col):
    """S[n] = a·S[n] + (Δ·u)·B[n] for one channel's state row (B read from z[row, b_col:])."""
    for n in range(D_STATE):
        S[n] = a * S[n] + dt_u * z[row, b_col + n]


@_cuda.jit(device=True, inline=True)
def zero_row_dev(S):
    """S[n] = 0 for n = 0..N−1 (a state row cleared, or an accumulator row started)."""
    for n in range(D_STATE):
        S[n] = _ZERO


@_cuda.jit(device=True, inline=True)
def row_masked_dev(mask, has_mask, b, t):
    """Whether row t of window b is masked (m_t = 0); mask is not read without has_mask."""
    return has_mask and mask[b, t] == _ZERO


@_cuda.jit(device=True, inline=True)
def scan_step_dev(S, masked, a, dt_u, z, row, b_col):
    """One scan step of a channel's state row: cleared at a masked row (the state restarts after it),
    else :func:`state_update_dev`."""
    if masked:
        zero_row_dev(S)
    else:
        state_update_dev(S, a, dt_u, z, row, b_col)


@_cuda.jit(device=True, inline=True)
def cell_dev(i, n_cols):
    """(row, column) of the flat index i over rows of n_cols."""
    r = i // n_cols
    return r, i - r * n_cols


@_cuda.jit(device=True, inline=True)
def channel_dev(i, width, head_dim):
    """(row, channel c, head h of c) of the flat index i over rows of width channels."""
    r, c = cell_dev(i, width)
    return r, c, c // head_dim


@_cuda.jit(device=True, inline=True)
def state_read_dev(S, z, row, c_col):
    """Σ_n S[n]·C[n] in order n = 0..N−1 (C read from z[row, c_col:])."""
    acc = _ZERO
    for n in range(D_STATE):
        acc += S[n] * z[row, c_col + n]
    return acc


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def ssd_scan_forward_kernel(z, dt_bias, a_log, mask, has_mask, n_steps, head_dim, y, delta, decay):
    """One thread per (window b, channel c): the K-step scan of S[c, :]; y[b, c] at the last step."""
    i = _cuda.grid(1)
    if i >= y.size:
        return
    width = y.shape[1]
    b, c, h = channel_dev(i, width, head_dim)
    b_col = width
    c_col = width + D_STATE
    dt_col = width + 2 * D_STATE + h
    ea = math.exp(a_log[h])
    bias = dt_bias[h]
    S = _cuda.local.array(D_STATE, float32)
    zero_row_dev(S)
    for t in range(n_steps):
        row = b * n_steps + t
        dt, a = decay_dev(z[row, dt_col], bias, ea)
        if c == h * head_dim:  # the head's first channel saves Δ_t, a_t for the backward
            delta[row, h] = dt
            decay[row, h] = a
        scan_step_dev(S, row_masked_dev(mask, has_mask, b, t), a, dt * z[row, c], z, row, b_col)
    y[b, c] = state_read_dev(S, z, b * n_steps + n_steps - 1, c_col)


@_cuda.jit(cache=True)
def ssd_scan_backward_kernel(z, dt_bias, a_log, mask, has_mask, n_steps, head_dim, g, delta, decay,
                             d_dt_pre, coef, dbw, d_a_log_part, d_c_part):
    """One thread per (window b, head h): per-head sums r_t, q_t and ∂L/∂C over the head's channels
    (state rows recomputed from the saved Δ, a), then the reverse scan γ_{t−1} = m_t a_t γ_t."""
    i = _cuda.grid(1)
    if i >= d_a_log_part.size:
        return
    b, h = cell_dev(i, d_a_log_part.shape[1])
    width = g.shape[1]
    b_col = width
    c_col = width + D_STATE
    dt_col = width + 2 * D_STATE + h
    last = b * n_steps + n_steps - 1
    S = _cuda.local.array(D_STATE, float32)
    dc = _cuda.local.array(D_STATE, float32)
    r = _cuda.local.array(MAX_STEPS, float32)
    q = _cuda.local.array(MAX_STEPS, float32)
    zero_row_dev(dc)
    for t in range(n_steps):
        r[t] = _ZERO
        q[t] = _ZERO
    # per-head sums over the channels, p = 0..head_dim−1 in order
    for p in range(head_dim):
        c = h * head_dim + p
        gp = g[b, c]
        zero_row_dev(S)
        for t in range(n_steps):
            row = b * n_steps + t
            q[t] += gp * state_read_dev(S, z, last, c_col)  # g[c]·(S_{t−1}[c, :]·C_{K−1})
            u = z[row, c]
            r[t] += gp * u
            scan_step_dev(S, row_masked_dev(mask, has_mask, b, t), decay[row, h], delta[row, h] * u, z, row, b_col)
        for n in range(D_STATE):
            dc[n] += gp * S[n]
    # reverse scan, t = K−1..0
    ea = math.exp(a_log[h])
    bias = dt_bias[h]
    gamma = _ONE
    d_a_log = _ZERO
    for k in range(n_steps):
        t = n_steps - 1 - k
        row = b * n_steps + t
        if row_masked_dev(mask, has_mask, b, t):
            d_dt_pre[row, h] = _ZERO
            coef[row, h] = _ZERO
            dbw[row, h] = _ZERO
            gamma = _ZERO  # the state restarted here: nothing earlier reaches y
            continue
        dt = delta[row, h]
        a = decay[row, h]
        beta = _ZERO
        for n in range(D_STATE):
            beta += z[row, b_col + n] * z[last, c_col + n]
        d_a = gamma * q[t]
        d_dt = gamma * r[t] * beta - d_a * ea * a
        d_dt_pre[row, h] = d_dt * sigmoid_dev(z[row, dt_col] + bias)
        d_a_log = d_a_log - d_a * dt * ea * a
        coef[row, h] = gamma * dt * beta
        dbw[row, h] = gamma * dt * r[t]
        gamma = gamma * a
    d_a_log_part[b, h] = d_a_log
    for n in range(D_STATE):
        d_c_part[b, h, n] = dc[n]


@_cuda.jit(cache=True)
def ssd_input_grad_kernel(g, z, n_steps, head_dim, d_dt_pre, coef, dbw, d_c_part, dz):
    """A thread row per row of z (block (lanes, rows) of launch.row_block), its lanes along the columns j:
    dz = [∂L/∂u | ∂L/∂B | ∂L/∂C | ∂L/∂Δ̃] (module docstring). One division per row for (b, t) instead of two
    per element (the flat-index layout before: ~29 M threads at B = 16,384, K = 16; the u columns keep one for
    their head), same sums in the same order."""
    row = _cuda.blockIdx.x * _cuda.blockDim.y + _cuda.threadIdx.y
    if row >= dz.shape[0]:
        return
    b, t = cell_dev(row, n_steps)
    width = g.shape[1]
    n_heads = coef.shape[1]
    last = b * n_steps + n_steps - 1
    j = _cuda.threadIdx.x
    while j < dz.shape[1]:
        if j < width:
            dz[row, j] = coef[row, j // head_dim] * g[b, j]
        elif j < width + D_STATE:
            acc = _ZERO
            for h in range(n_heads):
                acc += dbw[row, h]
            dz[row, j] = acc * z[last, j + D_STATE]  # · C_{K−1}[n]
        elif j < width + 2 * D_STATE:
            acc = _ZERO
            if t == n_steps - 1:
                for h in range(n_heads):
                    acc += d_c_part[b, h, j - width - D_STATE]
            dz[row, j] = acc
        else:
            dz[row, j] = d_dt_pre[row, j - width - 2 * D_STATE]
        j += _cuda.blockDim.x


@_cuda.jit(cache=True)
def ssd_step_kernel(z, dt_bias, a_log, reset, head_dim, state, y):
    """One thread per (env e, channel c): S = a·(reset ? 0 : S) + Δ u B; y = S·C; S written back."""
    i = _cuda.grid(1)
    if i >= y.size:
        return
    width = y.shape[1]
    e, c, h = channel_dev(i, width, head_dim)
    ea = math.exp(a_log[h])
    dt, a = decay_dev(z[e, width + 2 * D_STATE + h], dt_bias[h], ea)
    S = _cuda.local.array(D_STATE, float32)
    clear = reset[e] != _ZERO
    for n in range(D_STATE):
        S[n] = _ZERO if clear else state[e, c, n]
    state_update_dev(S, a, dt * z[e, c], z, e, width)
    y[e, c] = state_read_dev(S, z, e, width + D_STATE)
    for n in range(D_STATE):
        state[e, c, n] = S[n]


@_cuda.jit(cache=True)
def last_row_kernel(x, n_steps, out, accumulate):
    """out[b, j] = x[b·K + K − 1, j] (accumulate: +=). One thread per (b, j)."""
    i = _cuda.grid(1)
    if i >= out.size:
        return
    b, j = cell_dev(i, out.shape[1])
    v = x[b * n_steps + n_steps - 1, j]
    if accumulate:
        out[b, j] += v
    else:
        out[b, j] = v


@_cuda.jit(cache=True)
def add_to_last_row_kernel(dh, n_steps, dx):
    """dx[b·K + K − 1, j] += dh[b, j] (the residual's gradient). One thread per (b, j)."""
    i = _cuda.grid(1)
    if i >= dh.size:
        return
    b, j = cell_dev(i, dh.shape[1])
    dx[b * n_steps + n_steps - 1, j] += dh[b, j]


# ---------------------------------------------------------------------------------------------
# launchers (no allocation, host copy or sync: capturable)
# ---------------------------------------------------------------------------------------------
def _expect(what: str, arr, shape, dtype=np.float32):
    if tuple(arr.shape) != tuple(shape) or arr.dtype != dtype:
        raise ValueError(f"{what}: expected {np.dtype(dtype).name} {tuple(shape)}, got {arr.dtype} {tuple(arr.shape)}")


def _check_scan(z, dt_bias, a_log, mask, n_steps, head_dim, y):
    n_seq, width = y.shape
    n_heads = dt_bias.shape[0]
    if n_steps < 1 or n_steps > MAX_STEPS:
        raise ValueError(f"ssd scan: n_steps must be in 1..{MAX_STEPS} (MAX_STEPS), got {n_steps}")
    if head_dim * n_heads != width:
        raise ValueError(f"ssd scan: n_heads {n_heads} · head_dim {head_dim} != width {width}")
    _expect("ssd scan z", z, (n_seq * n_steps, z_width(width, n_heads)))
    _expect("ssd scan a_log", a_log, (n_heads,))
    if mask is not None:
        _expect("ssd scan mask", mask, (n_seq, n_steps))
    return n_seq, width, n_heads


def ssd_scan_forward(z, dt_bias, a_log, mask, n_steps: int, head_dim: int, y, delta, decay, stream):
    """y [B, H] = the scan's last-step output; delta, decay [B·K, n_h] saved for the backward.
    mask: float32 [B, K] (1 valid, 0 masked) or None (every row valid)."""
    n_seq, width, n_heads = _check_scan(z, dt_bias, a_log, mask, n_steps, head_dim, y)
    _expect("ssd scan delta", delta, (n_seq * n_steps, n_heads))
    _expect("ssd scan decay", decay, (n_seq * n_steps, n_heads))
    ssd_scan_forward_kernel[launch.blocks(n_seq * width, BLOCK), BLOCK, stream](
        z, dt_bias, a_log, delta if mask is None else mask, mask is not None, np.int32(n_steps),
        np.int32(head_dim), y, delta, decay)


def ssd_scan_backward(g, z, dt_bias, a_log, mask, n_steps: int, head_dim: int, delta, decay,
                      d_dt_pre, coef, dbw, d_a_log_part, d_c_part, dz, stream):
    """dz [B·K, P] from g = ∂L/∂y [B, H]; per-(b, h) parts of ∂L/∂A_log in d_a_log_part [B, n_h] and
    ∂L/∂Δ̃ in d_dt_pre [B·K, n_h] (their sums over b are the caller's fixed-order column sums);
    coef, dbw [B·K, n_h] and d_c_part [B, n_h, N] are scratch."""
    n_seq, _, n_heads = _check_scan(z, dt_bias, a_log, mask, n_steps, head_dim, g)
    rows = n_seq * n_steps
    for what, arr in (("d_dt_pre", d_dt_pre), ("coef", coef), ("dbw", dbw), ("delta", delta), ("decay", decay)):
        _expect(f"ssd scan backward {what}", arr, (rows, n_heads))
    _expect("ssd scan backward d_a_log_part", d_a_log_part, (n_seq, n_heads))
    _expect("ssd scan backward d_c_part", d_c_part, (n_seq, n_heads, D_STATE))
    _expect("ssd scan backward dz", dz, z.shape)
    ssd_scan_backward_kernel[launch.blocks(n_seq * n_heads, BLOCK), BLOCK, stream](
        z, dt_bias, a_log, delta if mask is None else mask, mask is not None, np.int32(n_steps),
        np.int32(head_dim), g, delta, decay, d_dt_pre, coef, dbw, d_a_log_part, d_c_part)
    grid, block = launch.row_block(rows, dz.shape[1], ROW_THREADS)
    ssd_input_grad_kernel[grid, block, stream](g, z, np.int32(n_steps), np.int32(head_dim), d_dt_pre, coef, dbw,
                                               d_c_part, dz)


def ssd_step(z, dt_bias, a_log, reset, head_dim: int, state, y, stream):
    """One acting step: state [N_env, H, N] updated in place, y [N_env, H]; reset float32 [N_env]
    (nonzero: clear the env's state before the update, its episode starts at this row)."""
    n_env, width = y.shape
    n_heads = dt_bias.shape[0]
    if head_dim * n_heads != width:
        raise ValueError(f"ssd step: n_heads {n_heads} · head_dim {head_dim} != width {width}")
    _expect("ssd step z", z, (n_env, z_width(width, n_heads)))
    _expect("ssd step state", state, (n_env, width, D_STATE))
    _expect("ssd step reset", reset, (n_env,))
    ssd_step_kernel[launch.blocks(n_env * width, BLOCK), BLOCK, stream](
        z, dt_bias, a_log, reset, np.int32(head_dim), state, y)


def last_row(x, n_steps: int, out, stream, accumulate: bool = False):
    """out[b, :] (+)= x[b·K + K − 1, :] for x [B·K, H], out [B, H]."""
    _expect("last_row x", x, (out.shape[0] * n_steps, out.shape[1]))
    last_row_kernel[launch.blocks(out.size, BLOCK), BLOCK, stream](x, np.int32(n_steps), out, bool(accumulate))


def add_to_last_row(dh, n_steps: int, dx, stream):
    """dx[b·K + K − 1, :] += dh[b, :]."""
    _expect("add_to_last_row dx", dx, (dh.shape[0] * n_steps, dh.shape[1]))
    add_to_last_row_kernel[launch.blocks(dh.size, BLOCK), BLOCK, stream](dh, np.int32(n_steps), dx)
