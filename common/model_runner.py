"""Batched forward passes of a ``Model`` over rows of a paged ``KvCache``.

One forward pass takes several requests, each a run of new tokens at positions
``[start, start + n)`` of its kv row: a prefill chunk (n > 1, start = tokens already in the
pool), a decode step (n = 1) or a speculative verification (n = k + 1). For every block it

1. computes Q/K/V of all the batch's tokens in one matmul (the dense work),
2. writes the new K/V into the pool at the row's slots of ``[start, start + n)``,
3. gathers K/V of the row's slots ``[0, start + n)`` and attends causally.

Attention runs in groups (choice): all items with at most ``PACK_MAX_QUERY`` new tokens
(decode steps, speculative verification) go into one padded batch (one SDPA call);
each longer item (a prefill chunk) runs alone, so a long chunk never makes short items pad
to its length. Padding repeats a real slot of the same row and is masked out, so the
padded rows never read stale or reserved pages.

Exactness: every item's tokens see exactly the keys a one-at-a-time run sees; batching
changes only the order of floating-point sums, so at float64 greedy tokens match exactly.

Pool layout (``cache.data()``): ``[num_pages, total_layers, 2, page_size, kv_heads,
head_dim]``; target block b uses layer b, draft block b uses layer num_layers + b.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.kv_cache import KvCache
from common.kv_record import KvRecord
from common.model import Model
from common.model_config import ModelConfig

PACK_MAX_QUERY = 16
"""Items with at most this many new tokens share one padded attention call."""


@dataclass(frozen=True)
class BatchItem:
    """One request's share of a forward pass.

    The caller has already ``cache.extend``-ed the row past ``start + len(token_ids)`` and
    the pool holds this model's K/V of positions ``[0, start)`` of the row.
    """

    kv: KvRecord
    """The request's ``KvRecord``."""
    token_ids: torch.Tensor | list[int]
    """The new tokens, at positions [start, start + n) of the row; n >= 1."""
    start: int
    """Row position of the first new token."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class _Group:
    """Index tensors of one attention call over B items (device tensors)."""

    query_index: torch.Tensor  # [B, num_queries] token index into the batch, padded
    valid_src: torch.Tensor  # [num_valid] index into the flattened [B * num_queries]
    valid_dest: torch.Tensor  # [num_valid] token index into the batch
    key_rows: torch.Tensor  # [B, num_keys] flat-pool row of each key slot at layer 0, padded
    mask: torch.Tensor  # [B, 1, group * num_queries, num_keys] True = may attend


@dataclass
class _Plan:
    """Everything a forward pass derives from the batch once, shared by all blocks."""

    token_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    write_rows: torch.Tensor  # [num_tokens] flat-pool row of each new token's K at layer 0
    groups: list[_Group]
    lengths: list[int]


class ModelRunner:
    """Runs ``model`` (target or draft) over rows of ``cache``; not thread-safe.

    Args:
        model: the ``Model``; its device must be the cache's device.
        cache: a ``KvCache`` whose layout is ``model.config.kv_layout(with_draft)`` for
            either value of ``with_draft`` (without draft layers ``draft=True`` fails).
    """

    def __init__(self, model: Model, cache: KvCache) -> None:
        cfg, layout = model.config, cache.layout
        if layout not in (cfg.kv_layout(True), cfg.kv_layout(False)):
            raise ValueError(f"KV layout {layout} does not fit model {cfg.name!r}: expected "
                             f"{cfg.kv_layout(True)} (draft layers optional)")
        self.model, self.cache = model, cache
        self.page_size = cache.page_size
        self.data = cache.data()  # [num_pages, total_layers, 2, page_size, kv_heads, head_dim]
        if self.data.device != model.device:
            raise ValueError(f"cache on {self.data.device}, model on {model.device}")
        # The pool as rows of one token's K or V, [num_pages * total_layers * 2 * page_size,
        # kv_heads * head_dim]: gathers and scatters over contiguous rows run near memcpy
        # speed, where 2-index advanced indexing of the 6-d view was several times slower.
        self.flat = self.data.view(-1, layout.num_kv_heads * layout.head_dim)
        self.page_rows = layout.total_layers * 2 * self.page_size

    @torch.inference_mode()
    def forward(self, batch: list[BatchItem], *, draft: bool = False) -> torch.Tensor:
        """Runs the batch; returns logits of each item's last token, [len(batch), vocab]."""
        h, plan = self._hidden(batch, draft)
        last = torch.tensor(plan.lengths, device=h.device).cumsum(0) - 1
        return self.model.logits(h[last])

    @torch.inference_mode()
    def forward_all(self, batch: list[BatchItem], *, draft: bool = False
                    ) -> list[torch.Tensor]:
        """Runs the batch; returns logits of every new token, one [n_i, vocab] per item
        (speculative verification needs all k + 1)."""
        h, plan = self._hidden(batch, draft)
        return list(self.model.logits(h).split(plan.lengths))

    def _hidden(self, batch: list[BatchItem], draft: bool) -> tuple[torch.Tensor, _Plan]:
        model = self.model
        num_blocks = model.num_blocks(draft)
        if draft and self.data.shape[1] == model.config.num_layers:
            raise ValueError("draft=True but the cache has no draft layers")
        first_layer = model.config.num_layers if draft else 0
        plan = self._plan(batch)
        h = model.embed(plan.token_ids)  # [num_tokens, hidden]
        for b in range(num_blocks):
            q, k, v = model.qkv(b, h, plan.positions)
            k_row = (first_layer + b) * 2 * self.page_size  # V rows follow at + page_size
            self.flat[plan.write_rows + k_row] = k.reshape(k.shape[0], -1)
            self.flat[plan.write_rows + k_row + self.page_size] = v.reshape(v.shape[0], -1)
            h = model.block_out(b, h, self._attend(q, k_row, plan))
        return h, plan

    def _attend(self, q: torch.Tensor, k_row: int, plan: _Plan) -> torch.Tensor:
        """q: [num_tokens, heads, dim] -> [num_tokens, heads * dim], group by group."""
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for g in plan.groups:
            k = self.flat[g.key_rows + k_row]  # [B, num_keys, kv_heads * dim]
            v = self.flat[g.key_rows + k_row + self.page_size]
            o = _group_attention(q, k, v, g)  # [B, num_queries, heads * dim]
            # Index tensors built on the host: no device sync from boolean masking.
            out[g.valid_dest] = o.reshape(-1, o.shape[-1])[g.valid_src]
        return out

    def _plan(self, batch: list[BatchItem]) -> _Plan:
        _validate(batch, self.model.config)
        ids, positions, slots = [], [], []
        dev = self.model.device
        for item in batch:
            ids.append(torch.as_tensor(item.token_ids, dtype=torch.int64).reshape(-1).to(dev))
            positions.append(torch.arange(item.start, item.end))
            slots.append(self.cache.slots(item.kv, 0, item.end))  # [end] int64
        writes = self._rows_of(torch.cat([s[it.start:] for s, it in zip(slots, batch)]))
        lengths = [it.num_tokens for it in batch]
        return _Plan(token_ids=torch.cat(ids).to(dev), positions=torch.cat(positions).to(dev),
                     write_rows=writes.to(dev), groups=self._groups(batch, slots, lengths),
                     lengths=lengths)

    def _rows_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Flat-pool rows of the K of layer 0 at the given slots."""
        return slots // self.page_size * self.page_rows + slots % self.page_size

    def _groups(self, batch: list[BatchItem], slots: list[torch.Tensor], lengths: list[int]
                ) -> list[_Group]:
        firsts = [sum(lengths[:i]) for i in range(len(batch))]
        packed = [i for i, n in enumerate(lengths) if n <= PACK_MAX_QUERY]
        alone = [[i] for i, n in enumerate(lengths) if n > PACK_MAX_QUERY]
        members = ([packed] if packed else []) + alone
        cfg = self.model.config
        group_size = cfg.num_heads // cfg.num_kv_heads
        return [_build_group([batch[i] for i in m], [self._rows_of(slots[i]) for i in m],
                             [firsts[i] for i in m], group_size, self.model.device)
                for m in members]


def _validate(batch: list[BatchItem], cfg: ModelConfig) -> None:
    if not batch:
        raise ValueError("empty batch")
    rows = [item.kv.row for item in batch]
    if len(set(rows)) != len(rows):
        raise ValueError(f"a kv row appears twice in one batch: rows {rows}")
    for item in batch:
        ids = torch.as_tensor(item.token_ids)
        if item.num_tokens < 1 or item.start < 0:
            raise ValueError(f"row {item.kv.row}: need >= 1 token and start >= 0, got "
                             f"{item.num_tokens} tokens at start {item.start}")
        if item.end > item.kv.allocated_len or item.end > cfg.max_position:
            raise ValueError(f"row {item.kv.row}: positions [{item.start}, {item.end}) pass "
                             f"allocated_len={item.kv.allocated_len} or "
                             f"max_position={cfg.max_position}; extend the row first")
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"row {item.kv.row}: token ids must be in [0, {cfg.vocab_size})")


def _build_group(items: list[BatchItem], rows: list[torch.Tensor], firsts: list[int],
                 group_size: int, device: torch.device) -> _Group:
    num_q = max(it.num_tokens for it in items)
    num_k = max(it.end for it in items)
    q_index = torch.empty(len(items), num_q, dtype=torch.int64)
    q_pos = torch.empty(len(items), num_q, dtype=torch.int64)
    key_rows = torch.empty(len(items), num_k, dtype=torch.int64)
    for b, (it, r, first) in enumerate(zip(items, rows, firsts)):
        # Padding repeats the item's last token and last slot: real data, masked out.
        j = torch.arange(num_q).clamp(max=it.num_tokens - 1)
        q_index[b], q_pos[b] = first + j, it.start + j
        key_rows[b] = r[torch.arange(num_k).clamp(max=it.end - 1)]
    q_valid = torch.arange(num_q) < torch.tensor([it.num_tokens for it in items])[:, None]
    valid_src = q_valid.reshape(-1).nonzero().reshape(-1)
    k_len = torch.tensor([it.end for it in items])[:, None, None]  # [B, 1, 1]
    k_pos = torch.arange(num_k)
    mask = (k_pos <= q_pos[:, :, None]) & (k_pos < k_len)  # [B, num_q, num_k]
    # Query rows are ordered (group member, query) to match _group_attention's reshape.
    mask = mask[:, None].expand(-1, group_size, -1, -1).reshape(len(items), 1, -1, num_k)
    return _Group(query_index=q_index.to(device), valid_src=valid_src.to(device),
                  valid_dest=q_index.reshape(-1)[valid_src].to(device),
                  key_rows=key_rows.to(device), mask=mask.to(device))


def _group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: _Group
                     ) -> torch.Tensor:
    """Grouped-query attention of one group without repeating K/V per query head.

    q: [num_tokens, heads, dim]; k, v: [B, num_keys, kv_heads * dim] (gathered, padded).
    Returns [B, num_queries, heads * dim].
    """
    num_b, num_q = g.query_index.shape
    dim = q.shape[2]
    k = k.view(num_b, k.shape[1], -1, dim).transpose(1, 2)  # [B, kv_heads, num_keys, dim]
    v = v.view(num_b, v.shape[1], -1, dim).transpose(1, 2)
    kv_heads = k.shape[1]
    qg = q[g.query_index].reshape(num_b, num_q, kv_heads, -1, dim)  # [B, nq, kvh, grp, dim]
    qg = qg.permute(0, 2, 3, 1, 4).reshape(num_b, kv_heads, -1, dim)  # [B, kvh, grp*nq, dim]
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask)  # [B, kvh, grp*nq, dim]
    o = o.reshape(num_b, kv_heads, -1, num_q, dim).permute(0, 3, 1, 2, 4)
    return o.reshape(num_b, num_q, -1)  # [B, nq, heads * dim]
