"""A subscriber of one publisher's KV events: in order, gaps filled from its replay socket.

``EventStream`` keeps the next ``seq`` it expects. A live batch with a larger ``seq`` (the
PUB socket dropped some, or this subscriber joined late) makes it ask the replay socket
for everything from the expected one; a smaller one was delivered already and is dropped.
It also replays from the start when it is created (so it learns what the publisher
cached before it connected) and whenever the stream has been quiet for ``resync_s`` (a
lost batch followed by silence would otherwise go unnoticed). Batches the publisher's
ring no longer holds are lost for good: ``receive`` says so with a ``Lost`` item, and
whoever rebuilds state from the stream must start over from the next ``AllBlocksCleared``
or treat that publisher's state as incomplete.

The replay socket is a DEALER that frames its requests as a REQ would
(``[b"", seq]``), so one request may stream many answers and a late answer to an earlier
request never wedges it; each replay waits at most ``replay_timeout_s``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import zmq

from common.auth import INSECURE, PlaneAuth
from common.kv_events.wire import (
    END_SEQ,
    EventBatch,
    EventsFormatError,
    decode_batch,
    seq_bytes,
    seq_of,
)

logger = logging.getLogger(__name__)
_UNANSWERED_BACKOFF_S = 10.0


@dataclass(frozen=True)
class Lost:
    """Batches ``[first, first + count)`` never arrived and replay cannot bring them (or
    one arrived undecodable): state rebuilt from this stream may be incomplete."""

    first: int
    count: int


class EventStream:
    """One publisher's batches, in ``seq`` order.

    Args:
        ctx: the ZMQ context.
        endpoint: the publisher's PUB address.
        replay_endpoint: its replay socket's address.
        auth: the events plane's client side (``common.auth.events_client``).
        topic: the topic to subscribe to (b"": every batch).
        replay_timeout_s: longest wait for one replay's answers.
        resync_s: replay from the expected ``seq`` after this long without a batch.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str,
                 auth: PlaneAuth = INSECURE, *, topic: bytes = b"",
                 replay_timeout_s: float = 2.0, resync_s: float = 1.0) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.replay_timeout_s, self.resync_s = replay_timeout_s, resync_s
        self.ctx, self.auth = ctx, auth
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._replay: zmq.Socket | None = None
        try:
            auth.connect(self.sub, endpoint)
            self._connect_replay()
        except BaseException:
            self.close()
            raise
        self.next_seq = 0
        """The ``seq`` this stream delivers next."""
        self.num_batches = self.num_gaps = self.num_lost = self.num_replays = 0
        self._last_heard = 0.0  # never: the first receive replays from 0

    def receive(self) -> list[tuple[int, EventBatch] | Lost]:
        """Every batch due now, in order (live ones, a gap's replay before them)."""
        out: list[tuple[int, EventBatch] | Lost] = []
        if time.monotonic() - self._last_heard >= self.resync_s:
            self._fill(None, out)
        while self.sub.poll(0):
            frames = self.sub.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or len(frames[1]) != 8:
                logger.warning("KV events from %s: a message of %d frames dropped",
                               self.endpoint, len(frames))
                continue
            seq = seq_of(frames[1])
            if seq < self.next_seq:
                continue  # replayed already
            if seq > self.next_seq:
                self.num_gaps += 1
                self._fill(seq, out)
            if seq == self.next_seq:
                self._deliver(seq, frames[2], out)
        return out

    def _fill(self, until: int | None, out: list) -> None:
        """Replay from ``next_seq`` (up to ``until``, exclusive, when given); what the
        publisher no longer holds below ``until`` is reported ``Lost``."""
        self.num_replays += 1
        self._last_heard = time.monotonic()
        self._replay.send_multipart([b"", seq_bytes(self.next_seq)])
        deadline = time.monotonic() + self.replay_timeout_s
        while (left := deadline - time.monotonic()) > 0 and self._replay.poll(left * 1000):
            frames = self._replay.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or len(frames[1]) != 8:
                continue
            seq = seq_of(frames[1])
            if frames[1] == END_SEQ:
                break
            if seq > self.next_seq and (until is None or seq <= until):
                self._lose(seq - self.next_seq, out)  # the ring starts past what we need
            if seq == self.next_seq and (until is None or seq < until):
                self._deliver(seq, frames[2], out)
        else:
            logger.warning("KV events from %s: replay from %d unanswered in %.1f s",
                           self.endpoint, self.next_seq, self.replay_timeout_s)
            self._connect_replay()  # a late answer must not end the next replay early
            # a publisher that does not answer is not asked again soon: whoever reads
            # several streams in one thread must not wait on it every resync
            self._last_heard = time.monotonic() + _UNANSWERED_BACKOFF_S
        if until is not None and self.next_seq < until:
            self._lose(until - self.next_seq, out)

    def _deliver(self, seq: int, payload: bytes, out: list) -> None:
        self._last_heard = time.monotonic()
        self.next_seq = seq + 1
        try:
            out.append((seq, decode_batch(payload)))
            self.num_batches += 1
        except EventsFormatError as exc:
            logger.warning("KV events from %s: batch %d undecodable: %s", self.endpoint,
                           seq, exc)
            self.num_lost += 1
            out.append(Lost(seq, 1))

    def _lose(self, count: int, out: list) -> None:
        logger.warning("KV events from %s: batches %d..%d are lost (past the publisher's "
                       "replay ring)", self.endpoint, self.next_seq, self.next_seq + count - 1)
        out.append(Lost(self.next_seq, count))
        self.num_lost += count
        self.next_seq += count

    def _connect_replay(self) -> None:
        if self._replay is not None:
            self._replay.close(0)
        self._replay = self.ctx.socket(zmq.DEALER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self.auth.connect(self._replay, self.replay_endpoint)

    def close(self) -> None:
        self.sub.close(0)
        if self._replay is not None:
            self._replay.close(0)
