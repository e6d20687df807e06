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
each GEMM output, loaded once into shared memory; the per-branch base row V - mean_a A, the row
statistics (one thread per (b, k, a) row: max, log Σ exp, Q) and the coalesced logits / probs
stores all read shared memory. Each pass declares the outputs it needs
(`declare_acts(..., outputs=...)`) and computes nothing else: the train step's online pass
("logits", "q"), the next-obs pass ("q",), the target pass ("probs",), acting ("q",).
Measured on the H200 (B = 16,384, branches (3, 3, 4, 4), 51 atoms, `python -m numbarl.bench.head`
and `bench.train --profile`): 156 µs per train-step pass on average, against 169 + 75 + 114 µs for
the earlier three-kernel split (elementwise logits, row stats, elementwise probs, every pass all
outputs) and 0.59 ms for the first one-thread-per-row kernel. Nsight Compute (on a variant with
the same loops) found it compute-bound with register-limited occupancy, not memory-bound: 94
registers per thread allow 5 blocks of 128 threads per SM.
Backward: `dueling_backward_kernel`, one thread per (b, z) (block (EW_ATOMS, EW_ROWS)): adjacent
threads touch adjacent atoms (coalesced), each loops over the branches and their actions.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import numpy as np
from numba import float32

from numbarl.cuda import blas, launch, reduce
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
# Elementwise kernels over [B, Z] rows (the head's backward and the C51 loss's): EW_ATOMS threads
# along the atoms (loop beyond), EW_ROWS samples per block.
EW_ATOMS = launch.shape(gpu=64, sim=1)
EW_ROWS = launch.shape(gpu=4, sim=8)
SHARED_BYTES_MAX = 48 * 1024  # dynamic shared memory a block may use without an opt-in

_ZERO = np.float32(0.0)
_NEG_INF = np.float32(-np.inf)


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
@_cuda.jit(cache=True)
def dueling_head_kernel(value, adv, n_atoms, width, branch_sizes, branch_offsets, branch_inv_sizes, support,
                        max_actions, samples, want_logits, want_stats, want_probs, logits, lse, q, probs):
    """One block per `samples` samples, block (HEAD_TX, HEAD_TY), dynamic shared memory
    (`head_shared_floats`): the block's value and advantage rows are loaded once, coalesced, and
    every output is computed from shared memory. value [B·Z] and adv [B·ΣA·Z] are flat views.

    1. load  V [S, Z] and A [S, ΣA·Z]: one contiguous span each, four loads in flight per thread;
    2. base  base[s, k, z] = V[s, z] - (Σ_a A[s, k, a, z]) · (1/A_k), thread row per sample, lane
             per atom (and the support, once per block);
    3. stats one thread per (s, k, a) row: x_z = A + base; row max, then lse = max + log Σ e and
             Q = Σ e·z / Σ e with e = exp(x_z - max) (skipped for a logits-only pass); padding
             rows lse = q = -inf;
    4. rows  thread row per (s, k, a), lanes along z: logits x_z and/or probs exp(x_z - lse),
             coalesced stores; padding logits -inf, probs 0.
    Fixed summation orders, no atomics: the same inputs give the same bits on every run.
    """
    sh = _cuda.shared.array(0, float32)
    batch = value.shape[0] // n_atoms
    n_branches = branch_sizes.shape[0]
    tx = _cuda.threadIdx.x
    ty = _cuda.threadIdx.y
    lanes = _cuda.blockDim.x  # the launch shape is read, not compiled in: a cached kernel serves any shape
    rows_y = _cuda.blockDim.y
    threads = lanes * rows_y
    t = ty * lanes + tx
    b0 = _cuda.blockIdx.x * samples
    n_s = min(samples, batch - b0)
    rows_per_sample = n_branches * max_actions
    n_rows = n_s * rows_per_sample
    off_a = samples * n_atoms  # shared layout: V | A | base | lse | support
    off_base = off_a + samples * width
    off_lse = off_base + samples * n_branches * n_atoms
    off_support = off_lse + samples * rows_per_sample

    # 1. load (the block's rows are contiguous in both GEMM outputs)
    n_load = n_s * width
    src = b0 * width
    i = t
    while i + 3 * threads < n_load:  # four independent loads before the stores
        x0 = adv[src + i]
        x1 = adv[src + i + threads]
        x2 = adv[src + i + 2 * threads]
        x3 = adv[src + i + 3 * threads]
        sh[off_a + i] = x0
        sh[off_a + i + threads] = x1
        sh[off_a + i + 2 * threads] = x2
        sh[off_a + i + 3 * threads] = x3
        i += 4 * threads
    while i < n_load:
        sh[off_a + i] = adv[src + i]
        i += threads
    i = t
    while i < n_s * n_atoms:
        sh[i] = value[b0 * n_atoms + i]
        i += threads
    _cuda.syncthreads()

    # 2. per-branch base row: base[s, k, z] = V[s, z] - (Σ_a A[s, k, a, z]) · (1/A_k)
    s = ty
    while s < n_s:
        for k in range(n_branches):
            n_actions = branch_sizes[k]
            first = off_a + s * width + branch_offsets[k] * n_atoms
            inv_n = branch_inv_sizes[k]
            out = off_base + (s * n_branches + k) * n_atoms
            z = tx
            while z < n_atoms:
                acc = _ZERO
                for a in range(n_actions):
                    acc += sh[first + a * n_atoms + z]
                sh[out + z] = sh[s * n_atoms + z] - acc * inv_n
                z += lanes
        s += rows_y
    i = t
    while i < n_atoms:
        sh[off_support + i] = support[i]
        i += threads
    _cuda.syncthreads()

    # 3. row statistics: log-sum-exp and Q, one thread per row
    if want_stats or want_probs:
        r = t
        while r < n_rows:
            s = r // rows_per_sample
            rem = r - s * rows_per_sample
            k = rem // max_actions
            a = rem - k * max_actions
            log_norm = _NEG_INF
            q_val = _NEG_INF
            if a < branch_sizes[k]:
                a_row = off_a + s * width + (branch_offsets[k] + a) * n_atoms
                b_row = off_base + (s * n_branches + k) * n_atoms
                mx = _NEG_INF
                for z in range(n_atoms):
                    mx = max(mx, sh[a_row + z] + sh[b_row + z])
                total = _ZERO
                expected = _ZERO
                for z in range(n_atoms):
                    e = math.exp(sh[a_row + z] + sh[b_row + z] - mx)
                    total += e
                    expected += e * sh[off_support + z]
                log_norm = mx + math.log(total)
                q_val = expected / total
            sh[off_lse + r] = log_norm
            if want_stats:
                lse[b0 + s, k, a] = log_norm
                q[b0 + s, k, a] = q_val
            r += threads
        _cuda.syncthreads()

    # 4. logits and / or probabilities, coalesced along the atoms
    if want_logits or want_probs:
        for s in range(n_s):
            for k in range(n_branches):
                n_actions = branch_sizes[k]
                b_row = off_base + (s * n_branches + k) * n_atoms
                a = ty
                while a < max_actions:
                    z = tx
                    if a < n_actions:
                        a_row = off_a + s * width + (branch_offsets[k] + a) * n_atoms
                        log_norm = _ZERO
                        if want_probs:
                            log_norm = sh[off_lse + (s * n_branches + k) * max_actions + a]
                        while z < n_atoms:
                            x = sh[a_row + z] + sh[b_row + z]
                            if want_logits:
                                logits[b0 + s, k, a, z] = x
                            if want_probs:
                                probs[b0 + s, k, a, z] = math.exp(x - log_norm)
                            z += lanes
                    else:  # padding: defined, never NaN
                        while z < n_atoms:
                            if want_logits:
                                logits[b0 + s, k, a, z] = _NEG_INF
                            if want_probs:
                                probs[b0 + s, k, a, z] = _ZERO
                            z += lanes
                    a += rows_y


@_cuda.jit(cache=True)
def dueling_backward_kernel(d_logits, branch_sizes, branch_offsets, branch_inv_sizes, d_value, d_adv):
    """Thread (z, b): dV[b, z] and dA[b, :, z] from d_logits (padding entries ignored); grid
    ceil(B / EW_ROWS), block (EW_ATOMS, EW_ROWS)."""
    b = _cuda.blockIdx.x * EW_ROWS + _cuda.threadIdx.y
    if b >= d_logits.shape[0]:
        return
    n_branches = d_logits.shape[1]
    n_atoms = d_logits.shape[3]
    z = _cuda.threadIdx.x
    while z < n_atoms:
        dv = _ZERO
        for k in range(n_branches):
            n_actions = branch_sizes[k]
            s = _ZERO
            for a in range(n_actions):
                s += d_logits[b, k, a, z]
            dv += s
            mean = s * branch_inv_sizes[k]
            first = branch_offsets[k] * n_atoms + z
            for a in range(n_actions):
                d_adv[b, first + a * n_atoms] = d_logits[b, k, a, z] - mean
        d_value[b, z] = dv
        z += EW_ATOMS


# ---------------------------------------------------------------------------------------------
# launchers and the layer
# ---------------------------------------------------------------------------------------------
OUTPUTS = ("logits", "probs", "q")


class C51Outputs(NamedTuple):
    """Fixed-address device views written by `BranchedDuelingC51Head.forward` for one tag
    (None for an output the tag was declared without)."""

    logits: object  # float32 [B, n_branches, max_actions, Z]
    probs: object  # float32 [B, n_branches, max_actions, Z] or None
    q: object  # float32 [B, n_branches, max_actions] or None


class BranchedDuelingC51Head(Module):
    """Dueling branched C51 head (module contract of numbarl.rl.nets.module).

    Parameters (weights [in, out], y = h @ W + b):
        {name}.value.w [H, Z]   {name}.value.b [Z]            group "{name}.value"
        {name}.adv.w [H, ΣA·Z]  {name}.adv.b [ΣA·Z]           group "{name}.adv"
    Buffers per tag (declare_acts): value, adv, logits, lse, q, and probs if requested by
    `outputs`; with backward=True the backward scratch d_value, d_adv, dh and the column-sum
    scratch of the accumulating bias gradients.

    forward(h, stream, tag, role) -> C51Outputs(logits, probs, q); backward(d_logits, stream, tag)
    -> dh, the four gradients by the gradient rule. compute="tf32" switches the GEMMs to TF32.
    """

    native_dx_accumulate = True  # dh ends in GEMMs: the first takes the ledger's beta

    def __init__(self, name: str, hidden: int, branch_sizes, n_atoms: int = 51, v_min: float = -10.0,
                 v_max: float = 10.0, compute: str = "fp32"):
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

        # constant per-branch tables, uploaded once (before any capture)
        layout = Arena(f"{name}.layout")
        layout.add("branch_sizes", (self.n_branches,), np.int32)
        layout.add("branch_offsets", (self.n_branches,), np.int32)
        layout.add("branch_inv_sizes", (self.n_branches,), np.float32)
        layout.add("support", (self.n_atoms,), np.float32)
        layout.add("unused4", (1, 1, 1, 1), np.float32)  # stands in for an output a pass does not want
        layout.add("unused3", (1, 1, 1), np.float32)
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
        (`dueling_head_kernel` takes it from device memory, so a captured graph follows). A host
        copy: between graph replays, never inside a capture."""
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

    def buffers(self, batch: int, backward: bool, outputs=OUTPUTS, **opts) -> list[Buf]:
        """Buffers of one pass. backward=False skips the backward scratch (target / next passes).

        outputs: which of "logits", "probs", "q" the pass computes (one kernel launch either way;
        each output left out is a [B, n_branches, max_actions, Z] store saved). "q" also writes the
        row log-sum-exp (lse). The train step declares ("logits", "q") for the online pass (logits
        for the loss, Q for the logged Q-mean), ("q",) for the next-obs pass and ("probs",) for the
        target pass; acting and evaluation declare ("q",).
        """
        unknown = set(outputs) - set(OUTPUTS)
        if unknown or not outputs:
            raise ValueError(f"{self.name}: outputs must be a non-empty subset of {OUTPUTS} (got {tuple(outputs)})")
        b, z, width = int(batch), self.n_atoms, self.total_actions * self.n_atoms
        shape4 = (b, self.n_branches, self.max_actions, z)
        bufs = [Buf("value", (b, z)), Buf("adv", (b, width))]
        if "logits" in outputs:
            bufs.append(Buf("logits", shape4))
        if "q" in outputs:
            bufs += [Buf("lse", shape4[:3]), Buf("q", shape4[:3])]
        if "probs" in outputs:
            bufs.append(Buf("probs", shape4))
        if backward:
            bufs += [Buf("d_value", (b, z)), Buf("d_adv", (b, width)), Buf("dh", (b, self.hidden)),
                     Buf("partials_value", reduce.col_partials_shape(b, z)),
                     Buf("partials_adv", reduce.col_partials_shape(b, width))]
        return bufs

    def outputs(self, tag: str = "online") -> C51Outputs:
        acts = self._arena(tag)

        def view(what):
            name = self._buf_name(tag, what)
            return acts[name] if name in acts else None

        return C51Outputs(view("logits"), view("probs"), view("q"))

    def dx_buffer(self, c: Ctx):
        return c.buf("dh")

    # -- kernels ------------------------------------------------------------------------------
    def forward_impl(self, c: Ctx, h) -> C51Outputs:
        """The two GEMMs, then the dueling combination + softmax in one launch."""
        value, adv = c.buf("value"), c.buf("adv")
        blas.gemm(h, c.p("w_value"), value, bias=c.p("b_value"), compute=self.compute, stream=c.stream)
        blas.gemm(h, c.p("w_adv"), adv, bias=c.p("b_adv"), compute=self.compute, stream=c.stream)
        out = self.outputs(c.tag)
        lse = c.buf("lse") if out.q is not None else None
        dueling_forward(value, adv, self.layout, c.stream, logits=out.logits, lse=lse, q=out.q, probs=out.probs)
        return out

    def backward_impl(self, c: Ctx, d_logits, dh):
        """dV, dA from d_logits [B, n_branches, max_actions, Z]; the four gradients by the gradient
        rule; dh = dV·W_vᵀ + dA·W_aᵀ into `dh` (the second GEMM accumulates)."""
        expected = (c.batch, self.n_branches, self.max_actions, self.n_atoms)
        if tuple(d_logits.shape) != expected:
            raise ValueError(f"{self.name}.backward: d_logits has shape {tuple(d_logits.shape)}, expected {expected}")
        h, d_value, d_adv = c.x(), c.buf("d_value"), c.buf("d_adv")
        dueling_backward(d_logits, self.layout, d_value, d_adv, c.stream)
        linear_param_grads(c, h, d_value, "w_value", "b_value", c.buf("partials_value"), self.compute)
        linear_param_grads(c, h, d_adv, "w_adv", "b_adv", c.buf("partials_adv"), self.compute)
        blas.gemm(d_value, c.p("w_value"), dh, trans_b=True, beta=c.dx_beta, compute=self.compute, stream=c.stream)
        blas.gemm(d_adv, c.p("w_adv"), dh, trans_b=True, beta=1.0, compute=self.compute, stream=c.stream)
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
    """float32 slots of dynamic shared memory one forward block uses (V | A | base | lse, support)."""
    return samples * (n_atoms + width + n_branches * n_atoms + n_branches * max_actions) + n_atoms


def dueling_forward(value, adv, layout: Arena, stream, logits=None, lse=None, q=None, probs=None,
                    block=None, samples=None) -> None:
    """The dueling combination and its softmax in one launch; writes only the outputs given.

    value [B, Z], adv [B, ΣA·Z]; logits, probs [B, n_branches, max_actions, Z]; lse, q
    [B, n_branches, max_actions] (both or neither). layout: Arena with int32 branch_sizes /
    branch_offsets, float32 branch_inv_sizes, support and the unused4 / unused3 stand-ins
    (`BranchedDuelingC51Head.layout`). block (lanes, thread rows) and samples (per block, at most)
    default to HEAD_TX/HEAD_TY and HEAD_SAMPLES; every shape gives the same bits.
    """
    given = [x for x in (logits, probs) if x is not None]
    if (lse is None) != (q is None):
        raise ValueError("c51 head: lse and q are written together: give both or neither")
    if not given and q is None:
        raise ValueError("c51 head: dueling_forward needs at least one output (logits, probs or q)")
    batch, n_atoms = value.shape
    sizes = layout["branch_sizes"]
    n_branches = sizes.shape[0]
    max_actions = (given[0].shape[2] if given else q.shape[2])
    shape4 = (batch, n_branches, max_actions, n_atoms)
    _check("value", value, (batch, n_atoms))
    _check("adv", adv, (batch, adv.shape[1]))
    _check("support", layout["support"], (n_atoms,))
    for name, arr in (("logits", logits), ("probs", probs)):
        if arr is not None:
            _check(name, arr, shape4)
    for name, arr in (("lse", lse), ("q", q)):
        if arr is not None:
            _check(name, arr, shape4[:3])
    if adv.shape[1] % n_atoms:
        raise ValueError(f"c51 head: adv has {adv.shape[1]} columns, not a multiple of {n_atoms} atoms")
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
            value.reshape(value.size), adv.reshape(adv.size), np.int64(n_atoms), np.int64(adv.shape[1]), sizes,
            layout["branch_offsets"], layout["branch_inv_sizes"], layout["support"],
            np.int64(max_actions), np.int64(samples), logits is not None, q is not None, probs is not None,
            u4 if logits is None else logits, u3 if lse is None else lse, u3 if q is None else q,
            u4 if probs is None else probs)


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
