"""Where a request goes: the router's view of its workers, and its choice of them.

Load is what the router itself routed and has not seen finish (no staleness from
heartbeats): a decode's share is reserved row tokens over its pool, a prefill's is prompt
tokens not yet prefilled. Ties go to the lower name, so choices are reproducible.

``Placement`` chooses by the deployment's ``routing``: ``least-loaded`` (``pick``), or
``prefix`` (``deploy.router.prefix_routing``), which follows every worker's KV events
(the address each advertises in ``Ready``) into a ``PrefixIndex`` on a thread of its own
and scores workers by the prompt's blocks already cached on them, against their load.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from common.auth import Keys, KeysError, events_client
from common.config import ServeConfig
from common.host import HashChain
from common.kv_events import EventFeed
from common.metrics import NodeMetrics
from deploy.router.errors import Unavailable
from deploy.router.prefix_index import Match, PrefixIndex
from deploy.router.prefix_routing import LOAD, LOCAL, Choice, Load, PrefixPolicy

logger = logging.getLogger(__name__)


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
    decode = min(_decodes(workers, row_len), key=lambda w: (w.assigned / w.pool_tokens,
                                                            w.name))
    if decode.role == "colocated":
        return decode, None
    return decode, min(_prefills(workers, prompt_len), key=lambda w: (w.assigned, w.name))


def _decodes(workers: list[WorkerInfo], row_len: int) -> list[WorkerInfo]:
    decodes = [w for w in live(workers, "decode", "colocated") if w.pool_tokens >= row_len]
    if not decodes:
        raise Unavailable(f"no ready worker can hold {row_len} tokens")
    return decodes


def _prefills(workers: list[WorkerInfo], prompt_len: int) -> list[WorkerInfo]:
    prefills = [w for w in live(workers, "prefill") if w.pool_tokens >= prompt_len]
    if not prefills:
        raise Unavailable(f"no ready prefill worker can hold a {prompt_len}-token prompt"
                         + _paused([w for w in workers if w.role == "prefill"]))
    return prefills


def admits_at_once(decode: WorkerInfo, row_len: int, config: ServeConfig) -> bool:
    """Eager prefill: the decode surely admits at once (room for the whole row with page
    rounding, and a batch slot), so the prefill need not wait for its announcement.
    Otherwise the prefill waits: preallocation at the decode is the backpressure."""
    rounding = config.page_size * (decode.routed + 1)
    return (decode.assigned + row_len + rounding <= decode.pool_tokens
            and decode.routed < config.batch_limit(decode.pool_tokens // config.page_size + 1))



@dataclass(frozen=True)
class Decision:
    """A request's workers: its decode (or colocated worker) and its prefill; ``prefill``
    None with a decode: the decode computes the prompt itself (``local``)."""

    decode: WorkerInfo
    prefill: WorkerInfo | None

    @property
    def local(self) -> bool:
        return self.prefill is None and self.decode.role == "decode"


class Placement:
    """The router's choice of workers, by ``config.routing``.

    Args:
        config: the deployment's config (``routing`` and its weights).
        keys: the deployment's key directory: the router subscribes to workers' KV events
            as identity ``router`` (CURVE); None: no keys (loopback only).
        node: the router's metrics registry (decisions, cached tokens, the index).
    """

    def __init__(self, config: ServeConfig, keys: Keys | None = None,
                 node: NodeMetrics | None = None) -> None:
        self.config, self.keys = config, keys
        self.prefix = config.routing == "prefix"
        self.policy = PrefixPolicy(config)
        self.index = PrefixIndex(config.page_size)
        self.feed: EventFeed | None = None
        self._node = node or NodeMetrics("router")
        self._decisions = self._node.counter("pdkv_routing_decisions_total")
        self._prompt = self._node.counter("pdkv_routing_prompt_tokens_total")
        self._cached = self._node.counter("pdkv_routing_cached_tokens_total")
        self._node.read(self._readings)

    # -- the workers' events -------------------------------------------------------------
    def watch(self, worker: WorkerInfo, events_addr: str, replay_addr: str,
              identity: str = "") -> None:
        """Follow ``worker``'s KV events (it advertised them in ``Ready``; ``identity``:
        the key directory's name it authenticated as). Its index starts afresh."""
        self.index.forget(worker.name)
        if not self.prefix or not events_addr:
            return
        try:
            auth = events_client(self.keys, "router", identity or "worker")
        except KeysError as exc:
            logger.error("router: cannot follow %s's KV events: %s", worker.name, exc)
            return
        if self.feed is None:
            self.feed = EventFeed(self.index.apply)
        self.feed.add(worker.name, events_addr, replay_addr, auth)
        logger.info("router: following %s's KV events at %s", worker.name, events_addr)

    def forget(self, name: str) -> None:
        """``name`` was lost: stop following it, drop what it held."""
        if self.feed is not None:
            self.feed.remove(name)
        self.index.forget(name)

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()
            self.feed = None

    # -- choosing ------------------------------------------------------------------------
    def pick(self, workers: Iterable[WorkerInfo], prompt: list[int], row_len: int
             ) -> Decision:
        """The workers for a request of ``prompt`` that may grow to ``row_len`` tokens.

        Raises:
            Unavailable: no ready worker can hold it.
        """
        workers = list(workers)
        if not self.prefix:
            decode, prefill = pick(workers, len(prompt), row_len)
            self._count("decode", decode, Choice(0, LOAD), len(prompt))
            if prefill is not None:
                self._count("prefill", prefill, Choice(0, LOAD), len(prompt))
            return Decision(decode, prefill)
        return self._pick_prefix(workers, prompt, row_len)

    def _pick_prefix(self, workers: list[WorkerInfo], prompt: list[int], row_len: int
                     ) -> Decision:
        n = len(prompt)
        decodes = _decodes(workers, row_len)
        keys = HashChain(self.config.page_size, tokens=prompt[:n - 1]).keys
        matches = self.index.match(keys, [w.name for w in workers])
        choice = self.policy.decode(_loads(decodes), [matches[w.name] for w in decodes], n)
        decode = decodes[choice.index]
        self._count("decode", decode, choice, n)
        if decode.role == "colocated":
            return Decision(decode, None)
        if self.policy.local(matches[decode.name], n):
            self._decisions.labels(stage="prefill", reason=LOCAL).inc()
            return Decision(decode, None)
        prefills = _prefills(workers, n)
        choice = self.policy.prefill(_loads(prefills), [matches[w.name] for w in prefills], n)
        self._count("prefill", prefills[choice.index], choice, n)
        return Decision(decode, prefills[choice.index])

    def _count(self, role: str, worker: WorkerInfo, choice: Choice, prompt_len: int) -> None:
        self._decisions.labels(stage=role, reason=choice.reason).inc()
        self._prompt.labels(stage=role).inc(prompt_len)
        self._cached.labels(stage=role, tier="device").inc(choice.device_tokens)
        self._cached.labels(stage=role, tier="host").inc(
            choice.cached_tokens - choice.device_tokens)

    def match(self, worker: str, prompt: list[int]) -> Match:
        """``worker``'s cached leading blocks of ``prompt`` as the index has them (tests,
        tools)."""
        keys = HashChain(self.config.page_size, tokens=prompt[:len(prompt) - 1]).keys
        return self.index.match(keys, [worker])[worker]

    def _readings(self) -> list[tuple[str, dict[str, str], float]]:
        out = []
        for name, st in (self.feed.stats() if self.feed is not None else {}).items():
            out += [("pdkv_kv_events_batches_total", {"publisher": name}, st["batches"]),
                    ("pdkv_kv_events_gaps_total", {"publisher": name}, st["gaps"]),
                    ("pdkv_kv_events_lost_batches_total", {"publisher": name}, st["lost"])]
        for name, media in self.index.blocks().items():
            out += [("pdkv_kv_events_blocks", {"publisher": name, "medium": m}, n)
                    for m, n in media.items()]
        return out


def _loads(workers: list[WorkerInfo]) -> list[Load]:
    return [Load(w.name, w.routed, w.assigned, w.pool_tokens) for w in workers]
