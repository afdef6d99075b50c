"""The router inside the front door's event loop (``pdkv serve``'s default shape).

Through ``pdkv frontend`` a request crosses a process boundary twice before a worker
sees it (HTTP into the front door, then a socket to the router) and its tokens cross
back the same way: each crossing costs a send, a wake-up of another process and a
decode, 0.3-0.6 ms on a busy host. Here the router shares the HTTP server's loop, so a
submit is a call into the router and each message for the front door is a call back,
as sglang's TokenizerManager shares its HTTP server's loop. The router's own work per
message is small (no model; a long text is encoded on threads, never in the loop), so
it costs the HTTP side little. A front door that must scale apart from its router runs as
``pdkv router`` + ``pdkv frontend`` (several front doors may share one router), or
``pdkv serve --router-process``.

Workers and other clients (launchers, ``pdkv top``, operators) reach the router on its
socket as before. The loop watches the socket's descriptor and drains every message
when it signals (each send may consume that signal, so after every round ``ZMQ_EVENTS``
is checked again, as ``deploy.http.ports`` does), and runs the router's timed work
(``Router.tick``: pings, leases, deadlines) every ``Router.idle_wait_s``.

In-process peers have routing ids that ZMQ never gives a connection (a zero byte, then
more than four bytes), and the identity of their role (``client``, ``operator``) when
the deployment has keys: the router checks them as it checks a socket's peers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq

from common.auth import Keys, control_server
from common.config import ServeConfig
from common.control import Bye, ControlHub, Hub, Malformed, Message, Shutdown
from deploy.http.ports import Deliver, RouterDown
from deploy.router.router import Router

logger = logging.getLogger(__name__)
_LOCAL = b"\x00pdkv-local-"
"""Prefix of in-process peers' routing ids (a peer cannot choose one that starts with a
zero byte, and ZMQ's own are five bytes long)."""


class LocalHub(ControlHub):
    """The router's socket, plus peers in this process: a send to one is a call."""

    def __init__(self, hub: Hub) -> None:
        self.hub, self.address, self.errors = hub, hub.address, hub.errors
        self.local: dict[bytes, Callable[[Message], None]] = {}

    def send(self, peer: bytes, msg: Message) -> bool:
        deliver = self.local.get(peer)
        if deliver is not None:
            deliver(msg)
            return True
        if peer.startswith(_LOCAL):
            return False  # an in-process peer that left
        return self.hub.send(peer, msg)

    def recv(self, timeout_s: float) -> tuple[bytes, Message | Malformed, str] | None:
        return self.hub.recv(timeout_s)

    def take_disconnects(self) -> int:
        return self.hub.take_disconnects()   # a worker's death is noticed here too

    @property
    def refused(self) -> int:
        return self.hub.refused

    def close(self, linger_s: float = 0.0) -> None:
        self.hub.close(linger_s)


class HostedRouter:
    """A ``Router`` served by the running asyncio loop instead of its own.

    Args:
        address: where the router binds for workers and other clients.
        config: the deployment's config.
        keys: the deployment's key directory (CURVE on the socket); None: no keys.
    """

    def __init__(self, address: str, config: ServeConfig, keys: Keys | None = None) -> None:
        self.ctx = zmq.Context()
        try:
            self.hub = LocalHub(Hub(self.ctx, address, control_server(keys)))
        except BaseException:
            self.ctx.term()
            raise
        self.router = Router(self.hub, config, keys)
        self.address = self.hub.address
        self.keyed = keys is not None
        self.finished = False
        """The router's shutdown completed (``Bye`` sent): it handles nothing more."""
        self.closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ticker: asyncio.Task | None = None
        self._drain_scheduled = False

    # -- serving in a loop -----------------------------------------------------------------
    def attach(self) -> None:
        """Serve the router in the running loop (until ``detach`` or the loop ends)."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.hub.hub.sock.getsockopt(zmq.FD), self._drain)
        self._ticker = self._loop.create_task(self._tick_loop(), name="router-tick")
        self._drain_scheduled = False
        self._settle()

    def detach(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.hub.hub.sock.getsockopt(zmq.FD))
            if self._ticker is not None:
                self._ticker.cancel()
        self._loop = self._ticker = None

    def port(self, role: str = "client") -> LocalPort:
        """A new in-process peer of the router with ``role``'s rights."""
        return LocalPort(self, role)

    def dispatch(self, peer: bytes, msg: Message, role: str) -> None:
        """A message from an in-process peer."""
        if self.finished or self.closed:
            raise RouterDown("the router has shut down")
        self.router.dispatch(peer, msg, role if self.keyed else "")
        self._settle()

    def _drain(self) -> None:
        self._drain_scheduled = False
        if self.finished or self.closed:
            return
        while (item := self.hub.recv(0)) is not None:
            self.router.dispatch(*item)
        self._settle()

    def _settle(self) -> None:
        """After a round of handling: finish a completed shutdown, or make sure messages
        that came meanwhile are drained (their descriptor signal may have been used)."""
        if self.finished or self.closed:
            return
        if self.router.shutdown_by is not None and self.router.shutdown_complete():
            self.finished = True
            return
        if (self._loop is not None and not self._drain_scheduled
                and self.hub.hub.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN):
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    async def _tick_loop(self) -> None:
        while not (self.finished or self.closed):
            self.router.tick(time.monotonic())
            self._settle()
            await asyncio.sleep(self.router.idle_wait_s())

    # -- the deployment's start and end ----------------------------------------------------
    async def wait_ready(self, names: set[str], timeout_s: float,
                         check: Callable[[], None]) -> None:
        """Serve until every worker of ``names`` registered and is ready.

        Raises:
            TimeoutError: not within ``timeout_s``.
            Whatever ``check`` raises (the launcher's ``WorkerDied``).
        """
        self.attach()
        try:
            deadline = time.monotonic() + timeout_s
            while not names <= {n for n, w in self.router.workers.items()
                                if w.ready and not w.lost}:
                check()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers not ready within {timeout_s}s")
                await asyncio.sleep(0.05)
        finally:
            self.detach()

    async def shutdown(self, timeout_s: float) -> Bye | None:
        """Stop every worker through the router (as ``pdkv router`` does for an operator's
        ``Shutdown``) and wait for their final stats; None past ``timeout_s``."""
        if self.finished or self.closed:
            return None
        self.attach()
        port = self.port("operator")
        bye: asyncio.Future[Bye] = asyncio.get_running_loop().create_future()
        port.attach(self._loop, lambda m: isinstance(m, Bye) and not bye.done()
                    and bye.set_result(m))
        try:
            port.send(Shutdown())
            return await asyncio.wait_for(bye, timeout_s)
        except asyncio.TimeoutError:
            logger.warning("router: the workers did not confirm shutdown within %.0f s",
                           timeout_s)
            return None
        finally:
            port.close()
            self.detach()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.detach()
            self.router.close()
            self.ctx.term()


class LocalPort:
    """The bridge's port to a ``HostedRouter`` (``deploy.http.ports.Port``)."""

    _count = 0

    def __init__(self, hosted: HostedRouter, role: str) -> None:
        LocalPort._count += 1
        self.hosted, self.role, self.address = hosted, role, hosted.address
        self.peer = _LOCAL + f"{role}-{LocalPort._count}".encode()

    def attach(self, loop: asyncio.AbstractEventLoop, deliver: Deliver) -> None:
        self.hosted.hub.local[self.peer] = deliver

    def send(self, msg: Message) -> None:
        self.hosted.dispatch(self.peer, msg, self.role)

    def detach(self) -> None:
        self.hosted.hub.local.pop(self.peer, None)

    def close(self) -> None:
        self.detach()
