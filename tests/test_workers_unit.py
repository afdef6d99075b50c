"""In-process stories of the worker pieces: chunked prefill, continuous batching,
admission, validation, sampling, workloads. Real KvCache, real model (float64)."""

from __future__ import annotations

import pytest

from common import KvCache
from common.config import ServeConfig
from common.freelog import replay_file
from common.model import ModelRunner, generate_greedy, sample
from common.request import BadRequest, ReqState, SamplingParams, validate
from decode_node.admission import Admission, WorkItem
from decode_node.batch import DecodeBatch, DecodeSeq, finish_ranges
from deploy.workload import WorkloadSpec, make_workload
from prefill_node.engine import PrefillEngine, PrefillTask
from prefill_node.worker import _union_length
from tests.model_helpers import F64

CFG = F64


def _cache(num_pages=256, page_size=4, log=None):
    return KvCache(num_pages, page_size, layout=CFG.kv_layout(False), log_path=log,
                   node="unit", max_rows=32)


def _serve(runner, prompts, params, chunk=5, budget=12):
    """Prefill + decode every prompt colocated-style; returns outputs by index."""
    cache = runner.cache
    engine, batch, outs = PrefillEngine(runner, chunk, budget), DecodeBatch(runner), {}
    for i, p in enumerate(prompts):
        kv = cache.open_row(f"r{i}")
        cache.extend(kv, len(p))
        engine.add(PrefillTask(f"r{i}", p, params, kv))
    while engine.has_work or len(batch):
        _, done = engine.step()
        for t in done:
            seq = DecodeSeq(t.rid, t.kv, params, len(t.prompt), [t.first_token])
            if not batch.add(seq):
                outs[t.rid] = seq
        outs.update({s.rid: s for s in batch.step()[1]})
    for seq in outs.values():
        cache.free_kv_row(seq.kv, finish_ranges(seq.kv, cache.page_size), reason="finished")
        cache.close_row(seq.kv)
    return [outs[f"r{i}"].output for i in range(len(prompts))]


def test_chunked_prefill_and_batched_decode_match_the_reference(model, tmp_path):
    prompts = [[(7 * i + 3 * j) % CFG.vocab_size for j in range(n)]
               for i, n in enumerate([1, 5, 13, 40, 17])]
    cache = _cache(log=tmp_path / "u.log")
    outs = _serve(ModelRunner(model, cache), prompts, SamplingParams(max_new_tokens=9))
    assert outs == generate_greedy(model, prompts, 9, page_size=4)
    cache.check_integrity()
    assert cache.num_free_pages() == 255
    cache.close()
    assert replay_file(tmp_path / "u.log").ok


def test_stop_token_ends_a_sequence_and_is_included(model):
    prompt = [3, 1, 4, 1, 5]
    free_run = generate_greedy(model, [prompt], 8, page_size=4)[0]
    stop = free_run[3]
    cache = _cache()
    out = _serve(ModelRunner(model, cache), [prompt],
                 SamplingParams(max_new_tokens=8, stop_token=stop))[0]
    assert out == free_run[:free_run.index(stop) + 1]


def test_max_new_tokens_one_never_joins_the_batch(model):
    cache = _cache()
    out = _serve(ModelRunner(model, cache), [[9, 9, 9]], SamplingParams(max_new_tokens=1))
    assert out == generate_greedy(model, [[9, 9, 9]], 1, page_size=4)
    assert cache.num_free_pages() == 255


def test_finish_ranges_cover_committed_part_and_lookahead_tail():
    cache = _cache(page_size=4)
    kv = cache.open_row("a")
    cache.extend(kv, 14)     # pages for positions [0, 16)
    cache.commit(kv, 9)      # positions [9, 14) are speculative lookahead
    assert finish_ranges(kv, 4) == [(0, 9), (12, 14)]
    kv2 = cache.open_row("b")
    cache.extend(kv2, 8)
    cache.commit(kv2, 8)
    assert finish_ranges(kv2, 4) == [(0, 8)]


def test_a_full_pool_queues_in_fifo_order_and_admits_when_pages_come_back():
    cache = _cache(num_pages=11, page_size=4)     # 10 usable pages = 40 tokens
    adm = Admission(cache, max_running=8)
    params = SamplingParams(max_new_tokens=9)     # rows of prompt + 8 positions
    big, small = WorkItem("big", [1] * 20, params), WorkItem("small", [1] * 4, params)
    first = WorkItem("first", [1] * 12, params)   # needs ceil(20 / 4) = 5 pages
    for item in (first, big, small):
        adm.enqueue(item)
    assert adm.admit_next() is first and first.kv.allocated_len == 12
    assert adm.admit_next() is None               # big needs 7 pages, 10 - 5 reserved
    assert list(adm.queue) == ["big", "small"]    # small does not overtake big
    adm.release(first, finish_ranges(first.kv, 4), "finished")
    assert adm.admit_next() is big              # 7 pages reserved, 5 allocated
    assert adm.admit_next() is small            # 3 pages reserved: the pool is spoken for
    assert cache.num_free_pages() == 4 and adm.num_free_tokens == 0


@pytest.mark.parametrize("prompt, params, words", [
    ([], SamplingParams(), "empty prompt"),
    ([1, 600], SamplingParams(), "[0, 512)"),
    ([1], SamplingParams(max_new_tokens=0), "max_new_tokens"),
    ([1], SamplingParams(temperature=-1.0), "temperature"),
    ([1], SamplingParams(temperature=float("nan")), "temperature"),
    ([1], SamplingParams(stop_token=9999), "stop_token"),
    ([1] * 90, SamplingParams(max_new_tokens=20), "exceeds the largest pool row"),
])
def test_bad_requests_are_refused_with_a_message_that_names_the_problem(prompt, params,
                                                                         words):
    with pytest.raises(BadRequest, match=words.replace("[", r"\[").replace(")", r"\)")):
        validate(prompt, params, vocab_size=512, max_tokens=100, max_new_tokens_limit=64)


def test_unknown_sampling_parameter_is_refused():
    with pytest.raises(BadRequest, match="unknown sampling parameters"):
        SamplingParams.from_dict({"top_q": 1})


def test_lifecycle_predicates():
    assert not ReqState.DECODING.is_finished and ReqState.ABORTED.is_finished
    assert ReqState.WAITING_KV.holds_kv and not ReqState.QUEUED.holds_kv
    retracted = ReqState.RETRACTED    # committed KV in the host tier, no device row
    assert retracted.is_retracted and not retracted.holds_kv and not retracted.is_finished
    assert ReqState.DECODING < retracted < ReqState.FINISHED


def test_temperature_sampling_is_a_pure_function_of_seed_rid_and_step():
    import torch
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=3)
    a = sample(logits, [p, p], ["x", "y"], [0, 5])
    assert a == sample(logits, [p, p], ["x", "y"], [0, 5])
    assert sample(logits, [SamplingParams()] * 2, ["x", "y"], [0, 0]) == \
        logits.argmax(-1).tolist()


def test_workload_is_a_pure_function_of_the_seed():
    spec = WorkloadSpec(requests=20, seed=7, rate=5.0)
    a, b = make_workload(spec, 512), make_workload(spec, 512)
    assert a == b and a[0].rid == "s7-r00000" and a[0].arrival_s == 0.0
    assert all(16 <= len(r.prompt) <= 256 and 8 <= r.max_new_tokens <= 48 for r in a)
    assert make_workload(WorkloadSpec(requests=20, seed=8), 512) != a


def test_config_validation_names_allowed_values():
    with pytest.raises(ValueError, match="allowed"):
        ServeConfig(model="huge")
    with pytest.raises(ValueError, match="allowed"):
        ServeConfig(transport="udp")
    with pytest.raises(ValueError, match="unknown config keys"):
        ServeConfig.from_dict({"pages": 3})
    assert ServeConfig.from_dict(ServeConfig().to_dict()) == ServeConfig()


def test_union_of_streaming_windows():
    assert _union_length([(0, 2), (1, 3), (5, 6)]) == 4


def test_router_picks_the_least_loaded_workers_that_can_hold_the_request():
    from deploy.placement import WorkerInfo, admits_at_once, pick
    d0 = WorkerInfo("d0", "decode", b"d0", pool_tokens=1000, ready=True, assigned=500)
    d1 = WorkerInfo("d1", "decode", b"d1", pool_tokens=4000, ready=True, assigned=1000)
    small = WorkerInfo("d2", "decode", b"d2", pool_tokens=100, ready=True)
    p0 = WorkerInfo("p0", "prefill", b"p0", pool_tokens=1000, ready=True, assigned=300)
    p1 = WorkerInfo("p1", "prefill", b"p1", pool_tokens=1000, ready=True, assigned=100)
    lost = WorkerInfo("p2", "prefill", b"p2", pool_tokens=1000, ready=True, lost=True)
    decode, prefill = pick([d0, d1, small, p0, p1, lost], 50, 200)
    assert (decode.name, prefill.name) == ("d1", "p1")   # d2 cannot hold 200 tokens
    with pytest.raises(BadRequest, match="no ready worker can hold 5000 tokens"):
        pick([d0, d1, p0], 50, 5000)
    cfg = ServeConfig(page_size=16)
    assert admits_at_once(d0, 400, cfg) and not admits_at_once(d0, 490, cfg)
