"""Tensors in named POSIX shared memory, so a peer process on the same host can map a pool.

The creator owns the segment and unlinks it at ``close`` (Python's resource tracker also
unlinks it if the creator dies). A process that attaches never unlinks it.
"""

from __future__ import annotations

import math
from multiprocessing import resource_tracker, shared_memory

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
        self._shm = shared_memory.SharedMemory(name=name, create=self.owner,
                                               size=max(nbytes, 1))
        if not self.owner:
            # Before Python 3.13 attaching registers the segment with the resource tracker,
            # which would unlink it when this process exits; the creator owns it.
            resource_tracker.unregister(self._shm._name, "shared_memory")
        if self._shm.size < nbytes:
            raise ValueError(f"shared memory {name!r} holds {self._shm.size} bytes, "
                             f"{nbytes} needed for {shape} {dtype}")
        flat = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)
        self.tensor = flat.view(dtype).view(shape)
        if self.owner:
            self.tensor.zero_()

    @property
    def name(self) -> str:
        return self._shm.name

    def close(self) -> None:
        """Drop the mapping (and the segment, for its creator). The tensor is unusable after."""
        self.tensor = None
        try:
            self._shm.close()
        except BufferError:  # a view of the buffer is still alive somewhere: leave it mapped
            pass
        if self.owner:
            self._shm.unlink()
            self.owner = False
