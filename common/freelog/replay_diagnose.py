"""Replay's slow paths: every page of an event that failed the fast checks, diagnosed.

A mixin of ``Replayer`` (replay.py), in the way sglang splits its scheduler: the hot loop
stays in one class, and what a clean log never reaches lives here, next to the words of
each violation.
"""

from __future__ import annotations

from typing import Any

from common.freelog.replay_state import (
    ALLOC_KIND,
    FREE,
    OP_ALLOC,
    OP_FREE,
    OPS,
    OWNED,
    PENDING,
    RESERVED,
    PoolState,
    short_pages,
    signed,
)
from common.freelog.report import Violation


class Diagnosis:
    """Diagnoses bad pages and records violations; needs ``Replayer``'s state."""

    def _alloc_slow(self, ps: PoolState, pages, owner: Any, oid: int, seq: int) -> None:
        new, tag = oid << 2 | OWNED, seq << 3 | OP_ALLOC
        bad: dict[str, list[int]] = {}
        seen: set[int] = set()
        good = 0
        for p in signed(pages):
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
                bad.setdefault(ALLOC_KIND[ps.own[p] & 3], []).append(p)
            seen.add(p)
        for kind, ps_pages in bad.items():
            self._violate(seq, kind, ps.info.name,
                          f"alloc to {owner} of {len(ps_pages)} page(s) that are not free "
                          f"{self._describe(ps, ps_pages, seen_twice=kind == 'double-alloc')}"
                          "; not applied", page=ps_pages[0], owner=str(owner),
                          pages=ps_pages)
        self._count_alloc(ps, good, seq)

    def _free_slow(self, ps: PoolState, pages, owner: Any, oid: int, reason: str,
                   seq: int) -> None:
        held, tag = oid << 2 | OWNED, seq << 3 | OP_FREE
        bad: dict[str, list[int]] = {}
        seen: set[int] = set()
        good = pending = 0
        for p in signed(pages):
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

    def _pin_slow(self, ps: PoolState, pages, pin_id: Any, seq: int) -> tuple[int, ...]:
        """Pins the pages that are owned or pending; returns them (the pin's pages)."""
        listed, applied, bad = signed(pages), [], []
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

    def _unknown_unpin(self, ps: PoolState, pages, pin_id: Any, seq: int) -> None:
        listed = signed(pages)
        self._violate(seq, "unknown-unpin", ps.info.name,
                      f"unpin of pin {pin_id}, which is not live (never pinned or already "
                      f"unpinned); pages {short_pages(listed)}",
                      page=listed[0] if listed and 0 <= listed[0] < ps.info.num_pages
                      else None)

    def _why_not_held(self, ps: PoolState, p: int, oid: int) -> str:
        if not 0 <= p < ps.info.num_pages:
            return "page-out-of-range"
        v = ps.own[p]
        state = v & 3
        if state == RESERVED:
            return "free-reserved"
        if state == OWNED:
            return "foreign-free"
        return "double-free"  # free, or pending (freed earlier while pinned)

    def _describe(self, ps: PoolState, pages: list[int], seen_twice: bool = False) -> str:
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
        return {"seq": tag >> 3, "op": OPS[tag & 7],
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
                      f"{short_pages(sorted(drop))} but no release follows it",
                      page=drop[0], pages=sorted(drop))
        self._free_pending(ps, drop, unpin_seq)
