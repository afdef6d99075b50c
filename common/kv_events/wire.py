"""vLLM's KV events on the wire: event batches as msgpack, exactly as vLLM encodes them.

vLLM (``vllm/distributed/kv_events.py``) defines its events as msgspec structs that are
``array_like`` and tagged, so a batch is a msgpack array (fields in declaration order)::

    EventBatch          [ts, [event, ...], data_parallel_rank]
    BlockStored         ["BlockStored", block_hashes, parent_block_hash, token_ids,
                         block_size, lora_id, medium]
    BlockRemoved        ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared    ["AllBlocksCleared"]

``ts`` is a float64 (wall-clock seconds), ``data_parallel_rank`` an int (pdkv: 0; one
publisher per worker). Block hashes are unsigned 64-bit ints, as vLLM sends them by
default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the last 8 bytes of the digest read
big-endian): here the last 8 bytes of pdkv's 16-byte hash-chain key (``external_hash``).
``parent_block_hash`` is None for a chain's first block, ``lora_id`` always None,
``token_ids`` the blocks' tokens (``block_size`` per block), ``medium`` ``"GPU"`` or
``"CPU"`` (vLLM's device tier and its CPU offloading tier).

Each batch travels as a ZMQ multipart message ``(topic, seq, payload)``, ``seq`` an
8-byte big-endian counter from 0 (``publisher.py``). ``decode_batch`` reads batches of
either of vLLM's encodings (tagged arrays, or the tagged maps of later vLLM releases),
ignoring fields it does not know, and checks every field before it is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

MEDIUM_GPU = "GPU"
"""The device pool's medium (vLLM's name for it, whatever backs the pool)."""
MEDIUM_CPU = "CPU"
"""The host tier's medium (vLLM's CPU offloading tier)."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end-of-replay marker (an empty payload follows it)."""
MAX_EVENTS_PER_BATCH = 1 << 16
"""Most events a batch may hold when decoded (a sanity bound, not a protocol limit)."""


class EventsFormatError(ValueError):
    """A batch that is not vLLM's KV events format; the message says what is wrong."""


def external_hash(key: bytes) -> int:
    """The block hash a subscriber sees for a pdkv hash-chain key: its last 8 bytes read
    as a big-endian unsigned int (how vLLM turns its digests into ints)."""
    return int.from_bytes(key[-8:], "big")


def seq_bytes(seq: int) -> bytes:
    """A batch's sequence number on the wire: 8 bytes, big-endian."""
    return seq.to_bytes(8, "big")


def seq_of(frame: bytes) -> int:
    """The sequence number of a frame (-1 for ``END_SEQ``)."""
    if len(frame) != 8:
        raise EventsFormatError(f"sequence frame of {len(frame)} bytes; need 8")
    return int.from_bytes(frame, "big", signed=True)


@dataclass(frozen=True)
class BlockStored:
    """Blocks entered a cache: a chain, each block the child of the one before."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None

    def to_wire(self) -> list:
        return ["BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids,
                self.block_size, self.lora_id, self.medium]


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left a cache."""

    block_hashes: list[int]
    medium: str | None = None

    def to_wire(self) -> list:
        return ["BlockRemoved", self.block_hashes, self.medium]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block of the publisher is gone (every medium): a restart, a reset."""

    def to_wire(self) -> list:
        return ["AllBlocksCleared"]


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: list[Event] = field(default_factory=list)
    data_parallel_rank: int | None = 0


def encode_batch(batch: EventBatch) -> bytes:
    """The batch as msgpack, byte for byte what vLLM's msgspec encoder writes."""
    fields = [float(batch.ts), [e.to_wire() for e in batch.events]]
    if batch.data_parallel_rank is not None:  # omit_defaults: None is left off
        fields.append(batch.data_parallel_rank)
    return msgpack.packb(fields, use_bin_type=True)


def decode_batch(payload: bytes) -> EventBatch:
    """Read one batch (tagged arrays or tagged maps); unknown event kinds are skipped.

    Raises:
        EventsFormatError: not msgpack, or a field of the wrong type or shape.
    """
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False,
                              max_array_len=1 << 24, max_map_len=1 << 16)
    except Exception as exc:  # msgpack raises several kinds for bad input
        raise EventsFormatError(f"payload is not msgpack: {exc}") from None
    if isinstance(raw, dict):  # a batch encoded as a map
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2:
        raise EventsFormatError("a batch is [ts, events, data_parallel_rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise EventsFormatError(f"batch ts {ts!r} is not a number")
    if not isinstance(events, list) or len(events) > MAX_EVENTS_PER_BATCH:
        raise EventsFormatError("batch events is not a list (or is too long)")
    if rank is not None and not _is_int(rank):
        raise EventsFormatError(f"data_parallel_rank {rank!r} is not an int")
    out = [e for e in (_event(raw_event) for raw_event in events) if e is not None]
    return EventBatch(float(ts), out, rank)


_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                           "lora_id", "medium"),
           "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}


def _event(raw: object) -> Event | None:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag, values = raw[0], raw[1:]
        names = _FIELDS.get(tag)
        fields = dict(zip(names, values)) if names is not None else {}
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag, fields = raw["type"], raw
    else:
        raise EventsFormatError(f"an event is a tagged array or map, not {raw!r:.60}")
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(fields.get("block_hashes")), _medium(fields))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # a kind this reader does not know: skipped


def _stored(f: dict) -> BlockStored:
    hashes, parent = _hashes(f.get("block_hashes")), f.get("parent_block_hash")
    tokens, size = f.get("token_ids"), f.get("block_size")
    if parent is not None:
        parent = _hash(parent)
    if not _is_int(size) or size < 1:
        raise EventsFormatError(f"BlockStored block_size {size!r} is not a positive int")
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise EventsFormatError("BlockStored token_ids is not a list of ints")
    if len(tokens) != len(hashes) * size:
        raise EventsFormatError(f"BlockStored: {len(tokens)} token ids for {len(hashes)} "
                                f"blocks of {size}")
    lora = f.get("lora_id")
    return BlockStored(hashes, parent, tokens, size, lora if _is_int(lora) else None,
                       _medium(f))


def _hashes(raw: object) -> list[int]:
    if not isinstance(raw, list):
        raise EventsFormatError(f"block_hashes {raw!r:.60} is not a list")
    return [_hash(h) for h in raw]


def _hash(raw: object) -> int:
    """A block hash as an unsigned 64-bit int (vLLM may also send the digest's bytes)."""
    if isinstance(raw, (bytes, bytearray)) and raw:
        return int.from_bytes(bytes(raw[-8:]), "big")
    if _is_int(raw):
        return raw & 0xFFFF_FFFF_FFFF_FFFF  # a signed 64-bit producer's value, unsigned
    raise EventsFormatError(f"block hash {raw!r:.40} is neither an int nor bytes")


def _medium(f: dict) -> str | None:
    medium = f.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise EventsFormatError(f"medium {medium!r:.40} is not a string")
    return medium


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
