"""End to end: router and workers as real processes over real ZMQ sockets.

Every story ends with a clean shutdown and every free log replaying clean. float64 on
CPU, so disaggregated outputs must equal colocated ones and the reference token by token.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from common.config import ServeConfig
from common.control import Error
from common.freelog import replay_file
from common.model import Model, generate_greedy
from deploy.launch.launcher import Cluster, WorkerDied
from deploy.launch.run import serve_workload
from deploy.loadgen.driver import drive
from deploy.loadgen.workload import WorkloadSpec, WorkRequest, make_workload

pytestmark = pytest.mark.timeout(180)

CFG = ServeConfig(dtype="float64", page_size=4, prefill_pages=96, decode_pages=160,
                  chunk_size=24, max_prefill_tokens=48, heartbeat_s=0.2, lease_s=3.0,
                  debug_integrity=True)
SPEC = WorkloadSpec(requests=8, seed=3, rate=40.0, prompt_len=(1, 90), output_len=(1, 12))


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of the workload, one request at a time in this process."""
    reqs = make_workload(SPEC, CFG.model_config().vocab_size)
    model = Model(CFG.model_config())
    return {r.rid: generate_greedy(model, [r.prompt], r.max_new_tokens, page_size=4)[0]
            for r in reqs}


def _assert_logs_clean(cluster: Cluster, expect: int) -> None:
    logs = cluster.freelogs()  # device pools and (offload on) host tiers
    assert len([p for p in logs if not p.name.endswith(".host.freelog")]) == expect, logs
    for log in logs:
        report = replay_file(log)
        assert report.ok, report.format()
        assert not report.warnings, report.warnings


@pytest.mark.parametrize("mode, num_prefill, num_decode", [
    ("colocated", 0, 1), ("disagg", 1, 1), ("disagg", 2, 1), ("disagg", 1, 2)])
def test_outputs_are_token_identical_to_the_reference(tmp_path, reference, mode,
                                                      num_prefill, num_decode):
    cluster = Cluster(CFG, mode, num_prefill, num_decode, log_dir=str(tmp_path)).start()
    results, stats, _ = serve_workload(cluster, SPEC)
    assert {rid: r.reason for rid, r in results.items()} == {
        rid: "length" for rid in reference}
    assert {rid: r.output_ids for rid, r in results.items()} == reference
    if mode == "disagg":
        assert sum(s.get("sent", 0) for s in stats.values()) == SPEC.requests
        assert sum(s.get("bytes_sent", 0) for s in stats.values()) > 0
        assert all(r.kv_bytes > 0 for r in results.values())
    _assert_logs_clean(cluster, num_prefill + num_decode)


def test_bad_requests_get_clear_errors_and_the_workers_keep_serving(tmp_path, reference):
    cluster = Cluster(CFG, "disagg", 1, 1, log_dir=str(tmp_path)).start()
    client = cluster.client
    bad = {
        "empty": ([], {}, "empty prompt"),
        "long": ([1] * 700, {}, "is longer than any pool row"),
        "vocab": ([1, 99999], {}, "token ids"),
        "n": ([1, 2], {"max_new_tokens": -3}, "max_new_tokens"),
        "temp": ([1, 2], {"temperature": "hot"}, "temperature"),
        "param": ([1, 2], {"beam": 4}, "unrecognized request argument: beam"),
        "row": ([1] * 300, {"max_new_tokens": 400}, "exceeds the largest pool row"),
        "context": ([1] * 4090, {"max_new_tokens": 10}, "or the model's context allows"),
        "hot": ([1, 2], {"temperature": 1e12}, "temperature"),
        "x" * 600: ([1, 2], {}, "rid must be 1..256 printable characters"),
    }
    for rid, (prompt, params, _) in bad.items():
        client.submit(rid, prompt, params)
    # 8 MB of text once took the router 30 s to encode, past every worker's lease
    bad["text"] = ([], {}, "exceeds the model's context of 4096")
    client.submit("text", [], text="hello world " * ((8 << 20) // 12))
    client.abort("nobody")
    errors, deadline = {}, time.monotonic() + 10
    while len(errors) < len(bad) + 1 and time.monotonic() < deadline:
        errors.update({m.rid: m.error for m in client.poll(0.1) if isinstance(m, Error)})
    for rid, (_, _, words) in bad.items():
        assert words in errors[rid], (rid, errors[rid])
    assert "unknown rid 'nobody'" in errors["nobody"]
    # a vanishing temperature (once a NaN that killed the prefill) is served as greedy
    results, _, _ = serve_workload(cluster, SPEC, params={"temperature": 1e-310})
    assert {rid: r.output_ids for rid, r in results.items()} == reference
    _assert_logs_clean(cluster, 2)


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_aborts_at_random_moments_leak_nothing(tmp_path, mode):
    # A small decode pool queues requests; long prompts in small chunks keep prefill and
    # transfer busy, so aborts land queued, prefilling, transferring and decoding.
    cfg = CFG.with_overrides(decode_pages=200, chunk_size=8, max_prefill_tokens=16)
    spec = WorkloadSpec(requests=24, seed=11, rate=0.0, prompt_len=(100, 300),
                        output_len=(20, 60))
    reqs = make_workload(spec, cfg.model_config().vocab_size)
    rng = random.Random(5)
    aborts = {r.rid: rng.uniform(0.0, 2.5) for r in reqs if rng.random() < 0.6}
    cluster = Cluster(cfg, mode, 1, 1, log_dir=str(tmp_path)).start()
    results = drive(cluster.client, reqs, aborts=aborts, check=cluster.check, timeout_s=120)
    stats = cluster.stop()
    cluster.check_exit_codes()
    reasons = {r.reason for r in results.values()}
    assert reasons <= {"length", "aborted"}, reasons
    assert sum(r.reason == "aborted" for r in results.values()) >= 3
    model = Model(cfg.model_config())
    for r in reqs:   # requests that were not aborted are still exact
        if results[r.rid].reason == "length":
            assert results[r.rid].output_ids == generate_greedy(
                model, [r.prompt], r.max_new_tokens, page_size=4)[0]
    assert sum(s.get("aborted", 0) for s in stats.values()) >= 3
    _assert_logs_clean(cluster, 2 if mode == "disagg" else 1)


def test_aborts_in_every_stage_free_both_sides(tmp_path):
    # Slow prefill (4-token chunks) and a decode pool that holds two requests:
    # a decodes and is aborted after 3 tokens; b is aborted while its KV is being computed
    # and streamed; c is aborted while queued for decode memory.
    cfg = CFG.with_overrides(decode_pages=190, prefill_pages=200, chunk_size=4,
                             max_prefill_tokens=8)
    prompt = [(5 * i) % 512 for i in range(300)]
    reqs = [WorkRequest(rid, prompt, 60, 0.0) for rid in ("a", "b", "c")]
    cluster = Cluster(cfg, "disagg", 1, 1, log_dir=str(tmp_path)).start()
    results = drive(cluster.client, reqs, aborts={"b": 0.06, "c": 0.03},
                    abort_after_tokens={"a": 3}, check=cluster.check, timeout_s=60)
    cluster.stop()
    cluster.check_exit_codes()
    assert {rid: r.reason for rid, r in results.items()} == {
        "a": "aborted", "b": "aborted", "c": "aborted"}
    decode = (tmp_path / "decode0.log").read_text()
    prefill = (tmp_path / "prefill0.log").read_text()
    for log, label, state in [(decode, "a", "DECODING"), (decode, "b", "WAITING_KV"),
                              (decode, "c", "QUEUED"), (prefill, "b", "PREFILLING")]:
        # workers name a request by the router's id, label#run-n
        assert re.search(rf" {label}#\S+ aborted in {state}", log), (label, state)
    _assert_logs_clean(cluster, 2)



def test_a_killed_worker_is_named_and_nothing_is_left_running(tmp_path):
    cluster = Cluster(CFG, "disagg", 1, 1, log_dir=str(tmp_path)).start()
    decode = next(p for p in cluster.procs if p.name == "decode0")
    os.kill(decode.popen.pid, signal.SIGKILL)
    reqs = make_workload(WorkloadSpec(requests=4, seed=1, rate=0.0), 512)
    with pytest.raises(WorkerDied, match=r"decode decode0 \(pid \d+\) killed by signal SIGKILL"):
        drive(cluster.client, reqs, check=cluster.check, timeout_s=30)
    cluster.stop()
    assert all(p.popen.poll() is not None for p in cluster.procs)
    report = replay_file(tmp_path / "prefill0.freelog")   # the survivor shut down cleanly
    assert report.ok, report.format()


def test_pdkv_run_cli_writes_jsonl_and_a_json_summary(tmp_path):
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "run", "--requests", "6", "--rate", "0",
         "--seed", "4", "--output", str(out), "--json", "--log-dir", str(tmp_path / "logs"),
         "--prompt-len", "8", "40", "--output-len", "2", "6"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import json
    summary = json.loads(proc.stdout)
    assert summary["ok"] == 6 and summary["freelog_violations"] == 0
    assert summary["freelogs"] == 4 and summary["kv_bytes"] > 0  # device + host tiers
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [x["rid"] for x in lines] == [f"s4-r{i:05d}" for i in range(6)]
    assert all(2 <= len(x["output_ids"]) <= 6 for x in lines)


def test_standalone_router_and_workers_over_tcp(tmp_path, reference):
    """The multi-host commands: pdkv keys, pdkv router, pdkv prefill --kv-advertise,
    pdkv decode, each "host" with only the keys it needs (docs/security.md).

    Loopback only: the prefill binds 127.0.0.1 and advertises it under another name
    (localhost), so the decodes reach it by the advertised address, not the bound one."""
    import json
    import socket

    from common.auth import Keys
    from deploy.cli import main as cli_main
    from deploy.router.client import Client

    def port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    router, kv = f"tcp://127.0.0.1:{port()}", port()
    base = [sys.executable, "-m", "deploy.cli"]
    # pdkv keys in this process: the same command's code, without four interpreter starts
    assert cli_main(["keys", "create", str(tmp_path / "keys")]) == 0
    for host in ("router", "worker", "operator"):
        assert cli_main(["keys", "export", str(tmp_path / "keys"), str(tmp_path / host),
                         "--for", host]) == 0
    cmds = {
        "router": [*base, "router", "--bind", router, "--config-json",
                   json.dumps(CFG.to_dict()), "--auth-keys", str(tmp_path / "router")],
        "p": [*base, "prefill", "--router", router, "--name", "p", "--kv-bind",
              f"tcp://127.0.0.1:{kv}", "--kv-advertise", f"tcp://localhost:{kv}",
              "--log-dir", str(tmp_path), "--auth-keys", str(tmp_path / "worker")],
        "d": [*base, "decode", "--router", router, "--name", "d", "--log-dir", str(tmp_path),
              "--auth-keys", str(tmp_path / "worker")],
    }
    procs = {n: subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=open(
        tmp_path / f"{n}.log", "w")) for n, c in cmds.items()}
    client = Client(router, keys=Keys(tmp_path / "operator"), identity="operator")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                workers = client.status(0.5).workers
            except TimeoutError:
                continue
            if len(workers) == 2 and all(w["ready"] for w in workers.values()):
                break
        out = tmp_path / "out.jsonl"   # pdkv run --router: drive a running deployment
        run = subprocess.run(
            [*base, "run", "--router", router, "--shutdown", "--log-dir", str(tmp_path),
             "--auth-keys", str(tmp_path / "operator"),
             "--requests", str(SPEC.requests), "--seed", str(SPEC.seed), "--rate", "40",
             "--prompt-len", *map(str, SPEC.prompt_len), "--output-len",
             *map(str, SPEC.output_len), "--output", str(out), "--json"],
            capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        summary = json.loads(run.stdout)
        assert summary["freelogs"] == 4 and summary["freelog_violations"] == 0  # + host
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert {x["rid"]: x["output_ids"] for x in lines} == reference
        assert all(p.wait(20) == 0 for p in procs.values())
    finally:
        client.close()
        for p in procs.values():
            p.kill()
    assert f"at tcp://localhost:{kv}" in (tmp_path / "d.log").read_text()  # advertised
    for name in ("p", "d"):
        assert replay_file(tmp_path / f"{name}.freelog").ok


def test_workers_exit_on_their_own_when_the_router_dies(tmp_path):
    cfg = CFG.with_overrides(rejoin_s=1.0)
    cluster = Cluster(cfg, "disagg", 1, 1, log_dir=str(tmp_path)).start()
    router = next(p for p in cluster.procs if p.role == "router")
    router.popen.kill()
    workers = [p for p in cluster.procs if p.role != "router"]
    codes = [p.popen.wait(cfg.lease_s + cfg.rejoin_s + 10) for p in workers]
    assert codes == [3, 3]   # RouterLost: no orphan outlives its deployment for long
    log = (tmp_path / "decode0.log").read_text()
    assert "router silent" in log and "no router took this worker back within 1 s" in log
    cluster.stop()
    for log in cluster.freelogs():
        assert replay_file(log).ok
