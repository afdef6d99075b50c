"""Prefill side of the NIXL data path: WRITE page runs into a decode's registered pool.

``NixlSource`` belongs to one ``KvSender`` (a member of its link): its agent, its
registered pool, one ``NixlChannel`` per decode peer that offered NIXL, and the control
messages that must wait for writes. Why a late write never lands in pages the decode
reused (docs/protocol.md):
- each run is one NIXL WRITE whose notification is the run's ``KvWritten``; the write is
  ``DONE`` only after its bytes and notification left for the peer (NIXL flushes before
  notifying), and the source pin is held until then (``NixlWrite.done``);
- ``Done``, ``Abort`` and ``AbortAck`` promise the decode that no more bytes of a request
  come, so they are held back (``hold``) while a write of that request is in flight, and
  sent by ``poll`` once every one completed, failed or was cancelled;
- writes start only while our last message to the peer is younger than half our lease
  (the decode declares us lost after a whole lease of silence), as on the shm path;
- a failed write (the peer vanished, its endpoint broke) loses the peer: its requests fail
  with ``peer_lost`` and its in-flight handles are cancelled.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict

import torch
import zmq

from . import nixl
from .channel import BlockRun, Completion, DataChannel
from .config import TransportConfig
from .messages import Hello, KvWritten, Message, encode

logger = logging.getLogger(__name__)


class NixlWrite:
    """One posted WRITE; ``done`` turns true once NIXL no longer reads the source pages
    (completed, failed, or cancelled by ``NixlChannel.drop``). Checking progresses it."""

    def __init__(self, channel: NixlChannel, rid: str, handle, state: str):
        self.channel, self.rid, self.handle = channel, rid, handle
        self.error = "" if state != "ERR" else "transfer failed when posted"
        self._done = state != "PROC"

    @property
    def done(self) -> bool:
        if not self._done:
            try:
                state = self.channel.agent.state(self.handle)
            except Exception as exc:  # NIXL raises e.g. nixlRemoteDisconnectError
                state, self.error = "ERR", repr(exc)
            if state == "ERR" and not self.error:
                self.error = "transfer failed"
            self._done = state != "PROC"
            if self._done:
                self.channel.settle(self)
        return self._done


class NixlChannel(DataChannel):
    """The data path to one decode rank whose pool this prefill's agent loaded.

    Args:
        agent: this prefill's agent; ``peer_agent``: the decode's agent name.
        local: this rank's pool; ``remote``: the decode rank's registered pool.
        dst_heads: where a leg's global heads lie in the decode rank's head axis.
    """

    name = "nixl"

    def __init__(self, agent: nixl.Agent, local: nixl.PoolGeom, remote: nixl.PoolGeom,
                 peer_agent: str, dst_heads: slice, stats: Counter):
        self.agent, self.local, self.remote = agent, local, remote
        self.peer_agent, self.dst_heads, self.stats = peer_agent, dst_heads, stats
        self.in_flight_by_rid: dict[str, list[NixlWrite]] = defaultdict(list)
        self.failures: list[str] = []

    def send_blocks(self, run: BlockRun) -> list[Completion]:
        """Post one WRITE of the run (heads ``run.src_heads`` into ``dst_heads`` of
        ``run.dest_pages``) with its ``KvWritten`` as the notification."""
        dest = run.dest_pages
        if len(dest) and (dest.min() < 1 or dest.max() >= self.remote.num_pages):
            self._unreachable(f"{run.rid}: dest pages [{dest.min()}, {dest.max()}] outside "
                              f"the peer's pool of {self.remote.num_pages} pages")
        local, remote = nixl.write_descs(self.local, run.src_pages, run.src_heads,
                                         self.remote, dest, self.dst_heads)
        notif = encode(KvWritten(rid=run.rid, first_block=run.first_block,
                                 num_blocks=len(dest), head_start=run.heads[0],
                                 head_end=run.heads[1]))
        if self.local.mem == "VRAM":
            # UCX reads VRAM outside torch's streams: the kernels that computed this KV
            # must have finished first (the frame path's device-to-host copy waits too)
            torch.cuda.synchronize(self.local.dev)
        try:
            handle, state = self.agent.write(local, self.local.mem, remote, self.remote.mem,
                                             self.peer_agent, notif)
        except Exception as exc:  # a vanished peer raises here (nixlRemoteDisconnectError)
            self._unreachable(f"{run.rid}: posting a write failed: {exc!r}")
        write = NixlWrite(self, run.rid, handle, state)
        self.stats["nixl_writes"] += 1
        self.stats["bytes_sent"] += int(local[:, 1].sum())
        if state != "PROC":  # completed inside transfer() (same-host cma) or failed at once
            self.settle(write)
            return []
        self.in_flight_by_rid[run.rid].append(write)
        return [write]

    def _unreachable(self, why: str) -> None:
        """Nothing was written: the caller loses the peer, as when a ZMQ peer vanished."""
        logger.error("%s -> %s: %s", self.agent.name, self.peer_agent, why)
        raise zmq.ZMQError(zmq.EHOSTUNREACH, why)

    def settle(self, write: NixlWrite) -> None:
        """A write ended: free its handle, note a failure, forget it."""
        if write.error:
            self.failures.append(f"{write.rid}: {write.error}")
        self.agent.release(write.handle)
        writes = self.in_flight_by_rid.get(write.rid, [])
        if write in writes:
            writes.remove(write)
            if not writes:
                del self.in_flight_by_rid[write.rid]

    def in_flight(self, rid: str) -> bool:
        """True while a write of ``rid`` may still land in the peer's pages."""
        return any(not w.done for w in list(self.in_flight_by_rid.get(rid, ())))

    def progress(self) -> bool:
        """Check every in-flight write; True while any is still in flight."""
        busy = False
        for writes in list(self.in_flight_by_rid.values()):
            for w in list(writes):
                busy = not w.done or busy
        return busy

    def drop(self) -> None:
        """The peer is gone: cancel what is in flight, then forget the peer's agent."""
        for writes in list(self.in_flight_by_rid.values()):
            for w in list(writes):
                if not w.done and self.agent.release(w.handle):
                    w._done = True  # cancelled: NIXL no longer touches the source pages
                    writes.remove(w)
        self.in_flight_by_rid = defaultdict(list, {r: w for r, w in
                                                   self.in_flight_by_rid.items() if w})
        self.agent.remove_peer(self.peer_agent)


class NixlSource:
    """A prefill's NIXL side: agent, registered pool, channels and held control messages.

    Built only when ``kv_transport`` is nixl or auto. ``offer`` fills our ``Hello``;
    ``accept`` answers a decode's offer with a channel (or None to fall back).
    """

    def __init__(self, node: str, data, stats: Counter):
        self.agent = nixl.Agent(node)
        self.geom = self.agent.register(data)
        self.stats = stats
        self.channels: dict[bytes, NixlChannel] = {}
        self._held: list[tuple[bytes, str, Message]] = []

    def accept(self, key: bytes, hello: Hello, dst_heads: slice) -> NixlChannel | None:
        """Load a decode's offered metadata; None (logged) when it is refused."""
        self.drop(key)
        remote = nixl.PoolGeom.of_peer(hello)
        if hello.nixl_mem not in ("DRAM", "VRAM") or remote.num_pages < 2 or \
                remote.addr <= 0:
            logger.warning("%s: %s offers a bad NIXL pool (%s, %d pages at %#x)",
                           self.agent.name, hello.node, hello.nixl_mem, remote.num_pages,
                           remote.addr)
            return None
        try:
            name = self.agent.add_peer(hello.nixl_md)
        except Exception as exc:  # bad or foreign metadata (another UCX, no shared transport)
            logger.warning("%s: cannot load %s's NIXL metadata: %r", self.agent.name,
                           hello.node, exc)
            return None
        if name != hello.nixl_agent:
            logger.warning("%s: %s's metadata names agent %r, its Hello %r",
                           self.agent.name, hello.node, name, hello.nixl_agent)
            self.agent.remove_peer(name)
            return None
        channel = NixlChannel(self.agent, self.geom, remote, name, dst_heads, self.stats)
        self.channels[key] = channel
        return channel

    def drop(self, key: bytes) -> None:
        channel = self.channels.pop(key, None)
        if channel is not None:
            channel.drop()

    def hold(self, key: bytes, rid: str, msg: Message) -> bool:
        """Keep ``msg`` (Done, Abort, AbortAck of ``rid``) until no write of ``rid`` to
        ``key`` is in flight; False when nothing is in flight (send it now)."""
        channel = self.channels.get(key)
        waiting = any(k == key and r == rid for k, r, _ in self._held)
        if not waiting and (channel is None or not channel.in_flight(rid)):
            return False
        self._held.append((key, rid, msg))
        self.stats["nixl_held_msgs"] += 1
        return True

    def progress(self) -> tuple[list[tuple[bytes, Message]], list[tuple[bytes, str]]]:
        """Progress every write. Returns the held messages now free to go (in order) and
        ``(peer, why)`` for each peer whose writes failed."""
        failed = []
        if self.channels:
            # a write's notification may still sit in UCX's send queue after the write
            # reads DONE, and goes out only when this agent progresses: do so every poll
            stray = self.agent.notifs()
            self.stats["nixl_notifs_unexpected"] += sum(map(len, stray.values()))
        for key, channel in list(self.channels.items()):
            channel.progress()
            if channel.failures:
                failed.append((key, "; ".join(channel.failures[:3])))
                channel.failures.clear()
        ready, keep, blocked = [], [], set()
        for key, rid, msg in self._held:
            channel = self.channels.get(key)
            if (key, rid) in blocked or (channel is not None and channel.in_flight(rid)):
                blocked.add((key, rid))
                keep.append((key, rid, msg))
            else:
                ready.append((key, msg))
        self._held = keep
        return ready, failed

    @property
    def busy(self) -> bool:
        """Writes in flight or messages held: ``poll`` should keep progressing."""
        return bool(self._held) or any(c.in_flight_by_rid for c in self.channels.values())

    def finish(self, wait_s: float = 1.0) -> None:
        """Before Bye: let in-flight writes complete (at most ``wait_s``)."""
        deadline = time.monotonic() + wait_s
        while any(c.progress() for c in self.channels.values()) and \
                time.monotonic() < deadline:
            time.sleep(0.0002)

    def close(self) -> None:
        """Cancel what is left, forget every peer agent, deregister the pool."""
        for key in list(self.channels):
            self.drop(key)
        self._held.clear()
        self.agent.close()


def source_for(config: TransportConfig, cache, stats: Counter) -> NixlSource | None:
    """The prefill's NIXL side when ``kv_transport`` asks for it (``nixl.side_for``)."""
    return nixl.side_for(NixlSource, config, cache, stats)
