"""Parameter store and the layer protocol shared by every network in numbarl.

Parameters live in ONE flat float32 buffer (an Arena) with a named view per tensor; gradients,
Adam moments and the target network mirror it view for view (same names, same offsets), so the
optimizer, gradient clipping and target updates run over flat vectors with one launch each
(SPEC §2.1). Checkpoints are the params buffer plus metadata.

Layer protocol (every layer / head / network follows it; written once in
numbarl/rl/nets/module.py, whose base class does this bookkeeping). One set of parameters serves several
independent passes per train step (online net on obs with backward; online net on next_obs for
the double-DQN argmax; target net on next_obs), so activation buffers are declared per *tag* and
forward takes the parameter *role* ("params" or "target"):

    class Layer:
        def declare_params(self, store: ParamStore) -> None      # store.add(...) each tensor once
        def declare_acts(self, acts: Arena, batch: int, tag: str) -> None
            # one set of activation/scratch buffers per pass tag ("online", "next", "target", ...)
        def forward(self, x, stream, tag="online", role="params") -> y
            # y is a fixed-address view of acts; params read from store.arenas[role]
        def backward(self, dy, stream, tag="online", dx_out=None) -> dx
            # uses the activations saved by forward(tag); inside a step (begin_step) the first
            # write of a gradient overwrites and later writes add (grad_beta); returns dx (None
            # for the first layer if not needed)

Views are looked up lazily (arena[name] caches), so layers keep the store/acts they were declared
with and fetch views by name after allocation.

Weights are stored [in, out] row-major so that y = x @ W + b for x [B, in].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from numbarl.cuda.runtime import Arena


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple
    group: str          # tensor group: weight-decay mask, LR groups, targeted resets ("trunk", "head.value", ...)
    decay: bool         # weight decay applies to this tensor
    init: Callable[[np.random.Generator, tuple], np.ndarray] = field(compare=False)


def zeros_init(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    return np.zeros(shape, np.float32)


def kaiming_uniform_init(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    """PyTorch nn.Linear default for a [in, out] weight: U(-1/sqrt(in), 1/sqrt(in))."""
    bound = 1.0 / np.sqrt(shape[0])
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


def bias_uniform_init(fan_in: int):
    def init(rng: np.random.Generator, shape: tuple) -> np.ndarray:
        bound = 1.0 / np.sqrt(fan_in)
        return rng.uniform(-bound, bound, size=shape).astype(np.float32)

    return init


def _address(buffer):
    """A device view's identity for the ledger: its data pointer (simulator: the numpy buffer)."""
    host = buffer.__dict__.get("_ary") if hasattr(buffer, "__dict__") else None
    if isinstance(host, np.ndarray):  # simulator: the wrapped numpy array
        return int(host.__array_interface__["data"][0]), tuple(buffer.shape)
    return int(buffer.device_ctypes_pointer.value), tuple(buffer.shape)


class ParamStore:
    """Named parameters in one flat buffer, mirrored by grads, Adam m/v and the target network."""

    ROLES = ("params", "grads", "adam_m", "adam_v", "target")

    def __init__(self):
        self.specs: dict[str, ParamSpec] = {}
        self.arenas: dict[str, Arena] = {role: Arena(role) for role in self.ROLES}
        self._allocated = False
        # gradient ledger of the open train step (numbarl.rl.nets.module: the gradient rule)
        self._in_step = False
        self._written: set = set()
        # {(role, name): device view} a module's c.p() reads instead of the arena's view of that
        # parameter (numbarl/rl/nets/spectral_norm.py: W_sn for a spectrally normalized weight)
        self.substitutes: dict = {}

    # -- the gradient rule ----------------------------------------------------------------------
    def begin_step(self) -> None:
        """Open a train step: the next write of every gradient overwrites, later writes add."""
        self._in_step = True
        self._written = set()

    def end_step(self) -> None:
        """Close the step (the optimizer does, after reading the gradients)."""
        self._in_step = False

    @property
    def in_step(self) -> bool:
        return self._in_step

    def grad_beta(self, name: str) -> float:
        """0.0 for the first write of parameter `name`'s gradient in the step, 1.0 afterwards.
        Outside a step every write overwrites (one backward, e.g. a layer test)."""
        return self._ledger(("grad", name))

    def act_beta(self, buffer) -> float:
        """The same rule for an activation gradient buffer shared by several consumers."""
        return self._ledger(("act", _address(buffer)))

    def _ledger(self, key) -> float:
        if not self._in_step:
            return 0.0
        if key in self._written:
            return 1.0
        self._written.add(key)
        return 0.0

    def add(self, name: str, shape, group: str, decay: bool, init=zeros_init) -> None:
        if name in self.specs:
            raise ValueError(f"parameter {name!r} declared twice")
        shape = tuple(int(s) for s in shape)
        self.specs[name] = ParamSpec(name, shape, group, decay, init)
        for arena in self.arenas.values():
            arena.add(name, shape, np.float32)

    def allocate(self) -> "ParamStore":
        for arena in self.arenas.values():
            arena.allocate()
        self._allocated = True
        return self

    # -- views --------------------------------------------------------------------------------
    def param(self, name):
        return self.arenas["params"][name]

    def grad(self, name):
        return self.arenas["grads"][name]

    def flat(self, role: str = "params"):
        """The role's whole buffer as one float32 vector (padding between views stays zero)."""
        return self.arenas[role].flat(np.float32)

    @property
    def n_params(self) -> int:
        return int(sum(np.prod(s.shape) for s in self.specs.values()))

    @property
    def flat_size(self) -> int:
        return self.arenas["params"].nbytes // 4

    def groups(self) -> list[str]:
        return sorted({s.group for s in self.specs.values()})

    def mask(self, predicate: Callable[[ParamSpec], bool]) -> np.ndarray:
        """Host float32 mask over the flat buffer: 1 where predicate(spec) holds, else 0."""
        m = np.zeros(self.flat_size, np.float32)
        arena = self.arenas["params"]
        for spec in self.specs.values():
            v = arena.views[spec.name]
            if predicate(spec):
                m[v.offset // 4 : v.offset // 4 + v.size] = 1.0
        return m

    def decay_mask(self) -> np.ndarray:
        return self.mask(lambda s: s.decay)

    def optimizer_groups(self) -> list[str]:
        """The optimizer's parameter groups: every tensor group, in declaration order."""
        return list(dict.fromkeys(s.group for s in self.specs.values()))

    def group_ids(self, groups: list[str]) -> np.ndarray:
        """Host int32 over the flat buffer: the index in `groups` of each element's tensor group
        (padding between views: 0; its grads and moments are zero, so its group does not matter)."""
        ids = np.zeros(self.flat_size, np.int32)
        arena = self.arenas["params"]
        for spec in self.specs.values():
            v = arena.views[spec.name]
            ids[v.offset // 4 : v.offset // 4 + v.size] = groups.index(spec.group)
        return ids

    # -- host I/O -----------------------------------------------------------------------------
    def init(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Draw initial values on the host (in declaration order), load them into params and
        target, zero grads and moments. Returns the host values."""
        values = {name: np.asarray(spec.init(rng, spec.shape), np.float32) for name, spec in self.specs.items()}
        self.load(values)
        self.arenas["target"].load(values)
        zero = {name: np.zeros(spec.shape, np.float32) for name, spec in self.specs.items()}
        for role in ("grads", "adam_m", "adam_v"):
            self.arenas[role].load(zero)
        return values

    def load(self, values: dict[str, np.ndarray], role: str = "params") -> None:
        self.arenas[role].load(values)

    def to_host(self, role: str = "params") -> dict[str, np.ndarray]:
        return self.arenas[role].to_host()
