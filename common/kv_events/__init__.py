"""KV events in vLLM's wire format: what a worker's caches hold, published over ZMQ (PUB
with a replay socket) for routers, and followed back (streams with gap replay)."""

from common.kv_events.feed import EventFeed
from common.kv_events.publisher import EventPublisher, replay_address
from common.kv_events.subscriber import EventStream, Lost
from common.kv_events.tiers import TierEvents
from common.kv_events.wire import (
    END_SEQ,
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    EventsFormatError,
    decode_batch,
    encode_batch,
    external_hash,
)

__all__ = ["END_SEQ", "MEDIUM_CPU", "MEDIUM_GPU", "AllBlocksCleared", "BlockRemoved",
           "BlockStored", "Event", "EventBatch", "EventFeed", "EventPublisher", "EventStream",
           "EventsFormatError", "Lost", "TierEvents", "decode_batch", "encode_batch",
           "external_hash", "replay_address"]
