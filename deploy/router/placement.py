"""Where a request goes: the router's view of its workers and the load-aware choice.

Load is what the router itself routed and has not seen finish (no staleness from
heartbeats): a decode's share is reserved row tokens over its pool, a prefill's is prompt
tokens not yet prefilled. Ties go to the lower name, so choices are reproducible.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from common.config import ServeConfig
from deploy.router.errors import Unavailable


@dataclass
class WorkerInfo:
    name: str
    role: str
    peer: bytes
    pid: int = 0
    kv_addr: str = ""
    pool_tokens: int = 0
    ready: bool = False
    lost: bool = False
    last_seen: float = 0.0
    assigned: int = 0
    """Tokens routed here and not finished (prompt for prefill, whole row for decode)."""
    routed: int = 0
    """Requests routed here and not finished."""
    stats: dict | None = None
    paused: str = ""
    """Why the worker admits no new requests (from its ``Load``); empty: it does."""
    draining: float = 0.0
    """When it began draining (``deploy.router.drain``: no new requests); 0: it is not."""


def live(workers: Iterable[WorkerInfo], *roles: str) -> list[WorkerInfo]:
    """Workers of ``roles`` that take new requests: ready, not lost, not paused, not
    draining."""
    return [w for w in workers if w.role in roles and w.ready and not w.lost
            and not w.paused and not w.draining]


def max_tokens(workers: Iterable[WorkerInfo]) -> int:
    """Longest row (prompt + new tokens) some ready decode or colocated worker holds.

    Raises:
        Unavailable: none is ready (naming the paused ones)."""
    workers = list(workers)
    decodes = live(workers, "decode", "colocated")
    if not decodes:
        raise Unavailable("no decode or colocated worker is ready" + _paused(workers))
    return max(w.pool_tokens for w in decodes)


def capacity(workers: Iterable[WorkerInfo]) -> tuple[int, int]:
    """(longest row: prompt + output, longest prompt) some ready worker holds: a prompt
    fits a colocated row less one (for the first output token), or a decode row less one
    that also fits a ready prefill's row.

    Raises:
        Unavailable: no ready decode or colocated worker, or decodes but no prefill.
    """
    workers = list(workers)
    row = prompt = prefill = 0
    for w in workers:
        if w.role == "prefill" and w.ready and not w.lost and not w.paused:
            prefill = max(prefill, w.pool_tokens)
    for w in workers:
        if w.role in ("decode", "colocated") and w.ready and not w.lost and not w.paused:
            row = max(row, w.pool_tokens)
            prompt = max(prompt, w.pool_tokens - 1 if w.role == "colocated" else
                         min(w.pool_tokens - 1, prefill))
    if not row:
        raise Unavailable("no decode or colocated worker is ready" + _paused(workers))
    if prompt <= 0:
        raise Unavailable("no ready prefill worker" + _paused(
            [w for w in workers if w.role == "prefill"]))
    return row, prompt


def _paused(workers: list[WorkerInfo]) -> str:
    """``; not admitting: decode0 (free log ...: EFBIG ...)`` for paused workers, or ''."""
    paused = [f"{w.name} ({w.paused})" for w in workers if w.paused and not w.lost]
    return f"; not admitting: {', '.join(paused)}" if paused else ""


def pick(workers: Iterable[WorkerInfo], prompt_len: int, row_len: int
         ) -> tuple[WorkerInfo, WorkerInfo | None]:
    """(decode or colocated worker, prefill or None for colocated), least loaded."""
    workers = list(workers)
    decodes = [w for w in live(workers, "decode", "colocated") if w.pool_tokens >= row_len]
    if not decodes:
        raise Unavailable(f"no ready worker can hold {row_len} tokens")
    decode = min(decodes, key=lambda w: (w.assigned / w.pool_tokens, w.name))
    if decode.role == "colocated":
        return decode, None
    prefills = [w for w in live(workers, "prefill") if w.pool_tokens >= prompt_len]
    if not prefills:
        raise Unavailable(f"no ready prefill worker can hold a {prompt_len}-token prompt"
                         + _paused([w for w in workers if w.role == "prefill"]))
    return decode, min(prefills, key=lambda w: (w.assigned, w.name))


def admits_at_once(decode: WorkerInfo, row_len: int, config: ServeConfig) -> bool:
    """Eager prefill: the decode surely admits at once (room for the whole row with page
    rounding, and a batch slot), so the prefill need not wait for its announcement.
    Otherwise the prefill waits: preallocation at the decode is the backpressure."""
    rounding = config.page_size * (decode.routed + 1)
    return (decode.assigned + row_len + rounding <= decode.pool_tokens
            and decode.routed < config.batch_limit(decode.pool_tokens // config.page_size + 1))

