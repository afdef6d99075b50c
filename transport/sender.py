"""``KvSender``: the prefill side of one TP rank. Binds, streams pages, tracks pins.

A worker's loop::

    sender = KvSender(cache, "tcp://0.0.0.0:5600", TransportConfig(node="p0"))
    for ev in sender.poll(0.01):          # Register -> READY, drained -> COMPLETED, ...
        ...
    sender.send(rid, kv, upto)            # after each prefill chunk (any size)
    sender.finish(rid, kv, first_token)   # whole prompt; the last block carries the token
    cache.free_kv_row(kv, [(0, kv.allocated_len)], reason="sent")  # on COMPLETED

The success path has one control message, the decode's ``Register``: data messages
carry their epochs, digest and (the last of each leg) the first token, and the request is
COMPLETED here when its own transfers report done - ZMQ released the last frame's
zero-copy reference (``MessageTracker``), the copy into a same-host decode's shared pool
returned (``shm.ShmChannel``), the NIXL writes are ``DONE``. Nobody sends Done or Ack.
Source pages stay pinned until then (or until the peer is gone); the worker alone frees
rows (reason from the final ``Event``).

Composed, not stacked: ``link`` (``SenderLink``: socket, handshake, heartbeats, data
channel per peer) returns what arrived as values, ``peers`` (``PeerTable``) holds leases,
``streamer`` (``Streamer``) pins and streams, and each request's state and transitions
are an ``Outgoing``. This class decides what messages mean for requests.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import zmq

from common.auth import INSECURE, PlaneAuth

from . import handshake, tp
from .capability import Capabilities
from .channel import PostFailed
from .config import TransportConfig
from .events import Event, EventKind, EventLog
from .integrity import leg_digest
from .limits import ABORT_REASONS
from .link import Inbound
from .messages import (
    Abort,
    AbortAck,
    Bye,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    ProtocolError,
    Register,
)
from .nixl_channel import source_for
from .outgoing import Outgoing, OutState, registered_leg
from .peers import Peer, PeerTable
from .pool_view import pool_view
from .sender_link import SenderLink
from .streamer import Streamer

logger = logging.getLogger(__name__)
BYE_SETTLE_S = 0.2
"""How long a clean ``Bye`` lets our NIXL writes to that peer report done before its
requests that are still draining fail (``peer_lost``)."""


class KvSender:
    """Prefill endpoint. Poll-driven, single-threaded, not thread-safe: call ``poll`` at
    least once per heartbeat interval (every wait is checked there).

    Args:
        cache: this rank's ``KvCache`` (``layout.num_kv_heads`` = heads of this rank).
        address: where to bind (``tcp://host:port``, ``tcp://host:*``, ``ipc://path``).
        config: identity, TP rank/size, deadlines and lease.
        ctx: ZMQ context to use; one is created (and terminated on ``close``) if omitted.
        auth: how decode peers authenticate (the deployment's KV credentials);
            without them only loopback or a private ipc path may be bound.
    """

    def __init__(self, cache, address: str, config: TransportConfig,
                 ctx: zmq.Context | None = None, auth: PlaneAuth = INSECURE):
        self.config, self.cache = config, cache
        self.stats: Counter[str] = Counter()
        self.events = EventLog(self.stats)
        self.peers = PeerTable(config.node, config.heartbeat_s, self.stats)
        self.transfers: dict[str, Outgoing] = {}
        # before the context: a NIXL that cannot serve kv_transport=nixl raises here
        self.nixl = source_for(config, cache, self.stats)  # None unless kv_transport asks
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        hello = handshake.make_hello(config, cache.layout, cache.page_size, "prefill",
                                     nixl_offer=self.nixl and {
                                         "nixl_agent": self.nixl.agent.name},
                                     device=str(cache.data().device))
        self.caps = Capabilities(config.require_capability, config.admission_timeout_s,
                                 self.stats)
        try:
            self.link = SenderLink(self._ctx, address, pool_view(cache.data()), hello, config,
                                   self.peers, self.stats, self.nixl, auth)
        except BaseException:
            if self._own_ctx:
                self._ctx.term()
            raise
        self.streamer = Streamer(cache, self.link)
        self.address = self.link.address

    @property
    def hello(self) -> Hello:
        return self.link.hello

    def data_paths(self) -> dict[str, str]:
        """Data path of each live decode peer (``nixl``, ``shm``, ``tcp``, ``ipc``), by peer label:
        a same-host decode whose pool could not be mapped shows frames here."""
        return {p.label: self.link.data_path(p.key) for p in self.peers.values()
                if not p.lost}

    # -- worker API ----------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.0) -> list[Event]:
        """Handle what arrived (waiting up to ``timeout_s`` for the first message), send
        heartbeats, check leases and deadlines, release finished pins.

        Returns:
            events since the last call, oldest first.
        """
        self._pump(int(timeout_s * 1000))
        now = time.monotonic()
        for held, exc in self.caps.expire(now):
            self.link.send_error(held.peer.key, held.peer.name, exc)
        for out in list(self.transfers.values()):
            self._check_deadlines(out, now)
            self._release(out)
        return self.events.take()

    def _complete(self, out: Outgoing) -> None:
        """Every block went out and our own transfers report done: COMPLETED ("sent")."""
        out.close()
        self.events.emit(EventKind.COMPLETED, out.rid, reason="sent",
                         first_token=out.first_token, prompt_len=out.prompt_len,
                         cached_tokens=out.cached_blocks * self.hello.page_size,
                         path="+".join(sorted({self.link.data_path(k) for k in out.legs})))

    def send(self, rid: str, kv, upto: int) -> bool:
        """Hand positions ``[0, upto)`` of ``kv``'s row to the transport (full pages only;
        a partial last page waits for ``finish``). Pins them; sends once every leg
        registered (until then the pins hold them: a missing registration is the
        backpressure, bounded by ``admission_timeout_s``).

        Returns:
            False (nothing pinned) when ``rid`` was aborted or failed; its final event is
            or will be in ``poll``'s answer, and the worker frees the row then.
        """
        self._pump(0)  # a decode's Abort must be seen before writing into its pool
        out = self._outgoing_for_send(rid, kv)
        if out is None:
            return False
        self.streamer.hand_over(out, upto // self.cache.page_size)
        self._flush(out)
        return True

    def finish(self, rid: str, kv, first_token: int) -> bool:
        """Hand over the whole prompt (``kv.allocated_len`` >= prompt length); the message
        of its last block carries ``first_token`` to every leg. Returns as ``send``."""
        self._pump(0)
        out = self._outgoing_for_send(rid, kv)
        if out is None:
            return False
        out.finished, out.first_token = True, int(first_token)
        if out.state == OutState.ASSEMBLING:
            # the prompt length arrives with the Register; hand over what the row holds
            self.streamer.hand_over(out, -(-kv.allocated_len // self.cache.page_size))
        else:
            self.streamer.hand_over(out, out.total_blocks)
        self._flush(out)
        return True

    def expect(self, rid: str, cap: str) -> None:
        """The router gave this rank ``rid`` with capability ``cap``: honour the
        registration that carries it (also one that came already), refuse any other
        (``require_capability``; docs/security.md)."""
        ready, refused = self.caps.expect(rid, cap)
        for held, exc in refused:
            self.link.send_error(held.peer.key, held.peer.name, exc)
        for held in ready:
            if self.peers.live(held.peer.key) is None:
                continue
            try:
                self._on_register(held.peer, held.msg)
            except ProtocolError as exc:
                self.link.send_error(held.peer.key, held.peer.name, exc)

    def abort(self, rid: str, reason: str = "aborted", detail: str = "") -> bool:
        """Abort ``rid`` towards every decode rank; pins stay until each acknowledges or
        is lost. Returns False when ``rid`` is unknown or already final here."""
        if reason not in ABORT_REASONS:
            raise ValueError(f"abort({rid!r}): reason={reason!r}; allowed: {ABORT_REASONS}")
        out = self.transfers.get(rid)
        if out is None or out.state.is_final:
            return False
        self._abort_legs(out, reason, detail)
        out.close(aborted=True)
        return True

    def sockets(self) -> list[zmq.Socket]:
        """The sockets a worker's loop may wait on (readable: call ``poll``)."""
        return [self.link.router.sock]

    def poll_within(self) -> float | None:
        """Seconds within which a worker should call ``poll`` again (NIXL writes in
        flight move only when polled, and no socket wakes the worker for them)."""
        return self.link.poll_within()

    def heartbeat(self) -> int:
        """Only the heartbeats due now to every peer: no reading, no lease check; returns
        how many went out. For a worker's heartbeat thread while its loop runs a long
        forward pass (``common/node/pulse.py``); the caller makes sure no other thread
        uses this endpoint meanwhile (ZMQ sockets are not thread-safe)."""
        return self.link.send_heartbeats()

    @property
    def num_pins(self) -> int:
        return sum(len(o.pins) for o in self.transfers.values())

    def close(self) -> None:
        """Let NIXL writes finish (bounded), say Bye to every peer, drop all pins, close
        the socket (``linger=0``)."""
        if self.nixl is not None:
            self.nixl.finish()
            self._pump(0)  # send what the writes held
        for peer in self.peers.values():
            if not peer.lost:
                self.link.send(peer.key, Bye(reason="closing"))
        for out in self.transfers.values():
            self.streamer.unpin_all(out)
        self.transfers.clear()
        self.link.close()
        if self._own_ctx:
            self._ctx.term()

    # -- what the link found -------------------------------------------------------------
    def _pump(self, timeout_ms: int) -> None:
        polled = self.link.poll(timeout_ms)
        for ev in polled.events:
            self.events.add(ev)
        for item in polled.inbound:
            try:
                if item.error is not None:
                    raise item.error
                self._on_message(item)
            except ProtocolError as exc:
                self.link.send_error(item.peer.key, item.peer.name, exc)
            except Exception as exc:  # a bug here must not take the worker down
                rid = getattr(item.msg, "rid", None)
                logger.exception("%s: handling %s from %s", self.config.node,
                                 type(item.msg).__name__, item.peer.name)
                self.link.send_error(item.peer.key, item.peer.name, ProtocolError(
                    ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", rid))
                out = self.transfers.get(rid or "")
                if out is not None and not out.state.is_final:
                    self._fail(out, "error", f"internal error: {exc}")
        for peer, why, clean in polled.lost:
            self._lose(peer, why, clean)

    def _on_message(self, item: Inbound) -> None:
        peer, msg = item.peer, item.msg
        if isinstance(msg, Register):
            self._on_register(peer, msg)
        elif isinstance(msg, Abort):
            self._on_abort(peer, msg)
        elif isinstance(msg, AbortAck):
            out = self._leg_owner(peer, msg.rid)
            if out is not None:
                out.legs[peer.key].abort_acked = True
        elif isinstance(msg, Error):
            self._on_error(peer, msg)
        elif not isinstance(msg, Heartbeat):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{type(msg).__name__} is not sent "
                                "to a prefill endpoint", getattr(msg, "rid", None))

    def _on_register(self, peer: Peer, msg: Register) -> None:
        if not self.caps.admit(peer, msg, time.monotonic()):
            return  # held until the worker learns rid's capability from the router
        out = self.transfers.get(msg.rid)
        if self.peers.recently_closed(msg.rid) or (out is not None and out.state.is_final):
            raise ProtocolError(ErrorCode.DUPLICATE_RID, f"{msg.rid!r} is closing", msg.rid)
        if out is not None and peer.key in out.legs:
            raise ProtocolError(ErrorCode.DUPLICATE_RID, f"{msg.rid!r} registered twice",
                                msg.rid)
        # pages we write into ourselves (shared memory, NIXL): each id inside that pool
        path = self.link.data_path(peer.key)
        limit = peer.hello.shm_pages if peer.key in self.link.shm else \
            peer.hello.nixl_pages if path == "nixl" else None
        try:
            leg = registered_leg(self.hello, peer.key, peer.hello, msg, out, limit)
        except ProtocolError as exc:
            self.stats[f"refused.register.{exc.code.value}"] += 1
            raise
        leg.name = peer.name
        leg.digest = leg_digest(path, self.hello.kv_digest, peer.hello.kv_digest)
        out = out or self.transfers.setdefault(msg.rid, Outgoing(msg.rid))
        h, ps = self.hello, self.hello.page_size
        expected = len(tp.peer_ranks(h.total_kv_heads, h.tp_size, h.tp_rank,
                                     peer.hello.tp_size))
        peer.rids.add(msg.rid)
        if out.add_leg(leg, msg.prompt_len, msg.cached_tokens // ps, -(-msg.prompt_len // ps),
                       expected):
            self._accept(out)

    def _accept(self, out: Outgoing) -> None:
        if out.kv is not None and out.handed > out.total_blocks:
            self._fail(out, "error", f"row holds {out.handed} pages, prompt needs "
                       f"{out.total_blocks}")
            return
        out.accept()   # nothing goes back: the data messages are the answer
        self.events.emit(EventKind.READY, out.rid, prompt_len=out.prompt_len,
                         cached_tokens=out.cached_blocks * self.hello.page_size)
        if out.finished:
            self.streamer.hand_over(out, out.total_blocks)
        self._flush(out)

    def _on_abort(self, peer: Peer, msg: Abort) -> None:
        self.link.send_after_writes(peer.key, msg.rid, AbortAck(rid=msg.rid))
        out = self.transfers.get(msg.rid)
        if out is None or peer.key not in out.legs:
            self.stats["aborts_unknown_rid"] += 1
            return
        self.stats["aborts_recv"] += 1
        out.legs[peer.key].abort_acked = True
        if not out.state.is_final:
            self._abort_legs(out, msg.reason, msg.detail)
            self._end(out, EventKind.ABORTED, msg.reason or "aborted", msg.detail)

    def _on_error(self, peer: Peer, msg: Error) -> None:
        self.stats["errors_recv"] += 1
        logger.warning("%s: peer %s reports %r: %r", self.config.node, peer.name, msg.code,
                       msg.detail)
        out = self.transfers.get(msg.rid)
        if out is not None and peer.key in out.legs and not out.state.is_final:
            self._fail(out, "error", f"peer error {msg.code}: {msg.detail}")

    def _leg_owner(self, peer: Peer, rid: str) -> Outgoing | None:
        """The request of an AbortAck; None (counted as late) when rid is already gone,
        as happens when two Aborts cross."""
        out = self.transfers.get(rid)
        if out is None or peer.key not in out.legs:
            self.stats["late_msgs"] += 1
            return None
        return out

    # -- endings -------------------------------------------------------------------------
    def _lose(self, peer: Peer, why: str, clean: bool = False) -> None:
        """``peer`` is gone: its legs count as abort-acked, its open requests fail."""
        if peer.lost:
            return
        self.caps.drop_peer(peer.key)
        if clean and self.nixl is not None:
            # a decode that says Bye took every write it counted: let ours report so
            # (bounded), so that requests it completed complete here too
            self.nixl.finish(BYE_SETTLE_S)
        for rid in self.peers.mark_lost(peer, why, clean):
            out = self.transfers.get(rid)
            if out is None or peer.key not in out.legs:
                continue
            out.legs[peer.key].abort_acked = True
            if out.state == OutState.DRAINING:   # every block went out: complete if our
                self.streamer.release(out, ())    # own transfers report done (not lost)
                if out.drained:
                    self._complete(out)
            if not out.state.is_final:
                self._fail(out, "peer_lost", f"decode {peer.name} lost: {why}")
        self.link.drop_peer(peer.key)
        self.events.emit(EventKind.PEER_LOST, peer=peer.name, reason="peer_lost", detail=why)

    def _abort_legs(self, out: Outgoing, reason: str, detail: str) -> None:
        """Send ``Abort`` to every live leg that has not stopped yet."""
        self.stats["aborts_sent"] += 1
        for leg in out.legs_to_abort(lambda key: self.peers.live(key) is not None):
            self.link.send_after_writes(leg.peer, out.rid,
                                        Abort(rid=out.rid, reason=reason, detail=detail))

    def _end(self, out: Outgoing, kind: EventKind, reason: str, detail: str) -> None:
        out.close(aborted=True)
        self.events.emit(kind, out.rid, reason=reason, detail=detail)

    def _fail(self, out: Outgoing, reason: str, detail: str) -> None:
        logger.warning("%s: %s failed (%s): %s", self.config.node, out.rid, reason, detail)
        self._abort_legs(out, reason, detail)
        self._end(out, EventKind.FAILED, reason, detail)

    def _check_deadlines(self, out: Outgoing, now: float) -> None:
        cfg, what = self.config, out.overdue(now, self.config)
        if what == "admission":
            self.stats["timeouts.admission"] += 1
            self._fail(out, "timeout", f"not every decode rank registered within "
                       f"{cfg.admission_timeout_s}s")
        elif what == "progress":
            self.stats["timeouts.progress"] += 1
            self._fail(out, "timeout", f"no progress on {out.state.name} for "
                       f"{now - out.t_progress:.1f}s")
        elif what == "done":
            self.stats["timeouts.done"] += 1
            self._fail(out, "timeout", f"not sent {now - out.t_start:.1f}s after the "
                       f"registrations (done_timeout_s {cfg.done_timeout_s}s)")
        elif what == "abort_ack":  # stop waiting, so the pins go
            self.stats["timeouts.abort_ack"] += 1
            out.stop_waiting_for_abort_acks()

    # -- outgoing ------------------------------------------------------------------------
    def _outgoing_for_send(self, rid: str, kv) -> Outgoing | None:
        out = self.transfers.get(rid)
        if out is None and not self.peers.recently_closed(rid):
            out = self.transfers[rid] = Outgoing(rid)
        if out is None or out.state.is_final:
            self.stats["sends_after_final"] += 1
            return None
        out.kv = kv
        out.touched(time.monotonic())
        return out

    def _flush(self, out: Outgoing) -> None:
        try:
            gone = self.streamer.flush(out)
        except PostFailed as exc:   # this request cannot be posted: it alone fails
            self.stats["post_failed"] += 1
            self._fail(out, "error", f"post failed: {exc}")
            return
        peer = None if gone is None else self.peers.live(gone)
        if peer is not None:
            self._lose(peer, "unreachable while sending")

    def _release(self, out: Outgoing) -> None:
        """Unpin what no live peer reads; complete a drained transfer; drop a closed,
        unpinned one."""
        self.streamer.release(out, {k for k in out.legs if self.peers.live(k) is None})
        if out.drained:
            self._complete(out)
        if out.removable:
            del self.transfers[out.rid]
            self.peers.remember_closed(out.rid, out.legs)
