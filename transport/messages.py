"""Control messages of the pdkv wire protocol, carried by the one msgpack codec
(``common.control.codec``).

Every message is a frozen dataclass with an explicit field list. On the wire it is one
msgpack map ``{"t": <type name>, <field>: <value>, ...}``; a ``KvChunk`` header is
followed by exactly one raw data frame (the page bytes), every other message by none.
Page ids travel as little-endian int32 ``bytes``, each with the epoch of the allocation
that owns it (``integrity.pack_epochs``). Nothing is ever pickled. A field with a default
(``Hello``'s same-host, NIXL and digest fields, ``Register.cap``) may be absent, so that
an older ``Hello`` still decodes and fails the handshake on ``version`` rather than on a
missing field.

The success path of a request has one control message, the decode's ``Register``; the
prefill's data messages (``KvChunk``, ``KvWritten``) carry the completion themselves (the
leg's last one carries ``first_token``). ``Abort``, ``AbortAck`` and ``Error`` are the
failure paths'; ``Heartbeat`` and ``Bye`` are per peer, not per request.

``decode`` never raises anything but ``ProtocolError``: unknown types, missing fields,
wrong field types and undecodable bytes all become one, with an ``ErrorCode``.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from common.control import Codec, DecodeError, pack_ids, unpack_ids

from . import limits as L
from .limits import INT32_MAX

PROTOCOL_VERSION = 4  # 2: shared-memory data path (KvWritten); 3: segment token, checks,
# Announce.cap (the request's KV capability); 4: the lean protocol (Register with page
# epochs; data messages carry epochs, digest and completion; no Accepted, Done, Ack)
MAX_HEADER_BYTES = 64 * 1024
MAX_NIXL_MD_BYTES = 48 * 1024  # a NIXL agent's metadata rides in the Hello header
KV_TRANSPORTS = ("zmq", "nixl", "auto")


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
    FORBIDDEN = "forbidden"            # a registration without the request's capability
    STALE_PAGES = "stale_pages"        # pages/epochs that are not the request's allocation
    CORRUPT = "corrupt"                # a digest of what landed differs from what was sent
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
    model_digest: str = ""  # fingerprint of the weights (target and draft); must match
    # version 3: the segment's secret, without which it cannot be mapped (decode only)
    shm_token: bytes = field(default=b"", repr=False)
    # NIXL data path (transport/nixl.py; absent from a peer without it, which means zmq):
    kv_transport: str = "zmq"  # the sender's mode: zmq, nixl (required) or auto
    nixl_agent: str = ""  # the sender's NIXL agent: a decode offers it, a prefill accepts
    nixl_md: bytes = b""  # decode: its agent's metadata (connection info, registered pool)
    nixl_mem: str = ""    # decode: "DRAM" or "VRAM", where its pool lives
    nixl_addr: int = 0    # decode: address of page 0 of the registered pool
    nixl_dev: int = 0     # decode: device id of that pool (0 for DRAM)
    nixl_pages: int = 0   # decode: pages of that pool
    # version 4: the digest this end computes over page runs ("" integrity off)
    kv_digest: str = ""

    def __post_init__(self) -> None:
        for name in ("node", "dtype", "host_id", "model_digest"):
            L.text(self, name, L.MAX_NAME, empty=name != "node")
        L.text(self, "model", L.MAX_TEXT)
        if self.role not in L.ROLES:
            raise ValueError(f"role={self.role[:40]!r}; allowed: {L.ROLES}")
        L.ints(self, version=(0, INT32_MAX), num_layers=(1, L.MAX_DIM),
               num_draft_layers=(0, L.MAX_DIM), total_kv_heads=(1, L.MAX_DIM),
               head_dim=(1, L.MAX_DIM), page_size=(1, L.MAX_PAGE_SIZE),
               tp_size=(1, L.MAX_TP), lease_ms=(1, L.MAX_LEASE_MS),
               shm_pages=(0, INT32_MAX))
        L.ints(self, tp_rank=(0, self.tp_size - 1))
        L.segment(self, "shm_pool")
        if len(self.shm_token) > 64:
            raise ValueError(f"shm_token of {len(self.shm_token)} bytes; at most 64")
        self._check_nixl()

    def _check_nixl(self) -> None:
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport={self.kv_transport[:40]!r}; allowed: "
                             f"{KV_TRANSPORTS}")
        if self.nixl_mem not in ("", "DRAM", "VRAM"):
            raise ValueError(f"nixl_mem={self.nixl_mem[:40]!r}; allowed: '', DRAM, VRAM")
        L.text(self, "nixl_agent", L.MAX_NAME)
        L.ints(self, nixl_addr=(0, (1 << 64) - 1), nixl_dev=(0, INT32_MAX),
               nixl_pages=(0, INT32_MAX))
        if len(self.nixl_md) > MAX_NIXL_MD_BYTES:
            raise ValueError(f"nixl_md of {len(self.nixl_md)} bytes; at most "
                             f"{MAX_NIXL_MD_BYTES}")
        if self.kv_digest not in L.DIGESTS:
            raise ValueError(f"kv_digest={self.kv_digest[:40]!r}; allowed: {L.DIGESTS}")


@dataclass(frozen=True)
class Register:
    """Decode -> prefill, the one control message of a request's success path: rows are
    allocated; stream the KV of ``rid`` into them. Sent when the decode admits the
    request, so it travels while the prefill computes."""

    rid: str
    prompt_len: int
    cached_tokens: int   # positions [0, cached_tokens) already held (prefix cache); page-aligned
    dest_pages: bytes    # int32 page ids of positions [0, prompt_len) in the decode pool
    dest_epochs: bytes   # the allocation epoch of each of them (integrity.pack_epochs)
    cap: str = ""        # the request's KV capability from the router

    def __post_init__(self) -> None:
        L.rid(self)
        L.ints(self, prompt_len=(1, INT32_MAX))
        # the last position is always sent: its message carries the first token
        L.ints(self, cached_tokens=(0, self.prompt_len - 1))
        L.text(self, "cap", L.MAX_CAP)
        if len(self.dest_pages) % 4:
            raise ValueError(f"dest_pages: {len(self.dest_pages)} bytes is not int32s")
        if len(self.dest_epochs) % 16:
            raise ValueError(f"dest_epochs: {len(self.dest_epochs)} bytes is not "
                             "(epoch, count) pairs")


@dataclass(frozen=True)
class KvChunk:
    """Prefill -> decode header of one data frame: ``num_blocks`` row blocks (pages).

    Row block ``first_block + i`` goes to ``dest_pages[first_block + i]`` of the
    registration; the frame holds heads ``[head_start, head_end)`` (global numbering) of
    every layer, laid out ``[num_blocks, total_layers, 2, page_size, head_end - head_start,
    head_dim]``. ``epochs`` repeats the registration's epochs of those pages, ``digest``
    is the frame's (None: integrity off on this leg), and the leg's last message carries
    ``first_token``: it is the leg's completion.
    """

    rid: str
    first_block: int
    num_blocks: int
    head_start: int
    head_end: int
    nbytes: int
    epochs: bytes = b""
    digest: int | None = None
    first_token: int | None = None

    def __post_init__(self) -> None:
        _check_blocks(self)
        L.ints(self, nbytes=(0, L.MAX_FRAME_BYTES))


@dataclass(frozen=True)
class KvWritten:
    """Prefill -> decode, one-sided legs (shared memory, a NIXL write's notification):
    blocks ``[first_block, first_block + num_blocks)``, heads ``[head_start, head_end)``,
    were written straight into the decode's ``dest_pages`` (no data frame follows). Sent
    after the write finished; ``epochs``, ``digest`` and ``first_token`` as ``KvChunk``'s."""

    rid: str
    first_block: int
    num_blocks: int
    head_start: int
    head_end: int
    epochs: bytes = b""
    digest: int | None = None
    first_token: int | None = None

    def __post_init__(self) -> None:
        _check_blocks(self)


@dataclass(frozen=True)
class Abort:
    """Either direction: stop ``rid``; the receiver answers ``AbortAck`` once it stopped."""

    rid: str
    reason: str          # free reason the peer records: one of limits.ABORT_REASONS
    detail: str

    def __post_init__(self) -> None:
        L.rid(self)
        if self.reason not in L.ABORT_REASONS:
            raise ValueError(f"reason={self.reason[:40]!r}; allowed: {L.ABORT_REASONS}")
        L.cut(self, "detail")


@dataclass(frozen=True)
class AbortAck:
    """Either direction: this side will not touch ``rid``'s pages any more."""

    rid: str

    def __post_init__(self) -> None:
        L.rid(self)


@dataclass(frozen=True)
class Heartbeat:
    """Either direction, every heartbeat interval; any message also renews the lease."""

    seq: int

    def __post_init__(self) -> None:
        L.ints(self, seq=(0, 1 << 62))


@dataclass(frozen=True)
class Bye:
    """Either direction: clean shutdown; everything held for the sender is released now."""

    reason: str

    def __post_init__(self) -> None:
        L.cut(self, "reason")


@dataclass(frozen=True)
class Error:
    """Answer to a message that broke the protocol; ``rid`` is empty when none applies."""

    code: str
    detail: str
    rid: str

    def __post_init__(self) -> None:
        L.text(self, "code", L.MAX_NAME)
        L.rid(self, empty=True)
        L.cut(self, "detail")


def _check_blocks(msg: KvChunk | KvWritten) -> None:
    L.rid(msg)
    L.ints(msg, first_block=(0, INT32_MAX), num_blocks=(1, INT32_MAX),
           head_start=(0, L.MAX_DIM - 1))
    L.ints(msg, head_end=(msg.head_start + 1, L.MAX_DIM))
    if len(msg.epochs) % 16:
        raise ValueError(f"epochs: {len(msg.epochs)} bytes is not (epoch, count) pairs")
    if msg.digest is not None:
        L.ints(msg, digest=(0, L.MAX_DIGEST))
    if msg.first_token is not None:
        L.ints(msg, first_token=(0, INT32_MAX))


Message = (Hello | Register | KvChunk | KvWritten | Abort | AbortAck | Heartbeat | Bye
           | Error)
CODEC = Codec(*typing.get_args(Message), max_bytes=MAX_HEADER_BYTES)


def encode(msg: Message) -> bytes:
    """One message as a msgpack map (the ``"t"`` key names its type)."""
    return CODEC.encode(msg)


def decode(frame: bytes | memoryview) -> Message:
    """Parse and validate one control frame.

    Raises:
        ProtocolError: for anything but a well-formed message of a known type.
    """
    try:
        return CODEC.decode(frame)
    except DecodeError as exc:
        raise ProtocolError(ErrorCode(exc.code), exc.detail, exc.rid) from None


def pages_to_bytes(pages: np.ndarray | typing.Sequence[int]) -> bytes:
    """Page ids as the wire carries them: little-endian int32."""
    return pack_ids(pages)


def pages_from_bytes(data: bytes, what: str = "pages") -> np.ndarray:
    """Inverse of ``pages_to_bytes`` (int64 copy); raises ``ProtocolError`` on a ragged
    length."""
    try:
        return unpack_ids(data, what).astype(np.int64)
    except ValueError as exc:
        raise ProtocolError(ErrorCode.BAD_FIELD, str(exc)) from None
