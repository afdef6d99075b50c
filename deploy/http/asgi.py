"""Responses that notice a client leaving, whether or not anything is being written.

A client that closes its connection before the first token (a long queue, a long
prefill) would otherwise be noticed only at the first write. Both responses here wait
for ``http.disconnect`` beside their work and cancel the work when it comes, so the
request is aborted on the router at once, whatever stage it is in.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(work: Awaitable, receive: Receive):
    """``await work`` unless the client leaves first (then the work is cancelled and
    ``ConnectionAbortedError`` is raised)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        raise ConnectionAbortedError("client disconnected")
    return task.result()


class EventStream(Response):
    """``text/event-stream`` from an async iterator of byte chunks."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        # no Response.__init__: it would render an empty body and send content-length: 0
        self.chunks, self.status_code, self.background = chunks, 200, None
        self.init_headers(SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        try:
            await until_disconnect(self._pump(send), receive)
        except (ConnectionAbortedError, OSError):
            return  # the client left: the iterator's cleanup aborted its request
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, send: Send) -> None:
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await self.chunks.aclose()
