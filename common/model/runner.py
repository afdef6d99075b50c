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
head_dim]``; target block b uses layer b, draft block b uses layer num_layers + b. The
draft is the target's own first layers (built-in models) or a separate draft checkpoint,
whose K/V rows may be narrower than the target's: they fill the first
``draft.num_kv_heads * draft.head_dim`` columns of each row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from common.kv import KvCache, KvRecord
from common.model.config import ModelConfig
from common.model.model import Model

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
    whole: bool = False  # unpadded, its items' tokens contiguous from the batch's first


@dataclass
class _Plan:
    """Everything a forward pass derives from the batch once, shared by all blocks."""

    token_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    write_rows: torch.Tensor  # [num_tokens] flat-pool row of each new token's K at layer 0
    groups: list[_Group]
    lengths: list[int]
    ends: list[int]


class ModelRunner:
    """Runs ``model`` (target or draft) over rows of ``cache``; not thread-safe.

    Args:
        model: the target ``Model``; its device must be the cache's device.
        cache: a ``KvCache`` whose layout is the target's, with or without the draft's
            layers after it (without them ``draft=True`` fails).
        draft: a separate draft model (a draft checkpoint); None: the draft is the
            target's first ``num_draft_layers`` blocks.
    """

    def __init__(self, model: Model, cache: KvCache, draft: Model | None = None) -> None:
        cfg, layout = model.config, cache.layout
        with_draft = cfg.kv_layout(True) if draft is None else replace(
            cfg.kv_layout(False), num_draft_layers=draft.config.num_layers)
        if layout not in (with_draft, cfg.kv_layout(False)):
            raise ValueError(f"KV layout {layout} does not fit model {cfg.name!r}: expected "
                             f"{with_draft} (draft layers optional)")
        if draft is not None and (draft.config.kv_size > cfg.kv_size
                                  or draft.device != model.device):
            raise ValueError(f"draft {draft.config.name!r} does not fit: KV width "
                             f"{draft.config.kv_size} > {cfg.kv_size} or device "
                             f"{draft.device} != {model.device}")
        self.model, self.cache, self.draft = model, cache, draft
        self.page_size = cache.page_size
        self.around_pass: Callable[[], AbstractContextManager] = nullcontext
        """Context every forward pass runs in: a worker lends its sockets to a heartbeat
        thread for the pass's length (``common/node/pulse.py``); nothing by default."""
        self.data = cache.data()  # [num_pages, total_layers, 2, page_size, kv_heads, head_dim]
        if self.data.device != model.device:
            raise ValueError(f"cache on {self.data.device}, model on {model.device}")
        # The pool as rows of one token's K or V, [num_pages * total_layers * 2 * page_size,
        # kv_heads * head_dim]: gathers and scatters over contiguous rows run near memcpy
        # speed, where 2-index advanced indexing of the 6-d view was several times slower.
        self.flat = self.data.view(-1, layout.num_kv_heads * layout.head_dim)
        self.page_rows = layout.total_layers * 2 * self.page_size

    @property
    def fingerprint(self) -> str:
        """The target's weights fingerprint, combined with a draft checkpoint's."""
        if self.draft is None:
            return self.model.fingerprint
        both = f"{self.model.fingerprint}+{self.draft.fingerprint}".encode()
        return hashlib.sha256(both).hexdigest()[:32]

    @torch.inference_mode()
    def forward(self, batch: list[BatchItem], *, draft: bool = False) -> torch.Tensor:
        """Runs the batch; returns logits of each item's last token, [len(batch), vocab]."""
        with self.around_pass():
            h, plan = self._hidden(batch, draft)
            last = torch.from_numpy(np.cumsum(plan.lengths) - 1)
            return self._pick(draft).logits(h[self._to_device(last)])

    @torch.inference_mode()
    def forward_all(self, batch: list[BatchItem], *, draft: bool = False
                    ) -> list[torch.Tensor]:
        """Runs the batch; returns logits of every new token, one [n_i, vocab] per item
        (speculative verification needs all k + 1)."""
        with self.around_pass():
            h, plan = self._hidden(batch, draft)
            return list(self._pick(draft).logits(h).split(plan.lengths))

    def _pick(self, draft: bool) -> Model:
        return self.draft if draft and self.draft is not None else self.model

    def _hidden(self, batch: list[BatchItem], draft: bool) -> tuple[torch.Tensor, _Plan]:
        model = self._pick(draft)
        num_blocks = model.num_blocks(draft and self.draft is None)
        if draft and self.data.shape[1] == self.model.config.num_layers:
            raise ValueError("draft=True but the cache has no draft layers")
        first_layer = self.model.config.num_layers if draft else 0
        width = model.config.kv_size  # a narrower draft fills the first columns of a row
        cols = slice(None) if width == self.flat.shape[1] else slice(0, width)
        plan = self._plan(batch, model.config)
        rope = model.rope(plan.positions, plan.ends, plan.lengths)
        h = model.embed(plan.token_ids)  # [num_tokens, hidden]
        for b in range(num_blocks):
            q, k, v = model.qkv(b, h, rope)
            k_row = (first_layer + b) * 2 * self.page_size  # V rows follow at + page_size
            self._write(plan.write_rows + k_row, k, cols)
            self._write(plan.write_rows + k_row + self.page_size, v, cols)
            h = model.block_out(b, h, self._attend(q, k_row, plan, cols))
        return h, plan

    def _write(self, rows: torch.Tensor, x: torch.Tensor, cols: slice) -> None:
        """x: [num_tokens, kv_heads, dim] into pool rows (all columns: the fast path)."""
        if cols == slice(None):
            self.flat[rows] = x.reshape(x.shape[0], -1)
        else:
            self.flat[rows, cols] = x.reshape(x.shape[0], -1)

    def _attend(self, q: torch.Tensor, k_row: int, plan: _Plan, cols: slice) -> torch.Tensor:
        """q: [num_tokens, heads, dim] -> [num_tokens, heads * dim], group by group."""
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for g in plan.groups:
            rows = g.key_rows.reshape(-1) + k_row
            shape = (*g.key_rows.shape, -1)  # [B, num_keys, kv_heads * dim]
            k = self.flat.index_select(0, rows)[:, cols].reshape(shape)
            v = self.flat.index_select(0, rows + self.page_size)[:, cols].reshape(shape)
            o = _group_attention(q, k, v, g)  # [B, num_queries, heads * dim]
            if g.whole and len(plan.groups) == 1:  # every token once, in order (decode)
                return o.reshape(out.shape)
            # Index tensors built on the host: no device sync from boolean masking.
            out[g.valid_dest] = o.reshape(-1, o.shape[-1])[g.valid_src]
        return out

    def _plan(self, batch: list[BatchItem], cfg: ModelConfig) -> _Plan:
        """Index tensors of the batch for the model of ``cfg``, built with a few numpy ops
        over all items.

        Key and write rows come from each row's page table (``cache.pages``, one entry per
        page) instead of its slot list (one per position), and no per-item tensors are made.
        """
        _validate(batch, cfg)
        ids = _token_ids(batch)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size):
            bad = next(it for it in batch
                       if any(not 0 <= int(t) < cfg.vocab_size for t in _as_list(it.token_ids)))
            raise ValueError(f"row {bad.kv.row}: token ids must be in [0, {cfg.vocab_size})")
        ps = self.page_size
        starts = np.fromiter((it.start for it in batch), np.int64, len(batch))
        lengths = np.fromiter((len(it.token_ids) for it in batch), np.int64, len(batch))
        ends = starts + lengths
        # All items' page tables end to end; item b's page i is flat_pages[page_off[b] + i].
        tables = [self.cache.pages(it.kv, 0, int(e)) for it, e in zip(batch, ends)]
        page_off = np.zeros(len(batch), np.int64)
        np.cumsum([len(t) for t in tables[:-1]], out=page_off[1:])
        page_base = np.concatenate(tables).astype(np.int64) * self.page_rows
        firsts = np.cumsum(lengths) - lengths
        total = int(lengths.sum())
        item_of = np.repeat(np.arange(len(batch)), lengths)
        positions = np.arange(total) - firsts[item_of] + starts[item_of]
        write_rows = page_base[page_off[item_of] + positions // ps] + positions % ps
        cfg_group = cfg.num_heads // cfg.num_kv_heads
        packed = np.flatnonzero(lengths <= PACK_MAX_QUERY)
        members = ([packed] if len(packed) else []) + [
            np.array([i]) for i in np.flatnonzero(lengths > PACK_MAX_QUERY)]
        groups = [_build_group(starts[m], lengths[m], firsts[m], page_off[m], page_base, ps,
                               cfg_group, cfg.sliding_window, self._to_device)
                  for m in members]
        return _Plan(token_ids=self._to_device(ids),
                     positions=self._to_device(torch.from_numpy(positions)),
                     write_rows=self._to_device(torch.from_numpy(write_rows)), groups=groups,
                     lengths=lengths.tolist(), ends=ends.tolist())

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.model.device.type == "cpu" else t.to(self.model.device)


def _as_list(token_ids: torch.Tensor | list[int]) -> list[int]:
    return token_ids if isinstance(token_ids, list) else torch.as_tensor(
        token_ids).reshape(-1).tolist()


def _token_ids(batch: list[BatchItem]) -> torch.Tensor:
    """All items' token ids end to end, int64 on the host (one tensor for the batch)."""
    flat: list[int] = []
    for it in batch:
        flat.extend(_as_list(it.token_ids))
    return torch.tensor(flat, dtype=torch.int64)


def _validate(batch: list[BatchItem], cfg: ModelConfig) -> None:
    """Batch shape checks (token id ranges are checked on the concatenated ids)."""
    if not batch:
        raise ValueError("empty batch")
    rows = {item.kv.row for item in batch}
    if len(rows) != len(batch):
        raise ValueError(f"a kv row appears twice in one batch: rows "
                         f"{[item.kv.row for item in batch]}")
    for item in batch:
        n = len(item.token_ids)
        end = item.start + n
        if n < 1 or item.start < 0:
            raise ValueError(f"row {item.kv.row}: need >= 1 token and start >= 0, got "
                             f"{n} tokens at start {item.start}")
        if end > item.kv.allocated_len or end > cfg.max_position:
            raise ValueError(f"row {item.kv.row}: positions [{item.start}, {end}) pass "
                             f"allocated_len={item.kv.allocated_len} or "
                             f"max_position={cfg.max_position}; extend the row first")


def _build_group(starts: np.ndarray, lengths: np.ndarray, firsts: np.ndarray,
                 page_off: np.ndarray, page_base: np.ndarray, page_size: int,
                 group_size: int, window: int, to_device) -> _Group:
    """One attention call over the items given by their starts, lengths, first token
    index in the batch and page-table offset into ``page_base`` (flat-pool row of each
    page's K at layer 0), all at once in numpy.

    With a sliding ``window`` only keys [start - window + 1, end) are gathered: a query
    at p sees keys (p - window, p]."""
    ends = starts + lengths
    lo = np.maximum(starts - window + 1, 0) if window else np.zeros_like(starts)
    num_b, num_q, num_k = len(starts), int(lengths.max()), int((ends - lo).max())
    # Padding repeats the item's last token and last slot: real data, masked out.
    j = np.minimum(np.arange(num_q), lengths[:, None] - 1)  # [B, num_q]
    q_index, q_pos = firsts[:, None] + j, starts[:, None] + j
    pos = lo[:, None] + np.minimum(np.arange(num_k), (ends - lo)[:, None] - 1)  # [B, num_k]
    key_rows = page_base[page_off[:, None] + pos // page_size] + pos % page_size
    valid_src = np.flatnonzero(np.arange(num_q) < lengths[:, None])
    k_pos = lo[:, None, None] + np.arange(num_k)  # [B, 1, nk], unclipped
    mask = (k_pos <= q_pos[:, :, None]) & (k_pos < ends[:, None, None])  # [B, nq, nk]
    if window:
        mask &= k_pos > q_pos[:, :, None] - window
    # Query rows are ordered (group member, query) to match _group_attention's reshape.
    mask = np.repeat(mask[:, None], group_size, axis=1).reshape(num_b, 1, -1, num_k)
    return _Group(query_index=to_device(torch.from_numpy(q_index)),
                  valid_src=to_device(torch.from_numpy(valid_src)),
                  valid_dest=to_device(torch.from_numpy(q_index.reshape(-1)[valid_src])),
                  key_rows=to_device(torch.from_numpy(key_rows)),
                  mask=to_device(torch.from_numpy(mask)),
                  whole=bool(firsts[0] == 0 and (lengths == num_q).all()
                             and (np.diff(firsts) == num_q).all()))


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
