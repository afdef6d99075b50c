"""Paged attention behind one interface, with the exact torch path as its reference.

The runner (``common.model.runner``) computes Q/K/V of a pass's tokens, writes K/V into
the pool and asks a backend for attention, layer by layer. A backend sees the pass twice:

1. ``plan`` (host, once per pass): from the pass's geometry (each item's start, length
   and page table) it adds its index arrays to the step's ``HostPlan`` (uploaded once
   with everything else) and returns what it needs to remember (shapes, slots);
2. ``bind`` (device, once per pass): builds what every layer shares (masks, buffers)
   from the uploaded arrays, without reading any of them back;
3. ``attend`` (device, once per layer): the attention output of every token.

Backends:

- ``TorchAttention`` (any device, exact; the CPU default and the float64 proofs'
  path): reads each row's pages with one page-granular gather per layer into buffers
  allocated once per pass, and calls SDPA with an additive mask built once per pass on
  the device. An item that starts at position 0 (a prompt's first chunk) attends over its
  own fresh K/V with ``is_causal`` and gathers nothing.
- ``FlexAttention`` (``common.model.flex_attention``, CUDA): torch's ``flex_attention``
  reading K/V where they lie in the pool through a block mask built from page tables.

``common.model.backends.select_backend`` picks one (``PDKV_ATTENTION`` overrides).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from common.model.plan import DevicePlan, HostPlan, Slot

PACK_MAX_QUERY = 16
"""Items with at most this many new tokens share one padded attention call."""


@dataclass(frozen=True)
class PoolView:
    """The runner's pool as attention reads it (shared by every backend)."""

    data: torch.Tensor
    """``[num_pages, total_layers, 2, page_size, kv_heads, head_dim]``."""
    page_size: int

    @property
    def flat(self) -> torch.Tensor:
        """``[num_pages * total_layers * 2 * page_size, kv_heads * head_dim]``: pool rows."""
        return self.data.view(-1, self.data.shape[-2] * self.data.shape[-1])

    @property
    def page_rows(self) -> int:
        """Pool rows per page: K and V of every layer."""
        return self.data.shape[1] * 2 * self.page_size


@dataclass(frozen=True)
class PassGeometry:
    """What attention needs of one pass, on the host (numpy, one entry per item)."""

    starts: np.ndarray
    """Row position of each item's first new token."""
    lengths: np.ndarray
    """New tokens per item."""
    firsts: np.ndarray
    """Index of each item's first token among the pass's tokens."""
    page_off: np.ndarray
    """Where each item's page table starts in ``tables``."""
    tables: np.ndarray
    """Every item's page ids for positions [0, end), end to end (int64)."""
    page_size: int
    group: int
    """Query heads per KV head."""
    window: int
    """Sliding window (0: full attention): a query at p sees keys (p - window, p]."""
    min_pages: int = 0
    """Read at least this many pages per item (a CUDA graph's fixed shapes)."""

    @property
    def ends(self) -> np.ndarray:
        return self.starts + self.lengths

    @property
    def lows(self) -> np.ndarray:
        """First key position each item reads."""
        if not self.window:
            return np.zeros_like(self.starts)
        return np.maximum(self.starts - self.window + 1, 0)


@dataclass(frozen=True)
class LayerArgs:
    """One layer's call: its queries, the pass's fresh K/V and where the layer lives."""

    q: torch.Tensor
    """[num_tokens, heads, head_dim]."""
    k: torch.Tensor
    """[num_tokens, kv_heads, head_dim] (already written into the pool)."""
    v: torch.Tensor
    layer: int
    """The layer's index among the pool's layers (a draft's follow the target's)."""
    width: int
    """Columns of a pool row the model uses (a narrower draft fills the first ones)."""


class AttentionBackend:
    """The interface; see the module doc for the three calls."""

    name = "base"

    def plan(self, plan: HostPlan, geo: PassGeometry) -> object:
        raise NotImplementedError

    def bind(self, meta: object, dev: DevicePlan, pool: PoolView, dtype: torch.dtype
             ) -> object:
        raise NotImplementedError

    def attend(self, state: object, args: LayerArgs) -> torch.Tensor:
        """[num_tokens, heads * head_dim]: every token's attention output."""
        raise NotImplementedError


# -- the exact torch path ---------------------------------------------------------------
@dataclass
class _GroupMeta:
    """One SDPA call over B items (host side: shapes and slots)."""

    num_items: int
    num_queries: int
    num_pages: int = 0
    """Pages gathered per item (0: a fresh item, attending over its own K/V)."""
    first: int = 0
    """Fresh item: its first token's index among the pass's tokens."""
    whole: bool = False
    """Its items' tokens are the pass's, in order, unpadded (no scatter back)."""
    slots: dict[str, Slot] = field(default_factory=dict)

    @property
    def packed(self) -> bool:
        """Short items: query heads of a KV head ride in the query dimension."""
        return self.num_queries <= PACK_MAX_QUERY


@dataclass
class _TorchMeta:
    groups: list[_GroupMeta]
    group_size: int
    window: int


class TorchAttention(AttentionBackend):
    """Exact attention with torch ops on any device (see the module doc).

    Items with at most ``PACK_MAX_QUERY`` new tokens (decode steps, speculative
    verification) share one padded call; each longer item (a prefill chunk) runs alone, so
    a long chunk never makes short items pad to its length. Padding repeats a real page
    and a real query of the same item and is masked out. Every token sees exactly the
    keys a one-at-a-time run sees, so at float64 greedy tokens match the reference.
    """

    name = "torch"

    def plan(self, plan: HostPlan, geo: PassGeometry) -> _TorchMeta:
        lengths = geo.lengths
        packed = np.flatnonzero(lengths <= PACK_MAX_QUERY)
        members = ([packed] if len(packed) else []) + [
            np.array([i]) for i in np.flatnonzero(lengths > PACK_MAX_QUERY)]
        return _TorchMeta([self._plan_group(plan, geo, m) for m in members], geo.group,
                          geo.window)

    @staticmethod
    def _plan_group(plan: HostPlan, geo: PassGeometry, m: np.ndarray) -> _GroupMeta:
        starts, lengths, firsts = geo.starts[m], geo.lengths[m], geo.firsts[m]
        if len(m) == 1 and starts[0] == 0 and lengths[0] > PACK_MAX_QUERY and (
                not geo.window or geo.window >= lengths[0]):
            # a prompt's first chunk: its keys are its own fresh K/V, causal from 0
            return _GroupMeta(1, int(lengths[0]), first=int(firsts[0]))
        ps, num_b, num_q = geo.page_size, len(m), int(lengths.max())
        ends, lows = starts + lengths, geo.lows[m]
        first_page, last_page = lows // ps, (ends - 1) // ps
        num_p = max(int((last_page - first_page).max()) + 1, geo.min_pages)
        # Page i of item b is its (first_page + i)-th; past its last, its last again (real
        # data, masked out).
        idx = first_page[:, None] + np.minimum(np.arange(num_p),
                                               (last_page - first_page)[:, None])
        pages = geo.tables[geo.page_off[m][:, None] + idx]  # [B, num_p]
        j = np.minimum(np.arange(num_q), lengths[:, None] - 1)  # padding repeats the last
        q_index, q_pos = firsts[:, None] + j, starts[:, None] + j  # [B, num_q]
        valid = np.flatnonzero(np.arange(num_q) < lengths[:, None])
        whole = bool(firsts[0] == 0 and (lengths == num_q).all()
                     and (np.diff(firsts) == num_q).all())
        meta = _GroupMeta(num_b, num_q, num_pages=num_p, whole=whole)
        meta.slots = {"pages": plan.add(pages.reshape(-1), np.int64),
                      "q_index": plan.add(q_index, np.int64),
                      "q_pos": plan.add(q_pos, np.int64),
                      "bounds": plan.add(np.stack([first_page * ps, lows, ends], 1),
                                         np.int64)}
        if not whole:
            meta.slots["valid_src"] = plan.add(valid, np.int64)
            meta.slots["valid_dest"] = plan.add(q_index.reshape(-1)[valid], np.int64)
        return meta

    def bind(self, meta: _TorchMeta, dev: DevicePlan, pool: PoolView, dtype: torch.dtype
             ) -> _TorchState:
        return _TorchState(meta, [_bind_group(g, meta, dev, pool, dtype) for g in meta.groups],
                           pool)

    def attend(self, state: _TorchState, args: LayerArgs) -> torch.Tensor:
        q, groups = args.q, state.meta.groups
        out = None
        for g, t in zip(groups, state.tensors):
            if not g.num_pages:
                n = slice(g.first, g.first + g.num_queries)
                o = _fresh_attention(q[n], args.k[n], args.v[n])
                if len(groups) == 1:
                    return o
                out = q.new_empty(q.shape[0], o.shape[-1]) if out is None else out
                out[n] = o
                continue
            k, v = state.gather(g, t, args.layer, args.width)
            o = _paged_attention(q, k, v, t, g.packed)  # [B, nq, heads * dim]
            if g.whole and len(groups) == 1:  # every token once, in order (decode)
                return o.reshape(q.shape[0], -1)
            out = q.new_empty(q.shape[0], o.shape[-1]) if out is None else out
            flat = o.reshape(-1, o.shape[-1])
            if g.whole:
                out[:flat.shape[0]] = flat
            else:  # index tensors built on the host: no device sync from boolean masks
                out[t["valid_dest"]] = flat[t["valid_src"]]
        return out


def _bind_group(g: _GroupMeta, meta: _TorchMeta, dev: DevicePlan, pool: PoolView,
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The group's index tensors, its additive mask and its gather buffers, once per pass."""
    if not g.num_pages:
        return {}
    t = {name: dev[slot] for name, slot in g.slots.items()}
    device = pool.data.device
    bounds = t["bounds"][:, :, None, None]  # [B, 3, 1, 1]: key_first, low, end
    k_pos = bounds[:, 0] + torch.arange(g.num_pages * pool.page_size, device=device)
    q_pos = t["q_pos"][:, :, None]  # [B, nq, 1]
    ok = (k_pos <= q_pos) & (k_pos < bounds[:, 2]) & (k_pos >= bounds[:, 1])  # [B, nq, nk]
    if meta.window:
        ok &= k_pos > q_pos - meta.window
    mask = torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, float("-inf"))
    if g.packed:  # rows (group member, query), as _paged_attention lays queries out
        mask = mask[:, None].expand(g.num_items, meta.group_size, *mask.shape[1:])
        t["mask"] = mask.reshape(g.num_items, 1, -1, mask.shape[-1]).contiguous()
    else:
        t["mask"] = mask[:, None]  # [B, 1, nq, nk], the same for every head
    row = pool.data.shape[-2] * pool.data.shape[-1] * pool.page_size  # one page's K
    t["k_buf"] = pool.data.new_empty(g.num_items * g.num_pages, row)
    t["v_buf"] = pool.data.new_empty(g.num_items * g.num_pages, row)
    return t


class _TorchState:
    """A pass's bound groups and the pool's per-layer page views."""

    def __init__(self, meta: _TorchMeta, tensors: list[dict[str, torch.Tensor]],
                 pool: PoolView) -> None:
        self.meta, self.tensors, self.pool = meta, tensors, pool
        d = pool.data
        # [num_pages, total_layers * 2, page_size * kv_heads * head_dim]: one page's K (or
        # V) of one layer is one contiguous row, so an item's context is one page gather
        self.pages = d.view(d.shape[0], d.shape[1] * 2, -1)

    def gather(self, g: _GroupMeta, t: dict[str, torch.Tensor], layer: int, width: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every item's pages at ``layer``: [B, num_keys, kv_heads * dim]."""
        torch.index_select(self.pages[:, 2 * layer], 0, t["pages"], out=t["k_buf"])
        torch.index_select(self.pages[:, 2 * layer + 1], 0, t["pages"], out=t["v_buf"])
        shape = (g.num_items, g.num_pages * self.pool.page_size, -1)
        k, v = t["k_buf"].view(shape), t["v_buf"].view(shape)
        if width != k.shape[-1]:  # a narrower draft: the first columns of each row
            k, v = k[..., :width], v[..., :width]
        return k, v


def _fresh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one item over its own new tokens (its first chunk).

    q: [n, heads, dim]; k, v: [n, kv_heads, dim] -> [n, heads * dim]. ``is_causal``
    without a mask lets SDPA take its fused kernel (about 10x the masked math on CPU).
    """
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], is_causal=True,
                                       enable_gqa=True)  # [1, heads, n, dim]
    return o[0].transpose(0, 1).reshape(q.shape[0], -1)


def _paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     t: dict[str, torch.Tensor], packed: bool) -> torch.Tensor:
    """Grouped-query attention of one group over its gathered keys.

    q: [num_tokens, heads, dim]; k, v: [B, num_keys, kv_heads * dim]. Packed groups put a
    KV head's query heads into the query dimension (no K/V repeat; measured fastest for
    a few queries per item); long items use SDPA's own GQA. Returns [B, nq, heads * dim].
    """
    query_index = t["q_index"]
    num_b, num_q = query_index.shape
    dim = q.shape[2]
    k = k.unflatten(-1, (-1, dim)).transpose(1, 2)  # [B, kv_heads, num_keys, dim]
    v = v.unflatten(-1, (-1, dim)).transpose(1, 2)
    qb = q[query_index]  # [B, nq, heads, dim]
    if not packed:
        o = F.scaled_dot_product_attention(qb.transpose(1, 2), k, v, attn_mask=t["mask"],
                                           enable_gqa=True)  # [B, heads, nq, dim]
        return o.transpose(1, 2).reshape(num_b, num_q, -1)
    kv_heads = k.shape[1]
    group = q.shape[1] // kv_heads
    qg = qb.reshape(num_b, num_q, kv_heads, group, dim)
    qg = qg.permute(0, 2, 3, 1, 4).reshape(num_b, kv_heads, group * num_q, dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=t["mask"])  # [B, kvh, g*nq, d]
    o = o.reshape(num_b, kv_heads, group, num_q, dim).permute(0, 3, 1, 2, 4)
    return o.reshape(num_b, num_q, -1)
