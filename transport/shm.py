"""Same-host data path: the prefill copies pages straight into the decode's shared pool.

The decode creates its pool with ``KvCache(..., shared_memory=True)`` and offers the
segment in its ``Hello`` (``shm_pool``, ``shm_pages``, ``host_id``). A prefill on the same
host (equal ``host_id``) maps it and answers with the same ``shm_pool``; from then on each
run of blocks is one copy from the prefill's pool into the decode's destination pages,
followed by a ``KvWritten`` control message instead of a data frame.

Why writes never land in pages the decode has reused (docs/protocol.md, "Shared memory"):
- the decode pins destination pages from ``announce`` until every leg sent ``Done`` or
  ``AbortAck`` or was lost; the prefill copies synchronously inside ``send``/``finish``/
  ``poll`` and only while the request is STREAMING, so all its writes precede its
  ``Done``/``AbortAck``/``Abort`` on the same ordered connection;
- the prefill reads its incoming control (a decode ``Abort``) before each write batch;
- the decode declares the prefill lost only after ``lease`` of silence counted from the
  prefill's last message, so the prefill copies only while its own last message to that
  peer is younger than half its lease, and otherwise falls back to ZMQ frames (which a
  decode that lost it drops).
"""

from __future__ import annotations

import logging
import socket
from collections import Counter
from functools import cache

from common.kv import (
    KvLayout,
    RunDigest,
    SegmentError,
    SharedTensor,
    copy_pages,
    copy_pages_fed,
    digest_of_pages,
)

from .channel import BlockRun, DataChannel, Posted
from .integrity import XXH3
from .messages import Hello, KvWritten, encode
from .pool_view import HostPoolView
from .sockets import RouterSocket

logger = logging.getLogger(__name__)


@cache
def host_id() -> str:
    """``<hostname>/<boot_id>``: equal on two processes only if they share a kernel boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # not Linux: no proof, so never claim to share a host
        return ""
    return f"{socket.gethostname()}/{boot}"


def attach(decode: Hello) -> SharedTensor | None:
    """Map the pool a decode ``Hello`` offers; None (logged) when no such segment exists
    here (the decode runs in another ``/dev/shm`` namespace): the leg then uses frames.

    Raises:
        SegmentError: the offer names something that must not be mapped - not a segment
            name, not a pdkv pool of exactly the offered shape, not ours to write, or the
            wrong token (someone else's pool). The handshake is refused.
    """
    if decode.shm_pages < 1:
        raise SegmentError(f"{decode.node} offers pool {decode.shm_pool!r} of "
                           f"{decode.shm_pages} pages")
    heads = decode.total_kv_heads // decode.tp_size
    layout = KvLayout(num_layers=decode.num_layers, num_draft_layers=decode.num_draft_layers,
                      num_kv_heads=heads, head_dim=decode.head_dim, dtype=decode.dtype)
    shape = (decode.shm_pages, *layout.page_shape(decode.page_size))
    try:
        return SharedTensor(shape, layout.torch_dtype, name=decode.shm_pool,
                            token=decode.shm_token)
    except FileNotFoundError:
        logger.warning("cannot map %s's pool %r: not on this host's /dev/shm; using ZMQ "
                       "frames", decode.node, decode.shm_pool)
        return None


class ShmChannel(DataChannel):
    """Prefill side of one shared-memory leg: owns the mapping of one decode rank's pool.

    Args:
        router: the prefill's socket, for the ``KvWritten`` that follows each copy.
        pool: this rank's pool; ``mapped``: the decode's pool (never unlinked here).
        dst_heads: where a leg's global heads lie in the decode rank's head axis.
    """

    name = "shm"

    def __init__(self, router: RouterSocket, pool: HostPoolView, mapped: SharedTensor,
                 dst_heads: slice, stats: Counter, max_piece_bytes: int = 8 << 20):
        self.router, self.pool, self.stats = router, pool, stats
        self.mapped = mapped
        self.dest = HostPoolView(mapped.tensor)
        self.dst_heads = dst_heads
        self.max_piece_bytes = max_piece_bytes

    def send_blocks(self, run: BlockRun) -> Posted:
        """Copy now, piece by piece (at most ``max_piece_bytes`` each, so that the decode
        checks one piece while the next is copied), each followed by its ``KvWritten``;
        the source pages are free to reuse on return."""
        block = self.pool.block_bytes(run.src_heads.stop - run.src_heads.start)
        step = max(1, self.max_piece_bytes // block)
        posted, n = Posted(), len(run.src_pages)
        for start in range(0, n, step):
            end = min(n, start + step)
            digest = self._copy(run, start, end)
            msg = KvWritten(**run.piece(start, end), digest=digest)
            self.router.send(run.peer, [encode(msg)])  # EHOSTUNREACH reaches the caller
            posted.entries.append(run.entry(start, end, digest))
            self.stats["shm_writes"] += 1
            self.stats["sent.KvWritten"] += 1
            self.stats["bytes_sent"] += (end - start) * block
        return posted

    def _copy(self, run: BlockRun, start: int, end: int) -> int | None:
        """Copy blocks ``[start, end)`` of ``run``; the digest of their source bytes."""
        src, dst = run.src_pages[start:end], run.dest_pages[start:end]
        whole = (run.src_heads.stop - run.src_heads.start == self.pool.num_heads
                 == self.dest.num_heads)
        if run.digest == XXH3 and whole:
            # one pass: each chunk of the source is digested while the copy has it in cache
            h = RunDigest()
            copy_pages_fed(self.pool.shaped, src, self.dest.shaped, dst, h.feed)
            return h.value()
        copy_pages(self.pool.shaped, src, self.dest.shaped, dst, src_heads=run.src_heads,
                   dst_heads=self.dst_heads)
        # the source run, just read by the copy: what the decode must find in its pages
        return digest_of_pages(run.digest, self.pool.data, src, run.src_heads) \
            if run.digest else None

    def close(self) -> None:
        """Drop the mapping (the decode owns and unlinks the segment)."""
        self.dest = None
        self.mapped.close()
