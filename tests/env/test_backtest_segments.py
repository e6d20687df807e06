"""Segmented backtest (numbarl/env/backtest_segments.py): the same results as the sequential
reference, bit for bit, on the CPU (the algorithm) and through the kernels (simulator or GPU)."""

import numpy as np
import pytest
from test_backtest import params_for, plan_actions

from numbarl.cuda.runtime import cuda, simulator
from numbarl.env.backtest import DeviceBacktest, backtest, backtest_reference
from numbarl.env.backtest_segments import backtest_segmented_reference, chunk_decisions
from numbarl.env.params import DIR_LONG, EnvParams
from numbarl.env.state import STATE_FIELDS


def _open_across(trades, bars) -> int:
    """Trades open across one of these bars (entered before it, closed after it)."""
    e, x = trades["entry_bar"].to_numpy()[:, None], trades["exit_bar"].to_numpy()[:, None]
    return int(((e < bars[None]) & (x > bars[None])).sum())


def _assert_same(got, want):
    np.testing.assert_array_equal(got.pnl, want.pnl)
    np.testing.assert_array_equal(got.position, want.position)
    assert got.trades.equals(want.trades)
    np.testing.assert_array_equal(got.accumulators, want.accumulators)


def test_segmented_algorithm_equals_reference_bitwise(rng, make_market):
    """Random latency, lock, holds, segment lengths (1 bar up), chunks and event slots (overflow
    included); segments start inside open positions and pending orders."""
    data = make_market(rng, n_bars=400)
    window = (7, 390)
    n_bars = window[1] - window[0]
    seen_overflow = seen_inside = 0
    for case in range(12):
        params = params_for(rng, fill_delay=case % 3, direction_lock=bool(case % 2))
        actions = plan_actions(rng, params, 4, n_bars, hold=int(rng.integers(2, 12)))
        if case == 5:
            actions = actions[0]  # one plan broadcast to every policy
        seg_bars = (1, 3, 32, 17)[case % 4] if case < 8 else int(rng.integers(2, 40))
        chunk = int(rng.integers(2, 200)) if case % 3 else None
        slots = 1 if case in (2, 7) else None  # 1 slot: nearly every segment overflows
        ref, ref_state = backtest_reference(data, window, params, actions, return_state=True)
        seg, seg_state, _ = backtest_segmented_reference(data, window, params, actions, seg_bars, chunk_bars=chunk,
                                                             event_slots=slots, return_state=True)
        _assert_same(seg, ref)
        for name, _ in STATE_FIELDS:
            np.testing.assert_array_equal(getattr(seg_state, name), getattr(ref_state, name), err_msg=name)
        starts = np.arange(window[0], window[1], seg_bars)
        seen_inside += _open_across(ref.trades, starts)
        seen_overflow += slots == 1 and len(ref.trades) > 0
    assert seen_inside > 50 and seen_overflow == 2


def test_carry_steps_few_bars_serially(rng, make_market):
    """The serial part (pass B's exact steps before each join) is the wait until the exact and the
    speculative run are flat together: a few bars per segment for plans held a few bars."""
    data = make_market(rng, n_bars=1300)
    params = params_for(rng, fill_delay=1, direction_lock=False, targets=(0.0, 2.0), stops=(0.0, 2.0))
    actions = plan_actions(rng, params, 4, 1280, hold=6)
    seg, _, exact = backtest_segmented_reference(data, (10, 1290), params, actions, 256, chunk_bars=700, return_state=True)
    _assert_same(seg, backtest_reference(data, (10, 1290), params, actions))
    assert 0 < exact < 0.1 * 4 * 1279


def test_segmented_algorithm_never_flat_policy(rng, make_market):
    """Always long without target or stop: never flat, so no segment joins its speculation; pass B
    steps every bar exactly (slow, still exact)."""
    data = make_market(rng, n_bars=200)
    params = EnvParams(fill_delay=0, targets=(0.0,), stops=(0.0,))
    actions = np.zeros((190, 4), np.int32)
    actions[:, 0] = DIR_LONG
    ref = backtest_reference(data, (0, 190), params, actions)
    assert len(ref.trades) == 1
    seg, _, exact = backtest_segmented_reference(data, (0, 190), params, np.stack([actions] * 2), 16, chunk_bars=50,
                                                 return_state=True)
    _assert_same(seg, backtest_reference(data, (0, 190), params, np.stack([actions] * 2)))
    assert exact == 2 * 189 - 2 * 16  # every bar but the first segment's (it starts flat: joined at once)


def test_device_segmented_backtest_equals_reference(rng, make_market):
    """The three kernels (3 policies x 200 bars, segments of 32 bars, chunks of 70): equal to the
    CPU reference (bitwise under the simulator, which runs the same compiled row functions; to
    float rounding on a GPU, where FMA contraction differs from the CPU) and, on both, bitwise to
    the one-thread device path."""
    data = make_market(rng, n_bars=220)
    params = params_for(rng, fill_delay=1, direction_lock=True, targets=(0.0, 2.0), stops=(0.0, 2.0))
    window = (5, 205)
    actions = plan_actions(rng, params, 3, window[1] - window[0], hold=9)
    ref = backtest_reference(data, window, params, actions)
    dev = backtest(data, window, params, actions=actions, chunk_bars=70, segment_bars=32)
    one = backtest(data, window, params, actions=actions, chunk_bars=70)
    _assert_same(dev, one)
    if simulator():
        _assert_same(dev, ref)
    else:
        np.testing.assert_allclose(dev.pnl, ref.pnl, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(dev.position, ref.position)
    starts = []
    for origin in range(5, 205, 70):
        c0, n_dec = chunk_decisions(5, 205, origin, 70)
        starts += list(range(c0, c0 + n_dec, 32))
    assert starts == [5, 37, 69, 74, 106, 138, 144, 176]
    assert len(ref.trades) > 20 and _open_across(ref.trades, np.array(starts)) >= 4


def test_segmented_backtest_arguments(rng, make_market):
    data = make_market(rng, n_bars=40)
    params = EnvParams()
    with pytest.raises(ValueError, match="segment_bars"):
        DeviceBacktest(data, params, 2, (0, 30), segment_bars=0)
    with pytest.raises(ValueError, match="event_slots"):
        DeviceBacktest(data, params, 2, (0, 30), segment_bars=8, event_slots=0)
    with pytest.raises(ValueError, match="segment_bars is for backtests of given actions"):
        backtest(data, (0, 30), params, q_fn=lambda obs, q, s: None, n_policies=1, segment_bars=8)
    # a chunk run twice (the cursors already at its end): refused, not silently recomputed
    bt = DeviceBacktest(data, params, 2, (0, 30), segment_bars=8)
    rows = cuda().to_device(np.zeros((30, 1), np.int32))
    bt.start()
    bt.run_actions(rows)
    bt.segment_check()
    bt.run_actions(rows)
    with pytest.raises(RuntimeError, match="first decision bar"):
        bt.segment_check()
