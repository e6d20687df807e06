"""LayerNorm layer (Layer protocol) over numbarl.cuda.kernels.layernorm.

    y = (x − mean_r) / sqrt(var_r + eps) · γ + β      per row r of x [B, dim] (Ba, Kiros & Hinton 2016)

Forward saves mean and rstd per row; the backward gives dx and overwrites dγ, dβ (column
reductions over the batch: deterministic two-phase folds, no atomics — see the kernel module).

Parameters: ``{name}.gamma`` [dim] (init 1) and ``{name}.beta`` [dim] (init 0), as
torch.nn.LayerNorm; never weight-decayed. Activations per tag: ``{name}.{tag}.y``, ``.mean``,
``.rstd``, and with backward=True ``.dx`` and the reduction scratch ``.partials``.
"""

from __future__ import annotations

import numpy as np

from numbarl.cuda.kernels import layernorm as ln
from numbarl.cuda.runtime import Arena, cuda
from numbarl.rl.nets.base import ParamStore, zeros_init

_cuda = cuda()  # the backend (GPU or simulator), selected once

DEFAULT_EPS = ln.DEFAULT_EPS


def ones_init(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    return np.ones(shape, np.float32)


# ---------------------------------------------------------------------------------------------
# reference (numpy, float64; the kernel module's references with a layer-style cache)
# ---------------------------------------------------------------------------------------------
def layernorm_forward_ref(x, gamma, beta, eps=DEFAULT_EPS):
    """(y, cache) in float64; cache = (x, mean, rstd) for layernorm_backward_ref."""
    x = np.asarray(x, np.float64)
    y, mean, rstd = ln.layernorm_forward_ref(x, gamma, beta, eps)
    return y, (x, mean, rstd)


def layernorm_backward_ref(dy, cache, gamma):
    """(dx, dgamma, dbeta) in float64."""
    x, mean, rstd = cache
    return ln.layernorm_backward_ref(np.asarray(dy, np.float64), x, gamma, mean, rstd)


# ---------------------------------------------------------------------------------------------
# layer
# ---------------------------------------------------------------------------------------------
class LayerNorm:
    """LayerNorm over the last axis of x [B, dim] with learned γ, β (see module doc)."""

    def __init__(self, name: str, dim: int, eps: float = DEFAULT_EPS, group: str | None = None):
        self.name, self.dim, self.eps = name, int(dim), float(eps)
        if self.dim < 1 or not self.eps >= 0.0:
            raise ValueError(f"{name}: dim must be >= 1 and eps >= 0 (got {dim}, {eps})")
        self.group = group or name
        self.store: ParamStore | None = None
        self._acts: dict[str, Arena] = {}
        self._batch: dict[str, int] = {}
        self._inputs: dict[str, object] = {}

    @property
    def out_dim(self) -> int:
        return self.dim

    @property
    def param_names(self) -> dict[str, str]:
        return {"gamma": f"{self.name}.gamma", "beta": f"{self.name}.beta"}

    def _act(self, tag: str, what: str) -> str:
        return f"{self.name}.{tag}.{what}"

    def _arena(self, tag: str) -> Arena:
        acts = self._acts.get(tag)
        if acts is None:
            raise KeyError(f"{self.name}: no activations declared for tag {tag!r}; call declare_acts(acts, batch, {tag!r})")
        return acts

    # -- protocol -----------------------------------------------------------------------------
    def declare_params(self, store: ParamStore) -> None:
        n = self.param_names
        store.add(n["gamma"], (self.dim,), self.group, decay=False, init=ones_init)
        store.add(n["beta"], (self.dim,), self.group, decay=False, init=zeros_init)
        self.store = store

    def declare_acts(self, acts: Arena, batch: int, tag: str, backward: bool = True) -> None:
        b = int(batch)
        acts.add(self._act(tag, "y"), (b, self.dim), np.float32)
        acts.add(self._act(tag, "mean"), (b,), np.float32)
        acts.add(self._act(tag, "rstd"), (b,), np.float32)
        if backward:
            acts.add(self._act(tag, "dx"), (b, self.dim), np.float32)
            acts.add(self._act(tag, "partials"), ln.layernorm_partials_shape(b, self.dim), np.float32)
        self._acts[tag], self._batch[tag] = acts, b

    def output(self, tag: str = "online"):
        return self._arena(tag)[self._act(tag, "y")]

    def forward(self, x, stream, tag: str = "online", role: str = "params"):
        """y = LN(x) for x [B, dim]; params from store.arenas[role]. Capturable."""
        acts = self._arena(tag)
        if tuple(x.shape) != (self._batch[tag], self.dim):
            raise ValueError(f"{self.name}.forward({tag!r}): x has shape {tuple(x.shape)}, "
                             f"expected {(self._batch[tag], self.dim)}")
        if self.store is None:
            raise RuntimeError(f"{self.name}: declare_params(store) was not called")
        params, n = self.store.arenas[role], self.param_names
        y = acts[self._act(tag, "y")]
        ln.layernorm_forward(x, params[n["gamma"]], params[n["beta"]], y, acts[self._act(tag, "mean")],
                             acts[self._act(tag, "rstd")], self.eps, stream)
        self._inputs[tag] = x
        return y

    def backward(self, dy, stream, tag: str = "online"):
        """dx from dy [B, dim]; overwrites dγ, dβ. Uses x, mean, rstd saved by forward(tag)."""
        acts = self._arena(tag)
        if self._act(tag, "dx") not in acts:
            raise RuntimeError(f"{self.name}: tag {tag!r} was declared with backward=False; it has no backward buffers")
        x = self._inputs.get(tag)
        if x is None:
            raise RuntimeError(f"{self.name}.backward({tag!r}) before forward({tag!r})")
        params, grads, n = self.store.arenas["params"], self.store.arenas["grads"], self.param_names
        dx = acts[self._act(tag, "dx")]
        ln.layernorm_backward(dy, x, params[n["gamma"]], acts[self._act(tag, "mean")], acts[self._act(tag, "rstd")],
                              dx, grads[n["gamma"]], grads[n["beta"]], acts[self._act(tag, "partials")], stream)
        return dx

    # -- float64 reference of the layer (host dict of params by name; composable) --------------
    def forward_ref(self, x, params):
        n = self.param_names
        return layernorm_forward_ref(x, params[n["gamma"]], params[n["beta"]], self.eps)

    def backward_ref(self, dy, cache, params):
        n = self.param_names
        dx, dg, db = layernorm_backward_ref(dy, cache, params[n["gamma"]])
        return dx, {n["gamma"]: dg, n["beta"]: db}
