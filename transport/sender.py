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

The class is layered: ``sender_link.SenderLink`` (socket, handshake, data path per peer)
< ``sender_control.SenderControl`` (decode's control messages, endings) < ``KvSender``
(worker API, handing over, streaming, pin release).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import zmq

from . import tp
from .channel import BlockRun, is_unreachable
from .config import TransportConfig
from .events import Event
from .messages import Done
from .outgoing import Leg, Outgoing, OutState, SendPin
from .sender_control import SenderControl

logger = logging.getLogger(__name__)


class KvSender(SenderControl):
    """Prefill endpoint.

    Args:
        cache: this rank's ``KvCache`` (``layout.num_kv_heads`` = heads of this rank).
        address: where to bind (``tcp://host:port``, ``tcp://host:*``, ``ipc://path``).
        config: identity, TP rank/size, deadlines and lease.
        ctx: ZMQ context to use; one is created (and terminated on ``close``) if omitted.
    """

    def __init__(self, cache, address: str, config: TransportConfig,
                 ctx: zmq.Context | None = None):
        super().__init__(cache, address, config, ctx)
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
        self._say_bye()
        for out in self.transfers.values():
            for pin in out.pins:
                self.cache.unpin(pin.pin_id)
        self.transfers.clear()
        self._close_link()

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
