"""Settings of one transport endpoint (prefill sender or decode receiver)."""

from __future__ import annotations

from dataclasses import dataclass

from .frame_memory import MMAP_THRESHOLD

FRAME_BYTES_LIMIT = MMAP_THRESHOLD // 2
"""Largest ``max_frame_bytes`` (16 MiB): a decode's glibc serves blocks below
``MMAP_THRESHOLD`` (glibc's own ceiling) from its heaps and maps larger ones afresh, and a
frame's buffer also holds libzmq's header; 8 and 16 MiB frames ran alike in ``pdkv bench
transfer`` (docs/benchmarks.md)."""


@dataclass(frozen=True)
class TransportConfig:
    """Deadlines, lease and identity of one endpoint. All times are seconds."""

    node: str = "node"
    """Name of this process, sent in the handshake and used in log lines."""
    model: str = ""
    """Model name; both ends must agree (empty on both is fine for tests)."""
    model_digest: str = ""
    """Fingerprint of the weights (``ModelRunner.fingerprint``: config, tensor names,
    shapes and sampled bytes, draft included); both ends must agree, so workers that
    loaded different checkpoints refuse each other (empty on both is fine for tests)."""
    tp_rank: int = 0
    """This endpoint's tensor-parallel rank."""
    tp_size: int = 1
    """Tensor-parallel size of this endpoint's group."""
    heartbeat_s: float = 1.0
    """Interval between heartbeats to each peer."""
    lease_s: float = 10.0
    """A peer silent (no message at all) for this long is declared lost."""
    handshake_timeout_s: float = 10.0
    """Deadline for the peer's Hello answer when connecting."""
    admission_timeout_s: float = 30.0
    """Prefill: how long handed-over pages wait for every decode rank's ``Register`` (from
    the first one, or from the first hand-over when none came yet): a missing registration
    is the backpressure, bounded here."""
    chunk_timeout_s: float = 60.0
    """Longest gap without progress on a request whose KV is moving (decode: between two
    data messages, from the first; prefill: from its last hand-over, once the worker
    handed over the first pages); also the longest wait for an ``AbortAck`` from a peer
    that is alive. A request registered but not started yet (queued at its prefill, which
    may take long under load) is not bounded by it: the prefill's lease says whether it
    is alive, and ``done_timeout_s`` bounds the whole."""
    done_timeout_s: float = 600.0
    """Longest time from Register to the last data message (decode) or from every leg's
    registration to the own transfers' completion (prefill): the request's overall
    deadline on the KV plane (workers set it to the router's ``request_timeout_s``)."""
    max_frame_bytes: int = 8 << 20
    """Prefill: coalesced page runs are cut into data frames of at most this many bytes
    (a page larger than this still travels as one frame), at most ``FRAME_BYTES_LIMIT``."""
    keep_frame_memory: bool = True
    """Decode: fix glibc's malloc thresholds (process-wide, once) so that the buffers of
    received frames stay mapped between frames instead of being faulted in afresh for
    each (transport/frame_memory.py); False leaves malloc's defaults."""
    require_capability: bool = False
    """Prefill: stream a request's KV only to a peer whose ``Register`` carries the
    capability the worker registered with ``KvSender.expect`` (an announce that comes
    first waits for it, up to ``admission_timeout_s``). Serving workers always set it;
    off, any handshaken peer may announce any rid (tests, benchmarks)."""
    shared_memory: bool = True
    """Use the same-host shared-memory data path when possible: decode offers its pool if
    it lives in shared memory (``KvCache(shared_memory=True)``), prefill maps an offered
    pool when both run on one host. False on either side keeps ZMQ data frames."""
    kv_transport: str = "zmq"
    """Data path: ``zmq`` (frames, or shared memory as above), ``nixl`` (NIXL WRITEs into
    the decode's registered pool; the handshake fails unless both ends use NIXL) or
    ``auto`` (NIXL when both ends offer it, else as ``zmq``). See transport/nixl.py."""
    kv_integrity: bool = True
    """Digest every transferred page run at the source and verify it where it lands
    (``common.kv.digest``; docs/protocol.md, "Integrity"); off on either end turns it
    off for the leg. Page epochs are checked either way."""

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} must be in [0, tp_size={self.tp_size})")
        if not 0 < self.heartbeat_s < self.lease_s:
            raise ValueError(f"need 0 < heartbeat_s={self.heartbeat_s} < lease_s={self.lease_s}")
        for name in ("handshake_timeout_s", "admission_timeout_s", "chunk_timeout_s",
                     "done_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.kv_transport not in ("zmq", "nixl", "auto"):
            raise ValueError(f"kv_transport={self.kv_transport!r}; allowed: zmq, nixl, auto")
        if not 1 <= self.max_frame_bytes <= FRAME_BYTES_LIMIT:
            raise ValueError(f"max_frame_bytes={self.max_frame_bytes} must be in [1, "
                             f"{FRAME_BYTES_LIMIT}]: a decode's malloc maps a frame buffer of "
                             "32 MiB or more afresh for every frame and faults each page in "
                             "(32 MiB frames moved at 0.17-0.46x of raw pyzmq)")
