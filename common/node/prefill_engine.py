"""Chunked prefill over rows of a ``KvCache``: the compute half of a prefill worker, of
a colocated worker, and of a decode that prefills a prompt's short uncached rest itself
(conditional disaggregation).

The engine owns no sockets and frees nothing: the worker admits a ``Request`` (opens and
extends its row), hands it here, and after each ``step`` learns which requests advanced
(``num_computed`` grew) and which computed their first token (appended to ``output``).

Each step builds one batched forward pass: requests in arrival order, each contributing at
most ``chunk_size`` prompt tokens, ``max_prefill_tokens`` in all. When the pool carries
draft layers the draft model's KV of the same chunk is computed too (speculative decoding
starts warm on the decode side).

Prefix-cache seam: a request whose first ``num_computed`` prompt tokens already hold KV
(loaded from a host tier) computes only the rest.

A pass waits for the device at most once: the target's and the draft's plans and the
first tokens' draw parameters go up in one copy; the first tokens come down in one copy
(none when no prompt finished); the draft's pass runs after it without being waited for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from common.model import BatchItem, HostPlan, ModelRunner, draw, plan_draws
from common.request import Request

logger = logging.getLogger(__name__)

Sampled = Callable[[list[Request]], None]
"""Told which requests of a pass have their first token (``PrefillEngine.step``)."""


class PrefillEngine:
    """Batches prompt chunks of many requests into forward passes.

    Args:
        runner: the model runner over the worker's cache.
        chunk_size: most prompt tokens one request adds to one pass.
        max_tokens: token budget of one pass.
        with_draft: also compute the draft model's KV (the pool must hold draft layers).
    """

    def __init__(self, runner: ModelRunner, chunk_size: int, max_tokens: int,
                 with_draft: bool = False) -> None:
        self.runner, self.cache = runner, runner.cache
        self.chunk_size, self.max_tokens = chunk_size, max_tokens
        self.with_draft = with_draft
        self.tasks: dict[str, Request] = {}
        self.batch: list[Request] = []
        """The requests of the last (or failing) step."""
        self.num_tokens_computed = 0

    def add(self, req: Request) -> None:
        """Prefill ``req`` from ``num_computed``; its row holds the whole prompt."""
        assert req.kv is not None and req.kv.allocated_len >= req.prompt_len, req.rid
        assert req.rid not in self.tasks and not req.output, req.rid
        self.tasks[req.rid] = req

    def remove(self, rid: str) -> Request | None:
        """Stop prefilling ``rid`` (abort); the caller frees its row."""
        return self.tasks.pop(rid, None)

    @property
    def has_work(self) -> bool:
        return bool(self.tasks)

    def step(self, on_sampled: Sampled | None = None) -> tuple[list[Request], list[Request]]:
        """Run one pass. Returns (requests that advanced, requests that finished their
        prompt); finished ones carry their first token in ``output`` and leave.

        Args:
            on_sampled: called with the finished requests once their first token is in
                ``output``, after the target's forward and before the draft's: the first
                token depends on the target's logits alone, so it need not wait for the
                draft KV (which the decode needs only for its first speculative step).
                The rows are not committed yet; an exception fails the pass.
        """
        batch = self.plan(self.max_tokens)
        if not batch:
            return [], []
        items = self.items(batch)
        finished = self.finishing(batch)
        self._compute(items, finished, on_sampled)
        self.commit(batch)
        return [r for r, _ in batch], [r for _, r in finished]

    @torch.inference_mode()
    def _compute(self, items: list[BatchItem], finished: list[tuple[int, Request]],
                 on_sampled: Sampled | None) -> None:
        """The target's pass, the finished prompts' first tokens, the draft's pass."""
        runner = self.runner
        host = HostPlan(runner.device)
        target = runner.plan(host, items)
        draft = runner.plan(host, items, draft=True) if self.with_draft else None
        if finished:  # only the finished prompts' last tokens need logits
            ends = np.cumsum([it.num_tokens for it in items]) - 1
            last = host.add(ends[[i for i, _ in finished]])
            draws = plan_draws(host, [r for _, r in finished], runner.model.config.vocab_size)
        dev = host.upload()
        h = runner.run(target, dev)
        if finished:
            logits = runner.head(target, h, dev[last])
            tokens = draw(logits, draws, dev)
            for (_, req), tok in zip(finished, tokens):
                req.output.append(int(tok))
            if on_sampled is not None:
                on_sampled([r for _, r in finished])
        if draft is not None:
            runner.run(draft, dev)

    # -- the pieces of a pass (a colocated worker folds them into its decode step) -------
    def plan(self, budget: int) -> list[tuple[Request, int]]:
        """The next pass's chunks within ``budget`` tokens: (request, tokens), in arrival
        order, at most ``chunk_size`` each (``batch`` names their requests)."""
        batch = []
        for req in self.tasks.values():
            if budget <= 0:
                break
            n = min(self.chunk_size, req.prompt_remaining, budget)
            if n > 0:
                batch.append((req, n))
            budget -= n
        self.batch = [r for r, _ in batch]
        return batch

    @staticmethod
    def items(batch: list[tuple[Request, int]]) -> list[BatchItem]:
        """The forward pass's items of ``plan``'s chunks."""
        return [BatchItem(r.kv, r.prompt[r.num_computed:r.num_computed + n], r.num_computed)
                for r, n in batch]

    @staticmethod
    def finishing(batch: list[tuple[Request, int]]) -> list[tuple[int, Request]]:
        """(index in ``batch``, request) of the chunks that end their prompt: their last
        token's logits give the first token."""
        return [(i, req) for i, (req, n) in enumerate(batch) if req.prompt_remaining == n]

    def commit(self, batch: list[tuple[Request, int]]) -> None:
        """The pass ran (its first tokens are in ``output``): commit each chunk's KV; the
        finished requests leave."""
        for req, n in batch:
            self.cache.commit(req.kv, n)
            req.num_computed += n
            self.num_tokens_computed += n
            if not req.prompt_remaining:
                del self.tasks[req.rid]
