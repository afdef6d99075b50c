"""What ``poll`` hands back to a worker, and the lease each peer holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from .messages import Hello


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


@dataclass
class Peer:
    """A connected, handshaken peer and its lease."""

    key: bytes
    hello: Hello
    last_seen: float
    next_heartbeat: float = 0.0
    heartbeat_seq: int = 0
    lost: bool = False
    rids: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return f"{self.hello.node}[tp{self.hello.tp_rank}/{self.hello.tp_size}]"

    def expired(self, now: float) -> bool:
        return now - self.last_seen > self.hello.lease_ms / 1000.0
