"""Writing the free log (format version 1, see docs/freelog.md).

One file per pool-owning process: a msgpack header map, then one msgpack map per event.
Events are buffered in memory and flushed by a background thread at least every
``FLUSH_INTERVAL_S`` and at close, so a crash loses at most the last tenth of a second.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

import msgpack
import numpy as np

FORMAT = "pdkv-freelog"
VERSION = 1
FLUSH_INTERVAL_S = 0.1
_FLUSH_BYTES = 1 << 20


_INT32_LE = np.dtype("<i4")


def pages_to_bytes(pages: np.ndarray | Sequence[int]) -> bytes:
    """Page ids as the log stores them: little-endian int32."""
    if isinstance(pages, np.ndarray) and pages.dtype == _INT32_LE:
        return pages.tobytes()  # the allocator's arrays: skip the conversion
    return np.asarray(pages, dtype=_INT32_LE).tobytes()


class FreeLogWriter:
    """Append-only recorder of allocator events; safe to call from several threads.

    Args:
        path: file to create (truncated if it exists; parent folders are made).
        node: name of the process that owns the pools, for the reader.
        pools: ``{pool_name: {"num_pages": int, "page_size": int, "reserved": [int]}}``.
    """

    def __init__(self, path: str | os.PathLike, *, node: str, pools: Mapping[str, Mapping]):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = os.fspath(path)
        self._file = open(self.path, "wb")
        self._packer = msgpack.Packer(use_bin_type=True)
        self._lock = threading.Lock()
        self._buffer = bytearray()
        self._seq = 0
        self._closed = False
        self._t0 = time.monotonic_ns()
        header = {"format": FORMAT, "version": VERSION, "node": node,
                  "pools": {name: dict(info) for name, info in pools.items()},
                  "created_unix_ns": time.time_ns()}
        self._file.write(self._packer.pack(header))
        self._file.flush()
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="freelog-flush",
                                         daemon=True)
        self._flusher.start()

    @property
    def num_events(self) -> int:
        """Events recorded so far (the next event's ``seq``)."""
        return self._seq

    # -- events -------------------------------------------------------------------------
    def alloc(self, pool: str, pages: np.ndarray, owner: str) -> None:
        self._append({"op": "alloc", "pool": pool, "pages": pages_to_bytes(pages),
                      "owner": owner})

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

    def unpin(self, pool: str, pages: np.ndarray, pin_id: int) -> None:
        self._append({"op": "unpin", "pool": pool, "pages": pages_to_bytes(pages),
                      "pin": pin_id})

    def release(self, pool: str, pages: np.ndarray) -> None:
        self._append({"op": "release", "pool": pool, "pages": pages_to_bytes(pages)})

    def handoff(self, pool: str, pages: np.ndarray, owner: str, to: str) -> None:
        self._append({"op": "handoff", "pool": pool, "pages": pages_to_bytes(pages),
                      "owner": owner, "to": to})

    def close(self, retained: Sequence[str] = ()) -> None:
        """Write the ``close`` event, flush and close the file. Idempotent."""
        if self._closed:
            return
        self._append({"op": "close", "pool": "", "pages": b"", "retained": list(retained)})
        self._stop.set()
        self._flusher.join()
        with self._lock:
            self._closed = True
            self._write_buffer()
            self._file.close()

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
            if len(self._buffer) >= _FLUSH_BYTES:
                self._write_buffer()

    def _write_buffer(self) -> None:
        if self._buffer:
            self._file.write(self._buffer)
            self._file.flush()
            self._buffer.clear()

    def _flush_loop(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL_S):
            with self._lock:
                if not self._closed:
                    self._write_buffer()
