"""Helpers for the transport tests: synthetic pools with deterministic patterns, and the
prefill/decode process bodies that the tests start with multiprocessing (spawn)."""

from __future__ import annotations

import numpy as np
import torch

from common import KvCache, KvLayout
from transport import TransportConfig


def layout(total_heads: int = 4, tp_size: int = 1, dtype: str = "float32") -> KvLayout:
    """A small layout with a draft layer; ``num_kv_heads`` is the heads of one rank."""
    return KvLayout(num_layers=2, num_draft_layers=1, num_kv_heads=total_heads // tp_size,
                    head_dim=8, dtype=dtype)


def make_cache(num_pages: int, page_size: int, lay: KvLayout, log_path=None,
               node: str = "node") -> KvCache:
    return KvCache(num_pages, page_size, layout=lay, log_path=log_path, node=node,
                   max_rows=64)


def pattern(seed: int, num_tokens: int, lay: KvLayout, head_start: int,
            num_heads: int) -> torch.Tensor:
    """Deterministic KV of positions ``[0, num_tokens)`` for global heads
    ``[head_start, head_start + num_heads)``: ``[tokens, layers, 2, heads, head_dim]``."""
    pos = np.arange(num_tokens).reshape(-1, 1, 1, 1, 1)
    layer = np.arange(lay.total_layers).reshape(1, -1, 1, 1, 1)
    kv = np.arange(2).reshape(1, 1, -1, 1, 1)
    head = (head_start + np.arange(num_heads)).reshape(1, 1, 1, -1, 1)
    dim = np.arange(lay.head_dim).reshape(1, 1, 1, 1, -1)
    val = (seed * 7919 + pos * 131 + layer * 17 + kv * 5 + head * 3 + dim * 7) % 65521
    return torch.from_numpy(val.astype(np.float64)).to(lay.torch_dtype)


def write_row(cache: KvCache, kv, values: torch.Tensor, start: int = 0) -> None:
    """Write ``values`` ([tokens, layers, 2, heads, dim]) at row positions start..."""
    slots = cache.slots(kv, start, start + values.shape[0])
    data = cache.data()
    ps = cache.page_size
    data[slots // ps, :, :, slots % ps] = values


def read_row(cache: KvCache, kv, start: int, end: int) -> torch.Tensor:
    slots = cache.slots(kv, start, end)
    ps = cache.page_size
    return cache.data()[slots // ps, :, :, slots % ps]


def config(node: str, rank: int = 0, size: int = 1, **kw) -> TransportConfig:
    """Short leases and deadlines so failure tests stay fast."""
    base = dict(heartbeat_s=0.1, lease_s=1.0, handshake_timeout_s=5.0,
                admission_timeout_s=5.0, chunk_timeout_s=5.0, done_timeout_s=20.0)
    base.update(kw)
    return TransportConfig(node=node, tp_rank=rank, tp_size=size, **base)
