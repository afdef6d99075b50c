"""Seeded synthetic workloads: prompt and output lengths, token ids, Poisson arrivals.

Everything, rids included, is a pure function of the seed and the spec: two runs with the
same seed send the same requests, so their outputs compare token by token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WorkloadSpec:
    """Shape of a workload."""

    requests: int = 64
    """Number of requests."""
    seed: int = 0
    """Seed of every random choice."""
    rate: float = 8.0
    """Mean arrivals per second (Poisson); 0 sends everything at once."""
    prompt_len: tuple[int, int] = (16, 256)
    """Prompt length range, inclusive, drawn log-uniform."""
    output_len: tuple[int, int] = (8, 48)
    """max_new_tokens range, inclusive, drawn uniform."""

    def __post_init__(self) -> None:
        lo, hi = self.prompt_len
        if self.requests < 0 or self.rate < 0 or not 1 <= lo <= hi:
            raise ValueError(f"bad workload: requests={self.requests} (>= 0), rate="
                             f"{self.rate} (>= 0), prompt_len={self.prompt_len} (1 <= min "
                             "<= max)")
        if not 1 <= self.output_len[0] <= self.output_len[1]:
            raise ValueError(f"output_len={self.output_len}: need 1 <= min <= max")


@dataclass(frozen=True)
class WorkRequest:
    rid: str
    prompt: list[int]
    max_new_tokens: int
    arrival_s: float
    """Seconds after the start of the run at which the request is sent."""


def make_workload(spec: WorkloadSpec, vocab_size: int) -> list[WorkRequest]:
    """The requests of ``spec``, in arrival order."""
    rng = np.random.default_rng(spec.seed)
    lo, hi = spec.prompt_len
    lens = np.exp(rng.uniform(np.log(lo), np.log(hi + 1), spec.requests)).astype(int)
    lens = np.clip(lens, lo, hi)
    outs = rng.integers(spec.output_len[0], spec.output_len[1] + 1, spec.requests)
    gaps = rng.exponential(1.0 / spec.rate, spec.requests) if spec.rate > 0 else \
        np.zeros(spec.requests)
    arrivals = np.cumsum(gaps) - (gaps[0] if spec.requests else 0.0)
    return [WorkRequest(rid=f"s{spec.seed}-r{i:05d}",
                        prompt=rng.integers(0, vocab_size, int(n)).tolist(),
                        max_new_tokens=int(o), arrival_s=float(t))
            for i, (n, o, t) in enumerate(zip(lens, outs, arrivals))]
