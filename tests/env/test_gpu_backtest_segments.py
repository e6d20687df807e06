"""Segmented device backtest at a medium size (run on the GPU: `pytest -m gpu tests/env/test_gpu_backtest_segments.py`).

The segmented kernels (numbarl/env/backtest_segments.py) against the one-thread device path
(bitwise: the same float operations compiled the same way) and against the CPU reference (to
float64 rounding: the GPU contracts multiply-adds into FMAs, the CPU does not).
"""

import numpy as np
import pytest

from numbarl.cuda.runtime import cuda, stream
from numbarl.env.backtest import DeviceBacktest, backtest, backtest_reference
from numbarl.env.params import EnvParams, pack_actions

pytestmark = pytest.mark.gpu
_cuda = cuda()

# real sizes (a probe may shrink these to run the same code on the simulator)
SIZE = {"n_policies": 256, "n_bars": 40_000, "chunk_bars": 16_384, "segment_bars": 512}
STATE_SIZE = {"n_policies": 512, "n_bars": 30_000, "chunk_bars": 8192, "segment_bars": 1024}
F64_RTOL, F64_ATOL = 1e-9, 1e-8


def _actions(rng, params, n_pol, n_bars):
    """Plans held 3-40 bars (a different hold per policy), so segments start inside positions."""
    out = np.empty((n_pol, n_bars, 4), np.int32)
    for p in range(n_pol):
        hold = 3 + p % 38
        seg = np.stack([rng.integers(0, s, n_bars // hold + 1) for s in params.branch_sizes], -1)
        out[p] = np.repeat(seg, hold, axis=0)[:n_bars]
    return out


@pytest.mark.parametrize("latency,lock", [(0, False), (1, True), (2, False)])
def test_gpu_segmented_backtest_equals_one_thread_path_and_reference(rng, make_market, latency, lock):
    n_pol, n_bars = SIZE["n_policies"], SIZE["n_bars"]
    data = make_market(rng, n_bars=n_bars + 100, n_features=8, bars_per_session=2000, start=5000.0)
    params = EnvParams(fill_delay=latency, direction_lock=lock, targets=(0.0, 1.0, 2.0), stops=(0.0, 1.0, 2.0),
                       slippage_ticks=0.5)
    window = (50, 50 + n_bars)
    actions = _actions(rng, params, n_pol, n_bars)
    ref = backtest_reference(data, window, params, actions)
    one = backtest(data, window, params, actions=actions, chunk_bars=SIZE["chunk_bars"])
    seg = backtest(data, window, params, actions=actions, chunk_bars=SIZE["chunk_bars"], segment_bars=SIZE["segment_bars"])
    # bitwise: the segmented kernels against the one-thread kernel
    np.testing.assert_array_equal(seg.pnl, one.pnl)
    np.testing.assert_array_equal(seg.position, one.position)
    assert seg.trades.equals(one.trades)
    np.testing.assert_array_equal(seg.accumulators, one.accumulators)
    # the CPU reference: discrete outputs exact, floats to rounding
    np.testing.assert_array_equal(seg.position, ref.position)
    np.testing.assert_allclose(seg.pnl, ref.pnl, rtol=F64_RTOL, atol=F64_ATOL)
    assert len(seg.trades) == len(ref.trades) > n_pol * n_bars // 100
    for col in ("policy", "entry_bar", "exit_bar", "side", "size", "exit_reason"):
        assert (seg.trades[col].to_numpy() == ref.trades[col].to_numpy()).all(), col
    for col in ("entry_price", "exit_price", "pnl"):
        np.testing.assert_allclose(seg.trades[col].to_numpy(), ref.trades[col].to_numpy(), rtol=F64_RTOL, atol=F64_ATOL)
    np.testing.assert_allclose(seg.accumulators, ref.accumulators, rtol=1e-9, atol=1e-12)


def test_gpu_segmented_final_state_equals_one_thread_path(rng, make_market):
    """DeviceBacktest driven chunk by chunk (the bench's count-only mode, max_trades=0): every
    state field after the window bitwise equal to the one-thread kernel's."""
    n_pol, n_bars, chunk = STATE_SIZE["n_policies"], STATE_SIZE["n_bars"], STATE_SIZE["chunk_bars"]
    data = make_market(rng, n_bars=n_bars + 10, n_features=4, bars_per_session=3000, start=5000.0)
    params = EnvParams(fill_delay=1, targets=(0.0, 1.0), stops=(0.0, 1.0))
    actions = _actions(rng, params, n_pol, n_bars)
    packed = np.ascontiguousarray(pack_actions(actions).T)
    states = []
    for seg_bars in (None, STATE_SIZE["segment_bars"]):
        bt = DeviceBacktest(data, params, n_pol, (0, n_bars), chunk_bars=chunk, max_trades=0, segment_bars=seg_bars)
        rows = _cuda.device_array((chunk, n_pol), np.int32)
        bt.start()
        for origin in range(0, n_bars, chunk):
            if origin:
                bt.set_origin(origin)
            block = np.zeros((chunk, n_pol), np.int32)
            lo = origin - 1
            block[max(lo, 0) - lo : min(lo + chunk, n_bars) - lo] = packed[max(lo, 0) : min(lo + chunk, n_bars)]
            rows.copy_to_device(block, stream=stream())  # ordered after the previous chunk's kernels
            bt.run_actions(rows)
            bt.scan()
        bt.segment_check()
        states.append({name: bt.arena[name].copy_to_host() for name in bt.state._fields})
        states[-1]["acc"] = bt.accumulators_to_host()
    for name, want in states[0].items():
        np.testing.assert_array_equal(states[1][name], want, err_msg=name)
    assert states[0]["trade_count"].sum() > n_pol * n_bars // 100
