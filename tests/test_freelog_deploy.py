"""A worker whose free log fills up, in a real deployment (router + two colocated workers).

The fault is real: ``RLIMIT_FSIZE`` set on the running worker (``prlimit``), so its free
log's next write past the limit gets a short write and EFBIG. The worker must stop
admitting new requests and say why, the router must route around it, every request must
still be served, and the deployment must report the log, never call it clean.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.config import ServeConfig
from common.freelog import replay_file
from deploy.launch.launcher import Cluster
from deploy.loadgen.driver import drive
from deploy.loadgen.workload import WorkloadSpec, make_workload
from deploy.router.routes import label_of

REPO = Path(__file__).resolve().parents[1]
ROOM = 1024  # bytes the largest of a worker's files may still grow by (a few requests)

pytestmark = pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs prlimit")


def limit_files(pid: int, log_dir: Path, name: str, room: int = ROOM) -> int:
    """Cap the files of worker ``pid`` at ``room`` bytes past the largest of them now."""
    limit = max(p.stat().st_size for p in log_dir.glob(f"{name}*")) + room
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    return limit


def unlimit(pid: int) -> None:
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)


def wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def worker_pid(log_dir: Path, name: str) -> int | None:
    """The pid of the worker process ``name`` logging to ``log_dir`` (from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--name" in argv and name.encode() in argv and str(log_dir).encode() in argv:
            return int(entry.name)
    return None


def test_pdkv_run_reports_a_worker_whose_free_log_filled(tmp_path):
    log_dir, output = tmp_path / "logs", tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "run", "--mode", "colocated", "--decode", "2",
         "--requests", "24", "--rate", "3", "--prompt-len", "16", "64", "--output-len", "8",
         "16", "--no-offload", "--log-dir", str(log_dir), "--output", str(output),
         "--json"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid = wait_for(lambda: (log_dir / "colocated0.freelog").exists()
                       and worker_pid(log_dir, "colocated0"), 180, "colocated0 to start")
        limit_files(pid, log_dir, "colocated0")
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, out + err  # every request served, one log incomplete
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["ok"] == summary["requests"] == 24, summary
    assert summary["freelog_incomplete"] == ["colocated0.freelog"], summary
    assert "EFBIG" in summary["freelog_problems"]["colocated0"]
    assert "free logs incomplete" in err
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(results) == 24 and all(r["reason"] in ("stop", "length") for r in results)
    router_log = (log_dir / "router.log").read_text()
    assert "colocated0 admits no new requests" in router_log and "EFBIG" in router_log
    assert replay_file(log_dir / "colocated1.freelog").ok
    # what colocated0 wrote is whole records: no torn record, no violation, not clean
    partial = replay_file(log_dir / "colocated0.freelog")
    assert partial.num_violations == 0 and not partial.closed, partial.format()


def test_a_paused_worker_admits_again_when_space_returns(tmp_path):
    cfg = ServeConfig(offload=False, spec_k=0, decode_pages=512, heartbeat_s=0.5)
    log_dir = tmp_path / "logs"
    vocab = cfg.model_config().vocab_size
    with Cluster(cfg, "colocated", 0, 2, log_dir=str(log_dir)) as cluster:
        pid = cluster.client.status(5.0).workers["colocated0"]["pid"]
        limit = limit_files(int(pid), log_dir, "colocated0", room=512)

        def paused() -> str:
            return cluster.client.status(5.0).workers["colocated0"]["paused"]

        spec = WorkloadSpec(requests=24, seed=1, rate=0.0, prompt_len=(32, 64),
                            output_len=(16, 24))
        first = drive(cluster.client, make_workload(spec, vocab), check=cluster.check)
        assert all(r.ok for r in first.values())
        why = wait_for(paused, 60, "colocated0 to pause")
        assert "EFBIG" in why and "colocated0.freelog" in why
        during = make_workload(WorkloadSpec(requests=6, seed=2, rate=0.0), vocab)
        assert all(r.ok for r in drive(cluster.client, during, check=cluster.check).values())
        unlimit(int(pid))
        wait_for(lambda: not paused(), 60, "colocated0 to admit again")
        after = make_workload(WorkloadSpec(requests=6, seed=3, rate=0.0), vocab)
        assert all(r.ok for r in drive(cluster.client, after, check=cluster.check).values())
    for name in ("colocated0", "colocated1"):
        report = replay_file(log_dir / f"{name}.freelog")
        assert report.ok and report.closed, report.format()  # every event, exactly once
    labels = {label_of(owner) for owner in _owners(log_dir / "colocated0.freelog")}
    assert labels & set(first)  # it served before the pause: the check below can fail
    assert not labels & {r.rid for r in during}  # nothing new was admitted while paused
    assert os.path.getsize(log_dir / "colocated0.freelog") > limit  # written past it later


def _owners(path: Path) -> set[str]:
    """Owners of the log's allocations: the router's request ids (``label#run-n``)."""
    from common.freelog import FreeLogReader

    with FreeLogReader(path) as reader:
        return {ev["owner"] for ev in reader.records if ev.get("op") == "alloc"}
