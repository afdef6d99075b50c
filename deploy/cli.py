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
    _add_bench(sub)
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
    from common.replay_cli import main as replay_main

    return replay_main(args)


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="performance measurements against baselines")
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    t = bench.add_parser("transfer", help="KV transfer throughput between two processes",
                         description="Move the KV of 1k/8k/32k-token requests (32 layers, 8 "
                                     "KV heads, dim 128, fp16, page 16) prefill -> decode; "
                                     "report GB/s next to raw pyzmq, memcpy and pickle.")
    t.add_argument("--quick", action="store_true", help="small sizes, under 30 s")
    t.add_argument("--json", action="store_true", help="print results as JSON")
    t.add_argument("--sizes", type=int, nargs="+", metavar="TOKENS",
                   help="request sizes in tokens (default 1024 8192 32768)")
    t.add_argument("--transports", nargs="+", choices=["tcp", "ipc"], default=["tcp", "ipc"],
                   help="transports to measure (default: both)")
    t.add_argument("--repeats", type=int, help="runs per figure; medians are quoted")
    t.add_argument("--pool-tokens", type=int,
                   help="pool size in tokens; larger requests move as several pool-sized "
                        "requests (default 8192, 2048 with --quick)")
    t.set_defaults(func=_run_bench_transfer)
    _add_bench_allocator(bench)


def _add_bench_allocator(bench) -> None:
    a = bench.add_parser("allocator", help="free_kv_row and free-log recording vs baselines",
                         description="free_kv_row of a 128k-token row at page sizes 1, 16 "
                                     "and 64 against a naive per-slot Python loop, and a "
                                     "request workload with and without a free log.")
    a.add_argument("--quick", action="store_true", help="fewer repeats and requests")
    a.add_argument("--json", action="store_true", help="print results as JSON")
    a.add_argument("--repeats", type=int, help="runs per figure; medians are quoted "
                                               "(default 7, 3 with --quick)")
    a.set_defaults(func=_run_bench_allocator)


def _run_bench_allocator(args: argparse.Namespace) -> int:
    from benchmarks.allocator import main as allocator_main

    return allocator_main(args)


def _run_bench_transfer(args: argparse.Namespace) -> int:
    from benchmarks.transfer import main as transfer_main

    return transfer_main(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
