"""``ReceiverLink``: the decode endpoint's sockets and peers - one DEALER per prefill
rank, the handshake it starts, prefill TP groups, and draining each socket.

Pins nothing and frees nothing; ``KvReceiver.announce`` pins destination pages and the
legs it gets from ``_legs_for`` decide who must be done with them.
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod

import zmq

from . import handshake, tp
from .channel import PoolView
from .config import TransportConfig
from .events import Peer
from .incoming import InLeg
from .messages import Error, Hello, Message, ProtocolError, decode, encode
from .peers import Endpoint
from .sockets import DealerSocket

logger = logging.getLogger(__name__)


class ReceiverLink(Endpoint):
    """Connect and handshake prefill groups; route each socket's messages to ``_dispatch``."""

    def __init__(self, cache, config: TransportConfig, ctx: zmq.Context | None = None):
        super().__init__(config, ctx)
        self.cache = cache
        self.pool = PoolView(cache.data())
        shm_name = getattr(cache, "shared_memory_name", lambda: None)() or ""
        self.hello = handshake.make_hello(config, cache.layout, cache.page_size, "decode",
                                          shm_pool=shm_name, shm_pages=cache.num_pages)
        self.sockets: dict[bytes, DealerSocket] = {}
        self.groups: list[list[bytes]] = []
        self._poller = zmq.Poller()

    @abstractmethod
    def _dispatch(self, peer: Peer, sock: DealerSocket, head: bytes) -> None:
        """Handle one message whose first frame is ``head``; data frames stay on ``sock``."""

    @abstractmethod
    def _fail_rid(self, rid: str | None, reason: str, detail: str) -> None:
        """Fail request ``rid`` if it is open here."""

    def connect(self, addresses: list[str] | str) -> int:
        """Connect to every rank of one prefill TP group and handshake with each.

        Returns:
            the group id to pass to ``announce``.
        Raises:
            HandshakeError: a rank's version, model, layout or TP setup differs.
            TimeoutError: a rank did not answer within ``handshake_timeout_s``.
        """
        addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        keys = [self._handshake(addr) for addr in addresses]
        ranks = sorted(self.peers[k].hello.tp_rank for k in keys)
        size = self.peers[keys[0]].hello.tp_size
        if ranks != list(range(size)):
            raise handshake.HandshakeError(f"prefill group {addresses} has ranks {ranks}, "
                                           f"expected 0..{size - 1}")
        self.groups.append(keys)
        return len(self.groups) - 1

    def _close_link(self) -> None:
        """Close every socket (``linger=0``) and our context."""
        for sock in self.sockets.values():
            sock.close()
        self.sockets.clear()
        self._end_context()

    def _poll_sockets(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for any socket, then drain every ready one."""
        ready = dict(self._poller.poll(int(timeout_s * 1000)))
        for key, sock in list(self.sockets.items()):
            if sock.sock in ready:
                self._drain(key, sock)

    # -- connection ----------------------------------------------------------------------
    def _handshake(self, address: str) -> bytes:
        cfg = self.config
        sock = DealerSocket(self._ctx, address, f"{cfg.node}/tp{cfg.tp_rank}")
        sock.send([encode(self.hello)])
        deadline = time.monotonic() + cfg.handshake_timeout_s
        try:
            theirs = self._await_hello(sock, address, deadline)
            handshake.check(self.hello, theirs)
            if theirs.shm_pool not in ("", self.hello.shm_pool):
                raise handshake.HandshakeError(f"{address}: prefill maps pool "
                                               f"{theirs.shm_pool!r}, we offered "
                                               f"{self.hello.shm_pool!r}")
        except BaseException:
            sock.close()
            raise
        now = time.monotonic()
        self.sockets[sock.identity] = sock
        self.peers[sock.identity] = Peer(sock.identity, theirs, now, now + cfg.heartbeat_s)
        self._poller.register(sock.sock, zmq.POLLIN)
        logger.info("%s: connected to %s at %s (data path %s)", cfg.node,
                    self.peers[sock.identity].name, address,
                    "shm" if theirs.shm_pool else "zmq")
        return sock.identity

    def _await_hello(self, sock: DealerSocket, address: str, deadline: float) -> Hello:
        while (left := deadline - time.monotonic()) > 0:
            if not sock.sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                continue
            frames = sock.recv_nowait()
            try:
                msg = decode(frames[0].bytes)
            except ProtocolError as exc:
                raise handshake.HandshakeError(f"{address}: bad handshake answer: {exc}") \
                    from None
            if isinstance(msg, Hello):
                return msg
            if isinstance(msg, Error):
                raise handshake.HandshakeError(f"{address}: {msg.code}: {msg.detail}")
        self.stats["timeouts.handshake"] += 1
        raise TimeoutError(f"{address}: no Hello within {self.config.handshake_timeout_s}s")

    def _legs_for(self, group: int) -> dict[bytes, InLeg]:
        h = self.hello
        keys = self.groups[group]
        legs = {}
        for key in keys:
            peer = self.peers[key]
            heads = tp.overlap(h.total_kv_heads, peer.hello.tp_size, peer.hello.tp_rank,
                               h.tp_size, h.tp_rank)
            if heads is None:
                continue
            if peer.lost:
                raise ValueError(f"prefill {peer.name} of group {group} is lost")
            legs[key] = InLeg(key, heads)
        return legs

    # -- incoming ------------------------------------------------------------------------
    def _drain(self, key: bytes, sock: DealerSocket) -> None:
        while (head := sock.recv_first_nowait()) is not None:
            self.stats["msgs_recv"] += 1
            self._touch(key)
            try:
                self._dispatch(self.peers[key], sock, head)
            except ProtocolError as exc:
                self._protocol_error(key, exc)
                self._fail_rid(exc.rid, "error", str(exc))
            finally:
                sock.skip_rest()  # a rejected message's data frame must not look like a message

    def _send(self, key: bytes, msg: Message) -> bool:
        sock = self.sockets.get(key)
        if sock is None:
            return False
        sock.send([encode(msg)])
        self.stats["msgs_sent"] += 1
        return True
