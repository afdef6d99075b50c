"""Text requests encoded off the router's loop: a few threads, a bounded queue, a deadline.

Encoding a long text (or rendering a chat template) takes seconds: 1.2 MB of text took
the built-in tokenizer 2.4 s, 8 MB 31 s under load. Done in the router's loop, that
stalled every other request and the heartbeats, so workers were declared lost. Here the
loop hands each long text request (``deploy.router.door.LOOP_TEXT_CHARS``; shorter ones
encode in the loop, faster than a hand-off) to ``TextEncoder.start`` and takes the
finished ones from ``TextEncoder.take`` at every turn; the tokenizer itself
(``tokenizers``, Rust) releases the GIL while it encodes (``Tokenizer.encode``), so the
loop runs meanwhile.

Bounds, all from ``ServeConfig``:

- ``encode_threads`` threads encode (started at the first long text);
- at most ``encode_queue`` texts are queued or being encoded; one more is refused at
  once (``Overloaded``), so a flood of texts cannot grow the router's memory;
- a text not encoded within ``encode_timeout_s`` of its submission fails with
  ``EncodeTimeout``. A thread cannot be interrupted mid-encode: it finishes and its
  result is dropped, and it still counts against ``encode_queue`` until then.

Nothing here touches a worker or a pool: a request aborted or failed while its text is
being encoded was never routed, so there is nothing to free (``cancel``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.request import BadRequest
from deploy.router.errors import EncodeFailed, EncodeTimeout, Overloaded

logger = logging.getLogger(__name__)

Key = tuple[bytes, str]
"""(client, label): what a client's abort names."""


@dataclass
class Job:
    """One text request between the router's loop and an encoding thread."""

    key: Key
    run: Callable[[], Any]
    """The encoding itself (runs on a thread)."""
    context: Any
    """What the loop needs to route the request once encoded (the thread ignores it)."""
    t_submit: float
    deadline: float
    result: Any = None
    error: BaseException | None = None
    cancelled: bool = False
    t_done: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class TextEncoder:
    """Encode text requests on ``threads`` daemon threads; the loop polls ``take``.

    Args:
        threads: encoding threads (started at the first text request).
        limit: texts queued or being encoded at most.
        timeout_s: deadline of one text, from ``start``.
    """

    def __init__(self, threads: int, limit: int, timeout_s: float) -> None:
        self.threads, self.limit, self.timeout_s = threads, limit, timeout_s
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._jobs: dict[Key, Job] = {}
        """Jobs the loop has not taken back yet (their label is in flight)."""
        self._running: list[threading.Thread] = []
        self._busy = 0
        """Jobs queued or on a thread, cancelled and timed-out ones included."""
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Text requests waiting for their encoding (what the loop still owes a reply)."""
        return len(self._jobs)

    def __contains__(self, key: Key) -> bool:
        return key in self._jobs

    @property
    def busy(self) -> int:
        """Texts queued or being encoded, abandoned ones included (bounded by ``limit``)."""
        return self._busy

    def start(self, key: Key, run: Callable[[], Any], context: Any, now: float) -> None:
        """Queue ``run`` (the encoding of ``key``'s text); never waits.

        Raises:
            Overloaded: ``limit`` texts are queued or being encoded.
        """
        assert key not in self._jobs, key
        with self._lock:
            if self._busy >= self.limit:
                raise Overloaded(f"the router is encoding {self._busy} texts already (limit "
                                 f"encode_queue={self.limit}); retry later or send token ids")
            self._busy += 1
        job = Job(key, run, context, now, now + self.timeout_s)
        self._jobs[key] = job
        if len(self._running) < self.threads:
            thread = threading.Thread(target=self._work, name=f"pdkv-encode-{len(self._running)}",
                                      daemon=True)  # a stuck encode never holds up exit
            self._running.append(thread)
            thread.start()
        self._queue.put(job)

    def cancel(self, key: Key) -> Job | None:
        """Forget ``key``'s job (aborted by its client); its result, if it still comes,
        is dropped. Returns the job, or None when ``key`` is not being encoded."""
        job = self._jobs.pop(key, None)
        if job is not None:
            job.cancelled = True
        return job

    def cancel_all(self) -> list[Key]:
        """Forget every job (the router shuts down); the keys, to tell their clients."""
        keys = list(self._jobs)
        for key in keys:
            self.cancel(key)
        return keys

    def take(self, now: float) -> list[Job]:
        """Jobs that finished (``result`` or ``error``) or passed their deadline
        (``error`` is an ``EncodeTimeout``), oldest first; each is returned once."""
        out = []
        for key, job in list(self._jobs.items()):
            if job.done.is_set():
                out.append(job)
            elif now >= job.deadline:
                job.cancelled = True   # the thread's late result is dropped
                job.error = EncodeTimeout(f"encoding the text did not finish within "
                                          f"encode_timeout_s={self.timeout_s:g} s")
                out.append(job)
            else:
                continue
            del self._jobs[key]
        return out

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for any job to finish (tests and the loop's idle
        wait); True when one has."""
        end = time.monotonic() + timeout_s
        while True:
            if any(j.done.is_set() for j in self._jobs.values()):
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, 0.002))

    def close(self) -> None:
        """Stop the threads once they finish what they encode (they are daemons: a
        process that exits does not wait for them)."""
        for _ in self._running:
            self._queue.put(None)
        self._jobs.clear()

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                if job.cancelled:
                    pass
                elif time.monotonic() >= job.deadline:   # it waited out its deadline queued
                    job.error = EncodeTimeout(f"the text waited past encode_timeout_s="
                                              f"{self.timeout_s:g} s for an encoding thread")
                else:
                    job.result = job.run()
            except BadRequest as exc:
                job.error = exc
            except Exception as exc:  # a tokenizer bug fails this request, not the router
                logger.exception("router: encoding %r failed", job.key[1])
                job.error = EncodeFailed(f"encoding the text failed: {exc}")
            finally:
                job.t_done = time.monotonic()
                with self._lock:
                    self._busy -= 1
                job.done.set()
