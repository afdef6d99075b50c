"""How the front door's bridge reaches its router: over a socket or by a call.

``ZmqPort``: a DEALER connected to a router in another process (``pdkv frontend``, or
``pdkv serve --router-process``). The event loop alone reads and writes the socket (ZMQ
sockets are not thread-safe): it watches the socket's file descriptor and drains every
message when it signals. That descriptor only tells that the socket's state changed, and
a send may consume the signal of messages that arrived meanwhile, so each send checks
``ZMQ_EVENTS`` and schedules a drain itself (the pattern of pyzmq's own event-loop
integrations). A send that cannot be queued within 0.2 s raises ``RouterDown``.

The other port, ``deploy.http.hosted.LocalPort``, hands messages to a router running in
the same event loop (``pdkv serve``'s default): no socket, no encoding, no wake-up of
another process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import zmq

from common.auth import Keys
from common.control import Malformed, Message
from deploy.router.client import Client

_SEND_TIMEOUT_MS = 200
Deliver = Callable[[Message | Malformed], None]
"""Where a port hands the router's messages (the bridge's dispatch)."""


class RouterDown(RuntimeError):
    """The router cannot be reached; the message says since when."""


class Port(Protocol):
    """The bridge's end of the control plane."""

    address: str

    def attach(self, loop: asyncio.AbstractEventLoop, deliver: Deliver) -> None:
        """From now on hand every message of the router to ``deliver``, in ``loop``."""

    def send(self, msg: Message) -> None:
        """Queue ``msg`` to the router. Raises ``RouterDown``."""

    def detach(self) -> None:
        """Stop delivering (the loop may be closing)."""

    def close(self) -> None:
        """Release the connection."""


class ZmqPort:
    """A router in another process, over a DEALER socket (CURVE with ``keys``)."""

    def __init__(self, address: str, keys: Keys | None = None, identity: str = "client"
                 ) -> None:
        self.address = address
        self._client = Client(address, "http", keys, identity)
        self._sock = self._client.link.sock
        self._sock.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver: Deliver | None = None
        self._drain_scheduled = False

    def attach(self, loop: asyncio.AbstractEventLoop, deliver: Deliver) -> None:
        self._loop, self._deliver = loop, deliver
        loop.add_reader(self._sock.getsockopt(zmq.FD), self._drain)

    def send(self, msg: Message) -> None:
        try:
            self._client.send(msg)
        except zmq.Again:
            raise RouterDown(f"router at {self.address} is not taking messages") from None
        finally:
            if (self._loop is not None and not self._drain_scheduled
                    and self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN):
                self._drain_scheduled = True
                self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        """Deliver every message waiting on the socket."""
        self._drain_scheduled = False
        if self._deliver is None:
            return
        for msg in self._client.poll(0):
            self._deliver(msg)

    def detach(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
        self._loop = self._deliver = None

    def close(self) -> None:
        self._client.close()
