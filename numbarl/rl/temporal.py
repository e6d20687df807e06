"""The temporal input of the C51 agent (agent.temporal = "mamba", issue 15): the trunk reads

    h̃_t = x_t + y · W_out,   y = Mamba2 scan over x_{t−K+1} .. x_t        (numbarl/rl/nets/mamba.py)

(agent.temporal_conv = d > 0: Mamba2's causal depthwise convolution of d taps and a SiLU on the scan's
inputs first, within the window; the acting and backtest passes run the same windows, so they agree.)

instead of the observation x_t, K = agent.temporal_steps. Online and target networks each have their
own scan parameters (the store's "params" and "target" roles: the optimizer's Polyak / periodic target
update covers them like every other tensor), optimizer group 'temporal.mamba' with its own learning
rate (agent.temporal_lr).

Where each pass's window comes from (K rows oldest first, row K − 1 the pass's own observation; rows
before the episode start or not in the replay are a zero prefix with mask 0, and the scan's state
restarts after them)::

    window "obs"   online, diag, iql_target   the replay rows ending at batch.index       (gather_sequences)
    window "next"  next, target               ... ending at batch.next_index (the n-step next observation)
    window "h<h>"  next_h<h>, target_h<h>     ... ending at the extra horizon's next_index (agent.horizons)
    window "act"   act                        the env's column ending at the row the collect step's gather
                                              has just written (count not advanced yet: count_offset=1),
                                              so acting sees exactly the window training will sample (the
                                              replay never draws a time whose window its ring has cut:
                                              Replay.set_history)
    window "eval"  eval                       a ring per backtest policy of the observations it scored, the
                                              newest last (reset_eval clears it: a backtest is one episode)

Backward (the online pass; also the next pass with ICM's agent.curiosity_trunk_grad, whose inverse loss
trains the trunk on φ(next_obs)): the trunk's first layer computes its input gradient dh̃ (it skips it
when the switch is off) and the scan's backward runs on it through all K steps; the scan computes no
input gradient of its own (the observations are data).

ISV routing (agent.isv_routing, numbarl/rl/isv.py): the scan returns u = y · W_out without the residual and
every pass reads h̃ = x_t + w ⊙ u, w = σ(isv · W_r + b_r) (optimizer group 'temporal.route', online and
target copies like the scan's; the isv vector is the agent's, bound with bind_isv). The backward runs the
routing's first (g = w ⊙ dh̃, dW_r, db_r) and the scan's on g.

Off (the default) nothing here is built: the agent's launches and bits are those without it.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from numbarl.config import AgentConfig, ConfigError
from numbarl.cuda import launch
from numbarl.cuda.runtime import Arena, cuda
from numbarl.rl.isv import IsvRoute
from numbarl.rl.nets.mamba import GROUP, MambaScan
from numbarl.rl.sequence import gather_sequences

_cuda = cuda()

BLOCK = 128
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


# ---------------------------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------------------------
def eval_push_ref(window, mask, count, obs):
    """numpy model of eval_push_kernel: (window [P, K, D], mask [P, K], count [P]) after one bar of obs [P, D]."""
    window, mask, count = np.array(window, np.float32), np.array(mask, np.float32), np.array(count, np.int64)
    K = window.shape[1]
    window[:, :-1] = window[:, 1:].copy()
    window[:, -1] = obs
    count += 1
    mask[:] = (np.arange(K)[None, :] >= K - np.minimum(count, K)[:, None]).astype(np.float32)
    return window, mask, count


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def act_index_kernel(count, n_slots, index):
    """index[e] = (count % n_slots) · N + e: the replay row the collect step's gather has just written."""
    e = _cuda.grid(1)
    if e < index.shape[0]:
        index[e] = (count[0] % n_slots) * index.shape[0] + e


@_cuda.jit(cache=True)
def eval_push_kernel(obs, window, mask, count):
    """One thread per policy p: shift its window [K, D] one row older, obs[p] into row K − 1, count + 1,
    mask[p, j] = 1 for the min(count, K) newest rows (eval_push_ref)."""
    p = _cuda.grid(1)
    if p >= window.shape[0]:
        return
    K = window.shape[1]
    D = window.shape[2]
    for j in range(K - 1):
        for d in range(D):
            window[p, j, d] = window[p, j + 1, d]
    for d in range(D):
        window[p, K - 1, d] = obs[p, d]
    n = count[p] + 1
    count[p] = n
    for j in range(K):
        mask[p, j] = _ONE if j >= K - min(n, K) else _ZERO


@_cuda.jit(cache=True)
def eval_reset_kernel(window, mask, count):
    """One thread per policy: empty window (zeros, mask 0, count 0)."""
    p = _cuda.grid(1)
    if p >= window.shape[0]:
        return
    for j in range(window.shape[1]):
        mask[p, j] = _ZERO
        for d in range(window.shape[2]):
            window[p, j, d] = _ZERO
    count[p] = 0


# ---------------------------------------------------------------------------------------------
# the agent's temporal input
# ---------------------------------------------------------------------------------------------
class TemporalInput:
    """The scan, the window buffers of every pass and the evaluation ring (module docstring).

    temporal = TemporalInput(cfg, state_dim, n_envs, eval_batch)
    temporal.declare_params(store)                      # after every other module: their init is unchanged
    temporal.declare_acts(acts, {"online": B, ...})     # scan passes (tag: windows of that pass)
    temporal.allocate()
    temporal.gather_batch(replay, stream)               # SAMPLE: the obs / next (/ horizon) windows
    x = temporal.forward(tag, stream, role)             # h̃ [rows, D], the trunk's input for the pass `tag`
    temporal.backward(dh, stream)                       # BACKWARD: dh̃ of the online pass → the scan's grads
    """

    # the window each pass reads (module docstring); multi-horizon tags map to "h<h>"
    WINDOW: ClassVar[dict[str, str]] = {"online": "obs", "diag": "obs", "iql_target": "obs", "next": "next",
                                         "target": "next", "act": "act", "eval": "eval"}

    def __init__(self, cfg: AgentConfig, state_dim: int, n_envs: int, eval_batch: int, horizons=()):
        self.K, self.dim = int(cfg.temporal_steps), int(state_dim)
        if cfg.temporal != "mamba":
            raise ConfigError(f"agent.temporal = {cfg.temporal!r}: the temporal input knows 'mamba'")
        routed = bool(cfg.isv_routing)  # ISV routing: the scan without its residual
        self.scan = MambaScan(GROUP, self.dim, n_steps=self.K, n_heads=int(cfg.temporal_heads), input_grad=False,
                              compute=cfg.compute, residual=not routed, conv=int(cfg.temporal_conv))
        self.route = IsvRoute("temporal.route", self.dim) if routed else None
        self.n_envs, self.eval_batch, self.horizons = int(n_envs), int(eval_batch), tuple(int(h) for h in horizons)
        self.batch_size = int(cfg.batch_size)
        self.state = Arena("temporal")
        self._rows = {"obs": self.batch_size, "next": self.batch_size, "act": self.n_envs, "eval": self.eval_batch}
        self._rows.update({f"h{h}": self.batch_size for h in self.horizons})
        for name, rows in self._rows.items():  # x [rows, K, D] and its scan mask [rows, K] (1 valid, 0 not)
            self.state.add(f"{name}.x", (rows, self.K, self.dim), np.float32)
            self.state.add(f"{name}.mask", (rows, self.K), np.float32)
        self.state.add("act.index", (self.n_envs,), np.int64)
        self.state.add("eval.count", (self.eval_batch,), np.int64)

    @property
    def group(self) -> str:
        return GROUP

    def window(self, tag: str) -> str:
        if tag.startswith(("next_h", "target_h")):
            return "h" + tag.split("_h", 1)[1]
        return self.WINDOW[tag]

    # -- declarations ---------------------------------------------------------------------------
    @property
    def groups(self) -> tuple:
        """The optimizer groups of the temporal input (the scan's; the routing's with agent.isv_routing)."""
        return (GROUP,) if self.route is None else (GROUP, self.route.group)

    def declare_params(self, store) -> None:
        self.scan.declare_params(store)
        if self.route is not None:
            self.route.declare_params(store)

    def bind_isv(self, isv) -> None:
        """The ISV vector the routing reads (agent.isv_routing): a fixed device address."""
        self.route.bind_isv(isv)

    def declare_acts(self, acts: Arena, tags, backward=("online",)) -> None:
        """The scan's buffers of each pass tag in `tags` (those in `backward` with their backward)."""
        for tag in tags:
            rows = self._rows[self.window(tag)]
            self.scan.declare_acts(acts, rows * self.K, tag, backward=tag in backward)
            if self.route is not None:
                self.route.declare_acts(acts, rows, tag, backward=tag in backward)

    def allocate(self) -> None:
        self.state.allocate()

    def check_replay(self, replay) -> None:
        """The replay draws only times whose K − 1 preceding rows are still in its ring (Replay.set_history):
        a trained window is always the one the collect step acted on, never one cut by the ring's oldest edge."""
        need = replay.window + self.K
        if replay.n_slots < need:
            raise ConfigError(f"agent.temporal_steps = {self.K} needs the replay to hold at least {need} steps per "
                              f"env (the {replay.window}-step window after {self.K - 1} rows of history); "
                              f"agent.replay_capacity holds {replay.n_slots} (raise it to >= {need} x n_envs)")
        replay.set_history(self.K - 1)

    # -- windows (capturable launches) ----------------------------------------------------------
    def gather_batch(self, replay, stream) -> None:
        """SAMPLE: the windows ending at the batch's rows, its next rows and each extra horizon's next rows."""
        batch, st = replay.batch, self.state
        gather_sequences(replay, batch.index, st["obs.x"], st["obs.mask"], stream)
        gather_sequences(replay, batch.next_index, st["next.x"], st["next.mask"], stream)
        for hb in batch.horizons:
            gather_sequences(replay, hb.next_index, st[f"h{hb.horizon}.x"], st[f"h{hb.horizon}.mask"], stream)

    def gather_act(self, replay, stream) -> None:
        """COLLECT, after the env's gather wrote obs_t into the replay's row: each env's window ending there."""
        st = self.state
        act_index_kernel[launch.blocks(self.n_envs, BLOCK), BLOCK, stream](replay.count, np.int64(replay.n_slots),
                                                                           st["act.index"])
        gather_sequences(replay, st["act.index"], st["act.x"], st["act.mask"], stream, count_offset=1)

    def push_eval(self, obs, stream) -> None:
        """The backtest's bar: obs [P, D] into each policy's ring."""
        st = self.state
        if tuple(obs.shape) != (self.eval_batch, self.dim):
            raise ValueError(f"temporal: the backtest scores obs of shape {tuple(obs.shape)}; the agent was built for "
                             f"{(self.eval_batch, self.dim)} (eval_batch, state_dim)")
        eval_push_kernel[launch.blocks(self.eval_batch, BLOCK), BLOCK, stream](obs, st["eval.x"], st["eval.mask"],
                                                                               st["eval.count"])

    def reset_eval(self, stream) -> None:
        st = self.state
        eval_reset_kernel[launch.blocks(self.eval_batch, BLOCK), BLOCK, stream](st["eval.x"], st["eval.mask"],
                                                                                st["eval.count"])

    # -- the scan ---------------------------------------------------------------------------------
    def inputs(self, tag: str):
        """(x [rows·K, D], mask [rows, K]) of the window the pass `tag` reads."""
        return self.window_rows(self.window(tag))

    def window_rows(self, name: str):
        """(x [rows·K, D], mask [rows, K]) of the window buffer `name` (obs, next, act, eval, h<horizon>)."""
        x = self.state[f"{name}.x"]
        return x.reshape(x.shape[0] * self.K, self.dim), self.state[f"{name}.mask"]

    def forward(self, tag: str, stream, role: str = "params"):
        """h̃ [rows, D] of the pass `tag` (parameters of `role`) on its window."""
        x, mask = self.inputs(tag)
        h = self.scan.forward(x, stream, tag=tag, role=role, mask=mask)
        if self.route is not None:  # ISV routing: h̃ = x_t + w ⊙ u
            h = self.route.route(h, x, self.K, stream, tag=tag, role=role)
        return h

    def output(self, tag: str):
        """h̃ of the pass `tag` (after forward)."""
        return self.scan.output(tag) if self.route is None else self.route.output(tag)

    def backward(self, dh, stream, tag: str = "online") -> None:
        """The pass's backward from dh̃ [B, D]: the scan's parameter gradients (the gradient rule: a second
        pass's backward in the same train step adds to the first's); with the ISV routing its gradients
        first and the scan's backward on w ⊙ dh̃."""
        if self.route is not None:
            dh = self.route.backward(dh, stream, tag=tag)
        self.scan.backward(dh, stream, tag=tag)

    # -- float64 reference ------------------------------------------------------------------------
    def forward_ref(self, window, mask, params, isv=None):
        """(h̃ [rows, D], cache) of a window [rows, K, D] with mask [rows, K] (MambaScan.forward_ref); with the
        ISV routing (isv [12] given) h̃ = x_t + w ⊙ u and cache = (scan cache, routing cache)."""
        window = np.asarray(window)
        h, cache = self.scan.forward_ref(window.reshape(-1, self.dim), params, mask=mask)
        if self.route is None:
            return h, cache
        h, route_cache = self.route.forward_ref(h, window[:, -1], isv, params)
        return h, (cache, route_cache)
