"""The front door's fast lane (``deploy.http.lane``) in one process: the generation
routes are served without FastAPI's request machinery, with the same answers, and every
other request still reaches the FastAPI app. Behind the front door runs a real router
(in process, over a fake hub: ``tests.fakes.RouterPort``) with a prefill and a decode
that the test plays."""

from __future__ import annotations

import asyncio
import json

import pytest

from common.config import ServeConfig
from common.control import (
    CODEC,
    Done,
    Prefilled,
    Ready,
    Register,
    Req,
    StatusReport,
    Submit,
    Tokens,
    unpack_ids,
)
from deploy.http.app import FrontDoor, create_app
from deploy.http.bridge import RouterBridge
from deploy.http.lane import FastLane
from deploy.http.translate import NOT_JSON
from deploy.router.router import Router
from tests.fakes import FakeHub, RouterPort

WORKERS = {"p0": {"role": "prefill", "ready": True, "lost": False, "pid": 1, "paused": ""},
           "d0": {"role": "decode", "ready": True, "lost": False, "pid": 2, "paused": ""}}
CFG = ServeConfig()


def deployment() -> Router:
    """A router with one prefill (p0) and one decode (d0) registered and ready."""
    router = Router(FakeHub(), CFG)
    for name, role in (("p0", "prefill"), ("d0", "decode")):
        router.dispatch(name.encode(), Register(role, name, 100))
        router.dispatch(name.encode(), Ready(name, "ipc:///p0" if role == "prefill" else "",
                                             CFG.pool_tokens(role)))
        router.hub.take(name.encode())
    return router


@pytest.fixture
def lane():
    router = deployment()
    port = RouterPort(router)
    bridge = RouterBridge(port.address, port=port)
    port.attach(None, bridge._dispatch)   # what bridge.start does, without its status loop
    door = FrontDoor(bridge)
    app = create_app(lambda: door)
    app.state.door = door   # what the lifespan does, without the status loop
    bridge._dispatch(CODEC.decode(CODEC.encode(StatusReport(WORKERS, 0, CFG.to_dict()))))
    yield FastLane(app), bridge, port
    door.shutdown("test over")
    router.encoder.close()
    router.hub.close()
    router.ctx.term()


def _scope(method: str, path: str, content_type: bytes | None) -> dict:
    headers = [(b"host", b"test")] + ([(b"content-type", content_type)] if content_type else [])
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "headers": headers,
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}


async def _call(lane: FastLane, method: str, path: str, body: bytes = b"",
                content_type: bytes | None = b"application/json", answer=None,
                port: RouterPort | None = None) -> tuple[int, bytes]:
    """One request through the lane: (status, body). ``answer(req)`` plays the workers
    once the router routed the request (``req``: the decode's ``Req``)."""
    sent: list[dict] = []
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if pending:
            return pending.pop()
        await asyncio.Event().wait()  # the client stays until the response ends

    async def send(message):
        sent.append(message)

    task = asyncio.ensure_future(lane(_scope(method, path, content_type), receive, send))
    if answer is not None:  # play the workers once the router routed the request
        while not task.done() and not any(isinstance(m, Submit) for m in port.sent):
            await asyncio.sleep(0)
        (req,) = port.router.hub.take(b"d0", Req)
        answer(req)
    await asyncio.wait_for(task, 5.0)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_a_stream_goes_through_the_lane_to_the_router_and_back(lane):
    asgi, bridge, port = lane
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, "return_token_ids": True,
                       "ignore_eos": True}).encode()

    def workers(req: Req) -> None:
        port.worker_says(b"p0", Tokens(req.rid, [11], first=True))
        port.worker_says(b"d0", Tokens(req.rid, [11], first=True), Tokens(req.rid, [12]),
                         Done(req.rid, "length", 2))
        port.worker_says(b"p0", Prefilled(req.rid, "sent"))

    status, out = asyncio.run(_call(asgi, "POST", "/v1/completions", body, answer=workers,
                                     port=port))
    assert status == 200
    (submit,) = [m for m in port.sent if isinstance(m, Submit)]
    assert unpack_ids(submit.prompt).tolist() == [5, 6, 7]
    assert submit.params["max_new_tokens"] == 2 and submit.params["temperature"] == 0
    events = [e[len("data: "):] for e in out.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["token_ids"] for c in chunks if c["choices"]] == [[11], [12], []]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    assert chunks[-1]["usage"]["prompt_tokens"] == 3
    assert {c["id"] for c in chunks} == {submit.rid}


@pytest.mark.parametrize("body, content_type, param, message", [
    (b'{"prompt": [1, 2]}', b"text/plain", "body", NOT_JSON),
    (b'{"prompt": [1, 2]}', None, "body", NOT_JSON),
    (b"", b"application/json", "body", NOT_JSON),
    (b"{not json", b"application/json", "body", NOT_JSON),
    (b"[1, 2]", b"application/json; charset=utf-8", "body", NOT_JSON),
    (b'{"prompt": [1, 2], "max_tokens": "many"}', b"application/json", "max_tokens",
     "max_new_tokens='many'; allowed: integers in [1, "),
    (b'{"prompt": [1, 2], "whatever": 1}', b"application/vnd.x+json", "whatever",
     "unrecognized request argument: whatever"),
    (b'{"prompt": [1, 2], "n": 3}', b"application/json", "n", "n=3"),
    (b'{"prompt": [1, 2], "model": "gpt-4"}', b"application/json", "model", "gpt-4"),
])
def test_the_lane_refuses_as_the_app_does(lane, body, content_type, param, message):
    asgi, _, port = lane
    status, out = asyncio.run(_call(asgi, "POST", "/v1/completions", body, content_type))
    err = json.loads(out)["error"]
    assert status == (404 if param == "model" else 400), err
    assert err["param"] == param and message in err["message"], err
    submitted = [m for m in port.sent if isinstance(m, Submit)]
    assert len(submitted) == (param != "body")   # the router's door refused the others
    assert not port.router.hub.take(b"d0") and not port.router.routes


def test_chat_is_in_the_lane_too(lane):
    asgi, _, port = lane
    status, out = asyncio.run(_call(asgi, "POST", "/v1/chat/completions",
                                    b'{"messages": []}'))
    assert status == 400 and json.loads(out)["error"]["param"] == "messages"


def test_every_other_request_reaches_the_app(lane):
    asgi, _, _ = lane
    status, out = asyncio.run(_call(asgi, "GET", "/v1/completions"))
    assert status == 405 and json.loads(out)["error"]["type"] == "invalid_request_error"
    status, out = asyncio.run(_call(asgi, "GET", "/health"))
    assert status == 200 and json.loads(out)["status"] == "ok"
