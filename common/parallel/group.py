"""A tensor-parallel group: the ranks of one worker and the collectives they share.

Every collective here has a deadline (the process group's ``timeout_s``): a rank that
died or stopped answering makes the others raise ``GroupLost`` within it instead of
hanging. Anything exchanged has a shape every rank knows before the call (a fixed
header, then a payload whose size the header announced), never a size taken from one
rank's local queue: ranks whose queues differ would otherwise wait on different
collectives forever.

Backends: gloo on CPU; NCCL for the model's all-reduce on CUDA, with a second gloo group
for the small control payloads (bytes and ids live on the host).

A group of one rank (``TpGroup.solo``) runs every collective as a no-op without
``torch.distributed``, so the single-device path is the same code.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_HEADER = 2  # int64 [tag, nbytes]


class GroupLost(RuntimeError):
    """A collective failed or passed its deadline: a rank of the group is gone."""


class TpGroup:
    """One rank's handle on its tensor-parallel group.

    Args:
        rank: this process's rank in ``[0, size)``; rank 0 is the leader (it schedules,
            samples and talks to the router).
        size: ranks in the group.
        device: this rank's device (``cpu`` or ``cuda:N``).

    Build with ``TpGroup.solo`` or ``TpGroup.join``.
    """

    def __init__(self, rank: int, size: int, device: str | torch.device = "cpu",
                 timeout_s: float = 30.0) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"tp rank={rank} must be in [0, size={size})")
        self.rank, self.size = rank, size
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self._cpu_group = None  # gloo group for control payloads (None: the default group)
        self._joined = False
        self._wake: _Waker | None = None  # readable when rank 0's step header landed

    @classmethod
    def solo(cls, device: str | torch.device = "cpu") -> TpGroup:
        """A group of one rank: every collective is a no-op."""
        return cls(0, 1, device)

    @classmethod
    def join(cls, rank: int, size: int, address: str, device: str | torch.device = "cpu",
             timeout_s: float = 30.0, rendezvous_s: float | None = None) -> TpGroup:
        """Join the group whose rendezvous rank 0 hosts at ``address`` (``tcp://host:port``).

        The rendezvous waits ``rendezvous_s`` (default ``timeout_s``) for every rank: the
        ranks are processes starting (importing torch, on a loaded host that alone can
        take tens of seconds), so it is a startup deadline. Every later collective times
        out after ``timeout_s``.

        Raises:
            GroupLost: not every rank joined within ``rendezvous_s``.
        """
        rendezvous_s = max(timeout_s, rendezvous_s or timeout_s)
        group = cls(rank, size, device, timeout_s)
        if size == 1:
            return group
        url = urlparse(address)
        if url.scheme != "tcp" or not url.hostname or not url.port:
            raise ValueError(f"tp group address {address!r}: expected tcp://host:port")
        if url.hostname.startswith("127."):
            # gloo and NCCL's bootstrap otherwise bind the address the hostname resolves
            # to (NCCL: the first non-loopback interface), an external interface even
            # when every rank is on this machine; the group's sockets authenticate
            # nothing, so they stay where only this host reaches them
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        backend = "nccl" if group.device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        try:
            dist.init_process_group(backend, init_method=address, rank=rank, world_size=size,
                                    timeout=timedelta(seconds=rendezvous_s))
            group._joined = True
            if rendezvous_s != timeout_s:  # every rank is here: collectives get their own
                _set_timeout(timeout)
            if backend == "nccl":
                # a bare "cuda" is the current device (set_device wants an index)
                torch.cuda.set_device(group.device.index or 0)
                group._cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        except Exception as exc:
            group.close()
            raise GroupLost(f"tp rank {rank}/{size}: rendezvous at {address} failed within "
                            f"{rendezvous_s:.0f} s (--tp-rendezvous-timeout-s; pdkv run "
                            f"gives ready_timeout_s): not every rank started and reached "
                            f"it: {exc}") from exc
        logger.info("tp rank %d/%d joined at %s (%s)", rank, size, address, backend)
        return group

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # -- model collectives ---------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; every rank gets the same bits."""
        if self.size > 1:
            self._run("all_reduce", dist.all_reduce, t)
        return t

    def gather_last_dim(self, t: torch.Tensor, full: int) -> torch.Tensor | None:
        """Rank 0 gets every rank's ``t`` ([..., shard]) joined on the last dimension and
        cut to ``full`` columns; other ranks get None. Shards may differ by one column
        (``shard_range``), so each is padded to the largest for the gather."""
        if self.size == 1:
            return t
        width = -(-full // self.size)
        if t.shape[-1] < width:
            t = torch.nn.functional.pad(t, (0, width - t.shape[-1]))
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.is_leader else None
        self._run("gather", dist.gather, t, parts, dst=0)
        if not self.is_leader:
            return None
        return torch.cat([p[..., :hi - lo] for p, (lo, hi) in
                          zip(parts, (shard_range(full, self.size, r) for r in range(self.size)))],
                         dim=-1)

    # -- control payloads (host) ----------------------------------------------------------
    def broadcast_ids(self, ids: list[int] | None, n: int) -> list[int]:
        """Rank 0's ``n`` token ids (sampled there) on every rank; others pass None."""
        if self.size == 1:
            return list(ids)
        t = torch.tensor(ids, dtype=torch.int64) if self.is_leader else \
            torch.empty(n, dtype=torch.int64)
        if t.shape != (n,):
            raise ValueError(f"broadcast_ids: rank 0 has {t.shape[0]} ids, the group agreed "
                             f"on {n}")
        self._run("broadcast", dist.broadcast, t, src=0, group=self._cpu_group)
        return t.tolist()

    def broadcast_bytes(self, tag: int, payload: bytes | None,
                        idle: Callable[[], None] | None = None) -> bytes:
        """Rank 0's ``payload`` on every rank (others pass None). A fixed header [tag,
        nbytes] goes first; a rank expecting another ``tag`` raises (the ranks' call
        orders diverged: a bug, never papered over).

        ``idle`` (ranks other than 0): called over and over while the header has not
        come, as ``idle(wake_fd, left_s)``: it waits (at most ``left_s``, the deadline's
        rest) for its own work or for ``wake_fd`` to be readable, which it becomes the
        moment rank 0's header lands (a follower's KV transport lives on between rank
        0's steps, and it sleeps on its sockets and on rank 0 at once: no polling)."""
        if self.size == 1:
            return payload
        header = torch.tensor([tag, len(payload)] if self.is_leader else [0, 0],
                              dtype=torch.int64)
        if idle is None or self.is_leader:
            self._run("broadcast", dist.broadcast, header, src=0, group=self._cpu_group)
        else:
            self._run("broadcast", self._wait_idle, header, idle)
        if int(header[0]) != tag:
            raise GroupLost(f"tp rank {self.rank}: expected message tag {tag}, rank 0 sent "
                            f"{int(header[0])}")
        data = _as_tensor(payload) if self.is_leader else \
            torch.empty(int(header[1]), dtype=torch.uint8)
        if len(data):
            self._run("broadcast", dist.broadcast, data, src=0, group=self._cpu_group)
        return payload if self.is_leader else data.numpy().tobytes()

    def _wait_idle(self, header: torch.Tensor, idle: Callable[[int, float], None]) -> None:
        work = dist.broadcast(header, src=0, group=self._cpu_group, async_op=True)
        wake = self._waker()
        # gloo completes the broadcast on its own thread: the future's callback makes
        # the pipe readable there (at once if it already completed)
        work.get_future().add_done_callback(lambda _done: wake.poke())
        deadline = time.monotonic() + self.timeout_s
        try:
            while not work.is_completed():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"nothing from rank 0 within {self.timeout_s:.0f} s")
                idle(wake.fd, left)
        finally:
            wake.drain()
        work.wait()  # raises what the broadcast met (a rank gone)

    def _waker(self) -> _Waker:
        if self._wake is None:
            self._wake = _Waker()
        return self._wake

    def all_min(self, values: list[int]) -> list[int]:
        """The element-wise minimum of every rank's ``values`` on every rank. Every rank
        passes as many values as the others (a count all of them got from rank 0 first:
        never the length of a rank's own queue)."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        self._run("all_reduce", dist.all_reduce, t, op=dist.ReduceOp.MIN,
                  group=self._cpu_group)
        return t.tolist()

    def gather_bytes(self, payload: bytes) -> list[bytes] | None:
        """Every rank's ``payload`` on rank 0 (in rank order), None on the others. Sizes
        are exchanged first ([1] per rank), then payloads padded to the largest."""
        if self.size == 1:
            return [payload]
        size = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(self.size)]
        self._run("all_gather", dist.all_gather, sizes, size, group=self._cpu_group)
        width = max(int(s) for s in sizes)
        if width == 0:
            return [b""] * self.size if self.is_leader else None
        data = torch.zeros(width, dtype=torch.uint8)
        data[:len(payload)] = _as_tensor(payload)
        parts = [torch.empty_like(data) for _ in range(self.size)] if self.is_leader else None
        self._run("gather", dist.gather, data, parts, dst=0, group=self._cpu_group)
        if not self.is_leader:
            return None
        return [p[:int(s)].numpy().tobytes() for p, s in zip(parts, sizes)]

    # -- life ------------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the group (idempotent); collectives fail afterwards."""
        if self._wake is not None:
            self._wake.close()
            self._wake = None
        if self._joined:
            self._joined = False
            try:
                dist.destroy_process_group()
            except Exception:  # a peer already gone: nothing left to tear down cleanly
                logger.debug("tp rank %d: destroy_process_group failed", self.rank,
                             exc_info=True)

    def _run(self, what: str, fn, *args, **kwargs) -> None:
        if not self._joined:
            raise GroupLost(f"tp rank {self.rank}/{self.size}: {what} on a closed group")
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            raise GroupLost(f"tp rank {self.rank}/{self.size}: {what} failed (a rank died "
                            f"or missed the {self.timeout_s:.0f} s deadline): {exc}") from exc


def _set_timeout(timeout: timedelta) -> None:
    """The default group's deadline from now on (it joined with the rendezvous's)."""
    from torch.distributed import distributed_c10d

    setter = getattr(distributed_c10d, "_set_pg_timeout", None)
    if setter is None:  # an older torch: collectives keep the rendezvous's deadline
        logger.warning("this torch cannot change a process group's timeout: collectives "
                       "keep the rendezvous deadline")
        return
    setter(timeout)


class _Waker:
    """A pipe that a broadcast's completion makes readable (``poke``, from gloo's
    thread), so that a follower sleeps on it next to its sockets (``zmq.Poller`` and
    ``select`` take the raw ``fd``)."""

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)
        self._lock = threading.Lock()  # a late poke never writes to a reused fd number
        self._closed = False

    def poke(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._w, b"\0")
            except BlockingIOError:  # full: readable already
                pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self.fd)
            os.close(self._w)


def _as_tensor(payload: bytes) -> torch.Tensor:
    """``payload`` as a uint8 tensor (a copy; empty bytes give an empty tensor)."""
    if not payload:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def shard_range(total: int, size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of ``total`` items held by ``rank`` when they need not split evenly
    (the vocabulary): the first ``total % size`` ranks hold one more."""
    base, extra = divmod(total, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def even_range(total: int, size: int, rank: int, what: str) -> tuple[int, int]:
    """``[start, end)`` of ``total`` items (heads, channels) that must split evenly.

    Raises:
        ValueError: ``total`` is not a multiple of ``size`` (names ``what``).
    """
    if total % size:
        raise ValueError(f"{what}={total} does not split over tensor-parallel size {size}; "
                         f"use a size that divides it")
    per = total // size
    return rank * per, (rank + 1) * per
