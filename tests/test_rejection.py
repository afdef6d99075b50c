"""Speculation for sampled requests keeps the target's distribution exactly.

Verification (common/model/rejection.py) checked statistically: many sequences at once,
each with its own seed, draft proposals drawn from a draft distribution unlike the
target's; every emitted token must follow the target's (truncated) distribution at its
position, which a chi-square test checks (alpha about 1e-4, fixed seeds: no flakes).
Every emitted token is the target's own draw at its position. Then the same through a
real ``SpeculativeStep`` against plain sampling.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from common import KvCache
from common.model import BatchItem, Model, ModelRunner
from common.model.plan import HostPlan
from common.model.rejection import Proposals, verify
from common.model.sampling import (
    SamplingArgs,
    choose,
    plan_sampling,
)
from common.request import Request, SamplingParams
from decode_node.batch import DecodeBatch, plain_step
from decode_node.speculative import SpeculativeStep
from tests.model_helpers import F64, prompt
from tests.stats_helpers import chi_square_ok, logits_of, reference_probs

TARGET = [[0.30, 0.22, 0.16, 0.12, 0.08, 0.06, 0.04, 0.02],
          [0.05, 0.05, 0.40, 0.10, 0.10, 0.20, 0.05, 0.05],
          [0.125] * 8]
DRAFT_PROBS = [[0.05, 0.40, 0.05, 0.30, 0.05, 0.05, 0.05, 0.05],
               [0.30, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10]]
N = 12000


def run_verify(p: SamplingParams, point_masses: list[int] | None = None,
               with_draws: bool = False):
    """N sequences, k = 2: draft draws (or fixed point masses), then ``verify``; with
    ``with_draws`` also the target's own draws [N, k + 1]."""
    k, v = 2, 8
    host = HostPlan("cpu")
    params = [SamplingParams(**{**p.to_dict(), "seed": i}) for i in range(N)]
    keys = [i * 7919 for i in range(N)]
    drafts = [plan_sampling(host, params, keys, [j] * N, vocab_size=v) for j in range(k)]
    target = plan_sampling(host, [q for q in params for _ in range(k + 1)],
                           [key for key in keys for _ in range(k + 1)],
                           [j for _ in range(N) for j in range(k + 1)], vocab_size=v)
    dev = host.upload()
    if point_masses is not None:
        tokens = torch.tensor([point_masses] * N)
    else:  # each position's draft draw takes the number of the target's draw there
        tokens = torch.stack([choose(logits_of(DRAFT_PROBS[j]).expand(N, v),
                                     SamplingArgs.bind(sp, dev), 0)[0]
                              for j, sp in enumerate(drafts)], 1)
    args = SamplingArgs.bind(target, dev)
    logits = torch.stack([logits_of(t) for t in TARGET]).repeat(N, 1)
    chosen = choose(logits, args, 0)
    out = verify(chosen, Proposals(tokens, torch.full((N,), k))).numpy()
    return (out, chosen[0].view(N, k + 1).numpy()) if with_draws else out


def check_positions(out: np.ndarray, p: SamplingParams) -> None:
    """Slot j holds the token at position j for sequences that accepted j proposals or
    more; each must follow the target's distribution there."""
    accepted = out[:, 0]
    for j in range(3):
        tokens = out[accepted >= j, 1 + j]
        counts = np.bincount(tokens, minlength=8)
        ok, stat, crit = chi_square_ok(counts, reference_probs(np.log(TARGET[j]), p))
        assert ok, (j, counts.tolist(), stat, crit)
    assert 0 < (accepted == 0).sum() and 0 < (accepted == 2).sum()


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9),
                                dict(temperature=1.2, top_k=5, min_p=0.1)],
                         ids=["plain", "top_p", "top_k+min_p"])
def test_speculation_keeps_the_target_distribution(kw):
    p = SamplingParams(**kw)
    out, draws = run_verify(p, with_draws=True)
    check_positions(out, p)
    # every emitted token is the target's own draw at its position
    for j in range(3):
        upto = out[:, 0] >= j
        assert (out[upto, 1 + j] == draws[upto, j]).all()


def test_point_mass_proposals_keep_it_too():
    """n-gram lookup's proposals: q is one at the proposal."""
    p = SamplingParams(temperature=1.0)
    out = run_verify(p, point_masses=[3, 2])
    check_positions(out, p)
    # p_0(3) = 0.12: about that share of sequences accept the first proposal
    assert abs((out[:, 0] >= 1).mean() - 0.12) < 0.02


def test_a_draft_equal_to_the_target_is_always_accepted():
    global DRAFT_PROBS
    saved, DRAFT_PROBS = DRAFT_PROBS, TARGET[:2]
    try:
        out = run_verify(SamplingParams(temperature=1.0))
    finally:
        DRAFT_PROBS = saved
    assert (out[:, 0] == 2).all()


def first_tokens(model, draft, step, n: int) -> np.ndarray:
    """The token after a short prompt's first one, for ``n`` seeds, from one step."""
    layout = replace(F64.kv_layout(False), num_draft_layers=draft.config.num_layers)
    cache = KvCache(n * 2 + 8, 16, layout=layout, max_rows=n)
    runner = ModelRunner(model, cache, draft)
    batch = DecodeBatch(runner, step)
    ids = prompt(10, seed=9)
    for i in range(n):
        kv = cache.open_row(f"r{i}")
        cache.extend(kv, len(ids))
        runner.forward([BatchItem(kv, ids, 0)])
        runner.forward([BatchItem(kv, ids, 0)], draft=True)
        cache.commit(kv, len(ids))
        batch.add(Request(f"r{i}", ids, SamplingParams(max_new_tokens=8, temperature=1.5,
                                                       top_p=0.95, seed=i),
                          kv=kv, output=[ids[0]], num_computed=len(ids)))
    seqs = list(batch.running.values())
    batch.step()
    return np.array([s.output[1] for s in seqs])


def test_a_speculative_step_samples_like_a_plain_one(model):
    """Through the model: the first sampled token of 800 seeds, speculative (k = 3) against
    plain. The draft is an unrelated model (another seed), so a step that kept its
    proposals unchecked would sample the draft's distribution; each token is the plain
    step's own, seed by seed."""
    draft = Model(F64.with_overrides(seed=11, num_layers=2, num_draft_layers=0))
    spec = first_tokens(model, draft, SpeculativeStep(3), 800)
    plain = first_tokens(model, draft, plain_step, 800)
    assert len(set(plain.tolist())) > 20 and (spec == plain).all()


def test_a_flat_target_nucleus_past_the_cpu_candidates_is_verified_again(model, monkeypatch):
    """CPU: with few candidates a flat distribution's nucleus passes them; the draws of the
    marked sequences are done again exactly (``exact_rows``), as a plain step does them."""
    from common.model import sampling
    from decode_node import speculative
    monkeypatch.setattr(sampling, "CPU_CANDIDATES", 4)
    again = []
    redo = speculative._Done.again

    def counted(self, seqs, *rest):
        again.append(len(seqs))
        return redo(self, seqs, *rest)

    monkeypatch.setattr(speculative._Done, "again", counted)
    draft = Model(F64.with_overrides(seed=11, num_layers=2, num_draft_layers=0))
    tokens = first_tokens(model, draft, SpeculativeStep(3), 6)
    assert again and again[0] == 6  # every row's nucleus (temperature 1.5) passes 4 tokens
    assert (tokens == first_tokens(model, draft, plain_step, 6)).all()
