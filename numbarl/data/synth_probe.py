"""How much of the synthetic market's planted edge one bar's features show, and how much memory adds.

The memory mode of the synthetic market (``synth.py``, ``data.synth_mode=memory``) hides the sign
of the order-flow → next-move relation in a regime that only history reveals. This module
measures it on a feature cache, out of sample (fitted on the first half of the bars, scored on
the second):

* ``linear_next`` / ``linear_oracle``: the best single-bar linear predictor (least squares on
  the cache's features and a constant) of the next bar's mid move / of the oracle (the planted
  drift expected over the next bar). Against the next move it also picks up the book's own
  mechanics (queue imbalance leads the mid by a fraction of a tick, in the null market too:
  ``linear_next`` of a null market is the baseline), so the planted edge is read on the oracle.
* ``products_oracle``: a single-bar *nonlinear* predictor of the oracle: least squares on the
  features, the pairwise products of the bar's windowed return / OFI / trade-imbalance features,
  and those products times ``trade_imb_4`` (what a memoryless network could compute from one bar).
* ``memory_next`` / ``memory_oracle``: the memory predictor ``f_t · Σ_{k=1..K} f_{t-k} · Δmid_{t-k+1}``
  with f = ``trade_imb_4`` (no fit): the regime estimated from the last K bars' flow-vs-next-move
  products, times the current flow.
* ``oracle_sharpe``: per-bar Sharpe of ``sign(oracle)`` held from close to close, paying half the
  spread per unit of position change.
* ``*_sharpe`` (the regime-walk mode's measure: what a predictor *earns*): that Sharpe for the sign
  of each predictor on the second half of the bars (``oracle_test_sharpe``: the oracle's on the same
  bars): ``linear_sharpe`` and ``products_sharpe`` (the fits above), ``products_side_sharpe`` (the
  products fit with the pairs also times the sign of the bar's own ``trade_imb``: the strongest
  single-bar fit found on the regime-walk market), ``memory_sharpe`` (the memory predictor) and
  ``rule_sharpe``, the memory rule ``regime_rule``: sign(``trade_imb_t``) times the sign of
  Σ_{j=1..K-1} sign(``trade_imb_{t-j}``) · Δmid_{t-j+1}, the regime estimated from how the mid
  followed the last K - 1 bars' sides (uses bars t-K+1..t only). ``linear_next_sharpe`` and
  ``products_next_sharpe``: the same single-bar fits (products with the side) to the next mid move
  instead of the oracle (what they earn in a null market, whose oracle is 0); ``rule_next``: the
  rule's correlation with the next move.

``python -m numbarl.data.synth_probe [--sessions 10] [--seeds 1,2,3] [--modes ...]`` builds planted,
memory and null-memory markets (or those ``--modes`` names) in a temporary folder and prints the
table. The regime-walk market at the training scale, as synth.py measured it:
``python -m numbarl.data.synth_probe --modes regime_walk,regime_walk-null --sessions 20 --events 120000
--bars-per-day 1000 --seeds 7 --regime-bars 200``.
"""

from __future__ import annotations

import numpy as np

WINDOW_FEATURES = ("ret_1", "ret_2", "ret_4", "ret_8", "ret_16", "micro_ret_1", "bar_ret", "ofi_total",
                   "ofi_total_4", "ofi_total_16", "ofi_1", "ofi_2", "ofi_5", "trade_imb", "trade_imb_4", "trade_imb_16")
FLOW = "trade_imb_4"


def _corr(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.std() == 0 or b.std() == 0:
        return 0.0
    return float(np.corrcoef(a, b)[0, 1])


def _fit_score(design, target, train, test) -> float:
    w = np.linalg.lstsq(design[train], target[train], rcond=1e-8)[0]
    return _corr(design[test] @ w, target[test])


def after_cost_sharpe(position, mid, bid, ask, session_id) -> float:
    position = np.asarray(position, np.float64)
    pnl = position[:-1] * np.diff(mid) - np.abs(np.diff(np.r_[0.0, position]))[:-1] * (ask - bid)[:-1] / 2
    pnl = pnl[session_id[1:] == session_id[:-1]]
    return float(pnl.mean() / pnl.std()) if pnl.std() > 0 else 0.0


def memory_predictor(flow, mid, session_id, k: int = 16) -> np.ndarray:
    """f_t · Σ_{j=1..k} f_{t-j} · Δmid_{t-j+1}: causal (bar t's value uses bars <= t)."""
    n = len(flow)
    same = np.r_[False, session_id[1:] == session_id[:-1]]
    move = np.where(same, np.r_[0.0, np.diff(mid)], 0.0)  # Δmid_t = mid_t - mid_{t-1}
    pair = np.r_[0.0, flow[:-1]] * move  # at bar t: f_{t-1} · Δmid_t
    return flow * np.convolve(pair, np.ones(k))[:n]


def regime_rule(side, mid, session_id, k: int = 16) -> np.ndarray:
    """side_t · Σ_{j=1..k-1} side_{t-j} · Δmid_{t-j+1} (side: the sign of the bar's trade imbalance):
    its sign is the rule's position; causal, bar t's value uses bars t-k+1..t only."""
    side = np.sign(np.asarray(side, np.float64))
    n = len(side)
    same = np.r_[False, session_id[1:] == session_id[:-1]]
    move = np.where(same, np.r_[0.0, np.diff(mid)], 0.0)
    pair = np.r_[0.0, side[:-1]] * move  # at bar t: side_{t-1} · Δmid_t
    return side * np.convolve(pair, np.ones(max(k - 1, 1)))[:n]


def _fit_predict(design, target, train, test) -> np.ndarray:
    w = np.linalg.lstsq(design[train], target[train], rcond=1e-8)[0]
    return design[test] @ w


def edge_report(cache, k: int = 16) -> dict:
    x = np.asarray(cache.features, np.float64)
    names = list(cache.feature_names)
    n = len(x)
    mid, sid = np.asarray(cache.mid, np.float64), np.asarray(cache.session_id)
    oracle = np.asarray(cache.oracle, np.float64)
    nxt = np.r_[np.diff(mid), 0.0]
    ok = np.r_[sid[1:] == sid[:-1], False]  # the next bar is in the same session
    half = n // 2
    train, test = np.flatnonzero(ok[:half]), half + np.flatnonzero(ok[half:])
    lin = np.c_[x, np.ones(n)]
    cols = x[:, [names.index(c) for c in WINDOW_FEATURES if c in names]]
    pairs = np.stack([cols[:, i] * cols[:, j] for i in range(cols.shape[1]) for j in range(i, cols.shape[1])], 1)
    flow = x[:, names.index(FLOW)]
    mem = memory_predictor(flow, mid, sid, k)
    bid, ask = np.asarray(cache.bid, np.float64), np.asarray(cache.ask, np.float64)
    fit, held = np.arange(half), np.arange(half, n)

    def earns(position):  # after-cost Sharpe of a position held on the second half of the bars
        return after_cost_sharpe(position, mid[held], bid[held], ask[held], sid[held])

    side = np.sign(x[:, names.index("trade_imb")]) if "trade_imb" in names else np.sign(flow)
    products = np.c_[lin, pairs, pairs * flow[:, None]]
    rule = regime_rule(side, mid, sid, k)
    sharpes = {
        "rule_next": _corr(rule[test], nxt[test]),
        "linear_next_sharpe": earns(np.sign(_fit_predict(lin, nxt, train, held))),
        "products_next_sharpe": earns(np.sign(_fit_predict(np.c_[products, pairs * side[:, None]], nxt, train, held))),
        "linear_sharpe": earns(np.sign(_fit_predict(lin, oracle, fit, held))),
        "products_sharpe": earns(np.sign(_fit_predict(products, oracle, fit, held))),
        "products_side_sharpe": earns(np.sign(_fit_predict(np.c_[products, pairs * side[:, None]], oracle, fit, held))),
        "memory_sharpe": earns(np.sign(mem[held])),
        "rule_sharpe": earns(np.sign(rule[held])),
        "oracle_test_sharpe": earns(np.sign(oracle[held])),
    }
    return {
        "linear_next": _fit_score(lin, nxt, train, test),
        "linear_oracle": _fit_score(lin, oracle, np.arange(half), np.arange(half, n)),
        "products_oracle": _fit_score(np.c_[lin, pairs, pairs * flow[:, None]], oracle, np.arange(half), np.arange(half, n)),
        "memory_next": _corr(mem[test], nxt[test]),
        "memory_oracle": _corr(mem[half:], oracle[half:]),
        "oracle_next": _corr(oracle[ok], nxt[ok]),
        "oracle_sharpe": after_cost_sharpe(np.sign(oracle), mid, np.asarray(cache.bid), np.asarray(cache.ask), sid),
        "bars": n,
        **sharpes,
    }


def main(argv=None) -> int:
    import argparse
    import tempfile
    from pathlib import Path

    from numbarl.data import synth
    from numbarl.data.fxcache import load_cache

    ap = argparse.ArgumentParser(prog="python -m numbarl.data.synth_probe", description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--events", type=int, default=30_000)
    ap.add_argument("--bars-per-day", type=int, default=200)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--modes", default="planted,memory,memory-null",
                    help="markets to build: planted, memory, memory_walk, walk, regime_walk; '-null' appended: its null twin")
    ap.add_argument("--regime-bars", type=float, default=0.0,
                    help="mean regime duration in bars (memory, memory_walk, regime_walk; 0: the mode's own)")
    args = ap.parse_args(argv)
    keys = ("linear_next", "linear_oracle", "products_oracle", "memory_next", "memory_oracle", "oracle_next", "oracle_sharpe")
    sharpe_keys = ("linear_sharpe", "products_sharpe", "products_side_sharpe", "linear_next_sharpe",
                   "products_next_sharpe", "memory_sharpe", "rule_sharpe", "oracle_test_sharpe")
    rows = []
    print(f"{'market':<16}{'seed':>5}" + "".join(f"{key:>16}" for key in keys))
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            for label in args.modes.split(","):
                mode, null = label.removesuffix("-null"), label.endswith("-null")
                path = synth.build_synthetic_cache(Path(tmp) / f"{label}-{seed}", args.sessions, seed, null=null, mode=mode,
                                                   events_per_session=args.events, bars_per_day=args.bars_per_day,
                                                   regime_bars=args.regime_bars or synth.mode_regime_bars(mode))
                rep = edge_report(load_cache(path), args.k)
                rows.append((label, seed, rep))
                print(f"{label:<16}{seed:>5}" + "".join(f"{rep[key]:>16.3f}" for key in keys), flush=True)
    print("\nafter-cost Sharpe per bar of each predictor's sign, second half of the bars (rule / oracle: the ratio)")
    print(f"{'market':<16}{'seed':>5}" + "".join(f"{key:>21}" for key in sharpe_keys) + f"{'rule/oracle':>13}"
          + f"{'rule_next':>11}")
    for label, seed, rep in rows:
        ratio = rep["rule_sharpe"] / rep["oracle_test_sharpe"] if rep["oracle_test_sharpe"] > 0 else float("nan")
        print(f"{label:<16}{seed:>5}" + "".join(f"{rep[key]:>21.3f}" for key in sharpe_keys) + f"{ratio:>13.2f}"
              + f"{rep['rule_next']:>11.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
