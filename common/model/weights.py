"""The runner's weight layout, filled tensor by tensor from Hugging Face names.

Every model enters pdkv the same way: a stream of ``(name, tensor)`` pairs named as in a
Hugging Face Llama checkpoint (``model.layers.3.self_attn.q_proj.weight``...), from a
safetensors checkpoint (``common.model.checkpoint``) or drawn from a seed
(``common.model.seeded``). ``WeightLoader`` copies each into preallocated fused tensors as
it arrives, so host memory holds one copy of the weights plus one tensor in flight.

Layout (matrices ``[out, in]`` as in Hugging Face, applied with ``F.linear``)::

    w_qkv     [(num_heads + 2 * num_kv_heads) * head_dim, hidden]   q | k | v rows
    w_gate_up [2 * intermediate, hidden]                            gate | up rows
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from common.model.checkpoint import StoredTensor
from common.model.config import ModelConfig

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_IGNORED = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved
_SAMPLE_WINDOWS, _SAMPLE_BYTES = 16, 4096


@dataclass
class BlockWeights:
    """One transformer block (see the module docstring for the fused layouts)."""

    attn_norm: torch.Tensor  # [hidden]
    w_qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    b_qkv: torch.Tensor | None  # [q_size + 2 * kv_size] (Qwen2, attention_bias)
    w_o: torch.Tensor  # [hidden, q_size]
    b_o: torch.Tensor | None  # [hidden] (attention_bias)
    mlp_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [2 * intermediate, hidden]
    w_down: torch.Tensor  # [hidden, intermediate]


@dataclass
class Weights:
    """All weights of a model on one device, and the fingerprint of where they came from."""

    embedding: torch.Tensor  # [vocab, hidden]
    blocks: list[BlockWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied
    fingerprint: str
    """Digest of the config and of every loaded tensor's name, shape, dtype and sampled
    bytes (as loaded, in the model's dtype)."""


class WeightLoader:
    """Copies Hugging Face-named tensors into a model's fused layout as they arrive.

    Args:
        cfg: the model's config (shapes, biases, tied embeddings).
        device: where the weights live.

    ``add`` each tensor once (any order), then ``finish``; unknown names, wrong shapes,
    duplicates and missing tensors raise ``ValueError`` naming the tensor.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self._targets, self._fused = _targets(cfg, device)
        self._seen: set[str] = set()
        self._digest = hashlib.sha256(repr(sorted(_digest_fields(cfg).items())).encode())
        self._digest_parts: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor | StoredTensor) -> None:
        """Copy one checkpoint tensor into place (converting to the model's dtype); a
        ``StoredTensor`` of the model's dtype is read from the file straight into place."""
        if name.endswith(_IGNORED):
            return
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return  # tied: transformers uses the embedding whatever the file holds
        target = self._targets.get(name)
        if target is None:
            raise ValueError(f"checkpoint tensor {name!r} is not part of a "
                             f"{self.cfg.architecture} with this config.json (quantized or "
                             "another architecture?)")
        if name in self._seen:
            raise ValueError(f"checkpoint tensor {name!r} appears twice")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"config.json implies {tuple(target.shape)}")
        if not isinstance(tensor, StoredTensor):
            target.copy_(tensor)
        elif tensor.dtype == target.dtype and target.is_contiguous() and \
                target.device.type == "cpu":
            tensor.read_into(target)
        else:  # another dtype or device: one tensor in flight
            target.copy_(tensor.load())
        self._digest_parts[name] = _sample_digest(name, target)
        self._seen.add(name)

    def finish(self) -> Weights:
        """The loaded weights; raises if a tensor the config needs never arrived."""
        missing = sorted(set(self._targets) - self._seen)
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ValueError(f"checkpoint lacks tensors {missing[:3]}{more}")
        for name in sorted(self._digest_parts):
            self._digest.update(self._digest_parts[name].encode())
        return _assemble(self.cfg, self._targets, self._fused, self._digest.hexdigest()[:32])


def load_into(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor | StoredTensor]],
              device: torch.device) -> Weights:
    """Stream ``tensors`` through a ``WeightLoader``; each may be dropped once copied."""
    loader = WeightLoader(cfg, device)
    for name, tensor in tensors:
        loader.add(name, tensor)
        del tensor
    return loader.finish()


def _digest_fields(cfg: ModelConfig) -> dict:
    """Config fields that shape the math (not its name, path, dtype or draft choice)."""
    skip = {"name", "path", "dtype", "seed", "num_draft_layers"}
    return {k: v for k, v in cfg.to_dict().items() if k not in skip}


def _sample_digest(name: str, tensor: torch.Tensor) -> str:
    """sha256 of the name, shape, dtype and up to 16 evenly spaced 4 KiB windows of bytes:
    any two different trainings differ there, and a 16 GB checkpoint digests in
    milliseconds (a bit flip between windows goes unseen; the loader is not a checksum)."""
    h = hashlib.sha256(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
    raw = tensor.detach().reshape(-1).view(torch.uint8)
    n = raw.numel()
    step = max(_SAMPLE_BYTES, n // _SAMPLE_WINDOWS)
    for start in range(0, n, step):
        h.update(raw[start:start + _SAMPLE_BYTES].cpu().numpy().tobytes())
    return h.hexdigest()


def _targets(cfg: ModelConfig, device: torch.device
             ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Preallocated tensors (and views into the fused ones) keyed by checkpoint tensor
    name, and the fused tensors keyed ``<layer>.qkv``, ``<layer>.b_qkv``, ``<layer>.gate_up``."""
    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=cfg.torch_dtype, device=device)

    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": empty(cfg.vocab_size, h),
                                  "model.norm.weight": empty(h)}
    fused: dict[str, torch.Tensor] = {}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = empty(cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = fused[f"{i}.qkv"] = empty(q + 2 * kv, h)
        gate_up = fused[f"{i}.gate_up"] = empty(2 * inter, h)
        t[p + "self_attn.q_proj.weight"] = qkv[:q]
        t[p + "self_attn.k_proj.weight"] = qkv[q:q + kv]
        t[p + "self_attn.v_proj.weight"] = qkv[q + kv:]
        if cfg.qkv_bias:
            b = fused[f"{i}.b_qkv"] = empty(q + 2 * kv)
            t[p + "self_attn.q_proj.bias"], t[p + "self_attn.k_proj.bias"] = b[:q], b[q:q + kv]
            t[p + "self_attn.v_proj.bias"] = b[q + kv:]
        t[p + "self_attn.o_proj.weight"] = empty(h, q)
        if cfg.o_bias:
            t[p + "self_attn.o_proj.bias"] = empty(h)
        t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = gate_up[:inter], \
            gate_up[inter:]
        t[p + "mlp.down_proj.weight"] = empty(h, inter)
        t[p + "input_layernorm.weight"] = empty(h)
        t[p + "post_attention_layernorm.weight"] = empty(h)
    return t, fused


def _assemble(cfg: ModelConfig, t: dict[str, torch.Tensor], fused: dict[str, torch.Tensor],
              fingerprint: str) -> Weights:
    blocks = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        blocks.append(BlockWeights(
            attn_norm=t[p + "input_layernorm.weight"], w_qkv=fused[f"{i}.qkv"],
            b_qkv=fused.get(f"{i}.b_qkv"),
            w_o=t[p + "self_attn.o_proj.weight"],
            b_o=t[p + "self_attn.o_proj.bias"] if cfg.o_bias else None,
            mlp_norm=t[p + "post_attention_layernorm.weight"],
            w_gate_up=fused[f"{i}.gate_up"], w_down=t[p + "mlp.down_proj.weight"]))
    embedding = t["model.embed_tokens.weight"]
    return Weights(embedding=embedding, blocks=blocks, final_norm=t["model.norm.weight"],
                   lm_head=embedding if cfg.tie_word_embeddings else t["lm_head.weight"],
                   fingerprint=fingerprint)
