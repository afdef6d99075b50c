"""Prefill-side prefix cache: keep computed prompt KV in the host tier and reuse it.

After a request's pages are sent, the prefill offloads the prompt's full pages (target
and draft layers alike) to its host tier. A later request whose prompt begins with
cached pages loads them into its row instead of recomputing them, and chunked prefill
starts after them (``PrefillTask.done = start``):

    positions  0 ............. start ........ len(prompt)
               | loaded (host) | computed here | -> first token from the last forward pass
    start = min(cached full pages, (len(prompt) - 1) // page_size) * page_size

At least one prompt token is always computed, so the first token comes from a forward
pass over real KV, exactly as without reuse.

Who frees what: the request's device row is the worker's, freed as usual after the send;
``offload_sent`` must run *before* that free (it pins the pages it copies, so the free may
follow at once: pinned pages return to the free list when their copy ends). Host pages
are the prefix cache's (``cache:host``), freed on eviction. Aborts free at once.
"""

from __future__ import annotations

import logging

from common.host import HashChain, LoadHandle, Offloader
from common.kv import KvRecord

logger = logging.getLogger(__name__)


class PrefixReuse:
    """Prefix loads and post-send offloads for one prefill worker.

    Args:
        offloader: moves pages between the worker's ``KvCache`` and its ``HostTier``.
        salt: mixed into the hash chains (model and layout), as on the decode side.
    """

    def __init__(self, offloader: Offloader, salt: bytes = b"") -> None:
        self.off, self.page_size, self.salt = offloader, offloader.page_size, salt
        self.num_hit_pages = 0
        self.num_hit_requests = 0

    def chain_of(self, tokens: list[int]) -> HashChain:
        return HashChain(self.page_size, self.salt, tokens)

    def lookup(self, prompt: list[int]) -> int:
        """Prompt tokens a hit would load (whole pages, at least one token left to compute)."""
        cap = (len(prompt) - 1) // self.page_size * self.page_size
        return min(self.off.lookup(self.chain_of(prompt)), cap)

    def prepare_load(self, kv: KvRecord, prompt: list[int]) -> LoadHandle | None:
        """Start loading ``prompt``'s cached prefix into ``kv`` (extended over the prompt).

        Returns:
            The handle (its ``num_tokens`` is the chunked-prefill start) or None on a miss.
            Compute nothing on the row before ``complete_load``; an abort meanwhile frees
            the row at once (the load's pins keep the pages safe).
        """
        handle = self.off.prepare_load(kv, self.chain_of(prompt), max_tokens=self.lookup(prompt))
        if handle is not None:
            self.num_hit_pages += len(handle.keys)
            self.num_hit_requests += 1
        return handle

    def complete_load(self, handle: LoadHandle, timeout: float | None = None) -> bool:
        """True once the prefix is in the row; then commit ``handle.num_tokens`` positions.

        Raises:
            RuntimeError: the copy failed; prefill from 0 instead.
        """
        return self.off.complete_load(handle, timeout)

    def load(self, kv: KvRecord, prompt: list[int], timeout: float | None = None) -> int:
        """Blocking load-and-commit of the cached prefix; returns the start position.

        Args:
            kv: the row, extended over the prompt, nothing committed yet.
            prompt: the request's prompt.
            timeout: seconds to wait for the copy.

        Returns:
            Positions [0, start) of the row hold the cached KV and are committed; 0 on a
            miss, a failed copy or a timeout (the caller computes everything).
        """
        assert kv.committed_len == 0, kv
        handle = self.prepare_load(kv, prompt)
        if handle is None:
            return 0
        try:
            done = self.complete_load(handle, timeout)
        except RuntimeError:
            logger.warning("prefix load of %s failed; computing the whole prompt", kv.owner)
            return 0
        if not done:
            # The load may still write these pages; rewriting them by prefill later is
            # ordered after it only on the copy engine's own queue, so refuse instead.
            raise TimeoutError(f"prefix load of {kv.owner!r} not done in {timeout} s; "
                               "free the row (pins keep it safe) and retry")
        self.off.cache.commit(kv, handle.num_tokens)
        return handle.num_tokens

    def offload_sent(self, kv: KvRecord, prompt: list[int]) -> bool:
        """After the pages were sent: start copying the prompt's full pages to the host.

        Call before freeing the row (the free may follow at once). Returns True when a
        copy started (False: everything cached or in flight, or the host tier is full).
        """
        return self.off.prepare_store(kv, self.chain_of(prompt)) is not None

    def poll(self) -> int:
        """Complete finished copies (call once per worker loop); returns how many."""
        return self.off.poll()
