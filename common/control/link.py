"""The control plane's sockets: ``Link`` (a DEALER to the router) and ``Hub`` (the
router's ROUTER). Both carry ``common.control.messages`` messages and never raise on what a
peer sends: a frame that does not decode comes back as ``Malformed`` and is counted in
``errors`` by code. Both authenticate as their ``PlaneAuth`` says (``common.auth.planes``):
with keys, CURVE, and the hub tags each message with its sender's identity name.

Workers and the router hold them through the interfaces ``ControlLink`` and
``ControlHub``, so tests build them in process over fakes (real subclasses) that carry
messages without sockets.
"""

from __future__ import annotations

import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections import Counter

import zmq

from common.auth import INSECURE, PlaneAuth, principal
from common.control.codec import DecodeError
from common.control.messages import CODEC, MAX_CONTROL_BYTES, Malformed, Message

logger = logging.getLogger(__name__)


def _decode(frame: bytes, errors: Counter) -> Message | Malformed:
    try:
        return CODEC.decode(frame)
    except DecodeError as exc:
        errors[exc.code] += 1
        return Malformed(exc.code, exc.detail, exc.rid or "")


class ControlLink(ABC):
    """A worker's or client's connection to the router."""

    errors: Counter[str]
    """Frames refused by code (undecodable, unexpected)."""

    @abstractmethod
    def send(self, msg: Message) -> None:
        """Queue ``msg`` for the router (never blocks)."""

    @abstractmethod
    def recv(self, timeout_s: float = 0.0) -> Message | Malformed | None:
        """The next message, or ``None`` when none came within ``timeout_s``."""

    def recv_all(self) -> list[Message | Malformed]:
        """Every message that is there now."""
        out = []
        while (msg := self.recv(0)) is not None:
            out.append(msg)
        return out

    def sockets(self) -> list[zmq.Socket]:
        """Sockets whose input should wake an idle loop (none for a fake)."""
        return []

    @abstractmethod
    def close(self) -> None:
        """Release the connection."""

    def close_after(self, linger_s: float) -> None:
        """Close, letting what is still queued reach the router for up to ``linger_s``
        (a worker's last words: its final metrics and stats)."""
        self.close()


class ControlHub(ABC):
    """The router's end of the control plane: messages keyed by the sender's id."""

    errors: Counter[str]
    address: str

    @abstractmethod
    def send(self, peer: bytes, msg: Message) -> bool:
        """False when the peer is gone (the caller decides what that means)."""

    @abstractmethod
    def recv(self, timeout_s: float) -> tuple[bytes, Message | Malformed, str] | None:
        """(peer, message, the identity name the peer authenticated as: '' without keys)
        or None when nothing came within ``timeout_s``."""

    @abstractmethod
    def close(self, linger_s: float = 0.0) -> None:
        """Release the socket, giving what was just sent up to ``linger_s`` to leave."""

    def take_disconnects(self) -> int:
        """Connections that closed since the last call (a peer's process died, or it
        closed its socket); which peer it was, a send to each shows (``send`` is False
        for a peer whose connection is gone). 0 where nothing watches connections."""
        return 0


class Link(ControlLink):
    """A DEALER connected to the router: send, receive with a timeout, close.

    Args:
        ctx: the process's ZMQ context.
        address: the router's address.
        name: prefix of the socket's routing id (logs on the router side).
        auth: how to authenticate to the router (``control_client``); none by default.
    """

    def __init__(self, ctx: zmq.Context, address: str, name: str,
                 auth: PlaneAuth = INSECURE) -> None:
        self.address = address
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        # 128 random bits: the router routes replies by this id, so no other peer may
        # guess it and reconnect under it while our requests are in flight
        self.sock.setsockopt(zmq.ROUTING_ID, f"{name}/{uuid.uuid4().hex}".encode())
        auth.connect(self.sock, address)
        self.errors: Counter[str] = Counter()

    def send(self, msg: Message) -> None:
        """Never blocks: while the router is away messages queue up to the socket's
        high-water mark (they reach a restarted router); past it they are dropped and
        counted (``errors["dropped"]``), so a dead router cannot stall the caller. A
        router that refused our keys never completes the handshake: the registration's
        deadline says so (``common.node.registration``)."""
        try:
            self.sock.send(CODEC.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self.errors["dropped"] += 1

    def send_raw(self, frames: list[bytes]) -> None:
        """Send frames as they are (tests of what a broken peer sends)."""
        self.sock.send_multipart(frames)

    def recv(self, timeout_s: float = 0.0) -> Message | Malformed | None:
        """The next message, or ``None`` when none came within ``timeout_s``."""
        if not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        frames = self.sock.recv_multipart()
        if len(frames) != 1:
            self.errors["extra_frames"] += 1
            return Malformed("extra_frames", f"{len(frames)} frames, expected 1")
        return _decode(frames[0], self.errors)

    def sockets(self) -> list[zmq.Socket]:
        return [self.sock]

    def close(self) -> None:
        self.sock.close(linger=0)

    def close_after(self, linger_s: float) -> None:
        # linger 0 discards messages the I/O thread has not written yet: a worker's final
        # Stats sent just before then never came, so the router waited out the lease at
        # shutdown and dropped the worker's final metrics as lost
        self.sock.close(linger=int(linger_s * 1000))


class Hub(ControlHub):
    """The router's ROUTER socket: messages keyed by the sender's routing id, each with
    the identity name its sender authenticated as ('' without keys).

    Raises:
        InsecureBind: without keys, ``address`` is reachable from other hosts or users.
    """

    def __init__(self, ctx: zmq.Context, address: str, auth: PlaneAuth = INSECURE) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        try:
            self.guard = auth.serve(self.sock, address)
        except BaseException:
            self.sock.close(linger=0)
            raise
        self.address: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.errors: Counter[str] = Counter()
        # a peer's connection closing (its process died: the kernel closes its sockets)
        # is an event here at once, on ipc and tcp alike, with or without CURVE
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self._disconnects = 0

    def send(self, peer: bytes, msg: Message) -> bool:
        """False when the peer is gone, or so far behind that its queue is full (the
        caller decides what that means); never blocks the router's loop."""
        try:
            self.sock.send_multipart([peer, CODEC.encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.errors["dropped"] += 1
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            return False

    def recv(self, timeout_s: float) -> tuple[bytes, Message | Malformed, str] | None:
        """(peer, message, sender's identity) or None when nothing came in time
        (connections that closed meanwhile are counted for ``take_disconnects``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            ready = dict(self.poller.poll(max(0, int((deadline - time.monotonic()) * 1000))))
            if self.monitor in ready:
                self._take_events()
            if self.sock in ready:
                break
            if time.monotonic() >= deadline:
                return None
        peer, *frames = self.sock.recv_multipart(copy=False)
        who = principal(frames[-1]) if frames else ""
        if len(frames) != 1:
            self.errors["extra_frames"] += 1
            return peer.bytes, Malformed("extra_frames", f"{len(frames)} frames, "
                                         "expected 1"), who
        msg = _decode(frames[0].bytes, self.errors)
        if isinstance(msg, Malformed):
            logger.warning("router: undecodable message from %r: %s", peer.bytes, msg.detail)
        return peer.bytes, msg, who

    def _take_events(self) -> None:
        while self.monitor.poll(0):
            frames = self.monitor.recv_multipart()
            if int.from_bytes(frames[0][:2], "little") == zmq.EVENT_DISCONNECTED:
                self._disconnects += 1

    def take_disconnects(self) -> int:
        self._take_events()
        n, self._disconnects = self._disconnects, 0
        return n

    @property
    def refused(self) -> int:
        """Connections refused at the handshake (unknown key, wrong password)."""
        return self.guard.refused

    def close(self, linger_s: float = 0.0) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        # a linger lets the I/O thread write what was just sent (the router's Bye with
        # the final stats and metrics); 0 drops it, and the client waits in vain
        self.sock.close(linger=int(linger_s * 1000))
        self.guard.close()


def wait_any(socks: list[zmq.Socket], timeout_s: float) -> bool:
    """Block until one of ``socks`` is readable or ``timeout_s`` passed."""
    if timeout_s <= 0:
        return False
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    return bool(poll_for(poller, timeout_s))


def poll_for(poller: zmq.Poller, timeout_s: float) -> list:
    """``poller.poll`` for up to ``timeout_s`` seconds. ZMQ counts whole milliseconds, so
    a shorter wait looks once and sleeps the rest (a 0.1 ms wait would otherwise spin):
    a message that comes meanwhile waits for the end of the sleep."""
    if timeout_s >= 0.001:
        return poller.poll(int(timeout_s * 1000))
    ready = poller.poll(0)
    if not ready and timeout_s > 0:
        time.sleep(timeout_s)
    return ready
