"""A Llama-style decoder (Llama, Qwen2, Mistral), split into the pieces a paged runner needs.

The model itself holds no KV: ``ModelRunner`` (common/model/runner.py) calls
``embed``, then per block ``qkv`` -> (its own paged attention) -> ``block_out``, then
``logits``. ``forward_dense`` runs the same pieces with plain causal attention over one
sequence and no cache; tests use it as the reference the paged path must match.

Weights load through ``common.model.weights.WeightLoader`` from a checkpoint directory
(``config.path``) or from the seed (built-in models): one way into pdkv for both.

The built-in draft model (speculative decoding) is self-speculative layer skipping: the
first ``num_draft_layers`` blocks of the target plus the target's final norm and lm_head
(see ``common.model.seeded`` for why its proposals agree).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from common.model.checkpoint import checkpoint_tensors
from common.model.config import ModelConfig, get_config
from common.model.rope import Rotary, rotate
from common.model.seeded import LATE_BLOCK_SCALE, seeded_tensors
from common.model.weights import BlockWeights, Weights, load_into

__all__ = ["LATE_BLOCK_SCALE", "BlockWeights", "Model", "dense_causal_attention",
           "load_weights", "rms_norm"]


def load_weights(cfg: ModelConfig, device: torch.device) -> Weights:
    """The weights of ``cfg``: from its checkpoint directory, or drawn from its seed."""
    source = checkpoint_tensors(cfg.path) if cfg.path else seeded_tensors(cfg)
    return load_into(cfg, source, device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension; half types are normalised in float32."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Model:
    """A Llama-style decoder on one device.

    Args:
        config: shape and options; ``config.path`` names the checkpoint directory, empty
            draws the weights from ``config.seed``.
        device: where weights and activations live.
        weights: already loaded weights (skips loading).
    """

    def __init__(self, config: ModelConfig | None = None, device: str | torch.device = "cpu",
                 weights: Weights | None = None):
        self.config = config or get_config("tiny")
        self.device = torch.device(device)
        w = weights or load_weights(self.config, self.device)
        self.embedding, self.blocks = w.embedding, w.blocks
        self.final_norm, self.lm_head = w.final_norm, w.lm_head
        self.fingerprint = w.fingerprint
        """Digest of config and weights; workers with different weights refuse each other."""
        self.rotary = Rotary(self.config, self.device)

    def num_blocks(self, draft: bool = False) -> int:
        """Blocks run by the target (all) or by the draft (the first num_draft_layers)."""
        if draft and self.config.num_draft_layers == 0:
            raise ValueError(f"model {self.config.name!r} has no draft (num_draft_layers=0)")
        return self.config.num_draft_layers if draft else self.config.num_layers

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: [num_tokens] int64 on the model's device -> [num_tokens, hidden]."""
        return self.embedding[token_ids]

    def rope(self, positions: torch.Tensor, ends: list[int] | None = None,
             lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of ``positions`` for ``qkv`` (see ``Rotary.tables``), once per pass."""
        return self.rotary.tables(positions, ends, lengths)

    def qkv(self, block: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries and keys, and values, of the hidden states h: [num_tokens, hidden].

        ``rope``: ``self.rope(positions)`` of the tokens. Returns q: [num_tokens, num_heads,
        head_dim], k and v: [num_tokens, num_kv_heads, head_dim]; query head i reads KV
        head i // (num_heads // num_kv_heads).
        """
        cfg, w = self.config, self.blocks[block]
        x = F.linear(rms_norm(h, w.attn_norm, cfg.rms_eps), w.w_qkv, w.b_qkv)
        q, k, v = x.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        cos, sin = rope
        q = rotate(q.reshape(-1, cfg.num_heads, cfg.head_dim), cos, sin)
        k = rotate(k.reshape(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        return q, k, v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)

    def block_out(self, block: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual update of a block: attn: [num_tokens, num_heads * head_dim] -> new h."""
        cfg, w = self.config, self.blocks[block]
        h = h + F.linear(attn, w.w_o, w.b_o)
        gate, up = F.linear(rms_norm(h, w.mlp_norm, cfg.rms_eps), w.w_gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, w.w_down)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [num_tokens, hidden] -> [num_tokens, vocab] (final norm, lm_head)."""
        return F.linear(rms_norm(h, self.final_norm, self.config.rms_eps), self.lm_head)

    def greedy(self, logits: torch.Tensor) -> list[int]:
        """The most likely token of each row of ``logits`` ([batch, vocab]); a
        tensor-parallel shard (``common.model.tp``) picks on rank 0 and shares the ids."""
        return logits.argmax(dim=-1).tolist()

    @torch.inference_mode()
    def forward_dense(self, token_ids: list[int] | torch.Tensor, *, draft: bool = False
                      ) -> torch.Tensor:
        """Logits [n, vocab] of every position of one sequence, no cache: the reference."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64).to(self.device)
        positions = torch.arange(len(ids), device=self.device)
        rope = self.rope(positions, [len(ids)], [len(ids)])
        h = self.embed(ids)
        for b in range(self.num_blocks(draft)):
            q, k, v = self.qkv(b, h, rope)
            h = self.block_out(b, h, dense_causal_attention(q, k, v, self.config.sliding_window))
        return self.logits(h)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           window: int = 0) -> torch.Tensor:
    """Plain causal attention over one sequence (written out, unlike the runner's SDPA).

    q: [n, num_heads, head_dim]; k, v: [n, num_kv_heads, head_dim] -> [n, num_heads * head_dim].
    ``window`` > 0: query i sees keys (i - window, i] only (Mistral's sliding window).
    """
    n, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [n, num_heads, head_dim]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)  # [heads, n, n]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if window:
        causal = causal.triu(1 - window)
    probs = scores.float() if q.dtype in (torch.float16, torch.bfloat16) else scores
    probs = probs.masked_fill(~causal, float("-inf")).softmax(-1).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(n, num_heads * head_dim)
