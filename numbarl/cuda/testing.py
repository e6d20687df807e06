"""Helpers for checking kernels against numpy references (tests and benchmark self-checks).

    d = to_device(x, s); kernel[grid, block, s](d, ...); got = to_host(d, s)
    assert_close(got, ref, atol=1e-6, rtol=1e-5)     # |got - ref| <= atol + rtol·|ref|, NaN/inf exact
    assert_fd_gradient(loss, arr, grad, picks, atol, rtol)  # a float64 reference's gradient by central differences
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda.runtime import cuda


def to_device(x, s):
    """Copy a host array to the device on stream s (contiguous first)."""
    return cuda().to_device(np.ascontiguousarray(x), stream=s)


def to_host(d, s):
    """Copy a device array to the host on stream s and wait for it."""
    out = d.copy_to_host(stream=s)
    s.synchronize()
    return out


def assert_close(got, ref, atol, rtol):
    """Elementwise |got − ref| ≤ atol + rtol·|ref| (float64), NaN positions and infinities equal."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg="NaN positions differ")
    inf = np.isinf(ref)
    np.testing.assert_array_equal(got[inf], ref[inf], err_msg="infinities differ")
    ok = ~np.isnan(ref) & ~inf
    err = np.abs(got[ok] - ref[ok])
    bound = atol + rtol * np.abs(ref[ok])
    assert np.all(err <= bound), f"max error {err.max() if err.size else 0:.3g} (atol {atol}, rtol {rtol})"


def assert_fd_gradient(loss, arr, grad, picks, atol, rtol, eps=1e-6, label=""):
    """grad = ∂loss/∂arr at the flat indices ``picks``, against central differences: each entry of arr is
    moved by ±eps in place (loss() reads arr), then restored; |grad − numeric| ≤ atol + rtol·|numeric|."""
    flat = arr.reshape(-1)
    assert np.shares_memory(flat, arr), "arr must be contiguous: the loss reads it in place"
    g = np.asarray(grad).reshape(-1)
    for i in picks:
        old = flat[i]
        flat[i] = old + eps
        up = loss()
        flat[i] = old - eps
        down = loss()
        flat[i] = old
        numeric = (up - down) / (2 * eps)
        assert abs(g[i] - numeric) <= atol + rtol * abs(numeric), f"{label}[{i}]: {g[i]} vs {numeric}"
