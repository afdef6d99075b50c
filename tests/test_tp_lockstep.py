"""The lockstep of a tensor-parallel worker, in one process: rank 0's cache and runner
record every change and pass (``LeaderKvCache``, ``LeaderRunner``), a follower's
``Mirror`` replays the steps on its own cache. The steps are taken off a real subclass of
``TpGroup`` that keeps what rank 0 broadcast (a group of one: no peers needed), so the
story checks what a follower does with them: the same page ids, the same free-log events,
a divergence caught before any KV is written, a lost rank 0 answered by freeing
everything with reason ``peer_lost``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.freelog import FreeLogReader, replay_file
from common.kv import KvCache
from common.model import BatchItem, Model, ModelRunner, get_config
from common.node.tp import LeaderKvCache, LeaderRunner, Lockstep, Mirror, RankPins, TpKvOp
from common.parallel import GroupLost
from tests.tp_helpers import Recording

CFG = get_config("tiny", dtype="float64")


def _pair(tmp_path, model: Model):
    group = Recording()
    lead = LeaderKvCache(64, 4, layout=CFG.kv_layout(True), log_path=tmp_path / "r0.freelog",
                         node="w", lockstep=Lockstep(group))
    follow = KvCache(64, 4, layout=CFG.kv_layout(True), log_path=tmp_path / "r1.freelog",
                     node="w/tp1")
    return group, LeaderRunner(model, lead), Mirror(ModelRunner(model, follow), 1)


def _events(path) -> list[tuple]:
    with FreeLogReader(path) as log:
        return [(e["op"], e.get("owner"), bytes(e.get("pages", b"")), e.get("reason"))
                for e in log.records]


def test_a_follower_repeats_rank_0_page_for_page(tmp_path, model):
    group, runner, mirror = _pair(tmp_path, model)
    cache = runner.cache
    a, b = cache.open_row("a"), cache.open_row("b")
    cache.extend(a, 9)
    cache.extend(b, 5)
    runner.forward([BatchItem(a, list(range(1, 10)), 0), BatchItem(b, [5, 6, 7, 8, 9], 0)])
    cache.commit(a, 9)
    cache.extend(a, 4)  # speculative lookahead, then its tail freed
    runner.forward_all([BatchItem(a, [3, 4, 5, 6], 9)], draft=True)
    cache.free_kv_row(a, [(12, 13)], reason="spec_reject")
    b_pages = cache.pages(b, 0, 5).tolist()
    cache.free_kv_row(b, [(0, 5)], reason="aborted")
    cache.close_row(b)
    pin = cache.pin(a, 0, 8, reason="send")
    cache.unpin(pin)
    runner.lockstep.send("idle")
    for step in group.steps:
        assert mirror.apply(step)
    assert np.array_equal(mirror.cache.pages(mirror.kv.rows["a"], 0, 12), cache.pages(a, 0, 12))
    # the follower's pool holds the same K/V (one model here), written by its own passes
    pages = cache.pages(a, 0, 12).tolist() + b_pages
    assert torch.equal(runner.data[pages], mirror.runner.data[pages])
    assert runner.data[pages].abs().sum() > 0
    cache.free_kv_row(a, [(0, 12)], reason="finished")
    cache.close_row(a)
    cache.close()
    runner.lockstep.send("stop")
    assert not mirror.apply(group.steps[-1]) and mirror.closed
    lead, follow = _events(tmp_path / "r0.freelog"), _events(tmp_path / "r1.freelog")
    assert lead == follow and ("free", "a", lead[-2][2], "finished") in lead
    for log in ("r0.freelog", "r1.freelog"):
        report = replay_file(tmp_path / log)
        assert report.ok and not report.warnings, report.format()


def test_a_follower_whose_pages_differ_stops_before_computing(tmp_path, model):
    group, runner, mirror = _pair(tmp_path, model)
    mirror.cache.extend(mirror.cache.open_row("stray"), 4)  # this rank's allocator moved on
    kv = runner.cache.open_row("a")
    runner.cache.extend(kv, 4)
    runner.forward([BatchItem(kv, [1, 2, 3, 4], 0)])
    with pytest.raises(GroupLost, match=r"a: rank 0 allocated pages \[1\], this rank cannot "
                                        r"take them .*page 1 is owned by 'stray'"):
        for step in group.steps:  # the pass, then its logits' rows
            mirror.apply(step)


def test_a_follower_that_lost_rank_0_frees_what_it_holds(tmp_path, model):
    group, runner, mirror = _pair(tmp_path, model)
    cache = runner.cache
    a = cache.open_row("a")
    cache.extend(a, 10)
    cache.commit(a, 10)
    cache.extend(a, 3)
    cache.free_kv_row(a, [(12, 13)], reason="spec_reject")  # a freed tail page
    cache.pin(a, 0, 4, reason="send")
    runner.lockstep.send("idle")
    mirror.apply(group.steps[-1])
    mirror.abandon()  # rank 0 went silent: what this rank holds goes back
    events = _events(tmp_path / "r1.freelog")
    assert [e[0] for e in events[-4:]] == ["pin", "unpin", "free", "close"], events
    # pages 1-3 (positions 0-11) only: the tail page was freed already (no double free)
    assert events[-2][1:] == ("a", np.array([1, 2, 3], "<i4").tobytes(), "peer_lost")
    report = replay_file(tmp_path / "r1.freelog")
    assert report.ok and not report.warnings, report.format()


def test_an_op_travels_without_its_default_fields_and_decodes_whole():
    """Rank 0 leaves an op's default fields out (most of them; the follower decodes a
    third faster); the checked codec fills them back in, so every op decodes equal."""
    from common.control import pack_ids
    from common.node.tp.lockstep import OP_CODEC, encode_op

    ops = [TpKvOp("open", "a"), TpKvOp("commit", "a", [9, 4, 0, 0], n=1),
           TpKvOp("extend", "a", [9, 9, 0, 0], n=4, pages=pack_ids([3])),
           TpKvOp("pin", "a", [9, 9, 0, 0], n=0, m=8, ranges=[0], text="send"),
           TpKvOp("free_pages", "cache:p", pages=pack_ids([2]), text="evicted", pool="swa"),
           TpKvOp("close", retained=["cache:p"]),
           TpKvOp("x_abort", "r", text="aborted", detail="client abort")]
    for op in ops:
        raw = encode_op(op)
        assert OP_CODEC.decode(raw) == op and len(raw) < len(OP_CODEC.encode(op)), op
    assert OP_CODEC.decode(encode_op(TpKvOp("open", "a"))) == TpKvOp("open", "a", [], 0)


def _aborted_mid_transfer(tmp_path, model):
    """Rows x (pages 1-2) and y (page 3) on both ranks; each rank's own transport pins
    x's pages (a receive: rank 0's through ``RankPins``, unrecorded; the follower's on
    its own cache), then rank 0 frees x (aborted: pending until its unpin) and y."""
    group, runner, mirror = _pair(tmp_path, model)
    cache = runner.cache
    x, y = cache.open_row("x"), cache.open_row("y")
    cache.extend(x, 8)
    cache.extend(y, 4)
    runner.lockstep.send("idle")
    mirror.apply(group.steps[-1])
    pins = (RankPins(cache).pin(x, 0, 8, reason="receive"),
            mirror.cache.pin(mirror.kv.rows["x"], 0, 8, reason="receive"))
    cache.free_kv_row(x, [(0, 8)], reason="aborted")
    cache.close_row(x)
    cache.free_kv_row(y, [(0, 4)], reason="finished")
    cache.close_row(y)
    return group, runner, mirror, pins


def test_a_follower_whose_transport_lets_go_first_takes_rank_0s_pages(tmp_path, model):
    """The follower's prefill peer acknowledged the abort before rank 0's did: its pool
    freed x's pages in another order than rank 0's. It still takes the page rank 0 picks
    for the next row (page 3, free on both ranks), where choosing by its own free list
    (page 2) would have lost the group; both logs replay clean."""
    group, runner, mirror, (pin0, pin1) = _aborted_mid_transfer(tmp_path, model)
    mirror.apply(_send(runner, group))
    mirror.cache.unpin(pin1)      # this rank's transfer ended first: pages 1-2 free here
    z = runner.cache.open_row("z")
    runner.cache.extend(z, 4)
    assert runner.cache.pages(z, 0, 4).tolist() == [3]
    mirror.apply(_send(runner, group))
    assert mirror.cache.pages(mirror.kv.rows["z"], 0, 4).tolist() == [3]
    RankPins(runner.cache).unpin(pin0)  # rank 0's ends later: its pages 1-2 free too
    runner.cache.free_kv_row(z, [(0, 4)], reason="finished")
    runner.cache.close_row(z)
    runner.cache.close()
    runner.lockstep.send("stop")
    assert not mirror.apply(group.steps[-1]) and mirror.closed
    for log in ("r0.freelog", "r1.freelog"):
        report = replay_file(tmp_path / log)
        assert report.ok and not report.warnings, report.format()


def test_rank_0_reusing_a_page_this_ranks_transport_still_pins_loses_the_group(
        tmp_path, model):
    """Rank 0's peer acknowledged the abort first and rank 0 hands x's pages to a new
    row while the follower's own receive still pins it (its peer may still write there):
    only the follower's own page states know, and the group is lost before any pass
    writes into that page. The follower then gives back what it holds; its log, with
    its transport's pin, replays clean."""
    group, runner, mirror, (pin0, pin1) = _aborted_mid_transfer(tmp_path, model)
    RankPins(runner.cache).unpin(pin0)
    z = runner.cache.open_row("z")
    runner.cache.extend(z, 12)
    assert runner.cache.pages(z, 0, 12).tolist() == [1, 2, 3]
    with pytest.raises(GroupLost, match=r"z: rank 0 allocated pages \[1, 2, 3\].*page 1 is "
                                        r"pinned here"):
        mirror.apply(_send(runner, group))
    mirror.cache.unpin(pin1)  # what closing its transport does
    mirror.abandon()
    report = replay_file(tmp_path / "r1.freelog")
    assert report.ok and not report.warnings, report.format()


def _send(runner: LeaderRunner, group: Recording) -> bytes:
    runner.lockstep.send("idle")
    return group.steps[-1]
