"""Named slots: statistics vectors and RNG streams, registered by name and collision-checked.

Kernels index a statistics vector and key counter-RNG draws with small integers that must be
compile-time constants (numba specializes on globals) and must never collide: two owners writing
one stats slot, or two draws sharing an RNG slot, silently corrupt a run. So every
slot is registered once, at import, under a name::

    TRAIN_STATS = StatsLayout("agent")
    STAT_LOSS = TRAIN_STATS.slot("loss", 8)          # a fixed number: recorded results reproduce
    STAT_NEW = TRAIN_STATS.slot("new_term")          # next free number

    EXPLORE = RNG_STREAMS.claim("explore.coin", 0, width=4)   # slots 0..3, one per action branch

A second claim of a taken number (or an overlapping range) raises at import with both owners'
names; :meth:`StatsLayout.read` turns a host copy of the vector into ``{name: value}``.
The stats vector itself is mapped pinned memory (numbarl.cuda.mapped) that kernels write and the
host reads at log intervals.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class SlotCollision(ValueError):
    """Two owners claimed one stats slot or one RNG slot."""


@dataclass(frozen=True)
class Slot:
    name: str
    index: int
    width: int = 1
    kind: str = "float"   # how read() reports it: "float" or "int"


class _Slots:
    def __init__(self, what: str, limit: int | None = None):
        self.what, self.limit = what, limit
        self.slots: dict[str, Slot] = {}

    def _claim(self, name: str, index: int | None, width: int, kind: str) -> Slot:
        if name in self.slots:
            raise SlotCollision(f"{self.what}: {name!r} is registered twice")
        taken = {i: s.name for s in self.slots.values() for i in range(s.index, s.index + s.width)}
        if index is None:
            index = 0
            while any(i in taken for i in range(index, index + width)):
                index += 1
        index, width = int(index), int(width)
        if index < 0 or width < 1 or (self.limit is not None and index + width > self.limit):
            raise SlotCollision(f"{self.what}: {name!r} asks for slots {index}..{index + width - 1}, "
                                f"outside 0..{self.limit - 1 if self.limit else 'inf'}")
        clash = sorted({taken[i] for i in range(index, index + width) if i in taken})
        if clash:
            raise SlotCollision(f"{self.what}: {name!r} asks for slots {index}..{index + width - 1}, "
                                f"already held by {', '.join(repr(c) for c in clash)}")
        slot = Slot(name, index, width, kind)
        self.slots[name] = slot
        return slot

    def __contains__(self, name: str) -> bool:
        return name in self.slots

    def __getitem__(self, name: str) -> Slot:
        return self.slots[name]

    def table(self) -> list[Slot]:
        return sorted(self.slots.values(), key=lambda s: s.index)


class StatsLayout(_Slots):
    """The named slots of one float32 statistics vector."""

    def __init__(self, name: str):
        super().__init__(f"stats vector {name!r}")
        self.name = name

    def slot(self, name: str, index: int | None = None, kind: str = "float") -> int:
        """Register `name` at `index` (None: the first free one); returns the index."""
        return self._claim(name, index, 1, kind).index

    def copy(self, name: str | None = None) -> "StatsLayout":
        """A layout with the same slots, to which an instance adds its own (e.g. one slot per
        optimizer group, known only once the network is built)."""
        out = StatsLayout(name or self.name)
        out.slots = dict(self.slots)
        return out

    @property
    def size(self) -> int:
        return max((s.index + s.width for s in self.slots.values()), default=0)

    def read(self, values: np.ndarray) -> dict:
        """{name: value} from a host copy of the vector (ints for slots registered kind="int")."""
        out = {}
        for s in self.table():
            v = values[s.index]
            out[s.name] = int(v) if s.kind == "int" else float(v)
        return out


class RngStreams(_Slots):
    """The named slot ranges of the counter RNG (numbarl.cuda.rng: one draw per lane, counter, slot)."""

    def __init__(self):
        super().__init__("counter-RNG slots", limit=1 << 16)

    def claim(self, name: str, index: int | None = None, width: int = 1) -> int:
        """Reserve slots index..index+width-1 for `name`; returns the first."""
        return self._claim(name, index, width, "int").index


# every counter-RNG draw in numbarl claims its slots here (the numbers predate the registry and
# are kept: recorded runs reproduce bit for bit)
RNG_STREAMS = RngStreams()
