"""The control plane: typed messages through the one codec, and a router that answers
whatever a peer sends (real ZMQ sockets, the router in this process)."""

from __future__ import annotations

import dataclasses
import threading
import time
import typing

import msgpack
import pytest
import zmq

from common.config import ServeConfig
from common.control import (
    CODEC,
    MAX_CONTROL_BYTES,
    Done,
    Error,
    Link,
    Malformed,
    Message,
    Ping,
    Pong,
    Register,
    Registered,
    Req,
    Status,
    StatusReport,
    Submit,
    Tokens,
    pack_ids,
    poll_for,
)
from deploy.router.client import Client
from deploy.router.router import Router

SAMPLES: list[Message] = [
    Register("decode", "d0", 123),
    Registered(ServeConfig().to_dict()),
    Req("r1", pack_ids([1, 2, 3]), {"max_new_tokens": 4, "temperature": 0.5}, "p0",
        "ipc:///tmp/x", "d0", eager=True),
    Tokens("r1", [5, 6], first=True, t_kv_wall=1.5),
    Done("r1", "length", n=2, xfer_s=0.25, kv_bytes=4096),
    Submit("r1", pack_ids([7]), {"max_new_tokens": 2}),
    StatusReport({"d0": {"role": "decode", "ready": True, "pid": 9}}, 3, {"page_size": 16},
                 {"malformed": 1}),
    Status(), Ping(), Pong(),
]


def test_every_message_type_is_documented_and_round_trips():
    from common.control import messages as control
    types = typing.get_args(control.Message)
    table = control.__doc__
    for cls in types:
        assert f"``{cls.__name__}``" in table, f"{cls.__name__} missing from the table"
        assert cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("), cls
    assert {type(m) for m in SAMPLES} <= set(types)
    for msg in SAMPLES:
        assert CODEC.decode(CODEC.encode(msg)) == msg


@pytest.mark.parametrize("body, code", [
    ({"t": "Register", "role": "decode", "name": "d0"}, "missing_field"),
    ({"t": "Register", "role": "decode", "name": "d0", "pid": "7"}, "bad_field"),
    ({"t": "Submit", "rid": "r", "prompt": b"", "params": {"n": None}}, "bad_field"),
    ({"t": "Tokens", "rid": "r", "ids": [1, True]}, "bad_field"),
    ({"t": "Exec", "rid": "r"}, "unknown_type"),
])
def test_a_message_that_breaks_its_schema_is_refused_with_a_code(body, code):
    with pytest.raises(ValueError) as info:
        CODEC.decode(msgpack.packb(body))
    assert info.value.code == code


@pytest.fixture
def router(tmp_path):
    r = Router(f"ipc://{tmp_path}/router.sock", ServeConfig(page_size=4))
    yield r
    r.hub.close()
    r.ctx.term()


@pytest.fixture
def peer(router):
    link = Link(router.ctx, router.address, "peer")
    yield link
    link.close()


def _exchange(router: Router, peer: Link) -> Message | Malformed:
    """Let the router take one message and answer; returns the answer."""
    item = router.hub.recv(5.0)
    assert item is not None, "the router got nothing"
    router.dispatch(*item)
    got = peer.recv(5.0)
    assert got is not None, "no answer from the router"
    return got


@pytest.mark.parametrize("frames, code", [
    ([b"one", b"two"], "extra_frames"),
    ([b"\xc1\xc1 not msgpack"], "malformed"),
    ([msgpack.packb([1, 2])], "malformed"),
    ([msgpack.packb({"t": "Frobnicate"})], "unknown_type"),
    ([msgpack.packb({"t": "Submit", "rid": "r9", "prompt": 5})], "bad_field"),
])
def test_the_router_answers_a_broken_frame_with_an_error_and_counts_it(router, peer,
                                                                       frames, code):
    peer.send_raw(frames)
    answer = _exchange(router, peer)
    assert isinstance(answer, Error) and answer.code == code, answer
    if code == "bad_field":
        assert answer.rid == "r9"   # the client learns which request was refused
    peer.send(Status())
    report = _exchange(router, peer)   # and it serves on
    assert isinstance(report, StatusReport) and report.errors == {code: 1}


def test_worker_messages_from_a_peer_that_never_registered_are_refused(router, peer):
    peer.send(Done("r1", "length", n=3))
    answer = _exchange(router, peer)
    assert isinstance(answer, Error) and answer.code == "not_registered", answer
    peer.send(Registered({}))   # a router -> worker message sent to the router
    answer = _exchange(router, peer)
    assert isinstance(answer, Error) and answer.code == "unexpected", answer


def test_a_bad_submit_is_an_error_naming_the_problem(router, peer):
    peer.send(Submit("r1", pack_ids([1, 2]), {"top_q": 1}))
    answer = _exchange(router, peer)
    assert isinstance(answer, Error) and answer.rid == "r1"
    assert "unrecognized request argument: top_q" in answer.error and answer.param == "top_q"
    peer.send(Submit("r2", b"\x01\x02\x03", {}))   # not a whole number of int32s
    answer = _exchange(router, peer)
    assert isinstance(answer, Error) and "int32" in answer.error


def test_the_routers_bye_leaves_before_its_socket_closes(tmp_path):
    # The Bye carries every worker's stats and the deployment's final metrics (megabytes
    # for a large one); closing the socket without a linger dropped it about half the
    # time, and the launcher then waited in vain for the final stats. Five rounds: with
    # the old close, all five passing had a chance of about 1%.
    for n in range(5):
        router = Router(f"ipc://{tmp_path}/r{n}.sock", ServeConfig(page_size=4))
        router.metrics.snapshot = lambda: b"m" * 4_000_000
        serving = threading.Thread(target=router.serve)
        serving.start()
        client = Client(router.address)
        try:
            bye = client.shutdown_bye(10.0)
        finally:
            client.close()
            serving.join(10.0)
        assert len(bye.metrics) == 4_000_000 and not serving.is_alive()


def test_control_frames_are_bounded():
    assert MAX_CONTROL_BYTES >= 4 * 1_000_000   # a million-token prompt fits
    big = Submit("r", b"\0" * (MAX_CONTROL_BYTES + 1))
    with pytest.raises(ValueError) as info:
        CODEC.decode(CODEC.encode(big))
    assert info.value.code == "oversized"


def test_messages_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Done("r", "stop").reason = "length"


def test_the_leak_fixture_sees_an_open_socket_and_a_live_context(no_leaked_zmq):
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    assert sock in no_leaked_zmq.sockets and ctx in no_leaked_zmq.contexts
    assert "leaked 1 ZMQ socket(s) ['DEALER'] and 1 context(s)" in no_leaked_zmq.leaks()
    assert sock.closed and ctx.closed and no_leaked_zmq.leaks() == ""


def test_a_wait_shorter_than_a_millisecond_sleeps_instead_of_spinning():
    """ZMQ polls in whole milliseconds: a 0.3 ms wait (like NIXL's progress slices) polls once
    and sleeps the rest; a readable socket answers at once."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://poll-for")
        b.connect("inproc://poll-for")
        poller = zmq.Poller()
        poller.register(b, zmq.POLLIN)
        t0 = time.monotonic()
        for _ in range(20):
            assert poll_for(poller, 0.0003) == []
        assert time.monotonic() - t0 >= 20 * 0.0003   # each waited (poll(0) returns at once)
        a.send(b"x")
        assert poll_for(poller, 0.0003) == [(b, zmq.POLLIN)]
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()
