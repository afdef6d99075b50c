"""Chunked prefill over rows of a ``KvCache``: the compute half of a prefill worker.

The engine owns no sockets and frees nothing: the worker admits a request (opens and
extends its row), hands it here as a ``PrefillTask``, and after each ``step`` learns which
prompt positions now hold KV and which requests computed their first token.

Each step builds one batched forward pass: requests in arrival order, each contributing at
most ``chunk_size`` prompt tokens, ``max_prefill_tokens`` in all. When the pool carries
draft layers the draft model's KV of the same chunk is computed too (speculative decoding
starts warm on the decode side).

Prefix-cache seam: a task whose first ``done`` prompt tokens already hold KV (loaded from
a host tier) is added with ``done`` set; the engine computes only the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from common.kv import KvRecord
from common.model import BatchItem, ModelRunner, sample
from common.request import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class PrefillTask:
    """One request being prefilled; ``kv.allocated_len >= len(prompt)``."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    kv: KvRecord
    done: int = 0
    """Prompt positions [0, done) hold KV (computed or loaded)."""
    first_token: int | None = None

    @property
    def remaining(self) -> int:
        return len(self.prompt) - self.done


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
        self.tasks: dict[str, PrefillTask] = {}
        self.num_tokens_computed = 0

    def add(self, task: PrefillTask) -> None:
        assert task.kv.allocated_len >= len(task.prompt), (task.rid, task.kv)
        assert task.rid not in self.tasks, task.rid
        self.tasks[task.rid] = task

    def remove(self, rid: str) -> PrefillTask | None:
        """Stop prefilling ``rid`` (abort); the caller frees its row."""
        return self.tasks.pop(rid, None)

    @property
    def has_work(self) -> bool:
        return bool(self.tasks)

    def step(self) -> tuple[list[PrefillTask], list[PrefillTask]]:
        """Run one pass. Returns (tasks that advanced, tasks that finished); finished tasks
        carry ``first_token`` and leave the engine."""
        batch = self._schedule()
        if not batch:
            return [], []
        items = [BatchItem(t.kv, t.prompt[t.done:t.done + n], t.done) for t, n in batch]
        logits = self.runner.forward(items)
        if self.with_draft:
            self.runner.forward(items, draft=True)
        finished = []
        for i, (task, n) in enumerate(batch):
            self.cache.commit(task.kv, n)
            task.done += n
            self.num_tokens_computed += n
            if task.remaining == 0:
                finished.append((i, task))
        if finished:
            rows = logits[[i for i, _ in finished]]
            tokens = sample(rows, [t.params for _, t in finished],
                            [t.rid for _, t in finished], [0] * len(finished))
            for (_, task), tok in zip(finished, tokens):
                task.first_token = tok
                del self.tasks[task.rid]
        return [t for t, _ in batch], [t for _, t in finished]

    def _schedule(self) -> list[tuple[PrefillTask, int]]:
        budget, batch = self.max_tokens, []
        for task in self.tasks.values():
            if budget <= 0:
                break
            n = min(self.chunk_size, task.remaining, budget)
            if n > 0:
                batch.append((task, n))
            budget -= n
        return batch
