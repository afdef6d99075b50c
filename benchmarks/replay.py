"""``pdkv bench replay``: events/s of ``pdkv replay`` against a bare msgpack decode of
the same file, in one run.

Goal: replay at least 0.25x the events/s of the bare decode.

The log is a realistic decode-node workload written with ``FreeLogWriter``: requests
arrive with a prompt (alloc of the prompt's pages, pinned while received), decode one
page at a time, offload full pages four at a time (pinned while copied), and finish
(committed range and speculative tail freed in one event); some abort while a pin is live
(pending pages, then unpin + release), some hand their prefix to a prefix cache that
evicts it later. Run:

    pdkv bench replay [--quick] [--events 2000000] [--repeats 3] [--json] [--report-only]
    python -m benchmarks.replay ...            # the same
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator

import msgpack

from benchmarks.goals import EPILOG, Goals, add_bench_flags, run_as_script
from common.freelog import FreeLogWriter, replay_file

PAGE_SIZE = 16
NUM_PAGES = 32768
GOAL_RATIO = 0.25
QUICK_EVENTS = 200_000  # keep deploy/cli_bench.py's --help in step
CACHE = "cache:prefix"


class _Workload:
    """Drives requests against a simple free list and records every step."""

    def __init__(self, log: FreeLogWriter, seed: int):
        self.log, self.rng = log, random.Random(seed)
        self.free = list(range(1, NUM_PAGES))
        self.rng.shuffle(self.free)
        self.next_pin = 0
        self.cache: list[list[int]] = []  # prefixes held by the cache, oldest first

    def take(self, n: int) -> list[int] | None:
        if len(self.free) < n:
            return None
        pages, self.free[-n:] = self.free[-n:], []
        return pages

    def pin(self, pages: list[int], reason: str) -> int:
        self.next_pin += 1
        self.log.pin("full", pages, self.next_pin, reason)
        return self.next_pin

    def request(self, rid: str) -> Iterator[None]:
        """One request's life; yields between steps so that requests interleave."""
        rng, log = self.rng, self.log
        prompt, output = rng.randint(64, 2048), rng.randint(32, 512)
        pages = self.take(-(-prompt // PAGE_SIZE))
        while pages is None:
            self.evict_cache()
            yield
            pages = self.take(-(-prompt // PAGE_SIZE))
        log.alloc("full", pages, rid)
        recv = self.pin(pages, "receive")
        yield
        log.unpin("full", pages, recv)
        length = prompt + output
        abort_at = rng.randint(prompt, length) if rng.random() < 0.05 else -1
        offload: list[tuple[int, list[int]]] = []
        # Decode one page of tokens per step: a page is allocated when the row crosses
        # into it, and every fourth full page starts an offload copy of the last four.
        for start in range(-(-prompt // PAGE_SIZE) * PAGE_SIZE, length, PAGE_SIZE):
            page = self.take(1)
            if page is None:
                abort_at = start
            else:
                log.alloc("full", page, rid)
                pages += page
            full = start // PAGE_SIZE
            if full % 4 == 0:
                chunk = pages[full - 4:full]
                offload.append((self.pin(chunk, "offload"), chunk))
            if offload and rng.random() < 0.6:
                pin_id, chunk = offload.pop(0)
                log.unpin("full", chunk, pin_id)
            if abort_at >= 0 and start >= abort_at:
                break
            yield
        yield from self.finish(rid, pages, length, abort_at >= 0, offload)

    def finish(self, rid: str, pages: list[int], length: int, aborted: bool,
               offload: list[tuple[int, list[int]]]) -> Iterator[None]:
        committed = -(-(length - 3) // PAGE_SIZE) * PAGE_SIZE  # 3 draft tokens
        keep = 0
        if not aborted and self.rng.random() < 0.1:
            keep = min(8, len(pages) - 1)
            self.log.handoff("full", pages[:keep], rid, CACHE)
            self.cache.append(pages[:keep])
        reason = "aborted" if aborted else "finished"
        self.log.free("full", pages[keep:], rid, reason,
                      ranges=[(keep * PAGE_SIZE, committed), (committed, length)])
        yield
        for pin_id, chunk in offload:  # copies still in flight when the row was freed
            self.log.unpin("full", chunk, pin_id)
            pending = [p for p in chunk if pages.index(p) >= keep]
            if pending:
                self.log.release("full", pending)
                self.free += pending
        pinned = {p for _, chunk in offload for p in chunk}
        self.free += [p for p in pages[keep:] if p not in pinned]

    def evict_cache(self) -> None:
        if self.cache:
            prefix = self.cache.pop(0)
            self.log.free("full", prefix, CACHE, "evicted")
            self.free += prefix


def write_log(path: str, num_events: int, seed: int = 0, concurrency: int = 64) -> int:
    """Write a log of about ``num_events`` events; returns the exact count."""
    log = FreeLogWriter(path, node="bench-decode",
                        pools={"full": {"num_pages": NUM_PAGES, "page_size": PAGE_SIZE,
                                        "reserved": [0]}})
    work = _Workload(log, seed)
    active: list[Iterator[None]] = []
    rid = 0
    while log._seq < num_events:  # the writer's own event counter
        while len(active) < concurrency:
            active.append(work.request(f"req-{rid}"))
            rid += 1
        i = work.rng.randrange(len(active))
        if next(active[i], StopIteration) is StopIteration:
            active[i] = active[-1]
            active.pop()
    for req in active:  # drain: let every request finish
        for _ in req:
            pass
    while work.cache:
        work.evict_cache()
    log.close(retained=[CACHE])
    return log._seq


def bare_decode(path: str) -> int:
    """The baseline: iterate a msgpack Unpacker over the file, nothing else."""
    count = 0
    with open(path, "rb") as f:
        for _ in msgpack.Unpacker(f, read_size=1 << 20, raw=False):
            count += 1
    return count


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def run(num_events: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.freelog")
        t0 = time.perf_counter()
        events = write_log(path, num_events)
        gen_s = time.perf_counter() - t0
        size = os.path.getsize(path)
        bare, replay, ratios = [], [], []
        for _ in range(repeats):  # interleaved, so machine noise hits both alike
            b, records = _timed(lambda: bare_decode(path))
            r, report = _timed(lambda: replay_file(path))
            bare.append(b)
            replay.append(r)
            ratios.append(b / r)
        bare_s, replay_s = statistics.median(bare), statistics.median(replay)
    assert report.ok, report.format()
    assert records == events + 1, (records, events)  # + the header
    pages = report.pools["full"]
    return {"events": events, "file_mib": round(size / 2**20, 1),
            "generate_s": round(gen_s, 2), "repeats": repeats,
            "bare_decode_s": round(bare_s, 3), "replay_s": round(replay_s, 3),
            "bare_events_per_s": round(events / bare_s),
            "replay_events_per_s": round(events / replay_s),
            "ratio": round(statistics.median(ratios), 3), "goal_ratio": GOAL_RATIO,
            "ratio_spread": [round(min(ratios), 3), round(max(ratios), 3)],
            "pages_allocated": pages["pages_allocated"],
            "pages_per_event": round((pages["pages_allocated"] + pages["pages_freed"]) * 2
                                     / events, 2),
            "peak_in_use": pages["peak_in_use"]}


def main(args: argparse.Namespace) -> int:
    repeats = args.repeats or 3
    result = run(args.events or (QUICK_EVENTS if args.quick else 2_000_000), repeats)
    goals = Goals("replay")
    goals.at_least("replay vs bare msgpack decode", result["ratio"], GOAL_RATIO,
                   measured=f"replay {result['replay_events_per_s']:,} events/s",
                   baseline=f"bare decode {result['bare_events_per_s']:,} events/s")
    if args.json:
        print(json.dumps({**result, **goals.to_dict()}, indent=2))
        return goals.exit_status(args)
    print(f"log: {result['events']:,} events, {result['file_mib']} MiB "
          f"(written in {result['generate_s']} s)")
    print(f"bare msgpack decode: {result['bare_events_per_s']:,} events/s "
          f"(median {result['bare_decode_s']} s of {repeats})")
    print(f"pdkv replay:         {result['replay_events_per_s']:,} events/s "
          f"(median {result['replay_s']} s of {repeats})")
    goals.print()
    return goals.exit_status(args)


def add_command(bench) -> None:
    """``pdkv bench replay``: its arguments (registered in pyproject.toml)."""
    p = bench.add_parser("replay", help="pdkv replay events/s vs a bare msgpack decode",
                         description="Write a realistic decode-node free log, then time "
                                     "pdkv replay against a bare msgpack decode of the "
                                     "same file.", epilog=EPILOG)
    add_bench_flags(p, quick="a 200,000-event log", repeats="3")
    p.add_argument("--events", type=int, metavar="N",
                   help="events in the generated log (default 2000000; 200000 with --quick)")
    p.set_defaults(func=main)


if __name__ == "__main__":
    sys.exit(run_as_script(add_command))
