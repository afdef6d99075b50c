"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal the front door answers is an ``ApiError`` with the HTTP status a client of
the OpenAI API expects. The router's door decides what to refuse and why (its ``Error``
carries a code and the parameter at fault, ``deploy.router.errors``); this module alone
turns codes into statuses (``STATUS``): 400 bad parameter (naming it), 404 unknown
model, 413 prompt too long, 429 busy, 503 not ready. The front door's own refusals are
about HTTP: 400 a body that is not JSON or does not translate, 401 bad or missing key,
404 unknown route, 429 front door full, 503 router unreachable or shutting down. A 500
is only ever an unexpected fault of pdkv itself, never a user's mistake.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_exceeded", 500: "internal_server_error",
          503: "service_unavailable"}


STATUS = {"bad_request": 400, "unsupported": 400, "context_length_exceeded": 413,
          "model_not_found": 404, "forbidden": 403, "overloaded": 429,
          "encode_timeout": 503, "unavailable": 503, "shutdown": 503,
          "encode_failed": 500}
"""The router's refusal codes -> HTTP statuses; any other code is a fault (500)."""


def refusal(code: str, message: str, param: str | None) -> ApiError:
    """The router refused a request (``Error`` with ``code``): its HTTP answer."""
    status = STATUS.get(code, 500)
    return ApiError(status, message, param=param or None,
                    code=None if code == "bad_request" else code,
                    headers={"retry-after": "1"} if status == 429 else None)


class ApiError(Exception):
    """A refusal with an HTTP status; ``param`` names the offending request field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code, self.headers = code, headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def _param_of(loc: tuple) -> str:
    """``("body", "messages", 0, "role")`` -> ``messages[0].role``."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def validation_error(errors: Sequence[Mapping]) -> ApiError:
    """Pydantic's first complaint (``ValidationError.errors()``, FastAPI's or the fast
    lane's), as a 400 naming the parameter."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _param_of(tuple(first.get("loc", ())))
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        message = f"unrecognized request argument: {param}"
    elif kind in ("json_invalid", "model_attributes_type", "model_type"):
        message = "the body must be a JSON object (Content-Type: application/json)"
    else:
        message = f"{param}: {first.get('msg', 'invalid value')}"
    return ApiError(400, message, param=param)


def install(app: FastAPI) -> None:
    """Route every failure through the OpenAI error shape."""

    @app.exception_handler(ApiError)
    async def _api(_req: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _fault(req: Request, exc: Exception) -> JSONResponse:
        logger.exception("http: unexpected fault serving %s %s", req.method, req.url.path)
        return ApiError(500, f"internal error in pdkv: {type(exc).__name__}: {exc}").response()
