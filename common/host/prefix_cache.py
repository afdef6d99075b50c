"""Prefix cache of the host tier: host pages keyed by a hash chain over full pages.

A request's tokens split into full pages; page ``i``'s key hashes the previous key and
page ``i``'s token ids (little-endian int32), so a key names the whole prefix up to the
end of its page, and the same tokens after a different prefix never match:

    key_0 = blake2b(root || tokens[0:ps]),  key_i = blake2b(key_{i-1} || tokens[i*ps:(i+1)*ps])
    root  = blake2b("pdkv-prefix" || salt)     (salt: for example the model and layout)

Only full pages get keys; the partial last page never does.

Chain consistency: an entry's parent is always cached, so the set of cached keys along
any chain is a prefix (lookups use binary search). Eviction keeps it so by evicting only
leaves (entries with no cached child) that nobody references, least recently used first.
``ref(key)`` protects ``key`` and, since only leaves go, all its ancestors, with one count;
in-flight loads and stores hold such a reference. Entries' pages are owned by
``cache:host`` in the host tier; eviction frees them there with reason ``evicted``.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from common.host.tier import CACHE_OWNER, HostTier

logger = logging.getLogger(__name__)

_DIGEST = 16


class HashChain:
    """The hash-chain keys of one request's full pages, extended as tokens arrive.

    Args:
        page_size: tokens per page (the pool's).
        salt: bytes mixed into the root key, so caches of different models never match.
        tokens: initial token ids.
    """

    def __init__(self, page_size: int, salt: bytes = b"", tokens: Sequence[int] = ()):
        if page_size < 1:
            raise ValueError(f"HashChain page_size={page_size} must be >= 1")
        self.page_size = page_size
        self.keys: list[bytes] = []
        self.num_tokens = 0
        self._last = hashlib.blake2b(b"pdkv-prefix" + salt, digest_size=_DIGEST).digest()
        self._partial = np.zeros(0, dtype="<i4")
        self.extend(tokens)

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append token ids; every page they complete gets its key."""
        arr = np.concatenate((self._partial, np.asarray(tokens, dtype="<i4").ravel()))
        ps, full = self.page_size, len(arr) // self.page_size
        data = arr[:full * ps].tobytes()
        step = ps * 4
        for i in range(full):
            self._last = hashlib.blake2b(self._last + data[i * step:(i + 1) * step],
                                         digest_size=_DIGEST).digest()
            self.keys.append(self._last)
        self._partial = arr[full * ps:].copy()
        self.num_tokens = len(self.keys) * ps + len(self._partial)

    def __len__(self) -> int:
        """Number of full pages (keys)."""
        return len(self.keys)


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

    def insert(self, keys: Sequence[bytes], pages: np.ndarray, parent: bytes | None) -> None:
        """Add a chain of new entries: ``keys[i]`` holds ``pages[i]``; ``parent`` precedes.

        The cache takes ownership of ``pages`` (owned by ``cache:host`` in the host tier).
        ``parent`` must be cached (or ``None`` at the root); ``keys`` must be new.
        """
        with self._lock:
            assert len(keys) == len(pages), f"{len(keys)} keys, {len(pages)} pages"
            assert parent is None or parent in self._entries, "parent of insert not cached"
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
            while len(freed) < num_pages and self._heap:
                last_use, key = heapq.heappop(self._heap)
                entry = self._entries.get(key)
                if entry is None or entry.last_use != last_use or not self._candidate(key):
                    continue  # stale heap item
                freed.append(self._remove(key))
            if freed:
                self.host.free(np.asarray(freed, dtype=np.int32), CACHE_OWNER, "evicted")
                self.num_evicted += len(freed)
                logger.debug("evicted %d host pages, %d cached", len(freed), len(self))
            return len(freed)

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


def prefix_len(keys: Sequence[bytes], present: Callable[[bytes], bool],
               limit: int | None = None) -> int:
    """Binary search for the longest prefix of ``keys[:limit]`` that ``present`` accepts.

    Correct because the accepted keys of a chain always form a prefix (see module doc).
    """
    lo, hi = 0, len(keys) if limit is None else min(limit, len(keys))
    while lo < hi:
        mid = (lo + hi) // 2
        if present(keys[mid]):
            lo = mid + 1
        else:
            hi = mid
    return lo
