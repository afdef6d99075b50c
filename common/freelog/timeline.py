"""What a free log says over time, for pictures: pages by state, frees by reason, and
one request's pages (``pdkv replay --plot``, ``--request``).

A second, forgiving pass over the log (replay judges; this only counts): per pool, pages
``owned`` (held, no I/O on them), ``pinned`` (held, with in-flight I/O) and ``pending``
(freed while pinned, free at their last unpin) after each event, sampled down to about
``MAX_POINTS`` points; every free with its reason and page count; and, for one request
id, how many pages it holds and how many of those are pinned, in every pool of the log.
Events it cannot read are skipped; at a ``lost`` marker the counts stop (what the lost
events did is unknown) and the gap's time is kept.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

from common.freelog.reader import DECODE_ERRORS, FreeLogReader

MAX_POINTS = 2048
FREE, OWNED, PENDING, RESERVED = 0, 1, 2, 3


@dataclass
class PoolSeries:
    """Pages by state of one pool over time (equal-length lists)."""

    name: str
    capacity: int
    t_s: list[float] = field(default_factory=list)
    owned: list[int] = field(default_factory=list)
    pinned: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max((a + b + c for a, b, c in zip(self.owned, self.pinned, self.pending)),
                   default=0)


@dataclass
class RequestTrack:
    """One request's pages in one log: held and pinned after each event that touched them,
    and its own events (``alloc``, ``free`` with reason, ``handoff``)."""

    rid: str
    t_s: list[float] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    pinned: list[int] = field(default_factory=list)
    events: list[tuple[float, str, int, str]] = field(default_factory=list)  # t, op, n, why


@dataclass
class Timeline:
    """One log's series. ``t0_unix_s`` places its clock on the wall clock, so that the
    logs of several processes share one time axis."""

    path: str
    node: str
    t0_unix_s: float
    pools: dict[str, PoolSeries]
    frees: list[tuple[float, str, int]] = field(default_factory=list)  # t_s, reason, pages
    gaps: list[float] = field(default_factory=list)  # t_s of each lost marker
    request: RequestTrack | None = None

    @property
    def end_s(self) -> float:
        return max((s.t_s[-1] for s in self.pools.values() if s.t_s), default=0.0)


class _PoolState:
    __slots__ = ("series", "state", "pins", "held", "pinned", "pending", "mine")

    def __init__(self, name: str, num_pages: int, reserved: tuple[int, ...]):
        self.state = [FREE] * num_pages
        for p in {0, *reserved}:
            self.state[p] = RESERVED
        self.pins = [0] * num_pages
        self.series = PoolSeries(name, num_pages - len({0, *reserved}))
        self.held = self.pinned = self.pending = 0  # held counts pinned ones too
        self.mine: set[int] = set()  # pages the tracked request holds


class _Builder:
    def __init__(self, reader: FreeLogReader, rid: str | None):
        header = reader.header
        self.pools = {n: _PoolState(n, p.num_pages, p.reserved) for n, p in header.pools.items()}
        created = header.created_unix_ns or 0
        self.timeline = Timeline(reader.path, header.node, created / 1e9,
                                 {n: s.series for n, s in self.pools.items()})
        self.rid = rid
        self.track = self.timeline.request = RequestTrack(rid) if rid is not None else None
        self.stride, self.count, self.stopped = 1, 0, False
        self.last_t = 0.0

    def feed(self, ev: dict) -> None:
        op, t_s = ev.get("op"), ev.get("t_ns", 0) / 1e9
        self.last_t = max(self.last_t, t_s)
        if op == "lost":
            self.timeline.gaps.append(t_s)
            self.stopped = True
        if self.stopped or op not in _OPS:
            return
        ps = self.pools[ev["pool"]]
        raw = ev["pages"]
        pages = struct.unpack(f"<{len(raw) >> 2}I", raw)  # a negative id: IndexError
        touched = _OPS[op](self, ps, pages, ev)
        if op == "free":
            self.timeline.frees.append((t_s, str(ev.get("reason", "")), len(pages)))
        if touched and self.track is not None:
            self._track(ps, t_s, op, len(pages), ev)
        self.count += 1
        if self.count % self.stride == 0:
            self._sample(t_s)

    # -- page transitions --------------------------------------------------------------
    def _alloc(self, ps: _PoolState, pages, ev) -> bool:
        mine = self._is_tracked(ev.get("owner"))
        for p in pages:
            if ps.state[p] == FREE:
                ps.state[p] = OWNED
                ps.held += 1
                ps.pinned += ps.pins[p] > 0
            if mine:
                ps.mine.add(p)
        return mine

    def _free(self, ps: _PoolState, pages, ev) -> bool:
        for p in pages:
            if ps.state[p] != OWNED:
                continue
            ps.held -= 1
            if ps.pins[p]:
                ps.pinned -= 1
                ps.state[p] = PENDING
                ps.pending += 1
            else:
                ps.state[p] = FREE
        return self._drop_mine(ps, pages, ev)

    def _pin(self, ps: _PoolState, pages, ev) -> bool:
        for p in pages:
            ps.pins[p] += 1
            if ps.pins[p] == 1 and ps.state[p] == OWNED:
                ps.pinned += 1
        return bool(ps.mine) and not ps.mine.isdisjoint(pages)

    def _unpin(self, ps: _PoolState, pages, ev) -> bool:
        for p in pages:
            if ps.pins[p] <= 0:
                continue
            ps.pins[p] -= 1
            if ps.pins[p]:
                continue
            if ps.state[p] == OWNED:
                ps.pinned -= 1
            elif ps.state[p] == PENDING:
                ps.state[p] = FREE
                ps.pending -= 1
        return bool(ps.mine) and not ps.mine.isdisjoint(pages)

    def _handoff(self, ps: _PoolState, pages, ev) -> bool:
        if self._is_tracked(ev.get("to")):
            ps.mine.update(pages)
            return True
        return self._drop_mine(ps, pages, ev)

    def _drop_mine(self, ps: _PoolState, pages, ev) -> bool:
        if not self._is_tracked(ev.get("owner")):
            return False
        ps.mine.difference_update(pages)
        return True

    def _is_tracked(self, owner) -> bool:
        """``owner`` is the tracked request: its router id (``LABEL#RUN-N``, what logs
        record), or any submission of the label its client knows (the front door's
        ``cmpl-...`` id, ``pdkv run --output``'s rid)."""
        if self.rid is None or not isinstance(owner, str):
            return False
        return owner == self.rid or owner.rsplit("#", 1)[0] == self.rid

    # -- samples ------------------------------------------------------------------------
    def _track(self, ps: _PoolState, t_s: float, op: str, n: int, ev: dict) -> None:
        tr = self.track
        tr.t_s.append(t_s)
        tr.held.append(sum(len(s.mine) for s in self.pools.values()))
        tr.pinned.append(sum(1 for s in self.pools.values() for p in s.mine if s.pins[p]))
        if op in ("alloc", "free", "handoff") and (self._is_tracked(ev.get("owner"))
                                                   or self._is_tracked(ev.get("to"))):
            why = str(ev.get("reason", "")) if op == "free" else str(ev.get("to", ""))
            tr.events.append((t_s, f"{ev.get('pool')}:{op}", n, why if op != "alloc" else ""))

    def _sample(self, t_s: float) -> None:
        for ps in self.pools.values():
            s = ps.series
            s.t_s.append(t_s)
            s.owned.append(ps.held - ps.pinned)
            s.pinned.append(ps.pinned)
            s.pending.append(ps.pending)
        if len(next(iter(self.pools.values())).series.t_s) >= 2 * MAX_POINTS:
            for ps in self.pools.values():
                _halve(ps.series)
            self.stride *= 2


def _halve(s: PoolSeries) -> None:
    """Keep the fuller sample of each pair (peaks survive), whole, with its own time."""
    keep = [i if s.owned[i] + s.pinned[i] + s.pending[i] >= s.owned[i + 1] + s.pinned[i + 1]
            + s.pending[i + 1] else i + 1 for i in range(0, len(s.t_s) - 1, 2)]
    for name in ("t_s", "owned", "pinned", "pending"):
        col = getattr(s, name)
        setattr(s, name, [col[i] for i in keep])


_OPS = {"alloc": _Builder._alloc, "free": _Builder._free, "pin": _Builder._pin,
        "unpin": _Builder._unpin, "handoff": _Builder._handoff,
        "release": lambda self, ps, pages, ev: False}


def build_timeline(path: str | os.PathLike, rid: str | None = None) -> Timeline:
    """Read one free log into a ``Timeline`` (``rid``: also track that request's pages).

    Raises:
        UnreadableLog: as replay (missing file, not a free log).
    """
    with FreeLogReader(path) as reader:
        builder = _Builder(reader, rid)
        try:
            for ev in reader.records:
                try:
                    builder.feed(ev)
                except (KeyError, TypeError, IndexError, AttributeError, struct.error):
                    continue  # replay reports it; a picture just leaves it out
        except DECODE_ERRORS:
            pass  # torn or corrupt tail: draw what came before
        if not builder.stopped:
            builder._sample(builder.last_t)  # the state at the end of the log
    return builder.timeline
