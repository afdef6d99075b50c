"""Metrics: one registry per process, KV page gauges read from the allocators, the
catalogue of every pdkv metric, the wire form the router gathers, the exposition."""

from common.metrics.catalogue import METRICS, MetricDef, family_of, metric
from common.metrics.exposition import MetricsServer, render, render_snapshot
from common.metrics.gather import Gatherer
from common.metrics.kv_collector import KvCollector
from common.metrics.node import NodeMetrics
from common.metrics.readings import abort_readings, host_readings, spec_readings, watch_host
from common.metrics.wire import WireError, from_wire, loads, merge, pack, to_wire

__all__ = ["METRICS", "Gatherer", "KvCollector", "MetricDef", "MetricsServer", "NodeMetrics",
           "WireError", "abort_readings", "family_of", "from_wire", "host_readings", "loads",
           "merge", "metric",
           "pack", "render", "render_snapshot", "spec_readings", "to_wire", "watch_host"]
