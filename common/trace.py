"""A benchmark-only hop trace: when each process touched a request, on one clock.

``pdkv bench hops`` sets ``PDKV_TRACE_DIR`` for the deployment it launches; each process
then keeps ``(t_ns, point, rid)`` marks in memory and writes them to
``<dir>/<pid>.trace`` (msgpack) when it exits. ``CLOCK_MONOTONIC`` is one clock for
every process of a host, so marks of the router, the prefill, the decode and the
client compare directly (``time.monotonic()`` is the same clock).

Off (the default) a mark is one global check: nothing is kept or written. Marks never
travel in messages, so a trace changes nothing a peer sees.
"""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path

import msgpack

ENV = "PDKV_TRACE_DIR"
MAX_MARKS = 1 << 20
"""At most this many marks per process (about 100 MB); later ones are dropped."""

_dir = os.environ.get(ENV, "")
_marks: list[tuple[int, str, str]] = []


def enabled() -> bool:
    return bool(_dir)


def mark(point: str, rid: str, t_ns: int = 0) -> None:
    """Note that this process reached ``point`` for ``rid`` (now, or at ``t_ns``)."""
    if _dir and len(_marks) < MAX_MARKS:
        _marks.append((t_ns or time.monotonic_ns(), point, rid))


def now_ns() -> int:
    """A timestamp for a later ``mark(..., t_ns=)`` (0 when tracing is off: free)."""
    return time.monotonic_ns() if _dir else 0


def flush() -> None:
    """Write the marks kept so far to ``<dir>/<pid>.trace`` (appending) and forget them."""
    if not _dir or not _marks:
        return
    Path(_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(_dir) / f"{os.getpid()}.trace", "ab") as f:
        f.write(msgpack.packb(_marks, use_bin_type=True))
    _marks.clear()


def read(directory: str | Path) -> list[tuple[int, str, str]]:
    """Every mark that the processes wrote under ``directory``, sorted by time."""
    out: list[tuple[int, str, str]] = []
    for path in sorted(Path(directory).glob("*.trace")):
        with open(path, "rb") as f:
            for chunk in msgpack.Unpacker(f, raw=False):
                out.extend((int(t), str(p), str(r)) for t, p, r in chunk)
    out.sort()
    return out


atexit.register(flush)
