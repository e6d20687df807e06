"""PPO (Schulman, Wolski, Dhariwal, Radford & Klimov 2017) on the device envs: two captured graphs.

``agent.kind = "ppo"``. Network: the shared trunk (numbarl's Mlp) with a policy head ``pi`` (one
Linear to Σ_k A_k logits: branch k's logits are columns [o_k, o_k + A_k); a masked softmax per
branch over the env's mask, the branches independent) and a value head ``v`` (one Linear to 1).
Optimizer groups: trunk, head.pi, head.v. No target network.

``collect_step(stream)`` — one env step of all N envs, every step::

    # COLLECT   obs, mask = env.gather()                              [N, state_dim], [N, n_b, max A]
    #           logits, V = pi(trunk(obs)), v(trunk(obs))              tag "act"
    #           a_k ~ masked categorical per branch (inverse CDF of one counter-RNG uniform keyed by
    #                 (env seed, lane = env, env step counter, slot ppo.action + k))
    #           rollout[t] ← obs, a, log π(a) = Σ_k log π_k(a_k), V, mask        t = pos (device)
    #           r, done = env.step(a, preference = l_long − l_short of the direction branch)
    #           rollout[t] ← r, done;  pos = (pos + 1) mod T

``update_step(stream)`` — after every T-th collect step (``after_collect`` returns ("update",))::

    # BOOTSTRAP obs_T = env.gather() (the state after the rollout); V_T = v(trunk(obs_T))
    # GAE       A, R = gae(r, done, V, V_T; γ = agent.gamma, λ = agent.gae_lambda)   numbarl/rl/gae.py
    #           A ← (A − mean) / (std + 1e-8) over the T·N rollout (fixed-order reductions)
    # for epoch e < K:   perm = keyed Feistel permutation of [0, T·N) (counter = update·K + e)
    #   for m < M:       minibatch = rows perm[m B : (m + 1) B], B = T·N // M (the rest of the
    #                    permutation is not used this epoch)
    #     forward trunk, pi, v (tag "train"); the PPO loss (numbarl/rl/losses/ppo.py: clip ε, value
    #     coefficient c_v, entropy coefficient c_e); backward: pi writes dh, v adds (the gradient
    #     ledger), the trunk's backward on the sum; AdamW with the global-norm clip (numbarl/rl/optim.py)
    # STATS     the last minibatch's loss terms, approx_kl, clip_frac → mapped stats

Everything is enqueued with fixed shapes and device counters: both functions are captured once and
replayed. ``scores`` (backtests) writes the logits per branch, so the backtest's greedy choice (the
first argmax over the mask) is the mode of the masked categorical.

Stats: loss, policy_loss, value_loss, entropy (of the joint action), approx_kl (k3 estimator),
clip_frac, adv_std (the raw GAE advantages' std before normalization), epsilon (always 0: PPO does
not use it; the trainer's status line reads it), train_step (optimizer steps), ppo_updates,
collect_step, nonfinite_step / nonfinite_what (as the c51 agent's), and the optimizer's slots.
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.config import AgentConfig
from numbarl.cuda import rng
from numbarl.cuda.mapped import MappedBuffer
from numbarl.cuda.registry import RNG_STREAMS, StatsLayout
from numbarl.cuda.runtime import Arena, cuda
from numbarl.env.params import BR_DIRECTION, DIR_LONG, DIR_SHORT
from numbarl.rl import gae
from numbarl.rl.agents.base import ArenaStateAgent, register
from numbarl.rl.losses.ppo import MAX_BRANCHES, PpoLoss
from numbarl.rl.nets.base import ParamStore
from numbarl.rl.nets.linear import Linear
from numbarl.rl.nets.mlp import Mlp
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

SLOT_ACTION = RNG_STREAMS.claim("ppo.action", 220, width=4)  # + branch: the sampled action of branch k

# mapped stats (float32, named): the optimizer writes its slots 0..11 straight into this vector
PPO_STATS = StatsLayout("ppo agent")
claim_optimizer_slots(PPO_STATS)  # slots 0..11: the optimizer writes them
STAT_LOSS = PPO_STATS.slot("loss", 12)  # mean PPO loss of the last minibatch
STAT_POLICY = PPO_STATS.slot("policy_loss", 13)  # mean clipped-surrogate loss (last minibatch)
STAT_VALUE = PPO_STATS.slot("value_loss", 14)  # mean ½(V − R)² (last minibatch)
STAT_ENTROPY = PPO_STATS.slot("entropy", 15)  # mean entropy of the joint action (last minibatch)
STAT_KL = PPO_STATS.slot("approx_kl", 16)  # mean (ρ − 1) − log ρ (last minibatch)
STAT_CLIPFRAC = PPO_STATS.slot("clip_frac", 17)  # share of |ρ − 1| > ε (last minibatch)
STAT_ADV_STD = PPO_STATS.slot("adv_std", 18)  # std of the raw GAE advantages of the last rollout
STAT_EPSILON = PPO_STATS.slot("epsilon", 19)  # always 0 (the trainer's status line reads it)
STAT_COLLECT_STEP = PPO_STATS.slot("collect_step", 20, kind="int")
STAT_TRAIN_STEP = PPO_STATS.slot("train_step", 21, kind="int")  # optimizer steps (K·M per update)
STAT_UPDATES = PPO_STATS.slot("ppo_updates", 22, kind="int")  # rollouts trained on
STAT_NONFINITE_STEP = PPO_STATS.slot("nonfinite_step", 23, kind="int")  # first non-finite train step (-1 = none)
STAT_NONFINITE_WHAT = PPO_STATS.slot("nonfinite_what", 24, kind="int")  # 1 = loss, 2 = gradients
N_STATS = PPO_STATS.size


def _grid(n: int) -> tuple[int, int]:
    return gae.grid(n)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def act_kernel(logits, value, mask, offsets, sizes, seed, counter, pos, obs, actions, preference, pref_cols,
               r_obs, r_actions, r_logp, r_value, r_mask):
    """One thread per env i: sample each branch from its masked categorical (inverse CDF of one
    uniform, float64), the joint log-prob, and write step t = pos[0] of the rollout."""
    i = _cuda.grid(1)
    if i >= logits.shape[0]:
        return
    t = pos[0]
    for c in range(obs.shape[1]):
        r_obs[t, i, c] = obs[i, c]
    logp = np.float64(0.0)
    for k in range(offsets.shape[0]):
        o = offsets[k]
        n = sizes[k]
        for a in range(mask.shape[2]):
            r_mask[t, i, k, a] = mask[i, k, a]
        m = -np.inf
        for a in range(n):
            if mask[i, k, a] != 0:
                m = max(m, np.float64(logits[i, o + a]))
        s = np.float64(0.0)
        for a in range(n):
            if mask[i, k, a] != 0:
                s += math.exp(np.float64(logits[i, o + a]) - m)
        u = np.float64(rng.uniform(seed[0], i, counter[0], SLOT_ACTION + k)) * s
        chosen = -1
        acc = np.float64(0.0)
        for a in range(n):
            if mask[i, k, a] != 0:
                acc += math.exp(np.float64(logits[i, o + a]) - m)
                chosen = a
                if acc > u:
                    break
        if chosen < 0:  # no allowed action (never from the env): the first one, log-prob of a uniform
            chosen = 0
            logp += -math.log(np.float64(n))
        else:
            logp += np.float64(logits[i, o + chosen]) - m - math.log(s)
        actions[i, k] = chosen
        r_actions[t, i, k] = chosen
    r_logp[t, i] = np.float32(logp)
    r_value[t, i] = value[i, 0]
    if pref_cols[0] >= 0:
        preference[i] = logits[i, pref_cols[0]] - logits[i, pref_cols[1]]
    else:
        preference[i] = np.float32(0.0)


@_cuda.jit(cache=True)
def record_kernel(reward, done, pos, r_reward, r_done):
    i = _cuda.grid(1)
    if i < reward.shape[0]:
        t = pos[0]
        r_reward[t, i] = reward[i]
        r_done[t, i] = done[i]


@_cuda.jit(cache=True)
def advance_kernel(pos, collect_step, T, stats):
    """pos = (pos + 1) mod T, collect_step += 1 (one thread)."""
    if _cuda.grid(1) == 0:
        pos[0] = (pos[0] + 1) % T
        collect_step[0] += 1
        stats[STAT_COLLECT_STEP] = np.float32(collect_step[0])
        stats[STAT_EPSILON] = np.float32(0.0)


@_cuda.jit(cache=True)
def after_update_kernel(updates, norm_scal, stats):
    if _cuda.grid(1) == 0:
        updates[0] += 1
        stats[STAT_UPDATES] = np.float32(updates[0])
        stats[STAT_ADV_STD] = norm_scal[2]


@_cuda.jit(cache=True)
def scores_kernel(logits, offsets, sizes, out):
    """out[p, k, a] = logits[p, o_k + a] for a < A_k, else −3e38 (never the argmax)."""
    p = _cuda.grid(1)
    if p >= out.shape[0]:
        return
    for k in range(out.shape[1]):
        for a in range(out.shape[2]):
            if k < offsets.shape[0] and a < sizes[k]:
                out[p, k, a] = logits[p, offsets[k] + a]
            else:
                out[p, k, a] = np.float32(-3.0e38)


# ---------------------------------------------------------------------------------------------
# the agent
# ---------------------------------------------------------------------------------------------
@register("ppo")
class PPOAgent(ArenaStateAgent):
    """Branched categorical actor-critic trained by PPO (module docstring)."""

    eps_end = 0.0  # PPO explores by sampling its policy (the feedback loop's epsilon reads this)

    def __init__(self, cfg: AgentConfig, state_dim: int, branch_sizes, n_envs: int, seed: int,
                 eval_batch: int = 1, epsilon=None, branch_lr: bool = False, feature_names=None):
        self.cfg = cfg  # feature_names: unused (no option of this agent names obs columns)
        self.state_dim, self.n_envs, self.seed = int(state_dim), int(n_envs), int(seed)
        self.branch_sizes = tuple(int(b) for b in branch_sizes)
        self.n_branches = len(self.branch_sizes)
        if self.n_branches > MAX_BRANCHES:
            raise ValueError(f"ppo: at most {MAX_BRANCHES} action branches, got {self.n_branches}")
        self.max_actions = max(self.branch_sizes)
        self.width = sum(self.branch_sizes)
        self.T, self.K, self.M = int(cfg.ppo_rollout), int(cfg.ppo_epochs), int(cfg.ppo_minibatches)
        n_rows = self.T * self.n_envs
        self.M = min(self.M, n_rows)  # a rollout of fewer rows than minibatches (one env: a backtest-only agent)
        self.B = B = n_rows // self.M
        N, S, nb, A = self.n_envs, self.state_dim, self.n_branches, self.max_actions

        # NETWORK: trunk + policy logits + value, one flat parameter buffer
        self.store = ParamStore()
        self.trunk = Mlp("trunk", S, cfg.trunk, activation=cfg.activation, compute=cfg.compute)
        self.pi = Linear("pi", self.trunk.out_dim, self.width, None, group="head.pi", compute=cfg.compute)
        self.v = Linear("v", self.trunk.out_dim, 1, None, group="head.v", compute=cfg.compute)
        for mod in (self.trunk, self.pi, self.v):
            mod.declare_params(self.store)
        self.acts = Arena("ppo.activations")
        for tag, batch, backward in (("act", N, False), ("train", B, True), ("eval", int(eval_batch), False)):
            for mod in (self.trunk, self.pi, self.v):
                mod.declare_acts(self.acts, batch, tag, backward=backward)
        self.acts.add("dh", (B, self.trunk.out_dim), np.float32)  # pi writes, v adds, the trunk reads
        self.store.allocate()
        self.acts.allocate()
        self.store.init(np.random.default_rng(self.seed))

        # ROLLOUT [T, N, ...] and the minibatch [B, ...]
        r = Arena("ppo.rollout")
        r.add("obs", (self.T, N, S), np.float32)
        r.add("actions", (self.T, N, nb), np.int32)
        r.add("logp", (self.T, N), np.float32)
        r.add("value", (self.T, N), np.float32)
        r.add("reward", (self.T, N), np.float32)
        r.add("done", (self.T, N), np.uint8)
        r.add("mask", (self.T, N, nb, A), np.uint8)
        r.add("adv", (self.T, N), np.float32)
        r.add("ret", (self.T, N), np.float32)
        r.allocate()
        self.rollout = r
        w = Arena("ppo.work")
        w.add("boot_obs", (N, S), np.float32)
        w.add("boot_mask", (N, nb, A), np.uint8)
        w.add("perm", (n_rows,), np.int64)
        w.add("mb_obs", (B, S), np.float32)
        w.add("mb_actions", (B, nb), np.int32)
        w.add("mb_logp", (B,), np.float32)
        w.add("mb_adv", (B,), np.float32)
        w.add("mb_ret", (B,), np.float32)
        w.add("mb_mask", (B, nb, A), np.uint8)
        w.add("offsets", (nb,), np.int32)
        w.add("sizes", (nb,), np.int32)
        w.add("pref_cols", (2,), np.int64)
        w.allocate()
        offsets = np.concatenate([[0], np.cumsum(self.branch_sizes)[:-1]]).astype(np.int32)
        pref = ([int(offsets[BR_DIRECTION]) + DIR_LONG, int(offsets[BR_DIRECTION]) + DIR_SHORT]
                if self.branch_sizes[BR_DIRECTION] > DIR_LONG else [-1, -1])
        w.load({"offsets": offsets, "sizes": np.asarray(self.branch_sizes, np.int32),
                "pref_cols": np.asarray(pref, np.int64)})
        self.work = w
        self.normalizer = gae.AdvantageNormalizer(n_rows)

        # device counters and the mapped stats (the optimizer writes its slots straight into them)
        self.scalars = Arena("ppo.scalars")
        for name in ("pos", "collect_step", "train_step", "updates"):
            self.scalars.add(name, (1,), np.int64)
        self.scalars.allocate()
        self.stats_layout = PPO_STATS.copy()
        self.stats = MappedBuffer(self.stats_layout.size, np.float32)
        self.stats.reset(0)
        self.stats.host[STAT_NONFINITE_STEP] = -1.0

        # LOSS, OPTIMIZER
        self.loss = PpoLoss(B, self.branch_sizes, cfg.ppo_clip, cfg.ppo_value_coef, cfg.ppo_entropy_coef)
        self.optim = Adam(self.store, AdamConfig(lr=cfg.lr, beta1=cfg.adam_beta1, beta2=cfg.adam_beta2, eps=cfg.adam_eps,
                                                 weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm),
                          None, stats=self.stats.device,
                          schedule=ScheduleConfig(cfg.lr_warmup_steps, cfg.lr_cycle_steps, cfg.lr_min_frac,
                                                  cfg.restart_momentum_scale))
        self.optim.allocate()
        self.stats.host[STAT_LR_SCALE] = 1.0
        self.stats.host[STAT_WARMUP_SCALE] = 1.0
        self.stats.host[STAT_LR] = np.float32(cfg.lr)

    # -- network passes ------------------------------------------------------------------------
    def forward(self, obs, stream, tag: str):
        """(logits [batch, Σ A_k], value [batch, 1]) of the online network."""
        h = self.trunk.forward(obs, stream, tag=tag)
        return self.pi.forward(h, stream, tag=tag), self.v.forward(h, stream, tag=tag)

    def scores(self, obs, out, stream):
        """The eval pass's logits per branch [P, n_branches, max_actions] (greedy = the mode)."""
        logits, _ = self.forward(obs, stream, tag="eval")
        w = self.work
        scores_kernel[_grid(out.shape[0]) + (stream,)](logits, w["offsets"], w["sizes"], out)

    # -- the agent contract: graphs and their schedule ------------------------------------------
    def step_functions(self, env) -> dict:
        return {"collect": lambda s: self.collect_step(env, s), "update": lambda s: self.update_step(env, s)}

    def after_collect(self, collect_steps: int, learning_starts: int, train_every: int) -> tuple[str, ...]:
        """The update after every agent.ppo_rollout-th collect step (the rollout is then full). On-policy:
        train.learning_starts and train.train_every (replay settings) do not apply."""
        return ("update",) if collect_steps > 0 and collect_steps % self.T == 0 else ()

    # -- COLLECT ----------------------------------------------------------------------------------
    def collect_step(self, env, stream):
        t, r, w, N = env.transition, self.rollout, self.work, self.n_envs
        obs, mask = env.gather(t.obs, t.mask, stream)
        logits, value = self.forward(obs, stream, tag="act")
        preference = env.arena["preference"]
        act_kernel[_grid(N) + (stream,)](logits, value, mask, w["offsets"], w["sizes"], env.seed_dev, env.counter,
                                         self.scalars["pos"], obs, t.actions, preference, w["pref_cols"],
                                         r["obs"], r["actions"], r["logp"], r["value"], r["mask"])
        out = env.step(t.actions, preference, stream=stream)
        record_kernel[_grid(N) + (stream,)](out.reward, out.done, self.scalars["pos"], r["reward"], r["done"])
        advance_kernel[1, 1, stream](self.scalars["pos"], self.scalars["collect_step"], np.int64(self.T),
                                     self.stats.device)
        env.advance(stream)

    # -- UPDATE -----------------------------------------------------------------------------------
    def update_step(self, env, stream):
        w = self.work
        # BOOTSTRAP: the value of the state after the rollout
        boot_obs, _ = env.gather(w["boot_obs"], w["boot_mask"], stream)
        _, boot_v = self.forward(boot_obs, stream, tag="act")
        self.train_on_rollout(boot_v, stream)

    def train_on_rollout(self, boot_v, stream):
        """GAE, advantage normalization and the K x M minibatch steps on the stored rollout, given the
        bootstrap value boot_v [N, 1] (device). Capturable."""
        r, w, N, T = self.rollout, self.work, self.n_envs, self.T
        gae.gae_kernel[_grid(N) + (stream,)](r["reward"], r["done"], r["value"], boot_v, np.float64(self.cfg.gamma),
                                             np.float64(self.cfg.gae_lambda), r["adv"], r["ret"])
        self.normalizer.run(r["adv"], stream)
        n_rows = T * N
        flat = {"obs": r["obs"].reshape(n_rows, self.state_dim), "actions": r["actions"].reshape(n_rows, self.n_branches),
                "logp": r["logp"].reshape(n_rows), "adv": r["adv"].reshape(n_rows), "ret": r["ret"].reshape(n_rows),
                "mask": r["mask"].reshape(n_rows, self.n_branches, self.max_actions)}
        for epoch in range(self.K):
            gae.permutation(w["perm"], self.seed, self.scalars["updates"], self.K, epoch, stream)
            for m in range(self.M):
                gae.gather_minibatch_kernel[_grid(self.B) + (stream,)](
                    w["perm"], np.int64(m * self.B), flat["obs"], flat["actions"], flat["logp"], flat["adv"],
                    flat["ret"], flat["mask"], w["mb_obs"], w["mb_actions"], w["mb_logp"], w["mb_adv"], w["mb_ret"],
                    w["mb_mask"])
                self.train_minibatch(stream, last=epoch == self.K - 1 and m == self.M - 1)
        after_update_kernel[1, 1, stream](self.scalars["updates"], self.normalizer.scal, self.stats.device)

    def train_minibatch(self, stream, last: bool = True):
        """One gradient step on the minibatch buffers (forward, loss, backward, AdamW)."""
        w = self.work
        self.store.begin_step()
        logits, value = self.forward(w["mb_obs"], stream, tag="train")
        inputs = {"logits": logits, "value": value, "actions": w["mb_actions"], "logp_old": w["mb_logp"],
                  "adv": w["mb_adv"], "ret": w["mb_ret"], "mask": w["mb_mask"]}
        self.loss.apply(inputs, {"logits": self.loss.grad("logits"), "value": self.loss.grad("value")}, stream,
                        ledger=self.store)
        dh = self.acts["dh"]
        self.pi.backward(self.loss.grad("logits"), stream, tag="train", dx_out=dh)
        self.v.backward(self.loss.grad("value"), stream, tag="train", dx_out=dh)
        self.trunk.backward(dh, stream, tag="train")
        self.optim.step(stream)
        after_train_step_kernel[1, 1, stream](self.loss.loss, self.scalars["train_step"], self.stats.device,
                                             STAT_TRAIN_STEP, STAT_LOSS, STAT_NONFINITE_STEP, STAT_NONFINITE_WHAT)
        if last:
            self.loss.means(self.stats.device, {"policy": STAT_POLICY, "value": STAT_VALUE, "entropy": STAT_ENTROPY,
                                                "kl": STAT_KL, "clipped": STAT_CLIPFRAC}, stream)

    # -- checkpoints ----------------------------------------------------------------------------
    # state_arrays, load_state, load_params, read_stats, nonfinite_tensors: ArenaStateAgent
    data_label = "rollout"
    finite_data = ("obs", "reward", "adv", "ret")

    @property
    def data_arena(self):
        return self.rollout
