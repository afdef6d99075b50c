"""Faults a deployment survives, with real processes: each story reproduces the fault,
then shows the deployment serving on with outputs identical to the reference and every
free log replaying clean (a killed process's log may end without a close; it must still
hold no violation).

float64 on CPU, short leases (heartbeat 0.2 s, lease 2 s) so the stories stay short.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from common.auth import Keys, control_client
from common.config import ServeConfig
from common.control import Error, Link, StatusReport
from common.freelog import replay_file
from common.model import Model, generate_greedy
from deploy.launch.launcher import Cluster
from deploy.loadgen.driver import drive, router_lost
from deploy.loadgen.workload import WorkloadSpec, WorkRequest, make_workload

pytestmark = pytest.mark.timeout(240)

CFG = ServeConfig(dtype="float64", page_size=4, prefill_pages=96, decode_pages=160,
                  chunk_size=24, max_prefill_tokens=48, heartbeat_s=0.2, lease_s=2.0,
                  rejoin_s=60.0, prefix_load_timeout_s=0.5, debug_integrity=True)
SPEC = WorkloadSpec(requests=6, seed=5, rate=40.0, prompt_len=(1, 60), output_len=(1, 10))


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    model = Model(CFG.model_config())
    return {r.rid: generate_greedy(model, [r.prompt], r.max_new_tokens, page_size=4)[0]
            for r in make_workload(SPEC, CFG.model_config().vocab_size)}


@pytest.fixture
def start(tmp_path):
    """Start a cluster; whatever the story's outcome, it is stopped at the end."""
    made: list[Cluster] = []

    def make(mode: str = "disagg", num_prefill: int = 1, num_decode: int = 1,
             cfg: ServeConfig = CFG) -> Cluster:
        made.append(Cluster(cfg, mode, num_prefill, num_decode, log_dir=str(tmp_path)))
        return made[-1].start()

    yield make
    for cluster in made:
        cluster.stop()


def _serve(cluster: Cluster, spec: WorkloadSpec = SPEC, **params) -> dict:
    reqs = make_workload(spec, CFG.model_config().vocab_size)
    results = drive(cluster.client, reqs, params=params, check=cluster.check, timeout_s=120,
                    lease_s=CFG.lease_s)
    assert all(r.ok for r in results.values()), {k: r.error for k, r in results.items()}
    return {rid: r.output_ids for rid, r in results.items()}


def _stop_and_replay(cluster: Cluster) -> None:
    cluster.stop()
    cluster.check_exit_codes()
    assert cluster.freelogs()
    for log in cluster.freelogs():
        report = replay_file(log)
        assert report.ok, report.format()


def _long(rid: str) -> WorkRequest:
    return WorkRequest(rid, [(7 * i) % 500 for i in range(200)], 400, 0.0)


def test_a_restarted_router_is_rejoined_and_clients_of_the_dead_one_hear_it(start, tmp_path,
                                                                           reference):
    cluster = start()
    router = next(p for p in cluster.procs if p.role == "router")
    killer = threading.Timer(0.5, router.popen.kill)
    killer.start()
    results = drive(cluster.client, [_long("a"), _long("b")], timeout_s=60,
                    lease_s=CFG.lease_s)
    killer.join()
    assert "silent for" in router_lost(results), results     # after the lease, no hang
    assert "error" in {r.reason for r in results.values()} <= {"error", "length"}
    cluster.restart("router")                               # same address
    cluster.wait_ready()                                     # the workers rejoined it
    for name in ("prefill0", "decode0"):
        assert "registered again with the router" in (tmp_path / f"{name}.log").read_text()
    assert _serve(cluster) == reference
    _stop_and_replay(cluster)


def test_pdkv_run_against_a_router_that_dies_fails_within_the_lease(start, tmp_path):
    cluster = start()
    router = next(p for p in cluster.procs if p.role == "router")
    run = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "run", "--router", cluster.router_addr,
         "--requests", "4", "--rate", "0", "--prompt-len", "200", "200", "--output-len",
         "400", "400", "--output", str(tmp_path / "out.jsonl"),
         "--auth-keys", str(cluster.keys_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while cluster.client.status(5).in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        router.popen.kill()
        _, err = run.communicate(timeout=30)
    finally:
        run.kill()
    assert run.returncode == 2, err
    assert "router lost" in err and cluster.router_addr in err
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    reasons = [x["reason"] for x in lines]     # what finished, and why the rest ended
    assert len(lines) == 4 and "error" in reasons and set(reasons) <= {"length", "error"}
    cluster.restart("router")
    cluster.wait_ready()
    _stop_and_replay(cluster)


def test_a_stopped_worker_rejoins_once_continued(start, tmp_path, reference):
    cluster = start()
    decode = next(p for p in cluster.procs if p.name == "decode0")
    os.kill(decode.popen.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while not cluster.client.status(5).workers["decode0"]["lost"]:
            assert time.monotonic() < deadline, "the router never noticed"
            time.sleep(0.1)
    finally:
        os.kill(decode.popen.pid, signal.SIGCONT)
    cluster.wait_ready()
    assert "registered again with the router" in (tmp_path / "decode0.log").read_text()
    assert _serve(cluster) == reference
    _stop_and_replay(cluster)


def test_both_workers_of_a_request_dying_fails_it_alone_and_restarts_serve(start, reference):
    cluster = start()
    client = cluster.client
    client.submit("doomed", _long("x").prompt, {"max_new_tokens": 400})
    first = None
    while first is None:
        first = next((m for m in client.poll(5) if getattr(m, "rid", "") == "doomed"),
                     None)
    for name in ("prefill0", "decode0"):
        proc = next(p for p in cluster.procs if p.name == name)
        proc.popen.kill()
        proc.popen.wait(10)
    done, deadline = None, time.monotonic() + 30
    while done is None and time.monotonic() < deadline:
        done = next((m for m in client.poll(0.5) if getattr(m, "reason", "") == "error"),
                    None)
    assert done is not None and "lost" in done.error
    assert isinstance(client.status(5), StatusReport)        # the router lives on
    for name in ("prefill0", "decode0"):
        cluster.restart(name)
    cluster.wait_ready()
    assert _serve(cluster) == reference
    _stop_and_replay(cluster)


def _poll_until(client, rid: str, seen: dict, timeout_s: float = 60.0):
    """Poll until ``rid`` is done; every message by rid lands in ``seen``."""
    deadline = time.monotonic() + timeout_s
    while not any(getattr(m, "reason", "") for m in seen.get(rid, [])):
        assert time.monotonic() < deadline, seen
        for m in client.poll(0.2):
            seen.setdefault(getattr(m, "rid", ""), []).append(m)
    return next(m for m in seen[rid] if getattr(m, "reason", ""))


def test_an_unresponsive_prefill_holds_up_only_its_own_requests(tmp_path):
    """The decode's handshake with a stopped prefill never stalls the decode (it once
    blocked its loop for the whole handshake): the other prefill's request is served
    meanwhile, and once the stopped one continues, its request is served too."""
    cfg = CFG.with_overrides(lease_s=30.0)   # the stop stays well inside every lease
    cluster = Cluster(cfg, "disagg", 2, 1, log_dir=str(tmp_path)).start()
    model = Model(cfg.model_config())
    prompts = {"first": [(3 * i) % 400 for i in range(40)],
               "second": [(5 * i + 1) % 400 for i in range(44)]}
    ref = {rid: generate_greedy(model, [p], 8, page_size=4)[0] for rid, p in prompts.items()}
    stopped = next(p for p in cluster.procs if p.name == "prefill1").popen
    seen: dict[str, list] = {}
    try:
        os.kill(stopped.pid, signal.SIGSTOP)   # before the decode ever connected to it
        try:
            for rid, prompt in prompts.items():   # ties go to prefill0, then prefill1
                cluster.client.submit(rid, prompt, {"max_new_tokens": 8})
            first = _poll_until(cluster.client, "first", seen)
            assert first.ok, first      # and nothing for the second yet but its admission
            assert [m for m in seen.get("second", []) if m.ids] == [], seen
        finally:
            os.kill(stopped.pid, signal.SIGCONT)
        second = _poll_until(cluster.client, "second", seen)
        assert second.ok, second
        tokens = {rid: [t for m in ms if hasattr(m, "ids") for t in m.ids]
                  for rid, ms in seen.items()}
        assert tokens == ref
        log = (tmp_path / "decode0.log").read_text()
        assert re.search(r"second#\S+ admitted \(44 prompt tokens, prefill prefill1\)", log)
        assert not any(w["lost"] for w in cluster.client.status(5).workers.values())
    finally:
        _stop_and_replay(cluster)


def test_broken_frames_and_huge_messages_never_stall_the_router(start, reference):
    cluster = start()
    # a peer of the deployment (a client key) that sends broken frames: without a key it
    # would not get past the CURVE handshake at all (tests/test_attacks.py)
    evil = Link(cluster.client.ctx, cluster.router_addr, "evil",
                control_client(Keys(cluster.keys_dir), "client"))
    try:
        evil.send_raw([b"two", b"frames"])
        evil.send_raw([b"\xc1 not msgpack"])
        answers = [evil.recv(10), evil.recv(10)]
        assert [a.code for a in answers if isinstance(a, Error)] == ["extra_frames",
                                                                    "malformed"]
        flood = threading.Thread(target=lambda: [evil.send_raw([b"\0" * (100 << 20)])
                                                 for _ in range(3)])
        flood.start()                                        # 3 x 100 MB while serving
        assert _serve(cluster) == reference
        flood.join()
        report = cluster.client.status(5)
        assert not any(w["lost"] for w in report.workers.values())
        assert report.errors["extra_frames"] == 1 and report.errors["malformed"] == 1
    finally:
        evil.close()
    _stop_and_replay(cluster)


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_a_seeded_workload_runs_again_against_a_live_deployment(start, reference, mode):
    # slow host-tier copies: the first run's rows still wait for them when the same
    # client rids come again (that reuse once reached open_row and stopped the decode)
    cfg = CFG.with_overrides(debug_copy_delay_s=0.05)   # (offload is on)
    cluster = start(mode, 0 if mode == "colocated" else 1, 1, cfg=cfg)
    assert _serve(cluster) == reference
    assert _serve(cluster) == reference                      # the same client rids again
    sampled = [_serve(cluster, temperature=0.8, seed=3) for _ in range(2)]
    assert sampled[0] == sampled[1] != reference             # seeded: a rerun samples alike
    _stop_and_replay(cluster)


def test_workers_that_build_longer_than_the_lease_are_not_lost(start, tmp_path, reference):
    # a build twice the lease (a large checkpoint loading) once had the router declare
    # the worker lost while it started: startup has its own deadline (ready_timeout_s)
    cluster = start(cfg=CFG.with_overrides(debug_build_delay_s=2 * CFG.lease_s))
    assert not any(w["lost"] for w in cluster.client.status(5).workers.values())
    assert _serve(cluster) == reference
    assert ") lost: " not in (tmp_path / "router.log").read_text()
    _stop_and_replay(cluster)


def test_a_worker_without_a_router_says_so_within_its_deadline(tmp_path):
    nowhere = f"ipc://{tmp_path}/nobody.sock"
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "decode", "--router", nowhere,
         "--connect-timeout", "2", "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert f"no router answered at {nowhere} within 2 s" in proc.stderr


def _queued_workload(n: int, seed: int) -> list[WorkRequest]:
    """``n`` prompts of 40-56 tokens, all at once: a prefill passing 48 tokens at a time
    works through them one pass each, the last ones long after the first."""
    return [WorkRequest(f"q{i}", [(seed * 7 + 13 * i + 3 * j) % 500 for j in range(40 + i % 17)],
                        4, 0.0) for i in range(n)]


def _serve_queued(cluster: Cluster, cfg: ServeConfig, reqs: list[WorkRequest]) -> None:
    model = Model(cfg.model_config())
    ref = {r.rid: generate_greedy(model, [r.prompt], r.max_new_tokens, page_size=4)[0]
           for r in reqs}
    # the client's own lease of the router is not under test: a loaded box may keep the
    # router from answering a ping within these stories' 1 s worker lease
    results = drive(cluster.client, reqs, check=cluster.check, timeout_s=180, lease_s=10.0)
    failed = {rid: r.error for rid, r in results.items() if not r.ok}
    assert failed == {}, f"{len(failed)}/{len(reqs)} requests failed: {failed}"
    assert {rid: r.output_ids for rid, r in results.items()} == ref


def test_requests_queued_behind_a_busy_prefill_outlive_the_kv_chunk_deadline(tmp_path):
    """Saturation in small (once 68 of 128 requests failed so): the decode registers all
    16 requests at once, the prefill (a target and a draft pass per step, each slowed
    0.1 s) starts the last ones 16 steps later, several times past a 1 s
    ``kv_chunk_timeout_s`` that is well above one step. That deadline measures a stalled
    transfer, not the prefill's queue: every request is served."""
    cfg = CFG.with_overrides(kv_chunk_timeout_s=1.0, debug_step_delay_s=0.1,
                             decode_pages=400, debug_integrity=False)
    cluster = Cluster(cfg, "disagg", 1, 1, log_dir=str(tmp_path)).start()
    try:
        _serve_queued(cluster, cfg, _queued_workload(16, seed=1))
        log = (tmp_path / "decode0.log").read_text() + (tmp_path / "prefill0.log").read_text()
        assert "failed (timeout)" not in log
    finally:
        _stop_and_replay(cluster)


def test_workers_busy_in_passes_longer_than_the_lease_are_not_lost(tmp_path):
    """Every forward pass takes 1.5x the lease (a trained model's prefill on a starved
    core): the workers' heartbeats go on from their pulse threads, so neither the router
    nor the KV peers declare a busy worker lost, and every request is served."""
    cfg = CFG.with_overrides(lease_s=1.0, debug_step_delay_s=1.5, decode_pages=400,
                             debug_integrity=False)
    cluster = Cluster(cfg, "disagg", 1, 1, log_dir=str(tmp_path)).start()
    try:
        _serve_queued(cluster, cfg, _queued_workload(4, seed=2))
        assert not any(w["lost"] for w in cluster.client.status(5).workers.values())
        for name in ("router", "prefill0", "decode0"):
            log = (tmp_path / f"{name}.log").read_text()
            assert " lost" not in log and "silent for" not in log, name
    finally:
        _stop_and_replay(cluster)
