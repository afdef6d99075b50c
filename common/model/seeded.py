"""Weights of built-in models, drawn from the config's seed and named as in a Hugging Face
checkpoint, so they load through the same ``WeightLoader`` as real checkpoints (and
``write_checkpoint`` can save them as one).

The self-speculative draft (the first ``num_draft_layers`` blocks) proposes well because
blocks past the draft's depth are drawn with small residual contributions
(``LATE_BLOCK_SCALE``), the way trained models' late layers refine rather than rewrite the
residual stream.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from common.model.config import ModelConfig

LATE_BLOCK_SCALE = 0.05
"""Scale of the output projections of blocks the draft model skips."""


def _randn(shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    # Each tensor has its own CPU generator so weights are identical on every device and
    # do not depend on how many other tensors were drawn before.
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def seeded_tensors(cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of the seeded model, one tensor at a time (float32)."""
    seed = cfg.seed * 1_000_003
    yield "model.embed_tokens.weight", _randn((cfg.vocab_size, cfg.hidden_size), seed, 1.0)
    for i in range(cfg.num_layers):
        yield from _block(cfg, i)
    yield "model.norm.weight", 1.0 + _randn((cfg.hidden_size,), seed + 7, 0.1)
    if not cfg.tie_word_embeddings:
        # std 4/sqrt(hidden) spreads logits enough that greedy choices are not near-ties.
        yield "lm_head.weight", _randn((cfg.hidden_size, cfg.vocab_size), seed + 8,
                                       4 / math.sqrt(cfg.hidden_size)).T


def _block(cfg: ModelConfig, index: int) -> Iterator[tuple[str, torch.Tensor]]:
    seed = cfg.seed * 1_000_003 + 16 * (index + 1)
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    late = cfg.num_draft_layers > 0 and index >= cfg.num_draft_layers
    scale = LATE_BLOCK_SCALE if late else 1.0
    p = f"model.layers.{index}."
    yield p + "input_layernorm.weight", 1.0 + _randn((h,), seed + 1, 0.1)
    qkv = _randn((h, q + 2 * kv), seed + 2, 1 / math.sqrt(h)).T  # drawn [in, out]
    yield p + "self_attn.q_proj.weight", qkv[:q]
    yield p + "self_attn.k_proj.weight", qkv[q:q + kv]
    yield p + "self_attn.v_proj.weight", qkv[q + kv:]
    if cfg.qkv_bias:
        b = _randn((q + 2 * kv,), seed + 9, 0.1)
        yield p + "self_attn.q_proj.bias", b[:q]
        yield p + "self_attn.k_proj.bias", b[q:q + kv]
        yield p + "self_attn.v_proj.bias", b[q + kv:]
    yield p + "self_attn.o_proj.weight", _randn((q, h), seed + 3, scale / math.sqrt(q)).T
    if cfg.o_bias:
        yield p + "self_attn.o_proj.bias", _randn((h,), seed + 10, 0.1)
    yield p + "post_attention_layernorm.weight", 1.0 + _randn((h,), seed + 4, 0.1)
    gate_up = _randn((h, 2 * inter), seed + 5, 1 / math.sqrt(h)).T
    yield p + "mlp.gate_proj.weight", gate_up[:inter]
    yield p + "mlp.up_proj.weight", gate_up[inter:]
    yield p + "mlp.down_proj.weight", _randn((inter, h), seed + 6,
                                             scale / math.sqrt(inter)).T
