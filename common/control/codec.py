"""One msgpack codec for dataclass messages, and one packing of int32 ids as bytes.

A message is a frozen dataclass with an explicit field list. On the wire it is one msgpack
map ``{"t": <class name>, <field>: <value>, ...}``; nothing is ever pickled. A field with a
default may be absent (older peers), every other field must be present with its declared
type. ``Codec.decode`` raises nothing but ``DecodeError``: undecodable bytes, unknown
types, missing fields, wrong field types and a ``ValueError``/``TypeError`` raised by the
message's own ``__post_init__`` (range checks) all become one, with a ``code``.

Supported field types: ``int`` (a ``bool`` is not an int here), ``float`` (an int is
accepted), ``str``, ``bytes``, ``bool``, ``X | None``, ``list[X]`` and ``dict[str, X]``
of those.

    codec = Codec(Hello, Announce, max_bytes=64 << 10)
    frame = codec.encode(Announce(rid="r1", ...))
    msg = codec.decode(frame)            # Announce(...) or DecodeError

Ids (token ids, page ids) travel as little-endian int32 ``bytes`` (``pack_ids``): a list
of thousands of ints inside msgpack costs 10-100x more to encode and decode.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

import msgpack
import numpy as np

MALFORMED = "malformed"          # bytes that are not one msgpack map
UNKNOWN_TYPE = "unknown_type"    # "t" names no message type of this codec
MISSING_FIELD = "missing_field"  # a field without a default is absent
BAD_FIELD = "bad_field"          # a field has the wrong type or an invalid value
OVERSIZED = "oversized"          # the frame is larger than the codec allows

INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


class DecodeError(ValueError):
    """A frame that is not a valid message; ``code`` is one of the module's constants,
    ``rid`` the frame's ``rid`` field when it had a string one (to fail that request)."""

    def __init__(self, code: str, detail: str, rid: str | None = None):
        super().__init__(f"{code}: {detail}")
        self.code, self.detail, self.rid = code, detail, rid


Check = Callable[[Any], bool]


class Codec:
    """Encoder and checked decoder for a fixed set of dataclass message types.

    Args:
        message_types: the dataclasses this codec carries; their names are the ``"t"`` key.
        max_bytes: frames longer than this are refused before parsing.
    """

    def __init__(self, *message_types: type, max_bytes: int = 1 << 20):
        self.max_bytes = max_bytes
        self.types: dict[str, type] = {cls.__name__: cls for cls in message_types}
        self._fields: dict[type, list[tuple[str, Check, str, bool]]] = {
            cls: _field_checks(cls) for cls in message_types}

    def encode(self, msg: Any) -> bytes:
        """One message as a msgpack map whose ``"t"`` key names its type."""
        body = {"t": type(msg).__name__}
        for f in dataclasses.fields(msg):
            body[f.name] = getattr(msg, f.name)
        return msgpack.packb(body, use_bin_type=True)

    def decode(self, frame: bytes | memoryview) -> Any:
        """Parse, type-check and build one message.

        Raises:
            DecodeError: for anything but a well-formed message of a known type.
        """
        if len(frame) > self.max_bytes:
            raise DecodeError(OVERSIZED, f"frame of {len(frame)} bytes exceeds "
                              f"{self.max_bytes}")
        try:
            body = msgpack.unpackb(frame, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated exception types
            raise DecodeError(MALFORMED, f"not msgpack: {type(exc).__name__}") from None
        if not isinstance(body, dict):
            raise DecodeError(MALFORMED, f"expected a map, got {type(body).__name__}")
        kind = body.get("t")
        cls = self.types.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise DecodeError(UNKNOWN_TYPE, f"unknown message type {_short(kind)}")
        rid = body.get("rid") if isinstance(body.get("rid"), str) else None
        fields = {}
        for name, check, want, optional in self._fields[cls]:
            if name not in body:
                if optional:
                    continue
                raise DecodeError(MISSING_FIELD, f"{cls.__name__}.{name} missing", rid)
            value = body[name]
            if not check(value):
                raise DecodeError(BAD_FIELD, f"{cls.__name__}.{name} must be {want}, got "
                                  f"{type(value).__name__}", rid)
            fields[name] = value
        try:
            return cls(**fields)
        except (ValueError, TypeError) as exc:  # the message's own range checks
            raise DecodeError(BAD_FIELD, f"{cls.__name__}: {exc}", rid) from None


def pack_ids(ids: np.ndarray | Iterable[int]) -> bytes:
    """Ids as the wire carries them: little-endian int32 bytes.

    Raises:
        ValueError: an id does not fit in int32 (it would wrap silently otherwise).
    """
    arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
    if arr.size and (int(arr.min()) < INT32_MIN or int(arr.max()) > INT32_MAX):
        raise ValueError(f"ids {int(arr.min())}..{int(arr.max())} do not fit in int32")
    return arr.astype("<i4", copy=False).tobytes()


def unpack_ids(data: bytes | memoryview, what: str = "ids") -> np.ndarray:
    """Inverse of ``pack_ids``: a read-only int32 view of ``data``.

    Raises:
        ValueError: the length is not a multiple of 4 (names ``what``).
    """
    if len(data) % 4:
        raise ValueError(f"{what}: {len(data)} bytes is not a whole number of int32s")
    return np.frombuffer(data, dtype="<i4")


# -- field checks ---------------------------------------------------------------------------
def _field_checks(cls: type) -> list[tuple[str, Check, str, bool]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, _checker(hints[f.name]), _describe(hints[f.name]),
             f.default is not dataclasses.MISSING
             or f.default_factory is not dataclasses.MISSING)
            for f in dataclasses.fields(cls)]


def _checker(hint: Any) -> Check:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is int:
        return lambda v: type(v) is int  # bool is an int subclass; a flag is not a count
    if hint is float:
        return lambda v: type(v) in (float, int)
    if hint in (str, bytes, bool):
        return lambda v, t=hint: type(v) is t
    if origin in (typing.Union, types.UnionType):
        checks = [_checker(a) for a in args]
        return lambda v: any(c(v) for c in checks)
    if hint is type(None):
        return lambda v: v is None
    if origin is list:
        item = _checker(args[0])
        return lambda v: type(v) is list and all(item(x) for x in v)
    if origin is dict and args[0] is str:
        value = _checker(args[1])
        return lambda v: type(v) is dict and all(type(k) is str and value(x)
                                                 for k, x in v.items())
    raise TypeError(f"Codec: unsupported field type {hint!r}")


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) is not None:  # dict[str, X] names itself "dict"
        return str(hint).replace("typing.", "")
    return getattr(hint, "__name__", None) or str(hint)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
