"""A worker's KV events: its publisher, and its caches' entries as events.

``--kv-events-endpoint ADDR`` makes a worker (rank 0 of a tensor-parallel group: its
followers hold the same pages and publish nothing) publish what its caches hold in vLLM's
format (``common.kv_events``, docs/kv_events.md), with a replay socket beside it:

| medium | what | stored | removed |
| --- | --- | --- | --- |
| ``CPU`` | the host tier's prefix cache | a copy to the host ended (pages cached) | evicted |
| ``GPU`` | the device pool's reusable pages | never (see below) | never |

pdkv's device pool keeps no prefix cache: a row's pages are the request's and go back to
the free list when it ends; a later request reuses a prefix by loading it from the host
tier. No device page is ever reused by another request, so the device medium publishes
no block: announcing a live row's pages would promise routers hits that pdkv cannot
serve. Its first batch is ``AllBlocksCleared`` (a restarted worker's old blocks are gone
for every medium), and so is its last, at shutdown.

The listener only queues; hashing and encoding happen on the publisher's thread.
"""

from __future__ import annotations

import hashlib
import logging
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from common.auth import PlaneAuth
from common.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    EventPublisher,
    TierEvents,
    external_hash,
)

if TYPE_CHECKING:
    from common.host import Offloader

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EventsSpec:
    """Where a worker publishes its KV events (``pdkv prefill/decode/colocated`` flags)."""

    endpoint: str
    """The PUB socket's bind address (``--kv-events-endpoint``)."""
    replay_endpoint: str = ""
    """The replay socket's (default: next TCP port, or ``<path>.replay``)."""
    advertise_host: str = ""
    """The host subscribers connect to when the bind host is a wildcard (default: this
    host's name)."""


class WorkerEvents:
    """A worker's publisher and the listener on its host tier's prefix cache.

    Args:
        spec: where to publish.
        auth: the events plane (``common.auth.events_server``).
        ctx: the worker's ZMQ context.
    """

    def __init__(self, spec: EventsSpec, auth: PlaneAuth, ctx: zmq.Context) -> None:
        self.spec = spec
        self.publisher = EventPublisher(spec.endpoint, spec.replay_endpoint or None, auth,
                                        ctx=ctx)
        self.publisher.publish(AllBlocksCleared())  # whatever an earlier process held
        self.offloader: Offloader | None = None

    def watch(self, offloader: Offloader | None, page_size: int) -> None:
        """Publish the host tier's prefix cache (call before its first entry)."""
        self.offloader = offloader
        if offloader is not None:
            offloader.prefix.listener = TierEvents(self.publisher, page_size, MEDIUM_CPU)

    @property
    def addresses(self) -> tuple[str, str]:
        """(events, replay) as subscribers reach them."""
        return (_advertised(self.publisher.address, self.spec.advertise_host),
                _advertised(self.publisher.replay_address, self.spec.advertise_host))

    def state(self) -> dict[str, int | str]:
        """What the events say this worker holds, for its final stats: the host tier's
        cached blocks and a digest of their hashes (a subscriber that rebuilt the state
        from the events computes the same: ``state_digest``)."""
        if self.offloader is None:
            return {"kv_events_cpu_blocks": 0, "kv_events_cpu_digest": state_digest([])}
        keys = self.offloader.prefix.keys()
        return {"kv_events_cpu_blocks": len(keys),
                "kv_events_cpu_digest": state_digest(external_hash(k) for k in keys)}

    def close(self) -> None:
        """Every cache is gone: say so, send what is queued and close."""
        if self.offloader is not None:
            self.offloader.prefix.listener = None
        self.publisher.publish(AllBlocksCleared())
        self.publisher.close()


def state_digest(hashes) -> str:
    """A digest of a set of block hashes (order does not matter)."""
    h = hashlib.blake2b(digest_size=16)
    for value in sorted(hashes):
        h.update(value.to_bytes(8, "big"))
    return h.hexdigest()


def _advertised(address: str, host: str) -> str:
    """``address`` with a wildcard host replaced by ``host`` (or this host's name)."""
    scheme, _, rest = address.partition("://")
    if scheme != "tcp":
        return address
    bound, _, port = rest.rpartition(":")
    if bound in ("0.0.0.0", "*", "[::]", "::"):
        bound = host or socket.gethostname()
    return f"tcp://{bound}:{port}"
