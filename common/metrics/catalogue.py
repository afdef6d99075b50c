"""Every metric pdkv exposes: name, type, labels and meaning, in one table.

The table is the contract for the exposition, docs/operations.md (a test checks that the
page lists every name) and deploy/grafana/pdkv.json (a test checks that every panel's
expression names a metric from here). Names follow Prometheus conventions: a ``pdkv_``
prefix, base units (seconds, bytes), ``_total`` on counters, ``_ratio`` on fractions.

Every sample of a worker also carries ``worker`` and ``role`` labels, added by the router
when it gathers the deployment's metrics (``common.metrics.wire.merge``); they are not
listed per metric below.
"""

from __future__ import annotations

from dataclasses import dataclass

# Buckets in seconds: from a fraction of a millisecond (CPU decode step, shm copy) to a
# long prefill on a loaded worker.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3,
                         0.6, 1.2, 2.5, 5.0)


@dataclass(frozen=True)
class MetricDef:
    """One metric family.

    Attributes:
        name: the exposed family name (counters end in ``_total``).
        kind: ``counter``, ``gauge``, ``histogram`` or ``info`` (a gauge of value 1).
        help: what it means, the HELP line and the docs' words.
        labels: label names besides ``worker`` and ``role``.
        where: who exposes it: ``kv`` (every process with a pool, read from the
            allocator at scrape time), ``worker`` (every worker), ``decode``, ``prefill``,
            ``router``, ``gather`` (the router, once per worker it gathers).
        buckets: histogram bucket bounds.
    """

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    where: str = "worker"
    buckets: tuple[float, ...] = ()


_POOL = ("tier", "pool")

METRICS: tuple[MetricDef, ...] = (
    # -- KV pages, read from the allocators (tier: device or host) -----------------------
    MetricDef("pdkv_kv_pages", "gauge", "Pages of a pool by state: free, owned, pinned "
              "(owned and claimed by in-flight I/O), pending (freed while pinned, free at "
              "the last unpin), reserved (page 0).", (*_POOL, "state"), "kv"),
    MetricDef("pdkv_kv_held_pages", "gauge", "Owned and pinned pages by owner kind: "
              "request (request rows) or the cache that owns them (cache:host).",
              (*_POOL, "owner_kind"), "kv"),
    MetricDef("pdkv_kv_capacity_pages", "gauge", "Usable pages of a pool (reserved ones "
              "excluded).", _POOL, "kv"),
    MetricDef("pdkv_kv_usage_ratio", "gauge", "Share of a pool's usable pages that are not "
              "free, 0 to 1 (like vllm:kv_cache_usage_perc).", _POOL, "kv"),
    MetricDef("pdkv_kv_frees_total", "counter", "Free events by reason (the free log's "
              "free events, exactly).", (*_POOL, "reason"), "kv"),
    MetricDef("pdkv_kv_freed_pages_total", "counter", "Pages given back by reason (the "
              "pages of the free log's free events, exactly).", (*_POOL, "reason"), "kv"),
    MetricDef("pdkv_kv_pins_total", "counter", "Pin events by reason (send, receive, "
              "offload, load, ...), as in the free log.", (*_POOL, "reason"), "kv"),
    MetricDef("pdkv_kv_pinned_pages_total", "counter", "Pages claimed by pins, by reason.",
              (*_POOL, "reason"), "kv"),
    MetricDef("pdkv_kv_unpins_total", "counter", "Unpin events (claims that ended).",
              _POOL, "kv"),
    MetricDef("pdkv_kv_allocated_pages_total", "counter", "Pages handed out.", _POOL, "kv"),
    MetricDef("pdkv_kv_released_pages_total", "counter", "Pages freed while pinned that "
              "became free at their last unpin (deferred releases).", _POOL, "kv"),
    MetricDef("pdkv_kv_handed_off_pages_total", "counter", "Pages whose ownership moved "
              "from a request to a cache.", _POOL, "kv"),
    # -- transfers (prefill sends, decode receives) -------------------------------------
    MetricDef("pdkv_transfer_bytes_total", "counter", "KV bytes moved by the transport, "
              "frames and shared-memory copies (direction: sent on prefill, received on "
              "decode).", ("direction",)),
    MetricDef("pdkv_transfer_pages_total", "counter", "KV pages of completed transfers, by "
              "data path: sent (prefill, acknowledged by every decode rank) or received "
              "(decode rank, every page landed); a prefix the decode loaded from its host "
              "tier is not sent.", ("direction", "path")),
    MetricDef("pdkv_transfer_completed_bytes_total", "counter", "KV bytes of completed "
              "transfers, by data path (sent on prefill, received on each decode rank): "
              "equal on both sides when every transfer completed. pdkv_transfer_bytes_total "
              "counts every byte moved, aborted transfers' too.", ("direction", "path")),
    MetricDef("pdkv_transfer_seconds", "histogram", "Per completed transfer, by data path: "
              "sent, the prefill's last chunk computed to the decode's acknowledgement of "
              "every page (the transfer time TTFT cannot hide); received, the decode's first "
              "KV landed to its last.", ("direction", "path"), "worker", LATENCY_BUCKETS),
    MetricDef("pdkv_transfer_in_flight", "gauge", "Requests whose KV transfer is open.",
              ("direction",)),
    MetricDef("pdkv_transfer_data_path", "gauge", "1 for the data path each live KV peer "
              "got at its handshake: shm (copies straight into the decode's shared pool), "
              "tcp or ipc (ZMQ frames). A same-host pair whose shared memory could not be "
              "mapped shows tcp or ipc here.", ("peer", "path")),
    MetricDef("pdkv_transfer_handshake_failures_total", "counter", "KV handshakes that "
              "failed, by reason and field. mismatch: the Hello field that differed "
              "(version, model, model_digest, num_layers, num_draft_layers, total_kv_heads, "
              "head_dim, dtype, page_size, role, tp_rank, tp_size, lease_ms, kv_transport, "
              "shm_pool; ranks: a prefill group's ranks; answer: a reply that is no Hello). "
              "refused: auth (prefill: a connection whose KV credentials were refused), "
              "shm_pool (prefill: the decode's shared pool could not be mapped safely), "
              "peer (decode: the prefill answered with an error). timeout (field none): no "
              "answer within handshake_timeout_s (a decode with wrong KV credentials sees "
              "this).", ("reason", "field")),
    MetricDef("pdkv_transfer_protocol_errors_total", "counter", "Protocol errors reported "
              "or received, by error code.", ("code",)),
    MetricDef("pdkv_transfer_lease_expiries_total", "counter", "KV peers declared lost "
              "after their lease ran out (their requests' pages freed as peer_lost)."),
    MetricDef("pdkv_transfer_aborts_total", "counter", "Transfer aborts by the side that "
              "aborted: local (this worker told its peer) or peer (the peer told us).",
              ("side",)),
    MetricDef("pdkv_request_aborts_total", "counter", "Requests a worker aborted (reason "
              "aborted: the client, the router or the KV peer asked), by the stage they were "
              "in: queued, waiting_kv, prefilling, transferring, decoding, retracted. The "
              "rows of those that held one are the free log's aborted frees.", ("stage",)),
    # -- serving --------------------------------------------------------------------------
    MetricDef("pdkv_requests_in_flight", "gauge", "Requests the router has routed and not "
              "finished.", (), "router"),
    MetricDef("pdkv_text_encoding_requests", "gauge", "Text requests the router is "
              "encoding (tokenizer, chat template) or has queued for its encoding threads; "
              "they are routed once encoded.", (), "router"),
    MetricDef("pdkv_text_encode_seconds", "histogram", "Per text request encoded, its "
              "submission to its token ids (queueing for an encoding thread included).",
              (), "router", LATENCY_BUCKETS),
    MetricDef("pdkv_text_encode_failures_total", "counter", "Text requests that got no ids: "
              "timeout (past encode_timeout_s), error (the tokenizer or chat template "
              "failed), overloaded (encode_queue full). Bad requests (a text longer than "
              "the context) are refused as such, not counted here.", ("reason",), "router"),
    MetricDef("pdkv_requests_total", "counter", "Finished requests by final reason (stop, "
              "length, aborted, error, timeout).", ("reason",), "router"),
    MetricDef("pdkv_migrations_total", "counter", "Requests the router moved to other "
              "workers, by cause: decode_lost, prefill_lost, colocated_lost (the worker died "
              "or went silent past its lease), kv_lost (the decode's transfer lost its "
              "prefill), drained (the worker drained past drain_timeout_s). The workers free "
              "what they held for the attempt that moved with reason migrated.",
              ("cause",), "router"),
    # -- routing (deploy/router/placement.py, docs/routing.md) ---------------------------
    MetricDef("pdkv_routing_decisions_total", "counter", "Workers the router chose, by stage "
              "(prefill, decode) and why: prefix (its cached prefix decided), load (no "
              "worker had a hit, or routing is least-loaded), imbalance (prefix routing fell "
              "back to load: the role's busiest worker ran too many more requests), local "
              "(stage prefill: none; the decode computes the prompt's uncached rest itself).",
              ("stage", "reason"), "router"),
    MetricDef("pdkv_routing_prompt_tokens_total", "counter", "Prompt tokens of the requests "
              "routed to a stage's workers (prefill: those given a prefill).", ("stage",),
              "router"),
    MetricDef("pdkv_routing_cached_tokens_total", "counter", "Of those, the tokens the "
              "router's index showed cached on the chosen worker when it chose (tier: device "
              "or host): the hits routing expected.", ("stage", "tier"), "router"),
    MetricDef("pdkv_request_prompt_tokens_total", "counter", "Prompt tokens of the requests "
              "that finished (stop or length).", (), "router"),
    MetricDef("pdkv_request_cached_tokens_total", "counter", "Of those, the tokens a "
              "worker's host tier supplied instead of computing or receiving them (the "
              "larger of the prefill's and the decode's count).", (), "router"),
    MetricDef("pdkv_prefix_hit_ratio", "gauge", "pdkv_request_cached_tokens_total over "
              "pdkv_request_prompt_tokens_total since the router started (0 before any "
              "request finished).", (), "router"),
    MetricDef("pdkv_kv_events_batches_total", "counter", "KV event batches the router "
              "applied to its prefix index, by publisher (a worker).", ("publisher",),
              "router"),
    MetricDef("pdkv_kv_events_gaps_total", "counter", "Gaps in a publisher's sequence "
              "numbers the router saw (each one asked its replay socket).", ("publisher",),
              "router"),
    MetricDef("pdkv_kv_events_lost_batches_total", "counter", "Batches neither the stream "
              "nor the replay brought (past the publisher's replay ring, or undecodable): "
              "the router dropped that worker's index entries and rebuilds them from its "
              "later events.", ("publisher",), "router"),
    MetricDef("pdkv_kv_events_blocks", "gauge", "Blocks the router's index holds per "
              "publisher and medium (GPU: device pool, CPU: host tier).",
              ("publisher", "medium"), "router"),
    MetricDef("pdkv_prompt_tokens_total", "counter", "Prompt tokens of the requests a worker "
              "prefilled (cached prefix included)."),
    MetricDef("pdkv_generation_tokens_total", "counter", "Tokens a worker generated."),
    MetricDef("pdkv_prefill_computed_tokens_total", "counter", "Prompt tokens a worker "
              "computed (a prefix loaded from its host tier not included): prefill and "
              "colocated workers, and a decode for the prompts it prefills itself "
              "(conditional disaggregation)."),
    MetricDef("pdkv_ttft_seconds", "histogram", "Time to first token at the router, submit "
              "to the first token relayed.", (), "router", LATENCY_BUCKETS),
    MetricDef("pdkv_tpot_seconds", "histogram", "Time per output token after the first, per "
              "request: (last token - first token) / (tokens - 1).", (), "router",
              TOKEN_LATENCY_BUCKETS),
    MetricDef("pdkv_e2e_latency_seconds", "histogram", "Submit to the final result at the "
              "router.", (), "router", LATENCY_BUCKETS),
    MetricDef("pdkv_queue_requests", "gauge", "Requests waiting in a worker queue: prefill "
              "(not yet computed), admission (decode waiting for pages), retracted "
              "(decode, moved to the host tier under pressure).", ("queue",)),
    MetricDef("pdkv_running_requests", "gauge", "Requests in the running batch (decode), or "
              "being prefilled (prefill)."),
    MetricDef("pdkv_spec_draft_tokens_total", "counter", "Draft tokens proposed by "
              "speculative decoding."),
    MetricDef("pdkv_spec_accepted_tokens_total", "counter", "Draft tokens the target model "
              "accepted."),
    MetricDef("pdkv_prefix_hit_pages_total", "counter", "Prompt pages loaded from the host "
              "tier instead of computed or received."),
    MetricDef("pdkv_host_copy_pages_total", "counter", "Pages copied between the device pool "
              "and the host tier (direction: offload to host, load from host).",
              ("direction",)),
    MetricDef("pdkv_host_copy_bytes_total", "counter", "Bytes copied between the device pool "
              "and the host tier.", ("direction",)),
    # -- the process --------------------------------------------------------------------
    MetricDef("pdkv_build_info", "info", "Build and serving config of the process (value "
              "1): version, model, dtype, page size, KV layout, transport, spec_k.",
              ("version", "model", "dtype", "page_size", "layout", "transport", "spec_k"),
              "worker"),
    MetricDef("pdkv_worker_up", "gauge", "1 while the router hears from the worker, 0 once "
              "it is lost or gone (its other series are dropped then).", (), "gather"),
    MetricDef("pdkv_worker_metrics_age_seconds", "gauge", "Age of the worker's last "
              "metrics report at the router (reports come every heartbeat_s).", (),
              "gather"),
)

_BY_NAME = {m.name: m for m in METRICS}


def metric(name: str) -> MetricDef:
    """The definition of ``name`` (a family name, as exposed)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no pdkv metric {name!r}; see common/metrics/catalogue.py") from None


def family_of(series: str) -> str | None:
    """The family a series name belongs to (``x_bucket`` -> ``x``), or None if unknown."""
    if series in _BY_NAME:
        return series
    for suffix in ("_bucket", "_sum", "_count"):
        base = series.removesuffix(suffix)
        if base != series and base in _BY_NAME and _BY_NAME[base].kind == "histogram":
            return base
    return None
