"""``pdkv replay``: verify free logs offline (docs/design.md, "The free log"; docs/freelog.md).

Replay rebuilds every pool page by page from the recorded events and reports each
violation with the event's seq, the page, the owner and the last event that changed the
page (alloc, free, release, handoff; pins are reported through the live pin table).
Memory is bounded by the pool sizes: one state word, one pin count and one "last
change" word per page, the live pins, and an owner table that is compacted when it
outgrows the pools.

Page states, packed with the owner id into one int per page (``owner_id << 2 | state``)
so that "does this owner hold this page" is a single comparison:

    FREE      on the free list (the owner id is the last owner, for messages)
    OWNED     held by its owner
    PENDING   freed by its owner while pinned; free again at the last unpin (+ release)
    RESERVED  never allocated (page 0, and the header's reserved list)

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

from common.freelog.aftergap import AfterGap
from common.freelog.progress import ProgressBar
from common.freelog.reader import DECODE_ERRORS, FreeLogReader, PoolInfo
from common.freelog.report import ReplayReport, Violation

FREE, OWNED, PENDING, RESERVED = 0, 1, 2, 3
_STATE_NAMES = ("free", "owned", "pending", "reserved")
_OPS = ("", "alloc", "free", "pin", "unpin", "release", "handoff")
OP_ALLOC, OP_FREE, OP_PIN, OP_UNPIN, OP_RELEASE, OP_HANDOFF = range(1, 7)
NO_OWNER = -1

# Page lists up to this size are decoded by a precompiled struct; longer ones compile
# their format on the way (struct caches it).
SMALL_EVENT = 256
# Pages are decoded as unsigned so that a negative id indexes past the end and raises
# IndexError like any other out-of-range id; the hot loop then needs no range check.
_UNPACK = {n: struct.Struct(f"<{n}I").unpack for n in range(SMALL_EVENT + 1)}
CHECK_EVERY = 1 << 16  # events between checkpoints (progress, owner-table compaction)
MAX_STORED_VIOLATIONS = 1000


class _Pool:
    """The replayed state of one pool: lists indexed by page id, and its counters."""

    __slots__ = ("info", "own", "pins", "last", "capacity", "live", "in_use", "peak",
                 "peak_seq", "pages_allocated", "pages_freed", "pages_released",
                 "pages_handed_off", "counts", "num_allocs", "freed_by_reason", "pins_by_reason")

    def __init__(self, info: PoolInfo):
        n = info.num_pages
        self.info = info
        # Python lists, not numpy arrays: a list item is read or written in about half
        # the time of a memoryview item over a numpy array, and a numpy call (about a
        # microsecond) only pays off above a few hundred pages. Values are shared int
        # objects (one per event), so memory stays a few tens of bytes per page.
        self.own = [NO_OWNER << 2 | FREE] * n  # owner id << 2 | state
        for p in {0, *info.reserved}:  # page 0 is padding, never allocated
            self.own[p] = NO_OWNER << 2 | RESERVED
        self.pins = [0] * n
        self.last = [0] * n  # seq << 3 | op code of the last event on the page; 0: none
        self.capacity = n - len({0, *info.reserved})
        self.live: dict[Any, tuple] = {}  # pin id -> (raw pages, pages, seq, reason)
        self.in_use = self.peak = self.peak_seq = 0
        self.pages_allocated = self.pages_freed = self.pages_released = 0
        self.pages_handed_off = 0
        self.counts = dict.fromkeys(_OPS[1:], 0)
        self.num_allocs = 0  # the most frequent event: an attribute is cheaper than a dict
        self.freed_by_reason: dict[str, list[int]] = {}  # reason -> [events, pages]
        self.pins_by_reason: dict[str, int] = {}

    def stats(self) -> dict[str, Any]:
        info = self.info
        return {"num_pages": info.num_pages, "page_size": info.page_size,
                "reserved": len(info.reserved), "capacity": self.capacity,
                "events": {**self.counts, "alloc": self.num_allocs},
                "pages_allocated": self.pages_allocated, "pages_freed": self.pages_freed,
                "pages_released": self.pages_released,
                "pages_handed_off": self.pages_handed_off,
                "peak_in_use": self.peak, "peak_seq": self.peak_seq,
                "in_use_at_end": self.in_use, "live_pins_at_end": len(self.live),
                "frees_by_reason": {r: {"events": e, "pages": p}
                                    for r, (e, p) in sorted(self.freed_by_reason.items())},
                "pins_by_reason": dict(sorted(self.pins_by_reason.items()))}


def _signed(pages) -> list[int]:
    """Page ids as the writer meant them (the fast path decodes them unsigned)."""
    return [p - (1 << 32) if p >= 1 << 31 else p for p in pages]


class Replayer:
    """Replays one free log. Use :func:`replay_file` unless you stream records yourself."""

    def __init__(self, reader: FreeLogReader, *,
                 progress: ProgressBar | None = None,
                 max_violations: int = MAX_STORED_VIOLATIONS):
        self.reader = reader
        self.report = ReplayReport(path=reader.path, node=reader.header.node)
        self.pools = {name: _Pool(info) for name, info in reader.header.pools.items()}
        self._owner_ids: dict[Any, int] = {}
        self._owner_names: list[Any] = []
        self._expect: tuple[_Pool, list[int], int] | None = None  # release due after unpin
        self._closed = False
        self._gap_seq: int | None = None  # seq of the first lost marker: judging stopped
        self._max_violations = max_violations
        self._progress = progress
        self._next_heavy = CHECK_EVERY
        self._checkpoint_offset = reader.offset()
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
    def _alloc(self, ps: _Pool, pages: tuple[int, ...], ev: dict, seq: int) -> None:
        owner = ev["owner"]
        oid = self._owner_ids.get(owner)
        if oid is None:
            oid = self._intern(owner)
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
    def _count_alloc(ps: _Pool, n: int, seq: int) -> None:
        ps.num_allocs += 1
        ps.pages_allocated += n
        ps.in_use += n
        if ps.in_use > ps.peak:
            ps.peak, ps.peak_seq = ps.in_use, seq

    def _free(self, ps: _Pool, pages: tuple[int, ...], ev: dict, seq: int) -> None:
        owner, reason = ev["owner"], ev["reason"]
        oid = self._owner_ids.get(owner)
        if oid is None:
            oid = self._intern(owner)
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
    def _count_free(ps: _Pool, n: int, pending: int, reason: str) -> None:
        ps.counts["free"] += 1
        ps.pages_freed += n
        ps.in_use -= n - pending
        by_reason = ps.freed_by_reason.get(reason)
        if by_reason is None:
            by_reason = ps.freed_by_reason[reason] = [0, 0]
        by_reason[0] += 1
        by_reason[1] += n

    def _pin(self, ps: _Pool, pages, ev: dict, seq: int) -> None:
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

    def _unpin(self, ps: _Pool, pages, ev: dict, seq: int) -> None:
        pin_id = ev["pin"]
        ps.counts["unpin"] += 1
        entry = ps.live.pop(pin_id, None)
        if entry is None:
            return self._unknown_unpin(ps, pages, pin_id, seq)
        raw, pinned, _, _ = entry
        if raw != ev["pages"]:
            self._violate(seq, "unpin-pages-mismatch", ps.info.name,
                          f"unpin of pin {pin_id} lists pages {_short(_signed(pages))}, "
                          f"the pin listed {_short(_signed(pinned))}; the pin's pages count")
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

    def _release(self, ps: _Pool, pages, ev: dict, seq: int) -> None:
        ps.counts["release"] += 1
        expect, self._expect = self._expect, None
        listed = _signed(pages)
        if expect is None or expect[0] is not ps:
            return self._violate(seq, "unexpected-release", ps.info.name,
                                 f"release of pages {_short(listed)} that no unpin just "
                                 "dropped; ignored", page=listed[0] if listed else None)
        _, drop, unpin_seq = expect
        if sorted(listed) != sorted(drop):
            missing, extra = sorted(set(drop) - set(listed)), sorted(set(listed) - set(drop))
            self._violate(seq, "release-mismatch", ps.info.name,
                          f"release after the unpin at seq {unpin_seq} must list exactly "
                          f"the pending pages {_short(sorted(drop))}; missing "
                          f"{_short(missing)}, extra {_short(extra)}",
                          page=(missing or extra)[0])
        self._free_pending(ps, drop, seq)

    def _free_pending(self, ps: _Pool, drop: list[int], seq: int) -> None:
        """Pages whose last pin dropped are free, whatever the release event says."""
        own, last, tag = ps.own, ps.last, seq << 3 | OP_RELEASE
        for p in drop:
            own[p] = own[p] - PENDING  # keeps the owner id, for messages
            last[p] = tag
        ps.in_use -= len(drop)
        ps.pages_released += len(drop)

    def _handoff(self, ps: _Pool, pages, ev: dict, seq: int) -> None:
        owner, to = ev["owner"], ev["to"]
        oid, tid = self._owner_id(owner), self._owner_id(to)
        held, new, tag = oid << 2 | OWNED, tid << 2 | OWNED, seq << 3 | OP_HANDOFF
        ps.counts["handoff"] += 1
        ps.pages_handed_off += len(pages)
        listed = _signed(pages)
        bad = [p for p in listed if not 0 <= p < ps.info.num_pages
               or ps.own[p] != held]
        if bad or len(set(listed)) != len(listed):
            kinds = [self._why_not_held(ps, p, oid) for p in bad] or ["duplicate-page"]
            self._violate(seq, "handoff-not-held", ps.info.name,
                          f"{owner} hands off pages {_short(bad or listed)} to {to} but "
                          f"does not hold them ({kinds[0]}); those pages stay put",
                          page=(bad or listed)[0], owner=str(owner), num_pages=len(bad))
        for p in listed:
            if p not in bad:
                ps.own[p] = new
                ps.last[p] = tag

    # -- slow paths: diagnose every page of an event that failed the fast checks ----------
    def _alloc_slow(self, ps: _Pool, pages, owner: Any, oid: int, seq: int) -> None:
        new, tag = oid << 2 | OWNED, seq << 3 | OP_ALLOC
        bad: dict[str, list[int]] = {}
        seen: set[int] = set()
        good = 0
        for p in _signed(pages):
            if not 0 <= p < ps.info.num_pages:
                bad.setdefault("page-out-of-range", []).append(p)
            elif p in seen:
                bad.setdefault("double-alloc", []).append(p)
            elif ps.own[p] == new and ps.last[p] == tag:
                good += 1  # applied by the fast path before it stopped
            elif ps.own[p] & 3 == FREE:
                ps.own[p], ps.last[p] = new, tag
                good += 1
            else:
                bad.setdefault(_ALLOC_KIND[ps.own[p] & 3], []).append(p)
            seen.add(p)
        for kind, ps_pages in bad.items():
            self._violate(seq, kind, ps.info.name,
                          f"alloc to {owner} of {len(ps_pages)} page(s) that are not free "
                          f"{self._describe(ps, ps_pages, seen_twice=kind == 'double-alloc')}"
                          "; not applied", page=ps_pages[0], owner=str(owner),
                          pages=ps_pages)
        self._count_alloc(ps, good, seq)

    def _free_slow(self, ps: _Pool, pages, owner: Any, oid: int, reason: str,
                   seq: int) -> None:
        held, tag = oid << 2 | OWNED, seq << 3 | OP_FREE
        bad: dict[str, list[int]] = {}
        seen: set[int] = set()
        good = pending = 0
        for p in _signed(pages):
            if not 0 <= p < ps.info.num_pages:
                bad.setdefault("page-out-of-range", []).append(p)
                continue
            v = ps.own[p]
            if p in seen:
                bad.setdefault("double-free", []).append(p)
            elif ps.last[p] == tag and v >> 2 == oid and v & 3 in (FREE, PENDING):
                good += 1  # applied by the fast path before it stopped
                pending += v & 3 == PENDING
            elif v == held:
                pinned = ps.pins[p] > 0
                ps.own[p], ps.last[p] = (held + 1 if pinned else held - 1), tag
                good += 1
                pending += pinned
            else:
                bad.setdefault(self._why_not_held(ps, p, oid), []).append(p)
            seen.add(p)
        for kind, bad_pages in bad.items():
            self._violate(seq, kind, ps.info.name,
                          f"free by {owner} (reason {reason}) of {len(bad_pages)} page(s) "
                          f"it does not hold "
                          f"{self._describe(ps, bad_pages)}; "
                          "not applied", page=bad_pages[0], owner=str(owner),
                          pages=bad_pages)
        self._count_free(ps, good, pending, reason)

    def _pin_slow(self, ps: _Pool, pages, pin_id: Any, seq: int) -> tuple[int, ...]:
        """Pins the pages that are owned or pending; returns them (the pin's pages)."""
        listed, applied, bad = _signed(pages), [], []
        # The fast loop pinned the pages before the first bad one.
        prefix_done = True
        for p in listed:
            ok = 0 <= p < ps.info.num_pages and ps.own[p] & 3 in (OWNED, PENDING)
            if ok and prefix_done:
                applied.append(p)
                continue
            prefix_done = False
            if ok:
                ps.pins[p] += 1
                applied.append(p)
            else:
                bad.append(p)
        if bad:
            self._violate(seq, "pin-free-page", ps.info.name,
                          f"pin {pin_id} of {len(bad)} page(s) that nobody holds "
                          f"{self._describe(ps, bad)}; those pages are not pinned",
                          page=bad[0], pages=bad)
        return tuple(applied)

    def _unknown_unpin(self, ps: _Pool, pages, pin_id: Any, seq: int) -> None:
        listed = _signed(pages)
        self._violate(seq, "unknown-unpin", ps.info.name,
                      f"unpin of pin {pin_id}, which is not live (never pinned or already "
                      f"unpinned); pages {_short(listed)}",
                      page=listed[0] if listed and 0 <= listed[0] < ps.info.num_pages
                      else None)

    def _why_not_held(self, ps: _Pool, p: int, oid: int) -> str:
        if not 0 <= p < ps.info.num_pages:
            return "page-out-of-range"
        v = ps.own[p]
        state = v & 3
        if state == RESERVED:
            return "free-reserved"
        if state == OWNED:
            return "foreign-free"
        return "double-free"  # free, or pending (freed earlier while pinned)

    def _describe(self, ps: _Pool, pages: list[int], seen_twice: bool = False) -> str:
        """``[5 (owned by req-1), 6 (free), ...]`` for the first few pages."""
        parts = []
        for p in pages[:4]:
            if not 0 <= p < ps.info.num_pages:
                parts.append(f"{p} (outside 0..{ps.info.num_pages - 1})")
                continue
            v = ps.own[p]
            state, who = v & 3, self._owner_name(v >> 2)
            text = {FREE: "free", OWNED: f"owned by {who}", RESERVED: "reserved",
                    PENDING: f"freed by {who} while pinned, still pending"}[state]
            if ps.pins[p] and state != PENDING:
                text += f", pinned x{ps.pins[p]}"
            parts.append(f"{p} ({text})")
        more = f", +{len(pages) - 4} more" if len(pages) > 4 else ""
        dup = " (listed twice in the event)" if seen_twice else ""
        return f"[{', '.join(parts)}{more}]{dup}"

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

    # -- violations --------------------------------------------------------------------------
    def _violate(self, seq: int, kind: str, pool: str, message: str, *,
                 page: int | None = None, owner: str | None = None, num_pages: int = 0,
                 pages: list[int] | None = None) -> None:
        report = self.report
        report.num_violations += 1
        report.violations_by_kind[kind] = report.violations_by_kind.get(kind, 0) + 1
        if len(report.violations) >= self._max_violations:
            return
        pages = pages or ([] if page is None else [page])
        report.violations.append(Violation(
            seq=seq, kind=kind, pool=pool, message=message, page=page, owner=owner,
            num_pages=num_pages or len(pages), pages=pages[:8],
            last=self._last_touch(pool, page)))

    def _last_touch(self, pool: str, page: int | None) -> dict[str, Any] | None:
        ps = self.pools.get(pool)
        if ps is None or page is None or not 0 <= page < ps.info.num_pages:
            return None
        tag = ps.last[page]
        if tag == 0:
            return None
        return {"seq": tag >> 3, "op": _OPS[tag & 7],
                "owner": self._owner_name(ps.own[page] >> 2)}

    def _seq_gap(self, seq: int, expected: int) -> None:
        what = "seq does not start at 0" if expected == 0 else "seq gap"
        self._violate(seq, "seq-gap", "", f"{what}: expected {expected}, got {seq} "
                      "(events lost or reordered)")

    def _missing_release(self, seq: int) -> None:
        ps, drop, unpin_seq = self._expect
        self._expect = None
        self._violate(seq, "missing-release", ps.info.name,
                      f"the unpin at seq {unpin_seq} dropped the last pin of pending pages "
                      f"{_short(sorted(drop))} but no release follows it",
                      page=drop[0], pages=sorted(drop))
        self._free_pending(ps, drop, unpin_seq)

    # -- rare events: close, unknown op or pool, malformed ---------------------------------
    def _odd_event(self, ev: Any, seq_next: int, count: int) -> int:
        """Judges an event that the hot loop could not take; returns the next seq due."""
        if self._is_long_event(ev):
            return self._long_event(ev, seq_next, count)
        if not isinstance(ev, dict) or type(ev.get("seq")) is not int:
            self._violate(seq_next, "malformed-event", "",
                          f"record #{seq_next + 1} is not an event map with an int seq: "
                          f"{_short_repr(ev)}")
            return seq_next + 1
        seq, op, pool = ev["seq"], ev.get("op"), ev.get("pool")
        if seq != seq_next:
            self._seq_gap(seq, seq_next)
        if op == "lost":
            return self._lost(ev, seq)
        if self._expect is not None and op != "release":
            self._missing_release(seq)
        if op == "close":
            self._close(ev, seq)
        elif op not in self._handlers:
            self._violate(seq, "unknown-op", str(pool), f"unknown op {op!r}; event ignored")
        elif pool not in self.pools:
            self._violate(seq, "unknown-pool", str(pool),
                          f"{op} names pool {pool!r}, not in the header "
                          f"({', '.join(self.pools)}); event ignored")
        else:
            self._violate(seq, "malformed-event", str(pool),
                          f"{op} event with a missing or mistyped key: {_short_repr(ev)}")
        return seq + 1

    def _is_long_event(self, ev: Any) -> bool:
        if not isinstance(ev, dict) or type(ev.get("seq")) is not int:
            return False
        raw = ev.get("pages")
        return (ev.get("op") in self._handlers and ev.get("pool") in self.pools
                and type(raw) is bytes and len(raw) > 4 * SMALL_EVENT and not len(raw) & 3)

    def _long_event(self, ev: dict, seq_next: int, count: int) -> int:
        """An event with more than SMALL_EVENT pages: the hot loop's steps, done here."""
        seq, op = ev["seq"], ev["op"]
        if seq != seq_next:
            self._seq_gap(seq, seq_next)
        if self._expect is not None and op != "release":
            self._missing_release(seq)
        raw = ev["pages"]
        try:
            self._handlers[op](self.pools[ev["pool"]],
                               struct.unpack(f"<{len(raw) >> 2}I", raw), ev, seq)
        except (KeyError, TypeError) as exc:
            self._violate(seq, "malformed-event", ev["pool"],
                          f"{op} event lacks or mistypes a key ({exc!r})")
        return seq + 1

    def _lost(self, ev: dict, seq: int) -> int:
        """A ``lost`` marker: ``count`` events from ``seq`` on never reached the file.

        What they did to pages and pins is unknown: from here on ``AfterGap`` judges each
        page again from what the log shows next. Returns the next seq due."""
        count = ev.get("count")
        if type(count) is not int or count < 0:
            self._violate(seq, "malformed-event", "", f"lost marker with a bad count: "
                          f"{_short_repr(ev)}")
            count = 0
        self._expect = None  # the release it waited for may be among the lost events
        self._note_gap(seq, count, ev.get("error", ""))
        self._gap_seq = seq
        return seq + count

    def _note_gap(self, seq: int, count: int, error: Any) -> None:
        self.report.gaps.append({"seq": seq, "count": count, "error": str(error)})
        self.report.lost_events += count

    def _after_gap(self, seq_next: int) -> int:
        """Judge the rest of the log from what it shows again (``aftergap.py``)."""
        return AfterGap(self).run(seq_next)

    def _after_close(self) -> int:
        count = 0
        for ev in self.reader.records:
            count += 1
            seq = ev.get("seq") if isinstance(ev, dict) else None
            op = ev.get("op") if isinstance(ev, dict) else None
            self._violate(seq if type(seq) is int else -1, "event-after-close", "",
                          f"{op} event after the close at seq {self.report.close_seq}")
        return count

    def _close(self, ev: dict, seq: int) -> None:
        retained = ev.get("retained", [])
        if not isinstance(retained, list):
            retained = []
        self._closed = True
        self.report.closed, self.report.close_seq = True, seq
        self.report.retained = [str(r) for r in retained]
        keep = [self._owner_ids[r] for r in retained if r in self._owner_ids]
        for ps in self.pools.values():
            self._judge_leaks(ps, seq, np.asarray(keep, dtype=np.int64))
            for pin_id, (_, pages, pin_seq, reason) in ps.live.items():
                listed = _signed(pages)
                self._violate(seq, "pinned-at-close", ps.info.name,
                              f"pin {pin_id} ({reason}, seq {pin_seq}) of {len(listed)} "
                              f"page(s) {_short(listed)} is still live at close",
                              page=listed[0] if listed else None, pages=listed)

    def _judge_leaks(self, ps: _Pool, seq: int, keep: np.ndarray) -> None:
        words = np.asarray(ps.own, dtype=np.int64)
        owned = np.flatnonzero((words & 3) == OWNED)
        owners = words[owned] >> 2
        leaked = ~np.isin(owners, keep)
        ids, counts = np.unique(owners[leaked], return_counts=True)
        for oid, count in zip(ids.tolist(), counts.tolist()):
            pages = owned[leaked][owners[leaked] == oid].tolist()
            name = self._owner_name(oid)
            self._violate(seq, "leak", ps.info.name,
                          f"{name} still holds {count} page(s) {_short(pages)} at close "
                          "and is not a retained owner", page=pages[0], owner=name,
                          num_pages=count, pages=pages)

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


_ALLOC_KIND = {OWNED: "double-alloc", PENDING: "reuse-while-pinned",
               RESERVED: "alloc-reserved"}


def _short(pages: list[int], limit: int = 8) -> str:
    if len(pages) <= limit:
        return f"[{', '.join(map(str, pages))}]"
    return f"[{', '.join(map(str, pages[:limit]))}, ... ({len(pages)} pages)]"


def _short_repr(obj: Any, limit: int = 120) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[:limit] + "..."


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
