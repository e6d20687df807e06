"""Training-path telemetry: the training envs' own realized results, read once per epoch.

The validation backtest says how the greedy policy trades a held-out window; this module says how
the envs that produce the training data actually traded and which reward terms carried signal, so
that a run shows whether training and validation agree (the goal: training-path Sharpe within 2x
of the validation Sharpe) and whether a reward term is all noise.

Device side (inside the captured collect step, nothing else in the graph changes): the env's step
kernel (numbarl/env/device.py) runs ``telemetry_step_row``: the training env step
(rows.env_step_row, unchanged: every output bit is the same) followed by ``accumulate_row``, which
adds env i's step to ITS OWN column of a float64 accumulator ``acc [N_TEL, N]`` (no atomics, one
writer per slot, each slot a sum in step order, so it is deterministic):

    T_BAR_N, T_BAR_SUM, T_BAR_SUMSQ            bars stepped; sum and sum of squares of the bar P&L
    T_TRADE_N, T_TRADE_WINS                    trades closed; those with net P&L > 0 (metrics' win)
    T_TRADE_SUM, T_TRADE_SUMSQ                 sum and sum of squares of their net P&L
    term_sum(j), term_sumsq(j)                 for each reward term TERMS[j]: sum and sum of
                                               squares of its contribution to the reward
    T_KELLY_ORDERS, T_KELLY_CAPPED,            the Kelly size cap (EnvParams.kelly_lambda > 0):
    T_KELLY_RATIO_SUM                          opening orders it sized, those it shrank, and the
                                               sum of capped / asked size (StepOut.kelly_ratio)

Money is in currency, as the backtest's metrics use it (bar P&L = change of realized + unrealized
P&L, trade P&L net of fees on both sides; core.py). A step can close two trades (an agent close at
bar c, then a stop/target/forced exit at bar n): each is counted.

The contribution of a reward term is what it adds to the reward: core.step_core computes
reward = (trade + micro [+ pnl] - holding - churn - opportunity + dsr) * conviction, so the contribution
of `holding` is -holding * conviction, of `micro` micro * conviction, and so on (costs come out
negative; pnl's is 0 while env.pnl_reward_scale is 0); the seven contributions sum to the reward (in float64, before its float32 store). The
terms come from the step's StepOut (r_trade ... r_dsr, conviction), the same values the reward
is summed from.

Host side, once per epoch: ``TrainPathTelemetry.read_and_reset`` copies the accumulators (one
synchronization, outside the graph), reduces them over envs with math.fsum (exactly rounded, so
independent of the order and of N's blocking: deterministic), turns them into the statistics of
``summarize`` and zeroes the accumulators with ``zero_kernel``. ``DeviceEnv.reset`` zeroes them too.

    from numbarl.env.telemetry import TrainPathTelemetry, epoch_record
    telemetry = TrainPathTelemetry(env, bars_per_day)
    ...                                               # an epoch of collect steps
    record = epoch_record(telemetry, stream)          # flat keys, None where undefined

What the figures are (``summarize``):

    train_path.sharpe       mean / std(ddof=1) of the bar P&L of every (env, step), annualized
                            like metrics.py's per-bar Sharpe: x sqrt(bars_per_day * 252). The
                            training path has no single equity curve (N envs, soft resets), so the
                            ratio is taken on bar P&L rather than on returns pnl / equity; the two
                            agree when the P&L is small beside the capital (metrics' r_t =
                            pnl_t / equity_{t-1} with a nearly constant equity).
    train_path.trade_sharpe mean / std(ddof=1) of trade P&L, not annualized (metrics' trade_sharpe)
    train_path.win_rate, train_path.avg_trade, train_path.n_trades, train_path.n_bars,
    train_path.pnl_mean, train_path.pnl_std (currency per env-bar)
    reward.<term>.mean, .std (ddof=1, over every env-step), .snr = mean / std
    train_path.kelly_capped_frac  the share of the opening orders the Kelly size cap sized that it
                            shrank (NaN with no such order: always with the cap off)
    train_path.kelly_size_ratio   their mean capped / asked size (NaN with no such order)

Undefined figures are NaN (None in ``epoch_record``): no bars or trades, fewer than 2, or a zero
std. A std is zero when it is at or below ZERO_STD_REL x the root mean square of the same series:
a variance from sums of squares loses about half the digits (measured: a constant series summed
10^7 times in float64 gives std / RMS up to 1.4e-5), so the threshold is 1e-4, and a term whose
|mean| / std exceeds 10^4 is a constant offset, not a signal.

The float64 reference: ``step_record_ref`` steps numpy state (CpuEnv's) with the same row function
and records every step's inputs to the accumulation (``record_row``); ``accumulate_reference``
folds a list of such records in numpy, in step order, to the accumulators the kernel must hold.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from numbarl.cuda.launch import device_function
from numbarl.cuda.runtime import cuda
from numbarl.cuda.runtime import stream as default_stream
from numbarl.env.metrics import TRADING_DAYS
from numbarl.env.params import EXIT_NONE
from numbarl.env.rows import env_step_row
from numbarl.env.state import row_jit

_cuda = cuda()

TERMS = ("trade", "micro", "holding", "churn", "opportunity", "dsr", "pnl")  # the reward's terms (core.py)
KEY_PREFIXES = ("train_path.", "reward.")  # the keys of epoch_record: the per-epoch train_path records

# accumulator rows: acc [N_TEL, N] float64, env i in column i
T_BAR_N, T_BAR_SUM, T_BAR_SUMSQ = 0, 1, 2
T_TRADE_N, T_TRADE_WINS, T_TRADE_SUM, T_TRADE_SUMSQ = 3, 4, 5, 6
T_TERM0 = 7  # term j: sum in row T_TERM0 + 2 j, sum of squares in row T_TERM0 + 2 j + 1
T_KELLY_ORDERS = T_TERM0 + 2 * len(TERMS)  # the Kelly size cap: orders it sized,
T_KELLY_CAPPED = T_KELLY_ORDERS + 1  # those it shrank,
T_KELLY_RATIO_SUM = T_KELLY_ORDERS + 2  # sum of capped / asked size
N_TEL = T_KELLY_ORDERS + 3

# rows of one step's record (reference only): rec [N_REC, N] float64
R_BAR_PNL, R_T1_CLOSED, R_T1_PNL, R_T2_CLOSED, R_T2_PNL = 0, 1, 2, 3, 4
R_TERM0 = 5  # contribution of term j in row R_TERM0 + j
R_KELLY_RATIO = R_TERM0 + len(TERMS)  # StepOut.kelly_ratio (0: no order sized by the Kelly cap)
N_REC = R_KELLY_RATIO + 1

ZERO_STD_REL = 1e-4  # std <= this x RMS of the same series is rounding of the sums: zero variance
BLOCK = 128

_F0 = np.float64(0.0)
_F1 = np.float64(1.0)


def term_sum(j: int) -> int:
    """Accumulator row of the sum of reward term TERMS[j]."""
    return T_TERM0 + 2 * j


def term_sumsq(j: int) -> int:
    """Accumulator row of the sum of squares of reward term TERMS[j]."""
    return T_TERM0 + 2 * j + 1


# ---------------------------------------------------------------------------------------------
# row functions (kernel and CPU reference share them)
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def reward_contributions(o):
    """The seven reward terms of a StepOut as signed contributions to the reward, TERMS order:
    reward = (sum of these) in float64 before its float32 store (pnl: 0 while its scale is 0)."""
    c = o.conviction
    return (
        o.r_trade * c,
        o.r_micro * c,
        -o.r_holding * c,
        -o.r_churn * c,
        -o.r_opportunity * c,
        o.r_dsr * c,
        o.r_pnl * c,
    )


@row_jit
def _add(acc, row, i, x):
    acc[row, i] += x
    acc[row + 1, i] += x * x


@row_jit
def _add_trade(acc, i, t):
    if t.reason == EXIT_NONE:
        return
    acc[T_TRADE_N, i] += _F1
    if t.pnl > _F0:
        acc[T_TRADE_WINS, i] += _F1
    _add(acc, T_TRADE_SUM, i, t.pnl)


@row_jit
def _add_kelly(acc, i, ratio):
    if ratio > _F0:  # an opening order sized by the Kelly cap
        acc[T_KELLY_ORDERS, i] += _F1
        if ratio < _F1:
            acc[T_KELLY_CAPPED, i] += _F1
        acc[T_KELLY_RATIO_SUM, i] += ratio


@row_jit
def accumulate_row(acc, i, o, t1, t2):
    """Add env i's step (StepOut o, closed trades t1, t2) to column i of acc [N_TEL, N]."""
    acc[T_BAR_N, i] += _F1
    _add(acc, T_BAR_SUM, i, o.bar_pnl)
    _add_trade(acc, i, t1)
    _add_trade(acc, i, t2)
    tr, mi, ho, ch, op, ds, pn = reward_contributions(o)
    _add(acc, T_TERM0, i, tr)
    _add(acc, T_TERM0 + 2, i, mi)
    _add(acc, T_TERM0 + 4, i, ho)
    _add(acc, T_TERM0 + 6, i, ch)
    _add(acc, T_TERM0 + 8, i, op)
    _add(acc, T_TERM0 + 10, i, ds)
    _add(acc, T_TERM0 + 12, i, pn)
    _add_kelly(acc, i, o.kelly_ratio)


@row_jit
def telemetry_step_row(st, i, actions, grids, mk, preference, risk_budget, k, lo, hi, seed, counter, out, acc):
    """The training env step of env i (rows.env_step_row), then its accumulation."""
    o, t1, t2 = env_step_row(st, i, actions, grids, mk, preference, risk_budget, k, lo, hi, seed, counter, out)
    accumulate_row(acc, i, o, t1, t2)


@row_jit
def zero_row(acc, i):
    for row in range(acc.shape[0]):
        acc[row, i] = _F0


@row_jit
def record_row(rec, i, o, t1, t2):
    """What env i's step adds to the accumulators, as one column of rec [N_REC, N] (reference)."""
    rec[R_BAR_PNL, i] = o.bar_pnl
    rec[R_T1_CLOSED, i] = _F1 if t1.reason != EXIT_NONE else _F0
    rec[R_T1_PNL, i] = t1.pnl
    rec[R_T2_CLOSED, i] = _F1 if t2.reason != EXIT_NONE else _F0
    rec[R_T2_PNL, i] = t2.pnl
    tr, mi, ho, ch, op, ds, pn = reward_contributions(o)
    rec[R_TERM0, i] = tr
    rec[R_TERM0 + 1, i] = mi
    rec[R_TERM0 + 2, i] = ho
    rec[R_TERM0 + 3, i] = ch
    rec[R_TERM0 + 4, i] = op
    rec[R_TERM0 + 5, i] = ds
    rec[R_TERM0 + 6, i] = pn
    rec[R_KELLY_RATIO, i] = o.kelly_ratio


@row_jit
def step_record_ref(st, actions, grids, mk, preference, risk_budget, k, lo, hi, seed, counter, out, rec):
    """CPU twin of the step kernel (numpy state, e.g. CpuEnv's): every env steps exactly as
    reference.step_ref does, and its step's record goes to rec [N_REC, N]."""
    for i in range(st.cursor.shape[0]):
        o, t1, t2 = env_step_row(st, i, actions, grids, mk, preference, risk_budget, k, lo, hi, seed, counter, out)
        record_row(rec, i, o, t1, t2)


def accumulate_reference(records) -> np.ndarray:
    """float64 numpy reference of the accumulators: the records [N_REC, N] of consecutive steps
    folded in step order (the order the kernel adds them, so the sums agree bit for bit)."""
    records = [np.asarray(r, np.float64) for r in records]
    n = records[0].shape[1] if records else 0
    acc = np.zeros((N_TEL, n), np.float64)
    for rec in records:
        acc[T_BAR_N] += 1.0
        acc[T_BAR_SUM] += rec[R_BAR_PNL]
        acc[T_BAR_SUMSQ] += rec[R_BAR_PNL] * rec[R_BAR_PNL]
        for closed, pnl in ((R_T1_CLOSED, R_T1_PNL), (R_T2_CLOSED, R_T2_PNL)):
            hit = rec[closed] != 0.0
            acc[T_TRADE_N] += np.where(hit, 1.0, 0.0)
            acc[T_TRADE_WINS] += np.where(hit & (rec[pnl] > 0.0), 1.0, 0.0)
            acc[T_TRADE_SUM] += np.where(hit, rec[pnl], 0.0)
            acc[T_TRADE_SUMSQ] += np.where(hit, rec[pnl] * rec[pnl], 0.0)
        for j in range(len(TERMS)):
            x = rec[R_TERM0 + j]
            acc[term_sum(j)] += x
            acc[term_sumsq(j)] += x * x
        ratio = rec[R_KELLY_RATIO]
        sized = ratio > 0.0
        acc[T_KELLY_ORDERS] += np.where(sized, 1.0, 0.0)
        acc[T_KELLY_CAPPED] += np.where(sized & (ratio < 1.0), 1.0, 0.0)
        acc[T_KELLY_RATIO_SUM] += np.where(sized, ratio, 0.0)
    return acc


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
_zero_row = device_function(zero_row)


@_cuda.jit(cache=True)
def zero_kernel(acc):
    i = _cuda.grid(1)
    if i >= acc.shape[1]:
        return
    _zero_row(acc, i)


def _dims(n: int) -> tuple[int, int]:
    n = max(1, int(n))
    threads = min(BLOCK, n)
    return (n + threads - 1) // threads, threads


def launch_zero(acc, stream) -> None:
    """acc [N_TEL, N] = 0 (one thread per env; only launches, so it can be captured)."""
    zero_kernel[_dims(acc.shape[1]) + (stream,)](acc)


# ---------------------------------------------------------------------------------------------
# host: the statistics
# ---------------------------------------------------------------------------------------------
def _mean_std(n: float, s: float, q: float) -> tuple[float, float]:
    """(mean, std with ddof=1) from a count, sum and sum of squares; NaN where undefined
    (std: fewer than 2 values, or at rounding level: ZERO_STD_REL)."""
    if not n >= 1:
        return math.nan, math.nan
    mean = s / n
    if not n >= 2:
        return mean, math.nan
    if not (math.isfinite(s) and math.isfinite(q)):
        return mean, math.nan
    var = max((q - s * mean) / (n - 1.0), 0.0)
    std = math.sqrt(var)
    if std <= ZERO_STD_REL * math.sqrt(q / n):
        return mean, math.nan
    return mean, std


def _ratio(mean: float, std: float) -> float:
    if math.isfinite(mean) and math.isfinite(std) and std > 0.0:
        return mean / std
    return math.nan


def summary_keys() -> tuple[str, ...]:
    """The keys of ``summarize`` (and ``epoch_record``), in order."""
    keys = ["train_path.n_bars", "train_path.pnl_mean", "train_path.pnl_std", "train_path.sharpe",
            "train_path.n_trades", "train_path.win_rate", "train_path.avg_trade", "train_path.trade_sharpe"]
    for term in TERMS:
        keys += [f"reward.{term}.mean", f"reward.{term}.std", f"reward.{term}.snr"]
    keys += ["train_path.kelly_capped_frac", "train_path.kelly_size_ratio"]
    return tuple(keys)


def summarize(acc: np.ndarray, bars_per_day: float) -> dict:
    """The statistics of host accumulators acc [N_TEL, N] (module docstring): each row reduced
    over envs with math.fsum, then ratios. Counts are ints; undefined figures are NaN."""
    bars_per_day = float(bars_per_day)
    if not math.isfinite(bars_per_day) or bars_per_day <= 0:
        raise ValueError(f"bars_per_day = {bars_per_day!r} is invalid: allowed a finite number > 0 (the cache's meta.json value)")
    acc = np.asarray(acc, np.float64)
    if acc.ndim != 2 or acc.shape[0] != N_TEL:
        raise ValueError(f"telemetry accumulators must be [{N_TEL}, N], got {list(acc.shape)}")
    tot = [math.fsum(acc[row]) for row in range(N_TEL)]
    n_bars = tot[T_BAR_N]
    pnl_mean, pnl_std = _mean_std(n_bars, tot[T_BAR_SUM], tot[T_BAR_SUMSQ])
    sharpe = _ratio(pnl_mean, pnl_std) * math.sqrt(bars_per_day * TRADING_DAYS)
    n_tr = tot[T_TRADE_N]
    avg_trade, trade_std = _mean_std(n_tr, tot[T_TRADE_SUM], tot[T_TRADE_SUMSQ])
    out = {
        "train_path.n_bars": int(n_bars),
        "train_path.pnl_mean": pnl_mean,
        "train_path.pnl_std": pnl_std,
        "train_path.sharpe": sharpe,
        "train_path.n_trades": int(n_tr),
        "train_path.win_rate": tot[T_TRADE_WINS] / n_tr if n_tr >= 1 else math.nan,
        "train_path.avg_trade": avg_trade,
        "train_path.trade_sharpe": _ratio(avg_trade, trade_std),
    }
    for j, term in enumerate(TERMS):
        mean, std = _mean_std(n_bars, tot[term_sum(j)], tot[term_sumsq(j)])
        out[f"reward.{term}.mean"] = mean
        out[f"reward.{term}.std"] = std
        out[f"reward.{term}.snr"] = _ratio(mean, std)
    n_kelly = tot[T_KELLY_ORDERS]
    out["train_path.kelly_capped_frac"] = tot[T_KELLY_CAPPED] / n_kelly if n_kelly >= 1 else math.nan
    out["train_path.kelly_size_ratio"] = tot[T_KELLY_RATIO_SUM] / n_kelly if n_kelly >= 1 else math.nan
    return out


class TrainPathTelemetry:
    """Reader of a DeviceEnv's training-path accumulators (``env.telemetry_acc``).

    read(stream)            host copy of acc [N_TEL, N] (synchronizes `stream`)
    reset(stream)           acc = 0 (a kernel on `stream`)
    read_and_reset(stream=None, bars_per_day=None) -> dict
                            summarize(read()) then reset(): the statistics since the last read
                            (or env.reset); bars_per_day defaults to the constructor's
    """

    def __init__(self, env, bars_per_day: float | None = None):
        self.env = env
        self.acc = env.telemetry_acc
        self.bars_per_day = bars_per_day

    def read(self, stream=None) -> np.ndarray:
        s = default_stream() if stream is None else stream
        host = self.acc.copy_to_host(stream=s)
        s.synchronize()
        return np.asarray(host, np.float64)

    def reset(self, stream=None) -> None:
        launch_zero(self.acc, default_stream() if stream is None else stream)

    def read_and_reset(self, stream=None, bars_per_day: float | None = None) -> dict:
        bpd = self.bars_per_day if bars_per_day is None else bars_per_day
        if bpd is None:
            raise ValueError("bars_per_day is needed to annualize the Sharpe: TrainPathTelemetry(env, bars_per_day) or read_and_reset(bars_per_day=)")
        acc = self.read(stream)
        self.reset(stream)
        return summarize(acc, bpd)


def epoch_record(telemetry: TrainPathTelemetry, stream=None, bars_per_day: float | None = None) -> dict:
    """The epoch's training-path statistics as a flat, JSON-ready dict (summary_keys(); None where
    undefined), for a metrics.jsonl record {"kind": "train_path", "fold", "epoch", **this};
    the accumulators are zeroed."""
    stats = telemetry.read_and_reset(stream, bars_per_day)
    return {k: (v if isinstance(v, int) or math.isfinite(v) else None) for k, v in stats.items()}
