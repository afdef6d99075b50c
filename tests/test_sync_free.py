"""A step waits for the device once: one copy of its plan in, one copy of its ids out.

Each story runs one kind of step (a prefill chunk, a decode step, a sampled step with
penalties and truncation, a speculative verification with a draft model, greedy and
sampled, and with n-gram lookup, the colocated worker's mixed step) under
``SyncRecorder`` (tests/sync_recorder.py), which fails on anything that would make a
GPU's host wait: ``.item()``, ``.tolist()``, data-dependent shapes, tensors made from
host data, copies to the host. The last tests insert such a call into the step and check
that the recorder catches it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from common import KvCache
from common.model import BatchItem, ModelRunner, sampling
from common.model.attention import TorchAttention
from common.node import PrefillEngine
from common.request import Request, SamplingParams
from decode_node.batch import DecodeBatch, plain_step
from decode_node.ngram import NgramProposer
from decode_node.speculative import SpeculativeStep
from tests.model_helpers import F64, prompt
from tests.sync_recorder import SyncRecorder

GREEDY = SamplingParams(max_new_tokens=12)
SAMPLED = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, top_k=8, min_p=0.01,
                         seed=5, presence_penalty=0.5, frequency_penalty=0.3,
                         repetition_penalty=1.2)


def decoding(model, params: list[SamplingParams], step, page_size: int = 4) -> DecodeBatch:
    """Sequences past their prompt (target and draft KV computed), in a batch."""
    cache = KvCache(160, page_size, layout=F64.kv_layout(with_draft=True))
    runner = ModelRunner(model, cache)
    batch = DecodeBatch(runner, step)
    for i, p in enumerate(params):
        ids = prompt(9 + 4 * i, seed=i)
        kv = cache.open_row(f"r{i}")
        cache.extend(kv, len(ids))
        runner.forward([BatchItem(kv, ids, 0)])
        runner.forward([BatchItem(kv, ids, 0)], draft=True)
        cache.commit(kv, len(ids))
        batch.add(Request(f"r{i}", ids, p, kv=kv, output=[ids[-1]], num_computed=len(ids)))
    return batch


def one_step(batch: DecodeBatch) -> SyncRecorder:
    with SyncRecorder() as rec:
        emitted, _ = batch.step()
    assert all(toks for _, toks in emitted)
    return rec


def assert_one_transfer_each_way(rec: SyncRecorder) -> None:
    assert rec.violations == []
    assert (rec.uploads, rec.downloads) == (1, 1)
    # only the CPU's rejection draws may draw again, past the step's one download
    assert rec.redraws <= (1 if MODE["value"] == sampling.HISTOGRAM else 0)


MODE = {"value": 0}


@pytest.fixture(autouse=True, params=[0, 16, sampling.HISTOGRAM],
                ids=["sort", "topk16", "cpu"])
def truncation(request, monkeypatch):
    """Each way truncation reads a row: a sort (CUDA's), 16 sorted candidates (fewer than
    the tiny vocabulary has; top_k=8 keeps every nucleus inside them) and the CPU's
    (histogram, rejection). The CPU's may read the device a second time, by design, when
    a draw fell outside its nucleus and is drawn again."""
    monkeypatch.setattr(sampling, "CPU_CANDIDATES", request.param)
    monkeypatch.setattr(sampling, "candidates_for", lambda device: request.param)
    monkeypatch.setattr("decode_node.speculative.candidates_for", lambda device: request.param)
    MODE["value"] = request.param


def test_a_prefill_chunk_and_the_pass_that_samples_the_first_token(model):
    cache = KvCache(64, 4, layout=F64.kv_layout(with_draft=True))
    engine = PrefillEngine(ModelRunner(model, cache), chunk_size=16, max_tokens=32,
                           with_draft=True)
    reqs = [Request(f"p{i}", prompt(24, seed=i), SAMPLED if i else GREEDY) for i in range(2)]
    for r in reqs:
        r.kv = cache.open_row(r.rid)
        cache.extend(r.kv, r.prompt_len)
        engine.add(r)
    with SyncRecorder() as rec:  # 16 + 16 tokens: no prompt finishes, nothing comes back
        engine.step()
    assert rec.violations == [] and (rec.uploads, rec.downloads) == (1, 0)
    with SyncRecorder() as rec:  # the rest: both first tokens, in one copy
        _, finished = engine.step()
    assert_one_transfer_each_way(rec)
    assert [len(r.output) for r in finished] == [1, 1]


def test_a_greedy_decode_step(model):
    assert_one_transfer_each_way(one_step(decoding(model, [GREEDY] * 3, plain_step)))


def test_a_sampled_step_with_penalties_and_truncation(model):
    batch = decoding(model, [SAMPLED, GREEDY, SAMPLED], plain_step)
    one_step(batch)  # outputs to penalise
    assert_one_transfer_each_way(one_step(batch))


@pytest.mark.parametrize("params", [[GREEDY] * 3, [SAMPLED, GREEDY, SAMPLED]],
                         ids=["greedy", "mixed"])
def test_a_speculative_verification_with_a_draft_model(model, params):
    batch = decoding(model, params, SpeculativeStep(3))
    one_step(batch)  # draft KV to catch up on in the next step
    rec = one_step(batch)
    assert_one_transfer_each_way(rec)
    assert batch.step_fn.stats.num_proposed > 0


def test_a_speculative_verification_by_ngram_lookup(model):
    params = [replace(p, max_new_tokens=30) for p in (SAMPLED, GREEDY)]
    batch = decoding(model, params, SpeculativeStep(3, NgramProposer(2)))
    for s in batch.running.values():  # a repeated tail: the lookup proposes
        s.output = s.prompt[-4:] + s.prompt[-4:]
        s.kv.committed_len = s.next_position
        batch.runner.cache.extend(s.kv, s.next_position + 1 - s.kv.allocated_len)
    assert_one_transfer_each_way(one_step(batch))
    assert batch.step_fn.stats.num_proposed == 6


def test_a_colocated_mixed_step(tmp_path):
    """The colocated worker's mixed step (decode tokens and prompt chunks in one pass, a
    prompt ending in it) under the recorder: one copy in, one copy of every id out."""
    from common.config import ServeConfig
    from common.control import Req, pack_ids
    from deploy.launch.colocated import ColocatedWorker
    from tests.fakes import FakeLink

    cfg = ServeConfig(dtype="float64", page_size=4, decode_pages=64, chunk_size=8,
                      max_prefill_tokens=16, spec_k=0, offload=False, heartbeat_s=0.2,
                      lease_s=3.0)
    worker = ColocatedWorker("c0", FakeLink(), log_dir=str(tmp_path))
    worker.start(cfg)
    recs: list[tuple[SyncRecorder, int]] = []
    inner = worker._mixed_forward

    def recorded(runner, seqs, chunks):
        with SyncRecorder() as rec:
            out = inner(runner, seqs, chunks)
        recs.append((rec, len(worker._computed)))
        return out

    worker._mixed_forward = recorded
    try:
        sampled = {**SAMPLED.to_dict(), "max_new_tokens": 8}  # penalties, truncation
        worker.dispatch(Req("a", pack_ids(prompt(6, seed=1)), sampled, prefill="",
                            prefill_addr="", decode="c0"))
        while not worker.scheduler.batch.running:
            worker.tick()
        worker.dispatch(Req("b", pack_ids(prompt(10, seed=2)), {"max_new_tokens": 4},
                            prefill="", prefill_addr="", decode="c0"))
        for _ in range(4):
            worker.tick()
    finally:
        worker.close()
    assert any(ended for _, ended in recs)  # a step that ended b's prompt and drew for it
    for rec, _ in recs:
        assert_one_transfer_each_way(rec)


# -- the recorder can fail --------------------------------------------------------------------
def test_an_item_inside_attention_is_caught(model, monkeypatch):
    attend = TorchAttention.attend

    def reading(self, state, args):
        if args.q.abs().sum().item() < 0:  # a host read of a device value
            raise AssertionError
        return attend(self, state, args)

    monkeypatch.setattr(TorchAttention, "attend", reading)
    rec = one_step(decoding(model, [GREEDY] * 2, plain_step))
    # one per layer of the pass, each naming the line that read the device
    assert len(rec.violations) >= F64.num_layers
    assert all("item" in v and "test_sync_free.py" in v for v in rec.violations)


def test_a_tolist_and_a_boolean_index_in_sampling_are_caught(model, monkeypatch):
    choose = sampling.choose

    def leaky(logits, args, *a, **kw):
        logits[logits > 1e9]  # a data-dependent shape
        logits.argmax(-1).tolist()  # a copy out
        return choose(logits, args, *a, **kw)

    monkeypatch.setattr("decode_node.speculative.choose", leaky)
    rec = one_step(decoding(model, [GREEDY] * 2, SpeculativeStep(2)))
    kinds = " ".join(rec.violations)
    assert "boolean index" in kinds and "Tensor.tolist" in kinds
    assert rec.downloads == 1  # the step's own copy out still counts once


def test_a_cpu_redraw_is_counted_apart_from_the_steps_two_copies():
    """A flat row with a small top_p: its rejection draw falls outside the nucleus and is
    drawn again (CPU only), after the one download; nothing else reads the device."""
    if MODE["value"] != sampling.HISTOGRAM:
        pytest.skip("the CPU's rejection draws only")
    logits = torch.linspace(0, 1, 300).expand(4, -1).contiguous()
    params = [SamplingParams(temperature=1.0, top_p=0.3, seed=i) for i in range(4)]
    with SyncRecorder() as rec:
        sampling.sample(logits, params, [""] * 4, [0] * 4)
    assert rec.violations == [] and (rec.uploads, rec.downloads, rec.redraws) == (1, 1, 1)
