"""Freeze detector (host, between epochs): Q statistics that stop moving while gradients do not.

A learner can sit at a fixed point where the logged gradient norm stays large (often pinned at the
clip threshold, agent.max_grad_norm) while the Q statistics do not change from epoch to epoch: Adam's
moments have converged to a state that cancels the updates. The detector is fed one record per epoch
(the epoch's last train record of metrics.jsonl, or any dict with the same keys)::

    det = FreezeDetector.from_config(cfg.agent)
    for each epoch:
        if det.update(record):          # True on the epoch the freeze is detected
            agent.on_freeze(stream)      # agent.freeze_reset: zero the Adam moments of 'head.adv'

Rule: with Δx the change of x from the previous record, an epoch is *frozen* when

    |Δ q_mean| < ε,  |Δ q_std| < ε,  |Δ u| < ε   and   grad_norm >= g_min

(u = the atom-utilisation key, by default the diagnostics' `atom_utilization`). The detector fires
when k consecutive epochs are frozen (k = agent.freeze_epochs, 4 by default), then starts counting
again from zero: a freeze that persists fires again after k more frozen epochs, not every epoch.
The first record only sets the reference (it has no Δ). A record missing a key, or with a
non-finite value, breaks the streak (it proves nothing either way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT_KEYS = ("q_mean", "q_std", "atom_utilization")


@dataclass
class FreezeDetector:
    eps: float = 1e-4
    """largest |Δ| per epoch of each watched statistic that still counts as 'not moving'"""
    epochs: int = 4
    """consecutive frozen epochs before firing (k)"""
    grad_min: float = 1.0
    """smallest gradient norm at which a still Q counts as a freeze (a zero gradient is convergence)"""
    keys: tuple = DEFAULT_KEYS
    """the statistics that must all stand still"""
    grad_key: str = "grad_norm"
    """the gradient-norm key of the record"""
    streak: int = 0
    fired: int = 0
    _last: dict | None = field(default=None, repr=False)

    def __post_init__(self):
        if not self.eps > 0.0 or self.epochs < 1 or not self.grad_min >= 0.0:
            raise ValueError(f"FreezeDetector needs eps > 0, epochs >= 1, grad_min >= 0 (got {self.eps}, "
                             f"{self.epochs}, {self.grad_min})")

    @classmethod
    def from_config(cls, agent_cfg) -> "FreezeDetector":
        """The detector of an AgentConfig (agent.freeze_eps, freeze_epochs, freeze_grad_min); the
        utilisation key is the controller's EMA when agent.atom_entropy_max > 0."""
        u = "atom_utilization_ema" if getattr(agent_cfg, "atom_entropy_max", 0.0) > 0 else "atom_utilization"
        return cls(eps=agent_cfg.freeze_eps, epochs=agent_cfg.freeze_epochs, grad_min=agent_cfg.freeze_grad_min,
                   keys=("q_mean", "q_std", u))

    def frozen_epoch(self, record: dict) -> bool | None:
        """Whether `record` is a frozen epoch relative to the previous one (None: no previous record
        or a missing / non-finite value)."""
        values = {k: record.get(k) for k in (*self.keys, self.grad_key)}
        if any(v is None or not math.isfinite(float(v)) for v in values.values()):
            return None
        if self._last is None:
            return None
        still = all(abs(float(values[k]) - float(self._last[k])) < self.eps for k in self.keys)
        return still and float(values[self.grad_key]) >= self.grad_min

    def update(self, record: dict) -> bool:
        """Feed one epoch's record; True when this epoch completes k consecutive frozen epochs."""
        frozen = self.frozen_epoch(record)
        values = {k: record.get(k) for k in (*self.keys, self.grad_key)}
        ok = all(v is not None and math.isfinite(float(v)) for v in values.values())
        self._last = values if ok else None
        self.streak = self.streak + 1 if frozen else 0
        if self.streak >= self.epochs:
            self.streak = 0
            self.fired += 1
            return True
        return False

    def state_dict(self) -> dict:
        """The detector's memory (JSON-ready) for a checkpoint: a resumed run detects as the uninterrupted one."""
        return {"streak": int(self.streak), "last": None if self._last is None else {k: float(v) for k, v in self._last.items()}}

    def load_state_dict(self, d: dict | None) -> None:
        if d:
            self.streak, self._last = int(d.get("streak", 0)), d.get("last")

    def reset(self) -> None:
        self.streak, self._last = 0, None
