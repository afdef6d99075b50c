"""Continuous batching of decode steps over rows of a ``KvCache``.

A request joins the batch once its prompt KV is in the pool and its first token is known
(computed by prefill). Each ``step`` runs one ``StepFn`` over every running request and
appends the tokens it returns to its ``output``; a request leaves when it reaches
``max_new_tokens`` or emits its stop token. The batch frees nothing: the scheduler frees
finished rows with ``finish_ranges`` (or the host connector does, once its copies end).

Row of a running sequence (P = prompt length, G = tokens generated so far)::

    [0, P)            prompt KV (received or prefilled)
    [P, P + G - 1)    KV of generated tokens 0 .. G-2
    token G-1         the newest token: no KV yet, it is the next step's input

``StepFn`` is the seam for speculative decoding: ``plain_step`` extends each row by one
slot and returns one token per sequence; a speculative step may extend by k lookahead
slots, commit only verified tokens and return several tokens.

A step waits for the device once: its plan (token ids, page tables, sampling
parameters) goes up in one copy, the forward pass and every sequence's draw run on the
device, and the chosen ids come down in one copy (``common.model.plan``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from common.kv import KvCache, KvRecord, ceil_align
from common.model import BatchItem, HostPlan, ModelRunner, draw, plan_draws
from common.request import Request

logger = logging.getLogger(__name__)


StepFn = Callable[[ModelRunner, list[Request]], list[list[int]]]
"""Runs one decode step over the sequences; returns the new tokens of each."""


@torch.inference_mode()
def plain_step(runner: ModelRunner, seqs: list[Request]) -> list[list[int]]:
    """One token per sequence, greedy or sampled by its params: write the newest token's
    KV, draw the next."""
    cache = runner.cache
    for s in seqs:
        assert s.kv.allocated_len == s.next_position, (s.rid, s.kv, s.next_position)
        cache.extend(s.kv, 1)
    host = HostPlan(runner.device)
    pp = runner.plan(host, [BatchItem(s.kv, s.output[-1:], s.next_position) for s in seqs])
    sp = plan_draws(host, seqs, runner.model.config.vocab_size)
    dev = host.upload()
    logits = runner.step_logits(pp, dev)  # a CUDA graph's replay where one is captured
    tokens = draw(logits, sp, dev)
    for s in seqs:
        cache.commit(s.kv, 1)
    return [[int(t)] for t in tokens]


greedy_step = plain_step
"""The step's name from before it sampled on the device (kept for callers)."""


def finish_ranges(kv: KvRecord, page_size: int) -> list[tuple[int, int]]:
    """What a finished sequence gives back, in one ``free_kv_row`` call.

    | range | holds |
    | --- | --- |
    | [protected_len, committed_len) | verified KV the request owns |
    | [ceil_align(committed_len), allocated_len) | lookahead tail (speculative decoding) |
    """
    tail = ceil_align(kv.committed_len, page_size)
    ranges = [(kv.protected_len, kv.committed_len)]
    if tail < kv.allocated_len:
        ranges.append((tail, kv.allocated_len))
    return ranges


class DecodeBatch:
    """The running sequences of one decode worker.

    Args:
        runner: the model runner over the worker's cache.
        step_fn: the step to run (``plain_step``; speculative decoding swaps it).
        on_commit: called with the sequences after each step, once their committed KV
            grew (the host-tier offload seam); None for no hook.
    """

    def __init__(self, runner: ModelRunner, step_fn: StepFn = plain_step,
                 on_commit: Callable[[list[Request]], None] | None = None) -> None:
        self.runner = runner
        self.cache: KvCache = runner.cache
        self.step_fn, self.on_commit = step_fn, on_commit
        self.running: dict[str, Request] = {}
        self.num_steps = 0

    def __len__(self) -> int:
        return len(self.running)

    def add(self, req: Request) -> bool:
        """Join the batch (new, or resumed in a new row). Returns False (not added) when
        the request is already done.

        The prompt's draft KV came with it (prefill computes it), so speculation starts
        from ``num_draft_valid = prompt_len``.
        """
        if req.is_done:
            return False
        assert req.kv.committed_len == req.next_position, (req.rid, req.kv)
        req.num_draft_valid = req.prompt_len
        self.running[req.rid] = req
        return True

    @staticmethod
    def items(seqs: list[Request]) -> list[BatchItem]:
        """A plain step's forward items: each sequence's newest token at its position."""
        return [BatchItem(s.kv, s.output[-1:], s.next_position) for s in seqs]

    def remove(self, rid: str) -> Request | None:
        """Take ``rid`` out (abort); the caller frees its row."""
        return self.running.pop(rid, None)

    def step(self, step_fn: StepFn | None = None
             ) -> tuple[list[tuple[Request, list[int]]], list[Request]]:
        """One step over all running sequences (by ``step_fn``, default the batch's own:
        a colocated worker passes one that folds prefill chunks into the same forward).

        Returns:
            (each sequence with its newly emitted tokens, sequences that finished; these
            left the batch and the caller frees their rows).
        """
        if not self.running:
            return [], []
        seqs = list(self.running.values())
        new = (step_fn or self.step_fn)(self.runner, seqs)
        self.num_steps += 1
        emitted, finished = [], []
        for s, toks in zip(seqs, new):
            took = []
            for t in toks:
                if s.is_done:
                    break
                s.output.append(t)
                took.append(t)
            emitted.append((s, took))
            if s.is_done:
                finished.append(s)
                del self.running[s.rid]
        if self.on_commit is not None:
            self.on_commit(seqs)
        return emitted, finished
