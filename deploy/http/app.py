"""The OpenAI-compatible HTTP front door: routes, admission, streaming, shutdown.

``create_app`` builds a FastAPI app in front of a router (``RouterBridge``). A request's
JSON is translated to the router's ``Submit`` (``translate``: no validation, no
tokenizer; the router's door checks everything, encodes text and cuts stops), admitted
if fewer than ``max_waiting`` requests wait for their first token (else 429), submitted
under a front-door request id of its own, and answered, once the router's first word on
it came (its first tokens, or its refusal as the HTTP error of its code), as one JSON
body or as Server-Sent Events. A client that leaves aborts its request;
``FrontDoor.shutdown`` ends every open stream with an error chunk.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Body, FastAPI, Request
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
from deploy.http.translate import Plan, plan

logger = logging.getLogger(__name__)


class FrontDoor:
    """State shared by the routes: the router link, admission, open generations."""

    def __init__(self, bridge: RouterBridge, *, model_name: str = "", api_key: str = "",
                 max_waiting: int = 256) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting} must be >= 1")
        self.bridge, self.api_key, self.max_waiting = bridge, api_key, max_waiting
        self.model_name = model_name
        self.live: set[Generation] = set()
        self.closing = ""
        self._config: tuple[int, tuple[str, int]] | None = None
        self.t_created = int(time.time())

    # -- the router's side -----------------------------------------------------------------
    def view(self) -> RouterView:
        """The router's last status; 503 while shutting down or the router is silent
        (whether workers can serve a request is the router's door's to say)."""
        if self.closing:
            raise ApiError(503, f"the server is shutting down ({self.closing})")
        view = self.bridge.view
        if view is None or self.bridge.router_lost:
            raise ApiError(503, f"the router at {self.bridge.address} is not answering")
        return view

    def served_model(self, view: RouterView) -> str:
        """The name clients call the model (``--served-model-name``, else the router's)."""
        return self.model_name or self._derived(view)[0]

    def max_model_len(self, view: RouterView) -> int:
        """What ``/v1/models`` reports: the longest row of the config's decode pools, or
        the model's context if shorter (the router's door enforces the live limits)."""
        return self._derived(view)[1]

    def _derived(self, view: RouterView) -> tuple[str, int]:
        """(the router's name of the model, max_model_len), built when the config changes
        (a checkpoint's config.json is read), not at every status answer."""
        key = id(view.config)
        if self._config is None or self._config[0] != key:
            cfg = ServeConfig.from_dict(view.config)
            self._config = (key, (cfg.model_name, min(cfg.pool_tokens("decode"),
                                                      cfg.model_config().max_position)))
        return self._config[1]

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
        """The front door's own bound: requests it holds without a first token (HTTP
        connections and their queues; the router bounds its encoding queue itself)."""
        waiting = sum(1 for g in self.live if g.waiting)
        if waiting >= self.max_waiting:
            raise ApiError(429, f"{waiting} requests are waiting for their first token (the "
                                f"front door holds at most {self.max_waiting}); retry later",
                           code="rate_limit_exceeded", headers={"retry-after": "1"})

    def admit(self, plan: Plan) -> Generation:
        self._refuse_if_full()
        gen = Generation(self.bridge, plan)
        try:
            gen.start()
        except RouterDown as exc:
            raise ApiError(503, str(exc)) from None
        self.live.add(gen)
        return gen

    async def serve(self, request: Request, body, chat: bool):
        """Answer one generation request; ``body`` is its parsed JSON."""
        t_in = trace.now_ns()
        self.check_key(request)
        view = self.view()
        gen = self.admit(plan(body, chat, self.served_model(view), self._derived(view)[0]))
        trace.mark("http.request_in", gen.rid, t_in)
        trace.mark("http.submit_out", gen.rid)
        try:   # the router's first word: tokens, or its refusal (raised as the HTTP error)
            await until_disconnect(gen.opened(), request.receive)
        except ConnectionAbortedError:
            self._forget(gen)
            return JSONResponse({}, status_code=499)  # nobody reads it
        except BaseException:
            self._forget(gen)
            raise
        shaper = Shaper(gen, self.served_model(view), chat)
        if gen.plan.stream:
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


def _body_doc(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": model.model_json_schema()}}}}


def _routes(app: FastAPI) -> None:
    def door(request: Request) -> FrontDoor:
        return request.app.state.door

    # The fast lane (deploy/http/lane.py) serves both POST routes; these declarations
    # give /docs their bodies (schemas.py documents the fields, the router checks them).
    @app.post("/v1/completions", openapi_extra=_body_doc(CompletionRequest))
    async def completions(request: Request, body: Annotated[dict, Body()]):
        return await door(request).serve(request, body, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_body_doc(ChatCompletionRequest))
    async def chat_completions(request: Request, body: Annotated[dict, Body()]):
        return await door(request).serve(request, body, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        d = door(request)
        d.check_key(request)
        view = d.view()
        return {"object": "list", "data": [{
            "id": d.served_model(view), "object": "model", "created": d.t_created,
            "owned_by": "pdkv", "max_model_len": d.max_model_len(view)}]}

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
            ok, why = d.view().ready()
            if not ok:
                raise ApiError(503, f"not ready: {why}")
        except ApiError as exc:
            return JSONResponse({"status": "unavailable", "reason": exc.message},
                                status_code=503)
        return {"status": "ok", "open": len(d.live), "in_flight": d.bridge.in_flight}
