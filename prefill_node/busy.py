"""The length of a union of time windows, in bounded memory.

A prefill streams several requests at once; the time some transfer was busy is the union
of each request's ``[first send, acknowledged)`` window. Windows are kept merged, and
those that end before a horizon (no window still to come can start earlier) fold into a
running total, so memory stays bounded by the requests in flight, not the run's length.
"""

from __future__ import annotations

import bisect


class BusyTime:
    """Seconds covered by the union of the windows added so far."""

    def __init__(self) -> None:
        self._folded = 0.0
        self._spans: list[tuple[float, float]] = []
        """Disjoint, sorted windows that a later window may still overlap."""

    def add(self, start: float, end: float, horizon: float = float("-inf")) -> None:
        """Add ``[start, end)``. ``horizon``: no window added later starts before it."""
        if end <= start:
            return
        i = bisect.bisect_left(self._spans, (start, start))
        if i and self._spans[i - 1][1] >= start:  # merge with the span on the left
            i -= 1
            start = self._spans[i][0]
        j = i
        while j < len(self._spans) and self._spans[j][0] <= end:
            end = max(end, self._spans[j][1])
            j += 1
        self._spans[i:j] = [(start, end)]
        done = 0
        while done < len(self._spans) and self._spans[done][1] <= horizon:
            self._folded += self._spans[done][1] - self._spans[done][0]
            done += 1
        del self._spans[:done]

    @property
    def seconds(self) -> float:
        return self._folded + sum(e - s for s, e in self._spans)

    @property
    def num_spans(self) -> int:
        """Windows still held (bounded by the requests in flight)."""
        return len(self._spans)
