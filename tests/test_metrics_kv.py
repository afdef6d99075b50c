"""KV page metrics: page states read from the allocator, frees and pins by reason counted
where the free log records them. A story with exact page ids, then a Hypothesis state
machine (the KvCache machine of test_kv_cache_properties) whose every step checks the
page-state gauges against its model and whose end checks every counter against the free
log's replay."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis.stateful import invariant

from common.host import HostTier
from common.kv import KvCache
from common.metrics import NodeMetrics, render
from tests.metrics_helpers import assert_counters_match_log, by, freelog_counts, parse
from tests.test_kv_cache_properties import SlidingWindowMachine

POOL = ("tier", "pool")


def _scrape(m: NodeMetrics):
    return parse(render(m.collect)[0].decode())


def _states(samples, tier="device", pool="full") -> dict[str, float]:
    return {k[0]: v for k, v in by(samples, "pdkv_kv_pages", ("state",), tier=tier,
                                   pool=pool).items()}


def test_page_states_and_reasons_follow_a_request_story(tmp_path):
    log = tmp_path / "story.freelog"
    cache = KvCache(10, 4, log_path=log, node="story")
    m = NodeMetrics("decode")
    m.watch_pools("device", cache.pool_stats)
    r1, r2 = cache.open_row("r1"), cache.open_row("r2")
    cache.extend(r1, 12)   # pages 1 2 3
    cache.extend(r2, 8)    # pages 4 5
    send = cache.pin(r1, 0, 8, reason="send")           # 1 2 pinned
    s = _scrape(m)
    assert _states(s) == {"free": 4, "owned": 3, "pinned": 2, "pending": 0, "reserved": 1}
    assert by(s, "pdkv_kv_held_pages", ("owner_kind",)) == {("request",): 5}
    assert by(s, "pdkv_kv_usage_ratio", POOL) == {("device", "full"): 5 / 9}

    cache.free_kv_row(r1, [(0, 12)], reason="sent")     # 1 2 pending, 3 free
    cache.handoff(r2, 8, "cache:prefix")                # 4 5 to the cache
    offload = cache.pin_pages(np.array([4], np.int32), reason="offload")
    s = _scrape(m)
    assert _states(s) == {"free": 5, "owned": 1, "pinned": 1, "pending": 2, "reserved": 1}
    assert by(s, "pdkv_kv_held_pages", ("owner_kind",)) == {("request",): 0,
                                                            ("cache:prefix",): 2}

    cache.unpin(send)                                   # 1 2 released
    cache.free_pages("cache:prefix", np.array([4, 5], np.int32), reason="evicted")
    cache.unpin(offload)                                # 4 released
    s = _scrape(m)
    assert _states(s) == {"free": 9, "owned": 0, "pinned": 0, "pending": 0, "reserved": 1}
    assert by(s, "pdkv_kv_frees_total", ("reason",)) == {("sent",): 1, ("evicted",): 1}
    assert by(s, "pdkv_kv_freed_pages_total", ("reason",)) == {("sent",): 3, ("evicted",): 2}
    assert by(s, "pdkv_kv_pins_total", ("reason",)) == {("send",): 1, ("offload",): 1}
    assert by(s, "pdkv_kv_pinned_pages_total", ("reason",)) == {("send",): 2, ("offload",): 1}
    assert by(s, "pdkv_kv_released_pages_total", POOL) == {("device", "full"): 3}
    assert by(s, "pdkv_kv_handed_off_pages_total", POOL) == {("device", "full"): 2}
    assert by(s, "pdkv_kv_allocated_pages_total", POOL) == {("device", "full"): 5}
    assert by(s, "pdkv_kv_unpins_total", POOL) == {("device", "full"): 2}
    for kv in (r1, r2):
        cache.close_row(kv)
    cache.close()
    _assert_counters_match_log(s, freelog_counts(log), "device")


def test_host_tier_pages_show_as_their_own_tier(tmp_path):
    host = HostTier(6, 4, log_path=tmp_path / "host.freelog", node="h")
    m = NodeMetrics("decode")
    m.watch_pools("host", lambda: [host.pool_stats()])
    pages = host.allocate(3)
    pin = host.pin(pages[:1], reason="load")
    host.free(pages, "cache:host", reason="evicted")
    s = _scrape(m)
    assert _states(s, "host", "host") == {"free": 4, "owned": 0, "pinned": 0, "pending": 1,
                                          "reserved": 1}
    host.unpin(pin)
    s = _scrape(m)
    assert _states(s, "host", "host")["free"] == 5
    host.close()
    _assert_counters_match_log(s, freelog_counts(tmp_path / "host.freelog"), "host")


def test_a_failing_pool_source_does_not_break_the_scrape():
    m = NodeMetrics("prefill")

    def broken():
        raise RuntimeError("pool gone")

    m.watch_pools("device", broken)
    cache = KvCache(4, 2)
    m.watch_pools("host", cache.pool_stats)
    s = _scrape(m)
    assert _states(s, "host", "full")["free"] == 3
    assert not by(s, "pdkv_kv_pages", ("state",), tier="device")


def _assert_counters_match_log(samples, pools: dict, tier: str) -> None:
    assert_counters_match_log(samples, pools, tier=tier)


class MetricsMachine(SlidingWindowMachine):
    """The KvCache machine, watched: gauges follow the model at every step, counters end
    equal to the free log's."""

    def __init__(self):
        super().__init__()
        self.metrics = NodeMetrics("decode")
        self.metrics.watch_pools("device", self.cache.pool_stats)

    @invariant()
    def page_states_match_the_model(self):
        s = _scrape(self.metrics)
        for pool, size in self.sizes.items():
            owned = set(self.model.owner[pool])
            pinned = {p for p, n in self.model.pins[pool].items() if n}
            assert _states(s, pool=pool) == {
                "free": self.model.num_free(pool, size), "owned": len(owned - pinned),
                "pinned": len(owned & pinned), "pending": len(pinned - owned),
                "reserved": 1}, pool

    def teardown(self):
        try:
            for owner in list(self.open):
                self.finish(owner)
            for pin_id in list(self.model.pin_pages):
                self.unpin(pin_id)
            self.cache.close()
            _assert_counters_match_log(_scrape(self.metrics), freelog_counts(self.log),
                                       "device")
        finally:
            self.tmp.cleanup()


TestMetricsMachine = MetricsMachine.TestCase
TestMetricsMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
