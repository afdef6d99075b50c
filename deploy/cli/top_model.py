"""What ``pdkv top`` shows, computed from two scrapes: per worker rows and rates.

A ``Scrape`` is the deployment's samples at one instant (from the router over the control
plane, or from a ``/metrics`` URL); ``view(now, before)`` turns it into ``TopView``
rows, with rates over the interval since ``before`` (none on the first frame).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.core import Metric

Samples = dict[str, list[tuple[dict[str, str], float]]]


@dataclass
class Scrape:
    """Samples by series name at monotonic time ``t``."""

    t: float
    samples: Samples

    @classmethod
    def of(cls, families: Iterable[Metric], t: float) -> Scrape:
        samples: Samples = defaultdict(list)
        for family in families:
            for s in family.samples:
                samples[s.name].append((dict(s.labels), s.value))
        return cls(t, dict(samples))

    def values(self, name: str, **where: str) -> list[tuple[dict[str, str], float]]:
        # every rank of a tensor-parallel worker holds the same page ids: its pages are
        # rank 0's (the other ranks' pool series would count them again)
        lead = name.startswith("pdkv_kv_")
        return [(labels, v) for labels, v in self.samples.get(name, [])
                if all(labels.get(k) == val for k, val in where.items())
                and not (lead and labels.get("rank", "0") != "0")]

    def total(self, name: str, **where: str) -> float:
        return sum(v for _, v in self.values(name, **where))


@dataclass
class WorkerRow:
    name: str
    role: str
    up: bool
    device: dict[str, float] = field(default_factory=dict)   # pages by state, device pools
    host_used: float = 0.0
    host_capacity: float = 0.0
    running: float = 0.0
    queues: dict[str, float] = field(default_factory=dict)
    in_flight: float = 0.0
    paths: dict[str, str] = field(default_factory=dict)      # peer -> data path
    tokens_per_s: float | None = None
    kv_bytes_per_s: float | None = None
    freed_pages_per_s: float | None = None

    @property
    def device_capacity(self) -> float:
        return sum(v for k, v in self.device.items() if k != "reserved")


@dataclass
class TopView:
    workers: list[WorkerRow]
    in_flight: float
    ttft_p50: float | None
    ttft_p99: float | None
    tokens_per_s: float | None
    frees_by_reason: dict[str, tuple[float, float | None]]   # reason -> (pages, pages/s)
    source: str = ""
    error: str = ""


def view(now: Scrape, before: Scrape | None, source: str = "") -> TopView:
    dt = now.t - before.t if before is not None else 0.0
    names = _workers(now)
    rows = [_row(now, before, dt, name, role, up) for name, (role, up) in sorted(names.items())]
    ttft = _delta_buckets(now, before, "pdkv_ttft_seconds")
    rates = [r.tokens_per_s for r in rows if r.tokens_per_s is not None]
    return TopView(rows, now.total("pdkv_requests_in_flight"), quantile(0.5, ttft),
                   quantile(0.99, ttft), sum(rates) if rates else None,
                   _frees(now, before, dt), source)


def _workers(now: Scrape) -> dict[str, tuple[str, bool]]:
    """worker -> (role, up): those the router reports, and any that sent samples."""
    out = {labels["worker"]: (labels.get("role", "?"), v >= 1)
           for labels, v in now.values("pdkv_worker_up") if "worker" in labels}
    for labels, _ in now.values("pdkv_kv_pages"):
        name = labels.get("worker")
        if name and name not in out:
            out[name] = (labels.get("role", "?"), True)
    out.pop("router", None)
    return out


def _row(now: Scrape, before: Scrape | None, dt: float, name: str, role: str,
         up: bool) -> WorkerRow:
    row = WorkerRow(name, role, up)
    for labels, v in now.values("pdkv_kv_pages", worker=name, tier="device"):
        row.device[labels["state"]] = row.device.get(labels["state"], 0.0) + v
    host = {labels["state"]: v
            for labels, v in now.values("pdkv_kv_pages", worker=name, tier="host")}
    row.host_capacity = now.total("pdkv_kv_capacity_pages", worker=name, tier="host")
    row.host_used = row.host_capacity - host.get("free", 0.0) if host else 0.0
    row.running = now.total("pdkv_running_requests", worker=name)
    row.queues = {labels["queue"]: v for labels, v in
                  now.values("pdkv_queue_requests", worker=name)}
    row.in_flight = now.total("pdkv_transfer_in_flight", worker=name)
    row.paths = {labels["peer"]: labels["path"] for labels, v in
                 now.values("pdkv_transfer_data_path", worker=name) if v >= 1}
    if before is not None and dt > 0:
        row.tokens_per_s = _rate(now, before, dt, "pdkv_generation_tokens_total", worker=name)
        row.kv_bytes_per_s = _rate(now, before, dt, "pdkv_transfer_bytes_total", worker=name)
        row.freed_pages_per_s = _rate(now, before, dt, "pdkv_kv_freed_pages_total",
                                      worker=name)
    return row


def _rate(now: Scrape, before: Scrape, dt: float, name: str, **where: str) -> float:
    # a counter that went down restarted (a worker came back): count from zero
    delta = now.total(name, **where) - before.total(name, **where)
    return (delta if delta >= 0 else now.total(name, **where)) / dt


def _frees(now: Scrape, before: Scrape | None, dt: float
           ) -> dict[str, tuple[float, float | None]]:
    totals: dict[str, float] = defaultdict(float)
    for labels, v in now.values("pdkv_kv_freed_pages_total"):
        totals[labels["reason"]] += v
    out = {}
    for reason, total in sorted(totals.items()):
        rate = None
        if before is not None and dt > 0:
            rate = _rate(now, before, dt, "pdkv_kv_freed_pages_total", reason=reason)
        out[reason] = (total, rate)
    return out


def _delta_buckets(now: Scrape, before: Scrape | None, name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of a histogram over the interval, or over all time
    when there was no earlier scrape or nothing happened in between."""
    def buckets(scrape: Scrape) -> dict[float, float]:
        out: dict[float, float] = defaultdict(float)
        for labels, v in scrape.values(f"{name}_bucket"):
            out[float(labels["le"])] += v
        return out

    cur = buckets(now)
    if before is not None:
        old = buckets(before)
        delta = {le: n - old.get(le, 0.0) for le, n in cur.items()}
        if delta and max(delta.values()) > 0 and min(delta.values()) >= 0:
            cur = delta
    return sorted(cur.items())


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over (le, cumulative count) pairs."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, prev_le, prev_n = q * buckets[-1][1], 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_n) / (n - prev_n) if n > prev_n
                                               else 0.0)
        prev_le, prev_n = le, n
    return prev_le
