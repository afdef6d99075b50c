"""What replaying one free log found: ``Violation``, ``ReplayReport`` and its summary text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    samples: dict[str, Any] | None = None  # t_s and in-use pages per pool, for --plot
    error: str | None = None  # set when the log was unreadable
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and self.num_violations == 0

    @property
    def exit_code(self) -> int:
        return 2 if self.error is not None else (0 if self.ok else 1)

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
    for w in r.warnings:
        lines.append(f"  warning: {w}")
    if r.num_violations:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r.violations_by_kind.items()))
        lines.append(f"  violations: {r.num_violations} ({kinds})")
        shown = r.violations[:max_violations]
        lines += [f"    {v.format()}" for v in shown]
        if r.num_violations > len(shown):
            lines.append(f"    ... and {r.num_violations - len(shown)} more (see --json)")
    verdict = "OK" if r.ok else f"FAILED ({r.num_violations} violations)"
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
