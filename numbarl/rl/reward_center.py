"""Reward centering (agent.reward_centering = β > 0): the learning side of Q-mean centering.

Why: a persistent mean reward r̄ (the holding cost paid every bar, a long lean on a drifting market) puts a
constant r̄/(1 − γ) into every value, and the Q-mean drifts with r̄'s estimate as the policy changes (the
origin's "Q-mean drifts 0→+0.47 (bootstrapping bias)"; numbarl logs it as q_mean). The values the policy ranks
differ by far less than that offset, and the C51 support must hold the offset too. Simple reward centering
(Naik, Wan, Tomar & Sutton 2024, "Reward Centering", RLC, Eq. 3 with the simple update) learns on r − r̄ with
r̄ a running average of the rewards, which removes the offset from every value.

In numbarl's replay learner, in the SAMPLE phase of every train step, after the replay drew the batch:

    m      = mean over the batch of the first reward r_τ of each sampled window (the replay's reward at the
             sampled row; the fixed-order flat mean of numbarl/cuda/reduce.py)
    r̄     ← r̄ + β (m − r̄)                                   float64 state, r̄ = 0 before the first step
    R̃_n   = R_n − r̄ · Σ_{k<m} γ^k = R_n − (r̄ / (1 − γ)) · (1 − γ^m)

for the batch's main window and every extra horizon (γ^m is each window's own discount, γ the replay's
current one: E3 may move it). That is E1's offset kernel (numbarl/rl/feedback/kernels.py) with offset
r̄/(1 − γ). E1 measures the greedy Q against the realized, uncentered returns, so it would read the centering's
shift as a bias and undo it: the configuration refuses the two together. Every bootstrapped value then shifts by −r̄/(1 − γ) and the greedy
ranking of one state's actions is untouched (the shift is the same for all of them).

The selection side of the origin's component (subtract each branch's mean Q over the batch before choosing) is
not built: argmax and the Q gap are shift-invariant, so it would change no action.

Stats (liveness key): ``reward_center`` = r̄ after the step's update; ``reward_center_offset`` = r̄/(1 − γ).
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda.reduce import Reducer
from numbarl.cuda.runtime import Arena, cuda
from numbarl.rl.feedback.kernels import offset_every_window, reward_offset_ref

_cuda = cuda()  # the backend (GPU or simulator), selected once

RATE_MAX = 1.0
_ZERO = np.float32(0.0)
_ONE64 = np.float64(1.0)


# ---------------------------------------------------------------------------------------------
# reference (float64)
# ---------------------------------------------------------------------------------------------
def center_ref(reward_store, index, rbar: float, beta: float, gamma: float, windows):
    """One step of the module docstring in float64: (new r̄, offset, the centered returns of each window).

    reward_store [n_slots, N] (the replay's rewards), index [B] (slot·N + env, −1 for an empty row: its reward
    counts as 0 in the mean, as the kernel's gather writes it), windows: a list of (R [B], discount [B])."""
    flat = np.asarray(reward_store, np.float64).reshape(-1)
    index = np.asarray(index)
    first = np.where(index >= 0, flat[np.maximum(index, 0)], 0.0)
    rbar = float(rbar) + float(beta) * (float(np.mean(first)) - float(rbar))
    offset = rbar / (1.0 - float(gamma))
    return rbar, offset, [reward_offset_ref(r, d, offset) for r, d in windows]


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def first_reward_kernel(reward_flat, index, out):
    """out[b] = the replay's reward at the sampled row index[b] (0 for an empty row, index −1)."""
    b = _cuda.grid(1)
    if b < out.shape[0]:
        i = index[b]
        out[b] = reward_flat[i] if i >= 0 else _ZERO


@_cuda.jit(cache=True)
def center_update_kernel(mean, state, beta, gamma, offset, stats, slot_rbar, slot_offset):
    """One thread: r̄ ← r̄ + β (mean − r̄) in float64 (state[0]; state[1] counts the updates), offset[0] = the
    float32 of r̄ / (1 − γ), and the two stats."""
    if _cuda.grid(1) == 0:
        rbar = state[0] + beta * (np.float64(mean[0]) - state[0])
        state[0] = rbar
        state[1] += _ONE64
        off = np.float32(rbar / (_ONE64 - np.float64(gamma[0])))
        offset[0] = off
        stats[slot_rbar] = np.float32(rbar)
        stats[slot_offset] = off


# ---------------------------------------------------------------------------------------------
# the component
# ---------------------------------------------------------------------------------------------
class RewardCenter:
    """``apply(replay, stream)`` after ``replay.sample``: updates r̄ from the batch and centers the batch's
    returns in place (module docstring). ``state_arrays`` / ``load_state`` carry r̄ through a checkpoint."""

    def __init__(self, batch: int, beta: float, slot_rbar: int, slot_offset: int):
        if not 0.0 < float(beta) <= RATE_MAX:
            raise ValueError(f"reward centering: the rate β must be in (0, {RATE_MAX}], got {beta}")
        self.beta = np.float64(beta)
        self.slots = (np.int64(slot_rbar), np.int64(slot_offset))
        self.arena = Arena("agent.reward_center")
        self.arena.add("first", (int(batch),), np.float32)
        self.arena.add("mean", (1,), np.float32)
        self.arena.add("offset", (1,), np.float32)
        self.arena.add("state", (2,), np.float64)  # r̄, updates
        self.arena.allocate()
        self.reducer = Reducer(int(batch))

    def apply(self, replay, stats, stream) -> None:
        """Capturable: the launches only (the gather, the fixed-order mean, the update, one offset per window)."""
        batch, a = replay.batch, self.arena
        n = batch.reward.shape[0]
        if n != a["first"].shape[0]:
            raise ValueError(f"reward centering: planned for a batch of {a['first'].shape[0]}, got {n}")
        first_reward_kernel[(n + 255) // 256, 256, stream](replay.store["reward"].reshape(-1), batch.index, a["first"])
        self.reducer.mean(a["first"], a["mean"], stream)
        center_update_kernel[1, 1, stream](a["mean"], a["state"], self.beta, replay.store["gamma"], a["offset"], stats,
                                           *self.slots)
        offset_every_window(batch, a["offset"], stream)

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {"reward_center/state": self.arena["state"].copy_to_host()}

    def load_state(self, arrays: dict) -> None:
        if "reward_center/state" in arrays:
            self.arena.load({"state": np.asarray(arrays["reward_center/state"], np.float64)})
