"""The attention backends behind one interface agree with each other and with dense
attention: the exact torch path (page gathers, fresh chunks) and flex_attention over the
pool in place (eager on CPU: its mask_mod alone decides; its block lists are checked to
cover every key the mask lets a query see, since the compiled CUDA kernel reads only
those)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from common import KvCache
from common.model import BatchItem, Model, ModelRunner, select_backend
from common.model.attention import PassGeometry, TorchAttention
from common.model.flex_attention import FlexAttention, flex_supported
from common.model.plan import HostPlan
from tests.model_helpers import F64, prompt

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def mixed_pass(runner: ModelRunner) -> tuple[list, list[BatchItem]]:
    """Rows with history, then one pass mixing a first chunk, a later chunk, decode steps
    and a verification; returns every item's logits and the items."""
    cache = runner.cache
    prompts = [prompt(n, seed=n) for n in (40, 3, 21, 50, 9)]
    done = [0, 3, 20, 17, 8]  # positions already in the pool
    new = [prompts[0][:40], [7], [5, 9, 11, 4], prompts[3][17:50], [1]]
    rows = [cache.open_row(f"r{i}") for i in range(5)]
    for i, kv in enumerate(rows):
        if done[i]:
            cache.extend(kv, done[i])
            runner.forward([BatchItem(kv, prompts[i][:done[i]], 0)])
    items = []
    for i, kv in enumerate(rows):
        cache.extend(kv, len(new[i]))
        items.append(BatchItem(kv, new[i], done[i]))
    return runner.forward_all(items), items


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("window", [0, 12])
def test_flex_over_the_pool_equals_the_torch_path(dtype, window):
    cfg = F64.with_overrides(dtype=dtype, sliding_window=window)
    model = Model(cfg)
    outs = {}
    for backend in (TorchAttention(), FlexAttention()):
        cache = KvCache(16, 16, layout=cfg.kv_layout(with_draft=True))
        outs[backend.name] = mixed_pass(ModelRunner(model, cache, attention=backend))[0]
    tol = 1e-10 if dtype == "float64" else 2e-4
    for a, b in zip(outs["torch"], outs["flex"]):
        torch.testing.assert_close(b, a, rtol=0, atol=tol)


def test_the_torch_path_equals_dense_attention(model):
    runner = ModelRunner(model, KvCache(16, 16, layout=F64.kv_layout(with_draft=True)))
    logits, items = mixed_pass(runner)
    whole = prompt(40, seed=40)
    torch.testing.assert_close(logits[0], model.forward_dense(whole), rtol=0, atol=1e-10)


def test_flex_block_lists_cover_every_key_its_mask_allows(model):
    """The compiled kernel visits only listed blocks: every (query, key) the mask_mod
    allows must lie in a listed block of that query's block row."""
    cache = KvCache(16, 16, layout=F64.kv_layout(with_draft=True))
    runner = ModelRunner(model, cache, attention=FlexAttention())
    _, items = mixed_pass(runner)
    host = HostPlan("cpu")
    pp = runner.plan(host, items)
    dev = host.upload()
    state = runner.attention.bind(pp.attention, dev, runner.pool, torch.float64)
    mask = state.mask
    kv_len = state.kv_len
    num_b, nq = state.meta.num_items, state.meta.num_queries
    b, q, k = torch.meshgrid(torch.arange(num_b), torch.arange(nq), torch.arange(kv_len),
                             indexing="ij")
    allowed = mask.mask_mod(b, torch.zeros_like(b), q, k)  # [B, nq, kv_len]
    ps = cache.page_size
    listed = torch.zeros(num_b, nq, kv_len // ps + 1, dtype=torch.bool)
    counts, indices = mask.kv_num_blocks, mask.kv_indices
    for bb in range(num_b):
        for qb in range(counts.shape[-1]):
            blocks = indices[bb, 0, qb, :counts[bb, 0, qb]].long()
            listed[bb, qb * 128:(qb + 1) * 128, blocks] = True
    in_list = listed.repeat_interleave(ps, dim=2)[:, :, :kv_len]
    assert allowed.any() and not (allowed & ~in_list).any()
    # and nothing is listed that belongs to another row
    per_row = {bb: set(indices[bb, 0, 0, :counts[bb, 0, 0]].tolist()) for bb in range(5)}
    assert all(not (per_row[a] & per_row[c]) for a in per_row for c in per_row if a < c)


def test_backend_selection():
    cpu = torch.device("cpu")
    assert select_backend(cpu, 16).name == "torch"
    assert select_backend(cpu, 16, "flex").name == "flex"
    assert flex_supported(16) and flex_supported(32) and not flex_supported(8)
    with pytest.raises(ValueError, match="allowed: auto, torch, flex"):
        select_backend(cpu, 16, "flashinfer")


def test_a_first_chunk_attends_over_its_own_keys_without_a_gather():
    geo = PassGeometry(np.array([0, 5]), np.array([40, 1]), np.array([0, 40]),
                       np.array([0, 3]), np.arange(1, 6, dtype=np.int64), 16, 2, 0)
    meta = TorchAttention().plan(HostPlan("cpu"), geo)
    fresh, packed = meta.groups[1], meta.groups[0]
    assert fresh.num_pages == 0 and fresh.num_queries == 40  # is_causal over fresh K/V
    assert packed.num_pages == 1 and packed.num_items == 1


@pytest.mark.parametrize("backend", [TorchAttention, FlexAttention])
def test_a_decode_pass_padded_for_a_cuda_graph_computes_the_same(backend):
    """Padding to a bucket (items and pages) changes nothing for the real items, and the
    padding's writes land in page 0 only."""
    from common.model.graphs import DecodeGraphs
    model = Model(F64)
    outs = []
    for graphs in (False, DecodeGraphs(capture=False)):
        cache = KvCache(32, 16, layout=F64.kv_layout(with_draft=True))
        runner = ModelRunner(model, cache, attention=backend(), graphs=graphs)
        rows = []
        for i, n in enumerate((5, 17, 40)):  # 1, 2, 3 pages: padded to 4 pages, 4 items
            kv = cache.open_row(f"r{i}")
            cache.extend(kv, n + 1)
            runner.forward([BatchItem(kv, prompt(n, seed=i), 0)])
            rows.append((kv, n))
        before = runner.data[1:].clone()
        host = HostPlan("cpu")
        pp = runner.plan(host, [BatchItem(kv, [3], n) for kv, n in rows])
        assert pp.bucket == ((4, 4) if graphs else None)
        outs.append(runner.step_logits(pp, host.upload()))
        changed = (runner.data[1:] != before).nonzero()[:, 0].unique() + 1
        assert set(changed.tolist()) <= {int(cache.pages(kv, n, n + 1)[0]) for kv, n in rows}
    assert outs[0].shape == outs[1].shape == (3, F64.vocab_size)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-10)
