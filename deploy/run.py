"""``pdkv run``: launch a deployment, serve a seeded workload, report, verify, shut down."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from common.config import DEFAULT, ServeConfig, resolve_model
from common.freelog import replay_file
from deploy.driver import Result, drive, router_lost
from deploy.launcher import Cluster, WorkerDied
from deploy.summary import format_summary, summarize
from deploy.workload import WorkloadSpec, make_workload

logger = logging.getLogger(__name__)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The embedded default, then ``--config FILE.json``, then individual flags."""
    cfg = DEFAULT
    if getattr(args, "config", None):
        cfg = ServeConfig.from_dict({**DEFAULT.to_dict(),
                                     **json.loads(Path(args.config).read_text())})
    draft = getattr(args, "draft_model", None)
    return cfg.with_overrides(
        **resolve_model(args.model), dtype=args.dtype, page_size=args.page_size,
        draft_model_path=str(Path(draft).expanduser().resolve()) if draft else None,
        spec_ngram=getattr(args, "spec_ngram", None),
        prefill_pages=args.prefill_pages, decode_pages=args.decode_pages,
        chunk_size=args.chunk_size, max_running=args.max_running, transport=args.transport,
        debug_integrity=args.debug_integrity, spec_k=args.spec_k, offload=args.offload,
        host_pages=args.host_pages, overcommit=args.overcommit,
        prefix_load_timeout_s=getattr(args, "prefix_load_timeout_s", None),
        prefill_tp=getattr(args, "prefill_tp", None), decode_tp=getattr(args, "decode_tp", None),
        tp_timeout_s=getattr(args, "tp_timeout_s", None))


def workload_from_args(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(requests=args.requests, seed=args.seed, rate=args.rate,
                        prompt_len=tuple(args.prompt_len), output_len=tuple(args.output_len),
                        turns=args.turns, shared_prefix=args.shared_prefix,
                        turn_gap_s=args.turn_gap)


def serve_workload(cluster: Cluster, spec: WorkloadSpec, progress: bool = False,
                   aborts: dict[str, float] | None = None, params: dict | None = None
                   ) -> tuple[dict[str, Result], dict, float]:
    """Run ``spec`` through a started cluster (``params``: extra sampling parameters of
    every request); returns (results, worker stats, wall s). Stops the cluster (clean
    shutdown) before returning."""
    requests = make_workload(spec, cluster.config.model_config().vocab_size)
    show = _progress_line if progress else None
    t0 = time.monotonic()
    try:
        results = drive(cluster.client, requests, params=params, aborts=aborts,
                        check=cluster.check,
                        progress=show, timeout_s=cluster.config.request_timeout_s,
                        lease_s=cluster.config.lease_s)
    finally:
        if progress:
            sys.stderr.write("\n")
    wall = max((r.t_done for r in results.values()), default=t0) - \
        min((r.t_submit for r in results.values()), default=t0)
    stats = cluster.stop()
    cluster.check_exit_codes()
    return results, stats, wall


def _progress_line(done: int, total: int) -> None:
    sys.stderr.write(f"\r  {done}/{total} requests done")
    sys.stderr.flush()


def replay_all(paths: list[Path]) -> list[str]:
    """Replay each free log; returns one line per log with a problem."""
    problems = []
    for path in paths:
        report = replay_file(path)
        if not report.ok:
            problems.append(f"{path.name}: {len(report.violations)} violation(s)\n"
                            f"{report.format()}")
    return problems


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    if args.router:
        return _attach(args, progress)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:  # a bad flag or a checkpoint pdkv refuses: before any process
        print(f"pdkv run: {exc}", file=sys.stderr)
        return 2
    spec = workload_from_args(args)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    cluster = Cluster(cfg, args.mode, args.prefill, args.decode, devices, args.log_dir,
                      threads=args.threads, metrics_port=args.metrics_port,
                      metrics_host=args.metrics_host)
    layout = (f"{args.prefill}P{args.decode}D" if args.mode == "disagg"
              else f"{args.decode} colocated")
    if max(cfg.prefill_tp, cfg.decode_tp) > 1:
        layout += f" (TP {cfg.prefill_tp}/{cfg.decode_tp})" if args.mode == "disagg" else \
            f" (TP{cfg.decode_tp})"
    try:
        cluster.start()
        if cluster.metrics_url:
            print(f"pdkv run: metrics at {cluster.metrics_url}", file=sys.stderr)
        if progress:
            sys.stderr.write(f"pdkv run: {layout} ready, sending {spec.requests} requests\n")
        results, stats, wall = serve_workload(cluster, spec, progress)
    except (WorkerDied, TimeoutError) as exc:
        cluster.stop()
        print(f"pdkv run: FAILED: {exc}\n  logs: {cluster.log_dir}", file=sys.stderr)
        return 2
    code = _report(args, results, summarize(results, stats, wall), cluster.freelogs(),
                   layout, cluster.log_dir)
    if code == 0:
        cluster.cleanup()
    return code


def _attach(args: argparse.Namespace, progress: bool) -> int:
    """``--router ADDR``: drive the workload through a running deployment."""
    from deploy.client import Client

    client = Client(args.router, "pdkv-run")
    try:
        status = client.status(10.0)
        workers = status.workers
        cfg = ServeConfig.from_dict(status.config)
        requests = make_workload(workload_from_args(args), cfg.model_config().vocab_size)
        t0 = time.monotonic()
        results = drive(client, requests, progress=_progress_line if progress else None,
                        lease_s=cfg.lease_s)
        wall = time.monotonic() - t0
        if lost := router_lost(results):
            _write_output(args, results)
            print(f"pdkv run: FAILED: {lost}", file=sys.stderr)
            return 2
        stats = client.shutdown() if args.shutdown else {}
    except TimeoutError as exc:
        print(f"pdkv run: FAILED: {exc}", file=sys.stderr)
        return 2
    finally:
        client.close()
    logs = sorted(Path(args.log_dir).glob("*.freelog")) if args.log_dir and args.shutdown \
        else []
    return _report(args, results, summarize(results, stats, wall), logs,
                   f"{len(workers)} workers at {args.router}", args.log_dir or "")


def _report(args: argparse.Namespace, results: dict[str, Result], summary: dict,
            freelogs: list[Path], layout: str, log_dir) -> int:
    """Replay the free logs, write --output, print the summary; the exit status."""
    problems = replay_all(freelogs)
    summary["freelogs"], summary["freelog_violations"] = len(freelogs), len(problems)
    _write_output(args, results)
    if args.json:
        print(json.dumps({"mode": args.mode, "layout": layout, **summary}))
    else:
        print(format_summary(summary, args.mode, layout))
        print(f"  free logs     {len(freelogs)} replayed, "
              f"{'clean' if not problems else 'VIOLATIONS'}")
    for p in problems:
        print(p, file=sys.stderr)
    if problems or summary["ok"] != summary["requests"]:
        print(f"pdkv run: {'free-log violations' if problems else 'requests failed'}; "
              f"logs kept in {log_dir}", file=sys.stderr)
        return 1
    return 0


def _write_output(args: argparse.Namespace, results: dict[str, Result]) -> None:
    """``--output``: one JSON line per request (the finished ones and why others ended)."""
    if args.output:
        with open(args.output, "w") as f:
            for rid in sorted(results):
                f.write(json.dumps(results[rid].to_json()) + "\n")
