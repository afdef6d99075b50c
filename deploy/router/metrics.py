"""The router's metrics: its own serving figures and the deployment's gathered view.

The router measures what only it sees (requests in flight, TTFT, TPOT and end-to-end
latency, finished requests by reason) and keeps every worker's last ``MetricsReport``
(``common.metrics.Gatherer``). The union is what ``--metrics-port`` serves, what a
client's ``MetricsQuery`` is answered with (``pdkv top``, the HTTP front door) and what
``Bye`` carries at shutdown.
"""

from __future__ import annotations

import logging
import time

from common.metrics import Gatherer, MetricsServer, NodeMetrics, WireError, loads, pack

logger = logging.getLogger(__name__)


class RouterMetrics:
    """Counting at the router's request transitions; gathering the workers' reports."""

    def __init__(self, in_flight, encoding=lambda: 0) -> None:
        self.node = NodeMetrics("router")
        self.gatherer = Gatherer(self.node)
        self.node.gauge("pdkv_requests_in_flight").set_function(in_flight)
        self.node.gauge("pdkv_text_encoding_requests").set_function(encoding)
        self._encode = self.node.histogram("pdkv_text_encode_seconds")
        self._encode_failures = self.node.counter("pdkv_text_encode_failures_total")
        self._requests = self.node.counter("pdkv_requests_total")
        self._ttft = self.node.histogram("pdkv_ttft_seconds")
        self._tpot = self.node.histogram("pdkv_tpot_seconds")
        self._e2e = self.node.histogram("pdkv_e2e_latency_seconds")
        self._migrations = self.node.counter("pdkv_migrations_total")
        self._timing: dict[str, list[float]] = {}   # rid -> [t_submit, t_first, t_last, n]
        self._served_prompt = self.node.counter("pdkv_request_prompt_tokens_total")
        self._served_cached = self.node.counter("pdkv_request_cached_tokens_total")
        self.served_tokens = [0, 0]  # prompt, cached: of the requests that finished
        self.node.gauge("pdkv_prefix_hit_ratio").set_function(self.hit_ratio)
        self.server: MetricsServer | None = None

    # -- requests ------------------------------------------------------------------------
    def submitted(self, rid: str, t: float) -> None:
        self._timing[rid] = [t, 0.0, 0.0, 0]

    _ENCODE_FAILURES = {"EncodeTimeout": "timeout", "EncodeFailed": "error",
                        "Overloaded": "overloaded"}

    def encoded(self, seconds: float | None, error: str) -> None:
        """A text request's encoding ended: in ``seconds`` (submit to ids), or failed
        (``error``: the exception's class name; a bad request, such as a text longer
        than the context, is no encoding failure)."""
        if seconds is not None:
            self._encode.observe(seconds)
        elif error in self._ENCODE_FAILURES:
            self._encode_failures.labels(reason=self._ENCODE_FAILURES[error]).inc()

    def tokens(self, rid: str, n: int) -> None:
        timing = self._timing.get(rid)
        if timing is None or not n:
            return
        now = time.monotonic()
        if not timing[3]:
            timing[1] = now
            self._ttft.observe(now - timing[0])
        timing[2], timing[3] = now, timing[3] + n

    def moved(self, old: str, new: str, cause: str) -> None:
        """A request's next attempt got id ``new`` (``deploy.router.migration``): count
        the move by its ``cause``; the request's timings go on under the new id."""
        self._migrations.labels(cause=cause).inc()
        if (timing := self._timing.pop(old, None)) is not None:
            self._timing[new] = timing

    def finished(self, rid: str, reason: str) -> None:
        timing = self._timing.pop(rid, None)
        self._requests.labels(reason=reason).inc()
        if timing is None:
            return
        t_submit, t_first, t_last, n = timing
        self._e2e.observe(time.monotonic() - t_submit)
        if n > 1:
            self._tpot.observe((t_last - t_first) / (n - 1))

    def served(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A request finished: its prompt and the part of it a host tier supplied."""
        cached_tokens = min(cached_tokens, prompt_tokens)
        self._served_prompt.inc(prompt_tokens)
        self._served_cached.inc(cached_tokens)
        self.served_tokens[0] += prompt_tokens
        self.served_tokens[1] += cached_tokens

    def hit_ratio(self) -> float:
        prompt, cached = self.served_tokens
        return cached / prompt if prompt else 0.0

    # -- workers -------------------------------------------------------------------------
    def report(self, worker: str, role: str, families: bytes, final: bool) -> bool:
        """Keep a worker's report; False (logged) if it was malformed."""
        try:
            self.gatherer.report(worker, role, loads(families), final)
            return True
        except WireError as exc:
            logger.warning("router: bad metrics report from %s: %s", worker, exc)
            return False

    def lost(self, worker: str, role: str) -> None:
        self.gatherer.lost(worker, role)

    def snapshot(self) -> bytes:
        return pack(self.gatherer.collect())

    # -- exposition ----------------------------------------------------------------------
    def serve_http(self, host: str, port: int) -> str:
        self.server = MetricsServer(self.gatherer.collect, host, port)
        return self.server.url

    @property
    def url(self) -> str:
        return self.server.url if self.server else ""

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
