"""Every learning component numbarl has, with the switch, the reference, the tests and the proof
that it runs in training.

A component is only done when a real training run shows it working: each entry names a metrics
key (a statistic the train step writes on the device, logged to metrics.jsonl every log interval)
and the condition that key meets when the component is live. A component that is configured but
silently never runs in the training forward is the failure this makes visible:
tests/rl/test_components.py runs tiny simulator trainings with every switch on and checks every
key, and checks that it is not met where the switch is off.

    python -m numbarl components            # a table
    python -m numbarl components --json     # the same, machine-readable
"""

from __future__ import annotations

import json
import sys
import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Component:
    name: str
    summary: str
    switch: str
    """The --set that turns it on (always on: the agent kind that has it)."""
    reference: str
    """Paper and equation, or the formula."""
    tests: tuple
    """Test files that check it against its reference."""
    liveness: str
    """metrics.jsonl key (train records) that proves it ran in training."""
    live_when: str
    """The condition the key meets when the component is live: '> 0', '> 1', '< 1' or '!= 0'."""
    agent_kinds: tuple = ("c51",)

    def is_live(self, value) -> bool:
        if value is None or not math.isfinite(float(value)):
            return False
        op, bound = self.live_when.split()
        bound = float(bound)
        return {">": value > bound, "<": value < bound, "!=": value != bound}[op]


COMPONENTS: tuple[Component, ...] = (
    Component(
        "c51", "branched dueling C51 value head, cross-entropy to the projected target distribution",
        "agent.kind=c51",
        "Bellemare, Dabney & Munos 2017, Eq. 7 (dense projection); Wang et al. 2016, Eq. 9 (dueling); "
        "Tavakoli, Pardo & Kormushev 2018 (action branching)",
        ("tests/rl/test_c51_head.py", "tests/rl/test_c51_loss.py", "tests/rl/test_module_contract.py"),
        "loss", "> 0"),
    Component(
        "double_dqn", "next-state action from the online network, its distribution from the target network",
        "agent.kind=c51",
        "van Hasselt, Guez & Silver 2016, Eq. 4",
        ("tests/rl/test_c51_loss.py",),
        "q_next_max", "!= 0"),
    Component(
        "n_step", "n-step returns from the replay (the window stops at an episode end)",
        "agent.n_step=3",
        "Sutton 1988; Hessel et al. 2018 (Rainbow), Eq. 2",
        ("tests/rl/test_replay.py",),
        "nstep_len_mean", "> 1"),
    Component(
        "target_periodic", "target network copied every agent.target_period train steps",
        "agent.target_update=periodic",
        "Mnih et al. 2015 (Methods: target network)",
        ("tests/rl/test_optim.py",),
        "target_copies", "> 0"),
    Component(
        "target_polyak", "target network Polyak-averaged every train step",
        "agent.target_update=polyak",
        "Lillicrap et al. 2016, Algorithm 1 (soft target update)",
        ("tests/rl/test_optim.py",),
        "target_soft_updates", "> 0"),
    Component(
        "grad_clip", "global-norm gradient clipping (deterministic norm)",
        "agent.max_grad_norm=10",
        "Pascanu, Mikolov & Bengio 2013, Algorithm 2",
        ("tests/rl/test_optim.py",),
        "clipped_steps", "> 0"),
    Component(
        "weight_decay", "decoupled weight decay on the weights (not biases) of the named optimizer groups",
        "agent.weight_decay=1e-4",
        "Loshchilov & Hutter 2019 (AdamW), Algorithm 2",
        ("tests/rl/test_optim.py", "tests/rl/test_schedules.py"),
        "decay_rate", "> 0"),
    Component(
        "lock_aware_target", "double-DQN argmax at the next state over the actions the env's mask allows there "
        "(the direction lock: the behaviour policy never takes the locked direction)",
        "agent.lock_aware_target=true",
        "van Hasselt, Guez & Silver 2016, Eq. 4, with the max over the env's allowed actions A(s')",
        ("tests/rl/test_c51_loss.py", "tests/run/test_trainer.py"),
        "lock_masked_frac", "> 0"),
    Component(
        "cql", "conservative Q-learning regularizer: logsumexp over each branch's actions minus the taken "
        "action's Q, its gradient added into the C51 loss's",
        "agent.cql_alpha=0.5",
        "Kumar, Zhou, Tucker & Levine 2020, Eq. 4 (CQL(H))",
        ("tests/rl/test_cql.py",),
        "cql_loss", "> 0"),
    Component(
        "iqn", "implicit quantile head on the shared trunk: quantile Huber loss to the target network's quantiles "
        "at the C51 double-DQN action, an auxiliary loss whose trunk gradient adds to the C51 head's",
        "agent.iqn=true",
        "Dabney, Ostrovski, Silver & Munos 2018, Eq. 3-4 (quantile Huber loss, cosine embedding)",
        ("tests/rl/test_iqn.py",),
        "iqn_loss", "> 0"),
    Component(
        "iql", "IQL expectile value head V(s) on the shared trunk: expectile loss to the target network's Q at the "
        "taken actions (mean over branches), an auxiliary loss whose trunk gradient adds to the C51 head's; "
        "A = Q - V logged as a diagnostic (acting stays C51-greedy)",
        "agent.iql=true",
        "Kostrikov, Nair & Levine 2021, Eq. 5 (expectile regression L2^tau(u) = |tau - 1{u<0}| u^2)",
        ("tests/rl/test_iql.py",),
        "iql_loss", "> 0"),
    # --- recursive confidence (agent.confidence_weight) ---------------------------------------------------
    Component(
        "recursive_confidence", "confidence head c(s) = sigmoid(h.w + b) on the shared trunk: cross-entropy to "
        "y = 1{the n-step move had the sign of the online q_gap} where the window carries a verdict, else the target "
        "network's c(s') at the n-step next state; an auxiliary loss whose trunk gradient adds to the C51 head's",
        "agent.confidence_weight=0.5",
        "numbarl/rl/losses/confidence.py (origin notes' 'recursive_confidence'; interpretation: binary cross-entropy "
        "with a TD-style bootstrapped target, y = c_target(s') where the return gives no verdict)",
        ("tests/rl/test_confidence.py", "tests/rl/test_gpu_confidence.py"),
        "confidence_loss", "> 0"),
    # --- end recursive confidence -----------------------------------------------------------------------
    # --- risk-budget head (agent.risk_head_weight) -------------------------------------------------------
    Component(
        "risk_head", "risk-budget head rho(s) = sigmoid(h.w + b) on the shared trunk: cross-entropy to the outcome "
        "of the trade each replay row opened (1 if it closed with net P&L > 0; unlabelled rows left out), an "
        "auxiliary loss whose trunk gradient adds to the C51 head's; a flat env's new entry executes at the "
        "largest grid size <= size x rho(s), in the collect step and the backtest alike",
        "agent.risk_head_weight=0.5",
        "numbarl/rl/losses/risk_head.py, numbarl/rl/nets/risk_head.py (origin notes' 'risk_budget_forward: risk "
        "budget from h_s2'; interpretation: a logistic win-probability head that scales entry sizes)",
        ("tests/rl/test_risk_head.py", "tests/rl/test_gpu_risk_head.py"),
        "risk_head_labeled", "> 0"),
    # --- end risk-budget head ------------------------------------------------------------------------------
    Component(
        "icm_curiosity", "ICM curiosity: forward and inverse models on the detached trunk features of obs and "
        "next_obs, trained every train step; intrinsic reward w x forward error / its running scale added to the "
        "batch reward before the C51 projection (0 where the window ended the episode)",
        "agent.curiosity_weight=0.1",
        "Pathak, Agrawal, Efros & Darrell 2017, Eq. 2-7 (inverse loss, forward loss, r_i = eta/2 ||phi_hat - phi||^2)",
        ("tests/rl/test_icm.py", "tests/rl/test_gpu_icm.py"),
        "intrinsic_reward_mean", "> 0"),
    Component(
        "multi_horizon_c51", "multi-horizon C51: n-step windows of several horizons from the same replay draw, one "
        "C51 loss each (own gamma^m bootstrap from the target net at that horizon's next state), blended per sample "
        "by a trend-strength (ADX) regime weight, gradients accumulated into one d_logits",
        "agent.horizons=1,3,4",
        "Bellemare, Dabney & Munos 2017, Eq. 7 per horizon; Sutton & Barto 2018, Eq. 7.1 (n-step return); "
        "Wilder 1978 (ADX); L = (1/B) sum_b sum_i beta_i(s_b) CE_i[b]",
        ("tests/rl/test_mh.py", "tests/rl/test_gpu_mh.py"),
        "mh_ce_longest", "> 0"),
    Component(
        "lr_warmup", "linear learning-rate warm-up of every optimizer group from its start",
        "agent.lr_warmup_steps=500",
        "Goyal et al. 2017, §2.2 (gradual warm-up)",
        ("tests/rl/test_schedules.py",),
        "lr_warmup_scale", "< 1"),
    Component(
        "lr_cosine_restarts", "cosine learning-rate annealing with warm restarts, Adam momentum scaled at each restart",
        "agent.lr_cycle_steps=20000",
        "Loshchilov & Hutter 2017 (SGDR), Eq. 5",
        ("tests/rl/test_schedules.py",),
        "lr_restarts", "> 0"),
    Component(
        "feature_gate", "sigmoid gate on each observation feature, y = x ⊙ σ(x·W + b), own optimizer group",
        "agent.feature_gate=true",
        "Dauphin et al. 2017, Eq. 1 (gated linear unit); Hu, Shen & Sun 2018, Eq. 3 (feature recalibration)",
        ("tests/rl/test_feature_gate.py", "tests/rl/test_module_contract.py"),
        "grad_norm.trunk.gate", "> 0"),
    # --- temporal input (agent.temporal; numbarl/rl/temporal.py) -------------------------------------------
    Component(
        "temporal_mamba", "Mamba2 selective scan over the observations of the last K bars before the C51 trunk, "
        "h = x_t + y W_out (windows from the replay's env columns in training and acting, a per-policy ring in the "
        "backtests), online and target scan parameters, BPTT through all K steps, own optimizer group; "
        "agent.temporal_conv = d: Mamba2's causal depthwise convolution + SiLU on the scan's inputs first",
        "agent.temporal=mamba",
        "Dao & Gu 2024, §3 (SSD: scalar decay per head, one B/C group as Mamba2's default; the short convolution "
        "of mamba_ssm, d_conv 4); Kapturowski et al. 2019 (sequence replay windows of stored observations)",
        ("tests/rl/test_temporal.py", "tests/rl/test_mamba.py", "tests/rl/test_sequence.py"),
        "grad_norm.temporal.mamba", "> 0"),
    Component(
        "isv", "ISV: 12 training-health signals (fast/slow EMAs of loss, grad norm and Q-mean, Q slope, clip share, "
        "bootstrap gap, stabilities, non-finite share) updated from the device stats by one kernel at the end of "
        "every train step, non-finite inputs skipped, checkpointed",
        "agent.isv=true",
        "the origin's update_isv_signals (spec T5: its ISV stayed at zero because the update never ran); "
        "EMA recursions in numbarl/rl/isv.py:isv_update_ref",
        ("tests/rl/test_isv.py",),
        "isv_loss_fast", "> 0"),
    Component(
        "isv_routing", "ISV temporal routing: per-feature weights w = σ(isv·W_r + b_r) on the temporal scan's output, "
        "h = x_t + w ⊙ (y W_out) on every pass (init w = 0.5), own optimizer group",
        "agent.temporal=mamba,agent.isv_routing=true",
        "the origin's launch_isv_temporal_route (spec T6); Dauphin et al. 2017, Eq. 1 (sigmoid gating)",
        ("tests/rl/test_isv.py", "tests/rl/test_gpu_isv.py", "tests/rl/test_mamba.py"),
        "grad_norm.temporal.route", "> 0"),
    # --- end temporal input --------------------------------------------------------------------------------
    Component(
        "predictive_coding", "predictive coding: a linear predictor of the target network's trunk features of the "
        "n-step next state from the online trunk features, normalized L2, gradient into the trunk (aux steps)",
        "agent.predictive_weight=0.1",
        "Schwarzer et al. 2021 (SPR), Eq. 4's normalized L2, without the action-conditioned transition model; "
        "Grill et al. 2020 (BYOL)",
        ("tests/rl/test_predictive.py",),
        "predictive_loss", "> 0"),
    Component(
        "future_features", "future-feature regression: a linear head on the online trunk features regressing named "
        "terms of the n-step next observation (a column or the product of two), mean squared error, gradient into "
        "the trunk (aux steps)",
        "agent.future_weight=0.1,agent.future_targets=ret_1",
        "Jaderberg et al. 2017 (UNREAL), §3.2's reward prediction as an auxiliary task, with user-named targets",
        ("tests/rl/test_future.py", "tests/rl/test_gpu_future.py"),
        "future_loss", "> 0"),
    Component(
        "obs_noise", "Gaussian noise on the market features of every observation the learner reads in a train step "
        "(obs, next_obs, the horizons' next_obs, the temporal windows), counter RNG keyed by the train step; the replay, "
        "acting and the backtests see clean observations",
        "agent.obs_noise=0.1",
        "Bishop 1995 (training with noise is Tikhonov regularization); Laskin et al. 2020 (RAD), Kostrikov et al. 2021 "
        "(DrQ): augmenting the observations of sampled transitions",
        ("tests/rl/test_obs_noise.py",),
        "obs_noise_var", "> 0"),
    Component(
        "regime_dropout", "inverted dropout on the online pass's trunk output at a rate set by the sample's regime "
        "column (ADX), counter RNG keyed by the train step; not on target passes, acting or backtests",
        "agent.regime_dropout=true",
        "Srivastava et al. 2014 (inverted dropout); the origin's apply_regime_dropout",
        ("tests/rl/test_regime_dropout.py",),
        "regime_dropout_frac", "> 0"),
    Component(
        "feature_attention", "sigmoid-gated feature attention with a LayerNorm residual on the trunk's last hidden "
        "layer, h <- LN(h + h ⊙ σ(h·W + b)), own optimizer group",
        "agent.feature_attention=true",
        "Hu, Shen & Sun 2018, Eq. 3 (squeeze-and-excitation gating); Ba et al. 2016 (LayerNorm); the origin's attn_sdp",
        ("tests/rl/test_module_contract.py", "tests/rl/test_feature_gate.py"),
        "grad_norm.trunk.attn", "> 0"),
    Component(
        "input_bottleneck", "tanh input bottleneck: a block of observation columns compressed through tanh units, "
        "concatenated with the rest before the trunk, own optimizer group",
        "agent.input_bottleneck=0:24:8",
        "the origin's bn_tanh_concat (spec D7)",
        ("tests/rl/test_bottleneck.py", "tests/rl/test_module_contract.py"),
        "grad_norm.trunk.bn", "> 0"),
    Component(
        "regime_gate", "regime gate on the trunk's last hidden layer, h <- h ⊙ 2σ(r·W_g + b_g) with r the trunk input's "
        "regime columns (ADX, realised volatilities; with the temporal input, those columns of the scan's output), "
        "starting at exactly 1, own optimizer group",
        "agent.regime_gate=true",
        "Dauphin et al. 2017, Eq. 1 (sigmoid gating); spec T9 (the origin's regime gate tensor group)",
        ("tests/rl/test_regime_gate.py", "tests/rl/test_gpu_regime_gate.py", "tests/rl/test_module_contract.py"),
        "grad_norm.trunk.rgate", "> 0"),
    Component(
        "kan_gate", "KAN spline gate on each observation feature, y = x ⊙ σ(w_b·silu(x) + w_s·Σ c·B(x)), cubic "
        "B-splines per feature, own optimizer group",
        "agent.kan_gate=true",
        "Liu et al. 2024 (KAN), Eq. 2.10; pykan k = 3, grid = 5",
        ("tests/rl/test_kan_gate.py", "tests/rl/test_module_contract.py"),
        "grad_norm.trunk.kan", "> 0"),
    Component(
        "atom_entropy", "adaptive atom-entropy regulariser: −β·H of the taken action's return distribution, "
        "β = β_max·clip((0.5 − u_ema)/0.5, 0, 1) from the EMA of the share of atoms the batch-mean distribution uses",
        "agent.atom_entropy_max=0.01",
        "numbarl/rl/losses/c51.py (∂H/∂l_i = −p_i(log p_i + H)); Williams & Peng 1991 (entropy regularisation)",
        ("tests/rl/test_c51_loss.py", "tests/rl/test_c51_stats.py"),
        "atom_utilization_ema", "> 0"),
    Component(
        "support_fit", "C51 support fitted to the n-step returns of the replay prefill, once before the first "
        "train step (device arrays: no re-capture)",
        "agent.support=fit",
        "numbarl/rl/support.py (v = |R_n| tail quantile x the horizon factor of a discounted sum)",
        ("tests/rl/test_support.py",),
        "support_fits", "> 0"),
    Component(
        "reward_centering", "running average reward r̄ (rate β, from each train batch's first rewards) taken off every "
        "sampled reward, so the values lose their r̄/(1 − γ) offset: the learning side of Q-mean centering (its "
        "selection side would change no argmax and is not built)",
        "agent.reward_centering=0.01",
        "Naik, Wan, Tomar & Sutton 2024 (Reward Centering), simple centering; numbarl/rl/reward_center.py",
        ("tests/rl/test_reward_center.py",),
        "reward_center", "!= 0"),
    Component(
        "adaptive_atoms", "learned C51 atom positions: spacings softplus(s) between the fixed support ends, "
        "ascent on the entropy of the batch-mean projected target; non-uniform projection once they move",
        "agent.adaptive_atoms=true",
        "numbarl/rl/losses/atoms.py (analytic ∂J/∂s, checked by central differences); Bellemare, Dabney & Munos "
        "2017, Algorithm 1 (projection on any ascending support)",
        ("tests/rl/test_adaptive_atoms.py",),
        "atom_spacing_ratio", "> 1"),
    Component(
        "freeze_reset", "freeze detector (Q mean, Q std and atom utilization unchanged for k epochs while the "
        "gradient flows) resetting Adam's moments of the branch advantages",
        "agent.freeze_reset=true",
        "numbarl/rl/freeze.py (origin notes: 'Q-stats FROZEN for 4+ epochs', targeted moment reset)",
        ("tests/rl/test_freeze.py",),
        "freeze_resets", "> 0"),
    Component(
        "e1_q_reality", "validation feedback E1: the median gap between the greedy Q at validation entries and the "
        "reward those trades realized, integrated into a reward offset on the sampled returns",
        "train.e1_q_reality=0.5",
        "numbarl/rl/feedback/loop.py (origin notes' E1: 'bias correction, replaces drift penalty')",
        ("tests/rl/test_feedback.py",),
        "feedback.e1_offset", "!= 0"),
    Component(
        "e2_adaptive_epsilon", "validation feedback E2: exploration rate x0.8 / x1.25 from the feedback Sharpe",
        "train.e2_adaptive_epsilon=true",
        "numbarl/rl/feedback/loop.py (origin notes' E2: 'performance-driven, replaces schedule')",
        ("tests/rl/test_feedback.py",),
        "feedback.e2_updates", "> 0"),
    Component(
        "e3_dynamic_gamma", "validation feedback E3: discount from the feedback trades' mean holding time",
        "train.e3_dynamic_gamma=true",
        "numbarl/rl/feedback/loop.py (origin notes' E3: 'from trade duration, replaces manual annealing')",
        ("tests/rl/test_feedback.py",),
        "feedback.e3_gamma", "> 0"),
    Component(
        "e3_refit_support", "E3 with the C51 support refitted from the replay's returns at each gamma E3 sets (the "
        "support is otherwise fitted once, at the starting gamma)",
        "train.e3_dynamic_gamma=true,train.e3_refit_support=true",
        "numbarl/rl/support.py (the fit rule at the replay's current gamma), numbarl/run/trainer.py (FoldTrainer.validate)",
        ("tests/rl/test_feedback.py",),
        "support_fits", "> 1"),
    Component(
        "e4_trade_autopsy", "validation feedback E4: losing trades blamed per branch; each branch's advantage "
        "columns get their own learning rate from its share of the blame",
        "train.e4_trade_autopsy=true",
        "numbarl/rl/feedback/loop.py (origin notes' E4: 'per-branch LR scaling from error rates')",
        ("tests/rl/test_feedback.py",),
        "feedback.e4_updates", "> 0"),
    Component(
        "e6_winner_distillation", "validation feedback E6: the replay rows of the top decile of training trades "
        "weigh 1 + kappa in the loss (normalized batch weights)",
        "train.e6_winner_boost=1",
        "Oh, Guo, Singh & Lee 2018 (self-imitation learning); origin notes' E6: 'boost top 10% trades in replay'",
        ("tests/rl/test_replay_weights.py",),
        "feedback.e6_trades_logged", "> 0"),
    Component(
        "e7_hindsight_labels", "validation feedback E7: entries of losing training trades labelled flat in hindsight; "
        "a large-margin loss on the direction branch towards the label, halved each epoch",
        "train.e7_margin_weight=0.1",
        "Hester et al. 2018 (DQfD), Eq. 2 (large-margin supervised loss); origin notes' E7: 'correct actions for losers'",
        ("tests/rl/test_hindsight.py",),
        "feedback.e7_labelled", "> 0"),
    Component(
        "e8_curriculum", "validation feedback E8: loss weights per regime bucket from the feedback trades' loss rate",
        "train.e8_curriculum_kappa=1",
        "origin notes' E8: 'oversample failure regimes' (importance weights per bucket, numbarl/rl/feedback/curriculum.py)",
        ("tests/rl/test_curriculum.py",),
        "feedback.e8_trades", "> 0"),
    Component(
        "e9_tradability_gate", "validation feedback E9: no entries in regime buckets whose shrunk mean feedback trade "
        "P&L is negative (training mask and backtest scores)",
        "train.e9_tradability_gate=true",
        "numbarl/rl/feedback/loop.py (origin notes' E9: 'tradability scores from eval')",
        ("tests/rl/test_feedback.py",),
        "feedback.e9_evidence", "> 0"),
    # --- spectral normalization and the CVaR entry gate ------------------------------------------------
    Component(
        "spectral_norm", "spectral normalization of the named layers' weights, W_sn = W / sigma, sigma by one power "
        "iteration per train step (u, v persistent, checkpointed); the target network its own sigma from the online "
        "vectors",
        "agent.spectral_norm=trunk.fc0,head.value",
        "Miyato, Kataoka, Koyama & Yoshida 2018, Algorithm 1 and Eq. 12 (lambda = <dW_sn, W_sn>)",
        ("tests/rl/test_spectral_norm.py",),
        "spectral_sigma.trunk.fc0", "> 0"),
    Component(
        "cvar_gate", "no greedy entry (long / short while flat) whose direction-branch CVaR_alpha is below "
        "-agent.cvar_floor, scaled by the IQN readiness budget (the greedy choice's collect mask, exploration "
        "ungated, and backtest scores); the switch sets the floor the A/Bs ran (0.005 reward units: the default "
        "1.0 is below any CVaR of the planted market's fitted support, +-0.54)",
        "agent.cvar_alpha=0.1,agent.cvar_floor=0.005",
        "Rockafellar & Uryasev 2000; Acerbi & Tasche 2002 (CVaR of a discrete distribution, fractional boundary atom)",
        ("tests/rl/test_cvar_gate.py",),
        "cvar_blocked_frac", "> 0"),
    # --- end spectral normalization and the CVaR entry gate --------------------------------------------
    # --- ensemble and the epistemic gate (agent.ensemble_heads, agent.epistemic_theta) -------------------
    Component(
        "ensemble", "bootstrapped ensemble of C51 heads on the shared trunk: M - 1 extra double-DQN C51 heads, each "
        "loss weighted per (transition, head) by a Bernoulli(1/2) mask of the replay row, an auxiliary loss whose "
        "trunk gradient adds to the C51 head's; epistemic score u = std over the M heads of the direction Q; with "
        "agent.epistemic_theta no greedy entry where budget x u > theta (the greedy choice's collect mask, "
        "exploration ungated, and backtest scores)",
        "agent.ensemble_heads=5",
        "Osband, Blundell, Pritzel & Van Roy 2016, Algorithm 1 (bootstrap masks, shared torso, K heads)",
        ("tests/rl/test_ensemble.py", "tests/rl/test_gpu_ensemble.py"),
        "ensemble_std", "> 0"),
    # --- end ensemble and the epistemic gate ----------------------------------------------------------------
    # --- the exploration risk budget (R18; agent.iqn; numbarl/env/core.py, numbarl/rl/cvar_gate.py) ----------
    Component(
        "risk_budget", "exploration risk budget rho = IQN readiness^2, written on the device every collect step and "
        "read by the env step: the Kelly cap fraction becomes 1 - rho (1 - frac) and the DSR reward term rho x term "
        "(rho = 1: the step without it, bit for bit); the CVaR and epistemic gates scale by the same rho",
        "agent.iqn=true,agent.risk_budget=true",
        "readiness = clip(1 - L_ema / L_first, 0, 1) of the quantile Huber loss; frac_rho = frac + (1 - rho)(1 - frac)",
        ("tests/env/test_risk_budget.py", "tests/rl/test_cvar_gate.py"),
        "risk_budget", "< 1"),
    # --- end the exploration risk budget ---------------------------------------------------------------------
    # --- the env's fractional-Kelly size cap (env.kelly_lambda; numbarl/env/core.py:kelly_size) ---------------
    Component(
        "kelly_sizing", "fractional-Kelly size cap at order time in the shared step (training env, backtest, CPU "
        "reference): an opening order's size becomes min(size, max_size x clip(lambda f*, floor, 1)) rounded down to "
        "whole lots, never below the smallest size; f* = p - (1 - p)/b from the env's own closed trades",
        "env.kelly_lambda=0.5",
        "Kelly 1956 (f* = p - q/b for b-to-1 odds); Thorp 2006 (fractional Kelly: betting lambda f*)",
        ("tests/env/test_core.py", "tests/env/test_telemetry.py"),
        "train_path.kelly_capped_frac", "> 0", agent_kinds=("c51", "ppo", "dt")),
    # --- end the env's fractional-Kelly size cap --------------------------------------------------------
    # --- the env's differential Sharpe reward term (env.dsr_reward_scale; numbarl/env/core.py) --------------
    Component(
        "dsr_reward", "trade-level differential Sharpe ratio as a reward term: D of each closed trade from its env's EMAs "
        "of trade P&L in ticks (0 until they hold env.dsr_warmup_trades trades), times the risk budget ρ",
        "env.dsr_reward_scale=0.1",
        "Moody & Saffell 2001, Eq. 15 (numbarl/env/core.py: dsr_update, dsr_term, _book)",
        ("tests/env/test_core.py", "tests/env/test_risk_budget.py"),
        "reward.dsr.std", "> 0", agent_kinds=("c51", "ppo", "dt")),
    # --- the env's mark-to-market reward term (env.pnl_reward_scale; numbarl/env/core.py:pnl_reward) ----------
    Component(
        "pnl_reward", "mark-to-market net P&L reward term in the shared step: scale x the step's change of realized + "
        "unrealized P&L (fees and the spread paid at fills included) per tick-contract; over a trade it sums to the "
        "trade's net P&L, so it prices costs as net P&L does (the trade + micro pair pays the mid's move twice, "
        "once without costs: bin/reward-align); the default preset's only P&L term (trade and micro at 0, gamma 0.95)",
        "env.pnl_reward_scale=0.01",
        "r = s * (equity_n - equity_c) / tick_value; sum over a trade = s * net P&L / tick_value",
        ("tests/env/test_core.py", "tests/env/test_telemetry.py", "tests/rl/test_feedback.py"),
        "reward.pnl.std", "> 0", agent_kinds=("c51", "ppo", "dt")),
    # --- end the env's mark-to-market reward term -----------------------------------------------------------
    # --- PPO (agent.kind = "ppo"; numbarl/rl/agents/ppo.py) ------------------------------------------------
    Component(
        "ppo", "PPO: clipped surrogate + value loss + entropy bonus on a branched masked-categorical policy and a "
        "value head on the shared trunk, K epochs x M minibatches per rollout (deterministic Feistel permutation)",
        "agent.kind=ppo",
        "Schulman, Wolski, Dhariwal, Radford & Klimov 2017, Eq. 7 (L^CLIP) and Eq. 9 (L^CLIP+VF+S)",
        ("tests/rl/test_ppo.py", "tests/rl/test_gpu_ppo.py"),
        "approx_kl", "> 0", agent_kinds=("ppo",)),
    Component(
        "gae", "generalized advantage estimation on the device rollout (reverse scan per env, bootstrap value of "
        "the state after the rollout), advantages normalized over the rollout",
        "agent.kind=ppo",
        "Schulman, Moritz, Levine, Jordan & Abbeel 2016, Eq. 16 (GAE(gamma, lambda))",
        ("tests/rl/test_ppo.py",),
        "adv_std", "> 0", agent_kinds=("ppo",)),
    # --- end PPO ---------------------------------------------------------------------------------------------
    # --- Decision Transformer (agent.kind = "dt"; numbarl/rl/agents/dt.py) -----------------------------------
    Component(
        "decision_transformer", "Decision Transformer: causal multi-head attention over (return-to-go, state, "
        "action) tokens of L steps, branch cross-entropy at the state tokens, trained on the device envs' "
        "behavior trajectories (oracle + noise), acting with a target return",
        "agent.kind=dt",
        "Chen, Lu, Rajeswaran, Lee, Grover, Laskin, Abbeel, Srinivas & Mordatch 2021, §3; Vaswani et al. 2017, "
        "Eq. 1 (attention)",
        ("tests/rl/test_dt.py", "tests/rl/test_gpu_dt.py", "tests/rl/test_module_contract.py"),
        "dt_action_acc", "> 0", agent_kinds=("dt",)),
    # --- end Decision Transformer -----------------------------------------------------------------------------
)


def by_name() -> dict[str, Component]:
    return {c.name: c for c in COMPONENTS}


def as_dicts() -> list[dict]:
    return [{**asdict(c), "tests": list(c.tests), "agent_kinds": list(c.agent_kinds)} for c in COMPONENTS]


def table() -> str:
    rows = [("component", "switch (--set)", "liveness key", "live when", "reference")]
    rows += [(c.name, c.switch, c.liveness, c.live_when, c.reference) for c in COMPONENTS]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for r in rows:
        lines.append("  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4])
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 9)
    return "\n".join(lines)


def main(argv) -> int:
    if "--version" in argv:
        from numbarl import __version__

        print(f"numbarl components {__version__}")
        return 0
    if any(a in ("-h", "--help") for a in argv):
        print("usage: python -m numbarl components [--json]\n\n"
              "Lists every learning component: its --set switch, reference, tests and the metrics.jsonl key\n"
              "that proves it ran in training (and the condition that key meets when it is live).")
        return 0
    unknown = [a for a in argv if a != "--json"]
    if unknown:
        print(f"error: unknown argument {unknown[0]!r} (usage: python -m numbarl components [--json])", file=sys.stderr)
        return 2
    if "--json" in argv:
        print(json.dumps(as_dicts(), indent=2))
    else:
        print(table())
    return 0
