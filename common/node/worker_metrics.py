"""What a worker counts for the metrics and reports to the router with its heartbeat."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from common.config import ServeConfig
from common.control import Load, Message, MetricsReport, Req, StepTokens, Tokens
from common.kv import KvCache
from common.metrics import NodeMetrics, WireError, from_wire, loads, merge, pack

logger = logging.getLogger(__name__)

Readings = Callable[[], list[tuple[str, dict[str, str], float]]]


class WorkerMetrics:
    """A worker's ``NodeMetrics`` and the counts the worker shell feeds it.

    Args:
        role: the worker's role (which tokens it counts).
        readings: the worker's own cheap reads (transport, host tier), at every report.
    """

    def __init__(self, role: str, readings: Readings) -> None:
        self.role = role
        self.metrics = NodeMetrics(role)
        # only the worker that generates (computes the prompt) counts tokens (prompt)
        self._generated = None if role == "prefill" else self.metrics.counter(
            "pdkv_generation_tokens_total")
        self._prompt = None if role == "decode" else self.metrics.counter(
            "pdkv_prompt_tokens_total")
        self._last_load: Load | None = None
        self.metrics.read(self._load_readings)
        self.metrics.read(readings)

    def watch(self, config: ServeConfig, cache: KvCache) -> None:
        """The device pool's page states, and what this worker was built from."""
        self.metrics.watch_pools("device", cache.pool_stats)
        self.metrics.set_info(**build_info(config, cache))

    def on_req(self, msg: Req) -> None:
        if self._prompt is not None:
            self._prompt.inc(len(msg.prompt) // 4)   # int32 ids

    def on_send(self, msg: Message, cache: KvCache | None) -> None:
        if isinstance(msg, Tokens | StepTokens) and self._generated is not None:
            self._generated.inc(len(msg.ids) // (4 if isinstance(msg, StepTokens) else 1))

    def on_transfer(self, direction: str, pages: int, nbytes: int, seconds: float,
                    path: str) -> None:
        """A request's KV transfer completed: ``direction`` sent (prefill, acknowledged
        by every decode rank) or received (decode, every page landed), over ``path``."""
        count_transfer(self.metrics, direction, pages, nbytes, seconds, path)

    def report(self, name: str, load: Load | None, final: bool = False,
               ranks: Sequence[bytes] = ()) -> MetricsReport | None:
        """The report to send (None when collecting failed: metrics never take a worker
        down); ``load``: the queues now (None keeps the last heartbeat's).

        ``ranks``: rank 0 of a tensor-parallel group passes its followers' metrics (wire
        bytes, rank order; empty when one did not report); every sample then carries
        ``rank`` (this process's ``"0"``)."""
        if load is not None:
            self._last_load = load
        try:
            own = self.metrics.collect()
            if ranks:
                own = merge([({"rank": "0"}, own), *_followers(name, ranks)])
            return MetricsReport(name, pack(own), final)
        except Exception:
            logger.exception("%s: collecting metrics failed", name)
            return None

    def _load_readings(self) -> list[tuple[str, dict[str, str], float]]:
        load = self._last_load
        if load is None:
            return []
        queue = "prefill" if self.role == "prefill" else "admission"
        return [("pdkv_running_requests", {}, load.running),
                ("pdkv_queue_requests", {"queue": queue}, load.queued)]


def count_transfer(metrics: NodeMetrics, direction: str, pages: int, nbytes: int,
                   seconds: float, path: str) -> None:
    """One completed KV transfer into ``metrics`` (rank 0's and every follower's)."""
    labels = {"direction": direction, "path": path or "?"}
    metrics.counter("pdkv_transfer_pages_total").labels(**labels).inc(pages)
    metrics.counter("pdkv_transfer_completed_bytes_total").labels(**labels).inc(nbytes)
    if pages:   # a prefix the decode held whole moved nothing: no transfer time
        metrics.histogram("pdkv_transfer_seconds").labels(**labels).observe(seconds)


def _followers(name: str, ranks: Sequence[bytes]) -> list:
    """``(labels, families)`` of each follower whose metrics decode (checked as the
    router checks a worker's: a follower's bad report is left out, never forwarded)."""
    out = []
    for rank, raw in enumerate(ranks, 1):
        if not raw:
            continue
        try:
            out.append(({"rank": str(rank)}, from_wire(loads(raw))))
        except WireError as exc:
            logger.warning("%s: tp rank %d's metrics left out: %s", name, rank, exc)
    return out


def build_info(config: ServeConfig, cache: KvCache) -> dict[str, str]:
    """The labels of ``pdkv_build_info`` for a worker built from ``config``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("pdkv")
    except PackageNotFoundError:
        ver = "unknown"
    lay = cache.layout
    return {"version": ver, "model": config.model_name, "dtype": str(lay.dtype),
            "page_size": str(cache.page_size), "transport": config.transport,
            "spec_k": str(config.spec_k),
            "layout": f"{lay.num_layers}+{lay.num_draft_layers}L/{lay.num_kv_heads}h/"
                      f"{lay.head_dim}d"}
