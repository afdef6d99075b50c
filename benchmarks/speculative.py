"""Speculative decoding and prefix reuse, each against its baseline in the same run.

    python -m benchmarks.speculative [--config tiny] [--k 2] [--quick] [--json]

- decode: tokens/s of a continuous batch (``--batch`` sequences, ``--gen`` tokens each)
  with ``greedy_step`` and with ``SpeculativeStep(k)`` on the same prompts; acceptance
  rate, mean accepted length (tokens per sequence-step) and token agreement between the
  two (exact at float64; at float32 batch shapes may flip near-ties);
- ttft: time to first token of a follow-up turn whose prompt shares a ``--prefix``-token
  prefix with the first turn, prefilled from scratch against loading the prefix from the
  prefill's host tier (``prefill_node.prefix_reuse``) and computing only the rest.

Medians of ``--repeat`` runs (a shared 2-core machine inflates single runs).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from common import KvCache
from common.host import HostTier, Offloader
from common.model import BatchItem, Model, ModelRunner, get_config
from common.node import PrefixReuse
from common.request import Request, SamplingParams
from decode_node.batch import DecodeBatch, StepFn, greedy_step
from decode_node.speculative import SpeculativeStep
from prefill_node.engine import PrefillEngine


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _prompts(cfg, num: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (length,), generator=gen).tolist()
            for _ in range(num)]


def _decode_once(model: Model, prompts: list[list[int]], gen: int, step: StepFn,
                 page_size: int, draft: Model | None = None) -> tuple[float, list[list[int]]]:
    """Prefill (untimed), then decode every prompt to ``gen`` tokens; (seconds, outputs).

    ``draft``: a separate draft model; without one the model's own draft layers (if any)."""
    total = sum(len(p) + gen + 8 for p in prompts)
    layout = model.config.kv_layout(with_draft=True)
    if draft is not None:
        layout = replace(model.config.kv_layout(False), num_draft_layers=draft.config.num_layers)
    cache = KvCache(total // page_size + len(prompts) + 2, page_size, layout=layout,
                    device=model.device)
    runner = ModelRunner(model, cache, draft)
    batch = DecodeBatch(runner, step)
    seqs = []
    for i, p in enumerate(prompts):
        kv = cache.open_row(f"r{i}")
        cache.extend(kv, len(p))
        first = int(runner.forward([BatchItem(kv, p, 0)])[0].argmax())
        if layout.num_draft_layers:
            runner.forward([BatchItem(kv, p, 0)], draft=True)
        cache.commit(kv, len(p))
        seqs.append(Request(f"r{i}", p, SamplingParams(max_new_tokens=gen), kv=kv,
                            output=[first], num_computed=len(p)))
        batch.add(seqs[-1])
    _sync(model)
    t0 = time.perf_counter()
    while len(batch):
        batch.step()
    _sync(model)
    return time.perf_counter() - t0, [s.output for s in seqs]


def bench_decode(model: Model, args: argparse.Namespace) -> dict:
    prompts = _prompts(model.config, args.batch, args.context, seed=1)
    new_tokens = args.batch * (args.gen - 1)  # the first token of each comes from prefill
    base, spec, stats = [], [], None
    _decode_once(model, prompts[:1], 4, greedy_step, args.page_size)  # warm-up
    for _ in range(args.repeat):
        t, want = _decode_once(model, prompts, args.gen, greedy_step, args.page_size)
        base.append(t)
        step = SpeculativeStep(args.k)
        t, got = _decode_once(model, prompts, args.gen, step, args.page_size)
        spec.append(t)
        stats = step.stats
    agree = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g)) / sum(map(len, want))
    base_tps, spec_tps = new_tokens / _median(base), new_tokens / _median(spec)
    return {"k": args.k, "batch": args.batch, "context": args.context, "gen": args.gen,
            "baseline_tokens_per_s": base_tps, "speculative_tokens_per_s": spec_tps,
            "speedup": spec_tps / base_tps, "acceptance_rate": stats.acceptance_rate,
            "baseline_s": sorted(base), "speculative_s": sorted(spec),
            "speedup_per_repeat": sorted(b / t for b, t in zip(base, spec)),
            "mean_accepted_len": stats.mean_accepted_len, "token_agreement": agree}


def bench_ttft(model: Model, args: argparse.Namespace) -> dict:
    cfg, ps = model.config, args.page_size
    pages = (args.prefix + args.suffix) * 2 // ps + 8
    cache = KvCache(pages, ps, layout=cfg.kv_layout(with_draft=True), device=model.device)
    host = HostTier(pages, ps, cfg.kv_layout(with_draft=True), device=model.device)
    reuse = PrefixReuse(Offloader(cache, host), cfg.name.encode())
    engine = PrefillEngine(ModelRunner(model, cache), args.chunk, args.chunk, with_draft=True)
    shared = _prompts(cfg, 1, args.prefix, seed=2)[0]
    first_turn = shared + _prompts(cfg, 1, args.suffix, seed=3)[0]
    _prefill(engine, reuse, "turn1", first_turn, use_reuse=False)
    assert reuse.offloader.wait(timeout=60)
    cold, warm = [], []
    for i in range(args.repeat):
        follow = shared + _prompts(cfg, 1, args.suffix, seed=10 + i)[0]
        cold.append(_prefill(engine, reuse, f"cold{i}", follow, use_reuse=False, store=False))
        warm.append(_prefill(engine, reuse, f"warm{i}", follow, use_reuse=True, store=False))
    reuse.offloader.close(timeout=60)
    return {"prefix": args.prefix, "suffix": args.suffix, "chunk": args.chunk,
            "ttft_full_s": _median(cold), "ttft_prefix_reuse_s": _median(warm),
            "speedup": _median(cold) / _median(warm),
            "ttft_full_all_s": sorted(cold), "ttft_prefix_reuse_all_s": sorted(warm),
            "prefix_hit_pages": reuse.num_hit_pages}


def _prefill(engine: PrefillEngine, reuse: PrefixReuse, rid: str, tokens: list[int], *,
             use_reuse: bool, store: bool = True) -> float:
    """TTFT of one request: admission (and prefix load) to its first token, seconds."""
    cache = engine.cache
    _sync(engine.runner.model)
    t0 = time.perf_counter()
    kv = cache.open_row(rid)
    cache.extend(kv, len(tokens))
    start = reuse.load(kv, tokens, timeout=60) if use_reuse else 0
    engine.add(Request(rid, tokens, SamplingParams(), kv=kv, num_computed=start))
    while engine.has_work:
        engine.step()
    _sync(engine.runner.model)
    ttft = time.perf_counter() - t0
    if store:
        reuse.offload_sent(kv, tokens)
    cache.free_kv_row(kv, [(0, kv.allocated_len)], reason="finished")
    cache.close_row(kv)
    return ttft


def _sync(model: Model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny", help="model config (tiny, small, ...)")
    p.add_argument("--dtype", default=None, help="override the config's dtype")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--k", type=int, default=2, help="draft tokens per step")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--suffix", type=int, default=64)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes, 1 repeat")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.context, args.gen, args.repeat = 4, 32, 24, 1
        args.prefix, args.suffix = 512, 32
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {"dtype": args.dtype} if args.dtype else {}
    model = Model(get_config(args.config, **overrides), args.device)
    result = {"config": args.config, "dtype": model.config.dtype, "device": args.device,
              "decode": bench_decode(model, args), "ttft": bench_ttft(model, args)}
    if args.json:
        print(json.dumps(result))
    else:
        d, t = result["decode"], result["ttft"]
        print(f"decode {args.config} k={d['k']} batch={d['batch']}: "
              f"{d['baseline_tokens_per_s']:.0f} -> {d['speculative_tokens_per_s']:.0f} "
              f"tokens/s ({d['speedup']:.2f}x), acceptance {d['acceptance_rate']:.2f}, "
              f"mean accepted len {d['mean_accepted_len']:.2f}, agreement "
              f"{d['token_agreement']:.3f}")
        print(f"ttft prefix={t['prefix']} suffix={t['suffix']}: {t['ttft_full_s'] * 1e3:.1f} "
              f"-> {t['ttft_prefix_reuse_s'] * 1e3:.1f} ms ({t['speedup']:.2f}x)")
    return result


if __name__ == "__main__":
    main()
