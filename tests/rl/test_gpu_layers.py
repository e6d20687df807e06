"""GPU tests (``pytest -m gpu tests/rl/test_gpu_layers.py``): layers, Adam and the replay buffer at
real sizes (batch 16,384, trunk 64→512→512) against float64 references, and a train-like step
(replay sample → trunk → head → backward → clip + Adam → target update) captured as a CUDA graph
that must replay bitwise like the same step run eagerly.
"""

import numpy as np
import pytest

from numbarl.cuda import rng as crng
from numbarl.cuda.kernels import elementwise
from numbarl.cuda.runtime import Arena, cuda, stream
from numbarl.rl.nets.base import ParamStore
from numbarl.rl.nets.linear import Linear
from numbarl.rl.nets.mlp import Mlp
from numbarl.rl.optim import Adam, AdamConfig, TargetConfig, adam_ref, target_update_ref
from numbarl.rl.replay import Replay, ReplayRef

pytestmark = pytest.mark.gpu

B, IN, H = 16384, 64, 512
_cuda = cuda()


def _rel(got, ref) -> float:
    """max |got − ref| / max |ref| (float64)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def _build(layer, batch, seed, tags=(("online", True),)):
    store = ParamStore()
    layer.declare_params(store)
    store.allocate()
    store.init(np.random.default_rng(seed))
    acts = Arena("acts")
    for tag, backward in tags:
        layer.declare_acts(acts, batch, tag, backward=backward)
    acts.allocate()
    return store, acts


def _host(x):
    """Copy on the compute stream (non-blocking: a plain copy_to_host would not wait for it)."""
    s = stream()
    out = x.copy_to_host(stream=s)
    s.synchronize()
    return out


def _f64(d: dict) -> dict:
    return {k: v.astype(np.float64) for k, v in d.items()}


# ---------------------------------------------------------------------------------------------
# layers at real size
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compute,bound", [("fp32", 5e-5), ("tf32", 5e-3)])
def test_relu_trunk_layer_by_layer(rng, compute, bound):
    """Each Linear against float64 math on the device's own inputs (so a ReLU whose pre-activation
    rounds to the other side of 0 in float32 cannot flip a mask between device and reference)."""
    net = Mlp("trunk", IN, (H, H), activation="relu", compute=compute)
    store, acts = _build(net, B, int(rng.integers(1 << 31)))
    params = _f64(store.to_host())
    x = rng.standard_normal((B, IN)).astype(np.float32)
    dy = rng.standard_normal((B, H)).astype(np.float32)
    s = stream()
    net.forward(_cuda.to_device(x, stream=s), s)
    assert net.backward(_cuda.to_device(dy, stream=s), s) is None  # first layer: no input gradient
    a = acts.to_host()
    grads = store.to_host("grads")
    y0, y1 = a["trunk.fc0.online.y"], a["trunk.fc1.online.y"]
    dpre1, dx1, dpre0 = a["trunk.fc1.online.dpre"], a["trunk.fc1.online.dx"], a["trunk.fc0.online.dpre"]
    x64, y0_64 = x.astype(np.float64), y0.astype(np.float64)
    # forward
    assert _rel(y0, np.maximum(x64 @ params["trunk.fc0.w"] + params["trunk.fc0.b"], 0)) < bound
    assert _rel(y1, np.maximum(y0_64 @ params["trunk.fc1.w"] + params["trunk.fc1.b"], 0)) < bound
    # backward: the ReLU masks are exact selections of the device's outputs
    np.testing.assert_array_equal(dpre1, np.where(y1 > 0, dy, 0))
    np.testing.assert_array_equal(dpre0, np.where(y0 > 0, dx1, 0))
    assert _rel(grads["trunk.fc1.w"], y0_64.T @ dpre1) < bound
    assert _rel(grads["trunk.fc1.b"], dpre1.astype(np.float64).sum(0)) < bound
    assert _rel(dx1, dpre1.astype(np.float64) @ params["trunk.fc1.w"].T) < bound
    assert _rel(grads["trunk.fc0.w"], x64.T @ dpre0) < bound
    assert _rel(grads["trunk.fc0.b"], dpre0.astype(np.float64).sum(0)) < bound


def test_silu_layernorm_trunk_end_to_end(rng):
    """Smooth trunk (Linear → LayerNorm → SiLU twice, input gradient on) against the float64
    reference of the whole network."""
    net = Mlp("trunk", IN, (H, H), activation="silu", layernorm=True, input_grad=True)
    store, _ = _build(net, B, int(rng.integers(1 << 31)))
    params = _f64(store.to_host())
    x = rng.standard_normal((B, IN)).astype(np.float32)
    dy = rng.standard_normal((B, H)).astype(np.float32)
    s = stream()
    y = net.forward(_cuda.to_device(x, stream=s), s)
    dx = net.backward(_cuda.to_device(dy, stream=s), s)
    ref_y, caches = net.forward_ref(x, params)
    ref_dx, ref_grads = net.backward_ref(dy, caches, params)
    assert _rel(_host(y), ref_y) < 1e-4
    assert _rel(_host(dx), ref_dx) < 1e-4
    grads = store.to_host("grads")
    for name, g in ref_grads.items():
        assert _rel(grads[name], g) < 1e-4, name


# ---------------------------------------------------------------------------------------------
# Adam at real size
# ---------------------------------------------------------------------------------------------
def test_adam_real_size_matches_reference(rng):
    trunk = Mlp("trunk", IN, (H, H))
    head = Linear("head", H, 612, group="head")
    store = ParamStore()
    trunk.declare_params(store)
    head.declare_params(store)
    store.allocate()
    store.init(rng)
    cfg = AdamConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=300.0)
    tcfg = TargetConfig.polyak(0.05)
    opt = Adam(store, cfg, tcfg).allocate()
    s = stream()
    p = _host(store.flat("params")).astype(np.float64)
    target = p.copy()
    m, v = np.zeros_like(p), np.zeros_like(p)
    mask = np.pad(store.decay_mask(), (0, p.size - store.flat_size)).astype(np.float64)
    step, clipped = 0, 0
    for k, scale in enumerate((0.1, 1.0, 0.3, 2.0, 0.5)):
        grads = {n: (scale * rng.standard_normal(sp.shape)).astype(np.float32) for n, sp in store.specs.items()}
        store.load(grads, role="grads")
        g = _host(store.flat("grads"))
        opt.step(s)
        p, m, v, step, stats = adam_ref(p, g, m, v, mask, step, cfg.lr, cfg)
        target = target_update_ref(target, p, step, tcfg)
        clipped += stats[1] < 1.0
        stats[9] = step  # the device's cumulative Polyak-update count (every step)
        stats[5] = clipped  # and its cumulative count of clipped steps
        # atol scaled to the vector: m = β1·m + (1 − β1)·g cancels for a few elements, where float32
        # rounding of the two terms (~1e-7 of max|m|) is all that is left
        for role, ref in (("params", p), ("adam_m", m), ("adam_v", v), ("target", target)):
            np.testing.assert_allclose(_host(store.flat(role)), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max(),
                                       err_msg=f"{role} step {k}")
        np.testing.assert_allclose(_host(opt.stats), stats, rtol=1e-5, err_msg=f"stats {k}")
    assert 0 < clipped < 5


# ---------------------------------------------------------------------------------------------
# replay buffer at real size
# ---------------------------------------------------------------------------------------------
def test_replay_real_size_matches_reference(rng):
    N, nb, n_step = 16384, 4, 3
    buf = Replay(capacity=8 * N, n_envs=N, state_dim=IN, n_branches=nb, batch_size=B, n_step=n_step,
                 gamma=0.99, seed=int(rng.integers(1 << 31))).allocate()
    ref = ReplayRef(buf.n_slots, N, IN, nb, n_step, 0.99, buf.seed)
    s = stream()
    counter = _cuda.to_device(np.array([17], np.int64))
    for t in range(21):  # 21 writes into 8 slots
        obs = rng.standard_normal((N, IN)).astype(np.float32)
        action = rng.integers(0, 3, (N, nb)).astype(np.int32)
        reward = rng.standard_normal(N).astype(np.float32)
        done = (rng.random(N) < 0.05).astype(np.uint8)
        buf.write(_cuda.to_device(obs, stream=s), _cuda.to_device(action, stream=s),
                  _cuda.to_device(reward, stream=s), _cuda.to_device(done, stream=s), s)
        ref.write(obs, action, reward, done)
        if t in (3, 12, 20):
            crng.advance(counter, s)
            batch = buf.sample(counter, s)
            want = ref.sample(B, int(_host(counter)[0]))
            for k in ("index", "next_index", "action"):
                np.testing.assert_array_equal(_host(getattr(batch, k)), want[k], err_msg=k)
            for k in ("obs", "next_obs", "done", "weight"):
                np.testing.assert_array_equal(_host(getattr(batch, k)), want[k].astype(np.float32), err_msg=k)
            for k in ("reward", "discount"):
                np.testing.assert_allclose(_host(getattr(batch, k)), want[k], rtol=1e-5, atol=1e-6, err_msg=k)


# ---------------------------------------------------------------------------------------------
# a train-like step: graph replay == eager, bitwise
# ---------------------------------------------------------------------------------------------
def _train_setup(seed: int):
    """Replay (4,096 envs, 8 slots, filled), trunk 64→512→512 + linear head 512→612, AdamW with
    clipping and a periodic target; step = sample → forward → L = ½·mean(out²) → backward → Adam."""
    host = np.random.default_rng(seed)
    N = 4096
    replay = Replay(capacity=8 * N, n_envs=N, state_dim=IN, n_branches=4, batch_size=B, n_step=3,
                    gamma=0.99, seed=seed).allocate()
    s = stream()
    for _ in range(10):
        replay.write(_cuda.to_device(host.standard_normal((N, IN)).astype(np.float32), stream=s),
                     _cuda.to_device(host.integers(0, 3, (N, 4)).astype(np.int32), stream=s),
                     _cuda.to_device(host.standard_normal(N).astype(np.float32), stream=s),
                     _cuda.to_device((host.random(N) < 0.05).astype(np.uint8), stream=s), s)
    trunk = Mlp("trunk", IN, (H, H), activation="relu")
    head = Linear("head", H, 612, group="head")
    store = ParamStore()
    trunk.declare_params(store)
    head.declare_params(store)
    store.allocate()
    store.init(host)
    acts = Arena("acts")
    trunk.declare_acts(acts, B, "online")
    head.declare_acts(acts, B, "online")
    acts.add("d_out", (B, 612), np.float32)
    acts.allocate()
    opt = Adam(store, AdamConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0), TargetConfig.periodic(2)).allocate()
    counter = _cuda.to_device(np.array([0], np.int64))
    d_out = acts["d_out"]

    def step(st):
        batch = replay.sample(counter, st)
        h = trunk.forward(batch.obs, st)
        out = head.forward(h, st)
        elementwise.copy(out, d_out, st)  # dL/d out = out / B
        elementwise.scale(d_out, 1.0 / B, st)
        trunk.backward(head.backward(d_out, st), st)
        opt.step(st)
        crng.advance(counter, st)

    def result():
        s.synchronize()
        out = {f"{role}": _host(store.flat(role)) for role in ("params", "target", "adam_m", "adam_v")}
        out["stats"] = _host(opt.stats)
        out["obs"] = _host(replay.batch.obs)
        out["counter"] = _host(counter)
        return out

    return step, result


def test_train_step_graph_replay_equals_eager_bitwise():
    from numbarl.cuda import graph

    step, result = _train_setup(seed=7)
    g = graph.capture(step, stream())  # warm-up step + capture
    assert g.captured and g.n_nodes > 10
    for _ in range(4):
        g.replay()
    graphed = result()

    step2, result2 = _train_setup(seed=7)
    for _ in range(5):
        step2(stream())
    eager = result2()

    assert graphed["counter"][0] == 5 and graphed["stats"][3] == 5.0
    for key in graphed:
        assert graphed[key].tobytes() == eager[key].tobytes(), key
    assert not np.array_equal(graphed["params"], graphed["adam_m"])  # sanity: training moved things

    step3, result3 = _train_setup(seed=7)  # and a third, eager run: identical again
    for _ in range(5):
        step3(stream())
    assert result3()["params"].tobytes() == eager["params"].tobytes()
