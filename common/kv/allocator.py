"""Page allocator of one pool: the only owner of the free list and of page states.

Page states, derived from two arrays:

    state     owner_of   pin_count   on free stack
    free        FREE        0            yes
    owned      >= 0         0            no
    pinned     >= 0        > 0           no
    pending     FREE       > 0           no      (freed while pinned; back at last unpin)
    reserved  RESERVED      0            no      (page 0: padding, never handed out)

Every operation is vectorised over page-id arrays, counted in ``counters`` and, when a
free log is attached, recorded as one event in the same call (metrics agree with the log).

Epochs: every ``allocate`` call gets the next number of a counter that only rises (it
starts at ``epoch_base``, the pool's creation time in microseconds, so a restarted process
does not hand out the epochs of its previous life) and stamps it on the pages it hands
out; the free log's ``alloc`` event records it. A page id that travels (a transfer's
destination pages) travels with its epoch, and ``check_held`` refuses one whose page is
now another allocation's (stale), another owner's (foreign) or no page at all (out of
range).
"""

from __future__ import annotations

import numpy as np

from common.freelog import FreeLogWriter
from common.kv.pool_stats import PoolCounters, PoolStats, owner_kind
from common.kv.reasons import FreeReason

FREE = -1
RESERVED = -2


class PageAllocator:
    """Allocator of ``num_pages`` pages of one pool; page ids in ``reserved`` are never used.

    Not thread-safe by itself: ``KvCache`` serialises calls.
    """

    def __init__(self, name: str, num_pages: int, reserved: tuple[int, ...] = (0,),
                 log: FreeLogWriter | None = None, epoch_base: int = 1):
        self.name = name
        self.num_pages = num_pages
        self.reserved = tuple(sorted(reserved))
        self._log = log
        self._owner_of = np.full(num_pages, FREE, dtype=np.int32)
        self._owner_of[list(self.reserved)] = RESERVED
        self._pin_count = np.zeros(num_pages, dtype=np.int32)
        self._epoch_of = np.zeros(num_pages, dtype=np.uint64)  # 0: never allocated
        self._next_epoch = max(1, int(epoch_base))
        usable = np.setdiff1d(np.arange(num_pages, dtype=np.int32), self.reserved)
        # Stack top is the end; reversed so that a fresh pool hands out ascending ids.
        self._stack = usable[::-1].copy()
        self._top = len(usable)
        self._owner_ids: dict[str, int] = {}
        self._owner_names: list[str] = []
        self._pins: dict[int, np.ndarray] = {}
        self.counters = PoolCounters()

    # -- queries ------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_usable(self) -> int:
        return self.num_pages - len(self.reserved)

    def can_allocate(self, n: int) -> bool:
        return n <= self._top

    def owner_id(self, owner: str) -> int:
        oid = self._owner_ids.get(owner)
        if oid is None:
            oid = self._owner_ids[owner] = len(self._owner_names)
            self._owner_names.append(owner)
        return oid

    def not_owned(self, pages: np.ndarray, owner: str) -> np.ndarray:
        """Positions in ``pages`` whose page ``owner`` does not hold."""
        return np.flatnonzero(self._owner_of[pages] != self.owner_id(owner))

    def epochs(self, pages: np.ndarray) -> np.ndarray:
        """The epoch of the allocation that handed out each page (uint64)."""
        return self._epoch_of[pages]

    def check_held(self, pages: np.ndarray, owner: str, epochs: np.ndarray
                   ) -> tuple[str, int] | None:
        """Why ``pages`` (with the epochs they travelled with) are not all ``owner``'s now:
        ``("out-of-range", i)``, ``("foreign", i)`` or ``("stale", i)`` for the first bad
        position ``i``; None when every page is the owner's, from that allocation."""
        pages = np.asarray(pages, dtype=np.int64)
        bad = np.flatnonzero((pages < 0) | (pages >= self.num_pages))
        if len(bad):
            return "out-of-range", int(bad[0])
        bad = np.flatnonzero(self._owner_of[pages] != self.owner_id(owner))
        if len(bad):
            return "foreign", int(bad[0])
        bad = np.flatnonzero(self._epoch_of[pages] != np.asarray(epochs, dtype=np.uint64))
        if len(bad):
            return "stale", int(bad[0])
        return None

    def owner_name(self, page: int) -> str:
        oid = int(self._owner_of[page])
        return {FREE: "<free>", RESERVED: "<reserved>"}.get(oid) or self._owner_names[oid]

    def pages_owned_by(self, owner: str) -> np.ndarray:
        return np.flatnonzero(self._owner_of == self.owner_id(owner)).astype(np.int32)

    def owners_holding_pages(self) -> dict[str, int]:
        counts = np.bincount(self._owner_of[self._owner_of >= 0], minlength=1)
        return {self._owner_names[i]: int(c) for i, c in enumerate(counts) if c}

    def stats(self) -> PoolStats:
        """Pages by state and by owner kind, and the counters (one vectorised pass)."""
        owned = self._owner_of >= 0
        pinned = self._pin_count > 0
        states = {"free": self._top,
                  "owned": int(np.count_nonzero(owned & ~pinned)),
                  "pinned": int(np.count_nonzero(owned & pinned)),
                  "pending": int(np.count_nonzero((self._owner_of == FREE) & pinned)),
                  "reserved": len(self.reserved)}
        kinds: dict[str, int] = {}
        per_owner = np.bincount(self._owner_of[owned], minlength=len(self._owner_names))
        for oid in np.flatnonzero(per_owner):
            kind = owner_kind(self._owner_names[oid])
            kinds[kind] = kinds.get(kind, 0) + int(per_owner[oid])
        return PoolStats(self.name, self.num_pages, states, kinds, self.counters.snapshot())

    # -- state changes ------------------------------------------------------------------
    def allocate(self, n: int, owner: str) -> np.ndarray:
        """Hand ``n`` free pages to ``owner``; the caller checked ``can_allocate(n)``."""
        assert n <= self._top, f"allocate({n}) with {self._top} free pages in {self.name}"
        self._top -= n
        pages = self._stack[self._top:self._top + n][::-1].copy()
        self._owner_of[pages] = self.owner_id(owner)
        epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
        self._epoch_of[pages] = epoch
        self.counters.record("alloc", n)
        if self._log is not None:
            self._log.alloc(self.name, pages, owner, epoch)
        return pages

    def take(self, pages: np.ndarray, owner: str) -> np.ndarray:
        """Hand exactly ``pages`` to ``owner``: a tensor-parallel follower takes the page ids
        rank 0's allocator chose (the same pages, whatever order this pool freed them in).

        Raises:
            ValueError: a page is not free here (owned, pinned by this process's own I/O,
                reserved) or is listed twice; named with its state; nothing changed.
        """
        pages = np.asarray(pages, dtype=np.int32)
        n = len(pages)
        if not np.array_equal(self._stack[self._top - n:self._top][::-1], pages):
            # freed in another order here (pins of this process's own I/O): take them out
            on_stack = self._stack[:self._top]
            keep = ~np.isin(on_stack, pages)
            if len(on_stack) - np.count_nonzero(keep) != n or len(np.unique(pages)) != n:
                raise ValueError(f"cannot take pages {pages.tolist()} of pool {self.name!r}: "
                                 f"{self._not_free(pages)}")
            self._stack[:self._top - n] = on_stack[keep]
        self._top -= n
        self._owner_of[pages] = self.owner_id(owner)
        self.counters.record("alloc", n)
        if self._log is not None:
            self._log.alloc(self.name, pages, owner)
        return pages

    def _not_free(self, pages: np.ndarray) -> str:
        for page in map(int, pages):
            if not 0 <= page < self.num_pages:
                return f"page {page} is outside the pool"
            owner = int(self._owner_of[page])
            held = "reserved" if owner == RESERVED else f"owned by {self.owner_name(page)!r}"
            if self._pin_count[page]:
                return (f"page {page} is pinned here ({self._pin_count[page]} pin(s)), "
                        + ("freed, back at its last unpin" if owner == FREE else held))
            if owner != FREE:
                return f"page {page} is {held}"
        return "a page is listed twice"

    def free(self, pages: np.ndarray, owner: str, reason: FreeReason | str,
             ranges: list[tuple[int, int]] | None = None) -> None:
        """``owner`` gives ``pages`` back (checked by the caller); pinned ones become pending.

        Raises:
            ValueError: ``reason`` is not a ``FreeReason``; nothing changed.
        """
        reason = FreeReason.check(reason)
        self._owner_of[pages] = FREE
        self.counters.record("free", len(pages), reason)
        if self._log is not None:
            self._log.free(self.name, pages, owner, reason.value, ranges)
        # with no live pin anywhere no page can be pinned: skip the gather
        self._push(pages[self._pin_count[pages] == 0] if self._pins else pages)

    def handoff(self, pages: np.ndarray, owner: str, to: str) -> None:
        """Move ``pages`` (held by ``owner``, checked by the caller) to the owner ``to``."""
        self._owner_of[pages] = self.owner_id(to)
        self.counters.record("handoff", len(pages))
        if self._log is not None:
            self._log.handoff(self.name, pages, owner, to)

    def check_pinnable(self, pages: np.ndarray) -> None:
        """Raise unless every page is owned or pending (never free or reserved)."""
        bad = np.flatnonzero((self._owner_of[pages] < 0) & (self._pin_count[pages] == 0))
        if len(bad):
            page = int(pages[bad[0]])
            raise ValueError(f"cannot pin page {page} of pool {self.name!r}: it is "
                             f"{self.owner_name(page)}, not owned or pending")

    def pin(self, pages: np.ndarray, pin_id: int, reason: str) -> None:
        """Claim ``pages`` for in-flight I/O; the caller checked ``check_pinnable``."""
        assert pin_id not in self._pins, f"pin id {pin_id} reused in {self.name}"
        self._pins[pin_id] = pages
        np.add.at(self._pin_count, pages, 1)
        self.counters.record("pin", len(pages), reason)
        if self._log is not None:
            self._log.pin(self.name, pages, pin_id, reason)

    def unpin(self, pin_id: int, record: dict | None = None) -> None:
        """End a pin; pages freed meanwhile whose last pin this was go back to the free list.
        ``record``: extra keys of the ``unpin`` event (what the I/O moved: digests)."""
        pages = self._pins.pop(pin_id)
        np.subtract.at(self._pin_count, pages, 1)
        self.counters.record("unpin", len(pages))
        if self._log is not None:
            self._log.unpin(self.name, pages, pin_id, record)
        released = np.unique(pages[(self._pin_count[pages] == 0)
                                   & (self._owner_of[pages] == FREE)])
        if len(released):
            self.counters.record("release", len(released))
            if self._log is not None:
                self._log.release(self.name, released)
            self._push(released)

    def _push(self, pages: np.ndarray) -> None:
        n = len(pages)
        self._stack[self._top:self._top + n] = pages[::-1]
        self._top += n

    # -- integrity ----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """free + owned + pending == usable; the stack holds exactly the free pages."""
        stack = self._stack[:self._top]
        assert len(np.unique(stack)) == len(stack), f"{self.name}: duplicate page on free list"
        assert np.all(self._owner_of[stack] == FREE), f"{self.name}: owned page on free list"
        assert np.all(self._pin_count[stack] == 0), f"{self.name}: pinned page on free list"
        expected = np.zeros(self.num_pages, dtype=np.int32)
        for pages in self._pins.values():
            np.add.at(expected, pages, 1)
        assert np.array_equal(expected, self._pin_count), f"{self.name}: pin counts drifted"
        owned = int(np.count_nonzero(self._owner_of >= 0))
        pending = int(np.count_nonzero((self._owner_of == FREE) & (self._pin_count > 0)))
        assert self._top + owned + pending == self.num_usable, (
            f"{self.name}: free {self._top} + owned {owned} + pending {pending} "
            f"!= usable {self.num_usable}")
        assert np.all(self._owner_of[list(self.reserved)] == RESERVED), \
            f"{self.name}: reserved page handed out"
