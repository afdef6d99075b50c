"""Byte views of a KV pool for the frame path: read page runs into frames, land frames in
pages.

A frame is host memory (ZMQ sends and receives host bytes), so how a run gets there
depends on where the pool lives:

- ``HostPoolView`` (a CPU pool): a frame of all of a page run's heads is a view of the
  pool, sent zero-copy; a received frame is copied once, into its pages.
- ``StagedPoolView`` (a CUDA pool): a run is copied device -> host into a fresh
  page-locked buffer, which the frame then carries (ZMQ holds the buffer until it is
  sent; torch's host allocator reuses it after that); a received frame is copied host ->
  device into its pages. Both copies run on the current stream and return when done, so
  a copy out comes after the kernels that wrote the KV, and the forward pass that reads
  a landed page comes after its copy in.

``pool_view(data)`` picks the one for the tensor's device. The shared-memory path needs a
host view on both sides (``on_host``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from common.kv import copy_pages


class PoolView(ABC):
    """Page runs of one pool tensor as bytes (no copy of the pool; whoever holds the
    tensor owns it).

    ``# shaped: [num_pages, total_layers, 2, page_size, heads_per_rank, head_dim * itemsize]``
    """

    on_host = False

    def __init__(self, data: torch.Tensor):
        assert data.is_contiguous(), (data.shape, data.stride())
        self.data = data
        self.num_heads = data.shape[4]
        self.page_bytes = data[0].numel() * data.element_size() if data.shape[0] else 0

    def block_bytes(self, num_heads: int) -> int:
        """Bytes of one page restricted to ``num_heads`` heads."""
        return self.page_bytes // self.num_heads * num_heads

    @abstractmethod
    def read(self, first_page: int, num_pages: int, heads: slice) -> np.ndarray:
        """Host bytes ``[num_pages, block_bytes]`` of consecutive pages restricted to
        ``heads``, for a frame: they stay valid while the returned array lives."""

    @abstractmethod
    def write(self, dest_pages: np.ndarray, heads: slice, payload: memoryview) -> int:
        """Copy a frame (``[len(dest_pages), ..., heads, ...]``) into ``dest_pages``;
        returns the number of runs it took (1 for consecutive pages)."""

    def _frame_shape(self, num_pages: int, heads: slice) -> tuple[int, ...]:
        shape = self.data.shape
        return (num_pages, *shape[1:4], heads.stop - heads.start,
                shape[5] * self.data.element_size())


class HostPoolView(PoolView):
    """A CPU pool: frames of whole pages are views of it."""

    on_host = True

    def __init__(self, data: torch.Tensor):
        assert data.device.type == "cpu", data.device
        super().__init__(data)
        self.shaped = data.view(torch.uint8).numpy()
        self.flat = self.shaped.reshape(self.shaped.shape[0], -1)

    def read(self, first_page: int, num_pages: int, heads: slice) -> np.ndarray:
        """A view when all heads, else a staging copy."""
        if heads.stop - heads.start == self.num_heads:
            return self.flat[first_page:first_page + num_pages]
        return np.ascontiguousarray(self.shaped[first_page:first_page + num_pages, :, :, :,
                                                heads]).reshape(num_pages, -1)

    def write(self, dest_pages: np.ndarray, heads: slice, payload: memoryview) -> int:
        src = np.frombuffer(payload, dtype=np.uint8).reshape(
            self._frame_shape(len(dest_pages), heads))
        # on this thread: landing through the copier's helper threads left ZMQ's next
        # receive buffers fresh (every byte page-faulted again; docs/benchmarks.md)
        return copy_pages(src, np.arange(len(dest_pages)), self.shaped, dest_pages,
                          dst_heads=heads, split=False)


class StagedPoolView(PoolView):
    """A pool on an accelerator: frames are host copies of its pages.

    Works on any device (the tests run it on a CPU pool); page-locked buffers only where
    CUDA is, since only they let a device copy run at the bus's speed.
    """

    def __init__(self, data: torch.Tensor):
        super().__init__(data)
        self.shaped = data.view(torch.uint8)
        self.pinned = data.device.type == "cuda"

    def read(self, first_page: int, num_pages: int, heads: slice) -> np.ndarray:
        staged = torch.empty(self._frame_shape(num_pages, heads), dtype=torch.uint8,
                             pin_memory=self.pinned)
        staged.copy_(self.shaped[first_page:first_page + num_pages, :, :, :, heads])
        return staged.numpy().reshape(num_pages, -1)  # the array keeps ``staged`` alive

    def write(self, dest_pages: np.ndarray, heads: slice, payload: memoryview) -> int:
        src = torch.frombuffer(payload, dtype=torch.uint8).view(
            self._frame_shape(len(dest_pages), heads))
        return copy_pages(src, np.arange(len(dest_pages)), self.shaped, dest_pages,
                          dst_heads=heads)


def pool_view(data: torch.Tensor) -> PoolView:
    """The view that frames need for a pool on ``data``'s device."""
    return HostPoolView(data) if data.device.type == "cpu" else StagedPoolView(data)
