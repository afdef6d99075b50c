"""The data path: page runs out of a source pool, into a destination pool.

Workers never see this module; ``KvSender``/``KvReceiver`` drive it. A new backend (CUDA
IPC, NIXL/RDMA) implements ``DataChannel`` (how bytes of a run leave, and when the source
pages may be touched again) and reuses ``pool_view.PoolView`` and ``common.kv.page_runs``;
``shm.ShmChannel`` is the same-host example. Every copy between pools goes through
``common.kv.copy_pages``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from common.kv import page_runs

from .messages import KvChunk, encode
from .pool_view import PoolView
from .sockets import RouterSocket


class Completion(Protocol):
    """A send in progress; ``done`` turns true once the source bytes may be reused."""

    @property
    def done(self) -> bool: ...


@dataclass(frozen=True)
class BlockRun:
    """Blocks ``[first_block, first_block + len(src_pages))`` of request ``rid`` for one leg.

    ``src_pages`` (this rank's pool) and ``dest_pages`` (the decode rank's pool) are the
    page ids of those blocks; ``heads`` are the leg's global heads and ``src_heads`` where
    they lie in the source pool's head axis.
    """

    peer: bytes
    rid: str
    first_block: int
    src_pages: np.ndarray
    dest_pages: np.ndarray
    heads: tuple[int, int]
    src_heads: slice


class DataChannel(ABC):
    """Moves the bytes of page runs to one kind of peer; control stays on ZMQ."""

    name = "abstract"

    @abstractmethod
    def send_blocks(self, run: BlockRun) -> list[Completion]:
        """Move ``run`` to its peer (or queue it) and announce it with a control message.

        The caller keeps the source pages pinned until every returned completion is done;
        the decode keeps the destination pages pinned until the peer says it stopped.
        Raises:
            zmq.ZMQError: EHOSTUNREACH when the peer is gone (nothing more is sent).
        """


class ZmqChannel(DataChannel):
    """Data frames ride the control connection, zero-copy, completion by ``MessageTracker``.

    Only the last frame of a ``send_blocks`` call is tracked: ZMQ writes one
    connection's messages in order, so once the last is released the earlier ones are.
    """

    name = "zmq"

    def __init__(self, router: RouterSocket, pool: PoolView, max_frame_bytes: int,
                 stats: Counter):
        self.router, self.pool, self.stats = router, pool, stats
        self.max_frame_bytes = max_frame_bytes

    def send_blocks(self, run: BlockRun) -> list[Completion]:
        heads = run.src_heads
        max_run = max(1, self.max_frame_bytes // self.pool.block_bytes(heads.stop - heads.start))
        runs = page_runs(run.src_pages, max_len=max_run)
        tracker, offset = None, 0
        for i, (first_page, _, length) in enumerate(runs):
            payload = self.pool.read(first_page, length, heads)
            header = encode(KvChunk(rid=run.rid, first_block=run.first_block + offset,
                                    num_blocks=length, head_start=run.heads[0],
                                    head_end=run.heads[1], nbytes=payload.nbytes))
            tracker = self.router.send(run.peer, [header, payload], track=i == len(runs) - 1)
            self.stats["bytes_sent"] += payload.nbytes
            offset += length
        self.stats["frames_sent"] += len(runs)
        return [] if tracker is None else [tracker]
