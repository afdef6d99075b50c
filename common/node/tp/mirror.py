"""A follower rank's side of the lockstep (``common.node.tp.lockstep``): its own cache and
runner, driven by rank 0's steps, and (disaggregated workers) its own KV transport.

Pins: a rank's KV transport pins its own pages (its sends and receives are its own), so
pin ids differ between ranks; a pin that rank 0 recorded is kept here under rank 0's id
and mapped to this rank's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from common.control import DecodeError, unpack_ids
from common.freelog import log_problems
from common.kv import KvRecord
from common.model import BatchItem, ModelRunner
from common.node.tp.lockstep import CODEC, OP_CODEC, RankReport, TpKvOp, TpStep, encode_report
from common.parallel import GroupLost


class RankTransfer(Protocol):
    """A follower's KV transport (a prefill rank's sender, a decode rank's receiver),
    driven by the transfer ops rank 0 records (``Lockstep.record_transfer``)."""

    def apply(self, op: TpKvOp, kv: KvRecord | None) -> None:
        """Repeat one ``x_*`` op on this rank's transport (``kv``: the op's row here)."""

    def status(self, rid: str) -> int:
        """This rank's part of ``rid``: 1 done, 0 under way, < 0 ended otherwise."""

    def forget(self, rid: str) -> None:
        """``rid``'s row is closed on rank 0: drop what is kept for its status."""

    def poll(self, timeout_s: float) -> None:
        """Move this rank's transfers on, waiting up to ``timeout_s`` for its sockets."""

    def sockets(self) -> list:
        """The sockets whose input means ``poll`` has work (a follower sleeps on them)."""

    def poll_within(self) -> float | None:
        """Seconds within which ``poll`` must run again with no socket waking it (NIXL);
        None: whenever."""

    def close(self) -> None:
        """Stop every transfer and drop its pins (before the pool closes)."""

    def readings(self) -> list[tuple[str, dict[str, str], float]]:
        """This rank's transport counters and data paths as metric readings."""

    def take_completed(self) -> list[tuple[str, int, int, float, str]]:
        """Transfers completed on this rank since the last call: (direction, pages,
        bytes, seconds, path), as ``WorkerMetrics.on_transfer`` counts them."""


class HostOps(Protocol):
    """A follower's host tier, driven by the host ops rank 0 records (``h_*``,
    ``common.node.tp.host``)."""

    def apply(self, op: TpKvOp) -> None:
        """Repeat one ``h_*`` op on this rank's host tier."""

    def abandon(self) -> None:
        """Rank 0 is gone: drop the copies' pins, close the host log."""


Reporter = Callable[[bool], RankReport]
"""Builds this rank's report for a ``health`` step (argument: the final one)."""


class Mirror:
    """A follower's cache and runner, driven by the leader's steps.

    ``apply`` returns False after the ``stop`` step. A step that does not fit this rank's
    state (other page ids, an unknown row) raises ``GroupLost``: the ranks diverged and
    computing on would write KV into the wrong slots.
    """

    def __init__(self, runner: ModelRunner, rank: int, transfer: RankTransfer | None = None,
                 group=None, reporter: Reporter | None = None,
                 host: HostOps | None = None) -> None:
        self.runner, self.cache, self.rank = runner, runner.cache, rank
        self.transfer, self.group, self.host = transfer, group, host
        self.reporter = reporter or (lambda _final: RankReport(self.log_problems()))
        self.rows: dict[str, KvRecord] = {}
        self.held: dict[str, set[int]] = {}  # row page indices each row still holds
        self.cache_owners: set[str] = set()
        self.pins: dict[int, int] = {}  # rank 0's pin id -> this rank's
        self.closed = False

    def apply(self, frame: bytes) -> bool:
        try:
            step = CODEC.decode(frame)
            for raw in step.ops:
                self._op(OP_CODEC.decode(raw))
        except (DecodeError, ValueError, KeyError, IndexError, AssertionError) as exc:
            raise GroupLost(f"tp rank {self.rank}: step does not fit this rank ({exc})") \
                from exc
        if step.kind == "stop":
            return False
        if step.kind in ("forward", "forward_all"):
            self._forward(step)
        elif step.kind == "agree":  # same count on every rank: rank 0 sent the rids
            self.group.all_min([self.transfer.status(rid) if self.transfer else 1
                                for rid in step.owners])
        elif step.kind == "health":
            self.group.gather_bytes(encode_report(self.reporter(step.final)))
        return True

    def log_problems(self, final: bool = False) -> str:
        """This rank's free logs that cannot write now ("" when they all can); ``final``:
        also those that lost events or never finished writing (what the worker's final
        stats say of its own, ``freelog_problem``)."""
        failing = [h.summary() for h in log_problems() if final or not h.ok]
        return f"tp rank {self.rank}: {'; '.join(failing)}" if failing else ""

    def _forward(self, step: TpStep) -> None:
        ids = unpack_ids(step.tokens, "tokens").tolist()
        items, at = [], 0
        for owner, start, n in zip(step.owners, step.starts, step.lengths):
            items.append(BatchItem(self.rows[owner], ids[at:at + n], start))
            at += n
        if step.kind == "forward":
            self.runner.forward(items, draft=step.draft)
        else:
            self.runner.forward_all(items, draft=step.draft)

    def _op(self, op: TpKvOp) -> None:  # noqa: C901 - one branch per op, flat on purpose
        c = self.cache
        kv = self.rows.get(op.owner)
        if kv is not None and op.counters:
            (kv.allocated_len, kv.committed_len, kv.swa_evicted_seqlen,
             kv.protected_len) = op.counters
        if op.op.startswith("x_"):
            if self.transfer is None:
                raise ValueError(f"transfer op {op.op!r} on a rank without a transport")
            self.transfer.apply(op, kv)
        elif op.op.startswith("h_"):
            if self.host is None:
                raise ValueError(f"host op {op.op!r} on a rank without a host tier")
            self.host.apply(op)
        elif op.op == "open":
            self.rows[op.owner] = c.open_row(op.owner)
            self.held[op.owner] = set()
        elif op.op == "extend":
            first = -(-kv.allocated_len // c.page_size)
            c.extend(kv, op.n)
            mine = c.pages(kv, first * c.page_size, kv.allocated_len) \
                if len(op.pages) else np.empty(0, np.int32)
            theirs = unpack_ids(op.pages, "pages")
            if not np.array_equal(mine, theirs):
                raise ValueError(f"{op.owner}: rank 0 allocated pages {theirs.tolist()}, "
                                 f"this rank {mine.tolist()}")
            self.held[op.owner].update(range(first, first + len(mine)))
        elif op.op == "commit":
            c.commit(kv, op.n)
        elif op.op == "close_row":
            c.close_row(self.rows.pop(op.owner))
            del self.held[op.owner]
            if self.transfer is not None:
                self.transfer.forget(op.owner)
        elif op.op == "free":
            r = op.ranges
            spans = [(r[i], r[i + 1]) for i in range(0, len(r), 2)]
            c.free_kv_row(kv, spans, reason=op.text)
            self._drop(op.owner, spans)
        elif op.op == "evict":
            c.evict_window(kv, op.n)
        elif op.op == "handoff":
            self._drop(op.owner, [(kv.protected_len, op.n)])
            c.handoff(kv, op.n, op.text)
            self.cache_owners.add(op.text)
        elif op.op == "free_pages":
            c.free_pages(op.owner, unpack_ids(op.pages, "pages"), reason=op.text, pool=op.pool)
        elif op.op in ("pin", "pin_pages"):
            pin_id = c.pin(kv, op.n, op.m, reason=op.text) if op.op == "pin" else \
                c.pin_pages(unpack_ids(op.pages, "pages"), reason=op.text, pool=op.pool)
            self.pins[op.ranges[0]] = pin_id
        elif op.op == "unpin":
            c.unpin(self.pins.pop(op.n))
        elif op.op == "close":
            self.close_transfer()  # its pins go before the pool closes
            c.close(op.retained)
            self.closed = True
        else:
            raise ValueError(f"unknown op {op.op!r}")

    def _drop(self, owner: str, spans: list[tuple[int, int]]) -> None:
        ps = self.cache.page_size
        for start, end in spans:
            self.held[owner].difference_update(range(start // ps, -(-end // ps)))

    def abandon(self) -> None:
        """Rank 0 is gone: give back every page this rank holds (reason ``peer_lost``)
        and close the free log, so it replays clean."""
        if self.closed:
            return
        self.close_transfer()
        if self.host is not None:
            self.host.abandon()
        for pin_id in sorted(self.pins.values()):
            self.cache.unpin(pin_id)
        self.pins.clear()
        ps = self.cache.page_size
        for owner, kv in list(self.rows.items()):
            spans = [(i * ps, min((i + 1) * ps, kv.allocated_len))
                     for i in sorted(self.held[owner])]  # touching spans are merged
            self.cache.free_kv_row(kv, spans, reason="peer_lost")
            self.cache.close_row(kv)
        self.rows.clear()
        self.held.clear()
        self.cache.close(sorted(self.cache_owners))
        self.closed = True

    def close_transfer(self) -> None:
        """Close this rank's KV transport (once): Bye to its peers, its pins dropped."""
        transfer, self.transfer = self.transfer, None
        if transfer is not None:
            transfer.close()
