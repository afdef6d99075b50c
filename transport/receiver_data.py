"""The decode endpoint's data path: land a ``KvChunk``'s data frame in the pool, and check
what a one-sided write (shared memory, NIXL) left in it - each after checking the message
against the request and leg it belongs to.

The frame was received into ZMQ's buffer; its digest is checked there, before a byte lands,
then it is copied once into the destination pages (one slice per run of consecutive pages
when it carries all of this rank's heads, else a head slice per run). A one-sided write is
already in the pages: the digest is computed over them (on a device pool as a reduction on
the device, read later: ``Pending``). Only pages of the request's own registration, pinned
since, are written; the pin is dropped by ``KvReceiver``, never here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import zmq

from common.kv import digest_of_bytes, digest_of_pages, digest_value

from .incoming import Incoming, InLeg
from .messages import ErrorCode, KvChunk, KvWritten, ProtocolError
from .pool_view import PoolView


def land_chunk(pool: PoolView, inc: Incoming, leg: InLeg, heads: slice, msg: KvChunk,
               data: list[zmq.Frame]) -> tuple[int, int, int | None]:
    """Check the chunk's frame (size, digest), then write it into its destination pages;
    returns its bytes, the number of page runs the copy took and the frame's digest.

    Args:
        heads: where the leg's global heads lie in this rank's head axis.
    Raises:
        ProtocolError: no frame, several, one whose size differs from its blocks', or
            (``corrupt``) one whose digest differs from the header's - before any byte
            is written.
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
    digest = None
    if leg.digest:
        frame = np.frombuffer(data[0].buffer, dtype=np.uint8).reshape(msg.num_blocks, -1)
        digest = digest_of_bytes(leg.digest, frame)
        check(msg, digest, inc)
    dest = inc.dest_pages[msg.first_block:msg.first_block + msg.num_blocks]
    return want, pool.write(dest, heads, data[0].buffer), digest


def check(msg: KvChunk | KvWritten, digest: int, inc: Incoming) -> None:
    """Raise ``corrupt`` when the digest of what landed is not the one ``msg`` claims."""
    if msg.digest is None:
        raise ProtocolError(ErrorCode.CORRUPT, f"blocks [{msg.first_block}, "
                            f"{msg.first_block + msg.num_blocks}) came without a digest on "
                            "a leg with integrity on", msg.rid)
    if digest != msg.digest:
        pages = inc.dest_pages[msg.first_block:msg.first_block + msg.num_blocks]
        raise ProtocolError(ErrorCode.CORRUPT, f"digest of blocks [{msg.first_block}, "
                            f"{msg.first_block + msg.num_blocks}) (pages "
                            f"{_short(pages)}) is {digest:#018x}, sent {msg.digest:#018x}",
                            msg.rid)


@dataclass
class Pending:
    """A one-sided write's digest still being computed on the device: checked (and its
    blocks counted) once ``ready``; ``entry`` is its free-log entry."""

    peer: bytes
    msg: KvWritten
    value: torch.Tensor
    event: object
    entry: list

    @property
    def ready(self) -> bool:
        return self.event is None or self.event.query()


def written_digest(data: torch.Tensor, inc: Incoming, heads: slice, msg: KvWritten,
                   algo: str):
    """The digest of the pages a one-sided write filled: an int, or on a device pool
    ``(fold tensor, event)`` to read once the event completed (nothing waits now)."""
    pages = inc.dest_pages[msg.first_block:msg.first_block + msg.num_blocks]
    value = digest_of_pages(algo, data, pages, heads)
    if not isinstance(value, torch.Tensor):
        return value
    if value.device.type != "cuda":
        return digest_value(value)
    event = torch.cuda.Event()
    event.record()
    return value, event


def _short(pages: np.ndarray) -> str:
    listed = ", ".join(str(int(p)) for p in pages[:8])
    return f"[{listed}{', ...' if len(pages) > 8 else ''}]"
