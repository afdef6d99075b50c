"""Offloading committed KV pages to the host tier, and loading cached prefixes back.

Which positions of a decode row may go to the host (docs/design.md, "Speculation and offload"):

    positions  0 ............ F ...... committed_len .. allocated_len
               | full committed | partial |  lookahead tail  |
    offloaded  [0, F), F = floor(committed_len / page_size) * page_size, whole pages only

The partial page, the speculative lookahead tail and the newest sampled token (no KV
yet, so not committed) are never offloaded.

Both directions are two-phase:

``prepare_store(kv, chain)``
    pins the device pages (reason ``offload``), allocates host pages to ``cache:host``
    and pins them, references the cached parent key, and starts the copy. Returns a
    ``StoreHandle`` or ``None`` when nothing new can be stored.
``complete_store(handle)`` / ``poll()``
    once the copy is done: unpins both sides, inserts the pages into the prefix cache
    (or, if the copy failed, frees the host pages with reason ``error``). Stores complete
    in submission order.
``prepare_load(kv, chain)`` / ``complete_load(handle)``
    the same for a cached prefix copied from the host into the row's first pages
    (pins reason ``load`` on host and device pages).

Who frees what: the request frees its device row with ``free_kv_row`` as usual; the
offloader never frees device pages. On finish, call ``wait(kv)`` first so that the row
is freed after its last copy. On abort, free at once (reason ``aborted``): the pins keep
the pages out of reuse until the copy completes, and ``poll()`` then releases them. Host
pages belong to the prefix cache, which frees them on eviction (reason ``evicted``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from common.host.chain import HashChain, prefix_len
from common.host.prefix_cache import PrefixCache
from common.host.tier import CACHE_OWNER, CopyEngine, CopyJob, HostTier
from common.kv import DigestMismatch, KvCache, KvRecord

logger = logging.getLogger(__name__)


@dataclass
class StoreHandle:
    """An offload in flight: row pages ``[first_page, first_page + len(keys))`` of ``row``."""

    row: KvRecord
    """The row copied from: copies are tracked per row, not per owner name (a later
    request of the same name never waits for, or frees before, another row's copies)."""
    first_page: int
    keys: list[bytes]
    parent: bytes | None
    device_pages: np.ndarray
    host_pages: np.ndarray
    device_pin: int
    host_pin: int
    job: CopyJob
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32), repr=False)
    """Token ids of the stored pages (the prefix cache's listener publishes them)."""
    done: bool = False

    @property
    def owner(self) -> str:
        return self.row.owner


@dataclass
class LoadHandle:
    """A prefix load in flight: ``num_tokens`` positions from 0 of ``row``."""

    row: KvRecord
    num_tokens: int
    keys: list[bytes]
    device_pages: np.ndarray
    host_pages: np.ndarray
    device_pin: int
    host_pin: int
    job: CopyJob
    done: bool = False
    error: BaseException | None = field(default=None, repr=False)

    @property
    def owner(self) -> str:
        return self.row.owner


class Offloader:
    """Moves full pages between a ``KvCache``'s ``full`` pool and a ``HostTier``.

    Args:
        cache: the device KV cache (no sliding-window pool: only ``full`` is offloaded).
        host: the host tier; same page size and layout as ``cache``.
        prefix: the prefix cache over ``host``; a new one when ``None``.
        engine: the copy engine; a new one on ``cache.device`` when ``None``.

    Thread-safe; copies run on the engine's thread or stream.
    """

    def __init__(self, cache: KvCache, host: HostTier, prefix: PrefixCache | None = None,
                 engine: CopyEngine | None = None):
        _check_compatible(cache, host)
        self.cache, self.host = cache, host
        self.prefix = prefix or PrefixCache(host)
        self.engine = engine or CopyEngine(cache.device)
        self.page_size = cache.page_size
        self._stores: deque[StoreHandle] = deque()
        self._loads: list[LoadHandle] = []
        self._inflight: set[bytes] = set()
        self._pending: dict[int, int] = {}
        """Copies in flight per row (``id`` of the KvRecord, which its handles keep alive)."""
        self._lock = threading.RLock()
        self.num_offloaded_pages = 0
        self.num_loaded_pages = 0
        self.num_corrupt_pages = 0
        """Host pages whose digest at a load differed from the one they were stored with."""

    # -- store: device -> host ----------------------------------------------------------
    def prepare_store(self, kv: KvRecord, chain: HashChain) -> StoreHandle | None:
        """Start copying ``kv``'s committed full pages not yet cached to the host tier.

        Args:
            kv: the open row; pages ``[0, committed_len // page_size)`` are candidates.
            chain: hash chain of the row's tokens (at least its committed full pages).

        Returns:
            The handle, or ``None`` when every candidate page is cached or in flight or
            the host tier is full of referenced pages. Evicts LRU host pages for room.
            The device pages stay the request's; the host pages become the cache's.
        """
        ps = self.page_size
        with self._lock:
            limit = min(len(chain.keys), kv.committed_len // ps)
            start = prefix_len(chain.keys, self._cached_or_inflight, limit)
            if start == limit:
                return None
            parent = chain.keys[start - 1] if start else None
            self.prefix.ref(parent)  # before evicting, so the parent stays
            short = (limit - start) - self.host.num_free
            if short > 0:
                self.prefix.evict(short)
            end = start + min(limit - start, self.host.num_free)
            if end == start:
                self.prefix.unref(parent)
                logger.debug("host tier full of referenced pages; %s not offloaded", kv.owner)
                return None
            return self._start_store(kv, chain, start, end, parent)

    def complete_store(self, handle: StoreHandle, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s for ``handle``'s copy and complete it; True when done."""
        if not handle.done and handle.job.wait(timeout):
            self.poll()  # stores complete in order; this one's predecessors are done too
        return handle.done

    def _start_store(self, kv: KvRecord, chain: HashChain, start: int, end: int,
                     parent: bytes | None) -> StoreHandle:
        ps, keys = self.page_size, chain.keys[start:end]
        device_pages = self.cache.pages(kv, start * ps, (start + len(keys)) * ps)
        host_pages = self.host.allocate(len(keys), CACHE_OWNER)
        assert host_pages is not None, "host pages counted free just before"
        # Ascending host pages make runs with an ascending device row: one slice per run
        # (eviction frees chains leaf first, so the free list hands them out descending).
        host_pages.sort()
        try:
            device_pin = self.cache.pin_pages(device_pages, reason="offload")
        except ValueError:  # the row no longer holds them: give everything back
            self.host.free(host_pages, CACHE_OWNER, "error")
            self.prefix.unref(parent)
            raise
        host_pin = self.host.pin(host_pages, "offload")
        job = self.engine.submit(self.cache.data(), device_pages, self.host.data, host_pages)
        handle = StoreHandle(kv, start, keys, parent, device_pages, host_pages,
                             device_pin, host_pin, job, chain.page_tokens(start, end))
        self._inflight.update(keys)
        self._stores.append(handle)
        self._pending[id(kv)] = self._pending.get(id(kv), 0) + 1
        return handle

    def _finish_store(self, h: StoreHandle) -> None:
        self.cache.unpin(h.device_pin)
        record = None
        if h.job.error is None:   # what a later load must find in these pages
            digests = self.host.digests(h.host_pages)
            self.host.remember(h.host_pages, digests)
            record = {"store": digests, "rid": h.owner}
        self.host.unpin(h.host_pin, record)
        self._inflight.difference_update(h.keys)
        if h.job.error is None and (h.parent is None or h.parent in self.prefix):
            self.prefix.insert(h.keys, h.host_pages, h.parent, h.tokens)
            self.num_offloaded_pages += len(h.keys)
        else:  # a failed copy, or one whose failed predecessor never became its parent
            logger.warning("offload of %d pages of %s dropped: %r", len(h.keys), h.owner,
                           h.job.error or "parent not cached")
            self.host.free(h.host_pages, CACHE_OWNER, "error")
        self.prefix.unref(h.parent)
        self._done(h)

    # -- load: host -> device -----------------------------------------------------------
    def lookup(self, chain: HashChain) -> int:
        """Tokens at the start of ``chain`` whose pages are cached (no side effects)."""
        return self.prefix.num_cached(chain.keys) * self.page_size

    def prepare_load(self, kv: KvRecord, chain: HashChain,
                     max_tokens: int | None = None) -> LoadHandle | None:
        """Start copying the longest cached prefix of ``chain`` into ``kv``'s first pages.

        Args:
            kv: an open row that already holds slots for the prefix (``extend`` first).
            chain: hash chain of the request's prompt.
            max_tokens: load at most this many tokens (whole pages).

        Returns:
            The handle (``num_tokens`` positions from 0), or ``None`` on a miss. After
            ``complete_load`` the caller commits those positions; the cache keeps the
            host pages, the request its device pages.
        """
        limit = kv.allocated_len if max_tokens is None else min(max_tokens, kv.allocated_len)
        with self._lock:
            keys = chain.keys[:limit // self.page_size]
            host_pages = self.prefix.match(keys)
            if not len(host_pages):
                return None
            keys = keys[:len(host_pages)]
            device_pages = self.cache.pages(kv, 0, len(keys) * self.page_size)
            device_pin = self.cache.pin_pages(device_pages, reason="load")
            self.prefix.ref(keys[-1])
            host_pin = self.host.pin(host_pages, "load")
            job = self.engine.submit(self.host.data, host_pages, self.cache.data(),
                                     device_pages)
            handle = LoadHandle(kv, len(keys) * self.page_size, keys, device_pages,
                                host_pages, device_pin, host_pin, job)
            self._loads.append(handle)
            self._pending[id(kv)] = self._pending.get(id(kv), 0) + 1
            return handle

    def complete_load(self, handle: LoadHandle, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s for the load; True once the prefix is in the row.

        Raises:
            RuntimeError: the copy failed (pins and references are already dropped).
        """
        if not handle.done and handle.job.wait(timeout):
            self.poll()
        if handle.error is not None:
            raise RuntimeError(f"prefix load of {handle.owner!r} failed") from handle.error
        return handle.done

    def _finish_load(self, h: LoadHandle) -> None:
        self.cache.unpin(h.device_pin)
        digests = self.host.digests(h.host_pages)   # the pages the copy read (still pinned)
        bad = self.host.mismatched(h.host_pages, digests)
        self.host.unpin(h.host_pin, {"load": digests, "rid": h.owner})
        self.prefix.unref(h.keys[-1])
        h.error = h.job.error
        if bad:   # corrupted at rest: this load fails, nobody loads these pages again
            self.num_corrupt_pages += len(bad)
            self.prefix.poison(h.keys[bad[0]])
            pages = [int(h.host_pages[i]) for i in bad]
            logger.error("prefix load of %s: host pages %s changed since they were stored "
                         "(digest mismatch); the request does its whole prompt", h.owner,
                         pages)
            h.error = h.error or DigestMismatch(f"host pages {pages} changed since stored")
        if h.error is None:
            self.num_loaded_pages += len(h.keys)
        self._done(h)

    # -- completion and waiting ---------------------------------------------------------
    def poll(self) -> int:
        """Complete every finished copy (stores in submission order); returns how many."""
        with self._lock:
            count = 0
            while self._stores and self._stores[0].job.done():
                self._finish_store(self._stores.popleft())
                count += 1
            for h in [h for h in self._loads if h.job.done()]:
                self._loads.remove(h)
                self._finish_load(h)
                count += 1
            return count

    def pending(self, kv: KvRecord | str) -> int:
        """Copies of the row ``kv`` (or of every row of an owner name) not completed yet."""
        with self._lock:
            if isinstance(kv, str):
                return sum(h.owner == kv for h in (*self._stores, *self._loads))
            return self._pending.get(id(kv), 0)

    def wait(self, kv: KvRecord | str | None = None, timeout: float | None = None) -> bool:
        """Complete every copy of ``kv`` (every copy when ``None``) within ``timeout`` s.

        Returns True when none is left; call before freeing a finished request's row.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            jobs = [h.job for h in (*self._stores, *self._loads)
                    if kv is None or h.row is kv or h.owner == kv]
        for job in jobs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.wait(left):
                break
        self.poll()
        with self._lock:
            return (self.pending(kv) if kv is not None
                    else len(self._stores) + len(self._loads)) == 0

    def close(self, timeout: float | None = None) -> bool:
        """Complete every copy and stop the engine; False if copies were still running."""
        ok = self.wait(None, timeout)
        if ok:
            self.engine.close()
        else:
            logger.error("offloader closed with %d copies in flight",
                         len(self._stores) + len(self._loads))
        return ok

    def check_integrity(self) -> None:
        with self._lock:
            self.prefix.check_integrity()
            self.host.check_integrity()
            assert sum(self._pending.values()) == len(self._stores) + len(self._loads)

    # -- internals ----------------------------------------------------------------------
    def _cached_or_inflight(self, key: bytes) -> bool:
        return key in self.prefix or key in self._inflight

    def _done(self, h: StoreHandle | LoadHandle) -> None:
        h.done = True
        left = self._pending[id(h.row)] - 1
        if left:
            self._pending[id(h.row)] = left
        else:
            del self._pending[id(h.row)]


def _check_compatible(cache: KvCache, host: HostTier) -> None:
    if "swa" in cache.pool_names:
        raise ValueError("Offloader: KvCache has a sliding-window pool; only caches with "
                         "the full pool alone can be offloaded for now")
    if host.page_size != cache.page_size or host.layout != cache.layout:
        raise ValueError(f"Offloader: host tier (page_size={host.page_size}, "
                         f"{host.layout}) does not match the KvCache "
                         f"(page_size={cache.page_size}, {cache.layout})")
