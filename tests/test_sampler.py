"""The batched device sampler: what each row draws from, that its draws follow it, that a
request's draws depend on its seed and step alone, and the penalties as vLLM defines them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.model import sample, sampling
from common.model.plan import HostPlan
from common.model.sampling import SamplingArgs, plan_sampling, process, seed_key
from common.request import BadRequest, SamplingParams, validate
from tests.stats_helpers import chi_square_ok, logits_of, reference_probs

PROBS = [0.30, 0.22, 0.16, 0.12, 0.08, 0.06, 0.04, 0.02]


def frequencies(logits: torch.Tensor, p: SamplingParams, n: int = 6000) -> np.ndarray:
    """Token counts of ``n`` draws of one row, batched as ``n`` requests with their own
    seeds (one sampler call)."""
    rows = logits.expand(n, -1)
    params = [SamplingParams(**{**p.to_dict(), "seed": i}) for i in range(n)]
    tokens = sample(rows, params, [""] * n, [0] * n)
    return np.bincount(tokens, minlength=logits.shape[-1])


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.6),
                                dict(temperature=1.3, top_p=0.7), dict(temperature=1.0, top_k=3),
                                dict(temperature=0.9, min_p=0.2),
                                dict(temperature=1.0, top_k=6, top_p=0.8, min_p=0.05)],
                         ids=["t1", "t0.6", "top_p", "top_k", "min_p", "all"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", [sampling.HISTOGRAM, 3, 0], ids=["cpu", "topk3", "sort"])
def test_draws_follow_the_truncated_distribution(kw, dtype, mode, monkeypatch):
    """On CPU (rejection, redraws by the histogram), with 3 sorted candidates (nuclei past
    them drawn again) and with a sort (CUDA's way)."""
    monkeypatch.setattr(sampling, "CPU_CANDIDATES", mode)
    p = SamplingParams(**kw)
    logits = logits_of(PROBS, dtype)
    counts = frequencies(logits, p)
    ok, stat, crit = chi_square_ok(counts, reference_probs(logits.double().numpy(), p))
    assert ok, (counts.tolist(), stat, crit)


def test_a_request_draws_alike_whatever_its_batch_and_wherever_it_runs():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 300, generator=gen) * 3
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) if i % 3 else
              SamplingParams() for i in range(16)]
    steps = list(range(16))
    together = sample(logits, params, ["x"] * 16, steps)
    alone = [sample(logits[i:i + 1], [params[i]], ["x"], [i])[0] for i in range(16)]
    shuffled = sample(logits.flip(0), params[::-1], ["x"] * 16, steps[::-1])[::-1]
    assert together == alone == shuffled
    assert together[0::3] == logits[0::3].argmax(-1).tolist()  # greedy rows: argmax


def test_seeds_and_labels_and_steps_each_change_the_draws():
    logits = torch.zeros(1, 1000)  # uniform: every draw is its uniform number
    base = SamplingParams(temperature=1.0, seed=7)
    one = [sample(logits, [base], ["a"], [s])[0] for s in range(20)]
    assert one == [sample(logits, [base], ["b"], [s])[0] for s in range(20)]  # label unused
    assert one != [sample(logits, [SamplingParams(temperature=1.0, seed=8)], ["a"], [s])[0]
                   for s in range(20)]
    unseeded = SamplingParams(temperature=1.0)
    a = [sample(logits, [unseeded], ["a"], [s])[0] for s in range(20)]
    assert a == [sample(logits, [unseeded], ["a"], [s])[0] for s in range(20)]
    assert a != [sample(logits, [unseeded], ["b"], [s])[0] for s in range(20)]
    assert len(set(one)) > 15  # the steps draw independently


def test_rows_a_cpu_draw_cannot_settle_are_marked_for_an_exact_redraw(monkeypatch):
    """By rejection, a draw outside the nucleus; by few candidates, a nucleus past them:
    each is marked, and ``exact_rows`` draws it again (the chi-square tests above check
    the result for both ways)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.cat([torch.randn(8, 400, generator=gen) * 0.1,  # flat: nucleus ~ 360
                        torch.randn(8, 400, generator=gen) * 8])    # peaked: a few tokens
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i) for i in range(16)]
    host = HostPlan("cpu")
    sp = plan_sampling(host, params, [seed_key(p, "") for p in params], [0] * 16,
                       vocab_size=400)
    args = SamplingArgs.bind(sp, host.upload())
    d = process(logits, args, candidates=32)
    assert d.uncovered.tolist() == [True] * 8 + [False] * 8
    flat = logits[:1].expand(2000, -1)
    many = [SamplingParams(temperature=1.0, top_p=0.9, seed=i) for i in range(2000)]
    host = HostPlan("cpu")
    sp = plan_sampling(host, many, list(range(2000)), [0] * 2000, vocab_size=400)
    rate = sampling.choose(flat, SamplingArgs.bind(sp, host.upload()),
                           sampling.HISTOGRAM)[1].double().mean().item()
    assert 0.05 < rate < 0.15  # about 1 - top_p of a flat row's draws fall outside


def reference_penalties(logits: np.ndarray, prompt: list[int], output: list[int],
                        p: SamplingParams) -> np.ndarray:
    """vLLM's apply_penalties, one row, written out."""
    x = logits.astype(np.float64).copy()
    counts = np.bincount(output, minlength=len(x)).astype(np.float64)
    seen = np.zeros(len(x), bool)
    seen[prompt] = True
    seen |= counts > 0
    x[seen] = np.where(x[seen] > 0, x[seen] / p.repetition_penalty,
                       x[seen] * p.repetition_penalty)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def test_penalties_as_vllm_defines_them():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 20, generator=gen, dtype=torch.float64)
    params = [SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25,
                             repetition_penalty=1.3),
              SamplingParams(),  # no penalties: untouched
              SamplingParams(repetition_penalty=0.8)]  # greedy requests get them too
    history = [([1, 2, 3], [3, 4, 4, 4]), ([5], [5, 6]), ([7, 8], [9, 9])]
    host = HostPlan("cpu")
    sp = plan_sampling(host, params, [1, 2, 3], [4, 2, 2], vocab_size=20, history=history)
    got = process(logits, SamplingArgs.bind(sp, host.upload()), candidates=0).x
    for i, (p, (prompt, out)) in enumerate(zip(params, history)):
        np.testing.assert_allclose(got[i].numpy(), reference_penalties(
            logits[i].numpy(), prompt, out, p), rtol=0, atol=1e-12)
    assert sample(logits[2:], [params[2]], [""], [2], [history[2]]) == [
        int(np.argmax(reference_penalties(logits[2].numpy(), *history[2], params[2])))]


def test_a_step_without_penalties_ignores_histories():
    logits = logits_of(PROBS)[None]
    assert sample(logits, [SamplingParams()], [""], [0]) == [0]


@pytest.mark.parametrize("kw, name", [
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"presence_penalty": True}, "presence_penalty")])
def test_penalty_and_min_p_ranges_are_vllms(kw, name):
    with pytest.raises(BadRequest, match=name):
        validate([1], SamplingParams(**kw), vocab_size=8, max_tokens=64,
                 max_new_tokens_limit=16)


def test_new_fields_travel_only_when_set():
    assert "repetition_penalty" not in SamplingParams().to_dict()
    p = SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.0,
                       presence_penalty=0.2)
    assert SamplingParams.from_dict(p.to_dict()) == p
    # what vLLM's own client sends with every request is accepted as it is
    assert validate([1], SamplingParams.from_dict({"repetition_penalty": 1.0}), vocab_size=8,
                    max_tokens=64, max_new_tokens_limit=16) == SamplingParams()


def test_block_draws_over_a_large_vocabulary_match_one_cumulative_sum():
    """The blocked inverse (block sums, then one block) picks what one float64 cumulative
    sum over the row picks, and never a token of weight 0."""
    gen = torch.Generator().manual_seed(4)
    w = torch.rand(256, 49152, generator=gen) ** 8
    w[w < 0.2] = 0  # most of the vocabulary cut away
    u = torch.rand(256, generator=gen, dtype=torch.float64)
    blocked = sampling.draw_weighted(w, u)
    plain = sampling.draw_weighted(w, u, blocks=False)
    assert (w.gather(1, blocked[:, None]) > 0).all()
    assert (blocked == plain).float().mean() >= 0.99
    # a row drawn many times follows its weights: mean index within 1% of the expected
    row = w[:1].expand(20000, -1)
    draws = sampling.draw_weighted(row, torch.rand(20000, generator=gen, dtype=torch.float64))
    expected = float((w[0].double() * torch.arange(49152)).sum() / w[0].double().sum())
    assert abs(draws.double().mean().item() - expected) < 0.01 * expected


@pytest.mark.parametrize("spread", [0.05, 1.0, 4.0, 12.0], ids=["flat", "wide", "peaked",
                                                               "sharp"])
def test_the_histogram_finds_the_sorted_nucleus_edge(spread):
    """The CPU's top-p threshold (a mass histogram, then a sort of one bin) equals the
    threshold a full sort finds, for nuclei of a few to tens of thousands of tokens."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(12, 49152, generator=gen) * spread
    logits[0, :300] = logits[0, 300]  # ties at the edge
    params = [SamplingParams(temperature=t, top_p=p, seed=1) for t, p in
              zip([1.0, 0.7, 1.5] * 4, [0.9, 0.5, 0.99, 0.3] * 3)]
    host = HostPlan("cpu")
    sp = plan_sampling(host, params, [1] * 12, [0] * 12, vocab_size=49152)
    args = SamplingArgs.bind(sp, host.upload())
    hist = process(logits, args, candidates=sampling.HISTOGRAM)
    exact = process(logits, args, candidates=0)
    assert not hist.uncovered.any()
    assert torch.equal(hist.thr, exact.thr)
    torch.testing.assert_close(hist.mass, exact.mass, rtol=1e-6, atol=0)


def test_an_edge_bin_too_full_to_sort_is_drawn_again(monkeypatch):
    monkeypatch.setattr(sampling, "EDGE_TOKENS", 8)
    logits = torch.zeros(2, 4096)  # one bin holds the whole vocabulary
    params = [SamplingParams(temperature=1.0, top_p=0.5, seed=i) for i in range(2)]
    host = HostPlan("cpu")
    sp = plan_sampling(host, params, [1, 2], [0, 0], vocab_size=4096)
    d = process(logits, SamplingArgs.bind(sp, host.upload()), candidates=sampling.HISTOGRAM)
    assert d.uncovered.all()
    assert sample(logits, params, ["", ""], [0, 0]) == sample(
        logits, params, ["", ""], [0, 0])  # drawn again exactly, reproducibly
