"""Device trading environment, backtest, metrics and the CPU reference env (SPEC §4).

    from numbarl.env import EnvParams, MarketData, DeviceEnv, compute_metrics
    from numbarl.env.backtest import backtest      # (the name `backtest` alone is the module)

Modules: params (EnvParams, action encoding), market (MarketData, causal volatility, upload),
core (the step function and every reward term, shared by all backends), device (DeviceEnv and
its kernels), backtest (DeviceBacktest, backtest), metrics, reference (CpuEnv), gym (TradingEnv).

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
