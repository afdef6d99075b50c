"""The data path: page runs out of a source pool, into a destination pool.

Workers never see this module; ``KvSender``/``KvReceiver`` drive it. A new backend (CUDA
IPC, NIXL/RDMA, shared memory) implements ``DataChannel`` (how bytes of a run leave, and
when the source pages may be touched again) and reuses ``PoolView`` and ``coalesce``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import numpy as np
import torch
import zmq

from .sockets import RouterSocket


class Completion(Protocol):
    """A send in progress; ``done`` turns true once the source bytes may be reused."""

    @property
    def done(self) -> bool: ...


class DataChannel(ABC):
    """Sends one data frame (a header plus a run of page bytes) to one peer."""

    name = "abstract"

    @abstractmethod
    def send_frame(self, peer: bytes, header: bytes, payload: np.ndarray) -> Completion:
        """Queue ``payload`` (a view of pinned pages or a staging copy) without copying it.

        Args:
            peer: routing id of the destination rank.
            header: the encoded ``KvChunk``.
            payload: bytes to move; the channel keeps a reference until the completion is
                done, the caller keeps the source pages pinned until then.
        Returns:
            the completion to poll; the pages stay the caller's.
        """


class ZmqChannel(DataChannel):
    """Data frames ride the control connection, zero-copy with a ``MessageTracker``."""

    name = "zmq"

    def __init__(self, router: RouterSocket):
        self.router = router

    def send_frame(self, peer: bytes, header: bytes, payload: np.ndarray) -> Completion:
        tracker = self.router.send(peer, [header, payload], track=True)
        assert tracker is not None
        return tracker


class PoolView:
    """Byte views of a KvCache data tensor (no copy; the cache owns the memory).

    ``# shaped: [num_pages, total_layers, 2, page_size, heads_per_rank, head_dim * itemsize]``
    """

    def __init__(self, data: torch.Tensor):
        assert data.is_contiguous() and data.device.type == "cpu", (data.shape, data.device)
        raw = data.view(torch.uint8).numpy()
        self.shaped = raw
        self.flat = raw.reshape(raw.shape[0], -1)
        self.num_heads = raw.shape[4]

    def block_bytes(self, num_heads: int) -> int:
        """Bytes of one page restricted to ``num_heads`` heads."""
        return self.flat.shape[1] // self.num_heads * num_heads

    def read(self, first_page: int, num_pages: int, heads: slice) -> np.ndarray:
        """Payload of consecutive pages: a view when all heads, else a staging copy."""
        if heads.stop - heads.start == self.num_heads:
            return self.flat[first_page:first_page + num_pages]
        return np.ascontiguousarray(self.shaped[first_page:first_page + num_pages, :, :, :,
                                                heads])

    def write(self, dest_pages: np.ndarray, heads: slice, payload: memoryview) -> None:
        """Scatter ``payload`` (``[len(dest_pages), ..., heads, ...]``) into ``dest_pages``."""
        src = np.frombuffer(payload, dtype=np.uint8)
        full = heads.stop - heads.start == self.num_heads
        shape = self.shaped.shape[1:4] + (heads.stop - heads.start, self.shaped.shape[5])
        src = src.reshape(len(dest_pages), -1) if full else src.reshape(-1, *shape)
        i = 0
        for start, length in coalesce(dest_pages, len(dest_pages)):
            page = int(dest_pages[start])
            if full:
                self.flat[page:page + length] = src[i:i + length]
            else:
                self.shaped[page:page + length, :, :, :, heads] = src[i:i + length]
            i += length


def coalesce(pages: np.ndarray, max_run: int) -> list[tuple[int, int]]:
    """Split ``pages`` into runs of consecutive ids, each at most ``max_run`` long.

    Returns:
        ``[(offset into pages, length), ...]`` covering ``pages`` in order.
    """
    if len(pages) == 0:
        return []
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    bounds = [0, *breaks.tolist(), len(pages)]
    runs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        for start in range(lo, hi, max_run):
            runs.append((start, min(max_run, hi - start)))
    return runs


def is_unreachable(exc: zmq.ZMQError) -> bool:
    """True when a ROUTER send failed because the peer is gone."""
    return exc.errno == zmq.EHOSTUNREACH
