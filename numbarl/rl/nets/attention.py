"""Causal multi-head self-attention and the pre-LN transformer block, on the module contract.

Shapes. A batch of B sequences of T tokens of width E is stored flat, row-major, one token per row:
x [B·T, E] (row b·T + i = token i of sequence b). H heads of width d = E / H.

Attention core (:class:`CausalAttentionCore`, no parameters; Vaswani et al. 2017, Eq. 1, with the
causal mask of Radford et al. 2018). Its input is the fused projection qkv [B·T, 3E]: columns
[0, E) are the queries, [E, 2E) the keys, [2E, 3E) the values; head h reads columns h·d .. h·d + d − 1
of each. Per sequence b, head h, query i::

    s_ij  = c · q_i · k_j             for j <= i (c = 1 / sqrt(d))
    P_ij  = exp(s_ij − max_j s) / Σ_{j'<=i} exp(s_ij' − max_j s)      0 for j > i
    o_i   = Σ_{j<=i} P_ij v_j         written to columns h·d .. h·d + d − 1 of y [B·T, E]

Backward from dy = ∂L/∂o (softmax Jacobian: dS_ij = P_ij (dP_ij − Σ_j' P_ij' dP_ij'))::

    dP_ij = dy_i · v_j       dS_ij = P_ij (dP_ij − Σ_{j'} P_ij' dP_ij')
    dq_i  = c Σ_{j<=i} dS_ij k_j        (kernel 1, one thread per (b, h, i): a query row)
    dk_j  = c Σ_{i>=j} dS_ij q_i        (kernel 2, one thread per (b, h, j): a key row)
    dv_j  = Σ_{i>=j} P_ij dy_i

Every sum is a loop in a fixed order inside one thread and every output element has exactly one
writer: no atomics, the same bits every run. T is small here (the Decision Transformer's 3·L
tokens, L <= 64: MAX_TOKENS), so a thread holds a row of scores in a local array.

Multi-head attention (:func:`causal_self_attention`) is a Stack (a Sequential whose parameter names
are a dict, so it nests) of Linear E→3E, the core, Linear E→E.
The output projection y = concat_h(o_h) · W_o is Σ_h o_h · W_o[h·d:(h+1)·d, :]: the per-head
output then the head sum, done by the GEMM's reduction over k (one pinned cuBLASLt algorithm per
shape, numbarl/cuda/blas.py, or the fixed-order fallbacks: the same order every run). Its weight gradients are
GEMMs xᵀ·dy over the token rows (numbarl/rl/nets/linear.py): no atomics either.

Transformer block (:func:`transformer_block`, pre-LN as GPT-2, Radford et al. 2019 §2.3)::

    h = x + Attn(LN1(x))          y = h + W2 · act(W1 · LN2(h) + b1) + b2     (MLP width 4E)

:class:`Residual` is y = x + f(x) for any inner module f: backward dx = dy + f'ᵀ dy.
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda.kernels import elementwise
from numbarl.cuda.launch import blocks
from numbarl.cuda.runtime import cuda
from numbarl.rl.nets.layernorm import LayerNorm
from numbarl.rl.nets.linear import Linear
from numbarl.rl.nets.module import Buf, Ctx, Module, Sequential

_cuda = cuda()  # the backend (GPU or simulator), selected once

BLOCK = 64  # threads per block of the attention kernels (one thread per (sequence, head, row))
MAX_TOKENS = 192  # tokens per sequence a thread's local score row holds (3 · 64 DT steps)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def attention_forward_ref(qkv, n_tokens: int, n_heads: int):
    """(y [B·T, E], probs [B, H, T, T]) in float64 for the fused qkv [B·T, 3E]."""
    qkv = np.asarray(qkv, np.float64)
    T, H = int(n_tokens), int(n_heads)
    E = qkv.shape[1] // 3
    d = E // H
    B = qkv.shape[0] // T
    q, k, v = (qkv[:, i * E:(i + 1) * E].reshape(B, T, H, d).transpose(0, 2, 1, 3) for i in range(3))  # [B, H, T, d]
    s = np.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(d)
    causal = np.tril(np.ones((T, T), bool))
    s = np.where(causal, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    o = np.einsum("bhij,bhjd->bhid", p, v)  # [B, H, T, d]
    return o.transpose(0, 2, 1, 3).reshape(B * T, E), p


def attention_backward_ref(dy, qkv, probs, n_tokens: int, n_heads: int):
    """d qkv [B·T, 3E] in float64 (module docstring)."""
    qkv = np.asarray(qkv, np.float64)
    T, H = int(n_tokens), int(n_heads)
    E = qkv.shape[1] // 3
    d = E // H
    B = qkv.shape[0] // T
    q, k, v = (qkv[:, i * E:(i + 1) * E].reshape(B, T, H, d).transpose(0, 2, 1, 3) for i in range(3))
    do = np.asarray(dy, np.float64).reshape(B, T, H, d).transpose(0, 2, 1, 3)
    dp = np.einsum("bhid,bhjd->bhij", do, v)
    ds = probs * (dp - (probs * dp).sum(axis=-1, keepdims=True))
    c = 1.0 / math.sqrt(d)
    dq = c * np.einsum("bhij,bhjd->bhid", ds, k)
    dk = c * np.einsum("bhij,bhid->bhjd", ds, q)
    dv = np.einsum("bhij,bhid->bhjd", probs, do)
    return np.concatenate([g.transpose(0, 2, 1, 3).reshape(B * T, E) for g in (dq, dk, dv)], axis=1)


# ---------------------------------------------------------------------------------------------
# device functions
# ---------------------------------------------------------------------------------------------
@_cuda.jit(device=True, inline=True)
def thread_row_dev(t, T, H, E):
    """(sequence b, head h, row i, head width d = E / H, token row b·T + i) of thread t over the (b, h, i)
    of T tokens, H heads and width E: i fastest, then h, then b."""
    b = t // (T * H)
    i = t % T
    return b, (t // T) % H, i, E // H, b * T + i


@_cuda.jit(device=True, inline=True)
def row_dot_dev(a, row_a, col_a, x, row_x, col_x, d):
    """Σ_c a[row_a, col_a + c]·x[row_x, col_x + c] in order c = 0..d−1."""
    acc = np.float32(0.0)
    for c in range(d):
        acc += a[row_a, col_a + c] * x[row_x, col_x + c]
    return acc


@_cuda.jit(device=True, inline=True)
def weighted_rows_dev(w, b, h, i, x, first_row, col):
    """Σ_{j<=i} w[b, h, i, j]·x[first_row + j, col] in order j = 0..i (a causal row of weights times
    a column of the sequence's token rows)."""
    acc = np.float32(0.0)
    for j in range(i + 1):
        acc += w[b, h, i, j] * x[first_row + j, col]
    return acc


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def attention_forward_kernel(qkv, n_tokens, n_heads, scale, probs, y):
    """One thread per (sequence b, head h, query i): the causal softmax row and the output row."""
    t = _cuda.grid(1)
    if t >= probs.shape[0] * n_heads * n_tokens:
        return
    b, h, i, d, row = thread_row_dev(t, n_tokens, n_heads, y.shape[1])
    T, E = n_tokens, y.shape[1]
    qo = h * d
    ko = E + h * d
    vo = 2 * E + h * d
    s = _cuda.local.array(MAX_TOKENS, np.float32)
    m = np.float32(-3.0e38)
    for j in range(i + 1):
        s[j] = row_dot_dev(qkv, row, qo, qkv, b * T + j, ko, d) * scale
        m = max(m, s[j])
    z = np.float32(0.0)
    for j in range(i + 1):
        s[j] = math.exp(s[j] - m)
        z += s[j]
    inv = np.float32(1.0) / z
    for j in range(T):
        probs[b, h, i, j] = s[j] * inv if j <= i else np.float32(0.0)
    for c in range(d):
        y[row, qo + c] = weighted_rows_dev(probs, b, h, i, qkv, b * T, vo + c)


@_cuda.jit(cache=True)
def attention_backward_query_kernel(qkv, probs, dy, n_tokens, n_heads, scale, dscores, dqkv):
    """One thread per (b, h, query i): dS row i (saved for kernel 2) and dq_i."""
    t = _cuda.grid(1)
    if t >= probs.shape[0] * n_heads * n_tokens:
        return
    b, h, i, d, row = thread_row_dev(t, n_tokens, n_heads, dy.shape[1])
    T, E = n_tokens, dy.shape[1]
    vo = 2 * E + h * d
    dot = np.float32(0.0)  # Σ_j P_ij dP_ij
    for j in range(i + 1):
        acc = row_dot_dev(dy, row, h * d, qkv, b * T + j, vo, d)
        dscores[b, h, i, j] = acc  # dP_ij for now
        dot += probs[b, h, i, j] * acc
    for j in range(T):
        dscores[b, h, i, j] = probs[b, h, i, j] * (dscores[b, h, i, j] - dot) if j <= i else np.float32(0.0)
    for c in range(d):
        dqkv[row, h * d + c] = weighted_rows_dev(dscores, b, h, i, qkv, b * T, E + h * d + c) * scale


@_cuda.jit(cache=True)
def attention_backward_key_kernel(qkv, probs, dy, dscores, n_tokens, n_heads, scale, dqkv):
    """One thread per (b, h, key j): dk_j and dv_j (sums over the queries i >= j in order)."""
    t = _cuda.grid(1)
    if t >= probs.shape[0] * n_heads * n_tokens:
        return
    b, h, j, d, row = thread_row_dev(t, n_tokens, n_heads, dy.shape[1])
    T, E = n_tokens, dy.shape[1]
    for c in range(d):
        acc_k = np.float32(0.0)
        acc_v = np.float32(0.0)
        for i in range(j, T):
            acc_k += dscores[b, h, i, j] * qkv[b * T + i, h * d + c]
            acc_v += probs[b, h, i, j] * dy[b * T + i, h * d + c]
        dqkv[row, E + h * d + c] = acc_k * scale
        dqkv[row, 2 * E + h * d + c] = acc_v


# ---------------------------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------------------------
class CausalAttentionCore(Module):
    """softmax(c·q·kᵀ + causal mask)·v per head, from the fused qkv [B·T, 3E] to y [B·T, E]."""

    def __init__(self, name: str, dim: int, n_heads: int, n_tokens: int):
        super().__init__(name)
        self.dim, self.n_heads, self.n_tokens = int(dim), int(n_heads), int(n_tokens)
        if self.n_heads < 1 or self.dim % self.n_heads != 0:
            raise ValueError(f"{name}: the width {dim} must be a multiple of the head count {n_heads}")
        if not 1 <= self.n_tokens <= MAX_TOKENS:
            raise ValueError(f"{name}: tokens per sequence must be in [1, {MAX_TOKENS}] (got {n_tokens})")
        self.scale = np.float32(1.0 / math.sqrt(self.dim // self.n_heads))

    @property
    def out_dim(self) -> int:
        return self.dim

    def _sequences(self, batch: int) -> int:
        if batch % self.n_tokens != 0:
            raise ValueError(f"{self.name}: {batch} token rows are not whole sequences of {self.n_tokens} tokens")
        return batch // self.n_tokens

    def in_shape(self, batch: int) -> tuple:
        return (batch, 3 * self.dim)

    def buffers(self, batch: int, backward: bool, **opts) -> list[Buf]:
        S, H, T = self._sequences(batch), self.n_heads, self.n_tokens
        bufs = [Buf("y", (batch, self.dim)), Buf("probs", (S, H, T, T))]
        if backward:
            bufs += [Buf("dscores", (S, H, T, T)), Buf("dx", (batch, 3 * self.dim))]
        return bufs

    def _grid(self, c: Ctx):
        n = self._sequences(c.batch) * self.n_heads * self.n_tokens
        threads = min(BLOCK, n)
        return blocks(n, threads), threads

    def forward_impl(self, c: Ctx, x):
        g, b = self._grid(c)
        attention_forward_kernel[g, b, c.stream](x, np.int64(self.n_tokens), np.int64(self.n_heads), self.scale,
                                                 c.buf("probs"), c.buf("y"))
        return c.buf("y")

    def backward_impl(self, c: Ctx, dy, dx):
        g, b = self._grid(c)
        T, H = np.int64(self.n_tokens), np.int64(self.n_heads)
        attention_backward_query_kernel[g, b, c.stream](c.x(), c.buf("probs"), dy, T, H, self.scale, c.buf("dscores"),
                                                        dx)
        attention_backward_key_kernel[g, b, c.stream](c.x(), c.buf("probs"), dy, c.buf("dscores"), T, H, self.scale,
                                                      dx)
        return dx

    def forward_ref(self, x, params):
        y, probs = attention_forward_ref(x, self.n_tokens, self.n_heads)
        return y, (np.asarray(x, np.float64), probs)

    def backward_ref(self, dy, cache, params):
        x, probs = cache
        return attention_backward_ref(dy, x, probs, self.n_tokens, self.n_heads), {}


def _names(module) -> dict:
    """{store name: store name} of a module's parameters, whatever form its param_names has."""
    names = module.param_names
    return {n: n for n in (names.values() if isinstance(names, dict) else names)}


class Stack(Sequential):
    """Sequential whose param_names is a dict, so a Stack nests inside a Sequential or a Stack."""

    @property
    def param_names(self) -> dict:
        out = {}
        for layer in self.layers:
            out.update(_names(layer))
        return out


class Residual(Module):
    """y = x + f(x) for an inner module f of the same width (module docstring). Parameters and the
    inner buffers are f's; own buffers "y" and (backward) "dx"."""

    def __init__(self, name: str, inner: Module, dim: int):
        super().__init__(name)
        self.inner, self.dim = inner, int(dim)

    @property
    def param_names(self) -> dict:
        return _names(self.inner)

    def declare_params(self, store) -> None:
        self.inner.declare_params(store)
        self.store = store

    def declare_acts(self, acts, batch: int, tag: str, backward: bool = True, **opts) -> None:
        super().declare_acts(acts, batch, tag, backward=backward, **opts)
        self.inner.declare_acts(acts, batch, tag, backward=backward, **opts)

    def in_shape(self, batch: int) -> tuple:
        return (batch, self.dim)

    def buffers(self, batch: int, backward: bool, **opts) -> list[Buf]:
        return [Buf("y", (batch, self.dim))] + ([Buf("dx", (batch, self.dim))] if backward else [])

    def forward_impl(self, c: Ctx, x):
        h = self.inner.forward(x, c.stream, tag=c.tag, role=c.role)
        elementwise.add(x, h, c.buf("y"), c.stream)
        return c.buf("y")

    def backward_impl(self, c: Ctx, dy, dx):
        d_inner = self.inner.backward(dy, c.stream, tag=c.tag)
        elementwise.add(dy, d_inner, dx, c.stream)
        return dx

    def forward_ref(self, x, params):
        h, cache = self.inner.forward_ref(x, params)
        return np.asarray(x, np.float64) + h, cache

    def backward_ref(self, dy, cache, params):
        d, grads = self.inner.backward_ref(dy, cache, params)
        return np.asarray(dy, np.float64) + d, grads


def causal_self_attention(name: str, dim: int, n_heads: int, n_tokens: int, group: str | None = None,
                          compute: str = "fp32", input_grad: bool = True) -> "Stack":
    """Multi-head causal self-attention: Linear E→3E ("{name}.qkv"), the core, Linear E→E ("{name}.out")."""
    return Stack(name, [
        Linear(f"{name}.qkv", dim, 3 * dim, None, group=group, compute=compute, input_grad=input_grad),
        CausalAttentionCore(f"{name}.core", dim, n_heads, n_tokens),
        Linear(f"{name}.out", dim, dim, None, group=group, compute=compute),
    ], group=group)


def transformer_block(name: str, dim: int, n_heads: int, n_tokens: int, activation: str = "relu",
                      group: str | None = None, compute: str = "fp32") -> "Stack":
    """Pre-LN block: x + Attn(LN(x)), then + MLP(LN(·)) with hidden width 4·dim (module docstring)."""
    attn = Stack(f"{name}.attn", [LayerNorm(f"{name}.ln1", dim, group=group),
                                       causal_self_attention(f"{name}.attn", dim, n_heads, n_tokens, group, compute)],
                      group=group)
    mlp = Stack(f"{name}.mlp", [LayerNorm(f"{name}.ln2", dim, group=group),
                                     Linear(f"{name}.fc1", dim, 4 * dim, activation, group=group, compute=compute),
                                     Linear(f"{name}.fc2", 4 * dim, dim, None, group=group, compute=compute)],
                     group=group)
    return Stack(name, [Residual(f"{name}.res_attn", attn, dim), Residual(f"{name}.res_mlp", mlp, dim)],
                      group=group)
