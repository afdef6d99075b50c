"""Decode side of the NIXL data path: the registered pool, and the notifications that
say which blocks a prefill wrote into it.

``NixlTarget`` is a member of ``KvReceiver`` (and of its link). It registers the
receiver's pool with its agent and offers the agent in the ``Hello``; each prefill that
accepts names its own agent, which maps that agent's notifications to the peer. The link
hands a notification back like a ZMQ message (``Inbound`` with ``via="nixl"``): the
run's ``KvWritten``, checked exactly like a shared-memory one (the peer serves that
request, the blocks lie inside its announced range, the heads are the leg's) before its
blocks count. Writes land only in destination pages that ``announce`` pinned; the pin
goes as on every path (Done, AbortAck, or a lost peer).

Notifications travel over UCX, ``Done`` over ZMQ, so a ``Done`` can overtake the last
notifications: it then waits here (``defer_done``) until they are in, at most
``chunk_timeout_s`` (``due_dones``). With UCX over TCP the bytes themselves land only
while this side progresses, so the link waits in ``nixl.SLICE_S`` slices while a NIXL leg
is open (``active``).
"""

from __future__ import annotations

import time
from collections import Counter

from . import nixl
from .config import TransportConfig
from .incoming import InState
from .messages import Done


class NixlTarget:
    """A decode's NIXL side: agent, registered pool, prefill agents, deferred Dones."""

    def __init__(self, node: str, data, stats: Counter):
        self.agent = nixl.Agent(node)
        self.geom = self.agent.register(data)
        self.stats = stats
        self.peers: dict[str, bytes] = {}        # prefill agent name -> peer key
        self.pending: dict[tuple[bytes, str], tuple[Done, float]] = {}

    def offer(self) -> dict:
        """The ``Hello`` fields that offer this pool to a prefill."""
        g = self.geom
        return {"nixl_agent": self.agent.name, "nixl_md": self.agent.metadata(),
                "nixl_mem": g.mem, "nixl_addr": g.addr, "nixl_dev": g.dev,
                "nixl_pages": g.num_pages}

    def bind(self, agent_name: str, key: bytes) -> None:
        """Notifications from ``agent_name`` come from peer ``key`` (one agent, one peer)."""
        if self.peers.get(agent_name, key) != key:
            raise ValueError(f"NIXL agent {agent_name!r} already serves another peer")
        self.peers[agent_name] = key

    def serves(self, key: bytes) -> bool:
        return key in self.peers.values()

    def forget(self, key: bytes) -> None:
        """The peer is gone: its notifications are dropped from now on."""
        self.peers = {a: k for a, k in self.peers.items() if k != key}
        self.pending = {p: v for p, v in self.pending.items() if p[0] != key}

    def notifications(self) -> list[tuple[bytes, bytes]]:
        """``(peer key, payload)`` of new notifications from bound agents (this call also
        progresses the backend); others are counted and dropped."""
        out = []
        for agent, payloads in self.agent.notifs().items():
            key = self.peers.get(agent)
            if key is None:
                self.stats["nixl_notifs_unknown_agent"] += len(payloads)
                continue
            out.extend((key, p) for p in payloads)
        return out

    def defer_done(self, key: bytes, rid: str, msg: Done) -> bool:
        """Keep a ``Done`` of a NIXL leg that still misses notifications; False for other
        legs and once ``due_dones`` hands it back."""
        if not self.serves(key) or (key, rid) in self.pending:
            return False
        self.pending[(key, rid)] = (msg, time.monotonic())
        self.stats["nixl_dones_deferred"] += 1
        return True

    def due_dones(self, transfers: dict, config: TransportConfig) -> list[tuple[bytes, Done]]:
        """Deferred Dones to judge now: their leg caught up, or ``chunk_timeout_s`` passed
        (then they fail as they stand). Dones of closed requests are dropped."""
        now, due = time.monotonic(), []
        for (key, rid), (msg, since) in list(self.pending.items()):
            inc = transfers.get(rid)
            leg = inc.legs.get(key) if inc is not None else None
            if leg is None or inc.state == InState.CLOSED:
                del self.pending[(key, rid)]
            elif leg.blocks_received >= inc.total_blocks - inc.cached_blocks or \
                    now - since > config.chunk_timeout_s:
                due.append((key, msg))
        return due

    def judged(self, key: bytes, rid: str) -> None:
        """A deferred Done was handed back and judged."""
        self.pending.pop((key, rid), None)

    def active(self, transfers: dict) -> bool:
        """A NIXL leg is open (bytes or notifications may be on their way)."""
        if self.pending:
            return True
        keys = set(self.peers.values())
        return any(inc.state != InState.CLOSED and keys.intersection(inc.legs)
                   for inc in transfers.values())

    def close(self) -> None:
        self.agent.close()


def target_for(config: TransportConfig, cache, stats: Counter) -> NixlTarget | None:
    """The decode's NIXL side when ``kv_transport`` asks for it (``nixl.side_for``)."""
    return nixl.side_for(NixlTarget, config, cache, stats)
