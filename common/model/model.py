"""A Llama-style decoder with seeded weights, split into the pieces a paged runner needs.

The model itself holds no KV: ``ModelRunner`` (common/model/runner.py) calls
``embed``, then per block ``qkv`` -> (its own paged attention) -> ``block_out``, then
``logits``. ``forward_dense`` runs the same pieces with plain causal attention over one
sequence and no cache; tests use it as the reference the paged path must match.

The draft model (speculative decoding) is self-speculative layer skipping: the first
``num_draft_layers`` blocks of the target plus the target's final norm and lm_head.
To make its proposals often right, blocks past the draft's depth are drawn with small
residual contributions (``LATE_BLOCK_SCALE``), the way trained models' late layers refine
rather than rewrite the residual stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.model.config import ModelConfig, get_config

LATE_BLOCK_SCALE = 0.05
"""Scale of the output projections of blocks the draft model skips."""


@dataclass
class BlockWeights:
    """One transformer block; matrices are [in, out] so activations multiply on the left."""

    attn_norm: torch.Tensor  # [hidden]
    w_qkv: torch.Tensor  # [hidden, (num_heads + 2 * num_kv_heads) * head_dim]
    w_o: torch.Tensor  # [num_heads * head_dim, hidden]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [hidden, 2 * intermediate]
    w_down: torch.Tensor  # [intermediate, hidden]


def _randn(shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    # Each tensor has its own CPU generator so weights are identical on every device and
    # do not depend on how many other tensors were drawn before.
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def _init_block(cfg: ModelConfig, index: int) -> BlockWeights:
    seed = cfg.seed * 1_000_003 + 16 * (index + 1)
    h, d = cfg.hidden_size, cfg.head_dim
    q_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    late = cfg.num_draft_layers > 0 and index >= cfg.num_draft_layers
    scale = LATE_BLOCK_SCALE if late else 1.0
    return BlockWeights(
        attn_norm=1.0 + _randn((h,), seed + 1, 0.1),
        w_qkv=_randn((h, q_out), seed + 2, 1 / math.sqrt(h)),
        w_o=_randn((cfg.num_heads * d, h), seed + 3, scale / math.sqrt(cfg.num_heads * d)),
        mlp_norm=1.0 + _randn((h,), seed + 4, 0.1),
        w_gate_up=_randn((h, 2 * cfg.intermediate_size), seed + 5, 1 / math.sqrt(h)),
        w_down=_randn((cfg.intermediate_size, h), seed + 6,
                      scale / math.sqrt(cfg.intermediate_size)),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension; half types are normalised in float32."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


class Rotary:
    """Rotary position embeddings (Llama's rotate-half convention), tables precomputed."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        half = cfg.head_dim // 2
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) / half)
        angles = torch.arange(cfg.max_position, dtype=torch.float64)[:, None] * inv_freq
        self.cos = angles.cos().to(device, cfg.torch_dtype)  # [max_position, head_dim / 2]
        self.sin = angles.sin().to(device, cfg.torch_dtype)  # [max_position, head_dim / 2]

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, heads, head_dim]; positions: [num_tokens] on x's device."""
        cos = self.cos[positions][:, None, :]  # [num_tokens, 1, head_dim / 2]
        sin = self.sin[positions][:, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Model:
    """A Llama-style decoder on one device with weights drawn from ``config.seed``."""

    def __init__(self, config: ModelConfig | None = None, device: str | torch.device = "cpu"):
        self.config = config or get_config("tiny")
        self.device = torch.device(device)
        cfg, dt = self.config, self.config.torch_dtype
        seed = cfg.seed * 1_000_003

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.device, dt)

        self.embedding = put(_randn((cfg.vocab_size, cfg.hidden_size), seed, 1.0))
        self.blocks = [BlockWeights(*map(put, vars(_init_block(cfg, i)).values()))
                       for i in range(cfg.num_layers)]
        self.final_norm = put(1.0 + _randn((cfg.hidden_size,), seed + 7, 0.1))
        # std 1/sqrt(hidden)*4 spreads logits enough that greedy choices are not near-ties.
        self.lm_head = put(_randn((cfg.hidden_size, cfg.vocab_size), seed + 8,
                                  4 / math.sqrt(cfg.hidden_size)))
        self.rotary = Rotary(cfg, self.device)

    def num_blocks(self, draft: bool = False) -> int:
        """Blocks run by the target (all) or by the draft (the first num_draft_layers)."""
        if draft and self.config.num_draft_layers == 0:
            raise ValueError(f"model {self.config.name!r} has no draft (num_draft_layers=0)")
        return self.config.num_draft_layers if draft else self.config.num_layers

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: [num_tokens] int64 on the model's device -> [num_tokens, hidden]."""
        return self.embedding[token_ids]

    def qkv(self, block: int, h: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries and keys, and values, of the hidden states h: [num_tokens, hidden].

        Returns q: [num_tokens, num_heads, head_dim], k and v: [num_tokens, num_kv_heads,
        head_dim]; query head i reads KV head i // (num_heads // num_kv_heads).
        """
        cfg, w = self.config, self.blocks[block]
        x = rms_norm(h, w.attn_norm, cfg.rms_eps) @ w.w_qkv
        q, k, v = x.split([cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                           cfg.num_kv_heads * cfg.head_dim], dim=-1)
        q = self.rotary.apply(q.reshape(-1, cfg.num_heads, cfg.head_dim), positions)
        k = self.rotary.apply(k.reshape(-1, cfg.num_kv_heads, cfg.head_dim), positions)
        return q, k, v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)

    def block_out(self, block: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual update of a block: attn: [num_tokens, num_heads * head_dim] -> new h."""
        cfg, w = self.config, self.blocks[block]
        h = h + attn @ w.w_o
        gate, up = (rms_norm(h, w.mlp_norm, cfg.rms_eps) @ w.w_gate_up).chunk(2, dim=-1)
        return h + (F.silu(gate) * up) @ w.w_down

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [num_tokens, hidden] -> [num_tokens, vocab] (final norm, lm_head)."""
        return rms_norm(h, self.final_norm, self.config.rms_eps) @ self.lm_head

    @torch.inference_mode()
    def forward_dense(self, token_ids: list[int] | torch.Tensor, *, draft: bool = False
                      ) -> torch.Tensor:
        """Logits [n, vocab] of every position of one sequence, no cache: the reference."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64).to(self.device)
        positions = torch.arange(len(ids), device=self.device)
        h = self.embed(ids)
        for b in range(self.num_blocks(draft)):
            q, k, v = self.qkv(b, h, positions)
            h = self.block_out(b, h, dense_causal_attention(q, k, v))
        return self.logits(h)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over one sequence (written out, unlike the runner's SDPA).

    q: [n, num_heads, head_dim]; k, v: [n, num_kv_heads, head_dim] -> [n, num_heads * head_dim].
    """
    n, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [n, num_heads, head_dim]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)  # [heads, n, n]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    probs = scores.float() if q.dtype in (torch.float16, torch.bfloat16) else scores
    probs = probs.masked_fill(~causal, float("-inf")).softmax(-1).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(n, num_heads * head_dim)
