"""Why pages are given back: the closed set of free reasons that the free log records.

Every free carries one. ``free_kv_row`` (and every other path that frees) refuses a
reason outside the set, before anything changes, so the log never holds a reason that
replay and metrics do not know. A request's end reason (``stop``, ``length``, a
transport failure code, ...) maps to its free reason with ``FreeReason.of_end``.
"""

from __future__ import annotations

from enum import Enum


class FreeReason(str, Enum):
    """The ``reason`` of a free-log ``free`` event."""

    FINISHED = "finished"
    """Decode (or colocated): the request generated its last token."""
    SENT = "sent"
    """Prefill: the decode acknowledged every page of the request."""
    ABORTED = "aborted"
    """A client abort, or the peer aborted the request."""
    TIMEOUT = "timeout"
    """A deadline passed (a transfer, a prefix load from the host tier)."""
    PEER_LOST = "peer_lost"
    """The KV peer went silent past its lease."""
    SPEC_REJECT = "spec_reject"
    """Speculative lookahead slots given back mid-request."""
    OFFLOADED = "offloaded"
    """Retraction: the row's committed KV went to the host tier."""
    EVICTED = "evicted"
    """A cache (host tier, sliding window) dropped pages it owned."""
    TRIMMED = "trimmed"
    """A request shortened its row (streaming, multi-turn trims)."""
    ERROR = "error"
    """Any other failure of the request."""
    MIGRATED = "migrated"
    """The router moved the request to another worker (its other worker died, or this
    one is draining): this attempt's row is given back, the request goes on elsewhere
    under a new id (docs/operations.md, "Migration")."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def check(cls, reason: FreeReason | str) -> FreeReason:
        """``reason`` as a ``FreeReason``.

        Raises:
            ValueError: not one of the free reasons (the message lists them).
        """
        try:
            return cls(reason)
        except ValueError:
            raise ValueError(f"free reason {reason!r} is not one of "
                             f"{[r.value for r in cls]}") from None

    @classmethod
    def of_end(cls, reason: str) -> FreeReason:
        """The free reason of a request that ended with ``reason``: ``stop`` and
        ``length`` are ``finished``, a free reason is itself, anything else (a transport
        error code, a peer's word) is ``error``."""
        if reason in ("stop", "length"):
            return cls.FINISHED
        try:
            return cls(reason)
        except ValueError:
            return cls.ERROR
