"""The handshake: both ends compare protocol version, model (name and weights
fingerprint), KV layout and TP ranks.

The connecting (decode) side sends its ``Hello``; the bound (prefill) side checks it and
answers with its own ``Hello`` either way, so both sides run the same ``check`` and both
fail with a message that names the differing field (docs/design.md, "Transfer").
"""

from __future__ import annotations

from common.kv import KvLayout, preferred_digest

from .config import TransportConfig
from .messages import PROTOCOL_VERSION, Hello
from .shm import host_id

# fields that must be equal on both ends of a transfer
_MUST_MATCH = ("version", "model", "model_digest", "num_layers", "num_draft_layers",
               "total_kv_heads", "head_dim", "dtype", "page_size")


class HandshakeError(RuntimeError):
    """The peer's version, model, KV layout or TP setup is incompatible with ours.

    ``field`` names what differed (a ``Hello`` field such as ``page_size``, or ``ranks``,
    ``shm_pool``, ``answer`` for a reply that is no ``Hello``, ``peer_refused`` for an
    ``Error`` reply): the ``field`` label of ``pdkv_transfer_handshake_failures_total``.
    """

    def __init__(self, message: str, field: str = "other") -> None:
        super().__init__(message)
        self.field = field


def count_failure(stats, reason: str, field: str) -> None:
    """Count a failed handshake (``reason``: mismatch, refused or timeout) in an
    endpoint's ``stats``, as ``transport.metrics`` reads them."""
    stats["errors.handshake" if reason != "timeout" else "timeouts.handshake"] += 1
    stats[f"{_FAILED}{reason}.{field}"] += 1


_FAILED = "handshake_failed."


def make_hello(config: TransportConfig, layout: KvLayout, page_size: int, role: str,
               shm_pool: str = "", shm_pages: int = 0, shm_token: bytes = b"",
               nixl_offer: dict | None = None, device: str = "cpu") -> Hello:
    """This endpoint's ``Hello``; ``layout.num_kv_heads`` is the heads of this rank only.

    A decode passes its shared pool (``shm_pool``, ``shm_pages``, ``shm_token``) to offer
    it, and either side its NIXL fields (``nixl_offer``, see transport/nixl.py); ``device``
    is where the pool lives (the digest this end offers, ``common.kv.digest``)."""
    offer = config.shared_memory and bool(shm_pool)
    return Hello(version=PROTOCOL_VERSION, node=config.node, role=role, model=config.model,
                 num_layers=layout.num_layers, num_draft_layers=layout.num_draft_layers,
                 total_kv_heads=layout.num_kv_heads * config.tp_size,
                 head_dim=layout.head_dim, dtype=layout.dtype, page_size=page_size,
                 tp_rank=config.tp_rank, tp_size=config.tp_size,
                 lease_ms=int(config.lease_s * 1000), host_id=host_id(),
                 shm_pool=shm_pool if offer else "", shm_pages=shm_pages if offer else 0,
                 shm_token=shm_token if offer else b"", model_digest=config.model_digest,
                 kv_transport=config.kv_transport,
                 kv_digest=preferred_digest(device) if config.kv_integrity else "",
                 **(nixl_offer or {}))


def check(mine: Hello, theirs: Hello) -> None:
    """Raise ``HandshakeError`` naming the first field that makes the peer incompatible."""
    for name in _MUST_MATCH:
        a, b = getattr(mine, name), getattr(theirs, name)
        if a != b:
            raise HandshakeError(f"handshake mismatch on {name}: ours ({mine.node}) is {a!r}, "
                                 f"peer {theirs.node} has {b!r}", name)
    if mine.role == theirs.role or {mine.role, theirs.role} != {"prefill", "decode"}:
        raise HandshakeError(f"handshake mismatch on role: ours is {mine.role!r}, peer "
                             f"{theirs.node} is {theirs.role!r}; need prefill <-> decode", "role")
    _check_tp(theirs)


def _check_tp(peer: Hello) -> None:
    if peer.tp_size < 1 or not 0 <= peer.tp_rank < peer.tp_size:
        raise HandshakeError(f"handshake mismatch on tp_rank: peer {peer.node} has "
                             f"tp_rank={peer.tp_rank}, tp_size={peer.tp_size}", "tp_rank")
    if peer.total_kv_heads % peer.tp_size:
        raise HandshakeError(f"handshake mismatch on tp_size: peer {peer.node} splits "
                             f"{peer.total_kv_heads} KV heads over tp_size={peer.tp_size}",
                             "tp_size")
    if peer.lease_ms < 1:
        raise HandshakeError(f"handshake mismatch on lease_ms: peer {peer.node} has "
                             f"{peer.lease_ms}", "lease_ms")
