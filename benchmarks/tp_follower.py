"""``pdkv bench tp-follower``: what a tensor-parallel follower's own pool costs per step.

A follower of a tensor-parallel group keeps a ``KvCache`` of its own (its allocator's page
states, its transport's pins, its own free log) and repeats rank 0's cache ops on it
before each pass (``common.node.tp``). This measures that bookkeeping on a decode stream,
without the pass itself (the model's cost is the same on every rank):

    batch rows decoding with speculation (k lookahead slots, 1..k+1 tokens accepted a
    step), each finishing after its output and replaced by a new prompt; rank 0 extends,
    commits, frees and closes rows as the decode scheduler does, then broadcasts the step.

Figures are CPU time per step (``time.process_time``: this process's threads, the free
log's writer included; steadier than wall time on a shared machine), median of
``--repeats`` runs of ``--steps`` steps:

- rank 0's cache work with recording (``LeaderKvCache``, the step encoded), and without
  (a plain ``KvCache``, no group): what the lockstep adds on rank 0;
- the follower applying the step: its ``KvCache`` with its free log, and without a log;
- the baseline: a follower with no allocator and no log, which only decodes the step and
  keeps each row's page ids (what a follower holding rank 0's page table would do).

Goal: the follower's work with its log is at most 1.5x rank 0's own recorded cache work
for the same step (it repeats the same allocator calls; it must not cost more than the
rank it follows). The baseline's ratio is printed, not judged: it is the price of the
follower's allocator and log, which docs/cluster.md weighs.

    python -m benchmarks.tp_follower [--batch 32] [--steps 400] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.goals import EPILOG, Goals, add_bench_flags, run_as_script

PAGE = 16


def _stream(cache, batch: int, steps: int, k: int, seed: int, after_step) -> None:
    """The decode stream on ``cache``; ``after_step()`` runs after each step's ops."""
    from common.kv import ceil_align

    rng = random.Random(seed)
    n = 0

    def admit():
        nonlocal n
        n += 1
        kv = cache.open_row(f"r{n}")
        prompt = rng.randint(64, 512)
        cache.extend(kv, prompt)
        cache.commit(kv, prompt)
        return [kv, rng.randint(16, 256)]

    rows = [admit() for _ in range(batch)]
    for _ in range(steps):
        for i, (kv, left) in enumerate(rows):
            cache.extend(kv, max(0, kv.committed_len + k + 1 - kv.allocated_len))
            got = min(left, rng.randint(1, k + 1))
            cache.commit(kv, got)
            if left - got > 0:
                rows[i][1] = left - got
                continue
            end = min(ceil_align(kv.committed_len, PAGE), kv.allocated_len)
            cache.free_kv_row(kv, [(0, end), (end, kv.allocated_len)] if
                              end < kv.allocated_len else [(0, end)], reason="finished")
            cache.close_row(kv)
            rows[i] = admit()
        after_step()


def _layout():
    from common.model import get_config

    return get_config("tiny").kv_layout()


def _pages(batch: int) -> int:
    return batch * (512 + 256 + 64) // PAGE + 64


class _Keep:
    """A group of one that keeps rank 0's steps (what the followers would receive)."""

    def __new__(cls):
        from common.node.tp import TAG_STEP
        from common.parallel import TpGroup

        class Keep(TpGroup):
            def __init__(self) -> None:
                super().__init__(0, 1)
                self.steps: list[bytes] = []

            def broadcast_bytes(self, tag, payload, idle=None):
                assert tag == TAG_STEP
                self.steps.append(payload)
                return payload

        return Keep()


def _leader(batch: int, steps: int, k: int, log: Path | None) -> tuple[float, list[bytes]]:
    from common.node.tp import LeaderKvCache, Lockstep

    group = _Keep()
    cache = LeaderKvCache(_pages(batch), PAGE, max_rows=batch, log_path=log, node="w",
                          layout=_layout(), lockstep=Lockstep(group))
    t0 = time.process_time()
    _stream(cache, batch, steps, k, 1, lambda: cache.lockstep.send("idle"))
    return time.process_time() - t0, group.steps


def _plain(batch: int, steps: int, k: int, log: Path | None) -> float:
    from common.kv import KvCache

    cache = KvCache(_pages(batch), PAGE, max_rows=batch, log_path=log, node="w",
                    layout=_layout())
    t0 = time.process_time()
    _stream(cache, batch, steps, k, 1, lambda: None)
    return time.process_time() - t0


def _follower(batch: int, frames: list[bytes], log: Path | None) -> float:
    from common.kv import KvCache
    from common.model import Model, ModelRunner, get_config
    from common.node.tp import Mirror

    cache = KvCache(_pages(batch), PAGE, max_rows=batch, log_path=log, node="w/tp1",
                    layout=_layout())
    # no pass runs: the model only satisfies the runner
    mirror = Mirror(ModelRunner(Model(get_config("tiny")), cache), 1)
    t0 = time.process_time()
    for frame in frames:
        mirror.apply(frame)
    return time.process_time() - t0


def _page_table(frames: list[bytes]) -> float:
    """The baseline follower: decodes every op, keeps each row's page ids, nothing else."""
    from common.control import unpack_ids
    from common.node.tp import read_step

    rows: dict[str, list[np.ndarray]] = {}
    t0 = time.process_time()
    for frame in frames:
        for op in read_step(frame)[1]:
            if op.op == "open":
                rows[op.owner] = []
            elif op.op == "extend" and op.pages:
                rows[op.owner].append(unpack_ids(op.pages, "pages"))
            elif op.op == "close_row":
                del rows[op.owner]
    return time.process_time() - t0


def measure(batch: int, steps: int, repeats: int, k: int = 4) -> dict:
    runs: dict[str, list[float]] = {name: [] for name in (
        "leader_recorded", "leader_plain", "follower_logged", "follower_unlogged",
        "page_table")}
    ops = 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            logs = Path(tmp) / str(r)
            logs.mkdir()
            t, frames = _leader(batch, steps, k, logs / "w.freelog")
            runs["leader_recorded"].append(t)
            runs["leader_plain"].append(_plain(batch, steps, k, logs / "p.freelog"))
            runs["follower_logged"].append(_follower(batch, frames, logs / "w.tp1.freelog"))
            runs["follower_unlogged"].append(_follower(batch, frames, None))
            runs["page_table"].append(_page_table(frames))
            ops = _count_ops(frames)
    per_step = {name: statistics.median(v) / steps * 1e6 for name, v in runs.items()}
    return {"batch": batch, "steps": steps, "repeats": repeats, "k": k,
            "ops_per_step": ops / steps, "us_per_step": per_step}


def _count_ops(frames: list[bytes]) -> int:
    from common.node.tp import read_step

    return sum(len(read_step(f)[1]) for f in frames)


def judge(results: dict) -> Goals:
    us = results["us_per_step"]
    goals = Goals("tp-follower")
    goals.at_most("follower with its log vs rank 0's recorded cache work",
                  us["follower_logged"] / us["leader_recorded"], 1.5,
                  measured=f"follower {us['follower_logged']:.0f} us/step",
                  baseline=f"rank 0 {us['leader_recorded']:.0f} us/step")
    return goals


def main(args: argparse.Namespace) -> int:
    repeats = args.repeats or (3 if args.quick else 5)
    steps = 100 if args.quick else args.steps
    results = measure(args.batch, steps, repeats)
    goals = judge(results)
    if args.json:
        print(json.dumps({**results, **goals.to_dict()}, indent=2))
        return goals.exit_status(args)
    us = results["us_per_step"]
    print(f"decode stream, {args.batch} rows, k=4, page {PAGE}: "
          f"{results['ops_per_step']:.1f} cache ops a step (median of {repeats} runs of "
          f"{steps} steps), CPU us per step:")
    for name, label in (("leader_plain", "rank 0, plain KvCache (no TP)"),
                        ("leader_recorded", "rank 0, LeaderKvCache + step encoded"),
                        ("follower_logged", "follower, KvCache with its free log"),
                        ("follower_unlogged", "follower, KvCache without a log"),
                        ("page_table", "baseline: decode + page table only")):
        print(f"  {label:<40} {us[name]:>8.1f}")
    print(f"  the follower's allocator and log cost {us['follower_logged'] - us['page_table']:.0f}"
          f" us a step over the page-table baseline "
          f"({us['follower_logged'] / us['page_table']:.1f}x)")
    goals.print()
    return goals.exit_status(args)


def add_command(bench) -> None:
    """``pdkv bench tp-follower``: its arguments (registered in pyproject.toml)."""
    a = bench.add_parser("tp-follower", help="a TP follower's own pool and log, per step",
                         description="The bookkeeping a tensor-parallel follower does per "
                                     "decode step (its KvCache with and without its free "
                                     "log) against rank 0's and a page-table-only follower.",
                         epilog=EPILOG)
    a.add_argument("--batch", type=int, default=32, help="rows decoding at once (32)")
    a.add_argument("--steps", type=int, default=400, help="decode steps a run (400)")
    add_bench_flags(a, quick="100 steps, 3 repeats", repeats="5, 3 with --quick")
    a.set_defaults(func=main)


if __name__ == "__main__":
    sys.exit(run_as_script(add_command))
