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

The dense form replaces the scatter of Algorithm 1 (floor/ceil + index_add) by a Z×Z hat-function
product: no atomics, no `l == u` special case (an atom landing exactly on z_i gets weight 1 there
and 0 on both neighbours), and a thread owns every value it writes.

Layouts (B = batch, n_branches, max_actions = max branch size, Z = n_atoms; padding entries of
branches shorter than max_actions are never read as actions):

    online_logits  float32 [B, n_branches, max_actions, Z]   head output on obs (tag "online")
    next_q         float32 [B, n_branches, max_actions]      online Q on next_obs (tag "next")
    target_probs   float32 [B, n_branches, max_actions, Z]   target-net probs on next_obs
    actions        int32/int64 [B, n_branches]               taken action per branch
    rewards        float32 [B]                               n-step return Σ γ^k r_{t+k}
    dones          float32/uint8/int32 [B]                   1 when the n-step window ended an episode
    discounts      float32 [B]                               γ^m >= 0, m = actual steps in the window
    weights        float32 [B] or None                       importance weights
    d_logits       float32 [B, n_branches, max_actions, Z]   gradient for the head's backward
    per_sample     float32 [B]                               (1/n_branches) Σ_k CE[b, k], unweighted
    loss           float32 [1]                               L above

Thread mapping (two launches):
  * `c51_loss_kernel`: one row of LANES = 32 threads per (b, k), ROWS = 8 rows per block. Lane l
    owns atoms i = l, l + 32, ...: Eq. 7's m_i as the dense sum over j (`project_atom_dev`, the
    same device function as the standalone `project_distribution`), the CE terms, and coalesced
    stores of d_logits (gradient row and the zeros of the other actions / padding). Row maxima and
    sums are folded in lane order through shared memory (`numbarl.cuda.reduce.row_fold`).
  * `c51_loss_reduce_kernel`, ONE block: per-sample means over branches and the scalar loss, by a
    fixed strided order then a fixed shared-memory tree: the same inputs give the same bits on
    every run (no atomics).
Measured on the H200 (B = 16,384, 4 branches, 51 atoms): a first version with one thread per
(b, k) doing the Z² hat evaluations alone and row-strided d_logits stores took 0.62 ms.
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda.runtime import Arena, cuda

_cuda = cuda()  # selects the backend (GPU or simulator) before numba is imported below

from numba import float32, njit  # noqa: E402  (numba must be imported after the backend switch)

from numbarl.cuda.reduce import LANES, OP_MAX, OP_SUM, ROWS, row_fold  # noqa: E402

BLOCK = 128  # threads per block of the elementwise projection kernel
REDUCE_BLOCK = 256  # threads of the single-block loss reduction (power of two)

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_NEG_INF = np.float32(-np.inf)
_NAN = np.float32(np.nan)


def make_support(n_atoms: int, v_min: float, v_max: float) -> np.ndarray:
    """The C51 support z_i = v_min + i·Δz as float32 [n_atoms] (both ends exact)."""
    if int(n_atoms) < 2:
        raise ValueError(f"n_atoms must be >= 2 (got {n_atoms}): C51 needs at least two atoms")
    if not (np.isfinite(v_min) and np.isfinite(v_max) and v_max > v_min):
        raise ValueError(f"C51 support needs finite v_min < v_max (got v_min={v_min}, v_max={v_max})")
    return np.linspace(float(v_min), float(v_max), int(n_atoms)).astype(np.float32)


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


def double_dqn_actions_ref(next_q, branch_sizes):
    """Online-net argmax per branch over the valid actions (first maximum on ties).

    Args:
      next_q: [B, n_branches, max_actions] E[Z] of the online net on next_obs.
      branch_sizes: [n_branches] number of valid actions of each branch.

    Returns:
      [B, n_branches] int64 greedy actions a*.
    """
    next_q = np.asarray(next_q, np.float64)
    out = np.zeros(next_q.shape[:2], np.int64)
    for k, n in enumerate(branch_sizes):
        out[:, k] = np.argmax(next_q[:, k, :n], axis=1)
    return out


def target_distribution_ref(next_q, target_probs, rewards, dones, discounts, support, branch_sizes):
    """Double-DQN C51 target per branch: project the target net's distribution at a*.

    Args:
      next_q: [B, n_branches, max_actions] online E[Z] on next_obs (selects a*).
      target_probs: [B, n_branches, max_actions, Z] target-net probabilities on next_obs.
      rewards, dones, discounts: [B] n-step return, done flag, γ^m.
      support: [Z].
      branch_sizes: [n_branches].

    Returns:
      [B, n_branches, Z] projected target distributions m (float64).
    """
    a_star = double_dqn_actions_ref(next_q, branch_sizes)  # [B, n_branches]
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


def cross_entropy_loss_ref(online_logits, actions, target_dist, weights=None):
    """Cross-entropy between the projected targets and the online distribution at the taken action.

    Args:
      online_logits: [B, n_branches, max_actions, Z] online head logits on obs.
      actions: [B, n_branches] taken actions.
      target_dist: [B, n_branches, Z] projected targets m (constants: no gradient flows into them).
      weights: [B] importance weights or None (all ones).

    Returns:
      loss: float, (1/B) Σ_b w_b · per_sample[b].
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
    for k in range(n_branches):
        logits = online_logits[rows, k, actions[:, k]]  # [B, Z]
        logp = log_softmax_ref(logits)
        m = np.asarray(target_dist[:, k], np.float64)
        ce[:, k] = -np.sum(m * logp, axis=1)
        # d CE / d logits = softmax · Σm - m  (Σm = 1 for a projected distribution)
        d = np.exp(logp) * np.sum(m, axis=1, keepdims=True) - m
        d_logits[rows, k, actions[:, k]] = (w / (batch * n_branches))[:, None] * d
    per_sample = ce.mean(axis=1)
    loss = float(np.mean(w * per_sample))
    return loss, per_sample, d_logits


def c51_loss_ref(online_logits, actions, next_q, target_probs, rewards, dones, discounts, support,
                 branch_sizes, weights=None):
    """The whole distributional double-DQN loss: target (double DQN + Eq. 7) then cross-entropy.

    Returns (loss, per_sample [B], d_logits [B, n_branches, max_actions, Z], target_dist
    [B, n_branches, Z]); see `target_distribution_ref` and `cross_entropy_loss_ref` for shapes.
    """
    target_dist = target_distribution_ref(next_q, target_probs, rewards, dones, discounts, support, branch_sizes)
    loss, per_sample, d_logits = cross_entropy_loss_ref(online_logits, actions, target_dist, weights)
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
def project_atom_dev(i, reward, gamma, probs_row, support, v_min, v_max, inv_delta_z):
    """m_i of Eq. 7 for one sample: Σ_j hat(T z_j, z_i) · p_j, dense, in the order j = 0..Z-1."""
    z_i = support[i]
    m = _ZERO
    for j in range(support.shape[0]):
        m += hat_weight(target_atom(reward, gamma, support[j], v_min, v_max), z_i, inv_delta_z) * probs_row[j]
    return m


@_cuda.jit(device=True)
def bootstrap_gamma_dev(discounts, dones, b):
    """γ_b = γ^m · (1 - done_b) as float32 for any numeric done dtype."""
    if dones[b] != 0:
        return _ZERO
    return discounts[b]


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def project_distribution_kernel(rewards, dones, discounts, next_probs, support, v_min, v_max, inv_delta_z, out):
    """out[b, i] = m_i (Eq. 7) for next_probs [B, Z]; one thread per (b, i), coalesced over i."""
    t = _cuda.grid(1)
    n_atoms = support.shape[0]
    if t >= out.shape[0] * n_atoms:
        return
    b = t // n_atoms
    i = t - b * n_atoms
    gamma = bootstrap_gamma_dev(discounts, dones, b)
    out[b, i] = project_atom_dev(i, rewards[b], gamma, next_probs[b], support, v_min, v_max, inv_delta_z)


@_cuda.jit(cache=True)
def c51_loss_kernel(online_logits, actions, next_q, target_probs, rewards, dones, discounts, weights, use_weights,
                    support, branch_sizes, v_min, v_max, inv_delta_z, grad_scale, target_dist, ce, d_logits):
    """One row of LANES threads per (sample b, branch k); block (LANES, ROWS) holds ROWS samples of
    one branch k = blockIdx.y.

    Every lane finds a* (A_k broadcast reads); lane l owns atoms i = l, l + LANES, ...: Eq. 7's
    m_i (dense sum over j), the taken action's logits for the log-sum-exp, the CE terms and the
    d_logits stores (coalesced). Row folds (max, Σexp, CE) go through shared memory in lane order
    (reduce.row_fold). An action outside the branch gives CE = NaN and zero gradients. No early
    return: rows past the end still reach every barrier.
    """
    fold_max = _cuda.shared.array((ROWS, LANES), float32)
    fold_sum = _cuda.shared.array((ROWS, LANES), float32)
    fold_ce = _cuda.shared.array((ROWS, LANES), float32)
    lane = _cuda.threadIdx.x
    ty = _cuda.threadIdx.y
    b = _cuda.blockIdx.x * ROWS + ty  # grid (ceil(B / ROWS), n_branches): no integer division
    k = _cuda.blockIdx.y
    batch, _, max_actions, n_atoms = online_logits.shape
    valid = b < batch
    taken = -1
    live = False
    if valid:
        taken = actions[b, k]
        live = taken >= 0 and taken < branch_sizes[k]

    # log-sum-exp of the online logits at the taken action (max-shifted)
    mx = _NEG_INF
    if live:
        i = lane  # (while loops: range() with a step divides to get its trip count)
        while i < n_atoms:
            mx = max(mx, online_logits[b, k, taken, i])
            i += LANES
    mx = row_fold(fold_max, ty, lane, mx, OP_MAX)
    total = _ZERO
    if live:
        i = lane
        while i < n_atoms:
            total += math.exp(online_logits[b, k, taken, i] - mx)
            i += LANES
    total = row_fold(fold_sum, ty, lane, total, OP_SUM)

    acc = _ZERO
    if live:
        log_norm = mx + math.log(total)
        # double DQN: a* = argmax of the online net's E[Z] on next_obs (first maximum wins)
        best = 0
        best_q = next_q[b, k, 0]
        for a in range(1, branch_sizes[k]):
            q = next_q[b, k, a]
            if q > best_q:
                best_q = q
                best = a
        probs_row = target_probs[b, k, best]  # [Z] target-net distribution at a*
        gamma = bootstrap_gamma_dev(discounts, dones, b)
        reward = rewards[b]
        scale = grad_scale
        if use_weights != 0:
            scale = grad_scale * weights[b]
        i = lane
        while i < n_atoms:
            m = project_atom_dev(i, reward, gamma, probs_row, support, v_min, v_max, inv_delta_z)
            target_dist[b, k, i] = m
            logp = online_logits[b, k, taken, i] - log_norm
            acc -= m * logp
            d_logits[b, k, taken, i] = scale * (math.exp(logp) - m)
            i += LANES
    acc = row_fold(fold_ce, ty, lane, acc, OP_SUM)
    if valid:
        for a in range(max_actions):  # zeros: other actions and padding (all rows when not live)
            if a != taken or not live:
                i = lane
                while i < n_atoms:
                    d_logits[b, k, a, i] = _ZERO
                    i += LANES
        if lane == 0:
            ce[b, k] = acc if live else _NAN


@_cuda.jit(cache=True)
def c51_loss_reduce_kernel(ce, weights, use_weights, inv_branches, inv_batch, per_sample, loss):
    """ONE block: per_sample[b] = mean_k CE[b, k]; loss[0] = (1/B) Σ_b w_b per_sample[b].

    Thread t sums samples t, t + REDUCE_BLOCK, ... in order, then a fixed shared-memory tree:
    bitwise reproducible, no atomics.
    """
    partial = _cuda.shared.array(REDUCE_BLOCK, np.float32)
    t = _cuda.threadIdx.x
    batch = ce.shape[0]
    n_branches = ce.shape[1]
    acc = _ZERO
    for b in range(t, batch, REDUCE_BLOCK):
        s = _ZERO
        for k in range(n_branches):
            s += ce[b, k]
        s = s * inv_branches
        per_sample[b] = s
        if use_weights != 0:
            s = s * weights[b]
        acc += s
    partial[t] = acc
    _cuda.syncthreads()
    stride = REDUCE_BLOCK // 2
    while stride > 0:
        if t < stride:
            partial[t] += partial[t + stride]
        _cuda.syncthreads()
        stride //= 2
    if t == 0:
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
    project_distribution_kernel[_grid(batch * n_atoms), BLOCK, stream](  # one thread per (b, i)
        rewards, dones, discounts, next_probs, support, v_min32, v_max32, inv_dz, out)


def support_scalars(n_atoms: int, v_min: float, v_max: float):
    """(v_min, v_max, 1/Δz) as the float32 kernel arguments matching `make_support`."""
    support = make_support(n_atoms, v_min, v_max)
    return support[0], support[-1], np.float32((int(n_atoms) - 1) / (float(v_max) - float(v_min)))


class C51Loss:
    """Plan for the fused distributional double-DQN loss: owns every buffer it writes.

    Built once before capture (allocates an Arena); `__call__` only launches two kernels:

        loss_fn = C51Loss(batch=16384, branch_sizes=(3, 3, 4, 4), n_atoms=51, v_min=-10, v_max=10)
        loss_fn(online_logits, actions, next_q, target_probs, rewards, dones, discounts, stream,
                weights=None)
        head.backward(loss_fn.d_logits, stream, tag="online")
        loss_fn.loss          # device float32 [1]
        loss_fn.per_sample    # device float32 [B] (unweighted, for priorities)

    `support` and `branch_sizes` must match the head's (`C51Loss.for_head(head, batch)`).
    """

    def __init__(self, batch: int, branch_sizes, n_atoms: int = 51, v_min: float = -10.0, v_max: float = 10.0):
        self.batch = int(batch)
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
        arena.add("ce", (self.batch, self.n_branches), np.float32)
        arena.add("target_dist", (self.batch, self.n_branches, self.n_atoms), np.float32)
        arena.add("per_sample", (self.batch,), np.float32)
        arena.add("loss", (1,), np.float32)
        arena.add("support", (self.n_atoms,), np.float32)
        arena.add("branch_sizes", (self.n_branches,), np.int32)
        arena.allocate()
        arena.load({"support": self.support_host, "branch_sizes": np.asarray(self.branch_sizes, np.int32)})
        self.arena = arena

    @classmethod
    def for_head(cls, head, batch: int) -> "C51Loss":
        """A loss plan matching a `BranchedDuelingC51Head` (same branches and support)."""
        return cls(batch, head.branch_sizes, head.n_atoms, head.v_min, head.v_max)

    @property
    def d_logits(self):
        """∂loss/∂online_logits, float32 [B, n_branches, max_actions, Z] (the head's backward input)."""
        return self.arena["d_logits"]

    @property
    def loss(self):
        return self.arena["loss"]

    @property
    def per_sample(self):
        return self.arena["per_sample"]

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
        return self.arena["support"]

    def __call__(self, online_logits, actions, next_q, target_probs, rewards, dones, discounts, stream,
                 weights=None) -> None:
        """Enqueue loss + d_logits (two launches; no allocation, copy or sync: capturable)."""
        b, nb, na, nz = self.batch, self.n_branches, self.max_actions, self.n_atoms
        _check("online_logits", online_logits, (b, nb, na, nz), _F32)
        _check("target_probs", target_probs, (b, nb, na, nz), _F32)
        _check("next_q", next_q, (b, nb, na), _F32)
        _check("actions", actions, (b, nb), _INT)
        _check("rewards", rewards, (b,), _F32)
        _check("discounts", discounts, (b,), _F32)
        _check("dones", dones, (b,), _DONE)
        use_weights = np.int32(weights is not None)
        if weights is None:
            weights = self.per_sample  # any float32 [B]; never read when use_weights == 0
        else:
            _check("weights", weights, (b,), _F32)
        c51_loss_kernel[(max(1, -(-b // ROWS)), nb), (LANES, ROWS), stream](
            online_logits, actions, next_q, target_probs, rewards, dones, discounts, weights, use_weights,
            self.support, self.arena["branch_sizes"], self.v_min, self.v_max, self.inv_delta_z, self.grad_scale,
            self.target_dist, self.ce, self.d_logits)
        c51_loss_reduce_kernel[1, REDUCE_BLOCK, stream](
            self.ce, weights, use_weights, self.inv_branches, self.inv_batch, self.per_sample, self.loss)
