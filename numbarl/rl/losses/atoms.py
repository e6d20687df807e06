"""Adaptive atom positions for the C51 support (agent.adaptive_atoms): spacings learned by gradient
ascent on the entropy of the batch-mean projected target.

Support (parameters s = `spacing_raw` [Z-1], float64 device memory):

    c_0 = 0,   c_i = Σ_{j<i} softplus(s_j)            (i = 1..Z-1, C = c_{Z-1})
    z_i = v_min + W · c_i / C,   W = v_max - v_min     (z_0 = v_min and z_{Z-1} = v_max stay fixed)

s starts at softplus⁻¹(1) = log(e - 1) for every j: c_i = i, the configured linspace. (v_min, v_max)
are the agent's support range in force (`agent.support_state["range"]`, float64 [2]: the config's,
or the one agent.support = "fit" sets after the prefill).

Objective (the origin notes' "atom entropy"), over the R = B · n_branches rows (b, k) of the last
train batch, p_{bk} = the target net's distribution at the double-DQN action, Φ_z = Algorithm 1 on
the support z (numbarl/rl/losses/c51.py: `project_distribution_nonuniform_ref`):

    m̄(s) = (1/R) Σ_{b,k} Φ_{z(s)}(r_b + γ_b z(s), p_{bk})      [Z]   (= column mean of target_dist)
    J(s) = H(m̄) = -Σ_i m̄_i log m̄_i

Update, on the aux train steps after `warmup` train steps, gradient ASCENT (more entropy: the atoms
move to where the targets put their mass; the origin notes' "SGD at LR=1e-3"):

    s ← s + lr · ∂J/∂s

Gradient: ANALYTIC, not the origin's central finite differences (2(Z-1) = 100 extra projections of
the whole batch); checked against central differences of the float64 reference in
tests/rl/test_adaptive_atoms.py. Derivation: Σ_i m̄_i = 1 for every z, so ∂J/∂m̄_i = -log m̄_i - 1
contributes only -log m̄_i = -g_i. A target atom x = clip(r + γ z_j, z_0, z_{Z-1}) in [z_l, z_u)
adds p_j (w_l e_l + w_u e_u)/R with w_u = (x - z_l)/D = 1 - w_l, D = z_u - z_l, so with
κ = p_j (g_u - g_l) / (R · D):

    ∂J/∂x   += -κ          (× γ into ∂J/∂z_j when r + γ z_j lies strictly inside (z_0, z_{Z-1}))
    ∂J/∂z_l += κ · w_l
    ∂J/∂z_u += κ · w_u

and the chain rule through the support (S_j = Σ_{q>j} ∂J/∂z_q, A = Σ_q c_q ∂J/∂z_q, σ = sigmoid):

    ∂J/∂s_j = W · σ(s_j) / C · (S_j - A / C)

The projection is piecewise linear in z: where a target atom sits exactly on a support atom (e.g.
r = 0 projected onto z = 0) J has a kink and this is its one-sided derivative for x in [z_l, z_u)
(central differences give the mean of both sides there). log m̄_i is taken of max(m̄_i, M_FLOOR):
an empty atom's entropy derivative is unbounded.

Launches per aux step (`AdaptiveAtoms.step`, all device-side, capturable):
  1. m̄·R = column sum of the loss's target_dist [R, Z]     (numbarl.cuda.reduce.col_sum, fixed order)
  2. `support_grad_rows_kernel`, one thread per (b, k): its row of ∂J/∂z contributions [R, Z]
     (the row is the thread's own: no atomics)
  3. ∂J/∂z = column sum of those rows                       (col_sum, fixed order)
  4. `spacing_update_kernel`, one thread: J, ∂J/∂s, the step, the new support z into the live
     device support (the head's `support`, which every pass and every bound C51Loss read), the flag
     `support_mode` = 1 (the losses switch to the non-uniform projection), and the stats
     support_entropy_J and atom_spacing_ratio = max_j softplus(s_j) / min_j softplus(s_j) (exactly 1
     until the first step).
Same inputs, same bits: no atomics, every sum in a fixed order.
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda import launch, reduce
from numbarl.cuda.runtime import Arena, cuda
from numbarl.rl.losses.c51 import (
    bootstrap_gamma_dev,
    project_distribution_nonuniform_ref,
    target_atom,
)

_cuda = cuda()

BLOCK = launch.shape(gpu=128, sim=8)  # threads per block of the per-(sample, branch) kernel
SPACING_INIT = math.log(math.e - 1.0)  # softplus⁻¹(1): every spacing 1, the uniform support
M_FLOOR = 1e-12  # log m̄_i of an empty atom is taken at this mass (module docstring)
_ZERO = np.float32(0.0)
_M_FLOOR32 = np.float32(M_FLOOR)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def softplus_ref(x):
    return np.logaddexp(0.0, np.asarray(x, np.float64))


def support_from_spacing_ref(spacing_raw, v_min: float, v_max: float) -> np.ndarray:
    """z_i = v_min + (v_max - v_min) · c_i / c_{Z-1}, c_i = Σ_{j<i} softplus(s_j), float64 [Z]."""
    c = np.concatenate([[0.0], np.cumsum(softplus_ref(spacing_raw))])
    return float(v_min) + (float(v_max) - float(v_min)) * c / c[-1]


def _rows(rewards, dones, discounts, probs):
    """(r [R], γ [R], p [R, Z]) of the rows (b, k) of probs [B, n_branches, Z] (b-major)."""
    probs = np.asarray(probs, np.float64)
    batch, n_branches, n_atoms = probs.shape
    gamma = np.asarray(discounts, np.float64) * (1.0 - np.asarray(dones, np.float64))
    return (np.repeat(np.asarray(rewards, np.float64), n_branches), np.repeat(gamma, n_branches),
            probs.reshape(batch * n_branches, n_atoms))


def support_entropy_ref(spacing_raw, v_min, v_max, rewards, dones, discounts, probs) -> float:
    """J(s) = H(mean over rows of Algorithm 1 on z(s)); probs [B, n_branches, Z] at a* (module docstring)."""
    z = support_from_spacing_ref(spacing_raw, v_min, v_max)
    r, gamma, p = _rows(rewards, dones, discounts, probs)
    m = project_distribution_nonuniform_ref(r, np.zeros_like(r), gamma, p, z).mean(axis=0)
    m = m[m > 0]
    return float(-np.sum(m * np.log(m)))


def support_entropy_grad_ref(spacing_raw, v_min, v_max, rewards, dones, discounts, probs):
    """The analytic gradient of the module docstring, float64: (J, ∂J/∂z [Z], ∂J/∂s [Z-1])."""
    s = np.asarray(spacing_raw, np.float64)
    z = support_from_spacing_ref(s, v_min, v_max)
    r, gamma, p = _rows(rewards, dones, discounts, probs)
    n_rows, n_atoms = p.shape
    m = project_distribution_nonuniform_ref(r, np.zeros_like(r), gamma, p, z).mean(axis=0)
    g = np.log(np.maximum(m, M_FLOOR))
    t = r[:, None] + gamma[:, None] * z[None, :]  # [R, Z_j]  r + γ z_j
    x = np.clip(t, z[0], z[-1])
    lower = np.searchsorted(z, x, side="right") - 1  # z_l <= x < z_u
    l = np.minimum(lower, n_atoms - 2)
    d = z[l + 1] - z[l]
    kappa = np.where(lower < n_atoms - 1, p * (g[l + 1] - g[l]) / (n_rows * d), 0.0)  # x = z_{Z-1}: no term
    dz = np.zeros(n_atoms)
    np.add.at(dz, l, kappa * (z[l + 1] - x) / d)  # ∂J/∂z_l
    np.add.at(dz, l + 1, kappa * (x - z[l]) / d)  # ∂J/∂z_u
    inside = (t > z[0]) & (t < z[-1])  # x = r + γ z_j moves with z_j
    np.add.at(dz, np.broadcast_to(np.arange(n_atoms), x.shape), np.where(inside, -gamma[:, None] * kappa, 0.0))
    sp = softplus_ref(s)
    c = np.concatenate([[0.0], np.cumsum(sp)])
    big_c, width = c[-1], float(v_max) - float(v_min)
    a = float(np.sum(c * dz))
    suffix = np.cumsum(dz[::-1])[::-1]  # suffix[q] = Σ_{q' >= q} dz
    sigmoid = 1.0 / (1.0 + np.exp(-s))
    ds = width * sigmoid / big_c * (suffix[1:] - a / big_c)
    m = m[m > 0]
    return float(-np.sum(m * np.log(m))), dz, ds


def spacing_step_ref(spacing_raw, grad, lr: float):
    """One ascent step s + lr · ∂J/∂s (float64)."""
    return np.asarray(spacing_raw, np.float64) + float(lr) * np.asarray(grad, np.float64)


# ---------------------------------------------------------------------------------------------
# device functions
# ---------------------------------------------------------------------------------------------
@_cuda.jit(device=True)
def softplus_dev(x):
    """log(1 + e^x) without overflow (float64)."""
    if x > 0.0:
        return x + math.log1p(math.exp(-x))
    return math.log1p(math.exp(x))


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def support_grad_rows_kernel(target_probs, best_action, actions, branch_sizes, rewards, dones, discounts, support,
                             atom_sums, inv_rows, grad_rows):
    """One thread per (sample b, branch k), grid (ceil(B / BLOCK), n_branches): grad_rows[b, k, :] =
    this row's terms of ∂J/∂z (module docstring) at the support the loss just projected on, with
    m̄ = atom_sums · inv_rows and p = target_probs[b, k, a*] (a* = best_action, the loss's). A row
    whose taken action is outside its branch (the loss's loud NaN) contributes zeros."""
    b = _cuda.blockIdx.x * BLOCK + _cuda.threadIdx.x
    k = _cuda.blockIdx.y
    if b >= grad_rows.shape[0]:
        return
    n_atoms = support.shape[0]
    out = grad_rows[b, k]
    for i in range(n_atoms):
        out[i] = _ZERO
    if actions[b, k] < 0 or actions[b, k] >= branch_sizes[k]:
        return
    probs = target_probs[b, k, best_action[b, k]]
    gamma = bootstrap_gamma_dev(discounts, dones, b)
    reward = rewards[b]
    last = n_atoms - 1
    v_min = support[0]
    v_max = support[last]
    lo = 0
    for j in range(n_atoms):
        t = reward + gamma * support[j]
        x = target_atom(reward, gamma, support[j], v_min, v_max)
        while lo < last and support[lo + 1] <= x:
            lo += 1  # searchsorted(z, x, "right") - 1
        p = probs[j]
        if lo == last or p == _ZERO:
            continue
        z_l = support[lo]
        z_u = support[lo + 1]
        d = z_u - z_l
        g_l = math.log(max(atom_sums[lo] * inv_rows, _M_FLOOR32))
        g_u = math.log(max(atom_sums[lo + 1] * inv_rows, _M_FLOOR32))
        kappa = p * (g_u - g_l) * inv_rows / d
        out[lo] += kappa * ((z_u - x) / d)
        out[lo + 1] += kappa * ((x - z_l) / d)
        if t > v_min and t < v_max:
            out[j] -= gamma * kappa


@_cuda.jit(cache=True)
def spacing_update_kernel(atom_sums, dj_dz, inv_rows, spacing_raw, support_range, train_step, warmup, lr, support,
                          support_mode, stats, slot_entropy, slot_ratio):
    """ONE thread: J of the current support into stats[slot_entropy]; once train_step[0] > warmup the
    ascent step on spacing_raw, the new support (float64 math, stored float32, both ends exact) and
    support_mode[0] = 1; then the spacings' max/min ratio into stats[slot_ratio]."""
    if _cuda.grid(1) != 0:
        return
    n_atoms = support.shape[0]
    n_gaps = n_atoms - 1
    entropy = 0.0
    for i in range(n_atoms):
        m = np.float64(atom_sums[i]) * np.float64(inv_rows)
        if m > 0.0:
            entropy -= m * math.log(m)
    stats[slot_entropy] = np.float32(entropy)
    if train_step[0] > warmup:
        v_min = support_range[0]
        width = support_range[1] - support_range[0]
        big_c = 0.0
        a = 0.0
        for q in range(n_atoms):  # A = Σ_q c_q ∂J/∂z_q, C = c_{Z-1}
            a += big_c * np.float64(dj_dz[q])
            if q < n_gaps:
                big_c += softplus_dev(spacing_raw[q])
        suffix = 0.0
        for jj in range(n_gaps):  # j = Z-2 .. 0: S_j = Σ_{q>j} ∂J/∂z_q; each s_j's step uses its old value
            j = n_gaps - 1 - jj
            suffix += np.float64(dj_dz[j + 1])
            s = spacing_raw[j]
            sigmoid = 1.0 / (1.0 + math.exp(-s))
            spacing_raw[j] = s + lr * (width * sigmoid / big_c * (suffix - a / big_c))
        big_c = 0.0
        for q in range(n_gaps):
            big_c += softplus_dev(spacing_raw[q])
        c = 0.0
        for i in range(n_gaps):
            support[i] = np.float32(v_min + width * (c / big_c))
            c += softplus_dev(spacing_raw[i])
        support[n_gaps] = np.float32(support_range[1])
        support_mode[0] = 1
    lo = math.inf  # the learned spacings' ratio (float64: exactly 1 before the first step; the float32
    hi = 0.0       # support's own gaps differ by rounding even when uniform)
    for i in range(n_gaps):
        gap = softplus_dev(spacing_raw[i])
        lo = min(lo, gap)
        hi = max(hi, gap)
    stats[slot_ratio] = np.float32(hi / lo)


# ---------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------
class AdaptiveAtoms:
    """Device state and launches of the adaptive support: owns `spacing_raw` and `support_mode`.

        atoms = AdaptiveAtoms(batch=16384, n_branches=4, n_atoms=51, lr=1e-3, warmup=500)
        loss.bind_support(head.support, atoms.support_mode)    # before capture
        ... loss(...)                                          # projects on head.support
        atoms.step(loss, rewards, dones, discounts, actions, target_probs, head.support,
                   support_range, train_step, stats, slot_entropy, slot_ratio, stream)
    """

    def __init__(self, batch: int, n_branches: int, n_atoms: int, lr: float, warmup: int):
        self.batch, self.n_branches, self.n_atoms = int(batch), int(n_branches), int(n_atoms)
        if self.n_atoms < 3:
            raise ValueError(f"adaptive atoms need n_atoms >= 3 (got {n_atoms}): with two atoms nothing can move")
        self.lr, self.warmup = float(lr), int(warmup)
        rows = self.batch * self.n_branches
        self.inv_rows = np.float32(1.0 / rows)
        arena = Arena("agent.adaptive_atoms")
        arena.add("spacing_raw", (self.n_atoms - 1,), np.float64)  # s: checkpointed
        arena.add("support_mode", (1,), np.int32)  # 0 = the support is the linspace, 1 = moved: checkpointed
        arena.add("atom_sums", (self.n_atoms,), np.float32)  # R · m̄
        arena.add("dj_dz", (self.n_atoms,), np.float32)
        arena.add("grad_rows", (self.batch, self.n_branches, self.n_atoms), np.float32)
        arena.add("partials", reduce.col_partials_shape(rows, self.n_atoms), np.float32)
        arena.allocate()
        arena.load({"spacing_raw": np.full(self.n_atoms - 1, SPACING_INIT), "support_mode": np.zeros(1, np.int32)})
        self.arena = arena

    @property
    def spacing_raw(self):
        return self.arena["spacing_raw"]

    @property
    def support_mode(self):
        return self.arena["support_mode"]

    def step(self, loss, rewards, dones, discounts, actions, target_probs, support, support_range, train_step,
             stats, slot_entropy: int, slot_ratio: int, stream) -> None:
        """Enqueue J, ∂J/∂s, the step and the new support (four to six launches; capturable). `loss`:
        the C51Loss (adaptive_support) that just ran on this batch: its target_dist and best_action."""
        rows, z = self.batch * self.n_branches, self.n_atoms
        a = self.arena
        reduce.col_sum(loss.target_dist.reshape(rows, z), a["atom_sums"], a["partials"], stream)
        support_grad_rows_kernel[(launch.blocks(self.batch, BLOCK), self.n_branches), BLOCK, stream](
            target_probs, loss.best_action, actions, loss.arena["branch_sizes"], rewards, dones, discounts, support,
            a["atom_sums"], self.inv_rows, a["grad_rows"])
        reduce.col_sum(a["grad_rows"].reshape(rows, z), a["dj_dz"], a["partials"], stream)
        spacing_update_kernel[1, 1, stream](a["atom_sums"], a["dj_dz"], self.inv_rows, a["spacing_raw"], support_range,
                                            train_step, np.int64(self.warmup), np.float64(self.lr), support,
                                            a["support_mode"], stats, np.int64(slot_entropy), np.int64(slot_ratio))

    def host_support(self, v_min: float, v_max: float) -> np.ndarray:
        """The support of the current spacing_raw on (v_min, v_max), float32 [Z] (host; a range set
        after the atoms moved, e.g. a fit on a resumed run)."""
        s = self.arena["spacing_raw"].copy_to_host()
        return support_from_spacing_ref(s, v_min, v_max).astype(np.float32)

    def state_arrays(self) -> dict:
        return {"atoms/spacing_raw": self.arena["spacing_raw"].copy_to_host(),
                "atoms/support_mode": self.arena["support_mode"].copy_to_host()}

    def load_arrays(self, arrays: dict) -> None:
        if "atoms/spacing_raw" in arrays:
            self.arena.load({"spacing_raw": np.asarray(arrays["atoms/spacing_raw"], np.float64),
                             "support_mode": np.asarray(arrays["atoms/support_mode"], np.int32)})
