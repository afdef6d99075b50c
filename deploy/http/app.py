"""The OpenAI-compatible HTTP front door: routes, admission, streaming, shutdown.

``create_app`` builds a FastAPI app in front of a router (``RouterBridge``). A request is
checked (``translate``; a long text is encoded on one of ``encode_threads`` threads, so
that the loop keeps answering everyone else), admitted if fewer than ``max_waiting``
requests wait for their first token or their encoding (else 429), submitted under a
front-door request id of its own, and answered as one JSON body or as Server-Sent Events.
A client that leaves aborts its request; ``FrontDoor.shutdown`` ends every open stream
with an error chunk.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common import trace
from common.config import ServeConfig
from common.metrics import render_snapshot
from deploy.http import errors
from deploy.http.asgi import EventStream, until_disconnect
from deploy.http.bridge import RouterBridge, RouterDown, RouterView
from deploy.http.errors import ApiError, error_body
from deploy.http.generation import Generation
from deploy.http.responses import DONE, Shaper, sse
from deploy.http.schemas import ChatCompletionRequest, CompletionRequest
from deploy.http.text import TextModel, load_text_model
from deploy.http.translate import Limits, Plan, plan_chat, plan_completion, text_chars

logger = logging.getLogger(__name__)

# Texts up to this many characters are encoded on the loop: a few thousand characters
# encode in well under a millisecond, less than a thread's hand-off costs; megabytes
# take seconds, which would stall every other request.
LOOP_TEXT_CHARS = 4096


class FrontDoor:
    """State shared by the routes: the router link, admission, open generations."""

    def __init__(self, bridge: RouterBridge, *, model_name: str = "", api_key: str = "",
                 max_waiting: int = 256, encode_threads: int = 2) -> None:
        if max_waiting < 1 or encode_threads < 1:
            raise ValueError(f"max_waiting={max_waiting} and encode_threads={encode_threads}"
                             " must be >= 1")
        self.bridge, self.api_key, self.max_waiting = bridge, api_key, max_waiting
        self.model_name = model_name
        self.live: set[Generation] = set()
        self.encoding = 0  # requests whose text a thread encodes now or soon
        self._encoder = ThreadPoolExecutor(encode_threads, thread_name_prefix="pdkv-encode")
        self.closing = ""
        self._limits: tuple[int, Limits] | None = None
        self._text: tuple[int, TextModel | None] | None = None
        self.t_created = int(time.time())

    # -- what the deployment allows --------------------------------------------------------
    def view(self) -> RouterView:
        """The router's last status; 503 while the deployment cannot serve."""
        if self.closing:
            raise ApiError(503, f"the server is shutting down ({self.closing})")
        view = self.bridge.view
        if view is None or self.bridge.router_lost:
            raise ApiError(503, f"the router at {self.bridge.address} is not answering")
        ok, why = view.ready()
        if not ok:
            raise ApiError(503, f"not ready: {why}")
        return view

    def served_model(self, view: RouterView) -> str:
        return self.model_name or ServeConfig.from_dict(view.config).model_name

    def limits(self, view: RouterView) -> Limits:
        key = id(view.config)
        if self._limits is None or self._limits[0] != key:
            self._limits = (key, Limits.from_config(view.config, self.served_model(view),
                                                    view.colocated))
        return self._limits[1]

    def text(self, view: RouterView) -> TextModel | None:
        key = id(view.config)
        if self._text is None or self._text[0] != key:
            self._text = (key, load_text_model(view.config))
        return self._text[1]

    def check_key(self, request: Request) -> None:
        if not self.api_key:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer "
                                "KEY' with the key the server was started with",
                           code="invalid_api_key")

    # -- serving -------------------------------------------------------------------------
    def _refuse_if_full(self) -> None:
        waiting = sum(1 for g in self.live if g.waiting) + self.encoding
        if waiting >= self.max_waiting:
            raise ApiError(429, f"{waiting} requests are waiting for their first token or "
                                f"their encoding (the front door holds at most "
                                f"{self.max_waiting}); retry later", code="rate_limit_exceeded",
                           headers={"retry-after": "1"})

    async def plan(self, body, chat: bool, lim: Limits, text: TextModel | None) -> Plan:
        """The request checked and its text encoded: on the loop when it is short, else on
        an encoding thread (counted as waiting, so admission bounds the threads' queue)."""
        make = plan_chat if chat else plan_completion
        if text is None or text_chars(body) <= LOOP_TEXT_CHARS:
            return make(body, lim, text)
        self._refuse_if_full()
        self.encoding += 1
        try:
            plan = await asyncio.get_running_loop().run_in_executor(
                self._encoder, make, body, lim, text)
        except asyncio.CancelledError:
            if not self.closing:
                raise  # the request itself was cancelled
            plan = None  # shutdown cancelled the encoding
        finally:
            self.encoding -= 1
        if self.closing:
            raise ApiError(503, f"the server is shutting down ({self.closing})")
        return plan

    def admit(self, plan: Plan, text: TextModel | None) -> Generation:
        self._refuse_if_full()
        stream = text.stream(plan.prompt, plan.stop_strs) if text is not None else None
        gen = Generation(self.bridge, plan, stream)
        try:
            gen.start()
        except RouterDown as exc:
            raise ApiError(503, str(exc)) from None
        self.live.add(gen)
        return gen

    async def serve(self, request: Request, body, chat: bool):
        t_in = trace.now_ns()
        self.check_key(request)
        view = self.view()
        lim, text = self.limits(view), self.text(view)
        plan = await self.plan(body, chat, lim, text)
        gen = self.admit(plan, text)
        trace.mark("http.request_in", gen.rid, t_in)
        trace.mark("http.submit_out", gen.rid)
        shaper = Shaper(gen, lim.model, chat)
        if plan.stream:
            return EventStream(self._stream(gen, shaper))
        try:
            text_out = await until_disconnect(self._collect(gen), request.receive)
        except ConnectionAbortedError:
            return JSONResponse({}, status_code=499)  # nobody reads it
        finally:
            self._forget(gen)
        if gen.failed_reason:
            raise ApiError(503 if self.closing else 500,
                           f"request failed ({gen.failed_reason}): {gen.error}")
        return JSONResponse(shaper.body(text_out))

    async def _collect(self, gen: Generation) -> str:
        return "".join([d.text async for d in gen.deltas()])

    async def _stream(self, gen: Generation, shaper: Shaper) -> AsyncIterator[bytes]:
        try:
            first = shaper.first_chunk()
            if first is not None:
                yield first
            async for delta in gen.deltas():
                yield shaper.chunk(delta)
                if trace.enabled() and delta.ids and len(gen.ids) == len(delta.ids):
                    trace.mark("http.first_out", gen.rid)  # written: the next one is asked
            if gen.failed_reason:
                yield sse(error_body(503 if self.closing else 500,
                                     f"request failed ({gen.failed_reason}): {gen.error}"))
            elif gen.plan.include_usage:
                yield shaper.usage_chunk()
            yield DONE
        finally:
            self._forget(gen)

    def _forget(self, gen: Generation) -> None:
        gen.close()
        self.live.discard(gen)

    def shutdown(self, why: str) -> None:
        """Refuse new requests; end every open one with an error (streams get an error
        chunk and ``[DONE]``), aborting it on the router."""
        self.closing = why
        self._encoder.shutdown(wait=False, cancel_futures=True)
        for gen in list(self.live):
            gen.interrupt(f"the server is shutting down ({why})")

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no request is open at the front door; False past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.live


def create_app(door_factory, *, title: str = "pdkv") -> FastAPI:
    """The app; ``door_factory()`` builds the ``FrontDoor`` inside the server's loop."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        door: FrontDoor = door_factory()
        app.state.door = door
        door.bridge.start()
        try:
            await door.bridge.status(timeout_s=5.0)  # know the deployment before serving
        except RouterDown as exc:
            logger.warning("http: %s; answering 503 until it does", exc)
        try:
            yield
        finally:
            door.shutdown("stopping")
            await door.drained(2.0)
            await door.bridge.close()

    app = FastAPI(title=title, lifespan=lifespan, docs_url="/docs", redoc_url=None)
    errors.install(app)
    _routes(app)
    return app


def _routes(app: FastAPI) -> None:
    def door(request: Request) -> FrontDoor:
        return request.app.state.door

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await door(request).serve(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await door(request).serve(request, body, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        d = door(request)
        d.check_key(request)
        view = d.view()
        lim = d.limits(view)
        return {"object": "list", "data": [{
            "id": lim.model, "object": "model", "created": d.t_created, "owned_by": "pdkv",
            "max_model_len": lim.max_row}]}

    @app.get("/metrics")
    async def metrics(request: Request):
        # Behind the API key when there is one (a scraper sends it as a bearer token):
        # the counters name workers, models and load, which is no one else's business.
        # The router gathers every worker's report, so one scrape covers the deployment.
        d = door(request)
        d.check_key(request)
        try:
            data = await d.bridge.metrics()
        except RouterDown as exc:
            raise ApiError(503, f"no metrics: {exc}") from None
        body, content_type = render_snapshot(data, request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/health")
    async def health(request: Request):
        d = door(request)
        try:
            d.view()
        except ApiError as exc:
            return JSONResponse({"status": "unavailable", "reason": exc.message},
                                status_code=503)
        return {"status": "ok", "open": len(d.live), "in_flight": d.bridge.in_flight}
