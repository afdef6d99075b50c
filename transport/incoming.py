"""Decode-side state of one request being received: legs, destination pin, counters and
transitions.

    blocks of the row (block = page = page_size positions)
    [0, cached)        held already (prefix cache): never written by the transport
    [cached, total)    pinned from Register until every leg's last data message landed
                       (or, after an abort, until every live leg sent AbortAck or was lost)

A leg is complete when each of its blocks landed once and its last message (the one with
the first token) came; the request commits when every leg is. ``Incoming`` changes only
through its methods, which check what a peer says against the request (raising
``ProtocolError``); ``KvReceiver`` does the I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from .config import TransportConfig
from .integrity import unpack_epochs
from .messages import ErrorCode, KvChunk, KvWritten, ProtocolError


class InState(IntEnum):
    STREAMING = 2   # Register sent; data messages land until every leg completed
    CLOSED = 3      # final event emitted (or aborted locally); waiting to unpin


@dataclass
class InLeg:
    """One prefill rank sending heads ``heads`` (global numbering) of this request."""

    peer: bytes
    heads: tuple[int, int]
    name: str = ""
    digest: str = ""            # the leg's digest algorithm ("" integrity off)
    blocks_received: int = 0
    landed: np.ndarray | None = None   # bool per block of the row: landed from this leg
    done: bool = False
    first_token: int | None = None
    abort_acked: bool = False
    runs: list = field(default_factory=list)   # free-log entries of what landed


@dataclass
class Incoming:
    rid: str
    kv: object
    prompt_len: int
    cached_blocks: int
    dest_pages: np.ndarray          # int64 page ids of blocks [0, total)
    dest_epochs: np.ndarray         # uint64 epoch of each of them (as registered)
    pin_id: int | None
    legs: dict[bytes, InLeg] = field(default_factory=dict)
    state: InState = InState.STREAMING
    refused: list = field(default_factory=list)   # free-log entries of refused messages
    pending: list = field(default_factory=list)   # device digests still being computed
    t_start: float = field(default_factory=time.monotonic)
    t_progress: float = field(default_factory=time.monotonic)
    t_first_data: float = 0.0
    """When the first KV of any leg landed (0: none yet)."""

    def __post_init__(self) -> None:
        for leg in self.legs.values():
            leg.landed = np.zeros(self.total_blocks, dtype=bool)

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

    # -- what the legs send ---------------------------------------------------------------
    def leg_for_blocks(self, peer: bytes, msg: KvChunk | KvWritten) -> InLeg:
        """The leg whose blocks ``msg`` carries, once they are within the request, new, and
        travel with the epochs they were registered with.

        Raises:
            ProtocolError: ``bad_range`` for blocks outside ``[cached, total)``, heads other
                than the leg's, or blocks this leg sent already; ``stale_pages`` for epochs
                other than the registration's (a message of an older registration of this
                rid, or of another request).
        """
        leg = self.legs[peer]
        lo, hi = msg.first_block, msg.first_block + msg.num_blocks
        if (msg.head_start, msg.head_end) != leg.heads or msg.num_blocks < 1 or not (
                self.cached_blocks <= lo and hi <= self.total_blocks):
            raise ProtocolError(ErrorCode.BAD_RANGE, f"blocks [{lo}, {hi}) heads "
                                f"[{msg.head_start}, {msg.head_end}) outside blocks "
                                f"[{self.cached_blocks}, {self.total_blocks}) heads "
                                f"{leg.heads}", self.rid)
        if leg.landed[lo:hi].any():
            raise ProtocolError(ErrorCode.BAD_RANGE, f"blocks [{lo}, {hi}) sent twice",
                                self.rid)
        epochs = unpack_epochs(msg.epochs, hi - lo, self.rid)
        if not np.array_equal(epochs, self.dest_epochs[lo:hi]):
            i = int(np.flatnonzero(epochs != self.dest_epochs[lo:hi])[0])
            raise ProtocolError(ErrorCode.STALE_PAGES, f"block {lo + i} (page "
                                f"{int(self.dest_pages[lo + i])}) came with epoch "
                                f"{int(epochs[i])}, registered with "
                                f"{int(self.dest_epochs[lo + i])}", self.rid)
        return leg

    def count_blocks(self, leg: InLeg, msg: KvChunk | KvWritten) -> None:
        lo, hi = msg.first_block, msg.first_block + msg.num_blocks
        leg.landed[lo:hi] = True
        leg.blocks_received += msg.num_blocks
        if msg.first_token is not None:
            leg.first_token = msg.first_token
        self.t_progress = time.monotonic()
        if not self.t_first_data:
            self.t_first_data = self.t_progress

    def complete(self) -> int | None:
        """The first token once every leg's blocks all landed with its last message (and
        every device digest checked); None while any is missing.

        Raises:
            ProtocolError: the legs disagree on the first token.
        """
        want = self.total_blocks - self.cached_blocks
        for leg in self.legs.values():
            leg.done = leg.first_token is not None and leg.blocks_received == want
        if self.pending or not all(g.done for g in self.legs.values()):
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
        """What deadline ran out, if any:

        - ``"done"``: the whole transfer took longer than ``done_timeout_s`` from the
          registration (the request's overall deadline);
        - ``"progress"``: no data for ``chunk_timeout_s`` after some had come. Before the
          first data the request waits in its prefill's queue, which may be long under
          load: the prefill's lease (its heartbeats) says it is alive, and only the
          overall deadline bounds that wait;
        - ``"abort_ack"``: a live leg did not acknowledge our abort in
          ``chunk_timeout_s``.
        """
        if self.state == InState.STREAMING:
            if now - self.t_start > cfg.done_timeout_s:
                return "done"
            if self.t_first_data and now - self.t_progress > cfg.chunk_timeout_s:
                return "progress"
        if self.state == InState.CLOSED and not self.abort_settled and (
                now - self.t_progress > cfg.chunk_timeout_s):
            return "abort_ack"
        return None

    def stop_waiting_for_abort_acks(self) -> None:
        for leg in self.legs.values():
            leg.abort_acked = True

