"""Every network module numbarl has, as a small case the contract test runs.

``tests/rl/test_module_contract.py`` is parametrized over :data:`MODULES`: each entry builds a
small instance on odd shapes and says which output its backward differentiates. Adding a module
to numbarl is one new file (the module, following numbarl/rl/nets/module.py), one entry here,
and its hand-computed cases in its own test file (docs/ARCHITECTURE.md walks through one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class ModuleCase:
    """make() builds the module; batch and in_dim give the input x [batch, in_dim]; `primary`
    picks the output the backward differentiates (default: the output itself) and `valid` the
    entries of it that are defined (padding of ragged outputs is excluded from the test loss);
    acts: extra keyword arguments of declare_acts."""

    make: Callable
    batch: int
    in_dim: int
    primary: Callable = field(default=lambda out: out)
    valid: Callable | None = None
    acts: dict = field(default_factory=dict)


def _c51_logits(out):
    return out.logits


def _c51_valid(module):
    def valid(shape):
        mask = np.zeros(shape, bool)
        for k, n in enumerate(module.branch_sizes):
            mask[:, k, :n, :] = True
        return mask

    return valid


def _cases() -> dict[str, ModuleCase]:
    from numbarl.rl.nets.activations import Activation
    from numbarl.rl.nets.attention import causal_self_attention, transformer_block
    from numbarl.rl.nets.bottleneck import TanhBottleneck
    from numbarl.rl.nets.c51_head import BranchedDuelingC51Head
    from numbarl.rl.nets.feature_gate import FeatureGate
    from numbarl.rl.nets.icm import IcmModel
    from numbarl.rl.nets.kan_gate import KanGate
    from numbarl.rl.nets.layernorm import LayerNorm
    from numbarl.rl.nets.linear import Linear
    from numbarl.rl.nets.mamba import MambaScan
    from numbarl.rl.nets.mlp import Mlp
    from numbarl.rl.nets.regime_gate import RegimeGate

    return {
        "linear": ModuleCase(lambda: Linear("fc", 5, 13), 7, 5),
        "linear-relu": ModuleCase(lambda: Linear("fc", 5, 13, "relu"), 7, 5),
        "linear-silu": ModuleCase(lambda: Linear("fc", 5, 13, "silu"), 7, 5),
        "activation-silu": ModuleCase(lambda: Activation("act", 6, "silu"), 7, 6),
        "layernorm": ModuleCase(lambda: LayerNorm("ln", 13), 7, 13),
        "feature-gate": ModuleCase(lambda: FeatureGate("gate", 6), 7, 6),
        "tanh-bottleneck": ModuleCase(lambda: TanhBottleneck("bn", 7, 2, 5, 2), 6, 7),
        "mlp-bottleneck": ModuleCase(lambda: Mlp("trunk", 7, (9,), bottleneck=(1, 5, 3), kan_gate=True,
                                                 input_grad=True), 6, 7),
        "kan-gate": ModuleCase(lambda: KanGate("kan", 6), 7, 6),
        "regime-gate": ModuleCase(lambda: RegimeGate("rg", Linear("rg.fc", 7, 5, "silu"), 7, 5, (4, 0, 2)), 6, 7),
        "mlp-regime-gate": ModuleCase(lambda: Mlp("trunk", 7, (9,), regime_gate=(6, 1), input_grad=True), 5, 7),
        "mlp-kan-gated": ModuleCase(lambda: Mlp("trunk", 5, (9,), input_gate=True, kan_gate=True, input_grad=True), 7, 5),
        "mlp-attention": ModuleCase(lambda: Mlp("trunk", 5, (9,), attention=True, input_grad=True), 7, 5),
        "mlp-gated": ModuleCase(lambda: Mlp("trunk", 5, (9,), input_gate=True, input_grad=True), 7, 5),
        "mlp-relu": ModuleCase(lambda: Mlp("trunk", 5, (13, 9), input_grad=True), 7, 5),
        "mlp-layernorm-silu": ModuleCase(lambda: Mlp("trunk", 5, (11, 6), activation="silu", layernorm=True,
                                                     input_grad=True), 7, 5),
        # sequences of n_tokens rows: batch = 2 sequences (numbarl/rl/nets/attention.py)
        "attention": ModuleCase(lambda: causal_self_attention("attn", 8, 2, 5), 10, 8),
        "transformer-block": ModuleCase(lambda: transformer_block("block", 6, 2, 3), 6, 6),
        # an ICM model (numbarl/rl/nets/icm.py; the agent's run without the input gradient)
        "icm-model": ModuleCase(lambda: IcmModel("icm.fwd", 6, 9, 5, "icm.forward", input_grad=True), 7, 6),
        # a selective scan over windows of n_steps rows: batch = 3 windows of 3 (numbarl/rl/nets/mamba.py)
        "mamba": ModuleCase(lambda: MambaScan("temporal.mamba", 8, n_steps=3, n_heads=2), 9, 8),
        "mamba-conv": ModuleCase(lambda: MambaScan("temporal.mamba", 8, n_steps=3, n_heads=2, conv=2), 9, 8),
        # 7 features in 2 heads: the scan's inner width 8 (W_in [7, P], W_out [8, 7])
        "mamba-uneven": ModuleCase(lambda: MambaScan("temporal.mamba", 7, n_steps=3, n_heads=2), 9, 7),
        "c51-head": ModuleCase(lambda: BranchedDuelingC51Head("head", 6, (3, 2), n_atoms=5, v_min=-2.0, v_max=2.0),
                               7, 6, primary=_c51_logits, valid="c51", acts={"outputs": ("logits", "q")}),
        # the advantage GEMMs at a padded width (agent.head_pad): 5 actions x 5 atoms = 25 -> 28 columns
        "c51-head-pad": ModuleCase(lambda: BranchedDuelingC51Head("head", 6, (3, 2), n_atoms=5, v_min=-2.0, v_max=2.0,
                                                                  pad_to=4),
                                   7, 6, primary=_c51_logits, valid="c51", acts={"outputs": ("logits", "q")}),
        # the value stream in the advantage's padded GEMM (agent.head_fuse_value): 25 + 5 -> 32 columns
        "c51-head-fused": ModuleCase(lambda: BranchedDuelingC51Head("head", 6, (3, 2), n_atoms=5, v_min=-2.0,
                                                                    v_max=2.0, pad_to=8, fuse_value=True),
                                     7, 6, primary=_c51_logits, valid="c51", acts={"outputs": ("logits", "q")}),
    }


MODULES: dict[str, ModuleCase] = {}


def modules() -> dict[str, ModuleCase]:
    """The registered cases (built on first use: importing them compiles nothing)."""
    if not MODULES:
        MODULES.update(_cases())
    return MODULES


def valid_mask(case: ModuleCase, module, shape) -> np.ndarray:
    if case.valid == "c51":
        return _c51_valid(module)(shape)
    if case.valid is None:
        return np.ones(shape, bool)
    return case.valid(shape)
