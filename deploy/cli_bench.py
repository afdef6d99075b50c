"""``pdkv bench``: every benchmark's arguments. Each benchmark module is imported only
when it runs, so that ``--help`` stays fast."""

from __future__ import annotations

import argparse

from deploy.cli_flags import (
    add_config_flags,
    add_workload_flags,
)

_BENCH_EPILOG = ("exit status: 0 every goal met (or --report-only), 1 a goal it printed "
                 "was missed, 2 bad arguments.")


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="performance measurements against baselines")
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    t = bench.add_parser("transfer", help="KV transfer throughput between two processes",
                         description="Move the KV of 1k/8k/32k-token requests (32 layers, 8 "
                                     "KV heads, dim 128, fp16, page 16) prefill -> decode; "
                                     "report GB/s next to raw pyzmq, memcpy and pickle.")
    from benchmarks.goals import add_bench_flags  # stdlib only: keeps --help fast

    add_bench_flags(t, quick="small sizes, under 30 s",
                    repeats="5, 2 with --quick; below 8k tokens proportionally more: 8x at 1k")
    t.add_argument("--sizes", type=int, nargs="+", metavar="TOKENS",
                   help="request sizes in tokens (default 1024 8192 32768)")
    t.add_argument("--transports", nargs="+",
                   choices=["tcp", "ipc", "shm", "nixl", "nixl-tcp"],
                   default=["tcp", "ipc", "shm"],
                   help="transports to measure (default: tcp ipc shm; shm = shared-memory "
                        "pool; nixl = NIXL WRITEs vs raw NIXL, UCX's choice; nixl-tcp = "
                        "UCX_TLS=tcp; both need pdkv[nixl])")
    t.add_argument("--kv-security", nargs="+", choices=["none", "plain", "curve"],
                   default=["none"], metavar="MODE",
                   help="KV-plane authentication to measure for each transport: none, "
                        "plain (authenticated, frames in the clear), curve (encrypted); "
                        "rows other than none report ratio_vs_none (default none)")
    t.add_argument("--pool-tokens", type=int,
                   help="pool size in tokens; larger requests move as several pool-sized "
                        "requests (default 8192, 2048 with --quick)")
    t.add_argument("--device", default="cpu", metavar="DEVICE",
                   help="where both pools live: cpu (default) or cuda:N; on a GPU frames "
                        "are staged through host memory and NIXL registers VRAM; the "
                        "baselines move host bytes, so the goals (set for CPU pools) are "
                        "reported, not judged; shm needs cpu")
    t.set_defaults(func=_run_bench_transfer)
    _add_bench_allocator(bench)
    _add_bench_replay(bench)
    _add_bench_security(bench)
    _add_bench_serve(bench)
    _add_bench_frontdoor(bench)
    _add_bench_hops(bench)
    _add_bench_spec(bench)


def _add_bench_spec(bench) -> None:
    p = bench.add_parser("spec", help="speculation, prefix reuse and host offload vs baselines",
                         description="Decode tokens/s with and without speculation; follow-up "
                                     "TTFT with and without prefix reuse (in process and "
                                     "through a real 1P1D deployment); host offload GB/s vs a "
                                     "plain copy. Medians and per-repeat spreads.")
    from benchmarks.goals import add_bench_flags

    add_bench_flags(p, quick="small sizes", repeats="5")
    p.add_argument("--repeat", dest="repeats", type=int, help=argparse.SUPPRESS)  # old name
    p.add_argument("--k", type=int, default=3, help="draft tokens per step (default 3)")
    p.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens (default 2048)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per served worker")
    p.add_argument("--model", default="tiny", metavar="NAME",
                   help="built-in model config of the decode and TTFT figures and of the "
                        "served deployment (tiny, small, llama-1b-shape, llama-8b-shape; "
                        "default tiny)")
    p.add_argument("--device", default="cpu", metavar="DEVICE",
                   help="cpu (default) or cuda:N: the in-process model, the served "
                        "workers and the offload bench's device pool")
    p.set_defaults(func=_run_bench_spec)


def _run_bench_spec(args: argparse.Namespace) -> int:
    from benchmarks.spec_suite import main as spec_main

    return spec_main(args)


def _add_bench_allocator(bench) -> None:
    from benchmarks.goals import add_bench_flags  # stdlib only: keeps --help fast

    a = bench.add_parser("allocator", help="free_kv_row and free-log recording vs baselines",
                         description="free_kv_row of a 128k-token row at page sizes 1, 16 "
                                     "and 64, recording on, against a vectorised torch "
                                     "allocator in the style of sglang's and a naive "
                                     "per-slot Python loop; a request workload with and "
                                     "without a free log.", epilog=_BENCH_EPILOG)
    add_bench_flags(a, quick="3 repeats, 1000 requests", repeats="7, 3 with --quick")
    a.set_defaults(func=_run_bench_allocator)


def _run_bench_allocator(args: argparse.Namespace) -> int:
    from benchmarks.allocator import main as allocator_main

    return allocator_main(args)


def _add_bench_replay(bench) -> None:
    from benchmarks.goals import add_bench_flags

    p = bench.add_parser("replay", help="pdkv replay events/s vs a bare msgpack decode",
                         description="Write a realistic decode-node free log, then time "
                                     "pdkv replay against a bare msgpack decode of the "
                                     "same file.", epilog=_BENCH_EPILOG)
    add_bench_flags(p, quick="a 200,000-event log", repeats="3")
    p.add_argument("--events", type=int, metavar="N",
                   help="events in the generated log (default 2000000; 200000 with --quick)")
    p.set_defaults(func=_run_bench_replay)


def _run_bench_replay(args: argparse.Namespace) -> int:
    from benchmarks.replay import main as replay_main

    return replay_main(args)


def _run_bench_transfer(args: argparse.Namespace) -> int:
    from benchmarks.transfer import main as transfer_main

    return transfer_main(args)


def _add_bench_security(bench) -> None:
    p = bench.add_parser(
        "security", help="TTFT without authentication, with authenticated-only KV, and "
                         "with encrypted KV",
        description="Serve one seeded workload through 1P1D three times, KV in tcp frames: "
                    "no keys (none), CURVE control plane with PLAIN KV (plain), CURVE "
                    "everywhere (curve, the default with keys). Report TTFT p50/p99 and the "
                    "exposed KV transfer, each against none. Defaults here: --model small "
                    "--prompt-len 128 512 --output-len 2 4 --rate 0.5 --requests 12 (no "
                    "queueing on 2 cores: TTFT is prefill plus transfer). See "
                    "docs/security.md.",
        epilog="exit status: 0; 1 when plain's TTFT p50 exceeds --goal times none's or a "
               "request failed (unless --report-only).")
    from benchmarks.goals import add_bench_flags

    add_bench_flags(p, quick="one repeat of 6 requests", repeats="3, 1 with --quick")
    p.add_argument("--goal", type=float, default=1.15, metavar="RATIO",
                   help="most plain TTFT p50 / none TTFT p50 (default 1.15)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    add_workload_flags(p, 12)
    add_config_flags(p)
    # long prompts and few outputs, on a model with KV worth moving: TTFT is the point
    p.set_defaults(func=_run_bench_security, model="small", prompt_len=[128, 512],
                   output_len=[2, 4], rate=0.5)


def _run_bench_security(args: argparse.Namespace) -> int:
    from benchmarks.security import main as security_main

    return security_main(args)


def _add_bench_serve(bench) -> None:
    p = bench.add_parser(
        "serve", help="disaggregated vs colocated on the same resources, rate sweeps, "
                      "or any OpenAI-compatible server (--endpoint)",
        description="Serve one seeded workload per rate point and report TTFT/TPOT p50 "
                    "and p99, tokens/s, SLO attainment and goodput. Without --endpoint: "
                    "1P1D against two colocated workers (data parallel), 2P2D against "
                    "four, every worker process with the same torch threads. With "
                    "--endpoint URL: drive that server over streaming HTTP.",
        epilog="exit status: 0; 1 when a request failed (unless --report-only).")
    p.add_argument("--endpoint", metavar="URL",
                   help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000; "
                        "prompts are token ids drawn from --model's vocabulary or "
                        "--vocab-size")
    p.add_argument("--rates", type=float, nargs="+", metavar="R",
                   help="rate sweep: requests/s of each point (default: --rate alone)")
    p.add_argument("--layouts", nargs="+", choices=["1p1d", "2p2d"], default=["1p1d"],
                   help="pairs to compare: 1p1d (vs 2 colocated), 2p2d (vs 4 colocated)")
    p.add_argument("--quick", action="store_true",
                   help="1 repeat of 12 requests per point (unless given)")
    p.add_argument("--repeats", type=int, metavar="N",
                   help="runs per point; medians (default 3, 1 with --quick)")
    p.add_argument("--ttft-target", type=float, default=1.0, metavar="S",
                   help="SLO: TTFT target in seconds (default 1.0)")
    p.add_argument("--tpot-target", type=float, default=0.1, metavar="S",
                   help="SLO: TPOT target in seconds (default 0.1)")
    p.add_argument("--slo-attainment", type=float, default=0.9, metavar="F",
                   help="share of requests within the SLO for a rate to count as "
                        "sustained (default 0.9)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw TTFT, TPOT, goodput and attainment against rate (needs "
                        "matplotlib: pip install 'pdkv[plot]')")
    p.add_argument("--json", action="store_true", help="print results as one JSON object")
    p.add_argument("--report-only", action="store_true",
                   help="exit 0 even when requests failed")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--devices", default="cpu", metavar="LIST",
                   help="comma-separated devices given to each deployment's workers "
                        "round-robin, as pdkv run's (default cpu); e.g. cuda:0 puts every "
                        "worker of both sides on one GPU")
    g = p.add_argument_group("with --endpoint")
    g.add_argument("--served-model", metavar="NAME",
                   help="model name to send (default: the server's first in /v1/models)")
    g.add_argument("--api-key", metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--vocab-size", type=int, metavar="N",
                   help="draw prompt token ids from [0, N) (default: --model's vocabulary)")
    g.add_argument("--no-token-ids", action="store_true",
                   help="do not ask for return_token_ids (servers that refuse it); tokens "
                        "are then counted from the final usage")
    g.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to generate past end-of-sequence (vLLM extension)")
    add_workload_flags(p, None, "48, 12 with --quick")
    add_config_flags(p)
    p.set_defaults(func=_run_bench_serve)


def _add_bench_frontdoor(bench) -> None:
    p = bench.add_parser(
        "frontdoor", help="the HTTP front door's cost: HTTP vs straight into the router",
        description="One 1P1D deployment serves the same workload in alternating passes "
                    "straight into the router and through the HTTP front door over "
                    "streaming HTTP; reports TTFT p50 added and the tokens/s ratio (goals: "
                    "<= 1 ms, >= 0.95). The front door is pdkv serve's (the router in its "
                    "event loop) or, with --shape frontend, pdkv frontend in front of a "
                    "router process. The host tier is off unless --offload is given (a pass "
                    "would reuse the previous pass's prefixes).",
        epilog="exit status: 0 goals met; 1 a goal missed (unless --report-only) or a "
               "request failed.")
    p.add_argument("--quick", action="store_true",
                   help="1 pass pair of 12 requests after the warm-up (unless given)")
    p.add_argument("--repeats", type=int, metavar="N",
                   help="pass pairs after one warm-up pair; medians (default 5, 1 with "
                        "--quick)")
    p.add_argument("--ttft-target", type=float, default=1.0, help=argparse.SUPPRESS)
    p.add_argument("--tpot-target", type=float, default=0.1, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print results as one JSON object")
    p.add_argument("--report-only", action="store_true", help="exit 0 on a missed goal")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--shape", choices=["serve", "frontend"], default="serve",
                   help="serve: pdkv serve, the router in the front door's loop (default); "
                        "frontend: pdkv frontend in front of a router process")
    add_workload_flags(p, None, "48, 12 with --quick")
    add_config_flags(p)
    p.set_defaults(func=_run_bench_frontdoor)


def _add_bench_hops(bench) -> None:
    p = bench.add_parser(
        "hops", help="the TTFT disaggregation adds at light load, hop by hop",
        description="Serve the same seeded prompts one at a time through one colocated "
                    "worker and through 1P1D (alternating); report both TTFTs, the "
                    "request's KV transfer at its data path's speed measured in the same "
                    "run, the hop cost (1P1D - colocated - transfer; goal <= 1 ms) and "
                    "each traced point of a request's path (router, prefill, decode) in "
                    "ms since the client's submit. The host tier is off unless --offload.",
        epilog="exit status: 0 goal met; 1 goal missed (unless --report-only) or a request "
               "failed.")
    from benchmarks.goals import add_bench_flags

    add_bench_flags(p, quick="1 repeat of 8 requests", repeats="3, 1 with --quick")
    p.add_argument("--warmup", type=int, default=3, metavar="N",
                   help="requests served first on each deployment, not counted (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    add_workload_flags(p, None, "24, 8 with --quick; --rate is not used: one at a time")
    add_config_flags(p)
    p.set_defaults(func=_run_bench_hops, output_len=[4, 8])


def _run_bench_hops(args: argparse.Namespace) -> int:
    from benchmarks.hops import main as hops_main

    return hops_main(args)


def _run_bench_frontdoor(args: argparse.Namespace) -> int:
    from benchmarks.frontdoor import main as frontdoor_main

    return frontdoor_main(args)


def _run_bench_serve(args: argparse.Namespace) -> int:
    from benchmarks.serve import main as serve_main

    return serve_main(args)
