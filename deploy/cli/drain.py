"""``pdkv drain WORKER``: take one worker out of a deployment without losing a request.

The router routes nothing new to it; it finishes what it holds for ``drain_timeout_s``;
what is left then moves to other workers; then it shuts down cleanly (exit 0) and its
name is free for a new process (a rolling restart: drain, restart, wait until it is
ready, next). docs/operations.md, "Draining and rolling restarts".
"""

from __future__ import annotations

import argparse
import sys
import time

from deploy.launch.flags import add_auth_flags


def add_parser(sub) -> None:
    p = sub.add_parser(
        "drain", help="stop routing to a worker; it ends its work, then exits",
        description="Ask the router to drain WORKER: no new requests go to it, it finishes "
                    "what it holds (what is left after the config's drain_timeout_s moves "
                    "to other workers of its role, the client's stream going on), then it "
                    "shuts down cleanly. SIGTERM to the worker's process does the same. "
                    "Waits until the worker left (--wait).",
        epilog="exit status: 0 drained (or, with --wait 0, draining); 1 still draining "
               "after --wait; 2 no live worker of that name, or the router refused (an "
               "operator identity is needed with keys)")
    p.add_argument("worker", help="the worker's name (pdkv top or status lists them)")
    p.add_argument("--router", required=True, metavar="ADDR",
                   help="the router's address, e.g. tcp://router-host:5555")
    p.add_argument("--wait", type=float, default=120.0, metavar="S",
                   help="seconds to wait for the worker to leave (default 120; 0: ask and "
                        "return)")
    add_auth_flags(p, "operator", "the deployment's key directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from common.auth import Keys
    from deploy.router.client import Client

    keys = Keys(args.auth_keys) if args.auth_keys else None
    client = Client(args.router, "pdkv-drain", keys, args.identity)
    try:
        refused = _ask(client, args.worker)
        if refused:
            print(f"pdkv drain: {refused}", file=sys.stderr)
            return 2
        print(f"{args.worker}: draining", flush=True)
        return _wait(client, args.worker, args.wait)
    finally:
        client.close()


def _ask(client, name: str, timeout_s: float = 10.0) -> str:
    """Send ``Drain``; '' once the router took it, else why not."""
    from common.control import Drain, Error, StatusReport

    client.send(Drain(name, nonce=1))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for msg in client.poll(0.2):
            if isinstance(msg, StatusReport) and msg.nonce == 1:
                return ""
            if isinstance(msg, Error):
                return f"the router refused: {msg.error}"
    return f"the router at {client.address} did not answer within {timeout_s:g} s"


def _wait(client, name: str, wait_s: float) -> int:
    """Until the router no longer counts ``name`` (0), or ``wait_s`` passed (1)."""
    deadline = time.monotonic() + wait_s
    while wait_s > 0 and time.monotonic() < deadline:
        w = client.status(10.0).workers.get(name)
        if w is None or w["lost"]:
            print(f"{name}: drained; it shut down", flush=True)
            return 0
        time.sleep(0.2)
    if wait_s <= 0:
        return 0
    print(f"pdkv drain: {name} still holds requests after {wait_s:g} s", file=sys.stderr)
    return 1
