"""The two generation routes as a raw ASGI app: the front door's fast lane.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are what every token waits
behind, so they skip FastAPI's request machinery (its middleware stack, route matching,
dependency solving): the lane reads the body, parses it (pydantic's own JSON parser)
and hands the object to ``FrontDoor.serve``, which translates it for the router (whose
door checks it). Every other request (other routes, other methods on these paths, the
lifespan) goes to the FastAPI app, which still declares both routes for its OpenAPI
schema (``/docs``).

Refusals are the app's: the same ``ApiError`` bodies, a body that is not JSON or not
sent as ``application/json`` is a 400 as FastAPI's strict content type makes it, and an
unexpected fault is a logged 500.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from pydantic_core import from_json
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from deploy.http.errors import ApiError
from deploy.http.translate import NOT_JSON

logger = logging.getLogger(__name__)

ROUTES: dict[str, bool] = {"/v1/completions": False, "/v1/chat/completions": True}
"""path -> chat."""


class FastLane:
    """``app`` with the generation routes served without it (see the module doc)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        chat = ROUTES.get(scope.get("path", "")) if scope["type"] == "http" and \
            scope["method"] == "POST" else None
        if chat is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await self._serve(request, chat)
        except ClientDisconnect:
            return  # left while sending its body: nothing was submitted
        await response(scope, receive, send)

    async def _serve(self, request: Request, chat: bool):
        try:
            body = await _json_body(request)
            return await self.app.state.door.serve(request, body, chat)
        except ApiError as exc:
            return exc.response()
        except ClientDisconnect:
            raise
        except Exception as exc:  # a fault of pdkv: the app's 500, never a dropped request
            logger.exception("http: unexpected fault serving POST %s", request.url.path)
            return ApiError(500, f"internal error in pdkv: {type(exc).__name__}: "
                                 f"{exc}").response()


async def _json_body(request: Request) -> dict:
    """The body as a JSON object; a 400 unless it is one, sent as JSON (FastAPI's strict
    content type: ``application/json`` or ``application/*+json``)."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    body = await request.body()
    if not (kind == "application/json" or
            (kind.startswith("application/") and kind.endswith("+json"))) or not body:
        raise ApiError(400, NOT_JSON, param="body")
    try:
        parsed = from_json(body)
    except ValueError:
        raise ApiError(400, NOT_JSON, param="body") from None
    if not isinstance(parsed, dict):
        raise ApiError(400, NOT_JSON, param="body")
    return parsed
