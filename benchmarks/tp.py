"""Tensor-parallel decode throughput: TP2 vs TP1 on the same machine, in one run.

Each rank is a real process (gloo on loopback, one torch thread each); every rank runs
the paged ``ModelRunner`` over its own ``KvCache`` (its KV heads) on a batch of requests:
one prefill of the prompts, then ``steps`` greedy decode steps, rank 0 picking the tokens
and the group sharing them (``TpModel.greedy``). Tokens/s counts decode tokens of the
whole batch over the decode steps' wall time, median of ``repeats`` runs, TP1 (the
baseline, the same code with a group of one) measured in the same run.

    python -m benchmarks.tp [--model small] [--batch 8] [--steps 32] [--repeats 3]

This is a model-level figure (no router, transport or scheduler): what splitting the
weights and adding two all-reduces per block costs or buys on this machine's cores. It
reports only (exit 0); on a 2-core CPU, TP2 has no spare core to win with.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import time


def _rank(rank: int, size: int, address: str, args: dict, out) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch

    from common.model import TpModel, get_config
    from common.parallel import TpGroup

    torch.set_num_threads(1)
    cfg = get_config(args["model"], dtype="float32")
    group = TpGroup.join(rank, size, address, timeout_s=120)
    try:
        model = TpModel(cfg, group)
        rates = [_decode(model, args) for _ in range(args["repeats"])]
        out.put((rank, rates))
    finally:
        group.close()


def _decode(model, args: dict) -> float:
    from common.kv import KvCache
    from common.model import BatchItem, ModelRunner

    batch, steps, plen = args["batch"], args["steps"], args["prompt_len"]
    cache = KvCache(batch * ((plen + steps) // 16 + 2) + 1, 16,
                    layout=model.config.kv_layout(), max_rows=batch)
    runner = ModelRunner(model, cache)
    rows = [cache.open_row(f"r{i}") for i in range(batch)]
    for kv in rows:
        cache.extend(kv, plen + steps)
    vocab = model.full_config.vocab_size
    items = [BatchItem(kv, [(i * 7 + j) % vocab for j in range(plen)], 0)
             for i, kv in enumerate(rows)]
    tokens = model.greedy(runner.forward(items))
    model.group.broadcast_ids([0] if model.group.is_leader else None, 1)  # align start
    t0 = time.perf_counter()
    for s in range(steps):
        items = [BatchItem(kv, [tokens[i]], plen + s) for i, kv in enumerate(rows)]
        tokens = model.greedy(runner.forward(items))
    rate = batch * steps / (time.perf_counter() - t0)
    cache.close()
    return rate


def _run(size: int, args: dict) -> list[float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    procs = [ctx.Process(target=_rank, args=(r, size, address, args, out), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=600) for _ in range(size))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return results[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="built-in model (default small)")
    p.add_argument("--batch", type=int, default=8, help="requests per step (default 8)")
    p.add_argument("--steps", type=int, default=32, help="decode steps (default 32)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    args = {"model": a.model, "batch": a.batch, "steps": a.steps,
            "prompt_len": a.prompt_len, "repeats": a.repeats}
    tp1, tp2 = _run(1, args), _run(2, args)
    res = {"model": a.model, "batch": a.batch, "steps": a.steps,
           "tp1_tokens_per_s": statistics.median(tp1),
           "tp2_tokens_per_s": statistics.median(tp2), "tp1_runs": tp1, "tp2_runs": tp2,
           "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count()}
    res["tp2_over_tp1"] = res["tp2_tokens_per_s"] / res["tp1_tokens_per_s"]
    if a.json:
        print(json.dumps(res))
    else:
        print(f"decode tokens/s ({a.model}, batch {a.batch}, {a.steps} steps, medians of "
              f"{a.repeats}): TP1 {res['tp1_tokens_per_s']:.1f}, TP2 "
              f"{res['tp2_tokens_per_s']:.1f} ({res['tp2_over_tp1']:.2f}x); load "
              f"{res['load_avg_1m']:.1f} on {res['cpus']} cpus")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
