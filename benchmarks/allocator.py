"""``pdkv bench allocator``: the KV memory core against naive baselines, in one run.

1. ``free_kv_row`` of one 128k-token row (committed part and speculative tail as two
   ranges) at page sizes 1, 16 and 64, against a naive allocator that walks the row slot
   by slot in Python. Goal: at least 50x faster at page size 16.
2. Recording overhead: the same request workload (open, prefill extend, decode extends,
   pin/unpin around a send, free, close) with and without a free log. Goal: at most 1.3x.

Every figure is the median of ``--repeats`` runs.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from common import KvCache, ceil_align

ROW_TOKENS = 128 * 1024


class NaiveAllocator:
    """The baseline: Python lists and dicts, one loop iteration per slot."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.free_list = list(range(num_pages - 1, 0, -1))
        self.owner: dict[int, str] = {}

    def allocate_row(self, owner: str, num_tokens: int) -> list[int]:
        slots = []
        for pos in range(num_tokens):
            if pos % self.page_size == 0:
                page = self.free_list.pop()
                self.owner[page] = owner
            slots.append(page * self.page_size + pos % self.page_size)
        return slots

    def free_row(self, owner: str, slots: list[int], ranges: list[tuple[int, int]]) -> None:
        freed: set[int] = set()
        for start, end in ranges:
            for pos in range(start, end):
                page = slots[pos] // self.page_size
                if page in freed:
                    continue
                if self.owner.get(page) != owner:
                    raise ValueError(f"double free of page {page}")
                del self.owner[page]
                freed.add(page)
                self.free_list.append(page)


def _median_time(setup, timed, repeats: int, teardown=lambda state: None) -> float:
    """Median seconds of ``timed(state)`` over fresh ``setup()`` states."""
    times = []
    for _ in range(repeats):
        state = setup()
        t0 = time.perf_counter()
        timed(state)
        times.append(time.perf_counter() - t0)
        teardown(state)
    return statistics.median(times)


def bench_free_kv_row(page_size: int, repeats: int) -> dict:
    num_pages = ROW_TOKENS // page_size + 2
    committed, allocated = ROW_TOKENS - 40, ROW_TOKENS
    tail = ceil_align(committed, page_size)
    ranges = [(0, tail), (tail, allocated)]  # committed part, speculative tail
    cache = KvCache(num_pages, page_size, max_rows=2)

    def setup_pdkv():
        kv = cache.open_row("r")
        cache.extend(kv, allocated)
        return kv

    def setup_naive():
        naive = NaiveAllocator(num_pages, page_size)
        return naive, naive.allocate_row("r", allocated)

    pdkv_s = _median_time(setup_pdkv, lambda kv: cache.free_kv_row(kv, ranges), repeats,
                          teardown=cache.close_row)
    naive_s = _median_time(setup_naive, lambda s: s[0].free_row("r", s[1], ranges), repeats)
    return {"page_size": page_size, "pdkv_ms": pdkv_s * 1e3, "naive_ms": naive_s * 1e3,
            "speedup": naive_s / pdkv_s}


def _request_workload(cache: KvCache, num_requests: int) -> None:
    for i in range(num_requests):
        kv = cache.open_row(f"req-{i}")
        cache.extend(kv, 300 + (i * 37) % 700)  # prefill
        pin = cache.pin(kv, 0, kv.allocated_len, reason="send")
        for _ in range(32):  # decode steps
            cache.extend(kv, 1)
        cache.commit(kv, kv.allocated_len)
        cache.unpin(pin)
        cache.free_kv_row(kv, [(0, kv.allocated_len)])
        cache.close_row(kv)


def bench_recording(num_requests: int, repeats: int) -> dict:
    events = 0

    def run(log_dir: str | None) -> float:
        nonlocal events
        log = None if log_dir is None else Path(log_dir) / "bench.pdkvlog"
        cache = KvCache(4096, 16, log_path=log)
        t0 = time.perf_counter()
        _request_workload(cache, num_requests)
        if cache.free_log is not None:
            events = cache.free_log.num_events
        cache.close()
        return time.perf_counter() - t0

    plain, recorded = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):  # interleaved, so machine noise hits both alike
            plain.append(run(None))
            recorded.append(run(tmp))
    p, r = statistics.median(plain), statistics.median(recorded)
    return {"requests": num_requests, "events": events, "plain_s": p, "recorded_s": r,
            "overhead": r / p}


def main(args) -> int:
    repeats = args.repeats or (3 if args.quick else 7)
    results = {"free_kv_row": [bench_free_kv_row(ps, repeats) for ps in (1, 16, 64)],
               "recording": bench_recording(1000 if args.quick else 3000, repeats)}
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"free_kv_row of a {ROW_TOKENS}-token row (median of {repeats}):")
    print(f"  {'page':>5} {'pdkv ms':>9} {'naive ms':>9} {'speedup':>8}")
    for r in results["free_kv_row"]:
        print(f"  {r['page_size']:>5} {r['pdkv_ms']:>9.3f} {r['naive_ms']:>9.1f} "
              f"{r['speedup']:>7.0f}x")
    rec = results["recording"]
    print(f"recording overhead, {rec['requests']} requests ({rec['events']} events): "
          f"{rec['plain_s']:.3f} s plain, {rec['recorded_s']:.3f} s recorded, "
          f"{rec['overhead']:.2f}x (goal <= 1.3x)")
    return 0


if __name__ == "__main__":
    import sys

    from deploy.cli import main as cli_main

    sys.exit(cli_main(["bench", "allocator", *sys.argv[1:]]))
