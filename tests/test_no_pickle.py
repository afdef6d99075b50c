"""Nothing pdkv serves with can unpickle: no pickle-family module, no pyzmq ``*_pyobj``,
no ``torch.load`` without ``weights_only=True``, no ``allow_pickle=True``, no msgpack hooks
that build objects. (That peers' pickles are refused at the door is in tests/test_attacks.py.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVING = ("common", "transport", "prefill_node", "decode_node", "deploy")
UNPICKLERS = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve",
              "joblib", "jsonpickle", "copyreg"}
PYOBJ = {"recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized"}
HOOKS = {"object_hook", "object_pairs_hook", "ext_hook", "list_hook"}
# the naive baseline that `pdkv bench transfer` beats: its own processes, loopback only
ALLOWED = {("benchmarks/transfer.py", "recv_pyobj"), ("benchmarks/transfer.py", "send_pyobj")}


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def findings(source: str, rel: str) -> list[str]:
    """Every way ``source`` could unpickle, as ``rel:line: what``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""]
            out += [f"{rel}:{node.lineno}: imports {n}" for n in names
                    if n.split(".")[0] in UNPICKLERS]
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        attr = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(
            func.value, ast.Name) else ""
        if attr in PYOBJ and (rel, attr) not in ALLOWED:
            out.append(f"{rel}:{node.lineno}: calls {attr} (pickle over ZMQ)")
        if attr == "load" and owner == "torch":
            weights = _keyword(node, "weights_only")
            if not (isinstance(weights, ast.Constant) and weights.value is True):
                out.append(f"{rel}:{node.lineno}: torch.load without weights_only=True")
        flag = _keyword(node, "allow_pickle")
        if isinstance(flag, ast.Constant) and flag.value is True:
            out.append(f"{rel}:{node.lineno}: allow_pickle=True")
        if attr in ("unpackb", "Unpacker", "loads") and any(k.arg in HOOKS
                                                             for k in node.keywords):
            out.append(f"{rel}:{node.lineno}: {attr} with an object-building hook")
    return out


def _sources():
    for pkg in (*SERVING, "benchmarks"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path, str(path.relative_to(ROOT))


def test_no_serving_module_can_unpickle():
    found = [f for path, rel in _sources() for f in findings(path.read_text(), rel)]
    assert not found, "ways to unpickle:\n" + "\n".join(found)


def test_the_only_pickles_are_the_transfer_benchmarks_own_baseline():
    used = {(rel, call) for path, rel in _sources() for call in PYOBJ
            if f".{call}(" in path.read_text()}
    assert used <= ALLOWED


@pytest.mark.parametrize("source, expected", [
    ("import pickle\n", "imports pickle"),
    ("from cloudpickle import loads\n", "imports cloudpickle"),
    ("x = sock.recv_pyobj()\n", "recv_pyobj"),
    ("m = torch.load(f)\n", "torch.load without weights_only"),
    ("m = torch.load(f, weights_only=False)\n", "torch.load without weights_only"),
    ("a = np.load(f, allow_pickle=True)\n", "allow_pickle"),
    ("d = msgpack.unpackb(b, ext_hook=h)\n", "object-building hook"),
])
def test_the_scanner_catches_each_way(source, expected):
    assert any(expected in f for f in findings(source, "deploy/x.py"))


def test_the_scanner_passes_safe_code():
    assert findings("m = torch.load(f, weights_only=True)\nmsgpack.unpackb(b, raw=False)\n",
                    "deploy/x.py") == []
