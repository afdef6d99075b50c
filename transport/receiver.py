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

The class is layered: ``receiver_link.ReceiverLink`` (sockets, handshake, groups)
< ``receiver_data.ReceiverData`` (frame and shared-memory data paths) < ``KvReceiver``
(worker API, control messages, endings, pin release).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import zmq

from .config import TransportConfig
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
    KvChunk,
    KvWritten,
    Message,
    ProtocolError,
    decode,
    pages_to_bytes,
)
from .peers import unexpected_frames
from .receiver_data import ReceiverData
from .sockets import DealerSocket

logger = logging.getLogger(__name__)


class KvReceiver(ReceiverData):
    """Decode endpoint.

    Args:
        cache: this rank's ``KvCache`` (``layout.num_kv_heads`` = heads of this rank).
        config: identity, TP rank/size, deadlines and lease.
        ctx: ZMQ context to use; one is created (and terminated on ``close``) if omitted.
    """

    def __init__(self, cache, config: TransportConfig, ctx: zmq.Context | None = None):
        super().__init__(cache, config, ctx)
        self.transfers: dict[str, Incoming] = {}

    # -- worker API (``connect`` is ``ReceiverLink.connect``) ------------------------------
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
        self._poll_sockets(timeout_s)
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
        self._say_bye()
        for inc in self.transfers.values():
            if inc.pin_id is not None:
                self.cache.unpin(inc.pin_id)
        self.transfers.clear()
        self._close_link()

    # -- control messages ----------------------------------------------------------------
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
            self._peer_error(peer, msg)
            self._fail_rid(msg.rid, "error", f"peer error {msg.code}: {msg.detail}")
        elif not isinstance(msg, Heartbeat):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{type(msg).__name__} is not sent to "
                                "a decode endpoint")

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
            self._stop_waiting_for_abort_acks(inc)

    def _maybe_release(self, inc: Incoming) -> None:
        if inc.state != InState.CLOSED or not inc.abort_settled:
            return
        if inc.pin_id is not None:
            self.cache.unpin(inc.pin_id)
        del self.transfers[inc.rid]
        self._remember_closed(inc.rid)

    def _on_peer_lost(self, peer: Peer, why: str) -> None:
        for rid in self._legs_lost_with(peer):
            self._fail_rid(rid, "peer_lost", f"prefill {peer.name} lost: {why}")
