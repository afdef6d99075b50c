"""A decode connecting to prefills without waiting for them (``KvReceiver.begin_connect``):
a silent, refusing or slow prefill holds up only the requests announced to it.

Sender and receiver in this process over ipc, both polled from the test's one thread:
with a blocking handshake that thread could not serve the sender while it connects, so
these stories are only possible when nothing waits.
"""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from tests.transport_helpers import config, layout, make_cache, pattern, read_row, write_row
from transport import EventKind, KvReceiver, KvSender

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ends(tmp_path):
    """(sender, receiver, a ROUTER that never answers, its address); all closed after."""
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.bind(f"ipc://{tmp_path}/silent.sock")
    made: list = []

    def make(**kw):
        tx = KvSender(make_cache(64, 4, layout(), node="p"), f"ipc://{tmp_path}/p.sock",
                      config("p"))
        rx = KvReceiver(make_cache(64, 4, layout(), node="d"), config("d", **kw))
        made.extend([tx, rx])
        return tx, rx, silent, f"ipc://{tmp_path}/silent.sock"

    yield make
    for end in made:
        end.close()
    silent.close(linger=0)
    ctx.term()


def _row(cache, rid, n, seed=None):
    kv = cache.open_row(rid)
    cache.extend(kv, n)
    if seed is not None:
        write_row(cache, kv, pattern(seed, n, cache.layout, 0, 4))
    return kv


def _until(rx, tx, want, rows=None, timeout_s=10.0):
    """Poll both ends until the receiver's events include ``want`` (rid, kind); the
    sender sends each request of ``rows`` (rid -> its row) once announced."""
    events, deadline = [], time.monotonic() + timeout_s
    while want not in {(e.rid, e.kind) for e in events}:
        assert time.monotonic() < deadline, events
        events += rx.poll(0.005)
        for ev in tx.poll(0.0):
            if ev.kind == EventKind.READY:
                tx.finish(ev.rid, rows[ev.rid], 7)
    return events


def test_a_silent_prefill_holds_up_only_the_requests_announced_to_it(ends):
    tx, rx, _, silent = ends(handshake_timeout_s=600.0)
    dead = rx.begin_connect(silent)                      # returns at once
    waiting = _row(rx.cache, "w", 16)
    rx.announce("w", waiting, 16, group=dead)
    assert rx.num_pins == 0 and "w" not in rx.transfers  # waits, pinning nothing
    live = rx.begin_connect(tx.address)
    kv_d = _row(rx.cache, "r", 30)
    rx.announce("r", kv_d, 30, group=live)
    kv_p = _row(tx.cache, "r", 30, seed=1)
    events = _until(rx, tx, ("r", EventKind.COMPLETED), {"r": kv_p})
    assert [(e.rid, e.first_token) for e in events if e.kind.is_final] == [("r", 7)]
    assert read_row(rx.cache, kv_d, 0, 30).equal(pattern(1, 30, tx.cache.layout, 0, 4))
    assert rx.link.is_connecting(dead) and not rx.group_lost(dead)
    assert rx.abort("w") and not rx.abort("w")           # it never reached a prefill


def test_a_handshake_past_its_deadline_fails_the_requests_that_waited(ends):
    tx, rx, _, silent = ends(handshake_timeout_s=0.3)
    group = rx.begin_connect(silent)
    for rid in ("a", "b"):
        rx.announce(rid, _row(rx.cache, rid, 8), 8, group=group)
    events = _until(rx, tx, ("b", EventKind.FAILED))
    failed = {e.rid: e for e in events if e.kind == EventKind.FAILED}
    assert set(failed) == {"a", "b"} and {e.reason for e in failed.values()} == {"error"}
    assert "no Hello within 0.3s" in failed["a"].detail and silent in failed["a"].detail
    assert rx.group_lost(group) and rx.stats["timeouts.handshake"] == 1
    assert rx.num_pins == 0 and rx.sockets() == []       # its socket closed
    again = rx.begin_connect(tx.address)                 # the worker connects anew
    rx.announce("c", _row(rx.cache, "c", 8), 8, group=again)
    _until(rx, tx, ("c", EventKind.COMPLETED), {"c": _row(tx.cache, "c", 8, seed=2)})


def test_a_prefill_that_differs_fails_the_waiting_requests_naming_the_field(ends, tmp_path):
    tx, rx, _, _ = ends()
    other = KvSender(make_cache(64, 4, layout(dtype="float16"), node="p2"),
                     f"ipc://{tmp_path}/p2.sock", config("p2"))
    try:
        group = rx.begin_connect(other.address)
        rx.announce("x", _row(rx.cache, "x", 8), 8, group=group)
        events = _until(rx, other, ("x", EventKind.FAILED))
        detail = next(e.detail for e in events if e.rid == "x")
        assert "mismatch on dtype" in detail
        assert rx.group_lost(group) and rx.stats["errors.handshake"] == 1
    finally:
        other.close()


def test_the_blocking_connect_still_waits_and_raises(ends):
    tx, rx, _, silent = ends(handshake_timeout_s=0.3)
    with pytest.raises(TimeoutError, match="no Hello"):
        rx.connect(silent)
    assert rx.stats["timeouts.handshake"] == 1 and not rx.link.connecting


def test_failed_connects_are_remembered_within_a_bound(ends, tmp_path):
    """A decode retries a refusing prefill at every request it admits: the reasons kept
    are bounded (``MAX_FAILED``, the newest), and a group whose reason was dropped is
    still lost, never taken for a live one."""
    from transport.receiver_link import MAX_FAILED

    tx, rx, _, _ = ends()
    other = KvSender(make_cache(64, 4, layout(dtype="float16"), node="p2"),
                     f"ipc://{tmp_path}/p2.sock", config("p2"))
    try:
        groups = []
        for _ in range(MAX_FAILED + 8):
            groups.append(rx.begin_connect(other.address))
            while rx.link.is_connecting(groups[-1]):
                other.poll(0.0)
                rx.poll(0.002)
        assert len(rx.link.failed) == MAX_FAILED
        assert list(rx.link.failed) == groups[-MAX_FAILED:]         # the newest kept
        assert "mismatch on dtype" in str(rx.link.failed[groups[-1]])
        assert all(rx.group_lost(g) for g in groups)                # the oldest too
        with pytest.raises(ValueError, match="is gone"):
            rx.link.legs_for(groups[0])
        assert rx.stats["errors.handshake"] == MAX_FAILED + 8
        good = rx.begin_connect(tx.address)                         # and a good one joins
        rx.announce("g", _row(rx.cache, "g", 8), 8, group=good)
        _until(rx, tx, ("g", EventKind.COMPLETED), {"g": _row(tx.cache, "g", 8, seed=3)})
        assert not rx.group_lost(good) and list(rx.link.groups) == [good]
    finally:
        other.close()


def test_peers_that_come_and_go_leave_nothing_behind(ends, tmp_path):
    """A prefill restarted at its address five times, and a decode that reconnects five
    times: each end keeps one peer (and the decode one socket), not one per reconnect,
    and a peer forgets each request once it closed; a stranger answered with an error
    leaves no trace either. Every request lands byte-exact."""
    _, rx, _, _ = ends()
    address = f"ipc://{tmp_path}/restarted.sock"
    for n in range(5):
        tx = KvSender(make_cache(64, 4, layout(), node="p"), address, config("p"))
        try:
            group = rx.begin_connect(tx.address)
            rid = f"r{n}"
            kv = _row(rx.cache, rid, 8)
            rx.announce(rid, kv, 8, group=group)
            _until(rx, tx, (rid, EventKind.COMPLETED), {rid: _row(tx.cache, rid, 8, seed=n)})
            assert torch.equal(read_row(rx.cache, kv, 0, 8),
                               pattern(n, 8, rx.cache.layout, 0, 4))
            deadline = time.monotonic() + 5
            while any(p.rids for p in [*rx.peers.values(), *tx.peers.values()]):
                assert time.monotonic() < deadline, "a closed request stays with its peer"
                rx.poll(0.002)
                tx.poll(0.0)
        finally:
            tx.close()
        deadline = time.monotonic() + 5
        while rx.peers:   # the prefill's Bye
            assert time.monotonic() < deadline, dict(rx.stats)
            rx.poll(0.002)
        assert len(rx.link.sockets) == 0 and len(rx.peers) == 0 and not rx.link.paths

    tx = KvSender(make_cache(64, 4, layout(), node="p"), address, config("p"))
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.DEALER)
    try:
        for _ in range(5):
            d = KvReceiver(make_cache(64, 4, layout(), node="d2"), config("d2"))
            d.begin_connect(tx.address)
            while not tx.peers:
                tx.poll(0.002)
                d.poll(0.0)
            d.close()
            while tx.peers:
                tx.poll(0.002)
        stranger.connect(tx.address)
        stranger.send(b"not a message")
        deadline = time.monotonic() + 5
        while tx.stats["errors.malformed"] == 0:
            assert time.monotonic() < deadline, dict(tx.stats)
            tx.poll(0.002)
        assert len(tx.peers) == 0 and not tx.link.paths and not tx.link._last_sent
    finally:
        stranger.close(linger=0)
        ctx.term()
        tx.close()
