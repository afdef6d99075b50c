"""Decode-side host-tier connector: offload while decoding, and retraction.

Glue between a decode worker's ``KvCache`` rows and ``common.host.Offloader``
(docs/design.md, "Speculation and offload"). Each running request keeps a ``HashChain``
over its committed tokens (``Request.chain``: prompt + generated but the newest) and,
each time a page fills with committed KV, its copy to the host tier starts
(``prepare_store``); ``poll`` each step completes finished copies. Prefix loads at
admission are ``common.host.PrefixReuse``'s.

What of a row may go to the host (P = prompt length, G = tokens generated)::

    positions  0 ........ F ....... C = P + G - 1 .... allocated_len
               | full committed | partial | newest | lookahead tail |
    offloaded  [0, F), F = C // page_size * page_size; never the partial page, the newest
               token (no KV) or the speculative tail

Who frees what:

- finish: ``request_finished(req, ranges)`` returns True when copies of the row are still
  in flight; the connector then owns the free and ``reap()`` does it (reason
  ``finished``) once they complete, and closes the row. False: the caller frees now.
- abort: the caller frees at once (reason ``aborted``) and calls ``request_aborted``;
  the offloader's pins keep in-flight pages out of reuse until the copy ends.
- retraction: ``retract`` frees the device row at once (reason ``offloaded``; pins again
  protect in-flight pages) and keeps the stored chain referenced; ``resume`` loads it
  into a new row.
- host pages always belong to the prefix cache (``cache:host``), freed on eviction.
"""

from __future__ import annotations

import logging

from common.host import HashChain, Offloader
from common.kv import FreeReason, KvRecord
from common.model import BatchItem, ModelRunner
from common.request import Request

logger = logging.getLogger(__name__)


class HostConnector:
    """Offload while decoding, held finishes and retraction for one decode worker.

    Args:
        offloader: moves pages between the worker's ``KvCache`` and its ``HostTier``.
        salt: mixed into every hash chain (for example the model name and layout), so a
            host tier never matches KV of another model.
    """

    def __init__(self, offloader: Offloader, salt: bytes = b"") -> None:
        self.offloader, self.cache = offloader, offloader.cache
        self.page_size, self.salt = offloader.page_size, salt
        self._held: list[tuple[Request, KvRecord, list[tuple[int, int]]]] = []
        """Finished requests whose rows wait for their copies: (request, row, ranges)."""
        self.num_retracted = 0

    def chain_of(self, tokens: list[int]) -> HashChain:
        return HashChain(self.page_size, self.salt, tokens)

    # -- decoding: offload as pages fill ------------------------------------------------
    def track(self, req: Request) -> None:
        """Start offloading ``req`` (call when it joins the batch; its prompt is committed)."""
        req.chain, req.num_offered_pages = self.chain_of(req.prompt), 0
        self._offload(req)

    def on_commit(self, reqs: list[Request]) -> None:
        """``DecodeBatch`` hook, after each step: complete copies, start new full pages."""
        self.offloader.poll()
        for r in reqs:
            if r.chain is not None:
                self._offload(r)

    def poll(self) -> int:
        """Complete finished copies; returns how many."""
        return self.offloader.poll()

    def _offload(self, req: Request, final: bool = False) -> None:
        """Offer the committed full pages not offered yet. While decoding, a page whose
        draft KV lags (speculation) waits for the draft's catch-up in the next step; when
        the row ends (``final``: finished or retracted) no catch-up comes in it, and the
        page goes as it is: its target KV is whole, one draft entry may be stale
        (docs/host_tier.md)."""
        kv, chain = req.kv, req.chain
        ready = kv.committed_len - (0 if final else req.draft_lag)
        full = ready // self.page_size
        if full <= req.num_offered_pages:
            return
        committed = req.output[:ready - req.prompt_len]
        chain.extend(committed[chain.num_tokens - req.prompt_len:])
        self.offloader.prepare_store(kv, chain)  # None: cached, in flight or host full
        req.num_offered_pages = full

    # -- finish, abort, reap ------------------------------------------------------------
    def request_finished(self, req: Request, ranges: list[tuple[int, int]]) -> bool:
        """The request finished; returns True when the connector takes over freeing.

        Args:
            req: the finished request (its last committed pages are offloaded now).
            ranges: what to free, usually ``finish_ranges(req.kv, page_size)``.

        Returns:
            True: copies are in flight; ``reap()`` frees ``ranges`` (reason ``finished``)
            and closes the row once they complete; the caller must not free or close.
            False: nothing in flight; the caller frees and closes now.
        """
        if req.chain is not None:
            self._offload(req, final=True)
            req.chain = None
        self.offloader.poll()
        if not self.offloader.pending(req.kv):
            return False
        self._held.append((req, req.kv, ranges))
        return True

    def request_aborted(self, req: Request) -> None:
        """Stop offloading ``req``; the caller frees its row at once (``aborted``)."""
        req.chain = None

    def reap(self, timeout: float = 0.0) -> list[Request]:
        """Free (reason ``finished``) and close held rows whose copies completed.

        Args:
            timeout: seconds to wait for the oldest held row's copies (0: just poll).

        Returns:
            The requests whose rows were freed.
        """
        if self._held and timeout > 0:
            self.offloader.wait(self._held[0][1], timeout)
        self.offloader.poll()
        done = [h for h in self._held if not self.offloader.pending(h[1])]
        for held in done:
            self._held.remove(held)
            _, kv, ranges = held
            self.cache.free_kv_row(kv, ranges, reason=FreeReason.FINISHED)
            self.cache.close_row(kv)
        return [req for req, _, _ in done]

    @property
    def num_held(self) -> int:
        """Finished rows waiting for their copies (pages still counted as used)."""
        return len(self._held)

    # -- retraction under memory pressure -----------------------------------------------
    def retract(self, req: Request, ranges: list[tuple[int, int]]) -> None:
        """Offload ``req``'s committed full pages and free its device row at once.

        The caller has taken ``req`` out of the batch. ``ranges`` (usually
        ``finish_ranges``) are freed with reason ``offloaded``, the row is closed and
        ``req.kv`` cleared; the pins of the copies in flight keep those pages out of reuse
        until the copies end. The stored chain's last key is referenced
        (``req.host_ref``) so that eviction keeps it until ``resume`` or ``discard``.
        """
        if req.chain is None:
            raise ValueError(f"retract({req.rid!r}): not tracked; call track() when it joins")
        self._offload(req, final=True)  # resume loads every committed full page back
        kv, chain = req.kv, req.chain
        full = kv.committed_len // self.page_size
        req.host_ref = chain.keys[full - 1] if full else None
        self.offloader.prefix.ref(req.host_ref)
        self.cache.free_kv_row(kv, ranges, reason=FreeReason.OFFLOADED)
        self.cache.close_row(kv)
        req.kv, req.chain = None, None
        self.num_retracted += 1
        logger.info("%s retracted to the host tier (%d committed tokens)", req.rid,
                    kv.committed_len)

    def resume(self, runner: ModelRunner, req: Request, timeout: float | None = None) -> None:
        """Bring a retracted request back into a new row of ``runner.cache`` (blocking).

        Loads the longest cached prefix of its committed tokens, recomputes the rest with
        the target and the draft (when the pool has draft layers), commits them and
        tracks the request again; ``req.kv`` is the new row.

        Raises:
            OutOfPages: the pool cannot hold the row now; nothing is held (retry later).
            RuntimeError: the load failed or timed out; the row is freed (``error``).
        """
        tokens = req.committed_tokens
        kv = self.cache.open_row(req.rid)
        try:
            self.cache.extend(kv, len(tokens))
        except Exception:
            self.cache.close_row(kv)
            raise
        loaded = self._load_committed(kv, tokens, timeout)
        self.discard(req)
        self._recompute(runner, kv, tokens, loaded)
        req.kv = kv
        self.track(req)

    def discard(self, req: Request) -> None:
        """Drop the host reference of a retracted request (it resumed or will not), so
        eviction may take its host pages. It holds no device row."""
        self.offloader.prefix.unref(req.host_ref)
        req.host_ref = None

    def _load_committed(self, kv: KvRecord, tokens: list[int], timeout: float | None) -> int:
        handle = self.offloader.prepare_load(kv, self.chain_of(tokens))
        if handle is None:
            return 0
        try:
            if not self.offloader.complete_load(handle, timeout):
                raise RuntimeError(f"resume of {kv.owner!r}: load not done in {timeout} s")
        except RuntimeError:
            self.cache.free_kv_row(kv, [(0, kv.allocated_len)], reason=FreeReason.ERROR)
            self.cache.close_row(kv)
            raise
        return handle.num_tokens

    @staticmethod
    def _recompute(runner: ModelRunner, kv: KvRecord, tokens: list[int], start: int) -> None:
        """KV of positions [start, len(tokens)): the partial page and anything not cached."""
        if start < len(tokens):
            item = BatchItem(kv, tokens[start:], start)
            runner.forward([item])
            if runner.cache.layout.num_draft_layers:
                runner.forward([item], draft=True)
        runner.cache.commit(kv, len(tokens))

    def check_integrity(self) -> None:
        self.offloader.check_integrity()
        for req, kv, _ in self._held:
            assert kv.is_open, f"held {req.rid!r} has a closed row"
