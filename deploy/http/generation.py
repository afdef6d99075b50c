"""One request's life at the front door: submit, its answer, follow its output, end.

The router streams token ids with their text, already cut at stop strings and stop ids
(``deploy.router.text_route``); a ``Generation`` turns its messages into ``Delta``
values and remembers the finish reason and usage. Its first message decides the HTTP
answer (``opened``): tokens, or the router's refusal, which becomes the HTTP error of
its code (``deploy.http.errors.refusal``). Whatever way it ends (the client leaves, the
server shuts down), ``close`` makes sure the router, prefill and decode stop working on
it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from deploy.http.bridge import Event, RouterBridge
from deploy.http.errors import refusal
from deploy.http.translate import Plan

# router reasons -> OpenAI finish_reason; anything else is a failure of the request
_FINISH = {"stop": "stop", "length": "length", "aborted": "abort"}


@dataclass
class Delta:
    ids: list[int]
    text: str
    finish_reason: str | None = None


@dataclass(eq=False)
class Generation:
    bridge: RouterBridge
    plan: Plan
    rid: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str = ""
    """Why the request failed (finish_reason stays None), e.g. a worker was lost."""
    failed_reason: str = ""
    cached_tokens: int = 0
    prompt_tokens: int = 0
    prompt_ids: list[int] = field(default_factory=list)
    t_first: float = 0.0
    _queue: asyncio.Queue[Event] | None = None
    _held: Event | None = None
    """The first event, taken by ``opened`` and handed to ``deltas`` next."""

    def start(self) -> None:
        """Submit to the router (raises ``RouterDown``)."""
        self._queue = self.bridge.submit(self.plan.submit(self.rid))

    @property
    def waiting(self) -> bool:
        """Submitted, no token yet (queued at the router or a worker, or prefilling)."""
        return not self.t_first and not self.ended

    @property
    def ended(self) -> bool:
        return self.finish_reason is not None or bool(self.failed_reason)

    async def opened(self) -> None:
        """Wait for the router's first word on the request.

        Raises:
            ApiError: the router refused it (the status of its code).
        """
        assert self._queue is not None, "start() first"
        self._held = await self._queue.get()
        if self._held.reason == "refused":
            self.failed_reason = "refused"
            event = self._held
            raise refusal(event.code, event.error, self.plan.field_of(event.param)
                          if event.param else None)

    def interrupt(self, error: str) -> None:
        """End the request from the front door's side (shutdown): the next delta fails."""
        if self._queue is not None and not self.ended:
            self.bridge.abort(self.rid)
            self._queue.put_nowait(Event(done=True, reason="error", error=error))

    async def deltas(self) -> AsyncIterator[Delta]:
        """Output as it comes; the last delta has ``finish_reason`` unless it failed
        (then ``failed_reason`` and ``error`` say why and the iteration just ends)."""
        assert self._queue is not None, "start() first"
        while not self.ended:
            event, self._held = self._held or await self._queue.get(), None
            self.prompt_tokens = event.prompt_tokens or self.prompt_tokens
            if event.ids or event.text:
                self.t_first = self.t_first or time.monotonic()
                self.ids.extend(event.ids)
                yield Delta(event.ids, event.text)
            if event.done and not self.ended:
                self.cached_tokens, self.prompt_ids = event.cached_tokens, event.prompt_ids
                if event.reason in _FINISH:
                    self.finish_reason = _FINISH[event.reason]
                    yield Delta([], "", self.finish_reason)
                else:
                    self.failed_reason, self.error = event.reason, event.error

    def close(self) -> None:
        """The response is over (sent, or the client left): abort what still runs."""
        if not self.ended:
            self.bridge.abort(self.rid)

    def usage(self) -> dict:
        n_prompt, n_out = self.prompt_tokens, len(self.ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                "total_tokens": n_prompt + n_out,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
