"""A request as the workers see it: lifecycle states, sampling parameters, validation.

Lifecycle (ordered; a request moves forward but for the steps back named below)::

    QUEUED -> WAITING_KV -> PREFILLING -> TRANSFERRING -> DECODING -> FINISHED
                                                          |  ^      \\-> ABORTED / FAILED
                                                          v  |
                                                        RETRACTED

Prefill uses QUEUED (no decode announced yet), PREFILLING and TRANSFERRING (last chunk
computed, waiting for the decode's acknowledgement). Decode uses QUEUED (no pool room),
WAITING_KV (announced, pages arriving), DECODING and, with overcommit, RETRACTED (its
committed KV is in the host tier and it holds no device row; resuming makes it DECODING
again). Colocated uses QUEUED, PREFILLING, DECODING. The other step back: a prefix load
from the host tier that timed out returns the request to QUEUED with its row freed (it
is admitted again without reuse).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum


class ReqState(IntEnum):
    """Where a request is in its life on one worker."""

    QUEUED = 1
    WAITING_KV = 2
    PREFILLING = 3
    TRANSFERRING = 4
    DECODING = 5
    RETRACTED = 6
    FINISHED = 7
    ABORTED = 8
    FAILED = 9

    @property
    def is_finished(self) -> bool:
        """Finished, aborted or failed: the request holds no pages any more."""
        return self >= ReqState.FINISHED

    @property
    def holds_kv(self) -> bool:
        """The worker holds a device row with pages for it (not while RETRACTED)."""
        return ReqState.WAITING_KV <= self <= ReqState.DECODING

    @property
    def is_retracted(self) -> bool:
        """Waiting in the host tier to resume; holds a host-tier reference, no row."""
        return self == ReqState.RETRACTED


class BadRequest(ValueError):
    """A request the service refuses; the message says what to change."""


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. Greedy when ``temperature == 0``."""

    max_new_tokens: int = 16
    """Generated tokens at most (the first token, computed by prefill, included)."""
    stop_token: int = -1
    """Generation ends after this token is emitted (included); -1 for none."""
    temperature: float = 0.0
    """0 is greedy; > 0 samples from softmax(logits / temperature)."""
    seed: int = 0
    """Seed of sampling when temperature > 0 (a pure function of seed, rid and step)."""
    top_k: int = -1
    """When sampling: only the ``top_k`` most likely tokens (ties included); -1 or 0: all."""
    top_p: float = 1.0
    """When sampling: only the most likely tokens whose probabilities add up to ``top_p``
    (nucleus sampling; the most likely token always stays); 1: all."""
    stop_token_ids: tuple[int, ...] = ()
    """More ids that end generation (included), e.g. every ``eos_token_id`` of a
    checkpoint's generation_config.json."""

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        allowed = {"max_new_tokens", "stop_token", "stop_token_ids", "temperature", "seed",
                   "top_k", "top_p"}
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise BadRequest(f"unknown sampling parameters {unknown}; allowed: "
                             f"{sorted(allowed)}")
        ids = d.get("stop_token_ids", ())
        if not isinstance(ids, (list, tuple)):
            raise BadRequest(f"stop_token_ids={ids!r} must be a list of token ids")
        try:
            return cls(**{**d, "stop_token_ids": tuple(ids)})
        except TypeError as exc:
            raise BadRequest(f"bad sampling parameters: {exc}") from None

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every id that ends generation (``stop_token`` and ``stop_token_ids``)."""
        return frozenset(self.stop_token_ids) | (
            {self.stop_token} if self.stop_token >= 0 else set())

    def is_stop(self, token: int) -> bool:
        return token == self.stop_token or token in self.stop_token_ids

    def to_dict(self) -> dict:
        """Plain fields; ``stop_token_ids`` only when set (a list)."""
        d = {"max_new_tokens": self.max_new_tokens, "stop_token": self.stop_token,
             "temperature": self.temperature, "seed": self.seed, "top_k": self.top_k,
             "top_p": self.top_p}
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        return d


def validate(prompt: list[int], params: SamplingParams, *, vocab_size: int,
             max_tokens: int, max_new_tokens_limit: int) -> None:
    """Raise ``BadRequest`` naming the problem; ``max_tokens`` is the longest row
    (prompt + generated tokens) any pool can hold."""
    if not prompt:
        raise BadRequest("empty prompt: send at least one token id")
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in prompt):
        raise BadRequest(f"prompt token ids must be integers in [0, {vocab_size})")
    n = params.max_new_tokens
    if not isinstance(n, int) or not 1 <= n <= max_new_tokens_limit:
        raise BadRequest(f"max_new_tokens={n!r}; allowed: integers in "
                         f"[1, {max_new_tokens_limit}]")
    t = params.temperature
    if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise BadRequest(f"temperature={t!r}; allowed: a finite number >= 0 (0 = greedy)")
    if not isinstance(params.stop_token, int) or not -1 <= params.stop_token < vocab_size:
        raise BadRequest(f"stop_token={params.stop_token!r}; allowed: -1 (none) or "
                         f"[0, {vocab_size})")
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise BadRequest(f"stop_token_ids must be integers in [0, {vocab_size})")
    if not isinstance(params.seed, int):
        raise BadRequest(f"seed={params.seed!r} must be an integer")
    if not isinstance(params.top_k, int) or params.top_k < -1:
        raise BadRequest(f"top_k={params.top_k!r}; allowed: -1 or 0 (all tokens) or >= 1")
    p = params.top_p
    if not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 1:
        raise BadRequest(f"top_p={p!r}; allowed: a number in (0, 1] (1 = all tokens)")
    if len(prompt) + n > max_tokens:
        raise BadRequest(f"prompt of {len(prompt)} tokens + max_new_tokens={n} exceeds the "
                         f"largest pool row ({max_tokens} tokens)")
