"""``SenderControl``: what decode peers say about a prefill request (Announce, Ack,
Abort, Error) and how a request ends (abort, failure, deadlines, a lost peer).

Pins nothing itself: ``_accept`` asks ``KvSender._hand_over`` to pin a finished prompt's
blocks, and a request that ends here keeps its pins until ``KvSender._release_pins`` sees
every leg settled (acked, abort-acked or lost).
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod

from . import tp
from .events import EventKind, Peer
from .messages import (
    Abort,
    AbortAck,
    Accepted,
    Ack,
    Announce,
    Bye,
    Error,
    ErrorCode,
    Heartbeat,
    Message,
    ProtocolError,
    pages_from_bytes,
)
from .outgoing import Leg, Outgoing, OutState
from .sender_link import SenderLink

logger = logging.getLogger(__name__)


class SenderControl(SenderLink):
    """Per-request control messages and endings of the prefill endpoint."""

    transfers: dict[str, Outgoing]

    @abstractmethod
    def _hand_over(self, out: Outgoing, end_block: int) -> None:
        """Pin blocks ``[handed, end_block)`` of ``out``'s row."""

    @abstractmethod
    def _flush(self, out: Outgoing) -> None:
        """Send every handed block not sent yet, then Done when complete."""

    # -- messages from decode peers ----------------------------------------------------
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
        self._peer_error(peer, msg)
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
            self._stop_waiting_for_abort_acks(out)

    def _on_peer_lost(self, peer: Peer, why: str) -> None:
        for rid in self._legs_lost_with(peer):
            out = self.transfers[rid]
            if not out.state.is_final:
                self._fail(out, "peer_lost", f"decode {peer.name} lost: {why}")
        self._drop_shm(peer.key)
