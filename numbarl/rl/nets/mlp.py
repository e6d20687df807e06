"""MLP trunk of configurable widths built from Linear (and optionally LayerNorm + Activation) layers.

For widths (w_0, ..., w_{L-1}) and input x [B, in_dim]:

    layernorm=False:  h_{i+1} = act(h_i · W_i + b_i)                   Linear with the activation fused
    layernorm=True:   h_{i+1} = act(LN(h_i · W_i + b_i; γ_i, β_i))     Linear → LayerNorm → Activation
                      (the "Linear-LN-act" block of e.g. Ball et al. 2023 / Nauman et al. 2024, BRO)

input_gate=True puts a :class:`numbarl.rl.nets.feature_gate.FeatureGate` (y = x ⊙ σ(x·W + b),
parameter group ``{group}.gate``) before the first Linear; kan_gate=True a
:class:`numbarl.rl.nets.kan_gate.KanGate` (y = x ⊙ σ(φ(x)), a KAN spline per feature, group
``{group}.kan``) before that (both on: the spline gate first); bottleneck=(lo, hi, width) passes the
input through a :class:`numbarl.rl.nets.bottleneck.TanhBottleneck` first (columns lo..hi − 1 compressed
to width tanh units, group ``{group}.bn``), so the gates and the first Linear see its output. attention=True ends the trunk with the
sigmoid-gated feature attention block y = LN(h + h ⊙ σ(h·W + b)) (squeeze-and-excitation style gating
with a LayerNorm residual: a :class:`numbarl.rl.nets.attention.Residual` around a FeatureGate, then a
LayerNorm; parameter group ``{group}.attn``; the origin's attn_sdp + attn_layer_norm).
regime_gate=(c_1, ..., c_R) wraps all of that in a :class:`numbarl.rl.nets.regime_gate.RegimeGate`:
y = h ⊙ 2σ(x[:, c]·W_g + b_g), the features scaled by a gate of the input's regime columns (group
``{group}.rgate``; then ``layers`` is that one gate, its body the layers above).

Every width gets the activation, so the trunk output h_L [B, w_{L-1}] feeds a head directly.
Layer (and parameter) names: ``{name}.fc{i}`` (``.w`` [in, out], ``.b``), ``{name}.ln{i}``
(``.gamma``, ``.beta``), ``{name}.act{i}``; all in tensor group ``group`` (default: name), weights
decayed when ``decay``, biases and LayerNorm parameters never.

A :class:`numbarl.rl.nets.module.Sequential`: the backward runs the layers in reverse (each
gradient by the module gradient rule); the first Linear computes dx only when
``input_grad=True`` (a trunk fed by observations needs no input gradient: that saves the largest
backward GEMM's sibling, dX = dH·W_0ᵀ).
"""

from __future__ import annotations

from numbarl.rl.nets.activations import Activation
from numbarl.rl.nets.attention import Residual
from numbarl.rl.nets.bottleneck import TanhBottleneck
from numbarl.rl.nets.feature_gate import FeatureGate
from numbarl.rl.nets.kan_gate import KanGate
from numbarl.rl.nets.layernorm import LayerNorm
from numbarl.rl.nets.linear import LINEAR_ACTIVATIONS, Linear
from numbarl.rl.nets.module import Sequential
from numbarl.rl.nets.regime_gate import RegimeGate


class Mlp(Sequential):
    """A stack of Linear (+ LayerNorm + Activation) modules (see module doc)."""

    def __init__(self, name: str, in_dim: int, widths, activation="relu", layernorm: bool = False,
                 group: str | None = None, decay: bool = True, input_grad: bool = False,
                 compute: str = "fp32", ln_eps: float = 1e-5, input_gate: bool = False, kan_gate: bool = False,
                 attention: bool = False, bottleneck: tuple | None = None, regime_gate: tuple | None = None):
        widths = tuple(int(w) for w in widths)
        if not widths or min(widths) < 1:
            raise ValueError(f"{name}: widths must be a non-empty sequence of sizes >= 1 (got {widths})")
        if activation not in LINEAR_ACTIVATIONS and activation != "none":
            raise ValueError(f"{name}: activation must be one of {LINEAR_ACTIVATIONS} (got {activation!r})")
        group = group or name
        layers = []
        d = int(in_dim)
        if bottleneck:  # the tanh input bottleneck, its own parameter group
            lo, hi, width = bottleneck
            layers.append(TanhBottleneck(f"{name}.bn", d, lo, hi, width, group=f"{group}.bn", decay=decay,
                                         input_grad=input_grad, compute=compute))
            d = layers[-1].out_dim
        if kan_gate:  # KAN spline gate on the input, its own parameter group
            layers.append(KanGate(f"{name}.kan", d, group=f"{group}.kan", input_grad=input_grad or bool(bottleneck)))
        if input_gate:  # sigmoid feature gate on the input, its own parameter group
            layers.append(FeatureGate(f"{name}.gate", d, group=f"{group}.gate", decay=decay,
                                      input_grad=input_grad or kan_gate or bool(bottleneck), compute=compute))
        for i, w in enumerate(widths):
            fused = None if layernorm else activation
            layers.append(Linear(f"{name}.fc{i}", d, w, fused, group=group, decay=decay,
                                 input_grad=input_grad or input_gate or kan_gate or bool(bottleneck) or i > 0,
                                 compute=compute))
            if layernorm:
                layers.append(LayerNorm(f"{name}.ln{i}", w, eps=ln_eps, group=group))
                if activation not in (None, "none"):
                    layers.append(Activation(f"{name}.act{i}", w, activation))
            d = w
        if attention:  # the gated feature-attention block on the last hidden layer, its own parameter group
            layers.append(Residual(f"{name}.attn", FeatureGate(f"{name}.attn.gate", d, group=f"{group}.attn",
                                                               decay=decay, compute=compute), d))
            layers.append(LayerNorm(f"{name}.attn.ln", d, eps=ln_eps, group=f"{group}.attn"))
        if regime_gate:  # the regime gate around all of it (it reads the trunk's input), its own parameter group
            layers = [RegimeGate(f"{name}.rgate", Sequential(f"{name}.body", layers, group), int(in_dim), d,
                                 regime_gate, group=f"{group}.rgate", decay=decay, compute=compute)]
        super().__init__(name, layers, group)
        self.in_dim, self.widths = int(in_dim), widths
        self.activation, self.layernorm, self.input_gate = activation, bool(layernorm), bool(input_gate)
        self.kan_gate, self.attention, self.bottleneck = bool(kan_gate), bool(attention), bottleneck
        self.regime_gate = tuple(regime_gate) if regime_gate else None

    @property
    def out_dim(self) -> int:
        return self.widths[-1]
