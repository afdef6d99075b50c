"""Decode-side host-tier connector: offload while decoding, prefix loads, retraction.

Glue between a decode worker's ``KvCache`` rows and ``common.host.offload.Offloader``
(DESIGN.md section 6, LESSONS.md item 4). Per running sequence it keeps a ``HashChain``
over the committed tokens (prompt + generated but the newest) and, each time a page fills
with committed KV, starts copying it to the host tier (``prepare_store``); ``poll`` each
step completes finished copies.

What of a row may go to the host (P = prompt length, G = tokens generated)::

    positions  0 ........ F ....... C = P + G - 1 .... allocated_len
               | full committed | partial | newest | lookahead tail |
    offloaded  [0, F), F = C // page_size * page_size; never the partial page, the newest
               token (no KV) or the speculative tail

Who frees what:

- finish: ``request_finished(kv, ranges)`` returns True when copies of the row are still
  in flight; the connector then owns the free and ``reap()`` does it (reason
  ``finished``) once they complete, and closes the row. False: the caller frees now.
- abort: the caller frees at once (reason ``aborted``) and calls ``request_aborted``;
  the offloader's pins keep in-flight pages out of reuse until the copy ends.
- retraction: ``retract`` frees the device row at once (reason ``offloaded``; pins again
  protect in-flight pages) and returns a ``Retracted`` that ``resume`` turns back into a
  running sequence in a new row.
- host pages always belong to the prefix cache (``cache:host``), freed on eviction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from common.host import HashChain, LoadHandle, Offloader
from common.kv import KvRecord
from common.model import BatchItem, ModelRunner
from common.request import SamplingParams
from decode_node.batch import DecodeSeq

logger = logging.getLogger(__name__)


@dataclass
class _Track:
    """A running sequence: its row, prompt and chain over its committed tokens."""

    kv: KvRecord
    prompt: list[int]
    chain: HashChain
    offered: int = 0
    """Full committed pages already handed to ``prepare_store``."""


@dataclass
class Retracted:
    """A sequence whose device row was given back; its committed pages are on the host."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    output: list[int]
    ref_key: bytes | None
    """Last key of the stored chain, referenced so eviction keeps it until ``resume``."""

    @property
    def committed_len(self) -> int:
        return len(self.prompt) + len(self.output) - 1


class HostConnector:
    """Offload, prefix loads and retraction for one decode worker.

    Args:
        offloader: moves pages between the worker's ``KvCache`` and its ``HostTier``.
        salt: mixed into every hash chain (for example the model name and layout), so a
            host tier never matches KV of another model.
    """

    def __init__(self, offloader: Offloader, salt: bytes = b"") -> None:
        self.off, self.cache = offloader, offloader.cache
        self.page_size, self.salt = offloader.page_size, salt
        self._tracks: dict[str, _Track] = {}
        self._held: dict[str, tuple[KvRecord, list[tuple[int, int]]]] = {}
        self.num_prefix_hit_pages = 0
        self.num_retracted = 0

    # -- admission: prefix lookup and load ----------------------------------------------
    def lookup(self, prompt: list[int]) -> int:
        """Prompt tokens (whole pages) the host tier holds; at least one token is left for
        the transfer, so the prefill always sends the token after the prefix."""
        cap = (len(prompt) - 1) // self.page_size * self.page_size
        return min(self.off.lookup(self.chain_of(prompt)), cap)

    def prepare_load(self, kv: KvRecord, prompt: list[int]) -> LoadHandle | None:
        """Start loading the cached prefix of ``prompt`` into ``kv``'s first pages.

        Args:
            kv: the admitted row, already extended over the prompt.
            prompt: the request's prompt.

        Returns:
            The handle (``num_tokens`` positions from 0) or None on a miss. The transfer
            then carries only ``[num_tokens, len(prompt))``. Wait with ``complete_load``
            before the row is read; an abort meanwhile frees the row at once (pins).
        """
        handle = self.off.prepare_load(kv, self.chain_of(prompt), max_tokens=self.lookup(prompt))
        if handle is not None:
            self.num_prefix_hit_pages += len(handle.keys)
        return handle

    def complete_load(self, handle: LoadHandle, timeout: float | None = None) -> bool:
        """True once the prefix is in the row (raises ``RuntimeError`` if the copy failed)."""
        return self.off.complete_load(handle, timeout)

    # -- decoding: offload as pages fill ------------------------------------------------
    def track(self, seq: DecodeSeq, prompt: list[int]) -> None:
        """Start offloading ``seq`` (call when it joins the batch; its prompt is committed)."""
        assert len(prompt) == seq.prompt_len, (seq.rid, len(prompt), seq.prompt_len)
        self._tracks[seq.rid] = _Track(seq.kv, list(prompt), self.chain_of(prompt))
        self._offload(seq)

    def on_commit(self, seqs: list[DecodeSeq]) -> None:
        """``DecodeBatch`` hook, after each step: complete copies, start new full pages."""
        self.off.poll()
        for s in seqs:
            if s.rid in self._tracks:
                self._offload(s)

    def poll(self) -> int:
        """Complete finished copies; returns how many."""
        return self.off.poll()

    def _offload(self, seq: DecodeSeq) -> None:
        t = self._tracks[seq.rid]
        full = t.kv.committed_len // self.page_size
        if full <= t.offered:
            return
        committed = seq.output[:t.kv.committed_len - seq.prompt_len]
        t.chain.extend(committed[t.chain.num_tokens - seq.prompt_len:])
        self.off.prepare_store(t.kv, t.chain)  # None: cached, in flight or host full
        t.offered = full

    # -- finish, abort, reap ------------------------------------------------------------
    def request_finished(self, seq: DecodeSeq, ranges: list[tuple[int, int]]) -> bool:
        """The sequence finished; returns True when the connector takes over freeing.

        Args:
            seq: the finished sequence (its last committed pages are offloaded now).
            ranges: what to free, usually ``finish_ranges(seq.kv, page_size)``.

        Returns:
            True: copies are in flight; ``reap()`` frees ``ranges`` (reason ``finished``)
            and closes the row once they complete; the caller must not free or close.
            False: nothing in flight; the caller frees and closes now.
        """
        if seq.rid in self._tracks:
            self._offload(seq)
            del self._tracks[seq.rid]
        self.off.poll()
        if not self.off.pending(seq.kv):
            return False
        self._held[seq.rid] = (seq.kv, ranges)
        return True

    def request_aborted(self, rid: str) -> None:
        """Forget ``rid``; the caller frees its row at once with reason ``aborted``."""
        self._tracks.pop(rid, None)

    def reap(self, timeout: float = 0.0) -> list[str]:
        """Free (reason ``finished``) and close held rows whose copies completed.

        Args:
            timeout: seconds to wait for the oldest held row's copies (0: just poll).

        Returns:
            The request ids whose rows were freed.
        """
        if self._held and timeout > 0:
            self.off.wait(next(iter(self._held.values()))[0], timeout)
        self.off.poll()
        done = [rid for rid, (kv, _) in self._held.items() if not self.off.pending(kv)]
        for rid in done:
            kv, ranges = self._held.pop(rid)
            self.cache.free_kv_row(kv, ranges, reason="finished")
            self.cache.close_row(kv)
        return done

    @property
    def num_held(self) -> int:
        """Finished rows waiting for their copies (pages still counted as used)."""
        return len(self._held)

    # -- retraction under memory pressure -----------------------------------------------
    def retract(self, seq: DecodeSeq, ranges: list[tuple[int, int]]) -> Retracted:
        """Offload ``seq``'s committed full pages and free its device row at once.

        The caller has taken ``seq`` out of the batch. ``ranges`` (usually
        ``finish_ranges``) are freed with reason ``offloaded`` and the row is closed; the
        pins of the copies in flight keep those pages out of reuse until the copies end.
        The stored chain is referenced so that eviction keeps it until ``resume``.
        """
        t = self._tracks.get(seq.rid)
        if t is None:
            raise ValueError(f"retract({seq.rid!r}): not tracked; call track() when it joins")
        self._offload(seq)
        del self._tracks[seq.rid]
        full = seq.kv.committed_len // self.page_size
        ref_key = t.chain.keys[full - 1] if full else None
        self.off.prefix.ref(ref_key)
        self.cache.free_kv_row(seq.kv, ranges, reason="offloaded")
        self.cache.close_row(seq.kv)
        self.num_retracted += 1
        logger.info("%s retracted to the host tier (%d committed tokens)", seq.rid,
                    seq.kv.committed_len)
        return Retracted(seq.rid, t.prompt, seq.params, list(seq.output), ref_key)

    def resume(self, runner: ModelRunner, r: Retracted, timeout: float | None = None
               ) -> DecodeSeq:
        """Bring a retracted sequence back into a new row of ``runner.cache`` (blocking).

        Loads the longest cached prefix of its committed tokens, recomputes the rest with
        the target and the draft (when the pool has draft layers), and commits them.

        Raises:
            OutOfPages: the pool cannot hold the row now; nothing is held (retry later).
            RuntimeError: the load failed or timed out; the row is freed (``error``).
        """
        tokens = r.prompt + r.output[:-1]  # the committed tokens
        kv = self.cache.open_row(r.rid)
        try:
            self.cache.extend(kv, len(tokens))
        except Exception:
            self.cache.close_row(kv)
            raise
        loaded = self._load_committed(kv, tokens, timeout)
        self.off.prefix.unref(r.ref_key)
        self._recompute(runner, kv, tokens, loaded)
        seq = DecodeSeq(r.rid, kv, r.params, len(r.prompt), list(r.output), r.prompt)
        self.track(seq, r.prompt)
        return seq

    def discard(self, r: Retracted) -> None:
        """Drop a retracted sequence that will not resume (abort): unreference its chain,
        so eviction may take its host pages. It holds no device row."""
        self.off.prefix.unref(r.ref_key)

    def _load_committed(self, kv: KvRecord, tokens: list[int], timeout: float | None) -> int:
        handle = self.off.prepare_load(kv, self.chain_of(tokens))
        if handle is None:
            return 0
        try:
            if not self.off.complete_load(handle, timeout):
                raise RuntimeError(f"resume of {kv.owner!r}: load not done in {timeout} s")
        except RuntimeError:
            self.cache.free_kv_row(kv, [(0, kv.allocated_len)], reason="error")
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

    def chain_of(self, tokens: list[int]) -> HashChain:
        return HashChain(self.page_size, self.salt, tokens)

    def check_integrity(self) -> None:
        self.off.check_integrity()
        for rid, t in self._tracks.items():
            assert t.kv.is_open, f"tracked {rid!r} has a closed row"
