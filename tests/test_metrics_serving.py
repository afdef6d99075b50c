"""Metrics of a real deployment (router and workers as processes, real sockets, real HTTP
scrapes read with Prometheus' own parser):

- scraped over HTTP by several clients while it serves, every scrape answers, parses and
  never sees a counter go down; at the end (``metrics.prom``, the router's final view)
  every KV counter equals what replaying each worker's free logs counts, device pools and
  host tiers, and the serving counters equal what the client saw;
- a prefill whose /dev/shm is private (as in a container) cannot map the decode's pool
  and silently falls back to frames: the data-path gauge shows ipc for that pair and shm
  for a normal one, through the control plane, over HTTP and in ``pdkv top``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from common.config import ServeConfig
from common.metrics import METRICS, from_wire, loads, render
from deploy.launch.launcher import Cluster
from deploy.loadgen.driver import drive
from deploy.loadgen.workload import WorkloadSpec, make_workload
from deploy.router.client import Client
from tests.metrics_helpers import assert_counters_match_log, by, freelog_counts, parse, scrape

pytestmark = pytest.mark.timeout(240)

CFG = ServeConfig(dtype="float64", page_size=4, prefill_pages=96, decode_pages=160,
                  chunk_size=24, max_prefill_tokens=48, heartbeat_s=0.2, lease_s=3.0)
SPEC = WorkloadSpec(requests=10, seed=5, rate=30.0, prompt_len=(8, 90), output_len=(4, 16))
# Families that only appear when something goes wrong.
ON_FAILURE_ONLY = {"pdkv_transfer_protocol_errors_total", "pdkv_migrations_total",
                   "pdkv_text_encode_failures_total"}   # (and this run sends no text)


class Scrapers:
    """Threads that scrape ``url`` until stopped; they record failures and any counter
    that went down between two scrapes of one thread."""

    def __init__(self, url: str, n: int = 3, max_scrapes: int = 400) -> None:
        self.url, self.errors, self.ok = url, [], 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(max_scrapes,))
                         for _ in range(n)]
        for t in self._threads:
            t.start()

    def _run(self, max_scrapes: int) -> None:
        last: dict = {}
        for _ in range(max_scrapes):
            if self._stop.is_set():
                return
            try:
                s = scrape(self.url)
                now = {**by(s, "pdkv_kv_freed_pages_total", ("worker", "tier", "reason")),
                       **by(s, "pdkv_requests_total", ("reason",))}
                down = {k: (last[k], v) for k, v in now.items() if v < last.get(k, 0)}
                assert not down, f"counters went down: {down}"
                last = now
                with self._lock:
                    self.ok += 1
            except Exception as exc:  # reported by the test thread
                with self._lock:
                    self.errors.append(repr(exc))
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)


def test_counters_scraped_while_serving_end_equal_to_the_free_logs(tmp_path):
    cluster = Cluster(CFG, "disagg", 1, 1, log_dir=str(tmp_path), metrics_port=0).start()
    assert cluster.metrics_url.startswith("http://127.0.0.1:")
    requests = make_workload(SPEC, CFG.model_config().vocab_size)
    scrapers = Scrapers(cluster.metrics_url)
    try:
        results = drive(cluster.client, requests, check=cluster.check, timeout_s=120)
    finally:
        scrapers.stop()   # before the shutdown: the router's endpoint goes with it
        cluster.stop()
    cluster.check_exit_codes()
    assert not scrapers.errors, scrapers.errors[:3]
    assert scrapers.ok >= 3
    assert {r.reason for r in results.values()} == {"length"}

    final = parse((tmp_path / "metrics.prom").read_text())
    logs = cluster.freelogs()
    assert len(logs) == 4, logs   # device pool and host tier of each worker
    for log in logs:
        worker, _, rest = log.name.partition(".")
        tier = "host" if rest == "host.freelog" else "device"
        assert_counters_match_log(final, freelog_counts(log), worker=worker, tier=tier)

    assert by(final, "pdkv_requests_total", ("reason",)) == {("length",): SPEC.requests}
    assert by(final, "pdkv_ttft_seconds_count", ()) == {(): SPEC.requests}
    assert by(final, "pdkv_generation_tokens_total", ("worker",)) == {
        ("decode0",): sum(len(r.output_ids) for r in results.values())}
    assert by(final, "pdkv_prompt_tokens_total", ("worker",)) == {
        ("prefill0",): sum(len(r.prompt) for r in requests)}
    page_bytes = CFG.model_config().kv_layout(with_draft=CFG.with_draft).page_bytes(4)
    # both sides of every completed transfer agree, per data path (here shm)
    keys = ("worker", "direction", "path")
    n_pages = sum(r.kv_bytes for r in results.values()) // page_bytes
    assert n_pages > 0
    assert by(final, "pdkv_transfer_pages_total", keys) == {
        ("prefill0", "sent", "shm"): n_pages, ("decode0", "received", "shm"): n_pages}
    assert by(final, "pdkv_transfer_completed_bytes_total", keys) == {
        ("prefill0", "sent", "shm"): n_pages * page_bytes,
        ("decode0", "received", "shm"): n_pages * page_bytes}
    timed = by(final, "pdkv_transfer_seconds_count", keys)
    assert set(timed) == {("prefill0", "sent", "shm"), ("decode0", "received", "shm")}
    assert len(set(timed.values())) == 1 and 0 < min(timed.values()) <= SPEC.requests
    sent = by(final, "pdkv_transfer_bytes_total", ("worker",))
    assert sent[("prefill0",)] == sent[("decode0",)] == n_pages * page_bytes
    assert by(final, "pdkv_transfer_data_path", ("worker", "peer", "path")) == {
        ("decode0", "prefill0", "shm"): 1, ("prefill0", "decode0", "shm"): 1}
    assert by(final, "pdkv_worker_up", ("worker",)) == {("decode0",): 1, ("prefill0",): 1}
    families = {s.removesuffix("_total").removesuffix("_count") for s in final}
    missing = [m.name for m in METRICS if m.name.removesuffix("_total") not in families
               and m.name not in ON_FAILURE_ONLY]
    assert not missing, f"metrics a served run never showed: {missing}"


def _per_path(samples, direction: str) -> dict[str, tuple[float, float, float]]:
    """path -> (pages, bytes, transfers) of completed transfers in ``direction``."""
    keys, out = ("path",), {}
    for path, in by(samples, "pdkv_transfer_pages_total", keys, direction=direction):
        out[path] = tuple(by(samples, name, keys, direction=direction)[(path,)] for name in (
            "pdkv_transfer_pages_total", "pdkv_transfer_completed_bytes_total",
            "pdkv_transfer_seconds_count"))
    return out


def _private_shm() -> list[str] | None:
    """A command prefix that runs a process with its own empty /dev/shm, or None."""
    if shutil.which("unshare") is None:
        return None
    wrap = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "-"]
    ok = subprocess.run([*wrap, "true"], capture_output=True, timeout=30).returncode == 0
    return wrap if ok else None


def test_a_peer_that_fell_back_from_shared_memory_shows_on_the_data_path_gauge(tmp_path):
    wrap = _private_shm()
    if wrap is None:
        pytest.skip("needs unshare -m (a mount namespace) to give a prefill its own /dev/shm")
    router = f"ipc://{tmp_path}/router.sock"
    cli = [sys.executable, "-m", "deploy.cli"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argvs = {"router": [*cli, "router", "--bind", router, "--metrics-port", "0",
                        "--config-json", _json(CFG)]}
    for name, role, prefix in (("decode0", "decode", []), ("prefill0", "prefill", []),
                               ("prefill1", "prefill", wrap)):
        argvs[name] = [*prefix, *cli, role, "--router", router, "--name", name]
        if role == "prefill":
            argvs[name] += ["--kv-bind", f"ipc://{tmp_path}/{name}.sock"]
    procs = {}
    client = None
    try:
        for name, argv in argvs.items():
            with open(tmp_path / f"{name}.log", "wb") as log:
                procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, env=env)
        client = Client(router, "test")
        status = _wait_ready(client, {"decode0", "prefill0", "prefill1"}, procs)
        _serve_at_once(client, 6)   # six at once: the router spreads them on both prefills
        want = {("decode0", "prefill0", "shm"): 1, ("decode0", "prefill1", "ipc"): 1,
                ("prefill0", "decode0", "shm"): 1, ("prefill1", "decode0", "ipc"): 1}
        deadline = time.monotonic() + 10 * CFG.heartbeat_s + 5
        while True:  # each worker's series are as of its last report (every heartbeat_s)
            snap = parse(render(lambda: from_wire(loads(client.metrics(5.0))))[0].decode())
            paths = by(snap, "pdkv_transfer_data_path", ("worker", "peer", "path"))
            moved = {d: _per_path(snap, d) for d in ("sent", "received")}
            if paths == want and moved["sent"] == moved["received"] and sum(
                    by(snap, "pdkv_transfer_seconds_count", ("direction", "path"),
                       direction="sent").values()) == 6 or time.monotonic() > deadline:
                break
            time.sleep(CFG.heartbeat_s)
        assert paths == want
        # each data path's completed transfers: what the prefills sent, the decode received
        assert moved["sent"] == moved["received"], moved
        assert set(moved["sent"]) == {"shm", "ipc"} and all(
            pages > 0 for pages, _, _ in moved["sent"].values()), moved
        assert by(scrape(status.metrics_url), "pdkv_transfer_data_path",
                  ("worker", "peer", "path")) == paths
        top = subprocess.run([*cli, "top", "--router", router, "--once", "--interval", "0.3"],
                             capture_output=True, text=True, timeout=60, env=env)
        assert top.returncode == 0, top.stderr
        rows = {line.split()[0]: line.split() for line in top.stdout.splitlines() if line}
        assert "ipc" in rows["prefill1"] and "shm" in rows["prefill0"], top.stdout
        assert "ipc,shm" in rows["decode0"], top.stdout
        client.shutdown(30.0)
        for p in procs.values():
            p.wait(timeout=30)
        assert all(p.returncode == 0 for p in procs.values()), {
            n: p.returncode for n, p in procs.items()}
    finally:
        if client is not None:
            client.close()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def _json(cfg: ServeConfig) -> str:
    import json

    return json.dumps(cfg.to_dict())


def _wait_ready(client: Client, names: set[str], procs: dict):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        assert not dead, f"processes exited: {dead}"
        try:
            status = client.status(1.0)
        except TimeoutError:
            continue
        if names <= {n for n, w in status.workers.items() if w["ready"]}:
            return status
        time.sleep(0.1)
    raise TimeoutError(f"{names} not ready within 120 s")


def _serve_at_once(client: Client, n: int) -> None:
    from common.control import Done

    for i in range(n):
        client.submit(f"r{i}", list(range(1, 30 + i)), {"max_new_tokens": 4})
    done: dict[str, str] = {}
    deadline = time.monotonic() + 120
    while len(done) < n and time.monotonic() < deadline:
        for msg in client.poll(0.5):
            if isinstance(msg, Done):
                done[msg.rid] = msg.reason
    assert done == {f"r{i}": "length" for i in range(n)}, done

