"""Probe: cuBLASLt fp32 (SIMT) with RELU_AUX_BIAS forward and DRELU_BGRAD on the input gradient: available, correct,
and what it costs against the plain GEMMs + numbarl's activation_backward and BGRADA."""
import json
import sys

import numpy as np
import torch
from nvmath.bindings import cublasLt as lt

R32, C32F, OPN, OPT = 0, 68, 0, 1
E = lt.Epilogue
A = lt.MatmulDescAttribute
h = lt.create()
ws = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
out = {}


def setattr_(desc, attr, v, dt):
    a = np.array([v], dt)
    lt.matmul_desc_set_attribute(desc, attr, a.ctypes.data, a.nbytes)


def plan(lt_a, lt_b, lt_c, ta, tb, epi, bias=None, aux=None, aux_ld=None):
    desc = lt.matmul_desc_create(C32F, R32)
    setattr_(desc, A.TRANSA, ta, np.int32)
    setattr_(desc, A.TRANSB, tb, np.int32)
    setattr_(desc, A.EPILOGUE, int(epi), np.uint32)
    if bias is not None:
        setattr_(desc, A.BIAS_POINTER, bias.data_ptr(), np.int64)
    if aux is not None:
        setattr_(desc, A.EPILOGUE_AUX_POINTER, aux.data_ptr(), np.int64)
        setattr_(desc, A.EPILOGUE_AUX_LD, aux_ld, np.int64)
    la, lb, lc = (lt.matrix_layout_create(R32, *x) for x in (lt_a, lt_b, lt_c))
    pref = lt.matmul_preference_create()
    x = np.array([32 << 20], np.uint64)
    lt.matmul_preference_set_attribute(pref, lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, x.ctypes.data, x.nbytes)
    res = np.zeros(4, dtype=lt.matmul_heuristic_result_dtype)
    cnt = np.zeros(1, np.int32)
    try:
        lt.matmul_algo_get_heuristic(h, desc, la, lb, lc, lc, pref, 4, res.ctypes.data, cnt.ctypes.data)
    except Exception as e:  # noqa: BLE001
        return None, repr(e)[:200]
    return (desc, la, lb, lc, res[: int(cnt[0])].copy()), int(cnt[0])


def run(p, Aop, Bop, C):
    desc, la, lb, lc, res = p
    ab = np.array([1.0, 0.0], np.float32)
    s = torch.cuda.current_stream().cuda_stream
    lt.matmul(h, desc, ab.ctypes.data, Aop.data_ptr(), la, Bop.data_ptr(), lb, ab.ctypes.data + 4, C.data_ptr(), lc,
              C.data_ptr(), lc, res[0:1].ctypes.data, ws.data_ptr(), ws.numel(), s)


def timeit(fn, reps=30):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000 / reps)
    return float(np.median(ts))


torch.manual_seed(0)
M, K, N = 16384, 512, 512
X = torch.randn(M, K, device="cuda")
W = torch.randn(K, N, device="cuda") / K ** 0.5
b = torch.randn(N, device="cuda") * 0.1
H = torch.empty(M, N, device="cuda")
aux = torch.zeros(M * N // 8, dtype=torch.uint8, device="cuda")
# forward H = relu(X W + b): lt A = W ([N, K] ld N), lt B = X ([K, M] ld K), C [N, M] ld N
pf, nf = plan((N, K, N), (K, M, K), (N, M, N), OPN, OPN, E.RELU_BIAS, bias=b)
pa, na = plan((N, K, N), (K, M, K), (N, M, N), OPN, OPN, E.RELU_AUX_BIAS, bias=b, aux=aux, aux_ld=N)
out["fwd_relu_bias"] = {"algos": nf, "us": timeit(lambda: run(pf, W, X, H))}
out["fwd_relu_aux_bias"] = {"algos": na}
if pa is not None and na:
    run(pa, W, X, H)
    ref = torch.relu(X.double() @ W.double() + b.double())
    out["fwd_relu_aux_bias"].update(us=timeit(lambda: run(pa, W, X, H)),
                                    err=((H.double() - ref).norm() / ref.norm()).item())
print(json.dumps(out), flush=True)
# input gradient of the next layer dH = dP W2ᵀ (dP [M, N2], W2 [N, N2]) with DRELU_BGRAD on H's mask: dPre = dH * (H > 0),
# db = colsum(dPre). lt A = W2 memory col-major [N2, N] ld N2, op T -> [N, N2]; lt B = dP col-major [N2, M] ld N2
N2 = 768
W2 = torch.randn(N, N2, device="cuda") / N ** 0.5
dP = torch.randn(M, N2, device="cuda") * 1e-3
dPre = torch.empty(M, N, device="cuda")
db = torch.empty(N, device="cuda")
pp, npl = plan((N2, N, N2), (N2, M, N2), (N, M, N), OPT, OPN, E.DEFAULT)
out["dgrad_plain"] = {"algos": npl, "us": timeit(lambda: run(pp, W2, dP, dPre))}
pd, nd = plan((N2, N, N2), (N2, M, N2), (N, M, N), OPT, OPN, E.DRELU_BGRAD, bias=db, aux=aux, aux_ld=N)
out["dgrad_drelu_bgrad"] = {"algos": nd}
if pd is not None and nd:
    run(pa, W, X, H)  # the mask of H
    run(pd, W2, dP, dPre)
    torch.cuda.synchronize()
    ref = (dP.double() @ W2.double().T) * (H.double() > 0)
    out["dgrad_drelu_bgrad"].update(us=timeit(lambda: run(pd, W2, dP, dPre)),
                                    err=((dPre.double() - ref).norm() / ref.norm()).item(),
                                    db_err=((db.double() - ref.sum(0)).norm() / ref.sum(0).norm()).item())
pdr, ndr = plan((N2, N, N2), (N2, M, N2), (N, M, N), OPT, OPN, E.DRELU, aux=aux, aux_ld=N)
out["dgrad_drelu"] = {"algos": ndr}
if pdr is not None and ndr:
    out["dgrad_drelu"]["us"] = timeit(lambda: run(pdr, W2, dP, dPre))
# the weight gradient with and without BGRADA (what numbarl runs today for the trunk layers): dW = Hᵀ dPre
dW = torch.empty(N, N2, device="cuda")
pw, nw = plan((N2, M, N2), (N, M, N), (N2, N, N2), OPN, OPT, E.DEFAULT)
out["wgrad_plain"] = {"algos": nw, "us": timeit(lambda: run(pw, dP, H, dW))}
db2 = torch.empty(N2, device="cuda")
pwb, nwb = plan((N2, M, N2), (N, M, N), (N2, N, N2), OPN, OPT, E.BGRADA, bias=db2)
out["wgrad_bgrada"] = {"algos": nwb}
if pwb is not None and nwb:
    out["wgrad_bgrada"]["us"] = timeit(lambda: run(pwb, dP, H, dW))
print(json.dumps(out), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
