"""MappedBuffer: kernels write, the host reads after record/read; misuse is an error."""

import numpy as np
import pytest

from numbarl.cuda.mapped import MappedBuffer
from numbarl.cuda.runtime import cuda, stream

_cuda = cuda()


@_cuda.jit(cache=True)
def write_stats_kernel(x, stats):
    """stats[0] = sum(x), stats[1] = max(x) (one thread: fixed order), stats[2] = len(x)."""
    if _cuda.grid(1) != 0:
        return
    s = x[0]
    m = x[0]
    for i in range(1, x.shape[0]):
        s += x[i]
        m = max(m, x[i])
    stats[0] = s
    stats[1] = m
    stats[2] = x.shape[0]


def test_kernel_writes_host_reads(rng):
    x = rng.standard_normal(13).astype(np.float32)
    buf = MappedBuffer(3)
    assert len(buf) == 3 and buf.host.dtype == np.float32 and (buf.host == 0).all()
    s = stream()
    write_stats_kernel[1, 1, s](_cuda.to_device(x), buf.device)
    buf.record(s)
    got = buf.read()
    np.testing.assert_allclose(got, [x.astype(np.float64).sum(), x.max(), 13], rtol=1e-5, atol=1e-5)
    got[0] = 123.0  # read() returns a copy
    assert buf.host[0] != 123.0


def test_read_before_record_is_an_error():
    buf = MappedBuffer(2, dtype=np.int32)
    with pytest.raises(RuntimeError, match="before record"):
        buf.read()


def test_reset_and_dtype():
    buf = MappedBuffer(4, dtype=np.int64)
    buf.reset(7)
    buf.record(stream())
    assert buf.read().tolist() == [7, 7, 7, 7] and buf.read().dtype == np.int64
    with pytest.raises(ValueError, match="n >= 1"):
        MappedBuffer(0)
