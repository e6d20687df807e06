"""Decision Transformer (Chen et al. 2021) on the device envs: offline trajectories, two captured graphs.

``agent.kind = "dt"``. What it is: a causal transformer over (return-to-go, state, action) tokens of
the last L steps (numbarl/rl/nets/dt.py, blocks in numbarl/rl/nets/attention.py) trained to predict
the behavior's action at each state token (numbarl/rl/losses/dt.py), then acting by asking for a
high return. The data: the device envs step a fixed BEHAVIOR policy, never the DT, and write its
trajectories to a device dataset of T steps x N envs, refreshed every T collect steps (offline RL
from env-written trajectories). The behavior of env i: with probability ε_i = noise · i / (N − 1)
a uniform random allowed action per branch, else the ORACLE: direction = sign(signal[bar]), the
largest size, target and stop index 0 (the trainer's oracle row). The signal is the planted
oracle when a caller gives it (:meth:`DTAgent.set_behavior_signal`, e.g. the synthetic cache's
oracle.npy), else the hindsight move mid[min(bar + H, hi − 1)] − mid[bar] inside the env's own
bar range (H = agent.dt_oracle_horizon; nothing after the training range is read). The spread of
ε over the envs gives trajectories of every quality, which is what return conditioning separates.

Return-to-go. The backtest has no episodes and does not hand rewards back to the agent, so the
return-to-go is the discounted, stationary one: G_t = r_t + γ (1 − done_t) G_{t+1} (γ = agent.dt_gamma),
by a reverse scan over the dataset (G_T = 0), normalized to zero mean and unit std over the dataset
(fixed-order reductions). Windows are drawn only where the truncation at T weighs < 5 %
(starts t0 <= T − L − tail, tail = min(⌈log 0.05 / log γ⌉, T − L)). Acting conditions every step on
the constant target R̂ = agent.dt_target (in those std units: 1.0 = one std above the mean return).

``collect_step``: obs, mask = env.gather(); behavior actions (one thread per env) → dataset[t];
env.step; dataset[t] ← r, done; t = (t + 1) mod T.
``update_step`` (after every T-th collect step): RETURNS (scan, normalize), then agent.dt_updates
gradient steps: SAMPLE B windows (env, start) by the counter RNG → TOKENS → FORWARD → LOSS →
BACKWARD → UPDATE (AdamW, the global-norm clip) → STATS.
``scores`` (the backtest): the eval state per policy (the last L observations and the DT's own
chosen actions, a step count) is pushed one bar, the window's tokens built, and the logits of the
newest state token written as the scores. ``reset_eval`` clears it. The action token the DT sees
for a past bar is its own first argmax over ALL actions of the branch (the backtest applies the
env's mask after ``scores`` and does not return the action taken; they differ only where the
direction lock masked the DT's choice). When that argmax is a side, the other side's score is
lowered below flat's: the backtest's greedy choice over the mask is then the DT's side where it is
allowed and flat (close) where the lock forbids it, as the behavior does (its masked oracle side
falls back to flat), never "hold" (on the raw logits the greedy choice between the two allowed
ones, flat and the held side, took the held side on 10 of 11 such bars in one CPU check below).

What the DT sees (agent.dt_portfolio, default off). The state token holds the observation's
MARKET features only; the portfolio features (the last PORTFOLIO_DIM columns: position,
unrealized P&L, bars in trade, ...) are left out of the dataset and the eval window. They are the
trace of the behavior's own past decisions, and the behavior decides on a signal the state does
not show: in its trajectories "long now" predicts "long next" (the oracle's side flips on ~5-9 %
of bars), so the DT learned to read the side from its position rather than from the market, and
acting it read its OWN position: it entered once and held (H200, default preset: 2-14 trades over
~3,000 bars, exposure 0.999). A causal confusion (self-delusion) of imitating an expert with hidden
information; the past action tokens carry the same information, but measured they mattered less.
CPU check (a planted tiny market, 250 held-out bars, this network trained on 1,536 x 16 behavior
steps at the default lr, then acting through ``scores``; seeds 0, 1, 2): before, 5, 18, 13 trades
(oracle 19), the position's side the oracle's on 0.41, 0.51, 0.59 of bars, Sharpe / the oracle's
-0.39, 0.08, 0.45; after, 15, 19, 29 trades, 0.70, 0.62, 0.67 of bars, 1.03, 0.58, 0.62.
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.config import AgentConfig
from numbarl.cuda import rng
from numbarl.cuda.mapped import MappedBuffer
from numbarl.cuda.registry import RNG_STREAMS, StatsLayout
from numbarl.cuda.runtime import Arena, cuda
from numbarl.env.params import (
    BR_DIRECTION,
    BR_SIZE,
    DIR_FLAT,
    DIR_LONG,
    DIR_SHORT,
    PORTFOLIO_DIM,
)
from numbarl.rl import gae
from numbarl.rl.agents.base import ArenaStateAgent, register
from numbarl.rl.losses.dt import DtLoss
from numbarl.rl.nets.base import ParamStore
from numbarl.rl.nets.dt import (
    TOKENS_PER_STEP,
    DecisionTransformerNet,
    branch_offsets,
    launch_tokens,
)
from numbarl.rl.optim import (
    STAT_LR,
    STAT_LR_SCALE,
    STAT_WARMUP_SCALE,
    Adam,
    AdamConfig,
    after_train_step_kernel,
    claim_optimizer_slots,
)
from numbarl.rl.schedules import ScheduleConfig

_cuda = cuda()

MAX_BRANCHES = 8
TRUNCATION_WEIGHT = 0.05  # the discounted tail a sampled window may miss at the dataset's end
SLOT_COIN = RNG_STREAMS.claim("dt.behavior_coin", 230)  # behavior: random action (prob ε_i) or the oracle
SLOT_ACTION = RNG_STREAMS.claim("dt.behavior_action", 231, width=MAX_BRANCHES)  # + branch: the random action
SLOT_WINDOW_ENV = RNG_STREAMS.claim("dt.window_env", 240)  # lane = window: the env of a sampled window
SLOT_WINDOW_START = RNG_STREAMS.claim("dt.window_start", 241)  # lane = window: its first step

DT_STATS = StatsLayout("dt agent")
claim_optimizer_slots(DT_STATS)  # slots 0..11: the optimizer writes them
STAT_LOSS = DT_STATS.slot("loss", 12)  # mean action cross-entropy (summed over branches) of the last batch
STAT_ACCURACY = DT_STATS.slot("dt_action_acc", 13)  # share of branch actions predicted (first argmax), last batch
STAT_RETURN_STD = DT_STATS.slot("dt_return_std", 14)  # std of the dataset's raw returns-to-go (last refresh)
STAT_EPSILON = DT_STATS.slot("epsilon", 15)  # always 0 (the trainer's status line reads it)
STAT_COLLECT_STEP = DT_STATS.slot("collect_step", 16, kind="int")
STAT_TRAIN_STEP = DT_STATS.slot("train_step", 17, kind="int")  # optimizer steps
STAT_UPDATES = DT_STATS.slot("dt_updates", 18, kind="int")  # dataset refreshes trained on
STAT_NONFINITE_STEP = DT_STATS.slot("nonfinite_step", 19, kind="int")  # first non-finite train step (-1 = none)
STAT_NONFINITE_WHAT = DT_STATS.slot("nonfinite_what", 20, kind="int")  # 1 = loss, 2 = gradients


def _grid(n: int) -> tuple[int, int]:
    return gae.grid(n)


def window_starts(rollout: int, context: int, gamma: float) -> int:
    """How many window starts the dataset offers: t0 in [0, T − L − tail] (module docstring)."""
    room = int(rollout) - int(context)
    if room < 0:
        raise ValueError(f"agent.dt_rollout = {rollout} must be >= agent.dt_context = {context}")
    tail = room if gamma >= 1.0 else (0 if gamma <= 0.0 else math.ceil(math.log(TRUNCATION_WEIGHT) / math.log(gamma)))
    return room - min(tail, room) + 1


def hindsight_signal(mid, lo: int, hi: int, horizon: int) -> np.ndarray:
    """signal[b] = mid[min(b + H, hi − 1)] − mid[b] for b in [lo, hi), 0 elsewhere (float32 [n_bars])."""
    mid = np.asarray(mid, np.float64)
    out = np.zeros(mid.shape[0], np.float32)
    bars = np.arange(lo, hi)
    out[lo:hi] = mid[np.minimum(bars + int(horizon), hi - 1)] - mid[bars]
    return out


def returns_ref(reward, done, gamma: float) -> np.ndarray:
    """G [T, N] = r + γ (1 − done) G_next, G_T = 0, in float64."""
    reward, done = np.asarray(reward, np.float64), np.asarray(done)
    out = np.zeros_like(reward)
    g = np.zeros(reward.shape[1])
    for t in range(reward.shape[0] - 1, -1, -1):
        g = reward[t] + gamma * np.where(done[t] != 0, 0.0, g)
        out[t] = g
    return out


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def behavior_kernel(mask, cursor, signal, noise, sizes, seed, counter, pos, obs, actions, preference, d_obs,
                    d_actions):
    """One thread per env i: the behavior action (module docstring) over the env's mask; dataset[t]
    (the obs's first d_obs.shape[2] columns: the market features unless agent.dt_portfolio)."""
    i = _cuda.grid(1)
    N = actions.shape[0]
    if i >= N:
        return
    t = pos[0]
    for c in range(d_obs.shape[2]):
        d_obs[t, i, c] = obs[i, c]
    eps = noise * np.float32(i) / np.float32(N - 1) if N > 1 else np.float32(0.0)
    explore = rng.uniform(seed[0], i, counter[0], SLOT_COIN) < eps
    sig = signal[cursor[i]]
    for k in range(actions.shape[1]):
        n = sizes[k]
        allowed = 0
        for a in range(n):
            if mask[i, k, a] != 0:
                allowed += 1
        choice = 0
        if explore and allowed > 0:
            pick = rng.randint(seed[0], i, counter[0], SLOT_ACTION + k, allowed)
            for a in range(n):
                if mask[i, k, a] != 0:
                    if pick == 0:
                        choice = a
                        break
                    pick -= 1
        else:
            if k == BR_DIRECTION:
                choice = DIR_LONG if sig > 0 else (DIR_SHORT if sig < 0 else DIR_FLAT)
            elif k == BR_SIZE:
                choice = n - 1
            if choice >= n or mask[i, k, choice] == 0:  # not allowed here: flat / the first allowed
                fallback = -1
                if k == BR_DIRECTION and DIR_FLAT < n and mask[i, k, DIR_FLAT] != 0:
                    fallback = DIR_FLAT
                else:
                    for a in range(n):
                        if mask[i, k, a] != 0:
                            fallback = a
                            break
                choice = fallback if fallback >= 0 else 0
        actions[i, k] = choice
        d_actions[t, i, k] = choice
    preference[i] = np.float32(0.0)


@_cuda.jit(cache=True)
def record_kernel(reward, done, pos, d_reward, d_done):
    i = _cuda.grid(1)
    if i < reward.shape[0]:
        t = pos[0]
        d_reward[t, i] = reward[i]
        d_done[t, i] = done[i]


@_cuda.jit(cache=True)
def advance_kernel(pos, collect_step, T, stats):
    """pos = (pos + 1) mod T, collect_step += 1 (one thread)."""
    if _cuda.grid(1) == 0:
        pos[0] = (pos[0] + 1) % T
        collect_step[0] += 1
        stats[STAT_COLLECT_STEP] = np.float32(collect_step[0])
        stats[STAT_EPSILON] = np.float32(0.0)


@_cuda.jit(cache=True)
def returns_kernel(reward, done, gamma, rtg):
    """One thread per env: the reverse scan G_t = r_t + γ (1 − done_t) G_{t+1} in float64."""
    i = _cuda.grid(1)
    if i >= reward.shape[1]:
        return
    g = np.float64(0.0)
    for t in range(reward.shape[0] - 1, -1, -1):
        if done[t, i] != 0:
            g = np.float64(0.0)
        g = np.float64(reward[t, i]) + gamma * g
        rtg[t, i] = np.float32(g)


@_cuda.jit(cache=True)
def sample_kernel(seed, updates, n_steps, step, n_starts, d_obs, d_actions, rtg, mb_rtg, mb_obs, mb_actions):
    """One thread per window w: env and start keyed by (seed, lane w, counter = updates·K + step)."""
    w = _cuda.grid(1)
    if w >= mb_obs.shape[0]:
        return
    counter = updates[0] * n_steps + step
    env = rng.randint(seed, w, counter, SLOT_WINDOW_ENV, d_obs.shape[1])
    t0 = rng.randint(seed, w, counter, SLOT_WINDOW_START, n_starts)
    for t in range(mb_obs.shape[1]):
        mb_rtg[w, t] = rtg[t0 + t, env]
        for c in range(mb_obs.shape[2]):
            mb_obs[w, t, c] = d_obs[t0 + t, env, c]
        for k in range(mb_actions.shape[2]):
            mb_actions[w, t, k] = d_actions[t0 + t, env, k]


@_cuda.jit(cache=True)
def after_update_kernel(updates, norm_scal, stats):
    if _cuda.grid(1) == 0:
        updates[0] += 1
        stats[STAT_UPDATES] = np.float32(updates[0])
        stats[STAT_RETURN_STD] = norm_scal[2]


@_cuda.jit(cache=True)
def eval_push_kernel(obs, count, hist_obs, hist_act):
    """One thread per policy p: append obs (its first hist_obs.shape[2] columns) to its last-L history
    (shift when full); action unknown (−1)."""
    p = _cuda.grid(1)
    if p >= obs.shape[0]:
        return
    L = hist_obs.shape[1]
    n = count[p]
    if n >= L:
        for t in range(L - 1):
            for c in range(hist_obs.shape[2]):
                hist_obs[p, t, c] = hist_obs[p, t + 1, c]
            for k in range(hist_act.shape[2]):
                hist_act[p, t, k] = hist_act[p, t + 1, k]
        pos = L - 1
    else:
        pos = n
    for c in range(hist_obs.shape[2]):
        hist_obs[p, pos, c] = obs[p, c]
    for k in range(hist_act.shape[2]):
        hist_act[p, pos, k] = -1
    count[p] = n + 1


@_cuda.jit(cache=True)
def eval_scores_kernel(logits, count, offsets, sizes, hist_act, out):
    """out[p, k, a] = logits of the newest state token (−3e38 beyond a branch); its first argmax per
    branch becomes that step's action token. Direction: when the argmax is a side, the other side's
    score goes below flat's (module docstring: a masked side closes, it never holds)."""
    p = _cuda.grid(1)
    if p >= out.shape[0]:
        return
    L = hist_act.shape[1]
    pos = min(count[p] - 1, L - 1)
    r = p * TOKENS_PER_STEP * L + TOKENS_PER_STEP * pos + 1
    for k in range(out.shape[1]):
        best = 0
        for a in range(out.shape[2]):
            if k < offsets.shape[0] and a < sizes[k]:
                v = logits[r, offsets[k] + a]
                out[p, k, a] = v
                if v > logits[r, offsets[k] + best]:
                    best = a
            else:
                out[p, k, a] = np.float32(-3.0e38)
        if k < offsets.shape[0]:
            hist_act[p, pos, k] = best
            if k == BR_DIRECTION and sizes[k] == 3 and best != DIR_FLAT:
                other = DIR_SHORT if best == DIR_LONG else DIR_LONG
                below = out[p, k, DIR_FLAT] - np.float32(1.0)
                out[p, k, other] = min(out[p, k, other], below)


@_cuda.jit(cache=True)
def zero_count_kernel(count):
    p = _cuda.grid(1)
    if p < count.shape[0]:
        count[p] = 0


# ---------------------------------------------------------------------------------------------
# the agent
# ---------------------------------------------------------------------------------------------
@register("dt")
class DTAgent(ArenaStateAgent):
    """Decision Transformer trained on behavior trajectories of the device envs (module docstring)."""

    eps_end = 0.0  # the DT never explores (the feedback loop's epsilon reads this)

    def __init__(self, cfg: AgentConfig, state_dim: int, branch_sizes, n_envs: int, seed: int,
                 eval_batch: int = 1, epsilon=None, branch_lr: bool = False, feature_names=None):
        self.cfg = cfg  # feature_names: unused (no option of this agent names obs columns)
        self.state_dim, self.n_envs, self.seed = int(state_dim), int(n_envs), int(seed)
        # the state token's features: the obs's first columns (the market's unless agent.dt_portfolio)
        self.token_dim = self.state_dim if cfg.dt_portfolio else self.state_dim - PORTFOLIO_DIM
        if self.token_dim < 1:
            raise ValueError(f"dt: state_dim = {state_dim} has no market features before the {PORTFOLIO_DIM} portfolio "
                             "ones (agent.dt_portfolio = true reads them all)")
        self.branch_sizes = tuple(int(b) for b in branch_sizes)
        self.n_branches = len(self.branch_sizes)
        if self.n_branches > MAX_BRANCHES:
            raise ValueError(f"dt: at most {MAX_BRANCHES} action branches, got {self.n_branches}")
        self.max_actions = max(self.branch_sizes)
        self.L, self.T, self.B, self.K = int(cfg.dt_context), int(cfg.dt_rollout), int(cfg.dt_batch), int(cfg.dt_updates)
        self.n_starts = window_starts(self.T, self.L, cfg.dt_gamma)
        self.eval_batch = P = int(eval_batch)
        N, S, nb, L, T, B = self.n_envs, self.token_dim, self.n_branches, self.L, self.T, self.B

        # NETWORK: one flat parameter buffer, one optimizer group "dt"
        self.store = ParamStore()
        self.net = DecisionTransformerNet("dt", S, self.branch_sizes, L, cfg.dt_embed, cfg.dt_heads, cfg.dt_layers,
                                          cfg.activation, compute=cfg.compute)
        self.net.declare_params(self.store)
        self.acts = Arena("dt.activations")
        self.net.declare_acts(self.acts, B * TOKENS_PER_STEP * L, "train", backward=True)
        self.net.declare_acts(self.acts, P * TOKENS_PER_STEP * L, "eval", backward=False)
        self.store.allocate()
        self.acts.allocate()
        self.store.init(np.random.default_rng(self.seed))

        # DATASET [T, N, ...] written by the envs, and the sampled windows [B, L, ...]
        d = Arena("dt.dataset")
        d.add("obs", (T, N, S), np.float32)
        d.add("actions", (T, N, nb), np.int32)
        d.add("reward", (T, N), np.float32)
        d.add("done", (T, N), np.uint8)
        d.add("rtg", (T, N), np.float32)
        d.allocate()
        self.data = d
        w = Arena("dt.work")
        w.add("mb_rtg", (B, L), np.float32)
        w.add("mb_obs", (B, L, S), np.float32)
        w.add("mb_actions", (B, L, nb), np.int32)
        w.add("tokens", (B * TOKENS_PER_STEP * L, self.net.in_dim), np.float32)
        w.add("offsets", (nb,), np.int32)
        w.add("sizes", (nb,), np.int32)
        w.allocate()
        w.load({"offsets": branch_offsets(self.branch_sizes), "sizes": np.asarray(self.branch_sizes, np.int32)})
        self.work = w
        # EVALUATION STATE (the backtest's policies): the last L observations and actions, a count
        e = Arena("dt.eval")
        e.add("hist_obs", (P, L, S), np.float32)
        e.add("hist_act", (P, L, nb), np.int32)
        e.add("count", (P,), np.int64)
        e.add("rtg", (P, L), np.float32)
        e.add("tokens", (P * TOKENS_PER_STEP * L, self.net.in_dim), np.float32)
        e.allocate()
        e.load({"rtg": np.full((P, L), cfg.dt_target, np.float32), "hist_act": np.full((P, L, nb), -1, np.int32)})
        self.eval_state = e
        self.normalizer = gae.AdvantageNormalizer(T * N)
        self.signal = None  # device float32 [n_bars], made by step_functions (or set_behavior_signal)
        self._signal_host = None

        self.scalars = Arena("dt.scalars")
        for name in ("pos", "collect_step", "train_step", "updates"):
            self.scalars.add(name, (1,), np.int64)
        self.scalars.allocate()
        self.stats_layout = DT_STATS.copy()
        self.stats = MappedBuffer(self.stats_layout.size, np.float32)
        self.stats.reset(0)
        self.stats.host[STAT_NONFINITE_STEP] = -1.0

        # LOSS, OPTIMIZER
        self.loss = DtLoss(B, L, self.branch_sizes)
        self.optim = Adam(self.store, AdamConfig(lr=cfg.lr, beta1=cfg.adam_beta1, beta2=cfg.adam_beta2, eps=cfg.adam_eps,
                                                 weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm),
                          None, stats=self.stats.device,
                          schedule=ScheduleConfig(cfg.lr_warmup_steps, cfg.lr_cycle_steps, cfg.lr_min_frac,
                                                  cfg.restart_momentum_scale))
        self.optim.allocate()
        self.stats.host[STAT_LR_SCALE] = 1.0
        self.stats.host[STAT_WARMUP_SCALE] = 1.0
        self.stats.host[STAT_LR] = np.float32(cfg.lr)

    # -- the behavior's signal ---------------------------------------------------------------------
    def set_behavior_signal(self, signal) -> None:
        """The oracle the behavior follows (float32 [n_bars] of the env's market, its sign = the
        direction), e.g. the synthetic cache's planted oracle. Call before step_functions."""
        host = np.ascontiguousarray(signal, np.float32).reshape(-1)
        if self.signal is not None:  # already on the device (and maybe in a captured graph): in place
            if self.signal.shape != host.shape:
                raise ValueError(f"dt: the behavior signal has {host.shape[0]} bars, the env's market "
                                 f"{self.signal.shape[0]}")
            self.signal.copy_to_device(host)
        self._signal_host = host

    def _ensure_signal(self, env) -> None:
        if self.signal is not None:
            return
        n_bars = int(env.market.n_bars)
        host = self._signal_host
        if host is None:
            host = hindsight_signal(env.market.data.mid, env.lo, env.hi, self.cfg.dt_oracle_horizon)
        elif host.shape[0] != n_bars:
            raise ValueError(f"dt: the behavior signal has {host.shape[0]} bars, the env's market {n_bars}")
        self.signal = _cuda.to_device(host)

    # -- the agent contract: graphs and their schedule ------------------------------------------
    def step_functions(self, env) -> dict:
        self._ensure_signal(env)  # allocated here, before any capture
        return {"collect": lambda s: self.collect_step(env, s), "update": self.update_step}

    def after_collect(self, collect_steps: int, learning_starts: int, train_every: int) -> tuple[str, ...]:
        """The update after every agent.dt_rollout-th collect step (the dataset is then rewritten)."""
        return ("update",) if collect_steps > 0 and collect_steps % self.T == 0 else ()

    def train_phases(self) -> list:
        return [("update", self.update_step)]

    # -- COLLECT ----------------------------------------------------------------------------------
    def collect_step(self, env, stream):
        t, d, N = env.transition, self.data, self.n_envs
        obs, mask = env.gather(t.obs, t.mask, stream)
        preference = env.arena["preference"]
        behavior_kernel[_grid(N) + (stream,)](mask, env.state.cursor, self.signal, np.float32(self.cfg.dt_behavior_noise),
                                              self.work["sizes"], env.seed_dev, env.counter, self.scalars["pos"], obs,
                                              t.actions, preference, d["obs"], d["actions"])
        out = env.step(t.actions, preference, stream=stream)
        record_kernel[_grid(N) + (stream,)](out.reward, out.done, self.scalars["pos"], d["reward"], d["done"])
        advance_kernel[1, 1, stream](self.scalars["pos"], self.scalars["collect_step"], np.int64(self.T),
                                     self.stats.device)
        env.advance(stream)

    # -- UPDATE -----------------------------------------------------------------------------------
    def update_step(self, stream):
        """RETURNS on the dataset, then agent.dt_updates gradient steps on sampled windows. Capturable."""
        d, w = self.data, self.work
        # RETURNS
        returns_kernel[_grid(self.n_envs) + (stream,)](d["reward"], d["done"], np.float64(self.cfg.dt_gamma), d["rtg"])
        self.normalizer.run(d["rtg"], stream)
        for k in range(self.K):
            # SAMPLE
            sample_kernel[_grid(self.B) + (stream,)](np.uint64(self.seed), self.scalars["updates"], np.int64(self.K),
                                                     np.int64(k), np.int64(self.n_starts), d["obs"], d["actions"],
                                                     d["rtg"], w["mb_rtg"], w["mb_obs"], w["mb_actions"])
            # TOKENS
            launch_tokens(w["mb_rtg"], w["mb_obs"], w["mb_actions"], w["offsets"], w["tokens"], stream)
            self.train_window_batch(stream, last=k == self.K - 1)
        after_update_kernel[1, 1, stream](self.scalars["updates"], self.normalizer.scal, self.stats.device)

    def train_window_batch(self, stream, last: bool = True):
        """One gradient step on the token buffer (forward, loss, backward, AdamW, stats)."""
        w = self.work
        self.store.begin_step()
        # FORWARD
        logits = self.net.forward(w["tokens"], stream, tag="train")
        # LOSS
        self.loss.apply({"logits": logits, "actions": w["mb_actions"]}, {"logits": self.loss.grad("logits")}, stream,
                        ledger=self.store)
        # BACKWARD
        self.net.backward(self.loss.grad("logits"), stream, tag="train")
        # UPDATE
        self.optim.step(stream)
        # STATS
        after_train_step_kernel[1, 1, stream](self.loss.loss, self.scalars["train_step"], self.stats.device,
                                             STAT_TRAIN_STEP, STAT_LOSS, STAT_NONFINITE_STEP, STAT_NONFINITE_WHAT)
        if last:
            self.loss.accuracy(self.stats.device, STAT_ACCURACY, stream)

    # -- acting (the backtest) ------------------------------------------------------------------
    def scores(self, obs, out, stream):
        """Push obs into each policy's history, run the DT on its window, write the newest state
        token's logits per branch [P, n_branches, max_actions] (greedy = the DT's action)."""
        e, P = self.eval_state, self.eval_batch
        if obs.shape[0] != P:
            raise ValueError(f"dt: the backtest has {obs.shape[0]} policies, the agent was built with eval_batch = {P}")
        eval_push_kernel[_grid(P) + (stream,)](obs, e["count"], e["hist_obs"], e["hist_act"])
        launch_tokens(e["rtg"], e["hist_obs"], e["hist_act"], self.work["offsets"], e["tokens"], stream)
        logits = self.net.forward(e["tokens"], stream, tag="eval")
        eval_scores_kernel[_grid(P) + (stream,)](logits, e["count"], self.work["offsets"], self.work["sizes"],
                                                 e["hist_act"], out)

    def reset_eval(self, stream) -> None:
        zero_count_kernel[_grid(self.eval_batch) + (stream,)](self.eval_state["count"])

    # -- checkpoints ----------------------------------------------------------------------------
    # state_arrays, load_state, load_params, read_stats, nonfinite_tensors: ArenaStateAgent
    data_label = "dataset"
    finite_data = ("obs", "reward", "rtg")

    @property
    def data_arena(self):
        return self.data
