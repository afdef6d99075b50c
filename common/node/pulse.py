"""Heartbeats from outside a long step: a live worker is never declared lost because it
is busy, while a stopped or hung one still is.

A worker's loop sends its heartbeats (``Load`` to the router, ``Heartbeat`` to each KV
peer) between steps. A forward pass that takes longer than the lease (a large prefill
pass on a starved core) would leave them silent, and its peers would declare a live
worker lost. ``Pulse`` lends the loop's sockets to a small thread for the length of each
pass (``ModelRunner.around_pass``):

    loop thread                               pulse thread
    owns the sockets (holds the lock)         sleeps
    computing(): releases the lock   ------>  every tick: takes the lock, sends the
      the forward pass (torch lets the GIL    heartbeats that are due, lets the lock go
      go)
    end of pass: takes the lock back  <-----  (waits for a beat in progress, if any)

ZMQ sockets may be used from any thread as long as two never use one at once; the lock
is that guarantee. A forward pass touches no socket.

What still ends a worker: SIGSTOP or a crash stops this thread with the rest, so its peers
declare it lost after the lease as before. A pass that does not end is treated as hung
once it has run ``max_busy_s``: the pulse stops beating, and the lease runs out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


class Pulse:
    """Beats on a thread of its own while the loop is ``computing``.

    Args:
        name: the worker's name (thread name, logs).
        beat: sends whatever heartbeats are due and returns how many it sent; called on
            the pulse thread, only while the loop computes, with the loop's sockets lent
            to it. Must be quick and must not block.
        tick_s: how often the pulse looks whether a beat is due (a quarter of the
            heartbeat interval keeps every beat within a quarter interval of its time).
        max_busy_s: a pass longer than this is hung: no beats past it.

    Built on the loop's thread, which owns the sockets from then on.
    """

    def __init__(self, name: str, beat: Callable[[], int], tick_s: float,
                 max_busy_s: float) -> None:
        self.name, self._beat = name, beat
        self.tick_s, self.max_busy_s = tick_s, max_busy_s
        self._lock = threading.Lock()
        self._lock.acquire()            # the loop's thread owns the sockets
        self._depth = 0                 # computing() nesting (the loop's thread only)
        self._since = 0.0               # when the outermost computing() began
        self._busy = threading.Event()  # set while the loop computes
        self._closed = threading.Event()
        self.num_sent = 0
        """Heartbeats sent while the loop computed (router and KV peers)."""
        self.num_hung = 0
        """Passes that ran past ``max_busy_s`` (their beats stopped there)."""
        self._warned = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-pulse", daemon=True)
        self._thread.start()

    @contextmanager
    def computing(self, delay_s: float = 0.0) -> Iterator[None]:
        """A forward pass: the sockets are the pulse's until it ends. Nests. ``delay_s``:
        test aid (``debug_step_delay_s``), the pass takes that much longer."""
        if self._depth == 0:
            self._since = time.monotonic()
            self._warned = False
            self._busy.set()
            self._lock.release()
        self._depth += 1
        try:
            if delay_s:
                time.sleep(delay_s)
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._busy.clear()
                self._lock.acquire()

    def _run(self) -> None:
        while not self._closed.is_set():
            self._busy.wait()
            if self._closed.wait(self.tick_s):
                return
            if not self._lock.acquire(blocking=False):
                continue  # the loop is between steps: its own heartbeats go out
            try:
                self._maybe_beat()
            except Exception:  # a beat that fails must not end the pulse
                logger.exception("%s: a heartbeat during a forward pass failed", self.name)
            finally:
                self._lock.release()

    def _maybe_beat(self) -> None:
        if not self._depth:
            return
        busy = time.monotonic() - self._since
        if busy <= self.max_busy_s:
            self.num_sent += self._beat()
        elif not self._warned:
            self._warned = True
            self.num_hung += 1
            logger.error("%s: a forward pass has run %.0f s (max_busy_s %.0f s): treated as hung, "
                         "heartbeats stop; peers declare this worker lost after their "
                         "lease", self.name, busy, self.max_busy_s)

    def close(self) -> None:
        """Stop the thread (the loop's thread keeps the sockets)."""
        self._closed.set()
        self._busy.set()
        self._thread.join(timeout=5.0)
