"""Text requests at the router, in process: encoded on threads, never in the loop.

A ``GatedDoor`` (a real ``Door`` whose encoding waits for the test's word) holds a text in
its encoding while the test sends other messages, so every order below is an order of
events, not of timings."""

from __future__ import annotations

import threading
import time

import pytest

from common.config import ServeConfig
from common.control import (
    Abort,
    Done,
    Error,
    Ready,
    Register,
    Registered,
    Req,
    Shutdown,
    Submit,
    pack_ids,
    unpack_ids,
)
from common.model import Tokenizer
from deploy.router.door import Door
from deploy.router.router import Router
from tests.fakes import FakeHub, settle

CFG = ServeConfig(page_size=4, decode_pages=101, prefill_pages=51, heartbeat_s=0.5,
                  lease_s=3.0)
CLIENT = b"client"


class GatedDoor(Door):
    """A ``Door`` whose text encodings start only once ``gate`` is set; ``started`` is set
    when a thread has begun one."""

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self.gate, self.started = threading.Event(), threading.Event()
        self.fail: Exception | None = None

    def text_job(self, msg: Submit):
        run = super().text_job(msg)

        def gated():
            self.started.set()
            assert self.gate.wait(30), "the test never opened the gate"
            if self.fail is not None:
                raise self.fail
            return run()
        return gated


def _router(**changes) -> Router:
    r = Router(FakeHub(), CFG.with_overrides(**changes))
    for name, role, tokens, addr in (("p0", "prefill", 200, "ipc:///p0"),
                                     ("d0", "decode", 400, "")):
        r.dispatch(name.encode(), Register(role, name, 100))
        assert isinstance(r.hub.take(name.encode())[0], Registered)
        r.dispatch(name.encode(), Ready(name, addr, tokens))
    return r


@pytest.fixture
def router():
    r = _router()
    yield r
    r.door.gate.set() if isinstance(r.door, GatedDoor) else None
    r.encoder.close()
    r.hub.close()
    r.ctx.term()


def _gate(router: Router) -> GatedDoor:
    router.door = GatedDoor(router.config)
    return router.door


def test_a_text_is_encoded_off_the_loop_and_routed_with_the_models_stop_ids(router):
    tok = Tokenizer.for_model(CFG.model_config())
    router.dispatch(CLIENT, Submit("t", b"", {"max_new_tokens": 3}, text="hello world"))
    assert len(router.encoder) == 1 or router.encoder.wait(0)   # queued, or done already
    settle(router)
    (req,) = router.hub.take(b"d0", Req)
    assert unpack_ids(req.prompt, "prompt").tolist() == tok.encode("hello world")
    assert set(tok.eos_token_ids) <= set(req.params["stop_token_ids"])
    assert router.hub.take(b"p0", Req) == [req] and len(router.routes) == 1


def test_requests_after_a_text_being_encoded_are_routed_before_it(router):
    door = _gate(router)
    router.dispatch(CLIENT, Submit("long", b"", {}, text="hello " * 20))
    assert door.started.wait(10)                      # a thread holds it now
    router.dispatch(CLIENT, Submit("ids", pack_ids([1] * 8), {}))
    router._tick_encoded(time.monotonic())
    assert [r.label for r in router.hub.take(b"d0", Req)] == ["ids"]   # routed at once
    door.gate.set()
    settle(router)
    assert [r.label for r in router.hub.take(b"d0", Req)] == ["long"]


def test_an_abort_while_encoding_answers_aborted_and_nothing_reaches_a_worker(router):
    door = _gate(router)
    router.dispatch(CLIENT, Submit("t", b"", {}, text="hello world"))
    assert door.started.wait(10)
    router.dispatch(CLIENT, Submit("t", b"", {}, text="again"))        # label in flight
    (err,) = router.hub.take(CLIENT, Error)
    assert err.code == "bad_request" and "being encoded" in err.error
    router.dispatch(CLIENT, Abort("t"))
    (done,) = router.hub.take(CLIENT, Done)
    assert (done.rid, done.reason) == ("t", "aborted") and len(router.encoder) == 0
    door.gate.set()                                   # its encoding ends: dropped
    assert router.encoder.busy == 0 or _drained(router)
    router._tick_encoded(time.monotonic())
    assert router.hub.take(b"d0") == [] and router.hub.take(b"p0") == []
    assert router.hub.take(CLIENT) == [] and len(router.routes) == 0
    router.dispatch(CLIENT, Abort("t"))               # a second abort: unknown now
    assert router.hub.take(CLIENT, Error)[0].code == "unknown_rid"


def _drained(router: Router) -> bool:
    deadline = time.monotonic() + 10
    while router.encoder.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    return router.encoder.busy == 0


def test_a_text_past_its_deadline_gets_its_own_error_and_the_late_result_is_dropped():
    router = _router(encode_timeout_s=0.2)
    try:
        door = _gate(router)
        router.dispatch(CLIENT, Submit("slow", b"", {}, text="hello world"))
        assert door.started.wait(10)
        router._tick_encoded(time.monotonic() + 0.5)      # the loop's clock passed it
        (err,) = router.hub.take(CLIENT, Error)
        assert err.code == "encode_timeout" and "encode_timeout_s=0.2" in err.error
        door.gate.set()
        assert _drained(router)
        router._tick_encoded(time.monotonic())
        assert router.hub.take(b"d0") == [] and router.hub.take(CLIENT) == []
        assert router.errors["encode_timeout"] == 1
    finally:
        router.door.gate.set()
        router.encoder.close()
        router.hub.close()
        router.ctx.term()


def test_a_full_encoding_queue_refuses_at_once_and_a_failing_encoding_fails_alone():
    router = _router(encode_queue=1)
    try:
        door = _gate(router)
        door.fail = RuntimeError("tokenizer exploded")
        router.dispatch(CLIENT, Submit("a", b"", {}, text="hello"))
        router.dispatch(CLIENT, Submit("b", b"", {}, text="world"))
        (err,) = router.hub.take(CLIENT, Error)
        assert (err.rid, err.code) == ("b", "overloaded") and "encode_queue=1" in err.error
        door.gate.set()
        settle(router)
        (err,) = router.hub.take(CLIENT, Error)
        assert (err.rid, err.code) == ("a", "encode_failed")
        assert "tokenizer exploded" in err.error
        door.fail = None
        router.dispatch(CLIENT, Submit("c", b"", {}, text="hello"))       # room again
        settle(router)
        assert [r.label for r in router.hub.take(b"d0", Req)] == ["c"]
        families = {f.name: f for f in router.metrics.node.collect()}
        failures = {s.labels["reason"]: s.value
                    for s in families["pdkv_text_encode_failures"].samples
                    if s.name.endswith("_total")}
        assert failures == {"overloaded": 1.0, "error": 1.0}
    finally:
        router.door.gate.set()
        router.encoder.close()
        router.hub.close()
        router.ctx.term()


def test_texts_still_encoding_at_shutdown_are_told_so(router):
    door = _gate(router)
    router.dispatch(CLIENT, Submit("t", b"", {}, text="hello"))
    assert door.started.wait(10)
    router.dispatch(b"op", Shutdown())
    (err,) = router.hub.take(CLIENT, Error)
    assert (err.rid, err.code) == ("t", "shutdown")
    door.gate.set()
    assert _drained(router)
    router._tick_encoded(time.monotonic())
    assert router.hub.take(b"d0", Req) == []
