"""blas.gemm against its float64 numpy reference (simulator: the tiled kernel and the host path).

Shapes are odd and not multiples of TILE / TILE_K so that partial tiles and several k panels
are exercised; inputs are fresh random draws every run.
"""

import numpy as np
import pytest

from numbarl.cuda import blas
from numbarl.cuda.runtime import cuda, simulator, stream

_cuda = cuda()
ATOL = 1e-5
RTOL = 1e-5


def _close(got, ref, atol=ATOL, rtol=RTOL):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    bad = np.abs(got - ref) > atol + rtol * np.abs(ref)
    assert not bad.any(), f"{bad.sum()} of {bad.size} mismatch; max err {np.abs(got - ref).max():.3e}"


def _operands(rng, M, K, N, trans_a, trans_b):
    A = rng.standard_normal((K, M) if trans_a else (M, K)).astype(np.float32)
    B = rng.standard_normal((N, K) if trans_b else (K, N)).astype(np.float32)
    C = rng.standard_normal((M, N)).astype(np.float32)
    return A, B, C


@pytest.fixture(params=["kernel", "host"] if simulator() else ["kernel"])
def gemm_backend(request):
    blas.set_backend(request.param)
    yield request.param
    blas.set_backend(None)


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_transposes_alpha_beta(rng, trans_a, trans_b):
    # 5 x 23 x 7: one partial tile; alpha/beta drawn fresh
    blas.set_backend("kernel")
    try:
        M, K, N = 5, 23, 7
        A, B, C = _operands(rng, M, K, N, trans_a, trans_b)
        alpha, beta = float(rng.uniform(-2, 2)), float(rng.uniform(-2, 2))
        dC = _cuda.to_device(C)
        blas.gemm(_cuda.to_device(A), _cuda.to_device(B), dC, trans_a, trans_b, alpha=alpha, beta=beta)
        ref = blas.gemm_ref(A, B, C, trans_a, trans_b, alpha, beta)[0]
        _close(dC.copy_to_host(), ref)
    finally:
        blas.set_backend(None)


def test_several_blocks_and_k_panels(rng, gemm_backend):
    # M, N span two TILE=16 tiles each (partial), K spans two TILE_K=64 panels (partial)
    M, K, N = 17, blas.TILE_K + 5, 18
    A, B, C = _operands(rng, M, K, N, True, False)
    dC = _cuda.device_array((M, N), np.float32)
    blas.gemm(_cuda.to_device(A), _cuda.to_device(B), dC, trans_a=True)
    _close(dC.copy_to_host(), blas.gemm_ref(A, B, trans_a=True)[0], atol=5e-5)


def test_hand_computed():
    # [[1, 2], [3, 4]] @ [[5, 6], [7, 8]] = [[19, 22], [43, 50]]; alpha=2, beta=-1 with C = 1:
    # 2 * [[19, 22], [43, 50]] - 1 = [[37, 43], [85, 99]]; + bias [1, -100], relu -> [[38, 0], [86, 0]]
    A = np.array([[1, 2], [3, 4]], np.float32)
    B = np.array([[5, 6], [7, 8]], np.float32)
    dC = _cuda.to_device(np.ones((2, 2), np.float32))
    blas.gemm(_cuda.to_device(A), _cuda.to_device(B), dC, alpha=2.0, beta=-1.0,
              bias=_cuda.to_device(np.array([1, -100], np.float32)), epilogue="relu")
    np.testing.assert_array_equal(dC.copy_to_host(), np.array([[38, 0], [86, 0]], np.float32))


@pytest.mark.parametrize("epilogue", [None, "relu", "gelu"])
def test_bias_and_activation(rng, gemm_backend, epilogue):
    M, K, N = 6, 9, 11
    A, B, C = _operands(rng, M, K, N, False, True)
    bias = rng.standard_normal(N).astype(np.float32)
    dC = _cuda.device_array((M, N), np.float32)
    blas.gemm(_cuda.to_device(A), _cuda.to_device(B), dC, trans_b=True, bias=_cuda.to_device(bias), epilogue=epilogue)
    ref = blas.gemm_ref(A, B, trans_b=True, bias=bias, epilogue=epilogue)[0]
    _close(dC.copy_to_host(), ref)
    if epilogue == "relu":
        assert (dC.copy_to_host() >= 0).all() and (ref == 0).any()


def test_gelu_aux_into_padded_rows(rng, gemm_backend):
    # aux rows are padded to a multiple of 8 floats (cuBLASLt's rule); the padding is untouched
    M, K, N = 5, 7, 11
    A, B, C = _operands(rng, M, K, N, True, True)
    bias = rng.standard_normal(N).astype(np.float32)
    aux_full = _cuda.to_device(np.full((M, 16), 7.0, np.float32))
    aux = aux_full[:, :N]
    dC = _cuda.to_device(C)
    blas.gemm(_cuda.to_device(A), _cuda.to_device(B), dC, True, True, alpha=0.5, beta=0.25,
              bias=_cuda.to_device(bias), epilogue="gelu_aux", aux=aux)
    out, pre, _, _ = blas.gemm_ref(A, B, C, True, True, 0.5, 0.25, bias, "gelu_aux")
    _close(dC.copy_to_host(), out)
    host_aux = aux_full.copy_to_host()
    _close(host_aux[:, :N], pre)
    assert (host_aux[:, N:] == 7.0).all()


@pytest.mark.parametrize("trans_a,trans_b", [(True, False), (False, True)])
def test_bgrad(rng, gemm_backend, trans_a, trans_b):
    M, K, N = 7, 19, 13
    A, B, C = _operands(rng, M, K, N, trans_a, trans_b)
    _, _, sum_a, sum_b = blas.gemm_ref(A, B, trans_a=trans_a, trans_b=trans_b)
    for epilogue, n, ref in (("bgrad_b", N, sum_b), ("bgrad_a", M, sum_a)):
        dC = _cuda.device_array((M, N), np.float32)
        grad = _cuda.to_device(np.full(n, np.nan, np.float32))
        blas.gemm(_cuda.to_device(A), _cuda.to_device(B), dC, trans_a, trans_b, epilogue=epilogue, bias_grad=grad)
        _close(grad.copy_to_host(), ref)
        _close(dC.copy_to_host(), A.T @ B if trans_a else A @ B.T)


def test_linear_backward_alias(rng):
    # "bgrad": weights [in, out], dW = xᵀ dy and db = colsum(dy) in one call
    x = rng.standard_normal((9, 4)).astype(np.float32)
    dy = rng.standard_normal((9, 3)).astype(np.float32)
    dW = _cuda.device_array((4, 3), np.float32)
    db = _cuda.device_array(3, np.float32)
    blas.gemm(_cuda.to_device(x), _cuda.to_device(dy), dW, trans_a=True, epilogue="bgrad", bias_grad=db)
    _close(dW.copy_to_host(), x.T.astype(np.float64) @ dy)
    _close(db.copy_to_host(), dy.astype(np.float64).sum(axis=0))


def test_beta_zero_ignores_nan_in_c(rng, gemm_backend):
    A, B, _ = _operands(rng, 3, 4, 5, False, False)
    dC = _cuda.to_device(np.full((3, 5), np.nan, np.float32))
    blas.gemm(_cuda.to_device(A), _cuda.to_device(B), dC)
    _close(dC.copy_to_host(), A.astype(np.float64) @ B)


def test_device_alpha(rng, gemm_backend):
    A, B, C = _operands(rng, 4, 6, 3, False, False)
    alpha = _cuda.to_device(np.array([rng.uniform(0.1, 3)], np.float32))
    dC = _cuda.to_device(C)
    blas.gemm(_cuda.to_device(A), _cuda.to_device(B), dC, alpha=alpha, beta=1.0)
    ref = blas.gemm_ref(A, B, C, alpha=float(alpha.copy_to_host()[0]), beta=1.0)[0]
    _close(dC.copy_to_host(), ref)


def test_strided_views(rng, gemm_backend):
    # operands are column slices of wider buffers (row stride > columns), output too
    big_a = rng.standard_normal((6, 12)).astype(np.float32)
    big_b = rng.standard_normal((5, 9)).astype(np.float32)
    dA, dB = _cuda.to_device(big_a), _cuda.to_device(big_b)
    out = _cuda.to_device(np.zeros((6, 10), np.float32))
    A, B, C = dA[:, 2:7], dB[:, 1:4], out[:, 3:6]  # [6, 5] @ [5, 3] -> [6, 3]
    blas.gemm(A, B, C)
    host = out.copy_to_host()
    _close(host[:, 3:6], big_a[:, 2:7].astype(np.float64) @ big_b[:, 1:4])
    assert (host[:, :3] == 0).all() and (host[:, 6:] == 0).all()


def test_deterministic_and_backends_agree(rng):
    M, K, N = 9, 31, 10
    A, B, _ = _operands(rng, M, K, N, False, False)
    dA, dB = _cuda.to_device(A), _cuda.to_device(B)
    outs = []
    try:
        for which in ("kernel", "kernel") + (("host",) if simulator() else ()):
            blas.set_backend(which)
            dC = _cuda.device_array((M, N), np.float32)
            blas.gemm(dA, dB, dC, epilogue="gelu")
            outs.append(dC.copy_to_host())
    finally:
        blas.set_backend(None)
    assert outs[0].tobytes() == outs[1].tobytes()
    if len(outs) == 3:
        _close(outs[0], outs[2])


def test_bad_calls_name_the_problem(rng):
    d = lambda *shape: _cuda.device_array(shape, np.float32)  # noqa: E731
    with pytest.raises(ValueError, match="do not chain"):
        blas.gemm(d(3, 4), d(5, 2), d(3, 2))
    with pytest.raises(TypeError, match="float32"):
        blas.gemm(_cuda.device_array((3, 4), np.float64), d(4, 2), d(3, 2))
    with pytest.raises(ValueError, match="unit inner stride"):
        blas.gemm(d(3, 8)[:, ::2], d(4, 2), d(3, 2))
    with pytest.raises(ValueError, match="unknown epilogue"):
        blas.gemm(d(3, 4), d(4, 2), d(3, 2), epilogue="swish")
    with pytest.raises(ValueError, match="multiple of 8"):
        blas.gemm(d(3, 4), d(4, 5), d(3, 5), epilogue="gelu_aux", aux=d(3, 5))
    with pytest.raises(ValueError, match="needs bias_grad"):
        blas.gemm(d(3, 4), d(4, 2), d(3, 2), epilogue="bgrad")
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        blas.gemm(d(3, 4), d(4, 2), d(3, 2), epilogue="bgrad_b", bias_grad=d(3))
    with pytest.raises(ValueError, match="cannot be combined"):
        blas.gemm(d(3, 4), d(4, 2), d(3, 2), bias=d(2), epilogue="bgrad_b", bias_grad=d(2))
    with pytest.raises(ValueError, match="compute"):
        blas.gemm(d(3, 4), d(4, 2), d(3, 2), compute="fp16")
    with pytest.raises(ValueError, match="backend"):
        blas.set_backend("magma")


# ---------------------------------------------------------------------------------------------
# The cuBLASLt path on the CPU: blas's plans drive an emulator of cublasLtMatmul that follows the
# documented column-major semantics on host memory. This checks the row-major -> column-major
# operand swap, leading dimensions, transposes, ROW-order layouts, epilogue enums, bias / aux /
# bgrad pointers and the bgrad fallback, which the GPU tests then check against the real library.
# ---------------------------------------------------------------------------------------------
import ctypes  # noqa: E402


class FakeCublasLt:
    """cublasLt calls emulated with numpy on host pointers (enums and dtypes are the real ones)."""

    def __init__(self, reject=()):
        import nvmath.bindings.cublasLt as real

        self.real = real
        for name in ("Epilogue", "MatmulDescAttribute", "MatmulPreferenceAttribute", "MatrixLayoutAttribute",
                     "Order", "PointerMode", "matmul_heuristic_result_dtype", "cuBLASLtError"):
            setattr(self, name, getattr(real, name))
        self.reject = reject  # predicate(desc dict) -> True: the heuristic finds no algorithm
        self.objects = {}
        self.calls = []

    def _new(self, obj):
        handle = 1000 + len(self.objects)
        self.objects[handle] = obj
        return handle

    def create(self):
        return 1

    def matmul_desc_create(self, compute, scale):
        return self._new({"compute": compute, "scale": scale, "TRANSA": 0, "TRANSB": 0, "EPILOGUE": 1,
                          "POINTER_MODE": 0, "BIAS_POINTER": 0, "EPILOGUE_AUX_POINTER": 0, "EPILOGUE_AUX_LD": 0})

    def matmul_desc_set_attribute(self, desc, attr, buf, size):
        dtype = np.dtype(self.real.get_matmul_desc_attribute_dtype(attr))
        value = np.frombuffer(ctypes.string_at(buf, size), dtype=dtype)[0]
        self.objects[desc][self.MatmulDescAttribute(attr).name] = int(value)

    def matrix_layout_create(self, dtype, rows, cols, ld):
        assert dtype == 0
        return self._new({"rows": rows, "cols": cols, "ld": ld, "order": 0})

    def matrix_layout_set_attribute(self, layout, attr, buf, size):
        assert attr == self.MatrixLayoutAttribute.ORDER
        self.objects[layout]["order"] = int(np.frombuffer(ctypes.string_at(buf, size), np.int32)[0])

    def matmul_preference_create(self):
        return self._new({})

    def matmul_preference_set_attribute(self, pref, attr, buf, size):
        self.objects[pref][self.MatmulPreferenceAttribute(attr).name] = ctypes.string_at(buf, size)

    def matmul_preference_destroy(self, pref):
        pass

    def matrix_layout_destroy(self, layout):
        pass

    def matmul_desc_destroy(self, desc):
        pass

    n_algos = 1  # candidates the emulated heuristic offers; candidate i's algo starts with int32 i + 1

    def matmul_algo_get_heuristic(self, handle, desc, a, b, c, d, pref, n, results, count):
        found = 0 if self.reject(self.objects[desc]) else min(n, self.n_algos)
        size = np.dtype(self.matmul_heuristic_result_dtype).itemsize
        for i in range(found):
            ctypes.c_int32.from_address(results + i * size).value = i + 1
        ctypes.c_int32.from_address(count).value = found

    def _view(self, ptr, layout):
        L = self.objects[layout]
        rows, cols, ld = L["rows"], L["cols"], L["ld"]
        if L["order"] == 0:  # column-major: (i, j) at i + j * ld
            assert ld >= rows, "cuBLASLt needs ld >= rows for a column-major layout"
            span, strides = ld * (cols - 1) + rows, (4, 4 * ld)
        else:  # row-major: (i, j) at i * ld + j
            assert ld >= cols
            span, strides = ld * (rows - 1) + cols, (4 * ld, 4)
        flat = np.ctypeslib.as_array((ctypes.c_float * span).from_address(ptr))
        return np.lib.stride_tricks.as_strided(flat, (rows, cols), strides)

    def matmul(self, handle, desc, alpha, a, adesc, b, bdesc, beta, c, cdesc, d, ddesc, algo, ws, ws_bytes, stream):
        D = self.objects[desc]
        E = self.Epilogue
        self.calls.append(dict(D, algo=ctypes.c_int32.from_address(algo).value - 1))
        opa = self._view(a, adesc).astype(np.float64)
        opb = self._view(b, bdesc).astype(np.float64)
        opa = opa.T if D["TRANSA"] else opa  # [m, k]
        opb = opb.T if D["TRANSB"] else opb  # [k, n]
        alpha_v = ctypes.c_float.from_address(alpha).value
        beta_v = ctypes.c_float.from_address(beta).value
        out = self._view(d, ddesc)
        t = alpha_v * (opa @ opb)
        if beta_v != 0.0:
            t += beta_v * self._view(c, cdesc)
        ep = D["EPILOGUE"]
        m = t.shape[0]
        if ep in (E.BIAS, E.RELU_BIAS, E.GELU_BIAS, E.GELU_AUX_BIAS):  # bias[m], broadcast over columns
            t += np.ctypeslib.as_array((ctypes.c_float * m).from_address(D["BIAS_POINTER"]))[:, None]
        if ep in (E.GELU_AUX, E.GELU_AUX_BIAS):
            aux = self._new({"rows": m, "cols": t.shape[1], "ld": D["EPILOGUE_AUX_LD"], "order": 0})
            self._view(D["EPILOGUE_AUX_POINTER"], aux)[...] = t
        if ep == E.BGRADA:  # sum over k of op(A): length m
            np.ctypeslib.as_array((ctypes.c_float * m).from_address(D["BIAS_POINTER"]))[...] = opa.sum(axis=1)
        if ep == E.BGRADB:  # sum over k of op(B): length n
            assert D["TRANSB"] == 1, "emulated restriction: BGRADB needs op T on B"
            n = t.shape[1]
            np.ctypeslib.as_array((ctypes.c_float * n).from_address(D["BIAS_POINTER"]))[...] = opb.sum(axis=0)
        if ep in (E.RELU, E.RELU_BIAS):
            t = np.maximum(t, 0.0)
        if ep in (E.GELU, E.GELU_BIAS, E.GELU_AUX, E.GELU_AUX_BIAS):
            t = blas.gelu_ref(t)
        out[...] = t


@pytest.fixture
def fake_lt(monkeypatch):
    pytest.importorskip("nvmath.bindings.cublasLt")
    fake = FakeCublasLt(reject=lambda desc: False)
    monkeypatch.setattr(blas, "_lt", lambda: fake)
    monkeypatch.setattr(blas, "_pointer", lambda x: x.__array_interface__["data"][0])
    monkeypatch.setattr(blas, "_workspace", lambda stream_int: (0, 0))
    monkeypatch.setattr(blas, "_device_constant", lambda v: np.array([v], np.float32))
    monkeypatch.setattr(blas._Lt, "handle", 1)
    monkeypatch.setattr(blas, "_PLANS", {})
    return fake


def _run_lt(A, B, C, ta=False, tb=False, alpha=1.0, beta=0.0, bias=None, epilogue=None, aux=None, bias_grad=None):
    epilogue = blas._canon_epilogue(epilogue)
    geometry = blas._check(A, B, C, ta, tb, alpha, beta, bias, epilogue, aux, bias_grad, "fp32")
    blas._gemm_cublaslt(A, B, C, ta, tb, alpha, beta, bias, epilogue, aux, bias_grad, "fp32", stream(), geometry)


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_cublaslt_plumbing_emulated(rng, fake_lt, trans_a, trans_b):
    M, K, N = 5, 23, 7
    A, B, C = _operands(rng, M, K, N, trans_a, trans_b)
    bias = rng.standard_normal(N).astype(np.float32)
    for epilogue in (None, "relu", "gelu"):
        out = C.copy()
        _run_lt(A, B, out, trans_a, trans_b, 0.5, 1.5, bias, epilogue)
        _close(out, blas.gemm_ref(A, B, C, trans_a, trans_b, 0.5, 1.5, bias, epilogue)[0])
    # gelu_aux into padded rows; bgrad_a / bgrad_b
    aux_full = np.full((M, 8), 3.0, np.float32)
    out = np.zeros((M, N), np.float32)
    _run_lt(A, B, out, trans_a, trans_b, bias=bias, epilogue="gelu_aux", aux=aux_full[:, :N])
    ref_out, pre, sum_a, sum_b = blas.gemm_ref(A, B, None, trans_a, trans_b, bias=bias, epilogue="gelu_aux")
    _close(out, ref_out)
    _close(aux_full[:, :N], pre)
    assert (aux_full[:, N:] == 3.0).all()
    for epilogue, ref in (("bgrad_a", sum_a), ("bgrad_b", sum_b)):
        grad = np.full(ref.shape, np.nan, np.float32)
        out = np.zeros((M, N), np.float32)
        _run_lt(A, B, out, trans_a, trans_b, epilogue=epilogue, bias_grad=grad)
        _close(grad, ref)
        _close(out, blas.gemm_ref(A, B, None, trans_a, trans_b)[0])
    # transposes: our B is cuBLASLt's A, our A its B
    assert {(c["TRANSA"], c["TRANSB"]) for c in fake_lt.calls if c["EPILOGUE"] != 512} == {(int(trans_b), int(trans_a))}


def test_cublaslt_plumbing_strided_device_alpha_and_pinned_plans(rng, fake_lt):
    big_a = rng.standard_normal((6, 12)).astype(np.float32)
    big_b = rng.standard_normal((5, 9)).astype(np.float32)
    out = np.zeros((6, 10), np.float32)
    alpha = np.array([1.75], np.float32)  # device-pointer alpha
    _run_lt(big_a[:, 2:7], big_b[:, 1:4], out[:, 3:6], alpha=alpha)
    _close(out[:, 3:6], 1.75 * (big_a[:, 2:7].astype(np.float64) @ big_b[:, 1:4]))
    assert (out[:, :3] == 0).all() and (out[:, 6:] == 0).all()
    assert fake_lt.calls[-1]["POINTER_MODE"] == int(fake_lt.PointerMode.DEVICE)
    n_plans = blas.plan_count()
    alpha[0] = -2.0  # a new value, same plan
    _run_lt(big_a[:, 2:7], big_b[:, 1:4], out[:, 3:6], alpha=alpha)
    _close(out[:, 3:6], -2.0 * (big_a[:, 2:7].astype(np.float64) @ big_b[:, 1:4]))
    assert blas.plan_count() == n_plans


def test_cublaslt_bgrad_falls_back_when_no_fused_algorithm(rng, fake_lt):
    # cuBLASLt without a BGRAD algorithm for a geometry: plain GEMM + colsum_kernel, same numbers
    fake_lt.reject = lambda desc: desc["EPILOGUE"] in (256, 512)
    x = rng.standard_normal((9, 4)).astype(np.float32)
    dy = rng.standard_normal((9, 3)).astype(np.float32)
    dW = np.zeros((4, 3), np.float32)
    db = np.zeros(3, np.float32)
    _run_lt(x, dy, dW, ta=True, epilogue="bgrad", bias_grad=db)
    _close(dW, x.T.astype(np.float64) @ dy)
    _close(db, dy.astype(np.float64).sum(axis=0))
    (plan,) = blas._PLANS.values()
    assert plan.bgrad_separate and fake_lt.calls[-1]["EPILOGUE"] == 1


# ---------------------------------------------------------------------------------------------
# tuned algorithms (NUMBARL_GEMM_TUNING): the plan takes the file's candidate, nothing else changes
# ---------------------------------------------------------------------------------------------
IDENTITY = {"device": "emulated", "cublaslt_version": 1}


@pytest.fixture
def tuned_lt(fake_lt, monkeypatch):
    fake_lt.n_algos = 4
    monkeypatch.setattr(blas, "tuning_identity", lambda: dict(IDENTITY))
    monkeypatch.delenv("NUMBARL_GEMM_TUNING", raising=False)
    blas.clear_tuning()
    yield fake_lt
    blas.clear_tuning()


def _tuning_file(path, entries, identity=IDENTITY):
    import json

    path.write_text(json.dumps({"identity": identity, "plans": {k: {"index": i} for k, i in entries.items()}}))
    return path


def test_tuning_file_picks_the_plans_candidate_and_the_same_numbers(rng, tuned_lt, tmp_path, monkeypatch):
    A, B, C = _operands(rng, 5, 23, 7, False, False)
    _run_lt(A, B, C)  # untuned: the heuristic's first candidate
    (key,) = blas._PLANS
    assert tuned_lt.calls[-1]["algo"] == 0 and blas.tuning_info()["applied"] == 0
    first = C.copy()
    monkeypatch.setattr(blas, "_PLANS", {})
    monkeypatch.setenv("NUMBARL_GEMM_TUNING", str(_tuning_file(tmp_path / "t.json", {blas.plan_key_text(key): 2})))
    blas._Tuning.checked = False  # a fresh process: the variable is read at the first plan
    C[...] = 0
    _run_lt(A, B, C)
    assert tuned_lt.calls[-1]["algo"] == 2
    assert blas.tuning_info() == {"file": str(tmp_path / "t.json"), "keys": 1, "applied": 1}
    np.testing.assert_array_equal(C, first)  # (the emulator's algorithms all compute alike)
    # another geometry is not in the file: first candidate
    A2, B2, C2 = _operands(rng, 3, 4, 5, False, False)
    _run_lt(A2, B2, C2)
    assert tuned_lt.calls[-1]["algo"] == 0 and blas.tuning_info()["applied"] == 1


def test_tuning_file_errors_name_the_file_and_the_problem(rng, tuned_lt, tmp_path):
    with pytest.raises(blas.GemmPlanError, match="not found"):
        blas.load_tuning(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(blas.GemmPlanError, match="bad.json: not a numbarl-bench gemm tuning file"):
        blas.load_tuning(tmp_path / "bad.json")
    other = _tuning_file(tmp_path / "other.json", {}, identity={"device": "another GPU", "cublaslt_version": 1})
    with pytest.raises(blas.GemmPlanError, match="was written for .*another GPU.*re-run numbarl-bench gemm"):
        blas.load_tuning(other)
    A, B, C = _operands(rng, 5, 23, 7, False, False)
    key = blas._plan_key(A, B, C, False, False, 1.0, 0.0, None, None, None, None, "fp32",
                         blas._check(A, B, C, False, False, 1.0, 0.0, None, None, None, None, "fp32"))
    assert blas.load_tuning(_tuning_file(tmp_path / "far.json", {blas.plan_key_text(key): 9})) == 1
    with pytest.raises(blas.GemmPlanError, match="candidate 9 .* does not exist here .*offers 4"):
        _run_lt(A, B, C)
    blas.clear_tuning()
    _run_lt(A, B, C)
    with pytest.raises(blas.GemmPlanError, match="plans already exist"):
        blas.load_tuning(tmp_path / "far.json")


def test_tuning_file_pins_the_algorithm_and_a_bgrad_plan_never_falls_back_on_it(rng, tuned_lt, tmp_path,
                                                                                 monkeypatch):
    x = rng.standard_normal((9, 4)).astype(np.float32)
    dy = rng.standard_normal((9, 3)).astype(np.float32)
    dW, db = np.zeros((4, 3), np.float32), np.zeros(3, np.float32)
    _run_lt(x, dy, dW, ta=True, epilogue="bgrad", bias_grad=db)
    (key,) = blas._PLANS
    found = blas._PLANS[key].candidates(4)
    text = blas.plan_key_text(key)
    for algo, ok in ((blas.algo_text(found[3]), True), (blas.algo_text(found[1]), False)):
        monkeypatch.setattr(blas, "_PLANS", {})
        blas.clear_tuning()
        path = tmp_path / f"pin-{ok}.json"
        path.write_text(__import__("json").dumps({"identity": IDENTITY, "plans": {text: {"index": 3, "algo": algo}}}))
        blas.load_tuning(path)
        if ok:
            _run_lt(x, dy, dW, ta=True, epilogue="bgrad", bias_grad=db)
            assert tuned_lt.calls[-1]["algo"] == 3 and not blas._PLANS[key].bgrad_separate
        else:  # the pinned algorithm is not candidate 3 here: an error, not the unfused fallback
            with pytest.raises(blas.GemmTuningError, match="not the algorithm the file pinned"):
                _run_lt(x, dy, dW, ta=True, epilogue="bgrad", bias_grad=db)
            assert not blas._PLANS
