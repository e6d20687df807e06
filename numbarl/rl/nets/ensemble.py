"""Bootstrapped ensemble of C51 heads and the epistemic entry gate (agent.ensemble_heads, agent.epistemic_theta).

Bootstrapped DQN (Osband, Blundell, Pritzel & Van Roy 2016, Algorithm 1): M value heads share one
trunk; head m trains only on the transitions its Bernoulli mask selects, so the heads disagree where
the data do not pin the value down, and their spread estimates epistemic uncertainty.

numbarl keeps the agent's C51 head (``head``) as head 0 and acting head, unchanged; the ensemble adds
M − 1 extra heads ``head.ens1 .. head.ens<M-1>`` (each a `BranchedDuelingC51Head`, one optimizer group
'head.ens' for all of them). Each extra head m is a full double-DQN C51 learner on the shared trunk
features h (the trunk passes the agent already runs: online on obs, online on next_obs, target on
next_obs):

    a*_m     = argmax_a Q_m(next_obs, a)               (head m, online parameters)
    target_m = Φ(R_n + (1 − done) γ^m z, p_m^target(next_obs, a*_m))     (its own target head)
    L_m      = (1/B) Σ_b w_bm · (1/n_branches) Σ_k CE_bk              (numbarl/rl/losses/c51.py weights)
    w_bm     = 1{U(seed, row_b, 0, MASK_SLOT + m − 1) < 1/2}   (· the batch's E6/E8 loss weight when it
                                                                  carries one)

row_b = the replay row (slot · n_envs + env) the sample came from: the mask of a transition for head m
is fixed for as long as it lives in the replay (Osband's per-transition mask drawn when the
transition is stored), a pure function of (seed, row, head) from the counter RNG
(numbarl/cuda/rng.py), so a run replays it exactly. The heads' losses are auxiliary losses: they run on
the agent.aux_frequency steps, their dh add into the trunk gradient after the C51 head's (and IQN,
IQL, confidence), in head order; on the other steps their gradients are zeroed.

Epistemic score, for direction action d of the direction branch (branch 0) at state s:

    u(s, d) = sqrt( (1/M) Σ_m (Q_m(s, 0, d) − Q̄(s, d))² ),  Q̄ = (1/M) Σ_m Q_m(s, 0, d)
                                                           (population std over head 0 and the extras)

e.g. Q = (1, 2, 3) over three heads: u = sqrt(2/3) = 0.8165. Float32, the heads summed in order
(head 0 first), two passes (mean, then squares).

The gate (agent.epistemic_theta = θ > 0): where env i is flat (its observation's position column is
0), an entry side d ∈ {short, long} is taken away when

    budget · u(s, d) > θ

budget = 1, or with agent.iqn the IQN readiness² (the exploration risk budget, as the CVaR gate:
numbarl/rl/cvar_gate.py; budget 0 gates nothing). Holding and closing are never gated. Per side, so
the entry the greedy policy would choose is blocked exactly when its own u exceeds θ. Where it acts
is where the CVaR gate acts: the greedy choice's copy of the env's mask after the acting pass
(collect, before the policy; exploration draws from the env's own mask, and the replay stores the
greedy choice's) and the greedy scores of a backtest (agent.scores: validation and test), gated
entries scored the lowest float32.

Statistics: ``ensemble_std`` (train, aux steps) = batch mean of u(obs_b, d_b) at the sample's taken
direction d_b on the online pass; with the gate (diagnostics, the last collect step)
``epistemic_blocked_frac`` (share of the flat envs with an entry gated), ``epistemic_score_mean``
(mean u over envs and the two sides) and ``epistemic_budget``.

Thread mapping: `bootstrap_mask_kernel` one thread per (sample, extra head); `direction_sides_kernel` / `direction_taken_kernel`
one thread per row, one launch per head (head m's Q rows into slice m of a [M, N, S] stack);
`epistemic_score_kernel` one thread per (row, side); the gate kernels one thread per env; the
gate statistics reuse the CVaR gate's one-block fixed-order kernel. No atomics.

One wide GEMM for the M − 1 heads would need a strided dueling kernel (each head's V and A columns
are not contiguous rows of a wide output); the extra heads are M − 1 head instances instead, each
with the head's own two GEMMs and fused dueling kernel.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from numbarl.cuda import launch
from numbarl.cuda.registry import RNG_STREAMS
from numbarl.cuda.rng import uniform
from numbarl.cuda.runtime import Arena, cuda
from numbarl.env.params import DIR_LONG, DIR_SHORT
from numbarl.rl.cvar_gate import (
    STATS_BLOCK,
    budget_ref,
    cvar_stats_kernel,
    gate_mask_dev,
    gate_scores_dev,
    gated_sides_dev,
    switch_of,
)
from numbarl.rl.cvar_gate import (
    _budget as budget_dev,  # the exploration risk budget, written once
)
from numbarl.rl.nets.c51_head import BranchedDuelingC51Head

_cuda = cuda()

MAX_HEADS = 16  # agent.ensemble_heads at most (RNG slots claimed for the extra heads' masks)
MASK_SLOT = RNG_STREAMS.claim("ensemble.mask", 250, width=MAX_HEADS - 1)  # + m − 1: extra head m's mask
GROUP = "head.ens"  # the one optimizer group of the extra heads
BLOCK = 128  # one row (sample or env) per thread
SIDES = (DIR_SHORT, DIR_LONG)  # score[i, 0] short, score[i, 1] long

_ZERO = np.float32(0.0)
_HALF = np.float32(0.5)
_LOWEST = np.float32(-3.4028235e38)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def bootstrap_mask_ref(seed: int, rows, n_extra: int, weights=None) -> np.ndarray:
    """w [n_extra, B]: 1{U(seed, row_b, 0, MASK_SLOT + m) < 1/2} (· weights[b]); row < 0 counts as 0."""
    rows = np.maximum(np.asarray(rows, np.int64), 0)
    out = np.zeros((int(n_extra), rows.size), np.float64)
    for m in range(int(n_extra)):
        for b, r in enumerate(rows):
            out[m, b] = 1.0 if uniform(seed, r, 0, MASK_SLOT + m) < _HALF else 0.0
    if weights is not None:
        out *= np.asarray(weights, np.float64)[None, :]
    return out


def epistemic_score_ref(dir_q) -> np.ndarray:
    """u [N, S] = population std over heads of dir_q [M, N, S]."""
    return np.asarray(dir_q, np.float64).std(axis=0)


def direction_q_ref(q_heads, actions=None) -> np.ndarray:
    """dir_q [M, N, S] from the heads' Q [M][N, n_branches, max_actions]: the two entry sides (S = 2),
    or the taken direction actions[:, 0] (S = 1)."""
    q = np.asarray(q_heads, np.float64)
    if actions is None:
        return q[:, :, 0, list(SIDES)]
    a = np.asarray(actions, np.int64)[:, 0]
    return q[:, np.arange(q.shape[1]), 0, a][:, :, None]


def gate_ref(score, flat, theta: float, budget: float = 1.0) -> np.ndarray:
    """gated [N, 2] bool (short, long): flat and budget · u > θ."""
    return np.asarray(flat, bool)[:, None] & (budget * np.asarray(score, np.float64) > float(theta))


def ensemble_c51_loss_ref(logits, actions, next_q, target_probs, rewards, dones, discounts, support, branch_sizes,
                          mask, next_mask=None):
    """(loss, d_logits) of one extra head: the C51 loss with the mask as per-sample weights (float64)."""
    from numbarl.rl.losses.c51 import c51_loss_ref

    loss, _, d_logits, _ = c51_loss_ref(logits, actions, next_q, target_probs, rewards, dones, discounts, support,
                                        branch_sizes, weights=mask, next_mask=next_mask)
    return loss, d_logits


# ---------------------------------------------------------------------------------------------
# device functions and kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def bootstrap_mask_kernel(seed, index, weights, use_weights, out):
    """out[m, b] = 1{U(seed, max(index[b], 0), 0, MASK_SLOT + m) < 1/2} (· weights[b]); one thread
    per (b, m)."""
    b = _cuda.grid(1)
    m = _cuda.blockIdx.y
    if b >= out.shape[1]:
        return
    row = max(index[b], 0)  # an unfilled sample (index −1, before the replay holds min_writes): row 0's mask
    w = _ZERO
    if uniform(seed, row, 0, MASK_SLOT + m) < _HALF:
        w = np.float32(1.0)
    if use_weights != 0:
        w = w * weights[b]
    out[m, b] = w


@_cuda.jit(cache=True)
def direction_sides_kernel(q, m, out):
    """out[m, i, s] = q[i, 0, side s] (the two entry sides); one thread per row i."""
    i = _cuda.grid(1)
    if i >= q.shape[0]:
        return
    out[m, i, 0] = q[i, 0, DIR_SHORT]
    out[m, i, 1] = q[i, 0, DIR_LONG]


@_cuda.jit(cache=True)
def direction_taken_kernel(q, actions, m, out):
    """out[m, i, 0] = q[i, 0, actions[i, 0]] (the taken direction); one thread per row i."""
    i = _cuda.grid(1)
    if i >= q.shape[0]:
        return
    out[m, i, 0] = q[i, 0, actions[i, 0]]


@_cuda.jit(device=True)
def epistemic_score_dev(dir_q, i, s):
    """Population std over the heads of dir_q[:, i, s] (float32, heads in order, two passes)."""
    n = dir_q.shape[0]
    acc = _ZERO
    for m in range(n):
        acc += dir_q[m, i, s]
    mean = acc / np.float32(n)
    var = _ZERO
    for m in range(n):
        d = dir_q[m, i, s] - mean
        var += d * d
    return math.sqrt(var / np.float32(n))


@_cuda.jit(cache=True)
def epistemic_score_kernel(dir_q, score):
    """score[i, s] = u of dir_q[:, i, s]; one thread per (i, s) (flat index i·S + s)."""
    t = _cuda.grid(1)
    n_sides = score.shape[1]
    if t >= score.shape[0] * n_sides:
        return
    i = t // n_sides
    s = t - i * n_sides
    score[i, s] = epistemic_score_dev(dir_q, i, s)


@_cuda.jit(cache=True)
def epistemic_mask_kernel(score, theta, readiness_state, use_budget, armed, obs, position_col, mask, blocked, flat,
                          budget_out):
    """The gate on the env's mask [N, n_branches, max_actions]: a flat env loses entry side s where
    budget · score[i, s] > θ; blocked[i] = 1 where it lost one, flat[i] = 1 where env i is flat;
    armed[0] == 0 (the trainer's prefill): nothing gated."""
    i = _cuda.grid(1)
    if i >= obs.shape[0]:
        return
    budget = budget_dev(readiness_state, use_budget)
    if i == 0:
        budget_out[0] = budget
    is_flat = obs[i, position_col] == _ZERO
    sides = gated_sides_dev(budget * score[i, 0], budget * score[i, 1], theta) if is_flat and armed[0] != 0 else 0
    gate_mask_dev(mask, i, sides)
    blocked[i] = 1 if sides else 0
    flat[i] = 1 if is_flat else 0


@_cuda.jit(cache=True)
def epistemic_scores_kernel(score, theta, readiness_state, use_budget, obs, position_col, q):
    """The gate on greedy scores [P, n_branches, max_actions]: gated entries scored lowest."""
    i = _cuda.grid(1)
    if i >= obs.shape[0]:
        return
    if obs[i, position_col] != _ZERO:
        return
    budget = budget_dev(readiness_state, use_budget)
    gate_scores_dev(q, i, gated_sides_dev(budget * score[i, 0], budget * score[i, 1], theta))


# ---------------------------------------------------------------------------------------------
# the extra heads, the masks, the score and the gate
# ---------------------------------------------------------------------------------------------
class EnsembleC51Head(BranchedDuelingC51Head):
    """An extra head of the ensemble: the agent's head, its parameters in the optimizer group 'head.ens'."""

    def params(self):
        return [replace(p, group=GROUP) for p in super().params()]


def make_extra_heads(n_heads: int, hidden: int, branch_sizes, n_atoms: int, v_min: float, v_max: float,
                     compute: str, pad_to: int = 1, fuse_value: bool = False) -> list[EnsembleC51Head]:
    """The M − 1 extra heads head.ens1 .. head.ens<M-1> (n_heads = M >= 2), laid out as the agent's head
    (pad_to, fuse_value: agent.head_pad, agent.head_fuse_value)."""
    if not 2 <= int(n_heads) <= MAX_HEADS:
        raise ValueError(f"agent.ensemble_heads = {n_heads}: an ensemble needs 2..{MAX_HEADS} heads (0 or 1 = off)")
    return [EnsembleC51Head(f"head.ens{m}", hidden, branch_sizes, n_atoms, v_min, v_max, compute=compute,
                            pad_to=pad_to, fuse_value=fuse_value) for m in range(1, int(n_heads))]


def bootstrap_masks(seed: int, index, out, stream, weights=None) -> None:
    """out [M − 1, B] float32: the extra heads' per-sample loss weights (module docstring)."""
    n_extra, batch = out.shape
    if index.shape != (batch,):
        raise ValueError(f"ensemble: index has shape {tuple(index.shape)}, expected ({batch},)")
    use = weights is not None
    bootstrap_mask_kernel[(launch.blocks(batch, BLOCK), n_extra), min(BLOCK, batch), stream](
        np.uint64(seed), index, weights if use else out[0], np.int32(use), out)


def direction_q(q_heads, out, stream, actions=None) -> None:
    """out [M, N, S] from the heads' Q views (head 0 first): S = 2, the two entry sides, or with
    actions [N, n_branches] S = 1, the taken direction."""
    n = out.shape[1]
    if len(q_heads) != out.shape[0]:
        raise ValueError(f"ensemble: {len(q_heads)} heads' Q for a stack of {out.shape[0]}")
    if out.shape[2] != (1 if actions is not None else 2):
        raise ValueError(f"ensemble: a direction-Q stack of shape {tuple(out.shape)} for "
                         f"{'the taken direction' if actions is not None else 'two sides'}")
    grid, block = launch.blocks(n, BLOCK), min(BLOCK, n)
    for m, q in enumerate(q_heads):
        if actions is None:
            direction_sides_kernel[grid, block, stream](q, np.int64(m), out)
        else:
            direction_taken_kernel[grid, block, stream](q, actions, np.int64(m), out)


def epistemic_score(dir_q, score, stream) -> None:
    """score [N, S] = the heads' std of dir_q [M, N, S]."""
    n = score.shape[0] * score.shape[1]
    epistemic_score_kernel[launch.blocks(n, BLOCK), min(BLOCK, n), stream](dir_q, score)


class EpistemicGate:
    """The epistemic entry gate (module docstring) over the agent's head and the extra heads.

    heads: [head 0, extras...] whose passes "act" and "eval" declare "q"; n_envs / eval_batch: the
    collect and backtest batches; position_col: the observation column of the signed position;
    readiness_state: the IQN head's device (L_first, L_ema) float64 [2], or None (budget 1); armed: the agent's
    device uint8 [1] entry-gate switch (numbarl/rl/cvar_gate.py: gate_switch), or None (one of the gate's own, on).
    """

    def __init__(self, heads, theta: float, n_envs: int, eval_batch: int, position_col: int, readiness_state=None,
                 armed=None):
        if not float(theta) > 0.0:
            raise ValueError(f"agent.epistemic_theta must be > 0 for the gate (got {theta})")
        if max(SIDES) >= heads[0].branch_sizes[0]:
            raise ValueError(f"the epistemic gate needs the direction branch's short and long actions; it has "
                             f"{heads[0].branch_sizes[0]} actions")
        self.heads, self.theta, self.position_col = list(heads), np.float32(theta), np.int64(position_col)
        m = len(self.heads)
        self.dev = Arena("agent.epistemic_gate")
        for tag, n in (("act", int(n_envs)), ("eval", int(eval_batch))):
            self.dev.add(f"dir_q.{tag}", (m, n, 2), np.float32)
            self.dev.add(f"score.{tag}", (n, 2), np.float32)
        self.dev.add("blocked", (int(n_envs),), np.uint8)
        self.dev.add("flat", (int(n_envs),), np.uint8)
        self.dev.add("budget", (1,), np.float32)
        self.dev.add("no_readiness", (2,), np.float64)
        self.dev.allocate()
        self.use_budget = readiness_state is not None
        self.readiness = readiness_state if readiness_state is not None else self.dev["no_readiness"]
        self._switch, self.armed = switch_of(armed, f"{self.dev.role}.armed")

    def _score(self, h, tag: str, stream):
        """The extra heads on the trunk output h of tag's pass (head 0 ran in it), then u of both sides."""
        for head in self.heads[1:]:
            head.forward(h, stream, tag=tag)
        dir_q, score = self.dev[f"dir_q.{tag}"], self.dev[f"score.{tag}"]
        direction_q([head.outputs(tag).q for head in self.heads], dir_q, stream)
        epistemic_score(dir_q, score, stream)
        return score

    def on_mask(self, h, obs, mask, stream, tag: str = "act") -> None:
        """After the acting pass (trunk output h [N, H]), before the policy: gated entries off the mask."""
        score = self._score(h, tag, stream)
        n = obs.shape[0]
        epistemic_mask_kernel[launch.blocks(n, BLOCK), min(BLOCK, n), stream](
            score, self.theta, self.readiness, self.use_budget, self.armed, obs, self.position_col, mask,
            self.dev["blocked"], self.dev["flat"], self.dev["budget"])

    def on_scores(self, h, obs, q, stream, tag: str = "eval") -> None:
        """After the evaluation pass (trunk output h [P, H]): gated entries scored lowest in q."""
        score = self._score(h, tag, stream)
        n = obs.shape[0]
        epistemic_scores_kernel[launch.blocks(n, BLOCK), min(BLOCK, n), stream](
            score, self.theta, self.readiness, self.use_budget, obs, self.position_col, q)

    def write_stats(self, stats, slots, stream) -> None:
        """epistemic_blocked_frac, epistemic_score_mean, epistemic_budget of the last collect step into
        stats[slots] (the CVaR gate's fixed-order one-block kernel: blocked / flat, mean over envs and sides)."""
        cvar_stats_kernel[1, STATS_BLOCK, stream](self.dev["score.act"], self.dev["blocked"], self.dev["flat"],
                                                  self.dev["budget"], stats, np.int64(slots[0]), np.int64(slots[1]),
                                                  np.int64(slots[2]))


__all__ = ["EnsembleC51Head", "EpistemicGate", "bootstrap_mask_ref", "bootstrap_masks", "budget_ref", "direction_q",
           "epistemic_score", "epistemic_score_ref", "gate_ref", "make_extra_heads"]
