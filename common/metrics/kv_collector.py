"""KV page metrics read from the allocators at scrape time.

Nothing is counted here: page states come from one vectorised pass over the allocator's
arrays and the frees and pins by reason from the counters that ``PageAllocator`` bumps in
the same call that writes the free log's event. A scrape therefore shows exactly what the
free log records, and the serving hot path pays only two integer additions per event.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from common.kv import PAGE_STATES, PoolStats
from common.metrics.catalogue import metric

logger = logging.getLogger(__name__)

# A source answers the current stats of its pools (KvCache.pool_stats, or a host tier's
# pool_stats wrapped in a list), read under the pool owner's lock.
StatsSource = Callable[[], Iterable[PoolStats]]

# (family, counted op, by reason?, events or pages)
_COUNTERS = (("pdkv_kv_frees_total", "free", True, 0),
             ("pdkv_kv_freed_pages_total", "free", True, 1),
             ("pdkv_kv_pins_total", "pin", True, 0),
             ("pdkv_kv_pinned_pages_total", "pin", True, 1),
             ("pdkv_kv_unpins_total", "unpin", False, 0),
             ("pdkv_kv_allocated_pages_total", "alloc", False, 1),
             ("pdkv_kv_released_pages_total", "release", False, 1),
             ("pdkv_kv_handed_off_pages_total", "handoff", False, 1))


class KvCollector:
    """A Prometheus collector over the pools of one process, by tier (device, host)."""

    def __init__(self) -> None:
        self._sources: list[tuple[str, StatsSource]] = []

    def watch(self, tier: str, source: StatsSource) -> None:
        """Add pools to expose; ``source()`` is called at every scrape."""
        self._sources.append((tier, source))

    def unwatch_all(self) -> None:
        self._sources.clear()

    def read(self) -> list[tuple[str, PoolStats]]:
        """(tier, stats) of every watched pool; a failing source is logged and skipped."""
        out = []
        for tier, source in list(self._sources):
            try:
                out.extend((tier, stats) for stats in source())
            except Exception:  # a scrape must never take the process down
                logger.exception("metrics: reading %s pools failed", tier)
        return out

    def collect(self) -> Iterator[Metric]:
        # a process without pools (the router) exposes no empty kv families
        return iter(families(self.read()) if self._sources else [])


def families(pools: list[tuple[str, PoolStats]]) -> list[Metric]:
    """The ``kv`` families of the catalogue for these pools."""
    labels = ["tier", "pool"]
    pages = _gauge("pdkv_kv_pages", [*labels, "state"])
    held = _gauge("pdkv_kv_held_pages", [*labels, "owner_kind"])
    capacity = _gauge("pdkv_kv_capacity_pages", labels)
    usage = _gauge("pdkv_kv_usage_ratio", labels)
    counters = {name: CounterMetricFamily(name.removesuffix("_total"), metric(name).help,
                                          labels=labels + (["reason"] if by_reason else []))
                for name, _, by_reason, _ in _COUNTERS}
    for tier, stats in pools:
        where = [tier, stats.name]
        for state in PAGE_STATES:
            pages.add_metric([*where, state], stats.states.get(state, 0))
        # request rows always show, so that a stacked panel keeps its series at zero
        for kind, n in sorted({"request": 0, **stats.owner_kinds}.items()):
            held.add_metric([*where, kind], n)
        capacity.add_metric(where, stats.usable)
        usage.add_metric(where, stats.usage)
        _add_counters(counters, where, stats)
    return [pages, held, capacity, usage, *counters.values()]


def _add_counters(counters: dict[str, CounterMetricFamily], where: list[str],
                  stats: PoolStats) -> None:
    for name, op, by_reason, column in _COUNTERS:
        family = counters[name]
        if by_reason:
            for (got_op, reason), counts in sorted(stats.counts.items()):
                if got_op == op:
                    family.add_metric([*where, reason], counts[column])
        else:
            family.add_metric(where, stats.counts.get((op, ""), (0, 0))[column])


def _gauge(name: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, metric(name).help, labels=labels)
