"""KvCache: paged KV pools, the row table, ``free_kv_row`` and pins, in one lock.

Pools are named ``full`` (full attention) and, in the hybrid sliding-window
configuration, ``swa``. A live row position has a slot in ``full`` and, while it is at or
above the row's ``swa_evicted_seqlen``, the matching slot of a page in ``swa`` (one
``swa`` page per ``full`` page of the row, the same offset within the page).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from common.freelog import FreeLogWriter
from common.kv.allocator import PageAllocator
from common.kv.errors import OutOfPages, RangeError
from common.kv.layout import KvLayout
from common.kv.pool_stats import PoolStats
from common.kv.ranges import ceil_div, check_ranges, merge_ranges, page_indices, range_of_index
from common.kv.reasons import FreeReason
from common.kv.record import KvRecord
from common.kv.segments import segment_stem
from common.kv.shared_tensor import SharedTensor


class KvCache:
    """Paged KV memory of one process: pools, allocators and request rows.

    Args:
        num_pages: pages of the ``full`` pool, page 0 (reserved) included.
        page_size: slots per page.
        swa_num_pages: pages of the ``swa`` pool; ``None`` for no sliding window.
        max_rows: rows (requests) open at once.
        max_row_len: positions a row may hold; defaults to the whole pool.
        device: where the KV tensors live (``cpu``, ``cuda:N``).
        log_path: free-log file to record every allocator event to; ``None`` records nothing.
        node: the process's name in the free log.
        layout: what a page holds; see ``KvLayout``.
        shared_memory: put the CPU pool tensors in named shared memory so that a peer on
            the same host can map them (``shared_memory_name``) and copy pages directly.
        segment: the stem of those segments' names (``segments.segment_stem``: the
            deployment and the worker); default ``pdkv.local.<node>``.

    All methods are thread-safe.
    """

    def __init__(self, num_pages: int, page_size: int, *, swa_num_pages: int | None = None,
                 max_rows: int = 256, max_row_len: int | None = None,
                 device: str | torch.device = "cpu", log_path: str | os.PathLike | None = None,
                 node: str = "node", layout: KvLayout | None = None,
                 shared_memory: bool = False, segment: str = ""):
        _check_sizes(num_pages, page_size, swa_num_pages, max_rows, max_row_len)
        self.num_pages, self.page_size = num_pages, page_size
        self.layout = layout or KvLayout()
        self.device = torch.device(device)
        self.max_row_len = max_row_len or (num_pages - 1) * page_size
        self._max_row_pages = ceil_div(self.max_row_len, page_size)
        sizes = {"full": num_pages} | ({"swa": swa_num_pages} if swa_num_pages else {})
        self._log = None if log_path is None else FreeLogWriter(log_path, node=node, pools={
            name: {"num_pages": n, "page_size": page_size, "reserved": [0]}
            for name, n in sizes.items()})
        epoch_base = time.time_ns() // 1000  # a restarted process never reuses old epochs
        self._pools = {name: PageAllocator(name, n, (0,), self._log, epoch_base)
                       for name, n in sizes.items()}
        stem = segment or segment_stem("", node)
        self._shared = {name: self._shared_tensor(n, stem) for name, n in sizes.items()
                        } if shared_memory else {}
        # [num_pages, total_layers, 2, page_size, num_kv_heads, head_dim]
        self._data = {name: self._shared[name].tensor if shared_memory else torch.zeros(
            (n, *self.layout.page_shape(page_size)), dtype=self.layout.torch_dtype,
            device=self.device) for name, n in sizes.items()}
        # Row table: page ids by row page index, and which of them the row still holds
        # (free_kv_row leaves the ids in place, so stale ids must never count as held).
        self._row_pages: dict[str, list[np.ndarray | None]] = {
            name: [None] * max_rows for name in sizes}
        self._row_held: dict[str, list[np.ndarray | None]] = {
            name: [None] * max_rows for name in sizes}
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._records: dict[str, KvRecord] = {}
        self._pin_pools: dict[int, list[PageAllocator]] = {}
        self._pin_ids = itertools.count(1)
        self._lock = threading.RLock()
        self._closed = False

    # -- pools --------------------------------------------------------------------------
    def data(self, pool: str = "full") -> torch.Tensor:
        """The pool's KV tensor, ``[num_pages, total_layers, 2, page_size, kv_heads, head_dim]``."""
        return self._data[pool]

    def num_free_pages(self, pool: str = "full") -> int:
        return self._pool(pool).num_free

    def shared_memory_name(self, pool: str = "full") -> str | None:
        """Name of the shared-memory segment holding ``data(pool)``, or None if private."""
        shared = self._shared.get(pool)
        return None if shared is None else shared.name

    def shared_memory_token(self, pool: str = "full") -> bytes:
        """The secret a process needs, with the name, to map ``data(pool)`` (b"" if
        private). Hand it only to peers that may write the pool."""
        shared = self._shared.get(pool)
        return b"" if shared is None else shared.token

    def _shared_tensor(self, num_pages: int, stem: str) -> SharedTensor:
        if self.device.type != "cpu":
            raise ValueError(f"shared_memory=True needs a CPU pool, not {self.device}")
        shape = (num_pages, *self.layout.page_shape(self.page_size))
        return SharedTensor(shape, self.layout.torch_dtype, stem=stem)

    @property
    def free_log(self) -> FreeLogWriter | None:
        """The recorder of this cache's allocator events, if any."""
        return self._log

    @property
    def pool_names(self) -> list[str]:
        return list(self._pools)

    # -- rows ---------------------------------------------------------------------------
    def open_row(self, owner: str) -> KvRecord:
        """Open an empty row for ``owner`` (a request id, one open row each)."""
        with self._lock:
            if owner in self._records:
                raise ValueError(f"owner {owner!r} already has an open row")
            if owner.startswith("cache:"):
                raise ValueError(f"owner {owner!r}: the 'cache:' prefix is for caches")
            if not self._free_rows:
                raise OutOfPages(f"all {len(self._row_pages['full'])} rows are open")
            row = self._free_rows.pop()
            for name in self._pools:
                self._row_pages[name][row] = np.zeros(self._max_row_pages, dtype=np.int32)
                self._row_held[name][row] = np.zeros(self._max_row_pages, dtype=bool)
            kv = self._records[owner] = KvRecord(owner=owner, row=row)
            return kv

    def has_row(self, owner: str) -> bool:
        """``owner`` holds an open row (a finished request's row stays open until its
        host copies end; a new row for the same owner must wait for it)."""
        with self._lock:
            return owner in self._records

    def extend(self, kv: KvRecord, num_tokens: int, pages: np.ndarray | None = None) -> None:
        """Give ``kv`` slots for positions ``[allocated_len, allocated_len + num_tokens)``.

        ``pages``: the exact page ids to take for the new pages (a tensor-parallel
        follower takes rank 0's); each must be free here. Not with a sliding-window pool.

        Raises:
            OutOfPages: a pool has too few free pages; nothing changed.
            ValueError: the row would pass ``max_row_len``, or a page of ``pages`` is not
                free here or their count is not the pages needed; nothing changed.
        """
        with self._lock:
            self._check_open(kv)
            new_len = kv.allocated_len + num_tokens
            if num_tokens < 0 or new_len > self.max_row_len:
                raise ValueError(f"extend({kv.owner!r}, {num_tokens}): row length {new_len} "
                                 f"outside [0, max_row_len={self.max_row_len}]")
            first = ceil_div(kv.allocated_len, self.page_size)
            need = ceil_div(new_len, self.page_size) - first
            tail_freed = not self._row_held["full"][kv.row][first - 1]
            if num_tokens and kv.allocated_len % self.page_size and tail_freed:
                raise ValueError(f"extend({kv.owner!r}): the row's last page (positions from "
                                 f"{(first - 1) * self.page_size}) was freed; lower "
                                 "allocated_len before extending the row again")
            if pages is not None and (len(pages) != need or len(self._pools) > 1):
                raise ValueError(f"extend({kv.owner!r}, {num_tokens}): {len(pages)} page ids "
                                 f"given for {need} new pages (one pool only)")
            for name, pool in self._pools.items():
                if not pool.can_allocate(need):
                    raise OutOfPages(f"{kv.owner!r} needs {need} pages of pool {name!r}, "
                                     f"{pool.num_free} free")
            for name, pool in self._pools.items():
                if need:
                    self._row_pages[name][kv.row][first:first + need] = pool.allocate(
                        need, kv.owner) if pages is None else pool.take(pages, kv.owner)
                    self._row_held[name][kv.row][first:first + need] = True
            kv.allocated_len = new_len

    def commit(self, kv: KvRecord, num_tokens: int) -> None:
        """Mark ``num_tokens`` more positions as holding verified KV."""
        with self._lock:
            if not 0 <= kv.committed_len + num_tokens <= kv.allocated_len:
                raise ValueError(f"commit({kv.owner!r}, {num_tokens}): committed_len "
                                 f"{kv.committed_len} + {num_tokens} outside "
                                 f"[0, allocated_len={kv.allocated_len}]")
            kv.committed_len += num_tokens

    def close_row(self, kv: KvRecord) -> None:
        """Return the row slot; the pages must have been freed (or handed off) first."""
        with self._lock:
            self._check_open(kv)
            for name in self._pools:
                held = int(np.count_nonzero(self._row_held[name][kv.row]))
                if held:
                    raise ValueError(f"close_row({kv.owner!r}): the row still holds {held} "
                                     f"pages of pool {name!r}; free them with free_kv_row "
                                     "first")
            for name in self._pools:
                self._row_pages[name][kv.row] = self._row_held[name][kv.row] = None
            del self._records[kv.owner]
            self._free_rows.append(kv.row)
            kv.row = -1

    # -- reading a row ------------------------------------------------------------------
    def pages(self, kv: KvRecord, start: int, end: int, pool: str = "full") -> np.ndarray:
        """Page ids (int32) covering positions ``[start, end)`` of the row."""
        with self._lock:
            self._check_span(kv, start, end)
            first, last = start // self.page_size, ceil_div(end, self.page_size)
            return self._row_pages[pool][kv.row][first:last].copy()

    def page_epochs(self, kv: KvRecord, start: int, end: int, pool: str = "full"
                    ) -> np.ndarray:
        """The allocation epoch (uint64) of each page ``pages(kv, start, end)`` returns."""
        with self._lock:
            return self._pool(pool).epochs(self.pages(kv, start, end, pool))

    def check_held(self, owner: str, pages: np.ndarray, epochs: np.ndarray,
                   pool: str = "full") -> str | None:
        """Why ``pages`` with ``epochs`` are not ``owner``'s current allocation ("out-of-range
        page 99", "stale page 7 (epoch ...)", "foreign page 3 (held by r2)"), or None
        when they are: what a landing transfer is checked against before it writes."""
        with self._lock:
            allocator = self._pool(pool)
            why = allocator.check_held(pages, owner, epochs)
            if why is None:
                return None
            kind, i = why
            page = int(np.asarray(pages)[i])
            if kind == "out-of-range":
                return f"out-of-range page {page} (pool {pool!r} has {allocator.num_pages})"
            if kind == "foreign":
                return f"foreign page {page} (held by {allocator.owner_name(page)})"
            return (f"stale page {page} (epoch {int(np.asarray(epochs)[i])}, now "
                    f"{int(allocator.epochs(np.array([page]))[0])})")

    def slots(self, kv: KvRecord, start: int, end: int, pool: str = "full") -> torch.Tensor:
        """Slot ids (int64, CPU) of positions ``[start, end)``: ``page * page_size + offset``."""
        with self._lock:
            self._check_span(kv, start, end)
            positions = np.arange(start, end)
            pages = self._row_pages[pool][kv.row][positions // self.page_size]
            return torch.from_numpy(pages.astype(np.int64) * self.page_size
                                    + positions % self.page_size)

    # -- giving pages back --------------------------------------------------------------
    def free_kv_row(self, kv: KvRecord, ranges: Iterable[Sequence[int]], *,
                    reason: FreeReason | str = FreeReason.FINISHED) -> None:
        """Give back the pages of row-position ranges of ``kv`` (docs/design.md, "free_kv_row").

        Touching ranges are merged; starts must be page-aligned; an end mid-page releases
        the whole last page. Positions below ``swa_evicted_seqlen`` go back to ``full``
        only, the rest to both pools. Pinned pages return to the free list at their last
        unpin. Counters and the row table are left to the caller.

        Raises:
            RangeError: any range breaks the contract (named in the message); nothing freed.
            ValueError: ``reason`` is not a ``FreeReason``; nothing freed.
        """
        reason = FreeReason.check(reason)
        with self._lock:
            self._check_open(kv)
            merged = merge_ranges(ranges)
            if not merged:
                return
            check_ranges(merged, self.page_size, kv.allocated_len, kv.protected_len)
            for pool, idx, pages in self._free_plan(kv, merged):
                pool.free(pages, kv.owner, reason, merged)
                self._row_held[pool.name][kv.row][idx] = False

    def evict_window(self, kv: KvRecord, upto: int) -> None:
        """Free the sliding-window pages of whole pages below position ``upto``."""
        with self._lock:
            self._check_open(kv)
            pool = self._pools.get("swa")
            if pool is None:
                raise ValueError("evict_window: this KvCache has no sliding-window pool")
            if not 0 <= upto <= kv.allocated_len:
                raise ValueError(f"evict_window({kv.owner!r}, {upto}) outside "
                                 f"[0, allocated_len={kv.allocated_len}]")
            floor = upto // self.page_size * self.page_size
            if floor <= kv.swa_evicted_seqlen:
                return
            idx = np.arange(kv.swa_evicted_seqlen // self.page_size, floor // self.page_size)
            pages = self._held_pages(kv, "swa", idx, [(kv.swa_evicted_seqlen, floor)])
            pool.free(pages, kv.owner, FreeReason.EVICTED, [(kv.swa_evicted_seqlen, floor)])
            self._row_pages["swa"][kv.row][idx] = 0
            self._row_held["swa"][kv.row][idx] = False
            kv.swa_evicted_seqlen = floor

    def handoff(self, kv: KvRecord, end: int, to: str) -> None:
        """Move the row's pages below ``end`` (page-aligned) to the cache owner ``to``."""
        with self._lock:
            self._check_open(kv)
            if not to.startswith("cache:"):
                raise ValueError(f"handoff to {to!r}: the new owner must be 'cache:<name>'")
            merged = merge_ranges([(kv.protected_len, end)])
            check_ranges(merged, self.page_size, kv.allocated_len, kv.protected_len)
            if end % self.page_size and end != kv.allocated_len:
                raise RangeError(f"handoff end {end} must be page-aligned")
            for pool, idx, pages in self._free_plan(kv, merged):
                pool.handoff(pages, kv.owner, to)
                self._row_held[pool.name][kv.row][idx] = False
            kv.protected_len = max(kv.protected_len, end)

    def free_pages(self, owner: str, pages: np.ndarray, *, reason: FreeReason | str,
                   pool: str = "full") -> None:
        """A cache (``owner``) gives back ``pages`` it holds."""
        reason = FreeReason.check(reason)
        with self._lock:
            pages = np.asarray(pages, dtype=np.int32)
            allocator = self._pool(pool)
            bad = allocator.not_owned(pages, owner)
            if len(bad):
                page = int(pages[bad[0]])
                raise RangeError(f"{owner!r} cannot free page {page} of pool {pool!r}: it "
                                 f"belongs to {allocator.owner_name(page)}")
            allocator.free(pages, owner, reason)

    def _free_plan(self, kv: KvRecord, merged: list[tuple[int, int]]
                   ) -> list[tuple[PageAllocator, np.ndarray, np.ndarray]]:
        """(pool, row page indices, page ids) to give back, checked to be held by ``kv``.

        Raises before anything changes.
        """
        if len(merged) == 1 and "swa" not in self._pools:
            # one range: a slice reads and writes the row without fancy indexing (several
            # times faster on a 128k-page row at page size 1)
            start, end = merged[0]
            idx = slice(start // self.page_size, ceil_div(end, self.page_size))
            return [(self._pools["full"], idx, self._held_pages(kv, "full", idx, merged))]
        idx = page_indices(merged, self.page_size)
        plan = [(self._pools["full"], idx, self._held_pages(kv, "full", idx, merged))]
        if "swa" in self._pools:
            floor = kv.swa_evicted_seqlen
            below, above = merged[0][0] < floor, merged[-1][1] > floor
            if below and above and floor % self.page_size:
                raise RangeError(f"ranges {merged} straddle swa_evicted_seqlen={floor}, "
                                 "which is not page-aligned")
            swa_idx = idx[idx >= floor // self.page_size] if above else idx[:0]
            plan.append((self._pools["swa"], swa_idx,
                         self._held_pages(kv, "swa", swa_idx, merged)))
        return [entry for entry in plan if len(entry[2])]

    def _held_pages(self, kv: KvRecord, pool: str, idx: np.ndarray | slice,
                    merged: list[tuple[int, int]]) -> np.ndarray:
        """Page ids at row page indices ``idx``; raises ``RangeError`` if one is not held."""
        pages = self._row_pages[pool][kv.row][idx]
        if isinstance(idx, slice):
            pages = pages.copy()  # a view of the row table, which later extends overwrite
        held = self._row_held[pool][kv.row][idx]
        if not held.all():
            bad = np.flatnonzero(~held)
            index = int(np.arange(len(self._row_held[pool][kv.row]))[idx][bad[0]])
            page = int(pages[bad[0]])
            start, end = range_of_index(merged, self.page_size, index)
            raise RangeError(f"range ({start}, {end}) of {kv.owner!r} covers page {page} of "
                             f"pool {pool!r} (row page {index}), which the row no longer "
                             "holds: a double free, or a page handed to a cache")
        return pages

    # -- pins ---------------------------------------------------------------------------
    def pin(self, kv: KvRecord, start: int, end: int, *, reason: str) -> int:
        """Pin the pages covering positions ``[start, end)`` in every pool that has them.

        Two-phase I/O: pin before handing the pages to a copy or a transfer, ``unpin``
        once it completed. Returns the pin id.
        """
        with self._lock:
            self._check_span(kv, start, end)
            idx = np.arange(start // self.page_size, ceil_div(end, self.page_size))
            per_pool = [(self._pools["full"], self._row_pages["full"][kv.row][idx])]
            if "swa" in self._pools:
                swa_idx = idx[idx >= kv.swa_evicted_seqlen // self.page_size]
                per_pool.append((self._pools["swa"], self._row_pages["swa"][kv.row][swa_idx]))
            return self._pin(per_pool, reason)

    def pin_pages(self, pages: np.ndarray, *, reason: str, pool: str = "full") -> int:
        """Pin page ids of ``pool`` directly (they must be owned or pending)."""
        with self._lock:
            return self._pin([(self._pool(pool), np.asarray(pages, dtype=np.int32))], reason)

    def unpin(self, pin_id: int, record: dict | None = None) -> None:
        """End pin ``pin_id``; pages freed meanwhile return to the free list at their last pin.
        ``record``: extra keys of the first pool's ``unpin`` event (digests of what the
        I/O moved, docs/freelog.md)."""
        with self._lock:
            pools = self._pin_pools.pop(pin_id, None)
            if pools is None:
                raise ValueError(f"unpin({pin_id}): no such pin (already unpinned?)")
            for i, pool in enumerate(pools):
                pool.unpin(pin_id, record if i == 0 else None)

    def _pin(self, per_pool: list[tuple[PageAllocator, np.ndarray]], reason: str) -> int:
        per_pool = [(pool, pages) for pool, pages in per_pool if len(pages)]
        for pool, pages in per_pool:  # check every pool before changing any
            pool.check_pinnable(pages)
        pin_id = next(self._pin_ids)
        for pool, pages in per_pool:
            pool.pin(pages, pin_id, reason)
        self._pin_pools[pin_id] = [pool for pool, _ in per_pool]
        return pin_id

    # -- lifecycle ----------------------------------------------------------------------
    def close(self, retained: Sequence[str] = ()) -> None:
        """Write the free log's ``close`` event (owners in ``retained`` may still hold pages).

        Shared-memory pools are unlinked; their tensors must not be used afterwards.
        """
        with self._lock:
            if not self._closed and self._log is not None:
                self._log.close(retained)
            self._closed = True
            for shared in self._shared.values():
                shared.close()

    def pool_stats(self) -> list[PoolStats]:
        """Every pool's pages by state and owner kind and its event counters, read at once."""
        with self._lock:
            return [pool.stats() for pool in self._pools.values()]

    def owners_holding_pages(self, pool: str = "full") -> dict[str, int]:
        with self._lock:
            return self._pool(pool).owners_holding_pages()

    def check_integrity(self) -> None:
        """Assert allocator invariants and that each owned page sits in its owner's row once."""
        with self._lock:
            for name, pool in self._pools.items():
                pool.check_integrity()
                for kv in self._records.values():
                    kv.check()
                    mine = self._row_pages[name][kv.row][self._row_held[name][kv.row]]
                    assert not len(pool.not_owned(mine, kv.owner)), (
                        f"{name}: {kv.owner!r} row holds pages it does not own")
                    owned = pool.pages_owned_by(kv.owner)
                    assert len(np.unique(mine)) == len(mine) == len(owned), (
                        f"{name}: {kv.owner!r} owns {len(owned)} pages, its row holds "
                        f"{len(mine)} ({len(np.unique(mine))} distinct)")

    # -- checks -------------------------------------------------------------------------
    def _pool(self, pool: str) -> PageAllocator:
        try:
            return self._pools[pool]
        except KeyError:
            raise ValueError(f"unknown pool {pool!r}; this KvCache has {list(self._pools)}") \
                from None

    def _check_open(self, kv: KvRecord) -> None:
        if not kv.is_open or self._records.get(kv.owner) is not kv:
            raise ValueError(f"row of {kv.owner!r} is not open in this KvCache")

    def _check_span(self, kv: KvRecord, start: int, end: int) -> None:
        self._check_open(kv)
        if not 0 <= start <= end <= kv.allocated_len:
            raise RangeError(f"positions ({start}, {end}) of {kv.owner!r} outside "
                             f"[0, allocated_len={kv.allocated_len}]")


def _check_sizes(num_pages: int, page_size: int, swa_num_pages: int | None, max_rows: int,
                 max_row_len: int | None) -> None:
    if num_pages < 2:
        raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is reserved)")
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be >= 1")
    if swa_num_pages is not None and swa_num_pages < 2:
        raise ValueError(f"swa_num_pages={swa_num_pages}: need at least 2 or None")
    if max_rows < 1:
        raise ValueError(f"max_rows={max_rows} must be >= 1")
    if max_row_len is not None and max_row_len < 1:
        raise ValueError(f"max_row_len={max_row_len} must be >= 1")
