"""``pdkv probe``: is one worker ready, as the router sees it? For orchestrators' readiness
checks (a Kubernetes exec probe, a systemd ``ExecStartPost``), where a worker has no HTTP
port of its own: the router is the one place that knows whether a worker registered,
built its model and pool, and still renews its lease."""

from __future__ import annotations

import argparse
import os
import sys

from deploy.router.client import Client


def add_parser(sub) -> None:
    p = sub.add_parser(
        "probe", help="exit 0 when the router counts a worker ready (readiness checks)",
        description="Ask the router for its status and report one worker: ready (exit 0), "
                    "registered but not ready or lost (exit 1), router not answering "
                    "(exit 2). Meant for Kubernetes readiness probes (deploy/k8s/).",
        epilog="exit status: 0 ready; 1 not registered, still building, or lost; 2 the "
               "router did not answer within --timeout.")
    p.add_argument("--router", required=True, metavar="ADDR",
                   help="the router's address, e.g. tcp://pdkv-router:5555")
    p.add_argument("--worker", required=True, metavar="NAME",
                   help="the worker's name (its --name)")
    p.add_argument("--timeout", type=float, default=3.0, metavar="S",
                   help="how long to wait for the router (default 3)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    client = Client(args.router, name=f"probe-{os.getpid()}")
    try:
        report = client.status(timeout_s=args.timeout)
    except TimeoutError:
        print(f"pdkv probe: the router at {args.router} did not answer within "
              f"{args.timeout:g} s", file=sys.stderr)
        return 2
    finally:
        client.close()
    worker = report.workers.get(args.worker)
    if worker is None:
        known = ", ".join(sorted(report.workers)) or "none"
        print(f"{args.worker}: not registered with the router (registered: {known})")
        return 1
    state = "lost" if worker["lost"] else "ready" if worker["ready"] else "building"
    print(f"{args.worker}: {state} ({worker['role']}, pid {worker['pid']})")
    return 0 if state == "ready" else 1
