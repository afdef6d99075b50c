"""``pdkv bench``: the benchmarks registered in the ``pdkv.bench`` entry-point group.

Each benchmark module declares its own subcommand (``add_command``) and registers it in
pyproject.toml, so nothing here names or imports a benchmark. Only the benchmark that runs
is loaded (importing one can cost torch); ``pdkv bench --help`` loads them all to list them.
"""

from __future__ import annotations

import argparse
from importlib.metadata import EntryPoint, entry_points

GROUP = "pdkv.bench"


def registered() -> dict[str, EntryPoint]:
    """Every registered benchmark by name."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def add_bench(sub: argparse._SubParsersAction, argv: list[str] | None) -> None:
    """``pdkv bench`` with the subcommand of the benchmark ``argv`` names, or of every
    registered one when it names none."""
    p = sub.add_parser("bench", help="performance measurements against baselines",
                       description="Each benchmark compares pdkv against a baseline measured "
                                   "in the same run, prints the ratio and exits 1 when a goal "
                                   "it printed was missed (docs/benchmarks.md).")
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    found = registered()
    if not found:
        p.epilog = (f"no benchmark is registered: the {GROUP!r} entry points come with the "
                    "installed package (pip install -e .)")
    wanted = _named(argv, found)
    for name in sorted(found) if wanted is None else [wanted] if wanted else []:
        found[name].load()(bench)


def _named(argv: list[str] | None, found: dict[str, EntryPoint]) -> str | None:
    """The benchmark ``pdkv bench NAME ...`` names (None: all are needed, or none)."""
    if not argv or argv[0] != "bench":
        return None if argv is None else ""
    name = next((a for a in argv[1:] if not a.startswith("-")), None)
    return name if name in found else None
