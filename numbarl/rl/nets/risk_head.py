"""Risk-budget head (issue 15, ../shared COMPONENTS T7): one logit per state on the shared trunk's features,
ρ(s) = σ(z(s)), trained by binary cross-entropy on the replay's trade outcomes
(numbarl/rl/losses/risk_head.py, where the labels and the loss live), and used to scale the size of new entries.

The origin notes give only the name ("risk_budget_forward: risk budget from h_s2"); this is numbarl's
interpretation, to be judged by its effect on drawdown. (Not the R18 exploration risk budget of
agent.risk_budget, which scales the env's Kelly cap by the IQN readiness: numbarl/rl/cvar_gate.py.)

For the trunk output h [B, H]:

    z[b] = h[b, :]·w + b_r          Linear "fc" (H → 1, no activation)   [B, 1]
    ρ[b] = σ(z[b])                  in the sizing / loss kernels, never stored by the head

The head outputs the LOGIT (the confidence head's pattern, numbarl/rl/nets/confidence.py): the loss takes
the cross-entropy from logits, so the backward is exactly numbarl's Linear backward (dw = hᵀ·dz,
db = colsum(dz), dh = dz·wᵀ added into the shared trunk gradient by the gradient ledger).

The use (agent.risk_head_sizing, on by default with the head): the executed size of a NEW entry (an env
that is flat, its observation's position column 0, choosing direction short or long) is the chosen size
times the factor f = min(1, ρ(s) / ρ̄), snapped DOWN to the env's size grid (EnvParams.sizes, default
(1, 2, 4) contracts), with ρ̄ the base win rate of the labelled trades (an EMA the loss keeps,
numbarl/rl/losses/risk_head.py):

    k′ = argmax_j { sizes[j] : sizes[j] ≤ sizes[k]·f }     (the largest grid size at or below the scaled one)
       = argmin_j sizes[j]  when no grid size is ≤ sizes[k]·f (never below the smallest size: an entry stays
                            an entry; whether to enter is the direction branch's choice, not the budget's)

e.g. sizes (1, 2, 4), chosen 4, ρ̄ = 0.5: ρ ≥ 0.5 → f = 1 → 4; ρ = 0.45 → 3.6 → 2; ρ = 0.25 → 2.0 → 2;
ρ = 0.15 → 1.2 → 1. Why relative to ρ̄: ρ is a win probability, and with the net P&L of a trade the win rate
of a profitable policy can sit anywhere (0.3-0.6 is common); size × ρ itself would lower every entry (ρ < 1
always) and never execute the largest size from flat, so the replay would never hold it there and its Q
would be bootstrapped untrained. Relative to the base rate, an entry the head rates at or above an average
trade keeps its size and only the below-average ones shrink. Before any labelled batch (ρ̄ not set) and
while ρ̄ ≤ 0 the factor is 1 (no evidence yet). NaN guard: a non-finite ρ (a NaN logit: a broken head)
takes the SMALLEST size, the protective choice for drawdown (the alternative, "no scaling", would let a
diverged head trade full size unnoticed). σ(±inf) is finite (0 or 1) and follows the rule.

Where, and why there. The executed action must be the one the replay stores and the one the backtest
takes, with the env untouched (it publishes masks and takes actions; it never reads the agent):

* collect step (dqn.py `collect_step`): AFTER the behaviour policy chose the actions (exploration included)
  and BEFORE env.step, `size_actions_kernel` rewrites the size action of each flat env choosing an entry to
  k′ (ρ from the head on the acting pass's trunk output). The replay then stores the executed action, so
  the C51 loss learns Q of the size that was actually traded. A reversal (an env in a position choosing
  the other side, with the direction lock off) is not a new entry from flat and keeps its size; holding,
  exits and the target / stop branches are never touched.
* backtests (agent.scores): the greedy choice per branch is the env's `greedy_action` (numbarl/env/rows.py,
  the first maximum). `size_scores_kernel` runs last on the scores: for a flat policy whose greedy direction
  is an entry it takes the greedy size k*, computes k′ as above and, when k′ ≠ k*, gives the size branch's
  best score to k′ and −inf to every other size (the lowest float32 to k′ if the best was not a number), so
  greedy_action picks k′: the backtest acts exactly as the collect step's greedy part does. The greedy
  choices are taken with the env's own mask of a flat position (`mask_row` at position 0, computed once),
  which is the mask a flat policy sees.

The size grid. The collect kernel reads the env's device grid (env.grids.sizes) and copies it into the
sizer's own `sizes` buffer, which the backtest kernel reads (agent.scores takes no env); it is a policy
array of the checkpoint (risk_grid/sizes), so a scored checkpoint sizes as it was trained. A backtest before
any collect step or checkpoint load raises (no silent unscaled backtest).

Thread mapping: one thread per env (collect) or policy (backtest); no atomics. Diagnostics: the share of
envs whose size the last collect step lowered (`resized`, a fixed-order mean at log intervals).

Parameters (optimizer group ``head.risk``): ``{name}.fc.w`` [H, 1] (kaiming-uniform, weight decay),
``{name}.fc.b`` [1] (no decay). Buffers per tag: the layer's own (``{name}.fc.{tag}.y`` is z).
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda import launch
from numbarl.cuda.runtime import Arena, cuda
from numbarl.env.params import BR_DIRECTION, BR_SIZE, DIR_LONG, DIR_SHORT
from numbarl.env.rows import greedy_action, mask_row
from numbarl.rl.losses.confidence import sigmoid_dev
from numbarl.rl.nets.confidence import LogitHead

_cuda = cuda()  # the backend (GPU or simulator), selected once

BLOCK = 128  # one env (policy) per thread
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_LOWEST = np.float32(-3.4028235e38)
_NEG_INF = np.float32(-np.inf)

_greedy_action = launch.device_function(greedy_action)


class RiskHead(LogitHead):
    """z(s) = h·w + b [B, 1] on the trunk features h [B, H]; ρ(s) = σ(z) (module docstring)."""

    default_group = "head.risk"


# ---------------------------------------------------------------------------------------------
# reference (numpy; ρ as the kernels computed it, the snap in float32 as they do)
# ---------------------------------------------------------------------------------------------
def size_factor_ref(rho, base=(1.0, 1.0)) -> np.float32:
    """f = min(1, ρ / ρ̄) in float32 (module docstring); base = (ρ̄, set): 1 when not set or ρ̄ ≤ 0; NaN for a
    non-finite ρ (which snaps to the smallest size)."""
    rho = np.float32(rho)
    if not np.isfinite(rho):
        return np.float32(np.nan)
    rate, seen = np.float32(base[0]), np.float32(base[1])
    if seen == 0 or not rate > 0:
        return np.float32(1.0)
    return np.float32(min(np.float32(rho / rate), np.float32(1.0)))


def snap_size_ref(k: int, factor, sizes) -> int:
    """k′: the index of the largest grid size ≤ sizes[k]·f (float32 product), else the smallest size's."""
    sizes = np.asarray(sizes, np.float32)
    target = np.float32(sizes[k]) * np.float32(factor)
    below = [j for j in range(sizes.size) if sizes[j] <= target]  # a NaN target: none (the smallest size)
    if not below:
        return int(np.argmin(sizes))
    return int(max(below, key=lambda j: sizes[j]))


def size_actions_ref(actions, obs, rho, sizes, position_col: int, base=(1.0, 1.0)):
    """(executed actions [N, n_branches], resized [N] bool): each flat env (obs[i, position_col] == 0) choosing
    direction short or long gets size k′ = snap_size_ref(size, f(ρ_i)); resized where k′ ≠ the chosen size.
    base = (ρ̄, set); the default (1, 1) makes f = ρ."""
    out = np.array(actions, copy=True)
    resized = np.zeros(out.shape[0], bool)
    for i in range(out.shape[0]):
        if obs[i, position_col] != 0 or out[i, BR_DIRECTION] not in (DIR_SHORT, DIR_LONG):
            continue
        k = int(out[i, BR_SIZE])
        if not 0 <= k < len(sizes):
            continue
        out[i, BR_SIZE] = snap_size_ref(k, size_factor_ref(rho[i], base), sizes)
        resized[i] = out[i, BR_SIZE] != k
    return out, resized


def _first_max_ref(row) -> int:
    """greedy_action over a whole row: the first maximum (NaN never wins; all NaN: the first)."""
    best, best_a = -np.inf, 0
    for a, v in enumerate(row):
        if v > best:
            best, best_a = v, a
    return best_a


def size_scores_ref(q, obs, rho, sizes, position_col: int, branch_sizes, base=(1.0, 1.0)):
    """The greedy scores with a flat policy's size branch moved to k′ where its greedy direction is an entry
    (module docstring): greedy over each branch's actions then picks k′. base as size_actions_ref."""
    out = np.array(q, copy=True)
    n_dir, n_size = int(branch_sizes[BR_DIRECTION]), int(branch_sizes[BR_SIZE])
    for i in range(out.shape[0]):
        if obs[i, position_col] != 0 or _first_max_ref(out[i, BR_DIRECTION, :n_dir]) not in (DIR_SHORT, DIR_LONG):
            continue
        k = _first_max_ref(out[i, BR_SIZE, :n_size])
        k2 = snap_size_ref(k, size_factor_ref(rho[i], base), sizes)
        if k2 != k:
            best = out[i, BR_SIZE, k]
            out[i, BR_SIZE, :n_size] = _NEG_INF
            out[i, BR_SIZE, k2] = best if best > _NEG_INF else _LOWEST
    return out


def flat_mask(n: int, branch_sizes) -> np.ndarray:
    """uint8 [n, n_branches, max_actions]: the env's mask (numbarl/env/rows.py `mask_row`) of a flat position,
    the mask every flat policy's greedy choice is taken over."""
    bs = np.asarray(branch_sizes, np.int64)
    mask = np.zeros((int(n), bs.size, int(bs.max())), np.uint8)
    for i in range(mask.shape[0]):
        for m in range(mask.shape[1] * mask.shape[2]):
            mask_row(mask, i, m, np.float64(0.0), np.int64(1), bs)
    return mask


# ---------------------------------------------------------------------------------------------
# device functions and kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(device=True, inline=True)
def size_factor_dev(rho, base):
    """f = min(1, ρ / ρ̄) (size_factor_ref); a non-finite ρ gives NaN (snapped to the smallest size)."""
    if not math.isfinite(rho):
        return np.float32(math.nan)
    if base[1] == _ZERO or not base[0] > _ZERO:
        return _ONE
    return min(rho / base[0], _ONE)


@_cuda.jit(device=True, inline=True)
def snap_size_dev(sizes, k, factor):
    """k′ of the module docstring: the largest grid size ≤ sizes[k]·f, else the smallest (a NaN f: no size is
    ≤ the NaN target, so the smallest: the protective choice)."""
    target = sizes[k] * factor
    best = -1
    low = 0
    for j in range(sizes.shape[0]):
        s = sizes[j]
        if s < sizes[low]:
            low = j
        if s <= target and (best < 0 or s > sizes[best]):
            best = j
    if best < 0:
        return low
    return best


@_cuda.jit(cache=True)
def size_actions_kernel(z, obs, position_col, env_sizes, actions, sizes, rho_out, resized, base):
    """One thread per env: ρ_i = σ(z[i, 0]) into rho_out; a flat env choosing an entry gets size k′ in
    actions[i, BR_SIZE] (resized[i] = 1 where lowered). Threads j < n_sizes copy env_sizes into sizes (the
    grid the backtest kernel reads; nothing in this launch reads that copy)."""
    i = _cuda.grid(1)
    if i < env_sizes.shape[0]:
        sizes[i] = env_sizes[i]
    if i >= obs.shape[0]:
        return
    rho = sigmoid_dev(z[i, 0])
    rho_out[i] = rho
    resized[i] = _ZERO
    if obs[i, position_col] != _ZERO:
        return
    d = actions[i, BR_DIRECTION]
    if d != DIR_SHORT and d != DIR_LONG:
        return
    k = actions[i, BR_SIZE]
    if k < 0 or k >= env_sizes.shape[0]:
        return
    k2 = snap_size_dev(env_sizes, k, size_factor_dev(rho, base))  # a NaN ρ: the smallest size
    if k2 != k:
        actions[i, BR_SIZE] = k2
        resized[i] = _ONE


@_cuda.jit(cache=True)
def size_scores_kernel(z, obs, position_col, sizes, mask, q, base):
    """One thread per policy: a flat policy whose greedy direction is an entry gets its size branch's best
    score at k′ and −inf at the other sizes (module docstring); greedy_action then picks k′."""
    i = _cuda.grid(1)
    if i >= obs.shape[0]:
        return
    if obs[i, position_col] != _ZERO:
        return
    d = _greedy_action(q, mask, i, BR_DIRECTION)
    if d != DIR_SHORT and d != DIR_LONG:
        return
    k = _greedy_action(q, mask, i, BR_SIZE)
    if k < 0 or k >= sizes.shape[0]:
        return
    k2 = snap_size_dev(sizes, k, size_factor_dev(sigmoid_dev(z[i, 0]), base))
    if k2 == k:
        return
    best = q[i, BR_SIZE, k]
    if not best > _NEG_INF:  # −inf or NaN: k′ must still win greedy_action's strict comparison
        best = _LOWEST
    for a in range(sizes.shape[0]):
        q[i, BR_SIZE, a] = _NEG_INF
    q[i, BR_SIZE, k2] = best


# ---------------------------------------------------------------------------------------------
# the use on the agent's passes
# ---------------------------------------------------------------------------------------------
class RiskSizer:
    """The size rewrite of new entries by ρ(s) (module docstring). head: the :class:`RiskHead` whose passes
    "act" and "eval" are declared (backward=False); position_col: the observation column of the signed
    position; n_sizes: the size branch's actions; eval_batch: policies of the backtest's scores."""

    def __init__(self, head: RiskHead, n_envs: int, eval_batch: int, position_col: int, branch_sizes, base_rate):
        self.head, self.position_col, self.base_rate = head, np.int64(position_col), base_rate  # (ρ̄, set) [2]
        self.branch_sizes = tuple(int(b) for b in branch_sizes)
        n_sizes = self.branch_sizes[BR_SIZE]
        self.dev = Arena("agent.risk_sizer")
        self.dev.add("sizes", (n_sizes,), np.float32)  # the env's grid, copied by the collect kernel
        self.dev.add("rho", (int(n_envs),), np.float32)
        self.dev.add("resized", (int(n_envs),), np.float32)
        self.dev.add("flat_mask", (int(eval_batch), len(self.branch_sizes), max(self.branch_sizes)), np.uint8)
        self.dev.allocate()
        self.dev.load({"flat_mask": flat_mask(eval_batch, self.branch_sizes)})
        self.bound = False  # whether the grid was copied (a collect step issued) or loaded

    @property
    def resized(self):
        """Device float32 [N]: 1 where the last collect step lowered env i's size."""
        return self.dev["resized"]

    @property
    def rho(self):
        """Device float32 [N]: ρ of the last collect step's acting pass."""
        return self.dev["rho"]

    def load_sizes(self, sizes) -> None:
        """The size grid (host float32 [n_sizes], e.g. a checkpoint's risk_grid/sizes); between replays."""
        sizes = np.asarray(sizes, np.float32).reshape(-1)
        if sizes.shape != self.dev["sizes"].shape or not np.all(sizes > 0):
            raise ValueError(f"risk head: a size grid of {self.dev['sizes'].shape[0]} positive sizes is needed "
                             f"(got {sizes.tolist()})")
        self.dev.load({"sizes": sizes})
        self.bound = True

    def on_actions(self, h, obs, actions, env_sizes, stream, tag: str = "act") -> None:
        """After the behaviour policy, before env.step (trunk output h [N, H]): flat entries' sizes to k′."""
        if tuple(env_sizes.shape) != tuple(self.dev["sizes"].shape):
            raise ValueError(f"risk head: the env's size grid has {env_sizes.shape[0]} sizes, the size branch "
                             f"{self.dev['sizes'].shape[0]}")
        z = self.head.forward(h, stream, tag=tag)
        n = max(obs.shape[0], env_sizes.shape[0])
        size_actions_kernel[launch.blocks(n, BLOCK), min(BLOCK, n), stream](
            z, obs, self.position_col, env_sizes, actions, self.dev["sizes"], self.dev["rho"], self.dev["resized"],
            self.base_rate)
        self.bound = True

    def on_scores(self, h, obs, q, stream, tag: str = "eval") -> None:
        """After the evaluation pass and every gate (trunk output h [P, H]): flat entries' greedy size to k′."""
        if not self.bound:
            raise RuntimeError("risk head (agent.risk_head_sizing): the backtest needs the env's size grid; run a "
                               "collect step, load a checkpoint that has risk_grid/sizes, or call "
                               "agent.risk_sizer.load_sizes(EnvParams.grids()[0]) first")
        z = self.head.forward(h, stream, tag=tag)
        n = obs.shape[0]
        size_scores_kernel[launch.blocks(n, BLOCK), min(BLOCK, n), stream](
            z, obs, self.position_col, self.dev["sizes"], self.dev["flat_mask"], q, self.base_rate)
