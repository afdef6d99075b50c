"""Helpers of the HTTP front-door tests: start ``pdkv frontend``/``pdkv serve`` as real
processes on loopback, read Server-Sent Events, find a process's children."""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.config import ServeConfig
from common.freelog import replay_file

# small pools, short leases, float64 so that outputs compare exactly
CFG = ServeConfig(dtype="float64", page_size=4, prefill_pages=96, decode_pages=160,
                  chunk_size=24, max_prefill_tokens=48, heartbeat_s=0.2, lease_s=3.0,
                  debug_integrity=True)
KEY = "sk-test-key"
_URL = re.compile(r"(http://[0-9.]+:[0-9]+)/v1")


def _cli(*args: str, log: Path) -> subprocess.Popen:
    with open(log, "ab") as err:
        return subprocess.Popen([sys.executable, "-m", "deploy.cli", *args],
                                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_url(proc: subprocess.Popen, log: Path, timeout_s: float = 120.0) -> str:
    """The URL the process prints once it serves; fails with its log otherwise."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if sel.select(0.2):
            line = proc.stdout.readline().decode()
            if m := _URL.search(line):
                return m.group(1)
    stop(proc)
    raise AssertionError(f"no URL within {timeout_s}s (exit {proc.returncode}):\n"
                         f"{log.read_text()[-3000:]}")


def start_frontend(router: str, log: Path, *args: str) -> tuple[subprocess.Popen, str]:
    proc = _cli("frontend", "--router", router, "--port", "0", *args, log=log)
    return proc, wait_url(proc, log)


def start_serve(tmp: Path, *args: str) -> tuple[subprocess.Popen, str]:
    cfg = tmp / "serve.json"
    cfg.write_text(json.dumps(CFG.to_dict()))
    log = tmp / "serve.log"
    proc = _cli("serve", "--config", str(cfg), "--port", "0", "--log-dir", str(tmp), *args,
                log=log)
    return proc, wait_url(proc, log)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
    """Signal, wait, SIGKILL past the deadline; the exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode


def children_of(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - out
        out |= frontier
    return out


def sse_events(lines) -> list:
    """The ``data:`` payloads of an SSE body: dicts, and the string ``[DONE]``."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_logs_clean(log_dir: Path) -> dict[str, int]:
    """Replay every free log in ``log_dir``; returns pages freed per reason."""
    logs = sorted(log_dir.glob("*.freelog"))
    assert logs, f"no free logs in {log_dir}"
    reasons: dict[str, int] = {}
    for log in logs:
        report = replay_file(log)
        assert report.ok, report.format()
        assert report.closed, f"{log.name} has no close event"
        for pool in report.pools.values():
            for reason, v in pool["frees_by_reason"].items():
                reasons[reason] = reasons.get(reason, 0) + v["pages"]
    return reasons
