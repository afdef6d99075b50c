"""Stories of the KV memory core, with exact page ids (a fresh pool hands out 1, 2, 3...)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from common import FreeReason, KvCache, KvLayout, OutOfPages, RangeError, ceil_align


def pages(cache: KvCache, kv, start: int, end: int, pool: str = "full") -> list[int]:
    return cache.pages(kv, start, end, pool).tolist()


@pytest.fixture
def cache():
    c = KvCache(32, 4, max_rows=8)
    yield c
    c.check_integrity()


def test_fresh_pool_hands_out_ascending_pages_and_never_page_zero(cache):
    kv = cache.open_row("r1")
    cache.extend(kv, 10)
    assert pages(cache, kv, 0, 10) == [1, 2, 3]
    assert cache.slots(kv, 3, 6).tolist() == [7, 8, 9]  # page 1 slots 4..7, then page 2
    assert cache.num_free_pages() == 31 - 3
    cache.extend(kv, 2)  # fills page 3 (positions 8..11): no new page
    assert pages(cache, kv, 0, 12) == [1, 2, 3]
    cache.extend(kv, 1)
    assert pages(cache, kv, 12, 13) == [4]


def test_touching_ranges_that_split_a_page_free_it_once():
    cache = KvCache(16, 8)
    kv = cache.open_row("r1")
    cache.extend(kv, 24)
    assert pages(cache, kv, 0, 24) == [1, 2, 3]
    cache.free_kv_row(kv, [(8, 9), (9, 24)])
    assert cache.num_free_pages() == 15 - 1
    cache.free_kv_row(kv, [(0, 8)])
    assert cache.num_free_pages() == 15
    cache.check_integrity()


def test_speculative_tail_freed_beside_committed_range(cache):
    kv = cache.open_row("r1")
    cache.extend(kv, 28)
    cache.commit(kv, 10)
    assert pages(cache, kv, 0, 28) == [1, 2, 3, 4, 5, 6, 7]
    committed_end = ceil_align(kv.committed_len, 4)
    assert committed_end == 12
    cache.free_kv_row(kv, [(0, committed_end), (committed_end, kv.allocated_len)])
    assert cache.num_free_pages() == 31
    cache.close_row(kv)


def test_end_mid_page_releases_the_whole_last_page(cache):
    kv = cache.open_row("r1")
    cache.extend(kv, 10)
    cache.free_kv_row(kv, [(8, 10)])
    assert cache.num_free_pages() == 31 - 2
    cache.free_kv_row(kv, [(0, 5)])
    assert cache.num_free_pages() == 31


@pytest.mark.parametrize("ranges", [[], [(4, 4)], [(0, 0), (8, 8)]])
def test_empty_ranges_are_no_ops(cache, ranges):
    kv = cache.open_row("r1")
    cache.extend(kv, 12)
    cache.free_kv_row(kv, ranges)
    assert cache.num_free_pages() == 31 - 3


@pytest.mark.parametrize("ranges, words", [
    ([(0, 4), (2, 8)], "(2, 8) overlaps"),
    ([(8, 12), (0, 4)], "(0, 4) overlaps or comes before"),
    ([(8, 4)], "reversed"),
    ([(-4, 4)], "negative"),
    ([(0, 16)], "past allocated_len=12"),
    ([(2, 8)], "starts mid-page"),
    ([(0, 4), (6, 8)], "(6, 8) starts mid-page"),
    ([("a", 4)], "not a (start, end) pair"),
])
def test_bad_ranges_are_rejected_naming_the_range_and_free_nothing(cache, ranges, words):
    kv = cache.open_row("r1")
    cache.extend(kv, 12)
    with pytest.raises(RangeError, match=words.replace("(", r"\(").replace(")", r"\)")):
        cache.free_kv_row(kv, ranges)
    assert cache.num_free_pages() == 31 - 3


def test_non_touching_ranges_sharing_a_page_are_rejected_with_nothing_freed():
    cache = KvCache(16, 8)
    kv = cache.open_row("r1")
    cache.extend(kv, 24)
    # (0, 5) ends inside page 1 and the next range starts in page 1 too: only an aligned
    # start can follow, so sharing always shows as a mid-page start.
    with pytest.raises(RangeError, match=r"\(5, 16\)|\(6, 16\)"):
        cache.free_kv_row(kv, [(0, 4), (6, 16)])
    assert cache.num_free_pages() == 15 - 3


def test_double_free_is_rejected_and_frees_nothing_of_the_call(cache):
    kv = cache.open_row("r1")
    cache.extend(kv, 16)  # pages 1..4
    cache.free_kv_row(kv, [(4, 8)])  # page 2
    message = r"range \(0, 12\) .* covers page 2 .*no longer holds: a double free"
    with pytest.raises(RangeError, match=message):
        cache.free_kv_row(kv, [(0, 12)])
    assert cache.num_free_pages() == 31 - 3
    cache.free_kv_row(kv, [(0, 4), (8, 16)])
    assert cache.num_free_pages() == 31


def test_double_free_is_caught_even_after_the_page_came_back_to_the_same_row(cache):
    kv = cache.open_row("r1")
    cache.extend(kv, 4)  # page 1
    cache.free_kv_row(kv, [(0, 4)], reason="trimmed")
    cache.extend(kv, 4)  # positions 4..7 get page 1 again (last freed, first reused)
    assert pages(cache, kv, 0, 8) == [1, 1]  # position 0..3 still shows the stale id
    with pytest.raises(RangeError, match=r"range \(0, 4\) .* covers page 1 .*row page 0"):
        cache.free_kv_row(kv, [(0, 4)])
    cache.free_kv_row(kv, [(4, 8)])
    assert cache.num_free_pages() == 31


def test_a_free_without_a_known_reason_is_refused_and_frees_nothing(tmp_path):
    cache = KvCache(16, 4, log_path=tmp_path / "r.log", node="t")
    kv = cache.open_row("r1")
    cache.extend(kv, 8)
    with pytest.raises(ValueError, match=r"free reason 'done' is not one of \['finished'"):
        cache.free_kv_row(kv, [(0, 8)], reason="done")
    with pytest.raises(ValueError, match="free reason"):
        cache.free_pages("r1", np.array([1], dtype=np.int32), reason="oops")
    assert cache.num_free_pages() == 15 - 2
    cache.free_kv_row(kv, [(0, 8)], reason=FreeReason.SPEC_REJECT)
    cache.close_row(kv)
    cache.close()
    with open(tmp_path / "r.log", "rb") as f:
        frees = [e for e in msgpack.Unpacker(f, raw=False) if e.get("op") == "free"]
    assert [e["reason"] for e in frees] == ["spec_reject"]


def test_an_end_reason_maps_to_one_free_reason():
    assert FreeReason.of_end("stop") is FreeReason.of_end("length") is FreeReason.FINISHED
    assert FreeReason.of_end("peer_lost") is FreeReason.PEER_LOST
    assert FreeReason.of_end("bad_range") is FreeReason.ERROR   # a transport error code


def test_pinned_pages_are_deferred_until_the_last_unpin(cache):
    kv = cache.open_row("r1")
    cache.extend(kv, 16)  # pages 1..4
    send = cache.pin(kv, 0, 8, reason="send")  # pages 1, 2
    offload = cache.pin(kv, 4, 12, reason="offload")  # pages 2, 3
    cache.free_kv_row(kv, [(0, 16)], reason="aborted")
    assert cache.num_free_pages() == 31 - 3  # page 4 is back, 1..3 pending
    cache.check_integrity()
    other = cache.open_row("r2")
    cache.extend(other, 4 * 28)  # every free page: never a pending one
    assert not set(pages(cache, other, 0, 112)) & {1, 2, 3}
    cache.free_kv_row(other, [(0, 112)])
    cache.unpin(send)
    assert cache.num_free_pages() == 31 - 2  # page 1 released, page 2 still pinned
    cache.unpin(offload)
    assert cache.num_free_pages() == 31
    with pytest.raises(ValueError, match="no such pin"):
        cache.unpin(offload)


def test_pinning_a_free_page_is_refused(cache):
    with pytest.raises(ValueError, match="cannot pin page 5"):
        cache.pin_pages(np.array([5]), reason="send")


def test_out_of_pages_and_row_length_change_nothing():
    cache = KvCache(5, 4, max_row_len=20)
    kv = cache.open_row("r1")
    cache.extend(kv, 10)
    with pytest.raises(OutOfPages, match="needs 2 pages of pool 'full', 1 free"):
        cache.extend(kv, 8)
    with pytest.raises(ValueError, match="max_row_len=20"):
        cache.extend(kv, 11)
    assert kv.allocated_len == 10 and cache.num_free_pages() == 1
    cache.check_integrity()


def test_commit_never_passes_allocated_len(cache):
    kv = cache.open_row("r1")
    cache.extend(kv, 5)
    cache.commit(kv, 5)
    with pytest.raises(ValueError, match="allocated_len=5"):
        cache.commit(kv, 1)


def test_close_row_refuses_a_row_that_still_holds_pages(cache):
    kv = cache.open_row("r1")
    cache.extend(kv, 8)
    with pytest.raises(ValueError, match="still holds 2 pages"):
        cache.close_row(kv)
    cache.free_kv_row(kv, [(0, 8)])
    cache.close_row(kv)
    with pytest.raises(ValueError, match="not open"):
        cache.extend(kv, 1)


def test_sliding_window_floor_splits_the_free_between_pools():
    cache = KvCache(32, 4, swa_num_pages=16)
    kv = cache.open_row("r1")
    cache.extend(kv, 24)
    assert pages(cache, kv, 0, 24) == [1, 2, 3, 4, 5, 6]
    assert pages(cache, kv, 0, 24, "swa") == [1, 2, 3, 4, 5, 6]
    cache.evict_window(kv, 10)  # pages below position 8 leave the window
    assert kv.swa_evicted_seqlen == 8
    assert cache.num_free_pages("swa") == 15 - 4
    assert pages(cache, kv, 0, 24, "swa") == [0, 0, 3, 4, 5, 6]
    cache.free_kv_row(kv, [(0, 8)])  # dead part: full pool only
    assert (cache.num_free_pages(), cache.num_free_pages("swa")) == (31 - 4, 15 - 4)
    cache.free_kv_row(kv, [(8, 24)])  # live part: both pools
    assert (cache.num_free_pages(), cache.num_free_pages("swa")) == (31, 15)
    cache.check_integrity()


def test_sliding_window_free_straddling_the_floor_returns_each_page_once():
    cache = KvCache(32, 4, swa_num_pages=16)
    kv = cache.open_row("r1")
    cache.extend(kv, 16)
    cache.evict_window(kv, 8)
    cache.free_kv_row(kv, [(0, 16)])
    assert (cache.num_free_pages(), cache.num_free_pages("swa")) == (31, 15)
    cache.check_integrity()


def test_swa_pool_shortage_changes_nothing():
    cache = KvCache(32, 4, swa_num_pages=3)
    kv = cache.open_row("r1")
    with pytest.raises(OutOfPages, match="pool 'swa', 2 free"):
        cache.extend(kv, 12)
    assert kv.allocated_len == 0 and cache.num_free_pages() == 31


def test_handoff_protects_the_prefix_from_the_request(cache):
    kv = cache.open_row("r1")
    cache.extend(kv, 12)
    cache.handoff(kv, 8, "cache:prefix")
    assert kv.protected_len == 8
    with pytest.raises(RangeError, match="protected prefix"):
        cache.free_kv_row(kv, [(0, 12)])
    cache.free_kv_row(kv, [(8, 12)])
    cache.close_row(kv)
    assert cache.owners_holding_pages() == {"cache:prefix": 2}
    cache.free_pages("cache:prefix", np.array([1, 2]), reason="evicted")
    assert cache.num_free_pages() == 31


def test_pool_tensor_has_the_documented_page_major_shape():
    layout = KvLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype="float16",
                      num_draft_layers=1)
    cache = KvCache(8, 16, layout=layout)
    assert cache.data().shape == (8, 4, 2, 16, 2, 4)
    assert cache.data().dtype == torch.float16
    assert layout.page_bytes(16) == 4 * 2 * 16 * 2 * 4 * 2


def test_constructor_rejects_nonsense_sizes():
    with pytest.raises(ValueError, match="page_size=0"):
        KvCache(8, 0)
    with pytest.raises(ValueError, match="num_pages=1"):
        KvCache(1, 4)
    with pytest.raises(ValueError, match="dtype='int8'"):
        KvLayout(dtype="int8")


def test_recorded_events_tell_each_page_journey(tmp_path):
    log = tmp_path / "node.pdkvlog"
    cache = KvCache(8, 4, log_path=log, node="prefill-0")
    kv = cache.open_row("r1")
    cache.extend(kv, 6)
    pin = cache.pin(kv, 0, 6, reason="send")
    cache.free_kv_row(kv, [(0, 6)], reason="sent")
    cache.unpin(pin)
    cache.close_row(kv)
    cache.close()
    header, *events = msgpack.Unpacker(open(log, "rb"), raw=False)
    assert header["format"] == "pdkv-freelog" and header["version"] == 1
    assert header["node"] == "prefill-0"
    assert header["pools"] == {"full": {"num_pages": 8, "page_size": 4, "reserved": [0]}}
    summary = [(e["seq"], e["op"], np.frombuffer(e["pages"], "<i4").tolist(),
                e.get("owner"), e.get("reason")) for e in events]
    assert summary == [
        (0, "alloc", [1, 2], "r1", None),
        (1, "pin", [1, 2], None, "send"),
        (2, "free", [1, 2], "r1", "sent"),
        (3, "unpin", [1, 2], None, None),
        (4, "release", [1, 2], None, None),
        (5, "close", [], None, None),
    ]
    assert events[2]["ranges"] == [[0, 6]]
    assert events[5]["retained"] == []


def test_shared_memory_pool_is_visible_to_a_process_that_maps_it():
    import subprocess
    import sys

    cache = KvCache(4, 2, shared_memory=True, layout=KvLayout(head_dim=4))
    name = cache.shared_memory_name()
    assert name and cache.shared_memory_name("full") == name
    token = cache.shared_memory_token()
    code = ("import torch; from common.kv import SharedTensor; "
            f"t = SharedTensor((4, 1, 2, 2, 1, 4), torch.float32, name={name!r}, "
            f"token={token!r}); t.tensor[3].fill_(7.0); t.close()")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert torch.all(cache.data()[3] == 7.0) and torch.all(cache.data()[:3] == 0)
    cache.close()
    with pytest.raises(FileNotFoundError):
        from common.kv import SharedTensor

        SharedTensor((1,), torch.float32, name=name, token=token)


def test_extend_with_given_pages_takes_exactly_those_or_changes_nothing(tmp_path):
    """A tensor-parallel follower takes the page ids rank 0 chose (``extend(..., pages)``):
    free ones in any order of its free list; a page owned here, pinned here (freed but its
    pin still held) or listed twice is refused, named, and nothing changes."""
    from common.freelog import replay_file

    cache = KvCache(16, 4, log_path=tmp_path / "f.freelog")
    a, b = cache.open_row("a"), cache.open_row("b")
    cache.extend(a, 6, np.array([5, 2], np.int32))  # not what the free list would hand out
    assert pages(cache, a, 0, 6) == [5, 2]
    cache.extend(a, 2, np.empty(0, np.int32))       # page 2 has room: no new page
    cache.extend(b, 4)
    assert pages(cache, b, 0, 4) == [1]             # the free list skipped the taken pages
    pin = cache.pin(a, 0, 4, reason="receive")
    cache.free_kv_row(a, [(0, 8)], reason="aborted")  # page 5 pending until the unpin
    before = cache.num_free_pages()
    c = cache.open_row("c")
    for given, why in (([5], "page 5 is pinned here"), ([1], "page 1 is owned by 'b'"),
                       ([3, 3], "listed twice"), ([0], "page 0 is reserved"),
                       ([20], "outside the pool")):
        with pytest.raises(ValueError, match=why):
            cache.extend(c, 4 * len(given), np.array(given, np.int32))
        assert c.allocated_len == 0 and cache.num_free_pages() == before
    with pytest.raises(ValueError, match="2 page ids given for 1 new pages"):
        cache.extend(c, 4, np.array([3, 4], np.int32))
    cache.unpin(pin)
    cache.extend(c, 4, np.array([5], np.int32))    # back on the free list: taken
    for kv, end in ((b, 4), (c, 4)):
        cache.free_kv_row(kv, [(0, end)], reason="finished")
        cache.close_row(kv)
    cache.close_row(a)
    cache.check_integrity()
    cache.close()
    report = replay_file(tmp_path / "f.freelog")
    assert report.ok and not report.warnings, report.format()
