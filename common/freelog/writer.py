"""Writing the free log (format version 1, see docs/freelog.md).

One file per pool-owning process incarnation: a msgpack header map, then one msgpack map
per event. Events are buffered in memory and written by a background thread at least
every ``FLUSH_INTERVAL_S`` and at close, so a crash loses at most the last tenth of a
second.

When the file refuses a write (a full disk, a file-size limit, an I/O error, a file
system remounted read-only) nothing is raised into the allocator: the writer cuts the
file back to its last whole record, keeps the records in memory (up to
``max_buffer_bytes``) and retries; ``health()`` says what failed, so that the worker can
stop admitting new work. When memory runs out, the buffered events are dropped and
counted, and once the file takes writes again a ``lost`` marker stands in for them.
Every record reaches the file at most once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import msgpack
import numpy as np

from common.freelog import health as _health
from common.freelog.health import LogHealth
from common.freelog.sink import LogFile, WriteError, describe

logger = logging.getLogger(__name__)


def freelog_file(log_dir: str | None, name: str) -> str | None:
    """``<log_dir>/<name>.freelog`` (the directory made first), or None without a
    ``log_dir``: every pool's log is named here, so ``pdkv run`` finds them all."""
    if not log_dir:
        return None
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    return str(Path(log_dir) / f"{name}.freelog")


FORMAT = "pdkv-freelog"
VERSION = 1
FLUSH_INTERVAL_S = 0.1
CLOSE_RETRY_S = 1.0
"""How long ``close`` keeps retrying a failing file before it gives the records up."""
MAX_BUFFER_BYTES = 64 << 20
_FLUSH_BYTES = 1 << 20
_settings = {"max_buffer_bytes": MAX_BUFFER_BYTES}


def configure(*, max_buffer_bytes: int | None = None) -> None:
    """Process-wide defaults for writers made from now on (a worker sets them from its
    config before it builds its pools)."""
    if max_buffer_bytes is not None:
        if max_buffer_bytes < 1:
            raise ValueError(f"max_buffer_bytes={max_buffer_bytes} must be >= 1")
        _settings["max_buffer_bytes"] = max_buffer_bytes


_INT32_LE = np.dtype("<i4")


def pages_to_bytes(pages: np.ndarray | Sequence[int]) -> bytes:
    """Page ids as the log stores them: little-endian int32."""
    if isinstance(pages, np.ndarray) and pages.dtype == _INT32_LE:
        return pages.tobytes()  # the allocator's arrays: skip the conversion
    return np.asarray(pages, dtype=_INT32_LE).tobytes()


class FreeLogWriter:
    """Append-only recorder of allocator events; safe to call from several threads.

    Args:
        path: file to create. An existing file is never touched: the log then goes to
            the next free incarnation name (``x.1.freelog``, ...); ``self.path`` says
            which. Parent folders are made.
        node: name of the process that owns the pools, for the reader.
        pools: ``{pool_name: {"num_pages": int, "page_size": int, "reserved": [int]}}``.
        max_buffer_bytes: records kept in memory while the file refuses writes; past it
            they are dropped (and a ``lost`` marker is written when the file works again).
            Default: ``configure``'s, 64 MiB unless changed.
        opener: makes the ``LogFile`` for a path (tests pass files that fail).

    Raises:
        OSError: the file cannot be created (read-only folder, permissions, ...).
    """

    def __init__(self, path: str | os.PathLike, *, node: str, pools: Mapping[str, Mapping],
                 max_buffer_bytes: int | None = None,
                 opener: Callable[[str], LogFile] = LogFile.create):
        self._file = opener(os.fspath(path))
        self.path = self._file.path
        self._packer = msgpack.Packer(use_bin_type=True)
        self._lock = threading.Lock()
        self._max_buffer = max_buffer_bytes = max_buffer_bytes or _settings["max_buffer_bytes"]
        self._spill = min(_FLUSH_BYTES, max_buffer_bytes)  # buffer size that triggers a write
        self._t0 = time.monotonic_ns()
        header = {"format": FORMAT, "version": VERSION, "node": node,
                  "pools": {name: dict(info) for name, info in pools.items()},
                  "created_unix_ns": time.time_ns(), "pid": os.getpid()}
        self._header: bytes | None = self._packer.pack(header)  # None once written
        self._buffer = bytearray()
        self._seq = 0
        self._buffer_first = 0  # seq of the first event in the buffer
        self._lost_first = self._lost_count = 0  # dropped events not yet marked in the file
        self._lost_error = ""
        self._num_lost = self._failures = 0
        self._error: OSError | None = None
        self._failing_since = 0.0
        self._broken = ""  # why the file can never be written again
        self._closed = False
        with self._lock:
            self._write_buffer()
        _health.register(self)
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="freelog-flush",
                                         daemon=True)
        self._flusher.start()

    @property
    def num_events(self) -> int:
        """Events recorded so far (the next event's ``seq``)."""
        return self._seq

    def health(self) -> LogHealth:
        """The writer's state now; ``ok`` is false while the file refuses writes."""
        with self._lock:
            failing = self._error is not None or bool(self._broken)
            error = self._broken or (describe(self._error) if self._error else "")
            return LogHealth(
                path=self.path, ok=not failing, error=error,
                failing_for_s=time.monotonic() - self._failing_since if failing else 0.0,
                buffered_bytes=len(self._buffer) + len(self._header or b""),
                lost_events=self._num_lost, failures=self._failures, closed=self._closed)

    # -- events -------------------------------------------------------------------------
    def alloc(self, pool: str, pages: np.ndarray, owner: str, epoch: int | None = None
              ) -> None:
        event = {"op": "alloc", "pool": pool, "pages": pages_to_bytes(pages), "owner": owner}
        if epoch is not None:
            event["epoch"] = int(epoch)
        self._append(event)

    def free(self, pool: str, pages: np.ndarray, owner: str, reason: str,
             ranges: Iterable[tuple[int, int]] | None = None) -> None:
        event = {"op": "free", "pool": pool, "pages": pages_to_bytes(pages), "owner": owner,
                 "reason": reason}
        if ranges is not None:
            event["ranges"] = [[int(s), int(e)] for s, e in ranges]
        self._append(event)

    def pin(self, pool: str, pages: np.ndarray, pin_id: int, reason: str) -> None:
        self._append({"op": "pin", "pool": pool, "pages": pages_to_bytes(pages),
                      "pin": pin_id, "reason": reason})

    def unpin(self, pool: str, pages: np.ndarray, pin_id: int,
              record: Mapping | None = None) -> None:
        """``record``: extra keys (``xfer``, ``digests``: what the pinned I/O moved and the
        digests it computed, docs/freelog.md); they may not replace the event's own."""
        event = {"op": "unpin", "pool": pool, "pages": pages_to_bytes(pages), "pin": pin_id}
        if record:
            clash = set(record) & {*event, "seq", "t_ns"}
            if clash:
                raise ValueError(f"unpin record may not set {sorted(clash)}")
            event.update(record)
        self._append(event)

    def release(self, pool: str, pages: np.ndarray) -> None:
        self._append({"op": "release", "pool": pool, "pages": pages_to_bytes(pages)})

    def handoff(self, pool: str, pages: np.ndarray, owner: str, to: str) -> None:
        self._append({"op": "handoff", "pool": pool, "pages": pages_to_bytes(pages),
                      "owner": owner, "to": to})

    def close(self, retained: Sequence[str] = ()) -> None:
        """Write the ``close`` event, flush and close the file. Idempotent, never raises
        for the file's sake: if the file still refuses writes after ``CLOSE_RETRY_S``,
        the unwritten events are counted as lost and ``health()`` says so."""
        if self._closed:
            return
        self._append({"op": "close", "pool": "", "pages": b"", "retained": list(retained)})
        self._stop.set()
        self._flusher.join()
        with self._lock:
            self._closed = True  # nothing appends any more; the flusher has stopped
        deadline = time.monotonic() + CLOSE_RETRY_S
        while True:
            with self._lock:
                done = self._write_buffer()
            if done or self._broken or time.monotonic() >= deadline:
                break
            time.sleep(FLUSH_INTERVAL_S)
        with self._lock:
            if not done:
                self._num_lost += self._seq - self._buffer_first
                logger.error("free log %s: closed with %d event(s) lost in all, the last "
                             "ones never written (%s); the file ends early", self.path,
                             self._num_lost, self._broken or describe(self._error))
                self._buffer.clear()
            self._file.close()
            complete = self._error is None and not self._broken and not self._num_lost
        if complete:
            _health.unregister(self)

    # -- internals ----------------------------------------------------------------------
    def _append(self, event: dict) -> None:
        """Number, stamp and buffer one event (the map's key order does not matter)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"free log {self.path} is closed; cannot record "
                                   f"{event['op']!r}")
            event["seq"] = self._seq
            event["t_ns"] = time.monotonic_ns() - self._t0
            self._seq += 1
            self._buffer += self._packer.pack(event)
            if len(self._buffer) >= self._spill:
                if self._error is None:
                    self._write_buffer()
                if self._error is not None and len(self._buffer) > self._max_buffer:
                    self._drop_buffer()

    def _write_buffer(self) -> bool:
        """Header, pending ``lost`` marker, then the buffered events; True when all are in
        the file. Called with the lock held."""
        if self._broken:
            return False
        if self._header is not None:
            if not self._write(self._header):
                return False
            self._header = None
        if self._lost_count:
            if not self._write(self._lost_marker()):
                return False
            self._lost_count = 0
        if self._buffer:
            if not self._write(self._buffer):
                return False
            self._buffer.clear()
        self._buffer_first = self._seq
        if self._error is not None:
            self._recovered()
        return True

    def _write(self, data: bytes | bytearray) -> bool:
        """One whole-records write; on failure the file is cut back to where it was."""
        base = self._file.size
        try:
            self._file.write_all(data)
            return True
        except WriteError as exc:
            failure = exc.cause
            if exc.written:
                self._cut_back(base)
        except OSError as exc:
            failure = exc
        failure = failure.with_traceback(None)  # kept for health(): no frames, no buffers
        if self._error is None:
            self._failed(failure)
        else:
            self._error = failure  # the newest cause is the one to report
        return False

    def _cut_back(self, base: int) -> None:
        try:
            self._file.truncate(base)
        except OSError as exc:
            # A half-written record would make the rest of the file unreadable: stop.
            self._broken = (f"cannot cut the file back after a partial write "
                            f"({describe(exc)}); nothing more is written to it")
            logger.error("free log %s: %s", self.path, self._broken)

    def _failed(self, exc: OSError) -> None:
        self._error, self._failing_since = exc, time.monotonic()
        self._failures += 1
        logger.error("free log %s: write failed (%s); keeping up to %d KiB of events in "
                     "memory and retrying", self.path, describe(exc), self._max_buffer >> 10)

    def _recovered(self) -> None:
        logger.warning("free log %s: writing again after %.1f s (%s); %d event(s) lost "
                       "in all", self.path, time.monotonic() - self._failing_since,
                       describe(self._error), self._num_lost)
        self._error = None

    def _drop_buffer(self) -> None:
        """Memory is full: give the buffered events up and remember where they were."""
        count = self._seq - self._buffer_first
        if not self._lost_count:
            self._lost_first = self._buffer_first
        self._lost_count += count
        self._lost_error = describe(self._error)
        self._num_lost += count
        self._buffer.clear()
        self._buffer_first = self._seq
        if self._lost_count == count:  # the first drop of this stretch; later ones add up
            logger.error("free log %s: dropping events (more than %d KiB waiting while the "
                         "file refuses writes: %s); a lost marker will say how many",
                         self.path, self._max_buffer >> 10, self._lost_error)

    def _lost_marker(self) -> bytes:
        """The ``lost`` event: it takes the seq of the first lost event and stands in for
        ``count`` of them, so the next event's seq is ``seq + count``."""
        return self._packer.pack({
            "seq": self._lost_first, "t_ns": time.monotonic_ns() - self._t0, "op": "lost",
            "pool": "", "pages": b"", "count": self._lost_count, "error": self._lost_error})

    def _flush_loop(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL_S):
            with self._lock:
                if self._closed:
                    continue
                if not self._write_buffer() and len(self._buffer) > self._max_buffer:
                    self._drop_buffer()
