"""Choosing tokens from logits: greedy, or seeded temperature sampling with top-k and
top-p (nucleus) truncation.

Sampling is a pure function of (params.seed, step), or of (the request's label, step)
when it has no seed, so a request produces the same tokens wherever its steps run
(prefill computes step 0, decode the rest) and again when it is sent again.
"""

from __future__ import annotations

import zlib

import torch

from common.request import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], labels: list[str],
           steps: list[int]) -> list[int]:
    """One token per row of ``logits`` ([batch, vocab]); ``labels`` seed the draws of
    requests without a seed of their own."""
    greedy = logits.argmax(dim=-1).tolist()
    drawn = [i for i, p in enumerate(params) if p.temperature != 0]
    # the rows to draw from reach the host in one copy (one device sync per batch)
    rows = dict(zip(drawn, logits[drawn].double().cpu())) if drawn else {}
    out = []
    for i, p in enumerate(params):
        if p.temperature == 0:
            out.append(int(greedy[i]))
            continue
        gen = torch.Generator().manual_seed(_seed(p.seed, labels[i], steps[i]))
        probs = torch.softmax(rows[i] / p.temperature, dim=-1)
        probs = truncate(probs, p.top_k, p.top_p)
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out


def truncate(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``probs`` ([vocab]) with every token outside the top ``top_k`` (ties kept), then
    outside the nucleus ``top_p`` of what is left, set to 0 (not renormalised:
    ``torch.multinomial`` takes weights). The most likely token always stays."""
    if 0 < top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        ranked, order = probs.sort(descending=True)
        before = ranked.cumsum(0) - ranked  # mass of the more likely tokens
        ranked = torch.where(before < top_p * ranked.sum(), ranked, torch.zeros_like(ranked))
        probs = torch.zeros_like(probs).scatter_(0, order, ranked)
    return probs


def _seed(seed: int | None, label: str, step: int) -> int:
    base = zlib.crc32(label.encode()) * 131 if seed is None else seed * 1_000_003
    return (base + step) % (1 << 63)
