"""Prefix cache of the host tier: host pages keyed by a hash chain over full pages
(``common.host.chain``: a key names the whole prefix up to the end of its page).

Chain consistency: an entry's parent is always cached, so the set of cached keys along
any chain is a prefix (lookups use binary search). Eviction keeps it so by evicting only
leaves (entries with no cached child) that nobody references, least recently used first.
``ref(key)`` protects ``key`` and, since only leaves go, all its ancestors, with one count;
in-flight loads and stores hold such a reference. Entries' pages are owned by
``cache:host`` in the host tier; eviction frees them there with reason ``evicted``.

A ``CacheListener`` hears every entry that comes and goes, inside the cache's lock and so
in the cache's own order (the KV events publish them: ``common.kv_events``); it must only
take note, never call back into the cache.
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from common.host.chain import prefix_len
from common.host.tier import CACHE_OWNER, HostTier

logger = logging.getLogger(__name__)


class CacheListener(Protocol):
    """Hears the prefix cache's entries come and go (called under the cache's lock)."""

    def stored(self, keys: Sequence[bytes], parent: bytes | None, tokens: np.ndarray
               ) -> None:
        """``keys`` (a chain, each the child of the one before, the first a child of
        ``parent``; None: the root) were cached; ``tokens`` are their pages' token ids
        (int32, ``len(keys) * page_size``)."""

    def removed(self, keys: Sequence[bytes]) -> None:
        """``keys`` were evicted (leaves first: a child before its parent)."""


@dataclass
class _Entry:
    page: int
    parent: bytes | None
    children: int = 0
    last_use: int = 0
    poisoned: bool = False   # its page failed its digest at a load


class PrefixCache:
    """Host pages by hash-chain key, with LRU eviction of unreferenced leaves.

    Args:
        host: the host tier whose pages (owned by ``cache:host``) the entries hold.

    Who frees what: pages handed to ``insert`` belong to the cache from then on; the cache
    frees them itself, in ``evict``, with reason ``evicted``. Thread-safe.
    """

    def __init__(self, host: HostTier):
        self.host = host
        self._entries: dict[bytes, _Entry] = {}
        self._refs: dict[bytes, int] = {}
        self._heap: list[tuple[int, bytes]] = []  # (last_use, key) candidates, lazily pruned
        self._clock = 0
        self._lock = threading.RLock()
        self.num_evicted = 0
        self.listener: CacheListener | None = None
        """Told of every entry stored and evicted (set before the first ``insert``)."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def _usable(self, key: bytes) -> bool:
        entry = self._entries.get(key)
        return entry is not None and not entry.poisoned

    def poison(self, key: bytes) -> None:
        """``key``'s page failed its digest: no match reaches it or its descendants any
        more; they stay (cached, so never stored again under these keys) until evicted."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.poisoned = True

    def num_cached(self, keys: Sequence[bytes]) -> int:
        """Length of the longest cached prefix of ``keys`` (no LRU update)."""
        with self._lock:
            return prefix_len(keys, self._usable)

    def match(self, keys: Sequence[bytes]) -> np.ndarray:
        """Host pages (int32) of the longest cached prefix of ``keys``; marks them used.

        The pages stay the cache's; ``ref`` the last matched key (and pin the pages) before
        reading them, or they may be evicted meanwhile.
        """
        with self._lock:
            n = prefix_len(keys, self._usable)
            self._clock += 1
            pages = np.empty(n, dtype=np.int32)
            for i, key in enumerate(keys[:n]):
                entry = self._entries[key]
                entry.last_use = self._clock
                pages[i] = entry.page
            if n:
                self._push_if_candidate(keys[n - 1])
            return pages

    def insert(self, keys: Sequence[bytes], pages: np.ndarray, parent: bytes | None,
               tokens: np.ndarray | None = None) -> None:
        """Add a chain of new entries: ``keys[i]`` holds ``pages[i]``; ``parent`` precedes.

        The cache takes ownership of ``pages`` (owned by ``cache:host`` in the host tier).
        ``parent`` must be cached (or ``None`` at the root); ``keys`` must be new.
        ``tokens`` (the pages' token ids) go to the ``listener``, which needs them.
        """
        with self._lock:
            assert len(keys) == len(pages), f"{len(keys)} keys, {len(pages)} pages"
            assert parent is None or parent in self._entries, "parent of insert not cached"
            if self.listener is not None and len(keys):
                assert tokens is not None, "insert without tokens while a listener hears"
                self.listener.stored(list(keys), parent, tokens)
            self._clock += 1
            for key, page in zip(keys, pages):
                assert key not in self._entries, "insert of a key already cached"
                if parent is not None:
                    self._entries[parent].children += 1
                self._entries[key] = _Entry(int(page), parent, last_use=self._clock)
                parent = key
            if len(keys):
                self._push_if_candidate(keys[-1])

    def ref(self, key: bytes | None) -> None:
        """Protect ``key`` and its ancestors from eviction (``key`` may be in flight)."""
        if key is not None:
            with self._lock:
                self._refs[key] = self._refs.get(key, 0) + 1

    def unref(self, key: bytes | None) -> None:
        if key is None:
            return
        with self._lock:
            count = self._refs[key] - 1
            if count:
                self._refs[key] = count
            else:
                del self._refs[key]
                self._push_if_candidate(key)

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages, least recently used unreferenced leaves first.

        Returns the number freed (fewer when the rest is referenced). One ``free`` event
        with reason ``evicted`` in the host log.
        """
        with self._lock:
            freed: list[int] = []
            keys: list[bytes] = []
            while len(freed) < num_pages and self._heap:
                last_use, key = heapq.heappop(self._heap)
                entry = self._entries.get(key)
                if entry is None or entry.last_use != last_use or not self._candidate(key):
                    continue  # stale heap item
                freed.append(self._remove(key))
                keys.append(key)
            if freed:
                if self.listener is not None:
                    self.listener.removed(keys)
                self.host.free(np.asarray(freed, dtype=np.int32), CACHE_OWNER, "evicted")
                self.num_evicted += len(freed)
                logger.debug("evicted %d host pages, %d cached", len(freed), len(self))
            return len(freed)

    def keys(self) -> dict[bytes, bytes | None]:
        """Every cached key and its parent (None at the root): the cache's state."""
        with self._lock:
            return {key: entry.parent for key, entry in self._entries.items()}

    def check_integrity(self) -> None:
        """Every parent cached, children counts right, pages distinct and owned by the cache."""
        with self._lock:
            children: dict[bytes, int] = {}
            for key, entry in self._entries.items():
                if entry.parent is not None:
                    assert entry.parent in self._entries, f"orphan entry {key.hex()}"
                    children[entry.parent] = children.get(entry.parent, 0) + 1
            for key, entry in self._entries.items():
                assert entry.children == children.get(key, 0), f"children of {key.hex()}"
            pages = [e.page for e in self._entries.values()]
            assert len(set(pages)) == len(pages), "a host page cached twice"
            owned = self.host.owners_holding_pages().get(CACHE_OWNER, 0)
            assert owned >= len(pages), f"cache holds {len(pages)} pages, owns {owned}"

    # -- internals ----------------------------------------------------------------------
    def _candidate(self, key: bytes) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.children == 0 and key not in self._refs

    def _push_if_candidate(self, key: bytes) -> None:
        if self._candidate(key):
            heapq.heappush(self._heap, (self._entries[key].last_use, key))

    def _remove(self, key: bytes) -> int:
        entry = self._entries.pop(key)
        if entry.parent is not None:
            parent = self._entries[entry.parent]
            parent.children -= 1
            # The parent was used at least as recently as its child.
            parent.last_use = max(parent.last_use, entry.last_use)
            self._push_if_candidate(entry.parent)
        return entry.page

