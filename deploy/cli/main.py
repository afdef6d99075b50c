"""The ``pdkv`` command line: its subcommands and their arguments. Flag groups that several
commands share are ``deploy.launch.flags``; each benchmark registers its own ``pdkv bench``
subcommand (``bench.py``)."""

from __future__ import annotations

import argparse
import os
import sys

from deploy.cli.bench import add_bench
from deploy.launch.flags import (
    add_auth_flags,
    add_config_flags,
    add_config_source,
    add_deployment_flags,
    add_http_flags,
    add_log_level,
    add_metrics_flags,
    add_routing_flags,
    add_workload_flags,
)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; ``argv`` (what will be parsed) names the one benchmark whose
    arguments ``pdkv bench`` loads (all of them for its help)."""
    parser = argparse.ArgumentParser(
        prog="pdkv",
        description="pdkv: KV-cache transfer and lifecycle layer for disaggregated "
                    "prefill/decode serving.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_replay(sub)
    add_bench(sub, argv)
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
    from deploy.cli.pages import add_parser as add_pages

    add_pages(cmd)


def _run_model_export(args: argparse.Namespace) -> int:
    from common.model import CONFIGS, export_builtin

    if args.name not in CONFIGS:
        print(f"pdkv model export: unknown built-in model {args.name!r}; allowed: "
              f"{sorted(CONFIGS)}", file=sys.stderr)
        return 2
    print(export_builtin(args.name, args.dir, args.dtype or "", layers=args.layers))
    return 0


def _add_cluster(sub) -> None:
    from deploy.launch.cluster.probe import add_parser

    add_parser(sub)


def _add_keys(sub) -> None:
    from deploy.cli.keys import add_parser

    add_parser(sub)


def _add_replay(sub) -> None:
    p = sub.add_parser(
        "replay", help="verify recorded free logs offline",
        description="Rebuild every pool page by page from free logs and report leaks, "
                    "double frees, foreign frees, reuse while pinned, unknown unpins, "
                    "seq gaps and pages still held at close. Each LOG is one process's "
                    "pools and is verified on its own; a folder stands for every *.freelog "
                    "in it (each restart of a process writes a new file: decode0.freelog, "
                    "decode0.1.freelog, ...). It also checks the KV digests the logs "
                    "recorded: within a log (what landed against what its message "
                    "claimed, host pages loaded against how they were stored, refused "
                    "pages) and across the logs given (every digest a decode received "
                    "against the one its prefill sent), naming the request and pages. "
                    "Format: docs/freelog.md.",
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
                        "its frees by reason) in every log where it appears; RID is the id "
                        "the client has (the API's cmpl-... id, pdkv run --output's rid) or "
                        "the router's (RID#RUN-N, as logs name it)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: only when stderr is a terminal)")
    p.add_argument("--max-violations", type=int, default=50, metavar="N",
                   help="violations printed per log in the summary (all are counted; "
                        "default 50)")
    p.set_defaults(func=_run_replay)


def _run_replay(args: argparse.Namespace) -> int:
    from common.freelog import replay_main

    return replay_main(args)


def _add_serving(sub) -> None:
    _add_run(sub)
    _add_serve(sub)
    _add_frontend(sub)
    _add_top(sub)
    _add_drain(sub)
    _add_router(sub)
    _add_prefill(sub)
    _add_decode(sub)
    _add_colocated(sub)


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
    add_deployment_flags(p)
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
    add_metrics_flags(p)
    add_auth_flags(p, None, "with --router: the deployment's key directory; otherwise "
                         "use it instead of the fresh keys made for this run")
    add_workload_flags(p, 64)
    add_config_flags(p)
    p.set_defaults(func=_run_run)


def _run_run(args: argparse.Namespace) -> int:
    from deploy.launch.run import main as run_main

    return run_main(args)


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve", help="launch router + workers behind an OpenAI-compatible HTTP server",
        description="Start the router and the workers as in pdkv run, then serve "
                    "/v1/completions, /v1/chat/completions, /v1/models and /health over "
                    "HTTP. Prints the URL when every worker is ready. SIGINT or SIGTERM ends "
                    "open streams with an error chunk, shuts everything down and replays "
                    "the free logs. See docs/http.md.",
        epilog="exit status: 0 clean shutdown and clean free logs; 1 a free-log violation; "
               "2 a process died, did not start, the port is taken, or the front door may "
               "not serve as asked (beyond loopback without an API key; a TLS file that "
               "does not load).")
    add_deployment_flags(p)
    add_http_flags(p)
    p.add_argument("--router-process", action="store_true",
                   help="run the router in a process of its own, the front door connecting "
                        "to it over a socket (default: the router runs in the front door's "
                        "event loop, which saves a socket hop each way; docs/http.md)")
    g = p.add_argument_group("authentication (docs/security.md)")
    g.add_argument("--auth-keys", metavar="DIR", default=os.environ.get("PDKV_AUTH_KEYS"),
                   help="use this key directory instead of the fresh keys made for this "
                        "run (default $PDKV_AUTH_KEYS)")
    add_config_flags(p)
    p.set_defaults(func=_run_serve)


def _add_frontend(sub) -> None:
    p = sub.add_parser(
        "frontend", help="the HTTP front door alone, in front of a running router",
        description="Serve the OpenAI API over HTTP for a deployment started with pdkv "
                    "router/prefill/decode (several hosts; several front doors may share "
                    "one router). See docs/http.md.",
        epilog="exit status: 0 after SIGINT/SIGTERM; 2 the port is taken, or it may not "
               "serve as asked (beyond loopback without an API key; a TLS file that does "
               "not load).")
    p.add_argument("--router", required=True, metavar="ADDR",
                   help="the router's address, e.g. tcp://router-host:5555")
    add_auth_flags(p, "client", "the deployment's key directory (the front door is a "
                                 "client of the router)")
    add_http_flags(p)
    p.set_defaults(func=_run_frontend)


def _run_serve(args: argparse.Namespace) -> int:
    from deploy.launch.serve import serve_main

    return serve_main(args)


def _run_frontend(args: argparse.Namespace) -> int:
    from deploy.launch.serve import frontend_main

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
    add_auth_flags(p, "client", "with --router: the deployment's key directory")
    p.set_defaults(func=_run_top)


def _run_top(args: argparse.Namespace) -> int:
    from deploy.cli.top import main as top_main

    return top_main(args)


def _add_drain(sub) -> None:
    from deploy.cli.drain import add_parser

    add_parser(sub)


def _add_router(sub) -> None:
    p = sub.add_parser("router", help="start the router (front door) alone",
                       description="Bind the router; workers register with it (pdkv prefill/"
                                   "decode --router ADDR) and take its serving config.")
    p.add_argument("--bind", default="tcp://127.0.0.1:5555",
                   help="address to bind (default tcp://127.0.0.1:5555; any other host "
                        "needs --auth-keys)")
    add_config_source(p, "default: the embedded default")
    add_routing_flags(p)
    add_metrics_flags(p)
    g = p.add_argument_group("authentication (docs/security.md)")
    g.add_argument("--auth-keys", metavar="DIR", default=os.environ.get("PDKV_AUTH_KEYS"),
                   help="the deployment's key directory (made by pdkv keys create; default "
                        "$PDKV_AUTH_KEYS): the router admits exactly its identities. "
                        "Without keys nothing is authenticated and only loopback or a "
                        "private ipc directory may be bound")
    add_log_level(p)
    p.set_defaults(func=_run_router)


def _run_router(args: argparse.Namespace) -> int:
    from deploy.launch.processes import run_router

    return run_router(args)


def _add_worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", required=True, metavar="ADDR",
                   help="the router's address, e.g. tcp://router-host:5555")
    p.add_argument("--name", help="unique worker name (default <role>-<hostname>)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    p.add_argument("--log-dir", metavar="DIR", help="write the free log <name>.freelog here")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (default 0: one per core of this process's CPU "
                        "affinity, e.g. taskset -c 0-3 pdkv decode ...)")
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
                   help="deadline of every collective once the group joined (default 30)")
    g.add_argument("--tp-rendezvous-timeout-s", type=float, default=120.0, metavar="S",
                   help="how long the ranks wait for each other to start and join, a "
                        "startup deadline (default 120; pdkv run passes ready_timeout_s)")
    g = p.add_argument_group("KV events (docs/kv_events.md)")
    g.add_argument("--kv-events-endpoint", default="", metavar="ADDR",
                   help="publish what this worker's caches hold in vLLM's KV events format "
                        "on a ZMQ PUB socket bound here (e.g. tcp://127.0.0.1:5557; another "
                        "host's router needs tcp://0.0.0.0:5557 and --auth-keys); the router "
                        "learns the address at registration (default: no events)")
    g.add_argument("--kv-events-replay-endpoint", default="", metavar="ADDR",
                   help="the replay socket's bind address (default: the next TCP port, or "
                        "PATH.replay for ipc://PATH)")
    g.add_argument("--kv-events-advertise-host", default="", metavar="HOST",
                   help="the host subscribers connect to when the endpoint binds a wildcard "
                        "(default: this host's name)")
    add_auth_flags(p, "worker", "the deployment's key directory")
    add_log_level(p)
    p.set_defaults(func=_run_worker)


def _add_prefill(sub) -> None:
    p = sub.add_parser("prefill", help="start one prefill worker against a router",
                       description="Register with the router, bind the KV sender, serve "
                                   "chunked prefill and stream KV to decode workers.")
    _add_worker_flags(p)
    p.add_argument("--kv-bind", default="tcp://127.0.0.1:5600",
                   help="address the KV sender binds (default tcp://127.0.0.1:5600; "
                        "decodes on other hosts need e.g. tcp://0.0.0.0:5600 and "
                        "--auth-keys); every rank of a tensor-parallel prefill binds its own")
    p.add_argument("--kv-advertise", default="",
                   help="address decode workers connect to (default: the bound address; set "
                        "it to tcp://<this-host>:<port> when binding 0.0.0.0); per rank too")


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
    from deploy.launch.processes import run_worker

    return run_worker(args)


def main(argv: list[str] | None = None) -> int:
    """Parse and run one command. A config error (a bad value in a flag or a config file,
    a device this machine lacks) is one line on stderr and exit status 2, as argparse's."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
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
