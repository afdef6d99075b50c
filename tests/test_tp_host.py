"""The host tier of a tensor-parallel worker, in one process: rank 0's offloader (its host
tier and copies recorded, ``common.node.tp.host``) stores, loads and evicts; a follower's
``Mirror`` with a ``HostMirror`` repeats every step on its own pools. The steps come off
a real ``TpGroup`` subclass that keeps what rank 0 broadcast (tests/test_tp_lockstep.py).
Both ranks hold every head here (one model), so the follower's host pages must hold
rank 0's bytes exactly, its loaded device pages too, and its device and host logs must
be rank 0's event for event and replay clean; its metrics count its own copies."""

from __future__ import annotations

import pytest
import torch

from common.config import ServeConfig
from common.control import pack_ids
from common.freelog import FreeLogReader, replay_file
from common.host import HashChain
from common.kv import KvCache
from common.model import BatchItem, Model, ModelRunner, get_config
from common.node import make_offloader
from common.node.tp import (
    LeaderKvCache,
    LeaderRunner,
    Lockstep,
    Mirror,
    RankMetrics,
    TpKvOp,
    follower_host,
)
from common.parallel import GroupLost
from tests.tp_helpers import Recording

CFG = get_config("tiny", dtype="float64")
SERVE = ServeConfig(host_pages=9)
PS = 4


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(CFG)


def _pair(tmp_path, model: Model, serve: ServeConfig = SERVE):
    group = Recording()
    lead = LeaderKvCache(64, PS, layout=CFG.kv_layout(True), log_path=tmp_path / "w.freelog",
                         node="w", lockstep=Lockstep(group))
    follow = KvCache(64, PS, layout=CFG.kv_layout(True), log_path=tmp_path / "w.tp1.freelog",
                     node="w/tp1")
    off = make_offloader(serve, lead, "cpu", str(tmp_path), "w")
    host = follower_host(serve, follow, "cpu", str(tmp_path), "w.tp1", "w/tp1")
    mirror = Mirror(ModelRunner(model, follow), 1, host=host)
    return group, LeaderRunner(model, lead), off, mirror


def _replay_steps(group: Recording, mirror: Mirror, runner: LeaderRunner) -> None:
    runner.lockstep.send("idle")
    for step in group.steps:
        assert mirror.apply(step)
    group.steps.clear()


def _events(path) -> list[tuple]:
    with FreeLogReader(path) as log:
        return [(e["op"], e.get("owner"), bytes(e.get("pages", b"")), e.get("reason"))
                for e in log.records]


def _assert_logs_match(tmp_path) -> None:
    for lead, follow in (("w.freelog", "w.tp1.freelog"),
                         ("w.host.freelog", "w.tp1.host.freelog")):
        assert _events(tmp_path / lead) == _events(tmp_path / follow), lead
        for log in (lead, follow):
            report = replay_file(tmp_path / log)
            assert report.ok and not report.warnings, report.format()


def test_a_follower_stores_loads_and_evicts_rank_0s_host_pages(tmp_path, model):
    group, runner, off, mirror = _pair(tmp_path, model)
    cache, tokens = runner.cache, list(range(3, 15))  # 12 tokens: 3 full pages
    a = cache.open_row("a")
    cache.extend(a, 12)
    runner.forward([BatchItem(a, tokens, 0)])
    cache.commit(a, 12)
    assert off.complete_store(off.prepare_store(a, HashChain(PS, tokens=tokens)), timeout=10)
    cache.free_kv_row(a, [(0, 12)], reason="finished")
    cache.close_row(a)
    b = cache.open_row("b")  # a later request with the same prompt loads it from the host
    cache.extend(b, 12)
    load = off.prepare_load(b, HashChain(PS, tokens=tokens), max_tokens=8)
    assert load is not None and off.complete_load(load, timeout=10) and load.num_tokens == 8
    cache.commit(b, 8)
    _replay_steps(group, mirror, runner)

    host_pages = load.host_pages.tolist()
    assert torch.equal(off.host.data[host_pages], mirror.host.host.data[host_pages])
    assert off.host.data[host_pages].abs().sum() > 0
    rows = cache.pages(b, 0, 8).tolist()
    assert rows == mirror.cache.pages(mirror.kv.rows["b"], 0, 8).tolist()
    assert torch.equal(mirror.runner.data[rows], runner.data[rows])  # loaded on both ranks
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for family in
               RankMetrics("colocated", mirror.cache, None, mirror.host).metrics.collect()
               for s in family.samples}
    assert samples[("pdkv_host_copy_pages_total", (("direction", "offload"),))] == 3
    assert samples[("pdkv_host_copy_pages_total", (("direction", "load"),))] == 2
    assert off.prefix.evict(3) == 3  # evicted on rank 0: freed on the follower too
    cache.free_kv_row(b, [(0, 12)], reason="finished")
    cache.close_row(b)
    off.close()
    off.host.close()
    cache.close()
    runner.lockstep.send("stop")
    assert not mirror.apply(group.steps[-1]) and mirror.closed and mirror.host.closed
    _assert_logs_match(tmp_path)
    ops = [e[0] for e in _events(tmp_path / "w.tp1.host.freelog")]
    assert ops.count("pin") == 2 and ops.count("unpin") == 2 and "free" in ops, ops


def test_a_follower_whose_host_pages_differ_loses_the_group(tmp_path, model):
    group, runner, off, mirror = _pair(tmp_path, model)
    mirror.host.host.allocate(1)  # this rank's host allocator moved on
    a = runner.cache.open_row("a")
    runner.cache.extend(a, 4)
    runner.cache.commit(a, 4)
    off.complete_store(off.prepare_store(a, HashChain(PS, tokens=[1, 2, 3, 4])), timeout=10)
    runner.lockstep.send("idle")
    with pytest.raises(GroupLost, match=r"rank 0 allocated host pages \[1\], this rank \[2\]"):
        mirror.apply(group.steps[-1])
    off.close()


def test_a_follower_that_lost_rank_0_mid_copy_drops_its_pins_and_closes_its_host_log(
        tmp_path, model):
    slow = ServeConfig(host_pages=9, debug_copy_delay_s=0.5)  # rank 0's copy still runs
    group, runner, off, mirror = _pair(tmp_path, model, slow)
    a = runner.cache.open_row("a")
    runner.cache.extend(a, 8)
    runner.cache.commit(a, 8)
    handle = off.prepare_store(a, HashChain(PS, tokens=list(range(8))))
    _replay_steps(group, mirror, runner)
    assert not handle.done and len(mirror.host.pins) == 1
    mirror.abandon()  # rank 0 went silent before its copy ended
    ops = [e[0] for e in _events(tmp_path / "w.tp1.host.freelog")]
    assert ops == ["alloc", "pin", "unpin", "close"], ops
    for log in ("w.tp1.freelog", "w.tp1.host.freelog"):
        report = replay_file(tmp_path / log)
        assert report.ok and not report.warnings, report.format()
    off.close()


def test_a_host_copy_outside_the_pools_loses_the_group_before_any_byte_moves(tmp_path, model):
    group, runner, off, mirror = _pair(tmp_path, model)
    runner.lockstep.record(TpKvOp("h_copy", n=1, pages=pack_ids([70, 1])))  # device page 70
    runner.lockstep.send("idle")
    with pytest.raises(GroupLost, match=r"step does not fit this rank .*outside"):
        mirror.apply(group.steps[-1])
    off.close()
