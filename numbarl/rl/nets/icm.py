"""ICM curiosity models (Pathak, Agrawal, Efros & Darrell 2017, "Curiosity-driven Exploration by
Self-supervised Prediction", §2.2): a forward and an inverse model on the agent's trunk features.

For a sampled transition (s, a, s′) with trunk features φ = φ(s), φ′ = φ(s′) [B, H] and the taken
action of every branch k, a_k < A_k (one-hot blocks of width A = Σ_k A_k, branch k at columns
[o_k, o_k + A_k), o_k = Σ_{j<k} A_j):

    x_fwd = [φ, onehot(a_0), …, onehot(a_{K−1})]       [B, H + A]      input of the forward model
    x_inv = [φ, φ′]                                      [B, 2H]         input of the inverse model
    φ̂′     = W_f2ᵀ relu(W_f1ᵀ x_fwd + b_f1) + b_f2        [B, H]          forward model f (Eq. 4)
    logits = W_i2ᵀ relu(W_i1ᵀ x_inv + b_i1) + b_i2        [B, A]          inverse model g (Eq. 2):
                                                                         branch k's logits at [o_k, o_k + A_k)

Each model is two numbarl Linear layers (cuBLASLt GEMMs, bias and ReLU fused in the first's
epilogue; a :class:`Sequential`), so the float64 reference is the layers' references composed and
the backward is theirs. The losses on φ̂′ and the logits, and the intrinsic reward, are in
numbarl/rl/losses/icm.py.

**Detached features.** The models read φ and φ′ as constants: their first layers compute no input
gradient (``input_grad=False``) and nothing flows back into the trunk. The trunk is the C51 network's
(its features are whatever predicts returns best); letting the forward loss train it would reward
features that are easy to predict (alone it has a trivial minimizer, features that ignore the state:
the reason ICM has the inverse loss shape φ), and letting the inverse loss train it would make the Q
features encode the taken action, a second objective competing with the C51 loss on the same weights. Detached, ICM measures
novelty in the space the value function already uses and never changes how Q is computed. The
price: the features are not selected for controllability (Pathak et al.'s point), and they drift as
the trunk learns (the forward model chases a moving target: the running scale of the intrinsic
reward, numbarl/rl/losses/icm.py, absorbs the drift in magnitude).

**trunk_grad=True** (agent.curiosity_trunk_grad; off by default) is Pathak et al.'s feature learning
on the shared trunk: the inverse model's first layer computes its input gradient
dx_inv = [∂L/∂φ, ∂L/∂φ′] [B, 2H], and ``icm_split_grad_kernel`` adds the first half into the trunk's dh
of the online pass (after the C51 head and any auxiliary heads wrote theirs: the gradient ledger's
order) and copies the second half into ``d_phi_next`` for a second trunk backward on the "next" pass
(the trunk's parameter gradients then accumulate by the gradient rule). The forward loss never
reaches the trunk (its minimizer on shared features is features that ignore the state).

Parameters: ``{name}.fwd.fc0.w`` [H + A, n], ``.b`` [n], ``{name}.fwd.out.w`` [n, H], ``.b`` [H] in
optimizer group ``icm.forward``; ``{name}.inv.fc0.w`` [2H, n], ``.b`` [n], ``{name}.inv.out.w`` [n, A],
``.b`` [A] in group ``icm.inverse`` (kaiming-uniform weights, biases never decayed). Buffers per tag:
the layers' own, plus ``{name}.{tag}.x_fwd`` / ``x_inv`` in the caller's arena.

Thread mapping: ``icm_inputs_kernel``, one thread per (sample b, column j) of the concatenated
width 2H + A (j < H: φ into both inputs; H ≤ j < 2H: φ′ into x_inv; else one-hot column j − 2H of
x_fwd); ``icm_split_grad_kernel``, one thread per (b, j) of [B, H]. No reductions, no atomics.
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda import launch
from numbarl.cuda.runtime import Arena, cuda
from numbarl.rl.nets.linear import Linear
from numbarl.rl.nets.module import Sequential

_cuda = cuda()  # the backend (GPU or simulator), selected once

BLOCK = launch.shape(gpu=256, sim=32)  # threads per block of the input kernel

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


def branch_offsets(branch_sizes) -> np.ndarray:
    """o_k = Σ_{j<k} A_j: the first column of branch k in the one-hot block and the logits (int32)."""
    sizes = np.asarray(branch_sizes, np.int64)
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64)
# ---------------------------------------------------------------------------------------------
def icm_inputs_ref(phi, phi_next, actions, branch_sizes):
    """(x_fwd [B, H + A], x_inv [B, 2H]) in float64 (module docstring)."""
    phi = np.asarray(phi, np.float64)
    a = np.asarray(actions, np.int64)
    B = phi.shape[0]
    onehot = np.zeros((B, int(np.sum(branch_sizes))))
    for k, o in enumerate(branch_offsets(branch_sizes)):
        onehot[np.arange(B), o + a[:, k]] = 1.0
    return np.concatenate([phi, onehot], axis=1), np.concatenate([phi, np.asarray(phi_next, np.float64)], axis=1)


# ---------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------
@_cuda.jit(cache=True)
def icm_inputs_kernel(phi, phi_next, actions, col_branch, offsets, x_fwd, x_inv):
    """One thread per (b, j), j < 2H + A: see the module docstring's thread mapping."""
    i = _cuda.grid(1)
    B = phi.shape[0]
    H = phi.shape[1]
    A = col_branch.shape[0]
    width = 2 * H + A
    if i >= B * width:
        return
    b = i // width
    j = i - b * width
    if j < H:
        v = phi[b, j]
        x_fwd[b, j] = v
        x_inv[b, j] = v
    elif j < 2 * H:
        x_inv[b, j] = phi_next[b, j - H]
    else:
        c = j - 2 * H
        k = col_branch[c]
        x_fwd[b, H + c] = _ONE if c - offsets[k] == actions[b, k] else _ZERO


@_cuda.jit(cache=True)
def icm_split_grad_kernel(dx_inv, dh, d_phi_next):
    """One thread per (b, j), j < H: dh[b, j] += dx_inv[b, j] (∂L/∂φ onto the trunk's online dh, which
    the heads wrote first); d_phi_next[b, j] = dx_inv[b, H + j] (∂L/∂φ′ for the next pass's backward)."""
    i = _cuda.grid(1)
    B = dh.shape[0]
    H = dh.shape[1]
    if i >= B * H:
        return
    b = i // H
    j = i - b * H
    dh[b, j] += dx_inv[b, j]
    d_phi_next[b, j] = dx_inv[b, H + j]


# ---------------------------------------------------------------------------------------------
# the models
# ---------------------------------------------------------------------------------------------
class IcmModel(Sequential):
    """y = Linear(ReLU(Linear(x))): the forward or the inverse model (module docstring).
    input_grad=False (the agent's use): the first layer computes no dx (detached features)."""

    def __init__(self, name: str, in_dim: int, hidden: int, out_dim: int, group: str, input_grad: bool = False,
                 compute: str = "fp32"):
        self.in_dim, self.hidden, self.out_dim_ = int(in_dim), int(hidden), int(out_dim)
        layers = [Linear(f"{name}.fc0", self.in_dim, self.hidden, "relu", group=group, input_grad=input_grad,
                         compute=compute),
                  Linear(f"{name}.out", self.hidden, self.out_dim_, None, group=group, compute=compute)]
        super().__init__(name, layers, group)

    @property
    def out_dim(self) -> int:
        return self.out_dim_


class Icm:
    """The forward and inverse models and their input buffers (module docstring).

    icm = Icm("icm", H, branch_sizes, hidden)
    icm.declare_params(store); icm.declare_acts(acts, B, "online")
    phi_hat, logits = icm.forward(phi, phi_next, actions, stream)     # [B, H], [B, A]
    icm.backward(d_phi_hat, d_logits, stream)                        # parameter grads (gradient rule)
    """

    FORWARD_GROUP = "icm.forward"
    INVERSE_GROUP = "icm.inverse"

    def __init__(self, name: str, feature_dim: int, branch_sizes, hidden: int = 256, compute: str = "fp32",
                 trunk_grad: bool = False):
        self.name, self.trunk_grad = name, bool(trunk_grad)
        self.feature_dim, self.hidden = int(feature_dim), int(hidden)
        self.branch_sizes = tuple(int(a) for a in branch_sizes)
        if self.feature_dim < 1 or self.hidden < 1 or not self.branch_sizes or min(self.branch_sizes) < 1:
            raise ValueError(f"{name}: feature_dim, hidden and every branch size must be >= 1 "
                             f"(got {feature_dim}, {hidden}, {branch_sizes})")
        self.n_actions = int(sum(self.branch_sizes))  # A: one-hot width and logits per sample
        H, A = self.feature_dim, self.n_actions
        self.forward_model = IcmModel(f"{name}.fwd", H + A, self.hidden, H, self.FORWARD_GROUP, compute=compute)
        self.inverse_model = IcmModel(f"{name}.inv", 2 * H, self.hidden, A, self.INVERSE_GROUP,
                                      input_grad=self.trunk_grad, compute=compute)
        self.offsets = branch_offsets(self.branch_sizes)
        self.col_branch = np.repeat(np.arange(len(self.branch_sizes)), self.branch_sizes).astype(np.int32)
        self.tables = Arena(f"{name}.tables")
        self.tables.add("offsets", (len(self.branch_sizes),), np.int32)
        self.tables.add("col_branch", (A,), np.int32)
        self.tables.allocate()
        self.tables.load({"offsets": self.offsets, "col_branch": self.col_branch})
        self._acts: dict[str, Arena] = {}

    @property
    def models(self):
        return self.forward_model, self.inverse_model

    @property
    def param_names(self) -> list[str]:
        return self.forward_model.param_names + self.inverse_model.param_names

    def declare_params(self, store) -> None:
        for m in self.models:
            m.declare_params(store)

    def declare_acts(self, acts: Arena, batch: int, tag: str = "online", backward: bool = True) -> None:
        B, H, A = int(batch), self.feature_dim, self.n_actions
        acts.add(f"{self.name}.{tag}.x_fwd", (B, H + A), np.float32)
        acts.add(f"{self.name}.{tag}.x_inv", (B, 2 * H), np.float32)
        if self.trunk_grad and backward:
            acts.add(f"{self.name}.{tag}.d_phi_next", (B, H), np.float32)
        for m in self.models:
            m.declare_acts(acts, B, tag, backward=backward)
        self._acts[tag] = acts

    def inputs(self, tag: str = "online"):
        """(x_fwd, x_inv) views of the pass."""
        acts = self._acts[tag]
        return acts[f"{self.name}.{tag}.x_fwd"], acts[f"{self.name}.{tag}.x_inv"]

    def forward(self, phi, phi_next, actions, stream, tag: str = "online", role: str = "params"):
        """Both models on (φ, a) and (φ, φ′); returns (φ̂′ [B, H], logits [B, A]). Capturable."""
        x_fwd, x_inv = self.inputs(tag)
        B, H = x_fwd.shape[0], self.feature_dim
        if tuple(phi.shape) != (B, H) or tuple(phi_next.shape) != (B, H) or tuple(actions.shape) != (B, len(self.branch_sizes)):
            raise ValueError(f"{self.name}.forward: phi {tuple(phi.shape)}, phi_next {tuple(phi_next.shape)}, actions "
                             f"{tuple(actions.shape)}; expected {(B, H)}, {(B, H)}, {(B, len(self.branch_sizes))}")
        n = B * (2 * H + self.n_actions)
        icm_inputs_kernel[launch.blocks(n, BLOCK), BLOCK, stream](phi, phi_next, actions, self.tables["col_branch"],
                                                                   self.tables["offsets"], x_fwd, x_inv)
        phi_hat = self.forward_model.forward(x_fwd, stream, tag=tag, role=role)
        logits = self.inverse_model.forward(x_inv, stream, tag=tag, role=role)
        return phi_hat, logits

    def output(self, tag: str = "online"):
        """(φ̂′, logits) views of the pass, valid after forward."""
        return self.forward_model.output(tag), self.inverse_model.output(tag)

    def backward(self, d_phi_hat, d_logits, stream, tag: str = "online") -> None:
        """Parameter gradients of both models by the gradient rule; with trunk_grad the inverse model's
        input gradient [B, 2H] too (add_trunk_grads hands it to the trunk), else none (detached)."""
        self.forward_model.backward(d_phi_hat, stream, tag=tag)
        self.inverse_model.backward(d_logits, stream, tag=tag)

    def add_trunk_grads(self, dh, stream, tag: str = "online"):
        """trunk_grad: dh += ∂L_I/∂φ (dh [B, H]: the online pass's trunk gradient the heads wrote) and
        ∂L_I/∂φ′ into the d_phi_next buffer, which it returns (the next pass's trunk backward reads it).
        After backward(); capturable."""
        if not self.trunk_grad:
            raise RuntimeError(f"{self.name}: built without trunk_grad; the inverse model computes no input gradient")
        acts = self._acts[tag]
        dx_inv = acts[f"{self.inverse_model.layers[0].name}.{tag}.dx"]
        d_phi_next = acts[f"{self.name}.{tag}.d_phi_next"]
        B, H = d_phi_next.shape
        if tuple(dh.shape) != (B, H):
            raise ValueError(f"{self.name}.add_trunk_grads: dh has shape {tuple(dh.shape)}, expected {(B, H)}")
        icm_split_grad_kernel[launch.blocks(B * H, BLOCK), BLOCK, stream](dx_inv, dh, d_phi_next)
        return d_phi_next

    # -- float64 reference ----------------------------------------------------------------------
    def forward_ref(self, phi, phi_next, actions, params):
        """(φ̂′, logits, cache) in float64; params: {store name: array}."""
        x_fwd, x_inv = icm_inputs_ref(phi, phi_next, actions, self.branch_sizes)
        phi_hat, c_f = self.forward_model.forward_ref(x_fwd, params)
        logits, c_i = self.inverse_model.forward_ref(x_inv, params)
        return phi_hat, logits, (c_f, c_i)

    def backward_ref(self, d_phi_hat, d_logits, cache, params, trunk_grads: bool = False):
        """{store name: gradient} of both models in float64; trunk_grads: also (∂L_I/∂φ, ∂L_I/∂φ′)."""
        c_f, c_i = cache
        _, g_f = self.forward_model.backward_ref(np.asarray(d_phi_hat, np.float64), c_f, params)
        dx_inv, g_i = self.inverse_model.backward_ref(np.asarray(d_logits, np.float64), c_i, params)
        if trunk_grads:
            H = self.feature_dim
            return {**g_f, **g_i}, (dx_inv[:, :H], dx_inv[:, H:])
        return {**g_f, **g_i}
