"""What a link's ``poll`` hands back to its endpoint, and the parts both links share.

A link (``SenderLink``, ``ReceiverLink``) owns the sockets, the handshake and the
heartbeats of one endpoint. Its ``poll`` returns values: the messages of handshaken peers
in arrival order, the peers it found lost (lease, Bye, unreachable) and the handshakes it
refused; the endpoint decides what they mean for its requests. Nothing calls back up.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import zmq

from .events import Event
from .messages import (
    Error,
    ErrorCode,
    KvChunk,
    Message,
    ProtocolError,
    decode,
)
from .peers import Peer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Inbound:
    """One message of a handshaken peer: its decoded control frame and the frames that
    followed it (a ``KvChunk``'s data frame), or the error that decoding raised. ``via``
    is ``zmq``, or ``nixl`` for a NIXL notification (a ``KvWritten``, no frames)."""

    peer: Peer
    msg: Message | None
    data: list[zmq.Frame] = field(default_factory=list)
    error: ProtocolError | None = None
    via: str = "zmq"


@dataclass
class LinkPoll:
    """What one ``poll`` of a link found."""

    inbound: list[Inbound] = field(default_factory=list)
    lost: list[tuple[Peer, str, bool]] = field(default_factory=list)  # (peer, why, clean)
    events: list[Event] = field(default_factory=list)                # handshakes refused
    more: bool = False  # the drain stopped early: more may be waiting (poll again, 0 s)


def parse(frames: list[zmq.Frame]) -> tuple[Message, list[zmq.Frame]]:
    """Decode a message's control frame; a ``KvChunk`` keeps its frames for the endpoint.

    Raises:
        ProtocolError: undecodable control frame, or frames after a message without data.
    """
    msg = decode(frames[0].buffer if frames else b"")
    rest = frames[1:]
    if rest and not isinstance(msg, KvChunk):
        raise ProtocolError(ErrorCode.EXTRA_FRAMES, f"{type(msg).__name__} followed by "
                            f"{len(rest)} more frame(s)", getattr(msg, "rid", None))
    return msg, rest


def count_error(stats: Counter, node: str, who: str, exc: ProtocolError) -> Error:
    """Count and log a protocol error of peer ``who``; returns the ``Error`` to answer."""
    stats["errors"] += 1
    stats[f"errors.{exc.code.value}"] += 1
    logger.warning("%s: protocol error from %s: %s: %r", node, who, exc.code.value,
                   exc.detail)
    return Error(code=exc.code.value, detail=exc.detail, rid=exc.rid or "")


def is_unreachable(exc: zmq.ZMQError) -> bool:
    """True when a ROUTER send failed because the peer is gone."""
    return exc.errno == zmq.EHOSTUNREACH
