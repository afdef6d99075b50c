"""Offload stories with exact page ids: device rows to the host tier and prefixes back.

Every story records both free logs (device pool ``full``, host pool ``host``) and checks
that they replay clean, aborts while copies are in flight included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common import KvCache, KvLayout
from common.freelog import FreeLogReader, replay_file
from common.host import CopyEngine, CopyJob, HashChain, HostTier, Offloader
from common.kv import copy_pages

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16",
                  num_draft_layers=1)


class ManualEngine(CopyEngine):
    """Holds every copy in flight until ``run_all()``; ``fail`` makes the copies fail."""

    def __init__(self, fail: bool = False):
        self.device = torch.device("cpu")
        self.fail = fail
        self._held: list[tuple] = []

    def submit(self, src, src_pages, dst, dst_pages) -> CopyJob:
        job = CopyJob()
        self._held.append((job, src, src_pages, dst, dst_pages))
        return job

    def run_all(self) -> None:
        for job, *args in self._held:
            if self.fail:
                job.set_done(OSError("injected copy failure"))
            else:
                copy_pages(*args)
                job.set_done()
        self._held.clear()

    def close(self) -> None:
        self.run_all()


class Setup:
    """A device cache, a host tier and an offloader, each recording its free log."""

    def __init__(self, tmp_path, page_size: int, num_pages: int = 16,
                 host_pages: int = 16, engine: CopyEngine | None = None):
        self.device_log, self.host_log = tmp_path / "device.pdkvlog", tmp_path / "host.pdkvlog"
        self.cache = KvCache(num_pages, page_size, layout=LAYOUT, log_path=self.device_log)
        self.host = HostTier(host_pages, page_size, LAYOUT, log_path=self.host_log)
        self.off = Offloader(self.cache, self.host, engine=engine)
        self.page_size = page_size

    def request(self, rid: str, tokens: list[int], allocated: int, committed: int):
        """A row with random KV in its pages and the chain of its tokens."""
        kv = self.cache.open_row(rid)
        self.cache.extend(kv, allocated)
        self.cache.commit(kv, committed)
        pages = self.cache.pages(kv, 0, allocated)
        self.cache.data()[pages] = torch.randn(
            (len(pages), *LAYOUT.page_shape(self.page_size))).to(LAYOUT.torch_dtype)
        return kv, HashChain(self.page_size, tokens=tokens)

    def finish(self, kv, reason: str = "finished") -> None:
        self.cache.free_kv_row(kv, [(0, kv.allocated_len)], reason=reason)
        self.cache.close_row(kv)

    def close_and_replay(self) -> tuple:
        assert self.off.close(timeout=5)
        self.off.check_integrity()
        self.cache.check_integrity()
        self.cache.close()
        self.host.close()
        reports = replay_file(self.device_log), replay_file(self.host_log)
        for report in reports:
            assert report.ok, report.format()
        return reports


def host_frees(log_path, reason: str) -> list[list[int]]:
    return [np.frombuffer(ev["pages"], "<i4").tolist()
            for ev in FreeLogReader(log_path).records
            if ev.get("op") == "free" and ev.get("reason") == reason]


def test_offload_at_page_size_16_copies_committed_full_pages_only(tmp_path):
    s = Setup(tmp_path, 16)
    # 50 committed tokens, 4 lookahead slots; 51 tokens (the newest one has no KV yet).
    kv, chain = s.request("r1", list(range(51)), allocated=54, committed=50)
    assert s.cache.pages(kv, 0, 54).tolist() == [1, 2, 3, 4]
    h = s.off.prepare_store(kv, chain)
    assert (h.first_page, h.device_pages.tolist(), h.host_pages.tolist()) == (0, [1, 2, 3],
                                                                             [1, 2, 3])
    assert s.off.pending(kv) == 1
    assert s.off.complete_store(h, timeout=5) and s.off.pending(kv) == 0
    assert torch.equal(s.host.data[1:4], s.cache.data()[1:4])
    assert s.off.prepare_store(kv, chain) is None  # all cached; page 4 is not full
    s.cache.commit(kv, 4)  # the lookahead verified: 54 committed, still 3 full pages
    assert s.off.prepare_store(kv, chain) is None
    s.cache.extend(kv, 10)
    s.cache.commit(kv, 10)
    chain.extend(range(51, 65))
    h = s.off.prepare_store(kv, chain)
    assert (h.first_page, h.device_pages.tolist(), h.host_pages.tolist()) == (3, [4], [4])
    assert s.off.wait(kv, timeout=5)
    s.finish(kv)
    assert s.off.num_offloaded_pages == 4
    s.close_and_replay()


def test_offload_at_page_size_1_stops_before_the_newest_token_and_the_tail(tmp_path):
    s = Setup(tmp_path, 1)
    kv, chain = s.request("r1", [7, 8, 9, 10, 11, 12], allocated=9, committed=5)
    h = s.off.prepare_store(kv, chain)
    assert h.device_pages.tolist() == [1, 2, 3, 4, 5]  # not 6 (newest), not 7..9 (tail)
    assert h.host_pages.tolist() == [1, 2, 3, 4, 5]
    assert s.off.wait(kv, timeout=5)
    assert torch.equal(s.host.data[1:6], s.cache.data()[1:6])
    s.finish(kv)
    s.close_and_replay()


def test_prefix_lookup_loads_byte_exact_kv_into_a_fresh_row(tmp_path):
    s = Setup(tmp_path, 4)
    a, a_chain = s.request("a", list(range(100, 110)), allocated=10, committed=10)
    assert s.off.complete_store(s.off.prepare_store(a, a_chain), timeout=5)
    prompt = list(range(100, 108)) + [1, 2, 3, 4, 5]  # shares a's two full pages
    b = s.cache.open_row("b")
    s.cache.extend(b, len(prompt))
    assert s.cache.pages(b, 0, 13).tolist() == [4, 5, 6, 7]
    b_chain = HashChain(4, tokens=prompt)
    assert s.off.lookup(b_chain) == 8
    h = s.off.prepare_load(b, b_chain)
    assert (h.num_tokens, h.host_pages.tolist(), h.device_pages.tolist()) == (8, [1, 2],
                                                                             [4, 5])
    assert s.off.complete_load(h, timeout=5)
    s.cache.commit(b, h.num_tokens)
    assert torch.equal(s.cache.data()[[4, 5]], s.cache.data()[[1, 2]])  # a's KV, exactly
    assert s.off.prepare_load(b, HashChain(4, tokens=[9] * 12)) is None  # a miss
    h = s.off.prepare_load(b, b_chain, max_tokens=7)  # the prefill keeps >= 1 token
    assert h.num_tokens == 4 and s.off.complete_load(h, timeout=5)
    assert s.off.num_loaded_pages == 3
    s.finish(a)
    s.finish(b)
    s.close_and_replay()


def test_full_host_tier_evicts_lru_and_never_a_chain_being_loaded(tmp_path):
    engine = ManualEngine()
    s = Setup(tmp_path, 4, host_pages=5, engine=engine)  # 4 usable host pages
    a, a_chain = s.request("a", [1] * 8, allocated=8, committed=8)
    b, b_chain = s.request("b", [2] * 8, allocated=8, committed=8)
    assert s.off.prepare_store(a, a_chain).host_pages.tolist() == [1, 2]
    assert s.off.prepare_store(b, b_chain).host_pages.tolist() == [3, 4]
    engine.run_all()
    assert s.off.poll() == 2
    c, c_chain = s.request("c", [1] * 8, allocated=8, committed=0)
    load = s.off.prepare_load(c, c_chain)  # a's chain is in use until the load completes
    assert load.host_pages.tolist() == [1, 2]
    d, d_chain = s.request("d", [4] * 12, allocated=12, committed=12)
    h = s.off.prepare_store(d, d_chain)  # 3 pages wanted; only b's 2 may be evicted
    assert (h.device_pages.tolist(), h.host_pages.tolist()) == ([7, 8], [3, 4])
    engine.run_all()
    s.off.poll()
    s.cache.commit(c, 8)
    for kv in (a, b, c, d):
        s.finish(kv)
    s.close_and_replay()
    assert host_frees(s.host_log, "evicted") == [[4, 3]]  # b's leaf first, then its parent


def test_abort_while_offload_in_flight_keeps_pages_pinned_until_the_copy_ends(tmp_path):
    engine = ManualEngine()
    s = Setup(tmp_path, 4, num_pages=8, engine=engine)  # 7 usable device pages
    a, a_chain = s.request("a", list(range(13)), allocated=12, committed=12)
    h = s.off.prepare_store(a, a_chain)
    assert h.device_pages.tolist() == [1, 2, 3]
    s.finish(a, reason="aborted")  # freed at once; the pins hold the pages
    assert s.cache.num_free_pages() == 4 and s.off.pending("a") == 1
    b = s.cache.open_row("b")
    s.cache.extend(b, 16)
    assert s.cache.pages(b, 0, 16).tolist() == [4, 5, 6, 7]  # never 1..3 while copying
    engine.run_all()
    assert s.off.poll() == 1 and s.off.pending("a") == 0
    assert s.cache.num_free_pages() == 3  # released at the unpin
    assert s.off.lookup(a_chain) == 12  # committed KV: the cache keeps it
    s.finish(b)
    device, host = s.close_and_replay()
    assert device.pools["full"]["frees_by_reason"]["aborted"]["pages"] == 3
    assert device.pools["full"]["pages_released"] == 3


def test_abort_while_load_in_flight_leaks_nothing(tmp_path):
    engine = ManualEngine()
    s = Setup(tmp_path, 4, engine=engine)
    a, a_chain = s.request("a", [5] * 8, allocated=8, committed=8)
    s.off.prepare_store(a, a_chain)
    engine.run_all()
    s.off.poll()
    s.finish(a)
    b, b_chain = s.request("b", [5] * 8, allocated=8, committed=0)
    h = s.off.prepare_load(b, b_chain)
    s.finish(b, reason="aborted")
    assert s.off.prefix.evict(10) == 0  # the chain being read is referenced
    engine.run_all()
    assert s.off.complete_load(h) and s.off.prefix.evict(10) == 2
    device, host = s.close_and_replay()
    assert device.pools["full"]["pages_released"] == 2
    assert host.pools["host"]["frees_by_reason"]["evicted"]["pages"] == 2


def test_failed_copy_frees_host_pages_with_reason_error_and_drops_children(tmp_path):
    engine = ManualEngine(fail=True)
    s = Setup(tmp_path, 2, engine=engine)
    a, a_chain = s.request("a", [1, 2, 3, 4], allocated=4, committed=2)
    first = s.off.prepare_store(a, a_chain)
    s.cache.commit(a, 2)
    second = s.off.prepare_store(a, a_chain)  # chained on the first, still in flight
    assert (first.host_pages.tolist(), second.host_pages.tolist()) == ([1], [2])
    engine.run_all()
    assert s.off.poll() == 2 and len(s.off.prefix) == 0
    s.finish(a)
    s.close_and_replay()
    assert host_frees(s.host_log, "error") == [[1], [2]]


def test_wait_holds_the_final_free_until_copies_complete(tmp_path):
    s = Setup(tmp_path, 16, num_pages=64, host_pages=64)
    kv, chain = s.request("r1", list(range(800)), allocated=800, committed=800)
    s.off.prepare_store(kv, chain)
    assert s.off.wait(kv, timeout=10) and s.off.pending(kv) == 0
    s.finish(kv)
    assert torch.equal(s.host.data[1:51], s.cache.data()[1:51])
    s.close_and_replay()


def test_offloader_rejects_mismatched_pools():
    with pytest.raises(ValueError, match="does not match"):
        Offloader(KvCache(8, 4, layout=LAYOUT), HostTier(8, 2, LAYOUT))
    with pytest.raises(ValueError, match="sliding-window"):
        Offloader(KvCache(8, 4, swa_num_pages=8), HostTier(8, 4))
