"""The ``pdkv`` command line: every subcommand's arguments live here."""

from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdkv",
        description="pdkv: KV-cache transfer and lifecycle layer for disaggregated "
                    "prefill/decode serving.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_replay(sub)
    _add_bench(sub)
    _add_serving(sub)
    _add_keys(sub)
    _add_model(sub)
    _add_cluster(sub)
    return parser


def _add_model(sub) -> None:
    p = sub.add_parser("model", help="built-in models as Hugging Face checkpoints")
    cmd = p.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    e = cmd.add_parser("export", help="write a built-in model as a checkpoint directory",
                       description="Write the seeded weights of a built-in model, its "
                                   "config.json and the built-in tokenizer in the Hugging "
                                   "Face layout: a checkpoint that pdkv run --model DIR and "
                                   "transformers' from_pretrained load (docs/models.md).")
    e.add_argument("name", help="built-in model: tiny, small, llama-1b-shape, llama-8b-shape")
    e.add_argument("dir", help="directory to write (created)")
    e.add_argument("--dtype", choices=["float16", "bfloat16", "float32", "float64"],
                   help="weights dtype (default: the model's own)")
    e.add_argument("--layers", type=int, metavar="N",
                   help="only the first N blocks (the built-in draft as its own checkpoint)")
    e.set_defaults(func=_run_model_export)


def _run_model_export(args: argparse.Namespace) -> int:
    from common.model import CONFIGS, export_builtin

    if args.name not in CONFIGS:
        print(f"pdkv model export: unknown built-in model {args.name!r}; allowed: "
              f"{sorted(CONFIGS)}", file=sys.stderr)
        return 2
    print(export_builtin(args.name, args.dir, args.dtype or "", layers=args.layers))
    return 0


def _add_cluster(sub) -> None:
    from deploy.cluster.probe import add_parser

    add_parser(sub)


def _add_keys(sub) -> None:
    from deploy.keys_cli import add_parser

    add_parser(sub)


def _add_replay(sub) -> None:
    p = sub.add_parser(
        "replay", help="verify recorded free logs offline",
        description="Rebuild every pool page by page from free logs and report leaks, "
                    "double frees, foreign frees, reuse while pinned, unknown unpins, "
                    "seq gaps and pages still held at close. Each LOG is one process's "
                    "pools and is verified on its own; a folder stands for every *.freelog "
                    "in it (each restart of a process writes a new file: decode0.freelog, "
                    "decode0.1.freelog, ...). Format: docs/freelog.md.",
        epilog="exit status: 0 every log clean, 1 a violation in some log, 2 a log "
               "unreadable (missing, not msgpack, wrong header or version), 3 a log "
               "incomplete (its writer lost events, e.g. on a full disk: it is never "
               "reported clean). With several logs the most severe wins, in the order "
               "2, 1, 3, 0. A torn last record and a missing close event are warnings, "
               "not failures.")
    p.add_argument("logs", nargs="+", metavar="LOG|DIR",
                   help="free log files to verify, or folders of them")
    p.add_argument("--json", action="store_true",
                   help="print one machine-readable JSON report (ok, exit_code, per log: "
                        "pools stats, warnings, violations) instead of the summary")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw FILE.png: per log and pool, pages by state (owned, pinned, "
                        "pending) stacked against capacity; frees by reason over time; one "
                        "time axis for all logs (needs matplotlib: pip install "
                        "'pdkv[plot]')")
    p.add_argument("--request", metavar="RID",
                   help="with --plot: add a panel of request RID's pages (held, pinned, "
                        "its frees by reason) in every log where it appears")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: only when stderr is a terminal)")
    p.add_argument("--max-violations", type=int, default=50, metavar="N",
                   help="violations printed per log in the summary (all are counted; "
                        "default 50)")
    p.set_defaults(func=_run_replay)


def _run_replay(args: argparse.Namespace) -> int:
    from common.freelog import replay_main

    return replay_main(args)


_BENCH_EPILOG = ("exit status: 0 every goal met (or --report-only), 1 a goal it printed "
                 "was missed, 2 bad arguments.")


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="performance measurements against baselines")
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    t = bench.add_parser("transfer", help="KV transfer throughput between two processes",
                         description="Move the KV of 1k/8k/32k-token requests (32 layers, 8 "
                                     "KV heads, dim 128, fp16, page 16) prefill -> decode; "
                                     "report GB/s next to raw pyzmq, memcpy and pickle.")
    from benchmarks.goals import add_bench_flags  # stdlib only: keeps --help fast

    add_bench_flags(t, quick="small sizes, under 30 s", repeats="5, 2 with --quick")
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
    t.set_defaults(func=_run_bench_transfer)
    _add_bench_allocator(bench)
    _add_bench_replay(bench)
    _add_bench_security(bench)
    _add_bench_serve(bench)
    _add_bench_frontdoor(bench)
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


def _add_serving(sub) -> None:
    _add_run(sub)
    _add_serve(sub)
    _add_frontend(sub)
    _add_top(sub)
    _add_router(sub)
    _add_prefill(sub)
    _add_decode(sub)
    _add_colocated(sub)


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    """Serving-config flags shared by ``run`` and ``bench serve`` (defaults: common/config.py)."""
    g = p.add_argument_group("serving config (defaults from common/config.py)")
    _add_config_source(g, "flags below override it")
    g.add_argument("--model", metavar="NAME|DIR",
                   help="a local checkpoint directory in the Hugging Face layout (config.json, "
                        "*.safetensors, tokenizer files; Llama, Qwen2, Mistral; never "
                        "downloaded; docs/models.md) or a built-in model: tiny (default), "
                        "small, llama-1b-shape, llama-8b-shape")
    g.add_argument("--dtype", choices=["float16", "bfloat16", "float32", "float64"],
                   help="override the model's dtype (default: the checkpoint's own; float64: "
                        "exact comparisons on CPU)")
    g.add_argument("--page-size", type=int, help="slots per KV page (default 16)")
    g.add_argument("--prefill-pages", type=int, help="pages per prefill pool (default 2048)")
    g.add_argument("--decode-pages", type=int, help="pages per decode pool (default 4096)")
    g.add_argument("--chunk-size", type=int, help="prefill chunk in tokens (default 256)")
    g.add_argument("--max-running", type=int, help="decode batch size limit (default 64)")
    g.add_argument("--transport", choices=["ipc", "tcp"],
                   help="addresses on one machine: ipc (default) or tcp on 127.0.0.1")
    g.add_argument("--kv-transport", choices=["zmq", "nixl", "auto"],
                   help="KV data path: zmq (default: frames, or shared memory on one "
                        "host), nixl (required: needs pdkv[nixl] on every worker), auto "
                        "(nixl where both ends have it)")
    g.add_argument("--kv-security", choices=["curve", "plain"],
                   help="KV connections: curve (default: encrypted and authenticated) or "
                        "plain (authenticated, KV bytes in the clear: a private data "
                        "network only; docs/security.md)")
    g.add_argument("--debug-integrity", action="store_true", default=None,
                   help="workers run check_integrity() whenever idle")
    g.add_argument("--prefill-tp", type=int, metavar="N",
                   help="tensor-parallel ranks (processes, devices) per prefill worker "
                        "(default 1; > 1 not built yet for disaggregated workers)")
    g.add_argument("--decode-tp", type=int, metavar="M",
                   help="tensor-parallel ranks per decode or colocated worker (default 1; "
                        "> 1 needs --no-offload; docs/cluster.md)")
    g.add_argument("--tp-timeout-s", type=float, metavar="S",
                   help="deadline of every collective of a tensor-parallel group; a rank "
                        "silent this long takes its group down (default 30)")
    _add_spec_host_flags(p)


def _add_config_source(g, note: str) -> None:
    """``--config FILE.json`` and ``--config-json JSON``, the same on run, router, bench."""
    g.add_argument("--config", metavar="FILE.json",
                   help=f"a JSON file: an object of ServeConfig fields ({note})")
    g.add_argument("--config-json", metavar="JSON",
                   help="the same object given inline, e.g. '{\"page_size\": 32}'")


def _add_spec_host_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding and host tier (docs/host_tier.md)")
    g.add_argument("--spec-k", type=int, metavar="K",
                   help="draft tokens per step for greedy requests; 0 turns speculation off "
                        "(default 3: the tiny model's best decode tokens/s). A checkpoint "
                        "speculates only with --draft-model or --spec-ngram")
    g.add_argument("--draft-model", metavar="DIR",
                   help="draft checkpoint for speculative decoding (same tokenizer as "
                        "--model; its KV is computed by prefill and sent with the target's)")
    g.add_argument("--spec-ngram", type=int, metavar="N",
                   help="speculate by n-gram prompt lookup: propose the tokens that followed "
                        "the latest earlier match of the sequence's last N..1 tokens (no "
                        "draft weights; default 0 = off)")
    g.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                   help="offload committed KV to a host tier and reuse cached prompt "
                        "prefixes on prefill and decode (default on)")
    g.add_argument("--host-pages", type=int, metavar="N",
                   help="pages of each worker's host tier (default 4096)")
    g.add_argument("--overcommit", action="store_true", default=None,
                   help="decode admits on prompt pages alone and retracts the youngest "
                        "request to the host tier when the pool runs out (needs --offload)")
    g.add_argument("--prefix-load-timeout-s", type=float, metavar="S",
                   help="longest wait for a prefix load from the host tier; past it the "
                        "request is served without the cached prefix (default 2.0)")


def _add_workload_flags(p: argparse.ArgumentParser, requests: int | None,
                        default_help: str = "") -> None:
    g = p.add_argument_group("workload (seeded; rids are a pure function of the seed)")
    g.add_argument("--requests", type=int, default=requests, metavar="R",
                   help=f"requests to send (default {default_help or requests})")
    g.add_argument("--seed", type=int, default=0, metavar="S", help="workload seed (default 0)")
    g.add_argument("--rate", type=float, default=8.0,
                   help="mean arrival rate, requests/s, Poisson (default 8; 0 = all at once)")
    g.add_argument("--prompt-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"),
                   help="prompt length range, log-uniform (default 16 256)")
    g.add_argument("--output-len", type=int, nargs=2, default=[8, 48], metavar=("MIN", "MAX"),
                   help="max_new_tokens range, uniform (default 8 48)")
    g.add_argument("--turns", type=int, default=1, metavar="N",
                   help="turns per conversation: each turn's prompt extends the previous "
                        "one (prefix reuse); --requests counts turns (default 1)")
    g.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                   help="system prompt every conversation begins with (default 0)")
    g.add_argument("--turn-gap", type=float, default=1.0, metavar="S",
                   help="seconds between a conversation's turns (default 1.0)")


def _add_deployment_flags(p: argparse.ArgumentParser) -> None:
    """What ``run`` and ``serve`` launch on this machine."""
    p.add_argument("--prefill", type=int, default=1, metavar="N",
                   help="prefill workers (disagg; default 1)")
    p.add_argument("--decode", type=int, default=1, metavar="M",
                   help="decode workers (disagg) or colocated workers (default 1)")
    p.add_argument("--mode", choices=["disagg", "colocated"], default="disagg",
                   help="disagg: separate prefill and decode workers (default); colocated: "
                        "one process does both (the reference)")
    p.add_argument("--devices", default="cpu", metavar="LIST",
                   help="comma-separated devices given to workers round-robin, e.g. "
                        "cuda:0,cuda:1 (default cpu)")
    p.add_argument("--log-dir", metavar="DIR",
                   help="keep free logs (<worker>.freelog) and process logs (<name>.log) "
                        "here (default: a temporary directory, removed when all is clean)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    from deploy.cluster.commands import add_cluster_flags

    add_cluster_flags(p)


def _add_run(sub) -> None:
    p = sub.add_parser(
        "run", help="launch router + workers, serve a synthetic workload, verify free logs",
        description="Start the router and the workers as separate processes (colocated: "
                    "one process per worker doing prefill and decode), wait until all are "
                    "ready, send a seeded workload with Poisson arrivals, print progress and "
                    "a summary, write one JSON line per request, replay every free log "
                    "(fails on any violation) and shut everything down. See "
                    "docs/operations.md.",
        epilog="exit status: 0 all requests served and logs clean; 1 a request failed or "
               "a free log has a violation; 2 a process died or did not start (named).")
    _add_deployment_flags(p)
    p.add_argument("--output", metavar="FILE.jsonl",
                   help="one JSON line per request: rid, output_ids, prompt_len, reason, "
                        "ttft_s, tpot_s")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress line on stderr (default: when stderr is a terminal)")
    p.add_argument("--router", metavar="ADDR",
                   help="launch nothing: send the workload to a running router (workers "
                        "started with pdkv router/prefill/decode, e.g. on several hosts)")
    p.add_argument("--shutdown", action="store_true",
                   help="with --router: stop the deployment afterwards and replay the free "
                        "logs found in --log-dir (needs an operator identity)")
    _add_metrics_flags(p)
    _add_auth_flags(p, None, "with --router: the deployment's key directory; otherwise "
                         "use it instead of the fresh keys made for this run")
    _add_workload_flags(p, 64)
    _add_config_flags(p)
    p.set_defaults(func=_run_run)


def _run_run(args: argparse.Namespace) -> int:
    from deploy.run import main as run_main

    return run_main(args)


def _add_http_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP front door (OpenAI API; docs/http.md)")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks one)")
    g.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: open)")
    g.add_argument("--served-model-name", metavar="NAME",
                   help="model name in /v1/models and in requests (default: the model's)")
    g.add_argument("--max-waiting", type=int, default=256, metavar="N",
                   help="requests the front door holds without a first token; beyond them "
                        "a 429 (default 256)")
    g.add_argument("--router-timeout-s", type=float, default=10.0, metavar="S",
                   help="the router silent this long ends every open request with an error "
                        "and answers 503 until it is back (default 10)")
    g.add_argument("--http-log-level", default="warning",
                   choices=["debug", "info", "warning", "error"],
                   help="uvicorn's log level (default warning; info logs each connection)")
    _add_log_level(p)


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve", help="launch router + workers behind an OpenAI-compatible HTTP server",
        description="Start the router and the workers as in pdkv run, then serve "
                    "/v1/completions, /v1/chat/completions, /v1/models and /health over "
                    "HTTP. Prints the URL when every worker is ready. SIGINT or SIGTERM ends "
                    "open streams with an error chunk, shuts everything down and replays "
                    "the free logs. See docs/http.md.",
        epilog="exit status: 0 clean shutdown and clean free logs; 1 a free-log violation; "
               "2 a process died, did not start, or the port is taken.")
    _add_deployment_flags(p)
    _add_http_flags(p)
    g = p.add_argument_group("authentication (docs/security.md)")
    g.add_argument("--auth-keys", metavar="DIR", default=os.environ.get("PDKV_AUTH_KEYS"),
                   help="use this key directory instead of the fresh keys made for this "
                        "run (default $PDKV_AUTH_KEYS)")
    _add_config_flags(p)
    p.set_defaults(func=_run_serve)


def _add_frontend(sub) -> None:
    p = sub.add_parser(
        "frontend", help="the HTTP front door alone, in front of a running router",
        description="Serve the OpenAI API over HTTP for a deployment started with pdkv "
                    "router/prefill/decode (several hosts; several front doors may share "
                    "one router). See docs/http.md.",
        epilog="exit status: 0 after SIGINT/SIGTERM; 2 the port is taken.")
    p.add_argument("--router", required=True, metavar="ADDR",
                   help="the router's address, e.g. tcp://router-host:5555")
    _add_auth_flags(p, "client", "the deployment's key directory (the front door is a "
                                 "client of the router)")
    _add_http_flags(p)
    p.set_defaults(func=_run_frontend)


def _run_serve(args: argparse.Namespace) -> int:
    from deploy.http.commands import serve_main

    return serve_main(args)


def _run_frontend(args: argparse.Namespace) -> int:
    from deploy.http.commands import frontend_main

    return frontend_main(args)
def _add_top(sub) -> None:
    p = sub.add_parser(
        "top", help="live view of a deployment's KV pages, queues and transfers",
        description="Once a second, read the deployment's metrics from the router (--router) "
                    "or a /metrics URL (--url: the router's --metrics-port, or the HTTP "
                    "front door) and draw every worker: device pool as a stacked bar "
                    "(owned, pinned, pending, free) with page counts, host tier, running "
                    "batch, queues, transfers in flight and their data path (shm, tcp, "
                    "ipc; a same-host peer off shm is highlighted), tokens/s, KV MB/s, "
                    "pages freed/s; then pages freed by reason. Ctrl-C quits. Needs rich: "
                    "pip install 'pdkv[top]'.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--router", metavar="ADDR", help="the router's address, e.g. "
                                                      "tcp://router-host:5555")
    src.add_argument("--url", metavar="URL", help="a Prometheus endpoint serving pdkv's "
                                                  "metrics, e.g. http://host:9400/metrics")
    p.add_argument("--interval", type=float, default=1.0, metavar="S",
                   help="seconds between frames (default 1)")
    p.add_argument("--once", action="store_true",
                   help="print one frame and exit (scripts, logs)")
    p.add_argument("--timeout", type=float, default=2.0, metavar="S",
                   help="deadline of each read (default 2)")
    _add_auth_flags(p, "client", "with --router: the deployment's key directory")
    p.set_defaults(func=_run_top)


def _run_top(args: argparse.Namespace) -> int:
    from deploy.top_cli import main as top_main

    return top_main(args)


def _add_auth_flags(p: argparse.ArgumentParser, identity: str | None, what: str) -> None:
    g = p.add_argument_group("authentication (docs/security.md)")
    g.add_argument("--auth-keys", metavar="DIR", default=os.environ.get("PDKV_AUTH_KEYS"),
                   help=f"{what} (made by pdkv keys create; default $PDKV_AUTH_KEYS). "
                        "Without keys nothing is authenticated and only loopback or a "
                        "private ipc directory may be bound")
    g.add_argument("--identity", metavar="NAME", default=identity,
                   help="identity of the key directory to run as (default "
                        f"{identity or 'operator with --shutdown, else client'})")


def _add_log_level(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="lifecycle log level (default info)")


def _add_router(sub) -> None:
    p = sub.add_parser("router", help="start the router (front door) alone",
                       description="Bind the router; workers register with it (pdkv prefill/"
                                   "decode --router ADDR) and take its serving config.")
    p.add_argument("--bind", default="tcp://127.0.0.1:5555",
                   help="address to bind (default tcp://127.0.0.1:5555; any other host "
                        "needs --auth-keys)")
    _add_config_source(p, "default: the embedded default")
    _add_metrics_flags(p)
    g = p.add_argument_group("authentication (docs/security.md)")
    g.add_argument("--auth-keys", metavar="DIR", default=os.environ.get("PDKV_AUTH_KEYS"),
                   help="the deployment's key directory (made by pdkv keys create; default "
                        "$PDKV_AUTH_KEYS): the router admits exactly its identities. "
                        "Without keys nothing is authenticated and only loopback or a "
                        "private ipc directory may be bound")
    _add_log_level(p)
    p.set_defaults(func=_run_router)


def _add_metrics_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve the deployment's Prometheus metrics (router and every worker, "
                        "labelled by worker) at http://HOST:PORT/metrics; 0 picks a free "
                        "port (default: not served over HTTP; pdkv top still works)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="interface for --metrics-port (default 127.0.0.1; 0.0.0.0 for a "
                        "Prometheus on another host)")


def _run_router(args: argparse.Namespace) -> int:
    from deploy.processes import run_router

    return run_router(args)


def _add_worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", required=True, metavar="ADDR",
                   help="the router's address, e.g. tcp://router-host:5555")
    p.add_argument("--name", help="unique worker name (default <role>-<hostname>)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    p.add_argument("--log-dir", metavar="DIR", help="write the free log <name>.freelog here")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--model", metavar="DIR",
                   help="this host's copy of the deployment's checkpoint directory (default: "
                        "the router's model_path); the KV handshake refuses peers whose "
                        "weights differ")
    p.add_argument("--draft-model", metavar="DIR",
                   help="this host's copy of the draft checkpoint (default: the router's)")
    p.add_argument("--connect-timeout", type=float, default=60.0, metavar="S",
                   help="exit (status 3) when no router answers the registration within S "
                        "seconds (default 60)")
    g = p.add_argument_group("tensor parallelism (docs/cluster.md)")
    g.add_argument("--tp-size", type=int, default=1, metavar="N",
                   help="ranks of this worker's group, one process per device (default 1)")
    g.add_argument("--tp-rank", type=int, default=0, metavar="R",
                   help="this process's rank: 0 registers with the router and schedules, "
                        "the others follow it (default 0)")
    g.add_argument("--tp-address", default="", metavar="tcp://HOST:PORT",
                   help="the group's rendezvous, on rank 0's host; the same for every rank")
    g.add_argument("--tp-timeout-s", type=float, default=30.0, metavar="S",
                   help="deadline of the rendezvous and of every collective (default 30)")
    _add_auth_flags(p, "worker", "the deployment's key directory")
    _add_log_level(p)
    p.set_defaults(func=_run_worker)


def _add_prefill(sub) -> None:
    p = sub.add_parser("prefill", help="start one prefill worker against a router",
                       description="Register with the router, bind the KV sender, serve "
                                   "chunked prefill and stream KV to decode workers.")
    _add_worker_flags(p)
    p.add_argument("--kv-bind", default="tcp://127.0.0.1:5600",
                   help="address the KV sender binds (default tcp://127.0.0.1:5600; "
                        "decodes on other hosts need e.g. tcp://0.0.0.0:5600 and "
                        "--auth-keys)")
    p.add_argument("--kv-advertise", default="",
                   help="address decode workers connect to (default: the bound address; set "
                        "it to tcp://<this-host>:<port> when binding 0.0.0.0)")


def _add_decode(sub) -> None:
    p = sub.add_parser("decode", help="start one decode worker against a router",
                       description="Register with the router, admit requests as memory "
                                   "allows, receive KV from prefill workers, decode in a "
                                   "continuous batch.")
    _add_worker_flags(p)


def _add_colocated(sub) -> None:
    p = sub.add_parser("colocated", help="start one colocated (prefill + decode) worker",
                       description="One process that prefills and decodes over one pool: "
                                   "the reference deployment.")
    _add_worker_flags(p)


def _run_worker(args: argparse.Namespace) -> int:
    from deploy.processes import run_worker

    return run_worker(args)


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
    _add_workload_flags(p, 12)
    _add_config_flags(p)
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
    _add_workload_flags(p, None, "48, 12 with --quick")
    _add_config_flags(p)
    p.set_defaults(func=_run_bench_serve)


def _add_bench_frontdoor(bench) -> None:
    p = bench.add_parser(
        "frontdoor", help="the HTTP front door's cost: HTTP vs straight into the router",
        description="One 1P1D deployment serves the same workload in alternating passes "
                    "straight into the router and through pdkv frontend over streaming "
                    "HTTP; reports TTFT p50 added and the tokens/s ratio (goals: <= 1 ms, "
                    ">= 0.95). The host tier is off unless --offload is given (a pass "
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
    _add_workload_flags(p, None, "48, 12 with --quick")
    _add_config_flags(p)
    p.set_defaults(func=_run_bench_frontdoor)


def _run_bench_frontdoor(args: argparse.Namespace) -> int:
    from benchmarks.frontdoor import main as frontdoor_main

    return frontdoor_main(args)


def _run_bench_serve(args: argparse.Namespace) -> int:
    from benchmarks.serve import main as serve_main

    return serve_main(args)


def main(argv: list[str] | None = None) -> int:
    """Parse and run one command. A config error (a bad value in a flag or a config file,
    a device this machine lacks) is one line on stderr and exit status 2, as argparse's."""
    args = build_parser().parse_args(argv)
    from common.config import ConfigError

    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"pdkv {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"pdkv {version('pdkv')}"
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "pdkv (not installed)"


if __name__ == "__main__":
    sys.exit(main())
