"""Is this process's free log telling the whole story? ``LogHealth`` and ``log_problems``.

A worker asks ``log_problems()`` in its loop: any writer of this process that cannot
write now (``ok`` false), or that lost events, is listed, and the worker stops admitting
new work while one cannot write (docs/freelog.md, "When the disk fails").
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import asdict, dataclass
from typing import Protocol


@dataclass(frozen=True)
class LogHealth:
    """One free-log writer's state, as a value (safe to send in stats)."""

    path: str
    ok: bool
    """The last write succeeded (or nothing failed yet)."""
    error: str = ""
    """Why writing fails now, e.g. ``ENOSPC (No space left on device)``; empty when ok."""
    failing_for_s: float = 0.0
    """Seconds since the current failure began (0 when ok)."""
    buffered_bytes: int = 0
    """Records kept in memory, not yet in the file."""
    lost_events: int = 0
    """Events dropped so far (the log says where with ``lost`` markers, when it can)."""
    failures: int = 0
    """Write failures so far (each a stretch of time the file refused writes)."""
    closed: bool = False

    @property
    def complete(self) -> bool:
        """Every event so far is in the file or will be (nothing lost, writing works)."""
        return self.ok and not self.lost_events

    def summary(self) -> str:
        if self.complete:
            return f"free log {self.path}: ok"
        state = f"failing for {self.failing_for_s:.1f}s: {self.error}" if not self.ok \
            else "writing again"
        return (f"free log {self.path}: {state}; {self.lost_events} event(s) lost, "
                f"{self.buffered_bytes} byte(s) waiting in memory")

    def to_dict(self) -> dict:
        return asdict(self)


class _HasHealth(Protocol):
    def health(self) -> LogHealth: ...


_lock = threading.Lock()
_writers: weakref.WeakSet = weakref.WeakSet()


def register(writer: _HasHealth) -> None:
    """Track ``writer`` (the writer calls it; closed healthy writers ``unregister``)."""
    with _lock:
        _writers.add(writer)


def unregister(writer: _HasHealth) -> None:
    with _lock:
        _writers.discard(writer)


def log_problems() -> list[LogHealth]:
    """Health of this process's writers that cannot write now or have lost events.

    Writers that closed cleanly drop out; one that closed with events unwritten stays, so
    that a worker's final stats still name it.
    """
    with _lock:
        writers = list(_writers)
    return sorted((h for h in (w.health() for w in writers) if not h.complete),
                  key=lambda h: h.path)
