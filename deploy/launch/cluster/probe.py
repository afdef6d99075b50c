"""``pdkv probe``: is one worker ready, as the router sees it? For orchestrators' readiness
checks (a Kubernetes exec probe, a systemd ``ExecStartPost``), where a worker has no HTTP
port of its own: the router is the one place that knows whether a worker registered,
built its model and pool, and still renews its lease.

Against a router with keys the probe authenticates like any peer: by default as the
``probe`` identity, which may ask the router's status and nothing else (docs/security.md,
"Roles on the control plane"), so a worker's host needs no more than the worker key and
the probe key. A router that refuses us is reported as refusing, never as silent."""

from __future__ import annotations

import argparse
import os
import sys

from common.auth import Keys, KeysError, control_client, handshake_check
from deploy.router.client import Client

READY, NOT_READY, NO_ANSWER, REFUSED = 0, 1, 2, 3


def add_parser(sub) -> None:
    p = sub.add_parser(
        "probe", help="exit 0 when the router counts a worker ready (readiness checks)",
        description="Ask the router for its status and report one worker: ready (exit 0), "
                    "registered but not ready or lost (exit 1), router not answering "
                    "(exit 2), the router refusing our identity (exit 3). Meant for "
                    "Kubernetes readiness probes (deploy/k8s/).",
        epilog="exit status: 0 ready; 1 not registered, still building, or lost; 2 the "
               "router did not answer within --timeout; 3 the router refused us (no keys "
               "for a router that has them, a key it does not know, or an identity that "
               "may not ask its status).")
    p.add_argument("--router", required=True, metavar="ADDR",
                   help="the router's address, e.g. tcp://pdkv-router:5555")
    p.add_argument("--worker", required=True, metavar="NAME",
                   help="the worker's name (its --name)")
    p.add_argument("--timeout", type=float, default=3.0, metavar="S",
                   help="how long to wait for the router (default 3)")
    p.add_argument("--auth-keys", metavar="DIR", default=os.environ.get("PDKV_AUTH_KEYS"),
                   help="the deployment's key directory (default $PDKV_AUTH_KEYS); needed "
                        "against a router started with --auth-keys")
    p.add_argument("--identity", metavar="NAME", default="probe",
                   help="identity to ask as (default probe: it may only read the "
                        "router's status; pdkv keys export DIR OUT --for probe)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        keys = Keys(args.auth_keys) if args.auth_keys else None
        client = Client(args.router, name=f"probe-{os.getpid()}", keys=keys,
                        identity=args.identity)
    except KeysError as exc:
        print(f"pdkv probe: {exc}", file=sys.stderr)
        return REFUSED
    try:
        report = client.status(timeout_s=args.timeout)
    except PermissionError as exc:
        print(f"pdkv probe: the router at {args.router} refused identity "
              f"{args.identity!r}: {exc}", file=sys.stderr)
        return REFUSED
    except TimeoutError:
        return _silent(args, keys)
    finally:
        client.close()
    return _report(args.worker, report.workers)


def _silent(args: argparse.Namespace, keys: Keys | None) -> int:
    """The router said nothing: refused at the handshake, or not there at all."""
    outcome, why = handshake_check(control_client(keys, args.identity), args.router,
                                   min(args.timeout, 3.0))
    if outcome == "refused":
        print(f"pdkv probe: refused: {why}", file=sys.stderr)
        return REFUSED
    print(f"pdkv probe: the router at {args.router} did not answer within "
          f"{args.timeout:g} s ({why})", file=sys.stderr)
    return NO_ANSWER


def _report(name: str, workers: dict) -> int:
    worker = workers.get(name)
    if worker is None:
        known = ", ".join(sorted(workers)) or "none"
        print(f"{name}: not registered with the router (registered: {known})")
        return NOT_READY
    state = "lost" if worker["lost"] else "ready" if worker["ready"] else "building"
    print(f"{name}: {state} ({worker['role']}, pid {worker['pid']})")
    return READY if state == "ready" else NOT_READY
