"""The engine at serving dtypes and on CUDA (the CUDA tests run in benchmarks/gpu/round.sh).

- bf16: the paged runner agrees with a float32 dense reference of the same weights within
  the stated tolerance (relative RMS of the logits <= 3%, the same most likely token at
  >= 90% of positions; measured on CPU for ``small``: 1.0% and 97%).
- CUDA: the steps (a prefill chunk, a greedy and a sampled decode step through their CUDA
  graph, a speculative verification, greedy and sampled) run under
  ``torch.cuda.set_sync_debug_mode("error")``, which raises at any synchronising call but
  the step's one download; a graph's replay equals the eager pass.
"""

from __future__ import annotations

import pytest
import torch

from common import KvCache
from common.model import BatchItem, Model, ModelRunner, get_config
from common.model.graphs import DecodeGraphs
from common.node import PrefillEngine
from common.request import Request, SamplingParams
from decode_node.batch import DecodeBatch, plain_step
from decode_node.speculative import SpeculativeStep

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (the GPU round)")
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
REL_RMS, TOP1 = 0.03, 0.90


def ids_of(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_paged_runner_agrees_with_a_float32_reference(device):
    name = "small" if device == "cpu" else "llama-1b-shape"
    ref = Model(get_config(name, dtype="float32"), device)
    model = Model(get_config(name, dtype="bfloat16"), device)
    ids = ids_of(96, model.config.vocab_size)
    cache = KvCache(16, 16, layout=model.config.kv_layout(True), device=device)
    runner = ModelRunner(model, cache)
    kv = cache.open_row("a")
    cache.extend(kv, 96)
    got = torch.cat(runner.forward_all([BatchItem(kv, ids[:64], 0)])  # a chunk, then
                    + runner.forward_all([BatchItem(kv, ids[64:], 64)])).float()  # the rest
    want = ref.forward_dense(ids).float()
    rel = ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert rel <= REL_RMS and top1 >= TOP1, (rel, top1)


# -- CUDA only -------------------------------------------------------------------------------
def decoding(model: Model, params: list[SamplingParams], step) -> DecodeBatch:
    cfg = model.config
    cache = KvCache(256, 16, layout=cfg.kv_layout(with_draft=True), device=model.device)
    runner = ModelRunner(model, cache)
    batch = DecodeBatch(runner, step)
    for i, p in enumerate(params):
        ids = ids_of(40 + 7 * i, cfg.vocab_size, i)
        kv = cache.open_row(f"r{i}")
        cache.extend(kv, len(ids))
        runner.forward([BatchItem(kv, ids, 0)])
        runner.forward([BatchItem(kv, ids, 0)], draft=True)
        cache.commit(kv, len(ids))
        batch.add(Request(f"r{i}", ids, p, kv=kv, output=[ids[-1]], num_computed=len(ids)))
    return batch


@pytest.fixture
def sync_errors(monkeypatch):
    """Any synchronising call raises, but inside the step's one download."""
    from common.model import plan
    original = plan.download

    def download(t):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return original(t)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    for where in ("decode_node.batch", "decode_node.speculative", "common.node.prefill_engine",
                  "common.model.sampling"):
        monkeypatch.setattr(f"{where}.download", download)

    class Armed:
        def __enter__(self):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")

        def __exit__(self, *exc):
            torch.cuda.set_sync_debug_mode(0)

    return Armed()


GREEDY = SamplingParams(max_new_tokens=40)
SAMPLED = SamplingParams(max_new_tokens=40, temperature=1.0, top_p=0.9, seed=3,
                         repetition_penalty=1.1)


@needs_cuda
@pytest.mark.parametrize("params", [[GREEDY] * 4, [SAMPLED, GREEDY, SAMPLED, SAMPLED]],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_steps_never_wait_for_the_device_but_once(sync_errors, params, spec):
    model = Model(get_config("small", dtype="bfloat16"), "cuda")
    batch = decoding(model, params, SpeculativeStep(3) if spec else plain_step)
    batch.step()  # warm-up: graph capture and kernel compilation synchronise, once
    batch.step()
    with sync_errors:
        for _ in range(3):
            batch.step()


@needs_cuda
def test_a_prefill_chunk_never_waits_for_the_device_but_once(sync_errors):
    model = Model(get_config("small", dtype="bfloat16"), "cuda")
    cache = KvCache(64, 16, layout=model.config.kv_layout(True), device="cuda")
    engine = PrefillEngine(ModelRunner(model, cache), 32, 64, with_draft=True)
    for i, p in enumerate((GREEDY, SAMPLED, GREEDY)):
        r = Request(f"p{i}", ids_of(48, model.config.vocab_size, i), p)
        r.kv = cache.open_row(r.rid)
        cache.extend(r.kv, r.prompt_len)
        engine.add(r)
    engine.step()  # warm-up
    with sync_errors:
        while engine.has_work:
            engine.step()


@needs_cuda
def test_a_cuda_graph_replays_the_eager_decode_pass():
    model = Model(get_config("small", dtype="float32"), "cuda")
    outs = []
    for graphs in (False, DecodeGraphs(capture=True)):
        cache = KvCache(128, 16, layout=model.config.kv_layout(True), device="cuda")
        runner = ModelRunner(model, cache, graphs=graphs)
        rows = []
        for i in range(5):
            kv = cache.open_row(f"r{i}")
            cache.extend(kv, 30 + i * 9 + 3)
            runner.forward([BatchItem(kv, ids_of(30 + i * 9, 4096, i), 0)])
            rows.append((kv, 30 + i * 9))
        steps = []
        for s in range(3):  # capture, then two replays
            steps.append(runner.forward([BatchItem(kv, [7 + s], n + s) for kv, n in rows]))
        outs.append(torch.stack(steps))
        if graphs:
            assert len(graphs) == 1 and not graphs.failed
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
