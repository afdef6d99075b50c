"""Replay's rare events: close, a ``lost`` marker, unknown ops and pools, malformed
records and events of many pages; a mixin of ``Replayer`` (replay.py) like
``replay_diagnose.Diagnosis``.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from common.freelog.aftergap import AfterGap
from common.freelog.replay_state import (
    OWNED,
    SMALL_EVENT,
    PoolState,
    short_pages,
    short_repr,
    signed,
)


class RareEvents:
    """Judges the events the hot loop hands over; needs ``Replayer``'s state."""

    def _odd_event(self, ev: Any, seq_next: int, count: int) -> int:
        """Judges an event that the hot loop could not take; returns the next seq due."""
        if self._is_long_event(ev):
            return self._long_event(ev, seq_next, count)
        if not isinstance(ev, dict) or type(ev.get("seq")) is not int:
            self._violate(seq_next, "malformed-event", "",
                          f"record #{seq_next + 1} is not an event map with an int seq: "
                          f"{short_repr(ev)}")
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
                          f"{op} event with a missing or mistyped key: {short_repr(ev)}")
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
                          f"{short_repr(ev)}")
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
                listed = signed(pages)
                self._violate(seq, "pinned-at-close", ps.info.name,
                              f"pin {pin_id} ({reason}, seq {pin_seq}) of {len(listed)} "
                              f"page(s) {short_pages(listed)} is still live at close",
                              page=listed[0] if listed else None, pages=listed)

    def _judge_leaks(self, ps: PoolState, seq: int, keep: np.ndarray) -> None:
        words = np.asarray(ps.own, dtype=np.int64)
        owned = np.flatnonzero((words & 3) == OWNED)
        owners = words[owned] >> 2
        leaked = ~np.isin(owners, keep)
        ids, counts = np.unique(owners[leaked], return_counts=True)
        for oid, count in zip(ids.tolist(), counts.tolist()):
            pages = owned[leaked][owners[leaked] == oid].tolist()
            name = self._owner_name(oid)
            self._violate(seq, "leak", ps.info.name,
                          f"{name} still holds {count} page(s) {short_pages(pages)} at close "
                          "and is not a retained owner", page=pages[0], owner=name,
                          num_pages=count, pages=pages)
