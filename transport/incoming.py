"""Decode-side state of one request being received: legs, destination pin, counters.

    blocks of the row (block = page = page_size positions)
    [0, cached)        held already (prefix cache): never written by the transport
    [cached, total)    pinned from Announce until every leg sent Done (or, after an
                       abort, until every live leg sent AbortAck or was lost)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np


class InState(IntEnum):
    ANNOUNCED = 1   # Announce sent; waiting for Accepted from every leg
    STREAMING = 2   # chunks arrive; waiting for Done from every leg
    CLOSED = 3      # final event emitted (or aborted locally); waiting to unpin


@dataclass
class InLeg:
    """One prefill rank sending heads ``heads`` (global numbering) of this request."""

    peer: bytes
    heads: tuple[int, int]
    accepted: bool = False
    blocks_received: int = 0
    done: bool = False
    first_token: int | None = None
    abort_acked: bool = False


@dataclass
class Incoming:
    rid: str
    kv: object
    prompt_len: int
    cached_blocks: int
    dest_pages: np.ndarray          # int64 page ids of blocks [0, total)
    pin_id: int | None
    legs: dict[bytes, InLeg] = field(default_factory=dict)
    state: InState = InState.ANNOUNCED
    t_start: float = field(default_factory=time.monotonic)
    t_progress: float = field(default_factory=time.monotonic)

    @property
    def total_blocks(self) -> int:
        return len(self.dest_pages)

    @property
    def abort_settled(self) -> bool:
        return all(leg.abort_acked or leg.done for leg in self.legs.values())
