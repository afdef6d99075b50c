"""Speculative decoding and prefix reuse, each against its baseline in the same run.

    python -m benchmarks.speculative [--model tiny] [--k 2] [--quick] [--json]
    python -m benchmarks.speculative --model DIR [--kinds ngram layers] [--draft-layers 8]

- decode (a built-in model): tokens/s of a continuous batch (``--batch`` random prompts,
  ``--gen`` tokens each) with ``greedy_step`` and with ``SpeculativeStep(k)`` (the model's
  own first layers as the draft) on the same prompts; acceptance rate, mean accepted
  length (tokens per sequence-step) and token agreement between the two (exact at
  float64; at float32 batch shapes may flip near-ties). The built-in models' weights are
  drawn so that their first layers agree with the whole model (``common.model.seeded``):
  these figures measure the machinery, not what a draft achieves on a trained model;
- decode on real text (a checkpoint directory with a tokenizer): the workloads of
  ``benchmarks.spec_texts`` (editing, quoting, code, summaries; each a batch of its
  prompts, generated to ``--gen`` tokens or the checkpoint's eos) decoded plainly and with
  each speculation kind of ``--kinds``, interleaved per repeat: ``ngram`` (prompt lookup,
  ``--spec-ngram`` tokens), ``layers`` (the checkpoint's first ``--draft-layers`` blocks as
  the draft, ``benchmarks.layer_draft``: the built-in models' kind on a trained model),
  ``draft`` (``--draft-model DIR``). Per kind and workload: tokens/s of both, the
  speed-up, acceptance, mean accepted length, and whether every output equals plain
  greedy's;
- ttft: time to first token of a follow-up turn whose prompt shares a ``--prefix``-token
  prefix with the first turn, prefilled from scratch against loading the prefix from the
  prefill's host tier (``prefill_node.prefix_reuse``) and computing only the rest.

Medians of ``--repeat`` runs (a shared 2-core machine inflates single runs).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.layer_draft import write_layer_draft
from benchmarks.spec_texts import encode_workloads
from common import KvCache
from common.config import resolve_model
from common.host import HostTier, Offloader
from common.model import BatchItem, Model, ModelRunner, Tokenizer, get_config, load_config
from common.node import PrefillEngine, PrefixReuse
from common.request import Request, SamplingParams
from decode_node.batch import DecodeBatch, StepFn, greedy_step
from decode_node.ngram import NgramProposer
from decode_node.speculative import SpeculativeStep


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _prompts(cfg, num: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (length,), generator=gen).tolist()
            for _ in range(num)]


def _decode_once(model: Model, prompts: list[list[int]], gen: int, step: StepFn,
                 page_size: int, draft: Model | None = None, stop_ids: tuple[int, ...] = ()
                 ) -> tuple[float, list[list[int]]]:
    """Prefill (untimed), then decode every prompt to ``gen`` tokens or one of
    ``stop_ids``; (seconds, outputs).

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
        params = SamplingParams(max_new_tokens=gen, stop_token_ids=stop_ids)
        seqs.append(Request(f"r{i}", p, params, kv=kv, output=[first], num_computed=len(p)))
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


def real_text_kinds(model: Model, args: argparse.Namespace, tmp: Path
                    ) -> dict[str, tuple[Model | None, Callable[[], SpeculativeStep]]]:
    """The speculation kinds of ``--kinds`` on checkpoint ``model``: name -> (draft model
    or None, a maker of a fresh ``SpeculativeStep``)."""
    kinds: dict[str, tuple[Model | None, Callable[[], SpeculativeStep]]] = {}
    dtype = model.config.dtype
    for kind in args.kinds:
        if kind == "ngram":
            n = args.spec_ngram
            kinds[f"ngram{n}"] = (None, lambda n=n: SpeculativeStep(args.k, NgramProposer(n)))
        elif kind == "layers":
            path = write_layer_draft(model.config.path, args.draft_layers,
                                     tmp / f"first{args.draft_layers}")
            kinds[f"layers{args.draft_layers}"] = (Model(load_config(path, dtype), args.device),
                                                   lambda: SpeculativeStep(args.k))
        elif kind == "draft":
            if not args.draft_model:
                raise SystemExit("--kinds draft needs --draft-model DIR")
            kinds["draft"] = (Model(load_config(args.draft_model, dtype), args.device),
                              lambda: SpeculativeStep(args.k))
    return kinds


def bench_real_text(model: Model, args: argparse.Namespace) -> dict:
    """Plain greedy against each kind on every ``spec_texts`` workload, interleaved per
    repeat; per kind an ``all`` row over every workload's tokens and seconds."""
    tok = Tokenizer.from_dir(model.config.path)
    workloads = encode_workloads(tok)
    stop = tuple(tok.eos_token_ids)
    with tempfile.TemporaryDirectory(prefix="pdkv-spec-") as tmp:
        kinds = real_text_kinds(model, args, Path(tmp))
        _decode_once(model, workloads["edit"][:1], 4, greedy_step, args.page_size)  # warm-up
        rows: dict[str, dict[str, dict]] = {kind: {} for kind in kinds}
        for name, prompts in workloads.items():
            times: dict[str, list[float]] = {"plain": [], **{k: [] for k in kinds}}
            for _ in range(args.repeat):
                t, want = _decode_once(model, prompts, args.gen, greedy_step, args.page_size,
                                       stop_ids=stop)
                times["plain"].append(t)
                for kind, (draft, make) in kinds.items():
                    step = make()
                    t, got = _decode_once(model, prompts, args.gen, step, args.page_size,
                                          draft, stop)
                    times[kind].append(t)
                    rows[kind][name] = _row(want, got, times["plain"], times[kind], step.stats)
        for kind in kinds:
            rows[kind]["all"] = _all_row(rows[kind])
    return {"k": args.k, "gen": args.gen, "repeat": args.repeat, "dtype": model.config.dtype,
            "workloads": {n: [len(p) for p in ps] for n, ps in workloads.items()},
            "kinds": rows}


def _row(want: list[list[int]], got: list[list[int]], plain: list[float],
         spec: list[float], stats) -> dict:
    tokens = sum(len(o) - 1 for o in want)  # the first token of each comes from prefill
    agree = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g))
    return {"tokens": tokens, "plain_s": _median(plain), "spec_s": _median(spec),
            "plain_tokens_per_s": tokens / _median(plain),
            "spec_tokens_per_s": tokens / _median(spec),
            "speedup": _median(plain) / _median(spec),
            "acceptance_rate": stats.acceptance_rate,
            "mean_accepted_len": stats.mean_accepted_len,
            "proposed": stats.num_proposed, "accepted": stats.num_accepted,
            "identical": want == got, "token_agreement": agree / max(1, sum(map(len, want)))}


def _all_row(rows: dict[str, dict]) -> dict:
    tokens = sum(r["tokens"] for r in rows.values())
    plain_s, spec_s = sum(r["plain_s"] for r in rows.values()), sum(r["spec_s"] for r in
                                                                     rows.values())
    proposed, accepted = sum(r["proposed"] for r in rows.values()), sum(r["accepted"] for r
                                                                        in rows.values())
    return {"tokens": tokens, "plain_tokens_per_s": tokens / plain_s,
            "spec_tokens_per_s": tokens / spec_s, "speedup": plain_s / spec_s,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "identical": all(r["identical"] for r in rows.values())}


def format_real_text(result: dict) -> str:
    r = result["real_text"]
    lines = [f"speculation on real text: {result['model']} ({r['dtype']}), k={r['k']}, up to "
             f"{r['gen']} tokens, medians of {r['repeat']}; each kind against plain greedy "
             "in the same run",
             f"{'kind':<10} {'workload':<8} {'plain tok/s':>11} {'spec tok/s':>10} "
             f"{'speedup':>7} {'accept':>6} {'tok/step':>8}  identical"]
    for kind, rows in r["kinds"].items():
        for name, row in rows.items():
            mal = f"{row['mean_accepted_len']:8.2f}" if "mean_accepted_len" in row else " " * 8
            lines.append(f"{kind:<10} {name:<8} {row['plain_tokens_per_s']:11.1f} "
                         f"{row['spec_tokens_per_s']:10.1f} {row['speedup']:6.2f}x "
                         f"{row['acceptance_rate']:6.2f} {mal}  {row['identical']}")
    return "\n".join(lines)


def bench_ttft(model: Model, args: argparse.Namespace) -> dict:
    cfg, ps = model.config, args.page_size
    pages = (args.prefix + args.suffix) * 2 // ps + 8
    draft = cfg.num_draft_layers > 0  # a built-in's draft KV is prefilled too
    cache = KvCache(pages, ps, layout=cfg.kv_layout(with_draft=draft), device=model.device)
    host = HostTier(pages, ps, cfg.kv_layout(with_draft=draft), device=model.device)
    reuse = PrefixReuse(Offloader(cache, host), cfg.name.encode())
    engine = PrefillEngine(ModelRunner(model, cache), args.chunk, args.chunk, with_draft=draft)
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
    p.add_argument("--model", "--config", dest="model", default="tiny", metavar="NAME|DIR",
                   help="built-in model (tiny, small, ...) or a checkpoint directory")
    p.add_argument("--dtype", default=None, help="override the model's dtype")
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
    g = p.add_argument_group("a checkpoint directory (real text)")
    g.add_argument("--kinds", nargs="+", choices=["ngram", "layers", "draft"],
                   default=["ngram", "layers"], help="speculation kinds to measure "
                   "(default: ngram layers)")
    g.add_argument("--spec-ngram", type=int, default=3, metavar="N",
                   help="n-gram lookup: longest tail matched (default 3)")
    g.add_argument("--draft-layers", type=int, default=8, metavar="N",
                   help="layer-skip draft: the checkpoint's first N blocks (default 8)")
    g.add_argument("--draft-model", metavar="DIR", help="--kinds draft: the draft checkpoint")
    g.add_argument("--no-ttft", action="store_true", help="skip the prefix-reuse TTFT figure")
    p.add_argument("--quick", action="store_true", help="small sizes, 1 repeat")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.context, args.gen, args.repeat = 4, 32, 24, 1
        args.prefix, args.suffix = 512, 32
    if args.threads:
        torch.set_num_threads(args.threads)
    fields = resolve_model(args.model)
    dtype = {"dtype": args.dtype} if args.dtype else {}
    cfg = load_config(fields["model_path"], **dtype) if fields["model_path"] else \
        get_config(args.model, **dtype)
    model = Model(cfg, args.device)
    result = {"model": cfg.name if cfg.path else args.model, "dtype": cfg.dtype,
              "device": args.device}
    if cfg.path:
        result["real_text"] = bench_real_text(model, args)
    else:
        result["decode"] = bench_decode(model, args)
    if not args.no_ttft:
        result["ttft"] = bench_ttft(model, args)
    if args.json:
        print(json.dumps(result))
        return result
    if cfg.path:
        print(format_real_text(result))
    else:
        d = result["decode"]
        print(f"decode {args.model} k={d['k']} batch={d['batch']} (seeded weights, built so "
              f"that the draft layers agree): {d['baseline_tokens_per_s']:.0f} -> "
              f"{d['speculative_tokens_per_s']:.0f} tokens/s ({d['speedup']:.2f}x), "
              f"acceptance {d['acceptance_rate']:.2f}, mean accepted len "
              f"{d['mean_accepted_len']:.2f}, agreement {d['token_agreement']:.3f}")
    if "ttft" in result:
        t = result["ttft"]
        print(f"ttft prefix={t['prefix']} suffix={t['suffix']}: {t['ttft_full_s'] * 1e3:.1f} "
              f"-> {t['ttft_prefix_reuse_s'] * 1e3:.1f} ms ({t['speedup']:.2f}x)")
    return result


if __name__ == "__main__":
    main()
