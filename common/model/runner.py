"""Batched forward passes of a ``Model`` over rows of a paged ``KvCache``, planned on the
host and run on the device without waiting for it.

One forward pass takes several requests, each a run of new tokens at positions
``[start, start + n)`` of its kv row: a prefill chunk (n > 1, start = tokens already in the
pool), a decode step (n = 1) or a speculative verification (n = k + 1). A pass is

1. planned (``plan``, host): token ids, positions, the pool rows each new token's K/V go
   to, the last token of each item, and the attention backend's arrays, all added to the
   step's ``HostPlan`` (``common.model.plan``), which a step uploads once;
2. run (``run``, device): embed, then per block Q/K/V of all tokens in one matmul, K/V
   written into the pool at the rows planned, attention by the backend
   (``common.model.attention``), the block's output; nothing is read back.

A pass may take some token ids from the device (``Sourced``): a draft pass feeds the
previous draft pass's proposals, a verification feeds all of them, and the host never
sees them before the step's one download.

``forward`` / ``forward_all`` plan, upload and run one pass (one copy in) and return
logits on the device; steps that sample use ``plan`` / ``run`` to put several passes and
their sampling into one upload.

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
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import numpy as np
import torch

from common.kv import KvCache, KvRecord
from common.model.attention import (
    PACK_MAX_QUERY,
    AttentionBackend,
    LayerArgs,
    PassGeometry,
    PoolView,
)
from common.model.backends import select_backend
from common.model.config import ModelConfig
from common.model.graphs import DecodeGraphs, graph_bucket, graphs_wanted
from common.model.model import Model
from common.model.plan import DevicePlan, HostPlan, Slot

__all__ = ["PACK_MAX_QUERY", "BatchItem", "ModelRunner", "PassPlan", "Sourced"]


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


@dataclass(frozen=True)
class Sourced:
    """Token ids a pass takes from a device tensor instead of its items' ``token_ids``
    (whose entries there are placeholders): token ``dest[i]`` of the pass is
    ``source.view(-1)[src[i]]``."""

    dest: np.ndarray
    src: np.ndarray


@dataclass
class PassPlan:
    """One forward pass as planned on the host (see the module doc)."""

    items: list[BatchItem]
    draft: bool
    lengths: np.ndarray
    slots: dict[str, Slot]
    attention: object
    """The backend's own plan (``AttentionBackend.plan``)."""
    sourced: Sourced | None = None
    bucket: tuple[int, int] | None = None
    """A decode pass padded for a CUDA graph: (items, pages per item); the padding items
    write to page 0 (reserved, never allocated) and are cut from the logits."""
    span: tuple[int, int] = (0, 0)
    """The bytes of the step's plan that this pass's arrays occupy."""

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def host_ids(self, source: np.ndarray | None = None) -> list[list[int]]:
        """Each item's token ids, the sourced ones read from ``source`` (host values)."""
        flat = np.concatenate([np.asarray(_as_list(it.token_ids), np.int64)
                               for it in self.items])
        if self.sourced is not None:
            flat[self.sourced.dest] = np.asarray(source).reshape(-1)[self.sourced.src]
        return [part.tolist() for part in np.split(flat, np.cumsum(self.lengths)[:-1])]


class ModelRunner:
    """Runs ``model`` (target or draft) over rows of ``cache``; not thread-safe.

    Args:
        model: the target ``Model``; its device must be the cache's device.
        cache: a ``KvCache`` whose layout is the target's, with or without the draft's
            layers after it (without them ``draft=True`` fails).
        draft: a separate draft model (a draft checkpoint); None: the draft is the
            target's first ``num_draft_layers`` blocks.
        attention: the attention backend; None: ``select_backend`` for the pool's device.
        graphs: CUDA graphs of decode passes (``common.model.graphs``): None, on CUDA
            unless ``PDKV_CUDA_GRAPHS=0``; False: none; a ``DecodeGraphs``: that one.
    """

    def __init__(self, model: Model, cache: KvCache, draft: Model | None = None,
                 attention: AttentionBackend | None = None,
                 graphs: DecodeGraphs | bool | None = None) -> None:
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
        self.pool = PoolView(self.data, self.page_size)
        # The pool as rows of one token's K or V, [num_pages * total_layers * 2 * page_size,
        # kv_heads * head_dim]: scatters over contiguous rows run near memcpy speed.
        self.flat = self.pool.flat
        self.page_rows = self.pool.page_rows
        self.attention = attention or select_backend(model.device, self.page_size)
        self.device = model.device
        if graphs is None:
            graphs = graphs_wanted(self.device)
        self.graphs = DecodeGraphs(capture=True) if graphs is True else graphs or None

    @property
    def fingerprint(self) -> str:
        """The target's weights fingerprint, combined with a draft checkpoint's."""
        if self.draft is None:
            return self.model.fingerprint
        both = f"{self.model.fingerprint}+{self.draft.fingerprint}".encode()
        return hashlib.sha256(both).hexdigest()[:32]

    # -- one pass, planned and uploaded alone --------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: list[BatchItem], *, draft: bool = False) -> torch.Tensor:
        """Runs the batch; returns logits of each item's last token, [len(batch), vocab]."""
        host = HostPlan(self.device)
        pp = self.plan(host, batch, draft=draft)
        dev = host.upload()
        return self.step_logits(pp, dev)

    @torch.inference_mode()
    def forward_all(self, batch: list[BatchItem], *, draft: bool = False
                    ) -> list[torch.Tensor]:
        """Runs the batch; returns logits of every new token, one [n_i, vocab] per item
        (speculative verification needs all k + 1)."""
        host = HostPlan(self.device)
        pp = self.plan(host, batch, draft=draft)
        dev = host.upload()
        return list(self.logits(pp, dev, self.run(pp, dev), every=True).split(
            pp.lengths.tolist()))

    # -- plan (host) and run (device) -----------------------------------------------------
    def model_of(self, draft: bool) -> Model:
        return self.draft if draft and self.draft is not None else self.model

    def plan(self, host: HostPlan, batch: Sequence[BatchItem], *, draft: bool = False,
             sourced: Sourced | None = None) -> PassPlan:
        """Adds one pass's arrays to ``host`` (see the module doc); checks the batch.

        Key and write rows come from each row's page table (``cache.pages``, one entry per
        page) with a few numpy ops over all items; no per-item tensors are made.
        """
        if draft and self.data.shape[1] == self.model.config.num_layers:
            raise ValueError("draft=True but the cache has no draft layers")
        cfg = self.model_of(draft).config
        batch = list(batch)
        _validate(batch, cfg)
        ids = _token_ids(batch)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size):
            bad = next(it for it in batch
                       if any(not 0 <= int(t) < cfg.vocab_size for t in _as_list(it.token_ids)))
            raise ValueError(f"row {bad.kv.row}: token ids must be in [0, {cfg.vocab_size})")
        ps = self.page_size
        start_byte = host.nbytes
        starts = np.fromiter((it.start for it in batch), np.int64, len(batch))
        lengths = np.fromiter((len(it.token_ids) for it in batch), np.int64, len(batch))
        ends = starts + lengths
        # All items' page tables end to end; item b's page i is tables[page_off[b] + i].
        tables = [self.cache.pages(it.kv, 0, int(e)) for it, e in zip(batch, ends)]
        rotary = self.model_of(draft).rotary
        bucket = None
        if self.graphs is not None and not draft and sourced is None and \
                not rotary.is_stretched(ends):
            bucket = graph_bucket(lengths, [len(t) for t in tables])
        real = lengths
        if bucket is not None:  # padding items: one token at position 0 of page 0
            pad = bucket[0] - len(batch)
            starts, lengths = np.append(starts, np.zeros(pad, np.int64)), \
                np.append(lengths, np.ones(pad, np.int64))
            tables += [np.zeros(1, np.int32)] * pad
            ids = np.append(ids, np.zeros(pad, np.int64))
        page_off = np.zeros(len(tables), np.int64)
        np.cumsum([len(t) for t in tables[:-1]], out=page_off[1:])
        flat_tables = np.concatenate(tables).astype(np.int64)
        firsts = np.cumsum(lengths) - lengths
        item_of = np.repeat(np.arange(len(tables)), lengths)
        positions = np.arange(int(lengths.sum())) - firsts[item_of] + starts[item_of]
        write_rows = flat_tables[page_off[item_of] + positions // ps] * self.page_rows \
            + positions % ps
        geo = PassGeometry(starts, lengths, firsts, page_off, flat_tables, ps,
                           cfg.num_heads // cfg.num_kv_heads, cfg.sliding_window,
                           bucket[1] if bucket else 0)
        slots = {"token_ids": host.add(ids), "positions": host.add(positions),
                 "write_rows": host.add(write_rows), "last": host.add(firsts + lengths - 1)}
        if rotary.is_stretched(ends):
            cos, sin = rotary.stretched(positions, ends, lengths)
            slots["cos"], slots["sin"] = host.add(cos), host.add(sin)
        if sourced is not None:
            slots["src_dest"] = host.add(sourced.dest, np.int64)
            slots["src_index"] = host.add(sourced.src, np.int64)
        attention = self.attention.plan(host, geo)
        return PassPlan(batch, draft, real, slots, attention, sourced, bucket,
                        (start_byte, host.nbytes))

    def run(self, pp: PassPlan, dev: DevicePlan, source: torch.Tensor | None = None
            ) -> torch.Tensor:
        """Runs a planned pass; returns the hidden states [num_tokens, hidden] (device).

        ``source``: the device tensor the pass's ``Sourced`` token ids come from. The
        pass runs inside ``around_pass``.
        """
        with self.around_pass():
            return self._run(pp, dev, source)

    def _run(self, pp: PassPlan, dev: DevicePlan, source: torch.Tensor | None
             ) -> torch.Tensor:
        draft = pp.draft
        model = self.model_of(draft)
        num_blocks = model.num_blocks(draft and self.draft is None)
        first_layer = self.model.config.num_layers if draft else 0
        width = model.config.kv_size  # a narrower draft fills the first columns of a row
        t = {name: dev[slot] for name, slot in pp.slots.items()}
        ids = t["token_ids"]
        if pp.sourced is not None:
            ids = ids.index_copy(0, t["src_dest"], source.reshape(-1)[t["src_index"]])
        rope = self._rope(model, t)
        state = self.attention.bind(pp.attention, dev, self.pool, model.config.torch_dtype)
        h = model.embed(ids)  # [num_tokens, hidden]
        for b in range(num_blocks):
            q, k, v = model.qkv(b, h, rope)
            layer = first_layer + b
            k_row = layer * 2 * self.page_size  # V rows follow at + page_size
            self._write(t["write_rows"] + k_row, k, width)
            self._write(t["write_rows"] + k_row + self.page_size, v, width)
            attn = self.attention.attend(state, LayerArgs(q, k, v, layer, width))
            h = model.block_out(b, h, attn)
        return h

    def logits(self, pp: PassPlan, dev: DevicePlan, h: torch.Tensor, *, every: bool = False,
               padded: bool = False) -> torch.Tensor:
        """Logits of each item's last token [items, vocab], or of every token (a padded
        pass's padding cut off unless ``padded``)."""
        if every:
            return self.head(pp, h[:pp.num_tokens])
        out = self.head(pp, h, dev[pp.slots["last"]])
        return out if padded else out[:len(pp.items)]

    def head(self, pp: PassPlan, h: torch.Tensor, rows: torch.Tensor | None = None
             ) -> torch.Tensor:
        """Logits of ``h[rows]`` (all of ``h`` when None), ``h`` being the hidden states
        of ``pp``, the pass run last: every logits computation goes through here (a
        tensor-parallel leader announces the rows, its followers compute their shards of
        the same rows)."""
        return self.model_of(pp.draft).logits(h if rows is None else h[rows])

    def step_logits(self, pp: PassPlan, dev: DevicePlan) -> torch.Tensor:
        """``logits(run(...))`` of a planned pass; a padded decode pass through its CUDA
        graph (``common.model.graphs``)."""
        if pp.bucket is not None and self.graphs is not None:
            with self.around_pass():  # a replay is a pass too (``run`` nests in a capture)
                return self.graphs.logits(self, pp, dev)[:len(pp.items)]
        return self.logits(pp, dev, self.run(pp, dev))

    @staticmethod
    def _rope(model: Model, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if "cos" in t:  # dynamic RoPE past the original context: planned on the host
            dt = model.config.torch_dtype
            return t["cos"].to(dt)[:, None, :], t["sin"].to(dt)[:, None, :]
        return model.rope(t["positions"])

    def _write(self, rows: torch.Tensor, x: torch.Tensor, width: int) -> None:
        """x: [num_tokens, kv_heads, dim] into pool rows (all columns: the fast path)."""
        if width == self.flat.shape[1]:
            self.flat[rows] = x.reshape(x.shape[0], -1)
        else:
            self.flat[rows, :width] = x.reshape(x.shape[0], -1)


def _as_list(token_ids: torch.Tensor | list[int]) -> list[int]:
    return token_ids if isinstance(token_ids, list) else torch.as_tensor(
        token_ids).reshape(-1).tolist()


def _token_ids(batch: list[BatchItem]) -> np.ndarray:
    """All items' token ids end to end, int64 on the host (one array for the batch)."""
    flat: list[int] = []
    for it in batch:
        flat.extend(_as_list(it.token_ids))
    return np.asarray(flat, dtype=np.int64)


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
