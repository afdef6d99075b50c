"""Paged attention with torch's ``flex_attention``, reading K/V where they lie in the pool.

Why this kernel: it ships with torch (Triton-compiled on CUDA), so every machine that runs
pdkv's torch has it; FlashInfer needs its own JIT toolchain or a >1 GB ahead-of-time wheel
per CUDA version, and flash-attn's block-table API wants pages of 256 tokens. flex reads a
block-sparse mask: here each KV block is one page of one layer, so the kernel visits a
row's pages in place and nothing is gathered.

The pool, ``[num_pages, total_layers, 2, page_size, kv_heads, head_dim]``, seen as pool rows
``[R, kv_heads * head_dim]`` (``PoolView.flat``): layer l's K of page p are rows
``p * page_rows + 2 * l * page_size + [0, page_size)`` and its V the next ``page_size``
rows. So the layer's K is the flat rows from offset ``2 * l * page_size`` on, viewed as
``[1, kv_heads, S, head_dim]`` (``as_strided``), its V from ``(2 * l + 1) * page_size``; in
both, page p is KV block ``p * page_rows / page_size`` for every layer, and one block mask
serves all layers of a pass.

Per pass (``bind``): each item is a batch entry; its queries are padded to the pass's
longest item; its block list is its pages from its window's first to its last (every
query block gets them all, causality and padding are the ``mask_mod``'s). The
``mask_mod`` alone is exact: it lets a query at position p see a key only on a page of its
own row (``page_row``) at a position <= p (and > p - window), so the block lists are
purely what the kernel skips (eager flex, on CPU, evaluates the ``mask_mod`` everywhere;
tests/test_attention_backends.py checks both against the torch path).

Shapes are padded to powers of two (items, queries, blocks) so that the compiled kernel
sees a few shapes, not one per batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from common.model.attention import AttentionBackend, LayerArgs, PassGeometry, PoolView
from common.model.plan import DevicePlan, HostPlan, Slot

Q_BLOCK = 128
"""Queries per block of the block mask (its KV blocks are pages)."""

_compiled = None


def flex_supported(page_size: int) -> bool:
    """Whether flex serves a pool of ``page_size``: its KV blocks are pages, and its
    kernel tiles them by 16 tokens or more."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return page_size >= 16 and page_size % 16 == 0


def _flex(device: torch.device):
    """The compiled kernel on CUDA (compiled once per process); eager elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention
    global _compiled
    if device.type != "cuda":
        return flex_attention
    if _compiled is None:
        import torch._dynamo
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclass
class _FlexMeta:
    num_items: int
    num_queries: int
    num_tokens: int
    window: int
    slots: dict[str, Slot] = field(default_factory=dict)


class FlexAttention(AttentionBackend):
    """``flex_attention`` over the pool in place (see the module doc)."""

    name = "flex"

    def plan(self, plan: HostPlan, geo: PassGeometry) -> _FlexMeta:
        ps, n = geo.page_size, len(geo.starts)
        num_b = _pow2(n)
        num_q = _pow2(int(geo.lengths.max()))
        num_qb = -(-num_q // Q_BLOCK)
        lows, ends = geo.lows, geo.ends
        first, last = lows // ps, (ends - 1) // ps
        num_blocks = _pow2(max(int((last - first).max()) + 1, geo.min_pages))
        # padding entries (items past n) have no blocks and no valid queries
        counts = np.zeros((num_b, 1, num_qb), np.int32)
        counts[:n] = (last - first + 1)[:, None, None]
        idx = first[:, None] + np.minimum(np.arange(num_blocks), (last - first)[:, None])
        pages = geo.tables[geo.page_off[:, None] + idx]  # [n, num_blocks]
        q_pos = np.full((num_b, num_q), -1, np.int64)  # -1: a padding query sees nothing
        j = np.arange(num_q)
        real = j < geo.lengths[:, None]
        q_pos[:n] = np.where(real, geo.starts[:, None] + j, -1)
        q_index = np.zeros((num_b, num_q), np.int64)
        q_index[:n] = geo.firsts[:, None] + np.minimum(j, geo.lengths[:, None] - 1)
        valid = np.flatnonzero(np.pad(real, ((0, num_b - n), (0, 0))))
        # the row of each page, and its first position, for the mask_mod
        row_pages = np.concatenate([geo.tables[geo.page_off[b]:geo.page_off[b] + last[b] + 1]
                                    for b in range(n)])
        row_of = np.repeat(np.arange(n), last + 1)
        logical = np.concatenate([np.arange(last[b] + 1) * ps for b in range(n)])
        meta = _FlexMeta(num_b, num_q, int(geo.lengths.sum()), geo.window)
        meta.slots = {"counts": plan.add(counts), "pages": plan.add(pages, np.int64),
                      "q_pos": plan.add(q_pos), "q_index": plan.add(q_index),
                      "valid": plan.add(valid, np.int64),
                      "row_pages": plan.add(row_pages, np.int64),
                      "row_of": plan.add(row_of, np.int64), "logical": plan.add(logical)}
        return meta

    def bind(self, meta: _FlexMeta, dev: DevicePlan, pool: PoolView, dtype: torch.dtype
             ) -> _FlexState:
        from torch.nn.attention.flex_attention import BlockMask
        t = {name: dev[slot] for name, slot in meta.slots.items()}
        device, ps = pool.data.device, pool.page_size
        num_pages = pool.data.shape[0]
        # per pass: which row holds each page, and where in the row it starts
        page_row = torch.full((num_pages,), -1, dtype=torch.int64, device=device)
        page_row.index_copy_(0, t["row_pages"], t["row_of"])
        page_pos = torch.zeros(num_pages, dtype=torch.int64, device=device)
        page_pos.index_copy_(0, t["row_pages"], t["logical"])
        page_rows, q_pos, window = pool.page_rows, t["q_pos"], meta.window

        def mask_mod(b, h, q_idx, kv_idx):
            # the view's rows of a page hold every layer's K and V: this layer's K are
            # the page's first page_size
            page, at = kv_idx // page_rows, kv_idx % page_rows
            key = page_pos[page] + at
            qp = q_pos[b, q_idx]
            ok = (at < ps) & (page_row[page] == b) & (key <= qp)
            if window:
                ok = ok & (key > qp - window)
            return ok

        num_qb = t["counts"].shape[-1]
        blocks = (t["pages"] * (page_rows // ps)).to(torch.int32)  # [n, num_blocks]
        indices = torch.zeros(meta.num_items, 1, num_qb, blocks.shape[1], dtype=torch.int32,
                              device=device)
        indices[:blocks.shape[0]] = blocks[:, None, None, :]
        kv_len = (num_pages - 1) * page_rows + ps
        mask = BlockMask.from_kv_blocks(t["counts"], indices, BLOCK_SIZE=(Q_BLOCK, ps),
                                        mask_mod=mask_mod,
                                        seq_lengths=(meta.num_queries, kv_len),
                                        compute_q_blocks=False)  # (for backward only)
        return _FlexState(meta, t, mask, pool, kv_len)

    def attend(self, state: _FlexState, args: LayerArgs) -> torch.Tensor:
        meta, t = state.meta, state.t
        q = args.q[t["q_index"]].transpose(1, 2)  # [B, heads, nq, dim]
        k, v = state.kv(args.layer, args.width, args.q.shape[-1], meta.num_items)
        o = _flex(args.q.device)(q, k, v, block_mask=state.mask, enable_gqa=True,
                                 kernel_options=state.kernel_options)
        o = o.transpose(1, 2).reshape(meta.num_items * meta.num_queries, -1)
        return o[t["valid"]]  # [num_tokens, heads * dim]


class _FlexState:
    def __init__(self, meta: _FlexMeta, t: dict[str, torch.Tensor], mask, pool: PoolView,
                 kv_len: int) -> None:
        self.meta, self.t, self.mask, self.pool, self.kv_len = meta, t, mask, pool, kv_len
        # the kernel's KV tile must divide a page (its sparse KV block); its default
        # prefill tile (64 or 128) is refused for 16-token pages
        ps = pool.page_size
        self.kernel_options = {"BLOCK_N": next(b for b in (64, 32, 16) if ps % b == 0)}

    def kv(self, layer: int, width: int, dim: int, num_items: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V as [B, kv_heads, S, dim] views of the pool."""
        flat = self.pool.flat
        row, ps = flat.shape[1], self.pool.page_size
        heads = width // dim
        size = (num_items, heads, self.kv_len, dim)
        stride = (0, dim, row, 1)
        base = flat.storage_offset()
        k = flat.as_strided(size, stride, base + 2 * layer * ps * row)
        v = flat.as_strided(size, stride, base + (2 * layer + 1) * ps * row)
        return k, v
