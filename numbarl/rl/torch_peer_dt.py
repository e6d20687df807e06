"""PyTorch peer of the Decision Transformer (agent.kind = "dt"): the same network and loss in plain PyTorch.

What a researcher would write for numbarl's DT (minGPT's arrangement, which the paper's code builds
on): an embedding Linear on the token features, pre-LN blocks (LayerNorm, one fused qkv Linear,
causal softmax attention per head, the output projection, residual; LayerNorm, Linear 4E, the
activation, Linear E, residual), a final LayerNorm and the action head; F.cross_entropy per branch
at the state tokens, summed over branches, averaged over the B·L samples; ``loss.backward()``.

``dt_loss_and_grads(net, params, tokens, actions)`` takes numbarl's network object (for its
shapes and names), numbarl's parameter dict (weights [in, out], as numbarl stores them) and one
batch; it returns the loss, the logits and the gradients under numbarl's names and layout. torch
is imported when called (an optional extra, never a runtime dependency).
"""

from __future__ import annotations

import numpy as np


def _torch():
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is an optional extra
        raise ImportError("the PyTorch peer needs torch (pip install torch)") from exc
    return torch


def dt_loss_and_grads(net, params: dict, tokens, actions, dtype: str = "float64", device: str = "cpu") -> dict:
    """Loss, logits [B·3L, W] and {numbarl name: gradient} of the DT network `net`
    (numbarl.rl.nets.dt.DecisionTransformerNet) on tokens [B·3L, F] and actions [B, L, n_b]; dtype
    "float64" (the reference the fp32 kernels are held to) or "float32" (the peer as usually run)."""
    torch = _torch()
    F = torch.nn.functional
    dev, dt = torch.device(device), getattr(torch, dtype)
    P = {k: torch.as_tensor(np.asarray(v, np.float64), dtype=dt, device=dev).requires_grad_(True)
         for k, v in params.items()}
    x = torch.as_tensor(np.asarray(tokens, np.float64), dtype=dt, device=dev)
    a = torch.as_tensor(np.asarray(actions, np.int64), device=dev)
    B, L, nb = a.shape
    T, E, H = net.n_tokens, net.dim, net.n_heads
    d = E // H
    name = net.name

    def linear(h, prefix):
        return h @ P[f"{prefix}.w"] + P[f"{prefix}.b"]

    def layernorm(h, prefix):
        return F.layer_norm(h, (E,), P[f"{prefix}.gamma"], P[f"{prefix}.beta"], eps=1e-5)

    act = {"relu": F.relu, "silu": F.silu}
    causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    h = linear(x, f"{name}.embed")
    for i in range(net.n_layers):
        blk = f"{name}.block{i}"
        qkv = linear(layernorm(h, f"{blk}.ln1"), f"{blk}.attn.qkv").view(B, T, 3, H, d)
        q, k, v = (qkv[:, :, j].transpose(1, 2) for j in range(3))  # [B, H, T, d]
        s = (q @ k.transpose(-1, -2)) / (d ** 0.5)
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        o = (p @ v).transpose(1, 2).reshape(B * T, E)
        h = h + linear(o, f"{blk}.attn.out")
        m = act[net.activation](linear(layernorm(h, f"{blk}.ln2"), f"{blk}.fc1"))
        h = h + linear(m, f"{blk}.fc2")
    logits = linear(layernorm(h, f"{name}.ln_f"), f"{name}.head")
    state = logits.view(B, L, 3, -1)[:, :, 1, :]  # the state tokens
    per_sample = torch.zeros(B, L, dtype=dt, device=dev)
    o = 0
    for kk, n in enumerate(net.branch_sizes):
        per_sample = per_sample + F.cross_entropy(state[:, :, o:o + n].reshape(B * L, n), a[:, :, kk].reshape(-1),
                                                  reduction="none").view(B, L)
        o += n
    loss = per_sample.mean()
    loss.backward()
    return {"loss": float(loss.detach().cpu()), "logits": logits.detach().cpu().double().numpy(),
            "grads": {k: v.grad.detach().cpu().double().numpy() for k, v in P.items()}}
