"""Transport pieces on their own: codec, TP head mapping, coalescing, in-process pairs."""

from __future__ import annotations

import re
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from common.kv import page_runs
from tests.transport_helpers import config, layout, make_cache, pattern, read_row, write_row
from transport import EventKind, HandshakeError, KvReceiver, KvSender
from transport.integrity import pack_epochs
from transport.messages import (
    AbortAck,
    ErrorCode,
    Heartbeat,
    Hello,
    KvChunk,
    ProtocolError,
    Register,
    decode,
    encode,
    pages_from_bytes,
    pages_to_bytes,
)
from transport.tp import overlap, peer_ranks, rank_heads

pytestmark = pytest.mark.timeout(60)


# -- codec ---------------------------------------------------------------------------------
def test_every_message_round_trips_and_page_ids_are_int32_bytes():
    msg = Register(rid="r1", prompt_len=33, cached_tokens=16,
                   dest_pages=pages_to_bytes([5, 6, 9]),
                   dest_epochs=pack_epochs(np.array([7, 7, 8], np.uint64)))
    assert decode(encode(msg)) == msg
    assert len(msg.dest_epochs) == 32     # two runs of (epoch, count): (7, 2), (8, 1)
    assert msg.dest_pages == b"\x05\x00\x00\x00\x06\x00\x00\x00\x09\x00\x00\x00"
    assert pages_from_bytes(msg.dest_pages).tolist() == [5, 6, 9]


@pytest.mark.parametrize("frame, code", [
    (b"\xc1garbage", ErrorCode.MALFORMED),
    (encode(AbortAck(rid="r"))[:-2], ErrorCode.MALFORMED),
    (msgpack.packb([1, 2]), ErrorCode.MALFORMED),
    (msgpack.packb({"t": "Pickle", "rid": "r"}), ErrorCode.UNKNOWN_TYPE),
    (msgpack.packb({"t": ["list"]}), ErrorCode.UNKNOWN_TYPE),
    (msgpack.packb({"t": "AbortAck"}), ErrorCode.MISSING_FIELD),
    (msgpack.packb({"t": "AbortAck", "rid": 7}), ErrorCode.BAD_FIELD),
    (msgpack.packb({"t": "KvWritten", "rid": "r", "first_block": 0, "num_blocks": True,
                    "head_start": 0, "head_end": 1}), ErrorCode.BAD_FIELD),
    (msgpack.packb({"t": "Done", "rid": "r", "num_blocks": 1, "first_token": 1}),
     ErrorCode.UNKNOWN_TYPE),                      # version 4 has no Done: never sent
    (b"\x00" * 70000, ErrorCode.OVERSIZED),
])
def test_bad_control_frames_are_protocol_errors_never_crashes(frame, code):
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    assert info.value.code == code


_HELLO = dict(version=4, node="evil", role="decode", model="", num_layers=2,
              num_draft_layers=1, total_kv_heads=4, head_dim=8, dtype="float32",
              page_size=4, tp_rank=0, tp_size=1, lease_ms=1000)


@pytest.mark.parametrize("kind, fields, what", [
    ("Hello", {**_HELLO, "shm_pages": -1, "shm_pool": "psm_x"}, "shm_pages=-1"),
    ("Hello", {**_HELLO, "shm_pool": "../../etc/passwd", "shm_pages": 8}, "segment name"),
    ("Hello", {**_HELLO, "shm_pool": "a/b"}, "segment name"),
    ("Hello", {**_HELLO, "shm_pool": ".."}, "segment name"),
    ("Hello", {**_HELLO, "tp_rank": 2, "tp_size": 2}, "tp_rank=2"),
    ("Hello", {**_HELLO, "lease_ms": 0}, "lease_ms=0"),
    ("Hello", {**_HELLO, "num_layers": -3}, "num_layers=-3"),
    ("Hello", {**_HELLO, "role": "router"}, "role"),
    ("Hello", {**_HELLO, "node": "a\nFAKE LOG LINE"}, "printable"),
    ("Hello", {**_HELLO, "kv_digest": "md5"}, "kv_digest='md5'"),
    ("Register", {"rid": "r", "prompt_len": -5, "cached_tokens": 0, "dest_pages": b"",
                  "dest_epochs": b""}, "prompt_len=-5"),
    ("Register", {"rid": "r", "prompt_len": 8, "cached_tokens": 8,
                  "dest_pages": b"\1\0\0\0\2\0\0\0", "dest_epochs": b""},
     "cached_tokens=8"),                          # the last position is always sent
    ("Register", {"rid": "r", "prompt_len": 4, "cached_tokens": 0,
                  "dest_pages": b"\1\0\0\0", "dest_epochs": b"\1" * 15}, "dest_epochs"),
    ("Register", {"rid": "", "prompt_len": 4, "cached_tokens": 0,
                  "dest_pages": b"\1\0\0\0", "dest_epochs": b""}, "rid must be"),
    ("Register", {"rid": "x" * 600, "prompt_len": 4, "cached_tokens": 0,
                  "dest_pages": b"\1\0\0\0", "dest_epochs": b""}, "rid must be"),
    ("KvChunk", {"rid": "r", "first_block": -1, "num_blocks": 1, "head_start": 0,
                 "head_end": 4, "nbytes": 8}, "first_block=-1"),
    ("KvChunk", {"rid": "r", "first_block": 0, "num_blocks": 0, "head_start": 0,
                 "head_end": 4, "nbytes": 8}, "num_blocks=0"),
    ("KvWritten", {"rid": "r", "first_block": 0, "num_blocks": 1, "head_start": 3,
                   "head_end": 1}, "head_end=1"),
    ("KvWritten", {"rid": "r", "first_block": 0, "num_blocks": 1, "head_start": 0,
                   "head_end": 1, "first_token": -7}, "first_token=-7"),
    ("KvChunk", {"rid": "r", "first_block": 0, "num_blocks": 1, "head_start": 0,
                 "head_end": 4, "nbytes": 8, "digest": -1}, "digest=-1"),
    ("Abort", {"rid": "r", "reason": "finished", "detail": ""}, "reason='finished'"),
    ("Heartbeat", {"seq": -1}, "seq=-1"),
])
def test_every_field_is_range_checked_when_decoded(kind, fields, what):
    with pytest.raises(ProtocolError, match=re.escape(what)) as info:
        decode(msgpack.packb({"t": kind, **fields}, use_bin_type=True))
    assert info.value.code == ErrorCode.BAD_FIELD


def test_long_or_unprintable_details_are_cut_not_refused():
    from transport.messages import Abort, Error
    msg = decode(encode(Error(code="x", detail="a\x1b[31m" + "b" * 9000, rid="")))
    assert len(msg.detail) == 4096 and msg.detail.startswith("a?[31m")
    assert decode(encode(Abort(rid="r", reason="timeout", detail="ok"))).detail == "ok"


def test_the_segment_token_never_shows_in_a_repr():
    hello = Hello(**_HELLO, shm_pool="psm_1", shm_pages=4, shm_token=b"secret-token")
    assert "secret" not in repr(hello) and decode(encode(hello)).shm_token == b"secret-token"


def test_ragged_page_id_bytes_are_rejected():
    with pytest.raises(ProtocolError, match="int32"):
        pages_from_bytes(b"\x01\x00\x00")


# -- TP head mapping -----------------------------------------------------------------------
def test_head_ranges_split_evenly_and_refuse_uneven_splits():
    assert [rank_heads(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="split evenly"):
        rank_heads(6, 4, 0)


@pytest.mark.parametrize("p_size, d_size, legs", [
    (2, 1, {(0, 0): (0, 4), (1, 0): (4, 8)}),
    (1, 2, {(0, 0): (0, 4), (0, 1): (4, 8)}),
    (2, 4, {(0, 0): (0, 2), (0, 1): (2, 4), (1, 2): (4, 6), (1, 3): (6, 8)}),
    (4, 2, {(0, 0): (0, 2), (1, 0): (2, 4), (2, 1): (4, 6), (3, 1): (6, 8)}),
])
def test_each_decode_rank_receives_exactly_its_heads(p_size, d_size, legs):
    got = {(p, d): overlap(8, p_size, p, d_size, d)
           for p in range(p_size) for d in range(d_size)
           if overlap(8, p_size, p, d_size, d) is not None}
    assert got == legs
    for d in range(d_size):
        assert peer_ranks(8, d_size, d, p_size) == sorted(p for p, dd in legs if dd == d)


def test_frames_are_cut_at_gaps_and_at_the_frame_cap():
    pages = np.array([3, 4, 5, 9, 10, 11, 12, 13, 2])
    assert page_runs(pages, max_len=3) == [(3, 3, 3), (9, 9, 3), (12, 12, 2), (2, 2, 1)]
    assert page_runs(np.array([], np.int64), max_len=4) == []


# -- in-process pairs ----------------------------------------------------------------------
class Pair:
    """A sender and a receiver in this process over ipc; the sender is polled by hand,
    except during the blocking handshake. ``shared``: the decode pool is in shared memory."""

    def __init__(self, tmp_path, p_layout=None, d_layout=None, p_page=4, d_page=4,
                 shared=False, p_kw=None, **kw):
        self.pc = make_cache(64, p_page, p_layout or layout(), node="p")
        self.dc = make_cache(64, d_page, d_layout or layout(), node="d", shared=shared)
        self.tx = KvSender(self.pc, f"ipc://{tmp_path}/p.sock",
                           config("p", **kw, **(p_kw or {})))
        self.rx = KvReceiver(self.dc, config("d", **kw))
        self.tx_events = []

    def connect(self):
        stop = threading.Event()

        def serve():
            while not stop.is_set():
                self.tx_events.extend(self.tx.poll(0.005))
        thread = threading.Thread(target=serve)
        thread.start()
        try:
            return self.rx.connect(self.tx.address)
        finally:
            stop.set()
            thread.join()

    def close(self):
        self.tx.close()
        self.rx.close()


@pytest.fixture
def pair(tmp_path):
    p = Pair(tmp_path)
    p.connect()
    yield p
    p.close()


def _rows(pair, rid, n, seed=1):
    kv_p = pair.pc.open_row(rid)
    pair.pc.extend(kv_p, n)
    write_row(pair.pc, kv_p, pattern(seed, n, pair.pc.layout, 0, 4))
    kv_d = pair.dc.open_row(rid)
    pair.dc.extend(kv_d, n)
    return kv_p, kv_d


def test_destination_pages_stay_pinned_after_a_decode_abort_until_the_prefill_acks(pair):
    free0 = pair.dc.num_free_pages()
    kv_p, kv_d = _rows(pair, "r1", 30)                     # 8 pages of 4 slots each side
    pair.rx.announce("r1", kv_d, 30)
    assert [e.kind for e in pair.tx.poll(0.5)] == [EventKind.READY]
    pair.tx.send("r1", kv_p, 13)                             # blocks 0..2 (the 13th waits)
    leg = next(iter(pair.rx.transfers["r1"].legs.values()))
    deadline = time.monotonic() + 2
    while leg.blocks_received < 3 and time.monotonic() < deadline:
        pair.rx.poll(0.01)
    assert leg.blocks_received == 3
    assert pair.rx.abort("r1")
    pair.dc.free_kv_row(kv_d, [(0, 30)], reason="aborted")  # the worker frees at once
    pair.dc.close_row(kv_d)
    pair.rx.poll(0.05)
    assert pair.dc.num_free_pages() == free0 - 8            # pinned: the prefill may write
    events = pair.tx.poll(0.5)
    assert [(e.kind, e.reason) for e in events] == [(EventKind.ABORTED, "aborted")]
    assert pair.tx.send("r1", kv_p, 30) is False             # nothing pinned any more
    pair.pc.free_kv_row(kv_p, [(0, 30)], reason="aborted")
    pair.pc.close_row(kv_p)
    deadline = time.monotonic() + 2
    while pair.dc.num_free_pages() != free0 and time.monotonic() < deadline:
        pair.rx.poll(0.01)
        pair.tx.poll(0.0)
    assert pair.dc.num_free_pages() == free0 and pair.rx.num_pins == 0
    assert pair.tx.num_pins == 0 and pair.pc.num_free_pages() == free0
    pair.dc.check_integrity()
    pair.pc.check_integrity()


def test_source_pages_stay_pinned_until_sent_and_the_row_free_is_deferred(pair):
    free0 = pair.pc.num_free_pages()
    kv_p, kv_d = _rows(pair, "r1", 17)
    pair.tx.send("r1", kv_p, 8)          # before the Register: pinned, queued
    assert pair.tx.num_pins == 1
    pair.rx.announce("r1", kv_d, 17)
    pair.tx_events += pair.tx.poll(0.5)
    pair.tx.finish("r1", kv_p, first_token=99)
    pair.pc.free_kv_row(kv_p, [(0, 17)], reason="sent")
    pair.pc.close_row(kv_p)
    assert pair.pc.num_free_pages() < free0            # still pinned by the transport
    events = []
    deadline = time.monotonic() + 2
    while len(events) < 1 and time.monotonic() < deadline:
        events += pair.rx.poll(0.01)
        pair.tx_events += pair.tx.poll(0.0)
    assert [(e.kind, e.first_token) for e in events] == [(EventKind.COMPLETED, 99)]
    assert torch_equal(read_row(pair.dc, kv_d, 0, 17), pattern(1, 17, pair.pc.layout, 0, 4))
    while pair.tx.transfers and time.monotonic() < deadline:
        pair.tx_events += pair.tx.poll(0.01)
    assert [e.kind for e in pair.tx_events if e.rid] == [EventKind.READY,
                                                         EventKind.COMPLETED]
    assert pair.pc.num_free_pages() == free0 and pair.tx.num_pins == 0



def test_source_pins_drop_in_the_poll_that_reports_completed(pair):
    """COMPLETED is the prefill's own transfer reporting done (the last frame's tracker):
    its pins are gone by then, so the worker's row free right after it is immediate."""
    free0 = pair.pc.num_free_pages()
    kv_p, kv_d = _rows(pair, "r1", 17)
    pair.rx.announce("r1", kv_d, 17)
    assert [e.kind for e in pair.tx.poll(0.5)] == [EventKind.READY]
    pair.tx.finish("r1", kv_p, first_token=7)
    deadline = time.monotonic() + 2
    done = []
    while not done and time.monotonic() < deadline:
        pair.rx.poll(0.01)
        done = [e for e in pair.tx.poll(0.01) if e.kind == EventKind.COMPLETED]
    assert [(e.rid, e.reason) for e in done] == [("r1", "sent")]
    assert pair.tx.num_pins == 0 and "r1" not in pair.tx.transfers
    pair.pc.free_kv_row(kv_p, [(0, 17)], reason="sent")
    pair.pc.close_row(kv_p)
    assert pair.pc.num_free_pages() == free0
    pair.pc.check_integrity()

def test_requests_queued_behind_a_busy_prefill_outlive_the_chunk_deadline(tmp_path):
    """Saturation in small: the decode registers every request at once, the prefill (alive:
    polled, heartbeating) starts them one by one, the last ones long after
    ``chunk_timeout_s``. The deadline measures a stalled transfer, not the queue: every
    request completes on both sides, none fails on a timeout."""
    pair = Pair(tmp_path, chunk_timeout_s=0.3, lease_s=2.0)
    pair.connect()
    try:
        rids = [f"r{i}" for i in range(6)]
        rows = {rid: _rows(pair, rid, 9, seed=i) for i, rid in enumerate(rids)}
        for rid in rids:
            pair.rx.announce(rid, rows[rid][1], 9)
        events, tx_events = [], []

        def run(seconds):
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                events.extend(pair.rx.poll(0.005))
                tx_events.extend(pair.tx.poll(0.0))

        run(1.0)                      # the queue: nothing handed over for 3x the deadline
        for i, rid in enumerate(rids):  # then one request per "step", 0.1 s apart
            pair.tx.send(rid, rows[rid][0], 4)
            run(0.1)
            pair.tx.finish(rid, rows[rid][0], first_token=i)
            run(0.1)
        deadline = time.monotonic() + 3
        while len([e for e in events if e.rid]) < len(rids) and time.monotonic() < deadline:
            run(0.05)
        assert {e.rid: (e.kind, e.reason) for e in events if e.rid} == {
            rid: (EventKind.COMPLETED, "") for rid in rids}
        run(0.2)
        assert {e.rid: e.kind for e in tx_events if e.kind.is_final} == {
            rid: EventKind.COMPLETED for rid in rids}
        for i, rid in enumerate(rids):
            assert torch_equal(read_row(pair.dc, rows[rid][1], 0, 9),
                               pattern(i, 9, pair.pc.layout, 0, 4))
        assert pair.rx.stats["timeouts.progress"] == pair.tx.stats["timeouts.progress"] == 0
    finally:
        pair.close()


def test_a_request_the_prefill_never_starts_fails_on_the_overall_deadline(tmp_path):
    """Not started is not forever: ``done_timeout_s`` (the client's deadline) ends a
    registered request the live prefill never hands over, on both sides."""
    pair = Pair(tmp_path, chunk_timeout_s=0.2, done_timeout_s=0.8, lease_s=2.0)
    pair.connect()
    try:
        kv_p, kv_d = _rows(pair, "r", 9)
        t0 = time.monotonic()
        pair.rx.announce("r", kv_d, 9)
        events, tx_events = [], []
        while not (events and tx_events) and time.monotonic() - t0 < 3:
            events += [e for e in pair.rx.poll(0.005) if e.rid]
            tx_events += [e for e in pair.tx.poll(0.0) if e.kind.is_final]
        waited = time.monotonic() - t0
        assert [(e.kind, e.reason) for e in events] == [(EventKind.FAILED, "timeout")]
        assert "done_timeout_s" in events[0].detail
        # the prefill's own deadline or the decode's Abort, whichever lands first
        assert [e.reason for e in tx_events] == ["timeout"]
        assert 0.7 < waited < 2.0   # the overall deadline, not the 0.2 s chunk deadline
    finally:
        pair.close()


def torch_equal(a, b):
    import torch
    return torch.equal(a, b)


@pytest.mark.parametrize("field, p_kw, d_kw", [
    ("page_size", {"p_page": 4}, {"d_page": 16}),
    ("dtype", {"p_layout": layout(dtype="float16")}, {}),
    ("num_draft_layers", {"p_layout": layout().__class__(num_layers=2, num_kv_heads=4,
                                                          head_dim=8)}, {}),
    ("total_kv_heads", {"p_layout": layout(total_heads=8)}, {}),
])
def test_handshake_mismatch_is_an_error_on_both_sides_naming_the_field(tmp_path, field,
                                                                       p_kw, d_kw):
    pair = Pair(tmp_path, **p_kw, **d_kw)
    try:
        with pytest.raises(HandshakeError, match=f"mismatch on {field}"):
            pair.connect()
        failed = [e for e in pair.tx_events if e.kind == EventKind.HANDSHAKE_FAILED]
        assert len(failed) == 1 and f"mismatch on {field}" in failed[0].detail
        assert pair.tx.stats["errors.handshake"] == 1 and not pair.tx.peers
    finally:
        pair.close()


def test_handshake_times_out_instead_of_hanging(tmp_path):
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.bind(f"ipc://{tmp_path}/silent.sock")
    rx = KvReceiver(make_cache(16, 4, layout()), config("d", handshake_timeout_s=0.3))
    try:
        with pytest.raises(TimeoutError, match="no Hello"):
            rx.connect(f"ipc://{tmp_path}/silent.sock")
        assert rx.stats["timeouts.handshake"] == 1
    finally:
        rx.close()
        silent.close(linger=0)
        ctx.term()


# -- a misbehaving peer: errors answered and counted, the endpoint keeps serving ---------
def raw(kind: str, **fields) -> bytes:
    """A control frame as a hostile peer writes it: no checks on our side."""
    return msgpack.packb({"t": kind, **fields}, use_bin_type=True)


def _raw_dealer(ctx, address, hello: Hello | None):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    if hello is not None:
        sock.send(encode(hello))
    return sock


def _answers(tx, sock, n):
    got = []
    deadline = time.monotonic() + 3
    while len(got) < n and time.monotonic() < deadline:
        tx.poll(0.01)
        while sock.poll(0):
            msg = decode(sock.recv_multipart()[0])
            if not isinstance(msg, Heartbeat):  # they start right after the Hello
                got.append(msg)
    return got


def test_prefill_answers_garbage_with_errors_and_keeps_serving(pair):
    ctx = zmq.Context()
    hello = pair.rx.hello
    evil = _raw_dealer(ctx, pair.tx.address, None)
    try:
        evil.send(encode(AbortAck(rid="x")))                  # before any Hello
        assert _answers(pair.tx, evil, 1)[0].code == "not_handshaken"
        evil.send(encode(hello))
        assert isinstance(_answers(pair.tx, evil, 1)[0], Hello)
        evil.send(b"\xc1\xc1")                                 # malformed
        evil.send_multipart([encode(AbortAck(rid="x")), b"extra"])  # may carry no frame
        evil.send(msgpack.packb({"t": "Register", "rid": "a"}))  # truncated message
        evil.send(raw("Register", rid="a", prompt_len=8, cached_tokens=0,
                      dest_pages=b"\x01\x00", dest_epochs=b""))    # ragged page ids
        evil.send(encode(KvChunk(rid="a", first_block=0, num_blocks=1, head_start=0,
                                 head_end=4, nbytes=4)))         # decode-only message
        codes = [m.code for m in _answers(pair.tx, evil, 5)]
        assert codes == ["malformed", "extra_frames", "missing_field", "bad_field",
                         "bad_field"]
        assert pair.tx.stats["errors"] == 6
        kv_p, kv_d = _rows(pair, "ok", 9)                      # the real peer still works
        pair.rx.announce("ok", kv_d, 9)
        pair.tx.poll(0.5)
        pair.tx.finish("ok", kv_p, 5)
        events = []
        deadline = time.monotonic() + 2
        while not events and time.monotonic() < deadline:
            events = pair.rx.poll(0.01)
        assert events[0].kind == EventKind.COMPLETED
        assert torch_equal(read_row(pair.dc, kv_d, 0, 9), pattern(1, 9, pair.pc.layout, 0, 4))
    finally:
        evil.close(linger=0)
        ctx.term()


class FakePrefill:
    """A raw ROUTER that answers the Hello and then sends whatever the test says."""

    def __init__(self, tmp_path, rx: KvReceiver):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"ipc://{tmp_path}/fake.sock")
        import dataclasses
        self.hello = dataclasses.replace(rx.hello, role="prefill", node="fake")
        self.peer = None
        stop = threading.Event()
        thread = threading.Thread(target=self._answer_hello, args=(stop,))
        thread.start()
        rx.connect(f"ipc://{tmp_path}/fake.sock")
        stop.set()
        thread.join()

    def _answer_hello(self, stop):
        while not stop.is_set() and self.peer is None:
            if self.sock.poll(10):
                self.peer, _ = self.sock.recv_multipart()
                self.sock.send_multipart([self.peer, encode(self.hello)])

    def send(self, *frames):
        self.sock.send_multipart([self.peer, *frames])

    def recv_all(self):
        out = []
        while self.sock.poll(50):
            out.append(decode(self.sock.recv_multipart()[1]))
        return out

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()


def fake_chunk(dc, kv, rid: str, first: int, num: int, nbytes: int, payload=None,
               first_token=None, epochs=None) -> bytes:
    """A KvChunk header as a prefill writes it: the registration's epochs of its pages,
    the payload's digest, the first token on the last one."""
    from common.kv import digest_of_bytes
    ps = dc.page_size
    if epochs is None:
        epochs = dc.page_epochs(kv, first * ps, min((first + num) * ps, kv.allocated_len)) \
            if first * ps < kv.allocated_len else np.ones(num, np.uint64)
    digest = None if payload is None else digest_of_bytes(
        "xxh3_64", np.frombuffer(payload, np.uint8).reshape(num, -1))
    return encode(KvChunk(rid=rid, first_block=first, num_blocks=num, head_start=0,
                          head_end=4, nbytes=nbytes, epochs=pack_epochs(epochs),
                          digest=digest, first_token=first_token))


def test_decode_answers_bad_frames_and_unknown_rids_and_keeps_serving(tmp_path):
    dc = make_cache(64, 4, layout())
    rx = KvReceiver(dc, config("d", lease_s=30.0))
    fake = FakePrefill(tmp_path, rx)
    try:
        free0 = dc.num_free_pages()
        rows = {}
        for rid in ("bad1", "bad2", "bad3", "good"):
            rows[rid] = dc.open_row(rid)
            dc.extend(rows[rid], 8)
            rx.announce(rid, rows[rid], 8)
        block = dc.data()[0].numel() * 4
        fake.send(fake_chunk(dc, rows["good"], "nobody", 0, 1, block), b"\0" * block)
        fake.send(fake_chunk(dc, rows["bad1"], "bad1", 0, 1, block))          # truncated
        fake.send(fake_chunk(dc, rows["bad2"], "bad2", 0, 1, block),
                  b"\0" * (block + 8))                                       # oversized
        fake.send(fake_chunk(dc, rows["bad3"], "bad3", 5, 1, block),
                  b"\0" * block)                                             # outside
        good = pattern(3, 8, dc.layout, 0, 4)
        write_row(dc, rows["good"], good)  # what the fake "sends", then wiped
        payload = dc.data()[dc.pages(rows["good"], 0, 8)].numpy().tobytes()
        dc.data().zero_()
        fake.send(fake_chunk(dc, rows["good"], "good", 0, 2, 2 * block, payload,
                             first_token=11), payload)   # data and completion at once
        events = []
        deadline = time.monotonic() + 3
        while len(events) < 4 and time.monotonic() < deadline:
            events += rx.poll(0.01)
        kinds = {e.rid: (e.kind, e.reason) for e in events}
        assert kinds == {"bad1": (EventKind.FAILED, "error"),
                         "bad2": (EventKind.FAILED, "error"),
                         "bad3": (EventKind.FAILED, "error"),
                         "good": (EventKind.COMPLETED, "")}
        assert [e.first_token for e in events if e.rid == "good"] == [11]
        assert torch_equal(read_row(dc, rows["good"], 0, 8), good)
        codes = [m.code for m in fake.recv_all() if type(m).__name__ == "Error"]
        assert sorted(codes) == ["bad_range", "oversized", "truncated", "unknown_rid"]
        assert rx.stats["errors"] == 4
        for rid, kv in rows.items():
            dc.free_kv_row(kv, [(0, 8)], reason="aborted" if "bad" in rid else "finished")
            dc.close_row(kv)
        for msg in ("bad1", "bad2", "bad3"):   # the fake confirms it stopped
            fake.send(encode(AbortAck(rid=msg)))
        deadline = time.monotonic() + 2
        while rx.transfers and time.monotonic() < deadline:
            rx.poll(0.01)
        assert dc.num_free_pages() == free0 and rx.num_pins == 0
        dc.check_integrity()
    finally:
        rx.close()
        fake.close()


def test_progress_deadline_then_lease_frees_the_destination(tmp_path):
    """A prefill that stalls after its first chunk: the progress deadline fails the
    request (its Abort goes unanswered), then the prefill's lease frees the pages."""
    dc = make_cache(64, 4, layout())
    rx = KvReceiver(dc, config("d", chunk_timeout_s=0.3, lease_s=0.8, heartbeat_s=0.1))
    fake = FakePrefill(tmp_path, rx)   # one chunk, then silence (no heartbeat either)
    try:
        free0 = dc.num_free_pages()
        kv = dc.open_row("r")
        dc.extend(kv, 8)
        t0 = time.monotonic()
        rx.announce("r", kv, 8)
        payload = dc.data()[dc.pages(kv, 0, 4)].numpy().tobytes()
        fake.send(fake_chunk(dc, kv, "r", 0, 1, len(payload), payload), payload)
        events = []
        while not events and time.monotonic() - t0 < 3:
            events = rx.poll(0.01)
        assert [(e.kind, e.reason) for e in events] == [(EventKind.FAILED, "timeout")]
        dc.free_kv_row(kv, [(0, 8)], reason="timeout")
        dc.close_row(kv)
        assert dc.num_free_pages() == free0 - 2        # the Abort is not acknowledged yet
        lost = []
        while not lost and time.monotonic() - t0 < 3:
            lost = [e for e in rx.poll(0.01) if e.kind == EventKind.PEER_LOST]
        rx.poll(0.0)
        assert dc.num_free_pages() == free0 and time.monotonic() - t0 < 1.5
        assert [type(m).__name__ for m in fake.recv_all()].count("Abort") == 1
    finally:
        rx.close()
        fake.close()


# -- shared memory: head-sliced copies, negotiation and its fallbacks ---------------------
@pytest.mark.parametrize("src_heads, dst_heads", [((0, 4), (0, 4)), ((2, 4), (0, 2)),
                                                  ((0, 2), (2, 4))])
def test_shm_copy_matches_a_per_page_reference_across_gaps_and_head_slices(src_heads,
                                                                            dst_heads):
    import torch

    from common.kv import copy_pages
    from transport.pool_view import HostPoolView
    src = torch.randn(16, 3, 2, 4, 4, 8)
    dst, want = torch.zeros_like(src), torch.zeros_like(src)
    sp, dp = np.array([3, 4, 5, 9, 10, 11]), np.array([7, 8, 2, 3, 4, 12])
    assert page_runs(sp, dp) == [(3, 7, 2), (5, 2, 1), (9, 3, 2), (11, 12, 1)]
    s, d = slice(*src_heads), slice(*dst_heads)
    assert copy_pages(HostPoolView(src).shaped, sp, HostPoolView(dst).shaped, dp, src_heads=s,
                      dst_heads=d) == 4
    for a, b in zip(sp, dp):
        want[b, :, :, :, d] = src[a, :, :, :, s]
    assert torch.equal(dst, want)


def _connect_and_transfer(pair, n=30):
    pair.connect()
    kv_p, kv_d = _rows(pair, "r1", n)
    pair.rx.announce("r1", kv_d, n)
    assert [e.kind for e in pair.tx.poll(0.5)] == [EventKind.READY]
    pair.tx.finish("r1", kv_p, 7)
    events, deadline = [], time.monotonic() + 3
    while not events and time.monotonic() < deadline:
        events += pair.rx.poll(0.01)
        pair.tx.poll(0.0)
    assert [(e.kind, e.first_token) for e in events] == [(EventKind.COMPLETED, 7)]
    assert torch_equal(read_row(pair.dc, kv_d, 0, n), pattern(1, n, pair.pc.layout, 0, 4))


@pytest.mark.parametrize("shared, p_kw, other_host, path", [
    (True, {}, False, "shm"),
    (False, {}, False, "zmq"),                          # decode pool is private
    (True, {"shared_memory": False}, False, "zmq"),     # prefill declines
    (True, {}, True, "zmq"),                            # not the same host
])
def test_shm_is_negotiated_and_falls_back_to_frames(tmp_path, shared, p_kw, other_host, path):
    import dataclasses
    pair = Pair(tmp_path, shared=shared, p_kw=p_kw)
    if other_host:
        pair.tx.link.hello = dataclasses.replace(pair.tx.hello, host_id="elsewhere/boot")
    try:
        _connect_and_transfer(pair)
        assert bool(pair.tx.link.shm) == (path == "shm")
        assert (pair.tx.stats["shm_writes"] > 0) == (path == "shm")
        assert (pair.tx.stats["frames_sent"] > 0) == (path == "zmq")
        assert pair.rx.stats["frames_recv_one_run"] == pair.rx.stats["frames_recv"]
    finally:
        pair.close()


def test_a_version_1_hello_fails_on_version_not_on_a_missing_field():
    from transport.messages import PROTOCOL_VERSION
    v2 = Hello(version=PROTOCOL_VERSION, node="p", role="prefill", model="", num_layers=2,
               num_draft_layers=1, total_kv_heads=4, head_dim=8, dtype="float32",
               page_size=4, tp_rank=0, tp_size=1, lease_ms=1000)
    body = msgpack.unpackb(encode(v2))
    for name in ("host_id", "shm_pool", "shm_pages"):
        del body[name]
    body["version"] = 1
    v1 = decode(msgpack.packb(body))
    assert v1.version == 1 and v1.shm_pool == ""
    from transport.handshake import check
    with pytest.raises(HandshakeError, match="mismatch on version"):
        check(dataclasses_replace(v2, role="decode"), v1)


def dataclasses_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)
