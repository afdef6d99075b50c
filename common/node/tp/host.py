"""The host tier of a tensor-parallel worker: every rank offloads its own KV heads.

Each rank keeps a host tier of its own (its heads of every cached page, its own free log)
with the same host page ids as rank 0. Rank 0 alone decides, as it does for the device
pool (``common.node.tp.lockstep``): its prefix cache picks what to store, load and evict,
and every change to its host pool and every copy it starts go into the lockstep's op
stream, after the device pins recorded before them. A follower repeats them in order:

    rank 0 (LeaderHostTier, LockstepCopies)    a follower (HostMirror)
    h_alloc   host pages to cache:host         allocates as many: must be the same ids
    h_free    evicted, or a failed copy's      frees the same pages, same reason
    h_pin     a copy claims host pages         pins them (rank 0's pin id mapped to its own)
    h_unpin   the copy ended                   unpins them
    h_copy    device <-> host pages, started   copies its heads of those pages, at once
    h_close   the host log's close event       writes its own

A follower's copy runs when it applies the op, before the pass that follows in the step,
and returns when it is done (on CUDA too: a copy only queued on the stream could be
overtaken by a write that ignores stream order, such as a NIXL WRITE into a page
unpinned meanwhile), so the pass that reads a loaded page, and any later write into a
page the copy read, come after it. Rank 0's
device pins for the copy are recorded like every other pin and its unpin comes after its
own copy ended, so a follower's copy has ended by the time it repeats that unpin: page
states stay identical on every rank, and so do the allocators' choices. The cost: a
follower's pass waits for its copy (rank 0's runs beside its pass), which the next
all-reduce passes on to rank 0; decode offloads a page at a time as pages fill.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from common.config import ServeConfig
from common.control import pack_ids, unpack_ids
from common.freelog import freelog_file
from common.host import CACHE_OWNER, CopyEngine, CopyJob, HostTier
from common.kv import KvCache, copy_pages
from common.node.tp.lockstep import Lockstep, TpKvOp


class LeaderHostTier(HostTier):
    """Rank 0's host tier: a ``HostTier`` that records every change for the followers."""

    def __init__(self, *args, lockstep: Lockstep, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lockstep = lockstep
        self._jlock = threading.RLock()  # each op recorded in the order it was applied

    def allocate(self, n: int, owner: str = CACHE_OWNER) -> np.ndarray | None:
        with self._jlock:
            pages = super().allocate(n, owner)
            if pages is not None and len(pages):
                self._rec("h_alloc", owner=owner, pages=pack_ids(pages))
            return pages

    def free(self, pages: np.ndarray, owner: str, reason: str) -> None:
        pages = np.asarray(pages, dtype=np.int32)
        with self._jlock:
            super().free(pages, owner, reason)
            if len(pages):
                self._rec("h_free", owner=owner, pages=pack_ids(pages),
                          text=str(getattr(reason, "value", reason)))

    def pin(self, pages: np.ndarray, reason: str) -> int:
        with self._jlock:
            pin_id = super().pin(pages, reason)
            self._rec("h_pin", pages=pack_ids(np.asarray(pages, np.int32)), text=reason,
                      n=pin_id)
            return pin_id

    def unpin(self, pin_id: int, record: dict | None = None) -> None:
        with self._jlock:
            super().unpin(pin_id, record)   # the record (digests) is this rank's log's
            self._rec("h_unpin", n=pin_id)

    def close(self, retained=(CACHE_OWNER,)) -> None:
        with self._jlock:
            if not self._closed:
                self._rec("h_close", retained=list(retained))
            super().close(retained)

    def _rec(self, op: str, **kw) -> None:
        self.lockstep.record(TpKvOp(op, **kw))


class LockstepCopies:
    """Rank 0's copy engine: each copy is recorded (``h_copy``), then run by ``engine``.

    ``h_copy``: ``n`` 1 for device to host, 0 for host to device; ``pages`` the source
    page ids, then the destination's (as many)."""

    def __init__(self, engine: CopyEngine, lockstep: Lockstep, host: HostTier) -> None:
        self.engine, self.lockstep, self.host = engine, lockstep, host

    def submit(self, src: torch.Tensor, src_pages: np.ndarray, dst: torch.Tensor,
               dst_pages: np.ndarray) -> CopyJob:
        to_host = dst is self.host.data
        assert to_host != (src is self.host.data), "a copy between the device and the host"
        ids = np.concatenate([np.asarray(src_pages, np.int32), np.asarray(dst_pages, np.int32)])
        self.lockstep.record(TpKvOp("h_copy", n=int(to_host), pages=pack_ids(ids)))
        return self.engine.submit(src, src_pages, dst, dst_pages)

    def close(self) -> None:
        self.engine.close()


class HostMirror:
    """A follower's host tier, driven by rank 0's ``h_*`` ops (``Mirror``'s ``host``).

    A change that does not fit this rank (other page ids, an unknown pin) raises
    ``ValueError``; the ``Mirror`` turns it into ``GroupLost``. Counts its copies as an
    ``Offloader`` does (``num_offloaded_pages``, ``num_loaded_pages``), for its metrics."""

    def __init__(self, host: HostTier, cache: KvCache) -> None:
        self.host, self.cache = host, cache
        self.pins: dict[int, int] = {}  # rank 0's host pin id -> this rank's
        self.closed = False
        self.num_offloaded_pages = self.num_loaded_pages = 0

    def apply(self, op: TpKvOp) -> None:
        pages = unpack_ids(op.pages, "pages") if op.pages else np.empty(0, np.int32)
        if op.op == "h_alloc":
            mine = self.host.allocate(len(pages), op.owner)
            if mine is None or not np.array_equal(mine, pages):
                raise ValueError(f"rank 0 allocated host pages {pages.tolist()}, this rank "
                                 f"{None if mine is None else mine.tolist()}")
        elif op.op == "h_free":
            self.host.free(pages, op.owner, op.text)
        elif op.op == "h_pin":
            self.pins[op.n] = self.host.pin(pages, op.text)
        elif op.op == "h_unpin":
            self.host.unpin(self.pins.pop(op.n))
        elif op.op == "h_copy":
            self._copy(pages, to_host=bool(op.n))
        elif op.op == "h_close":
            self.host.close(op.retained)
            self.closed = True
        else:
            raise ValueError(f"unknown host op {op.op!r}")

    def _copy(self, pages: np.ndarray, to_host: bool) -> None:
        half = len(pages) // 2
        src_pages, dst_pages = pages[:half], pages[half:]
        device, host = self.cache.data(), self.host.data
        src, dst = (device, host) if to_host else (host, device)
        # Blocking, also on CUDA: rank 0's unpins that follow are applied as soon as they
        # come, and a write that ignores stream order (a NIXL WRITE into a reused page)
        # must not overtake a copy still queued on the stream
        copy_pages(src, src_pages, dst, dst_pages)
        if to_host:
            self.num_offloaded_pages += half
        else:
            self.num_loaded_pages += half

    def abandon(self) -> None:
        """Rank 0 is gone: drop the pins of copies it never saw end (this rank's copies
        ended when they were applied) and close the host log; its pages stay the cache's."""
        for pin_id in sorted(self.pins.values()):
            self.host.unpin(pin_id)
        self.pins.clear()
        if not self.closed:
            self.host.close()
            self.closed = True


def follower_host(cfg: ServeConfig, cache: KvCache, device: str, log_dir: str | None,
                  name: str, node: str) -> HostMirror | None:
    """A tensor-parallel follower's host tier (``cfg.host_pool_pages()`` of its heads, logged to
    ``<log_dir>/<name>.host.freelog``), driven by rank 0's ops; None when ``cfg.offload``
    is off."""
    if not cfg.offload:
        return None
    host = HostTier(cfg.host_pool_pages(), cache.page_size, cache.layout, device=device,
                    log_path=freelog_file(log_dir, f"{name}.host"), node=node)
    return HostMirror(host, cache)
