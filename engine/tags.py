"""The engine's vocabulary: what it did to make an object usable, and how exact that was."""

from __future__ import annotations

import enum


class Exactness(str, enum.Enum):
    """How far a tag's result may move the model's output from the exact baseline."""

    EXACT = "exact"  # bitwise the same weights / K,V as the exact baseline
    EQUIVALENT = "equivalent"  # same math, other kernel or order: tiny numeric difference
    APPROXIMATE = "approximate"  # changes the output on purpose; spends quality budget


class Tag(str, enum.Enum):
    """Fallback tag: the action taken for one object in one step."""

    RESIDENT = "resident"
    EXACT_LOAD = "exact_load"
    CPU_EXECUTE = "cpu_execute"
    EXPERT_DEFER = "expert_defer"
    EXPERT_LOWBIT = "expert_lowbit"
    KV_DEQUANT = "kv_dequant"
    RECOMPUTE = "recompute"

    @property
    def exactness(self) -> Exactness:
        """The exactness this tag declares."""
        return TAG_EXACTNESS[self]

    @property
    def is_approximate(self) -> bool:
        return TAG_EXACTNESS[self] is Exactness.APPROXIMATE


TAG_EXACTNESS: dict[Tag, Exactness] = {
    Tag.RESIDENT: Exactness.EXACT,
    Tag.EXACT_LOAD: Exactness.EXACT,
    Tag.CPU_EXECUTE: Exactness.EQUIVALENT,
    Tag.EXPERT_DEFER: Exactness.APPROXIMATE,
    Tag.EXPERT_LOWBIT: Exactness.APPROXIMATE,
    Tag.KV_DEQUANT: Exactness.APPROXIMATE,
    Tag.RECOMPUTE: Exactness.EQUIVALENT,
}

EXPERT_TAGS: frozenset[Tag] = frozenset(
    {Tag.RESIDENT, Tag.EXACT_LOAD, Tag.CPU_EXECUTE, Tag.EXPERT_DEFER, Tag.EXPERT_LOWBIT}
)
KV_TAGS: frozenset[Tag] = frozenset({Tag.RESIDENT, Tag.EXACT_LOAD, Tag.KV_DEQUANT, Tag.RECOMPUTE})
NON_EXACT_TAGS: tuple[Tag, ...] = tuple(t for t in Tag if t.exactness is not Exactness.EXACT)
"""The tags a quality budget must allow before a controller may use them, in enum order."""
TAGS_BY_EXACTNESS: tuple[Tag, ...] = tuple(t for e in Exactness for t in Tag if t.exactness is e)
"""Every tag, exact first and approximate last (enum order within one exactness): the order reports show."""


class ObjectKind(str, enum.Enum):
    """What kind of object an event is about."""

    EXPERT = "expert"
    KV_BLOCK = "kv_block"


class Tier(str, enum.Enum):
    """Where a copy of an object lives."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
