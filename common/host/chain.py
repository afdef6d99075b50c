"""Hash-chain keys of a token sequence's full pages (torch-free: the router uses them).

A sequence's tokens split into full pages; page ``i``'s key hashes the previous key and
page ``i``'s token ids (little-endian int32), so a key names the whole prefix up to the
end of its page, and the same tokens after a different prefix never match:

    key_0 = blake2b(root || tokens[0:ps]),  key_i = blake2b(key_{i-1} || tokens[i*ps:(i+1)*ps])
    root  = blake2b("pdkv-prefix" || salt)     (salt: for example the model and layout)

Only full pages get keys; the partial last page never does. The chain keeps the tokens of
its full pages, so whoever caches pages under these keys can say which tokens they hold
(the KV events' ``BlockStored`` carries them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np

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
        self._last = root_key(salt)
        self._partial = np.zeros(0, dtype="<i4")
        self._full = bytearray()  # the full pages' tokens, int32 little-endian
        self.extend(tokens)

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append token ids; every page they complete gets its key."""
        arr = np.concatenate((self._partial, np.asarray(tokens, dtype="<i4").ravel()))
        ps, full = self.page_size, len(arr) // self.page_size
        data = arr[:full * ps].tobytes()
        new = chain_keys(self._last, data, ps)
        if new:
            self._last = new[-1]
            self.keys.extend(new)
        self._full += data
        self._partial = arr[full * ps:].copy()
        self.num_tokens = len(self.keys) * ps + len(self._partial)

    def page_tokens(self, start: int, end: int) -> np.ndarray:
        """Token ids (int32) of full pages ``[start, end)``."""
        if not 0 <= start <= end <= len(self.keys):
            raise ValueError(f"pages [{start}, {end}) of a chain of {len(self.keys)}")
        step = self.page_size * 4
        return np.frombuffer(bytes(self._full[start * step:end * step]), dtype="<i4")

    def __len__(self) -> int:
        """Number of full pages (keys)."""
        return len(self.keys)


def root_key(salt: bytes = b"") -> bytes:
    """The key every chain of ``salt`` starts from (the parent of its first page)."""
    return hashlib.blake2b(b"pdkv-prefix" + salt, digest_size=_DIGEST).digest()


def chain_keys(parent: bytes, data: bytes, page_size: int) -> list[bytes]:
    """The keys of full pages ``data`` (int32 little-endian token ids, whole pages) that
    follow the page keyed ``parent`` (``root_key`` for a chain's first page)."""
    step, out = page_size * 4, []
    for i in range(len(data) // step):
        parent = hashlib.blake2b(parent + data[i * step:(i + 1) * step],
                                 digest_size=_DIGEST).digest()
        out.append(parent)
    return out


def prefix_len(keys: Sequence[bytes], present: Callable[[bytes], bool],
               limit: int | None = None) -> int:
    """Binary search for the longest prefix of ``keys[:limit]`` that ``present`` accepts.

    Correct when the accepted keys of a chain always form a prefix (a cache that holds a
    key holds its parent: ``common.host.prefix_cache``).
    """
    lo, hi = 0, len(keys) if limit is None else min(limit, len(keys))
    while lo < hi:
        mid = (lo + hi) // 2
        if present(keys[mid]):
            lo = mid + 1
        else:
            hi = mid
    return lo
