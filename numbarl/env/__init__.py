"""Device trading environment, backtest, metrics and the CPU reference env (SPEC §4).

    from numbarl.env import EnvParams, MarketData, DeviceEnv, compute_metrics
    from numbarl.env.backtest import backtest      # (the name `backtest` alone is the module)

Modules: params (EnvParams, action encoding), market (MarketData, causal volatility, upload),
core (the step function, every reward term and the action mask, shared by all backends), device
(DeviceEnv and its kernels), backtest (DeviceBacktest, backtest), metrics, reference (CpuEnv),
gym (TradingEnv).

The env boundary (what crosses it is data; rules stay on their side)
--------------------------------------------------------------------
For N envs at their cursors c_i (the close of bar c_i), one step is:

    env.gather  -> obs  float32 [N, F + PORTFOLIO_DIM]    the observation
                   mask uint8   [N, 4, max_actions]        the actions available now
    learner     -> actions    int32   [N, 4]               one index per branch, mask[i, b, a] = 1
                   preference float32 [N]                  the agent's edge of long over short
                   risk_budget float32 [1]                 ρ, all envs (optional; default 1)
    env.step    -> reward, done, P&L, next obs and mask    (numbarl.env.device.Transition)

obs: columns 0..F-1 are the market features of bar c_i (causal: built from data up to its close),
then PORTFOLIO_FEATURES (params.py) of env i: signed position / max size, unrealized P&L in
volatility units, bars in trade, target and stop distances, order pending, Kelly fraction, churn
pressure.

actions: branches (params.BR_*) direction {short, flat, long} (params.DIR_*), size index into
params.sizes, target and stop indices into params.targets / params.stops (0 = none);
max_actions = the largest branch. A direction that keeps the position (the same side, or flat
while flat) places no order.

mask: mask[i, b, a] = 1 when action a of branch b is available to env i, 0 otherwise. Actions
beyond a branch's size are 0. With the direction lock (EnvParams.direction_lock) the direction
opposite to an open position is 0 (mid-plan the agent may hold or close, not reverse); nothing
else is masked. The env applies its rules once, here (rows.mask_row, written by the gather
kernel); policies (numbarl.rl.policies) choose among the allowed actions, exploration included,
and a learner that needs the actions available at a next state reads that state's mask (the
replay stores it with the observation) instead of re-deriving the rule.

preference: per env, the agent's preference of long over short, read only by the
opportunity-cost term while flat (scale x |preference|, EnvParams.opportunity_cost_scale; the
backtest sets it to 0). A C51 agent writes Q(direction = long) - Q(direction = short).

risk_budget: the exploration risk budget ρ ∈ [0, 1] of every env (R18; core.py's docstring): the
Kelly cap fraction becomes 1 − ρ (1 − frac) and the DSR reward term ρ times itself; ρ = 1 (the
env's own ones array, DeviceEnv.step's default; CpuEnv's; the backtests') is the step without it.
The C51 agent with agent.iqn writes its IQN readiness² on the device before each step.

Randomness: the env's RNG key is (seed_dev, counter): the counter advances once per collect step
(DeviceEnv.advance); a learner-side policy may key its own draws with it, on its own slots of
numbarl.cuda.registry.RNG_STREAMS.

Names are imported lazily: importing numbarl.env does not import numba, so the CUDA backend can
still be chosen (numbarl.cuda.backend.select) after this import.
"""

from importlib import import_module

_EXPORTS = {
    "EnvParams": "params",
    "StepConsts": "params",
    "PORTFOLIO_DIM": "params",
    "PORTFOLIO_FEATURES": "params",
    "EXIT_REASONS": "params",
    "pack_actions": "params",
    "MarketData": "market",
    "DeviceMarket": "market",
    "causal_volatility": "market",
    "DeviceEnv": "device",
    "Transition": "device",
    "upload": "device",
    "DeviceBacktest": "backtest",
    "BacktestResult": "backtest",
    "backtest_reference": "backtest",
    "Metrics": "metrics",
    "METRIC_NAMES": "metrics",
    "compute_metrics": "metrics",
    "CpuEnv": "reference",
    "TradingEnv": "gym",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'numbarl.env' has no attribute {name!r}")
    value = getattr(import_module(f"numbarl.env.{module}"), name)
    globals()[name] = value
    return value
