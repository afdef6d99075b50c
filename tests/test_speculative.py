"""Speculative decoding over a continuous batch reproduces greedy reference output exactly,
and seeded sampled output exactly as plain steps sample it.

Stories at float64 on CPU: sequences of different lengths join and leave a ``DecodeBatch``
driven by ``SpeculativeStep``; at finish every row is freed with ``finish_ranges`` (the
committed part and the lookahead tail in one call), and the recorded free log replays clean.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from common import KvCache
from common.freelog import FreeLogReader, replay_file
from common.kv import ceil_align, ceil_div
from common.model import BatchItem, Model, ModelRunner, generate_greedy, sample
from common.request import Request, SamplingParams
from decode_node.batch import DecodeBatch, finish_ranges, plain_step
from decode_node.ngram import NgramProposer
from decode_node.speculative import SpeculativeStep
from tests.model_helpers import F64, prompt


class Harness:
    """A decode node in miniature: prefill (target + draft), a batch, finish and free."""

    def __init__(self, model: Model, tmp_path, page_size: int, k: int, num_pages: int = 200):
        self.log = tmp_path / "decode.pdkvlog"
        self.cache = KvCache(num_pages, page_size, layout=F64.kv_layout(with_draft=True),
                             log_path=self.log, node="decode")
        self.runner = ModelRunner(model, self.cache)
        self.step = SpeculativeStep(k)
        self.batch = DecodeBatch(self.runner, self.step)
        self.outputs: dict[str, list[int]] = {}
        self.freed: dict[str, list[tuple[int, int]]] = {}

    def join(self, rid: str, tokens: list[int], params: SamplingParams) -> None:
        """Prefill with the target and the draft (a warm draft), then join the batch."""
        kv = self.cache.open_row(rid)
        self.cache.extend(kv, len(tokens))
        item = BatchItem(kv, tokens, 0)
        first = int(self.runner.forward([item])[0].argmax())
        self.runner.forward([item], draft=True)
        self.cache.commit(kv, len(tokens))
        seq = Request(rid, tokens, params, kv=kv, output=[first], num_computed=len(tokens))
        if not self.batch.add(seq):
            self.finish(seq)

    def run_step(self) -> None:
        _, finished = self.batch.step()
        for s in finished:
            self.finish(s)
        self.cache.check_integrity()

    def finish(self, s: Request) -> None:
        assert s.kv.committed_len == s.next_position  # nothing past the output committed
        ranges = finish_ranges(s.kv, self.cache.page_size)
        self.freed[s.rid] = ranges
        self.cache.free_kv_row(s.kv, ranges, reason="finished")
        self.cache.close_row(s.kv)
        self.outputs[s.rid] = s.output

    def drain(self) -> None:
        while len(self.batch):
            self.run_step()

    def close_and_replay(self) -> list[dict]:
        assert self.cache.num_free_pages() == self.cache.num_pages - 1
        self.cache.check_integrity()
        self.cache.close()
        report = replay_file(self.log)
        assert report.ok, report.format()
        return [ev for ev in FreeLogReader(self.log).records if ev.get("op") == "free"]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_batched_speculation_joins_and_leaves_like_the_reference(model, tmp_path,
                                                                 page_size, k):
    lengths, max_new = [19, 5, 33, 12], [20, 9, 14, 1]
    prompts = [prompt(n, seed=n) for n in lengths]
    want = [generate_greedy(model, [p], m)[0] for p, m in zip(prompts, max_new)]
    h = Harness(model, tmp_path, page_size, k)
    h.join("r0", prompts[0], SamplingParams(max_new_tokens=max_new[0]))
    h.join("r1", prompts[1], SamplingParams(max_new_tokens=max_new[1]))
    h.run_step()
    h.run_step()
    h.join("r2", prompts[2], SamplingParams(max_new_tokens=max_new[2]))
    h.join("r3", prompts[3], SamplingParams(max_new_tokens=max_new[3]))  # done at once
    h.drain()
    assert [h.outputs[f"r{i}"] for i in range(4)] == want
    frees = h.close_and_replay()
    assert {ev["reason"] for ev in frees} == {"finished"}
    assert sorted(ev["owner"] for ev in frees) == ["r0", "r1", "r2", "r3"]  # one call each
    st = h.step.stats
    assert 0 < st.num_accepted <= st.num_proposed and 1 < st.mean_accepted_len <= k + 1
    assert st.num_emitted == sum(max_new) - 4  # the first tokens came from prefill


def test_max_new_tokens_mid_speculation_emits_nothing_extra(model, tmp_path):
    p = prompt(21, seed=3)
    want = generate_greedy(model, [p], 7)[0]
    h = Harness(model, tmp_path, 16, k=4)
    h.join("r", p, SamplingParams(max_new_tokens=7))
    h.run_step()  # up to 5 tokens: 6 of 7 at most, then 1 more
    h.drain()
    assert h.outputs["r"] == want
    # Nothing allocated past the last token's position: k was cut to what may be emitted.
    assert h.freed["r"][-1][1] <= len(p) + 7
    h.close_and_replay()


def test_stop_token_inside_an_accepted_run_truncates_and_commits_only_up_to_it(model,
                                                                              tmp_path):
    p = prompt(14, seed=4)
    full = generate_greedy(model, [p], 16)[0]
    stop = full[5]
    want = generate_greedy(model, [p], 16, stop_token=stop)[0]
    assert len(want) < 16
    h = Harness(model, tmp_path, 4, k=4)
    h.join("r", p, SamplingParams(max_new_tokens=16, stop_token=stop))
    h.drain()
    assert h.outputs["r"] == want
    h.close_and_replay()


@pytest.mark.parametrize("page_size", [1, 16])
def test_lookahead_tail_is_freed_in_the_same_call(model, tmp_path, page_size):
    """A row abandoned mid-request (allocated ahead of committed) frees both parts at once."""
    p = prompt(30, seed=6)
    h = Harness(model, tmp_path, page_size, k=4)
    h.join("r", p, SamplingParams(max_new_tokens=40))
    h.run_step()
    h.run_step()
    s = h.batch.remove("r")
    kv = s.kv
    assert kv.allocated_len > kv.committed_len  # lookahead slots beyond the verified KV
    tail = ceil_align(kv.committed_len, page_size)
    want_ranges = [(0, kv.committed_len)] + ([(tail, kv.allocated_len)]
                                             if tail < kv.allocated_len else [])
    assert finish_ranges(kv, page_size) == want_ranges
    h.finish(s)
    frees = h.close_and_replay()
    assert len(frees) == 1  # one call frees every page the row held, tail included
    assert len(frees[0]["pages"]) // 4 == ceil_div(kv.allocated_len, page_size)


def test_reused_lookahead_slots_are_rewritten_exactly(model, tmp_path):
    """Weak acceptance (draft = 1 of 4 layers) leaves stale lookahead KV every step."""
    p = prompt(9, seed=8)
    want = generate_greedy(model, [p], 30)[0]
    h = Harness(model, tmp_path, 1, k=4)
    h.join("r", p, SamplingParams(max_new_tokens=30))
    extended = []
    while len(h.batch):
        s = h.batch.running["r"]
        before = s.kv.allocated_len
        h.run_step()
        extended.append(s.kv.allocated_len - before)
    assert h.outputs["r"] == want
    assert any(0 < e < 5 for e in extended[1:])  # reused slots: extended only what was missing
    h.close_and_replay()


def test_rejects_k_zero_and_speculates_for_sampled_requests_too(model, tmp_path):
    with pytest.raises(ValueError, match="k=0 must be >= 1"):
        SpeculativeStep(0)
    h = Harness(model, tmp_path, 4, k=2)
    h.join("r", prompt(5, seed=1), SamplingParams(max_new_tokens=9, temperature=0.5, seed=3))
    h.drain()  # sampled sequences speculate too (tests/test_rejection.py)
    assert len(h.outputs["r"]) == 9 and h.step.stats.num_proposed > 0
    h.close_and_replay()


@pytest.mark.parametrize("ngram", [False, True])
def test_penalised_greedy_speculation_equals_a_plain_penalised_step(model, tmp_path, ngram):
    """Greedy with vLLM's penalties: each verified position counts the proposals before
    it, so speculation emits what plain steps emit. With n-gram lookup most steps propose
    nothing (k = 0 for the whole batch), which the penalties' bookkeeping must allow."""
    params = SamplingParams(max_new_tokens=12, presence_penalty=0.5, frequency_penalty=0.4,
                            repetition_penalty=1.4)
    prompts = {"a": prompt(7, seed=4), "b": prompt(11, seed=5) * 2}
    outputs = {}
    for name, step in (("plain", plain_step),
                       ("spec", SpeculativeStep(3, NgramProposer(3) if ngram else None))):
        h = Harness(model, tmp_path / name, 4, k=3)
        h.step = step
        h.batch = DecodeBatch(h.runner, step)
        for rid, p in prompts.items():
            h.join(rid, p, params)
        h.drain()
        outputs[name] = h.outputs
        h.close_and_replay()
    assert outputs["spec"] == outputs["plain"]
    plain = {rid: generate_greedy(model, [p], 12)[0] for rid, p in prompts.items()}
    assert outputs["plain"] != plain   # the penalties change these outputs


def _join_drawn(h: Harness, rid: str, tokens: list[int], params: SamplingParams,
                num_prior: int = 0) -> None:
    """As a prefill hands a request over: target and draft KV of ``tokens``, the first
    token drawn by ``params`` at step ``num_prior`` (a moved request's prompt ends with
    the ``num_prior`` tokens it already emitted)."""
    kv = h.cache.open_row(rid)
    h.cache.extend(kv, len(tokens))
    item = BatchItem(kv, tokens, 0)
    logits = h.runner.forward([item])
    h.runner.forward([item], draft=True)
    h.cache.commit(kv, len(tokens))
    first = sample(logits, [params], [rid], [num_prior],
                   history=[(tokens, tokens[len(tokens) - num_prior:])])[0]
    assert h.batch.add(Request(rid, tokens, params, kv=kv, output=[first],
                               num_computed=len(tokens), num_prior=num_prior))


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=24, temperature=0.8, seed=3),
    SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, top_k=40, min_p=0.02,
                   seed=7, presence_penalty=0.3, repetition_penalty=1.2)],
    ids=["plain", "truncated+penalised"])
def test_sampled_speculation_emits_plain_sampling_tokens_wherever_its_steps_begin(
        model, tmp_path, params):
    """Seeded sampled requests: speculation (the model's first layer as the draft) emits
    exactly the tokens plain steps draw, and a request moved after any number of tokens
    (re-prefilled with them, its first token drawn there) goes on with the same tokens.
    Rejection sampling emitted other tokens once a step began at another output index."""
    p = prompt(9, seed=8)
    outs = {}
    for name, step in (("plain", plain_step), ("spec", SpeculativeStep(3))):
        h = Harness(model, tmp_path / name, 4, k=3)
        h.step, h.batch = step, DecodeBatch(h.runner, step)
        _join_drawn(h, "r", p, params)
        h.drain()
        outs[name] = h.outputs["r"]
        h.close_and_replay()
    want = outs["plain"]
    assert len(want) == 24 and outs["spec"] == want
    for n in (1, 2, 5, 11):
        h = Harness(model, tmp_path / f"moved{n}", 4, k=3)
        _join_drawn(h, "r", p + want[:n], replace(params, max_new_tokens=24 - n), n)
        h.drain()
        assert want[:n] + h.outputs["r"] == want, n
        assert h.step.stats.num_accepted > 0
        h.close_and_replay()
