"""Tensor-parallel workers serving, with real processes: a colocated worker of two gloo
ranks (one process each, loopback) is token-identical to the single-process reference
at float64, with speculative decoding (the built-in draft layers) on; every rank writes
its own free log and each replays clean, the follower's with exactly the pages rank 0
allocated. P TP2 -> D TP2, and a colocated TP2 group, with a draft checkpoint sharded like
the target, equal transformers. With host offload, both kinds of group serve multi-turn
chat equal to the reference, later turns loading their prefix from every rank's own host
tier, whose logs replay clean with rank 0's pages; a TP2 decode under memory pressure
retracts to and resumes from them with the reference's tokens. A follower SIGKILLed
mid-request takes its group down cleanly: rank 0's requests end with an error naming the
lost rank, rank 0 exits, its log replays clean, and the deployment serves on with the
other worker."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from common.config import ServeConfig
from common.freelog import FreeLogReader, replay_file
from common.model import Model, generate_greedy
from deploy.launch.launcher import Cluster
from deploy.launch.run import serve_workload
from deploy.loadgen.driver import drive
from deploy.loadgen.workload import WorkloadSpec, make_workload

pytestmark = pytest.mark.timeout(240)

CFG = ServeConfig(dtype="float64", page_size=4, prefill_pages=96, decode_pages=160,
                  chunk_size=24, max_prefill_tokens=48, heartbeat_s=0.2, lease_s=3.0,
                  offload=False, decode_tp=2, tp_timeout_s=10.0, debug_integrity=True)
SPEC = WorkloadSpec(requests=6, seed=5, rate=40.0, prompt_len=(1, 60), output_len=(1, 10))


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    model = Model(CFG.model_config())
    return {r.rid: generate_greedy(model, [r.prompt], r.max_new_tokens, page_size=4)[0]
            for r in make_workload(SPEC, CFG.model_config().vocab_size)}


@pytest.fixture
def start(tmp_path):
    made: list[Cluster] = []

    def make(num: int = 1) -> Cluster:
        made.append(Cluster(CFG, "colocated", 0, num, log_dir=str(tmp_path)))
        return made[-1].start()

    yield make
    for cluster in made:
        cluster.stop()


def _outputs(cluster: Cluster, spec: WorkloadSpec = SPEC, check: bool = True) -> dict:
    reqs = make_workload(spec, CFG.model_config().vocab_size)
    return drive(cluster.client, reqs, check=cluster.check if check else None, timeout_s=120,
                 lease_s=CFG.lease_s)


def test_a_colocated_tp2_worker_equals_the_reference_and_every_rank_log_is_clean(
        start, reference):
    cluster = start(1)
    assert [p.name for p in cluster.procs] == ["router", "colocated0", "colocated0.tp1"]
    results = _outputs(cluster)
    assert {rid: r.output_ids for rid, r in results.items()} == reference
    cluster.stop()
    cluster.check_exit_codes()
    logs = {p.name: p for p in cluster.freelogs()}
    assert set(logs) == {"colocated0.freelog", "colocated0.tp1.freelog"}, logs
    for log in logs.values():
        report = replay_file(log)
        assert report.ok and not report.warnings, report.format()
    (node0, allocs0), (node1, allocs1) = (_allocs(logs[n]) for n in (
        "colocated0.freelog", "colocated0.tp1.freelog"))
    assert (node0, node1) == ("colocated0", "colocated0/tp1")
    assert allocs0 == allocs1 and len(allocs0) >= len(reference)  # the same pages, in order


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_tp2_groups_with_a_draft_checkpoint_equal_transformers(tmp_path, mode):
    """P TP2 -> D TP2 with a draft checkpoint (narrower KV rows than the target's),
    sharded over each group's ranks like the target: each prefill rank computes its heads
    of the draft's KV too, which travels with the target's to the decode rank holding
    those heads. A colocated TP2 group keeps each rank's draft heads in that rank's own
    rows. Speculation with it is exact, so the output is transformers' greedy output of
    the target; every rank's log replays clean with rank 0's pages."""
    pytest.importorskip("transformers")
    from tests.checkpoint_helpers import hf_checkpoint, hf_generate

    cfg = replace(CFG, model_path=str(hf_checkpoint("llama")), prefill_tp=2,
                  draft_model_path=str(hf_checkpoint("llama-draft-tp2")))
    assert cfg.kv_layout().num_draft_layers == 1
    reqs = make_workload(SPEC, cfg.model_config().vocab_size)
    disagg = mode == "disagg"
    cluster = Cluster(cfg, mode, 1 if disagg else 0, 1, log_dir=str(tmp_path))
    try:
        cluster.start()
        results = drive(cluster.client, reqs, check=cluster.check, timeout_s=120,
                        lease_s=CFG.lease_s)
    finally:
        stats = cluster.stop()
    cluster.check_exit_codes()
    assert {rid: r.output_ids for rid, r in results.items()} == {
        r.rid: hf_generate("llama", r.prompt, r.max_new_tokens) for r in reqs}
    decoder = "decode0" if disagg else "colocated0"
    assert stats[decoder]["spec_proposed"] > 0, stats  # the draft did propose
    for worker in ("prefill0", "decode0") if disagg else ("colocated0",):
        logs = [tmp_path / f"{worker}.freelog", tmp_path / f"{worker}.tp1.freelog"]
        for log in logs:
            report = replay_file(log)
            assert report.ok and not report.warnings, report.format()
        assert _allocs(logs[0])[1] == _allocs(logs[1])[1]


CHAT = WorkloadSpec(requests=6, seed=7, rate=40.0, prompt_len=(1, 30), output_len=(1, 10),
                   turns=3, shared_prefix=26, turn_gap_s=0.4)


@pytest.mark.parametrize("mode", ["disagg", "disagg-local", "colocated"])
def test_tp2_groups_offload_and_reuse_prefixes_rank_by_rank(tmp_path, mode):
    """Host offload in tensor-parallel groups (P TP2 -> D TP2, and a colocated TP2 group),
    multi-turn chat: later turns load their shared prefix from the host tier, every rank
    its own heads of it. The output equals the single-process reference; every rank's
    device and host logs replay clean, a follower's with rank 0's pages. ``disagg``
    sends every turn through the prefill (its group's host tier must hit too);
    ``disagg-local`` lets the router send later turns to the decode group alone, which
    prefills their rest itself (conditional disaggregation, docs/routing.md)."""
    local = 256 if mode == "disagg-local" else 0
    cfg = CFG.with_overrides(offload=True, prefill_tp=2, local_prefill_tokens=local)
    model = Model(cfg.model_config())
    reqs = make_workload(CHAT, cfg.model_config().vocab_size)
    reference = {r.rid: generate_greedy(model, [r.prompt], r.max_new_tokens, page_size=4)[0]
                 for r in reqs}
    disagg = mode != "colocated"
    cluster = Cluster(cfg, "disagg" if disagg else mode, 1 if disagg else 0, 1,
                      log_dir=str(tmp_path)).start()
    results, stats, _ = serve_workload(cluster, CHAT)
    cluster.check_exit_codes()
    assert {rid: r.output_ids for rid, r in results.items()} == reference
    if local:  # later turns never reached the prefill: the decode computed their rest
        assert stats["prefill0"]["sent"] < len(reqs), stats
        assert stats["decode0"]["tokens_computed"] > 0, stats
        stats = {"decode0": stats["decode0"]}
    for counts in stats.values():  # each group stored, and later turns hit
        assert counts["offloaded_pages"] > 0 and counts["prefix_hit_pages"] > 0, stats
    for worker in ("prefill0", "decode0") if disagg else ("colocated0",):
        _assert_rank_logs_match(tmp_path, worker)


def _assert_rank_logs_match(log_dir, worker: str) -> None:
    """Rank 0's and rank 1's device and host logs replay clean, with the same pages."""
    for pool in ("", ".host"):
        logs = [log_dir / f"{worker}{pool}.freelog", log_dir / f"{worker}.tp1{pool}.freelog"]
        for log in logs:
            report = replay_file(log)
            assert report.ok and not report.warnings, report.format()
        allocs = _allocs(logs[0])[1]
        assert allocs and allocs == _allocs(logs[1])[1], logs


def test_a_tp2_decode_under_pressure_retracts_to_every_ranks_host_tier_and_resumes(tmp_path):
    """P TP1 -> D TP2, overcommitted admission on a small decode pool: running requests
    outgrow it, the youngest are retracted (every rank offloads its heads of their
    committed pages and frees the row), then resumed (loaded back on every rank, the rest
    recomputed in the lockstep). The tokens equal the reference; every rank's device and
    host logs replay clean with rank 0's pages."""
    cfg = CFG.with_overrides(offload=True, decode_pages=60, overcommit=True)
    spec = WorkloadSpec(requests=10, seed=0, rate=0.0, prompt_len=(20, 60),
                        output_len=(30, 60))
    model = Model(cfg.model_config())
    reference = {r.rid: generate_greedy(model, [r.prompt], r.max_new_tokens, page_size=4)[0]
                 for r in make_workload(spec, cfg.model_config().vocab_size)}
    cluster = Cluster(cfg, "disagg", 1, 1, log_dir=str(tmp_path)).start()
    results, stats, _ = serve_workload(cluster, spec)
    cluster.check_exit_codes()
    assert {rid: r.output_ids for rid, r in results.items()} == reference
    assert stats["decode0"]["retracted"] >= 2, stats
    _assert_rank_logs_match(tmp_path, "decode0")


def test_a_narrow_draft_checkpoint_needs_equal_prefill_and_decode_groups():
    from common.node.tp import check_draft_split
    from tests.checkpoint_helpers import hf_checkpoint

    pytest.importorskip("transformers")
    cfg = replace(CFG, model_path=str(hf_checkpoint("llama")),
                  draft_model_path=str(hf_checkpoint("llama-draft-tp2")), prefill_tp=1)
    for role in ("prefill", "decode"):
        with pytest.raises(ValueError, match="prefill_tp=1 and decode_tp=2 must be equal"):
            check_draft_split(cfg, role)
    check_draft_split(cfg, "colocated")              # one group: nothing to map
    check_draft_split(replace(cfg, prefill_tp=2), "decode")
    wide = replace(cfg, draft_model_path=str(hf_checkpoint("llama")))
    check_draft_split(wide, "prefill")               # as wide as the target: maps as it


def _wait_gone(cluster: Cluster, name: str) -> None:
    """Until the router counts ``name`` lost (its lease ran out) or forgot it."""
    deadline = time.monotonic() + 4 * CFG.lease_s
    while time.monotonic() < deadline:
        w = cluster.client.status(2.0).workers.get(name)
        if w is None or w["lost"]:
            return
        time.sleep(0.1)
    raise AssertionError(f"the router still routes to {name}")


def _allocs(path) -> tuple[str, list[tuple[str, bytes]]]:
    with FreeLogReader(path) as log:
        return log.header.node, [(e["owner"], bytes(e["pages"])) for e in log.records
                                 if e.get("op") == "alloc"]


def test_a_killed_rank_takes_its_group_down_and_its_requests_move(
        start, reference, tmp_path):
    cluster = start(2)
    ranks = {p.name: p for p in cluster.procs}
    long_spec = WorkloadSpec(requests=8, seed=11, rate=200.0, prompt_len=(40, 60),
                             output_len=(60, 80))
    reqs = make_workload(long_spec, CFG.model_config().vocab_size)
    killed = []

    def kill_once(*_):
        if not killed and sum(1 for _ in tmp_path.glob("*.freelog")) == 4:
            ranks["colocated0.tp1"].popen.kill()
            killed.append(time.monotonic())

    results = drive(cluster.client, reqs, progress=kill_once, timeout_s=120,
                    lease_s=CFG.lease_s)
    assert killed, "no request finished before the kill"
    # what the dead group held moves to the other group (deploy/router/migration.py):
    # nothing is lost
    failed = {rid: r.error for rid, r in results.items() if not r.ok}
    assert not failed and len(results) == len(reqs), failed
    assert ranks["colocated0"].popen.wait(30) == 1  # rank 0 leaves with its group
    _wait_gone(cluster, "colocated0")
    after = _outputs(cluster, check=False)
    assert {rid: r.output_ids for rid, r in after.items()} == reference
    cluster.stop()
    for name in ("colocated0", "colocated1", "colocated1.tp1"):
        report = replay_file(tmp_path / f"{name}.freelog")
        assert report.ok and not report.warnings, (name, report.format())
    torn = replay_file(tmp_path / "colocated0.tp1.freelog")  # SIGKILLed: no close, no harm
    assert not torn.violations, torn.format()


def test_a_follower_whose_free_log_cannot_write_pauses_its_group_and_says_why(
        start, tmp_path):
    """The fault is real, as in test_freelog_deploy: RLIMIT_FSIZE on the running follower
    (its free log's next write past the limit gets EFBIG). Rank 0 asks its followers
    about their logs at every heartbeat: the group admits nothing new while the follower's
    log fails, the router routes around it and says why, and it admits again once the
    follower's writes go through; both logs hold every event exactly once."""
    from tests.test_freelog_deploy import limit_files, unlimit, wait_for

    cluster = start(2)
    follower = next(p for p in cluster.procs if p.name == "colocated0.tp1").popen.pid
    limit_files(follower, tmp_path, "colocated0.tp1", room=512)
    vocab = CFG.model_config().vocab_size

    def paused() -> str:
        return cluster.client.status(5.0).workers["colocated0"]["paused"]

    first = make_workload(WorkloadSpec(requests=12, seed=1, rate=0.0, prompt_len=(32, 60),
                                       output_len=(8, 16)), vocab)
    assert all(r.ok for r in drive(cluster.client, first, check=cluster.check).values())
    why = wait_for(paused, 60, "colocated0 to pause on its follower's log")
    assert "tp rank 1" in why and "colocated0.tp1.freelog" in why and "EFBIG" in why, why
    during = make_workload(WorkloadSpec(requests=6, seed=2, rate=0.0), vocab)
    assert all(r.ok for r in drive(cluster.client, during, check=cluster.check).values())
    unlimit(follower)
    wait_for(lambda: not paused(), 60, "colocated0 to admit again")
    after = make_workload(WorkloadSpec(requests=6, seed=3, rate=0.0), vocab)
    assert all(r.ok for r in drive(cluster.client, after, check=cluster.check).values())
    cluster.stop()
    cluster.check_exit_codes()
    for name in ("colocated0", "colocated0.tp1"):
        report = replay_file(tmp_path / f"{name}.freelog")
        assert report.ok and report.closed, (name, report.format())
    with FreeLogReader(tmp_path / "colocated0.freelog") as log:
        # owners are the router's ids, "<label>#<run>-<n>"
        labels = {e["owner"].split("#")[0] for e in log.records if e.get("op") == "alloc"}
    assert {r.rid for r in first} & labels  # it served before: the check below can fail
    assert not labels & {r.rid for r in during}  # nothing new admitted while paused


def test_a_followers_free_log_problem_in_the_final_stats_marks_its_log_incomplete(tmp_path):
    """Rank 0's final stats carry a follower's free-log problem as ``tp<r>.freelog_problem``
    (a log that lost events may still replay clean: the file just ends); ``pdkv run``'s
    check counts that follower's log incomplete, not clean, and says why."""
    from common.kv import KvCache
    from deploy.launch.run import replay_all

    path = tmp_path / "decode0.tp1.freelog"
    cache = KvCache(8, 4, log_path=path, node="decode0/tp1")
    kv = cache.open_row("r1")
    cache.extend(kv, 6)
    cache.free_kv_row(kv, [(0, 6)], reason="finished")
    cache.close_row(kv)
    cache.close()
    problem = f"tp rank 1: free log {path}: failing for 1.0s: EFBIG; 3 event(s) lost"
    assert replay_all([path], {"decode0": {"role": "decode"}})["clean"] == [path.name]
    checked = replay_all([path], {"decode0": {"role": "decode",
                                              "tp1.freelog_problem": problem}})
    assert checked["incomplete"] == [path.name] and not checked["clean"], checked
    assert checked["reported"] == {"decode0/tp1": problem}
