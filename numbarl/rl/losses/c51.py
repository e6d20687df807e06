"""Distributional double-DQN loss for branched C51 heads: projection, target, cross-entropy.

Math (Bellemare, Dabney & Munos 2017, "A Distributional Perspective on Reinforcement Learning",
Algorithm 1 and Eq. 7; double DQN: van Hasselt, Guez & Silver 2016; action branching: Tavakoli,
Pardo & Kormushev 2018). For one sample b and one action branch k:

    support        z_i = v_min + i·Δz,  i = 0..Z-1,  Δz = (v_max - v_min) / (Z - 1)
    discount       γ_b = discounts[b] · (1 - dones[b])      (discounts = γ^m of the n-step return)
    double DQN     a*  = argmax_a E[Z(next_obs, a)] under the ONLINE net (first max on ties)
                   p_j = target-net probability of atom j at (next_obs, a*)
    Eq. 7 (dense)  m_i = Σ_j clip(1 - |clip(r_b + γ_b z_j, v_min, v_max) - z_i| / Δz, 0, 1) · p_j
    cross-entropy  CE[b, k] = -Σ_i m_i · log softmax(online_logits[b, k, a_taken])_i
    loss           L = (1/B) Σ_b w_b · (1/n_branches) Σ_k CE[b, k]      (w_b = 1 without weights)

The loss is the batch mean of the per-sample MEAN over branches (Tavakoli et al. 2018 average the
branch losses): its scale does not change when a branch is added. The PyTorch peer
(`numbarl.rl.torch_peer`) uses exactly this convention.

Its gradient with respect to the online logits is, because Σ_i m_i = 1 (every clipped target
atom splits its mass between the two neighbouring support points),

    ∂L/∂logits[b, k, a_taken, i] = w_b / (B · n_branches) · (softmax_i - m_i)

and zero for every other action and for the padding entries of shorter branches.

Adaptive atom-entropy regularisation (optional, `entropy_reg=True`; docs: the agent's
`agent.atom_entropy_max`): the objective gains −β · (1/(B·n_branches)) Σ_{b,k} H(p_bk), with
p_bk = softmax(online_logits[b, k, a_taken]) and H(p) = −Σ_i p_i log p_i. Since
∂H/∂l_i = −p_i (log p_i + H), its gradient adds

    β / (B · n_branches) · p_i · (log p_i + H)

at the taken action (unweighted by w_b). β is read from device memory (`entropy_beta` [1], written
by the agent's utilisation controller between or inside steps), so a captured graph follows it.
The target kernel then also writes H[b, k] (`entropy`) and the grad kernel the taken action's
probabilities (`taken_probs` [B, n_branches, Z], the utilisation's input). The logged `loss`
stays the cross-entropy alone. With entropy_reg=False none of this runs: same launches, same bits.

The support (z, and the projection's v_min, v_max, 1/Δz) is read from device memory
(`support` [Z] and `support_scalars` [3]): `set_support` rewrites both from the host between
graph replays (e.g. a support fitted to the replay's returns) and the captured graph follows.

Non-uniform support (adaptive atom positions, agent.adaptive_atoms; numbarl/rl/losses/atoms.py):
the support z_0 < z_1 < ... < z_{Z-1} is then any ascending array, and the hat of atom i has its
own left and right spacings (Bellemare et al. 2017, Algorithm 1, whose floor/ceil become a search):

    x_j = clip(r_b + γ_b z_j, z_0, z_{Z-1}),   l = searchsorted(z, x_j, side="right") - 1,  u = l + 1
    m_l += p_j (z_u - x_j) / (z_u - z_l),      m_u += p_j (x_j - z_l) / (z_u - z_l)   (l = Z-1: m_l += p_j)

`project_row_nonuniform_dev` evaluates it. A loss built with adaptive_support=True reads a device
flag `support_mode` [1] (owned by numbarl.rl.losses.atoms.AdaptiveAtoms): 0 = the uniform Eq. 7
below, bit for bit (the support is still the configured linspace: warm-up, or never moved), 1 =
the non-uniform form. A loss built without it never reads the flag: the default launches and bits
are unchanged.

The dense form replaces the scatter of Algorithm 1 (floor/ceil + index_add) by a Z×Z hat-function
product: no atomics, no `l == u` special case (an atom landing exactly on z_i gets weight 1 there
and 0 on both neighbours), and a thread owns every value it writes.

Layouts (B = batch, n_branches, max_actions = max branch size, Z = n_atoms; padding entries of
branches shorter than max_actions are never read as actions):

    online_logits  float32 [B, n_branches, max_actions, Z]   head output on obs (tag "online")
    next_q         float32 [B, n_branches, max_actions]      online Q on next_obs (tag "next")
    target_probs   float32 [B, n_branches, max_actions, Z]   target-net probs on next_obs
                   or float32 [B, n_branches, Z]             the same at a* alone (double_dqn_actions' a*)
    actions        int32/int64 [B, n_branches]               taken action per branch
    rewards        float32 [B]                               n-step return Σ γ^k r_{t+k}
    dones          float32/uint8/int32 [B]                   1 when the n-step window ended an episode
    discounts      float32 [B]                               γ^m >= 0, m = actual steps in the window
    weights        float32 [B] or None                       importance weights
    lse            float32 [B, n_branches, max_actions] or None   the online head's row log-sum-exp (read, not
                                                             computed again; the same bits)
    d_logits       float32 [B, n_branches, max_actions, Z]   gradient for the head's backward
    per_sample     float32 [B]                               (1/n_branches) Σ_k CE[b, k], unweighted
    loss           float32 [1]                               L above

Thread mapping (three launches; grids are (sample chunk, branch[, action]) so that no thread
divides an index, 64-bit integer division being slow on the GPU):
  * `c51_target_kernel`, TARGET_PARTS consecutive threads per (b, k): each the argmax over next_q and Eq. 7 for
    its share of the atoms into target_dist[b, k, :] by `project_atoms_dev` (the dense sum evaluated as a
    two-pointer sweep over its non-zero terms: O(Z) instead of Z², same sums; a share after the first starts its
    pointer where the whole-row sweep has it, found by bisection), then after a barrier the row's first thread the
    log-sum-exp of the taken action's logits (or the head's, given as "lse") and CE[b, k];
  * `c51_grad_kernel`, elementwise over d_logits: coalesced stores of the gradient row and of the
    zeros (other actions, padding); or `c51_taken_grad_kernel`, the taken rows alone (d_taken, for a
    caller whose only logits loss is this one: the head's TakenGrad backward gives the same bits);
  * `c51_loss_reduce_kernel`, ONE block: per-sample means over branches and the scalar loss, by a
    fixed strided order then a fixed shared-memory tree: the same inputs give the same bits on
    every run (no atomics).
Every index in the kernels is uint64 (a signed index costs Python's negative-index wraparound code
at each array access; issue 17, PTX for sm_90 before -> after: target 1,237 -> 908 instructions,
grad 1,013 -> 257 and 122 -> 46 registers, reduce 498 -> 265), with the atom loops unrolled by
four, loads first, every sum in its original order: the same bits.
Measured on the H200 (B = 16,384, 4 branches, 51 atoms): a first version with one thread per
(b, k) doing the Z² hat evaluations and row-strided d_logits stores took 0.62 ms; one 32-lane
group per (b, k) with the dense sum spread over lanes was slower than this split. One thread per (b, k) with the
sweep took 105 us (latency-bound: 0.39 waves of 128-thread blocks, 15 of 32 threads active); four threads per row in
the same launch shorten each thread's sweep (train step 2.806 -> 2.764 ms; docs/BENCHMARKS.md, twenty-eighth
session, with the designs that did not pay).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from numbarl.cuda import graph, launch
from numbarl.cuda.runtime import Arena, cuda
from numbarl.rl.losses.base import Loss
from numbarl.rl.nets.c51_head import EW_ATOMS, EW_ROWS, make_support

_cuda = cuda()  # the backend (GPU or simulator), selected once

# Launch shapes (numbarl.cuda.launch: small blocks under the simulator, where one thread walks a
# whole atom row; the results are the same sums in the same order). The elementwise kernels share
# the head's shape (EW_ATOMS x EW_ROWS, defined with the head whose outputs they read).
BLOCK = launch.shape(gpu=128, sim=16)  # threads per block of the per-(sample, branch) kernels
REDUCE_BLOCK = launch.shape(gpu=256, sim=16)  # threads of the single-block loss reduction (power of two)
# threads sharing one (sample, branch) row's projection in `c51_target_kernel` (a power of two dividing BLOCK, so a
# row's threads share a block and its barrier): the kernel is latency-bound on each row's sweep, so splitting the
# atoms shortens it and fills more warps
TARGET_PARTS = launch.shape(gpu=4, sim=2)
if TARGET_PARTS & (TARGET_PARTS - 1) or BLOCK % TARGET_PARTS:
    raise ValueError(f"c51: TARGET_PARTS = {TARGET_PARTS} must be a power of two dividing BLOCK = {BLOCK}")

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_NEG_INF = np.float32(-np.inf)
_NAN = np.float32(np.nan)
# uint64 index constants: every index in these kernels is uint64 (a signed index costs Python's
# negative-index wraparound code at every array access; an int literal mixed with a uint64 would
# make numba compute in float64, hence constants)
_U0, _U1, _U2, _U3, _U4 = (np.uint64(n) for n in range(5))
_BLOCK, _EW_ATOMS, _EW_ROWS = np.uint64(BLOCK), np.uint64(EW_ATOMS), np.uint64(EW_ROWS)
_REDUCE_BLOCK, _REDUCE_HALF = np.uint64(REDUCE_BLOCK), np.uint64(REDUCE_BLOCK // 2)

__all__ = ["C51Loss", "make_support"]  # make_support lives with the head; re-exported for callers


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def project_distribution_ref(rewards, dones, discounts, next_probs, support):
    """Projects the distribution r + γZ onto the fixed support (Bellemare et al. 2017, Eq. 7).

    Dense form: m_i = Σ_j clip(1 - |clip(r + γ z_j, v_min, v_max) - z_i| / Δz, 0, 1) · p_j with
    γ = discount · (1 - done). The support must be evenly spaced (Δz = z_1 - z_0).

    Hand-computed example (also `test_project_hand_computed`): support z = [-1, 0, 1] (Δz = 1),
    p = [0.2, 0.5, 0.3], r = 0.5, γ = 0.5, not done. Target atoms T z = 0.5 + 0.5·z = [0, 0.5, 1]:
    atom 0 lands exactly on z_1 (0.2 → m_1), atom 1 splits half/half between z_1 and z_2
    (0.25 each), atom 2 lands on z_2 (0.3 → m_2), so m = [0, 0.45, 0.55].
    Done with r = 2.5: every atom goes to clip(2.5) = 1, m = [0, 0, 1].
    Done with r = -0.25: m = [0.25, 0.75, 0].

    Args:
      rewards: [B] n-step returns r.
      dones: [B] 1 where the episode ended inside the window (bootstrap switched off).
      discounts: [B] γ^m, the discount of the bootstrap term.
      next_probs: [B, Z] probabilities p_j of the bootstrap distribution.
      support: [Z] evenly spaced atoms z.

    Returns:
      [B, Z] projected probabilities m (float64); each row sums to Σ_j p_j.
    """
    r = np.asarray(rewards, np.float64)[:, None]  # [B, 1]
    gamma = (np.asarray(discounts, np.float64) * (1.0 - np.asarray(dones, np.float64)))[:, None]  # [B, 1]
    z = np.asarray(support, np.float64)  # [Z]
    p = np.asarray(next_probs, np.float64)  # [B, Z]
    v_min, v_max = z[0], z[-1]
    delta_z = z[1] - z[0]
    target_z = np.clip(r + gamma * z[None, :], v_min, v_max)  # [B, Z_j]  T z_j
    hat = np.clip(1.0 - np.abs(target_z[:, None, :] - z[None, :, None]) / delta_z, 0.0, 1.0)  # [B, Z_i, Z_j]
    return np.einsum("bij,bj->bi", hat, p)


def project_distribution_nonuniform_ref(rewards, dones, discounts, next_probs, support):
    """Bellemare et al. 2017, Algorithm 1 on an ascending support with any spacings (float64).

    x_j = clip(r + γ z_j, z_0, z_{Z-1}); l = searchsorted(z, x_j, "right") - 1, u = l + 1; p_j goes
    to z_l and z_u in the ratio (z_u - x_j) : (x_j - z_l) (all of it to z_l when x_j = z_{Z-1} or
    x_j lands exactly on z_l). On an evenly spaced support this is Eq. 7 up to rounding.

    Hand-computed example (also `tests/rl/test_adaptive_atoms.py`): z = [-1, 0, 2], p = [0.2, 0.5,
    0.3], r = 0.5, γ = 0.5: T z = [0, 0.5, 1.5]; atom 0 lands on z_1 (0.2 → m_1), atom 1 is a
    quarter of the way from 0 to 2 (0.375 → m_1, 0.125 → m_2), atom 2 three quarters
    (0.075 → m_1, 0.225 → m_2): m = [0, 0.65, 0.35].

    Args: as `project_distribution_ref`, with support [Z] strictly ascending.
    Returns: [B, Z] float64, each row summing to Σ_j p_j.
    """
    r = np.asarray(rewards, np.float64)[:, None]  # [B, 1]
    gamma = (np.asarray(discounts, np.float64) * (1.0 - np.asarray(dones, np.float64)))[:, None]  # [B, 1]
    z = np.asarray(support, np.float64)  # [Z]
    p = np.asarray(next_probs, np.float64)  # [B, Z]
    n_atoms = z.size
    x = np.clip(r + gamma * z[None, :], z[0], z[-1])  # [B, Z_j]  T z_j
    lower = np.searchsorted(z, x, side="right") - 1  # z_l <= x < z_u; Z-1 when x = z_{Z-1}
    top = lower >= n_atoms - 1
    l = np.minimum(lower, n_atoms - 2)
    dz = z[l + 1] - z[l]
    w_l = np.where(top, 0.0, (z[l + 1] - x) / dz)
    w_u = np.where(top, 1.0, (x - z[l]) / dz)  # at the top: all of p_j to z_{Z-1} (= z_u of the last interval)
    rows = np.broadcast_to(np.arange(p.shape[0])[:, None], x.shape)
    out = np.zeros(p.shape)
    np.add.at(out, (rows, l), p * w_l)
    np.add.at(out, (rows, l + 1), p * w_u)
    return out


def double_dqn_actions_ref(next_q, branch_sizes, next_mask=None):
    """Online-net argmax per branch over the valid actions (first maximum on ties).

    Args:
      next_q: [B, n_branches, max_actions] E[Z] of the online net on next_obs.
      branch_sizes: [n_branches] number of valid actions of each branch.
      next_mask: None, or [B, n_branches, max_actions] the env's action mask of next_obs (0 = not
        available there, e.g. the direction a lock forbids): the max is then over A(next_obs), as
        the behaviour policy's (none available: action 0).

    Returns:
      [B, n_branches] int64 greedy actions a*.
    """
    next_q = np.asarray(next_q, np.float64)
    out = np.zeros(next_q.shape[:2], np.int64)
    for k, n in enumerate(branch_sizes):
        q = next_q[:, k, :n].copy()
        if next_mask is not None:
            q[np.asarray(next_mask)[:, k, :n] == 0] = -np.inf
        out[:, k] = np.argmax(q, axis=1)
    return out


def target_distribution_ref(next_q, target_probs, rewards, dones, discounts, support, branch_sizes, next_mask=None):
    """Double-DQN C51 target per branch: project the target net's distribution at a*.

    Args:
      next_q: [B, n_branches, max_actions] online E[Z] on next_obs (selects a*).
      target_probs: [B, n_branches, max_actions, Z] target-net probabilities on next_obs.
      rewards, dones, discounts: [B] n-step return, done flag, γ^m.
      support: [Z].
      branch_sizes: [n_branches].
      next_mask: see `double_dqn_actions_ref`.

    Returns:
      [B, n_branches, Z] projected target distributions m (float64).
    """
    a_star = double_dqn_actions_ref(next_q, branch_sizes, next_mask)  # [B, n_branches]
    target_probs = np.asarray(target_probs, np.float64)
    batch, n_branches = a_star.shape
    out = np.empty((batch, n_branches, target_probs.shape[-1]))
    for k in range(n_branches):
        p = target_probs[np.arange(batch), k, a_star[:, k]]  # [B, Z]
        out[:, k] = project_distribution_ref(rewards, dones, discounts, p, support)
    return out


def log_softmax_ref(x, axis=-1):
    x = np.asarray(x, np.float64)
    shifted = x - np.max(x, axis=axis, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def cross_entropy_loss_ref(online_logits, actions, target_dist, weights=None, entropy_beta: float = 0.0):
    """Cross-entropy between the projected targets and the online distribution at the taken action.

    Args:
      online_logits: [B, n_branches, max_actions, Z] online head logits on obs.
      actions: [B, n_branches] taken actions.
      target_dist: [B, n_branches, Z] projected targets m (constants: no gradient flows into them).
      weights: [B] importance weights or None (all ones).
      entropy_beta: β of the atom-entropy term −β/(B·n_branches) Σ_{b,k} H(p_bk) (unweighted;
        module docstring); 0 = none.

    Returns:
      loss: float, (1/B) Σ_b w_b · per_sample[b] − β · mean_{b,k} H (the objective d_logits is the
        gradient of; the device's logged loss is the β = 0 part).
      per_sample: [B] (1/n_branches) Σ_k CE[b, k] (unweighted).
      d_logits: [B, n_branches, max_actions, Z] ∂loss/∂online_logits, zero off the taken actions.
    """
    online_logits = np.asarray(online_logits, np.float64)
    actions = np.asarray(actions)
    batch, n_branches, _, _ = online_logits.shape
    w = np.ones(batch) if weights is None else np.asarray(weights, np.float64)
    rows = np.arange(batch)
    d_logits = np.zeros(online_logits.shape)
    ce = np.empty((batch, n_branches))
    ent = np.zeros((batch, n_branches))
    for k in range(n_branches):
        logits = online_logits[rows, k, actions[:, k]]  # [B, Z]
        logp = log_softmax_ref(logits)
        m = np.asarray(target_dist[:, k], np.float64)
        ce[:, k] = -np.sum(m * logp, axis=1)
        # d CE / d logits = softmax · Σm - m  (Σm = 1 for a projected distribution)
        d = np.exp(logp) * np.sum(m, axis=1, keepdims=True) - m
        d_logits[rows, k, actions[:, k]] = (w / (batch * n_branches))[:, None] * d
        if entropy_beta != 0.0:  # −β H / (B n_br): ∂/∂l_i = β p_i (log p_i + H) / (B n_br)
            p = np.exp(logp)
            h = -np.sum(p * logp, axis=1)
            ent[:, k] = h
            d_logits[rows, k, actions[:, k]] += entropy_beta / (batch * n_branches) * p * (logp + h[:, None])
    per_sample = ce.mean(axis=1)
    loss = float(np.mean(w * per_sample)) - entropy_beta * float(np.mean(ent))
    return loss, per_sample, d_logits


def atom_entropy_ref(online_logits, actions):
    """H[b, k] = −Σ_i p_i log p_i of softmax(online_logits[b, k, actions[b, k]]), float64 [B, n_branches]."""
    online_logits = np.asarray(online_logits, np.float64)
    batch, n_branches = online_logits.shape[:2]
    rows = np.arange(batch)
    out = np.empty((batch, n_branches))
    for k in range(n_branches):
        logp = log_softmax_ref(online_logits[rows, k, np.asarray(actions)[:, k]])
        out[:, k] = -np.sum(np.exp(logp) * logp, axis=1)
    return out


def c51_loss_ref(online_logits, actions, next_q, target_probs, rewards, dones, discounts, support,
                 branch_sizes, weights=None, next_mask=None, entropy_beta: float = 0.0):
    """The whole distributional double-DQN loss: target (double DQN + Eq. 7) then cross-entropy.

    Returns (loss, per_sample [B], d_logits [B, n_branches, max_actions, Z], target_dist
    [B, n_branches, Z]); see `target_distribution_ref` and `cross_entropy_loss_ref` for shapes.
    """
    target_dist = target_distribution_ref(next_q, target_probs, rewards, dones, discounts, support, branch_sizes,
                                          next_mask)
    loss, per_sample, d_logits = cross_entropy_loss_ref(online_logits, actions, target_dist, weights, entropy_beta)
    return loss, per_sample, d_logits, target_dist


# ---------------------------------------------------------------------------------------------
# device functions (scalar math shared by host and device; row helpers on the device)
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def target_atom(reward, gamma, z_j, v_min, v_max):
    """T z_j = clip(r + γ z_j, v_min, v_max) (float32 in, float32 out)."""
    t = reward + gamma * z_j
    if t < v_min:
        t = v_min
    if t > v_max:
        t = v_max
    return t


@njit(cache=True)
def hat_weight(target_z, z_i, inv_delta_z):
    """Eq. 7's kernel clip(1 - |T z_j - z_i| / Δz, 0, 1) (the bracket is never above 1)."""
    w = _ONE - abs(target_z - z_i) * inv_delta_z
    if w < _ZERO:
        w = _ZERO
    return w


@_cuda.jit(device=True)
def project_row_dev(reward, gamma, probs_row, support, v_min, v_max, inv_delta_z, out_row):
    """out_row[i] = m_i of Eq. 7 for one sample, i = 0..Z-1: the dense sum over j in the order
    j = 0..Z-1 with its zero terms skipped.

    γ >= 0 makes T z_j non-decreasing in j, so the j with a non-zero hat for z_i form one
    contiguous run whose start only moves right as i grows: a two-pointer sweep visits O(Z) pairs
    instead of Z². The skipped terms are exactly 0 (hat = 0), so each sum equals the dense one.
    """
    project_atoms_dev(reward, gamma, probs_row, support, v_min, v_max, inv_delta_z, out_row, _U0,
                      np.uint64(support.shape[0]))


@_cuda.jit(device=True)
def first_run_dev(reward, gamma, support, v_min, v_max, inv_delta_z, i):
    """The two-pointer sweep's `lo` at atom i: the first j whose target is not below z_i's hat (T z_j < z_i with a
    zero hat holds for a prefix of j = 0..Z-1, γ >= 0 making T z_j non-decreasing), by binary search."""
    z_i = support[i]
    lo = _U0
    hi = np.uint64(support.shape[0])
    while lo < hi:
        mid = (lo + hi) >> _U1
        target_z = target_atom(reward, gamma, support[mid], v_min, v_max)
        if target_z < z_i and hat_weight(target_z, z_i, inv_delta_z) == _ZERO:
            lo = mid + _U1
        else:
            hi = mid
    return lo


@_cuda.jit(device=True)
def project_atoms_dev(reward, gamma, probs_row, support, v_min, v_max, inv_delta_z, out_row, i_begin, i_end):
    """`project_row_dev`'s sweep over the atoms i_begin <= i < i_end alone, its pointer started where the full
    sweep has it at i_begin (`first_run_dev`): the same sums, so threads splitting a row's atoms write its bits."""
    n_atoms = np.uint64(support.shape[0])
    lo = _U0  # first j whose target may still reach z_i's hat
    if i_begin > _U0 and i_begin < i_end:
        lo = first_run_dev(reward, gamma, support, v_min, v_max, inv_delta_z, i_begin)
    i = i_begin
    while i < i_end:
        z_i = support[i]
        while lo < n_atoms:
            target_z = target_atom(reward, gamma, support[lo], v_min, v_max)
            if target_z < z_i and hat_weight(target_z, z_i, inv_delta_z) == _ZERO:
                lo += _U1  # below z_i's hat, hence below every later atom's
            else:
                break
        m = _ZERO
        j = lo
        while j < n_atoms:
            target_z = target_atom(reward, gamma, support[j], v_min, v_max)
            w = hat_weight(target_z, z_i, inv_delta_z)
            if w == _ZERO and target_z > z_i:
                break  # above z_i's hat: so are all later j
            m += w * probs_row[j]
            j += _U1
        out_row[i] = m
        i += _U1


@_cuda.jit(device=True)
def project_row_nonuniform_dev(reward, gamma, probs_row, support, out_row):
    """out_row = Algorithm 1 on the ascending support (`project_distribution_nonuniform_ref`):
    each target atom x_j splits p_j between its two neighbours z_l <= x_j < z_u in proportion to
    its distance, with the spacing z_u - z_l of that interval. The clip bounds are the support's
    own ends. γ >= 0 makes x_j non-decreasing in j, so l only moves right (one pass, O(Z)); the
    row is owned by this thread, so the scatter needs no atomics. Sums in j order."""
    n_atoms = np.uint64(support.shape[0])
    last = n_atoms - _U1
    v_min = support[0]
    v_max = support[last]
    i = _U0
    while i < n_atoms:
        out_row[i] = _ZERO
        i += _U1
    lo = _U0
    j = _U0
    while j < n_atoms:
        x = target_atom(reward, gamma, support[j], v_min, v_max)
        while lo < last and support[lo + _U1] <= x:
            lo += _U1  # searchsorted(z, x, "right") - 1
        p = probs_row[j]
        if lo == last:
            out_row[last] += p
        else:
            z_l = support[lo]
            z_u = support[lo + _U1]
            dz = z_u - z_l
            out_row[lo] += p * ((z_u - x) / dz)
            out_row[lo + _U1] += p * ((x - z_l) / dz)
        j += _U1


@_cuda.jit(device=True)
def bootstrap_gamma_dev(discounts, dones, b):
    """γ_b = γ^m · (1 - done_b) as float32 for any numeric done dtype."""
    if dones[b] != 0:
        return _ZERO
    return discounts[b]


@_cuda.jit(device=True)
def _four_rows_dev(ce, b0, b1, b2, b3, batch, n_branches):
    """(Σ_k ce[b_j, k] for j = 0..3), each sum from 0 in branch order k = 0..n_branches-1; rows
    b_j >= batch give garbage (the caller drops them). Four branches per step, the sixteen loads
    (indices clamped into the array: no load faults, no branch) issued before the adds."""
    last_b = batch - _U1
    last_k = n_branches - _U1
    b1 = min(b1, last_b)
    b2 = min(b2, last_b)
    b3 = min(b3, last_b)
    s0, s1, s2, s3 = _ZERO, _ZERO, _ZERO, _ZERO
    k = _U0
    while k < n_branches:
        k1 = min(k + _U1, last_k)
        k2 = min(k + _U2, last_k)
        k3 = min(k + _U3, last_k)
        x00, x01, x02, x03 = ce[b0, k], ce[b0, k1], ce[b0, k2], ce[b0, k3]
        x10, x11, x12, x13 = ce[b1, k], ce[b1, k1], ce[b1, k2], ce[b1, k3]
        x20, x21, x22, x23 = ce[b2, k], ce[b2, k1], ce[b2, k2], ce[b2, k3]
        x30, x31, x32, x33 = ce[b3, k], ce[b3, k1], ce[b3, k2], ce[b3, k3]
        s0 = _add_four(s0, x00, x01, x02, x03, n_branches - k)
        s1 = _add_four(s1, x10, x11, x12, x13, n_branches - k)
        s2 = _add_four(s2, x20, x21, x22, x23, n_branches - k)
        s3 = _add_four(s3, x30, x31, x32, x33, n_branches - k)
        k += _U4
    return s0, s1, s2, s3


@_cuda.jit(device=True)
def _add_four(s, x0, x1, x2, x3, n_left):
    """s + x0 + x1 + x2 + x3 in that order over the first min(n_left, 4) terms (selects, no branch)."""
    s += x0
    s = s + x1 if n_left > _U1 else s
    s = s + x2 if n_left > _U2 else s
    s = s + x3 if n_left > _U3 else s
    return s


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def project_distribution_kernel(rewards, dones, discounts, next_probs, support, v_min, v_max, inv_delta_z, out):
    """out[b, :] = Eq. 7 projection of next_probs[b, :]; one thread per sample b."""
    b = _cuda.grid(1)
    if b >= out.shape[0]:
        return
    gamma = bootstrap_gamma_dev(discounts, dones, b)
    project_row_dev(rewards[b], gamma, next_probs[b], support, v_min, v_max, inv_delta_z, out[b])


@_cuda.jit(device=True)
def best_action_dev(next_q, next_mask, use_mask, b, k, n_actions):
    """Double DQN: a* = argmax of the online net's E[Z] on next_obs (first maximum wins) over the actions available
    there (none available: action 0), as uint64. One function for the loss's own argmax and
    `double_dqn_actions_kernel`'s, so both pick the same a*."""
    best = _U0
    found = False
    best_q = next_q[b, k, 0]
    a = _U0
    while a < np.uint64(n_actions):
        if use_mask == 0 or next_mask[b, k, a] != 0:
            q = next_q[b, k, a]
            if not found or q > best_q:
                best_q = q
                best = a
                found = True
        a += _U1
    return best


@_cuda.jit(device=True)
def _project_dev(reward, gamma, probs_row, support, support_scalars, adaptive, support_mode, m_row, i_begin, i_end):
    """Eq. 7 of probs_row into m_row[i_begin:i_end], or (for the part with i_begin = 0 alone) Algorithm 1 on a moved
    adaptive support, whose scatter writes the whole row."""
    if adaptive != 0 and support_mode[0] != 0:  # adaptive atoms, moved: Algorithm 1 on the live support
        if i_begin == _U0:
            project_row_nonuniform_dev(reward, gamma, probs_row, support, m_row)
    else:
        project_atoms_dev(reward, gamma, probs_row, support, support_scalars[0], support_scalars[1],
                          support_scalars[2], m_row, i_begin, i_end)


@_cuda.jit(cache=True)
def double_dqn_actions_kernel(next_q, branch_sizes, next_mask, use_mask, out):
    """out[b, k] = a* of (b, k) (`best_action_dev`, int32): one thread per (sample, branch), grid (ceil(B / BLOCK),
    n_branches)."""
    b = np.uint64(_cuda.blockIdx.x) * _BLOCK + np.uint64(_cuda.threadIdx.x)
    k = np.uint64(_cuda.blockIdx.y)
    if b >= np.uint64(out.shape[0]):
        return
    out[b, k] = np.int32(best_action_dev(next_q, next_mask, use_mask, b, k, branch_sizes[k]))


@_cuda.jit(cache=True)
def c51_target_kernel(online_logits, actions, next_q, target_probs, rewards, dones, discounts, support,
                      branch_sizes, next_mask, use_mask, support_scalars, target_dist, lse, ce, use_entropy,
                      entropy, adaptive, support_mode, best_action, head_lse, use_head_lse, target_rows, use_rows,
                      parts_log2):
    """2^parts_log2 threads per (sample b, branch k) (consecutive threads; grid (ceil(B · parts / BLOCK), n_branches)),
    each projecting its share of the atoms (`project_atoms_dev`: the full sweep's sums), then, after a barrier, the
    row's first part alone the rest: double-DQN a*,
    Eq. 7 into target_dist[b, k, :], the log-sum-exp of the online logits at the taken action
    into lse[b, k], and CE[b, k]. An action outside the branch gives CE = NaN (loud) instead of
    an out-of-bounds read. With use_mask, the argmax skips the actions next_mask[b, k, :] (the env's
    mask of next_obs) marks unavailable. support_scalars = (v_min, v_max, 1/Δz) float32 [3] in device
    memory (never kernel arguments: a captured graph reads the current support). With use_entropy,
    entropy[b, k] = H(softmax of the taken action's logits). With adaptive (a loss built with
    adaptive_support), best_action[b, k] = a* (the adaptive atoms' gradient reads it) and, once the
    device flag support_mode[0] is 1, the projection is the non-uniform one (module docstring);
    without it neither is read or written.
    uint64 indices; the atom loops unrolled by four with the loads first and every sum in atom
    order i = 0..Z-1 (the same float32 operations as one atom per step).
    With use_rows, the projection reads target_rows[b, k] (the target probabilities already at a*: the head's
    select_probs at `double_dqn_actions_kernel`'s a*, the same function of next_q) instead of target_probs[b, k, a*].
    With use_head_lse, the log-sum-exp is read from head_lse[b, k, taken] (the online head's own row log-sum-exp,
    `dueling_head_kernel`'s: the same float32 operations in the same order on the same logits, hence the same
    bits) instead of being computed again.
    """
    shift = np.uint64(parts_log2)
    t = np.uint64(_cuda.blockIdx.x) * np.uint64(_cuda.blockDim.x) + np.uint64(_cuda.threadIdx.x)
    b = t >> shift
    part = t - (b << shift)
    k = np.uint64(_cuda.blockIdx.y)
    n_atoms = np.uint64(support.shape[0])
    share = (n_atoms + (_U1 << shift) - _U1) >> shift  # atoms per part
    i_begin = min(part * share, n_atoms)
    i_end = min(i_begin + share, n_atoms)
    active = b < np.uint64(online_logits.shape[0])
    valid = False
    taken = _U0
    if active:
        taken_signed = actions[b, k]
        valid = taken_signed >= 0 and taken_signed < branch_sizes[k]
        if valid:
            taken = np.uint64(taken_signed)
        elif part == _U0:
            lse[b, k] = _NAN
            ce[b, k] = _NAN
    if valid:
        best = best_action_dev(next_q, next_mask, use_mask, b, k, branch_sizes[k])
        gamma = bootstrap_gamma_dev(discounts, dones, b)
        m_row = target_dist[b, k]
        if adaptive != 0 and part == _U0:
            best_action[b, k] = np.int32(best)
        if use_rows != 0:
            _project_dev(rewards[b], gamma, target_rows[b, k], support, support_scalars, adaptive, support_mode, m_row,
                         i_begin, i_end)
        else:
            _project_dev(rewards[b], gamma, target_probs[b, k, best], support, support_scalars, adaptive,
                         support_mode, m_row, i_begin, i_end)
    if shift > _U0:
        _cuda.syncthreads()  # the row's other parts wrote their m
    if not valid or part != _U0:
        return
    m_row = target_dist[b, k]

    # log-sum-exp of the online logits at the taken action, then CE = -Σ m_i log p_i
    logits_row = online_logits[b, k, taken]
    if use_head_lse != 0:
        log_norm = head_lse[b, k, taken]
    else:
        mx = _NEG_INF
        i = _U0
        while i + _U3 < n_atoms:
            x0 = logits_row[i]
            x1 = logits_row[i + _U1]
            x2 = logits_row[i + _U2]
            x3 = logits_row[i + _U3]
            mx = max(mx, x0)
            mx = max(mx, x1)
            mx = max(mx, x2)
            mx = max(mx, x3)
            i += _U4
        while i < n_atoms:
            mx = max(mx, logits_row[i])
            i += _U1
        total = _ZERO
        i = _U0
        while i + _U3 < n_atoms:
            e0 = math.exp(logits_row[i] - mx)
            e1 = math.exp(logits_row[i + _U1] - mx)
            e2 = math.exp(logits_row[i + _U2] - mx)
            e3 = math.exp(logits_row[i + _U3] - mx)
            total += e0
            total += e1
            total += e2
            total += e3
            i += _U4
        while i < n_atoms:
            total += math.exp(logits_row[i] - mx)
            i += _U1
        log_norm = mx + math.log(total)
    lse[b, k] = log_norm
    acc = _ZERO
    i = _U0
    while i + _U3 < n_atoms:
        m0, x0 = m_row[i], logits_row[i]
        m1, x1 = m_row[i + _U1], logits_row[i + _U1]
        m2, x2 = m_row[i + _U2], logits_row[i + _U2]
        m3, x3 = m_row[i + _U3], logits_row[i + _U3]
        acc -= m0 * (x0 - log_norm)
        acc -= m1 * (x1 - log_norm)
        acc -= m2 * (x2 - log_norm)
        acc -= m3 * (x3 - log_norm)
        i += _U4
    while i < n_atoms:
        acc -= m_row[i] * (logits_row[i] - log_norm)
        i += _U1
    ce[b, k] = acc
    h = _ZERO
    if use_entropy != 0:  # H = -Σ p_i log p_i of the taken action's distribution
        i = _U0
        while i < n_atoms:
            logp = logits_row[i] - log_norm
            h -= math.exp(logp) * logp
            i += _U1
        entropy[b, k] = h


@_cuda.jit(device=True)
def _grad_row_dev(online_logits, b, k, taken, log_norm, target_dist, scale, use_entropy, ent_scale, h, taken_probs,
                  out_row, lane):
    """The taken action's gradient row of (b, k), lanes along z from `lane`: out_row[z] = scale · (softmax_z - m_z)
    (+ the entropy term, taken_probs[b, k, z] = p_z with use_entropy)."""
    n_atoms = np.uint64(target_dist.shape[2])
    z = lane
    if use_entropy != 0:
        while z < n_atoms:
            logp = online_logits[b, k, taken, z] - log_norm
            p = math.exp(logp)
            taken_probs[b, k, z] = p
            out_row[z] = scale * (p - target_dist[b, k, z]) + ent_scale * p * (logp + h)
            z += _EW_ATOMS
    else:
        while z < n_atoms:
            out_row[z] = scale * (math.exp(online_logits[b, k, taken, z] - log_norm) - target_dist[b, k, z])
            z += _EW_ATOMS


@_cuda.jit(device=True)
def _grad_scales_dev(b, weights, use_weights, grad_scale, use_entropy, entropy_beta):
    """(grad_scale · w_b, grad_scale · β) of sample b (w_b = 1 without weights, β = 0 without the entropy term)."""
    scale = grad_scale
    if use_weights != 0:
        scale = grad_scale * weights[b]
    ent_scale = _ZERO
    if use_entropy != 0:
        ent_scale = grad_scale * entropy_beta[0]
    return scale, ent_scale


@_cuda.jit(cache=True)
def c51_grad_kernel(online_logits, actions, branch_sizes, target_dist, lse, weights, use_weights, grad_scale,
                    d_logits, use_entropy, entropy_beta, entropy, taken_probs):
    """Thread row ty of block (EW_ATOMS, EW_ROWS) owns sample b = blockIdx.x · EW_ROWS + ty and
    writes its whole d_logits block [n_branches, max_actions, Z], lanes along z: grad_scale · w_b ·
    (softmax_z - m_z) at the taken action, 0 for every other action, padding and invalid actions.
    A block's stores are one contiguous span (a grid over (action, branch) would write every
    row in 16 interleaved passes: partial-sector writes, measured 104 us vs this layout's ~25).
    With use_entropy, the taken action's row adds grad_scale · β · p_z (log p_z + H[b, k]) (β =
    entropy_beta[0], device memory) and taken_probs[b, k, :] = p (zeros for an invalid action).
    uint64 indices; an invalid action (outside 0..A_k-1) matches no row (taken = max_actions)."""
    b = np.uint64(_cuda.blockIdx.x) * _EW_ROWS + np.uint64(_cuda.threadIdx.y)
    if b >= np.uint64(d_logits.shape[0]):
        return
    n_branches = np.uint64(d_logits.shape[1])
    max_actions = np.uint64(d_logits.shape[2])
    n_atoms = np.uint64(d_logits.shape[3])
    lane = np.uint64(_cuda.threadIdx.x)
    scale, ent_scale = _grad_scales_dev(b, weights, use_weights, grad_scale, use_entropy, entropy_beta)
    k = _U0
    while k < n_branches:
        taken_signed = actions[b, k]
        valid = taken_signed >= 0 and taken_signed < branch_sizes[k]
        taken = np.uint64(taken_signed) if valid else max_actions
        h = _ZERO
        if use_entropy != 0:
            h = entropy[b, k]
            if not valid:
                _zero_row_dev(taken_probs[b, k], n_atoms, lane)
        a = _U0
        while a < max_actions:
            if a == taken:
                _grad_row_dev(online_logits, b, k, a, lse[b, k], target_dist, scale, use_entropy, ent_scale, h,
                              taken_probs, d_logits[b, k, a], lane)
            else:
                _zero_row_dev(d_logits[b, k, a], n_atoms, lane)
            a += _U1
        k += _U1


@_cuda.jit(device=True)
def _zero_row_dev(row, n_atoms, lane):
    """row[z] = 0 for z = lane, lane + EW_ATOMS, ... < n_atoms."""
    z = lane
    while z < n_atoms:
        row[z] = _ZERO
        z += _EW_ATOMS


@_cuda.jit(cache=True)
def c51_taken_grad_kernel(online_logits, actions, branch_sizes, target_dist, lse, weights, use_weights, grad_scale,
                          d_taken, use_entropy, entropy_beta, entropy, taken_probs):
    """`c51_grad_kernel`'s taken rows alone: d_taken[b, k, :] = its d_logits[b, k, actions[b, k], :] bit for bit
    (zeros for an invalid action), taken_probs likewise; the head's `TakenGrad` backward reads them instead of
    the dense d_logits, whose other rows are zeros. Same launch shape and lanes."""
    b = np.uint64(_cuda.blockIdx.x) * _EW_ROWS + np.uint64(_cuda.threadIdx.y)
    if b >= np.uint64(d_taken.shape[0]):
        return
    n_branches = np.uint64(d_taken.shape[1])
    n_atoms = np.uint64(d_taken.shape[2])
    lane = np.uint64(_cuda.threadIdx.x)
    scale, ent_scale = _grad_scales_dev(b, weights, use_weights, grad_scale, use_entropy, entropy_beta)
    k = _U0
    while k < n_branches:
        taken_signed = actions[b, k]
        if taken_signed >= 0 and taken_signed < branch_sizes[k]:
            h = entropy[b, k] if use_entropy != 0 else _ZERO
            _grad_row_dev(online_logits, b, k, np.uint64(taken_signed), lse[b, k], target_dist, scale, use_entropy,
                          ent_scale, h, taken_probs, d_taken[b, k], lane)
        else:
            _zero_row_dev(d_taken[b, k], n_atoms, lane)
            if use_entropy != 0:
                _zero_row_dev(taken_probs[b, k], n_atoms, lane)
        k += _U1


@_cuda.jit(cache=True)
def c51_loss_reduce_kernel(ce, weights, use_weights, inv_branches, inv_batch, per_sample, loss):
    """ONE block: per_sample[b] = mean_k CE[b, k]; loss[0] = (1/B) Σ_b w_b per_sample[b].

    Thread t sums samples t, t + REDUCE_BLOCK, ... in order, then a fixed shared-memory tree:
    bitwise reproducible, no atomics. uint64 indices. Four samples per step with all their loads
    issued first (`_four_rows_dev`): one thread walks B / REDUCE_BLOCK samples, so the kernel is
    bound by one load latency per step (64 steps at B = 16,384), not by arithmetic; each sample's
    sum stays in branch order and acc in sample order.
    """
    partial = _cuda.shared.array(REDUCE_BLOCK, np.float32)
    t = np.uint64(_cuda.threadIdx.x)
    batch = np.uint64(ce.shape[0])
    n_branches = np.uint64(ce.shape[1])
    acc = _ZERO
    b = t
    while b < batch:
        b1 = b + _REDUCE_BLOCK
        b2 = b1 + _REDUCE_BLOCK
        b3 = b2 + _REDUCE_BLOCK
        s0, s1, s2, s3 = _four_rows_dev(ce, b, b1, b2, b3, batch, n_branches)
        w0, w1, w2, w3 = _ONE, _ONE, _ONE, _ONE
        if use_weights != 0:
            last = batch - _U1  # clamped loads never fault; the results for b_j >= batch are dropped
            w0 = weights[b]
            w1 = weights[min(b1, last)]
            w2 = weights[min(b2, last)]
            w3 = weights[min(b3, last)]
        s0 = s0 * inv_branches
        per_sample[b] = s0
        if use_weights != 0:
            s0 = s0 * w0
        acc += s0
        if b1 < batch:
            s1 = s1 * inv_branches
            per_sample[b1] = s1
            if use_weights != 0:
                s1 = s1 * w1
            acc += s1
        if b2 < batch:
            s2 = s2 * inv_branches
            per_sample[b2] = s2
            if use_weights != 0:
                s2 = s2 * w2
            acc += s2
        if b3 < batch:
            s3 = s3 * inv_branches
            per_sample[b3] = s3
            if use_weights != 0:
                s3 = s3 * w3
            acc += s3
        b = b3 + _REDUCE_BLOCK
    partial[t] = acc
    _cuda.syncthreads()
    stride = _REDUCE_HALF
    while stride > _U0:
        if t < stride:
            partial[t] += partial[t + stride]
        _cuda.syncthreads()
        stride = stride // _U2
    if t == _U0:
        loss[0] = partial[0] * inv_batch


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------
def _grid(n: int) -> int:
    return max(1, (n + BLOCK - 1) // BLOCK)


def _check(name, arr, shape, dtypes):
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"c51 loss: {name} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
    if np.dtype(arr.dtype) not in dtypes:
        raise TypeError(f"c51 loss: {name} has dtype {arr.dtype}, expected one of {[str(d) for d in dtypes]}")


_F32 = (np.dtype(np.float32),)
_INT = (np.dtype(np.int32), np.dtype(np.int64))
_DONE = (np.dtype(np.float32), np.dtype(np.uint8), np.dtype(np.int32), np.dtype(np.bool_))


def project_distribution(rewards, dones, discounts, next_probs, support, v_min, v_max, out, stream):
    """Device Eq. 7 for a batch: out [B, Z] = projection of next_probs [B, Z] (see the reference).

    `support` is a float32 device array [Z] holding `make_support(Z, v_min, v_max)`; v_min and
    v_max are the same Python floats (constants of the support, frozen into a captured graph).
    """
    batch, n_atoms = out.shape
    _check("next_probs", next_probs, (batch, n_atoms), _F32)
    _check("rewards", rewards, (batch,), _F32)
    _check("discounts", discounts, (batch,), _F32)
    _check("dones", dones, (batch,), _DONE)
    _check("support", support, (n_atoms,), _F32)
    _check("out", out, (batch, n_atoms), _F32)
    v_min32, v_max32, inv_dz = support_scalars(n_atoms, v_min, v_max)
    project_distribution_kernel[_grid(batch), BLOCK, stream](  # one thread per sample
        rewards, dones, discounts, next_probs, support, v_min32, v_max32, inv_dz, out)


def support_scalars(n_atoms: int, v_min: float, v_max: float):
    """(v_min, v_max, 1/Δz) as the float32 kernel arguments matching `make_support`."""
    support = make_support(n_atoms, v_min, v_max)
    return support[0], support[-1], np.float32((int(n_atoms) - 1) / (float(v_max) - float(v_min)))


class C51Loss(Loss):
    """Plan for the fused distributional double-DQN loss: owns every buffer it writes.

    Loss contract (numbarl/rl/losses/base.py): ``apply({"logits", "actions", "next_q",
    "target_probs", "rewards", "dones", "discounts"[, "weights", "next_mask", "lse"]}, {"logits": buffer}, stream,
    weight)``; the positional ``__call__`` below is the launcher it runs.

    Built once before capture (allocates an Arena); `__call__` only launches three kernels:

        loss_fn = C51Loss(batch=16384, branch_sizes=(3, 3, 4, 4), n_atoms=51, v_min=-10, v_max=10)
        loss_fn(online_logits, actions, next_q, target_probs, rewards, dones, discounts, stream,
                weights=None)
        head.backward(loss_fn.d_logits, stream, tag="online")
        loss_fn.loss          # device float32 [1]
        # or, when no other loss adds into the logits' gradient: its taken rows alone (the same bits downstream)
        loss_fn(..., stream, taken_grad=True)
        head.backward(TakenGrad(loss_fn.d_taken, actions), stream, tag="online")
        loss_fn.per_sample    # device float32 [B] (unweighted, for priorities)

    `support` and `branch_sizes` must match the head's (`C51Loss.for_head(head, batch)`).
    """

    def __init__(self, batch: int, branch_sizes, n_atoms: int = 51, v_min: float = -10.0, v_max: float = 10.0,
                 entropy_reg: bool = False, adaptive_support: bool = False):
        self.batch = int(batch)
        self.entropy_reg = bool(entropy_reg)
        self.adaptive_support = bool(adaptive_support)  # adaptive atoms: the support may become non-uniform
        self.branch_sizes = tuple(int(a) for a in branch_sizes)
        if self.batch < 1:
            raise ValueError(f"C51Loss: batch must be >= 1 (got {batch})")
        if not self.branch_sizes or min(self.branch_sizes) < 1:
            raise ValueError(f"C51Loss: branch_sizes must be non-empty positive sizes (got {branch_sizes})")
        self.n_branches = len(self.branch_sizes)
        self.max_actions = max(self.branch_sizes)
        self.n_atoms = int(n_atoms)
        self.support_host = make_support(self.n_atoms, v_min, v_max)
        self.v_min, self.v_max, self.inv_delta_z = support_scalars(self.n_atoms, v_min, v_max)
        self.grad_scale = np.float32(1.0 / (self.batch * self.n_branches))
        self.inv_branches = np.float32(1.0 / self.n_branches)
        self.inv_batch = np.float32(1.0 / self.batch)

        arena = Arena("c51_loss")
        arena.add("d_logits", (self.batch, self.n_branches, self.max_actions, self.n_atoms), np.float32)
        arena.add("d_taken", (self.batch, self.n_branches, self.n_atoms), np.float32)  # its taken rows alone
        arena.add("ce", (self.batch, self.n_branches), np.float32)
        arena.add("target_dist", (self.batch, self.n_branches, self.n_atoms), np.float32)
        arena.add("lse", (self.batch, self.n_branches), np.float32)
        arena.add("per_sample", (self.batch,), np.float32)
        arena.add("loss", (1,), np.float32)
        arena.add("support", (self.n_atoms,), np.float32)
        arena.add("support_scalars", (3,), np.float32)  # (v_min, v_max, 1/Δz): the projection reads them here
        arena.add("branch_sizes", (self.n_branches,), np.int32)
        arena.add("no_mask", (1, 1, 1), np.uint8)  # the kernel's next_mask when none is given (unread)
        arena.add("unused3", (1, 1, 1), np.float32)  # its head_lse / target_rows when none is given (unread)
        arena.add("unused4", (1, 1, 1, 1), np.float32)  # its target_probs when the rows at a* are given (unread)
        arena.add("a_star", (self.batch, self.n_branches), np.int32)  # double_dqn_actions' output
        if self.entropy_reg:  # the atom-entropy regulariser (module docstring)
            arena.add("entropy", (self.batch, self.n_branches), np.float32)
            arena.add("taken_probs", (self.batch, self.n_branches, self.n_atoms), np.float32)
            arena.add("entropy_beta", (1,), np.float32)
        else:  # stand-ins of the right rank, never read
            arena.add("entropy", (1, 1), np.float32)
            arena.add("taken_probs", (1, 1, 1), np.float32)
            arena.add("entropy_beta", (1,), np.float32)
        if self.adaptive_support:  # a* for the atoms' gradient; the uniform/non-uniform flag until bound
            arena.add("best_action", (self.batch, self.n_branches), np.int32)
            arena.add("support_mode", (1,), np.int32)
        else:  # stand-ins of the right rank, never read
            arena.add("best_action", (1, 1), np.int32)
            arena.add("support_mode", (1,), np.int32)
        arena.allocate()
        arena.load({"support_mode": np.zeros(1, np.int32)})
        arena.load({"support": self.support_host, "branch_sizes": np.asarray(self.branch_sizes, np.int32),
                    "support_scalars": np.array([self.v_min, self.v_max, self.inv_delta_z], np.float32)})
        self.arena = arena
        self._support = arena["support"]  # what the target kernel reads (bind_support may share another's)
        self._support_mode = arena["support_mode"]

    def bind_support(self, support, support_mode) -> None:
        """Adaptive atoms: project onto the device arrays `support` (float32 [Z], e.g. the head's, which
        numbarl.rl.losses.atoms rewrites on the device) and follow the flag `support_mode` (int32 [1]:
        0 uniform Eq. 7 with this loss's (v_min, v_max, 1/Δz), 1 non-uniform). Before capture."""
        if not self.adaptive_support:
            raise ValueError("C51Loss.bind_support: built without adaptive_support")
        _check("support", support, (self.n_atoms,), _F32)
        _check("support_mode", support_mode, (1,), (np.dtype(np.int32),))
        self._support, self._support_mode = support, support_mode

    def set_support(self, v_min: float, v_max: float) -> None:
        """Write a new support z = linspace(v_min, v_max, Z) and the projection's (v_min, v_max, 1/Δz)
        into device memory (host copies: between graph replays, never inside a capture). Every later
        call, eager or replayed, projects onto it."""
        support = make_support(self.n_atoms, v_min, v_max)
        self.support_host = support
        self.v_min, self.v_max, self.inv_delta_z = support_scalars(self.n_atoms, v_min, v_max)
        self.arena.load({"support": support,
                         "support_scalars": np.array([self.v_min, self.v_max, self.inv_delta_z], np.float32)})

    def set_entropy_beta(self, beta: float) -> None:
        """Host write of the device β of the atom-entropy term (tests; the agent's controller writes it
        on the device)."""
        if not self.entropy_reg:
            raise ValueError("C51Loss.set_entropy_beta: built without entropy_reg")
        self.arena.load({"entropy_beta": np.array([beta], np.float32)})

    name = "c51"
    inputs = ("logits", "actions", "next_q", "target_probs", "rewards", "dones", "discounts")
    # "logits": the dense ∂L/∂logits; "logits_taken": its rows at the taken actions (`d_taken`, every other row
    # being zero), for a caller whose head takes a TakenGrad and whose other losses add nothing at the logits
    grad_inputs = ("logits", "logits_taken")
    _taken_grad = False  # the form the next compute() writes (apply sets it from the gradients asked for)

    def apply(self, x: dict, grads: dict, stream, weight: float = 1.0, ledger=None) -> None:
        if "logits" in grads and "logits_taken" in grads:
            raise KeyError(f"{self.name}: ask for the logits' gradient dense ('logits') or as its taken rows "
                           "('logits_taken'), not both")
        self._taken_grad = "logits_taken" in grads
        try:
            super().apply(x, grads, stream, weight=weight, ledger=ledger)
        finally:
            self._taken_grad = False

    def compute(self, x: dict, stream) -> None:
        self(x["logits"], x["actions"], x["next_q"], x["target_probs"], x["rewards"], x["dones"], x["discounts"],
             stream, weights=x.get("weights"), next_mask=x.get("next_mask"), taken_grad=self._taken_grad,
             head_lse=x.get("lse"))

    def grad(self, name: str):
        return self.d_taken if name == "logits_taken" else self.d_logits

    def double_dqn_actions(self, next_q, stream, next_mask=None):
        """a* [B, n_branches] int32 (`a_star`) from the online Q on next_obs (and the env's mask of next_obs), the
        argmax this loss's target takes: for a step that computes the target network's probabilities at a* alone
        (`BranchedDuelingC51Head.select_probs`) and gives the loss those rows as target_probs [B, n_branches, Z]."""
        b, nb, na = self.batch, self.n_branches, self.max_actions
        _check("next_q", next_q, (b, nb, na), _F32)
        if next_mask is not None:
            _check("next_mask", next_mask, (b, nb, na), (np.dtype(np.uint8),))
        out = self.arena["a_star"]
        double_dqn_actions_kernel[(max(1, -(-b // BLOCK)), nb), BLOCK, stream](
            next_q, self.arena["branch_sizes"], self.arena["no_mask"] if next_mask is None else next_mask,
            np.int32(next_mask is not None), out)
        return out

    @classmethod
    def for_head(cls, head, batch: int, entropy_reg: bool = False, adaptive_support: bool = False) -> "C51Loss":
        """A loss plan matching a `BranchedDuelingC51Head` (same branches and support)."""
        return cls(batch, head.branch_sizes, head.n_atoms, head.v_min, head.v_max, entropy_reg=entropy_reg,
                   adaptive_support=adaptive_support)

    @property
    def d_logits(self):
        """∂loss/∂online_logits, float32 [B, n_branches, max_actions, Z] (the head's backward input)."""
        return self.arena["d_logits"]

    @property
    def d_taken(self):
        """The rows of ∂loss/∂online_logits at the taken actions, float32 [B, n_branches, Z] (zeros for an action
        outside its branch); written instead of d_logits by a call with taken_grad=True."""
        return self.arena["d_taken"]

    @property
    def ce(self):
        """Per (sample, branch) cross-entropy, float32 [B, n_branches]."""
        return self.arena["ce"]

    @property
    def target_dist(self):
        """Projected double-DQN targets m, float32 [B, n_branches, Z] (valid after a call)."""
        return self.arena["target_dist"]

    @property
    def support(self):
        """The float32 [Z] device support the projection reads (this loss's own, or the bound one)."""
        return self._support

    @property
    def best_action(self):
        """int32 [B, n_branches] double-DQN a* of the last call (adaptive_support only)."""
        return self.arena["best_action"]

    @property
    def entropy(self):
        """H of the taken action's online distribution, float32 [B, n_branches] (entropy_reg only)."""
        return self.arena["entropy"]

    @property
    def taken_probs(self):
        """The taken action's online probabilities, float32 [B, n_branches, Z] (entropy_reg only)."""
        return self.arena["taken_probs"]

    @property
    def entropy_beta(self):
        """Device float32 [1]: β of the atom-entropy term (entropy_reg only)."""
        return self.arena["entropy_beta"]

    def __call__(self, online_logits, actions, next_q, target_probs, rewards, dones, discounts, stream,
                 weights=None, next_mask=None, taken_grad: bool = False, head_lse=None) -> None:
        """Enqueue loss + d_logits (three launches; no allocation, copy or sync: capturable).
        head_lse: float32 [B, n_branches, max_actions], the online head's row log-sum-exp of these logits (the head's
        "lse" buffer, written with its Q): read instead of computed again, the same bits (optional input "lse").
        `next_mask`: uint8 [B, n_branches, max_actions], the env's action mask of each next_obs (e.g.
        ReplayBatch.next_mask): the double-DQN argmax is then over the actions it allows.
        taken_grad: write the gradient's taken rows into d_taken instead of the dense d_logits (which is then
        left as it was): a [B, n_branches, Z] write instead of [B, n_branches, max_actions, Z]."""
        b, nb, na, nz = self.batch, self.n_branches, self.max_actions, self.n_atoms
        _check("online_logits", online_logits, (b, nb, na, nz), _F32)
        rows = len(target_probs.shape) == 3  # the target probabilities already at a* (the head's select_probs)
        _check("target_probs", target_probs, (b, nb, nz) if rows else (b, nb, na, nz), _F32)
        _check("next_q", next_q, (b, nb, na), _F32)
        _check("actions", actions, (b, nb), _INT)
        _check("rewards", rewards, (b,), _F32)
        _check("discounts", discounts, (b,), _F32)
        _check("dones", dones, (b,), _DONE)
        if next_mask is not None:
            _check("next_mask", next_mask, (b, nb, na), (np.dtype(np.uint8),))
        if head_lse is not None:
            _check("lse", head_lse, (b, nb, na), _F32)
        use_weights = np.int32(weights is not None)
        if weights is None:
            weights = self.per_sample  # any float32 [B]; never read when use_weights == 0
        else:
            _check("weights", weights, (b,), _F32)
        lse, target_dist = self.arena["lse"], self.target_dist
        parts = TARGET_PARTS
        c51_target_kernel[(max(1, -(-b * parts // BLOCK)), nb), BLOCK, stream](
            online_logits, actions, next_q, self.arena["unused4"] if rows else target_probs, rewards, dones, discounts, self.support,
            self.arena["branch_sizes"], self.arena["no_mask"] if next_mask is None else next_mask,
            np.int32(next_mask is not None), self.arena["support_scalars"], target_dist, lse, self.ce,
            np.int32(self.entropy_reg), self.entropy, np.int32(self.adaptive_support), self._support_mode,
            self.arena["best_action"], self.arena["unused3"] if head_lse is None else head_lse,
            np.int32(head_lse is not None), target_probs if rows else self.arena["unused3"], np.int32(rows),
            np.int32(parts.bit_length() - 1))
        # the scalar loss and per-sample values read only ce: inside a graph.beside block their reduction forks here,
        # beside the gradient kernel (no gradient reads them)
        reduce_stream = graph.side_stream(stream)
        grad = c51_taken_grad_kernel if taken_grad else c51_grad_kernel
        grad[max(1, -(-b // EW_ROWS)), (EW_ATOMS, EW_ROWS), stream](
            online_logits, actions, self.arena["branch_sizes"], target_dist, lse, weights, use_weights,
            self.grad_scale, self.d_taken if taken_grad else self.d_logits, np.int32(self.entropy_reg),
            self.entropy_beta, self.entropy, self.taken_probs)
        c51_loss_reduce_kernel[1, REDUCE_BLOCK, reduce_stream](
            self.ce, weights, use_weights, self.inv_branches, self.inv_batch, self.per_sample, self.loss)
