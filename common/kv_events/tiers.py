"""A worker's caches as KV events: a prefix cache's listener that publishes its entries.

A ``TierEvents`` is a ``common.host.CacheListener``: told of entries stored and evicted
(inside the cache's lock, in the cache's order), it queues them on the publisher as they
are. The hashing and the token lists of vLLM's format are built on the publisher's
thread (``events()``), never in the worker's loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common.kv_events.publisher import EventPublisher
from common.kv_events.wire import BlockRemoved, BlockStored, Event, external_hash


class TierEvents:
    """Publishes one cache's entries as events of ``medium``.

    Args:
        publisher: the worker's publisher.
        block_size: tokens per page of the cache (the pool's page size).
        medium: ``MEDIUM_CPU`` for the host tier.
    """

    def __init__(self, publisher: EventPublisher, block_size: int, medium: str) -> None:
        self.publisher, self.block_size, self.medium = publisher, block_size, medium

    def stored(self, keys: Sequence[bytes], parent: bytes | None, tokens: np.ndarray
               ) -> None:
        self.publisher.publish(_Stored(list(keys), parent, tokens, self.block_size,
                                       self.medium))

    def removed(self, keys: Sequence[bytes]) -> None:
        self.publisher.publish(_Removed(list(keys), self.medium))


class _Stored:
    def __init__(self, keys: list[bytes], parent: bytes | None, tokens: np.ndarray,
                 block_size: int, medium: str) -> None:
        self.keys, self.parent, self.tokens = keys, parent, tokens
        self.block_size, self.medium = block_size, medium

    def events(self) -> list[Event]:
        parent = None if self.parent is None else external_hash(self.parent)
        return [BlockStored([external_hash(k) for k in self.keys], parent,
                            self.tokens.tolist(), self.block_size, None, self.medium)]


class _Removed:
    def __init__(self, keys: list[bytes], medium: str) -> None:
        self.keys, self.medium = keys, medium

    def events(self) -> list[Event]:
        return [BlockRemoved([external_hash(k) for k in self.keys], self.medium)]
