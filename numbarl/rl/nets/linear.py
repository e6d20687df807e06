"""Linear layer y = act(x·W + b) with a hand-written backward: cuBLASLt GEMMs + one pointwise kernel.

Shapes (weights [in, out] row-major, base.py's convention): x [B, in], W [in, out], b [out],
pre = x·W + b [B, out], y = act(pre) [B, out]; act ∈ {None, "relu", "silu"}.

Forward (one GEMM, plus one pointwise kernel for SiLU):
    None   gemm(x, W, y, bias=b)                          bias fused in the GEMM epilogue
    relu   gemm(x, W, y, bias=b, epilogue="relu")         bias + ReLU fused (RELU_BIAS)
    silu   gemm(x, W, pre, bias=b); y = silu(pre)         pre kept for the backward

Backward from dy (Goodfellow, Bengio & Courville 2016, §6.5.4, the dense layer's gradients):
    dpre = dy · act'(pre)          None: dpre is dy itself (no kernel); relu: mask from y > 0
    dW   = xᵀ · dpre               one GEMM whose "bgrad" epilogue also writes
    db   = Σ_batch dpre            db as the column sums of dpre (fixed order, deterministic)
    dx   = dpre · Wᵀ               skipped when the layer has input_grad=False (the first layer)
When dW and db are not the first writes of the step (a second consumer: the gradient rule of
numbarl/rl/nets/module.py) the GEMM accumulates (beta = 1) and db is a deterministic column sum
added in place (numbarl.cuda.reduce.col_sum): the bgrad epilogue can only overwrite.
:func:`linear_param_grads` is that logic, shared with every head that ends in a dense layer.

Measured on an H200 (graph replay, batch 16,384, trunk 64→512→512 ReLU): forward 216 µs fp32 /
56 µs tf32, backward without the first layer's dx 485 µs fp32 / 195 µs tf32. The ReLU backward
is an elementwise pass (96 MB of traffic per [16384, 512], ~25 µs at copy bandwidth: an estimate,
not measured); cuBLASLt's RELU_AUX + DRELU_BGRAD epilogues
would fold it into the GEMMs once numbarl.cuda.blas exposes them.

Parameters: ``{name}.w`` [in, out] (kaiming-uniform U(±1/sqrt(in)), PyTorch nn.Linear's default,
weight decay per ``decay``) and ``{name}.b`` [out] (U(±1/sqrt(in)), never decayed), group
``group`` (default: the layer name). Activations per tag: ``{name}.{tag}.y`` and for SiLU
``{name}.{tag}.pre``; with backward=True also ``{name}.{tag}.dpre`` (unless act is None),
``{name}.{tag}.dx`` (if input_grad) and ``{name}.{tag}.partials`` (column-sum scratch).
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda import blas, graph, reduce
from numbarl.cuda.kernels import elementwise
from numbarl.cuda.runtime import cuda
from numbarl.rl.nets.activations import activation_backward_ref, activation_ref
from numbarl.rl.nets.base import bias_uniform_init, kaiming_uniform_init
from numbarl.rl.nets.module import Buf, Ctx, Module, Param

_cuda = cuda()  # the backend (GPU or simulator), selected once


LINEAR_ACTIVATIONS = (None, "relu", "silu")


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def linear_forward_ref(x, w, b, activation=None):
    """(y, pre) = (act(x·W + b), x·W + b) in float64."""
    pre = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
    return activation_ref(pre, activation), pre


def linear_backward_ref(x, w, pre, dy, activation=None):
    """(dx, dW, db) in float64 for y = act(x·W + b), given the saved pre-activation."""
    dpre = activation_backward_ref(dy, pre, activation)
    x = np.asarray(x, np.float64)
    return dpre @ np.asarray(w, np.float64).T, x.T @ dpre, dpre.sum(axis=0)


# ---------------------------------------------------------------------------------------------
# shared by every module that ends in a dense layer
# ---------------------------------------------------------------------------------------------
def linear_param_grads(c: Ctx, x, dy, w_key: str, b_key: str, partials, compute: str, betas=None,
                       stream=None) -> None:
    """dW (+)= xᵀ·dy and db (+)= colsum(dy) by the gradient rule (c.beta): the first write of the
    step is one GEMM with the bgrad epilogue; later writes a beta = 1 GEMM plus an accumulating
    fixed-order column sum (`partials`: reduce.col_partials_shape(B, out) scratch). betas: the two
    c.beta values when the caller has already asked the ledger (asking marks the gradient written).
    stream: where the launches go; None: `graph.side_stream(c.stream)` (beside the pass's stream inside
    the agent's `graph.beside` block, else the pass's stream)."""
    s = graph.side_stream(c.stream) if stream is None else stream
    beta_w, beta_b = (c.beta(w_key), c.beta(b_key)) if betas is None else betas
    if beta_w == 0.0 and beta_b == 0.0:
        blas.gemm(x, dy, c.g(w_key), trans_a=True, epilogue="bgrad", bias_grad=c.g(b_key), compute=compute,
                  stream=s)
        return
    blas.gemm(x, dy, c.g(w_key), trans_a=True, beta=beta_w, compute=compute, stream=s)
    reduce.col_sum(dy, c.g(b_key), partials, s, accumulate=beta_b == 1.0)


# ---------------------------------------------------------------------------------------------
# layer
# ---------------------------------------------------------------------------------------------
class Linear(Module):
    """Dense layer with fused bias/activation (module contract of numbarl.rl.nets.module)."""

    native_dx_accumulate = True  # dx is a GEMM: its beta adds into a shared buffer

    def __init__(self, name: str, in_dim: int, out_dim: int, activation=None, group: str | None = None,
                 decay: bool = True, input_grad: bool = True, compute: str = "fp32"):
        super().__init__(name, group)
        self.in_dim, self.out_dim = int(in_dim), int(out_dim)
        if self.in_dim < 1 or self.out_dim < 1:
            raise ValueError(f"{name}: in_dim and out_dim must be >= 1 (got {in_dim}, {out_dim})")
        if compute not in blas.COMPUTES:
            raise ValueError(f"{name}: compute must be one of {blas.COMPUTES} (got {compute!r})")
        self.activation = None if activation in (None, "none", "identity") else activation
        if self.activation not in LINEAR_ACTIVATIONS:
            raise ValueError(f"{name}: activation must be one of {LINEAR_ACTIVATIONS} (got {activation!r})")
        self.decay, self.input_grad, self.compute = bool(decay), bool(input_grad), compute

    def params(self) -> list[Param]:
        return [Param("w", (self.in_dim, self.out_dim), kaiming_uniform_init, decay=self.decay),
                Param("b", (self.out_dim,), bias_uniform_init(self.in_dim), decay=False)]

    def in_shape(self, batch: int) -> tuple:
        return (batch, self.in_dim)

    def buffers(self, batch: int, backward: bool, **opts) -> list[Buf]:
        bufs = [Buf("y", (batch, self.out_dim))]
        if self.activation == "silu":
            bufs.append(Buf("pre", (batch, self.out_dim)))
        if backward:
            if self.activation is not None:
                bufs.append(Buf("dpre", (batch, self.out_dim)))
            if self.input_grad:
                bufs.append(Buf("dx", (batch, self.in_dim)))
            bufs.append(Buf("partials", reduce.col_partials_shape(batch, self.out_dim)))
        return bufs

    def forward_impl(self, c: Ctx, x):
        """y = act(x·W + b) for x [B, in]."""
        y = c.buf("y")
        if self.activation == "silu":
            pre = c.buf("pre")
            blas.gemm(x, c.p("w"), pre, bias=c.p("b"), compute=self.compute, stream=c.stream)
            elementwise.activation(pre, y, "silu", c.stream)
        else:  # bias (+ ReLU) fused into the GEMM epilogue
            blas.gemm(x, c.p("w"), y, bias=c.p("b"), epilogue=self.activation, compute=self.compute, stream=c.stream)
        return y

    def backward_impl(self, c: Ctx, dy, dx):
        """dW, db by the gradient rule; dx = dpre·Wᵀ into `dx` (None: no input gradient)."""
        if tuple(dy.shape) != (c.batch, self.out_dim):
            raise ValueError(f"{self.name}.backward: dy has shape {tuple(dy.shape)}, expected {(c.batch, self.out_dim)}")
        if self.activation is None:
            dpre = dy
        else:  # ReLU: relu'(pre) = [y > 0], so the output serves as the saved tensor
            dpre = c.buf("dpre")
            saved = c.buf("pre") if self.activation == "silu" else c.buf("y")
            elementwise.activation_backward(saved, dy, dpre, self.activation, c.stream)
        linear_param_grads(c, c.x(), dpre, "w", "b", c.buf("partials"), self.compute)
        if dx is None:
            return None
        blas.gemm(dpre, c.p("w"), dx, trans_b=True, beta=c.dx_beta, compute=self.compute, stream=c.stream)
        return dx

    # -- float64 reference of the layer (host dict of params by name; composable) --------------
    def forward_ref(self, x, params):
        n = self.param_names
        y, pre = linear_forward_ref(x, params[n["w"]], params[n["b"]], self.activation)
        return y, (np.asarray(x, np.float64), pre)

    def backward_ref(self, dy, cache, params):
        x, pre = cache
        n = self.param_names
        dx, dw, db = linear_backward_ref(x, params[n["w"]], pre, dy, self.activation)
        return dx, {n["w"]: dw, n["b"]: db}
