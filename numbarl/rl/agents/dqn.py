"""Branched dueling C51 + double DQN, end to end on the device: two captured step graphs.

The agent only orchestrates (Dopamine style); the math lives in the layers, the loss and the
optimizer. Two step functions, each captured once as a CUDA graph and replayed (SPEC §2.1):

``collect_step(stream)``  — one env step of all N envs::

    # COLLECT   obs = state_gather(env)                      [N, state_dim]
    #           Q   = online net(obs)                         [N, n_branches, max_actions]
    #           a   = epsilon-greedy per branch over the env's mask (numbarl.rl.policies)
    #           r, done = env_step(a)                         fills, P&L, reward terms, soft reset
    #           replay.write(obs, a, r, done)                 next obs = the env's next row
    #           epsilon, counters advanced on the device

``train_step(stream)``  — one gradient step::

    # SAMPLE    batch = replay.sample(counter)                uniform, n-step returns
    # TARGETS   a* = argmax_a E[Z_online(next_obs)]           double DQN (van Hasselt et al. 2016);
    #                over A(next_obs) with agent.lock_aware_target (the env's mask of next_obs)
    #           p  = Z_target(next_obs)[a*]
    # LOSS      m  = Φ(R_n + (1-done) γ^m z, p)               dense projection, Bellemare et al. 2017 Eq. 7
    #           L  = mean_b mean_branch −Σ m log softmax(logits_online(obs)[a])
    # BACKWARD  d logits → head → trunk                       hand-written backward, cuBLASLt GEMMs
    # UPDATE    global-norm clip, AdamW, target copy/Polyak   flat buffers, device step counter
    # STATS     loss, Q-mean, grad norm, ... → mapped memory  read by the host only at log intervals

Nothing in either step allocates, copies to/from the host or synchronizes; every per-step scalar
(epsilon, RNG counters, optimizer step, learning rate) lives in device memory. The same functions
run eagerly with ``--no-graph`` and give the same numbers.

``diagnostics_step(stream)`` (replayed at log intervals only) adds, besides the per-group gradient
norms, atom utilisation and policy entropy, the Q statistics of the last train batch (C6): the std
of Q at the taken actions (``q_std``), the per-branch means (``q_mean.direction`` ...), the mean
|Q_online − Q_target| at the taken action (``q_divergence``; one target-network pass on the batch's
obs, tag "diag") and the mean |q_gap| of the last collect step (``q_gap_abs_mean``; ``q_gap_mean``
is the signed mean).

Switches with their own device state (all off by default; off, the train step's launches and bits
are those without them):

* ``agent.atom_entropy_max`` (C5): the C51 loss adds the −β·H gradient (numbarl/rl/losses/c51.py);
  the stats phase then turns the batch-mean probabilities of the taken actions into the atom
  utilisation u (fixed-order column sum), its EMA and the next step's β, all on the device.
* ``agent.support = "fit"``: the trainer calls ``fit_support(stream)`` once after the replay
  prefill (numbarl/rl/support.py); the support is device memory every graph reads.
* ``agent.adaptive_atoms`` (C4): the support's spacings are learned (numbarl/rl/losses/atoms.py):
  every C51 loss projects onto the head's device support (non-uniform Algorithm 1 once it moved),
  and the stats phase of the aux train steps, after agent.adaptive_atoms_warmup train steps, takes
  one ascent step on the entropy of the batch-mean projected target and rewrites that support.
* ``agent.freeze_reset``: the trainer feeds numbarl.rl.freeze.FreezeDetector one record per epoch
  and calls ``on_freeze(stream)`` when it fires (Adam moments of group 'head.adv' zeroed).
* ``agent.iqn`` (A1): an implicit quantile head on the trunk output (numbarl/rl/nets/iqn_head.py,
  optimizer group 'head.iqn'), an auxiliary loss: on the aux train steps the LOSS phase draws τ, τ′,
  runs the head on the target pass's trunk output (target parameters) and the online one, and the
  quantile Huber loss at the C51 double-DQN action (numbarl/rl/losses/quantile_huber.py); BACKWARD
  writes the C51 head's dh and adds the IQN head's into one buffer (the gradient ledger) and runs the
  trunk's backward once on the sum. On the other train steps the IQN gradients are zeroed (Adam then
  moves the head by its moments alone). Stats: iqn_loss, iqn_loss_ema, iqn_readiness. With
  agent.risk_budget the collect step writes ρ = readiness² (the exploration risk budget) before the env
  step, which scales the env's Kelly cap and DSR term by it (numbarl/env/core.py; stat risk_budget);
  otherwise the env's ρ is 1.
* ``agent.iql`` (A2): an expectile value head V(s) on the trunk output (numbarl/rl/nets/iql_value.py, a
  one-hidden-layer SiLU MLP, optimizer group 'head.iql'), an auxiliary loss: on the aux train steps the
  LOSS phase runs the TARGET network on the batch's obs (tag "iql_target": one extra forward per aux
  step; the paper regresses V on the target Q, and the online pass's Q would make V chase the
  network it shapes) and V on the online pass's trunk output, then the expectile loss against
  Q̂ = mean over branches of the target Q at each branch's taken action (numbarl/rl/losses/expectile.py,
  τ = agent.iql_expectile). BACKWARD: the C51 head writes dh, the IQN head (when on) and the value
  head add theirs (the gradient ledger), the trunk's backward runs once on the sum. On the other
  train steps the value head's gradients are zeroed. Stats: iql_loss, iql_v_mean (train step),
  iql_adv_mean (diagnostics: A = Q̂ − V of the taken plans on the last train batch). A is a
  diagnostic only: acting stays C51-greedy.
* ``agent.confidence_weight`` > 0 (A6, recursive confidence): a confidence head c(s) = σ(h·w + b) on the
  online trunk output (numbarl/rl/nets/confidence.py, optimizer group 'head.conf'), an auxiliary loss: on
  the aux train steps the LOSS phase runs the head on the online trunk output (obs) and, with target
  parameters, on the TARGET pass's trunk output (next_obs: the TARGETS phase's pass, no extra trunk pass),
  then the cross-entropy against y = 1{the n-step move had the sign of the online q_gap} where the window
  carries a verdict, else c_target(s′) (numbarl/rl/losses/confidence.py). Its gradient, scaled by the
  weight, adds into dh after the IQN / IQL heads' (the gradient ledger). On the other train steps its
  gradients are zeroed. Stats: confidence_loss (unweighted), confidence_mean, confidence_boot_frac.
  With agent.confidence_floor > 0 the gate (numbarl/rl/nets/confidence.py:ConfidenceGate) takes a flat env's
  entries away where c(s) < floor: on the greedy choice's mask after the acting pass (collect) and on the greedy scores
  (agent.scores), the head run on those passes' trunk outputs. Stats (diagnostics): confidence_gated_frac.
* ``agent.risk_head_weight`` > 0 (issue 15, T7, risk budget): a head ρ(s) = σ(h·w + b) on the online trunk
  output (numbarl/rl/nets/risk_head.py, optimizer group 'head.risk'), an auxiliary loss: the binary
  cross-entropy of ρ against the outcome of the trade each sampled row opened (1 if it closed with net
  P&L > 0), on the labelled rows only (numbarl/rl/losses/risk_head.py; the labels are written by the collect
  step after the replay write, from E6's entry tracking). Its input gradient adds into dh after the other
  auxiliary heads'. Stats: risk_head_loss, risk_head_rho_mean (batch mean of ρ), risk_head_labeled. With
  agent.risk_head_sizing (default) the collect step, after the behaviour policy and before env.step, lowers
  the size of each flat env's new entry to the largest grid size ≤ size·ρ (the replay stores the executed
  action), and agent.scores moves a flat policy's greedy size the same way. Stats (diagnostics):
  risk_head_resized_frac.
* ``agent.spectral_norm`` (comma list of layers, e.g. "trunk.fc1,head.value"): every pass reads
  W_sn = W / σ for those weights (numbarl/rl/nets/spectral_norm.py, the store's substitutes). Two
  phases join the train step: "spectral_grad" before UPDATE (dW = (dW_sn − ⟨dW_sn, W_sn⟩ v uᵀ) / σ)
  and "spectral" after STATS (one power iteration on the updated W, W_sn, and the target network's
  W_sn_target with its own σ from the online vectors). u, v are checkpointed (spectral/<layer>.u|v);
  stats spectral_sigma.<layer>.
* ``agent.curiosity_weight`` ≥ 0.001: ICM curiosity (numbarl/rl/nets/icm.py, numbarl/rl/losses/icm.py;
  optimizer groups 'icm.forward', 'icm.inverse'). A "curiosity" phase before LOSS, every train step:
  the forward model on (φ(obs), a) and the inverse model on (φ(obs), φ(next_obs)), φ the trunk outputs
  of the online and next passes (detached), their loss and backward, then reward′ = R_n + r_i
  (r_i = w · ½‖φ̂ − φ(next_obs)‖²/H / running scale, 0 where the window ended the episode) is the reward
  the C51 projection (and IQN's) reads. Stats: icm_loss, icm_forward_loss, icm_inverse_loss,
  intrinsic_reward_mean, icm_error_scale; the scale is checkpointed (icm/scale). With
  agent.curiosity_trunk_grad the inverse loss also trains the trunk: BACKWARD adds its ∂L/∂φ(obs) into
  dh after the heads and runs a second trunk backward on the "next" pass with its ∂L/∂φ(next_obs).
* ``agent.horizons`` (e.g. "1,5,20", must include agent.n_step): multi-horizon C51
  (numbarl/rl/losses/multi_horizon.py). The replay returns every horizon's window of the same draw;
  TARGETS adds the online ("next_h<h>") and target ("target_h<h>") passes on each extra horizon's
  next_obs (two forwards per extra horizon); LOSS runs one C51 loss per horizon with per-sample weights
  from the trend-strength feature agent.horizon_regime_col, the n_step horizon (the agent's own loss)
  first, the others adding into its d_logits. The logged ``loss`` is the blended loss. What rewrites
  the n-step batch's reward (ICM's intrinsic reward, E1's reward offset) reaches the n_step horizon
  only; the other horizons read the replay's raw returns. Stats:
  mh_trend_mean, mh_weight_longest, mh_ce_longest and mh_ce.h<h> per horizon.
* ``agent.cvar_alpha`` > 0: the CVaR entry gate (numbarl/rl/cvar_gate.py) on the greedy choice's mask
  after the acting pass (collect: a copy of the env's mask, which ε-greedy's exploratory draws keep) and on
  the greedy scores (agent.scores): no entry on a side whose
  direction-branch CVaR_α is below −agent.cvar_floor (budget 1, or the IQN readiness² with
  agent.iqn). Stats (diagnostics): cvar_blocked_frac, cvar_mean, cvar_budget.
* ``agent.ensemble_heads`` = M >= 2: a bootstrapped ensemble (numbarl/rl/nets/ensemble.py, Osband et al.
  2016): M − 1 extra C51 heads on the trunk (optimizer group 'head.ens'), auxiliary losses: on the aux train
  steps the LOSS phase runs each extra head on the next / target / online passes' trunk outputs (its own
  double-DQN target) and its C51 loss with a per-(replay row, head) Bernoulli(1/2) mask as per-sample
  weights; BACKWARD adds their dh after the other auxiliary heads' (the gradient ledger). On the other train
  steps their gradients are zeroed. Stats: ensemble_std (batch mean of the std over the M heads of the
  direction-branch Q at the taken direction). With agent.epistemic_theta > 0 the epistemic gate takes a flat
  env's entry side d away where budget · u(s, d) > θ, on the greedy choice's mask after the acting pass (collect) and
  on the greedy scores (agent.scores), budget as the CVaR gate's. Stats (diagnostics):
  epistemic_blocked_frac, epistemic_score_mean, epistemic_budget.
* ``agent.temporal = "mamba"`` (issue 15): a Mamba2 scan over the observations of the last
  agent.temporal_steps bars before the trunk on every pass (numbarl/rl/temporal.py; optimizer group
  'temporal.mamba', online and target scan parameters). SAMPLE gathers the K-row windows ending at the
  batch's obs and next_obs (and each extra horizon's next_obs) from the replay's ring; COLLECT gathers each
  env's window ending at the row its gather just wrote; the backtest's ``scores`` push each bar into a
  per-policy window (cleared by ``reset_eval``). BACKWARD: the trunk's first layer computes its input
  gradient and the scan's backward runs on it (BPTT through all K). Stats (diagnostics):
  grad_norm.temporal.mamba.
* ``agent.predictive_weight`` (issue 15, T3): predictive coding, a linear predictor ``head.pc`` (optimizer
  group 'head.pc') on the online trunk output, trained on the aux steps by the normalized L2 to the target
  pass's trunk output on next_obs (numbarl/rl/losses/predictive.py; masked where the window ended an
  episode), weight λ; its input gradient adds into dh after the other auxiliary heads'. Stats:
  predictive_loss.
* ``agent.future_weight`` (issue 15): future-feature regression, a linear head ``head.ff`` (optimizer group
  'head.ff') on the online trunk output, trained on the aux steps by the mean squared error to
  ``agent.future_targets``, terms of next_obs (a column or the product of two; numbarl/rl/losses/future.py;
  masked where the window ended an episode), weight λ; its input gradient adds into dh after predictive
  coding's. Stats: future_loss.
* ``agent.regime_dropout`` (issue 15, T4): inverted dropout on the online pass's trunk output at a rate
  set by each sample's regime column (numbarl/rl/nets/regime_dropout.py; counter RNG keyed by the train
  step); every consumer of the online pass reads the dropped h', and the BACKWARD scales dh by the same
  mask before the trunk's backward. Stats: regime_dropout_frac.
* ``agent.isv`` (issue 15, T5): twelve training-health signals (numbarl/rl/isv.py: fast/slow EMAs of the loss,
  grad norm and Q-mean, ...) in a device vector, updated by one one-thread kernel from this step's device stats,
  the train step's last phase ("isv"); checkpointed (isv/vector, isv/updates; with the policy too). Stats:
  isv_<name> per signal. ``agent.isv_routing`` (T6, with agent.temporal = "mamba"; implies agent.isv): the
  temporal input's scan output is weighted per feature by w = σ(isv W_r + b_r) on every pass (numbarl/rl/temporal.py;
  optimizer group 'temporal.route'). Stats (diagnostics): grad_norm.temporal.route.
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.config import AgentConfig, ConfigError
from numbarl.cuda import graph as cuda_graph
from numbarl.cuda import launch, reduce
from numbarl.cuda.kernels import (
    elementwise,  # IQN (agent.iqn): zeroed gradients on steps without it
)
from numbarl.cuda.mapped import MappedBuffer
from numbarl.cuda.reduce import Reducer
from numbarl.cuda.registry import StatsLayout
from numbarl.cuda.runtime import Arena, cuda
from numbarl.env.params import BRANCH_NAMES
from numbarl.rl.agents.base import Agent, register
from numbarl.rl.cvar_gate import (
    risk_budget_kernel,  # R18: ρ for the env step (agent.risk_budget)
)
from numbarl.rl.isv import (
    ROUTE_GROUP as ISV_ROUTE_GROUP,  # ISV signals (agent.isv, agent.isv_routing)
)
from numbarl.rl.isv import Isv
from numbarl.rl.losses.c51 import C51Loss
from numbarl.rl.losses.confidence import ConfidenceLoss  # agent.confidence_weight
from numbarl.rl.losses.cql import CqlLoss
from numbarl.rl.losses.expectile import ExpectileLoss  # IQL (agent.iql)
from numbarl.rl.losses.icm import (  # ICM (agent.curiosity_weight)
    STAT_NAMES as ICM_STAT_NAMES,
)
from numbarl.rl.losses.icm import IcmLoss
from numbarl.rl.losses.multi_horizon import (  # multi-horizon C51 (agent.horizons)
    MultiHorizonC51Loss,
    parse_horizons,
)
from numbarl.rl.losses.future import FutureFeatureLoss  # agent.future_weight
from numbarl.rl.losses.predictive import PredictiveLoss  # agent.predictive_weight
from numbarl.rl.losses.quantile_huber import (  # IQN (agent.iqn)
    QuantileHuberLoss,
    iqn_readiness_kernel,
)
from numbarl.rl.nets.base import ParamStore
from numbarl.rl.nets.bottleneck import parse_bottleneck  # agent.input_bottleneck
from numbarl.rl.nets.c51_head import BranchedDuelingC51Head, TakenGrad, taken_rows_dense_ref
from numbarl.rl.nets.confidence import ConfidenceHead  # agent.confidence_weight
from numbarl.rl.nets.icm import Icm  # ICM (agent.curiosity_weight)
from numbarl.rl.nets.iql_value import IqlValueHead  # IQL (agent.iql)
from numbarl.rl.nets.iqn_head import IQN_TAU_SLOT, IqnHead  # IQN (agent.iqn)
from numbarl.rl.nets.linear import (
    Linear,  # the predictive-coding predictor (agent.predictive_weight), the future-feature head (future_weight)
)
from numbarl.rl.nets.mlp import Mlp
from numbarl.rl.nets.regime_dropout import RegimeDropout  # agent.regime_dropout
from numbarl.rl.obs_columns import resolve_obs_columns, resolve_obs_terms  # the regime columns, future terms
from numbarl.rl.obs_noise import ObsNoise  # agent.obs_noise
from numbarl.rl.reward_center import RewardCenter  # agent.reward_centering
from numbarl.rl.optim import (
    STAT_CLIP_SCALE,
    STAT_CLIPPED,
    STAT_DECAY_RATE,
    STAT_GRAD_NORM,
    STAT_LR,
    STAT_LR_RESTARTS,
    STAT_LR_SCALE,
    STAT_SKIPPED,
    STAT_STEP,
    STAT_TARGET_SOFT,
    STAT_TARGET_UPDATES,
    STAT_WARMUP_SCALE,
    Adam,
    AdamConfig,
    TargetConfig,
    nonfinite_flag_dev,
)
from numbarl.rl.policies import scheduled_epsilon, scheduled_epsilon_greedy, scheduled_epsilon_greedy_step
from numbarl.rl.replay import Replay
from numbarl.rl.schedules import ScheduleConfig

_cuda = cuda()

# one block reduces the batch statistics in a fixed order (a small block under the simulator,
# where every simulated thread is a Python thread)
STATS_BLOCK = launch.shape(gpu=1024, sim=32)  # H200, B = 16,384: 138 us with 256 threads, 90 us with 1024
TERMS_BLOCK = launch.shape(gpu=256, sim=32)  # threads per block of the statistics terms (one per sample)
STATS_ALL, STATS_SUMS, STATS_FINAL = np.int32(0), np.int32(1), np.int32(2)  # train_stats_kernel's stages

# mapped stats of the agent (float32, named; numbarl.cuda.registry): the optimizer's slots are
# copied first, at the optimizer's own numbers (numbarl.rl.optim.STAT_*)
AGENT_STATS = StatsLayout("c51 agent")
AGENT_STATS.slot("grad_norm", STAT_GRAD_NORM)
AGENT_STATS.slot("clip_scale", STAT_CLIP_SCALE)
AGENT_STATS.slot("lr", STAT_LR)
AGENT_STATS.slot("optim_step", STAT_STEP, kind="int")
AGENT_STATS.slot("skipped_steps", STAT_SKIPPED, kind="int")
AGENT_STATS.slot("clipped_steps", STAT_CLIPPED, kind="int")  # liveness of gradient clipping
AGENT_STATS.slot("target_copies", STAT_TARGET_UPDATES, kind="int")  # liveness of the periodic target copy
STAT_LOSS = AGENT_STATS.slot("loss", 8)  # mean C51 cross-entropy of the last train step
STAT_Q_MEAN = AGENT_STATS.slot("q_mean", 9)  # mean over the batch and branches of Q_online(obs, a taken)
STAT_Q_NEXT_MAX = AGENT_STATS.slot("q_next_max", 10)  # mean over batch and branches of max_a Q_online(next_obs, a)
STAT_EPSILON = AGENT_STATS.slot("epsilon", 11)  # exploration rate of the last collect step
STAT_COLLECT_STEP = AGENT_STATS.slot("collect_step", 12, kind="int")  # collect steps done (float32: exact to 2**24)
_scheduled_epsilon = launch.device_function(scheduled_epsilon)
STAT_TRAIN_STEP = AGENT_STATS.slot("train_step", 13, kind="int")  # train steps done
STAT_NONFINITE_STEP = AGENT_STATS.slot("nonfinite_step", 14, kind="int")  # first train step whose loss or grad norm was not finite (-1 = none)
STAT_NONFINITE_WHAT = AGENT_STATS.slot("nonfinite_what", 15, kind="int")  # 1 = loss, 2 = gradients
STAT_LOCK_MASKED = AGENT_STATS.slot("lock_masked_frac", 17)  # share of the batch whose next-state target skipped a locked direction
STAT_AGENT_LR_SCALE = AGENT_STATS.slot("lr_scale", 7)  # the lr schedule's multiplier (group 0) this step
STAT_AGENT_LR_RESTARTS = AGENT_STATS.slot("lr_restarts", 18, kind="int")  # warm restarts so far
STAT_AGENT_TARGET_SOFT = AGENT_STATS.slot("target_soft_updates", 19, kind="int")  # liveness of the Polyak target
STAT_AGENT_DECAY = AGENT_STATS.slot("decay_rate", 20)  # the largest lr x weight decay in force (weight decay live)
STAT_AGENT_WARMUP = AGENT_STATS.slot("lr_warmup_scale", 21)  # the warm-up part of the lr multiplier (group 0)
STAT_CQL_LOSS = AGENT_STATS.slot("cql_loss", 22)  # the CQL regularizer's value (before its weight α)
STAT_NSTEP_LEN = AGENT_STATS.slot("nstep_len_mean", 16)  # mean steps m of the sampled n-step windows (liveness of n-step)
N_STATS = AGENT_STATS.size

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


# ---------------------------------------------------------------------------------------------
# kernels (tiny, one block: bookkeeping and fixed-order batch statistics)
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def collect_tail_kernel(collect_step, schedule, decay_steps, epsilon, stats, replay_count, env_counter):
    """The collect step's bookkeeping, one launch after its replay write: epsilon[0] = the rate
    the step's ε-greedy used (numbarl.rl.policies.scheduled_epsilon, computed there in every
    thread), collect_step += 1, the replay's write count += 1 and the env's RNG counter += 1
    (three one-thread launches, ~1 µs each plus their gaps, before it was folded)."""
    if _cuda.grid(1) == 0:
        t = collect_step[0]
        eps = _scheduled_epsilon(t, schedule, decay_steps)
        epsilon[0] = eps
        collect_step[0] = t + 1
        stats[STAT_EPSILON] = eps
        stats[STAT_COLLECT_STEP] = np.float32(t + 1)
        replay_count[0] += 1
        env_counter[0] += 1


@_cuda.jit(cache=True)
def train_stats_terms_kernel(q, next_q, actions, index, next_index, n_envs, n_slots, next_mask, n_dir, tq, tn,
                             tm, tl):
    """One thread per sample b (all multiprocessors): the terms train_stats_kernel sums, written
    to tq/tn [B, n_branches] (Q of the taken action, max next Q) and tm/tl [B] (the n-step window
    length m, 0 for an unfilled slot; 1 when the double-DQN argmax skipped a masked direction).
    Split from the sum so that the scattered gathers run on the whole GPU, not on one block (90 us
    → a few us at B = 16,384); the sum reads the terms in the order it always added them, and
    adding an exact 0 leaves a non-negative float32 sum's bits unchanged: the statistics are
    bitwise those of the one-block kernel."""
    b = _cuda.grid(1)
    if b >= q.shape[0]:
        return
    nb = q.shape[1]
    na = q.shape[2]
    masked = _ZERO
    for a in range(n_dir):
        if next_mask[b, 0, a] == 0:
            masked = _ONE
            break
    tl[b] = masked
    m = _ZERO
    if index[b] >= 0:
        m = np.float32((next_index[b] // n_envs - index[b] // n_envs + n_slots) % n_slots)
    tm[b] = m
    for j in range(nb):
        tq[b, j] = q[b, j, actions[b, j]]
        best = next_q[b, j, 0]
        for a in range(1, na):
            v = next_q[b, j, a]
            if v > best:
                best = v
        tn[b, j] = best


@_cuda.jit(cache=True)
def train_stats_kernel(tq, tn, tm, tl, loss, optim_stats, train_step, stats, sums, stage):
    """Fixed-order batch statistics (one block) of the terms train_stats_terms_kernel wrote:
    Q-mean of the taken actions, mean max next Q, the mean n-step window length m (from the
    sampled slots: (next slot − slot) mod n_slots), the loss, the optimizer's slots, the share of
    samples whose double-DQN argmax skipped a direction the env's mask forbids at next_obs (0
    unless the lock-aware target reads the masks), and the sticky non-finite flag.
    stage (agent.overlap): STATS_ALL does both parts; STATS_SUMS only the batch sums, into sums[0..3] (they need
    the forward passes alone, so the step runs them beside the loss); STATS_FINAL only the rest, from those sums
    (after the optimizer's step): the same operations, the same bits."""
    B = tq.shape[0]
    nb = tq.shape[1]
    sq = _cuda.shared.array(STATS_BLOCK, np.float32)
    sn = _cuda.shared.array(STATS_BLOCK, np.float32)
    sm = _cuda.shared.array(STATS_BLOCK, np.float32)
    sl = _cuda.shared.array(STATS_BLOCK, np.float32)
    tid = _cuda.threadIdx.x
    if stage == STATS_FINAL:
        if tid == 0:
            _train_stats_final_dev(sums[0], sums[1], sums[2], sums[3], loss, optim_stats, train_step, stats, B, nb)
        return
    acc_q = _ZERO
    acc_n = _ZERO
    acc_m = _ZERO
    acc_l = _ZERO
    for b in range(tid, B, STATS_BLOCK):
        acc_l += tl[b]
        acc_m += tm[b]
        for j in range(nb):
            acc_q += tq[b, j]
            acc_n += tn[b, j]
    sq[tid] = acc_q
    sn[tid] = acc_n
    sm[tid] = acc_m
    sl[tid] = acc_l
    _cuda.syncthreads()
    width = STATS_BLOCK // 2
    while width > 0:
        if tid < width:
            sq[tid] += sq[tid + width]
            sn[tid] += sn[tid + width]
            sm[tid] += sm[tid + width]
            sl[tid] += sl[tid + width]
        _cuda.syncthreads()
        width //= 2
    if tid == 0:
        if stage == STATS_SUMS:
            sums[0] = sq[0]
            sums[1] = sn[0]
            sums[2] = sm[0]
            sums[3] = sl[0]
        else:
            _train_stats_final_dev(sq[0], sn[0], sm[0], sl[0], loss, optim_stats, train_step, stats, B, nb)


@_cuda.jit(device=True)
def _train_stats_final_dev(sum_q, sum_n, sum_m, sum_l, loss, optim_stats, train_step, stats, B, nb):
    """`train_stats_kernel`'s one-thread end: the means of the batch sums, the copies, the non-finite flag."""
    inv = _ONE / np.float32(B * nb)
    t = train_step[0] + 1
    train_step[0] = t
    stats[STAT_Q_MEAN] = sum_q * inv
    stats[STAT_Q_NEXT_MAX] = sum_n * inv
    stats[STAT_LOSS] = loss[0]
    stats[STAT_GRAD_NORM] = optim_stats[STAT_GRAD_NORM]
    stats[STAT_CLIP_SCALE] = optim_stats[STAT_CLIP_SCALE]
    stats[STAT_LR] = optim_stats[STAT_LR]
    stats[STAT_STEP] = optim_stats[STAT_STEP]
    stats[STAT_SKIPPED] = optim_stats[STAT_SKIPPED]
    stats[STAT_CLIPPED] = optim_stats[STAT_CLIPPED]
    stats[STAT_TARGET_UPDATES] = optim_stats[STAT_TARGET_UPDATES]
    stats[STAT_AGENT_LR_SCALE] = optim_stats[STAT_LR_SCALE]
    stats[STAT_AGENT_TARGET_SOFT] = optim_stats[STAT_TARGET_SOFT]
    stats[STAT_AGENT_DECAY] = optim_stats[STAT_DECAY_RATE]
    stats[STAT_AGENT_WARMUP] = optim_stats[STAT_WARMUP_SCALE]
    stats[STAT_AGENT_LR_RESTARTS] = optim_stats[STAT_LR_RESTARTS]
    stats[STAT_NSTEP_LEN] = sum_m / np.float32(B)
    stats[STAT_LOCK_MASKED] = sum_l / np.float32(B)
    stats[STAT_TRAIN_STEP] = np.float32(t)
    nonfinite_flag_dev(stats, t, loss[0], optim_stats[STAT_GRAD_NORM], STAT_NONFINITE_STEP, STAT_NONFINITE_WHAT)


MAX_BRANCH_ACTIONS = 32  # actions per branch the diagnostics' entropy kernel counts (one thread each)


@_cuda.jit(cache=True)
def atom_utilization_kernel(atom_sums, total, stats, slot):
    """One thread: p_j = atom_sums[j] / total (the batch-mean projected target distribution), and
    stats[slot] = exp(H(p)) / Z, its perplexity over the number of atoms: the fraction of the
    support the targets effectively use (1: uniform over all atoms; 5 / 51 when five atoms carry
    the mass evenly). Fixed order, float64."""
    if _cuda.grid(1) != 0:
        return
    n = atom_sums.shape[0]
    h = 0.0
    for j in range(n):
        p = np.float64(atom_sums[j]) / total
        if p > 0.0:
            h -= p * math.log(p)
    stats[slot] = np.float32(math.exp(h) / np.float64(n))


@_cuda.jit(cache=True)
def action_entropy_kernel(actions, count, branch_sizes, stats, first_slot):
    """Block b = branch b, thread a = action a: counts the envs that took action a in the replay's
    latest slot (a loop over envs: no atomics); thread 0 then writes the branch's entropy over its
    actions, normalized by log(A_b) (1: uniform, 0: one action), to stats[first_slot + b]."""
    b = _cuda.blockIdx.x
    a = _cuda.threadIdx.x
    counts = _cuda.shared.array(MAX_BRANCH_ACTIONS, np.int64)
    n_slots = actions.shape[0]
    n_envs = actions.shape[1]
    s = (count[0] - 1) % n_slots
    c = 0
    if a < branch_sizes[b] and count[0] > 0:
        for e in range(n_envs):
            if actions[s, e, b] == a:
                c += 1
    counts[a] = c
    _cuda.syncthreads()
    if a == 0:
        n_act = branch_sizes[b]
        h = 0.0
        for k in range(n_act):
            if counts[k] > 0:
                p = np.float64(counts[k]) / np.float64(n_envs)
                h -= p * math.log(p)
        stats[first_slot + b] = np.float32(h / math.log(np.float64(n_act))) if n_act > 1 else np.float32(0.0)


MAX_BRANCHES = len(BRANCH_NAMES)  # per-branch Q-means the diagnostics' Q-stats kernel holds (shared memory)
# offsets from the first Q-stats slot (consecutive slots, registered by the agent)
QS_STD, QS_DIVERGENCE, QS_GAP_ABS, QS_BRANCH_MEAN = 0, 1, 2, 3


@_cuda.jit(cache=True)
def q_stats_kernel(q, q_target, actions, preference, train_step, stats, first_slot):
    """One block, fixed order (diagnostics: log intervals only). Over the last train batch's
    (sample b, branch k) pairs with a = actions[b, k], Q = q[b, k, a] (the online pass on obs):

        stats[first + QS_STD]             population std of Q over all B·n_branches pairs (two passes)
        stats[first + QS_DIVERGENCE]      mean |Q − q_target[b, k, a]|   (the target network on obs)
        stats[first + QS_BRANCH_MEAN + k] mean of Q over the batch for branch k
        stats[first + QS_GAP_ABS]         mean |preference| over the envs (|Q(long) − Q(short)| of the
                                          last collect step)

    Before the first train step (train_step[0] == 0) only the |preference| mean is written."""
    B = q.shape[0]
    nb = q.shape[1]
    tid = _cuda.threadIdx.x
    s_sum = _cuda.shared.array(STATS_BLOCK, np.float32)
    s_div = _cuda.shared.array(STATS_BLOCK, np.float32)
    s_gap = _cuda.shared.array(STATS_BLOCK, np.float32)
    s_br = _cuda.shared.array((MAX_BRANCHES, STATS_BLOCK), np.float32)
    trained = train_step[0] > 0
    acc_s = _ZERO
    acc_d = _ZERO
    acc_g = _ZERO
    for j in range(MAX_BRANCHES):
        s_br[j, tid] = _ZERO
    if trained:
        for b in range(tid, B, STATS_BLOCK):
            for j in range(nb):
                a = actions[b, j]
                v = q[b, j, a]
                acc_s += v
                s_br[j, tid] += v
                acc_d += abs(v - q_target[b, j, a])
    for e in range(tid, preference.shape[0], STATS_BLOCK):
        acc_g += abs(preference[e])
    s_sum[tid] = acc_s
    s_div[tid] = acc_d
    s_gap[tid] = acc_g
    _cuda.syncthreads()
    width = STATS_BLOCK // 2
    while width > 0:
        if tid < width:
            s_sum[tid] += s_sum[tid + width]
            s_div[tid] += s_div[tid + width]
            s_gap[tid] += s_gap[tid + width]
            for j in range(MAX_BRANCHES):
                s_br[j, tid] += s_br[j, tid + width]
        _cuda.syncthreads()
        width //= 2
    if not trained:
        if tid == 0:
            stats[first_slot + QS_GAP_ABS] = s_gap[0] / np.float32(preference.shape[0])
        return
    mean = s_sum[0] / np.float32(B * nb)
    _cuda.syncthreads()  # every thread has read the mean before s_sum is reused
    acc_v = _ZERO
    for b in range(tid, B, STATS_BLOCK):
        for j in range(nb):
            d = q[b, j, actions[b, j]] - mean
            acc_v += d * d
    s_sum[tid] = acc_v
    _cuda.syncthreads()
    width = STATS_BLOCK // 2
    while width > 0:
        if tid < width:
            s_sum[tid] += s_sum[tid + width]
        _cuda.syncthreads()
        width //= 2
    if tid == 0:
        inv = _ONE / np.float32(B * nb)
        stats[first_slot + QS_STD] = math.sqrt(s_sum[0] * inv)
        stats[first_slot + QS_DIVERGENCE] = s_div[0] * inv
        stats[first_slot + QS_GAP_ABS] = s_gap[0] / np.float32(preference.shape[0])
        for j in range(nb):
            stats[first_slot + QS_BRANCH_MEAN + j] = s_br[j, 0] / np.float32(B)


def q_stats_ref(q, q_target, actions, preference):
    """float64 reference of q_stats_kernel: (std, divergence, mean |preference|, per-branch means)."""
    q, q_target = np.asarray(q, np.float64), np.asarray(q_target, np.float64)
    a = np.asarray(actions, np.int64)
    rows = np.arange(q.shape[0])[:, None]
    branches = np.arange(q.shape[1])[None, :]
    taken, taken_t = q[rows, branches, a], q_target[rows, branches, a]  # [B, n_branches]
    return (float(taken.std()), float(np.mean(np.abs(taken - taken_t))),
            float(np.mean(np.abs(np.asarray(preference, np.float64)))), taken.mean(axis=0))


# the adaptive atom-entropy controller (agent.atom_entropy_max > 0; numbarl/rl/losses/c51.py)
UTIL_THRESHOLD = 0.1  # an atom counts as used when the batch-mean probability exceeds 0.1 / Z
UTIL_EMA = 0.99  # u_ema ← 0.99 u_ema + 0.01 u
UTIL_TARGET = 0.5  # β ramps up as u_ema falls below one half of the atoms


@_cuda.jit(cache=True)
def atom_entropy_control_kernel(atom_sums, inv_rows, u_ema, beta_max, beta, stats, slot_u, slot_ema, slot_beta,
                                perplexity):
    """One thread, float64: p̄_i = atom_sums[i] · inv_rows (the batch- and branch-mean distribution
    the agent.atom_entropy_source names: the taken actions' online probabilities, or the projected
    targets); u = #{i: p̄_i > 0.1/Z} / Z, or with `perplexity` u = exp(H(p̄)) / Z (the
    atom_utilization diagnostic's measure); u_ema ← 0.99 u_ema + 0.01 u (the first step sets u_ema =
    u: u_ema < 0 marks 'none yet'), β = β_max · clip((0.5 − u_ema) / 0.5, 0, 1) into beta[0] (read
    by the next step's C51 gradient kernel) and the three stats slots."""
    if _cuda.grid(1) != 0:
        return
    n = atom_sums.shape[0]
    if perplexity != 0:
        h = 0.0
        for i in range(n):
            p = np.float64(atom_sums[i]) * inv_rows
            if p > 0.0:
                h -= p * math.log(p)
        u = math.exp(h) / np.float64(n)
    else:
        threshold = UTIL_THRESHOLD / np.float64(n)
        used = 0
        for i in range(n):
            if np.float64(atom_sums[i]) * inv_rows > threshold:
                used += 1
        u = np.float64(used) / np.float64(n)
    e = np.float64(u_ema[0])
    if e < 0.0:
        e = u
    else:
        e = UTIL_EMA * e + (1.0 - UTIL_EMA) * u
    u_ema[0] = np.float32(e)
    ramp = min(max((UTIL_TARGET - np.float64(u_ema[0])) / UTIL_TARGET, 0.0), 1.0)
    b = np.float32(beta_max * ramp)
    beta[0] = b
    stats[slot_u] = np.float32(u)
    stats[slot_ema] = u_ema[0]
    stats[slot_beta] = b


def atom_entropy_control_ref(taken_probs, u_ema: float, beta_max: float, perplexity: bool = False):
    """float64 reference of one controller step: (u, u_ema, β) from probabilities [B, n_branches, Z]
    (the taken actions' or the projected targets'; perplexity: u = exp(H(p̄)) / Z)."""
    p = np.asarray(taken_probs, np.float64)
    z = p.shape[-1]
    p_bar = p.reshape(-1, z).mean(axis=0)
    if perplexity:
        q = p_bar[p_bar > 0]
        u = float(np.exp(-np.sum(q * np.log(q)))) / z
    else:
        u = float(np.count_nonzero(p_bar > UTIL_THRESHOLD / z)) / z
    e = u if u_ema < 0 else UTIL_EMA * u_ema + (1.0 - UTIL_EMA) * u
    e = float(np.float32(e))
    return u, e, beta_max * min(max((UTIL_TARGET - e) / UTIL_TARGET, 0.0), 1.0)


# The target pass computes its probabilities at the double-DQN a* alone (BranchedDuelingC51Head.select_probs), the
# rows the projection reads, where nothing reads the others: the same bits as the full pass (tests/rl/test_overlap.py
# switches it off to check that).
TARGET_AT = True


# ---------------------------------------------------------------------------------------------
# the agent
# ---------------------------------------------------------------------------------------------
@register("c51")
class DQNAgent(Agent):
    """Online/target branched dueling C51 network, replay, loss and AdamW on the device.

    cfg: AgentConfig; state_dim: observation width; branch_sizes: actions per branch (the env's
    (direction, size, target, stop)); n_envs: parallel envs feeding the replay; eval_batch: batch of
    the greedy evaluation pass (policies in a backtest).
    """

    feedback = None  # the validation feedback loop acting inside the steps (attach_feedback)
    _aux = True  # whether the train step being issued runs the auxiliary losses (train_step)
    iqn_head = None  # the implicit quantile head (agent.iqn)
    iql_head = None  # the IQL expectile value head (agent.iql)
    pc_head = None  # the predictive-coding predictor (agent.predictive_weight)
    ff_head = None  # the future-feature regression head (agent.future_weight)
    rdrop = None  # regime dropout on the online pass's trunk output (agent.regime_dropout)
    obs_noise = None  # Gaussian noise on the training batch's market features (agent.obs_noise)
    reward_center = None  # the running average reward taken off the sampled returns (agent.reward_centering)
    conf_head = None  # the recursive-confidence head (agent.confidence_weight)
    conf_gate = None  # its selectivity gate on new entries (agent.confidence_floor)
    risk_head = None  # the risk-budget head (agent.risk_head_weight)
    risk_sizer = None  # its size rewrite of new entries (agent.risk_head_sizing)
    risk_labels = None  # its trade-outcome labels beside the replay
    risk_loss = None  # its cross-entropy (and the base win rate ρ̄ the sizing reads)
    icm = None  # the ICM curiosity models (agent.curiosity_weight)
    spectral = None  # spectral normalization of chosen layers (agent.spectral_norm)
    cvar_gate = None  # the CVaR entry gate (agent.cvar_alpha)
    ens_heads = ()  # the ensemble's extra C51 heads (agent.ensemble_heads)
    ens_gate = None  # the epistemic entry gate (agent.epistemic_theta)
    entry_gates = None  # the arena of the entry gates' device on/off switch (arm_entry_gates), with any gate on
    mh = None  # the multi-horizon C51 loss (agent.horizons)
    atoms = None  # the adaptive support's spacings (agent.adaptive_atoms)
    extra_horizons = ()  # the horizons other than n_step (agent.horizons)
    temporal = None  # the temporal input: a scan over the last K observations (agent.temporal)
    isv = None  # the ISV signals (agent.isv; implied by agent.isv_routing)

    def __init__(self, cfg: AgentConfig, state_dim: int, branch_sizes, n_envs: int, seed: int,
                 eval_batch: int = 1, epsilon=(1.0, 0.05, 1000), branch_lr: bool = False, feature_names=None):
        self.cfg = cfg
        self.state_dim, self.n_envs, self.seed = int(state_dim), int(n_envs), int(seed)
        # the observation's market feature names (the cache's): agent.regime_gate_cols, regime_dropout_col and
        # horizon_regime_col name columns by them; None: the default feature list (numbarl/rl/obs_columns.py)
        self.feature_names = None if feature_names is None else tuple(feature_names)
        self.branch_sizes = tuple(int(b) for b in branch_sizes)
        self.n_branches = len(self.branch_sizes)
        self.max_actions = max(self.branch_sizes)
        eps_start, eps_end, eps_decay = float(epsilon[0]), float(epsilon[1]), int(epsilon[2])
        B = cfg.batch_size

        # NETWORK: trunk MLP + dueling branched C51 head, one flat parameter buffer
        self.store = ParamStore()
        # with the temporal input the first layer also computes its input gradient (the scan's dh̃)
        bottleneck = parse_bottleneck(cfg.input_bottleneck)  # the tanh input bottleneck (agent.input_bottleneck)
        if bottleneck and bottleneck[1] > self.state_dim:
            raise ConfigError(f"agent.input_bottleneck = {cfg.input_bottleneck!r}: columns {bottleneck[0]}..{bottleneck[1] - 1} "
                              f"do not fit the observation's {self.state_dim}")
        regime_cols = (resolve_obs_columns(cfg.regime_gate_cols, self.feature_names, "regime_gate_cols", self.state_dim)
                       if cfg.regime_gate else None)  # the regime gate
        self.trunk = Mlp("trunk", self.state_dim, cfg.trunk, activation=cfg.activation, compute=cfg.compute,
                         input_gate=cfg.feature_gate, kan_gate=cfg.kan_gate, input_grad=bool(cfg.temporal),
                         attention=cfg.feature_attention, bottleneck=bottleneck, regime_gate=regime_cols)
        self.head = BranchedDuelingC51Head("head", self.trunk.out_dim, self.branch_sizes, cfg.n_atoms,
                                           cfg.v_min, cfg.v_max, compute=cfg.compute, pad_to=cfg.head_pad_multiple,
                                           fuse_value=cfg.fuse_value)
        self.trunk.declare_params(self.store)
        self.head.declare_params(self.store)
        self.acts = Arena("activations")
        # each pass computes only what its consumer reads: the loss needs the online logits, the
        # double-DQN argmax the online Q on next_obs, the projection the target probabilities
        # the target pass: the probabilities at the double-DQN a* alone (select_probs) unless a reader wants them all
        # (adaptive atoms' step, the multi-horizon loss's n-step horizon)
        self.target_at = TARGET_AT and not cfg.adaptive_atoms and not cfg.horizons
        target_outputs = ("probs_at",) if self.target_at else ("probs",)
        for tag, batch, backward, outputs in (("online", B, True, ("logits", "q")), ("next", B, False, ("q",)),
                                              ("target", B, False, target_outputs), ("act", self.n_envs, False, ("q",)),
                                              ("eval", int(eval_batch), False, ("q",)),
                                              ("diag", B, False, ("q",))):  # diagnostics: target net on obs
            # ICM with agent.curiosity_trunk_grad: the inverse loss's ∂L/∂φ(next_obs) runs the trunk's backward on "next"
            trunk_backward = backward or (tag == "next" and cfg.curiosity and cfg.curiosity_trunk_grad)
            self.trunk.declare_acts(self.acts, batch, tag, backward=trunk_backward)
            self.head.declare_acts(self.acts, batch, tag, backward=backward, outputs=outputs)
        # --- IQN (agent.iqn): the head on the trunk's online (backward) and target passes ---------
        if cfg.iqn:
            self.iqn_head = IqnHead("iqn", self.trunk.out_dim, self.branch_sizes, n_embed=cfg.iqn_embed,
                                    compute=cfg.compute)
            self.iqn_head.declare_params(self.store)
            self.iqn_head.declare_acts(self.acts, B, "online", backward=True, n_quantiles=cfg.iqn_quantiles)
            self.iqn_head.declare_acts(self.acts, B, "target", backward=False, n_quantiles=cfg.iqn_quantiles)
        # --- end IQN ---------------------------------------------------------------------------------
        # --- IQL (agent.iql): V on the online trunk output (backward) and in the diagnostics; the
        # target network's Q on obs for the expectile target (its own pass, tag "iql_target") ---------
        if cfg.iql:
            self.iql_head = IqlValueHead("iql", self.trunk.out_dim, cfg.iql_hidden, compute=cfg.compute)
            self.iql_head.declare_params(self.store)
            self.iql_head.declare_acts(self.acts, B, "online", backward=True)
            self.iql_head.declare_acts(self.acts, B, "diag", backward=False)
            self.trunk.declare_acts(self.acts, B, "iql_target", backward=False)
            self.head.declare_acts(self.acts, B, "iql_target", backward=False, outputs=("q",))
        # --- end IQL ---------------------------------------------------------------------------------
        # --- ICM (agent.curiosity_weight): forward and inverse models on the online pass's trunk output
        # (φ(obs)) and the "next" pass's (φ(next_obs)), declared last: the other parameters keep their init
        if cfg.curiosity:
            self.icm = Icm("icm", self.trunk.out_dim, self.branch_sizes, cfg.curiosity_hidden, compute=cfg.compute,
                           trunk_grad=cfg.curiosity_trunk_grad)
            self.icm.declare_params(self.store)
            self.icm.declare_acts(self.acts, B, "online")
        # --- end ICM ---------------------------------------------------------------------------------
        # --- multi-horizon C51 (agent.horizons): online and target passes on each extra horizon's next_obs
        self.horizons = parse_horizons(cfg.horizons)
        self.extra_horizons = tuple(h for h in self.horizons if h != cfg.n_step)
        for h in self.extra_horizons:
            for tag, outputs in ((f"next_h{h}", ("q",)), (f"target_h{h}", ("probs",))):
                self.trunk.declare_acts(self.acts, B, tag, backward=False)
                self.head.declare_acts(self.acts, B, tag, backward=False, outputs=outputs)
        # --- end multi-horizon C51 ---------------------------------------------------------------------
        # --- recursive confidence (agent.confidence_weight): the head on the online trunk output (backward)
        # and, with target parameters, on the target pass's (next_obs); declared last: the other
        # parameters keep their init ----------------------------------------------------------------------
        if cfg.confidence_weight > 0:
            self.conf_head = ConfidenceHead("conf", self.trunk.out_dim, compute=cfg.compute)
            self.conf_head.declare_params(self.store)
            self.conf_head.declare_acts(self.acts, B, "online", backward=True)
            self.conf_head.declare_acts(self.acts, B, "target", backward=False)
            if cfg.confidence_floor > 0:  # the gate: the head on the acting and evaluation passes
                self.conf_head.declare_acts(self.acts, self.n_envs, "act", backward=False)
                self.conf_head.declare_acts(self.acts, int(eval_batch), "eval", backward=False)
        # --- end recursive confidence --------------------------------------------------------------------
        # --- ensemble (agent.ensemble_heads): M − 1 extra C51 heads on the online (backward), next and
        # target passes' trunk outputs, with the gate also on acting and evaluation; declared last ----------
        if cfg.ensemble_heads >= 2:
            self._declare_ensemble(int(eval_batch))
        # --- end ensemble -----------------------------------------------------------------------------------
        # --- temporal input (agent.temporal): the scan before the trunk on every pass, declared last --------
        if cfg.temporal:
            self._declare_temporal(int(eval_batch))
        # --- end temporal input -------------------------------------------------------------------------------
        # --- predictive coding (agent.predictive_weight): a linear predictor on the online trunk output
        # (backward); its target is the target pass's trunk output on next_obs; declared last -------------
        if cfg.predictive_weight > 0:
            h = self.trunk.out_dim
            self.pc_head = Linear("head.pc", h, h, None, group="head.pc", input_grad=True, compute=cfg.compute)
            self.pc_head.declare_params(self.store)
            self.pc_head.declare_acts(self.acts, B, "online", backward=True)
        # --- end predictive coding -------------------------------------------------------------------------
        # --- future-feature regression (agent.future_weight): a linear head on the online trunk output
        # (backward) regressing terms of next_obs; declared after predictive coding's ----------------------
        if cfg.future_weight > 0:
            self._ff_cols = resolve_obs_terms(cfg.future_targets, self.feature_names, "future_targets",
                                              self.state_dim)
            self.ff_head = Linear("head.ff", self.trunk.out_dim, len(self._ff_cols[0]), None, group="head.ff",
                                  input_grad=True, compute=cfg.compute)
            self.ff_head.declare_params(self.store)
            self.ff_head.declare_acts(self.acts, B, "online", backward=True)
        # --- end future-feature regression -----------------------------------------------------------------
        # --- regime dropout (agent.regime_dropout): on the online pass's trunk output, rate from an obs column
        if cfg.regime_dropout:
            (col,) = resolve_obs_columns(cfg.regime_dropout_col, self.feature_names, "regime_dropout_col",
                                         self.state_dim, many=False)
            self.rdrop = RegimeDropout(B, self.trunk.out_dim, col, cfg.regime_dropout_lo,
                                       cfg.regime_dropout_hi, self.seed)
        # --- end regime dropout ------------------------------------------------------------------------------
        if cfg.obs_noise > 0:  # observation noise (agent.obs_noise): the market columns come first, then the portfolio's
            from numbarl.env.params import PORTFOLIO_FEATURES

            k = cfg.temporal_steps if cfg.temporal else 1
            self.obs_noise = ObsNoise(B, self.state_dim - len(PORTFOLIO_FEATURES), cfg.obs_noise, self.seed, B * k)
        # --- risk-budget head (agent.risk_head_weight): on the online trunk output (backward) and, for the
        # sizing, on the acting and evaluation passes; declared last: the other parameters keep their init --
        if cfg.risk_head_weight > 0:
            from numbarl.rl.nets.risk_head import RiskHead

            self.risk_head = RiskHead("risk", self.trunk.out_dim, compute=cfg.compute)
            self.risk_head.declare_params(self.store)
            self.risk_head.declare_acts(self.acts, B, "online", backward=True)
            if cfg.risk_head_sizing:
                self.risk_head.declare_acts(self.acts, self.n_envs, "act", backward=False)
                self.risk_head.declare_acts(self.acts, int(eval_batch), "eval", backward=False)
        # --- end risk-budget head -------------------------------------------------------------------------
        self.store.allocate()
        self.acts.allocate()
        self.store.init(np.random.default_rng(self.seed))

        # LOSS, OPTIMIZER, REPLAY
        self.loss = C51Loss.for_head(self.head, B, entropy_reg=cfg.atom_entropy_max > 0,
                                     adaptive_support=cfg.adaptive_atoms)
        # the CQL regularizer on the same logits: its gradient adds into the C51 loss's (loss contract)
        self.cql = CqlLoss.for_head(self.head, B) if cfg.cql_alpha > 0 else None
        if self.horizons:  # multi-horizon C51: one C51 loss per horizon, the agent's own at n_step
            if cfg.n_step not in self.horizons or len(self.horizons) < 2:
                raise ValueError(f"agent.horizons = {cfg.horizons!r} must name at least two windows, one of them "
                                 f"agent.n_step = {cfg.n_step}")
            losses = [self.loss if h == cfg.n_step
                      else C51Loss.for_head(self.head, B, adaptive_support=cfg.adaptive_atoms) for h in self.horizons]
            (col,) = resolve_obs_columns(cfg.horizon_regime_col, self.feature_names, "horizon_regime_col",
                                         self.state_dim, many=False)  # the trend-strength feature
            self.mh = MultiHorizonC51Loss(losses, self.horizons, primary=self.horizons.index(cfg.n_step),
                                          regime_col=col, trend_lo=cfg.horizon_trend_lo,
                                          trend_hi=cfg.horizon_trend_hi, mix=cfg.horizon_mix)
        target = (TargetConfig.periodic(cfg.target_period) if cfg.target_update == "periodic"
                  else TargetConfig.polyak(cfg.tau))
        self.optim = Adam(self.store, AdamConfig(lr=cfg.lr, beta1=cfg.adam_beta1, beta2=cfg.adam_beta2, eps=cfg.adam_eps,
                                                 weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm),
                          target, schedule=ScheduleConfig(cfg.lr_warmup_steps, cfg.lr_cycle_steps, cfg.lr_min_frac,
                                                          cfg.restart_momentum_scale))
        if branch_lr:  # one optimizer group per branch of the advantage GEMM (E4 scales their rates)
            self.optim.split_group("head.adv", self._branch_labels("head.adv"),
                                   [f"head.adv.{name}" for name in BRANCH_NAMES[:self.n_branches]])
        self.optim.allocate()
        if cfg.weight_decay_groups:  # weight decay only in the named groups (weights only, as always)
            named = [g.strip() for g in cfg.weight_decay_groups.split(",") if g.strip()]
            unknown = [g for g in named if g not in self.optim.parents.values()]
            if unknown:
                raise ValueError(f"agent.weight_decay_groups = {cfg.weight_decay_groups!r}: no optimizer group "
                                 f"{', '.join(unknown)}; this network's groups: {', '.join(self.optim.groups)}")
            for g in self.optim.groups:
                if self.optim.parents[g] not in named:
                    self.optim.set_weight_decay(0.0, group=g)
        self.replay = Replay(cfg.replay_capacity, self.n_envs, self.state_dim, self.n_branches, B,
                             n_step=cfg.n_step, gamma=cfg.gamma, seed=self.seed,
                             max_actions=self.max_actions,
                             horizons=self.extra_horizons).allocate()  # + the env's masks (lock-aware target)
        if self.temporal is not None:  # temporal input: its own learning rate (the ISV routing's too), K slots of history
            for group in self.temporal.groups:
                routed = group == ISV_ROUTE_GROUP and cfg.isv_routing_lr >= 0.0  # 0: the fixed 0.5 mixing
                self.optim.set_lr(cfg.isv_routing_lr if routed else cfg.temporal_lr, group=group)
            self.temporal.check_replay(self.replay)

        # device scalars (counters, the epsilon schedule) and the mapped stats read at log intervals
        self.scalars = Arena("agent.scalars")
        self.scalars.add("collect_step", (1,), np.int64)
        self.scalars.add("train_step", (1,), np.int64)
        self.scalars.add("epsilon_schedule", (2,), np.float32)
        self.scalars.add("epsilon_decay_steps", (1,), np.int64)
        self.scalars.add("epsilon", (1,), np.float32)  # this collect step's exploration rate
        self.scalars.allocate()
        self.set_epsilon_schedule(eps_start, eps_end, eps_decay)
        # per optimizer group: the gradient norm (fixed-order reduction into the mapped stats), the
        # liveness of every parameter group and the diagnostics' per-group norms
        self.stats_layout = AGENT_STATS.copy()
        self._group_norms = []
        for group in dict.fromkeys(self.optim.parents.values()):  # tensor groups (E4 splits head.adv)
            views = [self.store.grad(n) for n, spec in self.store.specs.items() if spec.group == group]
            slot = self.stats_layout.slot(f"grad_norm.{group}")
            self._group_norms.append((Reducer([v.size for v in views]), views, slot))
        # DIAGNOSTICS (replayed at log intervals only, numbarl.rl.agents.base): atom utilization of
        # the projected targets, the mean preference (Q-gap), the behaviour policy's entropy per branch
        if self.max_actions > MAX_BRANCH_ACTIONS:
            raise ValueError(f"a branch has {self.max_actions} actions; the diagnostics count at most {MAX_BRANCH_ACTIONS}")
        self._slot_atoms = self.stats_layout.slot("atom_utilization")
        self._slot_qgap = self.stats_layout.slot("q_gap_mean")
        self._slot_entropy = self.stats_layout.slot(f"action_entropy.{BRANCH_NAMES[0]}")
        for name in BRANCH_NAMES[1:self.n_branches]:  # consecutive slots, one per branch
            if self.stats_layout.slot(f"action_entropy.{name}") != self._slot_entropy + BRANCH_NAMES.index(name):
                raise RuntimeError("the per-branch entropy slots are not consecutive")
        self.stats_terms = Arena("agent.stats_terms")  # the train step's statistics terms (train_stats_terms_kernel)
        self.stats_terms.add("tq", (B, self.n_branches), np.float32)
        self.stats_terms.add("tn", (B, self.n_branches), np.float32)
        self.stats_terms.add("tm", (B,), np.float32)
        self.stats_terms.add("tl", (B,), np.float32)
        self.stats_terms.add("sums", (4,), np.float32)  # their batch sums (agent.overlap: computed beside the loss)
        self.stats_terms.allocate()
        self.diag = Arena("agent.diagnostics")
        self.diag.add("atom_sums", (cfg.n_atoms,), np.float32)
        self.diag.add("atom_partials", reduce.col_partials_shape(B * self.n_branches, cfg.n_atoms), np.float32)
        self.diag.add("branch_sizes", (self.n_branches,), np.int32)
        self.diag.allocate()
        self.diag.load({"branch_sizes": np.asarray(self.branch_sizes, np.int32)})
        self._qgap_reducer = Reducer(self.n_envs)
        self._init_c51_extras()
        if (any(h is not None for h in (self.iqn_head, self.iql_head, self.conf_head, self.pc_head, self.ff_head,
                                        self.risk_head))
                or self.ens_heads):
            # the trunk's output gradient that the C51 head writes and every auxiliary head adds into
            self.aux_state = Arena("agent.aux")
            self.aux_state.add("dh", (self.cfg.batch_size, self.trunk.out_dim), np.float32)
            self.aux_state.allocate()
        if self.iqn_head is not None:  # IQN (agent.iqn): loss, readiness state, stats slots
            self._init_iqn()
        if self.iql_head is not None:  # IQL (agent.iql): losses, reducer, stats slots
            self._init_iql()
        if self.icm is not None:  # ICM (agent.curiosity_weight): its loss, reward state and stats slots
            self._init_icm()
        if self.conf_head is not None:  # recursive confidence (agent.confidence_weight): loss, stats slots
            self._init_conf()
        if self.risk_head is not None:  # risk-budget head (agent.risk_head_weight): labels, loss, sizing, slots
            self._init_risk(int(eval_batch))
        if self.ens_heads:  # ensemble (agent.ensemble_heads): losses, masks, stats slots, the epistemic gate
            self._init_ensemble()
        if self.rdrop is not None:  # regime dropout (agent.regime_dropout): the dropped share's stat
            self._slot_rdrop = self.stats_layout.slot("regime_dropout_frac")
            self._rdrop_reducer = Reducer(self.cfg.batch_size * self.trunk.out_dim)
        if self.cfg.reward_centering > 0:  # reward centering (agent.reward_centering): r̄ and the value offset
            self.reward_center = RewardCenter(self.cfg.batch_size, self.cfg.reward_centering,
                                              self.stats_layout.slot("reward_center"),
                                              self.stats_layout.slot("reward_center_offset"))
        if self.obs_noise is not None:  # observation noise (agent.obs_noise): the mean noise² added to obs
            self._slot_obs_noise = self.stats_layout.slot("obs_noise_var")
            self._obs_noise_reducer = Reducer(self.obs_noise.sq.size)
        if self.pc_head is not None:  # predictive coding (agent.predictive_weight): loss, stats slot
            self.pc_loss = PredictiveLoss(self.cfg.batch_size, self.trunk.out_dim)
            self._slot_pc_loss = self.stats_layout.slot("predictive_loss")
            self._pc_grads = [self.store.grad(n) for n in self.pc_head.param_names.values()]
        if self.ff_head is not None:  # future-feature regression (agent.future_weight): loss, stats slot
            self.ff_loss = FutureFeatureLoss(self.cfg.batch_size, *self._ff_cols, self.state_dim)
            self._slot_ff_loss = self.stats_layout.slot("future_loss")
            self._ff_grads = [self.store.grad(n) for n in self.ff_head.param_names.values()]
        if self.mh is not None:  # multi-horizon C51 (agent.horizons): its stats slots
            self._init_mh()
        if cfg.isv or cfg.isv_routing:  # ISV signals (agent.isv; agent.isv_routing implies them): state, stats slots
            self.isv = Isv(self.stats_layout)
            if self.temporal is not None and self.temporal.route is not None:  # the routing reads the vector
                self.temporal.bind_isv(self.isv.vector)
        # --- spectral norm + CVaR gate (agent.spectral_norm, agent.cvar_alpha) ---------------------------
        self._init_spectral_cvar()
        # --- end spectral norm + CVaR gate -----------------------------------------------------------------
        self.overlap = cfg.overlap and self._plain_network()  # agent.overlap: the passes on forked streams
        self.stats = MappedBuffer(self.stats_layout.size, np.float32)
        self.stats.reset(0)
        self.stats.host[STAT_NONFINITE_STEP] = -1.0
        self.stats.host[self._slot_support] = self.head.v_min
        self.stats.host[self._slot_support + 1] = self.head.v_max

    def _init_c51_extras(self) -> None:
        """Slots and device state of the Q statistics (C6), the fitted support and the atom-entropy
        controller (C5); before the mapped stats are sized."""
        cfg, B = self.cfg, self.cfg.batch_size
        if self.n_branches > MAX_BRANCHES:
            raise ValueError(f"{self.n_branches} branches; the Q statistics hold at most {MAX_BRANCHES}")
        names = ["q_std", "q_divergence", "q_gap_abs_mean"] + [f"q_mean.{n}" for n in BRANCH_NAMES[:self.n_branches]]
        self._slot_qstats = self.stats_layout.slot(names[0])
        for i, name in enumerate(names[1:], 1):
            if self.stats_layout.slot(name) != self._slot_qstats + i:
                raise RuntimeError("the Q-stats slots are not consecutive")
        self._slot_support = self.stats_layout.slot("support_v_min")  # the support in force (fitted or config)
        if self.stats_layout.slot("support_v_max") != self._slot_support + 1:
            raise RuntimeError("the support slots are not consecutive")
        self._slot_support_fits = self.stats_layout.slot("support_fits", kind="int")
        self._slot_freeze = self.stats_layout.slot("freeze_resets", kind="int")
        self.support_state = Arena("agent.support")
        self.support_state.add("range", (2,), np.float64)  # (v_min, v_max) in force: checkpointed
        self.support_state.allocate()
        self.support_state.load({"range": np.array([cfg.v_min, cfg.v_max], np.float64)})
        self.atom_reg = None
        if cfg.atom_entropy_max > 0:
            self._slot_util = self.stats_layout.slot("atom_utilization_ctrl")  # u as agent.atom_entropy_source measures it
            self._slot_util_ema = self.stats_layout.slot("atom_utilization_ema")
            self._slot_beta = self.stats_layout.slot("atom_entropy_beta")
            self._slot_entropy_mean = self.stats_layout.slot("atom_entropy_mean")
            rows = B * self.n_branches
            self.atom_reg = Arena("agent.atom_entropy")
            self.atom_reg.add("u_ema", (1,), np.float32)
            self.atom_reg.add("atom_sums", (cfg.n_atoms,), np.float32)
            self.atom_reg.add("atom_partials", reduce.col_partials_shape(rows, cfg.n_atoms), np.float32)
            self.atom_reg.allocate()
            self.atom_reg.load({"u_ema": np.array([-1.0], np.float32)})  # < 0: no step yet
            self._entropy_reducer = Reducer(rows)
        if cfg.adaptive_atoms:  # C4: every C51 loss projects onto the head's support, which the atoms rewrite
            if getattr(cfg, "ensemble_heads", 0) >= 2:
                raise ValueError("agent.adaptive_atoms with agent.ensemble_heads: the ensemble's heads keep their own "
                                 "uniform supports; turn one of them off")
            from numbarl.rl.losses.atoms import AdaptiveAtoms

            self.atoms = AdaptiveAtoms(B, self.n_branches, cfg.n_atoms, lr=cfg.adaptive_atoms_lr,
                                       warmup=cfg.adaptive_atoms_warmup)
            for loss in (self.mh.losses if self.mh is not None else (self.loss,)):
                loss.bind_support(self.head.support, self.atoms.support_mode)
            self._slot_support_entropy = self.stats_layout.slot("support_entropy_J")
            self._slot_spacing_ratio = self.stats_layout.slot("atom_spacing_ratio")

    # --- IQN (agent.iqn) -----------------------------------------------------------------------------
    def _init_iqn(self) -> None:
        """The quantile Huber loss, the readiness state (float64
        (L_first, L_ema), checkpointed; L_first < 0: no step yet) and the stats slots."""
        cfg, B = self.cfg, self.cfg.batch_size
        self.iqn_loss = QuantileHuberLoss(B, self.branch_sizes, cfg.iqn_quantiles, cfg.iqn_quantiles)
        self.iqn_state = Arena("agent.iqn")
        self.iqn_state.add("readiness_state", (2,), np.float64)
        self.iqn_state.add("risk_budget", (1,), np.float32)  # R18: ρ the env step reads (_risk_budget)
        self.iqn_state.allocate()
        self.iqn_state.load({"readiness_state": np.array([-1.0, -1.0], np.float64)})
        self._slot_iqn_loss = self.stats_layout.slot("iqn_loss")
        self._slot_iqn_ready = self.stats_layout.slot("iqn_readiness")
        self._slot_iqn_ema = self.stats_layout.slot("iqn_loss_ema")
        self._slot_risk_budget = self.stats_layout.slot("risk_budget")
        self._iqn_grads = [self.store.grad(n) for n in self.iqn_head.param_names.values()]

    def _risk_budget(self, stream):
        """The env step's risk budget ρ (numbarl/env/core.py): readiness² written on the device
        (one thread, stats risk_budget) with agent.risk_budget (needs agent.iqn); None (the env's ρ = 1) without."""
        if self.iqn_head is None or not self.cfg.risk_budget:
            return None
        risk_budget_kernel[1, 1, stream](self.iqn_state["readiness_state"], self.iqn_state["risk_budget"],
                                         self.stats.device, self._slot_risk_budget)
        return self.iqn_state["risk_budget"]

    def _iqn_forward_loss(self, stream) -> None:
        """τ′ and the target head on the target pass's trunk output (target parameters), τ and the
        online head on the online pass's trunk output, then the quantile Huber loss (aux steps)."""
        batch, cfg, head = self.replay.batch, self.cfg, self.iqn_head
        counter = self.optim.step_counter  # fresh fractions every train step, the same in every run
        head.sample_tau(stream, "target", self.seed, counter, IQN_TAU_SLOT + 1)
        head.forward(self.trunk.output("target"), stream, tag="target", role="target")
        head.sample_tau(stream, "online", self.seed, counter, IQN_TAU_SLOT)
        head.forward(self._h_online(), stream, tag="online")
        inputs = {"quantiles": head.output("online"), "tau": head.tau_buffer("online"),
                  "target_quantiles": head.output("target"), "next_q": self.head.outputs("next").q,
                  "actions": batch.action, "rewards": self._rewards(), "dones": batch.done, "discounts": batch.discount,
                  "next_mask": batch.next_mask if cfg.lock_aware_target else None}
        self.iqn_loss.apply(inputs, {"quantiles": self.iqn_loss.grad("quantiles")}, stream, ledger=self.store)

    # --- end IQN -------------------------------------------------------------------------------------

    # --- IQL (agent.iql) -----------------------------------------------------------------------------
    def _init_iql(self) -> None:
        """The expectile loss (and a second instance for the diagnostics' advantage, so a log interval
        never touches the train step's gradient), the reducer of the V
        and advantage means and the stats slots; before the mapped stats are sized."""
        cfg, B = self.cfg, self.cfg.batch_size
        self.iql_loss = ExpectileLoss(B, self.branch_sizes, cfg.iql_expectile)
        self.iql_diag = ExpectileLoss(B, self.branch_sizes, cfg.iql_expectile)
        self._slot_iql_loss = self.stats_layout.slot("iql_loss")
        self._slot_iql_v_mean = self.stats_layout.slot("iql_v_mean")
        self._slot_iql_adv_mean = self.stats_layout.slot("iql_adv_mean")
        self._iql_reducer = Reducer(B)
        self._iql_grads = [self.store.grad(n) for n in self.iql_head.param_names]

    def _iql_forward_loss(self, stream) -> None:
        """Aux steps: the target network on obs (Q̂'s source), V on the online pass's trunk output, then
        the expectile loss; its ∂L/∂V stays in the loss's own buffer for the backward."""
        batch = self.replay.batch
        q_target = self.forward(batch.obs, stream, tag="iql_target", role="target").q
        v = self.iql_head.forward(self._h_online(), stream, tag="online")
        self.iql_loss.apply({"v": v, "q": q_target, "actions": batch.action}, {"v": self.iql_loss.grad("v")}, stream,
                            ledger=self.store)

    def _iql_stats(self, stream) -> None:
        """Aux steps: the expectile loss and the batch mean of V into the mapped stats."""
        stat_copy_kernel[1, 1, stream](self.iql_loss.loss, self.stats.device, np.int64(self._slot_iql_loss))
        self._iql_reducer.mean(self.iql_head.output("online"), self.stats.device, stream, at=self._slot_iql_v_mean)

    def _iql_diagnostics(self, q_target, stream) -> None:
        """Log intervals: A = Q̂ − V of the taken plans on the last train batch (Q̂ from the target
        network on its obs, the diag pass; V of the online value head on the last online trunk
        output), its batch mean into iql_adv_mean. A diagnostic only: no action reads it."""
        v = self.iql_head.forward(self.trunk.output("online"), stream, tag="diag")
        self.iql_diag.compute({"v": v, "q": q_target, "actions": self.replay.batch.action}, stream)
        self._iql_reducer.mean(self.iql_diag.adv, self.stats.device, stream, at=self._slot_iql_adv_mean)
    # --- end IQL -------------------------------------------------------------------------------------

    # --- recursive confidence (agent.confidence_weight) -----------------------------------------------
    def _init_conf(self) -> None:
        """The cross-entropy loss, the reducer of the batch means and the stats slots; before the mapped
        stats are sized."""
        cfg, B = self.cfg, self.cfg.batch_size
        self.conf_loss = ConfidenceLoss(B, self.branch_sizes, cfg.confidence_epsilon)
        self._slot_conf_loss = self.stats_layout.slot("confidence_loss")
        self._slot_conf_mean = self.stats_layout.slot("confidence_mean")
        self._slot_conf_boot = self.stats_layout.slot("confidence_boot_frac")
        self._conf_reducer = Reducer(B)
        self._conf_grads = [self.store.grad(n) for n in self.conf_head.param_names]
        if cfg.confidence_floor > 0:  # the selectivity gate on new entries
            from numbarl.env.params import PORTFOLIO_FEATURES
            from numbarl.rl.nets.confidence import ConfidenceGate

            position_col = self.state_dim - len(PORTFOLIO_FEATURES) + PORTFOLIO_FEATURES.index("position")
            self.conf_gate = ConfidenceGate(self.conf_head, cfg.confidence_floor, self.n_envs, position_col,
                                            armed=self._entry_gate_switch())
            self._slot_conf_gated = self.stats_layout.slot("confidence_gated_frac")
            self._conf_gate_reducer = Reducer(self.n_envs)

    def _conf_forward_loss(self, stream) -> None:
        """Aux steps: the head on the online pass's trunk output (obs) and, with target parameters, on the
        target pass's (next_obs), then the cross-entropy; weight · ∂L/∂z stays in the loss's own buffer."""
        batch, head = self.replay.batch, self.conf_head
        z_next = head.forward(self.trunk.output("target"), stream, tag="target", role="target")
        z = head.forward(self._h_online(), stream, tag="online")
        self.conf_loss.apply({"logits": z, "target_logits": z_next, "q": self.head.outputs("online").q,
                              "actions": batch.action, "rewards": batch.reward, "dones": batch.done},
                             {"logits": self.conf_loss.grad("logits")}, stream, weight=self.cfg.confidence_weight,
                             ledger=self.store)

    def _conf_stats(self, stream) -> None:
        """Aux steps: the (unweighted) loss, the batch means of c and of the bootstrapped share."""
        stat_copy_kernel[1, 1, stream](self.conf_loss.loss, self.stats.device, np.int64(self._slot_conf_loss))
        self._conf_reducer.mean(self.conf_loss.confidence, self.stats.device, stream, at=self._slot_conf_mean)
        self._conf_reducer.mean(self.conf_loss.bootstrapped, self.stats.device, stream, at=self._slot_conf_boot)
    # --- end recursive confidence --------------------------------------------------------------------

    # --- risk-budget head (agent.risk_head_weight; numbarl/rl/nets/risk_head.py, losses/risk_head.py) ---------
    def _init_risk(self, eval_batch: int) -> None:
        """The outcome labels beside the replay, the cross-entropy, the sizer (agent.risk_head_sizing) and the
        stats slots; before the mapped stats are sized."""
        from numbarl.env.params import PORTFOLIO_FEATURES
        from numbarl.rl.losses.risk_head import RiskHeadLoss, TradeOutcomeLabels
        from numbarl.rl.nets.risk_head import RiskSizer

        B = self.cfg.batch_size
        self.risk_labels = TradeOutcomeLabels(self.replay.n_slots, self.n_envs, B)
        self.risk_loss = RiskHeadLoss(B)
        self._slot_risk_loss = self.stats_layout.slot("risk_head_loss")
        self._slot_risk_rho = self.stats_layout.slot("risk_head_rho_mean")
        self._slot_risk_labeled = self.stats_layout.slot("risk_head_labeled")
        self._risk_reducer = Reducer(B)
        self._risk_grads = [self.store.grad(n) for n in self.risk_head.param_names]
        if self.cfg.risk_head_sizing:  # the size rewrite of new entries (collect step and backtest scores)
            position_col = self.state_dim - len(PORTFOLIO_FEATURES) + PORTFOLIO_FEATURES.index("position")
            self.risk_sizer = RiskSizer(self.risk_head, self.n_envs, eval_batch, position_col, self.branch_sizes,
                                        self.risk_loss.base_rate)
            self._slot_risk_resized = self.stats_layout.slot("risk_head_resized_frac")
            self._risk_resized_reducer = Reducer(self.n_envs)

    def _risk_forward_loss(self, stream) -> None:
        """Aux steps: the sampled rows' outcome labels, the head on the online pass's trunk output (obs), the
        cross-entropy on the labelled rows; weight · ∂L/∂z stays in the loss's own buffer."""
        labels = self.risk_labels.gather(self.replay.batch.index, stream)
        z = self.risk_head.forward(self._h_online(), stream, tag="online")
        self.risk_loss.apply({"logits": z, "labels": labels}, {"logits": self.risk_loss.grad("logits")}, stream,
                             weight=self.cfg.risk_head_weight, ledger=self.store)

    def _risk_stats(self, stream) -> None:
        """Aux steps: the (unweighted) loss, the batch mean of ρ (every sampled row), the labelled rows."""
        stat_copy_kernel[1, 1, stream](self.risk_loss.loss, self.stats.device, np.int64(self._slot_risk_loss))
        self._risk_reducer.mean(self.risk_loss.rho, self.stats.device, stream, at=self._slot_risk_rho)
        stat_copy_kernel[1, 1, stream](self.risk_loss.count, self.stats.device, np.int64(self._slot_risk_labeled))
    # --- end risk-budget head --------------------------------------------------------------------------

    # --- ensemble + epistemic gate (agent.ensemble_heads, agent.epistemic_theta; numbarl/rl/nets/ensemble.py) ---
    def _declare_ensemble(self, eval_batch: int) -> None:
        """The M − 1 extra heads' parameters (group 'head.ens') and passes: online (backward; logits for the
        loss, q for ensemble_std), next (q: each head's double-DQN argmax), target (probs); with the gate
        act and eval (q)."""
        from numbarl.rl.nets.ensemble import make_extra_heads

        cfg, B = self.cfg, self.cfg.batch_size
        self.ens_heads = make_extra_heads(cfg.ensemble_heads, self.trunk.out_dim, self.branch_sizes, cfg.n_atoms,
                                          cfg.v_min, cfg.v_max, cfg.compute, pad_to=cfg.head_pad_multiple,
                                          fuse_value=cfg.fuse_value)
        passes = [("online", B, True, ("logits", "q")), ("next", B, False, ("q",)), ("target", B, False, ("probs",))]
        self._ens_eval_batch = eval_batch
        if cfg.epistemic_theta > 0:
            passes += [("act", self.n_envs, False, ("q",)), ("eval", eval_batch, False, ("q",))]
        for head in self.ens_heads:
            head.declare_params(self.store)
            for tag, batch, backward, outputs in passes:
                head.declare_acts(self.acts, batch, tag, backward=backward, outputs=outputs)

    def _declare_temporal(self, eval_batch: int) -> None:
        """The temporal input (agent.temporal, numbarl/rl/temporal.py): its scan parameters (group
        'temporal.mamba', declared after every module before it; only the predictive-coding and future-feature heads
        come later)
        and a scan pass for every trunk pass."""
        from numbarl.rl.temporal import TemporalInput

        self.temporal = TemporalInput(self.cfg, self.state_dim, self.n_envs, eval_batch, horizons=self.extra_horizons)
        self.temporal.declare_params(self.store)
        tags = ["online", "next", "target", "act", "eval", "diag"] + (["iql_target"] if self.iql_head is not None else [])
        tags += [f"{kind}_h{h}" for h in self.extra_horizons for kind in ("next", "target")]
        # the passes with a backward: online, and next with ICM's agent.curiosity_trunk_grad (_trunk_backward)
        backward = ("online", "next") if self.icm is not None and self.icm.trunk_grad else ("online",)
        self.temporal.declare_acts(self.acts, tags, backward=backward)
        self.temporal.allocate()

    def _init_ensemble(self) -> None:
        """One C51 loss per extra head, the masks [M − 1, B], the direction-Q stack and score of the train
        batch, the stats slots and the gate; before the mapped stats are sized."""
        from numbarl.env.params import PORTFOLIO_FEATURES
        from numbarl.rl.nets.ensemble import EpistemicGate

        cfg, B, M = self.cfg, self.cfg.batch_size, len(self.ens_heads) + 1
        self.ens_losses = [C51Loss.for_head(head, B) for head in self.ens_heads]
        self.ens_state = Arena("agent.ensemble")
        self.ens_state.add("mask", (M - 1, B), np.float32)
        self.ens_state.add("dir_q", (M, B, 1), np.float32)
        self.ens_state.add("score", (B, 1), np.float32)
        self.ens_state.allocate()
        self._ens_grads = [[self.store.grad(n) for n in head.param_names.values()] for head in self.ens_heads]
        self._slot_ens_std = self.stats_layout.slot("ensemble_std")
        self._ens_reducer = Reducer(B)
        if cfg.epistemic_theta > 0:
            position_col = self.state_dim - len(PORTFOLIO_FEATURES) + PORTFOLIO_FEATURES.index("position")
            readiness = self.iqn_state["readiness_state"] if self.iqn_head is not None else None
            self.ens_gate = EpistemicGate([self.head, *self.ens_heads], cfg.epistemic_theta, self.n_envs,
                                          self._ens_eval_batch, position_col, readiness, armed=self._entry_gate_switch())
            self._slots_ens_gate = [self.stats_layout.slot(n) for n in
                                    ("epistemic_blocked_frac", "epistemic_score_mean", "epistemic_budget")]

    def _ens_forward_loss(self, stream) -> None:
        """Aux steps: the masks, then per extra head its next (online) and target passes on the trunk outputs
        the TARGETS phase left, its online pass, and its C51 loss with the mask as per-sample weights."""
        from numbarl.rl.nets.ensemble import bootstrap_masks

        batch, cfg = self.replay.batch, self.cfg
        mask = self.ens_state["mask"]
        bootstrap_masks(self.seed, batch.index, mask, stream,
                        weights=batch.weight if self.replay.normalize_weights else None)
        h_next, h_target, h = self.trunk.output("next"), self.trunk.output("target"), self._h_online()
        for m, (head, loss) in enumerate(zip(self.ens_heads, self.ens_losses)):
            head.forward(h_next, stream, tag="next")
            head.forward(h_target, stream, tag="target", role="target")
            out = head.forward(h, stream, tag="online")
            inputs = {"logits": out.logits, "actions": batch.action, "next_q": head.outputs("next").q,
                      "target_probs": head.outputs("target").probs, "rewards": self._rewards(), "dones": batch.done,
                      "discounts": batch.discount, "next_mask": batch.next_mask if cfg.lock_aware_target else None,
                      "weights": mask[m]}
            loss.apply(inputs, {"logits": loss.d_logits}, stream, ledger=self.store)

    def _ens_stats(self, stream) -> None:
        """Aux steps: ensemble_std = batch mean of u at the taken direction on the online pass."""
        from numbarl.rl.nets.ensemble import direction_q, epistemic_score

        dir_q, score = self.ens_state["dir_q"], self.ens_state["score"]
        direction_q([h.outputs("online").q for h in (self.head, *self.ens_heads)], dir_q, stream,
                    actions=self.replay.batch.action)
        epistemic_score(dir_q, score, stream)
        self._ens_reducer.mean(score.reshape(score.size), self.stats.device, stream, at=self._slot_ens_std)
    # --- end ensemble + epistemic gate ---------------------------------------------------------------

    # --- ICM (agent.curiosity_weight) ----------------------------------------------------------------
    def _init_icm(self) -> None:
        """The ICM loss (its arena holds reward′ and the running scale) and the consecutive stats slots
        icm_loss, icm_forward_loss, icm_inverse_loss, intrinsic_reward_mean, icm_error_scale; before the
        mapped stats are sized."""
        cfg = self.cfg
        self.icm_loss = IcmLoss(cfg.batch_size, self.trunk.out_dim, self.branch_sizes, cfg.curiosity_beta)
        self._slot_icm = self.stats_layout.slot(ICM_STAT_NAMES[0])
        for i, name in enumerate(ICM_STAT_NAMES[1:], 1):
            if self.stats_layout.slot(name) != self._slot_icm + i:
                raise RuntimeError("the ICM stats slots are not consecutive")

    def _rewards(self):
        """The batch reward the targets read: the replay's R_n, plus the intrinsic reward with ICM."""
        return self.icm_loss.rewards if self.icm is not None else self.replay.batch.reward

    def _curiosity(self, stream) -> None:
        """Every train step: the forward and inverse models on the online pass's φ(obs) and the next
        pass's φ(next_obs) (detached: no gradient reaches the trunk), their loss, their backward (the
        first writes of their gradients this step; the UPDATE phase moves them with everything else),
        then reward′ = R_n + r_i for the LOSS phase and the stats (numbarl/rl/losses/icm.py)."""
        batch, cfg = self.replay.batch, self.cfg
        phi, phi_next = self._h_online(), self.trunk.output("next")
        phi_hat, logits = self.icm.forward(phi, phi_next, batch.action, stream)
        loss = self.icm_loss
        loss.apply({"phi_hat": phi_hat, "phi_next": phi_next, "logits": logits, "actions": batch.action,
                    "dones": batch.done}, {"phi_hat": loss.grad("phi_hat"), "logits": loss.grad("logits")}, stream,
                   ledger=self.store)
        self.icm.backward(loss.grad("phi_hat"), loss.grad("logits"), stream)
        loss.intrinsic_reward(batch.reward, cfg.curiosity_weight, cfg.curiosity_normalize, self.stats.device,
                              self._slot_icm, stream)
    # --- end ICM -------------------------------------------------------------------------------------

    # --- multi-horizon C51 (agent.horizons) ----------------------------------------------------------
    def _init_mh(self) -> None:
        """Stats slots: the batch means of the trend strength and of the longest horizon's blend weight, and
        each horizon's unweighted cross-entropy (the longest's also under a fixed name, the liveness key)."""
        self._slot_mh_trend = self.stats_layout.slot("mh_trend_mean")
        self._slot_mh_weight = self.stats_layout.slot("mh_weight_longest")
        self._slot_mh_ce_longest = self.stats_layout.slot("mh_ce_longest")
        self._slots_mh_ce = [self.stats_layout.slot(f"mh_ce.h{h}") for h in self.horizons]
        self._mh_reducer = Reducer(self.cfg.batch_size)

    def _mh_targets(self, stream) -> None:
        """TARGETS of the extra horizons: the online net (double-DQN argmax) and the target net on each
        horizon's next_obs."""
        for hb in self.replay.batch.horizons:
            self.forward(hb.next_obs, stream, tag=f"next_h{hb.horizon}")
            self.forward(hb.next_obs, stream, tag=f"target_h{hb.horizon}", role="target")

    def _mh_inputs(self, inputs: dict) -> list:
        """Per-horizon C51 inputs (ascending horizons); the n_step horizon is the single loss's inputs."""
        extra = {hb.horizon: hb for hb in self.replay.batch.horizons}
        out = []
        for h in self.horizons:
            if h == self.cfg.n_step:
                out.append(inputs)
                continue
            hb = extra[h]
            out.append({"next_q": self.head.outputs(f"next_h{h}").q, "target_probs": self.head.outputs(f"target_h{h}").probs,
                        "rewards": hb.reward, "dones": hb.done, "discounts": hb.discount,
                        "next_mask": hb.next_mask if self.cfg.lock_aware_target else None})
        return out

    def _mh_stats(self, stream) -> None:
        red, dev = self._mh_reducer, self.stats.device
        red.mean(self.mh.trend, dev, stream, at=self._slot_mh_trend)
        red.mean(self.mh.weights[len(self.horizons) - 1], dev, stream, at=self._slot_mh_weight)
        for loss, slot in zip(self.mh.losses, self._slots_mh_ce):
            red.mean(loss.per_sample, dev, stream, at=slot)
        red.mean(self.mh.losses[-1].per_sample, dev, stream, at=self._slot_mh_ce_longest)
    # --- end multi-horizon C51 -------------------------------------------------------------------------

    # --- spectral norm + CVaR gate (agent.spectral_norm, agent.cvar_alpha) -------------------------------
    def _init_spectral_cvar(self) -> None:
        """Spectral normalization of the layers agent.spectral_norm names (its u, v from the seed, W_sn
        computed before any pass runs; stats spectral_sigma.<layer>) and the CVaR entry gate (stats
        cvar_blocked_frac, cvar_mean, cvar_budget; the IQN readiness as its budget when agent.iqn is on).
        Before the mapped stats are sized."""
        from numbarl.env.params import PORTFOLIO_FEATURES
        from numbarl.rl.cvar_gate import CvarGate
        from numbarl.rl.nets.spectral_norm import SpectralNorm

        cfg = self.cfg
        if cfg.spectral_norm:
            self.spectral = SpectralNorm(self.store, cfg.spectral_norm, self.seed)
            self._slots_sigma = [self.stats_layout.slot(f"spectral_sigma.{layer}") for layer in self.spectral.names]
        if cfg.cvar_alpha > 0:
            # the observation's signed-position column: the first portfolio feature after the market's
            position_col = self.state_dim - len(PORTFOLIO_FEATURES) + PORTFOLIO_FEATURES.index("position")
            readiness = self.iqn_state["readiness_state"] if self.iqn_head is not None else None
            self.cvar_gate = CvarGate(self.head, cfg.cvar_alpha, cfg.cvar_floor, self.n_envs, position_col, readiness,
                                      armed=self._entry_gate_switch())
            self._slots_cvar = [self.stats_layout.slot(n) for n in ("cvar_blocked_frac", "cvar_mean", "cvar_budget")]

    def _spectral_grad(self, stream) -> None:
        self.spectral.transform_grads(stream)

    def _spectral_power(self, stream) -> None:
        self.spectral.refresh(stream, n_iter=1, stats=self.stats.device, slots=self._slots_sigma)
    # --- end spectral norm + CVaR gate ---------------------------------------------------------------------

    def _branch_labels(self, group: str) -> dict:
        """{tensor: branch index of each element} for the tensors of `group` whose last axis is the
        advantage GEMM's columns (branch k: columns [off_k Z, (off_k + A_k) Z))."""
        cols = np.repeat(np.arange(self.n_branches), np.asarray(self.branch_sizes) * self.cfg.n_atoms)
        return {name: np.broadcast_to(cols, spec.shape).copy()
                for name, spec in self.store.specs.items() if spec.group == group}

    def set_epsilon_schedule(self, start: float, end: float, decay_steps: int) -> None:
        """Write the device epsilon schedule (host copy: between replays, never inside capture)."""
        if not (0.0 <= end <= 1.0 and 0.0 <= start <= 1.0) or int(decay_steps) < 1:
            raise ValueError(f"epsilon schedule needs start, end in [0, 1] and decay_steps >= 1 "
                             f"(got {start}, {end}, {decay_steps})")
        self.eps_start, self.eps_end, self.eps_decay = float(start), float(end), int(decay_steps)
        self.scalars.load({"epsilon_schedule": np.array([start, end], np.float32),
                           "epsilon_decay_steps": np.array([decay_steps], np.int64)})

    # -- the value support (C5 support-scale: agent.support = "fit") ------------------------------
    @property
    def support_range(self) -> tuple[float, float]:
        """(v_min, v_max) of the support in force (the config's, or the fitted one)."""
        return self.head.v_min, self.head.v_max

    # --- the entry gates' switch (CVaR, epistemic, confidence) -------------------------------------------
    def _entry_gate_switch(self):
        """The device uint8 [1] every entry gate's mask kernel reads (one per agent, on when built)."""
        if self.entry_gates is None:
            from numbarl.rl.cvar_gate import gate_switch

            self.entry_gates = gate_switch(mask_shape=(self.n_envs, len(self.branch_sizes), self.max_actions))
        return self.entry_gates["armed"]

    @property
    def entry_gates_armed(self):
        """The entry gates' device switch (uint8 [1], 1 = on), or None without a gate."""
        return None if self.entry_gates is None else self.entry_gates["armed"]

    def arm_entry_gates(self, armed: bool, stream) -> None:
        """Turn the entry gates on the collect step's mask (agent.cvar_alpha, agent.epistemic_theta,
        agent.confidence_floor) on or off; nothing without one. The trainer turns them off over the replay's
        prefill, the collect steps before the first train step: there the heads the gates read are untrained
        (an ensemble's disagreement, a CVaR or a confidence at initialization), and a gate at full budget (no
        IQN readiness) would take the random prefill's entries away, the returns the value support is fitted to
        with them (agent.support = "fit"). The backtest's greedy scores are always gated."""
        if self.entry_gates_armed is None:
            return
        stream.synchronize()  # the collect steps before this write have read the old value
        self.entry_gates_armed.copy_to_device(np.array([1 if armed else 0], np.uint8))

    def set_support(self, v_min: float, v_max: float) -> None:
        """Write the support linspace(v_min, v_max, Z) everywhere the steps read it: the head's
        `support` (every pass's Q), the loss's support and projection scalars (v_min, v_max, 1/Δz),
        the CQL term's support. Host copies into device memory that the captured graphs read (no
        kernel argument holds the support): call between graph replays, never inside a capture."""
        self.head.set_support(v_min, v_max)
        self.loss.set_support(v_min, v_max)
        for loss in (self.mh.losses if self.mh is not None else ()):  # multi-horizon C51: the other horizons'
            if loss is not self.loss:
                loss.set_support(v_min, v_max)
        if self.ens_heads:  # ensemble (agent.ensemble_heads): the extra heads and their losses
            for head, loss in zip(self.ens_heads, self.ens_losses):
                head.set_support(v_min, v_max)
                loss.set_support(v_min, v_max)
        if self.cql is not None:
            self.cql.arena.load({"support": self.head.support_host})
        self.support_state.load({"range": np.array([v_min, v_max], np.float64)})
        if self.atoms is not None and int(self.atoms.support_mode.copy_to_host()[0]) != 0:
            self._write_live_support(self.atoms.host_support(v_min, v_max))  # moved atoms: their spacing, new range
        self.stats.host[self._slot_support] = np.float32(v_min)
        self.stats.host[self._slot_support + 1] = np.float32(v_max)

    def fit_support(self, stream) -> dict | None:
        """agent.support = "fit": set the support to ±v fitted to the n-step returns the replay holds
        (numbarl/rl/support.py: the sampler's n and the device γ; v = max(|q_0.001|, |q_0.999|) of
        R_n times the horizon factor). Call ONCE, after the replay prefill and before the first
        train step, between graph replays (it copies the replay's rewards to the host and syncs
        `stream`). A resumed run gets the fitted support back from its checkpoint (load_state): do
        not fit again. Returns {"v_min", "v_max", "abs_quantile", "mean", "factor", "n"}, or None
        when agent.support is "fixed" or the replay holds no non-zero return (the support stays)."""
        from numbarl.rl.support import fit_support_range, replay_nstep_returns

        if self.cfg.support != "fit":
            return None
        store = self.replay.store
        reward = store["reward"].copy_to_host(stream=stream)
        done = store["done"].copy_to_host(stream=stream)
        count = store["count"].copy_to_host(stream=stream)
        gamma = self.replay.gamma_device.copy_to_host(stream=stream)
        stream.synchronize()
        g = float(gamma[0])
        returns = replay_nstep_returns(reward, done, int(count[0]), self.replay.n_step, g)
        fit = fit_support_range(returns, g, self.replay.n_step, self.cfg.support_horizon_factor)
        if fit["v"] is None:
            return None
        v = fit.pop("v")
        self.set_support(-v, v)
        self.stats.host[self._slot_support_fits] += 1.0
        return {"v_min": -v, "v_max": v, **fit}

    # -- the freeze reset (C6 detector → O4; numbarl/rl/freeze.py) -------------------------------
    FREEZE_GROUP = "head.adv"

    def on_freeze(self, stream) -> bool:
        """The freeze detector fired (numbarl.rl.freeze.FreezeDetector.update returned True): with
        agent.freeze_reset, zero Adam's m and v of the branch-advantage weights (group 'head.adv'),
        count it in the `freeze_resets` slot and return True; otherwise do nothing and return False.
        Eager launch between graph replays."""
        if not self.cfg.freeze_reset:
            return False
        for g in self.optim.groups:  # the group, or its per-branch parts (E4 splits head.adv)
            if self.optim.parents[g] == self.FREEZE_GROUP:
                self.optim.reset_moments(g, stream)
        self.stats.host[self._slot_freeze] += 1.0
        return True

    # -- network passes ------------------------------------------------------------------------
    def forward(self, obs, stream, tag: str, role: str = "params"):
        """Online (role='params') or target (role='target') network on obs; returns C51Outputs. With the
        temporal input the trunk reads h̃ of the pass's window instead (numbarl/rl/temporal.py: obs is
        that window's newest row, gathered before the pass)."""
        x = obs if self.temporal is None else self.temporal.forward(tag, stream, role)
        h = self.trunk.forward(x, stream, tag=tag, role=role)
        if tag == "online" and self.rdrop is not None:  # regime dropout: the online pass's consumers read h'
            h = self.rdrop.forward(h, obs, self.optim.step_counter, stream)
        return self.head.forward(h, stream, tag=tag, role=role)

    def _h_online(self):
        """The online pass's trunk features as its heads read them (after regime dropout when it is on)."""
        return self.trunk.output("online") if self.rdrop is None else self.rdrop.output

    def scores(self, obs, q_out, stream):
        """Greedy-evaluation Q [eval_batch, n_branches, max_actions] for a backtest's policies."""
        if self.temporal is not None:  # temporal input: obs into each policy's window of the last K bars
            self.temporal.push_eval(obs, stream)
        out = self.forward(obs, stream, tag="eval")
        _copy_kernel[_blocks(q_out.size), 256, stream](out.q.reshape(q_out.size), q_out.reshape(q_out.size))
        if self.cvar_gate is not None:  # CVaR entry gate (agent.cvar_alpha): gated entries scored lowest
            self.cvar_gate.on_scores(obs, q_out, stream, tag="eval")
        if self.conf_gate is not None:  # confidence gate (agent.confidence_floor)
            self.conf_gate.on_scores(self.trunk.output("eval"), obs, q_out, stream, tag="eval")
        if self.ens_gate is not None:  # epistemic gate (agent.epistemic_theta)
            self.ens_gate.on_scores(self.trunk.output("eval"), obs, q_out, stream, tag="eval")
        if self.feedback is not None:  # E9: no entries in gated regimes (numbarl/rl/feedback)
            self.feedback.on_scores(obs, q_out, stream)
        if self.risk_sizer is not None:  # risk head sizing, after every gate: a flat entry's greedy size × ρ
            self.risk_sizer.on_scores(self.trunk.output("eval"), obs, q_out, stream, tag="eval")

    def reset_eval(self, stream) -> None:
        """A backtest starts: the temporal input's windows are emptied (nothing else is carried)."""
        if self.temporal is not None:
            self.temporal.reset_eval(stream)

    def attach_feedback(self, loop) -> None:
        """Let a validation feedback loop (numbarl.rl.feedback.loop.FeedbackLoop) act inside the
        step functions: before they are captured (its device tables are read, never re-captured)."""
        self.feedback = loop
        if loop.weighted:  # E6/E8: the batch carries normalized loss weights from now on
            self.replay.normalize_weights = True


    # -- the agent contract: graphs and their schedule ------------------------------------------
    @property
    def aux_every(self) -> int:
        """Train steps per step with the auxiliary losses (agent.aux_frequency; 1 = every step, and
        then there is one train graph only)."""
        aux = self.cql is not None or (self.feedback is not None and self.feedback.has_aux_loss)
        aux = aux or self.iqn_head is not None  # IQN (agent.iqn) is an auxiliary loss
        aux = aux or self.iql_head is not None  # IQL (agent.iql) is an auxiliary loss
        aux = aux or self.conf_head is not None  # recursive confidence (agent.confidence_weight) too
        aux = aux or self.atoms is not None  # adaptive atoms (agent.adaptive_atoms) step on the aux steps
        aux = aux or bool(self.ens_heads)  # the ensemble's extra heads (agent.ensemble_heads) too
        aux = aux or self.pc_head is not None  # predictive coding (agent.predictive_weight) too
        aux = aux or self.ff_head is not None  # future-feature regression (agent.future_weight) too
        aux = aux or self.risk_head is not None  # the risk-budget head (agent.risk_head_weight) too
        return int(self.cfg.aux_frequency) if aux else 1

    def step_functions(self, env) -> dict:
        steps = {"collect": lambda s: self.collect_step(env, s), "train": self.train_step,
                 "diagnostics": lambda s: self.diagnostics_step(env, s)}
        if self.aux_every > 1:  # the train step without the auxiliary losses, and the one with them
            steps["train"] = lambda s: self.train_step(s, aux=False)
            steps["train_aux"] = lambda s: self.train_step(s, aux=True)
        return steps

    def after_collect(self, collect_steps: int, learning_starts: int, train_every: int) -> tuple[str, ...]:
        """One train step after every `train_every`-th collect step once the replay holds enough;
        with auxiliary losses every aux_every-th of them (collect step k * train_every with k a
        multiple of aux_every: a rule of the step number alone, so a resume keeps the rhythm) is
        the train step that also runs them."""
        ready = collect_steps >= self.train_starts_after(learning_starts)
        if not (ready and collect_steps % int(train_every) == 0):
            return ()
        if self.aux_every > 1 and (collect_steps // int(train_every)) % self.aux_every == 0:
            return ("train_aux",)
        return ("train",)

    @property
    def prefill_steps(self) -> int:
        return self.replay.min_writes

    # -- the two step functions (captured as graphs) --------------------------------------------
    def collect_step(self, env, stream):
        # COLLECT
        t, sc = env.transition, self.scalars
        # obs_t also straight into the replay's row of this step (no separate obs copy)
        obs, mask = env.gather(t.obs, t.mask, stream, ring=self.replay.obs_ring())
        if self.temporal is not None:                                  # temporal input: each env's last K rows
            self.temporal.gather_act(self.replay, stream)
        if self.feedback is not None:                                  # E9 gate on the mask (feedback loop)
            self.feedback.on_mask(obs, mask, stream)
        q = self.forward(obs, stream, tag="act").q                     # [N, n_branches, max_actions]
        explore = None  # the exploratory draws' mask: the env's (None: the same as the greedy choice's)
        if self.entry_gates is not None:  # entry gates: on a copy of the mask that only the greedy choice reads
            explore, mask = mask, self.entry_gates["greedy_mask"]
            elementwise.copy(explore, mask, stream)
        if self.cvar_gate is not None:                                 # CVaR entry gate (agent.cvar_alpha)
            self.cvar_gate.on_mask(obs, mask, stream, tag="act")
        if self.conf_gate is not None:  # confidence gate (agent.confidence_floor)
            self.conf_gate.on_mask(self.trunk.output("act"), obs, mask, stream, tag="act")
        if self.ens_gate is not None:  # epistemic gate (agent.epistemic_theta)
            self.ens_gate.on_mask(self.trunk.output("act"), obs, mask, stream, tag="act")
        preference = env.arena["preference"]                           # C51: Q(long) - Q(short)
        step, schedule, decay = sc["collect_step"], sc["epsilon_schedule"], sc["epsilon_decay_steps"]
        if self.risk_sizer is None:  # ε-greedy, the env step and the replay's row (obs already there): one launch
            out = scheduled_epsilon_greedy_step(q, mask, step, schedule, decay, t.actions, preference, env, self.replay,
                                                stream, risk_budget=self._risk_budget(stream),  # R18: ρ (or 1)
                                                explore=explore)
        else:
            scheduled_epsilon_greedy(q, mask, step, schedule, decay, env.seed_dev, env.counter, t.actions, preference,
                                     stream, explore=explore)
            # risk head: a flat env's new entry at size × ρ, snapped down (executed)
            self.risk_sizer.on_actions(self.trunk.output("act"), obs, t.actions, env.grids.sizes, stream, tag="act")
            out = env.step(t.actions, preference, stream=stream,       # fills, reward, done, reset
                           risk_budget=self._risk_budget(stream))      # R18: ρ = IQN readiness² (or 1)
            self.replay.write(obs, t.actions, out.reward, out.done, stream, mask=mask, obs_written=True, advance=False)
        # ε, the collect-step count, the replay's write count and the env's RNG counter: one launch
        collect_tail_kernel[1, 1, stream](sc["collect_step"], sc["epsilon_schedule"], sc["epsilon_decay_steps"],
                                          sc["epsilon"], self.stats.device, self.replay.count, env.counter)
        if self.feedback is not None:                                  # E6: rows of winning trades
            self.feedback.on_written(out, env, self.replay, stream)
        if self.risk_labels is not None:  # risk head: the closed trades' entry rows get their outcome
            self.risk_labels.mark(out, env.state, self.replay, stream)

    def _plain_network(self) -> bool:
        """Whether the network is the plain MLP trunk + C51 head with nothing on the passes' or the backward's
        streams but their own layers: what agent.overlap runs on forked streams (every component that adds a
        pass, a head, a second trunk backward or a write into a gradient keeps the one-stream step)."""
        layers = getattr(self.trunk, "layers", None)
        plain_trunk = layers is not None and all(isinstance(m, Linear) for m in layers)
        return (plain_trunk and self.temporal is None and self.rdrop is None and self.icm is None and self.mh is None
                and self.spectral is None and not self._aux_heads())

    def train_phases(self) -> list:
        """The train step's phases in program order (train_step opens the gradient ledger's step and
        runs exactly these; a phase run alone, e.g. timed by numbarl-bench, opens its own). With
        agent.overlap on a plain network, TARGETS and ONLINE are one phase, "forward" (`_forward`)."""
        passes = [("forward", self._forward)] if self.overlap else [("targets", self._targets), ("online", self._online)]
        phases = [("sample", self._sample), *passes, ("loss", self._loss), ("backward", self._backward),
                  ("update", self._update), ("stats", self._stats)]
        # --- spectral norm (agent.spectral_norm): dW from dW_sn before the update, then one power
        # iteration and W_sn for the new weights (numbarl/rl/nets/spectral_norm.py) ----------------------
        if self.spectral is not None:
            at = [name for name, _ in phases].index("update")
            phases.insert(at, ("spectral_grad", self._spectral_grad))
            phases.append(("spectral", self._spectral_power))
        # --- end spectral norm -------------------------------------------------------------------------------
        if self.icm is not None:  # ICM (agent.curiosity_weight): models, their loss and backward, reward′ before LOSS
            phases.insert([name for name, _ in phases].index("loss"), ("curiosity", self._curiosity))
        if self.isv is not None:  # ISV (agent.isv): the last launch of the step, on the stats it wrote
            phases.append(("isv", self._isv_update))
        return phases

    def train_step(self, stream, aux: bool = True):
        """One gradient step; aux=False leaves out the auxiliary losses (CQL) for agent.aux_frequency."""
        self._aux = aux
        try:
            self.store.begin_step()  # the gradient rule: this step's first writes overwrite (the update closes it)
            for _, phase in self.train_phases():
                phase(stream)
        finally:
            self._aux = True

    # SAMPLE
    def _sample(self, stream):
        factor = self.feedback.sample_factor if self.feedback is not None else None  # E8's bucket weights
        self.replay.sample(self.optim.step_counter, stream, factor=factor)
        if self.temporal is not None:  # temporal input: the K-row windows of obs, next_obs (and the horizons')
            self.temporal.gather_batch(self.replay, stream)
        if self.obs_noise is not None:  # observation noise: on every copy of an observation the learner reads
            self._perturb_batch(stream)
        if self.reward_center is not None:  # reward centering: r̄ from the batch, every window's returns less it
            self.reward_center.apply(self.replay, self.stats.device, stream)
        if self.feedback is not None:  # E1: the sampled returns less the reward offset
            self.feedback.on_sample(self.replay.batch, stream)

    def _perturb_batch(self, stream):
        """agent.obs_noise (numbarl/rl/obs_noise.py): noise on the sampled batch's market features, in place
        (the replay keeps the clean rows); each tensor its own lane range."""
        batch, noise, counter = self.replay.batch, self.obs_noise, self.optim.step_counter
        noise.apply(batch.obs, 0, counter, stream)
        noise.apply(batch.next_obs, 1, counter, stream)
        for i, hb in enumerate(batch.horizons):
            noise.apply(hb.next_obs, 2 + 2 * i, counter, stream)
        if self.temporal is not None:  # the windows the scan reads (their masked rows stay zero)
            names = ["obs", "next"] + [f"h{hb.horizon}" for hb in batch.horizons]
            for i, name in enumerate(names):
                x, mask = self.temporal.window_rows(name)
                noise.apply(x, 100 + i, counter, stream, row_mask=mask)

    # TARGETS (double DQN: online argmax on next_obs, target-network probabilities)
    def _targets(self, stream):
        batch = self.replay.batch
        self.forward(batch.next_obs, stream, tag="next")
        self.forward(batch.next_obs, stream, tag="target", role="target")
        if self.target_at:
            self._target_at(stream)
        if self.mh is not None:  # multi-horizon C51: the same two passes on every extra horizon's next_obs
            self._mh_targets(stream)

    def _online(self, stream):
        self.forward(self.replay.batch.obs, stream, tag="online")

    def _forward(self, stream):
        """TARGETS and ONLINE at once (agent.overlap): the next-obs pass and the target pass each on a stream
        forked from `stream`, the online pass on `stream`, joined before the loss. The three passes share no
        buffer (each tag has its own activations and padded-weight scratch, each stream its own cuBLASLt
        workspace), so every kernel computes what it computes in sequence: the same bits, with the passes'
        small kernels and GEMM tails filling each other's idle SMs."""
        batch = self.replay.batch
        branches = cuda_graph.fork(stream, 2)
        self.forward(batch.next_obs, branches[0], tag="next")
        self.forward(batch.next_obs, branches[1], tag="target", role="target")
        if self.target_at:  # a* on the next-obs pass's stream, then the target's rows at a* where both are done
            self._target_at(branches[1], next_stream=branches[0])
        self._online(stream)
        cuda_graph.join(stream, branches)

    def _target_at(self, stream, next_stream=None):
        """The target pass's probabilities at a* alone (agent.target_at): a* (the loss's argmax,
        C51Loss.double_dqn_actions) from the next-obs pass's Q on `next_stream` (that pass's stream; None: `stream`),
        then the head's select_probs on `stream` once both passes are done: the rows the projection reads, bit for
        bit, without the other actions'."""
        next_stream = stream if next_stream is None else next_stream
        mask = self.replay.batch.next_mask if self.cfg.lock_aware_target else None
        a_star = self.loss.double_dqn_actions(self.head.outputs("next").q, next_stream, next_mask=mask)
        if next_stream is not stream:
            cuda_graph.join(stream, [next_stream])
        self.head.select_probs("target", a_star, stream)

    # LOSS
    def _loss_inputs(self) -> dict:
        """The C51 loss's inputs this step."""
        batch = self.replay.batch
        return {"logits": self.head.outputs("online").logits, "actions": batch.action,
                "next_q": self.head.outputs("next").q, "target_probs": self._target_probs(),
                "rewards": self._rewards(), "dones": batch.done, "discounts": batch.discount,
                "next_mask": batch.next_mask if self.cfg.lock_aware_target else None,  # the env's mask of next_obs
                "weights": batch.weight if self.replay.normalize_weights else None,  # E6/E8 loss weights
                "lse": self.acts["head.online.lse"]}  # the head's row log-sum-exp: the loss reads, not recomputes

    def _target_probs(self):
        """The target pass's probabilities as the loss reads them: at a* alone [B, n_branches, Z] (target_at), or
        all of them [B, n_branches, max_actions, Z]."""
        out = self.head.outputs("target")
        return out.probs_at if self.target_at else out.probs

    def target_probs_host(self) -> np.ndarray:
        """The target pass's probabilities as a dense host array [B, n_branches, max_actions, Z] (references and
        tests): all of them, or (target_at) the rows at this step's a* with zeros elsewhere, which is all any
        double-DQN target reads."""
        out = self.head.outputs("target")
        if not self.target_at:
            return out.probs.copy_to_host()
        return taken_rows_dense_ref(out.probs_at.copy_to_host(), self.loss.arena["a_star"].copy_to_host(),
                                    self.branch_sizes)

    def _loss(self, stream):
        if not self.overlap:
            self._losses(stream)
            return
        with cuda_graph.beside(stream):  # agent.overlap: the statistics' batch sums and the loss's reduction beside
            self._batch_stats(cuda_graph.side_stream(stream), STATS_SUMS)
            self._losses(stream)

    def _losses(self, stream):
        batch, cfg = self.replay.batch, self.cfg
        inputs = self._loss_inputs()
        if self.mh is None:  # alone at the logits: the taken rows of its gradient (the head's TakenGrad)
            grads = {"logits_taken": self.loss.d_taken} if self._taken_grad() else {"logits": self.loss.d_logits}
            self.loss.apply(inputs, grads, stream, ledger=self.store)
        else:  # multi-horizon C51: the n_step loss writes d_logits, the other horizons add (regime-blended)
            self.mh.apply({"logits": inputs["logits"], "actions": batch.action, "obs": batch.obs,
                           "horizons": self._mh_inputs(inputs), "weights": inputs["weights"]},
                          {"logits": self.loss.d_logits}, stream, ledger=self.store)
        if self.cql is not None and self._aux:  # adds α · ∂L_cql/∂logits into the same buffer (C51 wrote first)
            self.cql.apply({"logits": inputs["logits"], "lse": inputs["lse"], "actions": batch.action},
                           {"logits": self.loss.d_logits}, stream, weight=cfg.cql_alpha, ledger=self.store)
        if self.feedback is not None and self._aux:  # E7's margin loss on the labelled rows (adds)
            self.feedback.apply_losses({"logits": inputs["logits"], "lse": inputs["lse"]},
                                       self.loss.d_logits, self.head.support, stream, self.store)
        if self.iqn_head is not None and self._aux:  # IQN (agent.iqn): its own head's quantile Huber loss
            self._iqn_forward_loss(stream)
        if self.iql_head is not None and self._aux:  # IQL (agent.iql): the value head's expectile loss
            self._iql_forward_loss(stream)
        if self.conf_head is not None and self._aux:  # recursive confidence: the head's cross-entropy
            self._conf_forward_loss(stream)
        if self.risk_head is not None and self._aux:  # risk-budget head: cross-entropy on the trade outcomes
            self._risk_forward_loss(stream)
        if self.ens_heads and self._aux:  # ensemble: the extra heads' masked C51 losses
            self._ens_forward_loss(stream)
        if self.pc_head is not None and self._aux:  # predictive coding: the predictor's normalized L2
            pred = self.pc_head.forward(self._h_online(), stream, tag="online")
            self.pc_loss.apply({"pred": pred, "target": self.trunk.output("target"), "dones": batch.done},
                               {"pred": self.pc_loss.grad("pred")}, stream, weight=cfg.predictive_weight,
                               ledger=self.store)
        if self.ff_head is not None and self._aux:  # future-feature regression: the head's squared error
            pred = self.ff_head.forward(self._h_online(), stream, tag="online")
            self.ff_loss.apply({"pred": pred, "next_obs": batch.next_obs, "dones": batch.done},
                               {"pred": self.ff_loss.grad("pred")}, stream, weight=cfg.future_weight,
                               ledger=self.store)

    # BACKWARD (d logits → head → trunk)
    def _taken_grad(self) -> bool:
        """Whether the C51 loss is the only writer of the logits' gradient this step (no multi-horizon blend, no
        CQL term, no E7 margin loss): its gradient is then zero off the taken actions, and the loss writes the
        taken rows alone (`TakenGrad`, the same bits in the head's backward without the dense array)."""
        margin = self.feedback is not None and self.feedback.margin is not None  # E7 adds at the logits
        return self.mh is None and self.cql is None and not margin

    def _head_grad(self):
        """The C51 head's output gradient as the loss wrote it: a TakenGrad, or the dense d_logits."""
        if self._taken_grad():
            return TakenGrad(self.loss.d_taken, self.replay.batch.action)
        return self.loss.d_logits

    def logits_grad_host(self) -> np.ndarray:
        """The C51 head's last ∂L/∂logits as a dense host array [B, n_branches, max_actions, Z] (its taken rows
        expanded when the loss wrote those): references and tests."""
        grad = self._head_grad()
        if isinstance(grad, TakenGrad):
            return taken_rows_dense_ref(grad.rows.copy_to_host(), grad.actions.copy_to_host(), self.branch_sizes)
        return grad.copy_to_host()

    def _aux_heads(self) -> list:
        """[(head, its output gradient, its parameter gradients)] of the auxiliary heads on the
        trunk (IQN, IQL, confidence, the ensemble's extra heads, the predictive-coding predictor), in the order
        their input gradients add into dh."""
        heads = []
        if self.iqn_head is not None:
            heads.append((self.iqn_head, self.iqn_loss.grad("quantiles"), self._iqn_grads))
        if self.iql_head is not None:
            heads.append((self.iql_head, self.iql_loss.grad("v"), self._iql_grads))
        if self.conf_head is not None:  # recursive confidence (agent.confidence_weight)
            heads.append((self.conf_head, self.conf_loss.grad("logits"), self._conf_grads))
        if self.ens_heads:  # ensemble (agent.ensemble_heads): the extra heads, in head order
            heads += [(head, loss.d_logits, grads) for head, loss, grads in
                      zip(self.ens_heads, self.ens_losses, self._ens_grads)]
        if self.pc_head is not None:  # predictive coding (agent.predictive_weight): the predictor
            heads.append((self.pc_head, self.pc_loss.grad("pred"), self._pc_grads))
        if self.ff_head is not None:  # future-feature regression (agent.future_weight): its head
            heads.append((self.ff_head, self.ff_loss.grad("pred"), self._ff_grads))
        if self.risk_head is not None:  # the risk-budget head (agent.risk_head_weight)
            heads.append((self.risk_head, self.risk_loss.grad("logits"), self._risk_grads))
        return heads

    def _backward(self, stream):
        """C51 head → trunk. With auxiliary heads (IQN, IQL), on an aux step the C51 head writes dh,
        each auxiliary head adds its part (the gradient ledger, in a fixed order) and the trunk's
        backward runs once on the sum; on the other steps their parameter gradients are zeroed (no
        stale gradient reaches Adam) and the backward is the plain one."""
        heads = self._aux_heads()
        if heads and self._aux:
            dh = self.head.backward(self._head_grad(), stream, tag="online", dx_out=self.aux_state["dh"])
            for head, grad, _ in heads:
                head.backward(grad, stream, tag="online", dx_out=dh)
            self._trunk_backward(dh, stream)
            return
        for _, _, grads in heads:
            for g in grads:
                elementwise.fill(g, 0.0, stream)
        with cuda_graph.beside(stream, on=self.overlap):  # agent.overlap: weight gradients on a side stream
            dh = self.head.backward(self._head_grad(), stream, tag="online")
            self._trunk_backward(dh, stream)

    def _trunk_backward(self, dh, stream):
        """The trunk's backward on dh; with ICM's agent.curiosity_trunk_grad the inverse loss's ∂L/∂φ(obs)
        is added into dh first (after the heads: the ledger's order) and its ∂L/∂φ(next_obs) runs a
        second trunk backward on the "next" pass, whose parameter gradients add (the gradient rule). With
        the temporal input each trunk backward's input gradient then runs the scan's backward on the same
        pass (online, then next), the scan's gradients adding likewise."""
        if self.icm is None or not self.icm.trunk_grad:
            if self.rdrop is not None:  # regime dropout: ∂L/∂h = ∂L/∂h' ⊙ s
                self.rdrop.backward(dh, stream)
            dx = self.trunk.backward(dh, stream, tag="online")
            if self.temporal is not None:  # temporal input: dh̃ back through the scan's K steps
                self.temporal.backward(dx, stream)
            return
        d_phi_next = self.icm.add_trunk_grads(dh, stream)
        if self.rdrop is not None:  # regime dropout: the online pass's dh (heads and ICM's φ(obs) part) ⊙ s
            self.rdrop.backward(dh, stream)
        dx = self.trunk.backward(dh, stream, tag="online")
        dx_next = self.trunk.backward(d_phi_next, stream, tag="next")
        if self.temporal is not None:  # temporal input: both passes' dh̃ through the scan
            self.temporal.backward(dx, stream)
            self.temporal.backward(dx_next, stream, tag="next")

    # UPDATE (global-norm clip, AdamW, target copy / Polyak)
    def _update(self, stream):
        self.optim.step(stream)

    # STATS
    def _batch_stats(self, stream, stage) -> None:
        """The train statistics' per-sample terms and then `train_stats_kernel` at `stage`: STATS_ALL (sums and the
        rest) or STATS_SUMS (the batch sums alone, beside the loss with agent.overlap) or STATS_FINAL (the rest, from
        those sums; no terms kernel)."""
        batch = self.replay.batch
        terms = self.stats_terms
        if stage != STATS_FINAL:
            train_stats_terms_kernel[launch.blocks(self.cfg.batch_size, TERMS_BLOCK), TERMS_BLOCK, stream](
                self.head.outputs("online").q, self.head.outputs("next").q, batch.action, batch.index,
                batch.next_index, np.int64(self.n_envs), np.int64(self.replay.n_slots), batch.next_mask,
                np.int64(self.branch_sizes[0] if self.cfg.lock_aware_target else 0),
                terms["tq"], terms["tn"], terms["tm"], terms["tl"])
        loss = self.loss.loss if self.mh is None else self.mh.loss  # multi-horizon C51: the blended loss
        train_stats_kernel[1, 1 if stage == STATS_FINAL else STATS_BLOCK, stream](
            terms["tq"], terms["tn"], terms["tm"], terms["tl"], loss, self.optim.stats, self.scalars["train_step"],
            self.stats.device, terms["sums"], stage)

    def _stats(self, stream):
        if self.cql is not None:
            stat_copy_kernel[1, 1, stream](self.cql.loss, self.stats.device, np.int64(STAT_CQL_LOSS))
        self._batch_stats(stream, STATS_FINAL if self.overlap else STATS_ALL)  # overlap: the sums ran in LOSS
        if self.mh is not None:
            self._mh_stats(stream)
        if self.atom_reg is not None:  # C5: utilisation of the taken actions' atoms → u_ema → next step's β
            self._atom_entropy_control(stream)
        if self.atoms is not None and self._aux:  # C4: J, ∂J/∂s, the spacing step, the new live support
            self._adaptive_atoms(stream)
        if self.iqn_head is not None and self._aux:  # IQN (agent.iqn): loss, its EMA and readiness, on the device
            iqn_readiness_kernel[1, 1, stream](self.iqn_loss.loss, self.iqn_state["readiness_state"], self.stats.device,
                                               np.int64(self._slot_iqn_loss), np.int64(self._slot_iqn_ready),
                                               np.int64(self._slot_iqn_ema))
        if self.iql_head is not None and self._aux:  # IQL (agent.iql): its loss and the mean V
            self._iql_stats(stream)
        if self.conf_head is not None and self._aux:  # recursive confidence: loss, mean c, bootstrapped share
            self._conf_stats(stream)
        if self.ens_heads and self._aux:  # ensemble: the batch-mean epistemic score
            self._ens_stats(stream)
        if self.rdrop is not None:  # regime dropout: the share of the online trunk features dropped this step
            self._rdrop_reducer.mean(self.rdrop.dropped, self.stats.device, stream, at=self._slot_rdrop)
        if self.obs_noise is not None:  # observation noise: the mean noise² on this step's obs
            self._obs_noise_reducer.mean(self.obs_noise.sq, self.stats.device, stream, at=self._slot_obs_noise)
        if self.pc_head is not None and self._aux:  # predictive coding: its loss
            stat_copy_kernel[1, 1, stream](self.pc_loss.loss, self.stats.device, np.int64(self._slot_pc_loss))
        if self.ff_head is not None and self._aux:  # future-feature regression: its loss
            stat_copy_kernel[1, 1, stream](self.ff_loss.loss, self.stats.device, np.int64(self._slot_ff_loss))
        if self.risk_head is not None and self._aux:  # risk-budget head: loss, mean ρ, labelled rows
            self._risk_stats(stream)

    def _isv_update(self, stream):
        """ISV (agent.isv, numbarl/rl/isv.py): one one-thread kernel on this step's device stats."""
        self.isv.update(self.stats.device, (STAT_LOSS, STAT_GRAD_NORM, STAT_Q_MEAN, STAT_Q_NEXT_MAX, STAT_CLIP_SCALE),
                        stream)

    def _atom_entropy_control(self, stream):
        B, nb, Z = self.cfg.batch_size, self.n_branches, self.cfg.n_atoms
        target = self.cfg.atom_entropy_source == "target"  # the projected targets' perplexity, or the taken probs
        source = self.loss.target_dist if target else self.loss.taken_probs
        reduce.col_sum(source.reshape(B * nb, Z), self.atom_reg["atom_sums"], self.atom_reg["atom_partials"], stream)
        self._entropy_reducer.mean(self.loss.entropy, self.stats.device, stream, at=self._slot_entropy_mean)
        atom_entropy_control_kernel[1, 1, stream](self.atom_reg["atom_sums"], np.float64(1.0 / (B * nb)),
                                                  self.atom_reg["u_ema"], np.float64(self.cfg.atom_entropy_max),
                                                  self.loss.entropy_beta, self.stats.device,
                                                  np.int64(self._slot_util), np.int64(self._slot_util_ema),
                                                  np.int64(self._slot_beta), np.int64(1 if target else 0))

    def _adaptive_atoms(self, stream):
        batch = self.replay.batch
        self.atoms.step(self.loss, self._rewards(), batch.done, batch.discount, batch.action,
                        self.head.outputs("target").probs, self.head.support, self.support_state["range"],
                        self.scalars["train_step"], self.stats.device, self._slot_support_entropy,
                        self._slot_spacing_ratio, stream)
        if self.cql is not None:  # the CQL term keeps its own copy of the support
            support = self.head.support
            _copy_kernel[_blocks(support.size), 256, stream](support, self.cql.arena["support"])

    def _write_live_support(self, support) -> None:
        """Host write of a float32 [Z] support into the head's device support (every pass and every
        bound C51 loss read it) and the CQL term's copy (adaptive atoms; between replays)."""
        support = np.asarray(support, np.float32)
        self.head.layout.load({"support": support})
        if self.cql is not None:
            self.cql.arena.load({"support": support})

    # DIAGNOSTICS (log intervals only: what the last train and collect steps left in their buffers)
    def diagnostics_step(self, env, stream):
        for reducer, views, slot in self._group_norms:  # gradient norm per optimizer group
            reducer.l2norm(views, self.stats.device, stream, at=slot)
        B, nb, Z = self.cfg.batch_size, self.n_branches, self.cfg.n_atoms
        reduce.col_sum(self.loss.target_dist.reshape(B * nb, Z), self.diag["atom_sums"], self.diag["atom_partials"],
                       stream)
        atom_utilization_kernel[1, 1, stream](self.diag["atom_sums"], np.float64(B * nb), self.stats.device,
                                              np.int64(self._slot_atoms))
        self._qgap_reducer.mean(env.arena["preference"], self.stats.device, stream, at=self._slot_qgap)
        action_entropy_kernel[nb, MAX_BRANCH_ACTIONS, stream](self.replay.store["action"], self.replay.count,
                                                               self.diag["branch_sizes"], self.stats.device,
                                                               np.int64(self._slot_entropy))
        # Q statistics of the last train batch (C6): the target network on its obs for q_divergence
        batch = self.replay.batch
        q_target = self.forward(batch.obs, stream, tag="diag", role="target").q
        q_stats_kernel[1, STATS_BLOCK, stream](self.head.outputs("online").q, q_target, batch.action,
                                               env.arena["preference"], self.scalars["train_step"],
                                               self.stats.device, np.int64(self._slot_qstats))
        if self.iql_head is not None:  # IQL (agent.iql): the advantage diagnostic on the same batch
            self._iql_diagnostics(q_target, stream)
        if self.cvar_gate is not None:  # CVaR entry gate (agent.cvar_alpha): the last collect step's share gated
            self.cvar_gate.write_stats(self.stats.device, self._slots_cvar, stream)
        if self.conf_gate is not None:  # confidence gate: the last collect step's share
            self._conf_gate_reducer.mean(self.conf_gate.gated, self.stats.device, stream, at=self._slot_conf_gated)
        if self.ens_gate is not None:  # epistemic gate: the last collect step's share gated
            self.ens_gate.write_stats(self.stats.device, self._slots_ens_gate, stream)
        if self.risk_sizer is not None:  # risk head sizing: the share of envs the last collect step resized
            self._risk_resized_reducer.mean(self.risk_sizer.resized, self.stats.device, stream,
                                            at=self._slot_risk_resized)

    # -- checkpoints --------------------------------------------------------------------------------
    def state_arrays(self) -> dict[str, np.ndarray]:
        out = {}
        for role, arena in self.store.arenas.items():
            if role == "grads":
                continue
            for name, value in arena.to_host().items():
                out[f"{role}/{name}"] = value
        for name, value in self.optim_state().items():
            out[f"optim/{name}"] = value
        for name, value in self.replay.store.to_host().items():
            out[f"replay/{name}"] = value
        for name, value in self.scalars.to_host().items():
            out[f"agent/{name}"] = value
        out["agent/stats"] = self.stats.host.copy()
        out["support/range"] = self.support_state["range"].copy_to_host()
        if self.atoms is not None:  # adaptive atoms: the spacings, the mode flag and the live support itself
            out.update(self.atoms.state_arrays())
            out["atoms/support"] = self.head.support.copy_to_host()
        if self.atom_reg is not None:
            out["atom_entropy/u_ema"] = self.atom_reg["u_ema"].copy_to_host()
            out["atom_entropy/beta"] = self.loss.entropy_beta.copy_to_host()
        if self.iqn_head is not None:  # IQN (agent.iqn): the readiness state
            out["iqn/readiness_state"] = self.iqn_state["readiness_state"].copy_to_host()
        if self.spectral is not None:  # spectral norm (agent.spectral_norm): the power-iteration vectors
            out.update(self.spectral.state_arrays())
        if self.icm is not None:  # ICM (agent.curiosity_weight): the intrinsic reward's running scale
            out["icm/scale"] = self.icm_loss.scale.copy_to_host()
        if self.isv is not None:  # ISV (agent.isv): the signals and their update counts
            out.update(self.isv.state_arrays())
        if self.reward_center is not None:  # reward centering (agent.reward_centering): r̄ and its update count
            out.update(self.reward_center.state_arrays())
        if self.risk_labels is not None:  # risk-budget head: the outcome labels beside the replay, the size grid
            out.update({f"risk/{k}": v for k, v in self.risk_labels.state_arrays().items()})
            out["risk_grid/base_rate"] = self.risk_loss.base_rate.copy_to_host()  # the sizing's ρ̄ (a policy array)
            if self.risk_sizer is not None and self.risk_sizer.bound:
                out["risk_grid/sizes"] = self.risk_sizer.dev["sizes"].copy_to_host()
        return out

    def optim_state(self) -> dict[str, np.ndarray]:
        return self.optim.state.to_host()

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        for role, arena in self.store.arenas.items():
            if role == "grads":
                continue
            arena.load({k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith(role + "/")})
        optim = {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("optim/")}
        if "lr" in optim and optim["lr"].shape != self.optim.lr.shape:  # a checkpoint from before groups
            optim["lr"] = np.broadcast_to(optim["lr"], self.optim.lr.shape)
        if "stats" in optim and optim["stats"].shape != self.optim.state["stats"].shape:
            # a checkpoint from a version with fewer optimizer statistics: the ones it has, then defaults
            stats = self.optim.state["stats"].copy_to_host()
            n = min(stats.size, optim["stats"].size)
            stats[:n] = optim["stats"][:n]
            optim["stats"] = stats
        self.optim.state.load(optim)
        self.replay.store.load({k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("replay/")})
        self.scalars.load({k.split("/", 1)[1]: v for k, v in arrays.items()
                           if k.startswith("agent/") and k != "agent/stats"})
        if "agent/stats" in arrays:  # a checkpoint from a version with fewer slots fills the ones it has
            saved = np.asarray(arrays["agent/stats"], np.float32)
            n = min(saved.size, self.stats.host.size)
            self.stats.host[:n] = saved[:n]
        self._load_support(arrays)
        if self.atom_reg is not None and "atom_entropy/u_ema" in arrays:
            self.atom_reg.load({"u_ema": arrays["atom_entropy/u_ema"]})
            self.loss.arena.load({"entropy_beta": arrays["atom_entropy/beta"]})
        if self.iqn_head is not None and "iqn/readiness_state" in arrays:  # IQN (agent.iqn)
            self.iqn_state.load({"readiness_state": arrays["iqn/readiness_state"]})
        if self.icm is not None and "icm/scale" in arrays:  # ICM (agent.curiosity_weight)
            self.icm_loss.arena.load({"scale": arrays["icm/scale"]})
        if self.spectral is not None:  # spectral norm (agent.spectral_norm): vectors, then W_sn of the loaded W
            self.spectral.load_arrays(arrays)
        if self.isv is not None:  # ISV (agent.isv)
            self._load_isv(arrays)
        if self.reward_center is not None:  # reward centering (agent.reward_centering)
            self.reward_center.load_state(arrays)
        if self.risk_labels is not None:  # risk-budget head: labels and entry rows, the size grid
            self.risk_labels.load_state({k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("risk/")})
            self._load_risk_grid(arrays)

    def _load_isv(self, arrays) -> None:
        """The ISV state; with the ISV routing on, arrays without isv/vector are refused (the routing would
        read isv = 0 and route every pass with w = σ(b_r) alone, silently)."""
        if self.temporal is not None and self.temporal.route is not None and "isv/vector" not in arrays:
            raise ValueError("the checkpoint has no isv/vector: the ISV routing (agent.isv_routing) would route with "
                             "isv = 0; load a checkpoint written with agent.isv_routing on")
        self.isv.load_arrays(arrays)

    def _load_risk_grid(self, arrays) -> None:
        """The size grid the risk head's sizing was trained with (risk_grid/sizes), if the arrays have it."""
        if self.risk_loss is not None and "risk_grid/base_rate" in arrays:
            self.risk_loss.arena.load({"base_rate": np.asarray(arrays["risk_grid/base_rate"], np.float32)})
        if self.risk_sizer is not None and "risk_grid/sizes" in arrays:
            self.risk_sizer.load_sizes(arrays["risk_grid/sizes"])

    def _load_support(self, arrays) -> None:
        """The support a checkpoint was trained with (a fitted one), if it saved one."""
        if "support/range" in arrays:
            v_min, v_max = (float(x) for x in np.asarray(arrays["support/range"], np.float64))
            if (v_min, v_max) != self.support_range:
                self.set_support(v_min, v_max)
        if self.atoms is not None and "atoms/spacing_raw" in arrays:  # adaptive atoms: the exact live support
            self.atoms.load_arrays(arrays)
            self._write_live_support(arrays["atoms/support"])

    # what the greedy policy reads besides the weights: the support (fitted range, adaptive atoms'
    # live support), spectral norm's vectors, and the IQN readiness the entry gates' budget is
    policy_prefixes = ("params/", "support/", "atoms/", "spectral/", "iqn/", "isv/",  # isv: the routing reads it
                       "risk_grid/")  # the risk head's sizing reads the size grid

    def load_params(self, arrays: dict[str, np.ndarray]) -> None:
        """Load the policy from checkpoint arrays (the `policy_prefixes` entries): the online
        network's weights ("params/<name>"), the support it was trained with, spectral norm's
        vectors and the IQN readiness (the CVaR / epistemic gates' budget)."""
        self.store.load({k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("params/")})
        self._load_support(arrays)  # the Q of a fitted support needs that support
        if self.spectral is not None:  # spectral norm (agent.spectral_norm): vectors, then W_sn of the loaded W
            self.spectral.load_arrays(arrays)
        if self.iqn_head is not None and "iqn/readiness_state" in arrays:  # the gates' budget
            self.iqn_state.load({"readiness_state": np.asarray(arrays["iqn/readiness_state"], np.float64)})
        if self.isv is not None:  # ISV (agent.isv): the vector the ISV routing reads, as trained
            self._load_isv(arrays)
        self._load_risk_grid(arrays)  # the risk head's size grid (agent.risk_head_sizing)

    def read_stats(self, stream) -> dict[str, float]:
        """Host read of the mapped stats by name (waits on an event behind the writers; log
        intervals only)."""
        self.stats.record(stream)
        values = self.stats_layout.read(self.stats.read())
        values.pop("optim_step")  # the same number as train_step once training runs
        return values

    def nonfinite_tensors(self) -> list[str]:
        """Names of the device tensors holding NaN/inf (host check after a guard trip): every role
        of the parameter store (params, grads, target network, Adam moments) and the replay's
        observations and rewards."""
        bad = []
        for role, arena in self.store.arenas.items():
            for name, value in arena.to_host().items():
                if not np.all(np.isfinite(value)):
                    bad.append(f"{role}:{name}")
        for name in ("obs", "reward"):
            if not np.all(np.isfinite(self.replay.store[name].copy_to_host())):
                bad.append(f"replay:{name}")
        # the loss is NaN by design for an action outside its branch (c51_target_kernel)
        actions = self.replay.store["action"].copy_to_host()
        sizes = np.asarray(self.branch_sizes, np.int64)
        invalid = int(np.sum(np.any((actions < 0) | (actions >= sizes), axis=-1)))
        if invalid:
            bad.append(f"replay:action ({invalid} rows hold an action outside its branch)")
        return bad


@_cuda.jit(cache=True)
def stat_copy_kernel(src, stats, slot):
    """stats[slot] = src[0] (a loss scalar into the mapped stats)."""
    if _cuda.grid(1) == 0:
        stats[slot] = src[0]


@_cuda.jit(cache=True)
def _copy_kernel(src, dst):
    i = _cuda.grid(1)
    if i < dst.size:
        dst[i] = src[i]


def _blocks(n: int) -> int:
    return max(1, (n + 255) // 256)
