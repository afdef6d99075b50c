"""``pdkv bench step``: the in-process decode step against its bandwidth floor.

A decode step must at least read every weight it multiplies by (the blocks, the final
norm, the head; the embedding only by rows) and every row's KV context once. Its floor is
those bytes over the device's memory bandwidth, measured in the same run by a large
device-to-device copy (read + write). The step is a greedy ``DecodeBatch`` step as a
decode worker runs it (plan, one upload, the pass, through its CUDA graph on CUDA, the
draw, one download), median of ``--steps`` at each ``--batch``.

Goal (judged on CUDA; reported on CPU, whose step is compute bound): the step <= 2x its
floor, for llama-1b-shape bf16 at batch 8 and 64.

    python -m benchmarks.step --device cuda:0 [--model llama-1b-shape] [--batch 8 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from benchmarks.goals import EPILOG, Goals, add_bench_flags, run_as_script
from common import KvCache
from common.model import BatchItem, Model, ModelRunner, get_config
from common.request import Request, SamplingParams
from decode_node.batch import DecodeBatch, plain_step

GOAL = 2.0


def bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of a device-to-device copy (read and write counted), median of repeats."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times[1:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def floor_bytes(model: Model, batch: int, context: int) -> int:
    """What one decode step must read: weights but the embedding, and the KV context."""
    cfg = model.config
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    weights = sum(size(t) for b in model.blocks for t in vars(b).values() if t is not None)
    weights += size(model.final_norm) + size(model.lm_head)
    kv = batch * context * cfg.num_layers * 2 * cfg.kv_size * torch.empty(
        (), dtype=cfg.torch_dtype).element_size()
    return weights + kv


def step_seconds(model: Model, batch_size: int, context: int, steps: int) -> float:
    """Median seconds of a greedy decode step over ``batch_size`` rows of ``context``."""
    cfg, ps = model.config, 16
    pages = batch_size * ((context + steps + 4) // ps + 2) + 2
    cache = KvCache(pages, ps, layout=cfg.kv_layout(with_draft=False), device=model.device,
                    max_rows=batch_size)
    runner = ModelRunner(model, cache)
    batch = DecodeBatch(runner, plain_step)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (context,), generator=gen).tolist()
    with torch.inference_mode():
        for i in range(batch_size):
            kv = cache.open_row(f"r{i}")
            cache.extend(kv, context)
            runner.forward([BatchItem(kv, ids, 0)])
            cache.commit(kv, context)
            batch.add(Request(f"r{i}", ids, SamplingParams(max_new_tokens=steps + 4), kv=kv,
                              output=[ids[-1]], num_computed=context))
    batch.step()  # warm-up: compilation and graph capture
    batch.step()
    times = []
    for _ in range(steps):
        _sync(model.device)
        t0 = time.perf_counter()
        batch.step()
        _sync(model.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    model_name = args.model or ("llama-1b-shape" if device.type == "cuda" else "small")
    cfg = get_config(model_name, **({"dtype": args.dtype} if args.dtype else {}),
                     num_draft_layers=0)
    if args.quick:
        args.batch, args.steps = args.batch[:1], min(args.steps, 3)
    model = Model(cfg, device)
    bw = bandwidth(device, (1 << 30) if device.type == "cuda" else (256 << 20))
    goals = Goals("step")
    rows = []
    for b in args.batch:
        step = step_seconds(model, b, args.context, args.steps)
        floor = floor_bytes(model, b, args.context) / bw
        rows.append({"batch": b, "step_ms": step * 1e3, "floor_ms": floor * 1e3,
                     "step_vs_floor": step / floor})
        if device.type == "cuda":
            goals.at_most(f"decode step {cfg.name} {cfg.dtype} batch {b} vs bandwidth floor",
                          step / floor, GOAL, measured=f"step {step * 1e3:.3f} ms",
                          baseline=f"floor {floor * 1e3:.3f} ms")
    result = {"model": cfg.name, "dtype": cfg.dtype, "device": str(device),
              "attention": ModelRunner(model, KvCache(4, 16, layout=cfg.kv_layout(False),
                                                      device=device)).attention.name,
              "bandwidth_gbps": bw / 1e9, "context": args.context, "steps": rows}
    if args.json:
        print(json.dumps({**result, **goals.to_dict()}))
        return goals.exit_status(args)
    print(f"{cfg.name} {cfg.dtype} on {device} ({result['attention']} attention), context "
          f"{args.context}, copy bandwidth {bw / 1e9:.1f} GB/s")
    for r in rows:
        print(f"  batch {r['batch']:>3}: step {r['step_ms']:.3f} ms, floor {r['floor_ms']:.3f} "
              f"ms, {r['step_vs_floor']:.2f}x the floor")
    if goals.items:
        goals.print()
    else:
        print("pdkv bench step: reported only (the floor goal is judged on CUDA)")
    return goals.exit_status(args)


def add_command(bench) -> None:
    """``pdkv bench step``: its arguments (registered in pyproject.toml)."""
    p = bench.add_parser("step", help="the in-process decode step vs its bandwidth floor",
                         description=__doc__.split("\n\n")[1], epilog=EPILOG)
    add_bench_flags(p, quick="the first batch size, 3 steps", repeats="(unused)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="", help="a built-in config (default: llama-1b-shape "
                                               "on CUDA, small on CPU)")
    p.add_argument("--dtype", default="", help="override the config's dtype")
    p.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    p.add_argument("--context", type=int, default=512, help="KV tokens per row")
    p.add_argument("--steps", type=int, default=10, help="timed steps per batch size")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.set_defaults(func=main)


if __name__ == "__main__":
    sys.exit(run_as_script(add_command))
