"""One rank's shard of a ``Model`` in a tensor-parallel group (Megatron-style).

What each rank holds and computes, for a group of ``size`` ranks (rank ``r``):

    piece             split                      collective
    embedding         replicated                 -
    attention         heads [r*H/size, ...)      -      (q, and KV heads [r*KV/size, ...))
      w_qkv           column-parallel            -
      w_o             row-parallel               all-reduce (1 per block)
    MLP w_gate_up     column-parallel            -
        w_down        row-parallel               all-reduce (1 per block)
    norms             replicated                 -
    lm_head           vocabulary shards          gather to rank 0 (logits live there only)

Why the embedding is replicated: a lookup costs no compute, and a vocabulary-sharded one
needs one more all-reduce of ``[tokens, hidden]`` per pass, latency that small decode
batches feel most; its memory (``vocab * hidden``, 0.25 GiB for a 32k x 4096 bf16 table) is
small next to the blocks. Why the head is sharded: it is a ``hidden x vocab`` matmul per
token, as large as a few blocks for big vocabularies, so each rank computes its share and
rank 0, the only rank that samples, gathers the logits. Ranks other than 0 therefore get
logits of shape ``[tokens, 0]``: they never sample (``TpGroup.broadcast_ids`` hands them rank
0's tokens).

Weights are loaded per rank (``common.model.tp_weights``): a rank reads only its slices of
a checkpoint. The rank's ``config`` is the shard's shape (``num_heads``, ``num_kv_heads`` and
``intermediate_size`` divided by the group size), so ``ModelRunner`` and a ``KvCache`` of
``config.kv_layout()`` (this rank's KV heads) work unchanged; ``full_config`` is the
model as a whole. The KV heads of rank ``r`` are exactly the transport's
``rank_heads(KV, size, r)``, so prefill and decode groups of different sizes exchange pages
head-range by head-range.

At float64 a group's output equals the single-device model's up to the order of the
all-reduce's sums (greedy tokens are identical; tests check both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.model.config import ModelConfig, get_config
from common.model.model import Model, rms_norm
from common.model.tp_weights import load_shard
from common.parallel import TpGroup, even_range, shard_range


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shape one rank of a ``size``-rank group holds.

    Raises:
        ValueError: heads, KV heads or the MLP width do not split evenly over ``size``
            (KV heads are never replicated: the transport maps whole heads).
    """
    if size == 1:
        return cfg
    for what, total in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads),
                        ("intermediate_size", cfg.intermediate_size)):
        even_range(total, size, 0, f"model {cfg.name!r}: {what}")
    return cfg.with_overrides(num_heads=cfg.num_heads // size,
                              num_kv_heads=cfg.num_kv_heads // size,
                              intermediate_size=cfg.intermediate_size // size)


class TpModel(Model):
    """This rank's shard of the model; runs only with every rank of ``group`` in step.

    Args:
        config: the whole model's config (``config.path``: the checkpoint to read from).
        group: the tensor-parallel group (a ``TpGroup.solo()`` gives the plain model).
        device: where this rank's weights live (default: the group's device).
    """

    def __init__(self, config: ModelConfig | None = None, group: TpGroup | None = None,
                 device: str | torch.device | None = None) -> None:
        self.group = group or TpGroup.solo()
        self.full_config = config or get_config("tiny")
        device = torch.device(device or self.group.device)
        rank, size = self.group.rank, self.group.size
        local = shard_config(self.full_config, size)
        weights = load_shard(self.full_config, local, rank, size, device)
        super().__init__(local, device, weights=weights)
        v0, v1 = shard_range(self.full_config.vocab_size, size, rank)
        # tied: the head is the (replicated) embedding; its rows are this rank's vocabulary
        self.head = self.embedding[v0:v1] if self.full_config.tie_word_embeddings else \
            self.lm_head  # [vocab shard, hidden]

    def block_out(self, block: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual update: each row-parallel projection is summed over the ranks once
        (a bias is added once, after the sum)."""
        cfg, w = self.config, self.blocks[block]
        o = self.group.all_reduce(F.linear(attn, w.w_o))
        h = h + (o if w.b_o is None else o + w.b_o)
        gate, up = F.linear(rms_norm(h, w.mlp_norm, cfg.rms_eps), w.w_gate_up).chunk(2, dim=-1)
        return h + self.group.all_reduce(F.linear(F.silu(gate) * up, w.w_down))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Rank 0: ``[tokens, vocab]``; other ranks: ``[tokens, 0]`` (see the module doc)."""
        local = F.linear(rms_norm(h, self.final_norm, self.config.rms_eps), self.head)
        full = self.group.gather_last_dim(local, self.full_config.vocab_size)
        return full if full is not None else local[:, :0]

    def greedy(self, logits: torch.Tensor) -> list[int]:
        """Rank 0 picks (it alone holds logits); every rank gets the same ids."""
        n = logits.shape[0]
        return self.group.broadcast_ids(logits.argmax(dim=-1).tolist()
                                        if self.group.is_leader else None, n)
