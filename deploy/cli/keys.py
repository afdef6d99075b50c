"""``pdkv keys``: create and distribute a deployment's CURVE keys (docs/security.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.auth import Keys, KeysError, add_key, create_keys, export_keys

_HOSTS = """\
Copy to each host only what it needs (pdkv keys export {dir} --for NAME OUT):
  router host   --for router     (with every public key: it admits exactly those)
  worker hosts  --for worker     (or one worker-HOST identity per host: pdkv keys add)
  clients       --for client     (operators: --for operator; only operators may shut down)
  readiness     --for probe      (pdkv probe: may only read the router's status)
Then start every process with --auth-keys DIR."""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "keys", help="create and distribute a deployment's authentication keys",
        description="Every pdkv socket authenticates its peers with ZMQ CURVE keys. A "
                    "deployment's keys live in one directory (0700, secrets 0600) with a "
                    "deployment id that every process checks. An identity's role is its "
                    "name up to the first '-': router, worker, client, operator or probe. "
                    "See docs/security.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=main)
    keys = p.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    c = keys.add_parser("create", help="a new key directory (router, worker, operator, "
                                       "probe, client identities and a fresh deployment "
                                       "id)")
    c.add_argument("dir", metavar="DIR", help="directory to create (must be new or empty)")
    c.add_argument("--client", action="append", metavar="NAME", dest="clients",
                   help="client identities to make instead of the one 'client' "
                        "(repeatable; e.g. client-frontend)")
    c.set_defaults(keys_func=_create)
    a = keys.add_parser("add", help="add one identity (e.g. worker-host3, client-alice)")
    a.add_argument("dir", metavar="DIR")
    a.add_argument("name", metavar="NAME", help="ROLE or ROLE-SUFFIX")
    a.set_defaults(keys_func=_add)
    e = keys.add_parser("export", help="copy what one host needs into a new directory")
    e.add_argument("dir", metavar="DIR")
    e.add_argument("out", metavar="OUT", help="new directory for that host")
    e.add_argument("--for", dest="names", action="append", required=True, metavar="NAME",
                   help="identity whose secret the host gets (repeatable)")
    e.set_defaults(keys_func=_export)
    s = keys.add_parser("show", help="deployment id, identities, secrets present here")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--json", action="store_true", help="one JSON object")
    s.set_defaults(keys_func=_show)


def main(args: argparse.Namespace) -> int:
    try:
        return args.keys_func(args)
    except (KeysError, ValueError, OSError) as exc:
        print(f"pdkv keys: {exc}", file=sys.stderr)
        return 2


def _create(args: argparse.Namespace) -> int:
    deployment = create_keys(args.dir, clients=args.clients)
    print(f"created {args.dir}: deployment {deployment}, identities "
          f"{', '.join(Keys(args.dir).names())}")
    print(_HOSTS.format(dir=args.dir))
    return 0


def _add(args: argparse.Namespace) -> int:
    pair = add_key(args.dir, args.name)
    print(f"added {pair.name} to {args.dir}; the router admits it after a restart")
    return 0


def _export(args: argparse.Namespace) -> int:
    export_keys(args.dir, args.names, args.out)
    print(f"exported {', '.join(args.names)} to {args.out}")
    return 0


def _show(args: argparse.Namespace) -> int:
    k = Keys(args.dir)
    here = {n: (Path(args.dir) / f"{n}.key_secret").exists() for n in k.names()}
    if args.json:
        print(json.dumps({"deployment_id": k.deployment_id, "identities": here}))
        return 0
    print(f"deployment {k.deployment_id}")
    for name, secret in here.items():
        print(f"  {name:<24} {'public + secret' if secret else 'public only'}")
    return 0
