"""One request's life at the front door: submit, follow its tokens, stop, end.

The router streams token ids; a ``Generation`` turns them into ``Delta`` values (ids, and
text when the model has a tokenizer), ends the output at a stop token id or stop string
that the workers do not know about (and aborts the rest of the request on the router, as
vLLM's output processor does), and remembers the finish reason and usage. Whatever way it
ends (the client leaves, the server shuts down), ``close`` makes sure the router,
prefill and decode stop working on it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from deploy.http.bridge import Event, RouterBridge
from deploy.http.text import TextStream
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
    text: TextStream | None = None
    """The output's text (None: the model serves token ids only)."""
    rid: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str = ""
    """Why the request failed (finish_reason stays None), e.g. a worker was lost."""
    failed_reason: str = ""
    cached_tokens: int = 0
    t_first: float = 0.0
    _queue: asyncio.Queue[Event] | None = None

    def start(self) -> None:
        """Submit to the router (raises ``RouterDown``)."""
        self._queue = self.bridge.submit(self.rid, self.plan.prompt, self.plan.params)

    @property
    def waiting(self) -> bool:
        """Submitted, no token yet (queued at the router or a worker, or prefilling)."""
        return not self.t_first and not self.ended

    @property
    def ended(self) -> bool:
        return self.finish_reason is not None or bool(self.failed_reason)

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
            event = await self._queue.get()
            if event.ids:
                self.t_first = self.t_first or time.monotonic()
                delta = self._on_ids(event.ids)
                if delta.ids or delta.text or delta.finish_reason:
                    yield delta
            if event.done and not self.ended:
                self.cached_tokens = event.cached_tokens
                if event.reason in _FINISH:
                    tail, hit = self.text.finish() if self.text is not None else ("", False)
                    self.finish_reason = "stop" if hit else _FINISH[event.reason]
                    yield Delta([], tail, self.finish_reason)
                else:
                    self.failed_reason, self.error = event.reason, event.error

    def _on_ids(self, ids: list[int]) -> Delta:
        stop_at = next((i for i, t in enumerate(ids) if t in self.plan.stop_ids), None)
        if stop_at is not None:
            ids = ids[:stop_at + 1]
        text_ids = ids[:-1] if stop_at is not None else ids  # a stop id's text is not shown
        text, hit = "", False
        if self.text is not None and text_ids:
            taken, text, hit = self.text.feed(text_ids)
            ids = ids[:taken] if hit else ids
        self.ids.extend(ids)
        if stop_at is not None or hit:
            self._finish_here("stop")
            return Delta(ids, text, "stop")
        return Delta(ids, text)

    def _finish_here(self, reason: str) -> None:
        """The front door ended the output: stop the workers too."""
        self.finish_reason = reason
        self.bridge.abort(self.rid)

    def close(self) -> None:
        """The response is over (sent, or the client left): abort what still runs."""
        if not self.ended:
            self.bridge.abort(self.rid)

    def usage(self) -> dict:
        n_prompt, n_out = len(self.plan.prompt), len(self.ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                "total_tokens": n_prompt + n_out,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
