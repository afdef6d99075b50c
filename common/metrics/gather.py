"""Gatherer: the router's view of the deployment's metrics, exposed once.

Workers send their families to the router every heartbeat (and once more when they
close); the router keeps the last report of each and serves the union, every sample
labelled with the worker's registered name and role, next to its own families. For
each worker the gatherer adds ``pdkv_worker_up`` and ``pdkv_worker_metrics_age_seconds``;
a worker that is lost keeps only those (up = 0), so that stale counters never pass for
live ones. A worker that closed cleanly keeps its final report until the router exits
(``pdkv run`` writes it to ``metrics.prom``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric

from common.metrics.catalogue import metric
from common.metrics.node import NodeMetrics
from common.metrics.wire import WireError, from_wire, merge

logger = logging.getLogger(__name__)


@dataclass
class _Report:
    role: str
    families: list[Metric]
    t: float
    up: bool = True
    final: bool = False


class Gatherer:
    """Last reports by worker, merged with the own process's metrics on ``collect``.

    Thread-safe: reports arrive on the router's loop, scrapes on HTTP threads.
    """

    def __init__(self, own: NodeMetrics, name: str = "router") -> None:
        self.own, self.name = own, name
        self._reports: dict[str, _Report] = {}
        self._lock = threading.Lock()

    def report(self, worker: str, role: str, data: object, final: bool = False) -> None:
        """Keep ``worker``'s report (wire form).

        Raises:
            WireError: the report is malformed; the previous one is kept.
        """
        families = from_wire(data)
        with self._lock:
            self._reports[worker] = _Report(role, families, time.monotonic(), True, final)

    def lost(self, worker: str, role: str) -> None:
        """``worker`` went silent or away: drop its series, keep up = 0."""
        with self._lock:
            old = self._reports.get(worker)
            if old is not None and old.final:
                old.up = False   # a clean goodbye keeps its final counters
                return
            self._reports[worker] = _Report(role, [], old.t if old else time.monotonic(),
                                            False)

    def workers(self) -> dict[str, bool]:
        with self._lock:
            return {name: r.up for name, r in self._reports.items()}

    def collect(self) -> list[Metric]:
        now = time.monotonic()
        with self._lock:
            reports = dict(self._reports)
        groups = [({"worker": self.name, "role": self.own.role}, self.own.collect())]
        for worker, r in sorted(reports.items()):
            groups.append(({"worker": worker, "role": r.role},
                           [*r.families, *_liveness(r, now)]))
        return merge(groups)


def _liveness(r: _Report, now: float) -> list[Metric]:
    up = GaugeMetricFamily("pdkv_worker_up", metric("pdkv_worker_up").help,
                           value=1.0 if r.up else 0.0)
    age = GaugeMetricFamily("pdkv_worker_metrics_age_seconds",
                            metric("pdkv_worker_metrics_age_seconds").help, value=now - r.t)
    return [up, age]


__all__ = ["Gatherer", "WireError"]
