"""Tuned cuBLASLt algorithms on the GPU (NUMBARL_GEMM_TUNING, numbarl-bench gemm): a plan takes the
tuning file's candidate, its result agrees with the float64 product, two runs give the same bits,
and the bench writes a file a later plan accepts."""

import json

import numpy as np
import pytest

from numbarl.cuda import blas
from numbarl.cuda.runtime import cuda, stream

pytestmark = pytest.mark.gpu
_cuda = cuda()


@pytest.fixture
def fresh_plans(monkeypatch):
    monkeypatch.setattr(blas, "_PLANS", {})
    monkeypatch.delenv("NUMBARL_GEMM_TUNING", raising=False)
    blas.clear_tuning()
    yield
    blas.clear_tuning()


def _gemm(A, B, compute="fp32"):
    C = _cuda.device_array((A.shape[0], B.shape[1]), np.float32)
    blas.gemm(A, B, C, epilogue="relu", bias=_cuda.to_device(np.zeros(B.shape[1], np.float32)), compute=compute,
              stream=stream())
    stream().synchronize()
    return C.copy_to_host()


def test_tuned_candidate_is_used_correct_and_deterministic(rng, fresh_plans, tmp_path, monkeypatch):
    a = rng.standard_normal((4096, 512)).astype(np.float32)
    b = rng.standard_normal((512, 765)).astype(np.float32)
    A, B = _cuda.to_device(a), _cuda.to_device(b)
    first = _gemm(A, B)
    (key, plan) = next(iter(blas._PLANS.items()))
    found = plan.candidates(8)
    if len(found) < 2:
        pytest.skip("the heuristic offers one algorithm for this geometry")
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"identity": blas.tuning_identity(),
                                "plans": {blas.plan_key_text(key): {"index": len(found) - 1}}}))
    monkeypatch.setattr(blas, "_PLANS", {})
    assert blas.load_tuning(path) == 1
    tuned = _gemm(A, B)
    (plan,) = blas._PLANS.values()
    assert plan.algo_index == len(found) - 1 and blas.tuning_info()["applied"] == 1
    want = np.maximum(a.astype(np.float64) @ b, 0.0)
    np.testing.assert_allclose(tuned, want, rtol=2e-5, atol=2e-4)
    np.testing.assert_allclose(first, want, rtol=2e-5, atol=2e-4)
    np.testing.assert_array_equal(_gemm(A, B), tuned)  # same algorithm, same bits


def test_bench_writes_a_tuning_file_later_plans_accept(fresh_plans, tmp_path, monkeypatch):
    from numbarl.bench import gemm as bench

    out = tmp_path / "tuning.json"
    code = bench.main(["--compute", "fp32", "--candidates", "3", "--iters", "3", "--repeats", "2", "--batch", "1024",
                       "--n-envs", "1024", "--trunk", "64,64", "--bars", "5000", "--min-gain", "0",
                       "--write-tuning", str(out), "--json", str(tmp_path / "r.json")])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["identity"] == blas.tuning_identity()
    results = json.loads((tmp_path / "r.json").read_text())
    rows = results["computes"]["fp32"]["plans"]
    assert rows and all(r["calls"]["train"] + r["calls"]["collect"] > 0 for r in rows)
    assert all(r["best_us"] <= r["first_us"] for r in rows)
    monkeypatch.setattr(blas, "_PLANS", {})
    assert blas.load_tuning(out) == len(doc["plans"])
