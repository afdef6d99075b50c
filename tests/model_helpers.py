"""The tiny model at float64 (where batching cannot flip a greedy token) and seeded prompts."""

from __future__ import annotations

import torch

from common.model import get_config

F64 = get_config("tiny", dtype="float64")


def prompt(n: int, seed: int = 1) -> list[int]:
    """``n`` token ids drawn from ``seed``: the same prompt in every test and process."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, F64.vocab_size, (n,), generator=gen).tolist()
