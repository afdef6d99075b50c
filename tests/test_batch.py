"""Chunked prefill and continuous batching together (colocated style): outputs equal the
reference, stop tokens, one-token requests, and what a finished row gives back. Real
KvCache, real model (float64)."""

from __future__ import annotations

from common import KvCache
from common.freelog import replay_file
from common.model import ModelRunner, generate_greedy
from common.node import PrefillEngine
from common.request import Request, SamplingParams
from decode_node.batch import DecodeBatch, finish_ranges
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
        engine.add(Request(f"r{i}", p, params, kv=kv))
    while engine.has_work or len(batch):
        _, done = engine.step()
        for req in done:
            if not batch.add(req):
                outs[req.rid] = req
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


