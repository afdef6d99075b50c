"""Seeded synthetic workloads: prompt and output lengths, token ids, Poisson arrivals.

Everything, rids included, is a pure function of the seed and the spec: two runs with the
same seed send the same requests, so their outputs compare token by token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    turns: int = 1
    """Turns per conversation (multi-turn chat): turn t's prompt is turn t-1's prompt, a
    seeded stand-in for the reply (max_new_tokens tokens) and a new user message; so it
    begins with the previous prompt (prefix reuse). ``requests`` counts every turn."""
    shared_prefix: int = 0
    """Tokens of a system prompt that every conversation's first prompt begins with."""
    turn_gap_s: float = 1.0
    """Seconds between a conversation's turns (the user's think time)."""

    def __post_init__(self) -> None:
        lo, hi = self.prompt_len
        if self.requests < 0 or self.rate < 0 or not 1 <= lo <= hi:
            raise ValueError(f"bad workload: requests={self.requests} (>= 0), rate="
                             f"{self.rate} (>= 0), prompt_len={self.prompt_len} (1 <= min "
                             "<= max)")
        if not 1 <= self.output_len[0] <= self.output_len[1]:
            raise ValueError(f"output_len={self.output_len}: need 1 <= min <= max")
        if self.turns < 1 or self.shared_prefix < 0 or self.turn_gap_s < 0:
            raise ValueError(f"bad workload: turns={self.turns} (>= 1), shared_prefix="
                             f"{self.shared_prefix} (>= 0), turn_gap_s={self.turn_gap_s} "
                             "(>= 0)")

    @property
    def is_chat(self) -> bool:
        """Multi-turn or shared-prefix workload (rids c<conversation>-t<turn>)."""
        return self.turns > 1 or self.shared_prefix > 0


@dataclass(frozen=True)
class WorkRequest:
    rid: str
    prompt: list[int]
    max_new_tokens: int
    arrival_s: float
    """Seconds after the start of the run at which the request is sent."""
    text: str = ""
    """A text prompt instead of ``prompt`` ids (encoded by the router)."""
    messages: list[dict[str, str]] = field(default_factory=list)
    """Chat messages instead (the model's chat template)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (text requests)."""


def make_workload(spec: WorkloadSpec, vocab_size: int) -> list[WorkRequest]:
    """The requests of ``spec``, in arrival order."""
    if spec.is_chat:
        return _chat_workload(spec, vocab_size)
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


def _chat_workload(spec: WorkloadSpec, vocab_size: int) -> list[WorkRequest]:
    """Conversations of ``spec.turns`` turns each, sorted by arrival (ties: rid)."""
    rng = np.random.default_rng(spec.seed)
    system = rng.integers(0, vocab_size, spec.shared_prefix).tolist()
    num_conv = -(-spec.requests // spec.turns)
    gaps = rng.exponential(1.0 / spec.rate, num_conv) if spec.rate > 0 else \
        np.zeros(num_conv)
    starts = np.cumsum(gaps) - (gaps[0] if num_conv else 0.0)
    lo, hi = spec.prompt_len
    out: list[WorkRequest] = []
    for c in range(num_conv):
        prompt = list(system)
        for t in range(min(spec.turns, spec.requests - c * spec.turns)):
            user = int(np.clip(np.exp(rng.uniform(np.log(lo), np.log(hi + 1))), lo, hi))
            n_out = int(rng.integers(spec.output_len[0], spec.output_len[1] + 1))
            prompt = prompt + rng.integers(0, vocab_size, user).tolist()
            out.append(WorkRequest(f"s{spec.seed}-c{c:04d}-t{t}", prompt, n_out,
                                   float(starts[c] + t * spec.turn_gap_s)))
            prompt = prompt + rng.integers(0, vocab_size, n_out).tolist()  # "the reply"
    return sorted(out, key=lambda r: (r.arrival_s, r.rid))
