"""``pdkv replay``: verify free logs offline (docs/design.md, "The free log"; docs/freelog.md).

Replay rebuilds every pool page by page from the recorded events and reports each
violation with the event's seq, the page, the owner and the last event that changed the
page (alloc, free, release, handoff; pins are reported through the live pin table).
Memory is bounded by the pool sizes: one state word, one pin count and one "last
change" word per page, the live pins, and an owner table that is compacted when it
outgrows the pools.

Page states are packed with the owner id into one int per page (replay_state.py). The
hot loop and the fast checks of each event are here; what a clean log never reaches is
in two mixins: the slow paths that diagnose bad pages (replay_diagnose.py) and the rare
events, close and ``lost`` markers among them (replay_rare.py).

Speed: the hot loop keeps per-page state in Python lists and numpy out of the way (a
numpy call costs about a microsecond, a list item a few tens of nanoseconds, half the
cost of a memoryview item over a numpy array). Any page that fails a check sends the
event to a slow path that diagnoses every page; a clean log never takes it.
"""

from __future__ import annotations

import os
import struct
import time
from typing import Any

import numpy as np

from common.freelog.digests import DigestLedger
from common.freelog.progress import ProgressBar
from common.freelog.reader import DECODE_ERRORS, FreeLogReader
from common.freelog.replay_diagnose import Diagnosis
from common.freelog.replay_rare import RareEvents
from common.freelog.replay_state import (
    NO_OWNER,
    OP_ALLOC,
    OP_FREE,
    OP_HANDOFF,
    OP_RELEASE,
    OWNED,
    PENDING,
    RESERVED,
    SMALL_EVENT,
    PoolState,
    short_pages,
    signed,
)
from common.freelog.report import ReplayReport

# Pages of events up to SMALL_EVENT long are decoded by a precompiled struct (longer
# ones in replay_rare.py), as unsigned so that a negative id indexes past the end and
# raises IndexError like any other out-of-range id: the hot loop needs no range check.
_UNPACK = {n: struct.Struct(f"<{n}I").unpack for n in range(SMALL_EVENT + 1)}
CHECK_EVERY = 1 << 16  # events between checkpoints (progress, owner-table compaction)
MAX_STORED_VIOLATIONS = 1000



class Replayer(Diagnosis, RareEvents):
    """Replays one free log. Use :func:`replay_file` unless you stream records yourself."""

    def __init__(self, reader: FreeLogReader, *,
                 progress: ProgressBar | None = None,
                 max_violations: int = MAX_STORED_VIOLATIONS):
        self.reader = reader
        self.report = ReplayReport(path=reader.path, node=reader.header.node)
        self.pools = {name: PoolState(info) for name, info in reader.header.pools.items()}
        self._owner_ids: dict[Any, int] = {}
        self._owner_names: list[Any] = []
        self._moved: set[Any] = set()
        """Owners freed ``migrated``: that attempt is over in this log (by name: owner
        ids are renumbered as the log goes)."""
        self._expect: tuple[PoolState, list[int], int] | None = None  # release due after unpin
        self._closed = False
        self._gap_seq: int | None = None  # seq of the first lost marker: judging stopped
        self._max_violations = max_violations
        self._progress = progress
        self._next_heavy = CHECK_EVERY
        self._checkpoint_offset = reader.offset()
        self.ledger = DigestLedger(reader.header.node)
        self._handlers = {"alloc": self._alloc, "free": self._free, "pin": self._pin,
                          "unpin": self._unpin, "release": self._release,
                          "handoff": self._handoff}

    # -- the hot loop ---------------------------------------------------------------------
    def run(self) -> ReplayReport:
        """Replay every record and judge the end of the log."""
        t0 = time.perf_counter()
        corrupt = None
        try:
            self._loop()
        except DECODE_ERRORS as exc:
            corrupt = f"{type(exc).__name__}: {exc}"
        self._finish(corrupt)
        self.report.seconds = time.perf_counter() - t0
        return self.report

    def _loop(self) -> int:
        pools, handlers, unpack = self.pools, self._handlers, _UNPACK
        seq_next = count = 0
        check_at = CHECK_EVERY
        expect_release = False  # the previous event was an unpin that dropped pages
        try:
            for count, ev in enumerate(self.reader.records, 1):
                try:
                    seq, op, raw, ps = ev["seq"], ev["op"], ev["pages"], pools[ev["pool"]]
                    handler = handlers[op]
                    # KeyError past SMALL_EVENT pages; struct.error unless whole int32s.
                    pages = unpack[len(raw) >> 2](raw)
                except (KeyError, TypeError, struct.error):
                    # close, unknown op or pool, malformed: all rare, all judged slowly.
                    seq_next = self._odd_event(ev, seq_next, count)
                    expect_release = self._expect is not None
                    if self._closed:
                        count += self._after_close()
                        break
                    if self._gap_seq is not None:
                        count += self._after_gap(seq_next)
                        break
                    continue
                if seq != seq_next:
                    self._seq_gap(seq, seq_next)
                seq_next = seq + 1
                if expect_release and op != "release":
                    self._missing_release(seq)
                try:
                    expect_release = handler(ps, pages, ev, seq)
                except (KeyError, TypeError) as exc:
                    expect_release = self._expect is not None
                    self._violate(seq, "malformed-event", ev.get("pool", ""),
                                  f"{op} event lacks or mistypes a key ({exc!r})")
                if count >= check_at:
                    check_at = count + self._checkpoint(count, ev)
        finally:
            self.report.events = count
        return count

    # -- events on the fast path; each falls back to a slow twin on any bad page ----------
    def _alloc(self, ps: PoolState, pages: tuple[int, ...], ev: dict, seq: int) -> None:
        owner = ev["owner"]
        oid = self._owner_ids.get(owner)
        if oid is None:
            oid = self._intern(owner)
            if "~" in owner:   # a later attempt of a request that moved here (maybe)
                self.report.attempts.append(owner)
        elif self._moved and owner in self._moved:
            self._violate(seq, "alloc-after-migrated", ev["pool"], f"alloc by {owner!r} "
                          "after it was freed 'migrated': an attempt that moved to another "
                          "worker took pages here again", owner=str(owner),
                          num_pages=len(pages))
        new, tag = oid << 2 | OWNED, seq << 3 | OP_ALLOC
        own, last = ps.own, ps.last
        try:
            for p in pages:
                if own[p] & 3:  # not FREE (a page listed twice is OWNED the second time)
                    break
                own[p] = new
                last[p] = tag
            else:
                n = len(pages)
                ps.pages_allocated += n
                in_use = ps.in_use = ps.in_use + n
                if in_use > ps.peak:
                    ps.peak, ps.peak_seq = in_use, seq
                ps.num_allocs += 1
                return None
        except IndexError:  # a page id out of range
            pass
        self._alloc_slow(ps, pages, owner, oid, seq)

    @staticmethod
    def _count_alloc(ps: PoolState, n: int, seq: int) -> None:
        ps.num_allocs += 1
        ps.pages_allocated += n
        ps.in_use += n
        if ps.in_use > ps.peak:
            ps.peak, ps.peak_seq = ps.in_use, seq

    def _free(self, ps: PoolState, pages: tuple[int, ...], ev: dict, seq: int) -> None:
        owner, reason = ev["owner"], ev["reason"]
        oid = self._owner_ids.get(owner)
        if oid is None:
            oid = self._intern(owner)
        if reason == "migrated" and owner not in self._moved:
            self._moved.add(owner)
            self.report.migrated.append(owner)
        held, tag = oid << 2 | OWNED, seq << 3 | OP_FREE
        own, pins, last = ps.own, ps.pins, ps.last
        freed = held - OWNED  # FREE, and the owner id is kept for messages
        pending = 0
        try:
            for p in pages:
                if own[p] != held:
                    break
                if pins[p]:  # freed while pinned: free at the last unpin
                    own[p] = held + (PENDING - OWNED)
                    pending += 1
                else:
                    own[p] = freed
                last[p] = tag
            else:
                return self._count_free(ps, len(pages), pending, reason)
        except IndexError:
            pass
        self._free_slow(ps, pages, owner, oid, reason, seq)

    @staticmethod
    def _count_free(ps: PoolState, n: int, pending: int, reason: str) -> None:
        ps.counts["free"] += 1
        ps.pages_freed += n
        ps.in_use -= n - pending
        by_reason = ps.freed_by_reason.get(reason)
        if by_reason is None:
            by_reason = ps.freed_by_reason[reason] = [0, 0]
        by_reason[0] += 1
        by_reason[1] += n

    def _pin(self, ps: PoolState, pages, ev: dict, seq: int) -> None:
        pin_id, reason = ev["pin"], ev["reason"]
        ps.counts["pin"] += 1
        ps.pins_by_reason[reason] = ps.pins_by_reason.get(reason, 0) + 1
        if pin_id in ps.live:
            old_seq = ps.live[pin_id][2]
            return self._violate(seq, "duplicate-pin", ps.info.name,
                                 f"pin id {pin_id} is already live (pinned at seq {old_seq});"
                                 " this pin is ignored")
        own, pins = ps.own, ps.pins
        try:
            for p in pages:
                if not 0 < own[p] & 3 < RESERVED:  # neither OWNED nor PENDING
                    break
                pins[p] += 1
            else:
                ps.live[pin_id] = (ev["pages"], pages, seq, reason)
                return None
        except IndexError:
            pass
        applied = self._pin_slow(ps, pages, pin_id, seq)
        ps.live[pin_id] = (ev["pages"], applied, seq, reason)

    def _unpin(self, ps: PoolState, pages, ev: dict, seq: int) -> None:
        pin_id = ev["pin"]
        ps.counts["unpin"] += 1
        if "xfer" in ev or "store" in ev or "load" in ev:  # what the pinned I/O moved
            self.ledger.take(ev, ps.info.name, signed(pages), seq)
        entry = ps.live.pop(pin_id, None)
        if entry is None:
            return self._unknown_unpin(ps, pages, pin_id, seq)
        raw, pinned, _, _ = entry
        if raw != ev["pages"]:
            self._violate(seq, "unpin-pages-mismatch", ps.info.name,
                          f"unpin of pin {pin_id} lists pages {short_pages(signed(pages))}, "
                          f"the pin listed {short_pages(signed(pinned))}; the pin's pages count")
        drop = []  # pages whose last pin this is and whose owner freed them meanwhile
        own, pins = ps.own, ps.pins
        for p in pinned:
            c = pins[p] - 1
            pins[p] = c
            if not c and own[p] & 3 == PENDING:
                drop.append(p)
        if drop:
            self._expect = (ps, drop, seq)
            return True
        return False

    def _release(self, ps: PoolState, pages, ev: dict, seq: int) -> None:
        ps.counts["release"] += 1
        expect, self._expect = self._expect, None
        listed = signed(pages)
        if expect is None or expect[0] is not ps:
            return self._violate(seq, "unexpected-release", ps.info.name,
                                 f"release of pages {short_pages(listed)} that no unpin just "
                                 "dropped; ignored", page=listed[0] if listed else None)
        _, drop, unpin_seq = expect
        if sorted(listed) != sorted(drop):
            missing, extra = sorted(set(drop) - set(listed)), sorted(set(listed) - set(drop))
            self._violate(seq, "release-mismatch", ps.info.name,
                          f"release after the unpin at seq {unpin_seq} must list exactly "
                          f"the pending pages {short_pages(sorted(drop))}; missing "
                          f"{short_pages(missing)}, extra {short_pages(extra)}",
                          page=(missing or extra)[0])
        self._free_pending(ps, drop, seq)

    def _free_pending(self, ps: PoolState, drop: list[int], seq: int) -> None:
        """Pages whose last pin dropped are free, whatever the release event says."""
        own, last, tag = ps.own, ps.last, seq << 3 | OP_RELEASE
        for p in drop:
            own[p] = own[p] - PENDING  # keeps the owner id, for messages
            last[p] = tag
        ps.in_use -= len(drop)
        ps.pages_released += len(drop)

    def _handoff(self, ps: PoolState, pages, ev: dict, seq: int) -> None:
        owner, to = ev["owner"], ev["to"]
        oid, tid = self._owner_id(owner), self._owner_id(to)
        held, new, tag = oid << 2 | OWNED, tid << 2 | OWNED, seq << 3 | OP_HANDOFF
        ps.counts["handoff"] += 1
        ps.pages_handed_off += len(pages)
        listed = signed(pages)
        bad = [p for p in listed if not 0 <= p < ps.info.num_pages
               or ps.own[p] != held]
        if bad or len(set(listed)) != len(listed):
            kinds = [self._why_not_held(ps, p, oid) for p in bad] or ["duplicate-page"]
            self._violate(seq, "handoff-not-held", ps.info.name,
                          f"{owner} hands off pages {short_pages(bad or listed)} to {to} but "
                          f"does not hold them ({kinds[0]}); those pages stay put",
                          page=(bad or listed)[0], owner=str(owner), num_pages=len(bad))
        for p in listed:
            if p not in bad:
                ps.own[p] = new
                ps.last[p] = tag


    # -- owners ----------------------------------------------------------------------------
    def _owner_id(self, owner: Any) -> int:
        oid = self._owner_ids.get(owner)
        return self._intern(owner) if oid is None else oid

    def _intern(self, owner: Any) -> int:
        if not isinstance(owner, str):
            raise TypeError(f"owner {owner!r} is not a string")
        oid = self._owner_ids[owner] = len(self._owner_names)
        self._owner_names.append(owner)
        return oid

    def _owner_name(self, oid: int) -> str:
        return self._owner_names[oid] if 0 <= oid < len(self._owner_names) else "nobody"

    def _compact_owners(self) -> None:
        """Forget owners that no page mentions, so memory follows the pools, not the log."""
        words = {name: np.asarray(ps.own, dtype=np.int64) for name, ps in self.pools.items()}
        used = np.unique(np.concatenate([w >> 2 for w in words.values()]))
        used = used[used >= 0]
        remap = np.full(len(self._owner_names) + 1, NO_OWNER, dtype=np.int64)
        remap[used + 1] = np.arange(len(used))  # index + 1 so that NO_OWNER maps to itself
        for name, w in words.items():
            self.pools[name].own = (remap[(w >> 2) + 1] << 2 | (w & 3)).tolist()
        self._owner_names = [self._owner_names[i] for i in used.tolist()]
        self._owner_ids = {name: i for i, name in enumerate(self._owner_names)}

    # -- checkpoints and the end of the log --------------------------------------------------
    def _checkpoint(self, count: int, ev: dict) -> int:
        """Runs every few events; returns how many events until the next one."""
        if count >= self._next_heavy:
            self._next_heavy = count + CHECK_EVERY
            self._checkpoint_offset = self.reader.offset()
            if self._progress is not None:
                self._progress.update(self._checkpoint_offset, count)
            if len(self._owner_names) > 4 * sum(p.capacity for p in self.pools.values()):
                self._compact_owners()
        return CHECK_EVERY

    def _finish(self, corrupt: str | None) -> None:
        report = self.report
        if self._expect is not None:
            self._missing_release(-1)
        if corrupt is None:
            end, corrupt = self.reader.scan_tail(self._checkpoint_offset)
            torn = self.reader.size - end
            if corrupt is None and torn > 0:
                report.warnings.append(
                    f"torn last record: {torn} byte(s) after offset {end} ignored "
                    "(the writer stopped mid-record, e.g. a crash)")
        else:
            end, _ = self.reader.scan_tail(self._checkpoint_offset)
        if corrupt is not None:
            self._violate(-1, "corrupt-data", "",
                          f"undecodable bytes after offset {end} ({corrupt}); "
                          "the rest of the log was not read")
        if not self._closed:
            held = sum(ps.in_use for ps in self.pools.values())
            pins = sum(len(ps.live) for ps in self.pools.values())
            report.warnings.append(
                f"no close event: the process did not shut down cleanly (killed?); "
                f"{held} page(s) in use and {pins} live pin(s) at the end are not judged")
        report.pools = {name: ps.stats() for name, ps in self.pools.items()}
        for v in self.ledger.findings:   # digests that disagree, messages refused
            self._violate(v.seq, v.kind, v.pool, v.message, owner=v.owner, pages=v.pages,
                          num_pages=v.num_pages, page=v.page)
        report.digests = dict(self.ledger.counts)
        report.ledger = self.ledger



# -- the public entry points ---------------------------------------------------------------
def replay_file(path: str | os.PathLike, *,
                progress: bool = False,
                max_violations: int = MAX_STORED_VIOLATIONS) -> ReplayReport:
    """Replay one free log and return its report (``report.ok`` when it is clean).

    Args:
        path: the free log.
        progress: draw a progress bar on stderr.
        max_violations: how many violations to keep in the report (all are counted).

    Raises:
        UnreadableLog: the file is missing, not msgpack, or not a version-1 free log.
    """
    with FreeLogReader(path) as reader:
        label = f"replay {os.path.basename(reader.path)}"
        bar = ProgressBar(label, reader.size) if progress else None
        try:
            return Replayer(reader, progress=bar,
                            max_violations=max_violations).run()
        finally:
            if bar is not None:
                bar.close()
