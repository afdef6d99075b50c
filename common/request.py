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
again). Colocated uses QUEUED, PREFILLING, DECODING. A request is admitted (gets a row)
while still QUEUED; a prefix load from the host tier that timed out there frees the row
and leaves it QUEUED, to be admitted again without reuse.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from common.host import HashChain
    from common.kv import KvRecord


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


_NEXT: dict[ReqState, frozenset[ReqState]] = {
    ReqState.QUEUED: frozenset({ReqState.WAITING_KV, ReqState.PREFILLING}),
    ReqState.WAITING_KV: frozenset({ReqState.DECODING}),
    ReqState.PREFILLING: frozenset({ReqState.TRANSFERRING, ReqState.DECODING}),
    ReqState.TRANSFERRING: frozenset({ReqState.FINISHED}),
    ReqState.DECODING: frozenset({ReqState.RETRACTED, ReqState.FINISHED}),
    ReqState.RETRACTED: frozenset({ReqState.DECODING}),
}
"""The moves of a live request; besides these it may end (ABORTED, FAILED) at any stage."""


def check_transition(old: ReqState, new: ReqState) -> None:
    """Assert that a request may move from ``old`` to ``new`` (an internal invariant)."""
    ok = not old.is_finished and (new in _NEXT.get(old, ()) or new in (
        ReqState.ABORTED, ReqState.FAILED))
    assert ok, f"request state {old.name} -> {new.name} is not a transition"


class BadRequest(ValueError):
    """A request the service refuses; the message says what to change.

    ``code`` names the kind of refusal (the router's ``Error.code``; subclasses in
    ``deploy.router.errors`` carry others, and the HTTP edge maps each to a status);
    ``param`` names the request parameter at fault, when one is."""

    code = "bad_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. Greedy when ``temperature == 0``."""

    max_new_tokens: int = 16
    """Generated tokens at most (the first token, computed by prefill, included)."""
    stop_token: int = -1
    """Generation ends after this token is emitted (included); -1 for none."""
    temperature: float = 0.0
    """0 is greedy; > 0 samples from softmax(logits / temperature)."""
    seed: int | None = None
    """Seed of sampling when temperature > 0: given, the draws are a pure function of
    (seed, step), so equal requests with one seed sample alike; None, of (label, step),
    so each request of a workload draws its own, again on a rerun."""
    top_k: int = -1
    """When sampling: only the ``top_k`` most likely tokens (ties included); -1 or 0: all."""
    top_p: float = 1.0
    """When sampling: only the most likely tokens whose probabilities add up to ``top_p``
    (nucleus sampling; the most likely token always stays); 1: all."""
    stop_token_ids: tuple[int, ...] = ()
    """More ids that end generation (included), e.g. every ``eos_token_id`` of a
    checkpoint's generation_config.json."""
    min_p: float = 0.0
    """When sampling: only tokens at least ``min_p`` times as likely as the most likely
    one (after temperature); 0: all."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the request has generated (OpenAI's
    presence penalty; vLLM's range [-2, 2]); greedy requests too."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the request generated it
    (OpenAI's frequency penalty; [-2, 2])."""
    repetition_penalty: float = 1.0
    """Divides a positive logit, multiplies a negative one, of every token in the prompt
    or generated so far (> 1 discourages repeats; vLLM's and transformers' definition;
    1: off)."""

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        allowed = {"max_new_tokens", "stop_token", "stop_token_ids", "temperature", "seed",
                   "top_k", "top_p", *OPTIONAL_FIELDS}
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise BadRequest(f"unknown sampling parameters {unknown}; allowed: "
                             f"{sorted(allowed)}", param=unknown[0])
        ids = d.get("stop_token_ids", ())
        if not isinstance(ids, (list, tuple)):
            raise BadRequest(f"stop_token_ids={ids!r} must be a list of token ids",
                             param="stop_token_ids")
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

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Any of the presence, frequency or repetition penalties is on."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    def to_dict(self) -> dict:
        """Plain fields; ``stop_token_ids`` (a list), ``seed``, ``min_p`` and the penalties
        only when set."""
        d = {"max_new_tokens": self.max_new_tokens, "stop_token": self.stop_token,
             "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            d["seed"] = self.seed
        for name, off in OPTIONAL_FIELDS.items():
            if getattr(self, name) != off:
                d[name] = getattr(self, name)
        return d


OPTIONAL_FIELDS = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                   "repetition_penalty": 1.0}
"""The fields past top_p, with the value that turns each off (left out of ``to_dict``)."""


MAX_TEMPERATURE = 2.0
"""The OpenAI API's range (0 to 2); hotter is close to uniform noise. Refused above."""
GREEDY_BELOW = 1e-5
"""A temperature below this samples like greedy decoding (and divides logits by almost
zero), so it is served as greedy, as other serving systems do."""


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def validate(prompt: Sequence[int] | np.ndarray, params: SamplingParams, *, vocab_size: int,
             max_tokens: int, max_new_tokens_limit: int, max_position: int | None = None
             ) -> SamplingParams:
    """Raise ``BadRequest`` naming the problem and the allowed values; return the params
    as they will be served (a temperature below ``GREEDY_BELOW`` is greedy).

    Args:
        max_tokens: the longest row (prompt + generated tokens) any pool can hold.
        max_position: the model's context; prompt + max_new_tokens must fit in it.
    """
    if not len(prompt):
        raise BadRequest("empty prompt: send at least one token id", param="prompt")
    n = params.max_new_tokens
    if not _is_int(n) or not 1 <= n <= max_new_tokens_limit:
        raise BadRequest(f"max_new_tokens={n!r}; allowed: integers in "
                         f"[1, {max_new_tokens_limit}]", param="max_new_tokens")
    if max_position is not None and len(prompt) + n > max_position:
        raise BadRequest(f"prompt of {len(prompt)} tokens + max_new_tokens={n} exceeds the "
                         f"model's context of {max_position} positions", param="max_new_tokens")
    if len(prompt) + n > max_tokens:
        raise BadRequest(f"prompt of {len(prompt)} tokens + max_new_tokens={n} exceeds the "
                         f"largest pool row ({max_tokens} tokens)", param="max_new_tokens")
    ids = np.asarray(prompt)
    if ids.dtype.kind not in "iu" or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise BadRequest(f"prompt token ids must be integers in [0, {vocab_size})",
                         param="prompt")
    t = params.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or \
            not 0 <= t <= MAX_TEMPERATURE:
        raise BadRequest(f"temperature={t!r}; allowed: 0 (greedy) or a number in "
                         f"(0, {MAX_TEMPERATURE:g}]", param="temperature")
    if not _is_int(params.stop_token) or not -1 <= params.stop_token < vocab_size:
        raise BadRequest(f"stop_token={params.stop_token!r}; allowed: -1 (none) or "
                         f"[0, {vocab_size})", param="stop_token")
    if any(not _is_int(t) or not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise BadRequest(f"stop_token_ids must be integers in [0, {vocab_size})",
                         param="stop_token_ids")
    if params.seed is not None and not (_is_int(params.seed) and 0 <= params.seed < 1 << 63):
        raise BadRequest(f"seed={params.seed!r}; allowed: none, or integers in [0, 2**63)",
                         param="seed")
    if not _is_int(params.top_k) or params.top_k < -1:
        raise BadRequest(f"top_k={params.top_k!r}; allowed: -1 or 0 (all tokens) or >= 1",
                         param="top_k")
    p = params.top_p
    if not _is_number(p) or not 0 < p <= 1:
        raise BadRequest(f"top_p={p!r}; allowed: a number in (0, 1] (1 = all tokens)",
                         param="top_p")
    _check_penalties(params)
    return dataclasses.replace(params, temperature=0.0) if t < GREEDY_BELOW else params


def _is_number(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _check_penalties(params: SamplingParams) -> None:
    """min_p and the penalties, in vLLM's ranges."""
    if not _is_number(params.min_p) or not 0 <= params.min_p <= 1:
        raise BadRequest(f"min_p={params.min_p!r}; allowed: a number in [0, 1] (0 = off)",
                         param="min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(params, name)
        if not _is_number(v) or not -2 <= v <= 2:
            raise BadRequest(f"{name}={v!r}; allowed: a number in [-2, 2] (0 = off)",
                             param=name)
    r = params.repetition_penalty
    if not _is_number(r) or not r > 0:
        raise BadRequest(f"repetition_penalty={r!r}; allowed: a number > 0 (1 = off)",
                         param="repetition_penalty")


@dataclass(eq=False)
class Request:
    """One request on one worker: what it asked for, where it is, and its counters.

    The same record serves prefill, decode and colocated; each side fills what it uses.
    ``state`` is written by one method per side (the side's scheduler), which checks the
    move with ``check_transition``. Row positions (P = ``prompt_len``, G = generated)::

        [0, num_computed)        prompt KV computed here, loaded from a host tier or
                                 received from a prefill (P once the prompt is done)
        [P, P + G - 1)           KV of generated tokens 0 .. G-2 (decode)
        P + G - 1                the newest token: no KV yet (``next_position``)
    """

    rid: str
    """Unique per submission (the router's id); owner of the row in the free log."""
    prompt: list[int]
    params: SamplingParams
    state: ReqState = ReqState.QUEUED
    kv: KvRecord | None = None
    """The device row while it holds one (None queued, retracted or ended)."""
    label: str = ""
    """The client's name for it (seeds sampling, so a rerun samples alike); rid if empty."""
    output: list[int] = field(default_factory=list)
    """Generated tokens, the first (computed by prefill) included."""
    num_computed: int = 0
    """Prompt positions [0, num_computed) hold KV."""
    num_cached: int = 0
    """Prompt tokens loaded from this worker's host tier (prefix reuse), neither computed
    nor received; reported to the client as usage's ``cached_tokens``."""
    t_arrival: float = field(default_factory=time.monotonic)
    stopped: bool = False
    """The router ended the output (a stop string it cut): done, as ``stop``."""

    # -- where the prompt comes from (decode) and goes to (prefill) ---------------------
    prefill: str = ""
    """Decode: the prefill worker computing the prompt; empty when colocated."""
    prefill_addr: str = ""
    cap: str = ""
    """Decode: the request's KV capability from the router (``Req.cap``); the announce
    carries it, and the prefill sends KV only to the peer that proved it."""
    num_prior: int = 0
    """A migrated request: its prompt ends with this many output tokens an earlier worker
    generated (``Req.prior``); its sampling steps count on from there."""
    eager: bool = False
    """Prefill: compute before the decode announced (the router saw room there)."""
    announced: bool = False
    """Prefill: the decode announced its rows over the KV transport."""
    reuse: bool = True
    """May load a cached prefix from the host tier (off after a load timed out)."""
    num_sent_pages: int = 0
    """Prefill: pages the transfer carried (the prompt's, less those the decode had)."""
    t_first_send: float = 0.0
    t_prefilled: float = 0.0
    """Prefill: when the last prompt chunk was computed."""

    # -- decoding ------------------------------------------------------------------------
    age: int = -1
    """Order in which it joined the batch (kept across retraction); -1 before."""
    num_draft_valid: int = 0
    """Speculation: draft-model KV is valid at row positions [0, num_draft_valid)."""
    draft_lag: int = 0
    """Speculation: committed positions at the row's end whose draft KV the draft has not
    written yet (1 after a step that accepted every proposal); the host connector stores
    their page once the draft caught up, never with a stale draft entry."""
    chain: HashChain | None = None
    """Host connector: hash chain over its committed tokens (None: not offloading)."""
    num_offered_pages: int = 0
    """Host connector: full committed pages already handed to the offloader."""
    host_ref: bytes | None = None
    """Retracted: the last key of its stored chain, referenced until it resumes."""

    def __post_init__(self) -> None:
        self.label = self.label or self.rid

    def __repr__(self) -> str:
        return (f"Request({self.rid!r}, {self.state.name}, prompt_len={self.prompt_len}, "
                f"output={len(self.output)}, num_computed={self.num_computed}, kv={self.kv})")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def max_len(self) -> int:
        """Row positions the request may need: prompt + generated tokens but the last."""
        return len(self.prompt) + self.params.max_new_tokens - 1

    @property
    def next_position(self) -> int:
        """Row position of the newest token (the next decode step's input)."""
        return len(self.prompt) + len(self.output) - 1

    @property
    def sample_step(self) -> int:
        """The step of the next token to sample (seeded draws are a function of seed and
        step): outputs so far, those of earlier workers included."""
        return self.num_prior + len(self.output)

    @property
    def committed_tokens(self) -> list[int]:
        """Tokens whose KV a decoding row holds: the prompt and all outputs but the newest."""
        return self.prompt + self.output[:-1]

    @property
    def prompt_remaining(self) -> int:
        """Prompt tokens still to compute (prefill)."""
        return len(self.prompt) - self.num_computed

    @property
    def is_done(self) -> bool:
        """Generated ``max_new_tokens``, emitted a stop token, or stopped by the router."""
        return self.stopped or len(self.output) >= self.params.max_new_tokens or (
            bool(self.output) and self.params.is_stop(self.output[-1]))

    @property
    def finish_reason(self) -> str:
        """``stop`` when the last token is a stop token or the router stopped it (a stop
        string), else ``length``."""
        return "stop" if self.stopped or (
            self.output and self.params.is_stop(self.output[-1])) else "length"
