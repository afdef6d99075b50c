"""Judging a free log after a ``lost`` marker, from what the log shows again.

The lost events may have allocated, freed, pinned or handed off any page, so at a gap
every page becomes *unknown* and every live pin *stale* (it may have ended in the gap).
Replay then reads on and learns each page again from the first event that touches it,
and judges only what the log itself proves after the gap:

    page was          alloc          free by X              pin             handoff X->Y
    unknown           owned          free (pins unknown)    not judged      owned by Y
    free              owned          double-free            pin-free-page*  not held
    owned by X        double-alloc   free / pending         pinned          owned by Y
    owned by Z        double-alloc   foreign-free           pinned          not held
    pending           reuse-while-   double-free            pinned          not held
                      pinned

    * unless the page's pins are unknown (a stale pin may make it pending, not free)

A page whose pins are unknown (learnt from a free or a handoff, or pinned while
unknown) never waits for a release and never makes one unexpected; an ``unpin`` of a pin
that is not known (stale, or begun in the gap) is not judged, and the ``release`` that
follows it frees what it lists. An ``alloc`` makes a page fully known again (a correct
allocator only hands out pages that are free and unpinned). At ``close`` only pages known
to be owned are judged as leaks and only pins begun after the gap as still live; pages
never seen again are counted, not judged. Nothing here is a guess: a log written by a
correct allocator with any stretch of events cut out replays without a violation
(tests/test_replay.py checks that on random cuts).
"""

from __future__ import annotations

import struct
from typing import Any

from common.freelog.replay_state import (
    FREE,
    OP_ALLOC,
    OP_FREE,
    OP_HANDOFF,
    OP_RELEASE,
    OWNED,
    PENDING,
    RESERVED,
)


class AfterGap:
    """Reads the rest of a log for a ``Replayer`` that met a ``lost`` marker."""

    def __init__(self, rp) -> None:
        self.rp = rp
        self.unknown: dict[str, bytearray] = {}
        self.soft: dict[str, bytearray] = {}  # pins unknown: free or pending, can't tell
        self.expect: tuple[Any, list[int], int] | None = None  # a known release due
        self.loose = False  # the next release may free what it lists (unjudged unpin)
        self.reset()

    def reset(self) -> None:
        """At a gap: every page unknown, every pin stale."""
        for name, ps in self.rp.pools.items():
            n = ps.info.num_pages
            unknown = bytearray(b"\x01") * n
            for p in {0, *ps.info.reserved}:
                unknown[p] = 0
            self.unknown[name], self.soft[name] = unknown, bytearray(unknown)
            ps.pins = [0] * n
            ps.live.clear()
        self.expect, self.loose = None, True  # the gap may have eaten an unpin

    # -- the loop --------------------------------------------------------------------------
    def run(self, seq_next: int) -> int:
        """Judge every remaining record; returns how many it read."""
        rp, count = self.rp, 0
        for ev in rp.reader.records:
            count += 1
            seq_next = self._event(ev, seq_next)
            if rp._closed:
                count += rp._after_close()
                break
        if self.expect is not None:
            self._missing_release(-1)
        self.rp.report.unknown_pages_at_end = sum(
            u.count(1) for u in self.unknown.values())
        return count

    def _event(self, ev: Any, seq_next: int) -> int:
        rp = self.rp
        seq = ev.get("seq") if isinstance(ev, dict) else None
        if type(seq) is not int:
            rp._violate(seq_next, "malformed-event", "", f"record after the gap is not an "
                        f"event map with an int seq: {str(ev)[:120]}")
            return seq_next + 1
        if seq != seq_next:
            rp._seq_gap(seq, seq_next)
        op = ev.get("op")
        if op == "lost":  # the release due may be among the lost events: no verdict
            count = ev.get("count")
            count = count if type(count) is int and count >= 0 else 0
            rp._note_gap(seq, count, ev.get("error", ""))
            self.reset()
            return seq + count
        if self.expect is not None and op != "release":
            self._missing_release(seq)
        if op == "close":
            self._close(ev, seq)
            return seq + 1
        self.rp.report.judged_after_gap += 1
        try:
            ps, raw = rp.pools[ev["pool"]], ev["pages"]
            pages = list(struct.unpack(f"<{len(raw) >> 2}i", raw))
            getattr(self, f"_{op}")(ps, pages, ev, seq)
        except (KeyError, TypeError, AttributeError, struct.error) as exc:
            rp._violate(seq, "malformed-event", str(ev.get("pool", "")),
                        f"{op} event after the gap that replay cannot read ({exc!r})")
        if op not in ("unpin", "release"):
            self.loose = False
        return seq + 1

    # -- events ----------------------------------------------------------------------------
    def _alloc(self, ps, pages: list[int], ev: dict, seq: int) -> None:
        owner = ev["owner"]
        oid, unknown, soft = self.rp._owner_id(owner), self._u(ps), self._s(ps)
        bad: dict[str, list[int]] = {}
        for p in self._in_range(ps, pages, seq, "alloc"):
            state = ps.own[p] & 3
            if unknown[p] or state == FREE:
                ps.own[p], ps.last[p] = oid << 2 | OWNED, seq << 3 | OP_ALLOC
                unknown[p] = soft[p] = 0
            else:
                kind = {OWNED: "double-alloc", PENDING: "reuse-while-pinned",
                        RESERVED: "alloc-reserved"}[state]
                bad.setdefault(kind, []).append(p)
        ps.num_allocs += 1
        ps.pages_allocated += len(pages)
        for kind, bad_pages in bad.items():
            self._bad(ps, seq, kind, bad_pages, f"alloc to {owner} of", owner)

    def _free(self, ps, pages: list[int], ev: dict, seq: int) -> None:
        owner, reason = ev["owner"], ev["reason"]
        oid, unknown, soft = self.rp._owner_id(owner), self._u(ps), self._s(ps)
        bad: dict[str, list[int]] = {}
        for p in self._in_range(ps, pages, seq, "free"):
            v = ps.own[p]
            if unknown[p]:  # free, or pending on a stale pin: soft
                ps.own[p] = oid << 2 | (PENDING if ps.pins[p] else FREE)
                unknown[p], soft[p] = 0, 1
            elif v == oid << 2 | OWNED:
                ps.own[p] = oid << 2 | (PENDING if ps.pins[p] else FREE)
            else:
                bad.setdefault(self.rp._why_not_held(ps, p, oid), []).append(p)
                continue
            ps.last[p] = seq << 3 | OP_FREE
        in_use = ps.in_use  # occupancy after a gap is unknown: it stays as at the gap
        self.rp._count_free(ps, len(pages), 0, reason)
        ps.in_use = in_use
        for kind, bad_pages in bad.items():
            self._bad(ps, seq, kind, bad_pages, f"free by {owner} (reason {reason}) of",
                      owner, "it does not hold")

    def _pin(self, ps, pages: list[int], ev: dict, seq: int) -> None:
        pin_id = ev["pin"]
        ps.counts["pin"] += 1
        if pin_id in ps.live:
            self.rp._violate(seq, "duplicate-pin", ps.info.name, f"pin id {pin_id} is "
                             "already live (pinned after the gap); this pin is ignored")
            return
        unknown, soft = self._u(ps), self._s(ps)
        applied, bad = [], []
        for p in self._in_range(ps, pages, seq, "pin"):
            state = ps.own[p] & 3
            if state == RESERVED or (state == FREE and not unknown[p] and not soft[p]):
                bad.append(p)
                continue
            ps.pins[p] += 1
            applied.append(p)
            if unknown[p]:
                soft[p] = 1
        ps.live[pin_id] = (ev["pages"], tuple(applied), seq, ev["reason"])
        if bad:
            self._bad(ps, seq, "pin-free-page", bad, f"pin {pin_id} of", None,
                      "that nobody holds")

    def _unpin(self, ps, pages: list[int], ev: dict, seq: int) -> None:
        ps.counts["unpin"] += 1
        entry = ps.live.pop(ev["pin"], None)
        if entry is None:  # stale, or begun in the gap: nothing to judge
            self.loose = True
            return
        soft, drop = self._s(ps), []
        for p in entry[1]:
            ps.pins[p] -= 1
            if not ps.pins[p] and ps.own[p] & 3 == PENDING and not soft[p]:
                drop.append(p)
        self.expect = (ps, drop, seq) if drop else None
        self.loose = False

    def _release(self, ps, pages: list[int], ev: dict, seq: int) -> None:
        ps.counts["release"] += 1
        expect, self.expect = self.expect, None
        listed = set(self._in_range(ps, pages, seq, "release"))
        soft, unknown = self._s(ps), self._u(ps)
        due = set(expect[1]) if expect is not None and expect[0] is ps else set()
        extra = sorted(p for p in listed - due if not (self.loose or soft[p] or unknown[p]))
        missing = sorted(due - listed)
        if missing or extra:
            self.rp._violate(seq, "release-mismatch" if expect else "unexpected-release",
                             ps.info.name, f"release after the gap lists pages it should not "
                             f"(missing {missing[:8]}, extra {extra[:8]})",
                             page=(missing or extra)[0])
        for p in listed | due:
            if ps.own[p] & 3 in (PENDING, FREE) or unknown[p]:
                ps.own[p] = ps.own[p] & ~3 | FREE
                unknown[p] = 0
                ps.last[p] = seq << 3 | OP_RELEASE
        ps.pages_released += len(listed)
        self.loose = False

    def _handoff(self, ps, pages: list[int], ev: dict, seq: int) -> None:
        owner, to = ev["owner"], ev["to"]
        oid, tid = self.rp._owner_id(owner), self.rp._owner_id(to)
        unknown, soft = self._u(ps), self._s(ps)
        ps.counts["handoff"] += 1
        ps.pages_handed_off += len(pages)
        bad = []
        for p in self._in_range(ps, pages, seq, "handoff"):
            if unknown[p]:
                unknown[p], soft[p] = 0, 1
            elif ps.own[p] != oid << 2 | OWNED:
                bad.append(p)
                continue
            ps.own[p], ps.last[p] = tid << 2 | OWNED, seq << 3 | OP_HANDOFF
        if bad:
            self._bad(ps, seq, "handoff-not-held", bad, f"{owner} hands off to {to}", owner,
                      "it does not hold")

    def _close(self, ev: dict, seq: int) -> None:
        """Leaks: pages known to be owned; live pins: those begun after the gap."""
        rp = self.rp
        for name, ps in rp.pools.items():
            unknown = self.unknown[name]
            for p, v in enumerate(ps.own):
                if unknown[p] and v & 3 == OWNED:
                    ps.own[p] = v & ~3 | FREE  # not judged: never seen after the gap
        rp._close(ev, seq)

    # -- helpers ---------------------------------------------------------------------------
    def _u(self, ps) -> bytearray:
        return self.unknown[ps.info.name]

    def _s(self, ps) -> bytearray:
        return self.soft[ps.info.name]

    def _in_range(self, ps, pages: list[int], seq: int, op: str) -> list[int]:
        n = ps.info.num_pages
        bad = [p for p in pages if not 0 <= p < n]
        if bad:
            self.rp._violate(seq, "page-out-of-range", ps.info.name, f"{op} lists pages "
                             f"{bad[:8]} outside 0..{n - 1}", pages=bad)
        return [p for p in pages if 0 <= p < n]

    def _bad(self, ps, seq: int, kind: str, pages: list[int], what: str, owner: Any,
             why: str = "that are not free") -> None:
        self.rp._violate(seq, kind, ps.info.name,
                         f"after the gap: {what} {len(pages)} page(s) {why} "
                         f"{self.rp._describe(ps, pages)}; not applied", page=pages[0],
                         owner=None if owner is None else str(owner), pages=pages)

    def _missing_release(self, seq: int) -> None:
        ps, drop, unpin_seq = self.expect
        self.expect = None
        self.rp._violate(seq, "missing-release", ps.info.name,
                         f"the unpin at seq {unpin_seq} dropped the last pin of pending pages "
                         f"{sorted(drop)[:8]} but no release follows it", page=drop[0],
                         pages=sorted(drop))
        for p in drop:
            ps.own[p] = ps.own[p] & ~3 | FREE
