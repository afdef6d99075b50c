"""Reading metrics the way Prometheus does (text over HTTP, the official parser), and the
free log's own counts to compare them with."""

from __future__ import annotations

import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

from common.freelog import replay_file


def parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``{sample name: [(labels, value), ...]}`` of an exposition in the text format."""
    out: dict[str, list] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append((dict(s.labels), s.value))
    return dict(out)


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        assert resp.status == 200, resp.status
        return parse(resp.read().decode())


def by(samples, name: str, keys: tuple[str, ...], **where: str) -> dict[tuple, float]:
    """Values of series ``name`` whose labels match ``where``, keyed by ``keys``' values."""
    out = {}
    for labels, value in samples.get(name, []):
        if all(labels.get(k) == v for k, v in where.items()):
            out[tuple(labels[k] for k in keys)] = value
    return out


def freelog_counts(path) -> dict[str, dict]:
    """Per pool, what replaying the log counts: frees and pins by reason, events, pages,
    and pages in use at the end. The log must replay clean."""
    report = replay_file(path)
    assert report.ok, [v.format() for v in report.violations[:5]]
    return report.pools


def assert_counters_match_log(samples, pools: dict, **where: str) -> None:
    """Every kv counter of the series matching ``where`` (tier, worker) equals what
    replaying the free log counted, pool by pool, and the pages in use at the end too."""
    for pool, st in pools.items():
        at = {**where, "pool": pool}
        frees = by(samples, "pdkv_kv_frees_total", ("reason",), **at)
        pages = by(samples, "pdkv_kv_freed_pages_total", ("reason",), **at)
        assert frees == {(r,): c["events"] for r, c in st["frees_by_reason"].items()}, at
        assert pages == {(r,): c["pages"] for r, c in st["frees_by_reason"].items()}, at
        pins = by(samples, "pdkv_kv_pins_total", ("reason",), **at)
        assert pins == {(r,): n for r, n in st["pins_by_reason"].items()}, at
        one = {"pdkv_kv_allocated_pages_total": st["pages_allocated"],
               "pdkv_kv_released_pages_total": st["pages_released"],
               "pdkv_kv_handed_off_pages_total": st["pages_handed_off"],
               "pdkv_kv_unpins_total": st["events"]["unpin"]}
        for name, expected in one.items():
            assert by(samples, name, (), **at) == {(): expected}, (at, name)
        states = by(samples, "pdkv_kv_pages", ("state",), **at)
        in_use = sum(v for (state,), v in states.items() if state not in ("free", "reserved"))
        assert in_use == st["in_use_at_end"], (at, states)
