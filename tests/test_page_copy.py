"""The one page-run copier (common/kv/page_copy.py): every way it moves pages is byte-exact
against a page-by-page reference, and it refuses page ids outside either pool."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from common.host import CopyEngine
from common.kv import check_pages, copy_pages, copy_threads, page_runs, set_copy_threads
from common.kv.copy_threads import _helpers
from common.kv.page_copy import SPLIT_ABOVE_BYTES, _guided_cuts, _run_cuts, _segments


def _reference(src, src_pages, dst, dst_pages, sh=slice(None), dh=slice(None)):
    want = dst.clone()
    for a, b in zip(src_pages, dst_pages):
        want[b, :, :, :, dh] = src[a, :, :, :, sh]
    return want


def test_runs_are_maximal_on_both_sides_and_cut_to_a_cap():
    src, dst = np.array([3, 4, 5, 9, 12]), np.array([7, 8, 9, 2, 3])
    assert page_runs(src, dst) == [(3, 7, 3), (9, 2, 1), (12, 3, 1)]
    assert page_runs(np.arange(10, 17), max_len=3) == [(10, 10, 3), (13, 13, 3), (16, 16, 1)]
    with pytest.raises(ValueError, match="3 source pages but 2"):
        page_runs(src[:3], dst[:2])


@pytest.mark.parametrize("case", ["dst runs", "src runs", "both scattered"])
def test_scattered_large_pages_are_byte_exact_on_every_path(case):
    page = (2, 2, 16, 4, 128)                         # 64 KiB float32 pages
    src = torch.randn((200, *page))
    dst = torch.zeros_like(src)
    rng = np.random.default_rng(7)
    scattered = rng.permutation(np.arange(1, 200))[:120]
    run = np.arange(60, 180)
    src_pages, dst_pages = {"dst runs": (scattered, run), "src runs": (run, scattered),
                            "both scattered": (scattered, scattered[::-1].copy())}[case]
    want = _reference(src, src_pages, dst, dst_pages)
    assert copy_pages(src, src_pages, dst, dst_pages) == len(
        page_runs(src_pages, dst_pages))
    assert torch.equal(dst, want)


@pytest.mark.parametrize("sh, dh", [((0, 4), (0, 4)), ((2, 4), (0, 2)), ((0, 2), (2, 4))])
def test_head_slices_between_numpy_byte_views_and_tensors(sh, dh):
    src = torch.randn(16, 3, 2, 4, 4, 8)
    dst = torch.zeros_like(src)
    sp, dp = np.array([3, 4, 5, 9, 10, 11]), np.array([7, 8, 2, 3, 4, 12])
    want = _reference(src, sp, dst, dp, slice(*sh), slice(*dh))
    as_bytes = lambda t: t.view(torch.uint8).numpy()  # noqa: E731  [.., heads, dim*4]
    copy_pages(as_bytes(src), sp, as_bytes(dst), dp, src_heads=slice(*sh),
               dst_heads=slice(*dh))
    assert torch.equal(dst, want)


@pytest.mark.parametrize("bad", [[-1], [16], [3, 99]])
def test_page_ids_outside_either_pool_are_refused_before_any_copy(bad):
    src, dst = torch.ones(16, 4), torch.zeros(16, 4)
    with pytest.raises(IndexError, match="outside a pool of 16 pages"):
        copy_pages(src, np.array([1] * len(bad)), dst, np.array(bad))
    with pytest.raises(IndexError, match="source page ids"):
        copy_pages(src, np.array(bad), dst, np.array([1] * len(bad)))
    assert not dst.any()
    check_pages(np.array([0, 15]), 16)


def test_shares_shrink_as_they_are_taken_and_are_copied_run_by_run():
    # 2 threads: each share about a quarter of what is left, at least 2 pages
    assert _guided_cuts(64, 2, 2) == [0, 16, 28, 37, 43, 48, 52, 55, 57, 59, 61, 63, 64]
    assert _guided_cuts(4, 2, 1) == [0, 1, 2, 3, 4]    # an 8 MiB frame of 2 MiB pages
    assert _guided_cuts(5, 2, 8) == [0, 5]             # never below the smallest share
    # a share is copied per run of consecutive page ids: runs start at these offsets
    assert _run_cuts(np.array([3, 4, 5, 9, 12, 13])).tolist() == [0, 3, 4, 6]
    assert _run_cuts(np.array([7])).tolist() == [0, 1]
    # shares [0, 4) [4, 6), runs [0, 3) [3, 4) [4, 6): every segment in one share and run
    assert _segments([0, 4, 6], [0, 3, 4, 6]) == [[(0, 3), (3, 4)], [(4, 6)]]
    assert _segments([0, 2, 6], [0, 3, 4, 6]) == [[(0, 2)], [(2, 3), (3, 4), (4, 6)]]
    assert _segments([0, 6], []) == [[(0, 6)]]


@pytest.fixture
def three_copy_threads():
    before = copy_threads()
    set_copy_threads(3)
    yield
    set_copy_threads(before)


@pytest.mark.parametrize("page_kib", [16, 256])       # gathered below 32 KiB, else by runs
@pytest.mark.parametrize("case", ["dst runs", "src runs", "both scattered", "one run"])
def test_large_cpu_copies_shared_over_threads_are_byte_exact(three_copy_threads, page_kib,
                                                             case):
    page = (2, 2, 4, 4, page_kib * 16)                # float16 numpy pools: the slice path
    n = 3 * SPLIT_ABOVE_BYTES // (page_kib << 10) + 7
    src = np.random.default_rng(1).integers(0, 1 << 16, (2 * n + 2, *page),
                                            np.uint16).view(np.float16)
    dst = np.zeros_like(src)
    rng = np.random.default_rng(2)
    scattered = rng.permutation(np.arange(1, 2 * n + 2))[:n]
    src_pages, dst_pages = {"dst runs": (scattered, np.arange(5, 5 + n)),
                            "src runs": (np.arange(5, 5 + n), scattered),
                            "both scattered": (scattered, scattered[::-1].copy()),
                            "one run": (np.arange(1, 1 + n), np.arange(n + 1, 2 * n + 1))}[case]
    want = dst.copy()
    want[dst_pages] = src[src_pages]
    copy_pages(src, src_pages, dst, dst_pages)
    assert np.array_equal(dst.view(np.uint16), want.view(np.uint16))  # NaN bit patterns too
    helpers = [t for t in threading.enumerate() if t.name.startswith("kv-page-copy")]
    assert 1 <= len(helpers) <= 2                     # the caller did one share itself


def test_split_false_copies_on_the_calling_thread_only(three_copy_threads, monkeypatch):
    """The transport lands frames with ``split=False``: helper threads left ZMQ's next
    receive buffers fresh (docs/benchmarks.md), so no share may go to one."""
    import common.kv.page_copy as page_copy
    pieces = []
    monkeypatch.setattr(page_copy, "run_pieces", lambda p, fn: (pieces.append(len(p)),
                                                                [fn(x) for x in p]))
    n = 3 * SPLIT_ABOVE_BYTES // (256 << 10)
    src = np.random.default_rng(3).integers(0, 255, (n, 256 << 10), np.uint8)
    dst = np.zeros_like(src)
    copy_pages(src, np.arange(n), dst, np.arange(n)[::-1].copy(), split=False)
    assert np.array_equal(dst, src[::-1]) and pieces == [1]
    copy_pages(src, np.arange(n), dst, np.arange(n)[::-1].copy())
    assert pieces[1] > 1                              # the default still shares it out


def test_one_run_on_the_calling_thread_is_one_slice_copy(monkeypatch):
    """A frame landing in consecutive pages (one run on both sides, ``split=False``) is one
    slice copy: byte-exact, its neighbours untouched, no share bookkeeping."""
    import common.kv.page_copy as page_copy
    monkeypatch.setattr(page_copy, "run_pieces", lambda *a: pytest.fail("shared out"))
    frame = np.random.default_rng(5).integers(0, 255, (4, 2, 2, 16, 4, 8), np.uint8)
    pool = np.zeros((12, *frame.shape[1:]), np.uint8)
    assert copy_pages(frame, np.arange(4), pool, np.arange(6, 10), split=False) == 1
    assert np.array_equal(pool[6:10], frame)
    assert not pool[:6].any() and not pool[10:].any()


def test_a_failing_share_is_raised_after_every_share_ended(three_copy_threads):
    src = np.ones((64, SPLIT_ABOVE_BYTES // 16), np.uint8)
    dst = np.zeros_like(src)
    dst.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        copy_pages(src, np.arange(1, 33), dst, np.arange(33, 64).tolist() + [1])
    assert not dst.any()
    with pytest.raises(ValueError, match="at least 1"):
        set_copy_threads(0)


def test_a_copy_never_waits_for_a_busy_helper(three_copy_threads):
    """Two helpers, both held by another caller's work: this copy does every share itself."""
    release = threading.Event()
    held = [_helpers().submit(release.wait, 30) for _ in range(2)]
    try:
        src = np.random.default_rng(3).integers(0, 255, (40, SPLIT_ABOVE_BYTES // 8), np.uint8)
        dst = np.zeros_like(src)
        copy_pages(src, np.arange(1, 21), dst, np.arange(20, 40))
        assert np.array_equal(dst[20:40], src[1:21]) and not dst[:20].any()
        assert not any(f.done() for f in held)
    finally:
        release.set()
    assert all(f.result(5) for f in held)


class RecordingEngine(CopyEngine):
    """Records which thread ran each copy; a copy of ``gate_pages`` waits for ``gate``."""

    def __init__(self):
        self.ran: list[tuple[int, str]] = []
        self.gate, self.gate_pages = threading.Event(), -1
        self.at_gate = threading.Event()
        super().__init__("cpu")

    def _copy(self, src, src_pages, dst, dst_pages):
        if int(src_pages[0]) == self.gate_pages:
            self.at_gate.set()
            self.gate.wait(5)
        self.ran.append((int(src_pages[0]), threading.current_thread().name))
        super()._copy(src, src_pages, dst, dst_pages)


def test_a_waiter_copies_a_share_of_the_running_copy_in_a_busy_helpers_place(
        three_copy_threads, monkeypatch):
    """The engine's thread runs the copy and both helpers are held by other work: the
    waiter takes a helper's queued share and copies it in its own thread."""
    import common.kv.page_copy as page_copy
    copied_by: list[str] = []
    real = page_copy._copy_segments
    me = threading.current_thread().name
    joined = threading.Event()

    def recording(src, src_pages, dst, dst_pages, segments, how):
        name = threading.current_thread().name
        copied_by.append(name)
        if name == me:
            joined.set()
        else:   # the engine's thread holds its first piece until we joined (or 5 s), so
            joined.wait(5)   # however late this thread comes to wait, a piece is left
        real(src, src_pages, dst, dst_pages, segments, how)

    monkeypatch.setattr(page_copy, "_copy_segments", recording)
    release = threading.Event()
    held = [_helpers().submit(release.wait, 30) for _ in range(2)]
    engine = RecordingEngine()
    try:
        n = 4 * SPLIT_ABOVE_BYTES // (256 << 10)           # 32 pages of 256 KiB
        src = torch.from_numpy(np.random.default_rng(5).integers(
            0, 255, (2 * n + 1, 256 << 10), np.uint8))
        dst = torch.zeros_like(src)
        engine.gate_pages = 1                             # the engine's thread holds it
        pages = np.random.default_rng(6).permutation(np.arange(2, 2 * n + 1))[:n]
        pages[0] = 1                                      # scattered: one slice per page
        job = engine.submit(src, pages, dst, np.arange(n + 1, 2 * n + 1))
        assert engine.at_gate.wait(5)
        engine.gate.set()
        assert job.wait(30) and job.error is None
        assert torch.equal(dst[n + 1:], src[pages]) and not dst[:n + 1].any()
        assert engine.ran == [(1, "kv-offload-copy")]     # the engine's thread ran it...
        assert me in copied_by and "kv-offload-copy" in copied_by  # ...and we joined
        assert not any(t.done() for t in held)            # no helper was needed
    finally:
        release.set()
        engine.close()


def test_copies_run_in_order_and_a_waiter_never_jumps_a_running_copy():
    engine = RecordingEngine()
    src, dst = torch.arange(16.0).view(16, 1), torch.zeros(16, 1)
    try:
        engine.gate_pages = 1
        first = engine.submit(src, np.array([1]), dst, np.array([9]))   # held at the gate
        second = engine.submit(src, np.array([2]), dst, np.array([10]))
        assert not second.wait(0.2)          # the first still runs: nobody jumps the queue
        assert not second.wait(0)            # a zero timeout only polls
        engine.gate.set()
        assert second.wait(5) and first.done()
        assert [page for page, _ in engine.ran] == [1, 2]
        assert dst.view(-1)[9:11].tolist() == [1.0, 2.0]
    finally:
        engine.close()


class WaitersOnlyEngine(RecordingEngine):
    """No worker thread takes jobs: only their waiters run them."""

    def _run(self) -> None:
        return


def test_a_waiter_runs_its_own_next_copy_in_its_own_thread():
    engine = WaitersOnlyEngine()
    src, dst = torch.arange(16.0).view(16, 1), torch.zeros(16, 1)
    first = engine.submit(src, np.array([5]), dst, np.array([1]))
    second = engine.submit(src, np.array([6]), dst, np.array([2]))
    assert not second.wait(0.1)              # not next: it waits (and times out)
    assert first.wait(1) and second.wait(1)
    me = threading.current_thread().name
    assert engine.ran == [(5, me), (6, me)] and dst.view(-1)[1:3].tolist() == [5.0, 6.0]
    engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("host_scattered", [False, True], ids=["host-runs", "both-scattered"])
def test_gpu_scattered_pages_to_and_from_pinned_host_are_byte_exact(host_scattered):
    # through the host tier's engine (its own stream, non-blocking copies, an event):
    # scattered device pages into a host run and into scattered host pages, and back
    dev = torch.randn((300, 2, 2, 16, 4, 64), device="cuda")
    host = torch.zeros((300, 2, 2, 16, 4, 64)).pin_memory()
    rng = np.random.default_rng(11)
    dev_pages = rng.permutation(np.arange(300))[:256]
    host_pages = rng.permutation(np.arange(300))[:256] if host_scattered else \
        np.arange(20, 276)
    engine = CopyEngine("cuda")
    try:
        job = engine.submit(dev, dev_pages, host, host_pages)
        assert job.wait(30)
        assert torch.equal(host[torch.from_numpy(host_pages)],
                           dev[torch.from_numpy(dev_pages).cuda()].cpu())
        back = torch.zeros_like(dev)
        job = engine.submit(host, host_pages, back, dev_pages)
        assert job.wait(30)
        idx = torch.from_numpy(dev_pages).cuda()
        assert torch.equal(back[idx], dev[idx])
    finally:
        engine.close()


@pytest.mark.parametrize("chunk", [1000, 64 << 10, 1 << 20])
def test_a_fed_copy_feeds_the_digest_of_its_source_pages(chunk):
    """``copy_pages_fed`` lands what ``copy_pages`` lands, and what it feeds, in order, is
    the run's canonical bytes: its xxh3 equals ``digest_of_pages`` of the source pages,
    whatever the chunk size (one not dividing a page either) and however the pages break
    into runs."""
    from common.kv import RunDigest, copy_pages_fed, digest_of_pages
    src = torch.randn((40, 2, 2, 16, 4, 32))                # 32 KiB float32 pages
    dst = torch.zeros_like(src)
    src_pages, dst_pages = np.array([3, 4, 5, 9, 12, 13, 30]), np.array([7, 8, 9, 2, 3, 4, 1])
    fed = RunDigest()
    assert copy_pages_fed(src, src_pages, dst, dst_pages, fed.feed, chunk) == len(
        page_runs(src_pages, dst_pages))
    assert torch.equal(dst, _reference(src, src_pages, torch.zeros_like(src), dst_pages))
    assert fed.value() == digest_of_pages("xxh3_64", src, src_pages)
    assert fed.value() != digest_of_pages("xxh3_64", src, src_pages[::-1].copy())


def test_a_fed_copy_refuses_bad_pages_before_writing_or_feeding():
    from common.kv import copy_pages_fed
    src, dst = torch.randn(8, 1, 2, 4, 2, 8), torch.zeros(8, 1, 2, 4, 2, 8)
    fed = []
    with pytest.raises(IndexError):
        copy_pages_fed(src, np.array([1, 8]), dst, np.array([1, 2]), fed.append)
    with pytest.raises(ValueError, match="2 source pages but 1"):
        copy_pages_fed(src, np.array([1, 2]), dst, np.array([1]), fed.append)
    assert not fed and not dst.any()
