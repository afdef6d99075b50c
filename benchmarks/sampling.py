"""``pdkv bench sampling``: decode tokens/s when every request samples, against greedy.

Two in-process decode batches (``DecodeBatch`` with the plain step, as a decode worker
runs it: the step's plan up in one copy, the forward pass, the draw, the ids down) decode
the same prompts, one greedy, one sampled (temperature 1.0, top_p 0.9, each request with
its own seed), stepping in turn (the order alternating), so that a shared machine's load
hits both alike. The figure is the median over step pairs of sampled tokens/s over greedy
tokens/s (``paired_ratio``). Goal: >= 0.9. It also reports the sampler alone (ms per
step over the batch's rows: greedy, temperature 1, temperature 1 with top_p 0.9).

The model: ``--checkpoint DIR`` (a real checkpoint, e.g. SmolLM2-135M), else the
``smollm2-shape`` config: SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 KV
heads, 49152-token vocabulary) with seeded weights and an untied head, whose logits
spread like a trained model's at temperature 1 (a top_p 0.9 nucleus of about 300 tokens).

    python -m benchmarks.sampling [--batch 64] [--steps 8] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from benchmarks.goals import EPILOG, Goals, add_bench_flags, paired_ratio, run_as_script
from common import KvCache
from common.model import BatchItem, Model, ModelConfig, ModelRunner, load_config, sample
from common.request import Request, SamplingParams
from decode_node.batch import DecodeBatch, plain_step

GOAL = 0.9
SMOLLM2_SHAPE = ModelConfig(name="smollm2-shape", vocab_size=49152, hidden_size=576,
                            num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                            intermediate_size=1536, rope_theta=100000.0, max_position=8192,
                            num_draft_layers=0)
"""SmolLM2-135M's shape, seeded weights (its head untied: see the module doc)."""


def model_config(args: argparse.Namespace) -> ModelConfig:
    if args.checkpoint:
        return load_config(args.checkpoint).with_overrides(num_draft_layers=0)
    cfg = SMOLLM2_SHAPE
    return cfg.with_overrides(num_layers=4) if args.quick else cfg


def decoding(model: Model, args: argparse.Namespace, params: SamplingParams,
             seed: int) -> DecodeBatch:
    """``args.batch`` requests past a random ``args.prompt``-token prompt, in a batch."""
    cfg, ps = model.config, 16
    pages = args.batch * ((args.prompt + args.steps + 2) // ps + 2) + 2
    cache = KvCache(pages, ps, layout=cfg.kv_layout(with_draft=False), device=model.device,
                    max_rows=args.batch)
    runner = ModelRunner(model, cache)
    batch = DecodeBatch(runner, plain_step)
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for i in range(args.batch):
            ids = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=gen).tolist()
            kv = cache.open_row(f"r{i}")
            cache.extend(kv, len(ids))
            runner.forward([BatchItem(kv, ids, 0)])
            cache.commit(kv, len(ids))
            p = SamplingParams(**{**params.to_dict(), "max_new_tokens": args.steps + 2,
                                  "seed": seed * 1000 + i})
            batch.add(Request(f"r{i}", ids, p, kv=kv, output=[ids[-1]],
                              num_computed=len(ids)))
    batch.step()  # warm-up
    return batch


def timed_step(batch: DecodeBatch) -> float:
    """Seconds per token of one step."""
    device = batch.runner.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    emitted, _ = batch.step()
    return (time.perf_counter() - t0) / sum(len(t) for _, t in emitted)


def sampler_ms(batch: int, vocab: int, repeats: int = 7) -> dict[str, float]:
    """The sampler alone: median ms of one step's draw over ``batch`` rows of logits
    spread like a trained model's at temperature 1 (normal, standard deviation 4: a top_p
    0.9 nucleus of about 300 tokens), greedy, temperature 1, temperature 1 with top_p 0.9."""
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 4
    cases = {"greedy": SamplingParams(), "t1": SamplingParams(temperature=1.0),
             "t1_top_p0.9": SamplingParams(temperature=1.0, top_p=0.9)}
    out = {}
    with torch.inference_mode():
        for name, p in cases.items():
            params = [SamplingParams(**{**p.to_dict(), "seed": i}) for i in range(batch)]
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                sample(logits, params, [""] * batch, [0] * batch)
                times.append(time.perf_counter() - t0)
            out[name] = 1e3 * statistics.median(times[1:])
    return out


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    if args.quick:
        args.batch, args.steps, args.prompt = min(args.batch, 16), min(args.steps, 4), 64
    cfg = model_config(args)
    model = Model(cfg, args.device)
    greedy, sampled = SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9)
    runs: dict[str, list[float]] = {"greedy": [], "sampled": []}
    for r in range(args.repeats or (2 if args.quick else 3)):
        # the two batches step in turn, so load on a shared machine hits both alike
        batches = {"greedy": decoding(model, args, greedy, r),
                   "sampled": decoding(model, args, sampled, r)}
        for step in range(args.steps):
            for name in ("greedy", "sampled") if step % 2 == 0 else ("sampled", "greedy"):
                runs[name].append(timed_step(batches[name]))
        del batches
    ratio = paired_ratio(runs["greedy"], runs["sampled"])  # seconds per token each
    tps = {k: 1 / statistics.median(v) for k, v in runs.items()}
    alone = sampler_ms(args.batch, cfg.vocab_size)
    result = {"model": cfg.name, "vocab": cfg.vocab_size, "device": args.device,
              "batch": args.batch, "prompt": args.prompt, "steps": args.steps,
              "threads": args.threads, "greedy_tokens_per_s": tps["greedy"],
              "sampled_tokens_per_s": tps["sampled"], "sampled_vs_greedy": ratio,
              "pairs": len(runs["greedy"]), "sampler_ms": alone}
    goals = Goals("sampling")
    goals.at_least("sampled (temperature 1, top_p 0.9) vs greedy decode tokens/s", ratio, GOAL,
                   measured=f"sampled {tps['sampled']:.1f} tok/s",
                   baseline=f"greedy {tps['greedy']:.1f} tok/s")
    if args.json:
        print(json.dumps({**result, **goals.to_dict()}))
    else:
        print(f"{cfg.name} (vocab {cfg.vocab_size}), batch {args.batch}, {args.steps} step "
              f"pairs x {len(runs['greedy']) // args.steps} after a {args.prompt}-token prompt, "
              f"{args.device}, {args.threads} thread(s); medians of paired steps")
        print("the sampler alone, ms per step: " + ", ".join(
            f"{k} {v:.1f}" for k, v in alone.items()))
        goals.print()
    return goals.exit_status(args)


def add_command(bench) -> None:
    """``pdkv bench sampling``: its arguments (registered in pyproject.toml)."""
    p = bench.add_parser("sampling", help="decode tokens/s sampled (T=1, top_p 0.9) vs greedy",
                         description=__doc__.split("\n\n")[1], epilog=EPILOG)
    add_bench_flags(p, quick="4 layers, batch 16, 4 steps, 2 repeats", repeats="3")
    p.add_argument("--checkpoint", default="", help="a checkpoint directory (a real model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=64, help="requests decoding together")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per run")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.set_defaults(func=main)


if __name__ == "__main__":
    sys.exit(run_as_script(add_command))
