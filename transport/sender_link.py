"""``SenderLink``: the prefill endpoint's socket and peers - the ROUTER it binds, the
handshake it answers, and the data path (ZMQ frames, or a same-host decode's shared pool)
each decode peer gets.

Pins nothing and frees nothing: the channels it picks only read source pages that
``KvSender`` pinned, and ``_drop_shm`` unmaps a peer's pool only after the peer is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from abc import abstractmethod

import zmq

from . import handshake, shm, tp
from .channel import DataChannel, PoolView, ZmqChannel, is_unreachable
from .config import TransportConfig
from .events import EventKind, Peer
from .messages import ErrorCode, Hello, Message, ProtocolError, decode, encode
from .peers import Endpoint, unexpected_frames
from .sockets import RouterSocket

logger = logging.getLogger(__name__)


class SenderLink(Endpoint):
    """Bind ``address``, handshake decode peers, route their messages to ``_on_message``."""

    def __init__(self, cache, address: str, config: TransportConfig,
                 ctx: zmq.Context | None = None):
        super().__init__(config, ctx)
        self.cache = cache
        self.router = RouterSocket(self._ctx, address)
        self.address = self.router.address_bound
        self.pool = PoolView(cache.data())
        self.channel: DataChannel = ZmqChannel(self.router, self.pool, config.max_frame_bytes,
                                               self.stats)
        self.shm: dict[bytes, shm.ShmChannel] = {}   # decode peers whose pool is mapped
        self._last_sent: dict[bytes, float] = {}     # peer -> monotonic time of our last send
        self.hello = handshake.make_hello(config, cache.layout, cache.page_size, "prefill")

    @abstractmethod
    def _on_message(self, peer: Peer, msg: Message) -> None:
        """Handle one message of a handshaken peer."""

    def _close_link(self) -> None:
        """Unmap every shared pool, close the socket (``linger=0``) and our context."""
        for channel in self.shm.values():
            channel.close()
        self.shm.clear()
        self.router.close()
        self._end_context()

    # -- incoming ------------------------------------------------------------------------
    def _drain(self, timeout_ms: int) -> None:
        item = self.router.recv(timeout_ms)
        while item is not None:
            self._dispatch(*item)
            item = self.router.recv(0)

    def _dispatch(self, key: bytes, frames: list) -> None:
        self.stats["msgs_recv"] += 1
        self._touch(key)
        try:
            msg = decode(frames[0].bytes if frames else b"")
            if len(frames) > 1:
                raise unexpected_frames(msg, len(frames) - 1)
            if isinstance(msg, Hello):
                self._on_hello(key, msg)
            elif key not in self.peers or self.peers[key].lost:
                raise ProtocolError(ErrorCode.NOT_HANDSHAKEN,
                                    f"{type(msg).__name__} before a successful Hello")
            else:
                self._on_message(self.peers[key], msg)
        except ProtocolError as exc:
            self._protocol_error(key, exc)

    def _on_hello(self, key: bytes, hello: Hello) -> None:
        try:
            handshake.check(self.hello, hello)
        except handshake.HandshakeError as exc:
            self._send(key, self.hello)
            self.stats["errors.handshake"] += 1
            logger.error("%s: %s", self.config.node, exc)
            self._emit(EventKind.HANDSHAKE_FAILED, detail=str(exc), peer=hello.node)
            return
        self._drop_shm(key)  # a reconnect under the same routing id maps afresh
        channel = self._map_shm(hello)
        if channel is not None:
            self.shm[key] = channel
        self._send(key, dataclasses.replace(self.hello, shm_pool=channel and hello.shm_pool
                                            or ""))
        now = time.monotonic()
        self.peers[key] = Peer(key, hello, last_seen=now, next_heartbeat=now)
        logger.info("%s: peer %s connected (data path %s)", self.config.node,
                    self.peers[key].name, "shm" if channel else "zmq")

    # -- data path per peer ----------------------------------------------------------------
    def _map_shm(self, hello: Hello) -> shm.ShmChannel | None:
        """The shared-memory channel to a decode that offers its pool on this host."""
        h = self.hello
        if not (self.config.shared_memory and hello.shm_pool and h.host_id
                and hello.host_id == h.host_id):
            return None
        mapped = shm.attach(hello)
        if mapped is None:
            return None
        heads = tp.overlap(h.total_kv_heads, h.tp_size, h.tp_rank, hello.tp_size,
                           hello.tp_rank)
        dst = tp.local_slice(heads, h.total_kv_heads, hello.tp_size, hello.tp_rank) \
            if heads else slice(0, 0)
        return shm.ShmChannel(self.router, self.pool, mapped, dst, self.stats)

    def _drop_shm(self, key: bytes) -> None:
        channel = self.shm.pop(key, None)
        if channel is not None:
            channel.close()

    def _channel_for(self, key: bytes) -> DataChannel:
        """Shared memory only while the decode cannot have declared us lost: our last
        message to it is younger than half our lease (its clock starts no earlier)."""
        channel = self.shm.get(key)
        if channel is None:
            return self.channel
        if time.monotonic() - self._last_sent.get(key, 0.0) > self.config.lease_s / 2:
            self.stats["shm_fallbacks"] += 1
            return self.channel
        return channel

    def _send(self, key: bytes, msg: Message) -> bool:
        try:
            self.router.send(key, [encode(msg)])
        except zmq.ZMQError as exc:
            if not is_unreachable(exc):
                raise
            return False
        self._last_sent[key] = time.monotonic()
        self.stats["msgs_sent"] += 1
        return True
