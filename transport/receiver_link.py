"""``ReceiverLink``: the decode endpoint's sockets and peers - one DEALER per prefill
rank, the handshake it starts (``Connecting``: never waited for in a worker's loop),
prefill TP groups, heartbeats and leases.

A member of ``KvReceiver``. Pins nothing and frees nothing; ``poll`` hands back each
message with its data frame still in ZMQ's buffer, so that the receiver checks it
against the request before any byte lands in the pool.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict

import zmq

from common.auth import INSECURE, PlaneAuth
from common.control import poll_for

from . import handshake, nixl, tp
from .config import TransportConfig
from .connecting import Connecting
from .link import Inbound, LinkPoll, count_error, parse
from .messages import (
    Bye,
    ErrorCode,
    Heartbeat,
    Hello,
    KvWritten,
    Message,
    ProtocolError,
    decode,
    encode,
)
from .nixl_target import NixlTarget
from .peers import Peer, PeerTable
from .sockets import DealerSocket

logger = logging.getLogger(__name__)
# One poll takes data frames off the sockets until it holds this many bytes, then hands
# them over (``LinkPoll.more``): each frame is copied into the pool and freed before the
# next are read, so ZMQ's buffers are reused while warm instead of piling up here.
DRAIN_BYTES = 16 << 20
MAX_DRAIN = 256  # messages per socket and poll, however small
MAX_FAILED = 64
"""Failed groups whose reason is kept (the newest): a decode retries a dead prefill at
every request it admits for it, so one entry per attempt would grow without end. An
older failed group is still failed (``group_lost``); only its words are gone."""


class ReceiverLink:
    """Connect and handshake prefill groups; hand their messages to ``poll``'s caller.

    Args:
        ctx: the endpoint's ZMQ context (the caller terminates it).
        hello: this rank's ``Hello``.
        peers: the endpoint's peer table; the link adds peers and ticks their leases.
        nixl: this rank's NIXL side (``nixl_target.target_for``), None without NIXL.
        auth: the KV credentials to present to prefills.
    """

    def __init__(self, ctx: zmq.Context, hello: Hello, config: TransportConfig,
                 peers: PeerTable, stats: Counter, nixl: NixlTarget | None = None,
                 auth: PlaneAuth = INSECURE):
        self.config, self.hello, self.peers, self.stats = config, hello, peers, stats
        self.nixl = nixl
        self._ctx, self.auth = ctx, auth
        self.sockets: dict[bytes, DealerSocket] = {}
        self.paths: dict[bytes, str] = {}   # peer -> data path: nixl, shm, tcp or ipc
        self._unreachable: set[bytes] = set()  # peers a send found without a connection
        self.groups: dict[int, list[Peer]] = {}
        """The ranks of each group that joined, by group id (a lost rank stays here, marked
        lost, until its group is connected afresh)."""
        self.connecting: dict[int, Connecting] = {}
        self.failed: OrderedDict[int, Exception] = OrderedDict()
        """Why each of the newest ``MAX_FAILED`` failed groups did not connect."""
        self._next_group = 0
        self._poller = zmq.Poller()
        self._turn = 0

    # -- connection ----------------------------------------------------------------------
    def begin(self, addresses: list[str] | str) -> int:
        """Start connecting to every rank of one prefill TP group; never waits.

        Returns:
            the group id to pass to ``legs_for`` once ``is_connecting(group)`` is False
            (``advance``, at every poll, takes the ranks' answers).
        """
        addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        cfg = self.config
        for old in [g for g in self.groups if self.group_lost(g)]:
            del self.groups[old]   # a lost group stays lost: it is connected afresh
        socks = [self._open(address) for address in addresses]
        group, self._next_group = self._next_group, self._next_group + 1
        self.connecting[group] = Connecting(
            addresses, socks, time.monotonic() + cfg.handshake_timeout_s,
            cfg.handshake_timeout_s)
        return group

    def connect(self, addresses: list[str] | str) -> int:
        """``begin``, then wait until the group joined or failed.

        Returns:
            the group id to pass to ``legs_for``.
        Raises:
            HandshakeError: a rank's version, model, layout or TP setup differs.
            TimeoutError: a rank did not answer within ``handshake_timeout_s``.
        """
        group = self.begin(addresses)
        while (conn := self.connecting.get(group)) is not None:
            conn.wait(conn.deadline - time.monotonic())
            self.advance()
        if group in self.failed:
            raise self.failed[group]
        return group

    def _open(self, address: str) -> DealerSocket:
        cfg = self.config
        sock = DealerSocket(self._ctx, address, f"{cfg.node}/tp{cfg.tp_rank}", self.auth)
        sock.send([encode(self.hello)])
        self._poller.register(sock.sock, zmq.POLLIN)  # its answer ends the worker's wait
        return sock

    def advance(self) -> None:
        """Take what the ranks of connecting groups answered (never waits): a group whose
        every rank answered joins; one that was refused or is past its deadline fails
        (``failed`` holds why) and its sockets close."""
        now = time.monotonic()
        for group, conn in list(self.connecting.items()):
            try:
                if not conn.step(self.hello, now):
                    continue
                self._join(group, conn)
            except (handshake.HandshakeError, TimeoutError) as exc:
                if isinstance(exc, TimeoutError):
                    handshake.count_failure(self.stats, "timeout", "none")
                elif exc.field == "peer_refused":   # its Error answer says why
                    handshake.count_failure(self.stats, "refused", "peer")
                else:
                    handshake.count_failure(self.stats, "mismatch", exc.field)
                if isinstance(exc, TimeoutError) and self.auth.secured:
                    exc = TimeoutError(f"{exc} (KV credentials refused? both ends must be "
                                       "of one deployment)")
                logger.warning("%s: cannot connect to prefill group %s: %s",
                               self.config.node, conn.addresses, exc)
                self._fail(group, exc)
                for sock in conn.socks:
                    self._poller.unregister(sock.sock)
                conn.close()
            del self.connecting[group]

    def _fail(self, group: int, exc: Exception) -> None:
        self.failed[group] = exc
        while len(self.failed) > MAX_FAILED:
            self.failed.popitem(last=False)

    def _join(self, group: int, conn: Connecting) -> None:
        hellos = [conn.hellos[i] for i in range(len(conn.socks))]
        ranks, size = sorted(h.tp_rank for h in hellos), hellos[0].tp_size
        if ranks != list(range(size)):
            raise handshake.HandshakeError(f"prefill group {conn.addresses} has ranks "
                                           f"{ranks}, expected 0..{size - 1}", "ranks")
        # NIXL first, for every rank: a rank that refuses it (HandshakeError) fails the
        # whole group before any of its ranks joins
        nixl_ranks = [nixl.negotiate(self.hello, theirs) for theirs in hellos]
        now = time.monotonic()
        for address, sock, theirs, by_nixl in zip(conn.addresses, conn.socks, hellos,
                                                  nixl_ranks):
            if by_nixl:
                self.nixl.bind(theirs.nixl_agent, sock.identity)
            self.sockets[sock.identity] = sock
            self.paths[sock.identity] = "nixl" if by_nixl else "shm" if theirs.shm_pool \
                else address.split(":", 1)[0]
            peer = self.peers.add(sock.identity, theirs, now, now + self.config.heartbeat_s)
            logger.info("%s: connected to %s at %s (data path %s)", self.config.node,
                        peer.name, address, self.paths[sock.identity])
        self.groups[group] = [self.peers[sock.identity] for sock in conn.socks]

    def is_connecting(self, group: int) -> bool:
        """True while ``group``'s handshake is under way."""
        return group in self.connecting

    def pending_sockets(self) -> list[zmq.Socket]:
        """Sockets of handshakes under way (a worker's loop waits on them too)."""
        return [s.sock for conn in self.connecting.values() for s in conn.socks]

    def legs_for(self, group: int) -> dict[bytes, tuple[int, int]]:
        """Global heads each rank of ``group`` sends this rank (ranks that overlap it).

        Raises:
            ValueError: a needed rank is lost (connect the group again).
        """
        if group in self.failed:
            raise ValueError(f"prefill group {group} did not connect: {self.failed[group]}")
        if group in self.connecting:
            raise ValueError(f"prefill group {group} is still connecting")
        if group not in self.groups:
            raise ValueError(f"prefill group {group} is gone (it failed long ago, or lost a "
                             "rank); connect again")
        h = self.hello
        legs = {}
        for peer in self.groups[group]:
            heads = tp.overlap(h.total_kv_heads, peer.hello.tp_size, peer.hello.tp_rank,
                               h.tp_size, h.tp_rank)
            if heads is None:
                continue
            if peer.lost:
                raise ValueError(f"prefill {peer.name} of group {group} is lost")
            legs[peer.key] = heads
        return legs

    def group_lost(self, group: int) -> bool:
        """True when any rank of ``group`` is lost or the group never connected (it must
        be connected again); False while it connects."""
        if group in self.connecting:
            return False
        ranks = self.groups.get(group)
        return ranks is None or any(peer.lost for peer in ranks)

    # -- polling -------------------------------------------------------------------------
    def poll(self, timeout_s: float, nixl_open: bool = False) -> LinkPoll:
        """Wait up to ``timeout_s`` for any socket, take what arrived (NIXL notifications
        too), send due heartbeats, find lost peers. ``nixl_open``: a NIXL leg is open, so
        the wait is cut into ``nixl.SLICE_S`` slices that progress NIXL (no socket wakes us
        for a notification, and over TCP the bytes land only while we progress)."""
        out = LinkPoll()
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            wait = min(left, nixl.SLICE_S) if nixl_open and self.nixl is not None else left
            self._drain_ready(out, dict(poll_for(self._poller, max(0.0, wait))))
            self._take_notifications(out)
            if out.inbound or out.lost or out.more or left <= wait:
                break
        due, expired = self.peers.tick(time.monotonic())
        for peer in due:
            self.send(peer.key, Heartbeat(seq=peer.heartbeat_seq))
        out.lost.extend((peer, why, False) for peer, why in expired)
        return out

    def send_heartbeats(self) -> int:
        """Only the heartbeats due now (no reading, no lease check); returns how many went
        out."""
        return sum(self.send(peer.key, Heartbeat(seq=peer.heartbeat_seq))
                   for peer in self.peers.due(time.monotonic()))

    def _drain_ready(self, out: LinkPoll, ready: dict) -> None:
        """Drain the ready sockets in turn (no socket starves the others) up to one drain's
        byte budget; ``out.more`` when the budget ran out first. A peer whose socket holds
        messages is alive, read or not yet: after a long step the budget may stop before
        its heartbeats, and its lease must not run out for that."""
        socks = list(self.sockets.items())
        now = time.monotonic()
        for key, sock in socks:
            if sock.sock in ready:
                self.peers.touch(key, now)
        self._turn = (self._turn + 1) % max(1, len(socks))
        budget = [DRAIN_BYTES]
        for key, sock in socks[self._turn:] + socks[:self._turn]:
            if sock.sock in ready and self._drain(out, key, sock, budget):
                out.more = True
                break

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

    def _take_notifications(self, out: LinkPoll) -> None:
        """NIXL notifications of live peers, as ``Inbound(via="nixl")`` values."""
        if self.nixl is None:
            return
        for key, payload in self.nixl.notifications():
            self.stats["msgs_recv"] += 1
            self.peers.touch(key, time.monotonic())
            peer = self.peers.live(key)
            if peer is None:
                self.stats["late_msgs"] += 1
                continue
            try:
                msg = decode(payload)
                if not isinstance(msg, KvWritten):  # a notification says what was written
                    raise ProtocolError(ErrorCode.BAD_FIELD, f"NIXL notification carries "
                                        f"{type(msg).__name__}, expected KvWritten",
                                        getattr(msg, "rid", None))
                out.inbound.append(Inbound(peer, msg, via="nixl"))
            except ProtocolError as exc:
                out.inbound.append(Inbound(peer, None, error=exc, via="nixl"))

    def send_error(self, key: bytes, who: str, exc: ProtocolError) -> None:
        """Count, log and answer a protocol error."""
        self.send(key, count_error(self.stats, self.config.node, who, exc))

    def send(self, key: bytes, msg: Message) -> bool:
        """Send one control message; False when we hold no socket to ``key`` or ZMQ holds
        no connection behind it."""
        sock = self.sockets.get(key)
        if sock is None:
            return False
        try:
            sock.send([encode(msg)])
        except zmq.Again:  # ZAP refused its reconnect: the peer's lease ends it
            self.stats["msgs_unsent"] += 1
            if key not in self._unreachable:
                self._unreachable.add(key)
                logger.warning("%s: %s not sent: ZMQ holds no connection to %s any more "
                               "(the server there refused this decode's KV credentials); "
                               "the peer's lease ends it", self.config.node,
                               type(msg).__name__, sock.address)
            return False
        self.stats["msgs_sent"] += 1
        self.stats[f"sent.{type(msg).__name__}"] += 1   # per type: what a path costs
        return True

    def drop(self, key: bytes) -> None:
        """Close the socket of a lost peer: nothing it says is acted on any more, and a
        socket kept would reconnect to a dead prefill for as long as the decode lives,
        one more at every reconnect."""
        sock = self.sockets.pop(key, None)
        if sock is not None:
            self._poller.unregister(sock.sock)
            sock.close()
        self.paths.pop(key, None)
        self._unreachable.discard(key)

    def close(self) -> None:
        """Close every socket (``linger=0``)."""
        for sock in self.sockets.values():
            sock.close()
        self.sockets.clear()
        for conn in self.connecting.values():
            conn.close()
        self.connecting.clear()
        if self.nixl is not None:
            self.nixl.close()
