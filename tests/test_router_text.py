"""The router's door and text route in process (a fake hub; the test plays the workers).

The door is the only admission: parameters by name, one set of limits, one error
vocabulary (codes), one stop policy (every stop id travels to the workers; a stop string
is cut here and the decode told to finish). Long texts are encoded on threads, never in
the loop: a ``GatedDoor`` (a real ``Door`` whose long encodings wait for the test's word)
holds one while the test sends other messages, so every order below is an order of
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
    Prefilled,
    Ready,
    Register,
    Registered,
    Req,
    Shutdown,
    Stop,
    Submit,
    Tokens,
    pack_ids,
    unpack_ids,
)
from common.model import Tokenizer
from deploy.router.door import LOOP_TEXT_CHARS, Door
from deploy.router.params import SAMPLING
from deploy.router.router import Router
from tests.fakes import FakeHub, settle

CFG = ServeConfig(page_size=4, decode_pages=101, prefill_pages=51, heartbeat_s=0.5,
                  lease_s=3.0)
CLIENT = b"client"
TOK = Tokenizer.for_model(CFG.model_config())
EOS = list(TOK.eos_token_ids)
LONG = "the " * (LOOP_TEXT_CHARS // 4 + 10)   # encoded on a thread; ~1050 tokens


def words(text: str) -> list[int]:
    """``text`` as output ids (no bos)."""
    return [t for t in TOK.encode(text) if t != 1]


class GatedDoor(Door):
    """A ``Door`` whose long texts start encoding only once ``gate`` is set; ``started``
    is set when a thread has begun one."""

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self.gate, self.started = threading.Event(), threading.Event()
        self.fail: Exception | None = None

    def encode(self, ask):
        if self.off_loop(ask):
            self.started.set()
            assert self.gate.wait(30), "the test never opened the gate"
            if self.fail is not None:
                raise self.fail
        return super().encode(ask)


def _router(**changes) -> Router:
    r = Router(FakeHub(), CFG.with_overrides(**changes))
    for name, role, tokens, addr in (("p0", "prefill", 2000, "ipc:///p0"),
                                     ("d0", "decode", 4000, "")):
        r.dispatch(name.encode(), Register(role, name, 100))
        assert isinstance(r.hub.take(name.encode())[0], Registered)
        r.dispatch(name.encode(), Ready(name, addr, tokens))
    return r


def _close(r: Router) -> None:
    if isinstance(r.door, GatedDoor):
        r.door.gate.set()
    r.encoder.close()
    r.hub.close()
    r.ctx.term()


@pytest.fixture
def router():
    r = _router()
    yield r
    _close(r)


def _gate(router: Router) -> GatedDoor:
    router.door = GatedDoor(router.config)
    return router.door


def _routed(router: Router, msg: Submit) -> Req:
    router.dispatch(CLIENT, msg)
    settle(router)
    (req,) = router.hub.take(b"d0", Req)
    assert router.hub.take(b"p0", Req) == [req]
    return req


def _refused(router: Router, msg: Submit) -> Error:
    in_flight = len(router.routes)
    router.dispatch(CLIENT, msg)
    settle(router)
    (err,) = router.hub.take(CLIENT, Error)
    assert err.rid == msg.rid and not router.hub.take(b"d0")
    assert len(router.routes) == in_flight
    return err


# -- the stop policy ----------------------------------------------------------------------
def test_every_stop_id_and_the_models_eos_travel_to_the_workers(router):
    req = _routed(router, Submit("a", pack_ids([5] * 8), {"stop_token_ids": [40, 41]}))
    assert req.params["stop_token_ids"] == [40, 41, *EOS] and req.params["stop_token"] == -1
    req = _routed(router, Submit("b", pack_ids([5] * 8), {"stop_token_ids": [40],
                                                          "ignore_eos": True}))
    assert req.params["stop_token_ids"] == [40]
    req = _routed(router, Submit("c", pack_ids([5] * 8), {"stop_token": 7}))   # older name
    assert req.params["stop_token_ids"] == [7, *EOS] and req.params["stop_token"] == -1
    req = _routed(router, Submit("d", b"", {"max_new_tokens": 3}, text="hello world"))
    assert unpack_ids(req.prompt, "prompt").tolist() == TOK.encode("hello world")
    assert req.params["stop_token_ids"] == EOS


def test_a_stop_id_ends_the_output_and_its_text_is_not_shown(router):
    out = words("hello world") + [40]
    req = _routed(router, Submit("a", pack_ids([5] * 8), {"stop_token_ids": [99, 40]}))
    router.dispatch(b"d0", Tokens(req.rid, out[:1], first=True))
    router.dispatch(b"d0", Tokens(req.rid, out[1:]))
    router.dispatch(b"d0", Done(req.rid, "stop", n=len(out)))
    router.dispatch(b"p0", Prefilled(req.rid, "sent"))
    got = router.hub.take(CLIENT)
    assert [t for m in got if isinstance(m, Tokens) for t in m.ids] == out
    assert "".join(m.text for m in got if isinstance(m, Tokens)) == "hello world"
    done = got[-1]
    assert (done.reason, done.n, done.text) == ("stop", len(out), "hello world")
    assert not router.hub.take(b"d0", Stop)   # the decode stopped by itself


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_cuts_the_text_and_tells_the_decode_alone_to_finish(router, include):
    body = words("hello world. the end")
    params = {"include_stop_str_in_output": True} if include else {}
    req = _routed(router, Submit("a", b"", params, text="say it", stop=[". the"]))
    router.dispatch(b"p0", Tokens(req.rid, body[:1], first=True))
    for t in body[1:]:
        router.dispatch(b"d0", Tokens(req.rid, [t]))
    assert router.hub.take(b"d0", Stop) == [Stop(req.rid)]   # once, at the cut
    assert router.hub.take(b"p0") == []                       # the prefill ends as always
    streamed = router.hub.take(CLIENT, Tokens)
    want = "hello world. the" if include else "hello world"
    assert "".join(m.text for m in streamed) == want
    ids = [t for m in streamed for t in m.ids]
    assert ids == body[:len(ids)] and len(ids) < len(body)   # up to the one that cut it
    router.dispatch(b"d0", Done(req.rid, "stop", n=len(body)))   # finished, as told
    router.dispatch(b"p0", Prefilled(req.rid, "sent"))
    (done,) = router.hub.take(CLIENT, Done)
    assert (done.reason, done.n, done.text, done.error) == ("stop", len(ids), want, "")


def test_special_tokens_show_only_when_asked(router):
    out = words("hi") + [3] + words(" there")   # 3: a chat turn marker
    marker = TOK.decode([3], skip_special_tokens=False)
    for skip, want in ((True, "hi there"), (False, f"hi{marker} there")):
        req = _routed(router, Submit(f"s{skip}", pack_ids([5] * 4), {
            "skip_special_tokens": skip, "ignore_eos": True}))
        router.dispatch(b"d0", Tokens(req.rid, out, first=True))
        assert "".join(m.text for m in router.hub.take(CLIENT, Tokens)) == want


def test_the_prompt_ids_come_back_when_asked(router):
    req = _routed(router, Submit("a", b"", {"return_token_ids": True}, text="hello world"))
    router.dispatch(b"d0", Tokens(req.rid, [5], first=True))
    router.dispatch(b"d0", Done(req.rid, "length", n=1))
    router.dispatch(b"p0", Prefilled(req.rid, "sent"))
    (done,) = router.hub.take(CLIENT, Done)
    assert unpack_ids(done.prompt_ids).tolist() == TOK.encode("hello world")
    assert done.prompt_tokens == len(TOK.encode("hello world"))


def test_a_chat_answer_runs_to_the_end_of_the_row_unless_capped(router):
    messages = [{"role": "user", "content": "hello"}]
    req = _routed(router, Submit("a", b"", {}, messages=messages))
    n_prompt = len(TOK.encode_chat(messages))
    assert req.params["max_new_tokens"] == min(CFG.max_new_tokens_limit, 4000 - n_prompt)
    long = [{"role": "user", "content": "the " * 1960}]   # the row binds, not the limit
    n_long = len(TOK.encode_chat(long))
    assert 4000 - 2048 < n_long <= 2000, n_long
    req = _routed(router, Submit("c", b"", {}, messages=long))
    assert req.params["max_new_tokens"] == 4000 - n_long
    req = _routed(router, Submit("b", b"", {"max_new_tokens": 5}, messages=messages))
    assert req.params["max_new_tokens"] == 5


# -- one vocabulary, one set of limits, one error vocabulary --------------------------------
def test_neutral_values_of_what_vllm_and_sglang_send_pass_and_others_are_refused(router):
    vllm = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0,
            "min_p": 0.0, "top_k": -1, "top_p": 1.0, "seed": 3, "ignore_eos": True,
            "skip_special_tokens": True, "include_stop_str_in_output": False,
            "stop_token_ids": [7], "n": 1, "best_of": 1, "logprobs": 0, "echo": False,
            "min_tokens": 0, "spaces_between_special_tokens": True, "temperature": 0.0,
            "model": CFG.model}
    req = _routed(router, Submit("a", pack_ids([5] * 8), vllm))
    assert req.params["seed"] == 3 and req.params["stop_token_ids"] == [7]
    for name, value in (("repetition_penalty", 1.1), ("presence_penalty", 0.5),
                        ("frequency_penalty", -0.5), ("min_p", 0.1)):
        msg = Submit(f"x-{name}", pack_ids([5] * 8), {name: value})
        if name in SAMPLING:   # the sampler serves it: it travels to the workers
            assert _routed(router, msg).params[name] == value
            continue
        err = _refused(router, msg)
        assert (err.code, err.param) == ("unsupported", name), err
        assert f"{name}={value!r} is not supported by pdkv" in err.error
    for name, value in (("n", 2), ("logprobs", 3), ("echo", True), ("best_of", 2),
                        ("tools", '[{"type":"function"}]')):
        err = _refused(router, Submit(f"y-{name}", pack_ids([5] * 8), {name: value}))
        assert (err.code, err.param) == ("unsupported", name), err


@pytest.mark.parametrize("params, kw, code, param, words_", [
    ({"temperature": 50}, {}, "bad_request", "temperature", "temperature=50; allowed"),
    ({"whatever": 1}, {}, "bad_request", "whatever",
     "unrecognized request argument: whatever"),
    ({"stop_token_ids": [512]}, {}, "bad_request", "stop_token_ids", "[0, 512)"),
    ({"max_new_tokens": 0}, {}, "bad_request", "max_new_tokens", "max_new_tokens=0"),
    ({"max_new_tokens": 2048}, {"prompt": pack_ids([5] * 1990)}, "bad_request",
     "max_new_tokens", "exceeds the largest pool row (4000 tokens)"),
    ({"model": "gpt-4"}, {}, "model_not_found", "model", "'gpt-4' does not exist"),
    ({"ignore_eos": 1}, {}, "bad_request", "ignore_eos", "true or false"),
    ({}, {"prompt": pack_ids([5] * 2500)}, "context_length_exceeded", "prompt",
     "prompt of 2500 tokens is longer than any pool row or the model's context allows "
     "(2000 tokens"),
    ({}, {"text": "x" * 80_000}, "context_length_exceeded", "prompt",
     "text of 80000 characters exceeds the model's context of 4096 positions"),
    ({}, {"prompt": pack_ids([5, 512])}, "bad_request", "prompt", "[0, 512)"),
    ({}, {"prompt": b""}, "bad_request", "prompt", "empty prompt: send one of"),
    ({}, {"prompt": pack_ids([5]), "text": "hi"}, "bad_request", "prompt", "send only one"),
    ({}, {"text": "hi", "stop": [""]}, "bad_request", "stop", "non-empty"),
    ({}, {"text": "hi", "stop": list("abcde")}, "bad_request", "stop", "at most 4"),
    ({}, {"messages": [{"role": "robot", "content": "hi"}]}, "bad_request", "messages",
     "role='robot'"),
])
def test_a_bad_request_is_refused_with_its_code_and_parameter(router, params, kw, code,
                                                              param, words_):
    prompt = kw.pop("prompt", b"" if kw else pack_ids([5] * 8))
    err = _refused(router, Submit("r", prompt, params, **kw))
    assert (err.code, err.param) == (code, param), err
    assert words_ in err.error, err.error


def test_a_bad_request_is_told_so_even_while_no_worker_is_ready():
    r = Router(FakeHub(), CFG)
    try:
        err = _refused(r, Submit("r", pack_ids([5] * 8), {"temperature": 50}))
        assert (err.code, err.param) == ("bad_request", "temperature")
        err = _refused(r, Submit("s", pack_ids([5] * 8), {}))
        assert err.code == "unavailable" and "no decode" in err.error
    finally:
        _close(r)


# -- long texts off the loop ----------------------------------------------------------------
def test_a_long_text_is_encoded_off_the_loop_and_short_ones_in_it(router):
    router.dispatch(CLIENT, Submit("short", b"", {"max_new_tokens": 3}, text="hello world"))
    assert [q.label for q in router.hub.take(b"d0", Req)] == ["short"]   # at once
    router.dispatch(CLIENT, Submit("long", b"", {"max_new_tokens": 3}, text=LONG))
    assert len(router.encoder) == 1 or router.encoder.wait(0)   # queued, or done already
    settle(router)
    (req,) = router.hub.take(b"d0", Req)
    assert unpack_ids(req.prompt, "prompt").tolist() == TOK.encode(LONG)


def test_requests_after_a_text_being_encoded_are_routed_before_it(router):
    door = _gate(router)
    router.dispatch(CLIENT, Submit("long", b"", {}, text=LONG))
    assert door.started.wait(10)                      # a thread holds it now
    router.dispatch(CLIENT, Submit("ids", pack_ids([1] * 8), {}))
    router.dispatch(CLIENT, Submit("text", b"", {}, text="hello"))
    router._tick_encoded(time.monotonic())
    assert [r.label for r in router.hub.take(b"d0", Req)] == ["ids", "text"]
    door.gate.set()
    settle(router)
    assert [r.label for r in router.hub.take(b"d0", Req)] == ["long"]


def test_an_abort_while_encoding_answers_aborted_and_nothing_reaches_a_worker(router):
    door = _gate(router)
    router.dispatch(CLIENT, Submit("t", b"", {}, text=LONG))
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
        router.dispatch(CLIENT, Submit("slow", b"", {}, text=LONG))
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
        _close(router)


def test_a_full_encoding_queue_refuses_at_once_and_a_failing_encoding_fails_alone():
    router = _router(encode_queue=1)
    try:
        door = _gate(router)
        door.fail = RuntimeError("tokenizer exploded")
        router.dispatch(CLIENT, Submit("a", b"", {}, text=LONG))
        router.dispatch(CLIENT, Submit("b", b"", {}, text=LONG))
        (err,) = router.hub.take(CLIENT, Error)
        assert (err.rid, err.code) == ("b", "overloaded") and "encode_queue=1" in err.error
        door.gate.set()
        settle(router)
        (err,) = router.hub.take(CLIENT, Error)
        assert (err.rid, err.code) == ("a", "encode_failed")
        assert "tokenizer exploded" in err.error
        door.fail = None
        router.dispatch(CLIENT, Submit("c", b"", {}, text=LONG))       # room again
        settle(router)
        assert [r.label for r in router.hub.take(b"d0", Req)] == ["c"]
        families = {f.name: f for f in router.metrics.node.collect()}
        failures = {s.labels["reason"]: s.value
                    for s in families["pdkv_text_encode_failures"].samples
                    if s.name.endswith("_total")}
        assert failures == {"overloaded": 1.0, "error": 1.0}
    finally:
        _close(router)


def test_texts_still_encoding_at_shutdown_are_told_so(router):
    door = _gate(router)
    router.dispatch(CLIENT, Submit("t", b"", {}, text=LONG))
    assert door.started.wait(10)
    router.dispatch(b"op", Shutdown())
    (err,) = router.hub.take(CLIENT, Error)
    assert (err.rid, err.code) == ("t", "shutdown")
    door.gate.set()
    assert _drained(router)
    router._tick_encoded(time.monotonic())
    assert router.hub.take(b"d0", Req) == []
