"""The house rules, read from every module's imports (docs/architecture.md, "Floors").

1. Floors: a module imports only from its own unit or from units on lower floors; two
   units on one floor never import each other (prefill_node and decode_node).
2. Faces: outside a wing of ``common`` a module imports only the wing's face
   (``from common.kv import KvCache``, never ``common.kv.cache``).
3. No circles: no module reaches itself through imports, lazy ones (inside a function or
   under ``TYPE_CHECKING``) included.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "transport", "prefill_node", "decode_node", "deploy", "benchmarks")

FLOORS: list[set[str]] = [  # bottom first
    {"common.lazy", "common.trace", "common.parallel"},
    {"common.freelog"},
    {"common.kv"},
    {"common.host"},
    {"common.request"},
    {"common.model"},
    {"common.config"},
    {"common", "common.metrics"},
    {"common.auth"},
    {"common.kv_events"},
    {"common.control"},
    {"transport"},
    {"common.node"},
    {"prefill_node", "decode_node"},
    {"deploy.router"},
    {"deploy.http"},
    {"deploy.loadgen"},
    {"deploy.launch"},
    {"benchmarks"},
    {"deploy.cli"},
    {"deploy"},
]
FLOOR_OF = {unit: n for n, units in enumerate(FLOORS) for unit in units}
WINGS = ("common.node.tp", "common.kv", "common.freelog", "common.model", "common.host",
         "common.node", "common.metrics", "common.parallel", "common.auth", "common.control",
         "common.kv_events")


def unit_of(module: str) -> str:
    """The floor unit a module belongs to: the longest unit name that prefixes it."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in FLOOR_OF:
            return ".".join(parts[:n])
    raise AssertionError(f"{module} is on no floor: add its package to FLOORS")


def wing_of(module: str) -> str | None:
    return next((w for w in WINGS if module == w or module.startswith(w + ".")), None)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _face_names(face: Path) -> set[str]:
    """What a package's face exports (its ``__all__``)."""
    for node in ast.parse(face.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__":
            return set(ast.literal_eval(node.value))
    return set()


def _imports(path: Path, known: dict[str, Path]):
    """(line, imported module) of every project import in ``path``; ``from a import b``
    names the module ``a.b`` where that is a module that the face ``a`` does not export
    under the name ``b``."""
    tree = ast.parse(path.read_text(), str(path))

    def module(parent: str, name: str) -> str:
        sub = f"{parent}.{name}"
        face = known.get(parent)
        exported = face is not None and face.name == "__init__.py" and name in _face_names(face)
        return sub if sub in known and not exported else parent

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [module(node.module, a.name) for a in node.names]
        else:
            continue
        for name in dict.fromkeys(names):
            if name.split(".")[0] in PACKAGES:
                yield node.lineno, name


def _modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for pkg in PACKAGES if (root / pkg).exists()
            for p in sorted((root / pkg).rglob("*.py"))}


def _violations(path: Path, root: Path = ROOT, known: dict[str, Path] | None = None
                ) -> list[str]:
    me = module_name(path, root)
    mine, my_wing = unit_of(me), wing_of(me)
    out = []
    for line, name in _imports(path, _modules(root) if known is None else known):
        where = f"{path.relative_to(root)}:{line}: imports {name}"
        theirs = unit_of(name)
        if theirs != mine and FLOOR_OF[theirs] >= FLOOR_OF[mine]:
            how = "a unit on its own floor" if FLOOR_OF[theirs] == FLOOR_OF[mine] else "upward"
            out.append(f"{where} ({how}: {mine} may import only floors below it)")
        wing = wing_of(name)
        if wing and name != wing and wing != my_wing and not (my_wing or "").startswith(
                wing + ".") and name.count(".") > wing.count("."):
            out.append(f"{where} (import from the face {wing} instead)")
    return out


def circles(root: Path = ROOT) -> list[list[str]]:
    """Every import circle among the modules under ``root``, each as its module files."""
    mods = _modules(root)
    graph = {m: {n for _, n in _imports(p, mods) if n in mods and n != m}
             for m, p in mods.items()}
    found, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(m: str) -> None:  # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in graph[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                on_stack.discard(n)
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                found.append(sorted(str(mods[n].relative_to(root)) for n in component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for m in sorted(graph):
        if m not in index:
            visit(m)
    return found


def test_every_import_follows_the_floors_and_faces():
    bad = [v for path in _modules().values() for v in _violations(path)]
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_no_import_circles():
    found = circles()
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_every_package_says_its_job():
    """Each package's face opens with a docstring: what it is for, in a sentence."""
    silent = [str(p.relative_to(ROOT)) for p in _modules().values()
              if p.name == "__init__.py" and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not silent, f"packages without a docstring: {silent}"


@pytest.mark.parametrize("where, source, expected", [
    ("prefill_node/bad.py", "from deploy.router.router import serve_router\n", "upward"),
    ("prefill_node/bad.py", "from decode_node.batch import DecodeBatch\n", "its own floor"),
    ("prefill_node/bad.py", "from common.kv.cache import KvCache\n", "the face common.kv"),
    ("transport/bad.py", "from common.node import WorkerBase\n", "upward"),
    ("benchmarks/bad.py", "from deploy.cli import main\n", "upward"),
])
def test_the_checker_catches_an_upward_or_past_the_face_import(tmp_path, where, source,
                                                               expected):
    bad = tmp_path / where
    bad.parent.mkdir(parents=True)
    bad.write_text(source)
    found = _violations(bad, root=tmp_path, known={})
    assert found and expected in found[0], found


def test_the_checker_finds_a_circle_and_names_its_files(tmp_path):
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "a.py").write_text("import deploy.b\n")
    (tmp_path / "deploy" / "b.py").write_text("def f():\n    from deploy.c import x\n")
    (tmp_path / "deploy" / "c.py").write_text("from deploy.a import y\n")
    assert circles(tmp_path) == [["deploy/a.py", "deploy/b.py", "deploy/c.py"]]


def test_the_router_and_the_command_line_start_without_torch():
    """Importing torch costs 1.5-2 s of CPU; the router, ``pdkv run``'s launcher, ``pdkv
    keys`` and ``pdkv replay`` use none of it, so the faces read their torch-bound modules
    on first use (common/lazy.py). A module-level torch import below any of these breaks
    it."""
    code = ("import argparse, sys, deploy.router.router, deploy.cli.main, "
            "deploy.launch.processes, deploy.launch.run, common.freelog.cli, "
            "common.auth.keys; from deploy.launch.config_args import config_from_args; "
            "config_from_args(argparse.Namespace(config_json='{}')); "
            "deploy.launch.run.check_devices(['cpu']); "
            "sys.exit(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:1] or None)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, f"torch was imported: {done.stderr.strip()}"
