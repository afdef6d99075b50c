"""Decode side of the NIXL data path: the registered pool, and the notifications that
say which blocks a prefill wrote into it.

``NixlTarget`` is a member of ``KvReceiver`` (and of its link). It registers the
receiver's pool with its agent and offers the agent in the ``Hello``; each prefill that
accepts names its own agent, which maps that agent's notifications to the peer. The link
hands a notification back like a ZMQ message (``Inbound`` with ``via="nixl"``): the
write's ``KvWritten``, checked exactly like a shared-memory one (the peer serves that
request, the blocks lie inside its registered range and were not written before, the
epochs are the registration's, the heads are the leg's, the digest matches the pages)
before its blocks count. The leg's last notification carries the first token: it is the
leg's completion, and nothing travels beside it over ZMQ. Writes land only in
destination pages that ``announce`` pinned; the pin goes as on every path (the leg
complete, AbortAck, or a lost peer). With UCX over TCP the bytes themselves land only
while this side progresses, so the link waits in ``nixl.SLICE_S`` slices while a NIXL leg
is open (``active``).
"""

from __future__ import annotations

from collections import Counter

from . import nixl
from .incoming import InState


class NixlTarget:
    """A decode's NIXL side: agent, registered pool, prefill agents."""

    def __init__(self, node: str, data, stats: Counter):
        self.agent = nixl.Agent(node)
        self.geom = self.agent.register(data)
        self.stats = stats
        self.peers: dict[str, bytes] = {}        # prefill agent name -> peer key

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

    def active(self, transfers: dict) -> bool:
        """A NIXL leg is open (bytes or notifications may be on their way)."""
        keys = set(self.peers.values())
        return any(inc.state != InState.CLOSED and keys.intersection(inc.legs)
                   for inc in transfers.values())

    def close(self) -> None:
        self.agent.close()


def target_for(config, cache, stats: Counter) -> NixlTarget | None:
    """The decode's NIXL side when ``kv_transport`` asks for it (``nixl.side_for``)."""
    return nixl.side_for(NixlTarget, config, cache, stats)
