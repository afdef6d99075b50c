"""``SenderLink``: the prefill endpoint's socket and peers - the ROUTER it binds, the
handshake it answers, heartbeats and leases, and the data path (ZMQ frames, or a
same-host decode's shared pool) of each decode peer.

A member of ``KvSender``. Pins nothing and frees nothing: the channels it hands out only
read source pages that ``KvSender`` pinned, and a peer's pool is unmapped only after the
peer is gone (``drop_peer``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter

import zmq

from common.auth import INSECURE, PlaneAuth
from common.kv import SegmentError

from . import handshake, nixl, shm, tp
from .channel import DataChannel, ZmqChannel
from .config import TransportConfig
from .events import Event, EventKind
from .link import Inbound, LinkPoll, count_error, is_unreachable, parse
from .messages import Bye, Error, ErrorCode, Heartbeat, Hello, Message, ProtocolError, encode
from .nixl_channel import NixlChannel, NixlSource
from .peers import PeerTable
from .pool_view import PoolView
from .sockets import RouterSocket

logger = logging.getLogger(__name__)


class SenderLink:
    """Bind ``address``; handshake decode peers; hand their messages to ``poll``'s caller.

    Args:
        ctx: the endpoint's ZMQ context (the caller terminates it).
        pool: byte views of this rank's pool, read by the data channels.
        hello: this rank's ``Hello``.
        peers: the endpoint's peer table; the link adds peers and ticks their leases.
        nixl: this rank's NIXL side (``nixl_channel.source_for``), None without NIXL.
        auth: how decode peers authenticate (the deployment's KV credentials).
    """

    def __init__(self, ctx: zmq.Context, address: str, pool: PoolView, hello: Hello,
                 config: TransportConfig, peers: PeerTable, stats: Counter,
                 nixl: NixlSource | None = None, auth: PlaneAuth = INSECURE):
        self.config, self.peers, self.stats, self.hello = config, peers, stats, hello
        self.nixl = nixl
        self.router = RouterSocket(ctx, address, auth)
        self.address = self.router.address_bound
        self.pool = pool
        self.frames: DataChannel = ZmqChannel(self.router, pool, config.max_frame_bytes,
                                              stats)
        self.shm: dict[bytes, shm.ShmChannel] = {}   # decode peers whose pool is mapped
        self.paths: dict[bytes, str] = {}   # peer -> data path at its handshake (metrics)
        self._last_sent: dict[bytes, float] = {}     # peer -> monotonic time of our last send

    # -- polling -------------------------------------------------------------------------
    def poll(self, timeout_ms: int) -> LinkPoll:
        """Read what arrived (waiting up to ``timeout_ms`` for the first message), answer
        handshakes, send due heartbeats, find lost peers."""
        out = LinkPoll()
        item = self._recv(out, timeout_ms / 1000)
        while item is not None:
            self._take(out, *item)
            item = self.router.recv(0)
        self._progress_nixl(out)
        due, expired = self.peers.tick(time.monotonic())
        for peer in due:
            if not self.send(peer.key, Heartbeat(seq=peer.heartbeat_seq)):
                out.lost.append((peer, "unreachable", False))
        out.lost.extend((peer, why, False) for peer, why in expired)
        return out

    def send_heartbeats(self) -> int:
        """Only the heartbeats due now (no reading, no lease check); returns how many went
        out. A peer found unreachable here is left to the next ``poll``."""
        return sum(self.send(peer.key, Heartbeat(seq=peer.heartbeat_seq))
                   for peer in self.peers.due(time.monotonic()))

    def _recv(self, out: LinkPoll, timeout_s: float):
        """The first message within ``timeout_s``; while NIXL writes are in flight (or
        control is held for them) the wait is cut into ``nixl.SLICE_S`` slices that
        progress them (over TCP they move only then)."""
        deadline = time.monotonic() + timeout_s
        while self.nixl is not None and self.nixl.busy:
            left = deadline - time.monotonic()
            item = self.router.recv(min(max(0.0, left), nixl.SLICE_S))
            if item is not None or left <= 0:
                return item
            self._progress_nixl(out)
        return self.router.recv(max(0.0, deadline - time.monotonic()))

    def _progress_nixl(self, out: LinkPoll) -> None:
        """Progress NIXL writes, send the control messages they held, and report peers
        whose writes failed as lost (their endpoint is broken: nothing more is written)."""
        if self.nixl is None:
            return
        ready, failed = self.nixl.progress()
        for key, msg in ready:
            self.send(key, msg)
        for key, why in failed:
            peer = self.peers.live(key)
            if peer is not None:
                out.lost.append((peer, f"NIXL write failed: {why}", False))

    def _take(self, out: LinkPoll, key: bytes, frames: list[zmq.Frame]) -> None:
        self.stats["msgs_recv"] += 1
        self.peers.touch(key, time.monotonic())
        peer = self.peers.live(key)
        try:
            msg, data = parse(frames)
            if isinstance(msg, Hello):
                self._on_hello(out, key, msg)
            elif peer is None:
                raise ProtocolError(ErrorCode.NOT_HANDSHAKEN,
                                    f"{type(msg).__name__} before a successful Hello")
            elif isinstance(msg, Bye):
                out.lost.append((peer, f"said Bye ({msg.reason!r})", True))
            else:
                out.inbound.append(Inbound(peer, msg, data))
        except ProtocolError as exc:
            if peer is None:  # nobody's request to fail: answer here
                self.send_error(key, repr(key), exc)
            else:
                out.inbound.append(Inbound(peer, None, error=exc))

    def send_error(self, key: bytes, who: str, exc: ProtocolError) -> None:
        """Count, log and answer a protocol error."""
        self.send(key, count_error(self.stats, self.config.node, who, exc))

    # -- handshake -----------------------------------------------------------------------
    def _on_hello(self, out: LinkPoll, key: bytes, theirs: Hello) -> None:
        try:
            handshake.check(self.hello, theirs)
            self.drop_peer(key)  # a reconnect under the same routing id maps afresh
            nixl_channel = self._map_nixl(key, theirs)
        except handshake.HandshakeError as exc:
            # answer without our NIXL agent, so that the decode sees the refusal too
            self.send(key, dataclasses.replace(self.hello, nixl_agent=""))
            handshake.count_failure(self.stats, "mismatch", exc.field)
            logger.error("%s: %s", self.config.node, exc)
            out.events.append(Event(EventKind.HANDSHAKE_FAILED, detail=str(exc),
                                    peer=theirs.node))
            return
        try:
            channel = None if nixl_channel else self._map_shm(theirs)
        except SegmentError as exc:
            self._refuse_shm(out, key, theirs, exc)
            return
        if channel is not None:
            self.shm[key] = channel
        self.paths[key] = "nixl" if nixl_channel else "shm" if channel is not None \
            else self.address.split(":", 1)[0]
        self.send(key, dataclasses.replace(
            self.hello, shm_pool=channel and theirs.shm_pool or "",
            nixl_agent=self.nixl.agent.name if nixl_channel else ""))
        now = time.monotonic()
        peer = self.peers.add(key, theirs, now, next_heartbeat=now)
        logger.info("%s: peer %s connected (data path %s)", self.config.node, peer.name,
                    self.data_path(key))

    def _map_nixl(self, key: bytes, theirs: Hello) -> NixlChannel | None:
        """The NIXL channel to a decode when both ends offer NIXL (``nixl.negotiate``).

        Raises:
            HandshakeError: either end requires NIXL and this leg cannot have it.
        """
        if not nixl.negotiate(self.hello, theirs):
            return None
        channel = self.nixl.accept(key, theirs, self._dst_heads(theirs))
        if channel is None:  # its metadata was refused: as if we had not offered NIXL
            nixl.negotiate(dataclasses.replace(self.hello, nixl_agent=""), theirs)
        return channel

    def _dst_heads(self, theirs: Hello) -> slice:
        """Where the heads we share with a decode rank lie in its head axis."""
        h = self.hello
        heads = tp.overlap(h.total_kv_heads, h.tp_size, h.tp_rank, theirs.tp_size,
                           theirs.tp_rank)
        return tp.local_slice(heads, h.total_kv_heads, theirs.tp_size, theirs.tp_rank) \
            if heads else slice(0, 0)

    def _refuse_shm(self, out: LinkPoll, key: bytes, theirs: Hello,
                    exc: SegmentError) -> None:
        """A decode offered a pool we must not map: refuse the handshake, loudly."""
        self.stats["shm_refused"] += 1
        handshake.count_failure(self.stats, "refused", "shm_pool")
        detail = f"refused the offered shared-memory pool: {exc}"
        logger.error("%s: handshake from %r %s", self.config.node, theirs.node, detail)
        self.send(key, Error(code=ErrorCode.HANDSHAKE.value, detail=detail, rid=""))
        out.events.append(Event(EventKind.HANDSHAKE_FAILED, detail=detail, peer=theirs.node))

    def _map_shm(self, theirs: Hello) -> shm.ShmChannel | None:
        """The shared-memory channel to a decode that offers its pool on this host."""
        h = self.hello
        if not (self.config.shared_memory and theirs.shm_pool and h.host_id
                and theirs.host_id == h.host_id and self.pool.on_host):
            return None
        mapped = shm.attach(theirs)
        if mapped is None:
            return None
        return shm.ShmChannel(self.router, self.pool, mapped, self._dst_heads(theirs),
                              self.stats, self.config.max_frame_bytes)

    # -- data path per peer ----------------------------------------------------------------
    def channel_for(self, key: bytes) -> DataChannel:
        """Shared memory or NIXL only while the decode cannot have declared us lost: our
        last message to it is younger than half our lease (its clock starts no earlier)."""
        channel = self.shm.get(key) or (self.nixl and self.nixl.channels.get(key))
        if channel is None:
            return self.frames
        if time.monotonic() - self._last_sent.get(key, 0.0) > self.config.lease_s / 2:
            self.stats[f"{channel.name}_fallbacks"] += 1
            return self.frames
        return channel

    def poll_within(self) -> float | None:
        """Seconds within which ``poll`` should run again (NIXL writes in flight, or
        control held for them, move only when polled); None: whenever."""
        return nixl.SLICE_S if self.nixl is not None and self.nixl.busy else None

    def send_after_writes(self, key: bytes, rid: str, msg: Message) -> None:
        """Send ``msg`` (Done, Abort or AbortAck: no more bytes of ``rid`` will come) once
        no NIXL write of ``rid`` to ``key`` is in flight; ``poll`` sends held ones."""
        if self.nixl is None or not self.nixl.hold(key, rid, msg):
            self.send(key, msg)

    def sent_data(self, key: bytes) -> None:
        """A data channel reached ``key``: that renews our claim on its shared pool."""
        if key in self.paths:
            self._last_sent[key] = time.monotonic()

    def data_path(self, key: bytes) -> str:
        """``nixl`` or ``shm`` when the peer's was chosen at its handshake, else the frames'
        scheme (tcp, ipc): a same-host peer whose pool could not be mapped shows here."""
        return self.paths.get(key, "?")

    def drop_peer(self, key: bytes) -> None:
        """Unmap the peer's pool, if mapped, drop its NIXL channel and what we kept about
        it (the peer is gone or reconnecting)."""
        self.paths.pop(key, None)
        self._last_sent.pop(key, None)
        channel = self.shm.pop(key, None)
        if channel is not None:
            channel.close()
        if self.nixl is not None:
            self.nixl.drop(key)

    def send(self, key: bytes, msg: Message) -> bool:
        """Send one control message; False when the peer is unreachable."""
        try:
            self.router.send(key, [encode(msg)])
        except zmq.ZMQError as exc:
            if not is_unreachable(exc):
                raise
            return False
        if key in self.paths:   # handshaken; never one entry per stranger we answer
            self._last_sent[key] = time.monotonic()
        self.stats["msgs_sent"] += 1
        self.stats[f"sent.{type(msg).__name__}"] += 1   # per type: what a path costs
        return True

    def close(self) -> None:
        """Unmap every shared pool and close the socket (``linger=0``)."""
        for channel in self.shm.values():
            channel.close()
        self.shm.clear()
        if self.nixl is not None:
            self.nixl.close()
        self.router.close()
