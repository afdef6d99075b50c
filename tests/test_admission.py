"""Admission as memory allows: a strict FIFO queue over a page reservation ledger."""

from __future__ import annotations

from common import KvCache
from common.request import Request, SamplingParams
from decode_node.admission import Admission
from decode_node.batch import finish_ranges
from tests.model_helpers import F64


def _cache(num_pages: int, page_size: int) -> KvCache:
    return KvCache(num_pages, page_size, layout=F64.kv_layout(False), node="unit",
                   max_rows=32)


def test_a_full_pool_queues_in_fifo_order_and_admits_when_pages_come_back():
    cache = _cache(num_pages=11, page_size=4)     # 10 usable pages = 40 tokens
    adm = Admission(cache, max_running=8)
    params = SamplingParams(max_new_tokens=9)     # rows of prompt + 8 positions
    big, small = Request("big", [1] * 20, params), Request("small", [1] * 4, params)
    first = Request("first", [1] * 12, params)   # needs ceil(20 / 4) = 5 pages
    for item in (first, big, small):
        adm.enqueue(item)
    assert adm.admit_next() is first and first.kv.allocated_len == 12
    assert adm.admit_next() is None               # big needs 7 pages, 10 - 5 reserved
    assert list(adm.queue) == ["big", "small"]    # small does not overtake big
    cache.free_kv_row(first.kv, finish_ranges(first.kv, 4), reason="finished")
    cache.close_row(first.kv)
    first.kv = None
    adm.forget(first)
    assert adm.admit_next() is big              # 7 pages reserved, 5 allocated
    assert adm.admit_next() is small            # 3 pages reserved: the pool is spoken for
    assert cache.num_free_pages() == 4 and adm.num_free_tokens == 0


