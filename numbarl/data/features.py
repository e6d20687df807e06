"""Causal bar features: a named registry and the default 64-feature state vector (SPEC §3.3).

Every feature at bar t is computed from bars 0..t only (bar t's fields are known at its close),
and normalization is causal too: a rolling z-score over the last ``norm_window`` bars including
t, never full-sample statistics. Bounded features (imbalances in [-1, 1], time of session, ADX in
[0, 1]) are used as they are. Values that do not exist yet (a 64-bar lag at bar 3, the first bars
of normalization) are 0, the normalized mean. The result is float32 [T, F] without NaN.

Feature families (``DEFAULT_FEATURES`` lists the default set in order; ``REGISTRY`` has every
name with a one-line description: ``numbarl-data inspect`` prints them):

* log mid returns over 1..64 bars, microprice return, bar return, realized volatility (8, 32,
  128 bars) and its short/long ratio, high-low range of the bar;
* multi-level order-flow imbalance (Cont, Kukanov & Stoikov 2014, eq. 2, per level as in Xu,
  Gould & Howison 2019): ``ofi_m`` = the bar's level-m OFI / the level's average depth over the
  last 64 bars, total OFI and its 4- and 16-bar sums;
* book shape at close: queue imbalance per level, depth imbalance over the top 3/5/10 levels,
  order-count imbalance, microprice - mid and spread in ticks, total depth and its change;
* trades: trade imbalance of the bar and over 4 and 16 bars, volume, trade count, duration,
  VWAP - mid, bar rate (bars in the last 5 minutes);
* time of session (fraction, sine, cosine) from the session calendar;
* trend and regime: Wilder's ADX(14) and DI+ - DI- on the bars' mid high/low/close, EMA(8) -
  EMA(32), rolling z of the mid, distance to the 64-bar high and low, return since the session's
  first bar.

Implementation: numba ``@njit`` loops over the bar columns (bars are few next to records).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from numba import njit

from numbarl.data.calendar import NS_PER_SECOND, SessionCalendar, date_from_ordinal
from numbarl.data.errors import DataError
from numbarl.data.records import N_LEVELS

DEPTH_WINDOW = 64  # bars over which average depth normalizes OFI
BAR_RATE_NS = 300 * NS_PER_SECOND
ADX_PERIOD = 14
EPS = 1e-12


@dataclass(frozen=True)
class FeatureParams:
    """Feature normalization (stored in the cache's meta)."""

    norm_window: int = 1000
    """Bars in the rolling z-score window (causal: the window ends at the current bar)."""
    norm_min_periods: int = 20
    """Bars needed before a z-score is computed; earlier values are 0."""
    clip: float = 5.0
    """Normalized features are clipped to [-clip, clip]."""

    def __post_init__(self):
        if self.norm_window < 2 or self.norm_min_periods < 2 or self.norm_min_periods > self.norm_window:
            raise DataError(
                f"feature normalization needs 2 <= norm_min_periods <= norm_window, got "
                f"{self.norm_min_periods} and {self.norm_window}"
            )
        if not self.clip > 0:
            raise DataError(f"feature clip must be > 0, got {self.clip}")

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# causal building blocks (numba)
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def lag_log_return(x, k):
    """log(x_t / x_{t-k}); NaN for t < k and where either value is not > 0 (a mid of 0 or below:
    a spread instrument, or a price that should not be there) — never a division by zero."""
    out = np.full(x.shape[0], np.nan)
    for t in range(k, x.shape[0]):
        if x[t] > 0.0 and x[t - k] > 0.0:
            out[t] = math.log(x[t] / x[t - k])
    return out


def side_move(flow, mid, k):
    """Σ_{j=1..k-1} sign(flow_{t-j}) · log(mid_{t-j+1} / mid_{t-j}): how the mid followed the sides of the last
    k - 1 bars' flow (synth_probe.regime_rule's regime estimate on log returns; causal, bars t-k+1..t); NaN for
    the first k - 2 bars (bar k - 2 sums the k - 2 products that exist there)."""
    pair = np.full(flow.shape[0], np.nan)
    pair[1:] = np.sign(flow[:-1]) * lag_log_return(mid, 1)[1:]
    return rolling_sum(pair, k - 1)


def lag(x, k):
    """x_{t-k} (NaN for the first k bars)."""
    out = np.full(x.shape[0], np.nan)
    out[k:] = x[:-k]
    return out


def flow_move(flow, mid, k):
    """Σ_{j=0..k-1} flow_{t-j-1} · log(mid_{t-j} / mid_{t-j-1}) (causal: bar t's value uses bars ≤ t); NaN
    until k such products exist."""
    pair = np.full(flow.shape[0], np.nan)
    pair[1:] = flow[:-1] * lag_log_return(mid, 1)[1:]
    return rolling_sum(pair, k)


@njit(cache=True)
def rolling_sum(x, w):
    """Σ of the finite values among x_{t-w+1..t}; NaN while fewer than w bars exist."""
    out = np.full(x.shape[0], np.nan)
    for t in range(w - 1, x.shape[0]):
        s = 0.0
        for j in range(t - w + 1, t + 1):
            if not math.isnan(x[j]):
                s += x[j]
        out[t] = s
    return out


@njit(cache=True)
def rolling_mean_finite(x, w):
    """Mean of the finite values among x_{t-w+1..t} (window shorter at the start); NaN if none.

    Running sum and count (one add and one subtract per bar); the same operations in the same
    order for any prefix of x, so truncating x never changes earlier values.
    """
    out = np.full(x.shape[0], np.nan)
    s = 0.0
    n = 0
    for t in range(x.shape[0]):
        if not math.isnan(x[t]):
            s += x[t]
            n += 1
        if t >= w and not math.isnan(x[t - w]):
            s -= x[t - w]
            n -= 1
        if n > 0:
            out[t] = s / n
    return out


@njit(cache=True)
def rolling_max(x, w):
    out = np.empty(x.shape[0])
    for t in range(x.shape[0]):
        m = -np.inf
        for j in range(max(0, t - w + 1), t + 1):
            m = max(m, x[j])
        out[t] = m
    return out


@njit(cache=True)
def rolling_min(x, w):
    out = np.empty(x.shape[0])
    for t in range(x.shape[0]):
        m = np.inf
        for j in range(max(0, t - w + 1), t + 1):
            m = min(m, x[j])
        out[t] = m
    return out


@njit(cache=True)
def ema(x, span):
    """Exponential moving average, alpha = 2/(span+1), started at x_0."""
    out = np.empty(x.shape[0])
    a = 2.0 / (span + 1.0)
    m = x[0] if x.shape[0] else 0.0
    for t in range(x.shape[0]):
        m = a * x[t] + (1.0 - a) * m
        out[t] = m
    return out


@njit(cache=True)
def rolling_zscore(x, w, min_periods, clip):
    """Causal z-score: (x_t - mean) / std over the finite values of x_{t-w+1..t} (ddof=0).

    Running sums of (x - x_ref) (x_ref: the first finite value) keep cancellation small; values
    before ``min_periods`` finite observations, NaN inputs and zero spread give 0.
    """
    n_total = x.shape[0]
    out = np.zeros(n_total)
    ref = np.nan
    for t in range(n_total):
        if not math.isnan(x[t]):
            ref = x[t]
            break
    if math.isnan(ref):
        return out
    s = 0.0
    s2 = 0.0
    n = 0
    for t in range(n_total):
        v = x[t]
        if not math.isnan(v):
            d = v - ref
            s += d
            s2 += d * d
            n += 1
        if t >= w:
            old = x[t - w]
            if not math.isnan(old):
                d = old - ref
                s -= d
                s2 -= d * d
                n -= 1
        if math.isnan(v) or n < min_periods:
            continue
        mean = s / n
        var = s2 / n - mean * mean
        if var <= EPS * (1.0 + mean * mean):
            continue
        z = (v - ref - mean) / math.sqrt(var)
        out[t] = min(max(z, -clip), clip)
    return out


@njit(cache=True)
def wilder_adx(high, low, close, period):
    """Wilder's ADX and DI+ - DI- (both /100) on bar high/low/close; causal recursions."""
    n = high.shape[0]
    adx = np.full(n, np.nan)
    di_diff = np.full(n, np.nan)
    a = 1.0 / period
    tr_s = 0.0
    pdm_s = 0.0
    mdm_s = 0.0
    adx_s = 0.0
    for t in range(1, n):
        up = high[t] - high[t - 1]
        down = low[t - 1] - low[t]
        pdm = up if (up > down and up > 0.0) else 0.0
        mdm = down if (down > up and down > 0.0) else 0.0
        tr = max(high[t] - low[t], abs(high[t] - close[t - 1]), abs(low[t] - close[t - 1]))
        if t == 1:
            tr_s, pdm_s, mdm_s = tr, pdm, mdm
        else:
            tr_s = a * tr + (1.0 - a) * tr_s
            pdm_s = a * pdm + (1.0 - a) * pdm_s
            mdm_s = a * mdm + (1.0 - a) * mdm_s
        if tr_s <= 0.0:
            di_p = 0.0
            di_m = 0.0
        else:
            di_p = pdm_s / tr_s
            di_m = mdm_s / tr_s
        dx = abs(di_p - di_m) / (di_p + di_m) if di_p + di_m > 0.0 else 0.0
        adx_s = dx if t == 1 else a * dx + (1.0 - a) * adx_s
        adx[t] = adx_s
        di_diff[t] = di_p - di_m
    return adx, di_diff


@njit(cache=True)
def bars_in_window(close_ts, window_ns):
    """Number of bars with close_ts in (t - window, t]."""
    out = np.empty(close_ts.shape[0])
    j = 0
    for t in range(close_ts.shape[0]):
        while close_ts[j] <= close_ts[t] - window_ns:
            j += 1
        out[t] = t - j + 1
    return out


@njit(cache=True)
def session_first(values, trade_date):
    """values at the first bar of each bar's session (causal: the session's first bar is <= t)."""
    out = np.empty(values.shape[0])
    first = 0.0
    for t in range(values.shape[0]):
        if t == 0 or trade_date[t] != trade_date[t - 1]:
            first = values[t]
        out[t] = first
    return out


def _ratio(num, den):
    num = np.asarray(num, np.float64)
    den = np.asarray(den, np.float64)
    out = np.zeros_like(num)
    np.divide(num, den, out=out, where=np.abs(den) > EPS)
    return out


# ---------------------------------------------------------------------------------------------
# inputs shared by the feature functions
# ---------------------------------------------------------------------------------------------
@dataclass
class FeatureInputs:
    """Bars plus the few constants features need; ``memo`` caches shared intermediates."""

    bars: np.ndarray
    tick_size: float | np.ndarray  # a number, or the tick in force at each bar's close
    calendar: SessionCalendar = SessionCalendar()
    memo: dict = field(default_factory=dict)

    def col(self, name) -> np.ndarray:
        key = ("col", name)
        if key not in self.memo:
            self.memo[key] = np.ascontiguousarray(self.bars[name], dtype=np.float64)
        return self.memo[key]

    def cached(self, key, fn: Callable[[], np.ndarray]) -> np.ndarray:
        if key not in self.memo:
            self.memo[key] = fn()
        return self.memo[key]

    @property
    def mid(self):
        return self.col("mid_close")

    def ret1(self):
        return self.cached("ret1", lambda: lag_log_return(self.mid, 1))

    def trade_imb(self):
        """trade_imb: (buy - sell volume) / volume of the bar."""
        return self.cached("trade_imb", lambda: _ratio(self.col("buy_volume") - self.col("sell_volume"),
                                                       self.col("volume")))

    def flow4(self):
        """trade_imb_4: (buy - sell volume) / volume over the last 4 bars."""
        return self.cached("flow4", lambda: _ratio(rolling_sum(self.col("buy_volume") - self.col("sell_volume"), 4),
                                                   rolling_sum(self.col("volume"), 4)))

    def avg_depth(self, m):
        return self.cached(("avg_depth", m), lambda: rolling_mean_finite(self.col("depth_mean")[:, m].copy(), DEPTH_WINDOW))

    def total_avg_depth(self):
        return self.cached("total_avg_depth", lambda: sum(self.avg_depth(m) for m in range(N_LEVELS)))

    def ofi_sum(self):
        return self.cached("ofi_sum", lambda: self.col("ofi").sum(axis=1))

    def session_fraction(self):
        def compute():
            bars = self.bars
            dates = bars["trade_date"]
            closes = {}
            for d in np.unique(dates):
                _, closes[int(d)] = self.calendar.open_close_ns(date_from_ordinal(int(d)))
            close_ns = np.array([closes[int(d)] for d in dates], np.int64)
            opened = bars["session_open_ns"].astype(np.int64)
            span = np.maximum(close_ns - opened, 1).astype(np.float64)
            return np.clip((bars["close_ts"].astype(np.int64) - opened) / span, 0.0, 1.0)

        return self.cached("tos", compute)

    def adx(self):
        return self.cached(
            "adx",
            lambda: wilder_adx(self.col("mid_high"), self.col("mid_low"), self.mid, float(ADX_PERIOD)),
        )

    def depth_total(self):
        return self.cached("depth_total", lambda: self.col("bid_sz").sum(axis=1) + self.col("ask_sz").sum(axis=1))

    def imbalance_top(self, kind, k):
        b = self.col(f"bid_{kind}")[:, :k].sum(axis=1)
        a = self.col(f"ask_{kind}")[:, :k].sum(axis=1)
        return _ratio(b - a, b + a)


# ---------------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Feature:
    name: str
    compute: Callable[[FeatureInputs], np.ndarray]
    normalize: bool
    doc: str


REGISTRY: dict[str, Feature] = {}


def register(name: str, normalize: bool, doc: str):
    """Decorator: add a feature function (FeatureInputs -> float64 [T]) to the registry."""

    def wrap(fn):
        if name in REGISTRY:
            raise ValueError(f"feature {name} registered twice")
        REGISTRY[name] = Feature(name, fn, normalize, doc)
        return fn

    return wrap


def _register_families():
    for k in (1, 2, 4, 8, 16, 32, 64):
        register(f"ret_{k}", True, f"log mid return over the last {k} bars")(
            lambda x, k=k: x.ret1() if k == 1 else lag_log_return(x.mid, k)
        )
    register("micro_ret_1", True, "log microprice return over the last bar")(
        lambda x: lag_log_return(x.col("micro_close"), 1)
    )
    register("bar_ret", True, "log(mid close / mid open) within the bar")(
        lambda x: np.log(x.mid / x.col("mid_open"))
    )
    for w in (8, 32, 128):
        register(f"rv_{w}", True, f"realized volatility: sqrt(mean of squared 1-bar returns over {w} bars)")(
            lambda x, w=w: x.cached(("rv", w), lambda: np.sqrt(np.maximum(rolling_mean_finite(x.ret1() ** 2, w), 0.0)))
        )
    register("rv_ratio", True, "rv_8 / rv_128 (volatility regime)")(
        lambda x: _ratio(REGISTRY["rv_8"].compute(x), REGISTRY["rv_128"].compute(x))
    )
    register("hl_range", True, "log(mid high / mid low) of the bar")(
        lambda x: np.log(x.col("mid_high") / x.col("mid_low"))
    )
    for m in range(N_LEVELS):
        register(f"ofi_{m + 1}", True, f"level-{m + 1} OFI of the bar / the level's average depth ({DEPTH_WINDOW} bars)")(
            lambda x, m=m: _ratio(x.col("ofi")[:, m], x.avg_depth(m))
        )
    register("ofi_total", True, "OFI summed over levels 1-10 / summed average depth")(
        lambda x: _ratio(x.ofi_sum(), x.total_avg_depth())
    )
    for k in (4, 16):
        register(f"ofi_total_{k}", True, f"total OFI over the last {k} bars / summed average depth")(
            lambda x, k=k: _ratio(rolling_sum(x.ofi_sum(), k), x.total_avg_depth())
        )
    for m in range(N_LEVELS):
        register(f"qi_{m + 1}", False, f"queue imbalance at level {m + 1}: (qb - qa) / (qb + qa) at close")(
            lambda x, m=m: _ratio(x.col("bid_sz")[:, m] - x.col("ask_sz")[:, m], x.col("bid_sz")[:, m] + x.col("ask_sz")[:, m])
        )
    for k in (3, 5, 10):
        register(f"depth_imb_{k}", False, f"depth imbalance over the top {k} levels at close")(
            lambda x, k=k: x.imbalance_top("sz", k)
        )
    for k in (1, 5):
        register(f"ct_imb_{k}", False, f"order-count imbalance over the top {k} levels at close")(
            lambda x, k=k: x.imbalance_top("ct", k)
        )
    register("micro_mid_ticks", True, "(microprice - mid) at close, in ticks")(
        lambda x: (x.col("micro_close") - x.mid) / x.tick_size
    )
    register("spread_ticks", True, "bid-ask spread at close, in ticks")(lambda x: x.col("spread") / x.tick_size)
    register("trade_imb", False, "(buy - sell volume) / volume of the bar")(lambda x: x.trade_imb())
    for k in (4, 16):
        register(f"trade_imb_{k}", False, f"(buy - sell volume) / volume over the last {k} bars")(
            lambda x, k=k: _ratio(
                rolling_sum(x.col("buy_volume") - x.col("sell_volume"), k), rolling_sum(x.col("volume"), k)
            )
        )
    register("log_volume", True, "log volume of the bar")(lambda x: np.log(np.maximum(x.col("volume"), 1.0)))
    register("log_trades", True, "log trade count of the bar")(lambda x: np.log(np.maximum(x.col("n_trades"), 1.0)))
    register("log_duration", True, "log bar duration in seconds (+1 ms)")(
        lambda x: np.log(x.col("duration_ns") / NS_PER_SECOND + 1e-3)
    )
    register("tos_frac", False, "time of session: fraction of open -> scheduled close elapsed")(
        lambda x: x.session_fraction()
    )
    register("tos_sin", False, "sin(2π · time of session)")(lambda x: np.sin(2.0 * np.pi * x.session_fraction()))
    register("tos_cos", False, "cos(2π · time of session)")(lambda x: np.cos(2.0 * np.pi * x.session_fraction()))
    register("adx_14", False, "Wilder ADX(14) / 100 on the bars' mid (trend strength, regime)")(lambda x: x.adx()[0])
    register("di_diff_14", False, "(DI+ - DI-) / 100, Wilder 14 (trend direction)")(lambda x: x.adx()[1])
    register("depth_log", True, "log total size of the top 10 levels at close")(
        lambda x: np.log(np.maximum(x.depth_total(), 1.0))
    )
    register("depth_change", True, "change of depth_log since the previous bar")(
        lambda x: lag_log_return(np.maximum(x.depth_total(), 1.0), 1)
    )
    register("ema_cross", True, "(EMA8 - EMA32 of the mid) in ticks")(
        lambda x: (ema(x.mid, 8.0) - ema(x.mid, 32.0)) / x.tick_size
    )
    register("mid_z_64", True, "(mid - 64-bar mean) / 64-bar std")(
        lambda x: rolling_zscore(x.mid, 64, 8, 1e9)
    )
    register("dist_high_64", True, "(mid - highest mid of the last 64 bars) in ticks")(
        lambda x: (x.mid - rolling_max(x.col("mid_high"), 64)) / x.tick_size
    )
    register("dist_low_64", True, "(mid - lowest mid of the last 64 bars) in ticks")(
        lambda x: (x.mid - rolling_min(x.col("mid_low"), 64)) / x.tick_size
    )
    register("vwap_dev", True, "(mid - VWAP of the bar) in ticks")(lambda x: (x.mid - x.col("vwap")) / x.tick_size)
    register("session_ret", True, "log(mid / open mid of the session's first bar)")(
        lambda x: np.log(x.mid / session_first(x.col("mid_open"), x.bars["trade_date"].astype(np.int64)))
    )
    register("bar_rate", True, "log number of bars in the last 5 minutes (activity)")(
        lambda x: np.log(bars_in_window(x.bars["close_ts"].astype(np.int64), BAR_RATE_NS))
    )
    # extra features, not in the default set
    register("theta_norm", False, "imbalance θ at close / threshold (about ±1)")(
        lambda x: np.clip(_ratio(x.col("imbalance"), x.col("threshold")), -2.0, 2.0)
    )
    register("gaps", False, "1 if the bar contains a book gap (F_MAYBE_BAD_BOOK)")(
        lambda x: (x.col("gaps") > 0).astype(np.float64)
    )
    register("log_events", True, "log number of book events in the bar")(
        lambda x: np.log(np.maximum(x.col("n_events"), 1.0))
    )
    register("ret_128", True, "log mid return over the last 128 bars")(lambda x: lag_log_return(x.mid, 128))
    # the memory rule's inputs (extras): how the last k bars' trade flow was followed by the mid, the sign of
    # a hidden flow -> move regime (the synthetic market's memory modes, docs/DATA.md), and that estimate
    # times the current flow (the rule's signal); a memoryless agent given them holds what a memory can hold
    for k in (8, 16):
        register(f"flow_move_{k}", True, f"sum over the last {k} bars of trade_imb_4(t-1) · ret_1(t): the flow -> "
                 "move regime")(lambda x, k=k: flow_move(x.flow4(), x.mid, k))
        register(f"flow_move_sig_{k}", True, f"trade_imb_4 · flow_move_{k}: the memory rule's signal")(
            lambda x, k=k: x.flow4() * flow_move(x.flow4(), x.mid, k))
    # the regime-walk market's (extras): the last bar's flow (what a bar's move responds to there: with it in
    # each row a scan can form the flow -> move products itself), and the regime rule's estimate and signal
    register("trade_imb_prev", False, "trade_imb of the previous bar")(lambda x: lag(x.trade_imb(), 1))
    register("side_move_16", True, "sum over the last 15 bars of sign(trade_imb(t-1)) · ret_1(t): the side -> "
             "move regime")(lambda x: side_move(x.trade_imb(), x.mid, 16))
    register("side_move_sig_16", True, "sign(trade_imb) · side_move_16: the regime rule's signal")(
        lambda x: np.sign(x.trade_imb()) * side_move(x.trade_imb(), x.mid, 16))


_register_families()

EXTRA_FEATURES: tuple[str, ...] = ("theta_norm", "gaps", "log_events", "ret_128", "flow_move_8", "flow_move_sig_8",
                                    "flow_move_16", "flow_move_sig_16", "trade_imb_prev", "side_move_16",
                                    "side_move_sig_16")  # registered, not in the default set
DEFAULT_FEATURES: tuple[str, ...] = tuple(name for name in REGISTRY if name not in EXTRA_FEATURES)
assert len(DEFAULT_FEATURES) == 64


def resolve_features(names: str | Sequence[str] | None) -> list[str]:
    """Feature names from a comma list or a sequence; ``default`` expands to DEFAULT_FEATURES."""
    if names is None:
        return list(DEFAULT_FEATURES)
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    out: list[str] = []
    for name in names:
        expanded = DEFAULT_FEATURES if name == "default" else (name,)
        for item in expanded:
            if item not in REGISTRY:
                raise DataError(f"unknown feature {item!r}; known features: {', '.join(REGISTRY)}")
            if item in out:
                raise DataError(f"feature {item!r} is listed twice")
            out.append(item)
    if not out:
        raise DataError("the feature list is empty")
    return out


def compute_features(
    bars: np.ndarray,
    names: str | Sequence[str] | None = None,
    tick_size: float | None = 0.25,
    params: FeatureParams = FeatureParams(),
    calendar: SessionCalendar = SessionCalendar(),
) -> np.ndarray:
    """float32 [T, F] normalized features for ``names`` (default: DEFAULT_FEATURES).

    ``tick_size``: the instrument's tick, or None for the per-bar tick of the bars (``tick``)."""
    names = resolve_features(names)
    if tick_size is None:
        # the tick in force at each bar's close (bars.py: known, or estimated from records up
        # to that close); a bar closed before any tick was known gets 0 for tick features
        ticks = np.asarray(bars["tick"], np.float64)
        tick = np.where(ticks > 0, ticks, np.nan)
    else:
        if not (np.isfinite(tick_size) and tick_size > 0):
            raise DataError(f"tick_size must be > 0, got {tick_size}")
        tick = float(tick_size)
    inputs = FeatureInputs(bars, tick, calendar)
    out = np.zeros((len(bars), len(names)), np.float32)
    if len(bars) == 0:
        return out
    for j, name in enumerate(names):
        spec = REGISTRY[name]
        with np.errstate(divide="ignore", invalid="ignore"):
            raw = np.asarray(spec.compute(inputs), np.float64)
        if spec.normalize:
            raw = rolling_zscore(np.where(np.isfinite(raw), raw, np.nan), params.norm_window, params.norm_min_periods, params.clip)
        else:
            raw = np.where(np.isfinite(raw), raw, 0.0)
        out[:, j] = raw
    return out
