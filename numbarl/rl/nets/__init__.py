"""Layers and heads with hand-written backward passes (forward/backward = kernels + cuBLASLt)."""
