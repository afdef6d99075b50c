"""``pdkv replay`` on the command line: reports, ``--json``, ``--plot`` and ``--request``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from common.freelog.digests import cross_check
from common.freelog.migrations import follow, format_follow
from common.freelog.reader import UnreadableLog
from common.freelog.replay import replay_file
from common.freelog.report import EXIT_CLEAN, EXIT_VIOLATIONS, ReplayReport, combined_exit


def plot_logs(paths: list[str], out: str, request: str | None = None) -> None:
    """Read each readable log's timeline and draw them (``common.freelog.plot``)."""
    from common.freelog.plot import write_plot
    from common.freelog.timeline import build_timeline

    write_plot([build_timeline(p, request) for p in paths], out, request)


def expand_logs(paths: list[str]) -> list[str]:
    """Each folder stands for the ``*.freelog`` files in it (every incarnation of every
    process, sorted); files stay as given. A folder without logs stays itself, so that it
    is reported unreadable."""
    out: list[str] = []
    for path in paths:
        found = sorted(str(p) for p in Path(path).glob("*.freelog")) \
            if os.path.isdir(path) else []
        out += found or [path]
    return out


def main(args) -> int:
    """``pdkv replay``: args has logs, json, plot, progress, max_violations.

    Returns the exit status: 0 every log clean, 1 a violation, 2 an unreadable log
    (or a plot that cannot be made), 3 a log with lost events (incomplete); with several
    logs the most severe in the order 2, 1, 3, 0.
    """
    plot, request = getattr(args, "plot", None), getattr(args, "request", None)
    if request is not None and not plot:
        print("pdkv replay: --request RID draws into the plot; give --plot FILE.png too",
              file=sys.stderr)
        return 2
    if plot and not _have_matplotlib():
        print("pdkv replay: --plot needs matplotlib; install it with "
              "pip install 'pdkv[plot]'", file=sys.stderr)
        return 2
    progress = getattr(args, "progress", None)
    reports = []
    for path in expand_logs(args.logs):
        show = sys.stderr.isatty() if progress is None else progress
        try:
            if os.path.isdir(path):
                raise UnreadableLog(f"{path}: a folder without *.freelog files")
            report = replay_file(path, progress=show)
        except UnreadableLog as exc:
            report = ReplayReport(path=os.fspath(path), error=str(exc))
        reports.append(report)
        if not getattr(args, "json", False):
            print(report.format(getattr(args, "max_violations", 50)), flush=True)
    found, counts = cross_check([r.ledger for r in reports if r.ledger is not None])
    status = combined_exit([r.exit_code for r in reports]
                           + [EXIT_VIOLATIONS if found else EXIT_CLEAN])
    moves = follow(reports)
    if not getattr(args, "json", False) and (found or any(counts.values())):
        print(format_cross(found, counts, getattr(args, "max_violations", 50)), flush=True)
    if getattr(args, "json", False):
        print(json.dumps({"ok": status == 0, "exit_code": status,
                          "logs": [r.to_dict() for r in reports],
                          "digests": {**counts, "mismatches": [v.__dict__ for v in found]},
                          "migrations": moves}, indent=2))
    elif moves:
        print(format_follow(moves), flush=True)
    if plot:
        plot_logs([r.path for r in reports if r.error is None], plot, request)
        print(f"plot written to {plot}", file=sys.stderr)
    return status


def format_cross(found: list, counts: dict, max_shown: int = 50) -> str:
    """The digest check across the logs given (a prefill's runs sent against a decode's
    received)."""
    head = (f"digests across logs: {counts['runs_matched']:,} runs matched, "
            f"{counts['runs_received_unmatched']:,} received without their sender's log, "
            f"{counts['runs_sent_unreceived']:,} sent and not received in these logs")
    if not found:
        return head + "\n  OK"
    lines = [head, f"  digest mismatches: {len(found)}"]
    lines += [f"    {v.format()}" for v in found[:max_shown]]
    return "\n".join(lines + [f"  FAILED ({len(found)} digest mismatches)"])


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
