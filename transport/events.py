"""What ``poll`` hands back to a worker."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import IntEnum


class EventKind(IntEnum):
    """Ordered by a request's life; ``is_final`` kinds end the request on this side."""

    READY = 1        # prefill: every decode rank announced rid; start (or keep) sending
    COMPLETED = 2    # prefill: decode acknowledged everything; decode: KV + first token in
    ABORTED = 3      # the peer aborted rid (reason is what it sent, usually "aborted")
    FAILED = 4       # timeout, peer_lost or error on rid
    PEER_LOST = 5    # a peer went silent past its lease or said Bye (rid is empty)
    HANDSHAKE_FAILED = 6  # a peer's Hello did not match ours (detail names the field)

    @property
    def is_final(self) -> bool:
        return self in (EventKind.COMPLETED, EventKind.ABORTED, EventKind.FAILED)


@dataclass(frozen=True)
class Event:
    """One thing that happened; for a final kind, ``reason`` is the free reason to use.

    The transport never frees rows: on a final event the worker calls
    ``free_kv_row(kv, ranges, reason=event.reason)`` (prefill: ``"sent"`` on COMPLETED,
    decode keeps its row on COMPLETED). Pins the transport still holds keep the pages out
    of reuse until the peer can no longer touch them, so freeing at once is safe.
    """

    kind: EventKind
    rid: str = ""
    reason: str = ""
    detail: str = ""
    first_token: int | None = None
    prompt_len: int = 0
    cached_tokens: int = 0
    peer: str = ""
    path: str = ""
    """COMPLETED: the data path the KV took (shm, tcp, ipc, nixl; ``+``-joined when a
    request's legs took several)."""
    kv_pages: int = 0
    """Decode COMPLETED: pages this rank received for the request (its cached prefix not)."""
    kv_bytes: int = 0
    """Decode COMPLETED: bytes this rank received for the request."""
    xfer_s: float = 0.0
    """Decode COMPLETED: its first KV received to its last (0: nothing was sent)."""


class EventLog:
    """The events an endpoint owes its worker, counted under ``events.<kind>``."""

    def __init__(self, stats: Counter):
        self.stats = stats
        self._events: list[Event] = []

    def emit(self, kind: EventKind, rid: str = "", **kw) -> None:
        self.add(Event(kind, rid, **kw))

    def add(self, event: Event) -> None:
        self._events.append(event)
        self.stats[f"events.{event.kind.name.lower()}"] += 1

    def take(self) -> list[Event]:
        """Every event since the last call, oldest first."""
        events, self._events = self._events, []
        return events
