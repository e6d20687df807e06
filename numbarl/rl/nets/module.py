"""The module contract every network piece of numbarl follows (layers, heads, whole networks).

A module declares its parameters and its per-pass buffers ONCE, as data (:class:`Param`,
:class:`Buf`); the base class :class:`Module` does the bookkeeping every layer used to copy
(naming, arena declarations, per-pass views, saved inputs, shape checks) and gives the component
author two kernel methods and two float64 reference methods to write::

    class MyLayer(Module):
        def params(self) -> list[Param]                       # trainable tensors (names relative to the module)
        def buffers(self, batch, backward, **opts) -> list[Buf]   # one pass's activations / scratch
        def in_shape(self, batch) -> tuple | None             # expected input shape (checked), None: any
        def forward_impl(self, c: Ctx, x) -> y                # enqueue kernels/GEMMs on c.stream
        def backward_impl(self, c: Ctx, dy, dx) -> dx | None  # grads through c.beta(); dx into `dx`
        def forward_ref(self, x, params) -> (y, cache)        # float64, host dict of params by full name
        def backward_ref(self, dy, cache, params) -> (dx, {full name: grad})

Passes. One set of parameters serves several independent passes per train step (online net on
obs with backward; online net on next_obs; target net on next_obs; acting; evaluation), so
buffers are declared per *tag* and forward takes the parameter *role* ("params" or "target"):
``declare_acts(acts, batch, tag, backward)`` then ``forward(x, stream, tag, role)`` and
``backward(dy, stream, tag)``. Buffer names are ``{module}.{tag}.{buf}``; parameter names
``{module}.{param}``. Views are fixed-address (SPEC §2.1), so every call is capturable.

The gradient rule (docs/ARCHITECTURE.md; the accumulating backward of llm.c's GPT-2 trainer). Inside one train step,
opened by :meth:`ParamStore.begin_step`, the first backward that writes a parameter's gradient
overwrites it and every later write accumulates, in program order: ``c.beta(key)`` returns 0.0
the first time a gradient is written in the step and 1.0 afterwards. The choice is made on the
host while the step function runs, so the eager warm-up, the captured graph and eager replays
make the same choice; GEMMs take it as ``beta`` and column sums / LayerNorm parameter grads as
``accumulate``, so there are no atomics and the bits are the same every run. Outside a step
(a layer test calling backward once) every write overwrites. The same ledger covers input
gradients: ``backward(dy, stream, tag, dx_out=buf)`` writes the module's input gradient into a
caller's buffer, overwriting on the first write of the step and adding afterwards, which is how
two heads train one trunk (``head_a.backward(..., dx_out=dh); head_b.backward(..., dx_out=dh);
trunk.backward(dh)``).

Contract test: tests/rl/test_module_contract.py runs every module in
:data:`numbarl.rl.nets.registry.MODULES` through the same checks (finite differences of the
reference, device vs reference on odd shapes, two consumers accumulating, a new step
overwriting; on a GPU: graph replay == eager, bitwise). docs/ARCHITECTURE.md walks through adding
one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from numbarl.cuda.kernels import elementwise
from numbarl.cuda.runtime import Arena
from numbarl.rl.nets.base import ParamStore, zeros_init


@dataclass(frozen=True)
class Param:
    """One trainable tensor of a module.

    name: relative to the module ("w", "value.w"); the store's name is "{module}.{name}".
    key: what the module's code calls it (``c.p(key)``, ``param_names[key]``); default: name.
    group: tensor group (weight-decay mask, optimizer groups); default: the module's group.
    """

    name: str
    shape: tuple
    init: Callable = field(default=zeros_init, compare=False)
    decay: bool = False
    group: str | None = None
    key: str | None = None

    @property
    def k(self) -> str:
        return self.key or self.name


@dataclass(frozen=True)
class Buf:
    """One buffer of a pass: "{module}.{tag}.{name}" in the activation arena."""

    name: str
    shape: tuple
    dtype: type = np.float32


class Ctx:
    """What forward_impl / backward_impl see: the views of ONE pass (tag) in ONE parameter role."""

    def __init__(self, module: "Module", tag: str, role: str, stream):
        self.module, self.tag, self.role, self.stream = module, tag, role, stream
        self.batch = module._batch[tag]
        self.dx_beta = 0.0  # how a backward writes its input gradient: 0.0 overwrite, 1.0 add

    def p(self, key: str):
        """Parameter view in this pass's role ("params" or "target"); a view the store substitutes
        for it where one is registered (a spectrally normalized weight's W_sn)."""
        store, name = self.module.store, self.module.param_names[key]
        subs = getattr(store, "substitutes", None)
        sub = subs.get((self.role, name)) if subs else None
        return store.arenas[self.role][name] if sub is None else sub

    def g(self, key: str):
        """Gradient view."""
        return self.module.store.arenas["grads"][self.module.param_names[key]]

    def beta(self, key: str) -> float:
        """0.0 on the first write of this gradient in the step, 1.0 afterwards (see module doc)."""
        return self.module.store.grad_beta(self.module.param_names[key])

    def buf(self, name: str):
        """This pass's buffer view, None when the pass did not declare it."""
        acts = self.module._arena(self.tag)
        full = self.module._buf_name(self.tag, name)
        return acts[full] if full in acts else None

    def x(self):
        """The input saved by forward(tag)."""
        return self.module._inputs[self.tag]


class Module:
    """Base of every layer, head and network (see the module docstring for the contract)."""

    # True when backward_impl can write its input gradient into a caller's buffer with a beta
    # (GEMM-ended backwards); otherwise the base adds the module's own dx into it (one kernel).
    native_dx_accumulate = False

    def __init__(self, name: str, group: str | None = None):
        self.name = name
        self.group = group or name
        self.store: ParamStore | None = None
        self._acts: dict[str, Arena] = {}
        self._batch: dict[str, int] = {}
        self._inputs: dict[str, object] = {}
        self._backward: dict[str, bool] = {}
        self._opts: dict[str, dict] = {}

    # -- what a component writes ---------------------------------------------------------------
    def params(self) -> list[Param]:
        return []

    def buffers(self, batch: int, backward: bool, **opts) -> list[Buf]:
        return []

    def in_shape(self, batch: int) -> tuple | None:
        return None

    def forward_impl(self, c: Ctx, x):
        raise TypeError(f"{type(self).__name__} does not define forward_impl (see numbarl.rl.nets.module)")

    def backward_impl(self, c: Ctx, dy, dx):
        raise TypeError(f"{type(self).__name__} does not define backward_impl (see numbarl.rl.nets.module)")

    def forward_ref(self, x, params):
        raise TypeError(f"{type(self).__name__} does not define forward_ref (see numbarl.rl.nets.module)")

    def backward_ref(self, dy, cache, params):
        raise TypeError(f"{type(self).__name__} does not define backward_ref (see numbarl.rl.nets.module)")

    # dx buffer of a pass: modules name it "dx" (None: the module computes no input gradient)
    def dx_buffer(self, c: Ctx):
        return c.buf("dx")

    # -- provided by the base -------------------------------------------------------------------
    @property
    def param_names(self) -> dict[str, str]:
        """{key: store name} of this module's parameters (empty for parameter-free modules)."""
        return {p.k: f"{self.name}.{p.name}" for p in self.params()}

    def _buf_name(self, tag: str, name: str) -> str:
        return f"{self.name}.{tag}.{name}"

    def _arena(self, tag: str) -> Arena:
        acts = self._acts.get(tag)
        if acts is None:
            raise KeyError(f"{self.name}: no activations declared for tag {tag!r}; "
                           f"call declare_acts(acts, batch, {tag!r})")
        return acts

    def declare_params(self, store: ParamStore) -> None:
        for p in self.params():
            store.add(f"{self.name}.{p.name}", p.shape, p.group or self.group, decay=p.decay, init=p.init)
        self.store = store

    def declare_acts(self, acts: Arena, batch: int, tag: str, backward: bool = True, **opts) -> None:
        """Buffers of one pass; backward=False (target / next / acting passes) skips the gradients."""
        b = int(batch)
        for buf in self.buffers(b, backward, **opts):
            acts.add(self._buf_name(tag, buf.name), buf.shape, buf.dtype)
        self._acts[tag], self._batch[tag], self._backward[tag], self._opts[tag] = acts, b, bool(backward), opts

    def output(self, tag: str = "online"):
        """The pass's output view ("y"), valid after forward."""
        return self._arena(tag)[self._buf_name(tag, "y")]

    def forward(self, x, stream, tag: str = "online", role: str = "params"):
        """Enqueue the forward pass of tag on x; parameters from store.arenas[role]. Capturable."""
        self._arena(tag)
        expected = self.in_shape(self._batch[tag])
        if expected is not None and tuple(x.shape) != tuple(expected):
            raise ValueError(f"{self.name}.forward({tag!r}): x has shape {tuple(x.shape)}, expected {tuple(expected)}")
        if self.params() and self.store is None:
            raise RuntimeError(f"{self.name}: declare_params(store) was not called")
        self._inputs[tag] = x
        return self.forward_impl(Ctx(self, tag, role, stream), x)

    def backward(self, dy, stream, tag: str = "online", dx_out=None):
        """Enqueue the backward of tag from dy: parameter grads by the gradient rule; returns dx.

        dx_out: a caller's buffer for the input gradient, overwritten on its first write in the
        step and accumulated into afterwards (two consumers of one tensor); None: the module's
        own dx buffer (or None when it computes no input gradient).
        """
        self._arena(tag)
        if not self._backward[tag]:
            raise RuntimeError(f"{self.name}: tag {tag!r} was declared with backward=False; it has no backward buffers")
        if tag not in self._inputs:
            raise RuntimeError(f"{self.name}.backward({tag!r}) before forward({tag!r})")
        c = Ctx(self, tag, "params", stream)
        if dx_out is None:
            return self.backward_impl(c, dy, self.dx_buffer(c))
        beta = self.store.act_beta(dx_out) if self.store is not None else 0.0
        if self.native_dx_accumulate:
            c.dx_beta = beta
            return self.backward_impl(c, dy, dx_out)
        own = self.dx_buffer(c)
        if own is None:
            raise RuntimeError(f"{self.name}: this pass computes no input gradient; dx_out cannot be filled")
        dx = self.backward_impl(c, dy, own)
        if beta == 0.0:
            elementwise.copy(dx, dx_out, stream)
        else:
            elementwise.axpy(1.0, dx, dx_out, stream)
        return dx_out


class Sequential(Module):
    """Modules run in order; backward in reverse; references composed. Parameters and buffers
    belong to the children (their names are theirs); the output is the last child's."""

    def __init__(self, name: str, layers, group: str | None = None):
        super().__init__(name, group)
        self.layers = list(layers)
        if not self.layers:
            raise ValueError(f"{name}: a Sequential needs at least one layer")

    @property
    def param_names(self) -> list[str]:
        names = []
        for layer in self.layers:
            names.extend(layer.param_names.values())
        return names

    def declare_params(self, store: ParamStore) -> None:
        for layer in self.layers:
            layer.declare_params(store)
        self.store = store

    def declare_acts(self, acts: Arena, batch: int, tag: str, backward: bool = True, **opts) -> None:
        for layer in self.layers:
            layer.declare_acts(acts, batch, tag, backward=backward, **opts)
        self._acts[tag], self._batch[tag], self._backward[tag] = acts, int(batch), bool(backward)

    def output(self, tag: str = "online"):
        return self.layers[-1].output(tag)

    def forward(self, x, stream, tag: str = "online", role: str = "params"):
        h = x
        for layer in self.layers:
            h = layer.forward(h, stream, tag=tag, role=role)
        self._inputs[tag] = x
        return h

    def backward(self, dy, stream, tag: str = "online", dx_out=None):
        d = dy
        for i, layer in enumerate(reversed(self.layers)):
            last = i == len(self.layers) - 1
            d = layer.backward(d, stream, tag=tag, dx_out=dx_out if last else None)
        return d

    def forward_ref(self, x, params):
        caches = []
        h = x
        for layer in self.layers:
            h, cache = layer.forward_ref(h, params)
            caches.append(cache)
        return h, caches

    def backward_ref(self, dy, caches, params):
        grads: dict[str, np.ndarray] = {}
        d = dy
        for layer, cache in zip(reversed(self.layers), reversed(caches)):
            d, g = layer.backward_ref(d, cache, params)
            for k, v in g.items():
                grads[k] = grads[k] + v if k in grads else v
        return d, grads
