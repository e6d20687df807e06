"""Probe: is an fp32-accurate GEMM from BF16 slices (bf16x6 along K, one cuBLASLt GEMM) faster than SIMT fp32
on the H200 at the train step's shapes? And does cuBLASLt accept COMPUTE_32F_EMULATED_16BFX9 on Hopper?"""
import json
import sys

import numpy as np
import torch
from nvmath.bindings import cublasLt as lt

R32, R16BF = 0, 14
C32F, C32F_EMU = 68, 78
OPN, OPT = 0, 1
h = lt.create()
ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
out = {}


def plan(dt_ab, compute, lt_a, lt_b, lt_c, ta, tb):
    desc = lt.matmul_desc_create(compute, R32)
    for attr, v in ((lt.MatmulDescAttribute.TRANSA, ta), (lt.MatmulDescAttribute.TRANSB, tb)):
        a = np.array([v], np.int32)
        lt.matmul_desc_set_attribute(desc, attr, a.ctypes.data, a.nbytes)
    la = lt.matrix_layout_create(dt_ab, *lt_a)
    lb = lt.matrix_layout_create(dt_ab, *lt_b)
    lc = lt.matrix_layout_create(R32, *lt_c)
    pref = lt.matmul_preference_create()
    x = np.array([64 << 20], np.uint64)
    lt.matmul_preference_set_attribute(pref, lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, x.ctypes.data, x.nbytes)
    res = np.zeros(8, dtype=lt.matmul_heuristic_result_dtype)
    cnt = np.zeros(1, np.int32)
    lt.matmul_algo_get_heuristic(h, desc, la, lb, lc, lc, pref, 8, res.ctypes.data, cnt.ctypes.data)
    return desc, la, lb, lc, res[: int(cnt[0])].copy()


def run(p, A, B, C, k=0):
    desc, la, lb, lc, res = p
    ab = np.array([1.0, 0.0], np.float32)
    s = torch.cuda.current_stream().cuda_stream
    lt.matmul(h, desc, ab.ctypes.data, A.data_ptr(), la, B.data_ptr(), lb, ab.ctypes.data + 4, C.data_ptr(), lc,
              C.data_ptr(), lc, res[k:k + 1].ctypes.data, ws.data_ptr(), ws.numel(), s)


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


def split3(x):
    """x = hi + mid + lo, each a bfloat16 (hi, mid by truncation: exact; lo rounded)."""
    hi = (x.view(torch.int32) & -65536).view(torch.float32)
    r = x - hi
    mid = (r.view(torch.int32) & -65536).view(torch.float32)
    lo = r - mid
    return hi.to(torch.bfloat16), mid.to(torch.bfloat16), lo.to(torch.bfloat16)


PAIRS = ((0, 0), (0, 1), (1, 0), (0, 2), (2, 0), (1, 1))


def cat_k(sl, dim, side):  # side 0: the left operand's slice i of pair (i, j); 1: the right's j
    return torch.cat([sl[p[side]] for p in PAIRS], dim=dim).contiguous()


torch.manual_seed(0)
M = 16384
for name, (K, N) in {"head_fwd": (512, 768), "trunk_fwd": (512, 512)}.items():
    X = torch.randn(M, K, device="cuda") * 0.5
    W = torch.randn(K, N, device="cuda") / K ** 0.5
    ref = (X.double() @ W.double())
    C = torch.empty(M, N, device="cuda")
    # fp32 row-major C = X W: lt A = W (col-major [N, K] ld N), lt B = X ([K, M] ld K)
    p32 = plan(R32, C32F, (N, K, N), (K, M, K), (N, M, N), OPN, OPN)
    run(p32, W, X, C)
    e32 = ((C.double() - ref).norm() / ref.norm()).item()
    t32 = timeit(lambda: run(p32, W, X, C))
    r = {"fp32_us": t32, "fp32_err": e32, "fp32_algos": len(p32[4])}
    try:
        pe = plan(R32, C32F_EMU, (N, K, N), (K, M, K), (N, M, N), OPN, OPN)
        r["emu_algos"] = len(pe[4])
        if len(pe[4]):
            run(pe, W, X, C)
            r["emu_err"] = ((C.double() - ref).norm() / ref.norm()).item()
            r["emu_us"] = timeit(lambda: run(pe, W, X, C))
    except Exception as e:  # noqa: BLE001
        r["emu_error"] = repr(e)[:300]
    xs, wsl = split3(X), split3(W)
    X6 = cat_k(xs, 1, 0)  # [M, 6K]
    W6 = cat_k(wsl, 0, 1)  # [6K, N]
    K6 = 6 * K
    pb = plan(R16BF, C32F, (N, K6, N), (K6, M, K6), (N, M, N), OPN, OPN)
    r["bf16x6_algos"] = len(pb[4])
    run(pb, W6, X6, C)
    r["bf16x6_err"] = ((C.double() - ref).norm() / ref.norm()).item()
    r["bf16x6_us"] = timeit(lambda: run(pb, W6, X6, C))
    r["split_x_us_torch"] = timeit(lambda: cat_k(split3(X), 1, 0), reps=10)
    # one bf16 GEMM at K (the speed of light per product)
    pb1 = plan(R16BF, C32F, (N, K, N), (K, M, K), (N, M, N), OPN, OPN)
    Xb, Wb = xs[0].contiguous(), wsl[0].contiguous()
    r["bf16x1_us"] = timeit(lambda: run(pb1, Wb, Xb, C))
    out[name] = r
    print(name, json.dumps(r), flush=True)

# weight gradient dW[K, N] = Xᵀ dY (reduction over M) and input gradient dX[M, K] = dY Wᵀ (reduction over N)
K, N = 512, 768
X = torch.randn(M, K, device="cuda") * 0.5
dY = torch.randn(M, N, device="cuda") * 1e-3
W = torch.randn(K, N, device="cuda") / K ** 0.5
dW = torch.empty(K, N, device="cuda")
ref = X.double().T @ dY.double()
# col-major dWᵀ [N, K] = dYᵀ [N, M] · X [M, K]: lt A = dY ([N, M] ld N, op N), lt B = X (col-major [K, M] ld K, op T)
p32 = plan(R32, C32F, (N, M, N), (K, M, K), (N, K, N), OPN, OPT)
run(p32, dY, X, dW)
r = {"fp32_us": timeit(lambda: run(p32, dY, X, dW)), "fp32_err": ((dW.double() - ref).norm() / ref.norm()).item()}
xs, ds = split3(X), split3(dY)
X6 = cat_k(xs, 0, 0)  # [6M, K]
D6 = cat_k(ds, 0, 1)  # [6M, N]
M6 = 6 * M
pb = plan(R16BF, C32F, (N, M6, N), (K, M6, K), (N, K, N), OPN, OPT)
r["bf16x6_algos"] = len(pb[4])
run(pb, D6, X6, dW)
r["bf16x6_err"] = ((dW.double() - ref).norm() / ref.norm()).item()
r["bf16x6_us"] = timeit(lambda: run(pb, D6, X6, dW))
out["head_wgrad"] = r
print("head_wgrad", json.dumps(r), flush=True)

dX = torch.empty(M, K, device="cuda")
ref = dY.double() @ W.double().T
# col-major dXᵀ [K, M] = W [K, N] (lt A = W memory col-major [N, K] ld N, op T) · dYᵀ (lt B = dY col-major [N, M] ld N)
p32 = plan(R32, C32F, (N, K, N), (N, M, N), (K, M, K), OPT, OPN)
run(p32, W, dY, dX)
r = {"fp32_us": timeit(lambda: run(p32, W, dY, dX)), "fp32_err": ((dX.double() - ref).norm() / ref.norm()).item()}
ws3, ds = split3(W), split3(dY)
W6 = cat_k(ws3, 1, 1)  # [K, 6N]
D6 = cat_k(ds, 1, 0)  # [M, 6N]
N6 = 6 * N
pb = plan(R16BF, C32F, (N6, K, N6), (N6, M, N6), (K, M, K), OPT, OPN)
r["bf16x6_algos"] = len(pb[4])
run(pb, W6, D6, dX)
r["bf16x6_err"] = ((dX.double() - ref).norm() / ref.norm()).item()
r["bf16x6_us"] = timeit(lambda: run(pb, W6, D6, dX))
out["head_dgrad"] = r
print("head_dgrad", json.dumps(r), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
