"""NodeMetrics: one process's metrics registry, built from the catalogue.

Each process (router, prefill, decode or colocated worker) makes one ``NodeMetrics`` and
hands it to the parts that count: they keep the metric objects they need
(``m.counter(name)``, bound to labels once, outside hot loops). Pools are watched, not
counted (``watch_pools``). The registry is the process's own, never prometheus_client's
global one, so that several workers built in one test process do not mix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from common.kv import PoolStats
from common.metrics.catalogue import MetricDef, metric
from common.metrics.kv_collector import KvCollector

logger = logging.getLogger(__name__)

# A reading: (catalogue name, labels, value), taken when the registry is collected.
Reading = tuple[str, dict[str, str], float]

# Which catalogue rows a process of each role defines.
_ROLE_SCOPES = {"prefill": {"worker", "prefill"}, "decode": {"worker", "decode"},
                "colocated": {"worker", "prefill", "decode"}, "router": {"router"},
                "worker": {"worker"}}   # a WorkerBase subclass that names no role


class NodeMetrics:
    """The metrics of one process of role ``role`` (prefill, decode, colocated, router)."""

    def __init__(self, role: str) -> None:
        if role not in _ROLE_SCOPES:
            raise ValueError(f"NodeMetrics role={role!r}; allowed: {sorted(_ROLE_SCOPES)}")
        self.role = role
        self.registry = CollectorRegistry(auto_describe=False)
        self.kv = KvCollector()
        self.registry.register(self.kv)
        self._info: dict[str, str] | None = None
        self._objects: dict[str, Counter | Gauge | Histogram] = {}
        self._readers: list[Callable[[], Iterable[Reading]]] = []
        self.registry.register(_InfoCollector(self))
        self.registry.register(_ReadCollector(self))

    # -- definitions ---------------------------------------------------------------------
    def counter(self, name: str) -> Counter:
        return self._get(name, "counter")

    def gauge(self, name: str) -> Gauge:
        return self._get(name, "gauge")

    def histogram(self, name: str) -> Histogram:
        return self._get(name, "histogram")

    def _get(self, name: str, kind: str):
        """The metric object, made on first use (so unused ones show no zero series)."""
        d = metric(name)
        if d.kind != kind:
            raise TypeError(f"{name} is a {d.kind}, not a {kind}")
        if d.where not in _ROLE_SCOPES[self.role]:
            raise KeyError(f"{name} is a {d.where} metric; a {self.role} process does not "
                           "expose it")
        obj = self._objects.get(name)
        if obj is None:
            obj = self._objects[name] = _make(d, self.registry)
        return obj

    def read(self, reader: Callable[[], Iterable[Reading]]) -> None:
        """Expose counters and gauges that live elsewhere (a transport's or an
        offloader's own counts): ``reader()`` is called at every collect, on the thread
        that collects, and answers ``(name, labels, value)`` readings. A name read this
        way is never also a metric object of this registry."""
        self._readers.append(reader)

    def set_info(self, **labels: object) -> None:
        """The labels of ``pdkv_build_info`` (the catalogue's names, all of them)."""
        want = set(metric("pdkv_build_info").labels)
        if set(labels) != want:
            raise ValueError(f"build info labels {sorted(labels)}; need {sorted(want)}")
        self._info = {k: str(v) for k, v in labels.items()}

    def watch_pools(self, tier: str, source: Callable[[], Iterable[PoolStats]]) -> None:
        """Expose the pools that ``source()`` reads (``cache.pool_stats``) as ``tier``."""
        if tier not in ("device", "host"):
            raise ValueError(f"tier={tier!r}; allowed: device, host")
        self.kv.watch(tier, source)

    # -- reading -------------------------------------------------------------------------
    def collect(self) -> list[Metric]:
        """Every family now, without the ``_created`` series (timestamps, not data)."""
        out = []
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            out.append(family)
        return out


class _ReadCollector:
    def __init__(self, node: NodeMetrics) -> None:
        self.node = node

    def collect(self):
        families: dict[str, Metric] = {}
        for reader in self.node._readers:
            try:
                readings = list(reader())
                for name, labels, value in readings:
                    family = families.get(name)
                    if family is None:
                        family = families[name] = _family(name, self.node)
                    family.add_sample(name, labels, float(value))
            except Exception:  # one broken part must not blank the whole scrape
                logger.exception("metrics: reader %r failed", reader)
        return list(families.values())


def _family(name: str, node: NodeMetrics) -> Metric:
    d = metric(name)
    if name in node._objects or d.kind not in ("counter", "gauge"):
        raise ValueError(f"{name}: read values must be counters or gauges that are not "
                         "also metric objects")
    cls = CounterMetricFamily if d.kind == "counter" else GaugeMetricFamily
    return cls(name.removesuffix("_total") if d.kind == "counter" else name, d.help)


class _InfoCollector:
    def __init__(self, node: NodeMetrics) -> None:
        self.node = node

    def collect(self):
        info = self.node._info
        if info is None:
            return []
        family = GaugeMetricFamily("pdkv_build_info", metric("pdkv_build_info").help,
                                   labels=list(info))
        family.add_metric(list(info.values()), 1)
        return [family]


def _make(d: MetricDef, registry: CollectorRegistry):
    if d.kind == "counter":
        return Counter(d.name.removesuffix("_total"), d.help, d.labels, registry=registry)
    if d.kind == "gauge":
        return Gauge(d.name, d.help, d.labels, registry=registry)
    if d.kind == "histogram":
        return Histogram(d.name, d.help, d.labels, registry=registry, buckets=d.buckets)
    raise ValueError(f"{d.name}: unknown kind {d.kind!r}")
