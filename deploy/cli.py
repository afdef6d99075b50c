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
    p = sub.add_parser("replay", help="verify recorded free logs offline",
                       description="Rebuild every pool page by page from free logs and "
                                   "report leaks, double frees and reuse while pinned.")
    p.add_argument("logs", nargs="+", metavar="LOG", help="free log files to verify")
    p.set_defaults(func=_run_replay)


def _run_replay(args: argparse.Namespace) -> int:
    from common.replay import main as replay_main

    return replay_main(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
