"""``Streamer``: the prefill's send path - pin what the worker hands over, stream it to
every leg through that leg's data channel (the last message of each leg carries the first
token: its completion), unpin what nobody reads with the free-log record of what went out.

A member of ``KvSender``; it returns what went wrong (an unreachable peer) as a value.
"""

from __future__ import annotations

from collections.abc import Container

import numpy as np
import zmq

from . import tp
from .channel import BlockRun
from .integrity import xfer_record
from .link import is_unreachable
from .outgoing import Leg, Outgoing, OutState, SendPin
from .sender_link import SenderLink


class Streamer:
    """Moves handed-over blocks of ``Outgoing`` requests out of ``cache``'s pool."""

    def __init__(self, cache, link: SenderLink):
        self.cache, self.link = cache, link

    def hand_over(self, out: Outgoing, end_block: int) -> None:
        """Pin blocks ``[handed, end_block)`` of the row: they now belong to the transport.

        Raises:
            ValueError: the row does not hold those blocks.
        """
        start = out.handed
        if end_block <= start:
            return
        ps = self.cache.page_size
        end_pos = min(end_block * ps, out.kv.allocated_len)
        pages = np.asarray(self.cache.pages(out.kv, start * ps, end_pos), np.int64)
        if len(pages) != end_block - start:
            raise ValueError(f"{out.rid}: row holds {out.kv.allocated_len} positions, "
                             f"cannot hand over blocks [{start}, {end_block})")
        out.hand_over(self.cache.pin_pages(pages, reason="send"), pages)

    def flush(self, out: Outgoing) -> bytes | None:
        """Frame and queue every handed block not sent yet; the prompt's last block (once
        ``finish`` handed it) goes with the first token, and the request drains.

        Returns:
            the key of a peer found unreachable (nothing more was sent), else None.
        """
        if out.state != OutState.STREAMING:
            return None
        first, end = out.unsent()
        final = out.finished and end >= out.total_blocks
        for leg in out.legs.values():
            if first < end and (gone := self._send_blocks(out, leg, first, end, final)):
                return gone
        out.mark_sent(end)
        return None

    def _send_blocks(self, out: Outgoing, leg: Leg, first: int, end: int,
                     final: bool) -> bytes | None:
        """Move blocks ``[first, end)`` to ``leg``, one channel call per pin, so that each
        completion is attached to the one pin whose pages it reads."""
        h = self.link.hello
        heads = tp.local_slice(leg.heads, h.total_kv_heads, h.tp_size, h.tp_rank)
        channel = self.link.channel_for(leg.peer)
        for pin in out.pins:
            lo, hi = max(first, pin.first), min(end, pin.end)
            if lo >= hi:
                continue
            run = BlockRun(leg.peer, out.rid, lo, out.src_pages[lo:hi], leg.dest_pages[lo:hi],
                           leg.heads, heads, leg.dest_epochs[lo:hi], leg.digest,
                           out.first_token if final and hi == end else None)
            try:
                posted = channel.send_blocks(run)
            except zmq.ZMQError as exc:
                if not is_unreachable(exc):
                    raise
                return leg.peer
            self.link.sent_data(leg.peer)
            pin.completions.extend((leg.peer, d) for d in posted.completions)
            pin.entries.setdefault(leg.peer, []).extend(posted.entries)
        return None

    def release(self, out: Outgoing, lost: Container[bytes]) -> None:
        """Unpin the runs of ``out`` that no live peer can still read; each unpin records
        what its pages sent (the digests replay compares with the decode's)."""
        for pin in out.releasable_pins(lost):
            self.cache.unpin(pin.pin_id, self._record(out, pin))

    def _record(self, out: Outgoing, pin: SendPin) -> dict | None:
        if not pin.entries or self.cache.free_log is None:
            return None
        return {"xfer": [xfer_record(out.rid, "sent", out.legs[key].name, runs)
                         for key, runs in pin.entries.items() if key in out.legs]}

    def unpin_all(self, out: Outgoing) -> None:
        """Closing: the socket goes away, so nothing reads the pages any more."""
        for pin in out.pins:
            self.cache.unpin(pin.pin_id)
        out.pins = []
