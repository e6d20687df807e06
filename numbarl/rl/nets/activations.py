"""Activation layer (ReLU, SiLU, ... from numbarl.cuda.kernels.elementwise) and its references.

    relu(x) = max(x, 0)                      relu'(x) = 1 if x > 0 else 0
    silu(x) = x · σ(x), σ(x) = 1/(1+e^-x)    silu'(x) = σ(x) · (1 + x · (1 − σ(x)))
    (SiLU: Elfwing, Uchibe & Doya 2018, Eq. 1 and its derivative, Eq. 2)

The kernels are the generic elementwise family (one thread per element, grid-stride); this module
adds the module wrapper used where an activation is not fused into a Linear layer (after
a LayerNorm) and the float64 layer references. For ReLU the backward may be given either the
pre-activation x or the output y = relu(x) as the saved tensor (x > 0 ⇔ y > 0), so a Linear layer
with a fused ReLU epilogue only keeps its output.
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda.kernels import elementwise
from numbarl.cuda.runtime import cuda
from numbarl.rl.nets.module import Buf, Ctx, Module

_cuda = cuda()  # the backend (GPU or simulator), selected once

LAYER_ACTIVATIONS = ("relu", "silu", "gelu", "gelu_tanh", "tanh", "sigmoid")


def canonical_activation(activation) -> str:
    """None / "none" / "identity" → "identity"; otherwise a name of the elementwise family."""
    if activation in (None, "none", "identity"):
        return "identity"
    if activation not in LAYER_ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose None or one of {LAYER_ACTIVATIONS}")
    return activation


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def activation_ref(x, activation):
    """act(x) in float64."""
    return elementwise.activation_ref(x, canonical_activation(activation))


def activation_backward_ref(dy, x, activation):
    """dx = dy · act'(x) in float64, x the pre-activation."""
    return np.asarray(dy, np.float64) * elementwise.activation_grad_ref(x, canonical_activation(activation))


# ---------------------------------------------------------------------------------------------
# layer
# ---------------------------------------------------------------------------------------------
class Activation(Module):
    """Standalone activation layer (module contract of numbarl.rl.nets.module; no parameters).

    Buffers per tag: ``{name}.{tag}.y`` [B, dim], and with backward=True ``{name}.{tag}.dx``.
    Saves its input x (the pre-activation) for the backward pass.
    """

    def __init__(self, name: str, dim: int, activation: str):
        super().__init__(name)
        self.dim = int(dim)
        self.activation = canonical_activation(activation)

    @property
    def out_dim(self) -> int:
        return self.dim

    def in_shape(self, batch: int) -> tuple:
        return (batch, self.dim)

    def buffers(self, batch: int, backward: bool, **opts) -> list[Buf]:
        return [Buf("y", (batch, self.dim))] + ([Buf("dx", (batch, self.dim))] if backward else [])

    def forward_impl(self, c: Ctx, x):
        """y = act(x) for x [B, dim]."""
        y = c.buf("y")
        elementwise.activation(x, y, self.activation, c.stream)
        return y

    def backward_impl(self, c: Ctx, dy, dx):
        """dx = dy · act'(x) with the x saved by forward(tag)."""
        elementwise.activation_backward(c.x(), dy, dx, self.activation, c.stream)
        return dx

    # -- float64 reference of the layer (composable with the other layers' *_ref methods) -------
    def forward_ref(self, x, params=None):
        return activation_ref(x, self.activation), np.asarray(x, np.float64)

    def backward_ref(self, dy, cache, params=None):
        return activation_backward_ref(dy, cache, self.activation), {}
