"""The Decision Transformer network (Chen et al. 2021, §3 and Fig. 1): tokens, causal blocks, action head.

A window of L steps of one trajectory is 3·L tokens, in time order (R̂_1, s_1, a_1, ..., R̂_L, s_L, a_L):
return-to-go R̂_t [B, L], state s_t [B, L, S] and the action a_t [B, L, n_b] (branch indices; −1 = no
action yet: the token of the step being decided). Token row r = b·3L + 3t + kind, kind 0 = R̂, 1 = s,
2 = a. Each token is one row of features F = 3 + 1 + S + W + L (W = Σ_k A_k)::

    columns [0, 3)          one-hot of the kind             → a bias per token kind
    column  3               R̂_t   (kind 0 only)            → R̂ embedding (Linear 1→E in the paper)
    [4, 4 + S)              s_t   (kind 1 only)            → state embedding (Linear S→E)
    [4 + S, 4 + S + W)      one-hot of a_t,k per branch k  → action embedding (one table per branch)
      (kind 2 only)
    [4 + S + W, F)          one-hot of the position t      → the learned position embedding, shared
                                                              by the three tokens of a step

so ONE Linear F→E ("{name}.embed") is exactly the paper's separate embeddings plus its position
embedding, and its gradient is one GEMM over the token rows (deterministic, no scatter-add). The
position is the step's index in the window (0 .. L−1), not the absolute time: the backtest has no
episodes, so a window is placed the same way in training and acting.

Then n_layers pre-LN causal transformer blocks (numbarl/rl/nets/attention.py: 3L tokens per
sequence), a final LayerNorm ("{name}.ln_f") and the action head Linear E→W ("{name}.head"):
logits [B·3L, W]; the loss and the policy read the state-token rows (r = b·3L + 3t + 1), which see
R̂_1..R̂_t, s_1..s_t and a_1..a_{t−1} (causal): the prediction of a_t.

:class:`DecisionTransformerNet` is a Stack (Sequential) of those modules, so it is a module on the
contract itself (float64 reference forward/backward composed from its layers).
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda.launch import blocks
from numbarl.cuda.runtime import cuda
from numbarl.rl.nets.attention import Stack, transformer_block
from numbarl.rl.nets.layernorm import LayerNorm
from numbarl.rl.nets.linear import Linear

_cuda = cuda()

BLOCK = 128
KIND_RTG, KIND_STATE, KIND_ACTION = 0, 1, 2
TOKENS_PER_STEP = 3


def token_features(state_dim: int, branch_sizes, context: int) -> int:
    """F: the width of a token row (module docstring)."""
    return 4 + int(state_dim) + int(sum(branch_sizes)) + int(context)


def branch_offsets(branch_sizes) -> np.ndarray:
    """o_k = Σ_{j<k} A_j: branch k's first column of the action one-hot and of the logits."""
    return np.concatenate([[0], np.cumsum(branch_sizes)[:-1]]).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# reference (numpy)
# ---------------------------------------------------------------------------------------------
def tokens_ref(rtg, states, actions, branch_sizes) -> np.ndarray:
    """tokens [B·3L, F] float32 from rtg [B, L], states [B, L, S], actions [B, L, n_b] (−1: none)."""
    rtg, states, actions = np.asarray(rtg), np.asarray(states), np.asarray(actions)
    B, L, S = states.shape
    W = int(sum(branch_sizes))
    offsets = branch_offsets(branch_sizes)
    out = np.zeros((B, L, TOKENS_PER_STEP, token_features(S, branch_sizes, L)), np.float32)
    for kind in range(TOKENS_PER_STEP):
        out[:, :, kind, kind] = 1.0
    out[:, :, KIND_RTG, 3] = rtg
    out[:, :, KIND_STATE, 4:4 + S] = states
    for b in range(B):
        for t in range(L):
            for k in range(actions.shape[2]):
                if actions[b, t, k] >= 0:
                    out[b, t, KIND_ACTION, 4 + S + offsets[k] + actions[b, t, k]] = 1.0
            out[b, t, :, 4 + S + W + t] = 1.0
    return out.reshape(B * L * TOKENS_PER_STEP, -1)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def tokens_kernel(rtg, states, actions, offsets, n_actions, tokens):
    """One thread per token row (module docstring); n_actions = W."""
    r = _cuda.grid(1)
    L = states.shape[1]
    if r >= tokens.shape[0]:
        return
    b = r // (TOKENS_PER_STEP * L)
    u = r - b * TOKENS_PER_STEP * L
    t = u // TOKENS_PER_STEP
    kind = u - t * TOKENS_PER_STEP
    S = states.shape[2]
    for c in range(tokens.shape[1]):
        tokens[r, c] = np.float32(0.0)
    tokens[r, kind] = np.float32(1.0)
    if kind == KIND_RTG:
        tokens[r, 3] = rtg[b, t]
    elif kind == KIND_STATE:
        for c in range(S):
            tokens[r, 4 + c] = states[b, t, c]
    else:
        for k in range(actions.shape[2]):
            a = actions[b, t, k]
            if a >= 0:
                tokens[r, 4 + S + offsets[k] + a] = np.float32(1.0)
    tokens[r, 4 + S + n_actions + t] = np.float32(1.0)


def launch_tokens(rtg, states, actions, offsets, tokens, stream) -> None:
    """tokens [B·3L, F] from the window buffers (capturable)."""
    n = int(tokens.shape[0])
    threads = min(BLOCK, n)
    n_actions = tokens.shape[1] - 4 - states.shape[2] - states.shape[1]
    tokens_kernel[blocks(n, threads), threads, stream](rtg, states, actions, offsets, np.int64(n_actions), tokens)


# ---------------------------------------------------------------------------------------------
# the network
# ---------------------------------------------------------------------------------------------
class DecisionTransformerNet(Stack):
    """embed (Linear F→E) → n_layers causal blocks → LayerNorm → head (Linear E→W), over 3L-token windows.

    Its input is the token matrix [B·3L, F] (:func:`launch_tokens`); its output the logits [B·3L, W].
    One optimizer group (``group``, default the name)."""

    def __init__(self, name: str, state_dim: int, branch_sizes, context: int, dim: int = 64, n_heads: int = 2,
                 n_layers: int = 1, activation: str = "relu", group: str | None = None, compute: str = "fp32"):
        self.state_dim, self.context = int(state_dim), int(context)
        self.branch_sizes = tuple(int(n) for n in branch_sizes)
        self.dim, self.n_heads, self.n_layers = int(dim), int(n_heads), int(n_layers)
        if activation not in ("relu", "silu"):
            raise ValueError(f"{name}: the MLP activation must be 'relu' or 'silu' (got {activation!r})")
        self.activation = activation
        if self.context < 1 or self.n_layers < 1:
            raise ValueError(f"{name}: context and n_layers must be >= 1 (got {context}, {n_layers})")
        self.n_tokens = TOKENS_PER_STEP * self.context
        self.in_dim = token_features(self.state_dim, self.branch_sizes, self.context)
        self.out_dim = int(sum(self.branch_sizes))
        group = group or name
        layers = [Linear(f"{name}.embed", self.in_dim, self.dim, None, group=group, input_grad=False, compute=compute)]
        layers += [transformer_block(f"{name}.block{i}", self.dim, self.n_heads, self.n_tokens, activation, group,
                                     compute) for i in range(self.n_layers)]
        layers += [LayerNorm(f"{name}.ln_f", self.dim, group=group),
                   Linear(f"{name}.head", self.dim, self.out_dim, None, group=group, compute=compute)]
        super().__init__(name, layers, group=group)
