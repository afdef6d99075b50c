"""Bodies of ``pdkv serve`` (a deployment with its HTTP front door) and ``pdkv frontend``
(the front door alone, in front of a running router)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import threading

from common.auth import Keys, KeysError
from deploy.http.access import API_KEY_ENV, Access, AccessError, access_from_args
from deploy.http.hosted import HostedRouter
from deploy.http.server import bind, run_frontend

logger = logging.getLogger(__name__)


class _Stop(Exception):
    """SIGINT or SIGTERM while launching."""


class _Signals:
    """SIGINT/SIGTERM raise ``_Stop`` while ``raising``; otherwise they are only recorded.
    While the HTTP server runs, uvicorn has its own handlers (they end the streams and
    stop the server) and raises the signal again when it returns: recorded here, so the
    deployment then shuts down in order instead of dying."""

    def __init__(self) -> None:
        self.got: list[int] = []
        self.raising = True
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        self.got.append(signum)
        if self.raising:
            raise _Stop(signal.Signals(signum).name)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _http_kwargs(args: argparse.Namespace, access: Access) -> dict:
    return dict(model_name=args.served_model_name or "", access=access,
                max_waiting=args.max_waiting, log_level=args.http_log_level,
                router_timeout_s=args.router_timeout_s)


def _access_or_explain(args: argparse.Namespace) -> Access | None:
    """The front door's lock as asked (``deploy.http.access``); None after saying why not."""
    try:
        return access_from_args(args)
    except AccessError as exc:
        print(f"pdkv {args.command}: {exc}", file=sys.stderr)
        return None


def _bind_or_explain(args: argparse.Namespace) -> socket.socket | None:
    try:
        return bind(args.host, args.port)
    except OSError as exc:
        print(f"pdkv: cannot listen on {args.host}:{args.port}: {exc.strerror}; choose "
              "another --port or --host", file=sys.stderr)
        return None


def frontend_main(args: argparse.Namespace) -> int:
    """``pdkv frontend --router ADDR``: exit 0 after SIGINT/SIGTERM."""
    _setup_logging(args.log_level)
    if args.router_timeout_s <= 0:
        print(f"pdkv frontend: --router-timeout-s={args.router_timeout_s} must be > 0",
              file=sys.stderr)
        return 2
    try:
        keys = Keys(args.auth_keys) if args.auth_keys else None
    except KeysError as exc:
        print(f"pdkv frontend: {exc}", file=sys.stderr)
        return 2
    access = _access_or_explain(args)
    sock = _bind_or_explain(args) if access is not None else None
    if sock is None:
        return 2
    sigs = _Signals()
    sigs.raising = False

    def ready(url: str) -> None:
        print(f"pdkv frontend: serving the OpenAI API at {url}/v1 in front of the router "
              f"at {args.router}", flush=True)

    run_frontend(args.router, sock, on_ready=ready, keys=keys, identity=args.identity or
                 "client", **_http_kwargs(args, access))
    return 0


def serve_main(args: argparse.Namespace) -> int:
    """``pdkv serve``: launch, serve HTTP until a signal, shut down, replay the free logs.
    Exit status: 0 clean, 1 a free-log violation, 2 a process died or did not start.

    The router runs in this process's event loop (``deploy.http.hosted``) unless
    ``--router-process`` asks for its own process (then the front door connects to it
    as ``pdkv frontend`` does)."""
    from deploy.launch.config_args import check_weights, config_from_args
    from deploy.launch.launcher import Cluster, WorkerDied
    from deploy.launch.run import replay_all

    _setup_logging(args.log_level)
    if args.cluster == "ray":  # the front door runs as a Ray actor too
        return serve_on_ray(args)
    cfg = config_from_args(args)
    check_weights(cfg)
    access = _access_or_explain(args)  # before launching: a setting refused fails at once
    sock = _bind_or_explain(args) if access is not None else None  # a busy port too
    if sock is None:
        return 2
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    cluster = Cluster(cfg, args.mode, args.prefill, args.decode, devices, args.log_dir,
                      threads=args.threads, keys_dir=args.auth_keys,
                      router_process=args.router_process)
    layout = (f"{args.prefill}P{args.decode}D" if args.mode == "disagg"
              else f"{args.decode} colocated")
    sigs = _Signals()
    hosted = None
    try:
        keys = Keys(cluster.keys_dir) if cluster.keys_dir else None
        if not args.router_process:
            hosted = HostedRouter(cluster.router_addr, cfg, keys)
        cluster.start()
        if cluster.router_cores:  # the front door (and router) off the decodes' cores
            os.sched_setaffinity(0, cluster.router_cores)
        if hosted is not None:
            asyncio.run(hosted.wait_ready(cluster.worker_names(), cfg.ready_timeout_s,
                                          cluster.check))
        sigs.raising = False
        if not sigs.got:
            where = "in this process" if hosted is not None else "in its own process"
            run_frontend(cluster.router_addr, sock, on_ready=lambda url: print(
                f"pdkv serve: {layout} {cfg.model_name} ready; OpenAI API at {url}/v1; router "
                f"{where} at {cluster.router_addr}\n{_watch_line(cluster)}", flush=True),
                keys=keys, identity="client", hosted=hosted, **_http_kwargs(args, access))
    except (WorkerDied, TimeoutError, KeysError) as exc:
        print(f"pdkv serve: FAILED: {exc}\n  logs: {cluster.log_dir}", file=sys.stderr)
        _stop(cluster, hosted)
        return 2
    except _Stop as exc:
        print(f"pdkv serve: stopped by {exc} while starting", file=sys.stderr)
    finally:
        sigs.raising = False
        sock.close()
    _stop(cluster, hosted)
    return _report(cluster, replay_all(cluster.freelogs(), cluster.final_stats))


def _watch_line(cluster) -> str:
    """How to watch this deployment: ``pdkv top`` at its router, with the key directory
    it runs with (made for this run unless --auth-keys named one; private to this user,
    removed at exit)."""
    keys = f" --auth-keys {cluster.keys_dir}" if cluster.keys_dir else ""
    return f"pdkv serve: watch it with: pdkv top --router {cluster.router_addr}{keys}"


def _stop(cluster, hosted: HostedRouter | None, timeout_s: float = 20.0) -> None:
    """Shut the deployment down through its router; make sure every process is gone."""
    if hosted is not None:
        bye = asyncio.run(hosted.shutdown(timeout_s))
        hosted.close()
        if bye is not None:
            cluster.final_stats = bye.stats
            cluster.write_metrics(bye.metrics)
    cluster.stop(timeout_s)


def _report(cluster, checked: dict) -> int:
    logs = cluster.freelogs()
    problems = checked["violations"] + checked["incomplete"] + checked["unreadable"] + \
        sorted(checked["reported"])  # replay_all's verdicts: any of them is not clean
    print(f"pdkv serve: stopped; {len(logs)} free logs replayed, "
          f"{'clean' if not problems else 'NOT CLEAN: ' + ', '.join(problems)}", flush=True)
    for line in checked["details"]:
        print(line, file=sys.stderr)
    try:
        cluster.check_exit_codes()
    except Exception as exc:  # WorkerDied: named, with its log tail
        print(f"pdkv serve: {exc}", file=sys.stderr)
        return 2
    if problems:
        print(f"pdkv serve: logs kept in {cluster.log_dir}", file=sys.stderr)
        return 1
    cluster.cleanup()
    return 0


def serve_on_ray(args: argparse.Namespace) -> int:
    """``pdkv serve --cluster ray`` (the front door is an actor too, so this process only
    waits for a signal): exit 0 clean, 1 a free-log violation, 2 a process
    died or did not start."""
    from deploy.launch.cluster.ray_launch import RayCluster
    from deploy.launch.config_args import config_from_args
    from deploy.launch.launcher import WorkerDied
    from deploy.launch.run import replay_all

    cfg = config_from_args(args)
    fe = ["--max-waiting", str(args.max_waiting), "--router-timeout-s",
          str(args.router_timeout_s), "--http-log-level", args.http_log_level]
    try:  # the front door actor checks its own address; its files and key are read here
        access = access_from_args(args)
    except AccessError as exc:
        print(f"pdkv serve: {exc}", file=sys.stderr)
        return 2
    fe += ["--served-model-name", args.served_model_name] if args.served_model_name else []
    fe += ["--allow-no-api-key"] if args.allow_no_api_key else []
    fe += ["--ssl-certfile", access.ssl_certfile] if access.tls else []
    fe += ["--ssl-keyfile", access.ssl_keyfile] if access.ssl_keyfile else []
    cluster = RayCluster(cfg, args.mode, args.prefill, args.decode, args.log_dir,
                         threads=args.threads, ray_address=args.ray_address,
                         placement=args.placement, max_restarts=args.ray_max_restarts,
                         frontend=fe, frontend_env={API_KEY_ENV: access.api_key}
                         if access.api_key else None)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cluster.start()
        print(f"pdkv serve: {args.prefill}P{args.decode}D {cfg.model_name} ready on Ray; OpenAI "
              f"API at {cluster.frontend_url}/v1", flush=True)
        while not stop.wait(1.0):
            cluster.check()
    except (WorkerDied, TimeoutError, RuntimeError) as exc:
        print(f"pdkv serve: FAILED: {exc}\n  logs: {cluster.log_dir}", file=sys.stderr)
        cluster.stop()
        return 2
    cluster.stop()
    checked = replay_all(cluster.freelogs(), cluster.final_stats)
    bad = checked["violations"] + checked["incomplete"] + checked["unreadable"]
    bad += sorted(checked["reported"])
    print(f"pdkv serve: stopped; {len(cluster.freelogs())} free logs replayed, "
          f"{'clean' if not bad else 'NOT CLEAN: ' + ', '.join(bad)}", flush=True)
    for line in checked["details"]:
        print(line, file=sys.stderr)
    return 1 if bad else 0
