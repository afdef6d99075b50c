"""The stops one HTTP completion passes in ``pdkv serve``'s process, counted, not timed.

``pdkv serve`` (1P1D, the tiny model at float64, the router in the front door's loop)
runs as a child of this script with a profile hook (``sys.setprofile`` in every thread)
that records, while a window is open, each project function called (file and qualified
name; the tree's own files, not installed libraries) and each control message the
process encodes or decodes (its type and request id). The parent opens a window
(SIGUSR1), sends one non-streamed ``/v1/completions`` request, and closes it (SIGUSR2)
once the answer came; then it opens a window of the same length with no request (the
router's timed work, status polls...). It does this ``--runs`` times (default 7) per
prompt kind (token ids, text) after a warm-up.

Reported per prompt kind:

- stops: the functions every request window passed, less the periodic background (those
  seen in every idle window: the router's timed work), and the files they live in;
- crossings: control frames of this request (its id in ``rid``) in and out of the
  process, by message type, plus the HTTP request and its response. The KV plane
  between prefill and decode is not in this process and not counted.

It counts and times nothing, so a busy machine changes nothing (the counts came out the
same on every run). The same script measures any checkout: ``--tree DIR`` runs the child
against that tree's code (its ``PYTHONPATH``), so ``--tree /path/to/main --tree .`` gives
before and after in one run. A measurement, not a goal: the exit status is 0 unless a
deployment failed.

    python benchmarks/edge_stops.py --tree /work/main --tree . --json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import runpy
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

_URL = re.compile(r"(http://[0-9.]+:[0-9]+)/v1")
PROMPTS = {
    "ids": [17, 250, 33, 401, 5, 76, 190, 288, 12, 99, 305, 61, 140, 222, 7, 350, 45, 480],
    "text": "The quick brown fox jumps over the lazy dog, and then it rests.",
}
CONFIG = {"dtype": "float64", "page_size": 4, "prefill_pages": 96, "decode_pages": 160,
          "chunk_size": 24, "max_prefill_tokens": 48, "heartbeat_s": 5.0, "lease_s": 30.0}
"""The tests' deployment, with a slow heartbeat: fewer background messages in a window."""


# -- the child: pdkv serve with the hook ------------------------------------------------------
class _Hook:
    """What the profile hook records while a window is open."""

    def __init__(self, root: str, out: Path) -> None:
        self.root, self.out = root, out
        self.on = False
        self.window = 0
        self.calls: set[tuple[str, str]] = set()
        self.frames: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()

    def profile(self, frame, event, arg) -> None:
        if not self.on:
            return
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(self.root) and \
                "site-packages" not in code.co_filename:
            rel = code.co_filename[len(self.root):].lstrip("/")
            self.calls.add((rel, code.co_qualname))
            if code.co_name == "encode" and rel.endswith("control/codec.py"):
                self._frame("out", frame.f_locals.get("msg"))
        elif event == "return" and code.co_name == "decode" and \
                code.co_filename.endswith("control/codec.py"):
            self._frame("in", arg)

    def _frame(self, way: str, msg) -> None:
        if msg is not None:
            with self.lock:
                self.frames.append((way, type(msg).__name__, str(getattr(msg, "rid", ""))))

    def start(self, *_) -> None:
        self.calls, self.frames, self.on = set(), [], True

    def stop(self, *_) -> None:
        self.on = False
        self.window += 1
        data = {"calls": sorted(self.calls), "frames": self.frames}
        path = self.out / f"window-{self.window}.json"
        path.with_suffix(".tmp").write_text(json.dumps(data))
        path.with_suffix(".tmp").rename(path)


def child(argv: list[str]) -> int:
    """``python -m deploy.cli ARGV`` (``pdkv serve``) in this process, hooked: run as a
    module, as the command line runs it (a benchmark imports nothing of the CLI)."""
    spec = importlib.util.find_spec("deploy")
    root = str(Path(spec.origin).resolve().parent.parent)
    hook = _Hook(root, Path(os.environ["EDGE_STOPS_OUT"]))
    signal.signal(signal.SIGUSR1, hook.start)
    signal.signal(signal.SIGUSR2, hook.stop)
    threading.setprofile(hook.profile)
    sys.setprofile(hook.profile)
    sys.argv = ["pdkv", *argv]
    try:
        runpy.run_module("deploy.cli", run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


# -- the parent --------------------------------------------------------------------------------
class _Serve:
    """``pdkv serve`` of one tree as this script's child."""

    def __init__(self, tree: Path, tmp: Path) -> None:
        self.tmp, self.out = tmp, tmp / "windows"
        self.out.mkdir()
        cfg = tmp / "serve.json"
        cfg.write_text(json.dumps(CONFIG))
        env = {**os.environ, "PYTHONPATH": str(tree), "EDGE_STOPS_OUT": str(self.out),
               "PYTHONUNBUFFERED": "1"}
        with open(tmp / "serve.log", "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--child", "serve",
                 "--config", str(cfg), "--port", "0", "--log-dir", str(tmp)],
                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env)
        self.url = self._wait_url(180.0)
        self.windows = 0

    def _wait_url(self, timeout_s: float) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if sel.select(0.2) and (m := _URL.search(self.proc.stdout.readline().decode())):
                return m.group(1)
        self.stop()
        raise RuntimeError(f"pdkv serve did not start; log {self.tmp / 'serve.log'}")

    def window(self, work) -> tuple[dict, float, object]:
        """Open a window, run ``work()``, close it: (what it recorded, seconds, result)."""
        self.proc.send_signal(signal.SIGUSR1)
        time.sleep(0.05)   # the handler runs in the serve loop's thread
        t0 = time.monotonic()
        result = work()
        took = time.monotonic() - t0
        self.proc.send_signal(signal.SIGUSR2)
        self.windows += 1
        path = self.out / f"window-{self.windows}.json"
        deadline = time.monotonic() + 30
        while not path.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"window {self.windows} was never written")
            time.sleep(0.01)
        return json.loads(path.read_text()), took, result

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


def _complete(url: str, prompt) -> dict:
    import httpx

    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})
    r.raise_for_status()
    return r.json()


def measure(serve: _Serve, kind: str, runs: int) -> dict:
    prompt = PROMPTS[kind]
    for _ in range(3):
        _complete(serve.url, prompt)   # warm: imports, the tokenizer, first-time paths
    request_sets, idle_counts, crossings = [], Counter(), []
    for _ in range(runs):
        rec, took, body = serve.window(lambda: _complete(serve.url, prompt))
        request_sets.append({tuple(c) for c in rec["calls"]})
        mine = Counter(f"{way} {t}" for way, t, rid in rec["frames"]
                       if rid.startswith(body["id"]))
        crossings.append(mine)
        idle, _, _ = serve.window(lambda took=took: time.sleep(took))
        idle_counts.update({tuple(c) for c in idle["calls"]})
    every = set.intersection(*request_sets)
    background = {c for c, n in idle_counts.items() if n == runs}
    stops = sorted(every - background)
    frames = crossings[0]
    return {
        "functions": len(stops), "files": len({f for f, _ in stops}),
        "background_removed": sorted(f"{f}:{q}" for f, q in every & background),
        "crossings": sum(frames.values()) + 2, "control_frames": dict(sorted(frames.items())),
        "message_types": len({k.split()[1] for k in frames}),
        "frames_same_every_run": all(c == frames for c in crossings),
        "stops": [f"{f}:{q}" for f, q in stops]}


def run_tree(tree: Path, runs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="pdkv-edge-stops-") as tmp:
        serve = _Serve(tree, Path(tmp))
        try:
            return {kind: measure(serve, kind, runs) for kind in PROMPTS}
        finally:
            serve.stop()


def _print(tree: str, result: dict) -> None:
    for kind, r in result.items():
        frames = ", ".join(f"{k} x{n}" for k, n in r["control_frames"].items())
        print(f"{tree} [{kind} prompt]: {r['functions']} functions in {r['files']} files; "
              f"{r['crossings']} process crossings (HTTP in and out; control frames: "
              f"{frames}); {r['message_types']} message types")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", type=Path,
                   help="a checkout to measure (repeat for several; default: this one)")
    p.add_argument("--runs", type=int, default=7, help="requests per prompt kind (default 7)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--list", action="store_true", help="print every stop too")
    args = p.parse_args(argv)
    trees = args.tree or [Path(__file__).resolve().parent.parent]
    out = {str(t): run_tree(t.resolve(), args.runs) for t in trees}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for tree, result in out.items():
        _print(tree, result)
        if args.list:
            for kind, r in result.items():
                print(f"  {kind}: " + "\n    ".join(r["stops"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
