"""Recursive-confidence head (issue 14 item 8, ../shared COMPONENTS A6): one logit per state on the shared
trunk's features, c(s) = σ(z(s)), trained by binary cross-entropy against a bootstrapped target
(numbarl/rl/losses/confidence.py, where the math of the target lives).

For the trunk output h [B, H]:

    z[b] = h[b, :]·w + b_c                Linear "fc" (H → 1, no activation)   [B, 1]
    c[b] = σ(z[b])                        in the loss / gate kernels, never stored by the head

The head outputs the LOGIT z, not c: the loss takes the cross-entropy from logits (the numerically
stable form softplus(z) − y·z, whose gradient is σ(z) − y), so the head needs no sigmoid kernel of its
own and its backward is exactly numbarl's Linear backward. Backward from dz [B, 1]:

    dw = hᵀ·dz,  db_c = colsum(dz)  (cuBLASLt bgrad epilogue / numbarl.cuda.reduce.col_sum: fixed order)
    dh = dz·wᵀ                      (input gradient on: with backward(dz, s, tag, dx_out=dh_shared) the GEMM
                                     adds it, beta = 1, into the buffer the C51 head wrote first: the
                                     gradient ledger of numbarl/rl/nets/module.py)

One :class:`Linear` in a :class:`Sequential` (the IQL value head's pattern, numbarl/rl/nets/iql_value.py),
so the float64 reference is the layer's reference. No float atomics anywhere.

The use (agent.confidence_floor > 0): :class:`ConfidenceGate`, a selectivity gate on new entries in the
manner of numbarl/rl/cvar_gate.py. Where env i is flat (its observation's position column is 0) and

    σ(z_i) < agent.confidence_floor        (z_i the head on the acting / evaluation pass's trunk output)

its entries (direction short and long) are taken away: off the greedy choice's copy of the env's mask in the
collect step (after the acting pass, before the policy; exploration draws from the env's own mask, and the
replay stores the greedy choice's: numbarl/rl/cvar_gate.py) and
scored lowest in the backtest's greedy scores (agent.scores). Holding, exits and the other branches are
never gated. Thread mapping: one thread per env (policy); the diagnostics' share of gated envs is a
fixed-order mean (numbarl.cuda.reduce.Reducer).

Parameters (optimizer group ``head.conf`` unless given): ``{name}.fc.w`` [H, 1] (kaiming-uniform, weight
decay), ``{name}.fc.b`` [1] (no decay). Buffers per tag: the layer's own (``{name}.fc.{tag}.y`` is z).
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda import launch
from numbarl.cuda.runtime import Arena, cuda
from numbarl.env.params import BR_DIRECTION, DIR_LONG, DIR_SHORT
from numbarl.rl.cvar_gate import switch_of
from numbarl.rl.nets.linear import Linear
from numbarl.rl.nets.module import Sequential

_cuda = cuda()  # the backend (GPU or simulator), selected once

GATE_BLOCK = 128  # one env (policy) per thread
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_LOWEST = np.float32(-3.4028235e38)


def sigmoid_ref(z):
    """σ(z) = 1 / (1 + e^{−z}) in float64, stable for large |z|."""
    z = np.asarray(z, np.float64)
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


class LogitHead(Sequential):
    """One logit per state, z(s) = h·w + b [B, 1] on the trunk features h [B, H] (one Linear "{name}.fc", its
    input gradient on): the confidence head's and the risk-budget head's (numbarl/rl/nets/risk_head.py)."""

    default_group = "head.logit"

    def __init__(self, name: str, in_dim: int, group: str | None = None, compute: str = "fp32"):
        self.in_dim = int(in_dim)
        if self.in_dim < 1:
            raise ValueError(f"{name}: in_dim must be >= 1 (got {in_dim})")
        group = group or self.default_group or name
        super().__init__(name, [Linear(f"{name}.fc", self.in_dim, 1, None, group=group, input_grad=True,
                                       compute=compute)], group)

    @property
    def out_dim(self) -> int:
        return 1


class ConfidenceHead(LogitHead):
    """z(s) = h·w + b [B, 1] on the trunk features h [B, H]; c(s) = σ(z) (module docstring)."""

    default_group = "head.conf"


# ---------------------------------------------------------------------------------------------
# the use: the selectivity gate on new entries (agent.confidence_floor)
# ---------------------------------------------------------------------------------------------
def gate_ref(z, obs, position_col: int, floor: float) -> np.ndarray:
    """gated [N] bool: env i flat (obs[i, position_col] == 0) and σ(z_i) < floor."""
    c = sigmoid_ref(np.asarray(z, np.float64).reshape(-1))
    return (np.asarray(obs)[:, position_col] == 0) & (c < float(floor))


def apply_mask_ref(mask, gated) -> np.ndarray:
    """The env's mask with the gated envs' entries (direction short and long) taken away."""
    out = np.array(mask, copy=True)
    for a in (DIR_SHORT, DIR_LONG):
        out[:, BR_DIRECTION, a] = np.where(gated, 0, out[:, BR_DIRECTION, a])
    return out


def apply_scores_ref(q, gated) -> np.ndarray:
    """The greedy scores with the gated envs' entries at the lowest float32."""
    out = np.array(q, copy=True)
    for a in (DIR_SHORT, DIR_LONG):
        out[:, BR_DIRECTION, a] = np.where(gated, _LOWEST, out[:, BR_DIRECTION, a])
    return out


@_cuda.jit(device=True, inline=True)
def _gated_dev(z, obs, i, position_col, floor):
    """σ(z[i, 0]) < floor where env i is flat (the loss module's stable sigmoid, e^{−|z|} only)."""
    if obs[i, position_col] != _ZERO:
        return False
    zi = z[i, 0]
    if zi >= _ZERO:
        c = _ONE / (_ONE + math.exp(-zi))
    else:
        e = math.exp(zi)
        c = e / (_ONE + e)
    return c < floor


@_cuda.jit(cache=True)
def confidence_mask_kernel(z, obs, position_col, floor, armed, mask, gated):
    """One thread per env: a gated env's entries off its mask [N, n_branches, max_actions]; gated[i] = 0 / 1;
    armed[0] == 0 (the trainer's prefill): nothing gated."""
    i = _cuda.grid(1)
    if i >= obs.shape[0]:
        return
    if armed[0] != 0 and _gated_dev(z, obs, i, position_col, floor):
        mask[i, BR_DIRECTION, DIR_SHORT] = 0
        mask[i, BR_DIRECTION, DIR_LONG] = 0
        gated[i] = _ONE
    else:
        gated[i] = _ZERO


@_cuda.jit(cache=True)
def confidence_scores_kernel(z, obs, position_col, floor, q):
    """One thread per policy: a gated policy's entries scored lowest in q [P, n_branches, max_actions]."""
    i = _cuda.grid(1)
    if i >= obs.shape[0]:
        return
    if _gated_dev(z, obs, i, position_col, floor):
        q[i, BR_DIRECTION, DIR_SHORT] = _LOWEST
        q[i, BR_DIRECTION, DIR_LONG] = _LOWEST


class ConfidenceGate:
    """No new entry where the confidence head says c(s) < floor (module docstring). head: the
    :class:`ConfidenceHead` whose passes "act" and "eval" are declared (backward=False); position_col: the
    observation column of the signed position; armed: the agent's device uint8 [1] entry-gate switch
    (numbarl/rl/cvar_gate.py: gate_switch), or None (one of the gate's own, on)."""

    def __init__(self, head: ConfidenceHead, floor: float, n_envs: int, position_col: int, armed=None):
        if not 0.0 < float(floor) < 1.0:
            raise ValueError(f"agent.confidence_floor must be in (0, 1) for the gate (got {floor})")
        self.head, self.floor, self.position_col = head, np.float32(floor), np.int64(position_col)
        self.dev = Arena("agent.confidence_gate")
        self.dev.add("gated", (int(n_envs),), np.float32)
        self.dev.allocate()
        self._switch, self.armed = switch_of(armed, f"{self.dev.role}.armed")

    @property
    def gated(self):
        """Device float32 [N]: 1 where the last collect step gated env i's entries."""
        return self.dev["gated"]

    def on_mask(self, h, obs, mask, stream, tag: str = "act") -> None:
        """After the acting pass (trunk output h [N, H]), before the policy: gated entries off the mask."""
        z = self.head.forward(h, stream, tag=tag)
        n = obs.shape[0]
        confidence_mask_kernel[launch.blocks(n, GATE_BLOCK), min(GATE_BLOCK, n), stream](
            z, obs, self.position_col, self.floor, self.armed, mask, self.dev["gated"])

    def on_scores(self, h, obs, q, stream, tag: str = "eval") -> None:
        """After the evaluation pass (trunk output h [P, H]): gated entries scored lowest in q."""
        z = self.head.forward(h, stream, tag=tag)
        n = obs.shape[0]
        confidence_scores_kernel[launch.blocks(n, GATE_BLOCK), min(GATE_BLOCK, n), stream](
            z, obs, self.position_col, self.floor, q)
