"""End to end with speculative decoding, host-tier offload and prefix reuse.

Real router and worker processes, float64 on CPU: whatever the draft proposes, whatever
is offloaded or loaded from a host tier, the tokens must equal the single-process greedy
reference, and every free log (device pools and host tiers) must replay clean.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from common.config import ServeConfig
from common.freelog import FreeLogReader, replay_file
from common.model import Model, generate_greedy
from deploy.launch.launcher import Cluster
from deploy.launch.run import serve_workload
from deploy.loadgen.driver import drive
from deploy.loadgen.workload import WorkloadSpec, make_workload
from deploy.router.routes import label_of

pytestmark = pytest.mark.timeout(180)

# local_prefill_tokens=0: every request goes through the prefill (these stories are about
# the transfer and both sides' prefix loads; a decode computing a later turn itself is
# tests/test_routing.py's)
CFG = ServeConfig(dtype="float64", page_size=4, prefill_pages=160, decode_pages=200,
                  chunk_size=24, max_prefill_tokens=48, heartbeat_s=0.2, lease_s=3.0,
                  host_pages=400, debug_integrity=True, local_prefill_tokens=0)
CHAT = WorkloadSpec(requests=9, seed=7, rate=40.0, prompt_len=(1, 30), output_len=(1, 12),
                    turns=3, shared_prefix=26, turn_gap_s=0.4)


def _reference(cfg: ServeConfig, spec: WorkloadSpec) -> dict[str, list[int]]:
    model = Model(cfg.model_config())
    return {r.rid: generate_greedy(model, [r.prompt], r.max_new_tokens,
                                   page_size=cfg.page_size)[0]
            for r in make_workload(spec, cfg.model_config().vocab_size)}


@pytest.fixture(scope="module")
def chat_reference() -> dict[str, list[int]]:
    return _reference(CFG, CHAT)


def _assert_all_logs_clean(cluster: Cluster, expect: int) -> None:
    logs = cluster.freelogs()
    assert len(logs) == expect, logs
    for log in logs:
        report = replay_file(log)
        assert report.ok, report.format()
        assert not report.warnings, report.warnings


def _aborted_while_offloading(log) -> set[str]:
    """Owners of device pages freed with reason ``aborted`` while an ``offload`` pin held
    them, whose pages were later released by the ``unpin`` of that offload pin: the
    deferred release the abort test is about."""
    pins: dict[int, tuple[str, set[int]]] = {}
    waiting: dict[int, str] = {}   # page freed (aborted) under an offload pin -> owner
    proven: set[str] = set()
    unpinned: tuple[str, set[int]] | None = None
    with FreeLogReader(log) as reader:
        for ev in reader.records:
            pages = set(np.frombuffer(ev.get("pages", b""), "<i4").tolist())
            op = ev["op"]
            if op == "pin":
                pins[ev["pin"]] = (ev["reason"], pages)
            elif op == "free" and ev["reason"] == "aborted":
                held = set().union(*(p for why, p in pins.values() if why == "offload"))
                waiting.update(dict.fromkeys(pages & held, ev["owner"]))
            elif op == "unpin":
                unpinned = pins.pop(ev["pin"])
            elif op == "release":
                assert unpinned is not None, ev  # a release follows its unpin
                why, pinned = unpinned
                for page in pages & set(waiting):
                    if why == "offload" and page in pinned:
                        proven.add(waiting.pop(page))
            if op != "unpin":
                unpinned = None
    return proven


@pytest.mark.parametrize("mode, spec_k, offload", [
    ("disagg", 1, False), ("disagg", 2, True), ("disagg", 4, True), ("disagg", 0, True),
    ("colocated", 3, True), ("colocated", 0, False)])
def test_multi_turn_outputs_equal_the_reference(tmp_path, chat_reference, mode, spec_k,
                                                offload):
    cfg = CFG.with_overrides(spec_k=spec_k, offload=offload)
    workers = 2 if mode == "disagg" else 1
    cluster = Cluster(cfg, mode, workers - 1, 1, log_dir=str(tmp_path)).start()
    results, stats, _ = serve_workload(cluster, CHAT)
    assert {rid: r.output_ids for rid, r in results.items()} == chat_reference
    totals = {k: sum(s.get(k, 0) for s in stats.values())
              for k in ("spec_proposed", "offloaded_pages", "prefix_hit_pages")}
    assert (totals["spec_proposed"] > 0) == (spec_k > 0), totals
    assert (totals["offloaded_pages"] > 0) == offload, totals
    assert (totals["prefix_hit_pages"] > 0) == offload, totals  # later turns hit
    _assert_all_logs_clean(cluster, workers * (2 if offload else 1))
    if mode == "disagg":
        _assert_kv_bytes_count_what_was_sent(cfg, results, stats, offload)


def _assert_kv_bytes_count_what_was_sent(cfg, results, stats, offload: bool) -> None:
    """Per-request ``kv_bytes`` is the pages the transfer carried: the whole prompt less
    the prefix the decode loaded from its host tier."""
    page = cfg.model_config().kv_layout(with_draft=cfg.with_draft).page_bytes(cfg.page_size)
    full = {rid: -(-r.prompt_len // cfg.page_size) * page for rid, r in results.items()}
    assert all(0 < r.kv_bytes <= full[rid] and r.kv_bytes % page == 0
               for rid, r in results.items()), results
    hits = [rid for rid, r in results.items() if r.kv_bytes < full[rid]]
    assert bool(hits) == offload, hits
    assert sum(r.kv_bytes for r in results.values()) == sum(
        s.get("bytes_sent", 0) for s in stats.values())  # what the prefill streamed


def test_speculation_at_page_size_16_with_max_new_tokens_mid_speculation(tmp_path):
    cfg = CFG.with_overrides(page_size=16, prefill_pages=48, decode_pages=64, host_pages=64,
                             spec_k=4)
    spec = WorkloadSpec(requests=6, seed=2, rate=0.0, prompt_len=(5, 60), output_len=(2, 9))
    cluster = Cluster(cfg, "disagg", 1, 1, log_dir=str(tmp_path)).start()
    results, _, _ = serve_workload(cluster, spec)
    assert {rid: r.output_ids for rid, r in results.items()} == _reference(cfg, spec)
    assert all(len(r.output_ids) == r.max_new_tokens for r in results.values())
    _assert_all_logs_clean(cluster, 4)


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_aborts_while_host_copies_are_in_flight_leak_nothing(tmp_path, mode):
    # Every host copy starts 30 ms late, so aborts during decode land on rows with
    # offloads in flight; finished rows wait for their copies before they are freed.
    cfg = CFG.with_overrides(debug_copy_delay_s=0.03, spec_k=2)
    spec = WorkloadSpec(requests=12, seed=5, rate=0.0, prompt_len=(20, 90),
                        output_len=(10, 30), turns=2, shared_prefix=16, turn_gap_s=0.3)
    reqs = make_workload(spec, cfg.model_config().vocab_size)
    rng = random.Random(3)
    after = {r.rid: rng.randint(1, 8) for r in reqs if rng.random() < 0.5}
    workers = 2 if mode == "disagg" else 1
    cluster = Cluster(cfg, mode, workers - 1, 1, log_dir=str(tmp_path)).start()
    results = drive(cluster.client, reqs, abort_after_tokens=after, check=cluster.check,
                    timeout_s=120)
    cluster.stop()
    cluster.check_exit_codes()
    aborted = {rid for rid, r in results.items() if r.reason == "aborted"}
    assert len(aborted) >= 3
    ref = _reference(cfg, spec)
    for rid, r in results.items():
        assert r.reason in ("length", "aborted"), (rid, r.reason, r.error)
        if r.reason == "length":
            assert r.output_ids == ref[rid]
    _assert_all_logs_clean(cluster, workers * 2)
    # the overlap this test is about happened: an aborted row was freed while its pages
    # were still pinned by a copy to the host, and they came back only at that copy's end
    decode_log = [p for p in cluster.freelogs() if p.name.startswith(mode_worker(mode))
                  and not p.name.endswith(".host.freelog")]
    assert len(decode_log) == 1, cluster.freelogs()
    proven = _aborted_while_offloading(decode_log[0])
    assert proven and {label_of(o) for o in proven} <= aborted, (proven, aborted)


def mode_worker(mode: str) -> str:
    """Name prefix of the worker that decodes (and offloads while decoding)."""
    return "decode" if mode == "disagg" else "colocated"


def test_prefix_loads_that_time_out_fall_back_to_full_prefill_and_receive(tmp_path,
                                                                         chat_reference):
    # Every host copy starts 50 ms late and a prefix load may take 5 ms: every load on
    # the prefill and the decode times out. Each such request gives its row back
    # (reason timeout; the load's pins keep the pages until the copy ends) and is served
    # without reuse, token-identical; both workers keep serving.
    cfg = CFG.with_overrides(debug_copy_delay_s=0.05, prefix_load_timeout_s=0.005,
                             spec_k=2)
    cluster = Cluster(cfg, "disagg", 1, 1, log_dir=str(tmp_path)).start()
    results, stats, _ = serve_workload(cluster, CHAT)
    assert {rid: r.output_ids for rid, r in results.items()} == chat_reference
    by_role = {s["role"]: s for s in stats.values()}
    assert by_role["prefill"]["prefix_load_timeouts"] > 0, stats
    assert by_role["decode"]["prefix_load_timeouts"] > 0, stats
    _assert_all_logs_clean(cluster, 4)
    for log in cluster.freelogs():
        if not log.name.endswith(".host.freelog"):
            with FreeLogReader(log) as reader:
                assert any(ev.get("reason") == "timeout" for ev in reader.records), log


@pytest.mark.parametrize("spec_k", [0, 2])
def test_retraction_under_pressure_gives_identical_tokens(tmp_path, spec_k):
    # Overcommitted admission on a 59-page decode pool: running requests outgrow it, the
    # youngest are retracted to the host tier and resumed when pages come back.
    cfg = CFG.with_overrides(decode_pages=60, overcommit=True, spec_k=spec_k)
    spec = WorkloadSpec(requests=10, seed=0, rate=0.0, prompt_len=(20, 60),
                        output_len=(30, 60))
    cluster = Cluster(cfg, "disagg", 1, 1, log_dir=str(tmp_path)).start()
    results, stats, _ = serve_workload(cluster, spec)
    assert {rid: r.output_ids for rid, r in results.items()} == _reference(cfg, spec)
    assert sum(s.get("retracted", 0) for s in stats.values()) >= 2, stats
    _assert_all_logs_clean(cluster, 4)
