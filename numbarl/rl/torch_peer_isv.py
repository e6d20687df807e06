"""PyTorch peer of numbarl's ISV temporal routing (numbarl/rl/isv.py, agent.isv_routing).

What a researcher would write without kernels: w = torch.sigmoid(isv @ W_r + b_r), h̃ = x_t + w * u, then
``loss.backward()`` with L = Σ dh ⊙ h̃ (autograd gives ∂L/∂u, the scan's upstream gradient, and the routing's
parameter gradients). The weights are numbarl's ([12, F] and [F]) and the gradients come back under numbarl's
names, so a test compares the kernels with autograd on the same inputs (tests/rl/test_isv.py).

torch is an optional extra: this module imports without it; the function imports torch when called.
"""

from __future__ import annotations

import numpy as np


def route_forward_backward(values: dict, u, x_last, isv, dh, name: str = "temporal.route", device="cpu") -> dict:
    """h̃ = x_t + σ(isv·W_r + b_r) ⊙ u and the gradients of L = Σ dh ⊙ h̃, the PyTorch way.

    values: {numbarl store name: array}; u, x_last, dh [rows, F]; isv [12] (a constant: no gradient).
    Returns {"out" [rows, F], "du" [rows, F], "grads" {numbarl name: array}} as float32 numpy arrays.
    """
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError("the PyTorch peer needs torch (pip install torch); numbarl itself does not") from e
    dev = torch.device(device)
    f32 = lambda a: torch.as_tensor(np.ascontiguousarray(np.asarray(a, np.float32)), device=dev)
    w = {k: f32(values[f"{name}.{k}"]).requires_grad_(True) for k in ("w_r", "b_r")}
    ut = f32(u).requires_grad_(True)
    gate = torch.sigmoid(f32(isv) @ w["w_r"] + w["b_r"])  # [F]
    out = f32(x_last) + gate * ut
    (out * f32(dh)).sum().backward()
    return {"out": out.detach().cpu().numpy(), "du": ut.grad.detach().cpu().numpy(),
            "grads": {f"{name}.{k}": v.grad.detach().cpu().numpy() for k, v in w.items()}}
