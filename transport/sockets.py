"""One small class per ZMQ socket role. Every socket closes with ``linger=0``.

The prefill side binds a ROUTER (many decode ranks connect); each decode rank connects
one DEALER per prefill rank. Control messages and KV data frames share the connection,
so ZMQ's per-connection ordering guarantees that every chunk of a request arrives before
its ``Done`` and before an ``AbortAck``. Both authenticate as their ``PlaneAuth`` says
(``common.auth.planes``, docs/security.md): CURVE or PLAIN with the deployment's KV
credentials; without them the ROUTER binds only loopback or a private ipc path.
"""

from __future__ import annotations

import logging
import uuid

import zmq

from common.auth import INSECURE, PlaneAuth
from common.control import poll_for

logger = logging.getLogger(__name__)


def _configure(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # payloads are zero-copy references to pinned pages, so an unbounded queue costs no
    # memory; a bounded one would make send block or drop inside a worker's loop
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


class RouterSocket:
    """Prefill side: binds ``address`` (``tcp://host:port``, ``tcp://host:*``, ``ipc://path``).

    Args:
        ctx: the ZMQ context; the caller owns it.
        address: where to bind; ``address_bound`` is the resolved endpoint.
        auth: how decode peers authenticate; none by default (loopback binds only).

    Raises:
        InsecureBind: without ``auth``, ``address`` is reachable from other hosts or users.
    """

    def __init__(self, ctx: zmq.Context, address: str, auth: PlaneAuth = INSECURE):
        self.sock = ctx.socket(zmq.ROUTER)
        _configure(self.sock)
        # unroutable sends raise instead of being dropped silently: a vanished peer shows
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.guard = auth.serve(self.sock, address)
        except BaseException:
            self.sock.close(linger=0)
            raise
        self.address_bound: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)

    def send(self, peer: bytes, frames: list, track: bool = False) -> zmq.MessageTracker | None:
        """Send ``frames`` to ``peer`` without copying; returns a tracker when ``track``.

        Raises:
            zmq.ZMQError: EHOSTUNREACH when the peer is not connected.
        """
        return self.sock.send_multipart([peer, *frames], copy=False, track=track)

    def recv(self, timeout_s: float) -> tuple[bytes, list[zmq.Frame]] | None:
        """``(peer, frames)`` of the next message, or ``None`` when none came within
        ``timeout_s`` seconds (0: only look)."""
        if not poll_for(self._poller, timeout_s):
            return None
        frames = self.sock.recv_multipart(copy=False)
        return frames[0].bytes, frames[1:]

    @property
    def refused(self) -> int:
        """Connections refused at the handshake (wrong KV credentials)."""
        return self.guard.refused

    def close(self) -> None:
        self.sock.close(linger=0)
        self.guard.close()


class DealerSocket:
    """Decode side: one connection to one prefill rank's ``RouterSocket``.

    Args:
        ctx: the ZMQ context; the caller owns it.
        address: the prefill rank's bound address.
        identity: prefix of the routing id (a random suffix keeps reconnects distinct).
        auth: the KV credentials to present; none by default.
    """

    def __init__(self, ctx: zmq.Context, address: str, identity: str,
                 auth: PlaneAuth = INSECURE):
        self.address = address
        self.sock = ctx.socket(zmq.DEALER)
        _configure(self.sock)
        # 128 random bits: the prefill routes a request's KV by this id, so no other peer
        # may guess it and take it over on a reconnect
        self.identity = f"{identity}/{uuid.uuid4().hex}".encode()
        self.sock.setsockopt(zmq.ROUTING_ID, self.identity)
        auth.connect(self.sock, address)

    def send(self, frames: list, track: bool = False) -> zmq.MessageTracker | None:
        """Queue ``frames`` (the queue is unbounded, so this never waits).

        Raises:
            zmq.Again: ZMQ holds no connection to the prefill any more. After the
                server refused our credentials (ZAP) libzmq drops the connection for
                good instead of reconnecting; a blocking send would then wait forever.
        """
        return self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False, track=track)

    def recv_nowait(self) -> list[zmq.Frame] | None:
        """The next message's frames, or ``None`` when nothing is queued."""
        try:
            return self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None

    def close(self) -> None:
        self.sock.close(linger=0)
