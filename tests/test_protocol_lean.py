"""The lean protocol's promises, as stories over real sockets and real pools.

- A request's success path costs one control message: the decode's ``Register``. The
  prefill sends data messages only; the last carries the first token; nobody sends Done.
- Page epochs: a page that is not the request's current allocation (stale, foreign, out
  of range) is refused before anything lands, recorded, and shows in replay.
- Integrity: a byte flipped in a frame in flight, in a shared-memory page after the
  prefill's write, or in a host-tier page between store and load is caught by its digest,
  fails only its own request (its neighbour lands byte-exact), and shows in replay with
  the request and the pages.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch

from common import KvCache, KvLayout
from common.freelog import replay_file
from common.host import HashChain, HostTier, Offloader
from tests.test_transport_unit import FakePrefill, fake_chunk
from tests.transport_helpers import config, layout, make_cache, pattern, read_row, write_row
from transport import EventKind, KvReceiver, KvSender, nixl
from transport.messages import AbortAck, encode

pytestmark = pytest.mark.timeout(60)


class LoggedPair:
    """A sender and a receiver in this process over ipc, each pool recording its free log;
    the sender is polled by a thread during the blocking handshake only."""

    def __init__(self, tmp_path, shared: bool = False, **kw):
        self.p_log, self.d_log = tmp_path / "prefill.log", tmp_path / "decode.log"
        self.pc = make_cache(64, 4, layout(), log_path=self.p_log, node="p")
        self.dc = make_cache(64, 4, layout(), log_path=self.d_log, node="d", shared=shared)
        self.tx = KvSender(self.pc, f"ipc://{tmp_path}/p.sock", config("p", **kw))
        self.rx = KvReceiver(self.dc, config("d", **kw))
        self.tx_events: list = []
        stop = threading.Event()

        def serve():
            while not stop.is_set():
                self.tx_events.extend(self.tx.poll(0.005))
        thread = threading.Thread(target=serve)
        thread.start()
        try:
            self.rx.connect(self.tx.address)
        finally:
            stop.set()
            thread.join()

    def rows(self, rid: str, n: int, seed: int):
        kv_p = self.pc.open_row(rid)
        self.pc.extend(kv_p, n)
        write_row(self.pc, kv_p, pattern(seed, n, self.pc.layout, 0, 4))
        kv_d = self.dc.open_row(rid)
        self.dc.extend(kv_d, n)
        return kv_p, kv_d

    def run(self, until, seconds: float = 3.0) -> list:
        events, deadline = [], time.monotonic() + seconds
        while time.monotonic() < deadline and not until(events):
            events += self.rx.poll(0.005)
            self.tx_events += self.tx.poll(0.0)
        return events

    def settle(self, rows: dict) -> None:
        """Free every row as a worker does, wait until no pin is left, close the pools."""
        for cache, kv, reason in rows.values():
            cache.free_kv_row(kv, [(0, kv.allocated_len)], reason=reason)
            cache.close_row(kv)
        deadline = time.monotonic() + 3
        while (self.tx.transfers or self.rx.transfers) and time.monotonic() < deadline:
            self.rx.poll(0.005)
            self.tx.poll(0.0)
        self.tx.close()
        self.rx.close()
        for cache in (self.pc, self.dc):
            cache.check_integrity()
            cache.close()


def _sent(stats: Counter, before: Counter) -> dict:
    """Messages sent since ``before``, by type; heartbeats are per peer, not per request."""
    return {k: v - before[k] for k, v in stats.items()
            if k.startswith("sent.") and k != "sent.Heartbeat" and v != before[k]}


@pytest.mark.parametrize("path", ["ipc", "shm", "nixl"])
def test_a_success_path_sends_the_registration_and_nothing_else(tmp_path, path):
    if path == "nixl" and nixl.import_error():
        pytest.skip(f"NIXL not importable: {nixl.import_error()}")
    kw = {"kv_transport": "nixl"} if path == "nixl" else {}
    pair = LoggedPair(tmp_path, shared=path == "shm", **kw)
    assert list(pair.rx.data_paths().values()) == [path]
    tx0, rx0 = Counter(pair.tx.stats), Counter(pair.rx.stats)
    kv_p, kv_d = pair.rows("r1", 30, seed=1)
    assert pair.tx.send("r1", kv_p, 16)       # computed before the registration: pinned
    pair.rx.announce("r1", kv_d, 30)          # the decode admits: Register, nothing else
    pair.run(lambda _: any(e.kind == EventKind.READY for e in pair.tx_events))
    assert pair.tx.finish("r1", kv_p, first_token=77)
    events = pair.run(lambda ev: ev and not pair.tx.transfers)
    assert [(e.kind, e.first_token) for e in events] == [(EventKind.COMPLETED, 77)]
    assert [(e.kind, e.reason) for e in pair.tx_events if e.rid] == [
        (EventKind.READY, ""), (EventKind.COMPLETED, "sent")]
    assert torch.equal(read_row(pair.dc, kv_d, 0, 30), pattern(1, 30, pair.pc.layout, 0, 4))
    assert _sent(pair.rx.stats, rx0) == {"sent.Register": 1}
    data = _sent(pair.tx.stats, tx0)          # data messages only, the last one completes
    assert data and set(data) <= {"sent.KvChunk", "sent.KvWritten"}, data
    assert pair.tx.num_pins == 0 and pair.rx.num_pins == 0
    pair.settle({"p": (pair.pc, kv_p, "sent"), "d": (pair.dc, kv_d, "finished")})
    for log in (pair.p_log, pair.d_log):
        report = replay_file(log)
        assert report.ok, report.format()


# -- page epochs --------------------------------------------------------------------------
def test_the_allocator_names_stale_foreign_and_out_of_range_pages(tmp_path):
    cache = make_cache(16, 4, layout(), log_path=tmp_path / "d.log")
    a = cache.open_row("a")
    cache.extend(a, 8)                                        # pages 1, 2: one epoch
    b = cache.open_row("b")
    cache.extend(b, 4)                                        # page 3: the next epoch
    pa, ea = cache.pages(a, 0, 8), cache.page_epochs(a, 0, 8)
    assert pa.tolist() == [1, 2] and ea[0] == ea[1] < cache.page_epochs(b, 0, 4)[0]
    assert cache.check_held("a", pa, ea) is None
    assert cache.check_held("a", cache.pages(b, 0, 4), cache.page_epochs(b, 0, 4)) \
        == "foreign page 3 (held by b)"
    assert cache.check_held("a", np.array([99]), ea[:1]).startswith("out-of-range page 99")
    cache.free_kv_row(a, [(0, 8)], reason="finished")
    cache.close_row(a)
    c = cache.open_row("c")
    cache.extend(c, 8)                                        # a's pages, a new allocation
    assert set(cache.pages(c, 0, 8).tolist()) == {1, 2}
    assert cache.check_held("c", pa, ea).startswith("stale page")   # a's epochs
    cache.free_kv_row(c, [(0, 8)], reason="finished")
    cache.free_kv_row(b, [(0, 4)], reason="finished")
    cache.close()
    from common.freelog import FreeLogReader
    allocs = [ev for ev in FreeLogReader(tmp_path / "d.log").records if ev["op"] == "alloc"]
    assert [ev["epoch"] for ev in allocs] == sorted({ev["epoch"] for ev in allocs})
    assert allocs[0]["epoch"] == int(ea[0])                   # the free log records it


@pytest.mark.parametrize("case", ["stale", "foreign"])
def test_data_for_pages_of_another_allocation_is_refused_and_writes_nothing(tmp_path, case):
    dc = make_cache(64, 4, layout(), log_path=tmp_path / "d.log", node="d")
    rx = KvReceiver(dc, config("d", lease_s=30.0))
    fake = FakePrefill(tmp_path, rx)
    try:
        rows = {}
        for rid in ("victim", "other", "ok"):
            rows[rid] = dc.open_row(rid)
            dc.extend(rows[rid], 8)
            rx.announce(rid, rows[rid], 8)
        block = dc.data()[0].numel() * 4
        payload = np.full(2 * block, 0x5A, np.uint8).tobytes()
        wrong = dc.page_epochs(rows["victim"], 0, 8) + np.uint64(1) if case == "stale" \
            else dc.page_epochs(rows["other"], 0, 8)          # another request's pages'
        fake.send(fake_chunk(dc, rows["victim"], "victim", 0, 2, 2 * block, payload,
                             first_token=1, epochs=wrong), payload)
        fake.send(fake_chunk(dc, rows["ok"], "ok", 0, 2, 2 * block, payload, first_token=2),
                  payload)
        events, deadline = [], time.monotonic() + 3
        while len(events) < 2 and time.monotonic() < deadline:
            events += rx.poll(0.01)
        assert {e.rid: (e.kind, e.reason) for e in events} == {
            "victim": (EventKind.FAILED, "error"), "ok": (EventKind.COMPLETED, "")}
        assert not read_row(dc, rows["victim"], 0, 8).any()   # nothing of it landed
        assert read_row(dc, rows["ok"], 0, 8).view(torch.uint8).eq(0x5A).all()
        assert rx.stats["refused.stale"] == 1 and rx.stats["errors.stale_pages"] == 1
        assert [m.code for m in fake.recv_all() if type(m).__name__ == "Error"] == [
            "stale_pages"]
        victim_pages = dc.pages(rows["victim"], 0, 8).tolist()
        rx.abort("other")                          # never sent: stop it
        for rid, kv in rows.items():
            dc.free_kv_row(kv, [(0, 8)], reason="finished" if rid == "ok" else "error")
            dc.close_row(kv)
        for rid in ("victim", "other"):            # the fake confirms it stopped both
            fake.send(encode(AbortAck(rid=rid)))
        deadline = time.monotonic() + 2
        while rx.transfers and time.monotonic() < deadline:
            rx.poll(0.01)
        assert rx.num_pins == 0
    finally:
        rx.close()
        fake.close()
    dc.close()
    report = replay_file(tmp_path / "d.log")
    refused = [v for v in report.violations if v.kind == "refused-pages"]
    assert len(refused) == 1 and refused[0].owner == "victim", report.format()
    assert refused[0].pages == victim_pages            # the request and its pages, named


# -- integrity: fault injection -------------------------------------------------------
def _flip(buffer: np.ndarray, at: int = 5) -> None:
    buffer.reshape(-1).view(np.uint8)[at] ^= 0x10


def _victim_and_neighbour(tmp_path, arm, shared=False):
    """Two interleaved requests; ``arm(pair)`` corrupts the victim's bytes on their way.
    Returns the pair's events by rid, the pair and the rows."""
    pair = LoggedPair(tmp_path, shared=shared)
    kv_vp, kv_vd = pair.rows("victim", 30, seed=1)
    kv_np, kv_nd = pair.rows("neighbour", 30, seed=2)
    pair.rx.announce("victim", kv_vd, 30)
    pair.rx.announce("neighbour", kv_nd, 30)
    pair.run(lambda _: sum(e.kind == EventKind.READY for e in pair.tx_events) == 2)
    pair.tx.send("neighbour", kv_np, 12)
    arm(pair)
    pair.tx.finish("victim", kv_vp, first_token=5)
    pair.tx.finish("neighbour", kv_np, first_token=6)
    events = pair.run(lambda ev: len(ev) == 2)
    rows = {"vp": (pair.pc, kv_vp, "sent"), "np": (pair.pc, kv_np, "sent"),
            "vd": (pair.dc, kv_vd, "error"), "nd": (pair.dc, kv_nd, "finished")}
    return {e.rid: e for e in events}, pair, rows


def _assert_only_the_victim_failed(events, pair, rows):
    assert (events["victim"].kind, events["victim"].reason) == (EventKind.FAILED, "error")
    assert "corrupt" in events["victim"].detail
    assert (events["neighbour"].kind, events["neighbour"].first_token) == (
        EventKind.COMPLETED, 6)
    assert torch.equal(read_row(pair.dc, rows["nd"][1], 0, 30),
                       pattern(2, 30, pair.pc.layout, 0, 4))
    assert pair.rx.stats["refused.corrupt"] == 1
    victim_pages = pair.dc.pages(rows["vd"][1], 0, 30).tolist()
    pair.settle(rows)
    report = replay_file(pair.d_log)
    found = [v for v in report.violations if v.kind == "digest-mismatch"]
    assert len(found) == 1 and found[0].owner == "victim", report.format()
    assert set(found[0].pages) <= set(victim_pages) and found[0].pages
    assert report.exit_code == 1 and "victim" in report.format()
    assert replay_file(pair.p_log).ok


def test_a_byte_flipped_in_a_frame_in_flight_fails_only_its_request(tmp_path):
    def arm(pair):
        router, send = pair.tx.link.router, pair.tx.link.router.send

        def corrupting(key, frames, track=False):
            if len(frames) == 2 and b"victim" in frames[0]:
                payload = np.array(frames[1], copy=True)   # the pool itself stays intact
                _flip(payload)
                frames = [frames[0], payload]
                router.send = send                          # one frame only
            return send(key, frames, track=track)
        router.send = corrupting
    events, pair, rows = _victim_and_neighbour(tmp_path, arm)
    assert pair.rx.stats["frames_recv"] > 0
    # nothing of the corrupt frame landed: its pages are as the decode allocated them
    assert not read_row(pair.dc, rows["vd"][1], 0, 30).any()
    _assert_only_the_victim_failed(events, pair, rows)


def test_a_byte_flipped_in_a_shared_page_after_the_write_fails_only_its_request(
        tmp_path, monkeypatch):
    import transport.shm as shm
    armed = []

    def corrupting(real):
        def copy(src, src_pages, dst, dst_pages, *args, **kw):
            out = real(src, src_pages, dst, dst_pages, *args, **kw)
            if armed:
                armed.clear()
                _flip(dst[int(dst_pages[0])])                # after the prefill's write
            return out
        return copy

    def arm(pair):
        assert pair.tx.link.shm, "the decode pool should be mapped"
        # whole heads with integrity on copy and digest in one pass (copy_pages_fed)
        for name in ("copy_pages", "copy_pages_fed"):
            monkeypatch.setattr(shm, name, corrupting(getattr(shm, name)))
        armed.append(True)
    events, pair, rows = _victim_and_neighbour(tmp_path, arm, shared=True)
    assert pair.rx.stats["shm_writes_recv"] > 0
    _assert_only_the_victim_failed(events, pair, rows)


def test_a_byte_flipped_in_a_host_page_between_store_and_load_fails_only_that_load(
        tmp_path):
    lay = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16")
    cache = KvCache(32, 4, layout=lay, log_path=tmp_path / "device.log")
    host = HostTier(32, 4, lay, log_path=tmp_path / "host.log")
    off = Offloader(cache, host)

    def stored(rid, tokens):
        kv = cache.open_row(rid)
        cache.extend(kv, len(tokens))
        cache.commit(kv, len(tokens))
        pages = cache.pages(kv, 0, len(tokens))
        cache.data()[pages] = torch.randn((len(pages), *lay.page_shape(4))).to(torch.float16)
        assert off.complete_store(off.prepare_store(kv, HashChain(4, tokens=tokens)), 5)
        want = cache.data()[pages].clone()
        cache.free_kv_row(kv, [(0, len(tokens))], reason="finished")
        cache.close_row(kv)
        return want

    def load(rid, tokens):
        kv = cache.open_row(rid)
        cache.extend(kv, len(tokens))
        handle = off.prepare_load(kv, HashChain(4, tokens=tokens))
        try:
            off.complete_load(handle, 5)
            return kv, handle, None
        except RuntimeError as exc:
            return kv, handle, exc

    victim_kv = stored("victim-store", list(range(100, 112)))      # 3 host pages
    neighbour_kv = stored("neighbour-store", list(range(500, 508)))  # 2 host pages
    victim_host = off.prefix.match(HashChain(4, tokens=list(range(100, 112))).keys)
    _flip(host.data[int(victim_host[1])].view(torch.uint8).numpy())   # at rest
    kv_v, _, err = load("victim", list(range(100, 112)))
    assert err is not None and "changed since" in str(err.__cause__)
    assert off.num_corrupt_pages == 1
    # nobody loads the bad page again: the prefix now stops before it
    assert off.lookup(HashChain(4, tokens=list(range(100, 112)))) == 4
    kv_n, handle, err = load("neighbour", list(range(500, 508)))
    assert err is None and handle.num_tokens == 8
    assert torch.equal(cache.data()[cache.pages(kv_n, 0, 8)], neighbour_kv)
    for kv in (kv_v, kv_n):
        cache.free_kv_row(kv, [(0, kv.allocated_len)], reason="finished")
        cache.close_row(kv)
    assert off.close(timeout=5)
    cache.close()
    host.close()
    assert victim_kv.shape[0] == 3
    report = replay_file(tmp_path / "host.log")
    found = [v for v in report.violations if v.kind == "digest-mismatch"]
    assert len(found) == 1 and found[0].owner == "victim", report.format()
    assert found[0].pages == [int(victim_host[1])]
    assert report.digests["pages_stored"] == 5 and report.digests["pages_loaded"] == 5
    assert replay_file(tmp_path / "device.log").ok


def test_a_post_that_fails_fails_only_its_request_with_an_abort(tmp_path, monkeypatch):
    """Post failed: the prefill cannot post one request's WRITE (its peer is fine). That
    request fails with reason error and its Abort reaches the decode, which answers
    AbortAck; the peer stays, and the next request moves byte-exact."""
    if nixl.import_error():
        pytest.skip(f"NIXL not importable: {nixl.import_error()}")
    pair = LoggedPair(tmp_path, kv_transport="nixl")
    agent = pair.tx.nixl.agent
    real = agent.write_prepped

    def failing(local, src, remote, dst, notif):
        if b"victim" in notif:
            raise RuntimeError("injected: the backend refused the post")
        return real(local, src, remote, dst, notif)
    monkeypatch.setattr(agent, "write_prepped", failing)
    kv_vp, kv_vd = pair.rows("victim", 30, seed=1)
    kv_np, kv_nd = pair.rows("neighbour", 30, seed=2)
    pair.rx.announce("victim", kv_vd, 30)
    pair.rx.announce("neighbour", kv_nd, 30)
    pair.run(lambda _: sum(e.kind == EventKind.READY for e in pair.tx_events) == 2)
    tx0, rx0 = Counter(pair.tx.stats), Counter(pair.rx.stats)
    pair.tx.finish("victim", kv_vp, first_token=5)
    pair.tx.finish("neighbour", kv_np, first_token=6)
    events = {e.rid: e for e in pair.run(lambda ev: len(ev) == 2)}
    assert (events["victim"].kind, events["victim"].reason) == (EventKind.ABORTED, "error")
    assert "post failed" in events["victim"].detail
    assert events["neighbour"].kind == EventKind.COMPLETED
    assert torch.equal(read_row(pair.dc, kv_nd, 0, 30), pattern(2, 30, pair.pc.layout, 0, 4))
    finals = {e.rid: (e.kind, e.reason) for e in pair.tx_events if e.kind.is_final}
    assert finals == {"victim": (EventKind.FAILED, "error"),
                      "neighbour": (EventKind.COMPLETED, "sent")}
    assert pair.tx.stats["post_failed"] == 1 and not pair.tx.stats["peers_lost"]
    # the failure path's messages: an Abort one way, its AbortAck the other
    assert _sent(pair.tx.stats, tx0) == {"sent.Abort": 1, "sent.KvWritten": 1}
    pair.run(lambda _: pair.rx.num_pins == 0)
    assert _sent(pair.rx.stats, rx0) == {"sent.AbortAck": 1}
    pair.settle({"vp": (pair.pc, kv_vp, "error"), "np": (pair.pc, kv_np, "sent"),
                 "vd": (pair.dc, kv_vd, "error"), "nd": (pair.dc, kv_nd, "finished")})
    for log in (pair.p_log, pair.d_log):
        report = replay_file(log)
        assert report.ok, report.format()


@pytest.mark.parametrize("heads", [slice(0, 2), slice(1, 2)])
def test_a_shared_memory_piece_digest_is_its_source_runs_digest(monkeypatch, heads):
    """The shared-memory copy digests its source as it copies when the leg carries every
    head (one pass), else after the copy: either way the ``KvWritten`` digest equals
    ``digest_of_pages`` of the source pages restricted to the leg's heads, and the decode
    pool holds those bytes."""
    import transport.shm as shm
    from common.kv import SharedTensor, digest_of_pages
    from transport.channel import BlockRun
    from transport.pool_view import HostPoolView

    class Router:
        def __init__(self):
            self.sent = []

        def send(self, peer, frames):
            self.sent.append((peer, frames))

    fed = []
    real_fed = shm.copy_pages_fed
    monkeypatch.setattr(shm, "copy_pages_fed", lambda *a, **kw: fed.append(1) or real_fed(
        *a, **kw))
    src = torch.randn((12, 2, 2, 4, 2, 8)).to(torch.float16)
    mapped = SharedTensor(tuple(src.shape), torch.float16)
    try:
        mapped.tensor.zero_()
        chan = shm.ShmChannel(Router(), HostPoolView(src), mapped, heads, Counter(),
                              max_piece_bytes=3 * HostPoolView(src).block_bytes(
                                  heads.stop - heads.start))
        src_pages, dest_pages = np.array([2, 3, 4, 7, 9]), np.array([5, 6, 1, 2, 3])
        run = BlockRun(peer=b"d", rid="r", first_block=0, src_pages=src_pages,
                       dest_pages=dest_pages, heads=(heads.start, heads.stop),
                       src_heads=heads, dest_epochs=np.ones(5, np.uint64),
                       digest="xxh3_64")
        posted = chan.send_blocks(run)
        digests = [e[5] for e in posted.entries]
        assert len(digests) == 2                            # pieces of 3 and 2 blocks
        assert len(fed) == (2 if heads == slice(0, 2) else 0)   # one pass: every head
        assert digests == [digest_of_pages("xxh3_64", src, src_pages[:3], heads),
                           digest_of_pages("xxh3_64", src, src_pages[3:], heads)]
        got = mapped.tensor[dest_pages][:, :, :, :, heads]
        assert torch.equal(got, src[src_pages][:, :, :, :, heads])
    finally:
        mapped.close()   # its creator: the segment goes too
