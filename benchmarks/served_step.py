"""``pdkv bench served``: served TPOT against the in-process decode step at the same batch.

The served path (router, a 1P1D deployment's decode worker with its host tier, one
``StepTokens`` message per step, the router's fan-out to the client) should cost little
beyond the step itself. Both sides run the same model, the same plain step (one token per
request: no speculation) and the same batch, on the cores the decode worker gets:

- **step**: ``batch`` requests prefilled in this process, then ``DecodeBatch.step`` timed
  one step at a time, pinned to the decode worker's cores with as many torch threads;
- **served**: the same requests submitted at once to a 1P1D deployment (launched as
  ``pdkv run`` does: the launcher shares the cores out, the decode gets its own); each
  request's tokens are timestamped as the client receives them. The steady window is from
  the moment the last request got its first token to the moment the first one got its
  last: every step in it runs the whole batch. Served TPOT is the median over requests of
  their mean gap between tokens inside it.

Goal: served TPOT p50 <= 1.15x the in-process step p50. Medians of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace

from benchmarks.goals import EPILOG, Goals, add_bench_flags, run_as_script
from common.config import ServeConfig
from common.control import Done, Error, Tokens
from common.sizing import split_cores
from deploy.launch.config_args import config_from_args
from deploy.launch.flags import add_config_flags
from deploy.launch.launcher import Cluster

GOAL = 1.15


def in_process_step(cfg: ServeConfig, batch: int, prompt_len: int, steps: int,
                    cores: list[int]) -> list[float]:
    """Seconds of each of ``steps`` decode steps over ``batch`` prefilled requests, pinned
    to ``cores`` with one torch thread per core."""
    import torch

    from common.kv import KvCache
    from common.model import Model, ModelRunner
    from common.node import PrefillEngine
    from common.request import Request, SamplingParams
    from decode_node.batch import DecodeBatch

    was_cores, was_threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    try:
        cache = KvCache(cfg.pool_pages("decode"), cfg.page_size, layout=cfg.kv_layout())
        runner = ModelRunner(Model(cfg.model_config()), cache)
        engine = PrefillEngine(runner, cfg.chunk_size, cfg.max_prefill_tokens)
        decode = DecodeBatch(runner)
        reqs = [Request(f"s{i}", _prompt(i, prompt_len, cfg.model_config().vocab_size),
                        SamplingParams(max_new_tokens=steps + 8)) for i in range(batch)]
        for r in reqs:
            r.kv = cache.open_row(r.rid)
            cache.extend(r.kv, prompt_len)
            engine.add(r)
        while engine.has_work:
            engine.step()
        for r in reqs:
            decode.add(r)
        decode.step()                                   # warm-up
        out = []
        for _ in range(steps):
            t0 = time.perf_counter()
            decode.step()
            out.append(time.perf_counter() - t0)
        cache.close()
        return out
    finally:
        os.sched_setaffinity(0, was_cores)
        torch.set_num_threads(was_threads)


def served(cfg: ServeConfig, batch: int, prompt_len: int, steps: int) -> dict:
    """Submit ``batch`` requests at once to a 1P1D deployment; the steady window's TPOT."""
    cluster = Cluster(cfg, "disagg", 1, 1).start()
    was = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cluster.router_cores or was)  # the client beside the router
    try:
        vocab = cfg.model_config().vocab_size
        times: dict[str, list[float]] = {f"s{i}": [] for i in range(batch)}
        for i, rid in enumerate(times):
            cluster.client.submit(rid, _prompt(i, prompt_len, vocab),
                                  {"max_new_tokens": steps, "temperature": 0.0})
        done: set[str] = set()
        deadline = time.monotonic() + 600
        while len(done) < batch and time.monotonic() < deadline:
            msgs = cluster.client.poll(1.0)
            now = time.perf_counter()
            for m in msgs:
                if isinstance(m, Tokens) and m.rid in times:
                    times[m.rid].extend([now] * len(m.ids))
                elif isinstance(m, Done | Error) and m.rid in times:
                    if isinstance(m, Error) or not m.ok:
                        raise RuntimeError(f"{m.rid} failed: {m}")
                    done.add(m.rid)
        if len(done) < batch:
            raise RuntimeError(f"only {len(done)} of {batch} requests ended in 600 s")
        decode_cores = next(p.cores for p in cluster.procs if p.role == "decode")
    finally:
        os.sched_setaffinity(0, was)
        cluster.stop()
        cluster.check_exit_codes()
        cluster.cleanup()
    return {**steady_tpot(times), "decode_cores": decode_cores}


def steady_tpot(times: dict[str, list[float]]) -> dict:
    """TPOT over the window where every request decodes: the median over requests of
    their mean gap between tokens inside it (and the whole-request TPOT beside it)."""
    start = max(t[0] for t in times.values())
    end = min(t[-1] for t in times.values())
    gaps, whole = [], []
    for t in times.values():
        inside = [x for x in t if start < x <= end]
        if len(inside) >= 2:
            gaps.append((inside[-1] - inside[0]) / (len(inside) - 1))
        whole.append((t[-1] - t[0]) / (len(t) - 1))
    if not gaps:
        raise RuntimeError("no steady window: every request should decode at once for a "
                           "while; raise --steps")
    return {"steady_tpot_s": statistics.median(gaps), "tpot_p50_s": statistics.median(whole),
            "window_s": end - start}


def _prompt(i: int, n: int, vocab: int) -> list[int]:
    return [(i * 7919 + j * 104729) % (vocab - 8) + 8 for j in range(n)]


def main(args: argparse.Namespace) -> int:
    repeats = args.repeats or (1 if args.quick else 3)
    batch, prompt_len, steps = (8, 32, 24) if args.quick else (args.batch, args.prompt_len,
                                                               args.steps)
    cfg = replace(config_from_args(args), spec_k=0)
    cores = split_cores(2)[1]  # the launcher's block for a 1P1D decode (router unpinned)
    step_s, served_s, tpot_s = [], [], []
    for rep in range(repeats):
        step_s.append(statistics.median(in_process_step(cfg, batch, prompt_len, steps, cores)))
        s = served(cfg, batch, prompt_len, steps)
        if s["decode_cores"] != cores:
            raise RuntimeError(f"the decode ran on {s['decode_cores']}, the step on {cores}")
        served_s.append(s["steady_tpot_s"])
        tpot_s.append(s["tpot_p50_s"])
        print(f"  repeat {rep + 1}/{repeats}: step {step_s[-1] * 1e3:.2f} ms, served "
              f"{served_s[-1] * 1e3:.2f} ms (window {s['window_s']:.1f} s)", file=sys.stderr)
    step, serv = statistics.median(step_s), statistics.median(served_s)
    goals = Goals("served")
    goals.at_most(f"served TPOT p50 vs in-process step, batch {batch}", serv / step, GOAL,
                  measured=f"served {serv * 1e3:.2f} ms", baseline=f"step {step * 1e3:.2f} ms")
    out = {"model": cfg.model_path or cfg.model, "batch": batch, "prompt_len": prompt_len,
           "steps": steps, "cores": cores, "repeats": repeats,
           "step_ms": [x * 1e3 for x in step_s], "served_steady_tpot_ms":
           [x * 1e3 for x in served_s], "served_tpot_p50_ms": [x * 1e3 for x in tpot_s],
           **goals.to_dict()}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"pdkv bench served: {out['model']}, batch {batch}, prompts {prompt_len}, "
              f"{steps} tokens, decode on cores {cores}, medians of {repeats}\n"
              f"  in-process step p50 {step * 1e3:.2f} ms; served steady TPOT p50 "
              f"{serv * 1e3:.2f} ms (whole-request TPOT p50 "
              f"{statistics.median(tpot_s) * 1e3:.2f} ms)")
        goals.print()
    return goals.exit_status(args)


def add_command(bench) -> None:
    """``pdkv bench served`` (registered in pyproject.toml)."""
    p = bench.add_parser(
        "served", help="served TPOT against the in-process decode step at the same batch",
        description="Time the plain decode step in process, then serve the same batch "
                    "through a 1P1D deployment and compare its steady-state TPOT.",
        epilog=EPILOG)
    p.add_argument("--batch", type=int, default=32, help="requests decoding at once "
                   "(default 32)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt "
                   "(default 128)")
    p.add_argument("--steps", type=int, default=96, help="tokens each request generates "
                   "(default 96)")
    add_bench_flags(p, quick="batch 8, 24 tokens, 1 repeat", repeats="3")
    add_config_flags(p)
    p.set_defaults(func=main)


if __name__ == "__main__":
    sys.exit(run_as_script(add_command))
