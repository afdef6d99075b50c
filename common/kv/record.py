"""A request's KV row counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KvRecord:
    """Counters of one request's KV row; the page ids live in ``KvCache``'s row table.

    Invariant: ``protected_len <= allocated_len``, ``committed_len <= allocated_len``,
    ``swa_evicted_seqlen <= allocated_len``; checked by ``check()`` wherever they change.
    """

    owner: str
    """Who may free the row's pages: the request id."""
    row: int
    """Index of the row in the row table; -1 once the row is closed."""
    allocated_len: int = 0
    """Positions ``[0, allocated_len)`` have slots."""
    committed_len: int = 0
    """Positions ``[0, committed_len)`` hold verified KV (speculative lookahead excluded)."""
    swa_evicted_seqlen: int = 0
    """Sliding-window floor: positions below it hold no sliding-window pages any more."""
    protected_len: int = 0
    """Prefix ``[0, protected_len)`` owned by a cache; the request never frees it."""

    @property
    def is_open(self) -> bool:
        return self.row >= 0

    def check(self) -> None:
        assert 0 <= self.committed_len <= self.allocated_len, self
        assert 0 <= self.protected_len <= self.allocated_len, self
        assert 0 <= self.swa_evicted_seqlen <= self.allocated_len, self
