"""Greedy self-speculative decoding over a continuous batch (a ``StepFn``).

Each step, for every running sequence (p = row position of its newest token, which has
no KV yet, so ``committed_len == p`` on entry):

1. the draft catches up: it runs the committed tokens whose draft KV it lacks (the newest
   token, and tokens accepted in the last step that it never ran), then proposes k tokens
   autoregressively, batched over the sequences (draft layers of the same row);
2. the target verifies ``[newest] + proposals`` (k + 1 positions) in one ``forward_all``;
3. greedy acceptance: take proposals while they equal the target's argmax, then the
   target's own token. Tokens past ``max_new_tokens`` or past a stop token are cut off.

Row of one sequence during a step (k = 3, 2 proposals accepted)::

    positions  0 ..... p    p+1  p+2  p+3    p+4
               |committed| x0 | d1 | d2 | d3 |         allocated_len = p + k + 1
    verified              [p, p + a + 1) = x0 d1 d2  -> commit(a + 1) = 3
    lookahead             [p + a + 1, p + k + 1)     -> stays allocated, rewritten later

``allocated_len`` may stay ahead of ``committed_len`` between steps: the next step extends
only by what is missing and overwrites the stale lookahead KV before any query reads it
(the runner writes a pass's K/V before it attends). At finish the worker frees the row
with ``decode_node.batch.finish_ranges`` (committed part and the lookahead tail in one
``free_kv_row`` call). This module frees nothing.

Draft KV: a request joins with warm draft KV for its prompt (the prefill computes it and
it travels with the target's), so draft positions ``[0, prompt_len)`` are valid;
``DecodeBatch.add`` sets ``Request.num_draft_valid`` so, and this step keeps it current.
The step holds no per-request state of its own. The draft is the model's own first layers
(built-ins) or a draft checkpoint (the runner's ``draft``); with n-gram lookup
(``NgramProposer``) step 1 is a lookup in the request's own tokens instead, and there is
no draft KV at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import accumulate

import torch

from common.config import ServeConfig
from common.kv import KvCache, OutOfPages
from common.model import BatchItem, ModelRunner
from common.request import Request
from decode_node.batch import StepFn, greedy_step
from decode_node.ngram import NgramProposer

logger = logging.getLogger(__name__)


@dataclass
class SpecStats:
    """Counters of one ``SpeculativeStep`` (summed over sequences)."""

    num_steps: int = 0
    """Batch steps run."""
    num_seq_steps: int = 0
    """Sequence-steps (one per sequence per step)."""
    num_proposed: int = 0
    """Draft tokens proposed."""
    num_accepted: int = 0
    """Draft tokens the target agreed with (before truncation at the end of a request)."""
    num_emitted: int = 0
    """Tokens returned (accepted drafts plus the target's own token, after truncation)."""

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens; 0.0 before any proposal."""
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens emitted per sequence-step, in [1, k + 1]; 0.0 before any step."""
        return self.num_emitted / self.num_seq_steps if self.num_seq_steps else 0.0

    def to_dict(self) -> dict:
        return {"num_steps": self.num_steps, "num_proposed": self.num_proposed,
                "num_accepted": self.num_accepted, "num_emitted": self.num_emitted,
                "acceptance_rate": self.acceptance_rate,
                "mean_accepted_len": self.mean_accepted_len}


class SpeculativeStep:
    """A ``StepFn`` that proposes ``k`` draft tokens per sequence and verifies them.

    Args:
        k: draft tokens per sequence per step (>= 1). Near the end of a request fewer are
            proposed, so a step never computes tokens past ``max_new_tokens``.
        ngram: propose by n-gram lookup in each request's own tokens instead of running a
            draft model.

    Greedy only (``temperature == 0``); with a draft model the cache must hold its
    layers. Not thread-safe (one per decode batch).
    """

    def __init__(self, k: int, ngram: NgramProposer | None = None) -> None:
        if k < 1:
            raise ValueError(f"SpeculativeStep k={k} must be >= 1 (use greedy_step for 0)")
        self.k, self.ngram = k, ngram
        self.stats = SpecStats()

    def __call__(self, runner: ModelRunner, seqs: list[Request]) -> list[list[int]]:
        """One speculative step; returns each sequence's new tokens (1 to k + 1)."""
        for s in seqs:
            if s.params.temperature != 0:
                raise ValueError(f"{s.rid}: speculative decoding is greedy only "
                                 f"(temperature={s.params.temperature}); use greedy_step")
            assert s.kv.committed_len == s.next_position, (s.rid, s.kv, s.next_position)
        ks = [self._make_room(runner, s) for s in seqs]
        proposals = self._propose(runner, seqs, ks)
        verify = runner.forward_all([BatchItem(s.kv, s.output[-1:] + props, s.next_position)
                                     for s, props in zip(seqs, proposals)])
        # every sequence's verified ids reach the host in one copy (one device sync)
        ids = torch.cat(verify).argmax(-1).tolist()
        starts = accumulate((len(logits) for logits in verify), initial=0)
        out = [self._accept(runner.cache, s, props, ids[start:start + len(logits)])
               for s, props, logits, start in zip(seqs, proposals, verify, starts)]
        self.stats.num_steps += 1
        return out

    # -- the three phases ---------------------------------------------------------------
    def _make_room(self, runner: ModelRunner, s: Request) -> int:
        """Extend the row so positions [p, p + k_s + 1) have slots; returns k_s.

        k_s is k, less near ``max_new_tokens`` / ``max_position`` / ``max_row_len``, and 0
        when the pool cannot hold the lookahead (then this step is a plain decode step).
        """
        cache, p = runner.cache, s.next_position
        limit = min(runner.model.config.max_position, cache.max_row_len)
        k_s = max(0, min(self.k, s.params.max_new_tokens - len(s.output) - 1, limit - p - 1))
        try:
            cache.extend(s.kv, max(0, p + k_s + 1 - s.kv.allocated_len))
        except OutOfPages:
            logger.debug("%s: no pages for %d lookahead slots; plain step", s.rid, k_s)
            k_s = 0
            cache.extend(s.kv, max(0, p + 1 - s.kv.allocated_len))
        return k_s

    def _propose(self, runner: ModelRunner, seqs: list[Request], ks: list[int]
                 ) -> list[list[int]]:
        """Draft proposals, k_s per sequence; pass j batches the sequences with k_s > j."""
        if self.ngram is not None:
            return [self.ngram.propose(s.prompt + s.output, k_s) for s, k_s in zip(seqs, ks)]
        proposals: list[list[int]] = [[] for _ in seqs]
        for j in range(max(ks, default=0)):
            idx = [i for i, k_s in enumerate(ks) if k_s > j]
            items = [self._draft_item(seqs[i], proposals[i], j) for i in idx]
            next_ids = runner.forward(items, draft=True).argmax(-1).tolist()
            for i, t in zip(idx, next_ids):
                proposals[i].append(int(t))
        return proposals

    def _draft_item(self, s: Request, props: list[int], j: int) -> BatchItem:
        if j:
            return BatchItem(s.kv, props[-1:], s.next_position + j)
        # Catch up from the first position without valid draft KV up to the newest token.
        start = s.num_draft_valid
        return BatchItem(s.kv, s.output[start - s.prompt_len:], start)

    def _accept(self, cache: KvCache, s: Request, props: list[int], greedy: list[int]
                ) -> list[int]:
        """Greedy acceptance, truncation at the request's end, commit of verified KV."""
        a = 0
        while a < len(props) and props[a] == greedy[a]:
            a += 1
        tokens = _truncate(s, props[:a] + [greedy[a]])
        # Positions [p, p + len(tokens)) now hold verified KV: the newest token's and the
        # accepted proposals' (the last emitted token gets its KV next step).
        cache.commit(s.kv, len(tokens))
        p = s.next_position
        if self.ngram is None:
            if props:
                # the draft ran positions [valid_len, p + k_s - 1]; those up to p + a hold
                valid = p + min(a, len(props) - 1) + 1  # committed tokens
                s.num_draft_valid = min(valid, s.kv.committed_len)
            s.draft_lag = s.kv.committed_len - s.num_draft_valid
        st = self.stats
        st.num_seq_steps += 1
        st.num_proposed += len(props)
        st.num_accepted += a
        st.num_emitted += len(tokens)
        return tokens


def _truncate(s: Request, tokens: list[int]) -> list[int]:
    """Cut ``tokens`` at ``max_new_tokens`` and just after a stop token."""
    tokens = tokens[:max(0, s.params.max_new_tokens - len(s.output))]
    hit = next((i for i, t in enumerate(tokens) if s.params.is_stop(t)), None)
    return tokens if hit is None else tokens[:hit + 1]


class MixedStep:
    """Speculation for greedy sequences, one sampled token for the others, in one step.

    Args:
        k: draft tokens per greedy sequence per step (>= 1).
        ngram: n-gram lookup instead of a draft model (see ``SpeculativeStep``).

    Sequences with ``temperature > 0`` run ``greedy_step`` (which samples by their params)
    in a second forward pass, so one sampled request never fails a speculative batch.
    """

    def __init__(self, k: int, ngram: NgramProposer | None = None) -> None:
        self.spec = SpeculativeStep(k, ngram)
        self.stats = self.spec.stats

    def __call__(self, runner: ModelRunner, seqs: list[Request]) -> list[list[int]]:
        greedy = [i for i, s in enumerate(seqs) if s.params.temperature == 0]
        other = [i for i, s in enumerate(seqs) if s.params.temperature != 0]
        out: list[list[int]] = [[] for _ in seqs]
        for part, fn in ((greedy, self.spec), (other, greedy_step)):
            if part:
                for i, toks in zip(part, fn(runner, [seqs[i] for i in part])):
                    out[i] = toks
        return out


def make_step(cfg: ServeConfig) -> StepFn:
    """The step of ``cfg.spec_kind``: ``MixedStep(spec_k)`` with a draft model (a draft
    checkpoint or the model's own layers) or n-gram lookup; ``greedy_step`` without."""
    kind = cfg.spec_kind
    if not kind:
        return greedy_step
    return MixedStep(cfg.spec_k, NgramProposer(cfg.spec_ngram) if kind == "ngram" else None)


def spec_stats(step: StepFn) -> dict:
    """Speculation counters of ``step`` for a worker's stats (empty without speculation)."""
    st = getattr(step, "stats", None)
    if st is None:
        return {}
    return {"spec_proposed": st.num_proposed, "spec_accepted": st.num_accepted,
            "spec_emitted": st.num_emitted, "spec_seq_steps": st.num_seq_steps}
