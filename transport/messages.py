"""Control messages of the pdkv wire protocol and their one codec (msgpack).

Every message is a frozen dataclass with an explicit field list. On the wire it is one
msgpack map ``{"t": <type name>, <field>: <value>, ...}``; a ``KvChunk`` header is
followed by exactly one raw data frame (the page bytes), every other message by none.
Page ids travel as little-endian int32 ``bytes``. Nothing is ever pickled. A field with a
default (only ``Hello``'s same-host fields) may be absent, so that a version-1 ``Hello``
still decodes and fails the handshake on ``version`` rather than on a missing field.

``decode`` never raises anything but ``ProtocolError``: unknown types, missing fields,
wrong field types and undecodable bytes all become one, with an ``ErrorCode``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from enum import Enum

import msgpack
import numpy as np

PROTOCOL_VERSION = 2  # 2: same-host shared-memory data path (KvWritten)
MAX_HEADER_BYTES = 64 * 1024


class ErrorCode(str, Enum):
    """Codes carried by ``Error`` messages and counted under ``errors.<code>``."""

    MALFORMED = "malformed"            # bytes that are not one msgpack map
    UNKNOWN_TYPE = "unknown_type"      # "t" names no message type
    MISSING_FIELD = "missing_field"    # a declared field is absent
    BAD_FIELD = "bad_field"            # a field has the wrong type or an invalid value
    TRUNCATED = "truncated"            # a KvChunk without its data frame
    OVERSIZED = "oversized"            # header or data frame larger than declared/allowed
    EXTRA_FRAMES = "extra_frames"      # frames after a message that carries none
    UNKNOWN_RID = "unknown_rid"        # a request id this endpoint does not hold
    BAD_RANGE = "bad_range"            # pages/heads outside what was announced
    DUPLICATE_RID = "duplicate_rid"    # announce of a rid already in flight from that peer
    NOT_HANDSHAKEN = "not_handshaken"  # anything but Hello before a successful Hello
    HANDSHAKE = "handshake"            # version/layout/TP mismatch (detail names the field)
    INTERNAL = "internal"              # a bug on the answering side; request failed


class ProtocolError(Exception):
    """A message that breaks the protocol; answered to the peer with ``Error``, counted."""

    def __init__(self, code: ErrorCode, detail: str, rid: str | None = None):
        super().__init__(f"{code.value}: {detail}")
        self.code = code
        self.detail = detail
        self.rid = rid


@dataclass(frozen=True)
class Hello:
    """Handshake, sent by the connecting (decode) side and answered with the peer's own."""

    version: int
    node: str
    role: str            # "prefill" or "decode"
    model: str
    num_layers: int
    num_draft_layers: int
    total_kv_heads: int  # heads of the whole model, before the TP split
    head_dim: int
    dtype: str
    page_size: int
    tp_rank: int
    tp_size: int
    lease_ms: int        # how long the sender of this Hello may be silent before it is lost
    # version 2, same-host shared memory (absent in a version-1 Hello):
    host_id: str = ""    # "<hostname>/<boot_id>": equal ids prove both ends share a kernel
    shm_pool: str = ""   # decode: its pool's segment, offered; prefill: the one it mapped
    shm_pages: int = 0   # decode: pages of that pool (its shape follows from the layout)


@dataclass(frozen=True)
class Announce:
    """Decode -> prefill: rows are preallocated, stream the KV of ``rid`` into them."""

    rid: str
    prompt_len: int
    cached_tokens: int   # positions [0, cached_tokens) already held (prefix cache); page-aligned
    dest_pages: bytes    # int32 page ids of positions [0, prompt_len) in the decode pool


@dataclass(frozen=True)
class Accepted:
    """Prefill -> decode: every decode rank needed for ``rid`` announced; streaming follows."""

    rid: str


@dataclass(frozen=True)
class KvChunk:
    """Prefill -> decode header of one data frame: ``num_blocks`` row blocks (pages).

    Row block ``first_block + i`` goes to ``dest_pages[first_block + i]`` of the announce;
    the frame holds heads ``[head_start, head_end)`` (global numbering) of every layer,
    laid out ``[num_blocks, total_layers, 2, page_size, head_end - head_start, head_dim]``.
    """

    rid: str
    first_block: int
    num_blocks: int
    head_start: int
    head_end: int
    nbytes: int


@dataclass(frozen=True)
class KvWritten:
    """Prefill -> decode, shared-memory legs: blocks ``[first_block, first_block +
    num_blocks)``, heads ``[head_start, head_end)``, were copied straight into the decode's
    ``dest_pages`` (no data frame follows). Sent after the copy finished."""

    rid: str
    first_block: int
    num_blocks: int
    head_start: int
    head_end: int


@dataclass(frozen=True)
class Done:
    """Prefill -> decode: the whole prompt's KV was sent; ``first_token`` is the first output."""

    rid: str
    num_blocks: int      # blocks sent in total for this rid to this rank
    first_token: int


@dataclass(frozen=True)
class Ack:
    """Decode -> prefill: every chunk of ``rid`` and its ``Done`` arrived and was written."""

    rid: str


@dataclass(frozen=True)
class Abort:
    """Either direction: stop ``rid``; the receiver answers ``AbortAck`` once it stopped."""

    rid: str
    reason: str          # free reason the peer should record: aborted, timeout, error, ...
    detail: str


@dataclass(frozen=True)
class AbortAck:
    """Either direction: this side will not touch ``rid``'s pages any more."""

    rid: str


@dataclass(frozen=True)
class Heartbeat:
    """Either direction, every heartbeat interval; any message also renews the lease."""

    seq: int


@dataclass(frozen=True)
class Bye:
    """Either direction: clean shutdown; everything held for the sender is released now."""

    reason: str


@dataclass(frozen=True)
class Error:
    """Answer to a message that broke the protocol; ``rid`` is empty when none applies."""

    code: str
    detail: str
    rid: str


Message = (Hello | Announce | Accepted | KvChunk | KvWritten | Done | Ack | Abort | AbortAck
           | Heartbeat | Bye | Error)
MESSAGE_TYPES: dict[str, type] = {cls.__name__: cls for cls in typing.get_args(Message)}
_FIELD_TYPES: dict[type, dict[str, type]] = {
    cls: {f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)}
    for cls in MESSAGE_TYPES.values()}
_OPTIONAL: dict[type, set[str]] = {
    cls: {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    for cls in MESSAGE_TYPES.values()}


def encode(msg: Message) -> bytes:
    """One message as a msgpack map (the ``"t"`` key names its type)."""
    body = {"t": type(msg).__name__}
    body.update(dataclasses.asdict(msg))
    return msgpack.packb(body, use_bin_type=True)


def decode(frame: bytes | memoryview) -> Message:
    """Parse and validate one control frame.

    Raises:
        ProtocolError: for anything but a well-formed message of a known type.
    """
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.OVERSIZED, f"control frame of {len(frame)} bytes "
                            f"exceeds {MAX_HEADER_BYTES}")
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ProtocolError(ErrorCode.MALFORMED, f"not msgpack: {exc!r}") from None
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.MALFORMED, f"expected a map, got {type(body).__name__}")
    kind = body.get("t")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {body.get('t')!r}")
    return cls(**_checked_fields(cls, body))


def _checked_fields(cls: type, body: dict) -> dict:
    fields = {}
    rid = body.get("rid") if isinstance(body.get("rid"), str) else None
    for name, want in _FIELD_TYPES[cls].items():
        if name not in body:
            if name in _OPTIONAL[cls]:
                continue
            raise ProtocolError(ErrorCode.MISSING_FIELD, f"{cls.__name__}.{name} missing", rid)
        value = body[name]
        # bool is an int subclass; a flag where a count is expected is still a type error
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{cls.__name__}.{name} must be "
                                f"{want.__name__}, got {type(value).__name__}", rid)
        fields[name] = value
    return fields


def pages_to_bytes(pages: np.ndarray | typing.Sequence[int]) -> bytes:
    """Page ids as the wire carries them: little-endian int32."""
    return np.asarray(pages, dtype="<i4").tobytes()


def pages_from_bytes(data: bytes, what: str = "pages") -> np.ndarray:
    """Inverse of ``pages_to_bytes``; raises ``ProtocolError`` on a ragged length."""
    if len(data) % 4:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{what}: {len(data)} bytes is not int32s")
    return np.frombuffer(data, dtype="<i4").astype(np.int64)
