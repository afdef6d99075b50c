"""``pdkv run``: launch a deployment, serve a seeded workload, report, verify, shut down."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path

from common.auth import KeysError
from common.config import ConfigError, ServeConfig
from common.freelog import UnreadableLog, replay_file
from deploy.launch.cluster.commands import make_cluster
from deploy.launch.config_args import check_weights, config_from_args
from deploy.launch.launcher import Cluster, WorkerDied
from deploy.loadgen.driver import Result, drive, router_lost
from deploy.loadgen.summary import format_summary, summarize
from deploy.loadgen.workload import WorkloadSpec, make_workload

logger = logging.getLogger(__name__)


def check_devices(devices: list[str]) -> None:
    """Refuse devices this machine does not have, before any process starts.

    Raises:
        ConfigError: naming the device and what the machine has.
    """
    if all(dev == "cpu" for dev in devices):
        return  # nothing to check, and no torch to import for it: the launcher needs none
    import torch

    for dev in devices:
        try:
            d = torch.device(dev)
        except (RuntimeError, ValueError):
            raise ConfigError(f"device {dev!r} is not a device; allowed: cpu, cuda, "
                              "cuda:N") from None
        if d.type == "cpu":
            continue
        if d.type != "cuda":
            raise ConfigError(f"device {dev!r}: allowed: cpu, cuda, cuda:N")
        if not torch.cuda.is_available():
            raise ConfigError(f"device {dev!r}: this machine has no usable CUDA device "
                              "(torch.cuda.is_available() is False); use cpu")
        count = torch.cuda.device_count()
        if d.index is not None and d.index >= count:
            raise ConfigError(f"device {dev!r}: this machine has {count} CUDA device(s), "
                              f"cuda:0 to cuda:{count - 1}")


def devices_from(spec: str) -> list[str]:
    """``--devices`` (comma-separated) as a list, checked against this machine.

    Raises:
        ConfigError: a device that is none or that this machine lacks (``check_devices``).
    """
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    check_devices(devices)
    return devices


def workload_from_args(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(requests=args.requests, seed=args.seed, rate=args.rate,
                        prompt_len=tuple(args.prompt_len), output_len=tuple(args.output_len),
                        turns=args.turns, shared_prefix=args.shared_prefix,
                        turn_gap_s=args.turn_gap)


def serve_workload(cluster: Cluster, spec: WorkloadSpec, progress: bool = False,
                   aborts: dict[str, float] | None = None, params: dict | None = None,
                   into: dict[str, Result] | None = None
                   ) -> tuple[dict[str, Result], dict, float]:
    """Run ``spec`` through a started cluster (``params``: extra sampling parameters of
    every request); returns (results, worker stats, wall s). Stops the cluster (clean
    shutdown) before returning. ``into`` keeps the results that had arrived when a worker
    died (``WorkerDied``) or the deadline passed."""
    requests = make_workload(spec, cluster.config.model_config().vocab_size)
    show = _progress_line if progress else None
    t0 = time.monotonic()
    try:
        results = drive(cluster.client, requests, params=params, aborts=aborts,
                        check=cluster.check,
                        progress=show, timeout_s=cluster.config.request_timeout_s,
                        lease_s=cluster.config.lease_s, into=into)
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


def replay_all(paths: list[Path], stats: dict | None = None) -> dict:
    """Replay each free log and gather what the workers said about theirs.

    Returns ``{"clean": [names], "violations": [names], "incomplete": [names],
    "unreadable": [names], "reported": {worker: problem}, "details": [text]}``: a log is
    incomplete when it holds a ``lost`` marker, or when its worker reported events it
    never wrote (the file then just ends, and replay alone cannot tell).
    """
    out: dict = {"clean": [], "violations": [], "incomplete": [], "unreadable": [],
                 "reported": {}, "details": []}
    for name, s in (stats or {}).items():
        if s.get("freelog_problem"):
            out["reported"][name] = str(s["freelog_problem"])
        for key, problem in s.items():  # a tensor-parallel follower's, via its rank 0
            rank, _, what = key.partition(".")
            if what == "freelog_problem" and rank.startswith("tp") and problem:
                out["reported"][f"{name}/{rank}"] = str(problem)
    for path in paths:
        try:
            report = replay_file(path)
        except UnreadableLog as exc:
            out["unreadable"].append(path.name)
            out["details"].append(f"{path.name}: UNREADABLE: {exc}")
            continue
        said = out["reported"].get(report.node, "")  # names the files it could not write
        if report.num_violations:
            out["violations"].append(path.name)
        elif report.incomplete or f"/{path.name}:" in said:
            out["incomplete"].append(path.name)
        else:
            out["clean"].append(path.name)
            continue
        out["details"].append(f"{path.name}:\n{report.format()}")
    out["details"] += [f"{w}: {p}" for w, p in out["reported"].items()]
    return out


def _free_log_line(checked: dict) -> str:
    total = sum(len(checked[k]) for k in ("clean", "violations", "incomplete", "unreadable"))
    bad = [f"{len(checked[k])} {label} ({', '.join(checked[k])})" for k, label in (
        ("violations", "with VIOLATIONS"), ("incomplete", "INCOMPLETE"),
        ("unreadable", "UNREADABLE")) if checked[k]]
    if checked.get("unchecked"):  # never "clean" for what was not looked at
        bad.append(f"NOT VERIFIED: {checked['unchecked']}")
    return f"  free logs     {total} replayed, " + (", ".join(bad) if bad else "clean")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    if args.router:
        return _attach(args, progress)
    try:
        cfg = config_from_args(args)
        check_weights(cfg)
    except ValueError as exc:  # a bad flag or a checkpoint pdkv refuses: before any process
        print(f"pdkv run: error: {exc}", file=sys.stderr)  # as deploy.cli.main prints ConfigError
        return 2
    spec = workload_from_args(args)
    devices = devices_from(args.devices)
    try:
        cluster = make_cluster(args, cfg, devices, keys_dir=args.auth_keys,
                               metrics_port=args.metrics_port, metrics_host=args.metrics_host)
    except ValueError as exc:
        print(f"pdkv run: {exc}", file=sys.stderr)
        return 2
    layout = (f"{args.prefill}P{args.decode}D" if args.mode == "disagg"
              else f"{args.decode} colocated")
    if max(cfg.prefill_tp, cfg.decode_tp) > 1:
        layout += f" (TP {cfg.prefill_tp}/{cfg.decode_tp})" if args.mode == "disagg" else \
            f" (TP{cfg.decode_tp})"
    results: dict[str, Result] = {}
    try:
        cluster.start(progress=_starting_line if progress else None)
        if cluster.metrics_url:
            print(f"\npdkv run: metrics at {cluster.metrics_url}", file=sys.stderr)
        if progress:
            sys.stderr.write(f"\npdkv run: {layout} ready, sending {spec.requests} requests\n")
        results, stats, wall = serve_workload(cluster, spec, progress, into=results)
    except (WorkerDied, TimeoutError, RuntimeError) as exc:  # Ray placement, KeysError
        cluster.stop()
        _write_output(args, results)
        finished = sum(1 for r in results.values() if r.reason)
        print(f"pdkv run: FAILED: {exc}\n  logs: {cluster.log_dir}" + (
            f"\n  {finished} finished request(s) written to {args.output}"
            if args.output else ""), file=sys.stderr)
        return 2
    code = _report(args, results, summarize(results, stats, wall), cluster.freelogs(),
                   layout, cluster.log_dir, stats)
    if code == 0:
        cluster.cleanup()
    return code


def _starting_line(state: dict) -> None:
    """Progress while the deployment starts: who registered, who is ready (built)."""
    sys.stderr.write(f"\r  starting: {state['registered']}/{state['total']} workers "
                     f"registered, {state['ready']}/{state['total']} ready "
                     f"(building models), {state['elapsed_s']:.0f} s ")
    sys.stderr.flush()


def _attach(args: argparse.Namespace, progress: bool) -> int:
    """``--router ADDR``: drive the workload through a running deployment.

    The summary covers this run only: figures come from this run's requests; figures
    that need the workers' counters (which span the deployment's lifetime) say n/a."""
    from common.auth import Keys
    from deploy.router.client import Client

    identity = args.identity or ("operator" if args.shutdown else "client")
    try:
        client = Client(args.router, "pdkv-run", Keys(args.auth_keys) if args.auth_keys
                        else None, identity)
    except KeysError as exc:
        print(f"pdkv run: {exc}", file=sys.stderr)
        return 2
    results: dict[str, Result] = {}
    try:
        status = client.status(10.0)
        workers = status.workers
        cfg = ServeConfig.from_dict(status.config)
        requests = make_workload(workload_from_args(args), cfg.model_config().vocab_size)
        t0 = time.monotonic()
        drive(client, requests, progress=_progress_line if progress else None,
              lease_s=cfg.lease_s, into=results)
        wall = time.monotonic() - t0
        if lost := router_lost(results):
            _write_output(args, results)
            print(f"pdkv run: FAILED: {lost}", file=sys.stderr)
            return 2
        stats = client.shutdown() if args.shutdown else {}
    except (TimeoutError, PermissionError) as exc:
        _write_output(args, results)
        print(f"pdkv run: FAILED: {exc}", file=sys.stderr)
        return 2
    finally:
        client.close()
    logs, unchecked = attached_logs(args.log_dir, args.shutdown, sorted(workers))
    summary = summarize(results, {}, wall, this_run_only=True)
    return _report(args, results, summary, logs, f"{len(workers)} workers at {args.router}",
                   args.log_dir or "", stats, unchecked)


def attached_logs(log_dir: str | None, shutdown: bool, workers: list[str]
                  ) -> tuple[list[Path], str]:
    """``--router``: the free logs to replay, and why the deployment is not verified
    ('' when it is): the workers still run (no ``--shutdown``: their logs are open), no
    ``--log-dir`` says where they wrote, or a worker left no log there (started without
    ``--log-dir``, it records nothing; nothing then proves its pages)."""
    if not shutdown:
        return [], ("not replayed: the workers still run (--shutdown stops them, then "
                    "their logs in --log-dir are replayed)")
    if not log_dir:
        return [], "not replayed: give --log-dir DIR, the folder the workers write them to"
    logs = sorted(Path(log_dir).glob("*.freelog"))
    missing = [w for w in workers  # its device pool's log: NAME.freelog, NAME.1.freelog...
               if not any(re.fullmatch(rf"{re.escape(w)}(\.\d+)?\.freelog", p.name)
                          for p in logs)]
    if missing:
        return logs, (f"no free log in {log_dir} for {', '.join(missing)} (a worker "
                      "started without --log-dir records nothing)")
    return logs, ""


def _write_output(args: argparse.Namespace, results: dict[str, Result]) -> None:
    """``--output``: one JSON line per request that ended (all of them after a full run)."""
    if args.output:
        with open(args.output, "w") as f:
            for rid in sorted(results):
                if results[rid].reason:
                    f.write(json.dumps(results[rid].to_json()) + "\n")


def _report(args: argparse.Namespace, results: dict[str, Result], summary: dict,
            freelogs: list[Path], layout: str, log_dir, stats: dict | None = None,
            unchecked: str = "") -> int:
    """Replay the free logs, write --output, print the summary; the exit status.
    ``unchecked``: why the deployment's logs are not (all) verified, printed instead of
    "clean"; a worker without a log fails the run as an incomplete log does."""
    checked = replay_all(freelogs, stats)
    checked["unchecked"] = unchecked
    if unchecked and freelogs:  # logs are missing: what was replayed is not all
        checked["missing"] = unchecked
    summary["freelogs"] = len(freelogs)
    summary["freelogs_unchecked"] = unchecked
    summary["freelog_violations"] = len(checked["violations"])
    summary["freelog_incomplete"] = checked["incomplete"] + checked["unreadable"]
    summary["freelog_problems"] = checked["reported"]
    _write_output(args, results)
    if args.json:
        print(json.dumps({"mode": args.mode, "layout": layout, **summary}))
    else:
        print(format_summary(summary, args.mode, layout))
        print(_free_log_line(checked))
    for p in checked["details"]:
        print(p, file=sys.stderr)
    bad_logs = checked["violations"] or summary["freelog_incomplete"] or \
        checked["reported"] or checked.get("missing")
    if bad_logs or summary["ok"] != summary["requests"]:
        why = "free-log violations" if checked["violations"] else (
            "free logs incomplete" if bad_logs else "requests failed")
        print(f"pdkv run: {why}; logs kept in {log_dir}", file=sys.stderr)
        return 1
    return 0
