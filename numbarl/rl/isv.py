"""ISV: twelve training-health signals of the C51 agent (agent.isv, issue 15, spec T5) and the temporal
routing they drive (agent.isv_routing, T6).

T5, the signals. A device float32 vector isv[12], updated once per train step by ONE one-thread kernel
(:func:`isv_update_kernel`), the last launch of the train step (inside the captured graph). It reads the
agent's device stats buffer (numbarl/rl/agents/dqn.py, slots that ``train_stats_kernel`` writes on EVERY
train step), never the host::

    L  = stats["loss"]        the C51 cross-entropy of the step        G  = stats["grad_norm"] (before clipping)
    Q  = stats["q_mean"]      mean Q of the taken actions              Qn = stats["q_next_max"] (mean max next Q)
    C  = stats["clip_scale"]  the factor the clip scaled the gradients by (1: not clipped)

    slot name            value                                             state
    0  loss_fast         EMA_0.9 (L)                                       recursion
    1  loss_slow         EMA_0.99(L)                                       recursion
    2  grad_norm_fast    EMA_0.9 (G)                                       recursion
    3  grad_norm_slow    EMA_0.99(G)                                       recursion
    4  q_mean_fast       EMA_0.9 (Q)                                       recursion
    5  q_mean_slow       EMA_0.99(Q)                                       recursion
    6  q_slope           q_mean_fast − q_mean_slow (Q drifting up > 0)     derived
    7  clip_frac         EMA_0.99(1{C < 1}): share of recent steps clipped recursion
    8  td_gap            EMA_0.9 (Qn − Q): the bootstrap gap               recursion
    9  grad_stability    clip(1 − |g_fast − g_slow| / (|g_slow| + ε), 0, 1) derived
    10 nonfinite_frac    EMA_0.99(1{L, G, Q, Qn or C not finite})          recursion
    11 loss_stability    clip(1 − |l_fast − l_slow| / (|l_slow| + ε), 0, 1) derived

EMA_β(x): e ← x on the first finite x the signal sees, then e ← β e + (1 − β) x (no zero-start bias: the
origin's ISV stayed at zero because its update never ran, and a zero-started slow EMA would look alike for
its first hundred steps). The spec's proposal also named the atom utilisation, the policy entropy and the
mean |q_gap|: the agent computes those in its diagnostics graph at log intervals only (or with
agent.atom_entropy_max), not on every train step, so td_gap, grad_stability and nonfinite_frac take their
places (every slot means the same in every configuration). ε = 1e-6.

Non-finite inputs never poison the state: a non-finite L skips the update of slots 0, 1 (11 is then
recomputed from the kept EMAs), G of 2, 3 (9), Q of 4, 5 (6) and, with Qn, of 8, C or G of 7 (the
optimizer skips a step whose G is not finite and writes C = 0 for it: no clip); slot 10 records that it
happened. ``updates[i]`` counts the finite updates of input i (loss, grad norm, Q, clip, td gap,
steps): 0 marks "none yet" for the first-value rule. Arithmetic in float64, the state stored in float32.
State (checkpointed as isv/vector, isv/updates; a backtest reads the vector frozen, since only train steps
write it) and the stats slots isv_<name> (logged at every interval).

T6, the routing (numbarl/rl/temporal.py with agent.temporal = "mamba"): the trunk reads

    w  = σ(isv · W_r + b_r)                   [F], W_r [12, F], b_r [F]  (group 'temporal.route')
    h̃  = x_t + w ⊙ u,    u = y · W_out        [rows, F]  (the scan's output projection, no residual)

(equivalently h̃ = w ⊙ (x_t + u) + (1 − w) ⊙ x_t). isv is an input without a gradient. Backward from dh̃:

    g   = w ⊙ dh̃                              the scan's upstream gradient (its W_out, BPTT, W_in)
    dw_j = Σ_b dh̃[b, j] u[b, j]                a fixed-order row sum of the transposed product [F, B]
    dz  = dw ⊙ w (1 − w),   dW_r = isv ⊗ dz,   db_r = dz          (the gradient rule: overwrite, then add)

Init W_r = 0, b_r = 0: w = 0.5 for every feature, i.e. the routed input starts exactly at the fixed 0.5
mixing the spec's A/B compares against (so the A/B measures what the learned, ISV-dependent routing adds),
and σ' = 1/4 is at its largest there (w ≈ 1 would start at the unrouted input but with σ' ≈ 0: a stuck gate).

Thread mapping: isv_update_kernel one thread; route_forward_kernel one thread per (row, feature) (each
recomputes its feature's w in the same fixed order, so every w_j is the same bits everywhere; row 0 stores
w); route_grad_terms_kernel one thread per (row, feature); route_param_grad_kernel one thread per feature.
No atomics.
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda import launch, reduce
from numbarl.cuda.kernels.elementwise import stride_launch
from numbarl.cuda.runtime import Arena, cuda
from numbarl.rl.nets.base import zeros_init
from numbarl.rl.nets.module import Buf, Ctx, Module, Param

_cuda = cuda()

ISV_NAMES = ("loss_fast", "loss_slow", "grad_norm_fast", "grad_norm_slow", "q_mean_fast", "q_mean_slow", "q_slope",
             "clip_frac", "td_gap", "grad_stability", "nonfinite_frac", "loss_stability")
N_ISV = len(ISV_NAMES)
(ISV_LOSS_FAST, ISV_LOSS_SLOW, ISV_GRAD_FAST, ISV_GRAD_SLOW, ISV_Q_FAST, ISV_Q_SLOW, ISV_Q_SLOPE, ISV_CLIP_FRAC,
 ISV_TD_GAP, ISV_GRAD_STABILITY, ISV_NONFINITE_FRAC, ISV_LOSS_STABILITY) = range(N_ISV)
# the inputs whose finite updates `updates` counts
INPUT_NAMES = ("loss", "grad_norm", "q_mean", "clip", "td_gap", "steps")
N_INPUTS = len(INPUT_NAMES)
IN_LOSS, IN_GRAD, IN_Q, IN_CLIP, IN_TD, IN_STEPS = range(N_INPUTS)
FAST, SLOW = 0.9, 0.99  # EMA decays
EPS = 1e-6  # the stabilities' denominator floor

ROUTE_GROUP = "temporal.route"
BLOCK = 128  # threads per block of the routing's elementwise kernels (GPU)
_ONE = np.float32(1.0)


# ---------------------------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------------------------
def _ema_ref(prev: float, x: float, beta: float, n: int) -> float:
    return x if n == 0 else beta * prev + (1.0 - beta) * x


def _stability_ref(fast: float, slow: float) -> float:
    return min(max(1.0 - abs(fast - slow) / (abs(slow) + EPS), 0.0), 1.0)


def isv_update_ref(isv, updates, loss, grad_norm, q_mean, q_next_max, clip_scale):
    """float64 model of one isv_update_kernel step (module docstring): (isv [12], updates [6]) after the
    step's stats. Inputs: the previous state and the five stats scalars."""
    v = np.array(isv, np.float64)
    n = np.array(updates, np.int64)
    L, G, Q, Qn, C = (float(x) for x in (loss, grad_norm, q_mean, q_next_max, clip_scale))
    fin = math.isfinite
    if fin(L):
        v[ISV_LOSS_FAST] = _ema_ref(v[ISV_LOSS_FAST], L, FAST, n[IN_LOSS])
        v[ISV_LOSS_SLOW] = _ema_ref(v[ISV_LOSS_SLOW], L, SLOW, n[IN_LOSS])
        n[IN_LOSS] += 1
    if fin(G):
        v[ISV_GRAD_FAST] = _ema_ref(v[ISV_GRAD_FAST], G, FAST, n[IN_GRAD])
        v[ISV_GRAD_SLOW] = _ema_ref(v[ISV_GRAD_SLOW], G, SLOW, n[IN_GRAD])
        n[IN_GRAD] += 1
    if fin(Q):
        v[ISV_Q_FAST] = _ema_ref(v[ISV_Q_FAST], Q, FAST, n[IN_Q])
        v[ISV_Q_SLOW] = _ema_ref(v[ISV_Q_SLOW], Q, SLOW, n[IN_Q])
        n[IN_Q] += 1
    if fin(C) and fin(G):  # a skipped step (G not finite) writes C = 0: not a clip
        v[ISV_CLIP_FRAC] = _ema_ref(v[ISV_CLIP_FRAC], 1.0 if C < 1.0 else 0.0, SLOW, n[IN_CLIP])
        n[IN_CLIP] += 1
    if fin(Q) and fin(Qn):
        v[ISV_TD_GAP] = _ema_ref(v[ISV_TD_GAP], Qn - Q, FAST, n[IN_TD])
        n[IN_TD] += 1
    bad = 0.0 if all(fin(x) for x in (L, G, Q, Qn, C)) else 1.0
    v[ISV_NONFINITE_FRAC] = _ema_ref(v[ISV_NONFINITE_FRAC], bad, SLOW, n[IN_STEPS])
    n[IN_STEPS] += 1
    v[ISV_Q_SLOPE] = v[ISV_Q_FAST] - v[ISV_Q_SLOW]
    if n[IN_GRAD] > 0:
        v[ISV_GRAD_STABILITY] = _stability_ref(v[ISV_GRAD_FAST], v[ISV_GRAD_SLOW])
    if n[IN_LOSS] > 0:
        v[ISV_LOSS_STABILITY] = _stability_ref(v[ISV_LOSS_FAST], v[ISV_LOSS_SLOW])
    return v, n


def route_forward_ref(u, x_last, isv, w_r, b_r):
    """(h̃ [rows, F], w [F]) in float64: w = σ(isv·W_r + b_r), h̃ = x_t + w ⊙ u."""
    u, x_last = np.asarray(u, np.float64), np.asarray(x_last, np.float64)
    z = np.asarray(isv, np.float64) @ np.asarray(w_r, np.float64) + np.asarray(b_r, np.float64)
    w = 1.0 / (1.0 + np.exp(-z))
    return x_last + w[None, :] * u, w


def route_backward_ref(dh, u, isv, w):
    """(g [rows, F] the scan's upstream gradient, dW_r [12, F], db_r [F]) in float64 from dh̃ [rows, F]."""
    dh, u, w = np.asarray(dh, np.float64), np.asarray(u, np.float64), np.asarray(w, np.float64)
    dw = np.sum(dh * u, axis=0)
    dz = dw * w * (1.0 - w)
    return w[None, :] * dh, np.outer(np.asarray(isv, np.float64), dz), dz


# ---------------------------------------------------------------------------------------------
# device functions
# ---------------------------------------------------------------------------------------------
@_cuda.jit(device=True)
def _ema_dev(prev, x, beta, n):
    if n == 0:
        return x
    return beta * prev + (1.0 - beta) * x


@_cuda.jit(device=True)
def _stability_dev(fast, slow):
    s = 1.0 - abs(fast - slow) / (abs(slow) + EPS)
    return min(max(s, 0.0), 1.0)


@_cuda.jit(device=True)
def route_weight_dev(isv, w_r, b_r, j):
    """w_j = σ(Σ_k isv[k] W_r[k, j] + b_r[j]) in float32, k in increasing order (the same bits in every thread)."""
    z = b_r[j]
    for k in range(isv.shape[0]):
        z += isv[k] * w_r[k, j]
    return _ONE / (_ONE + math.exp(-z))


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def isv_update_kernel(stats, slot_loss, slot_grad, slot_q, slot_qn, slot_clip, isv, updates, first_slot):
    """One thread: the ISV step of isv_update_ref from the stats slots, isv [12] float32 and updates [6] int64
    updated in place, stats[first_slot + i] = isv[i]."""
    if _cuda.grid(1) != 0:
        return
    L = np.float64(stats[slot_loss])
    G = np.float64(stats[slot_grad])
    Q = np.float64(stats[slot_q])
    Qn = np.float64(stats[slot_qn])
    C = np.float64(stats[slot_clip])
    fin_l = math.isfinite(L)
    fin_g = math.isfinite(G)
    fin_q = math.isfinite(Q)
    fin_qn = math.isfinite(Qn)
    fin_c = math.isfinite(C)
    if fin_l:
        n = updates[IN_LOSS]
        isv[ISV_LOSS_FAST] = np.float32(_ema_dev(np.float64(isv[ISV_LOSS_FAST]), L, FAST, n))
        isv[ISV_LOSS_SLOW] = np.float32(_ema_dev(np.float64(isv[ISV_LOSS_SLOW]), L, SLOW, n))
        updates[IN_LOSS] = n + 1
    if fin_g:
        n = updates[IN_GRAD]
        isv[ISV_GRAD_FAST] = np.float32(_ema_dev(np.float64(isv[ISV_GRAD_FAST]), G, FAST, n))
        isv[ISV_GRAD_SLOW] = np.float32(_ema_dev(np.float64(isv[ISV_GRAD_SLOW]), G, SLOW, n))
        updates[IN_GRAD] = n + 1
    if fin_q:
        n = updates[IN_Q]
        isv[ISV_Q_FAST] = np.float32(_ema_dev(np.float64(isv[ISV_Q_FAST]), Q, FAST, n))
        isv[ISV_Q_SLOW] = np.float32(_ema_dev(np.float64(isv[ISV_Q_SLOW]), Q, SLOW, n))
        updates[IN_Q] = n + 1
    if fin_c and fin_g:  # a skipped step (G not finite) writes C = 0: not a clip
        clipped = 1.0 if C < 1.0 else 0.0
        isv[ISV_CLIP_FRAC] = np.float32(_ema_dev(np.float64(isv[ISV_CLIP_FRAC]), clipped, SLOW, updates[IN_CLIP]))
        updates[IN_CLIP] += 1
    if fin_q and fin_qn:
        isv[ISV_TD_GAP] = np.float32(_ema_dev(np.float64(isv[ISV_TD_GAP]), Qn - Q, FAST, updates[IN_TD]))
        updates[IN_TD] += 1
    bad = 0.0 if (fin_l and fin_g and fin_q and fin_qn and fin_c) else 1.0
    isv[ISV_NONFINITE_FRAC] = np.float32(_ema_dev(np.float64(isv[ISV_NONFINITE_FRAC]), bad, SLOW, updates[IN_STEPS]))
    updates[IN_STEPS] += 1
    isv[ISV_Q_SLOPE] = np.float32(np.float64(isv[ISV_Q_FAST]) - np.float64(isv[ISV_Q_SLOW]))
    if updates[IN_GRAD] > 0:
        isv[ISV_GRAD_STABILITY] = np.float32(_stability_dev(np.float64(isv[ISV_GRAD_FAST]),
                                                            np.float64(isv[ISV_GRAD_SLOW])))
    if updates[IN_LOSS] > 0:
        isv[ISV_LOSS_STABILITY] = np.float32(_stability_dev(np.float64(isv[ISV_LOSS_FAST]),
                                                            np.float64(isv[ISV_LOSS_SLOW])))
    for i in range(isv.shape[0]):
        stats[first_slot + i] = isv[i]


@_cuda.jit(cache=True)
def route_forward_kernel(u, x, n_steps, isv, w_r, b_r, out, w_out):
    """out[b, j] = x[b·K + K − 1, j] + w_j u[b, j] (one thread per (b, j), grid stride); row 0 stores w_j."""
    rows = out.shape[0]
    F = out.shape[1]
    start, step = _cuda.grid(1), _cuda.gridsize(1)
    for i in range(start, rows * F, step):
        b = i // F
        j = i - b * F
        w = route_weight_dev(isv, w_r, b_r, j)
        out[b, j] = x[b * n_steps + n_steps - 1, j] + w * u[b, j]
        if b == 0:
            w_out[j] = w


@_cuda.jit(cache=True)
def route_grad_terms_kernel(dh, u, w, g, prod_t):
    """g[b, j] = w_j dh̃[b, j] (the scan's upstream gradient) and prod_t[j, b] = dh̃[b, j] u[b, j] (the
    terms of dw_j, transposed so a row sum adds them). One thread per (b, j), grid stride."""
    rows = dh.shape[0]
    F = dh.shape[1]
    start, step = _cuda.grid(1), _cuda.gridsize(1)
    for i in range(start, rows * F, step):
        b = i // F
        j = i - b * F
        d = dh[b, j]
        g[b, j] = w[j] * d
        prod_t[j, b] = d * u[b, j]


@_cuda.jit(cache=True)
def route_param_grad_kernel(dw, w, isv, d_w_r, d_b_r, accumulate):
    """One thread per feature j: dz = dw_j w_j (1 − w_j); d_b_r[j] (+)= dz, d_W_r[k, j] (+)= isv[k] dz."""
    j = _cuda.grid(1)
    if j >= dw.shape[0]:
        return
    wj = w[j]
    dz = dw[j] * wj * (_ONE - wj)
    if accumulate:
        d_b_r[j] += dz
        for k in range(isv.shape[0]):
            d_w_r[k, j] += isv[k] * dz
    else:
        d_b_r[j] = dz
        for k in range(isv.shape[0]):
            d_w_r[k, j] = isv[k] * dz


# ---------------------------------------------------------------------------------------------
# launchers and owners
# ---------------------------------------------------------------------------------------------
class Isv:
    """The ISV state of an agent and its update (module docstring).

    isv = Isv(stats_layout)          # registers the stats slots isv_<name> (before the mapped stats are sized)
    isv.update(stats, slots, stream) # the train step's last launch; slots: (loss, grad_norm, q_mean, q_next_max,
                                     # clip_scale) slot numbers of the agent's stats
    isv.vector                       # float32 [12] on the device (the routing and other consumers read it)
    """

    def __init__(self, stats_layout):
        self.first_slot = stats_layout.slot(f"isv_{ISV_NAMES[0]}")
        for i, name in enumerate(ISV_NAMES[1:], 1):
            if stats_layout.slot(f"isv_{name}") != self.first_slot + i:
                raise RuntimeError("the ISV stats slots are not consecutive")
        self.state = Arena("agent.isv")
        self.state.add("vector", (N_ISV,), np.float32)
        self.state.add("updates", (N_INPUTS,), np.int64)
        self.state.allocate()

    @property
    def vector(self):
        return self.state["vector"]

    def update(self, stats, slots, stream) -> None:
        loss, grad, q, qn, clip = (np.int64(s) for s in slots)
        isv_update_kernel[1, 1, stream](stats, loss, grad, q, qn, clip, self.state["vector"], self.state["updates"],
                                        np.int64(self.first_slot))

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {f"isv/{k}": v for k, v in self.state.to_host().items()}

    def load_arrays(self, arrays) -> None:
        self.state.load({k.split("/", 1)[1]: np.asarray(v) for k, v in arrays.items() if k.startswith("isv/")})


class IsvRoute(Module):
    """w = σ(isv·W_r + b_r), h̃ = x_t + w ⊙ u (module docstring), one pass per tag like every module; the
    isv vector is bound once (bind_isv: a fixed device address the captured graphs read).

    route = IsvRoute("temporal.route", F)
    route.declare_params(store); route.declare_acts(acts, rows, tag, backward=...)
    route.bind_isv(isv.vector)
    h = route.route(u, x, K, stream, tag, role)     # u [rows, F], x [rows·K, F] the window (row b·K + K − 1: x_t)
    g = route.backward(dh, stream, tag)             # the scan's upstream gradient [rows, F]; dW_r, db_r by the ledger
    """

    def __init__(self, name: str, width: int, group: str | None = ROUTE_GROUP):
        super().__init__(name, group)
        self.width = int(width)
        self.isv = None

    def params(self) -> list[Param]:
        return [Param("w_r", (N_ISV, self.width), zeros_init, decay=True), Param("b_r", (self.width,), zeros_init)]

    def buffers(self, batch: int, backward: bool, **opts) -> list[Buf]:
        F = self.width
        bufs = [Buf("y", (batch, F)), Buf("w", (F,))]
        if backward:
            bufs += [Buf("g", (batch, F)), Buf("prod_t", (F, batch)), Buf("dw", (F,))]
        return bufs

    def bind_isv(self, isv) -> None:
        if tuple(isv.shape) != (N_ISV,) or isv.dtype != np.float32:
            raise ValueError(f"{self.name}: the isv vector must be float32 [{N_ISV}], got {isv.dtype} {tuple(isv.shape)}")
        self.isv = isv

    def route(self, u, x, n_steps: int, stream, tag: str = "online", role: str = "params"):
        """h̃ [rows, F] of the pass `tag` (parameters of `role`). u is kept for the backward (the buffer the
        scan wrote; a later pass of the same tag must not have overwritten it before)."""
        if self.isv is None:
            raise RuntimeError(f"{self.name}: bind_isv(vector) before the first pass")
        c = Ctx(self, tag, role, stream)
        out, w = c.buf("y"), c.buf("w")
        if tuple(u.shape) != tuple(out.shape) or tuple(x.shape) != (out.shape[0] * int(n_steps), self.width):
            raise ValueError(f"{self.name}.route({tag!r}): u {tuple(u.shape)} and x {tuple(x.shape)} do not fit "
                             f"rows {out.shape[0]} x K {n_steps} x F {self.width}")
        self._inputs[tag] = u
        blocks, threads = stride_launch(out.size)
        route_forward_kernel[blocks, threads, stream](u, x, np.int32(n_steps), self.isv, c.p("w_r"), c.p("b_r"), out, w)
        return out

    def backward(self, dh, stream, tag: str = "online", dx_out=None):
        """g = w ⊙ dh̃ (returned: the scan's upstream gradient), dW_r and db_r by the gradient rule."""
        if not self._backward.get(tag):
            raise RuntimeError(f"{self.name}: tag {tag!r} was not declared with backward=True")
        c = Ctx(self, tag, "params", stream)
        u, w, g, prod_t, dw = self._inputs[tag], c.buf("w"), c.buf("g"), c.buf("prod_t"), c.buf("dw")
        if tuple(dh.shape) != tuple(g.shape):
            raise ValueError(f"{self.name}.backward({tag!r}): dh has shape {tuple(dh.shape)}, expected {tuple(g.shape)}")
        blocks, threads = stride_launch(dh.size)
        route_grad_terms_kernel[blocks, threads, stream](dh, u, w, g, prod_t)
        reduce.row_sum(prod_t, dw, stream)  # dw_j = Σ_b in a fixed order
        accumulate = c.beta("w_r") == 1.0
        if (c.beta("b_r") == 1.0) != accumulate:
            raise RuntimeError(f"{self.name}: W_r and b_r gradients out of step in the ledger")
        route_param_grad_kernel[launch.blocks(self.width, BLOCK), BLOCK, stream](dw, w, self.isv, c.g("w_r"),
                                                                                  c.g("b_r"), bool(accumulate))
        return g

    # -- float64 reference (host dict of params by name) ----------------------------------------
    def forward_ref(self, u, x_last, isv, params):
        n = self.param_names
        h, w = route_forward_ref(u, x_last, isv, params[n["w_r"]], params[n["b_r"]])
        return h, (np.asarray(u, np.float64), np.asarray(isv, np.float64), w)

    def backward_ref(self, dh, cache, params):
        u, isv, w = cache
        g, d_w_r, d_b_r = route_backward_ref(dh, u, isv, w)
        n = self.param_names
        return g, {n["w_r"]: d_w_r, n["b_r"]: d_b_r}
