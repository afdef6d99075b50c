"""Choosing tokens from logits: greedy, or seeded temperature sampling.

Sampling is a pure function of (params.seed, rid, step), so a request produces the same
tokens wherever its steps run (prefill computes step 0, decode the rest).
"""

from __future__ import annotations

import zlib

import torch

from common.request import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], rids: list[str],
           steps: list[int]) -> list[int]:
    """One token per row of ``logits`` ([batch, vocab])."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, p in enumerate(params):
        if p.temperature == 0:
            out.append(int(greedy[i]))
            continue
        gen = torch.Generator().manual_seed(_seed(p.seed, rids[i], steps[i]))
        probs = torch.softmax(logits[i].double().cpu() / p.temperature, dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out


def _seed(seed: int, rid: str, step: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(rid.encode()) * 131 + step) % (1 << 63)
