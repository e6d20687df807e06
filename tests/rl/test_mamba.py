"""Mamba2-style temporal scan (numbarl/rl/nets/mamba.py, kernels numbarl/cuda/kernels/ssm.py) on the
simulator: a hand-computed case; the float64 reference's BPTT against finite differences through all
K steps; the kernels (rank-one adjoint) against the reference (dense adjoint) for the output, the
input gradient of every row and every parameter gradient, with masks; the gradient rule; mask
semantics; the acting step against the scan; the PyTorch peer (autograd through a Python loop).
GPU checks at a real size: tests/rl/test_gpu_mamba.py."""

import math

import numpy as np
import pytest

from numbarl.cuda.runtime import Arena, cuda, stream
from numbarl.cuda.testing import assert_close, assert_fd_gradient
from numbarl.rl.nets.base import ParamStore
from numbarl.rl.nets.mamba import GROUP, MambaScan

_cuda = cuda()
N_SEQ, K, H, N_HEADS = 3, 4, 8, 2  # head_dim 4; d_state is the kernels' 16
ATOL, RTOL = 3e-6, 3e-5

# window 0 all valid; window 1: episode started at t = 2 (rows 0, 1 masked); window 2: a masked row
# in the middle (the state restarts after it)
MASK = np.array([[1, 1, 1, 1], [0, 0, 1, 1], [1, 0, 1, 1]], np.float32)


def _host(x):
    s = stream()
    out = x.copy_to_host(stream=s)
    s.synchronize()
    return out


def _dev(x):
    return _cuda.to_device(np.ascontiguousarray(x, np.float32))


def _build(rng, n_seq=N_SEQ, n_steps=K, width=H, n_heads=N_HEADS, act_envs=0, residual=True, conv=0):
    module = MambaScan("temporal.mamba", width, n_steps=n_steps, n_heads=n_heads, residual=residual, conv=conv)
    store = ParamStore()
    module.declare_params(store)
    store.allocate()
    store.init(rng)
    acts = Arena("acts")
    module.declare_acts(acts, n_seq * n_steps, "online")
    if act_envs:
        module.declare_acts(acts, act_envs, "act", backward=False, step=True)
    acts.allocate()
    # parameters beyond the init range: decays well inside (0, 1), steps of order 1
    values = {n: (0.5 * rng.standard_normal(s.shape)).astype(np.float32) for n, s in store.specs.items()}
    store.load(values)
    return module, store, {n: v.astype(np.float64) for n, v in values.items()}


def _inputs(rng, n_seq=N_SEQ, n_steps=K, width=H):
    x = rng.standard_normal((n_seq * n_steps, width)).astype(np.float32)
    dy = rng.standard_normal((n_seq, width)).astype(np.float32)
    return x, dy


# ---------------------------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------------------------
def test_hand_computed():
    """H = 1, one head, K = 2, x = [1, 2]; u = B[0] = C[0] = x (W_in = 1 on those columns), Δ̃ = 0 with
    b_Δ = softplus⁻¹(1) so Δ = 1, e^{A_log} = ln 2 so a = 1/2, W_out = 1:
    S_0 = Δ·u_0·B_0 = 1, S_1 = ½·1 + 1·2·2 = 4.5, y = S_1·C_1 = 9, h̃ = x_1 + y = 11.
    Row 0 masked: S_1 = 4, h̃ = 10. Acting from a cleared state over both rows gives 11."""
    m = MambaScan("m", 1, n_steps=2, n_heads=1)
    P = m.proj_width  # 1 + 32 + 1
    w_in = np.zeros((1, P))
    w_in[0, [0, 1, 17]] = 1.0  # u, B[0], C[0]
    params = {"m.w_in": w_in, "m.dt_bias": np.array([math.log(math.e - 1.0)]),
              "m.a_log": np.array([math.log(math.log(2.0))]), "m.w_out": np.ones((1, 1))}
    x = np.array([[1.0], [2.0]])
    out, cache = m.forward_ref(x, params)
    np.testing.assert_allclose(out, [[11.0]], rtol=1e-12)
    out, _ = m.forward_ref(x, params, mask=np.array([[0.0, 1.0]]))
    np.testing.assert_allclose(out, [[10.0]], rtol=1e-12)
    state = np.full((1, 1, 16), 5.0)  # whatever the env carried before its episode started
    _, state = m.step_ref(x[:1], state, np.array([1.0]), params)
    h, state = m.step_ref(x[1:], state, np.array([0.0]), params)
    np.testing.assert_allclose(h, [[11.0]], rtol=1e-12)
    np.testing.assert_allclose(state[0, 0, 0], 4.5, rtol=1e-12)
    # dh̃ = 1: ∂h̃/∂W_out = y = 9, and the decay: ∂y/∂a_1 = S_0·C_1 = 2
    _, grads = m.backward_ref(np.ones((1, 1)), cache, params)
    np.testing.assert_allclose(grads["m.w_out"], [[9.0]], rtol=1e-12)
    # ∂L/∂A_log = ∂y/∂a_1 · (−Δ e^{A_log} a_1) = 2 · (−ln 2 / 2) (a_0 multiplies S_{−1} = 0)
    np.testing.assert_allclose(grads["m.a_log"], [-math.log(2.0)], rtol=1e-12)


@pytest.mark.parametrize("residual, conv", [(True, 0), (False, 0), (True, 3)])
def test_reference_bptt_matches_finite_differences(rng, residual, conv):
    """Central differences of L = Σ R ⊙ h̃(x, θ) for every element of x (all K rows of every window:
    the gradient through the whole recurrence) and of every parameter, with the masks; also without
    the residual (u = y·W_out alone, the ISV routing's input) and with the causal convolution (3 taps)."""
    module = MambaScan("temporal.mamba", H, n_steps=K, n_heads=N_HEADS, residual=residual, conv=conv)
    store = ParamStore()
    module.declare_params(store)
    params = {n: 0.5 * rng.standard_normal(s.shape) for n, s in store.specs.items()}
    x = rng.standard_normal((N_SEQ * K, H))
    R = rng.standard_normal((N_SEQ, H))
    _, cache = module.forward_ref(x, params, MASK)
    dx, grads = module.backward_ref(R, cache, params)

    def loss():
        return float(np.sum(module.forward_ref(x, params, MASK)[0] * R))

    checks = [("x", x, dx)] + [(n, params[n], grads[n]) for n in params]
    for label, arr, analytic in checks:
        picks = range(arr.size) if arr.size <= 96 else rng.choice(arr.size, size=96, replace=False)
        assert_fd_gradient(loss, arr, analytic, picks, 1e-6, 1e-5, label=f"d{label}")
    # BPTT reaches the oldest row of a fully valid window; masked rows get nothing
    assert np.abs(dx[0]).max() > 1e-3
    rows = dx.reshape(N_SEQ, K, H)
    assert np.all(rows[MASK == 0] == 0.0)


# ---------------------------------------------------------------------------------------------
# kernels against the reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("masked, residual, conv, width", [(False, True, 0, H), (True, True, 0, H),
                                                           (True, False, 0, H), (False, True, 2, H), (True, True, 4, H),
                                                           (True, True, 2, 7)])
def test_kernels_match_reference(rng, masked, residual, conv, width):
    """h̃, dx (every row) and every parameter gradient; gradients preset to garbage are overwritten
    (a backward outside a train step); residual=False: u = y·W_out alone; conv: the causal convolution
    (with 4 taps = K, the oldest row reaches the newest through it); width 7: features the 2 heads do not
    divide (the scan's inner width 8)."""
    module, store, params = _build(rng, residual=residual, conv=conv, width=width)
    x, dy = _inputs(rng, width=width)
    mask = MASK if masked else None
    ref_out, cache = module.forward_ref(x, params, mask)
    ref_dx, ref_grads = module.backward_ref(dy, cache, params)
    store.load({n: np.full(s.shape, 7.0, np.float32) for n, s in store.specs.items()}, role="grads")
    s = stream()
    out = module.forward(_dev(x), s, mask=None if mask is None else _dev(mask))
    assert_close(_host(out), ref_out, ATOL, RTOL)
    dx = module.backward(_dev(dy), s)
    assert_close(_host(dx), ref_dx, ATOL, RTOL)
    grads = store.to_host("grads")
    assert set(grads) == set(ref_grads)
    for n, g in ref_grads.items():
        assert_close(grads[n], g, ATOL, RTOL * 3)  # sums over B·K rows of products
    assert all(store.specs[n].group == GROUP for n in grads)


@pytest.mark.parametrize("conv", [0, 2])
def test_gradient_rule_two_consumers_accumulate(rng, conv):
    """Inside a step two backwards add (parameters and a shared dx); the next step overwrites."""
    module, store, params = _build(rng, n_seq=2, conv=conv)
    x, dy = _inputs(rng, n_seq=2)
    dy2 = rng.standard_normal(dy.shape).astype(np.float32)
    mask = MASK[1:]
    cache = module.forward_ref(x, params, mask)[1]
    dx1, g1 = module.backward_ref(dy, cache, params)
    dx2, g2 = module.backward_ref(dy2, cache, params)
    s = stream()
    shared = _dev(np.full(x.shape, 3.0))
    module.forward(_dev(x), s, mask=_dev(mask))
    store.begin_step()
    module.backward(_dev(dy), s, dx_out=shared)
    module.backward(_dev(dy2), s, dx_out=shared)
    store.end_step()
    assert_close(_host(shared), dx1 + dx2, ATOL, RTOL)
    grads = store.to_host("grads")
    for n in g1:
        assert_close(grads[n], g1[n] + g2[n], ATOL, RTOL * 3)
    store.begin_step()
    module.backward(_dev(dy2), s, dx_out=shared)
    store.end_step()
    assert_close(_host(shared), dx2, ATOL, RTOL)
    for n in ("temporal.mamba.a_log",) + (("temporal.mamba.conv",) if conv else ()):
        assert_close(store.to_host("grads")[n], g2[n], ATOL, RTOL * 3)


@pytest.mark.parametrize("conv", [0, 3])
def test_mask_semantics(rng, conv):
    """What a masked row holds, and every row before it, does not reach h̃; their dx is 0; a mask of
    ones is the unmasked scan. With the convolution too: its taps stop at a masked row."""
    module, _, _ = _build(rng, conv=conv)
    x, dy = _inputs(rng)
    s = stream()
    base = _host(module.forward(_dev(x), s, mask=_dev(MASK)))
    dx = _host(module.backward(_dev(dy), s)).reshape(N_SEQ, K, H)
    # window 1: rows 0, 1 masked; window 2: row 1 masked, so row 0 is cut off by the restart
    dead = np.zeros((N_SEQ, K), bool)
    dead[1, :2] = dead[2, :2] = True
    assert np.all(dx[dead] == 0.0) and np.all(np.abs(dx[~dead]).max(axis=1) > 0)
    x2 = x.reshape(N_SEQ, K, H).copy()
    x2[dead] = 100.0 * rng.standard_normal((int(dead.sum()), H))
    again = _host(module.forward(_dev(x2.reshape(-1, H)), s, mask=_dev(MASK)))
    np.testing.assert_array_equal(again, base)
    # the live rows do matter
    x3 = x.reshape(N_SEQ, K, H).copy()
    x3[2, 2] += 1.0
    moved = _host(module.forward(_dev(x3.reshape(-1, H)), s, mask=_dev(MASK)))
    assert np.abs(moved[2] - base[2]).max() > 1e-4 and np.array_equal(moved[:2], base[:2])
    ones = _host(module.forward(_dev(x), s, mask=_dev(np.ones((N_SEQ, K)))))
    plain = _host(module.forward(_dev(x), s))
    np.testing.assert_array_equal(ones, plain)


@pytest.mark.parametrize("residual", [True, False])
def test_acting_step_matches_the_scan(rng, residual):
    """Each window stepped row by row as one env, its state holding garbage from an earlier episode
    and cleared (reset) at the window's first live row: h̃ after the last row equals the scan's, and
    every step equals the float64 step reference (with and without the residual)."""
    module, _, params = _build(rng, act_envs=N_SEQ, residual=residual)
    x, _ = _inputs(rng)
    s = stream()
    scan = _host(module.forward(_dev(x), s, mask=_dev(MASK)))
    start = np.array([0, 2, 2])  # first row after the last masked row of each window
    state_host = rng.standard_normal(module.state_shape(N_SEQ)).astype(np.float32)
    state = _dev(state_host)
    ref_state = state_host.astype(np.float64)
    rows = x.reshape(N_SEQ, K, H)
    for t in range(K):
        reset = (t == start).astype(np.float32)
        h = _host(module.step(_dev(rows[:, t]), state, _dev(reset), s))
        ref_h, ref_state = module.step_ref(rows[:, t], ref_state, reset, params)
        assert_close(h, ref_h, ATOL, RTOL)
        assert_close(_host(state), ref_state, ATOL, RTOL)
    # same device functions in the same order: equal up to the GEMMs' rounding of z
    assert_close(h, scan, 1e-6, 1e-6)


@pytest.mark.parametrize("conv, width", [(0, H), (3, H), (3, 7)])
def test_pytorch_peer(rng, conv, width):
    """Autograd through a Python loop (numbarl/rl/torch_peer_mamba.py) in float32 on the same weights,
    windows and mask: h̃, dx and every gradient within 1e-5 of the largest element (with the causal
    convolution too)."""
    pytest.importorskip("torch")
    from numbarl.rl.torch_peer_mamba import mamba_forward_backward

    module, store, _ = _build(rng, conv=conv, width=width)
    x, dy = _inputs(rng, width=width)
    s = stream()
    out = _host(module.forward(_dev(x), s, mask=_dev(MASK)))
    dx = _host(module.backward(_dev(dy), s))
    peer = mamba_forward_backward(store.to_host(), x, dy, K, N_HEADS, mask=MASK)
    grads = store.to_host("grads")
    pairs = [("out", out, peer["out"]), ("dx", dx, peer["dx"])] + [(n, grads[n], g) for n, g in peer["grads"].items()]
    for label, got, ref in pairs:
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), label


def test_conv_hand_computed():
    """The convolution alone: one window of K = 3 rows, one convolved column z = [1, 2, 3] and one copied
    (Δ̃ = [5, 6, 7]); taps w_0 = 1, w_1 = 0.5, bias 0.25: v = [1.25, 2.75, 4.25], out = silu(v); a masked
    row 1 stops the taps: v = [1.25, 0.25 (masked row: the bias), 3.25]. Backward of dout = 1 on the
    convolved column: dz_0 = w_0 e_0 + w_1 e_1, with e_t = silu'(v_t) (unmasked)."""
    from numbarl.cuda.kernels import conv1d

    silu = lambda v: v / (1.0 + math.exp(-v))

    def dsilu(v):
        s = 1.0 / (1.0 + math.exp(-v))
        return s * (1.0 + v * (1.0 - s))

    z = np.array([[1.0, 5.0], [2.0, 6.0], [3.0, 7.0]])
    w = np.array([[1.0], [0.5], [0.25]])
    out, v = conv1d.causal_conv_ref(z, w, None, 3, 1)
    np.testing.assert_allclose(v[:, 0], [1.25, 2.75, 4.25], rtol=1e-12)
    np.testing.assert_allclose(out, [[silu(1.25), 5.0], [silu(2.75), 6.0], [silu(4.25), 7.0]], rtol=1e-12)
    _, v = conv1d.causal_conv_ref(z, w, np.array([[1.0, 0.0, 1.0]]), 3, 1)
    np.testing.assert_allclose(v[:, 0], [1.25, 0.25, 3.25], rtol=1e-12)
    dz, dw = conv1d.causal_conv_backward_ref(np.ones((3, 2)), z, w, None, 3, 1)
    e = [dsilu(1.25), dsilu(2.75), dsilu(4.25)]
    np.testing.assert_allclose(dz[:, 0], [e[0] + 0.5 * e[1], e[1] + 0.5 * e[2], e[2]], rtol=1e-12)
    np.testing.assert_allclose(dz[:, 1], 1.0)  # the copied column passes dout through
    np.testing.assert_allclose(dw[:, 0], [e[0] + 2 * e[1] + 3 * e[2], e[1] + 2 * e[2], sum(e)], rtol=1e-12)


@pytest.mark.parametrize("taps, masked", [(1, False), (3, True), (8, True)])
def test_conv_kernels_match_reference(rng, taps, masked):
    """The convolution's three kernels alone (one thread per window column) against the float64 reference:
    out, v, dz (convolved and copied columns) and the weight-gradient parts summed over windows, with masked
    rows at the start, in the middle and at the end of windows, and d from 1 to the largest (8 > K)."""
    from numbarl.cuda.kernels import conv1d

    n_win, k_rows, p_cols, n_cols = 3, 5, 6, 4
    z = rng.standard_normal((n_win * k_rows, p_cols)).astype(np.float32)
    w = rng.standard_normal((taps + 1, n_cols)).astype(np.float32)
    dout = rng.standard_normal((n_win * k_rows, p_cols)).astype(np.float32)
    mask = np.array([[0, 1, 1, 1, 1], [1, 1, 0, 1, 1], [1, 1, 1, 1, 0]], np.float32) if masked else None
    s = stream()
    out, pre = _cuda.device_array((n_win * k_rows, p_cols), np.float32), _cuda.device_array((n_win * k_rows, n_cols), np.float32)
    dz, part = _cuda.device_array((n_win * k_rows, p_cols), np.float32), _cuda.device_array((n_win, (taps + 1) * n_cols), np.float32)
    dm = None if mask is None else _dev(mask)
    conv1d.conv_forward(_dev(z), _dev(w), dm, k_rows, out, pre, s)
    conv1d.conv_backward(_dev(dout), _dev(z), _dev(w), pre, dm, k_rows, dz, part, s)
    want_out, want_v = conv1d.causal_conv_ref(z, w, mask, k_rows, n_cols)
    want_dz, want_dw = conv1d.causal_conv_backward_ref(dout, z, w, mask, k_rows, n_cols)
    assert_close(_host(out), want_out, atol=ATOL, rtol=RTOL)
    assert_close(_host(pre), want_v, atol=ATOL, rtol=RTOL)
    assert_close(_host(dz), want_dz, atol=ATOL, rtol=RTOL)
    got_dw = _host(part).astype(np.float64).sum(axis=0).reshape(taps + 1, n_cols)
    assert_close(got_dw, want_dw, atol=ATOL, rtol=RTOL)


@pytest.mark.skipif(not __import__("numbarl.cuda.backend", fromlist=["backend"]).simulator_active(),
                    reason="the simulator reads REG_TAPS at run time; a compiled kernel has it as a constant")
@pytest.mark.parametrize("k_rows, taps", [(3, 4), (4, 2), (4, 4), (5, 4), (6, 3), (7, 4), (8, 1), (8, 4), (9, 4)])
def test_conv_register_path_equals_the_generic_loop(rng, k_rows, taps, monkeypatch):
    """For d ≤ REG_TAPS the forward and the weight parts read a chunk of four rows (and their masks) before the
    first store, then the last K mod 4 rows one by one: bit for bit the generic per-tap loop (forced here with REG_TAPS = 0, which the
    simulator reads at run time), for K below, at and between multiples of the chunk, masked rows inside and at
    the edges of chunks, and d from 1 to 4."""
    from numbarl.cuda.kernels import conv1d

    n_win, p_cols, n_cols = 3, 5, 4
    z = rng.standard_normal((n_win * k_rows, p_cols)).astype(np.float32)
    w = rng.standard_normal((taps + 1, n_cols)).astype(np.float32)
    dout = rng.standard_normal((n_win * k_rows, p_cols)).astype(np.float32)
    mask = np.ones((n_win, k_rows), np.float32)
    mask[0, 0] = mask[1, k_rows // 2] = mask[2, k_rows - 1] = 0.0
    mask[1, min(3, k_rows - 1)] = 0.0  # the last row of the first chunk

    def run(reg_taps, masked):
        monkeypatch.setattr(conv1d, "REG_TAPS", reg_taps)
        s = stream()
        out, pre = (_cuda.device_array((n_win * k_rows, c), np.float32) for c in (p_cols, n_cols))
        dz, part = _cuda.device_array((n_win * k_rows, p_cols), np.float32), _cuda.device_array(
            (n_win, (taps + 1) * n_cols), np.float32)
        dm = _dev(mask) if masked else None
        conv1d.conv_forward(_dev(z), _dev(w), dm, k_rows, out, pre, s)
        conv1d.conv_backward(_dev(dout), _dev(z), _dev(w), pre, dm, k_rows, dz, part, s)
        return [_host(x) for x in (out, pre, dz, part)]

    reg_taps = conv1d.REG_TAPS
    assert taps <= reg_taps
    for masked in (False, True):
        for name, got, want in zip(("out", "pre", "dz", "part"), run(reg_taps, masked), run(0, masked)):
            np.testing.assert_array_equal(got, want, err_msg=f"{name}, masked={masked}")


def test_conv_lets_the_scan_read_a_product_of_two_rows():
    """Why the convolution (numbarl/cuda/kernels/conv1d.py): the scan's state is a sum over rows of one
    row's products u_t ⊗ B_t, read by the newest row's C, so without the convolution h̃ holds no product
    of two *earlier* rows (∂²h̃/∂x_0∂x_1 = 0 in a window of 3 when the decay is held constant: Δ̃'s
    weights 0); with it u_1 mixes rows 0 and 1 and the mixed second difference is not 0."""
    rng = np.random.default_rng(3)
    for conv, expect_mixed in ((0, False), (2, True)):
        m = MambaScan("m", 4, n_steps=3, n_heads=1, conv=conv)
        store = ParamStore()
        m.declare_params(store)
        params = {n: rng.standard_normal(s.shape) for n, s in store.specs.items()}
        params["m.w_in"][:, -1] = 0.0  # Δ̃ = 0: a constant decay, so rows mix only through u ⊗ B (and the conv)
        x = rng.standard_normal((3, 4))

        def f(dx0, dx1, x=x, m=m, params=params):
            xx = x.copy()
            xx[0, 0] += dx0
            xx[1, 1] += dx1
            return m.forward_ref(xx, params)[0]

        eps = 1e-3
        mixed = (f(eps, eps) - f(eps, -eps) - f(-eps, eps) + f(-eps, -eps)) / (4 * eps * eps)
        assert (np.abs(mixed).max() > 1e-3) == expect_mixed, (conv, np.abs(mixed).max())


def test_errors_name_the_problem():
    assert MambaScan("m", 10, n_heads=4).inner == 12 and MambaScan("m", 8, n_heads=4).inner == 8
    with pytest.raises(ValueError, match="must be positive"):
        MambaScan("m", 10, n_heads=0)
    with pytest.raises(ValueError, match="n_steps"):
        MambaScan("m", 8, n_steps=33, n_heads=2)
    m = MambaScan("m", 8, n_steps=4, n_heads=2)
    with pytest.raises(ValueError, match="multiple of n_steps"):
        m.buffers(10, True)
    with pytest.raises(ValueError, match="conv must be in 0..8"):
        MambaScan("m", 8, n_steps=4, n_heads=2, conv=9)
    with pytest.raises(ValueError, match="not available with conv = 2"):
        MambaScan("m", 8, n_steps=4, n_heads=2, conv=2).buffers(3, False, step=True)


@pytest.mark.parametrize("threads", [32, 40, 256, 1000])
def test_scan_input_grad_kernel_covers_every_element_for_any_block(threads):
    """ssd_input_grad_kernel runs a thread row per row of z with its lanes along the columns (launch.row_block): the
    simulator's launcher shape has one row per block, the GPU's (256 threads) several; here blocks of several rows,
    lanes fewer than the columns (each lane loops) and row counts that are no multiple of the block's rows all write
    every element once (dz starts as NaN), with the same bits, and match the formula (module docstring)."""
    from numbarl.cuda import launch
    from numbarl.cuda.kernels import ssm

    rng = np.random.default_rng(5)
    n_seq, k_rows, width, head_dim = 3, 5, 6, 2
    n_heads, n = width // head_dim, ssm.D_STATE
    p_cols, rows = width + 2 * n + n_heads, n_seq * k_rows
    g = rng.standard_normal((n_seq, width)).astype(np.float32)
    z = rng.standard_normal((rows, p_cols)).astype(np.float32)
    d_dt, coef, dbw = (rng.standard_normal((rows, n_heads)).astype(np.float32) for _ in range(3))
    d_c = rng.standard_normal((n_seq, n_heads, n)).astype(np.float32)
    dz = _dev(np.full((rows, p_cols), np.nan, np.float32))
    grid, block = launch.row_block(rows, p_cols, threads)
    ssm.ssd_input_grad_kernel[grid, block](_dev(g), _dev(z), np.int32(k_rows), np.int32(head_dim), _dev(d_dt),
                                           _dev(coef), _dev(dbw), _dev(d_c), dz)
    got = _host(dz)
    b, t = np.divmod(np.arange(rows), k_rows)
    want = np.zeros((rows, p_cols))
    want[:, :width] = coef[:, np.arange(width) // head_dim] * g[b]
    want[:, width:width + n] = dbw.astype(np.float64).sum(axis=1)[:, None] * z[b * k_rows + k_rows - 1, width + n:width + 2 * n]
    want[:, width + n:width + 2 * n] = np.where((t == k_rows - 1)[:, None], d_c.astype(np.float64).sum(axis=1)[b], 0.0)
    want[:, width + 2 * n:] = d_dt
    assert not np.isnan(got).any()
    assert_close(got, want, atol=ATOL, rtol=RTOL)
    ref = _dev(np.full((rows, p_cols), np.nan, np.float32))
    grid, block = launch.row_block(rows, p_cols, 1)  # one lane, one row per block: every element in column order
    ssm.ssd_input_grad_kernel[grid, block](_dev(g), _dev(z), np.int32(k_rows), np.int32(head_dim), _dev(d_dt),
                                           _dev(coef), _dev(dbw), _dev(d_c), ref)
    np.testing.assert_array_equal(got.view(np.uint32), _host(ref).view(np.uint32))
