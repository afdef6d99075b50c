"""The decode endpoint's frame data path: land a ``KvChunk``'s data frame in the pool,
after checking it against the request and leg it belongs to.

The frame was received into ZMQ's buffer and is copied once, into the destination pages
(one slice per run of consecutive pages when it carries all of this rank's heads, else a
head slice per run). Only pages of the request's own announce, pinned since, are written;
the pin is dropped by ``KvReceiver``, never here. The shared-memory path has no frame: a
same-host prefill copies the pages itself and sends ``KvWritten``.
"""

from __future__ import annotations

import zmq

from .incoming import Incoming, InLeg
from .messages import ErrorCode, KvChunk, ProtocolError
from .pool_view import PoolView


def land_chunk(pool: PoolView, inc: Incoming, leg: InLeg, heads: slice, msg: KvChunk,
               data: list[zmq.Frame]) -> tuple[int, int]:
    """Write the chunk's frame into its destination pages; returns its bytes and the
    number of page runs the copy took.

    Args:
        heads: where the leg's global heads lie in this rank's head axis.
    Raises:
        ProtocolError: no frame, several, or one whose size differs from its blocks' -
            before any byte is written.
    """
    if not data:
        raise ProtocolError(ErrorCode.TRUNCATED, "KvChunk without its data frame", msg.rid)
    if len(data) > 1:
        raise ProtocolError(ErrorCode.EXTRA_FRAMES, f"KvChunk followed by {len(data)} "
                            "frames, not one", msg.rid)
    want = msg.num_blocks * pool.block_bytes(heads.stop - heads.start)
    got = len(data[0].buffer)
    if msg.nbytes != want or got != want:
        code = ErrorCode.OVERSIZED if max(got, msg.nbytes) > want else ErrorCode.TRUNCATED
        raise ProtocolError(code, f"data frame of {got} bytes (header says {msg.nbytes}), "
                            f"{msg.num_blocks} blocks need {want}", msg.rid)
    dest = inc.dest_pages[msg.first_block:msg.first_block + msg.num_blocks]
    return want, pool.write(dest, heads, data[0].buffer)
