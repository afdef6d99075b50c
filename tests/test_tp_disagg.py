"""Disaggregated tensor-parallel workers, with real processes: prefill and decode groups of
gloo ranks (one process each, loopback), every rank streaming the KV of its own heads to
the decode ranks that hold them. P TP2 -> D TP1, P TP1 -> D TP2 and P TP2 -> D TP2 are
token-identical to the single-process reference at float64 (speculative decoding with the
built-in draft layers on: the draft's KV travels too), over shared memory and over frames;
every rank's free log replays clean and each follower allocated exactly rank 0's pages.
A rank SIGKILLed mid-request takes its group down cleanly: the group's requests fail,
every other process's log replays clean, and the deployment serves on."""

from __future__ import annotations

import re
import time
from dataclasses import replace

import pytest

from common.config import ServeConfig
from common.freelog import FreeLogReader, replay_file
from common.model import Model, generate_greedy
from deploy.driver import drive
from deploy.launcher import Cluster
from deploy.workload import WorkloadSpec, make_workload

pytestmark = pytest.mark.timeout(240)

CFG = ServeConfig(dtype="float64", page_size=4, prefill_pages=96, decode_pages=160,
                  chunk_size=24, max_prefill_tokens=48, heartbeat_s=0.2, lease_s=3.0,
                  offload=False, tp_timeout_s=10.0, debug_integrity=True)
SPEC = WorkloadSpec(requests=6, seed=7, rate=40.0, prompt_len=(1, 60), output_len=(1, 10))


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    model = Model(CFG.model_config())
    return {r.rid: generate_greedy(model, [r.prompt], r.max_new_tokens, page_size=4)[0]
            for r in make_workload(SPEC, CFG.model_config().vocab_size)}


def _outputs(cluster: Cluster, check: bool = True) -> dict:
    reqs = make_workload(SPEC, CFG.model_config().vocab_size)
    return drive(cluster.client, reqs, check=cluster.check if check else None, timeout_s=120,
                 lease_s=CFG.lease_s)


def _rank(worker: str, rank: int) -> str:
    """The launcher's process name of ``rank`` of ``worker``."""
    return f"{worker}.tp{rank}" if rank else worker


def _allocs(path) -> tuple[str, list[tuple[str, bytes]]]:
    with FreeLogReader(path) as log:
        return log.header.node, [(e["owner"], bytes(e["pages"])) for e in log.records
                                 if e.get("op") == "alloc"]


def _check_logs(log_dir, worker: str, tp: int) -> None:
    """Every rank's log of ``worker`` replays clean; followers allocated rank 0's pages."""
    first = log_dir / f"{worker}.freelog"
    node0, allocs0 = _allocs(first)
    assert node0 == worker
    for rank in range(tp):
        path = first if rank == 0 else log_dir / f"{worker}.tp{rank}.freelog"
        report = replay_file(path)
        assert report.ok and not report.warnings, (path.name, report.format())
        if rank:
            node, allocs = _allocs(path)
            assert node == f"{worker}/tp{rank}" and allocs == allocs0, path.name


@pytest.mark.parametrize("ptp,dtp,shm", [(2, 1, True), (1, 2, True), (2, 2, True),
                                         (2, 2, False)],
                         ids=["p2-d1", "p1-d2", "p2-d2", "p2-d2-frames"])
def test_tp_groups_disaggregated_equal_the_reference_and_every_rank_log_is_clean(
        tmp_path, reference, ptp, dtp, shm):
    cfg = replace(CFG, prefill_tp=ptp, decode_tp=dtp, shared_memory=shm)
    cluster = Cluster(cfg, "disagg", 1, 1, log_dir=str(tmp_path))
    try:
        cluster.start()
        names = [p.name for p in cluster.procs]
        assert names == ["router", *(_rank("prefill0", r) for r in range(ptp)),
                         *(_rank("decode0", r) for r in range(dtp))], names
        results = _outputs(cluster)
        assert {rid: r.output_ids for rid, r in results.items()} == reference
    finally:
        cluster.stop()
    cluster.check_exit_codes()
    # every decode rank connected to every prefill rank, by the asked data path
    paths = _data_paths(tmp_path, dtp)
    assert all(p == ({"shm"} if shm else {"ipc"}) for p in paths.values()), paths
    _check_logs(tmp_path, "prefill0", ptp)
    _check_logs(tmp_path, "decode0", dtp)


def _data_paths(log_dir, dtp: int) -> dict[str, set[str]]:
    """Data paths each decode rank's log says it connected with, by rank log."""
    out = {}
    for rank in range(dtp):
        name = f"{_rank('decode0', rank)}.log"
        text = (log_dir / name).read_text()
        out[name] = set(re.findall(r"connected to \S+ at \S+ \(data path (\w+)\)", text))
    return out


def _wait_gone(cluster: Cluster, name: str) -> None:
    deadline = time.monotonic() + 4 * CFG.lease_s
    while time.monotonic() < deadline:
        w = cluster.client.status(2.0).workers.get(name)
        if w is None or w["lost"]:
            return
        time.sleep(0.1)
    raise AssertionError(f"the router still routes to {name}")


@pytest.mark.parametrize("victim,ptp,dtp,num_prefill,num_decode", [
    ("prefill0.tp1", 2, 1, 2, 1), ("decode0.tp1", 1, 2, 1, 2)],
    ids=["prefill-rank", "decode-rank"])
def test_a_killed_rank_fails_its_groups_requests_and_the_deployment_serves_on(
        tmp_path, reference, victim, ptp, dtp, num_prefill, num_decode):
    cfg = replace(CFG, prefill_tp=ptp, decode_tp=dtp)
    cluster = Cluster(cfg, "disagg", num_prefill, num_decode, log_dir=str(tmp_path))
    try:
        cluster.start()
        ranks = {p.name: p for p in cluster.procs}
        long_spec = WorkloadSpec(requests=10, seed=11, rate=200.0, prompt_len=(40, 60),
                                 output_len=(40, 60))
        reqs = make_workload(long_spec, CFG.model_config().vocab_size)
        killed = []

        def kill_once(done, _total):
            if not killed and done >= 1:
                ranks[victim].popen.kill()
                killed.append(time.monotonic())

        results = drive(cluster.client, reqs, progress=kill_once, timeout_s=120,
                        lease_s=CFG.lease_s)
        assert killed, "no request finished before the kill"
        failed = {rid: r.error for rid, r in results.items() if not r.ok}
        assert failed, "no request was in flight on the killed group"
        group = victim.split(".")[0]
        assert ranks[group].popen.wait(30) == 1  # rank 0 leaves with its group
        _wait_gone(cluster, group)
        after = _outputs(cluster, check=False)
        assert {rid: r.output_ids for rid, r in after.items()} == reference
    finally:
        cluster.stop()
    for path in sorted(tmp_path.glob("*.freelog")):
        report = replay_file(path)
        if path.name == f"{victim}.freelog":  # SIGKILLed: no close, no harm
            assert not report.violations, report.format()
        else:
            assert report.ok and not report.warnings, (path.name, report.format())
