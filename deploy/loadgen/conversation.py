"""Multi-turn chat, closed loop: clients that each hold one conversation at a time.

A conversation is a (possibly shared) system prompt and a list of user messages, each with
the reply length it asks for. Turn ``t``'s prompt is the conversation so far: the system
prompt, every earlier user message followed by the model's *actual* reply to it, then
user message ``t``; so each prompt begins with everything the previous turn's row held,
as a chat client's does. A client sends turn ``t + 1`` once turn ``t``'s reply is complete
(and ``think_s`` passed); ``clients`` conversations are in flight at once, interleaved, and
a client that finished a conversation starts the next one waiting.

Everything but the replies is a pure function of the seed (``ChatSpec``): two runs send
the same user messages, and with greedy sampling the same replies.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from common.control import Done
from deploy.loadgen.driver import Result, on_message
from deploy.router.client import Client


@dataclass(frozen=True)
class ChatSpec:
    """Shape of a seeded chat workload (lengths in tokens, ranges inclusive, uniform)."""

    conversations: int = 24
    clients: int = 6
    """Conversations in flight at once (one per client)."""
    turns: tuple[int, int] = (4, 8)
    systems: int = 1
    """Distinct system prompts; conversation ``c`` has system prompt ``c % systems``."""
    system_len: int = 0
    """Tokens of each system prompt (0: none)."""
    first_len: tuple[int, int] = (64, 256)
    """The first user message (a document, a question with context)."""
    user_len: tuple[int, int] = (16, 64)
    """Every later user message."""
    reply_len: tuple[int, int] = (16, 64)
    """max_new_tokens of each turn."""
    think_s: float = 0.0
    """Pause between a reply and the next turn."""
    seed: int = 0

    def __post_init__(self) -> None:
        ranges = (self.turns, self.first_len, self.user_len, self.reply_len)
        if self.conversations < 1 or self.clients < 1 or self.systems < 1 or \
                self.system_len < 0 or self.think_s < 0 or \
                any(not 1 <= lo <= hi for lo, hi in ranges):
            raise ValueError(f"bad chat workload: {self}")


@dataclass
class Conversation:
    cid: int
    system: list[int]
    users: list[list[int]]
    reply_lens: list[int]
    history: list[int] = field(default_factory=list)
    """The conversation so far (prompt of the last turn sent, then its reply)."""


def make_conversations(spec: ChatSpec, vocab_size: int) -> list[Conversation]:
    rng = np.random.default_rng(spec.seed)
    systems = [rng.integers(0, vocab_size, spec.system_len).tolist()
               for _ in range(spec.systems)]

    def draw(lo_hi: tuple[int, int]) -> int:
        return int(rng.integers(lo_hi[0], lo_hi[1] + 1))

    out = []
    for c in range(spec.conversations):
        n = draw(spec.turns)
        lens = [draw(spec.first_len)] + [draw(spec.user_len) for _ in range(n - 1)]
        out.append(Conversation(c, systems[c % spec.systems],
                                [rng.integers(0, vocab_size, k).tolist() for k in lens],
                                [draw(spec.reply_len) for _ in range(n)]))
    return out


def converse(client: Client, conversations: list[Conversation], clients: int, *,
             think_s: float = 0.0, params: dict | None = None, label: str = "chat",
             check: Callable[[], None] | None = None, timeout_s: float = 600.0
             ) -> dict[str, Result]:
    """Play ``conversations`` through the router, ``clients`` at a time.

    Returns:
        Every turn's result by rid (``<label>-c<conversation>-t<turn>``). A failed turn
        ends its conversation (the next turn would have no reply to build on).

    Raises:
        TimeoutError: not every turn ended within ``timeout_s``.
    """
    # Seeded token-id turns run to their drawn reply length past the model's eos ids (as
    # the open-loop driver's do): the next turn's history, and the work, stay the seed's.
    params = {"temperature": 0.0, "ignore_eos": True, **(params or {})}
    waiting = list(reversed(conversations))
    due: list[tuple[float, int, Conversation, int]] = []   # (when, cid, conv, turn)
    flying: dict[str, tuple[Conversation, int]] = {}
    results: dict[str, Result] = {}
    t0 = time.monotonic()
    for _ in range(min(clients, len(waiting))):
        conv = waiting.pop()
        heapq.heappush(due, (t0, conv.cid, conv, 0))
    while due or flying:
        now = time.monotonic()
        if now - t0 > timeout_s:
            raise TimeoutError(f"{len(flying)} turns in flight and {len(due)} due after "
                               f"{timeout_s}s")
        while due and due[0][0] <= now:
            _, _, conv, turn = heapq.heappop(due)
            rid = f"{label}-c{conv.cid:04d}-t{turn}"
            prompt = (conv.history or list(conv.system)) + conv.users[turn]
            results[rid] = Result(rid, len(prompt), conv.reply_lens[turn], t_submit=now)
            client.submit(rid, prompt, {"max_new_tokens": conv.reply_lens[turn], **params})
            conv.history = prompt
            flying[rid] = (conv, turn)
        wait = 0.05 if not due else max(0.0, min(0.05, due[0][0] - now))
        for msg in client.poll(wait):
            rid = getattr(msg, "rid", "")
            if rid not in flying or not on_message(results, msg):
                continue
            conv, turn = flying.pop(rid)
            res = results[rid]
            next_at = time.monotonic() + think_s
            if res.ok and turn + 1 < len(conv.users) and isinstance(msg, Done):
                conv.history = conv.history + res.output_ids
                heapq.heappush(due, (next_at, conv.cid, conv, turn + 1))
            elif waiting:  # this client's next conversation
                conv = waiting.pop()
                heapq.heappush(due, (next_at, conv.cid, conv, 0))
        if check is not None:
            check()
    return results
