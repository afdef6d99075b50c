"""Run a function on every rank of a real tensor-parallel group (one process per rank,
gloo on loopback) and collect what each rank returns; ``Recording``, a group of one that
keeps rank 0's steps for a follower's ``Mirror`` in the same process."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket
import traceback

from common.node.tp import TAG_STEP
from common.parallel import TpGroup


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank: int, size: int, address: str, args: tuple, out) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch

    torch.set_num_threads(1)
    try:
        out.put((rank, "ok", fn(rank, size, address, *args)))
    except BaseException as exc:  # reported to the test, which fails with the traceback
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(fn, size: int, *args, timeout_s: float = 120.0, killed: tuple[int, ...] = ()
              ) -> list:
    """``fn(rank, size, address, *args)`` on ``size`` processes; returns the results by
    rank (None for the ranks in ``killed``, which must die by SIGKILL). A rank that raised
    fails the call with its traceback; every process is stopped before returning. ``fn``
    must be importable (module level)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    address = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(fn, r, size, address, args, out),
                         daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    try:
        while len(results) < size - len(killed):
            rank, status, value = out.get(timeout=timeout_s)
            results[rank] = (status, value)
    except queue.Empty:
        raise AssertionError(f"ranks {sorted(set(range(size)) - set(results))} gave no "
                             f"result within {timeout_s} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join()
        out.close()
    errors = [f"rank {r}: {v}" for r, (s, v) in sorted(results.items()) if s != "ok"]
    errors += [f"rank {r} was to be killed, exit code {procs[r].exitcode}" for r in killed
               if procs[r].exitcode != -signal.SIGKILL]
    assert not errors, "\n".join(errors)
    return [results.get(r, (None, None))[1] for r in range(size)]


class Recording(TpGroup):
    """A group of one that keeps every step rank 0 broadcast."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.steps: list[bytes] = []

    def broadcast_bytes(self, tag: int, payload: bytes | None) -> bytes:
        assert tag == TAG_STEP
        self.steps.append(payload)
        return payload
