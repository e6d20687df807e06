"""Activation layer (ReLU, SiLU, ... from numbarl.cuda.kernels.elementwise) and its references.

    relu(x) = max(x, 0)                      relu'(x) = 1 if x > 0 else 0
    silu(x) = x · σ(x), σ(x) = 1/(1+e^-x)    silu'(x) = σ(x) · (1 + x · (1 − σ(x)))
    (SiLU: Elfwing, Uchibe & Doya 2018, Eq. 1 and its derivative, Eq. 2)

The kernels are the generic elementwise family (one thread per element, grid-stride); this module
adds the Layer-protocol wrapper used where an activation is not fused into a Linear layer (after
a LayerNorm) and the float64 layer references. For ReLU the backward may be given either the
pre-activation x or the output y = relu(x) as the saved tensor (x > 0 ⇔ y > 0), so a Linear layer
with a fused ReLU epilogue only keeps its output.
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda.kernels import elementwise
from numbarl.cuda.runtime import Arena, cuda

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
class Activation:
    """Standalone activation layer (Layer protocol of numbarl.rl.nets.base; no parameters).

    Activations per tag: ``{name}.{tag}.y`` [B, dim], and with backward=True ``{name}.{tag}.dx``.
    Saves its input x (the pre-activation) for the backward pass.
    """

    def __init__(self, name: str, dim: int, activation: str):
        self.name, self.dim = name, int(dim)
        self.activation = canonical_activation(activation)
        self._acts: dict[str, Arena] = {}
        self._batch: dict[str, int] = {}
        self._inputs: dict[str, object] = {}

    @property
    def out_dim(self) -> int:
        return self.dim

    def _act(self, tag, what):
        return f"{self.name}.{tag}.{what}"

    def _arena(self, tag: str) -> Arena:
        acts = self._acts.get(tag)
        if acts is None:
            raise KeyError(f"{self.name}: no activations declared for tag {tag!r}; call declare_acts(acts, batch, {tag!r})")
        return acts

    def declare_params(self, store) -> None:
        """No parameters."""

    def declare_acts(self, acts: Arena, batch: int, tag: str, backward: bool = True) -> None:
        acts.add(self._act(tag, "y"), (batch, self.dim), np.float32)
        if backward:
            acts.add(self._act(tag, "dx"), (batch, self.dim), np.float32)
        self._acts[tag], self._batch[tag] = acts, int(batch)

    def output(self, tag: str = "online"):
        return self._arena(tag)[self._act(tag, "y")]

    def forward(self, x, stream, tag: str = "online", role: str = "params"):
        """y = act(x) for x [B, dim]. Capturable."""
        y = self.output(tag)
        if tuple(x.shape) != tuple(y.shape):
            raise ValueError(f"{self.name}.forward({tag!r}): x has shape {tuple(x.shape)}, expected {tuple(y.shape)}")
        elementwise.activation(x, y, self.activation, stream)
        self._inputs[tag] = x
        return y

    def backward(self, dy, stream, tag: str = "online"):
        """dx = dy · act'(x) with the x saved by forward(tag)."""
        acts, name = self._arena(tag), self._act(tag, "dx")
        if name not in acts:
            raise RuntimeError(f"{self.name}: tag {tag!r} was declared with backward=False; it has no backward buffers")
        x = self._inputs.get(tag)
        if x is None:
            raise RuntimeError(f"{self.name}.backward({tag!r}) before forward({tag!r})")
        dx = acts[name]
        elementwise.activation_backward(x, dy, dx, self.activation, stream)
        return dx

    # -- float64 reference of the layer (composable with the other layers' *_ref methods) -------
    def forward_ref(self, x, params=None):
        return activation_ref(x, self.activation), np.asarray(x, np.float64)

    def backward_ref(self, dy, cache, params=None):
        return activation_backward_ref(dy, cache, self.activation), {}
