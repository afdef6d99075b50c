"""The house rules, read from every module's imports (docs/architecture.md, "Layers").

    deploy/          -> anything below (benchmarks only lazily, inside a function)
    prefill_node/    decode_node/   -> transport/, common/ (never deploy/ or each other)
    transport/       -> common/
    common/          -> nothing above it; outside common, only a wing's face is imported
    benchmarks/      -> anything
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "transport", "prefill_node", "decode_node", "deploy", "benchmarks")
MAY_IMPORT = {
    "common": {"common"},
    "transport": {"common", "transport"},
    "prefill_node": {"common", "transport", "prefill_node"},
    "decode_node": {"common", "transport", "decode_node"},
    "deploy": {"common", "transport", "prefill_node", "decode_node", "deploy"},
    "benchmarks": set(PACKAGES),
}
WINGS = {"kv", "freelog", "model", "host", "node", "metrics", "parallel"}


def _imports(path: Path):
    """(line, imported module, at module level) of every project import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES:
                yield node.lineno, name, id(node) in top_level


def _modules():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def _violations(path: Path, root: Path = ROOT) -> list[str]:
    rel = path.relative_to(root)
    pkg = rel.parts[0]
    out = []
    for line, name, top in _imports(path):
        target = name.split(".")
        where = f"{rel}:{line}: imports {name}"
        lazy_bench = pkg == "deploy" and target[0] == "benchmarks" and not top
        if target[0] not in MAY_IMPORT[pkg] and not lazy_bench:
            out.append(f"{where} ({pkg}/ may import only {sorted(MAY_IMPORT[pkg])})")
        if pkg == "deploy" and target[0] == "benchmarks" and top:
            out.append(f"{where} (deploy/ reaches benchmarks/ only lazily, in a function)")
        past_face = target[0] == "common" and len(target) > 2 and target[1] in WINGS
        inside_wing = rel.parts[0] == "common" and rel.parts[1] == target[1]
        if past_face and not inside_wing:
            out.append(f"{where} (import from the face common.{target[1]} instead)")
    return out


def test_every_import_follows_the_layers():
    bad = [v for path in _modules() for v in _violations(path)]
    assert not bad, "layering violations:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, expected", [
    ("from deploy.router import serve_router\n", "prefill_node/ may import only"),
    ("from decode_node.batch import DecodeBatch\n", "prefill_node/ may import only"),
    ("from common.kv.cache import KvCache\n", "import from the face common.kv"),
])
def test_the_checker_catches_an_upward_or_past_the_face_import(tmp_path, source, expected):
    (tmp_path / "prefill_node").mkdir()
    bad = tmp_path / "prefill_node" / "bad.py"
    bad.write_text(source)
    found = _violations(bad, root=tmp_path)
    assert found and expected in found[0], found


def test_the_router_and_the_command_line_start_without_torch():
    """Importing torch costs 1.5-2 s of CPU; the router, ``pdkv run``'s launcher, ``pdkv
    keys`` and ``pdkv replay`` use none of it, so the faces read their torch-bound modules
    on first use (common/lazy.py). A module-level torch import below any of these breaks
    it."""
    code = ("import argparse, sys, deploy.router, deploy.cli, deploy.processes, deploy.run, "
            "common.freelog.cli, common.node.keys; from deploy.config_args import "
            "config_from_args; config_from_args(argparse.Namespace(config_json='{}')); "
            "deploy.run.check_devices(['cpu']); "
            "sys.exit(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:1] or None)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, f"torch was imported: {done.stderr.strip()}"
