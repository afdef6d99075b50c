"""What a pool has done and holds, for metrics: event counters and a state snapshot.

``PoolCounters`` is bumped by ``PageAllocator`` in the same call that writes the free
log's event, so the frees and pins it counts by reason agree exactly with the log
(whether or not a log is attached). ``PoolStats`` is one consistent reading of a pool,
taken under its owner's lock: pages by state, held pages by owner kind, and the counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Page states of docs/freelog.md: every page id of a pool is in exactly one.
PAGE_STATES = ("free", "owned", "pinned", "pending", "reserved")
# Allocator operations counted; each is one free-log ``op``.
OPS = ("alloc", "free", "pin", "unpin", "release", "handoff")


class PoolCounters:
    """Events and pages per (op, reason) since the pool was made; ``reason`` is ''
    for ops that carry none (alloc, unpin, release, handoff)."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], list[int]] = {}

    def record(self, op: str, num_pages: int, reason: object = "") -> None:
        reason = getattr(reason, "value", reason)   # a str enum counts under its value
        entry = self._counts.get((op, reason))
        if entry is None:
            entry = self._counts[(op, reason)] = [0, 0]
        entry[0] += 1
        entry[1] += num_pages

    def snapshot(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``{(op, reason): (events, pages)}``, a copy."""
        return {key: (events, pages) for key, (events, pages) in self._counts.items()}


@dataclass(frozen=True)
class PoolStats:
    """One pool at one instant.

    Attributes:
        name: the pool's name in the free log (``full``, ``swa``, ``host``).
        num_pages: page ids of the pool, reserved ones included.
        states: pages per state of ``PAGE_STATES``; they sum to ``num_pages``.
        owner_kinds: owned and pinned pages per owner kind: ``request`` for request
            rows, the owner itself for caches (``cache:host``).
        counts: ``{(op, reason): (events, pages)}`` since the pool was made.
    """

    name: str
    num_pages: int
    states: dict[str, int]
    owner_kinds: dict[str, int] = field(default_factory=dict)
    counts: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)

    @property
    def usable(self) -> int:
        return self.num_pages - self.states.get("reserved", 0)

    @property
    def usage(self) -> float:
        """Share of usable pages not free (owned, pinned or pending), in [0, 1]."""
        return 1.0 - self.states.get("free", 0) / self.usable if self.usable else 0.0


def owner_kind(owner: str) -> str:
    """``request`` for a request's row, the owner's own name for a cache."""
    return owner if owner.startswith("cache:") else "request"
