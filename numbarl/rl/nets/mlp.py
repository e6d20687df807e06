"""MLP trunk of configurable widths built from Linear (and optionally LayerNorm + Activation) layers.

For widths (w_0, ..., w_{L-1}) and input x [B, in_dim]:

    layernorm=False:  h_{i+1} = act(h_i · W_i + b_i)                   Linear with the activation fused
    layernorm=True:   h_{i+1} = act(LN(h_i · W_i + b_i; γ_i, β_i))     Linear → LayerNorm → Activation
                      (the "Linear-LN-act" block of e.g. Ball et al. 2023 / Nauman et al. 2024, BRO)

Every width gets the activation, so the trunk output h_L [B, w_{L-1}] feeds a head directly.
Layer (and parameter) names: ``{name}.fc{i}`` (``.w`` [in, out], ``.b``), ``{name}.ln{i}``
(``.gamma``, ``.beta``), ``{name}.act{i}``; all in tensor group ``group`` (default: name), weights
decayed when ``decay``, biases and LayerNorm parameters never.

The backward runs the layers in reverse; the first Linear computes dx only when
``input_grad=True`` (a trunk fed by observations needs no input gradient: that saves the largest
backward GEMM's sibling, dX = dH·W_0ᵀ).
"""

from __future__ import annotations

from numbarl.cuda.runtime import Arena
from numbarl.rl.nets.activations import Activation
from numbarl.rl.nets.base import ParamStore
from numbarl.rl.nets.layernorm import LayerNorm
from numbarl.rl.nets.linear import LINEAR_ACTIVATIONS, Linear


class Mlp:
    """A stack of layers following the Layer protocol of numbarl.rl.nets.base (see module doc)."""

    def __init__(self, name: str, in_dim: int, widths, activation="relu", layernorm: bool = False,
                 group: str | None = None, decay: bool = True, input_grad: bool = False,
                 compute: str = "fp32", ln_eps: float = 1e-5):
        widths = tuple(int(w) for w in widths)
        if not widths or min(widths) < 1:
            raise ValueError(f"{name}: widths must be a non-empty sequence of sizes >= 1 (got {widths})")
        if activation not in LINEAR_ACTIVATIONS and activation != "none":
            raise ValueError(f"{name}: activation must be one of {LINEAR_ACTIVATIONS} (got {activation!r})")
        self.name, self.in_dim, self.widths = name, int(in_dim), widths
        self.activation, self.layernorm = activation, bool(layernorm)
        group = group or name
        self.layers = []
        d = self.in_dim
        for i, w in enumerate(widths):
            fused = None if layernorm else activation
            self.layers.append(Linear(f"{name}.fc{i}", d, w, fused, group=group, decay=decay,
                                      input_grad=input_grad or i > 0, compute=compute))
            if layernorm:
                self.layers.append(LayerNorm(f"{name}.ln{i}", w, eps=ln_eps, group=group))
                if activation not in (None, "none"):
                    self.layers.append(Activation(f"{name}.act{i}", w, activation))
            d = w

    @property
    def out_dim(self) -> int:
        return self.widths[-1]

    @property
    def param_names(self) -> list[str]:
        names = []
        for layer in self.layers:
            names.extend(getattr(layer, "param_names", {}).values())
        return names

    # -- protocol -----------------------------------------------------------------------------
    def declare_params(self, store: ParamStore) -> None:
        for layer in self.layers:
            layer.declare_params(store)

    def declare_acts(self, acts: Arena, batch: int, tag: str, backward: bool = True) -> None:
        for layer in self.layers:
            layer.declare_acts(acts, batch, tag, backward=backward)

    def output(self, tag: str = "online"):
        """float32 [B, out_dim] trunk output of a tag (valid after forward)."""
        return self.layers[-1].output(tag)

    def forward(self, x, stream, tag: str = "online", role: str = "params"):
        h = x
        for layer in self.layers:
            h = layer.forward(h, stream, tag=tag, role=role)
        return h

    def backward(self, dy, stream, tag: str = "online"):
        """Overwrites the grads of every trunk tensor; returns dx (None unless input_grad)."""
        d = dy
        for layer in reversed(self.layers):
            d = layer.backward(d, stream, tag=tag)
        return d

    # -- float64 reference (host dict of params by name) ----------------------------------------
    def forward_ref(self, x, params):
        caches = []
        h = x
        for layer in self.layers:
            h, cache = layer.forward_ref(h, params)
            caches.append(cache)
        return h, caches

    def backward_ref(self, dy, caches, params):
        grads = {}
        d = dy
        for layer, cache in zip(reversed(self.layers), reversed(caches)):
            d, g = layer.backward_ref(d, cache, params)
            grads.update(g)
        return d, grads
