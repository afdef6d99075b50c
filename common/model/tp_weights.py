"""Loading one tensor-parallel rank's shard of the weights: each rank reads only its slice.

The shard plan, by Hugging Face name (matrices ``[out, in]``; rank ``r`` of ``size``):

    q_proj (+bias)            rows of query heads [r*H/size, (r+1)*H/size)   column-parallel
    k_proj, v_proj (+bias)    rows of KV heads [r*KV/size, ...)              column-parallel
    o_proj                    columns of the rank's query heads              row-parallel
    gate_proj, up_proj        rows [r*I/size, ...)                           column-parallel
    down_proj                 columns [r*I/size, ...)                        row-parallel
    lm_head                   rows (vocabulary) ``shard_range(V, size, r)``  gathered on rank 0
    embed_tokens, norms, o_proj bias        whole (replicated)

A row slice of a stored tensor is one byte range of the file, read straight into place; a
column slice is read row by row, so a rank never reads bytes it does not hold (a seeded
model is drawn whole, tensor by tensor, and cut).

The fingerprint must not depend on the group size (a TP2 prefill and a TP1 decode hold
the same model): each tensor's digest is taken over the whole tensor, from the same
sampled byte windows ``common.model.weights`` digests, read from the file window by
window.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace

import torch

from common.model.checkpoint import StoredTensor, checkpoint_tensors
from common.model.config import ModelConfig
from common.model.seeded import seeded_tensors
from common.model.weights import (
    _SAMPLE_BYTES,
    _SAMPLE_WINDOWS,
    WeightLoader,
    Weights,
    _digest_fields,
    _sample_digest,
)
from common.parallel import even_range, shard_range

_LAYER = re.compile(r"model\.layers\.\d+\.(.+)")


def shard_of(name: str, cfg: ModelConfig, rank: int, size: int
             ) -> tuple[int, int, int] | None:
    """``(dim, start, end)`` of ``name`` that ``rank`` holds, or None for the whole tensor."""
    d = cfg.head_dim
    layer = _LAYER.fullmatch(name)
    part = layer.group(1) if layer else name
    if part.startswith("self_attn.q_proj."):
        q0, q1 = even_range(cfg.num_heads, size, rank, "num_heads")
        return 0, q0 * d, q1 * d
    if part.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
        k0, k1 = even_range(cfg.num_kv_heads, size, rank, "num_kv_heads")
        return 0, k0 * d, k1 * d
    if part == "self_attn.o_proj.weight":
        q0, q1 = even_range(cfg.num_heads, size, rank, "num_heads")
        return 1, q0 * d, q1 * d
    if part in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
        i0, i1 = even_range(cfg.intermediate_size, size, rank, "intermediate_size")
        return (1 if part == "mlp.down_proj.weight" else 0), i0, i1
    if name == "lm_head.weight":
        return (0, *shard_range(cfg.vocab_size, size, rank))
    return None


def load_shard(full: ModelConfig, local: ModelConfig, rank: int, size: int,
               device: torch.device) -> Weights:
    """This rank's weights (shapes of ``local``, the lm head cut by vocabulary), with the
    whole model's fingerprint."""
    source = checkpoint_tensors(full.path) if full.path else seeded_tensors(full)
    loader = _ShardLoader(full, local, rank, size, device)
    for name, tensor in source:
        loader.add_whole(name, tensor)
        del tensor
    return loader.finish()


class _ShardLoader(WeightLoader):
    """A ``WeightLoader`` of the local shape whose ``add_whole`` takes whole tensors."""

    def __init__(self, full: ModelConfig, local: ModelConfig, rank: int, size: int,
                 device: torch.device) -> None:
        super().__init__(local, device)
        self.full, self.rank, self.size = full, rank, size
        if not full.tie_word_embeddings:
            v0, v1 = shard_range(full.vocab_size, size, rank)
            self._targets["lm_head.weight"] = torch.empty(
                v1 - v0, full.hidden_size, dtype=full.torch_dtype, device=device)
        self._digest = hashlib.sha256(repr(sorted(_digest_fields(full).items())).encode())
        self._whole: dict[str, str] = {}

    def add_whole(self, name: str, tensor: torch.Tensor | StoredTensor) -> None:
        """Digest the whole tensor, then copy this rank's slice into place."""
        if name in self._targets and name not in self._whole:
            self._whole[name] = _whole_digest(name, tensor, self.full.torch_dtype)
        cut = shard_of(name, self.full, self.rank, self.size)
        self.add(name, tensor if cut is None else _slice(tensor, *cut))

    def finish(self) -> Weights:
        digest = self._digest.copy()  # before finish() feeds it the shards' digests
        weights = super().finish()  # raises on a missing tensor
        for name in sorted(self._whole):
            digest.update(self._whole[name].encode())
        return replace(weights, fingerprint=digest.hexdigest()[:32])


def _slice(t: torch.Tensor | StoredTensor, dim: int, start: int, end: int
           ) -> torch.Tensor | StoredTensor:
    if isinstance(t, torch.Tensor):
        return t.narrow(dim, start, end - start)
    if dim == 0:  # whole rows: one byte range of the file
        row = t.nbytes // t.shape[0]
        return replace(t, shape=(end - start, *t.shape[1:]), offset=t.offset + start * row,
                       nbytes=(end - start) * row)
    return _read_columns(t, start, end)


def _read_columns(t: StoredTensor, start: int, end: int) -> torch.Tensor:
    """Columns ``[start, end)`` of a stored 2-D tensor, one read per row."""
    rows, cols = t.shape
    elt = t.nbytes // (rows * cols)
    out = torch.empty((rows, end - start), dtype=t.dtype)
    view = memoryview(out.view(torch.uint8).numpy()).cast("B")
    width = (end - start) * elt
    with open(t.file, "rb", buffering=0) as f:
        for r in range(rows):
            f.seek(t.offset + (r * cols + start) * elt)
            if f.readinto(view[r * width:(r + 1) * width]) != width:
                raise ValueError(f"{t.file}: tensor {t.name!r} is truncated")
    return out


def _whole_digest(name: str, t: torch.Tensor | StoredTensor, dtype: torch.dtype) -> str:
    """``weights._sample_digest`` of the whole tensor in ``dtype``; a stored tensor is
    read only at the sampled windows."""
    if isinstance(t, torch.Tensor):
        return _sample_digest(name, t.to(dtype))
    h = hashlib.sha256(f"{name}|{tuple(t.shape)}|{dtype}".encode())
    elt_in = t.dtype.itemsize
    elt_out = dtype.itemsize
    numel = t.nbytes // elt_in
    n = numel * elt_out
    step = max(_SAMPLE_BYTES, n // _SAMPLE_WINDOWS)
    with open(t.file, "rb", buffering=0) as f:
        for start in range(0, n, step):
            e0, e1 = start // elt_out, min(numel, -(-(start + _SAMPLE_BYTES) // elt_out))
            f.seek(t.offset + e0 * elt_in)
            raw = torch.frombuffer(bytearray(f.read((e1 - e0) * elt_in)), dtype=t.dtype)
            window = raw.to(dtype).view(torch.uint8).numpy().tobytes()
            skip = start - e0 * elt_out
            h.update(window[skip:skip + _SAMPLE_BYTES])
    return h.hexdigest()

