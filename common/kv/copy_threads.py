"""Helper threads of the page copier (``common.kv.copy_pages``): how many threads a large
CPU copy is shared over, and the small pool that runs the shares.

A copy is cut into pieces that the caller and up to ``copy_threads() - 1`` helpers take
in turn; a helper that has not started when the caller runs out of pieces is taken back,
so no copy ever waits for a thread the machine has not scheduled yet.

A thread that only waits for a copy another thread runs (the host tier's ``CopyJob.wait``)
may join it (``offering``): it takes a helper's place whose task has not started, so the
copy never runs on more than ``copy_threads()`` threads, and a waiter that is already
awake copies instead of sleeping while a helper thread is woken for the same share.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import threading
from collections.abc import Callable, Iterator

MAX_COPY_THREADS = 4  # memory bandwidth, not cores, bounds a copy beyond a few threads

_threads = min(MAX_COPY_THREADS, len(os.sched_getaffinity(0)))
_pool: _Helpers | None = None
_pool_lock = threading.Lock()
_offer = threading.local()   # .hook: called with each Share this thread starts


class _Task:
    """One call handed to a helper thread; the caller may take it back until it starts."""

    def __init__(self, fn: Callable, args: tuple):
        self.fn, self.args = fn, args
        self.value: object = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._state = "queued"     # -> "running" -> "done", or -> "cancelled"
        self._done = threading.Event()

    def start(self) -> bool:
        with self._lock:
            if self._state != "queued":
                return False
            self._state = "running"
            return True

    def cancel(self) -> bool:
        """True when the task had not started (and now never will)."""
        with self._lock:
            if self._state == "queued":
                self._state = "cancelled"
                self._done.set()
            return self._state == "cancelled"

    def finish(self) -> None:
        with self._lock:
            self._state = "done"
        self._done.set()

    def run(self) -> None:
        """Run the task here (after a successful ``start``); an error is kept for the
        task's owner, never raised in the thread that ran it."""
        try:
            self.value = self.fn(*self.args)
        except BaseException as exc:  # handed to the caller, never lost
            self.error = exc
        self.finish()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        """Until it finished or was cancelled; a running copy always ends, so no deadline."""
        self._done.wait()

    def result(self, timeout: float | None = None) -> object:
        if not self._done.wait(timeout):
            raise TimeoutError("page copy helper still running")
        if self.error is not None:
            raise self.error
        return self.value


class _Helpers:
    """Helper threads of the page copier: a ``SimpleQueue`` of tasks (its ``put`` costs far
    less than ``ThreadPoolExecutor.submit``, which took a fifth of a decode's frame-landing
    loop in a profile), daemon threads."""

    def __init__(self, n: int):
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"kv-page-copy_{i}",
                                          daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable, *args) -> _Task:
        task = _Task(fn, args)
        self._tasks.put(task)
        return task

    def shutdown(self) -> None:
        for _ in self._threads:
            self._tasks.put(None)
        for t in self._threads:
            t.join()

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            if task.start():   # else its caller (or a joining waiter) did it already
                task.run()


def copy_threads() -> int:
    """Threads a large CPU page copy is shared out over (the caller's included)."""
    return _threads


def set_copy_threads(n: int) -> None:
    """Share large CPU page copies over ``n`` threads (1: the caller's thread only).

    Raises:
        ValueError: ``n`` < 1.
    """
    global _threads, _pool
    if n < 1:
        raise ValueError(f"copy threads {n}: need at least 1")
    with _pool_lock:
        _threads = n
        old, _pool = _pool, None
    if old is not None:
        old.shutdown()


def _helpers() -> _Helpers:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _Helpers(max(1, _threads - 1))
        return _pool


def _forget_pool_after_fork() -> None:
    # a forked child has none of the parent's threads: its pool would never run a task
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


class CopyShare:
    """One copy in progress: its pieces, taken in turn by the thread that started it, its
    helpers and any thread that ``join``s it."""

    def __init__(self, pieces: list, copy: Callable[[object], None]):
        self.pieces, self.copy = pieces, copy
        self._taken = itertools.count()  # next() on a count is atomic under the GIL
        self.tasks: list[_Task] = []

    def work(self) -> None:
        while (i := next(self._taken)) < len(self.pieces):
            self.copy(self.pieces[i])

    def join(self) -> bool:
        """Take the place of a helper that has not started (its task runs here, and the
        copy's owner waits for it as for the helper); False when every helper has started
        or the copy ended (nothing is copied here then)."""
        for task in self.tasks:
            if task.start():
                task.run()
                return True
        return False


@contextlib.contextmanager
def offering(hook: Callable[[CopyShare], None]) -> Iterator[None]:
    """While the block runs, every copy this thread shares out over helpers is first
    handed to ``hook`` (which must not block), so that a waiting thread may ``join`` it."""
    before = getattr(_offer, "hook", None)
    _offer.hook = hook
    try:
        yield
    finally:
        _offer.hook = before


def run_pieces(pieces: list, copy: Callable[[object], None]) -> None:
    """``copy`` every piece: this thread and up to ``copy_threads() - 1`` helpers (or
    threads that joined in their place) take the next piece until none is left. Returns
    once every piece is copied and nothing still writes; re-raises the first error then."""
    if len(pieces) < 2:
        for piece in pieces:
            copy(piece)
        return
    share = CopyShare(pieces, copy)
    pool = _helpers()
    share.tasks = [pool.submit(share.work) for _ in range(min(_threads, len(pieces)) - 1)]
    hook = getattr(_offer, "hook", None)
    if hook is not None:
        hook(share)
    try:
        share.work()
    finally:
        # a helper that has not started finds nothing left: take its task back
        running = [t for t in share.tasks if not t.cancel()]
        for t in running:
            t.wait()
    for t in running:
        if t.error is not None:
            raise t.error
