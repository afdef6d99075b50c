"""What a wire field may hold: the ranges, lengths and names the messages check.

Every message of ``messages.py`` checks its fields in ``__post_init__`` with these, so a
peer's message is checked the moment it is decoded (the codec turns the ``ValueError``
into ``Error(bad_field)``), and one of ours is checked before it leaves.
"""

from __future__ import annotations

from common.kv import valid_segment_name

INT32_MAX = (1 << 31) - 1
MAX_NAME = 256          # node names, dtype names
MAX_RID = 512           # request ids
MAX_CAP = 64            # a request's KV capability (the router's are 32 hex digits)
MAX_TEXT = 4096         # details and reasons are cut to this many characters
MAX_DIM = 1 << 16       # layers, heads, head dim
MAX_PAGE_SIZE = 1 << 20
MAX_TP = 4096
MAX_LEASE_MS = 3_600_000
MAX_FRAME_BYTES = 1 << 40
MAX_DIGEST = (1 << 64) - 1
DIGESTS = ("", "xxh3_64", "fold64")  # a Hello's kv_digest ("" integrity off)
ROLES = ("prefill", "decode")
# The free reasons an Abort may carry: the peer frees its row with it (docs/protocol.md).
# ``migrated``: the router moved the request to another worker (docs/operations.md).
ABORT_REASONS = ("aborted", "timeout", "error", "peer_lost", "migrated")


def ints(msg: object, **bounds: tuple[int, int]) -> None:
    """Each named int field of ``msg`` within ``[lo, hi]``.

    Raises:
        ValueError: naming the field, its value and its range.
    """
    for name, (lo, hi) in bounds.items():
        value = getattr(msg, name)
        if not lo <= value <= hi:
            raise ValueError(f"{name}={value} outside [{lo}, {hi}]")


def text(msg: object, name: str, max_len: int, empty: bool = True) -> None:
    """A printable string field of at most ``max_len`` characters (so it is safe to log).

    Raises:
        ValueError: too long, empty when it may not be, or with control characters.
    """
    value = getattr(msg, name)
    if len(value) > max_len or (not empty and not value) or not value.isprintable():
        raise ValueError(f"{name} must be 1..{max_len} printable characters, got "
                         f"{len(value)}: {value[:40]!r}")


def rid(msg: object, name: str = "rid", empty: bool = False) -> None:
    text(msg, name, MAX_RID, empty)


def cut(msg: object, name: str) -> None:
    """Cut a free-text field to ``MAX_TEXT`` and replace what cannot be logged safely."""
    value = getattr(msg, name)
    if len(value) > MAX_TEXT or not value.isprintable():
        value = "".join(c if c.isprintable() else "?" for c in value[:MAX_TEXT])
        object.__setattr__(msg, name, value)  # frozen dataclass: set during __post_init__


def segment(msg: object, name: str) -> None:
    """Empty, or a bare shared-memory segment name (no path, no ``..``)."""
    value = getattr(msg, name)
    if value and not valid_segment_name(value):
        raise ValueError(f"{name}={value[:40]!r} is not a shared-memory segment name")
