"""LayerNorm layer (Layer protocol) over numbarl.cuda.kernels.layernorm.

    y = (x − mean_r) / sqrt(var_r + eps) · γ + β      per row r of x [B, dim] (Ba, Kiros & Hinton 2016)

Forward saves mean and rstd per row; the backward gives dx and overwrites dγ, dβ (column
reductions over the batch: deterministic two-phase folds, no atomics — see the kernel module).

Parameters: ``{name}.gamma`` [dim] (init 1) and ``{name}.beta`` [dim] (init 0), as
torch.nn.LayerNorm; never weight-decayed. Activations per tag: ``{name}.{tag}.y``, ``.mean``,
``.rstd``, and with backward=True ``.dx`` and the reduction scratch ``.partials``.
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda.kernels import layernorm as ln
from numbarl.cuda.runtime import cuda
from numbarl.rl.nets.base import zeros_init
from numbarl.rl.nets.module import Buf, Ctx, Module, Param

_cuda = cuda()  # the backend (GPU or simulator), selected once

DEFAULT_EPS = ln.DEFAULT_EPS


def ones_init(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    return np.ones(shape, np.float32)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64; the kernel module's references with a layer-style cache)
# ---------------------------------------------------------------------------------------------
def layernorm_forward_ref(x, gamma, beta, eps=DEFAULT_EPS):
    """(y, cache) in float64; cache = (x, mean, rstd) for layernorm_backward_ref."""
    x = np.asarray(x, np.float64)
    y, mean, rstd = ln.layernorm_forward_ref(x, gamma, beta, eps)
    return y, (x, mean, rstd)


def layernorm_backward_ref(dy, cache, gamma):
    """(dx, dgamma, dbeta) in float64."""
    x, mean, rstd = cache
    return ln.layernorm_backward_ref(np.asarray(dy, np.float64), x, gamma, mean, rstd)


# ---------------------------------------------------------------------------------------------
# layer
# ---------------------------------------------------------------------------------------------
class LayerNorm(Module):
    """LayerNorm over the last axis of x [B, dim] with learned γ, β (see module doc)."""

    def __init__(self, name: str, dim: int, eps: float = DEFAULT_EPS, group: str | None = None):
        super().__init__(name, group)
        self.dim, self.eps = int(dim), float(eps)
        if self.dim < 1 or not self.eps >= 0.0:
            raise ValueError(f"{name}: dim must be >= 1 and eps >= 0 (got {dim}, {eps})")

    @property
    def out_dim(self) -> int:
        return self.dim

    def params(self) -> list[Param]:
        return [Param("gamma", (self.dim,), ones_init), Param("beta", (self.dim,), zeros_init)]

    def in_shape(self, batch: int) -> tuple:
        return (batch, self.dim)

    def buffers(self, batch: int, backward: bool, **opts) -> list[Buf]:
        bufs = [Buf("y", (batch, self.dim)), Buf("mean", (batch,)), Buf("rstd", (batch,))]
        if backward:
            bufs += [Buf("dx", (batch, self.dim)), Buf("partials", ln.layernorm_partials_shape(batch, self.dim))]
        return bufs

    def forward_impl(self, c: Ctx, x):
        """y = LN(x) for x [B, dim]."""
        y = c.buf("y")
        ln.layernorm_forward(x, c.p("gamma"), c.p("beta"), y, c.buf("mean"), c.buf("rstd"), self.eps, c.stream)
        return y

    def backward_impl(self, c: Ctx, dy, dx):
        """dx from dy [B, dim]; dγ, dβ by the gradient rule. Uses x, mean, rstd saved by forward."""
        beta_g, beta_b = c.beta("gamma"), c.beta("beta")
        if beta_g != beta_b:  # both are written by one kernel, always together
            raise RuntimeError(f"{self.name}: gamma and beta gradients are out of step in the ledger")
        ln.layernorm_backward(dy, c.x(), c.p("gamma"), c.buf("mean"), c.buf("rstd"), dx, c.g("gamma"), c.g("beta"),
                              c.buf("partials"), c.stream, accumulate=beta_g == 1.0)
        return dx

    # -- float64 reference of the layer (host dict of params by name; composable) --------------
    def forward_ref(self, x, params):
        n = self.param_names
        return layernorm_forward_ref(x, params[n["gamma"]], params[n["beta"]], self.eps)

    def backward_ref(self, dy, cache, params):
        n = self.param_names
        dx, dg, db = layernorm_backward_ref(dy, cache, params[n["gamma"]])
        return dx, {n["gamma"]: dg, n["beta"]: db}
