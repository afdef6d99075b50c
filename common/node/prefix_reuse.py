"""Prefix reuse: load a prompt's cached pages from the host tier, with the timeout policy.

One implementation for prefill, decode and colocated workers. At admission a request's
row is opened and extended over its prompt; ``load_request`` then fills the row's first
pages from the host tier's prefix cache, and the worker computes (or receives) only the
rest:

    positions  0 ............. start ........ len(prompt)
               | loaded (host) | computed or received
    start = min(cached full pages, (len(prompt) - 1) // page_size) * page_size

At least one prompt token is always left, so the first token comes from a forward pass
over real KV exactly as without reuse (and a decode always receives the token after the
prefix).

Timeout policy: a load that does not end within ``timeout_s`` costs the cached prefix,
never the worker. The row is freed (``timeout``; the load's pins keep its pages out of
reuse until the copy ends), ``req.kv`` is cleared and ``req.reuse`` turned off; the
caller puts the request back in its queue, and it gets its whole prompt in a new row. A
copy that fails loads nothing (start 0). Other exceptions are the caller's to contain.

Prefill also offers a sent prompt's full pages to the host tier (``offload_sent``; call
before freeing the row: its pins let the free follow at once). Host pages belong to the
prefix cache (``cache:host``), freed on eviction.
"""

from __future__ import annotations

import logging

from common.host import HashChain, LoadHandle, Offloader
from common.kv import FreeReason, KvRecord
from common.request import Request

logger = logging.getLogger(__name__)


class PrefixLoadTimeout(TimeoutError):
    """A prefix load did not end within its deadline; the row's first pages may still be
    written by the copy."""


class PrefixReuse:
    """Prefix loads (and post-send offloads) for one worker.

    Args:
        offloader: moves pages between the worker's ``KvCache`` and its ``HostTier``.
        salt: mixed into the hash chains (model and layout; ``host_salt``).
        timeout_s: longest a load may take (``ServeConfig.prefix_load_timeout_s``).
    """

    def __init__(self, offloader: Offloader, salt: bytes = b"",
                 timeout_s: float | None = None) -> None:
        self.offloader, self.cache = offloader, offloader.cache
        self.page_size, self.salt, self.timeout_s = offloader.page_size, salt, timeout_s
        self.num_hit_pages = 0
        self.num_hit_requests = 0
        self.num_timeouts = 0

    def chain_of(self, tokens: list[int]) -> HashChain:
        return HashChain(self.page_size, self.salt, tokens)

    def lookup(self, prompt: list[int]) -> int:
        """Prompt tokens a hit would load (whole pages, at least one token left)."""
        cap = (len(prompt) - 1) // self.page_size * self.page_size
        return min(self.offloader.lookup(self.chain_of(prompt)), cap)

    def prepare_load(self, kv: KvRecord, prompt: list[int]) -> LoadHandle | None:
        """Start loading ``prompt``'s cached prefix into ``kv`` (extended over the prompt);
        the handle's ``num_tokens`` is where the rest starts, None on a miss."""
        handle = self.offloader.prepare_load(kv, self.chain_of(prompt),
                                             max_tokens=self.lookup(prompt))
        if handle is not None:
            self.num_hit_pages += len(handle.keys)
            self.num_hit_requests += 1
        return handle

    def load(self, kv: KvRecord, prompt: list[int], *, commit: bool = True,
             timeout: float | None = None) -> int:
        """Blocking load of the cached prefix into ``kv``; returns the tokens loaded.

        Args:
            kv: the row, extended over the prompt, nothing committed yet.
            commit: commit the loaded positions (False: the caller commits them with the
                rest of the prompt, as a decode does when the transfer ends).
            timeout: seconds to wait (default ``timeout_s``).

        Returns:
            Positions [0, start) hold the cached KV; 0 on a miss or a failed copy.

        Raises:
            PrefixLoadTimeout: not done in time; free the row (pins keep it safe).
        """
        assert kv.committed_len == 0, kv
        handle = self.prepare_load(kv, prompt)
        if handle is None:
            return 0
        timeout = self.timeout_s if timeout is None else timeout
        try:
            done = self.offloader.complete_load(handle, timeout)
        except RuntimeError as exc:  # the copy failed and ended: do the whole prompt
            logger.warning("prefix load of %s failed (%s); the whole prompt instead",
                           kv.owner, exc)
            return 0
        if not done:
            # The load may still write these pages; rewriting them later is ordered after
            # it only on the copy engine's own queue, so give them up instead.
            raise PrefixLoadTimeout(f"prefix load of {kv.owner!r} not done in {timeout} s")
        if commit:
            self.cache.commit(kv, handle.num_tokens)
        return handle.num_tokens

    def load_request(self, req: Request, *, commit: bool = True) -> int | None:
        """``load`` into ``req.kv`` under the timeout policy; sets ``req.num_computed``.

        Returns:
            Prompt tokens loaded (0 on a miss, a failed copy or ``req.reuse`` off), or
            None when the load timed out: the row was freed (``timeout``) and closed,
            ``req.kv`` is None and ``req.reuse`` False; queue the request again.
        """
        if not req.reuse:
            return 0
        try:
            start = self.load(req.kv, req.prompt, commit=commit)
        except PrefixLoadTimeout as exc:
            logger.warning("%s; the whole prompt instead, in a new row", exc)
            self.num_timeouts += 1
            self.cache.free_kv_row(req.kv, [(0, req.kv.allocated_len)],
                                   reason=FreeReason.TIMEOUT)
            self.cache.close_row(req.kv)
            req.kv, req.reuse = None, False
            return None
        req.num_computed = req.num_cached = start
        return start

    def offload_sent(self, kv: KvRecord, prompt: list[int]) -> bool:
        """After the pages were sent: start copying the prompt's full pages to the host.

        Call before freeing the row (the free may follow at once). True when a copy
        started (False: everything cached or in flight, or the host tier is full).
        """
        return self.offloader.prepare_store(kv, self.chain_of(prompt)) is not None

    def poll(self) -> int:
        """Complete finished copies (once per worker loop); returns how many."""
        return self.offloader.poll()
