"""No request lost: a 2P2D deployment under 16 concurrent streaming requests loses one
worker at a time, and every request completes with the reference's tokens.

Each story is one fault under load: a decode SIGKILLed (with every process it started,
as a process group dies) mid-stream, a prefill SIGKILLed mid-transfer, a decode stopped
(SIGSTOP) past its lease; then every worker drained and restarted in turn (a rolling
restart, by ``pdkv drain`` and by SIGTERM), and the router restarted. After each, the
deployment serves a new round, and at the end every free log replays clean (a killed
process's log may end without a close; it must still hold no violation). A killed worker
must be noticed through its closed connections, not its lease: the router's log says so.

float64 on CPU (exact greedy tokens), a short lease (2 s) for the SIGSTOP story, short
outputs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.auth import Keys
from common.config import ServeConfig
from common.control import Drain
from common.freelog import FreeLogReader, follow_migrations, replay_file
from common.kv import deployment_tag, segment_stem
from common.model import Model, generate_greedy
from deploy.launch.launcher import Cluster
from deploy.loadgen.driver import Result, drive, router_lost
from deploy.loadgen.workload import WorkloadSpec, make_workload

pytestmark = pytest.mark.timeout(420)

CFG = ServeConfig(dtype="float64", page_size=4, prefill_pages=160, decode_pages=400,
                  chunk_size=16, max_prefill_tokens=32, heartbeat_s=0.2, lease_s=2.0,
                  rejoin_s=60.0, prefix_load_timeout_s=0.5, drain_timeout_s=0.5,
                  debug_integrity=True)
LOAD = WorkloadSpec(requests=16, seed=11, rate=0.0, prompt_len=(8, 48), output_len=(20, 28))
"""16 streams at once."""
FRESH = WorkloadSpec(requests=16, seed=13, rate=0.0, prompt_len=(8, 48), output_len=(20, 28))
"""16 streams whose prompts no worker has seen: a prefill killed mid-round still computes
some (LOAD's prompts come back from the host tier within milliseconds)."""
LONG = WorkloadSpec(requests=16, seed=12, rate=0.0, prompt_len=(8, 48), output_len=(60, 80))
"""16 longer streams: a drained decode still holds some when its drain_timeout_s ends."""


def _reference(spec: WorkloadSpec) -> dict[str, list[int]]:
    model = Model(CFG.model_config())
    return {r.rid: generate_greedy(model, [r.prompt], r.max_new_tokens, page_size=4)[0]
            for r in make_workload(spec, CFG.model_config().vocab_size)}


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return _reference(LOAD)


@pytest.fixture
def start(tmp_path):
    """Start a 2P2D deployment; whatever the story's outcome, it is stopped at the end."""
    made: list[Cluster] = []

    def make(cfg: ServeConfig = CFG) -> Cluster:
        made.append(Cluster(cfg, "disagg", 2, 2, log_dir=str(tmp_path)))
        return made[-1].start()

    yield make
    for c in made:
        c.stop()


def _serve(cluster: Cluster, reference: dict | None, fault=None,
           spec: WorkloadSpec = LOAD, params: dict | None = None) -> dict[str, Result]:
    """The 16 streams, ``fault(results)`` called as they run; every one must complete
    with the reference's tokens (None: any), and no client may see an error."""
    results: dict[str, Result] = {}
    reqs = make_workload(spec, CFG.model_config().vocab_size)
    drive(cluster.client, reqs, check=None if fault is None else lambda: fault(results),
          into=results, timeout_s=180, lease_s=10.0, params=params)
    failed = {rid: (r.reason, r.error) for rid, r in results.items() if not r.ok}
    assert not failed, failed
    if reference is not None:
        assert {rid: r.output_ids for rid, r in results.items()} == reference
    return results


def _streamed(results: dict[str, Result]) -> int:
    return sum(len(r.output_ids) for r in results.values())


def _proc(cluster: Cluster, name: str):
    return next(p for p in cluster.procs if p.name == name)


def _kill_group(pid: int) -> None:
    """SIGKILL ``pid`` and every process it started (its resource tracker, which would
    otherwise unlink its shared memory), as a dying process group goes."""
    family, todo = [pid], [pid]
    while todo:
        parent = todo.pop()
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                child = int(stat.parent.name)
                family.append(child)
                todo.append(child)
    for p in reversed(family):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Once:
    """A fault that fires once, when ``ready(results)`` says the moment has come."""

    def __init__(self, ready, act) -> None:
        self.ready, self.act, self.at = ready, act, 0.0

    def __call__(self, results: dict[str, Result]) -> None:
        if not self.at and self.ready(results):
            self.at = time.monotonic()
            self.act()


def _segments_of(cluster: Cluster, worker: str) -> list[str]:
    """The deployment's shared-memory segments that ``worker`` made."""
    stem = segment_stem(Keys(cluster.keys_dir).deployment_id, worker) + "."
    return [n for n in os.listdir("/dev/shm") if n.startswith(stem)]


def _migrated(results: dict[str, Result]) -> int:
    return sum(r.migrations for r in results.values())


def _replay_all(cluster: Cluster) -> dict[str, int]:
    """Every free log replays without a violation (a moved attempt never takes pages
    again where it was freed ``migrated``); frees by reason, summed over logs."""
    reasons: dict[str, int] = {}
    reports = [replay_file(log) for log in cluster.freelogs()]
    moves = follow_migrations(reports)
    assert all(m["next_log"] for m in moves), moves   # every next attempt ran somewhere
    for log, report in zip(cluster.freelogs(), reports):
        assert report.ok, report.format()
        with FreeLogReader(log) as reader:
            for e in reader.records:
                if e.get("op") == "free":
                    reasons[e["reason"]] = reasons.get(e["reason"], 0) + 1
    return reasons


def test_a_worker_killed_or_stopped_under_load_loses_no_request(start, reference, tmp_path):
    cluster = start()
    router_log = tmp_path / "router.log"
    mine = f"pdkv.{deployment_tag(Keys(cluster.keys_dir).deployment_id)}."
    # 1. a decode SIGKILLed with its process group mid-stream: noticed as its connections
    # close, its requests go on elsewhere, its shared memory is reclaimed
    decode0 = _proc(cluster, "decode0")
    assert _segments_of(cluster, "decode0")
    kill = Once(lambda res: _streamed(res) >= 48, lambda: _kill_group(decode0.popen.pid))
    results = _serve(cluster, reference, kill)
    assert kill.at and _migrated(results) > 0
    assert re.search(r"decode0 \(decode, pid \d+\) lost: its connection closed",
                     router_log.read_text())
    decode0.popen.wait(10)
    deadline = time.monotonic() + 2 * CFG.lease_s   # the router looks again once it died
    while _segments_of(cluster, "decode0"):
        assert time.monotonic() < deadline, _segments_of(cluster, "decode0")
        time.sleep(0.1)
    cluster.restart("decode0")
    cluster.wait_ready()

    # 2. a prefill SIGKILLed while it still computes and sends the round's prompts
    prefill0 = _proc(cluster, "prefill0")
    kill = Once(lambda res: sum(bool(r.output_ids) for r in res.values()) >= 3,
                lambda: _kill_group(prefill0.popen.pid))
    results = _serve(cluster, _reference(FRESH), kill, spec=FRESH)
    assert kill.at and _migrated(results) > 0
    assert re.search(r"prefill0 \(prefill, pid \d+\) lost: its connection closed",
                     router_log.read_text())
    cluster.restart("prefill0")
    cluster.wait_ready()

    # 3. a decode stopped past its lease: lost then (its connections stay open), its
    # requests move; continued, it is told so, ends what it held and rejoins. Sampled
    # requests this time: seeded, they resume their draws at the step they reached, so
    # they yield what the same round yields without the fault
    sampled = {"temperature": 0.8, "seed": 3}
    calm = _serve(cluster, None, params=sampled)
    sampled_reference = {rid: r.output_ids for rid, r in calm.items()}
    assert sampled_reference != reference
    decode1 = _proc(cluster, "decode1")

    def stop() -> None:
        os.kill(decode1.popen.pid, signal.SIGSTOP)

    pause = Once(lambda res: _streamed(res) >= 48, stop)
    try:
        results = _serve(cluster, sampled_reference, pause, params=sampled)
    finally:
        os.kill(decode1.popen.pid, signal.SIGCONT)
    assert pause.at and _migrated(results) > 0
    assert re.search(r"decode1 \(decode, pid \d+\) lost: silent for", router_log.read_text())
    cluster.wait_ready()
    assert "registered again with the router" in (tmp_path / "decode1.log").read_text()

    # the deployment serves on, untouched by what it went through
    assert _migrated(_serve(cluster, reference)) == 0
    cluster.stop()
    assert [n for n in os.listdir("/dev/shm") if n.startswith(mine)] == []   # none left
    reasons = _replay_all(cluster)
    assert reasons.get("migrated", 0) > 0, reasons   # survivors freed the moved attempts


def _drain_cli(cluster: Cluster, name: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "drain", name, "--router", cluster.router_addr,
         "--auth-keys", str(cluster.keys_dir), "--wait", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Rolling:
    """Drain every worker in turn (an operator's ``Drain``, ``pdkv drain`` or SIGTERM)
    as soon as a round's requests are routed, restart it once it exited and wait until
    it is ready, while the load runs; a drained process must exit 0."""

    def __init__(self, cluster: Cluster, plan: list[tuple[str, str]]) -> None:
        self.cluster, self.plan = cluster, list(plan)
        self.step: tuple | None = None
        self.done: list[str] = []

    def __call__(self, results: dict[str, Result]) -> None:
        if self.step is None:
            if self.plan and self.cluster.client.status(5).in_flight >= 8:   # routed
                name, how = self.plan.pop(0)
                proc = _proc(self.cluster, name)
                cli = None
                if how == "sigterm":
                    proc.popen.send_signal(signal.SIGTERM)
                elif how == "operator":
                    self.cluster.client.send(Drain(name))
                else:
                    cli = _drain_cli(self.cluster, name)
                self.step = ("exit", name, proc, cli)
        elif self.step[0] == "exit":
            _, name, proc, cli = self.step
            if proc.popen.poll() is not None:
                assert proc.popen.returncode == 0, proc.why()
                if cli is not None:
                    out, err = cli.communicate(timeout=30)
                    assert cli.returncode == 0 and "drained" in out, (out, err)
                self.cluster.restart(name)
                self.step = ("ready", name)
        else:
            name = self.step[1]
            w = self.cluster.client.status(5).workers.get(name)
            if w and w["ready"] and not w["lost"]:
                self.done.append(name)
                self.step = None


def test_a_rolling_restart_and_a_router_restart_lose_no_request(start, reference, tmp_path):
    long_reference = _reference(LONG)
    # a drained decode finishes for 0.1 s, then what it still holds moves
    cluster = start(CFG.with_overrides(drain_timeout_s=0.1))
    roll = Rolling(cluster, [("decode0", "operator"), ("prefill0", "sigterm"),
                             ("decode1", "sigterm"), ("prefill1", "cli")])
    moved, deadline = 0, time.monotonic() + 300
    while len(roll.done) < 4:   # rounds of 16 streams until every worker restarted once
        assert time.monotonic() < deadline, (roll.done, roll.step)
        moved += _migrated(_serve(cluster, long_reference, roll, LONG))
    assert roll.done == ["decode0", "prefill0", "decode1", "prefill1"]
    log = (tmp_path / "router.log").read_text()
    assert all(f"router: {n} drained" in log for n in roll.done)
    assert moved > 0 and re.search(r"worker decode\d drained", log)   # what was left moved

    # the router restarted under load: its clients hear it within the lease (no hang),
    # the workers register again without a restart of their own and serve the next round
    router = _proc(cluster, "router")
    kill = Once(lambda res: _streamed(res) >= 24, router.popen.kill)
    results: dict[str, Result] = {}
    drive(cluster.client, make_workload(LOAD, CFG.model_config().vocab_size), into=results,
          check=lambda: kill(results), timeout_s=120, lease_s=CFG.lease_s)
    assert kill.at and "silent for" in router_lost(results), results
    cluster.restart("router")
    cluster.wait_ready()
    pids = {p.name: p.popen.pid for p in cluster.procs}
    for name in ("prefill0", "prefill1", "decode0", "decode1"):
        assert "registered again with the router" in (tmp_path / f"{name}.log").read_text()
    _serve(cluster, reference)
    assert {p.name: p.popen.pid for p in cluster.procs} == pids   # no worker restarted
    cluster.stop()
    cluster.check_exit_codes()
    _replay_all(cluster)
