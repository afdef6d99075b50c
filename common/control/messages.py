"""Control messages between clients, the router and workers (the KV plane is ``transport``).

The router binds one ROUTER socket; every worker and client connects one DEALER
(``common.control.link``). Each message is a frozen dataclass carried by the one msgpack
codec (``common.control.codec``): on the wire one map ``{"t": <class name>, <field>: ...}``,
nothing pickled. Prompts travel as little-endian int32 bytes (``pack_ids``); the few ids
of a ``Tokens`` message as a list. Receivers dispatch on the message's type; a frame that
does not decode becomes a local ``Malformed`` (never sent) that the receiver answers with
``Error`` and counts, so no peer can crash it.

| message | from -> to | when |
| --- | --- | --- |
| ``Register`` | worker -> router | first message; answer: ``Registered``/``Error`` |
| ``Registered`` | router -> worker | the deployment's config; the worker builds from it |
| ``Ready`` | worker -> router | built: the router may route to it now |
| ``Load`` | worker -> router | every ``heartbeat_s``; doubles as the worker's heartbeat |
| ``Stats`` | worker -> router | at shutdown: the worker's final counters |
| ``MetricsReport`` | worker -> router | every ``heartbeat_s`` and as it closes: its metrics |
| ``Submit`` | client -> router | a new request |
| ``Req`` | router -> worker | a request for this worker (decode, prefill or colocated) |
| ``StepTokens`` | worker -> router | every request's new tokens of one step |
| ``Tokens`` | (worker ->) router -> client | tokens as they come (the router's first: admitted) |
| ``Done`` | worker -> router -> client | a request ended (router adds prefill figures) |
| ``Prefilled`` | prefill -> router | the prefill's part ended (sent, aborted, failed) |
| ``Abort`` | client -> router -> workers | stop a request; any stage |
| ``Stop`` | router -> decode/colocated | a stop string ended the output: finish it (``stop``) |
| ``Drain`` | operator or worker -> router | stop routing to a worker; it ends its work, exits |
| ``Error`` | any -> any | a refused request or message; ``code`` says which kind |
| ``Status`` / ``StatusReport`` | client -> router -> client | workers, requests in flight, config |
| ``MetricsQuery`` / ``MetricsSnapshot`` | client -> router -> client | the deployment's metrics |
| ``Ping`` / ``Pong`` | router -> worker, client -> router -> client | liveness |
| ``Shutdown`` | client -> router -> workers | stop everything cleanly |
| ``Bye`` | router -> client | every worker's final ``Stats``, after a ``Shutdown`` |
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

from common.control.codec import Codec, pack_ids, unpack_ids

Scalar = int | float | str | bool
"""A value of a free-form map (config, params, stats)."""
Param = int | float | str | bool | list[int]
"""A sampling parameter's value (``stop_token_ids`` is a list)."""
MAX_CONTROL_BYTES = 16 << 20
"""Largest control frame accepted (a prompt of four million tokens)."""


# -- worker -> router ---------------------------------------------------------------------
@dataclass(frozen=True)
class Register:
    """A worker introduces itself; names are unique within a deployment."""

    role: str
    """prefill, decode or colocated."""
    name: str
    pid: int
    deployment: str = ""
    """The deployment id of the worker's key directory; the router refuses any other
    ('' without keys)."""


@dataclass(frozen=True)
class Ready:
    """The worker built its model and pool; it takes requests from now on."""

    name: str
    kv_addr: str
    """Where decodes connect for KV (prefill; a tensor-parallel group's ranks,
    comma-separated in rank order); empty otherwise."""
    pool_tokens: int
    """Tokens of its free pool at start (the router's capacity for it)."""
    events_addr: str = ""
    """Where its KV events are published (vLLM's ZMQ PUB contract, docs/kv_events.md);
    empty: it publishes none."""
    events_replay_addr: str = ""
    """Its KV events replay socket (with ``events_addr``)."""


@dataclass(frozen=True)
class Load:
    """Periodic load report; any message renews the worker's lease, this one keeps it
    renewed while the worker is idle."""

    name: str
    running: int
    queued: int
    free_tokens: int
    queued_tokens: int = 0
    """Prompt tokens waiting for a row (prefill)."""
    paused: str = ""
    """Why the worker admits no new requests (a free log cannot write); empty: it does."""


@dataclass(frozen=True)
class Stats:
    """The worker's final counters (sent as it closes)."""

    name: str
    stats: dict[str, Scalar]


@dataclass(frozen=True)
class MetricsReport:
    """The worker's metric families (``common.metrics.pack``), every ``heartbeat_s`` and
    once more as it closes (``final``); the router exposes them labelled by worker."""

    name: str
    families: bytes
    final: bool = False


@dataclass(frozen=True)
class Prefilled:
    """The prefill's part of ``rid`` ended: ``sent`` (the decode acknowledged every
    page), ``aborted`` or a failure reason with ``error``."""

    rid: str
    reason: str
    error: str = ""
    xfer_s: float = 0.0
    """Last chunk computed -> the decode's acknowledgement (seconds)."""
    kv_bytes: int = 0
    """Bytes of the pages the transfer carried."""
    t_finish_wall: float = 0.0
    """Wall clock when the last chunk was computed (0 unless sent)."""
    cached_tokens: int = 0
    """Prompt tokens the prefill loaded from its host tier instead of computing them."""


# -- worker -> router -> client -----------------------------------------------------------
@dataclass(frozen=True)
class StepTokens:
    """Worker -> router: every request's new tokens from one step, in one message however
    many requests the step ran (a message per request per step cost the worker a
    send and the router a receive each). The router relays each request's share to its
    client as ``Tokens`` (``items``)."""

    rids: list[str]
    counts: bytes
    """Tokens of each rid, little-endian int32 (``pack_ids``), each >= 1."""
    ids: bytes
    """The rids' tokens end to end, little-endian int32."""
    first: int = 0
    """The first ``first`` rids' tokens begin with their first token (sampled by a
    prefill pass of the same step)."""

    def __post_init__(self) -> None:
        counts = unpack_ids(self.counts, "counts")
        if len(counts) != len(self.rids) or not 0 <= self.first <= len(self.rids):
            raise ValueError(f"{len(counts)} counts and first={self.first} for "
                             f"{len(self.rids)} rids")
        if len(counts) and (int(counts.min()) < 1 or int(counts.sum()) != len(self.ids) // 4
                            or len(self.ids) % 4):
            raise ValueError(f"counts add up to {int(counts.sum())}, ids hold "
                             f"{len(self.ids) / 4:g}; every count must be >= 1")

    @classmethod
    def of(cls, items: list[tuple[str, list[int], bool]]) -> StepTokens:
        """From ``(rid, ids, first)`` items, those with a first token leading."""
        items = sorted(items, key=lambda it: not it[2])  # stable: firsts first
        return cls([rid for rid, _, _ in items], pack_ids([len(ids) for _, ids, _ in items]),
                   pack_ids([t for _, ids, _ in items for t in ids]),
                   sum(1 for *_, first in items if first))

    def items(self) -> list[Tokens]:
        """One ``Tokens`` per rid, in order."""
        ids = unpack_ids(self.ids).tolist()
        out, at = [], 0
        for i, (rid, n) in enumerate(zip(self.rids, unpack_ids(self.counts).tolist())):
            out.append(Tokens(rid, ids[at:at + n], first=i < self.first))
            at += n
        return out


@dataclass(frozen=True)
class Tokens:
    """New output tokens of ``rid``, in order."""

    rid: str
    ids: list[int]
    first: bool = False
    """The first token (computed by prefill). A prefill sends it to the router as soon as
    it is computed and the decode again once it holds the KV; the router relays the one
    that comes first and drops the other."""
    text: str = ""
    """Router -> client, for a model with a tokenizer: the text these ids complete (may be
    empty while a character or a possible stop string is incomplete; never the text of a
    stop id)."""
    t_kv_wall: float = 0.0
    """Decode -> router only: wall clock when the decode held all KV and the first
    token (the router measures the exposed transfer with it)."""
    prompt_tokens: int = 0
    """Router -> client: the router's first ``Tokens`` of a request has no ids and says
    that its door let the request in; it carries the prompt's length as served (a text as
    encoded), for usage figures while the output streams."""


@dataclass(frozen=True)
class Done:
    """``rid`` ended: ``stop`` or ``length`` (finished), ``aborted``, or a failure
    (``error``, ``timeout``, ``peer_lost``) with ``error`` saying why."""

    rid: str
    reason: str
    n: int = 0
    """Tokens generated."""
    error: str = ""
    xfer_s: float = 0.0
    """Router -> client: last prefill chunk computed -> decode holds all KV."""
    kv_bytes: int = 0
    """Router -> client: bytes of KV the transfer carried."""
    text: str = ""
    """Router -> client, for a model with a tokenizer: the whole output text (the streamed
    pieces joined), cut before a stop string."""
    prompt_ids: bytes = b""
    """Router -> client, when the request asked (``return_token_ids``): the prompt's token
    ids as served (a text prompt as encoded), int32 (``unpack_ids``)."""
    prompt_tokens: int = 0
    """Router -> client: tokens of the prompt (a text prompt as encoded)."""
    cached_tokens: int = 0
    """Prompt tokens loaded from a host tier instead of computed or received (router ->
    client: the larger of the prefill's and the decode's count)."""
    migrations: int = 0
    """Router -> client: how often the request moved to another worker on its way (a
    worker died or drained); its tokens are those of a run without the move."""

    @property
    def ok(self) -> bool:
        return self.reason in ("stop", "length")


# -- router -> worker ---------------------------------------------------------------------
@dataclass(frozen=True)
class Registered:
    """Answer to ``Register``: the deployment's ``ServeConfig.to_dict()``, its id and
    the KV plane's credentials (``PlaneAuth.to_dict``; the control plane is
    encrypted whenever they are secret)."""

    config: dict[str, Scalar]
    deployment: str = ""
    kv_auth: dict[str, Scalar] = field(default_factory=dict)


@dataclass(frozen=True)
class Req:
    """A request for this worker. The router sends the same ``Req`` to the decode and
    the prefill it chose (``prefill`` empty: a colocated worker serves it alone)."""

    rid: str
    prompt: bytes
    """int32 token ids (``unpack_ids``)."""
    params: dict[str, Param]
    """``SamplingParams.to_dict()``, validated by the router."""
    prefill: str
    prefill_addr: str
    """The prefill's KV address (the decode connects there; its ranks' addresses,
    comma-separated, for a tensor-parallel prefill)."""
    decode: str
    eager: bool = False
    """The decode surely admits at once: the prefill may compute before the announce."""
    label: str = ""
    """The client's rid (``rid`` is the router's own, unique per submission); sampling
    is seeded by it, so a rerun of a seeded request samples the same tokens."""
    cap: str = ""
    """The request's KV capability: a random secret only these two workers get; the
    decode announces with it and the prefill sends KV only to the peer that did."""
    prior: int = 0
    """A migrated request (docs/operations.md, "Migration"): the last ``prior`` ids of
    ``prompt`` are output tokens an earlier worker generated and the client has;
    ``params.max_new_tokens`` counts only what is still to come, and sampling goes on at
    step ``prior`` (the draws are a function of seed and step)."""

    def __post_init__(self) -> None:
        if self.prior < 0:
            raise ValueError(f"prior={self.prior} must be >= 0")


# -- client -> router ---------------------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    """A new request. ``params`` are sampling parameters by name (``SamplingParams``);
    the router validates everything and answers ``Error`` for a bad request."""

    rid: str
    prompt: bytes
    params: dict[str, Param] = field(default_factory=dict)
    text: str = ""
    """A text prompt instead of ``prompt`` ids (encoded by the router; bos as the
    tokenizer adds it)."""
    messages: list[dict[str, str]] = field(default_factory=list)
    """Chat messages (role, content) instead: rendered with the model's chat template."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: the output ends before the first (text requests)."""


@dataclass(frozen=True)
class Status:
    """Ask the router for a ``StatusReport``."""

    nonce: int = 0
    """Echoed in the answer, so a late answer to an earlier ask is told apart."""


@dataclass(frozen=True)
class StatusReport:
    """The router's view: each worker's role/ready/lost/pid, requests in flight, the
    config, and the router's counters of refused messages by code."""

    workers: dict[str, dict[str, Scalar]]
    in_flight: int
    config: dict[str, Scalar]
    errors: dict[str, int] = field(default_factory=dict)
    metrics_url: str = ""
    """Where the router serves ``/metrics`` over HTTP (empty: it does not)."""
    nonce: int = 0
    """The ``Status`` it answers."""


@dataclass(frozen=True)
class MetricsQuery:
    """Ask the router for a ``MetricsSnapshot``."""


@dataclass(frozen=True)
class MetricsSnapshot:
    """The deployment's metrics as the router exposes them (``common.metrics.pack``):
    the router's own families and every worker's last report, labelled by worker."""

    families: bytes


@dataclass(frozen=True)
class Bye:
    """Answer to ``Shutdown`` once every live worker sent its final ``Stats`` (or the
    lease passed): stats by worker name, each with its ``role``."""

    stats: dict[str, dict[str, Scalar]]
    metrics: bytes = b""
    """The deployment's final metrics (``MetricsSnapshot.families``), after every worker's
    final report."""


# -- several directions -------------------------------------------------------------------
@dataclass(frozen=True)
class Abort:
    """Stop ``rid`` at any stage; every side frees what it holds (``aborted``)."""

    rid: str
    reason: str = ""
    """Router -> worker only: ``migrated`` when the router moved the request to another
    worker (the row is freed ``migrated``); empty: an abort (``aborted``). The router
    never forwards a client's."""

    def __post_init__(self) -> None:
        if self.reason not in ("", "migrated"):
            raise ValueError(f"Abort.reason={self.reason!r}; allowed: '' or 'migrated'")


@dataclass(frozen=True)
class Drain:
    """Stop routing new requests to worker ``name``; it finishes what it holds (what is
    left after ``drain_timeout_s`` moves to other workers), then the router tells it to
    shut down. An operator asks for any worker (answered with a ``StatusReport``
    carrying ``nonce``); a worker asks for itself (SIGTERM)."""

    name: str
    nonce: int = 0


@dataclass(frozen=True)
class Stop:
    """Router -> the decode (or colocated) worker of ``rid``: a stop string ended its
    output at the router; finish it as ``stop`` (its row freed ``finished``) now, or as
    soon as it decodes when its prompt's KV is still on the way. The prefill is not told:
    it ends its part as always (``sent``)."""

    rid: str


@dataclass(frozen=True)
class Error:
    """A refused request (``rid`` set) or message. ``code``: ``bad_request`` (fix the
    request and retry), ``unknown_rid``, ``refused`` (registration), ``forbidden`` (the
    sender's identity may not send this, or not for this request), ``not_registered``
    (a worker message from a peer that did not register), ``unexpected`` (a message this
    receiver does not take), a refused submission's code (``context_length_exceeded``,
    ``model_not_found``, ``overloaded``, ``unavailable``... ``deploy.router.errors``),
    or a codec code (``malformed``, ``unknown_type``,
    ``missing_field``, ``bad_field``, ``oversized``, ``extra_frames``)."""

    rid: str
    error: str
    code: str = "bad_request"
    param: str = ""
    """A refused request: the parameter at fault (``max_new_tokens``, ``prompt``...)."""


@dataclass(frozen=True)
class Ping:
    """Liveness probe; a worker ignores it (it renews the router's lease), the router
    answers ``Pong`` to a client."""

    nonce: int = 0
    """Echoed in the ``Pong``."""


@dataclass(frozen=True)
class Pong:
    """Answer to a client's ``Ping``."""

    run: str = ""
    """The router incarnation's tag: a new one means the router restarted and every
    request sent to the old one is lost."""
    nonce: int = 0
    """The ``Ping`` it answers."""


@dataclass(frozen=True)
class Shutdown:
    """Client -> router: stop every worker and answer ``Bye``; router -> worker: free
    everything, send ``Stats``, exit 0."""


@dataclass(frozen=True)
class Malformed:
    """Not a wire message: what a receiver gets in place of a frame that did not decode
    (``code`` and ``detail`` from the codec; ``rid`` when the frame had one)."""

    code: str
    detail: str
    rid: str = ""


Message = (Register | Ready | Load | Stats | MetricsReport | Prefilled | StepTokens | Tokens
           | Done
           | Registered | Req | Submit | Status | StatusReport | MetricsQuery
           | MetricsSnapshot | Bye | Abort | Stop | Drain | Error | Ping | Pong | Shutdown)
CODEC = Codec(*typing.get_args(Message), max_bytes=MAX_CONTROL_BYTES)
