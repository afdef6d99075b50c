"""The replayed state of a pool, page by page, and the names replay's messages use.

Page states, packed with the owner id into one int per page (``owner_id << 2 | state``)
so that "does this owner hold this page" is a single comparison:

    FREE      on the free list (the owner id is the last owner, for messages)
    OWNED     held by its owner
    PENDING   freed by its owner while pinned; free again at the last unpin (+ release)
    RESERVED  never allocated (page 0, and the header's reserved list)
"""

from __future__ import annotations

from typing import Any

from common.freelog.reader import PoolInfo

FREE, OWNED, PENDING, RESERVED = 0, 1, 2, 3
OPS = ("", "alloc", "free", "pin", "unpin", "release", "handoff")
OP_ALLOC, OP_FREE, OP_PIN, OP_UNPIN, OP_RELEASE, OP_HANDOFF = range(1, 7)
NO_OWNER = -1
# the violation an alloc of a page in each non-free state is
ALLOC_KIND = {OWNED: "double-alloc", PENDING: "reuse-while-pinned",
              RESERVED: "alloc-reserved"}

# Page lists up to this size are decoded by a precompiled struct; longer ones compile
# their format on the way (struct caches it).
SMALL_EVENT = 256


class PoolState:
    """The replayed state of one pool: lists indexed by page id, and its counters."""

    __slots__ = ("info", "own", "pins", "last", "capacity", "live", "in_use", "peak",
                 "peak_seq", "pages_allocated", "pages_freed", "pages_released",
                 "pages_handed_off", "counts", "num_allocs", "freed_by_reason", "pins_by_reason")

    def __init__(self, info: PoolInfo):
        n = info.num_pages
        self.info = info
        # Python lists, not numpy arrays: a list item is read or written in about half
        # the time of a memoryview item over a numpy array, and a numpy call (about a
        # microsecond) only pays off above a few hundred pages. Values are shared int
        # objects (one per event), so memory stays a few tens of bytes per page.
        self.own = [NO_OWNER << 2 | FREE] * n  # owner id << 2 | state
        for p in {0, *info.reserved}:  # page 0 is padding, never allocated
            self.own[p] = NO_OWNER << 2 | RESERVED
        self.pins = [0] * n
        self.last = [0] * n  # seq << 3 | op code of the last event on the page; 0: none
        self.capacity = n - len({0, *info.reserved})
        self.live: dict[Any, tuple] = {}  # pin id -> (raw pages, pages, seq, reason)
        self.in_use = self.peak = self.peak_seq = 0
        self.pages_allocated = self.pages_freed = self.pages_released = 0
        self.pages_handed_off = 0
        self.counts = dict.fromkeys(OPS[1:], 0)
        self.num_allocs = 0  # the most frequent event: an attribute is cheaper than a dict
        self.freed_by_reason: dict[str, list[int]] = {}  # reason -> [events, pages]
        self.pins_by_reason: dict[str, int] = {}

    def stats(self) -> dict[str, Any]:
        info = self.info
        return {"num_pages": info.num_pages, "page_size": info.page_size,
                "reserved": len(info.reserved), "capacity": self.capacity,
                "events": {**self.counts, "alloc": self.num_allocs},
                "pages_allocated": self.pages_allocated, "pages_freed": self.pages_freed,
                "pages_released": self.pages_released,
                "pages_handed_off": self.pages_handed_off,
                "peak_in_use": self.peak, "peak_seq": self.peak_seq,
                "in_use_at_end": self.in_use, "live_pins_at_end": len(self.live),
                "frees_by_reason": {r: {"events": e, "pages": p}
                                    for r, (e, p) in sorted(self.freed_by_reason.items())},
                "pins_by_reason": dict(sorted(self.pins_by_reason.items()))}


def signed(pages) -> list[int]:
    """Page ids as the writer meant them (the fast path decodes them unsigned)."""
    return [p - (1 << 32) if p >= 1 << 31 else p for p in pages]


def short_pages(pages: list[int], limit: int = 8) -> str:
    if len(pages) <= limit:
        return f"[{', '.join(map(str, pages))}]"
    return f"[{', '.join(map(str, pages[:limit]))}, ... ({len(pages)} pages)]"


def short_repr(obj: Any, limit: int = 120) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[:limit] + "..."
