"""Running the front door: uvicorn in this process, shutdown on SIGINT/SIGTERM.

Why FastAPI on uvicorn: it is what vLLM's and sglang's OpenAI servers run, so its
behaviour (SSE, disconnects, keep-alive, graceful shutdown) is what their clients already
meet; FastAPI's pydantic models give 400s that name the field for free, and uvicorn with
httptools and uvloop parses HTTP in C, which keeps the front door's own cost per request
well under a millisecond.

On the first SIGINT or SIGTERM the front door stops taking requests and ends every open
stream with an error chunk and ``[DONE]`` (their requests are aborted on the router),
then uvicorn closes the connections and returns.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

from common.auth import Keys
from deploy.http.access import Access, is_loopback
from deploy.http.app import FrontDoor, create_app
from deploy.http.bridge import RouterBridge
from deploy.http.hosted import HostedRouter
from deploy.http.lane import FastLane

logger = logging.getLogger(__name__)
OPEN = Access()
"""No API key, plain HTTP: what a loopback front door may be."""


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one), bound before the server starts so
    that the URL can be printed with the real port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket, scheme: str = "http") -> str:
    host, port = sock.getsockname()[:2]
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn, telling the front door first when a signal asks it to stop."""

    def __init__(self, config: uvicorn.Config, app: FastAPI,
                 on_ready: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_ready, self._app = on_ready, app
        self.signalled: int | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_ready()

    def handle_exit(self, sig: int, frame) -> None:
        if self.signalled is None:
            self.signalled = sig
            door: FrontDoor | None = getattr(self._app.state, "door", None)
            if door is not None:
                loop = asyncio.get_event_loop()
                loop.call_soon_threadsafe(door.shutdown, signal.Signals(sig).name)
        super().handle_exit(sig, frame)


def run_frontend(router: str, sock: socket.socket, *, model_name: str = "",
                 access: Access = OPEN, max_waiting: int = 256,
                 log_level: str = "warning", on_ready: Callable[[str], None] | None = None,
                 router_timeout_s: float = 10.0, keys: Keys | None = None,
                 identity: str = "client", hosted: HostedRouter | None = None) -> int | None:
    """Serve HTTP on ``sock`` in front of ``router`` until a signal; returns the signal
    number that stopped it (None when it stopped for another reason). With ``keys``
    the connection to the router authenticates as ``identity`` (docs/security.md).
    With ``hosted`` the router runs in the server's own loop (``deploy.http.hosted``)
    and the front door calls it instead of connecting to ``router``. ``access``: the
    API key that /v1/* and /metrics require, and the TLS files (``deploy.http.access``)."""
    api_key = access.api_key
    if api_key and not access.tls and not is_loopback(sock.getsockname()[0]):
        logger.warning("http: the API key travels in the clear to %s: give --ssl-certfile/"
                       "--ssl-keyfile, or end TLS in front of the front door",
                       url_of(sock))

    def door() -> FrontDoor:
        if hosted is not None:
            hosted.attach()  # in the server's loop, from now until the loop ends
            bridge = RouterBridge(hosted.address, router_timeout_s=router_timeout_s,
                                  port=hosted.port(identity))
        else:
            bridge = RouterBridge(router, router_timeout_s=router_timeout_s, keys=keys,
                                  identity=identity)
        return FrontDoor(bridge, model_name=model_name, api_key=api_key,
                         max_waiting=max_waiting)

    app = create_app(door)
    # no proxy-headers middleware (nothing here reads the client's address or scheme) and
    # no "server" header: less work per request on the path every token waits behind
    config = uvicorn.Config(FastLane(app), log_level=log_level, access_log=False,
                            proxy_headers=False, server_header=False,
                            timeout_graceful_shutdown=5, lifespan="on",
                            ssl_certfile=access.ssl_certfile or None,
                            ssl_keyfile=access.ssl_keyfile or None)
    url = url_of(sock, access.scheme)
    server = _Server(config, app, lambda: on_ready(url) if on_ready else None)
    server.run(sockets=[sock])
    return server.signalled
