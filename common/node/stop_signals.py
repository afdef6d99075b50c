"""SIGTERM and SIGINT stop a worker process, but never in the middle of a step; a serving
worker takes its first SIGTERM as "drain" instead.

A signal handler raises where the main thread happens to be. Raised inside a step, the
exit can cut a cache operation or a tensor-parallel broadcast in two: rank 0 of a group
that took its pending ops for a step and never sent them closes with its followers still
holding pages rank 0 freed (their free logs then report a leak, rightly). So while a step
runs (``held``) a signal is only noted, and the step ends before the exit is raised; at
any other moment (building, registering, an idle wait) it is raised at once, as before.

A worker that serves installs a drain hook (``drain_with``): its first SIGTERM only calls
the hook (the worker stops taking requests, ends what it holds, then exits cleanly:
docs/operations.md, "Draining"); a second SIGTERM, or SIGINT, stops it as above.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_STOPS = (signal.SIGTERM, signal.SIGINT)
_held = False
_pending: int | None = None
_drain: Callable[[], None] | None = None


def _exit(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)


def _on_signal(signum: int, _frame) -> None:
    global _pending, _drain
    if signum == signal.SIGTERM and _drain is not None:
        hook, _drain = _drain, None   # once: the next SIGTERM stops the process
        hook()
        return
    if not _held:
        raise _exit(signum)
    if _pending is None:
        _pending = signum


def install() -> None:
    """Make SIGTERM and SIGINT stop this process (``SystemExit(143)``,
    ``KeyboardInterrupt``), deferred while a step is ``held``. Main thread only."""
    for sig in _STOPS:
        signal.signal(sig, _on_signal)


def drain_with(hook: Callable[[], None] | None) -> None:
    """The next SIGTERM calls ``hook`` (in the main thread, between two bytecodes: it
    should only note the request) instead of stopping; ``None`` removes it."""
    global _drain
    _drain = hook


@contextmanager
def held() -> Iterator[None]:
    """Run a step whole: a stop signal that comes meanwhile is raised when it ends.

    A no-op off the main thread (signals are only handled there) and when nested."""
    global _held, _pending
    if _held or threading.current_thread() is not threading.main_thread():
        yield
        return
    _held = True
    try:
        yield
    finally:
        _held = False
        signum, _pending = _pending, None
        if signum is not None:
            raise _exit(signum)
