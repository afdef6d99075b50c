"""A KV events subscriber written from the format's documentation, not from pdkv's code.

vLLM documents the contract (``vllm/distributed/kv_events.py``, and its example subscriber
``examples/online_serving/kv_events_subscriber.py``); docs/kv_events.md restates it:

- a ZMQ SUB socket receives ``(topic, seq, payload)``, ``seq`` an 8-byte big-endian int;
- the replay endpoint is a ROUTER socket: a request is the first missing ``seq`` (8 bytes,
  big-endian) behind an empty delimiter frame (a REQ's framing), and the answers are
  ``(seq, payload)`` messages behind the same delimiter until ``seq`` is -1 with an empty
  payload. A REQ socket takes only the first answer of such a stream (ZMQ's REQ accepts
  one reply per request), so this subscriber asks with a DEALER, framing as a REQ would;
- a payload is msgspec's encoding of these structs (``array_like``, events tagged).

The structs below are vLLM's, copied from its documentation; decoding uses msgspec, the
library vLLM encodes with, so a payload pdkv gets wrong in any field fails here. State is
rebuilt per medium: block hash -> (parent hash, token ids), ``AllBlocksCleared`` empties
every medium (the state just before it is kept in ``cleared_states``).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


class DocSubscriber:
    """Follows one publisher: live batches in ``seq`` order, gaps filled by replay.

    Args:
        ctx: the ZMQ context.
        endpoint, replay_endpoint: the publisher's sockets.
        setup: called with each socket before it connects (CURVE keys).
        drop: ``seq`` numbers whose live message this subscriber throws away, as if the
            network had lost them (gap detection then asks the replay socket).
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str,
                 setup=lambda sock: None, drop: set[int] = frozenset()) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        setup(self.sub)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.ctx, self.replay_endpoint, self.setup = ctx, replay_endpoint, setup
        self.drop = set(drop)
        self.last_seq = -1
        self.gaps: list[tuple[int, int]] = []
        self.state: dict[str, dict[int, tuple[int | None, list[int]]]] = {}
        self.cleared_states: list[dict] = []
        self.block_sizes: set[int] = set()

    # -- the stream ------------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.0) -> int:
        """Read what is there (waiting up to ``timeout_s`` for the first); batches applied."""
        n = 0
        while self.sub.poll(int(timeout_s * 1000) if not n else 0):
            _, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq in self.drop:
                self.drop.discard(seq)
                continue
            if seq <= self.last_seq:
                continue
            if seq > self.last_seq + 1:
                self.gaps.append((self.last_seq + 1, seq))
                n += self.replay(self.last_seq + 1, until=seq)
            self.apply(DECODER.decode(payload))
            self.last_seq = seq
            n += 1
        return n

    def replay(self, start: int, until: int | None = None, timeout_s: float = 5.0) -> int:
        """Ask the replay socket for every batch from ``start``; apply those due."""
        req = self.ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        self.setup(req)
        req.connect(self.replay_endpoint)
        req.send_multipart([b"", start.to_bytes(8, "big")])
        n, deadline = 0, time.monotonic() + timeout_s
        try:
            while True:
                if not req.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                    raise TimeoutError(f"replay from {start} unanswered")
                delimiter, seq_bytes, payload = req.recv_multipart()
                assert delimiter == b""
                if not payload:
                    assert int.from_bytes(seq_bytes, "big", signed=True) == -1
                    return n
                seq = int.from_bytes(seq_bytes, "big")
                assert seq >= start, (seq, start)
                if seq == self.last_seq + 1 and (until is None or seq < until):
                    self.apply(DECODER.decode(payload))
                    self.last_seq = seq
                    n += 1
        finally:
            req.close(0)

    def follow(self, quiet_s: float = 0.3, timeout_s: float = 20.0) -> None:
        """Read until nothing came for ``quiet_s``."""
        deadline = time.monotonic() + timeout_s
        while self.poll(quiet_s):
            assert time.monotonic() < deadline, "the stream never went quiet"

    def close(self) -> None:
        self.sub.close(0)

    # -- the state -------------------------------------------------------------------------
    def apply(self, batch: KVEventBatch) -> None:
        assert batch.data_parallel_rank == 0
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                blocks = self.state.setdefault(ev.medium, {})
                for h in ev.block_hashes:
                    assert h in blocks, f"{ev.medium}: removal of unknown block {h:x}"
                    del blocks[h]
            else:
                self.cleared_states.append({m: dict(b) for m, b in self.state.items()})
                self.state = {}

    def _stored(self, ev: BlockStored) -> None:
        assert ev.lora_id is None and ev.medium in ("GPU", "CPU"), ev
        assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes), ev
        blocks = self.state.setdefault(ev.medium, {})
        parent = ev.parent_block_hash
        assert parent is None or parent in blocks, f"{ev.medium}: parent {parent:x} unknown"
        self.block_sizes.add(ev.block_size)
        size = ev.block_size
        for i, h in enumerate(ev.block_hashes):
            assert 0 <= h < 1 << 64
            blocks[h] = (parent, ev.token_ids[i * size:(i + 1) * size])
            parent = h

    def hashes(self, medium: str = "CPU", state: dict | None = None) -> set[int]:
        return set((self.state if state is None else state).get(medium, {}))

    def tokens_of(self, h: int, medium: str = "CPU", state: dict | None = None) -> list[int]:
        """The whole prefix block ``h`` names: its ancestors' tokens, then its own."""
        blocks = (self.state if state is None else state)[medium]
        out: list[int] = []
        while h is not None:
            parent, tokens = blocks[h]
            out = tokens + out
            h = parent
        return out
