"""The ``--cluster`` flags of ``pdkv run`` and ``pdkv serve``, and ``pdkv serve --cluster
ray`` (the front door is an actor too, so this process only waits for a signal)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from common.config import ServeConfig


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (docs/cluster.md)")
    g.add_argument("--cluster", choices=["local", "ray"], default="local",
                   help="local: processes on this machine (default); ray: router, front "
                        "door and every worker as Ray actors, one placement group per "
                        "worker (pip install 'pdkv[ray]')")
    g.add_argument("--ray-address", default="", metavar="ADDR",
                   help="the Ray cluster to join (HEAD:PORT or auto; default: start Ray on "
                        "this machine for the run)")
    g.add_argument("--placement", choices=["spread", "pack"], default="spread",
                   help="ray: workers on as many nodes as possible (spread, default) or on "
                        "as few as possible (pack)")
    g.add_argument("--ray-max-restarts", type=int, default=3, metavar="N",
                   help="ray: how often a worker that died comes back: Ray restarts a "
                        "one-rank worker's actor, the launcher all ranks of a "
                        "tensor-parallel group (default 3; then the run fails)")


def make_cluster(args: argparse.Namespace, cfg: ServeConfig, devices: list[str], **kw):
    """The launcher the flags ask for (``Cluster`` or ``RayCluster``)."""
    from deploy.launcher import Cluster

    if getattr(args, "cluster", "local") != "ray":
        return Cluster(cfg, args.mode, args.prefill, args.decode, devices, args.log_dir,
                       threads=args.threads, **kw)
    from deploy.cluster.ray_launch import RayCluster

    if args.devices != "cpu":
        raise ValueError("--devices is for one machine; with --cluster ray each worker gets "
                         "the GPU of its placement group (or the CPU)")
    return RayCluster(cfg, args.mode, args.prefill, args.decode, args.log_dir,
                      threads=args.threads, ray_address=args.ray_address,
                      placement=args.placement, max_restarts=args.ray_max_restarts, **kw)


def serve_on_ray(args: argparse.Namespace) -> int:
    """``pdkv serve --cluster ray``: exit 0 clean, 1 a free-log violation, 2 a process
    died or did not start."""
    from deploy.cluster.ray_launch import RayCluster
    from deploy.config_args import config_from_args
    from deploy.launcher import WorkerDied
    from deploy.run import replay_all

    cfg = config_from_args(args)
    fe = ["--max-waiting", str(args.max_waiting), "--router-timeout-s",
          str(args.router_timeout_s), "--http-log-level", args.http_log_level]
    fe += ["--api-key", args.api_key] if args.api_key else []
    fe += ["--served-model-name", args.served_model_name] if args.served_model_name else []
    cluster = RayCluster(cfg, args.mode, args.prefill, args.decode, args.log_dir,
                         threads=args.threads, ray_address=args.ray_address,
                         placement=args.placement, max_restarts=args.ray_max_restarts,
                         frontend=fe)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cluster.start()
        print(f"pdkv serve: {args.prefill}P{args.decode}D {cfg.model} ready on Ray; OpenAI "
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
