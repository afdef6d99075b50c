"""The peer table of one endpoint: live handshaken peers, their leases and heartbeats, the
rids each one serves, and the rids closed recently. A lost peer leaves the table.

A member of ``KvSender``/``KvReceiver`` and of their links (which add peers at the
handshake and tick leases); it sends nothing and frees nothing itself.
"""

from __future__ import annotations

import collections
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .messages import Hello

logger = logging.getLogger(__name__)
RECENT_RIDS = 4096  # closed rids remembered so late messages are dropped, not answered


@dataclass
class Peer:
    """A connected, handshaken peer and its lease."""

    key: bytes
    hello: Hello
    last_seen: float
    next_heartbeat: float = 0.0
    heartbeat_seq: int = 0
    lost: bool = False
    rids: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return f"{self.hello.node}[tp{self.hello.tp_rank}/{self.hello.tp_size}]"

    @property
    def label(self) -> str:
        """The peer's node name, with its rank when its group has several (metrics)."""
        h = self.hello
        return h.node if h.tp_size == 1 else f"{h.node}/tp{h.tp_rank}"

    def expired(self, now: float) -> bool:
        return now - self.last_seen > self.hello.lease_ms / 1000.0


class PeerTable:
    """Peers by routing key. Dict-like for reading (``table[key]``, ``get``, ``values``).

    Args:
        node: this endpoint's name, for log lines.
        heartbeat_s: interval between heartbeats to each peer.
        stats: the endpoint's counters (``heartbeats_sent``, ``peers_lost``).
    """

    def __init__(self, node: str, heartbeat_s: float, stats: Counter):
        self.node, self.heartbeat_s, self.stats = node, heartbeat_s, stats
        self._peers: dict[bytes, Peer] = {}
        self._recent: collections.OrderedDict[str, None] = collections.OrderedDict()

    # -- reading -------------------------------------------------------------------------
    def __getitem__(self, key: bytes) -> Peer:
        return self._peers[key]

    def __len__(self) -> int:
        return len(self._peers)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._peers)

    def values(self):
        return self._peers.values()

    def live(self, key: bytes) -> Peer | None:
        """The handshaken peer ``key``; None when it never handshook or was lost."""
        return self._peers.get(key)

    # -- changes -------------------------------------------------------------------------
    def add(self, key: bytes, hello: Hello, now: float, next_heartbeat: float) -> Peer:
        """Register (or re-register, after a reconnect under the same key) a peer."""
        peer = self._peers[key] = Peer(key, hello, last_seen=now,
                                       next_heartbeat=next_heartbeat)
        return peer

    def touch(self, key: bytes, now: float) -> None:
        """Any message renews the sender's lease."""
        peer = self._peers.get(key)
        if peer is not None:
            peer.last_seen = now

    def tick(self, now: float) -> tuple[list[Peer], list[tuple[Peer, str]]]:
        """Peers due a heartbeat now (their next one is scheduled), and peers whose lease
        ran out with why."""
        expired = []
        for peer in self._peers.values():
            if peer.expired(now):
                self.stats["lease_expiries"] += 1  # the caller marks it lost in this poll
                expired.append((peer, f"silent for {now - peer.last_seen:.2f}s "
                                      f"(lease {peer.hello.lease_ms} ms)"))
        gone = {id(peer) for peer, _ in expired}
        return self.due(now, lambda peer: id(peer) not in gone), expired

    def due(self, now: float, which=lambda peer: True) -> list[Peer]:
        """Peers (among ``which``) due a heartbeat now; their next one is scheduled. Alone
        (no lease check): what a worker's pulse thread sends while its loop computes."""
        due = []
        for peer in self._peers.values():
            if now >= peer.next_heartbeat and which(peer):
                peer.heartbeat_seq += 1
                peer.next_heartbeat = now + self.heartbeat_s
                self.stats["heartbeats_sent"] += 1
                due.append(peer)
        return due

    def mark_lost(self, peer: Peer, why: str, clean: bool = False) -> list[str]:
        """Mark ``peer`` lost (logged, counted), take it out of the table and hand back the
        rids it served, sorted; an empty list when it was lost already. Whatever its key
        sends later is refused as from a peer that never handshook, and a Hello under
        that key is a new peer, so the table holds live peers only: it does not grow by
        one at every reconnect."""
        if peer.lost:
            return []
        peer.lost = True
        if self._peers.get(peer.key) is peer:
            del self._peers[peer.key]
        self.stats["peers_lost"] += 1
        logger.log(logging.INFO if clean else logging.ERROR, "%s: peer %s lost: %s",
                   self.node, peer.name, why)
        rids = sorted(peer.rids)
        peer.rids.clear()
        return rids

    # -- closed rids ---------------------------------------------------------------------
    def remember_closed(self, rid: str, keys: Iterable[bytes]) -> None:
        """``rid`` is closed: the peers of ``keys`` (its legs) no longer serve it, and its
        late messages are dropped. A peer that served a million requests must not hold
        a million rids."""
        for key in keys:
            peer = self._peers.get(key)
            if peer is not None:
                peer.rids.discard(rid)
        self._recent[rid] = None
        while len(self._recent) > RECENT_RIDS:
            self._recent.popitem(last=False)

    def recently_closed(self, rid: str) -> bool:
        return rid in self._recent
