"""Continuous batching of decode steps over rows of a ``KvCache``.

A sequence joins the batch once its prompt KV is in the pool and its first token is known
(computed by prefill). Each ``step`` runs one ``StepFn`` over every running sequence and
appends the tokens it returns; a sequence leaves when it reaches ``max_new_tokens`` or
emits its stop token. The batch frees nothing: the worker frees finished rows with
``finish_ranges`` (so a host-tier connector can take over freeing later).

Row of a running sequence (P = prompt length, G = tokens generated so far)::

    [0, P)            prompt KV (received or prefilled)
    [P, P + G - 1)    KV of generated tokens 0 .. G-2
    token G-1         the newest token: no KV yet, it is the next step's input

``StepFn`` is the seam for speculative decoding: ``greedy_step`` extends each row by one
slot and returns one token per sequence; a speculative step may extend by k lookahead
slots, commit only verified tokens and return several tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from common.kv import KvCache, KvRecord, ceil_align
from common.model import BatchItem, ModelRunner, sample
from common.request import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class DecodeSeq:
    """One request in the continuous batch."""

    rid: str
    kv: KvRecord
    params: SamplingParams
    prompt_len: int
    output: list[int] = field(default_factory=list)
    """Generated tokens, the first (from prefill) included."""
    prompt: list[int] = field(default_factory=list)
    """The prompt's token ids (n-gram speculation looks up in them); may be empty."""

    @property
    def is_done(self) -> bool:
        return len(self.output) >= self.params.max_new_tokens or (
            bool(self.output) and self.params.is_stop(self.output[-1]))

    @property
    def next_position(self) -> int:
        """Row position of the newest token (the next step's input)."""
        return self.prompt_len + len(self.output) - 1


StepFn = Callable[[ModelRunner, list[DecodeSeq]], list[list[int]]]
"""Runs one decode step over the sequences; returns the new tokens of each."""


def greedy_step(runner: ModelRunner, seqs: list[DecodeSeq]) -> list[list[int]]:
    """One token per sequence: write the newest token's KV, sample the next."""
    cache = runner.cache
    for s in seqs:
        assert s.kv.allocated_len == s.next_position, (s.rid, s.kv, s.next_position)
        cache.extend(s.kv, 1)
    logits = runner.forward([BatchItem(s.kv, s.output[-1:], s.next_position) for s in seqs])
    for s in seqs:
        cache.commit(s.kv, 1)
    tokens = sample(logits, [s.params for s in seqs], [s.rid for s in seqs],
                    [len(s.output) for s in seqs])
    return [[t] for t in tokens]


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
        step_fn: the step to run (``greedy_step``; speculative decoding swaps it).
        on_commit: called with the sequences after each step, once their committed KV
            grew (the host-tier offload seam); None for no hook.
    """

    def __init__(self, runner: ModelRunner, step_fn: StepFn = greedy_step,
                 on_commit: Callable[[list[DecodeSeq]], None] | None = None) -> None:
        self.runner = runner
        self.cache: KvCache = runner.cache
        self.step_fn, self.on_commit = step_fn, on_commit
        self.running: dict[str, DecodeSeq] = {}
        self.num_steps = 0

    def __len__(self) -> int:
        return len(self.running)

    def add(self, seq: DecodeSeq) -> bool:
        """Join the batch. Returns False (not added) when the sequence is already done."""
        if seq.is_done:
            return False
        assert seq.kv.committed_len == seq.next_position, (seq.rid, seq.kv)
        self.running[seq.rid] = seq
        return True

    def remove(self, rid: str) -> DecodeSeq | None:
        """Take ``rid`` out (abort); the caller frees its row."""
        return self.running.pop(rid, None)

    def step(self) -> tuple[list[tuple[DecodeSeq, list[int]]], list[DecodeSeq]]:
        """One step over all running sequences.

        Returns:
            (each sequence with its newly emitted tokens, sequences that finished; these
            left the batch and the caller frees their rows).
        """
        if not self.running:
            return [], []
        seqs = list(self.running.values())
        new = self.step_fn(self.runner, seqs)
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
