"""The router's index of what every worker's caches hold, rebuilt from their KV events.

Blocks are indexed under the router's own hash chain over their token ids
(``common.host.chain``: a key names the whole prefix up to the end of its block), never
under the worker's hashes: a ``BlockStored`` names its parent by the worker's hash, which
the index maps to the router's key of that parent (per worker and medium), and its
blocks' keys follow from the parent's and their tokens. So the router needs neither a
worker's salt nor its hash function (a vLLM worker's events index alike), and a prompt's
blocks are looked up by hashing the prompt once.

    stored   parent known (or None: the chain's root) -> keys from tokens, indexed
             parent unknown (its event was lost)      -> dropped (counted)
    removed  the worker's hashes -> keys, unindexed
    cleared  every block of the worker, every medium
    lost     batches that never arrived: the worker's blocks are dropped (they may be
             stale), and it is indexed afresh from its next events

Media: ``GPU`` (or none: vLLM's device default) and ``CPU``; others are not indexed. The
feed's thread applies batches while the router's loop looks prompts up: one lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from common.host import chain_keys, root_key
from common.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Lost,
)

logger = logging.getLogger(__name__)
ROOT = root_key(b"")
"""The parent of every chain's first block in the router's keys."""
MEDIA = (MEDIUM_GPU, MEDIUM_CPU)
_INT32 = (-(1 << 31), (1 << 31) - 1)


@dataclass
class _Medium:
    keys: dict[int, bytes] = field(default_factory=dict)
    """The worker's block hash -> the router's key."""
    blocks: set[bytes] = field(default_factory=set)
    """The router's keys of the blocks it holds."""


@dataclass(frozen=True)
class Match:
    """A prompt's leading blocks cached on one worker."""

    device: int = 0
    """Blocks on its device (``GPU``)."""
    cached: int = 0
    """Blocks on its device or in its host tier (``>= device``)."""


class PrefixIndex:
    """Per worker and medium, the blocks its events say it holds.

    Args:
        page_size: tokens per block; events of another block size are not indexed.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._lock = threading.Lock()
        self._workers: dict[str, dict[str, _Medium]] = {}
        self.num_events = self.num_dropped = self.num_resets = 0

    # -- the feed's side ---------------------------------------------------------------
    def apply(self, worker: str, item: tuple[int, EventBatch] | Lost) -> None:
        """One item of ``worker``'s stream (``EventFeed``), in order."""
        with self._lock:
            if isinstance(item, Lost):
                self._clear(worker)
                self.num_resets += 1
                return
            for event in item[1].events:
                self.num_events += 1
                if isinstance(event, BlockStored):
                    self._stored(worker, event)
                elif isinstance(event, BlockRemoved):
                    self._removed(worker, event)
                elif isinstance(event, AllBlocksCleared):
                    self._clear(worker)

    def _medium(self, worker: str, medium: str | None) -> _Medium | None:
        name = MEDIUM_GPU if medium is None else medium
        if name not in MEDIA:
            return None
        return self._workers.setdefault(worker, {m: _Medium() for m in MEDIA})[name]

    def _stored(self, worker: str, ev: BlockStored) -> None:
        m = self._medium(worker, ev.medium)
        parent = ROOT if ev.parent_block_hash is None else \
            (m.keys.get(ev.parent_block_hash) if m is not None else None)
        if m is None or parent is None or ev.block_size != self.page_size or \
                not _fits_int32(ev.token_ids):
            self.num_dropped += 1
            return
        data = np.asarray(ev.token_ids, dtype="<i4").tobytes()
        for h, key in zip(ev.block_hashes, chain_keys(parent, data, self.page_size)):
            m.keys[h] = key
            m.blocks.add(key)

    def _removed(self, worker: str, ev: BlockRemoved) -> None:
        m = self._medium(worker, ev.medium)
        if m is None:
            return
        for h in ev.block_hashes:
            key = m.keys.pop(h, None)
            if key is not None:
                m.blocks.discard(key)

    def _clear(self, worker: str) -> None:
        """Every block of ``worker`` gone (it stays known: its metrics show 0 blocks)."""
        self._workers[worker] = {m: _Medium() for m in MEDIA}

    # -- the router's side -------------------------------------------------------------
    def forget(self, worker: str) -> None:
        """Drop ``worker`` (lost, or registering again: its events start over)."""
        with self._lock:
            self._workers.pop(worker, None)

    def match(self, keys: Sequence[bytes], workers: Iterable[str]) -> dict[str, Match]:
        """For each of ``workers``, how many of ``keys`` (a prompt's chain, router keys)
        lead its caches."""
        with self._lock:
            return {w: self._match(keys, self._workers.get(w)) for w in workers}

    @staticmethod
    def _match(keys: Sequence[bytes], media: dict[str, _Medium] | None) -> Match:
        if media is None:
            return Match()
        device, host = media[MEDIUM_GPU].blocks, media[MEDIUM_CPU].blocks
        n_dev = n_any = 0
        for key in keys:
            on_device = key in device
            if not on_device and key not in host:
                break
            n_any += 1
            n_dev += on_device and n_dev == n_any - 1  # the device's own run from 0
        return Match(n_dev, n_any)

    def blocks(self) -> dict[str, dict[str, int]]:
        """Blocks indexed per worker and medium (metrics)."""
        with self._lock:
            return {w: {name: len(m.blocks) for name, m in media.items()}
                    for w, media in self._workers.items()}


def _fits_int32(tokens: list[int]) -> bool:
    return not tokens or (_INT32[0] <= min(tokens) and max(tokens) <= _INT32[1])
