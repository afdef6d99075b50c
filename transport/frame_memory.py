"""Keep the memory of received data frames mapped from one frame to the next.

ZMQ's I/O thread mallocs a buffer for every frame it receives (8 MiB by default), and the
receiver frees it once the frame has landed in the pool. glibc's default rules give that
memory back to the kernel: a freed block above the mmap threshold is unmapped at once, and
a heap whose free top exceeds the trim threshold (twice the mmap threshold, which glibc
raises on the fly to the largest block freed, so about 16 MiB here) is shrunk. Either way
the next frame lands in fresh memory, and the I/O thread faults in and zeroes each of its
4 KiB pages while it reads the socket. On the 2-core box that was 2,000-10,000 faults per
128 MiB request and most of the tcp path's gap to raw pyzmq at 1k tokens
(docs/benchmarks.md).

Fixing both thresholds (mmap at 32 MiB, the ceiling of glibc's own dynamic rule; trim at
128 MiB) keeps a frame's buffer in the heap for the next one. The setting is process-wide,
so a decode endpoint makes it once (``TransportConfig.keep_frame_memory``); the heaps then
hold what the frames in flight peaked at. With another C library it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size come from the heaps (frames of up to 32 MiB stay warm)."""
TRIM_THRESHOLD = 128 << 20
"""Free memory at a heap's top is given back to the kernel only above this."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_kept: bool | None = None


def keep_frame_memory() -> bool:
    """Set glibc's malloc thresholds (once per process).

    Returns:
        whether they are set: False with another C library or when glibc refused.
    """
    global _kept
    if _kept is None:
        _kept = _set_thresholds()
        logger.debug("malloc thresholds for frames: %s", "set" if _kept else "unchanged")
    return _kept


def _set_thresholds() -> bool:
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mmap first: setting either turns glibc's dynamic rule off, and with a trim
    # threshold alone every 8 MiB frame would be mmapped and unmapped again
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
