"""Prefix-aware choice of a request's workers: where its prompt's blocks are cached,
against each worker's load (``routing = "prefix"``, docs/routing.md).

For a prompt the index gives, per worker, its leading blocks on the device and in the
host tier (``PrefixIndex.match``); a host block is worth ``routing_host_weight`` of a
device block, so a worker's *cached tokens* are ``(device + weight * host-only blocks) *
page_size``, at most the prompt less one token (the last one is always computed). Then,
per role, when the role is balanced:

    decode   most cached tokens; ties, and no hit anywhere: least loaded (reserved
             share of its pool)
    prefill  least (uncached prompt tokens + prompt tokens already queued on it): the
             prefill work ahead of this request's first token

and by load alone (least loaded) when it is imbalanced: its busiest worker runs more than
``routing_imbalance`` requests beyond the least busy one and more than
``routing_imbalance_ratio`` times as many (the rule of sglang's cache-aware router).

Conditional disaggregation: when the chosen decode's own caches hold most of the prompt
(at least as many tokens as they lack) and at most ``local_prefill_tokens`` are missing,
the decode computes them itself and no prefill is involved (Dynamo's and llm-d's
prefix-based P/D decision): the prefill hop, its queue and the transfer are saved for a
few tokens of compute on the decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.config import ServeConfig
from deploy.router.prefix_index import Match

LOAD, PREFIX, IMBALANCE, LOCAL = "load", "prefix", "imbalance", "local"
"""Why a worker was chosen: by load (no worker had a hit, or ties), by its cached prefix,
by load because the role was imbalanced; ``local``: no prefill, the decode computes."""


@dataclass(frozen=True)
class Choice:
    """One role's pick: the worker's index in the candidates, why, its cached tokens."""

    index: int
    reason: str
    cached_tokens: int = 0
    device_tokens: int = 0


@dataclass(frozen=True)
class Load:
    """What the router knows of a candidate's load (``WorkerInfo``)."""

    name: str
    routed: int
    """Requests in flight on it."""
    assigned: int
    """Tokens in flight on it (prefill: prompt tokens; decode: reserved row tokens)."""
    pool_tokens: int


class PrefixPolicy:
    """The scoring of ``routing = "prefix"`` (pure: the caller brings matches and loads)."""

    def __init__(self, config: ServeConfig) -> None:
        self.page_size = config.page_size
        self.host_weight = config.routing_host_weight
        self.imbalance, self.ratio = config.routing_imbalance, config.routing_imbalance_ratio
        self.local_tokens = config.local_prefill_tokens

    def cached(self, m: Match, prompt_len: int) -> tuple[int, int]:
        """(weighted cached tokens, device tokens) of a match, capped below the prompt."""
        cap = max(0, prompt_len - 1)
        weighted = (m.device + self.host_weight * (m.cached - m.device)) * self.page_size
        return min(int(weighted), cap), min(m.device * self.page_size, cap)

    def imbalanced(self, loads: Sequence[Load]) -> bool:
        busy = [w.routed for w in loads]
        return (max(busy) - min(busy) > self.imbalance
                and max(busy) > self.ratio * min(busy))

    def decode(self, loads: Sequence[Load], matches: Sequence[Match], prompt_len: int
               ) -> Choice:
        def least(i: int) -> tuple:
            w = loads[i]
            return (w.assigned / w.pool_tokens, w.name)

        order = range(len(loads))
        if self.imbalanced(loads):
            return Choice(min(order, key=least), IMBALANCE)
        cached = [self.cached(m, prompt_len) for m in matches]
        best = max(c for c, _ in cached)
        if best <= 0:
            return Choice(min(order, key=least), LOAD)
        i = min((i for i in order if cached[i][0] == best), key=least)
        return Choice(i, PREFIX, *cached[i])

    def prefill(self, loads: Sequence[Load], matches: Sequence[Match], prompt_len: int
                ) -> Choice:
        order = range(len(loads))
        if self.imbalanced(loads):
            return Choice(min(order, key=lambda i: (loads[i].assigned, loads[i].name)),
                          IMBALANCE)
        cached = [self.cached(m, prompt_len) for m in matches]
        i = min(order, key=lambda i: (prompt_len - cached[i][0] + loads[i].assigned,
                                      loads[i].name))
        return Choice(i, PREFIX if cached[i][0] > 0 else LOAD, *cached[i])

    def local(self, match: Match, prompt_len: int) -> bool:
        """The decode that has ``match`` computes the rest itself (conditional
        disaggregation): its caches hold most of the prompt and at most
        ``local_prefill_tokens`` of it are missing."""
        if self.local_tokens <= 0:
            return False
        have = min(match.cached * self.page_size, max(0, prompt_len - 1))
        missing = prompt_len - have
        return missing <= self.local_tokens and have >= missing
