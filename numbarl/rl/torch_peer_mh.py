"""PyTorch peer of the multi-horizon C51 loss (numbarl/rl/losses/multi_horizon.py), written the
PyTorch way: the regime blend, per horizon the masked double-DQN argmax, the dense Eq. 7 projection
(`numbarl.rl.torch_peer.project_distribution`) and the cross-entropy at the taken actions, the blended
batch mean, then autograd for ∂L/∂logits. The GPU test feeds it the agent's own head outputs of a
train step at full size (tests/rl/test_gpu_mh.py); the CPU test compares it with the float64
reference (tests/rl/test_mh.py).
"""

from __future__ import annotations

import numpy as np

from numbarl.rl.torch_peer import _torch, project_distribution


def multi_horizon_loss_and_grads(logits, actions, obs, horizons, support, branch_sizes, regime_col: int,
                                 trend_lo: float, trend_hi: float, mix: float, weights=None, device="cpu") -> dict:
    """The blended loss and its gradient.

    logits [B, n_branches, max_actions, Z] (online head on obs), actions [B, n_branches], obs [B, D];
    horizons: one dict per horizon (ascending) of numpy arrays next_q [B, n_branches, max_actions],
    target_probs [B, n_branches, max_actions, Z], rewards, dones, discounts [B] and optionally next_mask
    [B, n_branches, max_actions] (0 = not available); weights: importance weights [B] or None.
    Returns {"loss", "parts" [H] (each horizon's weighted loss), "d_logits" (same layout, 0 off the
    taken actions), "beta" [H, B], "trend" [B]} as numpy / floats.
    """
    torch = _torch()
    F = torch.nn.functional
    dev = torch.device(device)

    def t(x, dtype=torch.float32):
        return torch.as_tensor(np.ascontiguousarray(np.asarray(x)), device=dev).to(dtype)

    x = t(logits).requires_grad_(True)
    a = t(actions, torch.int64)
    z = t(support)
    n_h, batch = len(horizons), x.shape[0]
    rows = torch.arange(batch, device=dev)
    # REGIME: trend strength from the obs column, hat over the horizon index
    s = ((t(obs)[:, regime_col] - trend_lo) / (trend_hi - trend_lo)).clamp(0.0, 1.0).nan_to_num(0.0)
    idx = torch.arange(n_h, device=dev, dtype=torch.float32).unsqueeze(1)
    beta = (1.0 - mix) / n_h + mix * (1.0 - (s.unsqueeze(0) * (n_h - 1) - idx).abs()).clamp(min=0.0)  # [H, B]
    imp = t(weights) if weights is not None else torch.ones(batch, device=dev)
    parts = []
    for i, h in enumerate(horizons):
        # TARGETS at this horizon's next state (constants)
        with torch.no_grad():
            next_q, probs = t(h["next_q"]), t(h["target_probs"])
            mask = t(h["next_mask"], torch.bool) if h.get("next_mask") is not None else None
            targets = []
            for k, n in enumerate(branch_sizes):
                q = next_q[:, k, :n].clone()
                if mask is not None:
                    q[~mask[:, k, :n]] = -float("inf")
                a_star = q.argmax(dim=1)  # first maximum; all masked: every entry -inf, argmax 0
                p = probs[rows, k, a_star]  # [B, Z]
                targets.append(project_distribution(t(h["rewards"]), t(h["dones"]), t(h["discounts"]), p, z))
        # LOSS: cross-entropy at the taken actions, mean over branches, blended batch mean
        ce = torch.stack([-(targets[k] * F.log_softmax(x[rows, k, a[:, k]], dim=-1)).sum(-1)
                          for k in range(len(branch_sizes))], dim=1).mean(dim=1)  # [B]
        parts.append((beta[i] * imp * ce).mean())
    loss = torch.stack(parts).sum()
    loss.backward()
    return {"loss": float(loss.detach().cpu()), "parts": np.array([float(p.detach().cpu()) for p in parts]),
            "d_logits": x.grad.detach().cpu().numpy(), "beta": beta.cpu().numpy(), "trend": s.cpu().numpy()}
