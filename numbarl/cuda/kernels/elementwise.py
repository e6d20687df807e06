"""Elementwise kernels: fill, copy, scale, axpy, add, activations (forward and backward), bias add.

API (every launcher takes the stream; none allocates, copies to/from the host or synchronizes,
so all are safe inside a graph capture; arrays are numba device arrays)::

    fill(x, value, stream)                    # x[:] = value (any dtype)
    fill_bytes_zero(buf, stream)              # every byte of a contiguous array = 0
    copy(src, dst, stream)                    # dst[:] = src (same dtype and size)
    split_tf32(x, hi, lo, stream)             # hi = x rounded to TF32 (10-bit mantissa), lo = x - hi
    scale(x, alpha, stream)                   # x *= alpha
    axpy(alpha, x, y, stream)                 # y += alpha * x
    axpby(alpha, x, beta, y, stream)          # y = alpha * x + beta * y  (Polyak: alpha=tau, beta=1-tau)
    add(a, b, out, stream)                    # out = a + b
    mul(a, b, out, stream)                    # out = a * b
    activation(x, y, act, stream)             # y = f(x)
    activation_backward(x, dy, dx, act, stream)   # dx = dy * f'(x)   (x = the forward *input*)
    relu / silu / gelu / gelu_tanh / tanh / sigmoid (x, y, stream)
    relu_backward / silu_backward / ... (x, dy, dx, stream)
    bias_add(x, bias, y, stream)              # y[r, c] = x[r, c] + bias[c]      x, y: [R, C]
    bias_act(x, bias, y, act, stream, pre=None)   # pre = x + bias (stored if given); y = f(pre)

``alpha`` of scale/axpy is a Python number (frozen into a captured graph) or a float32 device
array whose element 0 is read at run time (per-step values: LR, clip coefficient): use a
one-element view ``buf[k:k+1]`` for a scalar that lives inside a larger buffer.
Float ops take float32 arrays of any contiguous shape (treated as flat vectors); the bias ops
take [R, C] arrays (2-D views may be strided) or contiguous [..., C]. Outputs may alias inputs
(each thread reads and writes only its own elements).

Activations (``act`` is a name or a code from ACTIVATIONS):

    relu(x)      = max(x, 0)                                    (NaN propagates; f'(x) = [x > 0])
    silu(x)      = x * sigmoid(x)                               (Elfwing et al. 2018)
    gelu(x)      = x * Phi(x) = x/2 * (1 + erf(x / sqrt 2))     (exact: PyTorch GELU() default)
    gelu_tanh(x) = x/2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))   (Hendrycks & Gimpel 2016,
                                                                  PyTorch GELU(approximate='tanh'))
    tanh(x), sigmoid(x) = 1 / (1 + exp(-x))                     (computed without overflow)

The scalar math lives in numba ``@njit`` functions (``*_dev``): kernels call them on the device
and host code (CPU reference env, fused kernels elsewhere) can call the same compiled math.
Thread mapping: 1-D grid-stride loops (grid capped at MAX_GRID blocks), so one launch
configuration serves any n.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from numbarl.cuda import launch
from numbarl.cuda.reduce import as_rows
from numbarl.cuda.runtime import cuda  # the backend (GPU or simulator), selected once

_cuda = cuda()

# ---------------------------------------------------------------------------------------------
# constants
# ---------------------------------------------------------------------------------------------
BLOCK = 256
MAX_GRID = 8192  # grid-stride beyond 2M threads

ACT_IDENTITY = 0
ACT_RELU = 1
ACT_SILU = 2
ACT_GELU = 3  # exact (erf)
ACT_GELU_TANH = 4  # tanh approximation
ACT_TANH = 5
ACT_SIGMOID = 6

ACTIVATIONS = {
    "identity": ACT_IDENTITY,
    "relu": ACT_RELU,
    "silu": ACT_SILU,
    "gelu": ACT_GELU,
    "gelu_tanh": ACT_GELU_TANH,
    "tanh": ACT_TANH,
    "sigmoid": ACT_SIGMOID,
}

_ZERO = np.float32(0.0)
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)
_THREE = np.float32(3.0)
_INV_SQRT2 = np.float32(1.0 / math.sqrt(2.0))
_INV_SQRT_2PI = np.float32(1.0 / math.sqrt(2.0 * math.pi))
_SQRT_2_OVER_PI = np.float32(math.sqrt(2.0 / math.pi))
_GELU_C = np.float32(0.044715)
_GELU_TANH_SATURATE = np.float32(10.0)  # |x| beyond which tanh(inner) == +-1 exactly in float32


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def _erf64(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def sigmoid_ref(x):
    x = np.asarray(x, np.float64)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def activation_ref(x, act) -> np.ndarray:
    """f(x) in float64."""
    act = activation_code(act)
    x = np.asarray(x, np.float64)
    if act == ACT_IDENTITY:
        return x.copy()
    if act == ACT_RELU:
        return np.maximum(x, 0.0)
    if act == ACT_SILU:
        return x * sigmoid_ref(x)
    if act == ACT_GELU:
        return 0.5 * x * (1.0 + _erf64(x / math.sqrt(2.0)))
    if act == ACT_GELU_TANH:
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if act == ACT_TANH:
        return np.tanh(x)
    return sigmoid_ref(x)


def activation_grad_ref(x, act) -> np.ndarray:
    """f'(x) in float64 (relu: 1 where x > 0 else 0)."""
    act = activation_code(act)
    x = np.asarray(x, np.float64)
    if act == ACT_IDENTITY:
        return np.ones_like(x)
    if act == ACT_RELU:
        return (x > 0).astype(np.float64)
    if act == ACT_SILU:
        s = sigmoid_ref(x)
        return s * (1.0 + x * (1.0 - s))
    if act == ACT_GELU:
        return 0.5 * (1.0 + _erf64(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    if act == ACT_GELU_TANH:
        k = math.sqrt(2.0 / math.pi)
        t = np.tanh(k * (x + 0.044715 * x**3))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x)
    if act == ACT_TANH:
        return 1.0 - np.tanh(x) ** 2
    s = sigmoid_ref(x)
    return s * (1.0 - s)


def bias_add_ref(x, bias) -> np.ndarray:
    return np.asarray(x, np.float64) + np.asarray(bias, np.float64)


# ---------------------------------------------------------------------------------------------
# device functions (numba @njit: callable from kernels and from host code)
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def sigmoid_dev(x):
    """1 / (1 + exp(-x)) without overflow: exp of a non-positive number only."""
    if x >= _ZERO:
        return _ONE / (_ONE + math.exp(-x))
    e = math.exp(x)
    return e / (_ONE + e)


@njit(cache=True)
def relu_dev(x):
    return _ZERO if x < _ZERO else x  # NaN -> NaN


@njit(cache=True)
def relu_grad_dev(x):
    return _ONE if x > _ZERO else _ZERO


@njit(cache=True)
def silu_dev(x):
    return x * sigmoid_dev(x)


@njit(cache=True)
def silu_grad_dev(x):
    s = sigmoid_dev(x)
    return s * (_ONE + x * (_ONE - s))


@njit(cache=True)
def gelu_dev(x):
    return _HALF * x * (_ONE + math.erf(x * _INV_SQRT2))


@njit(cache=True)
def gelu_grad_dev(x):
    cdf = _HALF * (_ONE + math.erf(x * _INV_SQRT2))
    pdf = math.exp(-_HALF * x * x) * _INV_SQRT_2PI
    return cdf + x * pdf


@njit(cache=True)
def gelu_tanh_dev(x):
    inner = _SQRT_2_OVER_PI * (x + _GELU_C * x * x * x)
    return _HALF * x * (_ONE + math.tanh(inner))


@njit(cache=True)
def gelu_tanh_grad_dev(x):
    # beyond +-10 tanh(inner) is exactly +-1 in float32, the derivative is exactly 1 or 0, and
    # the x^2 factor below would overflow to inf * 0 = NaN for |x| > 1.8e19
    if x > _GELU_TANH_SATURATE:
        return _ONE
    if x < -_GELU_TANH_SATURATE:
        return _ZERO
    x2 = x * x
    t = math.tanh(_SQRT_2_OVER_PI * (x + _GELU_C * x2 * x))
    dinner = _SQRT_2_OVER_PI * (_ONE + _THREE * _GELU_C * x2)
    return _HALF * (_ONE + t) + _HALF * x * (_ONE - t * t) * dinner


@njit(cache=True)
def tanh_dev(x):
    return math.tanh(x)


@njit(cache=True)
def tanh_grad_dev(x):
    t = math.tanh(x)
    return _ONE - t * t


@njit(cache=True)
def sigmoid_grad_dev(x):
    s = sigmoid_dev(x)
    return s * (_ONE - s)


@njit(cache=True)
def activation_dev(act, x):
    """f(x) for an activation code (ACTIVATIONS)."""
    if act == ACT_RELU:
        return relu_dev(x)
    if act == ACT_SILU:
        return silu_dev(x)
    if act == ACT_GELU:
        return gelu_dev(x)
    if act == ACT_GELU_TANH:
        return gelu_tanh_dev(x)
    if act == ACT_TANH:
        return tanh_dev(x)
    if act == ACT_SIGMOID:
        return sigmoid_dev(x)
    return x


@njit(cache=True)
def activation_grad_dev(act, x):
    """f'(x) for an activation code (ACTIVATIONS)."""
    if act == ACT_RELU:
        return relu_grad_dev(x)
    if act == ACT_SILU:
        return silu_grad_dev(x)
    if act == ACT_GELU:
        return gelu_grad_dev(x)
    if act == ACT_GELU_TANH:
        return gelu_tanh_grad_dev(x)
    if act == ACT_TANH:
        return tanh_grad_dev(x)
    if act == ACT_SIGMOID:
        return sigmoid_grad_dev(x)
    return _ONE


# ---------------------------------------------------------------------------------------------
# kernels (1-D grid-stride loops)
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def fill_kernel(x, value):
    i = _cuda.grid(1)
    stride = _cuda.gridsize(1)
    while i < x.size:
        x[i] = value
        i += stride


@_cuda.jit(cache=True)
def copy_kernel(src, dst):
    i = _cuda.grid(1)
    stride = _cuda.gridsize(1)
    while i < dst.size:
        dst[i] = src[i]
        i += stride


_TF32_ROUND = np.uint32(0x0FFF)  # half an ulp of TF32 minus one, in the 13 low mantissa bits it drops
_TF32_KEEP = np.uint32(0xFFFFE000)  # sign, exponent and the 10 mantissa bits TF32 keeps
_U13, _U1 = np.uint32(13), np.uint32(1)


@_cuda.jit(cache=True)
def split_tf32_kernel(x, xu, hi, hiu, lo):
    """hi = x rounded to the nearest TF32 (ties to even, on the bits: xu / hiu are uint32 views of x / hi),
    lo = x - hi (exact in float32: hi and x share the exponent or are one binade apart)."""
    i = _cuda.grid(1)
    stride = _cuda.gridsize(1)
    while i < x.size:
        b = xu[i]
        hiu[i] = (b + _TF32_ROUND + ((b >> _U13) & _U1)) & _TF32_KEEP
        lo[i] = x[i] - hi[i]
        i += stride


@_cuda.jit(cache=True)
def scale_kernel(x, alpha):
    i = _cuda.grid(1)
    stride = _cuda.gridsize(1)
    while i < x.size:
        x[i] = x[i] * alpha
        i += stride


@_cuda.jit(cache=True)
def scale_device_kernel(x, alpha_dev):
    alpha = alpha_dev[0]
    i = _cuda.grid(1)
    stride = _cuda.gridsize(1)
    while i < x.size:
        x[i] = x[i] * alpha
        i += stride


@_cuda.jit(cache=True)
def axpby_kernel(alpha, x, beta, y):
    i = _cuda.grid(1)
    stride = _cuda.gridsize(1)
    while i < y.size:
        y[i] = alpha * x[i] + beta * y[i]
        i += stride


@_cuda.jit(cache=True)
def axpy_kernel(alpha, x, y):
    i = _cuda.grid(1)
    stride = _cuda.gridsize(1)
    while i < y.size:
        y[i] = y[i] + alpha * x[i]
        i += stride


@_cuda.jit(cache=True)
def axpy_device_kernel(alpha_dev, x, y):
    alpha = alpha_dev[0]
    i = _cuda.grid(1)
    stride = _cuda.gridsize(1)
    while i < y.size:
        y[i] = y[i] + alpha * x[i]
        i += stride


@_cuda.jit(cache=True)
def add_kernel(a, b, out):
    i = _cuda.grid(1)
    stride = _cuda.gridsize(1)
    while i < out.size:
        out[i] = a[i] + b[i]
        i += stride


@_cuda.jit(cache=True)
def mul_kernel(a, b, out):
    i = _cuda.grid(1)
    stride = _cuda.gridsize(1)
    while i < out.size:
        out[i] = a[i] * b[i]
        i += stride


@_cuda.jit(cache=True)
def activation_kernel(x, y, act):
    i = _cuda.grid(1)
    stride = _cuda.gridsize(1)
    while i < y.size:
        y[i] = activation_dev(act, x[i])
        i += stride


@_cuda.jit(cache=True)
def activation_backward_kernel(x, dy, dx, act):
    i = _cuda.grid(1)
    stride = _cuda.gridsize(1)
    while i < dx.size:
        dx[i] = dy[i] * activation_grad_dev(act, x[i])
        i += stride


@_cuda.jit(cache=True)
def bias_act_kernel(x, bias, pre, y, act, store_pre):
    """pre[r, c] = x[r, c] + bias[c] (stored when store_pre); y[r, c] = f(pre[r, c])."""
    n_rows, n_cols = y.shape
    n = n_rows * n_cols
    i = _cuda.grid(1)
    stride = _cuda.gridsize(1)
    while i < n:
        r = i // n_cols
        c = i - r * n_cols
        v = x[r, c] + bias[c]
        if store_pre:
            pre[r, c] = v
        y[r, c] = activation_dev(act, v)
        i += stride


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------
def activation_code(act) -> int:
    """Activation name (ACTIVATIONS) or code -> code."""
    if isinstance(act, (int, np.integer)) and int(act) in ACTIVATIONS.values():
        return int(act)
    try:
        return ACTIVATIONS[act]
    except (KeyError, TypeError):
        raise ValueError(f"unknown activation {act!r}; choose one of {sorted(ACTIVATIONS)}") from None


def grid_for(n: int) -> int:
    """Blocks for a grid-stride launch over n elements."""
    return max(1, min(-(-int(n) // BLOCK), MAX_GRID))


def stride_launch(n: int) -> tuple[int, int]:
    """(blocks, threads) of a grid-stride launch over n elements: grid_for(n) x BLOCK on a GPU, one block
    of 32 under the simulator (every simulated thread is a Python thread; the kernel's loop does the rest)."""
    return launch.shape(gpu=grid_for(n), sim=1), launch.shape(gpu=BLOCK, sim=32)


def _flat(x, what: str):
    if x.ndim == 1:
        return x
    if not x.is_c_contiguous():
        raise ValueError(f"{what}: a {x.ndim}-D array of shape {x.shape} must be C-contiguous")
    return x.reshape(x.size)


def _f32(x, what: str):
    if x.dtype != np.float32:
        raise TypeError(f"{what}: expected float32, got {x.dtype}")
    return _flat(x, what)


def _same_size(what: str, *arrays):
    sizes = {a.size for a in arrays}
    if len(sizes) != 1:
        raise ValueError(f"{what}: arrays differ in size {[tuple(a.shape) for a in arrays]}")


def _is_device_scalar(alpha) -> bool:
    if isinstance(alpha, (int, float, np.number)):
        return False
    if getattr(alpha, "ndim", None) is None:
        raise TypeError(f"expected a number or a float32 device array for a scalar, got {type(alpha).__name__}")
    if alpha.dtype != np.float32 or alpha.size < 1:
        raise TypeError(f"a device scalar must be a non-empty float32 device array, got {alpha.dtype} {alpha.shape}")
    return True


def fill(x, value, stream):
    """x[:] = value (cast to x's dtype); x any contiguous device array."""
    x1 = _flat(x, "fill")
    fill_kernel[grid_for(x1.size), BLOCK, stream](x1, x1.dtype.type(value))


def _address(x) -> int:
    ptr = getattr(x, "device_ctypes_pointer", None)
    if ptr is not None and getattr(ptr, "value", None) is not None:
        return int(ptr.value)
    return int(x.__array_interface__["data"][0])  # simulator: a numpy array underneath


def fill_bytes_zero(buf, stream):
    """Zero every byte of a contiguous device array (4-byte stores when size and address allow)."""
    b = _flat(buf, "fill_bytes_zero")
    if b.dtype != np.uint8:
        b = b.view(np.uint8)
    if b.size == 0:
        return
    if b.size % 4 == 0 and _address(b) % 4 == 0:
        words = b.view(np.uint32)
        fill_kernel[grid_for(words.size), BLOCK, stream](words, np.uint32(0))
    else:
        fill_kernel[grid_for(b.size), BLOCK, stream](b, np.uint8(0))


def copy(src, dst, stream):
    """dst[:] = src; same dtype and size, both contiguous."""
    s1, d1 = _flat(src, "copy"), _flat(dst, "copy")
    if s1.dtype != d1.dtype:
        raise TypeError(f"copy: dtypes differ ({s1.dtype} -> {d1.dtype})")
    _same_size("copy", s1, d1)
    copy_kernel[grid_for(d1.size), BLOCK, stream](s1, d1)


def split_tf32_ref(x) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) of split_tf32 on the host: the same bit arithmetic in numpy (finite inputs)."""
    x = np.ascontiguousarray(x, np.float32)
    b = x.view(np.uint32)
    hi = ((b + _TF32_ROUND + ((b >> _U13) & _U1)) & _TF32_KEEP).astype(np.uint32).view(np.float32)
    return hi, (x - hi).astype(np.float32)


def split_tf32(x, hi, lo, stream):
    """hi = x rounded to TF32 (its low 13 mantissa bits zero, round to nearest even), lo = x − hi: the two
    operands of a split ("3xTF32") product, x·y ≈ hi_x·hi_y + hi_x·lo_y + lo_x·hi_y, whose three TF32 tensor-core
    GEMMs reach close to float32 accuracy (the dropped lo·lo term is ~2⁻²² of x·y; numbarl.bench.gemm
    --split-tf32).
    float32 arrays of one size, C-contiguous; finite x (an x within half a TF32 ulp of the float32 maximum rounds to
    inf)."""
    x1, h1, l1 = _flat(x, "split_tf32"), _flat(hi, "split_tf32"), _flat(lo, "split_tf32")
    for a in (x1, h1, l1):
        if a.dtype != np.float32:
            raise TypeError(f"split_tf32: arrays must be float32, got {a.dtype}")
    _same_size("split_tf32", x1, h1)
    _same_size("split_tf32", x1, l1)
    split_tf32_kernel[grid_for(x1.size), BLOCK, stream](x1, x1.view(np.uint32), h1, h1.view(np.uint32), l1)


def scale(x, alpha, stream):
    """x *= alpha; alpha a number or a float32 device array (element 0 read at run time)."""
    x1 = _f32(x, "scale")
    if _is_device_scalar(alpha):
        scale_device_kernel[grid_for(x1.size), BLOCK, stream](x1, alpha)
    else:
        scale_kernel[grid_for(x1.size), BLOCK, stream](x1, np.float32(alpha))


def axpy(alpha, x, y, stream):
    """y += alpha * x; alpha a number or a float32 device array (element 0 read at run time)."""
    x1, y1 = _f32(x, "axpy"), _f32(y, "axpy")
    _same_size("axpy", x1, y1)
    if _is_device_scalar(alpha):
        axpy_device_kernel[grid_for(y1.size), BLOCK, stream](alpha, x1, y1)
    else:
        axpy_kernel[grid_for(y1.size), BLOCK, stream](np.float32(alpha), x1, y1)


def axpby(alpha, x, beta, y, stream):
    """y = alpha * x + beta * y (numbers; e.g. Polyak target update alpha=tau, beta=1-tau)."""
    x1, y1 = _f32(x, "axpby"), _f32(y, "axpby")
    _same_size("axpby", x1, y1)
    axpby_kernel[grid_for(y1.size), BLOCK, stream](np.float32(alpha), x1, np.float32(beta), y1)


def add(a, b, out, stream):
    """out = a + b (float32, same sizes)."""
    a1, b1, o1 = _f32(a, "add"), _f32(b, "add"), _f32(out, "add")
    _same_size("add", a1, b1, o1)
    add_kernel[grid_for(o1.size), BLOCK, stream](a1, b1, o1)


def mul(a, b, out, stream):
    """out = a * b (float32, same sizes)."""
    a1, b1, o1 = _f32(a, "mul"), _f32(b, "mul"), _f32(out, "mul")
    _same_size("mul", a1, b1, o1)
    mul_kernel[grid_for(o1.size), BLOCK, stream](a1, b1, o1)


def activation(x, y, act, stream):
    """y = f(x) elementwise (float32, same sizes; y may be x)."""
    code = activation_code(act)
    x1, y1 = _f32(x, "activation"), _f32(y, "activation")
    _same_size("activation", x1, y1)
    activation_kernel[grid_for(y1.size), BLOCK, stream](x1, y1, code)


def activation_backward(x, dy, dx, act, stream):
    """dx = dy * f'(x), x the forward input (pre-activation); dx may alias dy."""
    code = activation_code(act)
    x1, dy1, dx1 = _f32(x, "activation_backward"), _f32(dy, "activation_backward"), _f32(dx, "activation_backward")
    _same_size("activation_backward", x1, dy1, dx1)
    activation_backward_kernel[grid_for(dx1.size), BLOCK, stream](x1, dy1, dx1, code)


def relu(x, y, stream):
    activation(x, y, ACT_RELU, stream)


def relu_backward(x, dy, dx, stream):
    activation_backward(x, dy, dx, ACT_RELU, stream)


def silu(x, y, stream):
    activation(x, y, ACT_SILU, stream)


def silu_backward(x, dy, dx, stream):
    activation_backward(x, dy, dx, ACT_SILU, stream)


def gelu(x, y, stream):
    """Exact GELU (erf)."""
    activation(x, y, ACT_GELU, stream)


def gelu_backward(x, dy, dx, stream):
    activation_backward(x, dy, dx, ACT_GELU, stream)


def gelu_tanh(x, y, stream):
    """GELU, tanh approximation."""
    activation(x, y, ACT_GELU_TANH, stream)


def gelu_tanh_backward(x, dy, dx, stream):
    activation_backward(x, dy, dx, ACT_GELU_TANH, stream)


def tanh(x, y, stream):
    activation(x, y, ACT_TANH, stream)


def tanh_backward(x, dy, dx, stream):
    activation_backward(x, dy, dx, ACT_TANH, stream)


def sigmoid(x, y, stream):
    activation(x, y, ACT_SIGMOID, stream)


def sigmoid_backward(x, dy, dx, stream):
    activation_backward(x, dy, dx, ACT_SIGMOID, stream)


def _rows_f32(x, what: str):
    x2 = as_rows(x, what)
    if x2.dtype != np.float32:
        raise TypeError(f"{what}: expected float32, got {x2.dtype}")
    return x2


def bias_act(x, bias, y, act, stream, pre=None):
    """pre = x + bias[None, :] (written when `pre` is given); y = f(pre). x, y, pre: [R, C].

    The fused forward of a linear layer's bias + activation that keeps the pre-activation for
    the backward pass. y may alias x.
    """
    code = activation_code(act)
    x2, y2 = _rows_f32(x, "bias_act"), _rows_f32(y, "bias_act")
    if bias.dtype != np.float32 or bias.ndim != 1:
        raise TypeError(f"bias_act: bias must be a 1-D float32 device array, got {bias.dtype} {bias.shape}")
    if x2.shape != y2.shape or bias.shape[0] != x2.shape[1]:
        raise ValueError(f"bias_act: shapes x {tuple(x2.shape)}, y {tuple(y2.shape)}, bias {tuple(bias.shape)} do not match")
    if pre is None:
        pre2, store = y2, False  # never written
    else:
        pre2, store = _rows_f32(pre, "bias_act"), True
        if pre2.shape != x2.shape:
            raise ValueError(f"bias_act: pre has shape {tuple(pre2.shape)}, expected {tuple(x2.shape)}")
    bias_act_kernel[grid_for(x2.shape[0] * x2.shape[1]), BLOCK, stream](x2, bias, pre2, y2, code, store)


def bias_add(x, bias, y, stream):
    """y[r, c] = x[r, c] + bias[c] (y may be x)."""
    bias_act(x, bias, y, ACT_IDENTITY, stream)
