"""Host tier stories: its own pool and log, and coalesced page copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common import KvLayout
from common.freelog import replay_file
from common.host import CACHE_OWNER, CopyEngine, HostTier
from common.kv import copy_pages, page_runs


def test_host_pool_has_its_own_allocator_log_and_page_layout(tmp_path):
    layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, num_draft_layers=1)
    host = HostTier(5, 16, layout, log_path=tmp_path / "host.pdkvlog")
    assert host.data.shape == (5, 3, 2, 16, 2, 4)
    assert not host.pinned  # pinned memory only for a CUDA device pool
    assert host.allocate(3).tolist() == [1, 2, 3]
    assert host.allocate(2) is None  # one page left: "not now", nothing changed
    assert host.num_free == 1
    with pytest.raises(ValueError, match="cannot free host page 1"):
        host.free(np.array([1]), "cache:other", "evicted")
    pin = host.pin(np.array([2]), "load")
    host.free(np.array([1, 2]), CACHE_OWNER, "evicted")
    assert host.num_free == 2  # page 2 waits for its pin
    host.unpin(pin)
    assert host.num_free == 3
    host.check_integrity()
    host.close()
    report = replay_file(tmp_path / "host.pdkvlog")
    assert report.ok, report.format()
    assert list(report.pools) == ["host"]
    assert report.pools["host"]["frees_by_reason"]["evicted"]["pages"] == 2


def test_page_runs_coalesce_pages_consecutive_on_both_sides():
    assert page_runs(np.array([1, 2, 3, 7, 8, 9]), np.array([4, 5, 6, 1, 2, 8])) == [
        (1, 4, 3), (7, 1, 2), (9, 8, 1)]
    assert page_runs(np.array([], dtype=np.int32), np.array([], dtype=np.int32)) == []


@pytest.mark.parametrize("dtype, page_size", [(torch.float16, 16), (torch.float16, 1),
                                              (torch.float32, 3)])
def test_copy_pages_is_byte_exact_for_runs_and_scattered_pages(dtype, page_size):
    gen = torch.Generator().manual_seed(0)
    src = torch.randn((40, 2, 2, page_size, 1, 3), generator=gen).to(dtype)
    dst = torch.zeros_like(src)
    rng = np.random.default_rng(1)
    src_pages, dst_pages = rng.permutation(39)[:20] + 1, rng.permutation(39)[:20] + 1
    copy_pages(src, src_pages, dst, dst_pages)  # scattered: the gather path
    assert torch.equal(dst[dst_pages], src[src_pages])
    copy_pages(src, np.arange(1, 11), dst, np.arange(21, 31))  # one run: one slice
    assert torch.equal(dst[21:31], src[1:11])


def test_copy_engine_runs_jobs_in_order_and_reports_errors():
    engine = CopyEngine("cpu")
    src, dst = torch.arange(8.0).view(8, 1), torch.zeros(8, 1)
    first = engine.submit(src, np.array([1, 2]), dst, np.array([3, 4]))
    bad = engine.submit(src, np.array([1]), dst, np.array([99]))
    last = engine.submit(dst, np.array([3]), dst, np.array([5]))
    assert last.wait(5) and first.done() and bad.done()
    assert first.error is None and last.error is None
    assert isinstance(bad.error, IndexError)
    assert dst.view(-1).tolist() == [0, 0, 0, 1, 2, 1, 0, 0]
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(src, np.array([1]), dst, np.array([1]))


def test_copy_pages_copies_scattered_large_pages_slice_by_slice():
    src = torch.randn((6, 64, 256))  # 64 KiB pages: one slice copy per page beats a gather
    dst = torch.zeros_like(src)
    copy_pages(src, np.array([5, 1, 3]), dst, np.array([2, 4, 1]))
    assert torch.equal(dst[[2, 4, 1]], src[[5, 1, 3]]) and not dst[[0, 3, 5]].any()


def test_copy_pages_gathers_scattered_pages_into_a_contiguous_destination():
    src = torch.randn((20, 2, 8, 4))
    dst = torch.zeros_like(src)
    src_pages = np.array([17, 3, 9, 1, 12, 5, 6, 2])
    copy_pages(src, src_pages, dst, np.arange(10, 18))
    assert torch.equal(dst[10:18], src[src_pages]) and not dst[:10].any()
