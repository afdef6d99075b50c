"""Following migrated requests across free logs: which attempt took each one over.

A request the router moved to other workers runs as attempts ``<id>``, ``<id>~1``,
``<id>~2``, ... (docs/operations.md, "Migration"); the worker an attempt left frees it
``migrated``. Given several logs of one deployment, ``follow`` says for each attempt that
moved where its successor took pages, or that no given log holds it (its worker's log was
not given, the client aborted it meanwhile, or its output was complete when it moved).
That is information, not a violation: replay proves pages, not routing.
"""

from __future__ import annotations

from pathlib import Path

from common.freelog.report import ReplayReport


def successor(owner: str) -> str:
    """The id of the attempt after ``owner``."""
    head, sep, n = owner.rpartition("~")
    if sep and n.isdigit() and "#" in head:
        return f"{head}~{int(n) + 1}"
    return f"{owner}~1"


def follow(reports: list[ReplayReport]) -> list[dict[str, str]]:
    """Per migrated attempt: ``{"attempt", "log", "next", "next_log"}`` (``next_log`` empty
    when no given log allocated for the next attempt)."""
    taken = {a: Path(r.path).name for r in reports for a in r.attempts}
    return [{"attempt": m, "log": Path(r.path).name, "next": successor(m),
             "next_log": taken.get(successor(m), "")}
            for r in reports for m in r.migrated]


def format_follow(moves: list[dict[str, str]], limit: int = 20) -> str:
    """Lines for ``pdkv replay``'s summary of the logs' migrations ('' without any)."""
    if not moves:
        return ""
    found = sum(bool(m["next_log"]) for m in moves)
    lines = [f"migrations: {len(moves)} request attempt(s) moved on; the next attempt took "
             f"pages in a given log for {found}"]
    for m in moves[:limit]:
        where = m["next_log"] or "no log given"
        lines.append(f"  {m['attempt']} ({m['log']}) -> {m['next']} ({where})")
    if len(moves) > limit:
        lines.append(f"  ... and {len(moves) - limit} more (see --json)")
    return "\n".join(lines)
