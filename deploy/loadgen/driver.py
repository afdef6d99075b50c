"""Drive a workload through a router: send at arrival times, collect streamed results.

Used by ``pdkv run``, ``pdkv bench serve`` and the end-to-end tests. Timing is measured
here, at the client: TTFT = first token received - submitted; TPOT = (last token - first
token) / (tokens - 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common.control import Done, Error, Malformed, Message, Tokens
from deploy.loadgen.workload import WorkRequest
from deploy.router.client import Client


@dataclass
class Result:
    """What the client saw of one request."""

    rid: str
    prompt_len: int
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    """Text requests: the streamed text pieces joined (equal to ``final_text``)."""
    final_text: str = ""
    """Text requests: the output text in the router's ``Done``."""
    prompt_tokens: int = 0
    """Tokens of the prompt as the router encoded it."""
    reason: str = ""
    """stop, length, aborted, error, timeout, peer_lost; empty while in flight."""
    error: str = ""
    t_submit: float = 0.0
    t_tokens: list[float] = field(default_factory=list)
    """When each message with tokens arrived: a speculative step streams several tokens
    in one, so the gaps are the inter-token latencies a streaming client sees."""
    t_done: float = 0.0
    xfer_s: float = 0.0
    """Last prefill chunk computed -> the decode holds all KV and the first token (wall
    clocks of both hosts; 0 colocated)."""
    kv_bytes: int = 0
    migrations: int = 0
    """How often the router moved the request to other workers (a worker died or
    drained); its tokens are those of a run without the move."""
    cached_tokens: int = 0
    """Prompt tokens a worker's host tier supplied (the router's ``Done``)."""

    @property
    def ok(self) -> bool:
        return self.reason in ("stop", "length")

    @property
    def t_first(self) -> float:
        return self.t_tokens[0] if self.t_tokens else 0.0

    @property
    def t_last(self) -> float:
        """When the last token arrived (``done`` may follow later)."""
        return self.t_tokens[-1] if self.t_tokens else 0.0

    @property
    def ttft_s(self) -> float:
        return self.t_first - self.t_submit if self.t_first else 0.0

    @property
    def tpot_s(self) -> float:
        n = len(self.output_ids)
        return (self.t_last - self.t_first) / (n - 1) if n > 1 and self.t_first else 0.0

    def to_json(self) -> dict:
        return {"rid": self.rid, "output_ids": self.output_ids, "text": self.final_text,
                "prompt_len": self.prompt_len or self.prompt_tokens,
                "max_new_tokens": self.max_new_tokens, "reason": self.reason,
                "error": self.error, "ttft_s": round(self.ttft_s, 6),
                "tpot_s": round(self.tpot_s, 6), "xfer_s": round(self.xfer_s, 6),
                "kv_bytes": self.kv_bytes}


def drive(client: Client, requests: list[WorkRequest], *, params: dict | None = None,
          aborts: dict[str, float] | None = None, abort_after_tokens: dict[str, int] | None = None,
          check: Callable[[], None] | None = None,
          progress: Callable[[int, int], None] | None = None,
          timeout_s: float = 600.0, lease_s: float = 10.0,
          into: dict[str, Result] | None = None) -> dict[str, Result]:
    """Send ``requests`` at their arrival times and wait for every result.

    Args:
        params: extra sampling parameters for every request.
        aborts: rid -> seconds after its submission at which the client aborts it.
        abort_after_tokens: rid -> the client aborts it once this many tokens arrived.
        check: called every loop (the launcher's liveness check raises when a worker died).
        progress: called with (done, total) when a request completes.
        lease_s: the router silent this long (it is pinged meanwhile) is lost: every
            unfinished request ends with reason ``error`` (``router_lost`` says so).
        into: the dict to fill with results as they arrive (the caller keeps what had
            finished when ``check`` or the deadline raised); a new one when None.
    Raises:
        TimeoutError: not every request ended within ``timeout_s``.
    """
    run = client.ping(lease_s)       # the router incarnation these requests go to
    session = _Session(client, requests, params or {}, dict(aborts or {}),
                       dict(abort_after_tokens or {}), {} if into is None else into)
    deadline = session.t0 + timeout_s
    while session.done < len(requests):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(requests) - session.done} requests unfinished after "
                               f"{timeout_s}s")
        session.step(progress)
        silent = client.keep_alive(lease_s / 4)
        if silent > lease_s:
            session.router_lost(f"the router at {client.address} has been silent for "
                                f"{silent:.1f} s (lease {lease_s:g} s): it died or is "
                                "unreachable")
        elif client.run != run:
            session.router_lost(f"the router at {client.address} restarted; the requests "
                                "it held are gone")
        if check is not None:
            check()
    return session.results


def router_lost(results: dict[str, Result]) -> str:
    """The error of requests that ended because the router went away ('' if none)."""
    return next((r.error for r in results.values() if r.error.startswith(_LOST)), "")


_LOST = "router lost: "


class _Session:
    """One ``drive`` call's state: what was sent, what came back, aborts still due."""

    def __init__(self, client: Client, requests: list[WorkRequest], params: dict,
                 aborts: dict[str, float], after_tokens: dict[str, int],
                 results: dict[str, Result]) -> None:
        self.client, self.requests, self.params = client, requests, params
        self.aborts, self.after_tokens = aborts, after_tokens
        results.update({r.rid: Result(r.rid, len(r.prompt), r.max_new_tokens)
                        for r in requests})
        self.results = results
        self.t0 = time.monotonic()
        self.next_i = self.done = 0

    def router_lost(self, why: str) -> None:
        """End every request still in flight: the router that serves them is gone."""
        now = time.monotonic()
        for res in self.results.values():
            if not res.reason:
                res.reason, res.error, res.t_done = "error", _LOST + why, now
                self.done += 1
        self.next_i = len(self.requests)

    def step(self, progress: Callable[[int, int], None] | None) -> None:
        """Submit what is due, send due aborts, wait for messages until the next arrival."""
        now = time.monotonic()
        while self.next_i < len(self.requests) and \
                now - self.t0 >= self.requests[self.next_i].arrival_s:
            req = self.requests[self.next_i]
            self.results[req.rid].t_submit = time.monotonic()
            self.client.submit(req.rid, req.prompt, {**_length(req), **self.params},
                               text=req.text, messages=req.messages, stop=req.stop)
            self.next_i += 1
        _send_aborts(self.client, self.results, self.aborts, now)
        wait = 0.05
        if self.next_i < len(self.requests):
            wait = min(wait, max(0.0, self.t0 + self.requests[self.next_i].arrival_s - now))
        for msg in self.client.poll(wait):
            if on_message(self.results, msg):
                self.done += 1
                if progress is not None:
                    progress(self.done, len(self.requests))
        _abort_on_tokens(self.client, self.results, self.after_tokens)


def _length(req: WorkRequest) -> dict:
    """A request's output length: a token-id prompt (a seeded synthetic one) runs to its
    drawn length past the model's eos ids, as ``vllm bench serve --ignore-eos`` does; a
    text or chat request ends at them, as a client of the model expects."""
    if req.text or req.messages:
        return {"max_new_tokens": req.max_new_tokens}
    return {"max_new_tokens": req.max_new_tokens, "ignore_eos": True}


def _send_aborts(client: Client, results: dict[str, Result], aborts: dict[str, float],
                 now: float) -> None:
    for rid, delay in list(aborts.items()):
        res = results[rid]
        if res.reason:
            del aborts[rid]
        elif res.t_submit and now >= res.t_submit + delay:
            client.abort(rid)
            del aborts[rid]


def _abort_on_tokens(client: Client, results: dict[str, Result],
                     after: dict[str, int]) -> None:
    for rid, n in list(after.items()):
        if len(results[rid].output_ids) >= n and not results[rid].reason:
            client.abort(rid)
            del after[rid]


def on_message(results: dict[str, Result], msg: Message | Malformed) -> bool:
    """Apply one router message; True when it ended a request."""
    res = results.get(getattr(msg, "rid", ""))
    if res is None or res.reason:
        return False
    now = time.monotonic()
    if isinstance(msg, Tokens):
        if msg.ids:
            res.t_tokens.append(now)
        res.output_ids.extend(msg.ids)
        res.text += msg.text
        return False
    if isinstance(msg, Done):
        res.t_done, res.reason, res.error = now, msg.reason, msg.error
        res.xfer_s, res.kv_bytes = msg.xfer_s, msg.kv_bytes
        res.final_text, res.prompt_tokens = msg.text, msg.prompt_tokens
        res.migrations = msg.migrations
        res.cached_tokens = msg.cached_tokens
        return True
    if isinstance(msg, Error):
        res.t_done, res.reason, res.error = now, "error", msg.error
        return True
    return False
