"""``pdkv top`` rendered headless: two scrapes of real registries (a decode with a device
pool and a host tier, a prefill whose shared memory was refused, the router), one frame
drawn to a recording console, its text checked cell by cell."""

from __future__ import annotations

import pytest

pytest.importorskip("rich")

from rich.console import Console  # noqa: E402

from common.host import HostTier  # noqa: E402
from common.kv import KvCache  # noqa: E402
from common.metrics import Gatherer, NodeMetrics, to_wire  # noqa: E402
from deploy.cli.top_model import Scrape, quantile, view  # noqa: E402
from deploy.cli.top_view import render  # noqa: E402


class Deployment:
    """A router gathering two workers' registries, as it does over the control plane."""

    def __init__(self) -> None:
        self.router = NodeMetrics("router")
        self.gatherer = Gatherer(self.router)
        self.decode, self.prefill = NodeMetrics("decode"), NodeMetrics("prefill")
        self.dcache, self.pcache = KvCache(101, 4), KvCache(51, 4)
        self.host = HostTier(41, 4)
        self.decode.watch_pools("device", self.dcache.pool_stats)
        self.decode.watch_pools("host", lambda: [self.host.pool_stats()])
        self.prefill.watch_pools("device", self.pcache.pool_stats)
        self.workers = {"decode0": ("decode", self.decode),
                        "prefill0": ("prefill", self.prefill)}

    def scrape(self, t: float) -> Scrape:
        for name, (role, m) in self.workers.items():
            if name in self.gone:
                self.gatherer.lost(name, role)
            else:
                self.gatherer.report(name, role, to_wire(m.collect()))
        return Scrape.of(self.gatherer.collect(), t)

    gone: frozenset[str] = frozenset()


def _text(frame, width: int = 220) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(frame)
    return console.export_text()


def _line(text: str, start: str) -> list[str]:
    lines = [ln for ln in text.splitlines() if ln.startswith(start)]
    assert len(lines) == 1, (start, text)
    return lines[0].split()


def test_one_frame_shows_every_worker_its_pages_queues_paths_and_rates():
    d = Deployment()
    d.router.gauge("pdkv_requests_in_flight").set(3)
    before = d.scrape(t=10.0)
    rows = [d.dcache.open_row(f"r{i}") for i in range(3)]
    for kv in rows:
        d.dcache.extend(kv, 40)                       # 10 pages each: 30 owned
    pin = d.dcache.pin(rows[0], 0, 16, reason="receive")   # 4 of them pinned
    d.dcache.free_kv_row(rows[1], [(0, 40)], reason="finished")
    d.host.allocate(8)
    d.decode.gauge("pdkv_running_requests").set(2)
    d.decode.gauge("pdkv_queue_requests").labels(queue="admission").set(5)
    d.decode.gauge("pdkv_queue_requests").labels(queue="retracted").set(1)
    d.decode.counter("pdkv_generation_tokens_total").inc(300)
    d.decode.counter("pdkv_transfer_bytes_total").labels(direction="received").inc(4e6)
    d.decode.gauge("pdkv_transfer_in_flight").labels(direction="received").set(1)
    d.decode.gauge("pdkv_transfer_data_path").labels(peer="prefill0", path="tcp").set(1)
    d.prefill.gauge("pdkv_transfer_data_path").labels(peer="decode0", path="tcp").set(1)
    ttft = d.router.histogram("pdkv_ttft_seconds")
    for s in (0.02, 0.03, 0.04, 0.2):
        ttft.observe(s)
    now = d.scrape(t=12.0)

    text = _text(render(view(now, before, "router ipc:///r")))
    assert "2/2 workers up" in text and "in flight 3" in text
    assert "150 tok/s" in text                        # 300 tokens over 2 s
    dec = _line(text, "decode0")
    # worker role up bar use% owned pinned pending free host run queued retracted xfer path
    assert dec[1:3] == ["decode", "up"]
    assert dec[3] == "█████" + "·" * 19               # 16 owned + 4 pinned of 100, 24 cells
    assert dec[4] == "20%"
    assert dec[5:15] == ["16", "4", "0", "80", "8/40", "2", "5", "1", "1", "tcp"], dec
    assert dec[15:18] == ["150", "2", "5"], dec     # tok/s, KV MB/s, freed pages/s
    pre = _line(text, "prefill0")
    assert pre[5:9] == ["0", "0", "0", "50"] and pre[14] == "tcp", pre
    assert _line(text, "finished")[1:] == ["10", "5"]
    d.dcache.unpin(pin)


def test_a_lost_worker_is_marked_and_its_rows_are_empty():
    d = Deployment()
    d.scrape(t=0.0)
    d.gone = frozenset({"prefill0"})
    text = _text(render(view(d.scrape(t=1.0), None, "x")))
    assert "1/2 workers up" in text
    pre = _line(text, "prefill0")
    assert pre[2] == "LOST" and pre[3] == "-"


def test_a_tensor_parallel_worker_shows_its_pages_once_and_every_ranks_bytes():
    """Rank 0 reports its follower's families labelled by rank (WorkerMetrics.report):
    pages (the same ids on every rank) count once, bytes of every rank add up."""
    from common.control import Load
    from common.metrics import loads, pack
    from common.node.worker_metrics import WorkerMetrics

    gatherer = Gatherer(NodeMetrics("router"))
    ranks = []
    for _ in range(2):
        cache = KvCache(51, 4)
        kv = cache.open_row("r0")
        cache.extend(kv, 40)                     # 10 pages on each rank
        ranks.append((cache, WorkerMetrics("decode", lambda: [])))
        ranks[-1][1].watch(_cfg(), cache)
    lead, follower = ranks[0][1], ranks[1][1]
    follower.metrics.counter("pdkv_transfer_bytes_total").labels(direction="received").inc(
        3e6)
    lead.metrics.counter("pdkv_transfer_bytes_total").labels(direction="received").inc(1e6)

    def scrape(t: float) -> Scrape:
        report = lead.report("decode0", Load("decode0", 0, 0, 0), False,
                             [pack(follower.metrics.collect())])
        gatherer.report("decode0", "decode", loads(report.families))
        return Scrape.of(gatherer.collect(), t)

    before = scrape(0.0)
    for m, n in ((lead, 1e6), (follower, 3e6)):
        m.metrics.counter("pdkv_transfer_bytes_total").labels(direction="received").inc(n)
    now = scrape(1.0)
    assert {lb["rank"] for lb, _ in now.values("pdkv_transfer_bytes_total")} == {"0", "1"}
    (row,) = view(now, before).workers
    assert row.device["owned"] == 10 and row.kv_bytes_per_s == 4e6, row


def _cfg():
    from common.config import ServeConfig

    return ServeConfig()


def test_quantile_matches_prometheus_histogram_quantile():
    buckets = [(0.1, 2.0), (0.2, 6.0), (0.4, 8.0), (float("inf"), 8.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.15)    # rank 4: halfway in (0.1, 0.2]
    assert quantile(0.25, buckets) == pytest.approx(0.1)
    assert quantile(1.0, buckets) == pytest.approx(0.4)
    assert quantile(0.5, []) is None
    assert quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


def test_once_draws_a_frame_with_rates_and_a_failed_read_is_an_answer_not_a_traceback():
    from deploy.cli.top_view import run

    d = Deployment()
    scrapes = iter([d.scrape(t=1.0), None])

    def read():
        snap = next(scrapes)
        if snap is None:   # the second read: pages moved and tokens came meanwhile
            d.decode.counter("pdkv_generation_tokens_total").inc(50)
            return d.scrape(t=1.5)
        return snap

    console = Console(record=True, width=220, color_system=None)
    assert run(read, "test", interval_s=0.01, once=True, console=console) == 0
    assert _line(console.export_text(), "decode0")[15] == "100"   # 50 tokens in 0.5 s

    def broken():
        raise OSError("connection refused")

    console = Console(record=True, width=220, color_system=None)
    assert run(broken, "http://x/metrics", once=True, console=console) == 1
    assert "cannot read http://x/metrics: connection refused" in console.export_text()
