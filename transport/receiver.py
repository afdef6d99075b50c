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

``announce`` sends the request's one control message, ``Register`` (destination pages and
their allocation epochs). Data messages are checked against it - blocks, heads, epochs
(and the allocator's current owner and epoch of each page), digest - and a frame lands
only then, copied once from ZMQ's buffer into the destination pages (``receiver_data``).
With a shared pool (``KvCache(shared_memory=True)``) or NIXL the prefill writes the pages
itself (``KvWritten``, no frame), and the pages are checked after. The request is
COMPLETED when every leg's blocks landed with its last message (the first token).

Destination pages are pinned from ``announce`` until every sending rank is done with them;
on ABORTED/FAILED the worker frees its row with ``event.reason`` at once (the pin defers
the pages' release until the peer confirmed it stopped or its lease ran out). The unpin
records what landed (``xfer``: digests, refusals) in the free log.

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
from common.kv import digest_value

from . import handshake, tp
from .config import TransportConfig
from .events import Event, EventKind, EventLog
from .frame_memory import keep_frame_memory
from .incoming import Incoming, InLeg, InState
from .integrity import leg_digest, pack_epochs, run_entry, xfer_record
from .limits import ABORT_REASONS
from .link import Inbound, LinkPoll
from .messages import (
    Abort,
    AbortAck,
    Bye,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    KvChunk,
    KvWritten,
    ProtocolError,
    Register,
    pages_to_bytes,
)
from .nixl import SLICE_S
from .nixl_target import target_for
from .peers import Peer, PeerTable
from .pool_view import pool_view
from .receiver_data import Pending, check, land_chunk, written_digest
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
                                     nixl_offer=self.nixl and self.nixl.offer(),
                                     device=str(cache.data().device))
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
        this). Announce to the group at once: registrations wait here, holding no pin,
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
        """Register ``kv``'s pages with ``group``: stream positions ``[cached_tokens,
        prompt_len)`` into them (the request's one control message).

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
                or not 0 <= cached_tokens < prompt_len:
            raise ValueError(f"announce {rid!r}: in flight or cached_tokens={cached_tokens} "
                             f"not page-aligned below prompt_len={prompt_len}")
        if self.link.is_connecting(group):  # sent once the group joined (poll)
            self._parked[rid] = _Parked(group, kv, prompt_len, cached_tokens, cap)
            return
        legs = {key: self._leg(key, heads) for key, heads in self.link.legs_for(group).items()}
        dest = np.asarray(self.cache.pages(kv, 0, prompt_len), np.int64)
        epochs = self.cache.page_epochs(kv, 0, prompt_len)
        msg = Register(rid=rid, prompt_len=prompt_len, cached_tokens=cached_tokens,
                       dest_pages=pages_to_bytes(dest), dest_epochs=pack_epochs(epochs),
                       cap=cap)  # checks fields first
        todo = dest[cached_tokens // ps:]
        pin = self.cache.pin_pages(todo, reason="receive") if len(todo) else None
        self.transfers[rid] = Incoming(rid, kv, prompt_len, cached_tokens // ps, dest,
                                       epochs, pin, legs)
        for key in legs:
            self.peers[key].rids.add(rid)
            self.link.send(key, msg)

    def _leg(self, key: bytes, heads: tuple[int, int]) -> InLeg:
        peer = self.peers[key]
        return InLeg(key, heads, name=peer.name, digest=leg_digest(
            self.link.paths.get(key, "?"), self.hello.kv_digest, peer.hello.kv_digest))

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
        self._check_pending()
        # messages still unread (after a long step the budget may end first) may be the
        # very progress a deadline waits for: judge deadlines once they are read
        backlog = polled.more
        now = time.monotonic()
        for inc in list(self.transfers.values()):
            if not backlog:
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

    def heartbeat(self) -> int:
        """Only the heartbeats due now to every peer: no reading, no lease check; returns
        how many went out. For a worker's heartbeat thread while its loop runs a long
        forward pass (``common/node/pulse.py``); the caller makes sure no other thread
        uses this endpoint meanwhile (ZMQ sockets are not thread-safe)."""
        return self.link.send_heartbeats()

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
        """Register what waited for a group that has now joined; fail what waited for one
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
        if isinstance(msg, (KvChunk, KvWritten, Abort)):
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
            if msg.code == ErrorCode.NOT_HANDSHAKEN:
                # it declared us lost (we were stopped past our lease) and forgot us: so is
                # it to us, and the next request reconnects (its announces would be
                # answered this way until they timed out)
                self._lose(peer, "it no longer knows this decode (it declared it lost)")
                return
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
        if isinstance(msg, Abort):
            self.stats["aborts_recv"] += 1
            inc.legs[peer.key].abort_acked = True
            self.link.send(peer.key, AbortAck(rid=inc.rid))
            self._abort_legs(inc, msg.reason, msg.detail)
            self._end(inc, EventKind.ABORTED, msg.reason or "aborted", msg.detail)
            return
        try:
            self._on_data(peer, inc, msg, item)
        except ProtocolError as exc:
            if exc.code in (ErrorCode.STALE_PAGES, ErrorCode.CORRUPT):
                self._refuse(inc, msg, exc)
            raise
        self._maybe_complete(inc)

    def _on_data(self, peer: Peer, inc: Incoming, msg: KvChunk | KvWritten,
                 item: Inbound) -> None:
        """Check a data message against the request, the allocator and its digest; land a
        frame only then (a one-sided write is in the pages already: it is checked)."""
        if isinstance(msg, KvWritten):
            self._check_one_sided(peer, msg, item.via)
        leg = inc.leg_for_blocks(peer.key, msg)
        lo, hi = msg.first_block, msg.first_block + msg.num_blocks
        why = self.cache.check_held(inc.rid, inc.dest_pages[lo:hi], inc.dest_epochs[lo:hi])
        if why is not None:   # fail closed: nothing of it is written
            raise ProtocolError(ErrorCode.STALE_PAGES, f"blocks [{lo}, {hi}): {why}",
                                inc.rid)
        h = self.hello
        heads = tp.local_slice(leg.heads, h.total_kv_heads, h.tp_size, h.tp_rank)
        if isinstance(msg, KvChunk):
            nbytes, runs, digest = land_chunk(self.pool, inc, leg, heads, msg, item.data)
            self.stats["frames_recv"] += 1
            self.stats["frames_recv_one_run"] += runs == 1
            self.stats["bytes_recv"] += nbytes
        else:
            digest = written_digest(self.cache.data(), inc, heads, msg, leg.digest) \
                if leg.digest else None
            if isinstance(digest, tuple):   # a device fold: counted once it is read
                entry = run_entry(lo, hi - lo, leg.heads, int(inc.dest_epochs[lo]), None,
                                  msg.digest)
                inc.pending.append(Pending(peer.key, msg, *digest, entry))
                leg.runs.append(entry)
                inc.count_blocks(leg, msg)
                return
            if digest is not None:
                check(msg, digest, inc)
            self._count_written(inc, msg, item.via)
        leg.runs.append(run_entry(lo, hi - lo, leg.heads, int(inc.dest_epochs[lo]), digest,
                                  msg.digest))
        inc.count_blocks(leg, msg)

    def _check_one_sided(self, peer: Peer, msg: KvWritten, via: str) -> None:
        """A ``KvWritten`` only from a peer of a one-sided path: a same-host prefill that
        mapped our shared pool, or (``via="nixl"``) a NIXL write's notification."""
        if via == "nixl" or (self.hello.shm_pool
                             and peer.hello.shm_pool == self.hello.shm_pool):
            return
        raise ProtocolError(ErrorCode.BAD_FIELD, f"KvWritten from {peer.name}, which "
                            "did not map our pool", msg.rid)

    def _count_written(self, inc: Incoming, msg: KvWritten, via: str) -> None:
        self.stats["nixl_writes_recv" if via == "nixl" else "shm_writes_recv"] += 1
        lay = self.cache.layout   # this rank's heads: the page bytes the write filled
        nbytes = (msg.num_blocks * lay.page_bytes(self.cache.page_size)
                  * (msg.head_end - msg.head_start) // lay.num_kv_heads)
        # NIXL bytes count as received (``bytes_recv``) like frames; shm copies apart
        self.stats["bytes_recv" if via == "nixl" else "bytes_recv_shm"] += nbytes

    def _refuse(self, inc: Incoming, msg: KvChunk | KvWritten, exc: ProtocolError) -> None:
        """Record a data message refused for its pages or its digest: counted, logged, and
        kept for the free log's unpin of the request."""
        kind = "corrupt" if exc.code == ErrorCode.CORRUPT else "stale"
        self.stats[f"refused.{kind}"] += 1
        logger.error("%s: %s: refused %s: %s", self.config.node, inc.rid,
                     type(msg).__name__, exc.detail)
        inc.refused.append({"kind": kind, "first_block": msg.first_block,
                            "num_blocks": msg.num_blocks, "detail": exc.detail[:512]})

    def _check_pending(self) -> None:
        """Device digests of one-sided writes whose reduction finished: check them now."""
        for inc in list(self.transfers.values()):
            while inc.pending and inc.pending[0].ready:
                p = inc.pending.pop(0)
                if inc.state == InState.CLOSED:
                    continue
                digest = digest_value(p.value)
                p.entry[5] = digest
                try:
                    check(p.msg, digest, inc)
                except ProtocolError as exc:
                    self._refuse(inc, p.msg, exc)
                    peer = self.peers.live(p.peer)
                    if peer is not None:
                        self.link.send_error(p.peer, peer.name, exc)
                    self._fail_rid(inc.rid, "error", str(exc))
                    break
                self._count_written(inc, p.msg, "nixl")
            if inc.state != InState.CLOSED:
                self._maybe_complete(inc)

    def _maybe_complete(self, inc: Incoming) -> None:
        """Commit once every leg's blocks landed with its last message."""
        first_token = inc.complete()
        if first_token is not None:
            self._end(inc, EventKind.COMPLETED, "", "", first_token=first_token,
                      **self._received(inc))

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
        elif what == "done":
            self.stats["timeouts.done"] += 1
            self._fail_rid(inc.rid, "timeout", f"KV not complete {now - inc.t_start:.1f}s "
                           f"after the registration (done_timeout_s {cfg.done_timeout_s}s)")
        elif what == "abort_ack":  # stop waiting, so the pin goes
            self.stats["timeouts.abort_ack"] += 1
            inc.stop_waiting_for_abort_acks()

    def _maybe_release(self, inc: Incoming) -> None:
        if not inc.releasable:
            return
        if inc.pin_id is not None:
            self.cache.unpin(inc.pin_id, self._record(inc))
        del self.transfers[inc.rid]
        self.peers.remember_closed(inc.rid, inc.legs)

    def _record(self, inc: Incoming) -> dict | None:
        """The receive pin's free-log record: per leg what landed, with the digest computed
        here and the one the message claimed, and what was refused."""
        if self.cache.free_log is None:
            return None
        legs = [xfer_record(inc.rid, "recv", leg.name, leg.runs,
                            dest_pages=pages_to_bytes(inc.dest_pages))
                for leg in inc.legs.values() if leg.runs]
        if inc.refused:
            legs.append(xfer_record(inc.rid, "recv", "", [], refused=inc.refused,
                                    dest_pages=pages_to_bytes(inc.dest_pages)))
        return {"xfer": legs} if legs else None

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
