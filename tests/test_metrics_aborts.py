"""End to end: aborts are counted by the stage the request was in, on each worker, and the
counters agree with the free logs (real router and workers, the deployment's final
metrics as the router exposes them, ``metrics.prom``).

The story of ``test_e2e_serving``'s aborts in every stage: a slow prefill (4-token chunks)
and a decode pool that holds two requests; ``a`` is aborted while decoding, ``b`` while
its KV is computed and streamed, ``c`` while it waits for decode memory."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from common.config import ServeConfig
from common.freelog import FreeLogReader, replay_file
from deploy.launch.launcher import Cluster
from deploy.loadgen.driver import drive
from deploy.loadgen.workload import WorkRequest
from tests.metrics_helpers import by, parse

pytestmark = pytest.mark.timeout(180)

CFG = ServeConfig(dtype="float64", page_size=4, prefill_pages=200, decode_pages=190,
                  chunk_size=4, max_prefill_tokens=8, heartbeat_s=0.2, lease_s=3.0,
                  debug_integrity=True)
ROW_STAGES = {"waiting_kv", "prefilling", "transferring", "decoding"}
"""Stages in which a worker holds a device row for the request (``ReqState.holds_kv``)."""


def _aborted_owners(path) -> set[str]:
    """Owners (the router's rids) of the log's ``free`` events with reason aborted."""
    with FreeLogReader(path) as reader:
        return {e["owner"] for e in reader.records
                if e.get("op") == "free" and e.get("reason") == "aborted"}


def _logged_stages(text: str) -> dict[str, str]:
    """rid label -> the stage its worker's log says it was aborted in."""
    return {m[1]: m[2].lower() for m in re.finditer(r" (\w+)#\S+ aborted in (\w+)", text)}


def test_aborts_are_counted_by_stage_and_agree_with_the_free_logs(tmp_path):
    prompt = [(5 * i) % 512 for i in range(300)]
    reqs = [WorkRequest(rid, prompt, 60, 0.0) for rid in ("a", "b", "c")]
    cluster = Cluster(CFG, "disagg", 1, 1, log_dir=str(tmp_path)).start()
    results = drive(cluster.client, reqs, aborts={"b": 0.06, "c": 0.03},
                    abort_after_tokens={"a": 3}, check=cluster.check, timeout_s=60)
    cluster.stop()
    cluster.check_exit_codes()
    assert {rid: r.reason for rid, r in results.items()} == {
        "a": "aborted", "b": "aborted", "c": "aborted"}
    final = parse((tmp_path / "metrics.prom").read_text())
    stages_seen = set()
    for worker in ("decode0", "prefill0"):
        counted = {stage: n for (stage,), n in by(final, "pdkv_request_aborts_total",
                                                  ("stage",), worker=worker).items() if n}
        logged = _logged_stages((tmp_path / f"{worker}.log").read_text())
        assert counted == dict(Counter(logged.values())), (worker, counted, logged)
        (log,) = [p for p in cluster.freelogs() if p.name == f"{worker}.freelog"]
        assert replay_file(log).ok
        # a request aborted where it held a row is one aborted free in this worker's log;
        # one aborted before it had a row (decode: queued for memory) is none
        freed = {owner.split("#")[0] for owner in _aborted_owners(log)}
        assert freed == {rid for rid, stage in logged.items() if stage in ROW_STAGES}, (
            worker, freed, logged)
        stages_seen |= set(counted)
    assert len(stages_seen) >= 2, stages_seen   # aborted in at least two stages
    # the decode saw all three: while decoding, while its KV came, while queued
    assert _logged_stages((tmp_path / "decode0.log").read_text()) == {
        "a": "decoding", "b": "waiting_kv", "c": "queued"}
