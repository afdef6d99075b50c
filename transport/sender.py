"""``KvSender``: the prefill side of one TP rank. Binds, streams pages, tracks pins.

A worker's loop::

    sender = KvSender(cache, "tcp://0.0.0.0:5600", TransportConfig(node="p0"))
    for ev in sender.poll(0.01):          # Announce -> READY, Ack -> COMPLETED, ...
        ...
    sender.send(rid, kv, upto)            # after each prefill chunk (any size)
    sender.finish(rid, kv, first_token)   # whole prompt; sends the tail page and Done
    cache.free_kv_row(kv, [(0, kv.allocated_len)], reason="sent")  # safe at once: pinned

The sender pins source pages when ``send``/``finish`` hands them over and unpins each
run once ZMQ released its zero-copy reference (``MessageTracker``) or the decode acked
every byte, once its copy into a same-host decode's shared pool returned
(``shm.ShmChannel``), or once the peer is gone;
the worker alone frees rows (reason from the final ``Event``).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import zmq

from . import handshake, shm, tp
from .channel import BlockRun, DataChannel, PoolView, ZmqChannel, is_unreachable
from .config import TransportConfig
from .endpoint import Endpoint, unexpected_frames
from .events import Event, EventKind, Peer
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
    Message,
    ProtocolError,
    decode,
    encode,
    pages_from_bytes,
)
from .outgoing import Leg, Outgoing, OutState, SendPin
from .sockets import RouterSocket

logger = logging.getLogger(__name__)


class KvSender(Endpoint):
    """Prefill endpoint.

    Args:
        cache: this rank's ``KvCache`` (``layout.num_kv_heads`` = heads of this rank).
        address: where to bind (``tcp://host:port``, ``tcp://host:*``, ``ipc://path``).
        config: identity, TP rank/size, deadlines and lease.
        ctx: ZMQ context to use; one is created (and terminated on ``close``) if omitted.
    """

    def __init__(self, cache, address: str, config: TransportConfig,
                 ctx: zmq.Context | None = None):
        super().__init__(config)
        self.cache = cache
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self.router = RouterSocket(self._ctx, address)
        self.address = self.router.address_bound
        self.pool = PoolView(cache.data())
        self.channel: DataChannel = ZmqChannel(self.router, self.pool, config.max_frame_bytes,
                                               self.stats)
        self.shm: dict[bytes, shm.ShmChannel] = {}   # decode peers whose pool is mapped
        self._last_sent: dict[bytes, float] = {}     # peer -> monotonic time of our last send
        self.hello = handshake.make_hello(config, cache.layout, cache.page_size, "prefill")
        self.transfers: dict[str, Outgoing] = {}

    # -- worker API ----------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.0) -> list[Event]:
        """Handle what arrived (waiting up to ``timeout_s`` for the first message), send
        heartbeats, check leases and deadlines, release finished pins.

        Returns:
            events since the last call, oldest first.
        """
        self._drain(int(timeout_s * 1000))
        now = time.monotonic()
        self._tick_peers(now)
        for out in list(self.transfers.values()):
            self._check_deadlines(out, now)
            self._release_pins(out)
        return self._take_events()

    def send(self, rid: str, kv, upto: int) -> bool:
        """Hand positions ``[0, upto)`` of ``kv``'s row to the transport (full pages only;
        a partial last page waits for ``finish``). Pins them; sends once accepted.

        Returns:
            False (nothing pinned) when ``rid`` was aborted or failed; its final event is
            or will be in ``poll``'s answer, and the worker frees the row then.
        """
        self._drain(0)  # a decode's Abort must be seen before writing into its pool
        out = self._outgoing_for_send(rid, kv)
        if out is None:
            return False
        self._hand_over(out, upto // self.cache.page_size)
        self._flush(out)
        return True

    def finish(self, rid: str, kv, first_token: int) -> bool:
        """Hand over the whole prompt (``kv.allocated_len`` >= prompt length) and send
        ``Done`` with ``first_token`` once every block is queued. Returns as ``send``."""
        self._drain(0)
        out = self._outgoing_for_send(rid, kv)
        if out is None:
            return False
        out.finished, out.first_token = True, int(first_token)
        if out.state == OutState.ASSEMBLING:
            # the prompt length arrives with the Announce; hand over what the row holds
            self._hand_over(out, -(-kv.allocated_len // self.cache.page_size))
        else:
            self._hand_over(out, out.total_blocks)
        self._flush(out)
        return True

    def abort(self, rid: str, reason: str = "aborted", detail: str = "") -> bool:
        """Abort ``rid`` towards every decode rank; pins stay until each acknowledges or
        is lost. Returns False when ``rid`` is unknown or already final here."""
        out = self.transfers.get(rid)
        if out is None or out.state.is_final:
            return False
        self._start_abort(out, reason, detail, notify_peers=True)
        out.state = OutState.CLOSED
        return True

    @property
    def num_pins(self) -> int:
        return sum(len(o.pins) for o in self.transfers.values())

    def close(self) -> None:
        """Say Bye to every peer, drop all pins, close the socket (``linger=0``)."""
        for peer in self.peers.values():
            if not peer.lost:
                self._send(peer.key, Bye(reason="closing"))
        for out in self.transfers.values():
            for pin in out.pins:
                self.cache.unpin(pin.pin_id)
        self.transfers.clear()
        for channel in self.shm.values():
            channel.close()
        self.shm.clear()
        self.router.close()
        if self._own_ctx:
            self._ctx.term()

    # -- incoming ------------------------------------------------------------------------
    def _drain(self, timeout_ms: int) -> None:
        item = self.router.recv(timeout_ms)
        while item is not None:
            self._dispatch(*item)
            item = self.router.recv(0)

    def _dispatch(self, key: bytes, frames: list) -> None:
        self.stats["msgs_recv"] += 1
        self._touch(key)
        try:
            msg = decode(frames[0].bytes if frames else b"")
            if len(frames) > 1:
                raise unexpected_frames(msg, len(frames) - 1)
            if isinstance(msg, Hello):
                self._on_hello(key, msg)
            elif key not in self.peers or self.peers[key].lost:
                raise ProtocolError(ErrorCode.NOT_HANDSHAKEN,
                                    f"{type(msg).__name__} before a successful Hello")
            else:
                self._on_message(self.peers[key], msg)
        except ProtocolError as exc:
            self._protocol_error(key, exc)

    def _on_hello(self, key: bytes, hello: Hello) -> None:
        try:
            handshake.check(self.hello, hello)
        except handshake.HandshakeError as exc:
            self._send(key, self.hello)
            self.stats["errors.handshake"] += 1
            logger.error("%s: %s", self.config.node, exc)
            self._emit(EventKind.HANDSHAKE_FAILED, detail=str(exc), peer=hello.node)
            return
        self._drop_shm(key)  # a reconnect under the same routing id maps afresh
        channel = self._map_shm(hello)
        if channel is not None:
            self.shm[key] = channel
        self._send(key, dataclasses.replace(self.hello, shm_pool=channel and hello.shm_pool
                                            or ""))
        now = time.monotonic()
        self.peers[key] = Peer(key, hello, last_seen=now, next_heartbeat=now)
        logger.info("%s: peer %s connected (data path %s)", self.config.node,
                    self.peers[key].name, "shm" if channel else "zmq")

    def _map_shm(self, hello: Hello) -> shm.ShmChannel | None:
        """The shared-memory channel to a decode that offers its pool on this host."""
        h = self.hello
        if not (self.config.shared_memory and hello.shm_pool and h.host_id
                and hello.host_id == h.host_id):
            return None
        mapped = shm.attach(hello)
        if mapped is None:
            return None
        heads = tp.overlap(h.total_kv_heads, h.tp_size, h.tp_rank, hello.tp_size,
                           hello.tp_rank)
        dst = tp.local_slice(heads, h.total_kv_heads, hello.tp_size, hello.tp_rank) \
            if heads else slice(0, 0)
        return shm.ShmChannel(self.router, self.pool, mapped, dst, self.stats)

    def _drop_shm(self, key: bytes) -> None:
        channel = self.shm.pop(key, None)
        if channel is not None:
            channel.close()

    def _on_message(self, peer: Peer, msg: Message) -> None:
        if isinstance(msg, Announce):
            self._on_announce(peer, msg)
        elif isinstance(msg, Ack):
            self._on_ack(peer, msg)
        elif isinstance(msg, Abort):
            self._on_abort(peer, msg)
        elif isinstance(msg, AbortAck):
            leg = self._leg(peer, msg.rid)
            if leg is not None:
                leg.abort_acked = True
        elif isinstance(msg, Bye):
            self._lose(peer, f"said Bye ({msg.reason})", clean=True)
        elif isinstance(msg, Error):
            self._on_error(peer, msg)
        elif not isinstance(msg, Heartbeat):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{type(msg).__name__} is not sent "
                                "to a prefill endpoint", getattr(msg, "rid", None))

    def _on_announce(self, peer: Peer, msg: Announce) -> None:
        out = self.transfers.get(msg.rid)
        if msg.rid in self._recent or (out is not None and out.state.is_final):
            raise ProtocolError(ErrorCode.DUPLICATE_RID, f"{msg.rid!r} is closing", msg.rid)
        if out is not None and peer.key in out.legs:
            raise ProtocolError(ErrorCode.DUPLICATE_RID, f"{msg.rid!r} announced twice",
                                msg.rid)
        leg = self._validated_leg(peer, msg, out)
        out = out or self.transfers.setdefault(msg.rid, Outgoing(msg.rid))
        if not out.legs:
            self._set_shape(out, peer, msg)
        out.legs[peer.key] = leg
        peer.rids.add(msg.rid)
        if len(out.legs) == out.expected_legs:
            self._accept(out)

    def _validated_leg(self, peer: Peer, msg: Announce, out: Outgoing | None) -> Leg:
        h = self.hello
        ps = h.page_size
        dest = pages_from_bytes(msg.dest_pages, "Announce.dest_pages")
        total = -(-msg.prompt_len // ps)
        if msg.prompt_len < 1 or len(dest) != total:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"prompt_len={msg.prompt_len} needs "
                                f"{total} dest pages, got {len(dest)}", msg.rid)
        if msg.cached_tokens % ps or not 0 <= msg.cached_tokens <= msg.prompt_len:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"cached_tokens={msg.cached_tokens} "
                                f"must be page-aligned and <= prompt_len", msg.rid)
        if out is not None and out.legs and (out.prompt_len, out.cached_blocks * ps) != (
                msg.prompt_len, msg.cached_tokens):
            raise ProtocolError(ErrorCode.BAD_FIELD, "decode ranks disagree on prompt_len "
                                "or cached_tokens", msg.rid)
        heads = tp.overlap(h.total_kv_heads, h.tp_size, h.tp_rank, peer.hello.tp_size,
                           peer.hello.tp_rank)
        if heads is None:
            raise ProtocolError(ErrorCode.BAD_RANGE, f"decode rank {peer.hello.tp_rank} "
                                f"shares no KV heads with prefill rank {h.tp_rank}", msg.rid)
        return Leg(peer.key, heads, dest)

    def _set_shape(self, out: Outgoing, peer: Peer, msg: Announce) -> None:
        h, ps = self.hello, self.hello.page_size
        out.prompt_len = msg.prompt_len
        out.cached_blocks = msg.cached_tokens // ps
        out.total_blocks = -(-msg.prompt_len // ps)
        out.expected_legs = len(tp.peer_ranks(h.total_kv_heads, h.tp_size, h.tp_rank,
                                              peer.hello.tp_size))
        out.t_start = time.monotonic()

    def _accept(self, out: Outgoing) -> None:
        if out.kv is not None and out.handed > out.total_blocks:
            self._fail(out, "error", f"row holds {out.handed} pages, prompt needs "
                       f"{out.total_blocks}")
            return
        out.state = OutState.STREAMING
        out.t_progress = time.monotonic()
        for leg in out.legs.values():
            self._send(leg.peer, Accepted(rid=out.rid))
        self._emit(EventKind.READY, out.rid, prompt_len=out.prompt_len,
                   cached_tokens=out.cached_blocks * self.hello.page_size)
        if out.finished:
            self._hand_over(out, out.total_blocks)
        self._flush(out)

    def _on_ack(self, peer: Peer, msg: Ack) -> None:
        leg = self._leg(peer, msg.rid)
        if leg is None:
            return
        leg.acked = True
        out = self.transfers[msg.rid]
        if out.state == OutState.DONE_SENT and all(g.acked for g in out.legs.values()):
            out.state = OutState.CLOSED
            self._emit(EventKind.COMPLETED, out.rid, reason="sent",
                       first_token=out.first_token, prompt_len=out.prompt_len,
                       cached_tokens=out.cached_blocks * self.hello.page_size)

    def _on_abort(self, peer: Peer, msg: Abort) -> None:
        self._send(peer.key, AbortAck(rid=msg.rid))
        out = self.transfers.get(msg.rid)
        if out is None or peer.key not in out.legs:
            self.stats["aborts_unknown_rid"] += 1
            return
        self.stats["aborts_recv"] += 1
        out.legs[peer.key].abort_acked = True
        if not out.state.is_final:
            self._start_abort(out, msg.reason, msg.detail, notify_peers=True)
            self._close(out, EventKind.ABORTED, msg.reason or "aborted", msg.detail)

    def _on_error(self, peer: Peer, msg: Error) -> None:
        self.stats["errors_recv"] += 1
        logger.warning("%s: peer %s reports %s: %s", self.config.node, peer.name, msg.code,
                       msg.detail)
        out = self.transfers.get(msg.rid)
        if out is not None and peer.key in out.legs and not out.state.is_final:
            self._fail(out, "error", f"peer error {msg.code}: {msg.detail}")

    def _leg(self, peer: Peer, rid: str) -> Leg | None:
        """The leg of an (Abort)Ack; None (counted as late) when rid is already gone, as
        happens when an Ack crosses an Abort."""
        out = self.transfers.get(rid)
        if out is None or peer.key not in out.legs:
            self.stats["late_msgs"] += 1
            return None
        return out.legs[peer.key]

    # -- outgoing ------------------------------------------------------------------------
    def _outgoing_for_send(self, rid: str, kv) -> Outgoing | None:
        out = self.transfers.get(rid)
        if out is None and rid not in self._recent:
            out = self.transfers[rid] = Outgoing(rid)
        if out is None or out.state.is_final:
            self.stats["sends_after_final"] += 1
            return None
        out.kv = kv
        out.t_progress = time.monotonic()
        return out

    def _hand_over(self, out: Outgoing, end_block: int) -> None:
        """Pin blocks ``[handed, end_block)`` of the row: they now belong to the transport."""
        start = out.handed
        if end_block <= start:
            return
        ps = self.cache.page_size
        end_pos = min(end_block * ps, out.kv.allocated_len)
        pages = np.asarray(self.cache.pages(out.kv, start * ps, end_pos), np.int64)
        if len(pages) != end_block - start:
            raise ValueError(f"{out.rid}: row holds {out.kv.allocated_len} positions, "
                             f"cannot hand over blocks [{start}, {end_block})")
        pin_id = self.cache.pin_pages(pages, reason="send")
        out.pins.append(SendPin(pin_id, start, end_block))
        out.src_pages = np.concatenate([out.src_pages, pages])

    def _flush(self, out: Outgoing) -> None:
        """Frame and queue every handed block not sent yet, then Done when complete."""
        if out.state != OutState.STREAMING:
            return
        first, end = max(out.sent, out.cached_blocks), min(out.handed, out.total_blocks)
        for leg in out.legs.values():
            if first < end and not self._send_blocks(out, leg, first, end):
                return
        out.sent = max(out.sent, end)
        for pin in out.pins:
            pin.flushed = pin.flushed or pin.end <= max(out.sent, out.cached_blocks)
        if out.finished and out.sent >= out.total_blocks:
            for leg in out.legs.values():
                self._send(leg.peer, Done(rid=out.rid, num_blocks=out.total_blocks
                                          - out.cached_blocks, first_token=out.first_token))
            out.state = OutState.DONE_SENT
            out.t_progress = time.monotonic()

    def _send_blocks(self, out: Outgoing, leg: Leg, first: int, end: int) -> bool:
        """Move blocks ``[first, end)`` to ``leg``, one channel call per pin, so that each
        completion is attached to the one pin whose pages it reads."""
        h = self.hello
        heads = tp.local_slice(leg.heads, h.total_kv_heads, h.tp_size, h.tp_rank)
        channel = self._channel_for(leg.peer)
        for pin in out.pins:
            lo, hi = max(first, pin.first), min(end, pin.end)
            if lo >= hi:
                continue
            run = BlockRun(leg.peer, out.rid, lo, out.src_pages[lo:hi], leg.dest_pages[lo:hi],
                           leg.heads, heads)
            try:
                done = channel.send_blocks(run)
            except zmq.ZMQError as exc:
                if not is_unreachable(exc):
                    raise
                self._lose(self.peers[leg.peer], "unreachable while sending")
                return False
            self._last_sent[leg.peer] = time.monotonic()
            pin.completions.extend((leg.peer, d) for d in done)
        return True

    def _channel_for(self, key: bytes) -> DataChannel:
        """Shared memory only while the decode cannot have declared us lost: our last
        message to it is younger than half our lease (its clock starts no earlier)."""
        channel = self.shm.get(key)
        if channel is None:
            return self.channel
        if time.monotonic() - self._last_sent.get(key, 0.0) > self.config.lease_s / 2:
            self.stats["shm_fallbacks"] += 1
            return self.channel
        return channel

    def _send(self, key: bytes, msg: Message) -> bool:
        try:
            self.router.send(key, [encode(msg)])
        except zmq.ZMQError as exc:
            if not is_unreachable(exc):
                raise
            return False
        self._last_sent[key] = time.monotonic()
        self.stats["msgs_sent"] += 1
        return True

    # -- ending ------------------------------------------------------------------------
    def _start_abort(self, out: Outgoing, reason: str, detail: str,
                     notify_peers: bool) -> None:
        self.stats["aborts_sent"] += notify_peers
        for leg in out.legs.values():
            peer = self.peers.get(leg.peer)
            if peer is None or peer.lost:
                leg.abort_acked = True
            elif notify_peers and not leg.abort_acked:
                self._send(leg.peer, Abort(rid=out.rid, reason=reason, detail=detail))
        out.t_progress = time.monotonic()

    def _close(self, out: Outgoing, kind: EventKind, reason: str, detail: str) -> None:
        out.state = OutState.CLOSED
        self._emit(kind, out.rid, reason=reason, detail=detail)

    def _fail(self, out: Outgoing, reason: str, detail: str) -> None:
        logger.warning("%s: %s failed (%s): %s", self.config.node, out.rid, reason, detail)
        self._start_abort(out, reason, detail, notify_peers=True)
        self._close(out, EventKind.FAILED, reason, detail)

    def _check_deadlines(self, out: Outgoing, now: float) -> None:
        cfg = self.config
        if out.state == OutState.ASSEMBLING and now - out.t_start > cfg.admission_timeout_s:
            self.stats["timeouts.admission"] += 1
            self._fail(out, "timeout", f"not every decode rank announced within "
                       f"{cfg.admission_timeout_s}s")
        elif out.state in (OutState.STREAMING, OutState.DONE_SENT) and (
                now - out.t_progress > cfg.chunk_timeout_s
                or now - out.t_start > cfg.done_timeout_s):
            self.stats["timeouts.progress"] += 1
            self._fail(out, "timeout", f"no progress on {out.state.name} for "
                       f"{now - out.t_progress:.1f}s")
        elif out.state == OutState.CLOSED and not out.abort_settled and (
                now - out.t_progress > cfg.chunk_timeout_s):
            self.stats["timeouts.abort_ack"] += 1
            for leg in out.legs.values():
                leg.abort_acked = True

    def _release_pins(self, out: Outgoing) -> None:
        """Unpin runs that no live peer can still read; drop finished transfers.

        A leg's completions are settled by its tracker, by its Ack (the decode holds every
        byte, so ZMQ will not read the pages again; the tracker of a connection's last
        frame can lag until the next message leaves) or by the peer's loss. So pins drop
        in the very poll that reports COMPLETED, and the worker's row free is immediate.
        """
        settled = {k for k, p in self.peers.items() if p.lost}
        settled.update(k for k, g in out.legs.items() if g.acked)
        aborting = out.state == OutState.CLOSED and out.legs and not all(
            g.acked for g in out.legs.values())
        keep = []
        for pin in out.pins:
            busy = any(not done.done for key, done in pin.completions if key not in settled)
            unsent = not pin.flushed and not out.state.is_final
            if busy or unsent or (aborting and not out.abort_settled):
                keep.append(pin)
            else:
                self.cache.unpin(pin.pin_id)
        out.pins = keep
        if out.state == OutState.CLOSED and not keep:
            del self.transfers[out.rid]
            self._remember_closed(out.rid)

    def _on_peer_lost(self, peer: Peer, why: str) -> None:
        for rid in sorted(peer.rids):
            out = self.transfers.get(rid)
            if out is None or peer.key not in out.legs:
                continue
            out.legs[peer.key].abort_acked = True
            if not out.state.is_final:
                self._fail(out, "peer_lost", f"decode {peer.name} lost: {why}")
        peer.rids.clear()
        self._drop_shm(peer.key)
