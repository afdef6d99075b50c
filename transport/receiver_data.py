"""``ReceiverData``: the decode endpoint's two ways pages arrive, checked against the
request and leg they belong to.

- frame path: a ``KvChunk`` header and its data frame, received straight into the
  destination pages when they are consecutive and carry all of this rank's heads
  (``recv_into``, one copy), otherwise scattered by ``PoolView.write``;
- shared-memory path: ``KvWritten``, sent after a same-host prefill copied the blocks into
  our shared pool itself (no frame).

Both write only into destination pages that ``KvReceiver.announce`` pinned; the pin is
dropped by ``KvReceiver._maybe_release``, never here.
"""

from __future__ import annotations

import time

import numpy as np

from . import tp
from .events import Peer
from .incoming import Incoming, InLeg, InState
from .messages import ErrorCode, KvChunk, KvWritten, ProtocolError
from .peers import unexpected_frames
from .receiver_link import ReceiverLink
from .sockets import DealerSocket


class ReceiverData(ReceiverLink):
    """Check a chunk's rid, blocks and heads, write its pages, count them on the leg."""

    transfers: dict[str, Incoming]

    def _incoming(self, peer: Peer, rid: str) -> Incoming | None:
        """The request ``rid`` that ``peer`` serves; None for a recently closed rid."""
        inc = self.transfers.get(rid)
        if inc is not None and peer.key in inc.legs and inc.state != InState.CLOSED:
            return inc
        if rid in self._recent or (inc is not None and peer.key in inc.legs):
            self.stats["late_msgs"] += 1
            return None
        raise ProtocolError(ErrorCode.UNKNOWN_RID, f"unknown rid {rid!r}", None)

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
