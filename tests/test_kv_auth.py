"""The KV plane's authentication and per-request capabilities (transport/capability.py),
in process on real sockets: a prefill endpoint, its decode, and a stranger decode.
Process-level attack stories: tests/test_attacks.py."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
import zmq

from common.auth import InsecureBind, new_kv_plane
from tests.transport_helpers import config, layout, make_cache, pattern, read_row, write_row
from transport import EventKind, KvReceiver, KvSender

pytestmark = pytest.mark.timeout(120)
CAP = "c0ffee" * 5 + "00"


class Plane:
    """A prefill (requires capabilities) and decodes connected with ``auth``."""

    def __init__(self, tmp_path, mechanism: str = "curve", **kw):
        self.auth = new_kv_plane(mechanism)
        self.pc = make_cache(64, 4, layout(), node="p")
        self.tx = KvSender(self.pc, "tcp://127.0.0.1:*",
                           config("p", require_capability=True, **kw), auth=self.auth)
        self.decodes: list[tuple[KvReceiver, object]] = []
        self.tx_events: list = []

    def decode(self, name: str, auth=None) -> tuple[KvReceiver, object]:
        cache = make_cache(64, 4, layout(), node=name)
        rx = KvReceiver(cache, config(name), auth=auth or self.auth)
        self.decodes.append((rx, cache))
        stop = threading.Event()

        def serve():   # the prefill answers the handshake while connect blocks
            while not stop.is_set():
                self.tx_events.extend(self.tx.poll(0.005))
        thread = threading.Thread(target=serve)
        thread.start()
        try:
            rx.connect(self.tx.address)
        finally:
            stop.set()
            thread.join()
        return rx, cache

    def pump(self, until, deadline_s: float = 10.0) -> None:
        deadline = time.monotonic() + deadline_s
        while not until() and time.monotonic() < deadline:
            self.tx_events.extend(self.tx.poll(0.005))
            for rx, _ in self.decodes:
                rx.events_seen = getattr(rx, "events_seen", []) + rx.poll(0.005)
        assert until(), "the plane did not get there in time"

    def close(self):
        for rx, cache in self.decodes:
            rx.close()
            cache.close()
        self.tx.close()
        self.pc.close()


@pytest.fixture
def plane(tmp_path):
    p = Plane(tmp_path)
    yield p
    p.close()


def _rows(cache, rid, n, seed=None):
    kv = cache.open_row(rid)
    cache.extend(kv, n)
    if seed is not None:
        write_row(cache, kv, pattern(seed, n, cache.layout, 0, 4))
    return kv


def _kinds(rx, rid):
    return [e.kind for e in getattr(rx, "events_seen", []) if e.rid == rid]


def _serve_one(plane, rx, dcache, rid, *, announce_first: bool, evil=None):
    """The prefill sends rid (17 tokens) to the decode holding ``CAP``; ``evil`` (a
    decode without it) announces the same rid first. Returns the decode's row."""
    kv_p = _rows(plane.pc, rid, 17, seed=3)
    kv_d = _rows(dcache, rid, 17)
    if evil is not None:
        erx, ecache = evil
        erx.announce(rid, _rows(ecache, rid, 17), 17, cap="guessed")
        plane.pump(lambda: plane.tx.stats["held.announce"] >= 1 or
                   plane.tx.stats["refused.announce"] >= 1)
    if announce_first:
        rx.announce(rid, kv_d, 17, cap=CAP)
        plane.pump(lambda: plane.tx.stats["held.announce"] >= 1 + (evil is not None))
        assert not any(e.kind == EventKind.READY for e in plane.tx_events)  # held
        plane.tx.expect(rid, CAP)
    else:
        plane.tx.expect(rid, CAP)
        rx.announce(rid, kv_d, 17, cap=CAP)
    plane.pump(lambda: any(e.kind == EventKind.READY and e.rid == rid
                           for e in plane.tx_events))
    plane.tx.finish(rid, kv_p, first_token=42)
    plane.pump(lambda: EventKind.COMPLETED in _kinds(rx, rid))
    assert torch.equal(read_row(dcache, kv_d, 0, 17), pattern(3, 17, plane.pc.layout, 0, 4))
    plane.pump(lambda: any(e.kind == EventKind.COMPLETED and e.rid == rid
                           for e in plane.tx_events))
    plane.pc.free_kv_row(kv_p, [(0, 17)], reason="sent")
    plane.pc.close_row(kv_p)
    return kv_d


@pytest.mark.parametrize("announce_first", [False, True])
def test_kv_goes_to_the_decode_with_the_capability(plane, announce_first):
    rx, dcache = plane.decode("d0")
    _serve_one(plane, rx, dcache, "r1", announce_first=announce_first)
    assert plane.tx.stats["refused.announce"] == 0


@pytest.mark.parametrize("evil_first", [False, True])
def test_an_announce_with_a_wrong_capability_is_refused_and_harmless(plane, evil_first):
    """Both orders: the forged announce is held then refused when the worker learns the
    capability, or refused at once when it knew it already."""
    rx, dcache = plane.decode("d0")
    erx, ecache = plane.decode("evil")
    _serve_one(plane, rx, dcache, "r1", announce_first=evil_first, evil=(erx, ecache))
    plane.pump(lambda: EventKind.FAILED in _kinds(erx, "r1"))
    assert plane.tx.stats["refused.announce"] == 1
    assert plane.tx.stats["errors.forbidden"] == 1
    assert erx.stats["errors_recv"] >= 1 and "bytes_recv" not in erx.stats
    # the stranger's destination pages were never written
    assert ecache.data().abs().sum().item() == 0


def test_an_announce_for_a_request_that_never_comes_is_refused_after_the_hold(tmp_path):
    plane = Plane(tmp_path, admission_timeout_s=0.3)
    try:
        erx, ecache = plane.decode("evil")
        erx.announce("ghost", _rows(ecache, "ghost", 9), 9, cap="x")
        plane.pump(lambda: plane.tx.stats["refused.announce"] == 1)
        assert plane.tx.caps.num_held == 0
        plane.pump(lambda: EventKind.FAILED in _kinds(erx, "ghost"))
    finally:
        plane.close()


def test_held_announces_are_bounded():
    """A peer cannot fill the prefill's memory with announces no request will claim."""
    from collections import Counter

    from transport.capability import Capabilities
    from transport.messages import ProtocolError, Register
    from transport.peers import Peer

    stats = Counter()
    caps = Capabilities(True, hold_s=5.0, stats=stats)
    peer = Peer(b"evil", hello=None, last_seen=0.0)
    held = [caps.admit(peer, Register("r", 1, 0, b"\0\0\0\0", b"", cap=str(i)), 0.0)
            for i in range(8)]
    assert held == [False] * 8 and caps.num_held == 8
    with pytest.raises(ProtocolError, match="too many"):
        caps.admit(peer, Register("r", 1, 0, b"\0\0\0\0", b"", cap="9"), 0.0)
    ready, refused = caps.expect("r", "3")
    assert [h.msg.cap for h in ready] == ["3"] and len(refused) == 7
    assert stats["refused.announce"] == 8 and caps.num_held == 0
    for i in range(1100):   # many rids: 1024 held in all
        try:
            caps.admit(peer, Register(f"g{i}", 1, 0, b"\0\0\0\0", b"", cap=""), 1.0)
        except ProtocolError:
            pass
    assert caps.num_held == 1024
    assert len(caps.expire(7.0)) == 1024 and caps.num_held == 0


@pytest.mark.parametrize("mechanism", ["curve", "plain"])
def test_a_decode_without_this_runs_credentials_cannot_connect(tmp_path, mechanism):
    plane = Plane(tmp_path, mechanism, handshake_timeout_s=1.0)
    try:
        with pytest.raises(TimeoutError, match="KV credentials refused"):
            plane.decode("stranger", auth=new_kv_plane(mechanism))
        assert not plane.tx.peers
    finally:
        plane.close()


def test_without_credentials_a_prefill_binds_only_loopback():
    cache = make_cache(8, 4, layout(), node="p")
    try:
        with pytest.raises(InsecureBind, match="--auth-keys"):
            KvSender(cache, "tcp://0.0.0.0:*", config("p"))
    finally:
        cache.close()


def test_an_announce_made_while_the_handshake_runs_keeps_its_capability(plane):
    """A serving decode announces at once to a group still connecting (``begin_connect``):
    the announcement waits for the handshake and then goes out with its capability."""
    cache = make_cache(64, 4, layout(), node="d0")
    rx = KvReceiver(cache, config("d0"), auth=plane.auth)
    plane.decodes.append((rx, cache))
    group = rx.begin_connect(plane.tx.address)
    kv_p, kv_d = _rows(plane.pc, "r1", 17, seed=3), _rows(cache, "r1", 17)
    plane.tx.expect("r1", CAP)
    rx.announce("r1", kv_d, 17, group=group, cap=CAP)    # parked: no handshake yet
    plane.pump(lambda: any(e.kind == EventKind.READY and e.rid == "r1"
                           for e in plane.tx_events))
    assert plane.tx.stats["refused.announce"] == 0
    plane.tx.finish("r1", kv_p, first_token=42)
    plane.pump(lambda: EventKind.COMPLETED in _kinds(rx, "r1"))
    assert torch.equal(read_row(cache, kv_d, 0, 17), pattern(3, 17, plane.pc.layout, 0, 4))
    plane.pump(lambda: any(e.kind == EventKind.COMPLETED and e.rid == "r1"
                           for e in plane.tx_events))
    plane.pc.free_kv_row(kv_p, [(0, 17)], reason="sent")
    plane.pc.close_row(kv_p)



def _serve_when_free(auth, sock: zmq.Socket, address: str, timeout_s: float = 5.0):
    """``auth.serve(sock, address)`` once the port is free: a closed socket's listener is
    closed by libzmq's I/O thread after ``close()`` returns, so rebinding its port at once
    can meet EADDRINUSE (seen in CI)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return auth.serve(sock, address)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def test_a_decode_whose_connection_was_refused_never_blocks_on_a_send(tmp_path):
    """The prefill dies without a word and a server that refuses this decode's key binds
    its address (it holds the plane's server keys, so the handshake gets as far as ZAP).
    The decode's DEALER reconnects there and is refused; libzmq then drops that
    connection for good instead of reconnecting, and a blocking send (the next
    heartbeat) would wait forever. The decode goes on polling and declares the peer
    lost at its lease."""
    plane = Plane(tmp_path)
    rx, _ = plane.decode("d0")
    plane.tx.link.router.close()  # the prefill's process is gone: no Bye
    other = zmq.Context()
    refusing = other.socket(zmq.ROUTER)
    refusing.linger = 0
    someone = new_kv_plane("curve")
    refuser = dataclasses.replace(plane.auth, allowed=((someone.public, "someone"),))
    guard = None
    try:
        guard = _serve_when_free(refuser, refusing, plane.tx.address)
        lost, deadline = [], time.monotonic() + 10.0
        while not lost and time.monotonic() < deadline:
            lost = [e for e in rx.poll(0.05) if e.kind == EventKind.PEER_LOST]
        assert lost, "the decode did not declare the prefill lost within 10 s"
        assert rx.stats["msgs_unsent"] >= 1  # a heartbeat met the dropped connection
        assert guard.refused >= 1
    finally:
        refusing.close(0)
        if guard is not None:
            guard.close()
        other.term()
        for peer in list(plane.tx.peers.values()):  # no Bye from a process that is gone
            plane.tx.peers.mark_lost(peer, "gone")
        plane.close()
