"""Following many publishers at once: one thread, one ``EventStream`` per publisher.

The router subscribes to every worker's events through one ``EventFeed``. Its thread owns
every socket; ``add`` and ``remove`` only queue a command, so the caller's loop never
waits on a publisher. Each stream's items (``(seq, EventBatch)`` or ``Lost``) go, in
order, to ``on_item(name, item)`` on the feed's thread: whatever it updates must be
safe to read from other threads (the router's index takes a lock).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import zmq

from common.auth import INSECURE, PlaneAuth
from common.kv_events.subscriber import EventStream, Lost
from common.kv_events.wire import EventBatch

logger = logging.getLogger(__name__)
_POLL_MS = 50

OnItem = Callable[[str, "tuple[int, EventBatch] | Lost"], None]


class EventFeed:
    """Streams of many publishers, by name, read on one thread.

    Args:
        on_item: gets every stream's items in order, on the feed's thread.
        replay_timeout_s, resync_s: each stream's (``EventStream``).
    """

    def __init__(self, on_item: OnItem, *, replay_timeout_s: float = 2.0,
                 resync_s: float = 1.0) -> None:
        self.on_item = on_item
        self.replay_timeout_s, self.resync_s = replay_timeout_s, resync_s
        self.ctx = zmq.Context()
        self.streams: dict[str, EventStream] = {}
        self.failures: dict[str, str] = {}
        """Publishers that could not be followed, and why (a bad address, say)."""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kv-events-feed", daemon=True)
        self._thread.start()

    def add(self, name: str, endpoint: str, replay_endpoint: str,
            auth: PlaneAuth = INSECURE) -> None:
        """Follow ``name``'s publisher (again from its first batch, if it was followed)."""
        self._commands.put(("add", name, endpoint, replay_endpoint, auth))

    def remove(self, name: str) -> None:
        """Stop following ``name``."""
        self._commands.put(("remove", name))

    def stats(self) -> dict[str, dict[str, int]]:
        """Per publisher: batches delivered, gaps seen, batches lost, replays asked."""
        return {name: {"batches": s.num_batches, "gaps": s.num_gaps, "lost": s.num_lost,
                       "replays": s.num_replays}
                for name, s in list(self.streams.items())}

    def sync(self, timeout_s: float = 5.0) -> bool:
        """Wait until the commands queued before this call were carried out and every
        stream was read once after them (tests)."""
        done = threading.Event()
        self._commands.put(("sync", done))
        return done.wait(timeout_s)

    def close(self) -> None:
        self._stopping = True
        self._thread.join(5.0)
        for stream in self.streams.values():
            stream.close()
        self.streams.clear()
        self.ctx.term()

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        while not self._stopping:
            synced = self._commands_due(poller)
            try:
                poller.poll(_POLL_MS if not synced else 0)
            except zmq.ZMQError:
                pass
            for name, stream in list(self.streams.items()):
                self._read(name, stream)
            for done in synced:
                done.set()

    def _commands_due(self, poller: zmq.Poller) -> list[threading.Event]:
        synced = []
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return synced
            if cmd[0] == "sync":
                synced.append(cmd[1])
                continue
            self._drop(cmd[1], poller)
            if cmd[0] == "add":
                self._follow(poller, *cmd[1:])

    def _follow(self, poller: zmq.Poller, name: str, endpoint: str, replay: str,
                auth: PlaneAuth) -> None:
        try:
            stream = EventStream(self.ctx, endpoint, replay, auth,
                                 replay_timeout_s=self.replay_timeout_s,
                                 resync_s=self.resync_s)
        except (zmq.ZMQError, ValueError) as exc:
            self.failures[name] = str(exc)
            logger.error("KV events of %s at %s cannot be followed: %s", name, endpoint, exc)
            return
        self.failures.pop(name, None)
        self.streams[name] = stream
        poller.register(stream.sub, zmq.POLLIN)

    def _drop(self, name: str, poller: zmq.Poller) -> None:
        stream = self.streams.pop(name, None)
        if stream is not None:
            poller.unregister(stream.sub)
            stream.close()

    def _read(self, name: str, stream: EventStream) -> None:
        try:
            items = stream.receive()
        except zmq.ZMQError as exc:
            logger.warning("KV events of %s: %s", name, exc)
            return
        for item in items:
            try:
                self.on_item(name, item)
            except Exception:  # one bad batch costs itself, never the feed
                logger.exception("KV events of %s: batch not applied", name)
