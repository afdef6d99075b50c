"""The ``pdkv`` command line: every subcommand's arguments live here."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdkv",
        description="pdkv: KV-cache transfer and lifecycle layer for disaggregated "
                    "prefill/decode serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_replay(sub)
    return parser


def _add_replay(sub) -> None:
    p = sub.add_parser(
        "replay", help="verify recorded free logs offline",
        description="Rebuild every pool page by page from free logs and report leaks, "
                    "double frees, foreign frees, reuse while pinned, unknown unpins, "
                    "seq gaps and pages still held at close. Each LOG is one process's "
                    "pools and is verified on its own. Format: docs/freelog.md.",
        epilog="exit status: 0 every log clean, 1 a violation in some log, 2 a log "
               "unreadable (missing, not msgpack, wrong header or version). A torn last "
               "record and a missing close event are warnings, not failures.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", metavar="LOG", help="free log files to verify")
    p.add_argument("--json", action="store_true",
                   help="print one machine-readable JSON report (ok, exit_code, per log: "
                        "pools stats, warnings, violations) instead of the summary")
    p.add_argument("--plot", metavar="FILE.png",
                   help="write pages in use per pool over time to FILE.png "
                        "(needs matplotlib: pip install 'pdkv[plot]')")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: only when stderr is a terminal)")
    p.add_argument("--max-violations", type=int, default=50, metavar="N",
                   help="violations printed per log in the summary (all are counted; "
                        "default 50)")
    p.set_defaults(func=_run_replay)


def _run_replay(args: argparse.Namespace) -> int:
    from common.replay import main as replay_main

    return replay_main(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
