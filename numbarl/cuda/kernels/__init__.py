"""Generic device kernel families, each module with a numpy float64 reference next to its kernels.

- ``elementwise``: fill, copy, scale, axpy/axpby, add, mul, activations (relu, silu, gelu, gelu_tanh,
  tanh, sigmoid) forward and backward, bias add / fused bias + activation, byte zeroing.
- ``softmax``: row-wise softmax, log-softmax, logsumexp and their backward passes.
- ``layernorm``: LayerNorm forward (saving mean, rstd) and backward with deterministic dgamma/dbeta.

Deterministic flat, row and column reductions live in :mod:`numbarl.cuda.reduce`.
Import the submodules directly (``from numbarl.cuda.kernels import softmax``); importing this
package compiles nothing.
"""
