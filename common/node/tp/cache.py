"""The KV pool of a tensor-parallel worker: rank 0 records every change, each follower
repeats it on a pool of its own (its KV heads, its own free log).

    rank 0 (LeaderKvCache)               a follower (CacheMirror)
    open      a row for a request         opens the same row
    extend    new pages (their ids)       takes exactly those page ids (each must be
                                          free here: not pinned by this rank's transport)
    commit, evict, handoff                the same, on its row
    free      row ranges, reason          frees the same ranges, same reason
    close_row, free_pages                 the same
    pin, pin_pages, unpin                 the same (rank 0's pin id mapped to its own)
    close     the log's close event       closes its pool and log

Each op carries the row's counters as rank 0 had them before it (callers set counters
directly; ``free_kv_row`` leaves them to them). The transport's own pins are not
recorded (``RankPins``): every rank's transport pins its own pages, at its own pace.

Why a follower keeps an allocator of its own when its page ids are rank 0's by
construction: its transport's pins are its own, so only its own page states know
whether a page rank 0 hands out is still being read or written here; and only its own
free log lets ``pdkv replay`` prove that offline (docs/cluster.md, "Why a follower keeps
its own allocator and free log").
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import numpy as np

from common.control import pack_ids, unpack_ids
from common.kv import KvCache, KvRecord
from common.node.tp.lockstep import Lockstep, TpKvOp


def _counters(kv: KvRecord) -> list[int]:
    return [kv.allocated_len, kv.committed_len, kv.swa_evicted_seqlen, kv.protected_len]


def _reason(reason) -> str:
    return str(getattr(reason, "value", reason))


class LeaderKvCache(KvCache):
    """Rank 0's cache: a ``KvCache`` that tells ``lockstep`` every change it makes."""

    def __init__(self, *args, lockstep: Lockstep, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lockstep = lockstep
        self._jlock = threading.RLock()  # one op recorded in the order it was applied

    def _rec(self, op: str, kv: KvRecord | None = None, before: list[int] | None = None,
             **kw) -> None:
        self.lockstep.record(TpKvOp(op, kv.owner if kv else kw.pop("owner", ""),
                                    before or [], **kw))

    def open_row(self, owner: str) -> KvRecord:
        with self._jlock:
            kv = super().open_row(owner)
            self._rec("open", owner=owner)
            return kv

    def extend(self, kv: KvRecord, num_tokens: int, pages: np.ndarray | None = None) -> None:
        with self._jlock:
            before = _counters(kv)
            first = -(-kv.allocated_len // self.page_size)
            super().extend(kv, num_tokens, pages)
            last = -(-kv.allocated_len // self.page_size)
            new = self.pages(kv, first * self.page_size, kv.allocated_len) \
                if last > first else np.empty(0, np.int32)
            self._rec("extend", kv, before, n=num_tokens, pages=pack_ids(new))

    def commit(self, kv: KvRecord, num_tokens: int) -> None:
        with self._jlock:
            before = _counters(kv)
            super().commit(kv, num_tokens)
            self._rec("commit", kv, before, n=num_tokens)

    def close_row(self, kv: KvRecord) -> None:
        with self._jlock:
            before = _counters(kv)
            super().close_row(kv)
            self._rec("close_row", owner=kv.owner, before=before)

    def free_kv_row(self, kv: KvRecord, ranges: Iterable[Sequence[int]], *,
                    reason="finished") -> None:
        ranges = [tuple(r) for r in ranges]
        with self._jlock:
            before = _counters(kv)
            super().free_kv_row(kv, ranges, reason=reason)
            self._rec("free", kv, before, ranges=[int(x) for r in ranges for x in r],
                      text=_reason(reason))

    def evict_window(self, kv: KvRecord, upto: int) -> None:
        with self._jlock:
            before = _counters(kv)
            super().evict_window(kv, upto)
            self._rec("evict", kv, before, n=upto)

    def handoff(self, kv: KvRecord, end: int, to: str) -> None:
        with self._jlock:
            before = _counters(kv)
            super().handoff(kv, end, to)
            self._rec("handoff", kv, before, n=end, text=to)

    def free_pages(self, owner: str, pages: np.ndarray, *, reason, pool: str = "full") -> None:
        with self._jlock:
            super().free_pages(owner, pages, reason=reason, pool=pool)
            self._rec("free_pages", owner=owner, pages=pack_ids(np.asarray(pages, np.int32)),
                      text=_reason(reason), pool=pool)

    def pin(self, kv: KvRecord, start: int, end: int, *, reason: str) -> int:
        with self._jlock:
            before = _counters(kv)
            pin_id = super().pin(kv, start, end, reason=reason)
            self._rec("pin", kv, before, n=start, m=end, ranges=[pin_id], text=reason)
            return pin_id

    def pin_pages(self, pages: np.ndarray, *, reason: str, pool: str = "full") -> int:
        with self._jlock:
            pin_id = super().pin_pages(pages, reason=reason, pool=pool)
            self._rec("pin_pages", pages=pack_ids(np.asarray(pages, np.int32)), text=reason,
                      pool=pool, ranges=[pin_id])
            return pin_id

    def unpin(self, pin_id: int, record: dict | None = None) -> None:
        with self._jlock:
            super().unpin(pin_id, record)   # the record (digests) is this rank's log's
            self._rec("unpin", n=pin_id)

    def close(self, retained: Sequence[str] = ()) -> None:
        with self._jlock:
            super().close(retained)
            self._rec("close", retained=list(retained))


class RankPins:
    """Rank 0's cache as its KV transport sees it: the transport's pins are this rank's
    alone (each rank's transport pins its own pages, at its own pace), so they are not
    recorded for the followers; everything else is the cache itself."""

    def __init__(self, cache: LeaderKvCache) -> None:
        self._cache = cache

    def __getattr__(self, name: str):
        return getattr(self._cache, name)

    def pin_pages(self, pages: np.ndarray, *, reason: str, pool: str = "full") -> int:
        return KvCache.pin_pages(self._cache, pages, reason=reason, pool=pool)

    def unpin(self, pin_id: int, record: dict | None = None) -> None:
        KvCache.unpin(self._cache, pin_id, record)

    def pin(self, kv: KvRecord, start: int, end: int, *, reason: str) -> int:
        return KvCache.pin(self._cache, kv, start, end, reason=reason)


class CacheMirror:
    """A follower's cache, driven by rank 0's cache ops (``apply``).

    An op that does not fit this rank's cache (a page rank 0 allocated that is not free
    here, an unknown row or pin) raises ``ValueError``/``KeyError``, before anything
    changes; the ``Mirror`` turns it into ``GroupLost``."""

    def __init__(self, cache: KvCache) -> None:
        self.cache = cache
        self.rows: dict[str, KvRecord] = {}
        self.held: dict[str, set[int]] = {}  # row page indices each row still holds
        self.cache_owners: set[str] = set()
        self.pins: dict[int, int] = {}  # rank 0's pin id -> this rank's
        self.closed = False

    def row(self, op: TpKvOp) -> KvRecord | None:
        """The op's row here, its counters set to rank 0's (None: no row of that owner)."""
        kv = self.rows.get(op.owner)
        if kv is not None and op.counters:
            (kv.allocated_len, kv.committed_len, kv.swa_evicted_seqlen,
             kv.protected_len) = op.counters
        return kv

    def apply(self, op: TpKvOp, kv: KvRecord | None) -> None:  # noqa: C901 - one per op
        c = self.cache
        if op.op == "open":
            self.rows[op.owner] = c.open_row(op.owner)
            self.held[op.owner] = set()
        elif op.op == "extend":
            first = -(-kv.allocated_len // c.page_size)
            theirs = unpack_ids(op.pages, "pages")
            try:
                c.extend(kv, op.n, theirs)
            except ValueError as exc:
                raise ValueError(f"{op.owner}: rank 0 allocated pages {theirs.tolist()}, "
                                 f"this rank cannot take them ({exc})") from exc
            self.held[op.owner].update(range(first, first + len(theirs)))
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
            self.pins[op.ranges[0]] = pin_id
        elif op.op == "unpin":
            c.unpin(self.pins.pop(op.n))
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
        and close the pool and its log, so it replays clean (this rank's transport is
        closed first: its pins are gone)."""
        if self.closed:
            return
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
