"""A follower rank's side of the lockstep (``common.model.tp_lockstep``): its own cache and
runner, driven by rank 0's steps."""

from __future__ import annotations

import numpy as np

from common.codec import DecodeError, unpack_ids
from common.kv import KvRecord
from common.model.runner import BatchItem, ModelRunner
from common.model.tp_lockstep import CODEC, OP_CODEC, TpKvOp, TpStep
from common.parallel import GroupLost


class Mirror:
    """A follower's cache and runner, driven by the leader's steps.

    ``apply`` returns False after the ``stop`` step. A step that does not fit this rank's
    state (other page ids, an unknown row) raises ``GroupLost``: the ranks diverged and
    computing on would write KV into the wrong slots.
    """

    def __init__(self, runner: ModelRunner, rank: int) -> None:
        self.runner, self.cache, self.rank = runner, runner.cache, rank
        self.rows: dict[str, KvRecord] = {}
        self.held: dict[str, set[int]] = {}  # row page indices each row still holds
        self.cache_owners: set[str] = set()
        self.pins: set[int] = set()
        self.closed = False

    def apply(self, frame: bytes) -> bool:
        try:
            step = CODEC.decode(frame)
            for raw in step.ops:
                self._op(OP_CODEC.decode(raw))
        except (DecodeError, ValueError, KeyError, AssertionError) as exc:
            raise GroupLost(f"tp rank {self.rank}: step does not fit this rank ({exc})") \
                from exc
        if step.kind == "stop":
            return False
        if step.kind in ("forward", "forward_all"):
            self._forward(step)
        return True

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
        if op.op == "open":
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
            if pin_id != op.ranges[0]:
                raise ValueError(f"pin id {pin_id} here, {op.ranges[0]} on rank 0")
            self.pins.add(pin_id)
        elif op.op == "unpin":
            c.unpin(op.n)
            self.pins.discard(op.n)
        elif op.op == "close":
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
        for pin_id in sorted(self.pins):
            self.cache.unpin(pin_id)
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
