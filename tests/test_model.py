"""The model runner: paged attention over KvCache rows equals plain dense attention."""

from __future__ import annotations

import pytest
import torch

from common import KvCache
from common.model import BatchItem, Model, ModelConfig, ModelRunner, generate_greedy, get_config
from tests.model_helpers import F64, prompt


def make_cache(m: Model, page_size: int, *, num_pages: int = 64, draft: bool = True
               ) -> KvCache:
    return KvCache(num_pages, page_size, layout=m.config.kv_layout(with_draft=draft))


def run_chunks(runner: ModelRunner, kv, tokens: list[int], chunks: list[int], *,
               draft: bool = False) -> torch.Tensor:
    """Prefill `tokens` in chunks of the given sizes; logits of every position."""
    out, start = [], 0
    for n in chunks:
        runner.cache.extend(kv, n)
        out += runner.forward_all([BatchItem(kv, tokens[start:start + n], start)], draft=draft)
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("draft", [False, True])
def test_paged_prefill_equals_dense(model: Model, page_size: int, draft: bool) -> None:
    runner = ModelRunner(model, make_cache(model, page_size))
    kv = runner.cache.open_row("r1")
    tokens = prompt(37)
    paged = run_chunks(runner, kv, tokens, [37], draft=draft)
    dense = model.forward_dense(tokens, draft=draft)
    assert paged.shape == (37, F64.vocab_size)
    torch.testing.assert_close(paged, dense, rtol=0, atol=1e-10)


@pytest.mark.parametrize("page_size", [1, 16])
def test_uneven_chunks_and_decode_steps_equal_one_shot(model: Model, page_size: int) -> None:
    tokens = prompt(45, seed=2)
    one = ModelRunner(model, make_cache(model, page_size))
    kv1 = one.cache.open_row("a")
    whole = run_chunks(one, kv1, tokens, [45])
    chunked = ModelRunner(model, make_cache(model, page_size))
    chunked.cache.extend(chunked.cache.open_row("pad"), 5)  # other pages than the first run
    kv2 = chunked.cache.open_row("b")
    parts = run_chunks(chunked, kv2, tokens, [5, 17, 1, 1, 20, 1])
    torch.testing.assert_close(parts, whole, rtol=0, atol=1e-10)
    k1 = one.data[one.cache.slots(kv1, 0, 45) // page_size, :, :, one.cache.slots(kv1, 0, 45)
                  % page_size]
    k2 = chunked.data[chunked.cache.slots(kv2, 0, 45) // page_size, :, :,
                      chunked.cache.slots(kv2, 0, 45) % page_size]
    torch.testing.assert_close(k2, k1, rtol=0, atol=1e-12)


def test_mixed_batch_equals_one_at_a_time(model: Model) -> None:
    """Prefill chunks (long and short), decode steps and a k+1 verification in one pass."""
    prompts = [prompt(n, seed=n) for n in (30, 3, 12, 50, 8)]
    done = [29, 3, 12, 0, 8]  # tokens already prefilled before the mixed pass
    new = [[prompts[0][29]], [7], [5, 9, 11], prompts[3][:40], [1]]
    solo_logits = []
    for i in range(5):
        runner = ModelRunner(model, make_cache(model, 16))
        kv = runner.cache.open_row(f"r{i}")
        if done[i]:
            run_chunks(runner, kv, prompts[i], [done[i]])
        runner.cache.extend(kv, len(new[i]))
        solo_logits += runner.forward_all([BatchItem(kv, new[i], done[i])])
    runner = ModelRunner(model, make_cache(model, 16, num_pages=128))
    rows = [runner.cache.open_row(f"r{i}") for i in range(5)]
    for i, kv in enumerate(rows):
        if done[i]:
            run_chunks(runner, kv, prompts[i], [done[i]])
    for i, kv in enumerate(rows):
        runner.cache.extend(kv, len(new[i]))
    batch = [BatchItem(kv, new[i], done[i]) for i, kv in enumerate(rows)]
    batched = runner.forward_all(batch)
    for got, want in zip(batched, solo_logits):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    last = runner.forward(batch)  # reruns the same positions: writes are idempotent
    torch.testing.assert_close(last, torch.stack([w[-1] for w in solo_logits]), rtol=0,
                               atol=1e-10)


def test_continuous_batching_reproduces_reference(model: Model) -> None:
    """A small scheduler: chunked prefill (chunk 8) mixed with decoding, page size 1."""
    prompts = [prompt(n, seed=10 + n) for n in (21, 4, 13, 9)]
    want = generate_greedy(model, prompts, 6)
    runner = ModelRunner(model, make_cache(model, 1, num_pages=200))
    rows = [runner.cache.open_row(f"r{i}") for i in range(4)]
    outs: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < 6 for o in outs):
        batch = []
        for i, kv in enumerate(rows):
            if kv.allocated_len < len(prompts[i]):  # still prefilling
                n = min(8, len(prompts[i]) - kv.allocated_len)
                batch.append((i, prompts[i][kv.allocated_len:kv.allocated_len + n]))
            elif len(outs[i]) < 6:
                batch.append((i, outs[i][-1:]))
        items = []
        for i, toks in batch:
            items.append(BatchItem(rows[i], toks, rows[i].allocated_len))
            runner.cache.extend(rows[i], len(toks))
        next_ids = runner.forward(items).argmax(-1).tolist()
        for (i, _), t in zip(batch, next_ids):
            if rows[i].allocated_len >= len(prompts[i]):
                outs[i].append(t)
    assert outs == want


def test_draft_writes_only_draft_layers(model: Model) -> None:
    runner = ModelRunner(model, make_cache(model, 4))
    kv = runner.cache.open_row("r")
    run_chunks(runner, kv, prompt(10), [10], draft=True)
    data = runner.data  # [num_pages, total_layers, 2, page_size, kv_heads, head_dim]
    assert data[:, :F64.num_layers].abs().sum() == 0
    assert data[:, F64.num_layers:].abs().sum() > 0
    runner.forward([BatchItem(kv, prompt(10), 0)])
    assert data[:, :F64.num_layers].abs().sum() > 0


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1), (8, 2)])
def test_gqa_shapes_and_paged_equals_dense(heads: int, kv_heads: int) -> None:
    cfg = F64.with_overrides(num_heads=heads, num_kv_heads=kv_heads, head_dim=16)
    m = Model(cfg)
    q, k, v = m.qkv(0, m.embed(torch.tensor([1, 2, 3])), m.rope(torch.arange(3)))
    assert q.shape == (3, heads, 16) and k.shape == v.shape == (3, kv_heads, 16)
    runner = ModelRunner(m, make_cache(m, 4))
    tokens = prompt(11)
    paged = run_chunks(runner, runner.cache.open_row("r"), tokens, [6, 5])
    torch.testing.assert_close(paged, m.forward_dense(tokens), rtol=0, atol=1e-10)


@pytest.mark.parametrize("changes,message", [
    ({"dtype": "float8"}, "allowed: ['bfloat16', 'float16', 'float32', 'float64']"),
    ({"num_kv_heads": 3}, "multiple of num_kv_heads=3"),
    ({"head_dim": 33}, "must be even"),
    ({"num_draft_layers": 4}, "allowed: 0 (no draft) to num_layers-1=3"),
    ({"hidden_size": 0}, "hidden_size=0 must be >= 1"),
])
def test_config_validation_names_allowed_values(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        ModelConfig(**changes)


def test_builtin_configs_and_layout() -> None:
    with pytest.raises(ValueError, match="unknown model config 'huge'; allowed"):
        get_config("huge")
    for name in ("tiny", "small", "llama-1b-shape", "llama-8b-shape"):
        cfg = get_config(name)
        layout = cfg.kv_layout(with_draft=True)
        assert layout.total_layers == cfg.num_layers + cfg.num_draft_layers
        assert cfg.kv_layout(with_draft=False).num_draft_layers == 0


def test_runner_rejects_bad_batches(model: Model) -> None:
    runner = ModelRunner(model, make_cache(model, 16))
    kv = runner.cache.open_row("r")
    runner.cache.extend(kv, 4)
    with pytest.raises(ValueError, match="extend the row first"):
        runner.forward([BatchItem(kv, [1, 2, 3], 2)])
    with pytest.raises(ValueError, match="appears twice"):
        runner.forward([BatchItem(kv, [1], 0), BatchItem(kv, [2], 1)])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        runner.forward([BatchItem(kv, [512], 0)])
    with pytest.raises(ValueError, match="does not fit model"):
        ModelRunner(model, KvCache(8, 16))
    no_draft = ModelRunner(model, make_cache(model, 16, draft=False))
    kv = no_draft.cache.open_row("r")
    no_draft.cache.extend(kv, 1)
    with pytest.raises(ValueError, match="no draft layers"):
        no_draft.forward([BatchItem(kv, [1], 0)], draft=True)


def test_weights_are_seeded_and_dtype_independent() -> None:
    a, b = Model(get_config("tiny")), Model(get_config("tiny", dtype="float64"))
    assert torch.equal(a.blocks[2].w_qkv, b.blocks[2].w_qkv.float())
    assert not torch.equal(a.lm_head, Model(get_config("tiny", seed=1)).lm_head)


def test_generate_greedy_is_deterministic_and_page_size_free(model: Model) -> None:
    prompts = [prompt(n, seed=n) for n in (5, 17, 1)]
    first = generate_greedy(model, prompts, 8)
    assert [len(o) for o in first] == [8, 8, 8]
    assert generate_greedy(Model(F64), prompts, 8, page_size=1) == first
    stop = first[1][2]
    stopped = generate_greedy(model, prompts[1:2], 8, stop_token=stop)[0]
    assert stopped == first[1][:first[1].index(stop) + 1]
    assert generate_greedy(model, prompts, 0) == [[], [], []]
    with pytest.raises(ValueError, match="at least one token"):
        generate_greedy(model, [[]], 4)


def test_config_round_trips_and_positions_are_bounded() -> None:
    cfg = get_config("small", dtype="float64")
    assert ModelConfig(**cfg.to_dict()) == cfg
    m = Model(F64.with_overrides(max_position=8))
    runner = ModelRunner(m, make_cache(m, 4))
    kv = runner.cache.open_row("r")
    runner.cache.extend(kv, 9)
    with pytest.raises(ValueError, match="max_position=8"):
        runner.forward([BatchItem(kv, prompt(9), 0)])


def speculate(runner: ModelRunner, prompt_ids: list[int], max_new: int, k: int) -> list[int]:
    """Greedy self-speculative decoding of one request (how issue 5 uses the runner)."""
    cache, kv = runner.cache, runner.cache.open_row("spec")
    cache.extend(kv, len(prompt_ids))
    runner.forward([BatchItem(kv, prompt_ids, 0)], draft=True)
    out = [int(runner.forward([BatchItem(kv, prompt_ids, 0)])[0].argmax())]
    draft_len = len(prompt_ids)  # positions [0, draft_len) hold valid draft KV
    while len(out) < max_new:
        seq = prompt_ids + out  # the last token has no KV yet, in either model
        cache.extend(kv, len(seq) + k - kv.allocated_len)  # k lookahead slots
        proposals, feed, pos = [], seq[draft_len:], draft_len
        for _ in range(k):
            logits = runner.forward([BatchItem(kv, feed, pos)], draft=True)
            pos += len(feed)
            feed = [int(logits[0].argmax())]
            proposals.append(feed[0])
        verify = runner.forward_all([BatchItem(kv, [out[-1]] + proposals, len(seq) - 1)])
        greedy = verify[0].argmax(-1).tolist()  # [k + 1]
        accepted = 0
        while accepted < k and proposals[accepted] == greedy[accepted]:
            accepted += 1
        out += proposals[:accepted] + [greedy[accepted]]
        draft_len = len(seq) + min(accepted, k - 1)
    return out[:max_new]


@pytest.mark.parametrize("k,page_size", [(1, 1), (2, 16), (4, 16)])
def test_speculative_decoding_reproduces_reference(model: Model, k: int, page_size: int
                                                   ) -> None:
    prompt_ids = prompt(19, seed=5)
    want = generate_greedy(model, [prompt_ids], 24)[0]
    runner = ModelRunner(model, make_cache(model, page_size, num_pages=80))
    assert speculate(runner, prompt_ids, 24, k) == want
