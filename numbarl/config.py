"""numbarl configuration: frozen dataclasses, named presets, file + ``--set`` overrides.

Four sections (SPEC §2): :class:`DataConfig`, the environment's :class:`numbarl.env.params.EnvParams`,
:class:`AgentConfig` and :class:`TrainConfig`, gathered in :class:`Config`. Every field has a
one-line docstring under it and, where it has limits, a validator (``_check``) that names the
field, the value and the allowed range. Everything is validated before any device allocation.
Derived sizes are computed in one place (:meth:`Config.derived`).

Presets are named instances: ``tiny`` (simulator-sized: seconds per epoch on a CPU), ``small``,
``default`` (the benchmark model of issue 4: 64 features, trunk 2×512, 4 branches, 51 atoms,
batch 16,384; Polyak-averaged target network) and ``large``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from numbarl.data.splits import DEFAULT_SPLIT
from numbarl.env.params import EnvParams


class ConfigError(ValueError):
    """An invalid configuration value: names the field, the value and what is allowed."""


def _check(section: str, name: str, value, lo=None, hi=None, choices=None, lo_open=False):
    where = f"{section}.{name}"
    if choices is not None:
        if value not in choices:
            raise ConfigError(f"{where} = {value!r} is not allowed; choose one of {list(choices)}")
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where} = {value!r} must be a finite number")
    if lo is not None and (value <= lo if lo_open else value < lo):
        rng = f"{'>' if lo_open else '>='} {lo}" + (f" and <= {hi}" if hi is not None else "")
        raise ConfigError(f"{where} = {value!r} is out of range: must be {rng}")
    if hi is not None and value > hi:
        raise ConfigError(f"{where} = {value!r} is out of range: must be <= {hi}" + (f" and >= {lo}" if lo is not None else ""))


@dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"
    """'synthetic' (the built-in market), an fxcache folder, or DBN/CSV files (comma separated)."""
    cache_dir: str = ""
    """Where feature caches are built and reused ('' = $NUMBARL_CACHE if set, else ~/.cache/numbarl)."""
    synth_sessions: int = 20
    """Sessions in the synthetic market."""
    synth_signal: float = 0.2
    """Strength of the planted order-flow signal in the synthetic market (0 = none)."""
    synth_null: bool = False
    """Synthetic market with no signal at all (the null hypothesis check)."""
    synth_seed: int = 7
    """Seed of the synthetic market (independent of the training seed)."""
    synth_scale: str = "default"
    """Size of the synthetic market's sessions: 'tiny' (tests, simulator) or 'default'."""
    synth_bars_per_day: int = 0
    """Imbalance bars per synthetic session (0 = the scale's default)."""
    synth_mode: str = "planted"
    """Synthetic market: 'planted' (order flow leads the mid), 'memory' (its sign is a hidden regime: only history
    pays), 'walk' (a null whose mid is a random walk nothing observable leads: the queues do not move the price) or
    'memory_walk' (the memory market's regime drift moving the walk's coin: no book structure leads the mid either) or
    'regime_walk' (the walk's coin follows the last imbalance bar's side with a hidden regime's sign: a memory of the
    last bars finds the regime)."""
    synth_regime_bars: float = 0.0
    """Memory modes (memory, memory_walk, regime_walk): mean duration of the hidden regime, in bars; 0 = the
    mode's own (40 for memory and memory_walk, 200 for regime_walk: numbarl/data/synth.py mode_regime_bars)."""
    symbol: str = ""
    """Instrument to keep when a DBN file holds several ('' = the only one)."""
    features: str = ""
    """Comma-separated feature list ('' = the default list)."""

    def validate(self):
        _check("data", "synth_sessions", self.synth_sessions, lo=3, hi=10_000)
        _check("data", "synth_signal", self.synth_signal, lo=0.0, hi=100.0)
        _check("data", "synth_scale", self.synth_scale, choices=("tiny", "default"))
        _check("data", "synth_bars_per_day", self.synth_bars_per_day, lo=0, hi=1_000_000)
        _check("data", "synth_mode", self.synth_mode, choices=("planted", "memory", "walk", "memory_walk", "regime_walk"))
        if self.synth_regime_bars != 0:  # 0: the mode's own
            _check("data", "synth_regime_bars", self.synth_regime_bars, lo=1.0, hi=1_000_000.0)


# agent families numbarl trains (the registry numbarl.rl.agents.base.AGENTS; a test keeps them equal)
AGENT_KINDS = ("c51", "ppo", "dt")


def parse_horizons(text: str) -> tuple[int, ...]:
    """agent.horizons: '1,5,20' -> (1, 5, 20) (sorted, unique); '' -> () (off)."""
    items = [w.strip() for w in str(text).split(",") if w.strip()]
    try:
        values = [int(w) for w in items]
    except ValueError:
        raise ValueError(f"agent.horizons = {text!r}: a comma list of integers (bars), e.g. '1,5,20'") from None
    return tuple(sorted(set(values)))


HEAD_PAD_TF32 = 64  # agent.head_pad=0 under TF32: 714 -> 768 columns (docs/BENCHMARKS.md, twentieth session)


def head_pad_multiple(head_pad: int, compute: str, kind: str, fp32_auto: int) -> int:
    """agent.head_pad resolved: the automatic 0 is HEAD_PAD_TF32 for a C51 agent under TF32 and `fp32_auto`
    (agent.head_pad_fp32: 64 since the twenty-fifth session, 1 for a run saved before it) under fp32; 1 for PPO and
    the DT, which have no C51 head."""
    if head_pad:
        return head_pad
    if kind != "c51":
        return 1
    return HEAD_PAD_TF32 if compute == "tf32" else fp32_auto


def value_fused(head_fuse_value, pad_multiple: int) -> bool:
    """agent.head_fuse_value resolved: the value stream fuses into the advantage's GEMM on a padded head only."""
    return bool(head_fuse_value) and pad_multiple > 1
# ICM curiosity (agent.curiosity_weight) is off below this weight: nothing of it is built
CURIOSITY_MIN_WEIGHT = 1e-3


@dataclass(frozen=True)
class AgentConfig:
    kind: str = "c51"
    """Agent family, a key of numbarl.rl.agents.base.AGENTS ('c51': branched dueling C51 + double
    DQN; 'ppo': branched categorical actor-critic trained by PPO, numbarl/rl/agents/ppo.py; 'dt': Decision
    Transformer trained on the envs' behavior trajectories, numbarl/rl/agents/dt.py);
    `python -m numbarl components` lists the learning components of each."""
    trunk: tuple = (512, 512)
    """Hidden widths of the trunk MLP."""
    activation: str = "relu"
    """Trunk activation: 'relu' or 'silu'."""
    n_atoms: int = 51
    """Atoms of the C51 return distribution."""
    v_min: float = -10.0
    """Lowest atom of the support (reward units)."""
    v_max: float = 10.0
    """Highest atom of the support (reward units)."""
    gamma: float = 0.99
    """Discount per bar."""
    n_step: int = 3
    """n of the n-step return."""
    batch_size: int = 16384
    """Transitions per train step."""
    replay_capacity: int = 1 << 20
    """Transitions held by the device replay buffer (rounded to a multiple of n_envs)."""
    lr: float = 2.5e-4
    """Adam learning rate."""
    adam_beta1: float = 0.9
    """Adam β1."""
    adam_beta2: float = 0.999
    """Adam β2."""
    adam_eps: float = 1e-8
    """Adam ε (CleanRL's C51 uses 0.01/batch; 1e-8 is PyTorch's default)."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay on trunk and head weights (not biases)."""
    max_grad_norm: float = 10.0
    """Global gradient-norm clip (0 = off)."""
    target_update: str = "periodic"
    """'periodic' (copy every target_period steps) or 'polyak' (τ-average every step)."""
    target_period: int = 1000
    """Train steps between target-network copies (periodic)."""
    tau: float = 0.005
    """Polyak averaging factor (polyak)."""
    lock_aware_target: bool = False
    """Double-DQN target over the actions available at the next state: with the env's direction
    lock on, the argmax skips the direction the lock forbids there (the behaviour policy never takes
    it, so its Q is never trained, yet the plain max can bootstrap from it). Off by default until
    measured on the GPU against the recorded results (docs/RESULTS.md)."""
    compute: str = "fp32"
    """GEMM precision: 'fp32' or 'tf32'."""
    head_pad: int = 0
    """Run the advantage head's GEMMs at its width ΣA·Z rounded up to a multiple of this (1 = as it is; 714 → 768
    at 64). 0 = automatic: 64 under TF32, where cuBLASLt picks one-float-aligned kernels for the width 714 and the
    padded train step is ~0.25 ms faster on the H200, and agent.head_pad_fp32 (64) in fp32. The parameters keep
    their shape: each pass copies them into a zero-padded scratch, so the values are the same math, rounded by
    other GEMM kernels (numbarl/rl/nets/c51_head.py)."""
    head_pad_fp32: int = 64
    """What the automatic agent.head_pad (0) means in fp32. In fp32, padding alone costs ~0.03 ms, but 64 with the
    value stream fused into the pad columns (agent.head_fuse_value) makes the train step 3.20 -> 3.06 ms and the
    collect step 0.617 -> 0.602 ms on the H200 (docs/BENCHMARKS.md, twenty-fourth session; 0.83 of the oracle on the
    planted market against the unpadded head's 0.85, inside the spread). 64 since the twenty-fifth session, with the
    default preset's deployment rule; a run saved before it (without the field) read fp32's 0 as 1, unpadded
    (config.LEGACY)."""
    head_fuse_value: bool = True
    """With a padded head (agent.head_pad resolving above 1, TF32's automatic padding included): the value stream
    joins the advantage's GEMM as its columns ΣA·Z .. ΣA·Z + Z, one GEMM per pass for both (714 + 51 -> 768
    columns at 64), instead of a separate 51-wide one: the TF32 train step 1.34 -> 1.22 ms on the H200
    (docs/BENCHMARKS.md, twenty-first session). The same math, rounded by other kernels. An unpadded head (fp32's
    automatic padding, agent.head_pad = 1) has no padding columns to hold the value stream and keeps its own
    GEMM: there the default does nothing (AgentConfig.fuse_value is what runs), and `--set agent.head_fuse_value=true`
    is an error. Before the twenty-first session the default was false (config.LEGACY)."""
    overlap: bool = True
    """Run the train step's independent work on forked CUDA streams (one graph still): the next-obs and target
    passes beside the online pass, and each layer's weight gradient beside the input-gradient chain of the
    backward. Each kernel computes what it computes on one stream, so the bits are the same either way
    (tests/rl/test_gpu_overlap.py); it applies to the plain network (MLP trunk + C51 head; a component that adds a
    pass, a head or a second backward keeps the one-stream step: DQNAgent._plain_network)."""
    lr_warmup_steps: int = 0
    """Linear learning-rate warm-up of every optimizer group over this many train steps from the
    group's start (numbarl/rl/schedules.py; 0 = off)."""
    lr_cycle_steps: int = 0
    """Cosine annealing with warm restarts: the period in train steps (0 = constant learning rate;
    20 epochs of the default preset = 20,000)."""
    lr_min_frac: float = 0.0
    """Lowest learning rate of a cosine cycle, as a fraction of agent.lr."""
    restart_momentum_scale: float = 0.5
    """Factor on Adam's first moments at each warm restart (0.5: momentum halved)."""
    weight_decay_groups: str = ""
    """Comma-separated optimizer groups that agent.weight_decay applies to (e.g. 'trunk,head.value');
    empty: every group (always only the tensors marked for decay: weights, not biases)."""
    cql_alpha: float = 0.0
    """Weight α of the conservative Q-learning regularizer on the online Q-values (numbarl/rl/losses/cql.py,
    Kumar et al. 2020); 0 = off."""
    aux_frequency: int = 4
    """Train steps per step that also runs the auxiliary losses (today: CQL); the others train the
    C51 loss alone (origin default 4; 1 = every step)."""
    iqn: bool = False
    """Implicit quantile head on the shared trunk (numbarl/rl/nets/iqn_head.py, Dabney et al. 2018),
    trained by the quantile Huber loss (numbarl/rl/losses/quantile_huber.py, κ = 1) against the target
    network's quantiles at the C51 double-DQN action, as an auxiliary loss (every agent.aux_frequency
    train steps); its own optimizer group 'head.iqn'; its gradient reaches the trunk. Its readiness²
    is the exploration risk budget ρ of the entry gates (and, with agent.risk_budget, of the env's Kelly cap
    and DSR term: numbarl/env/core.py); without it ρ = 1."""
    risk_budget: bool = False
    """The exploration risk budget on the env (R18; needs agent.iqn): the collect step hands the env step
    rho = IQN readiness^2, which loosens the Kelly size cap to 1 - rho (1 - cap) and scales the DSR reward term by
    rho (numbarl/env/core.py): loose while the IQN loss is unsettled, the configured protection once it is.
    Off: the env's rho is 1 (the CVaR and epistemic gates scale by readiness^2 with agent.iqn either way)."""
    iqn_quantiles: int = 32
    """IQN: quantile fractions per sample, N = N' (online and target)."""
    iqn_embed: int = 64
    """IQN: cosine features n of the fraction embedding cos(pi j tau), j < n."""
    iql: bool = False
    """IQL expectile value head on the shared trunk (numbarl/rl/nets/iql_value.py, Kostrikov et al. 2021):
    V(s), a one-hidden-layer SiLU MLP on the online trunk features, trained by the expectile loss
    (numbarl/rl/losses/expectile.py) against the target network's Q at the taken actions (mean over
    branches; one extra target-network pass on obs per aux step), as an auxiliary loss (every
    agent.aux_frequency train steps); its own optimizer group 'head.iql'; its gradient reaches the
    trunk. A = Q - V is a diagnostic only (iql_adv_mean): acting stays C51-greedy."""
    iql_expectile: float = 0.7
    """IQL: the expectile tau of the value loss |tau - 1{u<0}| u^2 (0.5 = mean regression)."""
    iql_hidden: int = 256
    """IQL: hidden width of the value head's SiLU layer."""
    # --- recursive confidence (numbarl/rl/nets/confidence.py, numbarl/rl/losses/confidence.py) ---------
    confidence_weight: float = 0.0
    """Recursive confidence (issue 14 item 8): weight of the binary cross-entropy of a confidence head
    c(s) = sigmoid(h.w + b) on the online trunk features against y = 1{the n-step move had the sign of the
    online q_gap} where the window carries a verdict (a long/short taken, |R_n| >= agent.confidence_epsilon),
    else the target network's c(s') at the n-step next state (1/2 at an episode end); an auxiliary loss
    (every agent.aux_frequency train steps), optimizer group 'head.conf', its gradient adds to the trunk's.
    0 = off (the default: nothing of it is built)."""
    confidence_epsilon: float = 1e-6
    """Recursive confidence: |R_n| below this carries no verdict on the conviction (bootstrapped target)."""
    confidence_floor: float = 0.0
    """Recursive confidence's selectivity gate (numbarl/rl/nets/confidence.py:ConfidenceGate): a flat env's greedy
    choice may not enter (direction long / short) where c(s) < this, in the collect step (exploratory draws are
    not gated) and the backtest scores; holding and
    exits stay allowed; off over the trainer's replay prefill (DQNAgent.arm_entry_gates). 0 = no gate (needs
    agent.confidence_weight > 0; in [0, 1))."""
    risk_head_weight: float = 0.0
    """Risk-budget head (issue 15, T7; numbarl/rl/nets/risk_head.py, numbarl/rl/losses/risk_head.py): weight of the
    binary cross-entropy of rho(s) = sigmoid(h.w + b) on the online trunk features against the outcome of the trade
    the replay row opened (1 if it closed with net P&L > 0, else 0; rows without a known outcome are left out); an
    auxiliary loss (every agent.aux_frequency train steps), optimizer group 'head.risk', its gradient adds to the
    trunk's. 0 = off (the default: nothing of it is built)."""
    risk_head_sizing: bool = True
    """Risk-budget head, with agent.risk_head_weight > 0: a flat env's new entry executes at the largest grid size
    <= the chosen size x rho(s) (never below the smallest size), in the collect step (the replay stores the executed
    action) and the backtests' greedy choice alike. False: the head is trained only (a diagnostic)."""
    predictive_weight: float = 0.0
    """Predictive coding (issue 15, T3; numbarl/rl/losses/predictive.py, SPR: Schwarzer et al. 2021): weight λ of
    the normalized L2 between a linear predictor (optimizer group 'head.pc') of the online trunk features of obs
    and the target network's trunk features of the n-step next_obs (masked at episode ends); an auxiliary loss
    (every agent.aux_frequency train steps) whose gradient reaches the trunk. 0 = off (nothing of it is built)."""
    future_weight: float = 0.0
    """Future-feature regression (issue 15; numbarl/rl/losses/future.py): weight λ of the mean squared error of a
    linear head (optimizer group 'head.ff') on the online trunk features of obs against agent.future_targets,
    terms of the n-step next_obs (masked at episode ends); an auxiliary loss (every agent.aux_frequency train
    steps) whose gradient reaches the trunk. 0 = off (nothing of it is built)."""
    future_targets: str = ""
    """The terms agent.future_weight regresses: a comma list, each an obs column (feature name or index) or the
    product of two, e.g. 'trade_imb_prev*ret_1' (on the regime-walk market its expectation is the hidden regime's
    sign times a constant). The terms are read from the batch's next_obs as the learner sees it: with
    agent.obs_noise on, a noised market column (a square term then gains σ² on average)."""
    reward_centering: float = 0.0
    """Reward centering (numbarl/rl/reward_center.py; Naik et al. 2024): the rate β of a running average r̄ of the
    rewards, updated every train step from the sampled batch's first rewards, and subtracted from every sampled
    reward, so the values lose their r̄/(1 − γ) offset (the learning side of the origin's Q-mean centering). 0 = off."""
    obs_noise: float = 0.0
    """Observation noise (numbarl/rl/obs_noise.py): std σ of Gaussian noise added, in every train step, to the market
    features (most are z-scored, so σ is in feature standard deviations) of each observation the learner reads: obs,
    next_obs, the extra horizons' next_obs and the temporal windows; the portfolio features, acting, the backtests
    and the replay stay exact. A regularizer against memorizing the training sessions. 0 = off."""
    regime_dropout: bool = False
    """Regime dropout (issue 15, T4; numbarl/rl/nets/regime_dropout.py): inverted dropout on the trunk output of the
    online training pass at rate p_lo + (p_hi - p_lo) * clip(obs[agent.regime_dropout_col], 0, 1), drawn from the
    counter RNG keyed by the train step; next/target passes, acting and backtests are not dropped."""
    regime_dropout_lo: float = 0.05
    """Regime dropout: the rate at regime signal 0 (the spec's proposal; the origin notes give none)."""
    regime_dropout_hi: float = 0.3
    """Regime dropout: the rate at regime signal 1."""
    regime_dropout_col: str = "adx_14"
    """Regime dropout: the regime signal's obs column, a feature name (adx_14 = ADX(14)/100) or an obs column
    index (a config saved with an int loads as that index); names resolve against the run's data.features."""
    # --- end recursive confidence -------------------------------------------------------------------
    feature_gate: bool = False
    """Sigmoid feature gate on the observation, y = x ⊙ σ(x·W + b) (numbarl/rl/nets/feature_gate.py),
    its own optimizer group 'trunk.gate'. Off until its A/B says otherwise (docs/RESULTS.md)."""
    input_bottleneck: str = ""
    """Tanh input bottleneck (issue 15, D7; numbarl/rl/nets/bottleneck.py): 'lo:hi:width' compresses obs columns
    lo..hi-1 (e.g. a block of order-flow and book-shape features) through width tanh units, trunk input =
    [the other columns, tanh(x[:, lo:hi] W + b)]; its own optimizer group 'trunk.bn'. Empty: off."""
    regime_gate: bool = False
    """Regime gate on the trunk's last hidden layer (issue 15, T9; numbarl/rl/nets/regime_gate.py):
    h <- h ⊙ 2σ(r W_g + b_g), r = the columns agent.regime_gate_cols of the trunk's input (the observation; with
    agent.temporal those columns of the scan's output h̃, and the gate's gradient then reaches the scan through r),
    W_g = b_g = 0 at init (the gate starts at exactly 1); every head reads its output; its own optimizer group
    'trunk.rgate' (the global agent.lr_warmup_steps, no warm-up of its own: at exactly 1 it starts without a shock)."""
    regime_gate_cols: str = "adx_14,rv_8,rv_32,rv_128,rv_ratio"
    """Regime gate: comma list of the obs columns of r, feature names or obs column indices (a saved "53,9,10,11,12"
    is those of the default 64-feature set); resolved against the run's data.features when the agent is built."""
    feature_attention: bool = False
    """Sigmoid-gated feature attention with a LayerNorm residual at the end of the trunk, h <- LN(h + h ⊙ σ(h·W + b))
    (issue 15, T1; numbarl/rl/nets/mlp.py), its own optimizer group 'trunk.attn'; every head reads its output."""
    kan_gate: bool = False
    """KAN spline gate on the observation, y_j = x_j · σ(w_b·silu(x_j) + w_s·Σ_m c_jm B_m(x_j)), cubic B-splines on
    5 intervals over [-5, 5] per feature (numbarl/rl/nets/kan_gate.py, Liu et al. 2024), its own optimizer group
    'trunk.kan'; before the sigmoid gate when both are on. Off until its A/B says otherwise."""
    support: str = "fixed"
    """C51 support: 'fixed' (agent.v_min .. agent.v_max) or 'fit': once, after the replay prefill, the
    support is set to ±v fitted to the replay's n-step returns (numbarl/rl/support.py:
    v = max(|q_0.001|, |q_0.999|) of R_n times the horizon factor)."""
    support_horizon_factor: float = 0.0
    """'fit' only: v = that quantile x this factor; 0 = auto, max(A / sqrt(1 - gamma^(2n)), |mean R_n| /
    (1 - gamma^n)) (the value is a discounted sum of many n-step windows; numbarl/rl/support.py)."""
    atom_entropy_max: float = 0.0
    """beta_max of the adaptive atom-entropy regulariser: beta = beta_max * clip((0.5 - u_ema) / 0.5, 0, 1)
    with u_ema the EMA of the share of atoms the taken actions' batch-mean distribution uses
    (numbarl/rl/agents/dqn.py); 0 = off (the spec suggests 1e-2)."""
    adaptive_atoms: bool = False
    """Adaptive atom positions (C4): the support's spacings z_{i+1} - z_i ∝ softplus(s_i) between the fixed
    ends v_min, v_max are learned by gradient ascent on the entropy of the batch-mean projected target
    (numbarl/rl/losses/atoms.py); the projection then uses each atom's own spacings. Off: the uniform support."""
    adaptive_atoms_lr: float = 1e-3
    """Adaptive atoms: step size of the ascent on the spacing parameters s (the origin notes' 1e-3)."""
    adaptive_atoms_warmup: int = 500
    """Adaptive atoms: train steps on the uniform support before the first spacing step (the origin notes' 500)."""
    atom_entropy_source: str = "taken"
    """What the atom-entropy controller measures utilization u on: 'taken' (the share of atoms whose
    batch-mean online probability at the taken action exceeds 0.1/Z) or 'target' (exp(H) / Z of the
    batch-mean projected target distribution: the atom_utilization diagnostic, the measure that fell
    from 0.98 to 0.36 over a default run while 'taken' stayed above 0.63; docs/RESULTS.md)."""
    freeze_reset: bool = False
    """On a detected freeze (numbarl/rl/freeze.py: Q-mean, Q-std and atom utilisation still for
    agent.freeze_epochs epochs while the gradient norm stays >= agent.freeze_grad_min), zero Adam's
    moments of the branch-advantage weights (optimizer group 'head.adv')."""
    freeze_eps: float = 1e-4
    """Freeze detector: largest per-epoch change of each watched statistic that counts as still."""
    freeze_epochs: int = 4
    """Freeze detector: consecutive still epochs before it fires."""
    freeze_grad_min: float = 1.0
    """Freeze detector: smallest logged gradient norm at which still Q statistics count as a freeze."""
    # --- spectral normalization and the CVaR entry gate ---------------------------------------------
    spectral_norm: str = ""
    """Comma-separated layers whose weight is spectrally normalized, W_sn = W / sigma(W) with sigma from
    one power iteration per train step (numbarl/rl/nets/spectral_norm.py, Miyato et al. 2018), e.g.
    'trunk.fc1,head.value' ('trunk.1' = 'trunk.fc1'); empty = off."""
    cvar_alpha: float = 0.0
    """Tail level alpha of the CVaR entry gate (numbarl/rl/cvar_gate.py): a flat env's greedy choice may not enter
    a side whose direction-branch CVaR_alpha is below -agent.cvar_floor (scaled by the IQN readiness budget;
    ε-greedy's exploratory draws are not gated); off over
    the trainer's replay prefill (DQNAgent.arm_entry_gates); 0 = off (e.g. 0.1)."""
    cvar_floor: float = 1.0
    """CVaR entry gate: the tolerated tail loss in reward units (>= 0): entry gated when
    budget * CVaR_alpha < -cvar_floor."""
    # --- end spectral normalization and the CVaR entry gate -------------------------------------------
    # --- ensemble and the epistemic gate (numbarl/rl/nets/ensemble.py) ----------------------------------
    ensemble_heads: int = 0
    """Bootstrapped ensemble of C51 heads (Osband et al. 2016): M heads on the shared trunk, the agent's
    head (acting) plus M - 1 extra heads (optimizer group 'head.ens'), each a double-DQN C51 loss with its
    own target head, weighted per (transition, head) by a Bernoulli(1/2) mask of the replay row from the
    counter RNG; auxiliary losses (every agent.aux_frequency train steps) whose trunk gradient adds to the
    C51 head's. 0 or 1 = off; 2..16 (5 proposed)."""
    epistemic_theta: float = 0.0
    """Epistemic entry gate: a flat env's greedy choice may not enter a side d (long / short) where
    budget * u(s, d) > theta (exploratory draws are not gated),
    u = the std over the ensemble's heads of the direction-branch Q(s, d) (budget 1, or the IQN readiness^2
    with agent.iqn), in the collect step and the backtest scores; holding and exits stay allowed; off over the
    trainer's replay prefill, where the untrained heads disagree (DQNAgent.arm_entry_gates).
    0 = no gate (needs agent.ensemble_heads >= 2)."""
    # --- end ensemble and the epistemic gate ------------------------------------------------------------
    # --- temporal input (numbarl/rl/temporal.py, numbarl/rl/nets/mamba.py; issue 15) ------------------
    temporal: str = ""
    """Temporal input of the C51 network: '' = off (the default: nothing of it is built) or 'mamba': the
    trunk reads h = x_t + y W_out, a Mamba2 selective scan (Dao & Gu 2024) over the observations of the last
    agent.temporal_steps bars of the env (the replay's column: the same window in training and acting; a
    per-policy ring in the backtests), online and target networks each with their own scan parameters,
    trained through all K steps (BPTT) in the optimizer group 'temporal.mamba'."""
    temporal_steps: int = 8
    """Temporal input: K, the bars of one window (1..32; the replay must hold K slots per env)."""
    temporal_heads: int = 8
    """Temporal input: heads of the scan (each its own decay); the scan's inner width is the observation width
    rounded up to a multiple of the heads."""
    temporal_lr: float = 1e-4
    """Temporal input: learning rate of the optimizer group 'temporal.mamba' (the origin's Adam 1e-4)."""
    temporal_conv: int = 0
    """Temporal input: taps d of Mamba2's causal depthwise convolution + SiLU on the scan's u, B and C before
    the scan (numbarl/cuda/kernels/conv1d.py; mamba_ssm's d_conv = 4); 0 = none. Without it the scan cannot
    form a product of two earlier bars' features (e.g. the last bar's flow times this bar's move)."""
    isv: bool = False
    """ISV signals (issue 15, T5; numbarl/rl/isv.py): a device vector of 12 training-health signals (fast/slow EMAs
    of the loss, grad norm and Q-mean, Q slope, clip share, bootstrap gap, stabilities, non-finite share) updated by
    one kernel at the end of every train step from the device stats; logged as isv_<name>, checkpointed."""
    isv_routing: bool = False
    """ISV temporal routing (issue 15, T6; numbarl/rl/isv.py): the trunk reads h = x_t + w ⊙ (y W_out) with
    per-feature weights w = σ(isv W_r + b_r) (init W_r = b_r = 0: w = 0.5, the fixed-mixing baseline), optimizer
    group 'temporal.route' at agent.temporal_lr; needs agent.temporal = 'mamba' and implies agent.isv."""
    isv_routing_lr: float = -1.0
    """ISV routing: learning rate of the group 'temporal.route'; -1 = agent.temporal_lr, 0 = W_r and b_r stay at
    their init (w = 0.5 for every feature: the fixed 0.5 mixing the routing's A/B compares against)."""
    # --- end temporal input ---------------------------------------------------------------------------
    # --- ICM curiosity (numbarl/rl/nets/icm.py, numbarl/rl/losses/icm.py) --------------------------------
    curiosity_weight: float = 0.0
    """ICM curiosity (Pathak et al. 2017): weight w of the intrinsic reward w * e / scale added to the
    batch reward before the C51 target projection, e = 1/2 ||forward model(phi(s), a) - phi(s')||^2 / H on the
    (detached) trunk features of width H, scale a running mean of e (agent.curiosity_normalize); the forward and
    inverse models train in the train step (optimizer groups 'icm.forward', 'icm.inverse'). Off below
    0.001 (CURIOSITY_MIN_WEIGHT), the default: then nothing of ICM is built."""
    curiosity_hidden: int = 256
    """ICM: hidden width of the forward and the inverse model (one ReLU layer each)."""
    curiosity_beta: float = 0.2
    """ICM: beta of the model loss beta * L_forward + (1 - beta) * L_inverse (Pathak et al. 2017, Eq. 7)."""
    curiosity_trunk_grad: bool = False
    """ICM: the inverse loss also trains the shared trunk (Pathak et al.'s feature learning), through phi(s) on
    the online pass and phi(s') on a second trunk backward of the next pass; off: the features are detached
    (ICM never changes how Q is computed; numbarl/rl/nets/icm.py says why that is the default)."""
    curiosity_normalize: bool = True
    """ICM: divide the forward error by its running scale (EMA 0.99 of the batch mean), so the mean intrinsic
    reward is about agent.curiosity_weight reward units; false: the raw error e times the weight."""
    # --- end ICM curiosity -------------------------------------------------------------------------------
    # --- multi-horizon C51 (agent.horizons; numbarl/rl/losses/multi_horizon.py) -----------------------------
    horizons: str = ""
    """Multi-horizon C51: n-step windows (bars) whose C51 losses are blended per sample, e.g. "1,5,20"; must
    include agent.n_step and name at least two. Each horizon other than n_step costs two extra forward passes
    (online and target net on its next state) per train step. Empty (default): the single n_step loss."""
    horizon_regime_col: str = "adx_14"
    """Multi-horizon C51: the trend-strength feature that blends the horizons, a feature name (adx_14 = ADX(14)/100)
    or an obs column index (a config saved with an int loads as that index)."""
    horizon_trend_lo: float = 0.20
    """Multi-horizon C51: feature value of no trend (weight on the shortest horizon); ADX 20."""
    horizon_trend_hi: float = 0.40
    """Multi-horizon C51: feature value of a strong trend (weight on the longest horizon); ADX 40."""
    horizon_mix: float = 0.5
    """Multi-horizon C51: share of each sample's weight the regime places (the rest is spread evenly over the
    horizons, so every horizon keeps learning); 0 = a plain average of the horizons' losses."""
    # --- end multi-horizon C51 ------------------------------------------------------------------------------
    # --- PPO (agent.kind = "ppo"; numbarl/rl/agents/ppo.py) --------------------------------------------
    ppo_rollout: int = 128
    """PPO: collect steps per rollout (T); the update runs after every T-th collect step on the T x n_envs
    transitions."""
    ppo_epochs: int = 4
    """PPO: passes (K) over the rollout per update, each in a fresh deterministic permutation."""
    ppo_minibatches: int = 4
    """PPO: minibatches (M) per epoch, of T * n_envs // M transitions each."""
    gae_lambda: float = 0.95
    """PPO: lambda of the generalized advantage estimate (Schulman et al. 2016); gamma is agent.gamma."""
    ppo_clip: float = 0.2
    """PPO: clip range epsilon of the probability ratio in the surrogate objective."""
    ppo_value_coef: float = 0.5
    """PPO: weight of the value loss 1/2 (V - R)^2."""
    ppo_entropy_coef: float = 0.01
    """PPO: weight of the entropy bonus (of the joint action: the sum over branches)."""
    # --- end PPO -----------------------------------------------------------------------------------------
    # --- Decision Transformer (agent.kind = "dt"; numbarl/rl/agents/dt.py) --------------------------------
    dt_context: int = 8
    """DT: steps L per window (3 L tokens: return-to-go, state, action per step)."""
    dt_embed: int = 64
    """DT: token width E of the transformer (a multiple of agent.dt_heads)."""
    dt_heads: int = 2
    """DT: attention heads per block."""
    dt_layers: int = 1
    """DT: transformer blocks (pre-LN; MLP width 4 E with agent.activation)."""
    dt_rollout: int = 64
    """DT: collect steps T per dataset: the envs' behavior trajectories of T steps x n_envs, rewritten and
    trained on after every T-th collect step (>= agent.dt_context)."""
    dt_updates: int = 16
    """DT: gradient steps per dataset (each on agent.dt_batch windows drawn by the counter RNG)."""
    dt_batch: int = 64
    """DT: windows of L steps per gradient step."""
    dt_gamma: float = 0.9
    """DT: discount of the return-to-go G_t = r_t + gamma G_{t+1} (stationary: the backtest has no episodes);
    windows end where the dataset's truncation weighs < 5 %."""
    dt_target: float = 1.0
    """DT: the return-to-go asked for when acting, in std units of the dataset's returns (0 = the mean)."""
    dt_behavior_noise: float = 0.5
    """DT: the behavior of env i takes a uniform random allowed action with probability noise * i / (n_envs - 1),
    else the oracle (the planted signal, or the hindsight move over agent.dt_oracle_horizon bars)."""
    dt_oracle_horizon: int = 8
    """DT: bars H of the hindsight oracle sign(mid[bar + H] - mid[bar]) (inside the env's bar range)."""
    dt_portfolio: bool = False
    """DT: the state token includes the observation's portfolio features (position, unrealized P&L, bars in
    trade, ...). Off: market features only. The behavior's portfolio is the trace of its own decisions on
    the hidden signal, so the DT reads "in a long, stay long" from it; acting, it reads its own position
    and holds (agents/dt.py, "What the DT sees")."""
    # --- end Decision Transformer ------------------------------------------------------------------------

    @property
    def head_pad_multiple(self) -> int:
        """agent.head_pad resolved (:func:`head_pad_multiple`)."""
        return head_pad_multiple(self.head_pad, self.compute, self.kind, self.head_pad_fp32)

    @property
    def fuse_value(self) -> bool:
        """agent.head_fuse_value resolved (:func:`value_fused`)."""
        return value_fused(self.head_fuse_value, self.head_pad_multiple)

    @property
    def curiosity(self) -> bool:
        """ICM curiosity is on: agent.curiosity_weight >= CURIOSITY_MIN_WEIGHT."""
        return self.curiosity_weight >= CURIOSITY_MIN_WEIGHT

    def validate(self):
        _check("agent", "kind", self.kind, choices=AGENT_KINDS)
        _check("agent", "lr_warmup_steps", self.lr_warmup_steps, lo=0, hi=10**9)
        _check("agent", "lr_cycle_steps", self.lr_cycle_steps, lo=0, hi=10**9)
        _check("agent", "lr_min_frac", self.lr_min_frac, lo=0.0, hi=1.0)
        _check("agent", "cql_alpha", self.cql_alpha, lo=0.0, hi=1e3)
        _check("agent", "aux_frequency", self.aux_frequency, lo=1, hi=10**6)
        _check("agent", "iqn_quantiles", self.iqn_quantiles, lo=1, hi=1024)
        if self.risk_budget and not self.iqn:
            raise ConfigError("agent.risk_budget = true needs agent.iqn = true (rho is the IQN readiness squared)")
        _check("agent", "iqn_embed", self.iqn_embed, lo=1, hi=4096)
        _check("agent", "iql_expectile", self.iql_expectile, lo=0.0, hi=1.0, lo_open=True)  # IQL (agent.iql)
        if self.iql_expectile >= 1.0:
            raise ConfigError(f"agent.iql_expectile = {self.iql_expectile} must be < 1")
        _check("agent", "iql_hidden", self.iql_hidden, lo=1, hi=16384)
        _check("agent", "confidence_weight", self.confidence_weight, lo=0.0, hi=1e3)  # recursive confidence
        _check("agent", "predictive_weight", self.predictive_weight, lo=0.0, hi=1e3)  # predictive coding
        _check("agent", "future_weight", self.future_weight, lo=0.0, hi=1e3)  # future-feature regression
        if self.future_weight > 0 or self.future_targets:
            from numbarl.rl.obs_columns import check_known_terms

            check_known_terms(self.future_targets, "future_targets")  # weight > 0 with no terms fails here
            if not self.future_weight > 0:
                raise ConfigError(f"agent.future_targets = {self.future_targets!r} is regressed only with "
                                  f"agent.future_weight > 0 (got {self.future_weight})")
        try:  # the tanh input bottleneck's lo:hi:width (its columns are checked against the obs width by the agent)
            from numbarl.rl.nets.bottleneck import parse_bottleneck

            parse_bottleneck(self.input_bottleneck)
        except ValueError as e:
            raise ConfigError(f"agent.input_bottleneck = {e}") from None
        # the regime gate's and regime dropout's columns: names or indices (resolved by the agent: obs_columns.py)
        from numbarl.rl.obs_columns import check_known_names

        check_known_names(self.regime_gate_cols, "regime_gate_cols")
        check_known_names(self.regime_dropout_col, "regime_dropout_col", many=False)
        _check("agent", "obs_noise", self.obs_noise, lo=0.0, hi=10.0)
        _check("agent", "reward_centering", self.reward_centering, lo=0.0, hi=1.0)
        _check("agent", "regime_dropout_lo", self.regime_dropout_lo, lo=0.0, hi=0.95)  # regime dropout
        _check("agent", "regime_dropout_hi", self.regime_dropout_hi, lo=0.0, hi=0.95)
        if self.regime_dropout_hi < self.regime_dropout_lo:
            raise ConfigError(f"agent.regime_dropout_hi = {self.regime_dropout_hi} must be >= agent.regime_dropout_lo "
                              f"= {self.regime_dropout_lo}")
        _check("agent", "confidence_epsilon", self.confidence_epsilon, lo=0.0, hi=1e9)
        _check("agent", "confidence_floor", self.confidence_floor, lo=0.0, hi=1.0)
        _check("agent", "risk_head_weight", self.risk_head_weight, lo=0.0, hi=1e3)  # risk-budget head
        if not isinstance(self.risk_head_sizing, bool):
            raise ConfigError(f"agent.risk_head_sizing = {self.risk_head_sizing!r} must be true or false")
        if self.confidence_floor >= 1.0 or (self.confidence_floor > 0 and not self.confidence_weight > 0):
            raise ConfigError(f"agent.confidence_floor = {self.confidence_floor} needs 0 <= floor < 1 and the confidence "
                              f"head trained (agent.confidence_weight > 0, got {self.confidence_weight})")
        _check("agent", "restart_momentum_scale", self.restart_momentum_scale, lo=0.0, hi=1.0)
        if self.weight_decay_groups:  # the c51 network's optimizer groups (numbarl/rl/agents/dqn.py)
            groups = (["trunk"] + (["trunk.bn"] if self.input_bottleneck else [])
                      + (["trunk.kan"] if self.kan_gate else []) + (["trunk.gate"] if self.feature_gate else [])
                      + (["trunk.attn"] if self.feature_attention else []) + (["trunk.rgate"] if self.regime_gate else [])
                      + ["head.value", "head.adv"])
            groups += ["head.iqn"] if self.iqn else []
            groups += ["head.iql"] if self.iql else []  # IQL (agent.iql)
            groups += ["head.conf"] if self.confidence_weight > 0 else []  # recursive confidence
            groups += ["head.pc"] if self.predictive_weight > 0 else []  # predictive coding
            groups += ["head.ff"] if self.future_weight > 0 else []  # future-feature regression
            groups += ["head.risk"] if self.risk_head_weight > 0 else []  # risk-budget head
            groups += ["head.ens"] if self.ensemble_heads >= 2 else []  # ensemble
            groups += ["icm.forward", "icm.inverse"] if self.curiosity else []  # ICM (agent.curiosity_weight)
            groups += ["temporal.mamba"] if self.temporal else []  # temporal input (agent.temporal)
            groups += ["temporal.route"] if self.isv_routing else []  # ISV routing (agent.isv_routing)
            unknown = [g.strip() for g in self.weight_decay_groups.split(",") if g.strip() and g.strip() not in groups]
            if unknown:
                raise ConfigError(f"agent.weight_decay_groups = {self.weight_decay_groups!r}: no optimizer group "
                                  f"{', '.join(unknown)}; the groups are {', '.join(groups)}")
        if not self.trunk:
            raise ConfigError("agent.trunk = () must name at least one hidden width")
        for w in self.trunk:
            _check("agent", "trunk[]", w, lo=1, hi=16384)
        _check("agent", "activation", self.activation, choices=("relu", "silu"))
        _check("agent", "n_atoms", self.n_atoms, lo=2, hi=512)  # the head keeps a sample's rows in shared memory
        if not self.v_min < self.v_max:
            raise ConfigError(f"agent.v_min = {self.v_min} must be < agent.v_max = {self.v_max}")
        _check("agent", "gamma", self.gamma, lo=0.0, hi=1.0)
        _check("agent", "n_step", self.n_step, lo=1, hi=64)
        _check("agent", "batch_size", self.batch_size, lo=1, hi=1 << 20)
        _check("agent", "replay_capacity", self.replay_capacity, lo=1, hi=1 << 30)
        _check("agent", "lr", self.lr, lo=0.0, hi=1.0, lo_open=True)
        _check("agent", "adam_beta1", self.adam_beta1, lo=0.0, hi=0.999999)
        _check("agent", "adam_beta2", self.adam_beta2, lo=0.0, hi=0.999999999)
        _check("agent", "adam_eps", self.adam_eps, lo=0.0, hi=1.0, lo_open=True)
        _check("agent", "weight_decay", self.weight_decay, lo=0.0, hi=1.0)
        _check("agent", "max_grad_norm", self.max_grad_norm, lo=0.0, hi=1e9)
        _check("agent", "target_update", self.target_update, choices=("periodic", "polyak"))
        _check("agent", "target_period", self.target_period, lo=1, hi=10**9)
        _check("agent", "tau", self.tau, lo=0.0, hi=1.0, lo_open=True)
        _check("agent", "compute", self.compute, choices=("fp32", "tf32"))
        _check("agent", "head_pad", self.head_pad, lo=0, hi=1024)
        _check("agent", "head_pad_fp32", self.head_pad_fp32, lo=1, hi=1024)
        if not isinstance(self.head_fuse_value, bool):
            raise ConfigError(f"agent.head_fuse_value = {self.head_fuse_value!r} must be true or false")
        if not isinstance(self.overlap, bool):
            raise ConfigError(f"agent.overlap = {self.overlap!r} must be true or false")
        _check("agent", "support", self.support, choices=("fixed", "fit"))
        _check("agent", "atom_entropy_source", self.atom_entropy_source, choices=("taken", "target"))
        _check("agent", "support_horizon_factor", self.support_horizon_factor, lo=0.0, hi=1e6)
        _check("agent", "atom_entropy_max", self.atom_entropy_max, lo=0.0, hi=10.0)
        _check("agent", "adaptive_atoms_lr", self.adaptive_atoms_lr, lo=0.0, hi=1.0, lo_open=True)
        _check("agent", "adaptive_atoms_warmup", self.adaptive_atoms_warmup, lo=0, hi=10**9)
        if self.adaptive_atoms and self.n_atoms < 3:
            raise ConfigError(f"agent.adaptive_atoms needs agent.n_atoms >= 3 (got {self.n_atoms}): with two atoms "
                              "both are the fixed ends and no spacing can move")
        _check("agent", "freeze_eps", self.freeze_eps, lo=0.0, hi=1e6, lo_open=True)
        _check("agent", "freeze_epochs", self.freeze_epochs, lo=1, hi=10**6)
        _check("agent", "freeze_grad_min", self.freeze_grad_min, lo=0.0, hi=1e9)
        _check("agent", "curiosity_weight", self.curiosity_weight, lo=0.0, hi=1e3)  # ICM curiosity
        _check("agent", "curiosity_hidden", self.curiosity_hidden, lo=1, hi=16384)
        _check("agent", "curiosity_beta", self.curiosity_beta, lo=0.0, hi=1.0)
        _check("agent", "ppo_rollout", self.ppo_rollout, lo=1, hi=1 << 20)  # PPO (agent.kind = "ppo")
        _check("agent", "ppo_epochs", self.ppo_epochs, lo=1, hi=1000)
        _check("agent", "ppo_minibatches", self.ppo_minibatches, lo=1, hi=1 << 20)
        _check("agent", "gae_lambda", self.gae_lambda, lo=0.0, hi=1.0)
        _check("agent", "ppo_clip", self.ppo_clip, lo=0.0, hi=10.0, lo_open=True)
        _check("agent", "ppo_value_coef", self.ppo_value_coef, lo=0.0, hi=1e3)
        _check("agent", "ppo_entropy_coef", self.ppo_entropy_coef, lo=0.0, hi=1e3)
        _check("agent", "dt_context", self.dt_context, lo=1, hi=64)  # DT (agent.kind = "dt")
        _check("agent", "dt_embed", self.dt_embed, lo=1, hi=4096)
        _check("agent", "dt_heads", self.dt_heads, lo=1, hi=64)
        if self.dt_embed % self.dt_heads != 0:
            raise ConfigError(f"agent.dt_embed = {self.dt_embed} must be a multiple of agent.dt_heads = {self.dt_heads}")
        _check("agent", "dt_layers", self.dt_layers, lo=1, hi=64)
        _check("agent", "dt_rollout", self.dt_rollout, lo=1, hi=1 << 20)
        if self.dt_rollout < self.dt_context:
            raise ConfigError(f"agent.dt_rollout = {self.dt_rollout} must be >= agent.dt_context = {self.dt_context} "
                              "(a window lies inside one dataset)")
        _check("agent", "dt_updates", self.dt_updates, lo=1, hi=10000)
        _check("agent", "dt_batch", self.dt_batch, lo=1, hi=1 << 20)
        _check("agent", "dt_gamma", self.dt_gamma, lo=0.0, hi=1.0)
        _check("agent", "dt_target", self.dt_target, lo=-100.0, hi=100.0)
        _check("agent", "dt_behavior_noise", self.dt_behavior_noise, lo=0.0, hi=1.0)
        _check("agent", "dt_oracle_horizon", self.dt_oracle_horizon, lo=1, hi=1 << 20)
        # the switches of the c51 network and loss have no meaning for PPO: never a silent no-op. (The
        # C51 distribution's shape — n_atoms, v_min/v_max, agent.support, which the default preset sets
        # to "fit" — describes the value head PPO does not have and is ignored, so --preset default
        # --set agent.kind=ppo works.)
        if self.kind in ("ppo", "dt"):
            c51_only = {"iqn": self.iqn, "iql": self.iql, "cql_alpha": self.cql_alpha > 0,
                        "confidence_weight": self.confidence_weight > 0,  # recursive confidence
                        "predictive_weight": self.predictive_weight > 0,  # predictive coding
                        "future_weight": self.future_weight > 0,  # future-feature regression
                        "head_pad": self.head_pad > 1,  # the padded C51 head (0, automatic, pads only a C51 head)
                        "risk_head_weight": self.risk_head_weight > 0,  # risk-budget head
                        "regime_dropout": self.regime_dropout,
                        "atom_entropy_max": self.atom_entropy_max > 0, "adaptive_atoms": self.adaptive_atoms,
                        "freeze_reset": self.freeze_reset, "spectral_norm": bool(self.spectral_norm),
                        "cvar_alpha": self.cvar_alpha > 0, "feature_gate": self.feature_gate, "kan_gate": self.kan_gate,
                        "feature_attention": self.feature_attention, "input_bottleneck": bool(self.input_bottleneck),
                        "regime_gate": self.regime_gate,  # regime gate
                        "ensemble_heads": self.ensemble_heads >= 2,  # ensemble
                        "lock_aware_target": self.lock_aware_target, "weight_decay_groups": bool(self.weight_decay_groups),
                        "curiosity_weight": self.curiosity,  # ICM: the c51 agent's hooks only
                        "temporal": bool(self.temporal),  # temporal input: the c51 agent's passes
                        "isv": self.isv, "isv_routing": self.isv_routing,  # ISV: the c51 agent's train step
                        "reward_centering": self.reward_centering > 0}  # the c51 agent's replay batch
            on = [f"agent.{name}" for name, value in c51_only.items() if value]
            if on:
                raise ConfigError(f"agent.kind = '{self.kind}' does not have {', '.join(on)} (c51 components); turn them off")
        # multi-horizon C51 (agent.horizons)
        if self.horizons:
            try:
                hs = parse_horizons(self.horizons)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            if self.kind != "c51":
                raise ConfigError(f"agent.horizons = {self.horizons!r} is a c51 component; agent.kind = '{self.kind}'")
            if len(hs) < 2 or self.n_step not in hs or not all(1 <= h <= 256 for h in hs):
                raise ConfigError(f"agent.horizons = {self.horizons!r} must name at least two windows in 1..256 bars, "
                                  f"one of them agent.n_step = {self.n_step}")
            check_known_names(self.horizon_regime_col, "horizon_regime_col", many=False)
            _check("agent", "horizon_mix", self.horizon_mix, lo=0.0, hi=1.0)
            if not self.horizon_trend_hi > self.horizon_trend_lo:
                raise ConfigError(f"agent.horizon_trend_hi = {self.horizon_trend_hi} must be > agent.horizon_trend_lo "
                                  f"= {self.horizon_trend_lo}")
        # spectral normalization and the CVaR entry gate
        _check("agent", "cvar_alpha", self.cvar_alpha, lo=0.0, hi=1.0)
        _check("agent", "cvar_floor", self.cvar_floor, lo=0.0, hi=1e9)
        # ensemble and the epistemic gate
        _check("agent", "ensemble_heads", self.ensemble_heads, lo=0, hi=16)
        _check("agent", "epistemic_theta", self.epistemic_theta, lo=0.0, hi=1e9)
        if self.epistemic_theta > 0 and self.ensemble_heads < 2:
            raise ConfigError(f"agent.epistemic_theta = {self.epistemic_theta} gates on the spread of an ensemble: "
                              f"set agent.ensemble_heads >= 2 (got {self.ensemble_heads}) or the theta to 0")
        if self.ensemble_heads >= 2 and getattr(self, "adaptive_atoms", False):
            raise ConfigError("agent.ensemble_heads and agent.adaptive_atoms are not combined yet (the extra heads keep "
                              "the fixed or fitted support, not the moved atoms): turn one of them off")
        if self.spectral_norm and not all(t.strip() for t in self.spectral_norm.split(",")):
            raise ConfigError(f"agent.spectral_norm = {self.spectral_norm!r}: an empty layer name in the list")
        # temporal input (agent.temporal)
        _check("agent", "temporal", self.temporal, choices=("", "mamba"))
        _check("agent", "temporal_steps", self.temporal_steps, lo=1, hi=32)  # numbarl/cuda/kernels/ssm.py MAX_STEPS
        _check("agent", "temporal_heads", self.temporal_heads, lo=1, hi=1024)
        _check("agent", "temporal_lr", self.temporal_lr, lo=0.0, hi=1.0, lo_open=True)
        _check("agent", "temporal_conv", self.temporal_conv, lo=0, hi=8)  # numbarl/cuda/kernels/conv1d.py MAX_WIDTH
        if self.temporal_conv > self.temporal_steps:  # a tap beyond the window would never see a row
            raise ConfigError(f"agent.temporal_conv = {self.temporal_conv} taps exceed the window of agent.temporal_steps "
                              f"= {self.temporal_steps} bars; use at most {self.temporal_steps}")
        if self.temporal_conv and self.temporal != "mamba":
            raise ConfigError(f"agent.temporal_conv = {self.temporal_conv} convolves the temporal input's scan inputs: "
                              f"it needs agent.temporal = 'mamba' (got {self.temporal!r})")
        if self.isv_routing_lr != -1.0:
            _check("agent", "isv_routing_lr", self.isv_routing_lr, lo=0.0, hi=1.0)  # or -1: agent.temporal_lr
        if self.isv_routing and self.temporal != "mamba":  # ISV routing weights the temporal input's scan
            raise ConfigError(f"agent.isv_routing = true routes the temporal input's scan: it needs agent.temporal = "
                              f"'mamba' (got {self.temporal!r}); set agent.temporal=mamba or agent.isv_routing=false")


@dataclass(frozen=True)
class TrainConfig:
    n_envs: int = 16384
    """Parallel device environments."""
    epochs: int = 10
    """Epochs per fold; each ends with a validation backtest and a checkpoint."""
    collect_steps_per_epoch: int = 1000
    """Env steps (of all n_envs) collected per epoch."""
    train_every: int = 1
    """Collect steps between train steps."""
    learning_starts: int = 8
    """Collect steps before the first train step (replay warm-up)."""
    epsilon_start: float = 1.0
    """Exploration rate at the first collect step."""
    epsilon_end: float = 0.05
    """Exploration rate after the decay."""
    epsilon_decay_steps: int = 2000
    """Collect steps of the linear epsilon decay."""
    log_interval: int = 100
    """Collect steps between host reads of the mapped stats (the only syncs in an epoch)."""
    seed: int = 0
    """Training seed: weights, RNG streams, env starts."""
    folds: int = 1
    """Walk-forward folds."""
    # the window sizes default to the one split definition numbarl-data --folds checks too
    train_sessions: int = DEFAULT_SPLIT["train_sessions"]
    """Sessions in each fold's training window."""
    val_sessions: int = DEFAULT_SPLIT["val_sessions"]
    """Sessions in each fold's validation window."""
    test_sessions: int = DEFAULT_SPLIT["test_sessions"]
    """Sessions in each fold's out-of-sample test window (the folds' test windows are adjacent and
    end at the newest session: numbarl/data/splits.py)."""
    embargo_bars: int = DEFAULT_SPLIT["embargo_bars"]
    """Bars dropped between train/validation/test windows."""
    graph: bool = True
    """Replay captured CUDA graphs (False = --no-graph: the same steps eagerly)."""
    select_window: int = 1
    """Model selection: the test window scores the epoch whose validation Sharpe averaged over it
    and the select_window - 1 epochs before it is highest (1 = the best single epoch; a larger
    window does not reward one lucky validation epoch)."""
    early_stop_patience: int = 0
    """Early stopping: a fold ends once this many epochs in a row have not beaten the best selection
    score (the test window then scores the best epoch, as after a full run); 0 = off, every epoch runs. It
    counts from the first defined score (none before select_window epochs, or while validation has no trades).
    Runs are deterministic, so a stopped run is the first epochs of the full one: it selects the same
    checkpoint unless a later epoch would have beaten the best."""
    deploy_min_trade_t: float = 0.0
    """Deployment rule: the selected checkpoint trades a fold's test window only when its validation window's
    trade t (per-trade Sharpe × √trades, numbarl ab's "trade t") reaches this; otherwise the fold deploys
    nothing: its test window is held flat (no trades, zero P&L: the test metrics, trade list, equity and pooled
    headline), the summary says why (deployed, val_trade_t, deploy_rule), and the policy's own test score stays
    beside it as test_policy, a diagnostic. 0 = off: every fold trades its test window."""
    # the validation feedback loop (numbarl/rl/feedback): with any switch on, the validation window
    # splits into a feedback part the switches read and a selection part the model is chosen on
    feedback_split: float = 0.5
    """Share of the validation window (its first bars) the feedback loop reads; the model is
    selected on the rest, after train.embargo_bars (used only when a feedback switch is on)."""
    e1_q_reality: float = 0.0
    """E1 Q reality check: step eta of the reward offset that removes the median gap between the
    greedy Q at validation entries and the reward those trades realized (0 = off; origin: 0.5)."""
    e2_adaptive_epsilon: bool = False
    """E2: after epoch 1 the exploration rate follows the feedback Sharpe (x0.8 when it holds up,
    x1.25 when it falls; [0.01, 0.3]) instead of the schedule."""
    e3_dynamic_gamma: bool = False
    """E3: discount from the feedback trades' mean holding time, clip(1 - 1/(2 avg_hold), 0.95, 0.999)."""
    e3_refit_support: bool = False
    """E3: refit the C51 value support (agent.support = 'fit') from the replay's returns at the new gamma each time
    E3 moves gamma; otherwise the support fitted once at the starting gamma stays (needs train.e3_dynamic_gamma)."""
    e4_trade_autopsy: bool = False
    """E4: each losing feedback trade blamed on one branch (direction, size, target, stop); each
    branch's advantage columns learn at agent.lr x clip(its share / the mean share, 0.5, 2)."""
    e6_winner_boost: float = 0.0
    """E6 winner distillation: the replay rows of the top e6_top_frac of the training trades (by
    P&L, threshold from the previous epoch) weigh 1 + this in the loss (0 = off; origin: 1)."""
    e6_top_frac: float = 0.1
    """E6: the share of training trades that count as winners."""
    e7_margin_weight: float = 0.0
    """E7 hindsight labels: weight lambda_E of the large-margin loss towards 'flat' at the entries of
    losing training trades, halved each epoch (0 = off; origin: 0.1)."""
    e7_margin: float = 0.8
    """E7: the margin l of the large-margin loss (reward units)."""
    e8_curriculum_kappa: float = 0.0
    """E8 curriculum: loss weight of a regime bucket clip(1 + kappa (its feedback loss rate - the
    mean), 0.5, 2) (0 = off; origin: 1)."""
    e9_tradability_gate: bool = False
    """E9: no entries in the regime buckets (trend x volatility terciles) whose shrunk mean
    feedback trade P&L is negative."""
    e9_min_trades: int = 10
    """Trades a regime bucket needs before E9 may gate it (and the trade count under which E2
    raises its exploration floor)."""
    regime_features: str = "adx_14,rv_32"
    """The two features whose training-window terciles define the 9 regime buckets (E8, E9)."""

    def validate(self):
        _check("train", "n_envs", self.n_envs, lo=1, hi=65536)
        _check("train", "epochs", self.epochs, lo=1, hi=100000)
        _check("train", "collect_steps_per_epoch", self.collect_steps_per_epoch, lo=1, hi=10**9)
        _check("train", "train_every", self.train_every, lo=1, hi=10**6)
        _check("train", "learning_starts", self.learning_starts, lo=0, hi=10**9)
        _check("train", "epsilon_start", self.epsilon_start, lo=0.0, hi=1.0)
        _check("train", "epsilon_end", self.epsilon_end, lo=0.0, hi=1.0)
        _check("train", "epsilon_decay_steps", self.epsilon_decay_steps, lo=1, hi=10**9)
        _check("train", "log_interval", self.log_interval, lo=1, hi=10**9)
        _check("train", "seed", self.seed, lo=0, hi=2**63 - 1)
        _check("train", "folds", self.folds, lo=1, hi=1000)
        _check("train", "train_sessions", self.train_sessions, lo=1, hi=100000)
        _check("train", "val_sessions", self.val_sessions, lo=1, hi=100000)
        _check("train", "test_sessions", self.test_sessions, lo=1, hi=100000)
        _check("train", "embargo_bars", self.embargo_bars, lo=0, hi=10**9)
        _check("train", "select_window", self.select_window, lo=1, hi=self.epochs)
        _check("train", "early_stop_patience", self.early_stop_patience, lo=0, hi=10**6)
        _check("train", "deploy_min_trade_t", self.deploy_min_trade_t, lo=0.0, hi=1e6)
        _check("train", "feedback_split", self.feedback_split, lo=0.0, hi=1.0, lo_open=True)
        _check("train", "e1_q_reality", self.e1_q_reality, lo=0.0, hi=10.0)
        _check("train", "e9_min_trades", self.e9_min_trades, lo=1, hi=10**9)
        _check("train", "e6_winner_boost", self.e6_winner_boost, lo=0.0, hi=100.0)
        _check("train", "e6_top_frac", self.e6_top_frac, lo=0.0, hi=1.0, lo_open=True)
        _check("train", "e8_curriculum_kappa", self.e8_curriculum_kappa, lo=0.0, hi=100.0)
        _check("train", "e7_margin_weight", self.e7_margin_weight, lo=0.0, hi=100.0)
        _check("train", "e7_margin", self.e7_margin, lo=0.0, hi=1e6)
        if len([w for w in self.regime_features.split(",") if w.strip()]) != 2:
            raise ConfigError(f"train.regime_features = {self.regime_features!r} must name two features, comma separated")


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvParams = field(default_factory=EnvParams)
    agent: AgentConfig = field(default_factory=AgentConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    preset: str = "default"
    """Name of the preset this config started from."""

    def validate(self) -> "Config":
        self.data.validate()
        getattr(self.env, "validate", lambda: None)()  # EnvParams validates on construction too
        self.agent.validate()
        self.train.validate()
        if self.agent.kind in ("ppo", "dt"):
            from numbarl.rl.feedback.split import feedback_on

            if feedback_on(self.train):
                raise ConfigError(f"agent.kind = '{self.agent.kind}' does not run the validation feedback loop (train.e1_* .. "
                                  "train.e9_* act on the c51 agent's replay, loss and epsilon); turn them off")
        if self.agent.reward_centering > 0 and self.train.e1_q_reality > 0:
            raise ConfigError(f"agent.reward_centering = {self.agent.reward_centering} and train.e1_q_reality = "
                              f"{self.train.e1_q_reality} both offset the sampled returns, and E1 measures the centered "
                              "values against the realized (uncentered) returns, so it would undo the centering: "
                              "set one of them to 0")
        if self.train.e3_refit_support and not (self.train.e3_dynamic_gamma and self.agent.support == "fit"):
            raise ConfigError("train.e3_refit_support = true refits the support when E3 moves gamma: it needs "
                              f"train.e3_dynamic_gamma = true (got {self.train.e3_dynamic_gamma}) and agent.support = "
                              f"'fit' (got {self.agent.support!r})")
        if self.agent.replay_capacity < self.train.n_envs * (self.agent.n_step + 1):
            raise ConfigError(
                f"agent.replay_capacity = {self.agent.replay_capacity} is too small for train.n_envs = "
                f"{self.train.n_envs} and agent.n_step = {self.agent.n_step}: needs at least "
                f"{self.train.n_envs * (self.agent.n_step + 1)}"
            )
        if self.agent.risk_head_weight > 0 and int(getattr(self.env, "latency_bars", 0)) > 0:
            # the outcome labels go on the row whose step filled the entry, the sizing rewrites the action of
            # the row that decides it: with latency they are L rows apart (numbarl/rl/losses/risk_head.py)
            raise ConfigError(f"agent.risk_head_weight = {self.agent.risk_head_weight} needs env.latency_bars = 0 "
                              f"(got {self.env.latency_bars}): the head's labels would land on the fill's row, L rows "
                              "after the decision it sizes; set env.latency_bars=0 or agent.risk_head_weight=0")
        if self.agent.horizons:  # multi-horizon C51: the longest window
            longest = max(parse_horizons(self.agent.horizons))
            if self.agent.replay_capacity < self.train.n_envs * (longest + 1):
                raise ConfigError(
                    f"agent.replay_capacity = {self.agent.replay_capacity} is too small for train.n_envs = "
                    f"{self.train.n_envs} and the longest of agent.horizons = {longest}: needs at least "
                    f"{self.train.n_envs * (longest + 1)}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------------------------
PRESETS: dict[str, Config] = {
    "tiny": Config(
        preset="tiny",
        data=DataConfig(synth_sessions=6, synth_scale="tiny", synth_bars_per_day=30),
        agent=AgentConfig(trunk=(16,), n_atoms=11, batch_size=16, replay_capacity=256, n_step=2,
                          target_period=4, lr=1e-3),
        train=TrainConfig(n_envs=4, epochs=2, collect_steps_per_epoch=6, learning_starts=3,
                          epsilon_decay_steps=8, log_interval=3, train_sessions=4, val_sessions=1,
                          test_sessions=1, embargo_bars=2),
    ),
    "small": Config(
        preset="small",
        agent=AgentConfig(trunk=(128, 128), batch_size=1024, replay_capacity=1 << 18, target_period=500),
        train=TrainConfig(n_envs=1024, epochs=5, collect_steps_per_epoch=500, epsilon_decay_steps=1000,
                          log_interval=100),
    ),
    # Polyak target averaging (τ = 0.005 per train step): on the planted synthetic market, 5 of 5
    # seeds reached 0.66-0.78 of the oracle's test Sharpe, against 2 of 5 with a periodic copy
    # every 1,000 steps (docs/RESULTS.md)
    # the C51 support fitted to the prefill's returns: on the planted market 0.87 of the oracle's
    # test Sharpe over 5 seeds (min 0.82) against 0.78 (min 0.70) with the fixed ±10 support, and no
    # seed with |t| > 2 on the null market (docs/RESULTS.md, 2026-12-01: the A/B arm also had
    # agent.atom_entropy_max=0.01, whose coefficient stayed 0 all run, so the arm is this config)
    # the reward that prices costs as net P&L does (the mark-to-market term alone: the trade and micro terms
    # off) with gamma = 0.95: on the planted market 0.85 of the oracle's test Sharpe over 5 seeds (min 0.79)
    # against 0.87 (min 0.82), and the late decay mostly gone: the last epoch's validation Sharpe 0.92 of the
    # best epoch's (min 0.88) against 0.71, validation trades x1.36 from the best epoch to the last (x1.6-1.7 in
    # the arms on the earlier reward), atom utilization 0.51 against 0.32; no seed with |t| > 2 on the null
    # market (largest 1.55)
    # (docs/RESULTS.md, eleventh session). agent.gamma is PPO's discount too: PPO and the DT were measured on
    # the earlier reward (trade 0.01 + micro 100, gamma 0.99)
    # fp32 GEMMs. TF32 (agent.compute=tf32: inputs rounded to TF32, fp32 accumulation) matched fp32 on the planted
    # market (0.85 of the oracle's test Sharpe over 5 seeds, min 0.81, against 0.85, min 0.79; twelfth session) at
    # about half the step time, and was this preset's precision for one session; on the null market one of its
    # five seeds reached test t = -2.57 (fp32's largest |t| there 1.55), so by the rule set before that run the
    # preset is fp32 again (docs/RESULTS.md, thirteenth session). The A/B grids run TF32 explicitly (t32 arms).
    # epsilon_end = 0.1: exploration kept at 10% after the decay, so the replay (the last 64 collect steps) never
    # holds near-greedy data only. With 0.05 the validation Sharpe peaked at epoch 1-3, at the end of the decay,
    # then sat on a plateau 0.86-0.96 of the peak (last/best min 0.88); with 0.1, fp32, 5 seeds: last/best 0.99
    # (min 0.98), test 0.85 of the oracle (min 0.81, as before), atom utilization 0.55 (0.51), null market largest
    # |t| 1.69 (1.55). epsilon_end = 0.2 lifted the plateau more (test 0.90, min 0.81) but put one null seed at
    # t = 2.20; a 4x replay and a 10,000-step decay did not help (docs/RESULTS.md, fifteenth session)
    # deploy_min_trade_t = 2 (since the twenty-fifth session): a fold trades its test window only when the selected
    # checkpoint's validation trade t reaches 2, else it holds the window flat and says so. Over the 120 archived
    # runs it was fitted on it held all 25 null seeds flat and deployed 54 of 55 planted seeds; out of sample (the
    # twenty-third and twenty-fourth sessions' 50 runs) 20 of 20 null seeds flat, 25 of 25 planted and memory-market
    # seeds deployed, and one memoryless regime-walk seed let through (test t -2.09) (docs/RESULTS.md). It changes
    # no training bit.
    "default": Config(preset="default", agent=AgentConfig(target_update="polyak", support="fit", gamma=0.95),
                      env=EnvParams(trade_reward_scale=0.0, micro_reward_scale=0.0, pnl_reward_scale=0.01),
                      train=TrainConfig(epsilon_end=0.1, deploy_min_trade_t=2.0)),
    "large": Config(
        preset="large",
        agent=AgentConfig(trunk=(1024, 1024, 512), batch_size=32768, replay_capacity=1 << 22, compute="tf32"),
        train=TrainConfig(n_envs=65536, epochs=20, collect_steps_per_epoch=2000, epsilon_decay_steps=5000,
                          deploy_min_trade_t=2.0),
    ),
}
# "temporal": the default preset with issue 15's temporal agent, for markets whose edge shows only through history:
# the Mamba2 scan over the last 12 bars (no convolution, its own learning rate 5e-4), the previous bar's trade
# imbalance as a feature, the future-feature regression of trade_imb_prev*ret_1 at weight 0.1, and early stopping
# after 2 epochs without a better validation score. On the 100-session regime walk (TF32, 5 seeds, twenty-second
# session, docs/RESULTS.md): 0.76 of the oracle's test Sharpe (min 0.727) against the memoryless agent's 0.00, every
# seed's best epoch the second; its train step 1.76x the memoryless one (fp32, docs/BENCHMARKS.md). The same stack at
# K = 16 lost 2.0% against the memoryless agent on the planted market (0.855 against 0.873). On null markets the K = 16
# stack's test windows lost with t below -2 in 3 of 10 seeds, so the preset also deploys a fold only when its
# validation trade t reaches 2 (train.deploy_min_trade_t). Over the 120 archived runs in bin/ab-arms.sh's BASE_RUNS
# that rule holds all 25 null seeds flat, and deploys 54 of the 55 planted-market seeds and all 25 seeds of the
# memory-market arms that learned the regime (docs/RESULTS.md, twenty-second session). The preset itself in fp32 with
# the rule live (twenty-fourth session, five seeds each): 0.72 of the oracle on the regime walk (min 0.66) against the
# memoryless default's -0.12; on a null market per seed every fold held flat (one policy would have scored t -5.61);
# on the planted market 0.81 against the default's 0.85 (-3.7%).
PRESETS["temporal"] = replace(
    PRESETS["default"], preset="temporal",
    data=replace(PRESETS["default"].data, features="default,trade_imb_prev"),
    agent=replace(PRESETS["default"].agent, temporal="mamba", temporal_steps=12, temporal_lr=5e-4, future_weight=0.1,
                  future_targets="trade_imb_prev*ret_1"),
    train=replace(PRESETS["default"].train, early_stop_patience=2, deploy_min_trade_t=2.0))


def preset(name: str) -> Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {list(PRESETS)}") from None


# ---------------------------------------------------------------------------------------------
# overrides: config files and --set key=value
# ---------------------------------------------------------------------------------------------
def _declared_kind(f: dataclasses.Field):
    """The scalar type a field declares (``float | None`` -> float), for fields whose current value
    (None) does not tell it; annotations are strings under ``from __future__ import annotations``."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str), ("tuple", tuple)):
        if name in str(text):
            return kind
    return None


def _coerce(section: str, f: dataclasses.Field, current, raw):
    where = f"{section}.{f.name}"
    if current is None:  # a field whose default is None ("use the data's"): coerce to its declared type
        if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("none", "null")):
            return None
        kind = _declared_kind(f)
        if kind is None:
            return raw
        current = {bool: False, int: 0, float: 0.0, str: "", tuple: ()}[kind]
    if isinstance(current, bool):
        if isinstance(raw, bool):
            return raw
        s = str(raw).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where} = {raw!r} is not a boolean (true/false)")
    try:
        if isinstance(current, int):
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            if isinstance(raw, str) and "e" in raw.lower():  # 1e6 is an integer, 2.5e0 is not
                value = float(raw)
                if not value.is_integer():
                    raise ValueError
                return int(value)
            return int(raw)
        if isinstance(current, float):
            return float(raw)
        if isinstance(current, tuple):
            items = raw if isinstance(raw, (list, tuple)) else [x for x in str(raw).replace("(", "").replace(")", "").split(",") if x.strip()]
            kind = type(current[0]) if current else float
            return tuple(kind(x) for x in items)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} = {raw!r} is not a valid {type(current).__name__}") from None
    return str(raw) if isinstance(current, str) else raw


# fields renamed since a released config format: the old name still loads (a run folder's own
# config.json from an earlier numbarl resumes and reproduces)
RENAMED = {("env", "fill_delay"): "latency_bars"}
# fields added with a default that is not what the code before them did: a saved section that lacks one was
# written by that code, so it takes this value (a run resumes, and numbarl ab compares it, as it ran)
LEGACY = {("agent", "head_pad"): 1,  # before the twentieth session no head was padded, TF32 included
          ("agent", "head_fuse_value"): False,  # before the twenty-first, no value stream was fused
          ("agent", "head_pad_fp32"): 1,  # before the twenty-fifth, fp32's automatic head_pad was none
          # before the twenty-second session no fold was held flat; the field's default is 0 (off) and the default
          # preset's 2 since the twenty-fifth: the entry makes numbarl ab compare a base saved without it as off
          ("train", "deploy_min_trade_t"): 0.0}


def with_legacy_fields(d: dict) -> dict:
    """A saved config dict (a run's config.json) with LEGACY's values for the fields its sections lack. A section
    the dict lacks altogether takes the preset's (from_dict's rule), LEGACY not applied. `--config` with an old
    run's config.json goes through `resolve`, not here: it runs with today's defaults (TF32 padded)."""
    out = dict(d)
    for (section, key), value in LEGACY.items():
        if isinstance(out.get(section), dict) and key not in out[section]:
            out[section] = {**out[section], key: value}
    return out


def behaviour_fields(d: dict) -> dict:
    """A config dict with its automatic values resolved, for comparing what two configs do (numbarl ab):
    agent.head_pad 0 becomes the multiple it means (AgentConfig.head_pad_multiple: fp32's 0 is agent.head_pad_fp32,
    1 in a run saved before that field; agent.head_pad_fp32 itself then leaves the dict, since it acts only through
    head_pad), and agent.head_fuse_value what runs (AgentConfig.fuse_value: false on an unpadded head). agent.overlap
    leaves it too: it changes which streams run the train step's kernels, not one bit of what they compute."""
    agent = d.get("agent")
    if not isinstance(agent, dict) or "head_pad" not in agent:
        return d
    pad = head_pad_multiple(agent["head_pad"], agent.get("compute", "fp32"), agent.get("kind", "c51"),
                            agent.get("head_pad_fp32", LEGACY[("agent", "head_pad_fp32")]))
    out = {k: v for k, v in agent.items() if k not in ("head_pad_fp32", "overlap")}  # head_pad_fp32: via head_pad
    out["head_pad"] = pad
    if "head_fuse_value" in agent:
        out["head_fuse_value"] = value_fused(agent["head_fuse_value"], pad)
    return {**d, "agent": out}


def saved_as_ran(d: dict) -> dict:
    """A run's saved config (config.json) as the run ran it, for comparisons: LEGACY fields, automatic values."""
    return behaviour_fields(with_legacy_fields(d))


def _apply_section(section_name: str, obj, updates: dict):
    names = {f.name: f for f in fields(obj)}
    changes = {}
    for key, raw in updates.items():
        new = RENAMED.get((section_name, key))
        if new is not None:
            if new in updates and updates[new] != raw:
                raise ConfigError(f"{section_name}.{key} (the old name of {section_name}.{new}) = {raw!r} "
                                  f"contradicts {section_name}.{new} = {updates[new]!r}; give one of them")
            key = new
        if key not in names:
            raise ConfigError(f"unknown config field {section_name}.{key}; known: {sorted(names)}")
        changes[key] = _coerce(section_name, names[key], getattr(obj, key), raw)
    try:
        return replace(obj, **changes)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # a section's own validation (EnvParams.__post_init__)
        raise ConfigError(f"{section_name}: {e}") from None


SECTIONS = ("data", "env", "agent", "train")


def apply(cfg: Config, updates: dict[str, Any]) -> Config:
    """Apply nested {section: {field: value}} or dotted {"section.field": value} updates. A
    top-level "preset" (config files, a run's config.json) is chosen by :func:`resolve`, not here."""
    nested: dict[str, dict] = {}
    for key, value in updates.items():
        if key == "preset":
            continue
        if isinstance(value, dict) and "." not in key:
            nested.setdefault(key, {}).update(value)
        elif "." not in key and key in ("data", "env", "agent", "train"):
            raise ConfigError(f"config section {key!r} must be a table of fields (e.g. {{\"lr\": 3e-4}}), got {value!r}")
        else:
            section, _, name = key.partition(".")
            if not name:
                raise ConfigError(f"config key {key!r} must look like section.field (e.g. agent.lr)")
            nested.setdefault(section, {})[name] = value
    sections = {"data", "env", "agent", "train"}
    out = cfg
    for section, vals in nested.items():
        if section not in sections:
            raise ConfigError(f"unknown config section {section!r}; known: {sorted(sections)}")
        out = replace(out, **{section: _apply_section(section, getattr(out, section), vals)})
    return out


def parse_sets(pairs) -> dict[str, str]:
    out = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"--set {pair!r} must look like section.field=value (e.g. agent.lr=3e-4)")
        out[key.strip()] = value.strip()
    return out


def load_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):  # no YAML library is a dependency of numbarl
        raise ConfigError(f"config file {path}: YAML is not supported; write the config as TOML (.toml) or "
                          "JSON (.json): `numbarl-train --print-config` prints one, examples/config.toml is a sample")
    if suffix not in (".toml", ".json"):
        raise ConfigError(f"config file {path}: unknown format {suffix or '(no extension)'!r}; "
                          "use a .toml or .json file (examples/config.toml is a sample)")
    try:
        text = path.read_text()
        if suffix == ".toml":
            import tomllib

            loaded = tomllib.loads(text)
        else:
            loaded = json.loads(text)
    except Exception as e:  # noqa: BLE001 - report any parse/read error the same way
        raise ConfigError(f"config file {path} could not be parsed: {e}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a table of sections (data, env, agent, train), "
                          f"got a {type(loaded).__name__}")
    if "preset" in loaded and not isinstance(loaded["preset"], str):
        raise ConfigError(f"config file {path}: preset = {loaded['preset']!r} must be a preset name, "
                          f"one of {list(PRESETS)}")
    return loaded


def from_dict(d: dict) -> Config:
    """Rebuild a Config saved with to_dict() (a run's config.json).

    A section the file holds was saved in full, so a field it lacks was added to numbarl after the run was
    saved: it takes its dataclass default (what the code that wrote the run did: new fields default to off),
    not the preset's current value. E.g. a default-preset run saved before env.pnl_reward_scale existed
    resumes with its own reward (trade + micro terms), not with the preset's mark-to-market term added. A field
    whose default is not its old behaviour takes its LEGACY value instead (agent.head_pad: 1, unpadded;
    agent.head_fuse_value: false; agent.head_pad_fp32: 1; train.deploy_min_trade_t: 0, every fold deployed)."""
    d = with_legacy_fields(d)
    name = d.get("preset", "default")
    base = preset(name)
    saved = {k: v for k, v in d.items() if k in SECTIONS}
    base = replace(base, **{k: type(getattr(base, k))() for k in saved})
    return replace(apply(base, saved), preset=name).validate()


def resolve(preset_name: str | None = None, config_file: str | None = None, sets=(), default_preset: str = "default",
            **direct) -> Config:
    """Preset → config file → --set overrides → direct CLI options (seed, epochs, folds ...).

    The preset is `preset_name` (--preset) when given, else the config file's ``preset`` key, else
    `default_preset` (the CLI's: 'default' on a GPU, 'tiny' on the simulator)."""
    loaded = load_file(config_file) if config_file else {}
    name = preset_name or loaded.get("preset") or default_preset
    cfg = replace(preset(name), preset=name)
    try:
        cfg = apply(cfg, loaded)
    except ConfigError as e:  # name the file the bad value came from
        raise ConfigError(f"config file {config_file}: {e}") from None
    given = parse_sets(sets)
    cfg = apply(cfg, given)
    cfg = apply(cfg, {k: v for k, v in direct.items() if v is not None})
    cfg = cfg.validate()
    # a switch the user turns on that does nothing in this config: one clear error, not a silent no-op (the default
    # and a config file's full dump may hold true on an unpadded head, where it means "fuse when padded")
    if "agent.head_fuse_value" in given and cfg.agent.head_fuse_value and not cfg.agent.fuse_value:
        what = f"--set agent.head_fuse_value={given['agent.head_fuse_value']}"
        if cfg.agent.kind != "c51":
            raise ConfigError(f"{what}: agent.kind = {cfg.agent.kind!r} has no C51 head, so there is no value stream "
                              "to fuse; drop the option")
        auto = cfg.agent.head_pad == 0  # fp32's automatic padding set to none (agent.head_pad_fp32 = 1)
        fix = "set agent.head_pad above 1" + (" (or agent.head_pad_fp32 above 1)" if auto else "")
        raise ConfigError(f"{what}: the value stream fuses into a padded head only, and agent.head_pad = "
                          f"{cfg.agent.head_pad} with agent.compute = {cfg.agent.compute!r} is unpadded; {fix}")
    return cfg


# ---------------------------------------------------------------------------------------------
# the resolved config as TOML (--print-config; loads back with --config)
# ---------------------------------------------------------------------------------------------
def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's


def to_toml(cfg: Config) -> str:
    """`cfg` as a TOML config file that `--config` loads back to the same config: the preset, then
    every field of every section with its docstring's first line as a comment. TOML has no null:
    a field left at None ("use the data's") is written commented out."""
    lines = ["# numbarl config (numbarl-train --print-config); load with numbarl-train --config FILE",
             f"preset = {_toml_value(cfg.preset)}"]
    docs = _field_docs()
    for section in SECTIONS:
        obj = getattr(cfg, section)
        lines += ["", f"[{section}]"]
        for f in fields(obj):
            value = getattr(obj, f.name)
            doc = docs.get((type(obj).__name__, f.name))
            if doc:
                lines.append(f"# {doc}")
            if value is None:
                lines.append(f"# {f.name} =  (unset: None)")
            else:
                lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _field_docs() -> dict:
    """{(class name, field): first line of the docstring under the field} from the sources."""
    import ast
    import inspect

    from numbarl.env import params as env_params

    out = {}
    for cls in (DataConfig, AgentConfig, TrainConfig, env_params.EnvParams):
        try:
            tree = ast.parse(inspect.getsource(cls))
        except (OSError, TypeError, SyntaxError):  # no source (a frozen install): no comments
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(getattr(nxt, "value", None), ast.Constant) and isinstance(nxt.value.value, str)):
                out[(cls.__name__, node.target.id)] = nxt.value.value.strip().splitlines()[0]
    return out
