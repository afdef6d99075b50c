"""A worker's KV events publisher: vLLM's ZMQ contract, a PUB socket and a replay socket.

Every batch goes out on the PUB socket as a three-frame message::

    (topic, seq, payload)   seq: 8 bytes big-endian, 0 for the first batch, +1 per batch
                            payload: wire.encode_batch (vLLM's msgpack EventBatch)

and is kept in a ring of the last ``buffer_steps`` batches. A subscriber that missed
batches (a gap in ``seq``, or it joined late) asks the replay ROUTER socket with one frame,
the first wanted ``seq`` (8 bytes, big-endian; a REQ socket adds the empty delimiter), and
gets every buffered batch from there as ``(seq, payload)`` messages, then
``(END_SEQ, b"")`` (``seq`` -1). A request older than the ring gets what the ring holds:
the first ``seq`` it receives then shows the subscriber what it lost.

``publish`` only appends to a queue: the worker's loop never encodes, hashes or touches a
socket for its events. One thread owns both sockets and does all of that, batching
whatever events have queued since its last batch. With deployment keys both sockets are
CURVE servers of the events plane (``common.auth.events_server``); without them they bind
only loopback or a private ipc path (``common.auth.check_bind``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import zmq

from common.auth import INSECURE, PlaneAuth
from common.kv_events.wire import END_SEQ, Event, EventBatch, encode_batch, seq_bytes, seq_of

logger = logging.getLogger(__name__)
_STOP = object()
_WAIT_S = 0.05
"""The thread's longest wait for an event: how soon a replay request is answered when no
event comes meanwhile."""


class PendingEvent(Protocol):
    """What ``publish`` takes: an event, or something that becomes events on the thread
    (hashing and token lists are built there, off the caller's loop)."""

    def events(self) -> list[Event]: ...


def replay_address(endpoint: str) -> str:
    """The replay socket's default address beside ``endpoint``: the next TCP port (vLLM's
    5557/5558 pair; a wildcard port stays a wildcard), or ``<path>.replay`` for ipc."""
    scheme, _, rest = endpoint.partition("://")
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        return f"tcp://{host}:{port}" if port == "*" else f"tcp://{host}:{int(port) + 1}"
    if scheme == "ipc":
        return f"ipc://{rest}.replay"
    raise ValueError(f"KV events endpoint {endpoint!r}: give tcp://HOST:PORT or ipc://PATH")


class EventPublisher:
    """Publishes KV event batches on a PUB socket, with a replay socket beside it.

    Args:
        endpoint: where the PUB socket binds (``tcp://127.0.0.1:5557``, ``ipc://PATH``).
        replay_endpoint: where the replay ROUTER socket binds (default
            ``replay_address(endpoint)``).
        auth: the events plane's server side (``common.auth.events_server``).
        ctx: the ZMQ context (the worker's); a new one when None.
        topic: the first frame of every message.
        buffer_steps: batches kept for replay (vLLM's default).
        max_batch: most events in one batch.
        hwm: the PUB socket's high-water mark (past it a slow subscriber loses batches
            and catches up through replay).

    Raises:
        InsecureBind: no ``auth`` and an address others could reach.
        zmq.ZMQError: an address that cannot be bound (in use, say).
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None,
                 auth: PlaneAuth = INSECURE, *, ctx: zmq.Context | None = None,
                 topic: str = "", buffer_steps: int = 10_000, max_batch: int = 1024,
                 hwm: int = 100_000) -> None:
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.topic, self.max_batch = topic.encode(), max_batch
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._guards = []
        self._pub = self._replay = None
        try:
            self._pub = self._bind(zmq.PUB, endpoint, auth, hwm, max_msg=4096)
            # a replay may send the whole ring at once: its high-water mark holds it
            self._replay = self._bind(zmq.ROUTER, replay_endpoint or replay_address(endpoint),
                                      auth, buffer_steps + 16, max_msg=4096)
        except BaseException:
            self._close_sockets(0)
            raise
        self.address = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_address = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.next_seq = 0
        self.num_events = self.num_replays = self.num_errors = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _bind(self, kind: int, address: str, auth: PlaneAuth, hwm: int,
              max_msg: int = -1) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg)  # not below a CURVE handshake's commands
        try:
            self._guards.append(auth.serve(sock, address))
        except BaseException:
            sock.close(0)
            raise
        return sock

    # -- the caller's side: appends only -------------------------------------------------
    def publish(self, event: Event | PendingEvent) -> None:
        """Queue ``event`` for the next batch (never blocks, never touches a socket)."""
        self._queue.put(event)

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued, then close both sockets (their last batches get up to
        ``timeout_s`` to leave)."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout_s + 1.0)
        if self._thread.is_alive():
            logger.error("KV events thread did not stop within %.1f s", timeout_s + 1.0)
            return
        self._close_sockets(int(timeout_s * 1000))

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every event queued before this call went out (tests, shutdown)."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout_s)

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            stopping = False
            while not stopping:
                self._serve_replays()
                try:
                    item = self._queue.get(timeout=_WAIT_S)
                except queue.Empty:
                    continue
                events, stopping = self._drain(item)
                if events:
                    self._send(events)
            self._serve_replays()
        except zmq.ZMQError as exc:  # the context went away under us (a failed close)
            logger.warning("KV events thread stopped: %s", exc)

    def _drain(self, item: object) -> tuple[list[Event], bool]:
        """The events queued now (up to ``max_batch``), and whether to stop after them."""
        events: list[Event] = []
        while True:
            if item is _STOP:
                return events, True
            if isinstance(item, threading.Event):  # flush: set once these are sent
                if events:
                    self._send(events)
                    events = []
                item.set()
            else:
                events.extend(self._expand(item))
            if len(events) >= self.max_batch:
                return events, False
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return events, False

    def _expand(self, item: object) -> list[Event]:
        try:
            return item.events() if hasattr(item, "events") else [item]
        except Exception:  # a bad pending event costs itself, never the thread
            self.num_errors += 1
            logger.exception("KV events: an event could not be built")
            return []

    def _send(self, events: list[Event]) -> None:
        seq = self.next_seq
        try:
            payload = encode_batch(EventBatch(time.time(), events, 0))
            self._pub.send_multipart((self.topic, seq_bytes(seq), payload))
        except Exception:  # logged and counted; the ring keeps order for replay
            self.num_errors += 1
            logger.exception("KV events: batch %d not sent", seq)
            return
        self._ring.append((seq, payload))
        self.next_seq, self.num_events = seq + 1, self.num_events + len(events)

    def _serve_replays(self) -> None:
        while self._replay.poll(0):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            self._serve_replay(frames)

    def _serve_replay(self, frames: list[bytes]) -> None:
        """``[identity, b"", start]`` (REQ) or ``[identity, start]`` (DEALER): every
        buffered batch from ``start``, then the end marker."""
        ident, start = frames[0], frames[-1]
        delim = [b""] if len(frames) == 3 and frames[1] == b"" else []
        try:
            first = seq_of(start)
        except ValueError:
            self.num_errors += 1
            logger.warning("KV events: replay request of %d frames refused", len(frames))
            first = self.next_seq  # answer with the end marker alone: nobody hangs
        self.num_replays += 1
        send: Callable = self._replay.send_multipart
        for seq, payload in list(self._ring):
            if seq >= first:
                send([ident, *delim, seq_bytes(seq), payload])
        send([ident, *delim, END_SEQ, b""])

    def _close_sockets(self, linger_ms: int) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger_ms)
        for guard in self._guards:
            guard.close()
        self._guards = []
        if self._own_ctx:
            self.ctx.term()
