"""Body of ``pdkv top``: pick the source (router or URL) and draw until Ctrl-C."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from common.metrics import from_wire, loads


def main(args: argparse.Namespace) -> int:
    try:
        from deploy.cli.top_view import Scrape, http_source, run
    except ImportError as exc:
        print(f"pdkv top needs rich ({exc}): pip install 'pdkv[top]'", file=sys.stderr)
        return 2
    if args.interval <= 0 or args.timeout <= 0:
        print("pdkv top: --interval and --timeout must be > 0", file=sys.stderr)
        return 2
    if args.url:
        return run(http_source(args.url, args.timeout), args.url, args.interval, args.once)
    from common.auth import Keys, KeysError
    from deploy.router.client import Client

    try:
        keys = Keys(args.auth_keys) if args.auth_keys else None
    except KeysError as exc:
        print(f"pdkv top: {exc}", file=sys.stderr)
        return 2
    client = Client(args.router, "pdkv-top", keys, args.identity)
    try:
        return run(_router_source(client, args.timeout, Scrape), f"router {args.router}",
                   args.interval, args.once)
    except TimeoutError as exc:  # only --once lets a failed read through
        print(f"pdkv top: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()


def _router_source(client, timeout_s: float, scrape_cls) -> Callable:
    def read():
        return scrape_cls.of(from_wire(loads(client.metrics(timeout_s))), time.monotonic())
    return read
