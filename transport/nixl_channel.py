"""Prefill side of the NIXL data path: WRITE page runs into a decode's registered pool.

``NixlSource`` belongs to one ``KvSender`` (a member of its link): its agent, its
registered pool, one ``NixlChannel`` per decode peer that offered NIXL, and the control
messages that must wait for writes. Why a late write never lands in pages the decode
reused (docs/protocol.md):
- each piece of a run is one NIXL WRITE whose notification is the piece's ``KvWritten``
  (its epochs and digest; the leg's last also its first token: the completion); the write
  is ``DONE`` only after its bytes and notification left for the peer (NIXL flushes
  before notifying), and the source pin is held until then (``NixlWrite.done``);
- ``Abort`` and ``AbortAck`` promise the decode that no more bytes of a request come, so
  they are held back (``hold``) while a write of that request is in flight, and sent by
  ``poll`` once every one completed, failed or was cancelled;
- setup is once per peer: the decode's metadata is loaded and a descriptor list over
  every page of both pools prepared at the handshake; a request whose legs move whole
  pages posts index arrays only (``nixl.Agent.write_prepped``);
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

from common.kv import digest_of_pages, digest_value

from . import nixl
from .channel import BlockRun, DataChannel, Posted, PostFailed
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
        local: this rank's pool (``data`` its tensor, ``local_dlist`` its prepared list);
            ``remote``: the decode rank's registered pool.
        dst_heads: where a leg's global heads lie in the decode rank's head axis.
        max_piece_bytes: a run is cut into WRITEs of at most this many bytes, so that the
            decode checks one piece's digest while the next moves.
    """

    name = "nixl"

    def __init__(self, agent: nixl.Agent, local: nixl.PoolGeom, remote: nixl.PoolGeom,
                 peer_agent: str, dst_heads: slice, stats: Counter, data=None,
                 local_dlist=None, max_piece_bytes: int = 32 << 20):
        self.agent, self.local, self.remote = agent, local, remote
        self.peer_agent, self.dst_heads, self.stats = peer_agent, dst_heads, stats
        self.data, self.local_dlist = data, local_dlist
        self.max_piece_bytes = max_piece_bytes
        self.remote_dlist = None
        if local_dlist is not None and remote.num_heads == local.num_heads:
            self.remote_dlist = agent.prep(remote, peer_agent)
        self.in_flight_by_rid: dict[str, list[NixlWrite]] = defaultdict(list)
        self.failures: list[str] = []

    def send_blocks(self, run: BlockRun) -> Posted:
        """Post the run as WRITEs (heads ``run.src_heads`` into ``dst_heads`` of
        ``run.dest_pages``), each with its ``KvWritten`` as the notification."""
        dest = run.dest_pages
        if len(dest) and (dest.min() < 1 or dest.max() >= self.remote.num_pages):
            self.stats["nixl_post_failed"] += 1
            raise PostFailed(f"dest pages [{dest.min()}, {dest.max()}] outside the peer's "
                             f"pool of {self.remote.num_pages} pages")
        if self.local.mem == "VRAM":
            # UCX reads VRAM outside torch's streams: the kernels that computed this KV
            # must have finished first (the frame path's device-to-host copy waits too)
            torch.cuda.synchronize(self.local.dev)
        nh = run.src_heads.stop - run.src_heads.start
        block = self.local.head_bytes * self.local.rows * nh
        step = max(1, self.max_piece_bytes // block)
        posted = Posted()
        for start in range(0, len(dest), step):
            write = self._post(run, start, min(len(dest), start + step), posted)
            if write is not None:
                posted.completions.append(write)
        return posted

    def _post(self, run: BlockRun, start: int, end: int, posted: Posted) -> NixlWrite | None:
        src, dest = run.src_pages[start:end], run.dest_pages[start:end]
        digest = None
        if run.digest:  # a device fold is read here: after the synchronize above anyway
            digest = digest_value(digest_of_pages(run.digest, self.data, src, run.src_heads))
        notif = encode(KvWritten(**run.piece(start, end), digest=digest))
        whole = run.src_heads.stop - run.src_heads.start == self.local.num_heads
        try:
            if whole and self.remote_dlist is not None:
                handle, state = self.agent.write_prepped(self.local_dlist, src,
                                                         self.remote_dlist, dest, notif)
            else:
                local, remote = nixl.write_descs(self.local, src, run.src_heads,
                                                 self.remote, dest, self.dst_heads)
                handle, state = self.agent.write(local, self.local.mem, remote,
                                                 self.remote.mem, self.peer_agent, notif)
        except Exception as exc:
            if "Disconnect" in type(exc).__name__:   # nixlRemoteDisconnectError: peer gone
                self._unreachable(f"{run.rid}: posting a write failed: {exc!r}")
            self.stats["nixl_post_failed"] += 1     # this request's post: it fails alone
            logger.error("%s -> %s: %s: posting a write failed: %r", self.agent.name,
                         self.peer_agent, run.rid, exc)
            raise PostFailed(f"posting a NIXL write failed: {exc!r}") from exc
        write = NixlWrite(self, run.rid, handle, state)
        posted.entries.append(run.entry(start, end, digest))
        self.stats["nixl_writes"] += 1
        self.stats["sent.KvWritten"] += 1
        self.stats["bytes_sent"] += (end - start) * self.local.head_bytes * self.local.rows \
            * (run.src_heads.stop - run.src_heads.start)
        if state != "PROC":  # completed inside transfer() (same-host cma) or failed at once
            self.settle(write)
            return None
        self.in_flight_by_rid[run.rid].append(write)
        return write

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
        if self.remote_dlist is not None:
            self.agent.unprep(self.remote_dlist)
            self.remote_dlist = None
        self.agent.remove_peer(self.peer_agent)


class NixlSource:
    """A prefill's NIXL side: agent, registered pool, channels and held control messages.

    Built only when ``kv_transport`` is nixl or auto. ``offer`` fills our ``Hello``;
    ``accept`` answers a decode's offer with a channel (or None to fall back).
    """

    def __init__(self, node: str, data, stats: Counter, max_piece_bytes: int = 32 << 20):
        self.agent = nixl.Agent(node)
        self.data = data
        self.geom = self.agent.register(data)
        self.dlist = self.agent.prep(self.geom)  # every local page, once
        self.stats = stats
        self.max_piece_bytes = max_piece_bytes
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
        try:
            channel = NixlChannel(self.agent, self.geom, remote, name, dst_heads, self.stats,
                                  self.data, self.dlist, self.max_piece_bytes)
        except Exception as exc:  # a remote list NIXL cannot prepare: as if refused
            logger.warning("%s: cannot prepare %s's pages: %r", self.agent.name, hello.node,
                           exc)
            self.agent.remove_peer(name)
            return None
        self.channels[key] = channel
        return channel

    def drop(self, key: bytes) -> None:
        channel = self.channels.pop(key, None)
        if channel is not None:
            channel.drop()

    def hold(self, key: bytes, rid: str, msg: Message) -> bool:
        """Keep ``msg`` (Abort, AbortAck of ``rid``) until no write of ``rid`` to
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
        self.agent.unprep(self.dlist)
        self.agent.close()


def source_for(config: TransportConfig, cache, stats: Counter) -> NixlSource | None:
    """The prefill's NIXL side when ``kv_transport`` asks for it (``nixl.side_for``)."""
    return nixl.side_for(NixlSource, config, cache, stats)
