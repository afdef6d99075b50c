"""pdkv transport: the wire protocol that moves KV pages from prefill to decode.

Public surface: ``KvSender`` (prefill), ``KvReceiver`` (decode), ``TransportConfig``,
``Event``/``EventKind`` (what ``poll`` returns), ``HandshakeError``, ``ProtocolError``.
See docs/protocol.md.
"""

from transport.config import TransportConfig
from transport.events import Event, EventKind
from transport.group import GroupReceiver, GroupSender, RankReceiver, RankSender
from transport.handshake import HandshakeError
from transport.messages import PROTOCOL_VERSION, ErrorCode, ProtocolError
from transport.metrics import transport_readings
from transport.receiver import KvReceiver
from transport.sender import KvSender

__all__ = ["PROTOCOL_VERSION", "ErrorCode", "Event", "EventKind", "GroupReceiver",
           "GroupSender", "HandshakeError", "KvReceiver", "KvSender", "ProtocolError",
           "RankReceiver", "RankSender", "TransportConfig", "transport_readings"]
