"""Self-speculative decoding over a continuous batch (a ``StepFn``), greedy and sampled,
with the device read once per step.

Each step, for every running sequence (p = row position of its newest token, which has
no KV yet, so ``committed_len == p`` on entry):

1. the draft catches up: it runs the committed tokens whose draft KV it lacks (the newest
   token, and tokens accepted in the last step that it never ran), then proposes k tokens
   autoregressively, batched over the sequences (draft layers of the same row): each
   proposal is the draft's own draw under the sequence's sampling parameters (greedy:
   its most likely token), with the number the target's draw at that position uses;
2. the target verifies ``[newest] + proposals`` (k + 1 positions) in one pass and draws
   at each position as a plain step would there;
3. acceptance (``common.model.rejection``): proposals are taken while they equal the
   target's draws, then the target's own draw. Every token is the one plain decoding
   emits at its output index, so a seeded request's tokens never depend on where its
   steps begin (a move to another decode, a step without lookahead). Tokens past
   ``max_new_tokens`` or past a stop token are cut off.

All of it is planned on the host before it runs: the draft passes' positions and the
verification's are known, and only their token ids come from the device (the previous
pass's proposals, ``Sourced``). The step's plan goes up in one copy and its result (each
sequence's accepted count and tokens) comes down in one copy.

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

import numpy as np
import torch

from common.config import ServeConfig
from common.kv import KvCache, OutOfPages
from common.model import (
    DRAW,
    BatchItem,
    HostPlan,
    ModelRunner,
    Proposals,
    SamplingArgs,
    Sourced,
    candidates_for,
    choose,
    download,
    exact_rows,
    plan_draws,
    verify,
    verify_on_host,
)
from common.request import Request
from decode_node.batch import StepFn, plain_step
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

    Greedy and sampled sequences alike (see the module doc); with a draft model the cache
    must hold its layers. Not thread-safe (one per decode batch).
    """

    def __init__(self, k: int, ngram: NgramProposer | None = None) -> None:
        if k < 1:
            raise ValueError(f"SpeculativeStep k={k} must be >= 1 (use plain_step for 0)")
        self.k, self.ngram = k, ngram
        self.stats = SpecStats()

    @torch.inference_mode()
    def __call__(self, runner: ModelRunner, seqs: list[Request]) -> list[list[int]]:
        """One speculative step; returns each sequence's new tokens (1 to k + 1)."""
        for s in seqs:
            assert s.kv.committed_len == s.next_position, (s.rid, s.kv, s.next_position)
        ks = [self._make_room(runner, s) for s in seqs]
        lookups = None
        if self.ngram is not None:
            lookups = [self.ngram.propose(s.prompt + s.output, k_s) for s, k_s in zip(seqs, ks)]
            ks = [len(p) for p in lookups]
        plan = _StepPlan(runner, seqs, ks, lookups)
        dev = plan.host.upload()
        done = plan.run(dev)
        # [B, k + 3] result, then the draws and their flags, then the proposals: the
        # step's one read of the device
        packed = download(done.packed)
        out = packed[:, :done.k + 3]
        flagged = np.flatnonzero(out[:, -1])
        if len(flagged):  # CPU only: draws outside their nucleus, drawn again exactly
            out[flagged] = done.again(flagged, packed, np.asarray(ks, np.int64))
        self.stats.num_steps += 1
        return [self._accept(runner.cache, s, int(row[0]), row[1:-1], k_s)
                for s, row, k_s in zip(seqs, out, ks)]

    # -- the host's parts ---------------------------------------------------------------
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

    def _accept(self, cache: KvCache, s: Request, accepted: int, slots: np.ndarray,
                k_s: int) -> list[int]:
        """Truncation at the request's end, commit of verified KV, draft bookkeeping."""
        tokens = _truncate(s, [int(t) for t in slots[:accepted + 1]])
        # Positions [p, p + len(tokens)) now hold verified KV: the newest token's and the
        # accepted proposals' (the last emitted token gets its KV next step).
        cache.commit(s.kv, len(tokens))
        p = s.next_position
        if self.ngram is None:
            if k_s:
                # the draft ran positions [valid_len, p + k_s - 1]; those up to p + a hold
                valid = p + min(accepted, k_s - 1) + 1  # committed tokens
                s.num_draft_valid = min(valid, s.kv.committed_len)
            s.draft_lag = s.kv.committed_len - s.num_draft_valid
        st = self.stats
        st.num_seq_steps += 1
        st.num_proposed += k_s
        st.num_accepted += accepted
        st.num_emitted += len(tokens)
        return tokens


class _StepPlan:
    """One speculative step planned on the host: its draft passes, its verification and
    their draws, in one ``HostPlan``."""

    def __init__(self, runner: ModelRunner, seqs: list[Request], ks: list[int],
                 lookups: list[list[int]] | None) -> None:
        self.runner, self.seqs, self.ks = runner, seqs, ks
        self.k = k = max(ks)
        self.vocab = runner.model.config.vocab_size
        self.host = host = HostPlan(runner.device)
        self.count = host.add(np.asarray(ks, np.int64))
        self.lookups = None if lookups is None else host.add(
            np.array([p + [0] * (k - len(p)) for p in lookups], np.int64).reshape(len(seqs), k))
        self.drafts = [] if lookups is not None else [self._draft_pass(j) for j in range(k)]
        self._verify_pass()

    def _draft_pass(self, j: int) -> tuple:
        """Pass j of the draft: who takes part, its plan, its draws."""
        runner, seqs, k = self.runner, self.seqs, self.k
        rows = [i for i, k_s in enumerate(self.ks) if k_s > j]
        if j == 0:  # catch up from the first position without draft KV to the newest token
            items = [BatchItem(seqs[i].kv, seqs[i].output[seqs[i].num_draft_valid
                                                          - seqs[i].prompt_len:],
                               seqs[i].num_draft_valid) for i in rows]
            sourced = None
        else:  # the previous proposal, from the device
            items = [BatchItem(seqs[i].kv, [0], seqs[i].next_position + j) for i in rows]
            sourced = Sourced(np.arange(len(rows)), np.asarray(rows) * k + j - 1)
        pp = runner.plan(self.host, items, draft=True, sourced=sourced)
        # the number of the target's draw at this position: coupled draws agree often
        sp = plan_draws(self.host, [seqs[i] for i in rows], self.vocab,
                        rows=[(n, j) for n in range(len(rows))], purposes=(DRAW,))
        return self.host.add(np.asarray(rows, np.int64)), pp, sp, j

    def _verify_pass(self) -> None:
        """The target over [newest] + proposals, its draws padded to k + 1 per sequence."""
        seqs, ks, k = self.seqs, self.ks, self.k
        items = [BatchItem(s.kv, s.output[-1:] + [0] * k_s, s.next_position)
                 for s, k_s in zip(seqs, ks)]
        lengths = np.asarray(ks, np.int64) + 1
        firsts = np.cumsum(lengths) - lengths
        dest = np.concatenate([f + 1 + np.arange(k_s) for f, k_s in zip(firsts, ks)] or
                              [np.zeros(0, np.int64)])
        src = np.concatenate([i * k + np.arange(k_s) for i, k_s in enumerate(ks)] or
                             [np.zeros(0, np.int64)])
        self.verify_pass = self.runner.plan(self.host, items, sourced=Sourced(dest, src))
        j = np.arange(k + 1)
        # row b * (k + 1) + j: position j of sequence b (past its proposals: its last)
        self.padded = self.host.add((firsts[:, None] + np.minimum(j, lengths[:, None] - 1)
                                     ).reshape(-1))
        self.verify_draws = plan_draws(self.host, seqs, self.vocab,
                                       rows=[(b, jj) for b in range(len(seqs))
                                             for jj in range(k + 1)])
        if self.verify_draws.penalties:  # position j counts proposals 0 .. j - 1
            earlier = (np.arange(k)[None, None, :] < j[None, :, None]) & \
                (np.arange(k)[None, None, :] < np.asarray(ks)[:, None, None])
            self.earlier = self.host.add(earlier.reshape(len(seqs) * (k + 1), k)
                                         .astype(np.float32))  # k = 0: no proposals

    # -- the device's part ----------------------------------------------------------------
    def run(self, dev) -> _Done:
        runner, k, num_b = self.runner, self.k, len(self.seqs)
        cand = candidates_for(runner.device)
        count = dev[self.count]
        tokens = dev[self.lookups] if self.lookups is not None else \
            self._propose(dev, num_b, cand)
        props = Proposals(tokens, count)
        h = runner.run(self.verify_pass, dev, source=tokens)
        logits = runner.head(self.verify_pass, h, dev[self.padded])  # [B * (k + 1), V]
        args = SamplingArgs.bind(self.verify_draws, dev)
        extra = None
        if self.verify_draws.penalties:
            extra = (tokens.repeat_interleave(k + 1, 0), dev[self.earlier])
        chosen = choose(logits, args, cand, extra=extra)  # [2, B * (k + 1)]
        packed = torch.cat([verify(chosen, props),
                            chosen.view(2, num_b, k + 1).transpose(0, 1).reshape(num_b, -1),
                            tokens], 1)
        return _Done(packed, logits, args, extra, k)

    def _propose(self, dev, num_b: int, cand: int) -> torch.Tensor:
        """The draft passes, each fed the previous one's proposals on the device; [B, k]."""
        runner, k = self.runner, self.k
        tokens = torch.zeros(num_b, k, dtype=torch.int64, device=runner.device)
        for rows_slot, pp, sp, j in self.drafts:
            rows = dev[rows_slot]
            logits = runner.logits(pp, dev, runner.run(pp, dev, source=tokens))
            args = SamplingArgs.bind(sp, dev)
            extra = None
            if sp.penalties and j:
                earlier = tokens[rows, :j]
                extra = (earlier, torch.ones_like(earlier, dtype=torch.float32))
            # a proposal outside its nucleus (CPU's flag) is still a proposal: not redrawn
            tokens[:, j].index_copy_(0, rows, choose(logits, args, cand, extra=extra)[0])
        return tokens


@dataclass
class _Done:
    """A step's device results, kept until its download was read."""

    packed: torch.Tensor
    """[B, 4k + 5]: ``verify``'s [B, k + 3], the draws' tokens [B, k + 1] and flags
    [B, k + 1], the proposals [B, k]."""
    logits: torch.Tensor
    args: SamplingArgs
    extra: tuple[torch.Tensor, torch.Tensor] | None
    k: int

    def again(self, seqs: np.ndarray, packed: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """``seqs``' verification with every flagged draw done again exactly (CPU: reads
        the device again); ``packed`` is the step's download, ``counts`` the proposals
        per sequence. Returns their rows of the result, [len(seqs), k + 3]."""
        k = self.k
        width = k + 1
        draws = packed[:, k + 3:k + 3 + 2 * width].reshape(-1, 2, width)
        first = draws.transpose(1, 0, 2).reshape(2, -1).copy()
        mine = np.zeros_like(first[1])
        mine.reshape(-1, width)[seqs] = 1
        first[1] &= mine  # only the flagged sequences' draws
        final = exact_rows(self.logits, self.args, first, extra=self.extra).reshape(-1, width)
        return verify_on_host(packed[seqs, k + 3 + 2 * width:], counts[seqs], final[seqs])


def _truncate(s: Request, tokens: list[int]) -> list[int]:
    """Cut ``tokens`` at ``max_new_tokens`` and just after a stop token."""
    tokens = tokens[:max(0, s.params.max_new_tokens - len(s.output))]
    hit = next((i for i, t in enumerate(tokens) if s.params.is_stop(t)), None)
    return tokens if hit is None else tokens[:hit + 1]


MixedStep = SpeculativeStep
"""Its name from when sampled sequences ran a plain step beside it (kept for callers)."""


def make_step(cfg: ServeConfig) -> StepFn:
    """The step of ``cfg.spec_kind``: ``SpeculativeStep(spec_k)`` with a draft model (a
    draft checkpoint or the model's own layers) or n-gram lookup; ``plain_step``
    without."""
    kind = cfg.spec_kind
    if not kind:
        return plain_step
    return SpeculativeStep(cfg.spec_k, NgramProposer(cfg.spec_ngram) if kind == "ngram"
                           else None)


def spec_stats(step: StepFn) -> dict:
    """Speculation counters of ``step`` for a worker's stats (empty without speculation)."""
    st = getattr(step, "stats", None)
    if st is None:
        return {}
    return {"spec_proposed": st.num_proposed, "spec_accepted": st.num_accepted,
            "spec_emitted": st.num_emitted, "spec_seq_steps": st.num_seq_steps}
