"""Helpers of the HTTP front-door tests: ``pdkv frontend``/``pdkv serve`` as real processes
on loopback, Server-Sent Events, a process's children, free-log replay."""

from __future__ import annotations

import json
from pathlib import Path

from common.config import ServeConfig
from common.freelog import replay_file
from deploy.http.process import ServerProcess, frontend_process

# small pools, short leases, float64 so that outputs compare exactly
CFG = ServeConfig(dtype="float64", page_size=4, prefill_pages=96, decode_pages=160,
                  chunk_size=24, max_prefill_tokens=48, heartbeat_s=0.2, lease_s=3.0,
                  debug_integrity=True)
KEY = "sk-test-key"
GREEDY = {"temperature": 0, "ignore_eos": True}
"""Greedy, and past any end-of-sequence id: outputs compare with the reference."""


def start_frontend(router: str, log: Path, *args: str) -> tuple[ServerProcess, str]:
    """``pdkv frontend`` on a free loopback port: (process, url)."""
    proc = frontend_process(router, *args, log=log)
    return proc, proc.start(120.0)


def start_serve(tmp: Path, *args: str) -> tuple[ServerProcess, str]:
    """``pdkv serve`` with ``CFG`` and its logs in ``tmp``: (process, url)."""
    cfg = tmp / "serve.json"
    cfg.write_text(json.dumps(CFG.to_dict()))
    proc = ServerProcess(["serve", "--config", str(cfg), "--port", "0", "--log-dir", str(tmp),
                          *args], tmp / "serve.log")
    return proc, proc.start(120.0)


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
