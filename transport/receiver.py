"""``KvReceiver``: the decode side of one TP rank. Connects to prefill groups, announces
requests, writes arriving pages into its pool, tracks the destination pin.

A worker's loop::

    rx = KvReceiver(cache, TransportConfig(node="d0"))
    group = rx.connect(["tcp://prefill-0:5600", "tcp://prefill-1:5600"])  # one TP group
    kv = cache.open_row(rid); cache.extend(kv, prompt_len)                  # backpressure
    rx.announce(rid, kv, prompt_len, cached_tokens=0, group=group)
    for ev in rx.poll(0.01):   # COMPLETED carries first_token; ABORTED/FAILED carry reason
        ...

Data frames are received straight into the destination pages when a frame's pages are
consecutive and carry all of this rank's heads (``recv_into``, one copy); otherwise the
frame is scattered. With a shared pool (``KvCache(shared_memory=True)``) the receiver
offers it and a same-host prefill writes the pages itself (``KvWritten``, no frame).

Destination pages are pinned from ``announce`` until every sending rank is done with them;
on ABORTED/FAILED the worker frees its row with ``event.reason`` at once (the pin defers
the pages' release until the peer confirmed it stopped or its lease ran out).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import zmq

from . import handshake, tp
from .channel import PoolView
from .config import TransportConfig
from .endpoint import Endpoint, unexpected_frames
from .events import Event, EventKind, Peer
from .incoming import Incoming, InLeg, InState
from .messages import (
    Abort,
    AbortAck,
    Accepted,
    Ack,
    Announce,
    Bye,
    Done,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    KvChunk,
    KvWritten,
    Message,
    ProtocolError,
    decode,
    encode,
    pages_to_bytes,
)
from .sockets import DealerSocket

logger = logging.getLogger(__name__)


class KvReceiver(Endpoint):
    """Decode endpoint.

    Args:
        cache: this rank's ``KvCache`` (``layout.num_kv_heads`` = heads of this rank).
        config: identity, TP rank/size, deadlines and lease.
        ctx: ZMQ context to use; one is created (and terminated on ``close``) if omitted.
    """

    def __init__(self, cache, config: TransportConfig, ctx: zmq.Context | None = None):
        super().__init__(config)
        self.cache = cache
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self.pool = PoolView(cache.data())
        shm_name = getattr(cache, "shared_memory_name", lambda: None)() or ""
        self.hello = handshake.make_hello(config, cache.layout, cache.page_size, "decode",
                                          shm_pool=shm_name, shm_pages=cache.num_pages)
        self.sockets: dict[bytes, DealerSocket] = {}
        self.groups: list[list[bytes]] = []
        self.transfers: dict[str, Incoming] = {}
        self._poller = zmq.Poller()

    # -- worker API ----------------------------------------------------------------------
    def connect(self, addresses: list[str] | str) -> int:
        """Connect to every rank of one prefill TP group and handshake with each.

        Returns:
            the group id to pass to ``announce``.
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

    def announce(self, rid: str, kv, prompt_len: int, cached_tokens: int = 0,
                 group: int = 0) -> None:
        """Ask ``group`` to stream positions ``[cached_tokens, prompt_len)`` into ``kv``.

        Args:
            kv: the preallocated row (``allocated_len >= prompt_len``); the worker keeps
                owning it and frees it; the transport pins its destination pages.
            cached_tokens: page-aligned prefix already held (prefix cache).
        Raises:
            ValueError: rid in flight, misaligned prefix, or a needed rank is lost.
        """
        ps = self.cache.page_size
        if rid in self.transfers or cached_tokens % ps or not 0 <= cached_tokens <= prompt_len:
            raise ValueError(f"announce {rid!r}: in flight or cached_tokens={cached_tokens} "
                             f"not page-aligned within prompt_len={prompt_len}")
        legs = self._legs_for(group)
        dest = np.asarray(self.cache.pages(kv, 0, prompt_len), np.int64)
        todo = dest[cached_tokens // ps:]
        pin = self.cache.pin_pages(todo, reason="receive") if len(todo) else None
        inc = Incoming(rid, kv, prompt_len, cached_tokens // ps, dest, pin, legs)
        self.transfers[rid] = inc
        msg = Announce(rid=rid, prompt_len=prompt_len, cached_tokens=cached_tokens,
                       dest_pages=pages_to_bytes(dest))
        for key in legs:
            self.peers[key].rids.add(rid)
            self._send(key, msg)

    def abort(self, rid: str, reason: str = "aborted", detail: str = "") -> bool:
        """Abort ``rid`` towards its prefill ranks; the destination pin stays until each
        acknowledges or is lost. Returns False when rid is unknown or already final."""
        inc = self.transfers.get(rid)
        if inc is None or inc.state == InState.CLOSED:
            return False
        self._abort_legs(inc, reason, detail)
        inc.state = InState.CLOSED
        return True

    def poll(self, timeout_s: float = 0.0) -> list[Event]:
        """Handle what arrived (waiting up to ``timeout_s`` for it), write pages, send
        heartbeats, check leases and deadlines, release settled pins.

        Returns:
            events since the last call, oldest first.
        """
        ready = dict(self._poller.poll(int(timeout_s * 1000)))
        for key, sock in list(self.sockets.items()):
            if sock.sock in ready:
                self._drain(key, sock)
        now = time.monotonic()
        self._tick_peers(now)
        for inc in list(self.transfers.values()):
            self._check_deadlines(inc, now)
            self._maybe_release(inc)
        return self._take_events()

    @property
    def num_pins(self) -> int:
        return sum(inc.pin_id is not None for inc in self.transfers.values())

    def close(self) -> None:
        """Say Bye to every prefill rank, drop all pins, close sockets (``linger=0``)."""
        for key, peer in self.peers.items():
            if not peer.lost:
                self._send(key, Bye(reason="closing"))
        for inc in self.transfers.values():
            if inc.pin_id is not None:
                self.cache.unpin(inc.pin_id)
        self.transfers.clear()
        for sock in self.sockets.values():
            sock.close()
        self.sockets.clear()
        if self._own_ctx:
            self._ctx.term()

    # -- connection ----------------------------------------------------------------------
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
        self.peers[sock.identity] = Peer(sock.identity, theirs, now, now + cfg.heartbeat_s)
        self._poller.register(sock.sock, zmq.POLLIN)
        logger.info("%s: connected to %s at %s (data path %s)", cfg.node,
                    self.peers[sock.identity].name, address,
                    "shm" if theirs.shm_pool else "zmq")
        return sock.identity

    def _await_hello(self, sock: DealerSocket, address: str, deadline: float) -> Hello:
        while (left := deadline - time.monotonic()) > 0:
            if not sock.sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                continue
            frames = sock.recv_nowait()
            try:
                msg = decode(frames[0].bytes)
            except ProtocolError as exc:
                raise handshake.HandshakeError(f"{address}: bad handshake answer: {exc}") \
                    from None
            if isinstance(msg, Hello):
                return msg
            if isinstance(msg, Error):
                raise handshake.HandshakeError(f"{address}: {msg.code}: {msg.detail}")
        self.stats["timeouts.handshake"] += 1
        raise TimeoutError(f"{address}: no Hello within {self.config.handshake_timeout_s}s")

    def _legs_for(self, group: int) -> dict[bytes, InLeg]:
        h = self.hello
        keys = self.groups[group]
        legs = {}
        for key in keys:
            peer = self.peers[key]
            heads = tp.overlap(h.total_kv_heads, peer.hello.tp_size, peer.hello.tp_rank,
                               h.tp_size, h.tp_rank)
            if heads is None:
                continue
            if peer.lost:
                raise ValueError(f"prefill {peer.name} of group {group} is lost")
            legs[key] = InLeg(key, heads)
        return legs

    # -- incoming ------------------------------------------------------------------------
    def _drain(self, key: bytes, sock: DealerSocket) -> None:
        while (head := sock.recv_first_nowait()) is not None:
            self.stats["msgs_recv"] += 1
            self._touch(key)
            try:
                self._dispatch(self.peers[key], sock, head)
            except ProtocolError as exc:
                self._protocol_error(key, exc)
                self._fail_rid(exc.rid, "error", str(exc))
            finally:
                sock.skip_rest()  # a rejected message's data frame must not look like a message

    def _dispatch(self, peer: Peer, sock: DealerSocket, head: bytes) -> None:
        msg = decode(head)
        if isinstance(msg, KvChunk):
            self._on_chunk(peer, msg, sock)
            return
        if sock.more():
            raise unexpected_frames(msg, sock.skip_rest())
        if isinstance(msg, KvWritten):
            self._on_written(peer, msg)
        elif isinstance(msg, AbortAck):
            inc = self.transfers.get(msg.rid)
            if inc is not None and peer.key in inc.legs:
                inc.legs[peer.key].abort_acked = True
            else:
                self.stats["late_msgs"] += 1
        elif isinstance(msg, (Accepted, Done, Abort)):
            inc = self._incoming(peer, msg.rid)
            if inc is not None:
                self._on_request_msg(peer, inc, msg)
            elif isinstance(msg, Abort):
                self._send(peer.key, AbortAck(rid=msg.rid))
        elif isinstance(msg, Bye):
            self._lose(peer, f"said Bye ({msg.reason})", clean=True)
        elif isinstance(msg, Error):
            self.stats["errors_recv"] += 1
            logger.warning("%s: %s reports %s: %s", self.config.node, peer.name, msg.code,
                           msg.detail)
            self._fail_rid(msg.rid, "error", f"peer error {msg.code}: {msg.detail}")
        elif not isinstance(msg, Heartbeat):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{type(msg).__name__} is not sent to "
                                "a decode endpoint")

    def _incoming(self, peer: Peer, rid: str) -> Incoming | None:
        """The request ``rid`` that ``peer`` serves; None for a recently closed rid."""
        inc = self.transfers.get(rid)
        if inc is not None and peer.key in inc.legs and inc.state != InState.CLOSED:
            return inc
        if rid in self._recent or (inc is not None and peer.key in inc.legs):
            self.stats["late_msgs"] += 1
            return None
        raise ProtocolError(ErrorCode.UNKNOWN_RID, f"unknown rid {rid!r}", None)

    def _on_request_msg(self, peer: Peer, inc: Incoming, msg: Message) -> None:
        leg = inc.legs[peer.key]
        inc.t_progress = time.monotonic()
        if isinstance(msg, Accepted):
            leg.accepted = True
            if all(g.accepted for g in inc.legs.values()):
                inc.state = InState.STREAMING
        elif isinstance(msg, Done):
            self._on_done(inc, leg, msg)
        elif isinstance(msg, Abort):
            self.stats["aborts_recv"] += 1
            leg.abort_acked = True
            self._send(peer.key, AbortAck(rid=inc.rid))
            self._abort_legs(inc, msg.reason, msg.detail)
            self._close(inc, EventKind.ABORTED, msg.reason or "aborted", msg.detail)

    def _leg_for_blocks(self, peer: Peer, msg: KvChunk | KvWritten) -> tuple | None:
        """``(request, leg)`` for a chunk's blocks; None for a late one of a closed rid."""
        inc = self._incoming(peer, msg.rid)
        if inc is None:
            return None
        leg = inc.legs[peer.key]
        lo, hi = msg.first_block, msg.first_block + msg.num_blocks
        if (msg.head_start, msg.head_end) != leg.heads or msg.num_blocks < 1 or not (
                inc.cached_blocks <= lo and hi <= inc.total_blocks):
            raise ProtocolError(ErrorCode.BAD_RANGE, f"blocks [{lo}, {hi}) heads "
                                f"[{msg.head_start}, {msg.head_end}) outside blocks "
                                f"[{inc.cached_blocks}, {inc.total_blocks}) heads {leg.heads}",
                                msg.rid)
        return inc, leg

    def _on_chunk(self, peer: Peer, msg: KvChunk, sock: DealerSocket) -> None:
        found = self._leg_for_blocks(peer, msg)
        if found is None:
            return
        inc, leg = found
        if not sock.more():
            raise ProtocolError(ErrorCode.TRUNCATED, "KvChunk without its data frame", msg.rid)
        want = msg.num_blocks * self.pool.block_bytes(leg.heads[1] - leg.heads[0])
        if msg.nbytes != want:
            raise self._size_error(msg, msg.nbytes, want)
        dest = inc.dest_pages[msg.first_block:msg.first_block + msg.num_blocks]
        h = self.hello
        heads = tp.local_slice(leg.heads, h.total_kv_heads, h.tp_size, h.tp_rank)
        if heads.stop - heads.start == self.pool.num_heads and np.all(np.diff(dest) == 1):
            got = sock.recv_into(self.pool.run_view(int(dest[0]), len(dest)))
            self.stats["frames_recv_into"] += 1
        else:
            frame = sock.recv_part()
            got = len(frame.buffer)
            if got == want:
                self.pool.write(dest, heads, frame.buffer)
        if got != want:  # a longer frame was cut at want: only this rid's pinned pages
            raise self._size_error(msg, got, want)
        if sock.more():
            raise unexpected_frames(msg, sock.skip_rest())
        self._count_blocks(inc, leg, msg.num_blocks)
        self.stats["frames_recv"] += 1
        self.stats["bytes_recv"] += want

    def _on_written(self, peer: Peer, msg: KvWritten) -> None:
        """A same-host prefill copied the blocks into our shared pool itself."""
        if not (self.hello.shm_pool and peer.hello.shm_pool == self.hello.shm_pool):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"KvWritten from {peer.name}, which "
                                "did not map our pool", msg.rid)
        found = self._leg_for_blocks(peer, msg)
        if found is not None:
            self._count_blocks(*found, msg.num_blocks)
            self.stats["shm_writes_recv"] += 1

    def _count_blocks(self, inc: Incoming, leg: InLeg, num_blocks: int) -> None:
        leg.blocks_received += num_blocks
        inc.t_progress = time.monotonic()

    @staticmethod
    def _size_error(msg: KvChunk, got: int, want: int) -> ProtocolError:
        code = ErrorCode.OVERSIZED if got > want else ErrorCode.TRUNCATED
        return ProtocolError(code, f"data frame of {got} bytes (header says {msg.nbytes}), "
                             f"{msg.num_blocks} blocks need {want}", msg.rid)

    def _on_done(self, inc: Incoming, leg: InLeg, msg: Done) -> None:
        want = inc.total_blocks - inc.cached_blocks
        if msg.num_blocks != want or leg.blocks_received != want:
            raise ProtocolError(ErrorCode.BAD_RANGE, f"Done after {leg.blocks_received} "
                                f"blocks (says {msg.num_blocks}), expected {want}", inc.rid)
        leg.done, leg.first_token = True, msg.first_token
        if not all(g.done for g in inc.legs.values()):
            return
        tokens = {g.first_token for g in inc.legs.values()}
        if len(tokens) != 1:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"prefill ranks disagree on the first "
                                f"token: {sorted(tokens)}", inc.rid)
        for key in inc.legs:
            self._send(key, Ack(rid=inc.rid))
        self._close(inc, EventKind.COMPLETED, "", "", first_token=tokens.pop())

    # -- ending ------------------------------------------------------------------------
    def _abort_legs(self, inc: Incoming, reason: str, detail: str) -> None:
        for key, leg in inc.legs.items():
            peer = self.peers[key]
            if peer.lost or leg.done:
                leg.abort_acked = True
            elif not leg.abort_acked:
                self.stats["aborts_sent"] += 1
                self._send(key, Abort(rid=inc.rid, reason=reason, detail=detail))
        inc.t_progress = time.monotonic()

    def _close(self, inc: Incoming, kind: EventKind, reason: str, detail: str,
               first_token: int | None = None) -> None:
        inc.state = InState.CLOSED
        self._emit(kind, inc.rid, reason=reason, detail=detail, first_token=first_token,
                   prompt_len=inc.prompt_len)

    def _fail_rid(self, rid: str | None, reason: str, detail: str) -> None:
        inc = self.transfers.get(rid or "")
        if inc is None or inc.state == InState.CLOSED:
            return
        logger.warning("%s: %s failed (%s): %s", self.config.node, inc.rid, reason, detail)
        self._abort_legs(inc, reason, detail)
        self._close(inc, EventKind.FAILED, reason, detail)

    def _check_deadlines(self, inc: Incoming, now: float) -> None:
        cfg = self.config
        if inc.state == InState.ANNOUNCED and now - inc.t_start > cfg.admission_timeout_s:
            self.stats["timeouts.admission"] += 1
            self._fail_rid(inc.rid, "timeout", f"not accepted within "
                           f"{cfg.admission_timeout_s}s")
        elif inc.state == InState.STREAMING and (now - inc.t_progress > cfg.chunk_timeout_s
                                                 or now - inc.t_start > cfg.done_timeout_s):
            self.stats["timeouts.progress"] += 1
            self._fail_rid(inc.rid, "timeout", f"no chunk for {now - inc.t_progress:.1f}s")
        elif inc.state == InState.CLOSED and not inc.abort_settled and (
                now - inc.t_progress > cfg.chunk_timeout_s):
            self.stats["timeouts.abort_ack"] += 1
            for leg in inc.legs.values():
                leg.abort_acked = True

    def _maybe_release(self, inc: Incoming) -> None:
        if inc.state != InState.CLOSED or not inc.abort_settled:
            return
        if inc.pin_id is not None:
            self.cache.unpin(inc.pin_id)
        del self.transfers[inc.rid]
        self._remember_closed(inc.rid)

    def _on_peer_lost(self, peer: Peer, why: str) -> None:
        for rid in sorted(peer.rids):
            inc = self.transfers.get(rid)
            if inc is None or peer.key not in inc.legs:
                continue
            inc.legs[peer.key].abort_acked = True
            self._fail_rid(rid, "peer_lost", f"prefill {peer.name} lost: {why}")
        peer.rids.clear()

    def _send(self, key: bytes, msg: Message) -> bool:
        sock = self.sockets.get(key)
        if sock is None:
            return False
        sock.send([encode(msg)])
        self.stats["msgs_sent"] += 1
        return True
