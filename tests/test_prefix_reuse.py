"""Prefix reuse (``common.host.PrefixReuse``): loaded KV equals computed KV, a hit changes
no logits, and a load past its deadline frees the row and turns reuse off.

float64 tiny model with draft layers; chunked prefill starts at ``num_computed``, after
the loaded prefix; both free logs replay clean.
"""

from __future__ import annotations

import pytest
import torch

from common import KvCache
from common.freelog import replay_file
from common.host import HostTier, Offloader
from common.model import BatchItem, ModelRunner
from common.node import PrefillEngine, PrefixReuse
from common.request import Request, SamplingParams
from tests.model_helpers import F64, prompt

LAYOUT = F64.kv_layout(with_draft=True)


class Prefill:
    """A prefill node in miniature: engine (chunk 16, with draft), host tier, reuse."""

    def __init__(self, model, tmp_path, page_size: int, num_pages: int = 64):
        self.device_log, self.host_log = tmp_path / "device.pdkvlog", tmp_path / "host.pdkvlog"
        self.cache = KvCache(num_pages, page_size, layout=LAYOUT, log_path=self.device_log,
                             node="prefill")
        self.host = HostTier(num_pages, page_size, LAYOUT, log_path=self.host_log,
                             node="prefill")
        self.reuse = PrefixReuse(Offloader(self.cache, self.host), b"tiny")
        self.engine = PrefillEngine(ModelRunner(model, self.cache), 16, 64, with_draft=True)

    def prefill(self, rid: str, tokens: list[int], *, reuse: bool = True):
        """Returns (row, start, first-token logits-free token)."""
        kv = self.cache.open_row(rid)
        self.cache.extend(kv, len(tokens))
        start = self.reuse.load(kv, tokens, timeout=5) if reuse else 0
        req = Request(rid, tokens, SamplingParams(), kv=kv, num_computed=start)
        self.engine.add(req)
        while self.engine.has_work:
            self.engine.step()
        return kv, start, req.output[0]

    def send_and_free(self, kv, tokens: list[int]) -> None:
        """What the worker does after the send: offload, then free at once."""
        self.reuse.offload_sent(kv, tokens)
        self.cache.free_kv_row(kv, [(0, kv.allocated_len)], reason="finished")
        self.cache.close_row(kv)

    def close_and_replay(self) -> None:
        assert self.reuse.offloader.close(timeout=5)
        self.reuse.offloader.check_integrity()
        self.cache.check_integrity()
        assert self.cache.num_free_pages() == self.cache.num_pages - 1
        self.cache.close()
        self.host.close()
        for log in (self.device_log, self.host_log):
            report = replay_file(log)
            assert report.ok, report.format()


def row_kv(cache: KvCache, kv, end: int) -> torch.Tensor:
    """KV of positions [0, end), all layers (draft included): [end, layers, 2, heads, dim]."""
    slots = cache.slots(kv, 0, end)
    ps = cache.page_size
    return cache.data()[slots // ps, :, :, slots % ps].clone()


@pytest.mark.parametrize("page_size", [1, 16])
def test_loaded_prefix_is_byte_exact_and_the_rest_matches_a_full_prefill(model, tmp_path,
                                                                         page_size):
    p = Prefill(model, tmp_path, page_size, num_pages=200 // page_size + 8)
    shared = prompt(40, seed=1)
    a, start_a, _ = p.prefill("a", shared + [3])
    computed = row_kv(p.cache, a, 40)
    assert start_a == 0
    p.send_and_free(a, shared + [3])
    assert p.reuse.offloader.wait(timeout=5)
    follow = shared + prompt(17, seed=2)
    b, start, first = p.prefill("b", follow)
    assert start == 40 // page_size * page_size and p.reuse.num_hit_pages == start // page_size
    assert torch.equal(row_kv(p.cache, b, start), computed[:start])  # byte-exact, both models
    c, start_c, first_full = p.prefill("c", follow, reuse=False)
    assert start_c == 0 and first == first_full
    # Logits of every prompt position after the hit equal a full prefill's.
    runner = p.engine.runner
    hit = runner.forward_all([BatchItem(b, follow[start:], start)])[0]
    full = runner.forward_all([BatchItem(c, follow, 0)])[0][start:]
    torch.testing.assert_close(hit, full, rtol=0, atol=1e-10)
    assert hit.argmax(-1).tolist() == full.argmax(-1).tolist()
    torch.testing.assert_close(row_kv(p.cache, b, len(follow)), row_kv(p.cache, c, len(follow)),
                               rtol=0, atol=1e-10)
    for kv in (b, c):
        p.send_and_free(kv, follow)
    p.close_and_replay()


def test_a_fully_cached_prompt_still_computes_its_last_page(model, tmp_path):
    p = Prefill(model, tmp_path, 4)
    tokens = prompt(16, seed=3)
    a, _, first_a = p.prefill("a", tokens)
    p.send_and_free(a, tokens)
    assert p.reuse.offloader.wait(timeout=5)
    assert p.reuse.lookup(tokens) == 12  # 4 pages cached, one page left to compute
    b, start, first_b = p.prefill("b", tokens)
    assert start == 12 and first_b == first_a
    assert not p.reuse.offload_sent(b, tokens)  # every page already cached
    p.cache.free_kv_row(b, [(0, 16)], reason="finished")
    p.cache.close_row(b)
    assert p.reuse.lookup(prompt(16, seed=4)) == 0
    p.close_and_replay()


def test_free_right_after_offload_waits_for_the_copy_via_pins(model, tmp_path):
    p = Prefill(model, tmp_path, 4, num_pages=16)
    tokens = prompt(30, seed=5)
    a, _, _ = p.prefill("a", tokens)
    p.send_and_free(a, tokens)  # freed at once; pages 1..7 pinned until the copy ends
    assert p.reuse.offloader.wait(timeout=5)
    assert p.cache.num_free_pages() == 15 and p.reuse.lookup(tokens) == 28
    p.close_and_replay()
