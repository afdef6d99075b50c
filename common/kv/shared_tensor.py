"""Tensors in named POSIX shared memory, so a peer process on the same host can map a pool.

The creator owns the segment and unlinks it at ``close`` (Python's resource tracker also
unlinks it if the creator dies alone; one killed with its process group takes the tracker
with it, and ``common.kv.segments.reclaim_orphans`` unlinks what it left: segments are
named after their deployment, worker and owner process, ``segments.segment_name``).
A process that attaches maps ``/dev/shm/<name>`` itself
(Linux): attaching through ``SharedMemory`` would register the name with a resource
tracker that the creator may share (processes spawned by one parent do), and undoing
that registration would drop the creator's own, leaking the segment if it crashes.

A segment starts with a header page: magic, a random 16-byte ``token`` and the tensor's
size; the tensor follows at ``HEADER_BYTES``. Attaching takes the name *and* the token and
refuses (``SegmentError``), before mapping anything, a name that is not a plain segment
name (no ``/``, no ``..``), a symlink or non-regular file, a file owned by another user
or writable by group or others, a size other than exactly header + tensor, a foreign
header or a wrong token. So a process that only knows a segment's name (names are listed
in ``/dev/shm`` for everyone) cannot make another process map and write it.
"""

from __future__ import annotations

import errno
import hmac
import math
import mmap
import os
import re
import secrets
import stat
from multiprocessing import shared_memory

import torch

from common.kv.segments import MAGIC, segment_name

HEADER_BYTES = 4096  # keeps the tensor page-aligned
TOKEN_BYTES = 16
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")


class SegmentError(ValueError):
    """A segment that may not be mapped: bad name, wrong file, size, header or token."""


def valid_segment_name(name: str) -> bool:
    """A bare POSIX shared-memory name: letters, digits, ``_.-``, no path, no ``..``."""
    return bool(_NAME.fullmatch(name)) and ".." not in name


class SharedTensor:
    """A CPU tensor backed by a named shared-memory segment.

    Args:
        shape, dtype: of the tensor.
        name: ``None`` creates a new zero-filled segment with a fresh ``token``, named
            ``<stem>.<pid>-<start>.<random>``; a name attaches to an existing one, which
            must carry ``token``.
        stem: a new segment's name stem (``segments.segment_stem``: deployment, worker).
    Raises:
        SegmentError: attaching to a segment that fails a check (see the module).
        FileNotFoundError: no segment of that name (on this host's ``/dev/shm``).
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, name: str | None = None,
                 token: bytes = b"", stem: str = "pdkv.local.node"):
        if any(d < 0 for d in shape):
            raise ValueError(f"SharedTensor shape {shape} has a negative dimension")
        nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        self.owner = name is None
        if self.owner:
            self._shm = shared_memory.SharedMemory(segment_name(stem), create=True,
                                                   size=HEADER_BYTES + nbytes)
            self.name, buffer = self._shm.name, self._shm.buf
            self.token = secrets.token_bytes(TOKEN_BYTES)
            buffer[:len(MAGIC) + TOKEN_BYTES + 8] = (MAGIC + self.token
                                                     + nbytes.to_bytes(8, "little"))
        else:
            self._shm, self.name, self.token = None, name, token
            buffer = self._map = _attach(name, nbytes, token)
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=HEADER_BYTES) \
            if nbytes else torch.zeros(0, dtype=torch.uint8)
        self.tensor = flat.view(dtype).view(shape)

    def close(self) -> None:
        """Drop the mapping (and the segment, for its creator). The tensor is unusable after."""
        self.tensor = None
        try:
            self._shm.close() if self.owner else self._map.close()
        except BufferError:  # a view of the buffer is still alive somewhere: leave it mapped
            pass
        if self.owner:
            self._shm.unlink()
            self.owner = False


def _attach(name: str, nbytes: int, token: bytes) -> mmap.mmap:
    """Map an existing segment after checking it (no resource tracker involved)."""
    if not valid_segment_name(name):
        raise SegmentError(f"{name!r} is not a shared-memory segment name")
    try:  # O_NOFOLLOW: a symlink planted in /dev/shm is refused, not followed
        fd = os.open(os.path.join("/dev/shm", name),
                     os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise FileNotFoundError(errno.ENOENT, f"no shared memory {name!r}") from None
        raise SegmentError(f"cannot open shared memory {name!r}: {exc.strerror}") from None
    try:
        _check_file(name, os.fstat(fd), nbytes)
        head = os.pread(fd, len(MAGIC) + TOKEN_BYTES + 8, 0)
        size = int.from_bytes(head[len(MAGIC) + TOKEN_BYTES:], "little")
        if head[:len(MAGIC)] != MAGIC or size != nbytes:
            raise SegmentError(f"shared memory {name!r} is not a pool of {nbytes} bytes")
        if not hmac.compare_digest(head[len(MAGIC):len(MAGIC) + TOKEN_BYTES], token):
            raise SegmentError(f"shared memory {name!r}: wrong token")
        return mmap.mmap(fd, HEADER_BYTES + nbytes)
    finally:
        os.close(fd)


def _check_file(name: str, st: os.stat_result, nbytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise SegmentError(f"shared memory {name!r} is not a regular file")
    # another user (or anyone, for a group/world-writable file) could shrink it under our
    # mapping, and a write past the new end kills the writer with SIGBUS
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise SegmentError(f"shared memory {name!r} belongs to uid {st.st_uid} (we are "
                           f"{os.geteuid()}) or is writable by others")
    if st.st_size != HEADER_BYTES + nbytes:
        raise SegmentError(f"shared memory {name!r} holds {st.st_size} bytes, "
                           f"{HEADER_BYTES + nbytes} expected")
