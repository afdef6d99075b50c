"""What replaying one free log found: ``Violation``, ``ReplayReport`` and its summary text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

EXIT_CLEAN, EXIT_VIOLATIONS, EXIT_UNREADABLE, EXIT_INCOMPLETE = 0, 1, 2, 3
_SEVERITY = (EXIT_UNREADABLE, EXIT_VIOLATIONS, EXIT_INCOMPLETE, EXIT_CLEAN)


def combined_exit(codes: list[int]) -> int:
    """The exit status of several logs: the most severe, 2 then 1 then 3 then 0."""
    return next((c for c in _SEVERITY if c in codes), EXIT_CLEAN)


@dataclass
class Violation:
    """One broken rule, tied to the event (``seq``) where replay saw it."""

    seq: int
    kind: str
    pool: str
    message: str
    page: int | None = None
    owner: str | None = None
    num_pages: int = 0
    pages: list[int] = field(default_factory=list)  # the first few offending pages
    last: dict[str, Any] | None = None  # last event that touched ``page``: seq, op, owner

    def format(self) -> str:
        where = f"seq {self.seq}" if self.seq >= 0 else "end of log"
        text = f"{where}: {self.kind}: {self.message}"
        if self.last is not None:
            text += (f" [page {self.page} last touched by seq {self.last['seq']} "
                     f"{self.last['op']} (owner {self.last['owner']})]")
        elif self.page is not None and self.kind not in ("page-out-of-range",):
            text += f" [page {self.page} never touched before]"
        return text


@dataclass
class ReplayReport:
    """The outcome of replaying one free log; ``ok`` when there is no violation."""

    path: str
    node: str = ""
    events: int = 0
    closed: bool = False
    close_seq: int | None = None
    retained: list[str] = field(default_factory=list)
    pools: dict[str, dict[str, Any]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)  # the first MAX_STORED
    num_violations: int = 0
    violations_by_kind: dict[str, int] = field(default_factory=dict)
    error: str | None = None  # set when the log was unreadable
    seconds: float = 0.0
    gaps: list[dict[str, Any]] = field(default_factory=list)  # lost markers: seq, count, error
    lost_events: int = 0
    judged_after_gap: int = 0  # events after the first gap, judged from what they show
    unknown_pages_at_end: int = 0  # pages the log never showed again after its last gap
    digests: dict[str, int] = field(default_factory=dict)  # runs sent/received, pages ...
    ledger: Any = field(default=None, repr=False)  # the digests, for ``cross_check``
    migrated: list[str] = field(default_factory=list)
    """Owners (request attempts) freed ``migrated`` here: they moved to another worker."""
    attempts: list[str] = field(default_factory=list)
    """Owners named as a later attempt (``...~k``) that took pages here."""

    @property
    def incomplete(self) -> bool:
        """Events are missing (``lost`` markers): the log cannot prove anything after them."""
        return bool(self.gaps)

    @property
    def ok(self) -> bool:
        """Clean: readable, complete and without a violation."""
        return self.error is None and self.num_violations == 0 and not self.incomplete

    @property
    def exit_code(self) -> int:
        if self.error is not None:
            return EXIT_UNREADABLE
        if self.num_violations:
            return EXIT_VIOLATIONS
        return EXIT_INCOMPLETE if self.incomplete else EXIT_CLEAN

    def to_dict(self) -> dict[str, Any]:
        d = {"log": self.path, "ok": self.ok, "exit_code": self.exit_code}
        if self.error is not None:
            return {**d, "error": self.error}
        return {**d, "node": self.node, "events": self.events, "closed": self.closed,
                "close_seq": self.close_seq, "retained": self.retained,
                "pools": self.pools, "warnings": self.warnings,
                "num_violations": self.num_violations,
                "violations_by_kind": self.violations_by_kind,
                "violations_truncated": self.num_violations > len(self.violations),
                "violations": [v.__dict__ for v in self.violations],
                "incomplete": self.incomplete, "lost_events": self.lost_events,
                "gaps": self.gaps, "judged_after_gap": self.judged_after_gap,
                "unknown_pages_at_end": self.unknown_pages_at_end,
                "digests": self.digests, "migrated": self.migrated,
                "seconds": round(self.seconds, 3)}

    def format(self, max_violations: int = 50) -> str:
        """The human-readable summary that ``pdkv replay`` prints."""
        return format_report(self, max_violations)


def format_report(r: ReplayReport, max_violations: int) -> str:
    if r.error is not None:
        return f"{r.path}: UNREADABLE: {r.error}"
    end = (f"closed at seq {r.close_seq} (retained: {', '.join(r.retained) or 'none'})"
           if r.closed else "no close event")
    lines = [f"{r.path}: node {r.node or '?'}, {r.events:,} events, {end}, "
             f"replayed in {r.seconds:.2f} s"]
    for name, st in r.pools.items():
        lines += _format_pool(name, st)
    d = r.digests
    if any(d.values()):
        lines.append(f"  digests: runs sent {d['runs_sent']:,}, received "
                     f"{d['runs_received']:,}, refused {d['runs_refused']:,}; host pages "
                     f"stored {d['pages_stored']:,}, loaded {d['pages_loaded']:,}")
    if r.migrated:
        lines.append(f"  migrated: {len(r.migrated)} request attempt(s) moved on to other "
                     "workers (freed 'migrated'; none took pages here again)"
                     if not r.violations_by_kind.get("alloc-after-migrated") else
                     f"  migrated: {len(r.migrated)} request attempt(s) moved on")
    for w in r.warnings:
        lines.append(f"  warning: {w}")
    if r.num_violations:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r.violations_by_kind.items()))
        lines.append(f"  violations: {r.num_violations} ({kinds})")
        shown = r.violations[:max_violations]
        lines += [f"    {v.format()}" for v in shown]
        if r.num_violations > len(shown):
            lines.append(f"    ... and {r.num_violations - len(shown)} more (see --json)")
    if r.incomplete:
        first = r.gaps[0]
        lines.append(f"  INCOMPLETE: {r.lost_events:,} event(s) lost in {len(r.gaps)} gap(s), "
                     f"the first at seq {first['seq']} ({first['error'] or 'no cause given'}); "
                     f"{r.judged_after_gap:,} event(s) after it judged from what they show, "
                     f"{r.unknown_pages_at_end:,} page(s) never seen again (not judged)")
    if r.num_violations:
        verdict = f"FAILED ({r.num_violations} violations)"
    else:
        verdict = "INCOMPLETE (not proven clean)" if r.incomplete else "OK"
    lines.append(f"  {verdict}" + (f", {len(r.warnings)} warning(s)" if r.warnings else ""))
    return "\n".join(lines)


def _format_pool(name: str, st: dict[str, Any]) -> list[str]:
    ev = st["events"]
    cap = max(st["capacity"], 1)
    reasons = ", ".join(f"{r} {v['pages']:,} pages/{v['events']:,} events"
                        for r, v in st["frees_by_reason"].items()) or "none"
    return [
        f"  pool {name}: {st['num_pages']:,} pages x {st['page_size']} slots "
        f"({st['capacity']:,} allocatable)",
        f"    pages allocated {st['pages_allocated']:,} in {ev['alloc']:,} allocs, "
        f"freed {st['pages_freed']:,} in {ev['free']:,} frees, released after pins "
        f"{st['pages_released']:,}",
        f"    peak in use {st['peak_in_use']:,} pages ({st['peak_in_use'] / cap:.1%}) at seq "
        f"{st['peak_seq']}; in use at end {st['in_use_at_end']:,}",
        f"    frees by reason: {reasons}",
        f"    pins {ev['pin']:,}, unpins {ev['unpin']:,}, handoffs {ev['handoff']:,} "
        f"({st['pages_handed_off']:,} pages), live pins at end {st['live_pins_at_end']}",
    ]
