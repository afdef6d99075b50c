"""What the prefill sender and the decode receiver share: counters, errors, leases, the ZMQ
context, Bye on close, giving up on AbortAcks, the bookkeeping of a lost peer."""

from __future__ import annotations

import collections
import logging
import time
from abc import ABC, abstractmethod
from collections import Counter

import zmq

from .config import TransportConfig
from .events import Event, EventKind, Peer
from .messages import Bye, Error, ErrorCode, Heartbeat, Message, ProtocolError, encode

logger = logging.getLogger(__name__)
_RECENT = 4096  # closed rids remembered so late messages are dropped, not answered as errors


class Endpoint(ABC):
    """Base of ``KvSender``/``KvReceiver``: poll-driven, single-threaded, not thread-safe.

    Every wait is checked in ``poll``: call it at least once per heartbeat interval.
    """

    def __init__(self, config: TransportConfig, ctx: zmq.Context | None):
        self.config = config
        self.stats: Counter[str] = Counter()
        self.peers: dict[bytes, Peer] = {}
        self.transfers: dict = {}   # rid -> Outgoing (sender) or Incoming (receiver)
        self._own_ctx = ctx is None  # terminated by ``_end_context`` only when ours
        self._ctx = ctx or zmq.Context()
        self._events: list[Event] = []
        self._recent: collections.OrderedDict[str, None] = collections.OrderedDict()

    # -- hooks ---------------------------------------------------------------------------
    @abstractmethod
    def _send(self, key: bytes, msg: Message) -> bool:
        """Send one control message; False when the peer is unreachable."""

    @abstractmethod
    def _on_peer_lost(self, peer: Peer, why: str) -> None:
        """Fail everything held for ``peer``."""

    # -- shared behaviour ------------------------------------------------------------------
    def _emit(self, kind: EventKind, rid: str = "", **kw) -> None:
        self._events.append(Event(kind, rid, **kw))
        self.stats[f"events.{kind.name.lower()}"] += 1

    def _remember_closed(self, rid: str) -> None:
        self._recent[rid] = None
        while len(self._recent) > _RECENT:
            self._recent.popitem(last=False)

    def _take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _protocol_error(self, key: bytes, exc: ProtocolError) -> None:
        """Count ``exc``, answer it to the peer, keep serving everyone else."""
        self.stats["errors"] += 1
        self.stats[f"errors.{exc.code.value}"] += 1
        logger.warning("%s: protocol error from %r: %s", self.config.node, key, exc)
        self._send(key, Error(code=exc.code.value, detail=exc.detail, rid=exc.rid or ""))

    def _touch(self, key: bytes) -> None:
        peer = self.peers.get(key)
        if peer is not None:
            peer.last_seen = time.monotonic()

    def _tick_peers(self, now: float) -> None:
        for peer in list(self.peers.values()):
            if peer.lost:
                continue
            if peer.expired(now):
                self._lose(peer, f"silent for {now - peer.last_seen:.2f}s "
                                 f"(lease {peer.hello.lease_ms} ms)")
            elif now >= peer.next_heartbeat:
                peer.heartbeat_seq += 1
                peer.next_heartbeat = now + self.config.heartbeat_s
                self.stats["heartbeats_sent"] += 1
                if not self._send(peer.key, Heartbeat(seq=peer.heartbeat_seq)):
                    self._lose(peer, "unreachable")

    def _say_bye(self) -> None:
        for peer in self.peers.values():
            if not peer.lost:
                self._send(peer.key, Bye(reason="closing"))

    def _end_context(self) -> None:
        if self._own_ctx:
            self._ctx.term()

    def _peer_error(self, peer: Peer, msg: Error) -> None:
        self.stats["errors_recv"] += 1
        logger.warning("%s: peer %s reports %s: %s", self.config.node, peer.name, msg.code,
                       msg.detail)

    def _stop_waiting_for_abort_acks(self, transfer) -> None:
        """An AbortAck overdue by ``chunk_timeout_s``: stop waiting, so the pins go."""
        self.stats["timeouts.abort_ack"] += 1
        for leg in transfer.legs.values():
            leg.abort_acked = True

    def _legs_lost_with(self, peer: Peer) -> list[str]:
        """Rids of ``peer``'s transfers; their legs to it count as abort-acked (nobody will
        answer). Clears ``peer.rids``; the caller fails each rid still open."""
        rids = []
        for rid in sorted(peer.rids):
            transfer = self.transfers.get(rid)
            if transfer is not None and peer.key in transfer.legs:
                transfer.legs[peer.key].abort_acked = True
                rids.append(rid)
        peer.rids.clear()
        return rids

    def _lose(self, peer: Peer, why: str, clean: bool = False) -> None:
        if peer.lost:
            return
        peer.lost = True
        self.stats["peers_lost"] += 1
        logger.log(logging.INFO if clean else logging.ERROR, "%s: peer %s lost: %s",
                   self.config.node, peer.name, why)
        self._on_peer_lost(peer, why)
        self._emit(EventKind.PEER_LOST, peer=peer.name, reason="peer_lost", detail=why)


def encode_frames(msg: Message) -> list[bytes]:
    return [encode(msg)]


def unexpected_frames(msg: Message, num_extra: int) -> ProtocolError:
    rid = getattr(msg, "rid", None)
    return ProtocolError(ErrorCode.EXTRA_FRAMES, f"{type(msg).__name__} followed by "
                         f"{num_extra} more frame(s)", rid)
