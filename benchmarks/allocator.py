"""``pdkv bench allocator``: the KV memory core against baselines, in one run.

1. ``free_kv_row`` of one 128k-token row (committed part and speculative tail as two
   ranges, recording to a free log) at page sizes 1, 16 and 64, against
   - a vectorised torch allocator in the style of sglang's paged allocator: the row is a
     slice of a ``req_to_token`` tensor of slot ids, its pages are ``slots // page_size``,
     ``torch.unique``'d and concatenated onto the free-page tensor (no checks, no
     recording). Goal: pdkv at least as fast (>= 1.0x) at page sizes 1 and 16;
   - a naive allocator that walks the row slot by slot in Python. Goal: >= 50x at 16.
2. Recording overhead: the same request workload (open, prefill extend, decode extends,
   pin/unpin around a send, free, close) with and without a free log. Goal: <= 1.3x.

Every figure is the median of ``--repeats`` runs; pdkv and its baselines alternate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.goals import EPILOG, Goals, add_bench_flags, run_as_script
from common import KvCache, ceil_align

ROW_TOKENS = 128 * 1024
TORCH_GOAL_PAGE_SIZES = (1, 16)


class TorchPagedAllocator:
    """The vectorised baseline, after sglang's ``PagedTokenToKVPoolAllocator``.

    ``req_to_token[row]`` holds the row's slot ids (int32, like sglang's
    ``ReqToTokenPool``); free pages are an int64 tensor. Freeing a range slices the row,
    turns slots into pages by integer division, dedups them with ``torch.unique`` and puts
    them in front of the free pages: what sglang's ``free`` does, without its free groups.
    """

    def __init__(self, num_pages: int, page_size: int, max_rows: int, max_row_len: int):
        self.page_size = page_size
        self.free_pages = torch.arange(1, num_pages, dtype=torch.int64)
        self.req_to_token = torch.zeros((max_rows, max_row_len), dtype=torch.int32)

    def allocate_row(self, row: int, num_tokens: int) -> None:
        need = -(-num_tokens // self.page_size)
        pages, self.free_pages = self.free_pages[:need], self.free_pages[need:]
        slots = pages[:, None] * self.page_size + torch.arange(self.page_size)
        self.req_to_token[row, :num_tokens] = slots.flatten()[:num_tokens].to(torch.int32)

    def free_row(self, row: int, ranges: list[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for start, end in ranges:  # touching ranges: one slice, as pdkv merges them
            if merged and merged[-1][1] == start:
                merged[-1][1] = end
            else:
                merged.append([start, end])
        for start, end in merged:
            slots = self.req_to_token[row, start:end]
            pages = torch.unique(slots // self.page_size)
            self.free_pages = torch.cat((pages, self.free_pages))


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


def bench_free_kv_row(page_size: int, repeats: int, log_dir: str) -> dict:
    num_pages = ROW_TOKENS // page_size + 2
    committed, allocated = ROW_TOKENS - 40, ROW_TOKENS
    tail = ceil_align(committed, page_size)
    ranges = [(0, tail), (tail, allocated)]  # committed part, speculative tail
    cache = KvCache(num_pages, page_size, max_rows=2,
                    log_path=Path(log_dir) / f"free_kv_row-{page_size}.freelog")

    def setup_pdkv():
        kv = cache.open_row("r")
        cache.extend(kv, allocated)
        return kv

    def setup_torch():
        alloc = TorchPagedAllocator(num_pages, page_size, 2, allocated)
        alloc.allocate_row(0, allocated)
        return alloc

    def setup_naive():
        naive = NaiveAllocator(num_pages, page_size)
        return naive, naive.allocate_row("r", allocated)

    pdkv, base = [], []
    for _ in range(repeats):  # interleaved, so machine noise hits both alike
        pdkv.append(_median_time(setup_pdkv, lambda kv: cache.free_kv_row(kv, ranges), 1,
                                 teardown=cache.close_row))
        base.append(_median_time(setup_torch, lambda a: a.free_row(0, ranges), 1))
    naive_s = _median_time(setup_naive, lambda s: s[0].free_row("r", s[1], ranges),
                           max(1, min(repeats, 3)))
    cache.close()
    pdkv_s, torch_s = statistics.median(pdkv), statistics.median(base)
    return {"page_size": page_size, "pdkv_ms": pdkv_s * 1e3, "torch_ms": torch_s * 1e3,
            "naive_ms": naive_s * 1e3, "vs_torch": torch_s / pdkv_s,
            "speedup": naive_s / pdkv_s,
            "pdkv_spread_ms": [min(pdkv) * 1e3, max(pdkv) * 1e3],
            "torch_spread_ms": [min(base) * 1e3, max(base) * 1e3]}


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


def judge(results: dict) -> Goals:
    goals = Goals("allocator")
    for r in results["free_kv_row"]:
        figures = dict(measured=f"pdkv {r['pdkv_ms']:.3f} ms recording",
                       baseline=f"torch {r['torch_ms']:.3f} ms")
        if r["page_size"] in TORCH_GOAL_PAGE_SIZES:
            goals.at_least(f"free_kv_row page {r['page_size']} vs torch", r["vs_torch"], 1.0,
                           **figures)
        if r["page_size"] == 16:
            goals.at_least("free_kv_row page 16 vs naive loop", r["speedup"], 50.0,
                           measured=figures["measured"],
                           baseline=f"naive {r['naive_ms']:.1f} ms")
    rec = results["recording"]
    goals.at_most("recording overhead", rec["overhead"], 1.3,
                  measured=f"recorded {rec['recorded_s']:.3f} s",
                  baseline=f"plain {rec['plain_s']:.3f} s")
    return goals


def main(args: argparse.Namespace) -> int:
    repeats = args.repeats or (3 if args.quick else 7)
    threads = torch.get_num_threads()
    # pdkv's free path is single-threaded numpy; torch on one thread too, so that
    # neither side pays for (or profits from) the other sessions on a shared machine
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            rows = [bench_free_kv_row(ps, repeats, tmp) for ps in (1, 16, 64)]
    finally:
        torch.set_num_threads(threads)
    results = {"repeats": repeats, "torch_threads": 1,
               "free_kv_row": rows,
               "recording": bench_recording(1000 if args.quick else 3000, repeats)}
    goals = judge(results)
    if args.json:
        print(json.dumps({**results, **goals.to_dict()}, indent=2))
        return goals.exit_status(args)
    print(f"free_kv_row of a {ROW_TOKENS}-token row, recording on (median of {repeats}; "
          f"torch on {results['torch_threads']} thread, like pdkv's numpy):")
    print(f"  {'page':>5} {'pdkv ms':>9} {'torch ms':>9} {'naive ms':>9} {'vs torch':>9} "
          f"{'vs naive':>9}")
    for r in rows:
        print(f"  {r['page_size']:>5} {r['pdkv_ms']:>9.3f} {r['torch_ms']:>9.3f} "
              f"{r['naive_ms']:>9.1f} {r['vs_torch']:>8.2f}x {r['speedup']:>8.0f}x")
    rec = results["recording"]
    print(f"recording overhead, {rec['requests']} requests ({rec['events']} events): "
          f"{rec['plain_s']:.3f} s plain, {rec['recorded_s']:.3f} s recorded, "
          f"{rec['overhead']:.2f}x")
    goals.print()
    return goals.exit_status(args)


def add_command(bench) -> None:
    """``pdkv bench allocator``: its arguments (registered in pyproject.toml)."""
    a = bench.add_parser("allocator", help="free_kv_row and free-log recording vs baselines",
                         description="free_kv_row of a 128k-token row at page sizes 1, 16 "
                                     "and 64, recording on, against a vectorised torch "
                                     "allocator in the style of sglang's and a naive "
                                     "per-slot Python loop; a request workload with and "
                                     "without a free log.", epilog=EPILOG)
    add_bench_flags(a, quick="3 repeats, 1000 requests", repeats="7, 3 with --quick")
    a.set_defaults(func=main)


if __name__ == "__main__":
    sys.exit(run_as_script(add_command))
