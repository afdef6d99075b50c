"""Decode-side host connector stories: offload while decoding, holding the final free until
copies end, aborts in flight, prefix loads at admission, retraction and resume.

float64 tiny model on CPU, exact page ids; both free logs (device ``full``, host ``host``)
replay clean at the end of every story.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common import KvCache
from common.freelog import FreeLogReader, replay_file
from common.host import HostTier, Offloader
from common.model import BatchItem, ModelRunner, generate_greedy
from common.node import PrefixReuse
from common.request import Request, SamplingParams
from decode_node.batch import DecodeBatch, finish_ranges, greedy_step
from decode_node.host_connector import HostConnector
from decode_node.speculative import SpeculativeStep
from tests.model_helpers import F64, prompt
from tests.test_offload import ManualEngine

LAYOUT = F64.kv_layout(with_draft=True)


class Node:
    """A decode node in miniature with a host tier; ``engine`` decides when copies end."""

    def __init__(self, model, tmp_path, page_size: int, *, num_pages: int = 40,
                 host_pages: int = 40, engine=None, k: int = 0):
        self.device_log, self.host_log = tmp_path / "device.pdkvlog", tmp_path / "host.pdkvlog"
        self.cache = KvCache(num_pages, page_size, layout=LAYOUT, log_path=self.device_log,
                             node="decode")
        self.host = HostTier(host_pages, page_size, LAYOUT, log_path=self.host_log,
                             node="decode")
        off = Offloader(self.cache, self.host, engine=engine)
        self.conn = HostConnector(off, b"tiny")
        self.reuse = PrefixReuse(off, b"tiny", timeout_s=5)
        self.runner = ModelRunner(model, self.cache)
        self.batch = DecodeBatch(self.runner, SpeculativeStep(k) if k else greedy_step,
                                 on_commit=self.conn.on_commit)
        self.outputs: dict[str, list[int]] = {}
        self.reqs: dict[str, Request] = {}

    def admit(self, rid: str, tokens: list[int], max_new: int, *, load: bool = True
              ) -> Request:
        """Admission with a prefix load, then the 'transfer' (here: computed) of the rest."""
        req = Request(rid, tokens, SamplingParams(max_new_tokens=max_new))
        kv = req.kv = self.cache.open_row(rid)
        self.cache.extend(kv, len(tokens))
        start = self.reuse.load_request(req, commit=False) if load else 0
        item = BatchItem(kv, tokens[start:], start)
        req.output.append(int(self.runner.forward([item])[0].argmax()))
        self.runner.forward([item], draft=True)
        self.cache.commit(kv, len(tokens))
        self.reqs[rid] = req
        assert self.batch.add(req)
        self.conn.track(req)
        return req

    def step(self) -> list[str]:
        """One batch step; returns rids the connector took over (their copies in flight)."""
        _, finished = self.batch.step()
        held = []
        for s in finished:
            self.outputs[s.rid] = s.output
            ranges = finish_ranges(s.kv, self.cache.page_size)
            if self.conn.request_finished(s, ranges):
                held.append(s.rid)
            else:
                self.cache.free_kv_row(s.kv, ranges, reason="finished")
                self.cache.close_row(s.kv)
        self.cache.check_integrity()
        return held

    def drain(self) -> None:
        while len(self.batch):
            self.step()
        while self.conn.num_held:
            self.conn.reap(timeout=5)

    def close_and_replay(self) -> tuple:
        assert self.conn.offloader.close(timeout=5)
        assert self.conn.num_held == 0 and not self.conn.reap()
        self.conn.check_integrity()
        self.cache.check_integrity()
        assert self.cache.num_free_pages() == self.cache.num_pages - 1
        self.cache.close()
        self.host.close()
        reports = replay_file(self.device_log), replay_file(self.host_log)
        for report in reports:
            assert report.ok, report.format()
        return reports


class SwitchEngine(ManualEngine):
    """Holds copies like ``ManualEngine`` until ``auto`` is set; then runs them at once."""

    auto = False

    def submit(self, src, src_pages, dst, dst_pages):
        job = super().submit(src, src_pages, dst, dst_pages)
        if self.auto:
            self.run_all()
        return job


def frees(log_path, reason: str) -> list[list[int]]:
    return [np.frombuffer(ev["pages"], "<i4").tolist()
            for ev in FreeLogReader(log_path).records
            if ev.get("op") == "free" and ev.get("reason") == reason]


def test_pages_go_to_the_host_as_they_fill_and_the_final_free_waits(model, tmp_path):
    engine = ManualEngine()
    n = Node(model, tmp_path, 4, engine=engine)
    p = prompt(10, seed=1)
    s = n.admit("a", p, 6)
    assert n.cache.pages(s.kv, 0, 10).tolist() == [1, 2, 3]
    assert n.conn.offloader.pending("a") == 1  # pages 1, 2 (prompt); page 3 is partial
    n.step()  # committed 11
    n.step()  # committed 12: page 3 is full
    assert n.conn.offloader.pending("a") == 2
    assert n.step() == [] and n.step() == [] and n.step() == ["a"]  # finished, held
    assert n.conn.reap() == [] and n.cache.owners_holding_pages() == {"a": 4}
    engine.run_all()
    assert [r.rid for r in n.conn.reap()] == ["a"]
    assert n.outputs["a"] == generate_greedy(model, [p], 6)[0]
    assert torch.equal(n.host.data[1:4], n.cache.data()[1:4])  # pages 1..3, exactly
    n.close_and_replay()
    assert frees(n.device_log, "finished") == [[1, 2, 3, 4]]


def test_abort_with_copies_in_flight_frees_at_once_and_pins_hold_the_pages(model, tmp_path):
    engine = ManualEngine()
    n = Node(model, tmp_path, 4, num_pages=8, engine=engine)  # 7 usable device pages
    s = n.admit("a", prompt(13, seed=2), 8)
    assert n.conn.offloader.pending("a") == 1  # pages 1..3 in flight
    n.batch.remove("a")
    n.conn.request_aborted(s)
    n.cache.free_kv_row(s.kv, finish_ranges(s.kv, 4), reason="aborted")
    n.cache.close_row(s.kv)
    assert n.cache.num_free_pages() == 4  # 3 never used + page 4; 1..3 pinned by the copy
    b = n.cache.open_row("b")
    n.cache.extend(b, 12)
    assert n.cache.pages(b, 0, 12).tolist() == [4, 5, 6]  # never 1..3 while copying
    assert n.cache.num_free_pages() == 1
    engine.run_all()
    n.conn.poll()
    assert n.cache.num_free_pages() == 4  # released at the unpin
    n.cache.free_kv_row(b, [(0, 12)], reason="finished")
    n.cache.close_row(b)
    device, _ = n.close_and_replay()
    assert device.pools["full"]["frees_by_reason"]["aborted"]["pages"] == 4


@pytest.mark.parametrize("page_size", [1, 16])
def test_follow_up_turn_loads_the_shared_prefix_and_matches_the_reference(model, tmp_path,
                                                                          page_size):
    n = Node(model, tmp_path, page_size, num_pages=120 // page_size + 8,
             host_pages=120 // page_size + 8, k=2)
    p1 = prompt(37, seed=3)
    n.admit("turn1", p1, 12)
    n.drain()
    p2 = p1 + n.outputs["turn1"] + prompt(9, seed=4)  # the whole first turn, then more
    expect_hit = min((37 + 11) // page_size, (len(p2) - 1) // page_size) * page_size
    assert n.reuse.lookup(p2) == expect_hit
    n.admit("turn2", p2, 10)
    assert n.reuse.num_hit_pages == expect_hit // page_size
    n.drain()
    assert n.outputs["turn2"] == generate_greedy(model, [p2], 10)[0]
    n.close_and_replay()


@pytest.mark.parametrize("page_size", [1, 2])
def test_a_page_whose_draft_kv_lags_waits_for_the_catch_up(model, tmp_path, page_size):
    """A step that accepts every proposal commits a position the draft never ran; while
    the request decodes, its page is offered only once the next step's catch-up wrote
    that draft KV, so no stored page carries a stale draft entry, and none is written
    while it copies."""
    n = Node(model, tmp_path, page_size, num_pages=80, host_pages=80, k=2)
    s = n.admit("a", prompt(9, seed=5), 40)
    lagged = 0
    while len(n.batch):
        n.step()
        if s.is_done:
            break
        lagged += s.draft_lag and s.kv.committed_len % page_size == 0
        assert s.num_offered_pages * page_size <= s.num_draft_valid, (s.kv, s.draft_lag)
    assert lagged  # the story met the case it is about
    n.drain()
    assert n.outputs["a"] == generate_greedy(model, [prompt(9, seed=5)], 40)[0]
    n.close_and_replay()


def test_retract_frees_the_row_and_resume_continues_exactly(model, tmp_path):
    engine = SwitchEngine()
    n = Node(model, tmp_path, 4, engine=engine, k=2)
    p = prompt(18, seed=5)
    s = n.admit("a", p, 20)
    for _ in range(3):
        n.step()
    n.batch.remove("a")
    committed = s.kv.committed_len
    n.conn.retract(s, finish_ranges(s.kv, 4))
    assert len(s.committed_tokens) == committed and s.kv is None
    assert n.cache.owners_holding_pages() == {}
    pinned = n.cache.num_pages - 1 - n.cache.num_free_pages()
    assert pinned == committed // 4  # full committed pages wait for their copy
    engine.run_all()
    n.conn.poll()
    assert n.cache.num_free_pages() == n.cache.num_pages - 1
    assert n.conn.offloader.prefix.evict(100) == 0  # the retracted chain is referenced
    engine.auto = True  # resume blocks on its load
    n.conn.resume(n.runner, s, timeout=5)
    assert n.conn.offloader.num_loaded_pages == committed // 4
    assert s.kv.committed_len == committed and n.batch.add(s)
    n.drain()
    engine.run_all()
    n.conn.reap()
    assert n.outputs["a"] == generate_greedy(model, [p], 20)[0]
    n.close_and_replay()
    assert frees(n.device_log, "offloaded")


def test_retract_of_an_untracked_sequence_is_refused(model, tmp_path):
    n = Node(model, tmp_path, 4)
    s = n.admit("a", prompt(6, seed=6), 4)
    n.conn.request_aborted(s)
    with pytest.raises(ValueError, match="not tracked"):
        n.conn.retract(s, finish_ranges(s.kv, 4))
    n.drain()
    n.close_and_replay()


def test_copies_are_tracked_per_row_so_a_reused_name_never_waits_for_the_old_one(
        model, tmp_path):
    engine = ManualEngine()
    n = Node(model, tmp_path, 4, engine=engine)
    old = n.admit("a", prompt(13, seed=8), 8)               # pages 1..3 in flight
    n.batch.remove("a")
    n.conn.request_aborted(old)
    n.cache.free_kv_row(old.kv, finish_ranges(old.kv, 4), reason="aborted")
    n.cache.close_row(old.kv)
    old_kv = old.kv
    new = n.admit("a", [5, 6], 2)                            # the same name; no full page
    assert n.conn.offloader.pending(old_kv) == 1 and n.conn.offloader.pending(new.kv) == 0
    assert n.step() == []                                    # finished and freed at once,
    assert n.cache.owners_holding_pages() == {}              # not held for the old copy
    assert n.outputs["a"] == generate_greedy(model, [[5, 6]], 2)[0]
    engine.run_all()
    n.close_and_replay()
