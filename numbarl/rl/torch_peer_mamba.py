"""PyTorch peer of numbarl's Mamba2-style temporal scan (numbarl/rl/nets/mamba.py, kernels in
numbarl/cuda/kernels/ssm.py).

What a researcher would write from Dao & Gu 2024 (SSD with a scalar decay per head) without a fused
kernel: one matmul for the input projection, a Python loop over the K steps carrying the state
S [B, n_heads, head_dim, N], the last step's read-out, the residual and the output matmul, then
``loss.backward()`` (autograd does the BPTT). With a ``{name}.conv`` weight [d + 1, H + 2N] among the
values (MambaScan's conv = d), Mamba2's causal depthwise convolution and SiLU on u | B | C come first,
written as the tap loop (a tap stops at a masked row, as the scan's state restarts there). The weights are numbarl's (``[in, out]``; the same
column layout of W_in: u | B | C | Δ̃) and the gradients come back under numbarl's names, so a test
compares the kernels with autograd on the same weights, windows and mask (tests/rl/test_mamba.py).

torch is an optional extra: this module imports without it; every function imports torch when called.
"""

from __future__ import annotations

import numpy as np

D_STATE = 16  # numbarl.cuda.kernels.ssm.D_STATE (not imported: the peer stays independent of numba)


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError("the PyTorch peer needs torch (pip install torch); numbarl itself does not") from e
    return torch


def mamba_forward_backward(values: dict, x, dh, n_steps: int, n_heads: int, mask=None, name: str = "temporal.mamba",
                           device="cpu") -> dict:
    """h̃ = x_{K−1} + SSD(x)·W_out and the gradients of L = Σ dh ⊙ h̃, the PyTorch way.

    values: {numbarl store name: array}; x [B·K, H] (window b at rows b·K .. b·K + K − 1, oldest
    first); dh [B, H]; mask [B, K] (1 valid, 0 masked) or None. Returns {"out" [B, H], "dx" [B·K, H],
    "grads" {numbarl name: array}} as float32 numpy arrays.
    """
    torch = _torch()
    import torch.nn.functional as F

    dev = torch.device(device)
    f32 = lambda a: torch.as_tensor(np.ascontiguousarray(np.asarray(a, np.float32)), device=dev)
    keys = ("w_in", "dt_bias", "a_log", "w_out") + (("conv",) if f"{name}.conv" in values else ())
    w = {k: f32(values[f"{name}.{k}"]).requires_grad_(True) for k in keys}
    K, n_h, N = int(n_steps), int(n_heads), D_STATE
    xt = f32(x).requires_grad_(True)
    D = xt.shape[1]
    H = w["w_in"].shape[1] - 2 * N - n_h  # the scan's inner width (D rounded up to a multiple of the heads)
    Bn, hd = xt.shape[0] // K, H // n_h
    m = torch.ones(Bn, K, device=dev) if mask is None else f32(mask)
    z = (xt @ w["w_in"]).reshape(Bn, K, -1)
    if "conv" in w:  # v_t = bias + Σ_k w_k · z_{t−k} over the rows since the last masked one, then SiLU
        d, cols = w["conv"].shape[0] - 1, w["conv"].shape[1]
        run, runs = torch.zeros(Bn, device=dev), []
        for t in range(K):
            run = torch.where(m[:, t] != 0, run + 1, torch.zeros_like(run))
            runs.append(run)
        rows = []
        for t in range(K):
            v = w["conv"][d].expand(Bn, cols)
            for k in range(min(d, t + 1)):
                v = v + (runs[t] > k).float()[:, None] * w["conv"][k] * z[:, t - k, :cols]
            rows.append(torch.cat([F.silu(v), z[:, t, cols:]], dim=1))
        z = torch.stack(rows, dim=1)
    u, Bt, Ct, dt_pre = z[..., :H], z[..., H:H + N], z[..., H + N:H + 2 * N], z[..., H + 2 * N:]
    dt = F.softplus(dt_pre + w["dt_bias"])  # [B, K, n_h]
    a = torch.exp(-dt * torch.exp(w["a_log"]))
    S = torch.zeros(Bn, n_h, hd, N, device=dev)
    for t in range(K):
        inp = (dt[:, t, :, None] * u[:, t].reshape(Bn, n_h, hd))[..., None] * Bt[:, t, None, None, :]
        S = m[:, t, None, None, None] * (a[:, t, :, None, None] * S + inp)
    y = torch.einsum("bhpn,bn->bhp", S, Ct[:, K - 1]).reshape(Bn, H)
    out = xt.reshape(Bn, K, D)[:, K - 1] + y @ w["w_out"]
    (out * f32(dh)).sum().backward()
    return {"out": out.detach().cpu().numpy(), "dx": xt.grad.detach().cpu().numpy(),
            "grads": {f"{name}.{k}": v.grad.detach().cpu().numpy() for k, v in w.items()}}
