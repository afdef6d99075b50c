"""The wire form the router gathers (checked, merged by worker) and the HTTP exposition,
read back with Prometheus' own text parser over real HTTP."""

from __future__ import annotations

import gzip
import threading
import urllib.error
import urllib.request

import msgpack
import pytest

from common.kv import KvCache
from common.metrics import (
    Gatherer,
    MetricsServer,
    NodeMetrics,
    WireError,
    from_wire,
    merge,
    render,
    to_wire,
)
from tests.metrics_helpers import by, parse, scrape


def _worker(free_reason: str = "finished") -> tuple[NodeMetrics, KvCache]:
    cache = KvCache(8, 4)
    m = NodeMetrics("decode")
    m.watch_pools("device", cache.pool_stats)
    kv = cache.open_row("r")
    cache.extend(kv, 6)
    cache.free_kv_row(kv, [(4, 6)], reason=free_reason)
    return m, cache


def _over_the_wire(m: NodeMetrics):
    return from_wire(msgpack.unpackb(msgpack.packb(to_wire(m.collect()), use_bin_type=True),
                                     raw=False))


def test_the_router_gathers_reports_into_one_family_per_name_labelled_by_worker():
    (a, _), (b, _) = _worker("finished"), _worker("aborted")
    router = NodeMetrics("router")
    router.gauge("pdkv_requests_in_flight").set(2)
    gatherer = Gatherer(router)
    gatherer.report("d0", "decode", msgpack.unpackb(msgpack.packb(to_wire(a.collect()))))
    gatherer.report("d1", "decode", to_wire(b.collect()))
    merged = gatherer.collect()
    names = [f.name for f in merged]
    assert len(names) == len(set(names))
    s = parse(render(gatherer.collect)[0].decode())
    assert by(s, "pdkv_kv_frees_total", ("worker", "reason")) == {
        ("d0", "finished"): 1, ("d1", "aborted"): 1}
    assert by(s, "pdkv_kv_pages", ("worker",), state="owned") == {("d0",): 1, ("d1",): 1}
    assert by(s, "pdkv_worker_up", ("worker", "role")) == {("d0", "decode"): 1,
                                                           ("d1", "decode"): 1}
    assert by(s, "pdkv_requests_in_flight", ("worker", "role")) == {("router", "router"): 2}
    assert all(v >= 0 for v in by(s, "pdkv_worker_metrics_age_seconds", ("worker",)).values())


def test_a_lost_worker_keeps_only_up_zero_and_a_clean_goodbye_keeps_its_counters():
    (a, _), (b, _) = _worker("finished"), _worker("aborted")
    gatherer = Gatherer(NodeMetrics("router"))
    gatherer.report("d0", "decode", to_wire(a.collect()))
    gatherer.report("d1", "decode", to_wire(b.collect()), final=True)
    with pytest.raises(WireError):
        gatherer.report("d0", "decode", [["evil", "gauge", "", []]])
    gatherer.lost("d0", "decode")
    gatherer.lost("d1", "decode")
    s = parse(render(gatherer.collect)[0].decode())
    assert by(s, "pdkv_worker_up", ("worker",)) == {("d0",): 0, ("d1",): 0}
    assert by(s, "pdkv_kv_frees_total", ("worker", "reason")) == {("d1", "aborted"): 1}
    assert gatherer.workers() == {"d0": False, "d1": False}


def test_a_worker_cannot_speak_for_another():
    m, _ = _worker()
    forged = to_wire(m.collect())
    for family in forged:
        for sample in family[3]:
            sample[1]["worker"] = "d9"
    merged = merge([({"worker": "d0", "role": "decode"}, from_wire(forged))])
    workers = {s.labels["worker"] for f in merged for s in f.samples}
    assert workers == {"d0"}


@pytest.mark.parametrize("report, words", [
    ({"not": "a list"}, "list of at most"),
    ([["pdkv_x", "gauge", "h"]], "need [name, type, help, samples]"),
    ([["evil_x", "gauge", "h", []]], "must match"),
    ([["pdkv_x", "bogus", "h", []]], "bad type"),
    ([["pdkv_x", "gauge", "h", [["other_y", {}, 1]]]], "outside the family"),
    ([["pdkv_x", "gauge", "h", [["pdkv_x", {"a": 1}, 1]]]], "labels must map"),
    ([["pdkv_x", "gauge", "h", [["pdkv_x", {"bad-name": "v"}, 1]]]], "labels must map"),
    ([["pdkv_x", "gauge", "h", [["pdkv_x", {}, "1"]]]], "not a number"),
    ([["pdkv_x", "gauge", "h", [["pdkv_x", {}, float("nan")]]]], "NaN"),
    ([["pdkv_x", "gauge", "h", [["pdkv_x", {}, 1.0]] * 50_001]], "more than"),
])
def test_a_bad_report_is_refused_with_words(report, words):
    with pytest.raises(WireError, match=words.replace("[", r"\[").replace("]", r"\]")):
        from_wire(report)


def test_http_server_serves_text_openmetrics_and_gzip():
    m, _ = _worker()
    server = MetricsServer(m.collect)
    try:
        s = scrape(server.url)
        assert by(s, "pdkv_kv_pages", ("state",))[("owned",)] == 1
        req = urllib.request.Request(server.url, headers={
            "Accept": "application/openmetrics-text; version=1.0.0",
            "Accept-Encoding": "gzip"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.headers["Content-Encoding"] == "gzip"
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            body = gzip.decompress(resp.read()).decode()
        assert body.rstrip().endswith("# EOF")
        for path, code in (("/", 404), ("/other", 404)):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=10)
            assert err.value.code == code
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(server.url, data=b"x"), timeout=10)
        assert err.value.code == 405
    finally:
        server.close()


def test_a_collect_that_fails_answers_500_and_the_server_keeps_serving():
    calls = []

    def collect():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        router = NodeMetrics("router")
        router.gauge("pdkv_requests_in_flight").set(1)
        return router.collect()

    server = MetricsServer(collect)
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(server.url, timeout=10)
        assert err.value.code == 500
        assert "pdkv_requests_in_flight" in scrape(server.url)
    finally:
        server.close()


def test_concurrent_scrapes_while_pages_move_all_parse():
    m, cache = _worker()
    server = MetricsServer(m.collect)
    stop, errors = threading.Event(), []

    def churn():
        i = 0
        while not stop.is_set():
            kv = cache.open_row(f"c{i}")
            cache.extend(kv, 5)
            cache.free_kv_row(kv, [(0, 5)], reason="finished")
            cache.close_row(kv)
            i += 1

    def scraper():
        try:
            for _ in range(20):
                s = scrape(server.url)
                states = by(s, "pdkv_kv_pages", ("state",))
                assert sum(states.values()) == 8, states  # one consistent reading
        except Exception as exc:  # reported below, in the test's thread
            errors.append(exc)

    worker = threading.Thread(target=churn)
    scrapers = [threading.Thread(target=scraper) for _ in range(4)]
    worker.start()
    for t in scrapers:
        t.start()
    for t in scrapers:
        t.join(timeout=120)
    stop.set()
    worker.join(timeout=30)
    server.close()
    assert not errors, errors[:3]
    s = parse(render(m.collect)[0].decode())
    assert by(s, "pdkv_kv_frees_total", ("reason",))[("finished",)] >= 2


def test_read_values_appear_and_a_broken_reader_blanks_only_itself():
    m = NodeMetrics("decode")
    m.read(lambda: [("pdkv_transfer_bytes_total", {"direction": "received"}, 42),
                    ("pdkv_queue_requests", {"queue": "admission"}, 3)])

    def broken():
        raise RuntimeError("transport gone")

    m.read(broken)
    m.counter("pdkv_generation_tokens_total").inc(5)
    m.read(lambda: [("pdkv_generation_tokens_total", {}, 1)])   # also an object: refused
    s = parse(render(m.collect)[0].decode())
    assert by(s, "pdkv_transfer_bytes_total", ("direction",)) == {("received",): 42}
    assert by(s, "pdkv_queue_requests", ("queue",)) == {("admission",): 3}
    assert by(s, "pdkv_generation_tokens_total", ()) == {(): 5}


def test_a_process_refuses_metrics_of_another_role():
    with pytest.raises(KeyError, match="router metric"):
        NodeMetrics("decode").histogram("pdkv_ttft_seconds")
    with pytest.raises(TypeError, match="is a counter"):
        NodeMetrics("decode").gauge("pdkv_kv_frees_total")
    with pytest.raises(ValueError, match="allowed"):
        NodeMetrics("cook")
