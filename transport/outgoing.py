"""Prefill-side state of one request in flight: its legs, pins, counters and transitions.

    blocks of the row (block = page = page_size positions)
    [0, cached)          decode holds these already (prefix cache): never sent
    [cached, sent)       framed and queued to every leg
    [sent, handed)       handed over by the worker and pinned, waiting for every leg's
                         registration (the prompt's last block also for ``finish``: its
                         message carries the first token)
    [handed, total)      not computed yet (a partial last page waits for ``finish``)

The request completes on this side when every block went out with the last message to
each leg and its own transfers report done (trackers, copies, NIXL writes): nobody sends
Done or Ack.

``Outgoing`` changes only through its methods; ``KvSender`` does the I/O they call for
(sending, pinning, unpinning, events).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from . import tp
from .channel import Completion
from .config import TransportConfig
from .integrity import unpack_epochs
from .limits import INT32_MAX
from .messages import ErrorCode, Hello, ProtocolError, Register, pages_from_bytes


class OutState(IntEnum):
    ASSEMBLING = 1   # waiting for every overlapping decode rank's Register
    STREAMING = 2    # every leg registered; chunks flow as the worker hands them over
    DRAINING = 3     # every block went out; waiting for our own transfers to report done
    CLOSED = 4       # final event emitted (or aborted here); removed once unpinned

    @property
    def is_final(self) -> bool:
        return self == OutState.CLOSED


@dataclass
class Leg:
    """One decode rank receiving (part of the heads of) this request."""

    peer: bytes
    heads: tuple[int, int]
    dest_pages: np.ndarray
    dest_epochs: np.ndarray
    name: str = ""
    digest: str = ""  # the leg's digest algorithm ("" integrity off)
    abort_acked: bool = False


@dataclass
class SendPin:
    """One ``KvCache`` pin over blocks ``[first, end)``, the sends that read them and
    the free-log entries of their messages, by leg."""

    pin_id: int
    first: int
    end: int
    flushed: bool = False
    completions: list[tuple[bytes, Completion]] = field(default_factory=list)
    entries: dict[bytes, list] = field(default_factory=dict)


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
    aborted: bool = False
    t_start: float = field(default_factory=time.monotonic)
    t_progress: float = field(default_factory=time.monotonic)
    t_first_hand: float = 0.0
    """When the worker first handed this request to the transport (0: not yet: the request
    still waits in the worker's queue)."""

    @property
    def handed(self) -> int:
        return len(self.src_pages)

    @property
    def abort_settled(self) -> bool:
        return all(leg.abort_acked for leg in self.legs.values())

    # -- admission -----------------------------------------------------------------------
    def add_leg(self, leg: Leg, prompt_len: int, cached_blocks: int, total_blocks: int,
                expected_legs: int) -> bool:
        """Record one decode rank's Register (the first fixes the shape); True once every
        overlapping rank registered."""
        if not self.legs:
            self.prompt_len, self.cached_blocks = prompt_len, cached_blocks
            self.total_blocks, self.expected_legs = total_blocks, expected_legs
            self.t_start = time.monotonic()
        self.legs[leg.peer] = leg
        return len(self.legs) == self.expected_legs

    def accept(self) -> None:
        self.state = OutState.STREAMING
        self.t_progress = time.monotonic()

    # -- streaming -----------------------------------------------------------------------
    def touched(self, now: float) -> None:
        """The worker handed (part of) the request over: it computes it now."""
        self.t_progress = now
        self.t_first_hand = self.t_first_hand or now

    def hand_over(self, pin_id: int, pages: np.ndarray) -> None:
        """The worker handed blocks ``[handed, handed + len(pages))``, pinned as ``pin_id``."""
        self.pins.append(SendPin(pin_id, self.handed, self.handed + len(pages)))
        self.src_pages = np.concatenate([self.src_pages, pages])

    def unsent(self) -> tuple[int, int]:
        """Blocks ``[first, end)`` handed over but not sent yet (empty unless STREAMING).
        The prompt's last block waits for ``finish``: its message is the completion."""
        if self.state != OutState.STREAMING:
            return 0, 0
        last = self.total_blocks if self.finished else self.total_blocks - 1
        return max(self.sent, self.cached_blocks), min(self.handed, last)

    def mark_sent(self, end: int) -> bool:
        """Blocks up to ``end`` are queued to every leg; True when the last went out now
        (the request drains: its completion is its own transfers')."""
        self.sent = max(self.sent, end)
        for pin in self.pins:
            pin.flushed = pin.flushed or pin.end <= max(self.sent, self.cached_blocks)
        if self.finished and self.sent >= self.total_blocks:
            self.state = OutState.DRAINING
            self.t_progress = time.monotonic()
            return True
        return False

    @property
    def drained(self) -> bool:
        """Every block went out and no transfer still reads a source page."""
        return self.state == OutState.DRAINING and not self.pins

    # -- ending --------------------------------------------------------------------------
    def legs_to_abort(self, is_live: Callable[[bytes], bool]) -> list[Leg]:
        """Legs that must be sent ``Abort``; legs of lost peers count as acknowledged."""
        todo = []
        for leg in self.legs.values():
            if not is_live(leg.peer):
                leg.abort_acked = True
            elif not leg.abort_acked:
                todo.append(leg)
        self.t_progress = time.monotonic()
        return todo

    def close(self, aborted: bool = False) -> None:
        self.state = OutState.CLOSED
        self.aborted = self.aborted or aborted

    def overdue(self, now: float, cfg: TransportConfig) -> str | None:
        """What deadline ran out, if any:

        - ``"admission"``: handed-over pages waited ``admission_timeout_s`` for every
          decode rank's registration;
        - ``"done"``: streaming took longer than ``done_timeout_s`` from the
          registrations (the request's overall deadline);
        - ``"progress"``: nothing handed over or sent for ``chunk_timeout_s`` once the
          worker handed over the first pages. A registered request the worker has not
          started yet waits in its own queue, bounded by the overall deadline only;
        - ``"abort_ack"``: a live leg did not acknowledge our abort in
          ``chunk_timeout_s``.
        """
        if self.state == OutState.ASSEMBLING and now - self.t_start > cfg.admission_timeout_s:
            return "admission"
        if self.state in (OutState.STREAMING, OutState.DRAINING):
            if now - self.t_start > cfg.done_timeout_s:
                return "done"
            if self.t_first_hand and now - self.t_progress > cfg.chunk_timeout_s:
                return "progress"
        if self.aborted and not self.abort_settled and (
                now - self.t_progress > cfg.chunk_timeout_s):
            return "abort_ack"
        return None

    def stop_waiting_for_abort_acks(self) -> None:
        for leg in self.legs.values():
            leg.abort_acked = True

    def releasable_pins(self, lost: Container[bytes]) -> list[SendPin]:
        """Pins that no live peer can still read; they leave ``pins``.

        A leg's completions are settled by its own transfer (the last frame's tracker, a
        synchronous copy, a NIXL write's ``DONE``) or by the peer's loss; after an abort,
        also by every live leg's ``AbortAck``. The request's COMPLETED follows in the poll
        that drops its last pin, so the worker's row free is immediate.
        """
        keep, free = [], []
        aborting = self.aborted and not self.abort_settled
        for pin in self.pins:
            busy = any(not done.done for key, done in pin.completions if key not in lost)
            unsent = not pin.flushed and not self.state.is_final
            if busy or unsent or aborting:
                keep.append(pin)
            else:
                free.append(pin)
        self.pins = keep
        return free

    @property
    def removable(self) -> bool:
        return self.state == OutState.CLOSED and not self.pins


def registered_leg(mine: Hello, key: bytes, theirs: Hello, msg: Register,
                   out: Outgoing | None, dest_limit: int | None) -> Leg:
    """The leg a decode rank's ``Register`` asks for, checked against the prompt's shape
    and the request's other legs.

    Args:
        dest_limit: pages of the decode pool we write into ourselves (shared memory);
            every destination page id must lie in ``[1, dest_limit)``.
    Raises:
        ProtocolError: page ids that do not cover the prompt (or repeat, or are 0 -
            reserved - or lie outside the pool we write), epochs that do not cover them,
            a misaligned prefix, ranks that disagree, or a rank that shares no heads with
            this one.
    """
    ps = mine.page_size
    dest = pages_from_bytes(msg.dest_pages, "Register.dest_pages")
    total = -(-msg.prompt_len // ps)
    if msg.prompt_len < 1 or len(dest) != total:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"prompt_len={msg.prompt_len} needs "
                            f"{total} dest pages, got {len(dest)}", msg.rid)
    high = INT32_MAX if dest_limit is None else dest_limit - 1
    if len(dest) and not 1 <= int(dest.min()) <= int(dest.max()) <= high:
        raise ProtocolError(ErrorCode.BAD_RANGE, f"dest pages {int(dest.min())}.."
                            f"{int(dest.max())} outside [1, {high}]", msg.rid)
    if len(np.unique(dest)) != len(dest):
        raise ProtocolError(ErrorCode.BAD_FIELD, "dest pages repeat a page", msg.rid)
    if msg.cached_tokens % ps or not 0 <= msg.cached_tokens <= msg.prompt_len:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"cached_tokens={msg.cached_tokens} "
                            f"must be page-aligned and <= prompt_len", msg.rid)
    if out is not None and out.legs and (out.prompt_len, out.cached_blocks * ps) != (
            msg.prompt_len, msg.cached_tokens):
        raise ProtocolError(ErrorCode.BAD_FIELD, "decode ranks disagree on prompt_len "
                            "or cached_tokens", msg.rid)
    heads = tp.overlap(mine.total_kv_heads, mine.tp_size, mine.tp_rank, theirs.tp_size,
                       theirs.tp_rank)
    if heads is None:
        raise ProtocolError(ErrorCode.BAD_RANGE, f"decode rank {theirs.tp_rank} shares no "
                            f"KV heads with prefill rank {mine.tp_rank}", msg.rid)
    epochs = unpack_epochs(msg.dest_epochs, len(dest), msg.rid)
    return Leg(key, heads, dest, epochs)
