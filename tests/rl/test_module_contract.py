"""The module contract (numbarl/rl/nets/module.py), checked for every registered module.

Each case of numbarl.rl.nets.registry.MODULES goes through the same checks: finite differences of
its float64 reference, the device module (simulator) against the reference on odd shapes, the
gradient rule (two consumers in one step accumulate, parameter gradients and a shared input
gradient alike; the next step overwrites whatever the buffers held), and names. Then a trunk
trained by two heads in one step against the float64 reference. GPU: graph replay == eager,
bitwise, for every module.
"""

import numpy as np
import pytest

from numbarl.cuda import blas
from numbarl.cuda.runtime import Arena, cuda, stream
from numbarl.cuda.testing import assert_close, assert_fd_gradient
from numbarl.rl.nets.base import ParamStore
from numbarl.rl.nets.linear import Linear
from numbarl.rl.nets.mlp import Mlp
from numbarl.rl.nets.registry import modules, valid_mask

_cuda = cuda()
CASES = sorted(modules())
RTOL, ATOL = 3e-5, 3e-6


@pytest.fixture
def host_gemm():
    blas.set_backend("host")
    yield
    blas.set_backend(None)


def _host(x):
    s = stream()
    out = x.copy_to_host(stream=s)
    s.synchronize()
    return out


def _dev(x):
    return _cuda.to_device(np.ascontiguousarray(x, np.float32))


def _build(case, rng, tag_backward=True):
    module = case.make()
    store = ParamStore()
    module.declare_params(store)
    store.allocate()
    store.init(rng)
    acts = Arena("acts")
    module.declare_acts(acts, case.batch, "online", backward=tag_backward, **case.acts)
    acts.allocate()
    # random parameters beyond the init range (both sides of every ReLU)
    values = {n: (0.5 * rng.standard_normal(s.shape)).astype(np.float32) for n, s in store.specs.items()}
    store.load(values)
    return module, store, {n: v.astype(np.float64) for n, v in values.items()}


def _loss_weights(case, module, ref_out, rng):
    """R for the test loss L = Σ R · primary(out) over the defined entries (0 at padding)."""
    primary = np.asarray(case.primary(ref_out), np.float64)
    mask = valid_mask(case, module, primary.shape)
    return np.where(mask, rng.standard_normal(primary.shape), 0.0).astype(np.float32), mask


def _ref(case, module, x, params, R):
    out, cache = module.forward_ref(x, params)
    dx, grads = module.backward_ref(R.astype(np.float64), cache, params)
    return out, dx, grads


# ---------------------------------------------------------------------------------------------
# finite differences of the float64 reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_reference_gradients_match_finite_differences(name, rng):
    case = modules()[name]
    module = case.make()
    store = ParamStore()
    module.declare_params(store)
    params = {n: 0.5 * rng.standard_normal(s.shape) for n, s in store.specs.items()}
    x = rng.standard_normal((case.batch, case.in_dim))
    out, cache = module.forward_ref(x, params)
    R, mask = _loss_weights(case, module, out, rng)
    R = R.astype(np.float64)

    def loss():
        y = np.asarray(case.primary(module.forward_ref(x, params)[0]), np.float64)
        return float(np.sum(np.where(mask, y, 0.0) * R))

    dx, grads = module.backward_ref(R, cache, params)
    checks = [("x", x, dx)] + [(n, params[n], grads[n]) for n in params]
    for label, arr, analytic in checks:
        picks = rng.choice(arr.size, size=min(arr.size, 12), replace=False)
        assert_fd_gradient(loss, arr, analytic, picks, 1e-5, 1e-4, label=f"{name} d{label}")


# ---------------------------------------------------------------------------------------------
# device vs reference, and the gradient rule
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_device_matches_reference_and_overwrites_outside_a_step(name, rng, host_gemm):
    case = modules()[name]
    module, store, params = _build(case, rng)
    x = rng.standard_normal((case.batch, case.in_dim)).astype(np.float32)
    ref_out, _ = module.forward_ref(x, params)
    R, mask = _loss_weights(case, module, ref_out, rng)
    _, ref_dx, ref_grads = _ref(case, module, x, params, R)
    store.load({n: np.full(s.shape, 7.0, np.float32) for n, s in store.specs.items()}, role="grads")  # garbage
    out = module.forward(_dev(x), stream())
    got = _host(case.primary(out))
    assert_close(np.where(mask, got, 0.0), np.where(mask, np.asarray(case.primary(ref_out)), 0.0), ATOL, RTOL)
    dx = module.backward(_dev(R), stream())
    assert_close(_host(dx), ref_dx, ATOL, RTOL)
    grads = store.to_host("grads")
    assert set(grads) == set(ref_grads) == set(params)
    for n, g in ref_grads.items():
        assert_close(grads[n], g, ATOL, RTOL)
    # names: {module}.{param}, and the module's param_names cover the store
    names = module.param_names.values() if isinstance(module.param_names, dict) else module.param_names
    assert sorted(names) == sorted(store.specs)
    assert all(n.startswith(module.name + ".") for n in names)


@pytest.mark.parametrize("name", CASES)
def test_two_consumers_accumulate_and_the_next_step_overwrites(name, rng, host_gemm):
    """Inside a step: backward(dy1) then backward(dy2) on the same pass gives the gradients of
    dy1 + dy2, for the parameters and for an input gradient written into a shared buffer; the
    next step's first backward overwrites."""
    case = modules()[name]
    module, store, params = _build(case, rng)
    x = rng.standard_normal((case.batch, case.in_dim)).astype(np.float32)
    ref_out, _ = module.forward_ref(x, params)
    R1, _ = _loss_weights(case, module, ref_out, rng)
    R2, _ = _loss_weights(case, module, ref_out, rng)
    _, dx1, g1 = _ref(case, module, x, params, R1)
    _, dx2, g2 = _ref(case, module, x, params, R2)
    shared_dx = _dev(np.full((case.batch, case.in_dim), np.nan, np.float32))  # garbage before the step
    store.load({n: np.full(s.shape, np.nan, np.float32) for n, s in store.specs.items()}, role="grads")
    module.forward(_dev(x), stream())
    store.begin_step()
    module.backward(_dev(R1), stream(), dx_out=shared_dx)
    module.backward(_dev(R2), stream(), dx_out=shared_dx)
    store.end_step()
    assert_close(_host(shared_dx), dx1 + dx2, ATOL, RTOL)
    grads = store.to_host("grads")
    for n in params:
        assert_close(grads[n], g1[n] + g2[n], ATOL, RTOL)
    # the next step: first writes overwrite the sums
    store.begin_step()
    module.backward(_dev(R2), stream(), dx_out=shared_dx)
    store.end_step()
    assert_close(_host(shared_dx), dx2, ATOL, RTOL)
    grads = store.to_host("grads")
    for n in params:
        assert_close(grads[n], g2[n], ATOL, RTOL)


@pytest.mark.parametrize("name", CASES)
def test_a_pass_without_backward_refuses_backward(name, rng, host_gemm):
    case = modules()[name]
    module, store, _ = _build(case, rng, tag_backward=False)
    module.forward(_dev(rng.standard_normal((case.batch, case.in_dim))), stream())
    with pytest.raises(RuntimeError, match="backward=False"):
        module.backward(_dev(np.zeros(1)), stream())


# ---------------------------------------------------------------------------------------------
# one trunk, two heads, one step
# ---------------------------------------------------------------------------------------------
def test_two_heads_train_one_trunk(rng, host_gemm):
    """trunk → (head A, head B): the trunk's gradient is that of dh_A + dh_B (float64 reference),
    the heads' own gradients are theirs alone."""
    B, D = 9, 5
    trunk = Mlp("trunk", D, (11, 7), input_grad=False)
    head_a = Linear("head_a", 7, 3)
    head_b = Linear("head_b", 7, 4, "silu")
    store = ParamStore()
    for m in (trunk, head_a, head_b):
        m.declare_params(store)
    store.allocate()
    store.init(rng)
    values = {n: (0.5 * rng.standard_normal(s.shape)).astype(np.float32) for n, s in store.specs.items()}
    store.load(values)
    params = {n: v.astype(np.float64) for n, v in values.items()}
    acts = Arena("acts")
    for m in (trunk, head_a, head_b):
        m.declare_acts(acts, B, "online")
    acts.add("dh", (B, 7), np.float32)
    acts.allocate()
    x = rng.standard_normal((B, D)).astype(np.float32)
    Ra, Rb = rng.standard_normal((B, 3)).astype(np.float32), rng.standard_normal((B, 4)).astype(np.float32)

    # reference: L = Σ Ra·A(h) + Σ Rb·B(h), h = trunk(x)
    h, c_trunk = trunk.forward_ref(x, params)
    _, c_a = head_a.forward_ref(h, params)
    _, c_b = head_b.forward_ref(h, params)
    dh_a, g_a = head_a.backward_ref(Ra.astype(np.float64), c_a, params)
    dh_b, g_b = head_b.backward_ref(Rb.astype(np.float64), c_b, params)
    _, g_trunk = trunk.backward_ref(dh_a + dh_b, c_trunk, params)

    s = stream()
    store.load({n: np.full(sp.shape, np.nan, np.float32) for n, sp in store.specs.items()}, role="grads")
    hd = trunk.forward(_dev(x), s)
    head_a.forward(hd, s)
    head_b.forward(hd, s)
    store.begin_step()
    dh = acts["dh"]
    head_a.backward(_dev(Ra), s, dx_out=dh)
    head_b.backward(_dev(Rb), s, dx_out=dh)
    trunk.backward(dh, s)
    store.end_step()
    grads = store.to_host("grads")
    assert_close(_host(dh), dh_a + dh_b, ATOL, RTOL)
    for n, g in {**g_trunk, **g_a, **g_b}.items():
        assert_close(grads[n], g, ATOL, RTOL)
    # the trunk got both heads' gradient: it differs from either head's alone
    _, only_a = trunk.backward_ref(dh_a, c_trunk, params)
    assert not np.allclose(grads["trunk.fc0.w"], only_a["trunk.fc0.w"], rtol=1e-3)


# ---------------------------------------------------------------------------------------------
# GPU: graph replay == eager, bitwise
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_graph_replay_equals_eager_bitwise(name, rng):
    from numbarl.cuda import graph as cuda_graph

    case = modules()[name]
    module, store, params = _build(case, rng)
    s = stream()
    x = _dev(rng.standard_normal((case.batch, case.in_dim)))
    ref_out, _ = module.forward_ref(rng.standard_normal((case.batch, case.in_dim)), params)
    R1, _ = _loss_weights(case, module, ref_out, rng)
    dy = _dev(R1)
    shared = _dev(np.zeros((case.batch, case.in_dim)))

    def step(st):
        out = module.forward(x, st)
        store.begin_step()
        module.backward(dy, st, dx_out=shared)
        module.backward(dy, st, dx_out=shared)
        store.end_step()
        return out

    out = step(s)
    eager = (_host(case.primary(out)), _host(shared), store.to_host("grads"))
    graph = cuda_graph.capture(step, s)
    graph.replay(s)
    got = (_host(case.primary(out)), _host(shared), store.to_host("grads"))
    assert np.array_equal(eager[0], got[0], equal_nan=True)
    assert np.array_equal(eager[1], got[1])
    for n in eager[2]:
        assert np.array_equal(eager[2][n], got[2][n]), n


@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_gpu_two_consumers_accumulate_through_cublaslt(name, rng):
    """The gradient rule on the GPU path itself (cuBLASLt's beta = 1 GEMMs, the accumulating column
    sums) against the float64 reference, not only graph == eager."""
    test_two_consumers_accumulate_and_the_next_step_overwrites(name, rng, None)
