"""Tensors in named POSIX shared memory, so a peer process on the same host can map a pool.

The creator owns the segment and unlinks it at ``close`` (Python's resource tracker also
unlinks it if the creator dies). A process that attaches maps ``/dev/shm/<name>`` itself
(Linux): attaching through ``SharedMemory`` would register the name with a resource
tracker that the creator may share (processes spawned by one parent do), and undoing
that registration would drop the creator's own, leaking the segment if it crashes.
"""

from __future__ import annotations

import math
import mmap
import os
from multiprocessing import shared_memory

import torch


class SharedTensor:
    """A CPU tensor backed by a named shared-memory segment.

    Args:
        shape, dtype: of the tensor.
        name: ``None`` creates a new zero-filled segment; a name attaches to an existing one.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, name: str | None = None):
        nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        self.owner = name is None
        if self.owner:
            self._shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
            self.name, buffer = self._shm.name, self._shm.buf
        else:
            self._shm, self.name = None, name
            buffer = self._map = _attach(name, nbytes)
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
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


def _attach(name: str, nbytes: int) -> mmap.mmap:
    """Map an existing segment without registering it with any resource tracker."""
    fd = os.open(os.path.join("/dev/shm", name.lstrip("/")), os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"shared memory {name!r} holds {size} bytes, {nbytes} needed")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
