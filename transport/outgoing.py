"""Prefill-side state of one request in flight: its legs, pins and counters.

    blocks of the row (block = page = page_size positions)
    [0, cached)          decode holds these already (prefix cache): never sent
    [cached, sent)       framed and queued to every leg
    [sent, handed)       handed over by the worker and pinned, waiting for Accepted
    [handed, total)      not computed yet (a partial last page waits for ``finish``)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from .channel import Completion


class OutState(IntEnum):
    ASSEMBLING = 1   # waiting for every overlapping decode rank's Announce
    STREAMING = 2    # Accepted sent; chunks flow as the worker hands them over
    DONE_SENT = 3    # Done sent to every leg; waiting for their Ack
    ABORTING = 4     # Abort sent or received; waiting for AbortAck / local I/O
    CLOSED = 5       # final event emitted; removed once its pins are released

    @property
    def is_final(self) -> bool:
        return self >= OutState.ABORTING


@dataclass
class Leg:
    """One decode rank receiving (part of the heads of) this request."""

    peer: bytes
    heads: tuple[int, int]
    dest_pages: np.ndarray
    acked: bool = False
    abort_acked: bool = False


@dataclass
class SendPin:
    """One ``KvCache`` pin over blocks ``[first, end)`` and the sends that read them."""

    pin_id: int
    first: int
    end: int
    flushed: bool = False
    completions: list[tuple[bytes, Completion]] = field(default_factory=list)


@dataclass
class Outgoing:
    rid: str
    kv: object | None = None
    state: OutState = OutState.ASSEMBLING
    legs: dict[bytes, Leg] = field(default_factory=dict)
    expected_legs: int = 0
    prompt_len: int = -1
    cached_blocks: int = 0
    total_blocks: int = 0
    src_pages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    sent: int = 0
    finished: bool = False
    first_token: int = 0
    pins: list[SendPin] = field(default_factory=list)
    t_start: float = field(default_factory=time.monotonic)
    t_progress: float = field(default_factory=time.monotonic)

    @property
    def handed(self) -> int:
        return len(self.src_pages)

    @property
    def abort_settled(self) -> bool:
        return all(leg.abort_acked for leg in self.legs.values())
