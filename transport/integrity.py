"""What a transfer proves about the bytes it moves: page epochs on the wire, the digest
each leg uses, and the free-log records of both.

Epochs: every destination page id travels with the epoch of the decode's allocation that
owns it (``common.kv`` stamps one per ``allocate``). On the wire a page list's epochs are
run-length pairs ``(epoch, count)`` of little-endian uint64 (a row allocated in one
``extend`` is one pair, however long). A data message repeats the epochs of the pages
it fills; the decode compares them with its registration and with its allocator's
current owner and epoch of each page before anything lands (``KvCache.check_held``).

Digests (``common.kv.digest``): frames and shared memory are host bytes on both ends, so
their legs use xxh3; a NIXL leg uses what both ends' ``Hello.kv_digest`` negotiate (fold64
between two device pools). Either end with integrity off (``kv_digest=""``) turns it off
for the leg.

Records (docs/freelog.md): the prefill's ``unpin`` of a send pin and the decode's
``unpin`` of a receive pin carry ``xfer``: for each leg, the request, the peer, and per
data message ``[first_block, num_blocks, head_start, head_end, epoch, digest]`` (the
decode adds the digest the message claimed); ``pdkv replay`` given both logs checks that
every digest received equals the one sent.
"""

from __future__ import annotations

import numpy as np

from common.kv import negotiate_digest

from .messages import ErrorCode, ProtocolError

XXH3 = "xxh3_64"
_PAIR = np.dtype([("epoch", "<u8"), ("count", "<u8")])


def pack_epochs(epochs: np.ndarray) -> bytes:
    """Epochs of a page list as run-length ``(epoch, count)`` uint64 pairs."""
    epochs = np.asarray(epochs, dtype=np.uint64)
    if not len(epochs):
        return b""
    cuts = np.flatnonzero(epochs[1:] != epochs[:-1]) + 1
    starts = np.concatenate([[0], cuts])
    counts = np.diff(np.concatenate([starts, [len(epochs)]]))
    pairs = np.empty(len(starts), dtype=_PAIR)
    pairs["epoch"], pairs["count"] = epochs[starts], counts
    return pairs.tobytes()


def unpack_epochs(data: bytes, num_pages: int, rid: str) -> np.ndarray:
    """Inverse of ``pack_epochs`` for a list of ``num_pages`` pages.

    Raises:
        ProtocolError: ragged bytes, or counts that do not cover exactly the pages.
    """
    if len(data) % _PAIR.itemsize:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"epochs: {len(data)} bytes is not "
                            "(epoch, count) pairs", rid)
    pairs = np.frombuffer(data, dtype=_PAIR)
    counts = pairs["count"]
    if int(counts.sum(dtype=np.uint64)) != num_pages or (len(counts) and counts.min() < 1):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"epochs cover {int(counts.sum())} "
                            f"pages, expected {num_pages}", rid)
    return np.repeat(pairs["epoch"], counts.astype(np.int64))


def leg_digest(path: str, mine: str, theirs: str) -> str:
    """The digest algorithm of a leg on data path ``path`` ("" when integrity is off)."""
    algo = negotiate_digest(mine, theirs)
    return algo if path == "nixl" or not algo else XXH3


def run_entry(first_block: int, num_blocks: int, heads: tuple[int, int], epoch: int,
              digest: int | None, *claimed: int | None) -> list:
    """One data message in a free-log ``xfer`` record (the decode adds the claimed digest)."""
    return [int(first_block), int(num_blocks), int(heads[0]), int(heads[1]), int(epoch),
            digest, *claimed]


def xfer_record(rid: str, direction: str, peer: str, runs: list, **extra) -> dict:
    """One leg's part of an ``unpin`` event's ``xfer`` list."""
    return {"rid": rid, "dir": direction, "peer": peer, "runs": runs, **extra}
