"""``KvReceiver``: the decode side of one TP rank. Connects to prefill groups, announces
requests, writes arriving pages into its pool, tracks the destination pin.

A worker's loop::

    rx = KvReceiver(cache, TransportConfig(node="d0"))
    group = rx.connect(["tcp://prefill-0:5600", "tcp://prefill-1:5600"])  # one TP group
    # (in a serving loop: rx.begin_connect(...), which never waits; announce at once)
    kv = cache.open_row(rid); cache.extend(kv, prompt_len)                  # backpressure
    rx.announce(rid, kv, prompt_len, cached_tokens=0, group=group)
    for ev in rx.poll(0.01):   # COMPLETED carries first_token; ABORTED/FAILED carry reason
        ...

Data frames are checked against the request's announce and copied once from ZMQ's
buffer into the destination pages (``receiver_data``). With a shared pool
(``KvCache(shared_memory=True)``) the receiver offers it and a same-host prefill writes
the pages itself (``KvWritten``, no frame).

Destination pages are pinned from ``announce`` until every sending rank is done with them;
on ABORTED/FAILED the worker frees its row with ``event.reason`` at once (the pin defers
the pages' release until the peer confirmed it stopped or its lease ran out).

Composed, not stacked: ``link`` (``ReceiverLink``: sockets, handshake, groups,
heartbeats) returns what arrived as values, ``peers`` (``PeerTable``) holds leases, and
each request's state and transitions are an ``Incoming``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import NamedTuple

import numpy as np
import zmq

from common.auth import INSECURE, PlaneAuth

from . import handshake, tp
from .config import TransportConfig
from .events import Event, EventKind, EventLog
from .frame_memory import keep_frame_memory
from .incoming import Incoming, InLeg, InState
from .limits import ABORT_REASONS
from .link import Inbound, LinkPoll
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
    ProtocolError,
    pages_to_bytes,
)
from .nixl import SLICE_S
from .nixl_target import target_for
from .peers import Peer, PeerTable
from .pool_view import pool_view
from .receiver_data import land_chunk
from .receiver_link import DRAIN_BYTES, ReceiverLink

logger = logging.getLogger(__name__)
MAX_POLL_BYTES = 256 << 20  # one poll lands at most about this much, then returns


class _Parked(NamedTuple):
    """An announcement waiting for its group's handshake."""

    group: int
    kv: object
    prompt_len: int
    cached_tokens: int
    cap: str = ""


class KvReceiver:
    """Decode endpoint. Poll-driven, single-threaded, not thread-safe: call ``poll`` at
    least once per heartbeat interval (every wait is checked there).

    Args:
        cache: this rank's ``KvCache`` (``layout.num_kv_heads`` = heads of this rank).
        config: identity, TP rank/size, deadlines and lease.
        ctx: ZMQ context to use; one is created (and terminated on ``close``) if omitted.
        auth: the KV credentials to present to prefills (the deployment's).
    """

    def __init__(self, cache, config: TransportConfig, ctx: zmq.Context | None = None,
                 auth: PlaneAuth = INSECURE):
        self.config, self.cache = config, cache
        if config.keep_frame_memory:
            keep_frame_memory()
        self.stats: Counter[str] = Counter()
        self.events = EventLog(self.stats)
        self.peers = PeerTable(config.node, config.heartbeat_s, self.stats)
        self.transfers: dict[str, Incoming] = {}
        self._parked: dict[str, _Parked] = {}   # announced to a group still connecting
        self.pool = pool_view(cache.data())
        # before the context: a NIXL that cannot serve kv_transport=nixl raises here
        self.nixl = target_for(config, cache, self.stats)  # None unless kv_transport asks
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        shm_name = cache.shared_memory_name() or ""
        hello = handshake.make_hello(config, cache.layout, cache.page_size, "decode",
                                     shm_pool=shm_name, shm_pages=cache.num_pages,
                                     shm_token=cache.shared_memory_token(),
                                     nixl_offer=self.nixl and self.nixl.offer())
        self.link = ReceiverLink(self._ctx, hello, config, self.peers, self.stats, self.nixl,
                                 auth)

    @property
    def hello(self) -> Hello:
        return self.link.hello

    def data_paths(self) -> dict[str, str]:
        """Data path of each live prefill peer (``shm``, ``tcp``, ``ipc``), by peer label."""
        return {p.label: self.link.paths.get(p.key, "?") for p in self.peers.values()
                if not p.lost}

    # -- worker API ----------------------------------------------------------------------
    def connect(self, addresses: list[str] | str) -> int:
        """Connect to every rank of one prefill TP group and handshake with each.

        Returns:
            the group id to pass to ``announce``.
        Raises:
            HandshakeError: a rank's version, model, layout or TP setup differs.
            TimeoutError: a rank did not answer within ``handshake_timeout_s``.
        """
        return self.link.connect(addresses)

    def begin_connect(self, addresses: list[str] | str) -> int:
        """Start connecting to one prefill TP group; never waits (a worker's loop uses
        this). Announce to the group at once: announcements wait here, holding no pin,
        until every rank answered; if the handshake fails or passes
        ``handshake_timeout_s``, each ends FAILED (reason ``error``, detail says why).

        Returns:
            the group id to pass to ``announce``.
        """
        return self.link.begin(addresses)

    def group_lost(self, group: int) -> bool:
        """True when a rank of ``group`` is lost: ``connect`` it again before announcing."""
        return self.link.group_lost(group)

    def announce(self, rid: str, kv, prompt_len: int, cached_tokens: int = 0,
                 group: int = 0, cap: str = "") -> None:
        """Ask ``group`` to stream positions ``[cached_tokens, prompt_len)`` into ``kv``.

        Args:
            kv: the preallocated row (``allocated_len >= prompt_len``); the worker keeps
                owning it and frees it; the transport pins its destination pages.
            cached_tokens: page-aligned prefix already held (prefix cache).
            group: a group from ``connect`` or ``begin_connect`` (still connecting: the
                announcement waits for it, see ``begin_connect``).
            cap: the request's KV capability from the router (docs/security.md); a
                prefill that requires capabilities sends nothing without it.
        Raises:
            ValueError: rid in flight, misaligned prefix, or a needed rank is lost.
        """
        ps = self.cache.page_size
        if rid in self.transfers or rid in self._parked or cached_tokens % ps \
                or not 0 <= cached_tokens <= prompt_len:
            raise ValueError(f"announce {rid!r}: in flight or cached_tokens={cached_tokens} "
                             f"not page-aligned within prompt_len={prompt_len}")
        if self.link.is_connecting(group):  # sent once the group joined (poll)
            self._parked[rid] = _Parked(group, kv, prompt_len, cached_tokens, cap)
            return
        legs = {key: InLeg(key, heads) for key, heads in self.link.legs_for(group).items()}
        dest = np.asarray(self.cache.pages(kv, 0, prompt_len), np.int64)
        msg = Announce(rid=rid, prompt_len=prompt_len, cached_tokens=cached_tokens,
                       dest_pages=pages_to_bytes(dest), cap=cap)  # checks fields first
        todo = dest[cached_tokens // ps:]
        pin = self.cache.pin_pages(todo, reason="receive") if len(todo) else None
        self.transfers[rid] = Incoming(rid, kv, prompt_len, cached_tokens // ps, dest, pin,
                                       legs)
        for key in legs:
            self.peers[key].rids.add(rid)
            self.link.send(key, msg)

    def abort(self, rid: str, reason: str = "aborted", detail: str = "") -> bool:
        """Abort ``rid`` towards its prefill ranks; the destination pin stays until each
        acknowledges or is lost. Returns False when rid is unknown or already final."""
        if reason not in ABORT_REASONS:
            raise ValueError(f"abort({rid!r}): reason={reason!r}; allowed: {ABORT_REASONS}")
        if self._parked.pop(rid, None) is not None:  # never announced: nothing to stop
            return True
        inc = self.transfers.get(rid)
        if inc is None or inc.state == InState.CLOSED:
            return False
        self._abort_legs(inc, reason, detail)
        inc.close()
        return True

    def poll(self, timeout_s: float = 0.0) -> list[Event]:
        """Handle what arrived (waiting up to ``timeout_s`` for it), write pages, send
        heartbeats, check leases and deadlines, release settled pins.

        Returns:
            events since the last call, oldest first.
        """
        nixl_open = self.poll_within() is not None
        polled, budget = self.link.poll(timeout_s, nixl_open), MAX_POLL_BYTES
        self._take(polled)
        while polled.more and budget > 0:  # land what we hold before reading on
            budget -= DRAIN_BYTES
            polled = self.link.poll(0)
            self._take(polled)
        self.link.advance()   # handshakes under way; what waited for them goes out
        self._announce_parked()
        now = time.monotonic()
        for inc in list(self.transfers.values()):
            self._check_deadlines(inc, now)
            self._maybe_release(inc)
        return self.events.take()

    def _take(self, polled: LinkPoll) -> None:
        for item in polled.inbound:
            try:
                if item.error is not None:
                    raise item.error
                self._on_message(item)
            except ProtocolError as exc:
                self.link.send_error(item.peer.key, item.peer.name, exc)
                self._fail_rid(exc.rid, "error", str(exc), by=item.peer)
            except Exception as exc:  # a bug here must not take the worker down
                rid = getattr(item.msg, "rid", None)
                logger.exception("%s: handling %s from %s", self.config.node,
                                 type(item.msg).__name__, item.peer.name)
                self.link.send_error(item.peer.key, item.peer.name, ProtocolError(
                    ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", rid))
                self._fail_rid(rid, "error", f"internal error: {exc}", by=item.peer)
        self._judge_deferred_dones()
        polled.inbound.clear()  # frees the frames we landed before the next are read
        for peer, why, clean in polled.lost:
            self._lose(peer, why, clean)

    def sockets(self) -> list[zmq.Socket]:
        """The sockets a worker's loop may wait on (readable: call ``poll``)."""
        return [s.sock for s in self.link.sockets.values()] + self.link.pending_sockets()

    def poll_within(self) -> float | None:
        """Seconds within which a worker should call ``poll`` again (a NIXL leg is open:
        no socket wakes the worker for its notifications, and over TCP its bytes land
        only while we poll); None: whenever."""
        if self.nixl is not None and self.nixl.active(self.transfers):
            return SLICE_S
        return None

    @property
    def num_pins(self) -> int:
        return sum(inc.pin_id is not None for inc in self.transfers.values())

    def close(self) -> None:
        """Say Bye to every prefill rank, drop all pins, close sockets (``linger=0``)."""
        for peer in self.peers.values():
            if not peer.lost:
                self.link.send(peer.key, Bye(reason="closing"))
        for inc in self.transfers.values():
            if inc.pin_id is not None:
                self.cache.unpin(inc.pin_id)
        self.transfers.clear()
        self._parked.clear()
        self.link.close()
        if self._own_ctx:
            self._ctx.term()

    # -- what the link found -------------------------------------------------------------
    def _announce_parked(self) -> None:
        """Announce what waited for a group that has now joined; fail what waited for one
        that did not."""
        for rid, p in list(self._parked.items()):
            if self.link.is_connecting(p.group):
                continue
            del self._parked[rid]
            try:
                self.announce(rid, p.kv, p.prompt_len, p.cached_tokens, p.group, p.cap)
            except ValueError as exc:  # the group did not connect, or lost a rank since
                logger.warning("%s: %s failed (error): %s", self.config.node, rid, exc)
                self.events.emit(EventKind.FAILED, rid, reason="error", detail=str(exc),
                                 prompt_len=p.prompt_len)

    def _on_message(self, item: Inbound) -> None:
        peer, msg = item.peer, item.msg
        if isinstance(msg, (KvChunk, KvWritten, Accepted, Done, Abort)):
            inc = self._incoming(peer, msg.rid)
            if inc is not None:
                self._on_request_msg(peer, inc, item)
            elif isinstance(msg, Abort):
                self.link.send(peer.key, AbortAck(rid=msg.rid))
            elif item.via == "nixl":  # written before the peer saw our Abort: pinned pages
                self.stats["nixl_writes_late"] += 1
        elif isinstance(msg, AbortAck):
            inc = self.transfers.get(msg.rid)
            if inc is not None and peer.key in inc.legs:
                inc.legs[peer.key].abort_acked = True
            else:
                self.stats["late_msgs"] += 1
        elif isinstance(msg, Error):
            self.stats["errors_recv"] += 1
            logger.warning("%s: peer %s reports %r: %r", self.config.node, peer.name,
                           msg.code, msg.detail)
            self._fail_rid(msg.rid, "error", f"peer error {msg.code}: {msg.detail}",
                           by=peer)
        elif not isinstance(msg, Heartbeat):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{type(msg).__name__} is not sent to "
                                "a decode endpoint")

    def _incoming(self, peer: Peer, rid: str) -> Incoming | None:
        """The open request ``rid`` that ``peer`` serves; None for a recently closed rid.

        Raises:
            ProtocolError: ``rid`` was never announced to ``peer``.
        """
        inc = self.transfers.get(rid)
        if inc is not None and peer.key in inc.legs and inc.state != InState.CLOSED:
            return inc
        if self.peers.recently_closed(rid) or (inc is not None and peer.key in inc.legs):
            self.stats["late_msgs"] += 1
            return None
        raise ProtocolError(ErrorCode.UNKNOWN_RID, f"unknown rid {rid!r}", None)

    def _on_request_msg(self, peer: Peer, inc: Incoming, item: Inbound) -> None:
        msg = item.msg
        if isinstance(msg, KvChunk):
            self._on_chunk(peer, inc, msg, item.data)
        elif isinstance(msg, KvWritten):
            self._on_written(peer, inc, msg, item.via)
        elif isinstance(msg, Accepted):
            inc.accept(peer.key)
        elif isinstance(msg, Done):
            self._on_done(peer.key, inc, msg)
        elif isinstance(msg, Abort):
            self.stats["aborts_recv"] += 1
            inc.legs[peer.key].abort_acked = True
            self.link.send(peer.key, AbortAck(rid=inc.rid))
            self._abort_legs(inc, msg.reason, msg.detail)
            self._end(inc, EventKind.ABORTED, msg.reason or "aborted", msg.detail)

    def _on_written(self, peer: Peer, inc: Incoming, msg: KvWritten, via: str) -> None:
        """Blocks a same-host prefill copied into our shared pool, or (``via="nixl"``) a
        NIXL write's notification; either only from a peer of that data path."""
        if via == "nixl":
            counter = "nixl_writes_recv"
        elif self.hello.shm_pool and peer.hello.shm_pool == self.hello.shm_pool:
            counter = "shm_writes_recv"
        else:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"KvWritten from {peer.name}, which "
                                "did not map our pool", msg.rid)
        inc.count_blocks(inc.leg_for_blocks(peer.key, msg), msg.num_blocks)
        self.stats[counter] += 1
        lay = self.cache.layout   # this rank's heads: the page bytes the write filled
        nbytes = (msg.num_blocks * lay.page_bytes(self.cache.page_size)
                  * (msg.head_end - msg.head_start) // lay.num_kv_heads)
        # NIXL bytes count as received (``bytes_recv``) like frames; shm copies apart
        self.stats["bytes_recv" if via == "nixl" else "bytes_recv_shm"] += nbytes

    def _on_done(self, key: bytes, inc: Incoming, msg: Done) -> None:
        leg, want = inc.legs[key], inc.total_blocks - inc.cached_blocks
        if leg.blocks_received < want and self.nixl is not None and \
                self.nixl.defer_done(key, inc.rid, msg):
            return  # the leg's NIXL notifications are still on their way
        first_token = inc.done(key, msg)
        if first_token is not None:
            for k in inc.legs:
                self.link.send(k, Ack(rid=inc.rid))
            self._end(inc, EventKind.COMPLETED, "", "", first_token=first_token,
                      **self._received(inc))

    def _judge_deferred_dones(self) -> None:
        """Deferred Dones whose notifications came in (or that are overdue)."""
        if self.nixl is None:
            return
        for key, msg in self.nixl.due_dones(self.transfers, self.config):
            try:
                self._on_done(key, self.transfers[msg.rid], msg)
            except ProtocolError as exc:
                peer = self.peers[key]
                self.link.send_error(key, peer.name, exc)
                self._fail_rid(exc.rid, "error", str(exc), by=peer)
            finally:
                self.nixl.judged(key, msg.rid)

    def _on_chunk(self, peer: Peer, inc: Incoming, msg: KvChunk, data: list) -> None:
        leg = inc.leg_for_blocks(peer.key, msg)
        h = self.hello
        heads = tp.local_slice(leg.heads, h.total_kv_heads, h.tp_size, h.tp_rank)
        nbytes, runs = land_chunk(self.pool, inc, leg, heads, msg, data)
        inc.count_blocks(leg, msg.num_blocks)
        self.stats["frames_recv"] += 1
        self.stats["frames_recv_one_run"] += runs == 1
        self.stats["bytes_recv"] += nbytes

    def _received(self, inc: Incoming) -> dict:
        """What a completed transfer brought this rank (its COMPLETED event's figures):
        the legs together cover this rank's heads of every page once."""
        pages = inc.total_blocks - inc.cached_blocks
        now = time.monotonic()
        paths = sorted({self.link.paths.get(key, "?") for key in inc.legs})
        return {"kv_pages": pages,
                "kv_bytes": pages * self.cache.layout.page_bytes(self.cache.page_size),
                "xfer_s": now - inc.t_first_data if inc.t_first_data else 0.0,
                "path": "+".join(paths)}

    # -- endings -------------------------------------------------------------------------
    def _abort_legs(self, inc: Incoming, reason: str, detail: str) -> None:
        for key in inc.legs_to_abort(lambda k: self.peers.live(k) is not None):
            self.stats["aborts_sent"] += 1
            self.link.send(key, Abort(rid=inc.rid, reason=reason, detail=detail))

    def _end(self, inc: Incoming, kind: EventKind, reason: str, detail: str,
             first_token: int | None = None, **figures) -> None:
        inc.close()
        self.events.emit(kind, inc.rid, reason=reason, detail=detail,
                         first_token=first_token, prompt_len=inc.prompt_len, **figures)

    def _fail_rid(self, rid: str | None, reason: str, detail: str,
                  by: Peer | None = None) -> None:
        """Fail ``rid`` if it is open here; a peer's fault (``by``) fails only a request
        that peer serves, so nobody can fail another prefill's request by naming it."""
        inc = self.transfers.get(rid or "")
        if inc is None or inc.state == InState.CLOSED or (by is not None
                                                          and by.key not in inc.legs):
            return
        logger.warning("%s: %s failed (%s): %s", self.config.node, inc.rid, reason, detail)
        self._abort_legs(inc, reason, detail)
        self._end(inc, EventKind.FAILED, reason, detail)

    def _check_deadlines(self, inc: Incoming, now: float) -> None:
        cfg, what = self.config, inc.overdue(now, self.config)
        if what == "admission":
            self.stats["timeouts.admission"] += 1
            self._fail_rid(inc.rid, "timeout", f"not accepted within "
                           f"{cfg.admission_timeout_s}s")
        elif what == "progress":
            self.stats["timeouts.progress"] += 1
            self._fail_rid(inc.rid, "timeout", f"no chunk for {now - inc.t_progress:.1f}s")
        elif what == "abort_ack":  # stop waiting, so the pin goes
            self.stats["timeouts.abort_ack"] += 1
            inc.stop_waiting_for_abort_acks()

    def _maybe_release(self, inc: Incoming) -> None:
        if not inc.releasable:
            return
        if inc.pin_id is not None:
            self.cache.unpin(inc.pin_id)
        del self.transfers[inc.rid]
        self.peers.remember_closed(inc.rid, inc.legs)

    def _lose(self, peer: Peer, why: str, clean: bool = False) -> None:
        """``peer`` is gone: its legs count as abort-acked, its open requests fail."""
        if peer.lost:
            return
        if self.nixl is not None:
            self.nixl.forget(peer.key)
        for rid in self.peers.mark_lost(peer, why, clean):
            inc = self.transfers.get(rid)
            if inc is not None and peer.key in inc.legs:
                inc.legs[peer.key].abort_acked = True
                self._fail_rid(rid, "peer_lost", f"prefill {peer.name} lost: {why}")
        self.link.drop(peer.key)
        self.events.emit(EventKind.PEER_LOST, peer=peer.name, reason="peer_lost", detail=why)
