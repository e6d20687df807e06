"""CVaR entry gate: no entry on a side whose predicted lower tail is too heavy (agent.cvar_alpha).

From the C51 head's distribution of the direction branch at the short and long actions
(probabilities p_z = softmax over the atoms of the head's logits, support z_0 < ... < z_{Z-1}),
the conditional value at risk at tail level α (Rockafellar & Uryasev 2000; Acerbi & Tasche 2002,
the mean of the lowest α of the distribution, the boundary atom taken fractionally):

    CVaR_α = (1/m) Σ_z w_z z_z,  w_z = min(p_z, α − Σ_{z' < z} w_z'),  m = Σ_z w_z   (m = α exactly
                                                                           unless Σ p < α by rounding)

e.g. atoms (−1, 1) with p = (0.3, 0.7): CVaR_0.1 = −1, CVaR_0.5 = (0.3·(−1) + 0.2·1) / 0.5 = −0.2.

The gate: where env i is flat (its observation's position column is 0), an entry side s ∈ {short,
long} is taken away when

    budget · CVaR_α(s) < −agent.cvar_floor            (cvar_floor in reward units, >= 0)

budget is the exploration risk budget: 1 without an IQN readiness; with agent.iqn on, readiness²
with readiness = clip(1 − L_ema / L_first, 0, 1) read on the device from the IQN head's readiness
state (numbarl/rl/losses/quantile_huber.py, `iqn_readiness_kernel`; 0 before its first step). The
readiness rises from 0 to 1 as the quantile loss falls, so the gate is loose while the agent
explores (budget 0: no entry is gated) and reaches its full strength, CVaR_α < −floor, as the
distributional heads converge. (Written as a product so budget 0 needs no division: it is the
threshold CVaR_α < −floor / budget.) Holding and exits are never gated. The same ρ scales the env's
Kelly size cap and DSR reward term (numbarl/env/core.py): `risk_budget_kernel` writes it into the
float32 [1] the env step reads (the DQN agent's collect step, agent.iqn).

Where it acts (as the E9 gate of numbarl/rl/feedback/kernels.py does):
* collect: on a copy of the env's mask that only the greedy choice reads (the agent's
  `gate_switch` arena, "greedy_mask"), after the acting pass and before the policy chooses; the
  exploratory draws of ε-greedy take the env's own mask, so a gate never takes an entry away from
  exploration, and the replay stores the greedy choice's mask (its next-state masks are what a
  lock-aware target reads). Not over the trainer's replay prefill (the switch, off until the first
  train step). Why exploration is left ungated (eighteenth session, docs/RESULTS.md): with the gate
  on exploration as well, a gate that closes every entry early (an untrained, wide distribution)
  leaves only zero returns in the replay; the IQN loss on them settles, the readiness climbs to ~1,
  the budget with it, and the gate stays shut: five of five seeds traded nothing in validation for
  their first five to eight epochs;
* backtests: on the greedy scores (agent.scores), the gated entries' Q set to the lowest float32.

Probabilities without a probs output: the acting ("act") and evaluation ("eval") passes declare
only "q" (which also stores the row log-sum-exp, lse). Declaring "probs" there would store
[N, n_branches, max_actions, Z] floats per step (N = 65,536, branches (3, 3, 4, 4), Z = 51:
214 MB of stores per collect step; not measured). The gate instead recomputes the direction
branch's two rows from what the pass already keeps: the value and advantage GEMM outputs and lse,
x_z = A[a, z] + V[z] − (Σ_a' A[a', z]) · (1/A_0), p_z = exp(x_z − lse) — the arithmetic of the head
kernel (numbarl/rl/nets/c51_head.py), in the same order.

Thread mapping: `cvar_mask_kernel` / `cvar_scores_kernel`, one thread per env (policy), two rows
of Z atoms each; `cvar_stats_kernel` (diagnostics, log intervals only) one block, fixed-order
sums of the last collect step's per-env results: ``cvar_blocked_frac`` (share of the flat envs
with an entry gated), ``cvar_mean`` (mean over envs of the two sides' CVaR), ``cvar_budget``.
No atomics.
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda import launch
from numbarl.cuda.runtime import Arena, cuda
from numbarl.env.params import DIR_LONG, DIR_SHORT

_cuda = cuda()

BLOCK = 128  # one env per thread
STATS_BLOCK = launch.shape(gpu=256, sim=8)

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_LOWEST = np.float32(-3.4028235e38)
SIDES = (DIR_SHORT, DIR_LONG)  # cvar[i, 0] short, cvar[i, 1] long


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def cvar_ref(probs, support, alpha: float) -> np.ndarray:
    """CVaR_α over the last axis of probs [..., Z] on an ascending support [Z] (module docstring)."""
    p = np.asarray(probs, np.float64)
    z = np.asarray(support, np.float64)
    flat = p.reshape(-1, p.shape[-1])
    out = np.empty(flat.shape[0])
    for r, row in enumerate(flat):
        m = acc = 0.0
        for pz, zz in zip(row, z):
            if m >= alpha:
                break
            take = min(pz, alpha - m)
            acc += take * zz
            m += take
        out[r] = acc / m if m > 0 else z[0]
    return out.reshape(p.shape[:-1])


def budget_ref(readiness_state=None) -> float:
    """1 without IQN; readiness² from (L_first, L_ema) otherwise (0 before the first IQN step)."""
    if readiness_state is None:
        return 1.0
    first, ema = float(readiness_state[0]), float(readiness_state[1])
    r = min(max(1.0 - ema / first, 0.0), 1.0) if first > 0 else 0.0
    return r * r


def gate_ref(cvar, flat, alpha_floor: float, budget: float = 1.0) -> np.ndarray:
    """gated [N, 2] bool (short, long): flat and budget · CVaR < −floor."""
    cvar = np.asarray(cvar, np.float64)
    return np.asarray(flat, bool)[:, None] & (budget * cvar < -float(alpha_floor))


def apply_mask_ref(mask, gated) -> np.ndarray:
    """The env's mask with the gated entries taken away (direction branch)."""
    out = np.array(mask, copy=True)
    for s, a in enumerate(SIDES):
        out[:, 0, a] = np.where(gated[:, s], 0, out[:, 0, a])
    return out


def apply_scores_ref(q, gated) -> np.ndarray:
    """The greedy scores with the gated entries at the lowest float32."""
    out = np.array(q, copy=True)
    for s, a in enumerate(SIDES):
        out[:, 0, a] = np.where(gated[:, s], _LOWEST, out[:, 0, a])
    return out


# ---------------------------------------------------------------------------------------------
# device functions and kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(device=True)
def side_cvar(value, adv, lse, support, i, action, n0, inv_n0, alpha):
    """CVaR_α of row (i, direction branch, action) from the pass's V [N, Z], A [N, ΣA·Z], lse."""
    n_atoms = support.shape[0]
    log_norm = lse[i, 0, action]
    m = _ZERO
    acc = _ZERO
    for z in range(n_atoms):
        if m >= alpha:
            break
        s = _ZERO
        for a in range(n0):
            s += adv[i, a * n_atoms + z]
        base = value[i, z] - s * inv_n0
        p = math.exp(adv[i, action * n_atoms + z] + base - log_norm)
        take = min(p, alpha - m)
        acc += take * support[z]
        m += take
    if m > _ZERO:
        return acc / m
    return support[0]


@_cuda.jit(device=True)
def _budget(readiness_state, use_budget):
    if not use_budget:
        return _ONE
    r = 0.0
    if readiness_state[0] > 0.0:
        r = min(max(1.0 - readiness_state[1] / readiness_state[0], 0.0), 1.0)
    return np.float32(r * r)


@_cuda.jit(device=True)
def gated_sides_dev(x_short, x_long, threshold):
    """The entry gates' common test: bit 0 (short) and bit 1 (long) set where the side's score x
    (scaled by the budget and signed so that larger is worse) exceeds the threshold. The CVaR gate
    passes x = −budget·CVaR with threshold = floor (budget·CVaR < −floor: negation is exact, the
    same comparison), the epistemic gate x = budget·score with θ (numbarl/rl/nets/ensemble.py)."""
    return (1 if x_short > threshold else 0) | (2 if x_long > threshold else 0)


@_cuda.jit(device=True)
def gate_mask_dev(mask, i, sides):
    """Collect step: the gated entry sides of env i off its mask [N, n_branches, max_actions]."""
    if sides & 1:
        mask[i, 0, DIR_SHORT] = 0
    if sides & 2:
        mask[i, 0, DIR_LONG] = 0


@_cuda.jit(device=True)
def gate_scores_dev(q, i, sides):
    """Backtest: the gated entry sides of policy i scored lowest in its greedy scores."""
    if sides & 1:
        q[i, 0, DIR_SHORT] = _LOWEST
    if sides & 2:
        q[i, 0, DIR_LONG] = _LOWEST


@_cuda.jit(cache=True)
def risk_budget_kernel(readiness_state, risk_budget, stats, slot):
    """risk_budget[0] = stats[slot] = ρ = readiness² (one thread, once per collect step, before the
    env step that reads it: the exploration risk budget of the Kelly cap and the DSR term). A
    non-finite readiness state (a NaN IQN loss, first or later) gives ρ = 1: the configured protection,
    never none. Before the first aux step (L_first < 0) ρ = 0: the prefill trades uncapped."""
    if _cuda.grid(1) == 0:
        finite = math.isfinite(readiness_state[0]) and math.isfinite(readiness_state[1])
        rho = _budget(readiness_state, True) if finite else _ONE
        risk_budget[0] = rho
        stats[slot] = rho


@_cuda.jit(cache=True)
def cvar_mask_kernel(value, adv, lse, support, n0, inv_n0, alpha, floor, readiness_state, use_budget, armed, obs,
                     position_col, mask, cvar, blocked, flat, budget_out):
    """The gate on the env's mask [N, n_branches, max_actions] (module docstring); per env the two
    CVaRs, blocked[i] = 1 where a flat env's entry was gated, flat[i] = 1 where env i is flat;
    armed[0] == 0 (the trainer's prefill): nothing gated."""
    i = _cuda.grid(1)
    if i >= obs.shape[0]:
        return
    budget = _budget(readiness_state, use_budget)
    if i == 0:
        budget_out[0] = budget
    is_flat = obs[i, position_col] == _ZERO
    c_short = side_cvar(value, adv, lse, support, i, DIR_SHORT, n0, inv_n0, alpha)
    c_long = side_cvar(value, adv, lse, support, i, DIR_LONG, n0, inv_n0, alpha)
    cvar[i, 0] = c_short
    cvar[i, 1] = c_long
    sides = gated_sides_dev(-(budget * c_short), -(budget * c_long), floor) if is_flat and armed[0] != 0 else 0
    gate_mask_dev(mask, i, sides)
    blocked[i] = 1 if sides else 0
    flat[i] = 1 if is_flat else 0


@_cuda.jit(cache=True)
def cvar_scores_kernel(value, adv, lse, support, n0, inv_n0, alpha, floor, readiness_state, use_budget, obs,
                       position_col, q):
    """The gate on greedy scores [P, n_branches, max_actions]: gated entries scored lowest."""
    i = _cuda.grid(1)
    if i >= obs.shape[0]:
        return
    if obs[i, position_col] != _ZERO:
        return
    budget = _budget(readiness_state, use_budget)
    c_short = side_cvar(value, adv, lse, support, i, DIR_SHORT, n0, inv_n0, alpha)
    c_long = side_cvar(value, adv, lse, support, i, DIR_LONG, n0, inv_n0, alpha)
    gate_scores_dev(q, i, gated_sides_dev(-(budget * c_short), -(budget * c_long), floor))


@_cuda.jit(cache=True)
def cvar_stats_kernel(cvar, blocked, flat, budget, stats, slot_frac, slot_mean, slot_budget):
    """ONE block, fixed order: blocked / flat envs, the mean CVaR over envs and sides, the budget."""
    sb = _cuda.shared.array(STATS_BLOCK, np.float32)
    sf = _cuda.shared.array(STATS_BLOCK, np.float32)
    sc = _cuda.shared.array(STATS_BLOCK, np.float32)
    tid = _cuda.threadIdx.x
    n = cvar.shape[0]
    ab = _ZERO
    af = _ZERO
    ac = _ZERO
    for i in range(tid, n, STATS_BLOCK):
        ab += np.float32(blocked[i])
        af += np.float32(flat[i])
        ac += cvar[i, 0] + cvar[i, 1]
    sb[tid] = ab
    sf[tid] = af
    sc[tid] = ac
    _cuda.syncthreads()
    width = STATS_BLOCK // 2
    while width > 0:
        if tid < width:
            sb[tid] += sb[tid + width]
            sf[tid] += sf[tid + width]
            sc[tid] += sc[tid + width]
        _cuda.syncthreads()
        width //= 2
    if tid == 0:
        stats[slot_frac] = sb[0] / sf[0] if sf[0] > _ZERO else _ZERO
        stats[slot_mean] = sc[0] / np.float32(2 * n)
        stats[slot_budget] = budget[0]


# ---------------------------------------------------------------------------------------------
# the gate
# ---------------------------------------------------------------------------------------------
def gate_switch(role: str = "agent.entry_gates", mask_shape=None) -> Arena:
    """The arena of a device uint8 [1] entry-gate switch, "armed", on (1). The mask kernels of the CVaR, epistemic and confidence
    gates read it in the collect step (a captured graph), so the trainer can turn the gates off over the
    replay's prefill and on for the training that follows without a second capture (DQNAgent.arm_entry_gates:
    an untrained head's gate would take the random prefill's entries away, and the value support is fitted to
    the prefill's returns). The backtest's score kernels do not read it: a backtest is always gated.
    mask_shape (N, n_branches, max_actions): also "greedy_mask" uint8 of that shape, the collect step's copy of
    the env's mask that the gates narrow for the greedy choice (exploration draws from the env's own)."""
    arena = Arena(role)
    arena.add("armed", (1,), np.uint8)
    if mask_shape is not None:
        arena.add("greedy_mask", tuple(int(d) for d in mask_shape), np.uint8)
    arena.allocate()
    arena.load({"armed": np.ones(1, np.uint8)})
    return arena


def switch_of(armed, role: str):
    """(owner, view) of an entry gate's switch: the agent's shared device uint8 [1] `armed` (owner None), or
    without one a switch of the gate's own, on (`gate_switch(role)`, kept by the gate so its memory lives)."""
    if armed is not None:
        return None, armed
    own = gate_switch(role)
    return own, own["armed"]


class CvarGate:
    """The CVaR entry gate of one C51 head (module docstring).

    head: numbarl.rl.nets.c51_head.BranchedDuelingC51Head whose passes "act" and "eval" declare
    "q" (value, adv and lse are read); n_envs: the collect batch; position_col: the observation
    column of the signed position; readiness_state: the IQN head's device (L_first, L_ema) float64
    [2], or None (budget 1); armed: the agent's device uint8 [1] entry-gate switch (`gate_switch`), or
    None (a switch of the gate's own, on).
    """

    def __init__(self, head, alpha: float, floor: float, n_envs: int, position_col: int, readiness_state=None,
                 armed=None):
        if not 0.0 < float(alpha) <= 1.0:
            raise ValueError(f"agent.cvar_alpha must be in (0, 1] for the gate (got {alpha})")
        if float(floor) < 0.0:
            raise ValueError(f"agent.cvar_floor must be >= 0 (got {floor})")
        if max(SIDES) >= head.branch_sizes[0]:
            raise ValueError(f"the CVaR gate needs the direction branch's short and long actions; it has "
                             f"{head.branch_sizes[0]} actions")
        self.head = head
        self.alpha, self.floor = np.float32(alpha), np.float32(floor)
        self.n0 = np.int64(head.branch_sizes[0])
        self.inv_n0 = np.float32(1.0 / np.float64(head.branch_sizes[0]))  # the head's branch_inv_sizes[0]
        self.position_col = np.int64(position_col)
        self.dev = Arena("agent.cvar_gate")
        self.dev.add("cvar", (int(n_envs), 2), np.float32)
        self.dev.add("blocked", (int(n_envs),), np.uint8)
        self.dev.add("flat", (int(n_envs),), np.uint8)
        self.dev.add("budget", (1,), np.float32)
        self.dev.add("no_readiness", (2,), np.float64)
        self.dev.allocate()
        self.use_budget = readiness_state is not None
        self.readiness = readiness_state if readiness_state is not None else self.dev["no_readiness"]
        self._switch, self.armed = switch_of(armed, f"{self.dev.role}.armed")

    def _pass(self, tag: str):
        head = self.head
        value, adv = head.pass_views(tag)  # the head's V and A (A's rows may be padded, V a view of them)
        return value, adv, head._arena(tag)[head._buf_name(tag, "lse")]

    def on_mask(self, obs, mask, stream, tag: str = "act") -> None:
        """After the acting pass of tag, before the policy: gated entries off the env's mask."""
        value, adv, lse = self._pass(tag)
        n = obs.shape[0]
        cvar_mask_kernel[launch.blocks(n, BLOCK), min(BLOCK, n), stream](
            value, adv, lse, self.head.support, self.n0, self.inv_n0, self.alpha, self.floor, self.readiness,
            self.use_budget, self.armed, obs, self.position_col, mask, self.dev["cvar"], self.dev["blocked"],
            self.dev["flat"], self.dev["budget"])

    def on_scores(self, obs, q, stream, tag: str = "eval") -> None:
        """After the evaluation pass of tag: gated entries scored lowest in the greedy scores q."""
        value, adv, lse = self._pass(tag)
        n = obs.shape[0]
        cvar_scores_kernel[launch.blocks(n, BLOCK), min(BLOCK, n), stream](
            value, adv, lse, self.head.support, self.n0, self.inv_n0, self.alpha, self.floor, self.readiness,
            self.use_budget, obs, self.position_col, q)

    def write_stats(self, stats, slots, stream) -> None:
        """cvar_blocked_frac, cvar_mean, cvar_budget of the last collect step into stats[slots]."""
        cvar_stats_kernel[1, STATS_BLOCK, stream](self.dev["cvar"], self.dev["blocked"], self.dev["flat"],
                                                  self.dev["budget"], stats, np.int64(slots[0]), np.int64(slots[1]),
                                                  np.int64(slots[2]))
