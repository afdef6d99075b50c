"""Serving configuration: one frozen dataclass shared by the router, workers and launcher.

Every field has a docstring; ``ServeConfig.from_dict`` validates and names the allowed
values. ``DEFAULT`` is the embedded default (tiny model, CPU, sizes that serve on 2 cores).
The config crosses process boundaries as a plain dict (``to_dict``), never pickled.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from common.kv import DTYPE_BYTES, KvLayout
from common.model import CONFIGS, ModelConfig, UnsupportedModel, get_config, load_config

_TRANSPORTS = ("ipc", "tcp")
_FREELOG_POLICIES = ("pause", "exit")
_KV_TRANSPORTS = ("zmq", "nixl", "auto")
_KV_SECURITY = ("curve", "plain")
_ROUTING = ("prefix", "least-loaded")


@dataclass(frozen=True)
class ServeConfig:
    """How a pdkv deployment serves: model, pool sizes, batching, deadlines."""

    model: str = "tiny"
    """Built-in model config name (see ``common.model.config.CONFIGS``); ignored when
    ``model_path`` is set."""
    model_path: str = ""
    """Local checkpoint directory in the Hugging Face layout (config.json, safetensors,
    tokenizer files; docs/models.md); every worker loads it from its own disk (a worker's
    ``--model DIR`` may name its local copy). Never downloaded."""
    draft_model_path: str = ""
    """Checkpoint directory of a separate draft model for speculative decoding (same
    tokenizer as the target; its KV is computed by prefill and travels with the
    target's). Empty: no draft checkpoint."""
    spec_ngram: int = 0
    """Speculative decoding by n-gram prompt lookup: propose the ``spec_k`` tokens that
    followed the longest earlier match (up to this many tokens) of the sequence's tail;
    no draft weights. 0: off."""
    dtype: str = ""
    """Override of the model's dtype (float16, bfloat16, float32, float64); empty keeps it
    (a checkpoint's own dtype). Tests use float64 so that disaggregated and colocated
    outputs compare exactly."""
    page_size: int = 16
    """Slots per KV page, equal on prefill and decode (checked by the handshake)."""
    prefill_pages: int = 0
    """Pages of each prefill worker's KV pool (page 0 reserved); 0 (default): sized from
    the memory budget (``kv_memory_mib`` on CPU, ``gpu_memory_utilization`` on CUDA;
    ``common.sizing``). A count here overrides the budget."""
    decode_pages: int = 0
    """Pages of each decode (or colocated) worker's KV pool; 0: from the memory budget,
    as ``prefill_pages``."""
    kv_memory_mib: int = 1024
    """CPU: MiB of each worker's KV pool (target and draft layers of every page), the
    size vLLM's CPU build takes as ``VLLM_CPU_KVCACHE_SPACE``. Ignored where a page count
    is given."""
    gpu_memory_utilization: float = 0.9
    """CUDA: share of the device's memory one worker may fill in all (its weights, an
    activation margin and its KV pool), as vLLM's ``--gpu-memory-utilization``: the pool
    gets that share of the device's total, less what the device already holds and less
    the model's weights and activations. Ignored where a page count is given."""
    max_rows: int = 256
    """Requests a worker's pool holds open at once."""
    chunk_size: int = 256
    """Prefill chunk: most prompt tokens one request contributes to one forward pass."""
    max_prefill_tokens: int = 1024
    """Token budget of one prefill forward pass over all its requests."""
    max_running: int = 0
    """Decode: most requests admitted at once (rows held: decoding, and prefilling on a
    colocated worker); 0 (default) sizes it from the pool: every admitted request holds
    at least one page, so ``min(max_rows, usable pages)`` (``batch_limit``)."""
    draft_kv: bool = False
    """Prefill also computes (and ships) the draft model's KV; speculative decoding
    needs it. Off: pools hold the target's layers only. Implied by ``spec_k > 0``
    (see ``with_draft``)."""
    spec_k: int = 3
    """Decode: draft tokens proposed per sequence per step (speculative decoding, greedy
    requests only); 0 turns speculation off. It proposes with ``draft_model_path``, else
    n-gram lookup (``spec_ngram``), else a built-in model's own first layers; a
    checkpoint with neither a draft nor n-gram lookup does not speculate. 3 is where the
    built-in tiny model's decode tokens/s peaked (acceptance about 0.86, from seeded
    weights built so that its draft layers agree); larger k wastes verify work on rejected
    tails. On a trained checkpoint see docs/benchmarks.md."""
    offload: bool = True
    """Decode offloads committed full pages to a host tier while decoding, and prefill
    and decode reuse cached prompt prefixes from their host tiers (docs/host_tier.md)."""
    host_pages: int = 0
    """Pages of each worker's host tier (page 0 reserved); used when ``offload`` is on.
    0 (default): ``host_memory_mib`` of pages."""
    host_memory_mib: int = 1024
    """MiB of each worker's host tier (pinned host memory beside a GPU), unless
    ``host_pages`` gives a count."""
    overcommit: bool = True
    """Allocate on demand and preempt (default): a decode or colocated worker admits a
    request on its prompt's pages (and the first decode slot) and its row grows as it
    generates; when a running request cannot grow, the youngest is retracted to the host
    tier and resumed, oldest first, when pages come back. It needs the host tier
    (``offload``); without it (or False here) admission reserves each request's whole
    life, prompt + max_new_tokens, up front (``preempts``)."""
    prefix_load_timeout_s: float = 2.0
    """Longest a worker waits for a prefix load from its host tier. Past it the request
    gives up the cached prefix (its row is freed with reason ``timeout``; the load's pins
    keep the pages safe) and computes or receives the whole prompt in a new row. Keep it
    well under ``lease_s``: the worker's loop waits meanwhile."""
    shared_memory: bool = True
    """Decode pools on CPU live in named shared memory, so a prefill on the same host
    copies pages straight into them (transport protocol v2); elsewhere ZMQ frames."""
    kv_transport: str = "zmq"
    """KV data path between prefill and decode: zmq (data frames, or the shared pool
    above on one host), nixl (NIXL WRITEs into the decode's registered pool; needs
    ``pdkv[nixl]`` on every worker, else the handshake fails and names the side), auto
    (NIXL where both ends have it, else zmq). Control always rides ZMQ."""
    kv_security: str = "curve"
    """How KV connections authenticate in a deployment with keys: ``curve`` (encrypted
    and authenticated) or ``plain`` (authenticated by a per-deployment password, KV bytes in the
    clear: only on a private data network; docs/security.md). Without keys: neither."""
    max_new_tokens_limit: int = 2048
    """Largest max_new_tokens a request may ask for."""
    transport: str = "ipc"
    """Addresses the launcher gives workers on one machine: ipc (unix sockets) or tcp."""
    heartbeat_s: float = 1.0
    """Interval of heartbeats between router and workers and between KV peers."""
    lease_s: float = 10.0
    """A peer (worker, router or KV peer) silent this long is declared lost. A worker
    busy with a long step is not silent: its heartbeats go on from a thread of their own
    while the step runs (up to ``max_busy_s``)."""
    max_busy_s: float = 120.0
    """Longest a single step of a worker (a forward pass, a wait for its host tier) keeps
    the worker alive by heartbeats sent from outside the step. A step that runs longer is
    treated as hung: the heartbeats stop and its peers declare the worker lost after their
    lease, as they do a stopped or dead one."""
    ready_timeout_s: float = 120.0
    """Startup deadline: the launcher waits this long for every process to report ready,
    and the router for a registered worker to build its model (instead of the lease)."""
    rejoin_s: float = 30.0
    """A worker that lost its router ends the requests it held, keeps its model, pools
    and host tier, and registers again for this long (a restarted router, or a router
    that declared it lost while it was stopped); then it exits (status 3). 0: exit at
    once."""
    request_timeout_s: float = 600.0
    """Router: a request with no result after this long fails with 'timeout'. It is also
    the overall deadline of a request's KV transfer (``done_timeout_s`` of both KV
    endpoints): however long a request waits in a live prefill's queue, it waits no
    longer than its client does."""
    max_migrations: int = 3
    """Router: how often one request may move to other workers when a worker of it dies
    or drains (docs/operations.md, "Migration"); one more move fails it with an error
    that says so. 0: never move (a worker's death fails its requests)."""
    drain_timeout_s: float = 30.0
    """Router: a draining worker (``pdkv drain``, SIGTERM) finishes its requests for this
    long; what it still holds then moves to other workers, and it exits."""
    kv_chunk_timeout_s: float = 60.0
    """Longest gap between two KV messages of one request once its first came (decode),
    or between two hand-overs once the prefill started it; also the longest wait for a
    live peer's ``AbortAck``. Not the wait for a request's first KV: a request queued at
    a live prefill waits as long as the prefill's heartbeats say it is alive, up to
    ``request_timeout_s`` (docs/protocol.md, "Deadlines")."""
    kv_handshake_timeout_s: float = 60.0
    """Decode: longest wait for a prefill's (each of its ranks') answer to the KV
    handshake. A prefill answers between its forward passes, so this must exceed its
    longest pass under load (on a starved core a pass of a trained model can take tens
    of seconds). Meanwhile a dead prefill is declared lost by the router's lease."""
    encode_threads: int = 2
    """Router: threads that encode text requests (tokenizer, chat template), off the loop
    that serves every other request and the heartbeats."""
    encode_queue: int = 64
    """Router: text requests queued or being encoded at most; one more is refused at once
    (``overloaded``)."""
    encode_timeout_s: float = 60.0
    """Router: a text request not encoded this long after it came fails with
    ``encode_timeout`` (it was never routed: nothing to free)."""
    routing: str = "prefix"
    """Router: how it picks a request's workers. ``prefix``: by the prompt's blocks
    already cached on each (from the workers' KV events), against each one's load,
    falling back to load past ``routing_imbalance``; ``least-loaded``: by load alone
    (docs/routing.md). With one worker of a role both pick it."""
    routing_host_weight: float = 0.8
    """Prefix routing: what a block cached in a worker's host tier is worth against one
    on its device (1.0): loading it costs a copy."""
    routing_imbalance: int = 8
    """Prefix routing falls back to least-loaded for a role when its busiest worker runs
    this many more requests than its least busy one and ``routing_imbalance_ratio``
    times as many (sglang's balance thresholds)."""
    routing_imbalance_ratio: float = 1.5
    """See ``routing_imbalance``."""
    local_prefill_tokens: int = 256
    """Conditional disaggregation (prefix routing): when the chosen decode's host tier
    holds most of the prompt and at most this many of its tokens are not cached there,
    the decode computes them itself, without a prefill (docs/routing.md). 0: always a
    prefill."""
    prefill_tp: int = 1
    """Ranks (devices, processes) of each prefill worker's tensor-parallel group."""
    decode_tp: int = 1
    """Ranks of each decode worker's tensor-parallel group; a colocated worker is a group
    of ``decode_tp`` ranks. Prefill and decode sizes may differ (docs/cluster.md)."""
    tp_timeout_s: float = 30.0
    """Deadline of every collective of a tensor-parallel group once it joined: a rank
    silent this long takes its group down. The rendezvous, where the ranks wait for each
    other to start, is a startup wait: it gets ``ready_timeout_s``."""
    debug_integrity: bool = False
    """Workers run ``KvCache.check_integrity()`` whenever their loop is idle."""
    debug_copy_delay_s: float = 0.0
    """Test aid: every copy to or from a host tier (CPU) starts this late, so aborts
    land while copies are in flight. 0 in production."""
    debug_step_delay_s: float = 0.0
    """Test aid: every forward pass of every worker (prefill, decode, colocated; a
    speculative step makes several) takes this much longer, as on a starved core;
    heartbeats go on meanwhile. 0 in production."""
    debug_build_delay_s: float = 0.0
    """Test aid: a worker's build (model and pools) takes this much longer, like a large
    checkpoint loading. 0 in production."""
    freelog_on_error: str = "pause"
    """What a worker does while its free log cannot write (full disk, I/O error):
    ``pause`` stops admitting new requests (the router routes them elsewhere), finishes
    the admitted ones and admits again once the log writes (no request lost, the log exact
    while memory lasts); ``exit`` makes the worker exit with status 4 (its in-flight
    requests fail) for supervisors that replace workers. docs/freelog.md."""
    freelog_max_buffer_kib: int = 65536
    """KiB of free-log records a worker keeps in memory while the file refuses writes;
    past it they are dropped and the log records a ``lost`` marker (replay: incomplete)."""

    def __post_init__(self) -> None:
        if self.model not in CONFIGS and not self.model_path:
            raise ValueError(f"model={self.model!r}; allowed: {sorted(CONFIGS)}, or a "
                             "checkpoint directory in model_path")
        if self.dtype and self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={self.dtype!r}; allowed: '' (model's own) or "
                             f"{tuple(DTYPE_BYTES)}")
        self._check_models()
        if self.transport not in _TRANSPORTS:
            raise ValueError(f"transport={self.transport!r}; allowed: {_TRANSPORTS}")
        if self.kv_transport not in _KV_TRANSPORTS:
            raise ValueError(f"kv_transport={self.kv_transport!r}; allowed: "
                             f"{_KV_TRANSPORTS}")
        if self.kv_security not in _KV_SECURITY:
            raise ValueError(f"kv_security={self.kv_security!r}; allowed: {_KV_SECURITY}")
        for name in ("page_size", "max_rows", "chunk_size", "max_new_tokens_limit",
                     "kv_memory_mib", "host_memory_mib"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_running < 0:
            raise ValueError(f"max_running={self.max_running} must be >= 1, or 0 (sized "
                             "from the pool)")
        for name in ("prefill_pages", "decode_pages", "host_pages"):
            if getattr(self, name) == 1 or getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 2 (page 0 is "
                                 "reserved), or 0 (sized from the memory budget)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization}; "
                             "allowed: (0, 1]")
        if self.max_prefill_tokens < self.chunk_size:
            raise ValueError(f"max_prefill_tokens={self.max_prefill_tokens} must be >= "
                             f"chunk_size={self.chunk_size}")
        if not 0 < self.heartbeat_s < self.lease_s:
            raise ValueError(f"need 0 < heartbeat_s={self.heartbeat_s} < "
                             f"lease_s={self.lease_s}")
        if not 0 <= self.spec_k <= 16:
            raise ValueError(f"spec_k={self.spec_k}; allowed: 0 (off) to 16")
        if not 0 < self.prefix_load_timeout_s < self.lease_s:
            raise ValueError(f"need 0 < prefix_load_timeout_s={self.prefix_load_timeout_s} "
                             f"< lease_s={self.lease_s}")
        if self.rejoin_s < 0:
            raise ValueError(f"rejoin_s={self.rejoin_s} must be >= 0 (0: exit at once)")
        if self.freelog_on_error not in _FREELOG_POLICIES:
            raise ValueError(f"freelog_on_error={self.freelog_on_error!r}; allowed: "
                             f"{_FREELOG_POLICIES}")
        if self.freelog_max_buffer_kib < 1:
            raise ValueError(f"freelog_max_buffer_kib={self.freelog_max_buffer_kib} must "
                             "be >= 1")
        if self.max_migrations < 0 or self.drain_timeout_s < 0:
            raise ValueError(f"max_migrations={self.max_migrations} and drain_timeout_s="
                             f"{self.drain_timeout_s} must be >= 0")
        if min(self.ready_timeout_s, self.request_timeout_s, self.kv_chunk_timeout_s,
               self.kv_handshake_timeout_s) <= 0:
            raise ValueError(f"ready_timeout_s={self.ready_timeout_s}, request_timeout_s="
                             f"{self.request_timeout_s}, kv_chunk_timeout_s="
                             f"{self.kv_chunk_timeout_s} and kv_handshake_timeout_s="
                             f"{self.kv_handshake_timeout_s} must be > 0")
        if self.encode_threads < 1 or self.encode_queue < 1 or self.encode_timeout_s <= 0:
            raise ValueError(f"encode_threads={self.encode_threads} and encode_queue="
                             f"{self.encode_queue} must be >= 1, encode_timeout_s="
                             f"{self.encode_timeout_s} > 0")
        if min(self.debug_copy_delay_s, self.debug_build_delay_s,
               self.debug_step_delay_s) < 0:
            raise ValueError("debug_copy_delay_s, debug_build_delay_s and "
                             "debug_step_delay_s must be >= 0")
        if self.max_busy_s < self.lease_s:
            raise ValueError(f"max_busy_s={self.max_busy_s} must be >= lease_s="
                             f"{self.lease_s}: a step shorter than the lease never needs "
                             "heartbeats from outside it")
        self._check_routing()
        self._check_tp()

    def _check_routing(self) -> None:
        if self.routing not in _ROUTING:
            raise ValueError(f"routing={self.routing!r}; allowed: {_ROUTING}")
        if not 0 <= self.routing_host_weight <= 1:
            raise ValueError(f"routing_host_weight={self.routing_host_weight}; allowed: 0 "
                             "to 1 (a device block is worth 1)")
        if self.routing_imbalance < 0 or self.routing_imbalance_ratio < 1:
            raise ValueError(f"routing_imbalance={self.routing_imbalance} must be >= 0 and "
                             f"routing_imbalance_ratio={self.routing_imbalance_ratio} >= 1")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens={self.local_prefill_tokens} must be >= "
                             "0 (0: off)")

    def _check_tp(self) -> None:
        if self.prefill_tp < 1 or self.decode_tp < 1 or self.tp_timeout_s <= 0:
            raise ValueError(f"prefill_tp={self.prefill_tp}, decode_tp={self.decode_tp} "
                             f"must be >= 1 and tp_timeout_s={self.tp_timeout_s} > 0")
        if max(self.prefill_tp, self.decode_tp) == 1:
            return
        from common.model import shard_config  # heads and MLP must split evenly

        draft = self.draft_model_config()  # sharded like the target (common/model/tp.py)
        for tp in {self.prefill_tp, self.decode_tp}:
            shard_config(self.model_config(), tp)
            if draft is not None:
                shard_config(draft, tp)

    def _check_models(self) -> None:
        """Refuse a checkpoint pdkv cannot serve now, before any process starts."""
        if not 0 <= self.spec_ngram <= 16:
            raise ValueError(f"spec_ngram={self.spec_ngram}; allowed: 0 (off) to 16")
        if self.spec_ngram and self.draft_model_path:
            raise ValueError("spec_ngram and draft_model_path both set: choose one kind of "
                             "speculation")
        target = self.model_config()
        if self.draft_model_path:
            check_draft(target, self.draft_model_config(), self.model_path,
                        self.draft_model_path)
        if self.spec_k and not self.spec_kind and not target.path:
            raise ValueError(f"spec_k={self.spec_k} but model {self.model!r} has no draft "
                             "layers; use spec_k=0")

    @property
    def spec_kind(self) -> str:
        """How decode speculates: ``draft`` (draft checkpoint), ``ngram``, ``layers`` (a
        built-in's first layers) or empty (no speculation)."""
        if not self.spec_k:
            return ""
        if self.draft_model_path:
            return "draft"
        if self.spec_ngram:
            return "ngram"
        return "layers" if self.model_config().num_draft_layers else ""

    @property
    def with_draft(self) -> bool:
        """Pools hold the draft's layers and prefill computes its KV."""
        if self.draft_kv:
            return bool(self.draft_model_path or self.model_config().num_draft_layers)
        return self.spec_kind in ("draft", "layers")

    @property
    def model_name(self) -> str:
        """The served model's name: the checkpoint directory's name, else the built-in
        model's (``model`` stays ``tiny`` when ``model_path`` is set)."""
        return Path(self.model_path).name if self.model_path else self.model

    def model_config(self) -> ModelConfig:
        """The target model's config with ``dtype`` applied (from ``model_path``'s
        config.json, or the built-in ``model``)."""
        if self.model_path:
            return _checkpoint_config("model_path", self.model_path, self.dtype)
        return get_config(self.model, **({"dtype": self.dtype} if self.dtype else {}))

    def draft_model_config(self) -> ModelConfig | None:
        """The draft checkpoint's config in the target's dtype; None without one."""
        if not self.draft_model_path:
            return None
        dtype = self.model_config().dtype
        return _checkpoint_config("draft_model_path", self.draft_model_path, dtype)

    def kv_layout(self) -> KvLayout:
        """What a page of every pool holds: the target's layers, then the draft's
        (``with_draft``). A draft checkpoint's layers are stored in rows of the
        target's width (its K/V fill the first columns)."""
        t = self.model_config()
        draft = self.draft_model_config()
        num_draft = (draft.num_layers if draft else t.num_draft_layers) if self.with_draft \
            else 0
        return KvLayout(num_layers=t.num_layers, num_kv_heads=t.num_kv_heads,
                        head_dim=t.head_dim, dtype=t.dtype, num_draft_layers=num_draft)

    @property
    def preempts(self) -> bool:
        """Admission allocates on demand and retracts under pressure (``overcommit`` with
        a host tier to retract to); False: whole-life reservation."""
        return self.overcommit and self.offload

    def batch_limit(self, num_pages: int) -> int:
        """Requests a worker with a pool of ``num_pages`` admits at once: ``max_running``,
        or (0) as many as the pool has pages for, one each, at most ``max_rows``."""
        return self.max_running or max(1, min(self.max_rows, num_pages - 1))

    def role_tp(self, role: str) -> int:
        """Tensor-parallel ranks a worker of ``role`` has (a colocated worker: the decode's)."""
        return self.prefill_tp if role == "prefill" else self.decode_tp

    def page_bytes(self, role: str = "decode") -> int:
        """Bytes of one page of a ``role`` worker's pool on one rank (its share of the
        heads in a tensor-parallel group)."""
        return self.kv_layout().page_bytes(self.page_size) // self.role_tp(role)

    def pool_pages(self, role: str, budget_bytes: int | None = None) -> int:
        """Pages of a ``role`` ('prefill', 'decode', 'colocated') worker's pool: the count
        given (``prefill_pages``/``decode_pages``), else as many as ``budget_bytes``
        (default ``kv_memory_mib``, the CPU budget) hold, plus the reserved page 0.
        ``common.sizing.device_pool_pages`` gives a CUDA worker's budget."""
        given = self.prefill_pages if role == "prefill" else self.decode_pages
        if given:
            return given
        budget = self.kv_memory_mib << 20 if budget_bytes is None else budget_bytes
        return max(2, budget // self.page_bytes(role) + 1)

    def host_pool_pages(self, role: str = "decode") -> int:
        """Pages of a worker's host tier: ``host_pages``, else ``host_memory_mib`` of them."""
        return self.host_pages or max(2, (self.host_memory_mib << 20)
                                      // self.page_bytes(role) + 1)

    def pool_tokens(self, role: str) -> int:
        """Tokens one row of a ``role`` ('prefill' or 'decode') pool can hold at most, as
        the config sizes it on CPU; a CUDA worker reports its own pool with ``Ready``."""
        return (self.pool_pages(role) - 1) * self.page_size

    def to_dict(self) -> dict:
        """Plain fields (JSON/msgpack-safe)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ServeConfig:
        """Build and validate (a config file, ``--config-json``, the router's message).

        Raises:
            ConfigError: an unknown key (naming the known ones), a value of the wrong type
                (``"page_size": "32"``: naming the field and the type it needs) or out of
                range; one line each.
        """
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; allowed: {sorted(known)}")
        for name, value in d.items():
            _check_type(name, known[name], value)
        try:
            return cls(**d)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def with_overrides(self, **changes: object) -> ServeConfig:
        """A validated copy with some fields changed; ``None`` values are ignored.

        Raises:
            ConfigError: as ``from_dict``.
        """
        changes = {k: v for k, v in changes.items() if v is not None}
        for name, value in changes.items():
            _check_type(name, next((f.type for f in fields(self) if f.name == name), ""),
                        value)
        try:
            return replace(self, **changes)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


class ConfigError(ValueError):
    """A config value that cannot be used; the message names the field and what is allowed
    (``pdkv`` prints it as one line, no traceback)."""


_TYPES = {"int": (int, "an integer"), "float": ((int, float), "a number"),
          "str": (str, "a string"), "bool": (bool, "true or false")}


def _check_type(name: str, annotation: object, value: object) -> None:
    wanted = _TYPES.get(str(annotation))
    if wanted is None:
        return
    types, words = wanted
    # bool is an int in Python, but "page_size": true is a mistake, not 1
    if not isinstance(value, types) or (isinstance(value, bool) and str(annotation) != "bool"):
        raise ConfigError(f"config field {name!r} must be {words}, not {value!r} "
                          f"({type(value).__name__})")


def _checkpoint_config(field: str, path: str, dtype: str) -> ModelConfig:
    try:
        return load_config(path, dtype)
    except (FileNotFoundError, UnsupportedModel) as exc:
        raise ValueError(f"{field}={path!r}: {exc}") from None


def check_draft(target: ModelConfig, draft: ModelConfig, target_path: str, draft_path: str
                ) -> None:
    """Refuse a draft checkpoint that cannot propose for ``target``, naming the field."""
    if draft.kv_size > target.kv_size:
        raise ValueError(f"draft_model_path={draft_path!r}: its KV per token and layer "
                         f"(num_key_value_heads * head_dim = {draft.kv_size}) exceeds the "
                         f"target's ({target.kv_size}); pdkv stores draft layers in the "
                         "target's pages")
    if draft.vocab_size > target.vocab_size:
        raise ValueError(f"draft_model_path={draft_path!r}: vocab_size={draft.vocab_size} "
                         f"exceeds the target's {target.vocab_size}")
    if target_path:
        a, b = Path(target_path, "tokenizer.json"), Path(draft_path, "tokenizer.json")
        if a.is_file() and b.is_file() and a.read_bytes() != b.read_bytes():
            raise ValueError(f"draft_model_path={draft_path!r}: its tokenizer.json differs "
                             "from the target's; a draft must share the target's tokenizer")


def resolve_model(value: str | None) -> dict:
    """ServeConfig fields of a ``--model`` value: a built-in name or a checkpoint directory.

    Raises:
        ValueError: neither (pdkv never downloads a model by name).
    """
    if value is None:
        return {}
    if value in CONFIGS:
        return {"model": value, "model_path": ""}
    if Path(value).expanduser().is_dir():
        return {"model_path": str(Path(value).expanduser().resolve())}
    raise ValueError(f"--model {value!r} is neither a directory nor a built-in model "
                     f"({', '.join(sorted(CONFIGS))}); pdkv never downloads: give a local "
                     "checkpoint directory in the Hugging Face layout")


DEFAULT = ServeConfig()
"""The embedded default."""
