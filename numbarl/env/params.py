"""Environment parameters, action encoding and the scalar constants the step functions read.

`EnvParams` is the one place every coefficient of the trading environment lives (SPEC §4): costs,
the action grids, the reward coefficients, the episode rules. It is a frozen dataclass validated
on construction; `step_consts()` turns it into `StepConsts`, a namedtuple of float64/int64
scalars that the shared `@njit` step functions (numbarl/env/core.py) and the numba.cuda kernels
take as one argument (namedtuples are passed by value to kernels and frozen into captured graphs,
which is right: parameters do not change during a run).

Actions are plans chosen per branch (branching dueling heads):

    branch 0  direction  {0: short, 1: flat, 2: long}
    branch 1  size       index into `sizes`   (contracts: whole multiples of `size_step`)
    branch 2  target     index into `targets` (units of recent volatility, 0 = no target)
    branch 3  stop       index into `stops`   (units of recent volatility, 0 = no stop)

Q arrays are [n, N_BRANCHES, max_actions]; entries beyond a branch's size are ignored.

Fill rule (numbarl/env/core.py, step 2): the decision is made at bar t's close from features up
to t; with `latency_bars = L` the order fills at bar t+L's close quote (buys at the ask, sells at
the bid, plus `slippage_ticks`), paying `fee_per_contract` per contract per side. L = 0, the
default, fills at the deciding bar's own close quote (zero latency): an optimistic assumption on
fast bars, so `EnvParams.fill_assumption()` states it in one line wherever results are shown.
Targets and stops fill on a later bar at their level, half a spread and the slippage worse.

Sizes are whole contracts by default (size_step = 1: futures trade whole contracts, and a
fractional default would also pay fractional fees); the default grid (1, 2, 4) keeps the ratios
size / max size = 1/4, 1/2, 1 of the earlier (0.25, 0.5, 1.0), so the observation's position
feature and the conviction scaling see the same fractions. An instrument that trades fractions
(a crypto pair, size_step = 0.001) declares its own step.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np

# action branches and direction codes ---------------------------------------------------------
N_BRANCHES = 4
BR_DIRECTION, BR_SIZE, BR_TARGET, BR_STOP = 0, 1, 2, 3
BRANCH_NAMES = ("direction", "size", "target", "stop")
DIR_SHORT, DIR_FLAT, DIR_LONG = 0, 1, 2
N_DIRECTIONS = 3
MAX_GRID = 32  # longest size/target/stop grid (keeps per-thread loops short and Q rows small)

# exit reasons (trade list `exit_reason`, env `exit_reason` output) -------------------------------
EXIT_NONE, EXIT_CLOSE, EXIT_TARGET, EXIT_STOP, EXIT_CAP, EXIT_END = 0, 1, 2, 3, 4, 5
EXIT_REASONS = ("none", "close", "target", "stop", "cap", "end")

# portfolio part of the observation (appended to the F market features) -----------------------
PORTFOLIO_FEATURES = (
    "position",  # signed position / max(sizes)
    "unrealized_vol",  # (mid - entry price) * side / volatility unit
    "bars_in_trade",  # bars held / obs_hold_bars
    "target_distance",  # (target level - mid) * side / volatility unit, 0 without a target
    "stop_distance",  # (mid - stop level) * side / volatility unit, 0 without a stop
    "order_pending",  # 1 while a delayed order waits for its fill bar
    "kelly_fraction",  # p - (1 - p) / b from this env's closed trades, clipped to [-1, 1]
    "churn_pressure",  # 1 - bars since last entry / churn threshold, clipped to [0, 1]
)
PORTFOLIO_DIM = len(PORTFOLIO_FEATURES)

NO_BAR = -(2**30)  # "never": last-entry bar before any entry


SIZE_STEP_RTOL = 1e-9  # a size is a whole multiple of size_step when |s/step - round(s/step)| <= this


class StepConsts(NamedTuple):
    """EnvParams resolved to scalars for the step functions (float64 / int64 only)."""

    fee: np.float64  # currency per contract per side
    slippage: np.float64  # extra price units paid per side beyond the quote
    multiplier: np.float64  # currency per price unit per contract
    tick_value: np.float64  # tick_size * multiplier: currency of one tick on one contract
    trade_scale: np.float64
    micro_scale: np.float64
    pnl_scale: np.float64  # mark-to-market net P&L reward (0: off, the reward's sum as without the term)
    hold_rate: np.float64
    churn_bars: np.float64
    churn_scale: np.float64
    opp_scale: np.float64
    conviction_weight: np.float64
    max_size: np.float64
    dsr_eta: np.float64
    dsr_scale: np.float64  # the DSR term's weight, times the step's risk budget ρ (not a constant: not here)
    dsr_warmup: np.int64  # D = 0 for a trade closed before the env's DSR EMAs hold this many trades
    obs_hold_bars: np.float64
    kelly_lambda: np.float64  # fractional-Kelly multiplier of the size cap (0: no cap, the step is unchanged)
    kelly_floor: np.float64  # smallest cap as a fraction of max_size (no history or no edge)
    size_step: np.float64  # lot size: the Kelly cap is rounded down to whole lots
    min_size: np.float64  # smallest size of the grid: the Kelly cap never goes below it
    episode_length: np.int64  # 0: no episodes (backtest)
    hard_cap: np.int64  # 0: no cap (backtest)
    latency_bars: np.int64  # an order decided at bar t's close fills at bar t + latency_bars's close
    direction_lock: np.int64


def _fail(field: str, value, allowed: str):
    raise ValueError(f"EnvParams.{field} = {value!r} is invalid: allowed {allowed}")


def _check_grid(name: str, grid, positive: bool):
    if not isinstance(grid, tuple) or len(grid) == 0:
        _fail(name, grid, f"a non-empty tuple of at most {MAX_GRID} numbers")
    if len(grid) > MAX_GRID:
        _fail(name, grid, f"at most {MAX_GRID} entries")
    for v in grid:
        if not isinstance(v, (int, float)) or not math.isfinite(v) or (v <= 0 if positive else v < 0):
            _fail(name, grid, "finite numbers " + ("> 0" if positive else ">= 0 (0 = none)"))
    if len(set(grid)) != len(grid):
        _fail(name, grid, "distinct values")


@dataclass(frozen=True)
class EnvParams:
    """Every coefficient of the trading environment and backtest (SPEC §4)."""

    # --- action grids ---
    sizes: tuple = (1.0, 2.0, 4.0)
    """Position sizes in contracts, one per action of the size branch (all > 0, whole multiples
    of size_step: whole contracts by default)."""
    targets: tuple = (0.0, 1.0, 2.0, 4.0)
    """Profit-target distances in volatility units; 0.0 means no target."""
    stops: tuple = (0.0, 1.0, 2.0, 4.0)
    """Stop-loss distances in volatility units; 0.0 means no stop."""

    # --- volatility unit (target/stop distances and observation scaling) ---
    vol_span: int = 100
    """EWMA span in bars of the causal per-bar volatility of the mid (computed at upload)."""
    vol_horizon_bars: int = 10
    """The volatility unit is the per-bar std of mid changes times sqrt(vol_horizon_bars)."""

    # --- execution and costs ---
    tick_size: float | None = None
    """Price increment; None takes MarketData.tick_size (the fxcache meta value)."""
    contract_multiplier: float = 50.0
    """Currency per price unit per contract (default 50: CME E-mini S&P 500, the market the
    synthetic data imitates; with 1.0 a $1 fee would cost 4 ticks per side and swamp any edge)."""
    fee_per_contract: float = 1.0
    """Fee in currency per contract per side (paid at entry and at exit)."""
    slippage_ticks: float = 0.0
    """Extra ticks paid per side on top of crossing the spread at the close quote."""
    size_step: float = 1.0
    """The instrument's lot size in contracts: every entry of sizes must be a whole multiple of it
    (1.0: whole contracts, as futures trade; e.g. 0.001 for an instrument that trades fractions)."""
    latency_bars: int = 0
    """Bars between a decision and its fill: decided at bar t's close, filled at bar t+latency_bars's
    close quote (0 = the deciding bar's own close quote: zero latency). Formerly `fill_delay`."""
    direction_lock: bool = True
    """Mid-plan the direction is locked: the opposite direction closes instead of reversing."""
    initial_capital: float = 100_000.0
    """Starting equity in currency; returns and drawdowns are relative to it."""

    # --- reward (each term in numbarl/env/core.py; money terms in ticks x contracts) ---
    trade_reward_scale: float = 0.01
    """Reward per tick-contract of net trade P&L, paid when the trade closes."""
    micro_reward_scale: float = 100.0
    """Micro-reward: scale * position * next-bar simple return of the mid."""
    pnl_reward_scale: float = 0.0
    """Mark-to-market reward: scale * the step's net P&L (realized + unrealized change, fees and the spread paid
    at fills included) per tick-contract; over a trade it sums to the trade's net P&L x scale / tick value.
    0 = off. With the trade and micro terms off it is a dense reward that prices costs as net P&L does (the
    default pair pays the mid's move twice, once without costs: bin/reward-align)."""
    holding_cost_rate: float = 1e-4
    """Holding cost per contract held per bar."""
    churn_threshold_bars: int = 20
    """An entry within this many bars of the previous entry pays the churn penalty (0 = off)."""
    churn_penalty_scale: float = 0.01
    """Churn penalty at zero bars since the previous entry (decays linearly to 0 at the threshold)."""
    opportunity_cost_scale: float = 0.001
    """Opportunity cost while flat: scale * |preference| (the agent's per-env input; always 0 in the backtest)."""
    conviction_weight: float = 0.0
    """Plan-conviction scaling weight w: reward *= 1 + w * (plan size / max size - 1); 0 = off."""
    dsr_eta: float = 0.01
    """Adaptation rate of the differential-Sharpe EMAs A and B (updated per closed trade)."""
    dsr_reward_scale: float = 0.0
    """Weight of the trade-level differential Sharpe ratio term (Moody & Saffell 2001); 0 = off.
    The term is multiplied by the step's risk budget ρ (numbarl/env/core.py; 1 without agent.iqn)."""
    dsr_warmup_trades: int = 100
    """The DSR term is 0 for an env's closed trade until its EMAs already hold this many trades (they
    still learn from every trade). With few trades the EMA variance B − A² is about η·r₁² and D runs to
    thousands (sixteenth session: a fitted support of ±570 at dsr_reward_scale 0.01); 100 = 1/dsr_eta at
    its default. 0 = from the second trade, Moody & Saffell's plain rule."""

    # --- sizing ---
    kelly_lambda: float = 0.0
    """Fractional-Kelly size cap at order time (Kelly 1956; Thorp 2006): an opening order's size
    becomes min(size, max_size x clip(kelly_lambda x f*, kelly_floor, 1)), rounded down to whole
    lots and never below min(sizes), with f* = p - (1 - p) / b from the env's own closed trades
    (the `kelly_fraction` observation). 0 = off (the default: sizes are the size branch's);
    0.5 = half Kelly. The clipped fraction is loosened by the step's risk budget ρ to
    1 − ρ (1 − fraction) (numbarl/env/core.py; ρ = 1 without agent.iqn: unchanged)."""
    kelly_floor: float = 0.25
    """The Kelly cap's lower bound as a fraction of max size: the cap while f* <= 0 or before the env
    has both a win and a loss (so an env without history still trades)."""

    # --- episodes ---
    episode_length: int = 5000
    """Bars after which done is raised, but only once the env is flat (position-gated)."""
    max_episode_bars: int = 10000
    """Hard cap: at this many bars the position is force-closed and done is raised."""
    obs_hold_bars: float = 100.0
    """Bars in trade are divided by this in the observation."""

    def __post_init__(self):
        for name in ("sizes", "targets", "stops"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        _check_grid("sizes", self.sizes, positive=True)
        _check_grid("targets", self.targets, positive=False)
        _check_grid("stops", self.stops, positive=False)
        ints = {
            "vol_span": (1, 10**7),
            "vol_horizon_bars": (1, 10**6),
            "latency_bars": (0, 10**4),
            "churn_threshold_bars": (0, 10**7),
            "dsr_warmup_trades": (0, 2**30),
            "episode_length": (1, 2**30),
            "max_episode_bars": (1, 2**30),
        }
        for name, (lo, hi) in ints.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
                _fail(name, v, f"an integer in [{lo}, {hi}]")
        if self.max_episode_bars < self.episode_length:
            _fail("max_episode_bars", self.max_episode_bars, f">= episode_length ({self.episode_length})")
        nonneg = (
            "fee_per_contract",
            "slippage_ticks",
            "trade_reward_scale",
            "micro_reward_scale",
            "pnl_reward_scale",
            "holding_cost_rate",
            "churn_penalty_scale",
            "opportunity_cost_scale",
            "dsr_reward_scale",
        )
        for name in nonneg:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                _fail(name, v, "a finite number >= 0")
        for name in ("contract_multiplier", "initial_capital", "obs_hold_bars"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                _fail(name, v, "a finite number > 0")
        if isinstance(self.size_step, bool) or not isinstance(self.size_step, (int, float)) or not (
            math.isfinite(self.size_step) and self.size_step > 0
        ):
            _fail("size_step", self.size_step, "a finite number > 0 (the instrument's lot size in contracts)")
        for size in self.sizes:
            lots = size / self.size_step
            if abs(lots - round(lots)) > SIZE_STEP_RTOL * max(1.0, abs(lots)):
                raise ValueError(
                    f"EnvParams.sizes = {self.sizes!r} is invalid: {size!r} is not a whole multiple of size_step = "
                    f"{self.size_step!r} (futures trade whole contracts: use sizes such as (1, 2, 4), or set "
                    f"env.size_step to the lot size of an instrument that trades fractions)"
                )
        if self.tick_size is not None and (
            not isinstance(self.tick_size, (int, float)) or not math.isfinite(self.tick_size) or self.tick_size <= 0
        ):
            _fail("tick_size", self.tick_size, "None (use the data's) or a finite number > 0")
        if not isinstance(self.conviction_weight, (int, float)) or not 0.0 <= self.conviction_weight <= 1.0:
            _fail("conviction_weight", self.conviction_weight, "a number in [0, 1]")
        if not isinstance(self.dsr_eta, (int, float)) or not 0.0 < self.dsr_eta < 1.0:
            _fail("dsr_eta", self.dsr_eta, "a number in (0, 1)")
        v = self.kelly_lambda
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            _fail("kelly_lambda", v, "a finite number >= 0 (0 = no Kelly size cap; 0.5 = half Kelly)")
        v = self.kelly_floor
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0.0 <= v <= 1.0):
            _fail("kelly_floor", v, "a number in [0, 1] (the Kelly cap's lower bound as a fraction of max size)")
        if not isinstance(self.direction_lock, (bool, np.bool_)):
            _fail("direction_lock", self.direction_lock, "True or False")

    # --- derived sizes (one place) ---
    @property
    def branch_sizes(self) -> tuple[int, int, int, int]:
        """Actions per branch: (direction 3, len(sizes), len(targets), len(stops))."""
        return (N_DIRECTIONS, len(self.sizes), len(self.targets), len(self.stops))

    @property
    def n_branches(self) -> int:
        return N_BRANCHES

    @property
    def max_actions(self) -> int:
        """Width of the last axis of Q arrays: the largest branch."""
        return max(self.branch_sizes)

    @property
    def max_size(self) -> float:
        return float(max(self.sizes))

    def state_dim(self, n_features: int) -> int:
        """Observation width: market features + PORTFOLIO_DIM portfolio features."""
        return int(n_features) + PORTFOLIO_DIM

    def grids(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sizes, targets, stops) as float32 arrays: the values every backend uses."""
        return (
            np.asarray(self.sizes, np.float32),
            np.asarray(self.targets, np.float32),
            np.asarray(self.stops, np.float32),
        )

    @property
    def fill_delay(self) -> int:
        """The former name of latency_bars (still accepted by the constructor and replace())."""
        return self.latency_bars

    def fill_assumption(self) -> str:
        """The execution assumption in one line, for reports and summaries."""
        if self.latency_bars == 0:
            when = "fills at the deciding bar's own close quote (zero latency)"
        else:
            bars = "bar" if self.latency_bars == 1 else "bars"
            when = (f"fills {self.latency_bars} {bars} after the decision at that bar's close quote "
                    f"(decided at bar t's close, filled at bar t+{self.latency_bars}'s)")
        slip = f" + {self.slippage_ticks:g} tick slippage" if self.slippage_ticks else ""
        lots = "whole contracts" if self.size_step == 1.0 else f"size step {self.size_step:g} contracts"
        if self.kelly_lambda > 0:
            lots += f", capped at {self.kelly_lambda:g} x Kelly of max size (floor {self.kelly_floor:g})"
        return (f"{when}, crossing the spread{slip}; fee {self.fee_per_contract:g} per contract per side; "
                f"{lots}; targets/stops at their level, half a spread worse")

    def resolved_tick_size(self, data_tick_size: float) -> float:
        return float(self.tick_size) if self.tick_size is not None else float(data_tick_size)

    def step_consts(self, tick_size: float, backtest: bool = False) -> StepConsts:
        """Scalars for the step functions. backtest=True: no episodes, no opportunity cost."""
        tick = self.resolved_tick_size(tick_size)
        if not math.isfinite(tick) or tick <= 0:
            raise ValueError(f"tick size {tick!r} is invalid: allowed a finite number > 0")
        return StepConsts(
            fee=np.float64(self.fee_per_contract),
            slippage=np.float64(self.slippage_ticks * tick),
            multiplier=np.float64(self.contract_multiplier),
            tick_value=np.float64(tick * self.contract_multiplier),
            trade_scale=np.float64(self.trade_reward_scale),
            micro_scale=np.float64(self.micro_reward_scale),
            pnl_scale=np.float64(self.pnl_reward_scale),
            hold_rate=np.float64(self.holding_cost_rate),
            churn_bars=np.float64(self.churn_threshold_bars),
            churn_scale=np.float64(self.churn_penalty_scale),
            opp_scale=np.float64(0.0 if backtest else self.opportunity_cost_scale),
            conviction_weight=np.float64(self.conviction_weight),
            max_size=np.float64(np.float32(self.max_size)),
            dsr_eta=np.float64(self.dsr_eta),
            dsr_scale=np.float64(self.dsr_reward_scale),
            dsr_warmup=np.int64(self.dsr_warmup_trades),
            obs_hold_bars=np.float64(self.obs_hold_bars),
            kelly_lambda=np.float64(self.kelly_lambda),
            kelly_floor=np.float64(self.kelly_floor),
            size_step=np.float64(self.size_step),
            min_size=np.float64(np.float32(min(self.sizes))),
            episode_length=np.int64(0 if backtest else self.episode_length),
            hard_cap=np.int64(0 if backtest else self.max_episode_bars),
            latency_bars=np.int64(self.latency_bars),
            direction_lock=np.int64(1 if self.direction_lock else 0),
        )

    def replace(self, **changes) -> "EnvParams":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        changes = _latency_alias(changes)
        unknown = set(changes) - set(values)
        if unknown:
            raise ValueError(f"EnvParams has no field(s) {sorted(unknown)}; fields: {sorted(values)}")
        values.update(changes)
        return EnvParams(**values)


def _latency_alias(kwargs: dict) -> dict:
    """`fill_delay=` (the former name) -> `latency_bars=`; both given and different is an error."""
    if "fill_delay" not in kwargs:
        return kwargs
    kwargs = dict(kwargs)
    delay = kwargs.pop("fill_delay")
    if "latency_bars" in kwargs and kwargs["latency_bars"] != delay:
        raise ValueError(f"EnvParams: fill_delay = {delay!r} and latency_bars = {kwargs['latency_bars']!r} disagree; "
                         f"fill_delay is the former name of latency_bars: pass latency_bars only")
    kwargs["latency_bars"] = delay
    return kwargs


_dataclass_init = EnvParams.__init__


def _init_accepting_fill_delay(self, *args, **kwargs):
    _dataclass_init(self, *args, **_latency_alias(kwargs))


_init_accepting_fill_delay.__doc__ = _dataclass_init.__doc__
_init_accepting_fill_delay.__signature__ = inspect.signature(_dataclass_init)
EnvParams.__init__ = _init_accepting_fill_delay


def pack_action(direction: int, size: int, target: int, stop: int) -> int:
    """Four branch indices in one int32 (8 bits each): compact action arrays for the backtest."""
    return int(direction) | (int(size) << 8) | (int(target) << 16) | (int(stop) << 24)


def pack_actions(actions: np.ndarray) -> np.ndarray:
    """[..., 4] branch indices -> [...] packed int32."""
    a = np.asarray(actions, dtype=np.int64)
    return (a[..., 0] | (a[..., 1] << 8) | (a[..., 2] << 16) | (a[..., 3] << 24)).astype(np.int32)


def validate_actions(actions: np.ndarray, params: EnvParams) -> np.ndarray:
    """Check a [..., 4] array of branch indices against the grids; returns it as int32."""
    a = np.asarray(actions)
    if a.ndim < 1 or a.shape[-1] != N_BRANCHES:
        raise ValueError(f"actions must have a last axis of {N_BRANCHES} branch indices, got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"actions must be integer branch indices, got dtype {a.dtype}")
    for b, n in enumerate(params.branch_sizes):
        col = a[..., b]
        if col.size and (col.min() < 0 or col.max() >= n):
            bad = col[(col < 0) | (col >= n)][0]
            raise ValueError(f"actions[..., {b}] ({BRANCH_NAMES[b]}) has index {int(bad)}; allowed 0..{n - 1}")
    return a.astype(np.int32)
