"""Arena: planning, alignment, fixed-address views, flat view, load/to_host, clear errors."""

import numpy as np
import pytest

from numbarl.cuda.runtime import ALIGN_BYTES, Arena, DeviceMemoryError, cuda, memory_info, stream

_cuda = cuda()


def _address(x):
    if hasattr(x, "_ary"):  # simulator
        return x._ary.__array_interface__["data"][0]
    return x.__cuda_array_interface__["data"][0]


def test_views_are_aligned_typed_and_fixed(rng):
    a = Arena("params")
    a.add("w1", (5, 7), np.float32)
    a.add("b1", 7, np.float32)
    a.add("steps", (3,), np.int64)
    offsets = [v.offset for v in a.views.values()]
    assert offsets == [0, ALIGN_BYTES, 2 * ALIGN_BYTES]
    assert a.nbytes == 2 * ALIGN_BYTES + 3 * 8
    a.allocate()
    w1 = a["w1"]
    assert w1.shape == (5, 7) and w1.dtype == np.float32 and a["b1"].shape == (7,)
    assert a["w1"] is w1  # cached view: the same object, the same address
    base = _address(a.buffer())
    assert _address(a["b1"]) - base == ALIGN_BYTES and _address(a["steps"]) - base == 2 * ALIGN_BYTES
    values = {"w1": rng.standard_normal((5, 7)).astype(np.float32), "b1": rng.standard_normal(7).astype(np.float32),
              "steps": np.array([1, 2, 3], np.int64)}
    a.load(values)
    host = a.to_host()
    for k, v in values.items():
        np.testing.assert_array_equal(host[k], v)
    assert "w1" in a and "w9" not in a
    assert "w1" in a.plan() and "arena params" in a.plan()


def test_flat_sees_every_view_and_zero_padding(rng):
    a = Arena("grads")
    a.add("x", (3,), np.float32)
    a.add("y", (2, 2), np.float32)
    a.allocate()
    a.load({"x": np.array([1, 2, 3], np.float32), "y": np.full((2, 2), 4, np.float32)})
    flat = a.flat(np.float32).copy_to_host()
    assert flat.size == a.buffer().size // 4
    assert flat.sum() == 1 + 2 + 3 + 16  # padding stays zero
    np.testing.assert_array_equal(flat[ALIGN_BYTES // 4: ALIGN_BYTES // 4 + 4], 4)


def test_errors_are_clear():
    a = Arena("acts")
    a.add("h", (4,), np.float32)
    with pytest.raises(RuntimeError, match="not allocated"):
        a["h"]
    with pytest.raises(ValueError, match="already has a view"):
        a.add("h", (4,))
    with pytest.raises(ValueError, match="negative"):
        a.add("bad", (-1, 3))
    a.allocate()
    with pytest.raises(RuntimeError, match="already allocated"):
        a.add("late", (2,))
    with pytest.raises(KeyError, match="no view 'g'"):
        a["g"]
    with pytest.raises(ValueError, match="expects shape"):
        a.load({"h": np.zeros(5, np.float32)})
    free, _ = memory_info()
    big = Arena("replay")
    big.add("transitions", (free // 4 + 1024,), np.float32)
    with pytest.raises(DeviceMemoryError, match="reduce the configuration") as e:
        big.allocate()
    assert f"{big.nbytes:,}" in str(e.value)
    assert not big.allocated


def test_empty_arena_and_zeroing():
    a = Arena("env")
    a.allocate()
    assert a.allocated and a.buffer().size == ALIGN_BYTES
    b = Arena("zeroed")
    b.add("v", (9,), np.int32)
    b.allocate()
    assert (b["v"].copy_to_host() == 0).all()
    stream().synchronize()


def test_runtime_self_check_passes():
    # the README's first command may run this; on the simulator it runs only the checks
    from numbarl.bench import runtime as bench

    assert bench.main(["--check"]) == 0
