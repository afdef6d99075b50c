"""``ReceiverLink``: the decode endpoint's sockets and peers - one DEALER per prefill
rank, the handshake it starts, prefill TP groups, heartbeats and leases.

A member of ``KvReceiver``. Pins nothing and frees nothing; ``poll`` hands back each
message with its data frame still in ZMQ's buffer, so that the receiver checks it
against the request before any byte lands in the pool.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import zmq

from . import handshake, tp
from .config import TransportConfig
from .link import Inbound, LinkPoll, count_error, parse
from .messages import Bye, Error, Heartbeat, Hello, Message, ProtocolError, decode, encode
from .peers import PeerTable
from .sockets import DealerSocket

logger = logging.getLogger(__name__)
# One poll takes data frames off the sockets until it holds this many bytes, then hands
# them over (``LinkPoll.more``): each frame is copied into the pool and freed before the
# next are read, so ZMQ's buffers are reused while warm instead of piling up here.
DRAIN_BYTES = 16 << 20
MAX_DRAIN = 256  # messages per socket and poll, however small


class ReceiverLink:
    """Connect and handshake prefill groups; hand their messages to ``poll``'s caller.

    Args:
        ctx: the endpoint's ZMQ context (the caller terminates it).
        hello: this rank's ``Hello``.
        peers: the endpoint's peer table; the link adds peers and ticks their leases.
    """

    def __init__(self, ctx: zmq.Context, hello: Hello, config: TransportConfig,
                 peers: PeerTable, stats: Counter):
        self.config, self.hello, self.peers, self.stats = config, hello, peers, stats
        self._ctx = ctx
        self.sockets: dict[bytes, DealerSocket] = {}
        self.paths: dict[bytes, str] = {}   # peer -> data path: shm, tcp or ipc
        self.groups: list[list[bytes]] = []
        self._poller = zmq.Poller()
        self._turn = 0

    # -- connection ----------------------------------------------------------------------
    def connect(self, addresses: list[str] | str) -> int:
        """Connect to every rank of one prefill TP group and handshake with each.

        Returns:
            the group id to pass to ``legs_for``.
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
        self.paths[sock.identity] = "shm" if theirs.shm_pool else address.split(":", 1)[0]
        peer = self.peers.add(sock.identity, theirs, now, now + cfg.heartbeat_s)
        self._poller.register(sock.sock, zmq.POLLIN)
        logger.info("%s: connected to %s at %s (data path %s)", cfg.node, peer.name,
                    address, "shm" if theirs.shm_pool else "zmq")
        return sock.identity

    def _await_hello(self, sock: DealerSocket, address: str, deadline: float) -> Hello:
        while (left := deadline - time.monotonic()) > 0:
            if not sock.sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                continue
            frames = sock.recv_nowait()
            try:
                msg = decode(frames[0].buffer)
            except ProtocolError as exc:
                raise handshake.HandshakeError(f"{address}: bad handshake answer: {exc}") \
                    from None
            if isinstance(msg, Hello):
                return msg
            if isinstance(msg, Error):
                raise handshake.HandshakeError(f"{address}: {msg.code}: {msg.detail}")
        self.stats["timeouts.handshake"] += 1
        raise TimeoutError(f"{address}: no Hello within {self.config.handshake_timeout_s}s")

    def legs_for(self, group: int) -> dict[bytes, tuple[int, int]]:
        """Global heads each rank of ``group`` sends this rank (ranks that overlap it).

        Raises:
            ValueError: a needed rank is lost (connect the group again).
        """
        h = self.hello
        legs = {}
        for key in self.groups[group]:
            peer = self.peers[key]
            heads = tp.overlap(h.total_kv_heads, peer.hello.tp_size, peer.hello.tp_rank,
                               h.tp_size, h.tp_rank)
            if heads is None:
                continue
            if peer.lost:
                raise ValueError(f"prefill {peer.name} of group {group} is lost")
            legs[key] = heads
        return legs

    def group_lost(self, group: int) -> bool:
        """True when any rank of ``group`` is lost (the group must be connected again)."""
        return any(self.peers[k].lost for k in self.groups[group])

    # -- polling -------------------------------------------------------------------------
    def poll(self, timeout_s: float) -> LinkPoll:
        """Wait up to ``timeout_s`` for any socket, take what arrived, send due heartbeats,
        find lost peers."""
        out = LinkPoll()
        ready = dict(self._poller.poll(int(timeout_s * 1000)))
        socks = list(self.sockets.items())
        self._turn = (self._turn + 1) % max(1, len(socks))  # no socket starves the others
        budget = [DRAIN_BYTES]
        for key, sock in socks[self._turn:] + socks[:self._turn]:
            if sock.sock in ready and self._drain(out, key, sock, budget):
                out.more = True
                break
        due, expired = self.peers.tick(time.monotonic())
        for peer in due:
            self.send(peer.key, Heartbeat(seq=peer.heartbeat_seq))
        out.lost.extend((peer, why, False) for peer, why in expired)
        return out

    def _drain(self, out: LinkPoll, key: bytes, sock: DealerSocket, budget: list[int]) -> bool:
        """Take ``sock``'s messages; True when the byte budget ran out first."""
        for _ in range(MAX_DRAIN):
            if budget[0] <= 0:
                return True
            frames = sock.recv_nowait()
            if frames is None:
                return False
            budget[0] -= sum(len(f.buffer) for f in frames[1:])
            self.stats["msgs_recv"] += 1
            self.peers.touch(key, time.monotonic())
            peer = self.peers.live(key)
            if peer is None:  # lost: what it still says is not acted on
                self.stats["late_msgs"] += 1
                continue
            try:
                msg, data = parse(frames)
            except ProtocolError as exc:
                out.inbound.append(Inbound(peer, None, error=exc))
                continue
            if isinstance(msg, Bye):
                out.lost.append((peer, f"said Bye ({msg.reason!r})", True))
            else:
                out.inbound.append(Inbound(peer, msg, data))
        return True

    def send_error(self, key: bytes, who: str, exc: ProtocolError) -> None:
        """Count, log and answer a protocol error."""
        self.send(key, count_error(self.stats, self.config.node, who, exc))

    def send(self, key: bytes, msg: Message) -> bool:
        """Send one control message; False when we hold no socket to ``key``."""
        sock = self.sockets.get(key)
        if sock is None:
            return False
        sock.send([encode(msg)])
        self.stats["msgs_sent"] += 1
        return True

    def close(self) -> None:
        """Close every socket (``linger=0``)."""
        for sock in self.sockets.values():
            sock.close()
        self.sockets.clear()
