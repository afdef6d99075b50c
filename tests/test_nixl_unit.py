"""NIXL data path pieces in one process: descriptors against a per-page reference, the
completion that is the prefill's own write, the control messages held while a write is in
flight, notifications in any order, and notifications that break the protocol. Real
NIXL agents (UCX) on real ipc sockets; one test holds a write "in flight" by wrapping the
real agent's completion report."""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest
import torch

from tests.test_transport_unit import Pair
from tests.transport_helpers import layout, make_cache, pattern, read_row, write_row
from transport import EventKind, nixl
from transport.integrity import pack_epochs
from transport.messages import AbortAck, KvWritten, Register, encode, pages_to_bytes

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(bool(nixl.import_error()),
                                 reason=f"NIXL not importable: {nixl.import_error()}")]


@pytest.mark.parametrize("src_heads, dst_heads, p_tp, d_tp", [
    (slice(0, 4), slice(0, 4), 1, 1),   # whole pages both ends: one descriptor per run
    (slice(0, 2), slice(0, 2), 1, 2),   # prefill TP1 -> decode rank 0 of TP2
    (slice(2, 4), slice(0, 2), 1, 2),   # ... -> decode rank 1
    (slice(0, 2), slice(2, 4), 2, 1),   # prefill rank 1 of TP2 -> decode TP1
])
def test_descriptors_copy_exactly_the_pages_and_heads_of_a_run(src_heads, dst_heads,
                                                               p_tp, d_tp):
    """memmove by the descriptors equals slicing the pools, across gaps in both runs."""
    src = torch.arange(12 * 3 * 2 * 4 * (4 // p_tp) * 8, dtype=torch.float32).view(
        12, 3, 2, 4, 4 // p_tp, 8)
    dst = torch.zeros(12, 3, 2, 4, 4 // d_tp, 8)
    sp, dp = np.array([2, 3, 4, 7, 8, 10]), np.array([5, 6, 1, 2, 3, 9])
    gs, gd = nixl.PoolGeom.of(src), nixl.PoolGeom.of(dst)
    whole = src_heads.stop - src_heads.start == gs.num_heads == gd.num_heads
    local, remote = nixl.write_descs(gs, sp, src_heads, gd, dp, dst_heads)
    assert local.shape == remote.shape and (local[:, 1] == remote[:, 1]).all()
    # runs consecutive on both sides: [2, 3]->[5, 6], [4]->[1], [7, 8]->[2, 3], [10]->[9]
    assert len(local) == (4 if whole else len(sp) * 3 * 2 * 4)
    for (s, n, _), (d, _, _) in zip(local.tolist(), remote.tolist()):
        ctypes.memmove(d, s, n)
    want = torch.zeros_like(dst)
    want[dp, :, :, :, dst_heads] = src[sp, :, :, :, src_heads]
    assert torch.equal(dst, want)


@pytest.fixture
def pair(tmp_path):
    p = Pair(tmp_path, kv_transport="nixl")
    p.connect()
    assert list(p.rx.data_paths().values()) == ["nixl"]
    assert list(p.tx.data_paths().values()) == ["nixl"]
    yield p
    p.close()


def _rows(pair, rid, n, seed=1):
    kv_p = pair.pc.open_row(rid)
    pair.pc.extend(kv_p, n)
    write_row(pair.pc, kv_p, pattern(seed, n, pair.pc.layout, 0, 4))
    kv_d = pair.dc.open_row(rid)
    pair.dc.extend(kv_d, n)
    return kv_p, kv_d


class Gate:
    """Writes read as "in flight" to the prefill (the real agent's report reads PROC)
    while ``closed``; the bytes and the notification still move."""

    def __init__(self, monkeypatch, agent: nixl.Agent):
        self.closed = True
        write, prepped, state = agent.write, agent.write_prepped, agent.state
        monkeypatch.setattr(agent, "write", lambda *a: self._gated(write(*a)))
        monkeypatch.setattr(agent, "write_prepped", lambda *a: self._gated(prepped(*a)))
        # the real state is still read: it progresses the write (the bytes move on)
        monkeypatch.setattr(agent, "state", lambda h: self._gated((h, state(h)))[1])

    def _gated(self, posted):
        handle, state = posted
        return handle, "PROC" if self.closed else state


def _poll_both(pair, seconds, until=lambda: False):
    events, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline and not until():
        events += pair.rx.poll(0.005)
        pair.tx_events.extend(pair.tx.poll(0.0))
    return events


def test_the_prefill_completes_when_its_own_write_reports_done(pair, monkeypatch):
    """No Done, no Ack: the decode completes on the write's notification (it carries the
    first token), the prefill when its own handle reads DONE; its source stays pinned
    until then."""
    gate = Gate(monkeypatch, pair.tx.nixl.agent)
    kv_p, kv_d = _rows(pair, "r1", 30)
    pair.rx.announce("r1", kv_d, 30)
    assert [e.kind for e in pair.tx.poll(0.5)] == [EventKind.READY]
    pair.tx.finish("r1", kv_p, first_token=42)
    # the prefill's worker loop is asked to poll soon (nothing wakes a socket wait)
    assert pair.tx.poll_within() == nixl.SLICE_S
    events = _poll_both(pair, 2, lambda: "r1" not in pair.rx.transfers)
    assert [(e.kind, e.first_token) for e in events] == [(EventKind.COMPLETED, 42)]
    assert torch.equal(read_row(pair.dc, kv_d, 0, 30), pattern(1, 30, pair.pc.layout, 0, 4))
    assert pair.tx.num_pins == 1 and not [e for e in pair.tx_events if e.rid]
    gate.closed = False
    _poll_both(pair, 2, lambda: not pair.tx.transfers)
    assert [(e.kind, e.reason) for e in pair.tx_events if e.rid] == [
        (EventKind.COMPLETED, "sent")]
    assert pair.tx.num_pins == 0 and pair.rx.stats["nixl_writes_recv"] == 1
    assert pair.tx.stats["sent.KvWritten"] == 1 and pair.rx.stats["sent.Register"] == 1
    assert pair.tx.poll_within() is None and pair.rx.poll_within() is None


def test_abort_ack_waits_until_the_write_in_flight_completed(pair, monkeypatch):
    """A decode abort: the prefill answers AbortAck only once its write is over, so the
    decode's destination pin (and the row's pages) stay until then."""
    gate = Gate(monkeypatch, pair.tx.nixl.agent)
    free0 = pair.dc.num_free_pages()
    kv_p, kv_d = _rows(pair, "r1", 30)
    pair.rx.announce("r1", kv_d, 30)
    assert [e.kind for e in pair.tx.poll(0.5)] == [EventKind.READY]
    pair.tx.send("r1", kv_p, 16)
    assert pair.rx.abort("r1")
    pair.dc.free_kv_row(kv_d, [(0, 30)], reason="aborted")
    pair.dc.close_row(kv_d)
    _poll_both(pair, 0.3)
    assert [e.kind for e in pair.tx_events if e.rid] == [EventKind.ABORTED]
    assert pair.rx.num_pins == 1 and pair.dc.num_free_pages() == free0 - 8
    gate.closed = False
    _poll_both(pair, 2, lambda: pair.rx.num_pins == 0 and pair.tx.num_pins == 0)
    assert pair.rx.num_pins == 0 and pair.dc.num_free_pages() == free0
    pair.pc.free_kv_row(kv_p, [(0, 30)], reason="aborted")
    pair.pc.close_row(kv_p)
    assert pair.tx.num_pins == 0
    pair.dc.check_integrity()


@pytest.mark.parametrize("notif, code", [
    (KvWritten(rid="r1", first_block=6, num_blocks=3, head_start=0, head_end=4),
     "bad_range"),
    (KvWritten(rid="r1", first_block=0, num_blocks=1, head_start=0, head_end=2),
     "bad_range"),
    (AbortAck(rid="r1"), "bad_field"),
])
def test_bad_notifications_fail_only_their_request(pair, notif, code):
    kv_p, kv_d = _rows(pair, "r1", 30)
    kv_p2, kv_d2 = _rows(pair, "r2", 12, seed=2)
    pair.rx.announce("r1", kv_d, 30)
    pair.rx.announce("r2", kv_d2, 12)
    pair.tx_events.extend(pair.tx.poll(0.5))
    agent = pair.tx.nixl.agent
    agent.agent.send_notif(pair.rx.nixl.agent.name, encode(notif))
    events = _poll_both(pair, 2, lambda: pair.rx.stats["errors"] > 0)
    events += _poll_both(pair, 0.2)
    assert pair.rx.stats[f"errors.{code}"] == 1, dict(pair.rx.stats)
    assert [(e.rid, e.kind, e.reason) for e in events] == [("r1", EventKind.FAILED, "error")]
    pair.tx.finish("r2", kv_p2, first_token=5)
    events = _poll_both(pair, 2, lambda: "r2" not in pair.rx.transfers)
    assert [(e.rid, e.kind) for e in events] == [("r2", EventKind.COMPLETED)]
    assert torch.equal(read_row(pair.dc, kv_d2, 0, 12), pattern(2, 12, pair.pc.layout, 0, 4))


def test_nixl_required_without_nixl_names_the_install(monkeypatch, tmp_path):
    monkeypatch.setattr(nixl, "import_error", lambda: "ModuleNotFoundError('nixl_cu12')")
    from tests.transport_helpers import config
    from transport import KvReceiver
    cache = make_cache(8, 4, layout())
    with pytest.raises(RuntimeError, match=r"pip install 'pdkv\[nixl-cu12\]'"):
        KvReceiver(cache, config("d", kv_transport="nixl"))
    cache.close()


class HeldNotifications:
    """The decode's agent progresses as usual, but the notifications it takes are kept
    from the receiver while ``closed`` (as if still on their way)."""

    def __init__(self, monkeypatch, target):
        self.closed, self.kept = True, []
        take = target.notifications

        def notifications():
            self.kept += take()
            if self.closed:
                return []
            out, self.kept = self.kept, []
            return out
        monkeypatch.setattr(target, "notifications", notifications)


def test_notifications_in_any_order_complete_only_when_every_one_is_in(pair, monkeypatch):
    """Two writes; their notifications arrive last-first: the one with the first token
    does not complete the request while the other's blocks are missing."""
    held = HeldNotifications(monkeypatch, pair.rx.nixl)
    kv_p, kv_d = _rows(pair, "r1", 30)
    pair.rx.announce("r1", kv_d, 30)
    assert [e.kind for e in pair.tx.poll(0.5)] == [EventKind.READY]
    pair.tx.send("r1", kv_p, 16)                    # blocks 0..3: the first write
    pair.tx.finish("r1", kv_p, first_token=9)       # blocks 4..7 and the first token
    assert _poll_both(pair, 0.3, lambda: len(held.kept) == 2) == []
    assert len(held.kept) == 2 and pair.rx.num_pins == 1
    held.kept.reverse()
    last = held.kept.pop(0)                         # the completion comes alone first
    held.closed, first = False, held.kept
    held.kept = [last]
    assert _poll_both(pair, 0.2) == [] and pair.rx.num_pins == 1
    held.kept = first
    events = _poll_both(pair, 2, lambda: "r1" not in pair.rx.transfers)
    assert [(e.kind, e.first_token) for e in events] == [(EventKind.COMPLETED, 9)]
    assert torch.equal(read_row(pair.dc, kv_d, 0, 30), pattern(1, 30, pair.pc.layout, 0, 4))


def test_notifications_that_never_come_fail_after_the_overall_deadline(tmp_path,
                                                                      monkeypatch):
    # no notification means no data seen: to the decode the request looks queued at its
    # prefill, which no chunk_timeout_s bounds (docs/protocol.md, "Deadlines"); the
    # overall deadline (done_timeout_s, 3 s here) ends it
    p = Pair(tmp_path, kv_transport="nixl", done_timeout_s=3.0,
             p_kw={"chunk_timeout_s": 60.0})
    p.connect()
    try:
        HeldNotifications(monkeypatch, p.rx.nixl)
        kv_p, kv_d = _rows(p, "r1", 30)
        p.rx.announce("r1", kv_d, 30)
        assert [e.kind for e in p.tx.poll(0.5)] == [EventKind.READY]
        p.tx.finish("r1", kv_p, first_token=9)
        events = _poll_both(p, 20, lambda: "r1" not in p.rx.transfers)
        # the request fails, its pin goes, no hang
        assert [(e.kind, e.reason) for e in events] == [(EventKind.FAILED, "timeout")]
        assert p.rx.num_pins == 0
    finally:
        p.close()


@pytest.mark.parametrize("dest", [[64, 3], [0, 3], [3, 3]])
def test_a_register_naming_pages_outside_the_registered_pool_writes_nothing(pair, dest):
    """Issue 9 on the NIXL path: the prefill writes only into the pages the decode
    allocated, inside its registered pool (64 pages: ids 1..63); a Register naming others
    is refused with bad_range/bad_field before anything is pinned or written."""
    sock = next(iter(pair.rx.link.sockets.values()))
    sock.send([encode(Register(rid="m1", prompt_len=8, cached_tokens=0,
                               dest_pages=pages_to_bytes(dest),
                               dest_epochs=pack_epochs(np.ones(2, np.uint64))))])
    assert _poll_both(pair, 0.3) == []
    assert pair.tx.stats["errors.bad_range"] + pair.tx.stats["errors.bad_field"] == 1
    assert pair.rx.stats["errors_recv"] == 1
    assert "m1" not in pair.tx.transfers and pair.tx.num_pins == 0
    assert pair.tx.stats["nixl_writes"] == 0 and pair.rx.stats["nixl_writes_recv"] == 0
