"""The front door's one link to the router: submit, abort, stream events, status, metrics.

This is the only module of ``deploy/http`` that speaks the router's control messages;
the rest sees ``Event`` values and ``RouterView``. It runs in the HTTP server's event
loop and reaches the router through a port (``deploy.http.ports``): a DEALER socket to a
router in another process, or a call into a router in this same loop
(``deploy.http.hosted``, ``pdkv serve``'s default).

Deadlines: the router fails a request it cannot finish (worker lost, its own request
timeout); the bridge asks for the router's status every ``status_interval_s`` and, when
no answer came for ``router_timeout_s``, declares the router lost and ends every open
request with an error. A send that cannot be queued raises ``RouterDown``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from common import trace
from common.auth import Keys
from common.control import (
    Abort,
    Done,
    Error,
    Malformed,
    MetricsQuery,
    MetricsSnapshot,
    Status,
    StatusReport,
    Submit,
    Tokens,
    unpack_ids,
)
from deploy.http.ports import Port, RouterDown, ZmqPort

logger = logging.getLogger(__name__)
__all__ = ["Event", "RouterBridge", "RouterDown", "RouterView"]


@dataclass
class Event:
    """What happened to one request: new tokens (and their text), or its end."""

    ids: list[int] = field(default_factory=list)
    text: str = ""
    done: bool = False
    reason: str = ""
    """stop, length, aborted, error, timeout, refused (the router refused the submit)."""
    error: str = ""
    code: str = ""
    """Refused: the router's code (``deploy.router.errors``)."""
    param: str = ""
    """Refused: the parameter at fault."""
    cached_tokens: int = 0
    prompt_tokens: int = 0
    """The prompt's length as served (on the first tokens, and at the end)."""
    prompt_ids: list[int] = field(default_factory=list)
    """At the end, when the request asked for them (``return_token_ids``)."""


@dataclass
class RouterView:
    """The deployment as the router last described it."""

    config: dict
    workers: dict[str, dict]
    t_answer: float

    def ready(self) -> tuple[bool, str]:
        """(ready, why not): one prefill and one decode ready, or one colocated worker."""
        roles = {w["role"] for w in self.workers.values() if w["ready"] and not w["lost"]}
        if "colocated" in roles or {"prefill", "decode"} <= roles:
            return True, ""
        have = ", ".join(sorted(roles)) or "none"
        return False, f"no ready prefill and decode worker (ready roles: {have})"

    @property
    def colocated(self) -> bool:
        return any(w["role"] == "colocated" for w in self.workers.values())


class RouterBridge:
    """A client of the router inside an asyncio loop.

    Args:
        address: the router's address (a DEALER connects there unless ``port`` is given).
        keys, identity: CURVE credentials of that connection (docs/security.md).
        port: how to reach the router instead (``deploy.http.hosted.LocalPort``).
    """

    def __init__(self, address: str, *, status_interval_s: float = 0.5,
                 router_timeout_s: float = 10.0, keys: Keys | None = None,
                 identity: str = "client", port: Port | None = None) -> None:
        self.address = address
        self._port: Port = port or ZmqPort(address, keys, identity)
        self._queues: dict[str, asyncio.Queue[Event]] = {}
        self._abandoned: set[str] = set()
        self.view: RouterView | None = None
        self._status_interval_s, self._router_timeout_s = status_interval_s, router_timeout_s
        self._t_start = time.monotonic()
        self._waiters: dict[type, list[asyncio.Future]] = {StatusReport: [],
                                                           MetricsSnapshot: []}
        """Futures waiting for the router's next answer of each type."""
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the reader and the status loop in the running event loop."""
        self._port.attach(asyncio.get_running_loop(), self._dispatch)
        self._tasks = [asyncio.create_task(self._watch(), name="bridge-status")]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._port.detach()
        self._fail_all("error", "front door shutting down")
        self._port.close()

    @property
    def router_lost(self) -> bool:
        last = self.view.t_answer if self.view else self._t_start
        return time.monotonic() - last > self._router_timeout_s

    # -- requests ------------------------------------------------------------------------
    def submit(self, msg: Submit) -> asyncio.Queue[Event]:
        """Send a request; its events arrive on the returned queue, the last one done."""
        rid = msg.rid
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self._queues[rid] = queue
        try:
            self._port.send(msg)
        except RouterDown:
            self._queues.pop(rid, None)
            raise
        return queue

    def abort(self, rid: str) -> None:
        """Abort on the router, the prefill and the decode; later events are dropped."""
        if rid not in self._queues or rid in self._abandoned:
            return
        self._abandoned.add(rid)
        try:
            self._port.send(Abort(rid))
        except RouterDown as exc:
            logger.warning("http: abort of %s not sent: %s", rid, exc)

    @property
    def in_flight(self) -> int:
        return len(self._queues)

    async def status(self, timeout_s: float = 1.0) -> RouterView:
        """A fresh status from the router. Raises ``RouterDown`` past ``timeout_s``."""
        await self._ask(Status(), StatusReport, "a status request", timeout_s)
        return self.view

    async def metrics(self, timeout_s: float = 2.0) -> bytes:
        """The deployment's metrics as the router gathers them (``MetricsSnapshot``).
        Raises ``RouterDown`` past ``timeout_s``."""
        snap = await self._ask(MetricsQuery(), MetricsSnapshot, "a metrics request",
                               timeout_s)
        return snap.families

    async def _ask(self, question, answer: type, what: str, timeout_s: float):
        """Send ``question``; the router's next ``answer`` (the router answers in order, so
        every waiter may take the first that comes)."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        waiters = self._waiters[answer]
        waiters.append(fut)
        self._port.send(question)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise RouterDown(f"router at {self.address} did not answer {what} "
                             f"within {timeout_s}s") from None
        finally:
            if fut in waiters:
                waiters.remove(fut)

    # -- internals -----------------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            try:
                self._port.send(Status())
            except RouterDown as exc:
                logger.warning("http: %s", exc)
            await asyncio.sleep(self._status_interval_s)
            if self.router_lost and self._queues:
                self._fail_all("error", f"router at {self.address} silent for more than "
                                        f"{self._router_timeout_s}s")

    def _dispatch(self, msg) -> None:
        if isinstance(msg, (StatusReport, MetricsSnapshot)):
            if isinstance(msg, StatusReport):
                # the same config keeps the same object: what the front door derives
                # from it (/v1/models' max_model_len reads a checkpoint's config.json) is
                # cached by identity and must survive the status answer that comes
                # every status_interval_s
                config = msg.config
                if self.view is not None and self.view.config == config:
                    config = self.view.config
                self.view = RouterView(config, msg.workers, time.monotonic())
            for fut in self._waiters[type(msg)]:
                if not fut.done():
                    fut.set_result(msg)
            return
        if isinstance(msg, Malformed):
            logger.warning("http: undecodable message from the router (%s): %s", msg.code,
                           msg.detail)
        queue = self._queues.get(getattr(msg, "rid", ""))
        if queue is None:
            return  # an answer to an abort of a request that already ended, or stale
        rid = msg.rid
        if isinstance(msg, Tokens):
            if msg.first:
                trace.mark("http.first_in", rid)
            if rid not in self._abandoned:
                queue.put_nowait(Event(ids=list(msg.ids), text=msg.text,
                                       prompt_tokens=msg.prompt_tokens))
        elif isinstance(msg, Done):
            self._end(rid, Event(done=True, reason=msg.reason, error=msg.error,
                                 cached_tokens=msg.cached_tokens,
                                 prompt_tokens=msg.prompt_tokens, prompt_ids=unpack_ids(
                                     msg.prompt_ids).tolist() if msg.prompt_ids else []))
        elif isinstance(msg, Error) and rid not in self._abandoned:
            # a refused submit (an abort that raced the end is answered with an Error
            # too: its Done comes, or came, on its own)
            self._end(rid, Event(done=True, reason="refused", error=msg.error,
                                 code=msg.code, param=msg.param))

    def _end(self, rid: str, event: Event) -> None:
        queue = self._queues.pop(rid)
        self._abandoned.discard(rid)
        queue.put_nowait(event)

    def _fail_all(self, reason: str, error: str) -> None:
        for rid in list(self._queues):
            self._end(rid, Event(done=True, reason=reason, error=error))
