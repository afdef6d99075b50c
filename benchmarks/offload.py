"""Host offload copy rate against a plain tensor copy of the same bytes, in one run.

Offload: ``prepare_store`` + ``complete_store`` of one row's committed full pages (pins,
host allocation, hash-chain lookup, the copy on the engine's thread or stream, unpins,
prefix-cache insert). Load: ``prepare_load`` + ``complete_load`` of the same prefix into
a second row. Plain: ``host.copy_(device[pages])`` of the same bytes into a preallocated
host tensor (pinned when the device is CUDA), one contiguous slice.

Same threads on both sides: torch's ``copy_`` shares a big block over its intra-op
threads, so the page copier gets as many (``--threads``, default torch's count; both set
for the run and printed): a one-thread copier against a two-thread ``copy_`` would measure
the thread count, not the copier. Each timed copy starts after a short pause
(``SETTLE_S``), so none inherits the spinning OpenMP threads of the one before.

Two cases: ``contiguous`` (fresh pools: one run of pages each side) and ``scattered``
(the row's device pages in random order, so every page is its own run). A round is
``TRIES`` tries, each timing offload, load and plain one after the other (interleaved, so
the machine's drift hits all three alike); a round's ratio is the median over its tries
of plain time / offload time, each try's pair side by side (``paired_ratio``). GB/s
figures are medians over every try. Goal: scattered offload >= 0.7x the plain copy of the
same bytes in every one of ``--repeats`` rounds (the worst round is judged); exit status
1 on a miss unless ``--report-only``. A control times the plain copy of another block of
the pool in the same tries and is judged as the offload: how far the baseline's own
rounds spread on this machine, printed beside the goal.

Why medians of pairs: one 128 MiB copy on the 2-core box takes 6-16 ms for the same bytes
(other machines' memory traffic), and the plain copy's rare fast tries (5.6-6.4 ms) were
faster than any scattered offload got (7.3 ms at best). A round judged by each side's fastest
try (this bench until 2026-12-04, 3 tries) therefore missed whenever the plain copy was
lucky: resampled from 210 measured tries, 77% of such 7-round runs missed the goal, and
the control (the plain copy against itself) 37%. Judged by the median of 15 paired tries
a run missed in 3% of resamples, the control in none (docs/benchmarks.md).

``--split`` times the parts of a scattered offload instead (no goal judged): ``prepare_store``
(pins, host allocation, hash-chain lookup, hand-off), ``complete_store`` (the copy and the
prefix-cache insert), the page copier called directly, one thread of numpy slices, and
the plain copy, interleaved, in ms (min / median / max of the rounds).

Run: ``python -m benchmarks.offload [--quick] [--json] [--report-only] [--device cuda] [--split]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from benchmarks.goals import Goals, add_bench_flags, paired_ratio
from common import KvCache, KvLayout
from common.host import HashChain, HostTier, Offloader
from common.kv import copy_pages, copy_threads, set_copy_threads

LAYOUT = KvLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16")
PAGE_SIZE = 16
GOAL = 0.7
# Pause before each timed copy. After a parallel region libgomp's threads spin (~14 ms
# by default, GOMP_SPINCOUNT), so whatever ran right after the plain ``copy_`` shared the
# cores with a spinning thread: on the 2-core box the copy following it ran at 2.7-2.9
# GB/s and the same copy elsewhere in the round at 3.7-3.9, whichever copy it was.
SETTLE_S = 0.05
# Tries per round (5 with --quick): the median of their paired ratios is the round's.
TRIES = 15


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    time.sleep(SETTLE_S)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _scatter_pool(cache: KvCache, num_pages: int, seed: int) -> None:
    """Leave the free list in random order, so the next row's pages are scattered."""
    rows = [cache.open_row(f"frag-{i}") for i in range(num_pages)]
    for kv in rows:
        cache.extend(kv, PAGE_SIZE)
    for i in np.random.default_rng(seed).permutation(num_pages):
        cache.free_kv_row(rows[i], [(0, PAGE_SIZE)])
        cache.close_row(rows[i])


def _setup(num_pages: int, device: torch.device, scattered: bool):
    """A pool with a committed ``src`` row of random KV (its pages in random order when
    ``scattered``), a host tier and offloader for it, and the plain copy's destination."""
    tokens = num_pages * PAGE_SIZE
    cache = KvCache(2 * num_pages + 1, PAGE_SIZE, layout=LAYOUT, device=device,
                    max_rows=2 * num_pages + 2)
    if scattered:
        _scatter_pool(cache, 2 * num_pages, seed=0)
    host = HostTier(num_pages + 1, PAGE_SIZE, LAYOUT, device=device)
    off = Offloader(cache, host)
    src = cache.open_row("src")
    cache.extend(src, tokens)
    cache.commit(src, tokens)
    pages = cache.pages(src, 0, tokens)
    cache.data()[pages] = torch.randn((num_pages, *LAYOUT.page_shape(PAGE_SIZE)),
                                      device=device).to(LAYOUT.torch_dtype)
    plain_dst = torch.empty_like(host.data[1:num_pages + 1], pin_memory=host.pinned)
    return cache, host, off, src, pages, plain_dst


def bench_case(name: str, num_pages: int, repeats: int, device: torch.device,
               tries: int = TRIES) -> dict:
    tokens = num_pages * PAGE_SIZE
    cache, host, off, src, pages, plain_dst = _setup(num_pages, device, name == "scattered")
    dst = cache.open_row("dst")
    cache.extend(dst, tokens)
    rounds = []   # per round: (offload, load, plain, control) seconds of each try
    for r in range(repeats + 1):  # the first round warms up and is dropped
        tried = []
        for t in range(tries if r else 1):
            chain = HashChain(PAGE_SIZE, tokens=np.full(tokens, r * tries + t, np.int32))
            off.prefix.evict(num_pages)  # outside the timing: room for this try
            tried.append((
                _timed(lambda c=chain: off.complete_store(off.prepare_store(src, c)), device),
                _timed(lambda c=chain: off.complete_load(off.prepare_load(dst, c)), device),
                # the baseline copies the same number of bytes as one contiguous block
                _timed(lambda: plain_dst.copy_(cache.data()[1:num_pages + 1]), device),
                # the control: the baseline's own copy of another block, timed as the rest
                _timed(lambda: plain_dst.copy_(cache.data()[num_pages + 1:]), device)))
        if r:
            rounds.append(list(zip(*tried)))
    assert torch.equal(cache.data()[cache.pages(dst, 0, tokens)], cache.data()[pages])
    off.close()
    nbytes = num_pages * LAYOUT.page_bytes(PAGE_SIZE)
    gbps = {k: nbytes / statistics.median([t for tried in rounds for t in tried[i]]) / 1e9
            for i, k in enumerate(("offload", "load", "plain"))}
    per_round = [paired_ratio(plain, offload) for offload, _, plain, _ in rounds]
    control = [paired_ratio(plain, again) for _, _, plain, again in rounds]
    return {"case": name, "pages": num_pages, "bytes": nbytes, "tries": tries,
            "offload_gbps": gbps["offload"], "load_gbps": gbps["load"],
            "plain_gbps": gbps["plain"], "offload_vs_plain": gbps["offload"] / gbps["plain"],
            "load_vs_plain": gbps["load"] / gbps["plain"],
            "offload_vs_plain_rounds": [round(r, 3) for r in per_round],
            "offload_vs_plain_worst": min(per_round),
            "control_rounds": [round(r, 3) for r in control], "control_worst": min(control)}


def split(num_pages: int, repeats: int, device: torch.device) -> dict[str, list[float]]:
    """Milliseconds of each part of a scattered offload, interleaved, per round."""
    tokens = num_pages * PAGE_SIZE
    cache, host, off, src, pages, plain_dst = _setup(num_pages, device, scattered=True)
    host_pages = np.arange(1, num_pages + 1)
    parts: dict[str, list[float]] = {}
    marks: list[float] = []

    def store(chain):  # back to back, as the bench's offload: the engine may start at once
        h = off.prepare_store(src, chain)
        marks.append(time.perf_counter())
        off.complete_store(h)

    def numpy_loop():
        s = cache.data().view(cache.data().shape[0], -1).view(torch.uint8).numpy()
        d = host.data.view(host.data.shape[0], -1).view(torch.uint8).numpy()
        for i, p in enumerate(pages):
            d[1 + i] = s[p]

    for r in range(repeats + 1):  # the first round warms up and is dropped
        chain = HashChain(PAGE_SIZE, tokens=np.full(tokens, r, np.int32))
        off.prefix.evict(num_pages)
        _sync(device)
        time.sleep(SETTLE_S)
        t0 = time.perf_counter()
        store(chain)
        _sync(device)
        t1 = time.perf_counter()
        times = {"prepare_store": marks[-1] - t0, "complete_store": t1 - marks[-1],
                 "copier direct": _timed(lambda: copy_pages(cache.data(), pages, host.data,
                                                            host_pages), device),
                 "plain copy_": _timed(lambda: plain_dst.copy_(
                     cache.data()[1:num_pages + 1]), device)}
        if device.type == "cpu":
            times["numpy 1 thread"] = _timed(numpy_loop, device)
        for k, v in times.items():
            if r:
                parts.setdefault(k, []).append(v * 1e3)
    off.close()
    return parts


def run(quick: bool, repeats: int | None, device: str | None,
        threads: int | None = None) -> dict:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    repeats = repeats or (3 if quick else 7)
    num_pages = 64 if quick else 256
    tries = 5 if quick else TRIES
    threads = threads or torch.get_num_threads()
    before = copy_threads(), torch.get_num_threads()
    torch.set_num_threads(threads)   # the plain copy's team
    set_copy_threads(threads)        # the page copier's
    try:
        cases = [bench_case(name, num_pages, repeats, dev, tries)
                 for name in ("contiguous", "scattered")]
    finally:
        set_copy_threads(before[0])
        torch.set_num_threads(before[1])
    return {"device": str(dev), "page_size": PAGE_SIZE,
            "page_bytes": LAYOUT.page_bytes(PAGE_SIZE), "repeats": repeats,
            "torch_threads": threads, "copy_threads": threads, "goal": GOAL, "cases": cases}


def judge(results: dict) -> Goals:
    """Scattered offload against the plain copy of the same bytes, worst round judged."""
    goals = Goals("offload")
    c = next(c for c in results["cases"] if c["case"] == "scattered")
    goals.at_least(f"scattered offload vs plain copy, worst of {len(c['offload_vs_plain_rounds'])}"
                   " rounds", c["offload_vs_plain_worst"], GOAL,
                   baseline=f"plain {c['plain_gbps']:.2f} GB/s",
                   measured=f"offload {c['offload_gbps']:.2f} GB/s (medians)")
    return goals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.offload",
                                     description=__doc__.split("\n\n")[0])
    add_bench_flags(parser, quick=f"32 MB rows, 3 rounds of 5 tries (else {TRIES})",
                    repeats="rounds: 7, 3 with --quick")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda "
                        "when available)")
    parser.add_argument("--threads", type=int, default=None, help="threads of both the "
                        "plain copy (torch intra-op) and the page copier (default: torch's "
                        f"count, {torch.get_num_threads()} here)")
    parser.add_argument("--split", action="store_true", help="time the parts of a scattered "
                        "offload (ms) instead; judges no goal")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads}: need at least 1")
    if args.split:
        return _print_split(args)
    results = run(args.quick, args.repeats, args.device, args.threads)
    goals = judge(results)
    if args.json:
        print(json.dumps({**results, **goals.to_dict()}, indent=2))
        return goals.exit_status(args)
    tries = results["cases"][0]["tries"]
    print(f"host offload on {results['device']}, pages of {results['page_bytes'] >> 10} KiB "
          f"(page_size {PAGE_SIZE}), {results['repeats']} rounds of {tries} interleaved tries "
          f"(GB/s: medians of every try; a round's ratio: median of its paired tries); "
          f"threads: plain copy_ {results['torch_threads']}, page copier "
          f"{results['copy_threads']}:")
    print(f"  {'case':>10} {'MiB':>6} {'offload':>9} {'load':>9} {'plain':>9} {'ratio':>6} "
          f"{'worst':>6}  per round")
    for c in results["cases"]:
        print(f"  {c['case']:>10} {c['bytes'] >> 20:>6} {c['offload_gbps']:>7.2f}GB/s "
              f"{c['load_gbps']:>7.2f}GB/s {c['plain_gbps']:>7.2f}GB/s "
              f"{c['offload_vs_plain']:>5.2f}x {c['offload_vs_plain_worst']:>5.2f}x  "
              f"{c['offload_vs_plain_rounds']}")
    c = next(c for c in results["cases"] if c["case"] == "scattered")
    print(f"  control (the plain copy of another block of the pool against the plain copy, "
          f"same rounds): worst {c['control_worst']:.2f}x, median "
          f"{statistics.median(c['control_rounds']):.2f}x, per round {c['control_rounds']}")
    goals.print()
    return goals.exit_status(args)


def _print_split(args) -> int:
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    threads = args.threads or torch.get_num_threads()
    before = copy_threads(), torch.get_num_threads()
    torch.set_num_threads(threads)
    set_copy_threads(threads)
    try:
        parts = split(64 if args.quick else 256, args.repeats or (3 if args.quick else 9), dev)
    finally:
        set_copy_threads(before[0])
        torch.set_num_threads(before[1])
    if args.json:
        print(json.dumps({"device": str(dev), "threads": threads, "split_ms": parts}, indent=2))
        return 0
    print(f"scattered offload split on {dev}, {threads} threads each side, ms per round:")
    for k, v in parts.items():
        print(f"  {k:>15} min {min(v):6.2f} median {statistics.median(v):6.2f} "
              f"max {max(v):6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
