"""Decode-side state of one request being received: legs, destination pin, counters and
transitions.

    blocks of the row (block = page = page_size positions)
    [0, cached)        held already (prefix cache): never written by the transport
    [cached, total)    pinned from Announce until every leg sent Done (or, after an
                       abort, until every live leg sent AbortAck or was lost)

``Incoming`` changes only through its methods, which check what a peer says against the
request (raising ``ProtocolError``); ``KvReceiver`` does the I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from .config import TransportConfig
from .messages import Done, ErrorCode, KvChunk, KvWritten, ProtocolError


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
    t_first_data: float = 0.0
    """When the first KV of any leg landed (0: none yet)."""

    @property
    def total_blocks(self) -> int:
        return len(self.dest_pages)

    @property
    def abort_settled(self) -> bool:
        return all(leg.abort_acked or leg.done for leg in self.legs.values())

    @property
    def releasable(self) -> bool:
        """Closed, and no leg can still write into the destination pages."""
        return self.state == InState.CLOSED and self.abort_settled

    # -- what the legs say ----------------------------------------------------------------
    def accept(self, peer: bytes) -> None:
        self.legs[peer].accepted = True
        self.t_progress = time.monotonic()
        if all(g.accepted for g in self.legs.values()):
            self.state = InState.STREAMING

    def leg_for_blocks(self, peer: bytes, msg: KvChunk | KvWritten) -> InLeg:
        """The leg whose blocks ``msg`` carries, once they are within the request.

        Raises:
            ProtocolError: blocks outside ``[cached, total)`` or heads other than the leg's.
        """
        leg = self.legs[peer]
        lo, hi = msg.first_block, msg.first_block + msg.num_blocks
        if (msg.head_start, msg.head_end) != leg.heads or msg.num_blocks < 1 or not (
                self.cached_blocks <= lo and hi <= self.total_blocks):
            raise ProtocolError(ErrorCode.BAD_RANGE, f"blocks [{lo}, {hi}) heads "
                                f"[{msg.head_start}, {msg.head_end}) outside blocks "
                                f"[{self.cached_blocks}, {self.total_blocks}) heads "
                                f"{leg.heads}", self.rid)
        return leg

    def count_blocks(self, leg: InLeg, num_blocks: int) -> None:
        leg.blocks_received += num_blocks
        self.t_progress = time.monotonic()
        if not self.t_first_data:
            self.t_first_data = self.t_progress

    def done(self, peer: bytes, msg: Done) -> int | None:
        """Leg ``peer`` sent everything; the first token once every leg did.

        Raises:
            ProtocolError: the leg's block count is wrong, or the legs disagree on the
                first token.
        """
        leg = self.legs[peer]
        self.t_progress = time.monotonic()
        want = self.total_blocks - self.cached_blocks
        if msg.num_blocks != want or leg.blocks_received != want:
            raise ProtocolError(ErrorCode.BAD_RANGE, f"Done after {leg.blocks_received} "
                                f"blocks (says {msg.num_blocks}), expected {want}", self.rid)
        leg.done, leg.first_token = True, msg.first_token
        if not all(g.done for g in self.legs.values()):
            return None
        tokens = {g.first_token for g in self.legs.values()}
        if len(tokens) != 1:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"prefill ranks disagree on the first "
                                f"token: {sorted(tokens)}", self.rid)
        return tokens.pop()

    # -- ending --------------------------------------------------------------------------
    def legs_to_abort(self, is_live: Callable[[bytes], bool]) -> list[bytes]:
        """Legs that must be sent ``Abort``; lost or finished legs count as stopped."""
        todo = []
        for key, leg in self.legs.items():
            if not is_live(key) or leg.done:
                leg.abort_acked = True
            elif not leg.abort_acked:
                todo.append(key)
        self.t_progress = time.monotonic()
        return todo

    def close(self) -> None:
        self.state = InState.CLOSED

    def overdue(self, now: float, cfg: TransportConfig) -> str | None:
        """What deadline ran out (``"admission"``, ``"progress"``, ``"abort_ack"``), if any."""
        if self.state == InState.ANNOUNCED and now - self.t_start > cfg.admission_timeout_s:
            return "admission"
        if self.state == InState.STREAMING and (now - self.t_progress > cfg.chunk_timeout_s
                                                or now - self.t_start > cfg.done_timeout_s):
            return "progress"
        if self.state == InState.CLOSED and not self.abort_settled and (
                now - self.t_progress > cfg.chunk_timeout_s):
            return "abort_ack"
        return None

    def stop_waiting_for_abort_acks(self) -> None:
        for leg in self.legs.values():
            leg.abort_acked = True
