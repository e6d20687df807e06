"""Device side of the validation feedback loop: small kernels that read host-written device tables.

E1 reward offset (in the train step's SAMPLE phase, after the replay drew the batch)::

    R~_n = R_n - c * sum_{k<m} gamma^k = R_n - offset * (1 - gamma^m)        c = (1 - gamma) * offset

i.e. every reward of the n-step window lowered by c, the same as subtracting c from the reward in
the replay's n-step scan (``discount`` = gamma^m is the batch's own), so every value shifts by
-offset (= -c / (1 - gamma)). ``offset`` is a device float32 scalar the loop writes between epochs.
Every window of the batch gets it (the main one and each extra horizon's, gamma^m each its own), and
reward centering (numbarl/rl/reward_center.py) calls the same kernel with its own offset.

E9 tradability gate: where the regime bucket of an env's observation is gated (gate[b] = 1) and
the env is flat, the entries (short, long) are taken away; holding and exits are never gated.
Collect: on the env's mask, before the policy chooses (exploration included), so the replay
stores the mask the behaviour policy saw. Backtests: on the greedy scores (the backtest's
greedy choice only sees scores), the entries' Q set to the lowest float32 so flat wins.
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda.runtime import cuda
from numbarl.env.params import DIR_LONG, DIR_SHORT
from numbarl.rl.feedback.regimes import bucket_of

_cuda = cuda()

_ONE = np.float32(1.0)
_LOWEST = np.float32(-3.4028235e38)


@_cuda.jit(cache=True)
def reward_offset_kernel(reward, discount, offset):
    """reward[b] -= offset[0] * (1 - discount[b]) (module docstring, E1)."""
    b = _cuda.grid(1)
    if b < reward.shape[0]:
        reward[b] = np.float32(reward[b] - offset[0] * (_ONE - discount[b]))


def offset_every_window(batch, offset, stream) -> None:
    """reward_offset_kernel on every window of a sampled batch: the main one and each extra horizon's, each by its
    own discount (E1's offset; reward centering's r̄/(1 − γ)). Capturable: launches only."""
    n = batch.reward.shape[0]
    for window in [batch, *batch.horizons]:
        reward_offset_kernel[(n + 255) // 256, 256, stream](window.reward, window.discount, offset)


@_cuda.jit(cache=True)
def gate_mask_kernel(obs, mask, position_col, edges, gate, col_a, col_b, blocked):
    """E9 on the env's mask [N, n_branches, max_actions]: no entry in a gated bucket while flat.
    blocked[i] = 1 where env i's entries were taken away this step (the liveness count)."""
    i = _cuda.grid(1)
    if i >= obs.shape[0]:
        return
    blocked[i] = 0
    if obs[i, position_col] != 0:
        return
    if gate[bucket_of(obs[i, col_a], obs[i, col_b], edges)] != 0:
        mask[i, 0, DIR_SHORT] = 0
        mask[i, 0, DIR_LONG] = 0
        blocked[i] = 1


@_cuda.jit(cache=True)
def gate_scores_kernel(obs, q, position_col, edges, gate, col_a, col_b):
    """E9 on greedy scores [P, n_branches, max_actions]: entries scored lowest in a gated bucket."""
    p = _cuda.grid(1)
    if p >= obs.shape[0]:
        return
    if obs[p, position_col] != 0:
        return
    if gate[bucket_of(obs[p, col_a], obs[p, col_b], edges)] != 0:
        q[p, 0, DIR_SHORT] = _LOWEST
        q[p, 0, DIR_LONG] = _LOWEST


def reward_offset_ref(reward, discount, offset: float) -> np.ndarray:
    """float64 reference of reward_offset_kernel."""
    return np.asarray(reward, np.float64) - float(offset) * (1.0 - np.asarray(discount, np.float64))
