"""PyTorch peer of numbarl's KAN spline gate (numbarl/rl/nets/kan_gate.py).

What a researcher would write from Liu et al. 2024 without a fused kernel: the cubic B-spline
bases by the Cox–de Boor recursion on the extended uniform grid (pykan's ``B_batch``, k = 3), the
edge function w_b·silu(x) + w_s·Σ c·B, the sigmoid gate, and ``loss.backward()`` for the
gradients. It shares no code with the kernels (the kernels use the closed-form segment weights),
so the comparison checks both. torch is an optional extra: every function imports it when called.
"""

from __future__ import annotations

import numpy as np

GRID, X_LO, X_HI, K = 5, -5.0, 5.0, 3  # numbarl.rl.nets.kan_gate's grid (not imported: independent)


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError("the PyTorch peer needs torch (pip install torch); numbarl itself does not") from e
    return torch


def bspline_bases(torch, x):
    """[..., GRID + K] cubic B-spline bases at x (clamped to the grid) by Cox–de Boor."""
    h = (X_HI - X_LO) / GRID
    knots = X_LO + h * torch.arange(-K, GRID + K + 1, dtype=x.dtype, device=x.device)  # GRID + 2K + 1 knots
    # the clamp written out: at exactly ±5 the gradient passes (the end cell's one-sided derivative, as the
    # kernels); torch.clamp's own derivative at its bounds has changed between torch versions
    xc = torch.where(x < X_LO, torch.full_like(x, X_LO), torch.where(x > X_HI, torch.full_like(x, X_HI), x))[..., None]
    # order 0: half-open cells; the last real cell takes x = X_HI (closed on the right)
    b = ((xc >= knots[:-1]) & (xc < knots[1:])).to(x.dtype)
    at_end = torch.zeros_like(b)
    at_end[..., GRID + K - 1] = 1.0  # the cell [X_HI - h, X_HI]
    b = torch.where(xc == X_HI, at_end, b)
    for p in range(1, K + 1):
        left = (xc - knots[:-(p + 1)]) / (knots[p:-1] - knots[:-(p + 1)]) * b[..., :-1]
        right = (knots[p + 1:] - xc) / (knots[p + 1:] - knots[1:-p]) * b[..., 1:]
        b = left + right
    return b


def kan_gate_forward_backward(theta, x, dy, device="cpu") -> dict:
    """y = x·σ(w_b·silu(x) + w_s·Σ c·B(x)) and the gradients of L = Σ dy ⊙ y; theta [F, GRID + K + 2]
    (rows w_b, w_s, c...), x and dy [B, F]. Returns float32 numpy {"y", "dx", "dtheta"}."""
    torch = _torch()
    dev = torch.device(device)
    th = torch.as_tensor(np.asarray(theta, np.float32), device=dev).requires_grad_(True)
    xt = torch.as_tensor(np.asarray(x, np.float32), device=dev).requires_grad_(True)
    spline = (bspline_bases(torch, xt) * th[:, 2:]).sum(-1)
    phi = th[:, 0] * torch.nn.functional.silu(xt) + th[:, 1] * spline
    y = xt * torch.sigmoid(phi)
    (y * torch.as_tensor(np.asarray(dy, np.float32), device=dev)).sum().backward()
    return {"y": y.detach().cpu().numpy(), "dx": xt.grad.cpu().numpy(), "dtheta": th.grad.cpu().numpy()}
