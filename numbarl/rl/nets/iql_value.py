"""IQL value head (Kostrikov, Nair & Levine 2021, "Offline RL with Implicit Q-Learning"): a state value
V(s) on the shared trunk's features, trained by the expectile loss (numbarl/rl/losses/expectile.py).

For the trunk output h [B, H] (the online pass's) and hidden width n:

    pre[b, :] = h[b, :]·W_0 + b_0                Linear "fc0"      [B, n]
    a[b, :]   = silu(pre[b, :])                   Activation "act0" (SiLU, Elfwing et al. 2018)
    V[b]      = a[b, :]·W_1 + b_1                 Linear "out"      [B, 1]

One hidden layer, numbarl's Linear + Activation modules (a :class:`Sequential`), so the kernels are
the cuBLASLt GEMMs and the elementwise SiLU every other layer uses, and the float64 reference is the
layers' references composed. Backward from dV [B, 1] (the loss writes it):

    da = dV·W_1ᵀ,  dW_1 = aᵀ·dV,  db_1 = colsum(dV)             Linear "out"
    dpre = da ⊙ silu'(pre)                                      Activation
    dh = dpre·W_0ᵀ,  dW_0 = hᵀ·dpre,  db_0 = colsum(dpre)        Linear "fc0" (input gradient on)

dh is the head's input gradient: with ``backward(dV, s, tag, dx_out=dh_shared)`` the first Linear's
GEMM writes it with beta = 1 into a buffer the C51 head wrote first (the gradient ledger of
numbarl/rl/nets/module.py), so the trunk's backward runs once on the sum of the heads' parts.

Parameters (optimizer group ``head.iql`` unless given): ``{name}.fc0.w`` [H, n], ``{name}.fc0.b`` [n],
``{name}.out.w`` [n, 1], ``{name}.out.b`` [1] (kaiming-uniform weights with weight decay, biases
without). Buffers per tag: the layers' own (``{name}.fc0.{tag}.y`` …; ``{name}.out.{tag}.y`` is V).
"""

from __future__ import annotations

from numbarl.rl.nets.activations import Activation
from numbarl.rl.nets.linear import Linear
from numbarl.rl.nets.module import Sequential


class IqlValueHead(Sequential):
    """V(s) = Linear(SiLU(Linear(h))) [B, 1] on the trunk features h [B, H] (module docstring)."""

    def __init__(self, name: str, in_dim: int, hidden: int = 256, group: str | None = "head.iql",
                 compute: str = "fp32"):
        self.in_dim, self.hidden = int(in_dim), int(hidden)
        if self.in_dim < 1 or self.hidden < 1:
            raise ValueError(f"{name}: in_dim and hidden must be >= 1 (got {in_dim}, {hidden})")
        group = group or name
        layers = [Linear(f"{name}.fc0", self.in_dim, self.hidden, None, group=group, input_grad=True, compute=compute),
                  Activation(f"{name}.act0", self.hidden, "silu"),
                  Linear(f"{name}.out", self.hidden, 1, None, group=group, compute=compute)]
        super().__init__(name, layers, group)

    @property
    def out_dim(self) -> int:
        return 1
