"""Model runner speed and draft quality, each against a baseline in the same run.

    python -m benchmarks.model [--config tiny] [--device cpu] [--threads 2] [--json]

- prefill: tokens/s of a one-shot paged prefill, against ``Model.forward_dense`` (no cache)
  on the same tokens;
- decode: latency of one batched step at batch 1 and 8 (context ``--context`` tokens
  each), against 8 batch-1 steps run one after another; the draft's step too;
- draft: greedy agreement of the draft with the target along target-generated text
  (the per-token acceptance probability of greedy speculative decoding).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from common import KvCache
from common.model import BatchItem, Model, ModelRunner, get_config


def _time(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Median seconds of fn over `repeat` runs, after one warm-up.

    On a shared 2-core machine other processes inflate single runs by 10x; the median
    of many runs is the figure to quote, and ``--threads 1`` is steadier under load.
    """
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _rows(runner: ModelRunner, num: int, context: int, gen: torch.Generator) -> list:
    """`num` rows prefilled with `context` random tokens, one slot of room each."""
    vocab = runner.model.config.vocab_size
    rows = []
    for i in range(num):
        kv = runner.cache.open_row(f"r{i}")
        runner.cache.extend(kv, context + 1)
        ids = torch.randint(0, vocab, (context,), generator=gen)
        runner.forward([BatchItem(kv, ids, 0)])
        runner.forward([BatchItem(kv, ids, 0)], draft=True)
        rows.append(kv)
    return rows


def bench_prefill(model: Model, cache: KvCache, length: int, repeat: int) -> dict:
    runner = ModelRunner(model, cache)
    kv = cache.open_row("prefill")
    cache.extend(kv, length)
    ids = torch.randint(0, model.config.vocab_size, (length,))
    paged = _time(lambda: runner.forward([BatchItem(kv, ids, 0)]), model.device, repeat)
    dense = _time(lambda: model.forward_dense(ids), model.device, repeat)
    return {"prefill_tokens": length, "paged_tokens_per_s": length / paged,
            "dense_tokens_per_s": length / dense}


def bench_decode(model: Model, cache: KvCache, context: int, repeat: int) -> dict:
    runner = ModelRunner(model, cache)
    rows = _rows(runner, 8, context, torch.Generator().manual_seed(0))

    def step(kvs: list, draft: bool = False) -> None:
        runner.forward([BatchItem(kv, [1], context) for kv in kvs], draft=draft)

    out = {"context": context}
    out["step_ms_batch1"] = 1e3 * _time(lambda: step(rows[:1]), model.device, repeat)
    out["step_ms_batch8"] = 1e3 * _time(lambda: step(rows), model.device, repeat)
    out["step_ms_8x_batch1"] = 1e3 * _time(lambda: [step([kv]) for kv in rows], model.device,
                                           max(3, repeat // 2))
    if model.config.num_draft_layers:
        out["draft_step_ms_batch1"] = 1e3 * _time(lambda: step(rows[:1], True), model.device,
                                                  repeat)
        out["draft_step_ms_batch8"] = 1e3 * _time(lambda: step(rows, True), model.device,
                                                  repeat)
    return out


@torch.inference_mode()
def bench_draft(model: Model, num_seqs: int, prompt_len: int, gen_len: int) -> dict:
    """Agreement of draft and target argmax at target-generated positions."""
    if not model.config.num_draft_layers:
        return {}
    gen = torch.Generator().manual_seed(1)
    agree = total = 0
    for _ in range(num_seqs):
        seq = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=gen).tolist()
        for _ in range(gen_len):
            seq.append(int(model.forward_dense(seq)[-1].argmax()))
        target = model.forward_dense(seq).argmax(-1)[prompt_len - 1:-1]
        draft = model.forward_dense(seq, draft=True).argmax(-1)[prompt_len - 1:-1]
        agree += int((target == draft).sum())
        total += gen_len
    return {"draft_agreement": agree / total, "draft_positions": total}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--dtype", default=None, help="override the config's dtype")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--prefill", type=int, default=512, help="prefill length")
    p.add_argument("--context", type=int, default=256, help="decode context per request")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = get_config(args.config, **({"dtype": args.dtype} if args.dtype else {}))
    model = Model(cfg, args.device)
    page_size = 16
    pages = (args.prefill + 9 * (args.context + 1)) // page_size + 16
    cache = KvCache(pages, page_size, layout=cfg.kv_layout(True), device=args.device)
    result = {"config": cfg.name, "dtype": cfg.dtype, "device": args.device,
              "threads": args.threads,
              **bench_prefill(model, cache, args.prefill, max(3, args.repeat // 4)),
              **bench_decode(model, cache, args.context, args.repeat),
              **bench_draft(model, 4, 32, 48)}
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value:.4g}" if isinstance(value, float) else
                  f"{key:>24}: {value}")
    return result


if __name__ == "__main__":
    main()
