"""The host tier: a KV pool in CPU memory of its own, and the engine that copies pages.

The host pool mirrors a device pool's page layout (docs/design.md, "Speculation and offload"):

    # data: [num_pages, total_layers, 2, page_size, num_kv_heads, head_dim]

It has its own capacity, its own ``PageAllocator`` (pool name ``host``, page 0 reserved)
and its own free log, so that ``pdkv replay`` checks host pages exactly like device
pages. Pages cached by the prefix cache are owned by ``cache:host``.

``CopyEngine`` moves pages between two page-major tensors asynchronously: on CUDA on a
side stream with an event, on CPU on one background thread. Both run jobs in submission
order, with the one page-run copier (``common.kv.copy_pages``: contiguous runs as one slice
each, short runs of small pages gathered on an int64 view).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from common.freelog import FreeLogWriter
from common.kv import (
    CopyShare,
    KvLayout,
    PageAllocator,
    PoolStats,
    copy_pages,
    digest_of_pages,
    offering,
)

logger = logging.getLogger(__name__)

HOST_POOL = "host"
CACHE_OWNER = "cache:host"
class HostTier:
    """A host KV pool: data tensor, allocator and free log, behind one lock.

    Args:
        num_pages: pages of the pool, page 0 (reserved) included.
        page_size: slots per page; must match the device pool's.
        layout: what a page holds; must match the device pool's.
        device: the device pool's device. The host data is pinned (page-locked) CPU memory
            only when this is a CUDA device and CUDA is available.
        log_path: free-log file of the ``host`` pool; ``None`` records nothing.
        node: the process's name in the free log.

    Who frees what: the owner passed to ``allocate`` (normally ``cache:host``) frees its
    pages with ``free``; pages freed while pinned return to the free list at the last
    ``unpin``. All methods are thread-safe.
    """

    def __init__(self, num_pages: int, page_size: int, layout: KvLayout | None = None, *,
                 device: str | torch.device = "cpu",
                 log_path: str | os.PathLike | None = None, node: str = "node"):
        if num_pages < 2:
            raise ValueError(f"HostTier num_pages={num_pages}: need at least 2 (page 0 is "
                             "reserved)")
        self.num_pages, self.page_size = num_pages, page_size
        self.layout = layout or KvLayout()
        device = torch.device(device)
        self.pinned = device.type == "cuda" and torch.cuda.is_available()
        self._log = None if log_path is None else FreeLogWriter(log_path, node=node, pools={
            HOST_POOL: {"num_pages": num_pages, "page_size": page_size, "reserved": [0]}})
        self._pool = PageAllocator(HOST_POOL, num_pages, (0,), self._log,
                                   time.time_ns() // 1000)
        # [num_pages, total_layers, 2, page_size, num_kv_heads, head_dim]
        self.data = torch.zeros((num_pages, *self.layout.page_shape(page_size)),
                                dtype=self.layout.torch_dtype, pin_memory=self.pinned)
        self._pin_ids = 1
        self._lock = threading.Lock()
        self._closed = False
        # the digest each page was stored with (docs/host_tier.md, "Integrity")
        self._stored = np.zeros(num_pages, dtype=np.uint64)
        self._has_stored = np.zeros(num_pages, dtype=bool)

    # -- integrity ----------------------------------------------------------------------
    def digests(self, pages: np.ndarray) -> list[int]:
        """xxh3 of each page's bytes now (host memory: ``common.kv.digest``)."""
        return [digest_of_pages("xxh3_64", self.data, np.array([p])) for p in pages]

    def remember(self, pages: np.ndarray, digests: list[int]) -> None:
        """The digests ``pages`` were stored with (checked again when they are loaded)."""
        pages = np.asarray(pages, dtype=np.int64)
        self._stored[pages] = np.asarray(digests, dtype=np.uint64)
        self._has_stored[pages] = True

    def mismatched(self, pages: np.ndarray, digests: list[int]) -> list[int]:
        """Positions of ``pages`` whose ``digests`` differ from what they were stored with."""
        pages = np.asarray(pages, dtype=np.int64)
        now = np.asarray(digests, dtype=np.uint64)
        return np.flatnonzero(self._has_stored[pages] & (self._stored[pages] != now)).tolist()

    @property
    def num_free(self) -> int:
        return self._pool.num_free

    @property
    def num_usable(self) -> int:
        return self._pool.num_usable

    def allocate(self, n: int, owner: str = CACHE_OWNER) -> np.ndarray | None:
        """Hand ``n`` free pages to ``owner``, or ``None`` (nothing changed) if too few."""
        with self._lock:
            if not self._pool.can_allocate(n):
                return None
            return self._pool.allocate(n, owner) if n else np.zeros(0, dtype=np.int32)

    def free(self, pages: np.ndarray, owner: str, reason: str) -> None:
        """``owner`` gives ``pages`` back (recorded with ``reason``); pinned ones wait."""
        pages = np.asarray(pages, dtype=np.int32)
        if not len(pages):
            return
        with self._lock:
            bad = self._pool.not_owned(pages, owner)
            if len(bad):
                page = int(pages[bad[0]])
                raise ValueError(f"{owner!r} cannot free host page {page}: it belongs to "
                                 f"{self._pool.owner_name(page)}")
            self._pool.free(pages, owner, reason)

    def pin(self, pages: np.ndarray, reason: str) -> int:
        """Claim owned (or pending) ``pages`` for a copy; returns the pin id for ``unpin``."""
        pages = np.asarray(pages, dtype=np.int32)
        with self._lock:
            self._pool.check_pinnable(pages)
            pin_id, self._pin_ids = self._pin_ids, self._pin_ids + 1
            self._pool.pin(pages, pin_id, reason)
            return pin_id

    def unpin(self, pin_id: int, record: dict | None = None) -> None:
        """End a pin; ``record``: extra keys of the ``unpin`` event (the digests a store
        computed or a load checked, docs/freelog.md)."""
        with self._lock:
            self._pool.unpin(pin_id, record)

    def pool_stats(self) -> PoolStats:
        """The host pool's pages by state and owner kind and its event counters."""
        with self._lock:
            return self._pool.stats()

    def owners_holding_pages(self) -> dict[str, int]:
        with self._lock:
            return self._pool.owners_holding_pages()

    def check_integrity(self) -> None:
        with self._lock:
            self._pool.check_integrity()

    def close(self, retained: Sequence[str] = (CACHE_OWNER,)) -> None:
        """Write the free log's ``close`` event; ``retained`` owners may still hold pages."""
        with self._lock:
            if not self._closed and self._log is not None:
                self._log.close(retained)
            self._closed = True


class CopyJob:
    """One submitted copy; ``done()`` polls, ``wait(timeout)`` blocks, ``error`` says why.

    A waiter whose CPU copy has not started yet runs it in its own thread (when its
    engine allows it) instead of sleeping while the engine's thread wakes up for it; one
    whose copy the engine's thread already runs joins it (``common.kv.CopyShare.join``),
    copying the share of a helper thread that has not started yet, as the calling thread
    of an OpenMP team does its own share. Either way the copy runs on at most
    ``copy_threads()`` threads.
    """

    def __init__(self, engine: CopyEngine | None = None) -> None:
        self.error: BaseException | None = None
        self._event = threading.Event()
        self._cuda_event: torch.cuda.Event | None = None
        self._engine = engine
        self._shares: list[CopyShare] = []   # shared-out parts of the running copy
        self._cv = threading.Condition()

    def offer(self, share: CopyShare) -> None:
        """For engines: part of this job's copy is being shared out; a waiter may join."""
        with self._cv:
            self._shares.append(share)
            self._cv.notify_all()

    def set_done(self, error: BaseException | None = None) -> None:
        """For engines: the copy finished (with ``error`` when it failed)."""
        self.error = error
        with self._cv:
            self._event.set()
            self._cv.notify_all()

    def done(self) -> bool:
        if self._cuda_event is not None:
            return self._cuda_event.query()
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the copy finished or ``timeout`` seconds passed; True when done.

        A zero timeout only polls. Otherwise, when the job is next and its engine idle,
        this call runs the copy itself, to its end; when the engine's thread runs it, this
        call copies a helper's share that has not started; the timeout bounds waiting for
        copies that other threads run."""
        if self._cuda_event is None:
            if self._engine is not None and not self._event.is_set() and (
                    timeout is None or timeout > 0):
                deadline = None if timeout is None else time.monotonic() + timeout
                self._engine.run_if_next(self)
                self._join(deadline)
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            return self._event.wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._cuda_event.query():  # Event.synchronize() has no timeout
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(50e-6)
        return True

    def _join(self, deadline: float | None) -> None:
        """Join each share of the copy as it is offered, until the copy is done."""
        joined = 0
        while True:
            with self._cv:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._cv.wait_for(lambda n=joined: self._event.is_set() or len(self._shares) > n,
                                  left)
                if self._event.is_set() or len(self._shares) <= joined:
                    return
                share = self._shares[joined]
            joined += 1
            share.join()


class CopyEngine:
    """Runs page copies in submission order, off the caller's thread or stream.

    On CPU, one worker thread runs the queue; a thread that waits for a job which is
    next while nothing runs takes it over (``run_if_next``), so a synchronous wait (a
    prefix load the worker needs now) costs no thread handoff either way. Order holds:
    one copy at a time, in submission order.

    Args:
        device: the device pool's device; CUDA uses a side stream, CPU a worker thread.
    """

    steal = True  # waiters may run their own next job (a test engine that delays says no)

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._jobs: deque[tuple] = deque()
        self._cond = threading.Condition()
        self._busy = False     # a copy is running, on the worker or in a waiter's thread
        self._closed = False
        if self._cuda:
            self._stream = torch.cuda.Stream(self.device)
        else:
            self._thread = threading.Thread(target=self._run, name="kv-offload-copy",
                                            daemon=True)
            self._thread.start()

    def submit(self, src: torch.Tensor, src_pages: np.ndarray, dst: torch.Tensor,
               dst_pages: np.ndarray) -> CopyJob:
        """Start ``dst[dst_pages] = src[src_pages]``; the caller pins both sides until done."""
        if self._closed:
            raise RuntimeError("CopyEngine is closed")
        if not self._cuda:
            job = CopyJob(self if self.steal else None)
            with self._cond:
                self._jobs.append((job, src, src_pages, dst, dst_pages))
                self._cond.notify_all()
            return job
        job = CopyJob()
        # The side stream waits for the compute stream, which wrote the KV being copied.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self._stream):
                copy_pages(src, src_pages, dst, dst_pages, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
        except BaseException as exc:  # reported to the job's owner, as on CPU: its pins
            job.set_done(exc)         # and pages are released by whoever reaps it
            return job
        job._cuda_event = event
        return job

    def run_if_next(self, job: CopyJob) -> None:
        """Run ``job`` in the calling thread if it is next in line and no copy runs."""
        with self._cond:
            if self._busy or not self._jobs or self._jobs[0][0] is not job:
                return
            item = self._jobs.popleft()
            self._busy = True
        self._execute(item)

    def close(self) -> None:
        """Finish queued copies and stop the worker thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._cuda:
            self._stream.synchronize()
            return
        with self._cond:
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._busy or not (self._jobs or self._closed):
                    self._cond.wait()
                if not self._jobs:  # closed, and every copy done
                    return
                item = self._jobs.popleft()
                self._busy = True
            self._execute(item)

    def _execute(self, item: tuple) -> None:
        job, src, src_pages, dst, dst_pages = item
        try:
            with offering(job.offer):  # a waiter may copy a share of it
                self._copy(src, src_pages, dst, dst_pages)
        except BaseException as exc:  # reported to the job's owner, never lost
            job.set_done(exc)
        else:
            job.set_done()
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _copy(self, src: torch.Tensor, src_pages: np.ndarray, dst: torch.Tensor,
              dst_pages: np.ndarray) -> None:
        copy_pages(src, src_pages, dst, dst_pages)
