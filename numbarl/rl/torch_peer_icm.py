"""PyTorch peer of numbarl's ICM curiosity (numbarl/rl/nets/icm.py, numbarl/rl/losses/icm.py).

What a researcher would write from Pathak et al. 2017 (§2.2, Eq. 2-7) for a branched action space:
two ``nn.Sequential(nn.Linear, nn.ReLU, nn.Linear)`` models, the forward one on
``torch.cat([phi, one_hot(a_0), …, one_hot(a_{K−1})])``, the inverse one on ``torch.cat([phi,
phi_next])`` with ``F.cross_entropy`` per branch, the features detached, then ``loss.backward()``.
The weights are numbarl's (``[in, out]``, transposed into nn.Linear's ``[out, in]``) and the gradients
come back under numbarl's names and layout, so a test compares the kernels with autograd on the
same weights and batch (tests/rl/test_icm.py).

Conventions shared with numbarl: v_b = 1 − done_b masks a sample out of both losses and the
intrinsic reward; e_b = ½ mean_j (φ̂′ − φ′)²_bj (the mean over the H features);
L = β · mean_b(v_b e_b) + (1 − β) · mean_b(v_b · mean_k CE_k) (the batch mean over all B samples,
masked ones counted as 0); r_i = w · v_b e_b / scale with the
scale after this batch's EMA step (given the scale before it).

torch is an optional extra: this module imports without it; every function imports torch when called.
"""

from __future__ import annotations

import numpy as np


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError("the PyTorch peer needs torch (pip install torch); numbarl itself does not") from e
    return torch


def _linear(values: dict, name: str, dev):
    torch = _torch()
    w = np.asarray(values[f"{name}.w"], np.float32)
    lin = torch.nn.Linear(int(w.shape[0]), int(w.shape[1])).to(dev)
    with torch.no_grad():
        lin.weight.copy_(torch.as_tensor(np.ascontiguousarray(w.T), device=dev))
        lin.bias.copy_(torch.as_tensor(np.asarray(values[f"{name}.b"], np.float32), device=dev))
    return lin


def icm_loss_and_grads(values: dict, phi, phi_next, actions, dones, branch_sizes, beta: float = 0.2,
                       weight: float = 0.0, scale: float = -1.0, normalize: bool = True, name: str = "icm",
                       device="cpu") -> dict:
    """The ICM losses and their gradients the PyTorch way, on numbarl's parameter values ({store
    name: array}), trunk features phi, phi_next [B, H] (constants), actions [B, K], dones [B].

    Returns {"loss", "forward_loss", "inverse_loss", "per_sample" [B], "phi_hat" [B, H], "logits"
    [B, A], "grads" {numbarl name: array in numbarl's layout}, "r_i" [B], "scale"} (float32 on `device`;
    r_i and scale from `weight`, the running `scale` before this batch (< 0: none yet) and `normalize`).
    """
    torch = _torch()
    import torch.nn.functional as F

    dev = torch.device(device)
    f32 = lambda a: torch.as_tensor(np.ascontiguousarray(np.asarray(a, np.float32)), device=dev)  # noqa: E731
    fwd = torch.nn.Sequential(_linear(values, f"{name}.fwd.fc0", dev), torch.nn.ReLU(),
                              _linear(values, f"{name}.fwd.out", dev))
    inv = torch.nn.Sequential(_linear(values, f"{name}.inv.fc0", dev), torch.nn.ReLU(),
                              _linear(values, f"{name}.inv.out", dev))
    phi_t, phi_next_t = f32(phi).detach(), f32(phi_next).detach()  # detached features: constants
    a = torch.as_tensor(np.asarray(actions, np.int64), device=dev)
    v = 1.0 - f32(dones)
    B, K = phi_t.shape[0], len(branch_sizes)
    onehot = torch.cat([F.one_hot(a[:, k], int(n)).to(phi_t.dtype) for k, n in enumerate(branch_sizes)], dim=1)
    phi_hat = fwd(torch.cat([phi_t, onehot], dim=1))
    logits = inv(torch.cat([phi_t, phi_next_t], dim=1))
    error = 0.5 * ((phi_hat - phi_next_t) ** 2).mean(dim=1)  # [B]
    ce = torch.zeros(B, device=dev)
    start = 0
    for k, n in enumerate(branch_sizes):
        ce = ce + F.cross_entropy(logits[:, start:start + int(n)], a[:, k], reduction="none")
        start += int(n)
    ce = ce / K
    forward_loss = (v * error).mean()
    inverse_loss = (v * ce).mean()
    loss = beta * forward_loss + (1.0 - beta) * inverse_loss
    loss.backward()
    grads = {}
    for model, part in ((fwd, "fwd"), (inv, "inv")):
        for lin, layer in ((model[0], "fc0"), (model[2], "out")):
            grads[f"{name}.{part}.{layer}.w"] = lin.weight.grad.detach().cpu().numpy().T.copy()
            grads[f"{name}.{part}.{layer}.b"] = lin.bias.grad.detach().cpu().numpy().copy()
    with torch.no_grad():
        masked = v * error
        n_valid = float(v.sum())
        if n_valid > 0:
            mean_error = float(masked.sum()) / n_valid
            scale = mean_error if scale < 0 else 0.99 * scale + 0.01 * mean_error
        if normalize:
            r_i = weight * masked / scale if scale > 1e-30 else torch.zeros_like(masked)
        else:
            r_i = weight * masked
    return {"loss": float(loss.detach().cpu()), "forward_loss": float(forward_loss.detach().cpu()),
            "inverse_loss": float(inverse_loss.detach().cpu()),
            "per_sample": (v * (beta * error + (1.0 - beta) * ce)).detach().cpu().numpy(),
            "phi_hat": phi_hat.detach().cpu().numpy(), "logits": logits.detach().cpu().numpy(), "grads": grads,
            "r_i": r_i.cpu().numpy(), "scale": float(scale)}
