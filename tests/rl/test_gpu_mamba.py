"""GPU checks of the Mamba2-style temporal scan (numbarl/rl/nets/mamba.py) at a real size: B = 4096
windows of K = 8 rows of the H = 512 trunk width, 8 heads (32,768 rows through cuBLASLt GEMMs):
forward, dx of every row and every parameter gradient against the float64 reference (dense BPTT),
with random episode starts masked; graph replay == eager, bitwise; two runs bitwise identical; the
acting step against the scan; and a timing print of forward + backward (graph replays). The first three
also with Mamba2's causal convolution (conv = 4 taps: agent.temporal_conv).

Run on a CUDA machine: `python -m pytest tests/rl/test_gpu_mamba.py -m gpu -q -s`
"""

import time

import numpy as np
import pytest

from numbarl.cuda import graph as cuda_graph
from numbarl.cuda.runtime import Arena, cuda, stream
from numbarl.rl.nets.base import ParamStore
from numbarl.rl.nets.mamba import MambaScan

pytestmark = pytest.mark.gpu

N_SEQ, K, H, N_HEADS = 4096, 8, 512, 8
CHUNK = 256  # windows per float64 reference call (its state history is [CHUNK, K + 1, H, 16] doubles)
_cuda = cuda()


def _host(x):
    s = stream()
    out = x.copy_to_host(stream=s)
    s.synchronize()
    return out


def _dev(x):
    s = stream()
    d = _cuda.to_device(np.ascontiguousarray(x, np.float32), stream=s)
    s.synchronize()
    return d


def _rel(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def _build(seed, act_envs=0, conv=0):
    module = MambaScan("temporal.mamba", H, n_steps=K, n_heads=N_HEADS, conv=conv)
    store = ParamStore()
    module.declare_params(store)
    store.allocate()
    store.init(np.random.default_rng(seed))  # the module's own init: the regime training starts in
    acts = Arena("acts")
    module.declare_acts(acts, N_SEQ * K, "online")
    if act_envs:
        module.declare_acts(acts, act_envs, "act", backward=False, step=True)
    acts.allocate()
    return module, store


def _inputs(seed):
    """x [B·K, H], dh [B, H] and a mask with an episode start inside ~30% of the windows."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N_SEQ * K, H)).astype(np.float32)
    dh = rng.standard_normal((N_SEQ, H)).astype(np.float32)
    start = np.where(rng.random(N_SEQ) < 0.3, rng.integers(1, K, N_SEQ), 0)
    mask = (np.arange(K)[None, :] >= start[:, None]).astype(np.float32)
    return x, dh, mask, start


@pytest.mark.parametrize("conv", [0, 4])
def test_matches_reference_at_real_size(rng, conv):
    seed = int(rng.integers(1 << 31))
    module, store = _build(seed, conv=conv)
    x, dh, mask, _ = _inputs(seed + 1)
    params = {n: v.astype(np.float64) for n, v in store.to_host().items()}
    s = stream()
    out = _host(module.forward(_dev(x), s, mask=_dev(mask)))
    dx = _host(module.backward(_dev(dh), s))
    grads = store.to_host("grads")
    ref_out, ref_dx = np.zeros_like(out, np.float64), np.zeros_like(dx, np.float64)
    ref_grads = {n: np.zeros(v.shape) for n, v in params.items()}
    for b0 in range(0, N_SEQ, CHUNK):
        rows = slice(b0 * K, (b0 + CHUNK) * K)
        o, cache = module.forward_ref(x[rows], params, mask[b0:b0 + CHUNK])
        d, g = module.backward_ref(dh[b0:b0 + CHUNK], cache, params)
        ref_out[b0:b0 + CHUNK], ref_dx[rows] = o, d
        for n in g:
            ref_grads[n] += g[n]
    assert _rel(out, ref_out) < 1e-5
    assert _rel(dx, ref_dx) < 1e-4
    assert np.all(dx.reshape(N_SEQ, K, H)[mask == 0] == 0.0)
    for n, g in ref_grads.items():  # sums over 32,768 rows: cancellation in the per-head sums
        assert _rel(grads[n], g) < 5e-4, (n, _rel(grads[n], g))


def _train_like_step(module, store, x, dh, mask, shared):
    def step(st):
        out = module.forward(x, st, mask=mask)
        store.begin_step()
        module.backward(dh, st, dx_out=shared)
        module.backward(dh, st, dx_out=shared)  # a second consumer: the accumulating paths too
        store.end_step()
        return out

    return step


def _snapshot(module, store, shared):
    return {"out": _host(module.output("online")), "dx": _host(shared), **store.to_host("grads")}


@pytest.mark.parametrize("conv", [0, 4])
def test_graph_replay_equals_eager_bitwise(rng, conv):
    seed = int(rng.integers(1 << 31))
    module, store = _build(seed, conv=conv)
    x, dh, mask, _ = _inputs(seed + 1)
    xd, dhd, md = _dev(x), _dev(dh), _dev(mask)
    shared = _dev(np.zeros_like(x))
    step = _train_like_step(module, store, xd, dhd, md, shared)
    s = stream()
    step(s)
    s.synchronize()
    eager = _snapshot(module, store, shared)
    graph = cuda_graph.capture(step, s)
    assert graph.captured
    graph.replay(s)
    s.synchronize()
    got = _snapshot(module, store, shared)
    for n in eager:
        assert np.array_equal(eager[n], got[n]), n
    assert np.isfinite(eager["out"]).all() and np.abs(eager["temporal.mamba.a_log"]).max() > 0


@pytest.mark.parametrize("conv", [0, 4])
def test_two_runs_bitwise_identical(rng, conv):
    seed = int(rng.integers(1 << 31))
    x, dh, mask, _ = _inputs(seed + 1)
    snaps = []
    for _ in range(2):
        module, store = _build(seed, conv=conv)
        shared = _dev(np.zeros_like(x))
        s = stream()
        _train_like_step(module, store, _dev(x), _dev(dh), _dev(mask), shared)(s)
        s.synchronize()
        snaps.append(_snapshot(module, store, shared))
    for n in snaps[0]:
        assert np.array_equal(snaps[0][n], snaps[1][n]), n


def test_acting_step_matches_the_scan(rng):
    """Every window stepped as one env (4096 envs), the state cleared at the window's first live row."""
    seed = int(rng.integers(1 << 31))
    module, _ = _build(seed, act_envs=N_SEQ)
    x, _, mask, start = _inputs(seed + 1)
    s = stream()
    scan = _host(module.forward(_dev(x), s, mask=_dev(mask)))
    state = _dev(np.random.default_rng(seed).standard_normal(module.state_shape(N_SEQ)))
    rows = x.reshape(N_SEQ, K, H)
    for t in range(K):
        h = module.step(_dev(rows[:, t]), state, _dev((t == start).astype(np.float32)), s)
    # the step's GEMM has another shape than the scan's (its own cuBLASLt algorithm): not bitwise
    assert _rel(_host(h), scan) < 1e-5


def test_timing_forward_backward(rng):
    """Prints graph-replay times (not a benchmark gate: docs/BENCHMARKS.md records measurements)."""
    seed = int(rng.integers(1 << 31))
    module, store = _build(seed, act_envs=N_SEQ)
    x, dh, mask, _ = _inputs(seed + 1)
    xd, dhd, md = _dev(x), _dev(dh), _dev(mask)
    shared = _dev(np.zeros_like(x))
    s = stream()

    def fwd_bwd(st):
        module.forward(xd, st, mask=md)
        store.begin_step()
        module.backward(dhd, st, dx_out=shared)
        store.end_step()

    state = _dev(np.zeros(module.state_shape(N_SEQ)))
    reset = _dev(np.zeros(N_SEQ))
    x_now = _dev(x[:N_SEQ])

    def act(st):
        module.step(x_now, state, reset, st)

    for name, fn in (("forward", lambda st: module.forward(xd, st, mask=md)), ("forward+backward", fwd_bwd),
                     ("acting step", act)):
        graph = cuda_graph.capture(fn, s)
        for _ in range(3):
            graph.replay(s)
        s.synchronize()
        n = 20
        t0 = time.perf_counter()
        for _ in range(n):
            graph.replay(s)
        s.synchronize()
        ms = (time.perf_counter() - t0) / n * 1e3
        rows = N_SEQ if name == "acting step" else N_SEQ * K
        print(f"mamba {name}: {ms:.3f} ms per graph replay (rows {rows}, H {H}, heads {N_HEADS}, K {K})")
        assert ms > 0
