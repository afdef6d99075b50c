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
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from common.kv import digest_of_bytes, page_runs

from .integrity import pack_epochs, run_entry
from .messages import KvChunk, encode
from .pool_view import PoolView
from .sockets import RouterSocket


class PostFailed(RuntimeError):
    """A channel could not post one request's run (its peer is fine): that request fails
    with reason ``error`` and goes down the abort path; nothing of the run was written."""


class Completion(Protocol):
    """A send in progress; ``done`` turns true once the source bytes may be reused."""

    @property
    def done(self) -> bool: ...


@dataclass(frozen=True)
class BlockRun:
    """Blocks ``[first_block, first_block + len(src_pages))`` of request ``rid`` for one leg.

    ``src_pages`` (this rank's pool) and ``dest_pages`` (the decode rank's pool) are the
    page ids of those blocks, ``dest_epochs`` the epochs the decode registered them with;
    ``heads`` are the leg's global heads and ``src_heads`` where they lie in the source
    pool's head axis. ``digest`` is the leg's algorithm ("" integrity off);
    ``first_token`` is set on the leg's final run: its last message carries it.
    """

    peer: bytes
    rid: str
    first_block: int
    src_pages: np.ndarray
    dest_pages: np.ndarray
    heads: tuple[int, int]
    src_heads: slice
    dest_epochs: np.ndarray
    digest: str = ""
    first_token: int | None = None

    def piece(self, start: int, end: int) -> dict:
        """The fields of a data message over blocks ``[start, end)`` of this run
        (relative), ``first_token`` on the run's last piece."""
        return {"rid": self.rid, "first_block": self.first_block + start,
                "num_blocks": end - start, "head_start": self.heads[0],
                "head_end": self.heads[1], "epochs": pack_epochs(self.dest_epochs[start:end]),
                "first_token": self.first_token if end == len(self.src_pages) else None}

    def entry(self, start: int, end: int, digest: int | None) -> list:
        """The free-log entry of the message over blocks ``[start, end)``."""
        return run_entry(self.first_block + start, end - start, self.heads,
                         int(self.dest_epochs[start]), digest)


@dataclass
class Posted:
    """What ``send_blocks`` started: completions (the source pages may be reused once
    every one is done) and the free-log entry of each message it sent."""

    completions: list = field(default_factory=list)
    entries: list = field(default_factory=list)


class DataChannel(ABC):
    """Moves the bytes of page runs to one kind of peer; control stays on ZMQ."""

    name = "abstract"

    @abstractmethod
    def send_blocks(self, run: BlockRun) -> Posted:
        """Move ``run`` to its peer (or queue it); each message carries its blocks' epochs
        and digest, and the run's last one its ``first_token``.

        The caller keeps the source pages pinned until every returned completion is done;
        the decode keeps the destination pages pinned until the peer says it stopped.
        Raises:
            zmq.ZMQError: EHOSTUNREACH when the peer is gone (nothing more is sent).
            PostFailed: this run cannot be posted (the request fails, the peer stays).
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

    def send_blocks(self, run: BlockRun) -> Posted:
        heads = run.src_heads
        max_run = max(1, self.max_frame_bytes // self.pool.block_bytes(heads.stop - heads.start))
        runs = page_runs(run.src_pages, max_len=max_run)
        tracker, offset, posted = None, 0, Posted()
        for i, (first_page, _, length) in enumerate(runs):
            payload = self.pool.read(first_page, length, heads)
            # the frame's own bytes: what the decode hashes before it lands them
            digest = digest_of_bytes(run.digest, payload) if run.digest else None
            header = encode(KvChunk(**run.piece(offset, offset + length),
                                    nbytes=payload.nbytes, digest=digest))
            tracker = self.router.send(run.peer, [header, payload], track=i == len(runs) - 1)
            self.stats["bytes_sent"] += payload.nbytes
            posted.entries.append(run.entry(offset, offset + length, digest))
            offset += length
        self.stats["frames_sent"] += len(runs)
        self.stats["sent.KvChunk"] += len(runs)
        if tracker is not None:
            posted.completions.append(tracker)
        return posted
